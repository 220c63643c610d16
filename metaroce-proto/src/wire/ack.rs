//! ACK packets: per-path cumulative point and 256-bit SACK, the connection's
//! CSN point, per-stream progress, NAKs, the receiver's rate hint and options.
//!
//! Fixed part (28 bytes):
//!
//! | offset | size | field | meaning |
//! |---|---|---|---|
//! | 0 | 8 | common header | type `0x02`; byte 2 `flags`, byte 3 reserved (`options_len` when coalesced) |
//! | 8 | 4 | `cum_csn` | every CSN before it has been received |
//! | 12 | 4 | `ts_echo` | `tx_ts` of the packet that triggered this ACK |
//! | 16 | 4 | `ack_delay_ns` | time the receiver held that packet before acking |
//! | 20 | 4 | `rate_hint_kbps` | receiver's grant for this sender (0: none) |
//! | 24 | 1 | `n_paths` | number of path entries |
//! | 25 | 1 | `n_streams` | number of stream entries |
//! | 26 | 1 | `n_naks` | number of NAK entries |
//! | 27 | 1 | `echo_path` | path id of the packet `ts_echo` came from |
//!
//! Then `n_paths` [`AckPathEntry`] (16 bytes plus the SACK bytes they carry,
//! at most 48 each), `n_streams`
//! [`AckStreamEntry`] (8 bytes each), `n_naks` [`NakEntry`] (12 bytes each),
//! then options as TLVs (`kind` u8, `len` u8, value) to the end of the datagram.
//! An option whose `kind` has the high bit set is critical: a receiver that
//! does not know it rejects the packet. Others are skipped.
//!
//! A **coalesced** ACK ([`ACK_FLAG_COALESCED`] in `flags`) has exactly byte 3
//! bytes of options, and a DATA packet of the same connection follows it in
//! the datagram ([`AckPacket::coalesced`]): an ACK riding on the data going
//! the other way.

use super::{
    check_len, check_out, expect_type, get_u16, get_u32, put_common, put_u16, put_u32, PacketType,
    WireError,
};
use crate::consts::{
    ACK_FLAG_COALESCED, ACK_HEADER_LEN, ACK_NAK_ENTRY_LEN, ACK_PATH_ENTRY_MIN_LEN,
    ACK_STREAM_ENTRY_LEN, MAX_OPTIONS_LEN, MAX_PATHS, SACK_BYTES,
};

/// The fixed fields of an ACK.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AckHeader {
    /// Flags byte: [`ACK_FLAG_COALESCED`], set by
    /// [`AckBuilder::finish_coalesced`]; other bits are sent as 0 and
    /// ignored.
    pub flags: u8,
    /// Destination connection id.
    pub dst_cid: u32,
    /// Every CSN before this one has been received.
    pub cum_csn: u32,
    /// `tx_ts` echoed from the packet that triggered this ACK.
    pub ts_echo: u32,
    /// Time between that packet's arrival and this ACK, ns.
    pub ack_delay_ns: u32,
    /// Receiver's rate grant for this sender in kbit/s; 0 means no limit.
    pub rate_hint_kbps: u32,
    /// Path id `ts_echo` came from.
    pub echo_path: u8,
}

/// Per-path acknowledgement state.
///
/// | offset | size | field |
/// |---|---|---|
/// | 0 | 1 | `path_id` |
/// | 1 | 1 | `flags` (sent as 0) |
/// | 2 | 1 | `sack_len`: bytes of the SACK bitvector that follow (0..=32) |
/// | 3 | 1 | reserved (sent as 0) |
/// | 4 | 4 | `ack_psn`: every PSN before it was received on this path |
/// | 8 | 4 | `rx_packets`: DATA packets received on this path (wrapping counter) |
/// | 12 | 4 | `ce_packets`: of them, CE-marked (wrapping counter; the ECN echo) |
/// | 16 | `sack_len` | `sack`: bit `i` (byte `i/8`, bit `i%8` from the LSB) set means PSN `ack_psn + 1 + i` was received; bytes beyond `sack_len` are zero |
///
/// The SACK is cut after its last non-zero byte, so the common entry of a
/// path whose packets all arrived in order takes 16 bytes instead of 48:
/// ACKs cost the reverse direction a third of the bytes they would.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AckPathEntry {
    /// The sender's path index.
    pub path_id: u8,
    /// Next PSN expected in order on the path.
    pub ack_psn: u32,
    /// Selective acknowledgement bits for `ack_psn + 1 ..= ack_psn + 256`.
    pub sack: [u8; SACK_BYTES],
    /// Packets received on the path so far.
    pub rx_packets: u32,
    /// CE-marked packets received on the path so far.
    pub ce_packets: u32,
}

impl AckPathEntry {
    /// Bytes of the SACK bitvector on the wire: up to its last non-zero byte.
    pub fn sack_len(&self) -> usize {
        self.sack.iter().rposition(|&b| b != 0).map_or(0, |i| i + 1)
    }

    /// Bytes this entry takes in an ACK.
    ///
    /// ```
    /// use metaroce_proto::wire::AckPathEntry;
    /// let mut e = AckPathEntry { path_id: 0, ack_psn: 7, sack: [0; 32], rx_packets: 7, ce_packets: 0 };
    /// assert_eq!(e.encoded_len(), 16, "in order: no SACK bytes");
    /// e.sack[2] = 0b100; // PSN 7 + 1 + 18 arrived, the ones before it did not
    /// assert_eq!(e.encoded_len(), 16 + 3);
    /// ```
    pub fn encoded_len(&self) -> usize {
        ACK_PATH_ENTRY_MIN_LEN + self.sack_len()
    }

    /// Whether PSN `ack_psn + 1 + i` is marked received.
    pub fn sack_bit(&self, i: u32) -> bool {
        let i = i as usize;
        i < SACK_BYTES * 8 && self.sack[i / 8] & (1 << (i % 8)) != 0
    }
}

/// Per-stream progress: every message before `msn_done` of the requester's
/// QP `qpn` has been executed by the responder (placed, consumed, or answered).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AckStreamEntry {
    /// QP number at the ACK's receiver (the requester).
    pub qpn: u32,
    /// First message not yet executed.
    pub msn_done: u32,
}

/// Why a request was refused ([`NakEntry::code`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum NakCode {
    /// Receiver not ready: no receive posted; retry after `rnr_timer_us`.
    Rnr = 1,
    /// Bad rkey, out-of-bounds address or missing access right.
    RemoteAccess = 2,
    /// A request the responder cannot carry out (too long for the receive buffer, bad opcode, ...).
    InvalidRequest = 3,
    /// The responder's QP is in the error state.
    RemoteOperation = 4,
}

impl NakCode {
    /// Decodes a NAK code.
    pub fn from_u8(v: u8) -> Result<Self, WireError> {
        Ok(match v {
            1 => Self::Rnr,
            2 => Self::RemoteAccess,
            3 => Self::InvalidRequest,
            4 => Self::RemoteOperation,
            _ => return Err(WireError::InvalidField("nak code")),
        })
    }
}

/// A negative acknowledgement of one message.
///
/// | offset | size | field |
/// |---|---|---|
/// | 0 | 4 | `qpn` (requester's) |
/// | 4 | 4 | `msn` |
/// | 8 | 1 | `code` |
/// | 9 | 1 | `gen` of the refused request |
/// | 10 | 2 | `rnr_timer_us` (RNR only) |
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NakEntry {
    /// QP number at the ACK's receiver.
    pub qpn: u32,
    /// Refused message.
    pub msn: u32,
    /// Reason.
    pub code: NakCode,
    /// Generation of the refused attempt.
    pub gen: u8,
    /// For RNR: how long to wait before retrying, µs.
    pub rnr_timer_us: u16,
}

/// One TLV option of an ACK.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AckOption<'a> {
    /// Option kind; high bit set means critical.
    pub kind: u8,
    /// Option value.
    pub value: &'a [u8],
}

/// A validated, zero-copy view of an ACK packet.
#[derive(Debug, Clone, Copy)]
pub struct AckPacket<'a> {
    buf: &'a [u8],
    header: AckHeader,
    n_paths: usize,
    /// Where the path entries end (they vary in length).
    paths_end: usize,
    n_streams: usize,
    n_naks: usize,
    /// Where the ACK ends: the datagram's end, or where the DATA packet
    /// coalesced with it starts.
    end: usize,
}

impl<'a> AckPacket<'a> {
    /// Validates an ACK: lengths, entry counts, path ids, NAK codes, options.
    ///
    /// `known_option` says which option kinds the caller understands; an
    /// unknown critical option rejects the packet. A coalesced ACK must be
    /// followed by at least one byte (the packet it rides on, which this
    /// does not check: see [`coalesced`](Self::coalesced)).
    pub fn parse(buf: &'a [u8], known_option: impl Fn(u8) -> bool) -> Result<Self, WireError> {
        expect_type(buf, PacketType::Ack, ACK_HEADER_LEN)?;
        let n_paths = usize::from(buf[24]);
        let n_streams = usize::from(buf[25]);
        let n_naks = usize::from(buf[26]);
        if n_paths > MAX_PATHS {
            return Err(WireError::InvalidField("n_paths"));
        }
        // Walk the path entries: each says how many SACK bytes it carries.
        let mut paths_end = ACK_HEADER_LEN;
        for _ in 0..n_paths {
            check_len(&buf[paths_end..], ACK_PATH_ENTRY_MIN_LEN)?;
            if usize::from(buf[paths_end]) >= MAX_PATHS {
                return Err(WireError::InvalidField("path_id"));
            }
            let sack_len = usize::from(buf[paths_end + 2]);
            if sack_len > SACK_BYTES {
                return Err(WireError::InvalidField("sack_len"));
            }
            check_len(&buf[paths_end..], ACK_PATH_ENTRY_MIN_LEN + sack_len)?;
            paths_end += ACK_PATH_ENTRY_MIN_LEN + sack_len;
        }
        let entries_end = paths_end + n_streams * ACK_STREAM_ENTRY_LEN + n_naks * ACK_NAK_ENTRY_LEN;
        check_len(buf, entries_end)?;
        // A coalesced ACK says where its options end; a packet follows.
        let end = if buf[2] & ACK_FLAG_COALESCED != 0 {
            let end = entries_end + usize::from(buf[3]);
            check_len(buf, end + 1)?;
            end
        } else {
            buf.len()
        };
        let header = AckHeader {
            flags: buf[2],
            dst_cid: get_u32(buf, 4),
            cum_csn: get_u32(buf, 8),
            ts_echo: get_u32(buf, 12),
            ack_delay_ns: get_u32(buf, 16),
            rate_hint_kbps: get_u32(buf, 20),
            echo_path: buf[27],
        };
        let pkt = AckPacket {
            buf,
            header,
            n_paths,
            paths_end,
            n_streams,
            n_naks,
            end,
        };
        let naks_at = pkt.naks_offset();
        for i in 0..n_naks {
            NakCode::from_u8(buf[naks_at + i * ACK_NAK_ENTRY_LEN + 8])?;
        }
        let opts = &buf[entries_end..end];
        if opts.len() > MAX_OPTIONS_LEN {
            return Err(WireError::InvalidField("options length"));
        }
        let mut at = 0;
        while at < opts.len() {
            check_len(&opts[at..], 2)?;
            let kind = opts[at];
            let len = usize::from(opts[at + 1]);
            check_len(&opts[at + 2..], len)?;
            if kind & 0x80 != 0 && !known_option(kind) {
                return Err(WireError::UnknownCriticalOption(kind));
            }
            at += 2 + len;
        }
        Ok(pkt)
    }

    fn streams_offset(&self) -> usize {
        self.paths_end
    }

    fn naks_offset(&self) -> usize {
        self.streams_offset() + self.n_streams * ACK_STREAM_ENTRY_LEN
    }

    fn options_offset(&self) -> usize {
        self.naks_offset() + self.n_naks * ACK_NAK_ENTRY_LEN
    }

    /// The fixed fields.
    pub fn header(&self) -> &AckHeader {
        &self.header
    }

    /// The ACK's own length: the datagram's, unless it is coalesced.
    pub fn ack_len(&self) -> usize {
        self.end
    }

    /// The bytes after a coalesced ACK: the DATA packet it rides on
    /// (`None` for an ACK alone in its datagram).
    ///
    /// ```
    /// use metaroce_proto::wire::{AckBuilder, AckHeader, AckPacket};
    /// let mut buf = [0u8; 64];
    /// let b = AckBuilder::new(&mut buf, AckHeader { dst_cid: 7, ..Default::default() }).unwrap();
    /// let n = b.finish_coalesced().unwrap();
    /// buf[n..n + 4].copy_from_slice(b"DATA");
    /// let ack = AckPacket::parse(&buf[..n + 4], |_| false).unwrap();
    /// assert_eq!(ack.ack_len(), n);
    /// assert_eq!(ack.coalesced(), Some(&b"DATA"[..]));
    /// ```
    pub fn coalesced(&self) -> Option<&'a [u8]> {
        let buf = self.buf;
        (self.end < buf.len()).then(|| &buf[self.end..])
    }

    /// The per-path entries.
    pub fn paths(&self) -> impl Iterator<Item = AckPathEntry> + 'a {
        let buf = self.buf;
        let mut at = ACK_HEADER_LEN;
        (0..self.n_paths).map(move |_| {
            // Lengths were validated in `parse`.
            let b = &buf[at..];
            let sack_len = usize::from(b[2]).min(SACK_BYTES);
            let mut sack = [0u8; SACK_BYTES];
            sack[..sack_len].copy_from_slice(&b[ACK_PATH_ENTRY_MIN_LEN..][..sack_len]);
            at += ACK_PATH_ENTRY_MIN_LEN + sack_len;
            AckPathEntry {
                path_id: b[0],
                ack_psn: get_u32(b, 4),
                sack,
                rx_packets: get_u32(b, 8),
                ce_packets: get_u32(b, 12),
            }
        })
    }

    /// The per-stream entries.
    pub fn streams(&self) -> impl Iterator<Item = AckStreamEntry> + 'a {
        let buf = self.buf;
        let at = self.streams_offset();
        (0..self.n_streams).map(move |i| {
            let b = &buf[at + i * ACK_STREAM_ENTRY_LEN..];
            AckStreamEntry {
                qpn: get_u32(b, 0),
                msn_done: get_u32(b, 4),
            }
        })
    }

    /// The NAK entries.
    pub fn naks(&self) -> impl Iterator<Item = NakEntry> + 'a {
        let buf = self.buf;
        let at = self.naks_offset();
        (0..self.n_naks).map(move |i| {
            let b = &buf[at + i * ACK_NAK_ENTRY_LEN..];
            NakEntry {
                qpn: get_u32(b, 0),
                msn: get_u32(b, 4),
                // Validated in `parse`.
                code: NakCode::from_u8(b[8]).unwrap_or(NakCode::InvalidRequest),
                gen: b[9],
                rnr_timer_us: get_u16(b, 10),
            }
        })
    }

    /// The options, in order.
    pub fn options(&self) -> impl Iterator<Item = AckOption<'a>> + 'a {
        let opts = &self.buf[self.options_offset()..self.end];
        let mut at = 0;
        core::iter::from_fn(move || {
            if at + 2 > opts.len() {
                return None;
            }
            let kind = opts[at];
            let len = usize::from(opts[at + 1]);
            let value = opts.get(at + 2..at + 2 + len)?;
            at += 2 + len;
            Some(AckOption { kind, value })
        })
    }
}

/// Writes an ACK into a caller-owned buffer, entry by entry, without allocating.
///
/// Entries must be added in order: paths, then streams, then NAKs, then options.
///
/// ```
/// use metaroce_proto::wire::{AckBuilder, AckHeader, AckPacket, AckPathEntry};
/// let mut buf = [0u8; 512];
/// let mut b = AckBuilder::new(&mut buf, AckHeader { dst_cid: 1, cum_csn: 10, ..Default::default() }).unwrap();
/// b.push_path(&AckPathEntry { path_id: 0, ack_psn: 4, sack: [0; 32], rx_packets: 4, ce_packets: 0 }).unwrap();
/// let n = b.finish();
/// let ack = AckPacket::parse(&buf[..n], |_| false).unwrap();
/// assert_eq!(ack.header().cum_csn, 10);
/// assert_eq!(ack.paths().next().unwrap().ack_psn, 4);
/// ```
#[derive(Debug)]
pub struct AckBuilder<'b> {
    buf: &'b mut [u8],
    len: usize,
    stage: u8,
    options_len: usize,
}

impl<'b> AckBuilder<'b> {
    /// Starts an ACK with the given fixed fields.
    pub fn new(buf: &'b mut [u8], h: AckHeader) -> Result<Self, WireError> {
        check_out(buf, ACK_HEADER_LEN)?;
        put_common(buf, PacketType::Ack, h.flags, 0, h.dst_cid);
        put_u32(buf, 8, h.cum_csn);
        put_u32(buf, 12, h.ts_echo);
        put_u32(buf, 16, h.ack_delay_ns);
        put_u32(buf, 20, h.rate_hint_kbps);
        buf[24] = 0;
        buf[25] = 0;
        buf[26] = 0;
        buf[27] = h.echo_path;
        Ok(AckBuilder {
            buf,
            len: ACK_HEADER_LEN,
            stage: 0,
            options_len: 0,
        })
    }

    /// Bytes left in the buffer.
    pub fn remaining(&self) -> usize {
        self.buf.len() - self.len
    }

    fn advance(
        &mut self,
        stage: u8,
        count_at: usize,
        entry_len: usize,
        limit: u8,
    ) -> Result<usize, WireError> {
        if self.stage > stage {
            return Err(WireError::InvalidField("entry order"));
        }
        if self.buf[count_at] == limit {
            return Err(WireError::InvalidField("entry count"));
        }
        check_out(&self.buf[self.len..], entry_len)?;
        self.stage = stage;
        self.buf[count_at] += 1;
        let at = self.len;
        self.len += entry_len;
        Ok(at)
    }

    /// Adds a path entry.
    pub fn push_path(&mut self, e: &AckPathEntry) -> Result<(), WireError> {
        if usize::from(e.path_id) >= MAX_PATHS {
            return Err(WireError::InvalidField("path_id"));
        }
        let sack_len = e.sack_len();
        let len = e.encoded_len();
        let at = self.advance(0, 24, len, MAX_PATHS as u8)?;
        let b = &mut self.buf[at..at + len];
        b[0] = e.path_id;
        b[1] = 0;
        b[2] = sack_len as u8;
        b[3] = 0;
        put_u32(b, 4, e.ack_psn);
        put_u32(b, 8, e.rx_packets);
        put_u32(b, 12, e.ce_packets);
        b[ACK_PATH_ENTRY_MIN_LEN..].copy_from_slice(&e.sack[..sack_len]);
        Ok(())
    }

    /// Adds a stream entry.
    pub fn push_stream(&mut self, e: &AckStreamEntry) -> Result<(), WireError> {
        let at = self.advance(1, 25, ACK_STREAM_ENTRY_LEN, u8::MAX)?;
        put_u32(self.buf, at, e.qpn);
        put_u32(self.buf, at + 4, e.msn_done);
        Ok(())
    }

    /// Adds a NAK entry.
    pub fn push_nak(&mut self, e: &NakEntry) -> Result<(), WireError> {
        let at = self.advance(2, 26, ACK_NAK_ENTRY_LEN, u8::MAX)?;
        put_u32(self.buf, at, e.qpn);
        put_u32(self.buf, at + 4, e.msn);
        self.buf[at + 8] = e.code as u8;
        self.buf[at + 9] = e.gen;
        put_u16(self.buf, at + 10, e.rnr_timer_us);
        Ok(())
    }

    /// Adds an option. Options take at most `MAX_OPTIONS_LEN` bytes in all.
    pub fn push_option(&mut self, kind: u8, value: &[u8]) -> Result<(), WireError> {
        let len =
            u8::try_from(value.len()).map_err(|_| WireError::InvalidField("option length"))?;
        if self.options_len + 2 + value.len() > MAX_OPTIONS_LEN {
            return Err(WireError::InvalidField("options length"));
        }
        self.options_len += 2 + value.len();
        check_out(&self.buf[self.len..], 2 + value.len())?;
        self.stage = 3;
        self.buf[self.len] = kind;
        self.buf[self.len + 1] = len;
        self.buf[self.len + 2..self.len + 2 + value.len()].copy_from_slice(value);
        self.len += 2 + value.len();
        Ok(())
    }

    /// Whether another entry of `entry_len` bytes fits.
    pub fn fits(&self, entry_len: usize) -> bool {
        self.remaining() >= entry_len
    }

    /// Number of entries of each kind so far: (paths, streams, naks).
    pub fn counts(&self) -> (u8, u8, u8) {
        (self.buf[24], self.buf[25], self.buf[26])
    }

    /// Finishes the ACK; returns its length. An ACK finished so is never
    /// coalesced ([`ACK_FLAG_COALESCED`] is cleared whatever the header
    /// said).
    pub fn finish(self) -> usize {
        self.buf[2] &= !ACK_FLAG_COALESCED;
        self.len
    }

    /// Finishes the ACK as a coalesced one, for a DATA packet to follow it
    /// in the same datagram: sets [`ACK_FLAG_COALESCED`] and writes the
    /// options' length into byte 3. Fails if the options take more than 255
    /// bytes (they cannot be delimited then).
    pub fn finish_coalesced(self) -> Result<usize, WireError> {
        let opts = u8::try_from(self.options_len)
            .map_err(|_| WireError::InvalidField("options length"))?;
        self.buf[2] |= ACK_FLAG_COALESCED;
        self.buf[3] = opts;
        Ok(self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn build(buf: &mut [u8]) -> usize {
        let mut b = AckBuilder::new(
            buf,
            AckHeader {
                flags: 0,
                dst_cid: 77,
                cum_csn: 1000,
                ts_echo: 5,
                ack_delay_ns: 600,
                rate_hint_kbps: 12_500_000,
                echo_path: 3,
            },
        )
        .unwrap();
        let mut sack = [0u8; SACK_BYTES];
        sack[0] = 0b101;
        sack[31] = 0x80;
        b.push_path(&AckPathEntry {
            path_id: 3,
            ack_psn: 10,
            sack,
            rx_packets: 20,
            ce_packets: 2,
        })
        .unwrap();
        b.push_path(&AckPathEntry {
            path_id: 4,
            ack_psn: 11,
            sack: [0; 32],
            rx_packets: 1,
            ce_packets: 0,
        })
        .unwrap();
        b.push_stream(&AckStreamEntry {
            qpn: 9,
            msn_done: 3,
        })
        .unwrap();
        b.push_nak(&NakEntry {
            qpn: 9,
            msn: 3,
            code: NakCode::Rnr,
            gen: 1,
            rnr_timer_us: 100,
        })
        .unwrap();
        b.push_option(0x01, b"hi").unwrap();
        b.finish()
    }

    #[test]
    fn round_trip() {
        let mut buf = [0u8; 512];
        let n = build(&mut buf);
        let a = AckPacket::parse(&buf[..n], |_| false).unwrap();
        assert_eq!(a.header().cum_csn, 1000);
        assert_eq!(a.header().rate_hint_kbps, 12_500_000);
        assert_eq!(a.header().echo_path, 3);
        let p: Vec<_> = a.paths().collect();
        assert_eq!(p.len(), 2);
        assert!(p[0].sack_bit(0) && !p[0].sack_bit(1) && p[0].sack_bit(2) && p[0].sack_bit(255));
        assert!(!p[0].sack_bit(256));
        assert_eq!(p[1].ack_psn, 11);
        assert_eq!(
            a.streams().collect::<Vec<_>>(),
            vec![AckStreamEntry {
                qpn: 9,
                msn_done: 3
            }]
        );
        let naks: Vec<_> = a.naks().collect();
        assert_eq!(naks[0].code, NakCode::Rnr);
        assert_eq!(naks[0].rnr_timer_us, 100);
        let opts: Vec<_> = a.options().collect();
        assert_eq!(
            opts,
            vec![AckOption {
                kind: 1,
                value: b"hi"
            }]
        );
        for cut in 0..n - 4 {
            assert!(
                AckPacket::parse(&buf[..cut], |_| false).is_err(),
                "cut {cut}"
            );
        }
    }

    #[test]
    fn critical_options_and_order() {
        let mut buf = [0u8; 512];
        let mut b = AckBuilder::new(&mut buf, AckHeader::default()).unwrap();
        b.push_stream(&AckStreamEntry {
            qpn: 1,
            msn_done: 1,
        })
        .unwrap();
        assert!(b
            .push_path(&AckPathEntry {
                path_id: 0,
                ack_psn: 0,
                sack: [0; 32],
                rx_packets: 0,
                ce_packets: 0
            })
            .is_err());
        b.push_option(0x81, &[]).unwrap();
        let n = b.finish();
        assert_eq!(
            AckPacket::parse(&buf[..n], |_| false).unwrap_err(),
            WireError::UnknownCriticalOption(0x81)
        );
        assert!(AckPacket::parse(&buf[..n], |k| k == 0x81).is_ok());
    }

    #[test]
    fn sack_is_cut_after_its_last_nonzero_byte() {
        let mut buf = [0u8; 512];
        let n = build(&mut buf);
        // Path 3's SACK ends in byte 31 (all 32 sent); path 4's is empty.
        assert_eq!(
            n,
            ACK_HEADER_LEN
                + 2 * ACK_PATH_ENTRY_MIN_LEN
                + SACK_BYTES
                + ACK_STREAM_ENTRY_LEN
                + ACK_NAK_ENTRY_LEN
                + 4
        );
        let mut sack = [0u8; SACK_BYTES];
        sack[1] = 0x40;
        let e = AckPathEntry {
            path_id: 1,
            ack_psn: 99,
            sack,
            rx_packets: 7,
            ce_packets: 1,
        };
        let mut b = AckBuilder::new(&mut buf, AckHeader::default()).unwrap();
        b.push_path(&e).unwrap();
        let n = b.finish();
        assert_eq!(n, ACK_HEADER_LEN + ACK_PATH_ENTRY_MIN_LEN + 2);
        let a = AckPacket::parse(&buf[..n], |_| false).unwrap();
        assert_eq!(a.paths().collect::<Vec<_>>(), vec![e]);
        // A length beyond the bitvector is refused, not read past.
        buf[ACK_HEADER_LEN + 2] = SACK_BYTES as u8 + 1;
        let mut long = buf;
        assert_eq!(
            AckPacket::parse(&long[..ACK_HEADER_LEN + 48 + 1], |_| false).unwrap_err(),
            WireError::InvalidField("sack_len")
        );
        // A length whose bytes are missing is truncation.
        long[ACK_HEADER_LEN + 2] = 20;
        assert!(matches!(
            AckPacket::parse(&long[..n], |_| false).unwrap_err(),
            WireError::Truncated { .. }
        ));
    }

    #[test]
    fn rejects_bad_nak_code() {
        let mut buf = [0u8; 512];
        let n = build(&mut buf);
        // Path 3 carries all 32 SACK bytes, path 4 none.
        let nak_code_at = ACK_HEADER_LEN
            + (ACK_PATH_ENTRY_MIN_LEN + SACK_BYTES)
            + ACK_PATH_ENTRY_MIN_LEN
            + ACK_STREAM_ENTRY_LEN
            + 8;
        buf[nak_code_at] = 0;
        assert_eq!(
            AckPacket::parse(&buf[..n], |_| false).unwrap_err(),
            WireError::InvalidField("nak code")
        );
    }
}
