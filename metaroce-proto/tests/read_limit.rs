//! The responder's limit on outstanding READs counts what the requester
//! can have outstanding, not responses it still holds for retransmission:
//! a READ the requester saw complete may wait at the responder for its
//! ACK, and the requester's next READ can get there first.

mod common;

use metaroce_proto::consts::DEFAULT_MAX_RD_ATOMIC;
use metaroce_proto::verbs::*;
use metaroce_proto::wire::{peek_common, PacketType};
use metaroce_proto::{Endpoint, EndpointConfig, Instant};
use std::net::SocketAddr;
use std::time::Duration;

#[test]
fn a_read_that_overtakes_the_ack_of_the_last_is_not_too_many() {
    let (a_addr, b_addr): (SocketAddr, SocketAddr) = (
        "10.0.0.1:4791".parse().unwrap(),
        "10.0.0.2:4791".parse().unwrap(),
    );
    let cfg = EndpointConfig {
        paths: 1,
        ..EndpointConfig::default()
    };
    let mut a = Endpoint::new(cfg.clone(), 21).unwrap();
    let mut b = Endpoint::new(cfg, 22).unwrap();
    let (pa, pb) = (a.alloc_pd(), b.alloc_pd());
    let (cqa, cqb) = (a.create_cq(256), b.create_cq(256));
    let n = usize::from(DEFAULT_MAX_RD_ATOMIC) + 1;
    let data: Vec<u8> = (0..n * 4096).map(|i| (i / 3) as u8).collect();
    let local = a
        .reg_mr(
            pa,
            vec![0u8; n * 4096].into_boxed_slice(),
            0,
            AccessFlags::LOCAL_WRITE,
        )
        .unwrap();
    let remote = b
        .reg_mr(
            pb,
            data.clone().into_boxed_slice(),
            0,
            AccessFlags::REMOTE_READ,
        )
        .unwrap();
    let qa = a.create_qp(QpInit::new(pa, cqa, cqa)).unwrap();
    let qb = b.create_qp(QpInit::new(pb, cqb, cqb)).unwrap();
    let mut now = Instant::from_nanos(1_000_000);
    let (ca, cb) = common::handshake(&mut a, &mut b, a_addr, b_addr, now);
    let mut buf = vec![0u8; 65_536];
    a.connect_qp(qa, ca, qb).unwrap();
    b.connect_qp(qb, cb, qa).unwrap();
    let read = |i: usize| {
        SendWr::new(
            i as u64,
            SendOp::Read(RemoteAddr {
                rkey: remote.rkey,
                addr: (i * 4096) as u64,
            }),
            Sge {
                lkey: local.lkey,
                addr: (i * 4096) as u64,
                len: 4096,
            },
        )
    };
    // As many READs as the requester may have outstanding.
    for i in 0..n - 1 {
        a.post_send(now, qa, read(i)).unwrap();
    }
    // The requests go over; the responses come back; A's ACKs of them are
    // lost, so B still holds every response for retransmission.
    let a_to_b = |a: &mut Endpoint, b: &mut Endpoint, now: Instant, buf: &mut [u8], acks: bool| {
        while let Some(t) = a.poll_transmit(now, buf) {
            let is_ack = peek_common(&buf[..t.size]).is_ok_and(|c| c.ptype == PacketType::Ack);
            if is_ack && !acks {
                continue;
            }
            let from = SocketAddr::new(a_addr.ip(), t.src_port);
            let seg = t.segment_size.unwrap_or(t.size);
            for dg in buf[..t.size].chunks(seg) {
                b.handle_datagram(now, from, t.ecn, dg);
            }
        }
    };
    let b_to_a = |a: &mut Endpoint, b: &mut Endpoint, now: Instant, buf: &mut [u8]| {
        while let Some(t) = b.poll_transmit(now, buf) {
            let from = SocketAddr::new(b_addr.ip(), t.src_port);
            let seg = t.segment_size.unwrap_or(t.size);
            for dg in buf[..t.size].chunks(seg) {
                a.handle_datagram(now, from, t.ecn, dg);
            }
        }
    };
    let mut wcs = Vec::new();
    for _ in 0..20 {
        a_to_b(&mut a, &mut b, now, &mut buf, false);
        b_to_a(&mut a, &mut b, now, &mut buf);
        now = now + Duration::from_micros(1);
        a.poll_cq(cqa, 64, &mut wcs).unwrap();
    }
    assert!(!wcs.is_empty(), "READs completed at the requester");
    assert!(wcs.iter().all(|w| w.status == WcStatus::Success), "{wcs:?}");
    // The requester has room again: one more READ, which reaches B before
    // any ACK of the earlier responses.
    a.post_send(now, qa, read(n - 1)).unwrap();
    a_to_b(&mut a, &mut b, now, &mut buf, false);
    // From here on everything is delivered.
    let end = now + Duration::from_millis(100);
    while wcs.len() < n && now < end {
        a_to_b(&mut a, &mut b, now, &mut buf, true);
        b_to_a(&mut a, &mut b, now, &mut buf);
        now = now + Duration::from_micros(10);
        for ep in [&mut a, &mut b] {
            if ep.poll_timeout().is_some_and(|t| t <= now) {
                ep.handle_timeout(now);
            }
        }
        a.poll_cq(cqa, 64, &mut wcs).unwrap();
    }
    assert_eq!(wcs.len(), n, "{wcs:?}");
    assert!(
        wcs.iter().all(|w| w.status == WcStatus::Success),
        "every READ succeeds: {wcs:?}"
    );
    assert!(a.mr(local.lkey).unwrap() == &data[..]);
    let _ = cqb;
}
