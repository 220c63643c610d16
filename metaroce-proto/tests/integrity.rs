//! End-to-end integrity (PROTOCOL §3.1): a link that flips bits in
//! transit, and the CRC32C trailer that keeps every flipped datagram out.

mod common;

use common::*;
use metaroce_proto::verbs::*;
use metaroce_proto::{EndpointConfig, Gather, RejectReason};
use std::time::Duration;

/// What one run of [`exchange`] saw.
#[derive(Debug)]
struct Outcome {
    /// Every operation completed successfully.
    all_succeeded: bool,
    /// Bytes at their destinations that differ from what was sent.
    wrong_bytes: usize,
    /// Datagrams the link corrupted.
    flipped: u64,
    /// Datagrams both endpoints refused for a failed integrity check.
    bad_integrity: u64,
    /// Datagrams the link delivered twice (a corrupted one is refused
    /// twice).
    duplicated: u64,
}

/// WRITE, WRITE_IMM, SEND and READ between a pair of endpoints of
/// configuration `cfg` over a link that loses `loss` and flips one random
/// bit in `flip` of the datagrams (`payload_only`: only in the last 64
/// bytes of datagrams longer than 1 KiB, which a DATA packet's payload
/// holds whatever else it carries), gathered or not.
fn exchange(
    cfg: EndpointConfig,
    seed: u64,
    loss: f64,
    flip: f64,
    payload_only: bool,
    gather: bool,
) -> Outcome {
    let mut p = Pair::new(cfg.clone(), cfg, seed, LinkConfig::lossy(loss));
    if gather {
        p.gather = Some(Gather::new(256));
    }
    p.connect();
    let v = Verbs::setup(&mut p);
    let flipped = std::rc::Rc::new(std::cell::Cell::new(0u64));
    let seen = flipped.clone();
    let mut rng = TestRng::new(seed ^ 0xf11b);
    p.on_wire = Some(Box::new(move |_, bytes: &mut Vec<u8>| {
        if rng.unit() >= flip || bytes.is_empty() {
            return;
        }
        let (from, len) = if payload_only {
            if bytes.len() <= 1024 {
                return;
            }
            (bytes.len() - 64, 64)
        } else {
            (0, bytes.len())
        };
        let bit = rng.below(len as u64 * 8) as usize;
        bytes[from + bit / 8] ^= 1 << (bit % 8);
        seen.set(seen.get() + 1);
    }));

    const W: usize = 300_000;
    const S: usize = 70_000;
    const R: usize = 200_000;
    let wdata = pattern(1, W);
    let sdata = pattern(2, S);
    let rdata = pattern(3, R);
    let src =
        p.a.reg_mr(
            v.pda,
            [wdata.clone(), sdata.clone()].concat(),
            0,
            AccessFlags::NONE,
        )
        .unwrap();
    let wdst =
        p.b.reg_mr(v.pdb, vec![0u8; W], 0, AccessFlags::REMOTE_WRITE)
            .unwrap();
    let rsrc =
        p.b.reg_mr(v.pdb, rdata.clone(), 0, AccessFlags::REMOTE_READ)
            .unwrap();
    let rdst =
        p.a.reg_mr(v.pda, vec![0u8; R], 0, AccessFlags::LOCAL_WRITE)
            .unwrap();
    let recv =
        p.b.reg_mr(v.pdb, vec![0u8; S], 0, AccessFlags::LOCAL_WRITE)
            .unwrap();
    // Receives in the order the messages consume them: the first
    // WRITE_IMM's immediate, the SEND, the last WRITE_IMM's immediate.
    for (id, len) in [(21, 0), (20, S as u32), (22, 0)] {
        p.b.post_recv(
            v.qb,
            RecvWr {
                wr_id: id,
                sge: Sge {
                    lkey: recv.lkey,
                    addr: 0,
                    len,
                }
                .into(),
            },
        )
        .unwrap();
    }
    let now = p.now;
    let half = (W / 2) as u32;
    let remote = |addr| RemoteAddr {
        rkey: wdst.rkey,
        addr,
    };
    let ops = [
        SendWr::new(
            1,
            SendOp::Write(remote(0)),
            Sge {
                lkey: src.lkey,
                addr: 0,
                len: half,
            },
        ),
        SendWr::new(
            2,
            SendOp::WriteImm(remote(u64::from(half)), 7),
            Sge {
                lkey: src.lkey,
                addr: u64::from(half),
                len: W as u32 - half,
            },
        ),
        SendWr::new(
            3,
            SendOp::Send,
            Sge {
                lkey: src.lkey,
                addr: W as u64,
                len: S as u32,
            },
        ),
        SendWr::new(
            4,
            SendOp::Read(RemoteAddr {
                rkey: rsrc.rkey,
                addr: 0,
            }),
            Sge {
                lkey: rdst.lkey,
                addr: 0,
                len: R as u32,
            },
        ),
        SendWr::new(
            5,
            SendOp::WriteImm(remote(0), 8),
            Sge {
                lkey: src.lkey,
                addr: 0,
                len: 0,
            },
        ),
    ];
    for wr in ops {
        p.a.post_send(now, v.qa, wr).unwrap();
    }
    let mut wa = Vec::new();
    let deadline = p.now + Duration::from_secs(20);
    p.run_until(deadline, |p| {
        p.a.poll_cq(v.cqa, usize::MAX, &mut wa).unwrap();
        wa.len() >= 5
    });
    let wb = drain_cq(&mut p.b, v.cqb);
    let all_succeeded = wa.len() == 5
        && wa.iter().all(|w| w.status == WcStatus::Success)
        && wb.len() == 3
        && wb.iter().all(|w| w.status == WcStatus::Success);
    let diff = |a: &[u8], b: &[u8]| a.iter().zip(b).filter(|(x, y)| x != y).count();
    let wrong_bytes = diff(p.b.mr(wdst.lkey).unwrap(), &wdata)
        + diff(p.b.mr(recv.lkey).unwrap(), &sdata)
        + diff(p.a.mr(rdst.lkey).unwrap(), &rdata);
    let bad_integrity = p.a.stats().rejects.get(RejectReason::BadIntegrity)
        + p.b.stats().rejects.get(RejectReason::BadIntegrity);
    Outcome {
        all_succeeded,
        wrong_bytes,
        flipped: flipped.get(),
        bad_integrity,
        duplicated: p.duplicated,
    }
}

fn crc_config() -> EndpointConfig {
    EndpointConfig {
        crc32c: true,
        paths: 4,
        max_gso_segments: 8,
        ..EndpointConfig::default()
    }
}

#[test]
fn crc32c_keeps_every_flipped_datagram_out() {
    for (seed, gather) in [(1, false), (2, true), (3, false), (4, true)] {
        let o = exchange(crc_config(), seed, 0.01, 0.2, false, gather);
        assert!(o.all_succeeded, "seed {seed}: {o:?}");
        assert_eq!(
            o.wrong_bytes, 0,
            "seed {seed}: no corrupted byte placed: {o:?}"
        );
        assert!(
            o.flipped > 15,
            "seed {seed}: the link corrupted datagrams: {o:?}"
        );
        // Every flip is caught: a flipped datagram is refused by its CRC
        // (or, flipped in its common header, as no packet of ours at all).
        assert!(
            o.bad_integrity * 10 >= o.flipped * 8,
            "seed {seed}: flips caught by the CRC: {o:?}"
        );
        assert!(
            o.bad_integrity <= o.flipped + o.duplicated,
            "seed {seed}: {o:?}"
        );
    }
}

#[test]
fn intact_datagrams_always_pass_their_crc32c() {
    // Copied and gathered, over a lossy link and a perfect one: no
    // datagram the link left alone fails its check.
    for (seed, gather, loss) in [
        (5, false, 0.0),
        (6, true, 0.0),
        (7, true, 0.02),
        (8, false, 0.02),
    ] {
        let o = exchange(crc_config(), seed, loss, 0.0, false, gather);
        assert!(o.all_succeeded, "seed {seed}: {o:?}");
        assert_eq!(
            (o.wrong_bytes, o.bad_integrity),
            (0, 0),
            "seed {seed}: {o:?}"
        );
    }
}

#[test]
fn without_crc32c_flipped_payloads_are_placed() {
    // The control: the same link without the trailer places corrupted
    // bytes, which is what the test above shows cannot happen with it.
    let cfg = EndpointConfig {
        crc32c: false,
        ..crc_config()
    };
    let o = exchange(cfg, 1, 0.0, 0.2, true, false);
    assert!(o.flipped > 15, "{o:?}");
    assert!(o.wrong_bytes > 0, "{o:?}");
    assert_eq!(o.bad_integrity, 0);
}

#[test]
fn crc32c_is_used_only_when_both_sides_ask() {
    let on = crc_config();
    let off = EndpointConfig {
        crc32c: false,
        ..crc_config()
    };
    for (ca, cb, trailer) in [
        (on.clone(), off.clone(), false),
        (off, on.clone(), false),
        (on.clone(), on, true),
    ] {
        let mut p = Pair::new(ca, cb, 9, LinkConfig::perfect());
        p.connect();
        let sizes = std::rc::Rc::new(std::cell::RefCell::new(Vec::new()));
        let seen = sizes.clone();
        p.on_wire = Some(Box::new(move |to_b, bytes: &mut Vec<u8>| {
            if to_b && bytes.get(1) == Some(&1) {
                seen.borrow_mut().push(bytes.len());
            }
        }));
        let v = Verbs::setup(&mut p);
        let data = pattern(5, 4096);
        let (src, dst) = write_regions(&mut p.a, v.pda, &mut p.b, v.pdb, &data);
        let now = p.now;
        p.a.post_send(now, v.qa, write_wr(1, &src, &dst, 0, 4096))
            .unwrap();
        let deadline = p.now + Duration::from_secs(1);
        assert!(p.run_until(deadline, |p| p.b.mr(dst.lkey).unwrap() == &data[..]));
        // A 4 KiB WRITE is one DATA packet: 52 bytes of header, the
        // payload, and the trailer if one was agreed.
        let want = 52 + 4096 + if trailer { 4 } else { 0 };
        assert_eq!(sizes.borrow().first(), Some(&want));
    }
}

fn psk_config(key: u8) -> EndpointConfig {
    EndpointConfig {
        psk: Some(metaroce_proto::Psk::new([key; 32])),
        ..crc_config()
    }
}

#[test]
fn sealed_connection_carries_every_operation_over_a_lossy_link() {
    for (seed, gather) in [(11, false), (12, true)] {
        let o = exchange(psk_config(7), seed, 0.02, 0.1, false, gather);
        assert!(o.all_succeeded, "seed {seed}: {o:?}");
        assert_eq!(o.wrong_bytes, 0, "seed {seed}: {o:?}");
        assert!(o.flipped > 10, "seed {seed}: {o:?}");
        // Every tampered datagram fails its tag (or names no connection).
        assert!(o.bad_integrity * 10 >= o.flipped * 8, "seed {seed}: {o:?}");
        assert!(
            o.bad_integrity <= o.flipped + o.duplicated,
            "seed {seed}: {o:?}"
        );
    }
}

#[test]
fn sealed_datagrams_hide_the_payload_and_say_so() {
    let mut p = Pair::new(psk_config(7), psk_config(7), 21, LinkConfig::perfect());
    p.connect();
    let (ca, cb) = (p.conn_a.unwrap(), p.conn_b.unwrap());
    assert_eq!(
        p.a.connection_protection(ca),
        Some(metaroce_proto::Protection::Aes128Gcm)
    );
    assert_eq!(
        p.b.connection_protection(cb),
        Some(metaroce_proto::Protection::Aes128Gcm)
    );
    let wire = std::rc::Rc::new(std::cell::RefCell::new(Vec::new()));
    let seen = wire.clone();
    p.on_wire = Some(Box::new(move |to_b, bytes: &mut Vec<u8>| {
        if to_b {
            seen.borrow_mut().push(bytes.clone());
        }
    }));
    let v = Verbs::setup(&mut p);
    let data = vec![0x5au8; 64 * 1024];
    let (src, dst) = write_regions(&mut p.a, v.pda, &mut p.b, v.pdb, &data);
    let now = p.now;
    p.a.post_send(now, v.qa, write_wr(1, &src, &dst, 0, data.len() as u32))
        .unwrap();
    let deadline = p.now + Duration::from_secs(1);
    assert!(p.run_until(deadline, |p| p.b.mr(dst.lkey).unwrap() == &data[..]));
    let wire = wire.borrow();
    assert!(wire.len() >= 16);
    for dg in wire.iter() {
        // No run of the payload's byte survives in the sealed datagram.
        assert!(
            !dg.windows(16).any(|w| w.iter().all(|&b| b == 0x5a)),
            "the payload is encrypted"
        );
    }
}

#[test]
fn a_client_with_another_key_is_refused_and_told() {
    for client in [psk_config(8), crc_config()] {
        let mut p = Pair::new(client, psk_config(7), 31, LinkConfig::perfect());
        let c = p.a.connect(p.now, p.b_addr).unwrap();
        p.conn_a = Some(c);
        let deadline = p.now + Duration::from_secs(5);
        p.run_until(deadline, |p| {
            p.events_a
                .iter()
                .any(|e| matches!(e, metaroce_proto::Event::ConnectionLost { .. }))
        });
        assert!(p.conn_b.is_none(), "the server created no connection");
        assert_eq!(p.b.established_connections(), 0);
        assert!(p.b.stats().rejects.get(RejectReason::BadKey) >= 1);
        assert!(
            p.events_a.iter().any(|e| matches!(
                e,
                metaroce_proto::Event::ConnectionLost {
                    error: metaroce_proto::ConnectionError::KeyRefused,
                    ..
                }
            )),
            "{:?}",
            p.events_a
        );
        // Refused at the first HELLO with a cookie: well within a second.
        assert!(p.now < metaroce_proto::Instant::from_nanos(1_000_000_000));
    }
    // A client with a key against a server without one: refused too.
    let mut p = Pair::new(psk_config(7), crc_config(), 32, LinkConfig::perfect());
    let c = p.a.connect(p.now, p.b_addr).unwrap();
    p.conn_a = Some(c);
    let deadline = p.now + Duration::from_secs(5);
    p.run_until(deadline, |p| !p.events_a.is_empty());
    assert!(
        matches!(
            p.events_a.first(),
            Some(metaroce_proto::Event::ConnectionLost {
                error: metaroce_proto::ConnectionError::KeyRefused,
                ..
            })
        ),
        "{:?}",
        p.events_a
    );
}

#[test]
fn tampered_and_replayed_datagrams_are_refused() {
    let mut p = Pair::new(psk_config(7), psk_config(7), 41, LinkConfig::perfect());
    p.connect();
    let v = Verbs::setup(&mut p);
    // Keep a copy of every DATA datagram to B, to replay later.
    let kept = std::rc::Rc::new(std::cell::RefCell::new(Vec::new()));
    let seen = kept.clone();
    p.on_wire = Some(Box::new(move |to_b, bytes: &mut Vec<u8>| {
        if to_b && bytes.len() > 1000 {
            seen.borrow_mut().push(bytes.clone());
        }
    }));
    let data = pattern(9, 32 * 1024);
    let (src, dst) = write_regions(&mut p.a, v.pda, &mut p.b, v.pdb, &data);
    let now = p.now;
    p.a.post_send(now, v.qa, write_wr(1, &src, &dst, 0, data.len() as u32))
        .unwrap();
    let deadline = p.now + Duration::from_secs(1);
    assert!(p.run_until(deadline, |p| p.b.mr(dst.lkey).unwrap() == &data[..]));
    p.on_wire = None;
    let kept = kept.borrow().clone();
    assert!(!kept.is_empty());
    // Overwrite the destination: a replay that got through would write it.
    p.b.mr_mut(dst.lkey).unwrap().fill(0xee);
    let from = std::net::SocketAddr::new(p.a_addr.ip(), 50_000);
    let now = p.now;
    let before = p.b.stats().rejects;
    // A flipped bit anywhere (header, ciphertext, tag or sequence number):
    // refused by its tag.
    let mut dg = kept[0].clone();
    for at in [9, 100, dg.len() - 20, dg.len() - 1] {
        dg[at] ^= 0x10;
        p.b.handle_datagram(now, from, metaroce_proto::Ecn::NotEct, &dg);
        dg[at] ^= 0x10;
    }
    let after = p.b.stats().rejects;
    assert_eq!(
        after.get(RejectReason::BadIntegrity) - before.get(RejectReason::BadIntegrity),
        4
    );
    // Replays: authentic, refused by the connection's CSN window.
    for dg in &kept {
        p.b.handle_datagram(now, from, metaroce_proto::Ecn::NotEct, dg);
    }
    let replayed = p.b.stats().rejects;
    assert_eq!(
        replayed.get(RejectReason::BadIntegrity),
        after.get(RejectReason::BadIntegrity)
    );
    assert_eq!(
        replayed.get(RejectReason::Duplicate) - after.get(RejectReason::Duplicate),
        kept.len() as u64
    );
    assert!(
        p.b.mr(dst.lkey).unwrap().iter().all(|&b| b == 0xee),
        "no replayed byte was placed"
    );
}

#[test]
fn an_accept_with_a_wrong_proof_is_ignored_and_the_handshake_goes_on() {
    let mut p = Pair::new(psk_config(7), psk_config(7), 51, LinkConfig::perfect());
    let forged = std::rc::Rc::new(std::cell::Cell::new(0));
    let seen = forged.clone();
    p.on_wire = Some(Box::new(move |to_b, bytes: &mut Vec<u8>| {
        // The server's first ACCEPT, its proof's last byte flipped.
        if !to_b && bytes.get(1) == Some(&0x12) && seen.get() == 0 {
            let last = bytes.len() - 1;
            bytes[last] ^= 1;
            seen.set(1);
        }
    }));
    p.connect();
    assert_eq!(forged.get(), 1);
    assert_eq!(p.a.stats().rejects.get(RejectReason::BadKey), 1);
    assert_eq!(
        p.a.connection_protection(p.conn_a.unwrap()),
        Some(metaroce_proto::Protection::Aes128Gcm)
    );
    // And the connection works.
    let v = Verbs::setup(&mut p);
    let data = pattern(4, 10_000);
    let (src, dst) = write_regions(&mut p.a, v.pda, &mut p.b, v.pdb, &data);
    let now = p.now;
    p.a.post_send(now, v.qa, write_wr(1, &src, &dst, 0, 10_000))
        .unwrap();
    let deadline = p.now + Duration::from_secs(1);
    assert!(p.run_until(deadline, |p| p.b.mr(dst.lkey).unwrap() == &data[..]));
}
