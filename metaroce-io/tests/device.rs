#![cfg(target_os = "linux")]
//! The async verbs API ([`Device`] and its handles) end to end over
//! loopback, on both backends: every operation with its payload checked,
//! the error statuses a user can provoke, completion-queue posting, and a
//! transfer through 1% and 10% injected loss. Where io_uring is unavailable
//! the io_uring variants print `skipped: io_uring unavailable: <reason>`
//! and pass. The `on_runtime::*` variants run the same tests with every
//! device opened by `Device::open_on_runtime` (its endpoint a task of the
//! test's runtime, not a thread), the `polled::*` ones with every device
//! opened by `Device::open_polled` and nobody calling `progress` (its
//! endpoint thread alone drives it); `polled_progress_*` drive polled
//! devices from the test's thread.

use metaroce_io::{
    AccessFlags, ApiError, Backend, CompletionQueue, Connection, Device, DriverConfig, FaultConfig,
    ProtectionDomain, QueuePair, RecvWr, RegionBuf, SendOp, SendWr, WcOpcode, WcStatus,
};
use metaroce_proto::verbs::{QpState, VerbsError};
mod common;

use common::pattern;
use std::sync::Mutex;
use std::time::Duration;

/// One test at a time: each runs two endpoint threads that busy-poll.
static SERIAL: Mutex<()> = Mutex::new(());

/// Every test ends within this (a hang is a failure).
const LIMIT: Duration = Duration::from_secs(20);

fn config(backend: Backend, faults: FaultConfig) -> DriverConfig {
    let mut c = DriverConfig::new("127.0.0.1:0".parse().unwrap());
    c.backend = backend;
    c.faults = faults;
    c
}

/// How a test's devices run their endpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// `Device::open`: a thread each.
    Thread,
    /// `Device::open_on_runtime`: a task of the test's runtime.
    Runtime,
    /// `Device::open_polled`, nobody calling `progress`.
    Polled,
}

thread_local! {
    static MODE: std::cell::Cell<Mode> = const { std::cell::Cell::new(Mode::Thread) };
}

/// Opens a device as this test runs them.
async fn open(cfg: DriverConfig) -> Result<Device, ApiError> {
    match MODE.with(|m| m.get()) {
        Mode::Thread => Device::open(cfg).await,
        Mode::Runtime => Device::open_on_runtime(cfg).await,
        Mode::Polled => Device::open_polled(cfg).await,
    }
}

/// [`run`], with every device the test opens running as `mode` says.
fn run_in<F, Fut>(mode: Mode, backend: Backend, f: F)
where
    F: FnOnce(Backend) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    MODE.with(|m| m.set(mode));
    run(backend, f);
    MODE.with(|m| m.set(Mode::Thread));
}

/// Runs `f` on a fresh runtime with `backend`, unless it cannot run here.
fn run<F, Fut>(backend: Backend, f: F)
where
    F: FnOnce(Backend) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    if backend == Backend::Uring {
        if let Err(why) = metaroce_io::uring_probe() {
            println!("skipped: io_uring unavailable: {why}");
            return;
        }
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        tokio::time::timeout(LIMIT, f(backend))
            .await
            .expect("test timed out")
    });
}

/// Both ends of a connected QP pair, each with its PD and one CQ.
struct Side {
    dev: Device,
    conn: Connection,
    pd: ProtectionDomain,
    cq: CompletionQueue,
    qp: QueuePair,
}

async fn pair(backend: Backend, faults: FaultConfig) -> (Side, Side) {
    let a = open(config(backend, faults.clone())).await.unwrap();
    let b = open(config(backend, faults)).await.unwrap();
    assert_eq!(a.backend(), backend);
    let (ca, cb) = tokio::join!(a.connect(b.local_addr()), b.accept());
    let (ca, cb) = (ca.unwrap(), cb.unwrap());
    assert_eq!(cb.peer(), a.local_addr());
    let (pda, pdb) = (a.alloc_pd().await.unwrap(), b.alloc_pd().await.unwrap());
    let (cqa, cqb) = (
        a.create_cq(1024).await.unwrap(),
        b.create_cq(1024).await.unwrap(),
    );
    let qa = pda.create_qp(&cqa, &cqa).await.unwrap();
    let qb = pdb.create_qp(&cqb, &cqb).await.unwrap();
    // The out-of-band exchange, through the byte form a real one would use.
    let ea = metaroce_io::QpEndpoint::from_bytes(&qa.endpoint().to_bytes()).unwrap();
    let eb = metaroce_io::QpEndpoint::from_bytes(&qb.endpoint().to_bytes()).unwrap();
    assert_eq!(ea.addr, a.local_addr());
    qa.connect(&ca, eb.qpn()).await.unwrap();
    qb.connect(&cb, ea.qpn()).await.unwrap();
    assert_eq!(qa.state().await.unwrap(), Some(QpState::Rts));
    (
        Side {
            dev: a,
            conn: ca,
            pd: pda,
            cq: cqa,
            qp: qa,
        },
        Side {
            dev: b,
            conn: cb,
            pd: pdb,
            cq: cqb,
            qp: qb,
        },
    )
}

async fn every_operation(backend: Backend) {
    let (a, b) = pair(backend, FaultConfig::default()).await;
    let len = 3 << 20;
    let data = pattern(1, len);

    // WRITE, then WRITE with immediate into a posted receive.
    let src = a.pd.reg_mr(data.clone(), AccessFlags::NONE).await.unwrap();
    let dst =
        b.pd.reg_mr(
            vec![0u8; len],
            AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
        )
        .await
        .unwrap();
    let remote = metaroce_io::RemoteMr::from_bytes(&dst.remote().to_bytes()).unwrap();
    let half = (len / 2) as u32;
    // Posted back to back, awaited together: completions in posting order.
    let w1 =
        a.qp.write(src.sge(0, half).unwrap(), remote.at(0, half).unwrap());
    let w2 = a.qp.write(
        src.sge(u64::from(half), half).unwrap(),
        remote.at(u64::from(half), half).unwrap(),
    );
    let (w1, w2) = tokio::join!(w1, w2);
    assert_eq!(w1.unwrap().opcode, WcOpcode::Write);
    assert_eq!(w2.unwrap().byte_len, half);
    assert!(
        dst.read(0, len).await.unwrap() == data,
        "WRITE bytes differ"
    );

    let scratch =
        b.pd.reg_mr(vec![0u8; 64], AccessFlags::LOCAL_WRITE)
            .await
            .unwrap();
    let r = b.qp.recv(scratch.sge(0, 64).unwrap());
    let tail = pattern(2, 4096);
    src.write(0, tail.clone()).await.unwrap();
    let wi =
        a.qp.write_imm(
            src.sge(0, 4096).unwrap(),
            remote.at(8192, 4096).unwrap(),
            0xfeed,
        )
        .await
        .unwrap();
    assert_eq!(wi.opcode, WcOpcode::Write);
    let rc = r.await.unwrap();
    assert_eq!(
        (rc.opcode, rc.imm),
        (WcOpcode::RecvRdmaWithImm, Some(0xfeed))
    );
    assert_eq!(dst.read(8192, 4096).await.unwrap(), tail);

    // READ back what was written, into a fresh region.
    let back =
        a.pd.reg_mr(vec![0u8; len], AccessFlags::LOCAL_WRITE)
            .await
            .unwrap();
    let rd =
        a.qp.read(
            back.sge(0, len as u32).unwrap(),
            remote.at(0, len as u32).unwrap(),
        )
        .await
        .unwrap();
    assert_eq!((rd.opcode, rd.byte_len), (WcOpcode::Read, len as u32));
    assert!(back.read(0, len).await.unwrap() == dst.read(0, len).await.unwrap());

    // SEND / RECV, with and without immediate, both directions.
    let msg = pattern(3, 10_000);
    let sbuf = a.pd.reg_mr(msg.clone(), AccessFlags::NONE).await.unwrap();
    let rbuf =
        b.pd.reg_mr(vec![0u8; 16_384], AccessFlags::LOCAL_WRITE)
            .await
            .unwrap();
    let r1 = b.qp.recv(rbuf.sge(0, 16_384).unwrap());
    let s1 =
        a.qp.send_imm(sbuf.sge(0, 10_000).unwrap(), 42)
            .await
            .unwrap();
    assert_eq!(s1.opcode, WcOpcode::Send);
    let r1 = r1.await.unwrap();
    assert_eq!(
        (r1.opcode, r1.byte_len, r1.imm),
        (WcOpcode::Recv, 10_000, Some(42))
    );
    assert_eq!(rbuf.read(0, 10_000).await.unwrap(), msg);
    let abuf =
        a.pd.reg_mr(vec![0u8; 100], AccessFlags::LOCAL_WRITE)
            .await
            .unwrap();
    let r2 = a.qp.recv(abuf.sge(0, 100).unwrap());
    b.qp.send(rbuf.sge(0, 100).unwrap()).await.unwrap();
    assert_eq!(r2.await.unwrap().byte_len, 100);
    assert_eq!(abuf.read(0, 100).await.unwrap(), msg[..100]);

    // Data-path calls are issued when called, in order: a write into the
    // send buffer followed at once by a SEND from it sends the new bytes.
    let fresh = pattern(6, 10_000);
    let r3 = b.qp.recv(rbuf.sge(0, 16_384).unwrap());
    let (w, s3) = tokio::join!(
        sbuf.write(0, fresh.clone()),
        a.qp.send(sbuf.sge(0, 10_000).unwrap())
    );
    w.unwrap();
    s3.unwrap();
    assert_eq!(r3.await.unwrap().byte_len, 10_000);
    assert_eq!(
        rbuf.read(0, 10_000).await.unwrap(),
        fresh,
        "the SEND carried the bytes written before it"
    );

    // The buffer comes back at deregistration.
    let buf = back.dereg().await.unwrap();
    assert!(buf[..] == dst.read(0, len).await.unwrap()[..]);
    let stats = b.dev.stats().await.unwrap();
    assert!(stats.datagrams_received > 0);
}

async fn completion_queue_posting(backend: Backend) {
    let (a, b) = pair(backend, FaultConfig::default()).await;
    let n = 64u64;
    let size = 8192u32;
    let data = pattern(4, (n as usize) * size as usize);
    let src = a.pd.reg_mr(data.clone(), AccessFlags::NONE).await.unwrap();
    let dst =
        b.pd.reg_mr(vec![0u8; data.len()], AccessFlags::LOCAL_WRITE)
            .await
            .unwrap();
    // Receives first, each with its own wr_id, then the SENDs.
    for i in 0..n {
        let sge = dst.sge(i * u64::from(size), size).unwrap();
        b.qp.post_recv(RecvWr {
            wr_id: 1000 + i,
            sge: sge.into(),
        })
        .await
        .unwrap();
    }
    let posts: Vec<_> = (0..n)
        .map(|i| {
            let sge = src.sge(i * u64::from(size), size).unwrap();
            a.qp.post_send(SendWr::new(i, SendOp::Send, sge))
        })
        .collect();
    for p in posts {
        p.await.unwrap();
    }
    for i in 0..n {
        let wc = a.cq.next().await.unwrap();
        assert_eq!(
            (wc.wr_id, wc.status),
            (i, WcStatus::Success),
            "send CQ order"
        );
    }
    for i in 0..n {
        let wc = b.cq.next().await.unwrap();
        assert_eq!(
            (wc.wr_id, wc.opcode, wc.byte_len),
            (1000 + i, WcOpcode::Recv, size)
        );
    }
    assert!(a.cq.poll(16).is_empty() && b.cq.poll(16).is_empty());
    assert!(dst.read(0, data.len()).await.unwrap() == data);
}

async fn error_statuses(backend: Backend) {
    let (a, b) = pair(backend, FaultConfig::default()).await;
    let src =
        a.pd.reg_mr(vec![1u8; 8192], AccessFlags::NONE)
            .await
            .unwrap();
    // A receive needs a region this side may write.
    let no_lw =
        b.pd.reg_mr(vec![0u8; 100], AccessFlags::REMOTE_READ)
            .await
            .unwrap();
    let r =
        b.qp.post_recv(RecvWr {
            wr_id: 9,
            sge: no_lw.sge(0, 100).unwrap().into(),
        })
        .await;
    // Refused as what it is: the region exists, without LOCAL_WRITE.
    let lkey = no_lw.info().lkey;
    assert!(
        matches!(r, Err(ApiError::Verbs(VerbsError::AccessDenied { lkey: k, need, .. }))
            if k == lkey && need == AccessFlags::LOCAL_WRITE),
        "{r:?}"
    );
    let msg = r.unwrap_err().to_string();
    assert!(msg.contains("lacks LOCAL_WRITE access"), "{msg}");
    // A READ into it is accepted and completes with LocalProtectionError,
    // as the reg_mr docs say (a fresh pair below: this fails the QP).
    let rd =
        b.qp.read(no_lw.sge(0, 100).unwrap(), src.remote().at(0, 100).unwrap());
    let e = rd.await.unwrap_err();
    assert!(
        matches!(&e, ApiError::Failed(wc) if wc.status == WcStatus::LocalProtectionError),
        "{e}"
    );
    drop((a, b));
    let (a, b) = pair(backend, FaultConfig::default()).await;
    let src =
        a.pd.reg_mr(vec![1u8; 8192], AccessFlags::NONE)
            .await
            .unwrap();
    // A region the peer may only read: a WRITE to it is refused remotely.
    let ro =
        b.pd.reg_mr(vec![0u8; 8192], AccessFlags::REMOTE_READ)
            .await
            .unwrap();
    let w =
        a.qp.write(src.sge(0, 4096).unwrap(), ro.remote().at(0, 4096).unwrap());
    let id = w.wr_id();
    let e = w.await.unwrap_err();
    // The awaited call's own wr_id, in the completion and the message.
    assert!(
        matches!(&e, ApiError::Failed(wc) if wc.status == WcStatus::RemoteAccessError && wc.wr_id == id && id > 0),
        "{e}"
    );
    let msg = e.to_string();
    assert!(
        msg.starts_with(&format!(
            "work request {id} (Write on QP {}) failed",
            a.qp.qpn()
        )),
        "{msg}"
    );
    assert_eq!(
        ro.read(0, 8192).await.unwrap(),
        vec![0u8; 8192],
        "nothing written"
    );
    // Local checks happen before anything is sent.
    assert!(matches!(
        src.sge(4096, 8192),
        Err(ApiError::OutOfBounds { .. })
    ));
    assert!(matches!(
        src.read(8000, 1000).await,
        Err(ApiError::OutOfBounds { .. })
    ));
    // A remote range is checked whole, not only its start.
    assert!(matches!(
        ro.remote().at(4096, 4097),
        Err(ApiError::OutOfBounds {
            offset: 4096,
            len: 4097,
            size: 8192
        })
    ));
    // After the error the QP is in ERROR; a fresh pair for the next case.
    drop((a, b));
    let (a, b) = pair(backend, FaultConfig::default()).await;
    let src =
        a.pd.reg_mr(vec![2u8; 8192], AccessFlags::NONE)
            .await
            .unwrap();
    let small =
        b.pd.reg_mr(vec![0u8; 100], AccessFlags::LOCAL_WRITE)
            .await
            .unwrap();
    let r = b.qp.recv(small.sge(0, 100).unwrap());
    let s = a.qp.send(src.sge(0, 4096).unwrap()).await;
    let r = r.await.unwrap_err();
    assert!(
        matches!(&r, ApiError::Failed(wc) if wc.status == WcStatus::LocalLengthError),
        "{r}"
    );
    assert!(
        matches!(&s, Err(ApiError::Failed(wc)) if wc.status == WcStatus::RemoteInvalidRequest),
        "{s:?}"
    );
    let r2 = b.qp.recv(small.sge(0, 100).unwrap()).await;
    assert!(
        r2.is_err(),
        "a receive on a QP in ERROR is flushed or refused"
    );
    let q = a.pd.reg_mr(vec![0u8; 0], AccessFlags::NONE).await;
    assert!(
        matches!(q, Err(ApiError::Verbs(VerbsError::InvalidLength(0)))),
        "{q:?}"
    );
}

async fn write_through_loss(backend: Backend, loss: f64) {
    let faults = FaultConfig {
        seed: 7,
        drop: loss,
        duplicate: 0.01,
        reorder: 0.02,
        reorder_delay: Duration::from_micros(300),
        per_path: None,
        per_source: None,
    };
    let (a, b) = pair(backend, faults).await;
    let len = 4 << 20;
    let data = pattern(5, len);
    let src = a.pd.reg_mr(data.clone(), AccessFlags::NONE).await.unwrap();
    let dst =
        b.pd.reg_mr(vec![0u8; len], AccessFlags::REMOTE_WRITE)
            .await
            .unwrap();
    let piece = 256 << 10;
    let reqs: Vec<_> = (0..len / piece)
        .map(|i| {
            let off = (i * piece) as u64;
            a.qp.write(
                src.sge(off, piece as u32).unwrap(),
                dst.remote().at(off, piece as u32).unwrap(),
            )
        })
        .collect();
    for r in reqs {
        r.await.unwrap();
    }
    assert!(
        dst.read(0, len).await.unwrap() == data,
        "bytes differ at loss {loss}"
    );
    println!("loss {loss}: b {:?}", b.dev.stats().await.unwrap());
}

/// A device on two local addresses (planes) each side: a WRITE lands
/// intact and both of the receiver's addresses got datagrams.
async fn two_plane_devices(backend: Backend) {
    let cfg = |listen: &str, extra: &str| {
        let mut c = config(backend, FaultConfig::default());
        c.listen = listen.parse().unwrap();
        c.planes = vec![extra.parse().unwrap()];
        c
    };
    let a = open(cfg("127.0.0.5:0", "127.0.0.6")).await.unwrap();
    let b = open(cfg("127.0.0.7:0", "127.0.0.8")).await.unwrap();
    let (ca, cb) = tokio::join!(a.connect(b.local_addr()), b.accept());
    let (ca, cb) = (ca.unwrap(), cb.unwrap());
    let (pda, pdb) = (a.alloc_pd().await.unwrap(), b.alloc_pd().await.unwrap());
    let (cqa, cqb) = (
        a.create_cq(64).await.unwrap(),
        b.create_cq(64).await.unwrap(),
    );
    let qa = pda.create_qp(&cqa, &cqa).await.unwrap();
    let qb = pdb.create_qp(&cqb, &cqb).await.unwrap();
    qa.connect(&ca, qb.qpn()).await.unwrap();
    qb.connect(&cb, qa.qpn()).await.unwrap();
    let data = pattern(9, 4 << 20);
    let src = pda.reg_mr(data.clone(), AccessFlags::NONE).await.unwrap();
    let dst = pdb
        .reg_mr(vec![0u8; data.len()], AccessFlags::REMOTE_WRITE)
        .await
        .unwrap();
    let half = (data.len() / 2) as u32;
    let (w1, w2) = tokio::join!(
        qa.write(src.sge(0, half).unwrap(), dst.remote().at(0, half).unwrap()),
        qa.write(
            src.sge(u64::from(half), half).unwrap(),
            dst.remote().at(u64::from(half), half).unwrap()
        )
    );
    w1.unwrap();
    w2.unwrap();
    assert!(
        dst.read(0, data.len()).await.unwrap() == data,
        "bytes differ"
    );
    // The paths spread over both planes, and both carried data.
    let st = ca.stats().await.unwrap().expect("connection open");
    let mut per_plane = [0u64; 2];
    for p in &st.paths {
        per_plane[usize::from(p.plane)] += p.packets_acked;
    }
    assert!(per_plane.iter().all(|&n| n > 50), "{per_plane:?}");
}

/// Round trips no completion may wait out: a SEND/RECV echo of 4 KiB,
/// each round trip timed from the SEND's post to the echo's arrival.
///
/// The endpoint thread used to sleep in its driver's poll (up to 100 ms)
/// with a command waiting for it (io_uring: the wake consumed by the
/// turn's first reap), which showed as a 100 ms round trip in about one of
/// 10,000: too rare for a test of a few thousand rounds to catch reliably.
/// That mechanism is tested deterministically by
/// `backends::a_wake_before_the_poll_is_not_lost` (and locally made
/// completions by `local_errors_complete_at_once`); this end-to-end test
/// fails if round trips wait systematically. Its bounds allow for a loaded
/// host: with the load average at 7 on 2 cores (other jobs, and two
/// busy-polling endpoint threads beside this one) single rounds took up to
/// 280 ms, so a few rounds over 20 ms are the host's, not the transport's.
/// The regions of an echo of `size` bytes: `a`'s request (the pattern of
/// `seed`) and room for the response, `b`'s buffer that receives the
/// request and sends it back; and the three buffers.
async fn echo_regions(
    a: &Side,
    b: &Side,
    size: u32,
    seed: u64,
) -> (
    metaroce_io::MemoryRegion,
    metaroce_io::MemoryRegion,
    [metaroce_io::Sge; 3],
) {
    let ra =
        a.pd.reg_mr(pattern(seed, 2 * size as usize), AccessFlags::LOCAL_WRITE)
            .await
            .unwrap();
    let rb =
        b.pd.reg_mr(vec![0u8; size as usize], AccessFlags::LOCAL_WRITE)
            .await
            .unwrap();
    let bufs = [
        ra.sge(0, size).unwrap(),
        ra.sge(u64::from(size), size).unwrap(),
        rb.sge(0, size).unwrap(),
    ];
    (ra, rb, bufs)
}

async fn no_round_trip_stalls(backend: Backend) {
    let (a, b) = pair(backend, FaultConfig::default()).await;
    let size = 4096u32;
    let (ra, _rb, [req, resp, echo]) = echo_regions(&a, &b, size, 11).await;
    let rounds = 5_000;
    let mut rtts = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let got_b = b.qp.recv(echo);
        let got_a = a.qp.recv(resp);
        let t0 = std::time::Instant::now();
        let sent_a = a.qp.send(req);
        got_b.await.unwrap();
        let sent_b = b.qp.send(echo);
        let wc = got_a.await.unwrap();
        rtts.push(t0.elapsed());
        assert_eq!(wc.byte_len, size);
        sent_a.await.unwrap();
        sent_b.await.unwrap();
    }
    rtts.sort_unstable();
    let worst = &rtts[rounds - 5..];
    println!("p50 {:?}, five worst {worst:?}", rtts[rounds / 2]);
    let slow = rtts
        .iter()
        .filter(|t| **t > Duration::from_millis(20))
        .count();
    assert!(
        slow <= rounds / 500 && rtts[rounds - 1] < Duration::from_secs(1),
        "{slow} of {rounds} round trips over 20 ms, the worst {worst:?}"
    );
    assert!(ra.read(u64::from(size), size as usize).await.unwrap() == pattern(11, size as usize));
}

/// Errors raised on this side complete at once: a SEND from an invalid
/// local buffer (`LocalProtectionError`, found when the request's turn to
/// be sent comes) and, on the QP that error left in ERROR, every later
/// post (`WrFlushError`, made while the post is handled). Neither needs a
/// datagram or a timer, and the endpoint thread used to sleep (until the
/// next timer, or 100 ms) before handing them over.
async fn local_errors_complete_at_once(backend: Backend) {
    let mut flushes = Vec::new();
    let mut protections = Vec::new();
    for _ in 0..10 {
        let (a, _b) = pair(backend, FaultConfig::default()).await;
        let src =
            a.pd.reg_mr(vec![1u8; 4096], AccessFlags::NONE)
                .await
                .unwrap();
        let mut bad = src.sge(0, 4096).unwrap();
        bad.lkey ^= 0x5a5a;
        let t0 = std::time::Instant::now();
        let e = a.qp.send(bad).await.unwrap_err();
        protections.push(t0.elapsed());
        assert!(
            matches!(&e, ApiError::Failed(wc) if wc.status == WcStatus::LocalProtectionError),
            "{e}"
        );
        for _ in 0..10 {
            let t0 = std::time::Instant::now();
            let e = a.qp.send(src.sge(0, 4096).unwrap()).await.unwrap_err();
            flushes.push(t0.elapsed());
            assert!(
                matches!(&e, ApiError::Failed(wc) if wc.status == WcStatus::WrFlushError),
                "{e}"
            );
        }
    }
    for (what, mut t) in [("protection", protections), ("flush", flushes)] {
        t.sort();
        let (p50, max) = (t[t.len() / 2], t[t.len() - 1]);
        println!("{what} error: p50 {p50:?}, max {max:?} of {}", t.len());
        // Microseconds when delivered at once; a sleep costs milliseconds.
        assert!(p50 < Duration::from_millis(1), "{what} errors: p50 {p50:?}");
        assert!(
            max < Duration::from_millis(20),
            "{what} errors: max {max:?}"
        );
    }
}

#[test]
fn no_round_trip_stalls_io_uring() {
    run(Backend::Uring, no_round_trip_stalls);
}

#[test]
fn no_round_trip_stalls_portable() {
    run(Backend::Portable, no_round_trip_stalls);
}

#[test]
fn local_errors_complete_at_once_io_uring() {
    run(Backend::Uring, local_errors_complete_at_once);
}

#[test]
fn local_errors_complete_at_once_portable() {
    run(Backend::Portable, local_errors_complete_at_once);
}

/// `create_qp_with` with capacities: a post beyond `max_send_wr` or
/// `max_recv_wr` is refused as `QueueFull`, and queues or connections of
/// another device are refused by name rather than mistaken for this one's.
async fn qp_capacities_and_foreign_handles(backend: Backend) {
    let (a, b) = pair(backend, FaultConfig::default()).await;
    let caps = metaroce_io::QpCaps {
        max_send_wr: 2,
        max_recv_wr: 3,
        ..Default::default()
    };
    let qp = a.pd.create_qp_with(&a.cq, &a.cq, caps).await.unwrap();
    let mr =
        a.pd.reg_mr(vec![0u8; 4096], AccessFlags::LOCAL_WRITE)
            .await
            .unwrap();
    let sge = mr.sge(0, 64).unwrap();
    let qb = b.pd.create_qp(&b.cq, &b.cq).await.unwrap();
    let (cb, ca) = (b.conn.clone(), a.conn.clone());
    qp.connect(&ca, qb.qpn()).await.unwrap();
    qb.connect(&cb, qp.qpn()).await.unwrap();
    let recvs: Vec<_> = (0..3).map(|_| qp.recv(sge)).collect();
    let r = qp.recv(sge).await;
    assert!(
        matches!(r, Err(ApiError::Verbs(VerbsError::QueueFull(3)))),
        "{r:?}"
    );
    // Sends to a peer with no receive posted stay outstanding (RNR).
    let sends: Vec<_> = (0..2).map(|_| qp.send(sge)).collect();
    let s = qp.send(sge).await;
    assert!(
        matches!(s, Err(ApiError::Verbs(VerbsError::QueueFull(2)))),
        "{s:?}"
    );
    let zero = metaroce_io::QpCaps {
        max_send_wr: 0,
        ..Default::default()
    };
    let z = a.pd.create_qp_with(&a.cq, &a.cq, zero).await;
    assert!(
        matches!(z, Err(ApiError::Verbs(VerbsError::InvalidLength(0)))),
        "{z:?}"
    );
    let f = a.pd.create_qp(&a.cq, &b.cq).await;
    assert!(
        matches!(f, Err(ApiError::Verbs(VerbsError::InvalidCq))),
        "{f:?}"
    );
    let q2 = a.pd.create_qp(&a.cq, &a.cq).await.unwrap();
    let f = q2.connect(&cb, qb.qpn()).await;
    assert!(
        matches!(f, Err(ApiError::Verbs(VerbsError::InvalidConnection))),
        "{f:?}"
    );
    drop((recvs, sends));
}

#[test]
fn qp_capacities_and_foreign_handles_portable() {
    run(Backend::Portable, qp_capacities_and_foreign_handles);
}

/// `rnr_retry = 0`: a SEND the peer has no receive for fails at the first
/// RNR NAK with `RnrRetryExceeded` (the default, 7, retries forever).
async fn rnr_retry_zero_fails_a_send_without_a_receive(backend: Backend) {
    let (a, b) = pair(backend, FaultConfig::default()).await;
    let attrs = metaroce_io::RcAttrs {
        rnr_retry: 0,
        ..Default::default()
    };
    let qa = a.pd.create_qp(&a.cq, &a.cq).await.unwrap();
    let qb = b.pd.create_qp(&b.cq, &b.cq).await.unwrap();
    qa.connect_with(&a.conn, qb.qpn(), attrs).await.unwrap();
    qb.connect(&b.conn, qa.qpn()).await.unwrap();
    let src = a.pd.reg_mr(vec![3u8; 64], AccessFlags::NONE).await.unwrap();
    let t0 = std::time::Instant::now();
    let e = tokio::time::timeout(Duration::from_secs(5), qa.send(src.sge(0, 64).unwrap()))
        .await
        .expect("with rnr_retry 0 the SEND fails, it is not retried forever")
        .unwrap_err();
    assert!(
        matches!(&e, ApiError::Failed(wc) if wc.status == WcStatus::RnrRetryExceeded),
        "{e}"
    );
    println!("RnrRetryExceeded after {:?}", t0.elapsed());
    let bad = metaroce_io::RcAttrs {
        rnr_retry: 8,
        ..Default::default()
    };
    let q = a.pd.create_qp(&a.cq, &a.cq).await.unwrap();
    let r = q.connect_with(&a.conn, qb.qpn(), bad).await;
    assert!(
        matches!(r, Err(ApiError::Verbs(VerbsError::InvalidAttribute(_)))),
        "{r:?}"
    );
}

/// A request whose peer QP is gone fails with `RetryExceeded` after the
/// QP's progress probes go unanswered: `retry_cnt` and `timeout` set that
/// time (default: the connection's RTO doubling over 7 probes, ~0.5 s).
async fn retry_cnt_and_timeout_bound_retry_exceeded(backend: Backend) {
    async fn time_to_fail(backend: Backend, attrs: metaroce_io::RcAttrs) -> Duration {
        let (a, b) = pair(backend, FaultConfig::default()).await;
        let qa = a.pd.create_qp(&a.cq, &a.cq).await.unwrap();
        let qb = b.pd.create_qp(&b.cq, &b.cq).await.unwrap();
        qa.connect_with(&a.conn, qb.qpn(), attrs).await.unwrap();
        qb.connect(&b.conn, qa.qpn()).await.unwrap();
        drop(qb);
        // The destroy reaches the peer's endpoint thread before the SEND.
        let _ = b.dev.stats().await.unwrap();
        let src = a.pd.reg_mr(vec![3u8; 64], AccessFlags::NONE).await.unwrap();
        let t0 = std::time::Instant::now();
        let e = qa.send(src.sge(0, 64).unwrap()).await.unwrap_err();
        let took = t0.elapsed();
        assert!(
            matches!(&e, ApiError::Failed(wc) if wc.status == WcStatus::RetryExceeded),
            "{e}"
        );
        took
    }
    let default = time_to_fail(backend, Default::default()).await;
    let fast = metaroce_io::RcAttrs {
        retry_cnt: Some(1),
        timeout: Some(Duration::from_millis(2)),
        ..Default::default()
    };
    let fast = time_to_fail(backend, fast).await;
    println!("RetryExceeded after {default:?} by default, {fast:?} with retry_cnt 1, timeout 2 ms");
    assert!(default > Duration::from_millis(100), "default {default:?}");
    assert!(fast < Duration::from_millis(60), "fast {fast:?}");
    assert!(fast * 4 < default, "fast {fast:?} default {default:?}");
}

#[test]
fn rnr_retry_zero_fails_a_send_without_a_receive_portable() {
    run(
        Backend::Portable,
        rnr_retry_zero_fails_a_send_without_a_receive,
    );
}

#[test]
fn retry_cnt_and_timeout_bound_retry_exceeded_portable() {
    run(
        Backend::Portable,
        retry_cnt_and_timeout_bound_retry_exceeded,
    );
}

/// `MemoryRegion::lend`: the region's bytes filled and read in place
/// (what a SEND carries, what a RECV left), and, while they are lent, a
/// post with an earlier `Sge` refused (`MrLent`), a peer's WRITE to the
/// region failing (`RemoteAccessError`), and no lend while a request
/// references the region (`MrInUse`).
async fn regions_lent_in_place(backend: Backend) {
    let (a, b) = pair(backend, FaultConfig::default()).await;
    let len = 1 << 20;
    let mut src =
        a.pd.reg_mr(RegionBuf::zeroed(len), AccessFlags::NONE)
            .await
            .unwrap();
    let mut dst =
        b.pd.reg_mr(RegionBuf::zeroed(len), AccessFlags::LOCAL_WRITE)
            .await
            .unwrap();
    let data = pattern(21, len);
    let early = src.sge(0, len as u32).unwrap();
    {
        let mut bytes = src.lend().await.unwrap();
        assert!(bytes.iter().all(|&x| x == 0));
        bytes.copy_from_slice(&data);
        // Lent: a post that names the region is refused, the QP unharmed.
        let r = a.qp.send(early).await;
        assert!(
            matches!(r, Err(ApiError::Verbs(VerbsError::MrLent(_)))),
            "{r:?}"
        );
    } // given back here, before the SEND below is issued
    let got = b.qp.recv(dst.sge(0, len as u32).unwrap());
    a.qp.send(src.sge(0, len as u32).unwrap()).await.unwrap();
    assert_eq!(got.await.unwrap().byte_len, len as u32);
    assert!(
        dst.lend().await.unwrap()[..] == data[..],
        "received bytes, read in place"
    );
    assert_eq!(a.qp.state().await.unwrap(), Some(QpState::Rts));

    // No lend while a request references the region.
    let pending = b.qp.recv(dst.sge(0, 64).unwrap());
    let l = dst.lend().await;
    assert!(
        matches!(l, Err(ApiError::Verbs(VerbsError::MrInUse(1)))),
        "{l:?}"
    );
    drop(l);
    drop(pending);

    // A peer's WRITE into a lent region fails.
    let mut target =
        b.pd.reg_mr(RegionBuf::zeroed(4096), AccessFlags::REMOTE_WRITE)
            .await
            .unwrap();
    let remote = target.remote();
    let held = target.lend().await.unwrap();
    let w =
        a.qp.write(src.sge(0, 4096).unwrap(), remote.at(0, 4096).unwrap())
            .await;
    assert!(
        matches!(&w, Err(ApiError::Failed(wc)) if wc.status == WcStatus::RemoteAccessError),
        "{w:?}"
    );
    assert!(held.iter().all(|&x| x == 0), "nothing was written");
}

#[test]
fn regions_lent_in_place_portable() {
    run(Backend::Portable, regions_lent_in_place);
}

#[test]
fn regions_lent_in_place_io_uring() {
    run(Backend::Uring, regions_lent_in_place);
}

/// Posting as `ibv_post_send` does: a batch (chain) in one call, only
/// signaled requests leaving a completion, completions polled into a
/// reused vector; a refused request in a batch says how many were posted.
async fn batched_and_unsignaled_posts(backend: Backend) {
    let (a, b) = pair(backend, FaultConfig::default()).await;
    let (n, size) = (64u64, 4096u32);
    let data = pattern(31, (n * u64::from(size)) as usize);
    let src = a.pd.reg_mr(data.clone(), AccessFlags::NONE).await.unwrap();
    let dst =
        b.pd.reg_mr(vec![0u8; data.len()], AccessFlags::LOCAL_WRITE)
            .await
            .unwrap();
    for i in 0..n {
        let sge = dst.sge(i * u64::from(size), size).unwrap();
        b.qp.post_recv(RecvWr {
            wr_id: i,
            sge: sge.into(),
        })
        .await
        .unwrap();
    }
    // Every 8th signaled: 8 completions for 64 SENDs.
    let wrs = (0..n).map(|i| SendWr {
        signaled: i % 8 == 7,
        ..SendWr::new(i, SendOp::Send, src.sge(i * u64::from(size), size).unwrap())
    });
    a.qp.post_send_batch(wrs).await.unwrap();
    let mut recvd = 0;
    while recvd < n {
        let wc = b.cq.next().await.unwrap();
        assert_eq!((wc.wr_id, wc.status), (recvd, WcStatus::Success));
        recvd += 1;
    }
    assert!(dst.read(0, data.len()).await.unwrap() == data);
    let mut wcs = Vec::with_capacity(16);
    let mut got = Vec::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while got.len() < 8 && std::time::Instant::now() < deadline {
        wcs.clear();
        if a.cq.poll_into(16, &mut wcs) == 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        got.extend(wcs.iter().map(|wc| wc.wr_id));
    }
    // A moment for any completion that should not be there.
    tokio::time::sleep(Duration::from_millis(20)).await;
    wcs.clear();
    a.cq.poll_into(16, &mut wcs);
    got.extend(wcs.iter().map(|wc| wc.wr_id));
    assert_eq!(
        got,
        (0..8).map(|k| k * 8 + 7).collect::<Vec<_>>(),
        "signaled only"
    );

    // A batch beyond the send queue's room: the first 4 are posted (the
    // peer has no receive for them: they wait in RNR), the 5th refused.
    let caps = metaroce_io::QpCaps {
        max_send_wr: 4,
        ..Default::default()
    };
    let qa = a.pd.create_qp_with(&a.cq, &a.cq, caps).await.unwrap();
    let qb = b.pd.create_qp(&b.cq, &b.cq).await.unwrap();
    qa.connect(&a.conn, qb.qpn()).await.unwrap();
    qb.connect(&b.conn, qa.qpn()).await.unwrap();
    let wrs = (0..6).map(|i| SendWr::new(100 + i, SendOp::Send, src.sge(0, 64).unwrap()));
    let r = qa.post_send_batch(wrs).await;
    assert!(
        matches!(
            r,
            Err(ApiError::BatchRefused {
                posted: 4,
                error: VerbsError::QueueFull(4)
            })
        ),
        "{r:?}"
    );
}

#[test]
fn batched_and_unsignaled_posts_portable() {
    run(Backend::Portable, batched_and_unsignaled_posts);
}

#[test]
fn batched_and_unsignaled_posts_io_uring() {
    run(Backend::Uring, batched_and_unsignaled_posts);
}

/// `post_recv_batch`: receives posted as one chain are consumed in order
/// and complete with their `wr_id`s; a chain that meets a refusal keeps
/// the receives before it (they are consumed as usual) and says how many
/// were posted and why the next was refused.
async fn receive_chains(backend: Backend) {
    let (a, b) = pair(backend, FaultConfig::default()).await;
    let (n, size) = (16u64, 1024u32);
    let data = pattern(41, (n * u64::from(size)) as usize);
    let src = a.pd.reg_mr(data.clone(), AccessFlags::NONE).await.unwrap();
    let dst =
        b.pd.reg_mr(vec![0u8; data.len()], AccessFlags::LOCAL_WRITE)
            .await
            .unwrap();
    // Posted in reverse address order: message i lands in slot n-1-i.
    let slot = |i: u64| (n - 1 - i) * u64::from(size);
    let wrs = (0..n).map(|i| RecvWr {
        wr_id: 500 + i,
        sge: dst.sge(slot(i), size).unwrap().into(),
    });
    b.qp.post_recv_batch(wrs).await.unwrap();
    for i in 0..n {
        a.qp.send(src.sge(i * u64::from(size), size).unwrap())
            .await
            .unwrap();
    }
    for i in 0..n {
        let wc = b.cq.next().await.unwrap();
        assert_eq!(
            (wc.wr_id, wc.status, wc.byte_len),
            (500 + i, WcStatus::Success, size)
        );
        let got = dst.read(slot(i), size as usize).await.unwrap();
        let at = (i * u64::from(size)) as usize;
        assert!(got == data[at..at + size as usize], "message {i}");
    }

    // A refusal in the middle: a region without LOCAL_WRITE.
    let readonly = b.pd.reg_mr(vec![0u8; 64], AccessFlags::NONE).await.unwrap();
    let wrs = [
        RecvWr {
            wr_id: 1,
            sge: dst.sge(0, 64).unwrap().into(),
        },
        RecvWr {
            wr_id: 2,
            sge: dst.sge(64, 64).unwrap().into(),
        },
        RecvWr {
            wr_id: 3,
            sge: readonly.sge(0, 64).unwrap().into(),
        },
        RecvWr {
            wr_id: 4,
            sge: dst.sge(128, 64).unwrap().into(),
        },
    ];
    let r = b.qp.post_recv_batch(wrs).await;
    assert!(
        matches!(
            r,
            Err(ApiError::BatchRefused {
                posted: 2,
                error: VerbsError::AccessDenied { .. }
            })
        ),
        "{r:?}"
    );
    // The two posted are there, in order; the fourth was not posted.
    for id in [1, 2] {
        a.qp.send(src.sge(0, 64).unwrap()).await.unwrap();
        let wc = b.cq.next().await.unwrap();
        assert_eq!((wc.wr_id, wc.status), (id, WcStatus::Success));
    }

    // Beyond the receive queue's room.
    let caps = metaroce_io::QpCaps {
        max_recv_wr: 3,
        ..Default::default()
    };
    let qb = b.pd.create_qp_with(&b.cq, &b.cq, caps).await.unwrap();
    let qa = a.pd.create_qp(&a.cq, &a.cq).await.unwrap();
    qa.connect(&a.conn, qb.qpn()).await.unwrap();
    qb.connect(&b.conn, qa.qpn()).await.unwrap();
    let wrs = (0..5).map(|i| RecvWr {
        wr_id: i,
        sge: dst.sge(i * 64, 64).unwrap().into(),
    });
    let r = qb.post_recv_batch(wrs).await;
    assert!(
        matches!(
            r,
            Err(ApiError::BatchRefused {
                posted: 3,
                error: VerbsError::QueueFull(3)
            })
        ),
        "{r:?}"
    );
}

#[test]
fn receive_chains_portable() {
    run(Backend::Portable, receive_chains);
}

#[test]
fn receive_chains_io_uring() {
    run(Backend::Uring, receive_chains);
}

/// Registering a large buffer maps its pages without holding up the
/// executor: a 1 ms ticker on the same single-threaded runtime keeps
/// ticking while 256 MiB (about 100 ms of mapping) is registered.
async fn reg_mr_does_not_block_the_executor(backend: Backend) {
    let dev = open(config(backend, FaultConfig::default())).await.unwrap();
    let pd = dev.alloc_pd().await.unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let ticker = tokio::spawn({
        let stop = stop.clone();
        async move {
            let mut worst = Duration::ZERO;
            let mut last = std::time::Instant::now();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                tokio::time::sleep(Duration::from_millis(1)).await;
                worst = worst.max(last.elapsed());
                last = std::time::Instant::now();
            }
            worst
        }
    });
    tokio::task::yield_now().await;
    let len = 256 << 20;
    let t0 = std::time::Instant::now();
    let mr = pd
        .reg_mr(RegionBuf::zeroed(len), AccessFlags::LOCAL_WRITE)
        .await
        .unwrap();
    let took = t0.elapsed();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let worst = ticker.await.unwrap();
    println!("256 MiB registered in {took:?}; the ticker's longest gap {worst:?}");
    assert_eq!(mr.len(), len as u64);
    assert!(
        worst < took / 2 + Duration::from_millis(5) || worst < Duration::from_millis(20),
        "the executor was held for {worst:?} of a {took:?} registration"
    );
}

#[test]
fn reg_mr_does_not_block_the_executor_portable() {
    run(Backend::Portable, reg_mr_does_not_block_the_executor);
}

#[test]
fn two_plane_devices_portable() {
    run(Backend::Portable, two_plane_devices);
}

#[test]
fn two_plane_devices_io_uring() {
    run(Backend::Uring, two_plane_devices);
}

#[test]
fn every_operation_io_uring() {
    run(Backend::Uring, every_operation);
}

#[test]
fn every_operation_portable() {
    run(Backend::Portable, every_operation);
}

#[test]
fn completion_queue_posting_io_uring() {
    run(Backend::Uring, completion_queue_posting);
}

#[test]
fn completion_queue_posting_portable() {
    run(Backend::Portable, completion_queue_posting);
}

#[test]
fn error_statuses_io_uring() {
    run(Backend::Uring, error_statuses);
}

#[test]
fn error_statuses_portable() {
    run(Backend::Portable, error_statuses);
}

#[test]
fn write_through_1pct_and_10pct_loss_io_uring() {
    run(Backend::Uring, |b| async move {
        write_through_loss(b, 0.01).await;
        write_through_loss(b, 0.10).await;
    });
}

#[test]
fn write_through_1pct_and_10pct_loss_portable() {
    run(Backend::Portable, |b| async move {
        write_through_loss(b, 0.01).await;
        write_through_loss(b, 0.10).await;
    });
}

#[test]
fn a_device_that_cannot_bind_says_why() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let a = Device::open(config(Backend::Portable, FaultConfig::default()))
            .await
            .unwrap();
        let mut c = config(Backend::Portable, FaultConfig::default());
        c.listen = a.local_addr();
        let e = Device::open(c).await.unwrap_err();
        assert!(
            matches!(e, ApiError::Driver(metaroce_io::DriverError::Bind { .. })),
            "{e}"
        );
    });
}

/// Scatter/gather lists through the async API, over 2% loss: a SEND
/// gathered from 3 elements in 2 regions into a receive of 2, a WRITE from
/// 2, a READ into 2; a SEND longer than its receive's elements; too many
/// elements refused; a region of a posted list does not deregister.
async fn scatter_gather_lists(backend: Backend) {
    use metaroce_io::{QpCaps, SgList, Sge};
    let faults = FaultConfig {
        seed: 39,
        drop: 0.02,
        duplicate: 0.01,
        reorder: 0.02,
        reorder_delay: Duration::from_micros(300),
        per_path: None,
        per_source: None,
    };
    let (a, b) = pair(backend, faults).await;
    let list = |s: &[Sge]| SgList::try_from(s).unwrap();
    let d1 = pattern(41, 300_000);
    let d2 = pattern(42, 200_000);
    let a1 = a.pd.reg_mr(d1.clone(), AccessFlags::NONE).await.unwrap();
    let a2 = a.pd.reg_mr(d2.clone(), AccessFlags::NONE).await.unwrap();
    let b1 =
        b.pd.reg_mr(vec![0u8; 300_000], AccessFlags::LOCAL_WRITE)
            .await
            .unwrap();
    let b2 =
        b.pd.reg_mr(vec![0u8; 300_000], AccessFlags::LOCAL_WRITE)
            .await
            .unwrap();

    // SEND: 100,000 + 50,001 + 30,000 bytes, into 70,000 then 200,000.
    let s = [
        a1.sge(5, 100_000).unwrap(),
        a2.sge(7, 50_001).unwrap(),
        a1.sge(200_000, 30_000).unwrap(),
    ];
    let mut sent = d1[5..100_005].to_vec();
    sent.extend_from_slice(&d2[7..50_008]);
    sent.extend_from_slice(&d1[200_000..230_000]);
    let r = b.qp.recv(list(&[
        b1.sge(10, 70_000).unwrap(),
        b2.sge(0, 200_000).unwrap(),
    ]));
    let wc = a.qp.send(list(&s)).await.unwrap();
    assert_eq!(wc.byte_len, 180_001);
    assert_eq!(r.await.unwrap().byte_len, 180_001);
    let got1 = b1.read(0, 300_000).await.unwrap();
    let got2 = b2.read(0, 300_000).await.unwrap();
    assert!(got1[10..70_010] == sent[..70_000], "first receive element");
    assert!(got2[..110_001] == sent[70_000..], "second receive element");
    assert!(got1[..10].iter().chain(&got1[70_010..]).all(|&x| x == 0));
    assert!(got2[110_001..].iter().all(|&x| x == 0));

    // WRITE from 2 elements.
    let win =
        b.pd.reg_mr(
            vec![0u8; 400_000],
            AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
        )
        .await
        .unwrap();
    let w = [a2.sge(1, 150_000).unwrap(), a1.sge(3, 120_003).unwrap()];
    let wc =
        a.qp.write(list(&w), win.remote().at(100, 270_003).unwrap())
            .await
            .unwrap();
    assert_eq!(wc.byte_len, 270_003);
    let mut written = d2[1..150_001].to_vec();
    written.extend_from_slice(&d1[3..120_006]);
    let got = win.read(0, 400_000).await.unwrap();
    assert!(got[100..270_103] == written[..], "WRITE bytes");
    assert!(got[..100].iter().chain(&got[270_103..]).all(|&x| x == 0));

    // READ it back into 2 elements of 2 regions.
    let r1 =
        a.pd.reg_mr(vec![0u8; 200_000], AccessFlags::LOCAL_WRITE)
            .await
            .unwrap();
    let r2 =
        a.pd.reg_mr(vec![0u8; 200_000], AccessFlags::LOCAL_WRITE)
            .await
            .unwrap();
    let rd = [r2.sge(9, 100_001).unwrap(), r1.sge(0, 170_002).unwrap()];
    let wc =
        a.qp.read(list(&rd), win.remote().at(100, 270_003).unwrap())
            .await
            .unwrap();
    assert_eq!(wc.byte_len, 270_003);
    let back2 = r2.read(0, 200_000).await.unwrap();
    let back1 = r1.read(0, 200_000).await.unwrap();
    assert!(
        back2[9..100_010] == written[..100_001],
        "READ, first element"
    );
    assert!(
        back1[..170_002] == written[100_001..],
        "READ, second element"
    );
    assert!(back2[..9].iter().chain(&back2[100_010..]).all(|&x| x == 0));
    assert!(back1[170_002..].iter().all(|&x| x == 0));
    let sa = a.conn.stats().await.unwrap().unwrap();
    let sb = b.conn.stats().await.unwrap().unwrap();
    assert!(
        sa.retransmits > 0 && sb.retransmits > 0,
        "lost packets were sent again: {} {}",
        sa.retransmits,
        sb.retransmits
    );

    // Too many elements: refused, the QP unharmed.
    let five = [a1.sge(0, 1).unwrap(); 5];
    assert!(matches!(
        SgList::try_from(&five[..]),
        Err(VerbsError::TooManySge { n: 5, max: 4 })
    ));
    let caps = QpCaps {
        max_send_sge: 2,
        max_recv_sge: 1,
        ..QpCaps::default()
    };
    let narrow = a.pd.create_qp_with(&a.cq, &a.cq, caps).await.unwrap();
    let narrow_b = b.pd.create_qp_with(&b.cq, &b.cq, caps).await.unwrap();
    narrow.connect(&a.conn, narrow_b.qpn()).await.unwrap();
    narrow_b.connect(&b.conn, narrow.qpn()).await.unwrap();
    let e = narrow.send(list(&s)).await;
    assert!(
        matches!(
            e,
            Err(ApiError::Verbs(VerbsError::TooManySge { n: 3, max: 2 }))
        ),
        "{e:?}"
    );
    let two_r = list(&[b1.sge(0, 10).unwrap(), b1.sge(10, 10).unwrap()]);
    let e = narrow_b.recv(two_r).await;
    assert!(
        matches!(
            e,
            Err(ApiError::Verbs(VerbsError::TooManySge { n: 2, max: 1 }))
        ),
        "{e:?}"
    );
    let e = narrow_b.post_recv(RecvWr::new(1, two_r)).await;
    assert!(
        matches!(
            e,
            Err(ApiError::Verbs(VerbsError::TooManySge { n: 2, max: 1 }))
        ),
        "{e:?}"
    );
    assert_eq!(narrow.state().await.unwrap(), Some(QpState::Rts));

    // A SEND longer than its receive's elements together (100 + 100 for
    // 250): the verbs statuses at both ends, nothing written.
    let small =
        b.pd.reg_mr(vec![0u8; 400], AccessFlags::LOCAL_WRITE)
            .await
            .unwrap();
    let held =
        b.pd.reg_mr(vec![0u8; 100], AccessFlags::LOCAL_WRITE)
            .await
            .unwrap();
    let r = b.qp.recv(list(&[
        small.sge(0, 100).unwrap(),
        held.sge(0, 100).unwrap(),
    ]));
    // The second element's region is held by the posted receive.
    let d = held.dereg().await;
    assert!(
        matches!(d, Err(ApiError::Verbs(VerbsError::MrInUse(1)))),
        "{d:?}"
    );
    let e =
        a.qp.send(list(&[a1.sge(0, 200).unwrap(), a2.sge(0, 50).unwrap()]))
            .await;
    assert!(
        matches!(&e, Err(ApiError::Failed(wc)) if wc.status == WcStatus::RemoteInvalidRequest),
        "{e:?}"
    );
    let e = r.await;
    assert!(
        matches!(&e, Err(ApiError::Failed(wc)) if wc.status == WcStatus::LocalLengthError),
        "{e:?}"
    );
    assert!(small.read(0, 400).await.unwrap().iter().all(|&x| x == 0));
}

#[test]
fn scatter_gather_lists_portable() {
    run(Backend::Portable, scatter_gather_lists);
}

#[test]
fn scatter_gather_lists_io_uring() {
    run(Backend::Uring, scatter_gather_lists);
}

/// The tests listed, in a module of their own, with every device opened
/// as `$mode` says, on each backend.
macro_rules! in_mode {
    ($module:ident, $mode:expr, { $($name:ident: $f:expr;)* }) => {
        mod $module {
            use super::*;
            $(
                #[test]
                fn $name() {
                    run_in($mode, Backend::Portable, $f);
                    run_in($mode, Backend::Uring, $f);
                }
            )*
        }
    };
}

// Every device's endpoint a task of the test's runtime
// (`Device::open_on_runtime`).
in_mode! { on_runtime, Mode::Runtime, {
    every_operation_both_backends: every_operation;
    completion_queue_posting_both_backends: completion_queue_posting;
    error_statuses_both_backends: error_statuses;
    write_through_loss_both_backends: |b| async move {
        write_through_loss(b, 0.01).await;
        write_through_loss(b, 0.10).await;
    };
    two_plane_devices_both_backends: two_plane_devices;
    no_round_trip_stalls_both_backends: no_round_trip_stalls;
    local_errors_complete_at_once_both_backends: local_errors_complete_at_once;
    qp_capacities_and_foreign_handles_both_backends: qp_capacities_and_foreign_handles;
    rnr_retry_zero_both_backends: rnr_retry_zero_fails_a_send_without_a_receive;
    retry_cnt_and_timeout_both_backends: retry_cnt_and_timeout_bound_retry_exceeded;
    regions_lent_in_place_both_backends: regions_lent_in_place;
    batched_and_unsignaled_posts_both_backends: batched_and_unsignaled_posts;
    receive_chains_both_backends: receive_chains;
    reg_mr_does_not_block_the_executor_both_backends: reg_mr_does_not_block_the_executor;
    scatter_gather_lists_both_backends: scatter_gather_lists;
}}

// Every device opened by `Device::open_polled` and no `progress` call:
// the polled device's endpoint thread drives it.
in_mode! { polled, Mode::Polled, {
    every_operation_both_backends: every_operation;
    completion_queue_posting_both_backends: completion_queue_posting;
    error_statuses_both_backends: error_statuses;
    write_through_loss_both_backends: |b| async move {
        write_through_loss(b, 0.01).await;
    };
    two_plane_devices_both_backends: two_plane_devices;
    local_errors_complete_at_once_both_backends: local_errors_complete_at_once;
    batched_and_unsignaled_posts_both_backends: batched_and_unsignaled_posts;
    receive_chains_both_backends: receive_chains;
}}

/// Polls `f` once, without waiting.
fn poll_once<F: std::future::Future + Unpin>(f: &mut F) -> Option<F::Output> {
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    match std::pin::Pin::new(f).poll(&mut cx) {
        std::task::Poll::Ready(v) => Some(v),
        std::task::Poll::Pending => None,
    }
}

/// Two polled devices driven by the test's thread alone, as an RDMA
/// progress loop drives them: 2,000 SEND round trips and a 4 MiB WRITE
/// with immediate data, each request polled without blocking between
/// `progress` calls. The turns that move the data are the caller's (most
/// `progress` calls do something while traffic flows), every byte
/// arrives, and a device of `Device::open` does nothing when asked.
async fn polled_progress(backend: Backend) {
    MODE.with(|m| m.set(Mode::Polled));
    let (a, b) = pair(backend, FaultConfig::default()).await;
    MODE.with(|m| m.set(Mode::Thread));
    // Out of tokio's cooperative budget: the loops below poll the
    // requests' futures many times without yielding to the runtime, as a
    // progress loop on a thread of its own does.
    tokio::task::unconstrained(polled_progress_loops(backend, a, b)).await;
}

async fn polled_progress_loops(backend: Backend, a: Side, b: Side) {
    let drive = || {
        let x = a.dev.progress();
        let y = b.dev.progress();
        x || y
    };
    // Spins the two endpoints until `f` is done; counts the turns that did
    // something.
    fn spin<F: std::future::Future + Unpin>(
        f: &mut F,
        drive: &dyn Fn() -> bool,
        busy: &mut u64,
    ) -> F::Output {
        let deadline = std::time::Instant::now() + LIMIT;
        loop {
            if drive() {
                *busy += 1;
            }
            if let Some(v) = poll_once(f) {
                return v;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "a request never completed"
            );
        }
    }
    let size = 64u32;
    let (ra, rb, [req, resp, echo]) = echo_regions(&a, &b, size, 5).await;
    let mut busy = 0u64;
    let rounds = 2_000;
    for _ in 0..rounds {
        let mut got_b = b.qp.recv(echo);
        let mut got_a = a.qp.recv(resp);
        let mut sent_a = a.qp.send(req);
        spin(&mut got_b, &drive, &mut busy).unwrap();
        let mut sent_b = b.qp.send(echo);
        let wc = spin(&mut got_a, &drive, &mut busy).unwrap();
        assert_eq!(wc.byte_len, size);
        spin(&mut sent_a, &drive, &mut busy).unwrap();
        spin(&mut sent_b, &drive, &mut busy).unwrap();
    }
    assert!(
        busy >= 2 * rounds as u64,
        "only {busy} of the caller's turns moved anything in {rounds} round trips"
    );
    assert_eq!(
        ra.read(u64::from(size), size as usize).await.unwrap(),
        pattern(5, size as usize)
    );
    // A bulk WRITE with immediate data, driven the same way.
    let len = 4u32 << 20;
    let src =
        a.pd.reg_mr(pattern(9, len as usize), AccessFlags::NONE)
            .await
            .unwrap();
    let dst =
        b.pd.reg_mr(
            vec![0u8; len as usize],
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
        )
        .await
        .unwrap();
    let mut got = b.qp.recv(rb.sge(0, 0).unwrap());
    let mut w = a.qp.write_imm(
        src.sge(0, len).unwrap(),
        dst.remote().at(0, len).unwrap(),
        77,
    );
    spin(&mut w, &drive, &mut busy).unwrap();
    let wc = spin(&mut got, &drive, &mut busy).unwrap();
    assert_eq!((wc.imm, wc.byte_len), (Some(77), len));
    assert!(dst.read(0, len as usize).await.unwrap() == pattern(9, len as usize));
    // Asked of a device whose own thread drives it: nothing.
    let t = Device::open(config(backend, FaultConfig::default()))
        .await
        .unwrap();
    assert!(!t.progress());
}

/// A polled device whose caller polls in bursts and stops between them (as
/// NCCL's proxy thread does between collectives), so that the endpoint
/// passes between the caller's thread and its own at every burst: 200
/// rounds of a SEND from `a` polled until `b` has it, then `a` polled until
/// its acknowledgement, then nobody for 3 ms. Every SEND gets through
/// without being sent again (a retransmission is a datagram that waited
/// for a thread). With `Backend::Auto` the device picks the portable
/// backend.
fn polled_device_whose_caller_stops_and_resumes() {
    run(Backend::Portable, |_| async {
        MODE.with(|m| m.set(Mode::Polled));
        let (a, b) = pair(Backend::Portable, FaultConfig::default()).await;
        MODE.with(|m| m.set(Mode::Thread));
        let auto = Device::open_polled(config(Backend::Auto, FaultConfig::default()))
            .await
            .unwrap();
        assert_eq!(auto.backend(), Backend::Portable);
        tokio::task::unconstrained(async move {
            let ra = a.pd.reg_mr(vec![1u8; 64], AccessFlags::NONE).await.unwrap();
            let rb =
                b.pd.reg_mr(vec![0u8; 64], AccessFlags::LOCAL_WRITE)
                    .await
                    .unwrap();
            let deadline = std::time::Instant::now() + LIMIT;
            for _ in 0..200 {
                let mut got = b.qp.recv(rb.sge(0, 8).unwrap());
                let mut sent = a.qp.send(ra.sge(0, 8).unwrap());
                while poll_once(&mut got).is_none() {
                    a.dev.progress();
                    b.dev.progress();
                    assert!(std::time::Instant::now() < deadline, "stuck");
                }
                while poll_once(&mut sent).is_none() {
                    a.dev.progress();
                    assert!(std::time::Instant::now() < deadline, "stuck");
                }
                std::thread::sleep(Duration::from_millis(3));
            }
            let st = a.conn.stats().await.unwrap().unwrap();
            // A few for this shared host's stalls (a thread off its CPU for
            // milliseconds), not one a round.
            assert!(
                st.retransmits <= 5,
                "{} retransmissions and {} timeouts in 200 rounds",
                st.retransmits,
                st.rto_fires
            );
        })
        .await;
    });
}

#[test]
fn polled_device_whose_caller_stops_and_resumes_portable() {
    polled_device_whose_caller_stops_and_resumes();
}

#[test]
fn polled_progress_portable() {
    run(Backend::Portable, polled_progress);
}

/// `post_send_now` and `post_recv_now` on polled devices: posted on the
/// caller's thread, answered there (a receive into no region at once, as
/// `ibv_post_recv` answers), completed to the CQs with the caller's `wr_id`s in order,
/// every byte placed; unsignaled sends leave no completion. A device with
/// its own thread says it is not polled.
async fn posting_now(backend: Backend) {
    MODE.with(|m| m.set(Mode::Polled));
    let (a, b) = pair(backend, FaultConfig::default()).await;
    MODE.with(|m| m.set(Mode::Thread));
    assert!(a.dev.is_polled() && b.dev.is_polled());
    let size = 256u32;
    let (ra, rb, [req, _, echo]) = echo_regions(&a, &b, size, 9).await;
    let bad = metaroce_io::Sge {
        lkey: 0xdead,
        ..echo
    };
    match b.qp.post_recv_now(RecvWr::new(1, bad)) {
        Err(ApiError::Verbs(VerbsError::InvalidKey(0xdead))) => {}
        other => panic!("a receive into no region: {other:?}"),
    }
    let rounds = 200u64;
    let mut wcs = Vec::with_capacity(16);
    for r in 0..rounds {
        b.qp.post_recv_now(RecvWr::new(1000 + r, echo)).unwrap();
        // Every other send unsignaled: done with the next signaled one.
        let wr = SendWr {
            signaled: r % 2 == 1,
            ..SendWr::new(r, SendOp::Send, req)
        };
        a.qp.post_send_now(wr).unwrap();
        let deadline = std::time::Instant::now() + LIMIT;
        let mut got = None;
        while got.is_none() {
            a.dev.progress();
            b.dev.progress();
            wcs.clear();
            b.cq.poll_into(16, &mut wcs);
            got = wcs.first().copied();
            assert!(
                std::time::Instant::now() < deadline,
                "receive {r} never completed"
            );
        }
        let wc = got.unwrap();
        assert_eq!(
            (wc.wr_id, wc.status, wc.byte_len),
            (1000 + r, WcStatus::Success, size)
        );
    }
    // The signaled sends complete, in order; the unsignaled ones do not.
    let mut sends = Vec::new();
    let deadline = std::time::Instant::now() + LIMIT;
    while sends.len() < rounds as usize / 2 {
        a.dev.progress();
        b.dev.progress();
        a.cq.poll_into(16, &mut sends);
        assert!(
            std::time::Instant::now() < deadline,
            "{} sends completed",
            sends.len()
        );
    }
    let ids: Vec<u64> = sends.iter().map(|w| w.wr_id).collect();
    assert_eq!(ids, (0..rounds).filter(|r| r % 2 == 1).collect::<Vec<_>>());
    assert!(sends.iter().all(|w| w.status == WcStatus::Success));
    assert_eq!(
        rb.read(0, size as usize).await.unwrap(),
        pattern(9, size as usize)
    );
    drop(ra);
    // A device with its own thread takes posts through the async calls.
    let c = open(config(backend, FaultConfig::default())).await.unwrap();
    assert!(!c.is_polled());
    let pd = c.alloc_pd().await.unwrap();
    let cq = c.create_cq(4).await.unwrap();
    let qp = pd.create_qp(&cq, &cq).await.unwrap();
    match qp.post_recv_now(RecvWr::new(1, echo)) {
        Err(ApiError::NotPolled) => {}
        other => panic!("a post on a threaded device: {other:?}"),
    }
}

/// Dropped completion queues go: one dropped while its QP still completes
/// to it waits for the QP (what completes to it meanwhile is dropped), and
/// a queue created later, which may take a destroyed one's number, sees
/// nothing of the old one's. Twenty QP pairs in turn, each with a
/// receive left posted that the QP's destruction flushes.
async fn dropped_completion_queues(backend: Backend) {
    let a = open(config(backend, FaultConfig::default())).await.unwrap();
    let b = open(config(backend, FaultConfig::default())).await.unwrap();
    for round in 0..20u64 {
        let (sa, sb) = metaroce_io::connect_qp_pair(&a, &b).await.unwrap();
        let ma = sa
            .pd
            .reg_mr(pattern(round, 64), AccessFlags::NONE)
            .await
            .unwrap();
        let mb = sb
            .pd
            .reg_mr(vec![0u8; 128], AccessFlags::LOCAL_WRITE)
            .await
            .unwrap();
        sb.qp
            .post_recv(RecvWr::new(round, mb.sge(0, 64).unwrap()))
            .await
            .unwrap();
        // Left posted: flushed when the QP goes.
        sb.qp
            .post_recv(RecvWr::new(1000 + round, mb.sge(64, 64).unwrap()))
            .await
            .unwrap();
        sa.qp
            .post_send(SendWr::new(round, SendOp::Send, ma.sge(0, 64).unwrap()))
            .await
            .unwrap();
        let got = sb.cq.next().await.unwrap();
        assert_eq!(
            (got.wr_id, got.status),
            (round, WcStatus::Success),
            "round {round}"
        );
        let sent = sa.cq.next().await.unwrap();
        assert_eq!((sent.wr_id, sent.status), (round, WcStatus::Success));
        let metaroce_io::ConnectedQp {
            qp: qa, cq: cqa, ..
        } = sa;
        let metaroce_io::ConnectedQp {
            qp: qb, cq: cqb, ..
        } = sb;
        if round % 2 == 0 {
            // The queues first: they wait for their QPs.
            drop((cqa, cqb));
            drop((qa, qb));
        } else {
            drop((qa, qb));
            drop((cqa, cqb));
        }
        drop((ma, mb));
    }
}

#[test]
fn dropped_completion_queues_portable() {
    run(Backend::Portable, dropped_completion_queues);
}

#[test]
fn posting_now_portable() {
    run(Backend::Portable, posting_now);
}

#[test]
fn posting_now_io_uring() {
    run(Backend::Uring, posting_now);
}

#[test]
fn polled_progress_io_uring() {
    run(Backend::Uring, polled_progress);
}

/// On a multi-thread runtime the endpoint task moves between the
/// runtime's threads (the io_uring receive is armed again by whichever
/// runs it): every operation still completes, byte-exact.
#[test]
fn on_a_multi_thread_runtime_every_operation_works() {
    for backend in [Backend::Portable, Backend::Uring] {
        if backend == Backend::Uring && metaroce_io::uring_probe().is_err() {
            println!("skipped: io_uring unavailable");
            continue;
        }
        let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        // Every thread of the runtime opens its devices on the runtime.
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .on_thread_start(|| MODE.with(|m| m.set(Mode::Runtime)))
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            // Spawned: the test's own future runs on the worker threads too.
            let h = tokio::spawn(every_operation(backend));
            tokio::time::timeout(LIMIT, h)
                .await
                .expect("test timed out")
                .expect("the test task");
        });
    }
}

/// Without a runtime that has I/O enabled there is no reactor for the
/// endpoint task: a typed error, not a panic or a hang.
#[test]
fn open_on_runtime_without_io_says_so() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let e = rt
        .block_on(Device::open_on_runtime(config(
            Backend::Portable,
            FaultConfig::default(),
        )))
        .unwrap_err();
    assert!(matches!(e, ApiError::NoRuntime), "{e}");
}
