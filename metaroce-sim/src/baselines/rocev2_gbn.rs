//! RoCEv2 RC as commodity NICs run it without PFC: go-back-N.
//!
//! - Receiver: accepts only the expected PSN and delivers it in order. An
//!   out-of-sequence packet is dropped; the first one of an episode
//!   triggers a NAK carrying the expected PSN (later ones are dropped
//!   silently until the expected PSN arrives). Duplicates are re-ACKed.
//! - Sender: on a NAK resends everything from the NAKed PSN; on a
//!   retransmission timeout resends from the oldest unacknowledged PSN.
//!   Rate is DCQCN's (see [`super::dcqcn`]); there is no window unless
//!   `gbn_max_outstanding` sets one.

use std::collections::VecDeque;

use super::header::{RcHeader, RcKind};
use super::rc::{RcHost, ReceiverRecovery, RecoveryScheme, SenderRecovery};
use super::BaselineParams;
use crate::time::Nanos;
use crate::transport::{AppEvent, TransportEnv};

/// The go-back-N recovery scheme.
#[derive(Debug)]
pub struct GoBackN;

impl RecoveryScheme for GoBackN {
    type Sender = GbnSender;
    type Receiver = GbnReceiver;
}

/// The `rocev2-gbn` baseline transport (one instance per host).
pub type RoceV2Gbn = RcHost<GoBackN>;

/// Go-back-N sender state.
#[derive(Debug)]
pub struct GbnSender {
    una: u64,
    nxt: u64,
    high: u64,
    max_outstanding: u64,
    rto: Nanos,
}

impl GbnSender {
    fn advance(&mut self, cum: u64) -> bool {
        let cum = cum.min(self.high);
        if cum > self.una {
            self.una = cum;
            self.nxt = self.nxt.max(cum);
            true
        } else {
            false
        }
    }
}

impl SenderRecovery for GbnSender {
    fn new(params: &BaselineParams, _env: &TransportEnv) -> Self {
        GbnSender {
            una: 0,
            nxt: 0,
            high: 0,
            max_outstanding: params.gbn_max_outstanding.unwrap_or(u64::MAX),
            rto: params.gbn_rto_ns,
        }
    }

    fn next_psn(&mut self, posted_end: u64) -> Option<(u64, bool)> {
        if self.nxt >= posted_end || self.nxt - self.una >= self.max_outstanding {
            return None;
        }
        let psn = self.nxt;
        let retx = psn < self.high;
        self.nxt += 1;
        self.high = self.high.max(self.nxt);
        Some((psn, retx))
    }

    fn on_feedback(&mut self, hdr: &RcHeader) -> bool {
        match hdr.kind {
            RcKind::Ack => self.advance(hdr.psn),
            RcKind::Nak => {
                let advanced = self.advance(hdr.psn);
                if hdr.psn == self.una && hdr.psn < self.high {
                    // Go back: resend everything from the NAKed PSN.
                    self.nxt = hdr.psn;
                    return true;
                }
                advanced
            }
            _ => false,
        }
    }

    fn una(&self) -> u64 {
        self.una
    }

    fn has_outstanding(&self) -> bool {
        self.una < self.high
    }

    fn on_timeout(&mut self) {
        self.nxt = self.una;
    }

    fn rto_ns(&self) -> Nanos {
        self.rto
    }
}

/// Go-back-N receiver state.
#[derive(Debug)]
pub struct GbnReceiver {
    expected: u64,
    nak_sent: bool,
    ack_every: u32,
    unacked: u32,
}

impl ReceiverRecovery for GbnReceiver {
    fn new(params: &BaselineParams) -> Self {
        GbnReceiver {
            expected: 0,
            nak_sent: false,
            ack_every: params.ack_every.max(1),
            unacked: 0,
        }
    }

    fn on_data(&mut self, hdr: &RcHeader, deliver: &mut VecDeque<AppEvent>) -> Option<RcHeader> {
        if hdr.psn == self.expected {
            deliver.push_back(AppEvent::Delivered {
                flow: hdr.flow,
                offset: hdr.offset,
                len: hdr.len,
            });
            self.expected += 1;
            self.nak_sent = false;
            self.unacked += 1;
            if self.unacked >= self.ack_every || hdr.last {
                self.unacked = 0;
                return Some(RcHeader::feedback(RcKind::Ack, self.expected));
            }
            None
        } else if hdr.psn > self.expected {
            // Out of sequence: drop it; NAK once per episode.
            if self.nak_sent {
                None
            } else {
                self.nak_sent = true;
                Some(RcHeader::feedback(RcKind::Nak, self.expected))
            }
        } else {
            Some(RcHeader::feedback(RcKind::Ack, self.expected))
        }
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

    #[test]
    fn receiver_drops_out_of_order_and_naks_once() {
        let mut r = GbnReceiver::new(&BaselineParams::default());
        let mut d = VecDeque::new();
        assert_eq!(r.on_data(&data(0), &mut d).unwrap().kind, RcKind::Ack);
        let nak = r.on_data(&data(2), &mut d).unwrap();
        assert_eq!((nak.kind, nak.psn), (RcKind::Nak, 1));
        assert_eq!(r.on_data(&data(3), &mut d), None);
        assert_eq!(d.len(), 1, "out-of-order packets are not delivered");
        assert_eq!(r.on_data(&data(1), &mut d).unwrap().psn, 2);
        assert_eq!(
            r.on_data(&data(0), &mut d).unwrap().psn,
            2,
            "duplicate re-ACKed"
        );
        assert_eq!(d.len(), 2);
    }

    #[test]
    fn sender_goes_back_on_nak() {
        let env_params = BaselineParams::default();
        let env = crate::transport::TransportEnv {
            host: 0,
            hosts: 2,
            planes: 1,
            link_gbps: 100.0,
            mtu: 1000,
            base_rtt_ns: 10_000,
            bdp_bytes: 125_000,
            addresses: crate::addr::AddressMap::new(2, 2, 1),
            seed: 0,
        };
        let mut s = GbnSender::new(&env_params, &env);
        for i in 0..10 {
            assert_eq!(s.next_psn(100), Some((i, false)));
        }
        assert!(s.on_feedback(&RcHeader::feedback(RcKind::Nak, 3)));
        assert_eq!(s.una(), 3);
        let resent: Vec<_> = (0..7).map(|_| s.next_psn(100).unwrap()).collect();
        assert_eq!(resent, (3..10).map(|p| (p, true)).collect::<Vec<_>>());
        assert_eq!(s.next_psn(100), Some((10, false)));
    }
}
