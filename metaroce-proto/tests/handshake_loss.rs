//! Handshake datagrams lost on the way: the HELLO that carries the cookie
//! is retried on an RTO from the HELLO/COOKIE round trip, not on the
//! backoff that the HELLOs lost before it built up.

use metaroce_proto::wire::PacketType;
use metaroce_proto::{Endpoint, EndpointConfig, Event, Instant};
use std::net::SocketAddr;
use std::time::Duration;

/// The next HELLO `a` sends, at its next timer; returns when it went.
fn next_hello(a: &mut Endpoint, buf: &mut [u8]) -> (Instant, usize) {
    let at = a.poll_timeout().expect("a HELLO timer");
    a.handle_timeout(at);
    let t = a.poll_transmit(at, buf).expect("a HELLO");
    assert_eq!(buf[1], PacketType::Hello as u8);
    (at, t.size)
}

#[test]
fn the_hello_with_the_cookie_retries_on_the_round_trip() {
    let config = EndpointConfig::default();
    let (rto, min_rto) = (config.handshake_rto, config.min_rto);
    let a_addr: SocketAddr = format!("10.0.0.1:{}", config.listen_port).parse().unwrap();
    let b_addr: SocketAddr = format!("10.0.0.2:{}", config.listen_port).parse().unwrap();
    let mut a = Endpoint::new(config.clone(), 1).unwrap();
    let mut b = Endpoint::new(config, 2).unwrap();
    let mut buf = vec![0u8; 65_536];
    let t0 = Instant::from_nanos(1_000_000);
    let conn = a.connect(t0, b_addr).unwrap();
    // HELLO 1 is lost; HELLO 2 goes after `handshake_rto`.
    a.poll_transmit(t0, &mut buf).unwrap();
    let (t1, n) = next_hello(&mut a, &mut buf);
    assert_eq!(t1, t0 + rto);
    // It reaches the server, whose COOKIE comes back 100 µs after it went.
    b.handle_datagram(t1, a_addr, metaroce_proto::Ecn::NotEct, &buf[..n]);
    let c = b.poll_transmit(t1, &mut buf).expect("a COOKIE");
    assert_eq!(buf[1], PacketType::Cookie as u8);
    let t2 = t1 + Duration::from_micros(100);
    a.handle_datagram(t2, b_addr, metaroce_proto::Ecn::NotEct, &buf[..c.size]);
    // HELLO 3, with the cookie, at once; lost.
    a.poll_transmit(t2, &mut buf)
        .expect("the HELLO with the cookie");
    assert_eq!(buf[1], PacketType::Hello as u8);
    // HELLO 4 after the round trip's RTO (3 × 100 µs, at least the minimum
    // RTO), not after four times `handshake_rto`; lost as well.
    let (t3, _) = next_hello(&mut a, &mut buf);
    assert_eq!(t3, t2 + min_rto.max(Duration::from_micros(300)));
    assert!(t3 - t2 < rto, "{:?}", t3 - t2);
    // Then the backoff doubles from there.
    let (t4, n) = next_hello(&mut a, &mut buf);
    assert_eq!(t4 - t3, 2 * (t3 - t2));
    // HELLO 5 arrives; the ACCEPT completes the handshake.
    b.handle_datagram(t4, a_addr, metaroce_proto::Ecn::NotEct, &buf[..n]);
    let acc = b.poll_transmit(t4, &mut buf).expect("an ACCEPT");
    assert_eq!(buf[1], PacketType::Accept as u8);
    a.handle_datagram(t4, b_addr, metaroce_proto::Ecn::NotEct, &buf[..acc.size]);
    let mut connected = false;
    while let Some(e) = a.poll_event() {
        connected |= matches!(e, Event::Connected(c) if c == conn);
    }
    assert!(connected);
    // Three HELLOs lost cost one handshake RTO and three minimum RTOs.
    assert_eq!(t4 - t0, rto + Duration::from_micros(100) + 3 * (t3 - t2));
}
