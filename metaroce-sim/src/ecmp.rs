//! ECMP: hashing the UDP/IP 5-tuple onto one of several equal-cost links.
//!
//! Each switch has its own hash seed (as real switches do, to avoid
//! polarisation), and the hash covers `(src ip, dst ip, src port, dst port,
//! proto)`, so a sender picks its path through the fabric by choosing its
//! UDP source port.

use crate::rng::mix64;

/// The fields of a flow's 5-tuple that the hash covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FiveTuple {
    /// Source IPv4 address (big-endian `u32`).
    pub src_ip: u32,
    /// Destination IPv4 address.
    pub dst_ip: u32,
    /// UDP source port.
    pub src_port: u16,
    /// UDP destination port.
    pub dst_port: u16,
    /// IP protocol number.
    pub proto: u8,
}

/// The 64-bit ECMP hash of `tuple` under a switch's `seed`.
pub fn hash(seed: u64, tuple: &FiveTuple) -> u64 {
    let a = mix64(seed ^ (((tuple.src_ip as u64) << 32) | tuple.dst_ip as u64));
    let b = ((tuple.src_port as u64) << 24) | ((tuple.dst_port as u64) << 8) | tuple.proto as u64;
    mix64(a ^ b.wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

/// Pick one of `n` members (`n > 0`) from a hash, by multiply-shift.
pub fn select(hash: u64, n: usize) -> usize {
    (((hash >> 32) * n as u64) >> 32) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn source_ports_spread_and_seeds_differ() {
        let mut counts = [0u32; 8];
        let mut same = 0;
        for port in 49152..49152 + 8000u16 {
            let t = FiveTuple {
                src_ip: 0x0a00_0001,
                dst_ip: 0x0a00_0102,
                src_port: port,
                dst_port: 4791,
                proto: 17,
            };
            let a = select(hash(1, &t), 8);
            counts[a] += 1;
            if a == select(hash(2, &t), 8) {
                same += 1;
            }
        }
        for c in counts {
            assert!((850..1150).contains(&c), "{counts:?}");
        }
        // Independent seeds agree about 1/8 of the time.
        assert!((800..1200).contains(&same), "{same}");
    }
}
