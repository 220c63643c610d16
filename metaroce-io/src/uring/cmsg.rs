//! Control messages and socket addresses as bytes: what the kernel puts in a
//! multishot receive buffer, and what a send carries. Safe code over the two
//! header accessors of [`sys`](super::sys).

use super::sys::{read_cmsghdr, write_cmsghdr, CMSG_HDR};
use metaroce_proto::Ecn;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV6};

/// `UDP_SEGMENT` (linux/udp.h): GSO segment size, on send.
pub(super) const UDP_SEGMENT: libc::c_int = 103;
/// `UDP_GRO` (linux/udp.h): enable GRO; on receive, the segment size.
pub(super) const UDP_GRO: libc::c_int = 104;

/// `CMSG_ALIGN`: control messages are aligned to `size_of::<usize>()` on Linux.
const fn align(n: usize) -> usize {
    let a = std::mem::size_of::<usize>();
    (n + a - 1) & !(a - 1)
}

/// `CMSG_SPACE(len)`.
pub(super) const fn space(len: usize) -> usize {
    CMSG_HDR + align(len)
}

/// What the receive control data said.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) struct RecvMeta {
    /// ECN bits of the IP header.
    pub ecn: Ecn,
    /// GRO segment size, if the kernel coalesced datagrams.
    pub stride: Option<usize>,
    /// When the datagram (the first of a GRO batch) arrived
    /// (`SCM_TIMESTAMPNS`: since the Unix epoch, wall clock).
    pub stamp: Option<std::time::Duration>,
}

/// Parses the control messages of a receive.
pub(super) fn parse_control(mut c: &[u8]) -> RecvMeta {
    let mut m = RecvMeta::default();
    while let Some((len, level, ty)) = read_cmsghdr(c) {
        if len < CMSG_HDR || len > c.len() {
            break;
        }
        let data = &c[CMSG_HDR..len];
        let int = || {
            data.get(..4)
                .map(|b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
        };
        match (level, ty) {
            // IPv4 TOS is one byte (some kernels: an int; the low byte on
            // little endian, and the kernel sends one byte on Linux).
            (libc::IPPROTO_IP, libc::IP_TOS) => {
                if let Some(&b) = data.first() {
                    m.ecn = Ecn::from_bits(b);
                }
            }
            (libc::IPPROTO_IPV6, libc::IPV6_TCLASS) => {
                if let Some(v) = int() {
                    m.ecn = Ecn::from_bits(v as u8);
                }
            }
            (libc::SOL_SOCKET, libc::SCM_TIMESTAMPNS) => {
                // struct timespec: two native longs (64-bit Linux).
                let word = |at: usize| {
                    data.get(at..at + 8)
                        .and_then(|b| b.try_into().ok())
                        .map(i64::from_ne_bytes)
                };
                if let (Some(sec), Some(nsec)) = (word(0), word(8)) {
                    if let (Ok(sec), Ok(nsec)) = (u64::try_from(sec), u32::try_from(nsec)) {
                        if nsec < 1_000_000_000 {
                            m.stamp = Some(std::time::Duration::new(sec, nsec));
                        }
                    }
                }
            }
            (libc::SOL_UDP, UDP_GRO) => {
                if let Some(v) = int() {
                    m.stride = usize::try_from(v).ok().filter(|&s| s > 0);
                }
            }
            _ => {}
        }
        let next = align(len);
        if next >= c.len() {
            break;
        }
        c = &c[next..];
    }
    m
}

/// Appends one control message carrying `data`; returns the new length, or
/// `None` without room.
fn push(
    buf: &mut [u8],
    at: usize,
    level: libc::c_int,
    ty: libc::c_int,
    data: &[u8],
) -> Option<usize> {
    let end = at.checked_add(space(data.len()))?;
    let b = buf.get_mut(at..end)?;
    b.fill(0);
    write_cmsghdr(b, CMSG_HDR + data.len(), level, ty)?;
    b[CMSG_HDR..CMSG_HDR + data.len()].copy_from_slice(data);
    Some(end)
}

/// Writes the control data of a send: the ECN codepoint (`IP_TOS` or
/// `IPV6_TCLASS`) and, for a GSO batch, `UDP_SEGMENT`. Returns its length.
pub(super) fn encode_send(buf: &mut [u8], v6: bool, ecn: Ecn, segment: Option<u16>) -> usize {
    let mut len = 0;
    if ecn != Ecn::NotEct {
        let tos = i32::from(ecn.bits()).to_ne_bytes();
        let (level, ty) = if v6 {
            (libc::IPPROTO_IPV6, libc::IPV6_TCLASS)
        } else {
            (libc::IPPROTO_IP, libc::IP_TOS)
        };
        len = push(buf, len, level, ty, &tos).unwrap_or(len);
    }
    if let Some(s) = segment {
        len = push(buf, len, libc::SOL_UDP, UDP_SEGMENT, &s.to_ne_bytes()).unwrap_or(len);
    }
    len
}

/// Decodes a `sockaddr_in` / `sockaddr_in6` given as bytes.
pub(super) fn parse_sockaddr(b: &[u8]) -> Option<SocketAddr> {
    let family = u16::from_ne_bytes([*b.first()?, *b.get(1)?]);
    let port = u16::from_be_bytes([*b.get(2)?, *b.get(3)?]);
    match libc::c_int::from(family) {
        libc::AF_INET => {
            let ip: [u8; 4] = b.get(4..8)?.try_into().ok()?;
            Some(SocketAddr::new(IpAddr::V4(Ipv4Addr::from(ip)), port))
        }
        libc::AF_INET6 => {
            let flow: [u8; 4] = b.get(4..8)?.try_into().ok()?;
            let ip: [u8; 16] = b.get(8..24)?.try_into().ok()?;
            let scope: [u8; 4] = b.get(24..28)?.try_into().ok()?;
            let ip = Ipv6Addr::from(ip);
            // A v4-mapped source (dual-stack socket) is the IPv4 peer.
            if let Some(v4) = ip.to_ipv4_mapped() {
                return Some(SocketAddr::new(IpAddr::V4(v4), port));
            }
            Some(SocketAddr::V6(SocketAddrV6::new(
                ip,
                port,
                u32::from_be_bytes(flow),
                u32::from_ne_bytes(scope),
            )))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::super::sys::CmsgBuf;
    use super::*;

    #[test]
    fn send_control_round_trips_through_the_parser() {
        let mut b = CmsgBuf([0; 64]);
        let n = encode_send(&mut b.0, false, Ecn::Ect0, Some(1200));
        assert_eq!(n, space(4) + space(2));
        // The parser reads TOS; UDP_SEGMENT is not a receive cmsg.
        let m = parse_control(&b.0[..n]);
        assert_eq!(m.ecn, Ecn::Ect0);
        assert_eq!(m.stride, None);
        assert_eq!(encode_send(&mut b.0, true, Ecn::NotEct, None), 0);
    }

    #[test]
    fn gro_and_tclass_are_read() {
        let mut b = [0u8; 64];
        let at = push(&mut b, 0, libc::SOL_UDP, UDP_GRO, &1400i32.to_ne_bytes()).unwrap();
        let n = push(
            &mut b,
            at,
            libc::IPPROTO_IPV6,
            libc::IPV6_TCLASS,
            &3i32.to_ne_bytes(),
        )
        .unwrap();
        let m = parse_control(&b[..n]);
        assert_eq!(m.stride, Some(1400));
        assert_eq!(m.ecn, Ecn::Ce);
    }

    #[test]
    fn receive_timestamps_are_read_and_checked() {
        let stamp = |sec: i64, nsec: i64| {
            let mut b = [0u8; 64];
            let mut ts = [0u8; 16];
            ts[..8].copy_from_slice(&sec.to_ne_bytes());
            ts[8..].copy_from_slice(&nsec.to_ne_bytes());
            let n = push(&mut b, 0, libc::SOL_SOCKET, libc::SCM_TIMESTAMPNS, &ts).unwrap();
            parse_control(&b[..n]).stamp
        };
        assert_eq!(
            stamp(1_800_000_000, 250),
            Some(std::time::Duration::new(1_800_000_000, 250))
        );
        assert_eq!(stamp(-1, 0), None, "before the epoch");
        assert_eq!(stamp(5, 1_000_000_000), None, "not a nanosecond count");
        assert_eq!(stamp(5, -1), None);
    }

    #[test]
    fn truncated_or_garbage_control_is_harmless() {
        assert_eq!(parse_control(&[]), RecvMeta::default());
        assert_eq!(parse_control(&[0xff; 40]), RecvMeta::default());
        let mut b = [0u8; 64];
        let n = push(&mut b, 0, libc::SOL_UDP, UDP_GRO, &9000i32.to_ne_bytes()).unwrap();
        for cut in 0..n {
            let _ = parse_control(&b[..cut]);
        }
        assert!(push(&mut b, 60, libc::SOL_UDP, UDP_GRO, &[0; 4]).is_none());
    }

    #[test]
    fn sockaddrs_decode() {
        let v4: SocketAddr = "127.0.0.1:4792".parse().unwrap();
        let s = socket2::SockAddr::from(v4);
        // SockAddr's storage as bytes, via its public accessors.
        let bytes = sockaddr_bytes(&s);
        assert_eq!(parse_sockaddr(&bytes), Some(v4));
        let v6: SocketAddr = "[::1]:9".parse().unwrap();
        assert_eq!(
            parse_sockaddr(&sockaddr_bytes(&socket2::SockAddr::from(v6))),
            Some(v6)
        );
        let mapped: SocketAddr = "[::ffff:10.0.0.1]:5".parse().unwrap();
        assert_eq!(
            parse_sockaddr(&sockaddr_bytes(&socket2::SockAddr::from(mapped))),
            Some("10.0.0.1:5".parse().unwrap())
        );
        assert_eq!(parse_sockaddr(&[0; 3]), None);
        assert_eq!(parse_sockaddr(&[0; 28]), None);
    }

    fn sockaddr_bytes(s: &socket2::SockAddr) -> Vec<u8> {
        match s.as_socket() {
            Some(SocketAddr::V4(a)) => {
                let mut b = vec![0u8; 16];
                b[..2].copy_from_slice(&(libc::AF_INET as u16).to_ne_bytes());
                b[2..4].copy_from_slice(&a.port().to_be_bytes());
                b[4..8].copy_from_slice(&a.ip().octets());
                b
            }
            Some(SocketAddr::V6(a)) => {
                let mut b = vec![0u8; 28];
                b[..2].copy_from_slice(&(libc::AF_INET6 as u16).to_ne_bytes());
                b[2..4].copy_from_slice(&a.port().to_be_bytes());
                b[4..8].copy_from_slice(&a.flowinfo().to_be_bytes());
                b[8..24].copy_from_slice(&a.ip().octets());
                b[24..28].copy_from_slice(&a.scope_id().to_ne_bytes());
                b
            }
            None => Vec::new(),
        }
    }
}
