#![cfg(target_os = "linux")]
//! `RegionBuf::resident` maps every page of a region when it is made, as
//! `ibv_reg_mr` leaves a region pinned, where `RegionBuf::zeroed` leaves
//! them to be mapped by the first transfer that touches them. Asked of the
//! kernel page by page (`mincore`).

use metaroce_proto::verbs::RegionBuf;

/// How many of the pages `buf` spans are in memory.
fn pages_in_memory(buf: &RegionBuf) -> usize {
    assert!(buf.is_page_aligned());
    let pages = buf.len().div_ceil(RegionBuf::PAGE);
    let mut vec = vec![0u8; pages];
    // SAFETY: `buf` starts on a page boundary and its `len` bytes are one
    // allocation; `vec` has a byte for each page of them, as mincore asks.
    let r = unsafe { libc::mincore(buf.as_ptr().cast_mut().cast(), buf.len(), vec.as_mut_ptr()) };
    assert_eq!(r, 0, "mincore: {}", std::io::Error::last_os_error());
    vec.iter().filter(|&&v| v & 1 == 1).count()
}

#[test]
fn resident_regions_have_every_page_in_memory_and_zeroed_ones_do_not() {
    // Large enough that the allocator maps fresh pages for it.
    let len = 64 << 20;
    let pages = len / RegionBuf::PAGE;
    let lazy = RegionBuf::zeroed(len);
    let resident = RegionBuf::resident(len);
    assert_eq!(pages_in_memory(&resident), pages);
    let untouched = pages_in_memory(&lazy);
    assert!(
        untouched < pages / 2,
        "a zeroed region has {untouched} of {pages} pages mapped before any touch"
    );
    assert!(resident.iter().step_by(4096).all(|&b| b == 0));
    assert_eq!(resident.len(), len);
}
