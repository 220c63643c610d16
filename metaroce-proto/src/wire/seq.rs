//! Serial-number arithmetic for the 32-bit wrapping sequence spaces (PSN, CSN, MSN).
//!
//! Comparisons follow RFC 1982: `a` is before `b` when `b - a`, taken modulo
//! 2^32, is in `1..2^31`. Every window the protocol uses is far smaller than
//! 2^31, so the order is unambiguous inside a window.

/// `a` comes strictly before `b` in serial order.
#[inline]
pub fn seq_lt(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) < 0
}

/// `a` comes before `b` or equals it.
#[inline]
pub fn seq_le(a: u32, b: u32) -> bool {
    a == b || seq_lt(a, b)
}

/// Distance from `from` forward to `to` (`to - from` modulo 2^32).
#[inline]
pub fn seq_dist(from: u32, to: u32) -> u32 {
    to.wrapping_sub(from)
}

/// The later of two sequence numbers in serial order.
#[inline]
pub fn seq_max(a: u32, b: u32) -> u32 {
    if seq_lt(a, b) {
        b
    } else {
        a
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn orders_across_wrap() {
        assert!(seq_lt(u32::MAX, 0));
        assert!(seq_lt(u32::MAX - 5, 3));
        assert!(!seq_lt(3, u32::MAX - 5));
        assert!(seq_le(7, 7));
        assert!(!seq_lt(7, 7));
        assert_eq!(seq_dist(u32::MAX - 1, 2), 4);
        assert_eq!(seq_max(u32::MAX, 1), 1);
        assert_eq!(seq_max(10, 9), 10);
    }
}
