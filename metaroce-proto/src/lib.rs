//! Sans-IO protocol core of metaroce: a MetaRoCE-style reliable transport
//! with RDMA verbs semantics over UDP/IP.
//!
//! - [`wire`]: the packet formats (`docs/PROTOCOL.md` is the specification).
//! - [`verbs`]: protection domains, memory regions, completion queues, queue
//!   pairs, work requests and completions.
//! - [`Endpoint`]: demultiplexes datagrams to connections, runs the
//!   handshake, reliability, spraying and congestion control.
//! - [`connection`], [`reliability`], [`cc`]: the pieces it is made of.
//!
//! No sockets, threads, async, clock or randomness of its own: datagrams and
//! time come in as arguments, datagrams go out into caller-owned buffers, and
//! the same inputs (and seed) give the same outputs.
// Unsafe code lives in one module only: `verbs::region_buf`, where a
// region's memory is reached through a raw pointer (see its docs).
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod cc;
pub mod config;
pub mod connection;
pub mod consts;
mod endpoint;
mod integrity;
pub mod reliability;
mod rng;
pub mod stats;
pub mod time;
pub mod verbs;
pub mod wire;

pub use config::{ConfigError, EndpointConfig};
pub use connection::{ConnectionError, ConnectionState, ConnectionStats, PathState, PathStats};
pub use endpoint::{Chunk, Ecn, Endpoint, EndpointError, Event, Gather, RegionPin, Transmit};
pub use integrity::{Protection, Psk};
pub use stats::{EndpointStats, RejectCounters, RejectReason};
pub use time::Instant;
