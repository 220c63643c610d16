//! IRN (Mittal et al., SIGCOMM 2018): RDMA without PFC by selective repeat.
//!
//! - Receiver: keeps out-of-order packets and delivers in order as holes
//!   fill. Every data packet is answered: an ACK (cumulative PSN) when it
//!   arrives in order, a NACK carrying the cumulative PSN and the
//!   out-of-order PSN that triggered it otherwise.
//! - Sender: tracks SACKed PSNs. The first NACK starts loss recovery: the
//!   un-SACKed PSNs below the highest SACKed one are retransmitted, each
//!   once per recovery episode, before new data; recovery ends when the
//!   cumulative ACK passes the PSN that was next when it began. A timeout
//!   (RTO_low with few packets in flight, RTO_high otherwise) retransmits
//!   every un-SACKed outstanding PSN. New packets are limited to a
//!   BDP-sized window (BDP-FC). Rate control is DCQCN.

use std::collections::VecDeque;

use super::header::{RcHeader, RcKind, DATA_OVERHEAD};
use super::rc::{RcHost, ReceiverRecovery, RecoveryScheme, SenderRecovery};
use super::BaselineParams;
use crate::packet::FlowId;
use crate::time::Nanos;
use crate::transport::{AppEvent, TransportEnv};

/// The IRN recovery scheme.
#[derive(Debug)]
pub struct SelectiveRepeat;

impl RecoveryScheme for SelectiveRepeat {
    type Sender = IrnSender;
    type Receiver = IrnReceiver;
}

/// The `irn` baseline transport (one instance per host).
pub type Irn = RcHost<SelectiveRepeat>;

/// IRN sender state.
#[derive(Debug)]
pub struct IrnSender {
    una: u64,
    nxt: u64,
    /// `sacked[i]`: PSN `una + i` was received out of order.
    sacked: VecDeque<bool>,
    recovery: bool,
    recovery_end: u64,
    retx_cursor: u64,
    high_sack: u64,
    window: u64,
    rto_low: Nanos,
    rto_high: Nanos,
    low_threshold: u64,
}

impl IrnSender {
    /// The BDP-FC window in packets.
    pub fn window(&self) -> u64 {
        self.window
    }

    fn advance(&mut self, cum: u64) -> bool {
        let cum = cum.min(self.nxt);
        if cum <= self.una {
            return false;
        }
        let n = (cum - self.una) as usize;
        self.sacked.drain(..n.min(self.sacked.len()));
        self.una = cum;
        true
    }
}

impl SenderRecovery for IrnSender {
    fn new(params: &BaselineParams, env: &TransportEnv) -> Self {
        let pkt = (env.mtu + DATA_OVERHEAD) as f64;
        let window = ((env.bdp_bytes as f64 * params.irn_window_bdp) / pkt)
            .ceil()
            .max(1.0) as u64;
        IrnSender {
            una: 0,
            nxt: 0,
            sacked: VecDeque::new(),
            recovery: false,
            recovery_end: 0,
            retx_cursor: 0,
            high_sack: 0,
            window,
            rto_low: params.irn_rto_low_ns,
            rto_high: params.irn_rto_high_ns,
            low_threshold: params.irn_rto_low_threshold,
        }
    }

    fn next_psn(&mut self, posted_end: u64) -> Option<(u64, bool)> {
        if self.recovery {
            let mut p = self.retx_cursor.max(self.una);
            while p < self.high_sack.min(self.nxt) {
                if !self.sacked[(p - self.una) as usize] {
                    self.retx_cursor = p + 1;
                    return Some((p, true));
                }
                p += 1;
            }
            self.retx_cursor = p;
        }
        if self.nxt < posted_end && self.nxt - self.una < self.window {
            let psn = self.nxt;
            self.nxt += 1;
            self.sacked.push_back(false);
            return Some((psn, false));
        }
        None
    }

    fn on_feedback(&mut self, hdr: &RcHeader) -> bool {
        let progressed = self.advance(hdr.psn);
        if hdr.kind == RcKind::Sack {
            let s = hdr.sack_psn;
            if s >= self.una && s < self.nxt {
                self.sacked[(s - self.una) as usize] = true;
            }
            if !self.recovery {
                self.recovery = true;
                self.recovery_end = self.nxt;
                self.retx_cursor = self.una;
                self.high_sack = s + 1;
            } else {
                self.high_sack = self.high_sack.max(s + 1);
            }
        }
        if self.recovery && self.una >= self.recovery_end {
            self.recovery = false;
        }
        progressed
    }

    fn una(&self) -> u64 {
        self.una
    }

    fn has_outstanding(&self) -> bool {
        self.una < self.nxt
    }

    fn on_timeout(&mut self) {
        self.recovery = true;
        self.recovery_end = self.nxt;
        self.retx_cursor = self.una;
        self.high_sack = self.nxt;
    }

    fn rto_ns(&self) -> Nanos {
        if self.nxt - self.una <= self.low_threshold {
            self.rto_low
        } else {
            self.rto_high
        }
    }
}

/// IRN receiver state.
#[derive(Debug)]
pub struct IrnReceiver {
    expected: u64,
    /// `ooo[i]`: payload of PSN `expected + i`, if it arrived.
    ooo: VecDeque<Option<(FlowId, u64, u32)>>,
}

impl ReceiverRecovery for IrnReceiver {
    fn new(_params: &BaselineParams) -> Self {
        IrnReceiver {
            expected: 0,
            ooo: VecDeque::new(),
        }
    }

    fn on_data(&mut self, hdr: &RcHeader, deliver: &mut VecDeque<AppEvent>) -> Option<RcHeader> {
        if hdr.psn < self.expected {
            return Some(RcHeader::feedback(RcKind::Ack, self.expected));
        }
        let idx = (hdr.psn - self.expected) as usize;
        if idx == 0 {
            deliver.push_back(AppEvent::Delivered {
                flow: hdr.flow,
                offset: hdr.offset,
                len: hdr.len,
            });
            self.expected += 1;
            self.ooo.pop_front();
            while let Some(Some((flow, offset, len))) = self.ooo.front().copied() {
                deliver.push_back(AppEvent::Delivered { flow, offset, len });
                self.expected += 1;
                self.ooo.pop_front();
            }
            return Some(RcHeader::feedback(RcKind::Ack, self.expected));
        }
        if self.ooo.len() <= idx {
            self.ooo.resize(idx + 1, None);
        }
        if self.ooo[idx].is_none() {
            self.ooo[idx] = Some((hdr.flow, hdr.offset, hdr.len));
        }
        let mut nack = RcHeader::feedback(RcKind::Sack, self.expected);
        nack.sack_psn = hdr.psn;
        Some(nack)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(psn: u64) -> RcHeader {
        RcHeader {
            kind: RcKind::Data,
            psn,
            sack_psn: 0,
            flow: 0,
            offset: psn * 100,
            len: 100,
            last: false,
        }
    }

    fn env() -> TransportEnv {
        TransportEnv {
            host: 0,
            hosts: 2,
            planes: 1,
            link_gbps: 100.0,
            mtu: 1000,
            base_rtt_ns: 10_000,
            bdp_bytes: 125_000,
            addresses: crate::addr::AddressMap::new(2, 2, 1),
            seed: 0,
        }
    }

    #[test]
    fn receiver_buffers_and_fills_holes() {
        let mut r = IrnReceiver::new(&BaselineParams::default());
        let mut d = VecDeque::new();
        r.on_data(&data(0), &mut d);
        let n = r.on_data(&data(2), &mut d).unwrap();
        assert_eq!((n.kind, n.psn, n.sack_psn), (RcKind::Sack, 1, 2));
        r.on_data(&data(3), &mut d);
        assert_eq!(d.len(), 1);
        let a = r.on_data(&data(1), &mut d).unwrap();
        assert_eq!((a.kind, a.psn), (RcKind::Ack, 4));
        let offsets: Vec<u64> = d
            .iter()
            .map(|e| match e {
                AppEvent::Delivered { offset, .. } => *offset,
                _ => unreachable!(),
            })
            .collect();
        assert_eq!(offsets, vec![0, 100, 200, 300]);
    }

    #[test]
    fn sender_retransmits_only_the_hole_and_respects_window() {
        let mut s = IrnSender::new(&BaselineParams::default(), &env());
        let w = s.window();
        assert_eq!(w, 125_000u64.div_ceil(1062));
        for i in 0..w {
            assert_eq!(s.next_psn(1000), Some((i, false)));
        }
        assert_eq!(s.next_psn(1000), None, "window full");
        // PSN 1 lost: NACKs for 2 and 3.
        s.on_feedback(&RcHeader::feedback(RcKind::Ack, 1));
        let mut n = RcHeader::feedback(RcKind::Sack, 1);
        n.sack_psn = 2;
        s.on_feedback(&n);
        n.sack_psn = 3;
        s.on_feedback(&n);
        assert_eq!(s.next_psn(1000), Some((1, true)));
        // Nothing else is retransmitted; the window (una = 1) admits one new PSN.
        assert_eq!(s.next_psn(1000), Some((w, false)));
        assert_eq!(s.next_psn(1000), None);
    }
}
