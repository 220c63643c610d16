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

    /// The instant on this clock of a kernel receive timestamp `stamp`
    /// (`SO_TIMESTAMPNS`: time since the Unix epoch on the system's wall
    /// clock), given `now` on this clock and `wall` on the wall clock, read
    /// together: `now` less the stamp's age. A stamp from the wall clock's
    /// future (a step of it) is `now`.
    ///
    /// ```
    /// use metaroce_io::Clock;
    /// use metaroce_proto::Instant;
    /// use std::time::Duration;
    /// let clock = Clock::new();
    /// let now = Instant::from_nanos(1_000_000);
    /// let wall = Duration::from_secs(1_800_000_000);
    /// let arrived = clock.arrival(now, wall, wall - Duration::from_micros(30));
    /// assert_eq!(now.saturating_since(arrived), Duration::from_micros(30));
    /// assert_eq!(clock.arrival(now, wall, wall + Duration::from_secs(1)), now);
    /// ```
    pub fn arrival(
        &self,
        now: Instant,
        wall: std::time::Duration,
        stamp: std::time::Duration,
    ) -> Instant {
        let age = u64::try_from(wall.saturating_sub(stamp).as_nanos()).unwrap_or(u64::MAX);
        Instant::from_nanos(now.as_nanos().saturating_sub(age))
    }

    /// When a datagram read at `now` arrived: its kernel receive stamp
    /// mapped by [`arrival`](Self::arrival), or `now` without one. `wall`
    /// caches the wall clock for the turn: read once, with the first stamp.
    pub fn arrived(
        &self,
        now: Instant,
        wall: &mut Option<std::time::Duration>,
        stamp: Option<std::time::Duration>,
    ) -> Instant {
        match stamp {
            Some(stamp) => self.arrival(now, *wall.get_or_insert_with(Self::wall), stamp),
            None => now,
        }
    }

    /// The wall clock (time since the Unix epoch), to read with
    /// [`now`](Self::now) for [`arrival`](Self::arrival).
    pub fn wall() -> std::time::Duration {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
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
