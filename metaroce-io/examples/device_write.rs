//! Bulk WRITE_IMM through the async API ([`metaroce_io::Device`]) over
//! loopback, shaped as `metaroce perf --op write` runs it, so that the two
//! can be compared in alternated rounds: the Gbit/s a service embedding
//! the crate sees against what the `perf` tool gets.
//!
//! ```text
//! cargo run --release -p metaroce-io --example device_write -- [--size 64M] [--depth 2] [--seconds 4] [--backend auto|io_uring|portable] [--busy-poll US] [--on-runtime | --polled] [--no-verify]
//! metaroce perf --op write -s 64M -t 2 -D 4 --json   # the baseline
//! ```
//!
//! As in `perf`: `--depth` WRITE_IMMs in flight, each from a source slot of
//! its own into a destination slot (twice as many slots as the depth),
//! every message's bytes checked in place by the receiver when its
//! immediate arrives (the message's index in the first 8 bytes, then a
//! fixed pseudo-random pattern), and a destination slot reused only after
//! the receiver said (a SEND of 8 bytes) that it checked it. Prints one JSON
//! object: bytes moved, seconds, Gbit/s, messages, messages checked.
//! `--on-runtime` runs both endpoints as tasks of this program's
//! current-thread runtime ([`Device::open_on_runtime`]): everything on one
//! thread. `--polled` opens both with [`Device::open_polled`] and runs the
//! receiver on a thread of its own: each side's thread drives its endpoint
//! ([`Device::progress`]) while it waits for a request, as a progress loop
//! does, and the receiver checks each message in 1 MiB pieces with a turn
//! of its endpoint between two, as `perf` checks between its driver's
//! turns.

use metaroce_io::{connect_qp_pair, AccessFlags, Backend, Device, DriverConfig, SgList};
use std::collections::VecDeque;
use std::future::Future;
use std::time::{Duration, Instant};

/// How the devices run their endpoints.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Thread,
    Runtime,
    Polled,
}

/// Awaits `f`, taking a turn of `dev`'s endpoint (a polled device) each
/// time it is not ready: the caller's thread is the busy poll. Elsewhere a
/// plain await.
async fn driving<F: Future>(dev: &Device, polled: bool, f: F) -> F::Output {
    if !polled {
        return f.await;
    }
    let mut f = std::pin::pin!(f);
    std::future::poll_fn(|cx| {
        if let std::task::Poll::Ready(v) = f.as_mut().poll(cx) {
            return std::task::Poll::Ready(v);
        }
        dev.progress();
        match f.as_mut().poll(cx) {
            std::task::Poll::Ready(v) => std::task::Poll::Ready(v),
            std::task::Poll::Pending => {
                cx.waker().wake_by_ref();
                std::task::Poll::Pending
            }
        }
    })
    .await
}

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn size(s: &str) -> usize {
    let (num, mul) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1 << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<usize>().expect("--size N[K|M|G]") * mul
}

/// The fixed pseudo-random bytes every message carries after its index
/// (the top byte of a multiplicative hash of each offset).
fn pattern(len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|i| ((i ^ 0x5bd1_e995).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 56) as u8)
        .collect()
}

async fn run(cfg: DriverConfig, len: usize, depth: usize, secs: f64, verify: bool, mode: Mode) {
    let open = || async {
        match mode {
            Mode::Runtime => Device::open_on_runtime(cfg.clone()).await,
            Mode::Polled => Device::open_polled(cfg.clone()).await,
            Mode::Thread => Device::open(cfg.clone()).await,
        }
    };
    let polled = mode == Mode::Polled;
    let (a, b) = (
        open().await.expect("client device"),
        open().await.expect("server device"),
    );
    let (qa, qb) = connect_qp_pair(&a, &b).await.expect("QP pair");
    let slots = 2 * depth;
    let pat = pattern(len);
    let mut src_bytes = Vec::with_capacity(depth * len);
    for _ in 0..depth {
        src_bytes.extend_from_slice(&pat);
    }
    let src = qa
        .pd
        .reg_mr(src_bytes, AccessFlags::NONE)
        .await
        .expect("source region");
    let map = memmap2::MmapOptions::new()
        .len(slots * len)
        .map_anon()
        .expect("map");
    let dst = qb
        .pd
        .reg_mr_owned(map, AccessFlags::REMOTE_WRITE)
        .await
        .expect("destination region");
    // Credits: the receiver's 8-byte SENDs back, one per checked message.
    let credit_in = qa
        .pd
        .reg_mr(vec![0u8; 8 * slots], AccessFlags::LOCAL_WRITE)
        .await
        .expect("credit region");
    let credit_out = qb
        .pd
        .reg_mr(vec![0u8; 8], AccessFlags::NONE)
        .await
        .expect("credit source");
    let remote = dst.remote();
    let dst_base = dst.as_ptr() as usize;

    // The receiver: one receive per slot (WRITE_IMM consumes one), checks
    // each message in place, then returns its slot.
    let server_side = qb;
    let server_dev = b.clone();
    let server = async move {
        let b = server_dev;
        let server_qp = &server_side.qp;
        let mut recvs: VecDeque<_> = (0..slots)
            .map(|_| server_qp.recv(SgList::default()))
            .collect();
        let (mut checked, mut bad) = (0u64, 0u64);
        while let Some(r) = recvs.pop_front() {
            let Ok(wc) = driving(&b, polled, r).await else {
                break;
            };
            let i = u64::from(wc.imm.expect("WRITE_IMM carries its index"));
            let slot = i as usize % slots;
            if verify {
                // SAFETY: the message's bytes are placed (its immediate
                // completed), and the sender writes this slot again only
                // after the credit below.
                let got = unsafe {
                    std::slice::from_raw_parts((dst_base + slot * len) as *const u8, len)
                };
                let head = got.len().min(8);
                let mut ok = got[..head] == i.to_le_bytes()[..head];
                // Polled: in 1 MiB pieces, a turn of the endpoint between
                // two (as perf checks between its driver's turns); else at
                // once, the endpoint thread driving meanwhile.
                let piece = if polled { 1 << 20 } else { len.max(1) };
                let mut at = head;
                while at < len {
                    let end = (at + piece).min(len);
                    ok &= got[at..end] == pat[at..end];
                    at = end;
                    if polled {
                        b.progress();
                    }
                }
                if !ok {
                    bad += 1;
                }
                checked += 1;
            }
            recvs.push_back(server_qp.recv(SgList::default()));
            let credit = server_qp.send(credit_out.sge(0, 8).expect("credit"));
            if driving(&b, polled, credit).await.is_err() {
                break;
            }
        }
        drop(dst);
        (checked, bad)
    };
    // Polled: the receiver on a thread of its own (its own runtime), as
    // the two sides of perf run on two.
    let server = if polled {
        let t = std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime")
                .block_on(tokio::task::unconstrained(server))
        });
        tokio::task::spawn_blocking(move || t.join().expect("receiver thread"))
    } else {
        tokio::spawn(server)
    };

    let credit_recvs: Vec<_> = (0..slots)
        .map(|s| {
            qa.qp
                .recv(credit_in.sge(8 * s as u64, 8).expect("credit slot"))
        })
        .collect();
    let mut credits = VecDeque::from(credit_recvs);
    let mut inflight = VecDeque::new();
    let src_base = src.as_mut_ptr() as usize;
    let t0 = Instant::now();
    let stop = t0 + Duration::from_secs_f64(secs);
    let (mut posted, mut done) = (0u64, 0u64);
    loop {
        // Post while there is depth and a free destination slot.
        while inflight.len() < depth && Instant::now() < stop {
            if posted >= slots as u64 {
                // The slot's earlier message must have been checked.
                let c = credits.pop_front().expect("a credit per slot");
                driving(&a, polled, c).await.expect("credit");
                let s = posted % slots as u64;
                credits.push_back(qa.qp.recv(credit_in.sge(8 * s, 8).expect("credit slot")));
            }
            let ls = posted as usize % depth;
            // SAFETY: this source slot's previous WRITE completed (depth
            // bounds the messages in flight to one per slot).
            unsafe {
                let head = len.min(8);
                std::ptr::copy_nonoverlapping(
                    posted.to_le_bytes().as_ptr(),
                    (src_base + ls * len) as *mut u8,
                    head,
                );
            }
            let at = (posted % slots as u64) * len as u64;
            let wr = qa.qp.write_imm(
                src.sge((ls * len) as u64, len as u32).expect("source slot"),
                remote.at(at, len as u32).expect("destination slot"),
                posted as u32,
            );
            inflight.push_back(wr);
            posted += 1;
        }
        let Some(wr) = inflight.pop_front() else {
            break;
        };
        driving(&a, polled, wr).await.expect("WRITE_IMM");
        done += 1;
    }
    let elapsed = t0.elapsed().as_secs_f64();
    // Closing flushes the receiver's pending receives: it stops there.
    qa.conn.close().await.expect("close");
    let (checked, bad) = server.await.expect("receiver");
    let bytes = done * len as u64;
    println!(
        "{{\"backend\":\"{}\",\"size\":{len},\"depth\":{depth},\"messages\":{done},\
         \"on_runtime\":{},\"polled\":{polled},\"busy_poll_us\":{},\"checked\":{checked},\"corrupt\":{bad},\"seconds\":{elapsed:.3},\"gbit_s\":{:.3}}}",
        a.backend(),
        mode == Mode::Runtime,
        cfg.busy_poll.as_micros(),
        bytes as f64 * 8.0 / elapsed / 1e9
    );
    assert_eq!(bad, 0, "messages with wrong bytes");
}

fn main() {
    let len = arg("--size").map_or(64 << 20, |s| size(&s));
    let depth: usize = arg("--depth").map_or(2, |s| s.parse().expect("--depth N"));
    let secs: f64 = arg("--seconds").map_or(4.0, |s| s.parse().expect("--seconds S"));
    let verify = !std::env::args().any(|a| a == "--no-verify");
    let mode = if std::env::args().any(|a| a == "--on-runtime") {
        Mode::Runtime
    } else if std::env::args().any(|a| a == "--polled") {
        Mode::Polled
    } else {
        Mode::Thread
    };
    let mut cfg = DriverConfig::new("127.0.0.1:0".parse().expect("address"));
    cfg.backend = arg("--backend").map_or(Backend::Auto, |s| s.parse().expect("--backend"));
    cfg.busy_poll =
        Duration::from_micros(arg("--busy-poll").map_or(0, |s| s.parse().expect("--busy-poll US")));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(tokio::task::unconstrained(run(
        cfg,
        len,
        depth.max(1),
        secs,
        verify,
        mode,
    )));
}
