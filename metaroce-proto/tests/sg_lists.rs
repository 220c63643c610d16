//! Scatter/gather lists: requests gathered from several local buffers and
//! receives (and READ destinations) scattered over several, over lossy
//! links, copied and gathered (zero-copy) transmits; the checks of every
//! element at post time, and the references that hold their regions.

mod common;

use common::*;
use metaroce_proto::consts::MAX_SGE;
use metaroce_proto::verbs::*;
use metaroce_proto::{EndpointConfig, Gather};
use std::time::Duration;

/// Endpoints that batch up to 8 segments per GSO send.
fn gso8() -> EndpointConfig {
    EndpointConfig {
        max_gso_segments: 8,
        ..EndpointConfig::default()
    }
}

/// A connected pair over a link losing `loss` of its packets, sending in
/// GSO batches of 8; payloads of at least `gather` bytes are sent from
/// their regions in place.
fn pair(seed: u64, loss: f64, gather: Option<usize>) -> (Pair, Verbs) {
    pair_with(gso8(), seed, loss, gather)
}

fn pair_with(cfg: EndpointConfig, seed: u64, loss: f64, gather: Option<usize>) -> (Pair, Verbs) {
    let link = if loss > 0.0 {
        LinkConfig::lossy(loss)
    } else {
        LinkConfig::perfect()
    };
    let mut p = Pair::new(cfg.clone(), cfg, seed, link);
    p.gather = gather.map(Gather::new);
    p.connect();
    let v = Verbs::setup(&mut p);
    (p, v)
}

fn sge(mr: &MrInfo, offset: u64, len: u32) -> Sge {
    Sge {
        lkey: mr.lkey,
        addr: mr.addr + offset,
        len,
    }
}

fn list(sges: &[Sge]) -> SgList {
    SgList::try_from(sges).unwrap()
}

/// The bytes `sges` name, in order, out of `ep`'s regions.
fn gathered(ep: &metaroce_proto::Endpoint, regions: &[MrInfo], sges: &[Sge]) -> Vec<u8> {
    let mut out = Vec::new();
    for s in sges {
        let mr = regions.iter().find(|m| m.lkey == s.lkey).unwrap();
        let at = (s.addr - mr.addr) as usize;
        out.extend_from_slice(&ep.mr(s.lkey).unwrap()[at..at + s.len as usize]);
    }
    out
}

/// SENDs gathered from 3 elements in 2 regions (one region named twice,
/// elements of odd lengths, not multiples of a segment) land in receives of
/// 2 elements in 2 regions, split where the receive says; over a lossy
/// link, so retransmissions must read the same bytes as the first
/// transmissions. Bytes outside the elements stay untouched.
fn send_gathered_and_scattered(seed: u64, loss: f64, gather: Option<usize>, gso: bool) {
    let cfg = if gso {
        gso8()
    } else {
        EndpointConfig::default()
    };
    let (mut p, v) = pair_with(cfg, seed, loss, gather);
    let a1 = reg(
        &mut p.a,
        v.pda,
        pattern(seed, 40_000),
        0x10_000,
        AccessFlags::NONE,
    );
    let a2 = reg(
        &mut p.a,
        v.pda,
        pattern(seed + 1, 20_000),
        0x90_000,
        AccessFlags::NONE,
    );
    let rounds = 12u64;
    let b1 = reg(
        &mut p.b,
        v.pdb,
        vec![0; 7_000 * rounds as usize],
        0x1000,
        AccessFlags::LOCAL_WRITE,
    );
    let b2 = reg(
        &mut p.b,
        v.pdb,
        vec![0; 12_100 * rounds as usize],
        0x40_000,
        AccessFlags::LOCAL_WRITE,
    );
    let mut sends = Vec::new();
    let mut recvs = Vec::new();
    for i in 0..rounds {
        // 5,000 + 9,001 + 3,333 + i bytes: 17,334 + i.
        let s = [
            sge(&a1, 100 + i * 7, 5_000),
            sge(&a2, 3 + i * 11, 9_001),
            sge(&a1, 20_000 + i * 13, 3_333 + i as u32),
        ];
        // 7,000 then 12,000: the message splits 7,000 in, inside the
        // gathered second element.
        let r = [
            sge(&b1, i * 7_000, 7_000),
            sge(&b2, 50 + i * 12_100, 12_000),
        ];
        p.b.post_recv(v.qb, RecvWr::new(100 + i, list(&r))).unwrap();
        sends.push(s);
        recvs.push(r);
    }
    let now = p.now;
    for (i, s) in sends.iter().enumerate() {
        p.a.post_send(now, v.qa, SendWr::new(i as u64, SendOp::Send, list(s)))
            .unwrap();
    }
    let wa = wait_cq(&mut p, true, v.cqa, rounds as usize, Duration::from_secs(5));
    let wb = wait_cq(
        &mut p,
        false,
        v.cqb,
        rounds as usize,
        Duration::from_secs(1),
    );
    let at = format!("seed {seed}, loss {loss}, gather {gather:?}, gso {gso}");
    for i in 0..rounds as usize {
        let len = 17_334 + i as u32;
        assert_eq!(
            (wa[i].wr_id, wa[i].status, wa[i].byte_len),
            (i as u64, WcStatus::Success, len),
            "{at}"
        );
        assert_eq!(
            (wb[i].wr_id, wb[i].status, wb[i].byte_len),
            (100 + i as u64, WcStatus::Success, len),
            "{at}"
        );
        let sent = gathered(&p.a, &[a1, a2], &sends[i]);
        assert_eq!(sent.len(), len as usize);
        let got = gathered(&p.b, &[b1, b2], &recvs[i]);
        assert!(
            got[..len as usize] == sent[..],
            "{at}: message {i} corrupted"
        );
        assert!(
            got[len as usize..].iter().all(|&x| x == 0),
            "{at}: bytes past message {i}"
        );
    }
    // Nothing outside the receives' elements was written.
    let b2_bytes = p.b.mr(b2.lkey).unwrap();
    for i in 0..rounds as usize {
        let slot = &b2_bytes[i * 12_100..(i + 1) * 12_100];
        assert!(slot[..50].iter().all(|&x| x == 0), "{at}");
        assert!(slot[50 + 12_000..].iter().all(|&x| x == 0), "{at}");
    }
    if loss > 0.0 {
        let s = p.a.connection_stats(p.conn_a.unwrap()).unwrap();
        assert!(s.retransmits > 0, "{at}: the link lost packets: {s:?}");
    }
    assert_eq!(p.b.stats().rejects.inconsistent, 0, "{at}");
    // Every reference was given back: all four regions deregister.
    p.run_for(Duration::from_millis(5));
    for m in [a1, a2] {
        assert!(p.a.dereg_mr(m.lkey).is_ok(), "{at}");
    }
    for m in [b1, b2] {
        assert!(p.b.dereg_mr(m.lkey).is_ok(), "{at}");
    }
}

#[test]
fn send_from_three_elements_into_a_receive_of_two_over_a_lossy_link() {
    // Packets one by one, and in GSO batches (whose segments after the
    // first follow the first's element).
    for gso in [false, true] {
        send_gathered_and_scattered(1, 0.05, None, gso);
        send_gathered_and_scattered(2, 0.0, None, gso);
        // Payloads of 1,024 bytes and more sent from their regions in place.
        send_gathered_and_scattered(3, 0.05, Some(1_024), gso);
    }
}

#[test]
fn write_gathered_from_two_elements() {
    for (seed, loss, gather) in [(10, 0.03, None), (11, 0.03, Some(1_024))] {
        let (mut p, v) = pair(seed, loss, gather);
        let a1 = reg(
            &mut p.a,
            v.pda,
            pattern(seed, 200_000),
            0,
            AccessFlags::NONE,
        );
        let a2 = reg(
            &mut p.a,
            v.pda,
            pattern(seed + 1, 300_000),
            0x100_000,
            AccessFlags::NONE,
        );
        let win = reg(
            &mut p.b,
            v.pdb,
            vec![0; 500_000],
            0x8000,
            AccessFlags::REMOTE_WRITE,
        );
        let s = [sge(&a1, 1, 123_457), sge(&a2, 4_096, 250_001)];
        let r = RemoteAddr {
            rkey: win.rkey,
            addr: win.addr + 10,
        };
        let now = p.now;
        p.a.post_send(now, v.qa, SendWr::new(5, SendOp::Write(r), list(&s)))
            .unwrap();
        let wa = wait_cq(&mut p, true, v.cqa, 1, Duration::from_secs(5));
        assert_eq!((wa[0].status, wa[0].byte_len), (WcStatus::Success, 373_458));
        let sent = gathered(&p.a, &[a1, a2], &s);
        let got = p.b.mr(win.lkey).unwrap();
        assert!(
            got[10..10 + sent.len()] == sent[..],
            "seed {seed}: corrupted"
        );
        assert!(got[..10].iter().all(|&x| x == 0));
        assert!(got[10 + sent.len()..].iter().all(|&x| x == 0));
        let st = p.a.connection_stats(p.conn_a.unwrap()).unwrap();
        assert!(st.retransmits > 0, "{st:?}");
    }
}

#[test]
fn read_scattered_into_two_elements() {
    let (mut p, v) = pair(20, 0.06, None);
    let data = pattern(20, 400_000);
    let win = reg(
        &mut p.b,
        v.pdb,
        data.clone(),
        0x4000,
        AccessFlags::REMOTE_READ,
    );
    let d1 = reg(
        &mut p.a,
        v.pda,
        vec![0; 200_000],
        0,
        AccessFlags::LOCAL_WRITE,
    );
    let d2 = reg(
        &mut p.a,
        v.pda,
        vec![0; 300_000],
        0x100_000,
        AccessFlags::LOCAL_WRITE,
    );
    // A split in the middle of a response packet: 100,001 is no multiple
    // of a segment.
    let s = [sge(&d2, 7, 100_001), sge(&d1, 50_000, 149_999)];
    let r = RemoteAddr {
        rkey: win.rkey,
        addr: win.addr + 333,
    };
    let now = p.now;
    p.a.post_send(now, v.qa, SendWr::new(6, SendOp::Read(r), list(&s)))
        .unwrap();
    let wa = wait_cq(&mut p, true, v.cqa, 1, Duration::from_secs(5));
    assert_eq!((wa[0].status, wa[0].byte_len), (WcStatus::Success, 250_000));
    let got = gathered(&p.a, &[d1, d2], &s);
    assert!(got[..] == data[333..333 + 250_000], "READ corrupted");
    let m1 = p.a.mr(d1.lkey).unwrap();
    assert!(m1[..50_000].iter().all(|&x| x == 0));
    assert!(m1[50_000 + 149_999..].iter().all(|&x| x == 0));
    let m2 = p.a.mr(d2.lkey).unwrap();
    assert!(m2[..7].iter().all(|&x| x == 0));
    assert!(m2[7 + 100_001..].iter().all(|&x| x == 0));
    let st = p.b.connection_stats(p.conn_b.unwrap()).unwrap();
    assert!(st.retransmits > 0, "responses were lost: {st:?}");
    p.run_for(Duration::from_millis(5));
    assert!(p.a.dereg_mr(d1.lkey).is_ok() && p.a.dereg_mr(d2.lkey).is_ok());
}

#[test]
fn a_send_longer_than_the_receives_elements_fails_with_the_verbs_statuses() {
    let (mut p, v) = pair(30, 0.0, None);
    let src = reg(&mut p.a, v.pda, vec![3; 1000], 0, AccessFlags::NONE);
    let rb = reg(&mut p.b, v.pdb, vec![0; 1000], 0, AccessFlags::LOCAL_WRITE);
    // 100 + 150 bytes of receive for a 251-byte SEND from two elements.
    let r = [sge(&rb, 0, 100), sge(&rb, 500, 150)];
    p.b.post_recv(v.qb, RecvWr::new(1, list(&r))).unwrap();
    p.b.post_recv(v.qb, RecvWr::new(2, list(&r))).unwrap();
    let s = [sge(&src, 0, 200), sge(&src, 300, 51)];
    let now = p.now;
    p.a.post_send(now, v.qa, SendWr::new(1, SendOp::Send, list(&s)))
        .unwrap();
    let wa = wait_cq(&mut p, true, v.cqa, 1, Duration::from_millis(50));
    assert_eq!(wa[0].status, WcStatus::RemoteInvalidRequest);
    let wb = drain_cq(&mut p.b, v.cqb);
    assert_eq!(
        wb.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
        vec![(1, WcStatus::LocalLengthError), (2, WcStatus::WrFlushError)]
    );
    assert!(p.b.mr(rb.lkey).unwrap().iter().all(|&x| x == 0));
    // Exactly as long fits.
    let (mut p, v) = pair(31, 0.0, None);
    let src = reg(&mut p.a, v.pda, pattern(31, 1000), 0, AccessFlags::NONE);
    let rb = reg(&mut p.b, v.pdb, vec![0; 1000], 0, AccessFlags::LOCAL_WRITE);
    let r = [sge(&rb, 0, 100), sge(&rb, 500, 150)];
    p.b.post_recv(v.qb, RecvWr::new(1, list(&r))).unwrap();
    let s = [sge(&src, 0, 200), sge(&src, 300, 50)];
    let now = p.now;
    p.a.post_send(now, v.qa, SendWr::new(1, SendOp::Send, list(&s)))
        .unwrap();
    let wb = wait_cq(&mut p, false, v.cqb, 1, Duration::from_millis(50));
    assert_eq!((wb[0].status, wb[0].byte_len), (WcStatus::Success, 250));
    assert_eq!(
        gathered(&p.b, &[rb], &r),
        gathered(&p.a, &[src], &s),
        "the 250 bytes"
    );
}

#[test]
fn too_many_elements_are_refused_with_a_typed_error() {
    let (mut p, v) = pair(40, 0.0, None);
    let src = reg(&mut p.a, v.pda, vec![1; 100], 0, AccessFlags::LOCAL_WRITE);
    let rb = reg(&mut p.b, v.pdb, vec![0; 100], 0, AccessFlags::LOCAL_WRITE);
    // A list holds at most MAX_SGE.
    let five = [sge(&src, 0, 10); MAX_SGE + 1];
    assert_eq!(
        SgList::try_from(&five[..]),
        Err(VerbsError::TooManySge {
            n: MAX_SGE + 1,
            max: MAX_SGE as u32
        })
    );
    let mut l = SgList::try_from(&five[..MAX_SGE]).unwrap();
    assert!(matches!(
        l.push(five[0]),
        Err(VerbsError::TooManySge { .. })
    ));
    // Capacities outside 1..=MAX_SGE are refused at creation.
    for (s, r) in [
        (0, 1),
        (1, 0),
        (MAX_SGE as u32 + 1, 1),
        (1, MAX_SGE as u32 + 1),
    ] {
        let init = QpInit {
            max_send_sge: s,
            max_recv_sge: r,
            ..QpInit::new(v.pda, v.cqa, v.cqa)
        };
        assert!(
            matches!(p.a.create_qp(init), Err(VerbsError::InvalidAttribute(_))),
            "{s} {r}"
        );
    }
    // QPs taking 2 send and 1 receive elements.
    let caps = |pd, cq| QpInit {
        max_send_sge: 2,
        max_recv_sge: 1,
        ..QpInit::new(pd, cq, cq)
    };
    let qa = p.a.create_qp(caps(v.pda, v.cqa)).unwrap();
    let qb = p.b.create_qp(caps(v.pdb, v.cqb)).unwrap();
    p.a.connect_qp(qa, p.conn_a.unwrap(), qb).unwrap();
    p.b.connect_qp(qb, p.conn_b.unwrap(), qa).unwrap();
    let three = list(&[sge(&src, 0, 10), sge(&src, 10, 10), sge(&src, 20, 10)]);
    let now = p.now;
    assert_eq!(
        p.a.post_send(now, qa, SendWr::new(1, SendOp::Send, three)),
        Err(VerbsError::TooManySge { n: 3, max: 2 })
    );
    let two_r = list(&[sge(&rb, 0, 50), sge(&rb, 50, 50)]);
    assert_eq!(
        p.b.post_recv(qb, RecvWr::new(1, two_r)),
        Err(VerbsError::TooManySge { n: 2, max: 1 })
    );
    // Nothing was queued or referenced: the regions deregister, and the
    // QPs go on with requests within their capacities.
    p.b.post_recv(qb, RecvWr::new(2, sge(&rb, 0, 100))).unwrap();
    let two = list(&[sge(&src, 0, 10), sge(&src, 90, 10)]);
    p.a.post_send(now, qa, SendWr::new(3, SendOp::Send, two))
        .unwrap();
    let wb = wait_cq(&mut p, false, v.cqb, 1, Duration::from_millis(50));
    assert_eq!(
        (wb[0].wr_id, wb[0].status, wb[0].byte_len),
        (2, WcStatus::Success, 20)
    );
    let wa = wait_cq(&mut p, true, v.cqa, 1, Duration::from_millis(50));
    assert_eq!((wa[0].wr_id, wa[0].status), (3, WcStatus::Success));
    assert!(p.a.dereg_mr(src.lkey).is_ok());
    assert!(p.b.dereg_mr(rb.lkey).is_ok());
}

#[test]
fn every_element_is_checked_when_posted() {
    let (mut p, v) = pair(50, 0.0, None);
    let ok = reg(&mut p.b, v.pdb, vec![0; 100], 0, AccessFlags::LOCAL_WRITE);
    let ro = reg(&mut p.b, v.pdb, vec![0; 100], 0x1000, AccessFlags::NONE);
    let good = sge(&ok, 0, 50);
    let cases = [
        (sge(&ro, 0, 10), "no LOCAL_WRITE"),
        (sge(&ok, 60, 50), "out of bounds"),
        (
            Sge {
                lkey: 0xdead,
                addr: 0,
                len: 10,
            },
            "no such region",
        ),
    ];
    for (bad, why) in cases {
        let r = p.b.post_recv(v.qb, RecvWr::new(1, list(&[good, bad])));
        assert!(r.is_err(), "{why}: {r:?}");
    }
    // The good element took no reference.
    assert!(p.b.dereg_mr(ok.lkey).is_ok());
    // A send with a bad second element completes with a local protection
    // error; the first element's region is not held.
    let src = reg(&mut p.a, v.pda, vec![1; 100], 0, AccessFlags::NONE);
    let bad = Sge {
        lkey: 0xdead,
        addr: 0,
        len: 10,
    };
    let now = p.now;
    p.a.post_send(
        now,
        v.qa,
        SendWr::new(1, SendOp::Send, list(&[sge(&src, 0, 10), bad])),
    )
    .unwrap();
    let wa = wait_cq(&mut p, true, v.cqa, 1, Duration::from_millis(50));
    assert_eq!(wa[0].status, WcStatus::LocalProtectionError);
    assert!(p.a.dereg_mr(src.lkey).is_ok());
}

#[test]
fn regions_of_posted_multi_element_requests_do_not_deregister() {
    let (mut p, v) = pair(60, 0.0, None);
    let a1 = reg(&mut p.a, v.pda, pattern(60, 100), 0, AccessFlags::NONE);
    let a2 = reg(&mut p.a, v.pda, pattern(61, 100), 0x1000, AccessFlags::NONE);
    let b1 = reg(&mut p.b, v.pdb, vec![0; 100], 0, AccessFlags::LOCAL_WRITE);
    let b2 = reg(
        &mut p.b,
        v.pdb,
        vec![0; 100],
        0x1000,
        AccessFlags::LOCAL_WRITE,
    );
    // No receive yet: the SEND waits (RNR, retried forever) holding both
    // of its regions; the second element's as much as the first's.
    let s = [sge(&a1, 0, 60), sge(&a2, 0, 70)];
    let now = p.now;
    p.a.post_send(now, v.qa, SendWr::new(1, SendOp::Send, list(&s)))
        .unwrap();
    p.run_for(Duration::from_millis(2));
    assert!(drain_cq(&mut p.a, v.cqa).is_empty());
    assert!(matches!(p.a.dereg_mr(a2.lkey), Err(VerbsError::MrInUse(1))));
    assert!(matches!(p.a.dereg_mr(a1.lkey), Err(VerbsError::MrInUse(1))));
    let r = [sge(&b1, 0, 65), sge(&b2, 5, 65)];
    p.b.post_recv(v.qb, RecvWr::new(9, list(&r))).unwrap();
    assert!(matches!(p.b.dereg_mr(b2.lkey), Err(VerbsError::MrInUse(1))));
    let wb = wait_cq(&mut p, false, v.cqb, 1, Duration::from_millis(100));
    assert_eq!((wb[0].status, wb[0].byte_len), (WcStatus::Success, 130));
    let wa = wait_cq(&mut p, true, v.cqa, 1, Duration::from_millis(100));
    assert_eq!(wa[0].status, WcStatus::Success);
    assert_eq!(gathered(&p.b, &[b1, b2], &r), gathered(&p.a, &[a1, a2], &s));
    for m in [a1, a2] {
        assert!(p.a.dereg_mr(m.lkey).is_ok());
    }
    for m in [b1, b2] {
        assert!(p.b.dereg_mr(m.lkey).is_ok());
    }
}
