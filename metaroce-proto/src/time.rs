//! Time as the core sees it: a monotonic instant passed in by the caller.
//!
//! The core never reads a clock. Drivers map their clock (or simulated time)
//! to nanoseconds since an origin of their choosing.

use core::ops::{Add, Sub};
use core::time::Duration;

/// A point in time, in nanoseconds since the driver's origin.
///
/// ```
/// use core::time::Duration;
/// use metaroce_proto::Instant;
/// let t = Instant::from_nanos(1_000);
/// assert_eq!((t + Duration::from_micros(1)).as_nanos(), 2_000);
/// assert_eq!(Instant::from_nanos(5_000) - t, Duration::from_nanos(4_000));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Instant(u64);

impl Instant {
    /// The origin.
    pub const ZERO: Instant = Instant(0);

    /// An instant `nanos` after the origin.
    pub const fn from_nanos(nanos: u64) -> Self {
        Instant(nanos)
    }

    /// Nanoseconds since the origin.
    pub const fn as_nanos(self) -> u64 {
        self.0
    }

    /// The low 32 bits of the nanosecond count, as carried in `tx_ts`.
    pub const fn wire_ts(self) -> u32 {
        self.0 as u32
    }

    /// Time since `earlier`, or zero if `earlier` is later.
    pub fn saturating_since(self, earlier: Instant) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }
}

impl Add<Duration> for Instant {
    type Output = Instant;
    fn add(self, d: Duration) -> Instant {
        Instant(
            self.0
                .saturating_add(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)),
        )
    }
}

impl Sub<Instant> for Instant {
    type Output = Duration;
    fn sub(self, rhs: Instant) -> Duration {
        self.saturating_since(rhs)
    }
}

/// Nanoseconds of a duration, saturating at `u64::MAX`.
pub(crate) fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}
