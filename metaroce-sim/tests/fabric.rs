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
