//! Criterion benchmarks of the sans-IO core.
//!
//! - `codec/*`: encode and decode of a DATA packet with a 4 KiB payload and
//!   of an ACK with 8 path entries (plus a plain 4 KiB memcpy for scale).
//! - `core/*`: the per-packet cost of the endpoint on a real transfer: a
//!   connected pair, one QP, a 64 MiB WRITE reposted whenever it completes.
//!   The sender's `poll_transmit` producing 4 KiB WRITE packets and the
//!   receiver's `handle_datagram` consuming them are timed separately
//!   (`iter_custom`); the rest of the loop (ACKs back to the sender, time
//!   steps, completions) runs untimed. Every timed packet is a new one of a
//!   live transfer, so the work per iteration is real.
//! - `core/ping_pong_8b`: the core's whole share of an 8-byte SEND/RECV
//!   round trip between two endpoints (post, transmit, receive, complete,
//!   repost, and the timer checks a driver makes each turn), the ACK of
//!   each SEND riding on the answer (PROTOCOL §6.7): what the core adds to
//!   a small message's latency on top of the system calls.
//!
//! Run: `cargo bench -p metaroce-proto --bench core -- --quick`.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use metaroce_proto::consts::SACK_BYTES;
use metaroce_proto::verbs::*;
use metaroce_proto::wire::{AckBuilder, AckHeader, AckPacket, AckPathEntry, DataHeader, OpcodeExt};
use metaroce_proto::{Chunk, Ecn, Endpoint, EndpointConfig, Event, Gather, Instant, RegionPin};
use std::hint::black_box;
use std::net::SocketAddr;
use std::time::Duration;

const PAYLOAD: usize = 4096;

fn data_header() -> DataHeader {
    DataHeader {
        opcode: metaroce_proto::wire::Opcode::Write,
        flags: 0,
        dst_cid: 0x1234_5678,
        dst_qpn: 17,
        path_id: 3,
        gen: 0,
        psn: 1000,
        csn: 5000,
        tx_ts: 42,
        msn: 7,
        msg_len: 1 << 20,
        msg_offset: 8 * PAYLOAD as u32,
        ext: OpcodeExt::Write {
            rkey: 9,
            remote_addr: 0x1000_0000,
        },
    }
}

fn ack_8_paths(buf: &mut [u8]) -> usize {
    let mut b = AckBuilder::new(
        buf,
        AckHeader {
            flags: 0,
            dst_cid: 77,
            cum_csn: 123_456,
            ts_echo: 5,
            ack_delay_ns: 600,
            rate_hint_kbps: 0,
            echo_path: 3,
        },
    )
    .unwrap();
    for i in 0..8u8 {
        let mut sack = [0u8; SACK_BYTES];
        sack[usize::from(i)] = 0b1010_0101;
        b.push_path(&AckPathEntry {
            path_id: i,
            ack_psn: 1000 + u32::from(i),
            sack,
            rx_packets: 5000,
            ce_packets: 3,
        })
        .unwrap();
    }
    b.finish()
}

fn codec(c: &mut Criterion) {
    let mut g = c.benchmark_group("codec");
    g.throughput(Throughput::Elements(1));
    let hdr = data_header();
    let payload = vec![0xabu8; PAYLOAD];
    let mut buf = vec![0u8; 9000];
    g.bench_function("data_encode_4k", |b| {
        b.iter(|| black_box(&hdr).emit(black_box(&mut buf[..]), black_box(&payload)))
    });
    let n = hdr.emit(&mut buf, &payload).unwrap();
    let pkt = buf[..n].to_vec();
    g.bench_function("data_decode_4k", |b| {
        b.iter(|| {
            let (h, p) = DataHeader::parse(black_box(&pkt)).unwrap();
            black_box((h.msn, p.len()))
        })
    });
    g.bench_function("ack_encode_8_paths", |b| {
        b.iter(|| ack_8_paths(black_box(&mut buf[..])))
    });
    let n = ack_8_paths(&mut buf);
    let ack = buf[..n].to_vec();
    g.bench_function("ack_decode_8_paths", |b| {
        b.iter(|| {
            let a = AckPacket::parse(black_box(&ack), |_| false).unwrap();
            // Decoding includes reading every entry.
            let s: u32 = a.paths().map(|p| p.ack_psn ^ u32::from(p.sack[0])).sum();
            black_box(s)
        })
    });
    g.throughput(Throughput::Bytes(PAYLOAD as u64));
    let src = vec![0x5au8; PAYLOAD];
    let mut dst = vec![0u8; PAYLOAD];
    g.bench_function("memcpy_4k", |b| {
        b.iter(|| {
            dst.copy_from_slice(black_box(&src));
            black_box(&mut dst);
        })
    });
    g.finish();
}

/// A connected pair with a 64 MiB WRITE always in flight from A to B.
struct Transfer {
    a: Endpoint,
    b: Endpoint,
    a_addr: SocketAddr,
    b_addr: SocketAddr,
    now: Instant,
    qa: Qpn,
    cqa: CqHandle,
    src: MrInfo,
    dst: MrInfo,
    next_wr: u64,
    outstanding: u32,
    /// Transmits A produced this round (buffers reused): each one's size,
    /// ECN, source port and GSO segment size.
    bufs: Vec<Vec<u8>>,
    sizes: Vec<(usize, Ecn, u16, Option<usize>)>,
    scratch: Vec<u8>,
    wcs: Vec<WorkCompletion>,
    /// Gathered transmits (as the io_uring driver sends): the gather, the
    /// chunks of each transmit of the round and the pins to release.
    gather: Option<Gather>,
    chunks: Vec<Vec<Chunk>>,
    pins: Vec<RegionPin>,
}

const BIG: usize = 64 << 20;
/// Datagrams taken from the sender per round at most.
const ROUND: usize = 256;

impl Transfer {
    /// A connected pair with two big WRITEs posted; `gso`: A batches up to
    /// 15 segments per transmit and gathers payloads from their region
    /// (threshold 1 KiB), as the io_uring driver has it do, else one copied
    /// datagram per transmit.
    fn new(gso: bool) -> Transfer {
        let a_addr: SocketAddr = "10.0.0.1:4792".parse().unwrap();
        let b_addr: SocketAddr = "10.0.0.2:4792".parse().unwrap();
        let cfg = EndpointConfig {
            max_gso_segments: if gso { 15 } else { 1 },
            ..EndpointConfig::default()
        };
        let mut a = Endpoint::new(cfg.clone(), 1).unwrap();
        let mut b = Endpoint::new(cfg, 2).unwrap();
        let (pa, pb) = (a.alloc_pd(), b.alloc_pd());
        let (cqa, cqb) = (a.create_cq(1024), b.create_cq(1024));
        let src = a
            .reg_mr(pa, vec![7u8; BIG].into_boxed_slice(), 0, AccessFlags::NONE)
            .unwrap();
        let dst = b
            .reg_mr(
                pb,
                vec![0u8; BIG].into_boxed_slice(),
                0x1000_0000,
                AccessFlags::REMOTE_WRITE,
            )
            .unwrap();
        let qa = a.create_qp(QpInit::new(pa, cqa, cqa)).unwrap();
        let qb = b.create_qp(QpInit::new(pb, cqb, cqb)).unwrap();
        let now = Instant::ZERO;
        let conn_a = a.connect(now, b_addr).unwrap();
        let mut t = Transfer {
            a,
            b,
            a_addr,
            b_addr,
            now,
            qa,
            cqa,
            src,
            dst,
            next_wr: 0,
            outstanding: 0,
            bufs: vec![vec![0u8; if gso { 65_536 } else { 9000 }]; ROUND],
            sizes: Vec::with_capacity(ROUND),
            scratch: vec![0u8; 65_536],
            wcs: Vec::new(),
            gather: gso.then(|| Gather::new(1024)),
            chunks: vec![Vec::new(); ROUND],
            pins: Vec::new(),
        };
        let mut conn_b = None;
        for _ in 0..100 {
            t.exchange_all();
            while let Some(e) = t.b.poll_event() {
                if let Event::Incoming { conn, .. } = e {
                    conn_b = Some(conn);
                }
            }
            if conn_b.is_some() {
                break;
            }
        }
        let conn_b = conn_b.expect("handshake");
        t.a.connect_qp(qa, conn_a, qb).unwrap();
        t.b.connect_qp(qb, conn_b, qa).unwrap();
        t.refill();
        t
    }

    /// Untimed: moves every datagram both ways until quiet.
    fn exchange_all(&mut self) {
        loop {
            let mut moved = false;
            while let Some(x) = self.a.poll_transmit(self.now, &mut self.scratch) {
                self.b
                    .handle_datagram(self.now, self.a_addr, x.ecn, &self.scratch[..x.size]);
                moved = true;
            }
            while let Some(x) = self.b.poll_transmit(self.now, &mut self.scratch) {
                self.a
                    .handle_datagram(self.now, self.b_addr, x.ecn, &self.scratch[..x.size]);
                moved = true;
            }
            if !moved {
                break;
            }
        }
    }

    /// Keeps two big WRITEs posted.
    fn refill(&mut self) {
        self.wcs.clear();
        self.a.poll_cq(self.cqa, 64, &mut self.wcs).unwrap();
        for w in &self.wcs {
            assert_eq!(w.status, WcStatus::Success);
            self.outstanding -= 1;
        }
        while self.outstanding < 2 {
            let wr = SendWr::new(
                self.next_wr,
                SendOp::Write(RemoteAddr {
                    rkey: self.dst.rkey,
                    addr: self.dst.addr,
                }),
                Sge {
                    lkey: self.src.lkey,
                    addr: 0,
                    len: BIG as u32,
                },
            );
            self.next_wr += 1;
            self.a.post_send(self.now, self.qa, wr).unwrap();
            self.outstanding += 1;
        }
    }

    /// Timed part 1: transmits of up to `max` datagrams in all out of the
    /// sender into `bufs`; returns the number of datagrams.
    fn produce(&mut self, max: usize) -> usize {
        self.sizes.clear();
        let mut datagrams = 0;
        for i in 0..ROUND {
            if datagrams >= max {
                break;
            }
            let t = match &mut self.gather {
                Some(g) => {
                    let t = self.a.poll_transmit_gather(self.now, &mut self.bufs[i], g);
                    if t.is_some() {
                        g.take_pins(&mut self.pins);
                        self.chunks[i].clear();
                        self.chunks[i].extend_from_slice(g.chunks());
                    }
                    t
                }
                None => self.a.poll_transmit(self.now, &mut self.bufs[i]),
            };
            let Some(x) = t else { break };
            datagrams += x.segment_size.map_or(1, |s| x.size.div_ceil(s));
            self.sizes.push((x.size, x.ecn, x.src_port, x.segment_size));
        }
        datagrams
    }

    /// Untimed, for gathered transmits: puts each one's bytes together in
    /// its buffer (what the kernel does with the `iovec`s) and gives the
    /// regions' pins back.
    fn assemble(&mut self) {
        if self.gather.is_none() {
            return;
        }
        for i in 0..self.sizes.len() {
            let mut k = 0;
            for c in &self.chunks[i] {
                let bytes = match c {
                    Chunk::Buf(r) => &self.bufs[i][r.clone()],
                    Chunk::Region { lkey, range } => &self.a.mr(*lkey).unwrap()[range.clone()],
                };
                self.scratch[k..k + bytes.len()].copy_from_slice(bytes);
                k += bytes.len();
            }
            if !self.chunks[i].is_empty() {
                self.bufs[i][..k].copy_from_slice(&self.scratch[..k]);
            }
        }
        self.a.release_pins(&mut self.pins);
    }

    /// Timed part 2: the receiver consumes what was produced, datagram by
    /// datagram.
    fn consume(&mut self) {
        for (i, &(size, ecn, port, seg)) in self.sizes.iter().enumerate() {
            let from = SocketAddr::new(self.a_addr.ip(), port);
            for dg in self.bufs[i][..size].chunks(seg.unwrap_or(size).max(1)) {
                self.b.handle_datagram(self.now, from, ecn, dg);
            }
        }
    }

    /// Untimed: ACKs back, time moves on, timers, completions.
    fn settle(&mut self) {
        while let Some(x) = self.b.poll_transmit(self.now, &mut self.scratch) {
            self.a
                .handle_datagram(self.now, self.b_addr, x.ecn, &self.scratch[..x.size]);
        }
        self.now = self.now + Duration::from_micros(5);
        for ep in [&mut self.a, &mut self.b] {
            if ep.poll_timeout().is_some_and(|t| t <= self.now) {
                ep.handle_timeout(self.now);
            }
        }
        self.refill();
    }
}

/// Runs the transfer until `iters` sender datagrams went through, timing
/// either the sender's `poll_transmit` or the receiver's `handle_datagram`.
#[allow(clippy::disallowed_methods)] // the benchmark's own stopwatch, not the core's clock
fn run_timed(t: &mut Transfer, iters: u64, time_sender: bool) -> Duration {
    let mut total = Duration::ZERO;
    let mut done = 0u64;
    let mut idle_rounds = 0;
    while done < iters {
        let want = (iters - done).min(ROUND as u64) as usize;
        let start = std::time::Instant::now();
        let n = t.produce(want);
        let mid = std::time::Instant::now();
        t.assemble();
        let mid2 = std::time::Instant::now();
        t.consume();
        let end = std::time::Instant::now();
        total += if time_sender { mid - start } else { end - mid2 };
        done += n as u64;
        idle_rounds = if n == 0 { idle_rounds + 1 } else { 0 };
        assert!(idle_rounds < 100_000, "the transfer stalled");
        t.settle();
    }
    total
}

fn core(c: &mut Criterion) {
    let mut g = c.benchmark_group("core");
    g.throughput(Throughput::Elements(1));
    for gso in [false, true] {
        let mut t = Transfer::new(gso);
        // Warm the congestion window up.
        run_timed(&mut t, 20_000, true);
        let (size, seg) = t.sizes.first().map_or((0, None), |s| (s.0, s.3));
        assert!(
            seg.unwrap_or(size) > PAYLOAD,
            "sender datagrams should be full 4 KiB WRITEs, got {size} bytes ({seg:?} per segment)"
        );
        if gso {
            assert!(
                seg.is_some_and(|s| size >= 8 * s),
                "GSO batches of full segments, got {size} bytes ({seg:?} per segment)"
            );
        }
        // Per datagram, both ways.
        let suffix = if gso { "_gso_gathered" } else { "" };
        g.bench_function(format!("poll_transmit_write_4k{suffix}"), |b| {
            b.iter_custom(|iters| run_timed(&mut t, iters, true))
        });
        g.bench_function(format!("handle_datagram_write_4k{suffix}"), |b| {
            b.iter_custom(|iters| run_timed(&mut t, iters, false))
        });
        // The transfer really delivered bytes.
        assert!(t.b.mr(t.dst.lkey).unwrap()[..1 << 20]
            .iter()
            .all(|&x| x == 7));
    }
    g.finish();
}

/// Two connected endpoints exchanging 8-byte SENDs, driven the way a
/// driver's turn drives them: the timer check, every transmit, every
/// datagram in, then the completions.
struct PingPong {
    eps: [Endpoint; 2],
    addrs: [SocketAddr; 2],
    qps: [Qpn; 2],
    cqs: [CqHandle; 2],
    mrs: [MrInfo; 2],
    now: Instant,
    buf: Vec<u8>,
    wcs: Vec<WorkCompletion>,
}

impl PingPong {
    fn new() -> PingPong {
        let addrs: [SocketAddr; 2] = [
            "10.0.0.1:4792".parse().unwrap(),
            "10.0.0.2:4792".parse().unwrap(),
        ];
        let mut eps = [1, 2].map(|seed| Endpoint::new(EndpointConfig::default(), seed).unwrap());
        let pds = [eps[0].alloc_pd(), eps[1].alloc_pd()];
        let cqs = [eps[0].create_cq(64), eps[1].create_cq(64)];
        let mrs = [0, 1].map(|i| {
            eps[i]
                .reg_mr(
                    pds[i],
                    vec![0u8; 16].into_boxed_slice(),
                    0,
                    AccessFlags::LOCAL_WRITE,
                )
                .unwrap()
        });
        let qps = [0, 1].map(|i| {
            eps[i]
                .create_qp(QpInit::new(pds[i], cqs[i], cqs[i]))
                .unwrap()
        });
        let now = Instant::ZERO;
        let conn_a = eps[0].connect(now, addrs[1]).unwrap();
        let mut p = PingPong {
            eps,
            addrs,
            qps,
            cqs,
            mrs,
            now,
            buf: vec![0u8; 9000],
            wcs: Vec::new(),
        };
        let mut conn_b = None;
        for _ in 0..100 {
            p.turn(0);
            p.turn(1);
            while let Some(e) = p.eps[1].poll_event() {
                if let Event::Incoming { conn, .. } = e {
                    conn_b = Some(conn);
                }
            }
            if conn_b.is_some() {
                break;
            }
        }
        let conn_b = conn_b.expect("handshake");
        p.eps[0].connect_qp(qps[0], conn_a, qps[1]).unwrap();
        p.eps[1].connect_qp(qps[1], conn_b, qps[0]).unwrap();
        for i in 0..2 {
            p.eps[i].post_recv(p.qps[i], p.recv_wr(i)).unwrap();
        }
        p
    }

    fn recv_wr(&self, i: usize) -> RecvWr {
        RecvWr {
            wr_id: 0,
            sge: Sge {
                lkey: self.mrs[i].lkey,
                addr: 8,
                len: 8,
            }
            .into(),
        }
    }

    fn send(&mut self, i: usize) {
        let wr = SendWr::new(
            1,
            SendOp::Send,
            Sge {
                lkey: self.mrs[i].lkey,
                addr: 0,
                len: 8,
            },
        );
        self.eps[i].post_send(self.now, self.qps[i], wr).unwrap();
    }

    /// A driver's turn at side `i`: timers, then what it sends goes
    /// straight into the other side.
    fn turn(&mut self, i: usize) {
        self.now = self.now + Duration::from_nanos(500);
        if self.eps[i].poll_timeout().is_some_and(|t| t <= self.now) {
            self.eps[i].handle_timeout(self.now);
        }
        while let Some(x) = self.eps[i].poll_transmit(self.now, &mut self.buf) {
            let from = SocketAddr::new(self.addrs[i].ip(), x.src_port);
            self.eps[1 - i].handle_datagram(self.now, from, x.ecn, &self.buf[..x.size]);
        }
    }

    /// Side `i`'s completions: true if a message arrived (its RECV reposted).
    fn received(&mut self, i: usize) -> bool {
        self.wcs.clear();
        self.eps[i].poll_cq(self.cqs[i], 8, &mut self.wcs).unwrap();
        let mut got = false;
        for k in 0..self.wcs.len() {
            assert_eq!(self.wcs[k].status, WcStatus::Success);
            if self.wcs[k].opcode == WcOpcode::Recv {
                got = true;
                self.eps[i].post_recv(self.qps[i], self.recv_wr(i)).unwrap();
            }
        }
        got
    }

    /// One round trip: A's SEND to B, B's answer back.
    fn round_trip(&mut self) {
        self.send(0);
        self.turn(0);
        self.turn(1);
        assert!(self.received(1), "the SEND arrived");
        self.send(1);
        self.turn(1);
        self.turn(0);
        assert!(self.received(0), "the answer arrived");
    }
}

fn ping_pong(c: &mut Criterion) {
    let mut g = c.benchmark_group("core");
    g.throughput(Throughput::Elements(1));
    let mut p = PingPong::new();
    for _ in 0..1000 {
        p.round_trip();
    }
    g.bench_function("ping_pong_8b", |b| b.iter(|| p.round_trip()));
    // What was timed is the exchange the protocol means: each ACK rode on
    // the answer, two datagrams a round trip.
    let sent = |p: &PingPong| p.eps[0].stats().datagrams_sent + p.eps[1].stats().datagrams_sent;
    let before = sent(&p);
    for _ in 0..1000 {
        p.round_trip();
    }
    let per_rt = (sent(&p) - before) as f64 / 1000.0;
    assert!(per_rt < 2.05, "{per_rt} datagrams a round trip");
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets = codec, core, ping_pong
}
criterion_main!(benches);
