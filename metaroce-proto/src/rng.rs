//! A small deterministic pseudo-random generator (SplitMix64).
//!
//! The core has no randomness of its own: the generator is seeded by the
//! caller, so the same seed gives the same connection ids, keys and ports.

/// SplitMix64: fast, statistically sound for ids and jitter, not cryptographic.
#[derive(Debug, Clone)]
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Rng(seed ^ 0x6a09_e667_f3bc_c909)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// 16 random bytes: a handshake nonce.
    pub(crate) fn nonce(&mut self) -> [u8; 16] {
        let mut n = [0u8; 16];
        n[..8].copy_from_slice(&self.next_u64().to_be_bytes());
        n[8..].copy_from_slice(&self.next_u64().to_be_bytes());
        n
    }

    pub(crate) fn next_u32(&mut self) -> u32 {
        (self.next_u64() >> 32) as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_and_in_range() {
        let mut a = Rng::new(7);
        let mut b = Rng::new(7);
        for _ in 0..100 {
            assert_eq!(a.next_u64(), b.next_u64());
        }
        assert_ne!(Rng::new(1).next_u64(), Rng::new(2).next_u64());
    }
}
