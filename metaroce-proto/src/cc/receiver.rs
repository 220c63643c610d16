//! The receiver's grant to its senders.

/// Divides a receiver's inbound capacity among the senders feeding it.
///
/// With a capacity set, each of `n` active senders is granted `capacity / n`
/// (the fair share); without one, no limit is granted (hint 0).
///
/// ```
/// use metaroce_proto::cc::ReceiverCc;
/// let mut r = ReceiverCc::new(Some(100_000_000));
/// assert_eq!(r.hint_kbps(4), 25_000_000);
/// let mut none = ReceiverCc::new(None);
/// assert_eq!(none.hint_kbps(4), 0);
/// ```
#[derive(Debug, Clone)]
pub struct ReceiverCc {
    capacity_kbps: Option<u64>,
}

impl ReceiverCc {
    /// A receiver with `capacity_kbps` of inbound capacity to share (None: no grants).
    pub fn new(capacity_kbps: Option<u64>) -> Self {
        ReceiverCc { capacity_kbps }
    }

    /// The grant for one of `active_senders` senders, in kbit/s (0: no limit).
    pub fn hint_kbps(&mut self, active_senders: usize) -> u32 {
        match self.capacity_kbps {
            Some(c) => (c / active_senders.max(1) as u64).clamp(1, u64::from(u32::MAX)) as u32,
            None => 0,
        }
    }
}
