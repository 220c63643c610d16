//! Packets as the fabric sees them.
//!
//! The fabric only looks at a packet's addressing (hosts, plane, UDP ports),
//! its wire size and its ECN bits. What the transport put inside is an
//! opaque `payload` of the transport's own type: baselines carry a small
//! `Copy` header, a transport that produces real datagrams can carry a byte
//! buffer. The fabric is generic over the payload, so the header-only
//! baselines pay nothing for that flexibility.

/// Index of a host (`0..hosts`).
pub type HostId = u32;

/// Identifier of an application flow (unique within one run).
pub type FlowId = u32;

/// IP protocol number of UDP, used in the ECMP 5-tuple.
pub const IPPROTO_UDP: u8 = 17;

/// RoCEv2's well-known UDP destination port.
pub const ROCEV2_UDP_PORT: u16 = 4791;

/// The two ECN bits of the IP header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Ecn {
    /// Not ECN-capable transport: switches never mark it.
    NotEct,
    /// ECN-capable transport, codepoint ECT(0).
    Ect0,
    /// ECN-capable transport, codepoint ECT(1).
    Ect1,
    /// Congestion experienced (set by a switch).
    Ce,
}

impl Ecn {
    /// `true` for ECT(0), ECT(1) and CE.
    pub fn is_capable(self) -> bool {
        !matches!(self, Ecn::NotEct)
    }
}

/// One packet in flight.
#[derive(Debug, Clone, PartialEq)]
pub struct Packet<P> {
    /// Sending host.
    pub src: HostId,
    /// Receiving host.
    pub dst: HostId,
    /// Plane (NIC port) the packet leaves and arrives on.
    pub plane: u8,
    /// UDP source port: the entropy the ECMP hash sees.
    pub src_port: u16,
    /// UDP destination port.
    pub dst_port: u16,
    /// ECN codepoint.
    pub ecn: Ecn,
    /// Size on the wire in bytes (all headers included).
    pub size: u32,
    /// Transport-specific content, opaque to the fabric.
    pub payload: P,
}

/// Storage for packets in flight: a slab indexed by `u32` with a free list,
/// so events carry a small index and no packet is allocated on the heap.
#[derive(Debug)]
pub(crate) struct PacketSlab<P> {
    slots: Vec<Option<Packet<P>>>,
    free: Vec<u32>,
    live: usize,
}

impl<P> PacketSlab<P> {
    pub(crate) fn new() -> Self {
        PacketSlab {
            slots: Vec::with_capacity(4096),
            free: Vec::with_capacity(4096),
            live: 0,
        }
    }

    pub(crate) fn insert(&mut self, pkt: Packet<P>) -> u32 {
        self.live += 1;
        if let Some(idx) = self.free.pop() {
            self.slots[idx as usize] = Some(pkt);
            idx
        } else {
            self.slots.push(Some(pkt));
            (self.slots.len() - 1) as u32
        }
    }

    pub(crate) fn get(&self, idx: u32) -> &Packet<P> {
        self.slots[idx as usize].as_ref().expect("live packet")
    }

    pub(crate) fn get_mut(&mut self, idx: u32) -> &mut Packet<P> {
        self.slots[idx as usize].as_mut().expect("live packet")
    }

    pub(crate) fn remove(&mut self, idx: u32) -> Packet<P> {
        let pkt = self.slots[idx as usize].take().expect("live packet");
        self.free.push(idx);
        self.live -= 1;
        pkt
    }

    pub(crate) fn live(&self) -> usize {
        self.live
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pkt(size: u32) -> Packet<()> {
        Packet {
            src: 0,
            dst: 1,
            plane: 0,
            src_port: 1,
            dst_port: 2,
            ecn: Ecn::Ect0,
            size,
            payload: (),
        }
    }

    #[test]
    fn slab_reuses_slots() {
        let mut s = PacketSlab::new();
        let a = s.insert(pkt(1));
        let b = s.insert(pkt(2));
        assert_eq!(s.live(), 2);
        assert_eq!(s.remove(a).size, 1);
        let c = s.insert(pkt(3));
        assert_eq!(c, a);
        assert_eq!(s.get(b).size, 2);
        assert_eq!(s.live(), 2);
    }
}
