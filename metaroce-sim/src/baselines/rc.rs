//! Host-side machinery shared by the RC baselines: queue pairs, DCQCN
//! pacing, ACK/NAK/CNP generation, RTO timers and transmit scheduling.
//!
//! A host keeps one sending QP per destination host and one receiving QP
//! per source host; flows to the same destination are messages posted in
//! order on the same QP. Each QP uses one fixed UDP source port (and one
//! plane), so it follows a single path through the fabric. What happens on
//! loss is the [`RecoveryScheme`]'s business.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::fmt::Debug;

use super::dcqcn::Dcqcn;
use super::header::{RcHeader, RcKind};
use super::message::MessageQueue;
use super::BaselineParams;
use crate::packet::{Ecn, HostId, Packet, ROCEV2_UDP_PORT};
use crate::rng::mix64;
use crate::time::{ps_to_ns_ceil, Nanos, PS_PER_NS};
use crate::transport::{
    AppEvent, Delivery, FlowStart, PlaneMask, SimTransport, TransportEnv, TransportStats,
};

/// Sender half of a loss-recovery scheme (one per sending QP).
pub trait SenderRecovery: Debug {
    /// A fresh QP's sender state.
    fn new(params: &BaselineParams, env: &TransportEnv) -> Self;
    /// The next PSN to transmit, below `posted_end` (the first PSN not yet
    /// posted), and whether it is a retransmission. Marks it as sent.
    fn next_psn(&mut self, posted_end: u64) -> Option<(u64, bool)>;
    /// An ACK, NAK or SACK arrived; returns `true` if it shows progress.
    fn on_feedback(&mut self, hdr: &RcHeader) -> bool;
    /// Every PSN below this is acknowledged.
    fn una(&self) -> u64;
    /// Some sent PSN is not yet acknowledged.
    fn has_outstanding(&self) -> bool;
    /// The retransmission timer fired.
    fn on_timeout(&mut self);
    /// Current retransmission timeout.
    fn rto_ns(&self) -> Nanos;
}

/// Receiver half of a loss-recovery scheme (one per receiving QP).
pub trait ReceiverRecovery: Debug {
    /// A fresh QP's receiver state.
    fn new(params: &BaselineParams) -> Self;
    /// A data packet arrived. Push what becomes deliverable (in order) to
    /// `deliver`; return the feedback to send, if any.
    fn on_data(&mut self, hdr: &RcHeader, deliver: &mut VecDeque<AppEvent>) -> Option<RcHeader>;
}

/// A loss-recovery scheme: a pair of sender and receiver halves.
pub trait RecoveryScheme: Debug {
    /// Sender half.
    type Sender: SenderRecovery;
    /// Receiver half.
    type Receiver: ReceiverRecovery;
}

#[derive(Debug)]
struct SendQp<S> {
    dst: HostId,
    plane: u8,
    src_port: u16,
    msgs: MessageQueue,
    rec: S,
    cc: Dcqcn,
    next_send_ps: u64,
    pace_wait: bool,
    in_ready: bool,
    last_progress: Nanos,
    armed: Option<Nanos>,
}

impl<S: SenderRecovery> SendQp<S> {
    fn deadline(&self) -> Option<Nanos> {
        let rto = self
            .rec
            .has_outstanding()
            .then(|| self.last_progress + self.rec.rto_ns());
        let pace = self.pace_wait.then(|| ps_to_ns_ceil(self.next_send_ps));
        [rto, pace, self.cc.next_timer()]
            .into_iter()
            .flatten()
            .min()
    }
}

#[derive(Debug)]
struct RecvQp<R> {
    rec: R,
    plane: u8,
    src_port: u16,
    next_cnp_at: Nanos,
}

/// One host running an RC transport with loss recovery `R`.
#[derive(Debug)]
pub struct RcHost<R: RecoveryScheme> {
    env: TransportEnv,
    params: BaselineParams,
    send: Vec<Option<Box<SendQp<R::Sender>>>>,
    recv: Vec<Option<Box<RecvQp<R::Receiver>>>>,
    ctrl: VecDeque<Packet<RcHeader>>,
    ready: VecDeque<HostId>,
    timers: BinaryHeap<Reverse<(Nanos, HostId)>>,
    events: VecDeque<AppEvent>,
    stats: TransportStats,
}

impl<R: RecoveryScheme> RcHost<R> {
    /// A host transport for `env` tuned by `params`.
    pub fn new(env: &TransportEnv, params: &BaselineParams) -> Self {
        let n = env.hosts as usize;
        RcHost {
            env: env.clone(),
            params: params.clone(),
            send: (0..n).map(|_| None).collect(),
            recv: (0..n).map(|_| None).collect(),
            ctrl: VecDeque::new(),
            ready: VecDeque::new(),
            timers: BinaryHeap::new(),
            events: VecDeque::new(),
            stats: TransportStats::default(),
        }
    }

    /// The UDP source port and plane of the QP from `src` to `dst`: fixed
    /// for the QP's lifetime, as a RoCEv2 NIC derives it from the QP number.
    fn qp_path(&self, src: HostId, dst: HostId) -> (u16, u8) {
        let h = mix64(self.env.seed ^ mix64(((src as u64) << 32) | dst as u64));
        (
            49152 + (h % 16384) as u16,
            ((h >> 32) % self.env.planes as u64) as u8,
        )
    }

    fn send_qp(&mut self, dst: HostId) -> &mut SendQp<R::Sender> {
        if self.send[dst as usize].is_none() {
            let (src_port, plane) = self.qp_path(self.env.host, dst);
            self.send[dst as usize] = Some(Box::new(SendQp {
                dst,
                plane,
                src_port,
                msgs: MessageQueue::new(self.env.mtu),
                rec: R::Sender::new(&self.params, &self.env),
                cc: Dcqcn::new(&self.params.dcqcn, self.env.link_gbps),
                next_send_ps: 0,
                pace_wait: false,
                in_ready: false,
                last_progress: 0,
                armed: None,
            }));
        }
        self.send[dst as usize].as_mut().expect("just created")
    }

    fn make_ready(&mut self, dst: HostId) {
        let qp = self.send[dst as usize].as_mut().expect("qp exists");
        if !qp.in_ready && !qp.pace_wait {
            qp.in_ready = true;
            self.ready.push_back(dst);
        }
    }

    /// Re-arm the QP's timer after its state changed.
    fn touch(&mut self, dst: HostId) {
        let qp = self.send[dst as usize].as_mut().expect("qp exists");
        let d = qp.deadline();
        if d != qp.armed {
            qp.armed = d;
            if let Some(d) = d {
                self.timers.push(Reverse((d, dst)));
            }
        }
    }

    fn control(&mut self, to: HostId, plane: u8, src_port: u16, hdr: RcHeader) {
        self.ctrl.push_back(Packet {
            src: self.env.host,
            dst: to,
            plane,
            src_port,
            dst_port: ROCEV2_UDP_PORT,
            ecn: Ecn::NotEct,
            size: hdr.wire_size(),
            payload: hdr,
        });
    }

    fn on_data(&mut self, now: Nanos, pkt: &Packet<RcHeader>) {
        let src = pkt.src;
        if self.recv[src as usize].is_none() {
            let (src_port, _) = self.qp_path(self.env.host, src);
            self.recv[src as usize] = Some(Box::new(RecvQp {
                rec: R::Receiver::new(&self.params),
                plane: pkt.plane,
                src_port,
                next_cnp_at: 0,
            }));
        }
        let qp = self.recv[src as usize].as_mut().expect("just created");
        let (plane, port) = (qp.plane, qp.src_port);
        let cnp = pkt.ecn == Ecn::Ce && self.params.dcqcn.enabled && now >= qp.next_cnp_at;
        if cnp {
            qp.next_cnp_at = now + self.params.dcqcn.cnp_interval_ns;
        }
        let feedback = qp.rec.on_data(&pkt.payload, &mut self.events);
        if cnp {
            self.stats.cnps += 1;
            self.control(src, plane, port, RcHeader::feedback(RcKind::Cnp, 0));
        }
        if let Some(fb) = feedback {
            self.control(src, plane, port, fb);
        }
    }

    fn on_feedback(&mut self, now: Nanos, pkt: &Packet<RcHeader>) {
        let Some(qp) = self.send[pkt.src as usize].as_mut() else {
            return;
        };
        if pkt.payload.kind == RcKind::Cnp {
            qp.cc.on_cnp(now);
        } else {
            if qp.rec.on_feedback(&pkt.payload) {
                qp.last_progress = now;
            }
            let una = qp.rec.una();
            qp.msgs.retire(una, &mut self.events);
            self.make_ready(pkt.src);
        }
        self.touch(pkt.src);
    }

    fn on_qp_timer(&mut self, now: Nanos, dst: HostId) {
        let qp = self.send[dst as usize].as_mut().expect("qp exists");
        qp.armed = None;
        qp.cc.on_timer(now);
        if qp.pace_wait && ps_to_ns_ceil(qp.next_send_ps) <= now {
            qp.pace_wait = false;
        }
        let mut ready = !qp.pace_wait;
        if qp.rec.has_outstanding() && now >= qp.last_progress + qp.rec.rto_ns() {
            qp.rec.on_timeout();
            qp.last_progress = now;
            self.stats.timeouts += 1;
            ready = true;
        }
        if ready {
            self.make_ready(dst);
        }
        self.touch(dst);
    }

    /// Try to produce a data packet from the QP to `dst`. `None` means the
    /// QP has nothing to send now (it leaves the ready list).
    fn try_send(&mut self, now: Nanos, dst: HostId) -> Option<Packet<RcHeader>> {
        let now_ps = now * PS_PER_NS;
        let host = self.env.host;
        let qp = self.send[dst as usize].as_mut().expect("qp exists");
        qp.in_ready = false;
        if qp.next_send_ps > now_ps {
            qp.pace_wait = true;
            self.touch(dst);
            return None;
        }
        let was_idle = !qp.rec.has_outstanding();
        let (psn, retx) = qp.rec.next_psn(qp.msgs.end_psn())?;
        let seg = qp.msgs.segment(psn);
        let hdr = RcHeader {
            kind: RcKind::Data,
            psn,
            sack_psn: 0,
            flow: seg.flow,
            offset: seg.offset,
            len: seg.len,
            last: seg.last,
        };
        let size = hdr.wire_size();
        let gap_ps = (size as f64 * 8_000.0 / qp.cc.rate_gbps()) as u64;
        qp.next_send_ps = qp.next_send_ps.max(now_ps) + gap_ps;
        qp.cc.on_sent(size as u64);
        if was_idle {
            qp.last_progress = now;
        }
        let pkt = Packet {
            src: host,
            dst: qp.dst,
            plane: qp.plane,
            src_port: qp.src_port,
            dst_port: ROCEV2_UDP_PORT,
            ecn: Ecn::Ect0,
            size,
            payload: hdr,
        };
        self.stats.data_packets += 1;
        self.stats.data_bytes += seg.len as u64;
        if retx {
            self.stats.retransmitted_packets += 1;
        }
        qp.in_ready = true;
        self.ready.push_back(dst);
        self.touch(dst);
        Some(pkt)
    }
}

impl<R: RecoveryScheme> SimTransport for RcHost<R> {
    type Payload = RcHeader;

    fn delivery(&self) -> Delivery {
        Delivery::InOrder
    }

    fn start_flow(&mut self, _now: Nanos, flow: &FlowStart) {
        self.send_qp(flow.dst).msgs.push(flow.flow, flow.bytes);
        self.make_ready(flow.dst);
        self.touch(flow.dst);
    }

    fn handle_packet(&mut self, now: Nanos, pkt: Packet<RcHeader>) {
        match pkt.payload.kind {
            RcKind::Data => self.on_data(now, &pkt),
            RcKind::Ack | RcKind::Nak | RcKind::Sack | RcKind::Cnp => self.on_feedback(now, &pkt),
        }
    }

    fn poll_transmit(&mut self, now: Nanos, idle: PlaneMask) -> Option<Packet<RcHeader>> {
        if let Some(p) = self.ctrl.pop_front() {
            self.stats.control_packets += 1;
            return Some(p);
        }
        for _ in 0..self.ready.len() {
            let dst = self.ready.pop_front()?;
            let plane = self.send[dst as usize].as_ref().expect("qp exists").plane;
            if !idle.contains(plane) {
                self.ready.push_back(dst);
                continue;
            }
            if let Some(p) = self.try_send(now, dst) {
                return Some(p);
            }
        }
        None
    }

    fn poll_timeout(&mut self) -> Option<Nanos> {
        while let Some(&Reverse((d, dst))) = self.timers.peek() {
            if self.send[dst as usize]
                .as_ref()
                .is_some_and(|q| q.armed == Some(d))
            {
                return Some(d);
            }
            self.timers.pop();
        }
        None
    }

    fn handle_timeout(&mut self, now: Nanos) {
        while let Some(&Reverse((d, dst))) = self.timers.peek() {
            if d > now {
                break;
            }
            self.timers.pop();
            if self.send[dst as usize]
                .as_ref()
                .is_some_and(|q| q.armed == Some(d))
            {
                self.on_qp_timer(now, dst);
            }
        }
    }

    fn poll_event(&mut self) -> Option<AppEvent> {
        self.events.pop_front()
    }

    fn stats(&self) -> TransportStats {
        self.stats
    }
}
