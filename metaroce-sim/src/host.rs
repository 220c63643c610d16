//! Host-side NIC state: one output port per plane.
//!
//! The NIC pulls packets from the transport only when a port is idle, so it
//! serialises at line rate without an unbounded queue. A packet the
//! transport hands over for a busy port waits in that port's small queue.

use std::collections::VecDeque;

use crate::time::Nanos;

/// One NIC port (one plane).
#[derive(Debug, Default)]
pub(crate) struct NicPort {
    /// Picosecond instant the last packet's last bit leaves the port.
    pub free_at_ps: u64,
    /// A packet is being serialised (a `NicFree` event is pending).
    pub busy: bool,
    /// Packets handed over while the port was busy (slab indices).
    pub pending: VecDeque<u32>,
}

impl NicPort {
    /// Ready for the transport to fill.
    pub fn is_idle(&self) -> bool {
        !self.busy && self.pending.is_empty()
    }

    /// When serialisation of a packet handed over at `now_ps` starts:
    /// right after the previous packet if the port has just become free
    /// (within the current nanosecond), else now.
    pub fn start_ps(&self, now_ps: u64) -> u64 {
        if now_ps < self.free_at_ps + 1_000 {
            self.free_at_ps.max(now_ps.saturating_sub(999))
        } else {
            now_ps
        }
    }
}

/// A host: its transport, NIC ports and timer bookkeeping.
#[derive(Debug)]
pub(crate) struct Host<T> {
    pub transport: T,
    pub ports: Vec<NicPort>,
    /// Earliest pending `Timer` event for this host, if any.
    pub timer_pending: Option<Nanos>,
    /// Queued for servicing after the current event.
    pub dirty: bool,
    /// In a stall (see [`crate::stalls`]): the transport is not called.
    pub stalled: bool,
    /// Packets that reached the host during the stall (slab indices), in
    /// arrival order.
    pub held: VecDeque<u32>,
}

impl<T> Host<T> {
    pub(crate) fn new(transport: T, planes: u32) -> Self {
        Host {
            transport,
            ports: (0..planes).map(|_| NicPort::default()).collect(),
            timer_pending: None,
            dirty: false,
            stalled: false,
            held: VecDeque::new(),
        }
    }

    /// Bit mask of idle ports.
    pub(crate) fn idle_mask(&self) -> u64 {
        self.ports
            .iter()
            .enumerate()
            .filter(|(_, p)| p.is_idle())
            .fold(0, |m, (i, _)| m | (1 << i))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn back_to_back_start_is_exact() {
        let p = NicPort {
            free_at_ps: 332_320,
            busy: false,
            pending: VecDeque::new(),
        };
        // The NicFree event fires at 333 ns: continue exactly where we were.
        assert_eq!(p.start_ps(333_000), 332_320);
        // Long idle: start now.
        assert_eq!(p.start_ps(400_000), 400_000);
    }
}
