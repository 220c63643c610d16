//! DATA packets: every packet carries its own destination.
//!
//! Fixed part (40 bytes, after which the opcode extension and the payload follow):
//!
//! | offset | size | field | meaning |
//! |---|---|---|---|
//! | 0 | 1 | `version` | [`VERSION`](crate::consts::VERSION) |
//! | 1 | 1 | `type` | `0x01` |
//! | 2 | 1 | `opcode` | [`Opcode`] |
//! | 3 | 1 | `flags` | [`data_flags`] |
//! | 4 | 4 | `dst_cid` | receiver's connection id |
//! | 8 | 4 | `dst_qpn` | receiver's queue pair number (the stream) |
//! | 12 | 1 | `path_id` | sender's path index |
//! | 13 | 1 | `gen` | request generation (bumped on each RNR retry) |
//! | 14 | 2 | reserved | sent as 0, ignored |
//! | 16 | 4 | `psn` | per-path sequence number |
//! | 20 | 4 | `csn` | connection sequence number (kept across retransmissions) |
//! | 24 | 4 | `tx_ts` | sender timestamp, ns, truncated to 32 bits |
//! | 28 | 4 | `msn` | message sequence number within the stream |
//! | 32 | 4 | `msg_len` | total length of the message in bytes |
//! | 36 | 4 | `msg_offset` | offset of this payload inside the message |

use super::{
    check_len, check_out, expect_type, get_u32, get_u64, put_common, put_u32, put_u64, PacketType,
    WireError,
};
use crate::consts::{DATA_HEADER_LEN, SEGMENT_ALIGN, SEGMENT_UNIT};

/// Payload bytes of a full `opcode` segment on a path of `mtu` UDP payload
/// bytes: what its header leaves, rounded down to a multiple of
/// [`SEGMENT_ALIGN`] where the rounded size is at least [`SEGMENT_UNIT`] or
/// divides it. Messages come in multiples of that unit (4 KiB), and one
/// whose length is a multiple of the segment splits into full segments
/// only, so a UDP GSO batch of equal segments runs on across message
/// boundaries (4 KiB at the default MTU, for every opcode; 2 KiB on a path
/// that leaves 2,100 bytes). Below the unit, a rounded size that does not
/// divide it buys nothing, and the whole room goes: on a standard
/// 1,500-byte Ethernet path (1,472 bytes of UDP payload) a WRITE carries
/// 1,420 bytes, not 1,408.
///
/// ```
/// use metaroce_proto::consts::DEFAULT_MTU;
/// use metaroce_proto::wire::{segment_payload, Opcode};
/// assert_eq!(segment_payload(usize::from(DEFAULT_MTU), Opcode::Write), 4096);
/// assert_eq!(segment_payload(usize::from(DEFAULT_MTU), Opcode::WriteImm), 4096);
/// assert_eq!(segment_payload(1472, Opcode::Write), 1420);
/// assert_eq!(segment_payload(2152, Opcode::Write), 2048);
/// ```
pub fn segment_payload(mtu: usize, opcode: Opcode) -> usize {
    let room = mtu.saturating_sub(DATA_HEADER_LEN + opcode.ext_len());
    let aligned = room / SEGMENT_ALIGN * SEGMENT_ALIGN;
    if aligned >= SEGMENT_UNIT || (aligned > 0 && SEGMENT_UNIT % aligned == 0) {
        aligned
    } else {
        room
    }
}

/// Flag bits of a DATA packet (`flags` byte).
pub mod data_flags {
    /// The receiver should acknowledge this packet at once.
    pub const ACK_REQ: u8 = 0x01;
    /// This packet is a retransmission (informational).
    pub const RETRANSMIT: u8 = 0x02;
    /// The sender's IP layer marked it ECN-capable (informational).
    pub const ECT: u8 = 0x04;
}

/// The operation a DATA packet belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Opcode {
    /// Part of a SEND; matched to a posted receive by `recv_seq`.
    Send = 0x01,
    /// Part of a SEND with immediate data.
    SendImm = 0x02,
    /// Part of an RDMA WRITE; placed at `rkey`/`remote_addr + msg_offset`.
    Write = 0x03,
    /// Part of an RDMA WRITE with immediate; consumes a posted receive.
    WriteImm = 0x04,
    /// An RDMA READ request for `msg_len` bytes at `rkey`/`remote_addr`.
    ReadReq = 0x05,
    /// Part of the response to an RDMA READ, placed by `msn`/`msg_offset`.
    ReadResp = 0x06,
    /// Carries only a CSN: a retransmission whose request no longer exists.
    Nop = 0x07,
}

impl Opcode {
    /// Decodes an opcode byte.
    pub fn from_u8(v: u8) -> Result<Self, WireError> {
        Ok(match v {
            0x01 => Self::Send,
            0x02 => Self::SendImm,
            0x03 => Self::Write,
            0x04 => Self::WriteImm,
            0x05 => Self::ReadReq,
            0x06 => Self::ReadResp,
            0x07 => Self::Nop,
            other => return Err(WireError::UnknownOpcode(other)),
        })
    }

    /// Length of the extension that follows the fixed header for this opcode.
    pub fn ext_len(self) -> usize {
        match self {
            Self::Send => 4,
            Self::SendImm => 8,
            Self::Write | Self::ReadReq => 12,
            Self::WriteImm => 20,
            Self::ReadResp | Self::Nop => 0,
        }
    }

    /// Whether the packet may carry payload bytes.
    pub fn carries_payload(self) -> bool {
        !matches!(self, Self::ReadReq | Self::Nop)
    }

    /// The opcode of a message's packets after its first (PROTOCOL §5.3):
    /// SEND for SEND_IMM, WRITE for WRITE_IMM (the immediate data goes once,
    /// in the packet at offset 0); the opcode itself otherwise.
    ///
    /// ```
    /// use metaroce_proto::wire::Opcode;
    /// assert_eq!(Opcode::WriteImm.continuation(), Opcode::Write);
    /// assert_eq!(Opcode::SendImm.continuation(), Opcode::Send);
    /// assert_eq!(Opcode::Write.continuation(), Opcode::Write);
    /// ```
    pub fn continuation(self) -> Self {
        match self {
            Self::SendImm => Self::Send,
            Self::WriteImm => Self::Write,
            other => other,
        }
    }
}

/// The opcode-specific extension of a DATA header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpcodeExt {
    /// SEND: `recv_seq` (u32).
    Send {
        /// Index of the receive work request this message consumes.
        recv_seq: u32,
    },
    /// SEND_IMM: `recv_seq` (u32), `imm` (u32).
    SendImm {
        /// Index of the receive work request this message consumes.
        recv_seq: u32,
        /// Immediate data.
        imm: u32,
    },
    /// WRITE: `rkey` (u32), `remote_addr` (u64) of the message's first byte.
    Write {
        /// Remote key.
        rkey: u32,
        /// Remote virtual address of byte 0 of the message.
        remote_addr: u64,
    },
    /// WRITE_IMM: `rkey`, `remote_addr`, `recv_seq`, `imm`.
    WriteImm {
        /// Remote key.
        rkey: u32,
        /// Remote virtual address of byte 0 of the message.
        remote_addr: u64,
        /// Index of the receive work request this message consumes.
        recv_seq: u32,
        /// Immediate data.
        imm: u32,
    },
    /// READ_REQ: `rkey`, `remote_addr`; the length is `msg_len`.
    ReadReq {
        /// Remote key.
        rkey: u32,
        /// Remote virtual address to read from.
        remote_addr: u64,
    },
    /// READ_RESP: no extension.
    ReadResp,
    /// NOP: no extension.
    Nop,
}

impl OpcodeExt {
    /// The extension of a message's packets after its first
    /// ([`Opcode::continuation`]): without the immediate data.
    ///
    /// ```
    /// use metaroce_proto::wire::OpcodeExt;
    /// let first = OpcodeExt::WriteImm { rkey: 7, remote_addr: 64, recv_seq: 3, imm: 9 };
    /// assert_eq!(first.continuation(), OpcodeExt::Write { rkey: 7, remote_addr: 64 });
    /// ```
    pub fn continuation(self) -> Self {
        match self {
            Self::SendImm { recv_seq, .. } => Self::Send { recv_seq },
            Self::WriteImm {
                rkey, remote_addr, ..
            } => Self::Write { rkey, remote_addr },
            other => other,
        }
    }

    /// The opcode this extension belongs to.
    pub fn opcode(&self) -> Opcode {
        match self {
            Self::Send { .. } => Opcode::Send,
            Self::SendImm { .. } => Opcode::SendImm,
            Self::Write { .. } => Opcode::Write,
            Self::WriteImm { .. } => Opcode::WriteImm,
            Self::ReadReq { .. } => Opcode::ReadReq,
            Self::ReadResp => Opcode::ReadResp,
            Self::Nop => Opcode::Nop,
        }
    }
}

/// A validated DATA header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataHeader {
    /// Operation; must agree with `ext`.
    pub opcode: Opcode,
    /// [`data_flags`] bits.
    pub flags: u8,
    /// Receiver's connection id.
    pub dst_cid: u32,
    /// Receiver's QP number.
    pub dst_qpn: u32,
    /// Sender's path index (`< MAX_PATHS`).
    pub path_id: u8,
    /// Request generation (RNR retries).
    pub gen: u8,
    /// Per-path sequence number.
    pub psn: u32,
    /// Connection sequence number.
    pub csn: u32,
    /// Sender timestamp (ns, truncated).
    pub tx_ts: u32,
    /// Message sequence number in the stream.
    pub msn: u32,
    /// Total message length.
    pub msg_len: u32,
    /// Offset of this payload in the message.
    pub msg_offset: u32,
    /// Opcode-specific fields.
    pub ext: OpcodeExt,
}

impl DataHeader {
    /// Total header length (fixed part plus extension).
    pub fn header_len(&self) -> usize {
        DATA_HEADER_LEN + self.opcode.ext_len()
    }

    /// Parses a DATA packet; returns the header and the payload.
    ///
    /// Checks lengths, the opcode, the path id range, and that the payload
    /// lies inside the message (`msg_offset + payload <= msg_len`).
    pub fn parse(buf: &[u8]) -> Result<(Self, &[u8]), WireError> {
        expect_type(buf, PacketType::Data, DATA_HEADER_LEN)?;
        let opcode = Opcode::from_u8(buf[2])?;
        let hlen = DATA_HEADER_LEN + opcode.ext_len();
        check_len(buf, hlen)?;
        let path_id = buf[12];
        if usize::from(path_id) >= crate::consts::MAX_PATHS {
            return Err(WireError::InvalidField("path_id"));
        }
        let e = DATA_HEADER_LEN;
        let ext = match opcode {
            Opcode::Send => OpcodeExt::Send {
                recv_seq: get_u32(buf, e),
            },
            Opcode::SendImm => OpcodeExt::SendImm {
                recv_seq: get_u32(buf, e),
                imm: get_u32(buf, e + 4),
            },
            Opcode::Write => OpcodeExt::Write {
                rkey: get_u32(buf, e),
                remote_addr: get_u64(buf, e + 4),
            },
            Opcode::WriteImm => OpcodeExt::WriteImm {
                rkey: get_u32(buf, e),
                remote_addr: get_u64(buf, e + 4),
                recv_seq: get_u32(buf, e + 12),
                imm: get_u32(buf, e + 16),
            },
            Opcode::ReadReq => OpcodeExt::ReadReq {
                rkey: get_u32(buf, e),
                remote_addr: get_u64(buf, e + 4),
            },
            Opcode::ReadResp => OpcodeExt::ReadResp,
            Opcode::Nop => OpcodeExt::Nop,
        };
        let hdr = DataHeader {
            opcode,
            flags: buf[3],
            dst_cid: get_u32(buf, 4),
            dst_qpn: get_u32(buf, 8),
            path_id,
            gen: buf[13],
            psn: get_u32(buf, 16),
            csn: get_u32(buf, 20),
            tx_ts: get_u32(buf, 24),
            msn: get_u32(buf, 28),
            msg_len: get_u32(buf, 32),
            msg_offset: get_u32(buf, 36),
            ext,
        };
        let payload = &buf[hlen..];
        hdr.check_payload(payload.len())?;
        Ok((hdr, payload))
    }

    fn check_payload(&self, payload: usize) -> Result<(), WireError> {
        let out_of_message = WireError::PayloadOutOfMessage {
            payload,
            offset: self.msg_offset,
            msg_len: self.msg_len,
        };
        if !self.opcode.carries_payload() {
            if payload != 0 {
                return Err(out_of_message);
            }
            if self.msg_offset != 0 {
                return Err(WireError::InvalidField("msg_offset"));
            }
            return Ok(());
        }
        let end = u64::from(self.msg_offset) + payload as u64;
        if end > u64::from(self.msg_len) {
            return Err(out_of_message);
        }
        Ok(())
    }

    /// Writes the header followed by `payload` into `buf`; returns the packet length.
    pub fn emit(&self, buf: &mut [u8], payload: &[u8]) -> Result<usize, WireError> {
        let hlen = self.emit_header(buf, payload.len())?;
        buf[hlen..hlen + payload.len()].copy_from_slice(payload);
        Ok(hlen + payload.len())
    }

    /// Writes only the header into `buf`, for a payload of `payload_len` bytes
    /// that the caller places at `buf[header_len()..]` itself (so that payload
    /// can be copied straight from a memory region). Returns the header length.
    pub fn emit_header(&self, buf: &mut [u8], payload_len: usize) -> Result<usize, WireError> {
        if self.ext.opcode() != self.opcode {
            return Err(WireError::InvalidField("opcode"));
        }
        if usize::from(self.path_id) >= crate::consts::MAX_PATHS {
            return Err(WireError::InvalidField("path_id"));
        }
        self.check_payload(payload_len)?;
        let hlen = self.header_len();
        check_out(buf, hlen + payload_len)?;
        put_common(
            buf,
            PacketType::Data,
            self.opcode as u8,
            self.flags,
            self.dst_cid,
        );
        put_u32(buf, 8, self.dst_qpn);
        buf[12] = self.path_id;
        buf[13] = self.gen;
        buf[14] = 0;
        buf[15] = 0;
        put_u32(buf, 16, self.psn);
        put_u32(buf, 20, self.csn);
        put_u32(buf, 24, self.tx_ts);
        put_u32(buf, 28, self.msn);
        put_u32(buf, 32, self.msg_len);
        put_u32(buf, 36, self.msg_offset);
        let e = DATA_HEADER_LEN;
        match self.ext {
            OpcodeExt::Send { recv_seq } => put_u32(buf, e, recv_seq),
            OpcodeExt::SendImm { recv_seq, imm } => {
                put_u32(buf, e, recv_seq);
                put_u32(buf, e + 4, imm);
            }
            OpcodeExt::Write { rkey, remote_addr } | OpcodeExt::ReadReq { rkey, remote_addr } => {
                put_u32(buf, e, rkey);
                put_u64(buf, e + 4, remote_addr);
            }
            OpcodeExt::WriteImm {
                rkey,
                remote_addr,
                recv_seq,
                imm,
            } => {
                put_u32(buf, e, rkey);
                put_u64(buf, e + 4, remote_addr);
                put_u32(buf, e + 12, recv_seq);
                put_u32(buf, e + 16, imm);
            }
            OpcodeExt::ReadResp | OpcodeExt::Nop => {}
        }
        Ok(hlen)
    }

    /// Rewrites a DATA header already in `buf` (by
    /// [`emit_header`](Self::emit_header)) into the header of another
    /// segment of the same message on the same path: only the fields that
    /// differ from segment to segment (`psn`, `csn`, `msg_offset`) change.
    /// How a GSO batch's follow-on headers are made without encoding each
    /// from scratch. `buf` must hold at least the fixed part.
    pub(crate) fn patch_segment(buf: &mut [u8], psn: u32, csn: u32, msg_offset: u32) {
        put_u32(buf, 16, psn);
        put_u32(buf, 20, csn);
        put_u32(buf, 36, msg_offset);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(ext: OpcodeExt, len: u32) -> DataHeader {
        DataHeader {
            opcode: ext.opcode(),
            flags: data_flags::ACK_REQ,
            dst_cid: 0xdead_beef,
            dst_qpn: 17,
            path_id: 63,
            gen: 2,
            psn: u32::MAX,
            csn: 1,
            tx_ts: 99,
            msn: 5,
            msg_len: len,
            msg_offset: 0,
            ext,
        }
    }

    #[test]
    fn a_patched_header_is_the_header_of_that_segment() {
        for ext in [
            OpcodeExt::Write {
                rkey: 7,
                remote_addr: 1 << 40,
            },
            OpcodeExt::WriteImm {
                rkey: 7,
                remote_addr: 9,
                recv_seq: 3,
                imm: 4,
            },
            OpcodeExt::Send { recv_seq: 11 },
            OpcodeExt::ReadResp,
        ] {
            let first = sample(ext, 1 << 20);
            let mut buf = [0u8; 4200];
            let hlen = first.emit_header(&mut buf, 4096).unwrap();
            DataHeader::patch_segment(&mut buf, 0x0102_0304, 0xa0b0_c0d0, 8192);
            let want = DataHeader {
                psn: 0x0102_0304,
                csn: 0xa0b0_c0d0,
                msg_offset: 8192,
                ..first
            };
            let mut direct = [0u8; 4200];
            assert_eq!(want.emit_header(&mut direct, 4096).unwrap(), hlen);
            assert_eq!(buf[..hlen], direct[..hlen], "{ext:?}");
        }
    }

    #[test]
    fn full_segments_fit_every_mtu_with_every_opcode() {
        let (lo, hi) = (crate::consts::MIN_MTU, crate::consts::MAX_MTU);
        for mtu in usize::from(lo)..=usize::from(hi) {
            for o in (1..=7).map(|v| Opcode::from_u8(v).unwrap()) {
                let (h, p) = (DATA_HEADER_LEN + o.ext_len(), segment_payload(mtu, o));
                assert!(p > 0 && h + p <= mtu, "mtu {mtu} {o:?}");
                if h + p < mtu {
                    // Rounded down: by less than the alignment, to a
                    // multiple of it that is at least the unit messages
                    // come in or divides it.
                    assert_eq!(p % SEGMENT_ALIGN, 0, "mtu {mtu} {o:?}");
                    assert!(h + p + SEGMENT_ALIGN > mtu, "mtu {mtu} {o:?}");
                    assert!(
                        p >= SEGMENT_UNIT || SEGMENT_UNIT % p == 0,
                        "mtu {mtu} {o:?}"
                    );
                } else if p % SEGMENT_ALIGN != 0 {
                    // The whole room, unaligned: only below the unit.
                    assert!(p < SEGMENT_UNIT, "mtu {mtu} {o:?}");
                }
            }
        }
        // At the default MTU every opcode carries 4 KiB.
        for o in [
            Opcode::Send,
            Opcode::SendImm,
            Opcode::Write,
            Opcode::WriteImm,
        ] {
            assert_eq!(
                segment_payload(usize::from(crate::consts::DEFAULT_MTU), o),
                4096
            );
        }
        assert_eq!(
            segment_payload(usize::from(crate::consts::DEFAULT_MTU), Opcode::ReadResp),
            4096
        );
    }

    #[test]
    fn every_opcode_round_trips() {
        let exts = [
            OpcodeExt::Send { recv_seq: 3 },
            OpcodeExt::SendImm {
                recv_seq: 4,
                imm: 0x1234,
            },
            OpcodeExt::Write {
                rkey: 5,
                remote_addr: u64::MAX - 8,
            },
            OpcodeExt::WriteImm {
                rkey: 6,
                remote_addr: 7,
                recv_seq: 8,
                imm: 9,
            },
            OpcodeExt::ReadReq {
                rkey: 10,
                remote_addr: 11,
            },
            OpcodeExt::ReadResp,
            OpcodeExt::Nop,
        ];
        for ext in exts {
            let payload: &[u8] = if ext.opcode().carries_payload() {
                b"xyz"
            } else {
                b""
            };
            let h = sample(ext, 100);
            let mut buf = [0u8; 256];
            let n = h.emit(&mut buf, payload).unwrap();
            assert_eq!(n, h.header_len() + payload.len());
            let (p, pl) = DataHeader::parse(&buf[..n]).unwrap();
            assert_eq!(p, h);
            assert_eq!(pl, payload);
            // Every truncation is rejected.
            for cut in 0..h.header_len() {
                assert!(
                    DataHeader::parse(&buf[..cut]).is_err(),
                    "cut {cut} of {ext:?}"
                );
            }
        }
    }

    #[test]
    fn rejects_payload_outside_message() {
        let mut h = sample(
            OpcodeExt::Write {
                rkey: 1,
                remote_addr: 0,
            },
            10,
        );
        h.msg_offset = 8;
        let mut buf = [0u8; 128];
        assert!(matches!(
            h.emit(&mut buf, b"abc"),
            Err(WireError::PayloadOutOfMessage { .. })
        ));
        let n = h.emit(&mut buf, b"ab").unwrap();
        // Grow the datagram behind the header's back: the decoder must notice.
        buf[n] = 0;
        assert!(matches!(
            DataHeader::parse(&buf[..n + 1]),
            Err(WireError::PayloadOutOfMessage { .. })
        ));
    }

    #[test]
    fn rejects_bad_opcode_and_path() {
        let h = sample(OpcodeExt::Send { recv_seq: 0 }, 0);
        let mut buf = [0u8; 128];
        let n = h.emit(&mut buf, b"").unwrap();
        let mut bad = buf;
        bad[2] = 0x55;
        assert_eq!(
            DataHeader::parse(&bad[..n]),
            Err(WireError::UnknownOpcode(0x55))
        );
        let mut bad = buf;
        bad[12] = 64;
        assert_eq!(
            DataHeader::parse(&bad[..n]),
            Err(WireError::InvalidField("path_id"))
        );
        let mut bad = buf;
        bad[1] = PacketType::Ack as u8;
        assert_eq!(
            DataHeader::parse(&bad[..n]),
            Err(WireError::InvalidField("type"))
        );
    }

    #[test]
    fn read_request_carries_no_payload() {
        let h = sample(
            OpcodeExt::ReadReq {
                rkey: 1,
                remote_addr: 2,
            },
            1 << 30,
        );
        let mut buf = [0u8; 128];
        assert!(h.emit(&mut buf, b"x").is_err());
        let n = h.emit(&mut buf, b"").unwrap();
        assert!(DataHeader::parse(&buf[..n + 1]).is_err());
    }
}
