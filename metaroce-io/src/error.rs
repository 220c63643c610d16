//! Driver errors.

use std::net::SocketAddr;

/// Why a driver could not be set up or run.
#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    /// A socket could not be bound (address in use, not local, no permission).
    #[error("cannot bind UDP socket to {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A socket operation failed.
    #[error("socket error: {0}")]
    Io(#[from] std::io::Error),
    /// The io_uring backend was asked for and the kernel cannot run it.
    #[error("io_uring unavailable: {0}")]
    UringUnavailable(String),
    /// The AF_XDP backend was asked for and cannot run here (no
    /// privilege, no AF_XDP in the kernel, another XDP program attached).
    #[error("AF_XDP unavailable: {0}")]
    XdpUnavailable(String),
    /// The driver configuration was refused.
    #[error("invalid driver configuration: {0}")]
    Config(String),
    /// The endpoint configuration was refused.
    #[error(transparent)]
    Endpoint(#[from] metaroce_proto::EndpointError),
}
