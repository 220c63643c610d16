//! RDMA verbs semantics, after rdma-core/ibverbs: protection domains, memory
//! regions with lkey/rkey and access flags, completion queues, queue pairs
//! with the RC state machine, work requests and work completions.
//!
//! The objects live inside an [`Endpoint`](crate::Endpoint); the handles here
//! name them. A memory region's bytes are held by the endpoint as a
//! [`RegionBuf`] (memory it owns, or the application's own, in place), and
//! the application reads and writes them with [`Endpoint::mr`](crate::Endpoint::mr)
//! and [`Endpoint::mr_mut`](crate::Endpoint::mr_mut), or, for memory
//! registered raw, through its own pointer within the rules of
//! [`RegionBuf::from_raw_parts`].

mod cq;
mod mr;
pub(crate) mod qp;
#[allow(unsafe_code)]
mod region_buf;

pub(crate) use cq::CompletionQueue;
pub use mr::MrInfo;
pub(crate) use mr::{MrTable, MAX_REGIONS};
pub use qp::{QpAttrs, QpState, RcAttrs};
pub use region_buf::RegionBuf;
pub(crate) use region_buf::Registered;

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

/// A scatter/gather list: up to [`MAX_SGE`](crate::consts::MAX_SGE)
/// local buffers that one work request gathers its bytes from (SEND,
/// WRITE) or scatters them into (a receive, a READ's destination), in
/// order, as `ibv_send_wr::sg_list`. Its message is the buffers' bytes one
/// after the other; empty buffers name no memory and are skipped.
///
/// A single [`Sge`] converts into a list of one (`From`), so calls that
/// take `impl Into<SgList>` take either.
///
/// ```
/// use metaroce_proto::verbs::{SgList, Sge, VerbsError};
/// let head = Sge { lkey: 1, addr: 0x1000, len: 64 };
/// let body = Sge { lkey: 2, addr: 0x8000, len: 4096 };
/// let list = SgList::try_from(&[head, body][..]).unwrap();
/// assert_eq!((list.len(), list.byte_len()), (2, 4160));
/// let one: SgList = head.into();
/// assert_eq!(one.as_slice(), &[head]);
/// // More than MAX_SGE elements are refused.
/// assert!(matches!(
///     SgList::try_from(&[head; 5][..]),
///     Err(VerbsError::TooManySge { n: 5, max: 4 })
/// ));
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Default)]
pub struct SgList {
    /// The elements; those at `n` and after are always `Sge::default()`.
    sges: [Sge; crate::consts::MAX_SGE],
    n: u8,
}

impl SgList {
    /// An empty list (a zero-length message).
    pub const fn new() -> Self {
        SgList {
            sges: [Sge {
                lkey: 0,
                addr: 0,
                len: 0,
            }; crate::consts::MAX_SGE],
            n: 0,
        }
    }

    /// Appends `sge`; [`VerbsError::TooManySge`] when the list already
    /// holds [`MAX_SGE`](crate::consts::MAX_SGE).
    pub fn push(&mut self, sge: Sge) -> Result<(), VerbsError> {
        let n = usize::from(self.n);
        if n >= crate::consts::MAX_SGE {
            return Err(VerbsError::TooManySge {
                n: n + 1,
                max: crate::consts::MAX_SGE as u32,
            });
        }
        self.sges[n] = sge;
        self.n += 1;
        Ok(())
    }

    /// The elements, in order.
    pub fn as_slice(&self) -> &[Sge] {
        &self.sges[..usize::from(self.n)]
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        usize::from(self.n)
    }

    /// Whether the list has no element.
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// The message length: every element's bytes together.
    pub fn byte_len(&self) -> u64 {
        self.as_slice().iter().map(|s| u64::from(s.len)).sum()
    }

    /// The element holding message byte `offset` and the offset in it
    /// (empty elements are skipped), with the message offset at which that
    /// element ends. `None` at or past the end.
    pub(crate) fn locate(&self, offset: u32) -> Option<(Sge, u32, u32)> {
        let mut start = 0u64;
        for s in self.as_slice() {
            let end = start + u64::from(s.len);
            if u64::from(offset) < end {
                let end = u32::try_from(end).ok()?;
                return Some((*s, offset - start as u32, end));
            }
            start = end;
        }
        None
    }

    /// Message bytes `offset..offset + len` as pieces of the elements, in
    /// order: (lkey, address, length). `None` if the range reaches past
    /// the end.
    pub(crate) fn pieces(
        &self,
        offset: u32,
        len: u32,
    ) -> Option<impl Iterator<Item = (u32, u64, u32)> + '_> {
        let end = u64::from(offset) + u64::from(len);
        if end > self.byte_len() {
            return None;
        }
        let mut start = 0u64;
        Some(self.as_slice().iter().filter_map(move |s| {
            let s_start = start;
            let s_end = start + u64::from(s.len);
            start = s_end;
            let from = u64::from(offset).max(s_start);
            let to = end.min(s_end);
            (from < to).then(|| {
                (
                    s.lkey,
                    s.addr.wrapping_add(from - s_start),
                    (to - from) as u32,
                )
            })
        }))
    }
}

impl core::fmt::Debug for SgList {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_list().entries(self.as_slice()).finish()
    }
}

impl From<Sge> for SgList {
    fn from(sge: Sge) -> Self {
        let mut l = SgList::new();
        l.sges[0] = sge;
        l.n = 1;
        l
    }
}

impl TryFrom<&[Sge]> for SgList {
    type Error = VerbsError;

    /// The list of `sges`, in order; [`VerbsError::TooManySge`] for more
    /// than [`MAX_SGE`](crate::consts::MAX_SGE).
    fn try_from(sges: &[Sge]) -> Result<Self, VerbsError> {
        if sges.len() > crate::consts::MAX_SGE {
            return Err(VerbsError::TooManySge {
                n: sges.len(),
                max: crate::consts::MAX_SGE as u32,
            });
        }
        let mut l = SgList::new();
        l.sges[..sges.len()].copy_from_slice(sges);
        l.n = sges.len() as u8;
        Ok(l)
    }
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

/// A send work request (`ibv_send_wr`).
///
/// ```
/// use metaroce_proto::verbs::{SendOp, SendWr, Sge, SgList};
/// let a = Sge { lkey: 1, addr: 0, len: 100 };
/// let b = Sge { lkey: 2, addr: 64, len: 28 };
/// // One buffer, or several gathered in order into one message.
/// let one = SendWr::new(7, SendOp::Send, a);
/// let two = SendWr::new(8, SendOp::Send, SgList::try_from(&[a, b][..]).unwrap());
/// assert_eq!((one.local.byte_len(), two.local.byte_len()), (100, 128));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SendWr {
    /// Caller's id, returned in the completion.
    pub wr_id: u64,
    /// What to do.
    pub op: SendOp,
    /// Local buffers, in order: the source for SEND/WRITE, the
    /// destination for READ (at most the QP's `max_send_sge` of them).
    pub local: SgList,
    /// Generate a completion on success (errors always complete).
    pub signaled: bool,
    /// Do not start before every earlier READ of this QP has completed.
    pub fence: bool,
}

impl SendWr {
    /// A signaled, unfenced work request.
    pub fn new(wr_id: u64, op: SendOp, local: impl Into<SgList>) -> Self {
        SendWr {
            wr_id,
            op,
            local: local.into(),
            signaled: true,
            fence: false,
        }
    }
}

/// A receive work request (`ibv_recv_wr`).
///
/// ```
/// use metaroce_proto::verbs::{RecvWr, Sge, SgList};
/// let hdr = Sge { lkey: 1, addr: 0, len: 64 };
/// let body = Sge { lkey: 1, addr: 4096, len: 4096 };
/// // A message of up to 4160 bytes: its first 64 in `hdr`, the rest in `body`.
/// let wr = RecvWr::new(3, SgList::try_from(&[hdr, body][..]).unwrap());
/// assert_eq!(wr.sge.byte_len(), 4160);
/// assert_eq!(RecvWr::new(4, hdr).sge.len(), 1);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecvWr {
    /// Caller's id, returned in the completion.
    pub wr_id: u64,
    /// Where an incoming SEND lands, filled in order (at most the QP's
    /// `max_recv_sge` elements).
    pub sge: SgList,
}

impl RecvWr {
    /// A receive of `wr_id` into `sge` (one [`Sge`] or an [`SgList`]).
    pub fn new(wr_id: u64, sge: impl Into<SgList>) -> Self {
        RecvWr {
            wr_id,
            sge: sge.into(),
        }
    }
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
    /// The completion queue is the send or receive queue of a QP: destroy
    /// the QP first.
    #[error("completion queue still used by a QP")]
    CqInUse,
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
    /// A work request has more scatter/gather elements than its queue
    /// takes (the QP's `max_send_sge` or `max_recv_sge`, or
    /// [`MAX_SGE`](crate::consts::MAX_SGE) for a list).
    #[error("{n} scatter/gather elements, more than the {max} allowed")]
    TooManySge {
        /// Elements in the request.
        n: usize,
        /// Most the queue (or list) takes.
        max: u32,
    },
    /// The elements of a work request add up to more than a message may
    /// carry ([`MAX_MESSAGE_LEN`](crate::consts::MAX_MESSAGE_LEN)).
    #[error("message of {0} bytes exceeds the largest message")]
    MessageTooLong(u64),
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
    /// Most scatter/gather elements of a send work request (1 to
    /// [`MAX_SGE`](crate::consts::MAX_SGE)).
    pub max_send_sge: u32,
    /// Most scatter/gather elements of a receive work request (1 to
    /// [`MAX_SGE`](crate::consts::MAX_SGE)).
    pub max_recv_sge: u32,
}

impl QpInit {
    /// Defaults of 1024 send and 1024 receive work requests, each of up
    /// to [`MAX_SGE`](crate::consts::MAX_SGE) elements.
    pub fn new(pd: PdHandle, send_cq: CqHandle, recv_cq: CqHandle) -> Self {
        QpInit {
            pd,
            send_cq,
            recv_cq,
            max_send_wr: 1024,
            max_recv_wr: 1024,
            max_send_sge: crate::consts::MAX_SGE as u32,
            max_recv_sge: crate::consts::MAX_SGE as u32,
        }
    }
}

/// Default RNR timer as a duration, for [`QpAttrs`].
pub const DEFAULT_MIN_RNR_TIMER: Duration = crate::consts::DEFAULT_RNR_TIMER;
