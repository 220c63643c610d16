//! The core's work per data packet on each side of a bulk WRITE stream, to
//! be counted in instructions (deterministic, unlike time on a shared
//! machine): `scripts/packet-cost.sh` runs this under callgrind and divides
//! the instructions of each side's functions below by the packets moved.
//!
//! The shape is the loopback benchmark's (`examples/loopback_baselines.rs`):
//! one connection, one QP, 16 outstanding 64 KiB WRITEs into 16 slots of the
//! remote region, the sender gathering payloads from its region into GSO
//! batches of up to 15 segments, at most two batches per turn (the io_uring
//! driver's default turn budget). What the kernel would do (putting the
//! gathered batches together, cutting them into datagrams) is done here
//! outside the counted functions.
//!
//! Run: `cargo run --release -p metaroce-proto --example packet_cost -- [PACKETS]`
//! (prints what it moved; the counting needs valgrind).

use metaroce_proto::verbs::*;
use metaroce_proto::{Chunk, Ecn, Endpoint, EndpointConfig, Event, Gather, Instant, RegionPin};
use std::net::SocketAddr;
use std::time::Duration;

const SIZE: usize = 64 << 10;
const DEPTH: u64 = 16;
/// Transmits per sender turn (two full GSO batches: 128 KiB).
const TURN: usize = 2;

/// A transmit of the sender's turn: its bytes (headers, or whole datagrams
/// once assembled), size, source port, segment size and gathered chunks.
type Out = (Vec<u8>, usize, u16, Option<usize>, Vec<Chunk>);

struct Stream {
    a: Endpoint,
    b: Endpoint,
    a_addr: SocketAddr,
    b_addr: SocketAddr,
    now: Instant,
    qa: Qpn,
    cqa: CqHandle,
    src: MrInfo,
    dst: MrInfo,
    posted: u64,
    done: u64,
    gather: Gather,
    pins: Vec<RegionPin>,
    /// The sender's transmits of a turn.
    out: Vec<Out>,
    /// The receiver's answers of a turn (the first `nacks` of them).
    acks: Vec<(Vec<u8>, usize)>,
    nacks: usize,
    scratch: Vec<u8>,
    wcs: Vec<WorkCompletion>,
    data_packets: u64,
    ack_packets: u64,
}

impl Stream {
    fn new() -> Stream {
        let a_addr: SocketAddr = "127.0.0.1:4792".parse().unwrap();
        let b_addr: SocketAddr = "127.0.0.1:4793".parse().unwrap();
        let cfg = EndpointConfig {
            max_gso_segments: 15,
            ..EndpointConfig::default()
        };
        let mut a = Endpoint::new(cfg.clone(), 1).unwrap();
        let mut b = Endpoint::new(cfg, 2).unwrap();
        let (pa, pb) = (a.alloc_pd(), b.alloc_pd());
        let (cqa, cqb) = (a.create_cq(1024), b.create_cq(1024));
        let src = a
            .reg_mr(
                pa,
                vec![7u8; 16 * SIZE].into_boxed_slice(),
                0,
                AccessFlags::NONE,
            )
            .unwrap();
        let dst = b
            .reg_mr(
                pb,
                vec![0u8; 16 * SIZE].into_boxed_slice(),
                0,
                AccessFlags::REMOTE_WRITE,
            )
            .unwrap();
        let qa = a.create_qp(QpInit::new(pa, cqa, cqa)).unwrap();
        let qb = b.create_qp(QpInit::new(pb, cqb, cqb)).unwrap();
        let now = Instant::ZERO;
        let conn_a = a.connect(now, b_addr).unwrap();
        let mut s = Stream {
            a,
            b,
            a_addr,
            b_addr,
            now,
            qa,
            cqa,
            src,
            dst,
            posted: 0,
            done: 0,
            gather: Gather::new(1024),
            pins: Vec::new(),
            out: (0..TURN)
                .map(|_| (vec![0u8; 65_536], 0, 0, None, Vec::new()))
                .collect(),
            acks: Vec::new(),
            nacks: 0,
            scratch: vec![0u8; 65_536],
            wcs: Vec::new(),
            data_packets: 0,
            ack_packets: 0,
        };
        let mut conn_b = None;
        for _ in 0..100 {
            s.handshake_step();
            while let Some(e) = s.b.poll_event() {
                if let Event::Incoming { conn, .. } = e {
                    conn_b = Some(conn);
                }
            }
            if conn_b.is_some() {
                break;
            }
        }
        let conn_b = conn_b.expect("handshake");
        s.a.connect_qp(qa, conn_a, qb).unwrap();
        s.b.connect_qp(qb, conn_b, qa).unwrap();
        s
    }

    fn handshake_step(&mut self) {
        while let Some(x) = self.a.poll_transmit(self.now, &mut self.scratch) {
            self.b
                .handle_datagram(self.now, self.a_addr, x.ecn, &self.scratch[..x.size]);
        }
        while let Some(x) = self.b.poll_transmit(self.now, &mut self.scratch) {
            self.a
                .handle_datagram(self.now, self.b_addr, x.ecn, &self.scratch[..x.size]);
        }
    }

    /// One turn of each side; returns the data packets moved.
    fn turn(&mut self) -> usize {
        sender_post(self);
        let n = sender_transmit(self);
        self.assemble();
        self.data_packets += receiver_receive(self) as u64;
        receiver_transmit(self);
        self.ack_packets += self.nacks as u64;
        sender_receive(self);
        self.now = self.now + Duration::from_micros(20);
        for ep in [&mut self.a, &mut self.b] {
            if ep.poll_timeout().is_some_and(|t| t <= self.now) {
                ep.handle_timeout(self.now);
            }
        }
        n
    }

    /// What the kernel does with a gathered send: the datagrams' bytes in
    /// one buffer (not counted: not the core's work).
    fn assemble(&mut self) {
        for (buf, size, _, _, chunks) in &mut self.out {
            if *size == 0 || chunks.is_empty() {
                continue;
            }
            let mut k = 0;
            for c in chunks.iter() {
                let bytes = match c {
                    Chunk::Buf(r) => &buf[r.clone()],
                    Chunk::Region { lkey, range } => &self.a.mr(*lkey).unwrap()[range.clone()],
                };
                self.scratch[k..k + bytes.len()].copy_from_slice(bytes);
                k += bytes.len();
            }
            buf[..k].copy_from_slice(&self.scratch[..k]);
        }
    }
}

/// Sender: completions reaped, WRITEs posted up to the depth.
#[inline(never)]
fn sender_post(s: &mut Stream) {
    s.wcs.clear();
    s.a.poll_cq(s.cqa, 64, &mut s.wcs).unwrap();
    for w in &s.wcs {
        assert_eq!(w.status, WcStatus::Success);
    }
    s.done += s.wcs.len() as u64;
    while s.posted - s.done < DEPTH {
        let slot = (s.posted % 16) * SIZE as u64;
        let wr = SendWr::new(
            s.posted,
            SendOp::Write(RemoteAddr {
                rkey: s.dst.rkey,
                addr: s.dst.addr + slot,
            }),
            Sge {
                lkey: s.src.lkey,
                addr: slot,
                len: SIZE as u32,
            },
        );
        s.a.post_send(s.now, s.qa, wr).unwrap();
        s.posted += 1;
    }
}

/// Sender: a turn's transmits (gathered GSO batches) out of the core.
#[inline(never)]
fn sender_transmit(s: &mut Stream) -> usize {
    let mut datagrams = 0;
    for (buf, size, port, seg, chunks) in &mut s.out {
        *size = 0;
        let Some(t) = s.a.poll_transmit_gather(s.now, buf, &mut s.gather) else {
            break;
        };
        s.gather.take_pins(&mut s.pins);
        chunks.clear();
        chunks.extend_from_slice(s.gather.chunks());
        (*size, *port, *seg) = (t.size, t.src_port, t.segment_size);
        datagrams += t.segment_size.map_or(1, |g| t.size.div_ceil(g));
    }
    // The kernel is done with the payloads once the batches are assembled.
    datagrams
}

/// Receiver: every datagram of the turn into the core.
#[inline(never)]
fn receiver_receive(s: &mut Stream) -> usize {
    let mut n = 0;
    for (buf, size, port, seg, _) in &s.out {
        let from = SocketAddr::new(s.a_addr.ip(), *port);
        for dg in buf[..*size].chunks(seg.unwrap_or(*size).max(1)) {
            s.b.handle_datagram(s.now, from, Ecn::Ect0, dg);
            n += 1;
        }
    }
    n
}

/// Receiver: its answers (ACKs) out of the core.
#[inline(never)]
fn receiver_transmit(s: &mut Stream) {
    let mut k = 0;
    loop {
        if s.acks.len() <= k {
            s.acks.push((vec![0u8; 9000], 0));
        }
        let Some(t) = s.b.poll_transmit(s.now, &mut s.acks[k].0) else {
            break;
        };
        s.acks[k].1 = t.size;
        k += 1;
    }
    s.nacks = k;
}

/// Sender: the ACKs into the core, and the regions' pins back.
#[inline(never)]
fn sender_receive(s: &mut Stream) {
    s.a.release_pins(&mut s.pins);
    for (buf, size) in &s.acks[..s.nacks] {
        s.a.handle_datagram(s.now, s.b_addr, Ecn::Ect0, &buf[..*size]);
    }
}

fn main() {
    let packets: u64 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(200_000);
    let mut s = Stream::new();
    let mut idle = 0;
    while s.data_packets < packets {
        if s.turn() == 0 {
            idle += 1;
            assert!(idle < 10_000, "the stream stalled");
        } else {
            idle = 0;
        }
    }
    // Every byte the completed WRITEs carried arrived.
    assert!(s.b.mr(s.dst.lkey).unwrap().iter().all(|&x| x == 7));
    println!(
        "data_packets {} ack_packets {} writes_completed {}",
        s.data_packets, s.ack_packets, s.done
    );
}
