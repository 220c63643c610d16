//! Completion queues.

use super::WorkCompletion;
use std::collections::VecDeque;

/// A completion queue: work completions in the order they were generated.
///
/// It never drops a completion. When more than `capacity` are waiting the
/// queue is marked overrun (reported once as an event), like `IBV_EVENT_CQ_ERR`,
/// but the completions are kept.
#[derive(Debug)]
pub(crate) struct CompletionQueue {
    pub(crate) entries: VecDeque<WorkCompletion>,
    pub(crate) capacity: usize,
    pub(crate) overrun_reported: bool,
    /// Not destroyed: its slot may be taken by a new queue otherwise.
    pub(crate) live: bool,
}

impl CompletionQueue {
    pub(crate) fn new(capacity: usize) -> Self {
        CompletionQueue {
            entries: VecDeque::new(),
            capacity: capacity.max(1),
            overrun_reported: false,
            live: true,
        }
    }

    /// Adds a completion; returns true when this push overran the capacity
    /// for the first time. A destroyed queue takes none.
    pub(crate) fn push(&mut self, wc: WorkCompletion) -> bool {
        if !self.live {
            return false;
        }
        self.entries.push_back(wc);
        if self.entries.len() > self.capacity && !self.overrun_reported {
            self.overrun_reported = true;
            return true;
        }
        false
    }
}
