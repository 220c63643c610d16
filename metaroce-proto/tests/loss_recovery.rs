//! Loss recovery on paths with few packets in flight: a lost tail packet
//! is found by a tail-loss probe and the path's own order (PROTOCOL §13.3),
//! not by a retransmission timeout.

mod common;

use common::*;
use metaroce_proto::verbs::*;
use metaroce_proto::wire::{data_flags, AckPacket, DataHeader, PacketType};
use metaroce_proto::EndpointConfig;
use std::cell::Cell;
use std::rc::Rc;
use std::time::Duration;

/// A connected pair (no coalesced ACKs) over a link of `delay` each way
/// at 10 Gbit/s, with 256 KiB of `pattern(fill)` registered at A and a
/// region as large at B for WRITEs into it.
fn write_pair(delay: Duration, seed: u64, fill: u64) -> (Pair, Verbs, Vec<u8>, MrInfo, MrInfo) {
    let cfg = EndpointConfig {
        coalesce_acks: false,
        ..EndpointConfig::default()
    };
    let link = LinkConfig {
        delay,
        bytes_per_us: 1250,
        ..LinkConfig::perfect()
    };
    let mut p = Pair::new(cfg.clone(), cfg, seed, link);
    p.connect();
    let v = Verbs::setup(&mut p);
    let data = pattern(fill, 256 << 10);
    let (src, dst) = write_regions(&mut p.a, v.pda, &mut p.b, v.pdb, &data);
    (p, v, data, src, dst)
}

#[test]
fn a_lost_tail_packet_is_found_by_a_probe_not_a_timeout() {
    let (mut p, v, data, src, dst) = write_pair(Duration::from_micros(50), 3, 9);
    let len = data.len();
    // A first WRITE gives every path RTT samples.
    let now = p.now;
    p.a.post_send(now, v.qa, write_wr(1, &src, &dst, 0, len as u32))
        .unwrap();
    assert_eq!(wait_done(&mut p, v.cqa), WcStatus::Success);
    // The second WRITE loses its last packet, once: no packet is sent
    // after it, so nothing but a probe (or the timeout) can show it.
    let dropped = Rc::new(Cell::new(false));
    let d = dropped.clone();
    p.on_wire = Some(Box::new(move |to_b, bytes| {
        let Ok((h, payload)) = DataHeader::parse(bytes) else {
            return;
        };
        let last = h.msg_offset as usize + payload.len() == h.msg_len as usize;
        if to_b && last && h.msg_len > 0 && h.flags & data_flags::RETRANSMIT == 0 && !d.get() {
            d.set(true);
            bytes.truncate(3);
        }
    }));
    let conn = p.conn_a.unwrap();
    let before = p.a.connection_stats(conn).unwrap();
    let now = p.now;
    p.a.post_send(now, v.qa, write_wr(2, &src, &dst, 0, len as u32))
        .unwrap();
    assert_eq!(wait_done(&mut p, v.cqa), WcStatus::Success);
    assert!(dropped.get());
    assert_eq!(p.b.mr(dst.lkey).unwrap(), &data[..]);
    let after = p.a.connection_stats(conn).unwrap();
    let sum = |s: &metaroce_proto::ConnectionStats, f: fn(&metaroce_proto::PathStats) -> u64| {
        s.paths.iter().map(f).sum::<u64>()
    };
    assert_eq!(after.rto_fires, before.rto_fires, "no timeout: {after:?}");
    assert!(sum(&after, |p| p.tail_probes) > sum(&before, |p| p.tail_probes));
    assert_eq!(
        sum(&after, |p| p.lost_by_timeout),
        sum(&before, |p| p.lost_by_timeout)
    );
    assert_eq!(sum(&after, |p| p.spurious_losses), 0);
}

/// Runs until one completion arrives on `cq` (1 s at most); its status.
fn wait_done(p: &mut Pair, cq: CqHandle) -> WcStatus {
    let deadline = p.now + Duration::from_secs(1);
    let mut got = Vec::new();
    p.run_until(deadline, |p| {
        got.extend(drain_cq(&mut p.a, cq));
        !got.is_empty()
    });
    got.first().expect("a completion").status
}

/// Path entries an ACK repeats: entries whose path received nothing since
/// the ACK before that reported it (the same `rx_packets`).
#[derive(Default)]
struct Repeats {
    last: std::collections::HashMap<u8, u32>,
    repeated: u64,
    entries: u64,
}

impl Repeats {
    fn see(&mut self, ack: &[u8]) {
        let Ok(a) = AckPacket::parse(ack, |_| true) else {
            return;
        };
        for e in a.paths() {
            self.entries += 1;
            if self.last.insert(e.path_id, e.rx_packets) == Some(e.rx_packets) {
                self.repeated += 1;
            }
        }
    }
}

/// Runs `writes` WRITEs of 256 KiB over a link on which every second ACK
/// is lost (`drop_acks`) and each WRITE's first packet too (so the
/// cumulative CSN, which acknowledges everything behind it, stays put).
/// Returns the retransmissions of each WRITE, the ACKs' path entries and
/// the receiver's duplicates.
fn writes_with_lost_reports(drop_acks: bool, writes: u64) -> (Vec<u64>, Repeats, u64) {
    let (mut p, v, data, src, dst) = write_pair(Duration::from_micros(20), 5, 11);
    let len = data.len();
    let repeats = Rc::new(std::cell::RefCell::new(Repeats::default()));
    let r = repeats.clone();
    let mut acks = 0u32;
    p.on_wire = Some(Box::new(move |to_b, bytes| {
        if !to_b && bytes.get(1) == Some(&(PacketType::Ack as u8)) {
            r.borrow_mut().see(bytes);
            acks += 1;
            if drop_acks && acks % 2 == 0 {
                bytes.truncate(3);
            }
            return;
        }
        let Ok((h, _)) = DataHeader::parse(bytes) else {
            return;
        };
        let first = h.msg_len > 0 && h.msg_offset == 0 && h.flags & data_flags::RETRANSMIT == 0;
        if drop_acks && to_b && first {
            bytes.truncate(3);
        }
    }));
    let conn = p.conn_a.unwrap();
    let mut retransmits = Vec::new();
    let mut before = 0;
    for wr_id in 1..=writes {
        let now = p.now;
        p.a.post_send(now, v.qa, write_wr(wr_id, &src, &dst, 0, len as u32))
            .unwrap();
        assert_eq!(wait_done(&mut p, v.cqa), WcStatus::Success);
        assert_eq!(p.b.mr(dst.lkey).unwrap(), &data[..]);
        let total = p.a.connection_stats(conn).unwrap().retransmits;
        retransmits.push(total - before);
        before = total;
    }
    let dups =
        p.b.connection_stats(p.conn_b.unwrap())
            .unwrap()
            .duplicates_received;
    p.on_wire = None;
    let repeats = std::mem::take(&mut *repeats.borrow_mut());
    (retransmits, repeats, dups)
}

/// A packet whose only report was lost with its ACK is declared lost and
/// sent again although it arrived; the receiver, seeing it twice, repeats
/// its path entries in the ACKs that follow (PROTOCOL §6.2). Where no
/// report is lost, no ACK repeats anything.
#[test]
fn lost_reports_make_the_receiver_repeat_its_path_entries() {
    let (retransmits, repeats, dups) = writes_with_lost_reports(true, 2);
    assert!(
        retransmits[0] > 1,
        "packets whose report was lost went again: {retransmits:?}"
    );
    assert!(dups > 0);
    assert!(
        repeats.repeated > 0,
        "{} of {} entries repeated",
        repeats.repeated,
        repeats.entries
    );
    let (retransmits, repeats, dups) = writes_with_lost_reports(false, 2);
    assert_eq!(retransmits, [0, 0]);
    assert_eq!(dups, 0);
    assert_eq!(repeats.repeated, 0, "of {} entries", repeats.entries);
    assert!(repeats.entries > 0);
}

/// The paths of one packet's transmissions that the link carried.
type Seen = Rc<std::cell::RefCell<Vec<u8>>>;

/// Runs WRITEs `1..=writes` of 256 KiB (after a first one that gives the
/// paths RTT samples) in which the packet at `offset` of the second WRITE
/// (`offset` None: its last packet) is lost `drops` times; returns the
/// paths its transmissions took, in order, once every WRITE completed.
fn packet_lost_repeatedly(offset: Option<u32>, drops: usize, writes: u64) -> Vec<u8> {
    let (mut p, v, data, src, dst) = write_pair(Duration::from_micros(50), 5, 11);
    let len = data.len();
    let now = p.now;
    p.a.post_send(now, v.qa, write_wr(1, &src, &dst, 0, len as u32))
        .unwrap();
    assert_eq!(wait_done(&mut p, v.cqa), WcStatus::Success);
    let seen: Seen = Default::default();
    let s = seen.clone();
    // The second WRITE is `msn` 1.
    p.on_wire = Some(Box::new(move |to_b, bytes| {
        let Ok((h, payload)) = DataHeader::parse(bytes) else {
            return;
        };
        let at = match offset {
            Some(o) => h.msg_offset == o,
            None => h.msg_offset as usize + payload.len() == h.msg_len as usize,
        };
        if to_b && h.msn == 1 && h.msg_len > 0 && at {
            let mut s = s.borrow_mut();
            s.push(h.path_id);
            if s.len() <= drops {
                bytes.truncate(3);
            }
        }
    }));
    let now = p.now;
    for w in 0..writes {
        p.a.post_send(now, v.qa, write_wr(2 + w, &src, &dst, 0, len as u32))
            .unwrap();
    }
    let wcs = wait_cq(&mut p, true, v.cqa, writes as usize, Duration::from_secs(1));
    assert_eq!(wcs.len(), writes as usize);
    assert!(wcs.iter().all(|w| w.status == WcStatus::Success));
    assert_eq!(p.b.mr(dst.lkey).unwrap(), &data[..]);
    let paths = seen.borrow().clone();
    paths
}

/// A packet lost twice at the tail of what was sent (the last packet of
/// the last WRITE: nothing else in flight) goes in two copies on two
/// paths; lost twice amid a window of packets, it goes once more, alone
/// (PROTOCOL §13.2).
#[test]
fn a_packet_lost_twice_at_the_tail_goes_in_two_copies() {
    let tail = packet_lost_repeatedly(None, 2, 1);
    assert_eq!(
        tail.len(),
        4,
        "original, retransmission, two copies: {tail:?}"
    );
    assert_ne!(tail[2], tail[3], "the copies take two paths: {tail:?}");
    // Lost once, it goes once more.
    let once = packet_lost_repeatedly(None, 1, 1);
    assert_eq!(once.len(), 2, "{once:?}");
    // Lost twice with three more WRITEs behind it (a megabyte in flight).
    let amid = packet_lost_repeatedly(Some(64 << 10), 2, 4);
    assert_eq!(amid.len(), 3, "original and two retransmissions: {amid:?}");
}
