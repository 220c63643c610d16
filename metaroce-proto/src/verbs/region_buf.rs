//! The memory a region holds: where its bytes are, and what keeps them alive.
//!
//! The only module of the core with `unsafe` code. A registered region's
//! bytes are reached through a raw pointer, never through a reference over
//! the whole region, so that the application may use the parts no transfer
//! touches (through its own pointer) while the endpoint places or sends
//! others: every access the core makes builds a slice over exactly the
//! bytes it copies, for as long as the copy takes.

use core::any::TypeId;
use core::fmt;
use core::ops::{Deref, DerefMut, Index, IndexMut, Range};
use core::ptr::NonNull;

/// The memory of a memory region: the bytes a peer WRITEs into or READs,
/// and that SENDs and WRITEs carry. It is a pointer and a length, and
/// (unless the memory was registered raw) the allocation that holds them.
///
/// Where the bytes come from:
///
/// - [`zeroed`](Self::zeroed), [`resident`](Self::resident) and
///   [`copy_of`](Self::copy_of) allocate them, starting on a page boundary
///   ([`PAGE`](Self::PAGE)), as `ibv_reg_mr` users allocate: each 4 KiB
///   payload of a region then lies in one page, which the kernel copies
///   (or, with zero copy, pins) page by page;
/// - a `Box<[u8]>` or `Vec<u8>` converts without a copy, aligned as the
///   allocator left it;
/// - [`from_owner`](Self::from_owner) takes any allocation of the
///   application's that derefs to bytes (a `memmap2::MmapMut`, huge pages,
///   an aligned allocation of its own) and keeps it alive, unmoved, until
///   the buffer is dropped or [`into_owner`](Self::into_owner) gives it back;
/// - [`from_raw_parts`](Self::from_raw_parts) (`unsafe`) names memory the
///   application keeps alive itself, as `ibv_reg_mr(pd, addr, len, …)` does.
///
/// Registering a buffer ([`Endpoint::reg_mr`](crate::Endpoint::reg_mr))
/// maps its every page ([`make_resident`](Self::make_resident)), as
/// `ibv_reg_mr` pins them, unless the region is registered
/// [`ON_DEMAND`](super::AccessFlags::ON_DEMAND).
///
/// Its memory never moves: [`as_ptr`](Self::as_ptr) is the same from
/// creation to drop, wherever the `RegionBuf` itself is moved.
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
pub struct RegionBuf {
    /// Byte 0. Valid for reads and writes of `len` bytes for as long as
    /// `owner` lives (or, with no owner and `len > 0`, as the caller of
    /// [`from_raw_parts`](Self::from_raw_parts) promised); dangling when
    /// `len == 0`.
    ptr: NonNull<u8>,
    len: usize,
    /// What keeps the bytes alive (`None`: raw, or empty).
    owner: Option<Owner>,
    /// `ptr..ptr + len` is the whole of the owner's bytes (not a part of
    /// them, as [`zeroed`](Self::zeroed) takes).
    whole: bool,
    /// Every page of the bytes has been written since they were allocated,
    /// so the kernel has mapped them all: [`make_resident`](Self::make_resident)
    /// has nothing left to do.
    mapped: bool,
}

/// An allocation that holds a region's bytes: boxed (so the bytes do not
/// move with the `RegionBuf`, even where they lie inside the value itself),
/// and held by a raw pointer, not a `Box`, so that nothing asserts unique
/// access to it while the bytes are reached through `RegionBuf::ptr`.
struct Owner {
    value: NonNull<dyn Send>,
    /// The value's type, for [`RegionBuf::into_owner`].
    type_id: TypeId,
}

impl Owner {
    /// Boxes `value` and returns it with the bytes it derefs to.
    fn new<T: AsMut<[u8]> + Send + 'static>(value: T) -> (Owner, NonNull<u8>, usize) {
        let raw: *mut T = Box::into_raw(Box::new(value));
        // SAFETY: `raw` comes from `Box::into_raw`: valid, aligned, and no
        // other pointer to the value exists.
        let bytes: &mut [u8] = unsafe { (*raw).as_mut() };
        let (ptr, len) = (NonNull::from(&mut *bytes).cast::<u8>(), bytes.len());
        // SAFETY: from `Box::into_raw`, never null.
        let value = unsafe { NonNull::new_unchecked(raw as *mut dyn Send) };
        let owner = Owner {
            value,
            type_id: TypeId::of::<T>(),
        };
        (owner, ptr, len)
    }

    /// The value back, if it is a `T`.
    fn take<T: 'static>(self) -> Result<T, Owner> {
        if self.type_id != TypeId::of::<T>() {
            return Err(self);
        }
        let raw = self.value.as_ptr() as *mut T;
        core::mem::forget(self);
        // SAFETY: `raw` came from `Box::<T>::into_raw` (the type id says
        // it is a `T`), and forgetting `self` leaves this the only owner.
        Ok(*unsafe { Box::from_raw(raw) })
    }
}

impl Drop for Owner {
    fn drop(&mut self) {
        // SAFETY: `value` came from `Box::into_raw` and is dropped once.
        drop(unsafe { Box::from_raw(self.value.as_ptr()) });
    }
}

// SAFETY: the owner is `Send` (required of every value it holds), and the
// bytes are plain memory whose access is governed by Rust's borrows of the
// `RegionBuf` (or, raw, by the promise of `from_raw_parts`, which includes
// that any thread may reach them).
unsafe impl Send for RegionBuf {}
// SAFETY: through `&RegionBuf` only shared reads of the bytes are possible
// (as through `&[u8]`), and the owner is never reached through it.
unsafe impl Sync for RegionBuf {}

impl Default for RegionBuf {
    /// No bytes.
    fn default() -> Self {
        RegionBuf {
            ptr: NonNull::dangling(),
            len: 0,
            owner: None,
            whole: true,
            mapped: true,
        }
    }
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
        // first page boundary inside.
        let storage = vec![0u8; len + Self::PAGE - 1].into_boxed_slice();
        let mut buf = RegionBuf::from_owner(storage);
        let start = buf.ptr.as_ptr().align_offset(Self::PAGE);
        buf.narrow(start, len);
        buf
    }

    /// Keeps `len` bytes from `start` of the bytes only.
    fn narrow(&mut self, start: usize, len: usize) {
        assert!(start <= self.len && len <= self.len - start);
        // SAFETY: `start` is within the bytes (checked above), so the
        // pointer stays inside the same allocation.
        self.ptr = unsafe { self.ptr.add(start) };
        self.whole = start == 0 && len == self.len;
        self.len = len;
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

    /// The bytes `owner` derefs to, in place: the memory the application
    /// allocated itself (a `memmap2::MmapMut`, huge pages, an aligned
    /// allocation; any `T: AsMut<[u8]>` that is `Send`), with no copy. The
    /// buffer keeps `owner` alive, boxed (so even bytes held inside the
    /// value itself do not move), until it is dropped or
    /// [`into_owner`](Self::into_owner) hands `owner` back.
    ///
    /// `owner.as_mut()` is called once, here: the bytes are the slice it
    /// returns, and `owner` is not touched again until it is given back or
    /// dropped.
    ///
    /// ```
    /// use metaroce_proto::verbs::RegionBuf;
    /// // Say, an allocation with an alignment of its own choosing.
    /// struct Aligned(Vec<u64>);
    /// impl AsMut<[u8]> for Aligned {
    ///     fn as_mut(&mut self) -> &mut [u8] {
    ///         let len = self.0.len() * 8;
    ///         // (An application might use bytemuck here instead.)
    ///         unsafe { std::slice::from_raw_parts_mut(self.0.as_mut_ptr().cast(), len) }
    ///     }
    /// }
    /// let mut buf = RegionBuf::from_owner(Aligned(vec![0x0101_0101_0101_0101; 512]));
    /// assert_eq!(buf.len(), 4096);
    /// assert_eq!(buf.as_ptr() as usize % 8, 0);
    /// buf[0] = 9;
    /// let back: Aligned = buf.into_owner().unwrap();
    /// assert_eq!(back.0[0], 0x0101_0101_0101_0109);
    /// ```
    pub fn from_owner<T: AsMut<[u8]> + Send + 'static>(owner: T) -> Self {
        let (owner, ptr, len) = Owner::new(owner);
        RegionBuf {
            ptr,
            len,
            owner: Some(owner),
            whole: true,
            mapped: false,
        }
    }

    /// `len` bytes at `ptr` that the application keeps alive itself, in
    /// place: what `ibv_reg_mr(pd, addr, length, access)` registers. The
    /// buffer frees nothing when dropped. [`from_owner`](Self::from_owner)
    /// is the safe way for memory the buffer may own.
    ///
    /// # Safety
    ///
    /// As with `ibv_reg_mr`, the caller promises, from this call until the
    /// buffer is dropped (for a registered region: until deregistering
    /// hands it back, and it is dropped):
    ///
    /// - the `len` bytes at `ptr` stay valid for reads and writes, from any
    ///   thread: they are not freed, unmapped, remapped or moved;
    /// - nothing else accesses them while the buffer is used as a slice
    ///   (its `Deref`/`DerefMut`, a region lent with
    ///   [`Endpoint::lend_mr`](crate::Endpoint::lend_mr),
    ///   [`Endpoint::mr`](crate::Endpoint::mr) and
    ///   [`mr_mut`](crate::Endpoint::mr_mut), and registration, which maps
    ///   the pages: with one system call that changes no byte, or, where
    ///   the kernel has none, by rewriting one byte a page with its own
    ///   value);
    /// - while it is registered, the application's other accesses keep
    ///   off the bytes a transfer uses, as the verbs rules ask: it does not
    ///   write bytes that a posted SEND or WRITE, or a peer's READ, may be
    ///   reading, and does not read or write bytes that a posted receive or
    ///   READ, or a peer's WRITE, may be writing, until the completion (or
    ///   the application's own protocol with the peer) says the transfer
    ///   is over. In Rust such an overlap is a data race, not merely
    ///   undefined contents as with a NIC.
    ///
    /// A zero `len` names no memory (`ptr` is then not used).
    ///
    /// ```
    /// use metaroce_proto::verbs::RegionBuf;
    /// use std::ptr::NonNull;
    /// let mut memory = vec![0u8; 8192];
    /// let ptr = NonNull::new(memory.as_mut_ptr()).unwrap();
    /// // SAFETY: `memory` outlives `buf` and is not used while `buf` lives.
    /// let mut buf = unsafe { RegionBuf::from_raw_parts(ptr, memory.len()) };
    /// buf[100] = 7;
    /// assert_eq!(buf.as_ptr(), ptr.as_ptr().cast_const());
    /// drop(buf); // frees nothing
    /// assert_eq!(memory[100], 7);
    /// ```
    pub unsafe fn from_raw_parts(ptr: NonNull<u8>, len: usize) -> Self {
        RegionBuf {
            ptr: if len == 0 { NonNull::dangling() } else { ptr },
            len,
            owner: None,
            whole: true,
            mapped: false,
        }
    }

    /// Whether the bytes start on a page boundary.
    pub fn is_page_aligned(&self) -> bool {
        self.as_ptr().align_offset(Self::PAGE) == 0
    }

    /// Whether the buffer names memory it does not own
    /// ([`from_raw_parts`](Self::from_raw_parts)).
    ///
    /// ```
    /// use metaroce_proto::verbs::RegionBuf;
    /// assert!(!RegionBuf::zeroed(10).is_raw());
    /// let mut memory = [0u8; 10];
    /// let ptr = std::ptr::NonNull::new(memory.as_mut_ptr()).unwrap();
    /// // SAFETY: `memory` outlives the buffer and is not used meanwhile.
    /// assert!(unsafe { RegionBuf::from_raw_parts(ptr, 10) }.is_raw());
    /// ```
    pub fn is_raw(&self) -> bool {
        self.owner.is_none() && self.len > 0
    }

    /// Byte 0 of the bytes (the same wherever the buffer is moved), without
    /// making a reference to them.
    ///
    /// ```
    /// use metaroce_proto::verbs::RegionBuf;
    /// let mut buf = RegionBuf::zeroed(8192);
    /// let p = buf.as_mut_ptr();
    /// let moved = Box::new(buf);
    /// assert_eq!(moved.as_ptr(), p.cast_const());
    /// assert_eq!((moved.len(), moved.is_empty()), (8192, false));
    /// ```
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// Byte 0 of the bytes, writable, without making a reference to them.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes, as a vector: without a copy if the buffer holds a whole
    /// `Vec<u8>` or `Box<[u8]>`, else a copy (a page-aligned buffer, an
    /// application's own allocation, raw memory).
    pub fn into_vec(self) -> Vec<u8> {
        if self.whole {
            let buf = match self.into_owner::<Vec<u8>>() {
                Ok(v) => return v,
                Err(buf) => buf,
            };
            match buf.into_owner::<Box<[u8]>>() {
                Ok(b) => b.into_vec(),
                Err(buf) => buf.to_vec(),
            }
        } else {
            self.to_vec()
        }
    }

    /// The allocation the buffer was made from, if it was made by
    /// [`from_owner`](Self::from_owner) with a `T` (or from a `Box<[u8]>`
    /// or `Vec<u8>`, which are kept as they are); else the buffer, back.
    ///
    /// ```
    /// use metaroce_proto::verbs::RegionBuf;
    /// let buf = RegionBuf::from_owner(vec![1u8, 2, 3]);
    /// let buf = buf.into_owner::<String>().unwrap_err(); // not a String
    /// assert_eq!(buf.into_owner::<Vec<u8>>().unwrap(), vec![1, 2, 3]);
    /// ```
    pub fn into_owner<T: 'static>(mut self) -> Result<T, RegionBuf> {
        match self.owner.take().map(Owner::take::<T>) {
            Some(Ok(value)) => Ok(value),
            Some(Err(owner)) => {
                self.owner = Some(owner);
                Err(self)
            }
            None => Err(self),
        }
    }
}

impl From<Box<[u8]>> for RegionBuf {
    fn from(storage: Box<[u8]>) -> Self {
        RegionBuf::from_owner(storage)
    }
}

impl From<Vec<u8>> for RegionBuf {
    fn from(v: Vec<u8>) -> Self {
        RegionBuf::from_owner(v)
    }
}

impl Deref for RegionBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` is valid for `len` bytes (dangling only when
        // `len == 0`, which a slice allows), and `&self` lets nothing
        // write them meanwhile (the promise of `from_raw_parts` covers
        // raw memory).
        unsafe { core::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for RegionBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` is the only way to the
        // bytes meanwhile.
        unsafe { core::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
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
    /// Its length, alignment and kind, not its (possibly huge) contents.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegionBuf")
            .field("len", &self.len)
            .field("page_aligned", &self.is_page_aligned())
            .field("raw", &self.is_raw())
            .finish()
    }
}

/// A registered region's bytes, as the core holds them: no slice over the
/// whole of them is made except where the application asks for one
/// ([`Endpoint::mr`](crate::Endpoint::mr)); placing and sending index the
/// bytes they copy, `buf[range]`, which makes a slice over that range only.
#[derive(Debug, Default)]
pub(crate) struct Registered(RegionBuf);

impl Registered {
    pub(crate) fn new(buf: RegionBuf) -> Self {
        Registered(buf)
    }

    pub(crate) fn into_inner(self) -> RegionBuf {
        self.0
    }

    pub(crate) fn len(&self) -> usize {
        self.0.len
    }

    /// Every byte (the application's view, [`Endpoint::mr`](crate::Endpoint::mr)).
    pub(crate) fn whole(&self) -> &[u8] {
        &self.0
    }

    /// Every byte, writable ([`Endpoint::mr_mut`](crate::Endpoint::mr_mut)).
    pub(crate) fn whole_mut(&mut self) -> &mut [u8] {
        &mut self.0
    }

    /// The bytes of `range`, if it lies within them.
    pub(crate) fn get(&self, range: Range<usize>) -> Option<&[u8]> {
        let len = self.check(&range)?;
        // SAFETY: `range` lies within the `len` valid bytes (checked), and
        // `&self` lets nothing in the endpoint write them meanwhile; the
        // application keeps its own accesses off bytes a transfer reads
        // (the promise of `from_raw_parts`, and Rust's borrows otherwise).
        Some(unsafe { core::slice::from_raw_parts(self.0.ptr.as_ptr().add(range.start), len) })
    }

    /// The bytes of `range`, writable, if it lies within them.
    pub(crate) fn get_mut(&mut self, range: Range<usize>) -> Option<&mut [u8]> {
        let len = self.check(&range)?;
        // SAFETY: as in `get`, and `&mut self` is the endpoint's only way
        // to the bytes meanwhile; the application keeps off bytes a
        // transfer writes.
        Some(unsafe { core::slice::from_raw_parts_mut(self.0.ptr.as_ptr().add(range.start), len) })
    }

    /// The length of `range`, if it lies within the bytes.
    fn check(&self, range: &Range<usize>) -> Option<usize> {
        (range.start <= range.end && range.end <= self.0.len).then(|| range.end - range.start)
    }
}

impl Index<Range<usize>> for Registered {
    type Output = [u8];
    /// The bytes of `range`; panics, as slices do, if it reaches outside.
    fn index(&self, range: Range<usize>) -> &[u8] {
        let len = self.0.len;
        self.get(range.clone())
            .unwrap_or_else(|| panic!("range {range:?} outside a region of {len} bytes"))
    }
}

impl IndexMut<Range<usize>> for Registered {
    fn index_mut(&mut self, range: Range<usize>) -> &mut [u8] {
        let len = self.0.len;
        match self.get_mut(range.clone()) {
            Some(bytes) => bytes,
            None => panic!("range {range:?} outside a region of {len} bytes"),
        }
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
        let back = r.into_vec();
        assert_eq!(back.as_ptr(), p, "no copy back");
        assert_eq!(back, vec![1, 2, 3]);
        let b: RegionBuf = vec![9u8; 10].into_boxed_slice().into();
        assert_eq!(b, RegionBuf::copy_of(&[9u8; 10]));
    }

    /// An owner holding its bytes inside itself: boxed once, they stay put
    /// however the buffer moves, and the owner comes back with them.
    #[test]
    fn owners_are_kept_in_place_and_given_back() {
        let mut buf = RegionBuf::from_owner([5u8; 64]);
        let p = buf.as_ptr();
        buf[3] = 1;
        let moved = Box::new(buf);
        assert_eq!(moved.as_ptr(), p, "the bytes did not move");
        assert!(!moved.is_raw());
        let moved = (*moved).into_owner::<Vec<u8>>().unwrap_err();
        let arr: [u8; 64] = moved.into_owner().unwrap();
        assert_eq!(arr[..4], [5, 5, 5, 1]);
        // An owner is dropped with the buffer.
        let tracked = std::sync::Arc::new(());
        struct Holder(Vec<u8>, #[allow(dead_code)] std::sync::Arc<()>);
        impl AsMut<[u8]> for Holder {
            fn as_mut(&mut self) -> &mut [u8] {
                &mut self.0
            }
        }
        let buf = RegionBuf::from_owner(Holder(vec![1; 10], tracked.clone()));
        assert_eq!(std::sync::Arc::strong_count(&tracked), 2);
        assert_eq!(buf.clone_bytes(), vec![1; 10]);
        drop(buf);
        assert_eq!(std::sync::Arc::strong_count(&tracked), 1);
    }

    #[test]
    fn raw_parts_are_used_in_place_and_not_freed() {
        let mut memory = vec![0u8; 100];
        let ptr = NonNull::new(memory.as_mut_ptr()).unwrap();
        // SAFETY: `memory` outlives the buffer and is not used meanwhile.
        let mut buf = unsafe { RegionBuf::from_raw_parts(ptr, 100) };
        assert!(buf.is_raw());
        buf[99] = 4;
        let buf = buf.into_owner::<Vec<u8>>().unwrap_err();
        assert_eq!(buf.into_vec()[99], 4, "a copy");
        assert_eq!(memory[99], 4);
        // SAFETY: nothing is named.
        let empty = unsafe { RegionBuf::from_raw_parts(NonNull::dangling(), 0) };
        assert!(!empty.is_raw() && empty.is_empty());
    }

    #[test]
    fn registered_bytes_are_indexed_by_range_only() {
        let mut r = Registered::new(RegionBuf::copy_of(&[1, 2, 3, 4, 5]));
        assert_eq!(&r[1..3], &[2, 3]);
        r[3..5].copy_from_slice(&[9, 9]);
        assert_eq!(r.whole(), &[1, 2, 3, 9, 9]);
        assert_eq!(r.get(4..6), None);
        #[allow(clippy::reversed_empty_ranges)]
        let backwards = r.get(3..2);
        assert_eq!(backwards, None);
        assert_eq!(r.get(5..5), Some(&[][..]));
        assert_eq!(r.into_inner().into_vec(), vec![1, 2, 3, 9, 9]);
    }

    #[test]
    #[should_panic(expected = "outside a region of 5 bytes")]
    fn registered_bytes_panic_outside_like_slices() {
        let r = Registered::new(RegionBuf::copy_of(&[1, 2, 3, 4, 5]));
        let _ = &r[4..6];
    }

    impl RegionBuf {
        fn clone_bytes(&self) -> Vec<u8> {
            self.to_vec()
        }
    }
}
