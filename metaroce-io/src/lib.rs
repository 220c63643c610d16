//! Drivers that run the sans-IO [`metaroce_proto`] core on real UDP sockets.
//!
//! Two backends behind one seam, the [`IoDriver`] trait:
//!
//! - [`UringDriver`] (Linux ≥ 6.0): a multishot `RECVMSG` into a registered
//!   provided-buffer ring with UDP GRO and ECN from the control data,
//!   `SENDMSG` with `UDP_SEGMENT` (GSO) and `IP_TOS`, `SENDMSG_ZC` (zero copy)
//!   for large transmits, the core's timer as a `TIMEOUT` on the ring, and
//!   one `io_uring_enter` per busy loop turn (a turn that sleeps adds one
//!   to send what woke it).
//! - [`PortableDriver`]: `std` sockets set up with `socket2`, ECN, GRO and
//!   GSO through `quinn-udp`, a `ppoll` wait bounded by the core's next timer.
//!
//! Around them: [`FaultConfig`] injects seeded loss, duplication and
//! reordering into what both backends receive (off by default, for tests),
//! and [`Metrics`] turns the core's stats into Prometheus metrics, served by
//! [`MetricsServer`] on `/metrics`.
//!
//! Both bind one receive socket on the endpoint's port and one send socket
//! per path source port, so that each path has its own ECMP entropy (twice as many send sockets as paths by default, so that a failed path can move to an unused port).
//! [`Driver::bind`] picks the backend: [`Backend::Auto`] (the default) takes
//! io_uring when the kernel supports it ([`uring_probe`]) and falls back to
//! the portable backend, logging which and why; [`Backend::Uring`] and
//! [`Backend::Portable`] force one. [`XdpDriver`] (Linux, root), asked for
//! with [`Backend::AfXdp`] and never picked by `Auto`, bypasses the
//! kernel's UDP/IP stack: see the [`xdp`] module. Another backend plugs in
//! by implementing [`IoDriver`] and adding a [`Driver`] variant.
//!
//! ```no_run
//! use metaroce_io::{Backend, Driver, DriverConfig};
//! use std::time::Duration;
//! let mut cfg = DriverConfig::new("127.0.0.1:0".parse().unwrap());
//! cfg.backend = Backend::Auto; // io_uring if the kernel can, else portable
//! let mut drv = Driver::bind(cfg).unwrap();
//! println!("running on {}", drv.backend());
//! let peer = "127.0.0.2:4792".parse().unwrap();
//! let now = drv.now();
//! let conn = drv.endpoint().connect(now, peer).unwrap();
//! loop {
//!     drv.poll(Duration::from_millis(1)).unwrap();
//!     if let Some(ev) = drv.endpoint().poll_event() {
//!         println!("{ev:?}");
//!         break;
//!     }
//! }
//! # let _ = conn;
//! ```

mod clock;
mod config;
pub mod device;
mod error;
mod fault;
mod memory;
mod metrics;
mod mtu;
mod pair;
mod portable;
mod sockets;
mod turn;
#[cfg(target_os = "linux")]
mod uring;
mod waker;
#[cfg(target_os = "linux")]
pub mod xdp;

pub use clock::Clock;
pub use config::{
    Backend, DriverConfig, DriverStats, UnknownBackend, UringConfig, XdpConfig, XdpInfo, XdpMode,
    DEFAULT_TURN_RECV_BYTES, DEFAULT_TURN_SEND_BYTES,
};
pub use device::{
    connect_qp_pair, ApiError, CompletionQueue, ConnectedQp, Connection, Device, LentRegion,
    MemoryRegion, OobDecodeError, ProtectionDomain, QpCaps, QpEndpoint, QueuePair, RemoteMr,
    WorkRequest, REG_MR_THREAD_BYTES,
};
pub use error::DriverError;
pub use fault::FaultConfig;
pub use memory::{make_resident, Mapping};
pub use metrics::{Metrics, MetricsServer, Refresh};
pub use mtu::max_udp_payload;
pub use pair::{connect_pair, PairError};
pub use portable::PortableDriver;
#[cfg(target_os = "linux")]
pub use uring::{uring_probe, UringCaps, UringDriver, ZC_COPIED_LIMIT};
pub use waker::Waker;
#[cfg(target_os = "linux")]
pub use xdp::XdpDriver;

/// The sans-IO core this crate drives, whole: everything the driver API's
/// [`Endpoint`] takes and gives.
pub use metaroce_proto as proto;
// Every type in this crate's public signatures, nameable from here.
pub use metaroce_proto::verbs::{
    AccessFlags, ConnectionHandle, CqHandle, MrInfo, PdHandle, QpAttrs, QpInit, QpState, Qpn,
    RcAttrs, RecvWr, RegionBuf, RemoteAddr, SendOp, SendWr, SgList, Sge, VerbsError, WcOpcode,
    WcStatus, WorkCompletion,
};
pub use metaroce_proto::{
    ConnectionError, ConnectionState, ConnectionStats, Endpoint, EndpointConfig, EndpointStats,
    Event, Instant, PathState, PathStats, RejectCounters, RejectReason,
};
pub use prometheus::Registry;
use std::net::SocketAddr;
use std::time::Duration;

/// Whether this kernel can run the io_uring backend (never, off Linux).
#[cfg(not(target_os = "linux"))]
pub fn uring_probe() -> Result<(), String> {
    Err("io_uring exists on Linux only".into())
}

/// What every backend offers: an [`Endpoint`] on sockets, driven by
/// [`poll`](IoDriver::poll). Code generic over it runs on any backend.
pub trait IoDriver {
    /// Binds the sockets and creates the endpoint.
    fn bind(cfg: DriverConfig) -> Result<Self, DriverError>
    where
        Self: Sized;
    /// Which backend this is (never [`Backend::Auto`]).
    fn backend(&self) -> Backend;
    /// The endpoint, to post work, connect, and poll completions and events.
    fn endpoint(&mut self) -> &mut Endpoint;
    /// The current time on the driver's clock.
    fn now(&self) -> Instant;
    /// The address peers reach this endpoint at.
    fn local_addr(&self) -> SocketAddr;
    /// Runs one turn of the loop: receives, runs due timers, sends, and if
    /// nothing happened waits at most `max_wait` (or until the core's next
    /// timer) for something to. A turn that made completions or events
    /// ([`Endpoint::unpolled`] grew), or that a [`Waker`] cut short, does
    /// not wait: the caller has something to look at.
    fn poll(&mut self, max_wait: Duration) -> Result<(), DriverError>;
    /// The driver's own counters.
    fn stats(&self) -> DriverStats;
    /// Replaces the fault injection (see [`FaultConfig`]); datagrams held
    /// back by the old one are still delivered when due.
    fn set_faults(&mut self, faults: FaultConfig);
    /// A handle that cuts the driver's wait in [`poll`](IoDriver::poll)
    /// short from another thread (see [`Waker`]).
    fn waker(&mut self) -> Result<Waker, DriverError>;
}

impl IoDriver for PortableDriver {
    fn bind(cfg: DriverConfig) -> Result<Self, DriverError> {
        PortableDriver::bind(cfg)
    }
    fn backend(&self) -> Backend {
        Backend::Portable
    }
    fn endpoint(&mut self) -> &mut Endpoint {
        PortableDriver::endpoint(self)
    }
    fn now(&self) -> Instant {
        PortableDriver::now(self)
    }
    fn local_addr(&self) -> SocketAddr {
        PortableDriver::local_addr(self)
    }
    fn poll(&mut self, max_wait: Duration) -> Result<(), DriverError> {
        PortableDriver::poll(self, max_wait)
    }
    fn stats(&self) -> DriverStats {
        PortableDriver::stats(self)
    }
    fn set_faults(&mut self, faults: FaultConfig) {
        PortableDriver::set_faults(self, faults)
    }
    fn waker(&mut self) -> Result<Waker, DriverError> {
        PortableDriver::waker(self)
    }
}

#[cfg(target_os = "linux")]
impl IoDriver for XdpDriver {
    fn bind(cfg: DriverConfig) -> Result<Self, DriverError> {
        XdpDriver::bind(cfg)
    }
    fn backend(&self) -> Backend {
        Backend::AfXdp
    }
    fn endpoint(&mut self) -> &mut Endpoint {
        XdpDriver::endpoint(self)
    }
    fn now(&self) -> Instant {
        XdpDriver::now(self)
    }
    fn local_addr(&self) -> SocketAddr {
        XdpDriver::local_addr(self)
    }
    fn poll(&mut self, max_wait: Duration) -> Result<(), DriverError> {
        XdpDriver::poll(self, max_wait)
    }
    fn stats(&self) -> DriverStats {
        XdpDriver::stats(self)
    }
    fn set_faults(&mut self, faults: FaultConfig) {
        XdpDriver::set_faults(self, faults)
    }
    fn waker(&mut self) -> Result<Waker, DriverError> {
        XdpDriver::waker(self)
    }
}

/// A driver on the backend [`DriverConfig::backend`] chose.
///
/// Both variants are large (socket state and buffers' bookkeeping, the
/// buffers themselves are on the heap); a program has one per endpoint and
/// never moves it on a hot path, so they are not boxed.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)]
pub enum Driver {
    /// The io_uring backend.
    #[cfg(target_os = "linux")]
    Uring(UringDriver),
    /// The portable backend.
    Portable(PortableDriver),
    /// The AF_XDP backend.
    #[cfg(target_os = "linux")]
    AfXdp(XdpDriver),
}

macro_rules! each {
    ($self:expr, $d:ident => $e:expr) => {
        match $self {
            #[cfg(target_os = "linux")]
            Driver::Uring($d) => $e,
            Driver::Portable($d) => $e,
            #[cfg(target_os = "linux")]
            Driver::AfXdp($d) => $e,
        }
    };
}

impl Driver {
    /// Binds on the configured backend. With [`Backend::Auto`], io_uring if
    /// [`uring_probe`] passes and its set-up succeeds, else portable; one
    /// `info` line says which and why. A forced [`Backend::Uring`] fails
    /// with [`DriverError::UringUnavailable`] where io_uring cannot run.
    pub fn bind(cfg: DriverConfig) -> Result<Self, DriverError> {
        let (drv, why) = match cfg.backend {
            Backend::Portable => (
                Driver::Portable(PortableDriver::bind(cfg)?),
                "configured".to_string(),
            ),
            #[cfg(target_os = "linux")]
            Backend::Uring => (
                Driver::Uring(UringDriver::bind(cfg)?),
                "configured".to_string(),
            ),
            #[cfg(not(target_os = "linux"))]
            Backend::Uring => {
                return Err(DriverError::UringUnavailable(
                    "io_uring exists on Linux only".into(),
                ))
            }
            #[cfg(target_os = "linux")]
            Backend::AfXdp => (
                Driver::AfXdp(XdpDriver::bind(cfg)?),
                "configured".to_string(),
            ),
            #[cfg(not(target_os = "linux"))]
            Backend::AfXdp => {
                return Err(DriverError::XdpUnavailable(
                    "AF_XDP exists on Linux only".into(),
                ))
            }
            Backend::Auto => Self::bind_auto(cfg)?,
        };
        let mut drv = drv;
        let gso_segments = drv.endpoint().config().max_gso_segments;
        tracing::info!(
            backend = %drv.backend(),
            local = %drv.local_addr(),
            gso_segments,
            "metaroce driver: {} backend ({why})",
            drv.backend()
        );
        Ok(drv)
    }

    #[cfg(target_os = "linux")]
    fn bind_auto(cfg: DriverConfig) -> Result<(Driver, String), DriverError> {
        match uring_probe() {
            Ok(caps) => match UringDriver::bind(cfg.clone()) {
                Ok(d) => Ok((
                    Driver::Uring(d),
                    format!(
                        "auto: kernel supports io_uring (zero copy {})",
                        if caps.sendmsg_zc {
                            "available"
                        } else {
                            "unavailable"
                        }
                    ),
                )),
                Err(DriverError::UringUnavailable(why)) => Ok((
                    Driver::Portable(PortableDriver::bind(cfg)?),
                    format!("auto: io_uring set-up failed: {why}"),
                )),
                Err(e) => Err(e),
            },
            Err(why) => Ok((
                Driver::Portable(PortableDriver::bind(cfg)?),
                format!("auto: io_uring unavailable: {why}"),
            )),
        }
    }

    #[cfg(not(target_os = "linux"))]
    fn bind_auto(cfg: DriverConfig) -> Result<(Driver, String), DriverError> {
        Ok((
            Driver::Portable(PortableDriver::bind(cfg)?),
            "auto: io_uring exists on Linux only".into(),
        ))
    }

    /// Which backend runs (never [`Backend::Auto`]).
    pub fn backend(&self) -> Backend {
        each!(self, d => IoDriver::backend(d))
    }

    /// On the AF_XDP backend: its mode, XDP hook and interface.
    pub fn xdp_info(&self) -> Option<XdpInfo> {
        match self {
            #[cfg(target_os = "linux")]
            Driver::AfXdp(d) => Some(d.info()),
            _ => None,
        }
    }

    /// The endpoint, to post work, connect, and poll completions and events.
    pub fn endpoint(&mut self) -> &mut Endpoint {
        each!(self, d => IoDriver::endpoint(d))
    }

    /// The current time on the driver's clock.
    pub fn now(&self) -> Instant {
        each!(self, d => IoDriver::now(d))
    }

    /// The address peers reach this endpoint at.
    pub fn local_addr(&self) -> SocketAddr {
        each!(self, d => IoDriver::local_addr(d))
    }

    /// Runs one turn of the loop (see [`IoDriver::poll`]).
    pub fn poll(&mut self, max_wait: Duration) -> Result<(), DriverError> {
        each!(self, d => IoDriver::poll(d, max_wait))
    }

    /// The driver's own counters.
    pub fn stats(&self) -> DriverStats {
        each!(self, d => IoDriver::stats(d))
    }

    /// One turn that never sleeps, for a caller (the Device on a runtime)
    /// that waits between turns itself: on [`wait_fds`](Self::wait_fds)
    /// becoming readable, for at most [`idle_wait`](Self::idle_wait).
    /// Whether the turn did anything (then another should follow at once).
    pub(crate) fn turn(&mut self) -> Result<bool, DriverError> {
        each!(self, d => d.turn())
    }

    /// Whether a [`turn`](Self::turn) now would surely find nothing to do
    /// (io_uring only, where it is known without a system call; `false`
    /// elsewhere). The caller must not rely on it after changing the
    /// endpoint itself.
    pub(crate) fn quiet(&mut self) -> bool {
        match self {
            #[cfg(target_os = "linux")]
            Driver::Uring(d) => d.quiet(),
            _ => false,
        }
    }

    /// How long such a caller may wait before the next turn (the core's
    /// next timer; `Duration::MAX` if none); `None`: a turn is due now.
    pub(crate) fn idle_wait(&mut self) -> Option<Duration> {
        each!(self, d => d.idle_wait())
    }

    /// The descriptors such a caller waits on (readable: a turn has work).
    pub(crate) fn wait_fds(&self) -> Vec<std::os::fd::RawFd> {
        each!(self, d => d.wait_fds())
    }

    /// Replaces the fault injection (see [`IoDriver::set_faults`]).
    pub fn set_faults(&mut self, faults: FaultConfig) {
        each!(self, d => IoDriver::set_faults(d, faults))
    }

    /// A handle that cuts [`poll`](Self::poll)'s wait short from another
    /// thread (see [`Waker`]).
    pub fn waker(&mut self) -> Result<Waker, DriverError> {
        each!(self, d => IoDriver::waker(d))
    }
}

impl IoDriver for Driver {
    fn bind(cfg: DriverConfig) -> Result<Self, DriverError> {
        Driver::bind(cfg)
    }
    fn backend(&self) -> Backend {
        Driver::backend(self)
    }
    fn endpoint(&mut self) -> &mut Endpoint {
        Driver::endpoint(self)
    }
    fn now(&self) -> Instant {
        Driver::now(self)
    }
    fn local_addr(&self) -> SocketAddr {
        Driver::local_addr(self)
    }
    fn poll(&mut self, max_wait: Duration) -> Result<(), DriverError> {
        Driver::poll(self, max_wait)
    }
    fn stats(&self) -> DriverStats {
        Driver::stats(self)
    }
    fn set_faults(&mut self, faults: FaultConfig) {
        Driver::set_faults(self, faults)
    }
    fn waker(&mut self) -> Result<Waker, DriverError> {
        Driver::waker(self)
    }
}

/// Why [`read_psk_file`] found no key.
#[derive(Debug, thiserror::Error)]
pub enum PskFileError {
    /// The file could not be read.
    #[error("cannot read the key file {path}: {source}")]
    Read {
        /// The file.
        path: std::path::PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file does not hold exactly 32 bytes.
    #[error("the key file {path} holds {len} bytes; a pre-shared key is exactly 32")]
    Length {
        /// The file.
        path: std::path::PathBuf,
        /// Its length.
        len: usize,
    },
}

/// Reads a pre-shared key (PROTOCOL §3.2) from a file of exactly 32 bytes,
/// for [`EndpointConfig::psk`](metaroce_proto::EndpointConfig::psk) (in
/// [`DriverConfig::endpoint`]). Make one with
/// `head -c 32 /dev/urandom > key`.
///
/// ```
/// let path = std::env::temp_dir().join(format!("metaroce-psk-doc-{}", std::process::id()));
/// std::fs::write(&path, [7u8; 32]).unwrap();
/// let mut cfg = metaroce_io::DriverConfig::new("127.0.0.1:0".parse().unwrap());
/// cfg.endpoint.psk = Some(metaroce_io::read_psk_file(&path).unwrap());
/// std::fs::write(&path, [7u8; 31]).unwrap();
/// assert!(metaroce_io::read_psk_file(&path).is_err());
/// std::fs::remove_file(&path).unwrap();
/// ```
pub fn read_psk_file(path: &std::path::Path) -> Result<metaroce_proto::Psk, PskFileError> {
    let bytes = std::fs::read(path).map_err(|source| PskFileError::Read {
        path: path.to_owned(),
        source,
    })?;
    metaroce_proto::Psk::from_slice(&bytes).ok_or(PskFileError::Length {
        path: path.to_owned(),
        len: bytes.len(),
    })
}
