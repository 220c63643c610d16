//! Congestion control from both ends.
//!
//! - [`SenderCc`]: the sender's window, ECN-driven AIMD with DCTCP-style
//!   proportional decrease; random loss is not a congestion signal.
//! - [`ReceiverCc`]: the receiver's grant to each sender (the rate hint in
//!   every ACK); version 1 grants no limit unless configured with a capacity.
//! - [`Pacer`]: spreads a sender's packets at the receiver's grant.

mod pacer;
mod receiver;
mod sender;

pub use pacer::Pacer;
pub use receiver::{ActiveSenders, ReceiverCc};
pub use sender::{DelayBase, SenderCc};
