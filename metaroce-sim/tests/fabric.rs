//! Fabric-level behaviour: conservation, determinism, ECMP, loss, failures,
//! queues.

mod common;

use common::small;
use metaroce_sim::ecmp::FiveTuple;
use metaroce_sim::time::{NS_PER_MS, NS_PER_US};
use metaroce_sim::topology::{Fabric, LinkKind, TopologySpec};
use metaroce_sim::{
    run, FaultAction, FaultSpec, FaultTarget, LossLinks, Pattern, SimConfig, TransportKind,
};

#[test]
fn every_packet_is_delivered_dropped_or_in_flight() {
    for transport in [
        TransportKind::RoceV2Gbn,
        TransportKind::Irn,
        TransportKind::Blast,
    ] {
        let cfg = SimConfig {
            loss: 0.02,
            faults: vec!["spine:1@0.3-0.6".parse().unwrap()],
            routing_convergence_ns: 50 * NS_PER_US,
            buffer_bytes: 200_000,
            ..small(transport)
        };
        let r = run(&cfg);
        let p = r.packets;
        assert!(p.is_conserved(), "{transport}: {p:?}");
        assert!(p.dropped_loss > 0, "{transport}: {p:?}");
        assert!(p.dropped_failed_link > 0, "{transport}: {p:?}");
        assert!(
            p.in_flight > 0,
            "a run cut at its duration leaves packets in flight"
        );
        assert!(p.delivered > 10_000);
    }
}

#[test]
fn same_seed_same_report_different_seed_different_report() {
    let cfg = SimConfig {
        loss: 0.01,
        ..small(TransportKind::Irn)
    };
    let a = run(&cfg);
    let b = run(&cfg);
    assert_eq!(a.without_wall_clock(), b.without_wall_clock());
    assert_eq!(
        serde_json::to_string(&a.without_wall_clock()).unwrap(),
        serde_json::to_string(&b.without_wall_clock()).unwrap()
    );
    let c = run(&SimConfig { seed: 2, ..cfg });
    assert_ne!(a.without_wall_clock(), c.without_wall_clock());
}

#[test]
fn ecmp_spreads_source_ports_roughly_uniformly_over_spines() {
    let spec = TopologySpec {
        hosts: 16,
        hosts_per_leaf: 8,
        spines: 8,
        planes: 1,
        host_gbps: 100.0,
        spine_gbps: 100.0,
        prop_ns: 1000,
        buffer_bytes: 1 << 20,
        ecn_threshold_bytes: 100_000,
    };
    let fabric = Fabric::new(spec, 42);
    let mut counts = [0u32; 8];
    let n = 8_000;
    for port in 0..n {
        let t = FiveTuple {
            src_ip: 0x0a00_0001,
            dst_ip: 0x0a00_0101,
            src_port: 49152 + port as u16,
            dst_port: 4791,
            proto: 17,
        };
        counts[fabric.ecmp_spine(0, 0, 1, &t).unwrap() as usize] += 1;
    }
    let mean = n as f64 / 8.0;
    for c in counts {
        assert!((c as f64 - mean).abs() < 0.12 * mean, "{counts:?}");
    }
}

#[test]
fn many_flows_use_every_spine_end_to_end() {
    // All-to-all on 16 hosts gives 128 inter-leaf QPs with distinct ports.
    let cfg = SimConfig {
        hosts: 16,
        spines: 4,
        hosts_per_leaf: Some(8),
        pattern: Pattern::AllToAll,
        duration_ns: 200 * NS_PER_US,
        ..small(TransportKind::Blast)
    };
    let r = run(&cfg);
    let load = r.spine_load();
    let mean = load.iter().sum::<u64>() as f64 / load.len() as f64;
    assert!(mean > 1000.0);
    for l in &load {
        assert!((*l as f64) > 0.5 * mean, "{load:?}");
    }
}

#[test]
fn random_loss_drops_the_requested_fraction() {
    for (links, p) in [
        (LossLinks::SpineToLeaf, 0.05),
        (LossLinks::LeafToHost, 0.01),
    ] {
        let cfg = SimConfig {
            loss: p,
            loss_links: links,
            duration_ns: 2 * NS_PER_MS,
            ..small(TransportKind::Blast)
        };
        let r = run(&cfg);
        let offered: u64 = r
            .links
            .iter()
            .filter(|l| links.applies(l.kind))
            .map(|l| l.offered)
            .sum();
        let n = offered as f64;
        let sigma = (n * p * (1.0 - p)).sqrt();
        let dropped = r.packets.dropped_loss as f64;
        assert!(n > 20_000.0);
        assert!(
            (dropped - n * p).abs() < 5.0 * sigma,
            "{links:?}: {dropped} of {n} at p={p}"
        );
    }
}

#[test]
fn a_failed_spine_carries_nothing_and_ecmp_avoids_it() {
    let base = SimConfig {
        pattern: Pattern::AllToAll,
        ..small(TransportKind::Blast)
    };
    let healthy = run(&base);
    assert!(healthy.spine_load()[2] > 0);

    // Converged at once: nothing is hashed onto spine 2, nothing is lost.
    let cfg = SimConfig {
        faults: vec!["spine:2@0".parse().unwrap()],
        ..base.clone()
    };
    let r = run(&cfg);
    assert_eq!(r.spine_load()[2], 0);
    assert_eq!(r.packets.dropped_failed_link, 0);
    assert!(r.spine_load().iter().all(|&l| l == 0 || l > 1000));

    // Routing converges after 200 µs: packets hashed onto the dead spine
    // until then are dropped, and it still carries nothing.
    let cfg = SimConfig {
        routing_convergence_ns: 200 * NS_PER_US,
        ..cfg
    };
    let r = run(&cfg);
    assert_eq!(r.spine_load()[2], 0);
    assert!(r.packets.dropped_failed_link > 100, "{:?}", r.packets);
    assert!(r.packets.is_conserved());
}

#[test]
fn a_failed_leaf_spine_link_stops_traffic_on_that_link_only() {
    let cfg = SimConfig {
        pattern: Pattern::AllToAll,
        faults: vec!["link:0-1@0.2".parse().unwrap()],
        ..small(TransportKind::Blast)
    };
    let before = run(&SimConfig {
        duration_ns: 200 * NS_PER_US,
        ..cfg.clone()
    });
    let after = run(&cfg);
    let carried = |r: &metaroce_sim::SimReport, kind: LinkKind| {
        r.links.iter().find(|l| l.kind == kind).unwrap().carried
    };
    let up = LinkKind::LeafUp {
        plane: 0,
        leaf: 0,
        spine: 1,
    };
    let down = LinkKind::SpineDown {
        plane: 0,
        spine: 1,
        leaf: 0,
    };
    let other = LinkKind::LeafUp {
        plane: 0,
        leaf: 1,
        spine: 1,
    };
    assert!(carried(&before, up) > 0 && carried(&before, down) > 0);
    // Nothing more crossed the link after it failed at 200 µs (packets
    // already in flight at the instant of failure are dropped too).
    assert!(carried(&after, up) <= carried(&before, up));
    assert!(carried(&after, down) <= carried(&before, down));
    // Leaf 1 keeps using spine 1 for destinations it can still reach.
    assert!(carried(&after, other) > carried(&before, other));
}

#[test]
fn a_degraded_link_runs_slower() {
    let flow = metaroce_sim::FlowRequest {
        src: 0,
        dst: 4,
        bytes: None,
        start_ns: 0,
    };
    let base = SimConfig {
        pattern: Pattern::Flows(vec![flow]),
        ..small(TransportKind::Blast)
    };
    let fast = run(&base);
    let slow = run(&SimConfig {
        faults: vec![FaultSpec {
            target: FaultTarget::Host { plane: 0, host: 4 },
            at_ns: 0,
            until_ns: None,
            action: FaultAction::Degrade { gbps: 25.0 },
        }],
        ..base
    });
    let ratio = slow.goodput_gbps / fast.goodput_gbps;
    assert!((0.2..0.3).contains(&ratio), "{ratio}");
    assert!(
        slow.packets.dropped_tail > 0,
        "the leaf port towards host 4 overflows"
    );
}

#[test]
fn incast_with_a_dumb_transport_fills_the_buffer_and_tail_drops() {
    let cfg = SimConfig {
        pattern: Pattern::Incast { senders: 6 },
        buffer_bytes: 300_000,
        duration_ns: 500 * NS_PER_US,
        ..small(TransportKind::Blast)
    };
    let r = run(&cfg);
    assert!(r.max_queue_bytes > 290_000, "{}", r.max_queue_bytes);
    assert!(r.max_queue_bytes <= 300_000);
    assert!(r.packets.dropped_tail > 1000, "{:?}", r.packets);
    // The receiver's link is the bottleneck and stays busy.
    assert!(r.goodput_fraction > 0.9, "{}", r.goodput_fraction);
    assert!(r.packets.is_conserved());
}

#[test]
fn ecn_marks_appear_under_incast_for_ecn_capable_traffic() {
    let cfg = SimConfig {
        pattern: Pattern::Incast { senders: 4 },
        ..small(TransportKind::Irn)
    };
    let r = run(&cfg);
    assert!(r.ecn_marked_fraction > 0.01, "{}", r.ecn_marked_fraction);
    assert!(r.transport_stats.cnps > 0);
    // ECN-less blast never gets marked.
    let r = run(&SimConfig {
        transport: TransportKind::Blast,
        ..cfg
    });
    assert_eq!(r.ecn_marked_fraction, 0.0);
}

#[test]
fn multiplane_uses_every_plane() {
    let cfg = SimConfig {
        planes: 2,
        pattern: Pattern::AllToAll,
        duration_ns: 300 * NS_PER_US,
        ..small(TransportKind::Irn)
    };
    let r = run(&cfg);
    let load = r.spine_load();
    assert_eq!(load.len(), 8);
    assert!(
        load[..4].iter().sum::<u64>() > 0 && load[4..].iter().sum::<u64>() > 0,
        "{load:?}"
    );
    assert!(r.packets.is_conserved());
    assert_eq!(r.bytes_lost, 0);

    // A whole plane failing: traffic on the other continues.
    let r = run(&SimConfig {
        faults: vec!["plane:1@0".parse().unwrap()],
        ..cfg
    });
    assert!(r.spine_load()[4..].iter().all(|&l| l == 0));
    assert!(r.goodput_gbps > 0.0);
}

/// One long-running flow from host 0 to host 4 (across the spines).
fn one_flow(transport: TransportKind) -> SimConfig {
    let flow = metaroce_sim::FlowRequest {
        src: 0,
        dst: 4,
        bytes: None,
        start_ns: 0,
    };
    SimConfig {
        pattern: Pattern::Flows(vec![flow]),
        ..small(transport)
    }
}

#[test]
fn shaped_spines_carry_the_shaping_rate_after_a_line_rate_burst() {
    // Spine links of 100 Gbit/s shaped to 10 Gbit/s, bucket 200 KB, queue
    // 1 MB. A blaster at 100 Gbit/s on one spine: the bucket lets 200 KB
    // through at line rate, then the port releases 10 Gbit/s.
    let base = one_flow(TransportKind::Blast);
    let cfg = SimConfig {
        spine_shaper: Some("10:200000:1000000".parse().unwrap()),
        duration_ns: 2 * NS_PER_MS,
        bin_ns: 10 * NS_PER_US,
        ..base.clone()
    };
    let r = run(&cfg);
    // Bits of the first 20 µs: at line rate, 200 KB of burst (16 µs).
    let first: f64 = r.goodput_series_gbps[..2].iter().sum::<f64>() / 2.0;
    assert!(first > 60.0, "burst at line rate: {first} Gb/s");
    // After the queue filled, the shaped rate, less headers.
    let tail = &r.goodput_series_gbps[100..];
    let steady = tail.iter().sum::<f64>() / tail.len() as f64;
    assert!((9.0..10.0).contains(&steady), "{steady} Gb/s");
    // A deep queue, filled to its limit, then tail drops.
    assert!(r.max_queue_bytes > 990_000 && r.max_queue_bytes <= 1_000_000);
    assert!(r.packets.dropped_tail > 1000);
    assert!(r.packets.is_conserved());

    // A 1 ms latency limit at 10 Gbit/s: 1.25 MB + the 200 KB burst.
    let r = run(&SimConfig {
        spine_shaper: Some("10:200000:1ms".parse().unwrap()),
        ..cfg.clone()
    });
    assert!(r.max_queue_bytes > 1_440_000 && r.max_queue_bytes <= 1_450_000);

    // Unshaped, the same flow runs at line rate.
    let r = run(&SimConfig {
        spine_shaper: None,
        ..cfg
    });
    assert!(r.goodput_gbps > 90.0, "{}", r.goodput_gbps);
}

#[test]
fn a_gray_spine_stays_up_and_carries_a_fraction_of_its_rate() {
    // `spine:2@0=10`: spine 2's links run at 10 of their 100 Gbit/s.
    let base = SimConfig {
        pattern: Pattern::AllToAll,
        ..small(TransportKind::Blast)
    };
    let cfg = SimConfig {
        faults: vec!["spine:2@0=10".parse().unwrap()],
        ..base.clone()
    };
    let r = run(&cfg);
    let load = r.spine_load();
    let others = (load[0] + load[1] + load[3]) as f64 / 3.0;
    // ECMP still hashes onto it (it is up): it gets offered its share...
    let offered = |r: &metaroce_sim::SimReport, spine: u32| -> u64 {
        r.links
            .iter()
            .filter(|l| matches!(l.kind, LinkKind::LeafUp { spine: s, .. } if s == spine))
            .map(|l| l.offered)
            .sum()
    };
    assert!(offered(&r, 2) as f64 > 0.5 * others, "{load:?}");
    // ... but carries only what a tenth of the rate lets through.
    let carried = load[2] as f64;
    assert!(carried > 0.0 && carried < 0.25 * others, "{load:?}");
    assert!(r.packets.dropped_tail > 1000);
    assert_eq!(r.packets.dropped_failed_link, 0);
    assert!(r.packets.is_conserved());
    // Healthy, spine 2 carries as much as its peers.
    let h = run(&base).spine_load();
    assert!(
        h[2] as f64 > 0.7 * (h[0] + h[1] + h[3]) as f64 / 3.0,
        "{h:?}"
    );
}

#[test]
fn a_blackholed_spine_drops_everything_while_ecmp_keeps_hashing_onto_it() {
    let base = SimConfig {
        pattern: Pattern::AllToAll,
        ..small(TransportKind::Blast)
    };
    let leaf_up_offered = |r: &metaroce_sim::SimReport, spine: u32| -> u64 {
        r.links
            .iter()
            .filter(|l| matches!(l.kind, LinkKind::LeafUp { spine: s, .. } if s == spine))
            .map(|l| l.offered)
            .sum()
    };
    let bh = run(&SimConfig {
        faults: vec!["spine:2@0=blackhole".parse().unwrap()],
        ..base.clone()
    });
    // Routing still chooses spine 2: packets are offered to it as to its
    // peers, and every one of them is dropped.
    let load = bh.spine_load();
    assert_eq!(load[2], 0, "{load:?}");
    let offered = leaf_up_offered(&bh, 2);
    assert!(
        offered as f64 > 0.7 * load[0] as f64,
        "{offered} vs {load:?}"
    );
    assert!(bh.packets.dropped_blackhole >= offered - 100);
    assert_eq!(bh.packets.dropped_failed_link, 0);
    assert!(bh.packets.is_conserved());

    // A failed spine with routing converging at once: nothing is hashed
    // onto it, nothing is lost.
    let failed = run(&SimConfig {
        faults: vec!["spine:2@0".parse().unwrap()],
        ..base.clone()
    });
    assert_eq!(leaf_up_offered(&failed, 2), 0);
    assert_eq!(failed.packets.dropped(), 0);

    // A blackhole that starts mid-run and ends: traffic crosses the spine
    // again afterwards; the loss is counted as after a failure.
    let mid = run(&SimConfig {
        faults: vec!["spine:2@0.2-0.6"
            .parse::<FaultSpec>()
            .map(|f| FaultSpec {
                action: FaultAction::Blackhole,
                ..f
            })
            .unwrap()],
        ..base
    });
    assert!(mid.spine_load()[2] > 1000);
    assert!(mid.packets.dropped_blackhole > 1000);
    assert!(mid.goodput_after_fault_gbps.is_some());
}

#[test]
fn host_stalls_pause_a_host_and_deliver_held_packets_together() {
    let base = SimConfig {
        duration_ns: 20 * NS_PER_MS,
        bin_ns: 10 * NS_PER_US,
        ..one_flow(TransportKind::Blast)
    };
    let clean = run(&base);
    // One stall per ms of running time, each exactly 100 µs: the hosts are
    // stalled 1/11 of the time.
    let cfg = SimConfig {
        host_stalls: Some("1:100:fixed".parse().unwrap()),
        ..base
    };
    let r = run(&cfg);
    assert_eq!(r.without_wall_clock(), run(&cfg).without_wall_clock());
    assert!(r.packets.is_conserved());
    assert_eq!(r.packets.dropped(), 0);
    // The sender sends nothing while stalled; the receiver loses nothing.
    let ratio = r.goodput_gbps / clean.goodput_gbps;
    assert!((0.84..0.96).contains(&ratio), "{ratio}");
    // Stalls show as runs of empty bins (either host stalled), followed by
    // the receiver's backlog at once; the clean run has no empty bin.
    let longest_gap = |s: &[f64]| {
        let (mut best, mut cur) = (0, 0);
        for &g in s {
            cur = if g == 0.0 { cur + 1 } else { 0 };
            best = best.max(cur);
        }
        best
    };
    assert_eq!(longest_gap(&clean.goodput_series_gbps[1..]), 0);
    assert!(longest_gap(&r.goodput_series_gbps) >= 9);
    let peak = r.goodput_series_gbps.iter().cloned().fold(0.0, f64::max);
    assert!(
        peak > 2.0 * clean.goodput_gbps,
        "held packets arrive together: {peak}"
    );
}

#[test]
fn finite_flows_report_rates_and_makespan() {
    let flows = vec![
        metaroce_sim::FlowRequest {
            src: 0,
            dst: 4,
            bytes: Some(2_000_000),
            start_ns: 0,
        },
        metaroce_sim::FlowRequest {
            src: 1,
            dst: 5,
            bytes: Some(1_000_000),
            start_ns: 100 * NS_PER_US,
        },
    ];
    let r = run(&SimConfig {
        pattern: Pattern::Flows(flows),
        ..small(TransportKind::Irn)
    });
    assert_eq!(r.flows_completed, 2);
    let (min, mean, max) = (
        r.flow_rate_min_gbps.unwrap(),
        r.flow_rate_mean_gbps.unwrap(),
        r.flow_rate_max_gbps.unwrap(),
    );
    assert!(min <= mean && mean <= max && min > 20.0 && max < 100.0);
    assert!((mean - (min + max) / 2.0).abs() < 1e-9);
    // Each rate is a flow's bytes over one of the two completion times.
    let (p50, p99) = (r.fct_p50_us.unwrap() * 1e3, r.fct_p99_us.unwrap() * 1e3);
    let close = |a: f64, b: f64| (a - b).abs() < 1e-6;
    let sorted = |a: f64, b: f64| (a.min(b), a.max(b));
    let (a, b) = sorted(16e6 / p50, 8e6 / p99);
    let (c, d) = sorted(16e6 / p99, 8e6 / p50);
    assert!(
        (close(min, a) && close(max, b)) || (close(min, c) && close(max, d)),
        "{min} {max} vs fcts {p50} {p99}"
    );
    // The makespan ends with the last flow; the run ends there too.
    let makespan = r.makespan_us.unwrap();
    assert!(
        (makespan - r.sim_ms * 1e3).abs() < 1.0,
        "{makespan} vs {}",
        r.sim_ms
    );

    // Long-running flows have neither.
    let r = run(&one_flow(TransportKind::Irn));
    assert_eq!((r.flow_rate_mean_gbps, r.makespan_us), (None, None));
}
