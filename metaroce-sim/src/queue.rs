//! Output-queued switch ports: FIFO, finite buffer, tail drop, ECN marking.
//!
//! A port serves packets first-in first-out at a fixed rate and never
//! preempts, so a packet's departure time is known the moment it is
//! admitted. The queue therefore stores only `(departure end, size)` pairs
//! and drains them lazily; no event is needed when a packet leaves the port.
//! A packet occupies the buffer from admission until its last bit has been
//! serialised.

use std::collections::VecDeque;

/// What happened to a packet offered to a port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Queued; serialisation ends at `end_ps`. `mark_ce` asks the caller to
    /// set CE on the (ECN-capable) packet.
    Accepted {
        /// Picosecond instant at which the last bit leaves the port.
        end_ps: u64,
        /// The queue exceeded the ECN threshold at admission.
        mark_ce: bool,
    },
    /// The buffer had no room: tail drop.
    TailDrop,
}

/// One output port's queue.
#[derive(Debug, Clone)]
pub struct PortQueue {
    backlog: VecDeque<(u64, u32)>,
    bytes: u64,
    free_at_ps: u64,
    capacity: u64,
    ecn_threshold: u64,
    max_bytes: u64,
}

impl PortQueue {
    /// A port with `capacity` bytes of buffer that marks ECN-capable
    /// packets CE when more than `ecn_threshold` bytes are queued ahead of
    /// them (DCTCP-style instantaneous marking).
    pub fn new(capacity: u64, ecn_threshold: u64) -> Self {
        PortQueue {
            backlog: VecDeque::new(),
            bytes: 0,
            free_at_ps: 0,
            capacity,
            ecn_threshold,
            max_bytes: 0,
        }
    }

    fn drain(&mut self, now_ps: u64) {
        while let Some(&(end, size)) = self.backlog.front() {
            if end > now_ps {
                break;
            }
            self.bytes -= size as u64;
            self.backlog.pop_front();
        }
    }

    /// Offer a packet of `size` bytes at `now_ps`, to be serialised at
    /// `ps_per_byte`.
    pub fn enqueue(
        &mut self,
        now_ps: u64,
        size: u32,
        ecn_capable: bool,
        ps_per_byte: u64,
    ) -> Admission {
        self.drain(now_ps);
        if self.bytes + size as u64 > self.capacity {
            return Admission::TailDrop;
        }
        let mark_ce = ecn_capable && self.bytes > self.ecn_threshold;
        let start = self.free_at_ps.max(now_ps);
        let end = start + size as u64 * ps_per_byte;
        self.free_at_ps = end;
        self.bytes += size as u64;
        self.max_bytes = self.max_bytes.max(self.bytes);
        self.backlog.push_back((end, size));
        Admission::Accepted {
            end_ps: end,
            mark_ce,
        }
    }

    /// Bytes buffered at `now_ps` (including the packet being serialised).
    pub fn bytes_at(&mut self, now_ps: u64) -> u64 {
        self.drain(now_ps);
        self.bytes
    }

    /// The largest occupancy seen, in bytes.
    pub fn max_bytes(&self) -> u64 {
        self.max_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serialises_back_to_back() {
        let mut q = PortQueue::new(10_000, 5_000);
        let a = q.enqueue(0, 1000, true, 80);
        let b = q.enqueue(0, 1000, true, 80);
        assert_eq!(
            a,
            Admission::Accepted {
                end_ps: 80_000,
                mark_ce: false
            }
        );
        assert_eq!(
            b,
            Admission::Accepted {
                end_ps: 160_000,
                mark_ce: false
            }
        );
        assert_eq!(q.bytes_at(80_000), 1000);
        assert_eq!(q.bytes_at(160_000), 0);
        // An idle port starts at once.
        let c = q.enqueue(1_000_000, 500, false, 80);
        assert_eq!(
            c,
            Admission::Accepted {
                end_ps: 1_040_000,
                mark_ce: false
            }
        );
    }

    #[test]
    fn ecn_threshold_marks_only_capable_packets_above_k() {
        let mut q = PortQueue::new(100_000, 2_500);
        let mut marks = Vec::new();
        for _ in 0..5 {
            match q.enqueue(0, 1000, true, 80) {
                Admission::Accepted { mark_ce, .. } => marks.push(mark_ce),
                Admission::TailDrop => panic!(),
            }
        }
        // Queue ahead: 0, 1000, 2000, 3000, 4000 bytes; K = 2500.
        assert_eq!(marks, vec![false, false, false, true, true]);
        match q.enqueue(0, 1000, false, 80) {
            Admission::Accepted { mark_ce, .. } => assert!(!mark_ce),
            Admission::TailDrop => panic!(),
        }
    }

    #[test]
    fn tail_drops_when_full_and_recovers() {
        let mut q = PortQueue::new(3_000, u64::MAX);
        assert!(matches!(
            q.enqueue(0, 1000, false, 80),
            Admission::Accepted { .. }
        ));
        assert!(matches!(
            q.enqueue(0, 1000, false, 80),
            Admission::Accepted { .. }
        ));
        assert!(matches!(
            q.enqueue(0, 1000, false, 80),
            Admission::Accepted { .. }
        ));
        assert_eq!(q.enqueue(0, 1, false, 80), Admission::TailDrop);
        assert_eq!(q.max_bytes(), 3_000);
        // After the first packet left there is room again.
        assert!(matches!(
            q.enqueue(80_000, 1000, false, 80),
            Admission::Accepted {
                end_ps: 320_000,
                ..
            }
        ));
    }
}
