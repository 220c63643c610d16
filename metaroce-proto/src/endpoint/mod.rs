//! The endpoint: demultiplexing, handshake, and the receive and transmit
//! paths. See [`Endpoint`] for the driver loop.

mod cookie;
mod qp_ops;
mod recv;
mod transmit;

use crate::config::{ConfigError, EndpointConfig};
use crate::connection::{Connection, ConnectionError, ConnectionState, ConnectionStats, Ctrl};
use crate::rng::Rng;
use crate::stats::{EndpointStats, RejectReason};
use crate::time::Instant;
use crate::verbs::qp::{consumes_recv, Qp, SendWqe};
use crate::verbs::{
    AccessFlags, CompletionQueue, ConnectionHandle, CqHandle, MrInfo, MrTable, PdHandle, QpAttrs,
    QpInit, QpState, Qpn, RcAttrs, RecvWr, RegionBuf, SendOp, SendWr, VerbsError, WcStatus,
    WorkCompletion,
};
use crate::wire::CloseCode;
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::net::{IpAddr, SocketAddr};

/// The connection table's map, by our own CIDs, with a fixed
/// (deterministic) hasher: iteration order never leaks into behaviour, but
/// determinism is cheap to keep.
///
/// Fx, not SipHash: every data packet looks its connection up by CID, and
/// SipHash cost about 100 instructions of that (a sixth of the receiver's
/// per-packet protocol work, `scripts/packet-cost.sh`). A keyed hash buys
/// nothing here: the keys are CIDs this endpoint drew at random, so no
/// sender can fill the table with colliding keys, and a CID it makes up
/// costs one probe sequence among well-spread ones.
type CidMap<V> = HashMap<u32, V, rustc_hash::FxBuildHasher>;

/// The handshake's map, by what the peer chose (its address, port and
/// CID): keyed SipHash, with a secret drawn with the endpoint's, so that a
/// peer cannot pick keys that collide.
type PeerMap<K, V> = HashMap<K, V, KeyedSip>;

/// SipHash-1-3 under a secret key.
#[derive(Debug, Clone, Copy)]
struct KeyedSip(u64, u64);

impl std::hash::BuildHasher for KeyedSip {
    type Hasher = siphasher::sip::SipHasher13;
    fn build_hasher(&self) -> Self::Hasher {
        siphasher::sip::SipHasher13::new_with_keys(self.0, self.1)
    }
}

/// ECN codepoint of an IP packet (RFC 3168).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Ecn {
    /// Not ECN-capable.
    #[default]
    NotEct,
    /// ECN-capable, codepoint 1.
    Ect1,
    /// ECN-capable, codepoint 0.
    Ect0,
    /// Congestion experienced.
    Ce,
}

impl Ecn {
    /// From the two low bits of the IP TOS / traffic class byte.
    pub fn from_bits(bits: u8) -> Ecn {
        match bits & 0b11 {
            0b00 => Ecn::NotEct,
            0b01 => Ecn::Ect1,
            0b10 => Ecn::Ect0,
            _ => Ecn::Ce,
        }
    }

    /// The two ECN bits.
    pub fn bits(self) -> u8 {
        match self {
            Ecn::NotEct => 0b00,
            Ecn::Ect1 => 0b01,
            Ecn::Ect0 => 0b10,
            Ecn::Ce => 0b11,
        }
    }
}

/// A datagram (or a GSO batch of them) for the driver to send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transmit {
    /// Destination address.
    pub dst: SocketAddr,
    /// Local address to send from (`None`: the driver's default).
    pub src_ip: Option<IpAddr>,
    /// UDP source port: the path's ECMP entropy.
    pub src_port: u16,
    /// ECN codepoint to set.
    pub ecn: Ecn,
    /// Bytes written to the buffer.
    pub size: usize,
    /// With several datagrams batched: the size of each but the last (UDP GSO).
    pub segment_size: Option<usize>,
}

/// One piece of a gathered transmit
/// ([`poll_transmit_gather`](Endpoint::poll_transmit_gather)), in wire order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Chunk {
    /// Bytes of the transmit buffer (headers, and payloads too small to be
    /// worth a reference).
    Buf(core::ops::Range<usize>),
    /// Bytes of a registered memory region, by its local key: a payload
    /// straight out of the region the request names. The region stays
    /// pinned (it cannot be deregistered) until the driver hands the
    /// transmit's [`RegionPin`]s ([`Gather::take_pins`]) back to
    /// [`release_pins`](Endpoint::release_pins).
    Region {
        /// The region's local key (also for a READ response, which names
        /// its region by rkey on the wire).
        lkey: u32,
        /// The bytes, as a range of [`Endpoint::mr`]`(lkey)`.
        range: core::ops::Range<usize>,
    },
}

/// Where the bytes of a gathered transmit are: the headers in the transmit
/// buffer, the payloads in their memory regions. Kept by the driver and
/// reused for every call.
///
/// ```
/// use metaroce_proto::{Chunk, Gather};
/// let g = Gather::new(1024);
/// assert!(g.chunks().is_empty());
/// assert!(matches!(Chunk::Buf(0..64), Chunk::Buf(_)));
/// ```
#[derive(Debug, Default)]
pub struct Gather {
    chunks: Vec<Chunk>,
    /// Not yet taken by the driver: one per region each transmit reads
    /// (a GSO batch of one message's segments pins its region once).
    pins: Vec<RegionPin>,
    /// Where the current transmit's pins begin in `pins`.
    pins_from: usize,
    min_payload: usize,
    /// Bytes of the buffer the current transmit uses so far.
    at: usize,
}

/// A gathered payload's hold on its memory region: while it exists the
/// region cannot be deregistered, so its memory stays where the kernel reads
/// it. Made only by the endpoint that gathered the payload, not `Clone`, and
/// only that endpoint's [`release_pins`](Endpoint::release_pins) lets go of
/// it (another endpoint ignores it). A pin that is dropped instead keeps its
/// region pinned for good, and an endpoint dropped while pins are out leaks
/// those regions' memory rather than free what the kernel may still read.
#[derive(Debug)]
#[must_use = "a dropped pin keeps its region pinned for good"]
pub struct RegionPin {
    pub(crate) lkey: u32,
    pub(crate) owner: u64,
}

impl Gather {
    /// Payloads of at least `min_payload` bytes are referenced in their
    /// region; smaller ones are copied into the buffer (a reference costs
    /// the kernel a page walk; a short copy is cheaper).
    pub fn new(min_payload: usize) -> Self {
        Gather {
            chunks: Vec::new(),
            pins: Vec::new(),
            pins_from: 0,
            min_payload: min_payload.max(1),
            at: 0,
        }
    }

    /// The pieces of the last transmit, in order. Empty: the transmit is
    /// the buffer's first `size` bytes, as with
    /// [`poll_transmit`](Endpoint::poll_transmit).
    pub fn chunks(&self) -> &[Chunk] {
        &self.chunks
    }

    /// Moves the pins of the transmits gathered so far into `into`, for the
    /// driver to keep until the kernel is done with their bytes.
    pub fn take_pins(&mut self, into: &mut Vec<RegionPin>) {
        into.append(&mut self.pins);
        self.pins_from = 0;
    }

    /// Whether any payload of the last transmit is in a region.
    pub fn has_regions(&self) -> bool {
        self.chunks
            .iter()
            .any(|c| matches!(c, Chunk::Region { .. }))
    }

    /// Appends `len` bytes of the buffer at the current position.
    fn push_buf(&mut self, len: usize) {
        let at = self.at;
        match self.chunks.last_mut() {
            Some(Chunk::Buf(r)) if r.end == at => r.end += len,
            _ => self.chunks.push(Chunk::Buf(at..at + len)),
        }
        self.at += len;
    }

    /// Appends the `tl` bytes of a datagram's trailer (PROTOCOL §3.1),
    /// filled in once the transmit is complete.
    #[inline]
    pub(crate) fn push_trailer(&mut self, tl: usize) {
        if tl > 0 {
            self.push_buf(tl);
        }
    }

    /// A new transmit. Pins not taken yet stay: dropping them would leave
    /// their regions pinned for good.
    fn start(&mut self) {
        self.chunks.clear();
        self.at = 0;
        self.pins_from = self.pins.len();
    }

    /// Appends a packet whose `hlen` bytes of header are at the current
    /// position of the buffer and whose payload stays at `range` of region
    /// `lkey`, pinned for the transmit.
    #[inline]
    pub(crate) fn push_region(
        &mut self,
        hlen: usize,
        mrs: &mut MrTable,
        lkey: u32,
        range: core::ops::Range<usize>,
    ) {
        self.push_buf(hlen);
        self.pin(mrs, lkey);
        self.chunks.push(Chunk::Region { lkey, range });
    }

    /// Pins region `lkey` of `mrs` for the current transmit, unless it
    /// already holds it.
    pub(crate) fn pin(&mut self, mrs: &mut MrTable, lkey: u32) {
        if self.pins[self.pins_from..].iter().any(|p| p.lkey == lkey) {
            return;
        }
        if let Some(pin) = mrs.pin(lkey) {
            self.pins.push(pin);
        }
    }
}

/// A payload of a sealed connection's datagram that is not in the
/// transmit buffer yet: `range` of region `lkey`, whose place is at `at` in
/// the buffer, right before its datagram's trailer.
#[derive(Debug)]
struct SealPayload {
    at: usize,
    lkey: u32,
    range: core::ops::Range<usize>,
}

/// Something the application should know about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// A connection we opened is established.
    Connected(ConnectionHandle),
    /// A peer opened a connection to us.
    Incoming {
        /// The new connection.
        conn: ConnectionHandle,
        /// Peer address (IP and listening port).
        peer: SocketAddr,
    },
    /// A connection ended; its QPs are in the error state.
    ConnectionLost {
        /// The connection.
        conn: ConnectionHandle,
        /// Why.
        error: ConnectionError,
    },
    /// A QP moved to the error state.
    QpError {
        /// The QP.
        qpn: Qpn,
        /// Status of the request that caused it.
        status: WcStatus,
    },
    /// A completion queue holds more completions than its capacity.
    CqOverrun(CqHandle),
}

/// Why `Endpoint::new` failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EndpointError {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
}

const QPN_INDEX_BITS: u32 = 20;
const QPN_INDEX_MASK: u32 = (1 << QPN_INDEX_BITS) - 1;
/// Stateless replies (COOKIE, VERSION_NEGOTIATION) queued at most.
const MAX_STATELESS_QUEUE: usize = 1024;

/// A stateless reply waiting to be sent.
#[derive(Debug, Clone, Copy)]
struct StatelessReply {
    dst: SocketAddr,
    /// The UDP source port it goes from.
    src_port: u16,
    buf: [u8; crate::consts::HELLO_LEN],
    len: usize,
}

/// A metaroce endpoint: one per host (or per set of sockets), owning the verbs
/// objects and the connections, driven by datagrams and time.
///
/// The driver loop, after quinn-proto:
///
/// - [`Endpoint::handle_datagram`] for every datagram received,
/// - [`Endpoint::poll_transmit`] until it returns `None`, sending each transmit,
/// - [`Endpoint::poll_timeout`] to know when to call [`Endpoint::handle_timeout`],
/// - [`Endpoint::poll_event`] for connection events, and
///   [`Endpoint::poll_cq`] for work completions.
///
/// ```
/// use metaroce_proto::{Endpoint, EndpointConfig, Instant, Event};
/// use metaroce_proto::verbs::*;
/// use std::net::SocketAddr;
///
/// let a_addr: SocketAddr = "10.0.0.1:4792".parse().unwrap();
/// let b_addr: SocketAddr = "10.0.0.2:4792".parse().unwrap();
/// let mut a = Endpoint::new(EndpointConfig::default(), 1).unwrap();
/// let mut b = Endpoint::new(EndpointConfig::default(), 2).unwrap();
///
/// // Verbs objects on both sides.
/// let (pa, pb) = (a.alloc_pd(), b.alloc_pd());
/// let (ca, cb) = (a.create_cq(64), b.create_cq(64));
/// let src = a.reg_mr(pa, vec![7u8; 10_000].into_boxed_slice(), 0, AccessFlags::NONE).unwrap();
/// let dst = b.reg_mr(pb, vec![0u8; 10_000].into_boxed_slice(), 0x9000, AccessFlags::REMOTE_WRITE).unwrap();
/// let qa = a.create_qp(QpInit::new(pa, ca, ca)).unwrap();
/// let qb = b.create_qp(QpInit::new(pb, cb, cb)).unwrap();
///
/// // Connect, exchanging QP numbers out of band.
/// let mut now = Instant::ZERO;
/// let conn_a = a.connect(now, b_addr).unwrap();
/// let mut buf = vec![0u8; 9000];
/// let mut conn_b = None;
/// let mut pump = |a: &mut Endpoint, b: &mut Endpoint, now: Instant, conn_b: &mut Option<_>| {
///     for _ in 0..100 {
///         let mut moved = false;
///         while let Some(t) = a.poll_transmit(now, &mut buf) {
///             b.handle_datagram(now, a_addr, t.ecn, &buf[..t.size]);
///             moved = true;
///         }
///         while let Some(t) = b.poll_transmit(now, &mut buf) {
///             a.handle_datagram(now, b_addr, t.ecn, &buf[..t.size]);
///             moved = true;
///         }
///         while let Some(e) = b.poll_event() {
///             if let Event::Incoming { conn, .. } = e { *conn_b = Some(conn); }
///         }
///         if !moved { break; }
///     }
/// };
/// pump(&mut a, &mut b, now, &mut conn_b);
/// a.connect_qp(qa, conn_a, qb).unwrap();
/// b.connect_qp(qb, conn_b.unwrap(), qa).unwrap();
///
/// // WRITE 10 000 bytes and wait for the completion.
/// let wr = SendWr::new(1, SendOp::Write(RemoteAddr { rkey: dst.rkey, addr: dst.addr }),
///                      Sge { lkey: src.lkey, addr: 0, len: 10_000 });
/// a.post_send(now, qa, wr).unwrap();
/// now = Instant::from_nanos(1_000);
/// pump(&mut a, &mut b, now, &mut conn_b);
/// let mut wcs = Vec::new();
/// a.poll_cq(ca, 16, &mut wcs).unwrap();
/// assert_eq!(wcs[0].status, WcStatus::Success);
/// assert!(b.mr(dst.lkey).unwrap().iter().all(|&x| x == 7));
/// ```
#[derive(Debug)]
pub struct Endpoint {
    config: EndpointConfig,
    rng: Rng,
    cookie_key: (u64, u64),
    conns: Vec<Option<Connection>>,
    by_cid: CidMap<usize>,
    by_peer: PeerMap<(IpAddr, u16, u32), usize>,
    pds: Vec<bool>,
    mrs: MrTable,
    cqs: Vec<CompletionQueue>,
    qps: Vec<Option<Qp>>,
    qp_gens: Vec<u32>,
    events: VecDeque<Event>,
    timers: BTreeSet<(Instant, usize)>,
    /// Connections whose timer must be recomputed before the timers are
    /// read ([`Connection::timer_stale`]): a burst of sends and ACKs costs
    /// one recomputation, not one each.
    stale: Vec<usize>,
    ready: VecDeque<usize>,
    /// Connections whose time-based loss check waits for the end of the
    /// batch of datagrams being read (see `run_loss_checks`).
    loss_checks: Vec<usize>,
    stateless: VecDeque<StatelessReply>,
    /// Stateless replies the rate allows now (`stateless_rate`), and when
    /// the bucket was last filled.
    stateless_tokens: u32,
    stateless_filled: Instant,
    /// QPs that exist.
    qp_count: usize,
    stats: EndpointStats,
    /// Where sealed datagrams are opened (PROTOCOL §3.2): grown to the
    /// largest datagram once, reused for every one.
    rx_scratch: Vec<u8>,
    /// The payloads of the transmit being built for a sealed connection,
    /// in order: left in their regions, to be encrypted straight into
    /// their places when the transmit is sealed.
    sealing: Vec<SealPayload>,
    local_ip: Option<IpAddr>,
    /// The latest `now` the driver has given.
    last_now: Instant,
    /// Reused by every ACK: the CSNs it delivered and declared lost, what
    /// the delivered ones carried (request segments as a count per run of
    /// one QP, the rest one by one); empty between ACKs.
    ack_scratch: AckScratch,
    /// Reused by every ACK built: its stream entries (QP progress), with
    /// their QP and whether they are fresh; empty between ACKs.
    stream_scratch: Vec<(crate::wire::AckStreamEntry, Qpn, bool)>,
    /// Connections in the `Established` state.
    established: usize,
    /// The receiver's grant to its senders.
    rcc: crate::cc::ReceiverCc,
    /// Connections that delivered data lately: what the receive window is
    /// shared by.
    rx_active: crate::cc::ActiveSenders,
}

/// See `Endpoint::ack_scratch`.
type AckScratch = (
    Vec<u32>,
    Vec<u32>,
    Vec<crate::connection::CsnKind>,
    Vec<(Qpn, u32)>,
);

impl Endpoint {
    /// A new endpoint. `seed` drives every random choice (connection ids,
    /// keys, source ports, cookie secret): the same seed gives the same behaviour.
    pub fn new(config: EndpointConfig, seed: u64) -> Result<Self, EndpointError> {
        config.validate()?;
        let mut rng = Rng::new(seed);
        let rcc_config = (
            config.receiver_capacity_kbps,
            config.receiver_active_window,
            config.receive_buffer,
        );
        let cookie_key = (rng.next_u64(), rng.next_u64());
        let stateless_burst = config.stateless_burst;
        Ok(Endpoint {
            config,
            rng,
            cookie_key,
            conns: Vec::new(),
            by_cid: CidMap::default(),
            // Not the cookie secret itself: a key of its own, derived from it.
            by_peer: PeerMap::with_hasher(KeyedSip(
                cookie_key.0 ^ 0x7065_6572_5f6d_6170,
                cookie_key.1.rotate_left(29) ^ 0x6279_5f70_6565_7221,
            )),
            pds: Vec::new(),
            // The key permutation's secret: derived from the cookie secret,
            // like the peer map's, so the generator's sequence is unchanged.
            mrs: MrTable::new((
                cookie_key.0.rotate_left(41) ^ 0x6d72_5f6b_6579_735f,
                cookie_key.1 ^ 0x7065_726d_7574_6521,
            )),
            cqs: Vec::new(),
            qps: Vec::new(),
            qp_gens: Vec::new(),
            events: VecDeque::new(),
            timers: BTreeSet::new(),
            stale: Vec::new(),
            ready: VecDeque::new(),
            loss_checks: Vec::new(),
            stateless: VecDeque::new(),
            stateless_tokens: stateless_burst,
            stateless_filled: Instant::ZERO,
            qp_count: 0,
            stats: EndpointStats::default(),
            rx_scratch: Vec::new(),
            sealing: Vec::new(),
            local_ip: None,
            last_now: Instant::ZERO,
            ack_scratch: Default::default(),
            stream_scratch: Vec::new(),
            established: 0,
            rcc: crate::cc::ReceiverCc::new(rcc_config.0, rcc_config.1).with_buffer(rcc_config.2),
            rx_active: crate::cc::ActiveSenders::new(rcc_config.1),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &EndpointConfig {
        &self.config
    }

    /// Sets the local address put in every [`Transmit::src_ip`] (for drivers
    /// with several local addresses; `None` lets the driver choose).
    pub fn set_local_ip(&mut self, ip: Option<IpAddr>) {
        self.local_ip = ip;
    }

    /// Connections currently established.
    pub fn established_connections(&self) -> usize {
        self.established
    }

    /// Endpoint-wide counters.
    pub fn stats(&self) -> EndpointStats {
        self.stats
    }

    /// A connection's counters, paths included.
    pub fn connection_stats(&self, conn: ConnectionHandle) -> Option<ConnectionStats> {
        self.conn(conn).map(|c| c.snapshot())
    }

    /// The MTU a connection sends with (UDP payload bytes of a datagram):
    /// this endpoint's [`EndpointConfig::mtu`] until the handshake ends,
    /// then the smaller of the two endpoints' (each side says its own in
    /// its HELLO or ACCEPT).
    ///
    /// ```
    /// use metaroce_proto::{Endpoint, EndpointConfig, Instant};
    /// let cfg = EndpointConfig { mtu: 8256, ..EndpointConfig::default() };
    /// let mut ep = Endpoint::new(cfg, 1).unwrap();
    /// let conn = ep.connect(Instant::ZERO, "10.0.0.2:4792".parse().unwrap()).unwrap();
    /// // No ACCEPT yet: this side's own.
    /// assert_eq!(ep.connection_mtu(conn), Some(8256));
    /// ```
    pub fn connection_mtu(&self, conn: ConnectionHandle) -> Option<u16> {
        self.conn(conn)
            .map(|c| u16::try_from(c.mtu).unwrap_or(u16::MAX))
    }

    /// What protects a connection's datagrams: negotiated in its
    /// handshake, [`Protection::None`](crate::Protection::None) until it ends.
    ///
    /// ```
    /// use metaroce_proto::{Endpoint, EndpointConfig, Instant, Protection};
    /// let mut ep = Endpoint::new(EndpointConfig::default(), 1).unwrap();
    /// let conn = ep.connect(Instant::ZERO, "10.0.0.2:4792".parse().unwrap()).unwrap();
    /// assert_eq!(ep.connection_protection(conn), Some(Protection::None));
    /// ```
    pub fn connection_protection(&self, conn: ConnectionHandle) -> Option<crate::Protection> {
        self.conn(conn).map(|c| c.protect.kind())
    }

    /// A connection's state.
    pub fn connection_state(&self, conn: ConnectionHandle) -> Option<ConnectionState> {
        self.conn(conn).map(|c| c.state)
    }

    /// Every connection handle, in creation order.
    pub fn connections(&self) -> impl Iterator<Item = ConnectionHandle> + '_ {
        self.conns
            .iter()
            .enumerate()
            .filter(|(_, c)| c.is_some())
            .map(|(i, _)| ConnectionHandle(i as u32))
    }

    fn conn(&self, h: ConnectionHandle) -> Option<&Connection> {
        self.conns.get(h.0 as usize)?.as_ref()
    }

    fn reject(&mut self, reason: RejectReason, from: SocketAddr) {
        self.stats.rejects.bump(reason);
        tracing::debug!(?reason, %from, "rejected packet");
    }

    // ------------------------------------------------------------------
    // Verbs: protection domains, memory regions, completion queues, QPs.
    // ------------------------------------------------------------------

    /// Allocates a protection domain (`ibv_alloc_pd`).
    pub fn alloc_pd(&mut self) -> PdHandle {
        self.pds.push(true);
        PdHandle((self.pds.len() - 1) as u32)
    }

    /// Frees a protection domain that holds no memory region or QP (`ibv_dealloc_pd`).
    pub fn dealloc_pd(&mut self, pd: PdHandle) -> Result<(), VerbsError> {
        self.check_pd(pd)?;
        if self.mrs.count_in_pd(pd) > 0 || self.qps.iter().flatten().any(|q| q.pd == pd) {
            return Err(VerbsError::PdInUse);
        }
        self.pds[pd.0 as usize] = false;
        Ok(())
    }

    fn check_pd(&self, pd: PdHandle) -> Result<(), VerbsError> {
        match self.pds.get(pd.0 as usize) {
            Some(true) => Ok(()),
            _ => Err(VerbsError::InvalidPd),
        }
    }

    /// Registers `buf` as a memory region whose byte 0 has virtual address
    /// `addr` (`ibv_reg_mr` with an iova). The endpoint owns the buffer
    /// until [`dereg_mr`](Self::dereg_mr) returns it. A
    /// [`RegionBuf::zeroed`] buffer starts on a page, as regions should; a
    /// `Box<[u8]>` or `Vec<u8>` is taken as it is, and so is memory the
    /// application allocated itself ([`RegionBuf::from_owner`], or, raw,
    /// [`RegionBuf::from_raw_parts`]): the region's bytes are that memory,
    /// in place.
    ///
    /// As `ibv_reg_mr` pins a region's pages, registration maps every page
    /// of the buffer ([`RegionBuf::make_resident`]), keeping its bytes, so
    /// that no transfer waits for a page fault: a few hundred faults per
    /// MiB taken here, on the calling thread, unless the buffer was made
    /// [`resident`](RegionBuf::resident) before. With
    /// [`AccessFlags::ON_DEMAND`] the pages are left to their first access.
    ///
    /// ```
    /// use metaroce_proto::verbs::{AccessFlags, RegionBuf};
    /// use metaroce_proto::{Endpoint, EndpointConfig};
    /// let mut ep = Endpoint::new(EndpointConfig::default(), 1).unwrap();
    /// let pd = ep.alloc_pd();
    /// let mr = ep
    ///     .reg_mr(pd, RegionBuf::zeroed(1 << 20), 0, AccessFlags::REMOTE_WRITE)
    ///     .unwrap();
    /// assert_eq!(mr.len, 1 << 20);
    /// assert!(ep.dereg_mr(mr.lkey).unwrap().is_page_aligned());
    /// ```
    pub fn reg_mr(
        &mut self,
        pd: PdHandle,
        buf: impl Into<RegionBuf>,
        addr: u64,
        access: AccessFlags,
    ) -> Result<MrInfo, VerbsError> {
        self.check_pd(pd)?;
        if self.mrs.len() >= self.config.max_regions {
            return Err(VerbsError::TooManyRegions);
        }
        let mut buf = buf.into();
        if !access.contains(AccessFlags::ON_DEMAND) {
            buf.make_resident();
        }
        // Keys come from the table's own permutation; this draw keeps the
        // generator's sequence (ports, ids) what it was when each
        // registration drew a key salt, so that a seed replays the same
        // simulation as before.
        let _ = self.rng.next_u32();
        self.mrs.register(pd, buf, addr, access)
    }

    /// Deregisters a region and hands its buffer back. Fails while work
    /// requests or READ responses still reference it.
    pub fn dereg_mr(&mut self, lkey: u32) -> Result<RegionBuf, VerbsError> {
        self.mrs.deregister(lkey)
    }

    /// The bytes of a region, for the application to read: a slice over
    /// the whole region. For memory registered raw
    /// ([`RegionBuf::from_raw_parts`]) nothing else may write any of its
    /// bytes while the slice lives; [`mr_range`](Self::mr_range) takes
    /// only the bytes it names.
    pub fn mr(&self, lkey: u32) -> Option<&[u8]> {
        self.mrs.by_lkey(lkey).map(|m| m.buf.whole())
    }

    /// The bytes `range` of region `lkey` (offsets from its byte 0), for
    /// the application to read, or for a driver that hands a gathered
    /// payload ([`Chunk::Region`]) to the kernel: a slice over those bytes
    /// only, so that the application may use others of a region registered
    /// raw meanwhile. `None` if there is no such region or the range
    /// reaches outside it.
    ///
    /// ```
    /// use metaroce_proto::verbs::{AccessFlags, RegionBuf};
    /// use metaroce_proto::{Endpoint, EndpointConfig};
    /// let mut ep = Endpoint::new(EndpointConfig::default(), 1).unwrap();
    /// let pd = ep.alloc_pd();
    /// let mr = ep.reg_mr(pd, RegionBuf::copy_of(b"hello, world"), 0, AccessFlags::NONE).unwrap();
    /// assert_eq!(ep.mr_range(mr.lkey, 7..12), Some(&b"world"[..]));
    /// assert_eq!(ep.mr_range(mr.lkey, 7..13), None);
    /// ep.mr_range_mut(mr.lkey, 0..5).unwrap().copy_from_slice(b"HELLO");
    /// assert_eq!(ep.mr(mr.lkey).unwrap(), b"HELLO, world");
    /// ```
    pub fn mr_range(&self, lkey: u32, range: core::ops::Range<usize>) -> Option<&[u8]> {
        self.mrs.by_lkey(lkey)?.buf.get(range)
    }

    /// The bytes `range` of region `lkey`, for the application to write
    /// (see [`mr_range`](Self::mr_range) and [`mr_mut`](Self::mr_mut)).
    pub fn mr_range_mut(&mut self, lkey: u32, range: core::ops::Range<usize>) -> Option<&mut [u8]> {
        self.mrs.by_lkey_mut(lkey)?.buf.get_mut(range)
    }

    /// The bytes of a region, for the application to write (a region moves
    /// nowhere while registered: it is the same memory every call). Bytes
    /// that an outstanding SEND/WRITE reads, or that a peer may WRITE, must
    /// not be changed until the request completes. A driver that gathers
    /// ([`poll_transmit_gather`](Self::poll_transmit_gather)) has the kernel
    /// read payloads from the region itself, possibly a moment after the
    /// request completed (a retransmission already on its way); such a copy
    /// is a duplicate the peer drops unread, so writing after the completion
    /// is safe.
    ///
    /// A slice over the whole region: for memory registered raw
    /// ([`RegionBuf::from_raw_parts`]) nothing else may access any of its
    /// bytes while it lives; [`mr_range_mut`](Self::mr_range_mut) takes
    /// only the bytes it names.
    pub fn mr_mut(&mut self, lkey: u32) -> Option<&mut [u8]> {
        self.mrs.by_lkey_mut(lkey).map(|m| m.buf.whole_mut())
    }

    /// Lends the bytes of region `lkey` to the application: they leave
    /// the endpoint, which keeps the region's keys, until
    /// [`return_mr`](Self::return_mr) brings them back. Meanwhile a post
    /// that names the region is refused with [`VerbsError::MrLent`],
    /// [`mr`](Self::mr) shows no bytes, and a peer's WRITE or READ of it
    /// fails with `RemoteAccessError` (its QP then fails, as when a region
    /// is deregistered): lend a region no peer accesses at the time.
    ///
    /// Refused while requests or READ responses reference the region
    /// ([`VerbsError::MrInUse`]), while the driver still sends from it
    /// ([`VerbsError::MrSending`]: retry after its next poll), or if it is
    /// lent already ([`VerbsError::MrLent`]).
    ///
    /// ```
    /// use metaroce_proto::verbs::{AccessFlags, RegionBuf};
    /// use metaroce_proto::{Endpoint, EndpointConfig};
    /// let mut ep = Endpoint::new(EndpointConfig::default(), 1).unwrap();
    /// let pd = ep.alloc_pd();
    /// let mr = ep.reg_mr(pd, RegionBuf::zeroed(4096), 0, AccessFlags::LOCAL_WRITE).unwrap();
    /// let mut bytes = ep.lend_mr(mr.lkey).unwrap();
    /// bytes[..5].copy_from_slice(b"hello"); // in place, no copy
    /// ep.return_mr(mr.lkey, bytes).unwrap();
    /// assert_eq!(&ep.mr(mr.lkey).unwrap()[..5], b"hello");
    /// ```
    pub fn lend_mr(&mut self, lkey: u32) -> Result<RegionBuf, VerbsError> {
        self.mrs.lend(lkey)
    }

    /// Brings lent bytes back ([`lend_mr`](Self::lend_mr)); `buf` must be
    /// as long as the region ([`VerbsError::InvalidLength`] if not).
    pub fn return_mr(&mut self, lkey: u32, buf: RegionBuf) -> Result<(), VerbsError> {
        self.mrs.give_back(lkey, buf)
    }

    /// Information about a registered region.
    pub fn mr_info(&self, lkey: u32) -> Option<MrInfo> {
        self.mrs.by_lkey(lkey).map(|m| m.info)
    }

    /// Creates a completion queue of `capacity` entries (`ibv_create_cq`),
    /// in the slot of a destroyed one if there is one.
    pub fn create_cq(&mut self, capacity: usize) -> CqHandle {
        let q = CompletionQueue::new(capacity);
        match self.cqs.iter().position(|q| !q.live) {
            Some(i) => {
                self.cqs[i] = q;
                CqHandle(i as u32)
            }
            None => {
                self.cqs.push(q);
                CqHandle((self.cqs.len() - 1) as u32)
            }
        }
    }

    /// Destroys a completion queue (`ibv_destroy_cq`), with the completions
    /// still in it; its handle is then invalid, and a later
    /// [`create_cq`](Self::create_cq) may reuse its number.
    /// [`VerbsError::CqInUse`] while a QP completes to it.
    ///
    /// ```
    /// use metaroce_proto::verbs::VerbsError;
    /// use metaroce_proto::{Endpoint, EndpointConfig};
    /// let mut ep = Endpoint::new(EndpointConfig::default(), 1).unwrap();
    /// let cq = ep.create_cq(16);
    /// ep.destroy_cq(cq).unwrap();
    /// assert_eq!(ep.destroy_cq(cq), Err(VerbsError::InvalidCq));
    /// ```
    pub fn destroy_cq(&mut self, cq: CqHandle) -> Result<(), VerbsError> {
        let i = self.live_cq(cq)?;
        let used = self
            .qps
            .iter()
            .flatten()
            .any(|q| q.send_cq == cq || q.recv_cq == cq);
        if used {
            return Err(VerbsError::CqInUse);
        }
        let q = &mut self.cqs[i];
        q.live = false;
        q.entries = VecDeque::new();
        Ok(())
    }

    /// The slot of queue `cq`, if the queue exists (not destroyed).
    fn live_cq(&self, cq: CqHandle) -> Result<usize, VerbsError> {
        let i = cq.0 as usize;
        match self.cqs.get(i) {
            Some(q) if q.live => Ok(i),
            _ => Err(VerbsError::InvalidCq),
        }
    }

    /// Moves up to `max` completions into `out` (`ibv_poll_cq`); returns how many.
    pub fn poll_cq(
        &mut self,
        cq: CqHandle,
        max: usize,
        out: &mut Vec<WorkCompletion>,
    ) -> Result<usize, VerbsError> {
        let i = self.live_cq(cq)?;
        let q = &mut self.cqs[i];
        let n = max.min(q.entries.len());
        out.extend(q.entries.drain(..n));
        if q.entries.len() <= q.capacity {
            q.overrun_reported = false;
        }
        Ok(n)
    }

    /// Completions waiting in a queue.
    pub fn cq_len(&self, cq: CqHandle) -> Result<usize, VerbsError> {
        Ok(self.cqs[self.live_cq(cq)?].entries.len())
    }

    /// Creates a queue pair in the RESET state (`ibv_create_qp`).
    pub fn create_qp(&mut self, init: QpInit) -> Result<Qpn, VerbsError> {
        self.check_pd(init.pd)?;
        let max_sge = crate::consts::MAX_SGE as u32;
        if !(1..=max_sge).contains(&init.max_send_sge) {
            return Err(VerbsError::InvalidAttribute(
                "max_send_sge not in 1..=MAX_SGE",
            ));
        }
        if !(1..=max_sge).contains(&init.max_recv_sge) {
            return Err(VerbsError::InvalidAttribute(
                "max_recv_sge not in 1..=MAX_SGE",
            ));
        }
        if self.qp_count >= self.config.max_qps {
            return Err(VerbsError::TooManyQps);
        }
        for cq in [init.send_cq, init.recv_cq] {
            self.live_cq(cq)?;
        }
        let idx = match self.qps.iter().position(|q| q.is_none()) {
            Some(i) => i,
            None => {
                if self.qps.len() as u32 >= QPN_INDEX_MASK {
                    return Err(VerbsError::QueueFull(QPN_INDEX_MASK));
                }
                self.qps.push(None);
                self.qp_gens.push(0);
                self.qps.len() - 1
            }
        };
        self.qp_gens[idx] = (self.qp_gens[idx] + 1) % (1 << (32 - QPN_INDEX_BITS));
        if self.qp_gens[idx] == 0 {
            self.qp_gens[idx] = 1;
        }
        let qpn = Qpn((self.qp_gens[idx] << QPN_INDEX_BITS) | idx as u32);
        let mut q = Qp::new(
            qpn,
            init.pd,
            init.send_cq,
            init.recv_cq,
            init.max_send_wr,
            init.max_recv_wr,
        );
        q.max_send_sge = init.max_send_sge;
        q.max_recv_sge = init.max_recv_sge;
        self.qps[idx] = Some(q);
        self.qp_count += 1;
        Ok(qpn)
    }

    fn qp_index(&self, qpn: Qpn) -> Option<usize> {
        let idx = (qpn.0 & QPN_INDEX_MASK) as usize;
        match self.qps.get(idx) {
            Some(Some(q)) if q.qpn == qpn => Some(idx),
            _ => None,
        }
    }

    pub(crate) fn qp_mut(&mut self, qpn: Qpn) -> Option<&mut Qp> {
        let idx = self.qp_index(qpn)?;
        self.qps[idx].as_mut()
    }

    /// A QP's state.
    pub fn qp_state(&self, qpn: Qpn) -> Option<QpState> {
        self.qp_index(qpn)
            .and_then(|i| self.qps[i].as_ref())
            .map(|q| q.state)
    }

    /// Destroys a QP (`ibv_destroy_qp`); outstanding requests are flushed first.
    pub fn destroy_qp(&mut self, qpn: Qpn) -> Result<(), VerbsError> {
        let idx = self.qp_index(qpn).ok_or(VerbsError::InvalidQp(qpn))?;
        self.fail_qp(qpn, None, false);
        if let Some(qp) = self.qps[idx].take() {
            self.qp_count -= 1;
            if let Some(c) = qp.conn {
                let ci = c.0 as usize;
                if let Some(conn) = self.conns.get_mut(ci).and_then(|c| c.as_mut()) {
                    conn.qps.retain(|&q| q != qpn);
                    let unreported = qp.msn_done != qp.reported_msn_done;
                    conn.retire_stream(qpn, qp.stream_entry(), unreported);
                    self.touch(ci, None);
                }
            }
        }
        Ok(())
    }

    /// Moves a QP to state `to` with `attrs` (`ibv_modify_qp`). Illegal
    /// transitions and missing attributes are typed errors.
    pub fn modify_qp(&mut self, qpn: Qpn, to: QpState, attrs: QpAttrs) -> Result<(), VerbsError> {
        if attrs.timeout.is_some_and(|t| t.is_zero()) {
            return Err(VerbsError::InvalidAttribute("a timeout of 0"));
        }
        let idx = self.qp_index(qpn).ok_or(VerbsError::InvalidQp(qpn))?;
        let from = self.qps[idx]
            .as_ref()
            .map(|q| q.state)
            .ok_or(VerbsError::InvalidQp(qpn))?;
        if !from.can_move_to(to) {
            return Err(VerbsError::IllegalTransition { from, to });
        }
        match (from, to) {
            (_, QpState::Reset) => {
                self.fail_qp(qpn, None, false);
                self.unbind_qp(qpn);
                if let Some(q) = self.qps[idx].as_mut() {
                    q.reset();
                }
                return Ok(());
            }
            (_, QpState::Error) => {
                self.fail_qp(qpn, None, true);
                return Ok(());
            }
            (QpState::Init, QpState::Rtr) => {
                let conn = attrs.conn.ok_or(VerbsError::MissingAttribute("conn"))?;
                let remote = attrs
                    .remote_qpn
                    .ok_or(VerbsError::MissingAttribute("remote_qpn"))?;
                let ci = conn.0 as usize;
                match self.conns.get_mut(ci).and_then(|c| c.as_mut()) {
                    Some(c) if c.is_open() => {
                        if !c.qps.contains(&qpn) {
                            c.qps.push(qpn);
                        }
                    }
                    _ => return Err(VerbsError::InvalidConnection),
                }
                let q = self.qps[idx].as_mut().ok_or(VerbsError::InvalidQp(qpn))?;
                q.conn = Some(conn);
                q.remote_qpn = remote.0;
                if let Some(v) = attrs.max_dest_rd_atomic {
                    q.max_dest_rd_atomic = v.max(1);
                }
                if let Some(v) = attrs.min_rnr_timer {
                    q.min_rnr_timer = v;
                }
            }
            _ => {}
        }
        let q = self.qps[idx].as_mut().ok_or(VerbsError::InvalidQp(qpn))?;
        if let Some(a) = attrs.access {
            q.access = a;
        }
        if let Some(v) = attrs.rnr_retry {
            q.rnr_retry = v.min(7);
        }
        if let Some(v) = attrs.max_rd_atomic {
            q.max_rd_atomic = v.max(1);
        }
        if let Some(v) = attrs.retry_cnt {
            q.retry_cnt = Some(v.min(7));
        }
        if let Some(t) = attrs.timeout {
            q.timeout = Some(t);
        }
        q.state = to;
        let conn = q.conn;
        if let Some(c) = conn {
            self.touch(c.0 as usize, None);
        }
        Ok(())
    }

    fn unbind_qp(&mut self, qpn: Qpn) {
        let Some(idx) = self.qp_index(qpn) else {
            return;
        };
        let Some(conn) = self.qps[idx].as_ref().and_then(|q| q.conn) else {
            return;
        };
        if let Some(c) = self.conns.get_mut(conn.0 as usize).and_then(|c| c.as_mut()) {
            c.qps.retain(|&q| q != qpn);
        }
    }

    /// RESET→INIT→RTR→RTS in one call, with every remote access allowed and
    /// default attributes: the usual way to bring up an RC QP once the
    /// connection exists and the peer's QP number is known.
    pub fn connect_qp(
        &mut self,
        qpn: Qpn,
        conn: ConnectionHandle,
        remote_qpn: Qpn,
    ) -> Result<(), VerbsError> {
        self.connect_qp_with(qpn, conn, remote_qpn, &RcAttrs::default())
    }

    /// RESET→INIT→RTR→RTS in one call with the RC attributes `attrs` (what
    /// `ibv_modify_qp` takes for the three transitions). Fails with
    /// [`VerbsError::InvalidAttribute`] before any transition if a value is
    /// out of range ([`RcAttrs::validate`]).
    ///
    /// ```
    /// use metaroce_proto::verbs::{QpInit, QpState, RcAttrs};
    /// use metaroce_proto::{Endpoint, EndpointConfig};
    /// let mut ep = Endpoint::new(EndpointConfig::default(), 1).unwrap();
    /// let (pd, cq) = (ep.alloc_pd(), ep.create_cq(16));
    /// let qp = ep.create_qp(QpInit::new(pd, cq, cq)).unwrap();
    /// let conn = ep.connect(metaroce_proto::Instant::ZERO, "127.0.0.1:4791".parse().unwrap()).unwrap();
    /// let attrs = RcAttrs { rnr_retry: 0, ..RcAttrs::default() };
    /// ep.connect_qp_with(qp, conn, qp, &attrs).unwrap();
    /// assert_eq!(ep.qp_state(qp), Some(QpState::Rts));
    /// ```
    pub fn connect_qp_with(
        &mut self,
        qpn: Qpn,
        conn: ConnectionHandle,
        remote_qpn: Qpn,
        attrs: &RcAttrs,
    ) -> Result<(), VerbsError> {
        attrs.validate()?;
        self.modify_qp(
            qpn,
            QpState::Init,
            QpAttrs {
                access: Some(attrs.access),
                ..Default::default()
            },
        )?;
        self.modify_qp(
            qpn,
            QpState::Rtr,
            QpAttrs {
                conn: Some(conn),
                remote_qpn: Some(remote_qpn),
                max_dest_rd_atomic: Some(attrs.max_dest_rd_atomic),
                min_rnr_timer: Some(attrs.min_rnr_timer),
                ..Default::default()
            },
        )?;
        self.modify_qp(
            qpn,
            QpState::Rts,
            QpAttrs {
                retry_cnt: attrs.retry_cnt,
                timeout: attrs.timeout,
                rnr_retry: Some(attrs.rnr_retry),
                max_rd_atomic: Some(attrs.max_rd_atomic),
                ..Default::default()
            },
        )
    }

    /// Posts a receive (`ibv_post_recv`). In the error state it completes at
    /// once with `WrFlushError`.
    ///
    /// Refused at once (typed error) when the QP's state does not take
    /// receives, its queue is full, the request has more elements than the
    /// QP's `max_recv_sge` ([`VerbsError::TooManySge`]) or more bytes than
    /// a message carries, or one of its elements is not a buffer the QP may
    /// write (no such region, another PD, no `LOCAL_WRITE`, out of bounds,
    /// lent). Each element's region is held until the receive completes:
    /// it cannot be deregistered meanwhile.
    pub fn post_recv(&mut self, qpn: Qpn, wr: RecvWr) -> Result<(), VerbsError> {
        let idx = self.qp_index(qpn).ok_or(VerbsError::InvalidQp(qpn))?;
        let Endpoint {
            qps,
            mrs,
            cqs,
            events,
            ..
        } = self;
        let q = qps[idx].as_mut().ok_or(VerbsError::InvalidQp(qpn))?;
        if q.state == QpState::Error {
            let wc = q.recv_flush_wc(&wr);
            qp_ops::push_wc(cqs, events, q.recv_cq, wc);
            return Ok(());
        }
        if !q.state.takes_recv() {
            return Err(VerbsError::InvalidState(q.state));
        }
        if q.rq.len() as u32 >= q.max_recv_wr {
            return Err(VerbsError::QueueFull(q.max_recv_wr));
        }
        check_list(&wr.sge, q.max_recv_sge)?;
        mrs.local_access_list(q.pd, &wr.sge, AccessFlags::LOCAL_WRITE)?;
        mrs.add_list_refs(&wr.sge, 1);
        q.rq.push_back(wr);
        Ok(())
    }

    /// Posts a send work request (`ibv_post_send`).
    ///
    /// Refused at once (typed error) when the QP's state does not take sends,
    /// its queue is full, the request has more elements than the QP's
    /// `max_send_sge` ([`VerbsError::TooManySge`]) or more bytes than a
    /// message carries, or one of its local regions is lent
    /// ([`lend_mr`](Self::lend_mr)). A request with an invalid local
    /// element (no such region, another PD, out of bounds, or a READ into a
    /// region without `LOCAL_WRITE`) is accepted and completes with
    /// `LocalProtectionError` when its turn comes, moving the QP to the
    /// error state, as with verbs. Each element's region is held until the
    /// request completes: it cannot be deregistered meanwhile.
    ///
    /// A message gathered from several elements is sent in packets that
    /// each carry bytes of one element only.
    pub fn post_send(&mut self, now: Instant, qpn: Qpn, wr: SendWr) -> Result<(), VerbsError> {
        let idx = self.qp_index(qpn).ok_or(VerbsError::InvalidQp(qpn))?;
        let Endpoint {
            qps,
            mrs,
            cqs,
            events,
            ..
        } = self;
        let q = qps[idx].as_mut().ok_or(VerbsError::InvalidQp(qpn))?;
        if q.state == QpState::Error {
            let wc = q.send_wc(&SendWqe::new(wr, 0, 0, None, false), WcStatus::WrFlushError);
            qp_ops::push_wc(cqs, events, q.send_cq, wc);
            return Ok(());
        }
        if !q.state.takes_send() {
            return Err(VerbsError::InvalidState(q.state));
        }
        if q.sq.len() as u32 >= q.max_send_wr {
            return Err(VerbsError::QueueFull(q.max_send_wr));
        }
        check_list(&wr.local, q.max_send_sge)?;
        let need = if matches!(wr.op, SendOp::Read(_)) {
            AccessFlags::LOCAL_WRITE
        } else {
            AccessFlags::NONE
        };
        let checked = mrs.local_access_list(q.pd, &wr.local, need);
        // A lent region is a passing state, not a bad buffer: refused now,
        // the QP stays as it is.
        if let Err(e @ VerbsError::MrLent(_)) = checked {
            return Err(e);
        }
        let ok = checked.is_ok();
        let has_ref = ok;
        if has_ref {
            mrs.add_list_refs(&wr.local, 1);
        }
        let msn = q.next_msn;
        q.next_msn = msn.wrapping_add(1);
        let recv_seq = q.next_recv_seq;
        if consumes_recv(&wr.op) {
            q.next_recv_seq = recv_seq.wrapping_add(1);
        }
        q.sq.push_back(SendWqe::new(
            wr,
            msn,
            recv_seq,
            if ok {
                None
            } else {
                Some(WcStatus::LocalProtectionError)
            },
            has_ref,
        ));
        if let Some(c) = q.conn {
            self.touch(c.0 as usize, Some(now));
        }
        Ok(())
    }

    // ------------------------------------------------------------------
    // Connections.
    // ------------------------------------------------------------------

    /// Opens a connection to the endpoint listening at `peer`. The
    /// [`Event::Connected`] event says when it is established; QPs may be
    /// bound to it at once.
    pub fn connect(
        &mut self,
        now: Instant,
        peer: SocketAddr,
    ) -> Result<ConnectionHandle, VerbsError> {
        let ci = self.new_connection(now, peer, true)?;
        if let Some(psk) = &self.config.psk {
            let nonce = self.rng.nonce();
            if let Some(c) = self.conns[ci].as_mut() {
                c.hs_security = Some(crate::wire::SecurityExt {
                    suite: crate::wire::SUITE_AES_128_GCM,
                    nonce,
                    proof: psk.hello_proof(&nonce, c.local_cid),
                });
            }
        }
        self.touch(ci, Some(now));
        Ok(ConnectionHandle(ci as u32))
    }

    fn new_connection(
        &mut self,
        now: Instant,
        peer: SocketAddr,
        is_client: bool,
    ) -> Result<usize, VerbsError> {
        if self.by_cid.len() >= self.config.max_connections {
            return Err(VerbsError::TooManyConnections);
        }
        if is_client {
            let connecting = self
                .conns
                .iter()
                .flatten()
                .filter(|c| c.state == ConnectionState::Connecting)
                .count();
            if connecting >= self.config.max_handshakes {
                return Err(VerbsError::TooManyHandshakes);
            }
        }
        let cid = loop {
            let c = self.rng.next_u32();
            if c != 0 && !self.by_cid.contains_key(&c) {
                break c;
            }
        };
        let ci = self
            .conns
            .iter()
            .position(|c| c.is_none())
            .unwrap_or_else(|| {
                self.conns.push(None);
                self.conns.len() - 1
            });
        let conn = Connection::new(
            cid,
            peer,
            self.local_ip,
            is_client,
            &self.config,
            &mut self.rng,
            now,
        );
        if conn.is_established() {
            self.established += 1;
        }
        self.conns[ci] = Some(conn);
        self.by_cid.insert(cid, ci);
        self.stats.connections_opened += 1;
        Ok(ci)
    }

    /// Closes a connection: a CLOSE goes to the peer, every QP bound to it
    /// moves to the error state.
    pub fn close(&mut self, now: Instant, conn: ConnectionHandle) -> Result<(), VerbsError> {
        let ci = conn.0 as usize;
        let c = self
            .conns
            .get_mut(ci)
            .and_then(|c| c.as_mut())
            .ok_or(VerbsError::InvalidConnection)?;
        if !c.is_open() {
            return Ok(());
        }
        let was_established = c.is_established();
        c.ctrl = if was_established {
            Some(Ctrl::Close(CloseCode::Normal))
        } else {
            None
        };
        self.end_connection(ci, ConnectionState::Closed, ConnectionError::LocallyClosed);
        self.touch(ci, Some(now));
        Ok(())
    }

    /// Frees a closed or failed connection's slot.
    pub fn release_connection(&mut self, conn: ConnectionHandle) -> Result<(), VerbsError> {
        let ci = conn.0 as usize;
        let c = self
            .conns
            .get(ci)
            .and_then(|c| c.as_ref())
            .ok_or(VerbsError::InvalidConnection)?;
        if c.is_open() || c.ctrl.is_some() {
            return Err(VerbsError::InvalidConnection);
        }
        let c = self.conns[ci].take().ok_or(VerbsError::InvalidConnection)?;
        self.by_cid.remove(&c.local_cid);
        self.by_peer.retain(|_, v| *v != ci);
        if let Some(k) = c.timer_key {
            self.timers.remove(&(k, ci));
        }
        self.ready.retain(|&r| r != ci);
        Ok(())
    }

    /// Ends a connection: state, event, QPs to error.
    fn end_connection(&mut self, ci: usize, state: ConnectionState, error: ConnectionError) {
        let Some(c) = self.conns[ci].as_mut() else {
            return;
        };
        if c.is_established() {
            self.established -= 1;
        }
        c.state = state;
        c.error = Some(error);
        c.retx.clear();
        let qps = c.qps.clone();
        let status = match error {
            ConnectionError::RetryExceeded => WcStatus::RetryExceeded,
            _ => WcStatus::WrFlushError,
        };
        for qpn in qps {
            // The oldest outstanding request gets the reason; the rest are flushed.
            let first = self.qp_mut(qpn).and_then(|q| q.sq.front().map(|w| w.msn));
            self.fail_qp(qpn, first.map(|m| (m, status)), true);
        }
        self.events.push_back(Event::ConnectionLost {
            conn: ConnectionHandle(ci as u32),
            error,
        });
    }

    // ------------------------------------------------------------------
    // Driver loop.
    // ------------------------------------------------------------------

    /// The next event, if any.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// How many completions (in every completion queue) and events wait
    /// for the application: what [`poll_cq`](Self::poll_cq) and
    /// [`poll_event`](Self::poll_event) would hand out.
    ///
    /// A driver compares it before and after a turn: a turn that made
    /// completions or events (a request that failed on this side when its
    /// turn to be sent came, say, which sends nothing) is one in which
    /// something happened, and must return to its caller rather than sleep
    /// with them undelivered.
    ///
    /// ```
    /// use metaroce_proto::{Endpoint, EndpointConfig};
    /// let mut ep = Endpoint::new(EndpointConfig::default(), 1).unwrap();
    /// ep.create_cq(16);
    /// assert_eq!(ep.unpolled(), 0);
    /// ```
    pub fn unpolled(&self) -> usize {
        self.events.len() + self.cqs.iter().map(|q| q.entries.len()).sum::<usize>()
    }

    /// When [`handle_timeout`](Self::handle_timeout) must be called next.
    pub fn poll_timeout(&mut self) -> Option<Instant> {
        self.refresh_timers();
        let next = self.timers.iter().next().map(|&(t, _)| t);
        if self.loss_checks.is_empty() {
            next
        } else {
            // A loss check waits for the end of the batch: due now.
            Some(next.map_or(self.last_now, |t| t.min(self.last_now)))
        }
    }

    /// Runs the time-based loss checks (PROTOCOL §13.3) that ACKs read
    /// since the last call made due: once per batch of datagrams, after
    /// all of them, not after each.
    pub(crate) fn run_loss_checks(&mut self, now: Instant) {
        while let Some(ci) = self.loss_checks.pop() {
            let judge = self.conns[ci].as_mut().and_then(|c| {
                std::mem::replace(&mut c.loss_check_due, false)
                    .then(|| c.newest_ack_arrival.min(now))
            });
            if let Some(at) = judge {
                self.detect_path_losses(ci, at);
                self.touch(ci, Some(now));
            }
        }
    }

    /// Runs every timer due at `now`.
    ///
    /// A driver hands the endpoint every datagram that has arrived before
    /// it runs timers, above all timers it runs late (its thread was held
    /// up): a retransmission timeout judged while the ACKs that answer it
    /// wait unread declares packets lost that arrived, and fails paths
    /// that deliver. `metaroce-io`'s io_uring driver, which reads a few
    /// receive buffers a turn, reads on before late timers for this.
    pub fn handle_timeout(&mut self, now: Instant) {
        self.last_now = self.last_now.max(now);
        self.run_loss_checks(now);
        self.refresh_timers();
        // Each due connection runs once per call.
        let due: Vec<(Instant, usize)> = self
            .timers
            .iter()
            .take_while(|&&(t, _)| t <= now)
            .copied()
            .collect();
        for (t, ci) in due {
            self.timers.remove(&(t, ci));
            if let Some(c) = self.conns[ci].as_mut() {
                c.timer_key = None;
            }
            self.on_conn_timeout(ci, now);
            self.touch(ci, Some(now));
        }
    }

    /// After anything changed a connection: updates its readiness to send,
    /// and marks its timer for recomputation (done once, when the timers
    /// are next read, however many touches come before).
    pub(crate) fn touch(&mut self, ci: usize, now: Option<Instant>) {
        if let Some(n) = now {
            self.last_now = self.last_now.max(n);
        }
        self.mark_stale(ci);
        self.update_ready(ci);
    }

    /// Queues `ci` for sending if it has something to send now.
    fn update_ready(&mut self, ci: usize) {
        // Queued already: `poll_transmit` asks again when its turn comes.
        if self.conns[ci].as_ref().is_none_or(|c| c.in_ready) {
            return;
        }
        if self.wants_send(ci, self.last_now) {
            if let Some(c) = self.conns[ci].as_mut() {
                c.in_ready = true;
                self.ready.push_back(ci);
            }
        }
    }

    /// Marks a connection's timer for recomputation.
    pub(crate) fn mark_stale(&mut self, ci: usize) {
        if let Some(c) = self.conns[ci].as_mut() {
            if !c.timer_stale {
                c.timer_stale = true;
                self.stale.push(ci);
            }
        }
    }

    /// Recomputes the timer of every connection marked stale, and its
    /// readiness (a pacing debt paid off since the touch needs no timer, but
    /// then the connection may send).
    fn refresh_timers(&mut self) {
        while let Some(ci) = self.stale.pop() {
            let Some(c) = self.conns.get_mut(ci).and_then(|c| c.as_mut()) else {
                continue;
            };
            if !c.timer_stale {
                continue;
            }
            c.timer_stale = false;
            let next = self.conn_deadline(ci);
            self.set_timer(ci, next);
            self.update_ready(ci);
        }
    }
}

/// Checks a request's list against its queue's `max_sge` and the largest
/// message.
fn check_list(list: &crate::verbs::SgList, max_sge: u32) -> Result<(), VerbsError> {
    if list.len() > max_sge as usize {
        return Err(VerbsError::TooManySge {
            n: list.len(),
            max: max_sge,
        });
    }
    let len = list.byte_len();
    if len > crate::consts::MAX_MESSAGE_LEN {
        return Err(VerbsError::MessageTooLong(len));
    }
    Ok(())
}
