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

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};
use metaroce_io::{Backend, Driver, DriverConfig};
use metaroce_proto::verbs::*;
use metaroce_proto::{EndpointConfig, Event};
use serde::Serialize;
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The operation to measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Op {
    /// RDMA WRITE (with immediate, so the server verifies each message).
    Write,
    /// RDMA READ (the client verifies each message).
    Read,
    /// SEND/RECV (the server verifies each message).
    Send,
}

/// Arguments of `metaroce perf`.
#[derive(Debug, Args)]
pub struct PerfArgs {
    /// Operation.
    #[arg(long, value_enum, default_value_t = Op::Write)]
    op: Op,
    /// Message size in bytes (suffixes K, M, G allowed).
    #[arg(short = 's', long, default_value = "64K", value_parser = parse_size)]
    size: u64,
    /// Test duration in seconds.
    #[arg(short = 'D', long, default_value_t = 2.0)]
    duration: f64,
    /// Outstanding work requests (perftest's tx depth).
    #[arg(short = 't', long = "tx-depth", default_value_t = 16)]
    depth: u32,
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

/// Out-of-band exchange between the two sides (as rdma_cm's private data would).
#[derive(Debug, Clone, Copy)]
struct ServerInfo {
    qpn: Qpn,
    rkey: u32,
    addr: u64,
    slots: u64,
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

fn bind(paths: u8, seed: u64, backend: Backend) -> anyhow::Result<Driver> {
    let mut cfg = DriverConfig::new("127.0.0.1:0".parse()?);
    cfg.backend = backend;
    cfg.endpoint = endpoint_config(paths);
    cfg.send_sockets = 2 * usize::from(paths);
    cfg.seed = seed;
    Ok(Driver::bind(cfg)?)
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

/// The loopback server: accepts one connection, exposes a region, verifies.
fn server(
    args: &PerfArgs,
    mut drv: Driver,
    to_client: mpsc::Sender<ServerInfo>,
    from_client: mpsc::Receiver<Qpn>,
    client_done: mpsc::Receiver<u64>,
) -> anyhow::Result<ServerResult> {
    let setup = Duration::from_secs(10);
    let mut conn = None;
    drive(&mut drv, setup, |d| {
        while let Some(e) = d.endpoint().poll_event() {
            if let Event::Incoming { conn: c, .. } = e {
                conn = Some(c);
            }
        }
        conn.is_some()
    })?;
    let conn = conn.context("no client connected")?;
    let size = args.size;
    let slots = u64::from(args.depth) * 2;
    let ep = drv.endpoint();
    let pd = ep.alloc_pd();
    let cq = ep.create_cq(slots as usize * 2);
    let mr = ep.reg_mr(
        pd,
        vec![0u8; (slots * size).max(1) as usize].into_boxed_slice(),
        0x1000_0000,
        AccessFlags::ALL,
    )?;
    let mut init = QpInit::new(pd, cq, cq);
    init.max_recv_wr = slots as u32;
    let qp = ep.create_qp(init)?;
    let client_qpn = from_client
        .recv_timeout(setup)
        .context("client QP number not received")?;
    ep.connect_qp(qp, conn, client_qpn)?;
    if args.op == Op::Read {
        // The client reads slots; each slot holds the pattern of its index.
        let buf = ep.mr_mut(mr.lkey).context("region vanished")?;
        for s in 0..slots {
            fill(&mut buf[(s * size) as usize..((s + 1) * size) as usize], s);
        }
    } else {
        for i in 0..slots {
            ep.post_recv(qp, recv_wr(args.op, &mr, i, slots, size))?;
        }
    }
    to_client
        .send(ServerInfo {
            qpn: qp,
            rkey: mr.rkey,
            addr: mr.addr,
            slots,
        })
        .ok();
    let mut res = ServerResult::default();
    let mut expected: Option<u64> = None;
    let mut wcs = Vec::new();
    let limit = Duration::from_secs_f64(args.duration + 30.0);
    let verify = !args.no_verify;
    let mut posted = slots;
    let ok = drive(&mut drv, limit, |d| {
        if expected.is_none() {
            if let Ok(n) = client_done.try_recv() {
                expected = Some(n);
            }
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
            if verify {
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
            let _ = ep.post_recv(qp, recv_wr(args.op, &mr, posted, slots, size));
            posted += 1;
        }
        args.op == Op::Read && expected.is_some() || expected.is_some_and(|n| res.messages >= n)
    })?;
    if !ok {
        bail!(
            "server: not every message arrived ({} of {:?})",
            res.messages,
            expected
        );
    }
    // Let the last ACKs go out.
    drive(&mut drv, Duration::from_millis(20), |_| false)?;
    Ok(res)
}

fn recv_wr(op: Op, mr: &MrInfo, i: u64, slots: u64, size: u64) -> RecvWr {
    let sge = match op {
        // WRITE_IMM lands by address; the receive only carries the immediate.
        Op::Write => Sge::default(),
        _ => Sge {
            lkey: mr.lkey,
            addr: mr.addr + (i % slots) * size,
            len: size as u32,
        },
    };
    RecvWr { wr_id: i, sge }
}

/// Runs the loopback test and prints the report.
pub fn run(args: PerfArgs) -> anyhow::Result<()> {
    if args.depth == 0 || args.paths == 0 {
        bail!("--tx-depth and --paths must be at least 1");
    }
    if args.duration <= 0.0 || !args.duration.is_finite() {
        bail!("--duration must be a positive number of seconds");
    }
    let server_drv = bind(args.paths, 1, args.backend).context("binding the server")?;
    let server_addr = server_drv.local_addr();
    let mut client = bind(args.paths, 2, args.backend).context("binding the client")?;
    let (info_tx, info_rx) = mpsc::channel();
    let (qpn_tx, qpn_rx) = mpsc::channel();
    let (done_tx, done_rx) = mpsc::channel();
    let res = std::thread::scope(|s| -> anyhow::Result<(Report, ServerResult)> {
        let a = &args;
        let srv = s.spawn(move || server(a, server_drv, info_tx, qpn_rx, done_rx));
        let rep = client_side(a, &mut client, server_addr, info_rx, qpn_tx, done_tx);
        let sres = srv
            .join()
            .map_err(|_| anyhow::anyhow!("server thread panicked"))??;
        Ok((rep?, sres))
    });
    let (mut rep, sres) = res?;
    if args.op != Op::Read {
        rep.verified_bytes = sres.verified_bytes;
        rep.corrupt_bytes = sres.corrupt_bytes;
    }
    if args.json {
        println!("{}", serde_json::to_string(&rep)?);
    } else {
        print_report(&rep, args.paths, args.depth);
    }
    if rep.corrupt_bytes > 0 {
        bail!("{} corrupt bytes", rep.corrupt_bytes);
    }
    Ok(())
}

fn client_side(
    args: &PerfArgs,
    drv: &mut Driver,
    server_addr: std::net::SocketAddr,
    from_server: mpsc::Receiver<ServerInfo>,
    to_server: mpsc::Sender<Qpn>,
    done: mpsc::Sender<u64>,
) -> anyhow::Result<Report> {
    let setup = Duration::from_secs(10);
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
    let size = args.size;
    let depth = u64::from(args.depth);
    let ep = drv.endpoint();
    let pd = ep.alloc_pd();
    let cq = ep.create_cq(depth as usize * 2);
    let mr = ep.reg_mr(
        pd,
        vec![0u8; (depth * size).max(1) as usize].into_boxed_slice(),
        0,
        AccessFlags::LOCAL_WRITE,
    )?;
    let mut init = QpInit::new(pd, cq, cq);
    init.max_send_wr = args.depth.max(1);
    let qp = ep.create_qp(init)?;
    to_server.send(qp).ok();
    let info = from_server
        .recv_timeout(setup)
        .context("server did not expose its region")?;
    drv.endpoint().connect_qp(qp, conn, info.qpn)?;

    let verify = !args.no_verify;
    let mut hist = hdrhistogram::Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3)?;
    let mut post_times = vec![Instant::now(); depth as usize];
    let mut next_iter = 0u64;
    let mut completed = 0u64;
    let mut outstanding = 0u64;
    let mut client_verified = 0u64;
    let mut client_corrupt = 0u64;
    let mut error: Option<WcStatus> = None;
    let mut wcs = Vec::new();
    let t0 = Instant::now();
    let run_for = Duration::from_secs_f64(args.duration);
    let finished = drive(drv, run_for + Duration::from_secs(30), |d| {
        let ep = d.endpoint();
        wcs.clear();
        let _ = ep.poll_cq(cq, 64, &mut wcs);
        for wc in &wcs {
            if wc.status != WcStatus::Success {
                error.get_or_insert(wc.status);
            }
            let iter = wc.wr_id;
            let lat = post_times[(iter % depth) as usize].elapsed();
            hist.saturating_record(lat.as_nanos().max(1) as u64);
            if args.op == Op::Read && verify && wc.status == WcStatus::Success {
                if let Some(buf) = ep.mr(mr.lkey) {
                    let slot = iter % depth;
                    let b = &buf[(slot * size) as usize..((slot + 1) * size) as usize];
                    let bad = check(b, iter % info.slots);
                    client_corrupt += bad;
                    client_verified += size - bad;
                }
            }
            completed += 1;
            outstanding -= 1;
        }
        if error.is_some() {
            return true;
        }
        let sending = t0.elapsed() < run_for;
        let now = d.now();
        let ep = d.endpoint();
        while sending && outstanding < depth {
            let i = next_iter;
            let slot = i % depth;
            let local = Sge {
                lkey: mr.lkey,
                addr: slot * size,
                len: size as u32,
            };
            if verify && args.op != Op::Read {
                if let Some(buf) = ep.mr_mut(mr.lkey) {
                    fill(
                        &mut buf[(slot * size) as usize..((slot + 1) * size) as usize],
                        i,
                    );
                }
            }
            let remote = RemoteAddr {
                rkey: info.rkey,
                addr: info.addr + (i % info.slots) * size,
            };
            let op = match args.op {
                Op::Write => SendOp::WriteImm(remote, i as u32),
                Op::Read => SendOp::Read(remote),
                Op::Send => SendOp::SendImm(i as u32),
            };
            if ep.post_send(now, qp, SendWr::new(i, op, local)).is_err() {
                break;
            }
            post_times[slot as usize] = Instant::now();
            next_iter += 1;
            outstanding += 1;
        }
        !sending && outstanding == 0
    })?;
    let elapsed = t0.elapsed().as_secs_f64();
    if let Some(st) = error {
        bail!("a work request failed with {st:?}");
    }
    if !finished {
        bail!("{outstanding} work requests did not complete");
    }
    done.send(completed).ok();
    let cs = drv.endpoint().connection_stats(conn).unwrap_or_default();
    // Keep answering until the server is done with its last ACKs.
    drive(drv, Duration::from_millis(50), |_| false)?;
    let bytes = completed * size;
    let us = |q: f64| hist.value_at_quantile(q) as f64 / 1000.0;
    Ok(Report {
        op: args.op,
        backend: drv.backend().to_string(),
        msg_size: size,
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
        verified_bytes: client_verified,
        corrupt_bytes: client_corrupt,
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

fn print_report(r: &Report, paths: u8, depth: u32) {
    let line = "-".repeat(86);
    let name = match r.op {
        Op::Write => "RDMA_Write",
        Op::Read => "RDMA_Read",
        Op::Send => "Send",
    };
    println!("{line}");
    println!(
        "                    {name} BW Test (metaroce, loopback, {} backend)",
        r.backend
    );
    println!(" Number of qps   : 1\t\tPaths per connection : {paths}");
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
