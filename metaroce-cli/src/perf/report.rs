//! What a run of `metaroce perf` reports: per direction, per path, and
//! the perftest-style table (or `--json`).

use super::*;

/// One path's line of the report.
#[derive(Debug, Serialize)]
pub(super) struct PathReport {
    pub(super) id: u8,
    pub(super) src_port: u16,
    pub(super) packets: u64,
    /// Bytes of the DATA packets sent (whole datagrams).
    pub(super) bytes: u64,
    pub(super) retransmits: u64,
    pub(super) lost: u64,
    /// Packets declared lost that arrived after all.
    pub(super) spurious: u64,
    /// Of `lost`: declared by time, and by the retransmission timeout (the
    /// rest by a gap in the path's acknowledgements).
    pub(super) lost_by_time: u64,
    pub(super) lost_by_timeout: u64,
    /// Of `spurious`: declared by time, and by the timeout.
    pub(super) spurious_by_time: u64,
    pub(super) spurious_by_timeout: u64,
    pub(super) ecn_marks: u64,
    pub(super) rtt_us: f64,
    /// The path's congestion window at the end, bytes.
    pub(super) cwnd: u64,
    /// Times declared failed (moved to a new source port, probed back).
    pub(super) failures: u64,
    /// Times moved to a new source port because the route stayed congested
    /// or was slow.
    pub(super) moves: u64,
    /// Of the moves begun: those leaving a slow route (its RTT far above
    /// the other paths').
    pub(super) slow_moves: u64,
    /// `active`, or `probing` (declared failed, testing its new route).
    pub(super) state: &'static str,
}

/// One direction of a run: the client's own stream (`tx`) or, with
/// `--bidir`, the server's back to it (`rx`).
#[derive(Debug, Default, Clone, Copy, Serialize)]
pub(super) struct Direction {
    pub(super) iterations: u64,
    pub(super) bytes: u64,
    pub(super) duration_s: f64,
    pub(super) gbps: f64,
    pub(super) verified_bytes: u64,
    pub(super) corrupt_bytes: u64,
    pub(super) retransmits: u64,
}

impl Direction {
    pub(super) fn new(
        iterations: u64,
        size: u64,
        secs: f64,
        checked: (u64, u64),
        retransmits: u64,
    ) -> Self {
        let bytes = iterations * size;
        Direction {
            iterations,
            bytes,
            duration_s: secs,
            gbps: if secs > 0.0 {
                bytes as f64 * 8.0 / secs / 1e9
            } else {
                0.0
            },
            verified_bytes: checked.0,
            corrupt_bytes: checked.1,
            retransmits,
        }
    }

    /// This side's own stream; `peer` is what the peer checked of it (the
    /// requester checks READs itself).
    pub(super) fn of(r: &Requester, peer: &ServerResult, retransmits: u64, size: u64) -> Self {
        let checked = if r.p.op == Op::Read {
            (r.verified, r.corrupt)
        } else {
            (peer.verified_bytes, peer.corrupt_bytes)
        };
        Direction::new(r.completed, size, r.elapsed(), checked, retransmits)
    }

    /// The peer's stream, as its `Done` told and as checked here.
    pub(super) fn from_peer(d: &PeerDone, own: &ServerResult, op: Op, size: u64) -> Self {
        let checked = if op == Op::Read {
            (d.verified_bytes, d.corrupt_bytes)
        } else {
            (own.verified_bytes, own.corrupt_bytes)
        };
        Direction::new(d.iterations, size, d.elapsed_s, checked, d.retransmits)
    }
}

/// This side's AF_XDP counters over the run (see `metaroce_io::DriverStats`).
#[derive(Debug, Serialize)]
pub(super) struct XdpCounters {
    /// Frames the XDP program redirected to the socket.
    pub(super) redirected: u64,
    /// Frames the program passed on to the kernel.
    pub(super) passed: u64,
    /// Frames lost on the way to the socket: dropped by the kernel, the
    /// receive ring full, the fill ring empty.
    pub(super) rx_dropped: u64,
    pub(super) rx_ring_full: u64,
    pub(super) fill_ring_empty: u64,
    /// Turns that found no free transmit frame.
    pub(super) tx_full: u64,
    /// Kicks after which the device had dropped a frame.
    pub(super) tx_dropped: u64,
    /// Datagrams that went through the kernel's UDP socket, out and in.
    pub(super) kernel_sent: u64,
    pub(super) kernel_received: u64,
}

impl XdpCounters {
    pub(super) fn of(s: &metaroce_io::DriverStats) -> Self {
        XdpCounters {
            redirected: s.xdp_redirected,
            passed: s.xdp_passed,
            rx_dropped: s.xdp_rx_dropped,
            rx_ring_full: s.xdp_rx_ring_full,
            fill_ring_empty: s.xdp_fill_ring_empty,
            tx_full: s.xdp_tx_full,
            tx_dropped: s.xdp_tx_dropped,
            kernel_sent: s.kernel_sent,
            kernel_received: s.kernel_received,
        }
    }
}

/// What `--json` prints. With `--bidir` the totals (`iterations`, `bytes`,
/// `gbps`, `msg_rate_mps`, `retransmits`, `verified_bytes`,
/// `corrupt_bytes`) are sums of both directions, given apart in `tx` and
/// `rx`; latency is the client's own requests'.
#[derive(Debug, Serialize)]
pub(super) struct Report {
    pub(super) op: Op,
    pub(super) backend: String,
    /// On the af_xdp backend: `copy` or `zero-copy`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) xdp_mode: Option<String>,
    /// On the af_xdp backend: this side's AF_XDP counters.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) xdp: Option<XdpCounters>,
    /// This side's `--busy-poll`, microseconds.
    pub(super) busy_poll_us: u64,
    pub(super) msg_size: u64,
    /// The connection's MTU (UDP payload bytes of a datagram): the smaller
    /// of the two sides' `--mtu`, within the client's route.
    pub(super) mtu: u16,
    /// This side's `--mtu`.
    pub(super) mtu_asked: u16,
    pub(super) qps: u32,
    pub(super) bidir: bool,
    /// Whether payloads were checked (off with `--no-verify`).
    pub(super) verify: bool,
    /// What checks each datagram's integrity: `none` or `crc32c`
    /// (negotiated: both sides' `--crc`).
    pub(super) integrity: &'static str,
    /// The AEAD sealing every datagram (`--psk-file`): `aes-128-gcm`, or `none`.
    pub(super) security: &'static str,
    /// Datagrams this side dropped because they failed that check.
    pub(super) integrity_failures: u64,
    pub(super) iterations: u64,
    pub(super) bytes: u64,
    pub(super) duration_s: f64,
    pub(super) gbps: f64,
    pub(super) msg_rate_mps: f64,
    pub(super) lat_min_us: f64,
    pub(super) lat_p50_us: f64,
    pub(super) lat_avg_us: f64,
    pub(super) lat_p99_us: f64,
    pub(super) lat_p999_us: f64,
    pub(super) retransmits: u64,
    pub(super) rto_fires: u64,
    pub(super) verified_bytes: u64,
    pub(super) corrupt_bytes: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) tx: Option<Direction>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) rx: Option<Direction>,
    /// The client's own stream's goodput in each `--interval` (1 s unless
    /// given) from the start of the data phase: the bytes of the messages
    /// that completed in it (acknowledged WRITEs and SENDs, checked READs).
    pub(super) intervals: Vec<Interval>,
    /// Whether `--interval` was given: the report then prints them.
    #[serde(skip)]
    pub(super) interval_given: bool,
    pub(super) paths: Vec<PathReport>,
}

/// One interval's goodput.
#[derive(Debug, Serialize, Clone, Copy, PartialEq)]
pub(super) struct Interval {
    pub(super) start_s: f64,
    pub(super) end_s: f64,
    pub(super) gbps: f64,
}

/// Cuts a timeline (bytes completed per `step` seconds) into intervals of
/// `every` seconds (rounded to whole steps, at least one) up to `elapsed`;
/// a remainder shorter than half an interval joins the one before it.
pub(super) fn intervals(timeline: &[u64], step: f64, every: f64, elapsed: f64) -> Vec<Interval> {
    let per = ((every / step).round() as usize).max(1);
    let steps = ((elapsed / step).ceil() as usize).max(timeline.len());
    let mut bounds: Vec<(usize, usize)> = (0..steps)
        .step_by(per)
        .map(|first| (first, (first + per).min(steps)))
        .collect();
    if let [.., (_, end), (first, last)] = bounds[..] {
        if 2 * (last - first) < per {
            bounds.truncate(bounds.len() - 2);
            bounds.push((end - per, last));
        }
    }
    bounds
        .into_iter()
        .map(|(first, last)| {
            let bytes: u64 = timeline
                .get(first.min(timeline.len())..last.min(timeline.len()))
                .map_or(0, |b| b.iter().sum());
            let start_s = first as f64 * step;
            let end_s = (last as f64 * step).min(elapsed.max(start_s));
            let secs = end_s - start_s;
            Interval {
                start_s,
                end_s,
                gbps: if secs > 0.0 {
                    bytes as f64 * 8.0 / secs / 1e9
                } else {
                    0.0
                },
            }
        })
        .collect()
}

/// What the server saw.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct ServerResult {
    pub(super) verified_bytes: u64,
    pub(super) corrupt_bytes: u64,
    pub(super) messages: u64,
}

/// Prints the report of one run, perftest's way: the set-up, the row of
/// figures, latency and verification, and a line per path.
pub(super) fn print_report(r: &Report, paths: u8, depth: u32, where_: &str) {
    print_header(r, paths, depth, where_);
    print_rows(r);
    print_footer(r);
}

/// A line of dashes, perftest's separator.
fn line() -> String {
    "-".repeat(96)
}

/// The set-up of a run (of the first run, with `--all`) and the header of
/// the rows.
pub(super) fn print_header(r: &Report, paths: u8, depth: u32, where_: &str) {
    let line = line();
    let name = match r.op {
        Op::Write => "RDMA_Write",
        Op::Read => "RDMA_Read",
        Op::Send => "Send",
    };
    println!("{line}");
    println!(
        "                    {name} BW Test (metaroce, {where_}, {} backend{})",
        r.backend,
        r.xdp_mode
            .as_deref()
            .map_or(String::new(), |m| format!(", {m} mode"))
    );
    println!(
        " Number of qps   : {}\t\tPaths per connection : {paths}",
        r.qps
    );
    let verification = if r.verify {
        "every byte"
    } else {
        "off (--no-verify)"
    };
    println!(" Tx depth        : {depth}\t\tVerification         : {verification}");
    println!(
        " Integrity       : {}\t\tSecurity             : {}",
        r.integrity, r.security
    );
    let asked = if r.mtu_asked == r.mtu {
        String::new()
    } else {
        format!(
            " (asked {}: the peer's or the route's is smaller)",
            r.mtu_asked
        )
    };
    println!(
        " Busy poll       : {} us\t\tMTU                  : {} B{asked}",
        r.busy_poll_us, r.mtu
    );
    if r.bidir {
        println!(" Direction       : both (tx: client -> server requests, rx: server -> client)");
    }
    println!("{line}");
    println!(" #bytes     #iterations    BW average[Gb/sec]   MsgRate[Mpps]   Retransmits   RTOs");
}

/// A run's row of figures (with `--bidir`, one per direction and their sum).
pub(super) fn print_rows(r: &Report) {
    if let (Some(tx), Some(rx)) = (&r.tx, &r.rx) {
        for (what, d) in [("tx", tx), ("rx", rx)] {
            println!(
                " {:<10} {:<14} {:<20.3} {:<15.6} {:<13} {what}",
                r.msg_size,
                d.iterations,
                d.gbps,
                d.iterations as f64 / d.duration_s.max(1e-9) / 1e6,
                d.retransmits
            );
        }
    }
    println!(
        " {:<10} {:<14} {:<20.3} {:<15.6} {:<13} {}{}",
        r.msg_size,
        r.iterations,
        r.gbps,
        r.msg_rate_mps,
        r.retransmits,
        r.rto_fires,
        if r.bidir { " (sum of both ways)" } else { "" }
    );
}

/// A run's latency, what was verified, and its paths.
fn print_footer(r: &Report) {
    let line = line();
    println!("{line}");
    if r.interval_given {
        println!(" interval [sec]      goodput [Gb/sec]");
        for i in &r.intervals {
            println!(" {:>6.1} - {:<6.1}     {:.3}", i.start_s, i.end_s, i.gbps);
        }
        println!("{line}");
    }
    println!(
        " latency [usec]  t_min {:.1}  t_typical {:.1}  t_avg {:.1}  p99 {:.1}  p99.9 {:.1}",
        r.lat_min_us, r.lat_p50_us, r.lat_avg_us, r.lat_p99_us, r.lat_p999_us
    );
    println!(
        " verified bytes  {}   corrupt bytes {}",
        r.verified_bytes, r.corrupt_bytes
    );
    println!("{line}");
    println!(
        " path src_port packets    bytes         retx     lost     ecn      rtt[usec] cwnd[KiB] state   fail/move(slow)"
    );
    for p in &r.paths {
        println!(
            " {:<4} {:<8} {:<10} {:<13} {:<8} {:<8} {:<8} {:<9.1} {:<9} {:<7} {}/{}({})",
            p.id,
            p.src_port,
            p.packets,
            p.bytes,
            p.retransmits,
            p.lost,
            p.ecn_marks,
            p.rtt_us,
            p.cwnd / 1024,
            p.state,
            p.failures,
            p.moves,
            p.slow_moves
        );
    }
    println!("{line}");
}

/// After the rows of `--all`: what was verified over every size.
pub(super) fn print_totals(sizes: usize, verified: u64, corrupt: u64) {
    println!("{}", line());
    println!(" {sizes} sizes, verified bytes {verified}   corrupt bytes {corrupt}");
    println!("{}", line());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn intervals_sum_their_steps_and_cut_the_last_short() {
        // 100 ms steps: 1.25 MB in each of the first 10 (100 Mbit/s), none
        // in the next 10, 2.5 MB in each of the last 5; the run lasted 2.5 s.
        let mut t = vec![1_250_000u64; 10];
        t.extend([0; 10]);
        t.extend([2_500_000; 5]);
        let iv = intervals(&t, 0.1, 1.0, 2.5);
        let rates: Vec<f64> = iv
            .iter()
            .map(|i| (i.gbps * 1000.0).round() / 1000.0)
            .collect();
        assert_eq!(rates, vec![0.1, 0.0, 0.2]);
        assert_eq!((iv[2].start_s, iv[2].end_s), (2.0, 2.5));
        // Half-second intervals; a timeline that ends before the run did
        // (nothing completed at the end) still covers the whole run, and
        // the last 0.1 s joins the interval before it.
        let iv = intervals(&t[..10], 0.1, 0.5, 1.6);
        assert_eq!(iv.len(), 3);
        assert_eq!(iv[2].gbps, 0.0);
        assert!((iv[2].start_s - 1.0).abs() < 1e-9);
        assert!((iv[2].end_s - 1.6).abs() < 1e-9);
        // What the merged remainder carried counts.
        let iv = intervals(&[1_250_000; 11], 0.1, 1.0, 1.1);
        assert_eq!(iv.len(), 1);
        assert!((iv[0].gbps - 0.1).abs() < 1e-9);
    }
}
