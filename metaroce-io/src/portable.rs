//! The portable driver: `std` sockets, `quinn-udp` for ECN and GRO, a
//! `ppoll` wait bounded by the core's next timer.

use crate::fault::{self, Faults};
use crate::sockets::Sockets;
use crate::waker::{WakeReceiver, Waker};
use crate::{Clock, DriverConfig, DriverError, DriverStats, FaultConfig};
use metaroce_proto::consts::MAX_PLANES;
use metaroce_proto::{Ecn, Endpoint, Instant};
use quinn_udp::{EcnCodepoint, RecvMeta, Transmit as QTransmit, UdpSockRef, UdpSocketState};
use std::io::IoSliceMut;
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;
use std::time::Duration;

/// A socket and what quinn-udp knows of it.
struct Sock {
    sock: UdpSocket,
    state: UdpSocketState,
}

impl Sock {
    fn new(sock: UdpSocket) -> Result<Sock, DriverError> {
        sock.set_nonblocking(true)?;
        let state = UdpSocketState::new(UdpSockRef::from(&sock))?;
        Ok(Sock { sock, state })
    }
}

/// The most one received message holds: a datagram, or a GRO batch of
/// them.
const RX_MESSAGE_MAX: usize = 65_536;

/// Messages one read of a receive socket may return (`recvmmsg`): as many
/// as a turn's default budget holds GRO batches of 64 KiB.
const RX_BATCH: usize = 4;

/// Whether a read returns several messages (`recvmmsg`) and one that
/// returns fewer than asked says the socket had no more. Elsewhere
/// quinn-udp reads one message a call, and reading goes on until the
/// socket is empty or the budget is spent.
const READS_MANY: bool = cfg!(any(target_os = "linux", target_os = "android"));

/// Runs one [`Endpoint`] on UDP sockets. Single-threaded: call
/// [`poll`](Self::poll) in a loop and use [`endpoint`](Self::endpoint) in
/// between to post work and read completions.
pub struct PortableDriver {
    ep: Endpoint,
    clock: Clock,
    /// Receive sockets, one per plane.
    recv: Vec<Sock>,
    send: Vec<Sock>,
    sockets: Sockets,
    local: SocketAddr,
    /// [`RX_BATCH`] receive buffers of `rx_chunk` bytes each, one per
    /// message a read may return.
    rx_buf: Vec<u8>,
    rx_chunk: usize,
    tx_buf: Vec<u8>,
    /// Bytes a turn sends before it reads ([`DriverConfig::turn_send_bytes`]).
    turn_send_bytes: usize,
    /// Bytes a turn reads from a socket ([`DriverConfig::turn_recv_bytes`]).
    turn_recv_bytes: usize,
    /// [`DriverConfig::busy_poll`].
    busy_poll: Duration,
    stats: DriverStats,
    faults: Option<Box<Faults>>,
    wake: Option<WakeReceiver>,
}

impl std::fmt::Debug for PortableDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PortableDriver")
            .field("local", &self.local)
            .field("send_sockets", &self.send.len())
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

fn to_quinn_ecn(e: Ecn) -> Option<EcnCodepoint> {
    match e {
        Ecn::NotEct => None,
        Ecn::Ect0 => Some(EcnCodepoint::Ect0),
        Ecn::Ect1 => Some(EcnCodepoint::Ect1),
        Ecn::Ce => Some(EcnCodepoint::Ce),
    }
}

impl PortableDriver {
    /// Binds the receive socket and the send sockets, and creates the endpoint.
    pub fn bind(cfg: DriverConfig) -> Result<Self, DriverError> {
        let mut sockets = Sockets::bind(&cfg)?;
        let local = sockets.local;
        let recv = std::mem::take(&mut sockets.recv)
            .into_iter()
            .map(Sock::new)
            .collect::<Result<Vec<_>, _>>()?;
        let send = std::mem::take(&mut sockets.send)
            .into_iter()
            .map(Sock::new)
            .collect::<Result<Vec<_>, _>>()?;
        let seed = cfg.endpoint_seed();
        let mut ecfg = sockets.endpoint_config(cfg.endpoint);
        // UDP GSO: let the core batch datagrams of one path into one send.
        let gso = send
            .iter()
            .map(|s| s.state.max_gso_segments())
            .min()
            .unwrap_or(1);
        ecfg.max_gso_segments = gso.clamp(1, cfg.max_gso_segments.max(1));
        let ep = Endpoint::new(ecfg, seed)?;
        let faults = Faults::new(&cfg.faults);
        let gro = recv
            .iter()
            .map(|s| s.state.gro_segments())
            .max()
            .unwrap_or(1)
            .max(1);
        tracing::debug!(
            %local,
            planes = recv.len(),
            send_sockets = send.len(),
            gro_segments = gro,
            gso_segments = ep.config().max_gso_segments,
            "portable UDP driver bound"
        );
        // A message is a datagram, or with GRO several coalesced (at most
        // 64 KiB of them); the read's buffers hold as much as one buffer
        // of GRO's size did.
        let rx_chunk = (RX_MESSAGE_MAX * gro.min(64) / RX_BATCH).max(RX_MESSAGE_MAX);
        Ok(PortableDriver {
            ep,
            clock: Clock::new(),
            recv,
            send,
            sockets,
            local,
            rx_buf: vec![0u8; RX_BATCH * rx_chunk],
            rx_chunk,
            tx_buf: vec![0u8; 65_536],
            turn_send_bytes: cfg.turn_send_bytes,
            turn_recv_bytes: cfg.turn_recv_bytes,
            busy_poll: cfg.busy_poll,
            stats: DriverStats::default(),
            faults,
            wake: None,
        })
    }

    /// The endpoint, to post work, connect, and poll completions and events.
    pub fn endpoint(&mut self) -> &mut Endpoint {
        &mut self.ep
    }

    /// The address peers reach this endpoint at.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// The current time on the driver's clock.
    pub fn now(&self) -> Instant {
        self.clock.now()
    }

    /// The driver's own counters.
    pub fn stats(&self) -> DriverStats {
        self.stats
    }

    /// A handle that cuts this driver's wait short from another thread
    /// (created on the first call; see [`Waker`]).
    pub fn waker(&mut self) -> Result<Waker, DriverError> {
        Ok(WakeReceiver::waker_in(&mut self.wake)?)
    }

    /// Replaces the fault injection (see [`IoDriver::set_faults`](crate::IoDriver::set_faults)).
    pub fn set_faults(&mut self, faults: FaultConfig) {
        fault::replace(&mut self.faults, &faults, self.clock.now(), &mut self.ep);
    }

    /// Runs one turn of the loop: sends what the core has, reads what the
    /// kernel has, runs due timers; if nothing happened (nothing sent or
    /// received, no completion or event made), waits for a datagram or a
    /// wake for at most `max_wait` or until the core's next timer.
    pub fn poll(&mut self, max_wait: Duration) -> Result<(), DriverError> {
        self.poll_turn(max_wait).map(|_| ())
    }

    /// [`poll`](Self::poll), saying whether the turn did anything.
    fn poll_turn(&mut self, max_wait: Duration) -> Result<bool, DriverError> {
        crate::turn::poll_turn(self, max_wait)
    }

    /// One turn that never sleeps, for a caller that waits between turns
    /// itself (on [`wait_fds`](Self::wait_fds), for at most
    /// [`idle_wait`](Self::idle_wait)); whether it did anything.
    pub(crate) fn turn(&mut self) -> Result<bool, DriverError> {
        self.poll_turn(Duration::ZERO)
    }

    /// How long a caller that runs [`turn`](Self::turn)s itself may wait
    /// for [`wait_fds`](Self::wait_fds) before the next turn: until the
    /// core's next timer (`Duration::MAX` if none); `None` if one is due.
    pub(crate) fn idle_wait(&mut self) -> Option<Duration> {
        let now = self.clock.now();
        let wait = fault::timer_wait(&mut self.ep, self.faults.as_deref(), now, Duration::MAX);
        (!wait.is_zero()).then_some(wait)
    }

    /// What a caller waiting between [`turn`](Self::turn)s waits on: each
    /// plane's receive socket.
    pub(crate) fn wait_fds(&self) -> Vec<std::os::fd::RawFd> {
        self.recv.iter().map(|r| r.sock.as_raw_fd()).collect()
    }

    /// Sends what the core has, up to the turn's budget of bytes
    /// ([`DriverConfig::turn_send_bytes`]). Returns whether any went out.
    fn flush(&mut self) -> Result<bool, DriverError> {
        let mut any = false;
        let mut budget = self.turn_send_bytes;
        while !any || budget > 0 {
            let now = self.clock.now();
            let Some(t) = self.ep.poll_transmit(now, &mut self.tx_buf) else {
                break;
            };
            any = true;
            budget = budget.saturating_sub(t.size);
            let q = QTransmit {
                destination: t.dst,
                ecn: to_quinn_ecn(t.ecn),
                contents: &self.tx_buf[..t.size],
                segment_size: t.segment_size,
                // The socket is bound to the plane's address already.
                src_ip: None,
            };
            let s = match self.sockets.send_index(t.src_ip, t.src_port) {
                Some(i) => &self.send[i],
                None => &self.recv[self.sockets.recv_index(t.src_ip)],
            };
            let res = s.state.try_send(UdpSockRef::from(&s.sock), &q);
            match res {
                Ok(()) => {
                    let n = t.segment_size.map_or(1, |s| t.size.div_ceil(s)) as u64;
                    self.stats.datagrams_sent += n;
                    if n > 1 {
                        self.stats.gso_sends += 1;
                    }
                }
                Err(e) => {
                    // A lost datagram: the protocol recovers it like any loss.
                    self.stats.send_errors += 1;
                    tracing::debug!(error = %e, dst = %t.dst, "send failed");
                }
            }
        }
        Ok(any)
    }

    /// Reads what every receive socket has, up to the turn's budget (so
    /// that answers and sending are not held back). Timers run only after
    /// this: an ACK that is already here must not lose the race against a
    /// retransmission timeout.
    fn receive(&mut self) -> Result<bool, DriverError> {
        let mut any = false;
        for k in 0..self.recv.len() {
            any |= self.receive_on(k)?;
        }
        Ok(any)
    }

    /// Reads what plane `k`'s receive socket has, up to the turn's budget
    /// of bytes ([`DriverConfig::turn_recv_bytes`]).
    fn receive_on(&mut self, k: usize) -> Result<bool, DriverError> {
        let mut any = false;
        let mut budget = self.turn_recv_bytes;
        // 4096 calls at most, whatever they return.
        for _ in 0..4096 {
            if any && budget == 0 {
                break;
            }
            // No more messages than the budget left may take whole (each
            // may be a GRO batch of 64 KiB), one at least.
            let ask = if READS_MANY {
                budget.div_ceil(RX_MESSAGE_MAX).clamp(1, RX_BATCH)
            } else {
                1
            };
            let mut meta = [RecvMeta::default(); RX_BATCH];
            let n = {
                let mut bufs: [IoSliceMut<'_>; RX_BATCH] = {
                    let mut chunks = self.rx_buf.chunks_mut(self.rx_chunk);
                    std::array::from_fn(|_| IoSliceMut::new(chunks.next().unwrap_or_default()))
                };
                let r = &self.recv[k];
                self.stats.reads += 1;
                match r.state.recv(
                    UdpSockRef::from(&r.sock),
                    &mut bufs[..ask],
                    &mut meta[..ask],
                ) {
                    Ok(n) => n,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(e.into()),
                }
            };
            let now = self.clock.now();
            let mut wall = None;
            for (i, m) in meta[..n].iter().enumerate() {
                any = true;
                budget = budget.saturating_sub(m.len);
                // quinn-udp turns SO_TIMESTAMPNS on and reads the stamps.
                let arrived = self.clock.arrived(now, &mut wall, m.timestamp);
                self.stats.stamped += u64::from(m.timestamp.is_some());
                let ecn = m.ecn.map_or(Ecn::NotEct, |e| Ecn::from_bits(e as u8));
                if m.stride != 0 && m.len > m.stride {
                    self.stats.gro_batches += 1;
                }
                let at = i * self.rx_chunk;
                for dg in crate::sockets::datagrams(&self.rx_buf[at..at + m.len], Some(m.stride)) {
                    self.stats.datagrams_received += 1;
                    if let Some(n) = self.stats.received_per_plane.get_mut(k) {
                        *n += 1;
                    }
                    fault::deliver(
                        &mut self.faults,
                        now,
                        arrived,
                        m.addr,
                        ecn,
                        dg,
                        &mut self.ep,
                        &mut self.stats,
                    );
                }
            }
            // Fewer messages than buffers: the socket had no more when it
            // was read. Another read now would most likely find nothing, a
            // system call that holds up what this one brought (the next
            // turn reads again).
            if READS_MANY && n < ask {
                break;
            }
        }
        Ok(any)
    }

    /// Delivers the held-back datagrams that are due. Returns whether any was.
    fn release(&mut self) -> bool {
        match &mut self.faults {
            Some(f) => f.release(self.clock.now(), &mut self.ep),
            None => false,
        }
    }

    /// Before a turn sleeps ([`DriverConfig::busy_poll`]): asks the kernel,
    /// without waiting, whether a socket or the waker is readable, again
    /// and again for up to the busy-poll time (at most `wait`). True if one
    /// became readable.
    fn busy_poll(&self, wait: Duration) -> Result<bool, DriverError> {
        let spin = self.busy_poll.min(wait);
        if spin.is_zero() {
            return Ok(false);
        }
        let until = std::time::Instant::now() + spin;
        loop {
            if self.wait_readable(Duration::ZERO)? {
                return Ok(true);
            }
            if std::time::Instant::now() >= until {
                return Ok(false);
            }
        }
    }

    /// Waits until a receive socket or the waker is readable, at most
    /// `timeout` (zero: only looks). True if one is.
    fn wait_readable(&self, timeout: Duration) -> Result<bool, DriverError> {
        let pollfd = crate::sockets::readable;
        // One receive socket per plane, and the waker: no allocation, as a
        // busy poll calls this again and again.
        let mut pfd = [pollfd(-1); MAX_PLANES + 1];
        let mut n = 0;
        for r in self.recv.iter().take(MAX_PLANES) {
            pfd[n] = pollfd(r.sock.as_raw_fd());
            n += 1;
        }
        let wake_at = n;
        if let Some(w) = &self.wake {
            pfd[n] = pollfd(w.fd());
            n += 1;
        }
        let r = crate::sockets::wait_readable(&mut pfd[..n], timeout)?;
        if let Some(w) = &self.wake {
            if pfd[wake_at].revents != 0 {
                w.drain();
            }
        }
        Ok(r > 0)
    }
}

impl crate::turn::TurnParts for PortableDriver {
    fn parts(&mut self) -> (&mut Endpoint, &Clock, Option<&Faults>, &mut DriverStats) {
        (
            &mut self.ep,
            &self.clock,
            self.faults.as_deref(),
            &mut self.stats,
        )
    }
    fn flush(&mut self) -> Result<bool, DriverError> {
        PortableDriver::flush(self)
    }
    fn receive(&mut self) -> Result<bool, DriverError> {
        PortableDriver::receive(self)
    }
    fn release(&mut self) -> bool {
        PortableDriver::release(self)
    }
    fn busy_poll(&mut self, wait: Duration) -> Result<bool, DriverError> {
        PortableDriver::busy_poll(self, wait)
    }
    fn wait_readable(&mut self, timeout: Duration) -> Result<bool, DriverError> {
        PortableDriver::wait_readable(self, timeout)
    }
}
