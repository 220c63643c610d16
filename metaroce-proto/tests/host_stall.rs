//! A stall of the receiving host holds every path's packets at once (on
//! one machine they wait in one socket, for a thread that is off its
//! core). When it resumes it reads them in order and acknowledges them as
//! it goes: the first path acknowledged must not make all the others look
//! dead for the silence they shared. Timeouts that fired
//! during the stall may declare packets lost (the ACKs show them arrived),
//! but no path is declared failed and no byte is lost.

mod common;

use metaroce_proto::verbs::*;
use metaroce_proto::{Ecn, Endpoint, EndpointConfig, Instant};
use std::net::SocketAddr;
use std::time::Duration;

/// One datagram held on its way: from, ECN, bytes.
type Held = (SocketAddr, Ecn, Vec<u8>);

#[test]
fn a_stall_of_every_path_fails_none() {
    let (a_addr, b_addr): (SocketAddr, SocketAddr) = (
        "10.0.0.1:4791".parse().unwrap(),
        "10.0.0.2:4791".parse().unwrap(),
    );
    let cfg = EndpointConfig {
        paths: 4,
        max_gso_segments: 15,
        ..EndpointConfig::default()
    };
    let mut a = Endpoint::new(cfg.clone(), 21).unwrap();
    let mut b = Endpoint::new(cfg, 22).unwrap();
    let (pa, pb) = (a.alloc_pd(), b.alloc_pd());
    let (cqa, cqb) = (a.create_cq(64), b.create_cq(64));
    const LEN: usize = 8 << 20;
    let data: Vec<u8> = (0..LEN).map(|i| (i * 13 + i / 4096) as u8).collect();
    let src = a
        .reg_mr(pa, data.clone().into_boxed_slice(), 0, AccessFlags::NONE)
        .unwrap();
    let dst = b
        .reg_mr(
            pb,
            vec![0u8; LEN].into_boxed_slice(),
            0,
            AccessFlags::REMOTE_WRITE,
        )
        .unwrap();
    let qa = a.create_qp(QpInit::new(pa, cqa, cqa)).unwrap();
    let qb = b.create_qp(QpInit::new(pb, cqb, cqb)).unwrap();
    let mut now = Instant::from_nanos(1_000_000);
    let (ca, cb) = common::handshake(&mut a, &mut b, a_addr, b_addr, now);
    a.connect_qp(qa, ca, qb).unwrap();
    b.connect_qp(qb, cb, qa).unwrap();
    let wr = SendWr::new(
        1,
        SendOp::Write(RemoteAddr {
            rkey: dst.rkey,
            addr: 0,
        }),
        Sge {
            lkey: src.lkey,
            addr: 0,
            len: LEN as u32,
        },
    );
    a.post_send(now, qa, wr).unwrap();
    let mut buf = vec![0u8; 65_536];
    // What each side sent that has not been delivered yet.
    let (mut to_b, mut to_a): (Vec<Held>, Vec<Held>) = (Vec::new(), Vec::new());
    let mut wcs = Vec::new();
    let end = now + Duration::from_secs(5);
    let mut stalled = false;
    let mut failures_after_stall = None;
    while wcs.is_empty() && now < end {
        while let Some(t) = a.poll_transmit(now, &mut buf) {
            let from = SocketAddr::new(a_addr.ip(), t.src_port);
            let seg = t.segment_size.unwrap_or(t.size);
            for dg in buf[..t.size].chunks(seg) {
                to_b.push((from, t.ecn, dg.to_vec()));
            }
        }
        let received = b.connection_stats(cb).unwrap().data_packets_received;
        let holding = received > 300 && !stalled;
        if !holding {
            for (from, ecn, dg) in to_b.drain(..) {
                b.handle_datagram(now, from, ecn, &dg);
            }
        }
        if !holding {
            while let Some(t) = b.poll_transmit(now, &mut buf) {
                to_a.push((b_addr, t.ecn, buf[..t.size].to_vec()));
            }
        }
        if holding {
            // The receiver stalls for 10 ms (five minimum RTOs): what the
            // sender sends waits for it; the sender's timers run.
            stalled = true;
            let until = now + Duration::from_millis(10);
            while now < until {
                now = now + Duration::from_micros(100);
                if a.poll_timeout().is_some_and(|t| t <= now) {
                    a.handle_timeout(now);
                }
                while let Some(t) = a.poll_transmit(now, &mut buf) {
                    let from = SocketAddr::new(a_addr.ip(), t.src_port);
                    let seg = t.segment_size.unwrap_or(t.size);
                    for dg in buf[..t.size].chunks(seg) {
                        to_b.push((from, t.ecn, dg.to_vec()));
                    }
                }
            }
            let before = a.connection_stats(ca).unwrap().path_failures;
            // Back on its core, the receiver reads what waited, in order,
            // and acknowledges as it goes; its ACKs are read at once.
            for (from, ecn, dg) in std::mem::take(&mut to_b) {
                b.handle_datagram(now, from, ecn, &dg);
                while let Some(t) = b.poll_transmit(now, &mut buf) {
                    a.handle_datagram(now, b_addr, t.ecn, &buf[..t.size]);
                }
            }
            failures_after_stall = Some(a.connection_stats(ca).unwrap().path_failures - before);
        }
        for (from, ecn, dg) in to_a.drain(..) {
            a.handle_datagram(now, from, ecn, &dg);
        }
        now = now + Duration::from_micros(10);
        for ep in [&mut a, &mut b] {
            if ep.poll_timeout().is_some_and(|t| t <= now) {
                ep.handle_timeout(now);
            }
        }
        a.poll_cq(cqa, 4, &mut wcs).unwrap();
    }
    let s = a.connection_stats(ca).unwrap();
    assert_eq!(
        failures_after_stall,
        Some(0),
        "paths declared failed as the held ACKs were read: {s:?}"
    );
    assert!(s.rto_fires > 0, "the stall outlasted the timeouts: {s:?}");
    assert_eq!(wcs.len(), 1, "the WRITE completed");
    assert_eq!(wcs[0].status, WcStatus::Success);
    assert!(b.mr(dst.lkey).unwrap() == &data[..], "every byte arrived");
    assert_eq!(s.path_failures, 0, "no path failed at all: {s:?}");
    let _ = cqb;
}
