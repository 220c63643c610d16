//! Stateless handshake cookies.
//!
//! `cookie = ts (u32, seconds, big-endian) || SipHash-1-3-128(secret; ts, ip, port, cid)[..12]`.
//! The server keeps no state for a HELLO until its cookie checks out, so a
//! spoofed source address, which never sees the cookie, creates nothing.

use crate::consts::{COOKIE_LEN, COOKIE_LIFETIME};
use crate::time::Instant;
use siphasher::sip128::{Hasher128, SipHasher13};
use std::hash::Hasher;
use std::net::IpAddr;

fn mac(key: (u64, u64), ts: u32, ip: IpAddr, port: u16, cid: u32) -> [u8; 12] {
    let mut h = SipHasher13::new_with_keys(key.0, key.1);
    h.write_u32(ts);
    match ip {
        IpAddr::V4(v4) => {
            h.write_u8(4);
            h.write(&v4.octets());
        }
        IpAddr::V6(v6) => {
            h.write_u8(6);
            h.write(&v6.octets());
        }
    }
    h.write_u16(port);
    h.write_u32(cid);
    let full = h.finish128().as_bytes();
    let mut out = [0u8; 12];
    out.copy_from_slice(&full[..12]);
    out
}

fn secs(now: Instant) -> u32 {
    (now.as_nanos() / 1_000_000_000) as u32
}

/// Makes a cookie for a client at `ip`/`port` with connection id `cid`.
pub(crate) fn make(
    key: (u64, u64),
    now: Instant,
    ip: IpAddr,
    port: u16,
    cid: u32,
) -> [u8; COOKIE_LEN] {
    let ts = secs(now);
    let mut c = [0u8; COOKIE_LEN];
    c[..4].copy_from_slice(&ts.to_be_bytes());
    c[4..].copy_from_slice(&mac(key, ts, ip, port, cid));
    c
}

/// Checks a cookie: authentic for this client and not expired.
pub(crate) fn check(
    key: (u64, u64),
    now: Instant,
    ip: IpAddr,
    port: u16,
    cid: u32,
    c: &[u8; COOKIE_LEN],
) -> bool {
    let ts = u32::from_be_bytes([c[0], c[1], c[2], c[3]]);
    let age = secs(now).wrapping_sub(ts);
    if u64::from(age) > COOKIE_LIFETIME.as_secs() {
        return false;
    }
    let expect = mac(key, ts, ip, port, cid);
    // Compare without an early exit.
    expect
        .iter()
        .zip(&c[4..])
        .fold(0u8, |acc, (a, b)| acc | (a ^ b))
        == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binds_address_and_expires() {
        let key = (1, 2);
        let ip: IpAddr = "10.0.0.1".parse().unwrap();
        let t0 = Instant::from_nanos(5_000_000_000);
        let c = make(key, t0, ip, 4792, 77);
        assert!(check(key, t0, ip, 4792, 77, &c));
        assert!(check(key, t0 + COOKIE_LIFETIME, ip, 4792, 77, &c));
        assert!(!check(
            key,
            t0 + COOKIE_LIFETIME + core::time::Duration::from_secs(1),
            ip,
            4792,
            77,
            &c
        ));
        assert!(!check(key, t0, "10.0.0.2".parse().unwrap(), 4792, 77, &c));
        assert!(!check(key, t0, ip, 4793, 77, &c));
        assert!(!check(key, t0, ip, 4792, 78, &c));
        assert!(!check((1, 3), t0, ip, 4792, 77, &c));
        let mut bad = c;
        bad[15] ^= 1;
        assert!(!check(key, t0, ip, 4792, 77, &bad));
    }
}
