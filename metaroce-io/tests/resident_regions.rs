#![cfg(target_os = "linux")]
//! A registered region has every page mapped, as `ibv_reg_mr` leaves a
//! region pinned, unless it is registered `ON_DEMAND`: asked of the kernel
//! page by page (`mincore`), for `RegionBuf::resident`, for
//! `RegionBuf::make_resident` on any buffer (its bytes kept), for the
//! driver's `make_resident` (one `madvise` where the kernel has it), and
//! for registration through the core's `Endpoint::reg_mr` and the async
//! `ProtectionDomain::reg_mr`.

use metaroce_io::{make_resident, Backend, Device, DriverConfig, Mapping};
use metaroce_proto::verbs::{AccessFlags, RegionBuf};
use metaroce_proto::{Endpoint, EndpointConfig};

/// Large enough that the allocator maps fresh pages for it.
const LEN: usize = 64 << 20;

/// How many of the pages that `len` bytes at `ptr` reach are in memory, and
/// how many pages they reach. Only asks the kernel about the mappings:
/// nothing at `ptr` is read.
fn pages_in_memory(ptr: *const u8, len: usize) -> (usize, usize) {
    let page = RegionBuf::PAGE;
    let start = ptr as usize / page * page;
    let pages = (ptr as usize + len).div_ceil(page) - start / page;
    let mut vec = vec![0u8; pages];
    // SAFETY: `start` is page-aligned and `vec` has a byte for each of the
    // `pages` pages from it, as mincore asks; mincore only reports on the
    // mappings (failing with ENOMEM where there is none) and touches no
    // byte of them.
    let r = unsafe { libc::mincore(start as *mut libc::c_void, pages * page, vec.as_mut_ptr()) };
    assert_eq!(r, 0, "mincore: {}", std::io::Error::last_os_error());
    (vec.iter().filter(|&&v| v & 1 == 1).count(), pages)
}

#[test]
fn resident_regions_have_every_page_in_memory_and_zeroed_ones_do_not() {
    let lazy = RegionBuf::zeroed(LEN);
    let resident = RegionBuf::resident(LEN);
    let (mapped, pages) = pages_in_memory(resident.as_ptr(), LEN);
    assert_eq!(mapped, pages);
    let (untouched, pages) = pages_in_memory(lazy.as_ptr(), LEN);
    assert!(
        untouched < pages / 2,
        "a zeroed region has {untouched} of {pages} pages mapped before any touch"
    );
    assert!(resident.iter().step_by(4096).all(|&b| b == 0));
    assert_eq!(resident.len(), LEN);
}

/// Runs `map` on a freshly allocated buffer that is not on a page boundary
/// and ends inside a page (the first and last pages only partly its own),
/// with a few bytes set (only their pages mapped), and checks that it then
/// has every page mapped and the same bytes.
fn maps_every_page_and_keeps_the_bytes(map: impl FnOnce(&mut RegionBuf)) {
    let len = LEN + 100;
    let mut v = vec![0u8; len];
    let marks = [(0, 1u8), (4095, 2), (LEN / 2 + 7, 3), (len - 1, 4)];
    for (i, b) in marks {
        v[i] = b;
    }
    let mut buf: RegionBuf = v.into();
    let (before, pages) = pages_in_memory(buf.as_ptr(), len);
    assert!(
        before < pages / 2,
        "{before} of {pages} pages mapped before"
    );
    map(&mut buf);
    assert_eq!(pages_in_memory(buf.as_ptr(), len), (pages, pages));
    for (i, b) in marks {
        assert_eq!(buf[i], b, "byte {i}");
    }
    let nonzero = buf.iter().filter(|&&b| b != 0).count();
    assert_eq!(nonzero, marks.len());
}

#[test]
fn make_resident_maps_every_page_a_buffer_reaches_and_keeps_its_bytes() {
    maps_every_page_and_keeps_the_bytes(RegionBuf::make_resident);
}

#[test]
fn the_driver_maps_a_buffer_in_one_call_and_keeps_its_bytes() {
    maps_every_page_and_keeps_the_bytes(|buf| {
        let how = make_resident(buf);
        if how == Mapping::PageByPage {
            // Kernels before 5.14 have no MADV_POPULATE_WRITE.
            println!("note: MADV_POPULATE_WRITE unavailable, pages touched one by one");
        } else {
            assert_eq!(how, Mapping::InOneCall);
        }
        assert_eq!(make_resident(buf), Mapping::Already);
    });
    assert_eq!(
        make_resident(&mut RegionBuf::resident(8192)),
        Mapping::Already
    );
}

/// The registrations the last two tests make: mapped, and on demand.
fn registrations() -> [AccessFlags; 2] {
    let access = AccessFlags::REMOTE_WRITE;
    [access, access | AccessFlags::ON_DEMAND]
}

/// Checks the pages of a region of `len` bytes at `ptr`, registered with
/// `access`: every one mapped, or, `ON_DEMAND`, fewer than half.
fn assert_mapped_as_registered(ptr: *const u8, len: usize, access: AccessFlags) {
    let (mapped, pages) = pages_in_memory(ptr, len);
    if access.contains(AccessFlags::ON_DEMAND) {
        assert!(mapped < pages / 2, "{access:?}: {mapped} of {pages}");
    } else {
        assert_eq!(mapped, pages, "registered with {access:?}");
    }
}

#[test]
fn the_core_maps_a_region_when_it_is_registered_unless_on_demand() {
    let mut ep = Endpoint::new(EndpointConfig::default(), 1).unwrap();
    let pd = ep.alloc_pd();
    for access in registrations() {
        let mr = ep.reg_mr(pd, vec![0u8; LEN], 0, access).unwrap();
        let bytes = ep.mr(mr.lkey).unwrap();
        assert_mapped_as_registered(bytes.as_ptr(), bytes.len(), access);
        ep.dereg_mr(mr.lkey).unwrap();
    }
}

#[test]
fn the_async_api_maps_a_region_when_it_is_registered_unless_on_demand() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut cfg = DriverConfig::new("127.0.0.1:0".parse().unwrap());
        cfg.backend = Backend::Portable;
        let dev = Device::open(cfg).await.unwrap();
        let pd = dev.alloc_pd().await.unwrap();
        for access in registrations() {
            let buf = RegionBuf::zeroed(LEN);
            // The allocation moves with the buffer into the endpoint; its
            // address stays, and the region keeps it alive until `dereg`.
            let ptr = buf.as_ptr();
            let mr = pd.reg_mr(buf, access).await.unwrap();
            assert_mapped_as_registered(ptr, LEN, access);
            mr.dereg().await.unwrap();
        }
    });
}
