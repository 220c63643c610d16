//! Output-queued switch ports: FIFO, finite buffer, tail drop, ECN marking,
//! and optional token-bucket shaping.
//!
//! A port serves packets first-in first-out at a fixed rate and never
//! preempts, so a packet's departure time is known the moment it is
//! admitted. The queue therefore stores only `(departure end, size)` pairs
//! and drains them lazily; no event is needed when a packet leaves the port.
//! A packet occupies the buffer from admission until its last bit has been
//! serialised.
//!
//! A shaped port ([`Shaper`]) works as Linux `tc tbf` and the shapers of
//! NIC and switch schedulers: a packet may start only when the bucket holds
//! as many tokens as it has bytes; tokens refill at the shaping rate up to
//! the burst size, and a packet that starts takes its size out of the
//! bucket. While tokens last the port serialises back to back at its line
//! rate; once the bucket is empty it releases a packet each time enough
//! tokens have refilled. A packet's delay is thus bimodal: none for the
//! first burst, then the queue's depth at the shaping rate. Because the
//! queue is FIFO the tokens are still known at admission: the port keeps
//! the bucket's level at the start of the last packet admitted.

use std::collections::VecDeque;
use std::str::FromStr;

use crate::config::ConfigError;
use crate::time::{ps_per_byte, Nanos, NS_PER_MS, NS_PER_US};

/// How deep a shaped port's queue may grow.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum QueueLimit {
    /// A byte limit (`tc tbf limit`).
    Bytes(u64),
    /// A latency limit (`tc tbf latency`): as tc does, the byte limit is
    /// what the shaping rate drains in this time, plus the burst.
    Latency {
        /// The latency, ns.
        ns: Nanos,
    },
    /// The switch buffer of the fabric (`SimConfig::buffer_bytes`).
    Buffer,
}

/// A token-bucket shaper on a class of links (`--spine-shaper`), in the
/// CLI syntax `RATE_GBPS:BURST_BYTES[:QUEUE]`, QUEUE being bytes or a
/// latency with a unit (`20ms`, `500us`).
///
/// `0.2:100000:20ms` is `tc tbf rate 200mbit burst 100000 latency 20ms`:
/// 200 Mbit/s, bursts of 100,000 bytes at line rate, and a queue of
/// 600,000 bytes (20 ms at the rate, plus the burst).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct ShaperSpec {
    /// Shaping rate, Gbit/s.
    pub gbps: f64,
    /// Bucket size, bytes.
    pub burst_bytes: u64,
    /// Queue depth.
    pub queue: QueueLimit,
}

impl ShaperSpec {
    /// The port's byte limit, given the fabric's switch buffer.
    pub fn queue_bytes(&self, buffer_bytes: u64) -> u64 {
        match self.queue {
            QueueLimit::Bytes(b) => b,
            QueueLimit::Latency { ns } => {
                (self.gbps * ns as f64 / 8.0).round() as u64 + self.burst_bytes
            }
            QueueLimit::Buffer => buffer_bytes,
        }
    }

    /// A fresh shaper (full bucket) of this spec.
    pub fn shaper(&self) -> Shaper {
        Shaper::new(ps_per_byte(self.gbps), self.burst_bytes)
    }

    /// Check the values; `max_packet` is the largest packet the fabric
    /// carries, which must fit the queue.
    pub fn validate(&self, buffer_bytes: u64, max_packet: u64) -> Result<(), ConfigError> {
        let bad = |m: &str| Err(ConfigError::BadShaper(format!("{m} in {self:?}")));
        if !(self.gbps > 0.0 && self.gbps.is_finite()) {
            return bad("rate must be positive");
        }
        if self.burst_bytes == 0 {
            return bad("burst must be positive");
        }
        if self.queue_bytes(buffer_bytes) < max_packet {
            return bad("queue smaller than one packet");
        }
        Ok(())
    }
}

impl FromStr for ShaperSpec {
    type Err = ConfigError;
    fn from_str(spec: &str) -> Result<Self, Self::Err> {
        let bad = |why: &str| ConfigError::BadShaper(format!("{why} in {spec:?}"));
        let mut parts = spec.split(':');
        let gbps: f64 = parts
            .next()
            .and_then(|r| r.trim().parse().ok())
            .ok_or_else(|| bad("bad RATE_GBPS"))?;
        let burst_bytes: u64 = parts
            .next()
            .ok_or_else(|| bad("missing BURST_BYTES"))?
            .trim()
            .parse()
            .map_err(|_| bad("bad BURST_BYTES"))?;
        let queue = match parts.next().map(str::trim) {
            None => QueueLimit::Buffer,
            Some(q) => {
                let lat = |num: &str, unit: u64| -> Result<QueueLimit, ConfigError> {
                    let v: f64 = num.parse().map_err(|_| bad("bad queue latency"))?;
                    if !(v >= 0.0 && v.is_finite()) {
                        return Err(bad("bad queue latency"));
                    }
                    Ok(QueueLimit::Latency {
                        ns: (v * unit as f64).round() as Nanos,
                    })
                };
                if let Some(ms) = q.strip_suffix("ms") {
                    lat(ms, NS_PER_MS)?
                } else if let Some(us) = q.strip_suffix("us") {
                    lat(us, NS_PER_US)?
                } else {
                    QueueLimit::Bytes(q.parse().map_err(|_| bad("bad QUEUE"))?)
                }
            }
        };
        if parts.next().is_some() {
            return Err(bad("too many fields"));
        }
        Ok(ShaperSpec {
            gbps,
            burst_bytes,
            queue,
        })
    }
}

/// What happened to a packet offered to a port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Queued; serialisation ends at `end_ps`. `mark_ce` asks the caller to
    /// set CE on the (ECN-capable) packet.
    Accepted {
        /// Picosecond instant at which the last bit leaves the port.
        end_ps: u64,
        /// The queue exceeded the ECN threshold at admission.
        mark_ce: bool,
    },
    /// The buffer had no room: tail drop.
    TailDrop,
}

/// A token bucket in front of a port's line: `tc tbf rate RATE burst BURST`.
///
/// Tokens are kept in picoseconds of credit: one byte costs
/// [`Shaper::ps_per_byte`] of them, and the bucket gains one per
/// picosecond, up to `burst_bytes × ps_per_byte`. All arithmetic is integer,
/// so shaped runs stay deterministic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shaper {
    /// Cost of one byte at the shaping rate (see [`crate::time::ps_per_byte`]).
    pub ps_per_byte: u64,
    /// Bucket size in bytes: the longest burst the port sends at line rate.
    pub burst_bytes: u64,
    /// Credit in the bucket at `at_ps`, in picoseconds.
    credit_ps: u64,
    /// When `credit_ps` was last brought up to date.
    at_ps: u64,
}

impl Shaper {
    /// A shaper of `ps_per_byte` (the shaping rate) and `burst_bytes`,
    /// with a full bucket.
    pub fn new(ps_per_byte: u64, burst_bytes: u64) -> Self {
        Shaper {
            ps_per_byte: ps_per_byte.max(1),
            burst_bytes,
            credit_ps: burst_bytes * ps_per_byte.max(1),
            at_ps: 0,
        }
    }

    fn cap_ps(&self) -> u64 {
        self.burst_bytes * self.ps_per_byte
    }

    /// The earliest instant at or after `earliest_ps` at which a packet of
    /// `size` bytes may start; takes its tokens out of the bucket.
    ///
    /// A packet larger than the bucket waits for a full bucket and then
    /// leaves it empty (tbf would refuse it forever; a real scheduler lets
    /// it pass at the shaping rate).
    fn start(&mut self, earliest_ps: u64, size: u32) -> u64 {
        let t = earliest_ps.max(self.at_ps);
        let credit = (self.credit_ps + (t - self.at_ps)).min(self.cap_ps());
        let need = (size as u64 * self.ps_per_byte).min(self.cap_ps());
        let start = t + need.saturating_sub(credit);
        let credit_at_start = credit + (start - t);
        self.credit_ps = credit_at_start - need;
        self.at_ps = start;
        start
    }
}

/// One output port's queue.
#[derive(Debug, Clone)]
pub struct PortQueue {
    backlog: VecDeque<(u64, u32)>,
    bytes: u64,
    free_at_ps: u64,
    capacity: u64,
    ecn_threshold: u64,
    max_bytes: u64,
    shaper: Option<Shaper>,
}

impl PortQueue {
    /// A port with `capacity` bytes of buffer that marks ECN-capable
    /// packets CE when more than `ecn_threshold` bytes are queued ahead of
    /// them (DCTCP-style instantaneous marking).
    pub fn new(capacity: u64, ecn_threshold: u64) -> Self {
        PortQueue {
            backlog: VecDeque::new(),
            bytes: 0,
            free_at_ps: 0,
            capacity,
            ecn_threshold,
            max_bytes: 0,
            shaper: None,
        }
    }

    /// A port with `capacity` bytes of buffer whose departures `shaper`
    /// holds back (see the module documentation).
    pub fn shaped(capacity: u64, ecn_threshold: u64, shaper: Shaper) -> Self {
        PortQueue {
            shaper: Some(shaper),
            ..PortQueue::new(capacity, ecn_threshold)
        }
    }

    /// The port's shaper, if it has one.
    pub fn shaper(&self) -> Option<&Shaper> {
        self.shaper.as_ref()
    }

    fn drain(&mut self, now_ps: u64) {
        while let Some(&(end, size)) = self.backlog.front() {
            if end > now_ps {
                break;
            }
            self.bytes -= size as u64;
            self.backlog.pop_front();
        }
    }

    /// Offer a packet of `size` bytes at `now_ps`, to be serialised at
    /// `ps_per_byte` (the line rate) once the port's shaper, if any, lets
    /// it start.
    pub fn enqueue(
        &mut self,
        now_ps: u64,
        size: u32,
        ecn_capable: bool,
        ps_per_byte: u64,
    ) -> Admission {
        self.drain(now_ps);
        if self.bytes + size as u64 > self.capacity {
            return Admission::TailDrop;
        }
        let mark_ce = ecn_capable && self.bytes > self.ecn_threshold;
        let mut start = self.free_at_ps.max(now_ps);
        if let Some(shaper) = &mut self.shaper {
            start = shaper.start(start, size);
        }
        let end = start + size as u64 * ps_per_byte;
        self.free_at_ps = end;
        self.bytes += size as u64;
        self.max_bytes = self.max_bytes.max(self.bytes);
        self.backlog.push_back((end, size));
        Admission::Accepted {
            end_ps: end,
            mark_ce,
        }
    }

    /// Bytes buffered at `now_ps` (including the packet being serialised).
    pub fn bytes_at(&mut self, now_ps: u64) -> u64 {
        self.drain(now_ps);
        self.bytes
    }

    /// The largest occupancy seen, in bytes.
    pub fn max_bytes(&self) -> u64 {
        self.max_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serialises_back_to_back() {
        let mut q = PortQueue::new(10_000, 5_000);
        let a = q.enqueue(0, 1000, true, 80);
        let b = q.enqueue(0, 1000, true, 80);
        assert_eq!(
            a,
            Admission::Accepted {
                end_ps: 80_000,
                mark_ce: false
            }
        );
        assert_eq!(
            b,
            Admission::Accepted {
                end_ps: 160_000,
                mark_ce: false
            }
        );
        assert_eq!(q.bytes_at(80_000), 1000);
        assert_eq!(q.bytes_at(160_000), 0);
        // An idle port starts at once.
        let c = q.enqueue(1_000_000, 500, false, 80);
        assert_eq!(
            c,
            Admission::Accepted {
                end_ps: 1_040_000,
                mark_ce: false
            }
        );
    }

    #[test]
    fn ecn_threshold_marks_only_capable_packets_above_k() {
        let mut q = PortQueue::new(100_000, 2_500);
        let mut marks = Vec::new();
        for _ in 0..5 {
            match q.enqueue(0, 1000, true, 80) {
                Admission::Accepted { mark_ce, .. } => marks.push(mark_ce),
                Admission::TailDrop => panic!(),
            }
        }
        // Queue ahead: 0, 1000, 2000, 3000, 4000 bytes; K = 2500.
        assert_eq!(marks, vec![false, false, false, true, true]);
        match q.enqueue(0, 1000, false, 80) {
            Admission::Accepted { mark_ce, .. } => assert!(!mark_ce),
            Admission::TailDrop => panic!(),
        }
    }

    #[test]
    fn tail_drops_when_full_and_recovers() {
        let mut q = PortQueue::new(3_000, u64::MAX);
        assert!(matches!(
            q.enqueue(0, 1000, false, 80),
            Admission::Accepted { .. }
        ));
        assert!(matches!(
            q.enqueue(0, 1000, false, 80),
            Admission::Accepted { .. }
        ));
        assert!(matches!(
            q.enqueue(0, 1000, false, 80),
            Admission::Accepted { .. }
        ));
        assert_eq!(q.enqueue(0, 1, false, 80), Admission::TailDrop);
        assert_eq!(q.max_bytes(), 3_000);
        // After the first packet left there is room again.
        assert!(matches!(
            q.enqueue(80_000, 1000, false, 80),
            Admission::Accepted {
                end_ps: 320_000,
                ..
            }
        ));
    }

    fn end(a: Admission) -> u64 {
        match a {
            Admission::Accepted { end_ps, .. } => end_ps,
            Admission::TailDrop => panic!("dropped"),
        }
    }

    #[test]
    fn parses_shaper_specs_as_tc_tbf() {
        let s: ShaperSpec = "0.2:100000:20ms".parse().unwrap();
        assert_eq!(s.gbps, 0.2);
        assert_eq!(s.burst_bytes, 100_000);
        assert_eq!(s.queue, QueueLimit::Latency { ns: 20 * NS_PER_MS });
        // tc: limit = rate × latency + burst.
        assert_eq!(s.queue_bytes(1), 600_000);
        assert_eq!(s.shaper().ps_per_byte, 40_000);
        let s: ShaperSpec = "25:65536:300000".parse().unwrap();
        assert_eq!(s.queue_bytes(1), 300_000);
        let s: ShaperSpec = "25:65536".parse().unwrap();
        assert_eq!(s.queue_bytes(123_456), 123_456);
        assert!(s.validate(123_456, 5_000).is_ok());
        assert!("0:1000"
            .parse::<ShaperSpec>()
            .unwrap()
            .validate(1 << 20, 5000)
            .is_err());
        for bad in ["", "1", "1:x", "1:100:5s", "1:100:1:2", "x:100"] {
            assert!(bad.parse::<ShaperSpec>().is_err(), "{bad}");
        }
    }

    #[test]
    fn shaped_port_releases_a_burst_at_line_rate_then_waits_for_tokens() {
        // Line 100 Gbit/s (80 ps/B), shaped to 10 Gbit/s (800 ps/B), bucket
        // of 3,000 bytes: three 1,000-byte packets leave back to back, then
        // one every 800 ns (the time 1,000 bytes of tokens take to refill).
        let mut q = PortQueue::shaped(1_000_000, u64::MAX, Shaper::new(800, 3_000));
        let ends: Vec<u64> = (0..6).map(|_| end(q.enqueue(0, 1000, false, 80))).collect();
        assert_eq!(ends[..3], [80_000, 160_000, 240_000]);
        // By time t the bucket has let 3,000 B + t / 800 ps of bytes start:
        // the fourth starts at 800 ns, the fifth at 1,600, the sixth at 2,400.
        assert_eq!(ends[3], 800_000 + 80_000);
        assert_eq!(ends[4], 1_600_000 + 80_000);
        assert_eq!(ends[5], 2_400_000 + 80_000);
        // The queue is deep: six packets are held at once.
        assert_eq!(q.bytes_at(0), 6_000);
        // Long idle: the bucket refills only up to its size.
        let later = 100_000_000;
        let ends: Vec<u64> = (0..4)
            .map(|_| end(q.enqueue(later, 1000, false, 80)))
            .collect();
        assert_eq!(
            ends,
            [
                later + 80_000,
                later + 160_000,
                later + 240_000,
                later + 800_000 + 80_000
            ]
        );
    }

    #[test]
    fn shaped_port_sustains_the_shaping_rate() {
        // 4,000 packets of 1,000 B at 10 Gbit/s: the first ten are the
        // burst, every later one waits 800 ns for its tokens.
        let mut q = PortQueue::shaped(u64::MAX, u64::MAX, Shaper::new(800, 10_000));
        let mut last = 0;
        for _ in 0..4_000 {
            last = end(q.enqueue(0, 1000, false, 80));
        }
        assert_eq!(last, (4_000 - 10) * 800_000 + 80_000);
    }

    #[test]
    fn shaped_port_tail_drops_at_its_byte_limit() {
        let mut q = PortQueue::shaped(5_000, u64::MAX, Shaper::new(800, 1_000));
        for _ in 0..5 {
            end(q.enqueue(0, 1000, false, 80));
        }
        assert_eq!(q.enqueue(0, 1000, false, 80), Admission::TailDrop);
        // The first packet left at 80 ns; the second starts only at 800 ns.
        assert_eq!(q.bytes_at(100_000), 4_000);
        assert_eq!(q.bytes_at(880_000), 3_000);
    }
}
