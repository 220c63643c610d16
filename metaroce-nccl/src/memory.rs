//! The plugin's one way to the application's memory: NCCL's own buffers,
//! registered in place.
//!
//! `regMr(comm, data, size)` registers the `size` bytes at `data` with the
//! comm's protection domain as they are ([`AppRegion::register`], over
//! [`ProtectionDomain::reg_mr_raw`]); `isend` and `irecv` name byte ranges
//! of that region directly ([`AppRegion::sge`], [`AppRegion::remote`]), so
//! the transport reads a message from NCCL's buffer and places a received
//! one into NCCL's buffer, with no copy; `deregMr` deregisters it
//! ([`AppRegion::dereg`]). Every `regMr` is a region of its own, even of
//! memory registered before or overlapping another registration (as
//! `ibv_reg_mr` allows).
//!
//! # Why the plugin may promise what `reg_mr_raw` asks
//!
//! `reg_mr_raw` is `unsafe`: its caller promises that the memory stays
//! valid until `dereg` returned `Ok`, that nothing accesses it while the
//! registration runs, and that the application keeps off the bytes a
//! transfer uses until its completion. NCCL's net-plugin contract gives
//! exactly that:
//!
//! - NCCL owns the buffer and frees it only after `deregMr` returned; the
//!   plugin's `deregMr` returns only once the region is deregistered
//!   ([`AppRegion::dereg`] waits while requests still use it), so the
//!   endpoint never reaches the memory after NCCL frees it;
//! - between `isend`/`irecv` and the `test` that reports the request done,
//!   NCCL neither writes the bytes of a send nor reads or writes the bytes
//!   of a receive; the plugin reports a send done only after its WRITE
//!   completed (every byte acknowledged) and a receive only after the
//!   completion of every message placed into it;
//! - NCCL registers a buffer before it uses it for transfers, not while a
//!   transfer of the same comm runs in it. Registration maps the pages with
//!   `madvise(MADV_POPULATE_WRITE)`, which changes no byte; only on kernels
//!   before 5.14 it touches a byte a page instead, so there a buffer must
//!   not be registered while a transfer fills memory it overlaps.
//!
//! The peer reaches a receive buffer only through the remote key and the
//! byte range this side advertised for one `irecv` (see [`crate::net`]);
//! the transport refuses a WRITE outside the region, and once the region
//! is deregistered its key is gone.

use crate::error::NetError;
use metaroce_io::{AccessFlags, ApiError, MemoryRegion, ProtectionDomain, Sge, VerbsError};
use std::future::Future;
use std::pin::pin;
use std::ptr::NonNull;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

/// Runs `f` to completion on this thread (parking between polls).
pub(crate) fn block_on<F: Future>(f: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    let mut f = pin!(f);
    loop {
        if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::park();
    }
}

/// An empty buffer: names no memory (the transport accepts it for a
/// zero-byte transfer without a region).
pub(crate) const EMPTY_SGE: Sge = Sge {
    lkey: 0,
    addr: 0,
    len: 0,
};

/// NCCL's memory that `regMr` registered (the `mhandle`).
#[derive(Debug)]
pub(crate) struct AppRegion {
    base: usize,
    len: usize,
    /// `None` for zero bytes (nothing to register).
    mr: Option<MemoryRegion>,
}

impl AppRegion {
    /// No memory: what a zero-byte transfer without a handle names.
    pub(crate) const EMPTY: AppRegion = AppRegion {
        base: 0,
        len: 0,
        mr: None,
    };

    /// Registers the `len` bytes at `base` in place with `pd`, with
    /// `access` (a receive comm's regions allow the peer's WRITE).
    ///
    /// # Safety
    /// The memory is NCCL's buffer, under NCCL's contract (see the module
    /// documentation): valid until [`dereg`](Self::dereg) returned, not
    /// used by NCCL while a request on it is outstanding.
    pub(crate) unsafe fn register(
        pd: &ProtectionDomain,
        base: *mut u8,
        len: usize,
        access: AccessFlags,
    ) -> Result<AppRegion, NetError> {
        let Some(ptr) = NonNull::new(base) else {
            if len == 0 {
                return Ok(AppRegion::EMPTY);
            }
            return Err(NetError::InvalidArgument("regMr of a NULL buffer".into()));
        };
        let mr = if len == 0 {
            None
        } else {
            // SAFETY: the caller's promise (NCCL's contract), which is the
            // one `reg_mr_raw` asks for; see the module documentation.
            Some(block_on(unsafe { pd.reg_mr_raw(ptr, len, access) })?)
        };
        Ok(AppRegion {
            base: base as usize,
            len,
            mr,
        })
    }

    /// Checks that `len` bytes at `ptr` lie inside the region; their
    /// offset in it.
    pub(crate) fn check(&self, ptr: *const u8, len: usize) -> Result<u64, NetError> {
        let p = ptr as usize;
        if len == 0 {
            return Ok(0);
        }
        if p >= self.base && p.saturating_add(len) <= self.base + self.len {
            Ok((p - self.base) as u64)
        } else {
            Err(NetError::InvalidArgument(format!(
                "{len} bytes at {p:#x} outside the registered {} bytes at {:#x}",
                self.len, self.base
            )))
        }
    }

    fn region(&self, len: usize) -> Result<Option<&MemoryRegion>, NetError> {
        let len_ok = u32::try_from(len).is_ok();
        if !len_ok {
            return Err(NetError::InvalidArgument("message over 4 GiB".into()));
        }
        Ok(if len == 0 { None } else { self.mr.as_ref() })
    }

    /// The `len` bytes at `ptr`, for a local work request (checked to lie
    /// inside the region).
    pub(crate) fn sge(&self, ptr: *const u8, len: usize) -> Result<Sge, NetError> {
        let off = self.check(ptr, len)?;
        match self.region(len)? {
            None => Ok(EMPTY_SGE),
            Some(mr) => Ok(mr.sge(off, len as u32)?),
        }
    }

    /// The remote key and address of the `len` bytes at `ptr`, for the
    /// peer to WRITE there (checked to lie inside the region).
    pub(crate) fn remote(&self, ptr: *const u8, len: usize) -> Result<(u32, u64), NetError> {
        let off = self.check(ptr, len)?;
        match self.region(len)? {
            None => Ok((0, 0)),
            Some(mr) => {
                let r = mr.remote().at(off, len as u32)?;
                Ok((r.rkey, r.addr))
            }
        }
    }

    /// Deregisters the region; returns only once the endpoint no longer
    /// reaches the memory (or has stopped).
    ///
    /// NCCL deregisters after its requests on the region completed, so the
    /// region is normally free at once. If requests still use it (a comm
    /// that failed with transfers in flight, which the transport completes
    /// with an error once they time out), this waits for them: the memory
    /// must not be given back to NCCL while the endpoint may still read or
    /// write it. It probes with [`MemoryRegion::lend`], which, unlike
    /// `dereg`, keeps the handle when the region is in use.
    pub(crate) fn dereg(self) -> Result<(), NetError> {
        let Some(mut mr) = self.mr else {
            return Ok(());
        };
        let start = Instant::now();
        let mut warned = false;
        loop {
            match block_on(mr.lend()) {
                Ok(lent) => {
                    drop(lent);
                    break;
                }
                Err(ApiError::Verbs(VerbsError::MrInUse(_))) => {
                    if !warned && start.elapsed() > Duration::from_secs(1) {
                        warned = true;
                        crate::log::warn(
                            line!(),
                            "deregMr: requests still use the region; waiting for them to end",
                        );
                    }
                    std::thread::sleep(Duration::from_micros(200));
                }
                // The endpoint has stopped: it reaches no memory any more.
                Err(ApiError::Closed) => return Ok(()),
                Err(e) => return Err(e.into()),
            }
        }
        match block_on(mr.dereg()) {
            Ok(_raw) => Ok(()),
            // The endpoint has stopped: it reaches no memory any more.
            Err(ApiError::Closed) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use metaroce_io::{connect_qp_pair, Backend, Device, DriverConfig};
    use std::sync::mpsc;

    fn device() -> Device {
        let mut c = DriverConfig::new("127.0.0.1:0".parse().unwrap());
        c.backend = Backend::Portable;
        block_on(Device::open(c)).unwrap()
    }

    /// A peer's SEND lands in a buffer registered in place, through a
    /// second, overlapping registration of the same memory; `dereg` does
    /// not return while a receive on the region is posted, and returns
    /// once it completed.
    #[test]
    fn in_place_overlapping_and_dereg_waits_for_posted_receives() {
        let (a, b) = (device(), device());
        let (qa, qb) = block_on(connect_qp_pair(&a, &b)).unwrap();
        let mut buf = vec![0u8; 16 << 10];
        let base = buf.as_mut_ptr();
        let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
        // SAFETY: `buf` outlives both regions (each is deregistered below,
        // before `buf` is read or dropped); it is read only after every
        // receive into it completed.
        let whole = unsafe { AppRegion::register(&qb.pd, base, buf.len(), access) }.unwrap();
        // SAFETY: as above.
        let part =
            unsafe { AppRegion::register(&qb.pd, base.wrapping_add(4096), 8192, access) }.unwrap();
        let (s1, s2) = (
            whole.sge(base.wrapping_add(4096), 100).unwrap(),
            part.sge(base.wrapping_add(4096), 100).unwrap(),
        );
        assert_ne!(s1.lkey, s2.lkey, "each registration is a region of its own");
        assert!(
            part.sge(base, 1).is_err(),
            "outside the second registration"
        );
        assert!(whole.sge(base.wrapping_add(16 << 10), 1).is_err());
        assert_eq!(whole.sge(std::ptr::null(), 0).unwrap(), EMPTY_SGE);

        let recv = qb.qp.recv(part.sge(base.wrapping_add(5000), 1000).unwrap());
        let (tx, rx) = mpsc::channel();
        let waiter = std::thread::spawn(move || {
            let r = part.dereg();
            tx.send(()).unwrap();
            r
        });
        assert!(
            rx.recv_timeout(Duration::from_millis(300)).is_err(),
            "dereg returned while a receive into the region was posted"
        );
        let msg = block_on(qa.pd.reg_mr(vec![7u8; 1000], AccessFlags::NONE)).unwrap();
        block_on(qa.qp.send(msg.sge(0, 1000).unwrap())).unwrap();
        assert_eq!(block_on(recv).unwrap().byte_len, 1000);
        rx.recv_timeout(Duration::from_secs(10))
            .expect("dereg once the receive completed");
        waiter.join().unwrap().unwrap();

        // The first registration still works after the second is gone.
        let recv = qb.qp.recv(whole.sge(base, 1000).unwrap());
        let msg = block_on(qa.pd.reg_mr(vec![9u8; 1000], AccessFlags::NONE)).unwrap();
        block_on(qa.qp.send(msg.sge(0, 1000).unwrap())).unwrap();
        assert_eq!(block_on(recv).unwrap().byte_len, 1000);
        whole.dereg().unwrap();
        assert!(buf[..1000].iter().all(|&x| x == 9));
        assert!(buf[1000..5000].iter().all(|&x| x == 0));
        assert!(buf[5000..6000].iter().all(|&x| x == 7));
        assert!(buf[6000..].iter().all(|&x| x == 0));
    }

    #[test]
    fn null_and_empty_registrations() {
        let d = device();
        let pd = block_on(d.alloc_pd()).unwrap();
        // SAFETY: nothing is registered (NULL or zero bytes).
        let null = unsafe { AppRegion::register(&pd, std::ptr::null_mut(), 8, AccessFlags::NONE) };
        assert!(matches!(null, Err(NetError::InvalidArgument(_))));
        let mut b = [0u8; 8];
        // SAFETY: zero bytes: nothing is registered.
        let empty = unsafe { AppRegion::register(&pd, b.as_mut_ptr(), 0, AccessFlags::NONE) };
        let empty = empty.unwrap();
        assert_eq!(empty.sge(b.as_ptr(), 0).unwrap(), EMPTY_SGE);
        assert!(empty.sge(b.as_ptr(), 1).is_err());
        empty.dereg().unwrap();
    }
}
