//! Queue pairs: the RC state machine, the requester's send queue and the
//! responder's message tracking.
//!
//! A QP is one stream of a connection. As a requester it segments work
//! requests into packets and completes them in order; as a responder it
//! places incoming packets where they say, counts each message's bytes, and
//! executes messages in order (receive completions, READ responses).

use super::{
    AccessFlags, ConnectionHandle, CqHandle, PdHandle, Qpn, RecvWr, SendOp, SendWr, VerbsError,
    WcOpcode, WcStatus, WorkCompletion,
};
use crate::consts::{
    DATA_HEADER_LEN, DEFAULT_MAX_RD_ATOMIC, DEFAULT_RNR_RETRY, DEFAULT_RNR_TIMER, MAX_SGE,
    MSG_WINDOW,
};
use crate::time::Instant;
use crate::wire::seq::{seq_dist, seq_lt};
use crate::wire::{segment_payload, AckStreamEntry, NakCode, NakEntry, Opcode, OpcodeExt};
use core::time::Duration;
use std::collections::VecDeque;

/// RC queue pair states (`ibv_qp_state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QpState {
    /// Created; nothing allowed.
    Reset,
    /// Initialised: receives may be posted.
    Init,
    /// Ready to receive: bound to a connection and remote QP.
    Rtr,
    /// Ready to send.
    Rts,
    /// Send queue drained: requests in progress finish, new ones wait.
    Sqd,
    /// Send queue error (kept for the verbs state set; RC errors go to `Error`).
    Sqe,
    /// Error: every outstanding request is flushed.
    Error,
}

impl QpState {
    /// Whether the verbs state machine allows `self -> to`.
    pub fn can_move_to(self, to: QpState) -> bool {
        use QpState::*;
        matches!(
            (self, to),
            (_, Reset)
                | (_, Error)
                | (Reset, Init)
                | (Init, Init)
                | (Init, Rtr)
                | (Rtr, Rts)
                | (Rts, Rts)
                | (Rts, Sqd)
                | (Sqd, Sqd)
                | (Sqd, Rts)
                | (Sqe, Rts)
        )
    }

    pub(crate) fn takes_recv(self) -> bool {
        matches!(
            self,
            QpState::Init | QpState::Rtr | QpState::Rts | QpState::Sqd | QpState::Sqe
        )
    }

    pub(crate) fn takes_send(self) -> bool {
        matches!(self, QpState::Rts | QpState::Sqd)
    }

    /// Whether incoming requests are processed.
    pub(crate) fn responds(self) -> bool {
        matches!(
            self,
            QpState::Rtr | QpState::Rts | QpState::Sqd | QpState::Sqe
        )
    }
}

/// Attributes for [`Endpoint::modify_qp`](crate::Endpoint::modify_qp), after
/// `ibv_qp_attr`. Each transition reads the ones it needs:
///
/// - RESET→INIT: `access` (remote rights the QP allows; default none beyond local).
/// - INIT→RTR: `conn` and `remote_qpn` (required), `max_dest_rd_atomic`, `min_rnr_timer`.
/// - RTR→RTS: `retry_cnt`, `timeout`, `rnr_retry`, `max_rd_atomic`.
///
/// Packets are retransmitted per connection (reliability is per connection,
/// shared by its QPs: its RTO and `retry_cnt` are in
/// [`EndpointConfig`](crate::EndpointConfig)). A QP's own `timeout` and
/// `retry_cnt` govern what is left to it: a request whose packets were all
/// acknowledged but which does not complete (the peer's QP is gone, or
/// stuck) is probed for after `timeout`, doubling each time, and fails
/// with `RetryExceeded` after `retry_cnt` unanswered probes. See [`RcAttrs`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QpAttrs {
    /// Remote access rights the QP allows (`qp_access_flags`).
    pub access: Option<AccessFlags>,
    /// Connection carrying this QP's stream.
    pub conn: Option<ConnectionHandle>,
    /// The peer's QP number.
    pub remote_qpn: Option<Qpn>,
    /// Largest number of READs the peer may have outstanding on us.
    pub max_dest_rd_atomic: Option<u8>,
    /// RNR delay we ask the peer to wait.
    pub min_rnr_timer: Option<Duration>,
    /// RNR retries before failing (7 = forever).
    pub rnr_retry: Option<u8>,
    /// Largest number of our READs outstanding at once.
    pub max_rd_atomic: Option<u8>,
    /// Unanswered progress probes before a request fails with
    /// `RetryExceeded` (`None` at creation: the connection's `retry_cnt`).
    pub retry_cnt: Option<u8>,
    /// Time without progress before the first probe (`None` at creation:
    /// the connection's retransmission timeout, which follows the RTT).
    pub timeout: Option<Duration>,
}

/// The RC attributes of [`Endpoint::connect_qp_with`](crate::Endpoint::connect_qp_with),
/// mirroring `ibv_modify_qp`'s for INIT, RTR and RTS, with defaults.
///
/// | field | `ibv_qp_attr` | default |
/// |---|---|---|
/// | `access` | `qp_access_flags` | every remote access (the regions still decide) |
/// | `retry_cnt` | `retry_cnt` | `None`: the connection's (7 by default) |
/// | `timeout` | `timeout` (4.096 µs · 2^n there) | `None`: the connection's RTO |
/// | `rnr_retry` | `rnr_retry` | 7 (retry forever) |
/// | `min_rnr_timer` | `min_rnr_timer` (a code there) | 100 µs |
/// | `max_rd_atomic` | `max_rd_atomic` | 16 |
/// | `max_dest_rd_atomic` | `max_dest_rd_atomic` | 16 |
///
/// `retry_cnt` and `timeout` apply to the QP's requests (see [`QpAttrs`]):
/// packet loss is recovered by the connection, under its own RTO and
/// `retry_cnt` ([`EndpointConfig`](crate::EndpointConfig)).
///
/// ```
/// use metaroce_proto::verbs::RcAttrs;
/// use std::time::Duration;
/// // Fail fast: no RNR retries, and a stuck request fails after one
/// // unanswered probe 1 ms after its last progress.
/// let attrs = RcAttrs {
///     rnr_retry: 0,
///     retry_cnt: Some(1),
///     timeout: Some(Duration::from_millis(1)),
///     ..RcAttrs::default()
/// };
/// assert_eq!(attrs.max_rd_atomic, 16);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RcAttrs {
    /// Remote access rights the QP allows.
    pub access: AccessFlags,
    /// Unanswered progress probes before a request fails with
    /// `RetryExceeded` (0 to 7; 0 fails at the first one); `None` takes
    /// the connection's (`EndpointConfig::retry_cnt`).
    pub retry_cnt: Option<u8>,
    /// Time without progress before the QP probes the responder (then
    /// doubling); `None` follows the connection's retransmission timeout.
    pub timeout: Option<Duration>,
    /// RNR NAKs taken before a request fails with `RnrRetryExceeded`
    /// (0 to 7; 7 retries forever, as in verbs).
    pub rnr_retry: u8,
    /// How long we ask a peer to wait before retrying a message we had no
    /// receive for.
    pub min_rnr_timer: Duration,
    /// Our READs outstanding at once (at least 1).
    pub max_rd_atomic: u8,
    /// The peer's READs we take at once (at least 1).
    pub max_dest_rd_atomic: u8,
}

impl Default for RcAttrs {
    fn default() -> Self {
        RcAttrs {
            access: AccessFlags::ALL,
            retry_cnt: None,
            timeout: None,
            rnr_retry: DEFAULT_RNR_RETRY,
            min_rnr_timer: DEFAULT_RNR_TIMER,
            max_rd_atomic: DEFAULT_MAX_RD_ATOMIC,
            max_dest_rd_atomic: DEFAULT_MAX_RD_ATOMIC,
        }
    }
}

impl RcAttrs {
    /// Checks the values: `retry_cnt` and `rnr_retry` at most 7, READ
    /// depths at least 1, a `timeout` above zero.
    pub fn validate(&self) -> Result<(), VerbsError> {
        if self.retry_cnt.is_some_and(|n| n > 7) {
            return Err(VerbsError::InvalidAttribute("retry_cnt above 7"));
        }
        if self.rnr_retry > 7 {
            return Err(VerbsError::InvalidAttribute("rnr_retry above 7"));
        }
        if self.max_rd_atomic == 0 || self.max_dest_rd_atomic == 0 {
            return Err(VerbsError::InvalidAttribute("a READ depth of 0"));
        }
        if self.timeout.is_some_and(|t| t.is_zero()) {
            return Err(VerbsError::InvalidAttribute("a timeout of 0"));
        }
        Ok(())
    }
}

/// A send work request in the send queue.
#[derive(Debug, Clone)]
pub(crate) struct SendWqe {
    pub(crate) wr: SendWr,
    /// The message length: the local elements' bytes together (checked to
    /// fit a `u32` when posted).
    len: u32,
    pub(crate) msn: u32,
    /// For receive-consuming operations: which receive it lands in.
    pub(crate) recv_seq: u32,
    pub(crate) gen: u8,
    pub(crate) rnr_retries: u8,
    /// READ: response bytes placed.
    pub(crate) read_received: u64,
    /// READ: at least one response packet placed (for zero-length READs).
    pub(crate) read_seen: bool,
    /// Set when the request failed locally before it was sent.
    pub(crate) local_error: Option<WcStatus>,
    /// Whether the request holds a reference on the region of each of its
    /// non-empty local elements.
    pub(crate) has_ref: bool,
}

impl SendWqe {
    /// A request as posted: first generation, nothing received yet.
    pub(crate) fn new(
        wr: SendWr,
        msn: u32,
        recv_seq: u32,
        local_error: Option<WcStatus>,
        has_ref: bool,
    ) -> Self {
        SendWqe {
            len: wr.local.byte_len() as u32,
            wr,
            msn,
            recv_seq,
            gen: 0,
            rnr_retries: 0,
            read_received: 0,
            read_seen: false,
            local_error,
            has_ref,
        }
    }

    pub(crate) fn opcode(&self) -> Opcode {
        match self.wr.op {
            SendOp::Send => Opcode::Send,
            SendOp::SendImm(_) => Opcode::SendImm,
            SendOp::Write(_) => Opcode::Write,
            SendOp::WriteImm(..) => Opcode::WriteImm,
            SendOp::Read(_) => Opcode::ReadReq,
        }
    }

    pub(crate) fn ext(&self) -> OpcodeExt {
        match self.wr.op {
            SendOp::Send => OpcodeExt::Send {
                recv_seq: self.recv_seq,
            },
            SendOp::SendImm(imm) => OpcodeExt::SendImm {
                recv_seq: self.recv_seq,
                imm,
            },
            SendOp::Write(r) => OpcodeExt::Write {
                rkey: r.rkey,
                remote_addr: r.addr,
            },
            SendOp::WriteImm(r, imm) => OpcodeExt::WriteImm {
                rkey: r.rkey,
                remote_addr: r.addr,
                recv_seq: self.recv_seq,
                imm,
            },
            SendOp::Read(r) => OpcodeExt::ReadReq {
                rkey: r.rkey,
                remote_addr: r.addr,
            },
        }
    }

    /// The opcode of the message's packets after its first, on a path of
    /// `mtu` (PROTOCOL §5.3): a SEND_IMM's or WRITE_IMM's go without the
    /// immediate data where that lets them carry more payload (1,420 bytes
    /// of a WRITE_IMM on a 1,500-byte Ethernet path, against 1,412). Where
    /// it does not (4 KiB either way at the default MTU) they keep it: all
    /// packets are then the same size, and a UDP GSO batch runs on from one
    /// message into the next, where a first packet 8 bytes longer than the
    /// rest would split each message's batch in two (loopback `perf`: 0.75
    /// of the rate).
    pub(crate) fn later_opcode(&self, mtu: usize) -> Opcode {
        let op = self.opcode();
        let cont = op.continuation();
        if cont != op && segment_payload(mtu, cont) > segment_payload(mtu, op) {
            cont
        } else {
            op
        }
    }

    /// The opcode of the packet at `offset` (see [`later_opcode`](Self::later_opcode)).
    pub(crate) fn opcode_at(&self, offset: u32, mtu: usize) -> Opcode {
        if offset == 0 {
            self.opcode()
        } else {
            self.later_opcode(mtu)
        }
    }

    /// The extension of the packet at `offset` (see [`later_opcode`](Self::later_opcode)).
    pub(crate) fn ext_at(&self, offset: u32, mtu: usize) -> OpcodeExt {
        if self.opcode_at(offset, mtu) == self.opcode() {
            self.ext()
        } else {
            self.ext().continuation()
        }
    }

    pub(crate) fn is_read(&self) -> bool {
        matches!(self.wr.op, SendOp::Read(_))
    }

    pub(crate) fn wc_opcode(&self) -> WcOpcode {
        match self.wr.op {
            SendOp::Send | SendOp::SendImm(_) => WcOpcode::Send,
            SendOp::Write(_) | SendOp::WriteImm(..) => WcOpcode::Write,
            SendOp::Read(_) => WcOpcode::Read,
        }
    }

    /// The message length.
    pub(crate) fn msg_len(&self) -> u32 {
        self.len
    }

    /// Bytes carried in request packets (zero for READ, whose data comes back).
    pub(crate) fn request_len(&self) -> u32 {
        if self.is_read() {
            0
        } else {
            self.msg_len()
        }
    }

    /// Most payload a request packet starting at message byte `offset` may
    /// carry: up to the end of the local element it starts in, so that a
    /// packet (and its every retransmission) reads one range of one region.
    pub(crate) fn segment_room(&self, offset: u32) -> u32 {
        if self.is_read() {
            return 0;
        }
        if self.wr.local.len() <= 1 {
            return self.len.saturating_sub(offset);
        }
        self.wr
            .local
            .locate(offset)
            .map_or(0, |(_, _, end)| end - offset)
    }
}

/// Whether an operation consumes a receive at the responder.
pub(crate) fn consumes_recv(op: &SendOp) -> bool {
    matches!(op, SendOp::Send | SendOp::SendImm(_) | SendOp::WriteImm(..))
}

/// A message being received by the responder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Incoming {
    /// Nothing seen yet.
    Empty,
    /// Refused (RNR) at generation `gen`; packets of `gen` or older are dropped.
    Refused { gen: u8 },
    /// Accepted and being placed.
    Accepted(Accepted),
    /// Failed a responder check: the QP fails when every earlier message is done.
    Failed {
        /// NAK to send then.
        code: NakCode,
        /// The receive it would land in completes with a local length error.
        local_len_error: bool,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Accepted {
    pub(crate) opcode: Opcode,
    pub(crate) gen: u8,
    pub(crate) len: u32,
    pub(crate) received: u64,
    pub(crate) complete: bool,
    pub(crate) recv_seq: u32,
    pub(crate) imm: Option<u32>,
    pub(crate) rkey: u32,
    pub(crate) addr: u64,
}

/// A READ response the responder owes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ReadResp {
    pub(crate) msn: u32,
    pub(crate) rkey: u32,
    pub(crate) addr: u64,
    pub(crate) len: u32,
    /// Next offset to send for the first time.
    pub(crate) next_offset: u32,
    pub(crate) sent_all: bool,
    /// Response packets sent (first transmissions) and delivered.
    pub(crate) pkts_sent: u32,
    pub(crate) pkts_acked: u32,
}

/// How large the next packet may be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SegLimit {
    /// The connection's MTU, which sets the payload of a full segment
    /// ([`segment_payload`]).
    pub(crate) mtu: usize,
    /// Largest packet, header included: the MTU, or the segment size of the
    /// UDP GSO batch the packet joins.
    wire: usize,
}

impl SegLimit {
    /// Full segments of a path of `mtu` UDP payload bytes.
    pub(crate) fn new(mtu: usize) -> Self {
        SegLimit { mtu, wire: mtu }
    }

    /// The same, for a packet of at most `wire` bytes.
    pub(crate) fn within(self, wire: usize) -> Self {
        SegLimit {
            wire: wire.min(self.wire),
            ..self
        }
    }

    /// Largest payload of a packet of `opcode`.
    pub(crate) fn payload(self, opcode: Opcode) -> u32 {
        let room = self.wire.saturating_sub(DATA_HEADER_LEN + opcode.ext_len());
        segment_payload(self.mtu, opcode).min(room).max(1) as u32
    }
}

/// One packet's worth of work chosen by a QP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Segment {
    /// Part of a request of the send queue.
    Request {
        msn: u32,
        gen: u8,
        offset: u32,
        len: u32,
    },
    /// Part of a READ response.
    Response { msn: u32, offset: u32, len: u32 },
}

/// A queue pair.
#[derive(Debug)]
pub(crate) struct Qp {
    pub(crate) qpn: Qpn,
    pub(crate) pd: PdHandle,
    pub(crate) send_cq: CqHandle,
    pub(crate) recv_cq: CqHandle,
    pub(crate) max_send_wr: u32,
    pub(crate) max_recv_wr: u32,
    /// Most scatter/gather elements of a send and of a receive request.
    pub(crate) max_send_sge: u32,
    pub(crate) max_recv_sge: u32,
    pub(crate) state: QpState,
    pub(crate) access: AccessFlags,
    pub(crate) conn: Option<ConnectionHandle>,
    pub(crate) remote_qpn: u32,
    pub(crate) max_dest_rd_atomic: u8,
    pub(crate) min_rnr_timer: Duration,
    pub(crate) rnr_retry: u8,
    pub(crate) max_rd_atomic: u8,
    /// Unanswered probes before a request fails (`None`: the connection's).
    pub(crate) retry_cnt: Option<u8>,
    /// Time without progress before a probe (`None`: the connection's RTO).
    pub(crate) timeout: Option<Duration>,

    // Requester side.
    pub(crate) sq: VecDeque<SendWqe>,
    /// MSN of `sq[0]`.
    pub(crate) sq_base_msn: u32,
    pub(crate) next_msn: u32,
    pub(crate) next_recv_seq: u32,
    /// Index in `sq` of the request being sent for the first time.
    pub(crate) send_idx: usize,
    pub(crate) send_offset: u32,
    pub(crate) reads_outstanding: u32,
    /// Peer's `msn_done` for our requests.
    pub(crate) remote_msn_done: u32,
    /// No new packets before this instant (RNR back-off).
    pub(crate) rnr_wait_until: Option<Instant>,
    /// Requests to resend from the start with a new generation (RNR), in MSN order.
    /// Each with the offset its resend has reached.
    pub(crate) resend: VecDeque<(u32, u32)>,

    // Responder side.
    pub(crate) rq: VecDeque<RecvWr>,
    /// `recv_seq` of `rq[0]`.
    pub(crate) rq_base_seq: u32,
    pub(crate) msn_done: u32,
    /// Messages from `msn_done` on.
    pub(crate) incoming: VecDeque<Incoming>,
    pub(crate) read_resps: VecDeque<ReadResp>,
    pub(crate) reported_msn_done: u32,
    pub(crate) stream_dirty: bool,
    /// First message that failed a responder check.
    pub(crate) failed_msn: Option<u32>,
    /// The NAK that moved the QP to ERROR, repeated to the requester.
    pub(crate) fatal_nak: Option<NakEntry>,
    /// Requester: a fatal NAK (message, status) that arrived while an
    /// earlier request (a READ whose response is on its way) was still
    /// incomplete; the QP fails when that message is the oldest.
    pub(crate) deferred_fatal: Option<(u32, WcStatus)>,

    // Progress probes (requester).
    /// Request packets sent and not yet acknowledged.
    pub(crate) unacked: u32,
    /// Last time the QP saw progress or sent a new request packet.
    pub(crate) last_progress: Instant,
    /// Probes sent since the last progress.
    pub(crate) probes: u8,
    /// A probe is owed.
    pub(crate) probe_pending: bool,
    /// When the first of the current run of progress probes went out.
    pub(crate) first_probe_at: Option<Instant>,
}

impl Qp {
    pub(crate) fn new(
        qpn: Qpn,
        pd: PdHandle,
        send_cq: CqHandle,
        recv_cq: CqHandle,
        max_send_wr: u32,
        max_recv_wr: u32,
    ) -> Self {
        Qp {
            qpn,
            pd,
            send_cq,
            recv_cq,
            max_send_wr: max_send_wr.clamp(1, MSG_WINDOW),
            max_recv_wr: max_recv_wr.max(1),
            max_send_sge: MAX_SGE as u32,
            max_recv_sge: MAX_SGE as u32,
            state: QpState::Reset,
            access: AccessFlags::NONE,
            conn: None,
            remote_qpn: 0,
            max_dest_rd_atomic: DEFAULT_MAX_RD_ATOMIC,
            min_rnr_timer: DEFAULT_RNR_TIMER,
            rnr_retry: DEFAULT_RNR_RETRY,
            max_rd_atomic: DEFAULT_MAX_RD_ATOMIC,
            retry_cnt: None,
            timeout: None,
            sq: VecDeque::new(),
            sq_base_msn: 0,
            next_msn: 0,
            next_recv_seq: 0,
            send_idx: 0,
            send_offset: 0,
            reads_outstanding: 0,
            remote_msn_done: 0,
            rnr_wait_until: None,
            resend: VecDeque::new(),
            rq: VecDeque::new(),
            rq_base_seq: 0,
            msn_done: 0,
            incoming: VecDeque::new(),
            read_resps: VecDeque::new(),
            reported_msn_done: 0,
            stream_dirty: false,
            failed_msn: None,
            fatal_nak: None,
            deferred_fatal: None,
            unacked: 0,
            last_progress: Instant::ZERO,
            probes: 0,
            probe_pending: false,
            first_probe_at: None,
        }
    }

    /// Back to the freshly created state (the `RESET` transition).
    pub(crate) fn reset(&mut self) {
        let mut fresh = Qp::new(
            self.qpn,
            self.pd,
            self.send_cq,
            self.recv_cq,
            self.max_send_wr,
            self.max_recv_wr,
        );
        fresh.max_send_sge = self.max_send_sge;
        fresh.max_recv_sge = self.max_recv_sge;
        *self = fresh;
    }

    /// The work request with message number `msn`, if still queued.
    pub(crate) fn wqe(&self, msn: u32) -> Option<&SendWqe> {
        let i = seq_dist(self.sq_base_msn, msn) as usize;
        self.sq.get(i)
    }

    pub(crate) fn wqe_mut(&mut self, msn: u32) -> Option<&mut SendWqe> {
        let i = seq_dist(self.sq_base_msn, msn) as usize;
        self.sq.get_mut(i)
    }

    /// Whether the QP has a packet it could send now.
    /// Whether the QP sends READ responses: as a responder, and in ERROR
    /// for the READs it executed before the request that failed it (the
    /// only ones it still holds then).
    fn answers_reads(&self) -> bool {
        self.state.responds() || self.state == QpState::Error
    }

    /// Its progress as an ACK reports it to the peer's QP (§6.3).
    pub(crate) fn stream_entry(&self) -> AckStreamEntry {
        AckStreamEntry {
            qpn: self.remote_qpn,
            msn_done: self.msn_done,
        }
    }

    pub(crate) fn has_send_work(&self, now: Instant) -> bool {
        if self.read_resps.iter().any(|r| !r.sent_all) && self.answers_reads() {
            return true;
        }
        if !self.state.takes_send() || self.rnr_wait_until.is_some_and(|t| now < t) {
            return false;
        }
        if !self.resend.is_empty() {
            return true;
        }
        self.next_new_request().is_some()
    }

    /// The earliest instant at which the QP will have work it does not have
    /// now: the end of an RNR back-off, or a progress probe (`rto` is the
    /// connection's timeout).
    pub(crate) fn next_timer(&self, rto: Duration) -> Option<Instant> {
        if self.rnr_wait_until.is_some() {
            return self.rnr_wait_until;
        }
        self.probe_deadline(rto)
    }

    /// When to probe the responder for progress: the oldest request has been
    /// sent and every packet of it acknowledged, yet it has not completed.
    /// `rto` is the connection's timeout, used unless the QP has its own.
    pub(crate) fn probe_deadline(&self, rto: Duration) -> Option<Instant> {
        let rto = self.timeout.unwrap_or(rto);
        let waiting = self.state.takes_send()
            && self.send_idx > 0
            && !self.sq.is_empty()
            && self.unacked == 0
            && self.resend.is_empty()
            && self.rnr_wait_until.is_none()
            && !self.probe_pending;
        waiting.then(|| self.last_progress + rto * (1u32 << self.probes.min(10)))
    }

    /// Unanswered probes before the oldest request fails, given the
    /// connection's `retry_cnt`.
    pub(crate) fn probe_limit(&self, conn_retry_cnt: u8) -> u8 {
        self.retry_cnt.unwrap_or(conn_retry_cnt)
    }

    /// Progress seen: no probe needed for a while.
    pub(crate) fn progressed(&mut self, now: Instant) {
        self.last_progress = now;
        self.probes = 0;
    }

    /// Index of the next request to start, if one may start now.
    fn next_new_request(&self) -> Option<usize> {
        let wqe = self.sq.get(self.send_idx)?;
        if self.send_offset == 0 {
            // Starting a new request: SQD lets requests in progress finish only.
            if self.state == QpState::Sqd {
                return None;
            }
            if wqe.wr.fence && self.reads_outstanding > 0 {
                return None;
            }
            if wqe.is_read() && self.reads_outstanding >= u32::from(self.max_rd_atomic.max(1)) {
                return None;
            }
        }
        Some(self.send_idx)
    }

    /// Picks the next packet: READ responses first, then RNR resends, then
    /// new requests; and whether it is a full one (as much payload as
    /// `limit` allows its opcode).
    pub(crate) fn next_segment(
        &mut self,
        now: Instant,
        limit: SegLimit,
    ) -> Option<(Segment, bool)> {
        if self.answers_reads() {
            if let Some(r) = self.read_resps.iter_mut().find(|r| !r.sent_all) {
                let max = limit.payload(Opcode::ReadResp);
                let len = (r.len - r.next_offset).min(max);
                r.pkts_sent += 1;
                let seg = Segment::Response {
                    msn: r.msn,
                    offset: r.next_offset,
                    len,
                };
                r.next_offset += len;
                if r.next_offset >= r.len {
                    r.sent_all = true;
                }
                return Some((seg, len == max));
            }
        }
        if !self.state.takes_send() || self.rnr_wait_until.is_some_and(|t| now < t) {
            return None;
        }
        self.rnr_wait_until = None;
        while let Some(&(msn, offset)) = self.resend.front() {
            let Some((len_total, room, gen, opcode)) = self.wqe(msn).map(|w| {
                let room = w.segment_room(offset);
                (w.request_len(), room, w.gen, w.opcode_at(offset, limit.mtu))
            }) else {
                // Completed or flushed meanwhile.
                self.resend.pop_front();
                continue;
            };
            let max = limit.payload(opcode);
            let len = room.min(max);
            let next = offset + len;
            self.last_progress = self.last_progress.max(now);
            if next >= len_total {
                self.resend.pop_front();
            } else if let Some(front) = self.resend.front_mut() {
                front.1 = next;
            }
            let seg = Segment::Request {
                msn,
                gen,
                offset,
                len,
            };
            return Some((seg, len == max));
        }
        let idx = self.next_new_request()?;
        let wqe = &self.sq[idx];
        let offset = self.send_offset;
        let total = wqe.request_len();
        let max = limit.payload(wqe.opcode_at(offset, limit.mtu));
        let len = wqe.segment_room(offset).min(max);
        let seg = Segment::Request {
            msn: wqe.msn,
            gen: wqe.gen,
            offset,
            len,
        };
        if offset == 0 && wqe.is_read() {
            self.reads_outstanding += 1;
        }
        self.last_progress = self.last_progress.max(now);
        self.send_offset += len;
        if self.send_offset >= total {
            self.send_idx += 1;
            self.send_offset = 0;
        }
        Some((seg, len == max))
    }

    /// The request under way, when its next segment is what
    /// [`next_segment`](Self::next_segment) would pick (its first segment
    /// has gone, no READ response or resend comes before it, no RNR wait):
    /// its MSN, generation, the offset of that next segment, its length and
    /// its opcode. For the rest of a GSO batch, taken with
    /// [`advance_request`](Self::advance_request).
    pub(crate) fn request_under_way(
        &self,
        now: Instant,
        mtu: usize,
    ) -> Option<(u32, u8, u32, u32, Opcode)> {
        let waiting = self.rnr_wait_until.is_some_and(|t| now < t);
        if self.send_offset == 0
            || !self.state.takes_send()
            || waiting
            || !self.resend.is_empty()
            || self.state.responds() && self.read_resps.iter().any(|r| !r.sent_all)
        {
            return None;
        }
        let w = self.sq.get(self.send_idx)?;
        Some((
            w.msn,
            w.gen,
            self.send_offset,
            w.request_len(),
            w.opcode_at(self.send_offset, mtu),
        ))
    }

    /// Takes `len` more bytes of the request under way (see
    /// [`request_under_way`](Self::request_under_way)) as one segment, as
    /// [`next_segment`](Self::next_segment) would, and counts it
    /// unacknowledged.
    pub(crate) fn advance_request(&mut self, now: Instant, len: u32, total: u32) {
        self.rnr_wait_until = None;
        self.last_progress = self.last_progress.max(now);
        self.unacked += 1;
        self.send_offset += len;
        if self.send_offset >= total {
            self.send_idx += 1;
            self.send_offset = 0;
        }
    }

    /// Responder: the record of message `msn`, creating empty slots up to it.
    /// `None` if `msn` is before `msn_done` (duplicate) or beyond the window.
    pub(crate) fn incoming_slot(&mut self, msn: u32) -> Result<&mut Incoming, IncomingReject> {
        if seq_lt(msn, self.msn_done) {
            return Err(IncomingReject::Duplicate);
        }
        let d = seq_dist(self.msn_done, msn);
        if d >= MSG_WINDOW {
            return Err(IncomingReject::OutOfWindow);
        }
        let d = d as usize;
        while self.incoming.len() <= d {
            self.incoming.push_back(Incoming::Empty);
        }
        Ok(&mut self.incoming[d])
    }

    /// Responder: retires completed messages in order. Calls `exec` for each
    /// with the accepted record while it is still the head (`msn_done` is
    /// its MSN); returns how many were retired. A message `exec` refuses
    /// (it checks before it changes anything) becomes
    /// [`Incoming::Failed`] with the code it gives, and retiring stops there.
    pub(crate) fn retire_in_order(
        &mut self,
        mut exec: impl FnMut(&mut Qp, Accepted) -> Result<(), NakCode>,
    ) -> u32 {
        let mut n = 0;
        while let Some(Incoming::Accepted(a)) = self.incoming.front().copied() {
            if !a.complete {
                break;
            }
            if let Err(code) = exec(self, a) {
                let msn = self.msn_done;
                if self.failed_msn.is_none_or(|f| seq_lt(msn, f)) {
                    self.failed_msn = Some(msn);
                }
                self.incoming[0] = Incoming::Failed {
                    code,
                    local_len_error: false,
                };
                break;
            }
            self.incoming.pop_front();
            self.msn_done = self.msn_done.wrapping_add(1);
            n += 1;
        }
        if n > 0 {
            self.stream_dirty = true;
        }
        n
    }

    /// A completion for the send work request `wqe`.
    pub(crate) fn send_wc(&self, wqe: &SendWqe, status: WcStatus) -> WorkCompletion {
        WorkCompletion {
            wr_id: wqe.wr.wr_id,
            status,
            opcode: wqe.wc_opcode(),
            byte_len: if status == WcStatus::Success {
                wqe.msg_len()
            } else {
                0
            },
            imm: None,
            qpn: self.qpn,
        }
    }

    /// A flush completion for the receive `wr`.
    pub(crate) fn recv_flush_wc(&self, wr: &RecvWr) -> WorkCompletion {
        WorkCompletion {
            wr_id: wr.wr_id,
            status: WcStatus::WrFlushError,
            opcode: WcOpcode::Recv,
            byte_len: 0,
            imm: None,
            qpn: self.qpn,
        }
    }
}

/// Why the responder could not find a message slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum IncomingReject {
    Duplicate,
    OutOfWindow,
}

#[cfg(test)]
mod tests {
    use super::*;
    use QpState::*;

    #[test]
    fn transition_table() {
        let all = [Reset, Init, Rtr, Rts, Sqd, Sqe, Error];
        let legal: &[(QpState, QpState)] = &[
            (Reset, Init),
            (Init, Init),
            (Init, Rtr),
            (Rtr, Rts),
            (Rts, Rts),
            (Rts, Sqd),
            (Sqd, Sqd),
            (Sqd, Rts),
            (Sqe, Rts),
        ];
        for &from in &all {
            for &to in &all {
                let expect = to == Reset || to == Error || legal.contains(&(from, to));
                assert_eq!(from.can_move_to(to), expect, "{from:?} -> {to:?}");
            }
        }
    }

    #[test]
    fn which_states_take_requests() {
        assert!(
            !Reset.takes_recv() && Init.takes_recv() && Rts.takes_recv() && !Error.takes_recv()
        );
        assert!(!Rtr.takes_send() && Rts.takes_send() && Sqd.takes_send() && !Error.takes_send());
        assert!(!Init.responds() && Rtr.responds() && !Error.responds());
    }

    fn qp() -> Qp {
        let mut q = Qp::new(Qpn(1), PdHandle(0), CqHandle(0), CqHandle(0), 16, 16);
        q.state = Rts;
        q
    }

    fn wqe(msn: u32, op: SendOp, len: u32) -> SendWqe {
        let local = super::super::Sge {
            lkey: 0,
            addr: 0,
            len,
        };
        SendWqe::new(SendWr::new(msn.into(), op, local), msn, 0, None, false)
    }

    #[test]
    fn segments_messages_to_the_mtu() {
        let mut q = qp();
        q.sq.push_back(wqe(0, SendOp::Send, 10_000));
        q.sq.push_back(wqe(1, SendOp::Send, 0));
        let now = Instant::ZERO;
        let limit = SegLimit::new(4096 + 60);
        let mut segs = Vec::new();
        while let Some((s, _)) = q.next_segment(now, limit) {
            segs.push(s);
        }
        assert_eq!(
            segs,
            vec![
                Segment::Request {
                    msn: 0,
                    gen: 0,
                    offset: 0,
                    len: 4096
                },
                Segment::Request {
                    msn: 0,
                    gen: 0,
                    offset: 4096,
                    len: 4096
                },
                Segment::Request {
                    msn: 0,
                    gen: 0,
                    offset: 8192,
                    len: 1808
                },
                Segment::Request {
                    msn: 1,
                    gen: 0,
                    offset: 0,
                    len: 0
                },
            ]
        );
    }

    #[test]
    fn segments_end_at_scatter_gather_element_ends() {
        use super::super::{SgList, Sge};
        let sge = |len| Sge {
            lkey: 1,
            addr: 0,
            len,
        };
        // 5,000 + 0 + 100 + 4,096 bytes: the empty element is skipped.
        let list = SgList::try_from(&[sge(5_000), sge(0), sge(100), sge(4_096)][..]).unwrap();
        let mut q = qp();
        q.sq.push_back(SendWqe::new(
            SendWr::new(0, SendOp::Send, list),
            0,
            0,
            None,
            false,
        ));
        let limit = SegLimit::new(4096 + 60);
        let mut got = Vec::new();
        while let Some((Segment::Request { offset, len, .. }, _)) =
            q.next_segment(Instant::ZERO, limit)
        {
            got.push((offset, len));
        }
        assert_eq!(
            got,
            vec![(0, 4096), (4096, 904), (5_000, 100), (5_100, 4_096)]
        );
        let w = &q.sq[0];
        assert_eq!(w.msg_len(), 9_196);
        assert_eq!(
            (
                w.segment_room(4_999),
                w.segment_room(5_000),
                w.segment_room(9_196)
            ),
            (1, 100, 0)
        );
        let pieces: Vec<_> = list.pieces(4_990, 120).unwrap().collect();
        assert_eq!(pieces, vec![(1, 4_990, 10), (1, 0, 100), (1, 0, 10)]);
        assert!(list.pieces(9_000, 197).is_none(), "past the end");
    }

    #[test]
    fn a_segment_joining_a_batch_fits_the_batch_segment_size() {
        let limit = SegLimit::new(4096 + 60);
        for op in [
            Opcode::Send,
            Opcode::Write,
            Opcode::WriteImm,
            Opcode::ReadResp,
        ] {
            assert_eq!(limit.payload(op), 4096, "{op:?}");
        }
        // A batch of WRITE segments (52-byte headers): a WRITE_IMM segment
        // (60) in it carries 8 bytes less, a SEND segment (44) no more.
        let batch = limit.within(52 + 4096);
        assert_eq!(batch.payload(Opcode::Write), 4096);
        assert_eq!(batch.payload(Opcode::WriteImm), 4088);
        assert_eq!(batch.payload(Opcode::Send), 4096);
        let mut q = qp();
        q.sq.push_back(wqe(0, SendOp::Send, 5000));
        let (s, full) = q.next_segment(Instant::ZERO, limit).unwrap();
        assert!(matches!(s, Segment::Request { len: 4096, .. }) && full);
        let (s, full) = q.next_segment(Instant::ZERO, limit).unwrap();
        assert!(matches!(s, Segment::Request { len: 904, .. }) && !full);
    }

    #[test]
    fn fence_and_read_limit_hold_requests_back() {
        let mut q = qp();
        q.max_rd_atomic = 1;
        let r = super::super::RemoteAddr { rkey: 1, addr: 0 };
        q.sq.push_back(wqe(0, SendOp::Read(r), 100));
        q.sq.push_back(wqe(1, SendOp::Read(r), 100));
        let mut w = wqe(2, SendOp::Write(r), 100);
        w.wr.fence = true;
        q.sq.push_back(w);
        let now = Instant::ZERO;
        assert!(matches!(
            q.next_segment(now, SegLimit::new(1000)).map(|s| s.0),
            Some(Segment::Request { msn: 0, len: 0, .. })
        ));
        assert_eq!(
            q.next_segment(now, SegLimit::new(1000)).map(|s| s.0),
            None,
            "second READ waits for max_rd_atomic"
        );
        q.reads_outstanding = 0;
        assert!(matches!(
            q.next_segment(now, SegLimit::new(1000)).map(|s| s.0),
            Some(Segment::Request { msn: 1, .. })
        ));
        assert_eq!(
            q.next_segment(now, SegLimit::new(1000)).map(|s| s.0),
            None,
            "fenced WRITE waits for the READs"
        );
        assert!(!q.has_send_work(now));
        q.reads_outstanding = 0;
        assert!(q.has_send_work(now));
    }

    #[test]
    fn rnr_wait_and_resend() {
        let mut q = qp();
        q.sq.push_back(wqe(0, SendOp::Send, 10));
        let t0 = Instant::from_nanos(1000);
        assert!(q
            .next_segment(t0, SegLimit::new(1000))
            .map(|s| s.0)
            .is_some());
        q.sq[0].gen = 1;
        q.resend.push_back((0, 0));
        q.rnr_wait_until = Some(Instant::from_nanos(5000));
        assert!(!q.has_send_work(t0));
        assert_eq!(q.next_segment(t0, SegLimit::new(1000)).map(|s| s.0), None);
        let t1 = Instant::from_nanos(5000);
        assert!(q.has_send_work(t1));
        assert_eq!(
            q.next_segment(t1, SegLimit::new(1000)).map(|s| s.0),
            Some(Segment::Request {
                msn: 0,
                gen: 1,
                offset: 0,
                len: 10
            })
        );
        assert_eq!(q.next_segment(t1, SegLimit::new(1000)).map(|s| s.0), None);
    }

    #[test]
    fn retires_only_contiguous_complete_messages() {
        let mut q = qp();
        let acc = |complete| {
            Incoming::Accepted(Accepted {
                opcode: Opcode::Write,
                gen: 0,
                len: 1,
                received: 1,
                complete,
                recv_seq: 0,
                imm: None,
                rkey: 0,
                addr: 0,
            })
        };
        *q.incoming_slot(1).unwrap() = acc(true);
        assert_eq!(q.retire_in_order(|_, _| Ok(())), 0);
        *q.incoming_slot(0).unwrap() = acc(true);
        *q.incoming_slot(2).unwrap() = acc(false);
        assert_eq!(q.retire_in_order(|_, _| Ok(())), 2);
        assert_eq!(q.msn_done, 2);
        assert_eq!(q.incoming_slot(1), Err(IncomingReject::Duplicate));
        assert_eq!(
            q.incoming_slot(2 + MSG_WINDOW).map(|_| ()),
            Err(IncomingReject::OutOfWindow)
        );
    }
}
