//! The wire format: one file per header kind, in the style of smoltcp.
//!
//! Every packet starts with the [common header](CommonHeader): version, type,
//! a type-specific flags byte and the destination connection id. All integers
//! are big-endian (network byte order). `docs/PROTOCOL.md` is the specification;
//! field names here are the spec's.
//!
//! Decoding never panics and never trusts a length: every `parse` checks the
//! buffer before it reads, and returns a [`WireError`] naming what was wrong.
//!
//! ```
//! use metaroce_proto::wire::{self, DataHeader, Opcode, OpcodeExt};
//!
//! let hdr = DataHeader {
//!     opcode: Opcode::Write,
//!     flags: 0,
//!     dst_cid: 7,
//!     dst_qpn: 3,
//!     path_id: 1,
//!     gen: 0,
//!     psn: 100,
//!     csn: 5,
//!     tx_ts: 42,
//!     msn: 0,
//!     msg_len: 4,
//!     msg_offset: 0,
//!     ext: OpcodeExt::Write { rkey: 9, remote_addr: 0x1000 },
//! };
//! let mut buf = [0u8; 128];
//! let n = hdr.emit(&mut buf, b"abcd").unwrap();
//! let (parsed, payload) = DataHeader::parse(&buf[..n]).unwrap();
//! assert_eq!(parsed, hdr);
//! assert_eq!(payload, b"abcd");
//! assert_eq!(wire::peek_type(&buf[..n]).unwrap(), wire::PacketType::Data);
//! ```

mod ack;
mod data;
mod handshake;
pub mod seq;

pub use ack::{
    AckBuilder, AckHeader, AckOption, AckPacket, AckPathEntry, AckStreamEntry, NakCode, NakEntry,
};
pub use data::{data_flags, segment_payload, DataHeader, Opcode, OpcodeExt};
pub use handshake::{
    Accept, Close, CloseCode, CookieReply, Hello, PlaneAddrs, SecurityExt, VersionNegotiation,
    EXT_PLANES, EXT_SECURITY, SUITE_AES_128_GCM,
};

use crate::consts::{COMMON_HEADER_LEN, VERSION};

/// Why a datagram could not be decoded. Each variant is counted by the endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// The datagram is shorter than the header it claims to carry.
    #[error("truncated packet: need {need} bytes, have {have}")]
    Truncated {
        /// Bytes the header needs.
        need: usize,
        /// Bytes present.
        have: usize,
    },
    /// The version byte is not one this implementation speaks.
    #[error("unsupported protocol version {0}")]
    UnsupportedVersion(u8),
    /// The packet type byte is unknown.
    #[error("unknown packet type {0:#04x}")]
    UnknownType(u8),
    /// A DATA packet's opcode is unknown.
    #[error("unknown opcode {0:#04x}")]
    UnknownOpcode(u8),
    /// A field holds a value the specification forbids.
    #[error("invalid field `{0}`")]
    InvalidField(&'static str),
    /// The payload does not fit the message it claims to belong to.
    #[error("payload of {payload} bytes at offset {offset} exceeds message length {msg_len}")]
    PayloadOutOfMessage {
        /// Payload bytes.
        payload: usize,
        /// Offset in the message.
        offset: u32,
        /// Message length.
        msg_len: u32,
    },
    /// The caller's output buffer is too small for the packet.
    #[error("output buffer too small: need {need} bytes, have {have}")]
    BufferTooSmall {
        /// Bytes needed.
        need: usize,
        /// Bytes available.
        have: usize,
    },
    /// A critical option (high bit of its type set) is not understood.
    #[error("unknown critical option {0:#04x}")]
    UnknownCriticalOption(u8),
}

/// Packet types (`type` byte of the common header).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum PacketType {
    /// Request or response data of a queue pair.
    Data = 0x01,
    /// Acknowledgement: per-path SACK, CSN point, stream progress, NAKs.
    Ack = 0x02,
    /// Connection request from a client.
    Hello = 0x10,
    /// A server's stateless cookie reply to a HELLO without a valid cookie.
    Cookie = 0x11,
    /// A server's acceptance of a HELLO with a valid cookie.
    Accept = 0x12,
    /// Connection close, with a reason.
    Close = 0x13,
    /// Reply to a HELLO of a version the server does not speak.
    VersionNegotiation = 0x1f,
}

impl PacketType {
    /// Decodes a type byte.
    pub fn from_u8(v: u8) -> Result<Self, WireError> {
        Ok(match v {
            0x01 => Self::Data,
            0x02 => Self::Ack,
            0x10 => Self::Hello,
            0x11 => Self::Cookie,
            0x12 => Self::Accept,
            0x13 => Self::Close,
            0x1f => Self::VersionNegotiation,
            other => return Err(WireError::UnknownType(other)),
        })
    }
}

/// The 8-byte header that starts every packet.
///
/// | offset | size | field |
/// |---|---|---|
/// | 0 | 1 | `version` |
/// | 1 | 1 | `type` |
/// | 2 | 1 | type-specific (DATA: `opcode`, others: `flags`) |
/// | 3 | 1 | type-specific (DATA: `flags`, others: reserved) |
/// | 4 | 4 | `dst_cid` |
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CommonHeader {
    /// Protocol version.
    pub version: u8,
    /// Packet type.
    pub ptype: PacketType,
    /// Connection id at the receiver (0 for a HELLO).
    pub dst_cid: u32,
}

/// Reads the version and type of a datagram without checking the rest.
///
/// A version other than [`VERSION`] is reported as
/// [`WireError::UnsupportedVersion`] so that the endpoint can answer a HELLO
/// of another version with a version negotiation packet.
pub fn peek_type(buf: &[u8]) -> Result<PacketType, WireError> {
    Ok(peek_common(buf)?.ptype)
}

/// Reads the common header of a datagram.
pub fn peek_common(buf: &[u8]) -> Result<CommonHeader, WireError> {
    check_len(buf, COMMON_HEADER_LEN)?;
    if buf[0] != VERSION {
        return Err(WireError::UnsupportedVersion(buf[0]));
    }
    Ok(CommonHeader {
        version: buf[0],
        ptype: PacketType::from_u8(buf[1])?,
        dst_cid: get_u32(buf, 4),
    })
}

#[inline]
pub(crate) fn check_len(buf: &[u8], need: usize) -> Result<(), WireError> {
    if buf.len() < need {
        Err(WireError::Truncated {
            need,
            have: buf.len(),
        })
    } else {
        Ok(())
    }
}

#[inline]
pub(crate) fn check_out(buf: &[u8], need: usize) -> Result<(), WireError> {
    if buf.len() < need {
        Err(WireError::BufferTooSmall {
            need,
            have: buf.len(),
        })
    } else {
        Ok(())
    }
}

// The getters are only called after a length check; slicing keeps them panic-free
// in debug builds all the same, because `check_len` ran first.
#[inline]
pub(crate) fn get_u16(buf: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([buf[at], buf[at + 1]])
}

#[inline]
pub(crate) fn get_u32(buf: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([buf[at], buf[at + 1], buf[at + 2], buf[at + 3]])
}

#[inline]
pub(crate) fn get_u64(buf: &[u8], at: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&buf[at..at + 8]);
    u64::from_be_bytes(b)
}

#[inline]
pub(crate) fn put_u16(buf: &mut [u8], at: usize, v: u16) {
    buf[at..at + 2].copy_from_slice(&v.to_be_bytes());
}

#[inline]
pub(crate) fn put_u32(buf: &mut [u8], at: usize, v: u32) {
    buf[at..at + 4].copy_from_slice(&v.to_be_bytes());
}

#[inline]
pub(crate) fn put_u64(buf: &mut [u8], at: usize, v: u64) {
    buf[at..at + 8].copy_from_slice(&v.to_be_bytes());
}

/// Writes the common header. `b2`/`b3` are the type-specific bytes.
#[inline]
pub(crate) fn put_common(buf: &mut [u8], ptype: PacketType, b2: u8, b3: u8, dst_cid: u32) {
    buf[0] = VERSION;
    buf[1] = ptype as u8;
    buf[2] = b2;
    buf[3] = b3;
    put_u32(buf, 4, dst_cid);
}

/// Checks the common header of `buf` against the expected type.
#[inline]
pub(crate) fn expect_type(buf: &[u8], ptype: PacketType, min_len: usize) -> Result<(), WireError> {
    let c = peek_common(buf)?;
    if c.ptype != ptype {
        return Err(WireError::InvalidField("type"));
    }
    check_len(buf, min_len)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn common_header_rejects_bad_input() {
        assert!(matches!(
            peek_common(&[1, 1, 0]),
            Err(WireError::Truncated { need: 8, have: 3 })
        ));
        assert_eq!(
            peek_common(&[9, 1, 0, 0, 0, 0, 0, 0]),
            Err(WireError::UnsupportedVersion(9))
        );
        assert_eq!(
            peek_common(&[1, 0x77, 0, 0, 0, 0, 0, 0]),
            Err(WireError::UnknownType(0x77))
        );
        let c = peek_common(&[1, 2, 0, 0, 0, 0, 1, 2]).unwrap();
        assert_eq!(c.ptype, PacketType::Ack);
        assert_eq!(c.dst_cid, 0x102);
    }

    #[test]
    fn every_type_byte_round_trips() {
        for t in [
            PacketType::Data,
            PacketType::Ack,
            PacketType::Hello,
            PacketType::Cookie,
            PacketType::Accept,
            PacketType::Close,
            PacketType::VersionNegotiation,
        ] {
            assert_eq!(PacketType::from_u8(t as u8), Ok(t));
        }
    }
}
