//! The sender's congestion window.

use core::time::Duration;

/// What [`SenderCc`]'s delay signal judges an RTT against.
///
/// ```
/// use core::time::Duration;
/// use metaroce_proto::cc::DelayBase;
/// let b = DelayBase::new(Duration::from_micros(10));
/// assert_eq!(b.reference, b.least);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DelayBase {
    /// The RTT with no queue of the sender's making: queueing is what an
    /// RTT has above it.
    pub reference: Duration,
    /// The least RTT the connection has seen (at most `reference`): the
    /// queueing tolerated is at least this long.
    pub least: Duration,
}

impl DelayBase {
    /// Both the reference and the least RTT: `rtt`.
    pub fn new(rtt: Duration) -> Self {
        Self {
            reference: rtt,
            least: rtt,
        }
    }
}

/// A connection's congestion window, in bytes.
///
/// Additive increase of one MTU per window of acknowledged bytes. Once per
/// RTT the window is checked against two congestion signals:
///
/// - ECN: if any acknowledged packet carried a CE mark, the window shrinks in
///   proportion to the smoothed marked fraction `alpha` (DCTCP):
///   `cwnd *= 1 - alpha/2`.
/// - Delay: if the RTT stayed above a reference RTT plus a target
///   queueing delay (the configured target, or the least RTT seen where
///   that is longer), the window shrinks in proportion to the excess (as
///   in Swift), at most by half: queues the network does not mark (a
///   host's socket buffer, a switch without ECN) still slow the sender.
///   The reference is the caller's ([`DelayBase`]): a connection gives the
///   smallest RTT it has seen, or more where all its paths share a delay
///   it did not make.
///
/// Random loss is not a congestion signal: it is recovered selectively.
///
/// ```
/// use core::time::Duration;
/// use metaroce_proto::cc::{DelayBase, SenderCc};
/// let mut cc = SenderCc::new(64 * 1024, 8 * 1024, 1 << 20, 4096, Duration::from_micros(50));
/// let rtt = Duration::from_micros(10);
/// cc.on_ack(64 * 1024, 16, 0, rtt, DelayBase::new(rtt), Duration::ZERO);
/// assert!(cc.window() > 64 * 1024);
/// let before = cc.window();
/// cc.on_ack(4096, 16, 16, rtt, DelayBase::new(rtt), Duration::from_micros(20));
/// assert!(cc.window() < before, "ECN marks shrink the window");
/// let before = cc.window();
/// cc.on_ack(4096, 16, 0, Duration::from_micros(200), DelayBase::new(rtt), Duration::from_micros(300));
/// assert!(cc.window() < before, "queueing delay shrinks the window");
/// assert_eq!(cc.congested_rounds(), 2, "two rounds in a row cut the window");
/// cc.on_ack(4096, 16, 0, rtt, DelayBase::new(rtt), Duration::from_micros(20));
/// assert_eq!(cc.congested_rounds(), 0, "a clean round ends the run");
/// ```
#[derive(Debug, Clone)]
pub struct SenderCc {
    cwnd: u64,
    min: u64,
    max: u64,
    mtu: u64,
    alpha: f64,
    delay_target: Duration,
    /// Marked and total packets in the current observation window.
    win_marked: u64,
    win_total: u64,
    /// Smallest RTT sample in the observation window.
    win_min_rtt: Option<Duration>,
    /// Elapsed time in this observation window.
    win_elapsed: Duration,
    /// Observation windows in a row that cut the window.
    congested_rounds: u32,
}

/// DCTCP's gain for the marked-fraction average.
const ALPHA_GAIN: f64 = 1.0 / 16.0;

impl SenderCc {
    /// A window starting at `initial` bytes, kept in `min..=max`; queueing
    /// delay above `delay_target` counts as congestion.
    pub fn new(initial: u64, min: u64, max: u64, mtu: u64, delay_target: Duration) -> Self {
        SenderCc {
            cwnd: initial.clamp(min, max),
            min,
            max,
            mtu: mtu.max(1),
            alpha: 1.0,
            delay_target,
            win_marked: 0,
            win_total: 0,
            win_min_rtt: None,
            win_elapsed: Duration::ZERO,
            congested_rounds: 0,
        }
    }

    /// Current window in bytes.
    pub fn window(&self) -> u64 {
        self.cwnd
    }

    /// Whether the window is within twice its smallest: the path sends
    /// about as little as it may.
    pub fn near_min(&self) -> bool {
        self.cwnd <= 2 * self.min
    }

    /// Whether the window is at its smallest.
    pub fn at_min(&self) -> bool {
        self.cwnd <= self.min
    }

    /// Starts over from `window` bytes (a path moved to a new route).
    pub fn reset(&mut self, window: u64) {
        self.cwnd = window.clamp(self.min, self.max);
        self.alpha = 1.0;
        self.win_marked = 0;
        self.win_total = 0;
        self.win_min_rtt = None;
        self.win_elapsed = Duration::ZERO;
        self.congested_rounds = 0;
    }

    /// Observation windows (about one RTT each) in a row in which ECN marks
    /// or queueing delay cut the window; 0 after a round that did not.
    pub fn congested_rounds(&self) -> u32 {
        self.congested_rounds
    }

    /// DCTCP's smoothed marked fraction.
    pub fn alpha(&self) -> f64 {
        self.alpha
    }

    /// Feeds an acknowledgement: `bytes` newly acknowledged, the ECN echo
    /// delta (`pkts` packets received by the peer, `marked` of them CE), the
    /// latest RTT sample and what delay is judged against, and the time
    /// since the previous call.
    pub fn on_ack(
        &mut self,
        bytes: u64,
        pkts: u64,
        marked: u64,
        rtt: Duration,
        base: DelayBase,
        elapsed: Duration,
    ) {
        let base_rtt = base.reference;
        self.win_marked += marked.min(pkts);
        self.win_total += pkts;
        self.win_elapsed += elapsed;
        self.win_min_rtt = Some(self.win_min_rtt.map_or(rtt, |m| m.min(rtt)));
        // The queueing tolerated: the target, or the least RTT seen where
        // that is longer (on a slow link one packet's serialization alone
        // exceeds a datacenter target, and a window pinned at its minimum
        // cannot shift traffic between routes). Not the reference, which
        // may hold a delay all paths share: tolerating that much again
        // would let the queues grow by as much.
        let target = self.delay_target.max(base.least);
        let queueing = rtt.saturating_sub(base_rtt);
        if marked == 0 && self.win_marked == 0 && queueing <= target {
            // Additive increase: one MTU per window's worth of acknowledged bytes.
            self.cwnd = (self.cwnd + bytes * self.mtu / self.cwnd.max(1)).min(self.max);
        }
        // Once per RTT, fold the observation window and react.
        let period = rtt.max(base_rtt);
        if self.win_elapsed >= period && (self.win_total > 0 || self.win_min_rtt.is_some()) {
            if self.win_total > 0 {
                let frac = self.win_marked as f64 / self.win_total as f64;
                self.alpha = (1.0 - ALPHA_GAIN) * self.alpha + ALPHA_GAIN * frac;
            }
            let mut factor: f64 = 1.0;
            if self.win_marked > 0 {
                factor = factor.min(1.0 - self.alpha / 2.0);
            }
            // Delay: even the best RTT of the window was above target.
            if let Some(best) = self.win_min_rtt {
                let excess = best.saturating_sub(base_rtt);
                if excess > target && !best.is_zero() {
                    let over = (excess - target).as_secs_f64() / best.as_secs_f64();
                    factor = factor.min(1.0 - (0.8 * over).min(0.5));
                }
            }
            if factor < 1.0 {
                self.cwnd = ((self.cwnd as f64 * factor) as u64).clamp(self.min, self.max);
                self.congested_rounds = self.congested_rounds.saturating_add(1);
            } else {
                self.congested_rounds = 0;
            }
            self.win_marked = 0;
            self.win_total = 0;
            self.win_min_rtt = None;
            self.win_elapsed = Duration::ZERO;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: Duration = Duration::from_micros(1);

    /// Feeds `rounds` RTTs of ACKs, each RTT `rtt`, over a path whose
    /// smallest RTT is `base`; returns the window at the end.
    fn run(rtt: Duration, base: Duration, rounds: u32) -> (u64, u32) {
        let mut cc = SenderCc::new(64 * 1024, 8 * 1024, 1 << 20, 4096, 100 * US);
        for _ in 0..rounds {
            for _ in 0..4 {
                cc.on_ack(4096, 1, 0, rtt, DelayBase::new(base), rtt / 4);
            }
        }
        (cc.window(), cc.congested_rounds())
    }

    #[test]
    fn queueing_within_the_target_lets_the_window_grow() {
        // 100 µs target: 60 µs of queueing is tolerated.
        let (w, rounds) = run(80 * US, 20 * US, 8);
        assert!(w > 64 * 1024, "{w}");
        assert_eq!(rounds, 0);
    }

    #[test]
    fn queueing_past_the_target_cuts_the_window() {
        let (w, rounds) = run(400 * US, 20 * US, 8);
        assert!(w < 32 * 1024, "{w}");
        assert_eq!(rounds, 8);
    }

    /// On a slow link the smallest RTT (mostly serialization) is longer
    /// than the target: the queueing tolerated is the smallest RTT itself,
    /// so one packet's worth of queue does not pin the window down.
    #[test]
    fn the_target_is_at_least_the_smallest_rtt() {
        let (w, rounds) = run(900 * US, 500 * US, 8);
        assert!(w > 64 * 1024, "{w}");
        assert_eq!(rounds, 0);
        // Twice the smallest RTT of queueing is too much all the same.
        let (w, _) = run(1500 * US, 500 * US, 8);
        assert!(w < 64 * 1024, "{w}");
    }

    /// A reference raised above the least RTT (a delay all paths share)
    /// moves where queueing starts, not how much is tolerated: 100 µs
    /// (the target) above a 300 µs reference, not 300 µs more.
    #[test]
    fn a_raised_reference_does_not_raise_the_target() {
        let base = DelayBase {
            reference: 300 * US,
            least: 20 * US,
        };
        let run = |rtt: Duration| {
            let mut cc = SenderCc::new(64 * 1024, 8 * 1024, 1 << 20, 4096, 100 * US);
            for _ in 0..8 {
                for _ in 0..4 {
                    cc.on_ack(4096, 1, 0, rtt, base, rtt / 4);
                }
            }
            (cc.window(), cc.congested_rounds())
        };
        let (w, rounds) = run(380 * US);
        assert!(w > 64 * 1024, "{w}");
        assert_eq!(rounds, 0);
        let (w, rounds) = run(560 * US);
        assert!(w < 64 * 1024, "{w}");
        assert_eq!(rounds, 8);
    }
}
