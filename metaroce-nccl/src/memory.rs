//! The plugin's one way to the application's memory.
//!
//! NCCL registers its own buffers (`regMr(data, size)`) and then sends
//! from and receives into them. The data path reaches those bytes only
//! through this module:
//!
//! - [`AppRegion`] is what `regMr` returns as the `mhandle`: the
//!   application's range, checked on every `isend`/`irecv` that names it;
//! - [`Staging`] keeps *bounce regions*, memory regions registered with the
//!   comm's protection domain, pooled by power-of-two size class;
//!   [`Bounce::fill`] copies the application's bytes in before a SEND,
//!   [`Bounce::drain`] copies a received message out to the application.
//!
//! A copy on each side costs little next to the fabric (memcpy moves
//! several GB/s per core; see `docs/BENCHMARKS.md` for what the transport
//! moves). Registering the application's memory in place, once
//! `metaroce-io` can, replaces the bounce regions: `regMr` registers the
//! range itself, [`Staging::take`] hands out a slice of that region,
//! `fill` and `drain` become no-ops — nothing outside this module changes.

use crate::error::NetError;
use metaroce_io::{AccessFlags, ApiError, MemoryRegion, ProtectionDomain, RegionBuf, Sge};
use std::future::Future;
use std::pin::{pin, Pin};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

/// Below this size a copy goes through the endpoint thread without a
/// round trip ([`MemoryRegion::write`]/[`MemoryRegion::read`]); from it on,
/// the region is lent and copied in place on the caller's thread.
const SMALL: usize = 256 << 10;
/// Smallest bounce region: 2^12 bytes.
const MIN_SHIFT: u32 = 12;

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

/// Polls `f` once without waiting: `Some` if it is done.
pub(crate) fn poll_now<F: Future + Unpin>(f: &mut F) -> Option<F::Output> {
    let mut cx = Context::from_waker(Waker::noop());
    match std::pin::Pin::new(f).poll(&mut cx) {
        Poll::Ready(v) => Some(v),
        Poll::Pending => None,
    }
}

/// The application's memory `regMr` was given (the `mhandle`).
#[derive(Debug)]
pub(crate) struct AppRegion {
    base: usize,
    len: usize,
}

impl AppRegion {
    /// No memory: what a zero-byte transfer without a handle names.
    pub(crate) const EMPTY: AppRegion = AppRegion { base: 0, len: 0 };

    /// Records `len` bytes at `base`.
    pub(crate) fn register(base: *mut u8, len: usize) -> Result<AppRegion, NetError> {
        if base.is_null() && len > 0 {
            return Err(NetError::InvalidArgument("regMr of a NULL buffer".into()));
        }
        Ok(AppRegion {
            base: base as usize,
            len,
        })
    }

    /// Checks that `len` bytes at `ptr` lie inside the region.
    pub(crate) fn check(&self, ptr: *const u8, len: usize) -> Result<(), NetError> {
        let p = ptr as usize;
        let inside = len == 0 || (p >= self.base && p.saturating_add(len) <= self.base + self.len);
        if inside {
            Ok(())
        } else {
            Err(NetError::InvalidArgument(format!(
                "{len} bytes at {p:#x} outside the registered {} bytes at {:#x}",
                self.len, self.base
            )))
        }
    }
}

/// A registered bounce region lent out of a [`Staging`] pool.
#[derive(Debug)]
pub(crate) struct Bounce {
    mr: MemoryRegion,
    shift: u32,
}

impl Bounce {
    /// The first `len` bytes, for a work request.
    pub(crate) fn sge(&self, len: usize) -> Result<Sge, NetError> {
        let len = u32::try_from(len)
            .map_err(|_| NetError::InvalidArgument("message over 4 GiB".into()))?;
        Ok(self.mr.sge(0, len)?)
    }

    /// Its size in bytes.
    pub(crate) fn capacity(&self) -> usize {
        1 << self.shift
    }

    /// Copies `src` to the start of the region; a SEND posted after this
    /// call carries it.
    pub(crate) fn fill(&mut self, src: &[u8]) -> Result<(), NetError> {
        if src.is_empty() {
            return Ok(());
        }
        if src.len() < SMALL {
            // Issued now, in order with the SEND that follows; its answer
            // (it cannot fail: the range is inside the region) is dropped.
            drop(self.mr.write(0, src));
        } else {
            let mut bytes = block_on(self.mr.lend())?;
            bytes[..src.len()].copy_from_slice(src);
        }
        Ok(())
    }

    /// Starts copying the first `len` bytes out, for [`drain`](Self::drain):
    /// for a small message, a request to the endpoint thread issued now, so
    /// that the copies of every message that came in meanwhile are answered
    /// in one turn of it instead of a round trip each.
    pub(crate) fn prefetch(&self, len: usize) -> Prefetch {
        Prefetch((len > 0 && len < SMALL).then(|| Box::pin(self.mr.read(0, len)) as CopyOut))
    }

    /// Copies the first `dst.len()` bytes of the region to `dst` (what
    /// `pre`, from [`prefetch`](Self::prefetch) with that length, started).
    pub(crate) fn drain(&mut self, pre: Prefetch, dst: &mut [u8]) -> Result<(), NetError> {
        if dst.is_empty() {
            return Ok(());
        }
        if let Some(read) = pre.0 {
            let bytes = block_on(read)?;
            dst.copy_from_slice(&bytes[..dst.len()]);
        } else {
            let bytes = block_on(self.mr.lend())?;
            dst.copy_from_slice(&bytes[..dst.len()]);
        }
        Ok(())
    }
}

/// A copy out of a bounce region started ahead ([`Bounce::prefetch`]).
pub(crate) struct Prefetch(Option<CopyOut>);

/// A copy of a region's bytes the endpoint thread answers.
type CopyOut = Pin<Box<dyn Future<Output = Result<Vec<u8>, ApiError>> + Send>>;

impl std::fmt::Debug for Prefetch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Prefetch").field(&self.0.is_some()).finish()
    }
}

/// Bounce regions of one comm, pooled by size class.
#[derive(Debug)]
pub(crate) struct Staging {
    pd: ProtectionDomain,
    free: Vec<Vec<MemoryRegion>>,
}

impl Staging {
    /// An empty pool on `pd`.
    pub(crate) fn new(pd: ProtectionDomain) -> Staging {
        Staging {
            pd,
            free: Vec::new(),
        }
    }

    /// A bounce region of at least `len` bytes (registered now if the pool
    /// has none of that size: a one-time cost per region).
    pub(crate) fn take(&mut self, len: usize) -> Result<Bounce, NetError> {
        let shift = len
            .max(1)
            .next_power_of_two()
            .trailing_zeros()
            .max(MIN_SHIFT);
        let class = (shift - MIN_SHIFT) as usize;
        if let Some(mr) = self.free.get_mut(class).and_then(Vec::pop) {
            return Ok(Bounce { mr, shift });
        }
        let mr = block_on(
            self.pd
                .reg_mr(RegionBuf::zeroed(1 << shift), AccessFlags::LOCAL_WRITE),
        )
        .map_err(|e: ApiError| NetError::from(e))?;
        Ok(Bounce { mr, shift })
    }

    /// Returns a region to the pool.
    pub(crate) fn give(&mut self, b: Bounce) {
        let class = (b.shift - MIN_SHIFT) as usize;
        if self.free.len() <= class {
            self.free.resize_with(class + 1, Vec::new);
        }
        self.free[class].push(b.mr);
    }
}
