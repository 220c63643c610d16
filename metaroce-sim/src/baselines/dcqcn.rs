//! DCQCN rate control (Zhu et al., SIGCOMM 2015), simplified but with the
//! paper's structure.
//!
//! - Notification point (receiver): on a CE-marked data packet, send a CNP
//!   to the sender, at most one per `cnp_interval_ns` per QP.
//! - Reaction point (sender): on a CNP, remember the target rate
//!   `R_T = R_C`, cut `R_C *= 1 - α/2`, and raise `α = (1-g)α + g`; without
//!   CNPs, α decays by `(1-g)` every `alpha_timer_ns`. The rate recovers in
//!   stages driven by a timer (`timer_ns`) and a byte counter
//!   (`byte_counter`): fast recovery (`R_C = (R_T + R_C)/2`) for the first
//!   `fast_recovery_steps` events, then additive increase (`R_T += R_AI`),
//!   and hyper increase (`R_T += i·R_HAI`) once both counters passed F.

use crate::time::{Nanos, NS_PER_US};

/// DCQCN constants.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct DcqcnParams {
    /// `false` turns rate control off (senders stay at line rate).
    pub enabled: bool,
    /// EWMA gain g (paper: 1/256).
    pub g: f64,
    /// Additive increase step R_AI in Gbit/s.
    pub ai_gbps: f64,
    /// Hyper increase step R_HAI in Gbit/s.
    pub hai_gbps: f64,
    /// Rate increase timer period (paper: 55 µs).
    pub timer_ns: Nanos,
    /// Byte counter for rate increase (paper: 10 MB).
    pub byte_counter: u64,
    /// Fast recovery stages F (paper: 5).
    pub fast_recovery_steps: u32,
    /// α update period without CNPs (paper: 55 µs).
    pub alpha_timer_ns: Nanos,
    /// Minimum sending rate in Gbit/s.
    pub min_gbps: f64,
    /// Receiver's minimum gap between CNPs of one QP (paper: 50 µs).
    pub cnp_interval_ns: Nanos,
}

impl Default for DcqcnParams {
    fn default() -> Self {
        DcqcnParams {
            enabled: true,
            g: 1.0 / 256.0,
            ai_gbps: 0.1,
            hai_gbps: 1.0,
            timer_ns: 55 * NS_PER_US,
            byte_counter: 10_000_000,
            fast_recovery_steps: 5,
            alpha_timer_ns: 55 * NS_PER_US,
            min_gbps: 0.1,
            cnp_interval_ns: 50 * NS_PER_US,
        }
    }
}

/// Reaction-point state of one QP.
#[derive(Debug, Clone)]
pub struct Dcqcn {
    p: DcqcnParams,
    line: f64,
    rc: f64,
    rt: f64,
    alpha: f64,
    alpha_at: Nanos,
    timer_stage: u32,
    byte_stage: u32,
    bytes: u64,
    next_increase: Option<Nanos>,
}

impl Dcqcn {
    /// A QP starting at `line_gbps` with α = 1.
    pub fn new(p: &DcqcnParams, line_gbps: f64) -> Self {
        Dcqcn {
            p: p.clone(),
            line: line_gbps,
            rc: line_gbps,
            rt: line_gbps,
            alpha: 1.0,
            alpha_at: 0,
            timer_stage: 0,
            byte_stage: 0,
            bytes: 0,
            next_increase: None,
        }
    }

    /// Current sending rate R_C in Gbit/s.
    pub fn rate_gbps(&self) -> f64 {
        self.rc
    }

    /// Current α.
    pub fn alpha(&self) -> f64 {
        self.alpha
    }

    /// The next time [`Dcqcn::on_timer`] has work to do.
    pub fn next_timer(&self) -> Option<Nanos> {
        self.next_increase
    }

    /// A CNP arrived.
    pub fn on_cnp(&mut self, now: Nanos) {
        if !self.p.enabled {
            return;
        }
        let periods = now.saturating_sub(self.alpha_at) / self.p.alpha_timer_ns;
        self.alpha *= (1.0 - self.p.g).powi(periods.min(i32::MAX as u64) as i32);
        self.alpha_at = now;
        self.rt = self.rc;
        self.rc = (self.rc * (1.0 - self.alpha / 2.0)).max(self.p.min_gbps);
        self.alpha = (1.0 - self.p.g) * self.alpha + self.p.g;
        self.timer_stage = 0;
        self.byte_stage = 0;
        self.bytes = 0;
        self.next_increase = Some(now + self.p.timer_ns);
    }

    /// `bytes` were sent.
    pub fn on_sent(&mut self, bytes: u64) {
        if self.next_increase.is_none() {
            return;
        }
        self.bytes += bytes;
        if self.bytes >= self.p.byte_counter {
            self.bytes -= self.p.byte_counter;
            self.byte_stage += 1;
            self.increase();
        }
    }

    /// Timer work due at or before `now`.
    pub fn on_timer(&mut self, now: Nanos) {
        while let Some(t) = self.next_increase {
            if t > now {
                break;
            }
            self.timer_stage += 1;
            self.increase();
            if self.next_increase.is_some() {
                self.next_increase = Some(t + self.p.timer_ns);
            }
        }
    }

    fn increase(&mut self) {
        let f = self.p.fast_recovery_steps;
        let (hi, lo) = (
            self.timer_stage.max(self.byte_stage),
            self.timer_stage.min(self.byte_stage),
        );
        if hi < f {
            // Fast recovery: converge towards the rate before the cut.
        } else if lo >= f {
            self.rt += (lo - f + 1) as f64 * self.p.hai_gbps;
        } else {
            self.rt += self.p.ai_gbps;
        }
        self.rt = self.rt.min(self.line);
        self.rc = ((self.rt + self.rc) / 2.0).min(self.line);
        if self.rc >= self.line * 0.9999 {
            self.rc = self.line;
            self.rt = self.line;
            self.next_increase = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cut_then_recover() {
        let p = DcqcnParams::default();
        let mut d = Dcqcn::new(&p, 100.0);
        d.on_cnp(0);
        assert!(
            (d.rate_gbps() - 50.0).abs() < 1e-9,
            "alpha 1 halves the rate"
        );
        assert!(d.next_timer().is_some());
        // Fast recovery: five timer periods bring R_C most of the way back.
        d.on_timer(5 * p.timer_ns);
        assert!(
            d.rate_gbps() > 98.0 && d.rate_gbps() <= 100.0,
            "{}",
            d.rate_gbps()
        );
        // Then additive/hyper increase reaches line rate and the timer stops.
        d.on_timer(100 * p.timer_ns);
        assert_eq!(d.rate_gbps(), 100.0);
        assert_eq!(d.next_timer(), None);
        // Alpha has decayed since the CNP; a later cut is gentler.
        d.on_cnp(100 * p.timer_ns);
        assert!(d.rate_gbps() > 50.0);
    }

    #[test]
    fn disabled_is_inert() {
        let p = DcqcnParams {
            enabled: false,
            ..DcqcnParams::default()
        };
        let mut d = Dcqcn::new(&p, 100.0);
        d.on_cnp(0);
        assert_eq!(d.rate_gbps(), 100.0);
        assert_eq!(d.next_timer(), None);
    }
}
