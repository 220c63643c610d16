//! Bounded resources (PROTOCOL §18): connections, handshakes in progress,
//! QPs and regions per endpoint. A local call beyond a limit fails with a
//! typed error; a peer's HELLO beyond the connection limit is refused and
//! counted; freeing one makes room again.

mod common;

use common::*;
use metaroce_proto::verbs::*;
use metaroce_proto::{Endpoint, EndpointConfig, Instant};
use std::net::SocketAddr;

fn peer(i: u16) -> SocketAddr {
    SocketAddr::new([10, 0, 1, (i % 250) as u8].into(), 4000 + i)
}

#[test]
fn qps_beyond_the_limit_fail_typed_and_a_destroyed_one_makes_room() {
    let cfg = EndpointConfig {
        max_qps: 3,
        ..EndpointConfig::default()
    };
    let mut ep = Endpoint::new(cfg, 1).unwrap();
    let pd = ep.alloc_pd();
    let cq = ep.create_cq(16);
    let init = QpInit::new(pd, cq, cq);
    let qps: Vec<Qpn> = (0..3).map(|_| ep.create_qp(init).unwrap()).collect();
    assert_eq!(ep.create_qp(init), Err(VerbsError::TooManyQps));
    ep.destroy_qp(qps[1]).unwrap();
    ep.create_qp(init).unwrap();
    assert_eq!(ep.create_qp(init), Err(VerbsError::TooManyQps));
}

/// A destroyed completion queue is gone (its handle refused) and its slot
/// is taken again: creating and destroying queues does not grow the
/// endpoint. One a QP completes to is not destroyed.
#[test]
fn destroyed_completion_queues_free_their_slot() {
    let mut ep = Endpoint::new(EndpointConfig::default(), 1).unwrap();
    let pd = ep.alloc_pd();
    let cq = ep.create_cq(16);
    let other = ep.create_cq(16);
    let qp = ep.create_qp(QpInit::new(pd, cq, other)).unwrap();
    assert_eq!(ep.destroy_cq(cq), Err(VerbsError::CqInUse));
    assert_eq!(ep.destroy_cq(other), Err(VerbsError::CqInUse));
    ep.destroy_qp(qp).unwrap();
    ep.destroy_cq(cq).unwrap();
    assert_eq!(
        ep.poll_cq(cq, 1, &mut Vec::new()),
        Err(VerbsError::InvalidCq)
    );
    assert_eq!(ep.cq_len(cq), Err(VerbsError::InvalidCq));
    assert_eq!(
        ep.create_qp(QpInit::new(pd, cq, cq)),
        Err(VerbsError::InvalidCq)
    );
    // A thousand created and destroyed: the same slot each time.
    for _ in 0..1000 {
        let again = ep.create_cq(16);
        assert_eq!(again, cq, "the destroyed queue's slot");
        assert_eq!(ep.cq_len(again), Ok(0));
        ep.destroy_cq(again).unwrap();
    }
}

#[test]
fn regions_beyond_the_limit_fail_typed_and_a_deregistered_one_makes_room() {
    let cfg = EndpointConfig {
        max_regions: 2,
        ..EndpointConfig::default()
    };
    let mut ep = Endpoint::new(cfg, 1).unwrap();
    let pd = ep.alloc_pd();
    let reg = |ep: &mut Endpoint| {
        ep.reg_mr(
            pd,
            vec![0u8; 64].into_boxed_slice(),
            0,
            AccessFlags::LOCAL_WRITE,
        )
    };
    let a = reg(&mut ep).unwrap();
    reg(&mut ep).unwrap();
    assert_eq!(reg(&mut ep).unwrap_err(), VerbsError::TooManyRegions);
    ep.dereg_mr(a.lkey).unwrap();
    reg(&mut ep).unwrap();
    assert_eq!(reg(&mut ep).unwrap_err(), VerbsError::TooManyRegions);
}

#[test]
fn handshakes_in_progress_are_bounded() {
    let cfg = EndpointConfig {
        max_handshakes: 4,
        ..EndpointConfig::default()
    };
    let mut ep = Endpoint::new(cfg, 1).unwrap();
    let now = Instant::from_nanos(1_000_000);
    let conns: Vec<_> = (0..4).map(|i| ep.connect(now, peer(i)).unwrap()).collect();
    assert_eq!(
        ep.connect(now, peer(9)).unwrap_err(),
        VerbsError::TooManyHandshakes
    );
    // One given up: room for another.
    ep.close(now, conns[0]).unwrap();
    ep.connect(now, peer(10)).unwrap();
}

#[test]
fn connections_beyond_the_limit_fail_typed_locally_and_are_refused_remotely() {
    let server_cfg = EndpointConfig {
        max_connections: 1,
        ..EndpointConfig::default()
    };
    // A client whose own limit is 1 too.
    let mut p = Pair::new(
        server_cfg.clone(),
        server_cfg.clone(),
        7,
        LinkConfig::perfect(),
    );
    p.connect();
    let now = p.now;
    assert_eq!(
        p.a.connect(now, peer(1)).unwrap_err(),
        VerbsError::TooManyConnections
    );
    // A second client's HELLO (with a valid cookie) is refused by B, which
    // is full, and counted.
    let mut other = Endpoint::new(EndpointConfig::default(), 99).unwrap();
    let other_addr: SocketAddr = "10.0.0.9:4792".parse().unwrap();
    other.set_local_ip(Some(other_addr.ip()));
    let b_addr = p.b_addr;
    other.connect(now, b_addr).unwrap();
    let mut buf = vec![0u8; 9000];
    let refused = p.b.stats().rejects.refused;
    for _ in 0..4 {
        while let Some(t) = other.poll_transmit(now, &mut buf) {
            p.b.handle_datagram(now, other_addr, metaroce_proto::Ecn::NotEct, &buf[..t.size]);
        }
        while let Some(t) = p.b.poll_transmit(now, &mut buf) {
            if t.dst.ip() == other_addr.ip() {
                other.handle_datagram(now, b_addr, metaroce_proto::Ecn::NotEct, &buf[..t.size]);
            }
        }
    }
    // Refused at the round of three HELLOs with the cookie (PROTOCOL §8.2).
    assert_eq!(p.b.stats().rejects.refused, refused + 3);
    assert_eq!(p.b.connections().count(), 1);
}

#[test]
fn limits_out_of_range_are_refused_by_validate() {
    let d = EndpointConfig::default();
    for bad in [
        EndpointConfig {
            max_regions: (1 << 24) + 1,
            ..d.clone()
        },
        EndpointConfig {
            max_qps: 1 << 20,
            ..d.clone()
        },
        EndpointConfig {
            stateless_burst: 0,
            ..d.clone()
        },
        EndpointConfig {
            stateless_rate: 0,
            ..d.clone()
        },
    ] {
        assert!(bad.validate().is_err(), "{bad:?}");
    }
    assert!(d.validate().is_ok());
}
