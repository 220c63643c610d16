//! Application-level accounting of flows: which bytes arrived intact,
//! which twice, which out of promised order, and when each flow completed.

use crate::packet::{FlowId, HostId};
use crate::time::Nanos;

/// Outcome of recording one delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DeliveryOutcome {
    /// Recorded; the flow is not complete (or is infinite).
    Progress,
    /// This delivery completed the flow.
    Completed,
}

/// State of one flow.
#[derive(Debug, Clone)]
pub(crate) struct FlowRecord {
    pub src: HostId,
    pub dst: HostId,
    pub bytes: Option<u64>,
    pub start: Nanos,
    pub done: Option<Nanos>,
    /// Launched by the traffic pattern's first round (at the start of the
    /// run, or at its own start time for an explicit flow list), not as a
    /// closed-loop successor of a completed flow.
    pub first_round: bool,
    /// Every byte below this offset arrived intact.
    contiguous: u64,
    /// Sorted, disjoint `[start, end)` ranges above `contiguous`.
    islands: Vec<(u64, u64)>,
}

/// All flows of a run and the byte counters derived from deliveries.
#[derive(Debug, Default)]
pub(crate) struct FlowTable {
    flows: Vec<FlowRecord>,
    pub intact_bytes: u64,
    pub duplicate_bytes: u64,
    pub misordered_bytes: u64,
    pub corrupted_bytes: u64,
    pub abandoned_bytes: u64,
    pub completed: u64,
    /// Completion times of finished flows.
    pub fcts: Vec<Nanos>,
}

impl FlowTable {
    pub(crate) fn add(
        &mut self,
        src: HostId,
        dst: HostId,
        bytes: Option<u64>,
        start: Nanos,
        first_round: bool,
    ) -> FlowId {
        self.flows.push(FlowRecord {
            src,
            dst,
            bytes,
            start,
            done: None,
            first_round,
            contiguous: 0,
            islands: Vec::new(),
        });
        (self.flows.len() - 1) as FlowId
    }

    pub(crate) fn get(&self, flow: FlowId) -> &FlowRecord {
        &self.flows[flow as usize]
    }

    pub(crate) fn len(&self) -> usize {
        self.flows.len()
    }

    /// Rates of the completed finite flows, in Gbit/s (bytes × 8 over the
    /// time from start to last byte delivered): `(min, mean, max)`, or
    /// `None` when no finite flow completed.
    pub(crate) fn rate_stats(&self) -> Option<(f64, f64, f64)> {
        let rates = self.flows.iter().filter_map(|f| {
            let (bytes, done) = (f.bytes?, f.done?);
            Some(bytes as f64 * 8.0 / (done - f.start).max(1) as f64)
        });
        let (mut n, mut sum, mut min, mut max) = (0u64, 0.0, f64::INFINITY, 0.0f64);
        for r in rates {
            n += 1;
            sum += r;
            min = min.min(r);
            max = max.max(r);
        }
        (n > 0).then(|| (min, sum / n as f64, max))
    }

    /// When the last finite flow of the first round completed (time from
    /// the start of the run), or `None` if one has not (or there is none).
    /// A collective finishes with its slowest flow.
    pub(crate) fn makespan(&self) -> Option<Nanos> {
        let mut last = None;
        for f in self
            .flows
            .iter()
            .filter(|f| f.first_round && f.bytes.is_some())
        {
            let done = f.done?;
            last = Some(last.map_or(done, |l: Nanos| l.max(done)));
        }
        last
    }

    /// Record that `len` bytes at `offset` of `flow` reached the
    /// application at `now`. With `in_order`, a delivery that does not
    /// start at the first missing byte is a violation of the promise.
    pub(crate) fn delivered(
        &mut self,
        flow: FlowId,
        offset: u64,
        len: u32,
        in_order: bool,
        now: Nanos,
    ) -> DeliveryOutcome {
        let Some(rec) = self.flows.get_mut(flow as usize) else {
            return DeliveryOutcome::Progress;
        };
        let mut a = offset;
        let mut b = offset + len as u64;
        if let Some(size) = rec.bytes {
            b = b.min(size);
        }
        if a >= b {
            return DeliveryOutcome::Progress;
        }
        if a < rec.contiguous {
            let dup = b.min(rec.contiguous) - a;
            self.duplicate_bytes += dup;
            a += dup;
            if a >= b {
                return DeliveryOutcome::Progress;
            }
        }
        if in_order && a != rec.contiguous {
            self.misordered_bytes += b - a;
            return DeliveryOutcome::Progress;
        }
        // Merge [a, b) into the islands, counting overlap as duplicate.
        let mut new_start = a;
        let mut new_end = b;
        let mut covered = 0;
        rec.islands.retain(|&(s, e)| {
            if e < a || s > b {
                return true;
            }
            covered += e.min(b).saturating_sub(s.max(a));
            new_start = new_start.min(s);
            new_end = new_end.max(e);
            false
        });
        let pos = rec.islands.partition_point(|&(s, _)| s < new_start);
        rec.islands.insert(pos, (new_start, new_end));
        self.duplicate_bytes += covered;
        self.intact_bytes += (b - a) - covered;
        if rec.islands[0].0 == rec.contiguous {
            rec.contiguous = rec.islands.remove(0).1;
        }
        if rec.done.is_none() && rec.bytes == Some(rec.contiguous) {
            rec.done = Some(now);
            self.completed += 1;
            self.fcts.push(now - rec.start);
            return DeliveryOutcome::Completed;
        }
        DeliveryOutcome::Progress
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_order_accounting() {
        let mut t = FlowTable::default();
        let f = t.add(0, 1, Some(300), 10, true);
        assert_eq!(t.delivered(f, 0, 100, true, 20), DeliveryOutcome::Progress);
        assert_eq!(
            t.delivered(f, 200, 100, true, 30),
            DeliveryOutcome::Progress
        );
        assert_eq!(t.misordered_bytes, 100);
        assert_eq!(t.delivered(f, 50, 100, true, 40), DeliveryOutcome::Progress);
        assert_eq!(t.duplicate_bytes, 50);
        assert_eq!(
            t.delivered(f, 150, 150, true, 50),
            DeliveryOutcome::Completed
        );
        assert_eq!(t.intact_bytes, 300);
        assert_eq!(t.fcts, vec![40]);
        assert_eq!(t.delivered(f, 0, 300, true, 60), DeliveryOutcome::Progress);
        assert_eq!(t.completed, 1);
    }

    #[test]
    fn placement_accounting() {
        let mut t = FlowTable::default();
        let f = t.add(0, 1, Some(400), 0, true);
        t.delivered(f, 300, 100, false, 1);
        t.delivered(f, 100, 100, false, 2);
        t.delivered(f, 150, 100, false, 3);
        assert_eq!(t.duplicate_bytes, 50);
        assert_eq!(t.intact_bytes, 250);
        assert_eq!(t.delivered(f, 0, 100, false, 4), DeliveryOutcome::Progress);
        assert_eq!(
            t.delivered(f, 250, 50, false, 5),
            DeliveryOutcome::Completed
        );
        assert_eq!(t.intact_bytes, 400);
        assert_eq!(t.misordered_bytes, 0);
    }

    #[test]
    fn infinite_flows_never_complete() {
        let mut t = FlowTable::default();
        let f = t.add(0, 1, None, 0, true);
        for i in 0..10 {
            assert_eq!(
                t.delivered(f, i * 10, 10, true, i),
                DeliveryOutcome::Progress
            );
        }
        assert_eq!(t.intact_bytes, 100);
        assert_eq!(t.rate_stats(), None);
        assert_eq!(t.makespan(), None, "no finite flow");
    }

    #[test]
    fn rate_stats_and_makespan() {
        let mut t = FlowTable::default();
        // 1,000 B in 800 ns (10 Gbit/s) and in 400 ns (20 Gbit/s).
        let a = t.add(0, 1, Some(1_000), 0, true);
        let b = t.add(2, 3, Some(1_000), 100, true);
        t.delivered(b, 0, 1_000, true, 500);
        assert_eq!(t.makespan(), None, "flow a is not done");
        t.delivered(a, 0, 1_000, true, 800);
        assert_eq!(t.makespan(), Some(800));
        // A later round's flow counts in the rates, not in the makespan.
        let c = t.add(0, 1, Some(2_000), 800, false);
        t.delivered(c, 0, 2_000, true, 2_400);
        assert_eq!(t.rate_stats(), Some((10.0, 40.0 / 3.0, 20.0)));
        assert_eq!(t.makespan(), Some(800));
        t.add(2, 3, Some(1_000), 900, false);
        assert_eq!(t.makespan(), Some(800));
    }
}
