//! Run reports and their table rendering.

use std::fmt::Write as _;

use crate::topology::LinkKind;
use crate::transport::TransportStats;

/// Per-link counters at the end of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct LinkStat {
    /// Which link.
    pub kind: LinkKind,
    /// Packets offered to the link (tail drops and drops onto a failed
    /// link included).
    pub offered: u64,
    /// Packets that crossed it and reached the far end.
    pub carried: u64,
    /// Deepest queue of the port feeding it (0 for host NIC links).
    pub max_queue_bytes: u64,
}

/// Packet-level conservation counters: every packet a transport handed to
/// a NIC is delivered, dropped for one stated reason, or still in the
/// fabric (queued or on a wire) when the run ends.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct PacketCounters {
    /// Packets handed to host NICs.
    pub injected: u64,
    /// Packets handed to the destination host's transport.
    pub delivered: u64,
    /// Tail drops at full switch ports.
    pub dropped_tail: u64,
    /// Random loss on lossy links.
    pub dropped_loss: u64,
    /// Sent onto (or arriving over) a failed link.
    pub dropped_failed_link: u64,
    /// No routable spine for the destination.
    pub dropped_no_route: u64,
    /// Dropped on purpose by a `DropNth` fault.
    pub dropped_targeted: u64,
    /// Dropped by a silent blackhole (a `Blackhole` fault).
    pub dropped_blackhole: u64,
    /// Still queued in NICs/switches or on a wire at the end.
    pub in_flight: u64,
}

impl PacketCounters {
    /// All drops, whatever the reason.
    pub fn dropped(&self) -> u64 {
        self.dropped_tail
            + self.dropped_loss
            + self.dropped_failed_link
            + self.dropped_no_route
            + self.dropped_targeted
            + self.dropped_blackhole
    }

    /// `injected == delivered + dropped + in_flight`.
    pub fn is_conserved(&self) -> bool {
        self.injected == self.delivered + self.dropped() + self.in_flight
    }
}

/// The outcome of one run. Serialises to JSON with serde.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct SimReport {
    /// Transport name.
    pub transport: String,
    /// Traffic pattern.
    pub pattern: String,
    /// Number of hosts.
    pub hosts: u32,
    /// Spines per plane.
    pub spines: u32,
    /// Planes.
    pub planes: u32,
    /// NIC port rate in Gbit/s.
    pub link_gbps: f64,
    /// Configured random loss probability.
    pub loss: f64,
    /// Seed.
    pub seed: u64,
    /// Simulated time covered, in milliseconds (the configured duration,
    /// or less when finite traffic finished earlier).
    pub sim_ms: f64,
    /// Application bytes delivered intact (first copy only), in Gbit/s per
    /// receiving host.
    pub goodput_gbps: f64,
    /// `goodput_gbps` over a host's line rate (all planes).
    pub goodput_fraction: f64,
    /// Retransmitted data packets over all data packets sent.
    pub retransmit_fraction: f64,
    /// Median flow completion time (flow start to last byte delivered).
    pub fct_p50_us: Option<f64>,
    /// 99th-percentile flow completion time.
    pub fct_p99_us: Option<f64>,
    /// Slowest completed finite flow: bytes × 8 over its completion time,
    /// Gbit/s (`None`: no finite flow completed).
    pub flow_rate_min_gbps: Option<f64>,
    /// Mean rate of the completed finite flows, Gbit/s.
    pub flow_rate_mean_gbps: Option<f64>,
    /// Fastest completed finite flow, Gbit/s.
    pub flow_rate_max_gbps: Option<f64>,
    /// µs from the start of the run until every finite flow of the first
    /// round (those the pattern starts, not their closed-loop successors;
    /// every flow of an explicit list) completed; `None` if one did not.
    pub makespan_us: Option<f64>,
    /// Flows started.
    pub flows_started: u64,
    /// Finite flows whose every byte was delivered.
    pub flows_completed: u64,
    /// Completed incast rounds or all-reduce steps.
    pub steps_completed: u64,
    /// Median round/step time.
    pub step_p50_us: Option<f64>,
    /// 99th-percentile round/step time.
    pub step_p99_us: Option<f64>,
    /// Deepest switch port queue seen.
    pub max_queue_bytes: u64,
    /// CE-marked among ECN-capable packets delivered.
    pub ecn_marked_fraction: f64,
    /// Application bytes lost: given up by the transport, delivered
    /// corrupted, or delivered out of order by a transport promising order.
    /// Must be 0 for a reliable transport.
    pub bytes_lost: u64,
    /// Of `bytes_lost`: bytes the transport abandoned.
    pub bytes_abandoned: u64,
    /// Of `bytes_lost`: bytes delivered corrupted.
    pub bytes_corrupted: u64,
    /// Of `bytes_lost`: bytes delivered out of order despite an in-order
    /// promise.
    pub bytes_misordered: u64,
    /// Bytes delivered again after a first intact copy (not goodput).
    pub bytes_duplicate: u64,
    /// Transport counters summed over hosts.
    pub transport_stats: TransportStats,
    /// Packet conservation counters.
    pub packets: PacketCounters,
    /// Events processed.
    pub events: u64,
    /// Events per wall-clock second.
    pub events_per_s: f64,
    /// Wall-clock seconds the run took (the only non-deterministic field,
    /// with `events_per_s`).
    pub wall_s: f64,
    /// Width of a time-series bin, µs ([`crate::SimConfig::bin_ns`]).
    pub bin_us: f64,
    /// Goodput per bin, Gbit/s per receiving host (see [`crate::series`]).
    pub goodput_series_gbps: Vec<f64>,
    /// With a fault that fails, blackholes or degrades links: µs from the
    /// first such fault until goodput,
    /// averaged over [`crate::series::RECOVERY_HOLD_BINS`] bins, is back at
    /// [`crate::series::RECOVERY_FRACTION`] of the line rate (`None`: never).
    pub recovery_us: Option<f64>,
    /// With a fault that fails, blackholes or degrades links: mean goodput
    /// per receiving host from the first such fault to the end, Gbit/s.
    pub goodput_after_fault_gbps: Option<f64>,
    /// Jain's index over the bytes delivered from each sending host.
    pub jain_fairness: Option<f64>,
    /// Incast: wire bytes the receiver's downlink carried over its capacity.
    pub receiver_utilization: Option<f64>,
    /// Incast: deepest queue of the receiver's downlink port.
    pub receiver_max_queue_bytes: Option<u64>,
    /// Incast: µs from the start until every sender is within ±10% of its
    /// fair share (see [`crate::series`]; `None`: never).
    pub convergence_us: Option<f64>,
    /// Incast: the window over which `convergence_us` measures rates.
    pub convergence_window_us: Option<f64>,
    /// The metaroce core's own counters (metaroce runs only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metaroce: Option<crate::metaroce::MetaroceSummary>,
    /// Per-link counters, in [`crate::topology::Fabric`] link order (not
    /// serialised: they are large; use [`SimReport::spine_load`] for a
    /// summary).
    #[serde(skip)]
    pub links: Vec<LinkStat>,
}

impl SimReport {
    /// Packets carried by each spine (over its incoming leaf→spine links),
    /// indexed `plane * spines + spine`.
    pub fn spine_load(&self) -> Vec<u64> {
        let mut load = vec![0; (self.planes * self.spines) as usize];
        for l in &self.links {
            if let LinkKind::LeafUp { plane, spine, .. } = l.kind {
                load[(plane as u32 * self.spines + spine) as usize] += l.carried;
            }
        }
        load
    }

    /// A copy with the wall-clock fields zeroed, for comparing runs.
    pub fn without_wall_clock(&self) -> SimReport {
        SimReport {
            wall_s: 0.0,
            events_per_s: 0.0,
            ..self.clone()
        }
    }
}

/// Percentile (nearest rank) of `values` in microseconds, or `None` if
/// empty. `values` is sorted in place.
pub(crate) fn percentile_us(values: &mut [u64], pct: f64) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    values.sort_unstable();
    let rank = ((pct / 100.0) * values.len() as f64).ceil() as usize;
    let idx = rank.clamp(1, values.len()) - 1;
    Some(values[idx] as f64 / 1_000.0)
}

fn opt(v: Option<f64>) -> String {
    v.map_or_else(|| "-".to_owned(), |x| format!("{x:.1}"))
}

/// Render reports as a plain-text table, one row per run.
///
/// A sweep renders as one table with a row per transport and loss rate.
pub fn render_table(reports: &[SimReport]) -> String {
    let header = [
        "transport",
        "pattern",
        "hosts",
        "loss",
        "goodput Gb/s",
        "of line",
        "retx",
        "fct p50 us",
        "fct p99 us",
        "flow Gb/s min/mean/max",
        "makespan us",
        "max queue KB",
        "ECN CE",
        "lost B",
        "drops",
        "events",
        "Mev/s",
        "wall s",
    ];
    let rows: Vec<Vec<String>> = reports
        .iter()
        .map(|r| {
            vec![
                r.transport.clone(),
                r.pattern.clone(),
                r.hosts.to_string(),
                format!("{}", r.loss),
                format!("{:.2}", r.goodput_gbps),
                format!("{:.1}%", 100.0 * r.goodput_fraction),
                format!("{:.2}%", 100.0 * r.retransmit_fraction),
                opt(r.fct_p50_us),
                opt(r.fct_p99_us),
                match (
                    r.flow_rate_min_gbps,
                    r.flow_rate_mean_gbps,
                    r.flow_rate_max_gbps,
                ) {
                    (Some(a), Some(b), Some(c)) => format!("{a:.2}/{b:.2}/{c:.2}"),
                    _ => "-".to_owned(),
                },
                opt(r.makespan_us),
                format!("{:.1}", r.max_queue_bytes as f64 / 1_000.0),
                format!("{:.2}%", 100.0 * r.ecn_marked_fraction),
                r.bytes_lost.to_string(),
                r.packets.dropped().to_string(),
                r.events.to_string(),
                format!("{:.1}", r.events_per_s / 1e6),
                format!("{:.2}", r.wall_s),
            ]
        })
        .collect();
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.len());
        }
    }
    let mut out = String::new();
    let line = |out: &mut String, cells: &[String]| {
        for (i, (c, w)) in cells.iter().zip(&widths).enumerate() {
            if i == 0 || i == 1 {
                let _ = write!(out, "{c:<w$}  ");
            } else {
                let _ = write!(out, "{c:>w$}  ");
            }
        }
        out.truncate(out.trim_end().len());
        out.push('\n');
    };
    line(
        &mut out,
        &header.iter().map(|h| h.to_string()).collect::<Vec<_>>(),
    );
    let total: usize = widths.iter().sum::<usize>() + 2 * (widths.len() - 1);
    out.push_str(&"-".repeat(total));
    out.push('\n');
    for row in &rows {
        line(&mut out, row);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles() {
        let mut v = vec![5_000, 1_000, 3_000, 2_000, 4_000];
        assert_eq!(percentile_us(&mut v, 50.0), Some(3.0));
        assert_eq!(percentile_us(&mut v, 99.0), Some(5.0));
        assert_eq!(percentile_us(&mut [], 50.0), None);
    }
}
