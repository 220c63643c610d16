//! End to end across crates: two endpoints on real UDP sockets over loopback,
//! each on a different backend of `metaroce-io` (io_uring against the
//! portable driver, both ways round), moving RDMA WRITE, SEND and READ data
//! through the full protocol and checking every byte.

use metaroce_io::{connect_pair, uring_probe, Backend, Driver, DriverConfig};
use metaroce_proto::verbs::*;
use std::time::{Duration, Instant};

fn bind(backend: Backend, seed: u64) -> Driver {
    let mut cfg = DriverConfig::new("127.0.0.1:0".parse().unwrap());
    cfg.backend = backend;
    cfg.seed = seed;
    cfg.endpoint.paths = 4;
    cfg.send_sockets = 4;
    Driver::bind(cfg).expect("bind a loopback endpoint")
}

/// Runs both drivers until `done` or the deadline.
fn run(
    a: &mut Driver,
    b: &mut Driver,
    within: Duration,
    mut done: impl FnMut(&mut Driver, &mut Driver) -> bool,
) -> bool {
    let start = Instant::now();
    while start.elapsed() < within {
        if done(a, b) {
            return true;
        }
        a.poll(Duration::from_micros(200)).unwrap();
        b.poll(Duration::from_micros(200)).unwrap();
    }
    done(a, b)
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 11) as u8)
        .collect()
}

fn interop(client_backend: Backend, server_backend: Backend) {
    let mut a = bind(client_backend, 1);
    let mut b = bind(server_backend, 2);
    assert_eq!(a.backend(), client_backend);
    assert_eq!(b.backend(), server_backend);
    let (conn_a, conn_b) =
        connect_pair(&mut a, &mut b, Duration::from_secs(10)).expect("handshake over loopback");

    let len = 4 << 20;
    let data = pattern(len, 7);
    let (ea, eb) = (a.endpoint(), b.endpoint());
    let (pa, pb) = (ea.alloc_pd(), eb.alloc_pd());
    let (ca, cb) = (ea.create_cq(64), eb.create_cq(64));
    let src = ea
        .reg_mr(
            pa,
            data.clone().into_boxed_slice(),
            0,
            AccessFlags::LOCAL_WRITE,
        )
        .unwrap();
    let back = ea
        .reg_mr(
            pa,
            vec![0; len].into_boxed_slice(),
            0,
            AccessFlags::LOCAL_WRITE,
        )
        .unwrap();
    let win = eb
        .reg_mr(
            pb,
            vec![0; len].into_boxed_slice(),
            0x4000_0000,
            AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
        )
        .unwrap();
    let rbuf = eb
        .reg_mr(
            pb,
            vec![0; 4096].into_boxed_slice(),
            0,
            AccessFlags::LOCAL_WRITE,
        )
        .unwrap();
    let qa = ea.create_qp(QpInit::new(pa, ca, ca)).unwrap();
    let qb = eb.create_qp(QpInit::new(pb, cb, cb)).unwrap();
    ea.connect_qp(qa, conn_a, qb).unwrap();
    eb.connect_qp(qb, conn_b, qa).unwrap();
    eb.post_recv(
        qb,
        RecvWr {
            wr_id: 50,
            sge: Sge {
                lkey: rbuf.lkey,
                addr: 0,
                len: 4096,
            }
            .into(),
        },
    )
    .unwrap();

    let remote = RemoteAddr {
        rkey: win.rkey,
        addr: win.addr,
    };
    let now = a.now();
    let ea = a.endpoint();
    ea.post_send(
        now,
        qa,
        SendWr::new(
            1,
            SendOp::Write(remote),
            Sge {
                lkey: src.lkey,
                addr: 0,
                len: len as u32,
            },
        ),
    )
    .unwrap();
    ea.post_send(
        now,
        qa,
        SendWr::new(
            2,
            SendOp::SendImm(9),
            Sge {
                lkey: src.lkey,
                addr: 1000,
                len: 4096,
            },
        ),
    )
    .unwrap();
    ea.post_send(
        now,
        qa,
        SendWr::new(
            3,
            SendOp::Read(remote),
            Sge {
                lkey: back.lkey,
                addr: 0,
                len: len as u32,
            },
        ),
    )
    .unwrap();
    let (mut wa, mut wb) = (Vec::new(), Vec::new());
    let ok = run(&mut a, &mut b, Duration::from_secs(30), |a, b| {
        a.endpoint().poll_cq(ca, 16, &mut wa).unwrap();
        b.endpoint().poll_cq(cb, 16, &mut wb).unwrap();
        wa.len() == 3 && wb.len() == 1
    });
    assert!(ok, "completions: {wa:?} {wb:?}");
    assert_eq!(
        wa.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
        vec![
            (1, WcStatus::Success),
            (2, WcStatus::Success),
            (3, WcStatus::Success)
        ]
    );
    assert_eq!(
        (wb[0].wr_id, wb[0].byte_len, wb[0].imm),
        (50, 4096, Some(9))
    );
    assert!(
        b.endpoint().mr(win.lkey).unwrap() == &data[..],
        "WRITE placed every byte"
    );
    assert_eq!(b.endpoint().mr(rbuf.lkey).unwrap(), &data[1000..5096]);
    assert!(
        a.endpoint().mr(back.lkey).unwrap() == &data[..],
        "READ brought every byte back"
    );
}

fn uring_or_skip() -> bool {
    match uring_probe() {
        Ok(_) => true,
        Err(why) => {
            eprintln!("skipped: io_uring unavailable: {why}");
            false
        }
    }
}

#[test]
fn portable_to_portable() {
    interop(Backend::Portable, Backend::Portable);
}

#[test]
fn uring_client_portable_server() {
    if uring_or_skip() {
        interop(Backend::Uring, Backend::Portable);
    }
}

#[test]
fn portable_client_uring_server() {
    if uring_or_skip() {
        interop(Backend::Portable, Backend::Uring);
    }
}
