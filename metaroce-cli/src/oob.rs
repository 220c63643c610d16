//! The out-of-band control channel of `metaroce perf`, as perftest's TCP
//! exchange or rdma_cm's private data: QP numbers, rkey, address, slot
//! count, the run's parameters, and at the end what the server verified.
//!
//! Wire format: each message is a 4-byte big-endian length followed by that
//! many bytes of JSON (one [`Msg`]). Every run starts with the client's
//! [`Msg::Hello`], which carries [`VERSION`]; a server that speaks another
//! version answers [`Msg::Refused`] with its own version and closes.
//!
//! Both the loopback test (in-memory channels) and the remote one (a TCP
//! connection) use a [`Link`], so one protocol drives both.
//!
//! The control channel is one TCP flow, so on an ECMP fabric it takes one
//! path; a silently broken path (a blackholed spine) would stop a run
//! before any data flows. So a client reaches the server with [`dial`]:
//! each attempt has a short timeout (see [`Retry`]) and comes from a TCP
//! source port no earlier attempt used ([`FreshPort`]), so a new 5-tuple
//! and a new ECMP hash; an attempt whose connect or setup exchange times
//! out is tried again until an overall deadline, and the error then lists
//! every attempt. The server accepts on a thread of its own
//! ([`Acceptor`]), so a client's new control connection takes over from
//! its dead one ([`Link::watch`]) instead of waiting behind it.

use serde::{Deserialize, Serialize};
use socket2::{Domain, Protocol, Socket, Type};
use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::fmt;
use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::{mpsc, Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::perf::Op;

/// Version of the control protocol. Bump on any incompatible change.
///
/// v2: `--bidir` (the server runs a stream of its own towards the client:
/// [`Msg::ClientQps`] carries the client's region, [`Msg::Start`] starts
/// the server's stream, [`Msg::Done`] goes both ways and carries the
/// sender's own figures). A v1 peer's `Hello` still parses, so it gets a
/// clear version mismatch rather than a protocol error.
///
/// v3: a new payload pattern (`perf::pattern`, cheaper to write and to
/// check): a v2 peer would see every byte of a v3 peer's messages as
/// corrupt, so the two refuse each other instead.
pub const VERSION: u32 = 3;

/// Largest control message accepted, bytes (they are all tiny).
const MAX_MSG: u32 = 1 << 20;

/// Why a `metaroce perf` run could not start or finish.
#[derive(Debug, thiserror::Error)]
pub enum PerfError {
    /// The server's address could not be resolved.
    #[error("cannot reach metaroce perf server at {addr}: {cause}")]
    Unreachable {
        /// The address as given.
        addr: String,
        /// The OS error (in the message, so not repeated as a source).
        cause: io::Error,
    },
    /// No attempt at the control channel succeeded: each one listed.
    #[error("cannot reach metaroce perf server at {addr}: {summary}{}", Attempts(.attempts))]
    GaveUp {
        /// The address as given.
        addr: String,
        /// Why the client stopped trying.
        summary: String,
        /// Every attempt, in order.
        attempts: Vec<Attempt>,
    },
    /// The control connection went quiet: no message within the time allowed.
    #[error("control connection stalled: no {wanted} within {:.2} s", .waited.as_secs_f64())]
    Stalled {
        /// The message awaited.
        wanted: &'static str,
        /// How long it was awaited.
        waited: Duration,
    },
    /// The peer closed the control connection, or it broke.
    #[error("control protocol: the peer closed the control connection")]
    Closed,
    /// (Server) A newer control connection, from the same client or from
    /// one waiting while this one stayed silent, took over.
    #[error("a newer control connection from {by} took over")]
    Superseded {
        /// The newer connection's peer.
        by: SocketAddr,
    },
    /// (Server) The client went away before its run started (not a failed
    /// run: a client that retries comes back on a new connection).
    #[error("the client left before its run started: {0}")]
    Abandoned(Box<PerfError>),
    /// The server refused this side's pre-shared key (`--psk-file`): the
    /// keys differ, or only one side has one. Not tried again.
    #[error("cannot connect to {addr}: the peer refused the key (the pre-shared keys differ, or only one side has one)")]
    KeyRefused {
        /// The server's metaroce endpoint.
        addr: SocketAddr,
    },
    /// The metaroce connection (UDP) to the server did not come up.
    #[error("cannot connect to {addr}: {why}")]
    NoConnection {
        /// The server's metaroce endpoint.
        addr: SocketAddr,
        /// What happened.
        why: String,
    },
    /// Client and server speak different control protocol versions.
    #[error(
        "control protocol version mismatch: this metaroce speaks v{ours}, the peer speaks v{theirs}"
    )]
    VersionMismatch {
        /// Our [`VERSION`].
        ours: u32,
        /// The peer's.
        theirs: u32,
    },
    /// The address to listen on is taken (or cannot be bound).
    #[error("port in use: cannot bind {what} {addr}: {cause}")]
    PortInUse {
        /// "UDP" or "TCP control".
        what: &'static str,
        /// The address.
        addr: SocketAddr,
        /// The OS error (in the message, so not repeated as a source).
        cause: io::Error,
    },
    /// The flags make no sense (checked on both sides).
    #[error("bad flags: {0}")]
    BadFlags(String),
    /// The server refused the run.
    #[error("server refused the run: {0}")]
    Refused(String),
    /// The peer sent something unexpected, or went away.
    #[error("control protocol: {0}")]
    Protocol(String),
}

/// What the client asks for.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct RunParams {
    /// Operation.
    pub op: Op,
    /// Message size, bytes.
    pub size: u64,
    /// Outstanding work requests in all.
    pub depth: u32,
    /// Queue pairs the work requests are spread over (round robin).
    pub qps: u32,
    /// Whether payloads are checked.
    pub verify: bool,
    /// Test duration, seconds (the server derives its time limits from it).
    pub duration: f64,
    /// Both ways at once: the server also runs the same operation towards
    /// the client over the same QPs (absent in a v1 `Hello`).
    #[serde(default)]
    pub bidir: bool,
}

/// A region the peer's work requests target.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub struct Region {
    /// Remote key.
    pub rkey: u32,
    /// Address of its first byte.
    pub addr: u64,
    /// Message slots in it (iteration `i` uses slot `i % slots`).
    pub slots: u64,
}

/// One control message.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Msg {
    /// Client → server, first: who we are and what to run.
    Hello {
        /// The client's [`VERSION`].
        version: u32,
        /// The run.
        params: RunParams,
    },
    /// Server → client: accepted; the metaroce UDP port to connect to.
    Welcome {
        /// The server's [`VERSION`].
        version: u32,
        /// UDP port of the server's endpoint.
        udp_port: u16,
    },
    /// Server → client: not accepted (`version` says which the server speaks).
    Refused {
        /// The server's [`VERSION`].
        version: u32,
        /// Why.
        reason: String,
    },
    /// Client → server: the connection is up; the client's QP numbers.
    ClientQps {
        /// One per QP, in round-robin order.
        qpns: Vec<u32>,
        /// With `bidir`: the region the server's stream targets (its
        /// receives are posted already).
        #[serde(default)]
        region: Option<Region>,
    },
    /// Server → client: the server's QPs and the region the client targets.
    Ready {
        /// One per QP, matching [`Msg::ClientQps`].
        qpns: Vec<u32>,
        /// Remote key of the region.
        rkey: u32,
        /// Its address.
        addr: u64,
        /// Message slots in it (iteration `i` uses slot `i % slots`).
        slots: u64,
    },
    /// Client → server, with `bidir`: the client's QPs are connected; the
    /// server starts its own stream.
    Start,
    /// Either way: this side's stream is over (the client's always; the
    /// server's with `bidir`).
    Done {
        /// Completed work requests.
        iterations: u64,
        /// Seconds from the first post to the last completion.
        #[serde(default)]
        elapsed_s: f64,
        /// Bytes the sender checked itself (READ) and found right ...
        #[serde(default)]
        verified_bytes: u64,
        /// ... and wrong.
        #[serde(default)]
        corrupt_bytes: u64,
        /// The sender's retransmissions on the connection.
        #[serde(default)]
        retransmits: u64,
    },
    /// The answer to [`Msg::Done`]: what the receiving side verified.
    Result {
        /// Bytes that matched their pattern.
        verified_bytes: u64,
        /// Bytes that did not (or arrived in failed completions).
        corrupt_bytes: u64,
        /// Messages the server saw.
        messages: u64,
    },
    /// Either way: the run failed on this side.
    Abort {
        /// Why.
        reason: String,
    },
}

/// Writes one length-prefixed message.
pub fn write_msg(w: &mut impl Write, m: &Msg) -> io::Result<()> {
    let body = serde_json::to_vec(m).map_err(io::Error::other)?;
    let len = u32::try_from(body.len()).map_err(io::Error::other)?;
    w.write_all(&len.to_be_bytes())?;
    w.write_all(&body)?;
    w.flush()
}

/// Reads one length-prefixed message; `Ok(None)` on a clean end of stream.
pub fn read_msg(r: &mut impl Read) -> io::Result<Option<Msg>> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let len = u32::from_be_bytes(len);
    if len > MAX_MSG {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("control message of {len} bytes (at most {MAX_MSG})"),
        ));
    }
    let mut body = vec![0u8; len as usize];
    r.read_exact(&mut body)?;
    serde_json::from_slice(&body)
        .map(Some)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

/// One side of a control channel: messages in, messages out.
///
/// Receiving never blocks the caller's driver loop for longer than asked,
/// so the endpoint keeps running while it waits: how long a side waits
/// for each message is its read timeout ([`PerfError::Stalled`]).
pub struct Link {
    tx: mpsc::Sender<Msg>,
    rx: mpsc::Receiver<Msg>,
    stream: Option<TcpStream>,
    /// When the link was made.
    opened: Instant,
    /// Whether a message has come.
    heard: Cell<bool>,
    /// See [`Link::watch`].
    watch: RefCell<Option<Watch>>,
    /// Closes when the writer thread of a TCP link is done.
    flushed: Option<mpsc::Receiver<()>>,
}

/// What [`Link::watch`] asks.
type Watch = Box<dyn FnMut(bool, Duration) -> Option<SocketAddr> + Send>;

/// How long a blocked write to the control connection may take before the
/// link gives up on it (its messages are tiny: only a dead path fills the
/// socket's buffer).
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

impl Link {
    /// Two connected in-memory ends (the loopback test).
    pub fn pair() -> (Link, Link) {
        let (a_tx, b_rx) = mpsc::channel();
        let (b_tx, a_rx) = mpsc::channel();
        (Link::new(a_tx, a_rx, None), Link::new(b_tx, b_rx, None))
    }

    fn new(tx: mpsc::Sender<Msg>, rx: mpsc::Receiver<Msg>, stream: Option<TcpStream>) -> Link {
        Link {
            tx,
            rx,
            stream,
            opened: Instant::now(),
            heard: Cell::new(false),
            watch: RefCell::new(None),
            flushed: None,
        }
    }

    /// A link over a TCP connection: a reader and a writer thread move the
    /// length-prefixed messages between the socket and the channels. The
    /// channel closes when the peer closes or sends garbage.
    pub fn tcp(stream: TcpStream) -> io::Result<Link> {
        stream.set_nodelay(true)?;
        stream.set_write_timeout(Some(WRITE_TIMEOUT))?;
        let mut rd = stream.try_clone()?;
        let mut wr = stream.try_clone()?;
        let (in_tx, in_rx) = mpsc::channel();
        let (out_tx, out_rx) = mpsc::channel::<Msg>();
        std::thread::spawn(move || loop {
            match read_msg(&mut rd) {
                Ok(Some(m)) => {
                    if in_tx.send(m).is_err() {
                        break;
                    }
                }
                Ok(None) => {
                    tracing::debug!("control connection: the peer closed it");
                    break;
                }
                Err(e) => {
                    tracing::debug!("control connection: {e}");
                    break;
                }
            }
        });
        let (flushed_tx, flushed) = mpsc::channel::<()>();
        std::thread::spawn(move || {
            for m in out_rx {
                if write_msg(&mut wr, &m).is_err() {
                    break;
                }
            }
            let _ = wr.shutdown(Shutdown::Write);
            drop(flushed_tx);
        });
        let mut link = Link::new(out_tx, in_rx, Some(stream));
        link.flushed = Some(flushed);
        Ok(link)
    }

    /// Queues a message for the peer (a gone peer shows up on receive).
    pub fn send(&self, m: Msg) {
        let _ = self.tx.send(m);
    }

    /// The next message if one is there; an error if the peer went away
    /// or (see [`watch`](Self::watch)) a newer connection took over.
    pub fn try_recv(&self) -> Result<Option<Msg>, PerfError> {
        match self.rx.try_recv() {
            Ok(m) => {
                self.heard.set(true);
                Ok(Some(m))
            }
            Err(mpsc::TryRecvError::Empty) => {
                if let Some(w) = self.watch.borrow_mut().as_mut() {
                    if let Some(by) = w(self.heard.get(), self.opened.elapsed()) {
                        return Err(PerfError::Superseded { by });
                    }
                }
                Ok(None)
            }
            Err(mpsc::TryRecvError::Disconnected) => Err(PerfError::Closed),
        }
    }

    /// (Server) Lets a newer control connection take over from this one
    /// until [`settle`](Self::settle): while nothing is queued, each
    /// receive asks `newer(heard, age)` (whether a message came on this
    /// link yet, and how long ago it was opened), and a peer address it
    /// returns ends the link with [`PerfError::Superseded`]. A client
    /// whose exchange stalls comes back on a new connection, and its old
    /// one may never close (its FIN lost on the same dead path).
    pub fn watch(&self, newer: impl FnMut(bool, Duration) -> Option<SocketAddr> + Send + 'static) {
        *self.watch.borrow_mut() = Some(Box::new(newer));
    }

    /// Whether [`watch`](Self::watch) is on.
    pub fn watched(&self) -> bool {
        self.watch.borrow().is_some()
    }

    /// (Server) The client has shown it got what it waited for (its run
    /// is under way): no other connection takes over from now on.
    pub fn settle(&self) {
        self.watch.borrow_mut().take();
    }
}

impl fmt::Debug for Link {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Link")
            .field("stream", &self.stream)
            .field("heard", &self.heard.get())
            .field("watched", &self.watched())
            .finish_non_exhaustive()
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        // Let the writer hand what is queued (a server's last `Result`) to
        // the kernel before the process may exit: it ends once `tx` is
        // gone and its queue is written.
        self.tx = mpsc::channel().0;
        if let Some(f) = &self.flushed {
            let _ = f.recv_timeout(FLUSH_TIMEOUT);
        }
        // Wake the reader thread.
        if let Some(s) = &self.stream {
            let _ = s.shutdown(Shutdown::Read);
        }
    }
}

/// How long dropping a TCP link waits for its queued messages to be
/// written (a write only waits when the socket's buffer is full).
const FLUSH_TIMEOUT: Duration = Duration::from_secs(1);

/// The client's schedule of attempts at the control channel.
#[derive(Debug, Clone, Copy)]
pub struct Retry {
    /// No attempt starts after this long, and none runs past it
    /// (`--connect-timeout`).
    pub deadline: Duration,
    /// The first attempt's timeout: its connect, and each wait of its
    /// exchange.
    pub first: Duration,
    /// Each later attempt's timeout is this much longer than the one
    /// before ...
    pub growth: f64,
    /// ... up to this.
    pub max: Duration,
}

/// Attempts end early no sooner than this after they began: an error that
/// comes at once (an unreachable network) is not retried in a busy loop.
const MIN_ATTEMPT: Duration = Duration::from_millis(200);

/// An attempt with less time than this left is not started.
const MIN_LEFT: Duration = Duration::from_millis(100);

impl Retry {
    /// The default schedule within `deadline`: 1 s for the first attempt,
    /// a quarter more for each after it, 4 s at most, so ten seconds hold
    /// six attempts that time out. Short, because an attempt on a dead
    /// path only ever times out, and it is a new path that helps; growing,
    /// so that a slow but working path (a lost SYN costs the kernel's 1 s
    /// retransmission) still gets through.
    pub fn within(deadline: Duration) -> Retry {
        Retry {
            deadline,
            first: Duration::from_secs(1),
            growth: 1.25,
            max: Duration::from_secs(4),
        }
    }

    /// Attempt `n`'s timeout (0-based), before the deadline cuts it.
    pub fn timeout(&self, n: usize) -> Duration {
        let f = self.growth.powi(i32::try_from(n).unwrap_or(i32::MAX));
        Duration::from_secs_f64((self.first.as_secs_f64() * f).min(self.max.as_secs_f64()))
    }
}

/// How long each wait of one attempt's control exchange may take.
#[derive(Debug, Clone, Copy)]
pub struct Budget {
    /// The attempt's timeout.
    pub each: Duration,
    /// When the client gives up (none: the loopback test).
    pub deadline: Option<Instant>,
}

impl Budget {
    /// `each` for every wait, no deadline.
    pub fn fixed(each: Duration) -> Budget {
        Budget {
            each,
            deadline: None,
        }
    }

    /// `want`, cut to what is left before the deadline.
    pub fn cap(&self, want: Duration) -> Duration {
        match self.deadline {
            Some(d) => want.min(d.saturating_duration_since(Instant::now())),
            None => want,
        }
    }
}

/// Opens the client's control connections: [`FreshPort`] for real; tests
/// put their own in front of it.
pub trait Connector {
    /// Connects to `to` within `timeout` from a source port not in `used`;
    /// returns that port (`None` if it did not get that far) and the outcome.
    fn connect(
        &mut self,
        to: SocketAddr,
        used: &[u16],
        timeout: Duration,
    ) -> (Option<u16>, io::Result<TcpStream>);
}

/// The real [`Connector`]: each connection comes from a fresh socket bound
/// (before it connects) to a port the kernel picks from its ephemeral
/// range, picked again while it is one an earlier attempt used. A new
/// source port makes a new 5-tuple, so a new ECMP hash and likely another
/// path through the fabric.
#[derive(Debug, Default, Clone, Copy)]
pub struct FreshPort;

impl FreshPort {
    /// A socket bound to a new port, and the port.
    fn socket(to: SocketAddr, used: &[u16]) -> io::Result<(Socket, u16)> {
        let any: IpAddr = match to {
            SocketAddr::V4(_) => Ipv4Addr::UNSPECIFIED.into(),
            SocketAddr::V6(_) => Ipv6Addr::UNSPECIFIED.into(),
        };
        // The ports refused stay bound until a new one comes, so the
        // kernel cannot hand them back.
        let mut refused = Vec::new();
        for _ in 0..16 {
            let s = Socket::new(Domain::for_address(to), Type::STREAM, Some(Protocol::TCP))?;
            s.bind(&SocketAddr::new(any, 0).into())?;
            let port = s
                .local_addr()?
                .as_socket()
                .map_or(0, |a: SocketAddr| a.port());
            if !used.contains(&port) {
                return Ok((s, port));
            }
            refused.push(s);
        }
        Err(io::Error::new(
            io::ErrorKind::AddrInUse,
            "the kernel kept handing out source ports already tried",
        ))
    }
}

impl Connector for FreshPort {
    fn connect(
        &mut self,
        to: SocketAddr,
        used: &[u16],
        timeout: Duration,
    ) -> (Option<u16>, io::Result<TcpStream>) {
        let (s, port) = match FreshPort::socket(to, used) {
            Ok(x) => x,
            Err(e) => return (None, Err(e)),
        };
        let r = s.connect_timeout(&to.into(), timeout).map(|()| s.into());
        (Some(port), r)
    }
}

/// How one attempt at the control channel failed.
#[derive(Debug, thiserror::Error)]
pub enum AttemptError {
    /// The TCP connect.
    #[error("connect: {0}")]
    Connect(io::Error),
    /// The exchange over the connection, once it was open.
    #[error("control exchange: {0:#}")]
    Exchange(anyhow::Error),
}

impl AttemptError {
    /// Whether another attempt from a new source port may do better: a
    /// timeout, a path that answered "unreachable", a connection that
    /// broke or stalled. A refused connection is an answer: nothing
    /// listens there.
    pub fn retryable(&self) -> bool {
        match self {
            AttemptError::Connect(e) => retryable_io(e),
            AttemptError::Exchange(e) => AttemptError::retryable_exchange(e),
        }
    }

    /// Whether an exchange that failed with `e` is worth another attempt:
    /// it stalled, the connection broke, or the metaroce connection did
    /// not come up.
    fn retryable_exchange(e: &anyhow::Error) -> bool {
        if let Some(p) = e.downcast_ref::<PerfError>() {
            matches!(
                p,
                PerfError::Stalled { .. } | PerfError::Closed | PerfError::NoConnection { .. }
            )
        } else {
            e.downcast_ref::<io::Error>().is_some_and(retryable_io)
        }
    }
}

/// I/O errors a new path may not have.
fn retryable_io(e: &io::Error) -> bool {
    use io::ErrorKind::*;
    matches!(
        e.kind(),
        TimedOut
            | WouldBlock
            | HostUnreachable
            | NetworkUnreachable
            | ConnectionReset
            | ConnectionAborted
            | BrokenPipe
            | NotConnected
            | UnexpectedEof
            | Interrupted
            | AddrInUse
    )
}

/// One attempt at the control channel, for the error that lists them.
#[derive(Debug)]
pub struct Attempt {
    /// The TCP source port it came from (`None`: it got no socket).
    pub src_port: Option<u16>,
    /// The time it was given.
    pub timeout: Duration,
    /// The time it took.
    pub took: Duration,
    /// How it failed.
    pub error: AttemptError,
}

impl fmt::Display for Attempt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.src_port {
            Some(p) => write!(f, "from source port {p}")?,
            None => write!(f, "with no source port")?,
        }
        write!(
            f,
            ", timeout {:.2} s a step: {} (after {:.2} s)",
            self.timeout.as_secs_f64(),
            self.error,
            self.took.as_secs_f64()
        )
    }
}

/// The attempts of [`PerfError::GaveUp`], a line each.
struct Attempts<'a>(&'a [Attempt]);

impl fmt::Display for Attempts<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, a) in self.0.iter().enumerate() {
            write!(f, "\n  attempt {}: {a}", i + 1)?;
        }
        Ok(())
    }
}

/// Opens the control channel to `to` (shown as `shown`) and runs
/// `exchange` over it, attempt after attempt from new source ports (see
/// [`Retry`]), until one succeeds, one fails in a way a new path would not
/// change, or the deadline passes ([`PerfError::GaveUp`], every attempt
/// listed). `exchange` gets each connection and its [`Budget`]; it fails
/// with [`PerfError::Stalled`] or [`PerfError::Closed`] to be tried again,
/// with anything else to end it.
pub fn dial<T>(
    to: SocketAddr,
    shown: &str,
    retry: &Retry,
    connector: &mut dyn Connector,
    mut exchange: impl FnMut(TcpStream, Budget) -> anyhow::Result<T>,
) -> anyhow::Result<T> {
    let deadline = Instant::now() + retry.deadline;
    let mut attempts: Vec<Attempt> = Vec::new();
    loop {
        let t0 = Instant::now();
        let timeout = retry
            .timeout(attempts.len())
            .min(deadline.saturating_duration_since(t0));
        let used: Vec<u16> = attempts.iter().filter_map(|a| a.src_port).collect();
        let (src_port, conn) = connector.connect(to, &used, timeout);
        let error = match conn {
            Err(e) => AttemptError::Connect(e),
            Ok(stream) => {
                let budget = Budget {
                    each: timeout,
                    deadline: Some(deadline),
                };
                match exchange(stream, budget) {
                    Ok(v) => {
                        if !attempts.is_empty() {
                            tracing::info!(
                                src_port,
                                "control channel to {to} up at attempt {}",
                                attempts.len() + 1
                            );
                        }
                        return Ok(v);
                    }
                    // The server answered (refused the run, speaks another
                    // version ...): that is the error, not reachability.
                    Err(e) if !AttemptError::retryable_exchange(&e) => return Err(e),
                    Err(e) => AttemptError::Exchange(e),
                }
            }
        };
        let again = error.retryable();
        let attempt = Attempt {
            src_port,
            timeout,
            took: t0.elapsed(),
            error,
        };
        let pause = MIN_ATTEMPT.saturating_sub(t0.elapsed());
        let left = deadline.saturating_duration_since(Instant::now());
        if again && left > pause + MIN_LEFT {
            tracing::warn!(
                src_port,
                "control channel to {to}, attempt {}: {}; trying again from a new source port ({:.1} s left)",
                attempts.len() + 1,
                attempt.error,
                left.as_secs_f64()
            );
            attempts.push(attempt);
            std::thread::sleep(pause);
            continue;
        }
        attempts.push(attempt);
        let summary = if again {
            let ports = attempts.iter().filter(|a| a.src_port.is_some()).count();
            format!(
                "no attempt succeeded within {:.1} s (--connect-timeout); {} attempts, from {ports} source ports:",
                retry.deadline.as_secs_f64(),
                attempts.len(),
            )
        } else {
            let last = &attempts[attempts.len() - 1].error;
            format!("{last}; not tried again (an answer, not a silent path):")
        };
        return Err(PerfError::GaveUp {
            addr: shown.to_string(),
            summary,
            attempts,
        }
        .into());
    }
}

/// The server's control listener, accepting on a thread of its own so that
/// a client's new connection is seen while the server is still busy with
/// its old one (see [`Link::watch`]).
#[derive(Debug, Clone)]
pub struct Acceptor {
    q: Arc<Mutex<Queue>>,
}

/// Connections accepted and not served yet.
#[derive(Debug)]
struct Queue {
    rx: mpsc::Receiver<(TcpStream, SocketAddr)>,
    pending: VecDeque<(TcpStream, SocketAddr)>,
}

impl Queue {
    /// Moves what the accepting thread has into `pending`.
    fn pull(&mut self) {
        while let Ok(c) = self.rx.try_recv() {
            self.pending.push_back(c);
        }
    }
}

impl Acceptor {
    /// Accepts on `listener` from now on.
    pub fn spawn(listener: TcpListener) -> io::Result<Acceptor> {
        let (tx, rx) = mpsc::channel();
        std::thread::Builder::new()
            .name("perf-accept".into())
            .spawn(move || loop {
                match listener.accept() {
                    Ok(c) => {
                        if tx.send(c).is_err() {
                            break;
                        }
                    }
                    Err(e) => {
                        // Out of descriptors and the like: try again soon.
                        tracing::warn!("control listener: accept failed: {e}");
                        std::thread::sleep(Duration::from_millis(50));
                    }
                }
            })?;
        Ok(Acceptor {
            q: Arc::new(Mutex::new(Queue {
                rx,
                pending: VecDeque::new(),
            })),
        })
    }

    fn queue(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.q.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The next connection to serve, waiting for one: the oldest, except
    /// that a connection from a host with a newer one waiting is dropped
    /// (that client gave up on it and tried again).
    pub fn next(&self) -> io::Result<(TcpStream, SocketAddr)> {
        let mut q = self.queue();
        loop {
            if q.pending.is_empty() {
                let c =
                    q.rx.recv()
                        .map_err(|_| io::Error::other("the control listener stopped"))?;
                q.pending.push_back(c);
            }
            q.pull();
            let Some((s, peer)) = q.pending.pop_front() else {
                continue;
            };
            if let Some((_, newer)) = q.pending.iter().find(|(_, p)| p.ip() == peer.ip()) {
                tracing::info!(
                    "control connection from {peer} dropped unserved: {newer} came after it"
                );
                continue;
            }
            return Ok((s, peer));
        }
    }

    /// A connection waiting from `ip`, if one is.
    pub fn newer_from(&self, ip: IpAddr) -> Option<SocketAddr> {
        let mut q = self.queue();
        q.pull();
        q.pending
            .iter()
            .find(|(_, p)| p.ip() == ip)
            .map(|&(_, p)| p)
    }

    /// The first connection waiting, if one is.
    pub fn waiting(&self) -> Option<SocketAddr> {
        let mut q = self.queue();
        q.pull();
        q.pending.front().map(|&(_, p)| p)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// What the tests of the control channel share.
    pub(crate) mod net {
        use super::super::*;

        /// A TCP listener on loopback that completes no more handshakes: its
        /// accept queue (backlog 0) holds one connection never accepted,
        /// so the kernel drops every later SYN, as a blackholed path does
        /// (no root needed). Keep both values alive.
        pub(crate) fn blackhole() -> (Socket, TcpStream, SocketAddr) {
            let s = Socket::new(Domain::IPV4, Type::STREAM, Some(Protocol::TCP)).unwrap();
            s.bind(&SocketAddr::from(([127, 0, 0, 1], 0)).into())
                .unwrap();
            s.listen(0).unwrap();
            let addr = s.local_addr().unwrap().as_socket().unwrap();
            let filler = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).unwrap();
            (s, filler, addr)
        }

        /// A listener that accepts every connection and never says a word:
        /// an exchange that stalls after the connect. Returns its address
        /// and the source ports it saw.
        pub(crate) fn silent() -> (SocketAddr, Arc<Mutex<Vec<u16>>>) {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = l.local_addr().unwrap();
            let seen = Arc::new(Mutex::new(Vec::new()));
            let s2 = seen.clone();
            std::thread::spawn(move || {
                let mut held = Vec::new();
                for c in l.incoming().flatten() {
                    s2.lock().unwrap().push(c.peer_addr().unwrap().port());
                    held.push(c);
                }
            });
            (addr, seen)
        }

        /// A [`Connector`] that sends its first attempts elsewhere (to a
        /// blackhole, a silent listener) and the rest where asked, through
        /// [`FreshPort`], and notes every source port.
        #[derive(Debug, Default)]
        pub(crate) struct Detour {
            pub(crate) first: Vec<SocketAddr>,
            pub(crate) ports: Vec<Option<u16>>,
            pub(crate) to: Vec<SocketAddr>,
        }

        impl Connector for Detour {
            fn connect(
                &mut self,
                to: SocketAddr,
                used: &[u16],
                timeout: Duration,
            ) -> (Option<u16>, io::Result<TcpStream>) {
                let to = self.first.get(self.ports.len()).copied().unwrap_or(to);
                let (port, r) = FreshPort.connect(to, used, timeout);
                self.ports.push(port);
                self.to.push(to);
                (port, r)
            }
        }

        /// Whether all of `ports` are there and differ.
        pub(crate) fn all_different(ports: &[Option<u16>]) -> bool {
            let mut p: Vec<u16> = ports.iter().map(|p| p.expect("a source port")).collect();
            p.sort_unstable();
            p.dedup();
            p.len() == ports.len()
        }
    }

    use net::*;

    /// A quick schedule for tests: 300 ms, then a quarter more, 1 s at most.
    fn quick(deadline: Duration) -> Retry {
        Retry {
            deadline,
            first: Duration::from_millis(300),
            growth: 1.25,
            max: Duration::from_secs(1),
        }
    }

    #[test]
    fn the_default_schedule_grows_modestly_and_holds_several_attempts() {
        let r = Retry::within(Duration::from_secs(10));
        assert_eq!(r.timeout(0), Duration::from_secs(1));
        assert_eq!(r.timeout(1), Duration::from_millis(1250));
        assert_eq!(r.timeout(30), Duration::from_secs(4));
        let (mut n, mut t) = (0, Duration::ZERO);
        while t + MIN_LEFT < r.deadline {
            t += r.timeout(n);
            n += 1;
        }
        assert!(n >= 6, "{n} attempts in 10 s");
    }

    #[test]
    fn connects_are_retried_from_new_source_ports_past_a_blackhole() {
        let (_bh, _filler, hole) = blackhole();
        let server = TcpListener::bind("127.0.0.1:0").unwrap();
        let to = server.local_addr().unwrap();
        let mut c = Detour {
            first: vec![hole, hole],
            ..Detour::default()
        };
        let t0 = Instant::now();
        let peer_port = dial(
            to,
            "test",
            &quick(Duration::from_secs(10)),
            &mut c,
            |s, b| {
                assert!(b.each >= Duration::from_millis(300));
                Ok(s.local_addr()?.port())
            },
        )
        .unwrap();
        let took = t0.elapsed();
        assert_eq!(c.to, [hole, hole, to]);
        assert!(all_different(&c.ports), "{:?}", c.ports);
        assert_eq!(Some(peer_port), c.ports[2]);
        let (_, from) = server.accept().unwrap();
        assert_eq!(from.port(), peer_port);
        // 300 + 375 ms of timeouts, and not much more.
        assert!(took >= Duration::from_millis(670), "{took:?}");
        assert!(took < Duration::from_secs(3), "{took:?}");
    }

    #[test]
    fn with_nothing_reachable_the_client_gives_up_in_time_and_names_each_attempt() {
        let (_bh, _filler, hole) = blackhole();
        let mut c = Detour::default();
        let deadline = Duration::from_millis(1500);
        let t0 = Instant::now();
        let err = dial(hole, "hole", &quick(deadline), &mut c, |_, _| Ok(())).unwrap_err();
        let took = t0.elapsed();
        assert!(took < deadline + Duration::from_millis(300), "{took:?}");
        let Some(PerfError::GaveUp { attempts, .. }) = err.downcast_ref::<PerfError>() else {
            panic!("{err:#}");
        };
        // 300, 375, 469 ms, then what is left.
        assert!(attempts.len() >= 4, "{err:#}");
        assert_eq!(attempts.len(), c.ports.len());
        assert!(all_different(&c.ports), "{:?}", c.ports);
        let text = err.to_string();
        assert!(
            text.starts_with(
                "cannot reach metaroce perf server at hole: no attempt succeeded within 1.5 s"
            ),
            "{text}"
        );
        for (i, a) in attempts.iter().enumerate() {
            assert!(
                matches!(&a.error, AttemptError::Connect(e) if e.kind() == io::ErrorKind::TimedOut),
                "{a}"
            );
            let port = a.src_port.unwrap();
            assert!(
                text.contains(&format!("attempt {}: from source port {port}, ", i + 1)),
                "{text}"
            );
        }
    }

    #[test]
    fn a_refused_connection_is_not_retried() {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let to = SocketAddr::from(([127, 0, 0, 1], port));
        let mut c = Detour::default();
        let err = dial(
            to,
            "closed",
            &quick(Duration::from_secs(5)),
            &mut c,
            |_, _| Ok(()),
        )
        .unwrap_err();
        assert_eq!(c.ports.len(), 1);
        let text = err.to_string();
        assert!(text.contains("not tried again"), "{text}");
        assert!(text.contains("attempt 1: from source port"), "{text}");
    }

    #[test]
    fn a_stalled_exchange_is_redone_on_a_new_connection() {
        let (quiet, seen) = silent();
        // A "server" that answers each connection with a byte.
        let server = TcpListener::bind("127.0.0.1:0").unwrap();
        let to = server.local_addr().unwrap();
        std::thread::spawn(move || {
            for mut c in server.incoming().flatten() {
                let _ = c.write_all(b"!");
            }
        });
        let mut c = Detour {
            first: vec![quiet],
            ..Detour::default()
        };
        let mut budgets = Vec::new();
        dial(
            to,
            "test",
            &quick(Duration::from_secs(10)),
            &mut c,
            |mut s, b| {
                budgets.push(b.each);
                s.set_read_timeout(Some(b.cap(b.each)))?;
                let mut byte = [0u8];
                match s.read_exact(&mut byte) {
                    Ok(()) => Ok(()),
                    Err(e)
                        if matches!(
                            e.kind(),
                            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                        ) =>
                    {
                        Err(PerfError::Stalled {
                            wanted: "a byte",
                            waited: b.each,
                        }
                        .into())
                    }
                    Err(e) => Err(e.into()),
                }
            },
        )
        .unwrap();
        assert_eq!(c.to, [quiet, to]);
        assert!(all_different(&c.ports), "{:?}", c.ports);
        assert_eq!(*seen.lock().unwrap(), [c.ports[0].unwrap()]);
        assert_eq!(
            budgets,
            [Duration::from_millis(300), Duration::from_millis(375)]
        );
    }

    #[test]
    fn an_answer_from_the_server_ends_the_attempts() {
        let server = TcpListener::bind("127.0.0.1:0").unwrap();
        let to = server.local_addr().unwrap();
        let mut c = Detour::default();
        let err = dial(
            to,
            "test",
            &quick(Duration::from_secs(10)),
            &mut c,
            |_, _| Err::<(), _>(PerfError::Refused("no".into()).into()),
        )
        .unwrap_err();
        assert!(
            matches!(err.downcast_ref(), Some(PerfError::Refused(_))),
            "{err:#}"
        );
        assert_eq!(c.ports.len(), 1);
    }

    #[test]
    fn a_newer_connection_from_the_same_host_takes_over_until_settled() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let to = l.local_addr().unwrap();
        let acc = Acceptor::spawn(l).unwrap();
        let _c1 = TcpStream::connect(to).unwrap();
        let (s1, p1) = acc.next().unwrap();
        let link = Link::tcp(s1).unwrap();
        let a = acc.clone();
        link.watch(move |_, _| a.newer_from(p1.ip()));
        assert!(link.try_recv().unwrap().is_none());
        let c2 = TcpStream::connect(to).unwrap();
        let t0 = Instant::now();
        let by = loop {
            match link.try_recv() {
                Ok(None) if t0.elapsed() < Duration::from_secs(5) => {
                    std::thread::sleep(Duration::from_millis(5))
                }
                Err(PerfError::Superseded { by }) => break by,
                other => panic!("{other:?}"),
            }
        };
        assert_eq!(by, c2.local_addr().unwrap());
        // Settled: nothing takes over any more.
        let link = Link::tcp(acc.next().unwrap().0).unwrap();
        let a = acc.clone();
        link.watch(move |_, _| a.newer_from(p1.ip()));
        link.settle();
        let _c3 = TcpStream::connect(to).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        assert!(link.try_recv().unwrap().is_none());
        // Of several waiting from one host, the newest is served.
        let c4 = TcpStream::connect(to).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(acc.next().unwrap().1, c4.local_addr().unwrap());
    }

    #[test]
    fn messages_round_trip_length_prefixed() {
        let msgs = [
            Msg::Hello {
                version: VERSION,
                params: RunParams {
                    op: Op::Read,
                    size: 4096,
                    depth: 16,
                    qps: 2,
                    verify: true,
                    duration: 1.5,
                    bidir: true,
                },
            },
            Msg::ClientQps {
                qpns: vec![3],
                region: Some(Region {
                    rkey: 9,
                    addr: 0x1000_0000,
                    slots: 4,
                }),
            },
            Msg::Start,
            Msg::Ready {
                qpns: vec![1, 2],
                rkey: 7,
                addr: 0x1000_0000,
                slots: 32,
            },
            Msg::Done {
                iterations: 9,
                elapsed_s: 0.5,
                verified_bytes: 0,
                corrupt_bytes: 0,
                retransmits: 2,
            },
        ];
        let mut buf = Vec::new();
        for m in &msgs {
            write_msg(&mut buf, m).unwrap();
        }
        assert_eq!(
            u32::from_be_bytes(buf[..4].try_into().unwrap()) as usize + 4,
            {
                let first = serde_json::to_vec(&msgs[0]).unwrap();
                first.len() + 4
            }
        );
        let mut r = &buf[..];
        for m in &msgs {
            assert_eq!(read_msg(&mut r).unwrap().as_ref(), Some(m));
        }
        assert_eq!(read_msg(&mut r).unwrap(), None);
    }

    #[test]
    fn a_v1_hello_still_parses_so_its_version_can_be_refused() {
        let v1 = br#"{"type":"hello","version":1,"params":{"op":"write","size":64,"depth":4,"qps":1,"verify":true,"duration":1.0}}"#;
        let mut buf = (v1.len() as u32).to_be_bytes().to_vec();
        buf.extend_from_slice(v1);
        match read_msg(&mut &buf[..]).unwrap() {
            Some(Msg::Hello { version, params }) => {
                assert_eq!(version, 1);
                assert!(!params.bidir);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn oversized_and_garbage_messages_are_refused() {
        let mut r = &[0xffu8, 0xff, 0xff, 0xff][..];
        assert!(read_msg(&mut r).is_err());
        let mut buf = 3u32.to_be_bytes().to_vec();
        buf.extend_from_slice(b"{x}");
        assert!(read_msg(&mut &buf[..]).is_err());
    }
}
