//! Where a frame goes: the kernel's route to a peer and the next hop's
//! Ethernet address, asked over rtnetlink (`netlink-packet-route`) and
//! cached until the kernel announces a change of routes or neighbours.

use netlink_packet_core::{
    NetlinkHeader, NetlinkMessage, NetlinkPayload, NLM_F_DUMP, NLM_F_REQUEST,
};
use netlink_packet_route::link::{LinkAttribute, LinkLayerType, LinkMessage};
use netlink_packet_route::neighbour::{
    NeighbourAddress, NeighbourAttribute, NeighbourMessage, NeighbourState,
};
use netlink_packet_route::route::{RouteAddress, RouteAttribute, RouteMessage};
use netlink_packet_route::{AddressFamily, RouteNetlinkMessage};
use netlink_sys::{protocols::NETLINK_ROUTE, Socket, SocketAddr};
use rustc_hash::FxHashMap;
use std::io;
use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, Instant};

/// rtnetlink multicast groups (`RTNLGRP_*`) whose messages void the cache.
const RTNLGRP_LINK: u32 = 1;
const RTNLGRP_NEIGH: u32 = 3;
const RTNLGRP_IPV4_ROUTE: u32 = 7;

/// How long an unresolved next hop waits before it is asked again (its
/// frames go through the kernel meanwhile, which resolves it).
const MISS_RETRY: Duration = Duration::from_millis(2);
/// The longest a resolved entry is trusted without a change notice.
const MAX_AGE: Duration = Duration::from_secs(5);

/// Where the kernel sends a frame to one destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Hop {
    /// Out of our interface to this Ethernet address.
    Mac([u8; 6]),
    /// Not resolvable here now (another interface, no neighbour entry
    /// yet): hand the datagram to the kernel.
    Kernel,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    hop: Hop,
    at: Instant,
}

/// Route and neighbour lookups for one interface.
pub(crate) struct Routes {
    ifindex: u32,
    req: Socket,
    events: Socket,
    cache: FxHashMap<Ipv4Addr, Entry>,
    buf: Vec<u8>,
    seq: u32,
    /// Lookups made (cache misses), for the driver's counters.
    pub(crate) lookups: u64,
}

impl std::fmt::Debug for Routes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Routes")
            .field("ifindex", &self.ifindex)
            .field("cached", &self.cache.len())
            .finish_non_exhaustive()
    }
}

impl Routes {
    pub(crate) fn new(ifindex: u32) -> io::Result<Routes> {
        let mut req = Socket::new(NETLINK_ROUTE)?;
        req.bind_auto()?;
        req.connect(&SocketAddr::new(0, 0))?;
        let mut events = Socket::new(NETLINK_ROUTE)?;
        events.bind_auto()?;
        for g in [RTNLGRP_LINK, RTNLGRP_NEIGH, RTNLGRP_IPV4_ROUTE] {
            events.add_membership(g)?;
        }
        events.set_non_blocking(true)?;
        Ok(Routes {
            ifindex,
            req,
            events,
            cache: FxHashMap::default(),
            buf: vec![0u8; 64 << 10],
            seq: 0,
            lookups: 0,
        })
    }

    /// The descriptor that becomes readable when routes or neighbours change.
    pub(crate) fn event_fd(&self) -> i32 {
        std::os::fd::AsRawFd::as_raw_fd(&self.events)
    }

    /// Drops the cache if the kernel announced a change since the last call.
    pub(crate) fn refresh(&mut self) {
        let mut changed = false;
        loop {
            match self.events.recv(&mut &mut self.buf[..], libc::MSG_DONTWAIT) {
                Ok(n) if n > 0 => changed = true,
                _ => break,
            }
        }
        if changed {
            self.cache.clear();
        }
    }

    /// Where frames to `dst` go now.
    pub(crate) fn hop(&mut self, dst: Ipv4Addr, now: Instant) -> Hop {
        if let Some(e) = self.cache.get(&dst) {
            let ttl = match e.hop {
                Hop::Mac(_) => MAX_AGE,
                Hop::Kernel => MISS_RETRY,
            };
            if now.duration_since(e.at) < ttl {
                return e.hop;
            }
        }
        self.lookups += 1;
        let hop = match self.resolve(dst) {
            Ok(h) => h,
            Err(e) => {
                tracing::debug!(%dst, error = %e, "route lookup failed");
                Hop::Kernel
            }
        };
        if self.cache.len() > 4096 {
            self.cache.clear();
        }
        self.cache.insert(dst, Entry { hop, at: now });
        hop
    }

    fn resolve(&mut self, dst: Ipv4Addr) -> io::Result<Hop> {
        let Some((oif, via)) = self.route(dst)? else {
            return Ok(Hop::Kernel);
        };
        if oif != self.ifindex {
            return Ok(Hop::Kernel);
        }
        Ok(self.neighbour(via)?.map_or(Hop::Kernel, Hop::Mac))
    }

    fn request(&mut self, msg: RouteNetlinkMessage, dump: bool) -> io::Result<()> {
        let mut hdr = NetlinkHeader::default();
        hdr.flags = NLM_F_REQUEST | if dump { NLM_F_DUMP } else { 0 };
        self.seq = self.seq.wrapping_add(1);
        hdr.sequence_number = self.seq;
        let mut m = NetlinkMessage::new(hdr, NetlinkPayload::from(msg));
        m.finalize();
        let mut out = vec![0u8; m.header.length as usize];
        m.serialize(&mut out[..]);
        self.req.send(&out, 0)?;
        Ok(())
    }

    /// Reads replies to the last request, calling `f` with each message,
    /// until the reply ends (`Done`, or one message without `DUMP`).
    fn replies(&mut self, dump: bool, mut f: impl FnMut(RouteNetlinkMessage)) -> io::Result<()> {
        loop {
            let n = self.req.recv(&mut &mut self.buf[..], 0)?;
            let mut off = 0;
            while off < n {
                let msg: NetlinkMessage<RouteNetlinkMessage> =
                    NetlinkMessage::deserialize(&self.buf[off..n])
                        .map_err(|e| io::Error::other(e.to_string()))?;
                let len = msg.header.length as usize;
                let ours = msg.header.sequence_number == self.seq;
                match msg.payload {
                    NetlinkPayload::Done(_) if ours => return Ok(()),
                    NetlinkPayload::Error(e) if ours => {
                        return match e.code {
                            None => Ok(()),
                            Some(c) => Err(io::Error::from_raw_os_error(-c.get())),
                        }
                    }
                    NetlinkPayload::InnerMessage(m) if ours => {
                        f(m);
                        if !dump {
                            return Ok(());
                        }
                    }
                    _ => {}
                }
                if len == 0 {
                    break;
                }
                off += len;
            }
        }
    }

    /// The kernel's route to `dst`: output interface and next hop.
    fn route(&mut self, dst: Ipv4Addr) -> io::Result<Option<(u32, Ipv4Addr)>> {
        let mut m = RouteMessage::default();
        m.header.address_family = AddressFamily::Inet;
        m.header.destination_prefix_length = 32;
        m.attributes
            .push(RouteAttribute::Destination(RouteAddress::Inet(dst)));
        self.request(RouteNetlinkMessage::GetRoute(m), false)?;
        let mut out = None;
        self.replies(false, |m| {
            if let RouteNetlinkMessage::NewRoute(r) = m {
                let mut oif = None;
                let mut via = dst;
                for a in &r.attributes {
                    match a {
                        RouteAttribute::Oif(i) => oif = Some(*i),
                        RouteAttribute::Gateway(RouteAddress::Inet(g)) => via = *g,
                        _ => {}
                    }
                }
                out = oif.map(|o| (o, via));
            }
        })?;
        Ok(out)
    }

    /// Our interface's Ethernet address, receive queues and MTU
    /// (`RTM_GETLINK`).
    pub(crate) fn link(&mut self) -> io::Result<([u8; 6], u32, u32)> {
        let mut m = LinkMessage::default();
        m.header.index = self.ifindex;
        self.request(RouteNetlinkMessage::GetLink(m), false)?;
        let mut out = Err(io::Error::other("no reply about the interface"));
        self.replies(false, |m| {
            let RouteNetlinkMessage::NewLink(l) = m else {
                return;
            };
            if l.header.link_layer_type != LinkLayerType::Ether {
                out = Err(io::Error::other("not an Ethernet interface"));
                return;
            }
            let mut mac = None;
            let mut queues = 1;
            let mut mtu = 1500;
            for a in &l.attributes {
                match a {
                    LinkAttribute::Address(b) if b.len() == 6 => {
                        mac = Some([b[0], b[1], b[2], b[3], b[4], b[5]]);
                    }
                    LinkAttribute::NumRxQueues(n) => queues = (*n).max(1),
                    LinkAttribute::Mtu(n) => mtu = *n,
                    _ => {}
                }
            }
            out = mac
                .map(|m| (m, queues, mtu))
                .ok_or_else(|| io::Error::other("the interface has no Ethernet address"));
        })?;
        out
    }

    /// The Ethernet address of `ip` on our interface, if the kernel knows it.
    fn neighbour(&mut self, ip: Ipv4Addr) -> io::Result<Option<[u8; 6]>> {
        let mut m = NeighbourMessage::default();
        m.header.family = AddressFamily::Inet;
        m.header.ifindex = self.ifindex;
        self.request(RouteNetlinkMessage::GetNeighbour(m), true)?;
        let ifindex = self.ifindex;
        let mut out = None;
        self.replies(true, |m| {
            let RouteNetlinkMessage::NewNeighbour(n) = m else {
                return;
            };
            if n.header.ifindex != ifindex
                || matches!(
                    n.header.state,
                    NeighbourState::Incomplete | NeighbourState::Failed | NeighbourState::None
                )
            {
                return;
            }
            let mut dst = None;
            let mut mac = None;
            for a in &n.attributes {
                match a {
                    NeighbourAttribute::Destination(NeighbourAddress::Inet(d)) => dst = Some(*d),
                    NeighbourAttribute::LinkLayerAddress(l) if l.len() == 6 => {
                        mac = Some([l[0], l[1], l[2], l[3], l[4], l[5]]);
                    }
                    _ => {}
                }
            }
            if dst == Some(ip) && mac.is_some() {
                out = mac;
            }
        })?;
        Ok(out)
    }
}

/// The interface the kernel routes `peer` through, by name.
pub fn route_interface(peer: IpAddr) -> io::Result<String> {
    let IpAddr::V4(dst) = peer else {
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "the AF_XDP backend carries IPv4 only",
        ));
    };
    let mut r = Routes::new(0)?;
    let (oif, _) = r
        .route(dst)?
        .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, format!("no route to {dst}")))?;
    interface_name(oif)
}

/// The name of interface `ifindex`.
pub(crate) fn interface_name(ifindex: u32) -> io::Result<String> {
    let mut name = [0 as libc::c_char; libc::IF_NAMESIZE];
    // SAFETY: `name` has the IF_NAMESIZE bytes if_indextoname writes at most.
    let p = unsafe { libc::if_indextoname(ifindex, name.as_mut_ptr()) };
    if p.is_null() {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: on success the buffer holds a NUL-terminated name.
    let s = unsafe { std::ffi::CStr::from_ptr(name.as_ptr()) };
    Ok(s.to_string_lossy().into_owned())
}

/// The index of interface `name`.
pub(crate) fn interface_index(name: &str) -> io::Result<u32> {
    let c = std::ffi::CString::new(name)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "interface name with a NUL"))?;
    // SAFETY: `c` is a valid NUL-terminated string.
    let i = unsafe { libc::if_nametoindex(c.as_ptr()) };
    if i == 0 {
        Err(io::Error::new(
            io::ErrorKind::NotFound,
            format!("no interface named {name}"),
        ))
    } else {
        Ok(i)
    }
}

/// The interface that holds address `ip`.
pub(crate) fn interface_of(ip: Ipv4Addr) -> io::Result<String> {
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `list` with a list we free below.
    if unsafe { libc::getifaddrs(&mut list) } < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut found = None;
    let mut p = list;
    while !p.is_null() {
        // SAFETY: `p` is a node of the list getifaddrs returned.
        let ifa = unsafe { &*p };
        if !ifa.ifa_addr.is_null() {
            // SAFETY: a non-null ifa_addr points to a sockaddr of its family.
            let fam = unsafe { (*ifa.ifa_addr).sa_family };
            if i32::from(fam) == libc::AF_INET {
                // SAFETY: an AF_INET address is a sockaddr_in.
                let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
                if Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)) == ip {
                    // SAFETY: ifa_name is a NUL-terminated string.
                    let name = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) };
                    found = Some(name.to_string_lossy().into_owned());
                    break;
                }
            }
        }
        p = ifa.ifa_next;
    }
    // SAFETY: `list` came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(list) };
    found.ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, format!("no interface holds {ip}")))
}
