//! RDMA verbs semantics, after rdma-core/ibverbs: protection domains, memory
//! regions with lkey/rkey and access flags, completion queues, queue pairs
//! with the RC state machine, work requests and work completions.
//!
//! The objects live inside an [`Endpoint`](crate::Endpoint); the handles here
//! name them. Memory regions are owned by the endpoint (so that the core can
//! place incoming bytes and read outgoing ones without unsafe code) and the
//! application reads and writes them with [`Endpoint::mr`](crate::Endpoint::mr)
//! and [`Endpoint::mr_mut`](crate::Endpoint::mr_mut).

mod cq;
mod mr;
pub(crate) mod qp;
mod region_buf;

pub(crate) use cq::CompletionQueue;
pub use mr::MrInfo;
pub(crate) use mr::{MrTable, MAX_REGIONS};
pub use qp::{QpAttrs, QpState, RcAttrs};
pub use region_buf::RegionBuf;

use core::time::Duration;

/// Access rights of a memory region (`IBV_ACCESS_*`).
///
/// ```
/// use metaroce_proto::verbs::AccessFlags;
/// let a = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
/// assert!(a.contains(AccessFlags::REMOTE_WRITE));
/// assert!(!a.contains(AccessFlags::REMOTE_READ));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct AccessFlags(u8);

impl AccessFlags {
    /// No rights beyond local read.
    pub const NONE: AccessFlags = AccessFlags(0);
    /// The local side may write (receive buffers, READ destinations).
    pub const LOCAL_WRITE: AccessFlags = AccessFlags(1);
    /// A peer may RDMA WRITE into the region.
    pub const REMOTE_WRITE: AccessFlags = AccessFlags(2);
    /// A peer may RDMA READ from the region.
    pub const REMOTE_READ: AccessFlags = AccessFlags(4);
    /// Every right.
    pub const ALL: AccessFlags = AccessFlags(7);
    /// Not a right but how the region is registered
    /// (`IBV_ACCESS_ON_DEMAND`): its pages are left to be mapped by the
    /// first access to each, a transfer's included, instead of all at
    /// registration. For regions far larger than what is ever moved in
    /// them; a transfer that reaches a page not yet mapped waits for the
    /// page fault, on the thread that drives the endpoint.
    ///
    /// ```
    /// use metaroce_proto::verbs::{AccessFlags, RegionBuf};
    /// use metaroce_proto::{Endpoint, EndpointConfig};
    /// let mut ep = Endpoint::new(EndpointConfig::default(), 1).unwrap();
    /// let pd = ep.alloc_pd();
    /// let access = AccessFlags::REMOTE_WRITE | AccessFlags::ON_DEMAND;
    /// let mr = ep.reg_mr(pd, RegionBuf::zeroed(256 << 20), 0, access).unwrap();
    /// assert!(mr.access.contains(AccessFlags::ON_DEMAND));
    /// ```
    pub const ON_DEMAND: AccessFlags = AccessFlags(8);

    /// Whether every right in `other` is present.
    pub fn contains(self, other: AccessFlags) -> bool {
        self.0 & other.0 == other.0
    }

    /// The raw bits.
    pub fn bits(self) -> u8 {
        self.0
    }
}

impl core::ops::BitOr for AccessFlags {
    type Output = AccessFlags;
    fn bitor(self, rhs: AccessFlags) -> AccessFlags {
        AccessFlags(self.0 | rhs.0)
    }
}

/// The rights by name, `|`-separated (`LOCAL_WRITE|REMOTE_READ`; `NONE`
/// for none), as error messages and logs show them.
///
/// ```
/// use metaroce_proto::verbs::AccessFlags;
/// let a = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ;
/// assert_eq!(a.to_string(), "LOCAL_WRITE|REMOTE_READ");
/// assert_eq!(AccessFlags::NONE.to_string(), "NONE");
/// ```
impl core::fmt::Display for AccessFlags {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        let names = [
            (AccessFlags::LOCAL_WRITE, "LOCAL_WRITE"),
            (AccessFlags::REMOTE_WRITE, "REMOTE_WRITE"),
            (AccessFlags::REMOTE_READ, "REMOTE_READ"),
            (AccessFlags::ON_DEMAND, "ON_DEMAND"),
        ];
        let mut first = true;
        for (flag, name) in names {
            if self.contains(flag) {
                if !first {
                    f.write_str("|")?;
                }
                f.write_str(name)?;
                first = false;
            }
        }
        if first {
            f.write_str("NONE")?;
        }
        Ok(())
    }
}

/// A protection domain.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PdHandle(pub(crate) u32);

/// A completion queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CqHandle(pub(crate) u32);

/// A queue pair, named by its QP number (what the peer puts in `dst_qpn`).
///
/// Shown as the bare decimal number by both `Display` and `Debug`, so that
/// a QP reads the same in every log line and message (`qpn=1048577`),
/// however the line was written.
///
/// ```
/// use metaroce_proto::verbs::Qpn;
/// assert_eq!(format!("{} {:?}", Qpn(1048577), Qpn(1048577)), "1048577 1048577");
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Qpn(pub u32);

impl core::fmt::Display for Qpn {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        core::fmt::Display::fmt(&self.0, f)
    }
}

impl core::fmt::Debug for Qpn {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        core::fmt::Display::fmt(&self.0, f)
    }
}

/// A connection to a peer endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnectionHandle(pub(crate) u32);

impl ConnectionHandle {
    /// The index, for logs and metrics.
    pub fn index(self) -> u32 {
        self.0
    }
}

/// A local buffer: `len` bytes at virtual address `addr` of the region `lkey`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Sge {
    /// Local key of the region.
    pub lkey: u32,
    /// Virtual address inside the region (region `addr` plus offset).
    pub addr: u64,
    /// Length in bytes.
    pub len: u32,
}

/// A remote buffer: virtual address `addr` in the peer's region `rkey`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RemoteAddr {
    /// Remote key of the peer's region.
    pub rkey: u32,
    /// Virtual address in the peer's region.
    pub addr: u64,
}

/// The operation of a send work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendOp {
    /// SEND: the bytes of `local` land in the peer's next posted receive.
    Send,
    /// SEND with immediate data.
    SendImm(u32),
    /// RDMA WRITE of `local` to `remote`.
    Write(RemoteAddr),
    /// RDMA WRITE with immediate: also consumes a receive at the peer.
    WriteImm(RemoteAddr, u32),
    /// RDMA READ of `local.len` bytes from `remote` into `local`.
    Read(RemoteAddr),
}

/// A send work request (`ibv_send_wr`, one scatter/gather element).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SendWr {
    /// Caller's id, returned in the completion.
    pub wr_id: u64,
    /// What to do.
    pub op: SendOp,
    /// Local buffer: source for SEND/WRITE, destination for READ.
    pub local: Sge,
    /// Generate a completion on success (errors always complete).
    pub signaled: bool,
    /// Do not start before every earlier READ of this QP has completed.
    pub fence: bool,
}

impl SendWr {
    /// A signaled, unfenced work request.
    pub fn new(wr_id: u64, op: SendOp, local: Sge) -> Self {
        SendWr {
            wr_id,
            op,
            local,
            signaled: true,
            fence: false,
        }
    }
}

/// A receive work request (`ibv_recv_wr`, one scatter/gather element).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecvWr {
    /// Caller's id, returned in the completion.
    pub wr_id: u64,
    /// Where an incoming SEND lands.
    pub sge: Sge,
}

/// Status of a work completion (`ibv_wc_status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WcStatus {
    /// Completed successfully.
    Success,
    /// A receive buffer was too small for the incoming message.
    LocalLengthError,
    /// A local buffer's lkey, bounds or access rights are wrong.
    LocalProtectionError,
    /// The peer refused the remote address, rkey or access.
    RemoteAccessError,
    /// The peer could not carry the request out (e.g. its receive buffer was too small).
    RemoteInvalidRequest,
    /// The peer's QP is in the error state.
    RemoteOperationError,
    /// The transport gave up after `retry_cnt` timeouts without progress.
    RetryExceeded,
    /// The peer had no receive posted after `rnr_retry` retries.
    RnrRetryExceeded,
    /// The QP moved to the error state before this request completed.
    WrFlushError,
}

/// What a completion completes (`ibv_wc_opcode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WcOpcode {
    /// A SEND or SEND with immediate.
    Send,
    /// An RDMA WRITE (with or without immediate).
    Write,
    /// An RDMA READ.
    Read,
    /// A receive consumed by a SEND.
    Recv,
    /// A receive consumed by a WRITE with immediate.
    RecvRdmaWithImm,
}

/// A work completion (`ibv_wc`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkCompletion {
    /// The work request's id.
    pub wr_id: u64,
    /// Outcome.
    pub status: WcStatus,
    /// Kind of request.
    pub opcode: WcOpcode,
    /// Bytes transferred (receives: bytes received).
    pub byte_len: u32,
    /// Immediate data, for SEND_IMM/WRITE_IMM receives.
    pub imm: Option<u32>,
    /// QP the request was posted on.
    pub qpn: Qpn,
}

/// Why a verbs call was refused. These are immediate errors of the call
/// itself; failures of a request after it was posted are reported as
/// [`WorkCompletion`]s with a [`WcStatus`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum VerbsError {
    /// No such protection domain.
    #[error("no such protection domain")]
    InvalidPd,
    /// No such completion queue.
    #[error("no such completion queue")]
    InvalidCq,
    /// No such queue pair.
    #[error("no such queue pair {0}")]
    InvalidQp(Qpn),
    /// No such memory region: the key was never issued, or its region was
    /// deregistered.
    #[error("no such memory region (key {0:#x})")]
    InvalidKey(u32),
    /// The region exists but was not registered with the rights the request
    /// needs: a receive (and a READ's destination) needs `LOCAL_WRITE`.
    #[error("memory region (key {lkey:#x}) lacks {need} access (registered with {has})")]
    AccessDenied {
        /// The region's local key.
        lkey: u32,
        /// What the request needs.
        need: AccessFlags,
        /// What the region was registered with.
        has: AccessFlags,
    },
    /// The region belongs to another protection domain than the QP.
    #[error("memory region (key {0:#x}) is in another protection domain than the QP")]
    OtherPd(u32),
    /// The buffer reaches outside its region.
    #[error("{len} bytes at address {addr:#x} reach outside memory region (key {lkey:#x})")]
    OutsideRegion {
        /// The region's local key.
        lkey: u32,
        /// The buffer's first byte.
        addr: u64,
        /// Its length.
        len: u32,
    },
    /// No such connection, or it is closed.
    #[error("no such connection")]
    InvalidConnection,
    /// The QP's current state does not allow this transition.
    #[error("illegal QP transition {from:?} -> {to:?}")]
    IllegalTransition {
        /// Current state.
        from: QpState,
        /// Requested state.
        to: QpState,
    },
    /// A transition was asked for without the attributes it needs.
    #[error("missing attribute `{0}` for this transition")]
    MissingAttribute(&'static str),
    /// An attribute's value is out of its range.
    #[error("invalid QP attribute: {0}")]
    InvalidAttribute(&'static str),
    /// The QP's state does not allow posting this request.
    #[error("QP is in state {0:?}, which does not take this request")]
    InvalidState(QpState),
    /// The work queue is full.
    #[error("work queue full ({0} entries)")]
    QueueFull(u32),
    /// The memory region is referenced by outstanding work requests.
    #[error("memory region still in use by {0} work requests")]
    MrInUse(u32),
    /// The driver is still sending from the memory region (gathered
    /// transmits not yet completed by the kernel, microseconds at most):
    /// retry after the driver's next poll.
    #[error("memory region still being sent from by {0} transmits")]
    MrSending(u32),
    /// The memory region's bytes are lent to the application
    /// (`Endpoint::lend_mr`): nothing may use it until they are back.
    #[error("memory region (key {0:#x}) is lent to the application")]
    MrLent(u32),
    /// The memory region is too large or empty.
    #[error("invalid memory region length {0}")]
    InvalidLength(usize),
    /// The protection domain still has objects in it.
    #[error("protection domain still in use")]
    PdInUse,
    /// The endpoint holds as many connections as its `max_connections`
    /// allows.
    #[error("connection limit reached")]
    TooManyConnections,
    /// The endpoint has as many handshakes in progress as its
    /// `max_handshakes` allows.
    #[error("handshake limit reached")]
    TooManyHandshakes,
    /// The endpoint holds as many QPs as its `max_qps` allows.
    #[error("queue pair limit reached")]
    TooManyQps,
    /// The endpoint holds as many memory regions as its `max_regions`
    /// allows (at most 2^24).
    #[error("memory region limit reached")]
    TooManyRegions,
}

/// Capacities and parameters given when a QP is created (`ibv_qp_init_attr`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpInit {
    /// Protection domain of the QP.
    pub pd: PdHandle,
    /// Completion queue for send work requests.
    pub send_cq: CqHandle,
    /// Completion queue for receive work requests.
    pub recv_cq: CqHandle,
    /// Largest number of outstanding send work requests (at most `MSG_WINDOW`).
    pub max_send_wr: u32,
    /// Largest number of outstanding receive work requests.
    pub max_recv_wr: u32,
}

impl QpInit {
    /// Defaults of 1024 send and 1024 receive work requests.
    pub fn new(pd: PdHandle, send_cq: CqHandle, recv_cq: CqHandle) -> Self {
        QpInit {
            pd,
            send_cq,
            recv_cq,
            max_send_wr: 1024,
            max_recv_wr: 1024,
        }
    }
}

/// Default RNR timer as a duration, for [`QpAttrs`].
pub const DEFAULT_MIN_RNR_TIMER: Duration = crate::consts::DEFAULT_RNR_TIMER;
