//! Maps the OS monotonic clock to the core's [`Instant`].

use metaroce_proto::Instant;

/// Nanoseconds since the clock was created, as the core's [`Instant`].
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    origin: std::time::Instant,
}

impl Clock {
    /// A clock whose origin is now.
    pub fn new() -> Self {
        Clock {
            origin: std::time::Instant::now(),
        }
    }

    /// The current instant.
    pub fn now(&self) -> Instant {
        Instant::from_nanos(u64::try_from(self.origin.elapsed().as_nanos()).unwrap_or(u64::MAX))
    }

    /// How long until `t` (zero if it has passed).
    pub fn until(&self, t: Instant) -> std::time::Duration {
        t.saturating_since(self.now())
    }
}

impl Default for Clock {
    fn default() -> Self {
        Self::new()
    }
}
