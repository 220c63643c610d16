//! The AF_XDP driver: the endpoint's datagrams bypass the kernel's UDP and
//! IP stack on both sides.
//!
//! - **Receive**: an XDP program on the interface (`bpf.rs`) redirects IPv4
//!   UDP frames to the endpoint's address and port into an AF_XDP socket
//!   (`xsk.rs`); everything else (ARP, ICMP, the perf control connection,
//!   other UDP) goes on to the kernel. The core reads each datagram where
//!   the kernel put it, in the UMEM, and the chunk goes back to the fill
//!   ring.
//! - **Transmit**: the core writes each datagram straight into a UMEM
//!   frame behind the 42 bytes of Ethernet, IPv4 and UDP headers this
//!   driver writes itself (UDP checksum computed, ECN in the TOS byte), with
//!   the next hop's Ethernet address from the kernel's route and neighbour
//!   tables (`route.rs`, over rtnetlink, refreshed when they change).
//!   A datagram whose next hop is not resolved yet, or whose route leaves
//!   by another interface, is sent through an ordinary UDP socket of the
//!   same port instead: the kernel resolves the neighbour on the way, and
//!   later datagrams take the AF_XDP path.
//!
//! One socket on one receive queue (`XdpConfig::queue`, 0 by default);
//! frames that a NIC's RSS puts on another queue pass to the kernel and are
//! read from the UDP socket bound on the same port (counted as
//! `kernel_received`). IPv4 only, one plane. The mode (zero copy where the
//! driver has it, copy otherwise, as on veth) is logged and reported in
//! [`DriverStats::xdp_zero_copy`](crate::DriverStats).
//!
//! Needs `CAP_NET_ADMIN` and `CAP_BPF` (root). The program is attached with
//! a BPF link, so it is detached when the driver is dropped or the process
//! ends, however it ends.
//!
//! Frames fit one 4 KiB UMEM chunk (the kernel refuses larger chunks in
//! aligned mode, and copy mode receives into one chunk): the endpoint's MTU
//! is at most [`PAGE_CHUNK_MAX_PAYLOAD`] (3798 bytes), and within the
//! interface's. The UDP checksum of a received frame is not verified: a
//! frame taken before the kernel's stack may carry a checksum that its
//! sender left to offload (as veth and local senders do), and there is no
//! way to tell; turn on `EndpointConfig::crc32c` for end-to-end integrity.
//!
//! ```no_run
//! use metaroce_io::{Backend, Driver, DriverConfig};
//! let mut cfg = DriverConfig::new("10.77.1.1:0".parse().unwrap());
//! cfg.backend = Backend::AfXdp;
//! cfg.xdp.iface = Some("eth0".into()); // default: the interface that holds 10.77.1.1
//! let drv = Driver::bind(cfg).unwrap();
//! println!("{}", drv.xdp_info().unwrap()); // "copy mode, driver XDP hook, eth0"
//! ```

pub(crate) mod bpf;
mod raw;
mod route;
mod xsk;

pub use raw::RawXdp;

pub use crate::config::{XdpConfig, XdpInfo, XdpMode};
pub use route::route_interface;
pub use xsk::XskStats;

use crate::fault::{self, Faults};
use crate::sockets::Sockets;
use crate::waker::{WakeReceiver, Waker};
use crate::{Clock, DriverConfig, DriverError, DriverStats, FaultConfig};
use metaroce_proto::{Ecn, Endpoint, Instant};
use route::{Hop, Routes};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4};
use std::os::fd::{AsRawFd, OwnedFd};
use std::time::Duration;
use xsk::{Xsk, XskConfig, MAX_RX_FRAME};

/// Ethernet + IPv4 (no options) + UDP headers.
const HEADERS: usize = 14 + 20 + 8;
/// The largest UDP payload a frame in one UMEM chunk holds: the MTU this
/// backend offers its peers (the connection takes the smaller of both
/// sides').
pub const PAGE_CHUNK_MAX_PAYLOAD: u16 = (MAX_RX_FRAME - HEADERS) as u16;

/// Runs one [`Endpoint`] on an AF_XDP socket. Single-threaded, like the
/// other drivers: call [`poll`](Self::poll) in a loop.
pub struct XdpDriver {
    ep: Endpoint,
    clock: Clock,
    /// The socket, its program, the route cache and the UDP sockets.
    port: Port,
    cpus: usize,
    tx_buf: Vec<u8>,
    turn_send_bytes: usize,
    turn_recv_bytes: usize,
    busy_poll: Duration,
    stats: DriverStats,
    faults: Option<Box<Faults>>,
    wake: Option<WakeReceiver>,
    /// When the side channels are looked at next, and whether a wait saw
    /// one readable.
    side_next: Instant,
    side_due: bool,
}

/// How often a busy driver looks at its side channels.
const SIDE_CHANNEL_EVERY: Duration = Duration::from_millis(1);

impl std::fmt::Debug for XdpDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("XdpDriver")
            .field("local", &self.port.local)
            .field("iface", &self.port.ifname)
            .field("mode", &self.port.xsk.mode)
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

fn unavailable(what: &str, e: std::io::Error) -> DriverError {
    let hint = match e.raw_os_error() {
        Some(libc::EPERM) | Some(libc::EACCES) => {
            " (AF_XDP needs CAP_NET_ADMIN and CAP_BPF: run as root)"
        }
        Some(libc::EAFNOSUPPORT) => " (this kernel has no AF_XDP sockets: CONFIG_XDP_SOCKETS)",
        _ => "",
    };
    DriverError::XdpUnavailable(format!("{what}: {e}{hint}"))
}

/// What both the driver and [`RawXdp`] stand on: the AF_XDP socket, the
/// program that feeds it, the route cache and the endpoint's UDP sockets.
pub(crate) struct Port {
    pub(crate) xsk: Xsk,
    pub(crate) routes: Routes,
    /// The UDP sockets of the endpoint's ports: they keep the ports taken,
    /// and carry what the AF_XDP path cannot (see the module docs).
    pub(crate) sockets: Sockets,
    pub(crate) local: SocketAddrV4,
    pub(crate) ifname: String,
    pub(crate) mac: [u8; 6],
    pub(crate) if_mtu: u32,
    pub(crate) counters: bpf::Map,
    /// Held for as long as the port lives: dropping the link detaches the
    /// program, then the program and the socket map go.
    _link: OwnedFd,
    _prog: bpf::Program,
    _xsk_map: bpf::Map,
    pub(crate) attach_mode: &'static str,
}

impl Port {
    /// Checks the configuration, binds the UDP sockets, loads and attaches
    /// the program and opens the socket.
    pub(crate) fn open(cfg: &DriverConfig) -> Result<Port, DriverError> {
        if !cfg.planes.is_empty() {
            return Err(DriverError::Config(
                "the AF_XDP backend runs one plane".into(),
            ));
        }
        let IpAddr::V4(ip) = cfg.listen.ip() else {
            return Err(DriverError::Config(
                "the AF_XDP backend carries IPv4 only".into(),
            ));
        };
        if ip.is_unspecified() || ip.is_loopback() {
            return Err(DriverError::Config(format!(
                "the AF_XDP backend needs the address of an Ethernet interface to bind \
                 (not {ip}): it writes that address into every frame"
            )));
        }
        let ifname = match &cfg.xdp.iface {
            Some(n) => n.clone(),
            None => route::interface_of(ip).map_err(|e| DriverError::Config(e.to_string()))?,
        };
        let ifindex =
            route::interface_index(&ifname).map_err(|e| DriverError::Config(e.to_string()))?;
        let mut routes = Routes::new(ifindex).map_err(|e| unavailable("rtnetlink socket", e))?;
        let (mac, queues, if_mtu) = routes
            .link()
            .map_err(|e| DriverError::Config(format!("interface {ifname}: {e}")))?;
        let sockets = Sockets::bind(cfg)?;
        let local = match sockets.local {
            SocketAddr::V4(a) => a,
            SocketAddr::V6(_) => unreachable!("bound to an IPv4 address"),
        };
        // The program first: an interface with another one attached is
        // refused before anything else is set up. Until the socket is in
        // its map, the program passes our frames on to the kernel.
        let queues = queues.max(cfg.xdp.queue + 1);
        let xsk_map = bpf::Map::xsk(queues).map_err(|e| unavailable("XSKMAP", e))?;
        let counters = bpf::Map::counters().map_err(|e| unavailable("counter map", e))?;
        let insns = bpf::program(ip, local.port(), xsk_map.fd(), counters.fd());
        let prog = bpf::Program::load(&insns).map_err(|(e, log)| {
            unavailable(&format!("loading the XDP program (verifier: {log})"), e)
        })?;
        let (link, attach_mode) = attach(&prog, ifindex, &ifname)?;
        let xsk = open_socket(cfg, ifindex, &ifname)?;
        xsk_map
            .set_socket(cfg.xdp.queue, xsk.fd())
            .map_err(|e| unavailable("XSKMAP entry", e))?;
        // The kernel's UDP sockets are not read from on the hot path: keep
        // them non-blocking for the fallback.
        for s in sockets.recv.iter().chain(&sockets.send) {
            s.set_nonblocking(true)?;
        }
        Ok(Port {
            xsk,
            routes,
            sockets,
            local,
            ifname,
            mac,
            if_mtu,
            counters,
            _link: link,
            _prog: prog,
            _xsk_map: xsk_map,
            attach_mode,
        })
    }

    /// Mode, hook and interface.
    pub(crate) fn info(&self) -> XdpInfo {
        XdpInfo {
            mode: self.xsk.mode,
            attach: self.attach_mode,
            iface: self.ifname.clone(),
        }
    }

    /// The largest UDP payload a frame may carry: one UMEM chunk, within
    /// the interface's MTU.
    pub(crate) fn max_payload(&self) -> u16 {
        self.if_mtu
            .saturating_sub(28)
            .min(u32::from(PAGE_CHUNK_MAX_PAYLOAD)) as u16
    }
}

impl XdpDriver {
    /// Opens the AF_XDP socket on the interface, loads and attaches the
    /// XDP program, binds the UDP sockets of the endpoint's ports and
    /// creates the endpoint.
    pub fn bind(cfg: DriverConfig) -> Result<Self, DriverError> {
        let port = Port::open(&cfg)?;
        let mut ecfg = port.sockets.endpoint_config(cfg.endpoint.clone());
        ecfg.mtu = ecfg.mtu.min(port.max_payload());
        ecfg.max_gso_segments = 1;
        let ep = Endpoint::new(ecfg, cfg.endpoint_seed())?;
        let (mode, attach_mode) = (port.xsk.mode, port.attach_mode);
        tracing::info!(
            local = %port.local,
            iface = %port.ifname,
            queue = cfg.xdp.queue,
            %mode,
            attach = attach_mode,
            frames = port.xsk.rx_frames + port.xsk.tx_frames,
            mtu = ep.config().mtu,
            "AF_XDP driver bound: {mode} mode, XDP program attached in {attach_mode} mode"
        );
        let stats = DriverStats {
            xdp_zero_copy: mode == XdpMode::ZeroCopy,
            ..DriverStats::default()
        };
        let faults = Faults::new(&cfg.faults);
        Ok(XdpDriver {
            ep,
            clock: Clock::new(),
            port,
            cpus: bpf::possible_cpus(),
            tx_buf: vec![0u8; 65_536],
            turn_send_bytes: cfg.turn_send_bytes,
            turn_recv_bytes: cfg.turn_recv_bytes,
            busy_poll: cfg.busy_poll,
            stats,
            faults,
            wake: None,
            side_next: Instant::ZERO,
            side_due: true,
        })
    }

    /// The endpoint.
    pub fn endpoint(&mut self) -> &mut Endpoint {
        &mut self.ep
    }

    /// The address peers reach this endpoint at.
    pub fn local_addr(&self) -> SocketAddr {
        SocketAddr::V4(self.port.local)
    }

    /// The current time on the driver's clock.
    pub fn now(&self) -> Instant {
        self.clock.now()
    }

    /// The interface the socket is bound to.
    pub fn interface(&self) -> &str {
        &self.port.ifname
    }

    /// Zero copy or copy.
    pub fn mode(&self) -> XdpMode {
        self.port.xsk.mode
    }

    /// How the XDP program is attached: `driver` (the interface's own
    /// hook) or `generic`.
    pub fn attach_mode(&self) -> &'static str {
        self.port.attach_mode
    }

    /// Mode, hook and interface, as `perf` reports them.
    pub fn info(&self) -> XdpInfo {
        self.port.info()
    }

    /// The driver's counters, with the socket's and the XDP program's.
    pub fn stats(&self) -> DriverStats {
        let x = self.port.xsk.stats();
        let mut s = self.stats;
        s.xdp_rx_dropped = x.rx_dropped;
        s.xdp_rx_ring_full = x.rx_ring_full;
        s.xdp_fill_ring_empty = x.rx_fill_ring_empty;
        s.xdp_invalid_descs = x.invalid_descs;
        s.xdp_tx_dropped = x.tx_dropped;
        s.xdp_fill_level = u64::from(x.fill_level);
        s.xdp_tx_free = u64::from(x.tx_free);
        s.xdp_passed = self
            .port
            .counters
            .sum(bpf::COUNT_PASS, self.cpus)
            .unwrap_or(0);
        s.xdp_redirected = self
            .port
            .counters
            .sum(bpf::COUNT_REDIRECT, self.cpus)
            .unwrap_or(0);
        s.route_lookups = self.port.routes.lookups;
        s
    }

    /// A handle that cuts this driver's wait short from another thread.
    pub fn waker(&mut self) -> Result<Waker, DriverError> {
        Ok(WakeReceiver::waker_in(&mut self.wake)?)
    }

    /// Replaces the fault injection.
    pub fn set_faults(&mut self, faults: FaultConfig) {
        fault::replace(&mut self.faults, &faults, self.clock.now(), &mut self.ep);
    }

    /// Runs one turn of the loop (see [`IoDriver::poll`](crate::IoDriver::poll)).
    pub fn poll(&mut self, max_wait: Duration) -> Result<(), DriverError> {
        self.poll_turn(max_wait).map(|_| ())
    }

    fn poll_turn(&mut self, max_wait: Duration) -> Result<bool, DriverError> {
        crate::turn::poll_turn(self, max_wait)
    }

    /// The side channels (route changes, datagrams the program passed to
    /// the kernel's socket) cost a system call each to look at: at most
    /// once a millisecond, or when a wait saw them readable. Whether the
    /// socket had anything.
    fn side_channels(&mut self) -> Result<bool, DriverError> {
        let now = self.clock.now();
        if !self.side_due && now < self.side_next {
            return Ok(false);
        }
        self.side_due = false;
        self.side_next = now + SIDE_CHANNEL_EVERY;
        self.port.routes.refresh();
        self.receive_kernel()
    }

    pub(crate) fn turn(&mut self) -> Result<bool, DriverError> {
        self.poll_turn(Duration::ZERO)
    }

    pub(crate) fn idle_wait(&mut self) -> Option<Duration> {
        let now = self.clock.now();
        let wait = fault::timer_wait(&mut self.ep, self.faults.as_deref(), now, Duration::MAX);
        (!wait.is_zero()).then_some(wait)
    }

    pub(crate) fn wait_fds(&self) -> Vec<std::os::fd::RawFd> {
        vec![
            self.port.xsk.fd(),
            self.port.sockets.recv[0].as_raw_fd(),
            self.port.routes.event_fd(),
        ]
    }

    /// Sends what the core has, up to the turn's budget; whether any went.
    fn flush(&mut self) -> Result<bool, DriverError> {
        let mut any = false;
        let mut budget = self.turn_send_bytes;
        let wall = std::time::Instant::now();
        let XdpDriver {
            ep,
            clock,
            port:
                Port {
                    xsk,
                    routes,
                    sockets,
                    local,
                    mac,
                    ..
                },
            stats,
            ..
        } = self;
        while !any || budget > 0 {
            let now = clock.now();
            let offload = xsk.csum_offload;
            let Some((addr, frame)) = xsk.tx_frame() else {
                stats.xdp_tx_full += 1;
                break;
            };
            let Some(t) = ep.poll_transmit(now, &mut frame[HEADERS..]) else {
                break;
            };
            any = true;
            budget = budget.saturating_sub(t.size);
            let SocketAddr::V4(dst) = t.dst else {
                stats.send_errors += 1;
                continue;
            };
            match routes.hop(*dst.ip(), wall) {
                Hop::Mac(next) => {
                    let src = SocketAddrV4::new(*local.ip(), t.src_port);
                    write_headers(
                        &mut frame[..HEADERS + t.size],
                        *mac,
                        next,
                        src,
                        dst,
                        t.ecn,
                        offload,
                    );
                    xsk.send(addr, HEADERS + t.size, Some(UDP_CSUM));
                    stats.datagrams_sent += 1;
                }
                Hop::Kernel => {
                    let s = match sockets.send_index(t.src_ip, t.src_port) {
                        Some(i) => &sockets.send[i],
                        None => &sockets.recv[0],
                    };
                    match s.send_to(&frame[HEADERS..HEADERS + t.size], t.dst) {
                        Ok(_) => {
                            stats.datagrams_sent += 1;
                            stats.kernel_sent += 1;
                        }
                        Err(e) => {
                            stats.send_errors += 1;
                            tracing::debug!(error = %e, dst = %t.dst, "send failed");
                        }
                    }
                }
            }
        }
        let published = xsk.flush()?;
        if !published {
            xsk.retry_kick()?;
        }
        Ok(any)
    }

    /// Reads what the AF_XDP socket (and, for frames the XDP program
    /// passed on, the UDP socket) has, up to the turn's budget.
    fn receive(&mut self) -> Result<bool, DriverError> {
        let XdpDriver {
            ep,
            clock,
            port: Port { xsk, local, .. },
            stats,
            faults,
            ..
        } = self;
        let mut any = false;
        let mut budget = self.turn_recv_bytes;
        let now = clock.now();
        let port = local.port();
        let ip = *local.ip();
        for _ in 0..64 {
            if any && budget == 0 {
                break;
            }
            let n = xsk.receive(64, |frame| {
                budget = budget.saturating_sub(frame.len());
                match parse(frame, ip, port) {
                    Ok((from, ecn, dg)) => {
                        stats.datagrams_received += 1;
                        stats.received_per_plane[0] += 1;
                        fault::deliver(faults, now, now, SocketAddr::V4(from), ecn, dg, ep, stats);
                    }
                    Err(why) => {
                        stats.recv_dropped += 1;
                        tracing::debug!(why, len = frame.len(), "frame refused");
                    }
                }
            });
            if n == 0 {
                break;
            }
            any = true;
        }
        Ok(any)
    }

    /// Reads what the kernel's UDP socket on the endpoint's port got:
    /// frames on a queue without our socket, or sent before the program
    /// was attached. Whether there was any.
    fn receive_kernel(&mut self) -> Result<bool, DriverError> {
        let XdpDriver {
            ep,
            clock,
            stats,
            faults,
            port: Port { sockets, .. },
            tx_buf,
            ..
        } = self;
        let now = clock.now();
        let mut any = false;
        for _ in 0..64 {
            match sockets.recv[0].recv_from(tx_buf) {
                Ok((n, from)) => {
                    any = true;
                    stats.datagrams_received += 1;
                    stats.kernel_received += 1;
                    fault::deliver(faults, now, now, from, Ecn::NotEct, &tx_buf[..n], ep, stats);
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Ok(any)
    }

    fn release(&mut self) -> bool {
        match &mut self.faults {
            Some(f) => f.release(self.clock.now(), &mut self.ep),
            None => false,
        }
    }

    /// Before a turn sleeps ([`DriverConfig::busy_poll`]): watches the
    /// receive ring, in shared memory, without a system call (the kernel
    /// fills it from its own context), and every few microseconds the
    /// other descriptors, for up to the busy-poll time (at most `wait`).
    /// True if something arrived.
    fn busy_poll(&mut self, wait: Duration) -> Result<bool, DriverError> {
        let spin = self.busy_poll.min(wait);
        if spin.is_zero() {
            return Ok(false);
        }
        let until = std::time::Instant::now() + spin;
        let mut k = 0u32;
        loop {
            if self.port.xsk.rx_pending() {
                return Ok(true);
            }
            k = k.wrapping_add(1);
            if k % 256 == 0 {
                if self.wait_readable(Duration::ZERO)? {
                    return Ok(true);
                }
                if std::time::Instant::now() >= until {
                    return Ok(false);
                }
            }
            std::hint::spin_loop();
        }
    }

    /// Waits until the AF_XDP socket, the UDP socket, a route change or the
    /// waker is readable, at most `timeout`. True if one is.
    fn wait_readable(&mut self, timeout: Duration) -> Result<bool, DriverError> {
        // Frames published while the kernel was busy go out first.
        self.port.xsk.retry_kick()?;
        let pollfd = crate::sockets::readable;
        let mut pfd = [
            pollfd(self.port.xsk.fd()),
            pollfd(self.port.sockets.recv[0].as_raw_fd()),
            pollfd(self.port.routes.event_fd()),
            pollfd(-1),
        ];
        if let Some(w) = &self.wake {
            pfd[3] = pollfd(w.fd());
        }
        let r = crate::sockets::wait_readable(&mut pfd, timeout)?;
        if let Some(w) = &self.wake {
            if pfd[3].revents != 0 {
                w.drain();
            }
        }
        if pfd[1].revents != 0 || pfd[2].revents != 0 {
            self.side_due = true;
        }
        Ok(r > 0)
    }
}

impl crate::turn::TurnParts for XdpDriver {
    fn parts(&mut self) -> (&mut Endpoint, &Clock, Option<&Faults>, &mut DriverStats) {
        (
            &mut self.ep,
            &self.clock,
            self.faults.as_deref(),
            &mut self.stats,
        )
    }
    fn before(&mut self) -> Result<bool, DriverError> {
        self.side_channels()
    }
    fn flush(&mut self) -> Result<bool, DriverError> {
        XdpDriver::flush(self)
    }
    fn receive(&mut self) -> Result<bool, DriverError> {
        XdpDriver::receive(self)
    }
    fn release(&mut self) -> bool {
        XdpDriver::release(self)
    }
    fn busy_poll(&mut self, wait: Duration) -> Result<bool, DriverError> {
        XdpDriver::busy_poll(self, wait)
    }
    fn wait_readable(&mut self, timeout: Duration) -> Result<bool, DriverError> {
        XdpDriver::wait_readable(self, timeout)
    }
}

/// Opens the AF_XDP socket on the configured queue. A queue still held by
/// a socket closed a moment ago (the kernel releases it asynchronously) is
/// waited for, up to a second; one held longer is another endpoint's.
fn open_socket(cfg: &DriverConfig, ifindex: u32, ifname: &str) -> Result<Xsk, DriverError> {
    let t0 = std::time::Instant::now();
    loop {
        let r = Xsk::open(XskConfig {
            ifindex,
            queue: cfg.xdp.queue,
            frames: cfg.xdp.frames,
            ring: cfg.xdp.ring,
            zero_copy: cfg.xdp.zero_copy,
        });
        match r {
            Ok(x) => return Ok(x),
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                if t0.elapsed() < Duration::from_secs(1) {
                    std::thread::sleep(Duration::from_millis(20));
                    continue;
                }
                return Err(DriverError::XdpUnavailable(format!(
                    "queue {} of {ifname} is taken by another AF_XDP socket (another \
                     endpoint runs on it): {e}",
                    cfg.xdp.queue
                )));
            }
            Err(e) => return Err(unavailable(&format!("AF_XDP socket on {ifname}"), e)),
        }
    }
}

/// Attaches `prog` to `ifindex`: the driver's hook where it has one, else
/// the generic one.
fn attach(
    prog: &bpf::Program,
    ifindex: u32,
    ifname: &str,
) -> Result<(OwnedFd, &'static str), DriverError> {
    let busy =
        |e: &std::io::Error| matches!(e.raw_os_error(), Some(libc::EBUSY) | Some(libc::EEXIST));
    match prog.attach(ifindex, bpf::XDP_FLAGS_DRV_MODE) {
        Ok(l) => Ok((l, "driver")),
        Err(e) if busy(&e) => Err(another_program(ifname, e)),
        Err(e) => {
            tracing::debug!(error = %e, iface = ifname, "no driver XDP hook; generic");
            match prog.attach(ifindex, bpf::XDP_FLAGS_SKB_MODE) {
                Ok(l) => Ok((l, "generic")),
                Err(e) if busy(&e) => Err(another_program(ifname, e)),
                Err(e) => Err(unavailable(
                    &format!("attaching the XDP program to {ifname}"),
                    e,
                )),
            }
        }
    }
}

fn another_program(ifname: &str, e: std::io::Error) -> DriverError {
    DriverError::XdpUnavailable(format!(
        "another XDP program is attached to {ifname} ({e}); detach it first \
         (`ip link set dev {ifname} xdp off`) or use another backend"
    ))
}

/// Where the UDP checksum's coverage starts in a frame, and its field
/// within that (for checksum offload).
const UDP_CSUM: (u16, u16) = (34, 6);

/// Writes the Ethernet, IPv4 and UDP headers in front of the datagram that
/// fills the rest of `frame`. With `offload`, the UDP checksum field gets
/// the pseudo-header's sum, for the NIC (or the kernel) to complete over
/// the datagram; without, the whole checksum.
fn write_headers(
    frame: &mut [u8],
    src_mac: [u8; 6],
    dst_mac: [u8; 6],
    src: SocketAddrV4,
    dst: SocketAddrV4,
    ecn: Ecn,
    offload: bool,
) {
    let udp_len = frame.len() - 14 - 20;
    let (hdr, payload) = frame.split_at_mut(HEADERS);
    hdr[0..6].copy_from_slice(&dst_mac);
    hdr[6..12].copy_from_slice(&src_mac);
    hdr[12..14].copy_from_slice(&[0x08, 0x00]);
    let ip = &mut hdr[14..34];
    ip[0] = 0x45;
    ip[1] = ecn.bits();
    ip[2..4].copy_from_slice(&((20 + udp_len) as u16).to_be_bytes());
    ip[4..6].copy_from_slice(&[0, 0]);
    ip[6..8].copy_from_slice(&[0x40, 0x00]); // don't fragment
    ip[8] = 64;
    ip[9] = 17;
    ip[10..12].copy_from_slice(&[0, 0]);
    ip[12..16].copy_from_slice(&src.ip().octets());
    ip[16..20].copy_from_slice(&dst.ip().octets());
    let c = fold(sum(ip, 0));
    ip[10..12].copy_from_slice(&(!c).to_be_bytes());
    let udp = &mut hdr[34..42];
    udp[0..2].copy_from_slice(&src.port().to_be_bytes());
    udp[2..4].copy_from_slice(&dst.port().to_be_bytes());
    udp[4..6].copy_from_slice(&(udp_len as u16).to_be_bytes());
    udp[6..8].copy_from_slice(&[0, 0]);
    if offload {
        let len = udp_len as u64;
        let pseudo = u64::from(u32::from(*src.ip())) + u64::from(u32::from(*dst.ip())) + 17 + len;
        hdr[40..42].copy_from_slice(&fold(pseudo).to_be_bytes());
        return;
    }
    let c = !fold(udp_sum(*src.ip(), *dst.ip(), udp, payload));
    // A computed zero is sent as all ones (zero means "no checksum").
    let c = if c == 0 { 0xffff } else { c };
    hdr[40..42].copy_from_slice(&c.to_be_bytes());
}

/// The one's-complement sum over the UDP pseudo-header, header and payload
/// (not yet folded or inverted).
fn udp_sum(src: Ipv4Addr, dst: Ipv4Addr, udp: &[u8], payload: &[u8]) -> u64 {
    let len = (udp.len() + payload.len()) as u64;
    let mut acc = u64::from(u32::from(src)) + u64::from(u32::from(dst)) + 17 + len;
    acc = sum(udp, acc);
    sum(payload, acc)
}

/// Adds `b` to a one's-complement accumulator as big-endian 16-bit words,
/// 8 bytes at a time (the sum of 32-bit halves is the same in 16-bit words
/// once folded).
fn sum(b: &[u8], mut acc: u64) -> u64 {
    let mut chunks = b.chunks_exact(8);
    for c in &mut chunks {
        let w = u64::from_be_bytes(c.try_into().expect("8 bytes"));
        let (s, carry) = acc.overflowing_add(w);
        acc = s + u64::from(carry);
    }
    let rest = chunks.remainder();
    let mut tail = [0u8; 8];
    tail[..rest.len()].copy_from_slice(rest);
    let w = u64::from_be_bytes(tail);
    let (s, carry) = acc.overflowing_add(w);
    s + u64::from(carry)
}

/// Folds a 64-bit one's-complement accumulator to 16 bits.
fn fold(mut acc: u64) -> u16 {
    acc = (acc & 0xffff_ffff) + (acc >> 32);
    acc = (acc & 0xffff_ffff) + (acc >> 32);
    acc = (acc & 0xffff) + (acc >> 16);
    acc = (acc & 0xffff) + (acc >> 16);
    acc as u16
}

/// The sender, ECN and UDP payload of a frame addressed to `ip`:`port`, or
/// why it is refused. The XDP program let only such frames through, but
/// every length is checked again here: the frame came from the network.
fn parse(
    frame: &[u8],
    ip: Ipv4Addr,
    port: u16,
) -> Result<(SocketAddrV4, Ecn, &[u8]), &'static str> {
    if frame.len() < HEADERS || frame[12..14] != [0x08, 0x00] {
        return Err("not IPv4");
    }
    let h = &frame[14..];
    let ihl = usize::from(h[0] & 0x0f) * 4;
    if h[0] >> 4 != 4 || ihl < 20 || h.len() < ihl + 8 {
        return Err("bad IPv4 header");
    }
    if h[9] != 17 {
        return Err("not UDP");
    }
    let total = usize::from(u16::from_be_bytes([h[2], h[3]]));
    if total < ihl + 8 || total > h.len() {
        return Err("bad IPv4 length");
    }
    if Ipv4Addr::new(h[16], h[17], h[18], h[19]) != ip {
        return Err("not our address");
    }
    let udp = &h[ihl..total];
    if u16::from_be_bytes([udp[2], udp[3]]) != port {
        return Err("not our port");
    }
    let ulen = usize::from(u16::from_be_bytes([udp[4], udp[5]]));
    if ulen < 8 || ulen > udp.len() {
        return Err("bad UDP length");
    }
    let src = SocketAddrV4::new(
        Ipv4Addr::new(h[12], h[13], h[14], h[15]),
        u16::from_be_bytes([udp[0], udp[1]]),
    );
    Ok((src, Ecn::from_bits(h[1] & 0x03), &udp[8..ulen]))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two network namespaces joined by a veth pair: `xa` (10.99.0.1/24)
    /// in the first, `xb` (10.99.0.2/24) in the second; removed on drop.
    struct Veth {
        ns: [String; 2],
    }

    impl Veth {
        /// The pair, or `None` (said on stdout) where namespaces cannot be
        /// made (not root).
        fn new(tag: &str) -> Option<Veth> {
            let ns = [0, 1].map(|k| format!("mrxu{}{tag}{k}", std::process::id()));
            let ip = |args: &[&str]| {
                std::process::Command::new("ip")
                    .args(args)
                    .output()
                    .is_ok_and(|o| o.status.success())
            };
            if !ip(&["netns", "add", &ns[0]]) {
                println!("skipped: cannot create a network namespace (needs root and iproute2)");
                return None;
            }
            let v = Veth { ns };
            let (a, b) = (&v.ns[0], &v.ns[1]);
            for args in [
                &["netns", "add", b][..],
                &[
                    "-n", a, "link", "add", "xa", "type", "veth", "peer", "name", "xb", "netns", b,
                ],
                &["-n", a, "addr", "add", "10.99.0.1/24", "dev", "xa"],
                &["-n", b, "addr", "add", "10.99.0.2/24", "dev", "xb"],
                &["-n", a, "link", "set", "xa", "up"],
                &["-n", b, "link", "set", "xb", "up"],
            ] {
                assert!(ip(args), "ip {args:?}");
            }
            Some(v)
        }

        /// Runs `f` on a thread that entered namespace `k` (0 or 1).
        fn run<T: Send + 'static>(&self, k: usize, f: impl FnOnce() -> T + Send + 'static) -> T {
            let path = format!("/run/netns/{}", self.ns[k]);
            std::thread::spawn(move || {
                let file = std::fs::File::open(&path).expect("the namespace file");
                // SAFETY: setns with a namespace descriptor moves only this
                // thread into that network namespace.
                let r = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
                assert_eq!(r, 0, "setns: {}", std::io::Error::last_os_error());
                f()
            })
            .join()
            .expect("the namespace thread")
        }
    }

    impl Drop for Veth {
        fn drop(&mut self) {
            for ns in &self.ns {
                let _ = std::process::Command::new("ip")
                    .args(["netns", "del", ns])
                    .output();
            }
        }
    }

    fn xdp_cfg(addr: &str) -> DriverConfig {
        let mut cfg = DriverConfig::new(addr.parse().unwrap());
        cfg.backend = crate::Backend::AfXdp;
        cfg.xdp.frames = 256;
        cfg.xdp.ring = 64;
        cfg
    }

    #[test]
    fn another_xdp_program_on_the_interface_is_refused_clearly() {
        let Some(veth) = Veth::new("p") else { return };
        veth.run(0, || {
            let ifindex = route::interface_index("xa").unwrap();
            let maps = (bpf::Map::xsk(1).unwrap(), bpf::Map::counters().unwrap());
            let insns = bpf::program(Ipv4Addr::new(10, 99, 0, 1), 1, maps.0.fd(), maps.1.fd());
            let prog = bpf::Program::load(&insns).expect("the verifier takes the program");
            let link = prog
                .attach(ifindex, bpf::XDP_FLAGS_SKB_MODE)
                .expect("attach");
            let err = XdpDriver::bind(xdp_cfg("10.99.0.1:0")).unwrap_err();
            let msg = err.to_string();
            assert!(
                msg.contains("another XDP program is attached to xa"),
                "{msg}"
            );
            // Gone with its link: the interface is free again.
            drop(link);
            let drv = XdpDriver::bind(xdp_cfg("10.99.0.1:0")).expect("bind once the hook is free");
            assert_eq!(drv.interface(), "xa");
            // The driver's own program goes with the driver.
            drop(drv);
            let again = prog.attach(ifindex, bpf::XDP_FLAGS_SKB_MODE);
            assert!(again.is_ok(), "the driver left its program: {again:?}");
        });
    }

    #[test]
    fn two_af_xdp_drivers_exchange_a_verified_write_over_veth() {
        use metaroce_proto::verbs::{
            AccessFlags, QpInit, RemoteAddr, SendOp, SendWr, Sge, WcStatus,
        };
        let Some(veth) = Veth::new("w") else { return };
        let mut a = veth.run(0, || {
            XdpDriver::bind(xdp_cfg("10.99.0.1:0")).expect("bind a")
        });
        let mut b = veth.run(1, || {
            XdpDriver::bind(xdp_cfg("10.99.0.2:0")).expect("bind b")
        });
        assert_eq!(a.info().iface, "xa");
        {
            let data: Vec<u8> = (0..1 << 20).map(|i: u32| (i * 31 + 7) as u8).collect();
            let (pa, pb) = (a.endpoint().alloc_pd(), b.endpoint().alloc_pd());
            let (cqa, cqb) = (a.endpoint().create_cq(64), b.endpoint().create_cq(64));
            let src = a
                .endpoint()
                .reg_mr(pa, data.clone().into_boxed_slice(), 0, AccessFlags::NONE)
                .unwrap();
            let dst = b
                .endpoint()
                .reg_mr(
                    pb,
                    vec![0u8; data.len()].into_boxed_slice(),
                    0,
                    AccessFlags::REMOTE_WRITE,
                )
                .unwrap();
            let qa = a.endpoint().create_qp(QpInit::new(pa, cqa, cqa)).unwrap();
            let qb = b.endpoint().create_qp(QpInit::new(pb, cqb, cqb)).unwrap();
            let now = a.now();
            let ca = a.endpoint().connect(now, b.local_addr()).unwrap();
            let t0 = std::time::Instant::now();
            let mut cb = None;
            while cb.is_none()
                || a.endpoint().connection_state(ca)
                    != Some(metaroce_proto::ConnectionState::Established)
            {
                a.poll(Duration::from_millis(1)).unwrap();
                b.poll(Duration::from_millis(1)).unwrap();
                while let Some(e) = b.endpoint().poll_event() {
                    if let metaroce_proto::Event::Incoming { conn, .. } = e {
                        cb = Some(conn);
                    }
                }
                while a.endpoint().poll_event().is_some() {}
                assert!(t0.elapsed() < Duration::from_secs(10), "no connection");
            }
            a.endpoint().connect_qp(qa, ca, qb).unwrap();
            b.endpoint().connect_qp(qb, cb.unwrap(), qa).unwrap();
            let wr = SendWr::new(
                1,
                SendOp::Write(RemoteAddr {
                    rkey: dst.rkey,
                    addr: 0,
                }),
                Sge {
                    lkey: src.lkey,
                    addr: 0,
                    len: data.len() as u32,
                },
            );
            let now = a.now();
            a.endpoint().post_send(now, qa, wr).unwrap();
            let mut wcs = Vec::new();
            while wcs.is_empty() {
                a.poll(Duration::from_millis(1)).unwrap();
                b.poll(Duration::from_millis(1)).unwrap();
                a.endpoint().poll_cq(cqa, 8, &mut wcs).unwrap();
                assert!(
                    t0.elapsed() < Duration::from_secs(20),
                    "the WRITE never completed"
                );
            }
            assert_eq!(
                wcs[0].status,
                WcStatus::Success,
                "{:?}\n{:?}",
                a.stats(),
                b.stats()
            );
            assert!(
                b.endpoint().mr(dst.lkey).unwrap() == &data[..],
                "every byte arrived"
            );
            let (sa, sb) = (a.stats(), b.stats());
            assert!(
                sb.xdp_redirected > 0 && sa.xdp_redirected > 0,
                "{sa:?} {sb:?}"
            );
            // 1 MiB in datagrams of at most 3798 bytes: most went out as
            // frames of the driver's own making (the first ones through the
            // kernel's socket, while it resolved the neighbour) and all came
            // in through the XDP program.
            assert!(sa.datagrams_sent - sa.kernel_sent >= 200, "{sa:?}");
            assert_eq!(sb.kernel_received, 0, "{sb:?}");
            assert_eq!(sb.xdp_invalid_descs, 0);
            // The counters reach Prometheus.
            let mut m = crate::Metrics::new("b").unwrap();
            m.update_driver(&sb);
            let text = m.encode();
            let line = format!(
                "metaroce_driver_xdp_redirected_total{{endpoint=\"b\"}} {}",
                sb.xdp_redirected
            );
            assert!(text.contains(&line), "{text}");
            assert!(
                text.contains("metaroce_driver_xdp_fill_level{endpoint=\"b\"} 64"),
                "{text}"
            );

            // A neighbour change announced by the kernel voids the cache:
            // the next datagram looks its next hop up again.
            let before = a.stats().route_lookups;
            let ns = veth.ns[0].clone();
            let ok = std::process::Command::new("ip")
                .args(["-n", &ns, "neigh", "replace", "10.99.0.2", "lladdr"])
                .args(["02:00:00:00:00:02", "dev", "xa", "nud", "permanent"])
                .status()
                .is_ok_and(|s| s.success());
            assert!(ok, "ip neigh replace");
            let now = a.now();
            let wr = SendWr::new(
                2,
                SendOp::Write(RemoteAddr {
                    rkey: dst.rkey,
                    addr: 0,
                }),
                Sge {
                    lkey: src.lkey,
                    addr: 0,
                    len: 4096,
                },
            );
            a.endpoint().post_send(now, qa, wr).unwrap();
            let t1 = std::time::Instant::now();
            while a.stats().route_lookups == before {
                a.poll(Duration::from_millis(1)).unwrap();
                b.poll(Duration::from_millis(1)).unwrap();
                assert!(t1.elapsed() < Duration::from_secs(5), "no new lookup");
            }
        }
    }

    #[test]
    fn headers_round_trip_through_the_parser_with_valid_checksums() {
        let payload: Vec<u8> = (0..1001u32).map(|i| (i * 7) as u8).collect();
        let mut frame = vec![0u8; HEADERS + payload.len()];
        frame[HEADERS..].copy_from_slice(&payload);
        let src: SocketAddrV4 = "10.77.1.1:40001".parse().unwrap();
        let dst: SocketAddrV4 = "10.77.2.1:18515".parse().unwrap();
        write_headers(&mut frame, [2; 6], [4; 6], src, dst, Ecn::Ect0, false);
        // The IPv4 header and the UDP datagram both sum to 0xffff.
        assert_eq!(fold(sum(&frame[14..34], 0)), 0xffff);
        let udp = &frame[34..];
        let pseudo = udp_sum(*src.ip(), *dst.ip(), &udp[..8], &udp[8..]);
        assert_eq!(fold(pseudo), 0xffff);
        let (from, ecn, dg) = parse(&frame, *dst.ip(), dst.port()).unwrap();
        assert_eq!((from, ecn, dg), (src, Ecn::Ect0, &payload[..]));
    }

    #[test]
    fn an_offloaded_checksum_completed_as_a_nic_would_is_valid() {
        let payload: Vec<u8> = (0..777u32).map(|i| (i * 13) as u8).collect();
        let mut frame = vec![0u8; HEADERS + payload.len()];
        frame[HEADERS..].copy_from_slice(&payload);
        let src: SocketAddrV4 = "10.77.1.1:40001".parse().unwrap();
        let dst: SocketAddrV4 = "10.77.2.1:18515".parse().unwrap();
        write_headers(&mut frame, [2; 6], [4; 6], src, dst, Ecn::Ect0, true);
        // The device sums from csum_start (the field holds the pseudo
        // header's sum) and writes the complement at csum_offset.
        let (start, offset) = (usize::from(UDP_CSUM.0), usize::from(UDP_CSUM.1));
        let c = !fold(sum(&frame[start..], 0));
        frame[start + offset..start + offset + 2].copy_from_slice(&c.to_be_bytes());
        let mut whole = frame.clone();
        write_headers(&mut whole, [2; 6], [4; 6], src, dst, Ecn::Ect0, false);
        assert_eq!(
            frame, whole,
            "the same checksum as the one computed in full"
        );
    }

    #[test]
    fn the_checksum_matches_the_rfc_1071_example() {
        // RFC 1071 §3: the words 0001 f203 f4f5 f6f7 sum to ddf2.
        assert_eq!(
            fold(sum(&[0x00, 0x01, 0xf2, 0x03, 0xf4, 0xf5, 0xf6, 0xf7], 0)),
            0xddf2
        );
    }

    #[test]
    fn truncated_and_foreign_frames_are_refused_without_panicking() {
        let mut frame = vec![0u8; HEADERS + 16];
        let src: SocketAddrV4 = "10.0.0.1:1".parse().unwrap();
        let dst: SocketAddrV4 = "10.0.0.2:2".parse().unwrap();
        write_headers(&mut frame, [0; 6], [0; 6], src, dst, Ecn::NotEct, false);
        for n in 0..frame.len() {
            let _ = parse(&frame[..n], *dst.ip(), 2);
        }
        assert!(parse(&frame, *dst.ip(), 3).is_err());
        assert!(parse(&frame, Ipv4Addr::new(10, 0, 0, 9), 2).is_err());
        let mut long = frame.clone();
        long[16..18].copy_from_slice(&9000u16.to_be_bytes());
        assert!(parse(&long, *dst.ip(), 2).is_err());
        assert!(parse(&frame, *dst.ip(), 2).is_ok());
    }
}
