//! The receive path: datagram → decode → connection → path and CSN
//! bookkeeping → stream (QP) placement → completions and ACK state.

use super::{cookie, qp_ops::rnr_us, Endpoint, Event, StatelessReply, MAX_STATELESS_QUEUE};
use crate::connection::{AckTiming, ConnectionError, ConnectionState, CsnKind, Ctrl, PathEvent};
use crate::consts::{ACK_OPT_RECV_WINDOW, HELLO_LEN, REPEAT_ACKS_AFTER_DUPLICATE};
use crate::integrity::{proofs_equal, Aead, Protect};
use crate::reliability::SeqAccept;
use crate::stats::RejectReason;
use crate::time::Instant;
use crate::verbs::qp::{Accepted, Incoming, IncomingReject};
use crate::verbs::{AccessFlags, ConnectionHandle, QpState, Qpn, WcStatus};
use crate::wire::seq::{seq_dist, seq_le, seq_lt};
use crate::wire::{
    self, data_flags, Accept, AckPacket, Close, CloseCode, CookieReply, DataHeader, Hello, NakCode,
    NakEntry, Opcode, OpcodeExt, PacketType, PlaneAddrs, SecurityExt, VersionNegotiation,
    WireError, SUITE_AES_128_GCM,
};
use std::net::SocketAddr;

impl Endpoint {
    /// Feeds one received datagram. `from` is its source address (the peer's
    /// IP and the path's source port), `ecn` the ECN codepoint of its IP header.
    ///
    /// Every datagram is untrusted: anything malformed, unauthorised,
    /// duplicated or out of window is dropped and counted in
    /// [`stats().rejects`](crate::EndpointStats::rejects), never trusted.
    pub fn handle_datagram(
        &mut self,
        now: Instant,
        from: SocketAddr,
        ecn: super::Ecn,
        data: &[u8],
    ) {
        self.handle_datagram_stamped(now, now, from, ecn, data)
    }

    /// [`handle_datagram`](Self::handle_datagram) for a datagram the OS
    /// stamped on arrival: `arrived` is its receive timestamp on the core's
    /// clock (taken as `now` if later). RTT samples, and the ACK delay this
    /// endpoint reports to the peer, are then measured from that instant:
    /// the time the datagram waited in the socket for the thread (asleep,
    /// or busy with a turn) is the host's, and counting it as network delay
    /// makes the delay signal cut windows that no queue is filling. On a
    /// host whose threads sleep when idle, a small window lengthens that
    /// wait, the longer RTT cuts the window further, and a single path's
    /// window collapsed to a few packets that way (`docs/BENCHMARKS.md`).
    ///
    /// ```
    /// use metaroce_proto::{Ecn, Endpoint, EndpointConfig, Instant};
    /// let mut ep = Endpoint::new(EndpointConfig::default(), 1).unwrap();
    /// let now = Instant::from_nanos(5_000_000);
    /// let arrived = Instant::from_nanos(4_990_000);
    /// // A datagram that is no packet of ours: counted and dropped.
    /// ep.handle_datagram_stamped(now, arrived, "10.0.0.2:4791".parse().unwrap(), Ecn::NotEct, b"junk");
    /// assert_eq!(ep.stats().datagrams_received, 1);
    /// ```
    pub fn handle_datagram_stamped(
        &mut self,
        now: Instant,
        arrived: Instant,
        from: SocketAddr,
        ecn: super::Ecn,
        data: &[u8],
    ) {
        let arrived = arrived.min(now);
        self.last_now = self.last_now.max(now);
        self.stats.datagrams_received += 1;
        self.stats.bytes_received += data.len() as u64;
        if VersionNegotiation::is(data) {
            return self.on_version_negotiation(now, from, data);
        }
        let common = match wire::peek_common(data) {
            Ok(c) => c,
            Err(WireError::UnsupportedVersion(_))
                if data.len() >= 12 && data[1] == PacketType::Hello as u8 =>
            {
                // A HELLO of another version: say which version we speak.
                let cid = u32::from_be_bytes([data[8], data[9], data[10], data[11]]);
                let mut buf = [0u8; HELLO_LEN];
                if let Ok(len) = VersionNegotiation::emit(cid, &mut buf) {
                    let port = if data.len() >= 14 {
                        u16::from_be_bytes([data[12], data[13]])
                    } else {
                        from.port()
                    };
                    let src = self.config.listen_port;
                    self.queue_stateless(now, SocketAddr::new(from.ip(), port), src, buf, len);
                }
                return self.reject(RejectReason::BadVersion, from);
            }
            Err(e) => return self.reject(e.into(), from),
        };
        // A connection's packets after the handshake: their trailer checked
        // and stripped, or the datagram opened, before anything else is
        // read (PROTOCOL §3.1, §3.2).
        let mut opened = std::mem::take(&mut self.rx_scratch);
        let data = match common.ptype {
            PacketType::Data | PacketType::Ack | PacketType::Close => {
                match self.unprotect(common.dst_cid, from, data, &mut opened) {
                    Some(Unprotected::Checked(n)) => &data[..n],
                    Some(Unprotected::Opened(n)) => &opened[..n],
                    None => {
                        self.rx_scratch = opened;
                        return;
                    }
                }
            }
            _ => data,
        };
        match common.ptype {
            PacketType::Data => self.on_data(now, arrived, from, ecn, data),
            PacketType::Ack => self.on_ack_datagram(now, arrived, from, ecn, data),
            PacketType::Hello => self.on_hello(now, from, data),
            PacketType::Cookie => self.on_cookie(now, from, data),
            PacketType::Accept => self.on_accept(now, from, data),
            PacketType::Close => self.on_close(now, from, data),
            PacketType::VersionNegotiation => self.reject(RejectReason::InvalidField, from),
        }
        self.rx_scratch = opened;
    }

    /// The packets of a datagram for connection `dst_cid` without its
    /// trailer, if that connection negotiated one and the datagram passes
    /// its check; `None` (counted) if it fails. A datagram for no known
    /// connection is left as it is, for the handlers to refuse.
    fn unprotect(
        &mut self,
        dst_cid: u32,
        from: SocketAddr,
        data: &[u8],
        scratch: &mut Vec<u8>,
    ) -> Option<Unprotected> {
        let Some(c) = self
            .by_cid
            .get(&dst_cid)
            .and_then(|&ci| self.conns[ci].as_ref())
        else {
            return Some(Unprotected::Checked(data.len()));
        };
        let r = if c.protect.is_aead() {
            if scratch.len() < data.len() {
                scratch.resize(data.len().max(usize::from(crate::consts::MAX_MTU)), 0);
            }
            c.protect.open_into(data, scratch).map(Unprotected::Opened)
        } else {
            c.protect.check(data).map(Unprotected::Checked)
        };
        if r.is_none() {
            self.reject(RejectReason::BadIntegrity, from);
        }
        r
    }

    /// Queues a stateless reply, if the rate (`stateless_rate`) and the
    /// queue allow; whether it was queued. One refused is counted
    /// (`RateLimited`).
    fn queue_stateless(
        &mut self,
        now: Instant,
        dst: SocketAddr,
        src_port: u16,
        buf: [u8; HELLO_LEN],
        len: usize,
    ) -> bool {
        let queued = self.offer_stateless(now, dst, src_port, buf, len);
        if !queued {
            self.stats.rejects.bump(RejectReason::RateLimited);
        }
        queued
    }

    /// [`queue_stateless`](Self::queue_stateless) without counting a
    /// refusal: for a spare copy of a reply that went.
    fn offer_stateless(
        &mut self,
        now: Instant,
        dst: SocketAddr,
        src_port: u16,
        buf: [u8; HELLO_LEN],
        len: usize,
    ) -> bool {
        let rate = u64::from(self.config.stateless_rate);
        let burst = self.config.stateless_burst;
        if self.stateless_tokens < burst && rate > 0 {
            let elapsed = now.saturating_since(self.stateless_filled).as_nanos();
            let earned = (elapsed.saturating_mul(u128::from(rate)) / 1_000_000_000)
                .min(u128::from(burst)) as u32;
            if earned > 0 {
                self.stateless_tokens = (self.stateless_tokens + earned).min(burst);
                self.stateless_filled = if self.stateless_tokens == burst {
                    now
                } else {
                    // Keep the fraction of a token already earned.
                    self.stateless_filled
                        + core::time::Duration::from_nanos(u64::from(earned) * 1_000_000_000 / rate)
                };
            }
        } else if self.stateless_tokens >= burst {
            self.stateless_filled = now;
        }
        if self.stateless_tokens == 0 || self.stateless.len() >= MAX_STATELESS_QUEUE {
            return false;
        }
        self.stateless_tokens -= 1;
        self.stateless.push_back(StatelessReply {
            dst,
            src_port,
            buf,
            len,
        });
        true
    }

    /// The connection index a packet names, if it exists and `from` is its peer.
    fn conn_for(&mut self, dst_cid: u32, from: SocketAddr) -> Option<usize> {
        let Some(&ci) = self.by_cid.get(&dst_cid) else {
            self.reject(RejectReason::UnknownConnection, from);
            return None;
        };
        let ok = self.conns[ci]
            .as_ref()
            .is_some_and(|c| c.is_peer_ip(from.ip()));
        if !ok {
            self.reject(RejectReason::WrongSource, from);
            return None;
        }
        Some(ci)
    }

    // ------------------------------------------------------------------
    // Handshake.
    // ------------------------------------------------------------------

    fn on_hello(&mut self, now: Instant, from: SocketAddr, data: &[u8]) {
        let hello = match Hello::parse(data) {
            Ok(h) => h,
            Err(e) => return self.reject(e.into(), from),
        };
        // `Hello::parse` checked the length, so the slice is in bounds.
        let planes = match PlaneAddrs::parse(&data[HELLO_LEN..]) {
            Ok(p) => p,
            Err(e) => return self.reject(e.into(), from),
        };
        let security = match SecurityExt::find(&data[HELLO_LEN..]) {
            Ok(s) => s,
            Err(e) => return self.reject(e.into(), from),
        };
        if !self.config.accept_incoming {
            return self.reject(RejectReason::Refused, from);
        }
        let key = (from.ip(), hello.listen_port, hello.src_cid);
        let valid = hello.cookie.is_some_and(|c| {
            cookie::check(
                self.cookie_key,
                now,
                from.ip(),
                hello.listen_port,
                hello.src_cid,
                &c,
            )
        });
        if !valid {
            if hello.cookie.is_some() {
                self.stats.rejects.bump(RejectReason::BadCookie);
            }
            let c = CookieReply {
                dst_cid: hello.src_cid,
                cookie: cookie::make(
                    self.cookie_key,
                    now,
                    from.ip(),
                    hello.listen_port,
                    hello.src_cid,
                ),
            };
            let mut buf = [0u8; HELLO_LEN];
            if let Ok(len) = c.emit(&mut buf) {
                let to = SocketAddr::new(from.ip(), hello.listen_port);
                // From a source port that follows the HELLO's: a client
                // that retries from a new port (a new route) gets its
                // COOKIE back over a new route too (§8.2).
                // It goes twice, the copy from the next port (another
                // route), as the client's HELLO does: a lost COOKIE of a
                // HELLO whose copy was lost costs the client a timeout.
                let ports = &self.config.source_ports;
                let port = |k: usize| {
                    (usize::from(from.port()) + k)
                        .checked_rem(ports.len())
                        .map_or(self.config.listen_port, |i| ports[i])
                };
                let (src, copy) = (port(0), port(1));
                if self.queue_stateless(now, to, src, buf, len) {
                    self.stats.cookies_sent += 1;
                    self.offer_stateless(now, to, copy, buf, len);
                }
            }
            return;
        }
        // With a pre-shared key, a client that does not prove it creates
        // nothing and hears why (PROTOCOL §3.2); checked once the cookie
        // has shown the client receives at its address.
        let nonce_c = match &self.config.psk {
            None => None,
            Some(psk) => match security {
                Some(s)
                    if s.suite == SUITE_AES_128_GCM
                        && proofs_equal(&psk.hello_proof(&s.nonce, hello.src_cid), &s.proof) =>
                {
                    Some(s.nonce)
                }
                _ => {
                    self.reject(RejectReason::BadKey, from);
                    let mut buf = [0u8; HELLO_LEN];
                    let close = Close {
                        dst_cid: hello.src_cid,
                        code: CloseCode::KeyRefused,
                    };
                    if let Ok(len) = close.emit(&mut buf) {
                        let src = self.config.listen_port;
                        self.queue_stateless(
                            now,
                            SocketAddr::new(from.ip(), hello.listen_port),
                            src,
                            buf,
                            len,
                        );
                    }
                    return;
                }
            },
        };
        if let Some(&ci) = self.by_peer.get(&key) {
            // The client missed our ACCEPT: send it again, create nothing.
            if let Some(c) = self.conns[ci].as_mut() {
                if c.is_established() {
                    c.ctrl = Some(Ctrl::Accept);
                }
            }
            return self.touch(ci, Some(now));
        }
        let peer = SocketAddr::new(from.ip(), hello.listen_port);
        let coalesce = self.config.coalesce_acks;
        let crc32c = self.config.crc32c;
        let ci = match self.new_connection(now, peer, false) {
            Ok(ci) => ci,
            Err(_) => return self.reject(RejectReason::Refused, from),
        };
        if let Some(c) = self.conns[ci].as_mut() {
            c.remote_cid = hello.src_cid;
            c.mtu = c.mtu.min(usize::from(hello.mtu));
            c.set_peer_paths(hello.max_paths);
            c.set_peer_planes(planes.as_slice());
            c.peer_grants = hello.grants;
            c.peer_coalesce = hello.coalesce && coalesce;
            if hello.crc32c && crc32c {
                c.protect = Protect::Crc32c;
            }
            if let (Some(psk), Some(nonce_c)) = (&self.config.psk, nonce_c) {
                let nonce_s = self.rng.nonce();
                let d = psk.derive(&nonce_c, &nonce_s, hello.src_cid, c.local_cid);
                c.hs_security = Some(SecurityExt {
                    suite: SUITE_AES_128_GCM,
                    nonce: nonce_s,
                    proof: d.proof,
                });
                c.protect = Protect::Aead(Box::new(Aead::new(d, false)));
            }
            c.peer_window = handshake_window(hello.window_kib);
            c.established_at = now;
        }
        self.by_peer.insert(key, ci);
        self.events.push_back(Event::Incoming {
            conn: ConnectionHandle(ci as u32),
            peer,
        });
        self.touch(ci, Some(now));
    }

    fn on_cookie(&mut self, now: Instant, from: SocketAddr, data: &[u8]) {
        let c = match CookieReply::parse(data) {
            Ok(c) => c,
            Err(e) => return self.reject(e.into(), from),
        };
        let Some(ci) = self.conn_for(c.dst_cid, from) else {
            return;
        };
        let Some(conn) = self.conns[ci].as_mut() else {
            return;
        };
        if conn.state != ConnectionState::Connecting {
            return self.reject(RejectReason::WrongState, from);
        }
        if conn.cookie == Some(c.cookie) {
            // The same cookie again (our HELLO with it is on its way, or
            // the reply was duplicated): nothing new to answer.
            return self.reject(RejectReason::Duplicate, from);
        }
        // Each new cookie asks for another HELLO; a peer (or a forger)
        // that keeps sending new ones gets `handshake_retries` of them
        // and then the handshake ends, as if it had timed out.
        conn.cookies_taken = conn.cookies_taken.saturating_add(1);
        if conn.cookies_taken > self.config.handshake_retries {
            self.stats.rejects.bump(RejectReason::BadCookie);
            self.end_connection(
                ci,
                ConnectionState::Failed,
                ConnectionError::HandshakeTimeout,
            );
            return self.touch(ci, Some(now));
        }
        conn.cookie = Some(c.cookie);
        conn.ctrl = Some(Ctrl::Hello);
        // The server answers: the HELLO with the cookie is retried on an
        // RTO of this round trip (as RFC 6298 from a first sample, 3×),
        // not on the backoff that the lost HELLOs before it built up.
        let sample = now.saturating_since(conn.hello_sent_at);
        conn.hello_interval = (sample * 3)
            .max(self.config.min_rto)
            .min(self.config.handshake_rto);
        conn.hello_backoff = 0;
        // A new round of HELLOs (copies of the last round still to go are
        // dropped).
        conn.hello_copies_left = 0;
        self.touch(ci, Some(now));
    }

    fn on_accept(&mut self, now: Instant, from: SocketAddr, data: &[u8]) {
        let a = match Accept::parse(data) {
            Ok(a) => a,
            Err(e) => return self.reject(e.into(), from),
        };
        let planes = match PlaneAddrs::parse(&data[Accept::LEN..]) {
            Ok(p) => p,
            Err(e) => return self.reject(e.into(), from),
        };
        let security = match SecurityExt::find(&data[Accept::LEN..]) {
            Ok(s) => s,
            Err(e) => return self.reject(e.into(), from),
        };
        let Some(ci) = self.conn_for(a.dst_cid, from) else {
            return;
        };
        let coalesce = self.config.coalesce_acks;
        let crc32c = self.config.crc32c;
        let Some(conn) = self.conns[ci].as_mut() else {
            return;
        };
        if conn.state != ConnectionState::Connecting {
            // A repeated ACCEPT after we got the first one.
            return self.reject(RejectReason::Duplicate, from);
        }
        if let Some(psk) = &self.config.psk {
            let mine = conn.hs_security;
            let Some(s) = security.filter(|s| s.suite == SUITE_AES_128_GCM) else {
                // The server has no key (or none we share): no connection.
                self.stats.rejects.bump(RejectReason::BadKey);
                self.end_connection(ci, ConnectionState::Failed, ConnectionError::KeyRefused);
                return self.touch(ci, Some(now));
            };
            let d = mine.map(|m| psk.derive(&m.nonce, &s.nonce, conn.local_cid, a.src_cid));
            match d {
                Some(d) if proofs_equal(&d.proof, &s.proof) => {
                    conn.protect = Protect::Aead(Box::new(Aead::new(d, true)));
                }
                // Not from a holder of the key: ignored, the handshake goes on.
                _ => return self.reject(RejectReason::BadKey, from),
            }
        }
        conn.remote_cid = a.src_cid;
        conn.peer = SocketAddr::new(conn.peer.ip(), a.listen_port);
        conn.mtu = conn.mtu.min(usize::from(a.mtu));
        conn.set_peer_paths(a.max_paths);
        conn.set_peer_planes(planes.as_slice());
        conn.peer_grants = a.grants;
        conn.peer_coalesce = a.coalesce && coalesce;
        if a.crc32c && crc32c && !conn.protect.is_aead() {
            conn.protect = Protect::Crc32c;
        }
        conn.peer_window = handshake_window(a.window_kib);
        // The round trip from the latest HELLO round to this ACCEPT seeds
        // the connection's RTT estimate (§13.3). Without it a first packet
        // lost, or its ACK, would wait for the initial RTO, and no path
        // could send a tail-loss probe before the first ACK. (An ACCEPT of
        // an earlier HELLO makes it short; the minimum RTO bounds the cost,
        // and the first ACK replaces it.) It is no base RTT for the delay
        // signal (§14): small datagrams on an idle host come back sooner
        // than full ones under load, and a base that low cut windows.
        let rtt = now.saturating_since(conn.hello_sent_at);
        if !rtt.is_zero() {
            conn.rtt.seed(rtt);
        }
        conn.established_at = now;
        conn.state = ConnectionState::Established;
        self.established += 1;
        conn.ctrl = None;
        conn.hello_deadline = None;
        conn.last_progress = now;
        conn.last_ack_at = now;
        self.events
            .push_back(Event::Connected(ConnectionHandle(ci as u32)));
        self.touch(ci, Some(now));
    }

    fn on_close(&mut self, now: Instant, from: SocketAddr, data: &[u8]) {
        let c = match Close::parse(data) {
            Ok(c) => c,
            Err(e) => return self.reject(e.into(), from),
        };
        let Some(ci) = self.conn_for(c.dst_cid, from) else {
            return;
        };
        if !self.conns[ci].as_ref().is_some_and(|c| c.is_open()) {
            return self.reject(RejectReason::WrongState, from);
        }
        let state = if c.code == CloseCode::Normal || c.code == CloseCode::Shutdown {
            ConnectionState::Closed
        } else {
            ConnectionState::Failed
        };
        let error = if c.code == CloseCode::KeyRefused {
            ConnectionError::KeyRefused
        } else {
            ConnectionError::ClosedByPeer(c.code)
        };
        self.end_connection(ci, state, error);
        self.touch(ci, Some(now));
    }

    fn on_version_negotiation(&mut self, now: Instant, from: SocketAddr, data: &[u8]) {
        let v = match VersionNegotiation::parse(data) {
            Ok(v) => v,
            Err(e) => return self.reject(e.into(), from),
        };
        let Some(ci) = self.conn_for(v.dst_cid, from) else {
            return;
        };
        if !self.conns[ci]
            .as_ref()
            .is_some_and(|c| c.state == ConnectionState::Connecting)
            || v.supports_ours
        {
            // Only meaningful during our handshake, and only if it excludes us.
            return self.reject(RejectReason::WrongState, from);
        }
        self.end_connection(
            ci,
            ConnectionState::Failed,
            ConnectionError::VersionMismatch {
                peer_highest: v.highest,
            },
        );
        self.touch(ci, Some(now));
    }

    // ------------------------------------------------------------------
    // DATA.
    // ------------------------------------------------------------------

    fn on_data(
        &mut self,
        now: Instant,
        arrived: Instant,
        from: SocketAddr,
        ecn: super::Ecn,
        data: &[u8],
    ) {
        let (hdr, payload) = match DataHeader::parse(data) {
            Ok(x) => x,
            Err(e) => return self.reject(e.into(), from),
        };
        let Some(ci) = self.conn_for(hdr.dst_cid, from) else {
            return;
        };
        let timing = AckTiming::of(&self.config);
        let Some(c) = self.conns[ci].as_mut() else {
            return;
        };
        if !c.is_established() {
            return self.reject(RejectReason::WrongState, from);
        }
        let pid = usize::from(hdr.path_id);
        if pid >= c.paths_rx.len() {
            return self.reject(RejectReason::InvalidField, from);
        }
        // Window checks come first, so that a refused packet leaves no trace.
        if !c.csn_in_window(hdr.csn) {
            return self.reject(RejectReason::CsnOutOfWindow, from);
        }
        if !c.paths_rx[pid].psn_in_window(hdr.psn) {
            return self.reject(RejectReason::PsnOutOfWindow, from);
        }
        let (_, out_of_order) = c.paths_rx[pid].on_packet(hdr.psn, ecn == super::Ecn::Ce);
        c.paths_rx[pid].note_csn(hdr.csn);
        c.stats.data_packets_received += 1;
        let wants_ack = hdr.flags & data_flags::ACK_REQ != 0;
        // A path-level duplicate (the network copied a datagram) or a late
        // packet whose PSN was given up is still checked by its CSN below:
        // the CSN, not the PSN, decides whether its contents are new.
        let fresh = c.accept_csn(hdr.csn) == SeqAccept::New;
        // ACKs go back over the plane data last arrived on: it works.
        let ip = from.ip();
        if c.peer_planes.get(usize::from(c.last_rx_plane)) != Some(&ip) {
            c.last_rx_plane = c.peer_planes.iter().position(|&p| p == ip).unwrap_or(0) as u8;
        }
        c.note_rx(
            now,
            arrived,
            hdr.path_id,
            hdr.tx_ts,
            out_of_order || !fresh,
            wants_ack,
            timing,
        );
        if hdr.opcode != Opcode::Nop {
            // NOPs (probes, route checks) carry nothing: they do not make
            // their connection a sender for the grant or the receive window.
            c.sender_rx_at = Some(arrived);
            self.rx_active.delivered(&mut c.rx_period, now);
        }
        if !fresh {
            c.stats.duplicates_received += 1;
            // Sent again although it had arrived: the ACK that reported it
            // was lost (or came too late). Path entries are repeated for a
            // while (§6.2).
            c.repeat_acks = REPEAT_ACKS_AFTER_DUPLICATE;
            self.reject(RejectReason::Duplicate, from);
            return self.touch(ci, Some(now));
        }
        match hdr.opcode {
            Opcode::Nop if wants_ack => self.on_probe(ci, &hdr),
            Opcode::Nop => {}
            Opcode::ReadResp => self.on_read_response(ci, from, &hdr, payload),
            _ => self.on_request(ci, from, &hdr, payload),
        }
        self.touch(ci, Some(now));
    }

    /// A progress probe: report the named QP's state at once.
    fn on_probe(&mut self, ci: usize, hdr: &DataHeader) {
        let Some(idx) = self.qp_index(Qpn(hdr.dst_qpn)) else {
            return self.stats.rejects.bump(RejectReason::BadQp);
        };
        let Some(q) = self.qps[idx].as_ref() else {
            return;
        };
        if q.conn != Some(ConnectionHandle(ci as u32)) {
            return self.stats.rejects.bump(RejectReason::BadQp);
        }
        let qpn = q.qpn;
        let nak = self.standing_nak(qpn);
        if let Some(c) = self.conns[ci].as_mut() {
            c.mark_stream(qpn);
            if let Some(n) = nak {
                c.push_nak(n);
            }
        }
    }

    /// Finds the QP a packet is for: it must exist and be bound to `ci`.
    fn qp_for(&mut self, ci: usize, qpn: u32, from: SocketAddr) -> Option<usize> {
        let idx = self.qp_index(Qpn(qpn));
        let ok = idx
            .and_then(|i| self.qps[i].as_ref())
            .is_some_and(|q| q.conn == Some(ConnectionHandle(ci as u32)));
        if !ok {
            self.reject(RejectReason::BadQp, from);
            return None;
        }
        idx
    }

    /// Requester: a READ response segment arrived.
    fn on_read_response(&mut self, ci: usize, from: SocketAddr, hdr: &DataHeader, payload: &[u8]) {
        let Some(idx) = self.qp_for(ci, hdr.dst_qpn, from) else {
            return;
        };
        let Endpoint {
            qps, mrs, conns, ..
        } = self;
        let Some(q) = qps[idx].as_mut() else { return };
        if !q.state.takes_send() {
            // Flushed or reset meanwhile: nothing to place into.
            self.stats.rejects.bump(RejectReason::BadQp);
            return;
        }
        let pd = q.pd;
        let Some(w) = q.wqe_mut(hdr.msn) else {
            return self.reject(RejectReason::Duplicate, from);
        };
        if !w.is_read() || hdr.msg_len != w.msg_len() || w.local_error.is_some() {
            return self.reject(RejectReason::Inconsistent, from);
        }
        // Within the READ's own buffers, split over them in order, in
        // regions of the QP's PD that allow local writes.
        if !payload.is_empty()
            && !mrs.scatter(
                pd,
                AccessFlags::LOCAL_WRITE,
                &w.wr.local,
                hdr.msg_offset,
                payload,
            )
        {
            return self.reject(RejectReason::Inconsistent, from);
        }
        w.read_received += payload.len() as u64;
        w.read_seen = true;
        q.last_progress = q.last_progress.max(self.last_now);
        q.probes = 0;
        if let Some(c) = conns[ci].as_mut() {
            c.stats.payload_bytes_received += payload.len() as u64;
        }
        let qpn = q.qpn;
        self.complete_in_order(qpn);
    }

    /// Responder: a request segment arrived.
    fn on_request(&mut self, ci: usize, from: SocketAddr, hdr: &DataHeader, payload: &[u8]) {
        let Some(idx) = self.qp_for(ci, hdr.dst_qpn, from) else {
            return;
        };
        let Some(q) = self.qps[idx].as_mut() else {
            return;
        };
        let qpn = q.qpn;
        if !q.state.responds() {
            if q.state == QpState::Error {
                // Say why, again: the stored fatal NAK, or that the QP is down.
                if let Some(nak) = self.standing_nak(qpn) {
                    if let Some(c) = self.conns[ci].as_mut() {
                        c.push_nak(nak);
                    }
                }
            }
            return self.reject(RejectReason::BadQp, from);
        }
        if q.failed_msn.is_some_and(|f| !seq_lt(hdr.msn, f)) {
            // At or after a message that failed: nothing more is placed.
            return self.reject(RejectReason::WrongState, from);
        }
        let rnr_timer = q.min_rnr_timer;
        let remote_qpn = q.remote_qpn;
        let slot = match q.incoming_slot(hdr.msn) {
            Ok(s) => *s,
            Err(IncomingReject::Duplicate) => {
                // Executed already: make sure the requester hears about it.
                if let Some(c) = self.conns[ci].as_mut() {
                    c.mark_stream(qpn);
                }
                return self.reject(RejectReason::Duplicate, from);
            }
            Err(IncomingReject::OutOfWindow) => {
                return self.reject(RejectReason::MsgOutOfWindow, from)
            }
        };
        let accepted = match slot {
            Incoming::Refused { gen } if !gen_newer(hdr.gen, gen) => {
                // The requester may have missed the NAK: say it again.
                let nak = NakEntry {
                    qpn: remote_qpn,
                    msn: hdr.msn,
                    code: NakCode::Rnr,
                    gen,
                    rnr_timer_us: rnr_us(rnr_timer),
                };
                if let Some(c) = self.conns[ci].as_mut() {
                    c.mark_stream(qpn);
                    c.push_nak(nak);
                }
                return self.reject(RejectReason::StaleGeneration, from);
            }
            Incoming::Failed { .. } => return self.reject(RejectReason::WrongState, from),
            Incoming::Accepted(a) => {
                if gen_newer(a.gen, hdr.gen) {
                    return self.reject(RejectReason::StaleGeneration, from);
                }
                if same_message(&a, hdr) {
                    a
                } else if opens(&a, hdr) {
                    match self.open_message(ci, idx, a, hdr, rnr_timer) {
                        Some(a) => a,
                        None => return,
                    }
                } else {
                    return self.reject(RejectReason::Inconsistent, from);
                }
            }
            Incoming::Empty | Incoming::Refused { .. } => match self.admit(ci, idx, hdr, rnr_timer)
            {
                Some(a) => a,
                None => return,
            },
        };
        let mut a = accepted;
        if a.received + payload.len() as u64 > u64::from(a.len) {
            return self.reject(RejectReason::Inconsistent, from);
        }
        // Place the payload where the packet says.
        if !payload.is_empty() && !self.place(idx, &a, hdr.msg_offset, payload) {
            // The target vanished (region deregistered mid-message).
            self.fail_message(ci, idx, hdr.msn, NakCode::RemoteAccess, false);
            return self.reject(RejectReason::Inconsistent, from);
        }
        a.received += payload.len() as u64;
        // A READ request is one packet: it is complete when it arrives.
        a.complete = a.opcode == Opcode::ReadReq || a.received >= u64::from(a.len);
        if let Some(c) = self.conns[ci].as_mut() {
            c.stats.payload_bytes_received += payload.len() as u64;
        }
        let Some(q) = self.qps[idx].as_mut() else {
            return;
        };
        if let Ok(s) = q.incoming_slot(hdr.msn) {
            *s = Incoming::Accepted(a);
        }
        if a.complete {
            self.retire_messages(qpn, ci);
        }
    }

    /// Marks message `msn` failed with `code`: nothing more is placed for it
    /// or later messages, and when every earlier message has been executed
    /// the QP moves to ERROR and the NAK goes out (see `retire_messages`).
    fn fail_message(
        &mut self,
        ci: usize,
        idx: usize,
        msn: u32,
        code: NakCode,
        local_len_error: bool,
    ) {
        let Some(q) = self.qps[idx].as_mut() else {
            return;
        };
        let qpn = q.qpn;
        tracing::debug!(
            ?qpn,
            ?code,
            msn,
            "request refused; the QP fails once earlier messages are done"
        );
        if q.failed_msn.is_none_or(|f| seq_lt(msn, f)) {
            q.failed_msn = Some(msn);
        }
        if let Ok(s) = q.incoming_slot(msn) {
            *s = Incoming::Failed {
                code,
                local_len_error,
            };
        }
        self.retire_messages(qpn, ci);
    }

    /// Validates the first packet of a message (generation) and creates its
    /// record, or refuses it: RNR (retry later), or a fatal error.
    fn admit(
        &mut self,
        ci: usize,
        idx: usize,
        hdr: &DataHeader,
        rnr_timer: core::time::Duration,
    ) -> Option<Accepted> {
        let q = self.qps[idx].as_ref()?;
        let (qp_access, pd) = (q.access, q.pd);
        // READs still being executed: admitted, or with response packets
        // still to send. A response sent in full but not yet acknowledged
        // stays held for retransmission without counting: the requester saw
        // that READ complete and may already have sent the next one, which
        // can overtake the ACK. (What it holds is bounded by the send
        // window, in which those packets are.)
        let pending_reads = q.read_resps.iter().filter(|r| !r.sent_all).count()
            + q.incoming
                .iter()
                .filter(|i| matches!(i, Incoming::Accepted(a) if a.opcode == Opcode::ReadReq))
                .count();
        let max_reads = usize::from(q.max_dest_rd_atomic);
        let mut rec = Accepted {
            opcode: hdr.opcode,
            gen: hdr.gen,
            len: hdr.msg_len,
            received: 0,
            complete: false,
            recv_seq: 0,
            imm: None,
            rkey: 0,
            addr: 0,
        };
        let recv_seq = match hdr.ext {
            OpcodeExt::Send { recv_seq }
            | OpcodeExt::SendImm { recv_seq, .. }
            | OpcodeExt::WriteImm { recv_seq, .. } => Some(recv_seq),
            _ => None,
        };
        if let OpcodeExt::SendImm { imm, .. } | OpcodeExt::WriteImm { imm, .. } = hdr.ext {
            rec.imm = Some(imm);
        }
        // RNR first: without a receive the message cannot be judged yet.
        if let Some(rs) = recv_seq {
            rec.recv_seq = rs;
            self.receive_for(ci, idx, hdr, rs, rnr_timer)?;
        }
        // Zero-length WRITEs and READs touch no memory: no key check (as in verbs).
        let remote_ok = |rkey: u32, addr: u64, need: AccessFlags| -> bool {
            let len = u64::from(hdr.msg_len);
            let checked = self.mrs.remote_access(pd, qp_access, rkey, addr, len, need);
            if let Err(why) = checked {
                tracing::debug!(
                    qpn = hdr.dst_qpn,
                    msn = hdr.msn,
                    rkey,
                    addr,
                    len,
                    "remote access refused: {why}"
                );
            }
            checked.is_ok()
        };
        let fatal = match hdr.ext {
            OpcodeExt::Write { rkey, remote_addr }
            | OpcodeExt::WriteImm {
                rkey, remote_addr, ..
            } => {
                rec.rkey = rkey;
                rec.addr = remote_addr;
                (!remote_ok(rkey, remote_addr, AccessFlags::REMOTE_WRITE))
                    .then_some(NakCode::RemoteAccess)
            }
            OpcodeExt::ReadReq { rkey, remote_addr } => {
                rec.rkey = rkey;
                rec.addr = remote_addr;
                if !remote_ok(rkey, remote_addr, AccessFlags::REMOTE_READ) {
                    Some(NakCode::RemoteAccess)
                } else if pending_reads >= max_reads {
                    Some(NakCode::InvalidRequest)
                } else {
                    None
                }
            }
            _ => None,
        };
        if let Some(code) = fatal {
            self.fail_message(ci, idx, hdr.msn, code, false);
            return None;
        }
        Some(rec)
    }

    /// Whether the receive `rs` that message `hdr` names is there for it
    /// (§11.3): `None`, once the RNR NAK is queued or the message failed,
    /// if it is not posted yet (RNR), if the requester names one it cannot
    /// (taken already, or further ahead than its message), or if it is
    /// too small for a SEND.
    fn receive_for(
        &mut self,
        ci: usize,
        idx: usize,
        hdr: &DataHeader,
        rs: u32,
        rnr_timer: core::time::Duration,
    ) -> Option<()> {
        let q = self.qps[idx].as_ref()?;
        let (qpn, remote_qpn, rq_base, msn_done) = (q.qpn, q.remote_qpn, q.rq_base_seq, q.msn_done);
        // A receive already taken, or one further ahead than the
        // message itself is (each earlier message takes one receive at
        // most): the requester breaks the protocol.
        if seq_lt(rs, rq_base) || seq_dist(rq_base, rs) > seq_dist(msn_done, hdr.msn) {
            self.stats.rejects.bump(RejectReason::Inconsistent);
            self.fail_message(ci, idx, hdr.msn, NakCode::InvalidRequest, false);
            return None;
        }
        let d = seq_dist(rq_base, rs) as usize;
        let q = self.qps[idx].as_ref()?;
        match q.rq.get(d) {
            None => {
                let nak = NakEntry {
                    qpn: remote_qpn,
                    msn: hdr.msn,
                    code: NakCode::Rnr,
                    gen: hdr.gen,
                    rnr_timer_us: rnr_us(rnr_timer),
                };
                if let Some(q) = self.qps[idx].as_mut() {
                    if let Ok(s) = q.incoming_slot(hdr.msn) {
                        *s = Incoming::Refused { gen: hdr.gen };
                    }
                }
                if let Some(c) = self.conns[ci].as_mut() {
                    // With the QP's `msn_done`, which the requester
                    // checks the NAK against (§11.5).
                    c.mark_stream(qpn);
                    c.push_nak(nak);
                }
                return None;
            }
            Some(r)
                if hdr.opcode != Opcode::WriteImm && u64::from(hdr.msg_len) > r.sge.byte_len() =>
            {
                // The receive is too small: it completes with a local
                // length error, the requester sees an invalid request.
                self.fail_message(ci, idx, hdr.msn, NakCode::InvalidRequest, true);
                return None;
            }
            Some(_) => {}
        }
        Some(())
    }

    /// The first packet of a SEND_IMM or WRITE_IMM, the one with the
    /// immediate data, whose later packets came first and made record `a`
    /// as a SEND or WRITE (§5.3): the record takes the immediate data, and
    /// a WRITE_IMM its receive, judged now as at the record's creation
    /// (§11.3; without one, the generation is refused and sent again whole).
    fn open_message(
        &mut self,
        ci: usize,
        idx: usize,
        mut a: Accepted,
        hdr: &DataHeader,
        rnr_timer: core::time::Duration,
    ) -> Option<Accepted> {
        match hdr.ext {
            OpcodeExt::SendImm { imm, .. } => a.imm = Some(imm),
            OpcodeExt::WriteImm { recv_seq, imm, .. } => {
                self.receive_for(ci, idx, hdr, recv_seq, rnr_timer)?;
                a.recv_seq = recv_seq;
                a.imm = Some(imm);
            }
            _ => return None,
        }
        a.opcode = hdr.opcode;
        Some(a)
    }

    /// Copies a payload to where it belongs. False if the target is gone or
    /// no longer allows it: every packet is checked as the first was (the
    /// region's PD, its rights, the QP's rights, the bounds), so a region
    /// deregistered mid-message, or one registered since under any key, is
    /// never written.
    fn place(&mut self, idx: usize, a: &Accepted, offset: u32, payload: &[u8]) -> bool {
        let Some(q) = self.qps[idx].as_ref() else {
            return false;
        };
        let pd = q.pd;
        let (key, base, need) = match a.opcode {
            Opcode::Send | Opcode::SendImm => {
                let d = seq_dist(q.rq_base_seq, a.recv_seq) as usize;
                // The receive's own buffers, in order, not only their regions.
                return match q.rq.get(d).map(|r| r.sge) {
                    Some(list) => {
                        self.mrs
                            .scatter(pd, AccessFlags::LOCAL_WRITE, &list, offset, payload)
                    }
                    None => false,
                };
            }
            _ if q.access.contains(AccessFlags::REMOTE_WRITE) => {
                (a.rkey, a.addr, AccessFlags::REMOTE_WRITE)
            }
            _ => return false,
        };
        let Some(addr) = base.checked_add(u64::from(offset)) else {
            return false;
        };
        let mr = self.mrs.by_rkey_mut(key);
        match mr.and_then(|m| {
            m.permits(pd, need, addr, payload.len() as u64)
                .map(|r| (m, r))
        }) {
            Some((m, r)) => {
                m.buf[r].copy_from_slice(payload);
                true
            }
            None => false,
        }
    }

    // ------------------------------------------------------------------
    // ACK.
    // ------------------------------------------------------------------

    /// A datagram that starts with an ACK: the ACK, then the DATA packet
    /// coalesced with it, if any (PROTOCOL §6.7). The DATA must be for the
    /// same connection, and this endpoint must have said it takes them.
    fn on_ack_datagram(
        &mut self,
        now: Instant,
        arrived: Instant,
        from: SocketAddr,
        ecn: super::Ecn,
        data: &[u8],
    ) {
        let ack = match AckPacket::parse(data, |_| false) {
            Ok(a) => a,
            Err(e) => return self.reject(e.into(), from),
        };
        let Some(rest) = ack.coalesced() else {
            return self.on_ack(now, arrived, from, &ack);
        };
        if !self.config.coalesce_acks {
            // Not advertised: a peer that sends them anyway breaks the
            // protocol; neither part is taken.
            return self.reject(RejectReason::InvalidField, from);
        }
        match wire::peek_common(rest) {
            Ok(c) if c.ptype == PacketType::Data && c.dst_cid == ack.header().dst_cid => {}
            Ok(_) => return self.reject(RejectReason::InvalidField, from),
            Err(e) => return self.reject(e.into(), from),
        }
        self.on_ack(now, arrived, from, &ack);
        self.on_data(now, arrived, from, ecn, rest);
    }

    fn on_ack(&mut self, now: Instant, arrived: Instant, from: SocketAddr, ack: &AckPacket<'_>) {
        let h = *ack.header();
        let Some(ci) = self.conn_for(h.dst_cid, from) else {
            return;
        };
        let Some(c) = self.conns[ci].as_mut() else {
            return;
        };
        if !c.is_established() {
            return self.reject(RejectReason::WrongState, from);
        }
        // The receiver's window: kept until an ACK gives another (one that
        // had no room for it says nothing). A malformed one refuses the ACK
        // before anything of it is taken.
        let mut window = None;
        for o in ack.options() {
            if o.kind == ACK_OPT_RECV_WINDOW {
                let Ok(w) = <[u8; 4]>::try_from(o.value) else {
                    return self.reject(RejectReason::InvalidField, from);
                };
                window = Some(u64::from(u32::from_be_bytes(w)).max(1));
            }
        }
        if window.is_some() {
            c.peer_window = window;
        }
        c.stats.acks_received += 1;
        c.peer_lag = core::time::Duration::from_nanos(u64::from(h.ack_delay_ns));
        c.own_lag = now.saturating_since(arrived);
        c.rate_hint_kbps = h.rate_hint_kbps;
        c.pacer.set_rate_kbps(now, h.rate_hint_kbps);
        // RTT from the timestamp echo: unambiguous, every transmission has
        // its own. Up to the ACK's arrival: the time it then waited for this
        // thread is not the network's.
        let rtt_ns = arrived
            .wire_ts()
            .wrapping_sub(h.ts_echo)
            .saturating_sub(h.ack_delay_ns);
        let rtt = core::time::Duration::from_nanos(u64::from(rtt_ns));
        let plausible = rtt < core::time::Duration::from_secs(1) && h.ts_echo != 0;
        if plausible {
            c.rtt.sample_at(now, rtt);
        }
        // The delay signal's reference (PROTOCOL §14): the least RTT seen,
        // or more where every path has a delay this connection did not make.
        let least = c.rtt.min_rtt().unwrap_or(rtt);
        let base = crate::cc::DelayBase {
            reference: c.delay_reference(least),
            least,
        };
        // What the ACK acknowledges had reached the peer by its arrival
        // here less the time the peer held it (delivery samples, §9.1).
        let reached =
            Instant::from_nanos(arrived.as_nanos().saturating_sub(u64::from(h.ack_delay_ns)));
        let (mut delivered, mut lost, mut kinds, mut requests) =
            std::mem::take(&mut self.ack_scratch);
        let mut bogus = false;
        let mut released = 0u64;
        for e in ack.paths() {
            let Some(p) = c.paths_tx.get_mut(usize::from(e.path_id)) else {
                bogus = true;
                continue;
            };
            let mut acked_bytes = 0u64;
            let echo = p.on_ack_at(&e, now, reached, |ev| match ev {
                PathEvent::Acked { csn, bytes } => {
                    acked_bytes += u64::from(bytes);
                    delivered.push(csn);
                }
                PathEvent::Lost { csn } => lost.push(csn),
            });
            let Ok((echo_pkts, echo_marked)) = echo else {
                bogus = true;
                continue;
            };
            if plausible && e.path_id == h.echo_path {
                p.rtt.sample_at(now, rtt);
            }
            if acked_bytes > 0 {
                p.delivered(now);
            }
            released = released.saturating_add(acked_bytes);
            // Each path's window follows its own ECN marks and delay.
            let latest = if p.rtt.srtt().is_some() {
                p.rtt.latest()
            } else {
                rtt
            };
            let elapsed = now.saturating_since(p.last_ack_at);
            p.last_ack_at = now;
            p.cc.on_ack(acked_bytes, echo_pkts, echo_marked, latest, base, elapsed);
        }
        c.recount_in_flight();
        if released > 0 {
            // Counted from our own send records, so a forged ACK cannot
            // claim more than was in flight.
            c.ack_batch = if c.ack_batch == 0 {
                released
            } else {
                (c.ack_batch * 7 + released) / 8
            };
        }
        // What the delivered CSNs carried. A request segment only lowers
        // its QP's count of unacknowledged segments, so those are counted
        // per run of one QP instead of being listed one by one.
        let mut note = |kind: Option<CsnKind>| match kind {
            Some(CsnKind::Request { qp, .. }) => {
                match requests.last_mut() {
                    Some((q, n)) if *q == qp => *n += 1,
                    _ => requests.push((qp, 1)),
                }
                true
            }
            Some(k) => {
                kinds.push(k);
                true
            }
            None => false,
        };
        let mut progress = false;
        for &csn in &delivered {
            progress |= note(c.ack_csn(csn));
        }
        // The connection-level point covers whatever path a CSN went on:
        // what is still unacknowledged below it (the paths' own entries,
        // just applied, moved `csn_una` past what they delivered).
        // (At exactly half the sequence space both orders hold: such a
        // point is refused, or the walk below would visit 2^31 CSNs.)
        if seq_le(h.cum_csn, c.next_csn) && seq_dist(h.cum_csn, c.next_csn) < 1 << 31 {
            let mut csn = c.csn_una;
            while seq_lt(csn, h.cum_csn) {
                progress |= note(c.ack_csn(csn));
                csn = csn.wrapping_add(1);
            }
        } else {
            bogus = true;
        }
        if progress {
            c.consecutive_rto = 0;
            c.timeout_probes = 0;
            c.last_progress = now;
        }
        c.last_ack_at = now;
        c.retransmit_lost(&lost);
        if bogus {
            self.stats.rejects.bump(RejectReason::BogusAck);
        }
        for &(qp, n) in &requests {
            if let Some(q) = self.qp_mut(qp) {
                q.unacked = q.unacked.saturating_sub(n);
            }
        }
        for &k in &kinds {
            self.csn_delivered(k);
        }
        delivered.clear();
        lost.clear();
        kinds.clear();
        requests.clear();
        self.ack_scratch = (delivered, lost, kinds, requests);
        // Stream progress: requests executed by the peer. A QP whose entry
        // is behind what the peer reported before (an ACK overtaken by a
        // later one, or a peer that never executed what a forged ACK made
        // this side complete) is noted: its RNR NAKs in this ACK speak for
        // a state this side has left behind.
        let mut behind: Vec<u32> = Vec::new();
        for s in ack.streams() {
            let Some(idx) = self.qp_index(Qpn(s.qpn)) else {
                self.stats.rejects.bump(RejectReason::BadQp);
                continue;
            };
            let Some(q) = self.qps[idx].as_mut() else {
                continue;
            };
            if q.conn != Some(ConnectionHandle(ci as u32)) {
                self.stats.rejects.bump(RejectReason::BadQp);
                continue;
            }
            if !seq_le(s.msn_done, q.next_msn) {
                self.stats.rejects.bump(RejectReason::BogusAck);
                continue;
            }
            if seq_lt(q.remote_msn_done, s.msn_done) {
                q.remote_msn_done = s.msn_done;
                q.progressed(now);
                let qpn = q.qpn;
                self.complete_in_order(qpn);
            } else if s.msn_done != q.remote_msn_done {
                behind.push(s.qpn);
            }
        }
        for n in ack.naks() {
            let stale = n.code == NakCode::Rnr && behind.contains(&n.qpn);
            self.on_nak(now, ci, n, stale);
        }
        // Time-based loss detection waits until every datagram that has
        // arrived was read (the next transmit or timer call): after a
        // stall of either host, the ACKs of every path arrive together,
        // and judged one by one the first paths' ACKs would make packets
        // whose ACKs are next in the batch look overdue.
        let newly_due = self.conns[ci].as_mut().is_some_and(|c| {
            c.newest_ack_arrival = c.newest_ack_arrival.max(arrived);
            !std::mem::replace(&mut c.loss_check_due, true)
        });
        if newly_due {
            self.loss_checks.push(ci);
        }
        self.move_paths(ci, now);
        self.touch(ci, Some(now));
    }

    /// A NAK of an ACK. `behind`: the same ACK reported the QP's
    /// `msn_done` behind what the peer reported before (PROTOCOL §11.5).
    fn on_nak(&mut self, now: Instant, ci: usize, n: NakEntry, behind: bool) {
        if let Some(c) = self.conns[ci].as_mut() {
            c.stats.naks_received += 1;
        }
        let Some(idx) = self.qp_index(Qpn(n.qpn)) else {
            return self.stats.rejects.bump(RejectReason::BadQp);
        };
        let Some(q) = self.qps[idx].as_mut() else {
            return;
        };
        if q.conn != Some(ConnectionHandle(ci as u32)) {
            return self.stats.rejects.bump(RejectReason::BadQp);
        }
        // A NAK for no outstanding request (a responder in ERROR answers
        // every probe with one for its msn_done) is no progress: counted
        // as such, it reset the probes, and a request whose peer QP had
        // failed was probed every RTO for ever instead of failing.
        if q.wqe(n.msn).is_none() {
            return;
        }
        // An RNR NAK from a responder that has not executed requests this
        // side already completed (its `msn_done`, in the same ACK, is
        // behind the one it reported before) is no genuine answer to the
        // request as this side sent it: either the ACK was overtaken (a
        // later one, or the next probe's answer, says it again) or this
        // side's record was forged (one forged ACK made it complete
        // requests the peer never received). Honoured, the second is an
        // RNR loop that never ends under `rnr_retry` 7: the peer's receives
        // stay taken by requests that will never arrive. Refused, the
        // request gets its progress probes and fails after `retry_cnt`.
        if behind {
            return self.stats.rejects.bump(RejectReason::Inconsistent);
        }
        // Only an answer about the oldest request is progress: an RNR loop
        // of later requests, or a fatal NAK waiting for the oldest, must not
        // keep the oldest, which may never complete, from its probes and
        // its `retry_cnt`.
        if n.msn == q.sq_base_msn {
            q.progressed(now);
        }
        let qpn = q.qpn;
        let rnr_retry = q.rnr_retry;
        let send_idx = q.send_idx;
        let send_offset = q.send_offset;
        let base = q.sq_base_msn;
        let Some(w) = q.wqe_mut(n.msn) else { return };
        let status = match n.code {
            NakCode::Rnr => {
                if w.gen != n.gen {
                    return; // stale: that generation was retried already
                }
                w.rnr_retries = w.rnr_retries.saturating_add(1);
                if rnr_retry != 7 && w.rnr_retries > rnr_retry {
                    WcStatus::RnrRetryExceeded
                } else {
                    w.gen = w.gen.wrapping_add(1);
                    let delay = core::time::Duration::from_micros(u64::from(n.rnr_timer_us.max(1)));
                    let pos = seq_dist(base, n.msn) as usize;
                    // Stop the first transmission of this request where it is.
                    if send_idx == pos && send_offset > 0 {
                        q.send_idx += 1;
                        q.send_offset = 0;
                    }
                    // Resend from the start under the new generation; any
                    // other message's resend keeps its place.
                    match q.resend.iter_mut().find(|(m, _)| *m == n.msn) {
                        Some(entry) => entry.1 = 0,
                        None => {
                            let at = q
                                .resend
                                .iter()
                                .position(|&(m, _)| seq_lt(n.msn, m))
                                .unwrap_or(q.resend.len());
                            q.resend.insert(at, (n.msn, 0));
                        }
                    }
                    let until = now + delay;
                    q.rnr_wait_until = Some(q.rnr_wait_until.map_or(until, |u| u.max(until)));
                    return;
                }
            }
            NakCode::RemoteAccess => WcStatus::RemoteAccessError,
            NakCode::InvalidRequest => WcStatus::RemoteInvalidRequest,
            NakCode::RemoteOperation => WcStatus::RemoteOperationError,
        };
        if seq_lt(q.sq_base_msn, n.msn) {
            // An earlier request is incomplete: a READ whose response the
            // NAK overtook (the responder executed it: the NAK says so).
            // The QP fails when this message is the oldest (PROTOCOL §11.5).
            if q.deferred_fatal.is_none_or(|(m, _)| seq_lt(n.msn, m)) {
                q.deferred_fatal = Some((n.msn, status));
            }
            return;
        }
        tracing::debug!(
            ?qpn,
            ?status,
            msn = n.msn,
            "request failed at the responder"
        );
        self.fail_qp(qpn, Some((n.msn, status)), true);
    }
}

/// Whether generation `a` is newer than `b` (serial order on 8 bits).
fn gen_newer(a: u8, b: u8) -> bool {
    (a.wrapping_sub(b) as i8) > 0
}

/// Whether a packet agrees with the message record its first packet made.
/// A SEND_IMM's or WRITE_IMM's packets after the one at offset 0 go as
/// SEND or WRITE packets, without the immediate data (§5.3).
fn same_message(a: &Accepted, h: &DataHeader) -> bool {
    let opcode = a.opcode == h.opcode || h.msg_offset != 0 && h.opcode == a.opcode.continuation();
    if !opcode || a.len != h.msg_len || a.gen != h.gen {
        return false;
    }
    match h.ext {
        OpcodeExt::Send { recv_seq } | OpcodeExt::SendImm { recv_seq, .. } => {
            recv_seq == a.recv_seq
        }
        OpcodeExt::Write { rkey, remote_addr } | OpcodeExt::ReadReq { rkey, remote_addr } => {
            rkey == a.rkey && remote_addr == a.addr
        }
        OpcodeExt::WriteImm {
            rkey,
            remote_addr,
            recv_seq,
            ..
        } => rkey == a.rkey && remote_addr == a.addr && recv_seq == a.recv_seq,
        OpcodeExt::ReadResp | OpcodeExt::Nop => false,
    }
}

/// Whether `h` is the first packet of a SEND_IMM or WRITE_IMM (at offset
/// 0, with the immediate data) whose later packets made record `a` as a
/// SEND or WRITE: the same message, its opcode now known (§5.3).
fn opens(a: &Accepted, h: &DataHeader) -> bool {
    if h.msg_offset != 0 || a.len != h.msg_len || a.gen != h.gen {
        return false;
    }
    match (a.opcode, h.ext) {
        (Opcode::Send, OpcodeExt::SendImm { recv_seq, .. }) => recv_seq == a.recv_seq,
        (
            Opcode::Write,
            OpcodeExt::WriteImm {
                rkey, remote_addr, ..
            },
        ) => rkey == a.rkey && remote_addr == a.addr,
        _ => false,
    }
}

/// The window a HELLO's or an ACCEPT's `window_kib` gives, in bytes (0:
/// none), until the peer's first ACK gives one.
fn handshake_window(kib: u16) -> Option<u64> {
    (kib > 0).then(|| u64::from(kib) * 1024)
}

/// Where a protected datagram's packets are once its protection is off.
#[derive(Debug, Clone, Copy)]
enum Unprotected {
    /// In the datagram, its first `n` bytes (the trailer checked).
    Checked(usize),
    /// Opened into the scratch buffer, its first `n` bytes.
    Opened(usize),
}
