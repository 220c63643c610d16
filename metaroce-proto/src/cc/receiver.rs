//! The receiver's grant to its senders.

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
/// ```
#[derive(Debug, Clone)]
pub struct ReceiverCc {
    capacity_kbps: Option<u64>,
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
            window,
            active: 1,
            counted_at: None,
        }
    }

    /// Whether grants are given at all.
    pub fn enabled(&self) -> bool {
        self.capacity_kbps.is_some()
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
