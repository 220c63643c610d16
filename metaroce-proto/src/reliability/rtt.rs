//! Round-trip time estimation and the retransmission timeout (RFC 6298 style).

use crate::consts::RTT_PEAK_EPOCH_RTTS;
use crate::time::Instant;
use core::time::Duration;

/// Smoothed RTT, RTT variance and the RTO derived from them.
///
/// ```
/// use core::time::Duration;
/// use metaroce_proto::reliability::RttEstimator;
/// let mut r = RttEstimator::new(Duration::from_millis(1), Duration::from_micros(100), Duration::from_secs(1));
/// r.sample(Duration::from_micros(10));
/// assert_eq!(r.srtt(), Some(Duration::from_micros(10)));
/// assert_eq!(r.rto(), Duration::from_micros(100)); // clamped to the minimum
/// ```
#[derive(Debug, Clone, Copy)]
pub struct RttEstimator {
    srtt: Option<Duration>,
    rttvar: Duration,
    min_rtt: Option<Duration>,
    latest: Duration,
    initial_rto: Duration,
    min_rto: Duration,
    max_rto: Duration,
    /// Largest sample of the current epoch, and of the one before.
    peak: Duration,
    prev_peak: Duration,
    /// Start of the current epoch (`RTT_PEAK_EPOCH_RTTS` smoothed RTTs,
    /// at least the minimum RTO), once a timed sample came.
    epoch_start: Option<Instant>,
    /// Samples taken since the estimator (re)started.
    samples: u32,
}

impl RttEstimator {
    /// A new estimator with no samples.
    pub fn new(initial_rto: Duration, min_rto: Duration, max_rto: Duration) -> Self {
        RttEstimator {
            srtt: None,
            rttvar: Duration::ZERO,
            min_rtt: None,
            latest: Duration::ZERO,
            initial_rto,
            min_rto,
            max_rto,
            peak: Duration::ZERO,
            prev_peak: Duration::ZERO,
            epoch_start: None,
            samples: 0,
        }
    }

    /// Forgets every sample (the path moved to a new route, whose delay
    /// the old one's says nothing about); the bounds stay.
    pub fn restart(&mut self) {
        *self = RttEstimator::new(self.initial_rto, self.min_rto, self.max_rto);
    }

    /// Samples taken since the estimator started or [`restart`](Self::restart)ed.
    pub fn samples(&self) -> u32 {
        self.samples
    }

    /// Feeds one RTT sample taken at `now`, which also keeps the recent
    /// peak ([`peak`](Self::peak)) over epochs of time.
    pub fn sample_at(&mut self, now: Instant, rtt: Duration) {
        self.sample(rtt);
        self.peak_at(now, rtt);
    }

    /// Keeps `delay`, a round trip measured otherwise than by an RTT
    /// sample (how long a packet took to be acknowledged), in the recent
    /// peak ([`peak`](Self::peak)) only: the smoothed RTT, its variance
    /// and the smallest RTT are left alone.
    ///
    /// ```
    /// use core::time::Duration;
    /// use metaroce_proto::{reliability::RttEstimator, Instant};
    /// let us = Duration::from_micros;
    /// let mut r = RttEstimator::new(us(100), us(20), us(100_000));
    /// r.sample_at(Instant::from_nanos(0), us(10));
    /// r.note_delay_at(Instant::from_nanos(5_000), us(40));
    /// assert_eq!((r.srtt(), r.peak()), (Some(us(10)), us(40)));
    /// ```
    pub fn note_delay_at(&mut self, now: Instant, delay: Duration) {
        self.peak = self.peak.max(delay);
        self.peak_at(now, delay);
    }

    /// Starts a new peak epoch with `rtt` if the current one is over.
    fn peak_at(&mut self, now: Instant, rtt: Duration) {
        let epoch = self.srtt.map_or(self.min_rto, |s| {
            (s * RTT_PEAK_EPOCH_RTTS).max(self.min_rto)
        });
        match self.epoch_start {
            Some(start) if now.saturating_since(start) < epoch => {}
            _ => {
                self.prev_peak = self.peak;
                self.peak = rtt;
                self.epoch_start = Some(now);
            }
        }
    }

    /// The largest RTT of the recent past (this epoch and the one before:
    /// between one and two epochs of `RTT_PEAK_EPOCH_RTTS` smoothed RTTs,
    /// at least the minimum RTO each), or the smoothed RTT if larger. A
    /// queue whose delay swings (a token-bucket shaper's, a switch port
    /// shared with bursts, a receiver thread that stalls) holds packets
    /// this long now and then without losing them: a packet is not
    /// overdue before it (PROTOCOL §13.3).
    ///
    /// ```
    /// use core::time::Duration;
    /// use metaroce_proto::{reliability::RttEstimator, Instant};
    /// let ms = Duration::from_millis;
    /// let mut r = RttEstimator::new(ms(1), ms(1), ms(500));
    /// r.sample_at(Instant::from_nanos(0), ms(2));
    /// r.sample_at(Instant::from_nanos(1_000_000), ms(9));
    /// r.sample_at(Instant::from_nanos(2_000_000), ms(2));
    /// assert_eq!(r.peak(), ms(9));
    /// // Two quiet epochs later the swing is forgotten.
    /// for t in 1..400 {
    ///     r.sample_at(Instant::from_nanos(2_000_000 + t * 1_000_000), ms(2));
    /// }
    /// assert!(r.peak() < ms(3));
    /// ```
    pub fn peak(&self) -> Duration {
        self.peak
            .max(self.prev_peak)
            .max(self.srtt.unwrap_or(Duration::ZERO))
    }

    /// Seeds an estimator that has no sample with a round trip measured
    /// otherwise (a handshake's): the smoothed RTT, its variance and so the
    /// RTO start from it, but it is not a sample: the smallest RTT (the
    /// base of the delay signal, PROTOCOL §14) waits for real ones, and
    /// the first of those replaces it. Does nothing once a sample came.
    ///
    /// ```
    /// use core::time::Duration;
    /// use metaroce_proto::reliability::RttEstimator;
    /// let us = Duration::from_micros;
    /// let mut r = RttEstimator::new(us(1000), us(10), us(100_000));
    /// r.seed(us(20));
    /// assert_eq!((r.srtt(), r.rto(), r.min_rtt(), r.samples()), (Some(us(20)), us(60), None, 0));
    /// r.sample(us(50));
    /// assert_eq!((r.srtt(), r.min_rtt()), (Some(us(50)), Some(us(50))));
    /// ```
    pub fn seed(&mut self, rtt: Duration) {
        if self.samples == 0 && self.srtt.is_none() {
            self.srtt = Some(rtt);
            self.rttvar = rtt / 2;
            self.latest = rtt;
        }
    }

    /// Feeds one RTT sample.
    pub fn sample(&mut self, rtt: Duration) {
        let first = self.samples == 0;
        self.latest = rtt;
        self.samples = self.samples.saturating_add(1);
        self.peak = self.peak.max(rtt);
        self.min_rtt = Some(self.min_rtt.map_or(rtt, |m| m.min(rtt)));
        match self.srtt.filter(|_| !first) {
            None => {
                self.srtt = Some(rtt);
                self.rttvar = rtt / 2;
            }
            Some(s) => {
                let err = s.abs_diff(rtt);
                self.rttvar = (self.rttvar * 3 + err) / 4;
                self.srtt = Some((s * 7 + rtt) / 8);
            }
        }
    }

    /// Smoothed RTT, once a sample exists.
    pub fn srtt(&self) -> Option<Duration> {
        self.srtt
    }

    /// Smallest RTT seen.
    pub fn min_rtt(&self) -> Option<Duration> {
        self.min_rtt
    }

    /// Latest sample.
    pub fn latest(&self) -> Duration {
        self.latest
    }

    /// RTT variance.
    pub fn rttvar(&self) -> Duration {
        self.rttvar
    }

    /// The retransmission timeout before backoff.
    pub fn rto(&self) -> Duration {
        match self.srtt {
            None => self.initial_rto,
            Some(s) => (s + self.rttvar * 4).clamp(self.min_rto, self.max_rto),
        }
    }

    /// Upper bound of the timeout, for backoff.
    pub fn max_rto(&self) -> Duration {
        self.max_rto
    }

    /// Lower bound of the timeout.
    pub fn min_rto(&self) -> Duration {
        self.min_rto
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn converges_and_clamps() {
        let mut r = RttEstimator::new(
            Duration::from_millis(1),
            Duration::from_micros(50),
            Duration::from_millis(10),
        );
        assert_eq!(r.rto(), Duration::from_millis(1));
        for _ in 0..50 {
            r.sample(Duration::from_micros(100));
        }
        let s = r.srtt().unwrap();
        assert!(s >= Duration::from_micros(99) && s <= Duration::from_micros(101));
        assert!(r.rto() >= Duration::from_micros(100) && r.rto() < Duration::from_micros(150));
        r.sample(Duration::from_secs(5));
        assert_eq!(r.rto(), Duration::from_millis(10));
        assert_eq!(r.min_rtt(), Some(Duration::from_micros(100)));
    }
}
