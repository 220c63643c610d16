//! Minimal reproductions of core bugs found by the property tests and the
//! fuzz targets, kept as regression tests. Each is deterministic (fixed seed,
//! perfect link unless stated). A test for a bug not yet fixed is
//! `#[ignore]`d with the reason; run those with `-- --ignored`.

mod common;

use common::*;
use metaroce_proto::verbs::*;
use metaroce_proto::{EndpointConfig, Instant};
use std::time::Duration;

fn reg(
    ep: &mut metaroce_proto::Endpoint,
    pd: PdHandle,
    data: Vec<u8>,
    addr: u64,
    access: AccessFlags,
) -> MrInfo {
    ep.reg_mr(pd, data.into_boxed_slice(), addr, access)
        .unwrap()
}

/// Found by `reliability_props` (case seed 0x1119f56505ce7acd, late receives).
///
/// Steps: one QP, perfect link. Post SEND #0 of 100 bytes and SEND #1 of
/// 1 MiB with no receive posted at B. Both are RNR-NAKed; the requester
/// resends #0 and starts resending #1 (many packets, `resend_offset` grows
/// past 100). B, still without a receive, RNR-NAKs #0 (gen 1) again: the NAK
/// handler inserts msn 0 at the front of `resend` but keeps `resend_offset`,
/// which belongs to msn 1. `Qp::next_segment` then computes
/// `len_total - offset` = 100 - (>100).
///
/// Expected: both SENDs complete Success once the receives are posted.
/// Actual (core at 570f047): debug build panics "attempt to subtract with
/// overflow" at `verbs/qp.rs:434` (`next_segment`, the `resend` branch); a
/// release build wraps and resends a bogus range of message #0.
/// Fixed in 376091e (per-message resend offsets); this test passes there.
#[test]
fn rnr_nak_for_earlier_message_during_resend() {
    let mut p = Pair::new(
        EndpointConfig::default(),
        EndpointConfig::default(),
        7,
        LinkConfig::perfect(),
    );
    p.connect();
    let v = Verbs::setup(&mut p);
    let big = 1 << 20;
    let data = pattern(1, big);
    let src = reg(&mut p.a, v.pda, data.clone(), 0, AccessFlags::NONE);
    let dst = reg(
        &mut p.b,
        v.pdb,
        vec![0; big + 100],
        0,
        AccessFlags::LOCAL_WRITE,
    );
    let now = p.now;
    for (id, addr, len) in [(0u64, 0u64, 100u32), (1, 0, big as u32)] {
        p.a.post_send(
            now,
            v.qa,
            SendWr::new(
                id,
                SendOp::Send,
                Sge {
                    lkey: src.lkey,
                    addr,
                    len,
                },
            ),
        )
        .unwrap();
    }
    // No receive for 2 ms: several RNR rounds.
    p.run_for(Duration::from_millis(2));
    for (id, addr, len) in [(10u64, 0u64, 100u32), (11, 100, big as u32)] {
        p.b.post_recv(
            v.qb,
            RecvWr {
                wr_id: id,
                sge: Sge {
                    lkey: dst.lkey,
                    addr,
                    len,
                },
            },
        )
        .unwrap();
    }
    let deadline: Instant = p.now + Duration::from_secs(2);
    let mut wa = Vec::new();
    p.run_until(deadline, |p| {
        wa.extend(drain_cq(&mut p.a, v.cqa));
        wa.len() >= 2
    });
    assert_eq!(
        wa.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
        vec![(0, WcStatus::Success), (1, WcStatus::Success)]
    );
    let b = p.b.mr(dst.lkey).unwrap();
    assert_eq!(&b[..100], &data[..100]);
    assert_eq!(&b[100..], &data[..]);
}
