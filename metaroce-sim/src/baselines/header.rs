//! The header the RC baselines carry in simulated packets (no payload
//! bytes: the fabric only needs sizes).

use crate::packet::FlowId;

/// Ethernet (14) + IPv4 (20) + UDP (8) + BTH (12) + ICRC (4) + FCS (4).
pub const DATA_OVERHEAD: u32 = 62;
/// A data packet's overhead plus the 4-byte AETH.
pub const ACK_BYTES: u32 = DATA_OVERHEAD + 4;
/// An IRN NACK: ACK plus the SACKed PSN.
pub const SACK_BYTES: u32 = ACK_BYTES + 4;
/// A RoCEv2 CNP: BTH plus 16 reserved bytes.
pub const CNP_BYTES: u32 = DATA_OVERHEAD + 16;

/// Kind of RC packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RcKind {
    /// Payload of a message.
    Data,
    /// Cumulative acknowledgement: every PSN below `psn` arrived.
    Ack,
    /// Go-back-N NAK (PSN sequence error): resend from `psn`.
    Nak,
    /// IRN NACK: cumulative `psn` plus the out-of-order `sack_psn` that
    /// triggered it.
    Sack,
    /// Congestion notification packet (DCQCN).
    Cnp,
}

/// Contents of one RC baseline packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RcHeader {
    /// Packet kind.
    pub kind: RcKind,
    /// Data: this packet's PSN. Ack/Nak/Sack: the cumulative PSN.
    pub psn: u64,
    /// Sack: the PSN received out of order.
    pub sack_psn: u64,
    /// Data: the flow (message) the payload belongs to.
    pub flow: FlowId,
    /// Data: byte offset within the flow.
    pub offset: u64,
    /// Data: payload bytes.
    pub len: u32,
    /// Data: last packet of its message (the receiver always ACKs it).
    pub last: bool,
}

impl RcHeader {
    /// A feedback header of `kind` carrying `psn`.
    pub fn feedback(kind: RcKind, psn: u64) -> Self {
        RcHeader {
            kind,
            psn,
            sack_psn: 0,
            flow: 0,
            offset: 0,
            len: 0,
            last: false,
        }
    }

    /// Wire size of a packet with this header.
    pub fn wire_size(&self) -> u32 {
        match self.kind {
            RcKind::Data => self.len + DATA_OVERHEAD,
            RcKind::Ack | RcKind::Nak => ACK_BYTES,
            RcKind::Sack => SACK_BYTES,
            RcKind::Cnp => CNP_BYTES,
        }
    }
}
