//! A peer that breaks the protocol, or the application that deregisters
//! memory under traffic, must never get bytes written where the application
//! did not allow them, nor stall or crash the endpoint. Each test rewrites,
//! forges or withholds datagrams on the wire of an in-memory pair, and
//! checks the verbs outcome: the completions (status, length) and the
//! bytes of every region.

mod common;

use common::*;
use metaroce_proto::consts::COOKIE_LEN;
use metaroce_proto::verbs::*;
use metaroce_proto::wire::{
    AckPacket, CookieReply, DataHeader, Hello, NakCode, Opcode, OpcodeExt, PacketType,
};
use metaroce_proto::{
    ConnectionError, Ecn, Endpoint, EndpointConfig, Event, Instant, RejectReason,
};
use std::cell::{Cell, RefCell};
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::Duration;

/// Both sides: no ACK coalesced in front of DATA, so every DATA datagram
/// starts with its header and a hook can rewrite it.
fn config() -> EndpointConfig {
    EndpointConfig {
        coalesce_acks: false,
        ..EndpointConfig::default()
    }
}

fn pair(link: LinkConfig) -> (Pair, Verbs) {
    let mut p = Pair::new(config(), config(), 11, link);
    p.connect();
    let v = Verbs::setup(&mut p);
    (p, v)
}

fn reg(ep: &mut Endpoint, pd: PdHandle, data: Vec<u8>, access: AccessFlags) -> MrInfo {
    ep.reg_mr(pd, data.into_boxed_slice(), 0, access).unwrap()
}

fn sge(mr: &MrInfo, addr: u64, len: u32) -> Sge {
    Sge {
        lkey: mr.lkey,
        addr,
        len,
    }
}

/// Rewrites, on the way from A to B, every DATA packet `f` changes.
fn rewrite_data(p: &mut Pair, mut f: impl FnMut(&mut DataHeader) -> bool + 'static) {
    p.on_wire = Some(Box::new(move |to_b, bytes| {
        if !to_b {
            return;
        }
        let Ok((mut h, payload)) = DataHeader::parse(bytes) else {
            return;
        };
        if f(&mut h) {
            let payload = payload.to_vec();
            let mut out = vec![0u8; bytes.len() + 64];
            let n = h.emit(&mut out, &payload).unwrap();
            out.truncate(n);
            *bytes = out;
        }
    }));
}

fn completions(p: &mut Pair, a: bool, cq: CqHandle) -> Vec<WorkCompletion> {
    drain_cq(if a { &mut p.a } else { &mut p.b }, cq)
}

/// Report 1: a SEND is placed in the receive its `recv_seq` names but was
/// completed on the oldest receive, so a SEND that names a later, larger
/// receive completed a smaller one with a `byte_len` beyond its buffer.
/// Now the requester's SEND fails (remote invalid request), nothing lands
/// in the later receive's buffer, and no receive completes successfully.
#[test]
fn send_that_names_a_later_receive_completes_none() {
    let (mut p, v) = pair(LinkConfig::perfect());
    let src = reg(&mut p.a, v.pda, pattern(1, 1000), AccessFlags::NONE);
    let small = reg(&mut p.b, v.pdb, vec![0; 100], AccessFlags::LOCAL_WRITE);
    let big = reg(&mut p.b, v.pdb, vec![0; 4096], AccessFlags::LOCAL_WRITE);
    p.b.post_recv(
        v.qb,
        RecvWr {
            wr_id: 10,
            sge: sge(&small, 0, 100).into(),
        },
    )
    .unwrap();
    p.b.post_recv(
        v.qb,
        RecvWr {
            wr_id: 11,
            sge: sge(&big, 0, 4096).into(),
        },
    )
    .unwrap();
    rewrite_data(&mut p, |h| match &mut h.ext {
        OpcodeExt::Send { recv_seq } => {
            *recv_seq = recv_seq.wrapping_add(1);
            true
        }
        _ => false,
    });
    let now = p.now;
    p.a.post_send(now, v.qa, SendWr::new(1, SendOp::Send, sge(&src, 0, 1000)))
        .unwrap();
    p.run_for(Duration::from_millis(50));
    let wa = completions(&mut p, true, v.cqa);
    assert_eq!(wa.len(), 1, "{wa:?}");
    assert_eq!(wa[0].status, WcStatus::RemoteInvalidRequest);
    for wc in completions(&mut p, false, v.cqb) {
        assert_ne!(wc.status, WcStatus::Success, "{wc:?}");
    }
    assert!(p.b.mr(big.lkey).unwrap().iter().all(|&b| b == 0));
    assert!(p.b.mr(small.lkey).unwrap().iter().all(|&b| b == 0));
}

/// Report 1, second shape: two SENDs name the same receive. The first
/// completes it; the second must not complete the next receive (whose
/// buffer it never filled), nor be dropped silently for ever: it fails
/// with a remote invalid request.
#[test]
fn two_sends_naming_one_receive() {
    let (mut p, v) = pair(LinkConfig::perfect());
    let src = reg(&mut p.a, v.pda, pattern(2, 128), AccessFlags::NONE);
    let dst = reg(&mut p.b, v.pdb, vec![0; 256], AccessFlags::LOCAL_WRITE);
    p.b.post_recv(
        v.qb,
        RecvWr {
            wr_id: 10,
            sge: sge(&dst, 0, 128).into(),
        },
    )
    .unwrap();
    p.b.post_recv(
        v.qb,
        RecvWr {
            wr_id: 11,
            sge: sge(&dst, 128, 128).into(),
        },
    )
    .unwrap();
    let first = Rc::new(Cell::new(None::<u32>));
    let seen = first.clone();
    rewrite_data(&mut p, move |h| match &mut h.ext {
        OpcodeExt::Send { recv_seq } => match seen.get() {
            None => {
                seen.set(Some(*recv_seq));
                false
            }
            Some(s) => {
                *recv_seq = s;
                true
            }
        },
        _ => false,
    });
    let now = p.now;
    for id in [1, 2] {
        p.a.post_send(now, v.qa, SendWr::new(id, SendOp::Send, sge(&src, 0, 64)))
            .unwrap();
    }
    p.run_for(Duration::from_millis(50));
    let wa = completions(&mut p, true, v.cqa);
    let status: Vec<_> = wa.iter().map(|w| (w.wr_id, w.status)).collect();
    assert_eq!(
        status,
        [(1, WcStatus::Success), (2, WcStatus::RemoteInvalidRequest)]
    );
    let wb = completions(&mut p, false, v.cqb);
    let got: Vec<_> = wb.iter().map(|w| (w.wr_id, w.status)).collect();
    assert_eq!(got, [(10, WcStatus::Success), (11, WcStatus::WrFlushError)]);
    let mem = p.b.mr(dst.lkey).unwrap();
    assert_eq!(&mem[..64], &pattern(2, 128)[..64]);
    assert!(mem[128..].iter().all(|&b| b == 0));
}

/// Report 2: a region deregistered while a WRITE into it is under way, and
/// a new region registered after it (in the same slot, at the same
/// address, without remote write): the rest of the WRITE must not land in
/// the new region, whatever its key. Before, keys repeated about once in
/// 256 registrations of a slot and placement did not check the rights.
#[test]
fn write_under_way_never_lands_in_a_region_registered_after_its_target() {
    let link = LinkConfig {
        bytes_per_us: 1_000,
        ..LinkConfig::perfect()
    };
    let (mut p, v) = pair(link);
    let len = 1 << 20;
    let data = pattern(3, len);
    let (src, x) = write_regions(&mut p.a, v.pda, &mut p.b, v.pdb, &data);
    let now = p.now;
    p.a.post_send(now, v.qa, write_wr(1, &src, &x, 0, len as u32))
        .unwrap();
    let started = p.run_until(p.now + Duration::from_secs(1), |p| {
        p.b.mr(x.lkey).unwrap()[0] != 0
    });
    assert!(
        started && p.b.mr(x.lkey).unwrap()[len - 1] == 0,
        "mid-WRITE"
    );
    p.b.dereg_mr(x.lkey).unwrap();
    // Register again and again, looking for the old key.
    let mut y = None;
    for _ in 0..20_000 {
        let m = reg(&mut p.b, v.pdb, vec![0; len], AccessFlags::LOCAL_WRITE);
        assert_ne!(m.lkey, x.lkey);
        if m.rkey == x.rkey {
            y = Some(m);
            break;
        }
        p.b.dereg_mr(m.lkey).unwrap();
    }
    let y = y.unwrap_or_else(|| reg(&mut p.b, v.pdb, vec![0; len], AccessFlags::LOCAL_WRITE));
    p.run_for(Duration::from_millis(50));
    assert!(
        p.b.mr(y.lkey).unwrap().iter().all(|&b| b == 0),
        "the new region was written"
    );
    let wa = completions(&mut p, true, v.cqa);
    assert_eq!(wa.len(), 1);
    assert_eq!(wa[0].status, WcStatus::RemoteAccessError);
}

/// Report 3: a peer (or a forger) answering every HELLO with a new COOKIE
/// overflowed the HELLO counter (a panic in debug builds) and kept the
/// handshake going for ever. Now it ends as a handshake timeout after
/// `handshake_retries` cookies, and sends no more HELLOs.
#[test]
fn endless_cookies_end_the_handshake() {
    let mut a = Endpoint::new(config(), 5).unwrap();
    let b_addr: SocketAddr = "10.0.0.2:4791".parse().unwrap();
    let mut now = Instant::from_nanos(1_000_000);
    let conn = a.connect(now, b_addr).unwrap();
    let mut buf = vec![0u8; 65_536];
    let t = a.poll_transmit(now, &mut buf).unwrap();
    let cid = Hello::parse(&buf[..t.size]).unwrap().src_cid;
    let mut hellos = 1;
    // The first round's copies.
    while a.poll_transmit(now, &mut buf).is_some() {
        hellos += 1;
    }
    for i in 0..400u32 {
        now = now + Duration::from_micros(10);
        let mut cookie = [0u8; COOKIE_LEN];
        cookie[..4].copy_from_slice(&i.to_be_bytes());
        let mut c = [0u8; 64];
        let n = CookieReply {
            dst_cid: cid,
            cookie,
        }
        .emit(&mut c)
        .unwrap();
        a.handle_datagram(now, b_addr, Ecn::NotEct, &c[..n]);
        while let Some(t) = a.poll_transmit(now, &mut buf) {
            if buf[1] == PacketType::Hello as u8 {
                hellos += 1;
            }
            assert!(t.size > 0);
        }
    }
    let retries = usize::from(config().handshake_retries);
    // The first round and one round per cookie taken, three HELLOs each
    // (PROTOCOL §8.2).
    assert_eq!(hellos, 3 * (retries + 1), "one round per cookie taken");
    let mut lost = None;
    while let Some(e) = a.poll_event() {
        if let Event::ConnectionLost { conn: c, error } = e {
            lost = Some((c, error));
        }
    }
    assert_eq!(lost, Some((conn, ConnectionError::HandshakeTimeout)));
    assert!(a.stats().rejects.get(RejectReason::BadCookie) >= 1);
}

/// Report 4: a READ whose region is deregistered after the request arrived
/// but before it was executed (an earlier WRITE still incomplete) was
/// answered with NOPs for ever. Now it fails with a remote access error.
#[test]
fn read_whose_region_went_fails_with_remote_access() {
    let (mut p, v) = pair(LinkConfig::perfect());
    let len = 64 << 10;
    let data = pattern(4, len);
    let (src, z) = write_regions(&mut p.a, v.pda, &mut p.b, v.pdb, &data);
    let x = reg(&mut p.b, v.pdb, pattern(5, 4096), AccessFlags::REMOTE_READ);
    let l = reg(&mut p.a, v.pda, vec![0; 4096], AccessFlags::LOCAL_WRITE);
    // The WRITE's first packet is withheld until `hold` clears.
    let hold = Rc::new(Cell::new(true));
    let read_sent = Rc::new(Cell::new(false));
    let (h, r) = (hold.clone(), read_sent.clone());
    p.on_wire = Some(Box::new(move |to_b, bytes| {
        let Ok((hdr, _)) = DataHeader::parse(bytes) else {
            return;
        };
        if !to_b {
            return;
        }
        if hdr.opcode == Opcode::ReadReq {
            r.set(true);
        }
        if h.get() && hdr.opcode == Opcode::Write && hdr.msg_offset == 0 {
            bytes.truncate(3); // refused as malformed: a loss
        }
    }));
    let now = p.now;
    p.a.post_send(now, v.qa, write_wr(1, &src, &z, 0, len as u32))
        .unwrap();
    let read = SendWr::new(
        2,
        SendOp::Read(RemoteAddr {
            rkey: x.rkey,
            addr: 0,
        }),
        sge(&l, 0, 4096),
    );
    p.a.post_send(now, v.qa, read).unwrap();
    assert!(p.run_until(p.now + Duration::from_secs(1), |_| read_sent.get()));
    p.run_for(Duration::from_micros(100));
    // Admitted, not executed: the region can go.
    p.b.dereg_mr(x.lkey).unwrap();
    hold.set(false);
    p.run_for(Duration::from_millis(50));
    let wa = completions(&mut p, true, v.cqa);
    let status: Vec<_> = wa.iter().map(|w| (w.wr_id, w.status)).collect();
    assert_eq!(
        status,
        [(1, WcStatus::Success), (2, WcStatus::RemoteAccessError)]
    );
    assert!(p.a.mr(l.lkey).unwrap().iter().all(|&b| b == 0));
}

/// Report 5: an RNR NAK of a new generation, queued while the previous
/// generation's was still waiting to go, was dropped as a duplicate; the
/// requester then ignored the stale one and waited for a timeout.
#[test]
fn rnr_nak_of_a_new_generation_replaces_the_queued_one() {
    let (mut p, v) = pair(LinkConfig::perfect());
    let src = reg(&mut p.a, v.pda, pattern(6, 6000), AccessFlags::NONE);
    let mut now = p.now;
    p.a.post_send(now, v.qa, SendWr::new(1, SendOp::Send, sge(&src, 0, 6000)))
        .unwrap();
    let (a_ip, b_addr) = (p.a_addr.ip(), p.b_addr);
    let first = pump(&mut p.a, now, a_ip);
    let data: Vec<_> = first
        .into_iter()
        .filter(|(_, d)| DataHeader::parse(d).is_ok_and(|(h, _)| h.opcode == Opcode::Send))
        .collect();
    assert!(data.len() >= 2, "a SEND of two segments");
    // B refuses generation 0 (no receive); A hears it.
    p.b.handle_datagram(now, data[0].0, Ecn::NotEct, &data[0].1);
    let acks = pump(&mut p.b, now, b_addr.ip());
    assert_eq!(nak_gens(&acks), [0]);
    for (from, d) in acks {
        p.a.handle_datagram(now, from, Ecn::NotEct, &d);
    }
    // A resends as generation 1 once its RNR wait ends.
    let mut resent = Vec::new();
    for _ in 0..100 {
        now = now + Duration::from_micros(100);
        if p.a.poll_timeout().is_some_and(|t| t <= now) {
            p.a.handle_timeout(now);
        }
        resent = pump(&mut p.a, now, a_ip);
        if !resent.is_empty() {
            break;
        }
    }
    let gen1 = resent
        .iter()
        .find(|(_, d)| DataHeader::parse(d).is_ok_and(|(h, _)| h.gen == 1))
        .expect("generation 1 sent")
        .clone();
    // The second segment of generation 0 arrives late, then generation 1,
    // before B sends anything.
    p.b.handle_datagram(now, data[1].0, Ecn::NotEct, &data[1].1);
    p.b.handle_datagram(now, gen1.0, Ecn::NotEct, &gen1.1);
    let naks = nak_gens(&pump(&mut p.b, now, b_addr.ip()));
    assert_eq!(naks, [1], "the NAK B sends is generation 1's");
}

/// Every datagram `ep` sends now, as (source address, bytes).
fn pump(ep: &mut Endpoint, now: Instant, ip: std::net::IpAddr) -> Vec<(SocketAddr, Vec<u8>)> {
    let mut buf = vec![0u8; 65_536];
    let mut out = Vec::new();
    while let Some(t) = ep.poll_transmit(now, &mut buf) {
        let seg = t.segment_size.unwrap_or(t.size).max(1);
        for d in buf[..t.size].chunks(seg) {
            out.push((SocketAddr::new(ip, t.src_port), d.to_vec()));
        }
    }
    out
}

/// The generations of the RNR NAKs in `datagrams`' ACKs.
fn nak_gens(datagrams: &[(SocketAddr, Vec<u8>)]) -> Vec<u8> {
    let naks = RefCell::new(Vec::new());
    for (_, d) in datagrams {
        if let Ok(ack) = AckPacket::parse(d, |_| false) {
            naks.borrow_mut()
                .extend(ack.naks().filter(|n| n.code == NakCode::Rnr).map(|n| n.gen));
        }
    }
    naks.into_inner()
}
