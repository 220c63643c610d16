//! Endpoint configuration.

use crate::consts::*;
use core::time::Duration;
use std::net::IpAddr;

/// How an endpoint behaves. Every field has a documented default
/// ([`EndpointConfig::default`]), taken from [`crate::consts`].
///
/// ```
/// use metaroce_proto::EndpointConfig;
/// let c = EndpointConfig { paths: 4, ..EndpointConfig::default() };
/// assert!(c.validate().is_ok());
/// assert!(EndpointConfig { paths: 0, ..c }.validate().is_err());
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct EndpointConfig {
    /// UDP port this endpoint receives on, advertised to peers.
    pub listen_port: u16,
    /// Largest UDP payload sent or accepted.
    pub mtu: u16,
    /// Paths each connection sprays over.
    pub paths: u8,
    /// UDP source ports used as path entropy.
    ///
    /// A driver with one socket per source port lists the ports it bound;
    /// the simulator lists any it likes. Each path draws a distinct one where
    /// the list is long enough.
    pub source_ports: Vec<u16>,
    /// Accept incoming connections.
    pub accept_incoming: bool,
    /// Largest number of connections (PROTOCOL §18): a local
    /// [`connect`](crate::Endpoint::connect) beyond it fails
    /// ([`TooManyConnections`](crate::verbs::VerbsError::TooManyConnections)),
    /// a peer's HELLO is refused (`Refused`). Closed connections count until
    /// released.
    pub max_connections: usize,
    /// Largest number of this endpoint's own handshakes in progress
    /// (connections in `Connecting`): a [`connect`](crate::Endpoint::connect)
    /// beyond it fails
    /// ([`TooManyHandshakes`](crate::verbs::VerbsError::TooManyHandshakes)).
    /// A server keeps no handshake state (cookies, §8.2, §8.4).
    pub max_handshakes: usize,
    /// Largest number of queue pairs: [`create_qp`](crate::Endpoint::create_qp)
    /// beyond it fails ([`TooManyQps`](crate::verbs::VerbsError::TooManyQps)).
    pub max_qps: usize,
    /// Largest number of registered memory regions (at most 2^24):
    /// [`reg_mr`](crate::Endpoint::reg_mr) beyond it fails
    /// ([`TooManyRegions`](crate::verbs::VerbsError::TooManyRegions)).
    pub max_regions: usize,
    /// Stateless replies (COOKIE, VERSION_NEGOTIATION) sent per second at
    /// most, on average (a token bucket of
    /// [`stateless_burst`](Self::stateless_burst)); a datagram whose reply
    /// is over the rate gets none and is counted (`RateLimited`). Bounds what
    /// a flood of spoofed HELLOs makes this endpoint send to the addresses
    /// they forge.
    pub stateless_rate: u32,
    /// Stateless replies sent back to back at most, after a quiet time.
    pub stateless_burst: u32,
    /// RTO before the first RTT sample.
    pub initial_rto: Duration,
    /// Lower bound of the RTO.
    pub min_rto: Duration,
    /// Upper bound of the RTO (backoff included).
    pub max_rto: Duration,
    /// Timeouts without progress before a connection fails (`retry_cnt`).
    pub retry_cnt: u8,
    /// The least time each retry is given (RoCE's `timeout`): a connection
    /// fails only after more than `retry_cnt` timeouts without progress
    /// *and* `(retry_cnt + 1) × retry_timeout` without progress; a QP's
    /// progress probes likewise, unless the QP has a `timeout` of its own
    /// (PROTOCOL §11.6, §13.4). Retransmissions are not slowed by it.
    pub retry_timeout: Duration,
    /// Delayed-ACK timer.
    pub ack_delay: Duration,
    /// Packets received before an ACK goes out regardless of the timer.
    pub ack_every: u32,
    /// Take coalesced datagrams (an ACK followed by a DATA packet) and,
    /// when the peer takes them too, send ACKs riding on DATA (PROTOCOL
    /// §6.7). Advertised in the handshake; off, this endpoint neither sends
    /// nor accepts them, like a peer that predates them.
    pub coalesce_acks: bool,
    /// Ask for CRC32C trailers (PROTOCOL §3.1): every datagram of a
    /// connection whose both sides ask ends with a CRC32C of its bytes, and
    /// one that fails it is dropped (counted as
    /// [`RejectReason::BadIntegrity`](crate::RejectReason::BadIntegrity))
    /// and recovered like a loss. Advertised in the handshake. Off by
    /// default: computing it costs about as much CPU as copying the bytes
    /// once more at each end (10–20% of loopback throughput,
    /// `docs/BENCHMARKS.md`).
    pub crc32c: bool,
    /// Pre-shared key of the authenticated, encrypted mode (PROTOCOL
    /// §3.2), off by default. With a key, every connection proves it in
    /// its handshake (a peer without the same key creates no connection)
    /// and seals every datagram after it with AES-128-GCM under keys of
    /// its own, derived from this key and both sides' handshake nonces.
    pub psk: Option<crate::Psk>,
    /// Longest wait of an ACK the peer asked for (the last packet of a
    /// message) for a DATA packet of this side's to ride on, while this
    /// side is sending to the peer (a request/response exchange); zero:
    /// never wait (ACKs still ride on DATA that goes anyway). Capped at
    /// `ack_delay`: a held ACK is still owed within the delayed-ACK time,
    /// which the peer's loss detection allows for.
    pub ack_hold: Duration,
    /// HELLO retransmission interval.
    pub handshake_rto: Duration,
    /// HELLO attempts before giving up.
    pub handshake_retries: u8,
    /// Initial congestion window, bytes.
    pub initial_window: u64,
    /// Bytes in flight allowed to a peer that grants rates (it said so in
    /// the handshake) until its first ACK, and so its first grant, arrives;
    /// one packet always goes. Bounds the first round trip of an incast.
    pub first_flight_bytes: u64,
    /// Smallest congestion window of a path, bytes (never below two
    /// packets, nor above the path's share of `initial_window`).
    pub min_window: u64,
    /// Largest congestion window, bytes.
    pub max_window: u64,
    /// Queueing delay (RTT above the smallest RTT seen) the sender tolerates
    /// before it slows down.
    pub delay_target: Duration,
    /// How long a sender counts as active for the receiver's grant after its
    /// last data packet.
    pub receiver_active_window: Duration,
    /// Largest number of datagrams one [`Transmit`](crate::Transmit) may carry
    /// (UDP GSO): drivers that can segment set it; 1 sends single datagrams.
    pub max_gso_segments: usize,
    /// Inbound capacity the receiver shares among its senders (kbit/s); `None`: grant no limit.
    pub receiver_capacity_kbps: Option<u64>,
    /// Bytes of arriving datagrams this endpoint's host holds for it until
    /// it reads them (its sockets' receive buffers). When set, every ACK
    /// tells its sender to keep at most its share in flight: this buffer
    /// divided among the connections that delivered data within about
    /// [`receiver_active_window`](Self::receiver_active_window) (PROTOCOL
    /// §14). Bytes in flight to a receiver include those waiting in its
    /// socket, so senders that keep to their shares never overflow it,
    /// however long the receiving thread is held up: a deep queue of
    /// requests then waits at the sender instead of being dropped by the
    /// receiver's kernel. `None` (the default of the core; the drivers set
    /// it from the buffers the kernel gave their sockets): no limit.
    pub receive_buffer: Option<u64>,
    /// Bytes the network adds to every datagram (link, IP and UDP headers
    /// and framing) that count against a link's rate. The pacer charges
    /// them on top of the UDP payload, so senders paced at grants that add
    /// up to a receiver's link rate do not overrun that link (without them,
    /// 4 KiB datagrams over Ethernet/IPv4 overrun it by about 1%, and an
    /// incast's queue grows without bound). 0: charge the payload only.
    pub datagram_overhead: u32,
    /// Local addresses, one per plane (multiplane: one NIC port and address
    /// per independent fabric plane), plane 0 first. Empty: one plane, sent
    /// from [`Endpoint::set_local_ip`](crate::Endpoint::set_local_ip)'s address.
    ///
    /// With two or more, HELLO and ACCEPT advertise planes 1.. to the peer,
    /// and a connection spreads its paths round robin over the planes both
    /// sides have (path `i` on plane `i mod P`, plane `k` paired with the
    /// peer's plane `k`). A failed plane is then a failed set of paths.
    /// At most [`MAX_PLANES`].
    pub plane_ips: Vec<IpAddr>,
}

impl Default for EndpointConfig {
    fn default() -> Self {
        EndpointConfig {
            listen_port: METAROCE_PORT,
            mtu: DEFAULT_MTU,
            paths: DEFAULT_PATHS,
            source_ports: (49152..=49152 + 255).collect(),
            accept_incoming: true,
            max_connections: 65_536,
            max_handshakes: 1_024,
            max_qps: 65_536,
            max_regions: 1 << 20,
            stateless_rate: 10_000,
            stateless_burst: 1_000,
            initial_rto: DEFAULT_INITIAL_RTO,
            min_rto: DEFAULT_MIN_RTO,
            max_rto: DEFAULT_MAX_RTO,
            retry_cnt: DEFAULT_RETRY_CNT,
            retry_timeout: DEFAULT_RETRY_TIMEOUT,
            ack_delay: DEFAULT_ACK_DELAY,
            ack_every: DEFAULT_ACK_EVERY,
            coalesce_acks: true,
            crc32c: false,
            psk: None,
            ack_hold: DEFAULT_ACK_HOLD,
            handshake_rto: DEFAULT_HANDSHAKE_RTO,
            handshake_retries: DEFAULT_HANDSHAKE_RETRIES,
            initial_window: DEFAULT_INITIAL_WINDOW,
            first_flight_bytes: DEFAULT_FIRST_FLIGHT,
            min_window: DEFAULT_MIN_WINDOW,
            max_window: DEFAULT_MAX_WINDOW,
            delay_target: DEFAULT_DELAY_TARGET,
            receiver_capacity_kbps: None,
            receive_buffer: None,
            datagram_overhead: 0,
            receiver_active_window: DEFAULT_RECEIVER_ACTIVE_WINDOW,
            max_gso_segments: 1,
            plane_ips: Vec::new(),
        }
    }
}

/// A configuration value out of its allowed range.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid endpoint configuration: {0}")]
pub struct ConfigError(pub &'static str);

impl EndpointConfig {
    /// Checks every field's range.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(MIN_MTU..=MAX_MTU).contains(&self.mtu) {
            return Err(ConfigError("mtu must be within MIN_MTU..=MAX_MTU"));
        }
        if self.paths == 0 || usize::from(self.paths) > MAX_PATHS {
            return Err(ConfigError("paths must be within 1..=MAX_PATHS"));
        }
        if self.source_ports.is_empty() || self.source_ports.contains(&0) {
            return Err(ConfigError(
                "source_ports must be a non-empty list of non-zero ports",
            ));
        }
        if self.min_rto.is_zero() || self.min_rto > self.max_rto {
            return Err(ConfigError("need 0 < min_rto <= max_rto"));
        }
        if self.retry_timeout.is_zero() {
            return Err(ConfigError("retry_timeout must be above zero"));
        }
        if self.min_window == 0 || self.min_window > self.max_window {
            return Err(ConfigError("need 0 < min_window <= max_window"));
        }
        if self.max_gso_segments == 0 {
            return Err(ConfigError("max_gso_segments must be at least 1"));
        }
        if self.ack_every == 0 {
            return Err(ConfigError("ack_every must be at least 1"));
        }
        if self.plane_ips.len() > MAX_PLANES {
            return Err(ConfigError("plane_ips holds at most MAX_PLANES addresses"));
        }
        if self.receive_buffer == Some(0) {
            return Err(ConfigError("receive_buffer must be at least 1 byte"));
        }
        if self.max_regions > crate::verbs::MAX_REGIONS {
            return Err(ConfigError("max_regions must be at most 2^24"));
        }
        if self.max_qps >= 1 << 20 {
            return Err(ConfigError("max_qps must be below 2^20"));
        }
        if self.stateless_rate == 0 || self.stateless_burst == 0 {
            return Err(ConfigError(
                "stateless_rate and stateless_burst must be at least 1",
            ));
        }
        if self.handshake_retries == 0 {
            return Err(ConfigError("handshake_retries must be at least 1"));
        }
        Ok(())
    }
}
