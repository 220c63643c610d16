//! Receive timestamps: RTT samples and reported ACK delays run from when a
//! datagram arrived (the OS's stamp), not from when a busy or sleeping
//! thread got to it.

mod common;

use metaroce_proto::verbs::*;
use metaroce_proto::{Ecn, Endpoint, EndpointConfig, Instant};
use std::net::SocketAddr;

const A: &str = "10.0.0.1:4791";
const B: &str = "10.0.0.2:4791";

fn us(n: u64) -> Instant {
    Instant::from_nanos(n * 1000)
}

/// A connected pair, one QP each, a 4 KiB region on each side; the
/// handshake runs at 1 ms (a zero timestamp is no RTT sample).
struct Two {
    a: Endpoint,
    b: Endpoint,
    ca: ConnectionHandle,
    qa: Qpn,
    src: MrInfo,
    dst: MrInfo,
}

fn two() -> Two {
    let (a_addr, b_addr): (SocketAddr, SocketAddr) = (A.parse().unwrap(), B.parse().unwrap());
    let cfg = EndpointConfig {
        paths: 1,
        ..EndpointConfig::default()
    };
    let mut a = Endpoint::new(cfg.clone(), 1).unwrap();
    let mut b = Endpoint::new(cfg, 2).unwrap();
    let (pa, pb) = (a.alloc_pd(), b.alloc_pd());
    let (cqa, cqb) = (a.create_cq(16), b.create_cq(16));
    let src = a
        .reg_mr(pa, vec![5u8; 4096].into_boxed_slice(), 0, AccessFlags::NONE)
        .unwrap();
    let dst = b
        .reg_mr(
            pb,
            vec![0u8; 4096].into_boxed_slice(),
            0,
            AccessFlags::REMOTE_WRITE,
        )
        .unwrap();
    let qa = a.create_qp(QpInit::new(pa, cqa, cqa)).unwrap();
    let qb = b.create_qp(QpInit::new(pb, cqb, cqb)).unwrap();
    let now = us(1000);
    let (ca, cb) = common::handshake(&mut a, &mut b, a_addr, b_addr, now);
    a.connect_qp(qa, ca, qb).unwrap();
    b.connect_qp(qb, cb, qa).unwrap();
    Two {
        a,
        b,
        ca,
        qa,
        src,
        dst,
    }
}

/// One 4 KiB WRITE leaves A at 2 ms and reaches B's socket 10 µs later;
/// B's thread reads it at `b_reads` and answers at 2.51 ms; the ACK reaches
/// A's socket 10 µs after that and A's thread reads it at `a_reads`.
/// `stamped`: both reads pass the arrival stamps. Returns A's smoothed RTT.
fn srtt_after_one_write(stamped: bool, b_reads: Instant, a_reads: Instant) -> u64 {
    let mut t = two();
    let (a_addr, b_addr): (SocketAddr, SocketAddr) = (A.parse().unwrap(), B.parse().unwrap());
    let sent = us(2000);
    let wr = SendWr::new(
        1,
        SendOp::Write(RemoteAddr {
            rkey: t.dst.rkey,
            addr: 0,
        }),
        Sge {
            lkey: t.src.lkey,
            addr: 0,
            len: 4096,
        },
    );
    t.a.post_send(sent, t.qa, wr).unwrap();
    let mut buf = vec![0u8; 65_536];
    let x = t.a.poll_transmit(sent, &mut buf).expect("the WRITE");
    let from = SocketAddr::new(a_addr.ip(), x.src_port);
    let arrived = us(2010);
    if stamped {
        t.b.handle_datagram_stamped(b_reads, arrived, from, Ecn::Ect0, &buf[..x.size]);
    } else {
        t.b.handle_datagram(b_reads, from, Ecn::Ect0, &buf[..x.size]);
    }
    let answered = us(2510);
    let ack = t.b.poll_transmit(answered, &mut buf).expect("the ACK");
    let ack_arrived = us(2520);
    if stamped {
        t.a.handle_datagram_stamped(a_reads, ack_arrived, b_addr, Ecn::NotEct, &buf[..ack.size]);
    } else {
        t.a.handle_datagram(a_reads, b_addr, Ecn::NotEct, &buf[..ack.size]);
    }
    let s = t.a.connection_stats(t.ca).unwrap();
    assert_eq!(s.acks_received, 1, "{s:?}");
    s.paths[0].srtt_ns
}

#[test]
fn rtt_runs_from_arrival_not_from_when_the_thread_read() {
    // The network took 10 µs each way. B's thread read the WRITE 300 µs
    // after it arrived, A's read the ACK 1.5 ms after it arrived.
    let (b_reads, a_reads) = (us(2310), us(4020));
    let stamped = srtt_after_one_write(true, b_reads, a_reads);
    assert!(
        (15_000..=25_000).contains(&stamped),
        "stamped: {stamped} ns, the network's 20 µs"
    );
    // Without stamps both waits count: B's (read at 2.31 ms, answered at
    // 2.51: 200 µs of its 300 µs wait are after the read, and it reports
    // only those) and all of A's.
    let unstamped = srtt_after_one_write(false, b_reads, a_reads);
    assert!(
        unstamped > 1_500_000,
        "unstamped: {unstamped} ns, the threads' waits included"
    );
}

#[test]
fn a_stamp_after_now_counts_as_now() {
    // An arrival stamp later than the read (clock skew between the OS's
    // clock and ours) is taken as the read itself, not trusted.
    let (b_reads, a_reads) = (us(2005), us(2515));
    let stamped = srtt_after_one_write(true, b_reads, a_reads);
    let unstamped = srtt_after_one_write(false, b_reads, a_reads);
    assert_eq!(stamped, unstamped);
}
