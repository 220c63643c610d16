//! Endpoint counters: what arrived, what was sent, and every rejection by reason.
//!
//! The core keeps plain counters; drivers export them (e.g. to Prometheus).

/// Why a datagram (or part of one) was rejected. Each reason has a counter in
/// [`RejectCounters`], and each rejection is logged at `debug` level.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RejectReason {
    /// Shorter than its headers.
    Truncated,
    /// Unknown protocol version.
    BadVersion,
    /// Unknown packet type.
    UnknownType,
    /// Unknown DATA opcode.
    UnknownOpcode,
    /// A field out of its allowed range, or payload outside its message.
    InvalidField,
    /// No connection with this id.
    UnknownConnection,
    /// The source address is not the connection's peer.
    WrongSource,
    /// A packet that the connection's state does not take (e.g. data before the handshake ended).
    WrongState,
    /// A CSN beyond the connection's receive window.
    CsnOutOfWindow,
    /// A PSN `PSN_WINDOW` or more after its path's `ack_psn`.
    PsnOutOfWindow,
    /// A packet seen before (path- or connection-level duplicate).
    Duplicate,
    /// For a QP that does not exist, belongs to another connection, or is not ready.
    BadQp,
    /// A message number beyond the QP's message window.
    MsgOutOfWindow,
    /// Disagrees with earlier packets of the same message.
    Inconsistent,
    /// An ACK acknowledging what was never sent, or naming unknown state.
    BogusAck,
    /// A handshake packet with a bad or expired cookie.
    BadCookie,
    /// The endpoint does not accept incoming connections or is full.
    Refused,
    /// A packet of a stale request generation (after an RNR retry).
    StaleGeneration,
    /// A datagram whose integrity trailer (CRC32C) does not match its
    /// bytes: corrupted in transit (PROTOCOL §3.1).
    BadIntegrity,
    /// A HELLO or ACCEPT whose key proof is missing or wrong (PROTOCOL §3.2).
    BadKey,
    /// A datagram whose stateless reply (COOKIE, VERSION_NEGOTIATION) the
    /// endpoint's `stateless_rate` did not allow: dropped unanswered.
    RateLimited,
}

/// Rejection counters, one per [`RejectReason`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[allow(missing_docs)]
pub struct RejectCounters {
    pub truncated: u64,
    pub bad_version: u64,
    pub unknown_type: u64,
    pub unknown_opcode: u64,
    pub invalid_field: u64,
    pub unknown_connection: u64,
    pub wrong_source: u64,
    pub wrong_state: u64,
    pub csn_out_of_window: u64,
    pub psn_out_of_window: u64,
    pub duplicate: u64,
    pub bad_qp: u64,
    pub msg_out_of_window: u64,
    pub inconsistent: u64,
    pub bogus_ack: u64,
    pub bad_cookie: u64,
    pub refused: u64,
    pub stale_generation: u64,
    pub bad_integrity: u64,
    pub bad_key: u64,
    pub rate_limited: u64,
}

impl RejectCounters {
    /// The counter for `r`.
    pub fn get(&self, r: RejectReason) -> u64 {
        use RejectReason::*;
        match r {
            Truncated => self.truncated,
            BadVersion => self.bad_version,
            UnknownType => self.unknown_type,
            UnknownOpcode => self.unknown_opcode,
            InvalidField => self.invalid_field,
            UnknownConnection => self.unknown_connection,
            WrongSource => self.wrong_source,
            WrongState => self.wrong_state,
            CsnOutOfWindow => self.csn_out_of_window,
            PsnOutOfWindow => self.psn_out_of_window,
            Duplicate => self.duplicate,
            BadQp => self.bad_qp,
            MsgOutOfWindow => self.msg_out_of_window,
            Inconsistent => self.inconsistent,
            BogusAck => self.bogus_ack,
            BadCookie => self.bad_cookie,
            Refused => self.refused,
            StaleGeneration => self.stale_generation,
            BadIntegrity => self.bad_integrity,
            BadKey => self.bad_key,
            RateLimited => self.rate_limited,
        }
    }

    pub(crate) fn bump(&mut self, r: RejectReason) {
        use RejectReason::*;
        let c = match r {
            Truncated => &mut self.truncated,
            BadVersion => &mut self.bad_version,
            UnknownType => &mut self.unknown_type,
            UnknownOpcode => &mut self.unknown_opcode,
            InvalidField => &mut self.invalid_field,
            UnknownConnection => &mut self.unknown_connection,
            WrongSource => &mut self.wrong_source,
            WrongState => &mut self.wrong_state,
            CsnOutOfWindow => &mut self.csn_out_of_window,
            PsnOutOfWindow => &mut self.psn_out_of_window,
            Duplicate => &mut self.duplicate,
            BadQp => &mut self.bad_qp,
            MsgOutOfWindow => &mut self.msg_out_of_window,
            Inconsistent => &mut self.inconsistent,
            BogusAck => &mut self.bogus_ack,
            BadCookie => &mut self.bad_cookie,
            Refused => &mut self.refused,
            StaleGeneration => &mut self.stale_generation,
            BadIntegrity => &mut self.bad_integrity,
            BadKey => &mut self.bad_key,
            RateLimited => &mut self.rate_limited,
        };
        *c += 1;
    }

    /// Sum of all counters.
    pub fn total(&self) -> u64 {
        self.truncated
            + self.bad_version
            + self.unknown_type
            + self.unknown_opcode
            + self.invalid_field
            + self.unknown_connection
            + self.wrong_source
            + self.wrong_state
            + self.csn_out_of_window
            + self.psn_out_of_window
            + self.duplicate
            + self.bad_qp
            + self.msg_out_of_window
            + self.inconsistent
            + self.bogus_ack
            + self.bad_cookie
            + self.refused
            + self.stale_generation
            + self.bad_integrity
            + self.bad_key
            + self.rate_limited
    }
}

impl From<crate::wire::WireError> for RejectReason {
    fn from(e: crate::wire::WireError) -> Self {
        use crate::wire::WireError::*;
        match e {
            Truncated { .. } => RejectReason::Truncated,
            UnsupportedVersion(_) => RejectReason::BadVersion,
            UnknownType(_) => RejectReason::UnknownType,
            UnknownOpcode(_) => RejectReason::UnknownOpcode,
            InvalidField(_)
            | PayloadOutOfMessage { .. }
            | BufferTooSmall { .. }
            | UnknownCriticalOption(_) => RejectReason::InvalidField,
        }
    }
}

/// Endpoint-wide counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EndpointStats {
    /// Datagrams handed to `handle_datagram`.
    pub datagrams_received: u64,
    /// Datagrams produced by `poll_transmit` (GSO segments counted one by one).
    pub datagrams_sent: u64,
    /// Bytes received.
    pub bytes_received: u64,
    /// Bytes sent.
    pub bytes_sent: u64,
    /// Connections created (both directions).
    pub connections_opened: u64,
    /// Cookies handed out.
    pub cookies_sent: u64,
    /// Rejections by reason.
    pub rejects: RejectCounters,
}
