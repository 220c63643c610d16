//! Multiplane: a connection spans one address pair per plane. Two endpoints
//! with two planes each, joined by a zero-latency in-memory network that
//! can fail a plane.

use metaroce_proto::verbs::*;
use metaroce_proto::{Ecn, Endpoint, EndpointConfig, Event, Instant};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};

fn ip(plane: u8, host: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(10, plane, 0, host))
}

fn plane_of(a: IpAddr) -> u8 {
    match a {
        IpAddr::V4(v) => v.octets()[1],
        IpAddr::V6(_) => 255,
    }
}

fn config(host: u8, planes: u8) -> EndpointConfig {
    EndpointConfig {
        paths: 4,
        plane_ips: if planes > 1 {
            (0..planes).map(|p| ip(p, host)).collect()
        } else {
            Vec::new()
        },
        ..EndpointConfig::default()
    }
}

/// A DATA datagram seen on the network: plane of source and destination, size.
#[derive(Debug, Clone, Copy)]
struct Seen {
    src_plane: u8,
    dst_plane: u8,
    size: usize,
    data: bool,
}

struct Net {
    ep: [Endpoint; 2],
    addr: [SocketAddr; 2],
    now: Instant,
    dead_plane: Option<u8>,
    seen: Vec<Seen>,
    last_data: Option<(SocketAddr, Vec<u8>)>,
}

impl Net {
    fn new(planes_a: u8, planes_b: u8) -> Net {
        let mut a = Endpoint::new(config(1, planes_a), 1).unwrap();
        let mut b = Endpoint::new(config(2, planes_b), 2).unwrap();
        a.set_local_ip(Some(ip(0, 1)));
        b.set_local_ip(Some(ip(0, 2)));
        Net {
            ep: [a, b],
            addr: [
                SocketAddr::new(ip(0, 1), 4792),
                SocketAddr::new(ip(0, 2), 4792),
            ],
            now: Instant::ZERO,
            dead_plane: None,
            seen: Vec::new(),
            last_data: None,
        }
    }

    /// Moves datagrams until none is left, then advances time to the next timer.
    fn step(&mut self) {
        let mut buf = vec![0u8; 9000];
        loop {
            let mut moved = false;
            for side in 0..2 {
                while let Some(t) = self.ep[side].poll_transmit(self.now, &mut buf) {
                    moved = true;
                    let src = t.src_ip.expect("multiplane endpoints name the source");
                    let data = buf[1] == 0x01;
                    self.seen.push(Seen {
                        src_plane: plane_of(src),
                        dst_plane: plane_of(t.dst.ip()),
                        size: t.size,
                        data,
                    });
                    if Some(plane_of(t.dst.ip())) == self.dead_plane {
                        continue;
                    }
                    let from = SocketAddr::new(src, t.src_port);
                    if data && side == 0 {
                        self.last_data = Some((from, buf[..t.size].to_vec()));
                    }
                    self.ep[1 - side].handle_datagram(self.now, from, t.ecn, &buf[..t.size]);
                }
            }
            if !moved {
                break;
            }
        }
        let next = [0, 1]
            .iter()
            .filter_map(|&s| self.ep[s].poll_timeout())
            .min()
            .unwrap_or(self.now + std::time::Duration::from_micros(10));
        self.now = next.max(self.now + std::time::Duration::from_nanos(100));
        for s in 0..2 {
            self.ep[s].handle_timeout(self.now);
        }
    }
}

/// Connects A to B, sets up one QP pair and a 1 MiB region at B; returns
/// (A's QP, A's CQ, A's source lkey, B's region).
fn setup(n: &mut Net) -> (Qpn, CqHandle, u32, MrInfo, ConnectionHandle) {
    let conn_a = n.ep[0].connect(n.now, n.addr[1]).unwrap();
    let mut conn_b = None;
    for _ in 0..20 {
        n.step();
        while let Some(e) = n.ep[1].poll_event() {
            if let Event::Incoming { conn, .. } = e {
                conn_b = Some(conn);
            }
        }
    }
    let conn_b = conn_b.expect("connected");
    let (pa, pb) = (n.ep[0].alloc_pd(), n.ep[1].alloc_pd());
    let (ca, cb) = (n.ep[0].create_cq(1024), n.ep[1].create_cq(1024));
    let len = 1 << 20;
    let src: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
    let src = n.ep[0]
        .reg_mr(pa, src.into_boxed_slice(), 0, AccessFlags::NONE)
        .unwrap();
    let dst = n.ep[1]
        .reg_mr(
            pb,
            vec![0u8; len].into_boxed_slice(),
            0x10_0000,
            AccessFlags::REMOTE_WRITE,
        )
        .unwrap();
    let qa = n.ep[0].create_qp(QpInit::new(pa, ca, ca)).unwrap();
    let qb = n.ep[1].create_qp(QpInit::new(pb, cb, cb)).unwrap();
    n.ep[0].connect_qp(qa, conn_a, qb).unwrap();
    n.ep[1].connect_qp(qb, conn_b, qa).unwrap();
    (qa, ca, src.lkey, dst, conn_a)
}

/// WRITEs the whole source region and waits for the completion.
fn write_all(n: &mut Net, qa: Qpn, ca: CqHandle, lkey: u32, dst: MrInfo, wr_id: u64) {
    let len = dst.len as u32;
    let wr = SendWr::new(
        wr_id,
        SendOp::Write(RemoteAddr {
            rkey: dst.rkey,
            addr: dst.addr,
        }),
        Sge { lkey, addr: 0, len },
    );
    n.ep[0].post_send(n.now, qa, wr).unwrap();
    let mut wcs = Vec::new();
    for _ in 0..200_000 {
        n.step();
        n.ep[0].poll_cq(ca, 16, &mut wcs).unwrap();
        if !wcs.is_empty() {
            break;
        }
    }
    assert_eq!(wcs.len(), 1, "the WRITE completed");
    assert_eq!(wcs[0].status, WcStatus::Success);
    let placed = n.ep[1].mr(dst.lkey).unwrap();
    let source = n.ep[0].mr(lkey).unwrap();
    assert!(placed == source, "every byte placed");
}

#[test]
fn paths_spread_over_planes_and_pair_addresses_by_plane() {
    let mut n = Net::new(2, 2);
    let (qa, ca, lkey, dst, conn) = setup(&mut n);
    write_all(&mut n, qa, ca, lkey, dst, 1);
    let data: Vec<&Seen> = n.seen.iter().filter(|s| s.data).collect();
    assert!(data.iter().all(|s| s.src_plane == s.dst_plane));
    let on1 = data.iter().filter(|s| s.src_plane == 1).count();
    assert!(
        on1 * 4 > data.len() && on1 * 4 < 3 * data.len(),
        "{on1} of {} DATA packets on plane 1",
        data.len()
    );
    // Every packet, ACKs included, pairs plane k with plane k.
    assert!(n.seen.iter().all(|s| s.src_plane == s.dst_plane));
    let stats = n.ep[0].connection_stats(conn).unwrap();
    let planes: Vec<u8> = stats.paths.iter().map(|p| p.plane).collect();
    assert_eq!(planes, vec![0, 1, 0, 1], "round robin over the planes");
}

#[test]
fn a_peer_without_planes_keeps_everything_on_plane_zero() {
    let mut n = Net::new(2, 1);
    let (qa, ca, lkey, dst, conn) = setup(&mut n);
    write_all(&mut n, qa, ca, lkey, dst, 1);
    assert!(n.seen.iter().all(|s| s.src_plane == 0 && s.dst_plane == 0));
    let stats = n.ep[0].connection_stats(conn).unwrap();
    assert!(stats.paths.iter().all(|p| p.plane == 0));
}

#[test]
fn a_failed_plane_loses_nothing_and_carries_only_probes() {
    let mut n = Net::new(2, 2);
    let (qa, ca, lkey, dst, _) = setup(&mut n);
    write_all(&mut n, qa, ca, lkey, dst, 1);
    n.dead_plane = Some(1);
    // The first WRITE after the failure loses what went into plane 1
    // before its paths were declared failed; it still completes intact.
    write_all(&mut n, qa, ca, lkey, dst, 2);
    let mark = n.seen.len();
    write_all(&mut n, qa, ca, lkey, dst, 3);
    assert_eq!(n.ep[0].qp_state(qa), Some(QpState::Rts));
    // Then 20 ms more (ten probe timeouts or so) for the probes to show.
    let until = n.now + std::time::Duration::from_millis(20);
    while n.now < until {
        n.step();
    }
    let after = &n.seen[mark..];
    let bytes = |plane: u8| -> usize {
        after
            .iter()
            .filter(|s| s.data && s.src_plane == plane)
            .map(|s| s.size)
            .sum()
    };
    // From then on plane 1 carries NOP probes only.
    assert!(bytes(0) >= 1 << 20);
    let probes = after.iter().filter(|s| s.data && s.src_plane == 1).count();
    assert!(probes > 0, "the failed paths keep probing");
    assert!(
        bytes(1) <= probes * 64,
        "plane 1: {} bytes, plane 0: {}",
        bytes(1),
        bytes(0)
    );
}

#[test]
fn packets_from_a_plane_address_are_matched_and_others_rejected() {
    let mut n = Net::new(2, 2);
    let (qa, ca, lkey, dst, _) = setup(&mut n);
    write_all(&mut n, qa, ca, lkey, dst, 1);
    let (from, pkt) = n.last_data.clone().expect("a DATA packet");
    let before = n.ep[1].stats().rejects;
    // The same packet again from its plane address: a duplicate, matched.
    n.ep[1].handle_datagram(n.now, from, Ecn::Ect0, &pkt);
    let mid = n.ep[1].stats().rejects;
    assert_eq!(mid.duplicate, before.duplicate + 1);
    // From an address that is none of the peer's: refused.
    let stranger = SocketAddr::new(ip(5, 1), from.port());
    n.ep[1].handle_datagram(n.now, stranger, Ecn::Ect0, &pkt);
    assert_eq!(n.ep[1].stats().rejects.wrong_source, mid.wrong_source + 1);
}

#[test]
fn poll_transmit_planes_only_gives_open_planes() {
    let mut n = Net::new(2, 2);
    let (qa, _ca, lkey, dst, _) = setup(&mut n);
    let wr = SendWr::new(
        9,
        SendOp::Write(RemoteAddr {
            rkey: dst.rkey,
            addr: dst.addr,
        }),
        Sge {
            lkey,
            addr: 0,
            len: 256 * 1024,
        },
    );
    n.ep[0].post_send(n.now, qa, wr).unwrap();
    let mut buf = vec![0u8; 9000];
    let mut got = 0;
    while let Some(t) = n.ep[0].poll_transmit_planes(n.now, &mut buf, 0b10) {
        assert_eq!(plane_of(t.src_ip.unwrap()), 1);
        got += 1;
    }
    assert!(got > 0, "plane 1 had packets");
    // The connection stayed ready: plane 0's packets come when it opens.
    let t = n.ep[0].poll_transmit_planes(n.now, &mut buf, 0b01).unwrap();
    assert_eq!(plane_of(t.src_ip.unwrap()), 0);
}
