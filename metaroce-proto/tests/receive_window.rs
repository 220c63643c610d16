//! The receiver's window (PROTOCOL §6.5, §14): a receiver given a receive
//! buffer tells each sender its share in every ACK, and the sender keeps
//! its bytes in flight within it; a malformed window is refused.

mod common;

use common::*;
use metaroce_proto::verbs::*;
use metaroce_proto::EndpointConfig;
use std::time::Duration;

const WRITE: usize = 64 << 10;
const WRITES: u64 = 32;
/// The receiver's buffer: a fraction of the link's bandwidth-delay product
/// (40 µs × 12.5 bytes/ns = 500 KB), so that the window, not the
/// congestion window, is what binds.
const BUFFER: u64 = 96 << 10;

fn config(receive_buffer: Option<u64>) -> EndpointConfig {
    EndpointConfig {
        paths: 4,
        max_gso_segments: 15,
        receive_buffer,
        ..EndpointConfig::default()
    }
}

fn link() -> LinkConfig {
    LinkConfig {
        delay: Duration::from_micros(20),
        bytes_per_us: 12_500,
        ..LinkConfig::perfect()
    }
}

/// What a stream of `WRITES` 64 KiB WRITEs, all posted at once, did.
struct Outcome {
    /// Most bytes the sender had in flight right after it sent more, once
    /// it knew a window.
    max_in_flight_windowed: u64,
    /// Most bytes it had in flight at any time.
    max_in_flight: u64,
    /// Most bytes it had in flight before the receiver's first ACK (with
    /// the window the ACCEPT gave, if any).
    max_first_flight: u64,
    /// The window the ACCEPT gave (0: none).
    accept_window: u64,
    /// The window the sender was given (0: none).
    peer_window: u64,
}

fn stream(receive_buffer: Option<u64>) -> Outcome {
    let mut p = Pair::new(config(None), config(receive_buffer), 7, link());
    p.connect();
    let v = Verbs::setup(&mut p);
    let total = WRITE * WRITES as usize;
    let data = pattern(3, total);
    let (src, dst) = write_regions(&mut p.a, v.pda, &mut p.b, v.pdb, &data);
    for i in 0..WRITES {
        let wr = write_wr(i, &src, &dst, i * WRITE as u64, WRITE as u32);
        p.a.post_send(p.now, v.qa, wr).unwrap();
    }
    let conn = p.conn_a.unwrap();
    let accept_window = p.a.connection_stats(conn).unwrap().peer_window;
    let (mut windowed, mut any, mut done, mut last, mut first) = (0, 0, 0u64, 0, 0);
    let deadline = p.now + Duration::from_secs(1);
    while done < WRITES {
        assert!(
            p.now < deadline,
            "{done} of {WRITES} WRITEs done in a second"
        );
        assert!(p.step(), "nothing left to do with {done} WRITEs done");
        let s = p.a.connection_stats(conn).unwrap();
        any = any.max(s.in_flight);
        if s.acks_received == 0 {
            first = first.max(s.in_flight);
        }
        // A step reads what arrived, then sends: what is in flight after a
        // step in which the sender sent is what it let itself have.
        if s.peer_window != 0 && p.sent[0].0 > last {
            windowed = windowed.max(s.in_flight);
        }
        last = p.sent[0].0;
        for wc in drain_cq(&mut p.a, v.cqa) {
            assert_eq!(wc.status, WcStatus::Success);
            done += 1;
        }
    }
    assert!(
        p.b.mr(dst.lkey).unwrap()[..] == data[..],
        "every byte arrived where it belongs"
    );
    Outcome {
        max_in_flight_windowed: windowed,
        max_in_flight: any,
        max_first_flight: first,
        accept_window,
        peer_window: p.a.connection_stats(conn).unwrap().peer_window,
    }
}

#[test]
fn a_sender_keeps_to_the_receivers_window() {
    let o = stream(Some(BUFFER));
    // One sender: the whole buffer is its share.
    assert_eq!(o.peer_window, BUFFER);
    // Before its first ACK the receiver counted the new sender on top of
    // the one it had (itself at least): half the buffer, from the ACCEPT.
    assert_eq!(o.accept_window, BUFFER / 2);
    assert!(
        o.max_first_flight > 0 && o.max_first_flight <= BUFFER / 2,
        "first flight of {} bytes against the ACCEPT's window of {}",
        o.max_first_flight,
        BUFFER / 2
    );
    assert!(
        o.max_in_flight_windowed <= BUFFER,
        "{} bytes in flight against a window of {BUFFER}",
        o.max_in_flight_windowed
    );
    assert!(
        o.max_in_flight_windowed > BUFFER / 2,
        "the window is used: {} bytes in flight at most",
        o.max_in_flight_windowed
    );
}

#[test]
fn without_a_receive_buffer_no_window_is_given() {
    // The control: the same stream fills far more than the buffer when
    // the receiver gives no window, so the test above can fail.
    let o = stream(None);
    assert_eq!((o.peer_window, o.accept_window), (0, 0));
    assert!(
        o.max_first_flight > BUFFER,
        "the first flight without a window is the congestion window's: {}",
        o.max_first_flight
    );
    assert!(
        o.max_in_flight > 2 * BUFFER,
        "only {} bytes in flight without a window",
        o.max_in_flight
    );
}

#[test]
fn a_malformed_window_is_refused_and_counted() {
    let mut p = Pair::new(config(None), config(Some(BUFFER)), 9, LinkConfig::perfect());
    p.connect();
    let v = Verbs::setup(&mut p);
    // Every ACK from b gets one more window option, three bytes long.
    p.on_wire = Some(Box::new(|to_b, bytes: &mut Vec<u8>| {
        if !to_b && bytes.get(1) == Some(&0x02) {
            bytes.extend_from_slice(&[0x01, 3, 0, 1, 0]);
        }
    }));
    let data = pattern(5, 8192);
    let (src, dst) = write_regions(&mut p.a, v.pda, &mut p.b, v.pdb, &data);
    p.a.post_send(p.now, v.qa, write_wr(1, &src, &dst, 0, 8192))
        .unwrap();
    p.run_for(Duration::from_millis(5));
    let refused = p.a.stats().rejects.invalid_field;
    assert!(refused > 0, "the ACKs with a malformed window were refused");
    let s = p.a.connection_stats(p.conn_a.unwrap()).unwrap();
    // The ACKs' well-formed window (the whole buffer) was not taken either:
    // the window is still the ACCEPT's.
    assert_eq!(
        s.peer_window,
        BUFFER / 2,
        "a window taken from a refused ACK"
    );
    assert_eq!(s.acks_received, 0, "a refused ACK counts for nothing");
    // The data itself arrived (the ACKs were what was malformed).
    assert!(p.b.mr(dst.lkey).unwrap()[..] == data[..]);
}

/// Two senders to one receiver: each is told half the buffer once both
/// deliver, and keeps to it; every byte of both arrives.
#[test]
fn two_senders_share_the_buffer() {
    const SHARED: u64 = 128 << 10;
    let addrs: [std::net::SocketAddr; 3] = [
        "10.0.0.1:4791".parse().unwrap(),
        "10.0.0.2:4791".parse().unwrap(),
        "10.0.0.3:4791".parse().unwrap(),
    ];
    let mut senders = [
        metaroce_proto::Endpoint::new(config(None), 1).unwrap(),
        metaroce_proto::Endpoint::new(config(None), 2).unwrap(),
    ];
    let mut r = metaroce_proto::Endpoint::new(config(Some(SHARED)), 3).unwrap();
    let mut now = metaroce_proto::Instant::from_nanos(1_000_000);
    let pr = r.alloc_pd();
    let cqr = r.create_cq(64);
    let mut flows = Vec::new();
    for (i, s) in senders.iter_mut().enumerate() {
        let (cs, cr) = handshake(s, &mut r, addrs[i], addrs[2], now);
        let ps = s.alloc_pd();
        let cqs = s.create_cq(64);
        let qs = s.create_qp(QpInit::new(ps, cqs, cqs)).unwrap();
        let qr = r.create_qp(QpInit::new(pr, cqr, cqr)).unwrap();
        s.connect_qp(qs, cs, qr).unwrap();
        r.connect_qp(qr, cr, qs).unwrap();
        let data = pattern(10 + i as u64, 8 * WRITE);
        let (src, dst) = write_regions(s, ps, &mut r, pr, &data);
        for k in 0..8u64 {
            let wr = write_wr(k, &src, &dst, k * WRITE as u64, WRITE as u32);
            s.post_send(now, qs, wr).unwrap();
        }
        flows.push((cs, cqs, dst, data, 0u64));
    }
    let mut buf = vec![0u8; 65_536];
    let mut most = [0u64; 2];
    let deadline = now + Duration::from_secs(1);
    while flows.iter().any(|f| f.4 < 8) {
        assert!(now < deadline, "the WRITEs did not finish");
        // Each sender sends what its windows allow; the receiver reads it
        // all, then answers; 10 µs pass.
        for (i, s) in senders.iter_mut().enumerate() {
            while let Some(t) = s.poll_transmit(now, &mut buf) {
                // A GSO batch is several datagrams.
                for d in buf[..t.size].chunks(t.segment_size.unwrap_or(t.size)) {
                    r.handle_datagram(now, addrs[i], t.ecn, d);
                }
            }
            let st = s.connection_stats(flows[i].0).unwrap();
            if st.peer_window == SHARED / 2 {
                most[i] = most[i].max(st.in_flight);
            }
        }
        while let Some(t) = r.poll_transmit(now, &mut buf) {
            let i = addrs.iter().position(|a| a.ip() == t.dst.ip()).unwrap();
            senders[i].handle_datagram(now, addrs[2], t.ecn, &buf[..t.size]);
        }
        now = now + Duration::from_micros(10);
        for (i, s) in senders.iter_mut().enumerate() {
            if s.poll_timeout().is_some_and(|t| t <= now) {
                s.handle_timeout(now);
            }
            flows[i].4 += drain_cq(s, flows[i].1)
                .iter()
                .inspect(|wc| assert_eq!(wc.status, WcStatus::Success))
                .count() as u64;
        }
        if r.poll_timeout().is_some_and(|t| t <= now) {
            r.handle_timeout(now);
        }
    }
    for (i, f) in flows.iter().enumerate() {
        assert!(
            most[i] > 0 && most[i] <= SHARED / 2,
            "sender {i}: {} bytes in flight at most while told {}",
            most[i],
            SHARED / 2
        );
        assert!(r.mr(f.2.lkey).unwrap()[..] == f.3[..], "sender {i}'s bytes");
    }
}
