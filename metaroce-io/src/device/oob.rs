//! What two applications exchange out of band before RDMA can flow, as
//! with rdma_cm's private data or a perftest control socket: where a QP is
//! ([`QpEndpoint`]) and which remote memory may be accessed ([`RemoteMr`]).
//!
//! Both have a fixed little-endian byte form (`to_bytes`/`from_bytes`) for
//! any byte channel, and serde implementations for structured ones (JSON
//! over HTTP, a config service). Neither is a secret the transport trusts:
//! every WRITE/READ is still checked against the region's bounds and access
//! rights at the target.

use super::ApiError;
use metaroce_proto::verbs::{Qpn, RemoteAddr};
use serde::{Deserialize, Serialize};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// Why an out-of-band record could not be decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum OobDecodeError {
    /// Fewer bytes than the record needs.
    #[error("record truncated: {got} of {need} bytes")]
    Truncated {
        /// Bytes given.
        got: usize,
        /// Bytes needed.
        need: usize,
    },
    /// The address family byte is neither 4 nor 6.
    #[error("unknown address family {0}")]
    Family(u8),
}

/// Where a queue pair lives: the endpoint's address (what
/// [`Device::connect`](super::Device::connect) dials) and the QP number
/// (what [`QueuePair::connect`](super::QueuePair::connect) takes).
///
/// ```
/// use metaroce_io::QpEndpoint;
/// let qp = QpEndpoint { addr: "10.0.0.7:4791".parse().unwrap(), qpn: 0x12 };
/// let bytes = qp.to_bytes();
/// assert_eq!(QpEndpoint::from_bytes(&bytes).unwrap(), qp);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct QpEndpoint {
    /// Address the endpoint listens on.
    pub addr: SocketAddr,
    /// The QP number.
    pub qpn: u32,
}

impl QpEndpoint {
    /// Size of the byte form: family (1), port (2), address (16), QPN (4).
    pub const LEN: usize = 23;

    /// The QP number as the core's type.
    pub fn qpn(&self) -> Qpn {
        Qpn(self.qpn)
    }

    /// The fixed byte form (IPv4 addresses zero-padded).
    pub fn to_bytes(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        match self.addr.ip() {
            IpAddr::V4(ip) => {
                b[0] = 4;
                b[3..7].copy_from_slice(&ip.octets());
            }
            IpAddr::V6(ip) => {
                b[0] = 6;
                b[3..19].copy_from_slice(&ip.octets());
            }
        }
        b[1..3].copy_from_slice(&self.addr.port().to_le_bytes());
        b[19..23].copy_from_slice(&self.qpn.to_le_bytes());
        b
    }

    /// Decodes [`to_bytes`](Self::to_bytes)' form (extra bytes are ignored).
    pub fn from_bytes(b: &[u8]) -> Result<Self, OobDecodeError> {
        let b: &[u8; Self::LEN] = b.get(..Self::LEN).and_then(|s| s.try_into().ok()).ok_or(
            OobDecodeError::Truncated {
                got: b.len(),
                need: Self::LEN,
            },
        )?;
        let port = u16::from_le_bytes([b[1], b[2]]);
        let ip = match b[0] {
            4 => IpAddr::V4(Ipv4Addr::new(b[3], b[4], b[5], b[6])),
            6 => {
                let mut o = [0u8; 16];
                o.copy_from_slice(&b[3..19]);
                IpAddr::V6(Ipv6Addr::from(o))
            }
            f => return Err(OobDecodeError::Family(f)),
        };
        Ok(QpEndpoint {
            addr: SocketAddr::new(ip, port),
            qpn: u32::from_le_bytes([b[19], b[20], b[21], b[22]]),
        })
    }
}

/// A peer's memory region as the peer hands it out: its remote key, the
/// virtual address of its first byte and its length (`ibv_mr`'s `rkey`,
/// `addr`, `length`).
///
/// ```
/// use metaroce_io::RemoteMr;
/// let mr = RemoteMr { rkey: 0xabcd, addr: 0x10_0000, len: 4096 };
/// assert_eq!(mr.at(96, 4000).unwrap().addr, 0x10_0060);
/// assert!(mr.at(96, 4001).is_err(), "reaches past the end");
/// assert!(mr.at(4096, 1).is_err());
/// assert_eq!(RemoteMr::from_bytes(&mr.to_bytes()).unwrap(), mr);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RemoteMr {
    /// Remote key.
    pub rkey: u32,
    /// Virtual address of byte 0.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
}

impl RemoteMr {
    /// Size of the byte form: rkey (4), address (8), length (8).
    pub const LEN: usize = 20;

    /// The remote address `offset` bytes into the region, for a WRITE or
    /// READ of `len` bytes there; [`ApiError::OutOfBounds`] if those bytes
    /// do not all lie in the region (as [`MemoryRegion::sge`] checks a
    /// local buffer). The peer checks again, and refuses a range outside
    /// its region with `RemoteAccessError`.
    ///
    /// [`MemoryRegion::sge`]: super::MemoryRegion::sge
    pub fn at(&self, offset: u64, len: u32) -> Result<RemoteAddr, ApiError> {
        match offset.checked_add(u64::from(len)) {
            Some(end) if end <= self.len => Ok(RemoteAddr {
                rkey: self.rkey,
                // Within `len` bytes of `addr`: no overflow unless the
                // peer's region itself wraps, which no region does.
                addr: self.addr.wrapping_add(offset),
            }),
            _ => Err(ApiError::OutOfBounds {
                offset,
                len: u64::from(len),
                size: self.len,
            }),
        }
    }

    /// The fixed little-endian byte form.
    pub fn to_bytes(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[0..4].copy_from_slice(&self.rkey.to_le_bytes());
        b[4..12].copy_from_slice(&self.addr.to_le_bytes());
        b[12..20].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Decodes [`to_bytes`](Self::to_bytes)' form (extra bytes are ignored).
    pub fn from_bytes(b: &[u8]) -> Result<Self, OobDecodeError> {
        if b.len() < Self::LEN {
            return Err(OobDecodeError::Truncated {
                got: b.len(),
                need: Self::LEN,
            });
        }
        let u64_at = |i: usize| {
            let mut x = [0u8; 8];
            x.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(x)
        };
        Ok(RemoteMr {
            rkey: u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            addr: u64_at(4),
            len: u64_at(12),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_forms_round_trip_and_reject_short_or_unknown_input() {
        for addr in ["127.0.0.1:9", "[::1]:65535", "10.1.2.3:0"] {
            let q = QpEndpoint {
                addr: addr.parse().unwrap(),
                qpn: 0xdead_beef,
            };
            let b = q.to_bytes();
            assert_eq!(QpEndpoint::from_bytes(&b).unwrap(), q);
            for n in 0..QpEndpoint::LEN {
                assert!(QpEndpoint::from_bytes(&b[..n]).is_err());
            }
        }
        let mut b = QpEndpoint {
            addr: "1.2.3.4:5".parse().unwrap(),
            qpn: 1,
        }
        .to_bytes();
        b[0] = 5;
        assert_eq!(QpEndpoint::from_bytes(&b), Err(OobDecodeError::Family(5)));
        let m = RemoteMr {
            rkey: 7,
            addr: u64::MAX - 3,
            len: 3,
        };
        assert_eq!(RemoteMr::from_bytes(&m.to_bytes()).unwrap(), m);
        assert!(RemoteMr::from_bytes(&m.to_bytes()[..19]).is_err());
        assert!(m.at(2, 1).is_ok() && m.at(3, 1).is_err() && m.at(2, 2).is_err());
        assert!(m.at(0, 3).is_ok() && m.at(u64::MAX, 2).is_err());
    }
}
