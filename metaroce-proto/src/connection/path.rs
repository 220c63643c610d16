//! One path of a connection: the sender's per-path sequence and send record
//! ring, and the receiver's per-path sequence tracking.

use crate::cc::SenderCc;
use crate::consts::{PSN_WINDOW, SACK_BITS, SACK_BYTES};
use crate::reliability::{RingBitmap, RttEstimator, SeqAccept};
use crate::time::Instant;
use crate::wire::seq::{seq_dist, seq_lt};
use crate::wire::AckPathEntry;
use core::time::Duration;

/// A packet sent on a path and not yet released.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct SentPkt {
    pub(crate) csn: u32,
    pub(crate) sent_at: Instant,
    pub(crate) bytes: u32,
    pub(crate) acked: bool,
    pub(crate) lost: bool,
    /// How it was declared lost, while `lost`.
    pub(crate) lost_by: LossCause,
}

/// Declarations by time a path must have made before their record counts
/// (`TIME_JUDGED_MIN`, §13.3).
const TIME_JUDGED_MIN: u32 = 16;

/// Declarations by time are taken as right while fewer than one in
/// `TIME_SPURIOUS_SHARE` turned out spurious (§13.3).
const TIME_SPURIOUS_SHARE: u32 = 8;

/// What declared a packet lost (PROTOCOL §13).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) enum LossCause {
    /// A later packet of the same path was acknowledged (§13.2).
    #[default]
    Sack,
    /// Time-based detection: a packet sent later was delivered, on any
    /// path, and this one is overdue (§13.3).
    Time,
    /// The path's retransmission timeout (§13.3).
    Timeout,
}

/// What an ACK or a timeout did to a path's packets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PathEvent {
    /// The packet carrying `csn` arrived.
    Acked { csn: u32, bytes: u32 },
    /// The packet carrying `csn` is lost.
    Lost { csn: u32 },
}

/// Why a path entry of an ACK was ignored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BogusAck;

/// Public counters of one path.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PathStats {
    /// Path id.
    pub id: u8,
    /// UDP source port (entropy) in use.
    pub src_port: u16,
    /// DATA packets sent (including retransmissions).
    pub packets_sent: u64,
    /// Payload-carrying bytes sent (whole datagrams).
    pub bytes_sent: u64,
    /// Packets acknowledged.
    pub packets_acked: u64,
    /// Packets declared lost (SACK gap or timeout).
    pub packets_lost: u64,
    /// Retransmissions sent on this path.
    pub retransmits: u64,
    /// Packets declared lost (by time or timeout) that were acknowledged
    /// afterwards: the declaration was premature.
    pub spurious_losses: u64,
    /// Of `packets_lost`: declared by time (a packet sent later was
    /// delivered and this one was overdue), not by a gap in the path's
    /// acknowledgements.
    pub lost_by_time: u64,
    /// Of `packets_lost`: declared by the path's retransmission timeout.
    pub lost_by_timeout: u64,
    /// Of `spurious_losses`: those declared by time.
    pub spurious_by_time: u64,
    /// Of `spurious_losses`: those declared by a timeout.
    pub spurious_by_timeout: u64,
    /// Tail-loss probes sent (a NOP beyond the window, when the oldest
    /// packet is overdue by the RTT but not yet by the peak RTT).
    pub tail_probes: u64,
    /// CE marks the peer echoed for this path.
    pub ce_marks: u64,
    /// Smoothed RTT in ns (0 before a sample).
    pub srtt_ns: u64,
    /// Bytes in flight.
    pub in_flight: u64,
    /// The path's congestion window, bytes.
    pub cwnd: u64,
    /// Times the path was declared failed and moved to a new source port.
    pub failures: u64,
    /// Times the path moved to a new source port because its route stayed
    /// congested or was slow (not failed).
    pub moves: u64,
    /// Moves begun because the route was slow: its RTT far above the other
    /// paths' (a gray link), not congested.
    pub slow_moves: u64,
    /// Current state (`None` only in a default value).
    pub state: Option<PathState>,
    /// Plane the path runs on (index into the endpoint's plane addresses).
    pub plane: u8,
}

/// A move drawn where every path was queued (PROTOCOL §9.1), to be judged.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Drawn {
    /// The source port the path left.
    pub(crate) from: u16,
    /// Its smoothed RTT on the route it left.
    pub(crate) srtt: Duration,
    /// When its new route is judged.
    pub(crate) judge_at: Instant,
}

/// Sender side of a path.
#[derive(Debug)]
pub(crate) struct PathTx {
    pub(crate) id: u8,
    /// Plane (local/remote address pair) the path is bound to.
    pub(crate) plane: u8,
    pub(crate) src_port: u16,
    pub(crate) next_psn: u32,
    pub(crate) una: u32,
    /// Send records, allocated on the first send (an idle path costs none).
    ring: Vec<SentPkt>,
    pub(crate) in_flight: u64,
    pub(crate) rtt: RttEstimator,
    /// The path's own congestion window.
    pub(crate) cc: SenderCc,
    pub(crate) state: PathState,
    /// Timeout backoff exponent; reset when the path delivers.
    pub(crate) backoff: u32,
    /// When the path last delivered a packet.
    pub(crate) last_delivery: Instant,
    /// Send time of the newest packet the path delivered.
    pub(crate) newest_delivered: Instant,
    /// Packets declared lost since the path last delivered one.
    pub(crate) consecutive_lost: u32,
    /// Send time of the oldest of those packets: another path that
    /// delivered a packet sent after it is evidence against this one; one
    /// that delivered only older packets is not (it may simply have been
    /// read first, as after a stall of the host every path's ACKs are).
    pub(crate) first_lost_at: Option<Instant>,
    /// Window to restart from when a probe succeeds.
    restart_window: u64,
    /// A move to this source port is pending: the path takes no new packets
    /// until those on its current route are resolved, so that its PSNs stay
    /// in order on one route.
    pub(crate) move_to: Option<u16>,
    /// The path was drawn off a route where every path was queued (§9.1):
    /// the port it left, its smoothed RTT there, and when the new route is
    /// judged. A draw that gained nothing is undone.
    pub(crate) drawn: Option<Drawn>,
    /// The pending move leaves a slow route: the RTT estimate restarts on
    /// the new one.
    slow_move: bool,
    /// Slow RTT samples of the present route, less the others (see
    /// `Connection::slow_paths`), and the sample count last judged.
    pub(crate) slow_score: u32,
    pub(crate) slow_judged: u32,
    /// Delivery delays of the present route: ACKs that acknowledged
    /// packets of the path, and how long the newest of them took (from its
    /// send to the ACK; a PSN goes once, so the time is its own). Every
    /// ACK that covers the path gives one, where an RTT sample needs the
    /// ACK to echo one of the path's packets: with many paths, a path that
    /// carries a few packets is seldom echoed (PROTOCOL §9.1).
    pub(crate) delivery_samples: u32,
    pub(crate) delivery_latest: Duration,
    /// Least time a packet waits before it is declared lost, by time or by
    /// timeout: a little more than the longest a packet this path declared
    /// lost turned out to take (it was acknowledged after all). Zero until
    /// that happens; decays with every ACK that delivers on the path. A
    /// queue deeper than the RTT estimate allows (a slow link's buffer)
    /// would otherwise turn into retransmissions of packets still in it, and
    /// each one would free window for more packets into the same queue.
    late_floor: Duration,
    /// A tail-loss probe is due on this path (§13.3): its oldest packet is
    /// overdue by the RTT alone, not yet by the peak RTT that declares it
    /// lost. One NOP goes on the path, beyond its window: if the packet was
    /// lost, the probe's ACK shows the gap and it is declared lost at
    /// once, by the path's own order; if it was only late, nothing is sent
    /// twice.
    pub(crate) probe_due: bool,
    /// The PSN the last probe was sent for (one probe per oldest packet),
    /// and when it went: the next waits a whole RTO, backoff included, so
    /// a path whose probes go unanswered (dead, or its ACKs refused) is
    /// not probed ever faster.
    probed_psn: Option<u32>,
    probed_at: Option<Instant>,
    /// Packets this path declared lost by time lately, and how many of
    /// them turned out to have arrived (halved together now and then).
    time_judged: u32,
    time_spurious: u32,
    /// Ring slots whose packet was declared lost and has not been
    /// acknowledged since (bit `slot`): an ACK may still show it arrived.
    lost_slots: [u64; SACK_BITS as usize / 64],
    /// When the path last sent a DATA packet (NOPs included): ACKs are not
    /// acknowledged, so a path that carries only ACKs learns whether its
    /// route still works from a NOP now and then (`check_due`).
    pub(crate) last_data_at: Option<Instant>,
    /// ACKs sent on the path since its last DATA packet.
    pub(crate) acks_carried: u32,
    /// A route check is due: one NOP on the path (§9.1, ACK paths).
    pub(crate) check_due: bool,
    /// Time of the previous ACK that carried this path (for the CC's clock).
    pub(crate) last_ack_at: Instant,
    last_rx_echo: u32,
    last_ce_echo: u32,
    pub(crate) stats: PathStats,
}

/// Whether a path carries traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathState {
    /// Delivering: gets traffic by its score.
    Active,
    /// Declared failed and moved to a new source port: one packet at a time
    /// probes whether the new route delivers.
    Probing,
}

impl PathTx {
    pub(crate) fn new(id: u8, src_port: u16, rtt: RttEstimator, cc: SenderCc) -> Self {
        let restart = cc.window();
        PathTx {
            id,
            plane: 0,
            src_port,
            next_psn: 0,
            una: 0,
            ring: Vec::new(),
            in_flight: 0,
            rtt,
            cc,
            state: PathState::Active,
            backoff: 0,
            last_delivery: Instant::ZERO,
            newest_delivered: Instant::ZERO,
            consecutive_lost: 0,
            first_lost_at: None,
            restart_window: restart,
            move_to: None,
            drawn: None,
            slow_move: false,
            slow_score: 0,
            slow_judged: 0,
            delivery_samples: 0,
            delivery_latest: Duration::ZERO,
            late_floor: Duration::ZERO,
            probe_due: false,
            probed_psn: None,
            probed_at: None,
            time_judged: 0,
            time_spurious: 0,
            lost_slots: [0; SACK_BITS as usize / 64],
            last_data_at: None,
            acks_carried: 0,
            check_due: false,
            last_ack_at: Instant::ZERO,
            last_rx_echo: 0,
            last_ce_echo: 0,
            stats: PathStats {
                id,
                src_port,
                state: Some(PathState::Active),
                ..Default::default()
            },
        }
    }

    /// Whether a packet of `bytes` may go out on this path now: SACK span,
    /// the path's window, and one at a time while probing.
    pub(crate) fn can_send(&self, bytes: u64) -> bool {
        self.has_room()
            && self.move_to.is_none()
            && match self.state {
                PathState::Probing => self.in_flight == 0,
                PathState::Active => {
                    self.in_flight == 0 || self.in_flight + bytes <= self.cc.window()
                }
            }
    }

    /// Whether ACKs should go on this path: it is active, not moving, and
    /// lost nothing since it last delivered (a route that dropped its last
    /// packet may drop ACKs too; it carries them again once it delivers).
    pub(crate) fn carries_acks(&self) -> bool {
        self.state == PathState::Active && self.move_to.is_none() && self.consecutive_lost == 0
    }

    /// An ACK went out on this path at `now`. A path that carried
    /// `ACK_PATH_CHECK_ACKS` ACKs and no DATA for `interval` (or lost its
    /// last packet and sent nothing for an RTO) gets a route check: one NOP.
    pub(crate) fn carried_ack(&mut self, now: Instant) {
        self.acks_carried = self.acks_carried.saturating_add(1);
        if self.last_data_at.is_none() {
            // The interval starts with the first ACK the path carries.
            self.last_data_at = Some(now);
        }
    }

    /// Marks the path for a route check when it is due (see `carried_ack`).
    pub(crate) fn schedule_check(&mut self, now: Instant, interval: Duration, conn: &RttEstimator) {
        if self.state != PathState::Active
            || self.move_to.is_some()
            || self.in_flight != 0
            || self.check_due
        {
            return;
        }
        let suspect = self.consecutive_lost > 0;
        if self.acks_carried < crate::consts::ACK_PATH_CHECK_ACKS && !suspect {
            return;
        }
        let interval = if suspect {
            self.rto(conn)
        } else {
            interval.max(self.rto(conn))
        };
        if self
            .last_data_at
            .is_some_and(|t| now.saturating_since(t) >= interval)
        {
            self.check_due = true;
        }
    }

    /// The path's retransmission timeout, backoff included: RFC 6298's,
    /// and never less than twice the recent peak RTT (a queue that was
    /// that deep lately may be deeper now; a packet in it is no loss).
    /// From the connection's estimate, `conn`, while the path has no
    /// sample of its own.
    pub(crate) fn rto(&self, conn: &RttEstimator) -> Duration {
        let shift = self.backoff.min(16);
        let est = self.estimate(conn).map_or(&self.rtt, |(e, _)| e);
        (est.rto().max(est.peak() * 2) * (1u32 << shift))
            .max(self.late_floor())
            .min(self.rtt.max_rto())
    }

    /// The floor in force (see `late_floor`): at most two smoothed RTTs,
    /// so that one packet held up by a stall of the host does not slow the
    /// path's loss recovery for long. (A late *acknowledgement* looks the
    /// same as a late packet: with ACKs lost too, as at 10% random loss, a
    /// higher cap slows the repair of real losses; four RTTs cost 0.4 point
    /// of goodput there in the simulator, two cost nothing measurable on
    /// the kernel fabric the floor is for.)
    pub(crate) fn late_floor(&self) -> Duration {
        let cap = self.rtt.srtt().map_or(Duration::ZERO, |s| s * 2);
        self.late_floor.min(cap)
    }

    /// When the path's oldest outstanding packet times out: its RTO after
    /// it was sent, plus `lag` (at most one more RTO; see
    /// `Connection::path_deadline`).
    pub(crate) fn deadline(&self, conn: &RttEstimator, lag: Duration) -> Option<Instant> {
        // An idle path (most of them, between small messages) has no
        // deadline: asked first, before the timeout is worked out.
        let oldest = self.oldest_outstanding()?;
        let rto = self.rto(conn);
        Some(oldest + rto + lag.min(rto))
    }

    /// How full the path would be with `bytes` more: lower is better.
    pub(crate) fn load(&self, bytes: u64) -> f64 {
        (self.in_flight + bytes) as f64 / self.cc.window().max(1) as f64
    }

    /// The path delivered something: it is healthy.
    pub(crate) fn delivered(&mut self, now: Instant) {
        self.last_delivery = now;
        self.backoff = 0;
        self.consecutive_lost = 0;
        self.first_lost_at = None;
        if self.state == PathState::Probing {
            // The new route works: back to a normal share at once.
            self.state = PathState::Active;
            self.stats.state = Some(PathState::Active);
            self.cc.reset(self.restart_window);
        }
    }

    /// Starts moving the path to `new_port` (a congested route, not a dead
    /// one); the move happens once nothing is in flight on the old route.
    /// Returns whether it happened at once (nothing was in flight).
    pub(crate) fn start_move(&mut self, new_port: u16) -> bool {
        self.move_to = Some(new_port);
        self.finish_move()
    }

    /// Starts moving a slow path (one whose RTT is far above its
    /// siblings') to `new_port`, as [`start_move`](Self::start_move); its
    /// RTT estimate starts over on the new route.
    pub(crate) fn start_slow_move(&mut self, new_port: u16) -> bool {
        // Left for being slow: no draw to judge any more.
        self.drawn = None;
        self.slow_move = true;
        self.stats.slow_moves += 1;
        self.start_move(new_port)
    }

    /// Completes a pending move whose old route has drained. Returns whether it did.
    pub(crate) fn finish_move(&mut self) -> bool {
        match self.move_to {
            Some(port) if self.in_flight == 0 => {
                self.move_to = None;
                self.src_port = port;
                // A new route: its own congestion history starts over, from
                // the same window (the route it left was crowded, not slow).
                self.cc.reset(self.cc.window());
                self.late_floor = Duration::ZERO;
                self.backoff = 0;
                if core::mem::take(&mut self.slow_move) {
                    self.rtt.restart();
                    self.slow_score = 0;
                    self.slow_judged = 0;
                    self.delivery_samples = 0;
                }
                self.stats.moves += 1;
                true
            }
            _ => false,
        }
    }

    /// Declares the path failed: moves it to `new_port` and starts probing.
    pub(crate) fn fail(&mut self, new_port: u16, min_window: u64) {
        self.drawn = None;
        self.move_to = None;
        // A new route: its probe gets a plain timeout, not the old route's
        // backoff. But a probe that timed out keeps doubling it (the timer
        // raised it): a path whose every probe goes unanswered (a dead
        // plane, or a peer whose ACKs of the path are refused) is probed
        // ever more rarely, up to `max_rto`, not every `min_rto` for ever.
        if self.state != PathState::Probing {
            self.backoff = 0;
        }
        self.state = PathState::Probing;
        self.src_port = new_port;
        self.late_floor = Duration::ZERO;
        self.probe_due = false;
        self.cc.reset(min_window);
        self.stats.failures += 1;
        self.stats.state = Some(PathState::Probing);
    }

    /// Time-based loss detection across paths (after RACK): an outstanding
    /// packet is lost once a packet sent after it was delivered (on any
    /// path: `evidence` is the newest such send time) and it has waited
    /// longer than twice this path's recent peak RTT (and its
    /// smoothed RTT plus a reordering allowance, and the late floor). This
    /// catches the tail of a burst, which no SACK gap reveals, without a
    /// timeout. Sooner, once it has waited the smoothed RTT and the
    /// allowance alone, the path sends a tail-loss probe (`probe_due`).
    ///
    /// A path with no RTT sample of its own (its packets are acknowledged,
    /// but no ACK echoed one of them) is judged by `conn`, the connection's
    /// estimate (§13.3): without one, its tail would wait for the timeout.
    pub(crate) fn detect_by_time(
        &mut self,
        now: Instant,
        evidence: Instant,
        slack: Duration,
        conn: &RttEstimator,
        out: impl FnMut(PathEvent),
    ) -> usize {
        let Some(oldest) = self.oldest_outstanding() else {
            return 0;
        };
        let Some((est, srtt)) = self.estimate(conn) else {
            return 0;
        };
        let probe_wait = Self::probe_wait(est, srtt, slack);
        // On another route a packet sent later may well overtake one in a
        // queue whose delay swings (a shaper's bucket, a stalled thread):
        // the path's own recent peak says how late its packets come.
        let peak = est.peak();
        // Unless this path's declarations by time have lately been right
        // (few turned out spurious: a lossy network with a steady queue),
        // when waiting longer only stalls its window.
        let accurate = self.time_judged >= TIME_JUDGED_MIN
            && self.time_spurious * TIME_SPURIOUS_SHARE < self.time_judged;
        let loss_wait = if accurate {
            probe_wait.max(self.late_floor())
        } else {
            probe_wait.max(peak * 2).max(self.late_floor())
        };
        let by_age =
            Instant::from_nanos(now.as_nanos().saturating_sub(crate::time::nanos(loss_wait)));
        let cutoff = by_age.min(Instant::from_nanos(evidence.as_nanos().saturating_sub(1)));
        if oldest <= cutoff {
            let n = self.expire(cutoff, LossCause::Time, out);
            self.time_judged += n as u32;
            if self.time_judged >= 2 * TIME_JUDGED_MIN {
                // A sliding record: the older half fades.
                self.time_judged /= 2;
                self.time_spurious /= 2;
            }
            return n;
        }
        // Not lost yet: a tail-loss probe, if its time has come.
        self.on_probe_timer(now, slack, conn);
        0
    }

    /// The RTT estimate the path's loss detection, probes, timeout and
    /// failure go by, with its smoothed RTT: its own once it has a
    /// sample, else the connection's, `conn` (none before the
    /// connection's first sample or seed).
    pub(crate) fn estimate<'a>(
        &'a self,
        conn: &'a RttEstimator,
    ) -> Option<(&'a RttEstimator, Duration)> {
        match self.rtt.srtt() {
            Some(s) => Some((&self.rtt, s)),
            None => conn.srtt().map(|s| (conn, s)),
        }
    }

    /// How long the oldest packet waits before a tail-loss probe goes:
    /// the smoothed RTT and a quarter, twice its variance and the peer's
    /// ACK delay; never quicker than a quarter of the minimum RTO (on a
    /// host stack RTTs jump with scheduling).
    fn probe_wait(est: &RttEstimator, srtt: Duration, slack: Duration) -> Duration {
        (srtt + srtt / 4 + est.rttvar() * 2 + slack).max(est.min_rto() / 4)
    }

    /// When the tail-loss probe for the oldest packet is due, if it has
    /// not gone (the probe timer: with every ACK lost or late, nothing
    /// else would look at the path before its timeout): `probe_wait` after
    /// that packet was sent, and half of it after the path last delivered.
    ///
    /// A probe is for a path gone quiet (for half the wait): while its ACKs
    /// keep coming, the next one will show any gap (a probe for every
    /// packet of a standing queue would double the traffic into it). And
    /// the next probe waits a whole RTO after the last.
    pub(crate) fn probe_deadline(&self, slack: Duration, conn: &RttEstimator) -> Option<Instant> {
        self.next_probe(slack, conn).map(|(_, at)| at)
    }

    /// The oldest packet's PSN and when its probe is due (see
    /// [`probe_deadline`](Self::probe_deadline)).
    fn next_probe(&self, slack: Duration, conn: &RttEstimator) -> Option<(u32, Instant)> {
        if self.state != PathState::Active || self.probe_due {
            return None;
        }
        let (est, srtt) = self.estimate(conn)?;
        let (psn, oldest) = self.oldest_outstanding_psn()?;
        (self.probed_psn != Some(psn)).then(|| {
            let wait = Self::probe_wait(est, srtt, slack);
            let after_last = self.probed_at.map_or(Instant::ZERO, |t| t + self.rto(conn));
            let at = (oldest + wait)
                .max(self.last_delivery + wait / 2)
                .max(after_last);
            (psn, at)
        })
    }

    /// Runs the probe timer (see [`probe_deadline`](Self::probe_deadline)):
    /// arms the probe once it is due.
    pub(crate) fn on_probe_timer(&mut self, now: Instant, slack: Duration, conn: &RttEstimator) {
        if let Some((psn, at)) = self.next_probe(slack, conn) {
            if at <= now {
                self.probe_due = true;
                self.probed_psn = Some(psn);
            }
        }
    }

    /// The tail-loss probe went out at `now`.
    pub(crate) fn probe_sent(&mut self, now: Instant) {
        self.probe_due = false;
        self.probed_at = Some(now);
        self.stats.tail_probes += 1;
    }

    /// Whether the path may have a packet outstanding: every packet before
    /// `una` is acknowledged or declared lost, so with `una` at the next
    /// PSN none is, and the path has no timer (no timeout, no tail-loss
    /// probe), which a field comparison tells.
    #[inline]
    pub(crate) fn has_records(&self) -> bool {
        self.una != self.next_psn
    }

    /// Whether another packet fits in the SACK span.
    pub(crate) fn has_room(&self) -> bool {
        seq_dist(self.una, self.next_psn) < SACK_BITS
    }

    fn slot(psn: u32) -> usize {
        (psn % SACK_BITS) as usize
    }

    fn set_lost_slot(&mut self, slot: usize, lost: bool) {
        let (w, m) = (slot / 64, 1u64 << (slot % 64));
        if lost {
            self.lost_slots[w] |= m;
        } else {
            self.lost_slots[w] &= !m;
        }
    }

    /// Marks the packet in `psn`'s slot lost (it must be outstanding).
    fn mark_lost(&mut self, psn: u32, cause: LossCause) -> u32 {
        let slot = Self::slot(psn);
        let p = &mut self.ring[slot];
        p.lost = true;
        p.lost_by = cause;
        match cause {
            LossCause::Sack => {}
            LossCause::Time => self.stats.lost_by_time += 1,
            LossCause::Timeout => self.stats.lost_by_timeout += 1,
        }
        let (bytes, csn, sent_at) = (p.bytes, p.csn, p.sent_at);
        self.in_flight -= u64::from(bytes);
        self.stats.packets_lost += 1;
        self.consecutive_lost += 1;
        self.first_lost_at = Some(self.first_lost_at.map_or(sent_at, |t| t.min(sent_at)));
        self.set_lost_slot(slot, true);
        csn
    }

    /// A packet declared lost was acknowledged: the declaration was
    /// premature, so later ones wait at least as long as it took.
    fn arrived_after_loss(&mut self, slot: usize, now: Instant) {
        let p = &mut self.ring[slot];
        p.acked = true;
        let took = now.saturating_since(p.sent_at);
        self.newest_delivered = self.newest_delivered.max(p.sent_at);
        self.stats.packets_acked += 1;
        self.stats.spurious_losses += 1;
        match p.lost_by {
            LossCause::Sack => {}
            LossCause::Time => {
                self.stats.spurious_by_time += 1;
                self.time_spurious += 1;
            }
            LossCause::Timeout => self.stats.spurious_by_timeout += 1,
        }
        self.late_floor = self.late_floor.max(took + took / 8);
        self.set_lost_slot(slot, false);
    }

    /// Declared-lost packets behind `una` that `e` acknowledges. Only PSNs
    /// within `SACK_BITS` of the next one count: the receiver cannot have
    /// slid its window past them, so its cumulative point covering one
    /// means it arrived.
    fn late_arrivals(&mut self, e: &AckPathEntry, now: Instant, out: &mut impl FnMut(PathEvent)) {
        if self.lost_slots.iter().all(|&w| w == 0) {
            return;
        }
        let base = self.next_psn.wrapping_sub(SACK_BITS);
        for w in 0..self.lost_slots.len() {
            let mut word = self.lost_slots[w];
            while word != 0 {
                let b = word.trailing_zeros();
                word &= word - 1;
                let slot = w * 64 + b as usize;
                // The PSN in the ring's span that uses this slot.
                let off = (slot as u32).wrapping_sub(base) % SACK_BITS;
                let psn = base.wrapping_add(off);
                if !seq_lt(psn, self.una) {
                    continue; // still in the live span: the main walk sees it
                }
                let acked = seq_lt(psn, e.ack_psn)
                    || (seq_lt(e.ack_psn, psn) && e.sack_bit(seq_dist(e.ack_psn, psn) - 1));
                if acked && !self.ring[slot].acked {
                    self.arrived_after_loss(slot, now);
                    let p = self.ring[slot];
                    out(PathEvent::Acked {
                        csn: p.csn,
                        bytes: p.bytes,
                    });
                }
            }
        }
    }

    /// Records a packet; returns its PSN.
    pub(crate) fn record_send(
        &mut self,
        csn: u32,
        now: Instant,
        bytes: u32,
        retransmit: bool,
    ) -> u32 {
        debug_assert!(self.has_room());
        let psn = self.next_psn;
        if self.ring.is_empty() {
            self.ring = vec![SentPkt::default(); SACK_BITS as usize];
        }
        self.set_lost_slot(Self::slot(psn), false);
        self.ring[Self::slot(psn)] = SentPkt {
            csn,
            sent_at: now,
            bytes,
            acked: false,
            lost: false,
            lost_by: LossCause::Sack,
        };
        self.next_psn = psn.wrapping_add(1);
        self.in_flight += u64::from(bytes);
        self.last_data_at = Some(now);
        self.acks_carried = 0;
        self.check_due = false;
        self.stats.packets_sent += 1;
        self.stats.bytes_sent += u64::from(bytes);
        if retransmit {
            self.stats.retransmits += 1;
        }
        psn
    }

    /// Applies one path entry of an ACK that arrived at `now`. Returns the
    /// ECN echo delta `(packets, marked)`.
    #[cfg(test)]
    pub(crate) fn on_ack(
        &mut self,
        e: &AckPathEntry,
        now: Instant,
        out: impl FnMut(PathEvent),
    ) -> Result<(u64, u64), BogusAck> {
        self.on_ack_at(e, now, now, out)
    }

    /// [`on_ack`](Self::on_ack), for an ACK whose packets had all reached
    /// the peer by `reached` (its arrival here less the peer's ACK delay:
    /// neither the time the peer held the ACK nor the time it waited here
    /// for this thread is the route's): the delivery sample counts to it.
    pub(crate) fn on_ack_at(
        &mut self,
        e: &AckPathEntry,
        now: Instant,
        reached: Instant,
        mut out: impl FnMut(PathEvent),
    ) -> Result<(u64, u64), BogusAck> {
        // The peer cannot acknowledge what was never sent.
        if seq_lt(self.next_psn, e.ack_psn) {
            return Err(BogusAck);
        }
        self.late_arrivals(e, now, &mut out);
        let mut highest: Option<u32> = None;
        let mut delivered_any = false;
        let mut newest_sent: Option<Instant> = None;
        // Nothing from the first PSN past the entry's reach on can be
        // acknowledged by it (every PSN before `ack_psn`, and those its SACK
        // bits name, up to the last non-zero byte): the walk stops there
        // instead of visiting every packet in flight.
        let sack_bits = e.sack_len() as u32 * 8;
        let reach = if sack_bits == 0 {
            e.ack_psn
        } else {
            e.ack_psn.wrapping_add(sack_bits + 1)
        };
        // The first packet the walk leaves outstanding: only from there on
        // can anything before the highest acknowledged one be missing.
        let mut hole: Option<u32> = None;
        let mut psn = self.una;
        while psn != self.next_psn && seq_lt(psn, reach) {
            let acked = seq_lt(psn, e.ack_psn)
                || (psn != e.ack_psn && e.sack_bit(seq_dist(e.ack_psn, psn) - 1));
            if !acked && hole.is_none() {
                let p = &self.ring[Self::slot(psn)];
                if !p.acked && !p.lost {
                    hole = Some(psn);
                }
            }
            if acked {
                highest = Some(psn);
                let p = &mut self.ring[Self::slot(psn)];
                if !p.acked {
                    let (csn, bytes) = (p.csn, p.bytes);
                    newest_sent = Some(newest_sent.map_or(p.sent_at, |t| t.max(p.sent_at)));
                    if p.lost {
                        self.arrived_after_loss(Self::slot(psn), now);
                    } else {
                        p.acked = true;
                        self.newest_delivered = self.newest_delivered.max(p.sent_at);
                        self.stats.packets_acked += 1;
                        self.in_flight -= u64::from(bytes);
                    }
                    delivered_any = true;
                    out(PathEvent::Acked { csn, bytes });
                }
            }
            psn = psn.wrapping_add(1);
        }
        // A path delivers in order: anything before an acknowledged packet that
        // is still missing was lost.
        if let (Some(h), Some(from)) = (highest, hole) {
            let mut psn = from;
            while seq_lt(psn, h) {
                let p = &self.ring[Self::slot(psn)];
                if !p.acked && !p.lost {
                    let csn = self.mark_lost(psn, LossCause::Sack);
                    out(PathEvent::Lost { csn });
                }
                psn = psn.wrapping_add(1);
            }
        }
        self.advance_una();
        if let Some(sent) = newest_sent {
            self.delivery_samples = self.delivery_samples.wrapping_add(1);
            self.delivery_latest = reached.saturating_since(sent);
            // How long the path's packets take, where no ACK echoes one of
            // them (§13.3): with many paths, a path is seldom the one
            // echoed, and its peak would miss its queue's swings.
            self.rtt.note_delay_at(now, self.delivery_latest);
        }
        if delivered_any {
            // The floor fades (by 1/512 per delivering ACK) once packets stop
            // turning up after their declared loss.
            self.late_floor -= self.late_floor / 512;
        }
        // ECN echo: cumulative counters, newer when rx_packets moved forward.
        let mut echo = (0, 0);
        if seq_lt(self.last_rx_echo, e.rx_packets) {
            let pkts = seq_dist(self.last_rx_echo, e.rx_packets);
            let marked = seq_dist(self.last_ce_echo, e.ce_packets).min(pkts);
            self.last_rx_echo = e.rx_packets;
            self.last_ce_echo = e.ce_packets;
            self.stats.ce_marks += u64::from(marked);
            echo = (u64::from(pkts), u64::from(marked));
        }
        Ok(echo)
    }

    fn advance_una(&mut self) {
        while self.una != self.next_psn {
            let p = &self.ring[Self::slot(self.una)];
            if !(p.acked || p.lost) {
                break;
            }
            self.una = self.una.wrapping_add(1);
        }
    }

    /// Send time of the oldest packet neither acknowledged nor declared lost.
    pub(crate) fn oldest_outstanding(&self) -> Option<Instant> {
        self.oldest_outstanding_psn().map(|(_, t)| t)
    }

    /// PSN and send time of the oldest packet neither acknowledged nor
    /// declared lost.
    fn oldest_outstanding_psn(&self) -> Option<(u32, Instant)> {
        let mut psn = self.una;
        while psn != self.next_psn {
            let p = &self.ring[Self::slot(psn)];
            if !p.acked && !p.lost {
                return Some((psn, p.sent_at));
            }
            psn = psn.wrapping_add(1);
        }
        None
    }

    /// Declares lost, by `cause`, every outstanding packet sent at or before `cutoff`.
    pub(crate) fn expire(
        &mut self,
        cutoff: Instant,
        cause: LossCause,
        mut out: impl FnMut(PathEvent),
    ) -> usize {
        let mut n = 0;
        let mut psn = self.una;
        while psn != self.next_psn {
            let p = &self.ring[Self::slot(psn)];
            if !p.acked && !p.lost && p.sent_at <= cutoff {
                let csn = self.mark_lost(psn, cause);
                n += 1;
                out(PathEvent::Lost { csn });
            }
            psn = psn.wrapping_add(1);
        }
        self.advance_una();
        n
    }

    /// Declares lost the oldest outstanding packet alone (a timeout while
    /// the whole connection is silent: it goes again as a probe).
    pub(crate) fn expire_oldest(&mut self, mut out: impl FnMut(PathEvent)) -> usize {
        let mut psn = self.una;
        while psn != self.next_psn {
            let p = &self.ring[Self::slot(psn)];
            if !p.acked && !p.lost {
                let csn = self.mark_lost(psn, LossCause::Timeout);
                out(PathEvent::Lost { csn });
                self.advance_una();
                return 1;
            }
            psn = psn.wrapping_add(1);
        }
        0
    }

    pub(crate) fn snapshot(&self) -> PathStats {
        PathStats {
            srtt_ns: self.rtt.srtt().map_or(0, crate::time::nanos),
            in_flight: self.in_flight,
            cwnd: self.cc.window(),
            src_port: self.src_port,
            plane: self.plane,
            ..self.stats
        }
    }
}

/// Receiver side of a path: which PSNs arrived, and the ECN counters.
#[derive(Debug)]
pub(crate) struct PathRx {
    seen: RingBitmap<{ SACK_BITS as usize / 64 }>,
    pub(crate) rx_packets: u32,
    pub(crate) ce_packets: u32,
    pub(crate) dirty: bool,
    /// ACKs still to repeat the path's entry after the one that carried
    /// it, if they have room (PROTOCOL §6.2).
    pub(crate) repeats: u8,
    /// The latest CSN (in sequence order) of a packet the path received
    /// (see [`holds_beyond`](Self::holds_beyond)).
    max_csn: Option<u32>,
    /// Highest PSN received.
    highest: Option<u32>,
}

impl PathRx {
    pub(crate) fn new() -> Self {
        PathRx {
            seen: RingBitmap::new(0),
            rx_packets: 0,
            ce_packets: 0,
            dirty: false,
            repeats: 0,
            max_csn: None,
            highest: None,
        }
    }

    /// Whether `psn` lies within the path's receive window: before
    /// `ack_psn + PSN_WINDOW` (PROTOCOL §9.2). Anything before `ack_psn` is
    /// in it (a late or duplicate packet, whose CSN decides).
    pub(crate) fn psn_in_window(&self, psn: u32) -> bool {
        let cum = self.seen.cum();
        seq_lt(psn, cum) || seq_dist(cum, psn) < PSN_WINDOW
    }

    /// Records `psn`. Returns the outcome and whether it is out of sequence:
    /// it reveals a new hole (beyond the highest PSN plus one) or arrives
    /// below the highest (a late or duplicate packet). Either is worth an
    /// immediate ACK; packets that follow an old hole in order are not.
    ///
    /// The window slides: a lost PSN is never sent again (its data goes out
    /// under a new PSN), so a PSN more than `SACK_BITS` ahead abandons the
    /// holes it leaves behind. The sender only sends it once those packets
    /// are acknowledged or declared lost, so nothing is given up that could
    /// still come.
    pub(crate) fn on_packet(&mut self, psn: u32, ce: bool) -> (SeqAccept, bool) {
        let out_of_order = match self.highest {
            None => psn != 0,
            Some(h) => psn != h.wrapping_add(1),
        };
        if self.highest.is_none_or(|h| seq_lt(h, psn)) {
            self.highest = Some(psn);
        }
        let r = self.seen.insert_sliding(psn);
        if r != SeqAccept::OutOfWindow {
            self.rx_packets = self.rx_packets.wrapping_add(1);
            if ce {
                self.ce_packets = self.ce_packets.wrapping_add(1);
            }
            self.dirty = true;
        }
        (r, out_of_order)
    }

    /// Notes the CSN of a packet the path received.
    pub(crate) fn note_csn(&mut self, csn: u32) {
        if self.max_csn.is_none_or(|m| seq_lt(m, csn)) {
            self.max_csn = Some(csn);
        }
    }

    /// Whether the path received a packet at or after `cum`, the
    /// cumulative CSN: only the path's entry acknowledges such a packet
    /// (PROTOCOL §6.2).
    pub(crate) fn holds_beyond(&self, cum: u32) -> bool {
        self.max_csn.is_some_and(|m| !seq_lt(m, cum))
    }

    /// This path's ACK entry.
    pub(crate) fn entry(&self, path_id: u8) -> AckPathEntry {
        let mut sack = [0u8; SACK_BYTES];
        self.seen.sack_into(&mut sack);
        AckPathEntry {
            path_id,
            ack_psn: self.seen.cum(),
            sack,
            rx_packets: self.rx_packets,
            ce_packets: self.ce_packets,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A connection estimate without a sample: paths go by their own.
    fn conn_rtt() -> RttEstimator {
        RttEstimator::new(
            Duration::from_millis(1),
            Duration::from_micros(10),
            Duration::from_secs(1),
        )
    }

    fn tx() -> PathTx {
        PathTx::new(
            0,
            1000,
            RttEstimator::new(
                Duration::from_millis(1),
                Duration::from_micros(10),
                Duration::from_secs(1),
            ),
            SenderCc::new(1 << 20, 1024, 1 << 24, 1000, Duration::from_micros(100)),
        )
    }

    /// Packets past what an ACK entry reaches (its `ack_psn`, or its last
    /// SACK bit) are neither acknowledged nor declared lost by it, however
    /// many are in flight; those before an acknowledged one that are
    /// missing are lost.
    #[test]
    fn an_ack_touches_nothing_past_its_reach() {
        let mut t = tx();
        for csn in 0..200 {
            t.record_send(1000 + csn, Instant::ZERO, 100, false);
        }
        let events = |t: &mut PathTx, e: &AckPathEntry| {
            let mut ev = Vec::new();
            t.on_ack(e, Instant::ZERO, |x| ev.push(x)).unwrap();
            let acked: Vec<u32> = ev
                .iter()
                .filter_map(|x| match x {
                    PathEvent::Acked { csn, .. } => Some(*csn),
                    _ => None,
                })
                .collect();
            let lost: Vec<u32> = ev
                .iter()
                .filter_map(|x| match x {
                    PathEvent::Lost { csn } => Some(*csn),
                    _ => None,
                })
                .collect();
            (acked, lost)
        };
        // In order up to PSN 10, no SACK: ten acknowledged, nothing lost.
        let mut r = PathRx::new();
        for psn in 0..10 {
            r.on_packet(psn, false);
        }
        let (acked, lost) = events(&mut t, &r.entry(0));
        assert_eq!(acked, (1000..1010).collect::<Vec<_>>());
        assert!(lost.is_empty());
        assert_eq!(t.in_flight, 190 * 100);
        // PSN 60 arrives alone: 10..60 are lost, 60 acknowledged, and the
        // 139 packets after it stay in flight, untouched.
        r.on_packet(60, false);
        let (acked, lost) = events(&mut t, &r.entry(0));
        assert_eq!(acked, vec![1060]);
        assert_eq!(lost, (1010..1060).collect::<Vec<_>>());
        assert_eq!(t.oldest_outstanding(), Some(Instant::ZERO));
        assert_eq!(
            t.in_flight,
            139 * 100,
            "only PSN 60 left the flight; the lost ones are no longer counted"
        );
    }

    #[test]
    fn sack_gap_is_loss_and_only_the_gap() {
        let mut t = tx();
        let mut r = PathRx::new();
        for csn in 0..6 {
            t.record_send(100 + csn, Instant::ZERO, 1000, false);
        }
        // Packet 2 is lost on the wire.
        for psn in [0, 1, 3, 4, 5] {
            r.on_packet(psn, psn == 4);
        }
        let mut ev = Vec::new();
        let echo = t
            .on_ack(&r.entry(0), Instant::ZERO, |e| ev.push(e))
            .unwrap();
        assert_eq!(echo, (5, 1));
        let lost: Vec<_> = ev
            .iter()
            .filter_map(|e| {
                if let PathEvent::Lost { csn } = e {
                    Some(*csn)
                } else {
                    None
                }
            })
            .collect();
        assert_eq!(lost, vec![102]);
        assert_eq!(
            ev.iter()
                .filter(|e| matches!(e, PathEvent::Acked { .. }))
                .count(),
            5
        );
        assert_eq!(t.in_flight, 0);
        assert_eq!(t.una, 6);
        // The same ACK again changes nothing.
        let mut again = Vec::new();
        assert_eq!(
            t.on_ack(&r.entry(0), Instant::ZERO, |e| again.push(e))
                .unwrap(),
            (0, 0)
        );
        assert!(again.is_empty());
    }

    #[test]
    fn bogus_ack_beyond_sent_is_refused() {
        let mut t = tx();
        t.record_send(0, Instant::ZERO, 10, false);
        let mut e = PathRx::new().entry(0);
        e.ack_psn = 5;
        assert_eq!(t.on_ack(&e, Instant::ZERO, |_| {}), Err(BogusAck));
    }

    #[test]
    fn span_is_bounded_by_sack_bits() {
        let mut t = tx();
        for i in 0..SACK_BITS {
            assert!(t.has_room());
            t.record_send(i, Instant::ZERO, 1, false);
        }
        assert!(!t.has_room());
    }

    #[test]
    fn expire_marks_old_packets() {
        let mut t = tx();
        t.record_send(1, Instant::from_nanos(10), 5, false);
        t.record_send(2, Instant::from_nanos(20), 5, false);
        assert_eq!(t.oldest_outstanding(), Some(Instant::from_nanos(10)));
        let mut ev = Vec::new();
        assert_eq!(
            t.expire(Instant::from_nanos(15), LossCause::Timeout, |e| ev.push(e)),
            1
        );
        assert_eq!(ev, vec![PathEvent::Lost { csn: 1 }]);
        assert_eq!(t.oldest_outstanding(), Some(Instant::from_nanos(20)));
        assert_eq!(t.in_flight, 5);
    }

    #[test]
    fn a_packet_declared_lost_that_arrives_raises_the_wait() {
        let ms = |n: u64| Instant::from_nanos(n * 1_000_000);
        let mut t = tx();
        for _ in 0..20 {
            t.rtt.sample(Duration::from_millis(3));
        }
        assert_eq!(t.late_floor(), Duration::ZERO);
        // Packet 0 sits in a deep queue: the time rule gives up on it at
        // 7 ms (another path delivered something sent later) ...
        t.record_send(10, ms(0), 100, false);
        let mut ev = Vec::new();
        assert_eq!(
            t.detect_by_time(ms(7), ms(6), Duration::ZERO, &conn_rtt(), |e| ev.push(e)),
            1
        );
        assert_eq!(ev, vec![PathEvent::Lost { csn: 10 }]);
        // ... but it arrives: the ACK, at 10 ms, reports it as delivered.
        let mut r = PathRx::new();
        r.on_packet(0, false);
        ev.clear();
        t.on_ack(&r.entry(0), ms(10), |e| ev.push(e)).unwrap();
        assert_eq!(
            ev,
            vec![PathEvent::Acked {
                csn: 10,
                bytes: 100
            }]
        );
        assert_eq!(t.stats.spurious_losses, 1);
        assert_eq!(
            t.in_flight, 0,
            "a packet declared lost left the flight once"
        );
        // It took 10 ms; the floor is that, capped at two smoothed RTTs.
        assert!(t.late_floor >= Duration::from_millis(10));
        let floor = t.late_floor();
        assert_eq!(floor, Duration::from_millis(6), "{floor:?}");
        assert!(t.rto(&conn_rtt()) >= floor);
        // The next packet is not given up on before it is that old (the
        // time rule alone would wait about 3.8 ms).
        t.record_send(11, ms(20), 100, false);
        assert_eq!(
            t.detect_by_time(ms(25), ms(28), Duration::ZERO, &conn_rtt(), |_| {}),
            0
        );
        assert_eq!(
            t.detect_by_time(ms(27), ms(28), Duration::ZERO, &conn_rtt(), |_| {}),
            1
        );
        // Delivering ACKs make the floor fade; a new route starts from none.
        let raw = t.late_floor;
        t.record_send(12, ms(40), 100, false);
        r.on_packet(2, false);
        t.on_ack(&r.entry(0), ms(41), |_| {}).unwrap();
        assert!(t.late_floor < raw);
        assert_eq!(t.stats.spurious_losses, 1, "packet 11 never arrived");
        t.fail(2000, 100);
        assert_eq!(t.late_floor(), Duration::ZERO);
    }

    #[test]
    fn the_late_floor_is_capped_at_two_rtts() {
        let mut t = tx();
        t.rtt.sample(Duration::from_millis(1));
        // One packet held up 100 ms (a stalled host) ...
        t.record_send(1, Instant::ZERO, 100, false);
        t.expire(Instant::ZERO, LossCause::Timeout, |_| {});
        let mut r = PathRx::new();
        r.on_packet(0, false);
        t.on_ack(&r.entry(0), Instant::from_nanos(100_000_000), |_| {})
            .unwrap();
        // ... holds later losses up by two smoothed RTTs at most.
        assert_eq!(t.late_floor(), Duration::from_millis(2));
    }

    #[test]
    fn a_failed_route_is_probed_on_a_plain_timeout_a_dead_one_ever_more_rarely() {
        let mut t = tx();
        t.rtt.sample(Duration::from_millis(1));
        let plain = t.rto(&conn_rtt());
        // Two timeouts on the old route doubled its RTO twice; the new
        // route's probe starts from the plain one.
        t.backoff = 2;
        t.fail(2000, 100);
        assert_eq!(t.state, PathState::Probing);
        assert_eq!(t.rto(&conn_rtt()), plain);
        // A probe that timed out (the timer doubled it) fails the path
        // again: that backoff stays.
        t.backoff += 1;
        t.fail(3000, 100);
        assert_eq!(t.rto(&conn_rtt()), plain * 2);
    }

    #[test]
    fn a_move_waits_for_the_old_route_to_drain() {
        let mut t = tx();
        t.record_send(1, Instant::ZERO, 100, false);
        t.record_send(2, Instant::ZERO, 100, false);
        t.start_move(2000);
        // Packets are still on the old route: no new ones, same port.
        assert_eq!(t.move_to, Some(2000));
        assert!(!t.can_send(100));
        assert_eq!(t.src_port, 1000);
        assert!(!t.finish_move());
        // Both arrive: the move completes, the window is kept.
        let window = t.cc.window();
        let mut r = PathRx::new();
        r.on_packet(0, false);
        r.on_packet(1, false);
        t.on_ack(&r.entry(0), Instant::from_nanos(10_000), |_| {})
            .unwrap();
        assert_eq!(t.in_flight, 0);
        assert!(t.finish_move());
        assert_eq!((t.src_port, t.move_to, t.stats.moves), (2000, None, 1));
        assert_eq!(t.cc.window(), window);
        assert!(t.can_send(100));
        // PSNs go on in order on the new route.
        assert_eq!(t.next_psn, 2);
        // With nothing in flight a move is immediate.
        assert!(t.start_move(3000));
        assert_eq!((t.src_port, t.stats.moves), (3000, 2));
        // A failure overrides a pending move.
        t.record_send(3, Instant::ZERO, 100, false);
        assert!(!t.start_move(4000));
        t.fail(5000, 100);
        assert_eq!((t.src_port, t.move_to), (5000, None));
    }

    #[test]
    fn receiver_window() {
        let mut r = PathRx::new();
        assert_eq!(r.on_packet(0, false), (SeqAccept::New, false));
        assert_eq!(r.on_packet(2, false), (SeqAccept::New, true));
        assert_eq!(r.on_packet(2, false).0, SeqAccept::Duplicate);
        let e = r.entry(3);
        assert_eq!(e.ack_psn, 1);
        assert!(e.sack_bit(0));
        // Far ahead: the hole at 1 is given up, the window slides.
        assert_eq!(r.on_packet(2 + SACK_BITS, false).0, SeqAccept::New);
        let e = r.entry(3);
        assert_eq!(e.ack_psn, 3);
        assert!(e.sack_bit(SACK_BITS - 2));
    }

    /// A packet overdue by the smoothed RTT alone gets a tail-loss probe,
    /// once; it is declared lost only past twice the path's recent peak
    /// RTT, where a queue that swings may still hold it.
    #[test]
    fn overdue_by_the_rtt_probes_overdue_by_the_peak_is_lost() {
        let ms = |n: u64| Instant::from_nanos(n * 1_000_000);
        let mut t = tx();
        t.rtt.sample_at(ms(0), Duration::from_millis(2));
        t.rtt.sample_at(ms(1), Duration::from_millis(6));
        for k in 2..10 {
            t.rtt.sample_at(ms(k), Duration::from_millis(2));
        }
        assert_eq!(t.rtt.peak(), Duration::from_millis(6));
        t.record_send(7, ms(100), 100, false);
        // Something sent later was delivered; 4 ms on, the RTT rule says
        // overdue, the peak says not yet: a probe, no loss.
        assert_eq!(
            t.detect_by_time(ms(104), ms(101), Duration::ZERO, &conn_rtt(), |_| {}),
            0
        );
        assert!(t.probe_due);
        t.probe_sent(Instant::ZERO);
        assert_eq!(t.stats.tail_probes, 1);
        assert_eq!(
            t.detect_by_time(ms(105), ms(101), Duration::ZERO, &conn_rtt(), |_| {}),
            0
        );
        assert!(!t.probe_due, "one probe per oldest packet");
        // Past twice the peak (12 ms): lost, by time.
        let mut ev = Vec::new();
        assert_eq!(
            t.detect_by_time(ms(113), ms(101), Duration::ZERO, &conn_rtt(), |e| ev
                .push(e)),
            1
        );
        assert_eq!(ev, vec![PathEvent::Lost { csn: 7 }]);
        assert_eq!(t.stats.lost_by_time, 1);
        // The timeout is never under twice the peak either.
        assert!(t.rto(&conn_rtt()) >= Duration::from_millis(12));
    }

    /// With no ACK at all (every one lost, or none due), the probe timer
    /// still sends the tail-loss probe.
    #[test]
    fn the_probe_timer_runs_without_evidence() {
        let ms = |n: u64| Instant::from_nanos(n * 1_000_000);
        let mut t = tx();
        t.rtt.sample_at(ms(0), Duration::from_millis(2));
        t.record_send(1, ms(10), 100, false);
        let due = t.probe_deadline(Duration::ZERO, &conn_rtt()).unwrap();
        assert!(
            due > ms(10) && due < t.deadline(&conn_rtt(), Duration::ZERO).unwrap(),
            "before the RTO"
        );
        t.on_probe_timer(
            Instant::from_nanos(due.as_nanos() - 1),
            Duration::ZERO,
            &conn_rtt(),
        );
        assert!(!t.probe_due);
        t.on_probe_timer(due, Duration::ZERO, &conn_rtt());
        assert!(t.probe_due);
        assert_eq!(
            t.probe_deadline(Duration::ZERO, &conn_rtt()),
            None,
            "armed once"
        );
        t.probe_sent(Instant::ZERO);
        assert_eq!(
            t.probe_deadline(Duration::ZERO, &conn_rtt()),
            None,
            "sent for this packet"
        );
    }

    /// A path whose packets are acknowledged but never echoed (the
    /// receiver echoes the packet it got last, which may be another
    /// path's every time) has no RTT of its own: its overdue tail is
    /// probed and declared lost by the connection's estimate, not left to
    /// the timeout.
    #[test]
    fn a_path_without_samples_goes_by_the_connections_rtt() {
        let ms = |n: u64| Instant::from_nanos(n * 1_000_000);
        let mut t = tx();
        let mut conn = conn_rtt();
        for k in 0..10 {
            conn.sample_at(ms(k), Duration::from_millis(2));
        }
        t.record_send(3, ms(100), 100, false);
        // Without an estimate of either kind, only the timeout is left.
        assert_eq!(t.probe_deadline(Duration::ZERO, &conn_rtt()), None);
        assert_eq!(
            t.detect_by_time(ms(150), ms(101), Duration::ZERO, &conn_rtt(), |_| {}),
            0
        );
        // With the connection's: a probe after about its RTT ...
        let due = t.probe_deadline(Duration::ZERO, &conn).unwrap();
        assert!(due >= ms(102) && due < ms(105), "{due:?}");
        assert_eq!(
            t.detect_by_time(ms(103), ms(101), Duration::ZERO, &conn, |_| {}),
            0
        );
        assert!(t.probe_due);
        // ... and the packet lost, by time, well before the RTO.
        let mut ev = Vec::new();
        assert_eq!(
            t.detect_by_time(ms(106), ms(101), Duration::ZERO, &conn, |e| ev.push(e)),
            1
        );
        assert_eq!(ev, vec![PathEvent::Lost { csn: 3 }]);
        assert!(t.deadline(&conn_rtt(), Duration::ZERO).is_none());
    }

    /// Every ACK that acknowledges packets of the path is a delivery
    /// sample: how long the newest of them took, whether or not the ACK
    /// echoed one of them; an ACK that acknowledges nothing new is none.
    #[test]
    fn every_acknowledging_ack_is_a_delivery_sample() {
        let us = |n: u64| Instant::from_nanos(n * 1_000);
        let mut t = tx();
        t.record_send(1, us(0), 100, false);
        t.record_send(2, us(10), 100, false);
        t.record_send(3, us(20), 100, false);
        let mut r = PathRx::new();
        r.on_packet(0, false);
        r.on_packet(1, false);
        t.on_ack(&r.entry(0), us(70), |_| {}).unwrap();
        assert_eq!(t.delivery_samples, 1);
        assert_eq!(
            t.delivery_latest,
            Duration::from_micros(60),
            "the newest: sent at 10"
        );
        t.on_ack(&r.entry(0), us(80), |_| {}).unwrap();
        assert_eq!(t.delivery_samples, 1, "nothing new");
        r.on_packet(2, false);
        t.on_ack(&r.entry(0), us(200), |_| {}).unwrap();
        assert_eq!(t.delivery_samples, 2);
        assert_eq!(t.delivery_latest, Duration::from_micros(180));
    }

    /// A path whose packets no ACK echoes (with many paths, most of them)
    /// learns its recent peak from its delivery samples: a packet of it is
    /// not declared lost by time before twice that, where its stale RTT
    /// estimate alone would have declared it (a spurious loss).
    #[test]
    fn delivery_samples_keep_the_peak_of_a_path_seldom_echoed() {
        let us = |n: u64| Instant::from_nanos(n * 1_000);
        let conn = conn_rtt();
        let mut t = tx();
        t.rtt.sample_at(us(0), Duration::from_micros(10));
        let mut r = PathRx::new();
        // Packet 0 takes 40 µs to be acknowledged: no RTT sample (the ACK
        // echoes another path's packet), one delivery sample.
        t.record_send(1, us(100), 100, false);
        r.on_packet(0, false);
        t.on_ack(&r.entry(0), us(140), |_| {}).unwrap();
        assert_eq!(
            t.rtt.srtt(),
            Some(Duration::from_micros(10)),
            "no RTT sample"
        );
        assert_eq!(t.rtt.peak(), Duration::from_micros(40));
        // Packet 1 has waited 60 µs when a later packet arrives by another
        // path: within twice the peak, so not lost yet.
        t.record_send(2, us(200), 100, false);
        let mut lost = 0;
        let evidence = us(250);
        t.detect_by_time(us(260), evidence, Duration::ZERO, &conn, |e| {
            lost += usize::from(matches!(e, PathEvent::Lost { .. }));
        });
        assert_eq!(lost, 0, "twice the peak is 80 µs");
        t.detect_by_time(us(290), evidence, Duration::ZERO, &conn, |e| {
            lost += usize::from(matches!(e, PathEvent::Lost { .. }));
        });
        assert_eq!(lost, 1, "overdue by twice the peak");
    }

    /// Declarations by time that keep turning out right (a lossy path with
    /// a steady queue) make the path declare at the RTT rule again rather
    /// than wait for twice the peak; spurious ones make it wait.
    #[test]
    fn declarations_that_were_right_speed_up_the_next() {
        let ms = |n: u64| Instant::from_nanos(n * 1_000_000);
        let mut t = tx();
        t.rtt.sample_at(ms(0), Duration::from_millis(2));
        t.rtt.sample_at(ms(1), Duration::from_millis(8));
        for k in 2..10 {
            t.rtt.sample_at(ms(k), Duration::from_millis(2));
        }
        let mut at = 100;
        let mut lost_after = |t: &mut PathTx| {
            t.record_send(at as u32, ms(at), 100, false);
            let mut wait = 0;
            while t.detect_by_time(
                ms(at + wait),
                ms(at + 1),
                Duration::ZERO,
                &conn_rtt(),
                |_| {},
            ) == 0
            {
                wait += 1;
            }
            at += 100;
            wait
        };
        assert!(lost_after(&mut t) >= 16, "twice the peak, first");
        for _ in 0..TIME_JUDGED_MIN {
            lost_after(&mut t);
        }
        let quick = lost_after(&mut t);
        assert!(
            quick <= 8,
            "the RTT rule once the record is good: {quick} ms"
        );
    }

    /// A path that carries ACKs but sends nothing checks its route with a
    /// NOP once the interval (at least its RTO) has passed; one that sends
    /// DATA never does; a path whose last packet was lost stops carrying
    /// ACKs and is checked again after one RTO.
    #[test]
    fn an_ack_only_path_checks_its_route() {
        let ms = |n: u64| Instant::from_nanos(n * 1_000_000);
        let interval = Duration::from_millis(16);
        let mut t = tx();
        assert!(t.carries_acks());
        // Nothing carried yet: no check, however long it has been.
        t.schedule_check(ms(100), interval, &conn_rtt());
        assert!(!t.check_due);
        t.carried_ack(ms(100));
        t.schedule_check(ms(110), interval, &conn_rtt());
        assert!(!t.check_due, "the interval starts with the first ACK");
        t.carried_ack(ms(116));
        t.schedule_check(ms(116), interval, &conn_rtt());
        assert!(!t.check_due, "too few ACKs to be worth a check");
        for _ in 0..crate::consts::ACK_PATH_CHECK_ACKS {
            t.carried_ack(ms(116));
        }
        t.schedule_check(ms(116), interval, &conn_rtt());
        assert!(t.check_due);
        // The check goes out as a DATA packet (a NOP): the interval restarts.
        t.record_send(1, ms(116), 64, false);
        assert!(!t.check_due && t.acks_carried == 0);
        // Lost: the path stops carrying ACKs, and is checked again one RTO
        // (1 ms here) after its last packet, not a whole interval.
        assert_eq!(t.expire(ms(116), LossCause::Timeout, |_| {}), 1);
        assert!(!t.carries_acks());
        t.schedule_check(ms(121), interval, &conn_rtt());
        assert!(t.check_due, "a suspect path is checked after one RTO");
        // A path that carries data is busy: no check while it has packets
        // in flight.
        let mut d = tx();
        d.carried_ack(ms(0));
        d.record_send(2, ms(1), 1000, false);
        d.carried_ack(ms(2));
        d.schedule_check(ms(50), interval, &conn_rtt());
        assert!(!d.check_due);
    }
}
