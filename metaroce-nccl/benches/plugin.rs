//! The plugin's work per message, without the waiting: two devices of one
//! process over loopback, both driven by this one thread, 8-byte messages
//! back and forth through `ncclNetPlugin_v12` as NCCL's proxy calls it
//! (`irecv` posted, then `isend`, then `test` until done). Every system
//! call, the protocol core, the device layer and the plugin are in the
//! time; the scheduler and the polling loops of two processes are not (the
//! harness's round trip, `metaroce-nccl-harness bench`, has them). For
//! comparing builds of the plugin and of `metaroce-io`'s polled devices.
//!
//! ```sh
//! cargo bench -p metaroce-nccl --bench plugin
//! ```

use criterion::{criterion_group, criterion_main, Criterion};
use metaroce_nccl::abi::{
    NcclResult, NetCommConfig, NetDeviceHandle, NCCL_NET_HANDLE_MAXSIZE, NCCL_PTR_HOST,
};
use metaroce_nccl::ncclNetPlugin_v12 as NET;
use std::ffi::{c_int, c_void};
use std::hint::black_box;
use std::ptr::null_mut;
use std::time::{Duration, Instant};

type Ptr = *mut c_void;

fn ok(what: &str, r: NcclResult) {
    assert_eq!(r, 0, "{what} failed ({r})");
}

/// A send comm from one device to the other and the receive comm it
/// reaches, with a registered 8-byte buffer on each.
struct Pair {
    send: Ptr,
    recv: Ptr,
    smh: Ptr,
    rmh: Ptr,
    sbuf: Box<[u8; 8]>,
    rbuf: Box<[u8; 8]>,
    /// The pair's last send, until tested done.
    sreq: Ptr,
}

/// Connects device `from` to device `to` (listen, then connect and accept
/// retried until both are ready).
fn pair(ctx: Ptr, from: c_int, to: c_int) -> Pair {
    // SAFETY: the calls as NCCL makes them, with live out-pointers.
    unsafe {
        let mut handle = [0u8; NCCL_NET_HANDLE_MAXSIZE];
        let mut listen: Ptr = null_mut();
        ok(
            "listen",
            NET.listen.unwrap()(ctx, to, handle.as_mut_ptr() as Ptr, &mut listen),
        );
        let (mut send, mut recv): (Ptr, Ptr) = (null_mut(), null_mut());
        let mut dev: *mut NetDeviceHandle = null_mut();
        let deadline = Instant::now() + Duration::from_secs(30);
        while send.is_null() || recv.is_null() {
            assert!(Instant::now() < deadline, "connect/accept did not finish");
            if send.is_null() {
                ok(
                    "connect",
                    NET.connect.unwrap()(
                        ctx,
                        from,
                        handle.as_mut_ptr() as Ptr,
                        &mut send,
                        &mut dev,
                    ),
                );
            }
            if recv.is_null() {
                ok("accept", NET.accept.unwrap()(listen, &mut recv, &mut dev));
            }
        }
        ok("closeListen", NET.close_listen.unwrap()(listen));
        let mut sbuf = Box::new([0u8; 8]);
        let mut rbuf = Box::new([0u8; 8]);
        let (mut smh, mut rmh): (Ptr, Ptr) = (null_mut(), null_mut());
        ok(
            "regMr",
            NET.reg_mr.unwrap()(send, sbuf.as_mut_ptr() as Ptr, 8, NCCL_PTR_HOST, &mut smh),
        );
        ok(
            "regMr",
            NET.reg_mr.unwrap()(recv, rbuf.as_mut_ptr() as Ptr, 8, NCCL_PTR_HOST, &mut rmh),
        );
        Pair {
            send,
            recv,
            smh,
            rmh,
            sbuf,
            rbuf,
            sreq: null_mut(),
        }
    }
}

/// Polls request `r` until done; its first size.
fn wait(r: Ptr) -> c_int {
    let mut done = 0;
    let mut sizes = [-1 as c_int; 8];
    while done == 0 {
        // SAFETY: a live request; room for the sizes of one buffer.
        ok("test", unsafe {
            NET.test.unwrap()(r, &mut done, sizes.as_mut_ptr())
        });
    }
    sizes[0]
}

/// One message over `p`: `irecv`, `isend`, then `test` of the receive
/// until done. The send stays outstanding, as in NCCL's proxy: it
/// completes with the acknowledgement that rides on the answer, and is
/// tested (done by then) before the pair's next send.
fn message(p: &mut Pair) {
    // SAFETY: the calls as NCCL's proxy makes them, on the pair's comms and
    // registered buffers, each request tested until done.
    unsafe {
        let mut data = [p.rbuf.as_mut_ptr() as Ptr];
        let mut sizes = [8usize];
        let mut tags = [0 as c_int];
        let mut mhs = [p.rmh];
        let mut phs = [null_mut()];
        let mut rreq: Ptr = null_mut();
        while rreq.is_null() {
            ok(
                "irecv",
                NET.irecv.unwrap()(
                    p.recv,
                    1,
                    data.as_mut_ptr(),
                    sizes.as_mut_ptr(),
                    tags.as_mut_ptr(),
                    mhs.as_mut_ptr(),
                    phs.as_mut_ptr(),
                    &mut rreq,
                ),
            );
        }
        if !p.sreq.is_null() {
            assert_eq!(wait(p.sreq), 8);
            p.sreq = null_mut();
        }
        while p.sreq.is_null() {
            ok(
                "isend",
                NET.isend.unwrap()(
                    p.send,
                    p.sbuf.as_mut_ptr() as Ptr,
                    8,
                    0,
                    p.smh,
                    null_mut(),
                    &mut p.sreq,
                ),
            );
        }
        assert_eq!(wait(rreq), 8);
    }
}

fn plugin(c: &mut Criterion) {
    // Two devices on loopback, polled by this thread.
    std::env::set_var("METAROCE_ADDRS", "127.0.0.1,127.0.0.1");
    std::env::set_var("METAROCE_BACKEND", "portable");
    let mut ctx: Ptr = null_mut();
    let mut cfg = NetCommConfig { traffic_class: -1 };
    // SAFETY: init as NCCL calls it, once, before any other call.
    ok("init", unsafe {
        NET.init.unwrap()(&mut ctx, 1, &mut cfg, None, None)
    });
    let mut there = pair(ctx, 0, 1);
    let mut back = pair(ctx, 1, 0);
    for _ in 0..2000 {
        message(&mut there);
        message(&mut back);
    }
    let mut g = c.benchmark_group("plugin");
    g.bench_function("round_trip_8b_one_thread", |b| {
        b.iter(|| {
            message(&mut there);
            message(&mut back);
            black_box(there.rbuf[0]);
        })
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(5)).warm_up_time(Duration::from_secs(1));
    targets = plugin
}
criterion_main!(benches);
