//! Test harness: two endpoints joined by an in-memory link that drops,
//! duplicates, reorders and delays datagrams at random (seeded).
#![allow(dead_code)]

use metaroce_proto::verbs::*;
use metaroce_proto::{Chunk, Ecn, Endpoint, EndpointConfig, Event, Gather, Instant};
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::net::SocketAddr;
use std::time::Duration;

/// A small deterministic generator for the link (tests must not depend on the core's).
///
/// [`TestRng::with_tape`] makes one whose numbers come from given bytes
/// first (a fuzzer's input: each `next_u64` takes the next 8, so the
/// fuzzer steers every choice drawn from it), then from the seed.
#[derive(Debug, Clone)]
pub struct TestRng {
    state: u64,
    tape: Vec<u8>,
    pos: usize,
}

impl TestRng {
    pub fn new(seed: u64) -> Self {
        TestRng {
            state: seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1,
            tape: Vec::new(),
            pos: 0,
        }
    }
    /// Numbers from `tape` (8 bytes each, little-endian, the last one
    /// padded with zeros), then from `seed` as [`new`](Self::new) would.
    pub fn with_tape(seed: u64, tape: &[u8]) -> Self {
        TestRng {
            tape: tape.to_vec(),
            ..TestRng::new(seed)
        }
    }
    pub fn next_u64(&mut self) -> u64 {
        if self.pos < self.tape.len() {
            let end = (self.pos + 8).min(self.tape.len());
            let mut b = [0u8; 8];
            b[..end - self.pos].copy_from_slice(&self.tape[self.pos..end]);
            self.pos = end;
            return u64::from_le_bytes(b);
        }
        // xorshift64*
        let mut x = self.state;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.state = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
}

/// What the link does to each datagram.
#[derive(Debug, Clone, Copy)]
pub struct LinkConfig {
    pub loss: f64,
    pub duplicate: f64,
    pub reorder: f64,
    pub delay: Duration,
    /// Extra delay of a reordered datagram, at most.
    pub reorder_delay: Duration,
    /// CE-mark this fraction of ECN-capable datagrams.
    pub ce: f64,
    /// Serialisation rate in bytes per microsecond (0: infinite).
    pub bytes_per_us: u64,
}

impl LinkConfig {
    pub fn lossy(loss: f64) -> Self {
        LinkConfig {
            loss,
            duplicate: loss / 4.0,
            reorder: loss / 2.0,
            delay: Duration::from_micros(5),
            reorder_delay: Duration::from_micros(20),
            ce: 0.0,
            bytes_per_us: 0,
        }
    }
    pub fn perfect() -> Self {
        Self::lossy(0.0)
    }
}

#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
struct InFlight {
    at: u64,
    seq: u64,
    to_b: bool,
    from: SocketAddr,
    ecn: u8,
    bytes: Vec<u8>,
}

/// Which source ports a gray route carries, and the delay it adds.
pub type GrayRoute = (fn(u16) -> bool, Duration);

/// Two endpoints, a link, and simulated time.
pub struct Pair {
    pub a: Endpoint,
    pub b: Endpoint,
    pub a_addr: SocketAddr,
    pub b_addr: SocketAddr,
    pub now: Instant,
    pub link: LinkConfig,
    rng: TestRng,
    queue: BinaryHeap<Reverse<InFlight>>,
    seq: u64,
    buf: Vec<u8>,
    pub conn_a: Option<ConnectionHandle>,
    pub conn_b: Option<ConnectionHandle>,
    pub events_a: Vec<Event>,
    pub events_b: Vec<Event>,
    pub delivered: u64,
    pub dropped: u64,
    /// Datagrams the link delivered twice.
    pub duplicated: u64,
    /// Datagrams and their bytes put on the link, per direction (a->b, b->a).
    pub sent: [(u64, u64); 2],
    /// Link is cut in this direction (a->b, b->a).
    pub cut: (bool, bool),
    /// Both directions are cut until this instant (a host stall, or an
    /// outage that ends on time whatever the timers do).
    pub cut_until: Option<Instant>,
    /// Earliest time each direction's wire is free (serialisation).
    wire_free: [u64; 2],
    /// Transmits are gathered ([`Endpoint::poll_transmit_gather`]) and put
    /// together from their chunks, like a scatter-gather send would.
    pub gather: Option<Gather>,
    /// Region chunks gathered (payloads that were not copied by the core).
    pub region_chunks: u64,
    /// FNV-1a over every datagram put on the link, per direction.
    pub wire_hash: [u64; 2],
    /// Sees (and may change) each datagram the link carries, with its
    /// direction (true: a to b), after it was hashed and counted.
    #[allow(clippy::type_complexity)]
    pub on_wire: Option<Box<dyn FnMut(bool, &mut Vec<u8>)>>,
    /// A gray route: A's datagrams from a source port the function picks
    /// take this much longer (as through a slowed link that ECMP hashes
    /// those ports onto).
    pub gray: Option<GrayRoute>,
}

impl Pair {
    pub fn new(ca: EndpointConfig, cb: EndpointConfig, seed: u64, link: LinkConfig) -> Pair {
        Pair {
            a: Endpoint::new(ca, seed ^ 0xa).unwrap(),
            b: Endpoint::new(cb, seed ^ 0xb).unwrap(),
            a_addr: "10.0.0.1:4792".parse().unwrap(),
            b_addr: "10.0.0.2:4792".parse().unwrap(),
            now: Instant::ZERO,
            link,
            rng: TestRng::new(seed),
            queue: BinaryHeap::new(),
            seq: 0,
            buf: vec![0u8; 65536],
            conn_a: None,
            conn_b: None,
            events_a: Vec::new(),
            events_b: Vec::new(),
            delivered: 0,
            dropped: 0,
            duplicated: 0,
            sent: [(0, 0); 2],
            cut: (false, false),
            cut_until: None,
            wire_free: [0, 0],
            gather: None,
            region_chunks: 0,
            wire_hash: [0xcbf2_9ce4_8422_2325; 2],
            on_wire: None,
            gray: None,
        }
    }

    /// Connects A to B and runs until both sides know the connection.
    pub fn connect(&mut self) {
        let c = self.a.connect(self.now, self.b_addr).unwrap();
        self.conn_a = Some(c);
        let deadline = self.now + Duration::from_secs(30);
        self.run_until(deadline, |p| {
            p.conn_b.is_some() && p.events_a.contains(&Event::Connected(c))
        });
        assert!(self.conn_b.is_some(), "handshake did not finish");
    }

    fn flush(&mut self) {
        for to_b in [true, false] {
            loop {
                let (ep, from) = if to_b {
                    (&mut self.a, self.a_addr)
                } else {
                    (&mut self.b, self.b_addr)
                };
                let (t, wire) = match self.gather.as_mut() {
                    None => {
                        let Some(t) = ep.poll_transmit(self.now, &mut self.buf) else {
                            break;
                        };
                        (t, self.buf[..t.size].to_vec())
                    }
                    Some(g) => {
                        let Some(t) = ep.poll_transmit_gather(self.now, &mut self.buf, g) else {
                            break;
                        };
                        let mut wire = Vec::with_capacity(t.size);
                        if g.chunks().is_empty() {
                            wire.extend_from_slice(&self.buf[..t.size]);
                        }
                        for c in g.chunks() {
                            match c {
                                Chunk::Buf(r) => wire.extend_from_slice(&self.buf[r.clone()]),
                                Chunk::Region { lkey, range } => {
                                    self.region_chunks += 1;
                                    wire.extend_from_slice(&ep.mr(*lkey).unwrap()[range.clone()]);
                                }
                            }
                        }
                        let mut pins = Vec::new();
                        g.take_pins(&mut pins);
                        ep.release_pins(&mut pins);
                        (t, wire)
                    }
                };
                assert!(t.size <= self.buf.len());
                assert_eq!(wire.len(), t.size, "the chunks add up to the transmit");
                let from = SocketAddr::new(from.ip(), t.src_port);
                // A GSO batch is several datagrams: the link sees each.
                let seg = t.segment_size.unwrap_or(t.size).max(1);
                let datagrams: Vec<Vec<u8>> = wire.chunks(seg).map(|c| c.to_vec()).collect();
                for mut bytes in datagrams {
                    let h = &mut self.wire_hash[usize::from(!to_b)];
                    for &b in &bytes {
                        *h = (*h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
                    }
                    if let Some(f) = self.on_wire.as_mut() {
                        f(to_b, &mut bytes);
                    }
                    let sent = &mut self.sent[usize::from(!to_b)];
                    sent.0 += 1;
                    sent.1 += bytes.len() as u64;
                    let cut = if to_b { self.cut.0 } else { self.cut.1 };
                    let cut = cut || self.cut_until.is_some_and(|t| self.now < t);
                    if cut || self.rng.unit() < self.link.loss {
                        self.dropped += 1;
                        continue;
                    }
                    let t = metaroce_proto::Transmit {
                        size: bytes.len(),
                        ..t
                    };
                    let copies = if self.rng.unit() < self.link.duplicate {
                        self.duplicated += 1;
                        2
                    } else {
                        1
                    };
                    let dir = usize::from(!to_b);
                    let mut depart = self.now.as_nanos();
                    if let Some(ns) = (t.size as u64 * 1000).checked_div(self.link.bytes_per_us) {
                        depart = depart.max(self.wire_free[dir]) + ns;
                        self.wire_free[dir] = depart;
                    }
                    for _ in 0..copies {
                        let mut at = depart + self.link.delay.as_nanos() as u64;
                        if let Some((slow, extra)) = self.gray {
                            if to_b && slow(t.src_port) {
                                at += extra.as_nanos() as u64;
                            }
                        }
                        if self.rng.unit() < self.link.reorder {
                            at += self
                                .rng
                                .below(self.link.reorder_delay.as_nanos() as u64 + 1);
                        }
                        let mut ecn = t.ecn.bits();
                        if t.ecn != Ecn::NotEct && self.rng.unit() < self.link.ce {
                            ecn = Ecn::Ce.bits();
                        }
                        self.seq += 1;
                        self.queue.push(Reverse(InFlight {
                            at,
                            seq: self.seq,
                            to_b,
                            from,
                            ecn,
                            bytes: bytes.clone(),
                        }));
                    }
                }
            }
        }
    }

    fn drain_events(&mut self) {
        while let Some(e) = self.a.poll_event() {
            self.events_a.push(e);
        }
        while let Some(e) = self.b.poll_event() {
            if let Event::Incoming { conn, .. } = e {
                self.conn_b = Some(conn);
            }
            self.events_b.push(e);
        }
    }

    /// Advances to the next datagram arrival or timer; false if nothing is left to do.
    pub fn step(&mut self) -> bool {
        self.flush();
        self.drain_events();
        let next_dg = self.queue.peek().map(|r| r.0.at);
        let next_timer = [self.a.poll_timeout(), self.b.poll_timeout()]
            .into_iter()
            .flatten()
            .map(|t| t.as_nanos())
            .min();
        let next = match (next_dg, next_timer) {
            (None, None) => return false,
            (Some(a), None) | (None, Some(a)) => a,
            (Some(a), Some(b)) => a.min(b),
        };
        self.now = Instant::from_nanos(next.max(self.now.as_nanos()));
        while self
            .queue
            .peek()
            .is_some_and(|r| r.0.at <= self.now.as_nanos())
        {
            let Reverse(d) = self.queue.pop().unwrap();
            self.delivered += 1;
            let ecn = Ecn::from_bits(d.ecn);
            if d.to_b {
                self.b.handle_datagram(self.now, d.from, ecn, &d.bytes);
            } else {
                self.a.handle_datagram(self.now, d.from, ecn, &d.bytes);
            }
        }
        if self.a.poll_timeout().is_some_and(|t| t <= self.now) {
            self.a.handle_timeout(self.now);
        }
        if self.b.poll_timeout().is_some_and(|t| t <= self.now) {
            self.b.handle_timeout(self.now);
        }
        self.flush();
        self.drain_events();
        true
    }

    /// Steps until `done` holds or `deadline` passes; returns whether `done` held.
    pub fn run_until(
        &mut self,
        deadline: Instant,
        mut done: impl FnMut(&mut Pair) -> bool,
    ) -> bool {
        loop {
            if done(self) {
                return true;
            }
            if self.now > deadline || !self.step() {
                return done(self);
            }
        }
    }

    /// Runs for `d` of simulated time.
    pub fn run_for(&mut self, d: Duration) {
        let end = self.now + d;
        self.run_until(end, |p| p.now >= end);
    }
}

/// A QP pair with regions on both sides, ready to use.
pub struct Verbs {
    pub qa: Qpn,
    pub qb: Qpn,
    pub cqa: CqHandle,
    pub cqb: CqHandle,
    pub pda: PdHandle,
    pub pdb: PdHandle,
}

impl Verbs {
    pub fn setup(p: &mut Pair) -> Verbs {
        let pda = p.a.alloc_pd();
        let pdb = p.b.alloc_pd();
        let cqa = p.a.create_cq(4096);
        let cqb = p.b.create_cq(4096);
        let qa = p.a.create_qp(QpInit::new(pda, cqa, cqa)).unwrap();
        let qb = p.b.create_qp(QpInit::new(pdb, cqb, cqb)).unwrap();
        p.a.connect_qp(qa, p.conn_a.unwrap(), qb).unwrap();
        p.b.connect_qp(qb, p.conn_b.unwrap(), qa).unwrap();
        Verbs {
            qa,
            qb,
            cqa,
            cqb,
            pda,
            pdb,
        }
    }
}

/// Deterministic payload bytes for message `tag`.
pub fn pattern(tag: u64, len: usize) -> Vec<u8> {
    let mut r = TestRng::new(tag.wrapping_add(77));
    (0..len).map(|_| r.next_u64() as u8).collect()
}

/// Polls every completion of `cq`.
pub fn drain_cq(ep: &mut Endpoint, cq: CqHandle) -> Vec<WorkCompletion> {
    let mut v = Vec::new();
    ep.poll_cq(cq, usize::MAX, &mut v).unwrap();
    v
}

/// Opens a connection from `a` (at `a_addr`) to `b` (at `b_addr`) at `now`,
/// every datagram delivered at once, for tests that move the datagrams
/// themselves; returns `a`'s handle and `b`'s.
pub fn handshake(
    a: &mut Endpoint,
    b: &mut Endpoint,
    a_addr: SocketAddr,
    b_addr: SocketAddr,
    now: Instant,
) -> (ConnectionHandle, ConnectionHandle) {
    let ca = a.connect(now, b_addr).unwrap();
    let mut buf = vec![0u8; 65_536];
    let mut cb = None;
    for _ in 0..10 {
        while let Some(t) = a.poll_transmit(now, &mut buf) {
            b.handle_datagram(now, a_addr, t.ecn, &buf[..t.size]);
        }
        while let Some(t) = b.poll_transmit(now, &mut buf) {
            a.handle_datagram(now, b_addr, t.ecn, &buf[..t.size]);
        }
        while let Some(e) = b.poll_event() {
            if let Event::Incoming { conn, .. } = e {
                cb = Some(conn);
            }
        }
    }
    (ca, cb.expect("handshake"))
}

/// Registers `data` as a region of `a` (in `pa`) and a zeroed region as
/// long on `b` (in `pb`) that the peer may write: what a WRITE moves.
pub fn write_regions(
    a: &mut Endpoint,
    pa: PdHandle,
    b: &mut Endpoint,
    pb: PdHandle,
    data: &[u8],
) -> (MrInfo, MrInfo) {
    let src = a
        .reg_mr(pa, data.to_vec().into_boxed_slice(), 0, AccessFlags::NONE)
        .unwrap();
    let dst = b
        .reg_mr(
            pb,
            vec![0u8; data.len()].into_boxed_slice(),
            0,
            AccessFlags::REMOTE_WRITE,
        )
        .unwrap();
    (src, dst)
}

/// A WRITE (`wr_id`) of the `len` bytes at offset `at` of region `src` to
/// the same offset of region `dst`.
pub fn write_wr(wr_id: u64, src: &MrInfo, dst: &MrInfo, at: u64, len: u32) -> SendWr {
    SendWr::new(
        wr_id,
        SendOp::Write(RemoteAddr {
            rkey: dst.rkey,
            addr: at,
        }),
        Sge {
            lkey: src.lkey,
            addr: at,
            len,
        },
    )
}

/// Two endpoints (4 paths, GSO batches of 15) joined by a connection, with
/// one WRITE of `data` from `a` into a zeroed region of `b` posted: the
/// set-up of the hand-driven tests that move the datagrams themselves.
pub struct OneWrite {
    pub a: Endpoint,
    pub b: Endpoint,
    pub a_addr: SocketAddr,
    pub b_addr: SocketAddr,
    pub ca: ConnectionHandle,
    pub cb: ConnectionHandle,
    /// `a`'s completion queue, where the WRITE completes.
    pub cqa: CqHandle,
    /// `b`'s region, where the data goes.
    pub dst: MrInfo,
    pub data: Vec<u8>,
    pub now: Instant,
}

impl OneWrite {
    /// Sets up with the endpoints' seeds `seeds` and posts the WRITE.
    pub fn new(data: Vec<u8>, seeds: (u64, u64)) -> Self {
        let (a_addr, b_addr): (SocketAddr, SocketAddr) = (
            "10.0.0.1:4791".parse().unwrap(),
            "10.0.0.2:4791".parse().unwrap(),
        );
        let cfg = EndpointConfig {
            paths: 4,
            max_gso_segments: 15,
            ..EndpointConfig::default()
        };
        let mut a = Endpoint::new(cfg.clone(), seeds.0).unwrap();
        let mut b = Endpoint::new(cfg, seeds.1).unwrap();
        let (pa, pb) = (a.alloc_pd(), b.alloc_pd());
        let (cqa, cqb) = (a.create_cq(64), b.create_cq(64));
        let len = data.len();
        let (src, dst) = write_regions(&mut a, pa, &mut b, pb, &data);
        let qa = a.create_qp(QpInit::new(pa, cqa, cqa)).unwrap();
        let qb = b.create_qp(QpInit::new(pb, cqb, cqb)).unwrap();
        let now = Instant::from_nanos(1_000_000);
        let (ca, cb) = handshake(&mut a, &mut b, a_addr, b_addr, now);
        a.connect_qp(qa, ca, qb).unwrap();
        b.connect_qp(qb, cb, qa).unwrap();
        a.post_send(now, qa, write_wr(1, &src, &dst, 0, len as u32))
            .unwrap();
        OneWrite {
            a,
            b,
            a_addr,
            b_addr,
            ca,
            cb,
            cqa,
            dst,
            data,
            now,
        }
    }

    /// Runs both endpoints' timers that are due at `self.now`.
    pub fn run_timers(&mut self) {
        let now = self.now;
        for ep in [&mut self.a, &mut self.b] {
            if ep.poll_timeout().is_some_and(|t| t <= now) {
                ep.handle_timeout(now);
            }
        }
    }

    /// Checks that the WRITE completed successfully in `wcs` and that every
    /// byte arrived.
    pub fn check_done(&self, wcs: &[WorkCompletion]) {
        assert_eq!(wcs.len(), 1, "the WRITE completed");
        assert_eq!(wcs[0].status, WcStatus::Success);
        assert!(
            self.b.mr(self.dst.lkey).unwrap() == &self.data[..],
            "every byte arrived"
        );
    }
}

/// Runs the pair until `n` completions arrived on `cq` of side A (`side_a`)
/// or B, or `within` passed; returns what arrived.
pub fn wait_cq(
    p: &mut Pair,
    side_a: bool,
    cq: CqHandle,
    n: usize,
    within: Duration,
) -> Vec<WorkCompletion> {
    let deadline = p.now + within;
    let mut got = Vec::new();
    p.run_until(deadline, |p| {
        let ep = if side_a { &mut p.a } else { &mut p.b };
        got.extend(drain_cq(ep, cq));
        got.len() >= n
    });
    got
}

/// Registers `data` as a region at `addr` of `pd`.
pub fn reg(
    ep: &mut metaroce_proto::Endpoint,
    pd: PdHandle,
    data: Vec<u8>,
    addr: u64,
    access: AccessFlags,
) -> MrInfo {
    ep.reg_mr(pd, data.into_boxed_slice(), addr, access)
        .unwrap()
}

/// Posts on `qp` of `ep` a receive (`wr_id`) of `len` bytes at `addr` of
/// region `mr`.
pub fn post_recv_into(
    ep: &mut metaroce_proto::Endpoint,
    qp: Qpn,
    wr_id: u64,
    mr: &MrInfo,
    addr: u64,
    len: u32,
) {
    let sge = Sge {
        lkey: mr.lkey,
        addr,
        len,
    };
    ep.post_recv(
        qp,
        RecvWr {
            wr_id,
            sge: sge.into(),
        },
    )
    .unwrap();
}
