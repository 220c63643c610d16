//! The baselines' defining behaviours, end to end over the fabric.

mod common;

use common::small;
use metaroce_sim::time::{NS_PER_MS, NS_PER_US};
use metaroce_sim::topology::LinkKind;
use metaroce_sim::{
    run, FaultAction, FaultSpec, FaultTarget, FlowRequest, Pattern, SimConfig, SimReport,
    TransportKind,
};

/// One 2 MB flow from host 0 to host 4 (other leaf) with the 200th data
/// packet host 0 sends dropped on its uplink.
fn single_loss(transport: TransportKind) -> SimReport {
    let cfg = SimConfig {
        pattern: Pattern::Flows(vec![FlowRequest {
            src: 0,
            dst: 4,
            bytes: Some(2_000_000),
            start_ns: 0,
        }]),
        faults: vec![FaultSpec {
            target: FaultTarget::Link(LinkKind::HostUp { plane: 0, host: 0 }),
            at_ns: 0,
            until_ns: None,
            action: FaultAction::DropNth { ordinal: 200 },
        }],
        ..small(transport)
    };
    let r = run(&cfg);
    assert_eq!(r.packets.dropped_targeted, 1);
    assert_eq!(r.packets.dropped(), 1, "{:?}", r.packets);
    assert_eq!(r.flows_completed, 1, "{transport}");
    assert_eq!(r.bytes_lost, 0);
    assert!(r.packets.is_conserved());
    r
}

#[test]
fn go_back_n_resends_the_window_after_one_loss() {
    let r = single_loss(TransportKind::RoceV2Gbn);
    let retx = r.transport_stats.retransmitted_packets;
    // Everything sent during about one RTT after the lost packet goes again:
    // at 100 Gbit/s and ~10 µs RTT that is a few dozen 4 KB packets.
    assert!((10..=60).contains(&retx), "go-back-N retransmitted {retx}");
    assert_eq!(
        r.transport_stats.timeouts, 0,
        "the NAK, not the RTO, recovers"
    );
}

#[test]
fn irn_resends_exactly_one_packet_after_one_loss() {
    let r = single_loss(TransportKind::Irn);
    assert_eq!(r.transport_stats.retransmitted_packets, 1);
    assert_eq!(r.transport_stats.timeouts, 0);
    assert_eq!(r.bytes_duplicate, 0);
}

#[test]
fn a_lost_tail_is_recovered_by_the_retransmission_timeout() {
    for transport in [TransportKind::RoceV2Gbn, TransportKind::Irn] {
        // 10 packets; the last one is dropped: no later packet triggers a NAK.
        let cfg = SimConfig {
            pattern: Pattern::Flows(vec![FlowRequest {
                src: 0,
                dst: 4,
                bytes: Some(40_960),
                start_ns: 0,
            }]),
            faults: vec![FaultSpec {
                target: FaultTarget::Link(LinkKind::HostUp { plane: 0, host: 0 }),
                at_ns: 0,
                until_ns: None,
                action: FaultAction::DropNth { ordinal: 9 },
            }],
            duration_ns: 5 * NS_PER_MS,
            ..small(transport)
        };
        let r = run(&cfg);
        assert_eq!(r.flows_completed, 1, "{transport}");
        assert_eq!(r.transport_stats.timeouts, 1, "{transport}");
        assert_eq!(r.transport_stats.retransmitted_packets, 1, "{transport}");
        let fct = r.fct_p50_us.unwrap();
        let rto_us = match transport {
            TransportKind::Irn => 100.0,
            _ => 1000.0,
        };
        assert!(
            fct > rto_us && fct < rto_us + 50.0,
            "{transport}: fct {fct} us"
        );
    }
}

#[test]
fn reliable_baselines_lose_no_bytes_under_random_loss() {
    for transport in [TransportKind::RoceV2Gbn, TransportKind::Irn] {
        let cfg = SimConfig {
            loss: 0.05,
            flow_bytes: Some(200_000),
            ..small(transport)
        };
        let r = run(&cfg);
        assert_eq!(r.bytes_lost, 0, "{transport}");
        assert!(r.flows_completed > 0, "{transport}");
        assert!(r.retransmit_fraction > 0.0);
        assert!(r.fct_p50_us.is_some() && r.fct_p99_us >= r.fct_p50_us);
    }
    // Under the same loss IRN retransmits far less than go-back-N.
    let cfg = SimConfig {
        loss: 0.01,
        ..small(TransportKind::RoceV2Gbn)
    };
    let gbn = run(&cfg);
    let irn = run(&SimConfig {
        transport: TransportKind::Irn,
        ..cfg
    });
    assert!(
        gbn.retransmit_fraction > 5.0 * irn.retransmit_fraction,
        "gbn {} irn {}",
        gbn.retransmit_fraction,
        irn.retransmit_fraction
    );
}

#[test]
fn ring_allreduce_steps_complete() {
    let cfg = SimConfig {
        pattern: Pattern::AllReduce,
        flow_bytes: Some(100_000),
        duration_ns: 500 * NS_PER_US,
        ..small(TransportKind::Irn)
    };
    let r = run(&cfg);
    assert!(r.steps_completed >= 10, "{}", r.steps_completed);
    let p50 = r.step_p50_us.unwrap();
    // 100 KB at 100 Gbit/s is 8 µs plus about an RTT.
    assert!(p50 > 8.0 && p50 < 40.0, "{p50}");
    assert_eq!(r.bytes_lost, 0);
}

#[test]
fn finite_flows_stop_the_run_early() {
    let cfg = SimConfig {
        pattern: Pattern::Flows(vec![
            FlowRequest {
                src: 0,
                dst: 5,
                bytes: Some(100_000),
                start_ns: 0,
            },
            FlowRequest {
                src: 1,
                dst: 5,
                bytes: Some(100_000),
                start_ns: 50 * NS_PER_US,
            },
        ]),
        ..small(TransportKind::RoceV2Gbn)
    };
    let r = run(&cfg);
    assert_eq!(r.flows_completed, 2);
    assert!(r.sim_ms < 0.2, "{}", r.sim_ms);
}
