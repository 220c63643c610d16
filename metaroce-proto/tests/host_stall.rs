//! A stall of the receiving host holds every path's packets at once (on
//! one machine they wait in one socket, for a thread that is off its
//! core). When it resumes it reads them in order and acknowledges them as
//! it goes: the first path acknowledged must not make all the others look
//! dead for the silence they shared. Timeouts that fire during the stall
//! send one packet per path again as a probe, not every path's window
//! (the ACKs show them all arrived); no path is declared failed and no
//! byte is lost.

mod common;

use common::OneWrite;
use metaroce_proto::Ecn;
use std::net::SocketAddr;
use std::time::Duration;

/// Datagrams of `a` waiting for `b`: from, ECN, bytes.
type Held = Vec<(SocketAddr, Ecn, Vec<u8>)>;

/// Everything `a` has to send now, into `held`.
fn hold_a(w: &mut OneWrite, buf: &mut [u8], held: &mut Held) {
    while let Some(t) = w.a.poll_transmit(w.now, buf) {
        let from = SocketAddr::new(w.a_addr.ip(), t.src_port);
        let seg = t.segment_size.unwrap_or(t.size);
        for dg in buf[..t.size].chunks(seg) {
            held.push((from, t.ecn, dg.to_vec()));
        }
    }
}

/// `b` reads `held` in order and acknowledges as it goes; `a` reads each
/// ACK at once.
fn deliver_to_b(w: &mut OneWrite, buf: &mut [u8], held: &mut Held) {
    for (from, ecn, dg) in held.drain(..) {
        w.b.handle_datagram(w.now, from, ecn, &dg);
        while let Some(t) = w.b.poll_transmit(w.now, buf) {
            w.a.handle_datagram(w.now, w.b_addr, t.ecn, &buf[..t.size]);
        }
    }
}

#[test]
fn a_stall_of_every_path_fails_none() {
    const LEN: usize = 8 << 20;
    let data: Vec<u8> = (0..LEN).map(|i| (i * 13 + i / 4096) as u8).collect();
    let mut w = OneWrite::new(data, (21, 22));
    let mut buf = vec![0u8; 65_536];
    let mut to_b = Held::new();
    let mut wcs = Vec::new();
    let end = w.now + Duration::from_secs(5);
    let mut failures_after_stall = None;
    while wcs.is_empty() && w.now < end {
        hold_a(&mut w, &mut buf, &mut to_b);
        let received = w.b.connection_stats(w.cb).unwrap().data_packets_received;
        if received > 300 && failures_after_stall.is_none() {
            // The receiver stalls for 10 ms (five minimum RTOs): what the
            // sender sends waits for it; the sender's timers run.
            let until = w.now + Duration::from_millis(10);
            while w.now < until {
                w.now = w.now + Duration::from_micros(100);
                let now = w.now;
                if w.a.poll_timeout().is_some_and(|t| t <= now) {
                    w.a.handle_timeout(now);
                }
                hold_a(&mut w, &mut buf, &mut to_b);
            }
            let before = w.a.connection_stats(w.ca).unwrap().path_failures;
            // Back on its core, the receiver reads what waited.
            deliver_to_b(&mut w, &mut buf, &mut to_b);
            let after = w.a.connection_stats(w.ca).unwrap().path_failures;
            failures_after_stall = Some(after - before);
        }
        deliver_to_b(&mut w, &mut buf, &mut to_b);
        w.now = w.now + Duration::from_micros(10);
        w.run_timers();
        w.a.poll_cq(w.cqa, 4, &mut wcs).unwrap();
    }
    let s = w.a.connection_stats(w.ca).unwrap();
    assert_eq!(
        failures_after_stall,
        Some(0),
        "paths declared failed as the held packets were acknowledged: {s:?}"
    );
    assert!(s.rto_fires > 0, "the stall outlasted the timeouts: {s:?}");
    // With every path silent a timeout sends one packet of its path again,
    // not the path's whole window: a few packets per path, not hundreds.
    assert!(
        s.packets_lost <= 4 * s.rto_fires * s.paths.len() as u64,
        "the stall's timeouts declared {} packets lost in {} fires: {s:?}",
        s.packets_lost,
        s.rto_fires
    );
    w.check_done(&wcs);
    assert_eq!(s.path_failures, 0, "no path failed at all: {s:?}");
}
