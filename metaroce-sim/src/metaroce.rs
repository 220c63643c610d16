//! The metaroce transport in the simulator: one real
//! [`metaroce_proto::Endpoint`] per host, carrying real datagram bytes.
//!
//! - Every host's endpoint listens on port [`METAROCE_PORT`] of its
//!   addresses (connections are opened to the plane-0 address) from the [`AddressMap`](crate::AddressMap); the UDP source port of each
//!   [`Transmit`](metaroce_proto::Transmit) becomes the fabric packet's source
//!   port, so the fabric's ECMP hash spreads a connection's paths over the
//!   spines (the spraying).
//! - Each flow is one RC QP pair. A host opens one connection per
//!   destination it sends to (lazily, at its first flow there); the receiver
//!   binds its QPs to the connection the sender opened. QP numbers, rkeys and
//!   addresses are exchanged out of band through state shared by the hosts
//!   of one run (both ends live in this process).
//! - A flow is a stream of RDMA WRITEs of [`MetaroceParams::chunk_bytes`]
//!   into a ring of slots of a region registered at the receiver, with
//!   [`MetaroceParams::outstanding`] WRITEs posted at once so the congestion
//!   window, not the application, limits the rate. The application bytes
//!   delivered are those of successfully completed WRITEs (a WRITE completion
//!   means the peer placed every byte); WRITEs completing with an error count
//!   as abandoned.
//! - Integrity: at each (sampled) WRITE completion the sender compares the
//!   bytes placed in the receiver's region with its own source bytes; any
//!   difference is reported as corrupted. Each WRITE reads its source at a
//!   different offset of a random buffer, so stale or misplaced data shows.
//!
//! - Multiplane (`planes` > 1): each endpoint gets one address per plane
//!   ([`EndpointConfig::plane_ips`]); connections spread their paths over
//!   the planes, each [`Transmit`](metaroce_proto::Transmit) goes out on the
//!   NIC port of the plane of its addresses, and the core is asked only for
//!   packets of idle ports ([`Endpoint::poll_transmit_planes`]). The line
//!   rate, the receiver's grant capacity and the initial window are per
//!   host: P ports of `link_gbps`.

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::rc::Rc;
use std::time::Duration;

use metaroce_proto::consts::{DATA_HEADER_LEN, METAROCE_PORT};
use metaroce_proto::verbs::{
    AccessFlags, ConnectionHandle, CqHandle, PdHandle, QpInit, Qpn, RemoteAddr, SendOp, SendWr,
    Sge, WcStatus, WorkCompletion,
};
use metaroce_proto::wire::Opcode;
use metaroce_proto::{Endpoint, EndpointConfig, Event, Instant};

use crate::packet::{Ecn, FlowId, HostId, Packet};
use crate::rng::SimRng;
use crate::time::{Nanos, NS_PER_US};
use crate::transport::{
    AppEvent, Delivery, FlowStart, PlaneMask, SimTransport, TransportEnv, TransportStats,
};

/// A datagram in flight: a recycled MTU-sized buffer and the length used.
///
/// Buffers keep their full length so that reusing one never re-zeroes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Datagram {
    buf: Vec<u8>,
    len: usize,
}

impl Datagram {
    /// The datagram's bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

/// Ethernet (14) + IPv4 (20) + UDP (8) + FCS (4): what the fabric adds to a
/// UDP payload.
pub const UDP_OVERHEAD: u32 = 46;

/// Bytes of source data beyond one chunk: WRITE `k` reads its source at
/// offset `(k * SOURCE_STRIDE) % SOURCE_SPAN`.
const SOURCE_SPAN: u64 = 64 * 1024;
const SOURCE_STRIDE: u64 = 4_104;

/// Tuning of the metaroce transport in the simulator.
///
/// Fields set to `None` are derived from the fabric ([`TransportEnv`]).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct MetaroceParams {
    /// Paths each connection sprays over (`--paths`).
    pub paths: u8,
    /// Number of distinct UDP source ports the endpoints may use (≥ 64).
    pub source_ports: u16,
    /// Bytes per RDMA WRITE.
    pub chunk_bytes: u32,
    /// WRITEs kept posted per flow.
    ///
    /// Default 8 (2 MiB of 256 KiB WRITEs), deep enough that the congestion
    /// window, not the application, limits the rate at 10% loss as well.
    /// With 4 (1 MiB, about three BDPs at the 64-host fabric's smoothed RTT
    /// of 20-30 µs) the oldest WRITE's recovery drains the pipeline at 10%
    /// loss: every WRITE has lost packets, the sender sends 4% fewer
    /// packets than lossless, and 449 RTOs fire where 28 do lossless
    /// (82.96 Gb/s against 84.93 with 8, 64 hosts, seed 1).
    pub outstanding: u32,
    /// Lower bound of the RTO; `None`: 5 × the fabric's base RTT, at least 20 µs.
    pub min_rto_ns: Option<Nanos>,
    /// RTO before the first RTT sample; `None`: 2 × the minimum RTO.
    pub initial_rto_ns: Option<Nanos>,
    /// Initial congestion window; `None`: one BDP of a NIC port.
    pub initial_window: Option<u64>,
    /// Largest congestion window; `None`: the core's default.
    pub max_window: Option<u64>,
    /// Bytes a sender puts in flight before its first grant (to a receiver
    /// that grants); `None`: the core's default (one packet).
    pub first_flight_bytes: Option<u64>,
    /// Delayed-ACK timer.
    pub ack_delay_ns: Nanos,
    /// Data packets per ACK at most.
    pub ack_every: u32,
    /// Verify the placed bytes of every n-th WRITE (1: all, 0: none).
    pub verify_every: u32,
    /// Receiver hints (`--receiver-hints`): the endpoint shares its host's
    /// link rate among its active senders and grants each its share in
    /// every ACK (`EndpointConfig::receiver_capacity_kbps`); off, no grants.
    pub receiver_hints: bool,
}

impl Default for MetaroceParams {
    fn default() -> Self {
        MetaroceParams {
            paths: metaroce_proto::consts::DEFAULT_PATHS,
            source_ports: 128,
            chunk_bytes: 256 * 1024,
            outstanding: 8,
            min_rto_ns: None,
            initial_rto_ns: None,
            initial_window: None,
            first_flight_bytes: None,
            max_window: None,
            ack_delay_ns: 2 * NS_PER_US,
            ack_every: 4,
            verify_every: 1,
            receiver_hints: true,
        }
    }
}

impl MetaroceParams {
    /// The endpoint configuration for a fabric described by `env`.
    pub fn endpoint_config(&self, env: &TransportEnv) -> EndpointConfig {
        let min_rto = self
            .min_rto_ns
            .unwrap_or_else(|| (5 * env.base_rtt_ns).max(20 * NS_PER_US));
        let initial_rto = self.initial_rto_ns.unwrap_or(2 * min_rto);
        let defaults = EndpointConfig::default();
        // Every plane the fabric has (at most what the core spans).
        let planes = env
            .addresses
            .planes()
            .clamp(1, metaroce_proto::consts::MAX_PLANES as u32);
        EndpointConfig {
            listen_port: METAROCE_PORT,
            // A WRITE packet carries exactly the fabric MTU of payload.
            mtu: (env.mtu as usize + DATA_HEADER_LEN + Opcode::Write.ext_len())
                .min(usize::from(metaroce_proto::consts::MAX_MTU)) as u16,
            paths: self.paths,
            source_ports: (0..self.source_ports.max(1)).map(|i| 49_152 + i).collect(),
            initial_rto: Duration::from_nanos(initial_rto),
            min_rto: Duration::from_nanos(min_rto),
            // A lost HELLO must not stall a flow for a host-stack timeout.
            handshake_rto: Duration::from_nanos(initial_rto),
            ack_delay: Duration::from_nanos(self.ack_delay_ns),
            ack_every: self.ack_every.max(1),
            // One BDP per NIC port: with P planes the host's line is P ports.
            initial_window: self.initial_window.unwrap_or(env.bdp_bytes * planes as u64),
            max_window: self.max_window.unwrap_or(defaults.max_window),
            first_flight_bytes: self
                .first_flight_bytes
                .unwrap_or(defaults.first_flight_bytes),
            receiver_capacity_kbps: self
                .receiver_hints
                .then(|| (env.link_gbps * 1e6 * planes as f64).round() as u64),
            // The grant is the link's rate: pace what the link carries.
            datagram_overhead: UDP_OVERHEAD,
            plane_ips: if planes > 1 {
                (0..planes)
                    .map(|p| IpAddr::V4(env.addresses.ip(env.host, p as u8)))
                    .collect()
            } else {
                Vec::new()
            },
            ..defaults
        }
    }
}

/// What a receiver publishes about a flow towards it.
#[derive(Debug, Clone, Copy)]
struct RxFlow {
    qpn: Qpn,
    lkey: u32,
    remote: RemoteAddr,
}

/// A sender's request that the receiver bind its QP for `flow`.
#[derive(Debug, Clone, Copy)]
struct Bind {
    peer: HostId,
    rx_qpn: Qpn,
    tx_qpn: Qpn,
}

/// Out-of-band messages from senders to a receiver.
#[derive(Debug, Clone, Copy)]
enum Mail {
    /// Bind the receiving QP of a new flow.
    Bind(Bind),
    /// A finite flow completed: free its QP and region.
    Release { flow: FlowId, qpn: Qpn, lkey: u32 },
}

/// State shared by every host of one run: the out-of-band channel.
#[derive(Debug, Default)]
struct World {
    endpoints: RefCell<Vec<Rc<RefCell<Endpoint>>>>,
    rx_flows: RefCell<HashMap<FlowId, RxFlow>>,
    mailboxes: RefCell<Vec<Vec<Mail>>>,
    /// Packet buffers, recycled across hosts.
    pool: RefCell<Vec<Vec<u8>>>,
    /// The adapters' counters, summed over hosts.
    adapter: RefCell<AdapterStats>,
}

/// One WRITE in progress.
#[derive(Debug, Clone, Copy)]
struct Chunk {
    seq: u64,
    offset: u64,
    len: u32,
    src_off: u64,
    dst_off: u64,
}

/// Sender side of a flow.
#[derive(Debug)]
struct TxFlow {
    flow: FlowId,
    dst: HostId,
    qpn: Qpn,
    rx: RxFlow,
    total: Option<u64>,
    posted: u64,
    next_seq: u64,
    inflight: VecDeque<Chunk>,
    failed: bool,
}

/// Counters of the adapter itself (beyond the core's).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct AdapterStats {
    /// WRITEs completed successfully.
    pub writes_ok: u64,
    /// WRITEs completed with an error status.
    pub writes_failed: u64,
    /// WRITEs whose placed bytes were compared with the source.
    pub writes_verified: u64,
    /// Bytes that differed.
    pub bytes_corrupted: u64,
    /// Completions that did not come in posting order.
    pub out_of_order_completions: u64,
    /// Connections lost.
    pub connections_lost: u64,
    /// Posting refused by the core (queue full, bad state).
    pub post_errors: u64,
    /// Completion queue overruns.
    pub cq_overruns: u64,
}

/// The metaroce transport of one host.
#[derive(Debug)]
pub struct Metaroce {
    env: TransportEnv,
    params: MetaroceParams,
    world: Rc<World>,
    ep: Rc<RefCell<Endpoint>>,
    pd: PdHandle,
    cq: CqHandle,
    src_lkey: u32,
    mtu: usize,
    /// Connections this host opened, by destination.
    conns_out: HashMap<HostId, ConnectionHandle>,
    /// Connections peers opened to this host, by source.
    conns_in: HashMap<HostId, ConnectionHandle>,
    /// Binds waiting for the peer's connection to arrive.
    pending_binds: Vec<Bind>,
    tx: HashMap<FlowId, TxFlow>,
    events: VecDeque<AppEvent>,
    wcs: Vec<WorkCompletion>,
    /// Datagrams of a GSO batch still to hand to the NIC.
    segments: VecDeque<Packet<Datagram>>,
}

/// A factory of [`Metaroce`] hosts sharing one run's out-of-band state:
/// pass `|env| factory.host(env)` to [`crate::run_transport`].
#[derive(Debug, Default)]
pub struct MetaroceFactory {
    params: MetaroceParams,
    world: Rc<World>,
}

impl MetaroceFactory {
    /// A factory for one run.
    pub fn new(params: MetaroceParams) -> Self {
        MetaroceFactory {
            params,
            world: Rc::new(World::default()),
        }
    }

    /// The transport of host `env.host`.
    pub fn host(&self, env: &TransportEnv) -> Metaroce {
        Metaroce::new(env, self.params.clone(), self.world.clone())
    }

    /// One line per sending connection: per-path packets, SRTT and CE marks
    /// at the end of the run (diagnostics).
    pub fn path_report(&self) -> Vec<String> {
        let mut out = Vec::new();
        for ep in self.world.endpoints.borrow().iter() {
            let ep = ep.borrow();
            for c in ep.connections() {
                let Some(cs) = ep.connection_stats(c) else {
                    continue;
                };
                if cs.data_packets_sent == 0 {
                    continue;
                }
                let paths: Vec<String> = cs
                    .paths
                    .iter()
                    .map(|p| {
                        format!(
                            "{}:{}pk/{:.1}us/{}ce/{}lost/{}KBw/{}KBf/{}fail",
                            p.src_port,
                            p.packets_sent,
                            p.srtt_ns as f64 / 1e3,
                            p.ce_marks,
                            p.packets_lost,
                            p.cwnd / 1000,
                            p.in_flight / 1000,
                            p.failures
                        )
                    })
                    .collect();
                out.push(format!(
                    "cwnd {} inflight {} rtos {} probes {} retx {} srtt {:.1}us rto {:.1}us | {}",
                    cs.cwnd,
                    cs.in_flight,
                    cs.rto_fires,
                    cs.probes_sent,
                    cs.retransmits,
                    cs.srtt_ns as f64 / 1e3,
                    cs.rto_ns as f64 / 1e3,
                    paths.join(" ")
                ));
            }
        }
        out
    }

    /// What the endpoints of the run did (call after the run).
    pub fn summary(&self) -> MetaroceSummary {
        let mut s = MetaroceSummary {
            adapter: *self.world.adapter.borrow(),
            ..MetaroceSummary::default()
        };
        let (mut cwnd, mut srtt, mut rto, mut n) = (0u64, 0u64, 0u64, 0u64);
        for ep in self.world.endpoints.borrow().iter() {
            let ep = ep.borrow();
            let es = ep.stats();
            s.datagrams_sent += es.datagrams_sent;
            s.rejects += es.rejects.total();
            s.rejects_duplicate += es.rejects.duplicate;
            for c in ep.connections() {
                let Some(cs) = ep.connection_stats(c) else {
                    continue;
                };
                s.connections += 1;
                s.data_packets_sent += cs.data_packets_sent;
                s.retransmits += cs.retransmits;
                s.fast_retransmits += cs.fast_retransmits;
                s.rto_fires += cs.rto_fires;
                s.path_failures += cs.path_failures;
                s.path_moves += cs.path_moves;
                s.packets_lost += cs.packets_lost;
                s.spurious_losses += cs.paths.iter().map(|p| p.spurious_losses).sum::<u64>();
                s.duplicates_received += cs.duplicates_received;
                s.acks_sent += cs.acks_sent;
                s.naks_sent += cs.naks_sent;
                s.probes_sent += cs.probes_sent;
                s.route_checks += cs.route_checks;
                if cs.data_packets_sent > 0 {
                    n += 1;
                    cwnd += cs.cwnd;
                    srtt += cs.srtt_ns;
                    rto += cs.rto_ns;
                    s.max_cwnd = s.max_cwnd.max(cs.cwnd);
                    s.max_srtt_us = s.max_srtt_us.max(cs.srtt_ns as f64 / 1e3);
                }
            }
        }
        if let Some(mean) = cwnd.checked_div(n) {
            s.mean_cwnd = mean;
            s.mean_srtt_us = srtt as f64 / n as f64 / 1e3;
            s.mean_rto_us = rto as f64 / n as f64 / 1e3;
        }
        s
    }
}

/// The core's view of a metaroce run, summed (or averaged, at the end of
/// the run) over every sending connection.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct MetaroceSummary {
    /// The adapters' counters.
    pub adapter: AdapterStats,
    /// Connections.
    pub connections: u64,
    /// Datagrams the endpoints sent (all kinds).
    pub datagrams_sent: u64,
    /// DATA packets sent, retransmissions included.
    pub data_packets_sent: u64,
    /// Retransmissions.
    pub retransmits: u64,
    /// Of those, caused by a SACK gap.
    pub fast_retransmits: u64,
    /// Retransmission timeouts.
    pub rto_fires: u64,
    /// Paths declared failed (and moved to a new source port).
    pub path_failures: u64,
    /// Paths moved to a new source port because their route stayed congested.
    pub path_moves: u64,
    /// Packets declared lost.
    pub packets_lost: u64,
    /// Of those, packets acknowledged after being declared lost (the
    /// declaration was premature), summed over the paths that exist at
    /// the end of the run.
    pub spurious_losses: u64,
    /// Duplicate DATA packets received.
    pub duplicates_received: u64,
    /// ACKs sent.
    pub acks_sent: u64,
    /// NAKs sent.
    pub naks_sent: u64,
    /// NOP probes sent (progress, tail-loss and failed-path probes).
    pub probes_sent: u64,
    /// Route checks sent: NOPs on paths that carry only ACKs.
    pub route_checks: u64,
    /// Datagrams the endpoints rejected (any reason).
    pub rejects: u64,
    /// Of those, duplicates.
    pub rejects_duplicate: u64,
    /// Mean congestion window of sending connections at the end.
    pub mean_cwnd: u64,
    /// Largest congestion window at the end.
    pub max_cwnd: u64,
    /// Mean smoothed RTT at the end.
    pub mean_srtt_us: f64,
    /// Largest smoothed RTT at the end.
    pub max_srtt_us: f64,
    /// Mean RTO at the end.
    pub mean_rto_us: f64,
}

fn count(world: &World, f: impl FnOnce(&mut AdapterStats)) {
    f(&mut world.adapter.borrow_mut());
}

fn to_proto_ecn(e: Ecn) -> metaroce_proto::Ecn {
    match e {
        Ecn::NotEct => metaroce_proto::Ecn::NotEct,
        Ecn::Ect0 => metaroce_proto::Ecn::Ect0,
        Ecn::Ect1 => metaroce_proto::Ecn::Ect1,
        Ecn::Ce => metaroce_proto::Ecn::Ce,
    }
}

fn from_proto_ecn(e: metaroce_proto::Ecn) -> Ecn {
    match e {
        metaroce_proto::Ecn::NotEct => Ecn::NotEct,
        metaroce_proto::Ecn::Ect0 => Ecn::Ect0,
        metaroce_proto::Ecn::Ect1 => Ecn::Ect1,
        metaroce_proto::Ecn::Ce => Ecn::Ce,
    }
}

impl Metaroce {
    fn new(env: &TransportEnv, params: MetaroceParams, world: Rc<World>) -> Self {
        assert!(params.outstanding > 0 && params.chunk_bytes > 0);
        let config = params.endpoint_config(env);
        let mtu = usize::from(config.mtu);
        let mut ep = Endpoint::new(config, env.seed).expect("valid endpoint config");
        ep.set_local_ip(Some(IpAddr::V4(env.addresses.ip(env.host, 0))));
        let pd = ep.alloc_pd();
        let cq = ep.create_cq(1 << 16);
        let mut rng = SimRng::stream(env.seed, 0xda7a);
        let len = params.chunk_bytes as usize + SOURCE_SPAN as usize;
        let mut src = vec![0u8; len];
        for w in src.chunks_mut(8) {
            let v = rng.next_u64().to_le_bytes();
            w.copy_from_slice(&v[..w.len()]);
        }
        let src_lkey = ep
            .reg_mr(pd, src.into_boxed_slice(), 0x1000_0000, AccessFlags::NONE)
            .expect("register source region")
            .lkey;
        let ep = Rc::new(RefCell::new(ep));
        {
            let mut eps = world.endpoints.borrow_mut();
            assert_eq!(eps.len(), env.host as usize, "hosts are created in order");
            eps.push(ep.clone());
            world.mailboxes.borrow_mut().push(Vec::new());
        }
        Metaroce {
            env: env.clone(),
            params,
            world,
            ep,
            pd,
            cq,
            src_lkey,
            mtu,
            conns_out: HashMap::new(),
            conns_in: HashMap::new(),
            pending_binds: Vec::new(),
            tx: HashMap::new(),
            events: VecDeque::new(),
            wcs: Vec::new(),
            segments: VecDeque::new(),
        }
    }

    /// The core's counters of every connection of this host.
    pub fn connection_stats(&self) -> Vec<metaroce_proto::ConnectionStats> {
        let ep = self.ep.borrow();
        ep.connections()
            .filter_map(|c| ep.connection_stats(c))
            .collect()
    }

    fn peer_addr(&self, host: HostId) -> SocketAddr {
        SocketAddr::new(IpAddr::V4(self.env.addresses.ip(host, 0)), METAROCE_PORT)
    }

    fn host_of(&self, ip: IpAddr) -> Option<(HostId, u8)> {
        match ip {
            IpAddr::V4(v4) => self.env.addresses.host_of(v4),
            IpAddr::V6(_) => None,
        }
    }

    /// Binds requested by senders since the last call.
    fn take_mail(&mut self) {
        let mail = std::mem::take(&mut self.world.mailboxes.borrow_mut()[self.env.host as usize]);
        for m in mail {
            match m {
                Mail::Bind(b) => self.try_bind(b),
                Mail::Release { flow, qpn, lkey } => {
                    let mut ep = self.ep.borrow_mut();
                    let _ = ep.destroy_qp(qpn);
                    let _ = ep.dereg_mr(lkey);
                    self.world.rx_flows.borrow_mut().remove(&flow);
                }
            }
        }
    }

    fn try_bind(&mut self, b: Bind) {
        match self.conns_in.get(&b.peer) {
            Some(&conn) => {
                if self
                    .ep
                    .borrow_mut()
                    .connect_qp(b.rx_qpn, conn, b.tx_qpn)
                    .is_err()
                {
                    count(&self.world, |a| a.post_errors += 1);
                }
            }
            None => self.pending_binds.push(b),
        }
    }

    /// Events and completions after any call into the endpoint.
    fn after_call(&mut self, now: Nanos) {
        loop {
            let ev = self.ep.borrow_mut().poll_event();
            let Some(ev) = ev else { break };
            match ev {
                Event::Incoming { conn, peer } => {
                    if let Some((host, _)) = self.host_of(peer.ip()) {
                        self.conns_in.insert(host, conn);
                        let (ready, rest): (Vec<Bind>, Vec<Bind>) =
                            self.pending_binds.drain(..).partition(|b| b.peer == host);
                        self.pending_binds = rest;
                        for b in ready {
                            self.try_bind(b);
                        }
                    }
                }
                Event::ConnectionLost { .. } => count(&self.world, |a| a.connections_lost += 1),
                Event::CqOverrun(_) => count(&self.world, |a| a.cq_overruns += 1),
                Event::Connected(_) | Event::QpError { .. } => {}
            }
        }
        self.wcs.clear();
        let mut wcs = std::mem::take(&mut self.wcs);
        let _ = self.ep.borrow_mut().poll_cq(self.cq, usize::MAX, &mut wcs);
        for wc in &wcs {
            self.on_completion(now, wc);
        }
        self.wcs = wcs;
    }

    fn on_completion(&mut self, now: Nanos, wc: &WorkCompletion) {
        let flow_id = (wc.wr_id >> 32) as FlowId;
        let seq = wc.wr_id & 0xffff_ffff;
        let Some(f) = self.tx.get_mut(&flow_id) else {
            return;
        };
        let pos = match f.inflight.iter().position(|c| c.seq & 0xffff_ffff == seq) {
            Some(p) => p,
            None => return,
        };
        if pos != 0 {
            count(&self.world, |a| a.out_of_order_completions += 1);
        }
        let Some(chunk) = f.inflight.remove(pos) else {
            return;
        };
        if wc.status != WcStatus::Success {
            count(&self.world, |a| a.writes_failed += 1);
            f.failed = true;
            self.events.push_back(AppEvent::Abandoned {
                flow: flow_id,
                bytes: chunk.len as u64,
            });
            return;
        }
        count(&self.world, |a| a.writes_ok += 1);
        let ve = self.params.verify_every;
        if ve > 0 && chunk.seq % ve as u64 == 0 {
            count(&self.world, |a| a.writes_verified += 1);
            let bad = {
                let eps = self.world.endpoints.borrow();
                let peer = eps[f.dst as usize].borrow();
                let me = self.ep.borrow();
                let placed = peer.mr(f.rx.lkey).map(|m| {
                    &m[chunk.dst_off as usize..chunk.dst_off as usize + chunk.len as usize]
                });
                let source = me.mr(self.src_lkey).map(|m| {
                    &m[chunk.src_off as usize..chunk.src_off as usize + chunk.len as usize]
                });
                match (placed, source) {
                    (Some(p), Some(s)) if p == s => 0,
                    (Some(p), Some(s)) => p.iter().zip(s).filter(|(a, b)| a != b).count() as u64,
                    _ => chunk.len as u64,
                }
            };
            if bad > 0 {
                count(&self.world, |a| a.bytes_corrupted += bad);
            }
            self.events.push_back(AppEvent::Delivered {
                flow: flow_id,
                offset: chunk.offset,
                len: chunk.len,
            });
            if bad > 0 {
                self.events.push_back(AppEvent::Corrupted {
                    flow: flow_id,
                    offset: chunk.offset,
                    len: bad as u32,
                });
            }
        } else {
            self.events.push_back(AppEvent::Delivered {
                flow: flow_id,
                offset: chunk.offset,
                len: chunk.len,
            });
        }
        let done = f.inflight.is_empty() && f.total.is_some_and(|t| f.posted >= t);
        if done {
            self.events.push_back(AppEvent::Completed { flow: flow_id });
            if let Some(f) = self.tx.remove(&flow_id) {
                let _ = self.ep.borrow_mut().destroy_qp(f.qpn);
                self.world.mailboxes.borrow_mut()[f.dst as usize].push(Mail::Release {
                    flow: flow_id,
                    qpn: f.rx.qpn,
                    lkey: f.rx.lkey,
                });
            }
        } else {
            self.post_more(now, flow_id);
        }
    }

    /// Keeps `outstanding` WRITEs posted on `flow`.
    fn post_more(&mut self, now: Nanos, flow_id: FlowId) {
        let chunk = self.params.chunk_bytes as u64;
        let k = self.params.outstanding as u64;
        let Some(f) = self.tx.get_mut(&flow_id) else {
            return;
        };
        if f.failed {
            return;
        }
        let mut ep = self.ep.borrow_mut();
        while (f.inflight.len() as u64) < k && f.total.is_none_or(|t| f.posted < t) {
            let len = f.total.map_or(chunk, |t| (t - f.posted).min(chunk)) as u32;
            let seq = f.next_seq;
            let src_off = (seq * SOURCE_STRIDE) % SOURCE_SPAN;
            let dst_off = (seq % k) * chunk;
            let wr = SendWr::new(
                (u64::from(f.flow) << 32) | (seq & 0xffff_ffff),
                SendOp::Write(RemoteAddr {
                    rkey: f.rx.remote.rkey,
                    addr: f.rx.remote.addr + dst_off,
                }),
                Sge {
                    lkey: self.src_lkey,
                    addr: 0x1000_0000 + src_off,
                    len,
                },
            );
            if ep.post_send(Instant::from_nanos(now), f.qpn, wr).is_err() {
                count(&self.world, |a| a.post_errors += 1);
                f.failed = true;
                break;
            }
            f.inflight.push_back(Chunk {
                seq,
                offset: f.posted,
                len,
                src_off,
                dst_off,
            });
            f.next_seq += 1;
            f.posted += len as u64;
        }
    }

    fn packet_from(&mut self, t: metaroce_proto::Transmit, buf: Vec<u8>) {
        let IpAddr::V4(dst_ip) = t.dst.ip() else {
            return self.recycle(buf);
        };
        let Some((dst, plane)) = self.env.addresses.host_of(dst_ip) else {
            return self.recycle(buf);
        };
        let seg = t.segment_size.unwrap_or(t.size).max(1);
        let mk = |buf: Vec<u8>, len: usize| Packet {
            src: self.env.host,
            dst,
            plane,
            src_port: t.src_port,
            dst_port: t.dst.port(),
            ecn: from_proto_ecn(t.ecn),
            size: len as u32 + UDP_OVERHEAD,
            payload: Datagram { buf, len },
        };
        if seg >= t.size {
            self.segments.push_back(mk(buf, t.size));
        } else {
            // A GSO batch: one fabric packet per segment.
            for part in buf[..t.size].chunks(seg) {
                let mut b = self.take_buf();
                b[..part.len()].copy_from_slice(part);
                self.segments.push_back(mk(b, part.len()));
            }
            self.recycle(buf);
        }
    }

    fn take_buf(&self) -> Vec<u8> {
        let mut b = self.world.pool.borrow_mut().pop().unwrap_or_default();
        if b.len() < self.mtu {
            b.resize(self.mtu, 0);
        }
        b
    }

    fn recycle(&self, buf: Vec<u8>) {
        let mut pool = self.world.pool.borrow_mut();
        if pool.len() < 65_536 {
            pool.push(buf);
        }
    }
}

impl SimTransport for Metaroce {
    type Payload = Datagram;

    fn delivery(&self) -> Delivery {
        // Completions of one QP come in posting order (verbs semantics).
        Delivery::InOrder
    }

    fn expect_flow(&mut self, _now: Nanos, flow: &FlowStart) {
        let k = self.params.outstanding as u64;
        let len = self.params.chunk_bytes as u64 * k;
        let len = flow.bytes.map_or(len, |b| b.min(len)).max(1) as usize;
        let mut ep = self.ep.borrow_mut();
        let addr = 0x2000_0000_0000 + (u64::from(flow.flow) << 32);
        let mr = ep
            .reg_mr(
                self.pd,
                vec![0u8; len].into_boxed_slice(),
                addr,
                AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
            )
            .expect("register receive region");
        let qpn = ep
            .create_qp(QpInit::new(self.pd, self.cq, self.cq))
            .expect("create receive QP");
        self.world.rx_flows.borrow_mut().insert(
            flow.flow,
            RxFlow {
                qpn,
                lkey: mr.lkey,
                remote: RemoteAddr {
                    rkey: mr.rkey,
                    addr: mr.addr,
                },
            },
        );
    }

    fn start_flow(&mut self, now: Nanos, flow: &FlowStart) {
        self.take_mail();
        let rx = *self
            .world
            .rx_flows
            .borrow()
            .get(&flow.flow)
            .expect("expect_flow ran on the receiver first");
        let t = Instant::from_nanos(now);
        let conn = match self.conns_out.get(&flow.dst) {
            Some(&c) => c,
            None => {
                let addr = self.peer_addr(flow.dst);
                let c = self
                    .ep
                    .borrow_mut()
                    .connect(t, addr)
                    .expect("open connection");
                self.conns_out.insert(flow.dst, c);
                c
            }
        };
        let qpn = {
            let mut ep = self.ep.borrow_mut();
            let mut init = QpInit::new(self.pd, self.cq, self.cq);
            init.max_send_wr = self.params.outstanding.max(1);
            let qpn = ep.create_qp(init).expect("create send QP");
            ep.connect_qp(qpn, conn, rx.qpn).expect("bind send QP");
            qpn
        };
        self.world.mailboxes.borrow_mut()[flow.dst as usize].push(Mail::Bind(Bind {
            peer: self.env.host,
            rx_qpn: rx.qpn,
            tx_qpn: qpn,
        }));
        self.tx.insert(
            flow.flow,
            TxFlow {
                flow: flow.flow,
                dst: flow.dst,
                qpn,
                rx,
                total: flow.bytes,
                posted: 0,
                next_seq: 0,
                inflight: VecDeque::new(),
                failed: false,
            },
        );
        self.post_more(now, flow.flow);
        self.after_call(now);
    }

    fn handle_packet(&mut self, now: Nanos, pkt: Packet<Datagram>) {
        self.take_mail();
        let from = SocketAddr::new(
            IpAddr::V4(Ipv4Addr::from(
                self.env.addresses.ip_u32(pkt.src, pkt.plane),
            )),
            pkt.src_port,
        );
        self.ep.borrow_mut().handle_datagram(
            Instant::from_nanos(now),
            from,
            to_proto_ecn(pkt.ecn),
            pkt.payload.as_bytes(),
        );
        self.recycle(pkt.payload.buf);
        self.after_call(now);
    }

    fn poll_transmit(&mut self, now: Nanos, idle: PlaneMask) -> Option<Packet<Datagram>> {
        // A GSO batch's segments go first, on their own plane.
        if let Some(p) = self.segments.front() {
            if !idle.contains(p.plane) {
                return None;
            }
            return self.segments.pop_front();
        }
        if idle.0 == 0 {
            return None;
        }
        self.take_mail();
        let mut buf = self.take_buf();
        // The core sends only on idle ports' planes (one port per plane).
        let t =
            self.ep
                .borrow_mut()
                .poll_transmit_planes(Instant::from_nanos(now), &mut buf, idle.0);
        let out = match t {
            Some(t) => {
                self.packet_from(t, buf);
                self.segments.pop_front()
            }
            None => {
                self.recycle(buf);
                None
            }
        };
        self.after_call(now);
        out
    }

    fn poll_timeout(&mut self) -> Option<Nanos> {
        self.ep.borrow_mut().poll_timeout().map(|t| t.as_nanos())
    }

    fn handle_timeout(&mut self, now: Nanos) {
        self.take_mail();
        self.ep
            .borrow_mut()
            .handle_timeout(Instant::from_nanos(now));
        self.after_call(now);
    }

    fn poll_event(&mut self) -> Option<AppEvent> {
        self.events.pop_front()
    }

    fn stats(&self) -> TransportStats {
        let mut s = TransportStats::default();
        let ep = self.ep.borrow();
        for c in ep.connections() {
            if let Some(cs) = ep.connection_stats(c) {
                s.data_packets += cs.data_packets_sent;
                s.retransmitted_packets += cs.retransmits;
                s.data_bytes += cs.paths.iter().map(|p| p.bytes_sent).sum::<u64>();
                s.control_packets += cs.acks_sent;
                s.timeouts += cs.rto_fires;
            }
        }
        s
    }
}
