//! An adversarial peer: the logic of the `adversarial_peer` fuzz target,
//! shared by `fuzz/fuzz_targets/adversarial_peer.rs` (which includes this
//! file with `#[path]`) and by `tests/adversarial_peer.rs` (its plain-test
//! twin, run in the normal suite). Self-contained: it needs nothing else of
//! `fuzz_logic`.
//!
//! Two real endpoints, A (the peer) and B (the *victim*), joined by two
//! connections over a lossless link with a fixed 5 µs delay. Connection 1
//! is attacked; connection 2 is never named by a forged packet. Both carry
//! a QP pair; B has, beside the regions the peer may use, regions it must
//! never see changed: one without any remote access, one with REMOTE_READ
//! only (both in connection 1's PD), and one with every access in
//! connection 2's PD. The adversary knows every key, connection id and QP
//! number, and watches the wire (it sees the PSNs, CSNs, MSNs and the
//! windows both ends report), so its forgeries can land anywhere relative
//! to the real state: exactly at it, behind, ahead, at a window's edge,
//! half the sequence space away, or anywhere.
//!
//! The input is a sequence of [`Action`]s ([`decode`] reads any bytes as
//! one; [`encode`] writes one back): forged DATA, ACK, CLOSE and coalesced
//! ACK+DATA packets to B, from A's address, for connection 1; replays of
//! real datagrams with a byte changed; bursts repeating the last forgery
//! with its sequence numbers bumped; legitimate requests posted by either
//! side; datagrams of the real peer dropped; simulated time passing.
//!
//! After every action both endpoints' transmits are polled until `None`
//! and their due timers run; then the invariants are checked (see
//! [`World::check`]):
//!
//! - nothing panics (in debug builds and in the fuzz profile, an
//!   arithmetic overflow in the core is a panic too), nothing livelocks;
//! - B emits at most [`MAX_VICTIM_DATAGRAMS_PER_ACTION`] datagrams per
//!   action, and handling one action takes at most [`MAX_STEPS_PER_ACTION`]
//!   network or timer steps;
//! - every connection's state stays within its bounds: bytes in flight at
//!   most the span rule allows ([`IN_FLIGHT_BOUND`]), windows and RTO
//!   within the configured limits, at most the configured paths, RTT
//!   estimates below a second, no more connections than were opened;
//! - the heap of the thread (when the caller can measure it, as the test
//!   does) grows by at most [`MAX_HEAP_GROWTH`] over the set-up, however
//!   long the sequence;
//! - the regions the peer may not write never change;
//! - every work request completes at most once and in post order per
//!   queue, with a receive's `byte_len` within its buffer;
//! - connection 2 is never lost and no QP of it fails.
//!
//! At the end, after the dust settles: every request posted on connection
//! 1 has completed (with whatever status: the attacker may fail them, it
//! must not hang them) within [`SETTLE`] of simulated time; with no work
//! left, each endpoint sends at most [`MAX_IDLE_DATAGRAMS`] datagrams a
//! second; the protected regions are still intact; and a WRITE, a READ and
//! a SEND on connection 2 work byte-exact.
//!
//! Core bugs it found are reproduced, each by a test of its own, in
//! `tests/adversarial_peer.rs` (findings 1 to 4, all fixed); the driver
//! tolerates none of them.
#![allow(dead_code)]

use metaroce_proto::consts::{
    ACK_OPT_RECV_WINDOW, CSN_WINDOW, DATA_HEADER_LEN, MAX_PATHS, MSG_WINDOW, SACK_BITS, SACK_BYTES,
};
use metaroce_proto::verbs::*;
use metaroce_proto::wire::seq::{seq_dist, seq_lt};
use metaroce_proto::wire::{
    Accept, AckBuilder, AckHeader, AckPacket, AckPathEntry, AckStreamEntry, DataHeader, NakCode,
    NakEntry, Opcode, OpcodeExt, PacketType,
};
use metaroce_proto::{
    ConnectionState, ConnectionStats, Ecn, Endpoint, EndpointConfig, Event, Instant,
};
use std::collections::VecDeque;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

// ---------------------------------------------------------------------------
// Bounds (the invariants' constants)
// ---------------------------------------------------------------------------

/// Paths of each endpoint.
pub const PATHS: u8 = 4;
/// The connection MTU (the default).
pub const MTU: usize = metaroce_proto::consts::DEFAULT_MTU as usize;
/// Actions read from one input, at most.
pub const MAX_ACTIONS: usize = 256;
/// Copies one [`Action::Repeat`] sends, at most.
pub const MAX_REPEAT: u8 = 64;

/// Bytes in flight of a connection, at most: by the span rule (PROTOCOL
/// §9.1) each path has at most `SACK_BITS` PSNs outstanding, each at most
/// one MTU.
pub const IN_FLIGHT_BOUND: u64 = PATHS as u64 * SACK_BITS as u64 * MTU as u64;

/// Datagrams B may emit while one action is handled. What B can have to
/// send at once is bounded whatever the peer does: every PSN its paths may
/// have outstanding (`PATHS × SACK_BITS` = 1024, each retransmitted once
/// when a forged SACK declares it lost), its own posted work (at most
/// [`MAX_OUTSTANDING`] requests of [`MAX_WR_LEN`] = 32 packets), READ
/// responses (the peer's legitimate READs, 32 packets, and forged ones: at
/// most `max_dest_rd_atomic` = 16 READs of at most a 64 KiB region each,
/// 256 packets), and ACKs, NAKs and probes (far fewer than the DATA
/// packets that cause them: a generous 512). A time step may see each of
/// these go out again on a timeout: the bound is twice their sum. (Over
/// 300,000 random sequences, every action above it was one of finding 3,
/// since fixed.)
pub const MAX_VICTIM_DATAGRAMS_PER_ACTION: u64 = 2 * (1024 + 32 + 32 + 256 + 512);

/// Network deliveries plus timer expiries one action may take (a livelock
/// guard: a healthy action takes a few hundred at most).
pub const MAX_STEPS_PER_ACTION: u64 = 50_000;

/// Growth of the heap over the set-up, at most: the responder's message
/// records (`MSG_WINDOW` per QP), the CSN and SACK bitmaps, the send rings
/// (`SACK_BITS` records per path), queued READ responses, and this
/// harness's own queues of datagrams in flight. All are bounded by
/// constants (PROTOCOL §18), not by the length of the attack. (Seen: under
/// 1 MiB after 7,000 forged packets that open 4,500 message records.)
pub const MAX_HEAP_GROWTH: isize = 8 << 20;

/// Probes (stream probes and path timeout probes, as the connection counts
/// them) in [`STORM_WINDOW`] without a request completing that mark a
/// probe storm (findings 1 and 3 were such storms): a healthy schedule
/// backs off (stream probes and each path's timeouts double from 2 ms):
/// 40 at most, in the first such window.
const PROBE_STORM: u64 = 100;
/// See [`PROBE_STORM`].
const STORM_WINDOW: Duration = Duration::from_millis(500);

/// Datagrams an endpoint may send in a second with nothing to do, starting
/// [`QUIET_AFTER`] after its last request completed.
pub const MAX_IDLE_DATAGRAMS: u64 = 64;
/// See [`MAX_IDLE_DATAGRAMS`].
const QUIET_AFTER: Duration = Duration::from_secs(1);

/// RNR retries of connection 1's QPs: 7 (for ever, the default, as in
/// verbs). One forged ACK used to start an RNR loop that never ended under
/// it (finding 4 of `tests/adversarial_peer.rs`).
pub const RNR_RETRY: u8 = 7;

/// Requests either side keeps outstanding on connection 1, at most.
pub const MAX_OUTSTANDING: usize = 8;
/// Largest legitimate request, bytes.
pub const MAX_WR_LEN: u32 = 16 * 1024;
/// Receives each side keeps posted on connection 1 (reposted as soon as
/// they complete, as an application that polls its CQ would): as many as
/// the other side may have requests outstanding, so that legitimate
/// traffic never meets RNR.
const RECVS: usize = MAX_OUTSTANDING;
/// Size of one receive buffer.
const SLOT: usize = 16 * 1024;
/// Size of the regions the requests use.
const REGION: usize = 64 * 1024;
/// Size of the protected regions.
const SMALL: usize = 16 * 1024;
/// One-way delay of the link.
const LINK_DELAY_NS: u64 = 5_000;
/// Simulated time the end waits, at most, for connection 1's requests to
/// complete (or fail). Long, because the worst legitimate case is: a
/// forged grant of 1 kbit/s paces the victim at one 4 KiB packet per ~33 s
/// until a real ACK replaces it, and when the real peer is gone (its
/// connection failed, its CLOSE lost) none ever does: the victim's
/// `retry_cnt` RTO rounds then take about 4 minutes. (Idle simulated time
/// costs nothing.)
const SETTLE: Duration = Duration::from_secs(600);

const A_IP: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1));
const B_IP: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 2));
const PORT: u16 = 4792;
/// The source port of forged packets (any port of the peer's IP is its).
const FORGED_PORT: u16 = 49_999;

fn addr(b: bool) -> SocketAddr {
    SocketAddr::new(if b { B_IP } else { A_IP }, PORT)
}

fn config() -> EndpointConfig {
    EndpointConfig {
        paths: PATHS,
        handshake_rto: Duration::from_millis(1),
        // As the drivers set them: ACKs carry a receive window, and both
        // sides grant rates, so the victim honours the grants it is sent.
        receive_buffer: Some(1 << 20),
        receiver_capacity_kbps: Some(100_000_000),
        ..EndpointConfig::default()
    }
}

// ---------------------------------------------------------------------------
// Actions and their byte format
// ---------------------------------------------------------------------------

/// A 32-bit sequence number chosen relative to what the adversary saw:
/// `base` is the next number the real sender would use, `edge` the
/// receiver's reported point (its window is `[edge, edge + window)`).
///
/// | `mode % 8` | value |
/// |---|---|
/// | 0 | `base + v % 4`: the expected one, or just past it |
/// | 1 | `base - 1 - v % 512`: behind (old, duplicate) |
/// | 2 | `base + v % (2 window + 2)`: ahead, inside the window or just past |
/// | 3 | `edge + window - 2 + v % 4`: at the window's edge |
/// | 4 | `base + 2^31 - 1 + v % 3`: half the space away |
/// | 5 | `v`: absolute |
/// | 6 | `base + v`: anywhere |
/// | 7 | `edge - window - 2 + v % 4`: a window behind |
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Sel {
    pub mode: u8,
    pub v: u32,
}

impl Sel {
    pub const fn at(d: u32) -> Sel {
        Sel { mode: 0, v: d }
    }
    pub const fn behind(d: u32) -> Sel {
        Sel { mode: 1, v: d }
    }
    pub const fn ahead(d: u32) -> Sel {
        Sel { mode: 2, v: d }
    }
    pub const fn edge(d: u32) -> Sel {
        Sel { mode: 3, v: d }
    }
    pub const fn half(d: u32) -> Sel {
        Sel { mode: 4, v: d }
    }
    pub const fn abs(v: u32) -> Sel {
        Sel { mode: 5, v }
    }
    pub const fn far(d: u32) -> Sel {
        Sel { mode: 6, v: d }
    }
    pub const fn window_behind(d: u32) -> Sel {
        Sel { mode: 7, v: d }
    }

    fn pick(self, base: u32, edge: u32, window: u32) -> u32 {
        let v = self.v;
        match self.mode % 8 {
            0 => base.wrapping_add(v % 4),
            1 => base.wrapping_sub(1 + v % 512),
            2 => base.wrapping_add(v % (2 * window + 2)),
            3 => edge
                .wrapping_add(window)
                .wrapping_sub(2)
                .wrapping_add(v % 4),
            4 => base.wrapping_add(0x7fff_ffff).wrapping_add(v % 3),
            5 => v,
            6 => base.wrapping_add(v),
            _ => edge
                .wrapping_sub(window)
                .wrapping_sub(2)
                .wrapping_add(v % 4),
        }
    }
}

/// One byte of a forged packet changed after it was built (`xor` 0: none).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Patch {
    pub pos: u16,
    pub xor: u8,
}

impl Patch {
    pub const NONE: Patch = Patch { pos: 0, xor: 0 };

    fn apply(self, b: &mut [u8]) {
        if self.xor != 0 && !b.is_empty() {
            let i = usize::from(self.pos) % b.len();
            b[i] ^= self.xor;
        }
    }
}

/// Message length and offset of a forged DATA packet.
///
/// Payload: `payload % (room + 1)` bytes (none for READ_REQ and NOP).
/// Offset (`off_mode % 5`): 0; `(off % 64) × 4096`; `msg_len - payload`
/// (the last packet); `off`; `u32::MAX - off % 4096`. Length (`len_mode %
/// 6`): the payload (a one-packet message); payload + offset; `len % 1 MiB`;
/// `u32::MAX`; `len`; 0. Combinations the decoder refuses (payload past the
/// message) are sent as they are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Span {
    pub len_mode: u8,
    pub len: u32,
    pub off_mode: u8,
    pub off: u32,
    pub payload: u16,
}

impl Span {
    /// A one-packet message of `payload` bytes.
    pub const fn single(payload: u16) -> Span {
        Span {
            len_mode: 0,
            len: 0,
            off_mode: 0,
            off: 0,
            payload,
        }
    }

    fn resolve(self, payload: u32) -> (u32, u32) {
        let off0 = match self.off_mode % 5 {
            0 | 2 => 0,
            1 => (self.off % 64) * 4096,
            3 => self.off,
            _ => u32::MAX - self.off % 4096,
        };
        let msg_len = match self.len_mode % 6 {
            0 => payload,
            1 => payload.saturating_add(off0),
            2 => self.len % (1 << 20),
            3 => u32::MAX,
            4 => self.len,
            _ => 0,
        };
        let off = if self.off_mode % 5 == 2 {
            msg_len.wrapping_sub(payload)
        } else {
            off0
        };
        (msg_len, off)
    }
}

/// A forged DATA packet for connection 1 at B.
///
/// `opcode % 7 + 1` is the opcode. `qp % 8`: 0..=2 B's QP of connection 1;
/// 3 B's QP of connection 2; 4 a QP of B never connected; 5 connection 1's
/// QP number with another generation; 6 QPN 0; 7 `ts` as a QPN. `path`:
/// with bit 7 set, `path & 63` (beyond the peer's paths), else `path % 5`
/// (4 is one past the peer's). `gen`: with bit 7 set, the value as it is,
/// else the real sender's latest plus `gen % 4`. `key % 8`: the rkey of
/// B's writable window, of the region without remote access, of the
/// read-only region, of connection 2's region (other PD), of the receive
/// buffers (local write only), of the local source region, `ts` as a key,
/// 0. `addr_mode % 6` places the address relative to that region: inside
/// (`addr % len`), straddling its end, just below it, near `u64::MAX`,
/// `addr` in both halves, its base. `ts_mode % 3`: the current time, the
/// peer's latest, `ts`. `ecn` is the IP codepoint it arrives with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FakeData {
    pub opcode: u8,
    pub flags: u8,
    pub qp: u8,
    pub path: u8,
    pub gen: u8,
    pub psn: Sel,
    pub csn: Sel,
    pub msn: Sel,
    pub recv_seq: Sel,
    pub span: Span,
    pub key: u8,
    pub addr_mode: u8,
    pub addr: u32,
    pub ts_mode: u8,
    pub ts: u32,
    pub ecn: u8,
    pub patch: Patch,
}

impl FakeData {
    /// The next packet the peer would send on `path`, as a one-packet
    /// message of `op` (1 SEND .. 7 NOP) with `payload` bytes into B's
    /// writable window.
    pub fn valid(op: u8, path: u8, payload: u16) -> FakeData {
        FakeData {
            opcode: op.wrapping_sub(1),
            path,
            span: Span::single(payload),
            ..FakeData::default()
        }
    }
}

/// One path entry of a forged ACK. `path`: with bit 7 set, `path & 63`,
/// else `path % 5` (4: one past B's paths). `ack_psn` is relative to the
/// next PSN B would send on the path. SACK (`sack_mode % 8`): none; all
/// 256 bits; the first `sack % 257` bits; bit `sack % 256` alone; `0x55`
/// in the first `sack % 33` bytes; bytes from `sack` as a seed; every bit
/// but the first (a hole right after `ack_psn`); the last bit alone.
/// Counters (`ctr_mode % 4`): the latest the peer reported plus `rx` (and
/// `ce` at most that); plus `rx` and `ce` (more marks than packets); `rx`
/// and `ce` as they are; the latest minus `rx` (going back).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FakePath {
    pub path: u8,
    pub ack_psn: Sel,
    pub sack_mode: u8,
    pub sack: u32,
    pub ctr_mode: u8,
    pub rx: u16,
    pub ce: u16,
}

/// A stream entry of a forged ACK: `qp % 4`: B's QP of connection 1 (0,
/// 1), of connection 2, connection 1's with another generation.
/// `msn_done` is relative to the next MSN B would use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FakeStream {
    pub qp: u8,
    pub msn: Sel,
}

/// A NAK entry of a forged ACK: `qp` as for [`FakeStream`]; `msn`
/// relative to B's oldest request the peer has not completed; code `code %
/// 4 + 1`; `gen_mode % 3`: B's latest generation, the one after, `gen`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FakeNak {
    pub qp: u8,
    pub msn: Sel,
    pub code: u8,
    pub gen_mode: u8,
    pub gen: u8,
    pub rnr_us: u16,
}

/// A forged ACK for connection 1 at B.
///
/// `cum` is relative to the next CSN B would assign. `ts_mode % 5`:
/// `ts_echo` 0; B's latest `tx_ts`; that minus `ts`; `ts`; the current
/// time plus `ts`. `delay_mode % 3`: `ack_delay_ns` 0, `delay % 100 µs`,
/// `delay`. `rate_mode % 7`: a grant of 0 (no limit), `u32::MAX`, 1 kbit/s,
/// `rate % 1000`, `rate`, the peer's latest, 100 Gbit/s. `opt_mode % 9`:
/// no option; receive window 0; `u32::MAX`; `opt`; a window option of 3
/// bytes (malformed); an unknown critical option; an unknown non-critical
/// option of `opt % 16` bytes; window 1; window 0 then `u32::MAX`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct FakeAck {
    pub cum: Sel,
    pub ts_mode: u8,
    pub ts: u32,
    pub delay_mode: u8,
    pub delay: u32,
    pub rate_mode: u8,
    pub rate: u32,
    pub echo_path: u8,
    pub paths: Vec<FakePath>,
    pub streams: Vec<FakeStream>,
    pub naks: Vec<FakeNak>,
    pub opt_mode: u8,
    pub opt: u32,
    pub patch: Patch,
}

/// A forged CLOSE: `cid_mode % 4`: B's cid of connection 1 (0, 1), the
/// peer's cid of it (as a CLOSE(UnknownConnection) carries), `cid`.
/// `code`: below `2^31`, `code % 6` (5 is unknown), else as it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FakeClose {
    pub cid_mode: u8,
    pub cid: u32,
    pub code: u32,
}

/// A legitimate request. `op % 4`: WRITE, READ, SEND, WRITE_IMM. Length
/// `len % (MAX_WR_LEN + 1)`, at a 64-byte aligned offset from `at`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Post {
    pub op: u8,
    pub len: u16,
    pub at: u16,
}

/// One step of the attack.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Simulated time passes (`WAITS[code % 12]`): datagrams in flight
    /// arrive, timers fire.
    Wait(u8),
    /// A forged DATA packet to B.
    Data(FakeData),
    /// A forged ACK to B.
    Ack(FakeAck),
    /// A forged CLOSE to B.
    Close(FakeClose),
    /// A forged ACK with a forged DATA packet riding on it, one datagram.
    Coalesced(FakeAck, FakeData),
    /// B (the victim) posts a request on connection 1.
    VictimPost(Post),
    /// A (the peer) posts a request on connection 1.
    PeerPost(Post),
    /// The next `n` datagrams of the real peer to B (`to_b`) or of B to
    /// the peer are lost.
    Drop { to_b: bool, n: u8 },
    /// A real datagram the peer sent B on connection 1 lately (`idx` among
    /// the last 32), sent again with `patch`.
    Replay { idx: u8, patch: Patch },
    /// The last forged datagram again, `n % (MAX_REPEAT + 1)` times. Each
    /// copy bumps (`bump` bits) of a DATA packet: 1 the PSN, 2 the CSN, 4
    /// the MSN, 8 the offset by the payload, 16 `recv_seq`; of an ACK: 1
    /// every `ack_psn`, 2 `cum_csn`, 4 every `msn_done`, 8 every path's
    /// counters.
    Repeat { n: u8, bump: u8 },
}

/// The waits of [`Action::Wait`], in ns.
pub const WAITS: [u64; 12] = [
    0,
    1_000,
    5_000,
    20_000,
    100_000,
    500_000,
    2_000_000,
    10_000_000,
    50_000_000,
    200_000_000,
    1_000_000_000,
    5_000_000_000,
];

/// Reads the input a field at a time (zeros past the end).
struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
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
    fn u32(&mut self) -> u32 {
        u32::from_be_bytes([self.u8(), self.u8(), self.u8(), self.u8()])
    }
    fn sel(&mut self) -> Sel {
        Sel {
            mode: self.u8(),
            v: self.u32(),
        }
    }
    fn patch(&mut self) -> Patch {
        Patch {
            pos: self.u16(),
            xor: self.u8(),
        }
    }
    /// An entry count: below `0xc0`, `b % 5`; else `b - 0xbf` (1..=64).
    fn count(&mut self) -> usize {
        let b = self.u8();
        if b < 0xc0 {
            usize::from(b % 5)
        } else {
            usize::from(b - 0xbf)
        }
    }
}

#[derive(Default)]
struct Writer(Vec<u8>);

impl Writer {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u16(&mut self, v: u16) {
        self.0.extend(v.to_be_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.0.extend(v.to_be_bytes());
    }
    fn sel(&mut self, s: Sel) {
        self.u8(s.mode);
        self.u32(s.v);
    }
    fn patch(&mut self, p: Patch) {
        self.u16(p.pos);
        self.u8(p.xor);
    }
    fn count(&mut self, n: usize) {
        assert!(n <= 64, "at most 64 entries of a kind");
        if n <= 4 {
            self.u8(n as u8);
        } else {
            self.u8(0xbf + n as u8);
        }
    }
}

fn rd_data(r: &mut Reader) -> FakeData {
    FakeData {
        opcode: r.u8(),
        flags: r.u8(),
        qp: r.u8(),
        path: r.u8(),
        gen: r.u8(),
        psn: r.sel(),
        csn: r.sel(),
        msn: r.sel(),
        recv_seq: r.sel(),
        span: Span {
            len_mode: r.u8(),
            len: r.u32(),
            off_mode: r.u8(),
            off: r.u32(),
            payload: r.u16(),
        },
        key: r.u8(),
        addr_mode: r.u8(),
        addr: r.u32(),
        ts_mode: r.u8(),
        ts: r.u32(),
        ecn: r.u8(),
        patch: r.patch(),
    }
}

fn wr_data(w: &mut Writer, d: &FakeData) {
    w.u8(d.opcode);
    w.u8(d.flags);
    w.u8(d.qp);
    w.u8(d.path);
    w.u8(d.gen);
    w.sel(d.psn);
    w.sel(d.csn);
    w.sel(d.msn);
    w.sel(d.recv_seq);
    w.u8(d.span.len_mode);
    w.u32(d.span.len);
    w.u8(d.span.off_mode);
    w.u32(d.span.off);
    w.u16(d.span.payload);
    w.u8(d.key);
    w.u8(d.addr_mode);
    w.u32(d.addr);
    w.u8(d.ts_mode);
    w.u32(d.ts);
    w.u8(d.ecn);
    w.patch(d.patch);
}

fn rd_ack(r: &mut Reader) -> FakeAck {
    let mut a = FakeAck {
        cum: r.sel(),
        ts_mode: r.u8(),
        ts: r.u32(),
        delay_mode: r.u8(),
        delay: r.u32(),
        rate_mode: r.u8(),
        rate: r.u32(),
        echo_path: r.u8(),
        ..FakeAck::default()
    };
    for _ in 0..r.count() {
        a.paths.push(FakePath {
            path: r.u8(),
            ack_psn: r.sel(),
            sack_mode: r.u8(),
            sack: r.u32(),
            ctr_mode: r.u8(),
            rx: r.u16(),
            ce: r.u16(),
        });
    }
    for _ in 0..r.count() {
        a.streams.push(FakeStream {
            qp: r.u8(),
            msn: r.sel(),
        });
    }
    for _ in 0..r.count() {
        a.naks.push(FakeNak {
            qp: r.u8(),
            msn: r.sel(),
            code: r.u8(),
            gen_mode: r.u8(),
            gen: r.u8(),
            rnr_us: r.u16(),
        });
    }
    a.opt_mode = r.u8();
    a.opt = r.u32();
    a.patch = r.patch();
    a
}

fn wr_ack(w: &mut Writer, a: &FakeAck) {
    w.sel(a.cum);
    w.u8(a.ts_mode);
    w.u32(a.ts);
    w.u8(a.delay_mode);
    w.u32(a.delay);
    w.u8(a.rate_mode);
    w.u32(a.rate);
    w.u8(a.echo_path);
    w.count(a.paths.len());
    for p in &a.paths {
        w.u8(p.path);
        w.sel(p.ack_psn);
        w.u8(p.sack_mode);
        w.u32(p.sack);
        w.u8(p.ctr_mode);
        w.u16(p.rx);
        w.u16(p.ce);
    }
    w.count(a.streams.len());
    for s in &a.streams {
        w.u8(s.qp);
        w.sel(s.msn);
    }
    w.count(a.naks.len());
    for n in &a.naks {
        w.u8(n.qp);
        w.sel(n.msn);
        w.u8(n.code);
        w.u8(n.gen_mode);
        w.u8(n.gen);
        w.u16(n.rnr_us);
    }
    w.u8(a.opt_mode);
    w.u32(a.opt);
    w.patch(a.patch);
}

/// Reads any bytes as a sequence of at most [`MAX_ACTIONS`] actions. Each
/// starts with a byte `k`; `k % 16` says which, and its fields follow in
/// the order of the struct (integers big-endian, a [`Sel`] as its mode
/// byte and `v`, an entry count as described on `Reader::count`).
///
/// | `k % 16` | action |
/// |---|---|
/// | 0, 1 | `Wait` |
/// | 2, 3, 4 | `Data` |
/// | 5, 6, 7 | `Ack` |
/// | 8 | `Close` |
/// | 9 | `Coalesced` |
/// | 10 | `VictimPost` |
/// | 11 | `PeerPost` |
/// | 12 | `Drop` (bit 4 of `k`: to B) |
/// | 13 | `Replay` |
/// | 14, 15 | `Repeat` |
pub fn decode(data: &[u8]) -> Vec<Action> {
    let mut r = Reader(data);
    let mut out = Vec::new();
    while !r.0.is_empty() && out.len() < MAX_ACTIONS {
        let k = r.u8();
        let a = match k % 16 {
            0 | 1 => Action::Wait(r.u8()),
            2..=4 => Action::Data(rd_data(&mut r)),
            5..=7 => Action::Ack(rd_ack(&mut r)),
            8 => Action::Close(FakeClose {
                cid_mode: r.u8(),
                cid: r.u32(),
                code: r.u32(),
            }),
            9 => {
                let a = rd_ack(&mut r);
                Action::Coalesced(a, rd_data(&mut r))
            }
            10 | 11 => {
                let p = Post {
                    op: r.u8(),
                    len: r.u16(),
                    at: r.u16(),
                };
                if k % 16 == 10 {
                    Action::VictimPost(p)
                } else {
                    Action::PeerPost(p)
                }
            }
            12 => Action::Drop {
                to_b: k & 0x10 != 0,
                n: r.u8(),
            },
            13 => Action::Replay {
                idx: r.u8(),
                patch: r.patch(),
            },
            _ => Action::Repeat {
                n: r.u8(),
                bump: r.u8(),
            },
        };
        out.push(a);
    }
    out
}

/// Writes actions in the format [`decode`] reads.
pub fn encode(actions: &[Action]) -> Vec<u8> {
    let mut w = Writer::default();
    for a in actions {
        match a {
            Action::Wait(c) => {
                w.u8(0);
                w.u8(*c);
            }
            Action::Data(d) => {
                w.u8(2);
                wr_data(&mut w, d);
            }
            Action::Ack(a) => {
                w.u8(5);
                wr_ack(&mut w, a);
            }
            Action::Close(c) => {
                w.u8(8);
                w.u8(c.cid_mode);
                w.u32(c.cid);
                w.u32(c.code);
            }
            Action::Coalesced(a, d) => {
                w.u8(9);
                wr_ack(&mut w, a);
                wr_data(&mut w, d);
            }
            Action::VictimPost(p) | Action::PeerPost(p) => {
                w.u8(if matches!(a, Action::VictimPost(_)) {
                    10
                } else {
                    11
                });
                w.u8(p.op);
                w.u16(p.len);
                w.u16(p.at);
            }
            Action::Drop { to_b, n } => {
                w.u8(if *to_b { 12 | 0x10 } else { 12 });
                w.u8(*n);
            }
            Action::Replay { idx, patch } => {
                w.u8(13);
                w.u8(*idx);
                w.patch(*patch);
            }
            Action::Repeat { n, bump } => {
                w.u8(14);
                w.u8(*n);
                w.u8(*bump);
            }
        }
    }
    w.0
}

// ---------------------------------------------------------------------------
// The world: two endpoints, two connections, a link with a fixed delay
// ---------------------------------------------------------------------------

/// What the adversary learned from the wire about connection 1. `a_*`:
/// what the peer sends B (and B's reports of it); `b_*`: what B sends the
/// peer (and the peer's reports of it). Sequence numbers are "next":
/// the highest seen plus one.
#[derive(Debug, Clone)]
struct Observed {
    a_psn: [u32; MAX_PATHS],
    a_csn: u32,
    a_msn: u32,
    a_recv_seq: u32,
    a_ts: u32,
    a_gen: u8,
    /// The peer's reports of B's packets (in the peer's ACKs).
    a_cum: u32,
    a_ack_psn: [u32; MAX_PATHS],
    a_rx: [u32; MAX_PATHS],
    a_ce: [u32; MAX_PATHS],
    a_msn_done: u32,
    a_rate: u32,
    b_psn: [u32; MAX_PATHS],
    b_csn: u32,
    b_msn: u32,
    b_ts: u32,
    b_gen: u8,
    /// B's reports of the peer's packets (in B's ACKs).
    b_cum: u32,
    b_ack_psn: [u32; MAX_PATHS],
    b_msn_done: u32,
}

impl Default for Observed {
    fn default() -> Self {
        Observed {
            a_psn: [0; MAX_PATHS],
            a_csn: 0,
            a_msn: 0,
            a_recv_seq: 0,
            a_ts: 0,
            a_gen: 0,
            a_cum: 0,
            a_ack_psn: [0; MAX_PATHS],
            a_rx: [0; MAX_PATHS],
            a_ce: [0; MAX_PATHS],
            a_msn_done: 0,
            a_rate: 0,
            b_psn: [0; MAX_PATHS],
            b_csn: 0,
            b_msn: 0,
            b_ts: 0,
            b_gen: 0,
            b_cum: 0,
            b_ack_psn: [0; MAX_PATHS],
            b_msn_done: 0,
        }
    }
}

/// `*x := max(*x, v)` in serial order; a forged `v` moves it only when
/// close ahead (the adversary keeps to plausible numbers for its "next").
fn bump_to(x: &mut u32, v: u32, forged: bool) {
    if seq_lt(*x, v) && (!forged || seq_dist(*x, v) < 4096) {
        *x = v;
    }
}

fn is_request(op: Opcode) -> bool {
    matches!(
        op,
        Opcode::Send | Opcode::SendImm | Opcode::Write | Opcode::WriteImm | Opcode::ReadReq
    )
}

/// Handles, numbers and regions of the set-up.
#[derive(Debug, Clone, Copy)]
struct Ids {
    conn_a1: ConnectionHandle,
    conn_b1: ConnectionHandle,
    conn_a2: ConnectionHandle,
    conn_b2: ConnectionHandle,
    a_cid1: u32,
    b_cid1: u32,
    a_cid2: u32,
    b_cid2: u32,
    qa1: Qpn,
    qb1: Qpn,
    qa2: Qpn,
    qb2: Qpn,
    qb_idle: Qpn,
    cq_a1: CqHandle,
    cq_a1r: CqHandle,
    cq_b1: CqHandle,
    cq_b1r: CqHandle,
    cq_a2: CqHandle,
    cq_b2: CqHandle,
    pa: PdHandle,
    pb: PdHandle,
    pb2: PdHandle,
    // B (victim), connection 1's PD.
    win: MrInfo,
    guard: MrInfo,
    ronly: MrInfo,
    rbuf: MrInfo,
    bsrc: MrInfo,
    bdst: MrInfo,
    // B, connection 2's PD.
    win2: MrInfo,
    bsrc2: MrInfo,
    // A (peer).
    awin: MrInfo,
    asrc: MrInfo,
    adst: MrInfo,
    arbuf: MrInfo,
    asrc2: MrInfo,
    adst2: MrInfo,
}

struct Flight {
    at: u64,
    to_b: bool,
    from: SocketAddr,
    ecn: Ecn,
    bytes: Vec<u8>,
}

/// Work requests of one queue, in post order, not yet completed.
#[derive(Debug, Default)]
struct Queue {
    /// (wr_id, buffer length for receives).
    pending: VecDeque<(u64, u32)>,
    /// Requests completed so far.
    completed: u64,
}

impl Queue {
    fn complete(&mut self, what: &str, wc: &WorkCompletion) {
        self.completed += 1;
        match self.pending.pop_front() {
            Some((id, len)) => {
                assert_eq!(
                    id, wc.wr_id,
                    "{what}: completion out of post order (or twice): {wc:?}, expected {id}"
                );
                if matches!(wc.opcode, WcOpcode::Recv | WcOpcode::RecvRdmaWithImm)
                    && wc.status == WcStatus::Success
                {
                    assert!(
                        wc.byte_len <= len,
                        "{what}: a receive of {len} bytes completed with {}: {wc:?}",
                        wc.byte_len
                    );
                }
            }
            None => panic!("{what}: a completion for no outstanding request: {wc:?}"),
        }
    }
}

/// Worst values seen over one run.
#[derive(Debug, Default, Clone)]
pub struct Report {
    pub actions: usize,
    pub injected: u64,
    /// Most datagrams B emitted during one action.
    pub max_victim_datagrams: u64,
    /// Most bytes B emitted during one action.
    pub max_victim_bytes: u64,
    /// Most network and timer steps of one action.
    pub max_steps: u64,
    /// Largest heap growth over the set-up (0 when not measured).
    pub peak_heap_growth: isize,
    /// Datagrams B refused, all reasons.
    pub victim_rejects: u64,
    pub victim_bogus_acks: u64,
    /// Connection 1 at B at the end.
    pub conn1_state: Option<ConnectionState>,
    /// Simulated time at the end.
    pub sim_ns: u64,
    pub completions: u64,
}

/// Counters of the action being handled.
#[derive(Debug, Default, Clone, Copy)]
struct ActionCounters {
    b_datagrams: u64,
    b_bytes: u64,
    steps: u64,
    /// [`World::path_failures`] when the action began.
    path_failures: u64,
}

pub struct World {
    pub a: Endpoint,
    pub b: Endpoint,
    pub now: Instant,
    buf: Vec<u8>,
    flights: VecDeque<Flight>,
    drop_to_b: u32,
    drop_to_a: u32,
    ids: Ids,
    obs: Observed,
    /// Real datagrams the peer sent B on connection 1 lately.
    recent: VecDeque<Vec<u8>>,
    last_forged: Option<Vec<u8>>,
    /// Send queues of connection 1 (A's, B's) and receive queues.
    sq_a: Queue,
    sq_b: Queue,
    rq_a: Queue,
    rq_b: Queue,
    next_wr: u64,
    recv_slot: [usize; 2],
    act: ActionCounters,
    pub report: Report,
    /// Contents of B's regions that must never change, by lkey.
    protected: Vec<(u32, Vec<u8>)>,
    heap: Option<HeapProbe>,
}

/// Measures the heap of the calling thread (live bytes): given by the test,
/// absent in the fuzz target (where libFuzzer's RSS and malloc limits
/// watch memory).
pub type HeapProbe = fn() -> isize;

struct HeapBase {
    probe: HeapProbe,
    base: isize,
}

/// Deterministic bytes for region `tag` (`REGION` of them, or fewer): made
/// once per process, as a debug build is slow to make them.
fn pattern(tag: u64, len: usize) -> Vec<u8> {
    static PATTERNS: std::sync::OnceLock<Vec<Vec<u8>>> = std::sync::OnceLock::new();
    let all = PATTERNS.get_or_init(|| {
        (0..16u64)
            .map(|t| {
                let mut x = t.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
                (0..REGION)
                    .map(|_| {
                        x ^= x >> 12;
                        x ^= x << 25;
                        x ^= x >> 27;
                        (x.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 56) as u8
                    })
                    .collect()
            })
            .collect()
    });
    all[tag as usize % all.len()][..len].to_vec()
}

/// A few bytes from `seed`.
fn noise(seed: u32, n: usize) -> Vec<u8> {
    let mut x = u64::from(seed).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            (x.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 56) as u8
        })
        .collect()
}

/// Opens a connection from `a` to `b` at `now`, every datagram delivered
/// at once; returns both handles and both connection ids (from the ACCEPT).
pub fn handshake(
    a: &mut Endpoint,
    b: &mut Endpoint,
    now: Instant,
) -> (ConnectionHandle, ConnectionHandle, u32, u32) {
    let ca = a.connect(now, addr(true)).unwrap();
    let mut buf = vec![0u8; 65_536];
    let (mut cb, mut cids, mut connected) = (None, None, false);
    for _ in 0..16 {
        while let Some(t) = a.poll_transmit(now, &mut buf) {
            b.handle_datagram(
                now,
                SocketAddr::new(A_IP, t.src_port),
                t.ecn,
                &buf[..t.size],
            );
        }
        while let Some(t) = b.poll_transmit(now, &mut buf) {
            if let Ok(acc) = Accept::parse(&buf[..t.size]) {
                cids = Some((acc.dst_cid, acc.src_cid));
            }
            a.handle_datagram(
                now,
                SocketAddr::new(B_IP, t.src_port),
                t.ecn,
                &buf[..t.size],
            );
        }
        while let Some(e) = b.poll_event() {
            if let Event::Incoming { conn, .. } = e {
                cb = Some(conn);
            }
        }
        while let Some(e) = a.poll_event() {
            connected |= e == Event::Connected(ca);
        }
    }
    assert!(connected, "handshake did not finish");
    let (a_cid, b_cid) = cids.expect("an ACCEPT");
    (ca, cb.expect("an incoming connection"), a_cid, b_cid)
}

impl World {
    /// Two endpoints, two connections with a QP pair each, regions, posted
    /// receives, and a little legitimate traffic on connection 1 so that
    /// every sequence space has moved.
    pub fn new(heap: Option<HeapProbe>) -> World {
        World::with_rnr_retry(heap, RNR_RETRY)
    }

    /// [`World::new`] with connection 1's QPs retrying RNR `rnr_retry`
    /// times (7: for ever).
    pub fn with_rnr_retry(heap: Option<HeapProbe>, rnr_retry: u8) -> World {
        let mut a = Endpoint::new(config(), 0xadd0_000a).unwrap();
        let mut b = Endpoint::new(config(), 0xadd0_000b).unwrap();
        let now = Instant::from_nanos(1_000_000);
        let (conn_a1, conn_b1, a_cid1, b_cid1) = handshake(&mut a, &mut b, now);
        let (conn_a2, conn_b2, a_cid2, b_cid2) = handshake(&mut a, &mut b, now);
        let (pa, pb, pb2) = (a.alloc_pd(), b.alloc_pd(), b.alloc_pd());
        let reg = |ep: &mut Endpoint, pd, data: Vec<u8>, at: u64, acc| {
            ep.reg_mr(pd, data.into_boxed_slice(), at, acc).unwrap()
        };
        let rw = AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ | AccessFlags::LOCAL_WRITE;
        let lw = AccessFlags::LOCAL_WRITE;
        let none = AccessFlags::NONE;
        let (cq_a1, cq_a1r, cq_a2) = (a.create_cq(4096), a.create_cq(4096), a.create_cq(64));
        let (cq_b1, cq_b1r, cq_b2) = (b.create_cq(4096), b.create_cq(4096), b.create_cq(64));
        let qa1 = a.create_qp(QpInit::new(pa, cq_a1, cq_a1r)).unwrap();
        let qb1 = b.create_qp(QpInit::new(pb, cq_b1, cq_b1r)).unwrap();
        let qa2 = a.create_qp(QpInit::new(pa, cq_a2, cq_a2)).unwrap();
        let qb2 = b.create_qp(QpInit::new(pb2, cq_b2, cq_b2)).unwrap();
        let qb_idle = b.create_qp(QpInit::new(pb, cq_b2, cq_b2)).unwrap();
        a.connect_qp(qa1, conn_a1, qb1).unwrap();
        b.connect_qp(qb1, conn_b1, qa1).unwrap();
        let rnr = QpAttrs {
            rnr_retry: Some(rnr_retry),
            ..QpAttrs::default()
        };
        a.modify_qp(qa1, QpState::Rts, rnr).unwrap();
        b.modify_qp(qb1, QpState::Rts, rnr).unwrap();
        a.connect_qp(qa2, conn_a2, qb2).unwrap();
        b.connect_qp(qb2, conn_b2, qa2).unwrap();
        let ids = Ids {
            conn_a1,
            conn_b1,
            conn_a2,
            conn_b2,
            a_cid1,
            b_cid1,
            a_cid2,
            b_cid2,
            qa1,
            qb1,
            qa2,
            qb2,
            qb_idle,
            cq_a1,
            cq_a1r,
            cq_b1,
            cq_b1r,
            cq_a2,
            cq_b2,
            pa,
            pb,
            pb2,
            win: reg(&mut b, pb, pattern(1, REGION), 0x1000_0000, rw),
            guard: reg(&mut b, pb, pattern(2, SMALL), 0x2000_0000, none),
            ronly: reg(
                &mut b,
                pb,
                pattern(3, SMALL),
                0x3000_0000,
                AccessFlags::REMOTE_READ,
            ),
            rbuf: reg(&mut b, pb, vec![0; RECVS * SLOT], 0x4000_0000, lw),
            bsrc: reg(&mut b, pb, pattern(4, REGION), 0x5000_0000, none),
            bdst: reg(&mut b, pb, vec![0; REGION], 0x6000_0000, lw),
            win2: reg(&mut b, pb2, pattern(5, SMALL), 0x7000_0000, rw),
            bsrc2: reg(&mut b, pb2, pattern(6, REGION), 0x7800_0000, none),
            awin: reg(&mut a, pa, pattern(7, REGION), 0x1000_0000, rw),
            asrc: reg(&mut a, pa, pattern(8, REGION), 0x2000_0000, none),
            adst: reg(&mut a, pa, vec![0; REGION], 0x3000_0000, lw),
            arbuf: reg(&mut a, pa, vec![0; RECVS * SLOT], 0x4000_0000, lw),
            asrc2: reg(&mut a, pa, pattern(9, REGION), 0x5000_0000, none),
            adst2: reg(&mut a, pa, vec![0; REGION], 0x6000_0000, lw),
        };
        let protected = [ids.guard, ids.ronly, ids.win2]
            .iter()
            .map(|mr| (mr.lkey, b.mr(mr.lkey).unwrap().to_vec()))
            .collect();
        let mut w = World {
            a,
            b,
            now,
            buf: vec![0u8; 65_536],
            flights: VecDeque::new(),
            drop_to_b: 0,
            drop_to_a: 0,
            ids,
            obs: Observed::default(),
            recent: VecDeque::new(),
            last_forged: None,
            sq_a: Queue::default(),
            sq_b: Queue::default(),
            rq_a: Queue::default(),
            rq_b: Queue::default(),
            next_wr: 1,
            recv_slot: [0, 0],
            act: ActionCounters::default(),
            report: Report::default(),
            protected,
            heap,
        };
        w.top_up_receives();
        // Some real traffic both ways, so that no sequence space is at 0.
        for (i, op) in [0u8, 2, 1, 3].into_iter().enumerate() {
            let p = Post {
                op,
                len: 1000 + 1500 * i as u16,
                at: 16 * i as u16,
            };
            w.post(true, p);
            w.post(false, p);
        }
        let end = w.now + Duration::from_millis(2);
        w.run_until(end, MAX_STEPS_PER_ACTION);
        w.after_action();
        assert!(
            w.sq_a.pending.is_empty() && w.sq_b.pending.is_empty(),
            "the warm-up traffic completed"
        );
        w.act = ActionCounters::default();
        w
    }

    // --- the link -------------------------------------------------------

    /// Polls both endpoints until neither has anything to send; puts the
    /// datagrams on the link (after sniffing them).
    fn flush(&mut self) {
        for from_b in [false, true] {
            let mut n = 0u64;
            loop {
                let ep = if from_b { &mut self.b } else { &mut self.a };
                let Some(t) = ep.poll_transmit(self.now, &mut self.buf) else {
                    break;
                };
                n += 1;
                assert!(
                    n <= 1_000_000,
                    "livelock: an endpoint keeps producing datagrams at one instant"
                );
                assert!(t.size <= self.buf.len() && t.size <= MTU);
                let seg = t.segment_size.unwrap_or(t.size).max(1);
                let peer = if from_b { A_IP } else { B_IP };
                let wire = self.buf[..t.size].to_vec();
                for chunk in wire.chunks(seg) {
                    if from_b {
                        self.act.b_datagrams += 1;
                        self.act.b_bytes += chunk.len() as u64;
                    }
                    if t.dst.ip() != peer {
                        continue; // to nobody we know
                    }
                    self.sniff(!from_b, chunk, false);
                    let drop = if from_b {
                        &mut self.drop_to_a
                    } else {
                        &mut self.drop_to_b
                    };
                    if *drop > 0 {
                        *drop -= 1;
                        continue;
                    }
                    let from_ip = if from_b { B_IP } else { A_IP };
                    self.flights.push_back(Flight {
                        at: self.now.as_nanos() + LINK_DELAY_NS,
                        to_b: !from_b,
                        from: SocketAddr::new(from_ip, t.src_port),
                        ecn: t.ecn,
                        bytes: chunk.to_vec(),
                    });
                }
            }
        }
    }

    /// Runs the network and the timers up to `end`, at most `cap` steps.
    fn run_until(&mut self, end: Instant, cap: u64) {
        loop {
            self.flush();
            let next_flight = self.flights.front().map(|f| f.at);
            let next_timer = [self.a.poll_timeout(), self.b.poll_timeout()]
                .into_iter()
                .flatten()
                .map(|t| t.as_nanos())
                .min();
            let next = match (next_flight, next_timer) {
                (Some(x), Some(y)) => Some(x.min(y)),
                (x, y) => x.or(y),
            };
            let Some(next) = next.filter(|&t| t <= end.as_nanos()) else {
                self.now = self.now.max(end);
                break;
            };
            self.act.steps += 1;
            assert!(
                self.act.steps <= cap,
                "livelock: {cap} network and timer steps in one action (now {:?}, end {end:?})",
                self.now
            );
            self.now = self.now.max(Instant::from_nanos(next));
            while self
                .flights
                .front()
                .is_some_and(|f| f.at <= self.now.as_nanos())
            {
                let f = self.flights.pop_front().unwrap();
                let ep = if f.to_b { &mut self.b } else { &mut self.a };
                ep.handle_datagram(self.now, f.from, f.ecn, &f.bytes);
            }
            self.fire_timers();
            self.drain();
            self.top_up_receives();
        }
        self.flush();
    }

    fn fire_timers(&mut self) {
        let now = self.now;
        for ep in [&mut self.a, &mut self.b] {
            if ep.poll_timeout().is_some_and(|t| t <= now) {
                ep.handle_timeout(now);
            }
        }
    }

    /// Learns what it can from a datagram going to B (`to_b`) or to A.
    fn sniff(&mut self, to_b: bool, bytes: &[u8], forged: bool) {
        if bytes.len() < 8 || bytes[0] != metaroce_proto::consts::VERSION {
            return;
        }
        let (cid_b, cid_a) = (self.ids.b_cid1, self.ids.a_cid1);
        if to_b && !forged && bytes[1] != PacketType::Close as u8 {
            let cid = u32::from_be_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]);
            if cid == cid_b {
                if self.recent.len() == 32 {
                    self.recent.pop_front();
                }
                self.recent.push_back(bytes.to_vec());
            }
        }
        let mut data = bytes;
        if let Ok(ack) = AckPacket::parse(bytes, |_| false) {
            let h = *ack.header();
            let o = &mut self.obs;
            if to_b && h.dst_cid == cid_b {
                bump_to(&mut o.a_cum, h.cum_csn, forged);
                if !forged {
                    o.a_rate = h.rate_hint_kbps;
                }
                for e in ack.paths() {
                    let p = usize::from(e.path_id);
                    bump_to(&mut o.a_ack_psn[p], e.ack_psn, forged);
                    o.a_rx[p] = e.rx_packets;
                    o.a_ce[p] = e.ce_packets;
                }
                for s in ack.streams() {
                    if s.qpn == self.ids.qb1.0 {
                        bump_to(&mut o.a_msn_done, s.msn_done, forged);
                    }
                }
            } else if !to_b && h.dst_cid == cid_a {
                bump_to(&mut o.b_cum, h.cum_csn, false);
                for e in ack.paths() {
                    bump_to(&mut o.b_ack_psn[usize::from(e.path_id)], e.ack_psn, false);
                }
                for s in ack.streams() {
                    if s.qpn == self.ids.qa1.0 {
                        bump_to(&mut o.b_msn_done, s.msn_done, false);
                    }
                }
            }
            match ack.coalesced() {
                Some(rest) => data = rest,
                None => return,
            }
        }
        let Ok((h, _)) = DataHeader::parse(data) else {
            return;
        };
        let p = usize::from(h.path_id);
        let o = &mut self.obs;
        if to_b && h.dst_cid == cid_b {
            bump_to(&mut o.a_psn[p], h.psn.wrapping_add(1), forged);
            bump_to(&mut o.a_csn, h.csn.wrapping_add(1), forged);
            if !forged {
                o.a_ts = h.tx_ts;
            }
            if h.dst_qpn == self.ids.qb1.0 && is_request(h.opcode) {
                bump_to(&mut o.a_msn, h.msn.wrapping_add(1), forged);
                if !forged {
                    o.a_gen = h.gen;
                }
                if let OpcodeExt::Send { recv_seq }
                | OpcodeExt::SendImm { recv_seq, .. }
                | OpcodeExt::WriteImm { recv_seq, .. } = h.ext
                {
                    bump_to(&mut o.a_recv_seq, recv_seq.wrapping_add(1), forged);
                }
            }
        } else if !to_b && h.dst_cid == cid_a {
            bump_to(&mut o.b_psn[p], h.psn.wrapping_add(1), false);
            bump_to(&mut o.b_csn, h.csn.wrapping_add(1), false);
            o.b_ts = h.tx_ts;
            if h.dst_qpn == self.ids.qa1.0 && is_request(h.opcode) {
                bump_to(&mut o.b_msn, h.msn.wrapping_add(1), false);
                o.b_gen = h.gen;
            }
        }
    }

    // --- legitimate traffic --------------------------------------------

    /// Posts a request on connection 1: by B (`victim`) or by A.
    fn post(&mut self, victim: bool, p: Post) {
        let q = if victim { &self.sq_b } else { &self.sq_a };
        if q.pending.len() >= MAX_OUTSTANDING {
            return;
        }
        let ids = self.ids;
        let (qpn, src, dst, remote) = if victim {
            (ids.qb1, ids.bsrc, ids.bdst, ids.awin)
        } else {
            (ids.qa1, ids.asrc, ids.adst, ids.win)
        };
        let len = u32::from(p.len) % (MAX_WR_LEN + 1);
        let at = (u64::from(p.at) * 64) % (REGION as u64 - u64::from(len) + 1);
        let raddr = RemoteAddr {
            rkey: remote.rkey,
            addr: remote.addr + at,
        };
        let op = match p.op % 4 {
            0 => SendOp::Write(raddr),
            1 => SendOp::Read(raddr),
            2 => SendOp::Send,
            _ => SendOp::WriteImm(raddr, u32::from(p.at)),
        };
        let local = if matches!(op, SendOp::Read(_)) {
            dst
        } else {
            src
        };
        let wr_id = self.next_wr;
        self.next_wr += 1;
        let wr = SendWr::new(
            wr_id,
            op,
            Sge {
                lkey: local.lkey,
                addr: local.addr + at,
                len,
            },
        );
        let ep = if victim { &mut self.b } else { &mut self.a };
        if ep.post_send(self.now, qpn, wr).is_ok() {
            let q = if victim {
                &mut self.sq_b
            } else {
                &mut self.sq_a
            };
            q.pending.push_back((wr_id, len));
        }
    }

    /// Keeps `RECVS` receives posted on each side of connection 1 while its
    /// QP takes them.
    fn top_up_receives(&mut self) {
        for victim in [false, true] {
            let (ep, qpn, buf, rq, slot) = if victim {
                (
                    &mut self.b,
                    self.ids.qb1,
                    self.ids.rbuf,
                    &mut self.rq_b,
                    &mut self.recv_slot[1],
                )
            } else {
                (
                    &mut self.a,
                    self.ids.qa1,
                    self.ids.arbuf,
                    &mut self.rq_a,
                    &mut self.recv_slot[0],
                )
            };
            if !matches!(ep.qp_state(qpn), Some(QpState::Rtr | QpState::Rts)) {
                continue;
            }
            while rq.pending.len() < RECVS {
                let wr_id = self.next_wr;
                self.next_wr += 1;
                let s = *slot % RECVS;
                *slot += 1;
                let sge = Sge {
                    lkey: buf.lkey,
                    addr: buf.addr + (s * SLOT) as u64,
                    len: SLOT as u32,
                };
                ep.post_recv(
                    qpn,
                    RecvWr {
                        wr_id,
                        sge: sge.into(),
                    },
                )
                .unwrap();
                rq.pending.push_back((wr_id, SLOT as u32));
            }
        }
    }

    /// Takes every completion and event; checks their order and that
    /// connection 2 is untouched.
    fn drain(&mut self) {
        let ids = self.ids;
        let mut wcs = Vec::new();
        for (victim, cq) in [
            (false, ids.cq_a1),
            (false, ids.cq_a1r),
            (true, ids.cq_b1),
            (true, ids.cq_b1r),
        ] {
            let ep = if victim { &mut self.b } else { &mut self.a };
            wcs.clear();
            ep.poll_cq(cq, usize::MAX, &mut wcs).unwrap();
            for wc in &wcs {
                self.report.completions += 1;
                let recv = cq == ids.cq_a1r || cq == ids.cq_b1r;
                let (q, what) = match (victim, recv) {
                    (false, false) => (&mut self.sq_a, "peer's sends"),
                    (false, true) => (&mut self.rq_a, "peer's receives"),
                    (true, false) => (&mut self.sq_b, "victim's sends"),
                    (true, true) => (&mut self.rq_b, "victim's receives"),
                };
                q.complete(what, wc);
            }
        }
        for victim in [false, true] {
            let ep = if victim { &mut self.b } else { &mut self.a };
            let (conn2, qp2) = if victim {
                (ids.conn_b2, ids.qb2)
            } else {
                (ids.conn_a2, ids.qa2)
            };
            while let Some(e) = ep.poll_event() {
                match e {
                    Event::ConnectionLost { conn, error } => {
                        assert_ne!(conn, conn2, "connection 2 lost: {error:?}")
                    }
                    Event::QpError { qpn, status } => {
                        assert_ne!(qpn, qp2, "a QP of connection 2 failed: {status:?}")
                    }
                    Event::CqOverrun(cq) => panic!("completion queue {cq:?} overrun"),
                    Event::Incoming { .. } => panic!("a connection nobody opened"),
                    Event::Connected(_) => {}
                }
            }
        }
    }

    // --- forging ------------------------------------------------------------

    fn region(&self, key: u8, raw: u32) -> (u32, u64, u64) {
        let i = &self.ids;
        let mr = match key % 8 {
            0 => i.win,
            1 => i.guard,
            2 => i.ronly,
            3 => i.win2,
            4 => i.rbuf,
            5 => i.bsrc,
            6 => {
                return (raw, i.win.addr, i.win.len);
            }
            _ => {
                return (0, i.win.addr, i.win.len);
            }
        };
        (mr.rkey, mr.addr, mr.len)
    }

    fn forge_data(&self, d: &FakeData) -> Vec<u8> {
        let o = &self.obs;
        let opcode = Opcode::from_u8(d.opcode % 7 + 1).unwrap();
        let path_id = if d.path & 0x80 != 0 {
            d.path & 0x3f
        } else {
            d.path % (PATHS + 1)
        };
        let p = usize::from(path_id);
        let psn = d.psn.pick(o.a_psn[p], o.b_ack_psn[p], SACK_BITS);
        let csn = d.csn.pick(o.a_csn, o.b_cum, CSN_WINDOW);
        let msn = d.msn.pick(o.a_msn, o.b_msn_done, MSG_WINDOW);
        let recv_seq = d.recv_seq.pick(o.a_recv_seq, o.a_recv_seq, RECVS as u32);
        let gen = if d.gen & 0x80 != 0 {
            d.gen
        } else {
            o.a_gen.wrapping_add(d.gen % 4)
        };
        let i = &self.ids;
        let dst_qpn = match d.qp % 8 {
            0..=2 => i.qb1.0,
            3 => i.qb2.0,
            4 => i.qb_idle.0,
            5 => i.qb1.0 ^ (1 << 20),
            6 => 0,
            _ => d.ts,
        };
        let (rkey, base, len) = self.region(d.key, d.ts);
        let a = u64::from(d.addr);
        let remote_addr = match d.addr_mode % 6 {
            0 => base + a % len.max(1),
            1 => base + len - a % 64,
            2 => base.wrapping_sub(1 + a % 64),
            3 => u64::MAX - a % 4096,
            4 => (a << 32) | a,
            _ => base,
        };
        let imm = d.ts;
        let ext = match opcode {
            Opcode::Send => OpcodeExt::Send { recv_seq },
            Opcode::SendImm => OpcodeExt::SendImm { recv_seq, imm },
            Opcode::Write => OpcodeExt::Write { rkey, remote_addr },
            Opcode::WriteImm => OpcodeExt::WriteImm {
                rkey,
                remote_addr,
                recv_seq,
                imm,
            },
            Opcode::ReadReq => OpcodeExt::ReadReq { rkey, remote_addr },
            Opcode::ReadResp => OpcodeExt::ReadResp,
            Opcode::Nop => OpcodeExt::Nop,
        };
        let hlen = DATA_HEADER_LEN + opcode.ext_len();
        let room = if opcode.carries_payload() {
            MTU - hlen
        } else {
            0
        };
        let payload_len = usize::from(d.span.payload) % (room + 1);
        let (msg_len, msg_offset) = d.span.resolve(payload_len as u32);
        let tx_ts = match d.ts_mode % 3 {
            0 => self.now.wire_ts(),
            1 => o.a_ts,
            _ => d.ts,
        };
        // Emitted with a length and offset the encoder takes, then the
        // real ones written over them.
        let hdr = DataHeader {
            opcode,
            flags: d.flags,
            dst_cid: i.b_cid1,
            dst_qpn,
            path_id,
            gen,
            psn,
            csn,
            tx_ts,
            msn,
            msg_len: if opcode.carries_payload() {
                u32::MAX
            } else {
                0
            },
            msg_offset: 0,
            ext,
        };
        let payload: Vec<u8> = (0..payload_len)
            .map(|k| 0xe5 ^ (k as u8) ^ (csn as u8))
            .collect();
        let mut out = vec![0u8; hlen + payload_len];
        let n = hdr.emit(&mut out, &payload).expect("a DATA packet encodes");
        out.truncate(n);
        out[32..36].copy_from_slice(&msg_len.to_be_bytes());
        out[36..40].copy_from_slice(&msg_offset.to_be_bytes());
        d.patch.apply(&mut out);
        out
    }

    fn forge_ack(&self, f: &FakeAck, coalesced: bool) -> Vec<u8> {
        let o = &self.obs;
        let cum_csn = f.cum.pick(o.b_csn, o.a_cum, CSN_WINDOW);
        let ts_echo = match f.ts_mode % 5 {
            0 => 0,
            1 => o.b_ts,
            2 => o.b_ts.wrapping_sub(f.ts),
            3 => f.ts,
            _ => self.now.wire_ts().wrapping_add(f.ts),
        };
        let ack_delay_ns = match f.delay_mode % 3 {
            0 => 0,
            1 => f.delay % 100_000,
            _ => f.delay,
        };
        let rate_hint_kbps = match f.rate_mode % 7 {
            0 => 0,
            1 => u32::MAX,
            2 => 1,
            3 => f.rate % 1000,
            4 => f.rate,
            5 => o.a_rate,
            _ => 100_000_000,
        };
        let h = AckHeader {
            flags: 0,
            dst_cid: self.ids.b_cid1,
            cum_csn,
            ts_echo,
            ack_delay_ns,
            rate_hint_kbps,
            echo_path: f.echo_path,
        };
        let mut buf = vec![0u8; 8192];
        let mut ab = AckBuilder::new(&mut buf, h).unwrap();
        let qp = |sel: u8| match sel % 4 {
            0 | 1 => self.ids.qb1.0,
            2 => self.ids.qb2.0,
            _ => self.ids.qb1.0 ^ (1 << 20),
        };
        for fp in &f.paths {
            let path_id = if fp.path & 0x80 != 0 {
                fp.path & 0x3f
            } else {
                fp.path % (PATHS + 1)
            };
            let p = usize::from(path_id);
            let ack_psn = fp.ack_psn.pick(o.b_psn[p], o.a_ack_psn[p], SACK_BITS);
            let mut sack = [0u8; SACK_BYTES];
            let s = fp.sack;
            match fp.sack_mode % 8 {
                0 => {}
                1 => sack = [0xff; SACK_BYTES],
                2 => {
                    for bit in 0..(s % 257) as usize {
                        sack[bit / 8] |= 1 << (bit % 8);
                    }
                }
                3 => {
                    let bit = (s % 256) as usize;
                    sack[bit / 8] |= 1 << (bit % 8);
                }
                4 => {
                    for b in sack.iter_mut().take((s % 33) as usize) {
                        *b = 0x55;
                    }
                }
                5 => sack.copy_from_slice(&noise(s, SACK_BYTES)),
                6 => {
                    sack = [0xff; SACK_BYTES];
                    sack[0] = 0xfe;
                }
                _ => sack[SACK_BYTES - 1] = 0x80,
            }
            let (rx, ce) = (u32::from(fp.rx), u32::from(fp.ce));
            let (rx_packets, ce_packets) = match fp.ctr_mode % 4 {
                0 => (
                    o.a_rx[p].wrapping_add(rx),
                    o.a_ce[p].wrapping_add(ce.min(rx)),
                ),
                1 => (o.a_rx[p].wrapping_add(rx), o.a_ce[p].wrapping_add(ce)),
                2 => (rx << 16 | ce, ce),
                _ => (o.a_rx[p].wrapping_sub(rx), o.a_ce[p].wrapping_sub(ce)),
            };
            let _ = ab.push_path(&AckPathEntry {
                path_id,
                ack_psn,
                sack,
                rx_packets,
                ce_packets,
            });
        }
        for s in &f.streams {
            let _ = ab.push_stream(&AckStreamEntry {
                qpn: qp(s.qp),
                msn_done: s.msn.pick(o.b_msn, o.a_msn_done, MSG_WINDOW),
            });
        }
        for n in &f.naks {
            let gen = match n.gen_mode % 3 {
                0 => o.b_gen,
                1 => o.b_gen.wrapping_add(1),
                _ => n.gen,
            };
            let code = match n.code % 4 {
                0 => NakCode::Rnr,
                1 => NakCode::RemoteAccess,
                2 => NakCode::InvalidRequest,
                _ => NakCode::RemoteOperation,
            };
            let _ = ab.push_nak(&NakEntry {
                qpn: qp(n.qp),
                msn: n.msn.pick(o.a_msn_done, o.b_msn_done, MSG_WINDOW),
                code,
                gen,
                rnr_timer_us: n.rnr_us,
            });
        }
        let v = f.opt;
        let _ = match f.opt_mode % 9 {
            0 => Ok(()),
            1 => ab.push_option(ACK_OPT_RECV_WINDOW, &0u32.to_be_bytes()),
            2 => ab.push_option(ACK_OPT_RECV_WINDOW, &u32::MAX.to_be_bytes()),
            3 => ab.push_option(ACK_OPT_RECV_WINDOW, &v.to_be_bytes()),
            4 => ab.push_option(ACK_OPT_RECV_WINDOW, &v.to_be_bytes()[..3]),
            5 => ab.push_option(0x80 | (v as u8 & 0x7f), &[]),
            6 => ab.push_option(0x02 + (v as u8 % 0x7e), &noise(v, (v % 16) as usize)),
            7 => ab.push_option(ACK_OPT_RECV_WINDOW, &1u32.to_be_bytes()),
            _ => ab
                .push_option(ACK_OPT_RECV_WINDOW, &0u32.to_be_bytes())
                .and_then(|_| ab.push_option(ACK_OPT_RECV_WINDOW, &u32::MAX.to_be_bytes())),
        };
        let n = if coalesced {
            match ab.finish_coalesced() {
                Ok(n) => n,
                Err(_) => return Vec::new(),
            }
        } else {
            ab.finish()
        };
        buf.truncate(n);
        f.patch.apply(&mut buf);
        buf
    }

    fn forge_close(&self, c: &FakeClose) -> Vec<u8> {
        let cid = match c.cid_mode % 4 {
            0 | 1 => self.ids.b_cid1,
            2 => self.ids.a_cid1,
            // Never connection 2's: it is not attacked.
            _ if c.cid == self.ids.b_cid2 || c.cid == self.ids.a_cid2 => self.ids.b_cid1,
            _ => c.cid,
        };
        let code = if c.code < 0x8000_0000 {
            c.code % 6
        } else {
            c.code
        };
        let mut out = vec![
            metaroce_proto::consts::VERSION,
            PacketType::Close as u8,
            0,
            0,
        ];
        out.extend(cid.to_be_bytes());
        out.extend(code.to_be_bytes());
        out
    }

    /// Delivers a forged datagram to B at once, from the peer's IP.
    fn inject(&mut self, bytes: Vec<u8>, ecn: Ecn) {
        if bytes.is_empty() {
            return;
        }
        // Connection 2 is never named (a patch could have made its cid).
        if bytes.len() >= 8 {
            let cid = u32::from_be_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]);
            if cid == self.ids.b_cid2 || cid == self.ids.a_cid2 {
                return;
            }
        }
        self.report.injected += 1;
        self.sniff(true, &bytes, true);
        let from = SocketAddr::new(A_IP, FORGED_PORT);
        self.b.handle_datagram(self.now, from, ecn, &bytes);
        self.fire_timers();
        self.flush();
        self.last_forged = Some(bytes);
    }

    /// The last forged datagram again, with numbers bumped by `k`.
    fn bumped(&self, bump: u8, k: u32) -> Option<Vec<u8>> {
        let mut b = self.last_forged.clone()?;
        let add = |b: &mut [u8], at: usize, by: u32| {
            if b.len() >= at + 4 {
                let v = u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
                b[at..at + 4].copy_from_slice(&v.wrapping_add(by).to_be_bytes());
            }
        };
        if b.len() < 8 {
            return Some(b);
        }
        if b[1] == PacketType::Data as u8 && b.len() >= DATA_HEADER_LEN {
            if bump & 1 != 0 {
                add(&mut b, 16, k);
            }
            if bump & 2 != 0 {
                add(&mut b, 20, k);
            }
            if bump & 4 != 0 {
                add(&mut b, 28, k);
            }
            if bump & 8 != 0 {
                let hlen = Opcode::from_u8(b[2])
                    .map_or(DATA_HEADER_LEN, |o| DATA_HEADER_LEN + o.ext_len());
                let payload = b.len().saturating_sub(hlen) as u32;
                add(&mut b, 36, payload.wrapping_mul(k));
            }
            if bump & 16 != 0 && matches!(b[2], 1 | 2) {
                add(&mut b, 40, k);
            }
        } else if b[1] == PacketType::Ack as u8 && b.len() >= 28 {
            if bump & 2 != 0 {
                add(&mut b, 8, k);
            }
            let mut at = 28;
            for _ in 0..b[24] {
                if b.len() < at + 16 {
                    break;
                }
                if bump & 1 != 0 {
                    add(&mut b, at + 4, k);
                }
                if bump & 8 != 0 {
                    add(&mut b, at + 8, k);
                    add(&mut b, at + 12, k);
                }
                at += 16 + usize::from(b[at + 2]);
            }
            if bump & 4 != 0 {
                for _ in 0..b[25] {
                    add(&mut b, at + 4, k);
                    at += 8;
                }
            }
        }
        Some(b)
    }

    // --- actions -------------------------------------------------------------

    /// Runs one action, then checks the invariants.
    pub fn act(&mut self, a: &Action) {
        self.act = ActionCounters {
            path_failures: self.path_failures(),
            ..ActionCounters::default()
        };
        match a {
            Action::Wait(c) => {
                let end = self.now + Duration::from_nanos(WAITS[usize::from(*c) % WAITS.len()]);
                self.run_until(end, MAX_STEPS_PER_ACTION);
            }
            Action::Data(d) => {
                let bytes = self.forge_data(d);
                self.inject(bytes, Ecn::from_bits(d.ecn));
            }
            Action::Ack(f) => {
                let bytes = self.forge_ack(f, false);
                self.inject(bytes, Ecn::NotEct);
            }
            Action::Close(c) => {
                let bytes = self.forge_close(c);
                self.inject(bytes, Ecn::NotEct);
            }
            Action::Coalesced(f, d) => {
                let mut bytes = self.forge_ack(f, true);
                if !bytes.is_empty() {
                    bytes.extend(self.forge_data(d));
                }
                self.inject(bytes, Ecn::from_bits(d.ecn));
            }
            Action::VictimPost(p) => self.post(true, *p),
            Action::PeerPost(p) => self.post(false, *p),
            Action::Drop { to_b, n } => {
                if *to_b {
                    self.drop_to_b = u32::from(*n);
                } else {
                    self.drop_to_a = u32::from(*n);
                }
            }
            Action::Replay { idx, patch } => {
                if !self.recent.is_empty() {
                    let i = usize::from(*idx) % self.recent.len();
                    let mut b = self.recent[i].clone();
                    patch.apply(&mut b);
                    self.inject(b, Ecn::NotEct);
                }
            }
            Action::Repeat { n, bump } => {
                for k in 1..=u32::from(n % (MAX_REPEAT + 1)) {
                    let Some(b) = self.bumped(*bump, k) else {
                        break;
                    };
                    let keep = self.last_forged.take();
                    self.inject(b, Ecn::NotEct);
                    self.last_forged = keep;
                }
            }
        }
        self.after_action();
        self.report.actions += 1;
    }

    fn after_action(&mut self) {
        self.fire_timers();
        self.flush();
        self.drain();
        self.top_up_receives();
        self.flush();
        self.check();
    }

    // --- invariants ------------------------------------------------------------

    /// The invariants checked after every action (module documentation).
    pub fn check(&mut self) {
        let act = self.act;
        let r = &mut self.report;
        r.max_victim_datagrams = r.max_victim_datagrams.max(act.b_datagrams);
        r.max_victim_bytes = r.max_victim_bytes.max(act.b_bytes);
        r.max_steps = r.max_steps.max(act.steps);
        if act.b_datagrams > MAX_VICTIM_DATAGRAMS_PER_ACTION {
            let failures = self.path_failures() - act.path_failures;
            panic!(
                "the victim sent {} datagrams in one action (paths declared failed \
                 meanwhile: {failures}; victim's connection 1: {:?})",
                act.b_datagrams,
                self.b.connection_stats(self.ids.conn_b1)
            );
        }
        assert!(act.steps <= MAX_STEPS_PER_ACTION);
        self.check_protected();
        let i = self.ids;
        for (who, ep, conn) in [("peer", &self.a, i.conn_a1), ("victim", &self.b, i.conn_b1)] {
            assert!(
                ep.connections().count() <= 2,
                "{who}: connections nobody opened"
            );
            if let Some(s) = ep.connection_stats(conn) {
                check_stats(who, ep.config(), &s);
            }
        }
        assert_eq!(
            self.a.connection_state(self.ids.conn_a2),
            Some(ConnectionState::Established),
            "the peer's connection 2"
        );
        assert_eq!(
            self.b.connection_state(self.ids.conn_b2),
            Some(ConnectionState::Established),
            "the victim's connection 2"
        );
        assert!(
            self.flights.len() <= 100_000,
            "{} datagrams in flight",
            self.flights.len()
        );
    }

    fn check_protected(&self) {
        for (lkey, bytes) in &self.protected {
            let now = self.b.mr(*lkey).expect("protected region still registered");
            if now != &bytes[..] {
                let at = now.iter().zip(bytes).position(|(x, y)| x != y).unwrap();
                panic!("a region the peer may not write changed (lkey {lkey:#x}, byte {at})");
            }
        }
    }

    // --- the end -----------------------------------------------------------------

    /// Lets connection 1's requests finish (or fail), then checks that every
    /// one completed, that the protected regions are intact, and that
    /// connection 2 carries a WRITE, a READ and a SEND byte-exact.
    pub fn finish(&mut self) {
        self.drop_to_a = 0;
        self.drop_to_b = 0;
        let deadline = self.now + SETTLE;
        // Per side, at the start of the current window: probes sent, path
        // failures of the connection, requests completed.
        let mark = |w: &World, victim: bool| {
            let (ep, conn, q) = if victim {
                (&w.b, w.ids.conn_b1, &w.sq_b)
            } else {
                (&w.a, w.ids.conn_a1, &w.sq_a)
            };
            let s = ep.connection_stats(conn);
            (
                s.as_ref().map_or(0, |s| s.probes_sent),
                s.map_or(0, |s| s.paths.iter().map(|p| p.failures).sum::<u64>()),
                q.completed,
            )
        };
        let mut since = self.now;
        let mut marks = [mark(self, false), mark(self, true)];
        while (!self.sq_a.pending.is_empty() || !self.sq_b.pending.is_empty())
            && self.now < deadline
        {
            self.act = ActionCounters::default();
            let end = (self.now + Duration::from_millis(100)).min(deadline);
            self.run_until(end, MAX_STEPS_PER_ACTION);
            self.after_action();
            if self.now.saturating_since(since) < STORM_WINDOW {
                continue;
            }
            // A request whose QP probes on and on without completing: the
            // probe schedule (PROTOCOL §11.6) allows `retry_cnt` probes at
            // doubling intervals, and each path's timeouts double too
            // (§13.3): a few dozen probes in a second, not hundreds.
            for victim in [false, true] {
                let (probes, failures, completed) = mark(self, victim);
                let (p0, f0, c0) = marks[usize::from(victim)];
                let pending = if victim { &self.sq_b } else { &self.sq_a };
                if probes.saturating_sub(p0) < PROBE_STORM
                    || completed > c0
                    || pending.pending.is_empty()
                {
                    continue;
                }
                let who = if victim { "victim" } else { "peer" };
                panic!(
                    "the {who} probes for ever without completing its requests: {} probes \
                     and {} path failures in 500 ms",
                    probes.saturating_sub(p0),
                    failures.saturating_sub(f0),
                );
            }
            since = self.now;
            marks = [mark(self, false), mark(self, true)];
        }
        assert!(
            self.sq_a.pending.is_empty() && self.sq_b.pending.is_empty(),
            "requests on connection 1 never completed: peer {:?} (qp {:?}, conn {:?}), \
             victim {:?} (qp {:?}, conn {:?})",
            self.sq_a.pending,
            self.a.qp_state(self.ids.qa1),
            self.a.connection_state(self.ids.conn_a1),
            self.sq_b.pending,
            self.b.qp_state(self.ids.qb1),
            self.b.connection_state(self.ids.conn_b1),
        );
        self.check_idle();
        for ep in [&self.a, &self.b] {
            for c in ep.connections() {
                if let Some(s) = ep.connection_stats(c) {
                    check_stats("either", ep.config(), &s);
                }
            }
        }
        self.check_protected();
        self.transfer_on_connection_2();
        let s = self.b.stats();
        self.report.victim_rejects = s.rejects.total();
        self.report.victim_bogus_acks = s.rejects.bogus_ack;
        self.report.conn1_state = self.b.connection_state(self.ids.conn_b1);
        self.report.sim_ns = self.now.as_nanos();
    }

    /// With no work left, the connections go quiet: after [`QUIET_AFTER`],
    /// each endpoint sends at most [`MAX_IDLE_DATAGRAMS`] datagrams in the
    /// next second (a failed path's probes back off to one per 500 ms).
    fn check_idle(&mut self) {
        self.act = ActionCounters::default();
        let end = self.now + QUIET_AFTER;
        self.run_until(end, MAX_STEPS_PER_ACTION);
        self.after_action();
        let before = [self.a.stats().datagrams_sent, self.b.stats().datagrams_sent];
        let failures = self.path_failures();
        self.act = ActionCounters::default();
        let end = self.now + Duration::from_secs(1);
        self.run_until(end, MAX_STEPS_PER_ACTION);
        self.after_action();
        for (i, (who, ep)) in [("peer", &self.a), ("victim", &self.b)]
            .into_iter()
            .enumerate()
        {
            let sent = ep.stats().datagrams_sent - before[i];
            if sent <= MAX_IDLE_DATAGRAMS {
                continue;
            }
            let failures = self.path_failures() - failures;
            panic!(
                "the {who} sent {sent} datagrams in one idle second (paths declared failed \
                 meanwhile: {failures})"
            );
        }
    }

    /// Times the paths of connection 1, either side, were declared failed.
    /// The state of the victim's QP on the attacked connection.
    pub fn victim_qp_state(&self) -> Option<QpState> {
        self.b.qp_state(self.ids.qb1)
    }

    fn path_failures(&self) -> u64 {
        [(&self.a, self.ids.conn_a1), (&self.b, self.ids.conn_b1)]
            .into_iter()
            .filter_map(|(ep, c)| ep.connection_stats(c))
            .map(|s| s.paths.iter().map(|p| p.failures).sum::<u64>())
            .sum()
    }

    fn transfer_on_connection_2(&mut self) {
        let i = self.ids;
        let (wlen, rlen, slen) = (6_000u32, 5_000u32, 1_000u32);
        let read_at: u32 = 8_192;
        let rbuf = self
            .a
            .reg_mr(
                i.pa,
                vec![0u8; slen as usize].into_boxed_slice(),
                0x7000_0000,
                AccessFlags::LOCAL_WRITE,
            )
            .unwrap();
        self.a
            .post_recv(
                i.qa2,
                RecvWr {
                    wr_id: 7,
                    sge: Sge {
                        lkey: rbuf.lkey,
                        addr: rbuf.addr,
                        len: slen,
                    }
                    .into(),
                },
            )
            .unwrap();
        let now = self.now;
        let wr = |id, op, mr: MrInfo, len| {
            SendWr::new(
                id,
                op,
                Sge {
                    lkey: mr.lkey,
                    addr: mr.addr,
                    len,
                },
            )
        };
        let remote = |at: u64| RemoteAddr {
            rkey: i.win2.rkey,
            addr: i.win2.addr + at,
        };
        self.a
            .post_send(now, i.qa2, wr(1, SendOp::Write(remote(0)), i.asrc2, wlen))
            .unwrap();
        self.a
            .post_send(
                now,
                i.qa2,
                wr(2, SendOp::Read(remote(u64::from(read_at))), i.adst2, rlen),
            )
            .unwrap();
        self.b
            .post_send(now, i.qb2, wr(3, SendOp::Send, i.bsrc2, slen))
            .unwrap();
        let (mut wa, mut wb) = (Vec::new(), Vec::new());
        for _ in 0..200 {
            self.act = ActionCounters::default();
            let end = self.now + Duration::from_millis(1);
            self.run_until(end, MAX_STEPS_PER_ACTION);
            self.a.poll_cq(i.cq_a2, 16, &mut wa).unwrap();
            self.b.poll_cq(i.cq_b2, 16, &mut wb).unwrap();
            if wa.len() >= 3 && !wb.is_empty() {
                break;
            }
        }
        let mut got: Vec<(u64, WcStatus)> = wa.iter().map(|w| (w.wr_id, w.status)).collect();
        got.sort_unstable_by_key(|g| g.0);
        assert_eq!(
            got,
            [
                (1, WcStatus::Success),
                (2, WcStatus::Success),
                (7, WcStatus::Success)
            ],
            "connection 2's WRITE, READ and receive"
        );
        assert_eq!(
            wb.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
            [(3, WcStatus::Success)],
            "connection 2's SEND"
        );
        let win2 = self.b.mr(i.win2.lkey).unwrap();
        let src = self.a.mr(i.asrc2.lkey).unwrap();
        assert!(win2[..wlen as usize] == src[..wlen as usize], "WRITE bytes");
        let init = &self
            .protected
            .iter()
            .find(|(k, _)| *k == i.win2.lkey)
            .unwrap()
            .1;
        assert!(
            win2[wlen as usize..] == init[wlen as usize..],
            "bytes past the WRITE"
        );
        let read = self.a.mr(i.adst2.lkey).unwrap();
        assert!(
            read[..rlen as usize] == init[read_at as usize..(read_at + rlen) as usize],
            "READ bytes"
        );
        let sent = self.b.mr(i.bsrc2.lkey).unwrap();
        assert!(
            self.a.mr(rbuf.lkey).unwrap() == &sent[..slen as usize],
            "SEND bytes"
        );
    }
}

/// Bounds of one connection's counters.
fn check_stats(who: &str, cfg: &EndpointConfig, s: &ConnectionStats) {
    assert!(
        s.paths.len() <= usize::from(cfg.paths),
        "{who}: {} paths",
        s.paths.len()
    );
    assert!(
        s.in_flight <= IN_FLIGHT_BOUND,
        "{who}: {} bytes in flight",
        s.in_flight
    );
    for p in &s.paths {
        assert!(
            p.in_flight <= u64::from(SACK_BITS) * MTU as u64,
            "{who}: path {} has {} bytes in flight",
            p.id,
            p.in_flight
        );
        assert!(
            p.cwnd <= cfg.max_window,
            "{who}: path {} window {}",
            p.id,
            p.cwnd
        );
        assert!(p.srtt_ns < 1_000_000_000, "{who}: path srtt {}", p.srtt_ns);
    }
    assert!(
        s.cwnd <= cfg.max_window * u64::from(cfg.paths),
        "{who}: window {}",
        s.cwnd
    );
    assert!(
        s.rto_ns <= cfg.max_rto.as_nanos() as u64,
        "{who}: rto {} ns",
        s.rto_ns
    );
    assert!(s.srtt_ns < 1_000_000_000, "{who}: srtt {} ns", s.srtt_ns);
}

/// The fuzz target: any bytes, read as actions ([`decode`]).
pub fn adversarial_peer(data: &[u8]) {
    run(&decode(data), None);
}

/// Runs `actions` against a fresh world and checks every invariant;
/// `heap`, when given, measures the thread's live heap bytes.
pub fn run(actions: &[Action], heap: Option<HeapProbe>) -> Report {
    let mut w = World::new(heap);
    let base = heap.map(|probe| HeapBase {
        probe,
        base: probe(),
    });
    for a in actions.iter().take(MAX_ACTIONS) {
        w.act(a);
        if let Some(h) = &base {
            let growth = (h.probe)() - h.base;
            w.report.peak_heap_growth = w.report.peak_heap_growth.max(growth);
            assert!(
                growth <= MAX_HEAP_GROWTH,
                "the heap grew by {growth} bytes over the set-up"
            );
        }
    }
    w.finish();
    w.report.clone()
}
