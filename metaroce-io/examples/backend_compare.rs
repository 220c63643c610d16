//! Loopback WRITE throughput of each backend, measured in the same run.
//!
//! ```text
//! cargo run --release -p metaroce-io --example backend_compare [-- SECONDS [ROUNDS]]
//! ```
//!
//! A server and a client endpoint, each on its own thread and sockets on
//! 127.0.0.1, stream RDMA WRITEs (16 outstanding, 8 paths, GSO up to 16
//! datagrams): 64 KiB messages on the portable and the io_uring backend,
//! then 1 MiB messages on io_uring with zero copy on and off. Runs alternate
//! (A B A B ...) so that a noisy shared machine disturbs both sides alike;
//! the ratios of the same run are what to compare.

use metaroce_io::{Backend, Driver, DriverConfig, DriverStats};
use metaroce_proto::verbs::*;
use metaroce_proto::{EndpointConfig, Event};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

const DEPTH: u64 = 16;
const PATHS: u8 = 8;

type Result<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

fn config(backend: Backend, zero_copy: bool) -> DriverConfig {
    let mut c = DriverConfig::new("127.0.0.1:0".parse().unwrap());
    c.endpoint = EndpointConfig {
        paths: PATHS,
        ..EndpointConfig::default()
    };
    c.send_sockets = usize::from(PATHS);
    c.max_gso_segments = 16;
    c.backend = backend;
    c.uring.zero_copy = zero_copy;
    c
}

/// One result.
#[derive(Debug, Clone, Copy)]
struct Run {
    gbps: f64,
    client: DriverStats,
    retransmits: u64,
}

/// Pins the calling thread to the first (`0`) or second (`1`) CPU this
/// process may use, where there are two: one core per side, so that the
/// scheduler does not now and then put both on one core and halve a run.
fn pin(side: usize) {
    if let Some(ids) = core_affinity::get_core_ids() {
        if ids.len() >= 2 {
            core_affinity::set_for_current(ids[side]);
        }
    }
}

/// Streams WRITEs of `msg` bytes for `secs` and returns the throughput.
fn stream(backend: Backend, msg: usize, secs: f64, zero_copy: bool) -> Result<Run> {
    pin(0);
    let server = Driver::bind(config(backend, zero_copy))?;
    let mut client = Driver::bind(config(backend, zero_copy))?;
    let server_addr = server.local_addr();
    let (qpn_tx, qpn_rx) = mpsc::channel::<Qpn>();
    let (info_tx, info_rx) = mpsc::channel::<(Qpn, u32, u64)>();
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = stop.clone();
    let srv = std::thread::spawn(move || -> Result<()> {
        pin(1);
        let mut d = server;
        let t0 = Instant::now();
        let conn = loop {
            if t0.elapsed() > Duration::from_secs(10) {
                return Err(format!("no client: {:?}", d.stats()).into());
            }
            d.poll(Duration::from_millis(1))?;
            if let Some(Event::Incoming { conn, .. }) = d.endpoint().poll_event() {
                break conn;
            }
        };
        let ep = d.endpoint();
        let pd = ep.alloc_pd();
        let cq = ep.create_cq(64);
        let mr = ep.reg_mr(
            pd,
            RegionBuf::zeroed(DEPTH as usize * msg),
            0x1000_0000,
            AccessFlags::REMOTE_WRITE,
        )?;
        let qp = ep.create_qp(QpInit::new(pd, cq, cq))?;
        let peer = qpn_rx.recv_timeout(Duration::from_secs(10))?;
        ep.connect_qp(qp, conn, peer)?;
        info_tx.send((qp, mr.rkey, mr.addr))?;
        while !stop2.load(Ordering::Relaxed) {
            d.poll(Duration::from_millis(1))?;
        }
        // Let the last ACKs go out.
        let t = Instant::now();
        while t.elapsed() < Duration::from_millis(20) {
            d.poll(Duration::from_millis(1))?;
        }
        Ok(())
    });

    let now = client.now();
    let conn = client.endpoint().connect(now, server_addr)?;
    let t0 = Instant::now();
    loop {
        if t0.elapsed() > Duration::from_secs(10) {
            return Err("no answer".into());
        }
        client.poll(Duration::from_millis(1))?;
        match client.endpoint().poll_event() {
            Some(Event::Connected(c)) if c == conn => break,
            Some(Event::ConnectionLost { error, .. }) => {
                return Err(format!("{error}: client {:?}", client.stats()).into())
            }
            _ => {}
        }
    }
    let ep = client.endpoint();
    let pd = ep.alloc_pd();
    let cq = ep.create_cq(64);
    let src = ep.reg_mr(
        pd,
        RegionBuf::copy_of(&vec![0x5au8; DEPTH as usize * msg]),
        0,
        AccessFlags::NONE,
    )?;
    let qp = ep.create_qp(QpInit::new(pd, cq, cq))?;
    qpn_tx.send(qp)?;
    let (peer, rkey, raddr) = info_rx.recv_timeout(Duration::from_secs(10))?;
    client.endpoint().connect_qp(qp, conn, peer)?;

    let mut wcs = Vec::new();
    let (mut next, mut outstanding, mut done_bytes) = (0u64, 0u64, 0u64);
    let warmup = Duration::from_millis(300);
    let run_for = warmup + Duration::from_secs_f64(secs);
    let start = Instant::now();
    let mut measured: Option<(Instant, u64)> = None;
    loop {
        let el = start.elapsed();
        if measured.is_none() && el >= warmup {
            measured = Some((Instant::now(), done_bytes));
        }
        if el >= run_for {
            break;
        }
        let now = client.now();
        let ep = client.endpoint();
        while outstanding < DEPTH {
            let slot = next % DEPTH;
            let wr = SendWr::new(
                next,
                SendOp::Write(RemoteAddr {
                    rkey,
                    addr: raddr + slot * msg as u64,
                }),
                Sge {
                    lkey: src.lkey,
                    addr: slot * msg as u64,
                    len: msg as u32,
                },
            );
            if ep.post_send(now, qp, wr).is_err() {
                break;
            }
            next += 1;
            outstanding += 1;
        }
        client.poll(Duration::from_millis(1))?;
        wcs.clear();
        client.endpoint().poll_cq(cq, 64, &mut wcs)?;
        for wc in &wcs {
            if wc.status != WcStatus::Success {
                stop.store(true, Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(50));
                return Err(format!(
                    "{backend} WRITE failed: {:?} after {:?}; client {:?}",
                    wc.status,
                    start.elapsed(),
                    client.stats()
                )
                .into());
            }
            outstanding -= 1;
            done_bytes += msg as u64;
        }
    }
    let (t_meas, b0) = measured.ok_or("no measurement window")?;
    let gbps = (done_bytes - b0) as f64 * 8.0 / t_meas.elapsed().as_secs_f64() / 1e9;
    let retransmits = client
        .endpoint()
        .connection_stats(conn)
        .map_or(0, |s| s.retransmits);
    let stats = client.stats();
    stop.store(true, Ordering::Relaxed);
    // Drain the outstanding WRITEs so that the server is not torn down mid-flight.
    let t = Instant::now();
    while outstanding > 0 && t.elapsed() < Duration::from_secs(5) {
        client.poll(Duration::from_millis(1))?;
        wcs.clear();
        client.endpoint().poll_cq(cq, 64, &mut wcs)?;
        outstanding -= wcs.len() as u64;
    }
    srv.join().map_err(|_| "server panicked")??;
    Ok(Run {
        gbps,
        client: stats,
        retransmits,
    })
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .init();
    let mut args = std::env::args().skip(1);
    let secs: f64 = args.next().map_or(Ok(2.5), |s| s.parse())?;
    let rounds: usize = args.next().map_or(Ok(2), |s| s.parse())?;
    if let Err(why) = metaroce_io::uring_probe() {
        println!("skipped: io_uring unavailable: {why}");
        let r = stream(Backend::Portable, 64 << 10, secs, false)?;
        println!("portable  64 KiB WRITE: {:.2} Gbit/s", r.gbps);
        return Ok(());
    }
    println!(
        "loopback WRITE, {DEPTH} outstanding, {PATHS} paths, {secs} s per run, {rounds} rounds"
    );
    let line = |label: &str, r: &Run| {
        println!(
            "  {label:<28} {:>7.2} Gbit/s  retransmits {:>5}  gso sends {:>7}  zc sends {:>6} (copied {})  submits {}",
            r.gbps,
            r.retransmits,
            r.client.gso_sends,
            r.client.zero_copy_sends,
            r.client.zero_copy_copied,
            r.client.submits
        )
    };
    let (mut p, mut u) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        println!("round {}", round + 1);
        let a = stream(Backend::Portable, 64 << 10, secs, false)?;
        line("portable  64 KiB", &a);
        let b = stream(Backend::Uring, 64 << 10, secs, false)?;
        line("io_uring  64 KiB", &b);
        p.push(a.gbps);
        u.push(b.gbps);
    }
    let (mut zc_on, mut zc_off) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        println!("round {}", round + 1);
        let a = stream(Backend::Uring, 1 << 20, secs, true)?;
        line("io_uring  1 MiB, zero copy", &a);
        let b = stream(Backend::Uring, 1 << 20, secs, false)?;
        line("io_uring  1 MiB, copy", &b);
        zc_on.push(a.gbps);
        zc_off.push(b.gbps);
    }
    println!("summary (means over {rounds} rounds):");
    println!(
        "  64 KiB: portable {:.2} Gbit/s, io_uring {:.2} Gbit/s, io_uring/portable = {:.2}",
        mean(&p),
        mean(&u),
        mean(&u) / mean(&p)
    );
    println!(
        "  1 MiB io_uring: zero copy {:.2} Gbit/s, copy {:.2} Gbit/s, zero copy/copy = {:.2}",
        mean(&zc_on),
        mean(&zc_off),
        mean(&zc_on) / mean(&zc_off)
    );
    Ok(())
}
