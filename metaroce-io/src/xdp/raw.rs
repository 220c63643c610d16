//! A raw AF_XDP datagram pump: the driver's socket, program and headers
//! with no protocol on top, to measure what the path itself can carry.

use super::route::Hop;
use super::{write_headers, Port, HEADERS};
use crate::{DriverConfig, DriverError, XdpInfo};
use metaroce_proto::Ecn;
use std::net::{SocketAddr, SocketAddrV4};
use std::time::Duration;

/// UDP datagrams over an AF_XDP socket and nothing else: the ceiling of
/// the AF_XDP path on an interface, against which [`XdpDriver`](super::XdpDriver)
/// is measured (`examples/xdp_pump.rs`). Set up exactly as the driver is
/// (the same program, socket, rings and headers; see the module docs), from
/// the same [`DriverConfig`]; needs root.
///
/// ```no_run
/// use metaroce_io::{xdp::RawXdp, DriverConfig};
/// let mut raw = RawXdp::open(&DriverConfig::new("10.77.1.1:0".parse().unwrap())).unwrap();
/// let peer = "10.77.2.1:9000".parse().unwrap();
/// // Until the kernel knows the next hop, a datagram goes through it.
/// while raw.send(peer, &[0u8; 64], 32).unwrap() == 0 {}
/// raw.recv(64, |from, payload| println!("{from}: {} bytes", payload.len()));
/// ```
pub struct RawXdp {
    port: Port,
}

impl std::fmt::Debug for RawXdp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawXdp")
            .field("local", &self.port.local)
            .field("iface", &self.port.ifname)
            .finish_non_exhaustive()
    }
}

impl RawXdp {
    /// Opens the socket on the configured address's interface (see
    /// [`XdpDriver::bind`](super::XdpDriver::bind) for what it checks).
    pub fn open(cfg: &DriverConfig) -> Result<RawXdp, DriverError> {
        Ok(RawXdp {
            port: Port::open(cfg)?,
        })
    }

    /// The address datagrams are received at.
    pub fn local_addr(&self) -> SocketAddrV4 {
        self.port.local
    }

    /// Mode, hook and interface.
    pub fn info(&self) -> XdpInfo {
        self.port.info()
    }

    /// The largest payload a datagram may carry (one UMEM chunk, within the
    /// interface's MTU).
    pub fn max_payload(&self) -> usize {
        usize::from(self.port.max_payload())
    }

    /// Sends up to `n` copies of `payload` to `dst` from the local address,
    /// headers and checksums written as the driver writes them; returns how
    /// many went into the transmit ring. While the next hop is unresolved,
    /// one copy goes through the kernel's socket instead (which resolves
    /// it) and 0 is returned.
    pub fn send(&mut self, dst: SocketAddrV4, payload: &[u8], n: usize) -> std::io::Result<usize> {
        let len = payload.len().min(self.max_payload());
        let Port {
            xsk,
            routes,
            sockets,
            local,
            mac,
            ..
        } = &mut self.port;
        routes.refresh();
        let next = match routes.hop(*dst.ip(), std::time::Instant::now()) {
            Hop::Mac(m) => m,
            Hop::Kernel => {
                sockets.recv[0].send_to(&payload[..len], SocketAddr::V4(dst))?;
                return Ok(0);
            }
        };
        let mut sent = 0;
        while sent < n {
            let offload = xsk.csum_offload;
            let Some((addr, frame)) = xsk.tx_frame() else {
                break;
            };
            frame[HEADERS..HEADERS + len].copy_from_slice(&payload[..len]);
            let frame = &mut frame[..HEADERS + len];
            write_headers(frame, *mac, next, *local, dst, Ecn::Ect0, offload);
            xsk.send(addr, HEADERS + len, Some(super::UDP_CSUM));
            sent += 1;
        }
        xsk.flush()?;
        Ok(sent)
    }

    /// Calls `f` with the sender and payload of each datagram received (at
    /// most `max`); returns how many there were.
    pub fn recv(&mut self, max: u32, mut f: impl FnMut(SocketAddrV4, &[u8])) -> u32 {
        let Port { xsk, local, .. } = &mut self.port;
        let (ip, port) = (*local.ip(), local.port());
        xsk.receive(max, |frame| {
            if let Ok((from, _, dg)) = super::parse(frame, ip, port) {
                f(from, dg);
            }
        })
    }

    /// Waits until a frame is received or `timeout` passes.
    pub fn wait(&mut self, timeout: Duration) -> std::io::Result<()> {
        self.port.xsk.retry_kick()?;
        let mut pfd = libc::pollfd {
            fd: self.port.xsk.fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: one valid pollfd, alive across the call.
        let r = unsafe { libc::poll(&mut pfd, 1, ms) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
        Ok(())
    }

    /// Whether a frame waits in the receive ring (no system call).
    pub fn pending(&mut self) -> bool {
        self.port.xsk.rx_pending()
    }
}
