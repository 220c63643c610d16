//! The plugin's one implementation, which every exported ABI version calls.
//!
//! # Connections
//!
//! Each plugin device has one [`Device`] (an endpoint thread on a free UDP
//! port of the device's address), opened on first use and shared by all its
//! comms. `listen` opens a TCP listener beside it and returns a handle
//! naming both. `connect` (on the peer) and `accept` each start a thread that
//! sets the comm up while NCCL keeps calling them (they return a NULL comm
//! until it is ready, as NCCL expects): each side makes a QP, they trade QP
//! numbers and endpoint addresses over TCP (as NCCL's IB transport does),
//! the connecting side opens its connection to the peer endpoint (or reuses
//! the one it has: one per peer endpoint and direction, carrying the QPs of
//! every comm between them), both QPs are brought to RTS, and a last byte
//! each way says so. One QP carries one direction: send comm to receive
//! comm.
//!
//! # Messages
//!
//! Receiver-driven, as NCCL's IB transport: `irecv` posts one empty
//! receive per buffer of the group, then SENDs the peer a *clear-to-send*
//! naming the group (an id) and, per buffer, its tag, remote key, address
//! and size. The send comm keeps a ring of receives for these messages.
//! `isend` takes the oldest announced buffer with its tag that is still
//! empty and RDMA-WRITEs the message from NCCL's registered buffer into
//! it, with immediate data naming the group and the buffer; that WRITE
//! consumes one of the receiver's empty receives, whose completion gives
//! the buffer and the message's size. No byte is copied on either side
//! (see `memory`). An `isend` whose buffer the peer has not announced yet
//! returns a NULL request, and NCCL calls it again; a group's messages may
//! come in any order. A message longer than its buffer is refused by the
//! sender. The clear-to-send bytes come from the peer and are checked
//! (size, counts, id) before use; a WRITE can only reach the regions this
//! side registered for receiving, inside their bounds.

use crate::abi::NCCL_NET_MAX_REQUESTS;
use crate::config::{Config, DeviceSpec};
use crate::error::NetError;
use crate::memory::{block_on, poll_now, AppRegion, EMPTY_SGE};
use metaroce_io::{
    AccessFlags, CompletionQueue, Connection, Device, MemoryRegion, ProtectionDomain, QpCaps,
    QueuePair, RcAttrs, RegionBuf, RemoteAddr, WorkRequest,
};
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
const WIRE_VERSION: u8 = 1;
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
    let d = block_on(Device::open(p.cfg.driver(spec, salt)))?;
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
            if let Some(c) = inc.get(&peer) {
                return Ok(c.clone());
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(NetError::Remote(format!(
                    "no connection from {peer} in time"
                )));
            }
            inc = self
                .arrived
                .wait_timeout(inc, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
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

/// The QP side of one comm; fields drop in order (QP, CQ, ...). The
/// connection and the endpoint are shared with the device's other comms.
struct Link {
    qp: QueuePair,
    _cq: CompletionQueue,
    conn: Connection,
    _node: Arc<Node>,
}

impl Link {
    /// A PD, CQ and QP on the device's endpoint, not yet connected.
    fn open(node: &Node) -> Result<(ProtectionDomain, CompletionQueue, QueuePair), NetError> {
        let dev = &node.dev;
        let pd = block_on(dev.alloc_pd())?;
        let depth = (NCCL_NET_MAX_REQUESTS * MAX_RECVS) as u32;
        let cq = block_on(dev.create_cq(2 * depth as usize))?;
        let caps = QpCaps {
            max_send_wr: depth,
            max_recv_wr: depth,
            ..QpCaps::default()
        };
        let qp = block_on(pd.create_qp_with(&cq, &cq, caps))?;
        Ok((pd, cq, qp))
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

/// The set-up message each side sends the other over TCP: the handle's
/// nonce, its QP number and its endpoint's address.
fn hello(nonce: u64, qpn: u32, endpoint: SocketAddr) -> [u8; 36] {
    let mut b = [0u8; 36];
    b[0..4].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
    b[4..12].copy_from_slice(&nonce.to_le_bytes());
    b[12..16].copy_from_slice(&qpn.to_le_bytes());
    put_addr(&mut b[16..36], endpoint);
    b
}

fn read_hello(s: &mut TcpStream, nonce: u64) -> Result<(u32, SocketAddr), NetError> {
    let mut b = [0u8; 36];
    s.read_exact(&mut b)?;
    let magic = u32::from_le_bytes(b[0..4].try_into().unwrap_or_default());
    let their = u64::from_le_bytes(b[4..12].try_into().unwrap_or_default());
    if magic != HELLO_MAGIC || their != nonce {
        return Err(NetError::Remote(
            "set-up message with a wrong magic or nonce".into(),
        ));
    }
    let qpn = u32::from_le_bytes(b[12..16].try_into().unwrap_or_default());
    let addr = get_addr(&b[16..36])
        .ok_or_else(|| NetError::Remote("set-up message with a bad address".into()))?;
    Ok((qpn, addr))
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
        let (peer_qpn, peer) = read_hello(&mut s, h.nonce)?;
        let (pd, cq, qp) = Link::open(&node)?;
        s.write_all(&hello(h.nonce, qp.qpn().0, node.dev.local_addr()))?;
        // The peer opens (or reuses) its connection to us, then says so.
        let mut ready = [0u8; 1];
        s.read_exact(&mut ready)?;
        let conn = node.incoming(peer, Instant::now() + timeout)?;
        block_on(qp.connect_with(&conn, metaroce_io::Qpn(peer_qpn), rc_attrs()))?;
        s.write_all(&[1])?;
        RecvComm::new(
            pd,
            Link {
                qp,
                _cq: cq,
                conn,
                _node: node,
            },
        )
    })?;
    Ok(Box::new(ListenComm { stop, pending }))
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
        let pending = Pending::spawn("metaroce-connect", move || {
            let (pd, cq, qp) = Link::open(&node)?;
            let mut s = TcpStream::connect_timeout(&h.tcp, timeout)?;
            s.set_read_timeout(Some(timeout))?;
            s.set_nodelay(true)?;
            s.write_all(&hello(h.nonce, qp.qpn().0, node.dev.local_addr()))?;
            let (peer_qpn, _) = read_hello(&mut s, h.nonce)?;
            let conn = node.outgoing(h.udp, Instant::now() + timeout)?;
            s.write_all(&[1])?;
            block_on(qp.connect_with(&conn, metaroce_io::Qpn(peer_qpn), rc_attrs()))?;
            // The peer's QP is connected too: sends may start.
            let mut ready = [0u8; 1];
            s.read_exact(&mut ready)?;
            SendComm::new(
                pd,
                Link {
                    qp,
                    _cq: cq,
                    conn,
                    _node: node,
                },
            )
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
/// padding, then per buffer its tag (4), remote key (4), address (8) and
/// size (8).
const CTS_HEAD: usize = 8;
const CTS_ENTRY: usize = 24;
const CTS_BYTES: usize = CTS_HEAD + MAX_RECVS * CTS_ENTRY;
/// A group id fits in the immediate data beside the buffer's index.
const ID_MASK: u32 = u32::MAX >> 3;

/// One buffer of a receive the peer posted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct CtsSlot {
    tag: i32,
    rkey: u32,
    addr: u64,
    size: u64,
    used: bool,
}

/// A receive (group) the peer posted and announced.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Cts {
    id: u32,
    slots: Vec<CtsSlot>,
    left: usize,
}

impl Cts {
    fn encode(&self, b: &mut [u8; CTS_BYTES]) -> usize {
        b[0..4].copy_from_slice(&self.id.to_le_bytes());
        b[4] = self.slots.len() as u8;
        for (i, s) in self.slots.iter().enumerate() {
            let e = &mut b[CTS_HEAD + i * CTS_ENTRY..CTS_HEAD + (i + 1) * CTS_ENTRY];
            e[0..4].copy_from_slice(&s.tag.to_le_bytes());
            e[4..8].copy_from_slice(&s.rkey.to_le_bytes());
            e[8..16].copy_from_slice(&s.addr.to_le_bytes());
            e[16..24].copy_from_slice(&s.size.to_le_bytes());
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
            slots.push(CtsSlot {
                tag: i32::from_le_bytes(le4(&e[0..4])?),
                rkey: u32::from_le_bytes(le4(&e[4..8])?),
                addr: u64::from_le_bytes(le8(&e[8..16])?),
                size: u64::from_le_bytes(le8(&e[16..24])?),
                used: false,
            });
        }
        Ok(Cts { id, slots, left: n })
    }
}

/// A send comm.
#[repr(C)]
pub(crate) struct SendComm {
    head: CommHead,
    link: Link,
    outstanding: Arc<AtomicU64>,
    /// Where the peer's clear-to-send messages land, `CTS_RING` slots.
    fifo: MemoryRegion,
    /// The receives posted into `fifo`, oldest first, with their slot.
    fifo_posted: VecDeque<(WorkRequest, usize)>,
    /// Receives the peer announced that still have buffers to fill.
    ready: VecDeque<Cts>,
}

impl SendComm {
    fn new(pd: ProtectionDomain, link: Link) -> Result<SendComm, NetError> {
        let fifo = block_on(pd.reg_mr(
            RegionBuf::zeroed(CTS_RING * CTS_BYTES),
            AccessFlags::LOCAL_WRITE,
        ))?;
        let mut fifo_posted = VecDeque::with_capacity(CTS_RING);
        for slot in 0..CTS_RING {
            let sge = fifo.sge((slot * CTS_BYTES) as u64, CTS_BYTES as u32)?;
            fifo_posted.push_back((link.qp.recv(sge), slot));
        }
        Ok(SendComm {
            head: CommHead {
                side: Side::Send,
                pd,
            },
            link,
            outstanding: Arc::new(AtomicU64::new(0)),
            fifo,
            fifo_posted,
            ready: VecDeque::new(),
        })
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
    /// their receives again.
    fn take_cts(&mut self) -> Result<(), NetError> {
        while let Some((wr, _)) = self.fifo_posted.front_mut() {
            let Some(r) = poll_now(wr) else { break };
            let (_, slot) = self
                .fifo_posted
                .pop_front()
                .unwrap_or_else(|| unreachable!());
            let wc = r?;
            let off = slot * CTS_BYTES;
            let len = (wc.byte_len as usize).min(CTS_BYTES);
            // SAFETY: the receive into this slot completed, so its bytes
            // are final, and no transfer uses them until the receive is
            // posted again below, after they are decoded.
            let bytes = unsafe { std::slice::from_raw_parts(self.fifo.as_ptr().add(off), len) };
            let cts = Cts::decode(bytes)?;
            self.ready.push_back(cts);
            let sge = self.fifo.sge(off as u64, CTS_BYTES as u32)?;
            self.fifo_posted.push_back((self.link.qp.recv(sge), slot));
        }
        Ok(())
    }

    /// `isend`: `None` when NCCL should try again later (the peer has not
    /// posted the receive yet, or too many sends are in flight).
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
        self.take_cts()?;
        // The oldest announced buffer with this tag.
        let found = self.ready.iter().enumerate().find_map(|(ci, c)| {
            c.slots
                .iter()
                .position(|s| !s.used && s.tag == tag)
                .map(|si| (ci, si))
        });
        let Some((ci, si)) = found else {
            return Ok(None);
        };
        let c = &mut self.ready[ci];
        let s = &mut c.slots[si];
        if size as u64 > s.size {
            return Err(NetError::InvalidArgument(format!(
                "isend of {size} bytes for tag {tag}: the peer's buffer holds {}",
                s.size
            )));
        }
        s.used = true;
        let remote = RemoteAddr {
            rkey: s.rkey,
            addr: s.addr,
        };
        let imm = c.id << 3 | si as u32;
        c.left -= 1;
        if c.left == 0 {
            self.ready.remove(ci);
        }
        let wr = self.link.qp.write_imm(local, remote, imm);
        self.outstanding.fetch_add(1, Ordering::Relaxed);
        Ok(Some(Box::new(Request::Send(SendReq {
            wr,
            size,
            outstanding: self.outstanding.clone(),
        }))))
    }
}

/// A send in flight.
pub(crate) struct SendReq {
    wr: WorkRequest,
    size: usize,
    outstanding: Arc<AtomicU64>,
}

impl Drop for SendReq {
    fn drop(&mut self) {
        self.outstanding.fetch_sub(1, Ordering::Relaxed);
    }
}

struct Slot {
    cap: usize,
    got: Option<usize>,
}

struct Group {
    id: u32,
    slots: Vec<Slot>,
    remaining: usize,
}

/// The receive side of one comm: the receives each message's WRITE with
/// immediate consumes, groups waiting, the clear-to-send messages sent.
struct RecvEngine {
    posted: VecDeque<WorkRequest>,
    groups: VecDeque<Group>,
    done: HashMap<u32, Vec<usize>>,
    failed: Option<(crate::abi::NcclResult, String)>,
    next_id: u32,
    /// Where clear-to-send messages are sent from, `CTS_RING` slots.
    cts: MemoryRegion,
    /// The SEND of each slot's last message.
    cts_sent: Vec<Option<WorkRequest>>,
}

impl RecvEngine {
    /// Takes the messages that are in: each one's immediate data names its
    /// group and buffer, its length is what it placed there.
    fn progress(&mut self) -> Result<(), NetError> {
        while let Some(wr) = self.posted.front_mut() {
            let Some(r) = poll_now(wr) else { break };
            self.posted.pop_front();
            let wc = r?;
            let imm = wc
                .imm
                .ok_or_else(|| NetError::Remote("a message without immediate data".into()))?;
            let (id, si) = (imm >> 3, (imm & 7) as usize);
            let len = wc.byte_len as usize;
            let gi =
                self.groups.iter().position(|g| g.id == id).ok_or_else(|| {
                    NetError::Remote(format!("a message for no receive ({imm:#x})"))
                })?;
            let g = &mut self.groups[gi];
            let slot = g
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
            slot.got = Some(len);
            g.remaining -= 1;
            // Groups finish in any order; keep the finished ones for `test`.
            if g.remaining == 0 {
                let g = self.groups.remove(gi).unwrap_or_else(|| unreachable!());
                self.done
                    .insert(g.id, g.slots.iter().map(|s| s.got.unwrap_or(0)).collect());
            }
        }
        Ok(())
    }
}

/// A receive comm.
#[repr(C)]
pub(crate) struct RecvComm {
    head: CommHead,
    link: Link,
    engine: Arc<Mutex<RecvEngine>>,
}

impl RecvComm {
    fn new(pd: ProtectionDomain, link: Link) -> Result<RecvComm, NetError> {
        let cts = block_on(pd.reg_mr(RegionBuf::zeroed(CTS_RING * CTS_BYTES), AccessFlags::NONE))?;
        Ok(RecvComm {
            head: CommHead {
                side: Side::Recv,
                pd,
            },
            link,
            engine: Arc::new(Mutex::new(RecvEngine {
                posted: VecDeque::new(),
                groups: VecDeque::new(),
                done: HashMap::new(),
                failed: None,
                next_id: 0,
                cts,
                cts_sent: (0..CTS_RING).map(|_| None).collect(),
            })),
        })
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
        let mut slots = Vec::with_capacity(bufs.len());
        for &(ptr, size, tag, mr) in bufs {
            if size > MAX_MESSAGE {
                return Err(NetError::InvalidArgument(format!("irecv of {size} bytes")));
            }
            let (rkey, addr) = mr.remote(ptr, size)?;
            slots.push(CtsSlot {
                tag,
                rkey,
                addr,
                size: size as u64,
                used: false,
            });
        }
        let mut eng = self.engine.lock().unwrap_or_else(|e| e.into_inner());
        if eng.groups.len() + eng.done.len() >= NCCL_NET_MAX_REQUESTS {
            return Ok(None);
        }
        let id = eng.next_id;
        eng.next_id = (id + 1) & ID_MASK;
        // A receive for each message's WRITE with immediate, posted before
        // the peer may send it.
        for _ in bufs {
            let wr = self.link.qp.recv(EMPTY_SGE);
            eng.posted.push_back(wr);
        }
        // The clear-to-send, out of its ring slot once that slot's last
        // message is through (long ago: 2 * NCCL_NET_MAX_REQUESTS receives).
        let ring = id as usize % CTS_RING;
        if let Some(prev) = eng.cts_sent[ring].take() {
            block_on(prev)?;
        }
        let mut msg = [0u8; CTS_BYTES];
        let n = Cts {
            id,
            slots,
            left: bufs.len(),
        }
        .encode(&mut msg);
        let off = ring * CTS_BYTES;
        // SAFETY: the slot's bytes are in the region; the SEND that last
        // read them completed above, and no other transfer uses them.
        unsafe {
            std::ptr::copy_nonoverlapping(msg.as_ptr(), eng.cts.as_mut_ptr().add(off), n);
        }
        let sge = eng.cts.sge(off as u64, n as u32)?;
        eng.cts_sent[ring] = Some(self.link.qp.send(sge));
        eng.groups.push_back(Group {
            id,
            slots: bufs
                .iter()
                .map(|&(_, cap, _, _)| Slot { cap, got: None })
                .collect(),
            remaining: bufs.len(),
        });
        Ok(Some(Box::new(Request::Recv(RecvReq {
            engine: self.engine.clone(),
            id,
            n: bufs.len(),
        }))))
    }
}

/// A (grouped) receive in flight.
pub(crate) struct RecvReq {
    engine: Arc<Mutex<RecvEngine>>,
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
    pub(crate) fn test(&mut self) -> Result<Option<Vec<usize>>, NetError> {
        match self {
            Request::Send(s) => match poll_now(&mut s.wr) {
                None => Ok(None),
                Some(r) => {
                    r?;
                    Ok(Some(vec![s.size]))
                }
            },
            Request::Recv(r) => {
                let mut eng = r.engine.lock().unwrap_or_else(|e| e.into_inner());
                if let Some((code, msg)) = &eng.failed {
                    return Err(NetError::Remote(format!(
                        "receive comm failed earlier ({code}): {msg}"
                    )));
                }
                if let Err(e) = eng.progress() {
                    eng.failed = Some((e.code(), e.to_string()));
                    return Err(e);
                }
                match eng.done.remove(&r.id) {
                    Some(sizes) => {
                        debug_assert_eq!(sizes.len(), r.n);
                        Ok(Some(sizes))
                    }
                    None => Ok(None),
                }
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
        let ep: SocketAddr = "10.1.2.3:4792".parse().unwrap();
        c.write_all(&hello(7, 42, ep)).unwrap();
        assert_eq!(read_hello(&mut s, 7).unwrap(), (42, ep));
        c.write_all(&hello(8, 42, ep)).unwrap();
        assert!(matches!(read_hello(&mut s, 7), Err(NetError::Remote(_))));
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
                    used: false,
                })
                .collect(),
            left: MAX_RECVS,
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
        let one = Cts {
            id: 3,
            slots: c.slots[..1].to_vec(),
            left: 1,
        };
        let n = one.encode(&mut b);
        assert_eq!(n, CTS_HEAD + CTS_ENTRY);
        assert_eq!(Cts::decode(&b[..n]).unwrap(), one);
    }
}
