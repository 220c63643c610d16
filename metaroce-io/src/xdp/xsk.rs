//! An AF_XDP socket, its UMEM and its four rings.
//!
//! Written against the kernel's documented interface
//! (`Documentation/networking/af_xdp.rst`, `<linux/if_xdp.h>`) rather than
//! on a crate: `xdpilone` (the one pure-Rust ring crate kept up to date) is
//! EUPL-1.2, outside the permissive licences this workspace takes
//! (`deny.toml`); `xsk-rs` builds `libxdp` and `libbpf` from C through
//! `libxdp-sys`, which would put a C and BPF toolchain on every machine
//! that builds metaroce; `afxdp` has not been updated since 2021. The rings
//! are four single-producer single-consumer queues in shared memory, so the
//! code is small: an index pair per ring, read and written with
//! acquire/release ordering as the kernel's side does.
//!
//! One UMEM of `frames` chunks of [`FRAME`] bytes (aligned mode): the first
//! half is given to the fill ring for receiving, the second half is the
//! transmit pool, returned through the completion ring.

pub use crate::config::XdpMode;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU32, Ordering};

/// Bytes per UMEM chunk (one page: aligned mode's largest).
pub(crate) const FRAME: usize = 4096;
/// Headroom the kernel leaves before a received frame (`XDP_PACKET_HEADROOM`).
pub(crate) const RX_HEADROOM: usize = 256;
/// The largest frame received into one chunk.
pub(crate) const MAX_RX_FRAME: usize = FRAME - RX_HEADROOM;
/// Bytes of transmit metadata before each sent frame
/// (`struct xsk_tx_metadata`: 24 bytes since its launch time), where the
/// kernel has it (6.8 and later).
const TX_META: usize = 24;

/// Anonymous memory mapped for the UMEM or a ring.
#[derive(Debug)]
struct Mmap {
    ptr: *mut u8,
    len: usize,
}

impl Mmap {
    fn map(len: usize, fd: Option<(i32, u64)>) -> io::Result<Mmap> {
        let (flags, fd, off) = match fd {
            Some((fd, off)) => (libc::MAP_SHARED | libc::MAP_POPULATE, fd, off),
            None => (
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE,
                -1,
                0,
            ),
        };
        // SAFETY: a fresh mapping at an address of the kernel's choosing;
        // `fd` (when given) is an open AF_XDP socket and `off` one of the
        // ring offsets it documents.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                flags,
                fd,
                off as libc::off_t,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mmap {
            ptr: ptr.cast(),
            len,
        })
    }
}

impl Drop for Mmap {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are exactly what mmap returned, unmapped once.
        unsafe {
            libc::munmap(self.ptr.cast(), self.len);
        }
    }
}

/// One ring: entries of `T` (a `u64` frame address for fill and completion,
/// an `xdp_desc` for receive and transmit).
#[derive(Debug)]
struct Ring<T> {
    /// The ring's mapping, kept for as long as the pointers below are used.
    _map: Mmap,
    producer: *const AtomicU32,
    consumer: *const AtomicU32,
    flags: *const AtomicU32,
    desc: *mut T,
    mask: u32,
    /// Our copy of the index we own, and the last seen value of the other.
    head: u32,
    seen: u32,
}

impl<T: Copy> Ring<T> {
    fn map(fd: i32, pgoff: u64, off: &libc::xdp_ring_offset, size: u32) -> io::Result<Ring<T>> {
        let len = off.desc as usize + size as usize * std::mem::size_of::<T>();
        let map = Mmap::map(len, Some((fd, pgoff)))?;
        // SAFETY: the offsets come from XDP_MMAP_OFFSETS for this socket
        // and lie within the `len` bytes mapped.
        let at = |o: u64| unsafe { map.ptr.add(o as usize) };
        let (producer, consumer, flags, desc) = (
            at(off.producer).cast::<AtomicU32>(),
            at(off.consumer).cast::<AtomicU32>(),
            at(off.flags).cast::<AtomicU32>(),
            at(off.desc).cast::<T>(),
        );
        Ok(Ring {
            _map: map,
            producer,
            consumer,
            flags,
            desc,
            mask: size - 1,
            head: 0,
            seen: 0,
        })
    }

    fn prod(&self) -> &AtomicU32 {
        // SAFETY: points into the ring's live mapping, 4-byte aligned, and
        // the kernel accesses it only atomically.
        unsafe { &*self.producer }
    }
    fn cons(&self) -> &AtomicU32 {
        // SAFETY: as for `prod`.
        unsafe { &*self.consumer }
    }

    /// Whether the kernel asks to be woken for this ring.
    fn needs_wakeup(&self) -> bool {
        // SAFETY: as for `prod`.
        unsafe { &*self.flags }.load(Ordering::Relaxed) & libc::XDP_RING_NEED_WAKEUP != 0
    }

    fn slot(&self, idx: u32) -> *mut T {
        // SAFETY: `idx & mask` is below the ring's size, within the mapping.
        unsafe { self.desc.add((idx & self.mask) as usize) }
    }

    // --- as the producer (fill, transmit) ---

    /// Free entries to produce into.
    fn free(&mut self) -> u32 {
        // `seen` is the consumer's index: free = size - (head - consumer).
        self.seen = self.cons().load(Ordering::Acquire);
        (self.mask + 1) - self.head.wrapping_sub(self.seen)
    }

    /// Writes `v` at the next entry (after [`free`] said there is room).
    fn push(&mut self, v: T) {
        // SAFETY: the entry is ours until `publish` hands it to the kernel.
        unsafe { self.slot(self.head).write(v) };
        self.head = self.head.wrapping_add(1);
    }

    /// Hands every pushed entry to the kernel.
    fn publish(&self) {
        self.prod().store(self.head, Ordering::Release);
    }

    // --- as the consumer (receive, completion) ---

    /// Entries ready to read.
    fn ready(&mut self) -> u32 {
        if self.seen == self.head {
            self.seen = self.prod().load(Ordering::Acquire);
        }
        self.seen.wrapping_sub(self.head)
    }

    /// The `k`th ready entry (`k` below [`ready`]).
    fn peek(&self, k: u32) -> T {
        // SAFETY: the kernel published this entry (below its producer
        // index) and does not touch it until we release it.
        unsafe { self.slot(self.head.wrapping_add(k)).read() }
    }

    /// Gives `n` read entries back.
    fn release(&mut self, n: u32) {
        self.head = self.head.wrapping_add(n);
        self.cons().store(self.head, Ordering::Release);
    }
}

/// Ring and socket statistics (`XDP_STATISTICS`) and fill levels.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct XskStats {
    /// Frames the kernel dropped for other reasons than a full ring.
    pub rx_dropped: u64,
    /// Frames dropped because the receive ring was full.
    pub rx_ring_full: u64,
    /// Times the kernel found the fill ring empty (a frame dropped for lack
    /// of a buffer).
    pub rx_fill_ring_empty: u64,
    /// Invalid descriptors the kernel saw on receive and transmit.
    pub invalid_descs: u64,
    /// Kicks of the transmit ring after which the device had dropped a
    /// frame (copy mode).
    pub tx_dropped: u64,
    /// Frames waiting in the fill ring for the kernel, at the last look.
    pub fill_level: u32,
    /// Frames free for transmitting, at the last look.
    pub tx_free: u32,
}

/// An AF_XDP socket bound to one queue of one interface.
#[derive(Debug)]
pub(crate) struct Xsk {
    // Field order is drop order: rings, then the socket, then the UMEM.
    fill: Ring<u64>,
    comp: Ring<u64>,
    rx: Ring<libc::xdp_desc>,
    tx: Ring<libc::xdp_desc>,
    fd: OwnedFd,
    umem: Mmap,
    /// Transmit frames not in flight.
    tx_pool: Vec<u64>,
    /// Received chunks waiting for room in the fill ring.
    fill_backlog: Vec<u64>,
    /// Transmit descriptors pushed and not yet published.
    tx_pending: u32,
    pub(crate) mode: XdpMode,
    /// Whether each transmit frame has room for metadata before it.
    tx_meta: bool,
    /// Whether frames carry transmit metadata asking for the UDP checksum:
    /// in copy mode, where the kernel fills it in (or marks the packet for
    /// the NIC to). A zero-copy driver may not implement the request, and
    /// there is no cheap way to ask, so there the driver computes it.
    pub(crate) csum_offload: bool,
    /// Kicks after which the device had dropped a frame.
    tx_dropped: std::cell::Cell<u64>,
    pub(crate) rx_frames: u32,
    pub(crate) tx_frames: u32,
}

// SAFETY: the raw pointers point into mappings this struct owns; the
// socket is used by one thread at a time (`&mut self`).
unsafe impl Send for Xsk {}

fn sockopt<T>(fd: i32, opt: libc::c_int, v: &T) -> io::Result<()> {
    // SAFETY: `v` is a live value of the type the option expects, of the
    // size passed.
    let r = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_XDP,
            opt,
            (v as *const T).cast(),
            std::mem::size_of::<T>() as libc::socklen_t,
        )
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// `getsockopt(2)` at level `SOL_XDP` into `v`; returns the length written.
fn getsockopt<T>(fd: i32, opt: libc::c_int, v: &mut T) -> io::Result<usize> {
    let mut len = std::mem::size_of::<T>() as libc::socklen_t;
    // SAFETY: `v` is writable for `len` bytes; the kernel writes at most that.
    let r = unsafe { libc::getsockopt(fd, libc::SOL_XDP, opt, (v as *mut T).cast(), &mut len) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(len as usize)
    }
}

/// What to open.
#[derive(Debug, Clone, Copy)]
pub(crate) struct XskConfig {
    pub ifindex: u32,
    pub queue: u32,
    /// UMEM chunks (a power of two, at least 64).
    pub frames: u32,
    /// Entries of each ring (a power of two).
    pub ring: u32,
    /// `Some(true)`: zero copy or fail; `Some(false)`: copy mode; `None`:
    /// zero copy where the driver has it, else copy.
    pub zero_copy: Option<bool>,
}

impl Xsk {
    /// Creates the socket, registers the UMEM, maps the rings and binds.
    pub(crate) fn open(cfg: XskConfig) -> io::Result<Xsk> {
        // SAFETY: plain socket(2).
        let fd = unsafe { libc::socket(libc::AF_XDP, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a new descriptor nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let raw = fd.as_raw_fd();
        let frames = cfg.frames.max(64).next_power_of_two();
        let umem = Mmap::map(frames as usize * FRAME, None)?;
        // Transmit metadata, to ask for the UDP checksum by offload (the
        // NIC computes it; copy mode marks the packet for the kernel to),
        // where the kernel takes it; else the driver computes it.
        // (Since 6.11 the length counts only with XDP_UMEM_TX_METADATA_LEN.)
        let reg = |meta: usize| libc::xdp_umem_reg {
            addr: umem.ptr as u64,
            len: umem.len as u64,
            chunk_size: FRAME as u32,
            headroom: 0,
            flags: if meta > 0 {
                libc::XDP_UMEM_TX_METADATA_LEN
            } else {
                0
            },
            tx_metadata_len: meta as u32,
        };
        let tx_meta = match sockopt(raw, libc::XDP_UMEM_REG, &reg(TX_META)) {
            Ok(()) => true,
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                tracing::debug!("no AF_XDP transmit metadata here: checksums in software");
                sockopt(raw, libc::XDP_UMEM_REG, &reg(0))?;
                false
            }
            Err(e) => return Err(e),
        };
        let ring = cfg.ring.max(64).next_power_of_two().min(frames / 2);
        for opt in [
            libc::XDP_UMEM_FILL_RING,
            libc::XDP_UMEM_COMPLETION_RING,
            libc::XDP_RX_RING,
            libc::XDP_TX_RING,
        ] {
            sockopt(raw, opt, &ring)?;
        }
        let off = xdp_offsets(raw)?;
        let fill = Ring::map(raw, libc::XDP_UMEM_PGOFF_FILL_RING, &off.fr, ring)?;
        let comp = Ring::map(raw, libc::XDP_UMEM_PGOFF_COMPLETION_RING, &off.cr, ring)?;
        let rx = Ring::map(raw, libc::XDP_PGOFF_RX_RING as u64, &off.rx, ring)?;
        let tx = Ring::map(raw, libc::XDP_PGOFF_TX_RING as u64, &off.tx, ring)?;
        let mut xsk = Xsk {
            fill,
            comp,
            rx,
            tx,
            fd,
            umem,
            tx_pool: Vec::new(),
            fill_backlog: Vec::new(),
            tx_pending: 0,
            mode: XdpMode::Copy,
            tx_meta,
            csum_offload: false,
            tx_dropped: std::cell::Cell::new(0),
            rx_frames: 0,
            tx_frames: 0,
        };
        // Receive frames into the fill ring before binding, the rest to send.
        let rx_frames = ring.min(frames / 2);
        for k in 0..rx_frames {
            xsk.fill.free();
            xsk.fill.push(u64::from(k) * FRAME as u64);
        }
        xsk.fill.publish();
        xsk.tx_pool = (rx_frames..frames)
            .rev()
            .map(|k| u64::from(k) * FRAME as u64)
            .collect();
        xsk.rx_frames = rx_frames;
        xsk.tx_frames = frames - rx_frames;
        let bind = |flags: u16| {
            let sa = libc::sockaddr_xdp {
                sxdp_family: libc::AF_XDP as u16,
                sxdp_flags: flags | libc::XDP_USE_NEED_WAKEUP,
                sxdp_ifindex: cfg.ifindex,
                sxdp_queue_id: cfg.queue,
                sxdp_shared_umem_fd: 0,
            };
            // SAFETY: `sa` is a valid sockaddr_xdp of the length passed.
            let r = unsafe {
                libc::bind(
                    raw,
                    (&sa as *const libc::sockaddr_xdp).cast(),
                    std::mem::size_of::<libc::sockaddr_xdp>() as libc::socklen_t,
                )
            };
            if r < 0 {
                Err(io::Error::last_os_error())
            } else {
                Ok(())
            }
        };
        xsk.mode = match cfg.zero_copy {
            Some(true) => bind(libc::XDP_ZEROCOPY).map(|()| XdpMode::ZeroCopy)?,
            Some(false) => bind(libc::XDP_COPY).map(|()| XdpMode::Copy)?,
            None => match bind(libc::XDP_ZEROCOPY) {
                Ok(()) => XdpMode::ZeroCopy,
                Err(e) => {
                    tracing::debug!(error = %e, "no zero-copy AF_XDP here; copy mode");
                    bind(libc::XDP_COPY).map(|()| XdpMode::Copy)?
                }
            },
        };
        xsk.csum_offload = xsk.tx_meta && xsk.mode == XdpMode::Copy;
        Ok(xsk)
    }

    pub(crate) fn fd(&self) -> i32 {
        self.fd.as_raw_fd()
    }

    /// Calls `f` with each received frame (the whole Ethernet frame), at
    /// most `max` of them, then gives their chunks back to the fill ring.
    /// Returns how many there were.
    pub(crate) fn receive(&mut self, max: u32, mut f: impl FnMut(&[u8])) -> u32 {
        self.refill();
        let n = self.rx.ready().min(max);
        if n == 0 {
            return 0;
        }
        // The fill ring has room for every chunk it lent out, once the
        // kernel says it took them: it publishes its consumer index of the
        // fill ring lazily, so what it took but has not said waits here.
        let room = self.fill.free();
        for k in 0..n {
            let d = self.rx.peek(k);
            let ok = (d.addr as usize)
                .checked_add(d.len as usize)
                .is_some_and(|end| end <= self.umem.len);
            if ok {
                // SAFETY: the kernel filled `len` bytes at `addr` of the
                // UMEM (checked to lie within it) and leaves the chunk
                // alone until it is in the fill ring again.
                let frame = unsafe {
                    std::slice::from_raw_parts(self.umem.ptr.add(d.addr as usize), d.len as usize)
                };
                f(frame);
            }
            let chunk = d.addr & !(FRAME as u64 - 1);
            if room > k {
                self.fill.push(chunk);
            } else {
                self.fill_backlog.push(chunk);
            }
        }
        self.rx.release(n);
        self.fill.publish();
        n
    }

    /// Gives the fill ring the chunks that waited for room in it.
    fn refill(&mut self) {
        if self.fill_backlog.is_empty() {
            return;
        }
        let room = self.fill.free() as usize;
        let k = room.min(self.fill_backlog.len());
        for chunk in self.fill_backlog.drain(..k) {
            self.fill.push(chunk);
        }
        if k > 0 {
            self.fill.publish();
        }
    }

    /// Whether received frames wait in the ring (one shared-memory load:
    /// no system call).
    pub(crate) fn rx_pending(&mut self) -> bool {
        self.rx.ready() > 0
    }

    /// Takes back the transmit frames the kernel is done with.
    fn reap(&mut self) {
        let n = self.comp.ready();
        for k in 0..n {
            // The frame's start, past its metadata: the chunk is the key.
            self.tx_pool.push(self.comp.peek(k) & !(FRAME as u64 - 1));
        }
        if n > 0 {
            self.comp.release(n);
        }
    }

    /// A free transmit frame to fill, if any: its chunk's address and the
    /// bytes the frame may take (past the metadata, where there is some).
    pub(crate) fn tx_frame(&mut self) -> Option<(u64, &mut [u8])> {
        if self.tx_pool.is_empty() {
            self.reap();
        }
        if self.tx.free() == 0 {
            return None;
        }
        let chunk = *self.tx_pool.last()?;
        let skip = if self.tx_meta { TX_META } else { 0 };
        // SAFETY: the chunk at `chunk` is in the pool: not lent to the
        // kernel; the slice stays within it.
        let buf = unsafe {
            std::slice::from_raw_parts_mut(self.umem.ptr.add(chunk as usize + skip), FRAME - skip)
        };
        Some((chunk, buf))
    }

    /// Queues the frame [`tx_frame`] gave (`len` bytes of it) for sending;
    /// `csum`: where the UDP checksum starts and where its field is, for
    /// the NIC (or the kernel) to fill in (only with [`csum_offload`]: the
    /// field then holds the pseudo-header's sum).
    pub(crate) fn send(&mut self, chunk: u64, len: usize, csum: Option<(u16, u16)>) {
        let popped = self.tx_pool.pop();
        debug_assert_eq!(popped, Some(chunk));
        let (addr, options) = match (self.tx_meta, csum.filter(|_| self.csum_offload)) {
            (true, Some((start, offset))) => {
                let mut meta = [0u8; TX_META];
                meta[..8].copy_from_slice(&u64::from(libc::XDP_TXMD_FLAGS_CHECKSUM).to_ne_bytes());
                meta[8..10].copy_from_slice(&start.to_ne_bytes());
                meta[10..12].copy_from_slice(&offset.to_ne_bytes());
                // SAFETY: the chunk is ours (popped from the pool above) and
                // its first TX_META bytes are the metadata area.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        meta.as_ptr(),
                        self.umem.ptr.add(chunk as usize),
                        TX_META,
                    )
                };
                (chunk + TX_META as u64, libc::XDP_TX_METADATA)
            }
            (true, None) => (chunk + TX_META as u64, 0),
            (false, _) => (chunk, 0),
        };
        self.tx.push(libc::xdp_desc {
            addr,
            len: len as u32,
            options,
        });
        self.tx_pending += 1;
    }

    /// Publishes queued frames and kicks the kernel when it asks to be.
    /// Returns whether any frame was published.
    pub(crate) fn flush(&mut self) -> io::Result<bool> {
        if self.tx_pending == 0 {
            return Ok(false);
        }
        self.tx.publish();
        self.tx_pending = 0;
        if self.mode == XdpMode::Copy || self.tx.needs_wakeup() {
            self.kick()?;
        }
        self.reap();
        Ok(true)
    }

    /// Asks the kernel to send what the transmit ring holds. In copy mode
    /// it sends at most a batch (32 frames) per call and says `EAGAIN`
    /// while more wait: call again, a few times at most.
    fn kick(&self) -> io::Result<()> {
        for _ in 0..16 {
            // SAFETY: a zero-length send on our socket: no buffer is read.
            let r = unsafe {
                libc::sendto(
                    self.fd(),
                    std::ptr::null(),
                    0,
                    libc::MSG_DONTWAIT,
                    std::ptr::null(),
                    0,
                )
            };
            if r >= 0 {
                return Ok(());
            }
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                // More to send, or the device was busy: again.
                Some(libc::EAGAIN) => continue,
                // Out of buffers: the frames stay in the ring for the next
                // kick.
                Some(libc::ENOBUFS) => return Ok(()),
                // The device dropped a frame (its chunk comes back through
                // the completion ring): a loss the protocol recovers.
                Some(libc::EBUSY) | Some(libc::ENETDOWN) => {
                    self.tx_dropped.set(self.tx_dropped.get() + 1);
                    continue;
                }
                _ => return Err(e),
            }
        }
        Ok(())
    }

    /// Whether a kick is owed for frames published while the kernel was
    /// busy (copy mode sends at most a batch per kick).
    pub(crate) fn tx_outstanding(&mut self) -> bool {
        self.tx.free() < self.tx.mask + 1
    }

    /// Kicks the transmit ring again when frames wait in it.
    pub(crate) fn retry_kick(&mut self) -> io::Result<()> {
        if self.tx_outstanding() {
            self.kick()?;
            self.reap();
        }
        Ok(())
    }

    /// The socket's statistics and ring levels.
    pub(crate) fn stats(&self) -> XskStats {
        let mut s = libc::xdp_statistics {
            rx_dropped: 0,
            rx_invalid_descs: 0,
            tx_invalid_descs: 0,
            rx_ring_full: 0,
            rx_fill_ring_empty_descs: 0,
            tx_ring_empty_descs: 0,
        };
        let _ = getsockopt(self.fd(), libc::XDP_STATISTICS, &mut s);
        let fill_level = self
            .fill
            .head
            .wrapping_sub(self.fill.cons().load(Ordering::Acquire));
        XskStats {
            rx_dropped: s.rx_dropped,
            rx_ring_full: s.rx_ring_full,
            rx_fill_ring_empty: s.rx_fill_ring_empty_descs,
            invalid_descs: s.rx_invalid_descs + s.tx_invalid_descs,
            fill_level,
            tx_dropped: self.tx_dropped.get(),
            tx_free: self.tx_pool.len() as u32,
        }
    }
}

fn xdp_offsets(fd: i32) -> io::Result<libc::xdp_mmap_offsets> {
    let zero = libc::xdp_ring_offset {
        producer: 0,
        consumer: 0,
        desc: 0,
        flags: 0,
    };
    let mut v = libc::xdp_mmap_offsets {
        rx: zero,
        tx: zero,
        fr: zero,
        cr: zero,
    };
    let len = getsockopt(fd, libc::XDP_MMAP_OFFSETS, &mut v)?;
    if len != std::mem::size_of::<libc::xdp_mmap_offsets>() {
        return Err(io::Error::other(
            "this kernel's AF_XDP ring offsets have no flags field (kernel before 5.4)",
        ));
    }
    Ok(v)
}
