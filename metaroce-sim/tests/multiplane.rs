//! Multiplane at a small scale: 16 hosts, 4 spines per plane, 100 Gbit/s
//! per NIC port, permutation. A connection spreads its paths over every
//! plane both hosts have; goodput must scale with the planes, and a failed
//! plane must cost only its share, with no byte lost and no QP failing.
//!
//! The thresholds sit below the measured values (noted next to each
//! assertion; the simulation is deterministic). The 64-host targets are
//! measured with `metaroce sim --planes 4` (docs/BENCHMARKS.md).

use metaroce_sim::time::NS_PER_US;
use metaroce_sim::{run, FaultSpec, SimConfig, SimReport, TransportKind};

/// `planes` planes, 8 paths and 4 outstanding 64 KiB WRITEs per plane (the
/// application keeps the same bytes posted per unit of line rate).
fn cfg(planes: u32, duration_us: u64) -> SimConfig {
    let mut c = SimConfig {
        transport: TransportKind::Metaroce,
        hosts: 16,
        spines: 4,
        planes,
        duration_ns: duration_us * NS_PER_US,
        ..SimConfig::default()
    };
    c.metaroce.paths = 8 * planes as u8;
    c.metaroce.chunk_bytes = 64 * 1024;
    c.metaroce.outstanding = 4 * planes;
    c.metaroce.verify_every = 4;
    c
}

fn go(c: &SimConfig) -> SimReport {
    let r = run(c);
    eprint!("{}", metaroce_sim::render_table(std::slice::from_ref(&r)));
    eprintln!(
        "recovery {:?} after {:?}",
        r.recovery_us, r.goodput_after_fault_gbps
    );
    assert_eq!(r.bytes_lost, 0, "bytes lost");
    assert_eq!(r.bytes_corrupted, 0, "bytes corrupted");
    assert!(r.packets.is_conserved());
    let m = r.metaroce.expect("metaroce summary");
    assert_eq!(m.adapter.connections_lost, 0, "a connection failed");
    assert_eq!(m.adapter.writes_failed, 0, "a WRITE completed in error");
    assert_eq!(m.adapter.bytes_corrupted, 0);
    assert!(m.adapter.writes_verified > 0);
    r
}

#[test]
fn goodput_scales_with_planes() {
    let one = go(&cfg(1, 600)).goodput_gbps;
    for planes in [2u32, 4] {
        let r = go(&cfg(planes, 600));
        let ratio = r.goodput_gbps / (planes as f64 * one);
        // Measured 2 planes: 1.000, 4 planes: 0.946 (x one plane's
        // 85.7 Gb/s; 324 Gb/s in all). One plane gained more than four
        // from the peak-RTT loss rules (83.1 -> 85.7 Gb/s, against 322 ->
        // 324 Gb/s): the ratio fell, the goodput did not.
        assert!(
            ratio >= 0.94,
            "{planes} planes: {} Gb/s = {ratio} x {planes} x {one}",
            r.goodput_gbps
        );
    }
}

#[test]
fn failed_plane_costs_only_its_share() {
    let planes = 4;
    let base = cfg(planes, 1_200);
    let mut c = base.clone();
    c.faults = vec!["plane:1@0.4".parse::<FaultSpec>().unwrap()];
    let before = go(&base);
    let r = go(&c);
    assert!(r.packets.dropped_failed_link > 0, "the plane did fail");
    let after = r.goodput_after_fault_gbps.expect("a fault ran");
    // The same run without the fault, over the same interval.
    let bins = &before.goodput_series_gbps[40..];
    let healthy = bins.iter().sum::<f64>() / bins.len() as f64;
    let share = after / healthy;
    // Measured 245-246 Gb/s after the failure, 0.694-0.698 of the healthy
    // run over the same interval (it was 260 before the probe backoff and
    // the NAK checks of the hardening work; the route checks of ACK paths
    // cost 0.003 of it); the 64-host benchmark keeps 0.765 of its 4-plane
    // run, above (P-1)/P = 0.75.
    assert!(
        share >= 0.69,
        "after the plane failed: {after} Gb/s = {share} of {healthy}"
    );
    // The dead plane's paths carry only probes: it takes a small fraction
    // of the data packets after the failure.
    assert!(r.goodput_gbps > 0.7 * before.goodput_gbps);
}
