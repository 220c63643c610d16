//! The memory a region owns.

use core::fmt;
use core::ops::{Deref, DerefMut};

/// Owned memory for a memory region: the bytes a peer WRITEs into or READs,
/// and that SENDs and WRITEs carry.
///
/// [`zeroed`](Self::zeroed) and [`copy_of`](Self::copy_of) start the bytes
/// on a page boundary ([`PAGE`](Self::PAGE)), as `ibv_reg_mr` users
/// allocate: each 4 KiB payload of a region then lies in one page, which
/// the kernel copies (or, with zero copy, pins) page by page. A `Box<[u8]>`
/// or `Vec<u8>` converts without a copy, aligned as the allocator left it.
///
/// Registering a buffer ([`Endpoint::reg_mr`](crate::Endpoint::reg_mr))
/// maps its every page ([`make_resident`](Self::make_resident)), as
/// `ibv_reg_mr` pins them, unless the region is registered
/// [`ON_DEMAND`](super::AccessFlags::ON_DEMAND).
///
/// ```
/// use metaroce_proto::verbs::RegionBuf;
/// let mut buf = RegionBuf::zeroed(64 << 10);
/// assert!(buf.is_page_aligned());
/// buf[..5].copy_from_slice(b"hello");
/// assert_eq!(buf.len(), 64 << 10);
/// let from_vec: RegionBuf = vec![7u8; 100].into();
/// assert_eq!(&from_vec[..], &[7u8; 100][..]);
/// assert_eq!(RegionBuf::copy_of(b"abc").into_vec(), b"abc".to_vec());
/// ```
#[derive(Default)]
pub struct RegionBuf {
    storage: Box<[u8]>,
    start: usize,
    len: usize,
    /// Every page of the bytes has been written since they were allocated,
    /// so the kernel has mapped them all: [`make_resident`](Self::make_resident)
    /// has nothing left to do.
    mapped: bool,
}

impl RegionBuf {
    /// The alignment [`zeroed`](Self::zeroed) and [`copy_of`](Self::copy_of) give.
    pub const PAGE: usize = 4096;

    /// `len` zero bytes starting on a page boundary.
    ///
    /// Like any zeroed allocation, its pages are mapped on first touch:
    /// here, when it is registered (or, registered
    /// [`ON_DEMAND`](super::AccessFlags::ON_DEMAND), by the first transfer
    /// that reaches each page, on the thread that drives it, a few
    /// microseconds a fault, which can hold a driver past its peer's
    /// retransmission timeout). [`resident`](Self::resident) maps them now.
    pub fn zeroed(len: usize) -> Self {
        // Up to a page more than asked for, and the bytes start at the
        // first page boundary inside: no unsafe allocation needed.
        let storage = vec![0u8; len + Self::PAGE - 1].into_boxed_slice();
        let start = storage.as_ptr().align_offset(Self::PAGE);
        RegionBuf {
            storage,
            start,
            len,
            mapped: false,
        }
    }

    /// `len` zero bytes starting on a page boundary, every page of them
    /// mapped now (one write a page), as `ibv_reg_mr` leaves a region
    /// pinned: no transfer into or out of it takes a page fault. The faults
    /// are taken here instead, 256 per MiB, on the calling thread, and
    /// registering the buffer has none left to take.
    ///
    /// ```
    /// use metaroce_proto::verbs::RegionBuf;
    /// let buf = RegionBuf::resident(1 << 20);
    /// assert!(buf.is_page_aligned());
    /// assert!(buf.iter().all(|&b| b == 0));
    /// ```
    pub fn resident(len: usize) -> Self {
        let mut buf = Self::zeroed(len);
        for page in buf.chunks_mut(Self::PAGE) {
            // Storing zero into memory known to be zeroed is a store a
            // compiler may drop; through `black_box` it cannot see that
            // it is.
            *core::hint::black_box(&mut page[0]) = 0;
        }
        buf.mapped = true;
        buf
    }

    /// Maps every page of the bytes, keeping what they hold (a read and a
    /// write of one byte a page), unless that is known to be done: a buffer
    /// made by [`resident`](Self::resident) or [`copy_of`](Self::copy_of),
    /// or already made resident, is left as it is. Registration calls this;
    /// calling it first takes the page faults on the calling thread rather
    /// than on whichever thread registers.
    ///
    /// ```
    /// use metaroce_proto::verbs::RegionBuf;
    /// let mut buf: RegionBuf = vec![5u8; 3 * RegionBuf::PAGE + 10].into();
    /// buf.make_resident();
    /// assert!(buf.iter().all(|&b| b == 5));
    /// ```
    pub fn make_resident(&mut self) {
        self.make_resident_with(|_| false);
    }

    /// [`make_resident`](Self::make_resident), with `populate` asked first
    /// to map the pages of the bytes it is given, keeping them, in one go
    /// (a driver's system call, such as Linux's
    /// `madvise(MADV_POPULATE_WRITE)`, which maps a range without a fault a
    /// page). Where it returns false the pages are touched one by one.
    ///
    /// ```
    /// use metaroce_proto::verbs::RegionBuf;
    /// let mut buf: RegionBuf = vec![5u8; 10_000].into();
    /// let mut asked = 0;
    /// buf.make_resident_with(|bytes| {
    ///     asked = bytes.len();
    ///     false // cannot: touch them instead
    /// });
    /// assert_eq!(asked, 10_000);
    /// buf.make_resident_with(|_| unreachable!("already resident"));
    /// ```
    pub fn make_resident_with(&mut self, populate: impl FnOnce(&mut [u8]) -> bool) {
        if self.mapped {
            return;
        }
        if populate(&mut self[..]) {
            self.mapped = true;
            return;
        }
        // The first byte of every page the bytes reach: byte 0 where they
        // do not start on a page boundary, then each boundary after it.
        let len = self.len;
        let first_boundary = self.as_ptr().align_offset(Self::PAGE).min(len);
        let touch = (first_boundary > 0)
            .then_some(0)
            .into_iter()
            .chain((first_boundary..len).step_by(Self::PAGE));
        for i in touch {
            // A store of the value just loaded, which the compiler may not
            // drop: through `black_box` it cannot see that it is the same.
            let byte = &mut self[i];
            *byte = core::hint::black_box(*byte);
        }
        self.mapped = true;
    }

    /// A page-aligned copy of `bytes` (every page of it mapped by the copy).
    pub fn copy_of(bytes: &[u8]) -> Self {
        let mut buf = Self::zeroed(bytes.len());
        buf.copy_from_slice(bytes);
        buf.mapped = true;
        buf
    }

    /// Whether the bytes start on a page boundary.
    pub fn is_page_aligned(&self) -> bool {
        self.as_ptr().align_offset(Self::PAGE) == 0
    }

    /// The bytes, as a vector (a copy unless they fill the allocation).
    pub fn into_vec(self) -> Vec<u8> {
        if self.start == 0 && self.len == self.storage.len() {
            self.storage.into_vec()
        } else {
            self.storage[self.start..self.start + self.len].to_vec()
        }
    }
}

impl From<Box<[u8]>> for RegionBuf {
    fn from(storage: Box<[u8]>) -> Self {
        let len = storage.len();
        RegionBuf {
            storage,
            start: 0,
            len,
            mapped: false,
        }
    }
}

impl From<Vec<u8>> for RegionBuf {
    fn from(v: Vec<u8>) -> Self {
        v.into_boxed_slice().into()
    }
}

impl Deref for RegionBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.storage[self.start..self.start + self.len]
    }
}

impl DerefMut for RegionBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.storage[self.start..self.start + self.len]
    }
}

impl AsRef<[u8]> for RegionBuf {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl AsMut<[u8]> for RegionBuf {
    fn as_mut(&mut self) -> &mut [u8] {
        self
    }
}

impl PartialEq for RegionBuf {
    fn eq(&self, other: &Self) -> bool {
        self[..] == other[..]
    }
}

impl Eq for RegionBuf {}

impl fmt::Debug for RegionBuf {
    /// Its length and alignment, not its (possibly huge) contents.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegionBuf")
            .field("len", &self.len)
            .field("page_aligned", &self.is_page_aligned())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zeroed_and_copies_start_on_a_page() {
        for len in [0, 1, 4095, 4096, 65_536 + 17] {
            let z = RegionBuf::zeroed(len);
            assert!(z.is_page_aligned(), "{len}");
            assert_eq!(z.len(), len);
            assert!(z.iter().all(|&b| b == 0));
            let bytes: Vec<u8> = (0..len).map(|i| i as u8).collect();
            let c = RegionBuf::copy_of(&bytes);
            assert!(c.is_page_aligned(), "{len}");
            assert_eq!(&c[..], &bytes[..]);
            assert_eq!(c.into_vec(), bytes);
        }
    }

    #[test]
    fn boxes_and_vectors_convert_as_they_are() {
        let v = vec![1u8, 2, 3];
        let p = v.as_ptr();
        let r: RegionBuf = v.into();
        assert_eq!(r.as_ptr(), p, "no copy");
        assert_eq!(r.into_vec(), vec![1, 2, 3]);
        let b: RegionBuf = vec![9u8; 10].into_boxed_slice().into();
        assert_eq!(b, RegionBuf::copy_of(&[9u8; 10]));
    }
}
