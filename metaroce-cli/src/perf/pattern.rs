//! The payload pattern `metaroce perf` writes and verifies.
//!
//! Word `k` (8 bytes, little-endian) of message `iter` is
//! `seed(iter) + k * STEP` (wrapping), `STEP` odd: within a message every
//! word differs from every other, so a byte placed at the wrong offset is
//! caught, and messages start from unrelated seeds, so a byte from another
//! message, or a stale one, is caught too (another message's word `k'`
//! equals this one's word `k` only if the seeds' difference times the
//! inverse of `STEP` is `k - k'`, a one in 2^64 chance for a seed pair).
//!
//! Both ends run over every byte of every message, on the threads that
//! drive the transport, so both are written to be cheap: four words at a
//! time, each lane stepping by `4 * STEP`, which the compiler turns into
//! vector adds, and [`check_at`] only ORs the differences together, block by
//! block, counting the wrong bytes of a block only if it has any.

/// The step between consecutive words of a message (odd: invertible
/// modulo 2^64, so the words of a message never repeat).
const STEP: u64 = 0x9e37_79b9_7f4a_7c15;
/// Four steps: one lane's step when four words go at a time.
const STEP4: u64 = STEP.wrapping_mul(4);
/// Bytes [`check_at`] compares before it looks at whether any differed.
const BLOCK: usize = 256;

/// Word 0 of message `iter`.
fn seed(iter: u64) -> u64 {
    (iter ^ 0x5bd1_e995).wrapping_mul(0xff51_afd7_ed55_8ccd)
}

/// Word `k` of the message whose word 0 is `seed`.
#[inline]
fn word(seed: u64, k: u64) -> u64 {
    seed.wrapping_add(k.wrapping_mul(STEP))
}

/// The four words from word `k` on, one per lane.
#[inline]
fn lanes(seed: u64, k: u64) -> [u64; 4] {
    [
        word(seed, k),
        word(seed, k + 1),
        word(seed, k + 2),
        word(seed, k + 3),
    ]
}

/// Writes message `iter`'s pattern over `buf` (a message of `buf.len()`
/// bytes; a last partial word gets the first bytes of its word).
pub(crate) fn fill(buf: &mut [u8], iter: u64) {
    fill_at(buf, iter, 0);
}

/// Writes the part of message `iter`'s pattern from byte `at` on (a
/// multiple of 8: whole words) over `buf`: a message filled piece by
/// piece is the same as one filled at once.
pub(crate) fn fill_at(buf: &mut [u8], iter: u64, at: u64) {
    debug_assert_eq!(at % 8, 0, "pieces start on a word");
    let first = at / 8;
    let s = seed(iter);
    let tail_word = first + (buf.len() / 32 * 4) as u64;
    let mut quads = buf.chunks_exact_mut(32);
    let mut w = lanes(s, first);
    for q in &mut quads {
        for (l, v) in w.iter_mut().enumerate() {
            q[8 * l..8 * l + 8].copy_from_slice(&v.to_le_bytes());
            *v = v.wrapping_add(STEP4);
        }
    }
    for (i, r) in quads.into_remainder().chunks_mut(8).enumerate() {
        let v = word(s, tail_word + i as u64).to_le_bytes();
        let n = r.len();
        r.copy_from_slice(&v[..n]);
    }
}

/// The number of bytes of `buf` that differ from message `iter`'s pattern
/// (zero: intact).
#[cfg(test)]
pub(crate) fn check(buf: &[u8], iter: u64) -> u64 {
    check_at(buf, iter, 0)
}

/// The number of bytes of `buf` that differ from the part of message
/// `iter`'s pattern from byte `at` on (a multiple of 8): a message checked
/// piece by piece counts what one checked at once does.
pub(crate) fn check_at(buf: &[u8], iter: u64, at: u64) -> u64 {
    debug_assert_eq!(at % 8, 0, "pieces start on a word");
    let s = seed(iter);
    let mut bad = 0;
    let mut k = at / 8;
    for block in buf.chunks(BLOCK) {
        let mut quads = block.chunks_exact(32);
        let mut w = lanes(s, k);
        let mut diff = [0u64; 4];
        for q in &mut quads {
            for (l, (v, d)) in w.iter_mut().zip(&mut diff).enumerate() {
                let got = u64::from_le_bytes(q[8 * l..8 * l + 8].try_into().expect("8 bytes"));
                *d |= got ^ *v;
                *v = v.wrapping_add(STEP4);
            }
        }
        let tail_word = k + (block.len() / 32 * 4) as u64;
        let tail_differs = quads
            .remainder()
            .chunks(8)
            .enumerate()
            .any(|(i, r)| *r != word(s, tail_word + i as u64).to_le_bytes()[..r.len()]);
        if diff.iter().any(|&d| d != 0) || tail_differs {
            bad += bad_bytes(block, s, k);
        }
        k += (BLOCK / 8) as u64;
    }
    bad
}

/// The wrong bytes of `block`, whose first word is word `k` of the message
/// whose word 0 is `seed`, one by one.
fn bad_bytes(block: &[u8], seed: u64, k: u64) -> u64 {
    block
        .chunks(8)
        .enumerate()
        .map(|(i, got)| {
            let want = word(seed, k + i as u64).to_le_bytes();
            got.iter().zip(&want).filter(|(a, b)| a != b).count() as u64
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pattern word by word, the plain way: what `fill` must produce.
    fn reference(len: usize, iter: u64) -> Vec<u8> {
        let s = seed(iter);
        (0..len)
            .map(|i| word(s, (i / 8) as u64).to_le_bytes()[i % 8])
            .collect()
    }

    #[test]
    fn fill_writes_the_pattern_and_check_accepts_it() {
        for len in [0, 1, 7, 8, 9, 31, 32, 33, 100, 255, 256, 257, 1003, 65_536] {
            let mut a = vec![0u8; len];
            fill(&mut a, 5);
            assert_eq!(a, reference(len, 5), "length {len}");
            assert_eq!(check(&a, 5), 0, "length {len}");
        }
    }

    #[test]
    fn a_message_in_pieces_is_the_message_at_once() {
        for (len, piece) in [(1003usize, 256usize), (65_536, 4096), (1000, 8), (77, 40)] {
            let mut whole = vec![0u8; len];
            fill(&mut whole, 3);
            let mut pieces = vec![0u8; len];
            for (i, c) in pieces.chunks_mut(piece).enumerate() {
                fill_at(c, 3, (i * piece) as u64);
            }
            assert_eq!(pieces, whole, "{len} bytes in pieces of {piece}");
            // One wrong byte in every other piece, counted piece by piece.
            let mut bad = 0;
            for (i, c) in pieces.chunks_mut(piece).enumerate() {
                if i % 2 == 1 {
                    c[c.len() / 2] ^= 1;
                    bad += 1;
                }
            }
            let counted: u64 = pieces
                .chunks(piece)
                .enumerate()
                .map(|(i, c)| check_at(c, 3, (i * piece) as u64))
                .sum();
            assert_eq!(counted, bad, "{len} bytes in pieces of {piece}");
            assert_eq!(check(&pieces, 3), bad);
        }
    }

    #[test]
    fn check_counts_every_wrong_byte_wherever_it_is() {
        for len in [1, 9, 40, 256, 300, 1003] {
            let mut a = vec![0u8; len];
            fill(&mut a, 11);
            // First, last, and one in the middle of each region: the
            // vector body, a block's tail, the message's tail.
            let mut hits: Vec<usize> = vec![0, len / 2, len - 1];
            hits.sort_unstable();
            hits.dedup();
            for &i in &hits {
                a[i] ^= 0x40;
            }
            assert_eq!(check(&a, 11), hits.len() as u64, "length {len}");
        }
    }

    #[test]
    fn pattern_catches_misplacement_and_other_messages() {
        let want = reference(4096, 7);
        let mut shifted = vec![0u8; 4096];
        shifted[8..].copy_from_slice(&want[..4088]);
        let mut stale = want.clone();
        fill(&mut stale[1024..2048], 6);
        let mut other = vec![0u8; 4096];
        fill(&mut other, 8);
        for (what, buf, words) in [
            ("another message's bytes", &other, 0..512),
            ("bytes a word off", &shifted, 0..512),
            ("a stale kilobyte", &stale, 128..256),
        ] {
            let wrong = buf.iter().zip(&want).filter(|(a, b)| a != b).count();
            assert_eq!(check(buf, 7), wrong as u64, "{what}: counted exactly");
            for k in words {
                let r = k * 8..k * 8 + 8;
                assert_ne!(buf[r.clone()], want[r], "{what}: word {k} is caught");
            }
        }
    }
}
