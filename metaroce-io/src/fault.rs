//! Fault injection on the receive side, shared by both backends: seeded
//! drop, duplication and reordering of datagrams before the core sees them,
//! for every datagram or only those from given source ports (paths).
//!
//! Off by default and then free: the driver holds no injector and each
//! received datagram costs one `None` check.

use crate::DriverStats;
use metaroce_proto::{Ecn, Endpoint, Instant};
use std::collections::VecDeque;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

/// What to do to received datagrams before the core sees them.
///
/// Each datagram (a GRO batch is split first) is dropped with probability
/// [`drop`](Self::drop); a kept one is handed to the core twice with
/// probability [`duplicate`](Self::duplicate), and held back for
/// [`reorder_delay`](Self::reorder_delay) with probability
/// [`reorder`](Self::reorder), so that later datagrams overtake it (held
/// datagrams are delivered on the first `poll` turn after they are due; the
/// driver's wait is bounded by the next one). The same seed and the same
/// arrivals give the same faults.
///
/// ```
/// use metaroce_io::{DriverConfig, FaultConfig};
/// use std::time::Duration;
/// let mut cfg = DriverConfig::new("127.0.0.1:0".parse().unwrap());
/// cfg.faults = FaultConfig {
///     seed: 7,
///     drop: 0.01,
///     duplicate: 0.005,
///     reorder: 0.01,
///     reorder_delay: Duration::from_micros(200),
///     per_path: None,
///     per_source: None,
/// };
/// assert!(cfg.faults.is_active());
/// assert!(!FaultConfig::default().is_active());
/// ```
#[derive(Debug, Clone, PartialEq, Default)]
pub struct FaultConfig {
    /// Seed of the injector's random numbers.
    pub seed: u64,
    /// Probability that a datagram is dropped, in `[0, 1]`.
    pub drop: f64,
    /// Probability that a kept datagram is delivered twice, in `[0, 1]`.
    pub duplicate: f64,
    /// Probability that a kept datagram is held back, in `[0, 1]`.
    pub reorder: f64,
    /// How long a held datagram waits.
    pub reorder_delay: Duration,
    /// Only datagrams from these UDP source ports (the peer's paths) are
    /// touched; `None`: all.
    pub per_path: Option<Vec<u16>>,
    /// Only datagrams from these peer addresses (for instance the address
    /// of one of the peer's planes) are touched; `None`: all. With
    /// `per_path` too, a datagram must match both.
    pub per_source: Option<Vec<IpAddr>>,
}

impl FaultConfig {
    /// Whether any fault can happen.
    pub fn is_active(&self) -> bool {
        self.drop > 0.0 || self.duplicate > 0.0 || (self.reorder > 0.0)
    }

    /// Drops every datagram from `ports` and leaves the rest alone: a path
    /// (or several) that stopped delivering.
    ///
    /// ```
    /// let f = metaroce_io::FaultConfig::blackhole(vec![40000]);
    /// assert_eq!(f.drop, 1.0);
    /// ```
    pub fn blackhole(ports: Vec<u16>) -> Self {
        FaultConfig {
            drop: 1.0,
            per_path: Some(ports),
            ..FaultConfig::default()
        }
    }

    /// Drops every datagram from the peer addresses `ips`: a plane that
    /// failed.
    ///
    /// ```
    /// let f = metaroce_io::FaultConfig::blackhole_sources(vec!["10.0.1.2".parse().unwrap()]);
    /// assert!(f.is_active() && f.per_path.is_none());
    /// ```
    pub fn blackhole_sources(ips: Vec<IpAddr>) -> Self {
        FaultConfig {
            drop: 1.0,
            per_source: Some(ips),
            ..FaultConfig::default()
        }
    }
}

/// A datagram held back for reordering.
struct Held {
    due: Instant,
    from: SocketAddr,
    ecn: Ecn,
    data: Vec<u8>,
}

/// The running injector of one driver.
pub(crate) struct Faults {
    cfg: FaultConfig,
    rng: u64,
    /// Held datagrams, in due order (one delay for all, so arrival order).
    held: VecDeque<Held>,
    /// Buffers of delivered held datagrams, reused.
    spare: Vec<Vec<u8>>,
}

impl Faults {
    /// An injector for `cfg`, or `None` when it does nothing.
    pub(crate) fn new(cfg: &FaultConfig) -> Option<Box<Faults>> {
        cfg.is_active().then(|| {
            Box::new(Faults {
                cfg: cfg.clone(),
                // splitmix64 of the seed: never zero for xorshift.
                rng: splitmix(cfg.seed) | 1,
                held: VecDeque::new(),
                spare: Vec::new(),
            })
        })
    }

    /// A uniform number in `[0, 1)`.
    fn uniform(&mut self) -> f64 {
        let mut x = self.rng;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.rng = x;
        (x >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Draws whether an event of probability `p` happens (no draw for 0).
    fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && (p >= 1.0 || self.uniform() < p)
    }

    /// When the next held datagram is due.
    pub(crate) fn next_due(&self) -> Option<Instant> {
        self.held.front().map(|h| h.due)
    }

    /// Hands `dg` to the core, or drops, duplicates or holds it.
    pub(crate) fn on_datagram(
        &mut self,
        now: Instant,
        from: SocketAddr,
        ecn: Ecn,
        dg: &[u8],
        ep: &mut Endpoint,
        stats: &mut DriverStats,
    ) {
        let untouched = self
            .cfg
            .per_path
            .as_ref()
            .is_some_and(|ports| !ports.contains(&from.port()))
            || self
                .cfg
                .per_source
                .as_ref()
                .is_some_and(|ips| !ips.contains(&from.ip()));
        if untouched {
            ep.handle_datagram(now, from, ecn, dg);
            return;
        }
        if self.chance(self.cfg.drop) {
            stats.faults_dropped += 1;
            return;
        }
        let copies = if self.chance(self.cfg.duplicate) {
            stats.faults_duplicated += 1;
            2
        } else {
            1
        };
        if self.chance(self.cfg.reorder) {
            stats.faults_delayed += 1;
            let mut data = self.spare.pop().unwrap_or_default();
            data.clear();
            data.extend_from_slice(dg);
            let due = now + self.cfg.reorder_delay;
            if copies == 2 {
                // The duplicate goes now, the original later.
                ep.handle_datagram(now, from, ecn, dg);
            }
            self.held.push_back(Held {
                due,
                from,
                ecn,
                data,
            });
            return;
        }
        for _ in 0..copies {
            ep.handle_datagram(now, from, ecn, dg);
        }
    }

    /// Delivers every held datagram that is due. Returns whether any was.
    pub(crate) fn release(&mut self, now: Instant, ep: &mut Endpoint) -> bool {
        let mut any = false;
        while self.held.front().is_some_and(|h| h.due <= now) {
            let h = self.held.pop_front().expect("front exists");
            ep.handle_datagram(now, h.from, h.ecn, &h.data);
            self.spare.push(h.data);
            any = true;
        }
        any
    }
}

fn splitmix(seed: u64) -> u64 {
    let mut z = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// How long a driver may wait from `now`, at most `cap`: until the core's
/// next timer or the injector's next held datagram, whichever comes first
/// (zero if one is due).
pub(crate) fn timer_wait(
    ep: &mut Endpoint,
    faults: Option<&Faults>,
    now: Instant,
    cap: Duration,
) -> Duration {
    [ep.poll_timeout(), faults.and_then(Faults::next_due)]
        .into_iter()
        .flatten()
        .fold(cap, |wait, t| wait.min(t.saturating_since(now)))
}

/// Replaces the injector by one for `cfg`, first delivering what the old one held.
pub(crate) fn replace(
    faults: &mut Option<Box<Faults>>,
    cfg: &FaultConfig,
    now: Instant,
    ep: &mut Endpoint,
) {
    if let Some(old) = faults {
        for h in old.held.drain(..) {
            ep.handle_datagram(now, h.from, h.ecn, &h.data);
        }
    }
    *faults = Faults::new(cfg);
}

/// Hands a received datagram to the core, through the injector if there is one.
#[inline]
#[allow(clippy::too_many_arguments)]
pub(crate) fn deliver(
    faults: &mut Option<Box<Faults>>,
    now: Instant,
    arrived: Instant,
    from: SocketAddr,
    ecn: Ecn,
    dg: &[u8],
    ep: &mut Endpoint,
    stats: &mut DriverStats,
) {
    match faults {
        None => ep.handle_datagram_stamped(now, arrived, from, ecn, dg),
        // What the injector lets through arrives, for the core, when it
        // lets it through.
        Some(f) => f.on_datagram(now, from, ecn, dg, ep, stats),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_means_no_injector() {
        assert!(Faults::new(&FaultConfig::default()).is_none());
    }

    #[test]
    fn rates_and_seeds() {
        let cfg = FaultConfig {
            seed: 3,
            drop: 0.1,
            ..FaultConfig::default()
        };
        let draws = |cfg: &FaultConfig| {
            let mut f = Faults::new(cfg).unwrap();
            (0..100_000).map(|_| f.chance(0.1)).collect::<Vec<_>>()
        };
        let a = draws(&cfg);
        assert_eq!(a, draws(&cfg), "same seed, same faults");
        let hits = a.iter().filter(|&&x| x).count();
        assert!((9_000..11_000).contains(&hits), "{hits}");
        let other = FaultConfig { seed: 4, ..cfg };
        assert_ne!(a, draws(&other));
    }
}
