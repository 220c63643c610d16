//! A path whose route is dead from the start (it never delivers, so it
//! never has an RTT of its own) is still declared failed and moved to a new
//! source port, and the transfer loses nothing.

mod common;

use metaroce_proto::verbs::*;
use metaroce_proto::{Endpoint, EndpointConfig, Instant};
use std::net::SocketAddr;
use std::time::Duration;

#[test]
fn a_path_dead_from_the_start_fails_and_moves() {
    let (a_addr, b_addr): (SocketAddr, SocketAddr) = (
        "10.0.0.1:4791".parse().unwrap(),
        "10.0.0.2:4791".parse().unwrap(),
    );
    let cfg = EndpointConfig {
        paths: 4,
        max_gso_segments: 15,
        ..EndpointConfig::default()
    };
    let mut a = Endpoint::new(cfg.clone(), 11).unwrap();
    let mut b = Endpoint::new(cfg, 12).unwrap();
    let (pa, pb) = (a.alloc_pd(), b.alloc_pd());
    let (cqa, cqb) = (a.create_cq(64), b.create_cq(64));
    const LEN: usize = 4 << 20;
    let data: Vec<u8> = (0..LEN).map(|i| (i * 7 + i / 4096) as u8).collect();
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
    let mut buf = vec![0u8; 65_536];
    a.connect_qp(qa, ca, qb).unwrap();
    b.connect_qp(qb, cb, qa).unwrap();
    // From here on, nothing from path 0's source port gets through.
    let dead = a.connection_stats(ca).unwrap().paths[0].src_port;
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
    let mut wcs = Vec::new();
    let mut dropped = 0;
    let end = now + Duration::from_secs(2);
    while wcs.is_empty() && now < end {
        while let Some(t) = a.poll_transmit(now, &mut buf) {
            if t.src_port == dead {
                dropped += 1;
                continue;
            }
            let from = SocketAddr::new(a_addr.ip(), t.src_port);
            let seg = t.segment_size.unwrap_or(t.size);
            for dg in buf[..t.size].chunks(seg) {
                b.handle_datagram(now, from, t.ecn, dg);
            }
        }
        while let Some(t) = b.poll_transmit(now, &mut buf) {
            a.handle_datagram(now, b_addr, t.ecn, &buf[..t.size]);
        }
        now = now + Duration::from_micros(10);
        for ep in [&mut a, &mut b] {
            if ep.poll_timeout().is_some_and(|t| t <= now) {
                ep.handle_timeout(now);
            }
        }
        a.poll_cq(cqa, 4, &mut wcs).unwrap();
    }
    assert_eq!(wcs.len(), 1, "the WRITE completed");
    assert_eq!(wcs[0].status, WcStatus::Success);
    assert!(b.mr(dst.lkey).unwrap() == &data[..], "every byte arrived");
    let s = a.connection_stats(ca).unwrap();
    assert!(dropped > 0, "the dead path was tried");
    assert!(
        s.path_failures > 0,
        "the dead path was declared failed: {s:?}"
    );
    assert!(
        s.paths.iter().all(|p| p.src_port != dead),
        "no path uses the dead port any more: {s:?}"
    );
    let _ = cqb;
}
