//! The io_uring driver: one ring per driver (per thread), a multishot
//! `RECVMSG` into a provided-buffer ring on the listen socket, `SENDMSG`
//! (GSO and ECN in control data) or `SENDMSG_ZC` per transmit from a pool of
//! send slots, and the core's next timer as a `TIMEOUT` on the ring, so one
//! `io_uring_enter` per loop turn submits everything and waits for a
//! datagram, a send completion or the timer, whichever comes first (and a
//! second one sends what the wake-up provoked). A turn with nothing to
//! submit, nothing to wait for and no completion held by the kernel (the
//! `IORING_SQ_TASKRUN` flag, in shared memory) makes no system call at
//! all. A driver moved to another thread re-arms its receive there on the
//! next turn.
//!
//! Large payloads go out without a copy in user space: the core gathers a
//! transmit ([`Endpoint::poll_transmit_gather`]), the headers in the send
//! slot and each payload left in its memory region, and one `SENDMSG` (or
//! `SENDMSG_ZC`) takes an `iovec` per piece; the regions stay pinned in the
//! core until the slot's last completion.
//!
//! All `unsafe` but the one call that hands region memory to a slot lives
//! in [`sys`]; the control messages are parsed and built by safe code in
//! [`cmsg`].

mod cmsg;
mod sys;

use crate::fault::{self, Faults};
use crate::sockets::Sockets;
use crate::waker::{WakeReceiver, Waker};
use crate::{Backend, Clock, DriverConfig, DriverError, DriverStats, FaultConfig, IoDriver};
use io_uring::cqueue;
use io_uring::types::RecvMsgOut;
use metaroce_proto::{Chunk, Endpoint, Gather, Instant, RegionPin, Transmit};
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::OnceLock;
use std::time::Duration;

pub use sys::UringCaps;
use sys::{SendCqe, TAG_CTRL, TAG_MASK, TAG_RECV, TAG_SEND, TAG_TIMER, TAG_WAKE};

/// The kernel's `UDP_MAX_SEGMENTS` on every kernel with GSO (newer ones allow 128).
const KERNEL_GSO_SEGMENTS: usize = 64;
/// Pieces of a gathered send kept on the stack (a header and a payload per
/// segment; a GSO batch of 4 KiB segments has at most 15).
const GATHER_PIECES: usize = 32;
/// Largest UDP payload of one send (IPv4; a GSO batch included).
const MAX_SEND: usize = 65_507;
/// Largest GRO receive the kernel builds.
const MAX_GRO_RECV: usize = 65_536;
/// A due timer this late says the thread was held up (see
/// `drain_before_late_timers`); a turn normally runs a timer within
/// microseconds of its deadline.
const LATE_TIMER: Duration = Duration::from_micros(250);
/// Rounds of receive buffers read before late timers run, at most.
const DRAIN_ROUNDS: u32 = 64;

/// Whether this kernel can run the io_uring backend, probed once per process
/// (ring creation, the opcodes used, a provided-buffer ring registration).
///
/// ```
/// match metaroce_io::uring_probe() {
///     Ok(caps) => println!("io_uring available, zero copy: {}", caps.sendmsg_zc),
///     Err(reason) => println!("io_uring unavailable: {reason}"),
/// }
/// ```
pub fn uring_probe() -> Result<UringCaps, String> {
    static PROBE: OnceLock<Result<UringCaps, String>> = OnceLock::new();
    PROBE.get_or_init(sys::probe_kernel).clone()
}

/// What a send slot's request was, for its completions.
#[derive(Debug, Clone, Copy, Default)]
struct SlotMeta {
    /// Datagrams one successful result stands for.
    datagrams: u64,
    /// Sent with zero copy.
    zc: bool,
    /// Carried `UDP_SEGMENT`.
    gso: bool,
    /// Payloads straight from their regions.
    gathered: bool,
}

/// A transmit's GSO segment size (`None`: one plain datagram, as is a
/// batch of one) and its number of datagrams.
fn segments(t: &Transmit) -> (Option<usize>, usize) {
    let seg = t.segment_size.filter(|&s| s > 0 && s < t.size);
    (seg, seg.map_or(1, |s| t.size.div_ceil(s)))
}

/// Fragments one zero-copy send may make (`MAX_SKB_FRAGS`, 17 unless the
/// kernel was built with more).
const ZC_MAX_FRAGS: usize = 17;

/// Pages the pieces of a gathered send touch, each counted apart (the
/// kernel makes a fragment per piece and page); `base` is the address of
/// the slot's buffer, which `Buf` pieces are ranges of.
fn page_spans(pieces: &[sys::Piece], base: usize) -> usize {
    const PAGE: usize = 4096;
    let span = |start: usize, len: usize| {
        let last = start + len.max(1) - 1;
        last / PAGE - start / PAGE + 1
    };
    pieces
        .iter()
        .map(|p| match p {
            sys::Piece::Buf(r) => span(base + r.start, r.len()),
            sys::Piece::Extern(ptr, len) => span(ptr.addr(), *len),
        })
        .sum()
}

/// Zero-copy notifications in a row saying the kernel copied after which
/// the driver stops asking for zero copy.
pub const ZC_COPIED_LIMIT: u32 = 64;

/// Runs one [`Endpoint`] on io_uring. Same shape and loop as
/// [`PortableDriver`](crate::PortableDriver): call [`poll`](Self::poll) in a
/// loop and use [`endpoint`](Self::endpoint) in between.
///
/// ```no_run
/// use metaroce_io::{DriverConfig, UringDriver};
/// use std::time::Duration;
/// let mut drv = UringDriver::bind(DriverConfig::new("127.0.0.1:0".parse().unwrap())).unwrap();
/// drv.poll(Duration::from_millis(1)).unwrap();
/// println!("{:?}", drv.stats());
/// ```
pub struct UringDriver {
    /// The ring: `UringDriver`'s `Drop` drains it before the pins of the
    /// gathered payloads in `ep`'s regions are released.
    ring: sys::Ring,
    ep: Endpoint,
    clock: Clock,
    /// The wall clock, read with the turn's `now` once a receive timestamp
    /// needs it (see [`Clock::arrival`]).
    wall: Option<std::time::Duration>,
    /// Receive sockets, one per plane.
    recv: Vec<UdpSocket>,
    send: Vec<UdpSocket>,
    sockets: Sockets,
    local: SocketAddr,
    v6: bool,
    free: Vec<usize>,
    meta: Vec<SlotMeta>,
    /// Where the core put the last transmit's bytes (gathered sends).
    gather: Gather,
    /// Whether transmits are gathered (payloads from their regions).
    gathering: bool,
    /// The pins of the regions each slot's send reads, released to the
    /// core at the slot's last completion.
    pinned: Vec<Vec<RegionPin>>,
    /// GSO segments the core batches.
    segments: usize,
    /// Wire bytes a turn queues before it submits ([`DriverConfig::turn_send_bytes`]).
    turn_send_bytes: usize,
    /// [`DriverConfig::busy_poll`].
    busy_poll: Duration,
    /// A receive of this turn ended for lack of buffers: datagrams wait
    /// in the socket.
    recv_starved: bool,
    /// The socket whose receive is armed first at the next turn: the
    /// planes' sockets share the provided buffers, and the receive
    /// submitted first takes them all while its socket has a backlog, so
    /// the order turns round (see [`arm_receives`](Self::arm_receives)).
    recv_first: usize,
    /// Something this turn meant to queue (a send, a receive or the
    /// waker's poll re-armed) found the submission queue full with the
    /// kernel taking nothing from it (`sys::Ring::push`) and waits for the
    /// next turn, which this one must not sleep before.
    backlog: bool,
    /// The last turn did nothing, and nothing is due before this instant
    /// (the core's next timer; `Instant::MAX` if none): until then a turn
    /// finds nothing unless a datagram or a command comes ([`quiet`]).
    ///
    /// [`quiet`]: Self::quiet
    quiet_until: Option<Instant>,
    /// GSO still works (downgraded on EIO/EINVAL).
    gso: bool,
    /// Zero copy enabled and still working.
    zc: bool,
    zc_threshold: usize,
    /// Zero-copy notifications in a row that said the kernel copied.
    zc_copied_run: u32,
    /// The armed timer: generation and deadline.
    timer: Option<(u64, Instant)>,
    timer_gen: u64,
    stats: DriverStats,
    faults: Option<Box<Faults>>,
    wake: Option<WakeReceiver>,
    /// The armed waker poll: generation and the thread that armed it.
    wake_armed: Option<(u64, std::thread::ThreadId)>,
    wake_gen: u64,
}

impl std::fmt::Debug for UringDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UringDriver")
            .field("local", &self.local)
            .field("planes", &self.recv.len())
            .field("send_sockets", &self.send.len())
            .field("gso", &self.gso)
            .field("zero_copy", &self.zc)
            .field("free_slots", &self.free.len())
            .field("timer", &self.timer)
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl UringDriver {
    /// Probes io_uring, binds the receive socket and the send sockets, sets
    /// up the ring and creates the endpoint. Fails with
    /// [`DriverError::UringUnavailable`] on a kernel without what it needs.
    pub fn bind(cfg: DriverConfig) -> Result<Self, DriverError> {
        let caps = uring_probe().map_err(DriverError::UringUnavailable)?;
        let mut sockets = Sockets::bind(&cfg)?;
        let local = sockets.local;
        let v6 = local.is_ipv6();
        let recv = std::mem::take(&mut sockets.recv);
        let mut gro = true;
        for r in &recv {
            let rfd = r.as_raw_fd();
            let tos = if v6 {
                sys::setsockopt_int(rfd, libc::IPPROTO_IPV6, libc::IPV6_RECVTCLASS, 1)
            } else {
                sys::setsockopt_int(rfd, libc::IPPROTO_IP, libc::IP_RECVTOS, 1)
            };
            if let Err(e) = tos {
                tracing::debug!(error = %e, "no ECN on receive");
            }
            gro &= sys::setsockopt_int(rfd, libc::SOL_UDP, cmsg::UDP_GRO, 1).is_ok();
            // Arrival stamps: RTT samples then leave out the wait for this
            // thread (`Endpoint::handle_datagram_stamped`).
            if let Err(e) = sys::setsockopt_int(rfd, libc::SOL_SOCKET, libc::SO_TIMESTAMPNS, 1) {
                tracing::debug!(error = %e, "no receive timestamps");
            }
        }
        let send = std::mem::take(&mut sockets.send);
        // Setting a default segment size of 0 (none) tells whether the
        // kernel knows UDP_SEGMENT at all.
        let gso = cfg.max_gso_segments > 1
            && send.iter().all(|s| {
                sys::setsockopt_int(s.as_raw_fd(), libc::SOL_UDP, cmsg::UDP_SEGMENT, 0).is_ok()
            });
        let seed = cfg.endpoint_seed();
        let mut ecfg = sockets.endpoint_config(cfg.endpoint);
        ecfg.max_gso_segments = if gso {
            KERNEL_GSO_SEGMENTS.clamp(1, cfg.max_gso_segments.max(1))
        } else {
            1
        };
        let segments = ecfg.max_gso_segments;
        let recv_payload = if gro {
            MAX_GRO_RECV
        } else {
            usize::from(metaroce_proto::consts::MAX_MTU)
        };
        let u = &cfg.uring;
        let ring = sys::Ring::new(
            u.entries.max(8).next_power_of_two(),
            u.recv_buffers,
            recv_payload,
            u.send_slots,
            MAX_SEND,
            segments,
        )
        .map_err(|e| DriverError::UringUnavailable(format!("ring set-up failed: {e}")))?;
        let ep = Endpoint::new(ecfg, seed)?;
        let faults = Faults::new(&cfg.faults);
        let zc = u.zero_copy && caps.sendmsg_zc;
        tracing::debug!(%local, send_sockets = send.len(), gro, gso_segments = segments, zero_copy = zc, "io_uring UDP driver bound");
        let n = ring.slots();
        Ok(UringDriver {
            ep,
            clock: Clock::new(),
            wall: None,
            recv,
            send,
            sockets,
            local,
            v6,
            ring,
            free: (0..n).rev().collect(),
            meta: vec![SlotMeta::default(); n],
            gather: Gather::new(u.gather_threshold),
            gathering: u.gather_threshold > 0,
            pinned: (0..n).map(|_| Vec::new()).collect(),
            segments,
            turn_send_bytes: cfg.turn_send_bytes,
            busy_poll: cfg.busy_poll,
            recv_starved: false,
            recv_first: 0,
            backlog: false,
            quiet_until: None,
            gso,
            zc,
            zc_threshold: u.zero_copy_threshold,
            zc_copied_run: 0,
            timer: None,
            timer_gen: 0,
            stats: DriverStats::default(),
            faults,
            wake: None,
            wake_armed: None,
            wake_gen: 0,
        })
    }

    /// The endpoint, to post work, connect, and poll completions and events.
    pub fn endpoint(&mut self) -> &mut Endpoint {
        &mut self.ep
    }

    /// The address peers reach this endpoint at.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// The current time on the driver's clock.
    pub fn now(&self) -> Instant {
        self.clock.now()
    }

    /// The driver's own counters.
    pub fn stats(&self) -> DriverStats {
        self.stats
    }

    /// Whether transmits of at least the configured threshold go out with
    /// zero copy (false once the kernel refused it, or copied
    /// [`ZC_COPIED_LIMIT`] of them in a row).
    pub fn zero_copy(&self) -> bool {
        self.zc
    }

    /// A handle that cuts this driver's wait short from another thread
    /// (created on the first call, polled on the ring; see [`Waker`]).
    pub fn waker(&mut self) -> Result<Waker, DriverError> {
        Ok(WakeReceiver::waker_in(&mut self.wake)?)
    }

    /// Keeps the waker's poll armed, by the thread that polls (like the
    /// receive: a poll armed by another thread is replaced).
    fn arm_wake(&mut self) -> Result<(), DriverError> {
        let Some(w) = &self.wake else { return Ok(()) };
        let me = sys::this_thread();
        match self.wake_armed {
            Some((_, owner)) if owner == me => return Ok(()),
            Some((gen, _)) => {
                if !self.ring.cancel(TAG_WAKE | gen)? {
                    self.backlog = true;
                    return Ok(());
                }
                // Cancelled: a new one is armed below, or by the next turn
                // if the queue has no room for it.
                self.wake_armed = None;
            }
            None => {}
        }
        if !self.ring.arm_wake(w.fd(), self.wake_gen + 1)? {
            self.backlog = true;
            return Ok(());
        }
        self.wake_gen += 1;
        self.wake_armed = Some((self.wake_gen, me));
        Ok(())
    }

    /// Replaces the fault injection (see [`IoDriver::set_faults`]).
    pub fn set_faults(&mut self, faults: FaultConfig) {
        fault::replace(&mut self.faults, &faults, self.clock.now(), &mut self.ep);
    }

    /// Runs one turn of the loop: hands what completed to the core (datagrams,
    /// finished sends), runs due timers, queues what the core has to send,
    /// and submits it all with one `io_uring_enter`. A turn with nothing to
    /// do waits in that same call, for a datagram, a send completion or a
    /// timer (at most `max_wait` or the core's next timer away), then hands
    /// what woke it to the core and submits the answers (a second enter, only
    /// if there are any), so that nothing the core produced waits for the
    /// caller's next turn. A turn that has nothing to submit and must not
    /// wait enters the kernel only if it holds completions for us
    /// ([`DriverStats::idle_turns`] counts those that did not).
    pub fn poll(&mut self, max_wait: Duration) -> Result<(), DriverError> {
        self.poll_turn(max_wait).map(|_| ())
    }

    /// [`poll`](Self::poll), saying whether the turn did anything (took a
    /// datagram or a send completion, ran a timer, queued a send, made a
    /// completion or an event).
    fn poll_turn(&mut self, max_wait: Duration) -> Result<bool, DriverError> {
        // Completions the kernel holds as task work (a datagram that came
        // while this thread was busy) or on its overflow list: an enter
        // posts them, for this turn.
        if self.ring.kernel_holds_completions() {
            self.ring.submit(0)?;
            self.stats.submits += 1;
        }
        let progress = self.work()?;
        let mut want = 0;
        // With a backlog the turn does not sleep: the next one queues it.
        if !progress && !max_wait.is_zero() && !self.backlog {
            // (A turn that must not wait reads no clock for it: a
            // ping-pong polled from one thread runs six turns a round trip.)
            let now = self.clock.now();
            let wait = fault::timer_wait(&mut self.ep, self.faults.as_deref(), now, max_wait);
            if !wait.is_zero() {
                let deadline = now + wait;
                if self.busy_poll(wait)? {
                    return Ok(true);
                }
                // What the busy poll spent counts against the wait, and a
                // turn without a timer armed must not wait at all.
                if !self.clock.until(deadline).is_zero() && self.set_timer(deadline)? {
                    want = 1;
                    self.stats.waits += 1;
                }
            }
        }
        if want == 0 && !self.ring.queued() && !self.ring.kernel_holds_completions() {
            // Nothing to hand the kernel, nothing to wait for and nothing
            // it holds for us: no system call.
            self.stats.idle_turns += 1;
            return Ok(progress);
        }
        self.ring.submit(want)?;
        self.stats.submits += 1;
        let mut woke = false;
        if want > 0 {
            woke = self.work()?;
            if woke && self.ring.queued() {
                self.ring.submit(0)?;
                self.stats.submits += 1;
            }
        }
        Ok(progress || woke)
    }

    /// One turn that never sleeps, for a caller that waits between turns
    /// itself (on [`wait_fds`](Self::wait_fds), for at most
    /// [`idle_wait`](Self::idle_wait)); whether it did anything.
    pub(crate) fn turn(&mut self) -> Result<bool, DriverError> {
        self.poll_turn(Duration::ZERO)
    }

    /// Whether a [`turn`](Self::turn) now would find nothing to do, known
    /// without running one (a few loads from memory shared with the
    /// kernel, one clock reading): the last turn did nothing, no completion
    /// waits in the ring or as the kernel's task work, nothing waits to be
    /// submitted, and the core's next timer is still ahead. The caller
    /// must run a turn anyway after it changed the endpoint (a post, a
    /// connect). For a thread that polls: NCCL's proxy thread calls the
    /// plugin's `test` millions of times a second.
    pub(crate) fn quiet(&mut self) -> bool {
        !self.backlog
            && !self.ring.queued()
            && !self.ring.completions_ready()
            && !self.ring.kernel_holds_completions()
            && self.quiet_until.is_some_and(|t| self.clock.now() < t)
    }

    /// How long a caller that runs [`turn`](Self::turn)s itself may wait
    /// for [`wait_fds`](Self::wait_fds) before the next turn: until the
    /// core's next timer (`Duration::MAX` if none); `None` if a turn must
    /// come now (completions wait in the ring or the kernel, or sends wait
    /// for room in the submission queue).
    pub(crate) fn idle_wait(&mut self) -> Option<Duration> {
        if self.backlog
            || self.ring.queued()
            || self.ring.completions_ready()
            || self.ring.kernel_holds_completions()
        {
            return None;
        }
        let now = self.clock.now();
        let wait = fault::timer_wait(&mut self.ep, self.faults.as_deref(), now, Duration::MAX);
        (!wait.is_zero()).then_some(wait)
    }

    /// What a caller waiting between [`turn`](Self::turn)s waits on: the
    /// ring, readable when it holds completions.
    pub(crate) fn wait_fds(&self) -> Vec<RawFd> {
        vec![self.ring.fd()]
    }

    /// Before a turn sleeps ([`DriverConfig::busy_poll`]): watches the
    /// completion queue and the kernel's "task work pending" flag (both in
    /// memory shared with the kernel: no system call) for up to the
    /// busy-poll time, at most `wait`. If something came, runs a turn for
    /// it and returns true: the caller's turn is then over, without a sleep.
    ///
    /// A thread asleep in the kernel must be woken by whoever sends to it,
    /// and on a virtual machine that wake (an inter-processor interrupt)
    /// costs the sender more than its whole send: with the peer polling,
    /// the sender only sets the flag (`docs/BENCHMARKS.md`, session 14).
    fn busy_poll(&mut self, wait: Duration) -> Result<bool, DriverError> {
        let spin = self.busy_poll.min(wait);
        if spin.is_zero() {
            return Ok(false);
        }
        // What the turn queued (answers, re-armed receives) goes out first;
        // with nothing queued, no system call.
        if self.ring.queued() {
            self.ring.submit(0)?;
            self.stats.submits += 1;
        }
        let until = std::time::Instant::now() + spin;
        'spin: loop {
            for _ in 0..64 {
                if self.ring.completions_ready() {
                    break 'spin;
                }
                if self.ring.kernel_holds_completions() {
                    // An enter runs the task work, which posts the
                    // completions, and flushes any that overflowed.
                    self.ring.submit(0)?;
                    self.stats.submits += 1;
                    break 'spin;
                }
                std::hint::spin_loop();
            }
            if std::time::Instant::now() >= until {
                return Ok(false);
            }
        }
        self.stats.busy_polls += 1;
        if self.work()? && self.ring.queued() {
            self.ring.submit(0)?;
            self.stats.submits += 1;
        }
        Ok(true)
    }

    /// Reaps completions, runs due timers, queues transmits and keeps the
    /// receive armed. Returns whether anything happened.
    fn work(&mut self) -> Result<bool, DriverError> {
        // One clock reading serves the turn: the sends it queues leave
        // together at its submission anyway.
        let now = self.clock.now();
        self.wall = None;
        self.recv_starved = false;
        self.backlog = false;
        let unpolled = self.ep.unpolled();
        let mut progress = self.reap(now);
        if let Some(f) = &mut self.faults {
            progress |= f.release(now, &mut self.ep);
        }
        // Timers run after what already arrived: an ACK that is here must
        // not lose the race against a retransmission timeout.
        let next = self.ep.poll_timeout();
        if next.is_some_and(|t| t <= now) {
            self.drain_before_late_timers(now)?;
            // What the timers did (events, failed requests) is the caller's
            // to see before this turn may sleep.
            self.ep.handle_timeout(now);
            progress = true;
        }
        progress |= self.flush(now)?;
        // Completions or events the turn made (a request that failed
        // locally when its turn to be sent came sends nothing) are the
        // caller's to see before this turn may sleep.
        progress |= self.ep.unpolled() != unpolled;
        // A turn that did nothing left the core as it found it: its next
        // timer stands.
        self.quiet_until = (!progress && self.faults.is_none())
            .then(|| next.unwrap_or(Instant::from_nanos(u64::MAX)));
        self.arm_receives()?;
        self.arm_wake()?;
        Ok(progress)
    }

    /// Before timers that are late run: if the thread was held up (a timer
    /// overdue by [`LATE_TIMER`]: the host stalled it, or a turn ran long)
    /// and the receive ran out of buffers, what waits in the socket came
    /// during the hold-up and must be read first, or a retransmission
    /// timeout fires for packets whose ACKs are here, unread, and paths
    /// that delivered look dead. Reads at most [`DRAIN_ROUNDS`] more rounds
    /// of buffers.
    fn drain_before_late_timers(&mut self, now: Instant) -> Result<(), DriverError> {
        let late = self
            .ep
            .poll_timeout()
            .is_some_and(|t| now.saturating_since(t) >= LATE_TIMER);
        let mut rounds = 0;
        while late && self.recv_starved && rounds < DRAIN_ROUNDS {
            self.recv_starved = false;
            self.arm_receives()?;
            self.ring.submit(0)?;
            self.stats.submits += 1;
            self.reap(now);
            rounds += 1;
            self.stats.late_drains += 1;
        }
        Ok(())
    }

    /// Keeps a multishot receive armed on every plane's socket (one that
    /// ended, for lack of buffers or otherwise, is queued again).
    ///
    /// The sockets share the provided buffers ([`UringConfig::recv_buffers`]),
    /// and the kernel serves the receives in the order they were submitted:
    /// the first takes every buffer while its socket has a backlog, and the
    /// next ends at once for want of one (ENOBUFS). Armed in the same order
    /// every turn, a plane behind a busy one was read only when the busy
    /// one ran dry: on loopback with 16 paths over two planes, the second
    /// plane's datagrams waited 10-30 ms in their socket, long after their
    /// copies had gone again on the first. So the first socket armed turns
    /// round, turn by turn.
    ///
    /// [`UringConfig::recv_buffers`]: crate::UringConfig::recv_buffers
    fn arm_receives(&mut self) -> Result<(), DriverError> {
        let n = self.recv.len();
        let first = self.recv_first % n.max(1);
        self.recv_first = first + 1;
        for i in 0..n {
            let k = (first + i) % n;
            let r = &self.recv[k];
            match self.ring.arm_recv(k, r.as_raw_fd())? {
                sys::Arm::Queued => self.stats.recv_arms += 1,
                sys::Arm::Armed => {}
                // The next turn arms it (datagrams wait in the socket).
                sys::Arm::Full => self.backlog = true,
            }
        }
        Ok(())
    }

    /// Makes sure a timer fires no later than `deadline`. False if the
    /// submission queue had no room for it (`sys::Ring::push`): then no
    /// timer bounds a wait, and the turn must not wait.
    fn set_timer(&mut self, deadline: Instant) -> Result<bool, DriverError> {
        if let Some((gen, at)) = self.timer {
            if at <= deadline {
                return Ok(true);
            }
            if !self.ring.remove_timer(gen)? {
                return Ok(false);
            }
            // Being removed: no wait counts on it any more.
            self.timer = None;
        }
        if !self
            .ring
            .arm_timer(self.clock.until(deadline), self.timer_gen + 1)?
        {
            return Ok(false);
        }
        self.timer_gen += 1;
        self.timer = Some((self.timer_gen, deadline));
        Ok(true)
    }

    /// Handles every completion ready. Returns whether any datagram or send
    /// completion (a freed slot) came.
    fn reap(&mut self, now: Instant) -> bool {
        let cqes = self.ring.reap();
        let mut progress = false;
        for c in &cqes {
            let tag = c.user_data() & TAG_MASK;
            let low = c.user_data() & !TAG_MASK;
            match tag {
                TAG_RECV => progress |= self.on_recv(now, sys::recv_socket(c.user_data()), c),
                TAG_SEND => {
                    self.on_send(low as usize, c);
                    progress = true;
                }
                TAG_TIMER => {
                    if self.timer.is_some_and(|(g, _)| g == low) {
                        self.timer = None;
                    }
                }
                TAG_WAKE => {
                    if let Some(w) = &self.wake {
                        w.drain();
                    }
                    // Whoever woke us has work for the caller (a command
                    // queued): the turn must return to it, not sleep with
                    // the wake consumed.
                    progress = true;
                    if !cqueue::more(c.flags()) && self.wake_armed.is_some_and(|(g, _)| g == low) {
                        self.wake_armed = None;
                    }
                }
                TAG_CTRL => {}
                _ => tracing::debug!(user_data = c.user_data(), "stray completion"),
            }
        }
        self.ring.restore(cqes);
        self.ring.publish();
        progress
    }

    /// One completion of the multishot receive: a buffer with one datagram
    /// or a GRO batch of them.
    fn on_recv(&mut self, now: Instant, plane: usize, c: &cqueue::Entry) -> bool {
        let r = c.result();
        if r < 0 {
            // ENOBUFS: every buffer was in use; the receive ended and is
            // re-armed once they are back (more waits in the socket).
            // ECANCELED: its thread exited.
            self.recv_starved |= r == -libc::ENOBUFS;
            if r != -libc::ENOBUFS && r != -libc::ECANCELED {
                tracing::debug!(error = %std::io::Error::from_raw_os_error(-r), "receive failed");
            }
            return false;
        }
        let Some((bid, data, hdr)) = self.ring.recv_buf(c) else {
            self.stats.recv_dropped += 1;
            return false;
        };
        let mut got = false;
        match RecvMsgOut::parse(data, hdr) {
            Ok(out) if !out.is_payload_truncated() && !out.is_name_data_truncated() => {
                match cmsg::parse_sockaddr(out.name_data()) {
                    Some(from) => {
                        let meta = cmsg::parse_control(out.control_data());
                        let arrived = self.clock.arrived(now, &mut self.wall, meta.stamp);
                        self.stats.stamped += u64::from(meta.stamp.is_some());
                        let p = out.payload_data();
                        if meta.stride.is_some_and(|s| p.len() > s) {
                            self.stats.gro_batches += 1;
                        }
                        for dg in crate::sockets::datagrams(p, meta.stride) {
                            self.stats.datagrams_received += 1;
                            if let Some(n) = self.stats.received_per_plane.get_mut(plane) {
                                *n += 1;
                            }
                            fault::deliver(
                                &mut self.faults,
                                now,
                                arrived,
                                from,
                                meta.ecn,
                                dg,
                                &mut self.ep,
                                &mut self.stats,
                            );
                            got = true;
                        }
                    }
                    None => self.stats.recv_dropped += 1,
                }
            }
            _ => self.stats.recv_dropped += 1,
        }
        self.ring.recycle(bid);
        got
    }

    /// One completion of a send slot (its result or a zero-copy notification).
    fn on_send(&mut self, i: usize, c: &cqueue::Entry) {
        let m = self.meta.get(i).copied().unwrap_or_default();
        match self.ring.send_done(i, c) {
            Some(SendCqe::Result(r)) if r >= 0 => {
                self.stats.datagrams_sent += m.datagrams;
                if m.gso {
                    self.stats.gso_sends += 1;
                }
                if m.zc {
                    self.stats.zero_copy_sends += 1;
                }
                if m.gathered {
                    self.stats.gathered_sends += 1;
                }
            }
            Some(SendCqe::Result(r)) => {
                // A lost datagram: the protocol recovers it like any loss.
                self.stats.send_errors += 1;
                let err = -r;
                // EMSGSIZE: a gathered zero-copy batch with more fragments
                // than this kernel takes.
                let refused = matches!(
                    err,
                    libc::EINVAL | libc::EIO | libc::EOPNOTSUPP | libc::EMSGSIZE
                );
                if m.zc && refused && self.zc {
                    self.zc = false;
                    tracing::warn!(error = %std::io::Error::from_raw_os_error(err), "zero-copy send refused: sending with copies from now on");
                } else if m.gso && !m.zc && matches!(err, libc::EINVAL | libc::EIO) && self.gso {
                    self.gso = false;
                    tracing::warn!(error = %std::io::Error::from_raw_os_error(err), "GSO send refused: sending segments one by one from now on");
                } else {
                    tracing::debug!(error = %std::io::Error::from_raw_os_error(err), "send failed");
                }
            }
            Some(SendCqe::Notif { copied: true }) => {
                self.stats.zero_copy_copied += 1;
                self.zc_copied_run += 1;
                if self.zc && self.zc_copied_run >= ZC_COPIED_LIMIT {
                    // Pinning pages only to have them copied costs more
                    // than copying once (loopback, veth, a NIC without
                    // scatter-gather): plain sends from now on.
                    self.zc = false;
                    tracing::info!(
                        copied = self.zc_copied_run,
                        "zero-copy sends turned off: the kernel copied every one of them (loopback, veth or a device without zero-copy support)"
                    );
                }
            }
            Some(SendCqe::Notif { copied: false }) => self.zc_copied_run = 0,
            None => {}
        }
        if i < self.ring.slots() && self.ring.slot_mut(i).is_free() {
            self.release(i);
            if !self.free.contains(&i) {
                self.free.push(i);
            }
        }
    }

    /// Gives the regions slot `i` sent from back to the core (the kernel
    /// is done with the slot).
    fn release(&mut self, i: usize) {
        if let Some(p) = self.pinned.get_mut(i) {
            if !p.is_empty() {
                self.ep.release_pins(p);
            }
        }
    }

    /// Queues a send for every transmit the core has, while send slots are
    /// free, the turn's budget of bytes lasts and the submission queue
    /// takes them. Returns whether any was queued.
    fn flush(&mut self, now: Instant) -> Result<bool, DriverError> {
        // Sends an earlier turn found no room for go first, in order. While
        // one still waits the core keeps its transmits: they would only
        // wait behind it, each holding a slot.
        if !self.ring.send_deferred()? {
            self.backlog = true;
            return Ok(false);
        }
        let mut any = false;
        let mut budget = self.turn_send_bytes;
        while let Some(&i) = self.free.last() {
            if any && budget == 0 {
                break;
            }
            let Some((buf, _)) = self.ring.slot_mut(i).parts_mut() else {
                self.free.pop();
                continue;
            };
            // GSO refused at run time splits batches into one send per
            // segment, from a contiguous buffer: no gathering then.
            let gather = self.gathering && (self.gso || self.segments == 1);
            let t = if gather {
                self.ep.poll_transmit_gather(now, buf, &mut self.gather)
            } else {
                self.ep.poll_transmit(now, buf)
            };
            let Some(t) = t else {
                break;
            };
            self.free.pop();
            any = true;
            // `size` counts the payloads left in their regions too.
            budget = budget.saturating_sub(t.size);
            // The pins are the slot's from here on, whatever happens next.
            self.gather.take_pins(&mut self.pinned[i]);
            let queued = if gather && self.gather.has_regions() {
                self.queue_gathered(i, &t)
            } else {
                self.queue(i, &t)
            };
            if let Err(e) = queued {
                if self.ring.slot_mut(i).is_free() {
                    self.release(i);
                    self.free.push(i);
                }
                self.stats.send_errors += 1;
                tracing::debug!(error = %e, dst = %t.dst, "send not queued");
            }
            if self.ring.has_deferred() {
                // The submission queue is full and the kernel takes nothing
                // for now: the send waits in the ring for the next turn.
                self.backlog = true;
                break;
            }
        }
        Ok(any)
    }

    /// The socket a transmit goes out on.
    fn send_fd(&self, t: &Transmit) -> RawFd {
        match self.sockets.send_index(t.src_ip, t.src_port) {
            Some(s) => self.send[s].as_raw_fd(),
            None => self.recv[self.sockets.recv_index(t.src_ip)].as_raw_fd(),
        }
    }

    /// Queues slot `i` for the gathered transmit `t`: the headers in the
    /// slot, the payloads in their regions, one `iovec` each.
    fn queue_gathered(&mut self, i: usize, t: &Transmit) -> std::io::Result<()> {
        let fd = self.send_fd(t);
        let (seg, datagrams) = segments(t);
        // On the stack (a full batch of 4 KiB segments has 30 pieces); more
        // spill to the heap.
        let mut pieces: smallvec::SmallVec<[sys::Piece; GATHER_PIECES]> = smallvec::SmallVec::new();
        for c in self.gather.chunks() {
            pieces.push(match c {
                Chunk::Buf(r) => sys::Piece::Buf(r.clone()),
                Chunk::Region { lkey, range } => {
                    // Only the payload's bytes: the application may use
                    // others of the region meanwhile.
                    let b = self
                        .ep
                        .mr_range(*lkey, range.clone())
                        .ok_or_else(|| std::io::Error::other("gathered region vanished"))?;
                    sys::Piece::Extern(b.as_ptr(), b.len())
                }
            });
        }
        let v6 = self.v6;
        let slot = self.ring.slot_mut(i);
        let (buf, ctrl) = slot.parts_mut().expect("free slot");
        let base = buf.as_ptr().addr();
        let seg16 = seg.and_then(|s| u16::try_from(s).ok());
        let clen = cmsg::encode_send(&mut ctrl.0, v6, t.ecn, seg16);
        // SAFETY: every `Extern` piece is a payload range of a region of
        // `self.ep` that the core pinned for this transmit: it refuses to
        // deregister the region while the pin (held in `self.pinned[i]`, not
        // forgeable, released only by this endpoint) exists, and a pinned
        // region's memory is leaked, never freed, if the endpoint is dropped
        // or replaced. The pin is released only once the slot's last
        // completion has come (`on_send`), its send was never queued, or
        // `Drop` has drained the ring. A region's memory never moves or
        // shrinks while registered (`RegionBuf`: owned memory is boxed, raw
        // memory is the application's promise). The application may still write the
        // bytes through the endpoint meanwhile (RDMA semantics: the
        // request's buffer is not to be touched until it completes); the
        // kernel only reads them.
        if !unsafe { slot.set_gather(t.dst, &pieces, clen) } {
            return Err(std::io::Error::other(
                "gathered transmit does not fit the slot",
            ));
        }
        // Zero copy makes every page a piece touches a fragment of one
        // socket buffer, and the kernel refuses more than `MAX_SKB_FRAGS`
        // of them (EMSGSIZE): a larger gathered send goes with one copy,
        // by the kernel.
        let zc =
            self.zc && t.size >= self.zc_threshold && page_spans(&pieces, base) <= ZC_MAX_FRAGS;
        self.meta[i] = SlotMeta {
            datagrams: datagrams as u64,
            zc,
            gso: seg.is_some(),
            gathered: true,
        };
        self.ring.send(i, 1, fd, zc)
    }

    /// Queues slot `i`, filled with `t`.
    fn queue(&mut self, i: usize, t: &Transmit) -> std::io::Result<()> {
        let fd = self.send_fd(t);
        let (seg, datagrams) = segments(t);
        let v6 = self.v6;
        let slot = self.ring.slot_mut(i);
        match seg {
            Some(s) if !self.gso => {
                // GSO was refused at run time: one send per segment.
                let (_, ctrl) = slot.parts_mut().expect("free slot");
                let clen = cmsg::encode_send(&mut ctrl.0, v6, t.ecn, None);
                for k in 0..datagrams {
                    slot.set_msg(k, t.dst, k * s..((k + 1) * s).min(t.size), clen);
                }
                self.meta[i] = SlotMeta {
                    datagrams: 1,
                    zc: false,
                    gso: false,
                    gathered: false,
                };
                self.ring.send(i, datagrams, fd, false)
            }
            _ => {
                let (_, ctrl) = slot.parts_mut().expect("free slot");
                let seg16 = seg.and_then(|s| u16::try_from(s).ok());
                let clen = cmsg::encode_send(&mut ctrl.0, v6, t.ecn, seg16);
                slot.set_msg(0, t.dst, 0..t.size, clen);
                let zc = self.zc && t.size >= self.zc_threshold;
                self.meta[i] = SlotMeta {
                    datagrams: datagrams as u64,
                    zc,
                    gso: seg.is_some(),
                    gathered: false,
                };
                self.ring.send(i, 1, fd, zc)
            }
        }
    }
}

impl Drop for UringDriver {
    /// Waits until the kernel is done with every send, then gives the
    /// regions their sends read back to the core. If the kernel does not
    /// answer in time the pins stay, and the endpoint leaks those regions'
    /// memory when it drops instead of freeing it under the kernel.
    fn drop(&mut self) {
        if self.ring.drain() {
            for i in 0..self.pinned.len() {
                self.release(i);
            }
        }
    }
}

impl IoDriver for UringDriver {
    fn bind(cfg: DriverConfig) -> Result<Self, DriverError> {
        UringDriver::bind(cfg)
    }
    fn backend(&self) -> Backend {
        Backend::Uring
    }
    fn endpoint(&mut self) -> &mut Endpoint {
        &mut self.ep
    }
    fn now(&self) -> Instant {
        self.clock.now()
    }
    fn local_addr(&self) -> SocketAddr {
        self.local
    }
    fn poll(&mut self, max_wait: Duration) -> Result<(), DriverError> {
        UringDriver::poll(self, max_wait)
    }
    fn stats(&self) -> DriverStats {
        self.stats
    }
    fn set_faults(&mut self, faults: FaultConfig) {
        UringDriver::set_faults(self, faults)
    }
    fn waker(&mut self) -> Result<Waker, DriverError> {
        UringDriver::waker(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use metaroce_proto::verbs::*;
    use metaroce_proto::EndpointConfig;

    /// `quiet` says a turn would find nothing only while that is so: after
    /// an idle turn, until a datagram arrives (its completion is in the ring
    /// or held by the kernel) or the core's next timer is due; and never
    /// before a turn has run.
    #[test]
    fn quiet_only_while_a_turn_would_do_nothing() {
        if let Err(why) = uring_probe() {
            println!("skipped: io_uring unavailable: {why}");
            return;
        }
        let limit = Duration::from_secs(10);
        let cfg = DriverConfig::new("127.0.0.1:0".parse().unwrap());
        let mut a = UringDriver::bind(cfg.clone()).unwrap();
        let mut b = UringDriver::bind(cfg).unwrap();
        assert!(!a.quiet(), "quiet before any turn");
        let (ca, cb) = crate::connect_pair(&mut a, &mut b, limit).unwrap();
        // Idle turns until one does nothing (the handshake's leftovers).
        let settle = |d: &mut UringDriver| {
            let t0 = std::time::Instant::now();
            while d.turn().unwrap() {
                assert!(t0.elapsed() < limit, "turns never settle");
            }
        };
        settle(&mut a);
        settle(&mut b);
        assert!(b.quiet(), "an idle turn left the driver not quiet");
        // A datagram for b: a SEND from a to a posted receive.
        let (pda, pdb) = (a.endpoint().alloc_pd(), b.endpoint().alloc_pd());
        let (cqa, cqb) = (a.endpoint().create_cq(16), b.endpoint().create_cq(16));
        let qa = a.endpoint().create_qp(QpInit::new(pda, cqa, cqa)).unwrap();
        let qb = b.endpoint().create_qp(QpInit::new(pdb, cqb, cqb)).unwrap();
        a.endpoint().connect_qp(qa, ca, qb).unwrap();
        b.endpoint().connect_qp(qb, cb, qa).unwrap();
        b.endpoint()
            .post_recv(qb, RecvWr::new(1, SgList::default()))
            .unwrap();
        settle(&mut b);
        assert!(b.quiet());
        let now = a.now();
        a.endpoint()
            .post_send(now, qa, SendWr::new(2, SendOp::Send, SgList::default()))
            .unwrap();
        a.turn().unwrap();
        let t0 = std::time::Instant::now();
        while b.quiet() {
            assert!(t0.elapsed() < limit, "a datagram came and b stays quiet");
        }
        // A turn takes it; the receive completes.
        let mut wc = Vec::new();
        while wc.is_empty() {
            assert!(t0.elapsed() < limit, "the SEND never arrived");
            b.turn().unwrap();
            b.endpoint().poll_cq(cqb, 16, &mut wc).unwrap();
        }
        // b answered with its acknowledgement at once; a takes it.
        let mut sent = Vec::new();
        while sent.is_empty() {
            assert!(t0.elapsed() < limit, "the SEND was never acknowledged");
            b.turn().unwrap();
            a.turn().unwrap();
            a.endpoint().poll_cq(cqa, 16, &mut sent).unwrap();
        }
        assert_eq!(sent[0].status, WcStatus::Success);
        // A timer: a SEND that b does not take (b runs no turn) leaves a
        // with a retransmission timeout. a is quiet until it is due, and
        // not after.
        let now = a.now();
        a.endpoint()
            .post_send(now, qa, SendWr::new(3, SendOp::Send, SgList::default()))
            .unwrap();
        settle(&mut a);
        let due = a
            .endpoint()
            .poll_timeout()
            .expect("a timer for the unacknowledged SEND");
        assert!(
            a.quiet(),
            "an idle turn with a timer ahead left a not quiet"
        );
        while a.now() < due {
            assert!(a.quiet() || a.now() >= due, "not quiet before the timer");
        }
        assert!(!a.quiet(), "quiet past the core's next timer");
    }

    /// A burst of sends larger than the submission queue (eight entries,
    /// the fewest the driver sets up; one datagram a send), in turns where
    /// the kernel takes nothing from the queue (as one that answers EBUSY
    /// or EAGAIN does): what does not fit waits for a later turn, no turn
    /// fails, and once the kernel takes submissions again every datagram
    /// arrives, each sent once (no loss, so no retransmission).
    #[test]
    fn a_full_submission_queue_defers_sends_instead_of_failing() {
        if let Err(why) = uring_probe() {
            println!("skipped: io_uring unavailable: {why}");
            return;
        }
        let limit = Duration::from_secs(10);
        let mut cfg = DriverConfig::new("127.0.0.1:0".parse().unwrap());
        cfg.endpoint = EndpointConfig {
            // Nothing is retransmitted while the sends wait: a datagram
            // sent twice is one that was lost.
            initial_rto: limit,
            min_rto: limit,
            max_rto: limit,
            ..EndpointConfig::default()
        };
        cfg.max_gso_segments = 1;
        cfg.turn_send_bytes = usize::MAX;
        cfg.uring.entries = 8;
        cfg.uring.send_slots = 64;
        let mut a = UringDriver::bind(cfg.clone()).unwrap();
        let mut b = UringDriver::bind(cfg).unwrap();
        let (ca, cb) = crate::connect_pair(&mut a, &mut b, limit).unwrap();
        let (pda, pdb) = (a.endpoint().alloc_pd(), b.endpoint().alloc_pd());
        let (cqa, cqb) = (a.endpoint().create_cq(16), b.endpoint().create_cq(16));
        let qa = a.endpoint().create_qp(QpInit::new(pda, cqa, cqa)).unwrap();
        let qb = b.endpoint().create_qp(QpInit::new(pdb, cqb, cqb)).unwrap();
        a.endpoint().connect_qp(qa, ca, qb).unwrap();
        b.endpoint().connect_qp(qb, cb, qa).unwrap();
        const LEN: usize = 128 << 10;
        let data: Vec<u8> = (0..LEN).map(|i| (i ^ (i >> 8)) as u8).collect();
        let src = a
            .endpoint()
            .reg_mr(pda, data.clone().into_boxed_slice(), 0, AccessFlags::NONE)
            .unwrap();
        let dst = b
            .endpoint()
            .reg_mr(
                pdb,
                vec![0u8; LEN].into_boxed_slice(),
                0x10_0000,
                AccessFlags::REMOTE_WRITE,
            )
            .unwrap();
        let now = a.now();
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
        a.endpoint().post_send(now, qa, wr).unwrap();

        a.ring.refuse_submissions(true);
        for turn in 0..4 {
            // Turns that may wait: one with nothing to do arms a timer.
            a.poll(Duration::from_millis(1))
                .unwrap_or_else(|e| panic!("turn {turn} with a full submission queue: {e}"));
        }
        let burst = a.endpoint().connection_stats(ca).unwrap().data_packets_sent;
        assert!(
            burst > 8,
            "{burst} datagrams fit the submission queue: the test shows nothing"
        );
        a.ring.refuse_submissions(false);

        let t0 = std::time::Instant::now();
        let mut wc = Vec::new();
        while wc.is_empty() {
            assert!(t0.elapsed() < limit, "the WRITE did not complete");
            a.poll(Duration::ZERO).unwrap();
            b.poll(Duration::ZERO).unwrap();
            a.endpoint().poll_cq(cqa, 16, &mut wc).unwrap();
        }
        assert_eq!(wc[0].status, WcStatus::Success, "{wc:?}");
        assert!(
            b.endpoint().mr(dst.lkey).unwrap() == &data[..],
            "WRITE data differs"
        );
        let (sa, sb) = (a.stats(), b.stats());
        assert_eq!(sa.send_errors, 0, "sends were dropped: a {sa:?}");
        let (conn_a, conn_b) = (
            a.endpoint().connection_stats(ca).unwrap(),
            b.endpoint().connection_stats(cb).unwrap(),
        );
        assert_eq!(
            conn_a.retransmits, 0,
            "datagrams were lost: {conn_a:?}\na {sa:?}\nb {sb:?}"
        );
        assert_eq!(
            conn_b.data_packets_received, conn_a.data_packets_sent,
            "a {sa:?}\nb {sb:?}"
        );
    }
}
