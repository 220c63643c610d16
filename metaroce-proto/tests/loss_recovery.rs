//! Loss recovery on paths with few packets in flight: a lost tail packet
//! is found by a tail-loss probe and the path's own order (PROTOCOL §13.3),
//! not by a retransmission timeout.

mod common;

use common::*;
use metaroce_proto::verbs::*;
use metaroce_proto::wire::{data_flags, DataHeader};
use metaroce_proto::EndpointConfig;
use std::cell::Cell;
use std::rc::Rc;
use std::time::Duration;

#[test]
fn a_lost_tail_packet_is_found_by_a_probe_not_a_timeout() {
    let cfg = EndpointConfig {
        coalesce_acks: false,
        ..EndpointConfig::default()
    };
    let link = LinkConfig {
        delay: Duration::from_micros(50),
        bytes_per_us: 1250,
        ..LinkConfig::perfect()
    };
    let mut p = Pair::new(cfg.clone(), cfg, 3, link);
    p.connect();
    let v = Verbs::setup(&mut p);
    // A first WRITE gives every path RTT samples.
    let len = 256 << 10;
    let data = pattern(9, len);
    let (src, dst) = write_regions(&mut p.a, v.pda, &mut p.b, v.pdb, &data);
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
