//! The UDP sockets of one driver, for both backends: per plane a receive
//! socket on the listen port and one send socket per source port (the same
//! port numbers on every plane, so that a path keeps its entropy whichever
//! plane it is on).

use crate::{DriverConfig, DriverError};
use metaroce_proto::EndpointConfig;
use rustc_hash::FxHashMap;
use socket2::{Domain, Protocol, Socket, Type};
use std::net::{IpAddr, SocketAddr, UdpSocket};

/// How often a port is chosen anew when it is free on plane 0 but taken on
/// another plane's address.
const PORT_ATTEMPTS: usize = 32;

/// A UDP socket bound to `addr` with kernel buffers of `buffer` bytes (blocking).
pub(crate) fn udp_socket(addr: SocketAddr, buffer: usize) -> Result<UdpSocket, DriverError> {
    let s = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP))?;
    // Larger kernel buffers absorb bursts; the kernel may clamp them.
    let _ = s.set_recv_buffer_size(buffer);
    let _ = s.set_send_buffer_size(buffer);
    // Never fragment: a fragment carries no UDP port, so ECMP could not
    // spray it, and one lost fragment loses the datagram. Too large a
    // datagram fails loudly instead (see `max_udp_payload`).
    crate::mtu::set_dont_fragment(&s, addr.is_ipv6());
    s.bind(&addr.into())
        .map_err(|source| DriverError::Bind { addr, source })?;
    Ok(s.into())
}

/// Binds `port` (0: a free one) on every address of `ips`: one socket per
/// address, all with the same port number.
fn bind_on_all(ips: &[IpAddr], port: u16, buffer: usize) -> Result<Vec<UdpSocket>, DriverError> {
    let mut last = None;
    for _ in 0..PORT_ATTEMPTS {
        let first = udp_socket(SocketAddr::new(ips[0], port), buffer)?;
        let chosen = first.local_addr()?.port();
        let mut all = vec![first];
        for &ip in &ips[1..] {
            match udp_socket(SocketAddr::new(ip, chosen), buffer) {
                Ok(s) => all.push(s),
                // Taken there: with a port of our choosing, try another.
                Err(DriverError::Bind { addr, source })
                    if port == 0 && source.kind() == std::io::ErrorKind::AddrInUse =>
                {
                    last = Some(DriverError::Bind { addr, source });
                    break;
                }
                Err(e) => return Err(e),
            }
        }
        if all.len() == ips.len() {
            return Ok(all);
        }
    }
    Err(last.expect("only a port taken on another plane retries"))
}

/// The bound sockets.
pub(crate) struct Sockets {
    /// Receive sockets, plane 0 first.
    pub recv: Vec<UdpSocket>,
    /// Send sockets, plane-major: plane `k`'s socket for `ports[j]` is
    /// `send[k * ports.len() + j]`.
    pub send: Vec<UdpSocket>,
    /// The source ports, the same on every plane.
    pub ports: Vec<u16>,
    /// The local address of each plane.
    pub ips: Vec<IpAddr>,
    /// The address peers reach plane 0 at.
    pub local: SocketAddr,
    /// The smallest receive buffer the kernel gave a receive socket
    /// (`SO_RCVBUF` as read back: the kernel's own accounting, which
    /// charges each datagram its buffer's full size), if it says.
    pub recv_buffer: Option<u64>,
    /// Send socket of each (plane address, source port): looked up for every
    /// transmit, with a fast hash (the keys are our own).
    by_src: FxHashMap<(IpAddr, u16), usize>,
}

impl Sockets {
    /// Binds what `cfg` asks for: `cfg.listen` and `cfg.planes`, each with
    /// the listen port and `cfg.send_sockets` source ports.
    pub fn bind(cfg: &DriverConfig) -> Result<Sockets, DriverError> {
        let mut ips = vec![cfg.listen.ip()];
        for &ip in &cfg.planes {
            if ip.is_unspecified() || cfg.listen.ip().is_unspecified() {
                return Err(DriverError::Config(
                    "every plane needs a specific local address (not 0.0.0.0 or ::)".into(),
                ));
            }
            if ip.is_ipv4() != cfg.listen.is_ipv4() || ips.contains(&ip) {
                return Err(DriverError::Config(format!(
                    "plane address {ip}: planes need distinct addresses of one family"
                )));
            }
            ips.push(ip);
        }
        if ips.len() > metaroce_proto::consts::MAX_PLANES {
            return Err(DriverError::Config(format!(
                "at most {} planes",
                metaroce_proto::consts::MAX_PLANES
            )));
        }
        let recv = bind_on_all(&ips, cfg.listen.port(), cfg.socket_buffer)?;
        let n = cfg.send_sockets.max(1);
        let mut per_port = Vec::with_capacity(n);
        for _ in 0..n {
            per_port.push(bind_on_all(&ips, 0, cfg.socket_buffer)?);
        }
        let ports: Vec<u16> = per_port
            .iter()
            .map(|s| s[0].local_addr().map(|a| a.port()))
            .collect::<Result<_, _>>()?;
        // Port-major as bound, plane-major as kept: each port's sockets
        // come out in plane order.
        let mut columns: Vec<_> = per_port.into_iter().map(Vec::into_iter).collect();
        let mut send = Vec::with_capacity(n * ips.len());
        let mut by_src = FxHashMap::default();
        for &ip in &ips {
            for (j, column) in columns.iter_mut().enumerate() {
                let sock = column.next().expect("one socket per plane");
                by_src.insert((ip, ports[j]), send.len());
                send.push(sock);
            }
        }
        let local = recv[0].local_addr()?;
        let recv_buffer = recv
            .iter()
            .map(|s| socket2::SockRef::from(s).recv_buffer_size().ok())
            .min()
            .flatten()
            .map(|b| b as u64);
        Ok(Sockets {
            local,
            recv_buffer,
            recv,
            send,
            ports,
            ips,
            by_src,
        })
    }

    /// The send socket for a transmit from `src_ip` (`None`: plane 0) and
    /// `port`, if there is one.
    pub fn send_index(&self, src_ip: Option<IpAddr>, port: u16) -> Option<usize> {
        self.by_src
            .get(&(src_ip.unwrap_or(self.ips[0]), port))
            .copied()
    }

    /// The receive socket of the plane of `src_ip` (plane 0 if none): what
    /// sends a transmit whose port has no send socket of its own.
    pub fn recv_index(&self, src_ip: Option<IpAddr>) -> usize {
        src_ip
            .and_then(|ip| self.ips.iter().position(|&p| p == ip))
            .unwrap_or(0)
    }

    /// `endpoint` with what was bound: listen port, source ports, with
    /// several planes their addresses, and unless it has one, the receive
    /// buffer its peers share: half of what the kernel gave each receive
    /// socket (the kernel charges a datagram more than its bytes).
    pub fn endpoint_config(&self, mut endpoint: EndpointConfig) -> EndpointConfig {
        if endpoint.receive_buffer.is_none() {
            endpoint.receive_buffer = self.recv_buffer.map(|b| (b / 2).max(1));
        }
        endpoint.listen_port = self.local.port();
        endpoint.source_ports = self.ports.clone();
        endpoint.plane_ips = if self.ips.len() > 1 {
            self.ips.clone()
        } else {
            Vec::new()
        };
        endpoint
    }
}

/// The datagrams of one receive: a GRO batch cut at its `stride` (the last
/// one may be shorter), or the whole buffer when the kernel gave no stride.
/// An empty receive is one empty datagram, not none: the core must see it to
/// count and refuse it like any other malformed datagram.
pub(crate) fn datagrams(batch: &[u8], stride: Option<usize>) -> impl Iterator<Item = &[u8]> {
    let stride = stride.filter(|&s| s > 0).unwrap_or(batch.len()).max(1);
    let empty = batch.is_empty().then_some(batch);
    batch.chunks(stride).chain(empty)
}

/// A `pollfd` waiting for `fd` to be readable (a negative `fd` is ignored).
pub(crate) fn readable(fd: std::os::fd::RawFd) -> libc::pollfd {
    libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    }
}

/// Waits until one of `pfd` is readable or `timeout` passed (to the
/// nanosecond; zero only looks); fills their `revents`. The number
/// readable; an interrupted wait is a wake with none.
pub(crate) fn wait_readable(
    pfd: &mut [libc::pollfd],
    timeout: std::time::Duration,
) -> std::io::Result<usize> {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs().min(i64::MAX as u64) as libc::time_t,
        tv_nsec: libc::c_long::from(timeout.subsec_nanos() as i32),
    };
    // SAFETY: `pfd` is a valid array of `pfd.len()` pollfds that lives
    // across the call, `ts` a valid timespec; a null signal mask leaves the
    // mask alone.
    let r = unsafe {
        libc::ppoll(
            pfd.as_mut_ptr(),
            pfd.len() as libc::nfds_t,
            &ts,
            std::ptr::null(),
        )
    };
    if r < 0 {
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
        return Ok(0);
    }
    Ok(r as usize)
}
