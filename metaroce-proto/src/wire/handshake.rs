//! Connection handshake and teardown: HELLO, COOKIE, ACCEPT, CLOSE, VERSION_NEGOTIATION.
//!
//! A client sends HELLO; a server that has no state for it answers with a
//! stateless COOKIE bound to the client's address; the client repeats HELLO
//! carrying the cookie; the server checks it, creates the connection and
//! answers ACCEPT. A spoofed source never sees the cookie, so it cannot make
//! the server keep state. HELLO is padded to [`HELLO_LEN`] so that no reply
//! is larger than the request.
//!
//! Version-independent invariants: byte 0 is the version, byte 1 the type,
//! bytes 4..8 `dst_cid`, and a HELLO carries its `src_cid` at bytes 8..12, in
//! every version. A VERSION_NEGOTIATION packet has version byte 0.

use super::{
    check_len, check_out, expect_type, get_u16, get_u32, put_common, put_u16, put_u32, PacketType,
    WireError,
};
use crate::consts::{
    AEAD_PROOF_LEN, COOKIE_LEN, HANDSHAKE_NONCE_LEN, HELLO_LEN, MAX_MTU, MAX_PATHS, MAX_PLANES,
    MIN_MTU, VERSION,
};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// HELLO flag: a cookie is present.
const HELLO_HAS_COOKIE: u8 = 0x01;

/// Capability bit (HELLO and ACCEPT byte 17): this side's ACKs carry rate
/// grants, so a peer sending to it holds its first flight to
/// `first_flight_bytes` until the first grant arrives.
const CAP_GRANTS: u8 = 0x01;

/// Capability bit (HELLO and ACCEPT byte 17): this side takes coalesced
/// datagrams, an ACK followed by a DATA packet (PROTOCOL §3, §6.7), so the
/// peer may carry its ACKs on its DATA.
const CAP_COALESCE: u8 = 0x02;

/// Capability bit (HELLO and ACCEPT byte 17): this side ends every datagram
/// of the connection with a CRC32C trailer and checks the peer's (PROTOCOL
/// §3.1). In force when both sides set it.
const CAP_CRC32C: u8 = 0x04;

/// HELLO: a client's connection request.
///
/// | offset | size | field |
/// |---|---|---|
/// | 0 | 8 | common header, type `0x10`, byte 2 `flags` (`0x01`: cookie present), `dst_cid` 0 |
/// | 8 | 4 | `src_cid`: the client's connection id |
/// | 12 | 2 | `listen_port`: UDP port the client receives on |
/// | 14 | 2 | `mtu`: largest UDP payload the client takes |
/// | 16 | 1 | `max_paths`: paths the client will spray over |
/// | 17 | 1 | `caps`: `0x01` = the client grants rates in its ACKs; `0x02` = it takes ACKs coalesced with DATA; `0x04` = CRC32C trailers |
/// | 18 | 2 | `window_kib`: the client's receive window for the server until its first ACK, KiB (0: none) |
/// | 20 | 16 | `cookie` (zero when absent) |
/// | 36 | 28 | padding (zero) |
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hello {
    /// Client connection id (non-zero).
    pub src_cid: u32,
    /// Client's receive port.
    pub listen_port: u16,
    /// Client's MTU.
    pub mtu: u16,
    /// Client's path count.
    pub max_paths: u8,
    /// Whether the client's ACKs carry rate grants.
    pub grants: bool,
    /// Whether the client takes coalesced datagrams (an ACK followed by a
    /// DATA packet), so that ACKs may ride on the data sent to it.
    pub coalesce: bool,
    /// Whether the client asks for CRC32C trailers (PROTOCOL §3.1).
    pub crc32c: bool,
    /// The client's receive window for the server until the client's first
    /// ACK gives one, in KiB (0: none; PROTOCOL §14).
    pub window_kib: u16,
    /// Cookie from a previous COOKIE reply.
    pub cookie: Option<[u8; COOKIE_LEN]>,
}

impl Hello {
    /// Parses a HELLO.
    pub fn parse(buf: &[u8]) -> Result<Self, WireError> {
        expect_type(buf, PacketType::Hello, HELLO_LEN)?;
        let src_cid = get_u32(buf, 8);
        if src_cid == 0 {
            return Err(WireError::InvalidField("src_cid"));
        }
        let mtu = get_u16(buf, 14);
        if !(MIN_MTU..=MAX_MTU).contains(&mtu) {
            return Err(WireError::InvalidField("mtu"));
        }
        if get_u16(buf, 12) == 0 {
            return Err(WireError::InvalidField("listen_port"));
        }
        let max_paths = buf[16];
        if max_paths == 0 || usize::from(max_paths) > MAX_PATHS {
            return Err(WireError::InvalidField("max_paths"));
        }
        let cookie = if buf[2] & HELLO_HAS_COOKIE != 0 {
            let mut c = [0u8; COOKIE_LEN];
            c.copy_from_slice(&buf[20..20 + COOKIE_LEN]);
            Some(c)
        } else {
            None
        };
        Ok(Hello {
            src_cid,
            listen_port: get_u16(buf, 12),
            mtu,
            max_paths,
            grants: buf[17] & CAP_GRANTS != 0,
            coalesce: buf[17] & CAP_COALESCE != 0,
            crc32c: buf[17] & CAP_CRC32C != 0,
            window_kib: get_u16(buf, 18),
            cookie,
        })
    }

    /// Writes a HELLO (always [`HELLO_LEN`] bytes).
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize, WireError> {
        check_out(buf, HELLO_LEN)?;
        buf[..HELLO_LEN].fill(0);
        let flags = if self.cookie.is_some() {
            HELLO_HAS_COOKIE
        } else {
            0
        };
        put_common(buf, PacketType::Hello, flags, 0, 0);
        put_u32(buf, 8, self.src_cid);
        put_u16(buf, 12, self.listen_port);
        put_u16(buf, 14, self.mtu);
        buf[16] = self.max_paths;
        buf[17] = caps(self.grants, self.coalesce, self.crc32c);
        put_u16(buf, 18, self.window_kib);
        if let Some(c) = &self.cookie {
            buf[20..20 + COOKIE_LEN].copy_from_slice(c);
        }
        Ok(HELLO_LEN)
    }
}

/// COOKIE: a server's stateless answer to a HELLO without a valid cookie.
///
/// | offset | size | field |
/// |---|---|---|
/// | 0 | 8 | common header, type `0x11`, `dst_cid` = the HELLO's `src_cid` |
/// | 8 | 16 | `cookie` |
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CookieReply {
    /// The client's connection id.
    pub dst_cid: u32,
    /// The cookie to echo.
    pub cookie: [u8; COOKIE_LEN],
}

impl CookieReply {
    /// Length on the wire.
    pub const LEN: usize = 8 + COOKIE_LEN;

    /// Parses a COOKIE.
    pub fn parse(buf: &[u8]) -> Result<Self, WireError> {
        expect_type(buf, PacketType::Cookie, Self::LEN)?;
        let mut cookie = [0u8; COOKIE_LEN];
        cookie.copy_from_slice(&buf[8..8 + COOKIE_LEN]);
        Ok(CookieReply {
            dst_cid: get_u32(buf, 4),
            cookie,
        })
    }

    /// Writes a COOKIE.
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize, WireError> {
        check_out(buf, Self::LEN)?;
        put_common(buf, PacketType::Cookie, 0, 0, self.dst_cid);
        buf[8..8 + COOKIE_LEN].copy_from_slice(&self.cookie);
        Ok(Self::LEN)
    }
}

/// ACCEPT: the server created the connection.
///
/// | offset | size | field |
/// |---|---|---|
/// | 0 | 8 | common header, type `0x12`, `dst_cid` = the client's cid |
/// | 8 | 4 | `src_cid`: the server's connection id |
/// | 12 | 2 | `listen_port`: UDP port the server receives on |
/// | 14 | 2 | `mtu`: the connection's MTU (the smaller of both) |
/// | 16 | 1 | `max_paths`: the server's path count |
/// | 17 | 1 | `caps`: `0x01` = the server grants rates in its ACKs; `0x02` = it takes ACKs coalesced with DATA; `0x04` = CRC32C trailers |
/// | 18 | 2 | `window_kib`: the server's receive window for the client until its first ACK, KiB (0: none) |
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Accept {
    /// The client's connection id.
    pub dst_cid: u32,
    /// The server's connection id.
    pub src_cid: u32,
    /// Server's receive port.
    pub listen_port: u16,
    /// Negotiated MTU.
    pub mtu: u16,
    /// Server's path count.
    pub max_paths: u8,
    /// Whether the server's ACKs carry rate grants.
    pub grants: bool,
    /// Whether the server takes coalesced datagrams (an ACK followed by a
    /// DATA packet), so that ACKs may ride on the data sent to it.
    pub coalesce: bool,
    /// Whether the server agrees to CRC32C trailers: set only when the
    /// client asked for them and the server wants them too.
    pub crc32c: bool,
    /// The server's receive window for the client until the server's first
    /// ACK gives one, in KiB (0: none; PROTOCOL §14).
    pub window_kib: u16,
}

impl Accept {
    /// Length on the wire.
    pub const LEN: usize = 20;

    /// Parses an ACCEPT.
    pub fn parse(buf: &[u8]) -> Result<Self, WireError> {
        expect_type(buf, PacketType::Accept, Self::LEN)?;
        let src_cid = get_u32(buf, 8);
        if src_cid == 0 {
            return Err(WireError::InvalidField("src_cid"));
        }
        let mtu = get_u16(buf, 14);
        if !(MIN_MTU..=MAX_MTU).contains(&mtu) {
            return Err(WireError::InvalidField("mtu"));
        }
        let max_paths = buf[16];
        if max_paths == 0 || usize::from(max_paths) > MAX_PATHS {
            return Err(WireError::InvalidField("max_paths"));
        }
        Ok(Accept {
            dst_cid: get_u32(buf, 4),
            src_cid,
            listen_port: get_u16(buf, 12),
            mtu,
            max_paths,
            grants: buf[17] & CAP_GRANTS != 0,
            coalesce: buf[17] & CAP_COALESCE != 0,
            crc32c: buf[17] & CAP_CRC32C != 0,
            window_kib: get_u16(buf, 18),
        })
    }

    /// Writes an ACCEPT.
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize, WireError> {
        check_out(buf, Self::LEN)?;
        buf[..Self::LEN].fill(0);
        put_common(buf, PacketType::Accept, 0, 0, self.dst_cid);
        put_u32(buf, 8, self.src_cid);
        put_u16(buf, 12, self.listen_port);
        put_u16(buf, 14, self.mtu);
        buf[16] = self.max_paths;
        buf[17] = caps(self.grants, self.coalesce, self.crc32c);
        put_u16(buf, 18, self.window_kib);
        Ok(Self::LEN)
    }
}

/// The `caps` byte of a HELLO or an ACCEPT.
fn caps(grants: bool, coalesce: bool, crc32c: bool) -> u8 {
    let mut c = 0;
    if crc32c {
        c |= CAP_CRC32C;
    }
    if grants {
        c |= CAP_GRANTS;
    }
    if coalesce {
        c |= CAP_COALESCE;
    }
    c
}

/// Type byte of the plane-address extension that may follow the fixed part
/// of a HELLO or an ACCEPT.
pub const EXT_PLANES: u8 = 0x01;

/// The sender's additional plane addresses: an optional extension after the
/// fixed part of a HELLO (offset [`HELLO_LEN`]) or an ACCEPT (offset
/// [`Accept::LEN`]). Plane 0 is the packet's source address; entry `k` of
/// the list is the sender's address on plane `k + 1`.
///
/// | offset | size | field |
/// |---|---|---|
/// | 0 | 1 | extension type [`EXT_PLANES`] |
/// | 1 | 1 | `count`: addresses listed, `1..MAX_PLANES` |
/// | 2 | … | `count` entries: family byte (4 or 6), then 4 or 16 address bytes |
///
/// Receivers that predate the extension ignore it (bytes beyond the fixed
/// length are ignored). A trailer whose first byte is another extension type
/// is ignored too (forward compatibility); bytes after a well-formed list are
/// ignored.
///
/// ```
/// use metaroce_proto::wire::PlaneAddrs;
/// use std::net::IpAddr;
/// let ips: Vec<IpAddr> = vec!["10.1.0.1".parse().unwrap(), "fd00::1".parse().unwrap()];
/// let p = PlaneAddrs::new(&ips).unwrap();
/// let mut buf = [0u8; 64];
/// let n = p.emit(&mut buf).unwrap();
/// assert_eq!(n, p.encoded_len());
/// assert_eq!(PlaneAddrs::parse(&buf[..n]).unwrap().as_slice(), &ips[..]);
/// assert!(PlaneAddrs::parse(&[]).unwrap().is_empty());
/// assert!(PlaneAddrs::parse(&buf[..n - 1]).is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlaneAddrs {
    addrs: [IpAddr; MAX_PLANES - 1],
    len: u8,
}

impl Default for PlaneAddrs {
    fn default() -> Self {
        PlaneAddrs {
            addrs: [IpAddr::V4(Ipv4Addr::UNSPECIFIED); MAX_PLANES - 1],
            len: 0,
        }
    }
}

impl PlaneAddrs {
    /// A list of additional plane addresses; more than `MAX_PLANES - 1` is
    /// an error.
    pub fn new(list: &[IpAddr]) -> Result<Self, WireError> {
        if list.len() > MAX_PLANES - 1 {
            return Err(WireError::InvalidField("plane count"));
        }
        let mut p = PlaneAddrs::default();
        p.addrs[..list.len()].copy_from_slice(list);
        p.len = list.len() as u8;
        Ok(p)
    }

    /// The addresses, plane 1 first.
    pub fn as_slice(&self) -> &[IpAddr] {
        &self.addrs[..usize::from(self.len)]
    }

    /// Whether the list is empty (the sender spans one plane).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes [`emit`](Self::emit) writes: 0 for an empty list.
    pub fn encoded_len(&self) -> usize {
        if self.is_empty() {
            return 0;
        }
        2 + self
            .as_slice()
            .iter()
            .map(|a| if a.is_ipv4() { 5 } else { 17 })
            .sum::<usize>()
    }

    /// Parses the bytes after a HELLO's or ACCEPT's fixed part. No bytes:
    /// an empty list. A malformed plane list (count 0 or too large, unknown
    /// family, an entry cut short) is an error.
    pub fn parse(trailer: &[u8]) -> Result<Self, WireError> {
        let mut p = PlaneAddrs::default();
        if trailer.first() != Some(&EXT_PLANES) {
            return Ok(p);
        }
        check_len(trailer, 2)?;
        let count = usize::from(trailer[1]);
        if count == 0 || count > MAX_PLANES - 1 {
            return Err(WireError::InvalidField("plane count"));
        }
        let mut at = 2;
        for slot in p.addrs.iter_mut().take(count) {
            check_len(trailer, at + 1)?;
            *slot = match trailer[at] {
                4 => {
                    check_len(trailer, at + 5)?;
                    let mut o = [0u8; 4];
                    o.copy_from_slice(&trailer[at + 1..at + 5]);
                    at += 5;
                    IpAddr::V4(Ipv4Addr::from(o))
                }
                6 => {
                    check_len(trailer, at + 17)?;
                    let mut o = [0u8; 16];
                    o.copy_from_slice(&trailer[at + 1..at + 17]);
                    at += 17;
                    IpAddr::V6(Ipv6Addr::from(o))
                }
                _ => return Err(WireError::InvalidField("plane address family")),
            };
        }
        p.len = count as u8;
        Ok(p)
    }

    /// Writes the extension (nothing for an empty list).
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize, WireError> {
        let n = self.encoded_len();
        if n == 0 {
            return Ok(0);
        }
        check_out(buf, n)?;
        buf[0] = EXT_PLANES;
        buf[1] = self.len;
        let mut at = 2;
        for a in self.as_slice() {
            match a {
                IpAddr::V4(v4) => {
                    buf[at] = 4;
                    buf[at + 1..at + 5].copy_from_slice(&v4.octets());
                    at += 5;
                }
                IpAddr::V6(v6) => {
                    buf[at] = 6;
                    buf[at + 1..at + 17].copy_from_slice(&v6.octets());
                    at += 17;
                }
            }
        }
        Ok(at)
    }
}

/// Type byte of the security extension (PROTOCOL §3.2, §7.7) that may
/// follow the fixed part of a HELLO or an ACCEPT, after the plane-address
/// extension if there is one.
pub const EXT_SECURITY: u8 = 0x02;

/// The AEAD suite of the security extension: AES-128-GCM, keys from HKDF-SHA256.
pub const SUITE_AES_128_GCM: u8 = 0x01;

/// The security extension of a HELLO or an ACCEPT: the sender's nonce for
/// the connection's key derivation and its proof that it holds the
/// pre-shared key (PROTOCOL §3.2).
///
/// | offset | size | field |
/// |---|---|---|
/// | 0 | 1 | extension type [`EXT_SECURITY`] |
/// | 1 | 1 | `suite`: [`SUITE_AES_128_GCM`] |
/// | 2 | 16 | `nonce` |
/// | 18 | 16 | `proof` |
///
/// ```
/// use metaroce_proto::wire::{PlaneAddrs, SecurityExt, SUITE_AES_128_GCM};
/// let e = SecurityExt { suite: SUITE_AES_128_GCM, nonce: [1; 16], proof: [2; 16] };
/// let planes = PlaneAddrs::new(&["10.1.0.1".parse().unwrap()]).unwrap();
/// let mut buf = [0u8; 64];
/// let n = planes.emit(&mut buf).unwrap();
/// let m = e.emit(&mut buf[n..]).unwrap();
/// assert_eq!(SecurityExt::find(&buf[..n + m]).unwrap(), Some(e));
/// assert_eq!(SecurityExt::find(&buf[..n]).unwrap(), None);
/// assert!(SecurityExt::find(&buf[..n + m - 1]).is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SecurityExt {
    /// The AEAD suite.
    pub suite: u8,
    /// The sender's handshake nonce.
    pub nonce: [u8; HANDSHAKE_NONCE_LEN],
    /// The sender's key proof.
    pub proof: [u8; AEAD_PROOF_LEN],
}

impl SecurityExt {
    /// Length on the wire.
    pub const LEN: usize = 2 + HANDSHAKE_NONCE_LEN + AEAD_PROOF_LEN;

    /// The extension in the bytes after a HELLO's or ACCEPT's fixed part,
    /// if present: first, or right after a well-formed plane-address list.
    /// A malformed plane list, or the extension cut short: an error.
    pub fn find(trailer: &[u8]) -> Result<Option<Self>, WireError> {
        let at = PlaneAddrs::parse(trailer)?.encoded_len();
        let rest = &trailer[at..];
        if rest.first() != Some(&EXT_SECURITY) {
            return Ok(None);
        }
        check_len(rest, Self::LEN)?;
        let mut e = SecurityExt {
            suite: rest[1],
            nonce: [0; HANDSHAKE_NONCE_LEN],
            proof: [0; AEAD_PROOF_LEN],
        };
        e.nonce.copy_from_slice(&rest[2..2 + HANDSHAKE_NONCE_LEN]);
        e.proof
            .copy_from_slice(&rest[2 + HANDSHAKE_NONCE_LEN..Self::LEN]);
        Ok(Some(e))
    }

    /// Writes the extension.
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize, WireError> {
        check_out(buf, Self::LEN)?;
        buf[0] = EXT_SECURITY;
        buf[1] = self.suite;
        buf[2..2 + HANDSHAKE_NONCE_LEN].copy_from_slice(&self.nonce);
        buf[2 + HANDSHAKE_NONCE_LEN..Self::LEN].copy_from_slice(&self.proof);
        Ok(Self::LEN)
    }
}

/// Reason carried by a CLOSE.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum CloseCode {
    /// The application closed the connection.
    Normal = 0,
    /// The peer broke the protocol.
    ProtocolViolation = 1,
    /// The sender ran out of retries (retry exceeded).
    RetryExceeded = 2,
    /// The sender is shutting down.
    Shutdown = 3,
    /// The receiver knows no such connection (sent in answer to stray packets).
    UnknownConnection = 4,
    /// The server refused the client's key proof (PROTOCOL §3.2): the keys
    /// differ, or one side has none.
    KeyRefused = 5,
}

impl CloseCode {
    /// Decodes a close code; an unknown code is an error.
    pub fn from_u32(v: u32) -> Result<Self, WireError> {
        Ok(match v {
            0 => Self::Normal,
            1 => Self::ProtocolViolation,
            2 => Self::RetryExceeded,
            3 => Self::Shutdown,
            4 => Self::UnknownConnection,
            5 => Self::KeyRefused,
            _ => return Err(WireError::InvalidField("close code")),
        })
    }
}

/// CLOSE: the sender tears the connection down.
///
/// | offset | size | field |
/// |---|---|---|
/// | 0 | 8 | common header, type `0x13`, `dst_cid` |
/// | 8 | 4 | `code` ([`CloseCode`]) |
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Close {
    /// Receiver's connection id.
    pub dst_cid: u32,
    /// Why.
    pub code: CloseCode,
}

impl Close {
    /// Length on the wire.
    pub const LEN: usize = 12;

    /// Parses a CLOSE.
    pub fn parse(buf: &[u8]) -> Result<Self, WireError> {
        expect_type(buf, PacketType::Close, Self::LEN)?;
        Ok(Close {
            dst_cid: get_u32(buf, 4),
            code: CloseCode::from_u32(get_u32(buf, 8))?,
        })
    }

    /// Writes a CLOSE.
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize, WireError> {
        check_out(buf, Self::LEN)?;
        put_common(buf, PacketType::Close, 0, 0, self.dst_cid);
        put_u32(buf, 8, self.code as u32);
        Ok(Self::LEN)
    }
}

/// VERSION_NEGOTIATION: answer to a HELLO of an unknown version.
///
/// | offset | size | field |
/// |---|---|---|
/// | 0 | 1 | `0` (version-independent) |
/// | 1 | 1 | type `0x1f` |
/// | 2 | 2 | reserved |
/// | 4 | 4 | `dst_cid` = the HELLO's `src_cid` |
/// | 8 | 1 | `count` |
/// | 9 | count | supported versions |
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VersionNegotiation {
    /// The client's connection id.
    pub dst_cid: u32,
    /// Whether the server speaks this implementation's [`VERSION`].
    pub supports_ours: bool,
    /// Highest version listed.
    pub highest: u8,
}

impl VersionNegotiation {
    /// Whether `buf` is a version negotiation packet (checked before the version byte).
    pub fn is(buf: &[u8]) -> bool {
        buf.len() >= 2 && buf[0] == 0 && buf[1] == PacketType::VersionNegotiation as u8
    }

    /// Parses a VERSION_NEGOTIATION.
    pub fn parse(buf: &[u8]) -> Result<Self, WireError> {
        check_len(buf, 9)?;
        if !Self::is(buf) {
            return Err(WireError::InvalidField("type"));
        }
        let count = usize::from(buf[8]);
        check_len(buf, 9 + count)?;
        if count == 0 {
            return Err(WireError::InvalidField("count"));
        }
        let versions = &buf[9..9 + count];
        Ok(VersionNegotiation {
            dst_cid: get_u32(buf, 4),
            supports_ours: versions.contains(&VERSION),
            highest: versions.iter().copied().max().unwrap_or(0),
        })
    }

    /// Writes a VERSION_NEGOTIATION listing this implementation's version.
    pub fn emit(dst_cid: u32, buf: &mut [u8]) -> Result<usize, WireError> {
        check_out(buf, 10)?;
        buf[0] = 0;
        buf[1] = PacketType::VersionNegotiation as u8;
        buf[2] = 0;
        buf[3] = 0;
        put_u32(buf, 4, dst_cid);
        buf[8] = 1;
        buf[9] = VERSION;
        Ok(10)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hello_round_trip_and_padding() {
        let h = Hello {
            src_cid: 5,
            listen_port: 4792,
            mtu: 4160,
            max_paths: 8,
            grants: true,
            coalesce: false,
            crc32c: false,
            window_kib: 0x1234,
            cookie: Some([7; COOKIE_LEN]),
        };
        let mut buf = [0xffu8; 100];
        let n = h.emit(&mut buf).unwrap();
        assert_eq!(n, HELLO_LEN);
        assert_eq!(Hello::parse(&buf[..n]).unwrap(), h);
        assert!(buf[36..HELLO_LEN].iter().all(|&b| b == 0));
        assert!(Hello::parse(&buf[..n - 1]).is_err());
        assert_eq!(buf[17], 0x01, "the grants capability is bit 0 of byte 17");
        assert_eq!(buf[18..20], [0x12, 0x34], "the window is bytes 18-19");
        let h2 = Hello {
            cookie: None,
            grants: false,
            ..h
        };
        h2.emit(&mut buf).unwrap();
        assert_eq!(Hello::parse(&buf[..n]).unwrap().cookie, None);
        assert!(!Hello::parse(&buf[..n]).unwrap().grants);
        let h3 = Hello {
            coalesce: true,
            ..h2
        };
        h3.emit(&mut buf).unwrap();
        assert_eq!(buf[17], 0x02, "coalescing is bit 1 of byte 17");
        assert_eq!(Hello::parse(&buf[..n]).unwrap(), h3);
        // Reserved capability bits are ignored.
        let h5 = Hello { crc32c: true, ..h2 };
        h5.emit(&mut buf).unwrap();
        assert_eq!(buf[17], 0x04, "CRC32C is bit 2 of byte 17");
        assert_eq!(Hello::parse(&buf[..n]).unwrap(), h5);
        buf[17] = 0xf8;
        let h4 = Hello::parse(&buf[..n]).unwrap();
        assert!(!h4.grants && !h4.coalesce && !h4.crc32c);
    }

    #[test]
    fn hello_rejects_bad_fields() {
        let h = Hello {
            src_cid: 5,
            listen_port: 1,
            mtu: 1500,
            max_paths: 8,
            grants: false,
            coalesce: true,
            crc32c: true,
            window_kib: 0,
            cookie: None,
        };
        let mut buf = [0u8; HELLO_LEN];
        h.emit(&mut buf).unwrap();
        for (at, val, what) in [
            (8usize, 0u8, "src_cid"),
            (16, 0, "max_paths"),
            (16, 65, "max_paths"),
        ] {
            let mut b = buf;
            if what == "src_cid" {
                b[8..12].fill(val);
            } else {
                b[at] = val;
            }
            assert_eq!(Hello::parse(&b), Err(WireError::InvalidField(what)));
        }
        let mut b = buf;
        b[14..16].copy_from_slice(&10u16.to_be_bytes());
        assert_eq!(Hello::parse(&b), Err(WireError::InvalidField("mtu")));
    }

    #[test]
    fn cookie_accept_close_round_trip() {
        let mut buf = [0u8; 64];
        let c = CookieReply {
            dst_cid: 9,
            cookie: [3; COOKIE_LEN],
        };
        let n = c.emit(&mut buf).unwrap();
        assert_eq!(CookieReply::parse(&buf[..n]).unwrap(), c);
        assert!(n <= HELLO_LEN);
        let a = Accept {
            dst_cid: 9,
            src_cid: 10,
            listen_port: 4792,
            mtu: 1500,
            max_paths: 4,
            grants: true,
            coalesce: true,
            crc32c: false,
            window_kib: 0xabcd,
        };
        let n = a.emit(&mut buf).unwrap();
        assert_eq!(Accept::parse(&buf[..n]).unwrap(), a);
        assert_eq!(buf[17], 0x03);
        assert_eq!(buf[18..20], [0xab, 0xcd]);
        assert!(n <= HELLO_LEN);
        let cl = Close {
            dst_cid: 9,
            code: CloseCode::RetryExceeded,
        };
        let n = cl.emit(&mut buf).unwrap();
        assert_eq!(Close::parse(&buf[..n]).unwrap(), cl);
        buf[11] = 200;
        assert!(Close::parse(&buf[..n]).is_err());
    }

    #[test]
    fn plane_addrs_round_trip_and_malformed() {
        let ips: Vec<IpAddr> = (1..MAX_PLANES as u8)
            .map(|p| IpAddr::V4(Ipv4Addr::new(10, p, 0, 1)))
            .collect();
        let p = PlaneAddrs::new(&ips).unwrap();
        let mut buf = [0u8; 128];
        let n = p.emit(&mut buf).unwrap();
        assert_eq!(n, 2 + 5 * ips.len());
        assert_eq!(PlaneAddrs::parse(&buf[..n]).unwrap().as_slice(), &ips[..]);
        // Trailing bytes after a well-formed list are ignored.
        assert_eq!(PlaneAddrs::parse(&buf[..n + 3]).unwrap(), p);
        // Every cut inside the list is refused.
        for cut in 1..n {
            assert!(
                matches!(
                    PlaneAddrs::parse(&buf[..cut]),
                    Err(WireError::Truncated { .. })
                ),
                "cut at {cut}"
            );
        }
        let mut b = buf;
        b[1] = 0;
        assert_eq!(
            PlaneAddrs::parse(&b[..n]),
            Err(WireError::InvalidField("plane count"))
        );
        b[1] = MAX_PLANES as u8;
        assert_eq!(
            PlaneAddrs::parse(&b[..n]),
            Err(WireError::InvalidField("plane count"))
        );
        let mut b = buf;
        b[2] = 5;
        assert_eq!(
            PlaneAddrs::parse(&b[..n]),
            Err(WireError::InvalidField("plane address family"))
        );
        // Another extension type, or none: no planes.
        let mut b = buf;
        b[0] = 0x7f;
        assert!(PlaneAddrs::parse(&b[..n]).unwrap().is_empty());
        assert!(PlaneAddrs::parse(&[]).unwrap().is_empty());
        assert_eq!(PlaneAddrs::default().emit(&mut buf), Ok(0));
        assert!(PlaneAddrs::new(&[ips[0]; MAX_PLANES]).is_err());
        assert!(p.emit(&mut buf[..n - 1]).is_err());
    }

    #[test]
    fn security_extension_alone_after_planes_and_malformed() {
        let e = SecurityExt {
            suite: SUITE_AES_128_GCM,
            nonce: [0xa5; HANDSHAKE_NONCE_LEN],
            proof: [0x5a; AEAD_PROOF_LEN],
        };
        let mut buf = [0u8; 128];
        let n = e.emit(&mut buf).unwrap();
        assert_eq!(n, SecurityExt::LEN);
        assert_eq!((buf[0], buf[1]), (EXT_SECURITY, SUITE_AES_128_GCM));
        assert_eq!(SecurityExt::find(&buf[..n]), Ok(Some(e)));
        // Every cut of it is refused; trailing bytes are ignored.
        for cut in 1..n {
            assert!(matches!(
                SecurityExt::find(&buf[..cut]),
                Err(WireError::Truncated { .. })
            ));
        }
        assert_eq!(SecurityExt::find(&buf[..n + 5]), Ok(Some(e)));
        // After a plane list; absent; another extension type.
        let planes = PlaneAddrs::new(&[IpAddr::V6(Ipv6Addr::LOCALHOST)]).unwrap();
        let p = planes.emit(&mut buf).unwrap();
        let m = e.emit(&mut buf[p..]).unwrap();
        assert_eq!(SecurityExt::find(&buf[..p + m]), Ok(Some(e)));
        assert_eq!(PlaneAddrs::parse(&buf[..p + m]), Ok(planes));
        assert_eq!(SecurityExt::find(&buf[..p]), Ok(None));
        assert_eq!(SecurityExt::find(&[]), Ok(None));
        assert_eq!(SecurityExt::find(&[0x7f; 40]), Ok(None));
        // A malformed plane list before it is an error.
        buf[1] = 0;
        assert!(SecurityExt::find(&buf[..p + m]).is_err());
        assert!(e.emit(&mut buf[..n - 1]).is_err());
        // Any bytes: an answer, never a panic.
        let mut x = 0x1234_5678u32;
        for len in 0..80 {
            let junk: Vec<u8> = (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 17;
                    x ^= x << 5;
                    if x % 5 == 0 {
                        EXT_SECURITY
                    } else {
                        x as u8
                    }
                })
                .collect();
            let _ = SecurityExt::find(&junk);
        }
    }

    #[test]
    fn key_refused_close_code() {
        assert_eq!(CloseCode::from_u32(5), Ok(CloseCode::KeyRefused));
        assert!(CloseCode::from_u32(6).is_err());
    }

    #[test]
    fn version_negotiation() {
        let mut buf = [0u8; 16];
        let n = VersionNegotiation::emit(44, &mut buf).unwrap();
        assert!(VersionNegotiation::is(&buf[..n]));
        let v = VersionNegotiation::parse(&buf[..n]).unwrap();
        assert_eq!(
            v,
            VersionNegotiation {
                dst_cid: 44,
                supports_ours: true,
                highest: VERSION
            }
        );
        buf[8] = 5;
        assert!(VersionNegotiation::parse(&buf[..n]).is_err());
    }
}
