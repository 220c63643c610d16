//! The event queue: a binary heap keyed by `(time, sequence number)`.
//!
//! Ties in time are broken by insertion order, which makes the simulation
//! deterministic regardless of the heap's internal layout. Push and pop are
//! `O(log n)` in the number of pending events, so the total cost grows
//! linearly with the number of packets simulated.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use crate::time::Nanos;

/// `key` packs `(time, seq)` as `time << 64 | seq`, so one integer
/// comparison orders entries.
#[derive(Debug)]
struct Entry<E> {
    key: u128,
    event: E,
}

impl<E> PartialEq for Entry<E> {
    fn eq(&self, other: &Self) -> bool {
        self.key == other.key
    }
}
impl<E> Eq for Entry<E> {}
impl<E> PartialOrd for Entry<E> {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl<E> Ord for Entry<E> {
    fn cmp(&self, other: &Self) -> Ordering {
        // Reversed: BinaryHeap is a max-heap, we want the earliest first.
        other.key.cmp(&self.key)
    }
}

/// A deterministic priority queue of timed events.
#[derive(Debug)]
pub struct EventQueue<E> {
    heap: BinaryHeap<Entry<E>>,
    seq: u64,
}

impl<E> Default for EventQueue<E> {
    fn default() -> Self {
        EventQueue {
            heap: BinaryHeap::with_capacity(1024),
            seq: 0,
        }
    }
}

impl<E> EventQueue<E> {
    /// An empty queue.
    pub fn new() -> Self {
        Self::default()
    }

    /// Schedule `event` at `time`.
    pub fn push(&mut self, time: Nanos, event: E) {
        let seq = self.seq;
        self.seq += 1;
        self.heap.push(Entry {
            key: ((time as u128) << 64) | seq as u128,
            event,
        });
    }

    /// Remove and return the earliest event (first inserted among equals).
    pub fn pop(&mut self) -> Option<(Nanos, E)> {
        self.heap.pop().map(|e| ((e.key >> 64) as Nanos, e.event))
    }

    /// The time of the earliest pending event.
    pub fn peek_time(&self) -> Option<Nanos> {
        self.heap.peek().map(|e| (e.key >> 64) as Nanos)
    }

    /// Number of pending events.
    pub fn len(&self) -> usize {
        self.heap.len()
    }

    /// `true` when nothing is pending.
    pub fn is_empty(&self) -> bool {
        self.heap.is_empty()
    }

    /// Iterate over pending events in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = &E> {
        self.heap.iter().map(|e| &e.event)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn orders_by_time_then_insertion() {
        let mut q = EventQueue::new();
        q.push(5, 'a');
        q.push(3, 'b');
        q.push(5, 'c');
        q.push(3, 'd');
        q.push(0, 'e');
        let order: Vec<char> = std::iter::from_fn(|| q.pop().map(|(_, e)| e)).collect();
        assert_eq!(order, vec!['e', 'b', 'd', 'a', 'c']);
    }
}
