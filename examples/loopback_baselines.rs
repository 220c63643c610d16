//! metaroce against the baselines it must be compared with, measured in the
//! same run on the same loopback: TCP (one stream), raw UDP with GSO/GRO
//! (the same datagram size metaroce sends), and a raw UDP ping-pong for
//! small-message latency.
//!
//! ```sh
//! cargo run --release --example loopback_baselines -- [SECONDS [ROUNDS [metaroce|metaroce1|sleeping|shallow|jumbo|udp|udp-gathered|udp-jumbo|udp-gathered-jumbo|udp-pieces|udp-no-copy|udp-receive|ping-pong|ping-pong-metaroce]]]
//! ```
//!
//! With `metaroce`, `metaroce1` (the same stream over one path),
//! `sleeping` (the stream without busy polling), `shallow` (16 WRITEs
//! outstanding), `jumbo` (8 KiB payloads), `udp`, `udp-gathered` (raw UDP
//! laid out as metaroce sends, below), `udp-jumbo` and
//! `udp-gathered-jumbo` (the same in jumbo datagrams), `ping-pong` (the
//! 8 B round trips), `ping-pong-metaroce` (metaroce's round trips alone, 100,000 a round,
//! with the user and kernel CPU time they took, against raw UDP polled)
//! or `udp-pieces` (raw UDP's buffer sent whole and in 64-byte `iovec`s:
//! what the kernel spends on a piece, of which metaroce's gathered sends
//! have two a datagram) or `udp-no-copy` (raw UDP sent with metaroce's
//! layout, then with the payloads' pages handed to the kernel instead of
//! copied: `MSG_ZEROCOPY`, and `vmsplice` + `splice`) or `udp-receive`
//! (raw UDP with metaroce's layout received three ways: thrown away,
//! copied into a region after the read as metaroce's receiver does, and
//! read straight into the region)
//! after the rounds, only that test runs, round after round (what
//! `scripts/cost-per-gbit.sh` profiles).
//!
//! Each side of a metaroce stream has a core of its own, so its driver
//! busy-polls for 50 µs before it sleeps
//! ([`DriverConfig::busy_poll`](metaroce_io::DriverConfig::busy_poll)),
//! as perftest's `ib_write_bw` polls its completion queue; each round also
//! runs the stream with drivers that sleep at once, the default of a
//! driver (and what the ping-pong, which polls both drivers from one
//! thread, must use).
//!
//! The 8 B round trips: metaroce's SEND/RECV ping-pong (both drivers
//! polled from one thread; each SEND carries the ACK of the one before it,
//! PROTOCOL §6.7), the same with every SEND acknowledged by a datagram of
//! its own (coalescing off), a raw UDP ping-pong whose two threads block
//! in their receives, and one whose two sockets are polled from one thread
//! (no wake-ups: the cost of the datagrams alone, the strictest baseline).
//! Both are also run with each side on a core of its own, never sleeping:
//! metaroce's drivers busy-polling (as perftest's `ib_send_lat` polls its
//! completion queue) against raw UDP threads spinning on non-blocking
//! sockets.
//!
//! The stream keeps 128 WRITEs outstanding, perftest's default depth for
//! `ib_write_bw`: raw UDP sends blind and never waits for its receiver,
//! while a WRITE stream whose queue is shallower than the receiver's
//! stalls waits for it. Each round also runs it with 16 outstanding (1 MiB
//! in flight at most), the depth of earlier sessions' figures.
//!
//! Each round also runs the WRITE stream over one path (no spraying: a
//! fabric without ECMP, or `paths = 1`), which must not fall behind the
//! sprayed one: its window once collapsed on a host whose threads sleep
//! (`docs/BENCHMARKS.md`, session 13).
//!
//! Raw UDP is also sent the way metaroce's driver sends, each datagram's
//! header and payload two pieces from apart that the kernel gathers as it
//! copies (`udp_gathered_gbps`): what that layout alone costs, which no
//! protocol that heads payloads it does not copy escapes.
//!
//! Prints each figure, metaroce's ratio to it and the CPU cycles each spent
//! per byte (process CPU time × the nominal clock, both ends), round by
//! round, then the median ratios. The machine is shared and noisy: compare
//! ratios, not absolute numbers.
//!
//! One core per side: in every throughput test the sending thread runs on
//! the first CPU this process may use and the receiving thread on the
//! second (when there are two), and each reports how busy it was (its CPU
//! time over the run's wall time), which tells a side that ran out of CPU
//! from one that waited for the other. Each side's CPU cycles per byte,
//! against the same side of raw UDP, say which side holds metaroce back:
//! raw UDP keeps both its threads busy, so a side that spends 1.25 times
//! its cycles per byte cannot move more than 0.8 of its bytes on one core.
//!
//! Each round also runs metaroce and raw UDP in jumbo datagrams (8 KiB
//! payloads, as a fabric with a 9000-byte MTU carries them): half the
//! pieces per byte for the kernel to gather.
//!
//! The metaroce stream also reports what its sender's loss recovery did.
//! Loopback loses a datagram only when a socket's receive queue overflows;
//! a declared loss whose packet arrived after all was spurious: the packet
//! or its ACK was held up on the host (a thread off its core for a few
//! milliseconds) past the loss timers.

use metaroce_io::{connect_pair, Driver, DriverConfig};
use metaroce_proto::verbs::*;
use quinn_udp::{RecvMeta, Transmit, UdpSockRef, UdpSocketState};
use std::io::{IoSliceMut, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Datagram size of the headline runs: metaroce's default MTU (a 4 KiB
/// payload, RoCE's largest, and its 64-byte header), for raw UDP too.
const DATAGRAM: usize = 4160;
/// Jumbo datagrams (an 8 KiB payload and its header, within a 9000-byte
/// Ethernet MTU), for metaroce and raw UDP alike.
const JUMBO: usize = 8192 + 64;
/// metaroce's header ahead of each payload.
const HEADER: usize = 64;

/// The two sides of a throughput test.
#[derive(Clone, Copy)]
enum Side {
    Sender = 0,
    Receiver = 1,
}

/// Pins the calling thread to its side's core (the first or second CPU
/// this process may use), where there are at least two. Left to the
/// scheduler, both sides now and then share one core for a while, and a
/// run's throughput halves. Also names the thread after its side
/// (`sender`, `receiver`), which is what profilers show
/// (`scripts/cost-per-gbit.sh` sorts samples by it).
fn pin(side: Side) {
    let name = match side {
        Side::Sender => "sender",
        Side::Receiver => "receiver",
    };
    // Best effort: a thread's name is only a label.
    let _ = std::fs::write("/proc/thread-self/comm", name);
    if let Some(ids) = core_affinity::get_core_ids() {
        if ids.len() >= 2 {
            core_affinity::set_for_current(ids[side as usize]);
        }
    }
}

/// CPU time the calling thread has used so far, from
/// `/proc/thread-self/schedstat` (nanoseconds on a CPU; zero if unknown).
fn thread_cpu() -> Duration {
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").unwrap_or_default();
    let ns = s.split_whitespace().next().and_then(|x| x.parse().ok());
    Duration::from_nanos(ns.unwrap_or(0))
}

/// User and kernel CPU time the calling thread has used so far
/// (`getrusage(RUSAGE_THREAD)`, microsecond resolution).
fn thread_user_sys() -> (Duration, Duration) {
    // SAFETY: `getrusage` writes one `rusage` into the zeroed local it is
    // given, which outlives the call.
    let r = unsafe {
        let mut r: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_THREAD, &mut r);
        r
    };
    let d =
        |t: libc::timeval| Duration::from_micros(t.tv_sec as u64 * 1_000_000 + t.tv_usec as u64);
    (d(r.ru_utime), d(r.ru_stime))
}

/// Runs `f` on a thread of its own (which `f` may pin), so that the
/// latency tests on this thread run where the scheduler puts them, as
/// before.
fn on_own_thread<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|s| s.spawn(f).join().unwrap())
}

/// How busy a thread was from `start`: CPU time over wall time.
struct Busy {
    cpu: Duration,
    wall: Instant,
}

impl Busy {
    fn start() -> Self {
        Busy {
            cpu: thread_cpu(),
            wall: Instant::now(),
        }
    }

    fn fraction(&self) -> f64 {
        (thread_cpu() - self.cpu).as_secs_f64() / self.wall.elapsed().as_secs_f64()
    }
}

/// A throughput run: Gbit/s, and how busy the sender and the receiver were.
#[derive(Clone, Copy)]
struct Run {
    gbps: f64,
    busy: [f64; 2],
    /// metaroce runs: what its sender's loss recovery did.
    recovery: Option<Recovery>,
}

impl Run {
    /// CPU cycles each side spent per byte moved (sender, receiver): its
    /// thread's CPU time (user + kernel) × the nominal clock over the bytes.
    fn cycles_per_byte(&self, hz: f64) -> [f64; 2] {
        let bytes_per_s = self.gbps * 1e9 / 8.0;
        self.busy.map(|b| b * hz / bytes_per_s)
    }
}

/// The sender's loss-recovery counters after a metaroce run.
#[derive(Clone, Copy)]
struct Recovery {
    lost: u64,
    spurious: u64,
    rto_fires: u64,
    path_failures: u64,
}

impl std::fmt::Display for Recovery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} declared lost ({} of them arrived after all), {} RTO fires, {} paths declared failed",
            self.lost, self.spurious, self.rto_fires, self.path_failures
        )
    }
}

fn tcp_gbps(secs: f64) -> Run {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let reader = std::thread::spawn(move || {
        pin(Side::Receiver);
        let (mut s, _) = l.accept().unwrap();
        let busy = Busy::start();
        let mut buf = vec![0u8; 1 << 20];
        let mut n = 0u64;
        while let Ok(k) = s.read(&mut buf) {
            if k == 0 {
                break;
            }
            n += k as u64;
        }
        (n, busy.fraction())
    });
    pin(Side::Sender);
    let mut s = TcpStream::connect(addr).unwrap();
    let buf = vec![7u8; 64 << 10];
    let busy = Busy::start();
    let t0 = Instant::now();
    while t0.elapsed().as_secs_f64() < secs {
        s.write_all(&buf).unwrap();
    }
    drop(s);
    let tx_busy = busy.fraction();
    let (n, rx_busy) = reader.join().unwrap();
    Run {
        gbps: n as f64 * 8.0 / t0.elapsed().as_secs_f64() / 1e9,
        busy: [tx_busy, rx_busy],
        recovery: None,
    }
}

/// What the receiving thread of a raw UDP stream does with each GRO batch.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Receive {
    /// Reads it (the kernel's copy into one buffer) and counts its bytes:
    /// the baseline.
    Discard,
    /// Reads it into one buffer, then copies each datagram's payload (all
    /// but its first `HEADER` bytes) into a 1 MiB region, slot after slot,
    /// as metaroce's receiver places payloads: two copies.
    Place,
    /// Reads it with an `iovec` a header and one a payload for each
    /// datagram, the payloads' straight into the region where the next
    /// slots are: the kernel's one copy puts each payload in place, as a
    /// receiver that knew (or guessed) where the next payloads go could.
    Scatter,
}

/// Raw UDP with GSO/GRO: a receiving thread reads with GRO and counts the
/// bytes (doing with them what `receive` says) while this thread calls
/// `send` (one GSO send of up to 64 KiB to the given address, on the given
/// socket) for `secs`.
fn udp_stream(secs: f64, receive: Receive, mut send: impl FnMut(&UdpSocket, SocketAddr)) -> Run {
    let rx = UdpSocket::bind("127.0.0.1:0").unwrap();
    let socket2 = socket2::SockRef::from(&rx);
    let _ = socket2.set_recv_buffer_size(8 << 20);
    rx.set_read_timeout(Some(Duration::from_millis(50)))
        .unwrap();
    let rx_state = UdpSocketState::new(UdpSockRef::from(&rx)).unwrap();
    let dst = rx.local_addr().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = stop.clone();
    let reader = std::thread::spawn(move || {
        pin(Side::Receiver);
        let busy = Busy::start();
        let mut buf = vec![0u8; 64 * 65536];
        let mut n = 0u64;
        if receive != Receive::Discard {
            n = place_batches(&rx, receive, &stop2);
            return (n, busy.fraction());
        }
        while !stop2.load(Ordering::Relaxed) {
            let mut meta = [RecvMeta::default()];
            let mut bufs = [IoSliceMut::new(&mut buf)];
            if let Ok(k) = rx_state.recv(UdpSockRef::from(&rx), &mut bufs, &mut meta) {
                n += meta[..k].iter().map(|m| m.len as u64).sum::<u64>();
            }
        }
        (n, busy.fraction())
    });
    pin(Side::Sender);
    let tx = UdpSocket::bind("127.0.0.1:0").unwrap();
    let busy = Busy::start();
    let t0 = Instant::now();
    while t0.elapsed().as_secs_f64() < secs {
        send(&tx, dst);
    }
    let elapsed = t0.elapsed().as_secs_f64();
    let tx_busy = busy.fraction();
    std::thread::sleep(Duration::from_millis(100));
    stop.store(true, Ordering::Relaxed);
    let (n, rx_busy) = reader.join().unwrap();
    Run {
        gbps: n as f64 * 8.0 / elapsed / 1e9,
        busy: [tx_busy, rx_busy],
        recovery: None,
    }
}

/// The receiving loop of [`Receive::Place`] and [`Receive::Scatter`] for
/// datagrams of `DATAGRAM` bytes (a `HEADER` and a 4 KiB payload), read
/// with plain `recvmsg` either way, until `stop`: the bytes received.
fn place_batches(rx: &UdpSocket, receive: Receive, stop: &AtomicBool) -> u64 {
    use std::os::fd::AsRawFd;
    const PAYLOAD: usize = DATAGRAM - HEADER;
    const SEGS: usize = 65_507 / DATAGRAM;
    const REGION: usize = 1 << 20;
    let mut backing = RegionBuf::resident(REGION);
    let mut batch = vec![0u8; 65_536];
    let mut headers = vec![0u8; HEADER * SEGS];
    let mut iov = Vec::with_capacity(2 * SEGS);
    let (mut slot, mut n) = (0usize, 0u64);
    while !stop.load(Ordering::Relaxed) {
        iov.clear();
        // One pointer into the region for all of this read's payloads.
        let region = backing.as_mut_ptr();
        match receive {
            Receive::Scatter => {
                for k in 0..SEGS {
                    let at = (slot + k) % (REGION / PAYLOAD) * PAYLOAD;
                    iov.push(libc::iovec {
                        iov_base: headers[k * HEADER..].as_mut_ptr().cast(),
                        iov_len: HEADER,
                    });
                    iov.push(libc::iovec {
                        iov_base: region.wrapping_add(at).cast(),
                        iov_len: PAYLOAD,
                    });
                }
            }
            _ => iov.push(libc::iovec {
                iov_base: batch.as_mut_ptr().cast(),
                iov_len: batch.len(),
            }),
        }
        // SAFETY: all zeros is a valid msghdr (no name, no control).
        let mut m: libc::msghdr = unsafe { std::mem::zeroed() };
        m.msg_iov = iov.as_mut_ptr();
        m.msg_iovlen = iov.len() as _;
        // SAFETY: every iovec points at writable memory of its length
        // (`headers`, `batch`, or a slot of the region: `at + PAYLOAD` is
        // within its REGION bytes), all alive and not otherwise borrowed
        // until the call ends.
        let r = unsafe { libc::recvmsg(rx.as_raw_fd(), &mut m, 0) };
        if r <= 0 {
            continue; // the read timeout: look at `stop` again
        }
        let len = r as usize;
        let segs = len.div_ceil(DATAGRAM);
        if receive == Receive::Place {
            for (k, d) in batch[..len].chunks(DATAGRAM).enumerate() {
                let at = (slot + k) % (REGION / PAYLOAD) * PAYLOAD;
                let p = &d[HEADER.min(d.len())..];
                backing[at..at + p.len()].copy_from_slice(p);
            }
        }
        slot += segs;
        n += len as u64;
    }
    n
}

/// The baseline: every GSO send one contiguous buffer of whole datagrams
/// of `datagram` bytes.
fn udp_gso_gbps(secs: f64, datagram: usize) -> Run {
    let mut state = None;
    let mut payload = Vec::new();
    udp_stream(secs, Receive::Discard, |tx, dst| {
        let st = state.get_or_insert_with(|| {
            let st = UdpSocketState::new(UdpSockRef::from(tx)).unwrap();
            // A GSO send is at most one 64 KiB UDP payload.
            let segs = st.max_gso_segments().clamp(1, 65_507 / datagram);
            payload = vec![9u8; datagram * segs];
            st
        });
        let t = Transmit {
            destination: dst,
            ecn: None,
            contents: &payload,
            segment_size: (payload.len() > datagram).then_some(datagram),
            src_ip: None,
        };
        let _ = st.try_send(UdpSockRef::from(tx), &t);
    })
}

/// How a raw UDP GSO send hands the kernel its bytes ([`udp_pieces_gbps`]).
#[derive(Clone, Copy)]
enum Pieces {
    /// As metaroce's io_uring driver sends: each datagram a 64-byte header
    /// from one buffer followed by its payload straight from a 1 MiB
    /// region (16 slots of 64 KiB, in turn), `segs` datagrams a send: with
    /// 4 KiB payloads and as many as fit 64 KiB, 15 datagrams, 30 pieces.
    Gathered { segs: usize },
    /// The same, sent with `MSG_ZEROCOPY`: the kernel pins the pages and
    /// refers to them instead of copying at the send. Each piece is then a
    /// fragment of the packet, and a packet has at most `MAX_SKB_FRAGS`
    /// (17 here), so at most 8 datagrams a send.
    ZeroCopy { segs: usize },
    /// The baseline's contiguous buffer cut into `iovec`s of this many
    /// bytes: the same bytes from the same place, only in more pieces.
    Cut(usize),
}

impl Pieces {
    /// The most datagrams of `datagram` bytes one GSO send carries (64 KiB
    /// of UDP payload).
    fn max_segs(datagram: usize) -> usize {
        65_507 / datagram
    }
}

/// Datagrams a zero-copy sender fits in a send: two fragments each
/// (header and payload) within `MAX_SKB_FRAGS` (17).
const ZC_SEGS: usize = 8;

/// A zero-copy sender reads its completion notifications back every this
/// many sends (and after a refused one): the kernel holds a send's pages,
/// and its socket's option memory, until they are read.
const ZC_REAP_EVERY: u64 = 8;

/// `len` bytes of `backing` from its first page boundary on, as a
/// registered region is (a 4 KiB payload of an aligned slot is then one
/// page: one fragment for a sender that refers to pages instead of
/// copying them, where one across two pages would be two).
fn page_aligned(backing: &[u8], len: usize) -> &[u8] {
    &backing[backing.as_ptr().align_offset(RegionBuf::PAGE)..][..len]
}

/// Sets an integer socket option on `fd`.
fn set_int_option(fd: std::os::fd::RawFd, level: libc::c_int, name: libc::c_int, value: i32) {
    // SAFETY: `value` is a readable c_int of the length passed.
    let r = unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            std::ptr::from_ref(&value).cast(),
            std::mem::size_of::<i32>() as libc::socklen_t,
        )
    };
    assert_eq!(
        r,
        0,
        "setsockopt({level}, {name}): {}",
        std::io::Error::last_os_error()
    );
}

/// Reads every zero-copy completion notification queued on `fd`'s error
/// queue and throws them away (the benchmark's pages never change).
fn drain_error_queue(fd: std::os::fd::RawFd) {
    let mut control = [0u8; 128];
    loop {
        // SAFETY: all zeros is a valid msghdr (no name, no data).
        let mut m: libc::msghdr = unsafe { std::mem::zeroed() };
        m.msg_control = control.as_mut_ptr().cast();
        m.msg_controllen = control.len() as _;
        // SAFETY: `m` points at `control`, which outlives the call; a
        // message with no data buffers is valid for MSG_ERRQUEUE.
        let r = unsafe { libc::recvmsg(fd, &mut m, libc::MSG_ERRQUEUE | libc::MSG_DONTWAIT) };
        if r < 0 {
            return;
        }
    }
}

/// Raw UDP whose every GSO `sendmsg` gives the kernel its bytes in
/// pieces, which it gathers as it copies (or, zero-copy, refers to).
/// `Gathered`, against the contiguous baseline, is the ceiling any
/// protocol that puts its own header on payloads it does not copy works
/// under; `Cut(64)` sends the baseline's own buffer (as many datagrams of
/// `datagram` bytes as fit 64 KiB) in 64-byte pieces, and so measures what
/// the kernel spends on a piece.
fn udp_pieces_gbps(secs: f64, datagram: usize, layout: Pieces, receive: Receive) -> Run {
    use std::os::fd::AsRawFd;
    let payload = datagram - HEADER;
    let (segs, zc) = match layout {
        Pieces::Gathered { segs } => (segs, false),
        Pieces::ZeroCopy { segs } => (segs, true),
        Pieces::Cut(_) => (Pieces::max_segs(datagram), false),
    };
    let headers = vec![1u8; HEADER * segs];
    let backing = vec![9u8; (16 << 16) + RegionBuf::PAGE];
    let region = page_aligned(&backing, 16 << 16);
    let contiguous = vec![9u8; datagram * segs];
    let control = segment_cmsg(datagram);
    let mut slot = 0usize;
    let mut sends = 0u64;
    udp_stream(secs, receive, |tx, dst| {
        if zc && sends == 0 {
            set_int_option(tx.as_raw_fd(), libc::SOL_SOCKET, libc::SO_ZEROCOPY, 1);
        }
        let pieces: Vec<std::io::IoSlice> = match layout {
            Pieces::Gathered { .. } | Pieces::ZeroCopy { .. } => {
                let base = (slot % 16) << 16;
                slot += 1;
                (0..segs)
                    .flat_map(|i| {
                        [
                            std::io::IoSlice::new(&headers[i * HEADER..(i + 1) * HEADER]),
                            std::io::IoSlice::new(
                                &region[base + i * payload..base + (i + 1) * payload],
                            ),
                        ]
                    })
                    .collect()
            }
            Pieces::Cut(n) => contiguous.chunks(n).map(std::io::IoSlice::new).collect(),
        };
        let dst = socket2::SockAddr::from(dst);
        let m = socket2::MsgHdr::new()
            .with_addr(&dst)
            .with_buffers(&pieces)
            .with_control(&control);
        let flags = if zc { libc::MSG_ZEROCOPY } else { 0 };
        let sent = socket2::SockRef::from(tx).sendmsg(&m, flags).is_ok();
        sends += 1;
        if zc && (!sent || sends.is_multiple_of(ZC_REAP_EVERY)) {
            drain_error_queue(tx.as_raw_fd());
        }
    })
}

/// The control message that makes a `sendmsg` a GSO send of `datagram`-
/// byte datagrams (`UDP_SEGMENT`, a u16).
fn segment_cmsg(datagram: usize) -> Vec<u8> {
    let mut control = vec![0u8; 64];
    // SAFETY: `control` is 64 bytes, more than CMSG_SPACE(2), and outlives
    // the header that points at it; CMSG_FIRSTHDR of a msghdr whose
    // control is that buffer is its start, where the cmsghdr and its 2
    // data bytes are written (unaligned writes: a Vec<u8> is not aligned).
    let len = unsafe {
        let space = libc::CMSG_SPACE(2) as usize;
        let mut m: libc::msghdr = std::mem::zeroed();
        m.msg_control = control.as_mut_ptr().cast();
        m.msg_controllen = space as _;
        let c = libc::CMSG_FIRSTHDR(&m);
        std::ptr::write_unaligned(
            c,
            libc::cmsghdr {
                cmsg_len: libc::CMSG_LEN(2) as _,
                cmsg_level: libc::SOL_UDP,
                cmsg_type: libc::UDP_SEGMENT,
            },
        );
        std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<u16>(), datagram as u16);
        space
    };
    control.truncate(len);
    control
}

/// Raw UDP whose payloads the kernel never copies at the send: each GSO
/// send (`segs` datagrams of `datagram` bytes, `UDP_SEGMENT` set on the
/// socket) is built by `vmsplice` of the payloads' pages into a pipe, then
/// per datagram its header sent with `MSG_MORE` and its payload spliced
/// from the pipe (`SPLICE_F_MORE` but for the last): the packet refers to
/// the region's pages, and the receiver copies from them. Two calls a
/// datagram, and a fragment each for header and payload (so at most
/// [`ZC_SEGS`] datagrams a send).
fn udp_spliced_gbps(secs: f64, datagram: usize, segs: usize) -> Run {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    let payload = datagram - HEADER;
    let headers = vec![1u8; HEADER * segs];
    let backing = vec![9u8; (16 << 16) + RegionBuf::PAGE];
    let region = page_aligned(&backing, 16 << 16);
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two descriptors pipe2 writes.
    let r = unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) };
    assert_eq!(r, 0, "pipe2: {}", std::io::Error::last_os_error());
    // SAFETY: pipe2 succeeded, and each descriptor is owned here alone.
    let (rd, wr) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // SAFETY: F_SETPIPE_SZ takes an int; a refusal leaves the default
    // (16 pages), which one send's payloads still fit.
    unsafe { libc::fcntl(wr.as_raw_fd(), libc::F_SETPIPE_SZ, 1 << 20) };
    let mut slot = 0usize;
    udp_stream(secs, Receive::Discard, |tx, dst| {
        let fd = tx.as_raw_fd();
        if slot == 0 {
            tx.connect(dst).expect("connect");
            set_int_option(fd, libc::SOL_UDP, libc::UDP_SEGMENT, datagram as i32);
        }
        let base = (slot % 16) << 16;
        slot += 1;
        let span = libc::iovec {
            iov_base: region[base..].as_ptr().cast_mut().cast(),
            iov_len: segs * payload,
        };
        // SAFETY: `span` covers `segs * payload` bytes of `region`, which
        // outlives every packet that refers to its pages (the stream's
        // receiver has drained before `backing` is dropped); vmsplice
        // without SPLICE_F_GIFT only reads them.
        let n = unsafe { libc::vmsplice(wr.as_raw_fd(), &span, 1, 0) };
        assert_eq!(
            n,
            span.iov_len as isize,
            "vmsplice: {}",
            std::io::Error::last_os_error()
        );
        for i in 0..segs {
            let h = &headers[i * HEADER..(i + 1) * HEADER];
            // SAFETY: `h` is HEADER readable bytes.
            let sent = unsafe { libc::send(fd, h.as_ptr().cast(), HEADER, libc::MSG_MORE) };
            assert_eq!(
                sent,
                HEADER as isize,
                "send: {}",
                std::io::Error::last_os_error()
            );
            let more = if i + 1 < segs { libc::SPLICE_F_MORE } else { 0 };
            // SAFETY: null offsets: the two ends are a pipe and a socket.
            let moved = unsafe {
                libc::splice(
                    rd.as_raw_fd(),
                    std::ptr::null_mut(),
                    fd,
                    std::ptr::null_mut(),
                    payload,
                    more,
                )
            };
            assert_eq!(
                moved,
                payload as isize,
                "splice: {}",
                std::io::Error::last_os_error()
            );
        }
    })
}

/// Raw UDP laid out as metaroce sends ([`Pieces::Gathered`]).
fn udp_gathered_gbps(secs: f64, datagram: usize) -> Run {
    udp_pieces_gbps(
        secs,
        datagram,
        Pieces::Gathered {
            segs: Pieces::max_segs(datagram),
        },
        Receive::Discard,
    )
}

/// The p50 and p99 of round-trip times, in microseconds.
fn p50_p99(mut lat: Vec<Duration>) -> (f64, f64) {
    lat.sort();
    let q = |x: f64| lat[((lat.len() - 1) as f64 * x) as usize].as_secs_f64() * 1e6;
    (q(0.5), q(0.99))
}

/// A UDP socket on loopback whose receives never block.
fn nonblocking_socket() -> UdpSocket {
    let s = UdpSocket::bind("127.0.0.1:0").unwrap();
    s.set_nonblocking(true).unwrap();
    s
}

/// One datagram from non-blocking `s`, spinning until it comes.
fn spin_recv(s: &UdpSocket, buf: &mut [u8]) -> (usize, SocketAddr) {
    loop {
        match s.recv_from(buf) {
            Ok(r) => return r,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => panic!("{e}"),
        }
    }
}

/// Raw UDP ping-pong, an echo thread and this one, each blocked in its
/// receive until the datagram comes (woken by the kernel).
fn udp_ping_pong_us(rounds: usize) -> (f64, f64) {
    let a = UdpSocket::bind("127.0.0.1:0").unwrap();
    let b = UdpSocket::bind("127.0.0.1:0").unwrap();
    let (aa, ba) = (a.local_addr().unwrap(), b.local_addr().unwrap());
    let echo = std::thread::spawn(move || {
        let mut buf = [0u8; 64];
        for _ in 0..rounds {
            let (n, from) = b.recv_from(&mut buf).unwrap();
            b.send_to(&buf[..n], from).unwrap();
        }
    });
    let mut lat = Vec::with_capacity(rounds);
    let mut buf = [0u8; 64];
    for _ in 0..rounds {
        let t0 = Instant::now();
        a.send_to(&[1u8; 8], ba).unwrap();
        a.recv_from(&mut buf).unwrap();
        lat.push(t0.elapsed());
    }
    echo.join().unwrap();
    let _ = aa;
    p50_p99(lat)
}

/// Raw UDP ping-pong with both sockets polled from this thread, as the
/// metaroce ping-pong polls both of its drivers: no thread sleeps, so this
/// is the cost of the two datagrams alone.
fn udp_ping_pong_polled_us(rounds: usize) -> (f64, f64) {
    let (a, b) = (nonblocking_socket(), nonblocking_socket());
    let (aa, ba) = (a.local_addr().unwrap(), b.local_addr().unwrap());
    let mut lat = Vec::with_capacity(rounds);
    let mut buf = [0u8; 64];
    for _ in 0..rounds {
        let t0 = Instant::now();
        a.send_to(&[1u8; 8], ba).unwrap();
        let (n, _) = spin_recv(&b, &mut buf);
        b.send_to(&buf[..n], aa).unwrap();
        spin_recv(&a, &mut buf);
        lat.push(t0.elapsed());
    }
    p50_p99(lat)
}

/// Raw UDP ping-pong, an echo thread and this one on a core each, each
/// spinning on its non-blocking socket (no thread sleeps).
fn udp_ping_pong_spinning_us(rounds: usize) -> (f64, f64) {
    let (a, b) = (nonblocking_socket(), nonblocking_socket());
    let ba = b.local_addr().unwrap();
    let echo = std::thread::spawn(move || {
        pin(Side::Receiver);
        let mut buf = [0u8; 64];
        for _ in 0..rounds {
            let (n, from) = spin_recv(&b, &mut buf);
            b.send_to(&buf[..n], from).unwrap();
        }
    });
    on_own_thread(|| {
        pin(Side::Sender);
        let mut lat = Vec::with_capacity(rounds);
        let mut buf = [0u8; 64];
        for _ in 0..rounds {
            let t0 = Instant::now();
            a.send_to(&[1u8; 8], ba).unwrap();
            spin_recv(&a, &mut buf);
            lat.push(t0.elapsed());
        }
        echo.join().unwrap();
        p50_p99(lat)
    })
}

/// Two endpoints on loopback, connected, with one QP pair.
struct Pair {
    a: Driver,
    b: Driver,
    /// `a`'s connection to `b`.
    ca: ConnectionHandle,
    qa: Qpn,
    qb: Qpn,
    cqa: CqHandle,
    cqb: CqHandle,
    pda: PdHandle,
    pdb: PdHandle,
}

/// How a metaroce WRITE stream runs.
#[derive(Clone, Copy)]
struct Stream {
    /// The io_uring driver sends payloads straight from their regions (its
    /// default), else it copies them into its send slots first.
    gather: bool,
    /// Paths each connection sprays over (default: the endpoint's, 8).
    paths: Option<u8>,
    /// The drivers busy-poll for this long before they sleep.
    busy_poll: Duration,
    /// WRITEs the application keeps outstanding.
    depth: u64,
    /// ACKs ride on DATA going the other way (the endpoints' default).
    coalesce: bool,
    /// The endpoints' MTU (UDP payload bytes of a datagram).
    mtu: usize,
}

impl Stream {
    /// Busy poll of a driver that has a core of its own.
    const BUSY_POLL: Duration = Duration::from_micros(50);
    /// perftest's default depth for bandwidth tests (`ib_write_bw -t`).
    const DEPTH: u64 = 128;
    /// The headline stream: gathered, sprayed, busy-polling, 128 WRITEs
    /// outstanding.
    const MAIN: Stream = Stream {
        gather: true,
        paths: None,
        busy_poll: Stream::BUSY_POLL,
        depth: Stream::DEPTH,
        coalesce: true,
        mtu: DATAGRAM,
    };
    /// The headline stream with 16 WRITEs outstanding (1 MiB, a few
    /// hundred microseconds of data here): a stall of the receiver longer
    /// than that leaves the sender without work, which raw UDP, sending
    /// blind, never is.
    const SHALLOW: Stream = Stream {
        depth: 16,
        ..Stream::MAIN
    };
    /// The headline stream in jumbo datagrams.
    const JUMBO: Stream = Stream {
        mtu: JUMBO,
        ..Stream::MAIN
    };
    /// A driver's defaults: drivers that sleep at once.
    const SLEEPING: Stream = Stream {
        busy_poll: Duration::ZERO,
        ..Stream::MAIN
    };
}

/// Two endpoints set up as `stream` says.
fn pair_with(stream: Stream) -> Pair {
    let cfg = || {
        let mut c = DriverConfig::new("127.0.0.1:0".parse().unwrap());
        c.busy_poll = stream.busy_poll;
        c.endpoint.coalesce_acks = stream.coalesce;
        c.endpoint.mtu = u16::try_from(stream.mtu).unwrap();
        if !stream.gather {
            c.uring.gather_threshold = 0;
        }
        if let Some(n) = stream.paths {
            c.endpoint.paths = n;
            c.send_sockets = 2 * usize::from(n);
        }
        c
    };
    let mut a = Driver::bind(cfg()).unwrap();
    let mut b = Driver::bind(cfg()).unwrap();
    let (ca, cb) = connect_pair(&mut a, &mut b, Duration::from_secs(10)).unwrap();
    let (pda, pdb) = (a.endpoint().alloc_pd(), b.endpoint().alloc_pd());
    let (cqa, cqb) = (a.endpoint().create_cq(1024), b.endpoint().create_cq(1024));
    let qa = a.endpoint().create_qp(QpInit::new(pda, cqa, cqa)).unwrap();
    let qb = b.endpoint().create_qp(QpInit::new(pdb, cqb, cqb)).unwrap();
    a.endpoint().connect_qp(qa, ca, qb).unwrap();
    b.endpoint().connect_qp(qb, cb, qa).unwrap();
    Pair {
        a,
        b,
        ca,
        qa,
        qb,
        cqa,
        cqb,
        pda,
        pdb,
    }
}

/// 64 KiB WRITEs (`stream.depth` outstanding, as perftest's `ib_write_bw`
/// keeps its tx depth; the WRITEs take 16 slots of 64 KiB in turn at both
/// ends, where perftest uses one), both endpoints driven from one thread
/// each (server on its own thread), for `secs`, set up as `stream` says.
fn metaroce_write_gbps(secs: f64, stream: Stream) -> Run {
    let Pair {
        mut a,
        mut b,
        ca,
        qa,
        cqa,
        pda,
        pdb,
        ..
    } = pair_with(stream);
    let size = 64usize << 10;
    let src = a
        .endpoint()
        .reg_mr(
            pda,
            RegionBuf::copy_of(&vec![3u8; 16 * size]),
            0,
            AccessFlags::NONE,
        )
        .unwrap();
    let win = b
        .endpoint()
        .reg_mr(
            pdb,
            RegionBuf::zeroed(16 * size),
            0,
            AccessFlags::REMOTE_WRITE,
        )
        .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = stop.clone();
    let server = std::thread::spawn(move || {
        pin(Side::Receiver);
        let busy = Busy::start();
        while !stop2.load(Ordering::Relaxed) {
            b.poll(Duration::from_micros(200)).unwrap();
        }
        busy.fraction()
    });
    pin(Side::Sender);
    let (mut posted, mut done) = (0u64, 0u64);
    let mut wcs = Vec::new();
    let busy = Busy::start();
    let t0 = Instant::now();
    loop {
        let sending = t0.elapsed().as_secs_f64() < secs;
        let now = a.now();
        let e = a.endpoint();
        while sending && posted - done < stream.depth {
            let slot = posted % 16;
            let r = RemoteAddr {
                rkey: win.rkey,
                addr: slot * size as u64,
            };
            let local = Sge {
                lkey: src.lkey,
                addr: slot * size as u64,
                len: size as u32,
            };
            e.post_send(now, qa, SendWr::new(posted, SendOp::Write(r), local))
                .unwrap();
            posted += 1;
        }
        wcs.clear();
        e.poll_cq(cqa, 64, &mut wcs).unwrap();
        done += wcs.len() as u64;
        if !sending && done == posted {
            break;
        }
        a.poll(Duration::from_micros(200)).unwrap();
    }
    let elapsed = t0.elapsed().as_secs_f64();
    let tx_busy = busy.fraction();
    stop.store(true, Ordering::Relaxed);
    let rx_busy = server.join().unwrap();
    let recovery = a.endpoint().connection_stats(ca).map(|s| Recovery {
        lost: s.packets_lost,
        spurious: s.paths.iter().map(|p| p.spurious_losses).sum(),
        rto_fires: s.rto_fires,
        path_failures: s.path_failures,
    });
    Run {
        gbps: done as f64 * size as f64 * 8.0 / elapsed / 1e9,
        busy: [tx_busy, rx_busy],
        recovery,
    }
}

/// A connected pair set up for 8-byte SEND/RECV round trips: a 16-byte
/// region each side (SENDs from its first 8 bytes, RECVs into its last 8)
/// and a RECV posted on each QP.
struct PingPongPair {
    a: Driver,
    b: Driver,
    qa: Qpn,
    qb: Qpn,
    cqa: CqHandle,
    cqb: CqHandle,
    ma: MrInfo,
    mb: MrInfo,
}

fn ping_pong_pair(stream: Stream) -> PingPongPair {
    let Pair {
        mut a,
        mut b,
        qa,
        qb,
        cqa,
        cqb,
        pda,
        pdb,
        ..
    } = pair_with(stream);
    let region = || vec![0u8; 16].into_boxed_slice();
    let ma = a
        .endpoint()
        .reg_mr(pda, region(), 0, AccessFlags::LOCAL_WRITE)
        .unwrap();
    let mb = b
        .endpoint()
        .reg_mr(pdb, region(), 0, AccessFlags::LOCAL_WRITE)
        .unwrap();
    a.endpoint().post_recv(qa, recv_wr(&ma)).unwrap();
    b.endpoint().post_recv(qb, recv_wr(&mb)).unwrap();
    PingPongPair {
        a,
        b,
        qa,
        qb,
        cqa,
        cqb,
        ma,
        mb,
    }
}

/// The RECVs completed on `cq` since the last call, each reposted (and,
/// with `answer`, answered with a SEND): how many there were.
fn received(
    d: &mut Driver,
    cq: CqHandle,
    qp: Qpn,
    m: &MrInfo,
    answer: bool,
    wcs: &mut Vec<WorkCompletion>,
) -> usize {
    wcs.clear();
    d.endpoint().poll_cq(cq, 8, wcs).unwrap();
    let mut n = 0;
    for wc in wcs.iter() {
        if wc.opcode == WcOpcode::Recv {
            let now = d.now();
            d.endpoint().post_recv(qp, recv_wr(m)).unwrap();
            if answer {
                d.endpoint().post_send(now, qp, send_wr(m)).unwrap();
            }
            n += 1;
        }
    }
    n
}

/// A RECV of 8 bytes into the last half of `m`.
fn recv_wr(m: &MrInfo) -> RecvWr {
    RecvWr {
        wr_id: 0,
        sge: Sge {
            lkey: m.lkey,
            addr: 8,
            len: 8,
        }
        .into(),
    }
}

/// A SEND of the first 8 bytes of `m`.
fn send_wr(m: &MrInfo) -> SendWr {
    SendWr::new(
        0,
        SendOp::Send,
        Sge {
            lkey: m.lkey,
            addr: 0,
            len: 8,
        },
    )
}

/// 8-byte SEND/RECV round trips, both endpoints polled from this thread;
/// `coalesce`: each SEND carries the ACK of the one before it (the
/// default), else every SEND is acknowledged by a datagram of its own.
fn metaroce_ping_pong_us(rounds: usize, coalesce: bool) -> (f64, f64) {
    let PingPongPair {
        mut a,
        mut b,
        qa,
        qb,
        cqa,
        cqb,
        ma,
        mb,
    } = ping_pong_pair(Stream {
        coalesce,
        ..Stream::SLEEPING
    });
    let mut lat = Vec::with_capacity(rounds);
    let mut wcs = Vec::new();
    for _ in 0..rounds {
        let t0 = Instant::now();
        let now = a.now();
        a.endpoint().post_send(now, qa, send_wr(&ma)).unwrap();
        let mut back = false;
        while !back {
            a.poll(Duration::ZERO).unwrap();
            b.poll(Duration::ZERO).unwrap();
            received(&mut b, cqb, qb, &mb, true, &mut wcs);
            back = received(&mut a, cqa, qa, &ma, false, &mut wcs) > 0;
        }
        lat.push(t0.elapsed());
    }
    p50_p99(lat)
}

/// What one driver poll costs when there is nothing to do (a connected
/// pair, no traffic), in nanoseconds: the ping-pong polls both drivers in
/// turn, most of the time finding nothing.
fn idle_poll_ns(polls: u32) -> f64 {
    let Pair { mut a, .. } = pair_with(Stream::SLEEPING);
    let t0 = Instant::now();
    for _ in 0..polls {
        a.poll(Duration::ZERO).unwrap();
    }
    t0.elapsed().as_secs_f64() * 1e9 / f64::from(polls)
}

/// 8-byte SEND/RECV round trips, each endpoint on a core of its own,
/// busy-polling (as perftest's `ib_send_lat` polls its completion queue).
fn metaroce_ping_pong_threads_us(rounds: usize) -> (f64, f64) {
    let PingPongPair {
        mut a,
        mut b,
        qa,
        qb,
        cqa,
        cqb,
        ma,
        mb,
    } = ping_pong_pair(Stream::MAIN);
    let echo = std::thread::spawn(move || {
        pin(Side::Receiver);
        let mut wcs = Vec::new();
        let mut n = 0;
        while n < rounds {
            b.poll(Duration::from_millis(1)).unwrap();
            n += received(&mut b, cqb, qb, &mb, true, &mut wcs);
        }
        // Until the last answer is acknowledged.
        for _ in 0..1000 {
            b.poll(Duration::from_micros(100)).unwrap();
        }
    });
    let out = on_own_thread(|| {
        pin(Side::Sender);
        let mut lat = Vec::with_capacity(rounds);
        let mut wcs = Vec::new();
        for _ in 0..rounds {
            let t0 = Instant::now();
            let now = a.now();
            a.endpoint().post_send(now, qa, send_wr(&ma)).unwrap();
            let mut back = false;
            while !back {
                a.poll(Duration::from_millis(1)).unwrap();
                back = received(&mut a, cqa, qa, &ma, false, &mut wcs) > 0;
            }
            lat.push(t0.elapsed());
        }
        for _ in 0..1000 {
            a.poll(Duration::from_micros(100)).unwrap();
        }
        p50_p99(lat)
    });
    echo.join().unwrap();
    out
}

/// CPU time this process has used so far (all threads, user + system),
/// from `/proc/self/stat` (in clock ticks of 10 ms).
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command name (which is in parentheses).
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<u64> = rest
        .split_whitespace()
        .map(|x| x.parse().unwrap_or(0))
        .collect();
    // utime and stime are fields 14 and 15, the 12th and 13th after ')'.
    (f.get(11).copied().unwrap_or(0) + f.get(12).copied().unwrap_or(0)) as f64 / 100.0
}

/// The CPU clock in Hz, from `/proc/cpuinfo` (0 if unknown).
fn cpu_hz() -> f64 {
    std::fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| {
            l.strip_prefix("cpu MHz")?
                .split(':')
                .nth(1)?
                .trim()
                .parse::<f64>()
                .ok()
        })
        .map_or(0.0, |mhz| mhz * 1e6)
}

/// Runs a throughput measurement: the run and the CPU cycles it spent per
/// byte moved (both ends, user + kernel).
fn measured(f: impl FnOnce() -> Run) -> (Run, f64) {
    let (c0, t0) = (cpu_seconds(), Instant::now());
    let run = f();
    let (cpu, wall) = (cpu_seconds() - c0, t0.elapsed().as_secs_f64());
    let bytes = run.gbps * 1e9 / 8.0 * wall;
    (run, cpu * cpu_hz() / bytes)
}

/// p50s of one round of the 8 B round trips, µs.
struct RoundTrips {
    metaroce: f64,
    /// metaroce with every SEND acknowledged by a datagram of its own.
    separate_acks: f64,
    udp: f64,
    /// Raw UDP polled from one thread.
    udp_polled: f64,
    /// metaroce with each side busy-polling on a core of its own.
    threads: f64,
    /// Raw UDP with each side spinning on a core of its own.
    udp_spinning: f64,
}

/// The 8 B round trips (raw UDP with sleeping threads and polled, then
/// metaroce with ACKs riding on the SENDs and apart), printed with their
/// ratios.
fn round_trips() -> RoundTrips {
    let (up50, up99) = udp_ping_pong_us(20_000);
    let (pp50, pp99) = udp_ping_pong_polled_us(20_000);
    let (sp50, sp99) = metaroce_ping_pong_us(20_000, false);
    let (mp50, mp99) = metaroce_ping_pong_us(20_000, true);
    let (us50, us99) = udp_ping_pong_spinning_us(20_000);
    let (mt50, mt99) = metaroce_ping_pong_threads_us(20_000);
    println!("  8 B round trip (us): metaroce SEND p50 {mp50:.1} p99 {mp99:.1} (ACKs apart: p50 {sp50:.1} p99 {sp99:.1}) | raw UDP p50 {up50:.1} p99 {up99:.1} (polled from one thread: p50 {pp50:.1} p99 {pp99:.1})");
    println!(
        "  metaroce / raw UDP: p50 {:.2}, p99 {:.2}; against raw UDP polled: p50 {:.2}, p99 {:.2}; ACKs riding on SENDs / apart: p50 {:.2}",
        mp50 / up50,
        mp99 / up99,
        mp50 / pp50,
        mp99 / pp99,
        mp50 / sp50,
    );
    println!(
        "  each side busy-polling on a core of its own: metaroce p50 {mt50:.1} p99 {mt99:.1} | raw UDP spinning p50 {us50:.1} p99 {us99:.1}: p50 {:.2}, p99 {:.2}",
        mt50 / us50,
        mt99 / us99
    );
    RoundTrips {
        metaroce: mp50,
        separate_acks: sp50,
        udp: up50,
        udp_polled: pp50,
        threads: mt50,
        udp_spinning: us50,
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Runs one throughput test alone, `rounds` times: `metaroce` (64 KiB
/// WRITEs, payloads gathered, busy polling, 128 outstanding), `metaroce1`
/// (the same over one path), `sleeping` (without busy polling), `shallow`
/// (16 outstanding), `jumbo` (8 KiB payloads), `udp` (raw UDP with
/// GSO/GRO), `udp-gathered` (raw UDP laid out as metaroce sends),
/// `udp-jumbo` or `udp-gathered-jumbo` (those two in jumbo datagrams); or
/// the round trips, `ping-pong` (all of them) or `ping-pong-metaroce`
/// (metaroce's alone, with their CPU time); or `udp-pieces`, what the
/// kernel spends on each `iovec` piece of a send.
fn only_throughput(which: &str, secs: f64, rounds: usize) {
    let hz = cpu_hz();
    if which == "ping-pong" {
        let (mut sleeping, mut polled, mut acks, mut threads) = (vec![], vec![], vec![], vec![]);
        for round in 1..=rounds {
            println!("round {round}");
            let rt = round_trips();
            sleeping.push(rt.metaroce / rt.udp);
            polled.push(rt.metaroce / rt.udp_polled);
            acks.push(rt.metaroce / rt.separate_acks);
            threads.push(rt.threads / rt.udp_spinning);
        }
        println!(
            "medians over {rounds} rounds, 8 B RTT p50: metaroce/raw UDP {:.2}, metaroce/raw UDP polled from one thread {:.2}, each side on its own core, busy-polling/spinning {:.2}, ACKs riding on the SENDs / apart {:.2}",
            median(sleeping),
            median(polled),
            median(threads),
            median(acks)
        );
        return;
    }
    if which == "udp-pieces" {
        // What the kernel spends on an `iovec` piece: the baseline's own
        // buffer sent whole, then in 64-byte pieces, alternately.
        let bytes = (65_507 / DATAGRAM * DATAGRAM) as f64;
        let pieces = bytes / 64.0;
        let mut per_piece = vec![];
        for round in 1..=rounds {
            let whole = on_own_thread(|| udp_gso_gbps(secs, DATAGRAM)).gbps;
            let cut = on_own_thread(|| {
                udp_pieces_gbps(secs, DATAGRAM, Pieces::Cut(64), Receive::Discard)
            })
            .gbps;
            // Microseconds a send takes, whole and cut.
            let (tw, tc) = (bytes * 8.0 / whole / 1e3, bytes * 8.0 / cut / 1e3);
            let ns = (tc - tw) * 1e3 / (pieces - 1.0);
            per_piece.push(ns);
            println!(
                "round {round}: raw UDP {whole:.2} Gbit/s whole ({tw:.1} us a {bytes} B send), {cut:.2} Gbit/s in {pieces} pieces of 64 B ({tc:.1} us): {ns:.0} ns a piece"
            );
        }
        println!(
            "median over {rounds} rounds: {:.0} ns a piece; metaroce's 4 KiB datagrams take 2 a datagram, 30 a send",
            median(per_piece)
        );
        return;
    }
    if which == "udp-receive" {
        // What a receiver that puts payloads where they belong pays, in
        // raw UDP sent with metaroce's layout, alternately: read and
        // thrown away (the baseline), read and then copied into a region
        // (metaroce's two copies), read straight into the region (one
        // copy, as a receiver that knew where the next payloads go could).
        let full = Pieces::max_segs(DATAGRAM);
        let kinds = [Receive::Discard, Receive::Place, Receive::Scatter];
        let (mut place, mut scatter) = (vec![], vec![]);
        for round in 1..=rounds {
            let g = kinds.map(|k| {
                on_own_thread(|| {
                    udp_pieces_gbps(secs, DATAGRAM, Pieces::Gathered { segs: full }, k)
                })
                .gbps
            });
            place.push(g[1] / g[0]);
            scatter.push(g[2] / g[1]);
            println!(
                "round {round}: thrown away {:.2} Gbit/s | copied into a region after the read {:.2} ({:.2} of thrown away) | read straight into the region {:.2} ({:.2} of copied after)",
                g[0], g[1], g[1] / g[0], g[2], g[2] / g[1]
            );
        }
        println!(
            "medians over {rounds} rounds: copied after the read / thrown away {:.2}, read into place / copied after the read {:.2}",
            median(place),
            median(scatter)
        );
        return;
    }
    if which == "udp-no-copy" {
        // Ways a sender could head payloads it does not copy, in raw UDP,
        // against the contiguous baseline, alternately: gathered as
        // metaroce sends (15 and 8 datagrams a send), gathered with
        // MSG_ZEROCOPY and spliced from the pages (8 a send, the most
        // their fragments allow).
        let names = [
            "gathered, 15 a send",
            "gathered, 8 a send",
            "MSG_ZEROCOPY, 8 a send",
            "spliced, 8 a send",
        ];
        let mut ratios = vec![vec![]; names.len()];
        let full = Pieces::max_segs(DATAGRAM);
        for round in 1..=rounds {
            let udp = on_own_thread(|| udp_gso_gbps(secs, DATAGRAM)).gbps;
            let runs = [
                on_own_thread(|| {
                    udp_pieces_gbps(
                        secs,
                        DATAGRAM,
                        Pieces::Gathered { segs: full },
                        Receive::Discard,
                    )
                }),
                on_own_thread(|| {
                    udp_pieces_gbps(
                        secs,
                        DATAGRAM,
                        Pieces::Gathered { segs: ZC_SEGS },
                        Receive::Discard,
                    )
                }),
                on_own_thread(|| {
                    udp_pieces_gbps(
                        secs,
                        DATAGRAM,
                        Pieces::ZeroCopy { segs: ZC_SEGS },
                        Receive::Discard,
                    )
                }),
                on_own_thread(|| udp_spliced_gbps(secs, DATAGRAM, ZC_SEGS)),
            ];
            let mut line = format!("round {round}: raw UDP {udp:.2} Gbit/s");
            for ((name, run), r) in names.iter().zip(&runs).zip(&mut ratios) {
                r.push(run.gbps / udp);
                line += &format!(" | {name} {:.2} ({:.2})", run.gbps, run.gbps / udp);
            }
            println!("{line}");
        }
        let medians: Vec<String> = names
            .iter()
            .zip(ratios)
            .map(|(n, r)| format!("{n} {:.2}", median(r)))
            .collect();
        println!(
            "medians over {rounds} rounds, of raw UDP: {}",
            medians.join(", ")
        );
        return;
    }
    if which == "ping-pong-metaroce" {
        for round in 1..=rounds {
            const N: usize = 100_000;
            let t0 = thread_user_sys();
            let (p50, p99) = metaroce_ping_pong_us(N, true);
            let t1 = thread_user_sys();
            let (u50, _) = udp_ping_pong_polled_us(N);
            let t2 = thread_user_sys();
            let idle = idle_poll_ns(1_000_000);
            let per = |a: Duration, b: Duration| (b - a).as_secs_f64() * 1e6 / N as f64;
            println!(
                "round {round}: metaroce 8 B round trip p50 {p50:.1} us, p99 {p99:.1} us, CPU a round trip (setup included) user {:.1} us, kernel {:.1} us | raw UDP polled p50 {u50:.1} us, user {:.1} us, kernel {:.1} us | a poll that finds nothing {idle:.0} ns",
                per(t0.0, t1.0),
                per(t0.1, t1.1),
                per(t1.0, t2.0),
                per(t1.1, t2.1)
            );
        }
        return;
    }
    for round in 1..=rounds {
        let run = match which {
            "metaroce" => on_own_thread(|| metaroce_write_gbps(secs, Stream::MAIN)),
            "metaroce1" => on_own_thread(|| {
                metaroce_write_gbps(
                    secs,
                    Stream {
                        paths: Some(1),
                        ..Stream::MAIN
                    },
                )
            }),
            "sleeping" => on_own_thread(|| metaroce_write_gbps(secs, Stream::SLEEPING)),
            "shallow" => on_own_thread(|| metaroce_write_gbps(secs, Stream::SHALLOW)),
            "udp" => on_own_thread(|| udp_gso_gbps(secs, DATAGRAM)),
            "udp-gathered" => on_own_thread(|| udp_gathered_gbps(secs, DATAGRAM)),
            "jumbo" => on_own_thread(|| metaroce_write_gbps(secs, Stream::JUMBO)),
            "udp-jumbo" => on_own_thread(|| udp_gso_gbps(secs, JUMBO)),
            "udp-gathered-jumbo" => on_own_thread(|| udp_gathered_gbps(secs, JUMBO)),
            other => panic!(
                "unknown test {other:?}: metaroce, metaroce1 (one path), sleeping (no busy poll), shallow (16 WRITEs outstanding), jumbo (8 KiB payloads), udp, udp-gathered, udp-jumbo, udp-gathered-jumbo, udp-pieces, udp-no-copy, udp-receive, ping-pong or ping-pong-metaroce"
            ),
        };
        let c = run.cycles_per_byte(hz);
        println!(
            "round {round}: {which} {:.2} Gbit/s, busy sender/receiver {:.2}/{:.2}, cycles per byte {:.2}/{:.2}",
            run.gbps, run.busy[0], run.busy[1], c[0], c[1]
        );
    }
}

fn main() {
    let secs: f64 = std::env::args()
        .nth(1)
        .map_or(2.0, |a| a.parse().expect("seconds"));
    let rounds: usize = std::env::args()
        .nth(2)
        .map_or(3, |a| a.parse().expect("rounds"));
    if let Some(only) = std::env::args().nth(3) {
        return only_throughput(&only, secs, rounds);
    }
    // Alternating rounds, so that a noisy shared machine disturbs all
    // alike; the ratios are medians over the rounds' own ratios.
    let (mut r_udp, mut r_tcp, mut r_cyc, mut r_lat) = (vec![], vec![], vec![], vec![]);
    let (mut r_gather, mut r_one, mut r_sleep, mut r_layout) = (vec![], vec![], vec![], vec![]);
    let (mut r_shallow, mut r_jumbo) = (vec![], vec![]);
    let (mut r_lat_polled, mut r_lat_acks, mut r_lat_threads) = (vec![], vec![], vec![]);
    let mut r_side = [vec![], vec![]];
    for round in 1..=rounds {
        let (tcp_run, tcp_c) = measured(|| on_own_thread(|| tcp_gbps(secs)));
        let (udp_run, udp_c) = measured(|| on_own_thread(|| udp_gso_gbps(secs, DATAGRAM)));
        let udp_gathered = on_own_thread(|| udp_gathered_gbps(secs, DATAGRAM)).gbps;
        let udp_jumbo = on_own_thread(|| udp_gso_gbps(secs, JUMBO)).gbps;
        let mr_jumbo = on_own_thread(|| metaroce_write_gbps(secs, Stream::JUMBO)).gbps;
        let (mr_run, mr_c) = measured(|| on_own_thread(|| metaroce_write_gbps(secs, Stream::MAIN)));
        let copied = Stream {
            gather: false,
            ..Stream::MAIN
        };
        let (mc_run, mc_c) = measured(|| on_own_thread(|| metaroce_write_gbps(secs, copied)));
        let one_path = Stream {
            paths: Some(1),
            ..Stream::MAIN
        };
        let one = on_own_thread(|| metaroce_write_gbps(secs, one_path)).gbps;
        let sleeping = on_own_thread(|| metaroce_write_gbps(secs, Stream::SLEEPING)).gbps;
        let shallow = on_own_thread(|| metaroce_write_gbps(secs, Stream::SHALLOW)).gbps;
        let (tcp, udp, mr, mc) = (tcp_run.gbps, udp_run.gbps, mr_run.gbps, mc_run.gbps);
        println!("round {round}");
        println!("  throughput (Gbit/s): metaroce WRITE 64 KiB {mr:.2} (payloads copied by the driver: {mc:.2}; one path: {one:.2}; drivers that sleep at once: {sleeping:.2}; 16 outstanding: {shallow:.2}) | raw UDP GSO/GRO {udp:.2} (sent as metaroce lays datagrams out, header and payload apart: {udp_gathered:.2}) | TCP {tcp:.2}");
        println!(
            "  metaroce / raw UDP = {:.2}   metaroce / TCP = {:.2}   gathered / copied = {:.2}",
            mr / udp,
            mr / tcp,
            mr / mc
        );
        println!(
            "  raw UDP laid out as metaroce / raw UDP = {:.2}   metaroce / raw UDP laid out as metaroce = {:.2}",
            udp_gathered / udp,
            mr / udp_gathered
        );
        println!(
            "  jumbo datagrams ({JUMBO} bytes, 8 KiB payloads), both sides: metaroce {mr_jumbo:.2}, raw UDP {udp_jumbo:.2}: metaroce / raw UDP = {:.2}",
            mr_jumbo / udp_jumbo
        );
        println!("  CPU cycles per byte (both ends): metaroce {mr_c:.2} (copied {mc_c:.2}) | raw UDP {udp_c:.2} | TCP {tcp_c:.2}");
        let busy = |r: Run| format!("{:.2}/{:.2}", r.busy[0], r.busy[1]);
        println!(
            "  busy, sender/receiver (CPU time / wall time): metaroce {} (copied {}) | raw UDP {} | TCP {}",
            busy(mr_run),
            busy(mc_run),
            busy(udp_run),
            busy(tcp_run)
        );
        let hz = cpu_hz();
        let (m, u) = (mr_run.cycles_per_byte(hz), udp_run.cycles_per_byte(hz));
        println!(
            "  CPU cycles per byte, sender/receiver thread: metaroce {:.2}/{:.2} | raw UDP {:.2}/{:.2} | metaroce/raw UDP: sender {:.2}, receiver {:.2}",
            m[0],
            m[1],
            u[0],
            u[1],
            m[0] / u[0],
            m[1] / u[1]
        );
        r_side[0].push(m[0] / u[0]);
        r_side[1].push(m[1] / u[1]);
        if let Some(r) = mr_run.recovery {
            println!("  metaroce stream's loss recovery (sender): {r}");
        }
        let rt = round_trips();
        r_udp.push(mr / udp);
        r_tcp.push(mr / tcp);
        r_cyc.push(mr_c / udp_c);
        r_lat.push(rt.metaroce / rt.udp);
        r_lat_polled.push(rt.metaroce / rt.udp_polled);
        r_lat_threads.push(rt.threads / rt.udp_spinning);
        r_lat_acks.push(rt.metaroce / rt.separate_acks);
        r_gather.push(mr / mc);
        r_one.push(one / udp);
        r_sleep.push(sleeping / udp);
        r_shallow.push(shallow / udp);
        r_layout.push(udp_gathered / udp);
        r_jumbo.push(mr_jumbo / udp_jumbo);
    }
    println!(
        "medians over {rounds} rounds: metaroce/raw UDP {:.2}, metaroce/TCP {:.2}, cycles per byte metaroce/raw UDP {:.2}, 8 B RTT p50 metaroce/raw UDP {:.2}, gathered/copied {:.2}",
        median(r_udp),
        median(r_tcp),
        median(r_cyc),
        median(r_lat),
        median(r_gather)
    );
    println!(
        "  8 B RTT p50: metaroce/raw UDP polled from one thread {:.2}; each side on its own core, busy-polling/spinning {:.2}; ACKs riding on the SENDs / apart {:.2}",
        median(r_lat_polled),
        median(r_lat_threads),
        median(r_lat_acks)
    );
    println!(
        "  one path (no spraying): metaroce/raw UDP {:.2}; drivers that sleep at once (no busy poll): {:.2}; 16 WRITEs outstanding instead of 128: {:.2}",
        median(r_one),
        median(r_sleep),
        median(r_shallow)
    );
    println!(
        "  raw UDP laid out as metaroce (64-byte headers and 4 KiB payloads from apart, 30 pieces a send) / raw UDP: {:.2}",
        median(r_layout)
    );
    println!(
        "  jumbo datagrams (8 KiB payloads) on both sides: metaroce/raw UDP {:.2}",
        median(r_jumbo)
    );
    let [rs, rr] = r_side;
    println!(
        "  per side, cycles per byte metaroce/raw UDP: sender {:.2}, receiver {:.2} (a side at 1.25 or more holds metaroce under 0.8 of raw UDP)",
        median(rs),
        median(rr)
    );
}
