//! Minimal reproductions of core bugs found by the property tests and the
//! fuzz targets, kept as regression tests. Each is deterministic (fixed seed,
//! perfect link unless stated). A test for a bug not yet fixed is
//! `#[ignore]`d with the reason; run those with `-- --ignored`.

mod common;

use common::*;
use metaroce_proto::verbs::*;
use metaroce_proto::{EndpointConfig, Instant};
use std::time::Duration;

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
                }
                .into(),
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

#[path = "fuzz_logic/mod.rs"]
mod fuzz_logic;

/// Found by the `endpoint_datagram` fuzzer (a 54-byte "slow unit": one edited
/// DATA packet took ~10 s in `handle_datagram`).
///
/// Steps: connected pair (perfect link). Take a real WRITE DATA packet A→B
/// and set its `psn` (bytes 16..20) to `psn + 0x6a00_0000`, i.e. far beyond
/// the path's receive window but still "ahead" in serial order; deliver it to
/// B from A's address. `RingBitmap::insert_sliding` (reliability/ring_bitmap.rs)
/// slides the window one sequence number per loop iteration, so the cost is
/// proportional to the PSN jump: up to 2^31 iterations for one datagram.
/// Anyone who can send one packet with the right `dst_cid` from the peer's IP
/// (or a bit error that survives the UDP checksum) stalls the endpoint.
///
/// Expected: O(1)/O(window) work (clear the bitmap and jump `cum` when the
/// jump exceeds the span); the packet is handled in microseconds.
/// Actual (core at fc7f74c): 10.5 s in a debug build; the fuzz input took
/// 9.2 s in the optimized (ASan) fuzz build.
#[test]
#[allow(clippy::disallowed_methods)] // wall clock of the test itself
fn far_ahead_psn_is_handled_in_constant_time() {
    let mut net = fuzz_logic::Net::new(3);
    let (ca, cb) = net.connect();
    net.capture = Some(Vec::new());
    // Capture the first DATA packet of a WRITE, without delivering it.
    let (pa, pb) = (net.a.alloc_pd(), net.b.alloc_pd());
    let (cqa, cqb) = (net.a.create_cq(16), net.b.create_cq(16));
    let qa = net.a.create_qp(QpInit::new(pa, cqa, cqa)).unwrap();
    let qb = net.b.create_qp(QpInit::new(pb, cqb, cqb)).unwrap();
    net.a.connect_qp(qa, ca, qb).unwrap();
    net.b.connect_qp(qb, cb, qa).unwrap();
    let src = reg(&mut net.a, pa, vec![1; 4096], 0, AccessFlags::NONE);
    let win = reg(&mut net.b, pb, vec![0; 4096], 0, AccessFlags::REMOTE_WRITE);
    let wr = SendWr::new(
        1,
        SendOp::Write(RemoteAddr {
            rkey: win.rkey,
            addr: 0,
        }),
        Sge {
            lkey: src.lkey,
            addr: 0,
            len: 4096,
        },
    );
    let now = net.now;
    net.a.post_send(now, qa, wr).unwrap();
    let mut buf = vec![0u8; 9000];
    let mut pkt = loop {
        let t = net.a.poll_transmit(now, &mut buf).expect("a DATA packet");
        if buf[1] == 0x01 {
            break buf[..t.size].to_vec();
        }
    };
    let psn = u32::from_be_bytes([pkt[16], pkt[17], pkt[18], pkt[19]]);
    pkt[16..20].copy_from_slice(&psn.wrapping_add(0x6a00_0000).to_be_bytes());
    let from = std::net::SocketAddr::new(fuzz_logic::Net::addr(false).ip(), 49152);
    let t0 = std::time::Instant::now();
    net.b
        .handle_datagram(now, from, metaroce_proto::Ecn::NotEct, &pkt);
    let took = t0.elapsed();
    assert!(
        took < Duration::from_millis(200),
        "one DATA packet with psn + 0x6a000000 took {took:?} in handle_datagram"
    );
}

/// Finding 5 (found by `tests/model.rs`, about one round in fifteen;
/// fixed): a fatal NAK that overtakes an earlier READ's response flushed
/// the READ.
///
/// Steps: one QP, perfect link but for the READ's one response packet,
/// which is lost. A posts a READ of 100 bytes from a region of B that
/// allows it, then a SEND of 200 bytes into B's receive of 100. B executes
/// the READ (its response goes, and is lost), then fails the SEND
/// (`InvalidRequest`, with `msn_done` 1: the READ is done) and moves its QP
/// to ERROR, which drops the READ's unacknowledged response: it is never
/// sent again. A takes the NAK and fails its QP: the READ, executed at B,
/// completes `WrFlushError`.
///
/// Expected (verbs): the READ completes `Success` (its response is sent
/// again until acknowledged; a responder that failed a later request still
/// answers the earlier ones), the SEND `RemoteInvalidRequest`. (A request
/// completing `WrFlushError` before the QP's first error completion never
/// happens in verbs.) The same race flushes SENDs and WRITEs that B
/// executed between the READ and the failed request, whose receives at B
/// complete `Success`.
/// Actual (core at 93fcc73): `[WrFlushError, RemoteInvalidRequest]`.
/// Fixed: a responder QP that fails keeps (and resends) the responses of
/// the READs it executed before, and the requester keeps a fatal NAK until
/// the requests before its message are complete (PROTOCOL §11.4, §11.5).
#[test]
fn a_fatal_nak_that_overtakes_a_read_response_does_not_flush_the_read() {
    use metaroce_proto::wire::{DataHeader, Opcode};
    let mut p = Pair::new(
        EndpointConfig::default(),
        EndpointConfig::default(),
        5,
        LinkConfig::perfect(),
    );
    p.connect();
    let v = Verbs::setup(&mut p);
    let src = reg(&mut p.a, v.pda, pattern(2, 200), 0, AccessFlags::NONE);
    let rd = reg(&mut p.a, v.pda, vec![0; 100], 0, AccessFlags::LOCAL_WRITE);
    let remote = reg(
        &mut p.b,
        v.pdb,
        pattern(3, 100),
        0,
        AccessFlags::REMOTE_READ,
    );
    let rcv = reg(&mut p.b, v.pdb, vec![0; 100], 0, AccessFlags::LOCAL_WRITE);
    let mut lost = false;
    p.on_wire = Some(Box::new(move |to_b, bytes| {
        let Ok((h, _)) = DataHeader::parse(bytes) else {
            return;
        };
        if !to_b && h.opcode == Opcode::ReadResp && !lost {
            lost = true;
            bytes.clear();
        }
    }));
    p.b.post_recv(
        v.qb,
        RecvWr {
            wr_id: 9,
            sge: Sge {
                lkey: rcv.lkey,
                addr: 0,
                len: 100,
            }
            .into(),
        },
    )
    .unwrap();
    let now = p.now;
    let read = SendWr::new(
        1,
        SendOp::Read(RemoteAddr {
            rkey: remote.rkey,
            addr: 0,
        }),
        Sge {
            lkey: rd.lkey,
            addr: 0,
            len: 100,
        },
    );
    let send = SendWr::new(
        2,
        SendOp::Send,
        Sge {
            lkey: src.lkey,
            addr: 0,
            len: 200,
        },
    );
    p.a.post_send(now, v.qa, read).unwrap();
    p.a.post_send(now, v.qa, send).unwrap();
    p.run_for(Duration::from_secs(1));
    let wcs = drain_cq(&mut p.a, v.cqa);
    assert_eq!(
        wcs.iter().map(|w| w.status).collect::<Vec<_>>(),
        [WcStatus::Success, WcStatus::RemoteInvalidRequest]
    );
    assert_eq!(p.a.mr(rd.lkey).unwrap(), &pattern(3, 100)[..]);
}
