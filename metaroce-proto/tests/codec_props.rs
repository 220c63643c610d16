//! Property tests of the wire codec (`metaroce_proto::wire`).
//!
//! For every packet type: encode → decode is the identity; decoding arbitrary
//! or mutated bytes never panics; every truncation of a valid packet is
//! either rejected or, where the format lets the datagram length delimit a
//! tail (DATA payload, ACK options), decodes to exactly the shorter tail.
//!
//! Deterministic: the proptest RNG is ChaCha with a fixed seed and failure
//! persistence is off, so CI runs the same cases every time. Override with
//! `PROPTEST_RNG_SEED=<u64>` / `PROPTEST_CASES=<n>` to explore further.

use metaroce_proto::consts::{
    ACK_FLAG_COALESCED, ACK_HEADER_LEN, ACK_NAK_ENTRY_LEN, ACK_PATH_ENTRY_MIN_LEN,
    ACK_STREAM_ENTRY_LEN, COOKIE_LEN, DATA_HEADER_LEN, HELLO_LEN, MAX_MTU, MAX_OPTIONS_LEN,
    MAX_PATHS, MAX_PLANES, MIN_MTU, SACK_BYTES, VERSION,
};
use metaroce_proto::wire::{
    self, Accept, AckBuilder, AckHeader, AckPacket, AckPathEntry, AckStreamEntry, Close, CloseCode,
    CookieReply, DataHeader, Hello, NakCode, NakEntry, OpcodeExt, PlaneAddrs, VersionNegotiation,
    WireError,
};
use proptest::prelude::*;
use proptest::test_runner::{RngAlgorithm, RngSeed};

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        rng_algorithm: RngAlgorithm::ChaCha,
        rng_seed: RngSeed::Fixed(0x6d65_7461_726f_6365),
        failure_persistence: None,
        max_shrink_iters: 2048,
        ..ProptestConfig::default()
    }
}

// ---------------------------------------------------------------------------
// Strategies.
// ---------------------------------------------------------------------------

fn ext_strategy() -> impl Strategy<Value = OpcodeExt> {
    prop_oneof![
        any::<u32>().prop_map(|recv_seq| OpcodeExt::Send { recv_seq }),
        (any::<u32>(), any::<u32>())
            .prop_map(|(recv_seq, imm)| OpcodeExt::SendImm { recv_seq, imm }),
        (any::<u32>(), any::<u64>())
            .prop_map(|(rkey, remote_addr)| OpcodeExt::Write { rkey, remote_addr }),
        (any::<u32>(), any::<u64>(), any::<u32>(), any::<u32>()).prop_map(
            |(rkey, remote_addr, recv_seq, imm)| OpcodeExt::WriteImm {
                rkey,
                remote_addr,
                recv_seq,
                imm
            }
        ),
        (any::<u32>(), any::<u64>())
            .prop_map(|(rkey, remote_addr)| OpcodeExt::ReadReq { rkey, remote_addr }),
        Just(OpcodeExt::ReadResp),
        Just(OpcodeExt::Nop),
    ]
}

/// A valid DATA header and payload: the payload lies inside the message.
fn data_strategy() -> impl Strategy<Value = (DataHeader, Vec<u8>)> {
    (
        ext_strategy(),
        any::<u8>(),
        any::<u32>(),
        any::<u32>(),
        0..MAX_PATHS as u8,
        any::<u8>(),
        (any::<u32>(), any::<u32>(), any::<u32>(), any::<u32>()),
        prop::collection::vec(any::<u8>(), 0..600),
        (any::<u32>(), any::<u32>()),
    )
        .prop_map(
            |(
                ext,
                flags,
                dst_cid,
                dst_qpn,
                path_id,
                gen,
                (psn, csn, tx_ts, msn),
                payload,
                (a, b),
            )| {
                let opcode = ext.opcode();
                let (payload, msg_offset, msg_len) = if opcode.carries_payload() {
                    let p = payload.len() as u64;
                    // msg_offset in 0..=MAX-p, msg_len in offset+p..=MAX.
                    let off = u64::from(a) % (u64::from(u32::MAX) - p + 1);
                    let len = off + p + u64::from(b) % (u64::from(u32::MAX) - off - p + 1);
                    (payload, off as u32, len as u32)
                } else {
                    (Vec::new(), 0, a)
                };
                (
                    DataHeader {
                        opcode,
                        flags,
                        dst_cid,
                        dst_qpn,
                        path_id,
                        gen,
                        psn,
                        csn,
                        tx_ts,
                        msn,
                        msg_len,
                        msg_offset,
                        ext,
                    },
                    payload,
                )
            },
        )
}

fn ack_header_strategy() -> impl Strategy<Value = AckHeader> {
    (
        any::<u8>(),
        any::<u32>(),
        any::<u32>(),
        any::<u32>(),
        any::<u32>(),
        any::<u32>(),
        any::<u8>(),
    )
        .prop_map(
            |(flags, dst_cid, cum_csn, ts_echo, ack_delay_ns, rate_hint_kbps, echo_path)| {
                AckHeader {
                    // The coalesced flag changes the layout: set only by
                    // `finish_coalesced` (see `coalesced_ack_round_trip`).
                    flags: flags & !ACK_FLAG_COALESCED,
                    dst_cid,
                    cum_csn,
                    ts_echo,
                    ack_delay_ns,
                    rate_hint_kbps,
                    echo_path,
                }
            },
        )
}

fn path_entry_strategy() -> impl Strategy<Value = AckPathEntry> {
    (
        0..MAX_PATHS as u8,
        any::<u32>(),
        any::<[u8; SACK_BYTES]>(),
        any::<u32>(),
        any::<u32>(),
    )
        .prop_map(
            |(path_id, ack_psn, sack, rx_packets, ce_packets)| AckPathEntry {
                path_id,
                ack_psn,
                sack,
                rx_packets,
                ce_packets,
            },
        )
}

fn nak_code_strategy() -> impl Strategy<Value = NakCode> {
    prop_oneof![
        Just(NakCode::Rnr),
        Just(NakCode::RemoteAccess),
        Just(NakCode::InvalidRequest),
        Just(NakCode::RemoteOperation),
    ]
}

fn nak_strategy() -> impl Strategy<Value = NakEntry> {
    (
        any::<u32>(),
        any::<u32>(),
        nak_code_strategy(),
        any::<u8>(),
        any::<u16>(),
    )
        .prop_map(|(qpn, msn, code, gen, rnr_timer_us)| NakEntry {
            qpn,
            msn,
            code,
            gen,
            rnr_timer_us,
        })
}

/// A whole ACK: its entries and options (total option bytes ≤ `MAX_OPTIONS_LEN`).
#[derive(Debug, Clone)]
struct AckModel {
    header: AckHeader,
    paths: Vec<AckPathEntry>,
    streams: Vec<AckStreamEntry>,
    naks: Vec<NakEntry>,
    options: Vec<(u8, Vec<u8>)>,
}

impl AckModel {
    /// A builder over `buf` with every entry and option pushed.
    fn build<'b>(&self, buf: &'b mut [u8]) -> AckBuilder<'b> {
        let mut b = AckBuilder::new(buf, self.header).unwrap();
        for p in &self.paths {
            b.push_path(p).unwrap();
        }
        for s in &self.streams {
            b.push_stream(s).unwrap();
        }
        for n in &self.naks {
            b.push_nak(n).unwrap();
        }
        for (k, v) in &self.options {
            b.push_option(*k, v).unwrap();
        }
        b
    }

    fn encode(&self) -> Vec<u8> {
        let mut buf = vec![0u8; 8192];
        let n = self.build(&mut buf).finish();
        buf.truncate(n);
        buf
    }

    fn entries_len(&self) -> usize {
        ACK_HEADER_LEN
            + self.paths.iter().map(|p| p.encoded_len()).sum::<usize>()
            + self.streams.len() * ACK_STREAM_ENTRY_LEN
            + self.naks.len() * ACK_NAK_ENTRY_LEN
    }

    fn critical_kinds(&self) -> Vec<u8> {
        self.options
            .iter()
            .map(|o| o.0)
            .filter(|k| k & 0x80 != 0)
            .collect()
    }
}

fn options_strategy() -> impl Strategy<Value = Vec<(u8, Vec<u8>)>> {
    prop::collection::vec(
        (any::<u8>(), prop::collection::vec(any::<u8>(), 0..40)),
        0..8,
    )
    .prop_map(|mut opts| {
        // Keep the options within MAX_OPTIONS_LEN, as a sender must.
        let mut total = 0;
        opts.retain(|(_, v)| {
            total += 2 + v.len();
            total <= MAX_OPTIONS_LEN
        });
        opts
    })
}

fn ack_strategy() -> impl Strategy<Value = AckModel> {
    (
        ack_header_strategy(),
        prop::collection::vec(path_entry_strategy(), 0..=MAX_PATHS),
        prop::collection::vec(
            (any::<u32>(), any::<u32>())
                .prop_map(|(qpn, msn_done)| AckStreamEntry { qpn, msn_done }),
            0..24,
        ),
        prop::collection::vec(nak_strategy(), 0..16),
        options_strategy(),
    )
        .prop_map(|(header, paths, streams, naks, options)| AckModel {
            header,
            paths,
            streams,
            naks,
            options,
        })
}

fn hello_strategy() -> impl Strategy<Value = Hello> {
    (
        1..=u32::MAX,
        any::<u16>(),
        MIN_MTU..=MAX_MTU,
        1..=MAX_PATHS as u8,
        any::<(bool, bool, bool)>(),
        any::<u16>(),
        prop::option::of(any::<[u8; COOKIE_LEN]>()),
    )
        .prop_map(
            |(
                src_cid,
                listen_port,
                mtu,
                max_paths,
                (grants, coalesce, crc32c),
                window_kib,
                cookie,
            )| {
                Hello {
                    src_cid,
                    listen_port,
                    mtu,
                    max_paths,
                    grants,
                    coalesce,
                    crc32c,
                    window_kib,
                    cookie,
                }
            },
        )
}

fn plane_ip_strategy() -> impl Strategy<Value = std::net::IpAddr> {
    prop_oneof![
        any::<[u8; 4]>().prop_map(std::net::IpAddr::from),
        any::<[u8; 16]>().prop_map(std::net::IpAddr::from),
    ]
}

fn accept_strategy() -> impl Strategy<Value = Accept> {
    (
        any::<u32>(),
        1..=u32::MAX,
        any::<u16>(),
        MIN_MTU..=MAX_MTU,
        1..=MAX_PATHS as u8,
        any::<(bool, bool, bool)>(),
        any::<u16>(),
    )
        .prop_map(
            |(
                dst_cid,
                src_cid,
                listen_port,
                mtu,
                max_paths,
                (grants, coalesce, crc32c),
                window_kib,
            )| {
                Accept {
                    dst_cid,
                    src_cid,
                    listen_port,
                    mtu,
                    max_paths,
                    grants,
                    coalesce,
                    crc32c,
                    window_kib,
                }
            },
        )
}

fn close_code_strategy() -> impl Strategy<Value = CloseCode> {
    prop_oneof![
        Just(CloseCode::Normal),
        Just(CloseCode::ProtocolViolation),
        Just(CloseCode::RetryExceeded),
        Just(CloseCode::Shutdown),
        Just(CloseCode::UnknownConnection),
    ]
}

/// Any valid packet of any type, encoded.
fn any_valid_packet() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        3 => data_strategy().prop_map(|(h, p)| {
            let mut buf = vec![0u8; h.header_len() + p.len()];
            h.emit(&mut buf, &p).unwrap();
            buf
        }),
        3 => ack_strategy().prop_map(|a| a.encode()),
        1 => hello_strategy().prop_map(|h| {
            let mut buf = vec![0u8; HELLO_LEN];
            h.emit(&mut buf).unwrap();
            buf
        }),
        1 => (any::<u32>(), any::<[u8; COOKIE_LEN]>()).prop_map(|(dst_cid, cookie)| {
            let mut buf = vec![0u8; CookieReply::LEN];
            CookieReply { dst_cid, cookie }.emit(&mut buf).unwrap();
            buf
        }),
        1 => accept_strategy().prop_map(|a| {
            let mut buf = vec![0u8; Accept::LEN];
            a.emit(&mut buf).unwrap();
            buf
        }),
        1 => (any::<u32>(), close_code_strategy()).prop_map(|(dst_cid, code)| {
            let mut buf = vec![0u8; Close::LEN];
            Close { dst_cid, code }.emit(&mut buf).unwrap();
            buf
        }),
        1 => any::<u32>().prop_map(|cid| {
            let mut buf = vec![0u8; 16];
            let n = VersionNegotiation::emit(cid, &mut buf).unwrap();
            buf.truncate(n);
            buf
        }),
    ]
}

/// A mutation of a byte string.
#[derive(Debug, Clone)]
enum Mutation {
    Flip { at: usize, bit: u8 },
    Set { at: usize, val: u8 },
    Truncate { len: usize },
    Extend { bytes: Vec<u8> },
    Insert { at: usize, val: u8 },
    Remove { at: usize },
}

fn mutation_strategy() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        4 => (any::<usize>(), 0u8..8).prop_map(|(at, bit)| Mutation::Flip { at, bit }),
        4 => (any::<usize>(), any::<u8>()).prop_map(|(at, val)| Mutation::Set { at, val }),
        1 => any::<usize>().prop_map(|len| Mutation::Truncate { len }),
        1 => prop::collection::vec(any::<u8>(), 1..64).prop_map(|bytes| Mutation::Extend { bytes }),
        1 => (any::<usize>(), any::<u8>()).prop_map(|(at, val)| Mutation::Insert { at, val }),
        1 => any::<usize>().prop_map(|at| Mutation::Remove { at }),
    ]
}

fn apply(buf: &mut Vec<u8>, m: &Mutation) {
    let n = buf.len();
    match m {
        Mutation::Flip { at, bit } if n > 0 => buf[at % n] ^= 1 << bit,
        Mutation::Set { at, val } if n > 0 => buf[at % n] = *val,
        Mutation::Truncate { len } => buf.truncate(len % (n + 1)),
        Mutation::Extend { bytes } => buf.extend_from_slice(bytes),
        Mutation::Insert { at, val } => buf.insert(at % (n + 1), *val),
        Mutation::Remove { at } if n > 0 => {
            buf.remove(at % n);
        }
        _ => {}
    }
}

// ---------------------------------------------------------------------------
// Decoding everything.
// ---------------------------------------------------------------------------

/// Runs every decoder on `buf` and walks every accessor; must never panic.
/// Also checks internal consistency of whatever decodes.
fn decode_all(buf: &[u8]) {
    let _ = wire::peek_type(buf);
    if let Ok(c) = wire::peek_common(buf) {
        assert_eq!(c.version, VERSION);
        assert_eq!(c.ptype as u8, buf[1]);
    }
    if let Ok((h, payload)) = DataHeader::parse(buf) {
        assert_eq!(h.ext.opcode(), h.opcode);
        assert_eq!(h.header_len() + payload.len(), buf.len());
        assert!(u64::from(h.msg_offset) + payload.len() as u64 <= u64::from(h.msg_len));
        // Re-encoding gives back the same bytes, except the reserved bytes 14..16.
        let mut out = vec![0u8; buf.len()];
        let n = h
            .emit(&mut out, payload)
            .expect("decoded header re-encodes");
        assert_eq!(n, buf.len());
        assert_eq!(&out[..14], &buf[..14]);
        assert_eq!(&out[16..], &buf[16..]);
    }
    for known in [false, true] {
        if let Ok(a) = AckPacket::parse(buf, |_| known) {
            let _ = a.header();
            let mut path_bytes = 0;
            let np = a
                .paths()
                .inspect(|p| {
                    assert!((p.path_id as usize) < MAX_PATHS);
                    // The decoded SACK is never longer than the bytes sent.
                    path_bytes += ACK_PATH_ENTRY_MIN_LEN + p.sack_len();
                })
                .count();
            assert!(np <= MAX_PATHS);
            let ns = a.streams().count();
            let nn = a.naks().count();
            let opt_bytes: usize = a.options().map(|o| 2 + o.value.len()).sum();
            let end =
                ACK_HEADER_LEN + path_bytes + ns * ACK_STREAM_ENTRY_LEN + nn * ACK_NAK_ENTRY_LEN;
            // The options cover the rest of the datagram, and the entries at
            // most what their lengths say (a SACK sent with trailing zero
            // bytes decodes to the same, shorter, bitvector).
            assert!(end + opt_bytes <= buf.len());
            if !known {
                assert!(a.options().all(|o| o.kind & 0x80 == 0));
            }
        }
    }
    let _ = Hello::parse(buf);
    let _ = CookieReply::parse(buf);
    let _ = Accept::parse(buf);
    let _ = Close::parse(buf);
    if let Ok(v) = VersionNegotiation::parse(buf) {
        assert!(VersionNegotiation::is(buf));
        let count = buf[8] as usize;
        assert_eq!(v.highest, *buf[9..9 + count].iter().max().unwrap());
    }
}

/// Whether any decoder accepts `buf`.
fn any_decoder_accepts(buf: &[u8]) -> bool {
    DataHeader::parse(buf).is_ok()
        || AckPacket::parse(buf, |_| true).is_ok()
        || Hello::parse(buf).is_ok()
        || CookieReply::parse(buf).is_ok()
        || Accept::parse(buf).is_ok()
        || Close::parse(buf).is_ok()
        || VersionNegotiation::parse(buf).is_ok()
}

// ---------------------------------------------------------------------------
// Properties.
// ---------------------------------------------------------------------------

proptest! {
    #![proptest_config(config(512))]

    #[test]
    fn data_round_trip((h, payload) in data_strategy()) {
        let mut buf = vec![0xa5u8; h.header_len() + payload.len() + 7];
        let n = h.emit(&mut buf, &payload).unwrap();
        prop_assert_eq!(n, h.header_len() + payload.len());
        prop_assert_eq!(h.header_len(), DATA_HEADER_LEN + h.opcode.ext_len());
        let (p, pl) = DataHeader::parse(&buf[..n]).unwrap();
        prop_assert_eq!(p, h);
        prop_assert_eq!(pl, &payload[..]);
        prop_assert_eq!(wire::peek_type(&buf[..n]).unwrap(), wire::PacketType::Data);
        prop_assert_eq!(wire::peek_common(&buf[..n]).unwrap().dst_cid, h.dst_cid);
        // emit_header + caller-placed payload gives the same bytes.
        let mut buf2 = vec![0u8; n];
        let hl = h.emit_header(&mut buf2, payload.len()).unwrap();
        buf2[hl..].copy_from_slice(&payload);
        prop_assert_eq!(&buf2[..], &buf[..n]);
        // No other decoder takes a DATA packet.
        prop_assert!(AckPacket::parse(&buf[..n], |_| true).is_err());
        prop_assert!(Hello::parse(&buf[..n]).is_err());
        prop_assert!(Close::parse(&buf[..n]).is_err());
        // Too small an output buffer is an error, never a panic.
        if n > 0 {
            let mut small = vec![0u8; n - 1];
            let short = matches!(h.emit(&mut small, &payload), Err(WireError::BufferTooSmall { .. }));
            prop_assert!(short);
        }
    }

    #[test]
    fn data_truncations((h, payload) in data_strategy()) {
        let mut buf = vec![0u8; h.header_len() + payload.len()];
        let n = h.emit(&mut buf, &payload).unwrap();
        for cut in 0..n {
            let r = DataHeader::parse(&buf[..cut]);
            if cut < h.header_len() {
                prop_assert!(r.is_err(), "cut {} of {:?} accepted", cut, h);
            } else {
                // The datagram delimits the payload: a shorter payload is a
                // shorter (still in-message) payload of the same header.
                let (p, pl) = r.unwrap();
                prop_assert_eq!(p, h);
                prop_assert_eq!(pl, &payload[..cut - h.header_len()]);
            }
        }
    }

    #[test]
    fn data_emit_refuses_invalid_headers(
        (h, payload) in data_strategy(),
        wrong in ext_strategy(),
        bad_path in (MAX_PATHS as u8)..=u8::MAX,
        extra in 1usize..64,
    ) {
        let mut buf = vec![0u8; 2048];
        if wrong.opcode() != h.opcode {
            let bad = DataHeader { ext: wrong, ..h };
            prop_assert!(bad.emit(&mut buf, &payload).is_err());
        }
        let bad = DataHeader { path_id: bad_path, ..h };
        prop_assert_eq!(bad.emit(&mut buf, &payload), Err(WireError::InvalidField("path_id")));
        // A payload that overflows the message is refused by the encoder too.
        let long = vec![0u8; (h.msg_len - h.msg_offset) as usize % 1024 + extra];
        if u64::from(h.msg_offset) + long.len() as u64 > u64::from(h.msg_len) {
            prop_assert!(h.emit(&mut buf, &long).is_err());
        }
    }

    #[test]
    fn ack_round_trip(a in ack_strategy()) {
        let buf = a.encode();
        prop_assert_eq!(buf.len(), a.entries_len() + a.options.iter().map(|o| 2 + o.1.len()).sum::<usize>());
        let crit = a.critical_kinds();
        let p = AckPacket::parse(&buf, |k| crit.contains(&k)).unwrap();
        prop_assert_eq!(*p.header(), a.header);
        prop_assert_eq!(p.paths().collect::<Vec<_>>(), a.paths.clone());
        prop_assert_eq!(p.streams().collect::<Vec<_>>(), a.streams.clone());
        prop_assert_eq!(p.naks().collect::<Vec<_>>(), a.naks.clone());
        let opts: Vec<(u8, Vec<u8>)> = p.options().map(|o| (o.kind, o.value.to_vec())).collect();
        prop_assert_eq!(opts, a.options.clone());
        for e in p.paths() {
            for i in 0..256u32 {
                let byte = e.sack[(i / 8) as usize];
                prop_assert_eq!(e.sack_bit(i), byte & (1 << (i % 8)) != 0);
            }
            prop_assert!(!e.sack_bit(256));
        }
        // An unknown critical option rejects the whole ACK.
        if let Some(&k) = crit.first() {
            prop_assert_eq!(
                AckPacket::parse(&buf, |_| false).unwrap_err(),
                WireError::UnknownCriticalOption(k)
            );
        } else {
            prop_assert!(AckPacket::parse(&buf, |_| false).is_ok());
        }
        prop_assert!(DataHeader::parse(&buf).is_err());
    }

    /// PROTOCOL §6.7: a coalesced ACK says where its options end, and the
    /// packet after it is handed back whole; cut anywhere before that
    /// packet's first byte, the datagram is refused.
    #[test]
    fn coalesced_ack_round_trip(a in ack_strategy(), data in prop::collection::vec(any::<u8>(), 1..64)) {
        let opts: usize = a.options.iter().map(|o| 2 + o.1.len()).sum();
        let mut buf = vec![0u8; 8192];
        let Ok(n) = a.build(&mut buf).finish_coalesced() else {
            // Only options past 255 bytes cannot be delimited.
            prop_assert!(opts > 255);
            return Ok(());
        };
        prop_assert!(opts <= 255);
        prop_assert_eq!(n, a.entries_len() + opts);
        buf.truncate(n);
        buf.extend_from_slice(&data);
        let crit = a.critical_kinds();
        let p = AckPacket::parse(&buf, |k| crit.contains(&k)).unwrap();
        prop_assert_eq!(p.header().flags & ACK_FLAG_COALESCED, ACK_FLAG_COALESCED);
        prop_assert_eq!(p.ack_len(), n);
        prop_assert_eq!(p.coalesced(), Some(&data[..]));
        prop_assert_eq!(p.paths().collect::<Vec<_>>(), a.paths.clone());
        prop_assert_eq!(p.streams().collect::<Vec<_>>(), a.streams.clone());
        prop_assert_eq!(p.naks().collect::<Vec<_>>(), a.naks.clone());
        let got: Vec<(u8, Vec<u8>)> = p.options().map(|o| (o.kind, o.value.to_vec())).collect();
        prop_assert_eq!(got, a.options.clone(), "the packet after the ACK is no option");
        for cut in 0..=n {
            prop_assert!(AckPacket::parse(&buf[..cut], |_| true).is_err(), "cut {} accepted", cut);
        }
        // A plain ACK is never coalesced.
        let plain = a.encode();
        prop_assert_eq!(AckPacket::parse(&plain, |_| true).map(|p| p.coalesced()), Ok(None));
        // ... even when its header asked for the flag: `finish` clears it.
        let flagged = AckModel {
            header: AckHeader {
                flags: a.header.flags | ACK_FLAG_COALESCED,
                ..a.header
            },
            ..a.clone()
        };
        prop_assert_eq!(flagged.encode(), plain);
    }

    #[test]
    fn ack_truncations(a in ack_strategy()) {
        let buf = a.encode();
        let entries = a.entries_len();
        // Option boundaries: the only lengths past the entries that decode.
        let mut boundaries = vec![entries];
        for (_, v) in &a.options {
            let last = *boundaries.last().unwrap();
            boundaries.push(last + 2 + v.len());
        }
        for cut in 0..buf.len() {
            let r = AckPacket::parse(&buf[..cut], |_| true);
            if cut < entries {
                prop_assert!(r.is_err(), "cut {} (entries end at {}) accepted", cut, entries);
            } else if let Some(i) = boundaries.iter().position(|&b| b == cut) {
                let p = r.unwrap();
                prop_assert_eq!(p.options().count(), i);
                prop_assert_eq!(p.naks().count(), a.naks.len());
            } else {
                prop_assert!(r.is_err(), "cut {} inside an option accepted", cut);
            }
        }
    }

    #[test]
    fn ack_builder_refuses_out_of_order_and_overflow(
        a in ack_strategy(),
        p in path_entry_strategy(),
        s in (any::<u32>(), any::<u32>()),
        n in nak_strategy(),
        bad_path in (MAX_PATHS as u8)..=u8::MAX,
    ) {
        let s = AckStreamEntry { qpn: s.0, msn_done: s.1 };
        let mut buf = vec![0u8; 8192];
        let mut b = AckBuilder::new(&mut buf, a.header).unwrap();
        let bad = AckPathEntry { path_id: bad_path, ..p };
        prop_assert!(b.push_path(&bad).is_err());
        b.push_stream(&s).unwrap();
        prop_assert!(b.push_path(&p).is_err());
        b.push_nak(&n).unwrap();
        prop_assert!(b.push_stream(&s).is_err());
        prop_assert!(b.push_path(&p).is_err());
        b.push_option(1, &[]).unwrap();
        prop_assert!(b.push_nak(&n).is_err());
        prop_assert!(b.push_option(1, &[0u8; 256]).is_err());
        prop_assert_eq!(b.counts(), (0, 1, 1));
        let len = b.finish();
        prop_assert!(AckPacket::parse(&buf[..len], |_| false).is_ok());
        // Path entries stop at MAX_PATHS.
        let mut b = AckBuilder::new(&mut buf, a.header).unwrap();
        for _ in 0..MAX_PATHS {
            b.push_path(&p).unwrap();
        }
        prop_assert!(b.push_path(&p).is_err());
        // A buffer too small for the fixed part or an entry is an error.
        let mut tiny = vec![0u8; ACK_HEADER_LEN - 1];
        prop_assert!(AckBuilder::new(&mut tiny, a.header).is_err());
        let mut small = vec![0u8; ACK_HEADER_LEN + p.encoded_len() - 1];
        let mut b = AckBuilder::new(&mut small, a.header).unwrap();
        prop_assert!(!b.fits(p.encoded_len()));
        prop_assert!(b.push_path(&p).is_err());
    }

    #[test]
    fn hello_round_trip_and_truncations(h in hello_strategy()) {
        let mut buf = vec![0xffu8; HELLO_LEN + 10];
        let n = h.emit(&mut buf).unwrap();
        prop_assert_eq!(n, HELLO_LEN);
        prop_assert_eq!(Hello::parse(&buf[..n]).unwrap(), h);
        prop_assert_eq!(&buf[18..20], &h.window_kib.to_be_bytes()[..], "the window, big-endian");
        prop_assert!(buf[36..HELLO_LEN].iter().all(|&b| b == 0));
        if h.cookie.is_none() {
            prop_assert!(buf[20..36].iter().all(|&b| b == 0));
        }
        for cut in 0..n {
            prop_assert!(Hello::parse(&buf[..cut]).is_err(), "cut {}", cut);
        }
        prop_assert_eq!(wire::peek_common(&buf[..n]).unwrap().dst_cid, 0);
        // Stays a HELLO with trailing bytes (the length is a minimum).
        prop_assert_eq!(Hello::parse(&buf[..n + 10]).unwrap(), h);
    }

    #[test]
    fn hello_with_planes_round_trip_and_truncations(
        h in hello_strategy(),
        ips in prop::collection::vec(plane_ip_strategy(), 1..MAX_PLANES),
    ) {
        let planes = PlaneAddrs::new(&ips).unwrap();
        let mut buf = vec![0u8; HELLO_LEN + planes.encoded_len()];
        let n = h.emit(&mut buf).unwrap();
        let m = planes.emit(&mut buf[n..]).unwrap();
        prop_assert_eq!(m, planes.encoded_len());
        let all = &buf[..n + m];
        // An old decoder's view: the HELLO itself, extension ignored.
        prop_assert_eq!(Hello::parse(all).unwrap(), h);
        let parsed = PlaneAddrs::parse(&all[HELLO_LEN..]).unwrap();
        prop_assert_eq!(parsed.as_slice(), &ips[..]);
        // Any cut inside the extension is an error, never a shorter list.
        for cut in HELLO_LEN + 1..n + m {
            prop_assert!(PlaneAddrs::parse(&all[HELLO_LEN..cut]).is_err(), "cut {}", cut);
        }
    }

    #[test]
    fn plane_trailer_never_panics(t in prop::collection::vec(any::<u8>(), 0..200)) {
        if let Ok(p) = PlaneAddrs::parse(&t) {
            let mut out = vec![0u8; p.encoded_len()];
            let n = p.emit(&mut out).unwrap();
            prop_assert_eq!(&out[..n], &t[..n]);
        }
    }

    #[test]
    fn cookie_round_trip_and_truncations(dst_cid in any::<u32>(), cookie in any::<[u8; COOKIE_LEN]>()) {
        let c = CookieReply { dst_cid, cookie };
        let mut buf = vec![0u8; 64];
        let n = c.emit(&mut buf).unwrap();
        prop_assert_eq!(n, CookieReply::LEN);
        prop_assert!(n <= HELLO_LEN);
        prop_assert_eq!(CookieReply::parse(&buf[..n]).unwrap(), c);
        for cut in 0..n {
            prop_assert!(CookieReply::parse(&buf[..cut]).is_err(), "cut {}", cut);
        }
    }

    #[test]
    fn accept_round_trip_and_truncations(a in accept_strategy()) {
        let mut buf = vec![0xffu8; 64];
        let n = a.emit(&mut buf).unwrap();
        prop_assert_eq!(n, Accept::LEN);
        prop_assert_eq!(Accept::parse(&buf[..n]).unwrap(), a);
        prop_assert_eq!(
            buf[17],
            u8::from(a.grants) | u8::from(a.coalesce) << 1 | u8::from(a.crc32c) << 2,
            "caps byte: the grants, coalescing and CRC32C bits"
        );
        prop_assert_eq!(&buf[18..20], &a.window_kib.to_be_bytes()[..], "the window, big-endian");
        for cut in 0..n {
            prop_assert!(Accept::parse(&buf[..cut]).is_err(), "cut {}", cut);
        }
    }

    #[test]
    fn close_round_trip_and_truncations(dst_cid in any::<u32>(), code in close_code_strategy(), bad in 5u32..) {
        let c = Close { dst_cid, code };
        let mut buf = vec![0u8; 64];
        let n = c.emit(&mut buf).unwrap();
        prop_assert_eq!(n, Close::LEN);
        prop_assert_eq!(Close::parse(&buf[..n]).unwrap(), c);
        for cut in 0..n {
            prop_assert!(Close::parse(&buf[..cut]).is_err(), "cut {}", cut);
        }
        buf[8..12].copy_from_slice(&bad.to_be_bytes());
        prop_assert_eq!(Close::parse(&buf[..n]), Err(WireError::InvalidField("close code")));
    }

    #[test]
    fn version_negotiation_round_trip_and_truncations(
        dst_cid in any::<u32>(),
        versions in prop::collection::vec(any::<u8>(), 1..20),
    ) {
        let mut buf = vec![0u8; 16];
        let n = VersionNegotiation::emit(dst_cid, &mut buf).unwrap();
        prop_assert_eq!(
            VersionNegotiation::parse(&buf[..n]).unwrap(),
            VersionNegotiation { dst_cid, supports_ours: true, highest: VERSION }
        );
        for cut in 0..n {
            prop_assert!(VersionNegotiation::parse(&buf[..cut]).is_err(), "cut {}", cut);
        }
        // A server's list of any versions.
        let mut vn = vec![0u8, 0x1f, 0, 0];
        vn.extend_from_slice(&dst_cid.to_be_bytes());
        vn.push(versions.len() as u8);
        vn.extend_from_slice(&versions);
        let v = VersionNegotiation::parse(&vn).unwrap();
        prop_assert_eq!(v.dst_cid, dst_cid);
        prop_assert_eq!(v.supports_ours, versions.contains(&VERSION));
        prop_assert_eq!(v.highest, *versions.iter().max().unwrap());
        for cut in 0..vn.len() {
            prop_assert!(VersionNegotiation::parse(&vn[..cut]).is_err(), "cut {}", cut);
        }
        // The version-independent check comes before the version byte.
        prop_assert!(wire::peek_common(&vn).is_err());
    }

    #[test]
    fn handshake_decoders_reject_bad_fields(
        h in hello_strategy(),
        a in accept_strategy(),
        bad_mtu in prop_oneof![0..MIN_MTU, (MAX_MTU + 1)..=u16::MAX],
        bad_paths in prop_oneof![Just(0u8), (MAX_PATHS as u8 + 1)..=u8::MAX],
    ) {
        let mut buf = vec![0u8; HELLO_LEN];
        h.emit(&mut buf).unwrap();
        for (field, patch) in [
            ("src_cid", Hello { src_cid: 0, ..h }),
            ("mtu", Hello { mtu: bad_mtu, ..h }),
            ("max_paths", Hello { max_paths: bad_paths, ..h }),
        ] {
            patch.emit(&mut buf).unwrap();
            prop_assert_eq!(Hello::parse(&buf), Err(WireError::InvalidField(field)));
        }
        let mut buf = vec![0u8; Accept::LEN];
        for (field, patch) in [
            ("src_cid", Accept { src_cid: 0, ..a }),
            ("mtu", Accept { mtu: bad_mtu, ..a }),
            ("max_paths", Accept { max_paths: bad_paths, ..a }),
        ] {
            patch.emit(&mut buf).unwrap();
            prop_assert_eq!(Accept::parse(&buf), Err(WireError::InvalidField(field)));
        }
    }
}

proptest! {
    #![proptest_config(config(2048))]

    #[test]
    fn arbitrary_bytes_never_panic(buf in prop::collection::vec(any::<u8>(), 0..3500)) {
        decode_all(&buf);
    }

    /// Arbitrary bodies behind a plausible common header, so the decoders get
    /// past the version and type checks.
    #[test]
    fn arbitrary_bodies_never_panic(
        ptype in prop::sample::select(vec![0x01u8, 0x02, 0x10, 0x11, 0x12, 0x13, 0x1f]),
        b2 in any::<u8>(),
        counts in (0u8..70, 0u8..8, 0u8..8),
        body in prop::collection::vec(any::<u8>(), 0..4000),
    ) {
        let mut buf = vec![VERSION, ptype, b2, 0, 0, 0, 0, 1];
        buf.extend_from_slice(&body);
        if ptype == 0x02 && buf.len() >= ACK_HEADER_LEN {
            buf[24] = counts.0;
            buf[25] = counts.1;
            buf[26] = counts.2;
        }
        if ptype == 0x1f {
            buf[0] = 0;
        }
        decode_all(&buf);
    }

    #[test]
    fn mutated_packets_never_panic(
        pkt in any_valid_packet(),
        muts in prop::collection::vec(mutation_strategy(), 1..6),
    ) {
        decode_all(&pkt);
        prop_assert!(any_decoder_accepts(&pkt));
        let mut m = pkt.clone();
        for mu in &muts {
            apply(&mut m, mu);
            decode_all(&m);
        }
    }

    #[test]
    fn single_bit_flips_of_a_data_header_never_panic((h, payload) in data_strategy(), bit in 0usize..(60 * 8)) {
        let mut buf = vec![0u8; h.header_len() + payload.len()];
        h.emit(&mut buf, &payload).unwrap();
        let at = bit / 8;
        if at < buf.len() {
            buf[at] ^= 1 << (bit % 8);
        }
        decode_all(&buf);
    }
}

/// Exhaustive: every one- and two-byte datagram, and every short prefix of a
/// zero-filled buffer with each type byte.
#[test]
fn tiny_datagrams_are_rejected() {
    for a in 0..=255u8 {
        assert!(!any_decoder_accepts(&[a]));
        for b in 0..=255u8 {
            decode_all(&[a, b]);
            assert!(!any_decoder_accepts(&[a, b]));
        }
    }
    for t in 0..=255u8 {
        for len in 0..(DATA_HEADER_LEN + 4) {
            let mut buf = vec![0u8; len];
            if len > 1 {
                buf[0] = VERSION;
                buf[1] = t;
            }
            decode_all(&buf);
        }
    }
}

// ---------------------------------------------------------------------------
// Encoder/decoder disagreements (see the report for details).
// ---------------------------------------------------------------------------

/// PROTOCOL.md §6.5: at most `MAX_OPTIONS_LEN` bytes of options follow the
/// entries, and the decoder enforces it; the builder should refuse to write
/// more, not produce an ACK its own decoder drops.
#[test]

fn ack_builder_output_always_parses() {
    let mut buf = vec![0u8; 2048];
    let mut b = AckBuilder::new(&mut buf, AckHeader::default()).unwrap();
    let mut pushed = 0;
    for _ in 0..3 {
        if b.push_option(1, &[0u8; 100]).is_ok() {
            pushed += 102;
        }
    }
    let n = b.finish();
    assert!(
        AckPacket::parse(&buf[..n], |_| false).is_ok(),
        "builder accepted {pushed} option bytes (> {MAX_OPTIONS_LEN}) but the parser rejects the ACK"
    );
}

/// PROTOCOL.md §7.1: `listen_port` is the UDP port the client receives on,
/// "non-zero"; the decoder accepts 0 and the server then addresses its
/// COOKIE/ACCEPT to port 0.
#[test]

fn hello_with_listen_port_zero_is_rejected() {
    let h = Hello {
        src_cid: 1,
        listen_port: 0,
        mtu: 1500,
        max_paths: 1,
        grants: false,
        coalesce: false,
        crc32c: false,
        window_kib: 0,
        cookie: None,
    };
    let mut buf = [0u8; HELLO_LEN];
    h.emit(&mut buf).unwrap();
    assert!(Hello::parse(&buf).is_err());
}
