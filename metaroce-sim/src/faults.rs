//! Faults: random loss on chosen links, link/spine/plane failures and
//! recoveries, degraded (gray) links, silent blackholes, and targeted
//! single-packet drops.
//!
//! A failure spec in the CLI's syntax is
//! `TARGET@START[-END][=GBPS|=blackhole]`, with times in (fractional)
//! milliseconds:
//!
//! | spec | meaning |
//! |---|---|
//! | `spine:3@2` | spine 3 of plane 0 fails at 2 ms |
//! | `spine:1.3@2-5` | spine 3 of plane 1 fails at 2 ms, recovers at 5 ms |
//! | `plane:1@0.5` | every link of plane 1 fails at 0.5 ms |
//! | `link:0-2@1` | leaf 0 ↔ spine 2 (both directions, plane 0) fails at 1 ms |
//! | `link:1.0-2@1` | the same on plane 1 |
//! | `host:5@1` | host 5's links on plane 0 fail (`host:P.H` for plane P) |
//! | `link:0-2@1=25` | leaf 0 ↔ spine 2 runs at 25 Gbit/s from 1 ms |
//! | `spine:3@2=10` | a gray spine: spine 3's links run at 10 Gbit/s from 2 ms, staying up |
//! | `spine:3@2=blackhole` | a silent blackhole: spine 3 drops everything from 2 ms while routing keeps hashing onto it |
//!
//! A failed link (`Fail`) is down: once routing converges
//! ([`crate::SimConfig::routing_convergence_ns`]) ECMP stops choosing it.
//! A degraded link stays up and serialises at the lower rate (on a shaped
//! port the lower of that rate and the shaping rate governs). A blackholed
//! link stays up for routing and drops every packet that crosses it, those
//! on the wire when it starts included (counted as `dropped_blackhole`).

use std::str::FromStr;

use crate::config::ConfigError;
use crate::packet::HostId;
use crate::time::{ms_to_ns, Nanos};
use crate::topology::{Fabric, LinkId, LinkKind};

/// Which links carry the configured random loss probability.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum LossLinks {
    /// Every spine→leaf link, so each inter-leaf packet sees the loss once
    /// (packets between hosts of one leaf see none).
    #[default]
    SpineToLeaf,
    /// Every leaf→host link: every packet, intra-leaf ones included, sees
    /// the loss exactly once.
    LeafToHost,
    /// Every switch output link (leaf→spine, spine→leaf, leaf→host).
    AllSwitchLinks,
}

impl FromStr for LossLinks {
    type Err = ConfigError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "spine-to-leaf" => Ok(LossLinks::SpineToLeaf),
            "leaf-to-host" => Ok(LossLinks::LeafToHost),
            "all" | "all-switch-links" => Ok(LossLinks::AllSwitchLinks),
            _ => Err(ConfigError::BadLossLinks(s.to_owned())),
        }
    }
}

impl LossLinks {
    /// Whether a link of `kind` carries the loss.
    pub fn applies(self, kind: LinkKind) -> bool {
        match self {
            LossLinks::SpineToLeaf => matches!(kind, LinkKind::SpineDown { .. }),
            LossLinks::LeafToHost => matches!(kind, LinkKind::LeafDown { .. }),
            LossLinks::AllSwitchLinks => !matches!(kind, LinkKind::HostUp { .. }),
        }
    }
}

/// A set of links a fault applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum FaultTarget {
    /// All links to and from one spine.
    Spine {
        /// Plane of the spine.
        plane: u8,
        /// Spine index.
        spine: u32,
    },
    /// Every link of a plane (host ports included).
    Plane {
        /// The plane.
        plane: u8,
    },
    /// Both directions between a leaf and a spine.
    LeafSpine {
        /// Plane of the link.
        plane: u8,
        /// Leaf index.
        leaf: u32,
        /// Spine index.
        spine: u32,
    },
    /// Both directions between a host and its leaf.
    Host {
        /// Plane of the NIC port.
        plane: u8,
        /// The host.
        host: HostId,
    },
    /// Exactly one unidirectional link.
    Link(LinkKind),
}

/// What happens to the target.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum FaultAction {
    /// The links go down (and come back at `until_ns`, if set).
    Fail,
    /// The links run at a lower rate (nominal again at `until_ns`).
    Degrade {
        /// New rate in Gbit/s.
        gbps: f64,
    },
    /// The links stay up, and routing keeps choosing them, but every packet
    /// crossing them is dropped (a silent blackhole), until `until_ns`.
    Blackhole,
    /// Drop the packet with this 0-based ordinal among those offered to
    /// each target link (deterministic single-loss experiments).
    DropNth {
        /// Ordinal of the packet to drop.
        ordinal: u64,
    },
}

/// One scheduled fault.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct FaultSpec {
    /// Links affected.
    pub target: FaultTarget,
    /// When it starts.
    pub at_ns: Nanos,
    /// When it ends (`None`: never).
    pub until_ns: Option<Nanos>,
    /// What it does.
    pub action: FaultAction,
}

impl FaultSpec {
    /// The links of `fabric` the target covers.
    pub fn links(&self, fabric: &Fabric) -> Vec<LinkId> {
        let spec = &fabric.spec;
        let l = fabric.leaves();
        let mut out = Vec::new();
        match self.target {
            FaultTarget::Spine { plane, spine } => {
                for leaf in 0..l {
                    out.push(fabric.leaf_up(plane, leaf, spine));
                    out.push(fabric.spine_down(plane, spine, leaf));
                }
            }
            FaultTarget::Plane { plane } => {
                for host in 0..spec.hosts {
                    out.push(fabric.host_up(plane, host));
                    out.push(fabric.leaf_down(plane, host));
                }
                for leaf in 0..l {
                    for spine in 0..spec.spines {
                        out.push(fabric.leaf_up(plane, leaf, spine));
                        out.push(fabric.spine_down(plane, spine, leaf));
                    }
                }
            }
            FaultTarget::LeafSpine { plane, leaf, spine } => {
                out.push(fabric.leaf_up(plane, leaf, spine));
                out.push(fabric.spine_down(plane, spine, leaf));
            }
            FaultTarget::Host { plane, host } => {
                out.push(fabric.host_up(plane, host));
                out.push(fabric.leaf_down(plane, host));
            }
            FaultTarget::Link(kind) => out.push(match kind {
                LinkKind::HostUp { plane, host } => fabric.host_up(plane, host),
                LinkKind::LeafUp { plane, leaf, spine } => fabric.leaf_up(plane, leaf, spine),
                LinkKind::SpineDown { plane, spine, leaf } => fabric.spine_down(plane, spine, leaf),
                LinkKind::LeafDown { plane, host } => fabric.leaf_down(plane, host),
            }),
        }
        out
    }

    /// Check that the target exists in a fabric of this shape.
    pub fn validate(
        &self,
        hosts: u32,
        leaves: u32,
        spines: u32,
        planes: u32,
    ) -> Result<(), ConfigError> {
        let bad = |what: &str| {
            Err(ConfigError::BadFault(format!(
                "{what} out of range in {self:?}"
            )))
        };
        let plane_ok = |p: u8| (p as u32) < planes;
        match self.target {
            FaultTarget::Spine { plane, spine } => {
                if !plane_ok(plane) || spine >= spines {
                    return bad("spine");
                }
            }
            FaultTarget::Plane { plane } => {
                if !plane_ok(plane) {
                    return bad("plane");
                }
            }
            FaultTarget::LeafSpine { plane, leaf, spine }
            | FaultTarget::Link(LinkKind::LeafUp { plane, leaf, spine })
            | FaultTarget::Link(LinkKind::SpineDown { plane, spine, leaf }) => {
                if !plane_ok(plane) || leaf >= leaves || spine >= spines {
                    return bad("link");
                }
            }
            FaultTarget::Host { plane, host }
            | FaultTarget::Link(LinkKind::HostUp { plane, host })
            | FaultTarget::Link(LinkKind::LeafDown { plane, host }) => {
                if !plane_ok(plane) || host >= hosts {
                    return bad("host");
                }
            }
        }
        if let Some(until) = self.until_ns {
            if until < self.at_ns {
                return Err(ConfigError::BadFault(format!(
                    "recovery before failure in {self:?}"
                )));
            }
        }
        if let FaultAction::Degrade { gbps } = self.action {
            if !(gbps > 0.0 && gbps.is_finite()) {
                return Err(ConfigError::BadFault(format!("bad rate in {self:?}")));
            }
        }
        Ok(())
    }
}

fn parse_num<T: FromStr>(s: &str, spec: &str) -> Result<T, ConfigError> {
    s.trim()
        .parse()
        .map_err(|_| ConfigError::BadFault(format!("bad number {s:?} in {spec:?}")))
}

/// Split `"P.X"` into `(P, X)`, or `"X"` into `(0, X)`.
fn plane_prefixed(s: &str, spec: &str) -> Result<(u8, String), ConfigError> {
    match s.split_once('.') {
        Some((p, rest)) => Ok((parse_num(p, spec)?, rest.to_owned())),
        None => Ok((0, s.to_owned())),
    }
}

impl FromStr for FaultSpec {
    type Err = ConfigError;

    fn from_str(spec: &str) -> Result<Self, Self::Err> {
        let bad = |why: &str| ConfigError::BadFault(format!("{why} in {spec:?}"));
        let (target, when) = spec
            .split_once('@')
            .ok_or_else(|| bad("missing '@TIME_MS'"))?;
        let (when, action) = match when.split_once('=') {
            Some((w, "blackhole")) => (w, FaultAction::Blackhole),
            Some((w, rate)) => (
                w,
                FaultAction::Degrade {
                    gbps: parse_num(rate, spec)?,
                },
            ),
            None => (when, FaultAction::Fail),
        };
        let (at, until) = match when.split_once('-') {
            Some((a, u)) => (a, Some(u)),
            None => (when, None),
        };
        let at_ms: f64 = parse_num(at, spec)?;
        let until_ms: Option<f64> = until.map(|u| parse_num(u, spec)).transpose()?;
        if at_ms < 0.0 || until_ms.is_some_and(|u| u < at_ms) {
            return Err(bad("bad times"));
        }
        let (kind, arg) = target
            .split_once(':')
            .ok_or_else(|| bad("missing 'KIND:'"))?;
        let target = match kind {
            "spine" => {
                let (plane, s) = plane_prefixed(arg, spec)?;
                FaultTarget::Spine {
                    plane,
                    spine: parse_num(&s, spec)?,
                }
            }
            "plane" => FaultTarget::Plane {
                plane: parse_num(arg, spec)?,
            },
            "link" => {
                let (plane, ls) = plane_prefixed(arg, spec)?;
                let (l, s) = ls
                    .split_once('-')
                    .ok_or_else(|| bad("link needs LEAF-SPINE"))?;
                FaultTarget::LeafSpine {
                    plane,
                    leaf: parse_num(l, spec)?,
                    spine: parse_num(s, spec)?,
                }
            }
            "host" => {
                let (plane, h) = plane_prefixed(arg, spec)?;
                FaultTarget::Host {
                    plane,
                    host: parse_num(&h, spec)?,
                }
            }
            _ => return Err(bad("unknown fault kind")),
        };
        Ok(FaultSpec {
            target,
            at_ns: ms_to_ns(at_ms),
            until_ns: until_ms.map(ms_to_ns),
            action,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_fault_specs() {
        let f: FaultSpec = "spine:3@2".parse().unwrap();
        assert_eq!(f.target, FaultTarget::Spine { plane: 0, spine: 3 });
        assert_eq!(f.at_ns, 2_000_000);
        assert_eq!(f.until_ns, None);
        assert_eq!(f.action, FaultAction::Fail);

        let f: FaultSpec = "spine:1.3@2-5.5".parse().unwrap();
        assert_eq!(f.target, FaultTarget::Spine { plane: 1, spine: 3 });
        assert_eq!(f.until_ns, Some(5_500_000));

        let f: FaultSpec = "link:1.0-2@0.25=25".parse().unwrap();
        assert_eq!(
            f.target,
            FaultTarget::LeafSpine {
                plane: 1,
                leaf: 0,
                spine: 2
            }
        );
        assert_eq!(f.at_ns, 250_000);
        assert_eq!(f.action, FaultAction::Degrade { gbps: 25.0 });

        let f: FaultSpec = "spine:3@2=10".parse().unwrap();
        assert_eq!(f.target, FaultTarget::Spine { plane: 0, spine: 3 });
        assert_eq!(f.action, FaultAction::Degrade { gbps: 10.0 });
        let f: FaultSpec = "spine:1.3@2-4=blackhole".parse().unwrap();
        assert_eq!(f.target, FaultTarget::Spine { plane: 1, spine: 3 });
        assert_eq!(f.action, FaultAction::Blackhole);
        assert_eq!(f.until_ns, Some(4_000_000));
        assert!("spine:3@2=black".parse::<FaultSpec>().is_err());

        assert_eq!(
            "plane:1@0".parse::<FaultSpec>().unwrap().target,
            FaultTarget::Plane { plane: 1 }
        );
        assert_eq!(
            "host:2.7@1".parse::<FaultSpec>().unwrap().target,
            FaultTarget::Host { plane: 2, host: 7 }
        );
        for bad in [
            "spine:3",
            "spine@3",
            "moon:1@2",
            "spine:x@1",
            "spine:1@5-2",
            "link:3@1",
        ] {
            assert!(bad.parse::<FaultSpec>().is_err(), "{bad}");
        }
    }

    #[test]
    fn validates_ranges() {
        let f: FaultSpec = "spine:8@1".parse().unwrap();
        assert!(f.validate(64, 8, 8, 1).is_err());
        assert!(f.validate(64, 8, 9, 1).is_ok());
    }
}
