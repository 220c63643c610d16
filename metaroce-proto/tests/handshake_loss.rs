//! Handshake datagrams lost on the way. Every HELLO round goes three
//! times, each HELLO from a new source port (a new ECMP route), and the
//! server answers each with two COOKIEs or two ACCEPTs from ports that
//! follow the HELLO's, so any two lost datagrams cost no timeout; the HELLO
//! that carries the cookie is retried on an RTO from the HELLO/COOKIE round
//! trip, not on the backoff that the HELLOs lost before it built up
//! (PROTOCOL §8.2).

use metaroce_proto::wire::PacketType;
use metaroce_proto::{Ecn, Endpoint, EndpointConfig, Event, Instant, Transmit};
use std::collections::HashSet;
use std::net::SocketAddr;
use std::time::Duration;

/// Every datagram `ep` has to send at `now`, with its bytes.
fn drain(ep: &mut Endpoint, now: Instant) -> Vec<(Transmit, Vec<u8>)> {
    let mut buf = vec![0u8; 65_536];
    let mut out = Vec::new();
    while let Some(t) = ep.poll_transmit(now, &mut buf) {
        out.push((t, buf[..t.size].to_vec()));
    }
    out
}

/// The HELLOs `a` sends at its next timer, and when.
fn timer_round(a: &mut Endpoint) -> (Instant, Vec<(Transmit, Vec<u8>)>) {
    let at = a.poll_timeout().expect("a HELLO timer");
    a.handle_timeout(at);
    let out = drain(a, at);
    assert!(out.iter().all(|(_, b)| b[1] == PacketType::Hello as u8));
    (at, out)
}

#[test]
fn hello_retries_take_new_routes_and_the_cookies_round_trip() {
    let config = EndpointConfig::default();
    let (rto, min_rto) = (config.handshake_rto, config.min_rto);
    let a_addr: SocketAddr = format!("10.0.0.1:{}", config.listen_port).parse().unwrap();
    let b_addr: SocketAddr = format!("10.0.0.2:{}", config.listen_port).parse().unwrap();
    let mut a = Endpoint::new(config.clone(), 1).unwrap();
    let mut b = Endpoint::new(config.clone(), 2).unwrap();
    let from_a = |t: &Transmit| SocketAddr::new(a_addr.ip(), t.src_port);
    let t0 = Instant::from_nanos(1_000_000);
    let conn = a.connect(t0, b_addr).unwrap();
    let mut ports = HashSet::new();
    // The first round: three HELLOs, all lost.
    let first = drain(&mut a, t0);
    assert_eq!(first.len(), 3, "the first round goes three times");
    ports.extend(first.iter().map(|(t, _)| t.src_port));
    // The timer's round: three HELLOs from new ports; all lost.
    let (t1, round) = timer_round(&mut a);
    assert_eq!(t1, t0 + rto);
    assert_eq!(round.len(), 3, "a timer's round goes three times");
    ports.extend(round.iter().map(|(t, _)| t.src_port));
    // The next round, after twice the interval: these reach the server,
    // which answers each from a port that follows the HELLO's.
    let (t2, round) = timer_round(&mut a);
    assert_eq!(t2 - t1, 2 * rto);
    assert_eq!(round.len(), 3);
    ports.extend(round.iter().map(|(t, _)| t.src_port));
    assert_eq!(ports.len(), 9, "every HELLO from its own port: {ports:?}");
    let mut cookies = Vec::new();
    for (t, bytes) in &round {
        b.handle_datagram(t2, from_a(t), Ecn::NotEct, bytes);
        cookies.extend(drain(&mut b, t2));
    }
    // Two for each HELLO, from two ports.
    assert_eq!(cookies.len(), 6);
    assert!(cookies
        .iter()
        .all(|(_, b)| b[1] == PacketType::Cookie as u8));
    for pair in cookies.chunks(2) {
        assert_ne!(pair[0].0.src_port, pair[1].0.src_port);
    }
    assert!(cookies
        .iter()
        .all(|(t, _)| config.source_ports.contains(&t.src_port)));
    // The first COOKIE comes back 100 µs after the HELLOs went; the copies
    // (the same cookie) are duplicates.
    let t3 = t2 + Duration::from_micros(100);
    for (_, bytes) in &cookies {
        a.handle_datagram(t3, b_addr, Ecn::NotEct, bytes);
    }
    // Three HELLOs with the cookie, at once (one round for all COOKIEs);
    // all lost.
    let answer = drain(&mut a, t3);
    assert_eq!(answer.len(), 3, "the cookie is answered by one round");
    assert!(answer.iter().all(|(_, b)| b[1] == PacketType::Hello as u8));
    assert_ne!(answer[0].0.src_port, answer[1].0.src_port);
    // The next round after the round trip's RTO (3 × 100 µs, at least the
    // minimum RTO), not after eight times `handshake_rto`; lost as well.
    let (t4, round) = timer_round(&mut a);
    assert_eq!(t4, t3 + min_rto.max(Duration::from_micros(300)));
    assert!(t4 - t3 < rto, "{:?}", t4 - t3);
    assert_eq!(round.len(), 3);
    // Then the backoff doubles from there; this round arrives.
    let (t5, round) = timer_round(&mut a);
    assert_eq!(t5 - t4, 2 * (t4 - t3));
    b.handle_datagram(t5, from_a(&round[1].0), Ecn::NotEct, &round[1].1);
    let accept = drain(&mut b, t5);
    assert_eq!(accept.len(), 2, "an ACCEPT goes twice");
    assert!(accept.iter().all(|(_, b)| b[1] == PacketType::Accept as u8));
    assert_ne!(accept[0].0.src_port, accept[1].0.src_port);
    a.handle_datagram(t5, b_addr, Ecn::NotEct, &accept[0].1);
    let mut connected = false;
    while let Some(e) = a.poll_event() {
        connected |= matches!(e, Event::Connected(c) if c == conn);
    }
    assert!(connected);
    // A repeated HELLO with the cookie gets the ACCEPT again, twice, from
    // other ports of the server's.
    b.handle_datagram(t5, from_a(&round[0].0), Ecn::NotEct, &round[0].1);
    let again = drain(&mut b, t5);
    assert_eq!(again.len(), 2);
    assert!(again.iter().all(|(_, b)| b[1] == PacketType::Accept as u8));
    assert!(again
        .iter()
        .all(|(t, _)| accept.iter().all(|(u, _)| u.src_port != t.src_port)));
}

/// Runs a handshake in which the `n`-th handshake datagram sent (either
/// way, counted from 0) is lost for every `n` in `lost`; every other one
/// arrives after `one_way`. Returns when the client is connected, or
/// `None` if that took a timer.
fn handshake_with_losses(lost: &[usize], one_way: Duration) -> Option<Instant> {
    let config = EndpointConfig::default();
    let a_addr: SocketAddr = format!("10.0.0.1:{}", config.listen_port).parse().unwrap();
    let b_addr: SocketAddr = format!("10.0.0.2:{}", config.listen_port).parse().unwrap();
    let mut a = Endpoint::new(config.clone(), 1).unwrap();
    let mut b = Endpoint::new(config, 2).unwrap();
    let t0 = Instant::from_nanos(1_000_000);
    let conn = a.connect(t0, b_addr).unwrap();
    // (arrival, to the server?, source, bytes)
    let mut wire: Vec<(Instant, bool, SocketAddr, Vec<u8>)> = Vec::new();
    let mut sent = 0;
    let mut send = |wire: &mut Vec<_>, now: Instant, to_b: bool, out: Vec<(Transmit, Vec<u8>)>| {
        for (t, bytes) in out {
            assert!(
                bytes[1] & 0xf0 == 0x10,
                "only handshake datagrams: {:#x}",
                bytes[1]
            );
            if !lost.contains(&sent) {
                let from = if to_b {
                    SocketAddr::new(a_addr.ip(), t.src_port)
                } else {
                    b_addr
                };
                wire.push((now + one_way, to_b, from, bytes));
            }
            sent += 1;
        }
    };
    send(&mut wire, t0, true, drain(&mut a, t0));
    let timer = a.poll_timeout().expect("a HELLO timer");
    while !wire.is_empty() {
        wire.sort_by_key(|w| w.0);
        let (at, to_b, from, bytes) = wire.remove(0);
        if at >= timer {
            return None;
        }
        if to_b {
            b.handle_datagram(at, from, Ecn::NotEct, &bytes);
            send(&mut wire, at, false, drain(&mut b, at));
        } else {
            a.handle_datagram(at, from, Ecn::NotEct, &bytes);
            send(&mut wire, at, true, drain(&mut a, at));
            while let Some(e) = a.poll_event() {
                if matches!(e, Event::Connected(c) if c == conn) {
                    return Some(at);
                }
            }
        }
    }
    None
}

/// Any two lost datagrams anywhere in the handshake cost no timeout: the
/// client is connected two round trips after it began, long before its
/// first HELLO timer. The three copies of a round all lost take the timer.
#[test]
fn two_losses_cost_no_timeout() {
    let one_way = Duration::from_micros(5);
    let t0 = Instant::from_nanos(1_000_000);
    let clean = handshake_with_losses(&[], one_way).expect("a lossless handshake");
    assert_eq!(clean, t0 + 4 * one_way);
    // Lossless, 18 datagrams go: HELLO ×3, COOKIE ×6 (two each), HELLO
    // with the cookie ×3 (for the first COOKIE; the others are
    // duplicates), ACCEPT ×6.
    for a in 0..18 {
        for b in a..18 {
            assert_eq!(
                handshake_with_losses(&[a, b], one_way),
                Some(clean),
                "datagrams {a} and {b} lost"
            );
        }
    }
    assert_eq!(handshake_with_losses(&[0, 1, 2], one_way), None);
}
