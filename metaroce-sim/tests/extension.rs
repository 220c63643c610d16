//! The transport extension point: a transport defined outside the crate,
//! carrying real datagram bytes and socket addresses, driven by
//! `run_transport`; plus the sweep helper and table renderer.

mod common;

use std::collections::VecDeque;
use std::net::{Ipv4Addr, SocketAddrV4};

use common::small;
use metaroce_sim::time::NS_PER_US;
use metaroce_sim::{
    render_table, run_transport, sweep, AppEvent, Delivery, Ecn, FlowStart, Nanos, Packet,
    PlaneMask, SimConfig, SimTransport, TransportEnv, TransportKind, TransportStats,
};

/// An unreliable datagram sender whose datagrams carry their flow and
/// offset as bytes, addressed by IPv4 socket addresses — the shape of the
/// future metaroce adapter. It (falsely) promises in-order delivery.
#[derive(Debug)]
struct Datagrams {
    env: TransportEnv,
    sends: VecDeque<(u32, SocketAddrV4, u64, u64)>,
    events: VecDeque<AppEvent>,
    stats: TransportStats,
}

impl SimTransport for Datagrams {
    type Payload = Vec<u8>;

    fn delivery(&self) -> Delivery {
        Delivery::InOrder
    }

    fn start_flow(&mut self, _now: Nanos, flow: &FlowStart) {
        let dst = SocketAddrV4::new(self.env.addresses.ip(flow.dst, 0), 4791);
        self.sends
            .push_back((flow.flow, dst, 0, flow.bytes.unwrap()));
    }

    fn handle_packet(&mut self, _now: Nanos, pkt: Packet<Vec<u8>>) {
        let flow = u32::from_be_bytes(pkt.payload[0..4].try_into().unwrap());
        let offset = u64::from_be_bytes(pkt.payload[4..12].try_into().unwrap());
        let len = pkt.payload.len() as u32 - 12;
        self.events
            .push_back(AppEvent::Delivered { flow, offset, len });
    }

    fn poll_transmit(&mut self, _now: Nanos, idle: PlaneMask) -> Option<Packet<Vec<u8>>> {
        assert!(idle.contains(0));
        let (flow, dst, offset, bytes) = self.sends.front_mut()?;
        let dst = *dst;
        let len = (*bytes - *offset).min(1000);
        let mut payload = Vec::with_capacity(12 + len as usize);
        payload.extend_from_slice(&flow.to_be_bytes());
        payload.extend_from_slice(&offset.to_be_bytes());
        payload.resize(12 + len as usize, 0xAB);
        let (dst_host, plane) = self.env.addresses.host_of(*dst.ip()).unwrap();
        let src = SocketAddrV4::new(self.env.addresses.ip(self.env.host, plane), 50_000);
        assert_eq!(
            self.env.addresses.host_of(*src.ip()),
            Some((self.env.host, plane))
        );
        *offset += len;
        if *offset == *bytes {
            self.sends.pop_front();
        }
        self.stats.data_packets += 1;
        Some(Packet {
            src: self.env.host,
            dst: dst_host,
            plane,
            src_port: src.port(),
            dst_port: dst.port(),
            ecn: Ecn::Ect0,
            size: payload.len() as u32 + 42,
            payload,
        })
    }

    fn poll_timeout(&mut self) -> Option<Nanos> {
        None
    }

    fn handle_timeout(&mut self, _now: Nanos) {}

    fn poll_event(&mut self) -> Option<AppEvent> {
        self.events.pop_front()
    }

    fn stats(&self) -> TransportStats {
        self.stats
    }
}

fn datagrams(env: &TransportEnv) -> Datagrams {
    assert_eq!(env.addresses.ip(1, 0), Ipv4Addr::new(10, 0, 0, 2));
    Datagrams {
        env: env.clone(),
        sends: VecDeque::new(),
        events: VecDeque::new(),
        stats: TransportStats::default(),
    }
}

#[test]
fn an_external_byte_carrying_transport_runs_and_broken_promises_count_as_lost() {
    let clean = SimConfig {
        flow_bytes: Some(100_000),
        duration_ns: 100 * NS_PER_US,
        ..small(TransportKind::Blast)
    };
    let r = run_transport(&clean, "datagrams", datagrams, None);
    assert_eq!(r.transport, "datagrams");
    assert!(r.flows_completed >= 8, "{}", r.flows_completed);
    assert_eq!(r.bytes_lost, 0);
    assert!(r.packets.is_conserved());

    // With loss, the transport delivers past holes despite promising order:
    // the simulator counts those bytes as lost.
    let lossy = SimConfig {
        loss: 0.05,
        ..clean
    };
    let r = run_transport(&lossy, "datagrams", datagrams, None);
    assert!(r.bytes_misordered > 0);
    assert_eq!(r.bytes_lost, r.bytes_misordered);
}

#[test]
fn sweep_renders_one_row_per_transport_and_loss() {
    let base = SimConfig {
        duration_ns: 100 * NS_PER_US,
        ..small(TransportKind::Irn)
    };
    let reports = sweep(
        &base,
        &[TransportKind::RoceV2Gbn, TransportKind::Irn],
        &[0.0, 0.01],
    );
    assert_eq!(reports.len(), 4);
    assert_eq!(
        (reports[1].transport.as_str(), reports[1].loss),
        ("rocev2-gbn", 0.01)
    );
    assert_eq!(
        (reports[2].transport.as_str(), reports[2].loss),
        ("irn", 0.0)
    );
    let table = render_table(&reports);
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines.len(), 2 + 4, "{table}");
    assert!(lines[0].starts_with("transport"));
    assert!(lines[4].starts_with("irn "), "{table}");
    let json = serde_json::to_value(&reports[0]).unwrap();
    for key in [
        "transport",
        "hosts",
        "loss",
        "goodput_gbps",
        "goodput_fraction",
        "retransmit_fraction",
        "fct_p50_us",
        "fct_p99_us",
        "max_queue_bytes",
        "ecn_marked_fraction",
        "bytes_lost",
        "events",
        "wall_s",
        "packets",
    ] {
        assert!(json.get(key).is_some(), "{key} missing");
    }
}
