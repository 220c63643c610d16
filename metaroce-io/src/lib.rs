//! Drivers that run the sans-IO [`metaroce_proto`] core on real UDP sockets.
//!
//! [`PortableDriver`] works on any kernel: `std` sockets set up with
//! `socket2`, ECN and GRO through `quinn-udp`, one blocking wait per loop turn
//! bounded by the core's next timer. One receive socket listens on the
//! endpoint's port; one send socket per path source port gives each path its
//! own ECMP entropy.
//!
//! ```no_run
//! use metaroce_io::{DriverConfig, PortableDriver};
//! use std::time::Duration;
//! let mut drv = PortableDriver::bind(DriverConfig::new("127.0.0.1:0".parse().unwrap())).unwrap();
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
mod error;
mod portable;

pub use clock::Clock;
pub use error::DriverError;
pub use portable::{DriverConfig, DriverStats, PortableDriver};
