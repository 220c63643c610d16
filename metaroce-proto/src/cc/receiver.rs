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
/// flight ([`window_share`](Self::window_share)).
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
/// assert_eq!(none.window_share(), None);
/// let mut b = ReceiverCc::new(None, Duration::from_micros(100)).with_buffer(Some(8 << 20));
/// assert!(!b.enabled() && b.counting());
/// b.set_active(Instant::ZERO, 2);
/// assert_eq!(b.window_share(), Some(4 << 20));
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

    /// Whether active senders are counted: for rate grants or buffer shares.
    pub fn counting(&self) -> bool {
        self.capacity_kbps.is_some() || self.buffer.is_some()
    }

    /// Each active sender's share of the receive buffer, bytes (saturating
    /// at `u32::MAX`, what an ACK carries); `None` without a buffer.
    pub fn window_share(&self) -> Option<u32> {
        self.buffer
            .map(|b| (b / self.active as u64).clamp(1, u64::from(u32::MAX)) as u32)
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
