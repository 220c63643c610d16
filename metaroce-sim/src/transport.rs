//! The extension point: host-side transports the simulator drives.
//!
//! A transport is a sans-IO state machine, one instance per host. The
//! simulator pushes inputs into it — flow starts from the application,
//! packets from the fabric, timer expiries — and pulls outputs out: packets
//! for the NIC ([`SimTransport::poll_transmit`], called whenever a NIC port
//! is idle, so the NIC serialises at line rate and a transport paces or
//! windows simply by returning `None`), its next deadline
//! ([`SimTransport::poll_timeout`]) and application events
//! ([`SimTransport::poll_event`]): bytes delivered to the receiving
//! application, sender-side completions, and bytes it gave up on.
//!
//! The shape matches a quinn-style core (`handle_datagram`,
//! `poll_transmit`, `poll_timeout`, `handle_timeout`), so a transport that
//! produces real datagrams — the metaroce adapter — can set
//! `Payload = Vec<u8>` (or `bytes::Bytes`) and map socket addresses to
//! `(host, plane)` with the [`AddressMap`] in its [`TransportEnv`].
//! Header-only baselines use a small `Copy` payload and pay nothing.
//!
//! The simulator checks delivery itself: every [`AppEvent::Delivered`] is
//! matched against the flow's byte ranges, so duplicates are not counted as
//! goodput and, for a transport that promises [`Delivery::InOrder`], a
//! delivery that skips ahead is counted as misordered (and as lost bytes).

use crate::addr::AddressMap;
use crate::packet::{FlowId, HostId, Packet};
use crate::time::Nanos;

/// Static facts a transport instance learns when it is created.
#[derive(Debug, Clone)]
pub struct TransportEnv {
    /// The host this instance runs on.
    pub host: HostId,
    /// Number of hosts in the fabric.
    pub hosts: u32,
    /// NIC ports (planes) of each host.
    pub planes: u32,
    /// Rate of one NIC port in Gbit/s.
    pub link_gbps: f64,
    /// Maximum transport payload per packet in bytes.
    pub mtu: u32,
    /// Round-trip time of an MTU packet and its ACK across an idle fabric
    /// between leaves.
    pub base_rtt_ns: Nanos,
    /// Bandwidth-delay product of one NIC port: `link_gbps * base_rtt`.
    pub bdp_bytes: u64,
    /// Addresses of every host on every plane.
    pub addresses: AddressMap,
    /// A seed for the transport's own random choices.
    pub seed: u64,
}

/// An application request: send `bytes` from `src` to `dst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlowStart {
    /// Run-wide flow identifier; carry it in packets to attribute deliveries.
    pub flow: FlowId,
    /// Sending host.
    pub src: HostId,
    /// Receiving host.
    pub dst: HostId,
    /// Bytes to send; `None` for a flow that never ends.
    pub bytes: Option<u64>,
}

/// What a transport tells the application layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AppEvent {
    /// Receiver side: `len` bytes at `offset` of `flow` are intact in the
    /// application's buffer.
    Delivered {
        /// The flow.
        flow: FlowId,
        /// Byte offset within the flow.
        offset: u64,
        /// Number of bytes.
        len: u32,
    },
    /// Sender side: every byte of `flow` has been acknowledged.
    Completed {
        /// The flow.
        flow: FlowId,
    },
    /// Sender side: the transport gave up on `bytes` bytes of `flow`.
    Abandoned {
        /// The flow.
        flow: FlowId,
        /// Bytes that will never be delivered.
        bytes: u64,
    },
    /// Receiver side: bytes were handed to the application damaged.
    Corrupted {
        /// The flow.
        flow: FlowId,
        /// Byte offset within the flow.
        offset: u64,
        /// Number of bytes.
        len: u32,
    },
}

/// The delivery promise a transport makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Delivery {
    /// Bytes reach the application strictly in order.
    InOrder,
    /// Bytes are placed at their offsets in any order.
    Placement,
}

/// Bit set of idle NIC ports (planes); bit `p` set = port `p` is idle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlaneMask(pub u64);

impl PlaneMask {
    /// Whether `plane`'s port is idle.
    pub fn contains(self, plane: u8) -> bool {
        self.0 & (1 << plane) != 0
    }
}

/// Counters a transport keeps about its own traffic.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct TransportStats {
    /// Data packets sent, retransmissions included.
    pub data_packets: u64,
    /// Of those, retransmissions.
    pub retransmitted_packets: u64,
    /// Payload bytes sent in data packets, retransmissions included.
    pub data_bytes: u64,
    /// ACK / NAK / SACK / CNP packets sent.
    pub control_packets: u64,
    /// Congestion notification packets sent (subset of control packets).
    pub cnps: u64,
    /// Retransmission timeouts that fired.
    pub timeouts: u64,
}

impl std::ops::AddAssign for TransportStats {
    fn add_assign(&mut self, o: Self) {
        self.data_packets += o.data_packets;
        self.retransmitted_packets += o.retransmitted_packets;
        self.data_bytes += o.data_bytes;
        self.control_packets += o.control_packets;
        self.cnps += o.cnps;
        self.timeouts += o.timeouts;
    }
}

/// A host-side transport driven by the simulator.
///
/// All methods take the current simulated time where it matters; a
/// transport must never read a clock or use global randomness.
pub trait SimTransport {
    /// What the transport puts in packets (opaque to the fabric).
    type Payload;

    /// The delivery promise the simulator checks deliveries against.
    fn delivery(&self) -> Delivery;

    /// The application on this host asks to send a flow.
    fn start_flow(&mut self, now: Nanos, flow: &FlowStart);

    /// A flow towards this host is about to start (called on the receiver
    /// before [`SimTransport::start_flow`] on the sender). Default: nothing.
    fn expect_flow(&mut self, _now: Nanos, _flow: &FlowStart) {}

    /// A packet addressed to this host arrived.
    fn handle_packet(&mut self, now: Nanos, pkt: Packet<Self::Payload>);

    /// The next packet to put on an idle NIC port, if any is ready now.
    /// `idle` says which ports are idle; a packet for a busy port waits in
    /// that port's NIC queue.
    fn poll_transmit(&mut self, now: Nanos, idle: PlaneMask) -> Option<Packet<Self::Payload>>;

    /// The earliest time the transport wants [`SimTransport::handle_timeout`].
    fn poll_timeout(&mut self) -> Option<Nanos>;

    /// Time has reached (at least) the deadline from `poll_timeout`.
    fn handle_timeout(&mut self, now: Nanos);

    /// The next application event, if any.
    fn poll_event(&mut self) -> Option<AppEvent>;

    /// The transport's counters.
    fn stats(&self) -> TransportStats;
}
