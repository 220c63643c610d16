//! A path whose route is slow, not dead (a gray link that ECMP hashes a
//! quarter of the source ports onto), moves to a new source port (PROTOCOL
//! §9.1): every message with a packet on it would otherwise wait for that
//! packet. On an even fabric no path moves for being slow.

mod common;

use common::*;
use metaroce_proto::verbs::*;
use metaroce_proto::{ConnectionStats, EndpointConfig};
use std::time::Duration;

/// The ports a gray spine carries: a quarter of them.
fn gray_port(port: u16) -> bool {
    port % 4 == 0
}

/// Runs `writes` 256 KiB WRITEs from A to B, four outstanding, each
/// checked in place; returns A's connection statistics after them.
fn stream(p: &mut Pair, writes: u64) -> ConnectionStats {
    let v = Verbs::setup(p);
    let len = 256 << 10;
    let data = pattern(5, len);
    let (src, dst) = write_regions(&mut p.a, v.pda, &mut p.b, v.pdb, &data);
    let (mut posted, mut done) = (0u64, 0u64);
    let deadline = p.now + Duration::from_secs(5);
    while done < writes {
        while posted < writes && posted - done < 4 {
            let now = p.now;
            p.a.post_send(now, v.qa, write_wr(posted, &src, &dst, 0, len as u32))
                .unwrap();
            posted += 1;
        }
        let wcs = wait_cq(p, true, v.cqa, 1, deadline.saturating_since(p.now));
        assert!(!wcs.is_empty(), "WRITE {done} did not complete in time");
        for wc in wcs {
            assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
            assert_eq!(wc.wr_id, done, "completions in order");
            done += 1;
        }
    }
    assert_eq!(p.b.mr(dst.lkey).unwrap(), &data[..], "every byte in place");
    p.a.connection_stats(p.conn_a.unwrap()).unwrap()
}

fn pair(seed: u64) -> Pair {
    let link = LinkConfig {
        delay: Duration::from_micros(50),
        bytes_per_us: 1250,
        ..LinkConfig::perfect()
    };
    let cfg = EndpointConfig::default();
    let mut p = Pair::new(cfg.clone(), cfg, seed, link);
    p.connect();
    p
}

#[test]
fn paths_on_a_gray_route_move_off_it() {
    for seed in [1, 2, 3] {
        let mut p = pair(seed);
        // 1.5 ms more on a gray port: 15 times the others' round trip.
        p.gray = Some((gray_port, Duration::from_micros(1500)));
        let s = stream(&mut p, 200);
        // A path on the gray route from the start, with no RTT of its own,
        // may be declared failed first (its packets overdue by the
        // connection's RTT, §13.3): it leaves the route all the same.
        let left: u64 = s.paths.iter().map(|p| p.slow_moves + p.failures).sum();
        assert!(left > 0, "seed {seed}: no path left the gray route: {s:?}");
        let gray: Vec<_> = s.paths.iter().filter(|p| gray_port(p.src_port)).collect();
        assert!(
            gray.is_empty(),
            "seed {seed}: paths still on the gray route: {gray:?}"
        );
    }
}

#[test]
fn an_even_fabric_moves_no_path_for_being_slow() {
    for seed in [1, 2, 3] {
        let mut p = pair(seed);
        let s = stream(&mut p, 200);
        let slow_moves: u64 = s.paths.iter().map(|p| p.slow_moves).sum();
        assert_eq!(slow_moves, 0, "seed {seed}: {s:?}");
    }
}

/// With 16 paths each carries few packets, and an ACK seldom echoes one
/// of a given path: the judgement goes by every ACK that covers the path
/// (how long its newest packet took), and the gray route's paths still
/// leave it, every byte in place, no slower than a sixth more than on an
/// even fabric.
#[test]
fn many_paths_leave_a_gray_route() {
    for seed in [1, 2, 3] {
        let cfg = EndpointConfig {
            paths: 16,
            ..EndpointConfig::default()
        };
        let link = LinkConfig {
            delay: Duration::from_micros(50),
            bytes_per_us: 1250,
            ..LinkConfig::perfect()
        };
        let mut even = Pair::new(cfg.clone(), cfg.clone(), seed, link);
        even.connect();
        let t0 = even.now;
        stream(&mut even, 200);
        let even_time = even.now.saturating_since(t0);
        let mut p = Pair::new(cfg.clone(), cfg, seed, link);
        p.connect();
        p.gray = Some((gray_port, Duration::from_micros(1500)));
        let t0 = p.now;
        let s = stream(&mut p, 200);
        let gray_time = p.now.saturating_since(t0);
        let slow_moves: u64 = s.paths.iter().map(|p| p.slow_moves).sum();
        assert!(slow_moves > 0, "seed {seed}: {s:?}");
        let gray: Vec<_> = s.paths.iter().filter(|p| gray_port(p.src_port)).collect();
        assert!(gray.is_empty(), "seed {seed}: still gray: {gray:?}");
        assert!(
            gray_time < even_time * 7 / 6 + Duration::from_millis(3),
            "seed {seed}: {gray_time:?} against {even_time:?}"
        );
    }
}
