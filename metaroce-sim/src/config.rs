//! Run configuration, mirroring the future `metaroce sim` command line.

use std::str::FromStr;

use crate::baselines::BaselineParams;
use crate::faults::{FaultSpec, LossLinks};
use crate::metaroce::MetaroceParams;
use crate::queue::ShaperSpec;
use crate::stalls::HostStalls;
use crate::time::{Nanos, NS_PER_MS};
use crate::traffic::Pattern;

/// Errors in a run configuration or in one of its textual specs.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    /// The transport name is unknown.
    #[error("unknown transport {0:?} (expected metaroce, rocev2-gbn, irn or blast)")]
    BadTransport(String),
    /// The transport is known but not built into this simulator yet.
    #[error("transport {0:?} is not available in this build of the simulator")]
    TransportUnavailable(String),
    /// The pattern spec does not parse.
    #[error("bad traffic pattern {0:?} (expected permutation, all-to-all, incast:K or allreduce)")]
    BadPattern(String),
    /// The fault spec does not parse or does not fit the fabric.
    #[error("bad fault spec: {0}")]
    BadFault(String),
    /// The loss-link selector is unknown.
    #[error("bad loss links {0:?} (expected spine-to-leaf, leaf-to-host or all)")]
    BadLossLinks(String),
    /// The shaper spec does not parse or is out of range.
    #[error("bad shaper {0} (expected RATE_GBPS:BURST_BYTES[:QUEUE_BYTES|LATENCYms|LATENCYus])")]
    BadShaper(String),
    /// The host-stall spec does not parse or is out of range.
    #[error("bad host stalls {0} (expected RATE_PER_MS:MEAN_US[:exp|fixed])")]
    BadStall(String),
    /// A parameter is out of range.
    #[error("invalid configuration: {0}")]
    Invalid(String),
}

/// The host transport to simulate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum TransportKind {
    /// RoCEv2 RC as commodity NICs run it without PFC: go-back-N + DCQCN.
    #[default]
    #[serde(rename = "rocev2-gbn")]
    RoceV2Gbn,
    /// IRN: selective repeat, BDP-capped window, DCQCN.
    Irn,
    /// A dumb unreliable sender at line rate (fabric diagnostics).
    Blast,
    /// metaroce: the real protocol core (`metaroce-proto`), one endpoint per host.
    Metaroce,
}

impl TransportKind {
    /// The CLI name.
    pub fn name(self) -> &'static str {
        match self {
            TransportKind::RoceV2Gbn => "rocev2-gbn",
            TransportKind::Irn => "irn",
            TransportKind::Blast => "blast",
            TransportKind::Metaroce => "metaroce",
        }
    }
}

impl std::fmt::Display for TransportKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for TransportKind {
    type Err = ConfigError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "rocev2-gbn" | "rocev2" | "gbn" => Ok(TransportKind::RoceV2Gbn),
            "irn" => Ok(TransportKind::Irn),
            "blast" => Ok(TransportKind::Blast),
            "metaroce" => Ok(TransportKind::Metaroce),
            _ => Err(ConfigError::BadTransport(s.to_owned())),
        }
    }
}

/// Everything that defines one simulation run.
///
/// Same configuration and seed give bit-identical reports (apart from the
/// wall-clock fields).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct SimConfig {
    /// Host transport (`--transport`).
    pub transport: TransportKind,
    /// Number of hosts (`--hosts`).
    pub hosts: u32,
    /// Spines per plane (`--spines`).
    pub spines: u32,
    /// Independent planes (`--planes`); each host has one NIC port per plane.
    pub planes: u32,
    /// Hosts per leaf; `None` = as many as spines (1:1 at equal rates).
    pub hosts_per_leaf: Option<u32>,
    /// Leaf oversubscription: host capacity / uplink capacity per leaf.
    pub oversubscription: f64,
    /// Host link (NIC port) rate in Gbit/s (`--link-gbps`).
    pub link_gbps: f64,
    /// Propagation delay per link.
    pub prop_delay_ns: Nanos,
    /// Buffer per switch output port.
    pub buffer_bytes: u64,
    /// ECN marking threshold K per switch port.
    pub ecn_threshold_bytes: u64,
    /// Switches mark CE above the threshold (`--ecn on|off`); off, no
    /// packet is ever marked.
    pub ecn_marking: bool,
    /// Maximum transport payload per packet (metaroce's full segments carry
    /// it rounded down to a multiple of 64 bytes).
    pub mtu: u32,
    /// Token-bucket shaping of every leaf→spine and spine→leaf port
    /// (`--spine-shaper`); `None`: ports serve at line rate. A stream that
    /// left one shaper conforms to the next, identical one, so a packet
    /// crossing a spine is held back once per direction in effect.
    pub spine_shaper: Option<ShaperSpec>,
    /// Stalls of the hosts' processing (`--host-stall`).
    pub host_stalls: Option<HostStalls>,
    /// Random loss probability (`--loss`) on `loss_links`.
    pub loss: f64,
    /// Which links carry `loss`.
    pub loss_links: LossLinks,
    /// Traffic pattern (`--pattern`).
    pub pattern: Pattern,
    /// Flow size (`--flow-bytes`); `None` = long-running flows.
    pub flow_bytes: Option<u64>,
    /// Simulated duration (`--duration-ms`).
    pub duration_ns: Nanos,
    /// Scheduled faults (`--fail`).
    pub faults: Vec<FaultSpec>,
    /// Delay between a link state change and ECMP excluding/including it;
    /// 0 = immediately.
    pub routing_convergence_ns: Nanos,
    /// Seed of every random choice (`--seed`).
    pub seed: u64,
    /// Width of a time-series bin (`--bin-us`), see [`crate::series`].
    pub bin_ns: Nanos,
    /// Tuning of the baseline transports.
    pub baseline: BaselineParams,
    /// Tuning of the metaroce transport.
    pub metaroce: MetaroceParams,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            transport: TransportKind::default(),
            hosts: 64,
            spines: 8,
            planes: 1,
            hosts_per_leaf: None,
            oversubscription: 1.0,
            link_gbps: 100.0,
            prop_delay_ns: 1_000,
            buffer_bytes: 1_000_000,
            ecn_threshold_bytes: 100_000,
            ecn_marking: true,
            spine_shaper: None,
            host_stalls: None,
            mtu: 4096,
            loss: 0.0,
            loss_links: LossLinks::default(),
            pattern: Pattern::default(),
            flow_bytes: None,
            duration_ns: 10 * NS_PER_MS,
            faults: Vec::new(),
            routing_convergence_ns: 0,
            seed: 1,
            bin_ns: 10_000,
            baseline: BaselineParams::default(),
            metaroce: MetaroceParams::default(),
        }
    }
}

impl SimConfig {
    /// Hosts per leaf after applying the default.
    pub fn effective_hosts_per_leaf(&self) -> u32 {
        self.hosts_per_leaf
            .unwrap_or(self.spines)
            .clamp(1, self.hosts.max(1))
    }

    /// Leaf switches per plane.
    pub fn leaves(&self) -> u32 {
        self.hosts.div_ceil(self.effective_hosts_per_leaf())
    }

    /// Rate of each leaf–spine link so that a leaf's uplink capacity is its
    /// host capacity divided by the oversubscription.
    pub fn spine_link_gbps(&self) -> f64 {
        self.link_gbps * self.effective_hosts_per_leaf() as f64
            / (self.spines as f64 * self.oversubscription)
    }

    /// Check every parameter; [`crate::run`] panics on an invalid config.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        if self.hosts < 2 {
            return bad(format!("need at least 2 hosts, got {}", self.hosts));
        }
        if self.spines == 0 || self.planes == 0 || self.planes > 64 {
            return bad("need at least one spine and 1..=64 planes".into());
        }
        let hpl = self.effective_hosts_per_leaf();
        if hpl > 254 || self.leaves() > 256 || self.planes > 256 {
            return bad(
                "fabric does not fit 10.P.L.H addressing (<=254 hosts/leaf, <=256 leaves)".into(),
            );
        }
        if !(self.link_gbps > 0.0 && self.link_gbps.is_finite()) {
            return bad(format!("link rate {} Gbit/s", self.link_gbps));
        }
        if !(self.oversubscription > 0.0 && self.oversubscription.is_finite()) {
            return bad(format!("oversubscription {}", self.oversubscription));
        }
        if !(0.0..1.0).contains(&self.loss) {
            return bad(format!("loss probability {} not in [0, 1)", self.loss));
        }
        if self.mtu == 0 || self.mtu > 65_000 {
            return bad(format!("mtu {}", self.mtu));
        }
        if self.flow_bytes == Some(0) {
            return bad("flow size must be positive".into());
        }
        if self.duration_ns == 0 {
            return bad("duration must be positive".into());
        }
        if self.bin_ns == 0 {
            return bad("time-series bin must be positive".into());
        }
        if self.buffer_bytes < self.mtu as u64 + 128 {
            return bad("switch buffer smaller than one packet".into());
        }
        if let Some(s) = &self.spine_shaper {
            let max_packet = self.mtu as u64 + 128;
            s.validate(self.buffer_bytes, max_packet)?;
        }
        if let Some(s) = &self.host_stalls {
            s.validate()?;
        }
        match &self.pattern {
            Pattern::Incast { senders } if *senders >= self.hosts => {
                return bad(format!("incast:{senders} needs more than {senders} hosts"));
            }
            Pattern::Flows(flows) => {
                for f in flows {
                    if f.src >= self.hosts
                        || f.dst >= self.hosts
                        || f.src == f.dst
                        || f.bytes == Some(0)
                    {
                        return bad(format!("bad flow {f:?}"));
                    }
                }
            }
            _ => {}
        }
        for f in &self.faults {
            f.validate(self.hosts, self.leaves(), self.spines, self.planes)?;
        }
        if self.transport == TransportKind::Metaroce {
            let m = &self.metaroce;
            if m.paths == 0 || usize::from(m.paths) > metaroce_proto::consts::MAX_PATHS {
                return bad(format!(
                    "metaroce paths {} not in 1..={}",
                    m.paths,
                    metaroce_proto::consts::MAX_PATHS
                ));
            }
            if m.source_ports < 64 || m.source_ports > 16_384 {
                return bad(format!(
                    "metaroce source ports {} not in 64..=16384",
                    m.source_ports
                ));
            }
            if m.chunk_bytes == 0 || m.outstanding == 0 {
                return bad("metaroce chunk size and outstanding WRITEs must be positive".into());
            }
            let mtu = self.mtu as usize
                + metaroce_proto::consts::DATA_HEADER_LEN
                + metaroce_proto::wire::Opcode::Write.ext_len();
            if mtu > usize::from(metaroce_proto::consts::MAX_MTU) {
                return bad(format!("mtu {} too large for metaroce", self.mtu));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transport_names() {
        for k in [
            TransportKind::RoceV2Gbn,
            TransportKind::Irn,
            TransportKind::Blast,
            TransportKind::Metaroce,
        ] {
            assert_eq!(k.name().parse::<TransportKind>().unwrap(), k);
        }
        assert!(matches!(
            "tcp".parse::<TransportKind>(),
            Err(ConfigError::BadTransport(_))
        ));
    }

    #[test]
    fn defaults_are_valid_and_one_to_one() {
        let c = SimConfig::default();
        c.validate().unwrap();
        assert_eq!(c.leaves(), 8);
        assert_eq!(c.spine_link_gbps(), 100.0);
        let bad = SimConfig {
            loss: 1.0,
            ..SimConfig::default()
        };
        assert!(bad.validate().is_err());
        let bad = SimConfig {
            pattern: Pattern::Incast { senders: 64 },
            ..SimConfig::default()
        };
        assert!(bad.validate().is_err());
    }
}
