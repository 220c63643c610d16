//! IPv4 addressing of hosts: one address per host per plane.
//!
//! Host `h` on plane `p` sits under leaf `l = h / hosts_per_leaf` at index
//! `i = h % hosts_per_leaf` and has the address `10.p.l.(i + 1)`. A
//! transport that works with socket addresses (the metaroce adapter) maps
//! between addresses and `(host, plane)` with [`AddressMap`].

use std::net::Ipv4Addr;

use crate::packet::HostId;

/// Maps `(host, plane)` to IPv4 addresses and back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AddressMap {
    hosts: u32,
    hosts_per_leaf: u32,
    planes: u32,
}

impl AddressMap {
    /// A map for `hosts` hosts, `hosts_per_leaf` per leaf, on `planes` planes.
    ///
    /// # Panics
    /// If the fabric does not fit the `10.P.L.H` scheme (more than 256
    /// planes or leaves, more than 254 hosts per leaf).
    pub fn new(hosts: u32, hosts_per_leaf: u32, planes: u32) -> Self {
        assert!(planes <= 256 && hosts_per_leaf <= 254 && hosts_per_leaf > 0);
        assert!(hosts.div_ceil(hosts_per_leaf) <= 256);
        AddressMap {
            hosts,
            hosts_per_leaf,
            planes,
        }
    }

    /// The address of `host` on `plane`.
    pub fn ip(&self, host: HostId, plane: u8) -> Ipv4Addr {
        Ipv4Addr::from(self.ip_u32(host, plane))
    }

    /// The address of `host` on `plane` as a big-endian `u32`.
    pub fn ip_u32(&self, host: HostId, plane: u8) -> u32 {
        let leaf = host / self.hosts_per_leaf;
        let idx = host % self.hosts_per_leaf + 1;
        (10 << 24) | ((plane as u32) << 16) | (leaf << 8) | idx
    }

    /// The `(host, plane)` owning `ip`, if any.
    pub fn host_of(&self, ip: Ipv4Addr) -> Option<(HostId, u8)> {
        let [a, p, l, i] = ip.octets();
        if a != 10 || p as u32 >= self.planes || i == 0 || i as u32 > self.hosts_per_leaf {
            return None;
        }
        let host = l as u32 * self.hosts_per_leaf + (i as u32 - 1);
        (host < self.hosts).then_some((host, p))
    }

    /// Number of planes (addresses per host).
    pub fn planes(&self) -> u32 {
        self.planes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let m = AddressMap::new(64, 8, 2);
        assert_eq!(m.ip(0, 0), Ipv4Addr::new(10, 0, 0, 1));
        assert_eq!(m.ip(13, 1), Ipv4Addr::new(10, 1, 1, 6));
        for h in 0..64 {
            for p in 0..2 {
                assert_eq!(m.host_of(m.ip(h, p)), Some((h, p)));
            }
        }
        assert_eq!(m.host_of(Ipv4Addr::new(10, 2, 0, 1)), None);
        assert_eq!(m.host_of(Ipv4Addr::new(10, 0, 8, 1)), None);
    }
}
