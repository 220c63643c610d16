//! A flood of spoofed HELLOs (PROTOCOL §18, §20): one million, from random
//! source addresses and ports, without a cookie, with a forged one, with a
//! genuine cookie replayed from another address, and of another version.
//! The endpoint must keep its memory flat (measured by a counting allocator:
//! the heap of the test's thread, where the endpoint lives), send no more
//! bytes than it received (no amplification), create no connection, and
//! still take a genuine client once the flood is over.
//!
//! `METAROCE_FLOOD_HELLOS=<n>` changes the count (default 1,000,000).

use metaroce_proto::consts::{HELLO_LEN, VERSION};
use metaroce_proto::{Ecn, Endpoint, EndpointConfig, Event, Instant};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

#[path = "common/heap.rs"]
mod heap;
use heap::live_heap;

/// xorshift64*: the flood's addresses and ids (seeded, so a run replays).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

const SERVER: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1)), 4792);
const CLIENT: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 0, 0, 2)), 4792);
/// Growth of the server's heap over the flood, at most.
const MAX_GROWTH: isize = 1 << 20;

/// Everything `ep` has to send now: (destination, bytes) of each datagram.
fn drain(ep: &mut Endpoint, now: Instant, buf: &mut [u8]) -> Vec<(SocketAddr, Vec<u8>)> {
    let mut out = Vec::new();
    while let Some(t) = ep.poll_transmit(now, buf) {
        out.push((t.dst, buf[..t.size].to_vec()));
    }
    out
}

fn hellos() -> u64 {
    std::env::var("METAROCE_FLOOD_HELLOS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000_000)
}

#[test]
fn a_million_spoofed_hellos_leave_memory_flat_and_amplify_nothing() {
    let mut buf = vec![0u8; 9_000];
    let mut now = Instant::from_nanos(1_000_000_000);
    let config = EndpointConfig::default();
    let (rate, burst) = (config.stateless_rate, config.stateless_burst);
    let mut server = Endpoint::new(config.clone(), 1).unwrap();
    let mut client = Endpoint::new(config, 2).unwrap();
    server.set_local_ip(Some(SERVER.ip()));
    client.set_local_ip(Some(CLIENT.ip()));

    // Templates, from a real client: its HELLO, and its HELLO with the
    // cookie the server gave it (genuine, but only for its own address).
    client.connect(now, SERVER).unwrap();
    let hello = drain(&mut client, now, &mut buf).remove(0).1;
    assert_eq!(hello.len(), HELLO_LEN);
    server.handle_datagram(now, CLIENT, Ecn::NotEct, &hello);
    let cookie = drain(&mut server, now, &mut buf).remove(0).1;
    client.handle_datagram(now, SERVER, Ecn::NotEct, &cookie);
    let with_cookie = drain(&mut client, now, &mut buf).remove(0).1;
    assert_ne!(with_cookie, hello);
    let before = server.stats();

    let n = hellos();
    let mut rng = Rng(0x5eed_f100d);
    let heap0 = live_heap();
    let mut peak = 0isize;
    let mut sent = 0u64;
    let mut pkt = [0u8; HELLO_LEN];
    for i in 0..n {
        // 1,000,000 HELLOs a second.
        now = now + Duration::from_micros(1);
        let r = rng.next();
        let from = SocketAddr::new(
            IpAddr::V4(Ipv4Addr::from((r >> 32) as u32)),
            (r as u16).max(1),
        );
        match i % 4 {
            0 => pkt.copy_from_slice(&hello),
            1 => {
                // A cookie of random bytes.
                pkt.copy_from_slice(&with_cookie);
                pkt[20..36].copy_from_slice(
                    &[rng.next().to_be_bytes(), rng.next().to_be_bytes()].concat(),
                );
            }
            2 => pkt.copy_from_slice(&with_cookie),
            _ => {
                pkt.copy_from_slice(&hello);
                pkt[0] = VERSION + 1 + (r >> 8) as u8 % 8;
            }
        }
        // A fresh client id, and a listen port of its own (where a COOKIE
        // would go: the reflection target).
        pkt[8..12].copy_from_slice(&((r >> 16) as u32 | 1).to_be_bytes());
        pkt[12..14].copy_from_slice(&((r >> 48) as u16).max(1).to_be_bytes());
        server.handle_datagram(now, from, Ecn::NotEct, &pkt);
        while let Some(t) = server.poll_transmit(now, &mut buf) {
            assert!(t.size <= HELLO_LEN, "a reply larger than its request");
            sent += t.size as u64;
        }
        if i % 1024 == 0 {
            server.handle_timeout(now);
            peak = peak.max(live_heap() - heap0);
        }
    }
    let growth = live_heap() - heap0;
    peak = peak.max(growth);
    let s = server.stats();
    let received = s.bytes_received - before.bytes_received;
    let replies = s.datagrams_sent - before.datagrams_sent;
    let secs = n as f64 / 1e6;
    eprintln!(
        "{n} spoofed HELLOs in {secs} s: heap growth {growth} B (peak {peak} B), \
         {received} B received, {sent} B sent in {replies} replies, {} cookies, \
         {} rate-limited, {} bad cookies, {} bad versions",
        s.cookies_sent - before.cookies_sent,
        s.rejects.rate_limited,
        s.rejects.bad_cookie - before.rejects.bad_cookie,
        s.rejects.bad_version,
    );
    assert!(peak < MAX_GROWTH, "heap grew by {peak} B");
    assert_eq!(sent, s.bytes_sent - before.bytes_sent);
    assert!(sent <= received, "{sent} B sent for {received} B received");
    // The rate holds: a burst, then `rate` a second.
    let allowed = u64::from(burst) + (secs * f64::from(rate)).ceil() as u64;
    assert!(replies <= allowed, "{replies} replies, {allowed} allowed");
    assert!(replies >= allowed.min(n) * 9 / 10, "{replies} replies");
    assert!(s.rejects.rate_limited >= n - allowed);
    let bad_cookies = s.rejects.bad_cookie - before.rejects.bad_cookie;
    assert_eq!(
        bad_cookies,
        n / 4 + (n + 1) / 4,
        "forged and replayed cookies"
    );
    assert_eq!(
        server.connections().count(),
        0,
        "a spoofed HELLO made a connection"
    );

    // Once the flood is over, the genuine client gets in.
    now = now + Duration::from_millis(1);
    server.handle_datagram(now, CLIENT, Ecn::NotEct, &hello);
    let cookie = drain(&mut server, now, &mut buf).remove(0).1;
    client.handle_datagram(now, SERVER, Ecn::NotEct, &cookie);
    let with_cookie = drain(&mut client, now, &mut buf).remove(0).1;
    server.handle_datagram(now, CLIENT, Ecn::NotEct, &with_cookie);
    for (_, d) in drain(&mut server, now, &mut buf) {
        client.handle_datagram(now, SERVER, Ecn::NotEct, &d);
    }
    let mut connected = false;
    while let Some(e) = client.poll_event() {
        connected |= matches!(e, Event::Connected(_));
    }
    assert!(connected, "the genuine client is in");
    assert_eq!(server.connections().count(), 1);
}
