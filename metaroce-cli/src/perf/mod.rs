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
mod report;
mod session;
mod stream;

use crate::oob::{
    dial, Acceptor, Budget, Connector, FreshPort, Link, Msg, PerfError, Region, Retry, RunParams,
    VERSION,
};
use anyhow::{bail, Context};
use clap::{Args, Subcommand, ValueEnum};
use metaroce_io::{Backend, Driver, DriverConfig, DriverError};
use metaroce_proto::consts::{DEFAULT_MTU, MAX_MTU, MIN_MTU};
use metaroce_proto::verbs::*;
use metaroce_proto::{Endpoint, EndpointConfig, Event, PathState};
use pattern::{check_at, fill, fill_at};
use report::*;
use serde::{Deserialize, Serialize};
use session::*;
use std::io::Write;
use std::net::{IpAddr, SocketAddr, TcpListener, ToSocketAddrs};
use std::time::{Duration, Instant};
use stream::*;

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
    #[command(flatten)]
    side: SideArgs,
}

/// How a side's driver is set up: the flags the server, the client and the
/// loopback test share.
#[derive(Debug, Args, Clone, Copy)]
struct SideArgs {
    /// Paths each connection sprays over (a server's: its ACKs, READ
    /// responses and `--bidir` stream).
    #[arg(long, default_value_t = metaroce_proto::consts::DEFAULT_PATHS)]
    paths: u8,
    /// I/O backend: auto (io_uring when the kernel has it), io_uring,
    /// portable, or af_xdp (root; never on loopback: give the server a
    /// `--bind` address of an Ethernet interface).
    #[arg(long, default_value = "auto")]
    backend: Backend,
    /// The interface the af_xdp backend attaches to (default: the one that
    /// holds the endpoint's address, which for a client is the interface
    /// of its route to the server).
    #[arg(long, value_name = "NAME")]
    iface: Option<IfaceName>,
    /// Microseconds each side's driver watches for work before it sleeps
    /// (0: it sleeps at once). Each side runs on a thread of its own, and
    /// polling spares the other side the cost of waking it, as perftest
    /// polls its completion queue.
    #[arg(long = "busy-poll", value_name = "US", default_value_t = DEFAULT_BUSY_POLL_US)]
    busy_poll_us: u64,
    /// Largest datagram, UDP payload bytes, 64 of them metaroce's header:
    /// 4160 (the default) carries 4 KiB payloads, RoCE's largest MTU; 8256
    /// carries 8 KiB in a 9000-byte frame. A connection uses the smaller
    /// of the two sides' (the server has `--mtu` too), and a client keeps
    /// within its route's MTU. With `--psk-file` the default is 4184: the
    /// 24 bytes each sealed datagram ends with on top, so that it still
    /// carries 4 KiB.
    #[arg(short = 'm', long, value_name = "BYTES", value_parser = mtu_range())]
    mtu: Option<u16>,
    /// CRC32C trailer on every datagram (end-to-end integrity, in force
    /// when both sides say on): a datagram that fails it is dropped and
    /// recovered like a loss.
    #[arg(long, value_name = "on|off", default_value = "off", value_parser = parse_on_off, action = clap::ArgAction::Set)]
    crc: bool,
    /// Authenticated, encrypted mode: the 32-byte pre-shared key in this
    /// file (both sides need the same). Every datagram is sealed with
    /// AES-128-GCM under keys each connection derives from it; a peer
    /// without it is refused.
    #[arg(long = "psk-file", value_name = "PATH", value_parser = psk_file)]
    psk: Option<metaroce_proto::Psk>,
    /// Fault injection: the fraction of arriving datagrams this side's
    /// driver drops (0.01: 1%), as a lossy network would.
    #[arg(long, value_name = "FRACTION", default_value_t = 0.0, value_parser = fraction)]
    loss: f64,
    /// Fault injection: the fraction of kept datagrams delivered twice.
    #[arg(long, value_name = "FRACTION", default_value_t = 0.0, value_parser = fraction)]
    duplicate: f64,
    /// Fault injection: the fraction of kept datagrams held back 200 µs
    /// (delivered after later ones).
    #[arg(long, value_name = "FRACTION", default_value_t = 0.0, value_parser = fraction)]
    reorder: f64,
}

/// `--psk-file`'s parser: the key in the file.
fn psk_file(path: &str) -> Result<metaroce_proto::Psk, String> {
    metaroce_io::read_psk_file(std::path::Path::new(path)).map_err(|e| e.to_string())
}

/// `on` or `off`.
fn parse_on_off(s: &str) -> Result<bool, String> {
    match s {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => Err(format!("`{s}`: say on or off")),
    }
}

/// A fault fraction: a number within `[0, 1]`.
fn fraction(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(f) if (0.0..=1.0).contains(&f) => Ok(f),
        _ => Err(format!("`{s}`: give a fraction within 0..=1 (0.01 is 1%)")),
    }
}

impl SideArgs {
    /// Refuses flags no driver could take.
    fn check(&self) -> Result<(), PerfError> {
        if self.paths == 0 {
            return Err(PerfError::BadFlags("--paths must be at least 1".into()));
        }
        Ok(())
    }

    /// `--mtu`, or its default: [`DEFAULT_MTU`], plus the AEAD trailer with
    /// a key.
    fn mtu(&self) -> u16 {
        self.mtu.unwrap_or(if self.psk.is_some() {
            DEFAULT_MTU + metaroce_proto::consts::AEAD_TRAILER_LEN as u16
        } else {
            DEFAULT_MTU
        })
    }

    fn tuning(&self) -> Tuning {
        Tuning {
            crc32c: self.crc,
            psk: self.psk,
            iface: self.iface,
            ..Tuning::new(self.paths, self.backend, self.busy_poll_us, self.mtu())
        }
        .with_faults(self.loss, self.duplicate, self.reorder)
    }
}

/// Arguments of `metaroce perf client`.
#[derive(Debug, Args)]
struct ClientArgs {
    /// The server: a host, optionally with :PORT (default port 18515).
    addr: String,
    /// TCP port of the server's control listener (default: PORT).
    #[arg(long)]
    ctrl_port: Option<u16>,
    /// Seconds to keep trying to reach the server's control listener and
    /// exchange a run's setup with it. An attempt whose connect or
    /// exchange times out (after 1 s, then a quarter longer each time, 4 s
    /// at most) is tried again from a new TCP source port, so another
    /// ECMP hash and likely another path past a silently broken one; on
    /// failure the error lists every attempt.
    #[arg(long, value_name = "SECONDS", default_value = "10", value_parser = parse_timeout)]
    connect_timeout: Duration,
    #[command(flatten)]
    opts: RunOpts,
}

/// `--connect-timeout`'s parser: positive seconds, at most an hour.
fn parse_timeout(s: &str) -> Result<Duration, String> {
    let secs: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("invalid number of seconds `{s}`"))?;
    if !(secs > 0.0 && secs <= 3600.0) {
        return Err(format!(
            "`{s}`: give a positive number of seconds, at most 3600"
        ));
    }
    Ok(Duration::from_secs_f64(secs))
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
    /// Interval rates, iperf3's `-i`: the goodput of the client's own
    /// stream in each interval of this many seconds (rounded to 0.1 s),
    /// a line each in the report; `--json` has them in `intervals`
    /// always, every second unless this says otherwise.
    #[arg(short = 'i', long, value_name = "SECS")]
    interval: Option<f64>,
    #[command(flatten)]
    side: SideArgs,
    /// Every message size from 2 bytes to 8 MiB, powers of two, one run
    /// each of `-D` seconds (perftest's `-a`), instead of `-s`: a row per
    /// size, or with `--json` one object per line. Against a server, each
    /// size is a run of its own (a server started with `--once` serves the
    /// first only). Sizes whose slots would not fit the server's 1 GiB
    /// region (a deep `-t`) are left out.
    #[arg(short = 'a', long, conflicts_with = "size")]
    all: bool,
}

/// The sizes `--all` runs: 2 bytes to 8 MiB, perftest's `-a`.
const ALL_SIZES: std::ops::RangeInclusive<u32> = 1..=23;

/// What `--mtu` takes: what an endpoint accepts.
fn mtu_range() -> clap::builder::RangedI64ValueParser<u16> {
    clap::value_parser!(u16).range(i64::from(MIN_MTU)..=i64::from(MAX_MTU))
}

/// `--busy-poll`'s default: 50 µs (`docs/BENCHMARKS.md`, session 14).
const DEFAULT_BUSY_POLL_US: u64 = 50;

impl RunOpts {
    /// The message sizes to run, in order: with `--all` those whose slots
    /// fit the server's region (a deep queue leaves the largest out).
    fn sizes(&self) -> Vec<u64> {
        if self.all {
            ALL_SIZES
                .map(|k| 1u64 << k)
                .take_while(|&size| region_fits(&self.with_size(size).params()))
                .collect()
        } else {
            vec![self.size]
        }
    }

    /// These options for one of [`sizes`](Self::sizes).
    fn with_size(&self, size: u64) -> RunOpts {
        RunOpts {
            size,
            ..self.clone()
        }
    }

    /// Refuses flags no run could take, before any runs.
    fn check(&self) -> anyhow::Result<()> {
        self.side.check()?;
        if let Some(i) = self.interval {
            if !(i >= 0.1 && i.is_finite()) {
                return Err(
                    PerfError::BadFlags(format!("--interval {i}: at least 0.1 seconds")).into(),
                );
            }
        }
        let sizes = self.sizes();
        // `--all` with a queue too deep for even its smallest size: what
        // that size says is wrong.
        for size in sizes.iter().copied().chain(sizes.is_empty().then_some(2)) {
            validate(&self.with_size(size).params())?;
        }
        Ok(())
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
    if !region_fits(p) {
        return Err(PerfError::BadFlags(format!(
            "{} slots of {} bytes exceed the server's {} MiB region limit",
            Layout::new(p).slots,
            p.size,
            MAX_REGION >> 20
        )));
    }
    Ok(())
}

/// Whether the server's region for a run (its slots of the run's size)
/// stays within [`MAX_REGION`].
fn region_fits(p: &RunParams) -> bool {
    Layout::new(p).slots.saturating_mul(p.size.max(1)) <= MAX_REGION
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

/// Runs `metaroce perf`: the loopback test, a server or a client.
pub fn run(args: PerfArgs) -> anyhow::Result<()> {
    match args.mode {
        None => run_loopback(args.opts),
        Some(Mode::Server(s)) => run_server(s),
        Some(Mode::Client(c)) => run_client(c),
    }
}

/// The loopback test: a server and a client endpoint in one process, a run
/// for each size.
fn run_loopback(opts: RunOpts) -> anyhow::Result<()> {
    opts.check()?;
    let mut out = Output::new(&opts, "loopback".into());
    for size in opts.sizes() {
        out.show(loopback_run(&opts.with_size(size))?)?;
    }
    out.finish()
}

/// One loopback run: fresh endpoints, a connection, the data phase.
fn loopback_run(opts: &RunOpts) -> anyhow::Result<Report> {
    let lo: SocketAddr = "127.0.0.1:0".parse()?;
    let tuning = opts.side.tuning();
    let mut server_drv = bind(lo, tuning, 1).context("binding the server")?;
    let server_ip = server_drv.local_addr().ip();
    let mut client = bind(lo, tuning, 2).context("binding the client")?;
    let (srv_link, cli_link) = Link::pair();
    std::thread::scope(|s| -> anyhow::Result<Report> {
        let srv = s.spawn(move || {
            let r = serve_run(&mut server_drv, &srv_link, None);
            drop(srv_link);
            r
        });
        let rep = client_run(
            opts,
            &mut client,
            &cli_link,
            server_ip,
            Budget::fixed(SETUP),
        );
        let sres = srv
            .join()
            .map_err(|_| anyhow::anyhow!("server thread panicked"))?;
        match (rep, sres) {
            (Ok(r), Ok(_)) => Ok(r),
            (Err(e), _) | (Ok(_), Err(e)) => Err(e),
        }
    })
}

/// Prints reports as runs end: perftest's report for one run; with
/// `--all` its header once and a row per size; with `--json` an object
/// per run, a line each. Corrupt bytes fail the command.
struct Output {
    json: bool,
    all: bool,
    paths: u8,
    depth: u32,
    where_: String,
    shown: usize,
    verified: u64,
    corrupt: u64,
}

impl Output {
    fn new(opts: &RunOpts, where_: String) -> Output {
        Output {
            json: opts.json,
            all: opts.all,
            paths: opts.side.paths,
            depth: opts.depth,
            where_,
            shown: 0,
            verified: 0,
            corrupt: 0,
        }
    }

    /// Prints one run's report (it stops the runs if bytes were corrupt).
    fn show(&mut self, rep: Report) -> anyhow::Result<()> {
        if self.json {
            println!("{}", serde_json::to_string(&rep)?);
        } else if !self.all {
            print_report(&rep, self.paths, self.depth, &self.where_);
        } else {
            if self.shown == 0 {
                print_header(&rep, self.paths, self.depth, &self.where_);
            }
            print_rows(&rep);
        }
        let _ = std::io::stdout().flush();
        self.shown += 1;
        self.verified += rep.verified_bytes;
        self.corrupt += rep.corrupt_bytes;
        if rep.corrupt_bytes > 0 {
            bail!(
                "{} corrupt bytes in the run of {}-byte messages",
                rep.corrupt_bytes,
                rep.msg_size
            );
        }
        Ok(())
    }

    /// After the last run: `--all`'s totals.
    fn finish(self) -> anyhow::Result<()> {
        if self.all && !self.json {
            print_totals(self.shown, self.verified, self.corrupt);
        }
        Ok(())
    }
}

/// `metaroce perf server`: binds, prints where, serves runs one at a time.
fn run_server(a: ServerArgs) -> anyhow::Result<()> {
    a.side.check()?;
    let mut drv = bind(a.bind, a.side.tuning(), 1)?;
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
    match drv.xdp_info() {
        Some(x) => writeln!(out, "metaroce perf server: {} backend ({x})", drv.backend())?,
        None => writeln!(out, "metaroce perf server: {} backend", drv.backend())?,
    }
    out.flush()?;
    serve(&mut drv, Acceptor::spawn(listener)?, a.once)
}

/// A control connection that has not said `Hello` within this long gives
/// way to another one waiting (a live client says it at once).
const HELLO_GRACE: Duration = Duration::from_secs(3);

/// The server's loop: runs one at a time, from the connections `acceptor`
/// takes. A client that left before its run started (it retried on a new
/// connection, see [`Link::watch`]) is not a run, even with `once`.
fn serve(drv: &mut Driver, acceptor: Acceptor, once: bool) -> anyhow::Result<()> {
    loop {
        let (stream, peer) = acceptor.next()?;
        let link = match Link::tcp(stream) {
            Ok(l) => l,
            Err(e) => {
                // Reset before we got to it.
                eprintln!("metaroce perf server: control connection from {peer}: {e}");
                continue;
            }
        };
        let acc = acceptor.clone();
        link.watch(move |heard, age| {
            acc.newer_from(peer.ip()).or_else(|| {
                (!heard && age >= HELLO_GRACE)
                    .then(|| acc.waiting())
                    .flatten()
            })
        });
        let r = serve_run(drv, &link, Some(peer.ip()));
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
                if once {
                    let corrupt = r.corrupt_bytes + o.sent.map_or(0, |d| d.corrupt_bytes);
                    if corrupt > 0 {
                        bail!("{corrupt} corrupt bytes");
                    }
                    return Ok(());
                }
            }
            Err(e) if matches!(e.downcast_ref(), Some(PerfError::Abandoned(_))) => {
                tracing::warn!("control connection from {peer}: {e:#}");
            }
            Err(e) if once => return Err(e),
            Err(e) => eprintln!("metaroce perf server: run from {peer} failed: {e:#}"),
        }
        let _ = std::io::stdout().flush();
    }
}

/// `metaroce perf client`: reaches the server over TCP, runs, reports; with
/// `--all`, a run for each size.
fn run_client(c: ClientArgs) -> anyhow::Result<()> {
    run_client_with(c, &mut FreshPort)
}

/// [`run_client`], its control connections opened by `connector`.
fn run_client_with(c: ClientArgs, connector: &mut dyn Connector) -> anyhow::Result<()> {
    let opts = c.opts;
    opts.check()?;
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
    // Datagrams must fit the route: a 1500-byte network gets 1472-byte ones.
    let route_mtu = metaroce_io::max_udp_payload(addr).ok();
    let retry = Retry::within(c.connect_timeout);
    let mut out = Output::new(&opts, format!("remote {}", c.addr));
    for size in opts.sizes() {
        let run = opts.with_size(size);
        // Each attempt: a control connection, a fresh endpoint (so new UDP
        // ports too), the setup exchange. A stalled one is dropped whole.
        let (mut drv, link, ready) = dial(addr, &c.addr, &retry, connector, |stream, budget| {
            let local_ip = stream.local_addr()?.ip();
            let link = Link::tcp(stream)?;
            let mut drv = bind_mtu(
                SocketAddr::new(local_ip, 0),
                run.side.tuning(),
                2,
                route_mtu,
            )
            .context("binding the client")?;
            let ready = client_setup(&run, &mut drv, &link, addr.ip(), budget)?;
            Ok((drv, link, ready))
        })?;
        out.show(client_measure(&run, &mut drv, &link, ready)?)?;
    }
    out.finish()
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
    use crate::oob::tests::net::{all_different, blackhole, silent, Detour};
    use crate::oob::{read_msg, write_msg};
    use std::net::TcpStream;

    /// Short runs of 1 KiB WRITEs on one path, on the portable backend.
    fn short_opts() -> RunOpts {
        RunOpts {
            op: Op::Write,
            size: 1024,
            duration: 0.1,
            depth: 4,
            qps: 1,
            no_verify: false,
            bidir: false,
            json: true,
            interval: None,
            side: SideArgs {
                paths: 1,
                backend: Backend::Portable,
                iface: None,
                busy_poll_us: 0,
                mtu: None,
                crc: false,
                psk: None,
                loss: 0.0,
                duplicate: 0.0,
                reorder: 0.0,
            },
            all: false,
        }
    }

    /// A `perf server --once` on loopback, on a thread: its control address
    /// and the thread (its result: the run's).
    fn server_once() -> (SocketAddr, std::thread::JoinHandle<anyhow::Result<()>>) {
        let lo: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let mut drv = bind(lo, short_opts().side.tuning(), 1).unwrap();
        let l = TcpListener::bind(lo).unwrap();
        let ctrl = l.local_addr().unwrap();
        let acc = Acceptor::spawn(l).unwrap();
        (ctrl, std::thread::spawn(move || serve(&mut drv, acc, true)))
    }

    fn client_of(ctrl: SocketAddr) -> ClientArgs {
        ClientArgs {
            addr: ctrl.to_string(),
            ctrl_port: None,
            connect_timeout: Duration::from_secs(10),
            opts: short_opts(),
        }
    }

    #[test]
    fn a_client_retries_past_blackholed_connects_then_runs_against_the_server() {
        let (_bh, _filler, hole) = blackhole();
        let (ctrl, srv) = server_once();
        let mut c = Detour {
            first: vec![hole, hole],
            ..Detour::default()
        };
        run_client_with(client_of(ctrl), &mut c).unwrap();
        assert_eq!(c.to, [hole, hole, ctrl]);
        assert!(all_different(&c.ports), "{:?}", c.ports);
        srv.join().unwrap().unwrap();
    }

    #[test]
    fn a_client_whose_exchange_stalls_reconnects_and_runs() {
        let (quiet, seen) = silent();
        let (ctrl, srv) = server_once();
        let mut c = Detour {
            first: vec![quiet],
            ..Detour::default()
        };
        run_client_with(client_of(ctrl), &mut c).unwrap();
        assert_eq!(c.to, [quiet, ctrl]);
        assert!(all_different(&c.ports), "{:?}", c.ports);
        assert_eq!(*seen.lock().unwrap(), [c.ports[0].unwrap()]);
        srv.join().unwrap().unwrap();
    }

    #[test]
    fn the_server_leaves_a_stalled_control_connection_for_the_clients_new_one() {
        let (ctrl, srv) = server_once();
        // A client that said Hello, got its Welcome, and went silent (its
        // path died): the server waits for its QPs ...
        let mut old = TcpStream::connect(ctrl).unwrap();
        write_msg(
            &mut old,
            &Msg::Hello {
                version: VERSION,
                params: short_opts().params(),
            },
        )
        .unwrap();
        assert!(matches!(read_msg(&mut old), Ok(Some(Msg::Welcome { .. }))));
        // ... until the same host comes back on a new connection: served
        // at once, not after the server's 10 s, and it is the `--once` run.
        let t0 = Instant::now();
        run_client_with(client_of(ctrl), &mut Detour::default()).unwrap();
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
        srv.join().unwrap().unwrap();
    }

    #[test]
    fn a_connection_silent_past_the_grace_gives_way_to_another_host() {
        let (ctrl, srv) = server_once();
        // Another host (127.0.0.2 is loopback too) connects and says nothing.
        let other =
            socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        other
            .bind(&SocketAddr::from(([127, 0, 0, 2], 0)).into())
            .unwrap();
        other.connect(&ctrl.into()).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        let t0 = Instant::now();
        let mut c = Detour::default();
        run_client_with(client_of(ctrl), &mut c).unwrap();
        let took = t0.elapsed();
        assert!(took < HELLO_GRACE + Duration::from_secs(3), "{took:?}");
        srv.join().unwrap().unwrap();
    }

    #[test]
    fn a_server_that_closes_right_after_its_result_ends_the_run_cleanly() {
        // The server's `Result` and its close reach the client at once (a
        // loaded host, a `--once` server exiting): the run is complete,
        // not "the peer closed the control connection".
        for op in [Op::Write, Op::Read] {
            let opts = RunOpts { op, ..short_opts() };
            let lo: SocketAddr = "127.0.0.1:0".parse().unwrap();
            let mut server_drv = bind(lo, opts.side.tuning(), 1).unwrap();
            let server_ip = server_drv.local_addr().ip();
            let mut client = bind(lo, opts.side.tuning(), 2).unwrap();
            let (srv_link, to_srv) = Link::pair();
            let (to_cli, cli_link) = Link::pair();
            let srv = std::thread::spawn(move || serve_run(&mut server_drv, &srv_link, None));
            // Between them: passes every message on, and closes the
            // client's side in the same breath as it passes the `Result`.
            let proxy = std::thread::spawn(move || {
                let mut to_cli = Some(to_cli);
                loop {
                    match to_srv.try_recv() {
                        Ok(Some(m)) => {
                            let last = matches!(m, Msg::Result { .. });
                            if let Some(c) = &to_cli {
                                c.send(m);
                            }
                            if last {
                                to_cli = None;
                            }
                        }
                        Ok(None) => {}
                        Err(_) => return,
                    }
                    if let Some(c) = &to_cli {
                        match c.try_recv() {
                            Ok(Some(m)) => to_srv.send(m),
                            Ok(None) => {}
                            Err(_) => return,
                        }
                    }
                    std::thread::sleep(Duration::from_micros(100));
                }
            });
            let rep = client_run(
                &opts,
                &mut client,
                &cli_link,
                server_ip,
                Budget::fixed(SETUP),
            )
            .unwrap_or_else(|e| panic!("{op:?}: {e:#}"));
            assert!(rep.iterations > 0 && rep.corrupt_bytes == 0, "{op:?}");
            srv.join().unwrap().unwrap();
            drop(cli_link);
            proxy.join().unwrap();
        }
    }

    #[test]
    fn a_client_of_another_version_is_refused() {
        let lo: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let mut drv = bind(lo, Tuning::new(1, Backend::Portable, 0, DEFAULT_MTU), 1).unwrap();
        let (srv, cli) = Link::pair();
        let opts = short_opts();
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
