//! The engine: the event loop tying fabric, hosts, transports, traffic and
//! faults together, and the public entry points.

use std::time::Instant;

use crate::addr::AddressMap;
use crate::baselines::{header, Blast, Irn, RoceV2Gbn};
use crate::config::{ConfigError, SimConfig, TransportKind};
use crate::ecmp::FiveTuple;
use crate::event::EventQueue;
use crate::faults::FaultAction;
use crate::flows::{DeliveryOutcome, FlowTable};
use crate::host::Host;
use crate::metaroce::MetaroceFactory;
use crate::packet::{HostId, PacketSlab, IPPROTO_UDP};
use crate::queue::PortQueue;
use crate::report::{percentile_us, LinkStat, PacketCounters, SimReport};
use crate::rng::SimRng;
use crate::series::{recovery_ns, Timeline, RECOVERY_FRACTION};
use crate::time::{ps_per_byte, ps_to_ns_ceil, Nanos, PS_PER_NS};
use crate::topology::{Fabric, LinkId, LinkKind, TopologySpec};
use crate::traffic::Pattern;
use crate::traffic::{NewFlow, Traffic};
use crate::transport::{
    AppEvent, Delivery, FlowStart, PlaneMask, SimTransport, TransportEnv, TransportStats,
};

/// Progress of a running simulation, passed to a progress callback.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    /// Current simulated time.
    pub sim_ns: Nanos,
    /// Simulated time the run will cover.
    pub duration_ns: Nanos,
    /// Events processed so far.
    pub events: u64,
}

/// How often (in events) the progress callback is called.
const PROGRESS_EVERY: u64 = 1 << 18;

#[derive(Debug, Clone, Copy)]
enum Ev {
    /// A packet finished crossing `link` and is at the link's far end.
    Arrive { link: LinkId, pkt: u32 },
    /// A NIC port finished serialising.
    NicFree { host: HostId, plane: u8 },
    /// A transport deadline may have been reached.
    Timer { host: HostId },
    /// A delayed flow start (index into `delayed`).
    FlowStart { idx: u32 },
    /// Fault `idx` of the config begins.
    FaultStart { idx: u32 },
    /// Fault `idx` of the config ends.
    FaultEnd { idx: u32 },
    /// Routing converges to the current link states.
    Reroute,
    /// `host` stalls (see [`crate::stalls`]).
    StallStart { host: HostId },
    /// `host`'s stall ends.
    StallEnd { host: HostId },
}

#[derive(Debug, Clone, Copy)]
enum Drop {
    Tail,
    Loss,
    FailedLink,
    NoRoute,
    Targeted,
    Blackhole,
}

struct Simulator<'c, T: SimTransport> {
    cfg: &'c SimConfig,
    now: Nanos,
    queue: EventQueue<Ev>,
    fabric: Fabric,
    addresses: AddressMap,
    hosts: Vec<Host<T>>,
    slab: PacketSlab<T::Payload>,
    loss_rng: SimRng,
    counters: PacketCounters,
    ect_delivered: u64,
    ce_delivered: u64,
    flows: FlowTable,
    traffic: Traffic,
    /// Flows waiting for their start time, and whether each belongs to
    /// the first round.
    delayed: Vec<(NewFlow, bool)>,
    delayed_started: usize,
    finite_active: u64,
    infinite_flows: u64,
    dirty: Vec<HostId>,
    events: u64,
    timeline: Timeline,
    /// One stream per host for its stalls.
    stall_rngs: Vec<SimRng>,
}

impl<T: SimTransport> std::fmt::Debug for Simulator<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Simulator")
            .field("now", &self.now)
            .field("events", &self.events)
            .finish()
    }
}

impl<'c, T: SimTransport> Simulator<'c, T> {
    fn new(cfg: &'c SimConfig, mut factory: impl FnMut(&TransportEnv) -> T) -> Self {
        let hpl = cfg.effective_hosts_per_leaf();
        let spec = TopologySpec {
            hosts: cfg.hosts,
            hosts_per_leaf: hpl,
            spines: cfg.spines,
            planes: cfg.planes,
            host_gbps: cfg.link_gbps,
            spine_gbps: cfg.spine_link_gbps(),
            prop_ns: cfg.prop_delay_ns,
            buffer_bytes: cfg.buffer_bytes,
            ecn_threshold_bytes: if cfg.ecn_marking {
                cfg.ecn_threshold_bytes
            } else {
                u64::MAX
            },
        };
        let mut fabric = Fabric::new(spec, cfg.seed);
        if cfg.loss > 0.0 {
            for link in &mut fabric.links {
                if cfg.loss_links.applies(link.kind) {
                    link.loss = cfg.loss;
                }
            }
        }
        if let Some(shaper) = &cfg.spine_shaper {
            let capacity = shaper.queue_bytes(cfg.buffer_bytes);
            for link in &mut fabric.links {
                if matches!(
                    link.kind,
                    LinkKind::LeafUp { .. } | LinkKind::SpineDown { .. }
                ) {
                    link.queue = PortQueue::shaped(
                        capacity,
                        fabric.spec.ecn_threshold_bytes,
                        shaper.shaper(),
                    );
                }
            }
        }
        let addresses = AddressMap::new(cfg.hosts, hpl, cfg.planes);
        let data = cfg.mtu + header::DATA_OVERHEAD;
        let base_rtt_ns = fabric.idle_one_way_ns(data) + fabric.idle_one_way_ns(header::ACK_BYTES);
        let bdp_bytes = (cfg.link_gbps * base_rtt_ns as f64 / 8.0).ceil() as u64;
        let hosts = (0..cfg.hosts)
            .map(|host| {
                let env = TransportEnv {
                    host,
                    hosts: cfg.hosts,
                    planes: cfg.planes,
                    link_gbps: cfg.link_gbps,
                    mtu: cfg.mtu,
                    base_rtt_ns,
                    bdp_bytes,
                    addresses,
                    seed: SimRng::stream(cfg.seed, 0x7000_0000 + host as u64).next_u64(),
                };
                Host::new(factory(&env), cfg.planes)
            })
            .collect();
        Simulator {
            cfg,
            now: 0,
            queue: EventQueue::new(),
            fabric,
            addresses,
            hosts,
            slab: PacketSlab::new(),
            loss_rng: SimRng::stream(cfg.seed, 1),
            counters: PacketCounters::default(),
            ect_delivered: 0,
            ce_delivered: 0,
            flows: FlowTable::default(),
            traffic: Traffic::new(cfg.pattern.clone(), cfg.hosts, cfg.flow_bytes),
            delayed: Vec::new(),
            delayed_started: 0,
            finite_active: 0,
            infinite_flows: 0,
            dirty: Vec::new(),
            events: 0,
            timeline: Timeline::new(cfg.hosts, cfg.bin_ns, cfg.duration_ns),
            stall_rngs: (0..cfg.hosts)
                .map(|h| SimRng::stream(cfg.seed, 0x57A1_0000 + h as u64))
                .collect(),
        }
    }

    fn mark_dirty(&mut self, host: HostId) {
        let h = &mut self.hosts[host as usize];
        if !h.dirty {
            h.dirty = true;
            self.dirty.push(host);
        }
    }

    // ---- flows -------------------------------------------------------

    fn launch(&mut self, nf: NewFlow, first_round: bool) {
        if nf.start_ns > self.now {
            self.queue.push(
                nf.start_ns,
                Ev::FlowStart {
                    idx: self.delayed.len() as u32,
                },
            );
            self.delayed.push((nf, first_round));
        } else {
            self.start_flow(nf, first_round);
        }
    }

    fn start_flow(&mut self, nf: NewFlow, first_round: bool) {
        let flow = self
            .flows
            .add(nf.src, nf.dst, nf.bytes, self.now, first_round);
        self.timeline.flow_started(nf.src);
        match nf.bytes {
            Some(_) => self.finite_active += 1,
            None => self.infinite_flows += 1,
        }
        let fs = FlowStart {
            flow,
            src: nf.src,
            dst: nf.dst,
            bytes: nf.bytes,
        };
        self.hosts[nf.dst as usize]
            .transport
            .expect_flow(self.now, &fs);
        self.mark_dirty(nf.dst);
        self.hosts[nf.src as usize]
            .transport
            .start_flow(self.now, &fs);
        self.mark_dirty(nf.src);
    }

    fn app_event(&mut self, host: HostId, ev: AppEvent) {
        match ev {
            AppEvent::Delivered { flow, offset, len } => {
                let in_order = self.hosts[host as usize].transport.delivery() == Delivery::InOrder;
                let before = self.flows.intact_bytes;
                let outcome = self.flows.delivered(flow, offset, len, in_order, self.now);
                let fresh = self.flows.intact_bytes - before;
                if fresh > 0 {
                    let src = self.flows.get(flow).src;
                    self.timeline.delivered(self.now, src, fresh);
                }
                if outcome == DeliveryOutcome::Completed {
                    self.finite_active -= 1;
                    let rec = self.flows.get(flow);
                    let (src, dst) = (rec.src, rec.dst);
                    for nf in self.traffic.on_complete(src, dst, self.now) {
                        self.launch(nf, false);
                    }
                }
            }
            AppEvent::Completed { .. } => {}
            AppEvent::Abandoned { bytes, .. } => self.flows.abandoned_bytes += bytes,
            AppEvent::Corrupted { len, .. } => self.flows.corrupted_bytes += len as u64,
        }
    }

    // ---- hosts -------------------------------------------------------

    fn service(&mut self, host: HostId) {
        let h = host as usize;
        if self.hosts[h].stalled {
            // Serviced again when the stall ends.
            return;
        }
        while let Some(ev) = self.hosts[h].transport.poll_event() {
            self.app_event(host, ev);
        }
        loop {
            let mask = self.hosts[h].idle_mask();
            if mask == 0 {
                break;
            }
            let Some(mut pkt) = self.hosts[h]
                .transport
                .poll_transmit(self.now, PlaneMask(mask))
            else {
                break;
            };
            assert!(
                (pkt.plane as u32) < self.cfg.planes,
                "transport chose plane {} of {}",
                pkt.plane,
                self.cfg.planes
            );
            pkt.src = host;
            let plane = pkt.plane;
            let idx = self.slab.insert(pkt);
            self.counters.injected += 1;
            if self.hosts[h].ports[plane as usize].is_idle() {
                self.nic_send(host, plane, idx);
            } else {
                self.hosts[h].ports[plane as usize].pending.push_back(idx);
                break;
            }
        }
        while let Some(ev) = self.hosts[h].transport.poll_event() {
            self.app_event(host, ev);
        }
        if let Some(deadline) = self.hosts[h].transport.poll_timeout() {
            let deadline = deadline.max(self.now);
            let hs = &mut self.hosts[h];
            if hs.timer_pending.is_none_or(|p| deadline < p) {
                hs.timer_pending = Some(deadline);
                self.queue.push(deadline, Ev::Timer { host });
            }
        }
    }

    fn drain_dirty(&mut self) {
        while let Some(host) = self.dirty.pop() {
            self.hosts[host as usize].dirty = false;
            self.service(host);
        }
    }

    /// Put packet `idx` on `host`'s idle port `plane`.
    fn nic_send(&mut self, host: HostId, plane: u8, idx: u32) {
        let now_ps = self.now * PS_PER_NS;
        let link_id = self.fabric.host_up(plane, host);
        let size = self.slab.get(idx).size as u64;
        let link = &mut self.fabric.links[link_id as usize];
        let port = &mut self.hosts[host as usize].ports[plane as usize];
        let start = port.start_ps(now_ps);
        let end = start + size * link.ps_per_byte;
        port.free_at_ps = end;
        port.busy = true;
        self.queue
            .push(ps_to_ns_ceil(end), Ev::NicFree { host, plane });
        self.after_serialise(link_id, idx, end);
    }

    /// Common tail of a transmission onto `link_id` ending at `end_ps`:
    /// failed link, targeted drop, random loss, or arrival at the far end.
    fn after_serialise(&mut self, link_id: LinkId, idx: u32, end_ps: u64) {
        let link = &mut self.fabric.links[link_id as usize];
        let ordinal = link.offered;
        link.offered += 1;
        if !link.up {
            return self.drop(idx, Drop::FailedLink);
        }
        if !link.drop_ordinals.is_empty() {
            if let Some(pos) = link.drop_ordinals.iter().position(|&o| o == ordinal) {
                link.drop_ordinals.swap_remove(pos);
                return self.drop(idx, Drop::Targeted);
            }
        }
        if link.loss > 0.0 && self.loss_rng.chance(link.loss) {
            return self.drop(idx, Drop::Loss);
        }
        let at = ps_to_ns_ceil(end_ps) + link.prop_ns;
        self.queue.push(
            at,
            Ev::Arrive {
                link: link_id,
                pkt: idx,
            },
        );
    }

    fn drop(&mut self, idx: u32, why: Drop) {
        self.slab.remove(idx);
        let c = &mut self.counters;
        match why {
            Drop::Tail => c.dropped_tail += 1,
            Drop::Loss => c.dropped_loss += 1,
            Drop::FailedLink => c.dropped_failed_link += 1,
            Drop::NoRoute => c.dropped_no_route += 1,
            Drop::Targeted => c.dropped_targeted += 1,
            Drop::Blackhole => c.dropped_blackhole += 1,
        }
    }

    // ---- switches ------------------------------------------------------

    /// Offer packet `idx` to the switch output port feeding `link_id`.
    fn switch_send(&mut self, link_id: LinkId, idx: u32) {
        let now_ps = self.now * PS_PER_NS;
        let link = &mut self.fabric.links[link_id as usize];
        if !link.up {
            link.offered += 1;
            return self.drop(idx, Drop::FailedLink);
        }
        let pkt = self.slab.get_mut(idx);
        match link
            .queue
            .enqueue(now_ps, pkt.size, pkt.ecn.is_capable(), link.ps_per_byte)
        {
            crate::queue::Admission::TailDrop => {
                link.offered += 1;
                self.drop(idx, Drop::Tail)
            }
            crate::queue::Admission::Accepted { end_ps, mark_ce } => {
                if mark_ce {
                    pkt.ecn = crate::packet::Ecn::Ce;
                }
                self.after_serialise(link_id, idx, end_ps)
            }
        }
    }

    fn forward_from_leaf(&mut self, plane: u8, leaf: u32, idx: u32) {
        let pkt = self.slab.get(idx);
        let dst_leaf = self.fabric.spec.leaf_of(pkt.dst);
        if dst_leaf == leaf {
            let out = self.fabric.leaf_down(plane, pkt.dst);
            return self.switch_send(out, idx);
        }
        let tuple = FiveTuple {
            src_ip: self.addresses.ip_u32(pkt.src, plane),
            dst_ip: self.addresses.ip_u32(pkt.dst, plane),
            src_port: pkt.src_port,
            dst_port: pkt.dst_port,
            proto: IPPROTO_UDP,
        };
        match self.fabric.ecmp_spine(plane, leaf, dst_leaf, &tuple) {
            Some(spine) => {
                let out = self.fabric.leaf_up(plane, leaf, spine);
                self.switch_send(out, idx)
            }
            None => self.drop(idx, Drop::NoRoute),
        }
    }

    fn arrive(&mut self, link_id: LinkId, idx: u32) {
        let link = &mut self.fabric.links[link_id as usize];
        if !link.up {
            return self.drop(idx, Drop::FailedLink);
        }
        if link.blackhole {
            return self.drop(idx, Drop::Blackhole);
        }
        link.carried += 1;
        match link.kind {
            LinkKind::HostUp { plane, host } => {
                let leaf = self.fabric.spec.leaf_of(host);
                self.forward_from_leaf(plane, leaf, idx)
            }
            LinkKind::LeafUp { plane, spine, .. } => {
                let dst_leaf = self.fabric.spec.leaf_of(self.slab.get(idx).dst);
                let out = self.fabric.spine_down(plane, spine, dst_leaf);
                self.switch_send(out, idx)
            }
            LinkKind::SpineDown { plane, leaf, .. } => self.forward_from_leaf(plane, leaf, idx),
            LinkKind::LeafDown { host, .. } => {
                let pkt = self.slab.get(idx);
                self.timeline.arrived(self.now, pkt.src, host, pkt.size);
                if pkt.ecn.is_capable() {
                    self.ect_delivered += 1;
                    if pkt.ecn == crate::packet::Ecn::Ce {
                        self.ce_delivered += 1;
                    }
                }
                if self.hosts[host as usize].stalled {
                    self.hosts[host as usize].held.push_back(idx);
                } else {
                    self.hand_over(host, idx);
                }
            }
        }
    }

    /// Give packet `idx`, which reached `host`, to its transport.
    fn hand_over(&mut self, host: HostId, idx: u32) {
        let pkt = self.slab.remove(idx);
        self.counters.delivered += 1;
        self.hosts[host as usize]
            .transport
            .handle_packet(self.now, pkt);
        self.mark_dirty(host);
    }

    // ---- host stalls ---------------------------------------------------

    /// Schedule `host`'s next stall after a running period, if it starts
    /// within the run.
    fn schedule_stall(&mut self, host: HostId) {
        let Some(stalls) = self.cfg.host_stalls else {
            return;
        };
        let at = self.now + stalls.running_ns(&mut self.stall_rngs[host as usize]);
        if at <= self.cfg.duration_ns {
            self.queue.push(at, Ev::StallStart { host });
        }
    }

    fn stall_start(&mut self, host: HostId) {
        let Some(stalls) = self.cfg.host_stalls else {
            return;
        };
        let len = stalls.stall_ns(&mut self.stall_rngs[host as usize]);
        self.hosts[host as usize].stalled = true;
        self.queue.push(self.now + len, Ev::StallEnd { host });
    }

    /// The stall ends: the packets that arrived meanwhile are handed over
    /// in arrival order, then the timers that fell due fire.
    fn stall_end(&mut self, host: HostId) {
        let h = host as usize;
        self.hosts[h].stalled = false;
        while let Some(idx) = self.hosts[h].held.pop_front() {
            self.hand_over(host, idx);
        }
        let t = self.now;
        let hs = &mut self.hosts[h];
        if hs.transport.poll_timeout().is_some_and(|d| d <= t) {
            hs.transport.handle_timeout(t);
        }
        self.mark_dirty(host);
        self.schedule_stall(host);
    }

    // ---- faults --------------------------------------------------------

    fn routes_changed(&mut self) {
        if self.cfg.routing_convergence_ns == 0 {
            self.fabric.recompute_routes();
        } else {
            self.queue
                .push(self.now + self.cfg.routing_convergence_ns, Ev::Reroute);
        }
    }

    fn fault(&mut self, idx: u32, begin: bool) {
        let spec = self.cfg.faults[idx as usize];
        let links = spec.links(&self.fabric);
        match spec.action {
            FaultAction::Fail => {
                for l in links {
                    self.fabric.links[l as usize].up = !begin;
                }
                self.routes_changed();
            }
            FaultAction::Degrade { gbps } => {
                for l in links {
                    let link = &mut self.fabric.links[l as usize];
                    link.ps_per_byte = if begin {
                        ps_per_byte(gbps)
                    } else {
                        link.nominal_ps_per_byte
                    };
                }
            }
            FaultAction::Blackhole => {
                // Routing is not told: ECMP keeps hashing onto the links.
                for l in links {
                    self.fabric.links[l as usize].blackhole = begin;
                }
            }
            FaultAction::DropNth { ordinal } => {
                if begin {
                    for l in links {
                        let link = &mut self.fabric.links[l as usize];
                        link.drop_ordinals.push(link.offered + ordinal);
                    }
                }
            }
        }
    }

    // ---- loop ----------------------------------------------------------

    fn finished(&self) -> bool {
        !self.traffic.is_open_ended()
            && self.infinite_flows == 0
            && self.finite_active == 0
            && self.delayed_started == self.delayed.len()
    }

    fn run(mut self, mut progress: Option<&mut dyn FnMut(&Progress)>, name: &str) -> SimReport {
        let wall = Instant::now();
        let duration = self.cfg.duration_ns;
        for (i, f) in self.cfg.faults.iter().enumerate() {
            if f.at_ns == 0 {
                // In force before the first packet is sent.
                self.fault(i as u32, true);
            } else {
                self.queue.push(f.at_ns, Ev::FaultStart { idx: i as u32 });
            }
            if let Some(until) = f.until_ns {
                self.queue.push(until, Ev::FaultEnd { idx: i as u32 });
            }
        }
        if self.cfg.host_stalls.is_some() {
            for host in 0..self.cfg.hosts {
                self.schedule_stall(host);
            }
        }
        let mut rng = SimRng::stream(self.cfg.seed, 2);
        let initial = self.traffic.initial(&mut rng);
        if matches!(self.cfg.pattern, Pattern::Incast { .. }) {
            let senders = self.traffic.incast_senders().to_vec();
            self.timeline.track_incast(0, &senders);
        }
        for nf in initial {
            self.launch(nf, true);
        }
        self.drain_dirty();
        let mut all_infinite_or_done = self.finished();
        while !all_infinite_or_done {
            let Some(t) = self.queue.peek_time() else {
                break;
            };
            if t > duration {
                break;
            }
            let (t, ev) = self.queue.pop().expect("peeked");
            self.now = t;
            self.events += 1;
            match ev {
                Ev::Arrive { link, pkt } => self.arrive(link, pkt),
                Ev::NicFree { host, plane } => {
                    let port = &mut self.hosts[host as usize].ports[plane as usize];
                    port.busy = false;
                    if let Some(idx) = port.pending.pop_front() {
                        self.nic_send(host, plane, idx);
                    }
                    self.mark_dirty(host);
                }
                Ev::Timer { host } => {
                    let h = &mut self.hosts[host as usize];
                    if h.timer_pending == Some(t) {
                        h.timer_pending = None;
                    }
                    // A stalled host's timers fire when the stall ends.
                    if !h.stalled && h.transport.poll_timeout().is_some_and(|d| d <= t) {
                        h.transport.handle_timeout(t);
                    }
                    self.mark_dirty(host);
                }
                Ev::FlowStart { idx } => {
                    self.delayed_started += 1;
                    let (nf, first_round) = self.delayed[idx as usize];
                    self.start_flow(nf, first_round);
                }
                Ev::FaultStart { idx } => self.fault(idx, true),
                Ev::FaultEnd { idx } => self.fault(idx, false),
                Ev::Reroute => self.fabric.recompute_routes(),
                Ev::StallStart { host } => self.stall_start(host),
                Ev::StallEnd { host } => self.stall_end(host),
            }
            self.drain_dirty();
            if self.events % PROGRESS_EVERY == 0 {
                if let Some(cb) = progress.as_mut() {
                    cb(&Progress {
                        sim_ns: t,
                        duration_ns: duration,
                        events: self.events,
                    });
                }
            }
            all_infinite_or_done = self.finished();
        }
        let sim_ns = if all_infinite_or_done {
            self.now
        } else {
            duration
        };
        let wall_s = wall.elapsed().as_secs_f64();
        self.report(name, sim_ns, wall_s)
    }

    fn report(mut self, name: &str, sim_ns: Nanos, wall_s: f64) -> SimReport {
        let cfg = self.cfg;
        self.counters.in_flight = self.slab.live() as u64;
        let mut stats = TransportStats::default();
        for h in &self.hosts {
            stats += h.transport.stats();
        }
        let receivers = self.traffic.receivers().max(1) as f64;
        let goodput_gbps = if sim_ns == 0 {
            0.0
        } else {
            self.flows.intact_bytes as f64 * 8.0 / sim_ns as f64 / receivers
        };
        let max_queue_bytes = self
            .fabric
            .links
            .iter()
            .filter(|l| !matches!(l.kind, LinkKind::HostUp { .. }))
            .map(|l| l.queue.max_bytes())
            .max()
            .unwrap_or(0);
        let frac = |a: u64, b: u64| if b == 0 { 0.0 } else { a as f64 / b as f64 };
        let line_gbps = cfg.link_gbps * cfg.planes as f64;
        let series = self.timeline.goodput_series(sim_ns, receivers);
        let fail_at = cfg
            .faults
            .iter()
            .filter(|f| {
                matches!(
                    f.action,
                    FaultAction::Fail | FaultAction::Blackhole | FaultAction::Degrade { .. }
                )
            })
            .map(|f| f.at_ns)
            .min();
        let recovery_us = fail_at.and_then(|at| {
            recovery_ns(&series, cfg.bin_ns, at, RECOVERY_FRACTION * line_gbps)
                .map(|ns| ns as f64 / 1e3)
        });
        let goodput_after_fault_gbps = fail_at.filter(|&at| at < sim_ns).map(|at| {
            let first = at.div_ceil(cfg.bin_ns) as usize;
            let tail = &series[first.min(series.len())..];
            tail.iter().sum::<f64>() / tail.len().max(1) as f64
        });
        let packet_bytes = cfg.mtu as u64 + crate::baselines::header::DATA_OVERHEAD as u64;
        let incast = self
            .timeline
            .incast_metrics(sim_ns, cfg.link_gbps, packet_bytes);
        let receiver_max_queue_bytes = incast.map(|_| {
            self.fabric.links[self.fabric.leaf_down(0, 0) as usize]
                .queue
                .max_bytes()
        });
        let rates = self.flows.rate_stats();
        let makespan_us = self.flows.makespan().map(|ns| ns as f64 / 1e3);
        let mut fcts = std::mem::take(&mut self.flows.fcts);
        let mut steps = std::mem::take(&mut self.traffic.step_times);
        let f = &self.flows;
        SimReport {
            transport: name.to_owned(),
            pattern: cfg.pattern.to_string(),
            hosts: cfg.hosts,
            spines: cfg.spines,
            planes: cfg.planes,
            link_gbps: cfg.link_gbps,
            loss: cfg.loss,
            seed: cfg.seed,
            sim_ms: sim_ns as f64 / 1e6,
            goodput_gbps,
            goodput_fraction: goodput_gbps / (cfg.link_gbps * cfg.planes as f64),
            retransmit_fraction: frac(stats.retransmitted_packets, stats.data_packets),
            fct_p50_us: percentile_us(&mut fcts, 50.0),
            fct_p99_us: percentile_us(&mut fcts, 99.0),
            flow_rate_min_gbps: rates.map(|r| r.0),
            flow_rate_mean_gbps: rates.map(|r| r.1),
            flow_rate_max_gbps: rates.map(|r| r.2),
            makespan_us,
            flows_started: f.len() as u64,
            flows_completed: f.completed,
            steps_completed: steps.len() as u64,
            step_p50_us: percentile_us(&mut steps, 50.0),
            step_p99_us: percentile_us(&mut steps, 99.0),
            max_queue_bytes,
            ecn_marked_fraction: frac(self.ce_delivered, self.ect_delivered),
            bytes_lost: f.abandoned_bytes + f.corrupted_bytes + f.misordered_bytes,
            bytes_abandoned: f.abandoned_bytes,
            bytes_corrupted: f.corrupted_bytes,
            bytes_misordered: f.misordered_bytes,
            bytes_duplicate: f.duplicate_bytes,
            transport_stats: stats,
            packets: self.counters,
            events: self.events,
            events_per_s: if wall_s > 0.0 {
                self.events as f64 / wall_s
            } else {
                0.0
            },
            wall_s,
            bin_us: cfg.bin_ns as f64 / 1e3,
            goodput_series_gbps: series,
            recovery_us,
            goodput_after_fault_gbps,
            jain_fairness: self.timeline.jain_fairness(),
            receiver_utilization: incast.map(|m| m.utilization),
            receiver_max_queue_bytes,
            convergence_us: incast.and_then(|m| m.convergence_ns.map(|ns| ns as f64 / 1e3)),
            convergence_window_us: incast.map(|m| m.window_ns as f64 / 1e3),
            metaroce: None,
            links: self
                .fabric
                .links
                .iter()
                .map(|l| LinkStat {
                    kind: l.kind,
                    offered: l.offered,
                    carried: l.carried,
                    max_queue_bytes: l.queue.max_bytes(),
                })
                .collect(),
        }
    }
}

/// Run one simulation with a built-in transport.
///
/// # Panics
/// If `config` is invalid; call [`SimConfig::validate`] (or use
/// [`try_run`]) to get a typed error instead.
///
/// # Example
/// ```
/// use metaroce_sim::{run, SimConfig, TransportKind};
///
/// let config = SimConfig {
///     transport: TransportKind::Irn,
///     hosts: 8,
///     spines: 4,
///     loss: 0.01,
///     duration_ns: 200_000, // 200 µs
///     ..SimConfig::default()
/// };
/// let report = run(&config);
/// assert!(report.packets.is_conserved());
/// assert_eq!(report.bytes_lost, 0);
/// println!("{}", metaroce_sim::render_table(&[report]));
/// ```
pub fn run(config: &SimConfig) -> SimReport {
    try_run(config).unwrap_or_else(|e| panic!("{e}"))
}

/// Like [`run`], but returns configuration errors instead of panicking.
pub fn try_run(config: &SimConfig) -> Result<SimReport, ConfigError> {
    run_with_progress(config, None)
}

/// Like [`try_run`], calling `progress` every few hundred thousand events.
pub fn run_with_progress(
    config: &SimConfig,
    progress: Option<&mut dyn FnMut(&Progress)>,
) -> Result<SimReport, ConfigError> {
    config.validate()?;
    let params = &config.baseline;
    Ok(match config.transport {
        TransportKind::RoceV2Gbn => run_transport(
            config,
            "rocev2-gbn",
            |env| RoceV2Gbn::new(env, params),
            progress,
        ),
        TransportKind::Irn => run_transport(config, "irn", |env| Irn::new(env, params), progress),
        TransportKind::Blast => run_transport(config, "blast", Blast::new, progress),
        TransportKind::Metaroce => {
            let factory = MetaroceFactory::new(config.metaroce.clone());
            let mut r = run_transport(config, "metaroce", |env| factory.host(env), progress);
            r.metaroce = Some(factory.summary());
            r
        }
    })
}

/// Run a simulation with any [`SimTransport`]: `factory` builds one
/// instance per host. `config.transport` is ignored; `name` labels the
/// report. This is the hook for transports living outside this crate.
///
/// # Panics
/// If `config` is invalid.
pub fn run_transport<T: SimTransport>(
    config: &SimConfig,
    name: &str,
    factory: impl FnMut(&TransportEnv) -> T,
    progress: Option<&mut dyn FnMut(&Progress)>,
) -> SimReport {
    if let Err(e) = config.validate() {
        panic!("{e}");
    }
    Simulator::new(config, factory).run(progress, name)
}

/// Run `base` once per transport and loss rate (transport-major order).
pub fn sweep(base: &SimConfig, transports: &[TransportKind], losses: &[f64]) -> Vec<SimReport> {
    let mut out = Vec::with_capacity(transports.len() * losses.len());
    for &transport in transports {
        for &loss in losses {
            out.push(run(&SimConfig {
                transport,
                loss,
                ..base.clone()
            }));
        }
    }
    out
}
