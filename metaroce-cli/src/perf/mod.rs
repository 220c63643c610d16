//! `metaroce perf`: bandwidth, message rate and latency of the transport,
//! with every payload byte verified end to end.
//!
//! With no arguments it runs a self-contained loopback test: a server and a
//! client endpoint in one process, each on its own thread and its own UDP
//! sockets on 127.0.0.1, talking the full protocol through the kernel.
//!
//! Verification: every 8-byte word of message `i` follows a pattern of its
//! own ([`pattern`]), so a byte placed at the wrong offset, from the wrong
//! message, or stale, is caught. WRITEs carry immediate data (the iteration) so that the server
//! sees each one land and checks it before it lets the slot be reused: a
//! slot is reused only after its receive is posted again, and the protocol
//! refuses (RNR) a WRITE_IMM that has no receive.

mod pattern;

use crate::oob::{Link, Msg, PerfError, Region, RunParams, VERSION};
use anyhow::{bail, Context};
use clap::{Args, Subcommand, ValueEnum};
use metaroce_io::{Backend, Driver, DriverConfig, DriverError};
use metaroce_proto::verbs::*;
use metaroce_proto::{Endpoint, EndpointConfig, Event, PathState};
use pattern::{check, fill};
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// The operation to measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Op {
    /// RDMA WRITE (with immediate, so the server verifies each message).
    Write,
    /// RDMA READ (the client verifies each message).
    Read,
    /// SEND/RECV (the server verifies each message).
    Send,
}

/// Arguments of `metaroce perf`: no subcommand runs the loopback test with
/// the flags given; `server` and `client` run it between two hosts.
#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct PerfArgs {
    #[command(subcommand)]
    mode: Option<Mode>,
    #[command(flatten)]
    opts: RunOpts,
}

/// `metaroce perf server` or `metaroce perf client`.
#[derive(Debug, Subcommand)]
enum Mode {
    /// Serve perf runs from remote clients, one at a time.
    Server(ServerArgs),
    /// Run against a `metaroce perf server`.
    Client(ClientArgs),
}

/// Default port, perftest's.
pub const DEFAULT_PORT: u16 = 18515;

/// Arguments of `metaroce perf server`.
#[derive(Debug, Args)]
struct ServerArgs {
    /// UDP address of the metaroce endpoint; the TCP control listener takes
    /// the same address and port unless `--ctrl-port` says otherwise (port
    /// 0: any free port, printed on the first line of output).
    #[arg(long, default_value = "0.0.0.0:18515")]
    bind: SocketAddr,
    /// TCP port of the control listener (default: the UDP port).
    #[arg(long)]
    ctrl_port: Option<u16>,
    /// Serve one run, then exit (non-zero if it failed).
    #[arg(long)]
    once: bool,
    /// Paths the server's endpoint sprays over (its ACKs and READ responses).
    #[arg(long, default_value_t = 8)]
    paths: u8,
    /// I/O backend: auto (io_uring when the kernel has it), io_uring, portable.
    #[arg(long, default_value = "auto")]
    backend: Backend,
    /// Microseconds the driver watches for work before it sleeps (0: it
    /// sleeps at once). Polling spares the peer the cost of waking it.
    #[arg(long = "busy-poll", value_name = "US", default_value_t = DEFAULT_BUSY_POLL_US)]
    busy_poll_us: u64,
}

/// Arguments of `metaroce perf client`.
#[derive(Debug, Args)]
struct ClientArgs {
    /// The server: a host, optionally with :PORT (default port 18515).
    addr: String,
    /// TCP port of the server's control listener (default: PORT).
    #[arg(long)]
    ctrl_port: Option<u16>,
    #[command(flatten)]
    opts: RunOpts,
}

/// What a run measures: the loopback test's flags and the client's.
#[derive(Debug, Args, Clone)]
struct RunOpts {
    /// Operation.
    #[arg(long, value_enum, default_value_t = Op::Write)]
    op: Op,
    /// Message size in bytes (suffixes K, M, G allowed).
    #[arg(short = 's', long, default_value = "64K", value_parser = parse_size)]
    size: u64,
    /// Test duration in seconds.
    #[arg(short = 'D', long, default_value_t = 2.0)]
    duration: f64,
    /// Outstanding work requests (perftest's tx depth), over all QPs.
    #[arg(short = 't', long = "tx-depth", default_value_t = 16)]
    depth: u32,
    /// Queue pairs; work requests go to them round robin.
    #[arg(short = 'q', long = "qps", default_value_t = 1)]
    qps: u32,
    /// Paths each connection sprays over.
    #[arg(long, default_value_t = 8)]
    paths: u8,
    /// Skip payload verification.
    #[arg(long)]
    no_verify: bool,
    /// Both ways at once: the server runs the same operation back to the
    /// client over the same QPs; the report has each direction and the sum.
    #[arg(short = 'b', long)]
    bidir: bool,
    /// Print one JSON object instead of the report.
    #[arg(long)]
    json: bool,
    /// I/O backend: auto (io_uring when the kernel has it), io_uring, portable.
    #[arg(long, default_value = "auto")]
    backend: Backend,
    /// Microseconds each side's driver watches for work before it sleeps
    /// (0: it sleeps at once). Each side runs on a thread of its own, and
    /// polling spares the other side the cost of waking it, as perftest
    /// polls its completion queue.
    #[arg(long = "busy-poll", value_name = "US", default_value_t = DEFAULT_BUSY_POLL_US)]
    busy_poll_us: u64,
}

/// `--busy-poll`'s default: 50 µs (`docs/BENCHMARKS.md`, session 14).
const DEFAULT_BUSY_POLL_US: u64 = 50;

impl RunOpts {
    fn tuning(&self) -> Tuning {
        Tuning::new(self.paths, self.backend, self.busy_poll_us)
    }

    fn params(&self) -> RunParams {
        RunParams {
            op: self.op,
            size: self.size,
            depth: self.depth,
            qps: self.qps,
            verify: !self.no_verify,
            duration: self.duration,
            bidir: self.bidir,
        }
    }
}

/// Largest region a server registers for one run.
const MAX_REGION: u64 = 1 << 30;

/// Checks a run's parameters (the client before it starts, the server on `Hello`).
fn validate(p: &RunParams) -> Result<(), PerfError> {
    if p.depth == 0 {
        return Err(PerfError::BadFlags("--tx-depth must be at least 1".into()));
    }
    if p.qps == 0 || p.qps > 256 {
        return Err(PerfError::BadFlags(
            "--qps must be between 1 and 256".into(),
        ));
    }
    if p.qps > p.depth {
        return Err(PerfError::BadFlags(format!(
            "--qps {} needs --tx-depth of at least {0}",
            p.qps
        )));
    }
    if p.duration <= 0.0 || !p.duration.is_finite() || p.duration > 86_400.0 {
        return Err(PerfError::BadFlags(
            "--duration must be a positive number of seconds (at most a day)".into(),
        ));
    }
    if p.size > u64::from(u32::MAX) {
        return Err(PerfError::BadFlags("message size exceeds 4 GiB - 1".into()));
    }
    let slots = Layout::new(p).slots;
    if slots.saturating_mul(p.size.max(1)) > MAX_REGION {
        return Err(PerfError::BadFlags(format!(
            "{slots} slots of {} bytes exceed the server's {} MiB region limit",
            p.size,
            MAX_REGION >> 20
        )));
    }
    Ok(())
}

/// Where each iteration goes: iteration `i` is posted on QP `i % qps`, lands
/// in server slot `i % slots`, and uses client slot `(i % qps) * per_qp +
/// (i / qps) % per_qp`. Each QP has at most `per_qp` work requests
/// outstanding and `2 * per_qp` receives, so per QP the single-QP argument
/// holds: a server slot is reused only after its message was verified.
#[derive(Debug, Clone, Copy)]
struct Layout {
    qps: u64,
    per_qp: u64,
    slots: u64,
}

impl Layout {
    fn new(p: &RunParams) -> Layout {
        let qps = u64::from(p.qps.max(1));
        let per_qp = u64::from(p.depth).div_ceil(qps).max(1);
        Layout {
            qps,
            per_qp,
            slots: qps * per_qp * 2,
        }
    }
    fn qp_of(&self, iter: u64) -> usize {
        (iter % self.qps) as usize
    }
    fn client_slot(&self, iter: u64) -> u64 {
        (iter % self.qps) * self.per_qp + (iter / self.qps) % self.per_qp
    }
    /// The iteration QP `j`'s `k`-th receive is for.
    fn recv_iter(&self, j: usize, k: u64) -> u64 {
        j as u64 + k * self.qps
    }
}

fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (num, mult) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1u64 << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    let n: u64 = num.parse().map_err(|_| format!("invalid size `{s}`"))?;
    let v = n
        .checked_mul(mult)
        .ok_or_else(|| format!("size `{s}` too large"))?;
    if v > u64::from(u32::MAX) {
        return Err(format!(
            "size `{s}` exceeds the largest message (4 GiB - 1)"
        ));
    }
    Ok(v)
}

/// One path's line of the report.
#[derive(Debug, Serialize)]
struct PathReport {
    id: u8,
    src_port: u16,
    packets: u64,
    /// Bytes of the DATA packets sent (whole datagrams).
    bytes: u64,
    retransmits: u64,
    lost: u64,
    /// Packets declared lost that arrived after all.
    spurious: u64,
    ecn_marks: u64,
    rtt_us: f64,
    /// Times declared failed (moved to a new source port, probed back).
    failures: u64,
    /// Times moved to a new source port because the route stayed congested.
    moves: u64,
    /// `active`, or `probing` (declared failed, testing its new route).
    state: &'static str,
}

/// One direction of a run: the client's own stream (`tx`) or, with
/// `--bidir`, the server's back to it (`rx`).
#[derive(Debug, Default, Clone, Copy, Serialize)]
struct Direction {
    iterations: u64,
    bytes: u64,
    duration_s: f64,
    gbps: f64,
    verified_bytes: u64,
    corrupt_bytes: u64,
    retransmits: u64,
}

impl Direction {
    fn new(iterations: u64, size: u64, secs: f64, checked: (u64, u64), retransmits: u64) -> Self {
        let bytes = iterations * size;
        Direction {
            iterations,
            bytes,
            duration_s: secs,
            gbps: if secs > 0.0 {
                bytes as f64 * 8.0 / secs / 1e9
            } else {
                0.0
            },
            verified_bytes: checked.0,
            corrupt_bytes: checked.1,
            retransmits,
        }
    }

    /// This side's own stream; `peer` is what the peer checked of it (the
    /// requester checks READs itself).
    fn of(r: &Requester, peer: &ServerResult, retransmits: u64, size: u64) -> Self {
        let checked = if r.p.op == Op::Read {
            (r.verified, r.corrupt)
        } else {
            (peer.verified_bytes, peer.corrupt_bytes)
        };
        Direction::new(r.completed, size, r.elapsed(), checked, retransmits)
    }

    /// The peer's stream, as its `Done` told and as checked here.
    fn from_peer(d: &PeerDone, own: &ServerResult, op: Op, size: u64) -> Self {
        let checked = if op == Op::Read {
            (d.verified_bytes, d.corrupt_bytes)
        } else {
            (own.verified_bytes, own.corrupt_bytes)
        };
        Direction::new(d.iterations, size, d.elapsed_s, checked, d.retransmits)
    }
}

/// What `--json` prints. With `--bidir` the totals (`iterations`, `bytes`,
/// `gbps`, `msg_rate_mps`, `retransmits`, `verified_bytes`,
/// `corrupt_bytes`) are sums of both directions, given apart in `tx` and
/// `rx`; latency is the client's own requests'.
#[derive(Debug, Serialize)]
struct Report {
    op: Op,
    backend: String,
    /// This side's `--busy-poll`, microseconds.
    busy_poll_us: u64,
    msg_size: u64,
    qps: u32,
    bidir: bool,
    iterations: u64,
    bytes: u64,
    duration_s: f64,
    gbps: f64,
    msg_rate_mps: f64,
    lat_min_us: f64,
    lat_p50_us: f64,
    lat_avg_us: f64,
    lat_p99_us: f64,
    lat_p999_us: f64,
    retransmits: u64,
    rto_fires: u64,
    verified_bytes: u64,
    corrupt_bytes: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    tx: Option<Direction>,
    #[serde(skip_serializing_if = "Option::is_none")]
    rx: Option<Direction>,
    paths: Vec<PathReport>,
}

/// What the server saw.
#[derive(Debug, Default, Clone, Copy)]
struct ServerResult {
    verified_bytes: u64,
    corrupt_bytes: u64,
    messages: u64,
}

fn endpoint_config(paths: u8) -> EndpointConfig {
    EndpointConfig {
        paths,
        ..EndpointConfig::default()
    }
}

/// How a side's driver is set up: the flags both sides have.
#[derive(Debug, Clone, Copy)]
struct Tuning {
    paths: u8,
    backend: Backend,
    busy_poll: Duration,
}

impl Tuning {
    fn new(paths: u8, backend: Backend, busy_poll_us: u64) -> Self {
        Tuning {
            paths,
            backend,
            busy_poll: Duration::from_micros(busy_poll_us),
        }
    }
}

/// Binds a driver on `listen`; an address in use becomes [`PerfError::PortInUse`].
fn bind(listen: SocketAddr, t: Tuning, seed: u64) -> anyhow::Result<Driver> {
    bind_mtu(listen, t, seed, None)
}

/// [`bind`] with the endpoint's MTU bounded by `mtu` (the route's largest
/// UDP payload), so that no datagram is too large for the network.
fn bind_mtu(
    listen: SocketAddr,
    t: Tuning,
    seed: u64,
    mtu: Option<usize>,
) -> anyhow::Result<Driver> {
    let Tuning {
        paths,
        backend,
        busy_poll,
    } = t;
    let mut cfg = DriverConfig::new(listen);
    cfg.backend = backend;
    cfg.busy_poll = busy_poll;
    cfg.endpoint = endpoint_config(paths);
    if let Some(m) = mtu {
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
fn drive(
    drv: &mut Driver,
    limit: Duration,
    mut done: impl FnMut(&mut Driver) -> bool,
) -> anyhow::Result<bool> {
    let start = Instant::now();
    while start.elapsed() < limit {
        if done(drv) {
            return Ok(true);
        }
        drv.poll(Duration::from_millis(1))?;
    }
    Ok(done(drv))
}

/// Runs `drv` until the next control message arrives (at most `limit`),
/// handing every endpoint event to `on_event` meanwhile.
fn drive_until_msg(
    drv: &mut Driver,
    link: &Link,
    limit: Duration,
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
    msg.ok_or_else(|| PerfError::Protocol(format!("no control message within {limit:?}")).into())
}

/// Turns an unexpected control message into an error.
fn unexpected(m: Msg, wanted: &str) -> anyhow::Error {
    match m {
        Msg::Abort { reason } => PerfError::Protocol(format!("the peer aborted: {reason}")).into(),
        other => PerfError::Protocol(format!("expected {wanted}, got {other:?}")).into(),
    }
}

/// One side's own stream: `op` work requests posted round robin over its
/// QPs against the peer's region for the run's duration, each timed and
/// (READ) checked on completion.
struct Requester {
    p: RunParams,
    lay: Layout,
    qps: Vec<Qpn>,
    cq: CqHandle,
    mr: MrInfo,
    remote: Region,
    hist: hdrhistogram::Histogram<u64>,
    post_times: Vec<Instant>,
    next_iter: u64,
    completed: u64,
    outstanding: u64,
    qp_out: Vec<u64>,
    verified: u64,
    corrupt: u64,
    error: Option<WcStatus>,
    t0: Instant,
    elapsed: Option<f64>,
    wcs: Vec<WorkCompletion>,
}

impl Requester {
    /// Registers the local buffer; `cq` is the QPs' send CQ.
    fn new(
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
        })
    }

    /// The clock of the run starts now.
    fn start(&mut self) {
        self.t0 = Instant::now();
    }

    /// Reaps completions and posts what the depth allows; true once the run
    /// is over (its time is up and nothing is outstanding) or a request failed.
    fn step(&mut self, d: &mut Driver) -> bool {
        if self.elapsed.is_some() {
            return true;
        }
        let size = self.p.size;
        let lay = self.lay;
        let ep = d.endpoint();
        self.wcs.clear();
        let _ = ep.poll_cq(self.cq, 64, &mut self.wcs);
        for wc in &self.wcs {
            if wc.status != WcStatus::Success {
                self.error.get_or_insert(wc.status);
            }
            let iter = wc.wr_id;
            let ls = lay.client_slot(iter);
            let lat = self.post_times[ls as usize].elapsed();
            self.hist.saturating_record(lat.as_nanos().max(1) as u64);
            if self.p.op == Op::Read && self.p.verify && wc.status == WcStatus::Success {
                if let Some(buf) = ep.mr(self.mr.lkey) {
                    let b = &buf[(ls * size) as usize..((ls + 1) * size) as usize];
                    let bad = check(b, iter % self.remote.slots);
                    self.corrupt += bad;
                    self.verified += size - bad;
                }
            }
            self.completed += 1;
            self.outstanding -= 1;
            self.qp_out[lay.qp_of(iter)] -= 1;
        }
        if self.error.is_some() {
            self.elapsed = Some(self.t0.elapsed().as_secs_f64());
            return true;
        }
        let sending = self.t0.elapsed() < Duration::from_secs_f64(self.p.duration);
        let now = d.now();
        let ep = d.endpoint();
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
                if let Some(buf) = ep.mr_mut(self.mr.lkey) {
                    fill(
                        &mut buf[(ls * size) as usize..((ls + 1) * size) as usize],
                        i,
                    );
                }
            }
            if ep
                .post_send(now, self.qps[j], SendWr::new(i, op, local))
                .is_err()
            {
                break;
            }
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

    fn elapsed(&self) -> f64 {
        self.elapsed
            .unwrap_or_else(|| self.t0.elapsed().as_secs_f64())
    }
}

/// One side's part in the peer's stream: a region the peer targets, the
/// receives its messages complete, and the check of every message.
struct Responder {
    p: RunParams,
    lay: Layout,
    qps: Vec<Qpn>,
    cq: CqHandle,
    mr: MrInfo,
    posted: Vec<u64>,
    res: ServerResult,
    expected: Option<u64>,
    wcs: Vec<WorkCompletion>,
}

impl Responder {
    /// Registers the region and fills it (READ) or posts every receive;
    /// `cq` is the QPs' receive CQ.
    fn new(
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
            // The peer reads slots; each slot holds the pattern of its index.
            let buf = ep.mr_mut(mr.lkey).context("region vanished")?;
            for s in 0..slots {
                fill(&mut buf[(s * size) as usize..((s + 1) * size) as usize], s);
            }
        } else {
            for (j, &qp) in qps.iter().enumerate() {
                for _ in 0..2 * lay.per_qp {
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
        })
    }

    fn region(&self) -> Region {
        Region {
            rkey: self.mr.rkey,
            addr: self.mr.addr,
            slots: self.lay.slots,
        }
    }

    /// Checks what arrived and lets the peer reuse each checked slot; true
    /// once the peer said how many messages it sent and all are in.
    fn step(&mut self, d: &mut Driver) -> bool {
        let (size, slots) = (self.p.size, self.lay.slots);
        self.wcs.clear();
        let ep = d.endpoint();
        let _ = ep.poll_cq(self.cq, 64, &mut self.wcs);
        for wc in &self.wcs {
            if wc.status != WcStatus::Success {
                self.res.corrupt_bytes += u64::from(wc.byte_len);
                continue;
            }
            let iter = wc.imm.map_or(self.res.messages, u64::from);
            let slot = iter % slots;
            if self.p.verify {
                if let Some(buf) = ep.mr(self.mr.lkey) {
                    let b =
                        &buf[(slot * size) as usize..(slot * size) as usize + wc.byte_len as usize];
                    let bad = check(b, iter);
                    self.res.corrupt_bytes += bad;
                    self.res.verified_bytes += u64::from(wc.byte_len) - bad;
                }
            }
            self.res.messages += 1;
            // The slot is checked: let the peer reuse it.
            if let Some(j) = self.qps.iter().position(|&q| q == wc.qpn) {
                let wr = recv_wr(self.p.op, &self.mr, &self.lay, j, self.posted[j], size);
                let _ = ep.post_recv(self.qps[j], wr);
                self.posted[j] += 1;
            }
        }
        match self.expected {
            None => false,
            // READs complete at the reader; nothing arrives here.
            Some(_) if self.p.op == Op::Read => true,
            Some(n) => self.res.messages >= n,
        }
    }
}

/// What the peer said about its own stream when it ended (its `Done`).
#[derive(Debug, Default, Clone, Copy)]
struct PeerDone {
    iterations: u64,
    elapsed_s: f64,
    verified_bytes: u64,
    corrupt_bytes: u64,
    retransmits: u64,
}

/// What the data phase learned from the peer.
#[derive(Debug, Default)]
struct Exchange {
    /// The peer's check of our stream (its answer to our `Done`).
    peer_result: Option<ServerResult>,
    /// The peer's own stream, when it ran one.
    peer_done: Option<PeerDone>,
}

/// The data phase of one side: runs its own stream (`req`) and its part in
/// the peer's (`resp`) at once, until its stream is over and checked by
/// the peer, and the peer's stream is over and checked here. `started`:
/// whether `req` runs from the start or waits for the peer's `Start`.
fn data_phase(
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
    let finished = drive(drv, Duration::from_secs_f64(duration + 30.0), |d| {
        loop {
            match link.try_recv() {
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
                    err = Some(e.into());
                    break;
                }
            }
        }
        if err.is_some() {
            return true;
        }
        if let Some(r) = req.as_deref_mut() {
            if started && !done_sent && r.step(d) {
                if let Some(st) = r.error {
                    err = Some(anyhow::anyhow!("a work request failed with {st:?}"));
                    return true;
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
        (req.is_none() || ex.peer_result.is_some()) && (resp.is_none() || result_sent)
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
fn create_qps(
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

/// What the server checked of the client's stream, and with `bidir` how
/// its own stream went.
#[derive(Debug, Default, Clone, Copy)]
struct ServeOutcome {
    received: ServerResult,
    sent: Option<Direction>,
}

/// The server's side of one run over `link`: reads the client's `Hello`,
/// accepts its connection, exposes a region, verifies every message (and
/// with `bidir` runs the same stream back to the client).
/// `peer_ip`, if known, is the client's address (its control connection's).
fn serve_run(
    drv: &mut Driver,
    link: &Link,
    peer_ip: Option<IpAddr>,
) -> anyhow::Result<ServeOutcome> {
    let setup = Duration::from_secs(10);
    // Anything left over from an earlier run is not ours.
    while drv.endpoint().poll_event().is_some() {}
    let mut conn = None;
    let take = |e: Event, conn: &mut Option<ConnectionHandle>| {
        if let Event::Incoming { conn: c, peer } = e {
            if peer_ip.is_none_or(|ip| ip == peer.ip()) {
                *conn = Some(c);
            }
        }
    };
    let p = match drive_until_msg(drv, link, setup, |e| take(e, &mut conn))? {
        Msg::Hello { version, params } => {
            if version != VERSION {
                link.send(Msg::Refused {
                    version: VERSION,
                    reason: format!(
                        "control protocol version {version}, this server speaks {VERSION}"
                    ),
                });
                return Err(PerfError::VersionMismatch {
                    ours: VERSION,
                    theirs: version,
                }
                .into());
            }
            if let Err(e) = validate(&params) {
                link.send(Msg::Refused {
                    version: VERSION,
                    reason: e.to_string(),
                });
                return Err(e.into());
            }
            params
        }
        m => return Err(unexpected(m, "Hello")),
    };
    link.send(Msg::Welcome {
        version: VERSION,
        udp_port: drv.local_addr().port(),
    });
    let mut client = None;
    while client.is_none() || conn.is_none() {
        if client.is_none() {
            match drive_until_msg(drv, link, setup, |e| take(e, &mut conn))? {
                Msg::ClientQps { qpns, region } if qpns.len() == p.qps as usize => {
                    if p.bidir && region.is_none() {
                        return Err(PerfError::Protocol(
                            "a bidirectional run without the client's region".into(),
                        )
                        .into());
                    }
                    client = Some((qpns, region));
                }
                m => return Err(unexpected(m, "ClientQps")),
            }
        } else {
            drive(drv, setup, |d| {
                while let Some(e) = d.endpoint().poll_event() {
                    take(e, &mut conn);
                }
                conn.is_some()
            })?;
            if conn.is_none() {
                bail!("the client's metaroce connection did not arrive");
            }
        }
    }
    let conn = conn.context("no client connected")?;
    let (client_qpns, client_region) = client.unwrap_or_default();
    let ep = drv.endpoint();
    let (pd, send_cq, recv_cq, qps) = create_qps(ep, &p)?;
    for (&qp, &remote) in qps.iter().zip(&client_qpns) {
        ep.connect_qp(qp, conn, Qpn(remote))?;
    }
    let mut resp = Responder::new(ep, pd, recv_cq, &qps, &p)?;
    let mut req = match client_region {
        Some(region) if p.bidir => Some(Requester::new(ep, pd, send_cq, &qps, &p, region)?),
        _ => None,
    };
    let region = resp.region();
    link.send(Msg::Ready {
        qpns: qps.iter().map(|q| q.0).collect(),
        rkey: region.rkey,
        addr: region.addr,
        slots: region.slots,
    });
    // The server's own stream (bidir) waits for the client's `Start`.
    let ex = data_phase(drv, link, conn, req.as_mut(), Some(&mut resp), false);
    // Let the last ACKs go out, then free the run's resources.
    drive(drv, Duration::from_millis(20), |_| false)?;
    let now = drv.now();
    let ep = drv.endpoint();
    for &qp in &qps {
        let _ = ep.destroy_qp(qp);
    }
    let _ = ep.dereg_mr(resp.mr.lkey);
    if let Some(r) = &req {
        let _ = ep.dereg_mr(r.mr.lkey);
    }
    let retransmits = ep.connection_stats(conn).map_or(0, |s| s.retransmits);
    let _ = ep.close(now, conn);
    let ex = ex?;
    let sent = match (&req, ex.peer_result) {
        (Some(r), Some(pr)) => Some(Direction::of(r, &pr, retransmits, p.size)),
        _ => None,
    };
    Ok(ServeOutcome {
        received: resp.res,
        sent,
    })
}

fn recv_wr(op: Op, mr: &MrInfo, lay: &Layout, j: usize, k: u64, size: u64) -> RecvWr {
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
    RecvWr { wr_id: iter, sge }
}

/// Runs `metaroce perf`: the loopback test, a server or a client.
pub fn run(args: PerfArgs) -> anyhow::Result<()> {
    match args.mode {
        None => run_loopback(args.opts),
        Some(Mode::Server(s)) => run_server(s),
        Some(Mode::Client(c)) => run_client(c),
    }
}

/// The loopback test: a server and a client endpoint in one process.
fn run_loopback(opts: RunOpts) -> anyhow::Result<()> {
    if opts.paths == 0 {
        bail!(PerfError::BadFlags("--paths must be at least 1".into()));
    }
    validate(&opts.params())?;
    let lo: SocketAddr = "127.0.0.1:0".parse()?;
    let tuning = opts.tuning();
    let mut server_drv = bind(lo, tuning, 1).context("binding the server")?;
    let server_ip = server_drv.local_addr().ip();
    let mut client = bind(lo, tuning, 2).context("binding the client")?;
    let (srv_link, cli_link) = Link::pair();
    let res = std::thread::scope(|s| -> anyhow::Result<Report> {
        let srv = s.spawn(move || {
            let r = serve_run(&mut server_drv, &srv_link, None);
            drop(srv_link);
            r
        });
        let rep = client_run(&opts, &mut client, &cli_link, server_ip);
        let sres = srv
            .join()
            .map_err(|_| anyhow::anyhow!("server thread panicked"))?;
        match (rep, sres) {
            (Ok(r), Ok(_)) => Ok(r),
            (Err(e), _) | (Ok(_), Err(e)) => Err(e),
        }
    });
    finish(&opts, res?, "loopback")
}

/// Prints the report; corrupt bytes make the run fail.
fn finish(opts: &RunOpts, rep: Report, where_: &str) -> anyhow::Result<()> {
    if opts.json {
        println!("{}", serde_json::to_string(&rep)?);
    } else {
        print_report(&rep, opts.paths, opts.depth, where_);
    }
    if rep.corrupt_bytes > 0 {
        bail!("{} corrupt bytes", rep.corrupt_bytes);
    }
    Ok(())
}

/// `metaroce perf server`: binds, prints where, serves runs one at a time.
fn run_server(a: ServerArgs) -> anyhow::Result<()> {
    if a.paths == 0 {
        bail!(PerfError::BadFlags("--paths must be at least 1".into()));
    }
    let mut drv = bind(a.bind, Tuning::new(a.paths, a.backend, a.busy_poll_us), 1)?;
    let udp = drv.local_addr();
    let ctrl = SocketAddr::new(a.bind.ip(), a.ctrl_port.unwrap_or(udp.port()));
    let listener = TcpListener::bind(ctrl).map_err(|cause| PerfError::PortInUse {
        what: "TCP control",
        addr: ctrl,
        cause,
    })?;
    let ctrl = listener.local_addr()?;
    let shown = SocketAddr::new(a.bind.ip(), udp.port());
    let mut out = std::io::stdout();
    if ctrl.port() == udp.port() {
        writeln!(out, "metaroce perf server: listening on {shown}")?;
    } else {
        writeln!(
            out,
            "metaroce perf server: listening on {shown} (control on TCP port {})",
            ctrl.port()
        )?;
    }
    writeln!(out, "metaroce perf server: {} backend", drv.backend())?;
    out.flush()?;
    loop {
        let (stream, peer) = listener.accept()?;
        let link = Link::tcp(stream)?;
        let r = serve_run(&mut drv, &link, Some(peer.ip()));
        drop(link);
        match r {
            Ok(o) => {
                let r = o.received;
                let back = o.sent.map_or(String::new(), |d| {
                    format!(
                        "; sent back {} messages ({:.3} Gbit/s), {} bytes verified by the client, {} corrupt",
                        d.iterations, d.gbps, d.verified_bytes, d.corrupt_bytes
                    )
                });
                // A closed stdout (the parent stopped reading) must not end the server.
                let _ = writeln!(
                    std::io::stdout(),
                    "metaroce perf server: run from {peer}: {} messages received, {} bytes verified, {} corrupt{back}",
                    r.messages, r.verified_bytes, r.corrupt_bytes
                );
                if a.once {
                    let corrupt = r.corrupt_bytes + o.sent.map_or(0, |d| d.corrupt_bytes);
                    if corrupt > 0 {
                        bail!("{corrupt} corrupt bytes");
                    }
                    return Ok(());
                }
            }
            Err(e) if a.once => return Err(e),
            Err(e) => eprintln!("metaroce perf server: run from {peer} failed: {e:#}"),
        }
        let _ = std::io::stdout().flush();
    }
}

/// `metaroce perf client`: reaches the server over TCP, runs, reports.
fn run_client(c: ClientArgs) -> anyhow::Result<()> {
    let opts = c.opts;
    if opts.paths == 0 {
        bail!(PerfError::BadFlags("--paths must be at least 1".into()));
    }
    validate(&opts.params())?;
    let target = with_default_port(&c.addr);
    let unreachable = |cause| PerfError::Unreachable {
        addr: c.addr.clone(),
        cause,
    };
    let mut addr = target
        .to_socket_addrs()
        .map_err(unreachable)?
        .next()
        .ok_or_else(|| unreachable(std::io::Error::other("no address")))?;
    if let Some(p) = c.ctrl_port {
        addr.set_port(p);
    }
    let stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).map_err(unreachable)?;
    let local_ip = stream.local_addr()?.ip();
    let link = Link::tcp(stream)?;
    // Datagrams must fit the route: a 1500-byte network gets 1472-byte ones.
    let route_mtu = metaroce_io::max_udp_payload(addr).ok();
    let mut drv = bind_mtu(SocketAddr::new(local_ip, 0), opts.tuning(), 2, route_mtu)
        .context("binding the client")?;
    let rep = client_run(&opts, &mut drv, &link, addr.ip())?;
    finish(&opts, rep, &format!("remote {}", c.addr))
}

/// `HOST[:PORT]` with perftest's port when none is given (IPv6 literals
/// take brackets to carry a port: `[::1]:18515`).
fn with_default_port(addr: &str) -> String {
    if addr.parse::<SocketAddr>().is_ok() {
        return addr.to_string();
    }
    if let Ok(ip) = addr.parse::<IpAddr>() {
        return SocketAddr::new(ip, DEFAULT_PORT).to_string();
    }
    match addr.rsplit_once(':') {
        Some((_, p)) if p.parse::<u16>().is_ok() => addr.to_string(),
        _ => format!("{addr}:{DEFAULT_PORT}"),
    }
}

/// The client's side of one run over `link` against the server at `server_ip`.
fn client_run(
    opts: &RunOpts,
    drv: &mut Driver,
    link: &Link,
    server_ip: IpAddr,
) -> anyhow::Result<Report> {
    let setup = Duration::from_secs(10);
    let p = opts.params();
    link.send(Msg::Hello {
        version: VERSION,
        params: p.clone(),
    });
    let udp_port = match drive_until_msg(drv, link, setup, |_| {})? {
        Msg::Welcome { udp_port, .. } => udp_port,
        Msg::Refused { version, .. } if version != VERSION => {
            return Err(PerfError::VersionMismatch {
                ours: VERSION,
                theirs: version,
            }
            .into())
        }
        Msg::Refused { reason, .. } => return Err(PerfError::Refused(reason).into()),
        m => return Err(unexpected(m, "Welcome")),
    };
    let server_addr = SocketAddr::new(server_ip, udp_port);
    let now = drv.now();
    let conn = drv.endpoint().connect(now, server_addr)?;
    let mut up = false;
    let mut failed = None;
    drive(drv, setup, |d| {
        while let Some(e) = d.endpoint().poll_event() {
            match e {
                Event::Connected(c) if c == conn => up = true,
                Event::ConnectionLost { error, .. } => failed = Some(error),
                _ => {}
            }
        }
        up || failed.is_some()
    })?;
    if let Some(e) = failed {
        bail!("cannot connect to {server_addr}: {e}");
    }
    if !up {
        bail!("cannot connect to {server_addr}: no answer");
    }
    let ep = drv.endpoint();
    let (pd, send_cq, recv_cq, qps) = create_qps(ep, &p)?;
    // With --bidir the server's stream lands here: receives go up before
    // the server learns where to send.
    let mut resp = if p.bidir {
        for &qp in &qps {
            // INIT takes receives; `connect_qp` goes on from there.
            let attrs = QpAttrs {
                access: Some(AccessFlags::ALL),
                ..Default::default()
            };
            ep.modify_qp(qp, QpState::Init, attrs)?;
        }
        Some(Responder::new(ep, pd, recv_cq, &qps, &p)?)
    } else {
        None
    };
    link.send(Msg::ClientQps {
        qpns: qps.iter().map(|q| q.0).collect(),
        region: resp.as_ref().map(Responder::region),
    });
    let (remote_qpns, remote) = match drive_until_msg(drv, link, setup, |_| {})? {
        Msg::Ready {
            qpns,
            rkey,
            addr,
            slots,
        } if qpns.len() == qps.len() => (qpns, Region { rkey, addr, slots }),
        m => return Err(unexpected(m, "Ready")),
    };
    let ep = drv.endpoint();
    for (&qp, &r) in qps.iter().zip(&remote_qpns) {
        ep.connect_qp(qp, conn, Qpn(r))?;
    }
    let mut req = Requester::new(ep, pd, send_cq, &qps, &p, remote)?;
    if p.bidir {
        link.send(Msg::Start);
    }
    let ex = data_phase(drv, link, conn, Some(&mut req), resp.as_mut(), true)?;
    let cs = drv.endpoint().connection_stats(conn).unwrap_or_default();
    // Keep answering until the server is done with its last ACKs.
    drive(drv, Duration::from_millis(20), |_| false)?;
    let size = p.size;
    let peer_result = ex.peer_result.unwrap_or_default();
    let tx = Direction::of(&req, &peer_result, cs.retransmits, size);
    let rx = match (&resp, ex.peer_done) {
        (Some(r), Some(d)) => Some(Direction::from_peer(&d, &r.res, p.op, size)),
        _ => None,
    };
    let both = |f: fn(&Direction) -> u64| f(&tx) + rx.as_ref().map_or(0, f);
    let hist = &req.hist;
    let us = |q: f64| hist.value_at_quantile(q) as f64 / 1000.0;
    let elapsed = tx.duration_s;
    Ok(Report {
        op: p.op,
        backend: drv.backend().to_string(),
        busy_poll_us: opts.busy_poll_us,
        msg_size: size,
        qps: p.qps,
        bidir: p.bidir,
        iterations: both(|d| d.iterations),
        bytes: both(|d| d.bytes),
        duration_s: elapsed,
        gbps: tx.gbps + rx.as_ref().map_or(0.0, |d| d.gbps),
        msg_rate_mps: tx.iterations as f64 / elapsed / 1e6
            + rx.as_ref()
                .map_or(0.0, |d| d.iterations as f64 / d.duration_s / 1e6),
        lat_min_us: hist.min() as f64 / 1000.0,
        lat_p50_us: us(0.5),
        lat_avg_us: hist.mean() / 1000.0,
        lat_p99_us: us(0.99),
        lat_p999_us: us(0.999),
        retransmits: both(|d| d.retransmits),
        rto_fires: cs.rto_fires,
        verified_bytes: both(|d| d.verified_bytes),
        corrupt_bytes: both(|d| d.corrupt_bytes),
        tx: p.bidir.then_some(tx),
        rx,
        paths: cs
            .paths
            .iter()
            .map(|p| PathReport {
                id: p.id,
                src_port: p.src_port,
                packets: p.packets_sent,
                bytes: p.bytes_sent,
                retransmits: p.retransmits,
                lost: p.packets_lost,
                spurious: p.spurious_losses,
                ecn_marks: p.ce_marks,
                rtt_us: p.srtt_ns as f64 / 1000.0,
                failures: p.failures,
                moves: p.moves,
                state: match p.state {
                    Some(PathState::Probing) => "probing",
                    _ => "active",
                },
            })
            .collect(),
    })
}

fn print_report(r: &Report, paths: u8, depth: u32, where_: &str) {
    let line = "-".repeat(96);
    let name = match r.op {
        Op::Write => "RDMA_Write",
        Op::Read => "RDMA_Read",
        Op::Send => "Send",
    };
    println!("{line}");
    println!(
        "                    {name} BW Test (metaroce, {where_}, {} backend)",
        r.backend
    );
    println!(
        " Number of qps   : {}\t\tPaths per connection : {paths}",
        r.qps
    );
    println!(" Tx depth        : {depth}\t\tVerification         : every byte");
    println!(" Busy poll       : {} us", r.busy_poll_us);
    if r.bidir {
        println!(" Direction       : both (tx: client -> server requests, rx: server -> client)");
    }
    println!("{line}");
    println!(" #bytes     #iterations    BW average[Gb/sec]   MsgRate[Mpps]   Retransmits   RTOs");
    if let (Some(tx), Some(rx)) = (&r.tx, &r.rx) {
        for (what, d) in [("tx", tx), ("rx", rx)] {
            println!(
                " {:<10} {:<14} {:<20.3} {:<15.6} {:<13} {what}",
                r.msg_size,
                d.iterations,
                d.gbps,
                d.iterations as f64 / d.duration_s.max(1e-9) / 1e6,
                d.retransmits
            );
        }
    }
    println!(
        " {:<10} {:<14} {:<20.3} {:<15.6} {:<13} {}{}",
        r.msg_size,
        r.iterations,
        r.gbps,
        r.msg_rate_mps,
        r.retransmits,
        r.rto_fires,
        if r.bidir { " (sum of both ways)" } else { "" }
    );
    println!("{line}");
    println!(
        " latency [usec]  t_min {:.1}  t_typical {:.1}  t_avg {:.1}  p99 {:.1}  p99.9 {:.1}",
        r.lat_min_us, r.lat_p50_us, r.lat_avg_us, r.lat_p99_us, r.lat_p999_us
    );
    println!(
        " verified bytes  {}   corrupt bytes {}",
        r.verified_bytes, r.corrupt_bytes
    );
    println!("{line}");
    println!(
        " path src_port packets    bytes         retx     lost     ecn      rtt[usec] state   fail/move"
    );
    for p in &r.paths {
        println!(
            " {:<4} {:<8} {:<10} {:<13} {:<8} {:<8} {:<8} {:<9.1} {:<7} {}/{}",
            p.id,
            p.src_port,
            p.packets,
            p.bytes,
            p.retransmits,
            p.lost,
            p.ecn_marks,
            p.rtt_us,
            p.state,
            p.failures,
            p.moves
        );
    }
    println!("{line}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("64K"), Ok(65536));
        assert_eq!(parse_size("1m"), Ok(1 << 20));
        assert_eq!(parse_size("100"), Ok(100));
        assert!(parse_size("5G").is_err());
        assert!(parse_size("x").is_err());
    }
}

#[cfg(test)]
mod remote_tests {
    use super::*;

    #[test]
    fn a_client_of_another_version_is_refused() {
        let lo: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let mut drv = bind(lo, Tuning::new(1, Backend::Portable, 0), 1).unwrap();
        let (srv, cli) = Link::pair();
        let opts = RunOpts {
            op: Op::Write,
            size: 1024,
            duration: 0.1,
            depth: 4,
            qps: 1,
            paths: 1,
            no_verify: false,
            bidir: false,
            json: true,
            backend: Backend::Portable,
            busy_poll_us: 0,
        };
        cli.send(Msg::Hello {
            version: VERSION + 1,
            params: opts.params(),
        });
        let err = serve_run(&mut drv, &srv, None).unwrap_err();
        assert!(
            matches!(
                err.downcast_ref::<PerfError>(),
                Some(PerfError::VersionMismatch { .. })
            ),
            "{err:#}"
        );
        match cli.try_recv().unwrap() {
            Some(Msg::Refused { version, .. }) => assert_eq!(version, VERSION),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn layout_keeps_each_qp_in_its_own_slots() {
        let p = RunParams {
            op: Op::Write,
            size: 8,
            depth: 5,
            qps: 2,
            verify: true,
            duration: 1.0,
            bidir: false,
        };
        let lay = Layout::new(&p);
        assert_eq!((lay.per_qp, lay.slots), (3, 12));
        for i in 0..100u64 {
            let j = lay.qp_of(i);
            assert_eq!(lay.client_slot(i) / lay.per_qp, j as u64);
            assert_eq!((i % lay.slots) % lay.qps, j as u64);
        }
        assert_eq!(lay.recv_iter(1, 2), 5);
        assert!(validate(&RunParams {
            qps: 0,
            ..p.clone()
        })
        .is_err());
        assert!(validate(&RunParams { qps: 9, ..p }).is_err());
    }

    #[test]
    fn default_port_is_perftests() {
        assert_eq!(with_default_port("10.0.0.1"), "10.0.0.1:18515");
        assert_eq!(with_default_port("10.0.0.1:9"), "10.0.0.1:9");
        assert_eq!(with_default_port("host"), "host:18515");
        assert_eq!(with_default_port("::1"), "[::1]:18515");
    }
}
