//! SEND/RECV echo through the async API ([`metaroce_io::Device`]) over
//! loopback: the round-trip latency an embedding service sees (from the
//! SEND's post to the echo's completion), and how soon errors raised on
//! this side complete (`WrFlushError` on a QP in ERROR, and
//! `LocalProtectionError` for a SEND from an invalid local buffer).
//!
//! ```sh
//! cargo run --release --example device_echo -- [--rounds N] [--seconds S] [--size BYTES] [--turns T] [--busy-poll US] [--on-runtime] [--verify-mib M] [--backend B] [--json]
//! ```
//!
//! Runs `--rounds` round trips (1,000,000) or for `--seconds` (60),
//! whichever ends first, then 1,000 flushed posts and 200 protection
//! errors, and prints p50/p99/p99.9/max of each. The round trips are
//! split into `--turns` (4) turns, each followed by as many round trips of
//! the same echo written on the driver API ([`metaroce_io::Driver`], one
//! thread per side, each sleeping in `Driver::poll` as the Device's
//! endpoint threads do): the baseline the Device's figures are compared
//! with, measured in the same run. `--on-runtime` opens both devices with
//! [`Device::open_on_runtime`] (their endpoints as tasks of this program's
//! current-thread runtime) instead of a thread each. Then it verifies a
//! registered region of `--verify-mib` MiB (120; 0 skips) against the
//! expected bytes, in place through `MemoryRegion::lend` and by copy
//! through `MemoryRegion::read`, beside a plain `memcmp` of two buffers
//! (the best of 5 each).

use metaroce_io::{
    connect_pair, connect_qp_pair, AccessFlags, ApiError, Device, Driver, DriverConfig, WcStatus,
};
use std::time::{Duration, Instant};

struct Args {
    rounds: usize,
    seconds: u64,
    size: u32,
    verify_mib: usize,
    turns: usize,
    busy_poll: Duration,
    on_runtime: bool,
    backend: metaroce_io::Backend,
    json: bool,
}

fn args() -> Result<Args, Box<dyn std::error::Error>> {
    let mut a = Args {
        rounds: 1_000_000,
        seconds: 60,
        size: 4096,
        verify_mib: 120,
        turns: 4,
        busy_poll: Duration::ZERO,
        on_runtime: false,
        backend: metaroce_io::Backend::Auto,
        json: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        match k.as_str() {
            "--json" => a.json = true,
            "--on-runtime" => a.on_runtime = true,
            "--rounds" => a.rounds = it.next().ok_or("--rounds N")?.parse()?,
            "--seconds" => a.seconds = it.next().ok_or("--seconds S")?.parse()?,
            "--size" => a.size = it.next().ok_or("--size BYTES")?.parse()?,
            "--turns" => a.turns = it.next().ok_or("--turns T")?.parse::<usize>()?.max(1),
            "--busy-poll" => {
                a.busy_poll = Duration::from_micros(it.next().ok_or("--busy-poll US")?.parse()?)
            }
            "--verify-mib" => a.verify_mib = it.next().ok_or("--verify-mib M")?.parse()?,
            "--backend" => {
                a.backend = it
                    .next()
                    .ok_or("--backend auto|io_uring|portable")?
                    .parse()?
            }
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    Ok(a)
}

/// p50, p99, p99.9 and max of `t`, in microseconds.
fn percentiles(t: &mut [Duration]) -> [f64; 4] {
    t.sort_unstable();
    let at = |q: f64| {
        let i = ((t.len() as f64 * q).ceil() as usize).clamp(1, t.len()) - 1;
        t[i].as_secs_f64() * 1e6
    };
    [at(0.50), at(0.99), at(0.999), at(1.0)]
}

fn config(args: &Args) -> DriverConfig {
    let mut cfg = DriverConfig::new("127.0.0.1:0".parse().expect("address"));
    cfg.backend = args.backend;
    cfg.busy_poll = args.busy_poll;
    cfg
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = args()?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(run(args))
}

async fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let (client, server) = if args.on_runtime {
        (
            Device::open_on_runtime(config(&args)).await?,
            Device::open_on_runtime(config(&args)).await?,
        )
    } else {
        (
            Device::open(config(&args)).await?,
            Device::open(config(&args)).await?,
        )
    };
    let deadline = Instant::now() + Duration::from_secs(args.seconds);
    let per_turn = args.rounds.div_ceil(args.turns);
    let mut rtt = Vec::with_capacity(args.rounds.min(10_000_000));
    let mut base = Vec::with_capacity(args.rounds.min(10_000_000));
    let mut turn_p50 = Vec::new();
    for _ in 0..args.turns {
        // Half of each turn's share of `--seconds` for each of the two.
        let share = Duration::from_secs_f64(args.seconds as f64 / (2 * args.turns) as f64);
        let started = Instant::now();
        let mut dev = device_turn(
            &client,
            &server,
            per_turn,
            args.size,
            (started + share).min(deadline),
        )
        .await?;
        // The baseline runs as long as the Device's turn took, at most as
        // many round trips.
        let until = Instant::now() + started.elapsed();
        let mut drv = tokio::task::spawn_blocking({
            let cfg = config(&args);
            move || driver_turn(cfg, per_turn, args.size, until)
        })
        .await??;
        turn_p50.push((percentiles(&mut dev)[0], percentiles(&mut drv)[0]));
        rtt.append(&mut dev);
        base.append(&mut drv);
        if Instant::now() >= deadline {
            break;
        }
    }
    let done = rtt.len();
    let size = args.size;

    // Local errors: protection (a fresh pair each, as the error moves the
    // QP to ERROR) and, on that QP, flushed posts.
    let mut prot = Vec::new();
    let mut flush = Vec::new();
    for _ in 0..200 {
        let (qc, _qs) = connect_qp_pair(&client, &server).await?;
        let src = qc.pd.reg_mr(vec![1u8; 4096], AccessFlags::NONE).await?;
        let mut bad = src.sge(0, 4096)?;
        bad.lkey ^= 0x5a5a;
        let t0 = Instant::now();
        let r = qc.qp.send(bad).await;
        prot.push(t0.elapsed());
        expect_status(r, WcStatus::LocalProtectionError)?;
        for _ in 0..5 {
            let t0 = Instant::now();
            let r = qc.qp.send(src.sge(0, 4096)?).await;
            flush.push(t0.elapsed());
            expect_status(r, WcStatus::WrFlushError)?;
        }
    }

    let [memcmp_ms, lend_ms, copy_ms] = if args.verify_mib > 0 {
        verify(&client, args.verify_mib << 20).await?
    } else {
        [0.0; 3]
    };

    let [p50, p99, p999, max] = percentiles(&mut rtt);
    let over_1ms = rtt
        .iter()
        .filter(|t| **t > Duration::from_millis(1))
        .count();
    let [b50, b99, b999, bmax] = percentiles(&mut base);
    let base_over_1ms = base
        .iter()
        .filter(|t| **t > Duration::from_millis(1))
        .count();
    let ratio = p50 / b50;
    let turns: Vec<String> = turn_p50
        .iter()
        .map(|(d, b)| format!("{:.2}", d / b))
        .collect();
    let [f50, f99, f999, fmax] = percentiles(&mut flush);
    let [l50, l99, l999, lmax] = percentiles(&mut prot);
    if args.json {
        println!(
            "{{\"backend\":\"{}\",\"on_runtime\":{},\"size\":{size},\"round_trips\":{done},\
             \"rtt_us\":{{\"p50\":{p50:.1},\"p99\":{p99:.1},\"p99_9\":{p999:.1},\"max\":{max:.1}}},\
             \"over_1ms\":{over_1ms},\
             \"driver_rtt_us\":{{\"n\":{},\"p50\":{b50:.1},\"p99\":{b99:.1},\"p99_9\":{b999:.1},\"max\":{bmax:.1}}},\"driver_over_1ms\":{base_over_1ms},\
             \"p50_vs_driver\":{ratio:.3},\"p50_vs_driver_by_turn\":[{}],\
             \"flush_us\":{{\"n\":{},\"p50\":{f50:.1},\"p99\":{f99:.1},\"p99_9\":{f999:.1},\"max\":{fmax:.1}}},\
             \"protection_us\":{{\"n\":{},\"p50\":{l50:.1},\"p99\":{l99:.1},\"p99_9\":{l999:.1},\"max\":{lmax:.1}}},\
             \"verify_ms\":{{\"mib\":{},\"memcmp\":{memcmp_ms:.2},\"in_place\":{lend_ms:.2},\"by_copy\":{copy_ms:.2}}}}}",
            client.backend(),
            args.on_runtime,
            base.len(),
            turns.join(","),
            flush.len(),
            prot.len(),
            args.verify_mib
        );
    } else {
        println!(
            "backend {}, {size} B echo, {done} round trips",
            client.backend()
        );
        println!("round trip   p50 {p50:8.1} us  p99 {p99:8.1}  p99.9 {p999:8.1}  max {max:9.1}  (over 1 ms: {over_1ms})");
        println!("driver API   p50 {b50:8.1} us  p99 {b99:8.1}  p99.9 {b999:8.1}  max {bmax:9.1}  (over 1 ms: {base_over_1ms}, n={})", base.len());
        println!(
            "Device p50 / driver API p50: {ratio:.2} (by turn: {})",
            turns.join(", ")
        );
        println!("flush error  p50 {f50:8.1} us  p99 {f99:8.1}  p99.9 {f999:8.1}  max {fmax:9.1}  (n={})", flush.len());
        println!("protection   p50 {l50:8.1} us  p99 {l99:8.1}  p99.9 {l999:8.1}  max {lmax:9.1}  (n={})", prot.len());
        if args.verify_mib > 0 {
            println!(
                "verify {} MiB: memcmp {memcmp_ms:.2} ms, in place (lend) {lend_ms:.2} ms, by copy (read) {copy_ms:.2} ms",
                args.verify_mib
            );
        }
    }
    Ok(())
}

/// Verifies a region of `len` bytes against the expected bytes: the best
/// of 5 of a plain `memcmp` of two buffers, of `lend` and compare in
/// place, and of `read` (a copy) and compare, in milliseconds.
async fn verify(dev: &Device, len: usize) -> Result<[f64; 3], Box<dyn std::error::Error>> {
    let expected: Vec<u8> = (0..len).map(|i| (i * 7 + i / 4096) as u8).collect();
    let pd = dev.alloc_pd().await?;
    let mut mr = pd
        .reg_mr(expected.clone(), AccessFlags::LOCAL_WRITE)
        .await?;
    let other = expected.clone();
    let mut best = [f64::MAX; 3];
    for _ in 0..5 {
        let t0 = Instant::now();
        let same = std::hint::black_box(&other[..]) == &expected[..];
        best[0] = best[0].min(t0.elapsed().as_secs_f64() * 1e3);
        let t0 = Instant::now();
        let in_place = {
            let bytes = mr.lend().await?;
            bytes[..] == expected[..]
        };
        best[1] = best[1].min(t0.elapsed().as_secs_f64() * 1e3);
        let t0 = Instant::now();
        let by_copy = mr.read(0, len).await? == expected;
        best[2] = best[2].min(t0.elapsed().as_secs_f64() * 1e3);
        if !(same && in_place && by_copy) {
            return Err("a region's bytes differ from what was registered".into());
        }
    }
    Ok(best)
}

/// One turn of the Device echo: `rounds` round trips (fewer if `deadline`
/// passes) on a fresh QP pair; the server echoes every message from the
/// buffer it landed in, with its next receive posted first.
async fn device_turn(
    client: &Device,
    server: &Device,
    rounds: usize,
    size: u32,
    deadline: Instant,
) -> Result<Vec<Duration>, Box<dyn std::error::Error>> {
    let (qc, qs) = connect_qp_pair(client, server).await?;
    let mc = qc
        .pd
        .reg_mr(vec![7u8; 2 * size as usize], AccessFlags::LOCAL_WRITE)
        .await?;
    let ms = qs
        .pd
        .reg_mr(vec![0u8; 2 * size as usize], AccessFlags::LOCAL_WRITE)
        .await?;
    let echo = tokio::spawn(async move {
        let server_qp = &qs.qp;
        let buf = |i: usize| ms.sge((i % 2) as u64 * u64::from(size), size);
        let mut next = server_qp.recv(buf(0)?);
        for i in 0..rounds {
            let wc = match next.await {
                Ok(wc) => wc,
                // The client stopped early (the time limit): its QP went.
                Err(_) if i > 0 => break,
                Err(e) => return Err(e),
            };
            next = server_qp.recv(buf(i + 1)?);
            let out = ms.sge((i % 2) as u64 * u64::from(size), wc.byte_len)?;
            if server_qp.send(out).await.is_err() {
                break;
            }
        }
        Ok::<_, ApiError>(())
    });
    let (req, resp) = (mc.sge(0, size)?, mc.sge(u64::from(size), size)?);
    let mut rtt = Vec::with_capacity(rounds.min(10_000_000));
    for _ in 0..rounds {
        let got = qc.qp.recv(resp);
        let t0 = Instant::now();
        let sent = qc.qp.send(req);
        got.await?;
        rtt.push(t0.elapsed());
        sent.await?;
        if Instant::now() >= deadline {
            break;
        }
    }
    // Closing the connection moves the server's QP to ERROR: its pending
    // receive completes flushed and the echo loop ends.
    qc.conn.close().await?;
    echo.await??;
    Ok(rtt)
}

/// The same echo on the driver API: each side's [`Driver`] on a thread of
/// its own, sleeping in `poll` when idle (as a Device's endpoint thread
/// does), the client timing from its SEND's post to the echo's
/// completion. At most `rounds` round trips, until `until`.
fn driver_turn(
    cfg: DriverConfig,
    rounds: usize,
    size: u32,
    until: Instant,
) -> Result<Vec<Duration>, String> {
    use metaroce_io::proto::verbs::{
        CqHandle, MrInfo, QpInit, Qpn, RecvWr, RegionBuf, SendOp, SendWr, Sge, WcOpcode,
    };
    type Side = (Driver, Qpn, CqHandle, MrInfo);
    let err = |e: &dyn std::fmt::Display| e.to_string();
    let mut a = Driver::bind(cfg.clone()).map_err(|e| err(&e))?;
    let mut b = Driver::bind(cfg).map_err(|e| err(&e))?;
    let (ca, cb) = connect_pair(&mut a, &mut b, Duration::from_secs(10)).map_err(|e| err(&e))?;
    let side = |d: &mut Driver| -> Result<(Qpn, CqHandle, MrInfo), String> {
        let e = d.endpoint();
        let pd = e.alloc_pd();
        let cq = e.create_cq(64);
        let mr = e
            .reg_mr(
                pd,
                RegionBuf::zeroed(2 * size as usize),
                0,
                AccessFlags::LOCAL_WRITE,
            )
            .map_err(|e| err(&e))?;
        let qp = e.create_qp(QpInit::new(pd, cq, cq)).map_err(|e| err(&e))?;
        Ok((qp, cq, mr))
    };
    let (qa, cqa, mra) = side(&mut a)?;
    let (qb, cqb, mrb) = side(&mut b)?;
    a.endpoint().connect_qp(qa, ca, qb).map_err(|e| err(&e))?;
    b.endpoint().connect_qp(qb, cb, qa).map_err(|e| err(&e))?;
    let recv = move |mr: &MrInfo| {
        RecvWr::new(
            0,
            Sge {
                lkey: mr.lkey,
                addr: u64::from(size),
                len: size,
            },
        )
    };
    let send = move |mr: &MrInfo| {
        SendWr::new(
            0,
            SendOp::Send,
            Sge {
                lkey: mr.lkey,
                addr: 0,
                len: size,
            },
        )
    };
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    // The server: echoes every message, its next receive posted first.
    let server = std::thread::spawn({
        let stop = stop.clone();
        move || -> Result<(), String> {
            let (mut d, q, cq, mr): Side = (b, qb, cqb, mrb);
            d.endpoint().post_recv(q, recv(&mr)).map_err(|e| err(&e))?;
            let mut wcs = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                d.poll(Duration::from_millis(10)).map_err(|e| err(&e))?;
                wcs.clear();
                d.endpoint()
                    .poll_cq(cq, 16, &mut wcs)
                    .map_err(|e| err(&e))?;
                for wc in &wcs {
                    if wc.opcode == WcOpcode::Recv {
                        let now = d.now();
                        d.endpoint().post_recv(q, recv(&mr)).map_err(|e| err(&e))?;
                        d.endpoint()
                            .post_send(now, q, send(&mr))
                            .map_err(|e| err(&e))?;
                    }
                }
            }
            Ok(())
        }
    });
    let (mut d, q, cq, mr): Side = (a, qa, cqa, mra);
    let mut rtt = Vec::with_capacity(rounds.min(10_000_000));
    let mut wcs = Vec::new();
    let mut run = || -> Result<(), String> {
        for _ in 0..rounds {
            d.endpoint().post_recv(q, recv(&mr)).map_err(|e| err(&e))?;
            let t0 = Instant::now();
            let now = d.now();
            d.endpoint()
                .post_send(now, q, send(&mr))
                .map_err(|e| err(&e))?;
            let (mut echoed, mut sent) = (false, false);
            while !(echoed && sent) {
                d.poll(Duration::from_millis(100)).map_err(|e| err(&e))?;
                wcs.clear();
                d.endpoint()
                    .poll_cq(cq, 16, &mut wcs)
                    .map_err(|e| err(&e))?;
                for wc in &wcs {
                    match wc.opcode {
                        WcOpcode::Recv if !echoed => {
                            echoed = true;
                            rtt.push(t0.elapsed());
                        }
                        _ => sent = true,
                    }
                }
            }
            if Instant::now() >= until {
                break;
            }
        }
        Ok(())
    };
    let res = run();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    server
        .join()
        .map_err(|_| "the echo thread panicked".to_string())??;
    res.map(|()| rtt)
}

fn expect_status(
    r: Result<metaroce_io::WorkCompletion, ApiError>,
    want: WcStatus,
) -> Result<(), Box<dyn std::error::Error>> {
    match r {
        Err(ApiError::Failed(wc)) if wc.status == want => Ok(()),
        other => Err(format!("expected {want:?}, got {other:?}").into()),
    }
}
