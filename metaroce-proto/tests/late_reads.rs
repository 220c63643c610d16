//! A thread that falls behind its socket reads datagrams late: what the
//! network delivered waits for it, stamped with when it arrived. The late
//! reads are no loss. A sender whose own thread reads ACKs late, or whose
//! peer reads its packets late (and says so in its ACKs' delay), stretches
//! its timeouts by that lag (PROTOCOL §13.3) and sends nothing twice.
//! (Before, a 3 ms lag against the 2 ms minimum RTO timed every path out
//! again and again, on a fabric that dropped nothing.)

mod common;

use common::OneWrite;
use metaroce_proto::{Ecn, Endpoint, Instant};
use std::collections::VecDeque;
use std::net::SocketAddr;
use std::time::Duration;

/// A datagram on its way: when its reader reads it, when it arrived.
struct InFlight {
    read_at: Instant,
    arrived: Instant,
    from: SocketAddr,
    ecn: Ecn,
    bytes: Vec<u8>,
}

/// One direction of a link: 400 bytes per µs (3.2 Gbit/s), 10 µs of
/// propagation, `spread` more for every step of the source port modulo 4
/// (routes of different lengths: packets of different paths overtake one
/// another), and a reader that reads each datagram arriving from
/// `lag_from` on `lag` after it arrived.
struct Dir {
    free_at: Instant,
    lag: Duration,
    lag_from: Instant,
    spread: Duration,
    queue: VecDeque<InFlight>,
}

impl Dir {
    fn new(lag: Duration, lag_from: Instant) -> Self {
        Dir {
            free_at: Instant::ZERO,
            lag,
            lag_from,
            spread: Duration::ZERO,
            queue: VecDeque::new(),
        }
    }

    /// Everything `ep` has to send at `now`, onto the link.
    fn send_all(&mut self, ep: &mut Endpoint, src: SocketAddr, now: Instant, buf: &mut [u8]) {
        while let Some(t) = ep.poll_transmit(now, buf) {
            let seg = t.segment_size.unwrap_or(t.size);
            for dg in buf[..t.size].chunks(seg) {
                let start = self.free_at.max(now);
                let done = start + Duration::from_nanos(dg.len() as u64 * 1000 / 400);
                self.free_at = done;
                let arrived =
                    done + Duration::from_micros(10) + self.spread * u32::from(t.src_port % 4);
                // In order of arrival: a datagram of a shorter route
                // overtakes those of longer ones.
                let at = self.queue.partition_point(|d| d.arrived <= arrived);
                self.queue.insert(
                    at,
                    InFlight {
                        read_at: if arrived >= self.lag_from {
                            arrived + self.lag
                        } else {
                            arrived
                        },
                        arrived,
                        from: SocketAddr::new(src.ip(), t.src_port),
                        ecn: t.ecn,
                        bytes: dg.to_vec(),
                    },
                );
            }
        }
    }

    /// Hands `ep` what its thread reads by `now`, with arrival stamps: at
    /// most `per_turn` datagrams (a driver reads a few receive buffers a
    /// turn; the rest waits in the socket for the next).
    fn read_due(&mut self, ep: &mut Endpoint, now: Instant, per_turn: usize) {
        let mut read = 0;
        while read < per_turn && self.queue.front().is_some_and(|d| d.read_at <= now) {
            read += 1;
            let d = self.queue.pop_front().unwrap();
            ep.handle_datagram_stamped(now, d.arrived, d.from, d.ecn, &d.bytes);
        }
    }
}

/// One 8 MiB WRITE from A to B; from 1 ms into it (the first ACKs have
/// come) A reads what reaches it `a_lag` late, B `b_lag` late, and A's
/// thread reads at most `a_per_turn` datagrams a turn. Returns A's RTO
/// fires and packets declared lost, after checking that the WRITE
/// completed with every byte. With `spread`, A's paths to B are routes of
/// different lengths ([`Dir`]).
fn write_with_late_reads(
    a_lag: Duration,
    b_lag: Duration,
    a_per_turn: usize,
    spread: Duration,
) -> (u64, u64) {
    const LEN: usize = 8 << 20;
    let data: Vec<u8> = (0..LEN).map(|i| (i * 7 + i / 4096) as u8).collect();
    let mut w = OneWrite::new(data, (31, 32));
    let mut buf = vec![0u8; 65_536];
    let lag_from = w.now + Duration::from_millis(1);
    let (mut to_b, mut to_a) = (Dir::new(b_lag, lag_from), Dir::new(a_lag, lag_from));
    to_b.spread = spread;
    let mut wcs = Vec::new();
    let end = w.now + Duration::from_secs(2);
    while wcs.is_empty() && w.now < end {
        to_b.read_due(&mut w.b, w.now, usize::MAX);
        to_a.read_due(&mut w.a, w.now, a_per_turn);
        w.run_timers();
        to_b.send_all(&mut w.a, w.a_addr, w.now, &mut buf);
        to_a.send_all(&mut w.b, w.b_addr, w.now, &mut buf);
        w.a.poll_cq(w.cqa, 4, &mut wcs).unwrap();
        // On to the next read or timer.
        let next = [
            to_b.queue.front().map(|d| d.read_at),
            to_a.queue.front().map(|d| d.read_at),
            w.a.poll_timeout(),
            w.b.poll_timeout(),
        ]
        .into_iter()
        .flatten()
        .min()
        .unwrap_or(end);
        w.now = next.max(w.now + Duration::from_nanos(1));
    }
    w.check_done(&wcs);
    let s = w.a.connection_stats(w.ca).unwrap();
    (s.rto_fires, s.packets_lost)
}

/// When the lag sets in, nothing at all comes for 3 ms: a silence that
/// nothing yet explains. Its timeout sends one probe for every path, and
/// the ACKs that follow tell of the lag: no other timeout, no other packet
/// sent twice. (Before the lags counted: about 2,560 RTO fires and 2,800
/// packets declared lost in either case.)
fn check_one_probe_at_most(what: &str, (rto_fires, lost): (u64, u64)) {
    assert!(
        rto_fires <= 1 && lost <= 1,
        "{what}: {rto_fires} RTO fires, {lost} packets declared lost"
    );
}

#[test]
fn the_senders_own_late_reads_are_not_losses() {
    let r = write_with_late_reads(
        Duration::from_millis(3),
        Duration::ZERO,
        usize::MAX,
        Duration::ZERO,
    );
    check_one_probe_at_most("A reads 3 ms late", r);
}

/// The same lag, with A's thread reading two datagrams a turn: each turn
/// ends with the rest of the ACKs still in the socket, and the time-based
/// loss check of the turn judges as of the newest ACK read (its arrival),
/// not as of the late read: a packet whose ACK waits unread was not
/// overdue then (PROTOCOL §13.3). (Judged at the read, every packet whose
/// ACK was next in the socket looked 3 ms overdue: 1,500-byte frames on
/// the kernel fabric, 2,000-4,000 spurious losses in 4 s.)
#[test]
fn acks_read_a_few_a_turn_are_judged_as_of_their_arrival() {
    let spread = Duration::from_micros(40);
    let r = write_with_late_reads(Duration::from_millis(3), Duration::ZERO, 2, spread);
    check_one_probe_at_most("A reads 3 ms late, 2 datagrams a turn", r);
}

#[test]
fn the_receivers_late_reads_are_not_losses() {
    let r = write_with_late_reads(
        Duration::ZERO,
        Duration::from_millis(3),
        usize::MAX,
        Duration::ZERO,
    );
    check_one_probe_at_most("B reads 3 ms late", r);
}

#[test]
fn reads_on_time_lose_nothing() {
    let r = write_with_late_reads(Duration::ZERO, Duration::ZERO, usize::MAX, Duration::ZERO);
    assert_eq!(r, (0, 0), "RTO fires and packets lost");
}
