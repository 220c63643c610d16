//! The endpoint thread behind a [`Device`](super::Device): it owns the
//! driver (and so the endpoint and every registered buffer), takes commands
//! from a queue in batches, and hands completions and events back through
//! one-shot channels and completion-queue sinks.

use super::{ApiError, CqSink, Incoming};
use crate::waker::WakeReceiver;
use crate::{Driver, DriverConfig, DriverError, Metrics, Waker};
use metaroce_proto::verbs::*;
use metaroce_proto::{
    ConnectionError, ConnectionState, ConnectionStats, Endpoint, EndpointStats, Event,
};
use rustc_hash::FxHashMap;
use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, TryRecvError};
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::sync::Notify as TaskNotify;
use tokio::sync::{mpsc as tmpsc, oneshot};

/// A reply channel.
pub(super) type Reply<T> = oneshot::Sender<Result<T, ApiError>>;

/// Where a posted request's completion goes.
pub(super) enum Notify {
    /// To the caller awaiting this one request.
    Once(oneshot::Sender<Result<WorkCompletion, ApiError>>),
    /// To the completion queue, for `poll`/`next`; the sender hears
    /// whether the post was accepted.
    Cq(Reply<()>),
}

/// Where a completion goes once the post was accepted.
enum Waiter {
    Once(oneshot::Sender<Result<WorkCompletion, ApiError>>),
    Cq,
}

impl Notify {
    /// The post was accepted: acknowledges it, and says where the completion goes.
    fn accepted(self) -> Waiter {
        match self {
            Notify::Once(tx) => Waiter::Once(tx),
            Notify::Cq(ack) => {
                let _ = ack.send(Ok(()));
                Waiter::Cq
            }
        }
    }
}

/// What the API asks the endpoint thread to do.
pub(super) enum Command {
    AllocPd(Reply<PdHandle>),
    DeallocPd(PdHandle),
    RegMr {
        pd: PdHandle,
        buf: RegionBuf,
        addr: u64,
        access: AccessFlags,
        reply: Reply<MrInfo>,
    },
    DeregMr(u32, Reply<RegionBuf>),
    LendMr(u32, Reply<RegionBuf>),
    ReturnMr(u32, RegionBuf),
    DropMr(u32),
    ReadMr {
        lkey: u32,
        offset: u64,
        len: usize,
        reply: Reply<Vec<u8>>,
    },
    WriteMr {
        lkey: u32,
        offset: u64,
        data: Vec<u8>,
        reply: Reply<()>,
    },
    CreateCq(usize, Arc<CqSink>, Reply<CqHandle>),
    CreateQp(QpInit, Reply<Qpn>),
    ConnectQp {
        qpn: Qpn,
        conn: ConnectionHandle,
        remote: Qpn,
        attrs: RcAttrs,
        reply: Reply<()>,
    },
    QpState(Qpn, Reply<Option<QpState>>),
    DestroyQp(Qpn),
    /// The queue's handle was dropped.
    DestroyCq(CqHandle),
    PostSend(Qpn, SendWr, Notify),
    /// Send requests posted in order, to the send CQ; the reply says how
    /// far it got.
    PostSendBatch(Qpn, Vec<SendWr>, Reply<()>),
    PostRecv(Qpn, RecvWr, Notify),
    /// Receives posted in order, to the receive CQ; the reply says how
    /// far it got.
    PostRecvBatch(Qpn, Vec<RecvWr>, Reply<()>),
    Connect(SocketAddr, Reply<ConnectionHandle>),
    Close(ConnectionHandle, Reply<()>),
    ConnState(ConnectionHandle, Reply<Option<ConnectionState>>),
    ConnStats(ConnectionHandle, Reply<Option<ConnectionStats>>),
    Stats(Reply<EndpointStats>),
    /// Brings the metrics up to date, then says so.
    RefreshMetrics(mpsc::SyncSender<()>),
}

/// A posted request waiting for its completion.
struct Pending {
    user_wr_id: u64,
    waiter: Waiter,
}

/// The endpoint thread's state.
pub(super) struct Worker {
    drv: Driver,
    rx: mpsc::Receiver<Command>,
    incoming: tmpsc::UnboundedSender<Incoming>,
    metrics: Option<Metrics>,
    /// Completion-queue sinks, by core CQ.
    cqs: FxHashMap<CqHandle, Arc<CqSink>>,
    /// Requests in flight, by the internal wr_id given to the core.
    /// (Keys the device makes, never the network's: a fast hash.)
    pending: FxHashMap<u64, Pending>,
    next_wr: u64,
    /// Unsignaled sends posted to a completion queue, by QP, oldest first
    /// (internal wr_ids): done, with no completion of their own, when a
    /// later send of their QP completes (RC completes in order).
    unsignaled: FxHashMap<Qpn, VecDeque<u64>>,
    /// Connects waiting for the handshake.
    connecting: HashMap<ConnectionHandle, Reply<ConnectionHandle>>,
    /// Regions and PDs whose handles were dropped while still in use.
    zombies_mr: Vec<u32>,
    zombies_pd: Vec<PdHandle>,
    /// Completion queues whose handles were dropped while a QP used them.
    zombies_cq: Vec<CqHandle>,
    /// Deregistrations waiting for the driver's last send from the region
    /// (a gathered payload still with the kernel, microseconds at most).
    deregs: Vec<(u32, Reply<RegionBuf>)>,
    /// Lends waiting for the same.
    lends: Vec<(u32, Reply<RegionBuf>)>,
    scratch: Vec<WorkCompletion>,
    /// Completions on their way to a CQ sink (reused: no allocation per batch).
    to_sink: Vec<WorkCompletion>,
    /// When the metrics were last brought up to date.
    last_metrics: std::time::Instant,
    /// A command ran outside a turn ([`Polled::run`]) since the last one:
    /// the next turn drives the driver even if it looks quiet.
    ran: bool,
}

/// What the endpoint thread tells `open` once it is up.
pub(super) struct Started {
    pub local: SocketAddr,
    pub backend: crate::Backend,
    pub waker: Waker,
}

/// Binds the driver on this thread and runs until every handle is gone.
pub(super) fn run(
    cfg: DriverConfig,
    metrics: Option<Metrics>,
    rx: mpsc::Receiver<Command>,
    incoming: tmpsc::UnboundedSender<Incoming>,
    started: oneshot::Sender<Result<Started, DriverError>>,
) {
    let mut drv = match Driver::bind(cfg) {
        Ok(d) => d,
        Err(e) => {
            let _ = started.send(Err(e));
            return;
        }
    };
    let waker = match drv.waker() {
        Ok(w) => w,
        Err(e) => {
            let _ = started.send(Err(e));
            return;
        }
    };
    let info = Started {
        local: drv.local_addr(),
        backend: drv.backend(),
        waker,
    };
    if started.send(Ok(info)).is_err() {
        return;
    }
    let mut w = Worker::new(drv, metrics, rx, incoming);
    if let Err(e) = w.run() {
        tracing::error!(error = %e, "metaroce endpoint thread stopped on a driver error");
    }
}

/// Binds the driver on the calling thread and runs the endpoint as a task
/// of the current tokio runtime (see [`Device::open_on_runtime`]): its
/// turns never block, and between them the task waits for the driver's
/// descriptors, a command (a [`tokio::sync::Notify`]) or the core's next timer (a
/// `timerfd`: tokio's own timers count in milliseconds, the core's in
/// microseconds).
///
/// [`Device::open_on_runtime`]: super::Device::open_on_runtime
pub(super) fn start_on_runtime(
    cfg: DriverConfig,
    metrics: Option<Metrics>,
    rx: mpsc::Receiver<Command>,
    incoming: tmpsc::UnboundedSender<Incoming>,
    notify: Arc<TaskNotify>,
) -> Result<(SocketAddr, crate::Backend), ApiError> {
    let drv = Driver::bind(cfg)?;
    let (local, backend) = (drv.local_addr(), drv.backend());
    let mut waits = Vec::new();
    // A runtime without I/O enabled panics on registration: that is
    // `NoRuntime` to the caller.
    for fd in drv.wait_fds() {
        // SAFETY: the descriptor is the driver's (its ring or a receive
        // socket), open for the driver's life; `run_task` drops these
        // watches before the driver.
        let a = std::panic::catch_unwind(|| unsafe {
            AsyncFd::register_with_interest(RawFdRef(fd), Interest::READABLE)
        })
        .map_err(|_| ApiError::NoRuntime)?;
        waits.push(a.map_err(|e| DriverError::Io(e.into_parts().1))?);
    }
    let timer = TimerFd::new().map_err(DriverError::Io)?;
    let w = Worker::new(drv, metrics, rx, incoming);
    tokio::spawn(run_task(w, waits, timer, notify));
    Ok((local, backend))
}

/// How long a caller of [`Device::progress`](super::Device::progress) is
/// taken to go on calling it: while calls come at least this often, the
/// endpoint thread of a polled device leaves the driver to the callers.
pub(super) const PROGRESS_LEASE: Duration = Duration::from_millis(1);

/// Turns the endpoint thread of a polled device takes in a row before it
/// lets a caller in.
const THREAD_BURST: usize = 64;

/// A polled device's endpoint (see
/// [`Device::open_polled`](super::Device::open_polled)): the worker behind
/// a lock that the application's threads take for a turn when they call
/// `progress` and the lock is free, and that the endpoint thread takes
/// while nobody calls.
pub(super) struct Polled {
    /// `None` once the endpoint stopped (every handle gone, or a driver
    /// error).
    worker: std::sync::Mutex<Option<Worker>>,
    /// A caller called `progress` since the endpoint thread last looked
    /// (no clock is read per call: the thread looks once a lease).
    touched: AtomicBool,
    /// The endpoint thread found callers driving when it last looked, and
    /// stays off the driver.
    callers_drive: AtomicBool,
    /// What the endpoint thread waits on beside the driver's descriptors.
    wake: WakeReceiver,
    waker: Waker,
}

impl Polled {
    /// One turn on the calling thread if no other thread is taking one;
    /// whether it did anything.
    pub(super) fn progress(&self) -> bool {
        if !self.touched.load(Ordering::Relaxed) {
            self.touched.store(true, Ordering::Release);
        }
        // The endpoint thread may be asleep until a far timer, blind to
        // the timers this caller's turns set: it must look again, and from
        // now on look once a lease (one wake a burst of calls).
        self.wake();
        let mut g = match self.worker.try_lock() {
            Ok(g) => g,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return false,
        };
        turn_or_stop(&mut g).unwrap_or(false)
    }

    /// Runs command `c` on the calling thread if no other thread is taking
    /// a turn: the commands queued before it first, so that it keeps its
    /// place, then what it made handed on. Gives `c` back when the
    /// endpoint is busy (or this thread is inside a turn already), to be
    /// queued for the next turn.
    pub(super) fn run(&self, c: Command) -> Option<Command> {
        let g = match self.worker.try_lock() {
            Ok(g) => g,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return Some(c),
        };
        if g.is_none() {
            return Some(c);
        }
        self.outside_turn(g, |w| w.command(c));
        None
    }

    /// Runs `f` on the worker on the calling thread, waiting while another
    /// thread takes a turn: the commands queued before it first, so that
    /// it keeps its place, then what it made handed on. `Closed` once the
    /// endpoint stopped.
    pub(super) fn with_worker<T>(
        &self,
        f: impl FnOnce(&mut Worker) -> Result<T, ApiError>,
    ) -> Result<T, ApiError> {
        let g = self.worker.lock().unwrap_or_else(|e| e.into_inner());
        self.outside_turn(g, f).ok_or(ApiError::Closed)?
    }

    /// `f` on the worker held by `g`, outside a turn: the commands queued
    /// before first, then what `f` made handed on, and the endpoint thread
    /// woken (`f` may have set a timer the sleeping thread must see).
    /// `None` once the endpoint stopped (`f` not called).
    fn outside_turn<T>(
        &self,
        mut g: std::sync::MutexGuard<'_, Option<Worker>>,
        f: impl FnOnce(&mut Worker) -> T,
    ) -> Option<T> {
        let w = g.as_mut()?;
        w.take_commands();
        let r = f(w);
        w.ran = true;
        w.events();
        w.completions();
        drop(g);
        self.wake();
        Some(r)
    }

    /// Wakes the endpoint thread for a new command, unless a caller drives
    /// (its next call takes the command).
    pub(super) fn wake(&self) {
        if !self.callers_drive.load(Ordering::Acquire) {
            self.waker.wake();
        }
    }

    /// Whether one of the core's timers is due and no turn has served it:
    /// a caller that called `progress` during the last lease has stopped
    /// since (or calls too rarely), and an acknowledgement or a
    /// retransmission it left owed must not wait another lease. Not
    /// waiting for the lock: a caller taking a turn serves it.
    fn timer_overdue(&self) -> bool {
        match self.worker.try_lock() {
            Ok(mut g) => g.as_mut().is_some_and(|w| {
                let now = w.drv.now();
                w.drv.endpoint().poll_timeout().is_some_and(|t| t <= now)
            }),
            Err(_) => false,
        }
    }

    /// Wakes the endpoint thread whoever drives (the last handle is gone).
    pub(super) fn wake_thread(&self) {
        self.waker.wake();
    }
}

/// One turn of a polled device's worker, whichever thread takes it:
/// whether it did anything, or `None` once the endpoint stopped (every
/// handle gone, or a driver error), when the worker is dropped.
fn turn_or_stop(slot: &mut Option<Worker>) -> Option<bool> {
    let w = slot.as_mut()?;
    match w.turn_once() {
        Ok(Some(p)) => Some(p),
        Ok(None) => {
            *slot = None;
            None
        }
        Err(e) => {
            tracing::error!(error = %e, "metaroce polled endpoint stopped on a driver error");
            *slot = None;
            None
        }
    }
}

/// Binds the driver on the calling thread and starts the thread that
/// drives a polled device's endpoint while no caller does.
pub(super) fn start_polled(
    cfg: DriverConfig,
    metrics: Option<Metrics>,
    rx: mpsc::Receiver<Command>,
    incoming: tmpsc::UnboundedSender<Incoming>,
) -> Result<(SocketAddr, crate::Backend, Arc<Polled>), ApiError> {
    let drv = Driver::bind(cfg)?;
    let (local, backend) = (drv.local_addr(), drv.backend());
    let mut fds = drv.wait_fds();
    let wake = WakeReceiver::new().map_err(DriverError::Io)?;
    fds.push(wake.fd());
    let waker = wake.waker();
    let polled = Arc::new(Polled {
        worker: std::sync::Mutex::new(Some(Worker::new(drv, metrics, rx, incoming))),
        touched: AtomicBool::new(false),
        callers_drive: AtomicBool::new(false),
        wake,
        waker,
    });
    let p = polled.clone();
    std::thread::Builder::new()
        .name("metaroce-endpoint".into())
        .spawn(move || run_polled(&p, &fds))
        .map_err(DriverError::Io)?;
    Ok((local, backend, polled))
}

/// The endpoint thread of a polled device: stays off while a caller
/// drives; else takes turns until one finds nothing to do, then waits for
/// a descriptor of the driver, a command or the core's next timer.
fn run_polled(p: &Polled, fds: &[RawFd]) {
    loop {
        if p.touched.swap(false, Ordering::AcqRel) && !p.timer_overdue() {
            // A caller drives: look again after a lease.
            p.callers_drive.store(true, Ordering::Release);
            std::thread::sleep(PROGRESS_LEASE);
            continue;
        }
        // Nobody called for a lease: commands wake this thread again.
        p.callers_drive.store(false, Ordering::Release);
        // Wakes from here on are seen by the wait below.
        p.wake.drain();
        let wait = {
            let mut g = p.worker.lock().unwrap_or_else(|e| e.into_inner());
            let mut wait = Duration::ZERO;
            for _ in 0..THREAD_BURST {
                match turn_or_stop(&mut g) {
                    Some(true) => continue,
                    Some(false) => {
                        wait = g
                            .as_mut()
                            .and_then(|w| w.drv.idle_wait())
                            .unwrap_or(Duration::ZERO);
                        break;
                    }
                    None => return,
                }
            }
            wait
        };
        if !wait.is_zero() {
            // Metrics keep their cadence: no wait is longer than 100 ms.
            let mut pfd: Vec<_> = fds.iter().map(|&fd| crate::sockets::readable(fd)).collect();
            // An error is a wake like any other: the loop looks again.
            let _ = crate::sockets::wait_readable(&mut pfd, wait.min(Duration::from_millis(100)));
        }
    }
}

/// A descriptor the driver owns, watched by the runtime's reactor (the
/// `AsyncFd`s are dropped before the driver that owns the descriptors).
struct RawFdRef(RawFd);

impl AsRawFd for RawFdRef {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

/// A one-shot monotonic `timerfd` (microsecond deadlines), readable when it fires.
struct TimerFd(AsyncFd<OwnedFd>);

impl TimerFd {
    fn new() -> std::io::Result<TimerFd> {
        // SAFETY: plain system call; its result is checked.
        let fd = unsafe {
            libc::timerfd_create(
                libc::CLOCK_MONOTONIC,
                libc::TFD_NONBLOCK | libc::TFD_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` is a new descriptor that nothing else owns.
        let owned = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: the `AsyncFd` owns the descriptor, which stays open until
        // it is dropped.
        let a = unsafe { AsyncFd::register_with_interest(owned, Interest::READABLE) };
        Ok(TimerFd(a.map_err(|e| e.into_parts().1)?))
    }

    /// Fires `after` from now (at least a nanosecond: zero would disarm).
    fn arm(&self, after: Duration) -> std::io::Result<()> {
        let after = after.max(Duration::from_nanos(1));
        let spec = libc::itimerspec {
            it_interval: libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
            it_value: libc::timespec {
                tv_sec: after.as_secs().min(i64::MAX as u64) as libc::time_t,
                tv_nsec: libc::c_long::from(after.subsec_nanos() as i32),
            },
        };
        // SAFETY: the descriptor is a timerfd we own; `spec` is a valid
        // itimerspec and the old value is not asked for.
        let r =
            unsafe { libc::timerfd_settime(self.0.as_raw_fd(), 0, &spec, std::ptr::null_mut()) };
        if r < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// Consumes an expiry, if any.
    fn drain(&self) {
        let mut b = [0u8; 8];
        // SAFETY: reads at most 8 bytes into `b` from a descriptor we own.
        let _ = unsafe { libc::read(self.0.as_raw_fd(), b.as_mut_ptr().cast(), b.len()) };
    }
}

/// The endpoint as a task: turns until one finds nothing to do, then waits
/// for a descriptor of the driver, a command or the next timer.
async fn run_task(
    mut w: Worker,
    waits: Vec<AsyncFd<RawFdRef>>,
    timer: TimerFd,
    notify: Arc<TaskNotify>,
) {
    let mut armed: Option<Duration> = None;
    loop {
        let progress = match w.turn_once() {
            Ok(Some(p)) => p,
            Ok(None) => break,
            Err(e) => {
                tracing::error!(error = %e, "metaroce endpoint task stopped on a driver error");
                break;
            }
        };
        let wait = if progress { None } else { w.drv.idle_wait() };
        let Some(wait) = wait else {
            // More to do: after the runtime's other tasks had their turn.
            tokio::task::yield_now().await;
            continue;
        };
        // Metrics keep their cadence; and no wait is longer than 100 ms,
        // as on the thread.
        let wait = wait.min(Duration::from_millis(100));
        if armed != Some(wait) {
            if let Err(e) = timer.arm(wait) {
                tracing::error!(error = %e, "metaroce endpoint task: timer failed");
                break;
            }
            armed = Some(wait);
        }
        let mut notified = std::pin::pin!(notify.notified());
        std::future::poll_fn(|cx| {
            let mut woke = notified.as_mut().poll(cx).is_ready();
            for a in &waits {
                if let Poll::Ready(r) = a.poll_read_ready(cx) {
                    // Cleared before the turn that reads: what comes after
                    // this sets it again.
                    if let Ok(mut g) = r {
                        g.clear_ready();
                    }
                    woke = true;
                }
            }
            if let Poll::Ready(r) = timer.0.poll_read_ready(cx) {
                if let Ok(mut g) = r {
                    g.clear_ready();
                }
                timer.drain();
                armed = None;
                woke = true;
            }
            if woke {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        })
        .await;
    }
    // The descriptors' watches go before the driver that owns them.
    drop(waits);
    drop(w);
}

impl Drop for Worker {
    fn drop(&mut self) {
        for sink in self.cqs.values() {
            sink.close();
        }
    }
}

impl Worker {
    fn new(
        drv: Driver,
        metrics: Option<Metrics>,
        rx: mpsc::Receiver<Command>,
        incoming: tmpsc::UnboundedSender<Incoming>,
    ) -> Worker {
        Worker {
            drv,
            rx,
            incoming,
            metrics,
            cqs: FxHashMap::default(),
            pending: FxHashMap::default(),
            next_wr: 1,
            unsignaled: FxHashMap::default(),
            connecting: HashMap::new(),
            zombies_mr: Vec::new(),
            zombies_cq: Vec::new(),
            deregs: Vec::new(),
            lends: Vec::new(),
            zombies_pd: Vec::new(),
            scratch: Vec::new(),
            to_sink: Vec::new(),
            last_metrics: std::time::Instant::now(),
            ran: false,
        }
    }

    /// One turn of the task ([`run_task`]): the commands queued so far, a
    /// driver turn that never sleeps, and what they made handed on.
    /// `None` once every handle is gone; else whether the turn did
    /// anything (commands count).
    fn turn_once(&mut self) -> Result<Option<bool>, DriverError> {
        let Some(commands) = self.take_commands() else {
            return Ok(None);
        };
        // Nothing came and nothing is due: no turn of the driver (a
        // polling caller's usual case).
        if !commands && !std::mem::take(&mut self.ran) && self.drv.quiet() {
            self.after_turn();
            return Ok(Some(false));
        }
        let progress = commands | self.drv.turn()?;
        self.after_turn();
        Ok(Some(progress))
    }

    /// Every command queued so far, in order, and what they made without
    /// the driver (a post to a QP in ERROR completes flushed at once, a
    /// close fails its QPs) handed on before a turn that may sleep.
    /// Whether there were any; `None` once every handle is gone.
    fn take_commands(&mut self) -> Option<bool> {
        let mut any = false;
        loop {
            match self.rx.try_recv() {
                Ok(c) => {
                    self.command(c);
                    any = true;
                }
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => return None,
            }
        }
        self.events();
        self.completions();
        Some(any)
    }

    /// What follows each driver turn: events and completions handed on,
    /// regions and PDs whose last use ended freed, metrics refreshed on
    /// their cadence.
    fn after_turn(&mut self) {
        self.events();
        self.completions();
        if !self.zombies_mr.is_empty()
            || !self.zombies_cq.is_empty()
            || !self.zombies_pd.is_empty()
            || !self.deregs.is_empty()
            || !self.lends.is_empty()
        {
            self.reap_zombies();
        }
        if let Some(m) = &mut self.metrics {
            if self.last_metrics.elapsed() >= Duration::from_millis(250) {
                self.last_metrics = std::time::Instant::now();
                m.update(self.drv.endpoint());
                m.update_driver(&self.drv.stats());
            }
        }
    }

    fn run(&mut self) -> Result<(), DriverError> {
        while self.take_commands().is_some() {
            // Nothing to do: sleep until a datagram, a timer or a command.
            self.drv.poll(Duration::from_millis(100))?;
            self.after_turn();
        }
        Ok(())
    }

    /// Posts `wr` to QP `qpn`'s send queue, its completion (if signaled,
    /// as in verbs) to the CQ with the caller's `wr_id`.
    pub(super) fn post_send_to_cq(
        &mut self,
        now: metaroce_proto::Instant,
        qpn: Qpn,
        wr: SendWr,
    ) -> Result<(), VerbsError> {
        let id = self.next_wr;
        self.next_wr += 1;
        let (user_wr_id, signaled) = (wr.wr_id, wr.signaled);
        self.drv
            .endpoint()
            .post_send(now, qpn, SendWr { wr_id: id, ..wr })?;
        let waiter = Waiter::Cq;
        self.pending.insert(id, Pending { user_wr_id, waiter });
        if !signaled {
            self.unsignaled.entry(qpn).or_default().push_back(id);
        }
        Ok(())
    }

    /// Posts `wr` to QP `qpn`'s receive queue, its completion to the CQ
    /// with the caller's `wr_id`.
    pub(super) fn post_recv_to_cq(&mut self, qpn: Qpn, wr: RecvWr) -> Result<(), VerbsError> {
        let id = self.next_wr;
        self.next_wr += 1;
        let user_wr_id = wr.wr_id;
        self.drv
            .endpoint()
            .post_recv(qpn, RecvWr { wr_id: id, ..wr })?;
        let waiter = Waiter::Cq;
        self.pending.insert(id, Pending { user_wr_id, waiter });
        Ok(())
    }

    /// The clock of the driver.
    pub(super) fn now(&self) -> metaroce_proto::Instant {
        self.drv.now()
    }

    fn command(&mut self, c: Command) {
        // The clock is read for the commands that take the time only (a
        // receive posted between two messages does not).
        let now = match c {
            Command::PostSend(..)
            | Command::PostSendBatch(..)
            | Command::Connect(..)
            | Command::Close(..) => self.drv.now(),
            _ => metaroce_proto::Instant::ZERO,
        };
        let ep = self.drv.endpoint();
        match c {
            Command::AllocPd(r) => {
                let _ = r.send(Ok(ep.alloc_pd()));
            }
            Command::DeallocPd(pd) => {
                if ep.dealloc_pd(pd).is_err() {
                    self.zombies_pd.push(pd);
                }
            }
            Command::RegMr {
                pd,
                buf,
                addr,
                access,
                reply,
            } => {
                let _ = reply.send(ep.reg_mr(pd, buf, addr, access).map_err(Into::into));
            }
            Command::DeregMr(lkey, r) => self.deregs.extend(try_dereg(ep, lkey, r)),
            Command::LendMr(lkey, r) => self.lends.extend(try_lend(ep, lkey, r)),
            Command::ReturnMr(lkey, buf) => {
                if let Err(e) = ep.return_mr(lkey, buf) {
                    tracing::warn!(lkey, error = %e, "lent region bytes not taken back");
                }
            }
            Command::DropMr(lkey) => {
                if let Err(VerbsError::MrInUse(_) | VerbsError::MrSending(_)) = ep.dereg_mr(lkey) {
                    self.zombies_mr.push(lkey);
                }
            }
            Command::ReadMr {
                lkey,
                offset,
                len,
                reply,
            } => {
                let res = region_range(ep, lkey, offset, len).and_then(|r| {
                    let bytes = ep.mr_range(lkey, r).ok_or(VerbsError::MrLent(lkey))?;
                    Ok(bytes.to_vec())
                });
                let _ = reply.send(res);
            }
            Command::WriteMr {
                lkey,
                offset,
                data,
                reply,
            } => {
                let res = region_range(ep, lkey, offset, data.len()).and_then(|r| {
                    let bytes = ep.mr_range_mut(lkey, r).ok_or(VerbsError::MrLent(lkey))?;
                    bytes.copy_from_slice(&data);
                    Ok(())
                });
                let _ = reply.send(res);
            }
            Command::CreateCq(cap, sink, r) => {
                let cq = ep.create_cq(cap);
                self.cqs.insert(cq, sink);
                let _ = r.send(Ok(cq));
            }
            Command::DestroyCq(cq) => {
                // Nobody reads it any more: what still completes to it
                // (a QP not destroyed yet) is dropped, not kept.
                if let Some(sink) = self.cqs.get(&cq) {
                    sink.close();
                }
                if !try_destroy_cq(ep, &mut self.cqs, cq) {
                    self.zombies_cq.push(cq);
                }
            }
            Command::CreateQp(init, r) => {
                let _ = r.send(ep.create_qp(init).map_err(Into::into));
            }
            Command::ConnectQp {
                qpn,
                conn,
                remote,
                attrs,
                reply,
            } => {
                let res = ep.connect_qp_with(qpn, conn, remote, &attrs);
                let _ = reply.send(res.map_err(Into::into));
            }
            Command::QpState(q, r) => {
                let _ = r.send(Ok(ep.qp_state(q)));
            }
            Command::DestroyQp(q) => {
                let _ = ep.destroy_qp(q);
            }
            Command::PostSend(qpn, mut wr, notify) => {
                // An awaited request always completes (its future waits
                // for it); one for the CQ only if signaled, as in verbs.
                let unsignaled = matches!(notify, Notify::Cq(_)) && !wr.signaled;
                wr.signaled |= !unsignaled;
                let user = wr.wr_id;
                let id = track(&mut self.pending, &mut self.next_wr, user, notify, |id| {
                    ep.post_send(now, qpn, SendWr { wr_id: id, ..wr })
                });
                if let Some(id) = id.filter(|_| unsignaled) {
                    self.unsignaled.entry(qpn).or_default().push_back(id);
                }
            }
            Command::PostSendBatch(qpn, wrs, reply) => {
                let mut res = Ok(());
                for (i, wr) in wrs.into_iter().enumerate() {
                    if let Err(error) = self.post_send_to_cq(now, qpn, wr) {
                        res = Err(ApiError::BatchRefused { posted: i, error });
                        break;
                    }
                }
                let _ = reply.send(res);
            }
            Command::PostRecv(qpn, wr, notify) => {
                let user = wr.wr_id;
                track(&mut self.pending, &mut self.next_wr, user, notify, |id| {
                    ep.post_recv(qpn, RecvWr { wr_id: id, ..wr })
                });
            }
            Command::PostRecvBatch(qpn, wrs, reply) => {
                let mut res = Ok(());
                for (i, wr) in wrs.into_iter().enumerate() {
                    if let Err(error) = self.post_recv_to_cq(qpn, wr) {
                        res = Err(ApiError::BatchRefused { posted: i, error });
                        break;
                    }
                }
                let _ = reply.send(res);
            }
            Command::Connect(peer, r) => match ep.connect(now, peer) {
                Ok(c) => {
                    self.connecting.insert(c, r);
                }
                Err(e) => {
                    let _ = r.send(Err(e.into()));
                }
            },
            Command::Close(c, r) => {
                let _ = r.send(ep.close(now, c).map_err(Into::into));
            }
            Command::ConnState(c, r) => {
                let _ = r.send(Ok(ep.connection_state(c)));
            }
            Command::ConnStats(c, r) => {
                let _ = r.send(Ok(ep.connection_stats(c)));
            }
            Command::Stats(r) => {
                let _ = r.send(Ok(ep.stats()));
            }
            Command::RefreshMetrics(done) => {
                if let Some(m) = &mut self.metrics {
                    m.update(ep);
                    m.update_driver(&self.drv.stats());
                }
                let _ = done.send(());
            }
        }
    }

    fn events(&mut self) {
        while let Some(e) = self.drv.endpoint().poll_event() {
            match e {
                Event::Connected(c) => {
                    if let Some(r) = self.connecting.remove(&c) {
                        let _ = r.send(Ok(c));
                    }
                }
                Event::Incoming { conn, peer } => {
                    if self.incoming.send(Incoming { conn, peer }).is_err() {
                        tracing::debug!(%peer, "incoming connection with no one accepting");
                    }
                }
                Event::ConnectionLost { conn, error } => {
                    if let Some(r) = self.connecting.remove(&conn) {
                        let _ = r.send(Err(ApiError::Connection(error)));
                    } else {
                        log_lost(conn, error);
                    }
                }
                Event::QpError { qpn, status } => {
                    tracing::debug!(%qpn, ?status, "QP moved to the error state");
                }
                Event::CqOverrun(cq) => {
                    tracing::warn!(?cq, "completion queue overrun");
                }
            }
        }
    }

    /// Hands every completion to its waiter or its queue's sink.
    fn completions(&mut self) {
        // Most turns of a polling caller find nothing: one count, no CQ
        // visited.
        if self.drv.endpoint().unpolled() == 0 {
            return;
        }
        for (&cq, sink) in &self.cqs {
            loop {
                self.scratch.clear();
                let n = self
                    .drv
                    .endpoint()
                    .poll_cq(cq, 256, &mut self.scratch)
                    .unwrap_or(0);
                if n == 0 {
                    break;
                }
                for wc in self.scratch.drain(..) {
                    if !matches!(wc.opcode, WcOpcode::Recv | WcOpcode::RecvRdmaWithImm) {
                        retire_unsignaled(&mut self.unsignaled, &mut self.pending, &wc);
                    }
                    let Some(p) = self.pending.remove(&wc.wr_id) else {
                        tracing::debug!(wr_id = wc.wr_id, "completion of an unknown request");
                        continue;
                    };
                    let wc = WorkCompletion {
                        wr_id: p.user_wr_id,
                        ..wc
                    };
                    match p.waiter {
                        Waiter::Once(tx) => {
                            let _ = tx.send(Ok(wc));
                        }
                        Waiter::Cq => self.to_sink.push(wc),
                    }
                }
                if !self.to_sink.is_empty() {
                    sink.push(&mut self.to_sink);
                }
            }
        }
    }

    fn reap_zombies(&mut self) {
        let ep = self.drv.endpoint();
        self.zombies_mr.retain(|&k| {
            matches!(
                ep.dereg_mr(k),
                Err(VerbsError::MrInUse(_) | VerbsError::MrSending(_))
            )
        });
        let waiting = std::mem::take(&mut self.deregs);
        self.deregs = waiting
            .into_iter()
            .filter_map(|(lkey, r)| try_dereg(ep, lkey, r))
            .collect();
        let waiting = std::mem::take(&mut self.lends);
        self.lends = waiting
            .into_iter()
            .filter_map(|(lkey, r)| try_lend(ep, lkey, r))
            .collect();
        self.zombies_pd.retain(|&pd| ep.dealloc_pd(pd).is_err());
        let cqs = &mut self.cqs;
        self.zombies_cq.retain(|&cq| !try_destroy_cq(ep, cqs, cq));
    }
}

/// Destroys queue `cq` and forgets its sink, unless a QP still completes
/// to it: then whether it went (false: try again later).
fn try_destroy_cq(
    ep: &mut Endpoint,
    cqs: &mut FxHashMap<CqHandle, Arc<CqSink>>,
    cq: CqHandle,
) -> bool {
    if let Err(VerbsError::CqInUse) = ep.destroy_cq(cq) {
        return false;
    }
    cqs.remove(&cq);
    true
}

/// Deregisters `lkey` and answers `r`, unless the driver is still sending
/// from the region: then hands both back, to try again after a poll.
fn try_dereg(ep: &mut Endpoint, lkey: u32, r: Reply<RegionBuf>) -> Option<(u32, Reply<RegionBuf>)> {
    match ep.dereg_mr(lkey) {
        Err(VerbsError::MrSending(_)) => Some((lkey, r)),
        res => {
            let _ = r.send(res.map_err(Into::into));
            None
        }
    }
}

/// Lends `lkey`'s bytes and answers `r`, unless the driver is still
/// sending from the region: then hands both back, to try again after a poll.
fn try_lend(ep: &mut Endpoint, lkey: u32, r: Reply<RegionBuf>) -> Option<(u32, Reply<RegionBuf>)> {
    match ep.lend_mr(lkey) {
        Err(VerbsError::MrSending(_)) => Some((lkey, r)),
        res => {
            if let Err(Ok(buf)) = r.send(res.map_err(Into::into)) {
                // The caller went away before the bytes came: they go back.
                let _ = ep.return_mr(lkey, buf);
            }
            None
        }
    }
}

/// Posts a request under a fresh internal wr_id and, if the core took it,
/// remembers where its completion goes and returns the id; if not, tells
/// the caller why.
fn track(
    pending: &mut FxHashMap<u64, Pending>,
    next_wr: &mut u64,
    user_wr_id: u64,
    notify: Notify,
    post: impl FnOnce(u64) -> Result<(), VerbsError>,
) -> Option<u64> {
    let id = *next_wr;
    *next_wr += 1;
    match post(id) {
        Ok(()) => {
            let waiter = notify.accepted();
            pending.insert(id, Pending { user_wr_id, waiter });
            Some(id)
        }
        Err(e) => {
            refuse(notify, e);
            None
        }
    }
}

/// A send of `wc.qpn` completed: the unsignaled sends posted before it on
/// that QP are done too, with no completion of their own (and the request
/// itself, if it was unsignaled and failed, leaves the list).
fn retire_unsignaled(
    unsignaled: &mut FxHashMap<Qpn, VecDeque<u64>>,
    pending: &mut FxHashMap<u64, Pending>,
    wc: &WorkCompletion,
) {
    let Some(q) = unsignaled.get_mut(&wc.qpn) else {
        return;
    };
    while let Some(&id) = q.front() {
        if id > wc.wr_id {
            break;
        }
        q.pop_front();
        if id != wc.wr_id {
            pending.remove(&id);
        }
    }
    if q.is_empty() {
        unsignaled.remove(&wc.qpn);
    }
}

fn refuse(notify: Notify, e: VerbsError) {
    match notify {
        Notify::Once(tx) => {
            let _ = tx.send(Err(e.into()));
        }
        Notify::Cq(ack) => {
            let _ = ack.send(Err(e.into()));
        }
    }
}

fn log_lost(conn: ConnectionHandle, error: ConnectionError) {
    tracing::info!(conn = conn.index(), %error, "connection lost");
}

/// The bytes `offset..offset + len` of region `lkey`, if it has them
/// (only those are touched: the application may use others in place).
fn region_range(
    ep: &Endpoint,
    lkey: u32,
    offset: u64,
    len: usize,
) -> Result<std::ops::Range<usize>, ApiError> {
    let info = ep.mr_info(lkey).ok_or(VerbsError::InvalidKey(lkey))?;
    slice_range(info.len as usize, offset, len)
}

/// `offset..offset + len` if it lies within `size` bytes.
fn slice_range(size: usize, offset: u64, len: usize) -> Result<std::ops::Range<usize>, ApiError> {
    let start = usize::try_from(offset).ok();
    match start.and_then(|s| Some(s..s.checked_add(len)?)) {
        Some(r) if r.end <= size => Ok(r),
        _ => Err(ApiError::OutOfBounds {
            offset,
            len: len as u64,
            size: size as u64,
        }),
    }
}
