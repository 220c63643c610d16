//! ACKs riding on DATA (PROTOCOL §6.7, §12): a request/response exchange
//! sends one datagram each way, the ACK of the request coalesced with the
//! response and the other way round; a receiver that only receives
//! acknowledges at once; a held ACK goes alone when no response comes in
//! time; and a coalesced datagram is taken only by an endpoint that said it
//! takes them, only for the connection its ACK names.

mod common;

use common::*;
use metaroce_proto::consts::{ACK_FLAG_COALESCED, DEFAULT_ACK_HOLD};
use metaroce_proto::verbs::*;
use metaroce_proto::wire::{AckBuilder, AckHeader};
use metaroce_proto::{EndpointConfig, Gather, Instant};
use std::time::Duration;

const DELAY: Duration = Duration::from_micros(5);
const MSG: usize = 8;

fn config(coalesce: bool) -> EndpointConfig {
    EndpointConfig {
        paths: 4,
        coalesce_acks: coalesce,
        ..EndpointConfig::default()
    }
}

fn link() -> LinkConfig {
    LinkConfig {
        delay: DELAY,
        ..LinkConfig::perfect()
    }
}

/// Both sides of an 8-byte SEND/RECV exchange: a region each, with the
/// message to send at offset 0 and the receive buffer at offset 64.
struct PingPong {
    p: Pair,
    v: Verbs,
    ma: MrInfo,
    mb: MrInfo,
}

impl PingPong {
    fn new(a: bool, b: bool, gather: bool) -> Self {
        Self::with(config(a), config(b), gather)
    }

    fn with(ca: EndpointConfig, cb: EndpointConfig, gather: bool) -> Self {
        let mut p = Pair::new(ca, cb, 11, link());
        if gather {
            p.gather = Some(Gather::new(1));
        }
        p.connect();
        let v = Verbs::setup(&mut p);
        let reg = |ep: &mut metaroce_proto::Endpoint, pd| {
            ep.reg_mr(
                pd,
                vec![0u8; 128].into_boxed_slice(),
                0,
                AccessFlags::LOCAL_WRITE,
            )
            .unwrap()
        };
        let ma = reg(&mut p.a, v.pda);
        let mb = reg(&mut p.b, v.pdb);
        let mut pp = PingPong { p, v, ma, mb };
        pp.post_recv(true);
        pp.post_recv(false);
        pp
    }

    fn post_recv(&mut self, a: bool) {
        let (ep, qp, m) = if a {
            (&mut self.p.a, self.v.qa, self.ma)
        } else {
            (&mut self.p.b, self.v.qb, self.mb)
        };
        let wr = RecvWr {
            wr_id: 0,
            sge: Sge {
                lkey: m.lkey,
                addr: 64,
                len: MSG as u32,
            }
            .into(),
        };
        ep.post_recv(qp, wr).unwrap();
    }

    /// Puts message `tag` into the sender's region and posts it.
    fn send(&mut self, a: bool, tag: u64) {
        let now = self.p.now;
        let (ep, qp, m) = if a {
            (&mut self.p.a, self.v.qa, self.ma)
        } else {
            (&mut self.p.b, self.v.qb, self.mb)
        };
        ep.mr_mut(m.lkey).unwrap()[..MSG].copy_from_slice(&pattern(tag, MSG));
        let wr = SendWr::new(
            tag,
            SendOp::Send,
            Sge {
                lkey: m.lkey,
                addr: 0,
                len: MSG as u32,
            },
        );
        ep.post_send(now, qp, wr).unwrap();
    }

    /// Runs until a receive completes on `a`'s side (or `b`'s), checks the
    /// message is `tag`'s and posts the next receive; returns the send
    /// completions seen on the way, with their times.
    fn await_recv(&mut self, a: bool, tag: u64, sends: &mut Vec<(u64, Instant)>) {
        let (cqa, cqb) = (self.v.cqa, self.v.cqb);
        let deadline = self.p.now + Duration::from_millis(50);
        let mut got = false;
        let ok = self.p.run_until(deadline, |p| {
            for (side, ep, cq) in [(true, &mut p.a, cqa), (false, &mut p.b, cqb)] {
                for wc in drain_cq(ep, cq) {
                    assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
                    match wc.opcode {
                        WcOpcode::Send => sends.push((wc.wr_id, p.now)),
                        WcOpcode::Recv => {
                            assert_eq!(side, a, "a receive on the wrong side");
                            got = true;
                        }
                        other => panic!("unexpected completion {other:?}"),
                    }
                }
            }
            got
        });
        assert!(ok, "message {tag} did not arrive");
        let (ep, m) = if a {
            (&self.p.a, self.ma)
        } else {
            (&self.p.b, self.mb)
        };
        assert_eq!(
            &ep.mr(m.lkey).unwrap()[64..64 + MSG],
            &pattern(tag, MSG)[..],
            "message {tag} arrived intact"
        );
        self.post_recv(a);
    }

    fn datagrams(&self) -> u64 {
        self.p.sent[0].0 + self.p.sent[1].0
    }
}

/// What `rounds` request/response round trips cost after the first.
struct Exchange {
    /// Datagrams per round trip, both directions.
    per_round: f64,
    /// ACKs sent coalesced by each side.
    coalesced: (u64, u64),
    /// Send completions on each side.
    sends: usize,
    /// Invalid-field rejections at either end.
    invalid: u64,
}

fn exchange(a: bool, b: bool, gather: bool, rounds: u64) -> Exchange {
    let mut pp = PingPong::new(a, b, gather);
    let mut sends = Vec::new();
    // The first round trip: the responder has sent nothing yet, so it
    // acknowledges the request at once.
    pp.send(true, 0);
    pp.await_recv(false, 0, &mut sends);
    pp.send(false, 1000);
    pp.await_recv(true, 1000, &mut sends);
    let before = pp.datagrams();
    for r in 1..=rounds {
        pp.send(true, r);
        pp.await_recv(false, r, &mut sends);
        pp.send(false, 1000 + r);
        pp.await_recv(true, 1000 + r, &mut sends);
    }
    let per_round = (pp.datagrams() - before) as f64 / rounds as f64;
    // The last ACKs go on their own, by the hold.
    pp.p.run_for(Duration::from_millis(1));
    let mut more = Vec::new();
    for (ep, cq) in [(&mut pp.p.a, pp.v.cqa), (&mut pp.p.b, pp.v.cqb)] {
        more.extend(drain_cq(ep, cq));
    }
    assert!(more.iter().all(|w| w.status == WcStatus::Success));
    let (ca, cb) = (pp.p.conn_a.unwrap(), pp.p.conn_b.unwrap());
    let sa = pp.p.a.connection_stats(ca).unwrap();
    let sb = pp.p.b.connection_stats(cb).unwrap();
    assert_eq!(sa.retransmits + sb.retransmits, 0);
    Exchange {
        per_round,
        coalesced: (sa.acks_coalesced, sb.acks_coalesced),
        sends: sends.len() + more.len(),
        invalid: pp.p.a.stats().rejects.invalid_field + pp.p.b.stats().rejects.invalid_field,
    }
}

#[test]
fn a_round_trip_costs_two_datagrams_when_acks_ride_on_data() {
    const ROUNDS: u64 = 50;
    for gather in [false, true] {
        let x = exchange(true, true, gather, ROUNDS);
        assert_eq!(
            x.per_round, 2.0,
            "one datagram each way (gather {gather}): each carries the ACK of the last"
        );
        assert!(
            x.coalesced.0 >= ROUNDS && x.coalesced.1 >= ROUNDS,
            "{:?}",
            x.coalesced
        );
        assert_eq!(x.sends as u64, 2 * (ROUNDS + 1), "every SEND completed");
        assert_eq!(x.invalid, 0);
        // Control: either side without coalescing, and each message costs
        // its own ACK again.
        for (a, b) in [(true, false), (false, true)] {
            let y = exchange(a, b, gather, ROUNDS);
            assert_eq!(y.per_round, 4.0, "a request, a response and their two ACKs");
            assert_eq!(
                y.coalesced,
                (0, 0),
                "no ACK rides to or from a peer that did not ask"
            );
            assert_eq!(y.sends as u64, 2 * (ROUNDS + 1));
            assert_eq!(y.invalid, 0);
        }
    }
}

/// A receiver that sends nothing has nothing for an ACK to ride on: it
/// acknowledges at once, and the sender's completions do not wait for the
/// hold.
#[test]
fn a_receiver_that_only_receives_acknowledges_at_once() {
    let mut pp = PingPong::new(true, true, false);
    let mut sends = Vec::new();
    for r in 0..5 {
        let posted = pp.p.now;
        pp.send(true, r);
        pp.await_recv(false, r, &mut sends);
        let cqa = pp.v.cqa;
        let deadline = pp.p.now + Duration::from_millis(5);
        let mut done = None;
        pp.p.run_until(deadline, |p| {
            if drain_cq(&mut p.a, cqa)
                .iter()
                .any(|w| w.opcode == WcOpcode::Send)
            {
                done = Some(p.now);
            }
            done.is_some()
        });
        let took = done.expect("the SEND completed").saturating_since(posted);
        assert!(
            took < 2 * DELAY + DEFAULT_ACK_HOLD / 4,
            "round {r}: the SEND took {took:?}, so its ACK was held"
        );
    }
    let sb = pp.p.b.connection_stats(pp.p.conn_b.unwrap()).unwrap();
    assert_eq!(sb.acks_coalesced, 0);
}

/// A request from A that B, a responder that has sent lately, received and
/// holds the ACK of for an answer: the exchange, the completions seen on
/// the way, and when the request was posted.
fn a_request_b_holds(b: EndpointConfig) -> (PingPong, Vec<(u64, Instant)>, Instant) {
    let mut pp = PingPong::with(config(true), b, false);
    let mut sends = Vec::new();
    pp.send(true, 0);
    pp.await_recv(false, 0, &mut sends);
    pp.send(false, 1000);
    pp.await_recv(true, 1000, &mut sends);
    pp.p.run_for(Duration::from_micros(100));
    let posted = pp.p.now;
    pp.send(true, 1);
    pp.await_recv(false, 1, &mut sends);
    (pp, sends, posted)
}

/// How long B, a responder that is sending but answers late (200 µs
/// after the request), held its ACK of the request: the time A's SEND took
/// beyond the two link crossings.
fn held_ack_wait(b: EndpointConfig) -> Duration {
    let (mut pp, mut sends, posted) = a_request_b_holds(b);
    let cqa = pp.v.cqa;
    let until = pp.p.now + Duration::from_micros(200);
    let mut done = None;
    pp.p.run_until(until, |p| {
        if done.is_none()
            && drain_cq(&mut p.a, cqa)
                .iter()
                .any(|w| w.opcode == WcOpcode::Send)
        {
            done = Some(p.now);
        }
        p.now >= until
    });
    let took = done
        .expect("the SEND completed before the answer")
        .saturating_since(posted);
    pp.send(false, 1001);
    pp.await_recv(true, 1001, &mut sends);
    took.saturating_sub(2 * DELAY)
}

/// The held ACK goes on its own once the hold is over, not with the late
/// answer.
#[test]
fn a_held_ack_goes_alone_when_the_answer_is_late() {
    let waited = held_ack_wait(config(true));
    assert!(
        waited >= DEFAULT_ACK_HOLD && waited <= DEFAULT_ACK_HOLD * 2,
        "the ACK waited {waited:?}: the hold ({DEFAULT_ACK_HOLD:?}), no more"
    );
}

/// A held ACK is still owed within the delayed-ACK time: a hold longer
/// than the ACK delay ends with it.
#[test]
fn the_hold_is_bounded_by_the_ack_delay() {
    let delay = Duration::from_micros(8);
    let waited = held_ack_wait(EndpointConfig {
        ack_hold: Duration::from_micros(50),
        ack_delay: delay,
        ..config(true)
    });
    assert!(
        waited >= delay && waited < 2 * delay,
        "the ACK waited {waited:?}, for an ACK delay of {delay:?}"
    );
}

/// Rewrites the first DATA packet B sends to A as a coalesced datagram:
/// a bare ACK for `ack_cid` (the DATA's own connection unless `other`)
/// followed by that DATA packet.
fn coalesce_first_data(p: &mut Pair, other: bool) {
    let mut done = false;
    p.on_wire = Some(Box::new(move |to_b, bytes| {
        if to_b || done || bytes.get(1) != Some(&0x01) {
            return;
        }
        done = true;
        let cid = u32::from_be_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]);
        let mut out = vec![0u8; 64];
        let h = AckHeader {
            dst_cid: if other { cid ^ 1 } else { cid },
            ..AckHeader::default()
        };
        let n = AckBuilder::new(&mut out, h)
            .unwrap()
            .finish_coalesced()
            .unwrap();
        assert_eq!(out[2] & ACK_FLAG_COALESCED, ACK_FLAG_COALESCED);
        out.truncate(n);
        out.extend_from_slice(bytes);
        *bytes = out;
    }));
}

/// A coalesced datagram is taken whole by an endpoint that takes them; an
/// endpoint that did not say so refuses it whole, as does any endpoint when
/// the DATA is not for the ACK's connection; refused, the message comes
/// again and arrives intact.
#[test]
fn coalesced_datagrams_are_taken_only_as_advertised() {
    for (a_takes, other, refused) in [
        (true, false, false),
        (false, false, true),
        (true, true, true),
    ] {
        let mut pp = PingPong::new(a_takes, true, false);
        coalesce_first_data(&mut pp.p, other);
        let mut sends = Vec::new();
        pp.send(false, 7);
        pp.await_recv(true, 7, &mut sends);
        let sb = pp.p.b.connection_stats(pp.p.conn_b.unwrap()).unwrap();
        let invalid = pp.p.a.stats().rejects.invalid_field;
        let case = format!("A takes {a_takes}, other connection {other}");
        if refused {
            assert_eq!(invalid, 1, "{case}: refused, and counted");
            assert!(
                sb.retransmits >= 1,
                "{case}: the DATA was not taken, so it came again"
            );
        } else {
            assert_eq!(invalid, 0, "{case}");
            assert_eq!(
                sb.retransmits, 0,
                "{case}: the DATA after the ACK was taken"
            );
            let sa = pp.p.a.connection_stats(pp.p.conn_a.unwrap()).unwrap();
            assert!(sa.acks_received >= 1, "{case}: so was the ACK");
        }
    }
}

/// An application that destroys its QP is done with it, and may exit next:
/// the ACK held for an answer to ride on goes at once, not when the hold
/// is over (the peer's last SEND, waiting for it, ran out of retries once
/// the process had exited). The control is
/// [`a_held_ack_goes_alone_when_the_answer_is_late`]: the same exchange
/// without the destroy waits the hold.
#[test]
fn a_held_ack_goes_at_once_when_the_qp_is_destroyed() {
    let (mut pp, _, posted) = a_request_b_holds(config(true));
    pp.p.b.destroy_qp(pp.v.qb).unwrap();
    let cqa = pp.v.cqa;
    let until = pp.p.now + DEFAULT_ACK_HOLD;
    let mut done = None;
    pp.p.run_until(until, |p| {
        if drain_cq(&mut p.a, cqa)
            .iter()
            .any(|w| w.opcode == WcOpcode::Send && w.status == WcStatus::Success)
        {
            done = Some(p.now);
        }
        done.is_some()
    });
    let took = done
        .expect("A's SEND completed within the hold")
        .saturating_since(posted);
    assert!(
        took < 2 * DELAY + DEFAULT_ACK_HOLD / 4,
        "the SEND took {took:?}: the destroyed QP's side held its ACK"
    );
}
