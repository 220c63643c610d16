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
    ) -> FlowId {
        self.flows.push(FlowRecord {
            src,
            dst,
            bytes,
            start,
            done: None,
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
        let f = t.add(0, 1, Some(300), 10);
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
        let f = t.add(0, 1, Some(400), 0);
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
        let f = t.add(0, 1, None, 0);
        for i in 0..10 {
            assert_eq!(
                t.delivered(f, i * 10, 10, true, i),
                DeliveryOutcome::Progress
            );
        }
        assert_eq!(t.intact_bytes, 100);
    }
}
