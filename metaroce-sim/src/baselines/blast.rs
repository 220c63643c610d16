//! A dumb unreliable transport: each flow blasts MTU packets at whatever
//! rate the NIC allows, with no congestion control, no ECN, no ACKs and no
//! retransmission. Useful to stress the fabric (incast queues, tail drops).

use std::collections::VecDeque;

use super::header::DATA_OVERHEAD;
use crate::packet::{Ecn, FlowId, HostId, Packet, ROCEV2_UDP_PORT};
use crate::rng::mix64;
use crate::time::Nanos;
use crate::transport::{
    AppEvent, Delivery, FlowStart, PlaneMask, SimTransport, TransportEnv, TransportStats,
};

/// What a blast packet carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlastHeader {
    /// The flow.
    pub flow: FlowId,
    /// Byte offset within the flow.
    pub offset: u64,
    /// Payload bytes.
    pub len: u32,
}

#[derive(Debug)]
struct BlastFlow {
    flow: FlowId,
    dst: HostId,
    plane: u8,
    src_port: u16,
    next_offset: u64,
    bytes: Option<u64>,
}

/// The `blast` transport (one instance per host).
#[derive(Debug)]
pub struct Blast {
    env: TransportEnv,
    flows: VecDeque<BlastFlow>,
    events: VecDeque<AppEvent>,
    stats: TransportStats,
}

impl Blast {
    /// A blaster for `env`.
    pub fn new(env: &TransportEnv) -> Self {
        Blast {
            env: env.clone(),
            flows: VecDeque::new(),
            events: VecDeque::new(),
            stats: TransportStats::default(),
        }
    }
}

impl SimTransport for Blast {
    type Payload = BlastHeader;

    fn delivery(&self) -> Delivery {
        Delivery::Placement
    }

    fn start_flow(&mut self, _now: Nanos, flow: &FlowStart) {
        let h = mix64(self.env.seed ^ flow.flow as u64);
        self.flows.push_back(BlastFlow {
            flow: flow.flow,
            dst: flow.dst,
            plane: (h % self.env.planes as u64) as u8,
            src_port: 49152 + ((h >> 16) % 16384) as u16,
            next_offset: 0,
            bytes: flow.bytes,
        });
    }

    fn handle_packet(&mut self, _now: Nanos, pkt: Packet<BlastHeader>) {
        let h = pkt.payload;
        self.events.push_back(AppEvent::Delivered {
            flow: h.flow,
            offset: h.offset,
            len: h.len,
        });
    }

    fn poll_transmit(&mut self, _now: Nanos, idle: PlaneMask) -> Option<Packet<BlastHeader>> {
        for _ in 0..self.flows.len() {
            let mut f = self.flows.pop_front()?;
            if !idle.contains(f.plane) {
                self.flows.push_back(f);
                continue;
            }
            let remaining = f.bytes.map_or(u64::MAX, |b| b - f.next_offset);
            let len = remaining.min(self.env.mtu as u64) as u32;
            let hdr = BlastHeader {
                flow: f.flow,
                offset: f.next_offset,
                len,
            };
            f.next_offset += len as u64;
            let pkt = Packet {
                src: self.env.host,
                dst: f.dst,
                plane: f.plane,
                src_port: f.src_port,
                dst_port: ROCEV2_UDP_PORT,
                ecn: Ecn::NotEct,
                size: len + DATA_OVERHEAD,
                payload: hdr,
            };
            if f.bytes.is_none_or(|b| f.next_offset < b) {
                self.flows.push_back(f);
            }
            self.stats.data_packets += 1;
            self.stats.data_bytes += len as u64;
            return Some(pkt);
        }
        None
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
