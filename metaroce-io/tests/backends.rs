#![cfg(target_os = "linux")]
//! One end-to-end loopback suite, run against every backend: two endpoints
//! on 127.0.0.1 talking the full protocol through the kernel, every payload
//! byte checked. Generic over [`IoDriver`]; each test is bounded in time.
//!
//! Where io_uring is unavailable (no kernel support, `EPERM` in a sandbox)
//! the io_uring variants print `skipped: io_uring unavailable: <reason>` and
//! pass.

mod common;

use common::{pattern, runnable, Pair};
use metaroce_io::{
    Backend, Driver, DriverConfig, DriverStats, FaultConfig, IoDriver, PortableDriver, UringDriver,
};
use metaroce_proto::verbs::*;
use metaroce_proto::{EndpointConfig, Event};
use std::time::{Duration, Instant};

/// Every test ends within this (a hang is a failure, not a stuck CI job).
const LIMIT: Duration = Duration::from_secs(30);

fn config(gso: usize) -> DriverConfig {
    let mut c = DriverConfig::new("127.0.0.1:0".parse().unwrap());
    c.endpoint = EndpointConfig {
        paths: 4,
        max_gso_segments: gso,
        ..EndpointConfig::default()
    };
    c.send_sockets = 4;
    c.max_gso_segments = gso;
    c
}

/// Two connected endpoints on backend `D`, bound with `cfg`.
fn pair<D: IoDriver>(cfg: DriverConfig) -> Pair<D> {
    Pair::connect(cfg, LIMIT)
}

/// Three 2 MiB WRITEs, checked byte by byte.
fn write_several_mib<D: IoDriver>(name: &str, gso: usize) -> Pair<D> {
    let mut p = pair::<D>(config(gso));
    p.write_checked(name, 6 << 20, 3);
    p
}

fn write<D: IoDriver>(name: &str) {
    if !runnable(name) {
        return;
    }
    let p = write_several_mib::<D>(name, 1);
    assert_eq!(p.a.backend().name(), name);
    assert_eq!(p.a.stats().gso_sends, 0, "GSO off: one datagram per send");
    println!("{name}: a {:?}\n{name}: b {:?}", p.a.stats(), p.b.stats());
}

fn write_gso<D: IoDriver>(name: &str) {
    if !runnable(name) {
        return;
    }
    let mut p = write_several_mib::<D>(name, 16);
    let (sa, sb) = (p.a.stats(), p.b.stats());
    println!("{name}: a {sa:?}\n{name}: b {sb:?}");
    assert!(
        p.a.endpoint().config().max_gso_segments > 1,
        "{name}: the kernel has GSO"
    );
    assert!(
        sa.gso_sends > 0,
        "{name}: batches went out with UDP_SEGMENT"
    );
    assert!(
        sa.datagrams_sent > sa.gso_sends,
        "{name}: batches carry several datagrams"
    );
    assert!(sb.gro_batches > 0, "{name}: loopback delivers GRO batches");
}

fn send_recv<D: IoDriver>(name: &str) {
    if !runnable(name) {
        return;
    }
    const N: usize = 16;
    const MSG: usize = 100_000;
    let mut p = pair::<D>(config(16));
    p.send_recv_checked(name, N, MSG);
}

/// Request/answer round trips over real sockets, both drivers polled from
/// this thread: each SEND carries the ACK of the one before it (PROTOCOL
/// §6.7), so a round trip costs about two datagrams, where every SEND
/// acknowledged on its own costs four; every message arrives intact. The
/// 2 KiB messages are gathered from their regions behind the ACK's bytes
/// (io_uring) or copied behind them (portable).
fn ping_pong_acks_ride_on_the_answers<D: IoDriver>(name: &str) {
    if !runnable(name) {
        return;
    }
    const ROUNDS: u64 = 200;
    const MSG: usize = 2048;
    let per_round = |coalesce: bool| {
        let mut cfg = config(16);
        cfg.endpoint.coalesce_acks = coalesce;
        // A hold (and the delayed-ACK time that bounds it) well past a
        // turn of this unoptimised test build: the default 20 µs is
        // shorter than one here.
        cfg.endpoint.ack_delay = Duration::from_millis(5);
        cfg.endpoint.ack_hold = Duration::from_millis(5);
        let mut p = pair::<D>(cfg);
        let reg = |d: &mut D, pd| {
            d.endpoint()
                .reg_mr(
                    pd,
                    vec![0u8; 2 * MSG].into_boxed_slice(),
                    0,
                    AccessFlags::LOCAL_WRITE,
                )
                .unwrap()
        };
        let (ma, mb) = (reg(&mut p.a, p.pda), reg(&mut p.b, p.pdb));
        let sge = |m: &MrInfo, at: usize| Sge {
            lkey: m.lkey,
            addr: at as u64,
            len: MSG as u32,
        };
        let recv = RecvWr {
            wr_id: 0,
            sge: sge(&ma, MSG).into(),
        };
        p.a.endpoint().post_recv(p.qa, recv).unwrap();
        let recv = RecvWr {
            wr_id: 0,
            sge: sge(&mb, MSG).into(),
        };
        p.b.endpoint().post_recv(p.qb, recv).unwrap();
        let before = p.a.stats().datagrams_sent + p.b.stats().datagrams_sent;
        let mut wcs = Vec::new();
        for r in 0..ROUNDS {
            // A asks (message 2r), B answers (2r + 1) as soon as it has it.
            for (tag, from_a) in [(2 * r, true), (2 * r + 1, false)] {
                // The side that asks (or answers) and the side that receives.
                let ((tx, tcq, tqp, tm), (rx, rcq, rqp, rm)) = if from_a {
                    ((&mut p.a, p.cqa, p.qa, ma), (&mut p.b, p.cqb, p.qb, mb))
                } else {
                    ((&mut p.b, p.cqb, p.qb, mb), (&mut p.a, p.cqa, p.qa, ma))
                };
                tx.endpoint().mr_mut(tm.lkey).unwrap()[..MSG].copy_from_slice(&pattern(tag, MSG));
                let now = tx.now();
                let wr = SendWr::new(tag, SendOp::Send, sge(&tm, 0));
                tx.endpoint().post_send(now, tqp, wr).unwrap();
                loop {
                    assert!(p.start.elapsed() < p.limit, "{name}: round {r} timed out");
                    tx.poll(Duration::ZERO).unwrap();
                    rx.poll(Duration::ZERO).unwrap();
                    wcs.clear();
                    rx.endpoint().poll_cq(rcq, 8, &mut wcs).unwrap();
                    tx.endpoint().poll_cq(tcq, 8, &mut wcs).unwrap();
                    assert!(wcs.iter().all(|w| w.status == WcStatus::Success), "{wcs:?}");
                    if wcs.iter().any(|w| w.opcode == WcOpcode::Recv) {
                        break;
                    }
                }
                let got = &rx.endpoint().mr(rm.lkey).unwrap()[MSG..];
                assert!(got == pattern(tag, MSG), "{name}: message {tag} differs");
                let recv = RecvWr {
                    wr_id: 0,
                    sge: sge(&rm, MSG).into(),
                };
                rx.endpoint().post_recv(rqp, recv).unwrap();
            }
        }
        let sent = p.a.stats().datagrams_sent + p.b.stats().datagrams_sent - before;
        let coalesced =
            p.a.endpoint()
                .connection_stats(p.conn_a)
                .unwrap()
                .acks_coalesced
                + p.b
                    .endpoint()
                    .connection_stats(p.conn_b)
                    .unwrap()
                    .acks_coalesced;
        (sent as f64 / ROUNDS as f64, coalesced)
    };
    let (riding, coalesced) = per_round(true);
    let (apart, none) = per_round(false);
    println!("{name}: datagrams per round trip {riding:.2} with ACKs riding on the answers, {apart:.2} apart");
    assert_eq!(none, 0, "{name}: coalescing off sends no coalesced ACK");
    assert!(
        apart >= 3.9,
        "{name}: every SEND acknowledged on its own: {apart:.2}"
    );
    // The hold is 20 µs of real time; a thread descheduled longer lets an
    // ACK go alone now and then, never most of them.
    assert!(
        riding <= 2.5,
        "{name}: {riding:.2} datagrams per round trip"
    );
    assert!(coalesced >= ROUNDS, "{name}: {coalesced} ACKs rode on DATA");
}

fn read<D: IoDriver>(name: &str) {
    if !runnable(name) {
        return;
    }
    const LEN: usize = 4 << 20;
    let mut p = pair::<D>(config(16));
    p.read_checked(name, LEN);
}

/// With nothing to do, `poll` sleeps until the core's timer (not busy, not
/// forever): a connection to a port nobody serves fails after its HELLO
/// retries, each retry woken by the driver's timer.
fn timers_wake_the_wait<D: IoDriver>(name: &str) {
    if !runnable(name) {
        return;
    }
    let mut cfg = config(1);
    cfg.endpoint.handshake_rto = Duration::from_millis(20);
    cfg.endpoint.handshake_retries = 3;
    let mut a = D::bind(cfg).unwrap();
    let dead = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let peer = dead.local_addr().unwrap();
    drop(dead);
    let t0 = Instant::now();
    let now = a.now();
    let conn = a.endpoint().connect(now, peer).unwrap();
    let mut lost = false;
    let mut polls = 0u32;
    while !lost {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "{name}: no timeout fired"
        );
        a.poll(Duration::from_secs(1)).unwrap();
        polls += 1;
        while let Some(e) = a.endpoint().poll_event() {
            if matches!(e, Event::ConnectionLost { conn: c, .. } if c == conn) {
                lost = true;
            }
        }
    }
    let took = t0.elapsed();
    println!(
        "{name}: connection lost after {took:?}, {polls} polls, {:?}",
        a.stats()
    );
    assert!(
        took >= Duration::from_millis(50),
        "{name}: retries were waited for"
    );
    assert!(polls < 500, "{name}: the driver slept between timers");
    assert!(
        took < Duration::from_millis(800),
        "{name}: woken by the core's timers, not by max_wait"
    );
    assert!(a.stats().waits > 0);
}

/// A wake that came before `poll` makes it return at once, as [`Waker`]
/// promises, even when the turn's own first look consumes it (io_uring
/// reaps the waker's poll completion with the datagrams): a turn that
/// swallowed it and then slept held back the command it announced (the
/// async API's 100 ms stalls).
///
/// [`Waker`]: metaroce_io::Waker
fn a_wake_before_the_poll_is_not_lost<D: IoDriver>(name: &str) {
    if !runnable(name) {
        return;
    }
    let mut a = D::bind(config(1)).unwrap();
    let waker = a.waker().unwrap();
    for _ in 0..3 {
        // Arms the waker's poll (io_uring: on the ring).
        a.poll(Duration::ZERO).unwrap();
    }
    for round in 0..5 {
        waker.wake();
        // The kernel sees the byte and completes the waker's poll.
        std::thread::sleep(Duration::from_millis(5));
        let t0 = Instant::now();
        a.poll(Duration::from_secs(1)).unwrap();
        let took = t0.elapsed();
        assert!(
            took < Duration::from_millis(200),
            "{name}: round {round}: a poll after a wake slept {took:?}"
        );
    }
}

/// Each side on its own thread with blocking waits, as `metaroce perf` runs.
fn threaded_write<D: IoDriver + Send + 'static>(name: &str) {
    if !runnable(name) {
        return;
    }
    let (sa, sb) = threaded_write_polling::<D>(name, Duration::ZERO);
    assert!(sb.waits > 0 || sa.waits > 0);
    assert_eq!(
        sa.busy_polls + sb.busy_polls,
        0,
        "{name}: no busy poll unless configured"
    );
}

/// [`threaded_write`] with drivers that busy-poll before they sleep: the
/// data still arrives intact. (Whether a poll finds work here depends on
/// the machine's load; `busy_poll_finds_a_datagram` checks that it does.)
fn threaded_write_busy_poll<D: IoDriver + Send + 'static>(name: &str) {
    if !runnable(name) {
        return;
    }
    let (sa, sb) = threaded_write_polling::<D>(name, Duration::from_millis(20));
    println!("{name}: client {sa:?}\nserver {sb:?}");
}

/// A driver polling for a second finds a datagram that comes 20 ms into
/// its turn: the turn ends then, without a sleep, counted as a busy poll.
fn busy_poll_finds_a_datagram<D: IoDriver>(name: &str) {
    if !runnable(name) {
        return;
    }
    let mut cfg = config(1);
    cfg.busy_poll = Duration::from_secs(1);
    let mut a = D::bind(cfg).unwrap();
    // A first turn arms the receive.
    a.poll(Duration::ZERO).unwrap();
    let to = a.local_addr();
    let sender = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(20));
        let s = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        // Not metaroce: the endpoint rejects it, after the driver read it.
        s.send_to(b"not a metaroce datagram", to).unwrap();
    });
    let t0 = Instant::now();
    a.poll(Duration::from_secs(2)).unwrap();
    let took = t0.elapsed();
    sender.join().unwrap();
    let st = a.stats();
    assert_eq!(st.busy_polls, 1, "{name}: the poll found it: {st:?}");
    assert_eq!(st.waits, 0, "{name}: no sleep: {st:?}");
    assert_eq!(st.datagrams_received, 1, "{name}: {st:?}");
    assert!(
        took < Duration::from_millis(900),
        "{name}: the turn ended when the datagram came, after {took:?}"
    );
}

/// More datagrams arrive at once than the completion queue holds (eight
/// submission entries, the fewest the driver sets up: 32 completions; 128
/// receive buffers, so that the buffers are not what ends the receive):
/// their completions overflow into the kernel's list, and the multishot
/// receive ends with its last one there. Turns that never wait and have
/// nothing to submit must still flush that list, or the receive is never
/// armed again and nothing more is read.
#[test]
fn io_uring_overflowed_completions_are_flushed() {
    if !runnable("io_uring") {
        return;
    }
    let mut cfg = config(1);
    cfg.uring.entries = 8;
    cfg.uring.recv_buffers = 128;
    let mut a = UringDriver::bind(cfg).unwrap();
    // The first turn arms the receive.
    a.poll(Duration::ZERO).unwrap();
    let to = a.local_addr();
    let s = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    const SENT: u64 = 64;
    for _ in 0..SENT {
        // Not metaroce: the endpoint rejects each, after the driver read it.
        s.send_to(b"not a metaroce datagram", to).unwrap();
    }
    std::thread::sleep(Duration::from_millis(20));
    let t0 = Instant::now();
    while a.stats().datagrams_received < SENT && t0.elapsed() < Duration::from_secs(2) {
        a.poll(Duration::ZERO).unwrap();
    }
    let st = a.stats();
    assert_eq!(
        st.datagrams_received, SENT,
        "io_uring: overflowed completions were never flushed: {st:?}"
    );
    assert!(
        st.recv_arms > 1,
        "io_uring: the receive never ended, so nothing overflowed and the test shows nothing: {st:?}"
    );
}

/// An io_uring turn with nothing to submit, nothing to wait for and no
/// completion held by the kernel makes no system call; a datagram that
/// then comes from another thread (its completion held as task work until
/// this thread enters the kernel or is interrupted) is still read.
#[test]
fn io_uring_idle_turns_make_no_system_call() {
    if !runnable("io_uring") {
        return;
    }
    let mut a = UringDriver::bind(config(1)).unwrap();
    // The first turn arms the receive: a submission.
    a.poll(Duration::ZERO).unwrap();
    let armed = a.stats();
    for _ in 0..10 {
        a.poll(Duration::ZERO).unwrap();
    }
    let idle = a.stats();
    assert_eq!(idle.submits, armed.submits, "idle turns entered the kernel");
    assert_eq!(idle.idle_turns, armed.idle_turns + 10);
    let to = a.local_addr();
    let sent = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = sent.clone();
    let sender = std::thread::spawn(move || {
        let s = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        // Not metaroce: the endpoint rejects it, after the driver read it.
        s.send_to(b"not a metaroce datagram", to).unwrap();
        flag.store(true, std::sync::atomic::Ordering::Release);
    });
    // Waits without a system call (any would run the task work on the way
    // back and post the completion): the turns below must see that the
    // kernel holds it.
    let t0 = Instant::now();
    while !sent.load(std::sync::atomic::Ordering::Acquire) {
        assert!(t0.elapsed() < LIMIT, "the datagram was never sent");
        std::hint::spin_loop();
    }
    while a.stats().datagrams_received == 0 {
        assert!(t0.elapsed() < LIMIT, "the datagram was never read");
        a.poll(Duration::ZERO).unwrap();
    }
    sender.join().unwrap();
}

/// A busy poll ends with the turn's wait: an idle driver that may poll for
/// a second returns from a 1 ms `poll` long before that second is over,
/// and what it did counts as a wait, not as a busy poll that found work.
fn busy_poll_is_bounded_by_the_wait<D: IoDriver>(name: &str) {
    if !runnable(name) {
        return;
    }
    let mut cfg = config(1);
    cfg.busy_poll = Duration::from_secs(1);
    let mut a = D::bind(cfg).unwrap();
    let t0 = Instant::now();
    for _ in 0..5 {
        a.poll(Duration::from_millis(1)).unwrap();
    }
    let took = t0.elapsed();
    assert!(
        took < Duration::from_millis(500),
        "{name}: 5 polls of 1 ms took {took:?}"
    );
    assert_eq!(a.stats().busy_polls, 0, "{name}: nothing came");
}

/// Writes 4 MiB with each side on its own thread, its driver busy-polling
/// for `busy_poll`; checks the data, returns each side's driver counters.
fn threaded_write_polling<D: IoDriver + Send + 'static>(
    name: &str,
    busy_poll: Duration,
) -> (DriverStats, DriverStats) {
    const LEN: usize = 4 << 20;
    let mut cfg = config(16);
    cfg.busy_poll = busy_poll;
    let Pair {
        mut a,
        mut b,
        qa,
        cqa,
        pda,
        pdb,
        start,
        ..
    } = pair::<D>(cfg);
    let data = pattern(4, LEN);
    let src = a
        .endpoint()
        .reg_mr(pda, data.clone().into_boxed_slice(), 0, AccessFlags::NONE)
        .unwrap();
    let dst = b
        .endpoint()
        .reg_mr(
            pdb,
            vec![0u8; LEN].into_boxed_slice(),
            0,
            AccessFlags::REMOTE_WRITE,
        )
        .unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let s2 = stop.clone();
    let server = std::thread::spawn(move || {
        while !s2.load(std::sync::atomic::Ordering::Relaxed) {
            b.poll(Duration::from_millis(1)).unwrap();
            assert!(start.elapsed() < LIMIT, "server timed out");
        }
        b
    });
    let now = a.now();
    for k in 0..4u64 {
        let off = k * (LEN as u64 / 4);
        let wr = SendWr::new(
            k,
            SendOp::Write(RemoteAddr {
                rkey: dst.rkey,
                addr: dst.addr + off,
            }),
            Sge {
                lkey: src.lkey,
                addr: off,
                len: LEN as u32 / 4,
            },
        );
        a.endpoint().post_send(now, qa, wr).unwrap();
    }
    let mut wcs = Vec::new();
    while wcs.len() < 4 {
        assert!(start.elapsed() < LIMIT, "{name}: client timed out");
        a.poll(Duration::from_millis(1)).unwrap();
        a.endpoint().poll_cq(cqa, 16, &mut wcs).unwrap();
    }
    assert!(wcs.iter().all(|w| w.status == WcStatus::Success));
    // The data is placed before the WRITE is acknowledged.
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut b = server.join().expect("server thread");
    assert!(
        b.endpoint().mr(dst.lkey).unwrap() == &data[..],
        "{name}: data differs"
    );
    (a.stats(), b.stats())
}

/// What a `poll` provoked leaves within that `poll`: the server answers the
/// handshake in the call that reports `Incoming` (even one that slept first),
/// so that a caller may stop polling it right then (as `metaroce perf`'s
/// server does while it waits for the client's QP number).
fn answers_leave_within_the_same_poll<D: IoDriver + Send + 'static>(name: &str) {
    if !runnable(name) {
        return;
    }
    let mut a = D::bind(config(1)).unwrap();
    let mut b = D::bind(config(1)).unwrap();
    let server = b.local_addr();
    let t0 = Instant::now();
    // The server sleeps in `poll` when the client's datagrams arrive.
    let srv = std::thread::spawn(move || {
        loop {
            assert!(t0.elapsed() < Duration::from_secs(5), "no Incoming");
            b.poll(Duration::from_millis(50)).unwrap();
            if let Some(Event::Incoming { .. }) = b.endpoint().poll_event() {
                return b; // never polled again
            }
        }
    });
    std::thread::sleep(Duration::from_millis(20));
    let now = a.now();
    let conn = a.endpoint().connect(now, server).unwrap();
    let mut connected = false;
    while !connected {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "{name}: the ACCEPT stayed queued in the server"
        );
        // A slow client: its datagrams reach a server that sleeps.
        std::thread::sleep(Duration::from_millis(5));
        a.poll(Duration::ZERO).unwrap();
        while let Some(e) = a.endpoint().poll_event() {
            assert_eq!(e, Event::Connected(conn), "{name}");
            connected = true;
        }
    }
    drop(srv.join().unwrap());
}

/// A turn hands the kernel at most `turn_send_bytes` (and at least one
/// transmit) before it goes back to read: with the budget used up by the
/// first GSO batch, one `poll` sends a batch per flush (the portable
/// backend flushes twice a turn); without a budget it sends what the
/// initial window allows.
fn turn_budget<D: IoDriver>(name: &str) {
    if !runnable(name) {
        return;
    }
    let sent_in_one_poll = |budget: usize| {
        let mut cfg = config(16);
        cfg.turn_send_bytes = budget;
        let mut p = pair::<D>(cfg);
        let w = p.post_write(1 << 20, 1);
        p.a.poll(Duration::ZERO).unwrap();
        let (sent, _) = p.data_packets();
        let gso = p.a.endpoint().config().max_gso_segments as u64;
        p.finish_write(name, w);
        (sent, gso)
    };
    let (limited, gso) = sent_in_one_poll(1);
    let (unlimited, _) = sent_in_one_poll(usize::MAX);
    assert!(gso > 1, "{name}: the kernel has GSO");
    assert!(
        limited >= 1 && limited <= 2 * gso,
        "{name}: {limited} datagrams left in one poll with a budget of 1 byte"
    );
    assert!(
        unlimited > 2 * gso,
        "{name}: without a budget one poll sends the initial window ({unlimited} datagrams)"
    );
}

/// A turn reads a bounded amount before it answers: the portable backend
/// up to `turn_recv_bytes` per socket, io_uring what its `recv_buffers`
/// hold. With both at their least, two polls of the receiver take at most
/// two GRO batches of the initial window waiting in its socket; with both
/// large, they take all of it.
fn turn_recv_budget<D: IoDriver>(name: &str) {
    if !runnable(name) {
        return;
    }
    let received_in_two_polls = |bytes: usize, buffers: u16| {
        let mut cfg = config(16);
        cfg.turn_recv_bytes = bytes;
        cfg.uring.recv_buffers = buffers;
        let mut p = pair::<D>(cfg);
        let w = p.post_write(1 << 20, 1);
        // The sender puts its initial window into the receiver's socket.
        for _ in 0..16 {
            p.a.poll(Duration::ZERO).unwrap();
        }
        let (window, _) = p.data_packets();
        p.b.poll(Duration::ZERO).unwrap();
        p.b.poll(Duration::ZERO).unwrap();
        let (_, got) = p.data_packets();
        let gso = p.a.endpoint().config().max_gso_segments as u64;
        p.finish_write(name, w);
        (got, window, gso)
    };
    let (bounded, window, gso) = received_in_two_polls(1, 1);
    assert!(
        window > 2 * gso,
        "{name}: the initial window is several batches ({window} datagrams)"
    );
    assert!(
        bounded >= 1 && bounded <= 2 * gso,
        "{name}: {bounded} of {window} datagrams read in two polls with the least budget"
    );
    let (unbounded, window, _) = received_in_two_polls(usize::MAX, 64);
    assert_eq!(
        unbounded, window,
        "{name}: with a large budget two polls read all that waits"
    );
}

/// Both drivers read the kernel's arrival stamp of what they receive and
/// map it onto the core's clock: every RTT sample (data out, ACK back) is
/// then plausible, which a stamp read in the wrong clock would not give
/// (its samples would be dropped as implausible, or be seconds long).
fn arrival_stamps<D: IoDriver>(name: &str) {
    if !runnable(name) {
        return;
    }
    let mut p = write_several_mib::<D>(name, 16);
    let (sa, sb) = (p.a.stats(), p.b.stats());
    assert!(sa.stamped > 0, "{name}: the ACKs came stamped: {sa:?}");
    assert!(sb.stamped > 0, "{name}: the data came stamped: {sb:?}");
    let conn = p.conn_a;
    let c = p.a.endpoint().connection_stats(conn).unwrap();
    assert!(
        c.srtt_ns > 0 && c.srtt_ns < 20_000_000,
        "{name}: smoothed RTT {} ns over loopback",
        c.srtt_ns
    );
}

/// A sender held up past its retransmission timeouts (a stall of the
/// host) reads the ACKs that came meanwhile before it judges any timeout:
/// in its first turn after the stall no timeout fires, no packet is
/// declared lost and no path fails. (The io_uring driver reads a few
/// receive buffers a turn, here one; that turn must read on before its
/// timers run.)
fn a_held_up_sender_reads_its_acks_first<D: IoDriver>(name: &str) {
    if !runnable(name) {
        return;
    }
    // One receive buffer on the sender: any two ACKs that wait are more
    // than one turn's read.
    let mut cfg_a = config(16);
    cfg_a.uring.recv_buffers = 1;
    let mut p = Pair::<D>::connect_with(cfg_a, config(16), LIMIT);
    let w = p.post_write(8 << 20, 8);
    p.run_until_received(name, 1000);
    // The sender sends a window's worth, then stalls for 20 ms (ten
    // minimum RTOs) while the receiver reads it all and acknowledges it.
    for _ in 0..16 {
        p.a.poll(Duration::ZERO).unwrap();
    }
    let stall = Instant::now();
    while stall.elapsed() < Duration::from_millis(20) {
        p.b.poll(Duration::from_micros(200)).unwrap();
    }
    let conn = p.conn_a;
    let before = p.a.endpoint().connection_stats(conn).unwrap();
    p.a.poll(Duration::ZERO).unwrap();
    let after = p.a.endpoint().connection_stats(conn).unwrap();
    println!("{name}: {:?}", p.a.stats());
    assert_eq!(
        (after.rto_fires, after.packets_lost, after.path_failures),
        (before.rto_fires, before.packets_lost, before.path_failures),
        "{name}: the first turn after the stall judged timeouts before reading its ACKs"
    );
    assert!(
        after.acks_received > before.acks_received,
        "{name}: the ACKs were read"
    );
    p.finish_write(name, w);
}

/// A datagram of no bytes is read, counted and refused by the endpoint as
/// truncated, like any other malformed datagram, and the driver goes on
/// reading what follows it.
fn an_empty_datagram_is_counted_and_refused<D: IoDriver>(name: &str) {
    if !runnable(name) {
        return;
    }
    let mut a = D::bind(config(1)).unwrap();
    // A first turn arms the receive.
    a.poll(Duration::ZERO).unwrap();
    let to = a.local_addr();
    let s = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    s.send_to(&[], to).unwrap();
    s.send_to(b"x", to).unwrap();
    let t0 = Instant::now();
    while a.endpoint().stats().datagrams_received < 2 && t0.elapsed() < LIMIT {
        a.poll(Duration::from_millis(1)).unwrap();
    }
    let ep = a.endpoint().stats();
    assert_eq!(
        (a.stats().datagrams_received, ep.datagrams_received),
        (2, 2),
        "{name}: both datagrams, the empty one too, were read and handed on"
    );
    assert_eq!(
        ep.rejects.get(metaroce_proto::RejectReason::Truncated),
        2,
        "{name}: both refused as truncated: {:?}",
        ep.rejects
    );
}

/// Datagrams the kernel dropped for want of room on the UDP socket bound
/// to `port` (`/proc/net/udp`'s `drops` column; 0 where it cannot say).
fn socket_drops(port: u16) -> u64 {
    let table = std::fs::read_to_string("/proc/net/udp").unwrap_or_default();
    table
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let local_port = f.get(1)?.rsplit(':').next()?;
            (u16::from_str_radix(local_port, 16).ok()? == port)
                .then(|| f.last()?.parse::<u64>().ok())
                .flatten()
        })
        .sum()
}

/// A receiver held up for 20 ms while its sender has 16 MiB of WRITEs
/// queued and a window that would let it send far more than the
/// receiver's socket holds. The receiver's window (half its socket's
/// receive buffer, shared by its senders: PROTOCOL §14) keeps the sender
/// within what that socket holds, so its kernel drops nothing and no
/// packet is lost; without the window (the control, so that this test can
/// fail) the kernel drops datagrams.
fn a_held_up_receiver_drops_nothing<D: IoDriver>(name: &str) {
    if !runnable(name) {
        return;
    }
    if !std::path::Path::new("/proc/net/udp").exists() {
        println!("skipped: no /proc/net/udp to read socket drops from");
        return;
    }
    let run = |window: bool| -> (u64, u64) {
        let mut cfg_a = config(16);
        // A sender whose congestion window alone would overrun the socket.
        cfg_a.endpoint.initial_window = 8 << 20;
        let mut cfg_b = config(16);
        cfg_b.socket_buffer = 256 << 10;
        if !window {
            cfg_b.endpoint.receive_buffer = Some(u64::MAX);
        }
        let mut p = Pair::<D>::connect_with(cfg_a, cfg_b, LIMIT);
        let port = p.b.local_addr().port();
        let before = socket_drops(port);
        let w = p.post_write(16 << 20, 64);
        p.run_until_received(name, 500);
        let stall = Instant::now();
        while stall.elapsed() < Duration::from_millis(20) {
            p.a.poll(Duration::from_micros(100)).unwrap();
        }
        p.finish_write(name, w);
        let drops = socket_drops(port) - before;
        let s = p.a.endpoint().connection_stats(p.conn_a).unwrap();
        let spurious: u64 = s.paths.iter().map(|p| p.spurious_losses).sum();
        println!(
            "{name}, window {window}: {drops} dropped by the kernel, {} declared lost ({spurious} arrived after all), window given {}",
            s.packets_lost, s.peer_window
        );
        (drops, s.peer_window)
    };
    let (drops, window) = run(true);
    assert!(window > 0, "{name}: the receiver gave a window");
    assert_eq!(
        drops, 0,
        "{name}: the kernel dropped datagrams despite the window"
    );
    let (drops, window) = run(false);
    assert!(
        drops > 0 && window >= u64::from(u32::MAX),
        "{name}: without a window nothing was dropped ({drops}): the test shows nothing"
    );
}

macro_rules! suite {
    ($($test:ident),*) => {
        mod portable {
            $(#[test] fn $test() { super::$test::<super::PortableDriver>("portable") })*
        }
        mod io_uring {
            $(#[test] fn $test() { super::$test::<super::UringDriver>("io_uring") })*
        }
    };
}

suite!(
    write,
    write_gso,
    turn_budget,
    turn_recv_budget,
    send_recv,
    ping_pong_acks_ride_on_the_answers,
    read,
    timers_wake_the_wait,
    a_wake_before_the_poll_is_not_lost,
    threaded_write,
    threaded_write_busy_poll,
    busy_poll_finds_a_datagram,
    busy_poll_is_bounded_by_the_wait,
    answers_leave_within_the_same_poll,
    a_held_up_sender_reads_its_acks_first,
    a_held_up_receiver_drops_nothing,
    an_empty_datagram_is_counted_and_refused,
    arrival_stamps
);

/// A portable turn that reads fewer messages than it asked the socket for
/// reads no more: the socket had nothing else, and a second read would
/// only hold up what the first brought (a system call on the way of every
/// answer).
#[test]
fn a_portable_read_that_drains_the_socket_is_the_turns_last() {
    let mut p = pair::<PortableDriver>(config(16));
    let w = p.post_write(64, 1);
    // Loopback: the WRITE is in b's socket when a's send returns.
    p.a.poll(Duration::ZERO).unwrap();
    let before = p.b.stats();
    p.b.poll(Duration::ZERO).unwrap();
    let s = p.b.stats();
    assert!(s.datagrams_received > before.datagrams_received, "{s:?}");
    assert_eq!(s.reads - before.reads, 1, "{before:?}\n{s:?}");
    p.finish_write("portable", w);
}

#[test]
fn auto_picks_io_uring_where_the_kernel_has_it() {
    let d = Driver::bind(config(1)).unwrap();
    match metaroce_io::uring_probe() {
        Ok(_) => assert_eq!(d.backend(), Backend::Uring),
        Err(why) => {
            println!("skipped: io_uring unavailable: {why}");
            assert_eq!(d.backend(), Backend::Portable);
        }
    }
    let mut cfg = config(1);
    cfg.backend = Backend::Portable;
    assert_eq!(Driver::bind(cfg).unwrap().backend(), Backend::Portable);
}

#[test]
fn the_enum_driver_runs_the_suite_too() {
    // `Driver` implements the trait: a WRITE through the auto-chosen backend.
    let p = write_several_mib::<Driver>("auto", 16);
    assert_ne!(p.a.backend(), Backend::Auto);
}

/// Two ends with two planes each on loopback addresses: 127.0.0.1 + .2
/// against .3 + .4.
fn two_plane_pair<D: IoDriver>() -> Pair<D> {
    let plane = |listen: &str, extra: &str| {
        let mut c = config(16);
        c.listen = listen.parse().unwrap();
        c.planes = vec![extra.parse().unwrap()];
        c
    };
    Pair::<D>::connect_with(
        plane("127.0.0.1:0", "127.0.0.2"),
        plane("127.0.0.3:0", "127.0.0.4"),
        LIMIT,
    )
}

/// A WRITE over two planes checked byte for byte, with the paths spread
/// over both planes and both planes carrying data.
fn two_planes<D: IoDriver>(name: &str) {
    let mut p = two_plane_pair::<D>();
    assert_eq!(p.a.endpoint().config().plane_ips.len(), 2, "{name}");
    p.write_checked(name, 8 << 20, 4);
    let stats = p.a.endpoint().connection_stats(p.conn_a).unwrap();
    let mut per_plane = [0u64; 2];
    for path in &stats.paths {
        per_plane[usize::from(path.plane)] += path.packets_acked;
    }
    println!("{name}: packets acked per plane {per_plane:?}");
    assert!(
        per_plane.iter().all(|&n| n > 100),
        "{name}: both planes carry data: {per_plane:?}"
    );
    // And they really went to both of b's addresses (and the ACKs back to
    // both of a's).
    let (rb, ra) = (
        p.b.stats().received_per_plane,
        p.a.stats().received_per_plane,
    );
    println!("{name}: datagrams received per plane: b {rb:?}, a {ra:?}");
    assert!(
        rb[0] > 100 && rb[1] > 100 && rb[2..].iter().all(|&n| n == 0),
        "{rb:?}"
    );
    assert!(ra[0] > 0 && ra[1] > 0, "{ra:?}");
    // The metrics say the same, per plane and per path.
    let mut m = metaroce_io::Metrics::new("b").unwrap();
    m.update_driver(&p.b.stats());
    m.update(p.b.endpoint());
    let text = m.encode();
    let line = format!(
        "metaroce_driver_plane_datagrams_received_total{{endpoint=\"b\",plane=\"1\"}} {}",
        rb[1]
    );
    assert!(text.contains(&line), "{name}: no `{line}` in\n{text}");
    assert!(text.contains("metaroce_path_plane{"), "{name}");
}

/// Plane 1 dies in both directions before the transfer (everything from
/// the peer's plane-1 address is dropped, at both ends): its paths fail and
/// the WRITE completes on plane 0, every byte intact.
fn a_dead_plane<D: IoDriver>(name: &str) {
    let mut p = two_plane_pair::<D>();
    p.b.set_faults(FaultConfig::blackhole_sources(vec!["127.0.0.2"
        .parse()
        .unwrap()]));
    p.a.set_faults(FaultConfig::blackhole_sources(vec!["127.0.0.4"
        .parse()
        .unwrap()]));
    p.write_checked(name, 4 << 20, 4);
    let stats = p.a.endpoint().connection_stats(p.conn_a).unwrap();
    let failed: u64 = stats
        .paths
        .iter()
        .filter(|x| x.plane == 1)
        .map(|x| x.failures)
        .sum();
    let dropped = p.b.stats().faults_dropped;
    println!("{name}: plane-1 path failures {failed}, dropped at b {dropped}");
    assert!(
        dropped > 0,
        "{name}: plane 1 was used and its datagrams dropped"
    );
    assert!(failed > 0, "{name}: plane 1's paths were declared failed");
}

#[test]
fn a_dead_plane_portable() {
    a_dead_plane::<PortableDriver>("portable");
}

#[test]
fn a_dead_plane_io_uring() {
    if runnable("io_uring") {
        a_dead_plane::<UringDriver>("io_uring");
    }
}

#[test]
fn two_planes_portable() {
    two_planes::<PortableDriver>("portable");
}

#[test]
fn two_planes_io_uring() {
    if runnable("io_uring") {
        two_planes::<UringDriver>("io_uring");
    }
}

#[test]
fn plane_addresses_are_checked() {
    let mut c = config(16);
    c.planes = vec!["0.0.0.0".parse().unwrap()];
    let e = PortableDriver::bind(c).unwrap_err();
    assert!(matches!(e, metaroce_io::DriverError::Config(_)), "{e}");
    let mut c = config(16);
    c.planes = vec!["127.0.0.1".parse().unwrap()];
    assert!(matches!(
        PortableDriver::bind(c),
        Err(metaroce_io::DriverError::Config(_))
    ));
}

#[test]
fn zero_copy_sends_complete_and_are_counted() {
    if !runnable("io_uring") {
        return;
    }
    if !metaroce_io::uring_probe().unwrap().sendmsg_zc {
        println!("skipped: no IORING_OP_SENDMSG_ZC");
        return;
    }
    // Batches of 4 segments (16.6 KB): above the 16 KiB zero-copy
    // threshold, and few enough pages for one socket buffer (a full batch
    // of 15 has more than MAX_SKB_FRAGS and is sent with a copy).
    let p = write_several_mib::<UringDriver>("io_uring", 4);
    let s = p.a.stats();
    println!("zero copy: {s:?}");
    assert!(
        s.zero_copy_sends > 0,
        "GSO batches above 16 KiB went zero-copy"
    );
    // Where the kernel copies every zero-copy send (loopback does), the
    // driver stops asking for it after ZC_COPIED_LIMIT of them: what was in
    // flight when it decided may still complete, no more.
    let limit = u64::from(metaroce_io::ZC_COPIED_LIMIT);
    if s.zero_copy_copied == s.zero_copy_sends && s.zero_copy_copied >= limit {
        assert!(!p.a.zero_copy(), "zero copy still on after {s:?}");
        assert!(
            s.zero_copy_sends <= limit + config(16).uring.send_slots as u64,
            "{s:?}"
        );
    } else {
        println!("kernel did not copy every zero-copy send: {s:?}");
    }
    // Off: no zero-copy sends at all.
    let mut cfg = config(16);
    cfg.uring.zero_copy = false;
    let d = UringDriver::bind(cfg).unwrap();
    assert!(!d.zero_copy());
}

#[test]
fn gathered_sends_carry_payloads_straight_from_the_regions() {
    if !runnable("io_uring") {
        return;
    }
    // Batched and one datagram per send: every byte checked at the far end.
    for gso in [16, 1] {
        let p = write_several_mib::<UringDriver>("io_uring", gso);
        let s = p.a.stats();
        println!("gathered, {gso} segments: {s:?}");
        assert!(s.gathered_sends > 0, "{gso} segments: {s:?}");
        assert_eq!(s.send_errors, 0, "{gso} segments: {s:?}");
    }
    // Threshold 0: every payload copied into the send slots.
    let mut cfg = config(16);
    cfg.uring.gather_threshold = 0;
    let mut p = pair::<UringDriver>(cfg);
    p.write_checked("io_uring", 2 << 20, 2);
    assert_eq!(p.a.stats().gathered_sends, 0, "{:?}", p.a.stats());
}

#[test]
fn dropping_mid_transfer_waits_for_the_kernel() {
    if !runnable("io_uring") {
        return;
    }
    // Start a transfer, stop half-way and drop both drivers while sends and
    // the multishot receive are in flight: `Drop` cancels and drains.
    let mut p = pair::<UringDriver>(config(16));
    let _write = p.post_write(8 << 20, 1);
    for _ in 0..50 {
        p.a.poll(Duration::ZERO).unwrap();
        p.b.poll(Duration::ZERO).unwrap();
    }
    let t = Instant::now();
    drop(p);
    assert!(t.elapsed() < Duration::from_secs(3));
}

#[test]
fn backend_names_parse() {
    for b in [
        Backend::Auto,
        Backend::Uring,
        Backend::Portable,
        Backend::AfXdp,
    ] {
        assert_eq!(b.name().parse::<Backend>(), Ok(b));
    }
    assert_eq!("af-xdp".parse::<Backend>(), Ok(Backend::AfXdp));
    let err = "dpdk".parse::<Backend>().unwrap_err();
    assert!(err.to_string().contains("af_xdp"), "{err}");
}
