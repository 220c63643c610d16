//! Host stalls: rare pauses of a host's packet processing, as a receiver
//! thread that is descheduled, or a NIC that holds its interrupts, causes.
//!
//! The model (`--host-stall RATE_PER_MS:MEAN_US[:exp|fixed]`):
//!
//! - Each host alternates between running and stalled. A running period
//!   lasts an exponentially distributed time of mean `1 / RATE_PER_MS`
//!   milliseconds, so while a host runs its stalls start as a Poisson
//!   process of `RATE_PER_MS` per millisecond.
//! - A stall lasts an exponentially distributed time of mean `MEAN_US`
//!   (`exp`, the default) or exactly `MEAN_US` (`fixed`).
//! - During a stall the host's transport sees nothing: packets that reach
//!   the host wait and are handed over together, in arrival order, when
//!   the stall ends; timers that fall due fire at the end; the transport
//!   sends nothing new (packets it already handed to the NIC still leave).
//! - Every host draws from its own random stream of the run's seed: stalls
//!   of different hosts are independent, and a run is still deterministic.
//!
//! A fraction `RATE × MEAN / (1 + RATE × MEAN)` of each host's time is
//! spent stalled (`RATE` per ns and `MEAN` in ns).

use std::str::FromStr;

use crate::config::ConfigError;
use crate::rng::SimRng;
use crate::time::{Nanos, NS_PER_MS, NS_PER_US};

/// How long a stall lasts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum StallLengths {
    /// Exponentially distributed around the mean.
    #[default]
    Exponential,
    /// Always the mean.
    Fixed,
}

/// Stalls of every host's processing (see the module documentation).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct HostStalls {
    /// Stalls per millisecond of running time.
    pub rate_per_ms: f64,
    /// Mean stall length, ns.
    pub mean_ns: Nanos,
    /// Distribution of stall lengths.
    pub lengths: StallLengths,
}

/// An exponential sample of mean `mean` (in any unit).
fn exponential(rng: &mut SimRng, mean: f64) -> f64 {
    // 1 - U is in (0, 1]: the logarithm is finite.
    -(1.0 - rng.next_f64()).ln() * mean
}

impl HostStalls {
    /// Length of the running period before the next stall.
    pub fn running_ns(&self, rng: &mut SimRng) -> Nanos {
        let mean = NS_PER_MS as f64 / self.rate_per_ms;
        (exponential(rng, mean).round() as Nanos).max(1)
    }

    /// Length of a stall.
    pub fn stall_ns(&self, rng: &mut SimRng) -> Nanos {
        match self.lengths {
            StallLengths::Fixed => self.mean_ns,
            StallLengths::Exponential => {
                (exponential(rng, self.mean_ns as f64).round() as Nanos).max(1)
            }
        }
    }

    /// The long-run fraction of time a host spends stalled.
    pub fn stalled_fraction(&self) -> f64 {
        let x = self.rate_per_ms * self.mean_ns as f64 / NS_PER_MS as f64;
        x / (1.0 + x)
    }

    /// Check the values.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(self.rate_per_ms > 0.0 && self.rate_per_ms.is_finite()) || self.mean_ns == 0 {
            return Err(ConfigError::BadStall(format!(
                "rate and mean must be positive in {self:?}"
            )));
        }
        Ok(())
    }
}

impl FromStr for HostStalls {
    type Err = ConfigError;
    fn from_str(spec: &str) -> Result<Self, Self::Err> {
        let bad = |why: &str| ConfigError::BadStall(format!("{why} in {spec:?}"));
        let mut parts = spec.split(':').map(str::trim);
        let rate_per_ms: f64 = parts
            .next()
            .and_then(|r| r.parse().ok())
            .ok_or_else(|| bad("bad RATE_PER_MS"))?;
        let mean_us: f64 = parts
            .next()
            .and_then(|m| m.parse().ok())
            .ok_or_else(|| bad("bad MEAN_US"))?;
        if !(mean_us > 0.0 && mean_us.is_finite()) {
            return Err(bad("bad MEAN_US"));
        }
        let lengths = match parts.next() {
            None | Some("exp") => StallLengths::Exponential,
            Some("fixed") => StallLengths::Fixed,
            Some(_) => return Err(bad("lengths are exp or fixed")),
        };
        if parts.next().is_some() {
            return Err(bad("too many fields"));
        }
        let s = HostStalls {
            rate_per_ms,
            mean_ns: (mean_us * NS_PER_US as f64).round() as Nanos,
            lengths,
        };
        s.validate()
            .map_err(|_| bad("rate and mean must be positive"))?;
        Ok(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_specs() {
        let s: HostStalls = "0.5:200".parse().unwrap();
        assert_eq!(s.rate_per_ms, 0.5);
        assert_eq!(s.mean_ns, 200_000);
        assert_eq!(s.lengths, StallLengths::Exponential);
        let s: HostStalls = "2:50.5:fixed".parse().unwrap();
        assert_eq!(s.mean_ns, 50_500);
        assert_eq!(s.lengths, StallLengths::Fixed);
        for bad in [
            "",
            "1",
            "0:100",
            "1:0",
            "1:100:uniform",
            "1:2:exp:4",
            "-1:5",
        ] {
            assert!(bad.parse::<HostStalls>().is_err(), "{bad}");
        }
    }

    #[test]
    fn samples_have_the_documented_means() {
        let s: HostStalls = "0.5:200".parse().unwrap();
        let mut rng = SimRng::new(3);
        let n = 20_000;
        let run: f64 = (0..n).map(|_| s.running_ns(&mut rng) as f64).sum::<f64>() / n as f64;
        let stall: f64 = (0..n).map(|_| s.stall_ns(&mut rng) as f64).sum::<f64>() / n as f64;
        assert!((run / 2e6 - 1.0).abs() < 0.03, "{run}");
        assert!((stall / 2e5 - 1.0).abs() < 0.03, "{stall}");
        let fixed = HostStalls {
            lengths: StallLengths::Fixed,
            ..s
        };
        assert_eq!(fixed.stall_ns(&mut rng), 200_000);
        assert!((s.stalled_fraction() - 0.1 / 1.1).abs() < 1e-12);
    }
}
