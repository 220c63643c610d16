//! A SEND_IMM's or WRITE_IMM's immediate data goes in its first packet
//! only where that makes the later ones carry more payload: they go as SEND
//! or WRITE packets, 8 bytes shorter in the header and that much longer in
//! the payload (PROTOCOL §5.3); at the default MTU, where 4 KiB fits either
//! way, every packet keeps it. The receiver takes them in any order: later
//! packets first make a record without the immediate data, and the first
//! packet completes it, judging a WRITE_IMM's receive then (an RNR NAK if
//! there is none yet).

mod common;

use common::*;
use metaroce_proto::consts::DATA_HEADER_LEN;
use metaroce_proto::verbs::*;
use metaroce_proto::wire::{DataHeader, Opcode};
use metaroce_proto::EndpointConfig;
use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

/// UDP payload of a standard 1,500-byte Ethernet path.
const MTU: u16 = 1472;

fn pair_1500(seed: u64, link: LinkConfig) -> (Pair, Verbs) {
    let cfg = EndpointConfig {
        mtu: MTU,
        ..EndpointConfig::default()
    };
    let mut p = Pair::new(cfg.clone(), cfg, seed, link);
    p.connect();
    let v = Verbs::setup(&mut p);
    (p, v)
}

/// A DATA packet A sent B, as the wire carried it: (opcode, offset, payload
/// length, datagram length).
type Seen = (Opcode, u32, usize, usize);

/// Records every DATA packet from A to B; `drop_first_imm` loses the first
/// transmission of a packet with immediate data (a packet that comes
/// after the others of its message).
fn watch(p: &mut Pair, drop_first_imm: bool) -> Rc<RefCell<Vec<Seen>>> {
    let seen = Rc::new(RefCell::new(Vec::new()));
    let log = seen.clone();
    let mut dropped = false;
    p.on_wire = Some(Box::new(move |to_b, dg: &mut Vec<u8>| {
        if !to_b {
            return;
        }
        let Ok((h, payload)) = DataHeader::parse(dg) else {
            return;
        };
        if h.opcode == Opcode::Nop {
            return;
        }
        log.borrow_mut()
            .push((h.opcode, h.msg_offset, payload.len(), dg.len()));
        if drop_first_imm && !dropped && h.opcode == Opcode::WriteImm {
            dropped = true;
            dg.clear();
        }
    }));
    seen
}

/// A 16-byte receive on B's QP.
fn post_recv(p: &mut Pair, v: &Verbs, wr_id: u64) {
    let rbuf = reg(&mut p.b, v.pdb, vec![0; 16], 0, AccessFlags::LOCAL_WRITE);
    post_recv_into(&mut p.b, v.qb, wr_id, &rbuf, 0, 16);
}

/// A WRITE_IMM of all of `src` to offset 0 of `win`.
fn post_write_imm(p: &mut Pair, v: &Verbs, src: &MrInfo, win: &MrInfo, len: usize, imm: u32) {
    let r = RemoteAddr {
        rkey: win.rkey,
        addr: 0,
    };
    let sge = Sge {
        lkey: src.lkey,
        addr: 0,
        len: len as u32,
    };
    p.a.post_send(p.now, v.qa, SendWr::new(1, SendOp::WriteImm(r, imm), sge))
        .unwrap();
}

/// The WRITE_IMM completes at A, and at B in receive `wr_id` with `imm`,
/// every byte of `data` in `win`.
fn check_delivered(p: &mut Pair, v: &Verbs, wr_id: u64, imm: u32, win: &MrInfo, data: &[u8]) {
    let wa = wait_cq(p, true, v.cqa, 1, Duration::from_secs(5));
    assert_eq!(wa[0].status, WcStatus::Success);
    let wb = drain_cq(&mut p.b, v.cqb);
    assert_eq!(
        (wb[0].wr_id, wb[0].opcode, wb[0].imm, wb[0].byte_len),
        (
            wr_id,
            WcOpcode::RecvRdmaWithImm,
            Some(imm),
            data.len() as u32
        )
    );
    assert_eq!(p.b.mr(win.lkey).unwrap(), data);
}

#[test]
fn immediate_data_rides_in_the_first_packet_only() {
    let (mut p, v) = pair_1500(41, LinkConfig::lossy(0.01));
    let len = 256 << 10;
    let data = pattern(41, len);
    let (src, win) = write_regions(&mut p.a, v.pda, &mut p.b, v.pdb, &data);
    post_recv(&mut p, &v, 7);
    let seen = watch(&mut p, false);
    post_write_imm(&mut p, &v, &src, &win, len, 0xabcd);
    check_delivered(&mut p, &v, 7, 0xabcd, &win, &data);

    let seen = seen.borrow();
    let full = usize::from(MTU);
    let imm_hdr = DATA_HEADER_LEN + Opcode::WriteImm.ext_len();
    let hdr = DATA_HEADER_LEN + Opcode::Write.ext_len();
    assert!(seen.len() > len / (full - hdr), "{} packets", seen.len());
    for &(op, offset, payload, size) in seen.iter() {
        if offset == 0 {
            // Sent again after a loss, it still carries the immediate data.
            assert_eq!(op, Opcode::WriteImm);
            assert_eq!((payload, size), (full - imm_hdr, full));
        } else {
            assert_eq!(op, Opcode::Write, "offset {offset}");
            assert_eq!(size, hdr + payload);
            if offset as usize + payload < len {
                // Every packet but the last fills the path: 1,420 bytes of
                // payload, against 1,412 with the immediate data.
                assert_eq!(payload, full - hdr, "offset {offset}");
            }
        }
    }
}

#[test]
fn a_write_imm_whose_first_packet_comes_last_waits_for_its_receive() {
    let (mut p, v) = pair_1500(42, LinkConfig::perfect());
    let len = 64 << 10;
    let data = pattern(42, len);
    let (src, win) = write_regions(&mut p.a, v.pda, &mut p.b, v.pdb, &data);
    // The first packet is lost once: the rest of the message arrives before
    // it and makes a record without the immediate data. No receive is
    // posted yet, so when the first packet comes, the message is refused
    // (RNR) though the later packets were placed.
    let seen = watch(&mut p, true);
    post_write_imm(&mut p, &v, &src, &win, len, 77);
    let a_conn = p.conn_a.unwrap();
    let deadline = p.now + Duration::from_secs(1);
    p.run_until(deadline, |p| {
        p.a.connection_stats(a_conn).unwrap().naks_received > 0
    });
    assert!(
        p.a.connection_stats(a_conn).unwrap().naks_received > 0,
        "the first packet, last to come, met no receive: RNR"
    );
    assert!(drain_cq(&mut p.b, v.cqb).is_empty());
    post_recv(&mut p, &v, 9);
    check_delivered(&mut p, &v, 9, 77, &win, &data);
    // The later packets went without the immediate data, the lost one
    // went again with it.
    let seen = seen.borrow();
    let imm: Vec<_> = seen.iter().filter(|s| s.0 == Opcode::WriteImm).collect();
    assert!(imm.len() >= 2 && imm.iter().all(|s| s.1 == 0), "{imm:?}");
    assert!(seen.iter().any(|s| s.0 == Opcode::Write));
}

#[test]
fn at_the_default_mtu_every_packet_keeps_the_immediate_data() {
    // 4 KiB of payload fits either way: the packets stay alike, so a GSO
    // batch runs on across messages (a first packet 8 bytes longer than
    // the rest ended every message's batch after it: loopback perf lost a
    // quarter of its rate).
    let cfg = EndpointConfig::default();
    let mut p = Pair::new(cfg.clone(), cfg, 43, LinkConfig::perfect());
    p.connect();
    let v = Verbs::setup(&mut p);
    let len = 64 << 10;
    let data = pattern(43, len);
    let (src, win) = write_regions(&mut p.a, v.pda, &mut p.b, v.pdb, &data);
    post_recv(&mut p, &v, 3);
    let seen = watch(&mut p, false);
    post_write_imm(&mut p, &v, &src, &win, len, 5);
    check_delivered(&mut p, &v, 3, 5, &win, &data);
    let seen = seen.borrow();
    assert_eq!(seen.len(), len / 4096);
    let size = DATA_HEADER_LEN + Opcode::WriteImm.ext_len() + 4096;
    assert!(
        seen.iter()
            .all(|&(op, _, payload, dg)| op == Opcode::WriteImm && payload == 4096 && dg == size),
        "{seen:?}"
    );
}
