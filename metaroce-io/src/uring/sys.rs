//! Every `unsafe` of the io_uring backend, and the memory the kernel shares.
//!
//! The rule all of it rests on: memory the kernel reads or writes on behalf
//! of a request lives in a [`Ring`], at an address that never changes (heap
//! allocations owned by the `Ring`, never resized), and is neither freed nor
//! written by us until the kernel says it is done with it:
//!
//! - a receive buffer from the moment it is published in the buffer ring
//!   until a completion names it (`IORING_CQE_F_BUFFER`), and again from the
//!   moment we give it back;
//! - a send slot (data, `msghdr`, `iovec`, address, control data) from the
//!   push of its request until its last completion: the result for
//!   `SENDMSG`, the notification (`IORING_CQE_F_NOTIF`) for `SENDMSG_ZC`
//!   when the result carried `IORING_CQE_F_MORE`;
//! - for a gathered send, the payloads its `iovec`s point at outside the
//!   slot (memory regions of the endpoint) for the same time: the caller of
//!   [`SendSlot::set_gather`] promises it (the core pins those regions
//!   until the driver releases them at the slot's last completion or after
//!   a successful drain at drop, and leaks a pinned region's memory rather
//!   than free it);
//! - the multishot receive's `msghdr` until the completion without
//!   `IORING_CQE_F_MORE` that ends it;
//! - the buffer ring's entries until it is unregistered;
//! - a timeout's `timespec` until the submission that hands it over (the
//!   kernel copies it while preparing the request).
//!
//! [`Ring`]'s `Drop` enforces this at the end: it cancels everything,
//! waits for the last completions and unregisters the buffer ring before any
//! memory is freed; if the kernel does not answer in time it leaks the
//! memory rather than free what the kernel might still touch.

use io_uring::types::{CancelBuilder, Fd, SubmitArgs, Timespec};
use io_uring::{cqueue, opcode, squeue, IoUring};
use socket2::SockAddr;
use std::alloc::{self, Layout};
use std::collections::VecDeque;
use std::io;
use std::mem::ManuallyDrop;
use std::os::fd::{AsRawFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::Duration;

/// `IORING_SEND_ZC_REPORT_USAGE` (not exported by the `io-uring` crate).
const SEND_ZC_REPORT_USAGE: u16 = 1 << 3;
/// `IORING_NOTIF_USAGE_ZC_COPIED`: the notification says the kernel copied.
pub(super) const NOTIF_USAGE_ZC_COPIED: i32 = i32::MIN;

/// What a completion belongs to: the top byte of `user_data`.
pub(super) const TAG_RECV: u64 = 1 << 56;
/// A send slot; the low bits are its index.
pub(super) const TAG_SEND: u64 = 2 << 56;
/// A timer; the low bits are its generation.
pub(super) const TAG_TIMER: u64 = 3 << 56;
/// A cancellation or timeout removal (no memory, nothing to do).
pub(super) const TAG_CTRL: u64 = 4 << 56;
/// The driver's waker poll; the low bits are its generation.
pub(super) const TAG_WAKE: u64 = 5 << 56;
/// Mask of the tag.
pub(super) const TAG_MASK: u64 = 0xff << 56;

/// Bits of a receive's `user_data` below the socket index: its generation.
const RECV_GEN_BITS: u32 = 40;

/// The `user_data` of receive generation `gen` on socket `k`.
fn recv_user_data(k: usize, gen: u64) -> u64 {
    TAG_RECV | ((k as u64) << RECV_GEN_BITS) | (gen & ((1 << RECV_GEN_BITS) - 1))
}

/// The socket index of a receive completion's `user_data`.
pub(super) fn recv_socket(user_data: u64) -> usize {
    ((user_data & !TAG_MASK) >> RECV_GEN_BITS) as usize
}

/// Sets an `int` socket option (socket2 has no setter for `UDP_GRO`,
/// `UDP_SEGMENT`, `IP_RECVTOS` on every version).
pub(super) fn setsockopt_int(
    fd: RawFd,
    level: libc::c_int,
    name: libc::c_int,
    value: libc::c_int,
) -> io::Result<()> {
    // SAFETY: `value` lives across the call and the length passed is its
    // size; the kernel only reads it. A bad `fd` is EBADF, not UB.
    let r = unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (&value as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// An all-zero `msghdr` (no name, no data, no control).
pub(super) fn zeroed_msghdr() -> libc::msghdr {
    // SAFETY: `msghdr` is a C struct of pointers and integers (and padding on
    // some libcs); all zeros is a valid value: null pointers, zero lengths.
    unsafe { std::mem::zeroed() }
}

/// Size of a `cmsghdr` (`CMSG_LEN(0)`).
pub(super) const CMSG_HDR: usize = std::mem::size_of::<libc::cmsghdr>();

/// Reads the `cmsghdr` at the start of `bytes`: (`cmsg_len`, level, type).
pub(super) fn read_cmsghdr(bytes: &[u8]) -> Option<(usize, libc::c_int, libc::c_int)> {
    if bytes.len() < CMSG_HDR {
        return None;
    }
    // SAFETY: `bytes` holds at least `size_of::<cmsghdr>()` initialized
    // bytes (checked above); `read_unaligned` has no alignment requirement,
    // and `cmsghdr` is plain integers, valid for any bit pattern.
    let h: libc::cmsghdr = unsafe { bytes.as_ptr().cast::<libc::cmsghdr>().read_unaligned() };
    // `cmsg_len` is a `size_t` on glibc and a `u32` on musl.
    #[allow(clippy::unnecessary_cast)]
    Some((h.cmsg_len as usize, h.cmsg_level, h.cmsg_type))
}

/// Writes a `cmsghdr` at the start of `bytes`.
pub(super) fn write_cmsghdr(
    bytes: &mut [u8],
    len: usize,
    level: libc::c_int,
    ty: libc::c_int,
) -> Option<()> {
    if bytes.len() < CMSG_HDR {
        return None;
    }
    // SAFETY: all-zero is a valid `cmsghdr` (integers and padding only).
    let mut h: libc::cmsghdr = unsafe { std::mem::zeroed() };
    h.cmsg_len = len as _;
    h.cmsg_level = level;
    h.cmsg_type = ty;
    // SAFETY: `bytes` has room for a `cmsghdr` (checked above) and we hold it
    // exclusively (`&mut`); `write_unaligned` needs no alignment.
    unsafe {
        bytes
            .as_mut_ptr()
            .cast::<libc::cmsghdr>()
            .write_unaligned(h)
    };
    Some(())
}

/// Control data storage aligned like a `cmsghdr`.
#[repr(C, align(8))]
#[derive(Clone, Copy)]
pub(super) struct CmsgBuf(pub [u8; 64]);

/// `struct io_uring_buf`: one entry of a provided-buffer ring.
#[repr(C)]
struct RawBuf {
    addr: u64,
    len: u32,
    bid: u16,
    /// In entry 0: the ring's tail.
    resv: u16,
}

/// A registered provided-buffer ring (`IORING_REGISTER_PBUF_RING`) and its buffers.
struct BufRing {
    ring: NonNull<RawBuf>,
    ring_layout: Layout,
    bufs: NonNull<u8>,
    bufs_layout: Layout,
    entries: u16,
    buf_size: usize,
    /// Our copy of the tail (the kernel owns the head).
    tail: u16,
    /// `lent[bid]`: the buffer is published to the kernel (not ours to read).
    lent: Vec<bool>,
    bgid: u16,
    registered: bool,
}

impl BufRing {
    fn new(entries: u16, buf_size: usize, bgid: u16) -> io::Result<Self> {
        if !entries.is_power_of_two() || entries > 32_768 || buf_size == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "recv_buffers must be a power of two up to 32768",
            ));
        }
        let bad = |_| io::Error::new(io::ErrorKind::InvalidInput, "buffer ring too large");
        let ring_layout = Layout::from_size_align(
            (usize::from(entries) * std::mem::size_of::<RawBuf>()).max(4096),
            4096,
        )
        .map_err(bad)?;
        let buf_size = buf_size.next_multiple_of(64);
        let bufs_layout =
            Layout::from_size_align(usize::from(entries) * buf_size, 4096).map_err(bad)?;
        // SAFETY: both layouts have a non-zero size. Zeroed memory: every
        // byte we may later read is initialized whether the kernel wrote it
        // or not.
        let (ring, bufs) = unsafe {
            (
                alloc::alloc_zeroed(ring_layout).cast::<RawBuf>(),
                alloc::alloc_zeroed(bufs_layout),
            )
        };
        let (Some(ring), Some(bufs)) = (NonNull::new(ring), NonNull::new(bufs)) else {
            alloc::handle_alloc_error(ring_layout)
        };
        let mut br = BufRing {
            ring,
            ring_layout,
            bufs,
            bufs_layout,
            entries,
            buf_size,
            tail: 0,
            lent: vec![false; usize::from(entries)],
            bgid,
            registered: false,
        };
        for bid in 0..entries {
            br.give(bid);
        }
        br.publish();
        Ok(br)
    }

    /// Hands buffer `bid` back to the kernel (visible after [`publish`](Self::publish)).
    fn give(&mut self, bid: u16) {
        let i = usize::from(bid);
        if i >= self.lent.len() || self.lent[i] {
            return;
        }
        self.lent[i] = true;
        let slot = usize::from(self.tail & (self.entries - 1));
        // SAFETY: `slot < entries`, inside the ring allocation. The kernel
        // reads entries between its head and the published tail only; this
        // one is at our unpublished tail, so nobody reads it while we write.
        // Raw field writes: entry 0's `resv` (the tail, which the kernel
        // reads) is not touched and no reference to it is made.
        unsafe {
            let e = self.ring.as_ptr().add(slot);
            std::ptr::addr_of_mut!((*e).addr)
                .write(self.bufs.as_ptr().add(i * self.buf_size) as u64);
            std::ptr::addr_of_mut!((*e).len).write(self.buf_size as u32);
            std::ptr::addr_of_mut!((*e).bid).write(bid);
        }
        self.tail = self.tail.wrapping_add(1);
    }

    /// Makes the buffers given since the last call visible to the kernel.
    fn publish(&mut self) {
        // SAFETY: the tail is the `resv` field of entry 0, inside the ring
        // allocation and 2-aligned (the ring is page-aligned). The kernel
        // reads it with an acquire load; we publish with a release store so
        // the entries written before are visible first.
        let tail =
            unsafe { AtomicU16::from_ptr(std::ptr::addr_of_mut!((*self.ring.as_ptr()).resv)) };
        tail.store(self.tail, Ordering::Release);
    }

    /// The bytes the kernel wrote into buffer `bid` (`len` of them), taking
    /// it back from the kernel. `None` if `bid` is not lent or `len` too large.
    fn take(&mut self, bid: u16, len: usize) -> Option<&[u8]> {
        let i = usize::from(bid);
        if i >= self.lent.len() || !self.lent[i] || len > self.buf_size {
            return None;
        }
        self.lent[i] = false;
        // SAFETY: in bounds (`i < entries`, `len <= buf_size`), initialized
        // (zeroed at allocation). The caller passes a `bid` from a completion
        // flagged `IORING_CQE_F_BUFFER`: the kernel has finished writing it
        // and will not pick it again until `give` publishes it, which needs
        // `&mut self` and so ends this borrow first.
        Some(unsafe { std::slice::from_raw_parts(self.bufs.as_ptr().add(i * self.buf_size), len) })
    }
}

impl Drop for BufRing {
    fn drop(&mut self) {
        if self.registered {
            // The kernel may still read the ring or write the buffers: leak them.
            tracing::warn!("io_uring buffer ring still registered at drop: leaking it");
            return;
        }
        // SAFETY: allocated in `new` with these layouts; not registered, so
        // the kernel holds no reference to either.
        unsafe {
            alloc::dealloc(self.ring.as_ptr().cast(), self.ring_layout);
            alloc::dealloc(self.bufs.as_ptr(), self.bufs_layout);
        }
    }
}

/// One `msghdr` with its single `iovec`.
struct Msg {
    hdr: libc::msghdr,
    iov: libc::iovec,
}

/// Where one piece of a gathered send is.
#[derive(Debug, Clone)]
pub(super) enum Piece {
    /// Bytes of the slot's buffer.
    Buf(std::ops::Range<usize>),
    /// Bytes outside the slot (a memory region's payload).
    Extern(*const u8, usize),
}

/// A send buffer and everything its `msghdr` points at.
pub(super) struct SendSlot {
    buf: Box<[u8]>,
    dst: SockAddr,
    ctrl: CmsgBuf,
    /// `msgs[0]` sends a whole transmit; `msgs[..n]` its segments one by one.
    msgs: Box<[Msg]>,
    /// The `iovec`s of a gathered send (through `msgs[0]`): a header and a
    /// payload per datagram.
    gather: Box<[libc::iovec]>,
    /// Completions the kernel still owes for this slot.
    inflight: u16,
    /// Its send, or the rest of its messages, waits in [`Ring`]'s list of
    /// deferred sends for room in the submission queue: the slot is not
    /// free even with nothing in flight.
    deferred: bool,
}

impl SendSlot {
    fn new(size: usize, max_msgs: usize) -> Self {
        SendSlot {
            buf: vec![0u8; size].into_boxed_slice(),
            dst: SockAddr::from(std::net::SocketAddr::from(([0, 0, 0, 0], 0))),
            ctrl: CmsgBuf([0; 64]),
            msgs: (0..max_msgs.max(1))
                .map(|_| Msg {
                    hdr: zeroed_msghdr(),
                    iov: libc::iovec {
                        iov_base: std::ptr::null_mut(),
                        iov_len: 0,
                    },
                })
                .collect(),
            gather: (0..2 * max_msgs.max(1) + 2)
                .map(|_| libc::iovec {
                    iov_base: std::ptr::null_mut(),
                    iov_len: 0,
                })
                .collect(),
            inflight: 0,
            deferred: false,
        }
    }

    /// Points message 0 at `pieces`, in order (one scatter-gather
    /// `sendmsg`: a GSO batch of headers and payloads), to `dst`, with the
    /// first `ctrl_len` bytes of control data. False if the slot is busy, a
    /// `Buf` piece is outside the buffer or there are more pieces than
    /// `iovec`s.
    ///
    /// # Safety
    ///
    /// The memory of every [`Piece::Extern`] must be readable for its length
    /// and stay allocated, at the same address, until the slot's last
    /// completion after the [`Ring::send`] that follows (or until the slot is
    /// pointed elsewhere without being sent). The kernel only reads it.
    pub(super) unsafe fn set_gather(
        &mut self,
        dst: std::net::SocketAddr,
        pieces: &[Piece],
        ctrl_len: usize,
    ) -> bool {
        if !self.is_free() || pieces.len() > self.gather.len() || pieces.is_empty() {
            return false;
        }
        for (iov, p) in self.gather.iter_mut().zip(pieces) {
            let (base, len) = match p {
                Piece::Buf(r) => {
                    let Some(b) = self.buf.get_mut(r.clone()) else {
                        return false;
                    };
                    (b.as_mut_ptr().cast::<libc::c_void>(), b.len())
                }
                // The kernel never writes through a send's `iovec`.
                Piece::Extern(ptr, len) => (ptr.cast_mut().cast::<libc::c_void>(), *len),
            };
            iov.iov_base = base;
            iov.iov_len = len;
        }
        self.dst = SockAddr::from(dst);
        let msg = &mut self.msgs[0];
        msg.hdr = zeroed_msghdr();
        msg.hdr.msg_name = self.dst.as_ptr() as *mut libc::c_void;
        msg.hdr.msg_namelen = self.dst.len();
        msg.hdr.msg_iov = self.gather.as_mut_ptr();
        msg.hdr.msg_iovlen = pieces.len() as _;
        if ctrl_len > 0 {
            msg.hdr.msg_control = self.ctrl.0.as_mut_ptr().cast();
            msg.hdr.msg_controllen = ctrl_len.min(self.ctrl.0.len()) as _;
        }
        true
    }

    /// Whether the kernel is done with the slot and no send of it waits.
    pub(super) fn is_free(&self) -> bool {
        self.inflight == 0 && !self.deferred
    }

    /// The buffer and control storage to fill, while the slot is free.
    pub(super) fn parts_mut(&mut self) -> Option<(&mut [u8], &mut CmsgBuf)> {
        if self.is_free() {
            Some((&mut self.buf, &mut self.ctrl))
        } else {
            None
        }
    }

    /// Points message `m` at `range` of the buffer, to `dst`, with the first
    /// `ctrl_len` bytes of control data. False if the slot is busy.
    pub(super) fn set_msg(
        &mut self,
        m: usize,
        dst: std::net::SocketAddr,
        range: std::ops::Range<usize>,
        ctrl_len: usize,
    ) -> bool {
        if !self.is_free() || m >= self.msgs.len() || range.end > self.buf.len() {
            return false;
        }
        self.dst = SockAddr::from(dst);
        let msg = &mut self.msgs[m];
        msg.iov.iov_base = self.buf[range.clone()].as_mut_ptr().cast();
        msg.iov.iov_len = range.len();
        msg.hdr = zeroed_msghdr();
        msg.hdr.msg_name = self.dst.as_ptr() as *mut libc::c_void;
        msg.hdr.msg_namelen = self.dst.len();
        msg.hdr.msg_iov = &mut msg.iov;
        msg.hdr.msg_iovlen = 1;
        if ctrl_len > 0 {
            msg.hdr.msg_control = self.ctrl.0.as_mut_ptr().cast();
            msg.hdr.msg_controllen = ctrl_len.min(self.ctrl.0.len()) as _;
        }
        true
    }
}

/// What a send completion meant for its slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SendCqe {
    /// The result of a send (bytes or `-errno`); more completions may follow.
    Result(i32),
    /// A zero-copy notification; whether the kernel copied after all.
    Notif {
        /// The kernel copied the data.
        copied: bool,
    },
}

/// A send the submission queue had no room for (see [`Ring::push`]):
/// messages `next..n` of a slot, still to be pushed, in order.
#[derive(Debug, Clone, Copy)]
struct DeferredSend {
    slot: usize,
    next: usize,
    n: usize,
    fd: RawFd,
    zc: bool,
}

/// What [`Ring::arm_recv`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Arm {
    /// A receive armed by this thread is in flight: nothing to do.
    Armed,
    /// A new receive is queued.
    Queued,
    /// The submission queue is full (see [`Ring::push`]): nothing was
    /// queued; the next turn tries again.
    Full,
}

/// The ring and all memory the kernel shares with it.
pub(super) struct Ring {
    ring: IoUring,
    recv_hdr: Box<libc::msghdr>,
    /// The current multishot receive of each receive socket (by the
    /// driver's index): its generation and the thread that armed it (its
    /// completions run as task work of that thread).
    recv: Vec<Option<(u64, std::thread::ThreadId)>>,
    /// Generation of the last receive armed.
    recv_gen: u64,
    /// Multishot receives still in flight (a replaced one until it ends).
    recv_live: u32,
    bufs: BufRing,
    slots: Box<[SendSlot]>,
    /// Sends waiting for room in the submission queue, in the order they
    /// were made: they go before any later one.
    deferred: VecDeque<DeferredSend>,
    timespec: Box<Timespec>,
    cqes: Vec<cqueue::Entry>,
    /// Tests: while set, [`submit`](Self::submit) enters no kernel, as if
    /// the kernel took nothing (see [`push`](Self::push)).
    #[cfg(test)]
    refuse_submissions: bool,
}

// SAFETY: the raw pointers in `Ring` (in `msghdr`s, `iovec`s and the buffer
// ring) point into heap memory the `Ring` itself owns; nothing in it is tied
// to a thread (the ring is created without `SINGLE_ISSUER`), and moving the
// `Ring` moves no pointed-to memory. Requests submitted on one thread stay
// valid when the next submission comes from another.
unsafe impl Send for Ring {}

/// Name and control space reserved in each receive buffer.
pub(super) const RECV_NAME_LEN: usize = std::mem::size_of::<libc::sockaddr_storage>();
/// Control space for the receive cmsgs (GRO stride, TOS / traffic class).
pub(super) const RECV_CONTROL_LEN: usize = 128;
/// `sizeof(struct io_uring_recvmsg_out)`.
const RECVMSG_OUT_LEN: usize = 16;

impl Ring {
    /// The ring's descriptor: readable (`poll`, `epoll`) while completions
    /// wait in it.
    pub(super) fn fd(&self) -> RawFd {
        self.ring.as_raw_fd()
    }

    /// Creates the ring, registers the buffer ring and allocates the send slots.
    pub(super) fn new(
        entries: u32,
        recv_buffers: u16,
        recv_payload: usize,
        slots: usize,
        slot_size: usize,
        max_msgs: usize,
    ) -> io::Result<Self> {
        // COOP_TASKRUN: completions are posted when we enter the kernel
        // (every turn does) instead of interrupting the thread for each;
        // TASKRUN_FLAG says in the shared ring when such work waits, which
        // is what a busy poll watches.
        let builder = |coop: bool| {
            let mut b = IoUring::builder();
            b.setup_cqsize(entries.saturating_mul(4));
            if coop {
                b.setup_coop_taskrun().setup_taskrun_flag();
            }
            b.build(entries)
        };
        // COOP_TASKRUN (5.19): completions are posted when the thread enters
        // the kernel (every turn does) instead of interrupting it for each.
        let ring = builder(true).or_else(|_| builder(false))?;
        let mut bufs = BufRing::new(
            recv_buffers,
            RECVMSG_OUT_LEN + RECV_NAME_LEN + RECV_CONTROL_LEN + recv_payload,
            0,
        )?;
        // SAFETY: the ring memory is `entries` page-aligned entries owned by
        // `bufs`, which lives inside this `Ring` and is not freed while
        // registered (`BufRing::drop` leaks it then; `Ring::drop` unregisters
        // it only after the last receive has ended).
        unsafe {
            ring.submitter().register_buf_ring_with_flags(
                bufs.ring.as_ptr() as u64,
                bufs.entries,
                bufs.bgid,
                0,
            )?;
        }
        bufs.registered = true;
        let mut recv_hdr = Box::new(zeroed_msghdr());
        recv_hdr.msg_namelen = RECV_NAME_LEN as _;
        recv_hdr.msg_controllen = RECV_CONTROL_LEN as _;
        Ok(Ring {
            ring,
            recv_hdr,
            recv: Vec::new(),
            recv_gen: 0,
            recv_live: 0,
            bufs,
            slots: (0..slots.max(1))
                .map(|_| SendSlot::new(slot_size, max_msgs))
                .collect(),
            deferred: VecDeque::with_capacity(slots.max(1)),
            timespec: Box::new(Timespec::new()),
            cqes: Vec::with_capacity(entries as usize * 4),
            #[cfg(test)]
            refuse_submissions: false,
        })
    }

    /// Whether the submission queue has room for `n` more entries.
    fn has_room(&mut self, n: usize) -> bool {
        let sq = self.ring.submission();
        sq.capacity() - sq.len() >= n
    }

    /// Pushes entries whose memory the caller has argued valid, all of them
    /// or none, submitting what is queued first if the queue lacks room (the
    /// enter hands the queued entries to the kernel, which frees their
    /// slots). The one `SubmissionQueue::push` of the backend.
    ///
    /// False if the queue still lacks room after that: the kernel took too
    /// few. It refuses submissions for a while now and then (EAGAIN when it
    /// cannot allocate requests; EBUSY on older kernels while completions
    /// overflow) and stops a batch at a request that fails to start. A full
    /// queue is no error: the caller keeps what it meant to queue and tries
    /// again on a later turn, after the turn's submission.
    ///
    /// # Safety
    /// Everything the entries point at must stay valid until the kernel is
    /// done with it, per the rules of the module documentation.
    unsafe fn push(&mut self, es: &[squeue::Entry]) -> io::Result<bool> {
        debug_assert!(es.len() <= self.ring.submission().capacity());
        if !self.has_room(es.len()) {
            self.submit(0)?;
            if !self.has_room(es.len()) {
                return Ok(false);
            }
        }
        // SAFETY: forwarded from the caller.
        Ok(unsafe { self.ring.submission().push_multiple(es) }.is_ok())
    }

    /// Arms the multishot receive on `fd` unless one armed by this thread
    /// is in flight. One armed by another thread (the driver moved) is
    /// cancelled and replaced, so that receive completions are posted by the
    /// thread that polls. `k` names the socket (one receive per socket);
    /// generations are unique across sockets.
    pub(super) fn arm_recv(&mut self, k: usize, fd: RawFd) -> io::Result<Arm> {
        let me = this_thread();
        if self.recv.len() <= k {
            self.recv.resize(k + 1, None);
        }
        let cancel = match self.recv[k] {
            Some((_, owner)) if owner == me => return Ok(Arm::Armed),
            Some((gen, _)) => Some(
                opcode::AsyncCancel::new(recv_user_data(k, gen))
                    .build()
                    .user_data(TAG_CTRL),
            ),
            None => None,
        };
        let gen = self.recv_gen + 1;
        let arm = opcode::RecvMsgMulti::new(Fd(fd), &*self.recv_hdr, self.bufs.bgid)
            .build()
            .user_data(recv_user_data(k, gen));
        // The cancellation and its replacement go in together or not at
        // all: the next turn then starts over from the same state.
        let both;
        let es = match cancel {
            Some(c) => {
                both = [c, arm];
                &both[..]
            }
            None => std::slice::from_ref(&arm),
        };
        // SAFETY: a cancellation refers to no memory. `recv_hdr` is boxed
        // in `self` and stays until `Drop` has seen every receive end
        // (`recv_live`); the buffers it fills belong to the registered
        // buffer ring, handed over and back under `BufRing`'s rules.
        if !unsafe { self.push(es)? } {
            return Ok(Arm::Full);
        }
        self.recv_gen = gen;
        self.recv[k] = Some((gen, me));
        self.recv_live += 1;
        Ok(Arm::Queued)
    }

    /// The slot at `i`.
    pub(super) fn slot_mut(&mut self, i: usize) -> &mut SendSlot {
        &mut self.slots[i]
    }

    /// Number of send slots.
    pub(super) fn slots(&self) -> usize {
        self.slots.len()
    }

    /// Sends messages `0..n` of slot `i` on `fd` (`n > 1`: segments one by
    /// one), with zero copy if `zc`. What the submission queue has no room
    /// for (see [`push`](Self::push)) waits, the slot kept busy, until
    /// [`send_deferred`](Self::send_deferred) pushes it: a send is never
    /// dropped for want of room.
    pub(super) fn send(&mut self, i: usize, n: usize, fd: RawFd, zc: bool) -> io::Result<()> {
        let slot = &mut self.slots[i];
        if !slot.is_free() || n == 0 || n > slot.msgs.len() {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "slot busy"));
        }
        // Behind the sends already waiting, if any: datagrams leave in the
        // order they were made.
        slot.deferred = true;
        self.deferred.push_back(DeferredSend {
            slot: i,
            next: 0,
            n,
            fd,
            zc,
        });
        self.send_deferred().map(|_| ())
    }

    /// Pushes the sends that wait for room in the submission queue, in
    /// order, as far as it takes them. True once none waits.
    pub(super) fn send_deferred(&mut self) -> io::Result<bool> {
        while let Some(mut d) = self.deferred.pop_front() {
            let pushed = self.push_send(&mut d);
            if !matches!(pushed, Ok(true)) {
                // The rest of its messages stay first in line.
                self.deferred.push_front(d);
                return pushed;
            }
            self.slots[d.slot].deferred = false;
        }
        Ok(true)
    }

    /// Whether sends wait for room in the submission queue.
    pub(super) fn has_deferred(&self) -> bool {
        !self.deferred.is_empty()
    }

    /// Pushes the messages of `d` not yet pushed, one request each, while
    /// the queue has room. True once all are in.
    fn push_send(&mut self, d: &mut DeferredSend) -> io::Result<bool> {
        while d.next < d.n {
            let hdr: *const libc::msghdr = &self.slots[d.slot].msgs[d.next].hdr;
            let e = if d.zc {
                opcode::SendMsgZc::new(Fd(d.fd), hdr)
                    .ioprio(SEND_ZC_REPORT_USAGE)
                    .build()
            } else {
                opcode::SendMsg::new(Fd(d.fd), hdr).build()
            }
            .user_data(TAG_SEND | d.slot as u64);
            // SAFETY: the `msghdr`, its `iovec`s, the data, the address and
            // the control data all live in slot `d.slot` of the boxed, never
            // resized slot array (a gathered send's payloads outside it are
            // the `set_gather` caller's promise). The slot has been busy
            // since `send` (its `deferred` flag until the last message is
            // pushed, then `inflight`, which counts this request from now
            // on), so `parts_mut`/`set_msg`/`set_gather` refuse to touch it
            // until its last completion (the notification for zero copy),
            // and `Drop` waits for that.
            if !unsafe { self.push(std::slice::from_ref(&e))? } {
                return Ok(false);
            }
            self.slots[d.slot].inflight += 1;
            d.next += 1;
        }
        Ok(true)
    }

    /// Records a send completion of slot `i`; returns what it was.
    pub(super) fn send_done(&mut self, i: usize, cqe: &cqueue::Entry) -> Option<SendCqe> {
        let slot = self.slots.get_mut(i)?;
        let flags = cqe.flags();
        if cqueue::notif(flags) {
            slot.inflight = slot.inflight.saturating_sub(1);
            return Some(SendCqe::Notif {
                copied: cqe.result() & NOTIF_USAGE_ZC_COPIED != 0,
            });
        }
        if !cqueue::more(flags) {
            // No notification follows: the kernel is done with the slot.
            slot.inflight = slot.inflight.saturating_sub(1);
        }
        Some(SendCqe::Result(cqe.result()))
    }

    /// Arms a timeout `after` from now, tagged `TAG_TIMER | gen`. False if
    /// the submission queue is full (see [`push`](Self::push)): not armed.
    pub(super) fn arm_timer(&mut self, after: Duration, gen: u64) -> io::Result<bool> {
        *self.timespec = Timespec::new()
            .sec(after.as_secs())
            .nsec(after.subsec_nanos());
        let e = opcode::Timeout::new(&*self.timespec)
            .build()
            .user_data(TAG_TIMER | gen);
        // SAFETY: the kernel copies the `timespec` while it prepares the
        // request, during the next submission; it is boxed in `self`, so it
        // outlives that. (Overwriting it before a submission only changes the
        // deadline read, never the memory's validity.)
        unsafe { self.push(std::slice::from_ref(&e)) }
    }

    /// Arms a multishot poll for readability of `fd` (the waker), tagged
    /// `TAG_WAKE | gen`. False if the submission queue is full (see
    /// [`push`](Self::push)): not armed.
    pub(super) fn arm_wake(&mut self, fd: RawFd, gen: u64) -> io::Result<bool> {
        let e = opcode::PollAdd::new(Fd(fd), libc::POLLIN as u32)
            .multi(true)
            .build()
            .user_data(TAG_WAKE | gen);
        // SAFETY: a poll refers to no memory of ours, only to the descriptor
        // (the kernel holds its own reference to the file while it polls).
        unsafe { self.push(std::slice::from_ref(&e)) }
    }

    /// Cancels the request tagged `user_data`. False if the submission
    /// queue is full (see [`push`](Self::push)): nothing queued.
    pub(super) fn cancel(&mut self, user_data: u64) -> io::Result<bool> {
        let e = opcode::AsyncCancel::new(user_data)
            .build()
            .user_data(TAG_CTRL);
        // SAFETY: a cancellation refers to no memory.
        unsafe { self.push(std::slice::from_ref(&e)) }
    }

    /// Removes the timer tagged `TAG_TIMER | gen`. False if the submission
    /// queue is full (see [`push`](Self::push)): nothing queued.
    pub(super) fn remove_timer(&mut self, gen: u64) -> io::Result<bool> {
        let e = opcode::TimeoutRemove::new(TAG_TIMER | gen)
            .build()
            .user_data(TAG_CTRL);
        // SAFETY: refers to no memory (only the other request's user_data).
        unsafe { self.push(std::slice::from_ref(&e)) }
    }

    /// Tests: makes every submission take nothing (`true`) or work again.
    #[cfg(test)]
    pub(super) fn refuse_submissions(&mut self, refuse: bool) {
        self.refuse_submissions = refuse;
    }

    /// Submits what is queued and waits for `want` completions.
    pub(super) fn submit(&mut self, want: usize) -> io::Result<()> {
        #[cfg(test)]
        if self.refuse_submissions {
            // What an enter the kernel answers with EBUSY or EAGAIN does
            // (the answers this function lets pass): nothing submitted,
            // nothing waited for.
            return Ok(());
        }
        match self.ring.submit_and_wait(want) {
            Ok(_) => Ok(()),
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EINTR | libc::EBUSY | libc::EAGAIN | libc::ETIME)
                ) =>
            {
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// Whether completions wait to be reaped (read in shared memory, no
    /// system call).
    pub(super) fn completions_ready(&mut self) -> bool {
        !self.ring.completion().is_empty()
    }

    /// Whether the kernel holds completions that only an enter posts: task
    /// work (`IORING_SQ_TASKRUN`), or completions that found the queue full
    /// and wait on the kernel's overflow list (`IORING_SQ_CQ_OVERFLOW`;
    /// among them perhaps a multishot receive's last, which must be seen
    /// before the receive is armed again). Both flags are in shared memory.
    pub(super) fn kernel_holds_completions(&mut self) -> bool {
        let sq = self.ring.submission();
        sq.taskrun() || sq.cq_overflow()
    }

    /// Whether submissions are queued.
    pub(super) fn queued(&mut self) -> bool {
        !self.ring.submission().is_empty()
    }

    /// Moves the ready completions into an internal list and returns it
    /// (taken: give it back with [`restore`](Self::restore)). Keeps the
    /// receive bookkeeping: a receive completion without `F_MORE` ends it.
    pub(super) fn reap(&mut self) -> Vec<cqueue::Entry> {
        let mut out = std::mem::take(&mut self.cqes);
        out.clear();
        out.extend(self.ring.completion());
        for c in &out {
            if c.user_data() & TAG_MASK == TAG_RECV && !cqueue::more(c.flags()) {
                self.recv_live = self.recv_live.saturating_sub(1);
                let ud = c.user_data();
                if let Some(r) = self.recv.get_mut(recv_socket(ud)) {
                    if r.is_some_and(|(g, _)| recv_user_data(recv_socket(ud), g) == ud) {
                        *r = None;
                    }
                }
            }
        }
        out
    }

    /// Gives the completion list back for reuse.
    pub(super) fn restore(&mut self, v: Vec<cqueue::Entry>) {
        self.cqes = v;
    }

    /// The datagram bytes of a receive completion (`io_uring_recvmsg_out`,
    /// name, control, payload), taken back from the kernel. Call
    /// [`recycle`](Self::recycle) with the buffer id when done.
    pub(super) fn recv_buf(&mut self, cqe: &cqueue::Entry) -> Option<(u16, &[u8], &libc::msghdr)> {
        let bid = cqueue::buffer_select(cqe.flags())?;
        let len = usize::try_from(cqe.result()).ok()?;
        let data = self.bufs.take(bid, len)?;
        Some((bid, data, &self.recv_hdr))
    }

    /// Hands a receive buffer back to the kernel (published by [`publish`](Self::publish)).
    pub(super) fn recycle(&mut self, bid: u16) {
        self.bufs.give(bid);
    }

    /// Publishes the recycled receive buffers.
    pub(super) fn publish(&mut self) {
        self.bufs.publish();
    }

    /// Cancels every request and waits (bounded) until the kernel holds no
    /// memory of ours. True if it got there. Messages of deferred sends
    /// not yet pushed are dropped: the kernel never saw them.
    pub(super) fn drain(&mut self) -> bool {
        let e = opcode::AsyncCancel2::new(CancelBuilder::any())
            .build()
            .user_data(TAG_CTRL);
        let deadline = std::time::Instant::now() + Duration::from_secs(2);
        let mut cancelled = false;
        loop {
            if !cancelled {
                // A full queue the kernel takes nothing from (see `push`)
                // takes the cancellation on a later round, once the
                // completions reaped below have made room.
                // SAFETY: a cancellation refers to no memory.
                match unsafe { self.push(std::slice::from_ref(&e)) } {
                    Ok(queued) => cancelled = queued,
                    Err(_) => return false,
                }
            }
            // Receive buffers come back to us with their completion; we never
            // read them again, so they need not be recycled.
            let cqes = self.reap();
            for c in &cqes {
                if c.user_data() & TAG_MASK == TAG_SEND {
                    let i = (c.user_data() & !TAG_MASK) as usize;
                    let _ = self.send_done(i, c);
                }
            }
            self.restore(cqes);
            let busy = self.recv_live > 0 || self.slots.iter().any(|s| s.inflight != 0);
            if !busy {
                return true;
            }
            let now = std::time::Instant::now();
            if now >= deadline {
                return false;
            }
            let left = deadline - now;
            let ts = Timespec::new()
                .sec(left.as_secs())
                .nsec(left.subsec_nanos());
            let args = SubmitArgs::new().timespec(&ts);
            match self.ring.submitter().submit_with_args(1, &args) {
                Ok(_) => {}
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::EINTR | libc::ETIME | libc::EBUSY)
                    ) => {}
                Err(_) => return false,
            }
        }
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        if !self.drain() {
            tracing::warn!("io_uring requests did not finish at drop: leaking their memory");
            // `ManuallyDrop` of moved-out parts: the ring fd is closed (the
            // kernel keeps its own references) but no memory is freed.
            let slots = std::mem::take(&mut self.slots);
            let _ = ManuallyDrop::new(slots);
            let hdr = std::mem::replace(&mut self.recv_hdr, Box::new(zeroed_msghdr()));
            let _ = ManuallyDrop::new(hdr);
            return; // `bufs` is still registered: its `Drop` leaks it.
        }
        if self
            .ring
            .submitter()
            .unregister_buf_ring(self.bufs.bgid)
            .is_ok()
        {
            self.bufs.registered = false;
        }
        // The fields drop now: the ring first (declaration order), then the
        // memory, which the kernel no longer references.
    }
}

/// Capabilities of this kernel's io_uring, found once by [`uring_probe`](crate::uring_probe).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UringCaps {
    /// `IORING_OP_SENDMSG_ZC` exists (zero-copy sends possible).
    pub sendmsg_zc: bool,
}

/// Creates a throwaway ring and checks what the backend needs: the ring
/// itself, the opcodes (`RECVMSG`, `SENDMSG`, `TIMEOUT`, `TIMEOUT_REMOVE`,
/// `ASYNC_CANCEL`; `SEND_ZC`, which came with multishot `RECVMSG` in 6.0;
/// optionally `SENDMSG_ZC`) and a buffer ring registration.
pub(super) fn probe_kernel() -> Result<UringCaps, String> {
    let ring = IoUring::new(8).map_err(|e| format!("io_uring_setup failed: {e}"))?;
    let mut p = io_uring::Probe::new();
    ring.submitter()
        .register_probe(&mut p)
        .map_err(|e| format!("IORING_REGISTER_PROBE failed: {e}"))?;
    let need = [
        (opcode::RecvMsg::CODE, "RECVMSG"),
        (opcode::SendMsg::CODE, "SENDMSG"),
        (opcode::Timeout::CODE, "TIMEOUT"),
        (opcode::TimeoutRemove::CODE, "TIMEOUT_REMOVE"),
        (opcode::AsyncCancel::CODE, "ASYNC_CANCEL"),
        (
            opcode::SendZc::CODE,
            "SEND_ZC (kernel < 6.0: no multishot RECVMSG)",
        ),
    ];
    for (code, name) in need {
        if !p.is_supported(code) {
            return Err(format!("opcode IORING_OP_{name} unsupported"));
        }
    }
    let mut br = BufRing::new(1, 64, 0).map_err(|e| e.to_string())?;
    // SAFETY: `br` outlives the registration: it is unregistered (or, if
    // that fails, leaked by its `Drop`) before it goes out of scope, and no
    // request ever uses it.
    unsafe {
        ring.submitter()
            .register_buf_ring_with_flags(br.ring.as_ptr() as u64, 1, 0, 0)
            .map_err(|e| format!("IORING_REGISTER_PBUF_RING failed: {e}"))?;
    }
    br.registered = true;
    if ring.submitter().unregister_buf_ring(0).is_ok() {
        br.registered = false;
    }
    Ok(UringCaps {
        sendmsg_zc: p.is_supported(opcode::SendMsgZc::CODE),
    })
}

/// The calling thread's id, read once per thread (`thread::current`
/// clones a handle each call, and every turn asks for every socket).
pub(super) fn this_thread() -> std::thread::ThreadId {
    thread_local! {
        static ME: std::thread::ThreadId = std::thread::current().id();
    }
    ME.with(|me| *me)
}
