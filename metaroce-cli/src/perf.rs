//! `metaroce perf`: bandwidth, message rate and latency of the transport,
//! with every payload byte verified end to end.
//!
//! With no arguments it runs a self-contained loopback test: a server and a
//! client endpoint in one process, each on its own thread and its own UDP
//! sockets on 127.0.0.1, talking the full protocol through the kernel.
//!
//! Verification: every 8-byte word of message `i` is `pattern(i, k)`, so a
//! byte placed at the wrong offset, from the wrong message, or stale, is
//! caught. WRITEs carry immediate data (the iteration) so that the server
//! sees each one land and checks it before it lets the slot be reused: a
//! slot is reused only after its receive is posted again, and the protocol
//! refuses (RNR) a WRITE_IMM that has no receive.

use crate::oob::{Link, Msg, PerfError, RunParams, VERSION};
use anyhow::{bail, Context};
use clap::{Args, Subcommand, ValueEnum};
use metaroce_io::{Backend, Driver, DriverConfig, DriverError};
use metaroce_proto::verbs::*;
use metaroce_proto::{EndpointConfig, Event};
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
    /// Print one JSON object instead of the report.
    #[arg(long)]
    json: bool,
    /// I/O backend: auto (io_uring when the kernel has it), io_uring, portable.
    #[arg(long, default_value = "auto")]
    backend: Backend,
}

impl RunOpts {
    fn params(&self) -> RunParams {
        RunParams {
            op: self.op,
            size: self.size,
            depth: self.depth,
            qps: self.qps,
            verify: !self.no_verify,
            duration: self.duration,
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
    retransmits: u64,
    lost: u64,
    ecn_marks: u64,
    rtt_us: f64,
}

/// What `--json` prints.
#[derive(Debug, Serialize)]
struct Report {
    op: Op,
    backend: String,
    msg_size: u64,
    qps: u32,
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
    paths: Vec<PathReport>,
}

/// What the server saw.
#[derive(Debug, Default, Clone, Copy)]
struct ServerResult {
    verified_bytes: u64,
    corrupt_bytes: u64,
    messages: u64,
}

/// Word `k` of message `iter`.
#[inline]
fn pattern(iter: u64, k: u64) -> u64 {
    (iter << 40) ^ k.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x5bd1_e995
}

fn fill(buf: &mut [u8], iter: u64) {
    let mut words = buf.chunks_exact_mut(8);
    let mut k = 0u64;
    for w in &mut words {
        w.copy_from_slice(&pattern(iter, k).to_le_bytes());
        k += 1;
    }
    let rest = words.into_remainder();
    let v = pattern(iter, k).to_le_bytes();
    rest.copy_from_slice(&v[..rest.len()]);
}

/// Returns the number of bytes that differ from the pattern of `iter`.
fn check(buf: &[u8], iter: u64) -> u64 {
    let mut words = buf.chunks_exact(8);
    let mut k = 0u64;
    let mut bad = 0u64;
    for w in &mut words {
        let got = u64::from_le_bytes([w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]]);
        let diff = got ^ pattern(iter, k);
        if diff != 0 {
            bad += u64::from((0..8).filter(|i| (diff >> (8 * i)) & 0xff != 0).count() as u32);
        }
        k += 1;
    }
    let rest = words.remainder();
    let v = pattern(iter, k).to_le_bytes();
    bad += rest.iter().zip(&v).filter(|(a, b)| a != b).count() as u64;
    bad
}

fn endpoint_config(paths: u8) -> EndpointConfig {
    EndpointConfig {
        paths,
        ..EndpointConfig::default()
    }
}

/// Binds a driver on `listen`; an address in use becomes [`PerfError::PortInUse`].
fn bind(listen: SocketAddr, paths: u8, seed: u64, backend: Backend) -> anyhow::Result<Driver> {
    bind_mtu(listen, paths, seed, backend, None)
}

/// [`bind`] with the endpoint's MTU bounded by `mtu` (the route's largest
/// UDP payload), so that no datagram is too large for the network.
fn bind_mtu(
    listen: SocketAddr,
    paths: u8,
    seed: u64,
    backend: Backend,
    mtu: Option<usize>,
) -> anyhow::Result<Driver> {
    let mut cfg = DriverConfig::new(listen);
    cfg.backend = backend;
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

/// The server's side of one run over `link`: reads the client's `Hello`,
/// accepts its connection, exposes a region, verifies every message.
/// `peer_ip`, if known, is the client's address (its control connection's).
fn serve_run(
    drv: &mut Driver,
    link: &Link,
    peer_ip: Option<IpAddr>,
) -> anyhow::Result<ServerResult> {
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
    let mut client_qpns = None;
    while client_qpns.is_none() || conn.is_none() {
        if client_qpns.is_none() {
            match drive_until_msg(drv, link, setup, |e| take(e, &mut conn))? {
                Msg::ClientQps { qpns } if qpns.len() == p.qps as usize => client_qpns = Some(qpns),
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
    let client_qpns = client_qpns.unwrap_or_default();
    let lay = Layout::new(&p);
    let size = p.size;
    let slots = lay.slots;
    let ep = drv.endpoint();
    let pd = ep.alloc_pd();
    let cq = ep.create_cq(slots as usize * 2);
    let mr = ep.reg_mr(
        pd,
        vec![0u8; (slots * size).max(1) as usize].into_boxed_slice(),
        0x1000_0000,
        AccessFlags::ALL,
    )?;
    let mut qps = Vec::new();
    for &remote in &client_qpns {
        let mut init = QpInit::new(pd, cq, cq);
        init.max_recv_wr = (2 * lay.per_qp) as u32;
        let qp = ep.create_qp(init)?;
        ep.connect_qp(qp, conn, Qpn(remote))?;
        qps.push(qp);
    }
    let mut posted = vec![0u64; qps.len()];
    if p.op == Op::Read {
        // The client reads slots; each slot holds the pattern of its index.
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
    link.send(Msg::Ready {
        qpns: qps.iter().map(|q| q.0).collect(),
        rkey: mr.rkey,
        addr: mr.addr,
        slots,
    });
    let mut res = ServerResult::default();
    let mut expected: Option<u64> = None;
    let mut link_err = None;
    let mut wcs = Vec::new();
    let limit = Duration::from_secs_f64(p.duration + 30.0);
    let ok = drive(drv, limit, |d| {
        if expected.is_none() {
            match link.try_recv() {
                Ok(Some(Msg::Done { iterations })) => expected = Some(iterations),
                Ok(Some(m)) => link_err = Some(unexpected(m, "Done")),
                Ok(None) => {}
                Err(e) => link_err = Some(e.into()),
            }
        }
        if link_err.is_some() {
            return true;
        }
        wcs.clear();
        let ep = d.endpoint();
        let _ = ep.poll_cq(cq, 64, &mut wcs);
        for wc in &wcs {
            if wc.status != WcStatus::Success {
                res.corrupt_bytes += u64::from(wc.byte_len);
                continue;
            }
            let iter = wc.imm.map_or(res.messages, u64::from);
            let slot = iter % slots;
            if p.verify {
                if let Some(buf) = ep.mr(mr.lkey) {
                    let b =
                        &buf[(slot * size) as usize..(slot * size) as usize + wc.byte_len as usize];
                    let bad = check(b, iter);
                    res.corrupt_bytes += bad;
                    res.verified_bytes += u64::from(wc.byte_len) - bad;
                }
            }
            res.messages += 1;
            // The slot is checked: let the client reuse it.
            if let Some(j) = qps.iter().position(|&q| q == wc.qpn) {
                let _ = ep.post_recv(qps[j], recv_wr(p.op, &mr, &lay, j, posted[j], size));
                posted[j] += 1;
            }
        }
        p.op == Op::Read && expected.is_some() || expected.is_some_and(|n| res.messages >= n)
    });
    let outcome = match (ok, link_err) {
        (Err(e), _) | (_, Some(e)) => Err(e),
        (Ok(false), None) => Err(anyhow::anyhow!(
            "server: not every message arrived ({} of {:?})",
            res.messages,
            expected
        )),
        (Ok(true), None) => Ok(res),
    };
    match &outcome {
        Ok(r) => link.send(Msg::Result {
            verified_bytes: r.verified_bytes,
            corrupt_bytes: r.corrupt_bytes,
            messages: r.messages,
        }),
        Err(e) => link.send(Msg::Abort {
            reason: format!("{e:#}"),
        }),
    }
    // Let the last ACKs go out, then free the run's resources.
    drive(drv, Duration::from_millis(20), |_| false)?;
    let now = drv.now();
    let ep = drv.endpoint();
    for &qp in &qps {
        let _ = ep.destroy_qp(qp);
    }
    let _ = ep.dereg_mr(mr.lkey);
    let _ = ep.close(now, conn);
    outcome
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
    let mut server_drv = bind(lo, opts.paths, 1, opts.backend).context("binding the server")?;
    let server_ip = server_drv.local_addr().ip();
    let mut client = bind(lo, opts.paths, 2, opts.backend).context("binding the client")?;
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
    let mut drv = bind(a.bind, a.paths, 1, a.backend)?;
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
            Ok(r) => {
                // A closed stdout (the parent stopped reading) must not end the server.
                let _ = writeln!(
                    std::io::stdout(),
                    "metaroce perf server: run from {peer}: {} messages received, {} bytes verified, {} corrupt",
                    r.messages, r.verified_bytes, r.corrupt_bytes
                );
                if a.once {
                    if r.corrupt_bytes > 0 {
                        bail!("{} corrupt bytes", r.corrupt_bytes);
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
    let mut drv = bind_mtu(
        SocketAddr::new(local_ip, 0),
        opts.paths,
        2,
        opts.backend,
        route_mtu,
    )
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
    let lay = Layout::new(&p);
    let size = p.size;
    let depth = u64::from(p.depth);
    let local_slots = lay.qps * lay.per_qp;
    let ep = drv.endpoint();
    let pd = ep.alloc_pd();
    let cq = ep.create_cq(local_slots as usize * 2);
    let mr = ep.reg_mr(
        pd,
        vec![0u8; (local_slots * size).max(1) as usize].into_boxed_slice(),
        0,
        AccessFlags::LOCAL_WRITE,
    )?;
    let mut qps = Vec::new();
    for _ in 0..lay.qps {
        let mut init = QpInit::new(pd, cq, cq);
        init.max_send_wr = lay.per_qp as u32;
        qps.push(ep.create_qp(init)?);
    }
    link.send(Msg::ClientQps {
        qpns: qps.iter().map(|q| q.0).collect(),
    });
    let (remote_qpns, rkey, raddr, slots) = match drive_until_msg(drv, link, setup, |_| {})? {
        Msg::Ready {
            qpns,
            rkey,
            addr,
            slots,
        } if qpns.len() == qps.len() => (qpns, rkey, addr, slots),
        m => return Err(unexpected(m, "Ready")),
    };
    for (&qp, &r) in qps.iter().zip(&remote_qpns) {
        drv.endpoint().connect_qp(qp, conn, Qpn(r))?;
    }

    let verify = p.verify;
    let mut hist = hdrhistogram::Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3)?;
    let mut post_times = vec![Instant::now(); local_slots as usize];
    let mut next_iter = 0u64;
    let mut completed = 0u64;
    let mut outstanding = 0u64;
    let mut qp_out = vec![0u64; qps.len()];
    let mut client_verified = 0u64;
    let mut client_corrupt = 0u64;
    let mut error: Option<WcStatus> = None;
    let mut wcs = Vec::new();
    let t0 = Instant::now();
    let run_for = Duration::from_secs_f64(p.duration);
    let finished = drive(drv, run_for + Duration::from_secs(30), |d| {
        let ep = d.endpoint();
        wcs.clear();
        let _ = ep.poll_cq(cq, 64, &mut wcs);
        for wc in &wcs {
            if wc.status != WcStatus::Success {
                error.get_or_insert(wc.status);
            }
            let iter = wc.wr_id;
            let ls = lay.client_slot(iter);
            let lat = post_times[ls as usize].elapsed();
            hist.saturating_record(lat.as_nanos().max(1) as u64);
            if p.op == Op::Read && verify && wc.status == WcStatus::Success {
                if let Some(buf) = ep.mr(mr.lkey) {
                    let b = &buf[(ls * size) as usize..((ls + 1) * size) as usize];
                    let bad = check(b, iter % slots);
                    client_corrupt += bad;
                    client_verified += size - bad;
                }
            }
            completed += 1;
            outstanding -= 1;
            qp_out[lay.qp_of(iter)] -= 1;
        }
        if error.is_some() {
            return true;
        }
        let sending = t0.elapsed() < run_for;
        let now = d.now();
        let ep = d.endpoint();
        while sending && outstanding < depth {
            let i = next_iter;
            let ls = lay.client_slot(i);
            let local = Sge {
                lkey: mr.lkey,
                addr: ls * size,
                len: size as u32,
            };
            let remote = RemoteAddr {
                rkey,
                addr: raddr + (i % slots) * size,
            };
            let op = match p.op {
                Op::Write => SendOp::WriteImm(remote, i as u32),
                Op::Read => SendOp::Read(remote),
                Op::Send => SendOp::SendImm(i as u32),
            };
            let j = lay.qp_of(i);
            // Round robin: wait for this QP rather than skip it; its slot
            // for `i` is free once it has fewer than `per_qp` outstanding.
            if qp_out[j] >= lay.per_qp {
                break;
            }
            let qp = qps[j];
            if verify && p.op != Op::Read {
                if let Some(buf) = ep.mr_mut(mr.lkey) {
                    fill(
                        &mut buf[(ls * size) as usize..((ls + 1) * size) as usize],
                        i,
                    );
                }
            }
            if ep.post_send(now, qp, SendWr::new(i, op, local)).is_err() {
                break;
            }
            post_times[ls as usize] = Instant::now();
            next_iter += 1;
            outstanding += 1;
            qp_out[j] += 1;
        }
        !sending && outstanding == 0
    })?;
    let elapsed = t0.elapsed().as_secs_f64();
    if let Some(st) = error {
        link.send(Msg::Abort {
            reason: format!("a work request failed with {st:?}"),
        });
        bail!("a work request failed with {st:?}");
    }
    if !finished {
        link.send(Msg::Abort {
            reason: format!("{outstanding} work requests did not complete"),
        });
        bail!("{outstanding} work requests did not complete");
    }
    link.send(Msg::Done {
        iterations: completed,
    });
    let cs = drv.endpoint().connection_stats(conn).unwrap_or_default();
    // Keep answering until the server is done with its last ACKs.
    let (verified_bytes, corrupt_bytes) =
        match drive_until_msg(drv, link, Duration::from_secs(30), |_| {})? {
            Msg::Result {
                verified_bytes,
                corrupt_bytes,
                ..
            } => {
                if p.op == Op::Read {
                    (client_verified, client_corrupt)
                } else {
                    (verified_bytes, corrupt_bytes)
                }
            }
            m => return Err(unexpected(m, "Result")),
        };
    drive(drv, Duration::from_millis(20), |_| false)?;
    let bytes = completed * size;
    let us = |q: f64| hist.value_at_quantile(q) as f64 / 1000.0;
    Ok(Report {
        op: p.op,
        backend: drv.backend().to_string(),
        msg_size: size,
        qps: p.qps,
        iterations: completed,
        bytes,
        duration_s: elapsed,
        gbps: bytes as f64 * 8.0 / elapsed / 1e9,
        msg_rate_mps: completed as f64 / elapsed / 1e6,
        lat_min_us: hist.min() as f64 / 1000.0,
        lat_p50_us: us(0.5),
        lat_avg_us: hist.mean() / 1000.0,
        lat_p99_us: us(0.99),
        lat_p999_us: us(0.999),
        retransmits: cs.retransmits,
        rto_fires: cs.rto_fires,
        verified_bytes,
        corrupt_bytes,
        paths: cs
            .paths
            .iter()
            .map(|p| PathReport {
                id: p.id,
                src_port: p.src_port,
                packets: p.packets_sent,
                retransmits: p.retransmits,
                lost: p.packets_lost,
                ecn_marks: p.ce_marks,
                rtt_us: p.srtt_ns as f64 / 1000.0,
            })
            .collect(),
    })
}

fn print_report(r: &Report, paths: u8, depth: u32, where_: &str) {
    let line = "-".repeat(86);
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
    println!("{line}");
    println!(" #bytes     #iterations    BW average[Gb/sec]   MsgRate[Mpps]   Retransmits   RTOs");
    println!(
        " {:<10} {:<14} {:<20.3} {:<15.6} {:<13} {}",
        r.msg_size, r.iterations, r.gbps, r.msg_rate_mps, r.retransmits, r.rto_fires
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
    println!(" path  src_port   packets      retransmits  lost     ecn_marks  rtt[usec]");
    for p in &r.paths {
        println!(
            " {:<5} {:<10} {:<12} {:<12} {:<8} {:<10} {:.1}",
            p.id, p.src_port, p.packets, p.retransmits, p.lost, p.ecn_marks, p.rtt_us
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

    #[test]
    fn pattern_catches_misplacement() {
        let mut a = vec![0u8; 100];
        fill(&mut a, 7);
        assert_eq!(check(&a, 7), 0);
        assert!(check(&a, 8) > 0, "another message's bytes are caught");
        let mut shifted = vec![0u8; 100];
        shifted[8..].copy_from_slice(&a[..92]);
        assert!(
            check(&shifted, 7) > 0,
            "bytes at the wrong offset are caught"
        );
    }
}

#[cfg(test)]
mod remote_tests {
    use super::*;

    #[test]
    fn a_client_of_another_version_is_refused() {
        let lo: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let mut drv = bind(lo, 1, 1, Backend::Portable).unwrap();
        let (srv, cli) = Link::pair();
        let opts = RunOpts {
            op: Op::Write,
            size: 1024,
            duration: 0.1,
            depth: 4,
            qps: 1,
            paths: 1,
            no_verify: false,
            json: true,
            backend: Backend::Portable,
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
