//! metaroce-sim: a packet-level, discrete-event simulator of data-centre
//! fabrics for RDMA transports over UDP.
//!
//! It models two-tier leaf-spine fabrics (optionally several independent
//! planes), output-queued switch ports with finite buffers, tail drop and
//! DCTCP-style ECN marking, token-bucket shaped ports, 5-tuple ECMP with
//! per-switch seeds, random loss, link/spine/plane failures, degraded
//! (gray) links and silent blackholes, stalls of the hosts' processing, and
//! several traffic patterns. Host transports plug in through the sans-IO [`SimTransport`]
//! trait; the crate runs the real metaroce core ([`metaroce`]) and ships
//! the baselines it is compared against
//! (RoCEv2 go-back-N and IRN, both with DCQCN) and a dumb blaster.
//!
//! Everything is deterministic: time is simulated nanoseconds, ties are
//! broken by insertion order, and every random draw comes from a [`SimRng`]
//! derived from the configured seed.
//!
//! Entry points: [`run`] (one run of a [`SimConfig`]), [`sweep`] (a grid of
//! transports × loss rates), [`run_transport`] (any [`SimTransport`]), and
//! [`render_table`] for reports.
//!
//! Module map:
//! - engine: [`time`], [`rng`], [`event`], `sim` (the loop and entry points)
//! - fabric: [`packet`], [`addr`], [`topology`], [`queue`], [`ecmp`], `host`
//! - scenario: [`config`], [`traffic`], [`faults`], [`stalls`]
//! - transports: [`transport`] (the trait), [`metaroce`] (the real core), [`baselines`]
//! - results: `flows` (delivery accounting), [`series`] (time series and
//!   the metrics derived from them), [`report`]

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod addr;
pub mod baselines;
pub mod config;
pub mod ecmp;
pub mod event;
pub mod faults;
mod flows;
mod host;
pub mod metaroce;
pub mod packet;
pub mod queue;
pub mod report;
pub mod rng;
pub mod series;
mod sim;
pub mod stalls;
pub mod time;
pub mod topology;
pub mod traffic;
pub mod transport;

pub use addr::AddressMap;
pub use baselines::BaselineParams;
pub use config::{ConfigError, SimConfig, TransportKind};
pub use faults::{FaultAction, FaultSpec, FaultTarget, LossLinks};
pub use metaroce::{Datagram, Metaroce, MetaroceFactory, MetaroceParams, MetaroceSummary};
pub use packet::{Ecn, FlowId, HostId, Packet};
pub use queue::{QueueLimit, ShaperSpec};
pub use report::{render_table, LinkStat, PacketCounters, SimReport};
pub use rng::SimRng;
pub use sim::{run, run_transport, run_with_progress, sweep, try_run, Progress};
pub use stalls::{HostStalls, StallLengths};
pub use time::Nanos;
pub use traffic::{FlowRequest, Pattern};
pub use transport::{
    AppEvent, Delivery, FlowStart, PlaneMask, SimTransport, TransportEnv, TransportStats,
};
