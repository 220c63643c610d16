//! Fabrics: two-tier leaf-spine, optionally replicated into independent
//! planes (multiplane: each host has one NIC port, and one IP, per plane).
//!
//! All links are unidirectional. Within a plane there are four kinds:
//! host→leaf ([`LinkKind::HostUp`]), leaf→spine, spine→leaf and leaf→host.
//! Link indices are computed arithmetically, so forwarding needs no lookup
//! tables apart from the per-destination-leaf ECMP groups.

use crate::ecmp::{self, FiveTuple};
use crate::packet::HostId;
use crate::queue::PortQueue;
use crate::rng::mix64;
use crate::time::{ps_per_byte, Nanos};

/// Shape and link parameters of a fabric.
#[derive(Debug, Clone, PartialEq)]
pub struct TopologySpec {
    /// Number of hosts.
    pub hosts: u32,
    /// Hosts attached to each leaf switch.
    pub hosts_per_leaf: u32,
    /// Spine switches per plane.
    pub spines: u32,
    /// Independent planes (1 = a plain leaf-spine fabric).
    pub planes: u32,
    /// Host link rate in Gbit/s (per NIC port).
    pub host_gbps: f64,
    /// Leaf–spine link rate in Gbit/s.
    pub spine_gbps: f64,
    /// Propagation delay of every link.
    pub prop_ns: Nanos,
    /// Buffer per switch output port in bytes.
    pub buffer_bytes: u64,
    /// ECN marking threshold K in bytes.
    pub ecn_threshold_bytes: u64,
}

impl TopologySpec {
    /// Number of leaf switches per plane.
    pub fn leaves(&self) -> u32 {
        self.hosts.div_ceil(self.hosts_per_leaf)
    }

    /// The leaf a host hangs off.
    pub fn leaf_of(&self, host: HostId) -> u32 {
        host / self.hosts_per_leaf
    }
}

/// What a unidirectional link connects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum LinkKind {
    /// Host NIC port → its leaf.
    HostUp {
        /// Plane of the link.
        plane: u8,
        /// Sending host.
        host: HostId,
    },
    /// Leaf → spine.
    LeafUp {
        /// Plane of the link.
        plane: u8,
        /// Leaf index within the plane.
        leaf: u32,
        /// Spine index within the plane.
        spine: u32,
    },
    /// Spine → leaf.
    SpineDown {
        /// Plane of the link.
        plane: u8,
        /// Spine index within the plane.
        spine: u32,
        /// Leaf index within the plane.
        leaf: u32,
    },
    /// Leaf → host NIC port.
    LeafDown {
        /// Plane of the link.
        plane: u8,
        /// Receiving host.
        host: HostId,
    },
}

/// Index of a link in [`Fabric::links`].
pub type LinkId = u32;

/// One unidirectional link with the output queue that feeds it.
#[derive(Debug, Clone)]
pub struct Link {
    /// Endpoints.
    pub kind: LinkKind,
    /// Serialisation cost (picoseconds per byte).
    pub ps_per_byte: u64,
    /// Nominal serialisation cost, restored when a degradation ends.
    pub nominal_ps_per_byte: u64,
    /// Propagation delay.
    pub prop_ns: Nanos,
    /// `false` while the link is failed: packets sent onto it are dropped.
    pub up: bool,
    /// `true` while the link is a silent blackhole: up for routing, but
    /// every packet crossing it is dropped.
    pub blackhole: bool,
    /// Probability that a packet is lost on this link.
    pub loss: f64,
    /// Output queue at the sending end (unused for host links, whose NIC
    /// is modelled in `host`).
    pub queue: PortQueue,
    /// Packets offered to this link so far.
    pub offered: u64,
    /// Packets that crossed the link and reached its far end.
    pub carried: u64,
    /// Ordinals (in `offered` order, 0-based) of packets to drop on purpose.
    pub drop_ordinals: Vec<u64>,
}

/// A built fabric: links plus routing state.
#[derive(Debug, Clone)]
pub struct Fabric {
    /// The spec it was built from.
    pub spec: TopologySpec,
    /// All links, indexed by [`LinkId`].
    pub links: Vec<Link>,
    leaves: u32,
    per_plane: u32,
    /// ECMP groups: spines usable from `(plane, src leaf)` to `dst leaf`.
    groups: Vec<Vec<u32>>,
    leaf_seeds: Vec<u64>,
}

impl Fabric {
    /// Build a fabric; `seed` derives each leaf's ECMP hash seed.
    pub fn new(spec: TopologySpec, seed: u64) -> Self {
        let leaves = spec.leaves();
        let (h, s, l) = (spec.hosts, spec.spines, leaves);
        let per_plane = 2 * h + 2 * l * s;
        let mut links = Vec::with_capacity((per_plane * spec.planes) as usize);
        let host_ppb = ps_per_byte(spec.host_gbps);
        let spine_ppb = ps_per_byte(spec.spine_gbps);
        let link = |kind, ppb| Link {
            kind,
            ps_per_byte: ppb,
            nominal_ps_per_byte: ppb,
            prop_ns: spec.prop_ns,
            up: true,
            blackhole: false,
            loss: 0.0,
            queue: PortQueue::new(spec.buffer_bytes, spec.ecn_threshold_bytes),
            offered: 0,
            carried: 0,
            drop_ordinals: Vec::new(),
        };
        for p in 0..spec.planes {
            let plane = p as u8;
            for host in 0..h {
                links.push(link(LinkKind::HostUp { plane, host }, host_ppb));
            }
            for leaf in 0..l {
                for spine in 0..s {
                    links.push(link(LinkKind::LeafUp { plane, leaf, spine }, spine_ppb));
                }
            }
            for spine in 0..s {
                for leaf in 0..l {
                    links.push(link(LinkKind::SpineDown { plane, spine, leaf }, spine_ppb));
                }
            }
            for host in 0..h {
                links.push(link(LinkKind::LeafDown { plane, host }, host_ppb));
            }
        }
        let leaf_seeds = (0..spec.planes * leaves)
            .map(|i| mix64(seed ^ mix64(0xEC3F_0000 + i as u64)))
            .collect();
        let mut fabric = Fabric {
            spec,
            links,
            leaves,
            per_plane,
            groups: Vec::new(),
            leaf_seeds,
        };
        fabric.recompute_routes();
        fabric
    }

    /// Leaves per plane.
    pub fn leaves(&self) -> u32 {
        self.leaves
    }

    /// Host `host`'s uplink on `plane`.
    pub fn host_up(&self, plane: u8, host: HostId) -> LinkId {
        plane as u32 * self.per_plane + host
    }

    /// Leaf `leaf` → spine `spine` on `plane`.
    pub fn leaf_up(&self, plane: u8, leaf: u32, spine: u32) -> LinkId {
        plane as u32 * self.per_plane + self.spec.hosts + leaf * self.spec.spines + spine
    }

    /// Spine `spine` → leaf `leaf` on `plane`.
    pub fn spine_down(&self, plane: u8, spine: u32, leaf: u32) -> LinkId {
        plane as u32 * self.per_plane
            + self.spec.hosts
            + self.leaves * self.spec.spines
            + spine * self.leaves
            + leaf
    }

    /// Leaf → host `host` on `plane`.
    pub fn leaf_down(&self, plane: u8, host: HostId) -> LinkId {
        plane as u32 * self.per_plane + self.spec.hosts + 2 * self.leaves * self.spec.spines + host
    }

    fn group_index(&self, plane: u8, src_leaf: u32, dst_leaf: u32) -> usize {
        ((plane as u32 * self.leaves + src_leaf) * self.leaves + dst_leaf) as usize
    }

    /// Rebuild every ECMP group from the current link states ("routing
    /// converges"): a spine stays in the group from leaf `a` to leaf `b`
    /// only while both `a→spine` and `spine→b` are up.
    pub fn recompute_routes(&mut self) {
        let (planes, l, s) = (self.spec.planes, self.leaves, self.spec.spines);
        let mut groups = Vec::with_capacity((planes * l * l) as usize);
        for p in 0..planes {
            let plane = p as u8;
            for a in 0..l {
                for b in 0..l {
                    let members: Vec<u32> = (0..s)
                        .filter(|&sp| {
                            self.links[self.leaf_up(plane, a, sp) as usize].up
                                && self.links[self.spine_down(plane, sp, b) as usize].up
                        })
                        .collect();
                    groups.push(members);
                }
            }
        }
        self.groups = groups;
    }

    /// The spines currently in the ECMP group from `src_leaf` to `dst_leaf`.
    pub fn group(&self, plane: u8, src_leaf: u32, dst_leaf: u32) -> &[u32] {
        &self.groups[self.group_index(plane, src_leaf, dst_leaf)]
    }

    /// The spine a packet with `tuple` takes from `src_leaf` to `dst_leaf`,
    /// or `None` when no spine is routable.
    pub fn ecmp_spine(
        &self,
        plane: u8,
        src_leaf: u32,
        dst_leaf: u32,
        tuple: &FiveTuple,
    ) -> Option<u32> {
        let group = self.group(plane, src_leaf, dst_leaf);
        if group.is_empty() {
            return None;
        }
        let seed = self.leaf_seeds[(plane as u32 * self.leaves + src_leaf) as usize];
        Some(group[ecmp::select(ecmp::hash(seed, tuple), group.len())])
    }

    /// One-way delay of a `size`-byte packet across an idle fabric between
    /// hosts on different leaves (store and forward at every hop).
    pub fn idle_one_way_ns(&self, size: u32) -> Nanos {
        let host = size as u64 * ps_per_byte(self.spec.host_gbps);
        let spine = size as u64 * ps_per_byte(self.spec.spine_gbps);
        4 * self.spec.prop_ns + (2 * host + 2 * spine).div_ceil(1000)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> TopologySpec {
        TopologySpec {
            hosts: 10,
            hosts_per_leaf: 4,
            spines: 3,
            planes: 2,
            host_gbps: 100.0,
            spine_gbps: 100.0,
            prop_ns: 1000,
            buffer_bytes: 1 << 20,
            ecn_threshold_bytes: 100_000,
        }
    }

    #[test]
    fn link_indices_match_kinds() {
        let f = Fabric::new(spec(), 1);
        assert_eq!(f.leaves(), 3);
        for p in 0..2u8 {
            for h in 0..10 {
                assert_eq!(
                    f.links[f.host_up(p, h) as usize].kind,
                    LinkKind::HostUp { plane: p, host: h }
                );
                assert_eq!(
                    f.links[f.leaf_down(p, h) as usize].kind,
                    LinkKind::LeafDown { plane: p, host: h }
                );
            }
            for l in 0..3 {
                for s in 0..3 {
                    assert_eq!(
                        f.links[f.leaf_up(p, l, s) as usize].kind,
                        LinkKind::LeafUp {
                            plane: p,
                            leaf: l,
                            spine: s
                        }
                    );
                    assert_eq!(
                        f.links[f.spine_down(p, s, l) as usize].kind,
                        LinkKind::SpineDown {
                            plane: p,
                            spine: s,
                            leaf: l
                        }
                    );
                }
            }
        }
        assert_eq!(f.links.len(), 2 * (20 + 18));
    }

    #[test]
    fn routes_exclude_failed_links_after_recompute() {
        let mut f = Fabric::new(spec(), 1);
        assert_eq!(f.group(0, 0, 1), &[0, 1, 2]);
        let down = f.spine_down(0, 1, 2) as usize;
        f.links[down].up = false;
        assert_eq!(f.group(0, 0, 2), &[0, 1, 2], "not converged yet");
        f.recompute_routes();
        assert_eq!(f.group(0, 0, 2), &[0, 2]);
        assert_eq!(f.group(0, 0, 1), &[0, 1, 2]);
        assert_eq!(f.group(1, 0, 2), &[0, 1, 2]);
    }
}
