//! A path whose route is dead from the start (it never delivers, so it
//! never has an RTT of its own) is still declared failed and moved to a new
//! source port, and the transfer loses nothing.

mod common;

use common::OneWrite;
use metaroce_proto::verbs::WorkCompletion;
use std::net::SocketAddr;
use std::time::Duration;

#[test]
fn a_path_dead_from_the_start_fails_and_moves() {
    const LEN: usize = 4 << 20;
    let data: Vec<u8> = (0..LEN).map(|i| (i * 7 + i / 4096) as u8).collect();
    let mut w = OneWrite::new(data, (11, 12));
    // From here on, nothing from path 0's source port gets through.
    let dead = w.a.connection_stats(w.ca).unwrap().paths[0].src_port;
    let (wcs, dropped) = run(&mut w, Duration::from_secs(2), |port| port != dead);
    w.check_done(&wcs);
    let s = w.a.connection_stats(w.ca).unwrap();
    assert!(dropped > 0, "the dead path was tried");
    assert!(
        s.path_failures > 0,
        "the dead path was declared failed: {s:?}"
    );
    assert!(
        s.paths.iter().all(|p| p.src_port != dead),
        "no path uses the dead port any more: {s:?}"
    );
}

/// Half the paths' routes die for good, every new port they move to as
/// well (as when a plane stays down): those paths keep probing, their
/// windows still counted in the connection's, and the transfer completes
/// over the other half, every byte in place.
#[test]
fn half_the_paths_dead_for_good_the_write_completes() {
    const LEN: usize = 8 << 20;
    let data: Vec<u8> = (0..LEN).map(|i| (i * 13 + i / 4096) as u8).collect();
    let mut w = OneWrite::new(data, (21, 22));
    let stats = w.a.connection_stats(w.ca).unwrap();
    let half = stats.paths.len() / 2;
    // Only the first half's original ports get through, ever.
    let alive: Vec<u16> = stats.paths[..half].iter().map(|p| p.src_port).collect();
    let (wcs, _) = run(&mut w, Duration::from_secs(5), |port| alive.contains(&port));
    let s = w.a.connection_stats(w.ca).unwrap();
    assert!(
        !wcs.is_empty(),
        "the WRITE did not complete in 5 s with half the paths dead: {s:?}"
    );
    w.check_done(&wcs);
    assert!(
        s.path_failures >= half as u64,
        "the dead paths failed: {s:?}"
    );
}

/// Runs `w`'s WRITE in 10 µs steps for at most `limit` of its time, A's
/// datagrams from a source port `passes` refuses dropped (B's all get
/// through). Returns A's completions (empty if the WRITE did not complete)
/// and how many datagrams were dropped.
fn run(
    w: &mut OneWrite,
    limit: Duration,
    passes: impl Fn(u16) -> bool,
) -> (Vec<WorkCompletion>, u64) {
    let mut buf = vec![0u8; 65_536];
    let mut wcs = Vec::new();
    let mut dropped = 0;
    let end = w.now + limit;
    while wcs.is_empty() && w.now < end {
        let now = w.now;
        while let Some(t) = w.a.poll_transmit(now, &mut buf) {
            if !passes(t.src_port) {
                dropped += 1;
                continue;
            }
            let from = SocketAddr::new(w.a_addr.ip(), t.src_port);
            let seg = t.segment_size.unwrap_or(t.size);
            for dg in buf[..t.size].chunks(seg) {
                w.b.handle_datagram(now, from, t.ecn, dg);
            }
        }
        while let Some(t) = w.b.poll_transmit(now, &mut buf) {
            w.a.handle_datagram(now, w.b_addr, t.ecn, &buf[..t.size]);
        }
        w.now = now + Duration::from_micros(10);
        w.run_timers();
        w.a.poll_cq(w.cqa, 4, &mut wcs).unwrap();
    }
    (wcs, dropped)
}
