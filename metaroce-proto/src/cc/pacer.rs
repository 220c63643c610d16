//! Pacing a connection at the receiver's grant.

use crate::time::Instant;
use core::time::Duration;

/// A token bucket that spreads a connection's DATA packets at the rate the
/// receiver granted.
///
/// A window cap alone lets every sender of an incast put its whole share in
/// flight at once, and the cap follows the smoothed RTT, which grows with
/// the very queue it should prevent. Paced at the grant, N senders together
/// arrive at the receiver's capacity, so its queue stays where the first
/// round trip left it (and ECN drains that).
///
/// Credit accrues at the rate up to `burst` bytes; a packet may go whenever
/// the credit is not negative and then costs its size, so the credit may go
/// into debt by at most one transmit. Rate 0 switches pacing off.
///
/// ```
/// use core::time::Duration;
/// use metaroce_proto::cc::Pacer;
/// use metaroce_proto::Instant;
/// let mut p = Pacer::new(8192);
/// let t0 = Instant::ZERO;
/// assert!(p.ready(t0), "unpaced: always ready");
/// p.set_rate_kbps(t0, 8_000); // 1 byte per microsecond
/// assert!(p.ready(t0));
/// p.sent(t0, 1000);
/// assert!(!p.ready(t0 + Duration::from_micros(999)));
/// assert_eq!(p.ready_at(), Some(t0 + Duration::from_micros(1000)));
/// assert!(p.ready(t0 + Duration::from_micros(1000)));
/// ```
#[derive(Debug, Clone)]
pub struct Pacer {
    rate_kbps: u32,
    /// Bytes of credit at `at` (negative: debt).
    credit: i64,
    at: Instant,
    burst: u64,
}

impl Pacer {
    /// An idle pacer (no rate yet) whose credit never exceeds `burst` bytes.
    pub fn new(burst: u64) -> Self {
        Pacer {
            rate_kbps: 0,
            credit: 0,
            at: Instant::ZERO,
            burst: burst.max(1),
        }
    }

    /// The pacing rate in kbit/s (0: not pacing).
    pub fn rate_kbps(&self) -> u32 {
        self.rate_kbps
    }

    /// Sets the rate (0 stops pacing). Credit earned so far at the old rate is kept.
    pub fn set_rate_kbps(&mut self, now: Instant, kbps: u32) {
        if kbps == self.rate_kbps {
            return;
        }
        if self.rate_kbps == 0 {
            self.credit = 0;
            self.at = now;
        } else {
            self.credit = self.credit_at(now);
            self.at = self.at.max(now);
        }
        self.rate_kbps = kbps;
    }

    /// Credit at `now`, in bytes.
    fn credit_at(&self, now: Instant) -> i64 {
        if self.rate_kbps == 0 {
            return 0;
        }
        let ns = now.saturating_since(self.at).as_nanos();
        // kbit/s = 1000/8 bytes per second = 1/8_000_000 bytes per ns.
        let earned = ns.saturating_mul(u128::from(self.rate_kbps)) / 8_000_000;
        let earned = i64::try_from(earned).unwrap_or(i64::MAX);
        self.credit
            .saturating_add(earned)
            .min(i64::try_from(self.burst).unwrap_or(i64::MAX))
    }

    /// Whether a packet may go at `now`.
    pub fn ready(&self, now: Instant) -> bool {
        self.rate_kbps == 0 || self.credit_at(now) >= 0
    }

    /// When the debt is paid off (None: not pacing, or no debt).
    pub fn ready_at(&self) -> Option<Instant> {
        if self.rate_kbps == 0 || self.credit >= 0 {
            return None;
        }
        let debt = self.credit.unsigned_abs() as u128;
        let ns = (debt * 8_000_000).div_ceil(u128::from(self.rate_kbps));
        Some(self.at + Duration::from_nanos(u64::try_from(ns).unwrap_or(u64::MAX)))
    }

    /// Charges `bytes` sent at `now`.
    pub fn sent(&mut self, now: Instant, bytes: u64) {
        if self.rate_kbps == 0 {
            return;
        }
        let credit = self.credit_at(now);
        self.at = self.at.max(now);
        self.credit = credit.saturating_sub(i64::try_from(bytes).unwrap_or(i64::MAX));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paces_at_the_rate_over_many_packets() {
        // 4 Gbit/s, 4 KB packets: one every 8.192 us.
        let mut p = Pacer::new(8192);
        let mut now = Instant::ZERO;
        p.set_rate_kbps(now, 4_000_000);
        let mut sent = 0u64;
        let end = Instant::ZERO + Duration::from_millis(1);
        while now < end {
            if p.ready(now) {
                p.sent(now, 4096);
                sent += 4096;
            } else {
                now = p.ready_at().unwrap();
            }
        }
        // 1 ms at 4 Gbit/s = 500,000 bytes (plus the first packet's debt).
        assert!((500_000..=500_000 + 2 * 4096).contains(&sent), "{sent}");
    }

    #[test]
    fn credit_is_capped_at_the_burst() {
        let mut p = Pacer::new(8192);
        p.set_rate_kbps(Instant::ZERO, 8_000_000); // 1 byte/ns
        let later = Instant::ZERO + Duration::from_millis(10);
        let mut n = 0;
        while p.ready(later) {
            p.sent(later, 4096);
            n += 1;
        }
        assert_eq!(n, 3, "8 KiB of credit: two packets, a third into debt");
    }

    #[test]
    fn rate_zero_stops_pacing_and_restart_forgets_debt() {
        let mut p = Pacer::new(4096);
        p.set_rate_kbps(Instant::ZERO, 1000);
        p.sent(Instant::ZERO, 1_000_000);
        assert!(!p.ready(Instant::ZERO + Duration::from_millis(1)));
        p.set_rate_kbps(Instant::ZERO, 0);
        assert!(p.ready(Instant::ZERO));
        assert_eq!(p.ready_at(), None);
        p.set_rate_kbps(Instant::ZERO, 1000);
        assert!(p.ready(Instant::ZERO));
    }
}
