#![cfg(target_os = "linux")]
//! Memory the application allocated itself, registered in place: a
//! `memmap2` map (`reg_mr_owned`) and a 2 MiB-aligned allocation
//! (`reg_mr_raw`). A peer WRITEs, READs and SENDs into them; the bytes are
//! checked where they are, through the application's own pointers (no copy,
//! no round trip to the endpoint thread), while another thread fills a part
//! of the same region no transfer touches. `dereg` gives the map back, with
//! the bytes still in it. On both backends; where io_uring is unavailable
//! its variant prints `skipped: io_uring unavailable: <reason>` and passes.

use metaroce_io::{connect_qp_pair, AccessFlags, ApiError, Backend, Device, DriverConfig};
use metaroce_proto::verbs::VerbsError;
mod common;

use common::pattern;
use std::alloc::Layout;
use std::ptr::NonNull;
use std::time::Duration;

/// Each region's size.
const LEN: usize = 8 << 20;
/// Half of it: transfers use one half while the application uses the other.
const HALF: usize = LEN / 2;

fn run<Fut: std::future::Future<Output = ()>>(backend: Backend, f: impl FnOnce(Backend) -> Fut) {
    if backend == Backend::Uring {
        if let Err(why) = metaroce_io::uring_probe() {
            println!("skipped: io_uring unavailable: {why}");
            return;
        }
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(30), f(backend))
            .await
            .expect("test timed out")
    });
}

async fn open(backend: Backend) -> Device {
    let mut c = DriverConfig::new("127.0.0.1:0".parse().unwrap());
    c.backend = backend;
    Device::open(c).await.unwrap()
}

/// `len` bytes at `ptr`, as a slice.
///
/// # Safety
/// The bytes are in a registered region and no transfer writes them now.
unsafe fn view<'a>(ptr: *const u8, len: usize) -> &'a [u8] {
    // SAFETY: the caller's promise.
    unsafe { std::slice::from_raw_parts(ptr, len) }
}

/// Memory from the global allocator with an alignment of 2 MiB (a huge
/// page's), freed on drop.
struct Aligned {
    ptr: NonNull<u8>,
    layout: Layout,
}

impl Aligned {
    fn zeroed(len: usize) -> Aligned {
        let layout = Layout::from_size_align(len, 2 << 20).unwrap();
        // SAFETY: the layout's size is not zero.
        let ptr = NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) }).expect("allocation");
        Aligned { ptr, layout }
    }
}

impl Drop for Aligned {
    fn drop(&mut self) {
        // SAFETY: allocated with this layout by `zeroed`, freed once.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

async fn in_place(backend: Backend) {
    let (a, b) = (open(backend).await, open(backend).await);
    let (qa, qb) = connect_qp_pair(&a, &b).await.unwrap();
    let all = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;

    // The map, registered as it is: the region is the map's memory.
    let mut map = memmap2::MmapOptions::new().len(LEN).map_anon().unwrap();
    map[..4].copy_from_slice(b"map!");
    let map_ptr = map.as_mut_ptr();
    let mr_map = qb.pd.reg_mr_owned(map, all).await.unwrap();
    assert_eq!(mr_map.as_mut_ptr(), map_ptr, "registered in place");
    assert_eq!(mr_map.len(), LEN as u64);

    // The aligned allocation, registered raw: the application keeps it.
    let aligned = Aligned::zeroed(LEN);
    // SAFETY: `aligned` outlives the region (it is deregistered below,
    // before `aligned` is dropped); the application's accesses below keep
    // off the bytes each transfer uses.
    let mr_raw = unsafe { qb.pd.reg_mr_raw(aligned.ptr, LEN, all) }
        .await
        .unwrap();
    assert_eq!(mr_raw.as_mut_ptr(), aligned.ptr.as_ptr());
    assert_eq!(mr_raw.as_ptr() as usize % (2 << 20), 0);
    // SAFETY: not zero bytes: refused before anything is registered.
    let empty = unsafe { qb.pd.reg_mr_raw(aligned.ptr, 0, all) }.await;
    assert!(
        matches!(empty, Err(ApiError::Verbs(VerbsError::InvalidLength(0)))),
        "{empty:?}"
    );

    let src_data = pattern(1, LEN);
    let src = qa
        .pd
        .reg_mr(src_data.clone(), AccessFlags::NONE)
        .await
        .unwrap();
    let sink = qa
        .pd
        .reg_mr(vec![0u8; LEN], AccessFlags::LOCAL_WRITE)
        .await
        .unwrap();

    // WRITE into the second half of each region while another thread
    // fills the first half of the raw one through its pointer.
    let raw_base = mr_raw.as_mut_ptr() as usize;
    let filler = std::thread::spawn(move || {
        let base = raw_base as *mut u8;
        for round in 0..16u8 {
            // SAFETY: the first half of the raw region: no transfer uses it
            // until the thread is joined.
            unsafe { std::ptr::write_bytes(base, round, HALF) };
        }
    });
    let w1 = qa.qp.write(
        src.sge(0, HALF as u32).unwrap(),
        mr_map.remote().at(HALF as u64, HALF as u32).unwrap(),
    );
    let w2 = qa.qp.write(
        src.sge(HALF as u64, HALF as u32).unwrap(),
        mr_raw.remote().at(HALF as u64, HALF as u32).unwrap(),
    );
    w1.await.unwrap();
    w2.await.unwrap();
    filler.join().unwrap();
    // SAFETY: the WRITEs completed (the requester's completion follows the
    // responder's placement); the filler is done.
    unsafe {
        assert!(view(map_ptr, 4) == b"map!", "untouched bytes kept");
        assert!(view(map_ptr.add(HALF), HALF) == &src_data[..HALF]);
        assert!(view(raw_base as *const u8, HALF).iter().all(|&x| x == 15));
        assert!(view(mr_raw.as_ptr().add(HALF), HALF) == &src_data[HALF..]);
    }

    // READ: the application fills the raw region's first half in place;
    // the peer READs it.
    let fill = pattern(2, HALF);
    // SAFETY: no transfer uses the first half now.
    unsafe { std::ptr::copy_nonoverlapping(fill.as_ptr(), mr_raw.as_mut_ptr(), HALF) };
    qa.qp
        .read(
            sink.sge(0, HALF as u32).unwrap(),
            mr_raw.remote().at(0, HALF as u32).unwrap(),
        )
        .await
        .unwrap();
    assert!(
        sink.read(0, HALF).await.unwrap() == fill,
        "READ of in-place bytes"
    );

    // SEND into a receive in the map's first half, checked in place.
    let msg = pattern(3, 1 << 20);
    let got = qb.qp.recv(mr_map.sge(8, msg.len() as u32).unwrap());
    let sent_from = qa.pd.reg_mr(msg.clone(), AccessFlags::NONE).await.unwrap();
    qa.qp
        .send(sent_from.sge(0, msg.len() as u32).unwrap())
        .await
        .unwrap();
    assert_eq!(got.await.unwrap().byte_len, msg.len() as u32);
    // SAFETY: the receive completed.
    unsafe {
        assert!(view(map_ptr.add(8), msg.len()) == &msg[..]);
        assert!(view(map_ptr, 4) == b"map!");
    }

    // The map comes back from `dereg`, with what the peer put in it.
    let map: memmap2::MmapMut = mr_map.dereg().await.unwrap().into_owner().unwrap();
    assert_eq!(map.as_ptr(), map_ptr.cast_const());
    assert!(map[HALF..] == src_data[..HALF]);
    assert!(map[8..8 + msg.len()] == msg[..]);
    // Raw memory comes back as a buffer that frees nothing.
    let back = mr_raw.dereg().await.unwrap();
    assert!(back.is_raw());
    assert_eq!(back.as_ptr(), aligned.ptr.as_ptr().cast_const());
    drop(back);
    // SAFETY: deregistered; `aligned` is still alive.
    assert!(unsafe { view(aligned.ptr.as_ptr(), HALF) } == &fill[..]);
}

#[test]
fn memmap_and_aligned_memory_used_in_place_portable() {
    run(Backend::Portable, in_place);
}

#[test]
fn memmap_and_aligned_memory_used_in_place_io_uring() {
    run(Backend::Uring, in_place);
}
