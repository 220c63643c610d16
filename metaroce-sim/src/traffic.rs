//! Traffic patterns: who sends how much to whom, and when.
//!
//! With no flow size, permutation, all-to-all and incast start long-running
//! ("infinite") flows for goodput measurements. With a flow size they run
//! closed-loop: permutation and all-to-all restart a pair's flow as soon as
//! it completes; incast runs synchronised rounds (the next round starts when
//! every sender's flow of the current one has completed); ring all-reduce
//! runs steps in which every host sends one chunk to its ring neighbour and
//! a step waits for the slowest transfer.

use std::str::FromStr;

use crate::config::ConfigError;
use crate::packet::HostId;
use crate::rng::SimRng;
use crate::time::Nanos;

/// Default chunk size of a ring all-reduce step when no flow size is given.
pub const DEFAULT_ALLREDUCE_CHUNK: u64 = 1 << 20;

/// One explicitly requested flow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct FlowRequest {
    /// Sender.
    pub src: HostId,
    /// Receiver.
    pub dst: HostId,
    /// Bytes to transfer (`None`: never ends).
    pub bytes: Option<u64>,
    /// Start time.
    pub start_ns: Nanos,
}

/// A traffic pattern.
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Pattern {
    /// Every host sends to a distinct host (a seeded derangement).
    #[default]
    Permutation,
    /// Every host sends to every other host.
    AllToAll,
    /// `senders` hosts (seeded choice) send to host 0.
    Incast {
        /// Number of senders.
        senders: u32,
    },
    /// Ring all-reduce steps.
    AllReduce,
    /// An explicit list of flows (no repetition).
    Flows(Vec<FlowRequest>),
}

impl FromStr for Pattern {
    type Err = ConfigError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "permutation" => Ok(Pattern::Permutation),
            "all-to-all" | "alltoall" => Ok(Pattern::AllToAll),
            "allreduce" | "all-reduce" | "ring-allreduce" => Ok(Pattern::AllReduce),
            _ => {
                if let Some(k) = s.strip_prefix("incast:") {
                    let senders = k
                        .parse()
                        .map_err(|_| ConfigError::BadPattern(s.to_owned()))?;
                    if senders == 0 {
                        return Err(ConfigError::BadPattern(s.to_owned()));
                    }
                    Ok(Pattern::Incast { senders })
                } else {
                    Err(ConfigError::BadPattern(s.to_owned()))
                }
            }
        }
    }
}

impl std::fmt::Display for Pattern {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Pattern::Permutation => write!(f, "permutation"),
            Pattern::AllToAll => write!(f, "all-to-all"),
            Pattern::Incast { senders } => write!(f, "incast:{senders}"),
            Pattern::AllReduce => write!(f, "allreduce"),
            Pattern::Flows(v) => write!(f, "flows:{}", v.len()),
        }
    }
}

/// A flow the generator wants started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct NewFlow {
    pub src: HostId,
    pub dst: HostId,
    pub bytes: Option<u64>,
    pub start_ns: Nanos,
    /// Generator bookkeeping (round or step number).
    pub tag: u32,
}

/// A seeded derangement of `0..n` (`n >= 2`): no host sends to itself.
pub fn derangement(n: u32, rng: &mut SimRng) -> Vec<HostId> {
    assert!(n >= 2);
    let mut perm: Vec<HostId> = (0..n).collect();
    loop {
        rng.shuffle(&mut perm);
        if perm.iter().enumerate().all(|(i, &d)| i as u32 != d) {
            return perm;
        }
    }
}

/// The generator's state during a run.
#[derive(Debug)]
pub(crate) struct Traffic {
    pattern: Pattern,
    hosts: u32,
    flow_bytes: Option<u64>,
    incast_senders: Vec<HostId>,
    outstanding: u32,
    round: u32,
    round_started: Nanos,
    /// Duration of each completed incast round or all-reduce step.
    pub step_times: Vec<Nanos>,
}

impl Traffic {
    pub(crate) fn new(pattern: Pattern, hosts: u32, flow_bytes: Option<u64>) -> Self {
        Traffic {
            pattern,
            hosts,
            flow_bytes,
            incast_senders: Vec::new(),
            outstanding: 0,
            round: 0,
            round_started: 0,
            step_times: Vec::new(),
        }
    }

    fn chunk(&self) -> u64 {
        self.flow_bytes.unwrap_or(DEFAULT_ALLREDUCE_CHUNK)
    }

    /// Number of distinct hosts that receive traffic (goodput is per host
    /// of this set).
    pub(crate) fn receivers(&self) -> u32 {
        match &self.pattern {
            Pattern::Incast { .. } => 1,
            Pattern::Flows(v) => {
                let mut d: Vec<HostId> = v.iter().map(|f| f.dst).collect();
                d.sort_unstable();
                d.dedup();
                d.len() as u32
            }
            _ => self.hosts,
        }
    }

    /// The incast senders (after [`Traffic::initial`]); empty otherwise.
    pub(crate) fn incast_senders(&self) -> &[HostId] {
        &self.incast_senders
    }

    pub(crate) fn initial(&mut self, rng: &mut SimRng) -> Vec<NewFlow> {
        let n = self.hosts;
        let bytes = self.flow_bytes;
        let flow = |src, dst, bytes, tag| NewFlow {
            src,
            dst,
            bytes,
            start_ns: 0,
            tag,
        };
        match self.pattern.clone() {
            Pattern::Permutation => derangement(n, rng)
                .into_iter()
                .enumerate()
                .map(|(s, d)| flow(s as HostId, d, bytes, 0))
                .collect(),
            Pattern::AllToAll => (0..n)
                .flat_map(|s| {
                    (0..n)
                        .filter(move |&d| d != s)
                        .map(move |d| flow(s, d, bytes, 0))
                })
                .collect(),
            Pattern::Incast { senders } => {
                let mut others: Vec<HostId> = (1..n).collect();
                rng.shuffle(&mut others);
                others.truncate(senders as usize);
                others.sort_unstable();
                self.incast_senders = others;
                self.outstanding = senders;
                self.incast_senders
                    .iter()
                    .map(|&s| flow(s, 0, bytes, 0))
                    .collect()
            }
            Pattern::AllReduce => self.allreduce_step(0),
            Pattern::Flows(v) => v
                .iter()
                .map(|f| NewFlow {
                    src: f.src,
                    dst: f.dst,
                    bytes: f.bytes,
                    start_ns: f.start_ns,
                    tag: 0,
                })
                .collect(),
        }
    }

    fn allreduce_step(&mut self, now: Nanos) -> Vec<NewFlow> {
        let n = self.hosts;
        self.outstanding = n;
        self.round_started = now;
        let chunk = self.chunk();
        let tag = self.round;
        (0..n)
            .map(|s| NewFlow {
                src: s,
                dst: (s + 1) % n,
                bytes: Some(chunk),
                start_ns: now,
                tag,
            })
            .collect()
    }

    /// A finite flow completed at `now`: which flows start next.
    pub(crate) fn on_complete(&mut self, src: HostId, dst: HostId, now: Nanos) -> Vec<NewFlow> {
        let bytes = self.flow_bytes;
        match &self.pattern {
            Pattern::Permutation | Pattern::AllToAll => {
                vec![NewFlow {
                    src,
                    dst,
                    bytes,
                    start_ns: now,
                    tag: 0,
                }]
            }
            Pattern::Incast { .. } => {
                self.outstanding -= 1;
                if self.outstanding > 0 {
                    return Vec::new();
                }
                self.step_times.push(now - self.round_started);
                self.round += 1;
                self.round_started = now;
                self.outstanding = self.incast_senders.len() as u32;
                self.incast_senders
                    .iter()
                    .map(|&s| NewFlow {
                        src: s,
                        dst: 0,
                        bytes,
                        start_ns: now,
                        tag: self.round,
                    })
                    .collect()
            }
            Pattern::AllReduce => {
                self.outstanding -= 1;
                if self.outstanding > 0 {
                    return Vec::new();
                }
                self.step_times.push(now - self.round_started);
                self.round += 1;
                self.allreduce_step(now)
            }
            Pattern::Flows(_) => Vec::new(),
        }
    }

    /// `true` if the pattern can never produce more flows once the current
    /// ones are done.
    pub(crate) fn is_open_ended(&self) -> bool {
        !matches!(self.pattern, Pattern::Flows(_))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_patterns() {
        assert_eq!(
            "permutation".parse::<Pattern>().unwrap(),
            Pattern::Permutation
        );
        assert_eq!("all-to-all".parse::<Pattern>().unwrap(), Pattern::AllToAll);
        assert_eq!(
            "incast:7".parse::<Pattern>().unwrap(),
            Pattern::Incast { senders: 7 }
        );
        assert_eq!("allreduce".parse::<Pattern>().unwrap(), Pattern::AllReduce);
        for bad in ["incast:", "incast:0", "incast:x", "ring", ""] {
            assert!(bad.parse::<Pattern>().is_err(), "{bad}");
        }
        assert_eq!(Pattern::Incast { senders: 3 }.to_string(), "incast:3");
    }

    #[test]
    fn derangement_has_no_fixed_points_and_is_seeded() {
        for seed in 0..50 {
            let p = derangement(16, &mut SimRng::new(seed));
            let mut sorted = p.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, (0..16).collect::<Vec<_>>());
            assert!(p.iter().enumerate().all(|(i, &d)| i as u32 != d));
            assert_eq!(p, derangement(16, &mut SimRng::new(seed)));
        }
    }

    #[test]
    fn allreduce_steps_wait_for_the_slowest() {
        let mut t = Traffic::new(Pattern::AllReduce, 4, Some(1000));
        let first = t.initial(&mut SimRng::new(1));
        assert_eq!(first.len(), 4);
        assert!(first.iter().all(|f| f.dst == (f.src + 1) % 4));
        assert!(t.on_complete(0, 1, 10).is_empty());
        assert!(t.on_complete(1, 2, 20).is_empty());
        assert!(t.on_complete(2, 3, 30).is_empty());
        let next = t.on_complete(3, 0, 50);
        assert_eq!(next.len(), 4);
        assert_eq!(t.step_times, vec![50]);
        assert!(next.iter().all(|f| f.start_ns == 50 && f.tag == 1));
    }
}
