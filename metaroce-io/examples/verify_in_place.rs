//! How long verifying a registered region's bytes takes, against a plain
//! `memcmp` of as many bytes in the same run: a peer WRITEs 120 MiB into a
//! region, and the application compares the region with what it expects,
//! three ways:
//!
//! - `in_place`: through the raw view ([`MemoryRegion::as_ptr`]), no copy;
//! - `lend`: through [`MemoryRegion::lend`] (a round trip to the endpoint
//!   thread, then in place);
//! - `read_copy`: through [`MemoryRegion::read`] (a copy of the region).
//!
//! Each is timed `--reps` times, interleaved with the `memcmp` baseline (two
//! ordinary 120 MiB buffers), and the medians are printed as one JSON
//! object, with each way's ratio to the baseline.
//!
//! ```text
//! cargo run --release -p metaroce-io --example verify_in_place -- [--mib 120] [--reps 9] [--backend portable|io_uring]
//! ```
//!
//! [`MemoryRegion::as_ptr`]: metaroce_io::MemoryRegion::as_ptr
//! [`MemoryRegion::lend`]: metaroce_io::MemoryRegion::lend
//! [`MemoryRegion::read`]: metaroce_io::MemoryRegion::read

use metaroce_io::{connect_qp_pair, AccessFlags, Backend, Device, DriverConfig};
use std::hint::black_box;
use std::time::{Duration, Instant};

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn pattern(len: usize) -> Vec<u8> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

async fn bench(backend: Backend, len: usize, reps: usize) {
    let open = || {
        let mut c = DriverConfig::new("127.0.0.1:0".parse().unwrap());
        c.backend = backend;
        Device::open(c)
    };
    let (a, b) = (open().await.unwrap(), open().await.unwrap());
    let (qa, qb) = connect_qp_pair(&a, &b).await.unwrap();
    let expected = pattern(len);
    let baseline_copy = expected.clone();
    let src = qa
        .pd
        .reg_mr(expected.clone(), AccessFlags::NONE)
        .await
        .unwrap();
    let map = memmap2::MmapOptions::new().len(len).map_anon().unwrap();
    let mut dst = qb
        .pd
        .reg_mr_owned(map, AccessFlags::REMOTE_WRITE)
        .await
        .unwrap();
    qa.qp
        .write(
            src.sge(0, len as u32).unwrap(),
            dst.remote().at(0, len as u32).unwrap(),
        )
        .await
        .unwrap();

    let (mut base, mut in_place, mut lend, mut read) = (vec![], vec![], vec![], vec![]);
    for _ in 0..reps {
        let t = Instant::now();
        assert!(black_box(&baseline_copy[..]) == black_box(&expected[..]));
        base.push(t.elapsed());

        let t = Instant::now();
        // SAFETY: the WRITE completed and the peer writes nothing more: no
        // transfer uses the region while it is read.
        let region = unsafe { std::slice::from_raw_parts(dst.as_ptr(), len) };
        assert!(black_box(region) == black_box(&expected[..]));
        in_place.push(t.elapsed());

        let t = Instant::now();
        let bytes = dst.lend().await.unwrap();
        assert!(black_box(&bytes[..]) == black_box(&expected[..]));
        drop(bytes);
        lend.push(t.elapsed());

        let t = Instant::now();
        let copy = dst.read(0, len).await.unwrap();
        assert!(black_box(&copy[..]) == black_box(&expected[..]));
        read.push(t.elapsed());
    }
    let (base, in_place, lend, read) = (median(base), median(in_place), median(lend), median(read));
    let ratio = |d: Duration| d.as_secs_f64() / base.as_secs_f64();
    println!(
        "{{\"backend\":\"{backend}\",\"bytes\":{len},\"reps\":{reps},\
         \"memcmp_ms\":{:.2},\"in_place_ms\":{:.2},\"lend_ms\":{:.2},\"read_copy_ms\":{:.2},\
         \"in_place_ratio\":{:.3},\"lend_ratio\":{:.3},\"read_copy_ratio\":{:.3}}}",
        ms(base),
        ms(in_place),
        ms(lend),
        ms(read),
        ratio(in_place),
        ratio(lend),
        ratio(read),
    );
}

fn main() {
    let mib: usize = arg("--mib").map_or(120, |s| s.parse().expect("--mib N"));
    let reps: usize = arg("--reps").map_or(9, |s| s.parse().expect("--reps N"));
    let backend = match arg("--backend").as_deref() {
        None | Some("portable") => Backend::Portable,
        Some("io_uring") => Backend::Uring,
        Some(other) => panic!("unknown backend {other} (portable or io_uring)"),
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(bench(backend, mib << 20, reps.max(1)));
}
