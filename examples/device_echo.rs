//! SEND/RECV echo through the async API ([`metaroce_io::Device`]) over
//! loopback: the round-trip latency an embedding service sees (from the
//! SEND's post to the echo's completion), and how soon errors raised on
//! this side complete (`WrFlushError` on a QP in ERROR, and
//! `LocalProtectionError` for a SEND from an invalid local buffer).
//!
//! ```sh
//! cargo run --release --example device_echo -- [--rounds N] [--seconds S] [--size BYTES] [--verify-mib M] [--backend B] [--json]
//! ```
//!
//! Runs `--rounds` round trips (1,000,000) or for `--seconds` (60),
//! whichever ends first, then 1,000 flushed posts and 200 protection
//! errors, and prints p50/p99/p99.9/max of each. Then it verifies a
//! registered region of `--verify-mib` MiB (120; 0 skips) against the
//! expected bytes, in place through `MemoryRegion::lend` and by copy
//! through `MemoryRegion::read`, beside a plain `memcmp` of two buffers
//! (the best of 5 each).

use metaroce_io::{connect_qp_pair, AccessFlags, ApiError, Device, DriverConfig, WcStatus};
use std::time::{Duration, Instant};

struct Args {
    rounds: usize,
    seconds: u64,
    size: u32,
    verify_mib: usize,
    backend: metaroce_io::Backend,
    json: bool,
}

fn args() -> Result<Args, Box<dyn std::error::Error>> {
    let mut a = Args {
        rounds: 1_000_000,
        seconds: 60,
        size: 4096,
        verify_mib: 120,
        backend: metaroce_io::Backend::Auto,
        json: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        match k.as_str() {
            "--json" => a.json = true,
            "--rounds" => a.rounds = it.next().ok_or("--rounds N")?.parse()?,
            "--seconds" => a.seconds = it.next().ok_or("--seconds S")?.parse()?,
            "--size" => a.size = it.next().ok_or("--size BYTES")?.parse()?,
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

async fn device(backend: metaroce_io::Backend) -> Result<Device, ApiError> {
    let mut cfg = DriverConfig::new("127.0.0.1:0".parse().expect("address"));
    cfg.backend = backend;
    Device::open(cfg).await
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = args()?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(run(args))
}

async fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let (client, server) = (device(args.backend).await?, device(args.backend).await?);
    let (qc, qs) = connect_qp_pair(&client, &server).await?;
    let size = args.size;
    let (pdc, pds) = (&qc.pd, &qs.pd);
    let mc = pdc
        .reg_mr(vec![7u8; 2 * size as usize], AccessFlags::LOCAL_WRITE)
        .await?;
    let ms = pds
        .reg_mr(vec![0u8; 2 * size as usize], AccessFlags::LOCAL_WRITE)
        .await?;

    // The server echoes every message from the buffer it landed in, with
    // the next receive posted first (into the other buffer).
    let rounds = args.rounds;
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
    let deadline = Instant::now() + Duration::from_secs(args.seconds);
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
    let done = rtt.len();
    // Closing the connection moves the server's QP to ERROR: its pending
    // receive completes flushed and the echo loop ends.
    qc.conn.close().await?;
    let _ = echo.await;

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
    let [f50, f99, f999, fmax] = percentiles(&mut flush);
    let [l50, l99, l999, lmax] = percentiles(&mut prot);
    if args.json {
        println!(
            "{{\"backend\":\"{}\",\"size\":{size},\"round_trips\":{done},\
             \"rtt_us\":{{\"p50\":{p50:.1},\"p99\":{p99:.1},\"p99_9\":{p999:.1},\"max\":{max:.1}}},\
             \"over_1ms\":{over_1ms},\
             \"flush_us\":{{\"n\":{},\"p50\":{f50:.1},\"p99\":{f99:.1},\"p99_9\":{f999:.1},\"max\":{fmax:.1}}},\
             \"protection_us\":{{\"n\":{},\"p50\":{l50:.1},\"p99\":{l99:.1},\"p99_9\":{l999:.1},\"max\":{lmax:.1}}},\
             \"verify_ms\":{{\"mib\":{},\"memcmp\":{memcmp_ms:.2},\"in_place\":{lend_ms:.2},\"by_copy\":{copy_ms:.2}}}}}",
            client.backend(),
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

fn expect_status(
    r: Result<metaroce_io::WorkCompletion, ApiError>,
    want: WcStatus,
) -> Result<(), Box<dyn std::error::Error>> {
    match r {
        Err(ApiError::Failed(wc)) if wc.status == want => Ok(()),
        other => Err(format!("expected {want:?}, got {other:?}").into()),
    }
}
