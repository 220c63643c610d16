//! A connection: one peer, many streams (QPs) above, many paths below, one
//! congestion controller.
//!
//! This module holds the transport state of a connection: handshake state,
//! the paths, the connection sequence (CSN) send table and receive window,
//! retransmission queue, RTO, and what the next ACK must say. The endpoint
//! joins it with the QPs and memory regions.

mod path;

pub(crate) use path::{Drawn, LossCause, PathEvent, PathRx, PathTx};
pub use path::{PathState, PathStats};

use crate::cc::{Pacer, SenderCc};
use crate::config::EndpointConfig;
use crate::consts::{
    ACK_HOLD_SENDING, COOKIE_LEN, CSN_WINDOW, REPATH_COOLDOWN_RTTS, REPATH_MAX_BACKOFF,
    SLOW_PATH_FACTOR, SLOW_PATH_SAMPLES, SLOW_PORTS_KEPT,
};
use crate::reliability::{RingBitmap, RttEstimator, SeqAccept};
use crate::rng::Rng;
use crate::time::Instant;
use crate::verbs::Qpn;
use crate::wire::seq::{seq_dist, seq_lt};
use crate::wire::{AckStreamEntry, CloseCode, NakEntry};
use core::time::Duration;
use std::collections::VecDeque;
use std::net::{IpAddr, SocketAddr};

/// Where a connection is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnectionState {
    /// Client: HELLO sent, waiting for COOKIE or ACCEPT.
    Connecting,
    /// Both ends know each other; data flows.
    Established,
    /// Closed by either side.
    Closed,
    /// Failed: handshake gave up, version mismatch, or retries exceeded.
    Failed,
}

/// Why a connection ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ConnectionError {
    /// The peer does not speak our protocol version.
    #[error("protocol version mismatch (peer's highest version: {peer_highest})")]
    VersionMismatch {
        /// Highest version the peer listed.
        peer_highest: u8,
    },
    /// No answer to the handshake.
    #[error("handshake timed out")]
    HandshakeTimeout,
    /// The transport ran out of retries (`retry_cnt` timeouts without progress).
    #[error("retry count exceeded: peer unreachable")]
    RetryExceeded,
    /// The peer closed the connection.
    #[error("closed by peer ({0:?})")]
    ClosedByPeer(CloseCode),
    /// Closed locally.
    #[error("closed locally")]
    LocallyClosed,
    /// The peer refused this side's pre-shared key (PROTOCOL §3.2): the
    /// keys differ, or the peer has none and this side has one.
    #[error("the peer refused the key: the pre-shared keys differ, or only one side has one")]
    KeyRefused,
}

/// What a CSN carried, so that it can be rebuilt for retransmission.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CsnKind {
    /// A request segment of QP `qp`.
    Request {
        qp: Qpn,
        msn: u32,
        gen: u8,
        offset: u32,
        len: u32,
    },
    /// A READ response segment of QP `qp`.
    Response {
        qp: Qpn,
        msn: u32,
        offset: u32,
        len: u32,
    },
    /// Nothing but the CSN (probe or obsolete retransmission).
    Nop,
}

impl CsnKind {
    /// Payload bytes the CSN's packet carries.
    pub(crate) fn payload_len(self) -> usize {
        match self {
            CsnKind::Request { len, .. } | CsnKind::Response { len, .. } => len as usize,
            CsnKind::Nop => 0,
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct CsnRecord {
    pub(crate) kind: CsnKind,
    pub(crate) acked: bool,
    pub(crate) queued: bool,
    pub(crate) last_path: u8,
    pub(crate) transmissions: u16,
    /// A second copy of its retransmission is still to go (§13.2).
    pub(crate) copy_due: bool,
}

/// Control packet the connection owes its peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ctrl {
    Hello,
    Accept,
    Close(CloseCode),
}

/// Public counters of a connection.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ConnectionStats {
    /// DATA packets sent, retransmissions included.
    pub data_packets_sent: u64,
    /// DATA packets received.
    pub data_packets_received: u64,
    /// Retransmissions sent (SACK-gap and timeout).
    pub retransmits: u64,
    /// Retransmissions caused by a SACK gap.
    pub fast_retransmits: u64,
    /// Retransmission timeouts fired.
    pub rto_fires: u64,
    /// Packets declared lost.
    pub packets_lost: u64,
    /// Duplicate packets received (CSN already seen).
    pub duplicates_received: u64,
    /// ACKs sent, coalesced ones included.
    pub acks_sent: u64,
    /// ACKs sent riding on a DATA packet, in one datagram with it
    /// (PROTOCOL §6.7).
    pub acks_coalesced: u64,
    /// ACKs received.
    pub acks_received: u64,
    /// NAKs sent.
    pub naks_sent: u64,
    /// NAKs received.
    pub naks_received: u64,
    /// Payload bytes of requests and responses sent for the first time.
    pub payload_bytes_sent: u64,
    /// Payload bytes placed at this end.
    pub payload_bytes_received: u64,
    /// NOP probes sent: progress probes, tail-loss probes and failed paths'
    /// probes of their new routes (not route checks).
    pub probes_sent: u64,
    /// Route checks sent: NOPs on paths that carry only ACKs (PROTOCOL §12).
    pub route_checks: u64,
    /// Paths declared failed and moved to a new source port.
    pub path_failures: u64,
    /// Paths moved to a new source port because their route stayed congested.
    pub path_moves: u64,
    /// Current congestion window.
    pub cwnd: u64,
    /// Bytes in flight.
    pub in_flight: u64,
    /// Smoothed RTT of the connection in ns.
    pub srtt_ns: u64,
    /// Current RTO in ns, backoff included.
    pub rto_ns: u64,
    /// Latest rate hint received (kbit/s, 0 none).
    pub rate_hint_kbps: u32,
    /// Bytes the peer lets this side keep in flight (its share of its
    /// receive buffer; 0: it gave none).
    pub peer_window: u64,
    /// Per-path counters.
    pub paths: Vec<PathStats>,
}

/// When the ACKs a receiver owes go out (from the endpoint's
/// configuration).
#[derive(Debug, Clone, Copy)]
pub(crate) struct AckTiming {
    /// Packets received before an ACK goes out at once.
    pub(crate) every: u32,
    /// The delayed-ACK timer.
    pub(crate) delay: Duration,
    /// How long an asked-for ACK may wait for DATA to ride on.
    pub(crate) hold: Duration,
}

impl AckTiming {
    pub(crate) fn of(config: &EndpointConfig) -> Self {
        AckTiming {
            every: config.ack_every,
            delay: config.ack_delay,
            hold: config.ack_hold,
        }
    }
}

/// A connection's transport state.
#[derive(Debug)]
pub(crate) struct Connection {
    pub(crate) local_cid: u32,
    pub(crate) remote_cid: u32,
    pub(crate) state: ConnectionState,
    pub(crate) error: Option<ConnectionError>,
    /// Peer IP and the port it listens on.
    pub(crate) peer: SocketAddr,
    pub(crate) local_ip: Option<IpAddr>,
    /// Local addresses per plane (empty: one plane, `local_ip`).
    pub(crate) local_planes: Vec<IpAddr>,
    /// The peer's addresses per plane, plane 0 (= `peer.ip()`) first.
    pub(crate) peer_planes: Vec<IpAddr>,
    /// Planes the driver can send on right now (bit per plane), for the
    /// duration of one transmit call; all ones otherwise.
    pub(crate) tx_mask: u64,
    /// Plane of the peer's address the latest DATA came from.
    pub(crate) last_rx_plane: u8,
    pub(crate) mtu: usize,

    // Handshake.
    pub(crate) cookie: Option<[u8; COOKIE_LEN]>,
    pub(crate) hello_attempts: u8,
    /// When the latest HELLO went out (its COOKIE's round trip).
    pub(crate) hello_sent_at: Instant,
    /// Doublings of `hello_interval` before the next HELLO's deadline:
    /// one per HELLO, back to none when a COOKIE shows the server answers.
    pub(crate) hello_backoff: u8,
    /// Base retransmission interval of HELLO: `handshake_rto`, then, once
    /// a COOKIE came, an RTO from that round trip (PROTOCOL §8.2).
    pub(crate) hello_interval: Duration,
    /// Copies of the current HELLO round still to go: every round goes
    /// three times, from three source ports (three routes), so that two
    /// lost datagrams cost no timeout (PROTOCOL §8.2). 0: the next HELLO
    /// starts a round.
    pub(crate) hello_copies_left: u8,
    /// Copies of the current ACCEPT still to go (§8.2).
    pub(crate) accept_copies_left: u8,
    /// Handshake datagrams (HELLO, ACCEPT) sent: each goes from the next
    /// plane-0 path's source port, so a retry takes a new ECMP route.
    pub(crate) hs_sent: u8,
    /// COOKIE replies taken during this handshake.
    pub(crate) cookies_taken: u8,
    pub(crate) hello_deadline: Option<Instant>,
    pub(crate) ctrl: Option<Ctrl>,

    // Paths.
    pub(crate) paths_tx: Vec<PathTx>,
    pub(crate) paths_rx: Vec<PathRx>,
    pub(crate) path_rr: usize,
    /// No path moves (to a less congested route) before this time.
    pub(crate) next_move_at: Instant,
    /// Path moves so far: each doubles the wait before the next (up to
    /// `REPATH_MAX_BACKOFF` doublings), so that a network where every route
    /// is congested (one bottleneck link, a host's own socket) does not
    /// keep moving paths for nothing.
    pub(crate) moves_made: u32,
    /// Source ports that slow paths left lately: a move does not go back
    /// to a route that was found slow, for a while.
    pub(crate) slow_ports: SlowPorts,
    /// Reused by [`slow_paths`](Self::slow_paths): the judged paths'
    /// smoothed RTTs, sorted for their median; empty between calls.
    srtt_scratch: Vec<Duration>,

    // Send side.
    pub(crate) next_csn: u32,
    pub(crate) csn_una: u32,
    pub(crate) sent: VecDeque<CsnRecord>,
    pub(crate) retx: VecDeque<u32>,
    pub(crate) in_flight: u64,
    /// Bytes one ACK releases, smoothed (1/8 gain): the ACK clock's step.
    pub(crate) ack_batch: u64,
    pub(crate) rtt: RttEstimator,
    /// When the last timeout that counted toward `retry_cnt` happened.
    pub(crate) last_timeout: Instant,
    pub(crate) consecutive_rto: u8,
    /// Retransmissions a silent timeout may send past the windows (one per
    /// path that timed out; spent as they go, voided by progress): the
    /// packets it leaves outstanding still fill the windows, and without
    /// these a long silence would stop the probes that end it.
    pub(crate) timeout_probes: u8,
    /// When the last silent timeout sent its probe (PROTOCOL §13.3): until
    /// something is acknowledged or the round ends, other paths that time
    /// out in the same silence wait for its answer.
    pub(crate) silent_probe_at: Option<Instant>,
    /// How far behind the peer was at its latest ACK: the time it held the
    /// newest packet that ACK answers (`ack_delay_ns`). A peer that comes
    /// back from a stall works through what waited in its socket, and
    /// says so here; packets still in that backlog are late, not lost.
    pub(crate) peer_lag: Duration,
    /// The delay all active paths shared while every window was near its
    /// minimum (a moving average): delay this connection's own traffic
    /// did not make (PROTOCOL §14, Delay).
    floor_shared: Option<Duration>,
    /// How far behind this side was when it read that ACK: the time from
    /// its arrival to its handling. A thread that falls behind its own
    /// socket has ACKs waiting there that it has not seen yet.
    pub(crate) own_lag: Duration,
    pub(crate) retry_cnt: u8,
    pub(crate) last_ack_at: Instant,
    pub(crate) last_progress: Instant,
    pub(crate) rate_hint_kbps: u32,
    /// Bytes the peer lets this side keep in flight to it (its share of
    /// its receive buffer, from its ACKs); `None` until it gives one.
    pub(crate) peer_window: Option<u64>,
    /// Spreads DATA at the receiver's grant.
    pub(crate) pacer: Pacer,
    /// What the network adds to each datagram, charged by the pacer.
    pub(crate) datagram_overhead: u64,
    /// The peer said in the handshake that its ACKs carry grants.
    pub(crate) peer_grants: bool,
    /// Bytes in flight allowed before the first grant (when `peer_grants`).
    pub(crate) first_flight: u64,
    /// ACKs may ride on DATA to the peer: it takes coalesced datagrams
    /// (said so in the handshake) and this endpoint sends them.
    pub(crate) peer_coalesce: bool,
    /// How this connection's datagrams are protected (negotiated in the
    /// handshake; plain until it ends).
    pub(crate) protect: crate::integrity::Protect,
    /// The security extension this side puts in its HELLO or ACCEPT
    /// (with a pre-shared key).
    pub(crate) hs_security: Option<crate::wire::SecurityExt>,
    /// When this side last sent a DATA packet: an ACK the peer asked for
    /// waits a moment for a packet to ride on only while this side sends.
    pub(crate) last_data_tx: Option<Instant>,

    // Receive side.
    pub(crate) rx_csn: RingBitmap<{ CSN_WINDOW as usize / 64 }>,
    pub(crate) ack_needed: bool,
    pub(crate) ack_now: bool,
    pub(crate) ack_deadline: Option<Instant>,
    pub(crate) since_ack: u32,
    pub(crate) last_rx_ts: u32,
    pub(crate) last_rx_path: u8,
    pub(crate) last_rx_at: Instant,
    /// When the latest DATA packet other than a NOP arrived: the
    /// connection counts as a sender to this side's grant and receive
    /// window (NOPs, the peer's probes and route checks, carry nothing).
    pub(crate) sender_rx_at: Option<Instant>,
    /// The period this connection last delivered data in, as the
    /// endpoint's [`ActiveSenders`](crate::cc::ActiveSenders) counts them.
    pub(crate) rx_period: u64,
    /// This side opened the connection.
    pub(crate) is_client: bool,
    /// When the connection became established.
    pub(crate) established_at: Instant,
    pub(crate) naks: VecDeque<NakEntry>,
    pub(crate) dirty_streams: Vec<Qpn>,
    /// ACKs still to repeat path entries (PROTOCOL §6.2): set when a
    /// packet this side already had comes again, the sign that the report
    /// of it was lost.
    pub(crate) repeat_acks: u32,
    /// Streams whose progress was reported lately, with how many more ACKs
    /// repeat it (a lost ACK must not hold a completion until the next one).
    pub(crate) recent_streams: Vec<(Qpn, u8)>,
    /// The last progress of QPs destroyed while it was owed or repeated
    /// ([`retire_stream`](Self::retire_stream)), by local QPN, until its
    /// repeats are over.
    pub(crate) retired_streams: Vec<(Qpn, AckStreamEntry)>,
    /// RNR NAKs sent lately, with how many more ACKs repeat them: one ACK
    /// may carry the NAKs of every request of a window, and while the
    /// requester's head request loops on RNR no probe asks for the others.
    pub(crate) recent_naks: Vec<(NakEntry, u8)>,
    /// A time-based loss check waits for the end of the batch being read.
    pub(crate) loss_check_due: bool,
    /// Arrival time (the OS's receive stamp) of the newest ACK read: the
    /// time-based loss check judges as of then (PROTOCOL §13.3).
    pub(crate) newest_ack_arrival: Instant,

    // Streams.
    pub(crate) qps: Vec<Qpn>,
    pub(crate) qp_rr: usize,

    // Endpoint bookkeeping.
    pub(crate) timer_key: Option<Instant>,
    /// Something changed since `timer_key` was computed: it is recomputed
    /// before anyone reads the timers (the connection is in the
    /// endpoint's stale list).
    pub(crate) timer_stale: bool,
    pub(crate) in_ready: bool,
    pub(crate) stats: ConnectionStats,
}

/// The last `SLOW_PORTS_KEPT` source ports that slow paths left, and when
/// (a ring).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct SlowPorts {
    ring: [Option<(u16, Instant)>; SLOW_PORTS_KEPT],
    next: usize,
}

impl SlowPorts {
    /// A slow path left `port` at `now`; the oldest entry makes room.
    pub(crate) fn note(&mut self, port: u16, now: Instant) {
        self.ring[self.next] = Some((port, now));
        self.next = (self.next + 1) % SLOW_PORTS_KEPT;
    }

    /// Whether a slow path left `port` less than `memory` before `now`.
    pub(crate) fn shuns(&self, port: u16, now: Instant, memory: Duration) -> bool {
        self.ring
            .iter()
            .flatten()
            .any(|&(p, at)| p == port && now < at + memory)
    }
}

impl Connection {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        local_cid: u32,
        peer: SocketAddr,
        local_ip: Option<IpAddr>,
        is_client: bool,
        config: &EndpointConfig,
        rng: &mut Rng,
        now: Instant,
    ) -> Self {
        let rtt = RttEstimator::new(config.initial_rto, config.min_rto, config.max_rto);
        let mut paths_tx = Vec::with_capacity(usize::from(config.paths));
        // Each path has its own window; together they start at the initial window.
        let per_path =
            (config.initial_window / u64::from(config.paths)).max(2 * u64::from(config.mtu));
        // At least two packets: with one, a path waits a whole round trip
        // (and a delayed ACK) between packets, and a GSO batch, which counts
        // against its own path's window, would never hold two.
        let path_min = config
            .min_window
            .min(per_path)
            .max(2 * u64::from(config.mtu));
        // Distinct ports per path where there are enough: a random offset
        // into the list, then consecutive entries.
        let ports = &config.source_ports;
        let first = rng.next_u32() as usize % ports.len();
        for id in 0..config.paths {
            let port = ports[(first + usize::from(id)) % ports.len()];
            let cc = SenderCc::new(
                per_path,
                path_min,
                config.max_window,
                u64::from(config.mtu),
                config.delay_target,
            );
            paths_tx.push(PathTx::new(id, port, rtt, cc));
        }
        Connection {
            local_cid,
            remote_cid: 0,
            state: if is_client {
                ConnectionState::Connecting
            } else {
                ConnectionState::Established
            },
            error: None,
            peer,
            local_ip,
            local_planes: config.plane_ips.clone(),
            peer_planes: vec![peer.ip()],
            tx_mask: u64::MAX,
            last_rx_plane: 0,
            mtu: usize::from(config.mtu),
            cookie: None,
            hello_attempts: 0,
            hello_sent_at: now,
            hello_backoff: 0,
            accept_copies_left: 0,
            hello_interval: config.handshake_rto,
            hello_copies_left: 0,
            hs_sent: 0,
            cookies_taken: 0,
            hello_deadline: None,
            ctrl: if is_client {
                Some(Ctrl::Hello)
            } else {
                Some(Ctrl::Accept)
            },
            paths_tx,
            paths_rx: Vec::new(),
            path_rr: 0,
            next_move_at: now,
            moves_made: 0,
            slow_ports: SlowPorts::default(),
            srtt_scratch: Vec::new(),
            next_csn: 0,
            csn_una: 0,
            sent: VecDeque::new(),
            retx: VecDeque::new(),
            in_flight: 0,
            ack_batch: 0,
            rtt,
            last_timeout: now,
            consecutive_rto: 0,
            silent_probe_at: None,
            peer_lag: Duration::ZERO,
            floor_shared: None,
            own_lag: Duration::ZERO,
            timeout_probes: 0,
            retry_cnt: config.retry_cnt,
            last_ack_at: now,
            last_progress: now,
            rate_hint_kbps: 0,
            peer_window: None,
            pacer: Pacer::new(
                (config.max_gso_segments.max(2) as u64).saturating_mul(u64::from(config.mtu)),
            ),
            datagram_overhead: u64::from(config.datagram_overhead),
            peer_grants: false,
            peer_coalesce: false,
            protect: crate::integrity::Protect::Plain,
            hs_security: None,
            last_data_tx: None,
            first_flight: config.first_flight_bytes,
            rx_csn: RingBitmap::new(0),
            ack_needed: false,
            ack_now: false,
            ack_deadline: None,
            since_ack: 0,
            last_rx_ts: 0,
            last_rx_path: 0,
            last_rx_at: now,
            sender_rx_at: None,
            rx_period: 0,
            is_client,
            established_at: now,
            naks: VecDeque::new(),
            dirty_streams: Vec::new(),
            repeat_acks: 0,
            recent_streams: Vec::new(),
            retired_streams: Vec::new(),
            recent_naks: Vec::new(),
            loss_check_due: false,
            newest_ack_arrival: Instant::ZERO,
            qps: Vec::new(),
            qp_rr: 0,
            timer_key: None,
            timer_stale: false,
            in_ready: false,
            stats: ConnectionStats::default(),
        }
    }

    /// Sets up the receive side for a peer spraying over `peer_paths` paths.
    pub(crate) fn set_peer_paths(&mut self, peer_paths: u8) {
        self.paths_rx = (0..peer_paths).map(|_| PathRx::new()).collect();
    }

    /// Records the peer's additional plane addresses (from its HELLO or
    /// ACCEPT) and binds the paths round robin to the planes both sides
    /// have: path `i` to plane `i mod P`, local plane `k` with the peer's
    /// plane `k`.
    pub(crate) fn set_peer_planes(&mut self, extra: &[IpAddr]) {
        self.peer_planes.truncate(1);
        self.peer_planes[0] = self.peer.ip();
        self.peer_planes.extend_from_slice(extra);
        let planes = if self.local_planes.len() < 2 {
            1
        } else {
            self.local_planes.len().min(self.peer_planes.len())
        };
        for (i, p) in self.paths_tx.iter_mut().enumerate() {
            p.plane = (i % planes) as u8;
        }
    }

    /// Planes the connection's paths use.
    pub(crate) fn planes(&self) -> usize {
        self.paths_tx
            .iter()
            .map(|p| usize::from(p.plane) + 1)
            .max()
            .unwrap_or(1)
    }

    /// The path the next ACK goes on (an index into `paths_tx`), in turn
    /// over the paths of the plane ACKs use (`ack_plane`) that carry ACKs
    /// (`PathTx::carries_acks`); a route that dropped its last packet is
    /// skipped until it delivers again. With none such, any path of the
    /// plane. Marks the paths whose route check is due (§9.1).
    pub(crate) fn next_ack_path(&mut self, now: Instant) -> usize {
        let n = self.paths_tx.len();
        let plane = self.ack_plane();
        let turn = |k: usize| (self.path_rr + k) % n;
        let pi = (0..n)
            .map(turn)
            .find(|&i| self.paths_tx[i].plane == plane && self.paths_tx[i].carries_acks())
            .or_else(|| (0..n).map(turn).find(|&i| self.paths_tx[i].plane == plane))
            .unwrap_or(self.path_rr % n);
        self.path_rr = (pi + 1) % n;
        self.paths_tx[pi].carried_ack(now);
        let interval = self
            .rtt
            .srtt()
            .map_or(self.rtt.rto(), |s| s * crate::consts::ACK_PATH_CHECK_RTTS);
        for p in &mut self.paths_tx {
            p.schedule_check(now, interval, &self.rtt);
        }
        pi
    }

    /// The plane ACKs go on: the one the latest DATA arrived on, if some
    /// path of this side uses it (else plane 0).
    pub(crate) fn ack_plane(&self) -> u8 {
        if self.paths_tx.iter().any(|p| p.plane == self.last_rx_plane) {
            self.last_rx_plane
        } else {
            0
        }
    }

    /// Whether `ip` is one of the peer's plane addresses.
    pub(crate) fn is_peer_ip(&self, ip: IpAddr) -> bool {
        self.peer.ip() == ip || self.peer_planes.contains(&ip)
    }

    /// Whether the driver can send on `plane` now.
    pub(crate) fn plane_open(&self, plane: u8) -> bool {
        self.tx_mask & (1u64 << (plane & 63)) != 0
    }

    /// Whether path `p` may be used by this transmit call.
    pub(crate) fn path_open(&self, p: &PathTx) -> bool {
        self.plane_open(p.plane)
    }

    /// A path that may send a NOP probe now, if any: a failed one with
    /// nothing in flight (probing its new route), or an active one whose
    /// tail-loss probe is due (§13.3); its plane open.
    pub(crate) fn probe_path(&self) -> Option<usize> {
        if !self.csn_room() {
            return None;
        }
        self.paths_tx
            .iter()
            .position(|p| self.probe_due_on(p) && p.has_room())
    }

    /// Whether path `p` may send a NOP probe, its window aside (the test
    /// of [`probe_path`](Self::probe_path)).
    #[inline]
    fn probe_due_on(&self, p: &PathTx) -> bool {
        let failed = || p.state == PathState::Probing && p.in_flight == 0;
        let tail = || p.state == PathState::Active && p.probe_due && p.move_to.is_none();
        let check = || p.check_due && p.in_flight == 0 && p.move_to.is_none();
        (failed() || tail() || check()) && self.path_open(p)
    }

    /// The reference RTT of the delay signal (PROTOCOL §14, Delay): the
    /// least RTT seen (`least`), or more where every active path has a
    /// delay this connection did not make: the delay they all share now,
    /// at most what they shared while every window was near its minimum
    /// (a host held up, routers short of CPU: sending less drains none
    /// of it). A queue that all paths cross and that this connection fills
    /// grows past that, and counts.
    pub(crate) fn delay_reference(&mut self, least: Duration) -> Duration {
        // In one look at the active paths (this runs on every ACK): the
        // delay they all have, the least smoothed RTT among them once two
        // or more have one, and whether every window is near its minimum.
        let (mut timed, mut shared, mut at_floor) = (0, Duration::MAX, true);
        for p in self
            .paths_tx
            .iter()
            .filter(|p| p.state == PathState::Active)
        {
            if let Some(s) = p.rtt.srtt() {
                timed += 1;
                shared = shared.min(s);
            }
            at_floor &= p.cc.near_min();
        }
        if timed < 2 {
            return least;
        }
        if at_floor {
            self.floor_shared = Some(self.floor_shared.map_or(shared, |f| (f * 7 + shared) / 8));
        }
        self.floor_shared
            .map_or(least, |f| shared.min(f).max(least))
    }

    /// Whether any path has room in its window, and whether
    /// [`probe_path`](Self::probe_path) has one (a probe is due). Most
    /// paths have no probe due: their flags are tested before their room.
    pub(crate) fn room_and_probe(&self) -> (bool, bool) {
        if self.probe_path().is_some() {
            return (true, true);
        }
        (self.paths_tx.iter().any(PathTx::has_room), false)
    }

    /// Whether [`pick_path`](Self::pick_path) has a path for `bytes`: one
    /// the driver can send on, active, with room in its window and span
    /// ([`path_room`](Self::path_room), the test `pick_path` makes).
    pub(crate) fn data_path_room(&self, bytes: u64) -> bool {
        self.paths_tx.iter().any(|p| self.path_room(p, bytes))
    }

    pub(crate) fn is_established(&self) -> bool {
        self.state == ConnectionState::Established
    }

    pub(crate) fn is_open(&self) -> bool {
        matches!(
            self.state,
            ConnectionState::Connecting | ConnectionState::Established
        )
    }

    /// The connection's RTO (paths time out on their own estimates).
    pub(crate) fn rto(&self) -> Duration {
        self.rtt.rto()
    }

    /// When path `pi`'s oldest outstanding packet times out: its RTO
    /// after it was sent, plus the lags of the latest ACK (at most one more
    /// RTO): how long the peer held it and how long it then waited for
    /// this side. While either end works through a backlog of datagrams,
    /// packets and ACKs in it are late, not lost (PROTOCOL §13.3).
    pub(crate) fn path_deadline(&self, pi: usize) -> Option<Instant> {
        let d = self.paths_tx[pi].deadline(&self.rtt, self.peer_lag + self.own_lag)?;
        Some(self.silence_hold().map_or(d, |end| d.max(end)))
    }

    /// The bytes in flight, summed again over the paths after packets
    /// left them (acknowledged, or declared lost).
    pub(crate) fn recount_in_flight(&mut self) {
        self.in_flight = self.paths_tx.iter().map(|p| p.in_flight).sum();
    }

    /// How long the current round of timeouts lasts: the RTO, doubled for
    /// each round in a row without progress (at most `max_rto`). Timeouts
    /// within one round count once toward `retry_cnt`.
    pub(crate) fn timeout_round(&self) -> Duration {
        let shift = u32::from(self.consecutive_rto.saturating_sub(1)).min(16);
        (self.rto() * (1u32 << shift)).min(self.rtt.max_rto())
    }

    /// While the whole connection is silent and has its probe out (a
    /// silent timeout sent one and nothing was acknowledged since), until
    /// when every path waits for that probe's answer: the end of its round.
    /// One probe answers for all; a host stall that timed every path out
    /// within a millisecond used to cost a packet per path.
    pub(crate) fn silence_hold(&self) -> Option<Instant> {
        self.silent_probe_at
            .filter(|&t| self.last_progress <= t)
            .map(|t| t + self.timeout_round())
    }

    /// The MTU full segments are sized by: the connection's, less the
    /// datagram's trailer (`wire::segment_payload`, `SegLimit`). Where a
    /// SEND_IMM's or WRITE_IMM's later packets drop the immediate data
    /// depends on it too, so segmenting and encoding must ask the same.
    pub(crate) fn segment_mtu(&self) -> usize {
        self.mtu - self.protect.trailer_len()
    }

    /// The sum of the paths' windows.
    pub(crate) fn window(&self) -> u64 {
        self.paths_tx.iter().map(|p| p.cc.window()).sum()
    }

    /// The cap the receiver's rate grant puts on bytes in flight: the grant
    /// times the smoothed RTT (with headroom for ACK timing).
    pub(crate) fn rate_cap(&self) -> Option<u64> {
        if self.rate_hint_kbps == 0 {
            return None;
        }
        // The smoothed RTT, not the smallest: a grant must still fill the
        // pipe when the fabric queues a little (a cap on the base RTT held
        // lone senders below their grant). The queue itself is bounded by
        // the paths' ECN and delay reactions.
        let rtt = self.rtt.srtt()?;
        let bytes_per_sec = u64::from(self.rate_hint_kbps) * 1000 / 8;
        // Plus one ACK's worth of bytes: the RTT sample leaves out the time
        // the receiver holds a packet before acking it (delayed and
        // coalesced ACKs), but bytes are freed only when the ACK arrives, a
        // batch at a time. Without it a short-RTT connection (5 us: the
        // batch is a quarter of grant x RTT) idles its link waiting for ACKs.
        let cap = (bytes_per_sec as f64 * rtt.as_secs_f64() * 1.25) as u64 + self.ack_batch;
        // At least two packets: with one, a small grant waits a whole
        // delayed ACK per packet and falls below itself (the pacer spreads
        // the packets at the grant anyway).
        Some(cap.max(2 * self.mtu as u64))
    }

    /// Whether a new CSN may be assigned (window of the peer's duplicate filter).
    pub(crate) fn csn_room(&self) -> bool {
        seq_dist(self.csn_una, self.next_csn) < CSN_WINDOW - 1
    }

    /// Whether some path's window (and the receiver's grant) lets `bytes`
    /// more go out.
    pub(crate) fn cwnd_room(&self, bytes: u64) -> bool {
        !self.capped(bytes) && self.data_path_room(bytes)
    }

    /// Whether `bytes` more may go out on `path` itself: its own window
    /// and span, and the receiver's grant. A GSO batch grows on one path
    /// (one source port, one route) only while that path has room: room on
    /// another path is no licence to overfill this one's route.
    pub(crate) fn cwnd_room_on(&self, path: usize, bytes: u64) -> bool {
        self.paths_tx
            .get(path)
            .is_some_and(|p| self.path_room(p, bytes))
            && !self.capped(bytes)
    }

    /// Whether the receiver's grant holds `bytes` more back: before the
    /// first ACK (no grant yet) beyond the first flight, beyond the cap of
    /// its rate, or beyond its window (one packet always goes).
    fn capped(&self, bytes: u64) -> bool {
        if self
            .peer_window
            .is_some_and(|w| self.in_flight > 0 && self.in_flight + bytes > w)
        {
            return true;
        }
        let first_flight = self.peer_grants
            // No ACK yet, so no grant yet.
            && self.stats.acks_received == 0
            && self.in_flight > 0
            && self.in_flight + bytes > self.first_flight;
        first_flight
            || self
                .rate_cap()
                .is_some_and(|cap| self.in_flight > 0 && self.in_flight + bytes > cap)
    }

    /// Whether path `p`'s own window lets `bytes` more go out on it.
    fn path_room(&self, p: &PathTx, bytes: u64) -> bool {
        self.path_open(p) && p.state == PathState::Active && p.can_send(bytes)
    }

    /// The scheduler: among the paths whose window has room for `bytes`,
    /// the least loaded (bytes in flight over window: a path the network
    /// marks, delays or loses gets a smaller window and so fewer packets),
    /// ties broken by RTT, then round robin. `avoid` (the path a packet was
    /// lost on) is used only when no other path has room.
    pub(crate) fn pick_path(&mut self, avoid: Option<u8>, bytes: u64) -> Option<usize> {
        // A failed path carries NOP probes only (`probe_path`) until it
        // delivers again: data sent into a dead route (a failed plane keeps
        // every new source port dead) would hold up its message for a
        // timeout.
        self.pick_among(avoid, bytes, |c, p| c.path_room(p, bytes))
    }

    /// [`pick_path`](Self::pick_path) among the paths `usable` lets through.
    fn pick_among(
        &mut self,
        avoid: Option<u8>,
        bytes: u64,
        usable: impl Fn(&Self, &PathTx) -> bool,
    ) -> Option<usize> {
        let n = self.paths_tx.len();
        let mut best: Option<(usize, f64, Duration)> = None;
        let mut fallback = None;
        // Round robin from `path_rr`.
        let start = self.path_rr % n.max(1);
        for i in (start..n).chain(0..start) {
            let p = &self.paths_tx[i];
            if !usable(self, p) {
                continue;
            }
            if Some(p.id) == avoid && n > 1 {
                fallback.get_or_insert(i);
                continue;
            }
            let load = p.load(bytes);
            let rtt = p.rtt.srtt().unwrap_or(Duration::ZERO);
            let better = match best {
                None => true,
                Some((_, bl, br)) => load < bl - 1e-9 || (load <= bl + 1e-9 && rtt < br),
            };
            if better {
                best = Some((i, load, rtt));
            }
        }
        let pick = best.map(|b| b.0).or(fallback)?;
        self.path_rr = (pick + 1) % n;
        Some(pick)
    }

    /// A path for a timeout's probe ([`timeout_probes`](Self::timeout_probes)):
    /// as [`pick_path`](Self::pick_path), among the active, open paths
    /// whatever their windows.
    pub(crate) fn pick_probe_path(&mut self, avoid: Option<u8>) -> Option<usize> {
        self.pick_among(avoid, 0, |c, p| {
            c.path_open(p) && p.state == PathState::Active
        })
    }

    /// Judges the paths' new RTT samples and returns those too slow for
    /// their siblings (§9.1). A sample is slow when it exceeds
    /// `SLOW_PATH_FACTOR` times the median smoothed RTT of the active
    /// paths, and that median by half a minimum RTO. Each slow sample
    /// raises the path's score by one, each other lowers it by one; a path
    /// whose score reaches `SLOW_PATH_SAMPLES` is slow. A gray link (up, at
    /// a fraction of its rate) holds every packet through it in a deep
    /// queue, and a message with one packet there completes only when
    /// that packet arrives: a smaller share does not help, a new route
    /// does. A stall of a host delays a few samples of every path, which
    /// the score forgets. At most half the paths are moving at a time,
    /// the slowest first.
    pub(crate) fn slow_paths(&mut self) -> Vec<usize> {
        let judged = |p: &PathTx| {
            p.state == PathState::Active && p.move_to.is_none() && p.delivery_samples > 0
        };
        // Most ACKs bring no new sample to judge: then nothing to sort.
        let unjudged = |p: &PathTx| judged(p) && p.delivery_samples != p.slow_judged;
        if !self.paths_tx.iter().any(unjudged) {
            return Vec::new();
        }
        let mut srtts = core::mem::take(&mut self.srtt_scratch);
        srtts.extend(
            self.paths_tx
                .iter()
                .filter(|p| judged(p))
                .filter_map(|p| p.rtt.srtt()),
        );
        srtts.sort_unstable();
        let median = (srtts.len() >= 3).then(|| srtts[srtts.len() / 2]);
        srtts.clear();
        self.srtt_scratch = srtts;
        let Some(median) = median else {
            return Vec::new();
        };
        let mut slow = Vec::new();
        for (i, p) in self.paths_tx.iter_mut().enumerate() {
            if !unjudged(p) {
                continue;
            }
            p.slow_judged = p.delivery_samples;
            let latest = p.delivery_latest;
            if latest > median * SLOW_PATH_FACTOR && latest > median + p.rtt.min_rto() / 2 {
                p.slow_score = p.slow_score.saturating_add(1);
            } else {
                p.slow_score = p.slow_score.saturating_sub(1);
            }
            if p.slow_score >= SLOW_PATH_SAMPLES {
                slow.push(i);
            }
        }
        let moving = self.paths_tx.iter().filter(|p| p.move_to.is_some()).count();
        let room = (self.paths_tx.len() / 2).saturating_sub(moving);
        slow.sort_by_key(|&i| core::cmp::Reverse(self.paths_tx[i].rtt.srtt()));
        slow.truncate(room);
        slow
    }

    /// Whether a path sends from `port`, or is moving to it.
    pub(crate) fn uses_port(&self, port: u16) -> bool {
        self.paths_tx
            .iter()
            .any(|p| p.src_port == port || p.move_to == Some(port))
    }

    /// A slow path left its route: it may have been the only path there,
    /// and the route is then found again only by draws. They start over
    /// from the shortest cooldown (each draw that gains nothing is undone,
    /// PROTOCOL §9.1). Not after a failure: the route a failed path left
    /// is dead, and draws would go back into it.
    pub(crate) fn rearm_draws(&mut self, now: Instant) {
        self.moves_made = 0;
        self.next_move_at = self.next_move_at.min(now + self.move_cooldown(0));
    }

    /// The wait after a congested-path move before the next (§9.1):
    /// `REPATH_COOLDOWN_RTTS` smoothed RTTs, doubled `doublings` times (at
    /// most `REPATH_MAX_BACKOFF`).
    pub(crate) fn move_cooldown(&self, doublings: u32) -> Duration {
        let srtt = self.rtt.srtt().unwrap_or(self.rtt.rto());
        srtt * REPATH_COOLDOWN_RTTS * (1u32 << doublings.min(REPATH_MAX_BACKOFF))
    }

    /// Assigns the next CSN to `kind`.
    pub(crate) fn new_csn(&mut self, kind: CsnKind) -> u32 {
        self.push_csn(kind, 0, 0)
    }

    /// [`new_csn`](Self::new_csn) for a packet going out on `path` now:
    /// its record says so from the start ([`note_data_sent`](Self::note_data_sent)
    /// with `recorded` then leaves it alone).
    pub(crate) fn new_csn_sent(&mut self, kind: CsnKind, path: usize) -> u32 {
        let last_path = self.paths_tx.get(path).map_or(0, |p| p.id);
        self.push_csn(kind, last_path, 1)
    }

    fn push_csn(&mut self, kind: CsnKind, last_path: u8, transmissions: u16) -> u32 {
        let csn = self.next_csn;
        self.next_csn = csn.wrapping_add(1);
        self.sent.push_back(CsnRecord {
            kind,
            acked: false,
            queued: false,
            last_path,
            transmissions,
            copy_due: false,
        });
        csn
    }

    /// Books a DATA packet of `size` bytes (`payload` of them its payload)
    /// just put out on `path` for `csn`: the path's record, bytes in flight,
    /// pacing, counters, and the CSN's last path and transmissions (unless
    /// `recorded`: [`new_csn_sent`](Self::new_csn_sent) wrote them).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn note_data_sent(
        &mut self,
        path: usize,
        csn: u32,
        now: Instant,
        size: usize,
        payload: usize,
        retransmit: bool,
        recorded: bool,
    ) {
        let p = &mut self.paths_tx[path];
        p.record_send(csn, now, size as u32, retransmit);
        let path_id = p.id;
        // One look-up of the CSN's record serves both: its last path and
        // transmissions, and its kind. A NOP (a probe, a route check) is no
        // request or response: it does not make the ACKs this side owes
        // wait for DATA to ride on (§12).
        let nop = match self.record_mut(csn) {
            Some(r) => {
                if !recorded {
                    r.last_path = path_id;
                    r.transmissions = r.transmissions.saturating_add(1);
                }
                matches!(r.kind, CsnKind::Nop)
            }
            None => false,
        };
        if !nop {
            self.last_data_tx = Some(now);
        }
        self.in_flight += size as u64;
        self.pacer.sent(now, size as u64 + self.datagram_overhead);
        self.stats.data_packets_sent += 1;
        if !retransmit {
            self.stats.payload_bytes_sent += payload as u64;
        }
    }

    pub(crate) fn record_mut(&mut self, csn: u32) -> Option<&mut CsnRecord> {
        if seq_lt(csn, self.csn_una) {
            return None;
        }
        self.sent.get_mut(seq_dist(self.csn_una, csn) as usize)
    }

    /// Marks `csn` delivered. Returns its kind if this is news.
    pub(crate) fn ack_csn(&mut self, csn: u32) -> Option<CsnKind> {
        let rec = self.record_mut(csn)?;
        if rec.acked {
            return None;
        }
        rec.acked = true;
        let kind = rec.kind;
        while self.sent.front().is_some_and(|r| r.acked) {
            self.sent.pop_front();
            self.csn_una = self.csn_una.wrapping_add(1);
        }
        Some(kind)
    }

    /// Packets declared lost before any timeout (a SACK gap, by time, a
    /// slow path's move): counted, and their CSNs queued for a fast
    /// retransmission.
    pub(crate) fn retransmit_lost(&mut self, lost: &[u32]) {
        self.stats.packets_lost += lost.len() as u64;
        for &csn in lost {
            if self.queue_retransmit(csn) {
                self.stats.fast_retransmits += 1;
            }
        }
    }

    /// Queues `csn` for retransmission unless it is delivered or queued already.
    pub(crate) fn queue_retransmit(&mut self, csn: u32) -> bool {
        match self.record_mut(csn) {
            Some(r) if !r.acked && !r.queued => {
                r.queued = true;
                self.retx.push_back(csn);
                true
            }
            _ => false,
        }
    }

    /// Notes a received DATA packet for the ACK machinery: it came in on
    /// `path` at `arrived` (its OS receive stamp, or `now`), echoing
    /// `tx_ts`. An ACK is owed: at once if `urgent` (a hole, a duplicate)
    /// or `ack_every` packets are unacknowledged, soon if the packet `asked`
    /// for one ([`ack_soon`](Self::ack_soon)), else by the ACK delay.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn note_rx(
        &mut self,
        now: Instant,
        arrived: Instant,
        path: u8,
        tx_ts: u32,
        urgent: bool,
        asked: bool,
        ack: AckTiming,
    ) {
        self.last_rx_ts = tx_ts;
        self.last_rx_path = path;
        // The ACK delay the peer is told runs from here: the wait for this
        // thread is ours, not the network's.
        self.last_rx_at = arrived;
        self.ack_needed = true;
        self.since_ack += 1;
        if urgent || self.since_ack >= ack.every {
            self.ack_now = true;
        } else if asked {
            self.ack_soon(now, ack.hold);
        } else if self.ack_deadline.is_none() {
            self.ack_deadline = Some(now + ack.delay);
        }
    }

    /// An ACK the peer asked for (the last packet of a message, a message
    /// done): at once, unless this side is sending DATA to the peer
    /// itself and the peer takes coalesced datagrams. Then it waits up to
    /// `hold` for a DATA packet to ride on (PROTOCOL §12): a request and its
    /// response then cost two datagrams, not four. A delayed-ACK deadline
    /// already running stays in force if it is sooner: the hold never
    /// outlasts the ACK delay of the packet that arrived.
    pub(crate) fn ack_soon(&mut self, now: Instant, hold: Duration) {
        self.ack_needed = true;
        let sending = self
            .last_data_tx
            .is_some_and(|t| now.saturating_since(t) <= ACK_HOLD_SENDING);
        if self.peer_coalesce && sending && !hold.is_zero() {
            let by = now + hold;
            self.ack_deadline = Some(self.ack_deadline.map_or(by, |d| d.min(by)));
        } else {
            self.ack_now = true;
        }
    }

    /// QP `qpn` (local), whose peer QP is `entry.qpn`, is destroyed: its
    /// progress still goes to the peer. Not reported yet, it goes now (an
    /// ACK held for an answer to ride on included: the application is
    /// done with the QP and may exit before the hold is over, and the
    /// peer's last requests would wait until their retries ran out); and
    /// it is repeated as the progress of a live QP is
    /// ([`recent_streams`](Self::recent_streams)), from `retired_streams`.
    pub(crate) fn retire_stream(&mut self, qpn: Qpn, entry: AckStreamEntry, unreported: bool) {
        if unreported {
            self.note_stream(qpn);
        }
        let owed = self.dirty_streams.contains(&qpn);
        if owed || self.recent_streams.iter().any(|r| r.0 == qpn) {
            self.retired_streams.push((qpn, entry));
        }
        if owed {
            self.ack_now = true;
        }
    }

    /// Queues a NAK (once per message and code).
    pub(crate) fn push_nak(&mut self, nak: NakEntry) {
        // One NAK per message and code: a newer one (an RNR of a later
        // generation, a longer timer) replaces the one still queued, which
        // the requester would drop as stale and then wait for a timeout.
        match self
            .naks
            .iter_mut()
            .find(|n| n.qpn == nak.qpn && n.msn == nak.msn && n.code == nak.code)
        {
            Some(queued) => *queued = nak,
            None => self.naks.push_back(nak),
        }
        // The new one supersedes any repeated.
        self.recent_naks
            .retain(|(n, _)| !(n.qpn == nak.qpn && n.msn == nak.msn && n.code == nak.code));
        self.ack_needed = true;
        self.ack_now = true;
    }

    /// Marks a stream's progress as owed to the peer, at once.
    pub(crate) fn mark_stream(&mut self, qpn: Qpn) {
        self.note_stream(qpn);
        self.ack_now = true;
    }

    /// Marks a stream's progress as owed to the peer, soon
    /// ([`ack_soon`](Self::ack_soon)): messages done, which the response
    /// about to go may carry.
    pub(crate) fn mark_stream_soon(&mut self, qpn: Qpn, now: Instant, hold: Duration) {
        self.note_stream(qpn);
        self.ack_soon(now, hold);
    }

    fn note_stream(&mut self, qpn: Qpn) {
        if !self.dirty_streams.contains(&qpn) {
            self.dirty_streams.push(qpn);
        }
        self.ack_needed = true;
    }

    /// Whether an ACK must go out now.
    pub(crate) fn ack_due(&self, now: Instant) -> bool {
        self.ack_needed && (self.ack_now || self.ack_deadline.is_some_and(|d| d <= now))
    }

    /// The source port of the next handshake datagram (HELLO, ACCEPT):
    /// the plane-0 paths' ports in turn, one per datagram sent (§8.2), so
    /// that a route that drops everything (a silent blackhole) cannot
    /// hold every retry.
    pub(crate) fn next_handshake_port(&mut self) -> u16 {
        let plane0 = self.paths_tx.iter().filter(|p| p.plane == 0).count().max(1);
        let k = usize::from(self.hs_sent) % plane0;
        self.hs_sent = self.hs_sent.wrapping_add(1);
        self.paths_tx
            .iter()
            .filter(|p| p.plane == 0)
            .nth(k)
            .map_or(self.paths_tx[0].src_port, |p| p.src_port)
    }

    /// The local address to send from on `plane`.
    pub(crate) fn plane_src(&self, plane: u8) -> Option<IpAddr> {
        self.local_planes
            .get(usize::from(plane))
            .copied()
            .or(self.local_ip)
    }

    /// Where packets on `plane` go: the peer's address on that plane.
    pub(crate) fn plane_dst(&self, plane: u8) -> SocketAddr {
        let ip = self
            .peer_planes
            .get(usize::from(plane))
            .copied()
            .unwrap_or(self.peer.ip());
        SocketAddr::new(ip, self.peer.port())
    }

    pub(crate) fn snapshot(&self) -> ConnectionStats {
        let mut s = self.stats.clone();
        s.cwnd = self.window();
        s.in_flight = self.in_flight;
        s.srtt_ns = self.rtt.srtt().map_or(0, crate::time::nanos);
        s.rto_ns = crate::time::nanos(self.rto());
        s.rate_hint_kbps = self.rate_hint_kbps;
        s.peer_window = self.peer_window.unwrap_or(0);
        s.paths = self.paths_tx.iter().map(|p| p.snapshot()).collect();
        s
    }

    /// Records a CSN in the receive window. Out-of-window CSNs are refused
    /// before anything else is touched.
    pub(crate) fn csn_in_window(&self, csn: u32) -> bool {
        seq_lt(csn, self.rx_csn.cum()) || seq_dist(self.rx_csn.cum(), csn) < CSN_WINDOW
    }

    pub(crate) fn accept_csn(&mut self, csn: u32) -> SeqAccept {
        self.rx_csn.insert(csn)
    }
}

#[cfg(test)]
mod slow_ports_tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn a_slow_port_is_shunned_for_a_while_then_not() {
        let mut sp = SlowPorts::default();
        let t0 = Instant::ZERO + 5 * MS;
        assert!(!sp.shuns(4000, t0, 100 * MS), "nothing noted yet");
        sp.note(4000, t0);
        assert!(sp.shuns(4000, t0 + 99 * MS, 100 * MS));
        assert!(!sp.shuns(4001, t0 + MS, 100 * MS), "only the port noted");
        // A route slow for a moment (a queue, a stall) is not shunned for
        // good: once no path uses it, only a move can find it again.
        assert!(!sp.shuns(4000, t0 + 100 * MS, 100 * MS));
    }

    #[test]
    fn the_ring_keeps_the_last_ports() {
        let mut sp = SlowPorts::default();
        let t0 = Instant::ZERO;
        for port in 0..(SLOW_PORTS_KEPT as u16 + 1) {
            sp.note(5000 + port, t0);
        }
        assert!(!sp.shuns(5000, t0, 100 * MS), "the oldest made room");
        for port in 1..=(SLOW_PORTS_KEPT as u16) {
            assert!(sp.shuns(5000 + port, t0, 100 * MS));
        }
    }
}
