//! Simulated time.
//!
//! The simulator's clock counts nanoseconds from the start of a run in a
//! plain `u64` ([`Nanos`]). Link serialisation is tracked internally in
//! picoseconds so that back-to-back packets at odd rates do not accumulate
//! rounding error; events themselves are always scheduled on whole
//! nanoseconds.

/// Simulated time or duration in nanoseconds.
pub type Nanos = u64;

/// Nanoseconds per microsecond.
pub const NS_PER_US: Nanos = 1_000;
/// Nanoseconds per millisecond.
pub const NS_PER_MS: Nanos = 1_000_000;
/// Picoseconds per nanosecond.
pub(crate) const PS_PER_NS: u64 = 1_000;

/// Picoseconds needed to serialise one byte at `gbps` Gbit/s (rounded).
///
/// 100 Gbit/s gives 80 ps per byte, 25 Gbit/s 320 ps per byte.
pub fn ps_per_byte(gbps: f64) -> u64 {
    ((8_000.0 / gbps).round() as u64).max(1)
}

/// Round a picosecond instant up to the next whole nanosecond.
pub(crate) fn ps_to_ns_ceil(ps: u64) -> Nanos {
    ps.div_ceil(PS_PER_NS)
}

/// Convert milliseconds (possibly fractional) to nanoseconds.
pub fn ms_to_ns(ms: f64) -> Nanos {
    (ms * NS_PER_MS as f64).round() as Nanos
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates() {
        assert_eq!(ps_per_byte(100.0), 80);
        assert_eq!(ps_per_byte(25.0), 320);
        assert_eq!(ps_per_byte(400.0), 20);
        assert_eq!(ps_to_ns_ceil(1), 1);
        assert_eq!(ps_to_ns_ceil(1000), 1);
        assert_eq!(ps_to_ns_ceil(1001), 2);
        assert_eq!(ms_to_ns(2.5), 2_500_000);
    }
}
