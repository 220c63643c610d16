//! The sender's congestion window.

use core::time::Duration;

/// A connection's congestion window, in bytes.
///
/// Additive increase of one MTU per window of acknowledged bytes; once per
/// RTT, if any acknowledged packet carried a CE mark, the window shrinks in
/// proportion to the smoothed marked fraction `alpha` (DCTCP):
/// `cwnd *= 1 - alpha/2`.
///
/// ```
/// use core::time::Duration;
/// use metaroce_proto::cc::SenderCc;
/// let mut cc = SenderCc::new(64 * 1024, 8 * 1024, 1 << 20, 4096);
/// let rtt = Duration::from_micros(10);
/// cc.on_ack(64 * 1024, 16, 0, rtt, Duration::ZERO);
/// assert!(cc.window() > 64 * 1024);
/// let before = cc.window();
/// cc.on_ack(4096, 16, 16, rtt, Duration::from_micros(20));
/// assert!(cc.window() < before);
/// ```
#[derive(Debug, Clone)]
pub struct SenderCc {
    cwnd: u64,
    min: u64,
    max: u64,
    mtu: u64,
    alpha: f64,
    /// Marked and total packets in the current observation window.
    win_marked: u64,
    win_total: u64,
    /// Bytes acknowledged since the window was last reduced or the epoch started.
    win_acked: u64,
    /// Elapsed time in this observation window.
    win_elapsed: Duration,
}

/// DCTCP's gain for the marked-fraction average.
const ALPHA_GAIN: f64 = 1.0 / 16.0;

impl SenderCc {
    /// A window starting at `initial` bytes, kept in `min..=max`.
    pub fn new(initial: u64, min: u64, max: u64, mtu: u64) -> Self {
        SenderCc {
            cwnd: initial.clamp(min, max),
            min,
            max,
            mtu: mtu.max(1),
            alpha: 1.0,
            win_marked: 0,
            win_total: 0,
            win_acked: 0,
            win_elapsed: Duration::ZERO,
        }
    }

    /// Current window in bytes.
    pub fn window(&self) -> u64 {
        self.cwnd
    }

    /// DCTCP's smoothed marked fraction.
    pub fn alpha(&self) -> f64 {
        self.alpha
    }

    /// Feeds an acknowledgement: `bytes` newly acknowledged, and the ECN echo
    /// delta (`pkts` packets received by the peer, `marked` of them CE).
    /// `elapsed` is the time since the previous call.
    pub fn on_ack(&mut self, bytes: u64, pkts: u64, marked: u64, rtt: Duration, elapsed: Duration) {
        self.win_marked += marked.min(pkts);
        self.win_total += pkts;
        self.win_acked += bytes;
        self.win_elapsed += elapsed;
        if marked == 0 && self.win_marked == 0 {
            // Additive increase: one MTU per window's worth of acknowledged bytes.
            self.cwnd = (self.cwnd + bytes * self.mtu / self.cwnd.max(1)).min(self.max);
        }
        // Once per RTT, fold the observation window into alpha and react.
        if self.win_elapsed >= rtt && self.win_total > 0 {
            let frac = self.win_marked as f64 / self.win_total as f64;
            self.alpha = (1.0 - ALPHA_GAIN) * self.alpha + ALPHA_GAIN * frac;
            if self.win_marked > 0 {
                let reduced = (self.cwnd as f64 * (1.0 - self.alpha / 2.0)) as u64;
                self.cwnd = reduced.clamp(self.min, self.max);
            }
            self.win_marked = 0;
            self.win_total = 0;
            self.win_acked = 0;
            self.win_elapsed = Duration::ZERO;
        }
    }
}
