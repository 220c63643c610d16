//! The baseline transports metaroce is compared against.
//!
//! - [`RoceV2Gbn`] ([`rocev2_gbn`]): RoCEv2 RC as commodity NICs run it
//!   without PFC — one path per QP, in-order delivery, go-back-N.
//! - [`Irn`] ([`irn`]): IRN — selective repeat with SACK-style NACKs and a
//!   BDP-sized window cap, one path per QP.
//! - [`Blast`] ([`blast`]): a dumb unreliable line-rate sender for fabric
//!   experiments (incast, buffer sizing).
//!
//! The two RC transports share the host-side machinery in [`rc`] (queue
//! pairs, scheduling, timers, [`dcqcn`] rate control) and differ only in
//! their [`rc::RecoveryScheme`].

pub mod blast;
pub mod dcqcn;
pub mod header;
pub mod irn;
mod message;
pub mod rc;
pub mod rocev2_gbn;

pub use blast::Blast;
pub use dcqcn::DcqcnParams;
pub use irn::Irn;
pub use rocev2_gbn::RoceV2Gbn;

use crate::time::{Nanos, NS_PER_US};

/// Tuning of the baseline transports.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct BaselineParams {
    /// DCQCN rate control (both RC baselines).
    pub dcqcn: DcqcnParams,
    /// Receiver ACKs every this many in-order packets (and every message's
    /// last packet).
    pub ack_every: u32,
    /// Go-back-N retransmission timeout. ConnectX-class NICs take
    /// 4.096 µs · 2^n; n = 8 gives about 1 ms (the common default n = 14
    /// would be 67 ms and stall these short runs completely).
    pub gbn_rto_ns: Nanos,
    /// Go-back-N cap on packets in flight per QP (`None`: rate only, as
    /// commodity NICs do for WRITEs).
    pub gbn_max_outstanding: Option<u64>,
    /// IRN's RTO when few packets are in flight (paper: 100 µs).
    pub irn_rto_low_ns: Nanos,
    /// IRN's RTO otherwise (paper: 320 µs).
    pub irn_rto_high_ns: Nanos,
    /// In-flight packet count up to which IRN uses the low RTO (paper: 3).
    pub irn_rto_low_threshold: u64,
    /// IRN's window cap in multiples of the BDP (BDP-FC: 1.0).
    pub irn_window_bdp: f64,
}

impl Default for BaselineParams {
    fn default() -> Self {
        BaselineParams {
            dcqcn: DcqcnParams::default(),
            ack_every: 1,
            gbn_rto_ns: 1_000 * NS_PER_US,
            gbn_max_outstanding: None,
            irn_rto_low_ns: 100 * NS_PER_US,
            irn_rto_high_ns: 320 * NS_PER_US,
            irn_rto_low_threshold: 3,
            irn_window_bdp: 1.0,
        }
    }
}
