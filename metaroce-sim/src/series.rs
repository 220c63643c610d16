//! Time series of a run and the metrics derived from them: goodput in fixed
//! bins, recovery after a failure, and for incast the receiver's link
//! utilisation, fairness and convergence.
//!
//! Definitions (all computed from integer counters, so deterministic):
//!
//! - **Goodput series**: application bytes delivered intact (first copy) in
//!   each bin of [`SimConfig::bin_ns`](crate::SimConfig::bin_ns), over all
//!   hosts, in Gbit/s per receiving host. A bin covers `[b·bin, (b+1)·bin)`;
//!   the last one may be shorter (it is divided by its real width). For
//!   metaroce a delivery is a completed WRITE, so bins shorter than a few
//!   WRITE times per host are lumpy.
//! - **Recovery** (`recovery_us`, runs with a `Fail` fault): from the first
//!   failure's start time to the start of the first bin at or after it from
//!   which goodput, averaged over [`RECOVERY_HOLD_BINS`] bins, is at or
//!   above [`RECOVERY_FRACTION`] of the line rate. 0 means goodput never
//!   left the band (at that resolution); `None`, it never got back. metaroce
//!   delivers a WRITE at its completion, so a bin holds whole WRITEs: use
//!   bins of several WRITE times per host (e.g. 64 KiB WRITEs, 20 µs bins)
//!   for a smooth series.
//! - **Jain fairness** (`jain_fairness`): `(Σx)² / (n·Σx²)` over the intact
//!   bytes delivered from each host that started a flow (whole run).
//! - **Incast** (pattern `incast:K`, receiver host 0):
//!   `receiver_utilization` is the wire bytes (headers included) the
//!   receiver's downlink delivered over its capacity for the whole run;
//!   `receiver_max_queue_bytes` is the deepest queue of that port.
//!   `convergence_us` is the end of the first window after the start in
//!   which every sender's arrival rate at the receiver (wire bytes) is within
//!   ±[`CONVERGENCE_TOLERANCE`] of the fair share (line rate / K) and stays
//!   so for [`CONVERGENCE_HOLD`] windows, each shifted by one bin. A window
//!   is the shortest whole number of bins in which a sender at fair share
//!   delivers [`CONVERGENCE_PACKETS`] full packets (so that ±10% is
//!   resolvable at packet granularity); it is reported as
//!   `convergence_window_us` and bounds the smallest value
//!   `convergence_us` can take.

use crate::packet::HostId;
use crate::time::Nanos;

/// Share of the line rate goodput must reach again after a failure.
pub const RECOVERY_FRACTION: f64 = 0.85;
/// Consecutive bins goodput must stay at or above it.
pub const RECOVERY_HOLD_BINS: usize = 5;
/// Allowed deviation of a sender's rate from its fair share.
pub const CONVERGENCE_TOLERANCE: f64 = 0.10;
/// Consecutive (sliding) windows in which every sender must be within it.
pub const CONVERGENCE_HOLD: usize = 5;
/// Packets at fair share a convergence window must hold.
pub const CONVERGENCE_PACKETS: u64 = 10;

/// Per-sender wire arrivals at the incast receiver.
#[derive(Debug)]
struct IncastRec {
    receiver: HostId,
    /// Sender index by host (`u32::MAX`: not a sender).
    index: Vec<u32>,
    /// `[sender][bin]` wire bytes delivered to the receiver.
    arrivals: Vec<Vec<u64>>,
    /// All wire bytes delivered to the receiver.
    total: u64,
}

/// Counters recorded during a run.
#[derive(Debug)]
pub(crate) struct Timeline {
    bin_ns: Nanos,
    duration_ns: Nanos,
    goodput: Vec<u64>,
    sender_bytes: Vec<u64>,
    is_sender: Vec<bool>,
    incast: Option<IncastRec>,
}

impl Timeline {
    pub(crate) fn new(hosts: u32, bin_ns: Nanos, duration_ns: Nanos) -> Self {
        let bin_ns = bin_ns.max(1);
        let bins = duration_ns.div_ceil(bin_ns).max(1) as usize;
        Timeline {
            bin_ns,
            duration_ns,
            goodput: vec![0; bins],
            sender_bytes: vec![0; hosts as usize],
            is_sender: vec![false; hosts as usize],
            incast: None,
        }
    }

    /// Track per-sender arrivals at `receiver` from `senders`.
    pub(crate) fn track_incast(&mut self, receiver: HostId, senders: &[HostId]) {
        let mut index = vec![u32::MAX; self.sender_bytes.len()];
        for (i, &s) in senders.iter().enumerate() {
            index[s as usize] = i as u32;
        }
        self.incast = Some(IncastRec {
            receiver,
            index,
            arrivals: vec![vec![0; self.goodput.len()]; senders.len()],
            total: 0,
        });
    }

    fn bin(&self, now: Nanos) -> usize {
        ((now / self.bin_ns) as usize).min(self.goodput.len() - 1)
    }

    pub(crate) fn flow_started(&mut self, src: HostId) {
        self.is_sender[src as usize] = true;
    }

    /// `bytes` of application data from `src` were delivered intact at `now`.
    pub(crate) fn delivered(&mut self, now: Nanos, src: HostId, bytes: u64) {
        let b = self.bin(now);
        self.goodput[b] += bytes;
        self.sender_bytes[src as usize] += bytes;
    }

    /// A packet of `size` wire bytes from `src` reached host `dst` at `now`.
    pub(crate) fn arrived(&mut self, now: Nanos, src: HostId, dst: HostId, size: u32) {
        let b = self.bin(now);
        if let Some(rec) = &mut self.incast {
            if rec.receiver == dst {
                rec.total += size as u64;
                let i = rec.index[src as usize];
                if i != u32::MAX {
                    rec.arrivals[i as usize][b] += size as u64;
                }
            }
        }
    }

    /// Width of bin `b` within a run of `sim_ns`.
    fn width(&self, b: usize, sim_ns: Nanos) -> Nanos {
        let start = b as u64 * self.bin_ns;
        let end = ((b as u64 + 1) * self.bin_ns).min(sim_ns.max(start));
        end - start
    }

    /// Goodput per bin in Gbit/s per receiving host, up to `sim_ns`.
    pub(crate) fn goodput_series(&self, sim_ns: Nanos, receivers: f64) -> Vec<f64> {
        let bins = sim_ns.min(self.duration_ns).div_ceil(self.bin_ns) as usize;
        (0..bins.min(self.goodput.len()))
            .map(|b| {
                let w = self.width(b, sim_ns);
                if w == 0 {
                    0.0
                } else {
                    self.goodput[b] as f64 * 8.0 / w as f64 / receivers
                }
            })
            .collect()
    }

    /// Jain's index over the bytes of every host that started a flow.
    pub(crate) fn jain_fairness(&self) -> Option<f64> {
        let x: Vec<f64> = self
            .sender_bytes
            .iter()
            .zip(&self.is_sender)
            .filter(|(_, &s)| s)
            .map(|(&b, _)| b as f64)
            .collect();
        jain(&x)
    }

    /// Incast metrics: utilisation, convergence and its window, if tracked.
    pub(crate) fn incast_metrics(
        &self,
        sim_ns: Nanos,
        link_gbps: f64,
        packet_bytes: u64,
    ) -> Option<IncastMetrics> {
        let rec = self.incast.as_ref()?;
        let k = rec.arrivals.len().max(1) as f64;
        let utilization = if sim_ns == 0 {
            0.0
        } else {
            rec.total as f64 * 8.0 / (sim_ns as f64 * link_gbps)
        };
        // Fair share in bytes per ns; window: CONVERGENCE_PACKETS packets at it.
        let fair = link_gbps / 8.0 / k;
        let window_ns = (CONVERGENCE_PACKETS * packet_bytes) as f64 / fair;
        let w = ((window_ns / self.bin_ns as f64).ceil() as usize).max(1);
        let full_bins = (sim_ns.min(self.duration_ns) / self.bin_ns) as usize;
        let convergence = convergence_end(
            &rec.arrivals,
            full_bins,
            w,
            fair * (w as u64 * self.bin_ns) as f64,
        )
        .map(|end| end as u64 * self.bin_ns);
        Some(IncastMetrics {
            utilization,
            convergence_ns: convergence,
            window_ns: w as u64 * self.bin_ns,
        })
    }
}

/// What [`Timeline::incast_metrics`] computes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct IncastMetrics {
    pub utilization: f64,
    pub convergence_ns: Option<Nanos>,
    pub window_ns: Nanos,
}

/// Jain's fairness index of `x` (`None` if empty or all zero).
pub fn jain(x: &[f64]) -> Option<f64> {
    let sum: f64 = x.iter().sum();
    let sq: f64 = x.iter().map(|v| v * v).sum();
    if x.is_empty() || sq == 0.0 {
        return None;
    }
    Some(sum * sum / (x.len() as f64 * sq))
}

/// The first window end (in bins) from which [`CONVERGENCE_HOLD`]
/// consecutive windows of `w` bins have every series within
/// ±[`CONVERGENCE_TOLERANCE`] of `fair_bytes` (bytes per window). Only the
/// first `bins` bins count (full bins).
pub fn convergence_end(
    series: &[Vec<u64>],
    bins: usize,
    w: usize,
    fair_bytes: f64,
) -> Option<usize> {
    if series.is_empty() || bins < w {
        return None;
    }
    let lo = fair_bytes * (1.0 - CONVERGENCE_TOLERANCE);
    let hi = fair_bytes * (1.0 + CONVERGENCE_TOLERANCE);
    let prefix: Vec<Vec<u64>> = series
        .iter()
        .map(|s| {
            let mut p = Vec::with_capacity(bins + 1);
            p.push(0);
            for &v in &s[..bins] {
                p.push(p.last().unwrap() + v);
            }
            p
        })
        .collect();
    let ok = |end: usize| {
        prefix.iter().all(|p| {
            let v = (p[end] - p[end - w]) as f64;
            (lo..=hi).contains(&v)
        })
    };
    let mut run = 0;
    for end in w..=bins {
        if ok(end) {
            run += 1;
            if run == CONVERGENCE_HOLD {
                return Some(end + 1 - CONVERGENCE_HOLD);
            }
        } else {
            run = 0;
        }
    }
    None
}

/// Time from `fail_ns` to the start of the first bin at or after it from
/// which the mean goodput over [`RECOVERY_HOLD_BINS`] bins is at or above
/// `threshold_gbps` (a mean, because WRITE completions make single bins
/// lumpy).
pub fn recovery_ns(
    series: &[f64],
    bin_ns: Nanos,
    fail_ns: Nanos,
    threshold_gbps: f64,
) -> Option<Nanos> {
    let first = fail_ns.div_ceil(bin_ns.max(1)) as usize;
    let h = RECOVERY_HOLD_BINS;
    (first..series.len().saturating_sub(h - 1))
        .find(|&b| series[b..b + h].iter().sum::<f64>() / h as f64 >= threshold_gbps)
        .map(|b| b as u64 * bin_ns - fail_ns)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jain_index() {
        assert_eq!(jain(&[1.0, 1.0, 1.0]), Some(1.0));
        assert!((jain(&[1.0, 0.0]).unwrap() - 0.5).abs() < 1e-12);
        assert_eq!(jain(&[]), None);
    }

    #[test]
    fn recovery_needs_a_held_band() {
        let s = [
            90.0, 90.0, 10.0, 80.0, 90.0, 90.0, 50.0, 90.0, 90.0, 90.0, 90.0, 80.0,
        ];
        // Failure at 15 ns with 10 ns bins: first bin considered is 2; the
        // first 5-bin window with a mean of at least 85 starts at bin 7.
        assert_eq!(recovery_ns(&s, 10, 15, 85.0), Some(70 - 15));
        assert_eq!(recovery_ns(&s, 10, 0, 85.0), Some(70));
        assert_eq!(recovery_ns(&s[..11], 10, 15, 85.0), None);
        let flat = [90.0; 8];
        assert_eq!(recovery_ns(&flat, 10, 20, 85.0), Some(0));
    }

    #[test]
    fn convergence_of_two_senders() {
        // Windows of 2 bins, fair 10 bytes per window.
        let a = vec![0, 20, 5, 5, 5, 5, 5, 5, 5, 5];
        let b = vec![20, 0, 5, 5, 5, 5, 5, 5, 5, 5];
        // Window ending at bin 4 ([2,4)) is the first fair one.
        assert_eq!(
            convergence_end(&[a.clone(), b.clone()], 10, 2, 10.0),
            Some(4)
        );
        assert_eq!(convergence_end(&[a, b], 7, 2, 10.0), None);
    }
}
