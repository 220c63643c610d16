//! A fixed-size window of sequence numbers seen, anchored at a cumulative point.

use crate::wire::seq::{seq_dist, seq_lt};

/// What happened to a sequence number offered to a [`RingBitmap`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SeqAccept {
    /// First time seen; recorded.
    New,
    /// Seen before, or below the cumulative point.
    Duplicate,
    /// Beyond the window; not recorded.
    OutOfWindow,
}

/// Tracks which sequence numbers in `cum .. cum + 64*WORDS` have been seen.
///
/// `cum` is the first sequence number not yet seen; everything before it has
/// been. Bit `s % (64*WORDS)` stands for `s`. State is `8*WORDS` bytes, fixed.
#[derive(Debug, Clone)]
pub(crate) struct RingBitmap<const WORDS: usize> {
    cum: u32,
    /// Allocated when the first number beyond `cum` is recorded: a window
    /// that only ever advances in order costs no memory.
    bits: Option<Box<[u64; WORDS]>>,
}

impl<const WORDS: usize> RingBitmap<WORDS> {
    const SPAN: u32 = (WORDS * 64) as u32;

    pub(crate) fn new(start: u32) -> Self {
        RingBitmap {
            cum: start,
            bits: None,
        }
    }

    /// First sequence number not yet seen.
    pub(crate) fn cum(&self) -> u32 {
        self.cum
    }

    #[inline]
    fn slot(s: u32) -> (usize, u64) {
        let i = (s % Self::SPAN) as usize;
        (i / 64, 1u64 << (i % 64))
    }

    /// Whether `s` has been seen.
    #[cfg(test)]
    pub(crate) fn contains(&self, s: u32) -> bool {
        if seq_lt(s, self.cum) {
            return true;
        }
        if seq_dist(self.cum, s) >= Self::SPAN {
            return false;
        }
        let (w, m) = Self::slot(s);
        self.bits.as_ref().is_some_and(|b| b[w] & m != 0)
    }

    /// Records `s`; advances `cum` over every contiguous seen number.
    pub(crate) fn insert(&mut self, s: u32) -> SeqAccept {
        if seq_lt(s, self.cum) {
            return SeqAccept::Duplicate;
        }
        if seq_dist(self.cum, s) >= Self::SPAN {
            return SeqAccept::OutOfWindow;
        }
        if s == self.cum {
            // In order: advance over it and whatever was seen beyond it.
            self.cum = self.cum.wrapping_add(1);
            self.sweep();
            return SeqAccept::New;
        }
        let bits = self.bits.get_or_insert_with(|| Box::new([0; WORDS]));
        let (w, m) = Self::slot(s);
        if bits[w] & m != 0 {
            return SeqAccept::Duplicate;
        }
        bits[w] |= m;
        SeqAccept::New
    }

    /// Advances `cum` over numbers already seen, clearing their bits.
    fn sweep(&mut self) {
        if let Some(bits) = self.bits.as_mut() {
            loop {
                let (w, m) = Self::slot(self.cum);
                if bits[w] & m == 0 {
                    break;
                }
                bits[w] &= !m;
                self.cum = self.cum.wrapping_add(1);
            }
        }
    }

    /// Records `s`, sliding the window forward when `s` lies beyond it: the
    /// numbers the window leaves behind are given up as never to arrive.
    /// Used for path sequences, whose lost numbers are never sent again.
    pub(crate) fn insert_sliding(&mut self, s: u32) -> SeqAccept {
        if !seq_lt(s, self.cum) && seq_dist(self.cum, s) >= Self::SPAN {
            let new_min = s.wrapping_sub(Self::SPAN - 1);
            match self.bits.as_mut() {
                // The whole window is left behind, or there is nothing
                // recorded: start afresh (constant time, however far the
                // peer jumps).
                None => self.cum = new_min,
                Some(bits) if seq_dist(self.cum, new_min) >= Self::SPAN => {
                    bits.fill(0);
                    self.cum = new_min;
                }
                Some(bits) => {
                    while seq_lt(self.cum, new_min) {
                        let (w, m) = Self::slot(self.cum);
                        bits[w] &= !m;
                        self.cum = self.cum.wrapping_add(1);
                    }
                }
            }
            // The new start may be a number already seen.
            self.sweep();
        }
        self.insert(s)
    }

    /// The selective-ack bits for `cum + 1 ..`, `out.len()*8` of them: bit
    /// `i` (byte `i/8`, bit `i%8` from the LSB) stands for `cum + 1 + i`.
    pub(crate) fn sack_into(&self, out: &mut [u8]) {
        out.fill(0);
        let Some(bits) = self.bits.as_ref() else {
            return;
        };
        // Walk the words rather than every bit: most are zero.
        for (wi, &word) in bits.iter().enumerate() {
            let mut word = word;
            while word != 0 {
                let b = word.trailing_zeros();
                word &= word - 1;
                let slot = wi as u32 * 64 + b;
                // Sequence number whose slot this is, inside the window.
                let base_slot = self.cum % Self::SPAN;
                let off = (slot + Self::SPAN - base_slot) % Self::SPAN;
                if off == 0 {
                    continue;
                }
                let i = (off - 1) as usize;
                if i / 8 < out.len() {
                    out[i / 8] |= 1 << (i % 8);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_order_and_holes() {
        let mut b: RingBitmap<4> = RingBitmap::new(u32::MAX - 1);
        assert_eq!(b.insert(u32::MAX - 1), SeqAccept::New);
        assert_eq!(b.cum(), u32::MAX);
        assert_eq!(b.insert(1), SeqAccept::New);
        assert_eq!(b.cum(), u32::MAX);
        assert!(b.contains(1) && !b.contains(0));
        let mut sack = [0u8; 32];
        b.sack_into(&mut sack);
        // cum = MAX; 1 is cum + 2 -> bit 1.
        assert_eq!(sack[0], 0b10);
        assert_eq!(b.insert(1), SeqAccept::Duplicate);
        assert_eq!(b.insert(u32::MAX - 5), SeqAccept::Duplicate);
        assert_eq!(b.insert(u32::MAX), SeqAccept::New);
        assert_eq!(b.insert(0), SeqAccept::New);
        assert_eq!(b.cum(), 2);
        assert_eq!(b.insert(2 + 256), SeqAccept::OutOfWindow);
        assert_eq!(b.insert(2 + 255), SeqAccept::New);
        b.sack_into(&mut sack);
        assert_eq!(sack[31], 0x40);
    }

    #[test]
    fn sliding_gives_up_old_holes() {
        let mut b: RingBitmap<4> = RingBitmap::new(0);
        assert_eq!(b.insert_sliding(1), SeqAccept::New);
        assert_eq!(b.cum(), 0, "0 is a hole");
        assert_eq!(b.insert_sliding(256), SeqAccept::New);
        // 256 needs the window to start at 1: 0 is abandoned, 1 was seen.
        assert_eq!(b.cum(), 2);
        assert!(b.contains(256) && !b.contains(2));
        assert_eq!(b.insert_sliding(0), SeqAccept::Duplicate);
        assert_eq!(b.insert_sliding(1000), SeqAccept::New);
        // A jump of billions is handled at once, not step by step.
        let mut far: RingBitmap<4> = RingBitmap::new(5);
        far.insert_sliding(6);
        assert_eq!(far.insert_sliding(0x6a00_0000), SeqAccept::New);
        assert_eq!(far.cum(), 0x6a00_0000 - 255);
        assert!(far.contains(0x6a00_0000) && !far.contains(0x6a00_0000 - 1));
        assert_eq!(b.cum(), 1000 - 255);
        assert!(!b.contains(1000 - 255));
        let mut sack = [0u8; 32];
        b.sack_into(&mut sack);
        assert_eq!(sack[31], 0x40, "1000 is cum + 255 -> bit 254");
    }

    #[test]
    fn matches_a_set_model() {
        let mut b: RingBitmap<4> = RingBitmap::new(0);
        let mut seen = std::collections::BTreeSet::new();
        let mut x = 12345u64;
        for _ in 0..5000 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let s = b
                .cum()
                .wrapping_add((x >> 33) as u32 % 300)
                .wrapping_sub(20);
            let expect = if seq_lt(s, b.cum()) || seen.contains(&s) {
                SeqAccept::Duplicate
            } else if seq_dist(b.cum(), s) >= 256 {
                SeqAccept::OutOfWindow
            } else {
                SeqAccept::New
            };
            assert_eq!(b.insert(s), expect, "seq {s}");
            if expect == SeqAccept::New {
                seen.insert(s);
            }
            let mut cum = 0u32;
            while seen.contains(&cum) {
                cum += 1;
            }
            assert_eq!(b.cum(), cum);
            assert!(seen.iter().all(|&v| b.contains(v)));
        }
    }
}
