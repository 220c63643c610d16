//! Regression tests of the multipath and congestion-control targets
//! (docs/BENCHMARKS.md, "Multipath and congestion-control targets") at a
//! small scale: 16 hosts, short runs, fast in debug builds.
//!
//! The thresholds sit below the values the current core measured (noted
//! next to each assertion, release and debug give the same numbers: the
//! simulation is deterministic); they catch regressions, they are not the
//! targets themselves (those are measured at 64 hosts with `metaroce sim`).

use metaroce_sim::series::recovery_ns;
use metaroce_sim::time::NS_PER_US;
use metaroce_sim::{run, FaultSpec, Pattern, SimConfig, SimReport, TransportKind};

/// 16 hosts, 4 leaves of 4, 4 spines, 100 Gbit/s, long-running
/// permutation flows, 64 KiB WRITEs, no byte verification (speed).
fn small(duration_us: u64) -> SimConfig {
    let mut c = SimConfig {
        transport: TransportKind::Metaroce,
        hosts: 16,
        spines: 4,
        duration_ns: duration_us * NS_PER_US,
        ..SimConfig::default()
    };
    c.metaroce.chunk_bytes = 64 * 1024;
    c.metaroce.verify_every = 0;
    c
}

fn go(c: &SimConfig) -> SimReport {
    let r = run(c);
    eprint!("{}", metaroce_sim::render_table(std::slice::from_ref(&r)));
    eprintln!(
        "jain {:?} util {:?} rxq {:?} conv {:?} recovery {:?} after {:?}",
        r.jain_fairness,
        r.receiver_utilization,
        r.receiver_max_queue_bytes,
        r.convergence_us,
        r.recovery_us,
        r.goodput_after_fault_gbps
    );
    assert_eq!(r.bytes_lost, 0, "bytes lost");
    assert!(r.packets.is_conserved());
    r
}

fn with_loss(c: &SimConfig, loss: f64) -> SimConfig {
    SimConfig { loss, ..c.clone() }
}

#[test]
fn series_covers_the_run_and_sums_to_goodput() {
    let c = small(300);
    let r = go(&c);
    assert_eq!(r.bin_us, 10.0);
    assert_eq!(r.goodput_series_gbps.len(), 30);
    let mean = r.goodput_series_gbps.iter().sum::<f64>() / 30.0;
    assert!(
        (mean - r.goodput_gbps).abs() < 1e-6,
        "{mean} vs {}",
        r.goodput_gbps
    );
    // Deterministic.
    assert_eq!(go(&c).without_wall_clock(), r.without_wall_clock());
}

#[test]
fn lossless_permutation_goodput() {
    let r = go(&small(500));
    // Measured 0.836 (0.773 before the grant cap counted one ACK's bytes;
    // start-up included; the handshake and first RTTs
    // weigh on a 0.5 ms run).
    assert!(r.goodput_fraction >= 0.70, "{}", r.goodput_fraction);
}

#[test]
fn loss_1_percent_keeps_most_of_lossless() {
    // The benchmark's workload (256 KiB WRITEs, 4 posted: 1 MiB, ~9 BDPs).
    // With 64 KiB WRITEs only 256 KiB is posted, about two BDPs, so a hole
    // being repaired in the oldest WRITE idles the sender: 74.9 / 83.6 =
    // 0.896 (72.5 / 77.3 = 0.937 while the grant cap still held lossless
    // runs below the line). That measures the application's posting depth.
    let mut c = small(500);
    c.metaroce.chunk_bytes = 256 * 1024;
    let base = go(&c).goodput_gbps;
    let r = go(&with_loss(&c, 0.01));
    // Measured 82.05 / 83.89 = 0.978.
    assert!(
        r.goodput_gbps >= 0.95 * base,
        "{} vs {base}",
        r.goodput_gbps
    );
}

#[test]
fn loss_10_percent_keeps_a_share_of_lossless() {
    let c = small(1_000);
    let base = go(&c).goodput_gbps;
    let r = go(&with_loss(&c, 0.1));
    let ratio = r.goodput_gbps / base;
    // Measured 53.97 / 87.88 = 0.614 (49.8 / 79.6 = 0.626 before the
    // grant cap counted one ACK's bytes; 64 KiB WRITEs; a 1 ms run: lost handshakes and the
    // first RTTs weigh more than in the 10 ms benchmark).
    assert!(ratio >= 0.55, "{ratio}");
}

#[test]
fn loss_1_percent_beats_go_back_n() {
    let c = with_loss(&small(500), 0.01);
    let m = go(&c).goodput_gbps;
    let g = go(&SimConfig {
        transport: TransportKind::RoceV2Gbn,
        ..c
    })
    .goodput_gbps;
    // Measured 74.9 vs 48.0 (1.6x; the 5x target is at 64 hosts).
    assert!(m >= 1.3 * g, "{m} vs {g}");
}

#[test]
fn spine_failure_loses_nothing_and_recovers() {
    // 2 leaves of 8, 8 spines: spine 1 fails at 400 µs (7/8 of the
    // inter-leaf capacity left).
    let mut c = SimConfig {
        spines: 8,
        bin_ns: 20 * NS_PER_US,
        faults: vec!["spine:1@0.4".parse::<FaultSpec>().unwrap()],
        ..small(800)
    };
    c.metaroce.outstanding = 8;
    let r = go(&c);
    let after = r.goodput_after_fault_gbps.expect("a failure");
    // Back at 0.85 of line (averaged over 5 bins of 20 µs): measured 20 µs.
    let rec = r.recovery_us.expect("recovers");
    assert!(rec <= 100.0, "{rec}");
    // The same from the series, at a lower bar.
    let low = recovery_ns(&r.goodput_series_gbps, c.bin_ns, 400 * NS_PER_US, 60.0);
    assert!(low.is_some_and(|ns| ns as f64 <= rec * 1e3), "{low:?}");
    // Measured 85.1 Gb/s from the failure to the end.
    assert!(after >= 75.0, "{after}");
}

#[test]
fn incast_is_fair_and_fills_the_receiver() {
    let mut c = SimConfig {
        pattern: Pattern::Incast { senders: 8 },
        ..small(1_000)
    };
    c.metaroce.outstanding = 8;
    let r = go(&c);
    let util = r.receiver_utilization.unwrap();
    let jain = r.jain_fairness.unwrap();
    // Measured 0.914 and 0.9990.
    assert!(util >= 0.85, "{util}");
    assert!(jain >= 0.98, "{jain}");
    assert!(r.receiver_max_queue_bytes.is_some());
    assert!(r.convergence_window_us.is_some());
}

#[test]
fn incast_queue_stays_short_and_rates_converge_at_once() {
    let mut c = SimConfig {
        pattern: Pattern::Incast { senders: 12 },
        ..small(1_000)
    };
    c.metaroce.outstanding = 8;
    let r = go(&c);
    // Limit: ECN threshold + one BDP (100 Gbit/s x the fabric's ~9.4 us RTT).
    let bdp = 100_000_000_000u64 / 8 * 94 / 10_000_000;
    let limit = c.ecn_threshold_bytes + bdp;
    let q = r.receiver_max_queue_bytes.unwrap();
    assert!(q < limit, "queue {q} vs {limit}");
    assert_eq!(r.packets.dropped_tail, 0);
    // Converged in the first window the measure can resolve (the start is
    // two handshake round trips in).
    let conv = r.convergence_us.expect("converges");
    let window = r.convergence_window_us.unwrap();
    assert!(
        conv <= window + 3.0 * r.bin_us,
        "{conv} us, window {window}"
    );
    // Without the first-flight limit every sender starts with one BDP: the
    // queue is several times deeper (the mechanism is what keeps it short).
    c.metaroce.first_flight_bytes = Some(u64::MAX);
    let burst = go(&c);
    let qb = burst.receiver_max_queue_bytes.unwrap();
    assert!(qb > 2 * q, "{qb} vs {q}");
}

#[test]
fn ablation_one_path_costs_goodput() {
    let c = small(500);
    let eight = go(&c).goodput_gbps;
    let mut one = c.clone();
    one.metaroce.paths = 1;
    let one = go(&one).goodput_gbps;
    // Measured 77.3 (8 paths) vs 62.3 (1 path).
    assert!(one < 0.9 * eight, "{one} vs {eight}");
}

#[test]
fn ablation_ecn_off_marks_nothing() {
    let mut c = SimConfig {
        pattern: Pattern::Incast { senders: 8 },
        ecn_marking: false,
        ..small(500)
    };
    c.metaroce.receiver_hints = false;
    let off = go(&c);
    assert_eq!(off.ecn_marked_fraction, 0.0);
    let on = go(&SimConfig {
        ecn_marking: true,
        ..c
    });
    assert!(on.ecn_marked_fraction > 0.0);
    // Without ECN (and without hints) the receiver's queue is deeper:
    // measured 998 KB (tail drops) against 713 KB.
    assert!(
        off.receiver_max_queue_bytes >= on.receiver_max_queue_bytes,
        "{:?} vs {:?}",
        off.receiver_max_queue_bytes,
        on.receiver_max_queue_bytes
    );
}

#[test]
fn ablation_receiver_hints_change_the_incast() {
    let mut c = SimConfig {
        pattern: Pattern::Incast { senders: 8 },
        ..small(500)
    };
    let on = go(&c);
    c.metaroce.receiver_hints = false;
    let off = go(&c);
    // With hints the senders hold about one grant's worth in flight: fewer
    // CE marks at the receiver's port (measured 12.0% against 95.8%).
    assert!(
        on.ecn_marked_fraction < off.ecn_marked_fraction,
        "{} vs {}",
        on.ecn_marked_fraction,
        off.ecn_marked_fraction
    );
}

/// 16 hosts, 4 leaves of 4, 4 spines, with the benchmark's workload
/// (256 KiB WRITEs, 8 outstanding), 2 ms, no byte verification.
fn bench_like() -> SimConfig {
    let mut c = small(2_000);
    c.metaroce.chunk_bytes = 256 * 1024;
    c
}

/// Mean goodput from 0.5 ms on (past the handshakes and first grants).
fn steady(r: &SimReport) -> f64 {
    let s = &r.goodput_series_gbps[50..];
    s.iter().sum::<f64>() / s.len() as f64
}

#[test]
fn lossless_fraction_and_10_percent_loss_ratio() {
    let c = bench_like();
    let base = go(&c);
    let lossy = go(&with_loss(&c, 0.1));
    let (b, l) = (steady(&base), steady(&lossy));
    eprintln!(
        "lossless {} (steady {b}), 10% loss {} (steady {l}): ratio {}",
        base.goodput_fraction,
        lossy.goodput_gbps,
        l / b
    );
    // Measured steady 95.9 Gb/s (whole run 0.929 of line: start-up weighs
    // on 2 ms).
    assert!(b >= 95.0, "lossless steady {b} Gb/s");
    // Measured 87.3 / 95.9 = 0.910 (the physical limit is about 0.90 of
    // the line: retransmissions take a tenth of every link).
    assert!(l / b >= 0.88, "10% loss: {l} / {b}");
}

/// One connection each way between two hosts on two leaves, 16 paths over
/// 4 spines that each carry a quarter of a host's rate (1:1, one host per
/// leaf), so the spines, not the hosts, are the bottleneck. With seed 1 the
/// hash leaves host 0's connection with no path over one spine: spraying
/// alone kept it at 3/4 of the line (84.4 Gb/s per host, against 96.4 with
/// seeds 2-8). Moving persistently congested, starved paths to new source
/// ports finds the idle spine: 94.2 Gb/s.
#[test]
fn congested_paths_move_to_an_unused_spine() {
    let mut c = SimConfig {
        transport: TransportKind::Metaroce,
        hosts: 2,
        hosts_per_leaf: Some(1),
        spines: 4,
        duration_ns: 20_000 * NS_PER_US,
        seed: 1,
        ..SimConfig::default()
    };
    c.metaroce.paths = 16;
    c.metaroce.verify_every = 0;
    let r = go(&c);
    let m = r.metaroce.as_ref().expect("metaroce summary");
    eprintln!("path moves {}", m.path_moves);
    assert!(m.path_moves > 0, "no path moved");
    // Measured 2: it finds the spine and stops (no churn).
    assert!(m.path_moves <= 8, "{} moves", m.path_moves);
    assert_eq!(m.path_failures, 0, "a congested path is not a failed one");
    assert_eq!(r.bytes_lost + r.bytes_corrupted, 0);
    // Measured 94.21 Gb/s (0.942 of the line).
    assert!(r.goodput_fraction >= 0.92, "{}", r.goodput_fraction);
}
