//! The receiver's grant to its senders: a rate, and a share of its receive
//! buffer.

use crate::time::Instant;
use core::time::Duration;

/// Divides a receiver's inbound capacity among the senders feeding it.
///
/// A sender is active when it delivered data within the activity window.
/// With a capacity set, each active sender is granted `capacity / active`
/// (the fair share) in every ACK; senders cap their bytes in flight at the
/// grant times their base RTT, so N senders converge on fair shares without
/// building a queue at the receiver's link. Without a capacity, no limit is
/// granted (hint 0).
///
/// With a receive buffer set ([`with_buffer`](Self::with_buffer)), each
/// active sender is also told to keep at most `buffer / active` bytes in
/// flight ([`window_share`](Self::window_share)), the active senders
/// counted by an [`ActiveSenders`].
///
/// ```
/// use core::time::Duration;
/// use metaroce_proto::cc::ReceiverCc;
/// use metaroce_proto::Instant;
/// let mut r = ReceiverCc::new(Some(100_000_000), Duration::from_micros(100));
/// assert!(r.stale(Instant::ZERO));
/// r.set_active(Instant::ZERO, 4);
/// assert_eq!(r.hint_kbps(), 25_000_000);
/// assert!(!r.stale(Instant::from_nanos(1_000)));
/// let none = ReceiverCc::new(None, Duration::from_micros(100));
/// assert_eq!(none.hint_kbps(), 0);
/// assert_eq!(none.window_share(2), None);
/// let b = ReceiverCc::new(None, Duration::from_micros(100)).with_buffer(Some(8 << 20));
/// assert!(!b.enabled());
/// assert_eq!(b.window_share(2), Some(4 << 20));
/// ```
#[derive(Debug, Clone)]
pub struct ReceiverCc {
    capacity_kbps: Option<u64>,
    buffer: Option<u64>,
    window: Duration,
    active: usize,
    counted_at: Option<Instant>,
}

impl ReceiverCc {
    /// A receiver with `capacity_kbps` of inbound capacity to share (None: no
    /// grants); a sender counts as active for `window` after its last data.
    pub fn new(capacity_kbps: Option<u64>, window: Duration) -> Self {
        ReceiverCc {
            capacity_kbps,
            buffer: None,
            window,
            active: 1,
            counted_at: None,
        }
    }

    /// The same, sharing `buffer` bytes of receive buffer among the active
    /// senders too (`None`: no window is given).
    pub fn with_buffer(mut self, buffer: Option<u64>) -> Self {
        self.buffer = buffer;
        self
    }

    /// Whether rate grants are given at all.
    pub fn enabled(&self) -> bool {
        self.capacity_kbps.is_some()
    }

    /// Each of `active` senders' share of the receive buffer, bytes
    /// (saturating at `u32::MAX`, what an ACK carries); `None` without a
    /// buffer.
    pub fn window_share(&self, active: usize) -> Option<u32> {
        self.buffer
            .map(|b| (b / active.max(1) as u64).clamp(1, u64::from(u32::MAX)) as u32)
    }

    /// The activity window.
    pub fn window(&self) -> Duration {
        self.window
    }

    /// Whether the count of active senders should be refreshed (16 times a window).
    pub fn stale(&self, now: Instant) -> bool {
        self.counted_at
            .is_none_or(|t| now.saturating_since(t) >= self.window / 16)
    }

    /// Records how many senders are active.
    pub fn set_active(&mut self, now: Instant, active: usize) {
        self.active = active.max(1);
        self.counted_at = Some(now);
    }

    /// The grant for each active sender, in kbit/s (0: no limit).
    pub fn hint_kbps(&self) -> u32 {
        match self.capacity_kbps {
            Some(c) => (c / self.active as u64).clamp(1, u64::from(u32::MAX)) as u32,
            None => 0,
        }
    }
}

/// Counts the connections that delivered data lately, in constant time per
/// packet (what every ACK's window share divides by; the rate grant's count
/// scans the connections instead, and is only kept when grants are on).
///
/// Time is cut into periods of the activity window; a connection counts in
/// the period it last delivered in, and the count is the larger of the
/// current and the previous period's: a connection that stopped delivering
/// leaves it within two windows.
///
/// ```
/// use core::time::Duration;
/// use metaroce_proto::cc::ActiveSenders;
/// use metaroce_proto::Instant;
/// let us = |n: u64| Instant::from_nanos(n * 1_000);
/// let mut a = ActiveSenders::new(Duration::from_micros(100));
/// let (mut c1, mut c2) = (0, 0);
/// a.delivered(&mut c1, us(10));
/// a.delivered(&mut c2, us(20));
/// a.delivered(&mut c1, us(30));
/// assert_eq!(a.count(us(40)), 2);
/// a.delivered(&mut c1, us(150));
/// assert_eq!(a.count(us(150)), 2); // c2 still counts from the last period
/// a.delivered(&mut c1, us(250));
/// assert_eq!(a.count(us(250)), 1); // c2 is gone
/// ```
#[derive(Debug, Clone)]
pub struct ActiveSenders {
    period: u64,
    /// Current period (its index from time zero, plus one: a connection's
    /// mark of 0 means "never").
    current: u64,
    /// When the current period ends (ns): before it, a packet costs no
    /// division.
    ends: u64,
    in_current: usize,
    in_previous: usize,
}

impl ActiveSenders {
    /// A count over periods of `window` (at least 1 ns).
    pub fn new(window: Duration) -> Self {
        ActiveSenders {
            period: crate::time::nanos(window).max(1),
            current: 1,
            ends: crate::time::nanos(window).max(1),
            in_current: 0,
            in_previous: 0,
        }
    }

    fn roll(&mut self, now: Instant) {
        if now.as_nanos() < self.ends {
            return;
        }
        let p = now.as_nanos() / self.period + 1;
        self.ends = p.saturating_mul(self.period);
        if p > self.current {
            self.in_previous = if p == self.current + 1 {
                self.in_current
            } else {
                0
            };
            self.in_current = 0;
            self.current = p;
        }
    }

    /// A connection delivered data at `now`; `mark` is its own record of
    /// the period it last did (0 at first).
    pub fn delivered(&mut self, mark: &mut u64, now: Instant) {
        self.roll(now);
        if *mark != self.current {
            *mark = self.current;
            self.in_current += 1;
        }
    }

    /// Connections that delivered within about the last window (at least 1).
    pub fn count(&mut self, now: Instant) -> usize {
        self.roll(now);
        self.in_current.max(self.in_previous).max(1)
    }
}
