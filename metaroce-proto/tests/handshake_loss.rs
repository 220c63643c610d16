//! Handshake datagrams lost on the way. A HELLO round the timer starts
//! goes twice, each HELLO from a new source port (a new ECMP route), and
//! the server's COOKIE follows the HELLO's port; the HELLO that carries
//! the cookie is retried on an RTO from the HELLO/COOKIE round trip, not
//! on the backoff that the HELLOs lost before it built up (PROTOCOL §8.2).

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
    // HELLO 1 goes alone, and is lost.
    let first = drain(&mut a, t0);
    assert_eq!(first.len(), 1);
    ports.insert(first[0].0.src_port);
    // The timer's round: two HELLOs from two new ports; both lost.
    let (t1, round) = timer_round(&mut a);
    assert_eq!(t1, t0 + rto);
    assert_eq!(round.len(), 2, "a timer's round goes twice");
    ports.extend(round.iter().map(|(t, _)| t.src_port));
    // The next round, after twice the interval: these reach the server,
    // which answers each from a port that follows the HELLO's.
    let (t2, round) = timer_round(&mut a);
    assert_eq!(t2 - t1, 2 * rto);
    assert_eq!(round.len(), 2);
    ports.extend(round.iter().map(|(t, _)| t.src_port));
    assert_eq!(ports.len(), 5, "every HELLO from its own port: {ports:?}");
    let mut cookies = Vec::new();
    for (t, bytes) in &round {
        b.handle_datagram(t2, from_a(t), Ecn::NotEct, bytes);
        cookies.extend(drain(&mut b, t2));
    }
    assert_eq!(cookies.len(), 2);
    assert!(cookies
        .iter()
        .all(|(_, b)| b[1] == PacketType::Cookie as u8));
    assert_ne!(cookies[0].0.src_port, cookies[1].0.src_port);
    assert!(cookies
        .iter()
        .all(|(t, _)| config.source_ports.contains(&t.src_port)));
    // The first COOKIE comes back 100 µs after the HELLOs went; the copy
    // (the same cookie) is a duplicate.
    let t3 = t2 + Duration::from_micros(100);
    for (_, bytes) in &cookies {
        a.handle_datagram(t3, b_addr, Ecn::NotEct, bytes);
    }
    // One HELLO, with the cookie, at once; lost.
    let answer = drain(&mut a, t3);
    assert_eq!(answer.len(), 1, "the cookie is answered once");
    assert_eq!(answer[0].1[1], PacketType::Hello as u8);
    // The next round after the round trip's RTO (3 × 100 µs, at least the
    // minimum RTO), not after eight times `handshake_rto`; lost as well.
    let (t4, round) = timer_round(&mut a);
    assert_eq!(t4, t3 + min_rto.max(Duration::from_micros(300)));
    assert!(t4 - t3 < rto, "{:?}", t4 - t3);
    assert_eq!(round.len(), 2);
    // Then the backoff doubles from there; this round arrives.
    let (t5, round) = timer_round(&mut a);
    assert_eq!(t5 - t4, 2 * (t4 - t3));
    b.handle_datagram(t5, from_a(&round[1].0), Ecn::NotEct, &round[1].1);
    let accept = drain(&mut b, t5);
    assert_eq!(accept.len(), 1);
    assert_eq!(accept[0].1[1], PacketType::Accept as u8);
    a.handle_datagram(t5, b_addr, Ecn::NotEct, &accept[0].1);
    let mut connected = false;
    while let Some(e) = a.poll_event() {
        connected |= matches!(e, Event::Connected(c) if c == conn);
    }
    assert!(connected);
    // A repeated HELLO with the cookie gets the ACCEPT again, from another
    // of the server's ports.
    b.handle_datagram(t5, from_a(&round[0].0), Ecn::NotEct, &round[0].1);
    let again = drain(&mut b, t5);
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].1[1], PacketType::Accept as u8);
    assert_ne!(again[0].0.src_port, accept[0].0.src_port);
}
