#![cfg(target_os = "linux")]
//! Memory per idle connection: opens many connections between two
//! endpoints over loopback and compares the process's resident set
//! (`/proc/self/statm`) before and after. Alone in its binary, so no other
//! test's allocations land in the measurement.

use metaroce_io::{Driver, DriverConfig};
use metaroce_proto::{EndpointConfig, Event};
use std::time::{Duration, Instant};

const N: usize = 4000;

/// Resident set size in bytes.
fn rss() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    pages * page as u64
}

#[test]
fn idle_connections_are_small() {
    let start = Instant::now();
    let mut cfg = DriverConfig::new("127.0.0.1:0".parse().unwrap());
    cfg.endpoint = EndpointConfig {
        max_connections: 2 * N,
        ..EndpointConfig::default()
    };
    let mut a = Driver::bind(cfg.clone()).unwrap();
    let mut b = Driver::bind(cfg).unwrap();
    let peer = b.local_addr();
    // Warm up: one connection, so that one-time allocations (tables, buffers)
    // are not counted against the others.
    let mut want = 1;
    let (mut up, mut incoming) = (0, 0);
    let run = |a: &mut Driver, b: &mut Driver, want: usize, up: &mut usize, inc: &mut usize| {
        while *up < want || *inc < want {
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "only {up}/{want} connected, {inc} incoming"
            );
            a.poll(Duration::ZERO).unwrap();
            b.poll(Duration::ZERO).unwrap();
            while let Some(e) = a.endpoint().poll_event() {
                match e {
                    Event::Connected(_) => *up += 1,
                    other => panic!("a: {other:?}"),
                }
            }
            while let Some(e) = b.endpoint().poll_event() {
                if matches!(e, Event::Incoming { .. }) {
                    *inc += 1;
                }
            }
        }
    };
    let now = a.now();
    a.endpoint().connect(now, peer).unwrap();
    run(&mut a, &mut b, want, &mut up, &mut incoming);
    let before = rss();
    want += N;
    for _ in 0..N {
        let now = a.now();
        a.endpoint().connect(now, peer).unwrap();
        // Handshake in batches, so the kernel's receive buffer never overflows.
        if a.endpoint().connections().count() % 256 == 0 {
            let target = a.endpoint().connections().count();
            run(&mut a, &mut b, target, &mut up, &mut incoming);
        }
    }
    run(&mut a, &mut b, want, &mut up, &mut incoming);
    // Idle for a while: whatever idle connections do (ACK timers, probes).
    let idle = Instant::now();
    while idle.elapsed() < Duration::from_millis(300) {
        a.poll(Duration::from_millis(1)).unwrap();
        b.poll(Duration::from_millis(1)).unwrap();
    }
    let after = rss();
    assert_eq!(a.endpoint().connections().count(), want);
    assert_eq!(b.endpoint().connections().count(), want);
    let grown = after.saturating_sub(before);
    // Each connection has state at both ends.
    let per_conn = grown as f64 / N as f64;
    println!(
        "{N} idle connections ({} backend): RSS {} -> {} KiB, {per_conn:.0} bytes per connection \
         ({:.0} per endpoint side), in {:?}",
        a.backend(),
        before >> 10,
        after >> 10,
        per_conn / 2.0,
        start.elapsed()
    );
    assert!(
        per_conn < 64.0 * 1024.0,
        "{per_conn:.0} bytes per idle connection (both ends)"
    );
}
