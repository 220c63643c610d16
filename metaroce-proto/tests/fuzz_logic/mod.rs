//! The logic of the fuzz targets, shared by `fuzz/fuzz_targets/*.rs` (which
//! include this file with `#[path]`) and by `tests/fuzz_targets.rs` (which
//! runs it on seeded random and mutated inputs in the normal test suite).
//!
//! - [`decode_packet`]: every decoder and accessor on arbitrary bytes.
//! - [`endpoint_datagram`]: a connected pair with QPs, regions and requests
//!   in flight; the input is a little program of datagrams (raw, or mutations
//!   of valid packets captured from a real exchange) delivered to either
//!   endpoint, from the peer or from a stranger, interleaved with time
//!   steps. Nothing may panic or livelock, and afterwards a real transfer
//!   (WRITE, SEND, READ) must work byte-exact: on the existing connection
//!   when only strangers sent datagrams, and on a fresh connection always.
#![allow(dead_code)]

use metaroce_proto::consts::{ACK_HEADER_LEN, MAX_PATHS};
use metaroce_proto::verbs::*;
use metaroce_proto::wire::{
    self, Accept, AckPacket, Close, CookieReply, DataHeader, Hello, VersionNegotiation,
};
use metaroce_proto::{ConnectionState, Ecn, Endpoint, EndpointConfig, Event, Instant};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

// ---------------------------------------------------------------------------
// decode_packet
// ---------------------------------------------------------------------------

/// Runs every decoder on `buf`, walks every accessor, and checks that what
/// decodes is self-consistent. Must never panic on any input.
pub fn decode_packet(buf: &[u8]) {
    let _ = wire::peek_type(buf);
    let _ = wire::peek_common(buf);
    if let Ok((h, payload)) = DataHeader::parse(buf) {
        assert_eq!(h.ext.opcode(), h.opcode);
        assert_eq!(h.header_len() + payload.len(), buf.len());
        let mut out = vec![0u8; buf.len()];
        let n = h
            .emit(&mut out, payload)
            .expect("a decoded header re-encodes");
        assert_eq!(n, buf.len());
        // Bytes 14..16 are reserved (sent 0, ignored).
        assert_eq!(&out[..14], &buf[..14]);
        assert_eq!(&out[16..], &buf[16..]);
    }
    for known in [false, true] {
        if let Ok(a) = AckPacket::parse(buf, |_| known) {
            let _ = a.header();
            assert!(a.paths().all(|p| usize::from(p.path_id) < MAX_PATHS));
            let _ = a.streams().count();
            let _ = a.naks().count();
            let opts: usize = a.options().map(|o| 2 + o.value.len()).sum();
            assert!(opts <= buf.len() - ACK_HEADER_LEN);
        }
    }
    if Hello::parse(buf).is_ok() {
        plane_trailer(&buf[metaroce_proto::consts::HELLO_LEN..]);
    }
    let _ = CookieReply::parse(buf);
    if Accept::parse(buf).is_ok() {
        plane_trailer(&buf[Accept::LEN..]);
    }
    plane_trailer(buf);
    let _ = Close::parse(buf);
    let _ = VersionNegotiation::parse(buf);
}

/// The plane-address extension: a decoded list re-encodes to the bytes it
/// came from.
fn plane_trailer(t: &[u8]) {
    if let Ok(p) = metaroce_proto::wire::PlaneAddrs::parse(t) {
        assert!(p.as_slice().len() < metaroce_proto::consts::MAX_PLANES);
        let mut out = vec![0u8; p.encoded_len()];
        let n = p.emit(&mut out).expect("a decoded list re-encodes");
        assert_eq!(&out[..n], &t[..n]);
    }
}

// ---------------------------------------------------------------------------
// A tiny deterministic network: zero-latency, lossless, with capture.
// ---------------------------------------------------------------------------

/// xorshift64*, deterministic.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next_u64() as u8).collect()
    }
}

pub fn pattern(tag: u64, len: usize) -> Vec<u8> {
    Rng::new(tag.wrapping_add(0x51)).bytes(len)
}

const A_IP: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1));
const B_IP: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 2));
const STRANGER_IP: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 9, 9, 9));
const PORT: u16 = 4792;
/// Iterations of the network loop any one `run_until` may take.
const STEP_CAP: u32 = 200_000;

/// A captured datagram: the bytes and whether it went to B.
#[derive(Debug, Clone)]
pub struct Captured {
    pub to_b: bool,
    pub from_port: u16,
    pub bytes: Vec<u8>,
}

pub struct Net {
    pub a: Endpoint,
    pub b: Endpoint,
    pub now: Instant,
    buf: Vec<u8>,
    pub capture: Option<Vec<Captured>>,
    /// Drop everything A sends (to keep requests in flight).
    pub mute_a: bool,
    pub incoming_b: Vec<ConnectionHandle>,
    pub connected_a: Vec<ConnectionHandle>,
    /// Timer steps and datagrams moved so far (for diagnosing slow inputs).
    pub steps: u64,
    pub datagrams: u64,
}

impl Net {
    pub fn new(seed: u64) -> Net {
        let cfg = EndpointConfig {
            // Small timers so that the fuzz's time steps reach them.
            handshake_rto: Duration::from_millis(1),
            // As the drivers set it: ACKs carry a receive window.
            receive_buffer: Some(1 << 20),
            ..EndpointConfig::default()
        };
        Net {
            a: Endpoint::new(cfg.clone(), seed ^ 0xa).unwrap(),
            b: Endpoint::new(cfg, seed ^ 0xb).unwrap(),
            now: Instant::ZERO,
            buf: vec![0u8; 65536],
            capture: None,
            mute_a: false,
            incoming_b: Vec::new(),
            connected_a: Vec::new(),
            steps: 0,
            datagrams: 0,
        }
    }

    pub fn addr(b: bool) -> SocketAddr {
        SocketAddr::new(if b { B_IP } else { A_IP }, PORT)
    }

    /// Moves every pending datagram (zero latency); returns whether any moved.
    fn flush(&mut self) -> bool {
        let mut moved = false;
        for _ in 0..10_000 {
            let mut any = false;
            for from_a in [true, false] {
                loop {
                    let (src, src_ip) = if from_a {
                        (&mut self.a, A_IP)
                    } else {
                        (&mut self.b, B_IP)
                    };
                    let Some(t) = src.poll_transmit(self.now, &mut self.buf) else {
                        break;
                    };
                    assert!(t.size <= self.buf.len());
                    any = true;
                    self.datagrams += 1;
                    if from_a && self.mute_a {
                        continue;
                    }
                    let dst_b = t.dst.ip() == B_IP;
                    if !dst_b && t.dst.ip() != A_IP {
                        continue; // to a stranger
                    }
                    let bytes = &self.buf[..t.size];
                    if let Some(c) = self.capture.as_mut() {
                        c.push(Captured {
                            to_b: dst_b,
                            from_port: t.src_port,
                            bytes: bytes.to_vec(),
                        });
                    }
                    let from = SocketAddr::new(src_ip, t.src_port);
                    let dst = if dst_b { &mut self.b } else { &mut self.a };
                    dst.handle_datagram(self.now, from, t.ecn, bytes);
                }
            }
            self.drain_events();
            if !any {
                return moved;
            }
            moved = true;
        }
        panic!("livelock: the endpoints keep producing datagrams at one instant");
    }

    fn drain_events(&mut self) {
        while let Some(e) = self.a.poll_event() {
            if let Event::Connected(c) = e {
                self.connected_a.push(c);
            }
        }
        while let Some(e) = self.b.poll_event() {
            if let Event::Incoming { conn, .. } = e {
                self.incoming_b.push(conn);
            }
        }
    }

    /// Delivers one datagram to A or B.
    pub fn inject(&mut self, to_b: bool, from: SocketAddr, ecn: Ecn, bytes: &[u8]) {
        let ep = if to_b { &mut self.b } else { &mut self.a };
        ep.handle_datagram(self.now, from, ecn, bytes);
        // Whatever it provokes is delivered too.
        self.flush();
    }

    /// Runs timers and traffic for `d` of simulated time.
    pub fn run_for(&mut self, d: Duration) {
        let end = self.now + d;
        self.run_until(end, |_| false);
    }

    /// Runs until `done` or `deadline`; returns whether `done` held.
    pub fn run_until(&mut self, deadline: Instant, mut done: impl FnMut(&mut Net) -> bool) -> bool {
        for _ in 0..STEP_CAP {
            self.flush();
            if done(self) {
                return true;
            }
            let next = [self.a.poll_timeout(), self.b.poll_timeout()]
                .into_iter()
                .flatten()
                .min();
            match next {
                Some(t) if t <= deadline => {
                    self.steps += 1;
                    self.now = self.now.max(t);
                    for ep in [&mut self.a, &mut self.b] {
                        if ep.poll_timeout().is_some_and(|t| t <= self.now) {
                            ep.handle_timeout(self.now);
                        }
                    }
                }
                _ => {
                    self.now = self.now.max(deadline);
                    self.flush();
                    return done(self);
                }
            }
        }
        panic!(
            "livelock: {STEP_CAP} timer steps before {deadline:?} (now {:?})",
            self.now
        );
    }

    /// Opens a connection A→B; returns both handles.
    pub fn connect(&mut self) -> (ConnectionHandle, ConnectionHandle) {
        let before = self.incoming_b.len();
        let ca = self.a.connect(self.now, Self::addr(true)).unwrap();
        let deadline = self.now + Duration::from_secs(1);
        let ok = self.run_until(deadline, |n| {
            n.connected_a.contains(&ca) && n.incoming_b.len() > before
        });
        assert!(ok, "handshake did not finish");
        (ca, *self.incoming_b.last().unwrap())
    }
}

/// One side's verbs objects.
pub struct Side {
    pub pd: PdHandle,
    pub cq: CqHandle,
}

/// Runs a WRITE, a SEND and a READ from A to B on a fresh QP pair bound to
/// (`ca`, `cb`) and checks every byte and completion.
pub fn transfer_works(net: &mut Net, ca: ConnectionHandle, cb: ConnectionHandle, tag: u64) {
    let (pa, pb) = (net.a.alloc_pd(), net.b.alloc_pd());
    let (cqa, cqb) = (net.a.create_cq(64), net.b.create_cq(64));
    let qa = net.a.create_qp(QpInit::new(pa, cqa, cqa)).unwrap();
    let qb = net.b.create_qp(QpInit::new(pb, cqb, cqb)).unwrap();
    net.a.connect_qp(qa, ca, qb).unwrap();
    net.b.connect_qp(qb, cb, qa).unwrap();
    let wlen = 20_000usize;
    let slen = 5_000usize;
    let rlen = 9_000usize;
    let src = pattern(tag, wlen + slen);
    let rsrc = pattern(tag ^ 0xff, rlen);
    let src_mr = net
        .a
        .reg_mr(pa, src.clone().into_boxed_slice(), 0, AccessFlags::NONE)
        .unwrap();
    let rdst = net
        .a
        .reg_mr(
            pa,
            vec![0u8; rlen].into_boxed_slice(),
            0,
            AccessFlags::LOCAL_WRITE,
        )
        .unwrap();
    let mut win_init = vec![0u8; wlen + rlen];
    win_init[wlen..].copy_from_slice(&rsrc);
    let win = net
        .b
        .reg_mr(
            pb,
            win_init.into_boxed_slice(),
            0x7000_0000,
            AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
        )
        .unwrap();
    let rbuf = net
        .b
        .reg_mr(
            pb,
            vec![0u8; slen].into_boxed_slice(),
            0,
            AccessFlags::LOCAL_WRITE,
        )
        .unwrap();
    net.b
        .post_recv(
            qb,
            RecvWr {
                wr_id: 100,
                sge: Sge {
                    lkey: rbuf.lkey,
                    addr: 0,
                    len: slen as u32,
                }
                .into(),
            },
        )
        .unwrap();
    let now = net.now;
    let wrs = [
        SendWr::new(
            1,
            SendOp::Write(RemoteAddr {
                rkey: win.rkey,
                addr: win.addr,
            }),
            Sge {
                lkey: src_mr.lkey,
                addr: 0,
                len: wlen as u32,
            },
        ),
        SendWr::new(
            2,
            SendOp::Send,
            Sge {
                lkey: src_mr.lkey,
                addr: wlen as u64,
                len: slen as u32,
            },
        ),
        SendWr::new(
            3,
            SendOp::Read(RemoteAddr {
                rkey: win.rkey,
                addr: win.addr + wlen as u64,
            }),
            Sge {
                lkey: rdst.lkey,
                addr: 0,
                len: rlen as u32,
            },
        ),
    ];
    for wr in wrs {
        net.a.post_send(now, qa, wr).unwrap();
    }
    let mut wa = Vec::new();
    let mut wb = Vec::new();
    let deadline = net.now + Duration::from_secs(5);
    net.run_until(deadline, |n| {
        n.a.poll_cq(cqa, 16, &mut wa).unwrap();
        n.b.poll_cq(cqb, 16, &mut wb).unwrap();
        wa.len() >= 3 && !wb.is_empty()
    });
    let got: Vec<(u64, WcStatus)> = wa.iter().map(|w| (w.wr_id, w.status)).collect();
    assert_eq!(
        got,
        vec![
            (1, WcStatus::Success),
            (2, WcStatus::Success),
            (3, WcStatus::Success)
        ],
        "transfer after fuzzing"
    );
    assert_eq!(wb.len(), 1);
    assert_eq!(
        (wb[0].wr_id, wb[0].status, wb[0].byte_len),
        (100, WcStatus::Success, slen as u32)
    );
    assert!(net.a.mr(rdst.lkey).unwrap() == &rsrc[..], "READ bytes");
    let w = net.b.mr(win.lkey).unwrap();
    assert!(w[..wlen] == src[..wlen], "WRITE bytes");
    assert!(w[wlen..] == rsrc[..], "READ source changed");
    assert!(net.b.mr(rbuf.lkey).unwrap() == &src[wlen..], "SEND bytes");
}

/// The fixture of `endpoint_datagram`: a connected pair, QPs, regions,
/// posted receives, requests in flight, and the packets of a real exchange.
pub struct Fixture {
    pub net: Net,
    pub conn: (ConnectionHandle, ConnectionHandle),
    pub corpus: Vec<Captured>,
}

impl Fixture {
    pub fn new() -> Fixture {
        let mut net = Net::new(0x00f0_22ed);
        net.capture = Some(Vec::new());
        let (ca, cb) = net.connect();
        // Two QP pairs, every kind of request so that every opcode is captured.
        let (pa, pb) = (net.a.alloc_pd(), net.b.alloc_pd());
        let (cqa, cqb) = (net.a.create_cq(4096), net.b.create_cq(4096));
        let src = net
            .a
            .reg_mr(
                pa,
                pattern(1, 16384).into_boxed_slice(),
                0x1000,
                AccessFlags::LOCAL_WRITE,
            )
            .unwrap();
        let win = net
            .b
            .reg_mr(
                pb,
                pattern(2, 16384).into_boxed_slice(),
                0x10_0000,
                AccessFlags::ALL,
            )
            .unwrap();
        let rbuf = net
            .b
            .reg_mr(
                pb,
                vec![0u8; 16384].into_boxed_slice(),
                0x20_0000,
                AccessFlags::LOCAL_WRITE,
            )
            .unwrap();
        let remote = RemoteAddr {
            rkey: win.rkey,
            addr: win.addr,
        };
        let sge = |len: u32| Sge {
            lkey: src.lkey,
            addr: src.addr,
            len,
        };
        for _ in 0..2 {
            let qa = net.a.create_qp(QpInit::new(pa, cqa, cqa)).unwrap();
            let qb = net.b.create_qp(QpInit::new(pb, cqb, cqb)).unwrap();
            net.a.connect_qp(qa, ca, qb).unwrap();
            net.b.connect_qp(qb, cb, qa).unwrap();
            for k in 0..16u32 {
                net.b
                    .post_recv(
                        qb,
                        RecvWr {
                            wr_id: u64::from(k),
                            sge: Sge {
                                lkey: rbuf.lkey,
                                addr: rbuf.addr + u64::from(k) * 1024,
                                len: 1024,
                            }
                            .into(),
                        },
                    )
                    .unwrap();
            }
            let now = net.now;
            for (i, op) in [
                SendOp::Send,
                SendOp::SendImm(5),
                SendOp::Write(remote),
                SendOp::WriteImm(remote, 6),
                SendOp::Read(remote),
            ]
            .into_iter()
            .enumerate()
            {
                let len = if matches!(op, SendOp::Write(_) | SendOp::Read(_)) {
                    6000
                } else {
                    700
                };
                net.a
                    .post_send(now, qa, SendWr::new(i as u64, op, sge(len)))
                    .unwrap();
            }
            let deadline = net.now + Duration::from_millis(50);
            let mut n = 0;
            net.run_until(deadline, |net| {
                n += net.a.cq_len(cqa).unwrap();
                let mut v = Vec::new();
                net.a.poll_cq(cqa, 64, &mut v).unwrap();
                n >= 5
            });
            assert!(n >= 5, "fixture transfer did not finish");
            // A request and its answer, twice: B's answers carry its ACKs
            // of the requests (coalesced datagrams, PROTOCOL §6.7).
            for round in 0..2u64 {
                let ask = Sge {
                    lkey: src.lkey,
                    addr: src.addr + 8192,
                    len: 64,
                };
                net.a
                    .post_recv(
                        qa,
                        RecvWr {
                            wr_id: 90 + round,
                            sge: ask.into(),
                        },
                    )
                    .unwrap();
                let now = net.now;
                net.a
                    .post_send(now, qa, SendWr::new(60 + round, SendOp::Send, sge(64)))
                    .unwrap();
                let deadline = net.now + Duration::from_millis(50);
                let asked = net.run_until(deadline, |net| {
                    let mut v = Vec::new();
                    net.b.poll_cq(cqb, 64, &mut v).unwrap();
                    v.iter()
                        .any(|w| w.opcode == WcOpcode::Recv && w.byte_len == 64)
                });
                assert!(asked, "fixture request did not arrive");
                let answer = Sge {
                    lkey: rbuf.lkey,
                    addr: rbuf.addr,
                    len: 64,
                };
                let now = net.now;
                net.b
                    .post_send(now, qb, SendWr::new(70 + round, SendOp::Send, answer))
                    .unwrap();
                let answered = net.run_until(deadline, |net| {
                    let mut v = Vec::new();
                    net.a.poll_cq(cqa, 64, &mut v).unwrap();
                    v.iter().any(|w| w.opcode == WcOpcode::Recv)
                });
                assert!(answered, "fixture answer did not arrive");
            }
            // Leave a WRITE in flight whose packets are lost (A keeps state
            // to retransmit), and a SEND that will be retried.
            net.mute_a = true;
            let now = net.now;
            net.a
                .post_send(now, qa, SendWr::new(50, SendOp::Write(remote), sge(9000)))
                .unwrap();
            net.a
                .post_send(now, qa, SendWr::new(51, SendOp::Send, sge(300)))
                .unwrap();
            net.flush();
            net.mute_a = false;
        }
        // Handshake packets of a second connection attempt (HELLO, COOKIE,
        // ACCEPT), and a CLOSE, for the corpus.
        let mut corpus = net.capture.take().unwrap();
        let mut n2 = Net::new(0x005e_c00d);
        n2.capture = Some(Vec::new());
        let (c2a, _) = n2.connect();
        n2.a.close(n2.now, c2a).unwrap();
        n2.flush();
        corpus.extend(n2.capture.take().unwrap());
        Fixture {
            net,
            conn: (ca, cb),
            corpus,
        }
    }
}

impl Default for Fixture {
    fn default() -> Self {
        Self::new()
    }
}

/// Reads the fuzz input a byte at a time (zeros past the end).
struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn u8(&mut self) -> u8 {
        match self.0.split_first() {
            Some((&b, rest)) => {
                self.0 = rest;
                b
            }
            None => 0,
        }
    }
    fn u16(&mut self) -> u16 {
        u16::from_be_bytes([self.u8(), self.u8()])
    }
    fn take(&mut self, n: usize) -> &[u8] {
        let n = n.min(self.0.len());
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        a
    }
    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// The fuzz target: see the module documentation for the input format.
///
/// Each command starts with a byte `c`:
/// - bit 0..=2 (`c & 7`): 0 = time step of `u8 × 20 µs`; 1 = raw datagram of
///   `u16 % 2048` bytes; 2..=7 = a captured packet (`u8` index among the
///   packets that went to the target), then `u8 % 8` edits
///   (`u16` position, `u8` value, `u8` kind: set / xor / truncate / extend);
/// - bit 3: deliver to B (else A); bit 4: from a stranger's IP (else from
///   the peer's IP); bits 5..=6: ECN codepoint; bit 7: from a random port.
pub fn endpoint_datagram(data: &[u8]) {
    let mut fx = Fixture::new();
    run_program(&mut fx, data);
}

pub fn run_program(fx: &mut Fixture, data: &[u8]) {
    let mut input = Input(data);
    let mut from_peer = false;
    let mut n_cmds = 0;
    while !input.is_empty() && n_cmds < 512 {
        n_cmds += 1;
        let c = input.u8();
        let to_b = c & 0x08 != 0;
        let stranger = c & 0x10 != 0;
        let ecn = Ecn::from_bits(c >> 5);
        let port = if c & 0x80 != 0 {
            input.u16().max(1)
        } else {
            PORT
        };
        let ip = if stranger {
            STRANGER_IP
        } else if to_b {
            A_IP
        } else {
            B_IP
        };
        let from = SocketAddr::new(ip, port);
        let bytes: Vec<u8> = match c & 7 {
            0 => {
                let d = Duration::from_micros(u64::from(input.u8()) * 20);
                fx.net.run_for(d);
                continue;
            }
            1 => {
                let n = usize::from(input.u16()) % 2048;
                input.take(n).to_vec()
            }
            _ => {
                let pool: Vec<&Captured> = fx.corpus.iter().filter(|p| p.to_b == to_b).collect();
                if pool.is_empty() {
                    continue;
                }
                let mut b = pool[usize::from(input.u8()) % pool.len()].bytes.clone();
                for _ in 0..input.u8() % 8 {
                    let pos = usize::from(input.u16());
                    let val = input.u8();
                    let kind = input.u8();
                    let n = b.len();
                    match kind % 8 {
                        0..=3 if n > 0 => b[pos % n] = val,
                        4 | 5 if n > 0 => b[pos % n] ^= val,
                        6 => b.truncate(pos % (n + 1)),
                        7 => b.extend(std::iter::repeat_n(val, pos % 64 + 1)),
                        _ => {}
                    }
                }
                b
            }
        };
        if !stranger {
            from_peer = true;
        }
        decode_packet(&bytes);
        fx.net.inject(to_b, from, ecn, &bytes);
    }
    // Let the dust settle: retransmissions, ACKs, timers.
    fx.net.run_for(Duration::from_millis(30));

    // A stranger's datagrams must leave the connection fully working.
    let (ca, cb) = fx.conn;
    if !from_peer {
        assert_eq!(
            fx.net.a.connection_state(ca),
            Some(ConnectionState::Established),
            "a stranger's datagram changed A's connection"
        );
        assert_eq!(
            fx.net.b.connection_state(cb),
            Some(ConnectionState::Established),
            "a stranger's datagram changed B's connection"
        );
        transfer_works(&mut fx.net, ca, cb, 11);
    }
    // Whatever arrived, a fresh connection works.
    let (ca2, cb2) = fx.net.connect();
    transfer_works(&mut fx.net, ca2, cb2, 12);
}

/// Valid-looking seed inputs for the fuzzer: one command per captured packet
/// (unmodified and lightly edited), plus a few time steps.
pub fn seed_inputs(fx: &Fixture) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    let mut per_dir = [0usize, 0];
    for p in &fx.corpus {
        let d = usize::from(p.to_b);
        let idx = per_dir[d] as u8;
        per_dir[d] += 1;
        let c = 2 | if p.to_b { 0x08 } else { 0 };
        out.push(vec![c, idx, 0]);
        out.push(vec![c, idx, 1, 0, 20, 0xff, 0, 0, 0x40]);
    }
    out.push(vec![0, 50, 0x0a, 3, 0]);
    out
}
