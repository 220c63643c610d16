#![cfg(target_os = "linux")]
//! Transfers over loopback through the driver's fault injector, on both
//! backends: seeded loss (1% and 10%), duplication and reordering of every
//! received datagram, and a path whose every datagram is dropped. Every
//! payload byte must arrive intact and every completion be a success, within
//! a few seconds.
//!
//! The tests take a lock, so that they run one at a time and each one's
//! time bound measures it alone (two busy-polling endpoints per test).
//! Where io_uring is unavailable the io_uring variants print
//! `skipped: io_uring unavailable: <reason>` and pass.

mod common;

use common::{pattern, runnable, Pair};
use metaroce_io::{DriverConfig, FaultConfig, IoDriver, PortableDriver, UringDriver};
use metaroce_proto::verbs::*;
use metaroce_proto::EndpointConfig;
use std::sync::Mutex;
use std::time::Duration;

/// Every test ends within this.
const LIMIT: Duration = Duration::from_secs(8);

static SERIAL: Mutex<()> = Mutex::new(());

fn config() -> DriverConfig {
    let mut c = DriverConfig::new("127.0.0.1:0".parse().unwrap());
    c.endpoint = EndpointConfig {
        paths: 4,
        ..EndpointConfig::default()
    };
    c.send_sockets = 8;
    c
}

/// Loss `p`, plus 1% duplication and 2% reordering (held 300 µs).
fn lossy(seed: u64, p: f64) -> FaultConfig {
    FaultConfig {
        seed,
        drop: p,
        duplicate: 0.01,
        reorder: 0.02,
        reorder_delay: Duration::from_micros(300),
        per_path: None,
        per_source: None,
    }
}

/// Two endpoints connected cleanly, then with `fa`/`fb` injected at each end.
fn faulty_pair<D: IoDriver>(fa: FaultConfig, fb: FaultConfig) -> Pair<D> {
    let mut p = Pair::<D>::connect(config(), LIMIT);
    p.a.set_faults(fa);
    p.b.set_faults(fb);
    p
}

/// What a faulty run did, for the test log.
fn report<D: IoDriver>(p: &mut Pair<D>, what: &str) {
    let cs = p.a.endpoint().connection_stats(p.conn_a).unwrap();
    println!(
        "{what}: {:?}; a {:?}; b {:?}; a's connection: {} retransmits ({} fast), {} RTO fires, {} path failures",
        p.start.elapsed(),
        p.a.stats(),
        p.b.stats(),
        cs.retransmits,
        cs.fast_retransmits,
        cs.rto_fires,
        cs.path_failures
    );
}

/// Two 2 MiB WRITEs from `a` to `b`, checked byte by byte.
fn write_through<D: IoDriver>(name: &str, fa: FaultConfig, fb: FaultConfig) -> Pair<D> {
    let mut p = faulty_pair::<D>(fa, fb);
    p.write_checked(name, 4 << 20, 2);
    p
}

fn write_loss<D: IoDriver>(name: &str, loss: f64) {
    if !runnable(name) {
        return;
    }
    let mut p = write_through::<D>(name, lossy(1, loss), lossy(2, loss));
    report(&mut p, &format!("{name}: WRITE at {}% loss", loss * 100.0));
    let (sa, sb) = (p.a.stats(), p.b.stats());
    assert!(sb.faults_dropped > 0, "loss was injected");
    if loss >= 0.1 {
        assert!(sa.faults_dropped > 0, "ACKs were lost too");
    }
    assert!(sb.faults_duplicated > 0 && sb.faults_delayed > 0);
    let cs = p.a.endpoint().connection_stats(p.conn_a).unwrap();
    assert!(cs.retransmits > 0, "{name}: losses were repaired");
}

fn write_1pct<D: IoDriver>(name: &str) {
    write_loss::<D>(name, 0.01)
}

fn write_10pct<D: IoDriver>(name: &str) {
    write_loss::<D>(name, 0.10)
}

/// SEND/RECV with immediates at 10% loss both ways.
fn send_recv_10pct<D: IoDriver>(name: &str) {
    if !runnable(name) {
        return;
    }
    const N: usize = 16;
    const MSG: usize = 128_000;
    let mut p = faulty_pair::<D>(lossy(3, 0.10), lossy(4, 0.10));
    p.send_recv_checked(name, N, MSG);
    report(&mut p, &format!("{name}: SEND/RECV at 10% loss"));
    assert!(p.b.stats().faults_dropped > 0);
}

/// A READ of 4 MiB at 10% loss both ways (the data flows from `b`).
fn read_10pct<D: IoDriver>(name: &str) {
    if !runnable(name) {
        return;
    }
    const LEN: usize = 4 << 20;
    let mut p = faulty_pair::<D>(lossy(5, 0.10), lossy(6, 0.10));
    p.read_checked(name, LEN);
    report(&mut p, &format!("{name}: READ at 10% loss"));
    assert!(p.a.stats().faults_dropped > 0);
}

/// `b` drops everything that comes from one of `a`'s path source ports:
/// the core declares the path failed, moves it to another port, and the
/// WRITE completes.
fn one_path_blackholed<D: IoDriver>(name: &str) {
    if !runnable(name) {
        return;
    }
    // a's path ports are known once the connection is up: the faults go on after.
    let mut p = faulty_pair::<D>(FaultConfig::default(), FaultConfig::default());
    let before = p.a.endpoint().connection_stats(p.conn_a).unwrap();
    let port = before.paths[0].src_port;
    p.b.set_faults(FaultConfig::blackhole(vec![port]));
    let start = p.start;
    const LEN: usize = 4 << 20;
    let data = pattern(7, LEN);
    let src =
        p.a.endpoint()
            .reg_mr(p.pda, data.clone().into_boxed_slice(), 0, AccessFlags::NONE)
            .unwrap();
    let dst =
        p.b.endpoint()
            .reg_mr(
                p.pdb,
                vec![0u8; LEN].into_boxed_slice(),
                0,
                AccessFlags::REMOTE_WRITE,
            )
            .unwrap();
    let wr = SendWr::new(
        1,
        SendOp::Write(RemoteAddr {
            rkey: dst.rkey,
            addr: dst.addr,
        }),
        Sge {
            lkey: src.lkey,
            addr: src.addr,
            len: LEN as u32,
        },
    );
    // Declaring the path failed takes its retransmission timeouts: a WRITE
    // that the other paths finish sooner (a fast machine) is repeated, up
    // to a few times, until they have run.
    for round in 0..8 {
        p.b.endpoint().mr_mut(dst.lkey).unwrap().fill(0);
        let now = p.a.now();
        p.a.endpoint().post_send(now, p.qa, wr).unwrap();
        p.complete(1, 0);
        let got = p.b.endpoint().mr(dst.lkey).unwrap();
        assert!(got == &data[..], "{name}: WRITE {round} data differs");
        let stats = p.a.endpoint().connection_stats(p.conn_a).unwrap();
        if stats.path_failures > 0 {
            break;
        }
    }
    let after = p.a.endpoint().connection_stats(p.conn_a).unwrap();
    report(&mut p, &format!("{name}: path on port {port} blackholed"));
    println!(
        "{name}: path ports before {:?}, after {:?}, took {:?}",
        before.paths.iter().map(|s| s.src_port).collect::<Vec<_>>(),
        after.paths.iter().map(|s| s.src_port).collect::<Vec<_>>(),
        start.elapsed()
    );
    assert!(
        p.b.stats().faults_dropped > 0,
        "the path's datagrams were dropped"
    );
    assert!(
        after.path_failures > 0,
        "{name}: the path was declared failed"
    );
    assert!(
        after.paths.iter().all(|s| s.src_port != port),
        "{name}: no path uses the dead port any more"
    );
}

macro_rules! suite {
    ($($test:ident),*) => {
        mod portable {
            $(#[test] fn $test() {
                let _g = super::SERIAL.lock().unwrap_or_else(|e| e.into_inner());
                super::$test::<super::PortableDriver>("portable")
            })*
        }
        mod io_uring {
            $(#[test] fn $test() {
                let _g = super::SERIAL.lock().unwrap_or_else(|e| e.into_inner());
                super::$test::<super::UringDriver>("io_uring")
            })*
        }
    };
}

suite!(
    write_1pct,
    write_10pct,
    send_recv_10pct,
    read_10pct,
    one_path_blackholed
);
