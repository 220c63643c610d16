//! A QP's send queue of messages and the PSN ↔ (flow, offset) mapping.

use std::collections::VecDeque;

use crate::packet::FlowId;
use crate::transport::AppEvent;

#[derive(Debug, Clone, Copy)]
struct Message {
    flow: FlowId,
    bytes: Option<u64>,
    first_psn: u64,
    packets: u64,
}

impl Message {
    fn end_psn(&self) -> u64 {
        self.first_psn.saturating_add(self.packets)
    }
}

/// Where a PSN's payload lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Segment {
    pub flow: FlowId,
    pub offset: u64,
    pub len: u32,
    pub last: bool,
}

/// Messages posted on one QP, in PSN order.
#[derive(Debug)]
pub(crate) struct MessageQueue {
    msgs: VecDeque<Message>,
    end_psn: u64,
    mtu: u32,
}

impl MessageQueue {
    pub(crate) fn new(mtu: u32) -> Self {
        MessageQueue {
            msgs: VecDeque::new(),
            end_psn: 0,
            mtu,
        }
    }

    /// Post a message; `None` bytes = a message that never ends.
    pub(crate) fn push(&mut self, flow: FlowId, bytes: Option<u64>) {
        let packets = bytes.map_or(u64::MAX / 4, |b| b.div_ceil(self.mtu as u64).max(1));
        let m = Message {
            flow,
            bytes,
            first_psn: self.end_psn,
            packets,
        };
        self.end_psn = m.end_psn();
        self.msgs.push_back(m);
    }

    /// First PSN not yet posted.
    pub(crate) fn end_psn(&self) -> u64 {
        self.end_psn
    }

    /// The payload of `psn` (which must be posted and not yet retired).
    pub(crate) fn segment(&self, psn: u64) -> Segment {
        let i = self.msgs.partition_point(|m| m.end_psn() <= psn);
        let m = self.msgs[i];
        let offset = (psn - m.first_psn) * self.mtu as u64;
        let len =
            m.bytes
                .map_or(self.mtu as u64, |b| (b - offset).min(self.mtu as u64)) as u32;
        Segment {
            flow: m.flow,
            offset,
            len,
            last: psn + 1 == m.end_psn(),
        }
    }

    /// Retire messages fully acknowledged below `una`, reporting completions.
    pub(crate) fn retire(&mut self, una: u64, events: &mut VecDeque<AppEvent>) {
        while let Some(m) = self.msgs.front() {
            if m.end_psn() > una {
                break;
            }
            events.push_back(AppEvent::Completed { flow: m.flow });
            self.msgs.pop_front();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_psns_to_segments() {
        let mut q = MessageQueue::new(1000);
        q.push(7, Some(2500));
        q.push(8, Some(1000));
        assert_eq!(q.end_psn(), 4);
        assert_eq!(
            q.segment(0),
            Segment {
                flow: 7,
                offset: 0,
                len: 1000,
                last: false
            }
        );
        assert_eq!(
            q.segment(2),
            Segment {
                flow: 7,
                offset: 2000,
                len: 500,
                last: true
            }
        );
        assert_eq!(
            q.segment(3),
            Segment {
                flow: 8,
                offset: 0,
                len: 1000,
                last: true
            }
        );
        let mut ev = VecDeque::new();
        q.retire(3, &mut ev);
        assert_eq!(ev, vec![AppEvent::Completed { flow: 7 }]);
        assert_eq!(q.segment(3).flow, 8);
        q.push(9, None);
        assert_eq!(q.segment(1_000_000).offset, (1_000_000 - 4) * 1000);
    }
}
