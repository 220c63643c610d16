//! Reliability building blocks: sequence bitmaps for duplicate suppression and
//! selective acknowledgement, and the RTT/RTO estimator.

mod ring_bitmap;
mod rtt;

pub(crate) use ring_bitmap::{RingBitmap, SeqAccept};
pub use rtt::RttEstimator;
