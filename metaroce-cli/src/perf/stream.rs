//! The data phase of a run, on either side: where each iteration goes,
//! the requester that posts and times the work requests, the responder
//! that checks what lands, and the drivers that carry them.

use super::*;
use metaroce_io::FaultConfig;
use std::collections::VecDeque;

/// Where each iteration goes: iteration `i` is posted on QP `i % qps`, lands
/// in server slot `i % slots`, and uses client slot `(i % qps) * per_qp +
/// (i / qps) % per_qp`. Each QP has at most `per_qp` work requests
/// outstanding, so per QP the single-QP argument holds: a server slot is
/// reused only after its message was verified. For SENDs each receive
/// names its slot (`2 * per_qp` posted, one more per message checked). A
/// WRITE with immediate data lands by address, and its packets can be
/// placed before its receive exists (later packets that overtake the
/// first are placed as a plain WRITE's, PROTOCOL §5.3): so only `per_qp`
/// are posted at first. WRITE `i` is posted once WRITE `i - per_qp`
/// completed, which took receive `i - per_qp`, posted only once message
/// `i - 2 * per_qp`, the slot's previous one, was checked.
#[derive(Debug, Clone, Copy)]
pub(super) struct Layout {
    pub(super) qps: u64,
    pub(super) per_qp: u64,
    pub(super) slots: u64,
}

impl Layout {
    pub(super) fn new(p: &RunParams) -> Layout {
        let qps = u64::from(p.qps.max(1));
        let per_qp = u64::from(p.depth).div_ceil(qps).max(1);
        Layout {
            qps,
            per_qp,
            slots: qps * per_qp * 2,
        }
    }
    pub(super) fn qp_of(&self, iter: u64) -> usize {
        (iter % self.qps) as usize
    }
    pub(super) fn client_slot(&self, iter: u64) -> u64 {
        (iter % self.qps) * self.per_qp + (iter / self.qps) % self.per_qp
    }
    /// The iteration QP `j`'s `k`-th receive is for.
    pub(super) fn recv_iter(&self, j: usize, k: u64) -> u64 {
        j as u64 + k * self.qps
    }
}

pub(super) fn endpoint_config(paths: u8) -> EndpointConfig {
    EndpointConfig {
        paths,
        ..EndpointConfig::default()
    }
}

/// How a side's driver is set up: the flags both sides have.
#[derive(Debug, Clone, Copy)]
pub(super) struct Tuning {
    pub(super) paths: u8,
    pub(super) backend: Backend,
    pub(super) busy_poll: Duration,
    /// The endpoint's MTU (`--mtu`).
    pub(super) mtu: u16,
    /// Ask for CRC32C trailers (`--crc`).
    pub(super) crc32c: bool,
    /// The pre-shared key (`--psk-file`).
    pub(super) psk: Option<metaroce_proto::Psk>,
    /// Injected faults of arriving datagrams (`--loss`, `--duplicate`,
    /// `--reorder`): fractions.
    pub(super) faults: (f64, f64, f64),
    /// The af_xdp backend's interface (`--iface`).
    pub(super) iface: Option<IfaceName>,
}

/// A network interface's name (at most 15 bytes, as the kernel's), kept
/// inline so that the settings stay `Copy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IfaceName {
    bytes: [u8; 15],
    len: u8,
}

impl IfaceName {
    /// The name.
    pub fn as_str(&self) -> &str {
        std::str::from_utf8(&self.bytes[..usize::from(self.len)]).unwrap_or("")
    }
}

impl std::str::FromStr for IfaceName {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s.is_empty() || s.len() > 15 || s.contains(['/', ' ', '\0']) {
            return Err(format!("`{s}`: not an interface name (1 to 15 bytes)"));
        }
        let mut bytes = [0u8; 15];
        bytes[..s.len()].copy_from_slice(s.as_bytes());
        Ok(IfaceName {
            bytes,
            len: s.len() as u8,
        })
    }
}

impl Tuning {
    pub(super) fn new(paths: u8, backend: Backend, busy_poll_us: u64, mtu: u16) -> Self {
        Tuning {
            paths,
            backend,
            busy_poll: Duration::from_micros(busy_poll_us),
            mtu,
            crc32c: false,
            psk: None,
            faults: (0.0, 0.0, 0.0),
            iface: None,
        }
    }

    /// These settings with datagrams dropped, duplicated and held back at
    /// the given rates as they arrive.
    pub(super) fn with_faults(self, loss: f64, duplicate: f64, reorder: f64) -> Self {
        Tuning {
            faults: (loss, duplicate, reorder),
            ..self
        }
    }
}

/// Binds a driver on `listen`; an address in use becomes [`PerfError::PortInUse`].
pub(super) fn bind(listen: SocketAddr, t: Tuning, seed: u64) -> anyhow::Result<Driver> {
    bind_mtu(listen, t, seed, None)
}

/// [`bind`] with the endpoint's MTU bounded by `route_mtu` (the route's
/// largest UDP payload), so that no datagram is too large for the network.
pub(super) fn bind_mtu(
    listen: SocketAddr,
    t: Tuning,
    seed: u64,
    route_mtu: Option<usize>,
) -> anyhow::Result<Driver> {
    let Tuning {
        paths,
        backend,
        busy_poll,
        mtu: own_mtu,
        crc32c,
        psk,
        faults: (drop, duplicate, reorder),
        iface,
    } = t;
    let mut cfg = DriverConfig::new(listen);
    cfg.faults = FaultConfig {
        seed: seed ^ 0xfa17,
        drop,
        duplicate,
        reorder,
        reorder_delay: Duration::from_micros(200),
        ..FaultConfig::default()
    };
    cfg.backend = backend;
    cfg.busy_poll = busy_poll;
    cfg.xdp.iface = iface.map(|n| n.as_str().to_string());
    cfg.endpoint = endpoint_config(paths);
    cfg.endpoint.mtu = own_mtu;
    cfg.endpoint.crc32c = crc32c;
    cfg.endpoint.psk = psk;
    if let Some(m) = route_mtu {
        let m = m.clamp(
            usize::from(metaroce_proto::consts::MIN_MTU),
            usize::from(cfg.endpoint.mtu),
        );
        cfg.endpoint.mtu = m as u16;
    }
    cfg.send_sockets = 2 * usize::from(paths);
    cfg.seed = seed;
    match Driver::bind(cfg) {
        Ok(d) => Ok(d),
        Err(DriverError::Bind { addr, source }) => Err(PerfError::PortInUse {
            what: "UDP",
            addr,
            cause: source,
        }
        .into()),
        Err(e) => Err(e.into()),
    }
}

/// Runs `drv` until `done` says so or `limit` passes.
pub(super) fn drive(
    drv: &mut Driver,
    limit: Duration,
    mut done: impl FnMut(&mut Driver) -> bool,
) -> anyhow::Result<bool> {
    drive_turns(
        drv,
        limit,
        |d| if done(d) { Turn::Done } else { Turn::Idle },
    )
}

/// What a turn of [`drive_turns`]'s closure says.
pub(super) enum Turn {
    /// Finished.
    Done,
    /// Work is left that did not fit the turn: the driver runs without
    /// waiting, and the next turn comes at once.
    Busy,
    /// Nothing to do until the network brings something.
    Idle,
}

/// Runs `drv` until `turn` says it is done or `limit` passes; between
/// turns the driver waits for the network up to a millisecond, unless the
/// turn was busy.
pub(super) fn drive_turns(
    drv: &mut Driver,
    limit: Duration,
    mut turn: impl FnMut(&mut Driver) -> Turn,
) -> anyhow::Result<bool> {
    let start = Instant::now();
    while start.elapsed() < limit {
        let wait = match turn(drv) {
            Turn::Done => return Ok(true),
            Turn::Busy => Duration::ZERO,
            Turn::Idle => Duration::from_millis(1),
        };
        drv.poll(wait)?;
    }
    Ok(matches!(turn(drv), Turn::Done))
}

/// Runs `drv` until the next control message arrives (at most `limit`),
/// handing every endpoint event to `on_event` meanwhile.
pub(super) fn drive_until_msg(
    drv: &mut Driver,
    link: &Link,
    limit: Duration,
    wanted: &'static str,
    mut on_event: impl FnMut(Event),
) -> anyhow::Result<Msg> {
    let mut msg = None;
    let mut err = None;
    drive(drv, limit, |d| {
        while let Some(e) = d.endpoint().poll_event() {
            on_event(e);
        }
        match link.try_recv() {
            Ok(Some(m)) => msg = Some(m),
            Ok(None) => {}
            Err(e) => err = Some(e),
        }
        msg.is_some() || err.is_some()
    })?;
    if let Some(e) = err {
        return Err(e.into());
    }
    msg.ok_or_else(|| {
        PerfError::Stalled {
            wanted,
            waited: limit,
        }
        .into()
    })
}

/// Turns an unexpected control message into an error.
pub(super) fn unexpected(m: Msg, wanted: &str) -> anyhow::Error {
    match m {
        Msg::Abort { reason } => PerfError::Protocol(format!("the peer aborted: {reason}")).into(),
        other => PerfError::Protocol(format!("expected {wanted}, got {other:?}")).into(),
    }
}

/// Payload bytes a step of the data phase fills or checks at most, each,
/// before the driver runs again (about 30 µs here). Checking an 8 MiB
/// message at once held the driver for milliseconds, past the peer's
/// retransmission timeout: every such message cost a spurious timeout.
pub(super) const STEP_BYTES: u64 = 256 << 10;

/// Writes every byte of a freshly registered region (a poison no message
/// pattern holds throughout), before the run, as perftest sets its
/// buffers. Registration has already mapped its pages (before it did, the
/// first touch of each, in the middle of a run, held the thread that took
/// it for milliseconds: 8 MiB messages ran at 11–12 Gbit/s untouched
/// against 13–16 touched).
fn touch(ep: &mut Endpoint, mr: &MrInfo) {
    if let Some(b) = ep.mr_mut(mr.lkey) {
        b.fill(0xa5);
    }
}

/// A message that arrived whole and is being checked, piece by piece; its
/// slot is not reused until that is done.
#[derive(Debug, Clone, Copy)]
pub(super) struct Arrived {
    /// Its iteration.
    pub(super) iter: u64,
    /// The message whose pattern it must hold (READs read a slot, filled
    /// once with the pattern of the slot's index).
    pub(super) pattern: u64,
    /// Where it starts in the region, and its length.
    pub(super) at: u64,
    pub(super) len: u64,
    /// The QP it came on (the responder reposts its receive).
    pub(super) qpn: Qpn,
    /// Bytes checked so far, and how many of them were wrong.
    pub(super) checked: u64,
    pub(super) bad: u64,
}

impl Arrived {
    /// Checks up to `budget` more bytes of the message in `region` (each
    /// counted wrong if `region` is gone); returns the bytes checked.
    fn check_some(&mut self, region: Option<&[u8]>, budget: u64) -> u64 {
        let n = (self.len - self.checked).min(budget);
        let start = (self.at + self.checked) as usize;
        match region.and_then(|r| r.get(start..start + n as usize)) {
            Some(b) => self.bad += check_at(b, self.pattern, self.checked),
            None => self.bad += n,
        }
        self.checked += n;
        n
    }

    fn done(&self) -> bool {
        self.checked == self.len
    }
}

/// Checks the messages at the front of `queue`, in order, [`STEP_BYTES`]
/// at most in all; returns how many at the front are now wholly checked
/// (the caller takes them off).
fn check_front(queue: &mut VecDeque<Arrived>, region: Option<&[u8]>) -> usize {
    let mut budget = STEP_BYTES;
    let mut done = 0;
    for a in queue.iter_mut() {
        if !a.done() {
            if budget == 0 {
                break;
            }
            budget -= a.check_some(region, budget);
            if !a.done() {
                break;
            }
        }
        done += 1;
    }
    done
}

/// One side's own stream: `op` work requests posted round robin over its
/// QPs against the peer's region for the run's duration, each timed and
/// (READ) checked on completion.
pub(super) struct Requester {
    pub(super) p: RunParams,
    pub(super) lay: Layout,
    pub(super) qps: Vec<Qpn>,
    pub(super) cq: CqHandle,
    pub(super) mr: MrInfo,
    pub(super) remote: Region,
    pub(super) hist: hdrhistogram::Histogram<u64>,
    pub(super) post_times: Vec<Instant>,
    pub(super) next_iter: u64,
    pub(super) completed: u64,
    pub(super) outstanding: u64,
    pub(super) qp_out: Vec<u64>,
    pub(super) verified: u64,
    pub(super) corrupt: u64,
    pub(super) error: Option<WcStatus>,
    pub(super) t0: Instant,
    pub(super) elapsed: Option<f64>,
    pub(super) wcs: Vec<WorkCompletion>,
    /// READs completed and being checked (still outstanding until then).
    pub(super) reads: VecDeque<Arrived>,
    /// Bytes of the next request's message filled so far.
    pub(super) filled: u64,
    /// Bytes of the messages completed in each [`TIMELINE_STEP`] of the
    /// run, from its start: the interval rates of the report.
    pub(super) timeline: Vec<u64>,
}

/// The resolution of a requester's timeline: 100 ms.
pub(super) const TIMELINE_STEP: f64 = 0.1;

impl Requester {
    /// Registers the local buffer; `cq` is the QPs' send CQ.
    pub(super) fn new(
        ep: &mut Endpoint,
        pd: PdHandle,
        cq: CqHandle,
        qps: &[Qpn],
        p: &RunParams,
        remote: Region,
    ) -> anyhow::Result<Requester> {
        let lay = Layout::new(p);
        let local_slots = lay.qps * lay.per_qp;
        let mr = ep.reg_mr(
            pd,
            RegionBuf::zeroed((local_slots * p.size).max(1) as usize),
            0,
            AccessFlags::LOCAL_WRITE,
        )?;
        touch(ep, &mr);
        Ok(Requester {
            p: p.clone(),
            lay,
            qps: qps.to_vec(),
            cq,
            mr,
            remote,
            hist: hdrhistogram::Histogram::new_with_bounds(1, 60_000_000_000, 3)?,
            post_times: vec![Instant::now(); local_slots as usize],
            next_iter: 0,
            completed: 0,
            outstanding: 0,
            qp_out: vec![0; qps.len()],
            verified: 0,
            corrupt: 0,
            error: None,
            t0: Instant::now(),
            elapsed: None,
            wcs: Vec::new(),
            reads: Default::default(),
            filled: 0,
            timeline: Vec::new(),
        })
    }

    /// Whether a step has filling or checking left that did not fit its
    /// budget: the next step should come without a wait.
    pub(super) fn busy(&self) -> bool {
        self.elapsed.is_none() && (self.filled > 0 || !self.reads.is_empty())
    }

    /// The clock of the run starts now.
    pub(super) fn start(&mut self) {
        self.t0 = Instant::now();
    }

    /// Reaps completions, checks READs and posts what the depth allows,
    /// filling and checking at most [`STEP_BYTES`] each; true once the run
    /// is over (its time is up and nothing is outstanding) or a request
    /// failed.
    pub(super) fn step(&mut self, d: &mut Driver) -> bool {
        if self.elapsed.is_some() {
            return true;
        }
        let size = self.p.size;
        let lay = self.lay;
        let ep = d.endpoint();
        let mut wcs = std::mem::take(&mut self.wcs);
        wcs.clear();
        let _ = ep.poll_cq(self.cq, 64, &mut wcs);
        for wc in &wcs {
            if wc.status != WcStatus::Success {
                self.error.get_or_insert(wc.status);
            }
            let iter = wc.wr_id;
            let ls = lay.client_slot(iter);
            let lat = self.post_times[ls as usize].elapsed();
            self.hist.saturating_record(lat.as_nanos().max(1) as u64);
            let arrived = Arrived {
                iter,
                pattern: iter % self.remote.slots,
                at: ls * size,
                len: size,
                qpn: wc.qpn,
                checked: 0,
                bad: 0,
            };
            if self.p.op == Op::Read && self.p.verify && wc.status == WcStatus::Success {
                // Outstanding, its slot held, until checked.
                self.reads.push_back(arrived);
            } else {
                self.retire(iter);
            }
        }
        self.wcs = wcs;
        for _ in 0..check_front(&mut self.reads, ep.mr(self.mr.lkey)) {
            let a = self.reads.pop_front().expect("checked");
            self.corrupt += a.bad;
            self.verified += a.len - a.bad;
            self.retire(a.iter);
        }
        if self.error.is_some() {
            self.elapsed = Some(self.t0.elapsed().as_secs_f64());
            return true;
        }
        let sending = self.t0.elapsed() < Duration::from_secs_f64(self.p.duration);
        if !sending {
            // The message being filled never goes.
            self.filled = 0;
        }
        let now = d.now();
        let ep = d.endpoint();
        let mut budget = STEP_BYTES;
        while sending && self.outstanding < u64::from(self.p.depth) {
            let i = self.next_iter;
            let ls = lay.client_slot(i);
            let local = Sge {
                lkey: self.mr.lkey,
                addr: ls * size,
                len: size as u32,
            };
            let remote = RemoteAddr {
                rkey: self.remote.rkey,
                addr: self.remote.addr + (i % self.remote.slots) * size,
            };
            let op = match self.p.op {
                Op::Write => SendOp::WriteImm(remote, i as u32),
                Op::Read => SendOp::Read(remote),
                Op::Send => SendOp::SendImm(i as u32),
            };
            let j = lay.qp_of(i);
            // Round robin: wait for this QP rather than skip it; its slot
            // for `i` is free once it has fewer than `per_qp` outstanding.
            if self.qp_out[j] >= lay.per_qp {
                break;
            }
            if self.p.verify && self.p.op != Op::Read {
                // The message goes once it is filled, over as many steps as
                // that takes.
                let n = (size - self.filled).min(budget);
                if n > 0 {
                    if let Some(buf) = ep.mr_mut(self.mr.lkey) {
                        let from = (ls * size + self.filled) as usize;
                        fill_at(&mut buf[from..from + n as usize], i, self.filled);
                    }
                    self.filled += n;
                    budget -= n;
                }
                if self.filled < size {
                    break;
                }
            }
            if ep
                .post_send(now, self.qps[j], SendWr::new(i, op, local))
                .is_err()
            {
                break;
            }
            self.filled = 0;
            self.post_times[ls as usize] = Instant::now();
            self.next_iter += 1;
            self.outstanding += 1;
            self.qp_out[j] += 1;
        }
        if !sending && self.outstanding == 0 {
            self.elapsed = Some(self.t0.elapsed().as_secs_f64());
            return true;
        }
        false
    }

    /// Iteration `iter` is over: its slot and its place in the depth are free.
    fn retire(&mut self, iter: u64) {
        self.completed += 1;
        let step = (self.t0.elapsed().as_secs_f64() / TIMELINE_STEP) as usize;
        if self.timeline.len() <= step {
            self.timeline.resize(step + 1, 0);
        }
        self.timeline[step] += self.p.size;
        self.outstanding -= 1;
        self.qp_out[self.lay.qp_of(iter)] -= 1;
    }

    pub(super) fn elapsed(&self) -> f64 {
        self.elapsed
            .unwrap_or_else(|| self.t0.elapsed().as_secs_f64())
    }
}

/// One side's part in the peer's stream: a region the peer targets, the
/// receives its messages complete, and the check of every message.
pub(super) struct Responder {
    pub(super) p: RunParams,
    pub(super) lay: Layout,
    pub(super) qps: Vec<Qpn>,
    pub(super) cq: CqHandle,
    pub(super) mr: MrInfo,
    pub(super) posted: Vec<u64>,
    pub(super) res: ServerResult,
    pub(super) expected: Option<u64>,
    pub(super) wcs: Vec<WorkCompletion>,
    /// Messages arrived and being checked; their receives are posted again
    /// once they are.
    pub(super) arrived: VecDeque<Arrived>,
}

impl Responder {
    /// Registers the region and fills it (READ) or posts every receive;
    /// `cq` is the QPs' receive CQ.
    pub(super) fn new(
        ep: &mut Endpoint,
        pd: PdHandle,
        cq: CqHandle,
        qps: &[Qpn],
        p: &RunParams,
    ) -> anyhow::Result<Responder> {
        let lay = Layout::new(p);
        let (size, slots) = (p.size, lay.slots);
        let mr = ep.reg_mr(
            pd,
            RegionBuf::zeroed((slots * size).max(1) as usize),
            0x1000_0000,
            AccessFlags::ALL,
        )?;
        let mut posted = vec![0u64; qps.len()];
        if p.op == Op::Read {
            // The peer reads slots; each slot holds the pattern of its index
            // (which touches every page, as `touch` would).
            let buf = ep.mr_mut(mr.lkey).context("region vanished")?;
            for s in 0..slots {
                fill(&mut buf[(s * size) as usize..((s + 1) * size) as usize], s);
            }
        } else {
            touch(ep, &mr);
            // WRITEs: see `Layout` (their data may land before a receive).
            let first = if p.op == Op::Write {
                lay.per_qp
            } else {
                2 * lay.per_qp
            };
            for (j, &qp) in qps.iter().enumerate() {
                for _ in 0..first {
                    ep.post_recv(qp, recv_wr(p.op, &mr, &lay, j, posted[j], size))?;
                    posted[j] += 1;
                }
            }
        }
        Ok(Responder {
            p: p.clone(),
            lay,
            qps: qps.to_vec(),
            cq,
            mr,
            posted,
            res: ServerResult::default(),
            expected: None,
            wcs: Vec::new(),
            arrived: Default::default(),
        })
    }

    pub(super) fn region(&self) -> Region {
        Region {
            rkey: self.mr.rkey,
            addr: self.mr.addr,
            slots: self.lay.slots,
        }
    }

    /// Whether messages wait to be checked: the next step should come
    /// without a wait.
    pub(super) fn busy(&self) -> bool {
        !self.arrived.is_empty()
    }

    /// Checks what arrived, at most [`STEP_BYTES`] a step, and lets the
    /// peer reuse each slot once its message is checked; true once the peer
    /// said how many messages it sent and all are in and checked.
    pub(super) fn step(&mut self, d: &mut Driver) -> bool {
        let (size, slots) = (self.p.size, self.lay.slots);
        self.wcs.clear();
        let ep = d.endpoint();
        let _ = ep.poll_cq(self.cq, 64, &mut self.wcs);
        for wc in &self.wcs {
            if wc.status != WcStatus::Success {
                self.res.corrupt_bytes += u64::from(wc.byte_len);
                continue;
            }
            let iter = wc
                .imm
                .map_or(self.res.messages + self.arrived.len() as u64, u64::from);
            let len = u64::from(wc.byte_len);
            self.arrived.push_back(Arrived {
                iter,
                pattern: iter,
                at: (iter % slots) * size,
                len,
                qpn: wc.qpn,
                // Unverified, nothing to check.
                checked: if self.p.verify { 0 } else { len },
                bad: 0,
            });
        }
        for _ in 0..check_front(&mut self.arrived, ep.mr(self.mr.lkey)) {
            let a = self.arrived.pop_front().expect("checked");
            if self.p.verify {
                self.res.corrupt_bytes += a.bad;
                self.res.verified_bytes += a.len - a.bad;
            }
            self.res.messages += 1;
            // The slot is checked: let the peer reuse it.
            if let Some(j) = self.qps.iter().position(|&q| q == a.qpn) {
                let wr = recv_wr(self.p.op, &self.mr, &self.lay, j, self.posted[j], size);
                let _ = ep.post_recv(self.qps[j], wr);
                self.posted[j] += 1;
            }
        }
        match self.expected {
            None => false,
            // READs complete at the reader; nothing arrives here.
            Some(_) if self.p.op == Op::Read => true,
            Some(n) => self.res.messages >= n && self.arrived.is_empty(),
        }
    }
}

/// What the peer said about its own stream when it ended (its `Done`).
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct PeerDone {
    pub(super) iterations: u64,
    pub(super) elapsed_s: f64,
    pub(super) verified_bytes: u64,
    pub(super) corrupt_bytes: u64,
    pub(super) retransmits: u64,
}

/// What the data phase learned from the peer.
#[derive(Debug, Default)]
pub(super) struct Exchange {
    /// The peer's check of our stream (its answer to our `Done`).
    pub(super) peer_result: Option<ServerResult>,
    /// The peer's own stream, when it ran one.
    pub(super) peer_done: Option<PeerDone>,
}

/// The data phase of one side: runs its own stream (`req`) and its part in
/// the peer's (`resp`) at once, until its stream is over and checked by
/// the peer, and the peer's stream is over and checked here. `started`:
/// whether `req` runs from the start or waits for the peer's `Start`.
pub(super) fn data_phase(
    drv: &mut Driver,
    link: &Link,
    conn: ConnectionHandle,
    mut req: Option<&mut Requester>,
    mut resp: Option<&mut Responder>,
    mut started: bool,
) -> anyhow::Result<Exchange> {
    let duration = req
        .as_ref()
        .map(|r| r.p.duration)
        .or(resp.as_ref().map(|r| r.p.duration))
        .unwrap_or(0.0);
    if started {
        if let Some(r) = req.as_deref_mut() {
            r.start();
        }
    }
    let mut ex = Exchange::default();
    let mut done_sent = false;
    let mut result_sent = false;
    let mut err: Option<anyhow::Error> = None;
    // A server's link stays open to a newer connection of its client until
    // the client shows it has its `Ready`: a message, or its first packet.
    let mut watched = link.watched();
    let finished = drive_turns(drv, Duration::from_secs_f64(duration + 30.0), |d| {
        if watched
            && d.endpoint()
                .connection_stats(conn)
                .is_some_and(|s| s.data_packets_received > 0)
        {
            link.settle();
            watched = false;
        }
        // The peer may close right after its last message: both can be
        // waiting at one turn, and the close is an error only if that
        // message was not the last one needed.
        let mut gone = None;
        loop {
            let got = link.try_recv();
            if watched && matches!(got, Ok(Some(_))) {
                link.settle();
                watched = false;
            }
            match got {
                Ok(None) => break,
                Ok(Some(Msg::Start)) if !started && req.is_some() => {
                    started = true;
                    if let Some(r) = req.as_deref_mut() {
                        r.start();
                    }
                }
                Ok(Some(Msg::Done {
                    iterations,
                    elapsed_s,
                    verified_bytes,
                    corrupt_bytes,
                    retransmits,
                })) if ex.peer_done.is_none() && resp.is_some() => {
                    ex.peer_done = Some(PeerDone {
                        iterations,
                        elapsed_s,
                        verified_bytes,
                        corrupt_bytes,
                        retransmits,
                    });
                    if let Some(r) = resp.as_deref_mut() {
                        r.expected = Some(iterations);
                    }
                }
                Ok(Some(Msg::Result {
                    verified_bytes,
                    corrupt_bytes,
                    messages,
                })) if done_sent && ex.peer_result.is_none() => {
                    ex.peer_result = Some(ServerResult {
                        verified_bytes,
                        corrupt_bytes,
                        messages,
                    });
                }
                Ok(Some(m)) => {
                    err = Some(unexpected(m, "Start, Done or Result"));
                    break;
                }
                Err(e) => {
                    gone = Some(e);
                    break;
                }
            }
        }
        if err.is_some() {
            return Turn::Done;
        }
        if let Some(r) = req.as_deref_mut() {
            if started && !done_sent && r.step(d) {
                if let Some(st) = r.error {
                    err = Some(anyhow::anyhow!("a work request failed with {st:?}"));
                    return Turn::Done;
                }
                let retransmits = d
                    .endpoint()
                    .connection_stats(conn)
                    .map_or(0, |s| s.retransmits);
                link.send(Msg::Done {
                    iterations: r.completed,
                    elapsed_s: r.elapsed(),
                    verified_bytes: r.verified,
                    corrupt_bytes: r.corrupt,
                    retransmits,
                });
                done_sent = true;
            }
        }
        if let Some(r) = resp.as_deref_mut() {
            if !result_sent && r.step(d) {
                link.send(Msg::Result {
                    verified_bytes: r.res.verified_bytes,
                    corrupt_bytes: r.res.corrupt_bytes,
                    messages: r.res.messages,
                });
                result_sent = true;
            }
        }
        if (req.is_none() || ex.peer_result.is_some()) && (resp.is_none() || result_sent) {
            Turn::Done
        } else if let Some(e) = gone {
            err = Some(e.into());
            Turn::Done
        } else if req.as_ref().is_some_and(|r| r.busy()) || resp.as_ref().is_some_and(|r| r.busy())
        {
            Turn::Busy
        } else {
            Turn::Idle
        }
    });
    let failure = match finished {
        Err(e) => Some(e),
        Ok(_) if err.is_some() => err,
        Ok(true) => None,
        Ok(false) => Some(match (&req, &resp) {
            (Some(r), _) if !done_sent => {
                anyhow::anyhow!("{} work requests did not complete", r.outstanding)
            }
            (Some(_), _) if ex.peer_result.is_none() => {
                anyhow::anyhow!("the peer never said what it verified")
            }
            (_, Some(r)) => anyhow::anyhow!(
                "not every message arrived ({} of {:?})",
                r.res.messages,
                r.expected
            ),
            _ => anyhow::anyhow!("the run did not finish"),
        }),
    };
    if let Some(e) = failure {
        link.send(Msg::Abort {
            reason: format!("{e:#}"),
        });
        return Err(e);
    }
    Ok(ex)
}

/// Creates a run's QPs (each with room for its share of the send depth and
/// twice that many receives), a send CQ and a receive CQ.
pub(super) fn create_qps(
    ep: &mut Endpoint,
    p: &RunParams,
) -> anyhow::Result<(PdHandle, CqHandle, CqHandle, Vec<Qpn>)> {
    let lay = Layout::new(p);
    let pd = ep.alloc_pd();
    let send_cq = ep.create_cq(lay.slots as usize * 2);
    let recv_cq = ep.create_cq(lay.slots as usize * 2);
    let mut qps = Vec::new();
    for _ in 0..lay.qps {
        let mut init = QpInit::new(pd, send_cq, recv_cq);
        init.max_send_wr = lay.per_qp as u32;
        init.max_recv_wr = (2 * lay.per_qp) as u32;
        qps.push(ep.create_qp(init)?);
    }
    Ok((pd, send_cq, recv_cq, qps))
}

pub(super) fn recv_wr(op: Op, mr: &MrInfo, lay: &Layout, j: usize, k: u64, size: u64) -> RecvWr {
    let iter = lay.recv_iter(j, k);
    let sge = match op {
        // WRITE_IMM lands by address; the receive only carries the immediate.
        Op::Write => Sge::default(),
        _ => Sge {
            lkey: mr.lkey,
            addr: mr.addr + (iter % lay.slots) * size,
            len: size as u32,
        },
    };
    RecvWr {
        wr_id: iter,
        sge: sge.into(),
    }
}
