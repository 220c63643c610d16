//! QP work shared by the receive and transmit paths: completing requests in
//! order, failing a QP, executing retired messages, connection timers.

use super::{Endpoint, Event};
use crate::connection::{
    Connection, ConnectionError, ConnectionState, CsnKind, Ctrl, LossCause, PathEvent,
};
use crate::consts::{
    REPATH_ALL_MIN_DRAWS, REPATH_MAX_BACKOFF, REPATH_QUEUED_RTTS, REPATH_ROUNDS,
    REPATH_WINDOW_SHARE,
};
use crate::rng::Rng;
use crate::time::Instant;
use crate::verbs::qp::{Accepted, Incoming, ReadResp};
use crate::verbs::{
    AccessFlags, CompletionQueue, CqHandle, Qpn, RecvWr, WcOpcode, WcStatus, WorkCompletion,
};
use crate::wire::seq::seq_lt;
use crate::wire::{NakCode, NakEntry, Opcode};
use std::collections::VecDeque;

/// Adds a completion to its queue; reports an overrun once.
pub(crate) fn push_wc(
    cqs: &mut [CompletionQueue],
    events: &mut VecDeque<Event>,
    cq: CqHandle,
    wc: WorkCompletion,
) {
    if let Some(q) = cqs.get_mut(cq.0 as usize) {
        if q.push(wc) {
            events.push_back(Event::CqOverrun(cq));
        }
    }
}

impl Endpoint {
    /// Moves a QP to ERROR: the request `failing` (by MSN) completes with its
    /// status, every other outstanding request and receive is flushed.
    /// `event` says whether to report the error.
    pub(crate) fn fail_qp(&mut self, qpn: Qpn, failing: Option<(u32, WcStatus)>, event: bool) {
        let Some(idx) = self.qp_index(qpn) else {
            return;
        };
        let Endpoint {
            qps,
            mrs,
            cqs,
            events,
            ..
        } = self;
        let Some(q) = qps[idx].as_mut() else { return };
        let was_error = q.state == QpState::Error;
        let sq: Vec<_> = q.sq.drain(..).collect();
        for w in &sq {
            let status = match failing {
                Some((msn, st)) if msn == w.msn => st,
                _ => WcStatus::WrFlushError,
            };
            if w.has_ref {
                mrs.add_list_refs(&w.wr.local, -1);
            }
            let wc = q.send_wc(w, status);
            push_wc(cqs, events, q.send_cq, wc);
        }
        let rq: Vec<_> = q.rq.drain(..).collect();
        for r in &rq {
            mrs.add_list_refs(&r.sge, -1);
            let wc = q.recv_flush_wc(r);
            push_wc(cqs, events, q.recv_cq, wc);
        }
        for r in q.read_resps.drain(..) {
            mrs.add_ref_rkey(r.rkey, -1);
        }
        q.sq_base_msn = q.next_msn;
        q.rq_base_seq = q.rq_base_seq.wrapping_add(rq.len() as u32);
        q.send_idx = 0;
        q.send_offset = 0;
        q.resend.clear();
        q.reads_outstanding = 0;
        q.rnr_wait_until = None;
        q.incoming.clear();
        q.deferred_fatal = None;
        q.state = QpState::Error;
        if event && !was_error {
            let status = failing.map_or(WcStatus::WrFlushError, |f| f.1);
            events.push_back(Event::QpError { qpn, status });
            tracing::debug!(?qpn, ?status, "QP moved to the error state");
        }
    }

    /// Declares path `pi` failed: it moves to a source port no other path
    /// uses (a new ECMP route) and carries one probe packet at a time until
    /// it delivers again.
    pub(crate) fn fail_path(&mut self, ci: usize, pi: usize, why: &'static str, now: Instant) {
        let min_window = u64::from(self.config.mtu);
        let Some(c) = self.conns[ci].as_mut() else {
            return;
        };
        // A port no path uses; with none to spare the path keeps its port
        // (and its route) but still probes before it carries traffic again.
        let new_port = unused_port(&self.config.source_ports, &mut self.rng, c, now)
            .unwrap_or(c.paths_tx[pi].src_port);
        let p = &mut c.paths_tx[pi];
        tracing::debug!(
            conn = ci,
            path = p.id,
            old = p.src_port,
            new = new_port,
            why,
            "path failed: new source port"
        );
        p.fail(new_port, min_window);
        c.stats.path_failures += 1;
    }

    /// After an ACK: completes path moves whose old route drained, moves
    /// every slow path (`Connection::slow_paths`) to a new source port,
    /// and moves a starved path to a new source port (a new ECMP route): one whose
    /// window was cut `REPATH_ROUNDS` rounds in a row and is below the
    /// connection's mean path window / `REPATH_WINDOW_SHARE` (the smallest
    /// such window first); or, where every path is queued past
    /// `REPATH_QUEUED_RTTS` least RTTs, the slowest. One path at a time
    /// (two where every window is at its minimum or every path is queued,
    /// `REPATH_ALL_MIN_DRAWS`: draws, each undone if it gained nothing),
    /// the n-th move at least
    /// `REPATH_COOLDOWN_RTTS` × 2^min(n, `REPATH_MAX_BACKOFF`) smoothed
    /// RTTs after the one before.
    ///
    /// Spraying over per-path windows shifts traffic away from a crowded
    /// route, but cannot reach a route no path hashes onto: with 16 paths
    /// over 4 spines, one connection in 25 has no path over some spine.
    pub(crate) fn move_paths(&mut self, ci: usize, now: Instant) {
        let Some(c) = self.conns[ci].as_mut() else {
            return;
        };
        let mut moving = false;
        for p in c.paths_tx.iter_mut() {
            if p.finish_move() {
                c.stats.path_moves += 1;
                tracing::debug!(conn = ci, path = p.id, port = p.src_port, "path moved");
            }
            moving |= p.move_to.is_some();
        }
        // Slow routes first, each path on its own (no cooldown: a path is
        // judged again only after `SLOW_PATH_SAMPLES` on its new route).
        for pi in c.slow_paths() {
            let Some(port) = unused_port(&self.config.source_ports, &mut self.rng, c, now) else {
                break;
            };
            let p = &mut c.paths_tx[pi];
            let old = p.src_port;
            tracing::debug!(
                conn = ci,
                path = p.id,
                old,
                new = port,
                srtt_us = p.rtt.srtt().map_or(0, |s| s.as_micros() as u64),
                "slow path moves to a new source port"
            );
            // What waits in the slow route's queue holds up its messages
            // for as long as the queue is deep: it goes again on other
            // paths now (a copy that still arrives is a harmless
            // duplicate), and the path takes its new route at once.
            let mut lost = Vec::new();
            p.expire(now, LossCause::Time, |e| {
                if let PathEvent::Lost { csn } = e {
                    lost.push(csn);
                }
            });
            if p.start_slow_move(port) {
                c.stats.path_moves += 1;
            }
            c.recount_in_flight();
            c.retransmit_lost(&lost);
            moving = true;
            c.slow_ports.note(old, now);
            c.rearm_draws(now);
        }
        // A draw (below) that gained nothing goes back to the port it left:
        // drawn where every route looked alike, it may have left a route
        // that only it used (PROTOCOL §9.1).
        for pi in 0..c.paths_tx.len() {
            let p = &c.paths_tx[pi];
            let Some(d) = p.drawn else {
                continue;
            };
            if p.move_to.is_some() || now < d.judge_at {
                continue;
            }
            let gained = p.rtt.srtt().is_some_and(|s| s < d.srtt - d.srtt / 8);
            let taken = c.uses_port(d.from);
            let p = &mut c.paths_tx[pi];
            p.drawn = None;
            if !gained && !taken && p.state == crate::connection::PathState::Active {
                tracing::debug!(
                    conn = ci,
                    path = p.id,
                    port = d.from,
                    "a drawn path gained nothing: back to its port"
                );
                if p.start_move(d.from) {
                    c.stats.path_moves += 1;
                }
                moving = true;
            }
        }
        if moving || c.paths_tx.len() < 2 || now < c.next_move_at {
            return;
        }
        // A candidate: congested round after round, with a window far below
        // its siblings' (its route is crowded where theirs are not). Moving
        // it costs little: it carries little.
        // Where windows are down at their minimum they no longer tell
        // routes apart. Then a path whose RTT is twice the least crowded
        // path's qualifies (a route with fewer paths on it has room), and,
        // where every active path is at its minimum, any congested one: a
        // route that no path uses is found only by moving, and where every
        // route is the bottleneck the cooldown's backoff makes moves rare.
        let active = || {
            c.paths_tx
                .iter()
                .filter(|p| p.state == crate::connection::PathState::Active)
        };
        // Every path queued past the least RTT ever seen by more than the
        // delay target: every route is a bottleneck, or some route has no
        // path, or the delay is one all paths share (PROTOCOL §14, Delay).
        // The windows need not be at their minimum then (the delay signal
        // discounts a shared delay), and only a move can tell.
        let queued_everywhere = c.rtt.min_rtt().is_some_and(|least| {
            let over = (least * REPATH_QUEUED_RTTS).max(least + self.config.delay_target);
            active().count() >= 2 && active().all(|p| p.rtt.srtt().is_some_and(|s| s >= over))
        });
        // Otherwise only a path congested round after round qualifies, and
        // on most ACKs there is none: the rest is not worth computing.
        if !queued_everywhere && !active().any(|p| p.cc.congested_rounds() >= REPATH_ROUNDS) {
            return;
        }
        let mean = c.window() / c.paths_tx.len() as u64;
        let fastest = active().filter_map(|p| p.rtt.srtt()).min();
        let all_min = active().all(|p| p.cc.at_min());
        let mut candidates: Vec<usize> = c
            .paths_tx
            .iter()
            .enumerate()
            .filter(|(_, p)| {
                let crowded = p.cc.at_min()
                    && (all_min
                        || fastest.is_some_and(|f| p.rtt.srtt().is_some_and(|s| s >= f * 2)));
                p.state == crate::connection::PathState::Active
                    && (queued_everywhere
                        || p.cc.congested_rounds() >= REPATH_ROUNDS
                            && (p.cc.window().saturating_mul(REPATH_WINDOW_SHARE) < mean
                                || crowded))
            })
            .map(|(i, _)| i)
            .collect();
        if queued_everywhere {
            // The slowest route first: the most crowded, where a route no
            // path uses would help most.
            candidates.sort_by_key(|&i| (core::cmp::Reverse(c.paths_tx[i].rtt.srtt()), i));
        } else {
            // The smallest window first; among equals, the slowest route.
            candidates.sort_by_key(|&i| {
                let p = &c.paths_tx[i];
                (p.cc.window(), core::cmp::Reverse(p.rtt.srtt()), i)
            });
        }
        // Where every window is at its minimum, or every route is queued,
        // windows no longer show which route has room, and a move is a
        // draw among the routes: two paths draw at once, so that a route
        // no path uses is found in half the moves (each waits for the
        // cooldown, which doubles).
        let draws = if all_min || queued_everywhere {
            REPATH_ALL_MIN_DRAWS
        } else {
            1
        };
        let mut moved = false;
        let judge_at = now + c.move_cooldown(0);
        for &pi in candidates.iter().take(draws) {
            let Some(port) = unused_port(&self.config.source_ports, &mut self.rng, c, now) else {
                break;
            };
            let p = &mut c.paths_tx[pi];
            p.drawn = match (draws > 1, p.rtt.srtt()) {
                (true, Some(srtt)) => Some(crate::connection::Drawn {
                    from: p.src_port,
                    srtt,
                    judge_at,
                }),
                _ => None,
            };
            tracing::debug!(
                conn = ci,
                path = p.id,
                old = p.src_port,
                new = port,
                rounds = p.cc.congested_rounds(),
                "congested path moves to a new source port"
            );
            if p.start_move(port) {
                c.stats.path_moves += 1;
            }
            moved = true;
        }
        if moved {
            c.next_move_at = now + c.move_cooldown(c.moves_made);
            c.moves_made = c.moves_made.saturating_add(1);
        }
    }

    /// After an ACK: time-based loss detection on every path, and paths that
    /// lose packet after packet while others deliver are declared failed.
    pub(crate) fn detect_path_losses(&mut self, ci: usize, now: Instant) {
        let slack = self.config.ack_delay;
        let min_rto = self.config.min_rto;
        let Some(c) = self.conns[ci].as_mut() else {
            return;
        };
        let evidence = c
            .paths_tx
            .iter()
            .map(|p| p.newest_delivered)
            .max()
            .unwrap_or(Instant::ZERO);
        let mut lost = Vec::new();
        // Whether any path has lost enough in a row to be judged below.
        let mut suspects = false;
        for p in c.paths_tx.iter_mut() {
            // Most paths are idle between small messages: nothing to judge.
            if p.has_records() {
                p.detect_by_time(now, evidence, slack, &c.rtt, |e| {
                    if let PathEvent::Lost { csn } = e {
                        lost.push(csn);
                    }
                });
            }
            suspects |= p.state == crate::connection::PathState::Active
                && p.consecutive_lost >= crate::consts::PATH_FAIL_LOSSES;
        }
        if !lost.is_empty() {
            c.recount_in_flight();
            c.retransmit_lost(&lost);
        }
        if !suspects {
            return;
        }
        let failing: Vec<usize> = (0..c.paths_tx.len())
            .filter(|&i| {
                let p = &c.paths_tx[i];
                // Most paths lose nothing: the cheap test first.
                if p.state != crate::connection::PathState::Active
                    || p.consecutive_lost < crate::consts::PATH_FAIL_LOSSES
                {
                    return false;
                }
                // Random loss loses a packet now and then; a dead route loses
                // everything and delivers nothing for several RTTs, and for
                // longer than its RTT varies: a deep queue whose delay varies
                // (a shaped link's bucket, milliseconds) holds a path's packets
                // well past four *smoothed* RTTs now and then while the other
                // paths' queues are shorter (the kernel fabric at 10% loss:
                // 1,786 healthy paths declared failed in 6 s, 293 with the
                // variance counted).
                // A path that never delivered has no RTT of its own (a
                // route dead from the start, or since before its first ACK):
                // the connection's stands in, else it could never fail, and
                // once its window of packets is lost the scheduler leaves it
                // idle, neither used nor probed, with its port unchanged.
                // And never for less than the minimum RTO, the host's own
                // timing uncertainty: at the start the only RTT is the
                // handshake's, and a burst into a shaped queue held every
                // path past four of those (13 of 16 healthy paths failed in
                // the first milliseconds of a lossless run, re-rolling the
                // connection's ECMP placement).
                let silent = p.estimate(&c.rtt).is_some_and(|(e, s)| {
                    let wait = ((s + e.rttvar()) * 4).max(e.peak() * 2).max(min_rto);
                    now.saturating_since(p.last_delivery) > wait
                });
                // Another path delivered a packet sent after this one's
                // first loss: the network carries what this route drops.
                // (Packets sent before it say nothing: on a host that
                // stalled, every path's ACKs wait in one socket and the
                // first path read would otherwise fail all the others.)
                let overtaken = p.first_lost_at.is_some_and(|lost| {
                    c.paths_tx
                        .iter()
                        .enumerate()
                        .any(|(j, o)| j != i && o.newest_delivered > lost)
                });
                silent && overtaken
            })
            .collect();
        for pi in failing {
            self.fail_path(ci, pi, "silent, losing every packet", now);
        }
    }

    /// Requester: completes, in order, every request at the head of the send
    /// queue that is done.
    pub(crate) fn complete_in_order(&mut self, qpn: Qpn) {
        let Some(idx) = self.qp_index(qpn) else {
            return;
        };
        let Endpoint {
            qps,
            mrs,
            cqs,
            events,
            ..
        } = self;
        let Some(q) = qps[idx].as_mut() else { return };
        while let Some(w) = q.sq.front() {
            // Not yet (fully) sent for the first time: cannot be done.
            if q.send_idx == 0 {
                break;
            }
            let done = if w.is_read() {
                w.read_seen && w.read_received >= u64::from(w.msg_len())
            } else {
                seq_lt(w.msn, q.remote_msn_done)
            };
            if !done {
                break;
            }
            let Some(w) = q.sq.pop_front() else { break };
            q.sq_base_msn = q.sq_base_msn.wrapping_add(1);
            q.send_idx -= 1;
            if w.is_read() {
                q.reads_outstanding = q.reads_outstanding.saturating_sub(1);
            }
            q.resend.retain(|&(m, _)| m != w.msn);
            if w.has_ref {
                mrs.add_list_refs(&w.wr.local, -1);
            }
            if w.wr.signaled {
                let wc = q.send_wc(&w, WcStatus::Success);
                push_wc(cqs, events, q.send_cq, wc);
            }
        }
        // A fatal NAK that waited for the requests before its message.
        let due = q
            .deferred_fatal
            .filter(|&(m, _)| q.sq.front().is_none_or(|w| w.msn == m));
        if let Some((msn, status)) = due {
            self.fail_qp(qpn, Some((msn, status)), true);
        }
    }

    /// Responder: retires complete messages in order, generating receive
    /// completions and queueing READ responses.
    pub(crate) fn retire_messages(&mut self, qpn: Qpn, ci: usize) {
        let Some(idx) = self.qp_index(qpn) else {
            return;
        };
        let (now, hold) = (self.last_now, self.config.ack_hold);
        let Endpoint {
            qps,
            mrs,
            cqs,
            events,
            conns,
            ..
        } = self;
        let Some(q) = qps[idx].as_mut() else { return };
        let retired = q.retire_in_order(|q, a: Accepted| match a.opcode {
            Opcode::Send | Opcode::SendImm | Opcode::WriteImm => {
                // The message was placed in the receive its `recv_seq`
                // named; it must be the one it completes, the oldest. A
                // requester that named another (or a SEND longer than it)
                // breaks the protocol: the message fails, and no receive
                // completes with bytes it does not hold.
                let fits = |r: &RecvWr| {
                    a.opcode == Opcode::WriteImm || u64::from(a.len) <= r.sge.byte_len()
                };
                if a.recv_seq != q.rq_base_seq || !q.rq.front().is_some_and(fits) {
                    tracing::debug!(
                        qpn = q.qpn.0,
                        msn = q.msn_done,
                        recv_seq = a.recv_seq,
                        expected = q.rq_base_seq,
                        "message names a receive that is not the next one"
                    );
                    return Err(NakCode::InvalidRequest);
                }
                let Some(r) = q.rq.pop_front() else {
                    return Err(NakCode::InvalidRequest);
                };
                q.rq_base_seq = q.rq_base_seq.wrapping_add(1);
                mrs.add_list_refs(&r.sge, -1);
                let wc = WorkCompletion {
                    wr_id: r.wr_id,
                    status: WcStatus::Success,
                    opcode: if a.opcode == Opcode::WriteImm {
                        WcOpcode::RecvRdmaWithImm
                    } else {
                        WcOpcode::Recv
                    },
                    byte_len: a.len,
                    imm: a.imm,
                    qpn: q.qpn,
                };
                push_wc(cqs, events, q.recv_cq, wc);
                Ok(())
            }
            Opcode::ReadReq => {
                // The region may have been deregistered (or its key never
                // valid for this PD) since the request arrived: a READ is
                // executed only from a region that still allows it.
                let len = u64::from(a.len);
                let need = AccessFlags::REMOTE_READ;
                if let Err(why) = mrs.remote_access(q.pd, q.access, a.rkey, a.addr, len, need) {
                    tracing::debug!(
                        qpn = q.qpn.0,
                        msn = q.msn_done,
                        rkey = a.rkey,
                        "READ refused at execution: {why}"
                    );
                    return Err(NakCode::RemoteAccess);
                }
                // A zero-length READ names no region (its key is not even
                // checked, as in verbs): it holds none, under key 0, which
                // is never issued.
                let rkey = if a.len > 0 { a.rkey } else { 0 };
                mrs.add_ref_rkey(rkey, 1);
                q.read_resps.push_back(ReadResp {
                    msn: q.msn_done,
                    rkey,
                    addr: a.addr,
                    len: a.len,
                    next_offset: 0,
                    sent_all: false,
                    pkts_sent: 0,
                    pkts_acked: 0,
                });
                Ok(())
            }
            Opcode::Write | Opcode::ReadResp | Opcode::Nop => Ok(()),
        });
        if retired > 0 {
            if let Some(c) = conns[ci].as_mut() {
                // The response about to go (a READ's, or the application's
                // answer) may carry it.
                c.mark_stream_soon(qpn, now, hold);
            }
        }
        // Every message before a failed one is done: now the QP fails.
        if let Some(&Incoming::Failed {
            code,
            local_len_error,
        }) = q.incoming.front()
        {
            if local_len_error {
                if let Some(r) = q.rq.pop_front() {
                    q.rq_base_seq = q.rq_base_seq.wrapping_add(1);
                    mrs.add_list_refs(&r.sge, -1);
                    let wc = WorkCompletion {
                        wr_id: r.wr_id,
                        status: WcStatus::LocalLengthError,
                        opcode: WcOpcode::Recv,
                        byte_len: 0,
                        imm: None,
                        qpn,
                    };
                    push_wc(cqs, events, q.recv_cq, wc);
                }
            }
            let nak = NakEntry {
                qpn: q.remote_qpn,
                msn: q.msn_done,
                code,
                gen: 0,
                rnr_timer_us: 0,
            };
            if let Some(c) = conns[ci].as_mut() {
                // The stream entry says every earlier message succeeded; the
                // NAK after it fails this one.
                c.mark_stream(qpn);
                c.push_nak(nak);
            }
            let status = match code {
                NakCode::RemoteAccess => WcStatus::RemoteAccessError,
                _ => WcStatus::RemoteInvalidRequest,
            };
            // Earlier READs were executed: their responses are still sent
            // (again, if lost) until acknowledged.
            let responses = std::mem::take(&mut q.read_resps);
            self.fail_qp(qpn, None, false);
            if let Some(q) = self.qps[idx].as_mut() {
                q.fatal_nak = Some(nak);
                q.read_resps = responses;
            }
            self.events.push_back(Event::QpError { qpn, status });
        }
    }

    /// A READ response packet of `qpn`/`msn` was delivered.
    pub(crate) fn response_acked(&mut self, qpn: Qpn, msn: u32) {
        let Some(idx) = self.qp_index(qpn) else {
            return;
        };
        let Endpoint { qps, mrs, .. } = self;
        let Some(q) = qps[idx].as_mut() else { return };
        if let Some(pos) = q.read_resps.iter().position(|r| r.msn == msn) {
            let r = &mut q.read_resps[pos];
            r.pkts_acked += 1;
            if r.sent_all && r.pkts_acked >= r.pkts_sent {
                let rkey = r.rkey;
                q.read_resps.remove(pos);
                mrs.add_ref_rkey(rkey, -1);
            }
        }
    }

    /// The NAKs a full report repeats for `qpn`: a refused message at the
    /// head, or the error state.
    pub(crate) fn standing_nak(&mut self, qpn: Qpn) -> Option<NakEntry> {
        let idx = self.qp_index(qpn)?;
        let q = self.qps[idx].as_ref()?;
        if q.state == QpState::Error {
            if let Some(n) = q.fatal_nak {
                return Some(n);
            }
            return Some(NakEntry {
                qpn: q.remote_qpn,
                msn: q.msn_done,
                code: NakCode::RemoteOperation,
                gen: 0,
                rnr_timer_us: 0,
            });
        }
        match q.incoming.front() {
            Some(Incoming::Refused { gen }) => Some(NakEntry {
                qpn: q.remote_qpn,
                msn: q.msn_done,
                code: NakCode::Rnr,
                gen: *gen,
                rnr_timer_us: rnr_us(q.min_rnr_timer),
            }),
            _ => None,
        }
    }

    /// Runs a connection's expired timers.
    pub(crate) fn on_conn_timeout(&mut self, ci: usize, now: Instant) {
        let retry_timeout = self.config.retry_timeout;
        let Some(c) = self.conns[ci].as_mut() else {
            return;
        };
        match c.state {
            ConnectionState::Connecting => {
                if c.hello_deadline.is_some_and(|d| d <= now) {
                    c.hello_deadline = None;
                    if c.hello_attempts >= self.config.handshake_retries {
                        self.end_connection(
                            ci,
                            ConnectionState::Failed,
                            ConnectionError::HandshakeTimeout,
                        );
                    } else {
                        c.ctrl = Some(Ctrl::Hello);
                        c.hello_copies_left = 0;
                    }
                }
                return;
            }
            ConnectionState::Established => {}
            _ => return,
        }
        if c.ack_deadline.is_some_and(|d| d <= now) {
            c.ack_now = true;
            c.ack_deadline = None;
        }
        // RNR back-offs that ended: the QPs may send again.
        for &qpn in &c.qps {
            let idx = (qpn.0 & super::QPN_INDEX_MASK) as usize;
            if let Some(q) = self
                .qps
                .get_mut(idx)
                .and_then(|q| q.as_mut())
                .filter(|q| q.qpn == qpn)
            {
                if q.rnr_wait_until.is_some_and(|t| t <= now) {
                    q.rnr_wait_until = None;
                }
            }
        }
        // Tail-loss probes whose timer ran out.
        let slack = self.config.ack_delay;
        for p in c.paths_tx.iter_mut() {
            p.on_probe_timer(now, slack, &c.rtt);
        }
        // Retransmission timeouts, path by path.
        let mut lost = Vec::new();
        let mut fired = false;
        let mut silent_fires = 0u8;
        let last_delivery_elsewhere = |paths: &[crate::connection::PathTx], me: usize| {
            paths
                .iter()
                .enumerate()
                .filter(|&(i, _)| i != me)
                .map(|(_, p)| p.newest_delivered)
                .max()
        };
        let npaths = c.paths_tx.len();
        for pi in 0..npaths {
            let Some(c) = self.conns[ci].as_mut() else {
                return;
            };
            let p = &c.paths_tx[pi];
            let (Some(oldest), Some(deadline)) = (p.oldest_outstanding(), c.path_deadline(pi))
            else {
                continue;
            };
            if deadline > now {
                continue;
            }
            let rto = p.rto(&c.rtt);
            // A path fails when it times out while another path delivered
            // packets sent after this one's oldest: the network works, this
            // route does not. (Alone, or with every path silent, it is only
            // backed off: that is the peer or the whole network.) No ACK
            // at all for half the timeout is such a silence too, whatever
            // the other paths delivered before it: a peer or a thread off
            // its core stops every path's ACKs alike, and those that came
            // just before make other paths look as if they delivered.
            let acks_stopped = now.saturating_since(c.last_ack_at) >= rto / 2;
            let others_deliver = !acks_stopped
                && last_delivery_elsewhere(&c.paths_tx, pi).is_some_and(|t| t > oldest);
            let probing = p.state == crate::connection::PathState::Probing;
            // Nothing sent since this path's oldest packet got through on
            // any path: the whole connection is silent. The peer or this
            // host stalled (their packets wait in a socket, and their ACKs
            // come when it ends), or every route failed at once. Only the
            // oldest packet goes again, as a probe; the others wait: they
            // are acknowledged when the stall ends, or declared lost by
            // time (PROTOCOL §13.3) once the probe's ACK shows that a
            // later packet got through. A stall no longer sends a window
            // again.
            let silent = acks_stopped || (!others_deliver && p.newest_delivered <= oldest);
            let cutoff =
                Instant::from_nanos(now.as_nanos().saturating_sub(crate::time::nanos(rto)));
            let p = &mut c.paths_tx[pi];
            let mut on_lost = |e| {
                if let PathEvent::Lost { csn } = e {
                    lost.push(csn);
                }
            };
            if silent && !probing {
                p.expire_oldest(&mut on_lost);
                silent_fires += 1;
                c.silent_probe_at = Some(now);
            } else {
                p.expire(cutoff, crate::connection::LossCause::Timeout, &mut on_lost);
            }
            p.backoff += 1;
            fired = true;
            // A second timeout in a row while other paths deliver, or a
            // probe that timed out, fails the path.
            if probing {
                self.fail_path(ci, pi, "probe timed out", now);
            } else if others_deliver && p.backoff >= 2 {
                self.fail_path(ci, pi, "timed out twice while others deliver", now);
            }
        }
        let Some(c) = self.conns[ci].as_mut() else {
            return;
        };
        if fired {
            c.recount_in_flight();
            c.stats.rto_fires += 1;
            c.stats.packets_lost += lost.len() as u64;
            for csn in lost.drain(..) {
                c.queue_retransmit(csn);
            }
            // Timeouts count toward retry_cnt only while nothing gets
            // through, and once per backed-off round: eight paths timing out
            // together after one scheduling stall are one timeout, not eight.
            if c.last_progress > c.last_timeout {
                c.consecutive_rto = 1;
                c.last_timeout = now;
            } else if now >= c.last_timeout + c.timeout_round() || c.consecutive_rto == 0 {
                c.consecutive_rto = c.consecutive_rto.saturating_add(1);
                c.last_timeout = now;
            }
            // A connection silent for a second counted round in a row (not
            // one whose receiver merely drops: that one makes progress in
            // between) may send its probes past the windows.
            if c.consecutive_rto >= 2 {
                let most = c.paths_tx.len().min(usize::from(u8::MAX)) as u8;
                c.timeout_probes = c.timeout_probes.saturating_add(silent_fires).min(most);
            }
            tracing::debug!(conn = ci, n = c.consecutive_rto, "retransmission timeout");
            // And only after the retries had their time (`retry_timeout`
            // each): a short RTO must not turn a host stall into a failure.
            let floor = retry_timeout * (u32::from(c.retry_cnt) + 1);
            if c.consecutive_rto > c.retry_cnt && now.saturating_since(c.last_progress) >= floor {
                c.ctrl = Some(Ctrl::Close(crate::wire::CloseCode::RetryExceeded));
                self.end_connection(ci, ConnectionState::Failed, ConnectionError::RetryExceeded);
                return;
            }
        }
        // Progress probes: a QP whose requests were all delivered but not
        // completed asks the responder where it stands; after `retry_cnt`
        // unanswered probes the request fails (the connection stays up).
        let rto = c.rto();
        let retry_cnt = c.retry_cnt;
        let qps = c.qps.clone();
        for qpn in qps {
            let Some(q) = self.qp_mut(qpn) else { continue };
            if q.probe_deadline(rto).is_none_or(|d| d > now) {
                continue;
            }
            let limit = q.probe_limit(retry_cnt);
            let floor = q.timeout.unwrap_or(retry_timeout) * u32::from(limit);
            let given = q
                .first_probe_at
                .is_none_or(|t| now.saturating_since(t) >= floor);
            if q.probes >= limit && given {
                let oldest = q.sq.front().map(|w| w.msn);
                tracing::debug!(?qpn, "no progress after {} probes", q.probes);
                self.fail_qp(qpn, oldest.map(|m| (m, WcStatus::RetryExceeded)), true);
            } else {
                if q.probes == 0 {
                    q.first_probe_at = Some(now);
                }
                q.probes = q.probes.saturating_add(1);
                q.probe_pending = true;
                q.last_progress = now;
            }
        }
    }

    /// The connection's next deadline.
    pub(crate) fn conn_deadline(&self, ci: usize) -> Option<Instant> {
        let c = self.conns[ci].as_ref()?;
        let mut next: Option<Instant> = None;
        let mut consider = |t: Option<Instant>| {
            if let Some(t) = t {
                next = Some(next.map_or(t, |n| n.min(t)));
            }
        };
        match c.state {
            ConnectionState::Connecting => consider(c.hello_deadline),
            ConnectionState::Established => {
                if c.ack_needed && !c.ack_now {
                    consider(c.ack_deadline);
                }
                // Most paths are idle between small messages: no timer.
                for (pi, p) in c.paths_tx.iter().enumerate() {
                    if p.has_records() {
                        consider(c.path_deadline(pi));
                        consider(p.probe_deadline(self.config.ack_delay, &c.rtt));
                    }
                }
                // Paced data waits for its credit (a spare wake-up at worst;
                // a debt already paid off needs no timer).
                consider(c.pacer.ready_at().filter(|&t| t > self.last_now));
                let rto = c.rto();
                for &qpn in &c.qps {
                    if let Some(q) = self.qp_index(qpn).and_then(|i| self.qps[i].as_ref()) {
                        consider(q.next_timer(rto));
                    }
                }
            }
            _ => {}
        }
        next
    }

    /// Whether the connection has a packet to send now.
    pub(crate) fn wants_send(&self, ci: usize, now: Instant) -> bool {
        let Some(c) = self.conns[ci].as_ref() else {
            return false;
        };
        if c.ctrl.is_some() {
            return true;
        }
        if !c.is_established() {
            return false;
        }
        if c.ack_due(now) {
            return true;
        }
        let (path_room, probe) = c.room_and_probe();
        if probe {
            return true;
        }
        if !path_room {
            return false;
        }
        let paced_ok = c.pacer.ready(now);
        if !c.retx.is_empty() && paced_ok && (c.cwnd_room(c.mtu as u64) || c.timeout_probes > 0) {
            return true;
        }
        if !c.csn_room() {
            return false;
        }
        // The window is asked once, and only if some QP has work for it.
        let mut cwnd = None;
        c.qps.iter().any(|&qpn| {
            self.qp_index(qpn)
                .and_then(|i| self.qps[i].as_ref())
                .is_some_and(|q| {
                    q.probe_pending
                        || q.has_send_work(now)
                            && *cwnd.get_or_insert_with(|| paced_ok && c.cwnd_room(c.mtu as u64))
                })
        })
    }

    /// A CSN was delivered: do what its contents need.
    pub(crate) fn csn_delivered(&mut self, kind: CsnKind) {
        match kind {
            CsnKind::Response { qp, msn, .. } => self.response_acked(qp, msn),
            CsnKind::Request { qp, .. } => {
                if let Some(q) = self.qp_mut(qp) {
                    q.unacked = q.unacked.saturating_sub(1);
                }
            }
            CsnKind::Nop => {}
        }
    }
}

use crate::verbs::QpState;

/// An RNR timer in whole microseconds for the wire.
pub(crate) fn rnr_us(d: core::time::Duration) -> u16 {
    u16::try_from(d.as_micros()).unwrap_or(u16::MAX).max(1)
}

/// A source port from `ports`, drawn at random, that none of `c`'s paths
/// uses or is moving to, and not one that a slow path left lately while
/// another is free; `None` when every port is taken.
fn unused_port(ports: &[u16], rng: &mut Rng, c: &Connection, now: Instant) -> Option<u16> {
    let start = rng.next_u32() as usize % ports.len();
    let free = |port: &u16| !c.uses_port(*port);
    let candidates = || (0..ports.len()).map(|k| ports[(start + k) % ports.len()]);
    // A port a slow path left lately only if nothing else is free. Lately:
    // within the longest wait between congested-path moves. A route that
    // was slow for a moment (a queue, a stall) is not shunned for good:
    // ports are few (32 for `perf`, about 8 per spine of 4), and a spine
    // whose every port is shunned, once no path uses it, could never be
    // found again.
    let memory = c.move_cooldown(REPATH_MAX_BACKOFF);
    candidates()
        .find(|port| free(port) && !c.slow_ports.shuns(*port, now, memory))
        .or_else(|| candidates().find(free))
}
