//! Mapping a memory region's pages at registration, as `ibv_reg_mr` pins
//! them, with one system call where the kernel has one for it.

use metaroce_proto::verbs::RegionBuf;

/// How [`make_resident`] mapped a buffer's pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mapping {
    /// With one system call (`madvise(MADV_POPULATE_WRITE)`).
    InOneCall,
    /// A page fault a page: the kernel has no call for it (before Linux
    /// 5.14, or not Linux).
    PageByPage,
    /// Nothing to do: the buffer was resident already
    /// ([`RegionBuf::resident`], [`RegionBuf::copy_of`], or made so before).
    Already,
}

/// Maps every page of `buf`, keeping its bytes, as registering it does
/// ([`ProtectionDomain::reg_mr`](crate::device::ProtectionDomain::reg_mr)
/// calls this; the core's `Endpoint::reg_mr` touches the pages one by one
/// unless they are mapped already): with `madvise(MADV_POPULATE_WRITE)`
/// where the kernel has it, one call for the whole range, about 2.5 times
/// as fast here as a fault a page; by touching each page otherwise. For
/// users of the lower-level [`Driver`](crate::Driver), before
/// `reg_mr`, on a thread of their choosing.
///
/// ```
/// use metaroce_io::{make_resident, Mapping};
/// use metaroce_proto::verbs::RegionBuf;
/// let mut buf: RegionBuf = vec![3u8; 1 << 20].into();
/// assert_ne!(make_resident(&mut buf), Mapping::Already);
/// assert_eq!(make_resident(&mut buf), Mapping::Already);
/// assert!(buf.iter().all(|&b| b == 3));
/// ```
pub fn make_resident(buf: &mut RegionBuf) -> Mapping {
    let mut how = Mapping::Already;
    buf.make_resident_with(|bytes| {
        let done = populate_write(bytes);
        how = if done {
            Mapping::InOneCall
        } else {
            Mapping::PageByPage
        };
        done
    });
    how
}

/// Asks the kernel to map the pages `bytes` reach, writable, in one call.
/// False where it cannot (older kernels: `EINVAL`; other systems).
#[cfg(target_os = "linux")]
fn populate_write(bytes: &mut [u8]) -> bool {
    if bytes.is_empty() {
        return true;
    }
    let page = RegionBuf::PAGE;
    let start = bytes.as_ptr() as usize / page * page;
    let end = (bytes.as_ptr() as usize + bytes.len()).div_ceil(page) * page;
    // SAFETY: the range is the pages `bytes` reach, all memory this
    // process has allocated (the first and last may also hold other
    // allocations' bytes). MADV_POPULATE_WRITE only faults those pages in,
    // writable, as a write to each would: it changes no byte of them,
    // frees nothing and moves nothing, so no reference into them is
    // disturbed.
    let r = unsafe {
        libc::madvise(
            start as *mut libc::c_void,
            end - start,
            libc::MADV_POPULATE_WRITE,
        )
    };
    r == 0
}

#[cfg(not(target_os = "linux"))]
fn populate_write(_bytes: &mut [u8]) -> bool {
    false
}
