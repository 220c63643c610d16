//! The async, verbs-shaped API: what an embedding Rust service uses.
//!
//! A [`Device`] is one endpoint on its own thread (the *endpoint thread*),
//! which owns the [`Driver`](crate::Driver), the core and every registered
//! buffer; or, opened with [`Device::open_on_runtime`], a task of the
//! caller's tokio runtime that does the same between the runtime's other
//! tasks. The thread gives the endpoint a core of its own for bulk
//! transfers; the task saves the hand-over between threads that each
//! request and each completion otherwise costs (on a current-thread
//! runtime a round trip then involves no thread switch; see
//! `docs/BENCHMARKS.md`). The handles ([`ProtectionDomain`], [`MemoryRegion`],
//! [`CompletionQueue`], [`QueuePair`], [`Connection`]) send it commands
//! through one queue, in order, and wake it if it sleeps; what it answers
//! comes back through `tokio::sync` channels, so any async runtime (or
//! `futures::executor::block_on`) can await it. Work requests return a
//! [`WorkRequest`] future of their completion, or go to a completion
//! queue when posted with [`QueuePair::post_send`]/[`QueuePair::post_recv`].
//!
//! # Order
//!
//! The data-path calls — the work requests, [`QueuePair::post_send`],
//! [`QueuePair::post_recv`], [`MemoryRegion::read`] and
//! [`MemoryRegion::write`] — are issued when they are *called*, and the
//! endpoint thread carries them out in call order; their futures only wait
//! for the answer. So `tokio::join!(mr.write(0, req), qp.post_send(wr))`
//! fills the buffer and then sends it, in one round trip to the endpoint
//! thread. (The set-up calls, `async fn`s such as [`Device::alloc_pd`] or
//! [`QueuePair::connect`], start when first polled, as usual.)
//!
//! # Setting up a connection (the out-of-band exchange)
//!
//! As with rdma_cm, an RC connection needs two things from the peer that
//! the transport cannot discover: where its QP is ([`QpEndpoint`]) and, for
//! WRITE/READ, which of its memory may be accessed ([`RemoteMr`]). The
//! application carries them over any channel it has (a TCP socket, a
//! rendezvous service; both have a byte form and serde support):
//!
//! 1. the server opens a device on a known address and waits in
//!    [`Device::accept`]; the client calls [`Device::connect`] with that
//!    address (a cookie-protected handshake, like rdma_cm's
//!    route/connect steps);
//! 2. each side creates its QP and sends the peer its [`QpEndpoint`]
//!    (and any [`RemoteMr`]s);
//! 3. each side calls [`QueuePair::connect`] with the connection and the
//!    peer's QP number (or [`QueuePair::connect_with`], with the RC
//!    attributes of `ibv_modify_qp`: retry counts, timeouts, READ depths);
//!    the QPs are then ready to send (RTS).
//!
//! # Which memory the application may touch
//!
//! [`ProtectionDomain::reg_mr`] moves the buffer into the endpoint: from
//! then until [`MemoryRegion::dereg`] gives it back, the application holds
//! no reference into it, so no request can race with the application's own
//! loads and stores in the memory-safety sense. It reads and writes the
//! region through [`MemoryRegion::read`] and [`MemoryRegion::write`], which
//! copy, in order with the requests posted on the same device, or in place
//! through [`MemoryRegion::lend`], which hands the bytes themselves over
//! for as long as its guard lives (nothing else uses the region
//! meanwhile). The verbs rule still applies to the *contents*:
//!
//! Memory the application allocated itself (a `memmap2` map, huge pages,
//! an aligned allocation) is registered in place with
//! [`ProtectionDomain::reg_mr_owned`], which keeps it until `dereg` gives
//! it back, or, kept alive by the application, with the `unsafe`
//! [`ProtectionDomain::reg_mr_raw`]. Every region has a raw view,
//! [`MemoryRegion::as_mut_ptr`], `unsafe` to use, for filling and reading
//! one part in place while transfers use others: the endpoint only ever
//! touches the byte ranges transfers name.
//!
//! - bytes a posted SEND or WRITE reads must not be changed until its
//!   completion: packets are built from the region when they are sent and
//!   again when they are retransmitted, so the peer could get a mix;
//! - bytes a posted RECV or READ fills, and bytes of a region the peer may
//!   WRITE to, hold their final value only once the completion is seen
//!   (for a peer's WRITE: once the peer says so, e.g. with a
//!   WRITE-with-immediate or a SEND after it).
//!
//! # Example
//!
//! ```no_run
//! use metaroce_io::{AccessFlags, Device, DriverConfig, RegionBuf};
//! # async fn demo() -> Result<(), metaroce_io::ApiError> {
//! let server = Device::open(DriverConfig::new("127.0.0.1:0".parse().unwrap())).await?;
//! let client = Device::open(DriverConfig::new("127.0.0.1:0".parse().unwrap())).await?;
//! let (conn_c, conn_s) = tokio::join!(client.connect(server.local_addr()), server.accept());
//! let (conn_c, conn_s) = (conn_c?, conn_s?);
//!
//! let (pd_c, pd_s) = (client.alloc_pd().await?, server.alloc_pd().await?);
//! let (cq_c, cq_s) = (client.create_cq(256).await?, server.create_cq(256).await?);
//! let qp_c = pd_c.create_qp(&cq_c, &cq_c).await?;
//! let qp_s = pd_s.create_qp(&cq_s, &cq_s).await?;
//! // Out of band: QP endpoints and the target region cross to the peer.
//! let target = pd_s.reg_mr(RegionBuf::zeroed(1 << 20), AccessFlags::REMOTE_WRITE).await?;
//! let (ep_c, ep_s, remote) = (qp_c.endpoint(), qp_s.endpoint(), target.remote());
//! qp_c.connect(&conn_c, ep_s.qpn()).await?;
//! qp_s.connect(&conn_s, ep_c.qpn()).await?;
//!
//! let src = pd_c.reg_mr(vec![7u8; 1 << 20], AccessFlags::NONE).await?;
//! qp_c.write(src.sge(0, 1 << 20)?, remote.at(0, 1 << 20)?).await?;
//! assert_eq!(target.read(0, 4).await?, vec![7u8; 4]);
//! # Ok(()) }
//! ```

mod oob;
mod worker;

pub use oob::{OobDecodeError, QpEndpoint, RemoteMr};

use crate::{Backend, DriverConfig, DriverError, Metrics, Waker};
use metaroce_proto::verbs::*;
use metaroce_proto::{ConnectionError, ConnectionState, ConnectionStats, EndpointStats};
use std::collections::VecDeque;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{mpsc, Arc, Mutex};
use std::task::{Context, Poll};
use tokio::sync::{mpsc as tmpsc, oneshot, Notify};
use worker::{Command, Notify as Dest};

/// Why a call of the async API failed.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The core refused the call (bad key, wrong QP state, queue full…).
    #[error(transparent)]
    Verbs(#[from] VerbsError),
    /// The driver could not be set up.
    #[error(transparent)]
    Driver(#[from] DriverError),
    /// The connection failed or was lost.
    #[error("connection failed: {0}")]
    Connection(#[from] ConnectionError),
    /// A work request completed with an error status (the completion
    /// says which request, by the `wr_id` the post gave it or, for an
    /// awaited call, [`WorkRequest::wr_id`], and what it was).
    #[error("work request {} ({:?} on QP {}) failed: {:?}", .0.wr_id, .0.opcode, .0.qpn, .0.status)]
    Failed(WorkCompletion),
    /// A range lies outside a memory region.
    #[error("range of {len} bytes at offset {offset} outside a region of {size} bytes")]
    OutOfBounds {
        /// Start of the range.
        offset: u64,
        /// Its length.
        len: u64,
        /// The region's size.
        size: u64,
    },
    /// A request of a batch ([`QueuePair::post_send_batch`],
    /// [`QueuePair::post_recv_batch`]) was refused:
    /// the `posted` requests before it were posted (and complete as
    /// usual), it and those after it were not (`ibv_post_send`'s `bad_wr`).
    #[error("request {posted} of a batch refused ({error}); the {posted} before it were posted, none after")]
    BatchRefused {
        /// How many requests of the batch were posted (the index of the refused one).
        posted: usize,
        /// Why it was refused.
        error: VerbsError,
    },
    /// A call for a device of [`Device::open_polled`] on one whose own
    /// thread or task drives the endpoint ([`QueuePair::post_send_now`],
    /// [`QueuePair::post_recv_now`]).
    #[error("the call is for a polled device (Device::open_polled)")]
    NotPolled,
    /// The endpoint thread has stopped (a driver error, logged), or the
    /// runtime an endpoint task ran on shut down.
    #[error("the endpoint thread has stopped")]
    Closed,
    /// [`Device::open_on_runtime`] was called outside a tokio runtime, or
    /// in one without I/O enabled.
    #[error("open_on_runtime needs a tokio runtime with I/O enabled (enable_io or enable_all)")]
    NoRuntime,
}

/// A connection a peer opened to us, as the endpoint thread reports it.
#[derive(Debug, Clone, Copy)]
struct Incoming {
    conn: ConnectionHandle,
    peer: SocketAddr,
}

/// How a command queued for the endpoint gets it looking.
enum Wake {
    /// The endpoint thread sleeps in its driver's poll.
    Thread(Waker),
    /// The endpoint task waits on the runtime.
    Task(Arc<Notify>),
    /// The application's threads drive the endpoint, or its thread does.
    Polled(Arc<worker::Polled>),
}

impl Wake {
    fn wake(&self) {
        match self {
            Wake::Thread(w) => w.wake(),
            Wake::Task(n) => n.notify_one(),
            Wake::Polled(p) => p.wake(),
        }
    }

    /// Wakes the thread or task whether or not a caller drives.
    fn wake_owner(&self) {
        match self {
            Wake::Polled(p) => p.wake_thread(),
            w => w.wake(),
        }
    }
}

struct Shared {
    tx: mpsc::Sender<Command>,
    /// The `wr_id` of the next awaited work request.
    next_wr_id: std::sync::atomic::AtomicU64,
    waker: Wake,
    local: SocketAddr,
    backend: Backend,
    incoming: tokio::sync::Mutex<tmpsc::UnboundedReceiver<Incoming>>,
}

impl Drop for Shared {
    fn drop(&mut self) {
        // The queue's sender goes with us: the thread (or task) sees it
        // closed and ends.
        self.waker.wake_owner();
    }
}

/// An endpoint on its own thread: the verbs "device" (`ibv_context`).
/// Cheap to clone; the thread ends when the last handle of it (including
/// every PD, region, CQ, QP and connection) is dropped.
///
/// ```no_run
/// # async fn demo() -> Result<(), metaroce_io::ApiError> {
/// let dev = metaroce_io::Device::open(
///     metaroce_io::DriverConfig::new("0.0.0.0:4791".parse().unwrap()),
/// ).await?;
/// println!("listening on {} ({})", dev.local_addr(), dev.backend());
/// let conn = dev.accept().await?;
/// println!("connection from {}", conn.peer());
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Device {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("local", &self.shared.local)
            .field("backend", &self.shared.backend)
            .finish_non_exhaustive()
    }
}

/// A future of one reply from the endpoint thread.
async fn answer<T>(rx: oneshot::Receiver<Result<T, ApiError>>) -> Result<T, ApiError> {
    rx.await.unwrap_or(Err(ApiError::Closed))
}

impl Device {
    /// Starts the endpoint thread and binds the driver there (on the backend
    /// `cfg` asks for; see [`Driver::bind`](crate::Driver::bind)).
    pub async fn open(cfg: DriverConfig) -> Result<Device, ApiError> {
        Self::start(cfg, None).await
    }

    /// Like [`open`](Self::open), and keeps `metrics` up to date with the
    /// endpoint's and the driver's counters: every 250 ms, and at once when
    /// [`metrics_refresher`](Self::metrics_refresher) asks. Serve its
    /// registry with [`MetricsServer::start_with_refresh`] and that
    /// refresher, and every scrape sees the counters as they are.
    ///
    /// [`MetricsServer::start_with_refresh`]: crate::MetricsServer::start_with_refresh
    pub async fn open_with_metrics(
        cfg: DriverConfig,
        metrics: Metrics,
    ) -> Result<Device, ApiError> {
        Self::start(cfg, Some(metrics)).await
    }

    async fn start(cfg: DriverConfig, metrics: Option<Metrics>) -> Result<Device, ApiError> {
        let (tx, rx) = mpsc::channel();
        let (in_tx, in_rx) = tmpsc::unbounded_channel();
        let (st_tx, st_rx) = oneshot::channel();
        std::thread::Builder::new()
            .name("metaroce-endpoint".into())
            .spawn(move || worker::run(cfg, metrics, rx, in_tx, st_tx))
            .map_err(DriverError::Io)?;
        let started = st_rx.await.map_err(|_| ApiError::Closed)??;
        Ok(Device::from_parts(
            tx,
            Wake::Thread(started.waker),
            started.local,
            started.backend,
            in_rx,
        ))
    }

    /// A handle of an endpoint that takes commands from `tx` (and is woken
    /// by `waker`) and reports incoming connections on `incoming`.
    fn from_parts(
        tx: mpsc::Sender<Command>,
        waker: Wake,
        local: SocketAddr,
        backend: Backend,
        incoming: tmpsc::UnboundedReceiver<Incoming>,
    ) -> Device {
        Device {
            shared: Arc::new(Shared {
                tx,
                next_wr_id: std::sync::atomic::AtomicU64::new(1),
                waker,
                local,
                backend,
                incoming: tokio::sync::Mutex::new(incoming),
            }),
        }
    }

    /// Like [`open`](Self::open), but the endpoint runs as a task of the
    /// calling tokio runtime instead of on a thread of its own, as a quinn
    /// endpoint does: no thread hands requests and completions over, so a
    /// request posted from a task goes out when that task yields, and a
    /// completion wakes its task without waking another thread. On a
    /// current-thread runtime, a round trip between two such devices has no
    /// thread switch at all.
    ///
    /// The endpoint's work (receiving, placing data, sending) then takes
    /// the runtime's time: use it where latency matters more than a core of
    /// its own for bulk transfers. Between its turns the task waits on the
    /// driver's descriptors (the io_uring ring or the receive sockets), a
    /// command, or the core's next timer (a `timerfd`, to the
    /// microsecond); it never blocks the runtime. The driver is bound on
    /// the calling thread (a few system calls).
    ///
    /// Must be called within a tokio runtime with I/O enabled
    /// (`enable_io`, or `enable_all`; else [`ApiError::NoRuntime`]); the
    /// task ends when the last handle of the device is dropped, or when the
    /// runtime shuts down (later calls then fail with [`ApiError::Closed`]). The
    /// driver's `busy_poll` is not used: the task never spins.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), metaroce_io::ApiError> {
    /// use metaroce_io::{Device, DriverConfig};
    /// let dev = Device::open_on_runtime(DriverConfig::new("127.0.0.1:0".parse().unwrap())).await?;
    /// println!("listening on {} ({})", dev.local_addr(), dev.backend());
    /// # Ok(()) }
    /// ```
    pub async fn open_on_runtime(cfg: DriverConfig) -> Result<Device, ApiError> {
        Self::start_on_runtime(cfg, None)
    }

    /// [`open_on_runtime`](Self::open_on_runtime), keeping `metrics` up to
    /// date as [`open_with_metrics`](Self::open_with_metrics) does.
    pub async fn open_on_runtime_with_metrics(
        cfg: DriverConfig,
        metrics: Metrics,
    ) -> Result<Device, ApiError> {
        Self::start_on_runtime(cfg, Some(metrics))
    }

    fn start_on_runtime(cfg: DriverConfig, metrics: Option<Metrics>) -> Result<Device, ApiError> {
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(ApiError::NoRuntime);
        }
        let (tx, rx) = mpsc::channel();
        let (in_tx, in_rx) = tmpsc::unbounded_channel();
        let notify = Arc::new(Notify::new());
        let (local, backend) = worker::start_on_runtime(cfg, metrics, rx, in_tx, notify.clone())?;
        Ok(Device::from_parts(
            tx,
            Wake::Task(notify),
            local,
            backend,
            in_rx,
        ))
    }

    /// Like [`open`](Self::open), but the application's own threads drive
    /// the endpoint, each call of [`progress`](Self::progress) taking one
    /// turn of it on the calling thread: what arrived is received and
    /// placed, completions are handed on, and what is due is sent, with no
    /// other thread woken on the way. This is how a polling loop gets the
    /// round trip of a busy-polling NIC driver from a software endpoint:
    /// an RDMA application's progress loop, NCCL's proxy thread.
    ///
    /// The device also has an endpoint thread, which takes the turns
    /// whenever no caller does: it looks once a millisecond, leaves the
    /// endpoint to the callers while `progress` was called since it last
    /// looked (unless a timer of the endpoint is overdue: a caller that
    /// stopped left an acknowledgement owed), and otherwise drives it as
    /// the thread of [`open`](Self::open) does (acknowledgements,
    /// retransmissions and requests posted while nobody polls still go
    /// out). So the rest of the API behaves as on any device; a request
    /// posted between two `progress` calls goes out at the next call. A
    /// call that posts or sets something up runs on the caller's thread
    /// when no turn is being taken (else it waits in a queue for the next
    /// turn); [`QueuePair::post_send_now`] and
    /// [`QueuePair::post_recv_now`] post there and answer at once, with
    /// no allocation, for a loop that polls its completion queues.
    /// The driver's `busy_poll` is not used: the callers are the busy poll.
    /// With [`Backend::Auto`] the device runs on the portable backend:
    /// an io_uring receive is bound to the thread that armed it, and the
    /// endpoint passes between threads (the callers', its own); asked for
    /// explicitly, io_uring is used, and is at its best driven by one
    /// thread that never stops polling.
    ///
    /// A progress loop polls the requests' futures without a waker (a
    /// no-op one), many times; it belongs on a thread of its own. Inside a
    /// tokio task, wrap it in `tokio::task::unconstrained`, or tokio's
    /// cooperative budget makes the futures pending until the task yields.
    ///
    /// ```no_run
    /// # async fn demo(qp: metaroce_io::QueuePair, mr: metaroce_io::MemoryRegion,
    /// #     remote: metaroce_io::RemoteAddr) -> Result<(), metaroce_io::ApiError> {
    /// use metaroce_io::{Device, DriverConfig};
    /// let dev = Device::open_polled(DriverConfig::new("127.0.0.1:0".parse().unwrap())).await?;
    /// // ... a connected QP on `dev`, a region, the peer's region ...
    /// use std::future::Future;
    /// use std::task::{Context, Poll, Waker};
    /// let mut wr = qp.write(mr.sge(0, 8)?, remote);
    /// let wc = loop {
    ///     dev.progress();
    ///     // Polled without blocking, as a progress loop polls its CQ.
    ///     let mut cx = Context::from_waker(Waker::noop());
    ///     if let Poll::Ready(wc) = std::pin::Pin::new(&mut wr).poll(&mut cx) {
    ///         break wc?;
    ///     }
    /// };
    /// println!("{:?}", wc.status);
    /// # Ok(()) }
    /// ```
    pub async fn open_polled(cfg: DriverConfig) -> Result<Device, ApiError> {
        Self::start_polled(cfg, None)
    }

    /// [`open_polled`](Self::open_polled), keeping `metrics` up to date as
    /// [`open_with_metrics`](Self::open_with_metrics) does.
    pub async fn open_polled_with_metrics(
        cfg: DriverConfig,
        metrics: Metrics,
    ) -> Result<Device, ApiError> {
        Self::start_polled(cfg, Some(metrics))
    }

    fn start_polled(mut cfg: DriverConfig, metrics: Option<Metrics>) -> Result<Device, ApiError> {
        // The endpoint passes between the callers' threads and its own, and
        // an io_uring receive is bound to the thread that armed it: right
        // after a switch a datagram can wait for the other thread (a
        // caller that resumes polling saw millisecond stalls and
        // retransmission timeouts). The portable backend has no such tie.
        if cfg.backend == Backend::Auto {
            cfg.backend = Backend::Portable;
        }
        let (tx, rx) = mpsc::channel();
        let (in_tx, in_rx) = tmpsc::unbounded_channel();
        let (local, backend, polled) = worker::start_polled(cfg, metrics, rx, in_tx)?;
        Ok(Device::from_parts(
            tx,
            Wake::Polled(polled),
            local,
            backend,
            in_rx,
        ))
    }

    /// Takes one turn of the endpoint on the calling thread, if this is a
    /// device of [`open_polled`](Self::open_polled) and no other thread is
    /// taking one: the requests posted so far go to the endpoint, what
    /// arrived is received and placed, completions reach their requests
    /// and completion queues, and what is due is sent. Never blocks.
    /// Returns whether the turn did anything; `false` on a device whose
    /// own thread or task drives it, where it does nothing.
    ///
    /// ```no_run
    /// # fn demo(dev: metaroce_io::Device, cq: metaroce_io::CompletionQueue) {
    /// // A progress loop: drive the endpoint, then poll the CQ.
    /// let wcs = loop {
    ///     dev.progress();
    ///     let wcs = cq.poll(16);
    ///     if !wcs.is_empty() {
    ///         break wcs;
    ///     }
    ///     std::thread::yield_now();
    /// };
    /// println!("{} completions", wcs.len());
    /// # }
    /// ```
    pub fn progress(&self) -> bool {
        match &self.shared.waker {
            Wake::Polled(p) => p.progress(),
            _ => false,
        }
    }

    /// Whether this is a device of [`open_polled`](Self::open_polled),
    /// which takes [`QueuePair::post_send_now`] and
    /// [`QueuePair::post_recv_now`].
    pub fn is_polled(&self) -> bool {
        matches!(self.shared.waker, Wake::Polled(_))
    }

    /// The endpoint of a polled device, for a call on the caller's thread.
    fn polled(&self) -> Result<&worker::Polled, ApiError> {
        match &self.shared.waker {
            Wake::Polled(p) => Ok(p),
            _ => Err(ApiError::NotPolled),
        }
    }

    /// The address peers connect to.
    pub fn local_addr(&self) -> SocketAddr {
        self.shared.local
    }

    /// The backend the driver runs on.
    pub fn backend(&self) -> Backend {
        self.shared.backend
    }

    /// A fresh `wr_id` for an awaited work request.
    fn next_wr_id(&self) -> u64 {
        self.shared
            .next_wr_id
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether `other` is a handle of this same device (endpoint thread).
    fn same(&self, other: &Device) -> bool {
        Arc::ptr_eq(&self.shared, &other.shared)
    }

    fn send(&self, c: Command) {
        // A polled device whose endpoint is free runs it here and now.
        let c = match &self.shared.waker {
            Wake::Polled(p) => match p.run(c) {
                None => return,
                Some(c) => c,
            },
            _ => c,
        };
        // A closed queue means the thread stopped: the reply channel inside
        // `c` is dropped with it and the caller sees `Closed`.
        if self.shared.tx.send(c).is_ok() {
            self.shared.waker.wake();
        }
    }

    async fn call<T>(
        &self,
        f: impl FnOnce(oneshot::Sender<Result<T, ApiError>>) -> Command,
    ) -> Result<T, ApiError> {
        self.issue(f).await
    }

    /// Sends the command now; the future waits for its answer.
    fn issue<T>(
        &self,
        f: impl FnOnce(oneshot::Sender<Result<T, ApiError>>) -> Command,
    ) -> impl Future<Output = Result<T, ApiError>> {
        let (tx, rx) = oneshot::channel();
        self.send(f(tx));
        answer(rx)
    }

    /// Opens a connection to the endpoint listening at `peer` and waits
    /// until it is established (or the handshake fails).
    pub async fn connect(&self, peer: SocketAddr) -> Result<Connection, ApiError> {
        let conn = self.call(|r| Command::Connect(peer, r)).await?;
        Ok(Connection {
            dev: self.clone(),
            conn,
            peer,
        })
    }

    /// Waits for the next connection a peer opens to this endpoint.
    pub async fn accept(&self) -> Result<Connection, ApiError> {
        let inc = self.shared.incoming.lock().await.recv().await;
        let inc = inc.ok_or(ApiError::Closed)?;
        Ok(Connection {
            dev: self.clone(),
            conn: inc.conn,
            peer: inc.peer,
        })
    }

    /// Allocates a protection domain (`ibv_alloc_pd`).
    pub async fn alloc_pd(&self) -> Result<ProtectionDomain, ApiError> {
        let pd = self.call(Command::AllocPd).await?;
        Ok(ProtectionDomain {
            dev: self.clone(),
            pd,
        })
    }

    /// Creates a completion queue (`ibv_create_cq`) for the requests posted
    /// with [`QueuePair::post_send`]/[`QueuePair::post_recv`] (requests
    /// awaited one by one never land there).
    pub async fn create_cq(&self, capacity: usize) -> Result<CompletionQueue, ApiError> {
        let sink = Arc::new(CqSink::default());
        let s = sink.clone();
        let cq = self
            .call(|r| Command::CreateCq(capacity.max(1), s, r))
            .await?;
        Ok(CompletionQueue {
            dev: self.clone(),
            cq,
            sink,
        })
    }

    /// The endpoint's counters (packets, rejections by reason, …).
    pub async fn stats(&self) -> Result<EndpointStats, ApiError> {
        self.call(Command::Stats).await
    }

    /// A [`Refresh`](crate::Refresh) for
    /// [`MetricsServer::start_with_refresh`](crate::MetricsServer::start_with_refresh):
    /// each call has the endpoint thread bring the metrics given to
    /// [`open_with_metrics`](Self::open_with_metrics) up to date, and
    /// waits for it (at most 100 ms; a device opened without metrics
    /// answers at once). It blocks: call it from a thread that may block,
    /// as the metrics server's does, not from an async task.
    ///
    /// ```no_run
    /// // `registry`: that of the metrics the device was opened with.
    /// # fn demo(dev: metaroce_io::Device, registry: metaroce_io::Registry) {
    /// let refresh = dev.metrics_refresher();
    /// std::thread::spawn(move || {
    ///     refresh(); // the device's series in `registry` are current now
    ///     println!("{} metric families", registry.gather().len());
    /// });
    /// # }
    /// ```
    pub fn metrics_refresher(&self) -> crate::Refresh {
        let dev = self.clone();
        Box::new(move || {
            let (tx, rx) = mpsc::sync_channel(1);
            dev.send(Command::RefreshMetrics(tx));
            let _ = rx.recv_timeout(std::time::Duration::from_millis(100));
        })
    }
}

/// One end of a QP pair made by [`connect_qp_pair`]: the connection, and a
/// PD, a CQ (for both sends and receives) and a QP in RTS on it. Its fields
/// drop in order (QP, CQ, PD, connection).
///
/// ```no_run
/// # async fn demo(a: metaroce_io::Device, b: metaroce_io::Device) -> Result<(), metaroce_io::ApiError> {
/// let (end_a, _end_b) = metaroce_io::connect_qp_pair(&a, &b).await?;
/// println!("QP {} on a connection to {}", end_a.qp.qpn(), end_a.conn.peer());
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct ConnectedQp {
    /// The QP, connected to the other end's.
    pub qp: QueuePair,
    /// Where requests posted with [`QueuePair::post_send`] and
    /// [`QueuePair::post_recv`] complete.
    pub cq: CompletionQueue,
    /// The QP's protection domain, for its memory regions.
    pub pd: ProtectionDomain,
    /// The connection the QP runs on.
    pub conn: Connection,
}

impl ConnectedQp {
    /// A PD, a CQ and a QP on `dev`, for `conn` (not connected yet).
    async fn make(dev: &Device, conn: Connection) -> Result<ConnectedQp, ApiError> {
        let pd = dev.alloc_pd().await?;
        let cq = dev.create_cq(1024).await?;
        let qp = pd.create_qp(&cq, &cq).await?;
        Ok(ConnectedQp { qp, cq, pd, conn })
    }
}

/// Connects device `a` to device `b` and makes a connected RC QP pair on
/// it, with default capacities and attributes: what every test and
/// single-process program writes (the driver API's
/// [`connect_pair`](crate::connect_pair) does the connection part for
/// drivers). Both devices must be in this process (between processes or
/// hosts, the QP numbers cross out of band: see the module documentation),
/// and nothing else may be waiting in `b`'s [`Device::accept`] meanwhile:
/// this takes `b`'s next incoming connection, which is `a`'s.
///
/// ```no_run
/// # async fn demo() -> Result<(), metaroce_io::ApiError> {
/// use metaroce_io::{connect_qp_pair, AccessFlags, Device, DriverConfig};
/// let a = Device::open(DriverConfig::new("127.0.0.1:0".parse().unwrap())).await?;
/// let b = Device::open(DriverConfig::new("127.0.0.1:0".parse().unwrap())).await?;
/// let (qa, qb) = connect_qp_pair(&a, &b).await?;
/// let src = qa.pd.reg_mr(vec![1u8; 64], AccessFlags::NONE).await?;
/// let dst = qb.pd.reg_mr(vec![0u8; 64], AccessFlags::LOCAL_WRITE).await?;
/// let got = qb.qp.recv(dst.sge(0, 64)?);
/// qa.qp.send(src.sge(0, 64)?).await?;
/// assert_eq!(got.await?.byte_len, 64);
/// # Ok(()) }
/// ```
pub async fn connect_qp_pair(
    a: &Device,
    b: &Device,
) -> Result<(ConnectedQp, ConnectedQp), ApiError> {
    // The handshake completes on the endpoint threads; `accept` then
    // takes what `b`'s reported.
    let ca = a.connect(b.local_addr()).await?;
    let cb = b.accept().await?;
    let sa = ConnectedQp::make(a, ca).await?;
    let sb = ConnectedQp::make(b, cb).await?;
    sa.qp.connect(&sa.conn, sb.qp.qpn()).await?;
    sb.qp.connect(&sb.conn, sa.qp.qpn()).await?;
    Ok((sa, sb))
}

/// A connection to a peer endpoint; QPs are bound to it with
/// [`QueuePair::connect`].
#[derive(Debug, Clone)]
pub struct Connection {
    dev: Device,
    conn: ConnectionHandle,
    peer: SocketAddr,
}

impl Connection {
    /// The peer's address (its IP and listening port).
    pub fn peer(&self) -> SocketAddr {
        self.peer
    }

    /// The core's handle.
    pub fn handle(&self) -> ConnectionHandle {
        self.conn
    }

    /// Where the connection stands (`None` once released).
    pub async fn state(&self) -> Result<Option<ConnectionState>, ApiError> {
        let c = self.conn;
        self.dev.call(|r| Command::ConnState(c, r)).await
    }

    /// The connection's counters and per-path telemetry (RTT, window,
    /// losses, ECN marks, state, plane); `None` once released.
    pub async fn stats(&self) -> Result<Option<ConnectionStats>, ApiError> {
        let c = self.conn;
        self.dev.call(|r| Command::ConnStats(c, r)).await
    }

    /// Closes the connection: the peer is told, every QP bound to it moves
    /// to the error state and its outstanding requests complete flushed.
    pub async fn close(&self) -> Result<(), ApiError> {
        let c = self.conn;
        self.dev.call(|r| Command::Close(c, r)).await
    }
}

/// A protection domain (`ibv_pd`): regions and QPs of one PD only work
/// with each other.
#[derive(Debug)]
pub struct ProtectionDomain {
    dev: Device,
    pd: PdHandle,
}

impl Drop for ProtectionDomain {
    fn drop(&mut self) {
        self.dev.send(Command::DeallocPd(self.pd));
    }
}

/// The size from which [`ProtectionDomain::reg_mr`] maps a buffer's pages
/// on a thread of its own (4 MiB: about 1.6 ms of mapping), so that a
/// large registration does not hold up the async executor.
pub const REG_MR_THREAD_BYTES: usize = 4 << 20;

/// Maps `buf`'s pages ([`make_resident`](crate::make_resident)) on a new
/// thread and hands it back.
async fn make_resident_off_thread(mut buf: RegionBuf) -> Result<RegionBuf, ApiError> {
    let (tx, rx) = oneshot::channel();
    std::thread::Builder::new()
        .name("metaroce-reg-mr".into())
        .spawn(move || {
            crate::make_resident(&mut buf);
            let _ = tx.send(buf);
        })
        .map_err(DriverError::Io)?;
    rx.await.map_err(|_| ApiError::Closed)
}

impl ProtectionDomain {
    /// Registers `buf` as a memory region (`ibv_reg_mr`); the endpoint owns
    /// it until [`MemoryRegion::dereg`]. Its virtual address is chosen by
    /// the endpoint (a distinct range per region). [`RegionBuf::zeroed`]
    /// gives page-aligned memory, as regions should have; a `Vec<u8>` or
    /// `Box<[u8]>` is taken as it is.
    ///
    /// As `ibv_reg_mr` pins a region's pages, this maps every page of
    /// `buf` before the endpoint takes it, keeping its bytes (with one
    /// `madvise(MADV_POPULATE_WRITE)` where the kernel has it, else a fault
    /// a page; about 0.4 s for a GiB), not the driver in the middle of a
    /// transfer: a buffer of [`REG_MR_THREAD_BYTES`] or more on a thread of
    /// its own, which this future awaits without blocking the executor; a
    /// smaller one (a millisecond at most) on the calling thread. `access`
    /// with [`AccessFlags::ON_DEMAND`] leaves them to the first access of
    /// each page instead.
    ///
    /// `access` is what the peer may do (`REMOTE_WRITE`, `REMOTE_READ`) and
    /// whether this side's own requests may write into it: a region a
    /// receive or a READ lands in needs `LOCAL_WRITE`, as in verbs. A
    /// receive into a region without it is refused when posted, with
    /// [`VerbsError::AccessDenied`]; a READ into one is accepted and
    /// completes with [`WcStatus::LocalProtectionError`] (moving the QP to
    /// ERROR), as every send request whose local buffer is invalid does.
    ///
    /// Fails with [`VerbsError::InvalidLength`] for an empty buffer,
    /// [`VerbsError::TooManyRegions`] once the endpoint holds 16,777,216
    /// regions, [`ApiError::Driver`] if the thread that maps a large
    /// buffer cannot be started, and [`ApiError::Closed`] if the endpoint
    /// thread has stopped; the buffer is dropped with the error.
    pub async fn reg_mr(
        &self,
        buf: impl Into<RegionBuf>,
        access: AccessFlags,
    ) -> Result<MemoryRegion, ApiError> {
        // Each region gets its own 1 TiB-aligned virtual range, so that an
        // address names one region's byte only.
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let addr = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed) << 40;
        self.reg_mr_at(buf, addr, access).await
    }

    /// Registers `buf` with byte 0 at virtual address `addr` (an iova).
    pub async fn reg_mr_at(
        &self,
        buf: impl Into<RegionBuf>,
        addr: u64,
        access: AccessFlags,
    ) -> Result<MemoryRegion, ApiError> {
        let mut buf = buf.into();
        let base = RegionPtr(buf.as_mut_ptr());
        if !access.contains(AccessFlags::ON_DEMAND) {
            // Not on the driver's thread, which would stall every
            // connection's traffic while it took the faults, nor, for a
            // large buffer, on the executor's.
            if buf.len() >= REG_MR_THREAD_BYTES {
                buf = make_resident_off_thread(buf).await?;
            } else {
                crate::make_resident(&mut buf);
            }
        }
        let pd = self.pd;
        let info = self
            .dev
            .call(|reply| Command::RegMr {
                pd,
                buf,
                addr,
                access,
                reply,
            })
            .await?;
        Ok(MemoryRegion {
            dev: self.dev.clone(),
            info,
            base,
            live: true,
        })
    }

    /// Registers memory the application allocated itself, in place, with
    /// no copy (`ibv_reg_mr` on its own buffer): any `T` that derefs to
    /// bytes and may cross threads, such as a `memmap2::MmapMut` (a file,
    /// or anonymous memory with huge pages), an aligned allocation of its
    /// own, or a `Vec<u8>`. The region keeps `owner` alive and unmoved;
    /// [`MemoryRegion::dereg`] gives it back
    /// ([`RegionBuf::into_owner`]). Reach the bytes meanwhile with
    /// [`MemoryRegion::lend`] (safe, in place), [`MemoryRegion::read`] and
    /// [`MemoryRegion::write`] (copies), or the raw view
    /// [`MemoryRegion::as_mut_ptr`] (`unsafe` to use). Otherwise as
    /// [`reg_mr`](Self::reg_mr): the pages are mapped first, off the
    /// executor for a large region, and the errors are the same.
    ///
    /// ```no_run
    /// # async fn demo(pd: metaroce_io::ProtectionDomain) -> Result<(), Box<dyn std::error::Error>> {
    /// use metaroce_io::AccessFlags;
    /// // 1 GiB of anonymous memory (add `.huge(None)` for huge pages).
    /// let map = memmap2::MmapOptions::new().len(1 << 30).map_anon()?;
    /// let mr = pd.reg_mr_owned(map, AccessFlags::REMOTE_WRITE | AccessFlags::LOCAL_WRITE).await?;
    /// // … peers WRITE into it …
    /// let map: memmap2::MmapMut = mr.dereg().await?.into_owner().unwrap();
    /// println!("{:?}", &map[..16]);
    /// # Ok(()) }
    /// ```
    pub async fn reg_mr_owned<T: AsMut<[u8]> + Send + 'static>(
        &self,
        owner: T,
        access: AccessFlags,
    ) -> Result<MemoryRegion, ApiError> {
        self.reg_mr(RegionBuf::from_owner(owner), access).await
    }

    /// Registers `len` bytes at `ptr` that the application keeps alive and
    /// uses itself, in place: what `ibv_reg_mr(pd, addr, length, access)`
    /// does with memory from anywhere (a pool, a C library, memory another
    /// runtime manages). [`MemoryRegion::as_mut_ptr`] is `ptr`.
    /// [`MemoryRegion::dereg`] returns a [`RegionBuf`] that frees nothing
    /// when dropped. Otherwise as [`reg_mr`](Self::reg_mr); a `len` of 0
    /// is refused with [`VerbsError::InvalidLength`].
    ///
    /// # Safety
    ///
    /// The rules of `ibv_reg_mr`, as [`RegionBuf::from_raw_parts`] states
    /// them; in short, from this call on:
    ///
    /// - the memory stays valid and in place (not freed, unmapped or
    ///   remapped) until [`MemoryRegion::dereg`] has returned `Ok`; if the
    ///   region is dropped instead, or the device stops, until every
    ///   handle of the [`Device`] is dropped and its endpoint thread has
    ///   ended (in practice: keep it for the life of the process);
    /// - nothing accesses it while this call runs (its pages are mapped,
    ///   one byte a page rewritten where the kernel cannot map them in one
    ///   call), nor while a [`LentRegion`] of the region lives;
    /// - the application's accesses keep off the bytes a transfer uses:
    ///   it does not write bytes a posted SEND or WRITE, or a peer's READ,
    ///   may be reading, and does not read or write bytes a posted receive
    ///   or READ, or a peer's WRITE, may be writing, until the completion
    ///   (or the application's protocol with the peer) says it is over.
    ///
    /// ```no_run
    /// # async fn demo(pd: metaroce_io::ProtectionDomain) -> Result<(), metaroce_io::ApiError> {
    /// use metaroce_io::AccessFlags;
    /// use std::ptr::NonNull;
    /// let memory: &'static mut [u8] = Box::leak(vec![0u8; 1 << 20].into_boxed_slice());
    /// let ptr = NonNull::new(memory.as_mut_ptr()).unwrap();
    /// // SAFETY: leaked, so valid for ever; the application reads it only
    /// // after the receive below completed.
    /// let mr = unsafe { pd.reg_mr_raw(ptr, 1 << 20, AccessFlags::LOCAL_WRITE) }.await?;
    /// assert_eq!(mr.as_ptr(), ptr.as_ptr().cast_const());
    /// # Ok(()) }
    /// ```
    pub async unsafe fn reg_mr_raw(
        &self,
        ptr: std::ptr::NonNull<u8>,
        len: usize,
        access: AccessFlags,
    ) -> Result<MemoryRegion, ApiError> {
        if len == 0 {
            return Err(VerbsError::InvalidLength(0).into());
        }
        // SAFETY: the caller's promise, as this function's contract states
        // it, is the one `from_raw_parts` asks for.
        let buf = unsafe { RegionBuf::from_raw_parts(ptr, len) };
        self.reg_mr(buf, access).await
    }

    /// Creates an RC queue pair (`ibv_create_qp`) with the default
    /// capacities ([`QpCaps::default`]: 1024 send and 1024 receive
    /// requests). See [`create_qp_with`](Self::create_qp_with).
    pub async fn create_qp(
        &self,
        send_cq: &CompletionQueue,
        recv_cq: &CompletionQueue,
    ) -> Result<QueuePair, ApiError> {
        self.create_qp_with(send_cq, recv_cq, QpCaps::default())
            .await
    }

    /// Creates an RC queue pair (`ibv_create_qp`) whose send requests
    /// complete in `send_cq` and receives in `recv_cq`, with the capacities
    /// `caps` (`ibv_qp_init_attr.cap`): a post beyond them is refused with
    /// [`VerbsError::QueueFull`].
    ///
    /// Fails with [`VerbsError::InvalidCq`] if a queue belongs to another
    /// [`Device`], with [`VerbsError::InvalidLength`] for a capacity of
    /// zero or a send capacity above the protocol's message window
    /// (`MSG_WINDOW`), and with [`VerbsError::InvalidAttribute`] for an
    /// element capacity outside 1 to `MAX_SGE`.
    ///
    /// ```no_run
    /// # async fn demo(dev: metaroce_io::Device) -> Result<(), metaroce_io::ApiError> {
    /// use metaroce_io::QpCaps;
    /// let pd = dev.alloc_pd().await?;
    /// let (scq, rcq) = (dev.create_cq(64).await?, dev.create_cq(256).await?);
    /// let caps = QpCaps { max_send_wr: 64, max_recv_wr: 256, ..QpCaps::default() };
    /// let qp = pd.create_qp_with(&scq, &rcq, caps).await?;
    /// # let _ = qp; Ok(()) }
    /// ```
    pub async fn create_qp_with(
        &self,
        send_cq: &CompletionQueue,
        recv_cq: &CompletionQueue,
        caps: QpCaps,
    ) -> Result<QueuePair, ApiError> {
        for cq in [send_cq, recv_cq] {
            if !self.dev.same(&cq.dev) {
                return Err(VerbsError::InvalidCq.into());
            }
        }
        for n in [caps.max_send_wr, caps.max_recv_wr] {
            if n == 0 {
                return Err(VerbsError::InvalidLength(0).into());
            }
        }
        if caps.max_send_wr > metaroce_proto::consts::MSG_WINDOW {
            return Err(VerbsError::InvalidLength(caps.max_send_wr as usize).into());
        }
        let init = QpInit {
            max_send_wr: caps.max_send_wr,
            max_recv_wr: caps.max_recv_wr,
            max_send_sge: caps.max_send_sge,
            max_recv_sge: caps.max_recv_sge,
            ..QpInit::new(self.pd, send_cq.cq, recv_cq.cq)
        };
        let qpn = self.dev.call(|r| Command::CreateQp(init, r)).await?;
        Ok(QueuePair {
            dev: self.dev.clone(),
            qpn,
        })
    }
}

/// The capacities of a queue pair (`ibv_qp_cap`), for
/// [`ProtectionDomain::create_qp_with`]: how many send and receive requests
/// may be outstanding at once (posted and not yet completed), and how many
/// scatter/gather elements each may have.
///
/// ```
/// let caps = metaroce_io::QpCaps { max_recv_wr: 4096, ..Default::default() };
/// assert_eq!(caps.max_send_wr, 1024);
/// assert_eq!(caps.max_send_sge, metaroce_io::proto::consts::MAX_SGE as u32);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCaps {
    /// Send requests (SEND, WRITE, READ…) outstanding at once, 1 to the
    /// protocol's message window (`MSG_WINDOW`); 1024 by default.
    pub max_send_wr: u32,
    /// Receives posted and not yet consumed at once; 1024 by default.
    pub max_recv_wr: u32,
    /// Scatter/gather elements of a send request, 1 to `MAX_SGE` (4, the
    /// default); more are refused with [`VerbsError::TooManySge`].
    pub max_send_sge: u32,
    /// Scatter/gather elements of a receive, 1 to `MAX_SGE` (4, the
    /// default); more are refused with [`VerbsError::TooManySge`].
    pub max_recv_sge: u32,
}

impl Default for QpCaps {
    fn default() -> Self {
        QpCaps {
            max_send_wr: 1024,
            max_recv_wr: 1024,
            max_send_sge: metaroce_proto::consts::MAX_SGE as u32,
            max_recv_sge: metaroce_proto::consts::MAX_SGE as u32,
        }
    }
}

/// A registered memory region (`ibv_mr`). Dropping it deregisters it once
/// no request uses it any more; [`dereg`](Self::dereg) gives the buffer back.
#[derive(Debug)]
pub struct MemoryRegion {
    dev: Device,
    info: MrInfo,
    /// Byte 0 of the region's memory, for the raw view.
    base: RegionPtr,
    live: bool,
}

/// The address of a region's byte 0: only handed to the application
/// ([`MemoryRegion::as_mut_ptr`]), never dereferenced here.
#[derive(Debug, Clone, Copy)]
struct RegionPtr(*mut u8);

// SAFETY: an address only; what the application does with it is under the
// contract of `MemoryRegion::as_mut_ptr`, which is `unsafe` to use.
unsafe impl Send for RegionPtr {}
// SAFETY: as for `Send`.
unsafe impl Sync for RegionPtr {}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        if self.live {
            self.dev.send(Command::DropMr(self.info.lkey));
        }
    }
}

impl MemoryRegion {
    /// Local key, address, length and access of the region.
    pub fn info(&self) -> MrInfo {
        self.info
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.info.len
    }

    /// Whether the region is empty (never: empty regions are refused).
    pub fn is_empty(&self) -> bool {
        self.info.len == 0
    }

    /// Byte 0 of the region's memory, for reading it in place: the raw
    /// view of `ibv_mr.addr`. The address is the same for the region's
    /// life, wherever the handle moves; it is the memory registered (the
    /// buffer given to [`ProtectionDomain::reg_mr`], the owner's bytes of
    /// [`ProtectionDomain::reg_mr_owned`], the `ptr` of
    /// [`ProtectionDomain::reg_mr_raw`]). See [`as_mut_ptr`](Self::as_mut_ptr)
    /// for when using it is sound.
    ///
    /// ```no_run
    /// # async fn demo(pd: metaroce_io::ProtectionDomain) -> Result<(), metaroce_io::ApiError> {
    /// let data = vec![5u8; 4096];
    /// let at = data.as_ptr();
    /// let mr = pd.reg_mr_owned(data, metaroce_io::AccessFlags::NONE).await?;
    /// assert_eq!(mr.as_ptr(), at); // the application's own memory, in place
    /// # Ok(()) }
    /// ```
    pub fn as_ptr(&self) -> *const u8 {
        self.base.0
    }

    /// Byte 0 of the region's memory, for filling and reading it in place
    /// without a copy or a round trip to the endpoint thread: the raw view
    /// of `ibv_mr.addr`, for what [`lend`](Self::lend) cannot do (touch one
    /// part while transfers use others, from many threads). Getting the
    /// pointer is safe; using it is `unsafe`, and sound only within the
    /// verbs rules, which Rust cannot check here:
    ///
    /// - stay within [`len`](Self::len) bytes, and only while the region
    ///   is registered (this handle alive, [`dereg`](Self::dereg) not yet
    ///   called) and not lent (no [`LentRegion`] of it alive);
    /// - do not write bytes that a posted SEND or WRITE, or a peer's READ,
    ///   may be reading, until its completion (or your protocol with the
    ///   peer) says it is over: the endpoint reads them when it builds each
    ///   packet, retransmissions included;
    /// - do not read or write bytes that a posted receive or READ, or a
    ///   peer's WRITE, may be writing, until the completion (for a peer's
    ///   WRITE: the peer's WRITE_IMM or SEND after it) says they are final;
    /// - the same for the copies [`read`](Self::read) (reads its bytes)
    ///   and [`write`](Self::write) (writes them) until their futures are
    ///   done.
    ///
    /// What the application wrote before it posts a request (or issues
    /// any call of this API) is what the request sees, and what a
    /// completion reports is visible once the application has it: the
    /// calls and completions pass through channels that order memory.
    ///
    /// The endpoint keeps to its side: it reaches a region's bytes only
    /// through the ranges transfers name, never the whole region at once,
    /// so the parts no transfer uses are the application's. Breaking a
    /// rule is a data race (undefined behaviour), not merely the torn
    /// contents a NIC would give; where a peer is not trusted to keep to
    /// the protocol, read what it may write with [`lend`](Self::lend)
    /// (which fails its accesses meanwhile) or [`read`](Self::read).
    ///
    /// ```no_run
    /// # async fn demo(pd: metaroce_io::ProtectionDomain, qp: metaroce_io::QueuePair) -> Result<(), metaroce_io::ApiError> {
    /// use metaroce_io::{AccessFlags, RegionBuf};
    /// let mr = pd.reg_mr(RegionBuf::zeroed(2 << 20), AccessFlags::LOCAL_WRITE).await?;
    /// let base = mr.as_mut_ptr();
    /// // Receive into the second MiB while filling the first in place.
    /// let incoming = qp.recv(mr.sge(1 << 20, 1 << 20)?);
    /// // SAFETY: the first MiB is in the region, and no transfer uses it.
    /// unsafe { std::ptr::write_bytes(base, 7, 1 << 20) };
    /// let n = incoming.await?.byte_len as usize;
    /// // SAFETY: the receive completed: its bytes are final and no longer used.
    /// let got = unsafe { std::slice::from_raw_parts(base.add(1 << 20), n) };
    /// println!("received {:?}", &got[..n.min(16)]);
    /// qp.send(mr.sge(0, 1 << 20)?).await?;
    /// # Ok(()) }
    /// ```
    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.base.0
    }

    /// What a peer needs to WRITE to or READ from this region.
    pub fn remote(&self) -> RemoteMr {
        RemoteMr {
            rkey: self.info.rkey,
            addr: self.info.addr,
            len: self.info.len,
        }
    }

    /// The local buffer `len` bytes at `offset`, for a work request.
    pub fn sge(&self, offset: u64, len: u32) -> Result<Sge, ApiError> {
        match offset.checked_add(u64::from(len)) {
            Some(end) if end <= self.info.len => Ok(Sge {
                lkey: self.info.lkey,
                addr: self.info.addr + offset,
                len,
            }),
            _ => Err(ApiError::OutOfBounds {
                offset,
                len: u64::from(len),
                size: self.info.len,
            }),
        }
    }

    /// A copy of `len` bytes at `offset` (see the module documentation for
    /// when they are final). Issued when called, in order with the other
    /// data-path calls; the future waits for the bytes.
    pub fn read(
        &self,
        offset: u64,
        len: usize,
    ) -> impl Future<Output = Result<Vec<u8>, ApiError>> + Send + 'static {
        let lkey = self.info.lkey;
        self.dev.issue(move |reply| Command::ReadMr {
            lkey,
            offset,
            len,
            reply,
        })
    }

    /// Copies `data` into the region at `offset`. Issued when called, in
    /// order with the other data-path calls: a SEND or WRITE posted after
    /// it, even before this future is awaited, carries the new bytes.
    pub fn write(
        &self,
        offset: u64,
        data: impl Into<Vec<u8>>,
    ) -> impl Future<Output = Result<(), ApiError>> + Send + 'static {
        let (lkey, data) = (self.info.lkey, data.into());
        self.dev.issue(move |reply| Command::WriteMr {
            lkey,
            offset,
            data,
            reply,
        })
    }

    /// Lends the region's bytes to the application, to fill or read in
    /// place, without a copy: the guard derefs to them, and dropping it
    /// gives them back (in order with the data-path calls issued after
    /// the drop, so a SEND posted right after carries what was written).
    ///
    /// While the guard lives the region's keys stay, and nothing else may
    /// use its bytes: it borrows this `MemoryRegion` (no [`sge`](Self::sge),
    /// [`read`](Self::read) or [`write`](Self::write) meanwhile), a post
    /// that names the region with an earlier [`Sge`] is refused with
    /// [`VerbsError::MrLent`], and a peer's WRITE or READ of it fails with
    /// `RemoteAccessError`, which fails the peer's QP, as if the region were
    /// deregistered. So lend a region registered for local access only, or
    /// one the application knows no peer accesses at the time (its
    /// protocol says so: a WRITE_IMM or SEND after the peer's last WRITE).
    ///
    /// Waits while the driver still sends from the region (microseconds);
    /// fails with [`VerbsError::MrInUse`] while posted requests or a peer's
    /// READ response reference it: await their completions first.
    ///
    /// ```no_run
    /// # async fn demo(pd: metaroce_io::ProtectionDomain, qp: metaroce_io::QueuePair) -> Result<(), metaroce_io::ApiError> {
    /// use metaroce_io::{AccessFlags, RegionBuf};
    /// let mut mr = pd.reg_mr(RegionBuf::zeroed(1 << 20), AccessFlags::LOCAL_WRITE).await?;
    /// {
    ///     let mut bytes = mr.lend().await?;
    ///     bytes.fill(7); // in place: no copy, no allocation
    /// } // back to the endpoint here
    /// qp.send(mr.sge(0, 1 << 20)?).await?;
    /// let received = qp.recv(mr.sge(0, 1 << 20)?).await?;
    /// let bytes = mr.lend().await?;
    /// let n = received.byte_len as usize;
    /// println!("got {n} bytes: {:?}", &bytes[..n.min(16)]);
    /// # Ok(()) }
    /// ```
    pub async fn lend(&mut self) -> Result<LentRegion<'_>, ApiError> {
        let lkey = self.info.lkey;
        let buf = self.dev.call(|r| Command::LendMr(lkey, r)).await?;
        Ok(LentRegion {
            mr: self,
            buf: Some(buf),
        })
    }

    /// Deregisters the region and gives its buffer back (an owner given to
    /// [`ProtectionDomain::reg_mr_owned`] comes back through
    /// [`RegionBuf::into_owner`]; raw memory, through a buffer that frees
    /// nothing). Fails with [`VerbsError::MrInUse`] (and keeps the region)
    /// while posted requests or a peer's READ response still use it; waits
    /// while the driver still sends from it (microseconds).
    ///
    /// ```no_run
    /// # async fn demo(pd: metaroce_io::ProtectionDomain) -> Result<(), metaroce_io::ApiError> {
    /// use metaroce_io::AccessFlags;
    /// let mr = pd.reg_mr_owned(vec![1u8; 4096], AccessFlags::NONE).await?;
    /// let v: Vec<u8> = mr.dereg().await?.into_owner().unwrap();
    /// assert_eq!(v.len(), 4096);
    /// # Ok(()) }
    /// ```
    pub async fn dereg(mut self) -> Result<RegionBuf, ApiError> {
        let lkey = self.info.lkey;
        let buf = self.dev.call(|r| Command::DeregMr(lkey, r)).await;
        if buf.is_ok() {
            self.live = false;
        }
        buf
    }
}

/// The bytes of a [`MemoryRegion`] lent to the application
/// ([`MemoryRegion::lend`]): a `[u8]` to read and write in place. Dropping
/// it gives them back to the endpoint.
///
/// ```no_run
/// # async fn demo(mut mr: metaroce_io::MemoryRegion) -> Result<(), metaroce_io::ApiError> {
/// let bytes = mr.lend().await?;
/// let zeros = bytes.iter().filter(|&&b| b == 0).count();
/// drop(bytes); // the region is usable again
/// println!("{zeros} zero bytes of {}", mr.len());
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct LentRegion<'a> {
    mr: &'a mut MemoryRegion,
    /// `Some` until dropped.
    buf: Option<RegionBuf>,
}

impl std::ops::Deref for LentRegion<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.buf.as_deref().unwrap_or(&[])
    }
}

impl std::ops::DerefMut for LentRegion<'_> {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.buf.as_deref_mut().unwrap_or(&mut [])
    }
}

impl Drop for LentRegion<'_> {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            // A stopped endpoint thread drops the bytes with the command.
            self.mr.dev.send(Command::ReturnMr(self.mr.info.lkey, buf));
        }
    }
}

/// Completions waiting for the application, filled by the endpoint thread.
#[derive(Debug, Default)]
struct CqSink {
    queue: Mutex<VecDeque<WorkCompletion>>,
    ready: Notify,
    /// The endpoint thread has stopped: nothing more will come.
    closed: std::sync::atomic::AtomicBool,
}

impl CqSink {
    fn close(&self) {
        self.closed
            .store(true, std::sync::atomic::Ordering::Release);
        self.ready.notify_one();
    }

    /// Moves every completion of `wcs` to the queue (leaving `wcs` empty,
    /// its capacity kept for the next batch); drops them once the queue's
    /// handle is gone (closed).
    fn push(&self, wcs: &mut Vec<WorkCompletion>) {
        if self.closed.load(std::sync::atomic::Ordering::Acquire) {
            wcs.clear();
            return;
        }
        self.queue
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend(wcs.drain(..));
        self.ready.notify_one();
    }
}

/// A completion queue (`ibv_cq`): where requests posted with
/// [`QueuePair::post_send`] and [`QueuePair::post_recv`] complete, with the
/// caller's `wr_id`, in the order the transport completes them (per QP in
/// posting order, as RC requires).
#[derive(Debug)]
pub struct CompletionQueue {
    dev: Device,
    cq: CqHandle,
    sink: Arc<CqSink>,
}

impl CompletionQueue {
    /// The device the queue belongs to.
    pub fn device(&self) -> &Device {
        &self.dev
    }

    /// Takes up to `max` completions that are ready, without waiting
    /// (`ibv_poll_cq`), into a new vector; [`poll_into`](Self::poll_into)
    /// reuses one.
    pub fn poll(&self, max: usize) -> Vec<WorkCompletion> {
        let mut out = Vec::new();
        self.poll_into(max, &mut out);
        out
    }

    /// Appends up to `max` completions that are ready to `out`, without
    /// waiting and without allocating once `out` has room (`ibv_poll_cq`
    /// into the caller's array); returns how many.
    ///
    /// ```no_run
    /// # fn demo(cq: &metaroce_io::CompletionQueue) {
    /// let mut wcs = Vec::with_capacity(64);
    /// loop {
    ///     wcs.clear();
    ///     if cq.poll_into(64, &mut wcs) == 0 {
    ///         break;
    ///     }
    ///     for wc in &wcs {
    ///         println!("{} {:?}", wc.wr_id, wc.status);
    ///     }
    /// }
    /// # }
    /// ```
    pub fn poll_into(&self, max: usize, out: &mut Vec<WorkCompletion>) -> usize {
        let mut q = self.sink.queue.lock().unwrap_or_else(|e| e.into_inner());
        let n = max.min(q.len());
        out.extend(q.drain(..n));
        n
    }

    /// Waits for the next completion.
    pub async fn next(&self) -> Result<WorkCompletion, ApiError> {
        loop {
            if let Some(wc) = self
                .sink
                .queue
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .pop_front()
            {
                return Ok(wc);
            }
            if self.sink.closed.load(std::sync::atomic::Ordering::Acquire) {
                return Err(ApiError::Closed);
            }
            self.sink.ready.notified().await;
        }
    }
}

/// A reliable-connected queue pair (`ibv_qp`, RC).
///
/// The one-request calls ([`write`](Self::write), [`read`](Self::read),
/// [`send`](Self::send), [`recv`](Self::recv), …) post at once, when
/// called, in call order, and return a [`WorkRequest`] future of the
/// completion: post many, then await them (their completions come in
/// posting order).
#[derive(Debug)]
pub struct QueuePair {
    dev: Device,
    qpn: Qpn,
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        self.dev.send(Command::DestroyQp(self.qpn));
    }
}

impl Drop for CompletionQueue {
    /// Destroys the queue once no QP completes to it (the endpoint holds
    /// it until then, dropping what still completes to it).
    fn drop(&mut self) {
        self.dev.send(Command::DestroyCq(self.cq));
    }
}

/// The completion of one posted work request: `Ok` with the completion if
/// it succeeded, [`ApiError::Failed`] with it if not, or the post's own
/// refusal.
#[derive(Debug)]
#[must_use = "a work request's outcome is only known by awaiting it"]
pub struct WorkRequest {
    wr_id: u64,
    rx: oneshot::Receiver<Result<WorkCompletion, ApiError>>,
}

impl WorkRequest {
    /// The request's `wr_id`, given by the device (counting from 1, one
    /// sequence per [`Device`]): its completion, and an
    /// [`ApiError::Failed`], carry the same.
    ///
    /// ```no_run
    /// # async fn demo(qp: metaroce_io::QueuePair, sge: metaroce_io::Sge) {
    /// let req = qp.send(sge);
    /// let id = req.wr_id();
    /// match req.await {
    ///     Ok(wc) => assert_eq!(wc.wr_id, id),
    ///     Err(metaroce_io::ApiError::Failed(wc)) => assert_eq!(wc.wr_id, id),
    ///     Err(e) => eprintln!("not posted: {e}"),
    /// }
    /// # }
    /// ```
    pub fn wr_id(&self) -> u64 {
        self.wr_id
    }
}

impl Future for WorkRequest {
    type Output = Result<WorkCompletion, ApiError>;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        Pin::new(&mut self.rx).poll(cx).map(|r| match r {
            Ok(Ok(wc)) if wc.status == WcStatus::Success => Ok(wc),
            Ok(Ok(wc)) => Err(ApiError::Failed(wc)),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(ApiError::Closed),
        })
    }
}

impl QueuePair {
    /// The QP number.
    pub fn qpn(&self) -> Qpn {
        self.qpn
    }

    /// What the peer needs to connect its QP to this one.
    pub fn endpoint(&self) -> QpEndpoint {
        QpEndpoint {
            addr: self.dev.local_addr(),
            qpn: self.qpn.0,
        }
    }

    /// Where the QP's state machine stands.
    pub async fn state(&self) -> Result<Option<QpState>, ApiError> {
        let q = self.qpn;
        self.dev.call(|r| Command::QpState(q, r)).await
    }

    /// Binds the QP to `conn` and the peer's QP `remote`, and brings it to
    /// RTS (RESET→INIT→RTR→RTS with every remote access the regions allow)
    /// with the default attributes ([`RcAttrs::default`]); see
    /// [`connect_with`](Self::connect_with).
    pub async fn connect(&self, conn: &Connection, remote: Qpn) -> Result<(), ApiError> {
        self.connect_with(conn, remote, RcAttrs::default()).await
    }

    /// Binds the QP to `conn` and the peer's QP `remote`, and brings it to
    /// RTS with the RC attributes `attrs`, as `ibv_modify_qp` does through
    /// INIT, RTR and RTS: the remote access the QP allows, `retry_cnt` and
    /// `timeout` (how soon a request that stops making progress, the peer's
    /// QP gone say, fails with [`WcStatus::RetryExceeded`]), `rnr_retry`
    /// (how many times a SEND the peer had no receive for is retried before
    /// it fails with [`WcStatus::RnrRetryExceeded`]; 7 is forever),
    /// `min_rnr_timer`, and the READ depths.
    ///
    /// Fails with [`VerbsError::InvalidAttribute`] for a value out of range,
    /// [`VerbsError::InvalidConnection`] for a connection of another
    /// [`Device`] (or one closed), and [`VerbsError::IllegalTransition`] if
    /// the QP is connected already.
    ///
    /// ```no_run
    /// # async fn demo(qp: metaroce_io::QueuePair, conn: metaroce_io::Connection, peer: metaroce_io::QpEndpoint) -> Result<(), metaroce_io::ApiError> {
    /// use metaroce_io::RcAttrs;
    /// use std::time::Duration;
    /// // A request-response service that would rather fail fast than wait.
    /// let attrs = RcAttrs {
    ///     rnr_retry: 0,
    ///     retry_cnt: Some(2),
    ///     timeout: Some(Duration::from_millis(5)),
    ///     ..RcAttrs::default()
    /// };
    /// qp.connect_with(&conn, peer.qpn(), attrs).await?;
    /// # Ok(()) }
    /// ```
    pub async fn connect_with(
        &self,
        conn: &Connection,
        remote: Qpn,
        attrs: RcAttrs,
    ) -> Result<(), ApiError> {
        if !self.dev.same(&conn.dev) {
            return Err(VerbsError::InvalidConnection.into());
        }
        let (qpn, conn) = (self.qpn, conn.conn);
        self.dev
            .call(|reply| Command::ConnectQp {
                qpn,
                conn,
                remote,
                attrs,
                reply,
            })
            .await
    }

    fn post(&self, op: SendOp, local: SgList) -> WorkRequest {
        let (tx, rx) = oneshot::channel();
        let wr_id = self.dev.next_wr_id();
        let wr = SendWr::new(wr_id, op, local);
        self.dev
            .send(Command::PostSend(self.qpn, wr, Dest::Once(tx)));
        WorkRequest { wr_id, rx }
    }

    /// RDMA WRITE of `local` (one [`Sge`], or an [`SgList`] gathered in
    /// order) to `remote`.
    ///
    /// A request with more elements than the QP's `max_send_sge`
    /// ([`QpCaps`]) is refused with [`VerbsError::TooManySge`].
    ///
    /// ```no_run
    /// # async fn demo(qp: metaroce_io::QueuePair, a: metaroce_io::MemoryRegion, b: metaroce_io::MemoryRegion, remote: metaroce_io::RemoteAddr) -> Result<(), metaroce_io::ApiError> {
    /// use metaroce_io::SgList;
    /// // A header from one region and a body from another, as one message.
    /// let list = SgList::try_from(&[a.sge(0, 64)?, b.sge(0, 4096)?][..])?;
    /// let wc = qp.write(list, remote).await?;
    /// assert_eq!(wc.byte_len, 4160);
    /// # Ok(()) }
    /// ```
    pub fn write(&self, local: impl Into<SgList>, remote: RemoteAddr) -> WorkRequest {
        self.post(SendOp::Write(remote), local.into())
    }

    /// RDMA WRITE with immediate data: also consumes a receive at the peer,
    /// which completes with `imm` once every byte is placed.
    pub fn write_imm(&self, local: impl Into<SgList>, remote: RemoteAddr, imm: u32) -> WorkRequest {
        self.post(SendOp::WriteImm(remote, imm), local.into())
    }

    /// RDMA READ of as many bytes as `local` holds, at `remote`, into
    /// `local` (one [`Sge`], or an [`SgList`] filled in order); its regions
    /// need `LOCAL_WRITE`.
    pub fn read(&self, local: impl Into<SgList>, remote: RemoteAddr) -> WorkRequest {
        self.post(SendOp::Read(remote), local.into())
    }

    /// SEND of `local` (one [`Sge`], or an [`SgList`] gathered in order)
    /// into the peer's next posted receive.
    pub fn send(&self, local: impl Into<SgList>) -> WorkRequest {
        self.post(SendOp::Send, local.into())
    }

    /// SEND with immediate data.
    pub fn send_imm(&self, local: impl Into<SgList>, imm: u32) -> WorkRequest {
        self.post(SendOp::SendImm(imm), local.into())
    }

    /// Posts a receive into `sge` (one [`Sge`], or an [`SgList`] filled in
    /// order, at most the QP's `max_recv_sge` elements); the future
    /// completes when a SEND (or a WRITE with immediate) consumed it
    /// (`byte_len`, `imm`). A SEND longer than the elements together fails
    /// it with [`WcStatus::LocalLengthError`] (and the sender's with
    /// [`WcStatus::RemoteInvalidRequest`]).
    ///
    /// ```no_run
    /// # async fn demo(qp: metaroce_io::QueuePair, hdr: metaroce_io::MemoryRegion, body: metaroce_io::MemoryRegion) -> Result<(), metaroce_io::ApiError> {
    /// use metaroce_io::SgList;
    /// // The first 64 bytes of the message into `hdr`, the rest into `body`.
    /// let list = SgList::try_from(&[hdr.sge(0, 64)?, body.sge(0, 1 << 20)?][..])?;
    /// let wc = qp.recv(list).await?;
    /// println!("{} bytes", wc.byte_len);
    /// # Ok(()) }
    /// ```
    pub fn recv(&self, sge: impl Into<SgList>) -> WorkRequest {
        let (tx, rx) = oneshot::channel();
        let wr_id = self.dev.next_wr_id();
        let wr = RecvWr::new(wr_id, sge);
        self.dev
            .send(Command::PostRecv(self.qpn, wr, Dest::Once(tx)));
        WorkRequest { wr_id, rx }
    }

    /// Posts a send request whose completion goes to the send CQ, with
    /// `wr.wr_id` (`ibv_post_send`). As in verbs, a request with
    /// `signaled: false` that succeeds leaves no completion: it is done once
    /// a later signaled request of this QP completes (post one now and
    /// then, or the send queue fills); a failed one always completes.
    /// Resolves when the endpoint accepted (or refused) it.
    pub fn post_send(&self, wr: SendWr) -> impl Future<Output = Result<(), ApiError>> {
        let (tx, rx) = oneshot::channel();
        self.dev.send(Command::PostSend(self.qpn, wr, Dest::Cq(tx)));
        answer(rx)
    }

    /// Posts a send request now, on the calling thread, as `ibv_post_send`
    /// does: the answer is the endpoint's, and the completion goes to the
    /// send CQ as with [`post_send`](Self::post_send) (`signaled`
    /// honoured). No command is queued and nothing is allocated: for a
    /// progress loop that posts and polls itself. For a device of
    /// [`Device::open_polled`] only (others answer
    /// [`ApiError::NotPolled`]); it waits while another thread takes a turn
    /// of the endpoint. The request goes out at the next
    /// [`Device::progress`]. Errors are those of
    /// [`post_send_batch`](Self::post_send_batch)'s requests, as
    /// [`ApiError::Verbs`].
    ///
    /// ```no_run
    /// # fn demo(dev: metaroce_io::Device, qp: metaroce_io::QueuePair, cq: metaroce_io::CompletionQueue, mr: metaroce_io::MemoryRegion) -> Result<(), metaroce_io::ApiError> {
    /// use metaroce_io::{SendOp, SendWr};
    /// qp.post_send_now(SendWr::new(7, SendOp::Send, mr.sge(0, 64)?))?;
    /// let mut wcs = Vec::with_capacity(16);
    /// while wcs.is_empty() {
    ///     dev.progress();
    ///     cq.poll_into(16, &mut wcs);
    /// }
    /// assert_eq!(wcs[0].wr_id, 7);
    /// # Ok(()) }
    /// ```
    pub fn post_send_now(&self, wr: SendWr) -> Result<(), ApiError> {
        let qpn = self.qpn;
        self.dev.polled()?.with_worker(|w| {
            let now = w.now();
            w.post_send_to_cq(now, qpn, wr).map_err(Into::into)
        })
    }

    /// Posts a receive now, on the calling thread, as `ibv_post_recv`
    /// does: as [`post_send_now`](Self::post_send_now) for the receive
    /// queue, the completion to the receive CQ as with
    /// [`post_recv`](Self::post_recv). Errors are those of
    /// [`post_recv_batch`](Self::post_recv_batch)'s requests, as
    /// [`ApiError::Verbs`].
    ///
    /// ```no_run
    /// # fn demo(qp: metaroce_io::QueuePair, mr: metaroce_io::MemoryRegion) -> Result<(), metaroce_io::ApiError> {
    /// use metaroce_io::RecvWr;
    /// qp.post_recv_now(RecvWr::new(3, mr.sge(0, 4096)?))?;
    /// # Ok(()) }
    /// ```
    pub fn post_recv_now(&self, wr: RecvWr) -> Result<(), ApiError> {
        let qpn = self.qpn;
        self.dev
            .polled()?
            .with_worker(|w| w.post_recv_to_cq(qpn, wr).map_err(Into::into))
    }

    /// Posts send requests in order, as one chain (`ibv_post_send` with a
    /// linked list of work requests): one command and one wake of the
    /// endpoint thread for all of them. Completions go to the send CQ as
    /// with [`post_send`](Self::post_send) (`signaled` honoured). If one
    /// is refused, those before it stay posted and the rest are dropped:
    /// [`ApiError::BatchRefused`] says how many were posted.
    ///
    /// ```no_run
    /// # async fn demo(qp: metaroce_io::QueuePair, mr: metaroce_io::MemoryRegion) -> Result<(), metaroce_io::ApiError> {
    /// use metaroce_io::{SendOp, SendWr};
    /// // 16 SENDs of 4 KiB, only the last one signaled.
    /// let wrs = (0..16u64).map(|i| SendWr {
    ///     signaled: i == 15,
    ///     ..SendWr::new(i, SendOp::Send, mr.sge(i * 4096, 4096).unwrap())
    /// });
    /// qp.post_send_batch(wrs).await?;
    /// # Ok(()) }
    /// ```
    pub fn post_send_batch(
        &self,
        wrs: impl IntoIterator<Item = SendWr>,
    ) -> impl Future<Output = Result<(), ApiError>> {
        let wrs = wrs.into_iter().collect();
        let (tx, rx) = oneshot::channel();
        self.dev.send(Command::PostSendBatch(self.qpn, wrs, tx));
        answer(rx)
    }

    /// Posts a receive whose completion goes to the receive CQ (`ibv_post_recv`).
    pub fn post_recv(&self, wr: RecvWr) -> impl Future<Output = Result<(), ApiError>> {
        let (tx, rx) = oneshot::channel();
        self.dev.send(Command::PostRecv(self.qpn, wr, Dest::Cq(tx)));
        answer(rx)
    }

    /// Posts receives in order, as one chain (`ibv_post_recv` with a
    /// linked list of work requests): one command and one wake of the
    /// endpoint thread for all of them. Incoming SENDs (and WRITEs with
    /// immediate) consume them in this order, and they complete in the
    /// receive CQ with their `wr_id`s, as with [`post_recv`](Self::post_recv).
    ///
    /// If one is refused, those before it stay posted and the rest are
    /// dropped: [`ApiError::BatchRefused`] says how many were posted and
    /// why the next was refused — [`VerbsError::QueueFull`] beyond the
    /// QP's `max_recv_wr` ([`QpCaps`]), [`VerbsError::InvalidKey`],
    /// [`VerbsError::AccessDenied`] (a region without `LOCAL_WRITE`),
    /// [`VerbsError::OtherPd`], [`VerbsError::OutsideRegion`] or
    /// [`VerbsError::MrLent`] for one of its buffers,
    /// [`VerbsError::TooManySge`] beyond the QP's `max_recv_sge`, [`VerbsError::InvalidState`]
    /// for a QP that takes no receives yet (RESET). A QP in ERROR takes
    /// them, and each completes at once with [`WcStatus::WrFlushError`],
    /// as in verbs.
    ///
    /// ```no_run
    /// # async fn demo(qp: metaroce_io::QueuePair, mr: metaroce_io::MemoryRegion) -> Result<(), metaroce_io::ApiError> {
    /// use metaroce_io::RecvWr;
    /// // 64 receives of 4 KiB, side by side in one region.
    /// let wrs = (0..64u64).map(|i| RecvWr::new(i, mr.sge(i * 4096, 4096).unwrap()));
    /// qp.post_recv_batch(wrs).await?;
    /// # Ok(()) }
    /// ```
    pub fn post_recv_batch(
        &self,
        wrs: impl IntoIterator<Item = RecvWr>,
    ) -> impl Future<Output = Result<(), ApiError>> {
        let wrs = wrs.into_iter().collect();
        let (tx, rx) = oneshot::channel();
        self.dev.send(Command::PostRecvBatch(self.qpn, wrs, tx));
        answer(rx)
    }
}
