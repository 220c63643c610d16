//! The transmit path: work request → stream → path scheduler → encode → transmit.
//!
//! Priorities within a connection: control packets (handshake, close), ACKs,
//! retransmissions, a completion probe, then new data from the connection's
//! QPs in round robin.

use super::{Ecn, Endpoint, Gather, RegionPin, SealPayload, Transmit};
use crate::connection::{CsnKind, Ctrl};
use crate::consts::{
    ACK_HEADER_LEN, ACK_NAK_ENTRY_LEN, ACK_OPT_RECV_WINDOW, ACK_PATH_ENTRY_MIN_LEN,
    ACK_STREAM_ENTRY_LEN, DATA_HEADER_LEN,
};

/// ACKs after the first that repeat a stream's progress (all of them lost
/// at 10% loss: 1 in 1,000).
const STREAM_REPEATS: u8 = 2;

/// Copies of each HELLO round (PROTOCOL §8.2).
const HELLO_COPIES: u8 = 3;

/// Copies of each ACCEPT (PROTOCOL §8.2).
const ACCEPT_COPIES: u8 = 2;

/// One copy of a handshake packet that goes `copies` times, `left`
/// counting the copies of its round still to go: whether this one starts
/// a round. While some are left, the caller owes the packet again.
fn take_copy(left: &mut u8, copies: u8) -> bool {
    let first = *left == 0;
    if first {
        *left = copies;
    }
    *left -= 1;
    first
}

/// Bytes in flight (in MTUs) below which a packet lost twice goes in two
/// copies (PROTOCOL §13.2).
const TAIL_COPY_FLIGHT_MTUS: u64 = 2;

/// ACKs after the first that repeat a path's entry, room permitting
/// (PROTOCOL §6.2).
const PATH_REPEATS: u8 = 2;

/// ACKs after the first that repeat an RNR NAK, with its QP's stream entry,
/// room permitting (PROTOCOL §11.5).
const NAK_REPEATS: u8 = 2;

/// The longest DATA header: WRITE_IMM's, with its 20-byte extension.
const MAX_DATA_HEADER_LEN: usize = DATA_HEADER_LEN + 20;

/// Room a DATA packet must leave for an ACK to ride on it: the fixed part,
/// a path entry, a stream entry and the window option. Less, and the ACK
/// goes on its own.
const COALESCED_ACK_MIN: usize = ACK_HEADER_LEN + ACK_PATH_ENTRY_MIN_LEN + ACK_STREAM_ENTRY_LEN + 6;

/// A request packet [`encode_data`](Endpoint::encode_data) put out with its
/// payload, as a template for the next segments of the same message in the
/// same GSO batch: their headers differ only in PSN, CSN and offset, and
/// their payloads come from the same region.
#[derive(Debug, Clone, Copy)]
struct Template {
    qp: Qpn,
    msn: u32,
    gen: u8,
    /// Header length.
    hlen: usize,
    /// The payload's region: found by lkey (else by rkey), and its key.
    local: bool,
    key: u32,
    /// Address in that region where message byte 0 would be: the
    /// payload's element, extended back to the message start.
    base: u64,
    /// Message offset where that element ends: packets never cross it.
    end: u32,
}
use crate::integrity::Protect;
use crate::time::Instant;
use crate::verbs::qp::{SegLimit, Segment};
use crate::verbs::{AccessFlags, PdHandle, Qpn};
use crate::wire::{
    data_flags, Accept, AckBuilder, AckHeader, Close, DataHeader, Hello, NakCode, Opcode,
    OpcodeExt, PacketType,
};

impl Endpoint {
    /// Writes the next datagram to send into `buf` and says where it goes.
    /// Call until it returns `None`. `buf` should hold at least one MTU.
    pub fn poll_transmit(&mut self, now: Instant, buf: &mut [u8]) -> Option<Transmit> {
        self.poll_transmit_planes(now, buf, u64::MAX)
    }

    /// [`poll_transmit`](Self::poll_transmit) for a driver with one NIC port
    /// per plane ([`EndpointConfig::plane_ips`](crate::EndpointConfig::plane_ips)):
    /// only packets for the planes whose bit is set in `planes` (bit `k`:
    /// plane `k`, the address `plane_ips[k]`) come out, so a busy port does
    /// not hold up the others. Connections with packets for a masked plane
    /// stay ready for a later call. Stateless replies (COOKIE,
    /// VERSION_NEGOTIATION) go out whatever the mask.
    pub fn poll_transmit_planes(
        &mut self,
        now: Instant,
        buf: &mut [u8],
        planes: u64,
    ) -> Option<Transmit> {
        self.poll_transmit_with(now, buf, planes, None)
    }

    /// [`poll_transmit`](Self::poll_transmit) without copying payloads: the
    /// headers go into `buf` and every payload of at least the gather's
    /// threshold stays in its memory region, named by a
    /// [`Chunk::Region`](super::Chunk::Region); [`Gather::chunks`] lists the transmit's bytes in
    /// wire order (empty: the first `size` bytes of `buf`, as with
    /// `poll_transmit`). The driver sends them with one scatter-gather send
    /// (`sendmsg` with an `iovec` per chunk, zero copy if it likes) and,
    /// once the kernel is done with them, hands their pins
    /// ([`Gather::take_pins`]) back to [`release_pins`](Self::release_pins):
    /// until then their regions are pinned and
    /// [`dereg_mr`](Self::dereg_mr) refuses them with
    /// [`VerbsError::MrSending`](crate::verbs::VerbsError::MrSending). The
    /// datagrams are the ones `poll_transmit` would have written, byte for
    /// byte.
    ///
    /// ```
    /// use metaroce_proto::{Chunk, Endpoint, EndpointConfig, Gather, Instant};
    /// let mut ep = Endpoint::new(EndpointConfig::default(), 1).unwrap();
    /// let mut buf = vec![0u8; 65_536];
    /// let mut g = Gather::new(1024);
    /// let mut pins = Vec::new();
    /// while let Some(t) = ep.poll_transmit_gather(Instant::ZERO, &mut buf, &mut g) {
    ///     g.take_pins(&mut pins);
    ///     for c in g.chunks() {
    ///         match c {
    ///             Chunk::Buf(r) => { let _header = &buf[r.clone()]; }
    ///             Chunk::Region { lkey, range } => { let _payload = &ep.mr(*lkey).unwrap()[range.clone()]; }
    ///         }
    ///     }
    ///     // ... the kernel sends it, and says it is done ...
    ///     ep.release_pins(&mut pins);
    ///     let _ = t;
    /// }
    /// ```
    pub fn poll_transmit_gather(
        &mut self,
        now: Instant,
        buf: &mut [u8],
        gather: &mut Gather,
    ) -> Option<Transmit> {
        gather.start();
        let t = self.poll_transmit_with(now, buf, u64::MAX, Some(&mut *gather));
        if t.is_none() {
            // Never the case (chunks come only with a transmit); were it
            // so, the pins stay in `gather` for the driver's next take.
            gather.chunks.clear();
        }
        t
    }

    /// Lets go of pins of gathered transmits the kernel is done with (and
    /// empties `pins`). Pins another endpoint made are ignored: their
    /// regions stay pinned.
    pub fn release_pins(&mut self, pins: &mut Vec<RegionPin>) {
        for p in pins.drain(..) {
            self.mrs.unpin(p);
        }
    }

    fn poll_transmit_with(
        &mut self,
        now: Instant,
        buf: &mut [u8],
        planes: u64,
        mut gather: Option<&mut Gather>,
    ) -> Option<Transmit> {
        self.last_now = self.last_now.max(now);
        self.run_loss_checks(now);
        if let Some(r) = self.stateless.pop_front() {
            if buf.len() >= r.len {
                buf[..r.len].copy_from_slice(&r.buf[..r.len]);
                return Some(self.sent(Transmit {
                    dst: r.dst,
                    src_ip: self.primary_ip(),
                    src_port: r.src_port,
                    ecn: Ecn::NotEct,
                    size: r.len,
                    segment_size: None,
                }));
            }
        }
        // Connections that only have packets for masked planes: ready again
        // once this call is over. Each connection is tried once per call.
        let mut blocked = Vec::new();
        let mut out = None;
        while let Some(ci) = self.ready.pop_front() {
            if let Some(c) = self.conns[ci].as_mut() {
                c.in_ready = false;
                c.tx_mask = planes;
            }
            // A sealed datagram is encrypted in the buffer: nothing of it
            // can stay in a region.
            let sealed = self.conns[ci].as_ref().is_some_and(|c| c.protect.is_aead());
            let g = if sealed { None } else { gather.as_deref_mut() };
            self.sealing.clear();
            let t = self.transmit_conn(ci, now, buf, g);
            if let Some(c) = self.conns[ci].as_mut() {
                c.tx_mask = u64::MAX;
            }
            match t {
                Some(t) => {
                    self.protect_transmit(ci, buf, gather.as_deref(), &t);
                    self.touch(ci, Some(now));
                    out = Some(self.sent(t));
                    break;
                }
                None => {
                    // Nothing after all: refresh the timer, but do not requeue
                    // unless a masked plane was what stopped it.
                    self.mark_stale(ci);
                    let masked = self.conns[ci]
                        .as_ref()
                        .is_some_and(|c| planes | !plane_bits(c.planes()) != u64::MAX);
                    if masked && self.wants_send(ci, now) {
                        blocked.push(ci);
                    }
                }
            }
        }
        for ci in blocked.into_iter().rev() {
            if let Some(c) = self.conns[ci].as_mut() {
                if !c.in_ready {
                    c.in_ready = true;
                    self.ready.push_front(ci);
                }
            }
        }
        out
    }

    /// Fills the trailer of every datagram of `t`, a transmit of
    /// connection `ci` (PROTOCOL §3.1): each GSO segment is a datagram of
    /// its own. HELLO and ACCEPT go before the protection is in force.
    fn protect_transmit(
        &mut self,
        ci: usize,
        buf: &mut [u8],
        gather: Option<&Gather>,
        t: &Transmit,
    ) {
        let Endpoint {
            conns,
            mrs,
            sealing,
            ..
        } = self;
        let region = |p: &SealPayload| mrs.by_lkey(p.lkey).and_then(|m| m.buf.get(p.range.clone()));
        let Some(c) = conns[ci].as_mut() else {
            return;
        };
        if c.protect.trailer_len() == 0
            || matches!(
                buf.get(1).map(|&b| PacketType::from_u8(b)),
                Some(Ok(PacketType::Hello | PacketType::Accept))
            )
        {
            // Nothing to seal: payloads left in their regions go in as
            // they are.
            for p in sealing.drain(..) {
                fill_in(buf, 0, &p, region(&p));
            }
            return;
        }
        let seg = t.segment_size.unwrap_or(t.size);
        match gather {
            // A sealed connection's transmit is never gathered.
            Some(g) if !g.chunks.is_empty() && !c.protect.is_aead() => {
                crate::integrity::crc_gathered(
                    buf,
                    &g.chunks,
                    |lkey, r| mrs.by_lkey(lkey).and_then(|m| m.buf.get(r)),
                    t.size,
                    seg,
                );
            }
            _ => {
                let mut left = sealing.drain(..).peekable();
                for (i, dg) in buf[..t.size].chunks_mut(seg).enumerate() {
                    let (start, end) = (i * seg, i * seg + dg.len());
                    // The payload at this datagram's end (a datagram
                    // carries one DATA packet, its payload last). Were
                    // there more, all would be copied in first. Entries
                    // come in order, each inside its datagram.
                    let first = left.next_if(|p| p.at < end);
                    let mut whole = true;
                    while let Some(p) = left.next_if(|p| p.at < end) {
                        whole = false;
                        fill_in(dg, start, &p, region(&p));
                    }
                    match first.as_ref().map(|p| (p, region(p))) {
                        Some((p, Some(bytes))) if whole && p.at >= start => {
                            c.protect.seal_from(dg, p.at - start, bytes);
                        }
                        Some((p, bytes)) => {
                            fill_in(dg, start, p, bytes);
                            c.protect.seal(dg);
                        }
                        None => c.protect.seal(dg),
                    }
                }
            }
        }
        sealing.clear();
    }

    /// The address stateless replies and handshakes go from: plane 0.
    pub(crate) fn primary_ip(&self) -> Option<std::net::IpAddr> {
        self.config.plane_ips.first().copied().or(self.local_ip)
    }

    fn sent(&mut self, t: Transmit) -> Transmit {
        self.stats.datagrams_sent += 1;
        self.stats.bytes_sent += t.size as u64;
        t
    }

    pub(crate) fn set_timer(&mut self, ci: usize, next: Option<Instant>) {
        let Some(c) = self.conns[ci].as_mut() else {
            return;
        };
        if c.timer_key != next {
            // The new key in before the old one out: a set that would be
            // empty in between frees its node, and the insert allocates one.
            if let Some(k) = next {
                self.timers.insert((k, ci));
            }
            if let Some(k) = std::mem::replace(&mut c.timer_key, next) {
                self.timers.remove(&(k, ci));
            }
        }
    }

    fn transmit_conn(
        &mut self,
        ci: usize,
        now: Instant,
        buf: &mut [u8],
        mut gather: Option<&mut Gather>,
    ) -> Option<Transmit> {
        let max_paths = self.config.paths;
        let listen_port = self.config.listen_port;
        let grants = self.rcc.enabled();
        let coalesce = self.config.coalesce_acks;
        let extra = if self.config.plane_ips.len() > 1 {
            crate::wire::PlaneAddrs::new(&self.config.plane_ips[1..]).unwrap_or_default()
        } else {
            crate::wire::PlaneAddrs::default()
        };
        let c = self.conns[ci].as_mut()?;
        let mtu = c.mtu.min(buf.len());
        // Every packet built below leaves room for the datagram's trailer
        // (PROTOCOL §3.1), filled once the transmit is complete.
        let tl = c.protect.trailer_len();
        // Handshake and close go on plane 0.
        let (src_ip, mut src_port) = (c.plane_src(0), c.paths_tx[0].src_port);
        let dst = c.peer;
        if c.ctrl.is_some() && !c.plane_open(0) {
            return None;
        }
        if let Some(ctrl) = c.ctrl.take() {
            let security = c.hs_security;
            let with_planes = |len: Result<usize, crate::wire::WireError>, buf: &mut [u8]| {
                let n = len?;
                let n = n + extra.emit(&mut buf[n..])?;
                match security {
                    Some(s) => Ok(n + s.emit(&mut buf[n..])?),
                    None => Ok(n),
                }
            };
            let len = match ctrl {
                Ctrl::Hello => {
                    src_port = c.next_handshake_port();
                    // Each round goes `HELLO_COPIES` times (§8.2); the
                    // copies are counted once, with the first.
                    if take_copy(&mut c.hello_copies_left, HELLO_COPIES) {
                        c.hello_attempts = c.hello_attempts.saturating_add(1);
                        // Exponential backoff from the interval (§8.2).
                        let shift = u32::from(c.hello_backoff).min(16);
                        c.hello_backoff = c.hello_backoff.saturating_add(1);
                        c.hello_deadline = Some(now + c.hello_interval * (1u32 << shift));
                        c.hello_sent_at = now;
                    }
                    if c.hello_copies_left > 0 {
                        c.ctrl = Some(Ctrl::Hello);
                    }
                    let n = Hello {
                        src_cid: c.local_cid,
                        listen_port,
                        mtu: c.mtu as u16,
                        max_paths,
                        grants,
                        coalesce,
                        crc32c: self.config.crc32c,
                        window_kib: handshake_window_kib(&self.rcc, &mut self.rx_active, now),
                        cookie: c.cookie,
                    }
                    .emit(buf);
                    with_planes(n, buf)
                }
                Ctrl::Accept => {
                    src_port = c.next_handshake_port();
                    // Each ACCEPT goes `ACCEPT_COPIES` times, each from
                    // its own port (§8.2).
                    take_copy(&mut c.accept_copies_left, ACCEPT_COPIES);
                    if c.accept_copies_left > 0 {
                        c.ctrl = Some(Ctrl::Accept);
                    }
                    let n = Accept {
                        dst_cid: c.remote_cid,
                        src_cid: c.local_cid,
                        listen_port,
                        mtu: c.mtu as u16,
                        max_paths,
                        grants,
                        coalesce,
                        crc32c: matches!(c.protect, Protect::Crc32c),
                        window_kib: handshake_window_kib(&self.rcc, &mut self.rx_active, now),
                    }
                    .emit(buf);
                    with_planes(n, buf)
                }
                Ctrl::Close(code) => Close {
                    dst_cid: c.remote_cid,
                    code,
                }
                .emit(buf)
                .and_then(|n| with_trailer(n, tl, buf.len())),
            };
            return len.ok().map(|size| Transmit {
                dst,
                src_ip,
                src_port,
                ecn: Ecn::NotEct,
                size,
                segment_size: None,
            });
        }
        if !c.is_established() {
            return None;
        }
        // An ACK whose plane's port is busy waits for it; data on other
        // planes may go meanwhile.
        if c.ack_due(now) && c.plane_open(c.ack_plane()) {
            return self.emit_ack(ci, now, &mut buf[..mtu], tl);
        }
        // Retransmissions: same CSN, new PSN, preferably another path. A
        // silent timeout's probe goes whatever the windows say.
        loop {
            let room = c.cwnd_room(mtu as u64);
            let probe = !room && c.timeout_probes > 0;
            if !(room || probe) || !c.pacer.ready(now) {
                break;
            }
            let Some(csn) = c.retx.pop_front() else { break };
            let tail = c.in_flight < TAIL_COPY_FLIGHT_MTUS * mtu as u64;
            let Some(rec) = c.record_mut(csn) else {
                continue;
            };
            rec.queued = false;
            let copy = core::mem::take(&mut rec.copy_due);
            if rec.acked {
                continue;
            }
            // A packet lost twice at the tail of what was sent (next to
            // nothing else in flight, so no later packet's ACK shows a
            // third loss soon) goes in two copies on two paths (§13.2): the
            // request it belongs to, and every later one, wait on it.
            let twice =
                tail && !copy && rec.transmissions >= 2 && !matches!(rec.kind, CsnKind::Nop);
            let (kind, avoid) = (rec.kind, rec.last_path);
            let pick = if probe {
                c.pick_probe_path(Some(avoid))
            } else {
                c.pick_path(Some(avoid), mtu as u64)
            };
            if probe {
                // Spent; or void when no path may take one (failed or
                // probing paths have probes of their own), so that
                // `wants_send` does not keep asking for it.
                c.timeout_probes = if pick.is_some() {
                    c.timeout_probes - 1
                } else {
                    0
                };
            }
            let Some(path) = pick else {
                c.retx.push_front(csn);
                if let Some(r) = c.record_mut(csn) {
                    r.queued = true;
                    r.copy_due = copy;
                }
                return None;
            };
            c.stats.retransmits += 1;
            if twice {
                // The copy goes next, on another path than this one.
                if let Some(r) = c.record_mut(csn) {
                    r.queued = true;
                    r.copy_due = true;
                    c.retx.push_front(csn);
                }
            }
            let size = self
                .encode_data(
                    ci,
                    path,
                    csn,
                    kind,
                    now,
                    (&mut buf[..mtu], 0),
                    true,
                    None,
                    gather,
                )?
                .0;
            return self.data_transmit(ci, path, size);
        }
        // A failed path probes its new route with a NOP (no message waits
        // on it); a delivered probe makes the path active again.
        let c = self.conns[ci].as_mut()?;
        if let Some(path) = c.probe_path() {
            let p = &mut c.paths_tx[path];
            let tail = p.probe_due;
            if tail {
                p.probe_sent(now);
            }
            if !tail && p.check_due && p.state == crate::connection::PathState::Active {
                c.stats.route_checks += 1;
            } else {
                c.stats.probes_sent += 1;
            }
            return self.emit_nop(ci, path, now, &mut buf[..mtu], None, gather);
        }
        // Progress probes: a NOP asking for one QP's state at once.
        let c = self.conns[ci].as_mut()?;
        if c.csn_room() && c.data_path_room(mtu as u64) {
            let probe = c.qps.iter().copied().find(|&qpn| {
                let idx = (qpn.0 & super::QPN_INDEX_MASK) as usize;
                self.qps
                    .get(idx)
                    .and_then(|q| q.as_ref())
                    .is_some_and(|q| q.qpn == qpn && q.probe_pending)
            });
            if let Some(qpn) = probe {
                let (remote, msn) = {
                    let q = self.qp_mut(qpn)?;
                    q.probe_pending = false;
                    (q.remote_qpn, q.sq.front().map_or(q.next_msn, |w| w.msn))
                };
                let c = self.conns[ci].as_mut()?;
                let path = c.pick_path(None, mtu as u64)?;
                c.stats.probes_sent += 1;
                return self.emit_nop(ci, path, now, &mut buf[..mtu], Some((remote, msn)), gather);
            }
        }
        let c = self.conns[ci].as_mut()?;
        // New data, QPs in round robin.
        if !c.csn_room() || !c.cwnd_room(mtu as u64) || !c.pacer.ready(now) {
            return None;
        }
        // Full segments are sized by the connection's MTU; this buffer
        // may take less.
        let seg_mtu = c.segment_mtu();
        let nq = c.qps.len();
        let start = c.qp_rr;
        for k in 0..nq {
            let c = self.conns[ci].as_mut()?;
            let qpn = c.qps[(start + k) % nq];
            let Some(idx) = self.qp_index(qpn) else {
                continue;
            };
            let q = self.qps[idx].as_mut()?;
            // A request whose local buffer was invalid fails when its turn comes.
            if q.send_offset == 0 && q.state.takes_send() {
                if let Some(w) = q.sq.get(q.send_idx) {
                    if let Some(st) = w.local_error {
                        let msn = w.msn;
                        self.fail_qp(qpn, Some((msn, st)), true);
                        continue;
                    }
                }
            }
            let limit = SegLimit::new(seg_mtu).within(mtu - tl);
            let Some((kind, full)) = self.take_segment(qpn, now, limit) else {
                continue;
            };
            let c = self.conns[ci].as_mut()?;
            c.qp_rr = (start + k + 1) % nq;
            // A path has room (`cwnd_room` above asks `pick_path`'s own
            // question), so the segment always goes out.
            let path = c.pick_path(None, mtu as u64)?;
            let csn = c.new_csn(kind);
            // An ACK owed rides along if the segment leaves room for it.
            let at = if full {
                0
            } else {
                self.coalesce_ack(
                    ci,
                    now,
                    &mut buf[..mtu - tl],
                    kind.payload_len(),
                    gather.as_deref_mut(),
                )
            };
            let (size, template) = self.encode_data(
                ci,
                path,
                csn,
                kind,
                now,
                (&mut buf[at..mtu], at),
                false,
                None,
                gather.as_deref_mut(),
            )?;
            let first = self.data_transmit(ci, path, at + size)?;
            if !full {
                return Some(first);
            }
            return Some(
                self.extend_batch(ci, qpn, path, first, template, now, buf, limit, gather),
            );
        }
        None
    }

    /// The next new segment of `qpn`, as what its CSN will carry, and
    /// whether it is a full one.
    fn take_segment(&mut self, qpn: Qpn, now: Instant, limit: SegLimit) -> Option<(CsnKind, bool)> {
        // `next_segment` clears an RNR wait that has passed even when it
        // then has nothing to send; the check keeps that wait (and the timer
        // it sets) until there is something to send.
        if !self.qp_mut(qpn)?.has_send_work(now) {
            return None;
        }
        self.next_segment_of(qpn, now, limit)
    }

    /// [`take_segment`](Self::take_segment) without its check, for a QP that
    /// has just produced a segment.
    fn next_segment_of(
        &mut self,
        qpn: Qpn,
        now: Instant,
        limit: SegLimit,
    ) -> Option<(CsnKind, bool)> {
        let q = self.qp_mut(qpn)?;
        let (seg, full) = q.next_segment(now, limit)?;
        let kind = match seg {
            Segment::Request {
                msn,
                gen,
                offset,
                len,
            } => {
                q.unacked += 1;
                CsnKind::Request {
                    qp: qpn,
                    msn,
                    gen,
                    offset,
                    len,
                }
            }
            Segment::Response { msn, offset, len } => CsnKind::Response {
                qp: qpn,
                msn,
                offset,
                len,
            },
        };
        Some((kind, full))
    }

    /// Appends more segments of the same QP on the same path to a full
    /// first segment, for one UDP GSO send: every segment but the last is
    /// exactly as long as the first (a segment whose opcode has a longer
    /// header carries that much less payload), so the batch ends after the
    /// first shorter one. A segment of the message before it copies that
    /// one's header and patches it ([`Template`]).
    #[allow(clippy::too_many_arguments)]
    fn extend_batch(
        &mut self,
        ci: usize,
        qpn: Qpn,
        path: usize,
        first: Transmit,
        mut template: Option<Template>,
        now: Instant,
        buf: &mut [u8],
        limit: SegLimit,
        mut gather: Option<&mut Gather>,
    ) -> Transmit {
        let max = self.config.max_gso_segments;
        let seg = first.size;
        let tl = self.conns[ci]
            .as_ref()
            .map_or(0, |c| c.protect.trailer_len());
        let limit = limit.within(seg - tl);
        let mut t = first;
        let mut n = 1;
        // Where the template's header is in `buf`.
        let mut template_at = 0;
        while n < max && t.size == n * seg && buf.len() >= t.size + seg {
            if let Some(tp) = template {
                let k = self.extend_run(
                    ci,
                    path,
                    &tp,
                    template_at,
                    now,
                    buf,
                    &mut t,
                    (seg, max - n),
                    limit,
                    gather.as_deref_mut(),
                );
                n += k;
                if k > 0 {
                    continue;
                }
            }
            let Some(c) = self.conns[ci].as_ref() else {
                break;
            };
            if !c.paths_tx[path].has_room()
                || !c.cwnd_room_on(path, seg as u64)
                || !c.csn_room()
                || !c.pacer.ready(now)
            {
                break;
            }
            // The QP just produced a segment (no RNR wait is pending), so
            // `next_segment` alone says whether it has another.
            let Some((kind, _)) = self.next_segment_of(qpn, now, limit) else {
                break;
            };
            let Some(c) = self.conns[ci].as_mut() else {
                break;
            };
            let csn = c.new_csn(kind);
            // Gathered, the buffer holds only what is not in a region.
            let at = gather.as_ref().map_or(t.size, |g| g.at);
            let size = self
                .encode_data(
                    ci,
                    path,
                    csn,
                    kind,
                    now,
                    (&mut buf[at..at + seg], at),
                    false,
                    None,
                    gather.as_deref_mut(),
                )
                .map(|(size, tp)| {
                    template = tp;
                    template_at = at;
                    size
                });
            match size {
                Some(size) => {
                    t.size += size;
                    n += 1;
                }
                None => break,
            }
        }
        if n > 1 {
            t.segment_size = Some(seg);
        }
        t
    }

    /// Appends to the batch `t` the next segments of the request whose
    /// first segment `tp` describes (its header at `template_at` in `buf`),
    /// as many as the batch (`room` more of `seg` bytes each), the path's
    /// and the connection's windows and the pacer allow, with the checks
    /// and records of [`extend_batch`](Self::extend_batch) for each: the
    /// same packets, in fewer steps. Each header is the template's with
    /// PSN, CSN and offset patched; the region is looked up and
    /// range-checked once. Segments stop at the end of the template's
    /// scatter/gather element. Returns how many it appended: none when that
    /// request is not the QP's next (it ended, or something comes first),
    /// its element ended,
    /// its region is gone or no window has room, which the caller then
    /// sorts out the general way.
    #[allow(clippy::too_many_arguments)]
    fn extend_run(
        &mut self,
        ci: usize,
        path: usize,
        tp: &Template,
        template_at: usize,
        now: Instant,
        buf: &mut [u8],
        t: &mut Transmit,
        (seg, room): (usize, usize),
        limit: SegLimit,
        mut gather: Option<&mut Gather>,
    ) -> usize {
        let Some(idx) = self.qp_index(tp.qp) else {
            return 0;
        };
        let Endpoint {
            conns,
            qps,
            mrs,
            sealing,
            ..
        } = self;
        let (Some(c), Some(q)) = (
            conns.get_mut(ci).and_then(|c| c.as_mut()),
            qps.get_mut(idx).and_then(|q| q.as_mut()),
        ) else {
            return 0;
        };
        let Some((msn, gen, start, total, opcode)) = q.request_under_way(now, limit.mtu) else {
            return 0;
        };
        if (msn, gen) != (tp.msn, tp.gen) {
            return 0;
        }
        // The rest of the template's element: the next one starts afresh.
        let stop = total.min(tp.end);
        if start >= stop {
            return 0;
        }
        let mr = if tp.local {
            mrs.by_lkey(tp.key)
        } else {
            mrs.by_rkey(tp.key)
        };
        // The rest of the element, in its region: checked once.
        let rest = u64::from(stop - start);
        let Some(rest_range) =
            mr.and_then(|m| m.range(tp.base.wrapping_add(u64::from(start)), rest))
        else {
            return 0;
        };
        let lkey = mr.map_or(0, |m| m.info.lkey);
        let max_payload = limit.payload(opcode);
        let hlen = tp.hlen;
        let tl = c.protect.trailer_len();
        let qp = tp.qp;
        let mut offset = start;
        let mut k = 0;
        // The batch stays within the buffer's size even where the payloads
        // are not in it (as `extend_batch` has it): that is what keeps a
        // gathered batch within one UDP datagram's 64 KiB.
        while k < room && offset < stop && buf.len() >= t.size + seg {
            if !c.paths_tx[path].has_room()
                || !c.cwnd_room_on(path, seg as u64)
                || !c.csn_room()
                || !c.pacer.ready(now)
            {
                break;
            }
            let len = (stop - offset).min(max_payload);
            let size = hlen + len as usize + tl;
            let gathered = gather
                .as_ref()
                .is_some_and(|g| len as usize >= g.min_payload);
            let at = gather.as_ref().map_or(t.size, |g| g.at);
            let end = if gathered { at + hlen + tl } else { at + size };
            // Nothing is recorded for a segment that cannot go out whole.
            if size > seg || end > buf.len() || !gathered && mrs.by_lkey(lkey).is_none() {
                break;
            }
            let csn = c.new_csn_sent(
                CsnKind::Request {
                    qp,
                    msn,
                    gen,
                    offset,
                    len,
                },
                path,
            );
            buf.copy_within(template_at..template_at + hlen, at);
            DataHeader::patch_segment(&mut buf[at..], c.paths_tx[path].next_psn, csn, offset);
            let from = rest_range.start + (offset - start) as usize;
            let range = from..from + len as usize;
            match gather.as_deref_mut() {
                Some(g) if gathered => {
                    g.push_region(hlen, mrs, lkey, range);
                    g.push_trailer(tl);
                }
                g => {
                    if c.protect.is_aead() {
                        // Encrypted into place when the transmit is sealed.
                        sealing.push(SealPayload {
                            at: at + hlen,
                            lkey,
                            range,
                        });
                    } else if let Some(m) = mrs.by_lkey(lkey) {
                        buf[at + hlen..end - tl].copy_from_slice(&m.buf[range]);
                    }
                    if let Some(g) = g {
                        g.push_buf(size);
                    }
                }
            }
            c.note_data_sent(path, csn, now, size, len as usize, false, true);
            q.advance_request(now, len, total);
            offset += len;
            t.size += size;
            k += 1;
            if size < seg {
                // A shorter segment ends the batch.
                break;
            }
        }
        k
    }

    /// A NOP probe on `path` (asking for one QP's state if `probe`).
    fn emit_nop(
        &mut self,
        ci: usize,
        path: usize,
        now: Instant,
        buf: &mut [u8],
        probe: Option<(u32, u32)>,
        gather: Option<&mut Gather>,
    ) -> Option<Transmit> {
        let c = self.conns[ci].as_mut()?;
        let csn = c.new_csn(CsnKind::Nop);
        let (size, _) = self.encode_data(
            ci,
            path,
            csn,
            CsnKind::Nop,
            now,
            (buf, 0),
            false,
            probe,
            gather,
        )?;
        self.data_transmit(ci, path, size)
    }

    /// The transmit of a DATA packet of `size` bytes that
    /// [`encode_data`](Self::encode_data) put out on `path`, on its own.
    fn data_transmit(&self, ci: usize, path: usize, size: usize) -> Option<Transmit> {
        let c = self.conns[ci].as_ref()?;
        let p = &c.paths_tx[path];
        Some(Transmit {
            dst: c.plane_dst(p.plane),
            src_ip: c.plane_src(p.plane),
            src_port: p.src_port,
            ecn: Ecn::Ect0,
            size,
            segment_size: None,
        })
    }

    /// Encodes one DATA packet for `csn` on `path` and records it; returns
    /// its size, and for a request's payload the [`Template`] its message's
    /// next segments may follow. With a gather, a large enough payload stays
    /// in its region and only the header goes into `buf`.
    #[allow(clippy::too_many_arguments)]
    fn encode_data(
        &mut self,
        ci: usize,
        path: usize,
        csn: u32,
        kind: CsnKind,
        now: Instant,
        (buf, base): (&mut [u8], usize),
        retransmit: bool,
        probe: Option<(u32, u32)>,
        gather: Option<&mut Gather>,
    ) -> Option<(usize, Option<Template>)> {
        let Endpoint {
            conns,
            qps,
            mrs,
            sealing,
            ..
        } = self;
        let c = conns[ci].as_mut()?;
        let mtu = c.segment_mtu();
        let p = &c.paths_tx[path];
        let mut hdr = DataHeader {
            opcode: Opcode::Nop,
            flags: data_flags::ECT,
            dst_cid: c.remote_cid,
            dst_qpn: 0,
            path_id: p.id,
            gen: 0,
            psn: p.next_psn,
            csn,
            tx_ts: now.wire_ts(),
            msn: 0,
            msg_len: 0,
            msg_offset: 0,
            ext: OpcodeExt::Nop,
        };
        if retransmit {
            hdr.flags |= data_flags::RETRANSMIT;
        }
        if let Some((dst_qpn, msn)) = probe {
            hdr.flags |= data_flags::ACK_REQ;
            hdr.dst_qpn = dst_qpn;
            hdr.msn = msn;
        }
        let qp_of = |qpn: Qpn| {
            let idx = (qpn.0 & super::QPN_INDEX_MASK) as usize;
            qps.get(idx)
                .and_then(|q| q.as_ref())
                .filter(|q| q.qpn == qpn)
        };
        // Where the payload comes from: (region found by lkey?, key, address,
        // length), and what the region must allow: a READ response is
        // checked at every transmission as its request was on arrival.
        let mut source: Option<(bool, u32, u64, u32)> = None;
        let mut remote_read: Option<PdHandle> = None;
        // A request's payload: where its element ends in the message.
        let mut sge_end = 0;
        // The message's later packets carry the same header as this one,
        // which can then serve them as a template (not a first packet
        // whose immediate data the later ones go without).
        let mut same_later = false;
        match kind {
            CsnKind::Request {
                qp,
                msn,
                gen,
                offset,
                len,
            } => {
                if let Some(q) = qp_of(qp).filter(|q| q.state.takes_send()) {
                    if let Some(w) = q.wqe(msn).filter(|w| w.gen == gen) {
                        hdr.ext = w.ext_at(offset, mtu);
                        hdr.opcode = hdr.ext.opcode();
                        same_later = hdr.opcode == w.later_opcode(mtu);
                        hdr.dst_qpn = q.remote_qpn;
                        hdr.gen = gen;
                        hdr.msn = msn;
                        hdr.msg_len = w.msg_len();
                        hdr.msg_offset = offset;
                        // One element holds the whole payload (segments
                        // stop at element ends); a range that is not in
                        // one names key 0, never issued: the CSN goes as a
                        // NOP.
                        let elem =
                            w.wr.local
                                .locate(offset)
                                .filter(|&(_, _, end)| len > 0 && len <= end - offset);
                        if let Some((sge, at, end)) = elem {
                            sge_end = end;
                            source =
                                Some((true, sge.lkey, sge.addr.wrapping_add(u64::from(at)), len));
                        } else if len > 0 {
                            source = Some((true, 0, 0, len));
                        }
                    }
                }
            }
            CsnKind::Response {
                qp,
                msn,
                offset,
                len,
            } => {
                // A QP in ERROR still answers the READs it executed before
                // the request that failed it.
                let answering = qp_of(qp)
                    .filter(|q| q.state.responds() || q.state == crate::verbs::QpState::Error);
                if let Some(q) = answering {
                    if let Some(r) = q.read_resps.iter().find(|r| r.msn == msn) {
                        hdr.opcode = Opcode::ReadResp;
                        hdr.ext = OpcodeExt::ReadResp;
                        hdr.dst_qpn = q.remote_qpn;
                        hdr.msn = msn;
                        hdr.msg_len = r.len;
                        hdr.msg_offset = offset;
                        if len > 0 {
                            source =
                                Some((false, r.rkey, r.addr.wrapping_add(u64::from(offset)), len));
                            remote_read = Some(q.pd);
                        }
                    }
                }
            }
            CsnKind::Nop => {}
        }
        // The payload: its region and its range there, looked up once.
        let found = source.and_then(|(local, key, addr, len)| {
            let mr = if local {
                mrs.by_lkey(key)
            } else {
                mrs.by_rkey(key)
            }?;
            let range = match remote_read {
                Some(pd) => mr.permits(pd, AccessFlags::REMOTE_READ, addr, u64::from(len))?,
                None => mr.range(addr, u64::from(len))?,
            };
            Some((mr, range))
        });
        if source.is_some() && found.is_none() {
            // The source vanished: keep the CSN alive as a NOP.
            hdr = nop_of(&hdr);
        }
        // Zero-length segments, and CSNs whose request is gone (already a NOP).
        let plen = found.as_ref().map_or(0, |(_, r)| r.len());
        let tl = c.protect.trailer_len();
        let hlen = hdr.emit_header(buf, plen).ok()?;
        let size = hlen + plen + tl;
        if size > buf.len() {
            return None;
        }
        let template = match (kind, source) {
            (CsnKind::Request { qp, msn, gen, .. }, Some((local, key, addr, _)))
                if found.is_some() && !retransmit && probe.is_none() && same_later =>
            {
                Some(Template {
                    qp,
                    msn,
                    gen,
                    hlen,
                    local,
                    key,
                    base: addr.wrapping_sub(u64::from(hdr.msg_offset)),
                    end: sge_end,
                })
            }
            _ => None,
        };
        match (found, gather) {
            (Some((mr, range)), Some(g)) if plen >= g.min_payload => {
                let lkey = mr.info.lkey;
                g.push_region(hlen, mrs, lkey, range);
                g.push_trailer(tl);
            }
            (found, g) => {
                if let Some((mr, range)) = found {
                    if c.protect.is_aead() {
                        // Encrypted into place when the transmit is sealed.
                        sealing.push(SealPayload {
                            at: base + hlen,
                            lkey: mr.info.lkey,
                            range,
                        });
                    } else {
                        buf[hlen..hlen + plen].copy_from_slice(&mr.buf[range]);
                    }
                }
                if let Some(g) = g {
                    g.push_buf(size);
                }
            }
        }
        c.note_data_sent(path, csn, now, size, plen, retransmit, false);
        Some((size, template))
    }

    /// The receiver's grant for each sender: its inbound capacity and its
    /// receive buffer, each shared by the connections that delivered data
    /// recently: the rate and the window an ACK carries.
    fn grant(&mut self, now: Instant) -> (u32, Option<u32>) {
        let active = self.rx_active.count(now);
        (self.rate_hint(now), self.rcc.window_share(active))
    }

    /// The receiver's rate grant for each sender: its inbound capacity
    /// shared by the connections that delivered data recently. The count is
    /// refreshed at most 16 times per activity window, so an ACK rarely
    /// costs a scan.
    fn rate_hint(&mut self, now: Instant) -> u32 {
        if !self.rcc.enabled() {
            return 0;
        }
        if self.rcc.stale(now) {
            let window = self.rcc.window();
            let active = self
                .conns
                .iter()
                .flatten()
                .filter(|c| {
                    // A connection a peer opened to us counts from the
                    // moment it is accepted, before its first data: the
                    // first ACKs of an incast then already share the
                    // capacity among every sender of it.
                    c.is_established()
                        && match c.sender_rx_at {
                            Some(at) => now.saturating_since(at) <= window,
                            None => {
                                !c.is_client && now.saturating_since(c.established_at) <= window
                            }
                        }
                })
                .count();
            self.rcc.set_active(now, active);
        }
        self.rcc.hint_kbps()
    }

    /// Sends an ACK on its own: everything the peer is owed that fits.
    /// `tl`: the connection's trailer length, left free at the end.
    fn emit_ack(&mut self, ci: usize, now: Instant, buf: &mut [u8], tl: usize) -> Option<Transmit> {
        let room = buf.len().checked_sub(tl)?;
        let size = self.encode_ack(ci, now, &mut buf[..room], false)? + tl;
        let c = self.conns[ci].as_mut()?;
        // ACKs rotate over the working paths (source ports) of the plane the
        // latest DATA arrived on.
        let pi = c.next_ack_path(now);
        let plane = c.paths_tx[pi].plane;
        Some(Transmit {
            dst: c.plane_dst(plane),
            src_ip: c.plane_src(plane),
            src_port: c.paths_tx[pi].src_port,
            ecn: Ecn::NotEct,
            size,
            segment_size: None,
        })
    }

    /// Puts the ACK the peer is owed, if any, at the start of `buf` (an
    /// MTU), coalesced with the DATA packet of `payload` bytes to follow it
    /// (PROTOCOL §6.7), when the peer takes such datagrams and the packet
    /// leaves room; returns its length (0: none). With a gather, the ACK is
    /// the transmit's first chunk.
    fn coalesce_ack(
        &mut self,
        ci: usize,
        now: Instant,
        buf: &mut [u8],
        payload: usize,
        gather: Option<&mut Gather>,
    ) -> usize {
        let Some(c) = self.conns[ci].as_ref() else {
            return 0;
        };
        if !c.peer_coalesce || !c.ack_needed {
            return 0;
        }
        let room = buf.len().saturating_sub(MAX_DATA_HEADER_LEN + payload);
        if room < COALESCED_ACK_MIN {
            return 0;
        }
        let Some(n) = self.encode_ack(ci, now, &mut buf[..room], true) else {
            return 0;
        };
        if let Some(c) = self.conns[ci].as_mut() {
            c.stats.acks_coalesced += 1;
        }
        if let Some(g) = gather {
            g.push_buf(n);
        }
        n
    }

    /// Encodes an ACK with everything the peer is owed that fits into
    /// `buf`; `coalesced`: a DATA packet will follow it in the datagram.
    /// Returns its length.
    fn encode_ack(
        &mut self,
        ci: usize,
        now: Instant,
        buf: &mut [u8],
        coalesced: bool,
    ) -> Option<usize> {
        let (hint, window) = self.grant(now);
        let c = self.conns[ci].as_mut()?;
        let hdr = AckHeader {
            flags: 0,
            dst_cid: c.remote_cid,
            cum_csn: c.rx_csn.cum(),
            ts_echo: c.last_rx_ts,
            ack_delay_ns: u32::try_from(now.saturating_since(c.last_rx_at).as_nanos())
                .unwrap_or(u32::MAX),
            rate_hint_kbps: hint,
            echo_path: c.last_rx_path,
        };
        let mut streams: Vec<Qpn> = std::mem::take(&mut c.dirty_streams);
        // Progress reported lately rides along again: at 10% loss one
        // completion in ten would otherwise wait for the next message's ACK
        // (or a progress probe), idling a sender whose requests are all sent.
        let fresh = streams.len();
        for &(qpn, _) in &c.recent_streams {
            if !streams.contains(&qpn) {
                streams.push(qpn);
            }
        }
        let mut entries = std::mem::take(&mut self.stream_scratch);
        for (i, &qpn) in streams.iter().enumerate() {
            let live = self.qp_index(qpn).and_then(|idx| self.qps[idx].as_mut());
            if let Some(q) = live {
                entries.push((q.stream_entry(), qpn, i < fresh));
                q.reported_msn_done = q.msn_done;
            } else if let Some(&(_, e)) = self.conns[ci]
                .as_ref()
                .and_then(|c| c.retired_streams.iter().find(|r| r.0 == qpn))
            {
                // A destroyed QP's last progress (`retire_stream`).
                entries.push((e, qpn, i < fresh));
            }
        }
        let c = self.conns[ci].as_mut()?;
        // The list goes back, empty, with its room (nothing else fills it
        // meanwhile): no allocation per ACK.
        streams.clear();
        c.dirty_streams = streams;
        let mut b = AckBuilder::new(buf, hdr).ok()?;
        // The options go last in the packet, but their room is kept first:
        // the window must not lose its place to path entries.
        let window_len = if window.is_some() { 2 + 4 } else { 0 };
        let mut more = false;
        for (i, p) in c.paths_rx.iter_mut().enumerate() {
            if !p.dirty {
                continue;
            }
            let entry = p.entry(i as u8);
            if b.fits(entry.encoded_len() + window_len) && b.push_path(&entry).is_ok() {
                p.dirty = false;
                p.repeats = PATH_REPEATS;
            } else {
                more = true;
            }
        }
        // Entries reported lately ride along again where the ACK has room
        // left after what it owes (§6.2), if the path received a packet at
        // or beyond the cumulative CSN (which acknowledges everything
        // before it): with many paths, each carries a few packets, and the
        // one ACK that reported them may be lost.
        if c.repeat_acks > 0 {
            c.repeat_acks -= 1;
            let owed = window_len
                + entries.len() * ACK_STREAM_ENTRY_LEN
                + c.naks.len() * ACK_NAK_ENTRY_LEN;
            let cum = c.rx_csn.cum();
            for (i, p) in c.paths_rx.iter_mut().enumerate() {
                if p.dirty || p.repeats == 0 || !p.holds_beyond(cum) {
                    continue;
                }
                let entry = p.entry(i as u8);
                if b.fits(entry.encoded_len() + owed) && b.push_path(&entry).is_ok() {
                    p.repeats -= 1;
                }
            }
        }
        let mut unsent_streams = Vec::new();
        // The requester's QPs whose stream entry this ACK carries, noted
        // only for the RNR NAKs to repeat below (most ACKs have none).
        let repeats_naks = !c.recent_naks.is_empty();
        let mut reported: Vec<u32> = Vec::new();
        for (e, qpn, fresh) in &entries {
            let sent = b.push_stream(e).is_ok();
            if sent && repeats_naks {
                reported.push(e.qpn);
            }
            if *fresh {
                if sent {
                    match c.recent_streams.iter_mut().find(|r| r.0 == *qpn) {
                        Some(r) => r.1 = STREAM_REPEATS + 1,
                        None => c.recent_streams.push((*qpn, STREAM_REPEATS + 1)),
                    }
                } else {
                    unsent_streams.push(*qpn);
                }
            }
        }
        entries.clear();
        self.stream_scratch = entries;
        // One repeat used up by this ACK (fresh entries start one higher).
        c.recent_streams.retain_mut(|r| {
            r.1 = r.1.saturating_sub(1);
            r.1 > 0
        });
        more |= !unsent_streams.is_empty();
        c.dirty_streams.extend(unsent_streams);
        if !c.retired_streams.is_empty() {
            let (recent, dirty) = (&c.recent_streams, &c.dirty_streams);
            c.retired_streams
                .retain(|r| dirty.contains(&r.0) || recent.iter().any(|x| x.0 == r.0));
        }
        let repeats_from = c.recent_naks.len();
        while let Some(n) = c.naks.front() {
            if b.push_nak(n).is_err() {
                more = true;
                break;
            }
            if n.code == NakCode::Rnr {
                c.recent_naks.push((*n, NAK_REPEATS));
            }
            c.naks.pop_front();
            c.stats.naks_sent += 1;
        }
        // RNR NAKs sent lately ride along again where room is left, each
        // with its QP's stream entry (the requester checks the NAK against
        // it): one lost ACK may have carried a whole window's NAKs, and the
        // requester would learn of each only from a progress probe.
        // Each is offered to the next `NAK_REPEATS` ACKs, fitting or not.
        let mut room = true;
        for (n, left) in c.recent_naks[..repeats_from].iter_mut() {
            *left -= 1;
            if room && reported.contains(&n.qpn) {
                room = b.fits(ACK_NAK_ENTRY_LEN + window_len) && b.push_nak(n).is_ok();
            }
        }
        c.recent_naks.retain(|&(_, left)| left > 0);
        if let Some(w) = window {
            // Room was kept above; were it short, the sender keeps the
            // share of the previous ACK.
            let _ = b.push_option(ACK_OPT_RECV_WINDOW, &w.to_be_bytes());
        }
        // A coalesced ACK's options are at most 6 bytes here, well within
        // the 255 its length byte can say.
        let size = if coalesced {
            b.finish_coalesced().ok()?
        } else {
            b.finish()
        };
        c.stats.acks_sent += 1;
        if more {
            c.ack_now = true;
        } else {
            c.ack_needed = false;
            c.ack_now = false;
            c.ack_deadline = None;
            c.since_ack = 0;
        }
        Some(size)
    }
}

/// The receive window a HELLO or an ACCEPT gives the peer until this side's
/// first ACK: the buffer shared by the senders active now and the new one,
/// in KiB (at least 1 when there is a buffer; 0: none).
fn handshake_window_kib(
    rcc: &crate::cc::ReceiverCc,
    active: &mut crate::cc::ActiveSenders,
    now: Instant,
) -> u16 {
    rcc.window_share(active.count(now) + 1)
        .map_or(0, |w| (w / 1024).clamp(1, u32::from(u16::MAX)) as u16)
}

/// A packet of `n` bytes followed by a trailer of `tl`, in a buffer of `cap`.
fn with_trailer(n: usize, tl: usize, cap: usize) -> Result<usize, crate::wire::WireError> {
    if n + tl > cap {
        return Err(crate::wire::WireError::BufferTooSmall {
            need: n + tl,
            have: cap,
        });
    }
    Ok(n + tl)
}

/// Bit mask of planes `0..planes`.
fn plane_bits(planes: usize) -> u64 {
    if planes >= 64 {
        u64::MAX
    } else {
        (1u64 << planes) - 1
    }
}

/// The NOP that keeps `h`'s CSN alive when its contents are gone.
fn nop_of(h: &DataHeader) -> DataHeader {
    DataHeader {
        opcode: Opcode::Nop,
        ext: OpcodeExt::Nop,
        dst_qpn: 0,
        gen: 0,
        msn: 0,
        msg_len: 0,
        msg_offset: 0,
        ..*h
    }
}

/// Copies a deferred payload into datagram `dg` (which starts at `start` in
/// the transmit buffer); where its region is gone (never the case: it was
/// read when the packet was built, in the same call), what is at its place
/// is zeroed rather than sent as it is.
fn fill_in(dg: &mut [u8], start: usize, p: &SealPayload, bytes: Option<&[u8]>) {
    let Some(at) = p.at.checked_sub(start) else {
        return;
    };
    let len = p.range.len();
    let Some(place) = dg.get_mut(at..at + len) else {
        return;
    };
    match bytes {
        Some(b) if b.len() == len => place.copy_from_slice(b),
        _ => place.fill(0),
    }
}
