//! Path MTU: datagrams are never fragmented, and the endpoint's MTU should
//! fit the route to the peer.

use socket2::{Domain, Protocol, Socket, Type};
use std::net::SocketAddr;
use std::os::fd::AsRawFd;

/// Sets "don't fragment" (path MTU discovery, `IP_PMTUDISC_DO`) on a UDP socket.
pub(crate) fn set_dont_fragment(s: &Socket, v6: bool) {
    let (level, name, value) = if v6 {
        (
            libc::IPPROTO_IPV6,
            libc::IPV6_MTU_DISCOVER,
            libc::IPV6_PMTUDISC_DO,
        )
    } else {
        (
            libc::IPPROTO_IP,
            libc::IP_MTU_DISCOVER,
            libc::IP_PMTUDISC_DO,
        )
    };
    // SAFETY: `value` is a live `c_int` for the duration of the call and the
    // length passed is its size; the fd belongs to `s`, which outlives it.
    let r = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            level,
            name,
            std::ptr::addr_of!(value).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r != 0 {
        tracing::debug!(error = %std::io::Error::last_os_error(), "cannot set don't-fragment");
    }
}

/// The largest UDP payload that fits the route to `dst` without
/// fragmentation (the route's MTU minus IP and UDP headers), as the kernel
/// knows it now. Use it to bound `EndpointConfig::mtu` before talking to a
/// peer across a network whose MTU may be smaller than the default's.
///
/// ```
/// let p = metaroce_io::max_udp_payload("127.0.0.1:9".parse().unwrap()).unwrap();
/// assert!(p >= 1472);
/// ```
pub fn max_udp_payload(dst: SocketAddr) -> std::io::Result<usize> {
    let s = Socket::new(Domain::for_address(dst), Type::DGRAM, Some(Protocol::UDP))?;
    s.connect(&dst.into())?;
    let (level, name, headers) = if dst.is_ipv6() {
        (libc::IPPROTO_IPV6, libc::IPV6_MTU, 40 + 8)
    } else {
        (libc::IPPROTO_IP, libc::IP_MTU, 20 + 8)
    };
    let mut mtu: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `mtu` and `len` are live locals the kernel writes at most
    // `len` bytes into; the fd belongs to `s`, which outlives the call.
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            level,
            name,
            std::ptr::addr_of_mut!(mtu).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok((mtu as usize).saturating_sub(headers))
}
