//! The plugin's one implementation, which every exported ABI version calls.
//!
//! # Connections
//!
//! Each plugin device has one [`Device`] on a free UDP port of the
//! device's address, opened on first use and shared by all its comms. By
//! default it is a polled device ([`Device::open_polled`]): NCCL's proxy
//! thread drives it in each `test`, `isend` and `irecv` (a turn of the
//! endpoint on the calling thread, no other thread woken), and its endpoint
//! thread takes over while they are not called (`METAROCE_PROGRESS`).
//! `listen` opens a TCP listener beside it and returns a handle naming
//! both. `connect` (on the peer) and `accept` each start a thread that sets
//! the comm up while NCCL keeps calling them (they return a NULL comm until
//! it is ready, as NCCL expects): each side makes a QP, they trade QP
//! numbers, endpoint addresses and eager limits over TCP (as NCCL's IB
//! transport does), and both bring their QPs to RTS on the one connection
//! between the two endpoints, which carries the QPs of every comm between
//! them both ways: the endpoint with the lower address opens it (or reuses
//! the one it has), the other waits for it. A last byte each way says the
//! comm is ready. One QP carries one direction: send comm to receive comm.
//!
//! # Messages
//!
//! Receiver-driven, as NCCL's IB transport, except for small messages.
//! Every message of a comm has a sequence number among the comm's messages
//! of its tag, and every buffer an `irecv` posts one among the buffers of
//! its tag; message *k* of a tag fills buffer *k* of that tag. A receive
//! comm keeps 32 receives posted, into bounce buffers of the eager size
//! (`METAROCE_EAGER_BYTES`, the smaller of the two sides'); every message
//! consumes one, in order.
//!
//! - A message up to the eager size goes at once, a SEND with its tag as
//!   immediate data, whether or not its buffer is posted yet: no
//!   announcement travels before it. The receiver copies it from the
//!   bounce buffer into NCCL's buffer, or, if the `irecv` has not come yet,
//!   keeps it (copied aside, 64 at most, then in its bounce buffer; the
//!   sender waits, RNR, when all 32 are taken) until it comes. As `irecv`s
//!   take copies, held messages are copied aside in their place and their
//!   bounce buffers posted again.
//! - A larger message waits for its buffer to be announced: `irecv` SENDs
//!   the peer a *clear-to-send* naming the group (an id) and, per buffer
//!   that may take a message too large to come eagerly, its tag, sequence
//!   number, remote key, address and size. The send comm keeps a ring of
//!   receives for these. `isend` RDMA-WRITEs the message from NCCL's
//!   registered buffer into the announced one, with immediate data naming
//!   the group and the buffer: no byte copied on either side (see
//!   `memory`). An `isend` whose buffer is not announced yet returns a NULL
//!   request, and NCCL calls it again.
//!
//! Buffers that only take eager messages are announced too if no message
//! filled them within 1 ms, so that a sender with a message too large for
//! them learns their size and fails instead of waiting; a message longer
//! than its buffer is refused (by the sender, or by the receiver for an
//! eager one). The clear-to-send bytes come from the peer and are checked
//! (size, counts, id, index) before use; a WRITE can only reach the
//! regions this side registered for receiving, inside their bounds.
//!
//! # Requests
//!
//! Each comm's QP has a send and a receive completion queue. On a polled
//! device a post goes to the endpoint on the calling thread
//! (`QueuePair::post_send_now`), answered at once, nothing allocated; with
//! the endpoint thread driving, it is handed over and its answer taken at
//! the next post or `test`. A send request is its number among the QP's
//! sends: RC completes them in posting order, so the count of completions
//! says which are done. Receives complete in posting order too, each
//! naming its buffer in its `wr_id`. `test` takes what the CQs have, and a
//! turn of a polled endpoint if nothing was there.

use crate::abi::NCCL_NET_MAX_REQUESTS;
use crate::config::{Config, DeviceSpec, Progress};
use crate::error::NetError;
use crate::memory::{block_on, AppRegion, EMPTY_SGE};
use metaroce_io::{
    AccessFlags, ApiError, CompletionQueue, Connection, Device, MemoryRegion, ProtectionDomain,
    QpCaps, QueuePair, RcAttrs, RecvWr, RegionBuf, RemoteAddr, SendOp, SendWr, Sge, WcOpcode,
    WcStatus, WorkCompletion,
};
use rustc_hash::FxHashMap;
use smallvec::SmallVec;
use std::collections::{HashMap, VecDeque};
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Most buffers of one grouped receive (`maxRecvs`).
pub const MAX_RECVS: usize = 8;
/// Largest message (`maxP2pBytes`): NCCL's own `MAX_NET_SIZE`, 1 GiB.
pub const MAX_MESSAGE: usize = 1 << 30;

const HANDLE_MAGIC: &[u8; 4] = b"MRNC";
const HELLO_MAGIC: u32 = 0x4d52_4e48; // "MRNH"
const WIRE_VERSION: u8 = 2;
/// Where `connect` keeps its progress in the handle (NCCL passes the same
/// handle memory to every call of one connection).
const HANDLE_STATE: usize = 64;

/// The plugin's state after `init`.
pub(crate) struct Plugin {
    pub(crate) cfg: Config,
    /// Device names, NUL-terminated, for `getProperties`.
    pub(crate) names: Vec<std::ffi::CString>,
}

static PLUGIN: OnceLock<Plugin> = OnceLock::new();
static SALT: AtomicU64 = AtomicU64::new(1);
static PENDING: Mutex<Option<HashMap<u64, Pending<SendComm>>>> = Mutex::new(None);

/// Reads the configuration once; later calls (NCCL inits the plugin per
/// communicator) find it there.
pub(crate) fn init() -> Result<&'static Plugin, NetError> {
    if let Some(p) = PLUGIN.get() {
        return Ok(p);
    }
    let cfg = Config::from_env()?;
    let names = cfg
        .devices
        .iter()
        .map(|d| std::ffi::CString::new(d.name.clone()).unwrap_or_default())
        .collect();
    let p = PLUGIN.get_or_init(|| Plugin { cfg, names });
    crate::log::info(
        line!(),
        &format!(
            "{} device(s): {}",
            p.cfg.devices.len(),
            p.cfg
                .devices
                .iter()
                .map(|d| d.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    );
    Ok(p)
}

/// The plugin, once `init` ran.
pub(crate) fn plugin() -> Result<&'static Plugin, NetError> {
    PLUGIN.get().ok_or(NetError::NotInitialized)
}

fn device_node(dev: i32) -> Result<(&'static Plugin, Arc<Node>), NetError> {
    let p = plugin()?;
    let (i, spec) = usize::try_from(dev)
        .ok()
        .and_then(|i| p.cfg.devices.get(i).map(|s| (i, s)))
        .ok_or_else(|| NetError::InvalidArgument(format!("no device {dev}")))?;
    Ok((p, node(p, i, spec)?))
}

/// One plugin device's endpoint, shared by all its comms, and the
/// connections to each peer endpoint: the one this side opened (its send
/// comms' QPs) and the one the peer opened (its receive comms' QPs).
struct Node {
    dev: Device,
    outgoing: Mutex<HashMap<SocketAddr, Connection>>,
    incoming: Mutex<HashMap<SocketAddr, Connection>>,
    arrived: Condvar,
}

static NODES: Mutex<Vec<Option<Arc<Node>>>> = Mutex::new(Vec::new());

/// The endpoint of device `dev`, opened on first use, with a thread that
/// takes the connections peers open to it.
fn node(p: &Plugin, dev: usize, spec: &DeviceSpec) -> Result<Arc<Node>, NetError> {
    let mut nodes = NODES.lock().unwrap_or_else(|e| e.into_inner());
    if nodes.len() <= dev {
        nodes.resize(dev + 1, None);
    }
    if let Some(n) = &nodes[dev] {
        return Ok(n.clone());
    }
    let salt = SALT.fetch_add(1, Ordering::Relaxed) ^ u64::from(std::process::id()) << 20;
    let cfg = p.cfg.driver(spec, salt);
    let d = match p.cfg.progress {
        Progress::Caller => block_on(Device::open_polled(cfg))?,
        Progress::Thread => block_on(Device::open(cfg))?,
    };
    let n = Arc::new(Node {
        dev: d,
        outgoing: Mutex::new(HashMap::new()),
        incoming: Mutex::new(HashMap::new()),
        arrived: Condvar::new(),
    });
    let taker = n.clone();
    std::thread::Builder::new()
        .name("metaroce-incoming".into())
        .spawn(move || {
            while let Ok(c) = block_on(taker.dev.accept()) {
                // A peer endpoint opens one connection to us at a time; a
                // new one replaces one it lost.
                taker
                    .incoming
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(c.peer(), c);
                taker.arrived.notify_all();
            }
        })?;
    nodes[dev] = Some(n.clone());
    crate::log::info(
        line!(),
        &format!("device {dev}: endpoint on {}", n.dev.local_addr()),
    );
    Ok(n)
}

fn established(c: &Connection) -> bool {
    matches!(
        block_on(c.state()),
        Ok(Some(metaroce_io::ConnectionState::Established))
    )
}

impl Node {
    /// The connection this side opened to `peer`, opened now if there is
    /// none (or it failed).
    fn outgoing(&self, peer: SocketAddr, deadline: Instant) -> Result<Connection, NetError> {
        let mut out = self.outgoing.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = out.get(&peer) {
            if established(c) {
                return Ok(c.clone());
            }
        }
        let c = block_on(with_deadline(deadline, self.dev.connect(peer)))??;
        out.insert(peer, c.clone());
        Ok(c)
    }

    /// The connection `peer` opened to this side, once it is there.
    fn incoming(&self, peer: SocketAddr, deadline: Instant) -> Result<Connection, NetError> {
        let mut inc = self.incoming.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            // One that failed is replaced when the peer opens a new one.
            if let Some(c) = inc.get(&peer).filter(|c| established(c)) {
                return Ok(c.clone());
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(NetError::Remote(format!(
                    "no connection from {peer} in time (its own error says why; \
                     with METAROCE_PSK_FILE, both sides need the same key)"
                )));
            }
            inc = self
                .arrived
                .wait_timeout(inc, (deadline - now).min(Duration::from_millis(10)))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// The one connection between this endpoint (`me`) and the endpoint
    /// `peer`, which carries the QPs of every comm between the two, both
    /// ways: the endpoint with the lower address opens it (or reuses the
    /// one it has), the other waits for it. So a message and the
    /// acknowledgement of one that came the other way share a datagram.
    fn shared(
        &self,
        me: SocketAddr,
        peer: SocketAddr,
        deadline: Instant,
    ) -> Result<Connection, NetError> {
        if me < peer {
            self.outgoing(peer, deadline)
        } else {
            self.incoming(peer, deadline)
        }
    }
}

/// The opaque handle `listen` fills and NCCL carries to the peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Handle {
    tcp: SocketAddr,
    udp: SocketAddr,
    nonce: u64,
}

fn put_addr(b: &mut [u8], a: SocketAddr) {
    // 20 bytes: family, pad, port, 16 address bytes.
    b[0] = if a.is_ipv4() { 4 } else { 6 };
    b[2..4].copy_from_slice(&a.port().to_le_bytes());
    match a.ip() {
        IpAddr::V4(v4) => b[4..8].copy_from_slice(&v4.octets()),
        IpAddr::V6(v6) => b[4..20].copy_from_slice(&v6.octets()),
    }
}

fn get_addr(b: &[u8]) -> Option<SocketAddr> {
    let port = u16::from_le_bytes([b[2], b[3]]);
    let ip = match b[0] {
        4 => IpAddr::V4(Ipv4Addr::new(b[4], b[5], b[6], b[7])),
        6 => IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(&b[4..20]).ok()?)),
        _ => return None,
    };
    Some(SocketAddr::new(ip, port))
}

impl Handle {
    fn write(&self, b: &mut [u8; crate::abi::NCCL_NET_HANDLE_MAXSIZE]) {
        b.fill(0);
        b[0..4].copy_from_slice(HANDLE_MAGIC);
        b[4] = WIRE_VERSION;
        put_addr(&mut b[8..28], self.tcp);
        put_addr(&mut b[28..48], self.udp);
        b[48..56].copy_from_slice(&self.nonce.to_le_bytes());
    }

    fn read(b: &[u8; crate::abi::NCCL_NET_HANDLE_MAXSIZE]) -> Result<Handle, NetError> {
        let bad = || NetError::InvalidArgument("not a metaroce handle".into());
        if &b[0..4] != HANDLE_MAGIC || b[4] != WIRE_VERSION {
            return Err(bad());
        }
        Ok(Handle {
            tcp: get_addr(&b[8..28]).ok_or_else(bad)?,
            udp: get_addr(&b[28..48]).ok_or_else(bad)?,
            nonce: u64::from_le_bytes(b[48..56].try_into().map_err(|_| bad())?),
        })
    }
}

fn fresh_nonce() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(SALT.fetch_add(1, Ordering::Relaxed));
    h.write_u32(std::process::id());
    h.finish() | 1
}

/// The QP side of one comm; fields drop in order (QP, CQs, ...). The
/// connection and the endpoint are shared with the device's other comms.
struct Link {
    qp: QueuePair,
    /// The QP's sends and their completions (shared with the requests).
    sends: Arc<Mutex<SendLog>>,
    /// Where its receives complete.
    recv_cq: CompletionQueue,
    /// Posts to a device driven by its own thread, whose answers have not
    /// come yet (a refusal surfaces at the next post or `test`).
    unanswered: Mutex<VecDeque<PostAnswer>>,
    conn: Connection,
    node: Arc<Node>,
}

/// The endpoint thread's answer to a post.
type PostAnswer = std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), ApiError>> + Send>>;

/// A QP not yet connected, with its PD and completion queues.
type Opened = (ProtectionDomain, [CompletionQueue; 2], QueuePair);

impl Link {
    /// The device's endpoint.
    fn dev(&self) -> &Device {
        &self.node.dev
    }

    /// A PD, CQs (send, receive) and QP on the device's endpoint, not yet
    /// connected.
    fn open(node: &Node) -> Result<Opened, NetError> {
        let dev = &node.dev;
        let pd = block_on(dev.alloc_pd())?;
        let depth = (NCCL_NET_MAX_REQUESTS * MAX_RECVS) as u32;
        let send_cq = block_on(dev.create_cq(depth as usize))?;
        let recv_cq = block_on(dev.create_cq(depth as usize))?;
        let caps = QpCaps {
            max_send_wr: depth,
            max_recv_wr: depth,
            ..QpCaps::default()
        };
        let qp = block_on(pd.create_qp_with(&send_cq, &recv_cq, caps))?;
        Ok((pd, [send_cq, recv_cq], qp))
    }

    fn new(opened: ([CompletionQueue; 2], QueuePair), conn: Connection, node: Arc<Node>) -> Link {
        let ([cq, recv_cq], qp) = opened;
        let sends = SendLog {
            cq,
            next: 0,
            completed: 0,
            failed: None,
            scratch: Vec::with_capacity(64),
        };
        Link {
            qp,
            sends: Arc::new(Mutex::new(sends)),
            recv_cq,
            unanswered: Mutex::new(VecDeque::new()),
            conn,
            node,
        }
    }

    /// Keeps the answer to a post made through the endpoint thread, and
    /// takes the answers that came: a refusal is an error now.
    fn answered_later(&self, f: Option<PostAnswer>) -> Result<(), NetError> {
        let mut q = self.unanswered.lock().unwrap_or_else(|e| e.into_inner());
        q.extend(f);
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        while let Some(f) = q.front_mut() {
            match f.as_mut().poll(&mut cx) {
                std::task::Poll::Ready(r) => {
                    q.pop_front();
                    r?;
                }
                std::task::Poll::Pending => break,
            }
        }
        Ok(())
    }

    /// Posts a send of `local`; its number among the QP's sends
    /// ([`SendLog`]). On a polled device it is posted on the caller's
    /// thread (no allocation, no command queued), else handed to the
    /// endpoint thread, its answer taken later.
    fn post_send(&self, op: SendOp, local: Sge) -> Result<u64, NetError> {
        let mut log = self.sends.lock().unwrap_or_else(|e| e.into_inner());
        let wr = SendWr::new(log.next, op, local);
        if self.dev().is_polled() {
            self.qp.post_send_now(wr)?;
        } else {
            self.answered_later(Some(Box::pin(self.qp.post_send(wr))))?;
        }
        log.next += 1;
        Ok(log.next - 1)
    }

    /// The outcome of send `id`, if known (taking what its CQ has).
    fn send_outcome(&self, id: u64) -> Option<Result<(), NetError>> {
        if let Err(e) = self.answered_later(None) {
            return Some(Err(e));
        }
        let mut log = self.sends.lock().unwrap_or_else(|e| e.into_inner());
        log.take();
        log.outcome(id)
    }

    /// Posts a receive, its completion to `recv_cq`, as
    /// [`post_send`](Self::post_send).
    fn post_recv(&self, wr: RecvWr) -> Result<(), NetError> {
        if self.dev().is_polled() {
            self.qp.post_recv_now(wr)?;
        } else {
            self.answered_later(Some(Box::pin(self.qp.post_recv(wr))))?;
        }
        Ok(())
    }
}

/// Takes every completion of `cq` into `out` (emptied first); whether
/// there were any.
fn drain(cq: &CompletionQueue, out: &mut Vec<WorkCompletion>) -> bool {
    out.clear();
    while cq.poll_into(64, out) != 0 {}
    !out.is_empty()
}

/// The buffer of a receive that completed, `posted` the buffers of the
/// receives posted (each one's `wr_id`), oldest first: receives complete
/// in posting order.
fn in_order(wc: &WorkCompletion, posted: &mut VecDeque<usize>) -> Result<usize, NetError> {
    succeeded(wc)?;
    let buf = wc.wr_id as usize;
    if posted.pop_front() != Some(buf) {
        return Err(NetError::Remote(format!(
            "the receive into buffer {buf} completed out of order"
        )));
    }
    Ok(buf)
}

/// A completion's status as a result.
fn succeeded(wc: &WorkCompletion) -> Result<(), NetError> {
    if wc.status == WcStatus::Success {
        Ok(())
    } else {
        Err(ApiError::Failed(*wc).into())
    }
}

/// Which comm a `regMr` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Side {
    /// A send comm: its regions are only read, by this side.
    Send,
    /// A receive comm: the peer WRITEs into its regions.
    Recv,
}

/// What both comms start with (both are `#[repr(C)]`), so that `regMr`,
/// given either as a `void *`, finds the protection domain.
#[repr(C)]
pub(crate) struct CommHead {
    side: Side,
    pd: ProtectionDomain,
}

impl CommHead {
    /// Registers NCCL's `len` bytes at `data` with the comm, in place.
    ///
    /// # Safety
    /// NCCL's buffer under NCCL's contract ([`AppRegion::register`]).
    pub(crate) unsafe fn reg_mr(&self, data: *mut u8, len: usize) -> Result<AppRegion, NetError> {
        let access = match self.side {
            Side::Send => AccessFlags::NONE,
            Side::Recv => AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
        };
        // SAFETY: the caller's promise.
        unsafe { AppRegion::register(&self.pd, data, len, access) }
    }
}

/// The comm head of a send or receive comm.
///
/// # Safety
/// `comm` is a send comm `connect` made or a receive comm `accept` made,
/// not closed.
pub(crate) unsafe fn comm_head<'a>(comm: *mut std::ffi::c_void) -> &'a CommHead {
    // SAFETY: both comms are `#[repr(C)]` with a `CommHead` first.
    unsafe { &*(comm as *const CommHead) }
}

fn rc_attrs() -> RcAttrs {
    RcAttrs {
        // A receiver that has not posted yet makes the SEND wait, forever.
        rnr_retry: 7,
        ..RcAttrs::default()
    }
}

/// A set-up running on a thread of its own.
struct Pending<T> {
    rx: mpsc::Receiver<Result<T, NetError>>,
}

impl<T> Pending<T> {
    fn spawn(
        name: &str,
        f: impl FnOnce() -> Result<T, NetError> + Send + 'static,
    ) -> Result<Self, NetError>
    where
        T: Send + 'static,
    {
        let (tx, rx) = mpsc::channel();
        std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                let _ = tx.send(f());
            })?;
        Ok(Pending { rx })
    }

    /// `Some` once the set-up finished.
    fn poll(&self) -> Option<Result<T, NetError>> {
        match self.rx.try_recv() {
            Ok(r) => Some(r),
            Err(mpsc::TryRecvError::Empty) => None,
            Err(mpsc::TryRecvError::Disconnected) => {
                Some(Err(NetError::Remote("the set-up thread ended".into())))
            }
        }
    }
}

/// A listen comm.
pub(crate) struct ListenComm {
    stop: Arc<AtomicBool>,
    pending: Pending<RecvComm>,
}

impl Drop for ListenComm {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// The set-up message each side sends the other over TCP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Hello {
    qpn: u32,
    /// Its endpoint's address.
    endpoint: SocketAddr,
    /// The largest message it sends or takes eagerly (both sides use the
    /// smaller of the two).
    eager: u32,
}

const HELLO_LEN: usize = 40;

/// The bytes of `h` for the handle's nonce.
fn hello(nonce: u64, h: Hello) -> [u8; HELLO_LEN] {
    let mut b = [0u8; HELLO_LEN];
    b[0..4].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
    b[4..12].copy_from_slice(&nonce.to_le_bytes());
    b[12..16].copy_from_slice(&h.qpn.to_le_bytes());
    put_addr(&mut b[16..36], h.endpoint);
    b[36..40].copy_from_slice(&h.eager.to_le_bytes());
    b
}

/// The set-up's one-byte "ready" from the peer. A peer that closes the
/// set-up instead failed on its side (a connection it could not open, a
/// key it was refused): said so, rather than as a short read.
fn read_ready(s: &mut TcpStream) -> Result<(), NetError> {
    let mut ready = [0u8; 1];
    match s.read_exact(&mut ready) {
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Err(NetError::Remote(
            "the peer ended the set-up before its side was ready: its own error says why \
             (with METAROCE_PSK_FILE, both sides need the same key)"
                .into(),
        )),
        r => Ok(r?),
    }
}

fn read_hello(s: &mut TcpStream, nonce: u64) -> Result<Hello, NetError> {
    let mut b = [0u8; HELLO_LEN];
    s.read_exact(&mut b)?;
    let magic = u32::from_le_bytes(b[0..4].try_into().unwrap_or_default());
    let their = u64::from_le_bytes(b[4..12].try_into().unwrap_or_default());
    if magic != HELLO_MAGIC || their != nonce {
        return Err(NetError::Remote(
            "set-up message with a wrong magic or nonce".into(),
        ));
    }
    let qpn = u32::from_le_bytes(b[12..16].try_into().unwrap_or_default());
    let endpoint = get_addr(&b[16..36])
        .ok_or_else(|| NetError::Remote("set-up message with a bad address".into()))?;
    let eager = u32::from_le_bytes(b[36..40].try_into().unwrap_or_default());
    Ok(Hello {
        qpn,
        endpoint,
        eager,
    })
}

/// `listen`: fills `handle`, returns the listen comm.
pub(crate) fn listen(
    dev: i32,
    handle: &mut [u8; crate::abi::NCCL_NET_HANDLE_MAXSIZE],
) -> Result<Box<ListenComm>, NetError> {
    let (p, node) = device_node(dev)?;
    let tcp = TcpListener::bind(SocketAddr::new(node.dev.local_addr().ip(), 0))?;
    tcp.set_nonblocking(true)?;
    let h = Handle {
        tcp: tcp.local_addr()?,
        udp: node.dev.local_addr(),
        nonce: fresh_nonce(),
    };
    h.write(handle);
    let stop = Arc::new(AtomicBool::new(false));
    let stopped = stop.clone();
    let timeout = p.cfg.connect_timeout;
    let eager_bytes = p.cfg.eager_bytes as u32;
    let pending = Pending::spawn("metaroce-accept", move || {
        // Wait for the peer's TCP connection as long as the comm lives.
        let mut s = loop {
            match tcp.accept() {
                Ok((s, _)) => break s,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if stopped.load(Ordering::Relaxed) {
                        return Err(NetError::Remote("listen comm closed".into()));
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(e) => return Err(e.into()),
            }
        };
        s.set_nonblocking(false)?;
        s.set_read_timeout(Some(timeout))?;
        s.set_nodelay(true)?;
        let theirs = read_hello(&mut s, h.nonce)?;
        let (pd, cqs, qp) = Link::open(&node)?;
        let ours = Hello {
            qpn: qp.qpn().0,
            endpoint: node.dev.local_addr(),
            eager: eager_bytes,
        };
        s.write_all(&hello(h.nonce, ours))?;
        // The peer has its side of the connection between us (it opened
        // it, or waits for it), then says so.
        read_ready(&mut s)?;
        let conn = node.shared(ours.endpoint, theirs.endpoint, Instant::now() + timeout)?;
        block_on(qp.connect_with(&conn, metaroce_io::Qpn(theirs.qpn), rc_attrs()))?;
        // The receives the first messages consume are posted before the
        // peer may send.
        let comm = RecvComm::new(
            pd,
            Link::new((cqs, qp), conn, node),
            ours.eager.min(theirs.eager) as usize,
        )?;
        s.write_all(&[1])?;
        Ok(comm)
    })?;
    Ok(Box::new(ListenComm { stop, pending }))
}

/// Waits until `f` has an answer, on a thread that drives the endpoint
/// meanwhile (on a polled device; elsewhere `progress` does nothing and
/// this only waits).
fn wait_driving<T>(dev: &Device, mut f: impl FnMut() -> Option<T>) -> T {
    loop {
        if let Some(v) = f() {
            return v;
        }
        if !dev.progress() {
            std::thread::yield_now();
        }
    }
}

/// Awaits `f` until `deadline` (a timer thread wakes the waiter).
async fn with_deadline<F: std::future::Future>(
    deadline: Instant,
    f: F,
) -> Result<F::Output, NetError> {
    let mut f = std::pin::pin!(f);
    std::future::poll_fn(|cx| {
        if let std::task::Poll::Ready(v) = f.as_mut().poll(cx) {
            return std::task::Poll::Ready(Ok(v));
        }
        let now = Instant::now();
        if now >= deadline {
            return std::task::Poll::Ready(Err(NetError::Remote(
                "the peer did not connect in time".into(),
            )));
        }
        let w = cx.waker().clone();
        let wait = (deadline - now).min(Duration::from_millis(50));
        std::thread::spawn(move || {
            std::thread::sleep(wait);
            w.wake();
        });
        std::task::Poll::Pending
    })
    .await
}

/// `accept`: `Some` once the connection is ready.
pub(crate) fn accept(l: &mut ListenComm) -> Result<Option<Box<RecvComm>>, NetError> {
    match l.pending.poll() {
        None => Ok(None),
        Some(r) => r.map(|c| Some(Box::new(c))),
    }
}

/// `connect`: `Some` once the connection is ready; keeps its progress in
/// `handle`.
pub(crate) fn connect(
    dev: i32,
    handle: &mut [u8; crate::abi::NCCL_NET_HANDLE_MAXSIZE],
) -> Result<Option<Box<SendComm>>, NetError> {
    let state = u64::from_le_bytes(
        handle[HANDLE_STATE..HANDLE_STATE + 8]
            .try_into()
            .unwrap_or_default(),
    );
    let mut map = PENDING.lock().unwrap_or_else(|e| e.into_inner());
    let map = map.get_or_insert_with(HashMap::new);
    if state == 0 {
        let (p, node) = device_node(dev)?;
        let h = Handle::read(handle)?;
        let id = fresh_nonce();
        let timeout = p.cfg.connect_timeout;
        let eager_bytes = p.cfg.eager_bytes as u32;
        let pending = Pending::spawn("metaroce-connect", move || {
            let (pd, cqs, qp) = Link::open(&node)?;
            let mut s = TcpStream::connect_timeout(&h.tcp, timeout)?;
            s.set_read_timeout(Some(timeout))?;
            s.set_nodelay(true)?;
            let ours = Hello {
                qpn: qp.qpn().0,
                endpoint: node.dev.local_addr(),
                eager: eager_bytes,
            };
            s.write_all(&hello(h.nonce, ours))?;
            let theirs = read_hello(&mut s, h.nonce)?;
            let deadline = Instant::now() + timeout;
            let conn = if ours.endpoint < theirs.endpoint {
                let c = node.shared(ours.endpoint, theirs.endpoint, deadline)?;
                s.write_all(&[1])?;
                c
            } else {
                // The peer opens it once it reads this.
                s.write_all(&[1])?;
                node.shared(ours.endpoint, theirs.endpoint, deadline)?
            };
            block_on(qp.connect_with(&conn, metaroce_io::Qpn(theirs.qpn), rc_attrs()))?;
            let comm = SendComm::new(
                pd,
                Link::new((cqs, qp), conn, node),
                ours.eager.min(theirs.eager) as usize,
            )?;
            // The peer's QP is connected and its receives are posted:
            // sends may start.
            read_ready(&mut s)?;
            Ok(comm)
        })?;
        map.insert(id, pending);
        handle[HANDLE_STATE..HANDLE_STATE + 8].copy_from_slice(&id.to_le_bytes());
        return Ok(None);
    }
    let Some(pending) = map.get(&state) else {
        return Err(NetError::InvalidArgument(
            "connect with a handle already used".into(),
        ));
    };
    match pending.poll() {
        None => Ok(None),
        Some(r) => {
            map.remove(&state);
            r.map(|c| Some(Box::new(c)))
        }
    }
}

/// Clear-to-send messages in flight per comm: a ring of this many slots on
/// each side (at most `NCCL_NET_MAX_REQUESTS` receives are outstanding).
const CTS_RING: usize = 2 * NCCL_NET_MAX_REQUESTS;
/// A clear-to-send message: group id (4), buffer count (1), 3 bytes of
/// padding, then per buffer its tag (4), remote key (4), address (8), size
/// (4), sequence number among the comm's buffers of its tag (4), index in
/// the group (1) and 3 bytes of padding.
const CTS_HEAD: usize = 8;
const CTS_ENTRY: usize = 28;
const CTS_BYTES: usize = CTS_HEAD + MAX_RECVS * CTS_ENTRY;
/// A group id fits in the immediate data beside the buffer's index.
const ID_MASK: u32 = u32::MAX >> 3;
/// Receives each receive comm keeps posted: every message, eager or
/// written, consumes one; an eager one lands in its bounce buffer.
const BOUNCE_RECVS: usize = 32;
/// Eager messages a receive comm copies aside while no `irecv` is posted
/// for them; past this many it keeps them in their bounce buffers (and the
/// sender waits, RNR, once all are taken).
const STASH_MAX: usize = 64;
/// How long a posted receive whose buffers all take eager messages waits
/// for them before it is announced after all: a sender with a message too
/// large for such a buffer then learns its size and fails, instead of
/// waiting for an announcement forever.
const ANNOUNCE_LATE: Duration = Duration::from_millis(1);
/// `progress` calls between two readings of the clock for late
/// announcements (a polling caller makes one every few microseconds).
const LATE_CHECK_POLLS: u32 = 16;

/// The next sequence number of `tag` in `seqs`, counted on.
fn next_seq<S: std::hash::BuildHasher>(seqs: &mut HashMap<i32, u32, S>, tag: i32) -> u32 {
    let next = seqs.entry(tag).or_insert(0);
    let seq = *next;
    *next = seq.wrapping_add(1);
    seq
}

/// Whether sequence number `a` comes before `b` (they wrap).
fn seq_before(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) < 0
}

/// One buffer of a receive, as announced to the sender.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct CtsSlot {
    tag: i32,
    rkey: u32,
    addr: u64,
    size: u32,
    /// Its place among the comm's buffers of this tag.
    seq: u32,
    /// Its index in the group.
    index: u8,
}

/// A receive (group) announced to the sender: the buffers a WRITE may
/// fill.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Cts {
    id: u32,
    slots: Vec<CtsSlot>,
}

impl Cts {
    fn encode(&self, b: &mut [u8; CTS_BYTES]) -> usize {
        b[..CTS_HEAD].fill(0);
        b[0..4].copy_from_slice(&self.id.to_le_bytes());
        b[4] = self.slots.len() as u8;
        for (i, s) in self.slots.iter().enumerate() {
            let e = &mut b[CTS_HEAD + i * CTS_ENTRY..CTS_HEAD + (i + 1) * CTS_ENTRY];
            e[0..4].copy_from_slice(&s.tag.to_le_bytes());
            e[4..8].copy_from_slice(&s.rkey.to_le_bytes());
            e[8..16].copy_from_slice(&s.addr.to_le_bytes());
            e[16..20].copy_from_slice(&s.size.to_le_bytes());
            e[20..24].copy_from_slice(&s.seq.to_le_bytes());
            e[24] = s.index;
            e[25..28].fill(0);
        }
        CTS_HEAD + self.slots.len() * CTS_ENTRY
    }

    /// Decodes a message from the peer (untrusted: refused unless well
    /// formed).
    fn decode(b: &[u8]) -> Result<Cts, NetError> {
        let bad = || NetError::Remote(format!("a malformed clear-to-send of {} bytes", b.len()));
        if b.len() < CTS_HEAD {
            return Err(bad());
        }
        let id = u32::from_le_bytes(b[0..4].try_into().map_err(|_| bad())?);
        let n = usize::from(b[4]);
        if id > ID_MASK || n == 0 || n > MAX_RECVS || b.len() != CTS_HEAD + n * CTS_ENTRY {
            return Err(bad());
        }
        let le4 = |x: &[u8]| <[u8; 4]>::try_from(x).map_err(|_| bad());
        let le8 = |x: &[u8]| <[u8; 8]>::try_from(x).map_err(|_| bad());
        let mut slots = Vec::with_capacity(n);
        for e in b[CTS_HEAD..].chunks_exact(CTS_ENTRY) {
            let size = u32::from_le_bytes(le4(&e[16..20])?);
            if size as usize > MAX_MESSAGE || usize::from(e[24]) >= MAX_RECVS {
                return Err(bad());
            }
            slots.push(CtsSlot {
                tag: i32::from_le_bytes(le4(&e[0..4])?),
                rkey: u32::from_le_bytes(le4(&e[4..8])?),
                addr: u64::from_le_bytes(le8(&e[8..16])?),
                size,
                seq: u32::from_le_bytes(le4(&e[20..24])?),
                index: e[24],
            });
        }
        Ok(Cts { id, slots })
    }
}

/// A buffer the peer announced, waiting for the message of its tag and
/// sequence number.
#[derive(Debug, Clone, Copy)]
struct Announced {
    rkey: u32,
    addr: u64,
    size: u32,
    /// The immediate data of the WRITE that fills it (group id, index).
    imm: u32,
}

/// A send comm.
#[repr(C)]
pub(crate) struct SendComm {
    head: CommHead,
    link: Arc<Link>,
    outstanding: Arc<AtomicU64>,
    /// Messages up to this size go eagerly (agreed with the peer).
    eager: usize,
    /// Where the peer's clear-to-send messages land, `CTS_RING` slots.
    fifo: MemoryRegion,
    /// The slots whose receives are posted, oldest first (receives
    /// complete in posting order; each one's `wr_id` is its slot).
    fifo_posted: VecDeque<usize>,
    /// Buffers the peer announced, by tag and sequence number.
    ready: HashMap<(i32, u32), Announced>,
    /// The sequence number of the next message of each tag (this side's
    /// tags: a fast hash).
    sent: FxHashMap<i32, u32>,
    /// Completions taken from the receive CQ (reused).
    scratch: Vec<WorkCompletion>,
}

/// What became of a QP's sends, numbered from 0 in posting order (their
/// `wr_id`s): RC completes them in that order, so a count says which are
/// done.
struct SendLog {
    /// The sends' completion queue.
    cq: CompletionQueue,
    /// The number of the next send.
    next: u64,
    /// The sends numbered below this completed.
    completed: u64,
    /// The first send that failed (those after it fail too: the QP is in
    /// ERROR).
    failed: Option<WorkCompletion>,
    /// Completions taken from the CQ (reused).
    scratch: Vec<WorkCompletion>,
}

impl SendLog {
    /// Takes the completions that came.
    fn take(&mut self) {
        if !drain(&self.cq, &mut self.scratch) {
            return;
        }
        for wc in &self.scratch {
            if wc.status == WcStatus::Success {
                self.completed = self.completed.max(wc.wr_id + 1);
            } else if self.failed.is_none() {
                self.failed = Some(*wc);
            }
        }
    }

    /// Send `seq`'s outcome, if it is known.
    fn outcome(&self, seq: u64) -> Option<Result<(), NetError>> {
        if seq < self.completed {
            return Some(Ok(()));
        }
        let f = self.failed.filter(|f| f.wr_id <= seq)?;
        Some(succeeded(&WorkCompletion { wr_id: seq, ..f }))
    }
}

impl SendComm {
    fn new(pd: ProtectionDomain, link: Link, eager: usize) -> Result<SendComm, NetError> {
        let fifo = block_on(pd.reg_mr(
            RegionBuf::zeroed(CTS_RING * CTS_BYTES),
            AccessFlags::LOCAL_WRITE,
        ))?;
        let mut fifo_posted = VecDeque::with_capacity(CTS_RING);
        for slot in 0..CTS_RING {
            let sge = fifo.sge((slot * CTS_BYTES) as u64, CTS_BYTES as u32)?;
            link.post_recv(RecvWr::new(slot as u64, sge))?;
            fifo_posted.push_back(slot);
        }
        Ok(SendComm {
            head: CommHead {
                side: Side::Send,
                pd,
            },
            link: Arc::new(link),
            outstanding: Arc::new(AtomicU64::new(0)),
            eager,
            fifo,
            fifo_posted,
            ready: HashMap::new(),
            sent: FxHashMap::default(),
            scratch: Vec::with_capacity(64),
        })
    }

    /// The device the comm's endpoint runs on.
    pub(crate) fn device(&self) -> Device {
        self.link.dev().clone()
    }

    /// A log line with the counters of the comm's connection (shared with
    /// the device's other send comms to the same peer), at close.
    pub(crate) fn log_close(&self) {
        if let Ok(Some(st)) = block_on(self.link.conn.stats()) {
            crate::log::info(
                line!(),
                &format!(
                    "send comm to {} closed; its connection: {} data packets sent, {} retransmits, {} RTO fires",
                    self.link.conn.peer(),
                    st.data_packets_sent,
                    st.retransmits,
                    st.rto_fires
                ),
            );
        }
    }

    /// Takes the clear-to-send messages that came in, in order, and posts
    /// their receives again. A buffer announced for a message that already
    /// went eagerly is dropped.
    fn take_cts(&mut self) -> Result<(), NetError> {
        let mut wcs = std::mem::take(&mut self.scratch);
        drain(&self.link.recv_cq, &mut wcs);
        let r = wcs.iter().try_for_each(|wc| self.cts_in(wc));
        self.scratch = wcs;
        r
    }

    /// One clear-to-send message in, its slot's receive posted again.
    fn cts_in(&mut self, wc: &WorkCompletion) -> Result<(), NetError> {
        let slot = in_order(wc, &mut self.fifo_posted)?;
        let off = slot * CTS_BYTES;
        let len = (wc.byte_len as usize).min(CTS_BYTES);
        // SAFETY: the receive into this slot completed, so its bytes are
        // final, and no transfer uses them until the receive is posted
        // again below, after they are decoded.
        let bytes = unsafe { std::slice::from_raw_parts(self.fifo.as_ptr().add(off), len) };
        let cts = Cts::decode(bytes)?;
        for c in cts.slots {
            let next = self.sent.get(&c.tag).copied().unwrap_or(0);
            if seq_before(c.seq, next) {
                continue;
            }
            let a = Announced {
                rkey: c.rkey,
                addr: c.addr,
                size: c.size,
                imm: cts.id << 3 | u32::from(c.index),
            };
            if self.ready.insert((c.tag, c.seq), a).is_some() {
                return Err(NetError::Remote(format!(
                    "buffer {} of tag {} announced twice",
                    c.seq, c.tag
                )));
            }
        }
        let sge = self.fifo.sge(off as u64, CTS_BYTES as u32)?;
        self.link.post_recv(RecvWr::new(slot as u64, sge))?;
        self.fifo_posted.push_back(slot);
        Ok(())
    }

    /// `isend`: `None` when NCCL should try again later (too many sends in
    /// flight, or a message too large to go eagerly whose buffer the peer
    /// has not announced yet).
    pub(crate) fn isend(
        &mut self,
        data: *const u8,
        size: usize,
        tag: i32,
        mr: &AppRegion,
    ) -> Result<Option<Box<Request>>, NetError> {
        if size > MAX_MESSAGE {
            return Err(NetError::InvalidArgument(format!("isend of {size} bytes")));
        }
        let local = mr.sge(data, size)?;
        if self.outstanding.load(Ordering::Relaxed) >= NCCL_NET_MAX_REQUESTS as u64 {
            return Ok(None);
        }
        let seq = self.sent.get(&tag).copied().unwrap_or(0);
        let op = if size <= self.eager {
            // Eager: into the next bounce receive the peer keeps posted,
            // announced or not; the tag rides in the immediate data.
            self.take_cts()?;
            self.ready.remove(&(tag, seq));
            SendOp::SendImm(tag as u32)
        } else {
            // The buffer the peer announced for this message; if it has
            // not come in yet, a turn of the endpoint (on a polled device)
            // may bring it.
            let mut found = None;
            for turn in [false, true] {
                if turn && !self.link.dev().progress() {
                    break;
                }
                self.take_cts()?;
                found = self.ready.remove(&(tag, seq));
                if found.is_some() {
                    break;
                }
            }
            let Some(a) = found else {
                return Ok(None);
            };
            if size as u64 > u64::from(a.size) {
                return Err(NetError::InvalidArgument(format!(
                    "isend of {size} bytes for tag {tag}: the peer's buffer holds {}",
                    a.size
                )));
            }
            let remote = RemoteAddr {
                rkey: a.rkey,
                addr: a.addr,
            };
            SendOp::WriteImm(remote, a.imm)
        };
        let id = self.link.post_send(op, local)?;
        self.sent.insert(tag, seq.wrapping_add(1));
        self.outstanding.fetch_add(1, Ordering::Relaxed);
        // Out now, not at the next `test`.
        self.link.dev().progress();
        Ok(Some(Box::new(Request::Send(SendReq {
            id,
            size,
            link: self.link.clone(),
            outstanding: self.outstanding.clone(),
        }))))
    }
}

/// A send in flight.
pub(crate) struct SendReq {
    /// Its `wr_id`: its place among the comm's sends.
    id: u64,
    size: usize,
    /// The comm's QP and endpoint, which `test` drives.
    link: Arc<Link>,
    outstanding: Arc<AtomicU64>,
}

impl Drop for SendReq {
    fn drop(&mut self) {
        self.outstanding.fetch_sub(1, Ordering::Relaxed);
    }
}

/// One buffer of a posted receive.
struct Slot {
    /// NCCL's buffer (an address: the engine moves between threads).
    ptr: usize,
    cap: usize,
    tag: i32,
    seq: u32,
    /// Its remote key and address, for the announcement.
    rkey: u32,
    addr: u64,
    announced: bool,
    got: Option<usize>,
}

struct Group {
    id: u32,
    slots: SmallVec<[Slot; MAX_RECVS]>,
    remaining: usize,
    /// Whether buffers of it that take eager messages are not announced,
    /// and since when.
    quiet: Quiet,
}

/// How long a group's buffers that take eager messages have gone
/// unannounced. The clock is read for it once every `LATE_CHECK_POLLS`
/// `progress` calls, not per call: the first reading after the group went
/// quiet stamps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Quiet {
    /// Every buffer is filled or announced.
    No,
    /// Quiet, not stamped yet.
    Unstamped,
    /// Quiet at least since then.
    Since(Instant),
}

/// The sizes of a receive's buffers, or a send's size, for `test`.
pub(crate) type Sizes = SmallVec<[usize; MAX_RECVS]>;

/// An eager message that came before its `irecv`.
enum Stashed {
    /// Copied aside; its bounce buffer is posted again.
    Copied(Vec<u8>),
    /// Still in bounce buffer `idx` (the copies aside are full).
    Held { idx: usize, len: usize },
}

/// The receive side of one comm: the bounce receives every message
/// consumes, the groups waiting, eager messages waiting for their `irecv`,
/// the clear-to-send messages sent.
struct RecvEngine {
    /// Messages up to this size come eagerly (agreed with the peer).
    eager: usize,
    /// Bounce buffers, `BOUNCE_RECVS` of `eager` bytes.
    bounce: MemoryRegion,
    /// The buffers whose receives are posted, oldest first (receives
    /// complete in posting order; each one's `wr_id` is its buffer).
    posted: VecDeque<usize>,
    /// Bounce buffers whose messages were taken, to post again.
    freed: Vec<usize>,
    /// Completions taken from the receive CQ (reused).
    scratch: Vec<WorkCompletion>,
    groups: VecDeque<Group>,
    /// Receives done and not tested yet, by id (this side's ids: a fast
    /// hash; the maps keyed by what the peer sends keep the default one).
    done: FxHashMap<u32, Sizes>,
    /// `progress` calls since the clock was last read for `Quiet`.
    late_polls: u32,
    failed: Option<(crate::abi::NcclResult, String)>,
    next_id: u32,
    /// The sequence number of the next buffer posted, by tag.
    posted_seq: FxHashMap<i32, u32>,
    /// The sequence number of the next message to arrive, by tag.
    arrived_seq: HashMap<i32, u32>,
    stash: HashMap<(i32, u32), Stashed>,
    /// How many of `stash` are copied aside (at most `STASH_MAX`).
    copied: usize,
    /// Where clear-to-send messages are sent from, `CTS_RING` slots.
    cts: MemoryRegion,
    /// The SEND of each slot's last message (its number among the QP's
    /// sends).
    cts_sent: Vec<Option<u64>>,
}

impl RecvEngine {
    fn new(pd: &ProtectionDomain, link: &Link, eager: usize) -> Result<RecvEngine, NetError> {
        let cts = block_on(pd.reg_mr(RegionBuf::zeroed(CTS_RING * CTS_BYTES), AccessFlags::NONE))?;
        let bounce = block_on(pd.reg_mr(
            RegionBuf::zeroed(BOUNCE_RECVS * eager.max(1)),
            AccessFlags::LOCAL_WRITE,
        ))?;
        let mut e = RecvEngine {
            eager,
            bounce,
            posted: VecDeque::with_capacity(BOUNCE_RECVS),
            freed: Vec::with_capacity(BOUNCE_RECVS),
            scratch: Vec::with_capacity(BOUNCE_RECVS),
            groups: VecDeque::new(),
            done: FxHashMap::default(),
            late_polls: 0,
            failed: None,
            next_id: 0,
            posted_seq: FxHashMap::default(),
            arrived_seq: HashMap::new(),
            stash: HashMap::new(),
            copied: 0,
            cts,
            cts_sent: (0..CTS_RING).map(|_| None).collect(),
        };
        for idx in 0..BOUNCE_RECVS {
            e.post_bounce(link, idx)?;
        }
        Ok(e)
    }

    /// Posts bounce receive `idx` again at the next
    /// [`progress`](Self::progress): not on the way of the message that
    /// freed it to `test`.
    fn repost(&mut self, idx: usize) {
        self.freed.push(idx);
    }

    /// Posts the bounce receives freed since the last call.
    fn post_freed(&mut self, link: &Link) -> Result<(), NetError> {
        for k in 0..self.freed.len() {
            self.post_bounce(link, self.freed[k])?;
        }
        self.freed.clear();
        Ok(())
    }

    /// Posts bounce receive `idx`.
    fn post_bounce(&mut self, link: &Link, idx: usize) -> Result<(), NetError> {
        let sge = if self.eager == 0 {
            EMPTY_SGE
        } else {
            self.bounce
                .sge((idx * self.eager) as u64, self.eager as u32)?
        };
        link.post_recv(RecvWr::new(idx as u64, sge))?;
        self.posted.push_back(idx);
        Ok(())
    }

    /// Copies an eager message, `bytes`, into `slot`.
    fn place(slot: &mut Slot, bytes: &[u8]) -> Result<(), NetError> {
        if bytes.len() > slot.cap {
            return Err(NetError::Remote(format!(
                "a message of {} bytes for a buffer of {}",
                bytes.len(),
                slot.cap
            )));
        }
        if !bytes.is_empty() {
            // SAFETY: `slot.ptr` is NCCL's buffer of `slot.cap` bytes from
            // an `irecv` not reported done yet, which NCCL leaves alone
            // until then; `bytes` are a bounce buffer or a stash, which do
            // not overlap it.
            unsafe {
                std::ptr::copy_nonoverlapping(bytes.as_ptr(), slot.ptr as *mut u8, bytes.len())
            };
        }
        slot.got = Some(bytes.len());
        Ok(())
    }

    /// Bounce buffer `idx`'s first `len` bytes (borrowing only the bounce
    /// region, so that a slot of the engine's groups can take them).
    ///
    /// # Safety
    /// Its receive completed and it is not posted again while the slice
    /// lives.
    unsafe fn bounced(bounce: &MemoryRegion, eager: usize, idx: usize, len: usize) -> &[u8] {
        // SAFETY: the caller's promise; `len` is at most `eager`, checked
        // by the transport (the receive's buffer is that long).
        unsafe { std::slice::from_raw_parts(bounce.as_ptr().add(idx * eager), len) }
    }

    /// The group and buffer waiting for message `seq` of `tag`.
    fn find(&self, tag: i32, seq: u32) -> Option<(usize, usize)> {
        self.groups.iter().enumerate().find_map(|(gi, g)| {
            g.slots
                .iter()
                .position(|s| s.tag == tag && s.seq == seq && s.got.is_none())
                .map(|si| (gi, si))
        })
    }

    /// One buffer of group `gi` filled: the group is done once all are.
    fn filled(&mut self, gi: usize) {
        let g = &mut self.groups[gi];
        g.remaining -= 1;
        // Groups finish in any order; keep the finished ones for `test`.
        if g.remaining == 0 {
            let g = self.groups.remove(gi).unwrap_or_else(|| unreachable!());
            self.done
                .insert(g.id, g.slots.iter().map(|s| s.got.unwrap_or(0)).collect());
        }
    }

    /// Takes the messages that are in, in order: a WRITE with immediate
    /// names its group and buffer, an eager SEND its tag (it is the next
    /// message of that tag). Then announces the receives that waited too
    /// long for eager messages.
    fn progress(&mut self, link: &Link) -> Result<(), NetError> {
        link.answered_later(None)?;
        self.post_freed(link)?;
        let mut wcs = std::mem::take(&mut self.scratch);
        drain(&link.recv_cq, &mut wcs);
        let r = wcs.iter().try_for_each(|wc| self.message_in(wc));
        self.scratch = wcs;
        r?;
        if self.groups.iter().any(|g| g.quiet != Quiet::No) {
            self.late_polls += 1;
            if self.late_polls >= LATE_CHECK_POLLS {
                self.late_polls = 0;
                let now = Instant::now();
                let mut late = Vec::new();
                for g in &mut self.groups {
                    match g.quiet {
                        Quiet::Unstamped => g.quiet = Quiet::Since(now),
                        Quiet::Since(t) if now - t >= ANNOUNCE_LATE => late.push(g.id),
                        _ => {}
                    }
                }
                for id in late {
                    self.announce(link, id, false)?;
                }
            }
        }
        Ok(())
    }

    /// One message in (its bounce receive completed).
    fn message_in(&mut self, wc: &WorkCompletion) -> Result<(), NetError> {
        let idx = in_order(wc, &mut self.posted)?;
        let imm = wc
            .imm
            .ok_or_else(|| NetError::Remote("a message without immediate data".into()))?;
        let len = wc.byte_len as usize;
        if wc.opcode == WcOpcode::RecvRdmaWithImm {
            self.repost(idx);
            self.written(imm, len)
        } else {
            self.eager_in(idx, imm as i32, len)
        }
    }

    /// A WRITE with immediate `imm` placed `len` bytes.
    fn written(&mut self, imm: u32, len: usize) -> Result<(), NetError> {
        let (id, si) = (imm >> 3, (imm & 7) as usize);
        let gi = self
            .groups
            .iter()
            .position(|g| g.id == id)
            .ok_or_else(|| NetError::Remote(format!("a message for no receive ({imm:#x})")))?;
        let slot = self.groups[gi]
            .slots
            .get_mut(si)
            .filter(|s| s.got.is_none())
            .ok_or_else(|| NetError::Remote(format!("a message for no buffer ({imm:#x})")))?;
        if len > slot.cap {
            return Err(NetError::Remote(format!(
                "a message of {len} bytes for a buffer of {}",
                slot.cap
            )));
        }
        let next = self.arrived_seq.entry(slot.tag).or_insert(0);
        if *next != slot.seq {
            return Err(NetError::Remote(format!(
                "message {} of tag {} written where {} was due",
                slot.seq, slot.tag, *next
            )));
        }
        *next = slot.seq.wrapping_add(1);
        slot.got = Some(len);
        self.filled(gi);
        Ok(())
    }

    /// An eager message of `len` bytes of `tag` in bounce buffer `idx`.
    fn eager_in(&mut self, idx: usize, tag: i32, len: usize) -> Result<(), NetError> {
        if len > self.eager {
            return Err(NetError::Remote(format!(
                "an eager message of {len} bytes (at most {})",
                self.eager
            )));
        }
        let seq = next_seq(&mut self.arrived_seq, tag);
        match self.find(tag, seq) {
            Some((gi, si)) => {
                // SAFETY: the receive completed; the buffer is posted again
                // only after the copy (freed below, posted at the next
                // `progress`). The bounce region is not the
                // slot's memory (NCCL's), so the two do not overlap.
                let bytes = unsafe { Self::bounced(&self.bounce, self.eager, idx, len) };
                Self::place(&mut self.groups[gi].slots[si], bytes)?;
                self.filled(gi);
                self.repost(idx);
            }
            None => {
                let stashed = if self.copied < STASH_MAX {
                    // SAFETY: as above.
                    let bytes =
                        unsafe { Self::bounced(&self.bounce, self.eager, idx, len) }.to_vec();
                    self.repost(idx);
                    self.copied += 1;
                    Stashed::Copied(bytes)
                } else {
                    Stashed::Held { idx, len }
                };
                self.stash.insert((tag, seq), stashed);
            }
        }
        Ok(())
    }

    /// Copies messages held in their bounce buffers aside while the copies
    /// have room, and posts those buffers again. The copies make room when
    /// `irecv`s take them; a held message keeps its bounce receive, and a
    /// sender whose SENDs find none waits (RNR) until one is posted again,
    /// so without this it would wait for the held messages' own `irecv`s.
    fn release_held(&mut self) {
        // Every stashed message not copied aside is held.
        if self.copied >= STASH_MAX || self.stash.len() == self.copied {
            return;
        }
        let mut held: Vec<((i32, u32), usize, usize)> = self
            .stash
            .iter()
            .filter_map(|(&k, s)| match *s {
                Stashed::Held { idx, len } => Some((k, idx, len)),
                Stashed::Copied(_) => None,
            })
            .collect();
        // In the order of their buffers: the same arrivals post the same.
        held.sort_unstable_by_key(|&(_, idx, _)| idx);
        for (key, idx, len) in held.into_iter().take(STASH_MAX - self.copied) {
            // SAFETY: held since its receive completed; posted again only
            // after the copy (freed below, posted at the next `progress`).
            let bytes = unsafe { Self::bounced(&self.bounce, self.eager, idx, len) }.to_vec();
            self.stash.insert(key, Stashed::Copied(bytes));
            self.copied += 1;
            self.repost(idx);
        }
    }

    /// Sends the clear-to-send of group `id`: its buffers still empty and
    /// not announced, all of them or (`big_only`) those that may take a
    /// message too large to come eagerly.
    fn announce(&mut self, link: &Link, id: u32, big_only: bool) -> Result<(), NetError> {
        let eager = self.eager;
        let Some(g) = self.groups.iter_mut().find(|g| g.id == id) else {
            return Ok(());
        };
        let mut slots = Vec::new();
        for (i, s) in g.slots.iter_mut().enumerate() {
            if s.got.is_some() || s.announced || (big_only && s.cap <= eager) {
                continue;
            }
            s.announced = true;
            slots.push(CtsSlot {
                tag: s.tag,
                rkey: s.rkey,
                addr: s.addr,
                size: s.cap as u32,
                seq: s.seq,
                index: i as u8,
            });
        }
        let quiet = g.slots.iter().any(|s| s.got.is_none() && !s.announced);
        g.quiet = match (quiet, g.quiet) {
            (false, _) => Quiet::No,
            (true, Quiet::No) => Quiet::Unstamped,
            (true, q) => q,
        };
        if slots.is_empty() {
            return Ok(());
        }
        // Out of its ring slot once that slot's last message is through
        // (long ago: 2 * NCCL_NET_MAX_REQUESTS receives).
        let ring = id as usize % CTS_RING;
        if let Some(prev) = self.cts_sent[ring].take() {
            wait_driving(link.dev(), || link.send_outcome(prev))?;
        }
        let mut msg = [0u8; CTS_BYTES];
        let n = Cts { id, slots }.encode(&mut msg);
        let off = ring * CTS_BYTES;
        // SAFETY: the slot's bytes are in the region; the SEND that last
        // read them completed above, and no other transfer uses them.
        unsafe {
            std::ptr::copy_nonoverlapping(msg.as_ptr(), self.cts.as_mut_ptr().add(off), n);
        }
        let sge = self.cts.sge(off as u64, n as u32)?;
        self.cts_sent[ring] = Some(link.post_send(SendOp::Send, sge)?);
        Ok(())
    }
}

/// A receive comm.
#[repr(C)]
pub(crate) struct RecvComm {
    head: CommHead,
    link: Arc<Link>,
    engine: Arc<Mutex<RecvEngine>>,
}

impl RecvComm {
    fn new(pd: ProtectionDomain, link: Link, eager: usize) -> Result<RecvComm, NetError> {
        let engine = RecvEngine::new(&pd, &link, eager)?;
        Ok(RecvComm {
            head: CommHead {
                side: Side::Recv,
                pd,
            },
            link: Arc::new(link),
            engine: Arc::new(Mutex::new(engine)),
        })
    }

    /// The device the comm's endpoint runs on.
    pub(crate) fn device(&self) -> Device {
        self.link.dev().clone()
    }

    /// `irecv` of `bufs` (pointer, size, tag, region): `None` when NCCL
    /// should try again later.
    pub(crate) fn irecv(
        &mut self,
        bufs: &[(*mut u8, usize, i32, &AppRegion)],
    ) -> Result<Option<Box<Request>>, NetError> {
        if bufs.is_empty() || bufs.len() > MAX_RECVS {
            return Err(NetError::InvalidArgument(format!(
                "irecv of {} buffers (1 to {MAX_RECVS})",
                bufs.len()
            )));
        }
        let mut slots = SmallVec::<[Slot; MAX_RECVS]>::new();
        for &(ptr, size, tag, mr) in bufs {
            if size > MAX_MESSAGE {
                return Err(NetError::InvalidArgument(format!("irecv of {size} bytes")));
            }
            let (rkey, addr) = mr.remote(ptr, size)?;
            slots.push(Slot {
                ptr: ptr as usize,
                cap: size,
                tag,
                seq: 0,
                rkey,
                addr,
                announced: false,
                got: None,
            });
        }
        let mut eng = self.engine.lock().unwrap_or_else(|e| e.into_inner());
        let eng = &mut *eng;
        if eng.groups.len() + eng.done.len() >= NCCL_NET_MAX_REQUESTS {
            return Ok(None);
        }
        let id = eng.next_id;
        eng.next_id = (id + 1) & ID_MASK;
        let mut remaining = slots.len();
        for s in &mut slots {
            s.seq = next_seq(&mut eng.posted_seq, s.tag);
            // An eager message that came first.
            match eng.stash.remove(&(s.tag, s.seq)) {
                Some(Stashed::Copied(bytes)) => {
                    eng.copied -= 1;
                    RecvEngine::place(s, &bytes)?;
                    remaining -= 1;
                }
                Some(Stashed::Held { idx, len }) => {
                    // SAFETY: held since its receive completed; posted
                    // again only after the copy (freed below, posted at the
                    // next `progress`).
                    let bytes = unsafe { RecvEngine::bounced(&eng.bounce, eng.eager, idx, len) };
                    RecvEngine::place(s, bytes)?;
                    remaining -= 1;
                    eng.repost(idx);
                }
                None => {}
            }
        }
        eng.release_held();
        if remaining == 0 {
            eng.done
                .insert(id, slots.iter().map(|s| s.got.unwrap_or(0)).collect());
        } else {
            eng.groups.push_back(Group {
                id,
                slots,
                remaining,
                quiet: Quiet::No,
            });
            // The buffers a message too large to come eagerly may fill are
            // announced now (the announcement goes out at the next turn:
            // `test`, `isend`); the others only if no eager message filled
            // them in time.
            eng.announce(&self.link, id, true)?;
        }
        Ok(Some(Box::new(Request::Recv(RecvReq {
            engine: self.engine.clone(),
            link: self.link.clone(),
            id,
            n: bufs.len(),
        }))))
    }
}

/// A (grouped) receive in flight.
pub(crate) struct RecvReq {
    engine: Arc<Mutex<RecvEngine>>,
    /// The comm's QP and endpoint, which `test` drives.
    link: Arc<Link>,
    id: u32,
    n: usize,
}

/// A request `isend`/`irecv` returned, polled by `test`.
pub(crate) enum Request {
    /// A send.
    Send(SendReq),
    /// A receive of `n` buffers.
    Recv(RecvReq),
}

impl Request {
    /// `test`: the sizes once done (one per buffer of a receive).
    pub(crate) fn test(&mut self) -> Result<Option<Sizes>, NetError> {
        match self {
            Request::Send(s) => {
                // If not done, a turn of a polled endpoint may bring it.
                let mut r = s.link.send_outcome(s.id);
                if r.is_none() && s.link.dev().progress() {
                    r = s.link.send_outcome(s.id);
                }
                match r {
                    None => Ok(None),
                    Some(r) => {
                        r?;
                        Ok(Some(smallvec::smallvec![s.size]))
                    }
                }
            }
            Request::Recv(r) => {
                // If not done, a turn of a polled endpoint may bring it.
                for turn in [false, true] {
                    if turn && !r.link.dev().progress() {
                        break;
                    }
                    let mut eng = r.engine.lock().unwrap_or_else(|e| e.into_inner());
                    if let Some((code, msg)) = &eng.failed {
                        return Err(NetError::Remote(format!(
                            "receive comm failed earlier ({code}): {msg}"
                        )));
                    }
                    if let Err(e) = eng.progress(&r.link) {
                        eng.failed = Some((e.code(), e.to_string()));
                        return Err(e);
                    }
                    if let Some(sizes) = eng.done.remove(&r.id) {
                        debug_assert_eq!(sizes.len(), r.n);
                        return Ok(Some(sizes));
                    }
                }
                Ok(None)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::abi::NCCL_NET_HANDLE_MAXSIZE;

    #[test]
    fn handle_round_trips_and_refuses_foreign_bytes() {
        for (tcp, udp) in [
            ("10.0.0.1:4000", "10.0.0.1:5000"),
            ("[fe80::1]:4000", "[2001:db8::2]:65535"),
        ] {
            let h = Handle {
                tcp: tcp.parse().unwrap(),
                udp: udp.parse().unwrap(),
                nonce: 0x1234_5678_9abc_def1,
            };
            let mut b = [0xffu8; NCCL_NET_HANDLE_MAXSIZE];
            h.write(&mut b);
            assert_eq!(Handle::read(&b).unwrap(), h);
            // connect's progress lives past the fields, zero until used.
            assert!(b[HANDLE_STATE..].iter().all(|&x| x == 0));
        }
        let mut b = [0u8; NCCL_NET_HANDLE_MAXSIZE];
        assert!(matches!(
            Handle::read(&b),
            Err(NetError::InvalidArgument(_))
        ));
        b[0..4].copy_from_slice(HANDLE_MAGIC);
        b[4] = WIRE_VERSION;
        b[8] = 5; // neither IPv4 nor IPv6
        assert!(Handle::read(&b).is_err());
    }

    #[test]
    fn set_up_message_checks_magic_and_nonce() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let mut c = TcpStream::connect(addr).unwrap();
        let (mut s, _) = l.accept().unwrap();
        let h = Hello {
            qpn: 42,
            endpoint: "10.1.2.3:4792".parse().unwrap(),
            eager: 8192,
        };
        c.write_all(&hello(7, h)).unwrap();
        assert_eq!(read_hello(&mut s, 7).unwrap(), h);
        c.write_all(&hello(8, h)).unwrap();
        assert!(matches!(read_hello(&mut s, 7), Err(NetError::Remote(_))));
    }

    #[test]
    fn sequence_numbers_compare_across_the_wrap() {
        assert!(seq_before(1, 2));
        assert!(!seq_before(2, 2));
        assert!(!seq_before(3, 2));
        assert!(seq_before(u32::MAX, 0));
        assert!(!seq_before(0, u32::MAX));
    }

    #[test]
    fn clear_to_send_round_trips_and_refuses_malformed_bytes() {
        let c = Cts {
            id: ID_MASK,
            slots: (0..MAX_RECVS as i32)
                .map(|i| CtsSlot {
                    tag: -i,
                    rkey: 0xabcd_0000 + i as u32,
                    addr: 0x7f00_0000_0000 + i as u64 * 4096,
                    size: 1 << 30,
                    seq: u32::MAX - i as u32,
                    index: i as u8,
                })
                .collect(),
        };
        let mut b = [0u8; CTS_BYTES];
        let n = c.encode(&mut b);
        assert_eq!(n, CTS_BYTES);
        assert_eq!(Cts::decode(&b[..n]).unwrap(), c);
        // Short, long, no buffers, too many, an id past the mask.
        assert!(Cts::decode(&b[..n - 1]).is_err());
        assert!(Cts::decode(&b[..4]).is_err());
        let mut x = b;
        x[4] = 0;
        assert!(Cts::decode(&x[..CTS_HEAD]).is_err());
        x[4] = MAX_RECVS as u8 + 1;
        assert!(Cts::decode(&x).is_err());
        let mut x = b;
        x[3] = 0xff;
        assert!(Cts::decode(&x).is_err());
        // A buffer index past the group, a size past the largest message.
        let mut x = b;
        x[CTS_HEAD + 24] = MAX_RECVS as u8;
        assert!(Cts::decode(&x).is_err());
        let mut x = b;
        x[CTS_HEAD + 16..CTS_HEAD + 20].copy_from_slice(&(MAX_MESSAGE as u32 + 1).to_le_bytes());
        assert!(Cts::decode(&x).is_err());
        let one = Cts {
            id: 3,
            slots: c.slots[..1].to_vec(),
        };
        let n = one.encode(&mut b);
        assert_eq!(n, CTS_HEAD + CTS_ENTRY);
        assert_eq!(Cts::decode(&b[..n]).unwrap(), one);
    }
}
