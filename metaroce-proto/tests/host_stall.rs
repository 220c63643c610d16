//! A stall of the receiving host holds every path's packets at once (on
//! one machine they wait in one socket, for a thread that is off its
//! core). When it resumes it reads them in order and acknowledges them as
//! it goes: the first path acknowledged must not make all the others look
//! dead for the silence they shared. A timeout that fires during the stall
//! sends one packet again as a probe for every path, not every path's
//! window nor a packet per path (the ACKs show them all arrived); no path
//! is declared failed and no byte is lost.

mod common;

use common::{drain_cq, pattern, write_regions, write_wr, LinkConfig, OneWrite, Pair, Verbs};
use metaroce_proto::consts::{DEFAULT_RETRY_CNT, DEFAULT_RETRY_TIMEOUT};
use metaroce_proto::verbs::WcStatus;
use metaroce_proto::{Ecn, EndpointConfig};
use std::net::SocketAddr;
use std::time::Duration;

/// Datagrams of `a` waiting for `b`: from, ECN, bytes.
type Held = Vec<(SocketAddr, Ecn, Vec<u8>)>;

/// Everything `a` has to send now, into `held`.
fn hold_a(w: &mut OneWrite, buf: &mut [u8], held: &mut Held) {
    while let Some(t) = w.a.poll_transmit(w.now, buf) {
        let from = SocketAddr::new(w.a_addr.ip(), t.src_port);
        let seg = t.segment_size.unwrap_or(t.size);
        for dg in buf[..t.size].chunks(seg) {
            held.push((from, t.ecn, dg.to_vec()));
        }
    }
}

/// `b` reads `held` in order and acknowledges as it goes; `a` reads each
/// ACK at once.
fn deliver_to_b(w: &mut OneWrite, buf: &mut [u8], held: &mut Held) {
    for (from, ecn, dg) in held.drain(..) {
        w.b.handle_datagram(w.now, from, ecn, &dg);
        while let Some(t) = w.b.poll_transmit(w.now, buf) {
            w.a.handle_datagram(w.now, w.b_addr, t.ecn, &buf[..t.size]);
        }
    }
}

#[test]
fn a_stall_of_every_path_fails_none() {
    const LEN: usize = 8 << 20;
    let data: Vec<u8> = (0..LEN).map(|i| (i * 13 + i / 4096) as u8).collect();
    let mut w = OneWrite::new(data, (21, 22));
    let mut buf = vec![0u8; 65_536];
    let mut to_b = Held::new();
    let mut wcs = Vec::new();
    let end = w.now + Duration::from_secs(5);
    let mut failures_after_stall = None;
    while wcs.is_empty() && w.now < end {
        hold_a(&mut w, &mut buf, &mut to_b);
        let received = w.b.connection_stats(w.cb).unwrap().data_packets_received;
        if received > 300 && failures_after_stall.is_none() {
            // The receiver stalls for 10 ms (five minimum RTOs): what the
            // sender sends waits for it; the sender's timers run.
            let until = w.now + Duration::from_millis(10);
            while w.now < until {
                w.now = w.now + Duration::from_micros(100);
                let now = w.now;
                if w.a.poll_timeout().is_some_and(|t| t <= now) {
                    w.a.handle_timeout(now);
                }
                hold_a(&mut w, &mut buf, &mut to_b);
            }
            let before = w.a.connection_stats(w.ca).unwrap().path_failures;
            // Back on its core, the receiver reads what waited.
            deliver_to_b(&mut w, &mut buf, &mut to_b);
            let after = w.a.connection_stats(w.ca).unwrap().path_failures;
            failures_after_stall = Some(after - before);
        }
        deliver_to_b(&mut w, &mut buf, &mut to_b);
        w.now = w.now + Duration::from_micros(10);
        w.run_timers();
        w.a.poll_cq(w.cqa, 4, &mut wcs).unwrap();
    }
    let s = w.a.connection_stats(w.ca).unwrap();
    assert_eq!(
        failures_after_stall,
        Some(0),
        "paths declared failed as the held packets were acknowledged: {s:?}"
    );
    assert!(s.rto_fires > 0, "the stall outlasted the timeouts: {s:?}");
    // With every path silent a timeout sends one packet again, as a probe
    // for the whole connection: not a path's window, and not one packet
    // per path either (the other paths wait for the probe's answer).
    let by_timeout: u64 = s.paths.iter().map(|p| p.lost_by_timeout).sum();
    assert!(
        by_timeout <= s.rto_fires,
        "the stall's timeouts declared {by_timeout} packets lost in {} fires: {s:?}",
        s.rto_fires
    );
    w.check_done(&wcs);
    assert_eq!(s.path_failures, 0, "no path failed at all: {s:?}");
}

/// WRITEs streaming from A to B (16 of 64 KiB outstanding, 8 paths, a
/// 3.2 Gbit/s link) until `silence_from`, then nothing gets through either
/// way until `silence_from + silence`, then the run goes on for 2 s.
/// Returns the first failed completion (status, ms into the run) and how
/// many WRITEs completed after the silence.
fn stream_through_a_silence(
    seed: u64,
    loss: f64,
    silence: Duration,
) -> (Option<(WcStatus, u64)>, u64) {
    let cfg = EndpointConfig {
        paths: 8,
        ..EndpointConfig::default()
    };
    let link = LinkConfig {
        bytes_per_us: 400,
        duplicate: 0.0,
        reorder: 0.0,
        ..LinkConfig::lossy(loss)
    };
    let mut p = Pair::new(cfg.clone(), cfg, seed, link);
    p.connect();
    let v = Verbs::setup(&mut p);
    const MSG: u64 = 64 << 10;
    let data = pattern(seed, 16 * MSG as usize);
    let (src, dst) = write_regions(&mut p.a, v.pda, &mut p.b, v.pdb, &data);
    let mut next = 0u64;
    for _ in 0..16 {
        let at = (next % 16) * MSG;
        p.a.post_send(p.now, v.qa, write_wr(next, &src, &dst, at, MSG as u32))
            .unwrap();
        next += 1;
    }
    let silence_from = p.now + Duration::from_millis(50);
    let silence_to = silence_from + silence;
    let end = silence_to + Duration::from_secs(2);
    let mut failed = None;
    let mut done_after = 0;
    let mut silenced = false;
    p.run_until(end, |p| {
        if !silenced && p.now >= silence_from {
            p.cut_until = Some(silence_to);
            silenced = true;
        }
        for wc in drain_cq(&mut p.a, v.cqa) {
            if wc.status != WcStatus::Success {
                failed = Some((wc.status, p.now.as_nanos() / 1_000_000));
                return true;
            }
            if p.now > silence_to {
                done_after += 1;
            }
            let at = (next % 16) * MSG;
            p.a.post_send(p.now, v.qa, write_wr(next, &src, &dst, at, MSG as u32))
                .unwrap();
            next += 1;
        }
        false
    });
    (failed, done_after)
}

/// A host that stops for 200 ms (a thread off its core on a busy machine:
/// nothing it sends leaves, nothing sent to it is read) in the middle of a
/// transfer fails nothing, with or without loss. Each timeout during the
/// silence sends one packet per path again as a probe, past windows that
/// the packets still outstanding fill, so the first probe after the
/// silence ends it; and the retries must have had `retry_timeout` each
/// before the connection may fail. (Before, the probes stopped once the
/// retransmitted probes filled the windows, and the connection failed
/// with `RetryExceeded` about 300 ms into a 200 ms silence.)
#[test]
fn a_silence_of_200_ms_mid_transfer_fails_nothing() {
    for (seed, loss) in [(1, 0.0), (2, 0.01), (3, 0.0), (4, 0.01)] {
        let (failed, after) = stream_through_a_silence(seed, loss, Duration::from_millis(200));
        assert_eq!(failed, None, "seed {seed}, loss {loss}");
        assert!(
            after > 100,
            "seed {seed}: only {after} WRITEs after the silence"
        );
    }
}

/// A silence longer than the retry budget fails the connection with
/// `RetryExceeded`, but not before `(retry_cnt + 1) × retry_timeout` of it.
#[test]
fn a_silence_past_the_retry_budget_fails_with_retry_exceeded() {
    let budget = DEFAULT_RETRY_TIMEOUT * (u32::from(DEFAULT_RETRY_CNT) + 1);
    let (failed, _) = stream_through_a_silence(5, 0.0, Duration::from_secs(3));
    let (status, at_ms) = failed.expect("a 3 s silence fails the connection");
    assert_eq!(status, WcStatus::RetryExceeded);
    // The silence starts 50 ms after the connection, itself a few ms in.
    let silent_ms = at_ms.saturating_sub(50);
    assert!(
        silent_ms as u128 >= budget.as_millis() && silent_ms < 3000,
        "failed {silent_ms} ms into the silence (budget {budget:?})"
    );
}

/// A delay every path of a connection shares and that it did not make (a
/// host held up: a receiving thread waiting for its CPU, routers short of
/// CPU) is not queueing it can drain by sending less (PROTOCOL §14,
/// Delay): when every packet both ways comes to wait 145 µs more (an RTT
/// of 300 µs against 10), the windows come down to their minimum, find
/// the delay there too, and grow again, where counting from the least RTT
/// ever seen alone kept them at the minimum (8,320 bytes each: no path
/// could take more than its share of the traffic). The data still arrives
/// whole.
#[test]
fn a_delay_every_path_shares_does_not_pin_the_windows() {
    let cfg = EndpointConfig {
        paths: 4,
        ..EndpointConfig::default()
    };
    let min = cfg.min_window;
    // Packets overtake each other now and then, so that ACKs echo the
    // timestamps of every path, as on a real network.
    let link = LinkConfig {
        reorder: 0.3,
        reorder_delay: Duration::from_micros(3),
        ..LinkConfig::perfect()
    };
    let mut p = Pair::new(cfg.clone(), cfg, 51, link);
    p.connect();
    let v = Verbs::setup(&mut p);
    let data: Vec<u8> = (0..64usize << 20)
        .map(|i| (i * 7 + i / 4096) as u8)
        .collect();
    let (src, dst) = write_regions(&mut p.a, v.pda, &mut p.b, v.pdb, &data);
    let now = p.now;
    p.a.post_send(now, v.qa, write_wr(1, &src, &dst, 0, data.len() as u32))
        .unwrap();
    let warm = p.now + Duration::from_micros(300);
    p.run_until(warm, |_| false);
    p.link.delay = Duration::from_micros(150);
    let later = p.now + Duration::from_millis(12);
    p.run_until(later, |_| false);
    let s = p.a.connection_stats(p.conn_a.unwrap()).unwrap();
    let windows: Vec<u64> = s.paths.iter().map(|x| x.cwnd).collect();
    assert!(
        windows.iter().all(|&w| w > 4 * min),
        "windows {windows:?} (minimum {min}) after 12 ms of a delay all paths share"
    );
    let deadline = p.now + Duration::from_secs(5);
    assert!(p.run_until(deadline, |p| p.b.mr(dst.lkey).unwrap() == &data[..]));
}
