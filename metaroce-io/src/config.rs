//! What every backend is set up from, and what it counts.

use crate::FaultConfig;
use metaroce_proto::EndpointConfig;
use std::fmt;
use std::net::SocketAddr;
use std::str::FromStr;
use std::time::Duration;

/// Which I/O backend runs the endpoint.
///
/// [`Driver::bind`](crate::Driver::bind) resolves [`Auto`](Backend::Auto)
/// once, at bind time; a bound driver reports [`Uring`](Backend::Uring) or
/// [`Portable`](Backend::Portable), never `Auto`.
///
/// ```
/// use metaroce_io::Backend;
/// assert_eq!("io_uring".parse::<Backend>(), Ok(Backend::Uring));
/// assert_eq!(Backend::Portable.to_string(), "portable");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Backend {
    /// io_uring when the kernel supports what it needs, else portable.
    #[default]
    Auto,
    /// io_uring (multishot receive into a provided-buffer ring, GSO/GRO,
    /// zero-copy sends, timers on the ring). Binding fails without it.
    Uring,
    /// `std` sockets and `quinn-udp`; works on any kernel.
    Portable,
    /// AF_XDP (Linux, root): an XDP program steers the endpoint's frames
    /// to an AF_XDP socket and the driver writes its frames' headers
    /// itself, past the kernel's UDP/IP stack ([`XdpDriver`](crate::XdpDriver)).
    /// Only when asked for: [`Backend::Auto`] never picks it.
    AfXdp,
}

impl Backend {
    /// The name used in logs, reports and [`FromStr`].
    pub fn name(self) -> &'static str {
        match self {
            Backend::Auto => "auto",
            Backend::Uring => "io_uring",
            Backend::Portable => "portable",
            Backend::AfXdp => "af_xdp",
        }
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A backend name that is not `auto`, `io_uring` (or `uring`) or `portable`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown backend `{0}` (expected auto, io_uring, portable or af_xdp)")]
pub struct UnknownBackend(pub String);

impl FromStr for Backend {
    type Err = UnknownBackend;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(Backend::Auto),
            "io_uring" | "io-uring" | "uring" => Ok(Backend::Uring),
            "portable" => Ok(Backend::Portable),
            "af_xdp" | "af-xdp" | "afxdp" | "xdp" => Ok(Backend::AfXdp),
            _ => Err(UnknownBackend(s.to_string())),
        }
    }
}

/// Default of [`DriverConfig::turn_send_bytes`]: two full GSO batches.
pub const DEFAULT_TURN_SEND_BYTES: usize = 128 << 10;

/// Default of [`DriverConfig::turn_recv_bytes`]: four GSO batches.
pub const DEFAULT_TURN_RECV_BYTES: usize = 256 << 10;

/// Settings only the io_uring backend reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UringConfig {
    /// Submission queue entries (a power of two; the completion queue gets four times as many).
    pub entries: u32,
    /// Buffers in the provided-buffer ring the multishot receive fills (a
    /// power of two, at most 32768). Each holds one receive, a GRO batch of
    /// up to 64 KiB included.
    ///
    /// This is also the io_uring backend's bound on the receive work of a
    /// turn (what [`DriverConfig::turn_recv_bytes`] is to the portable
    /// one): the kernel copies into every free buffer each time the thread
    /// enters it, before the thread sees any of them. With 64 buffers a
    /// turn took up to 4 MiB at once while its ACKs waited, and the sender
    /// ran out of window; with 4, a loopback WRITE stream ran 1.4x as fast
    /// (`docs/BENCHMARKS.md`). When all are in use the receive ends
    /// (ENOBUFS) and the datagrams wait in the socket until the next turn
    /// re-arms it.
    pub recv_buffers: u16,
    /// Send buffers (each up to 64 KiB). A transmit waits in the core while
    /// all are with the kernel.
    pub send_slots: usize,
    /// Send large transmits with `IORING_OP_SENDMSG_ZC` (zero copy). The
    /// driver turns it off by itself (with a log line) once
    /// [`ZC_COPIED_LIMIT`](crate::ZC_COPIED_LIMIT) notifications in a row
    /// say the kernel copied anyway, as it always does on loopback and veth:
    /// there pinning the pages only adds to the copy.
    pub zero_copy: bool,
    /// Smallest transmit (bytes, a whole GSO batch) sent with zero copy.
    pub zero_copy_threshold: usize,
    /// Payloads of at least this many bytes go to the kernel straight out
    /// of their memory region (a scatter-gather send: the headers from the
    /// send slot, each payload from its region, no copy by the driver); `0`
    /// copies every payload into the send slot first.
    pub gather_threshold: usize,
}

impl Default for UringConfig {
    fn default() -> Self {
        UringConfig {
            entries: 256,
            recv_buffers: 4,
            send_slots: 32,
            zero_copy: true,
            zero_copy_threshold: 16 << 10,
            gather_threshold: 1024,
        }
    }
}

/// How to set a driver up.
#[derive(Debug, Clone)]
pub struct DriverConfig {
    /// Address to receive on (port 0: any free port).
    pub listen: SocketAddr,
    /// The endpoint's configuration; `listen_port`, `source_ports` and
    /// `max_gso_segments` are replaced by what the driver actually bound and
    /// what the kernel supports.
    pub endpoint: EndpointConfig,
    /// More local addresses, one per further plane (multiplane: one NIC
    /// port and address per independent fabric plane; `listen` is plane 0).
    /// The driver binds the listen port and every source port on each, and
    /// the endpoint spreads each connection's paths over the planes both
    /// sides have (see
    /// [`EndpointConfig::plane_ips`](metaroce_proto::EndpointConfig::plane_ips),
    /// which the driver fills in). Empty: one plane.
    pub planes: Vec<std::net::IpAddr>,
    /// Send sockets per plane, one per source port (path entropy). Default:
    /// twice the paths, so that a failed path can move to a port no other
    /// path uses.
    pub send_sockets: usize,
    /// Seed of the endpoint. With a pre-shared key
    /// ([`EndpointConfig::psk`](metaroce_proto::EndpointConfig::psk)) the
    /// driver mixes 64 bits of the operating system's randomness into it:
    /// the connections' handshake nonces, and so their keys, must never
    /// repeat (PROTOCOL §3.2), whatever seed the application gives.
    pub seed: u64,
    /// Kernel socket buffer size to ask for, bytes (the kernel may give
    /// less: `net.core.rmem_max` caps it). Unless
    /// [`endpoint.receive_buffer`](metaroce_proto::EndpointConfig::receive_buffer)
    /// is set, the driver shares half of the receive buffer it got among
    /// the peers sending to it (each ACK tells its sender its share of
    /// bytes in flight), so that a receiving thread held up for a while
    /// makes its senders wait instead of its kernel drop their datagrams;
    /// set that field to `Some(u64::MAX)` to give senders no such limit.
    pub socket_buffer: usize,
    /// Most datagrams per GSO send (the kernel's limit applies too; 1 disables GSO).
    pub max_gso_segments: usize,
    /// Bytes one turn of the loop hands the kernel before it goes back to
    /// read what came in (at least one transmit always goes). A turn that
    /// sends a whole window at once keeps the thread in the kernel, copying,
    /// for hundreds of microseconds, during which no ACK is read, no request
    /// completes and the application posts nothing: on loopback with 16
    /// 64 KiB WRITEs outstanding, no bound gave about two thirds of the
    /// throughput that 128 KiB (two GSO batches) gives (`docs/BENCHMARKS.md`).
    pub turn_send_bytes: usize,
    /// Bytes the portable backend reads from a receive socket in one turn
    /// before it answers them (at least one datagram or GRO batch): ACKs
    /// and completions for what was read leave at the end of the turn, so
    /// a turn that drains megabytes holds them back and starves the
    /// sender. The io_uring backend's bound is its number of receive
    /// buffers ([`UringConfig::recv_buffers`]).
    pub turn_recv_bytes: usize,
    /// How long a turn of [`Driver::poll`](crate::Driver::poll) with nothing
    /// to do watches for work (a datagram, a finished send, a wake) before
    /// it sleeps; zero (the default): it sleeps at once.
    ///
    /// Polling spends the thread's CPU while it waits, and spares the
    /// sender the cost of waking it: on loopback with a thread per side,
    /// 50 µs took one-at-a-time 8 B SENDs from 0.025 to 0.087 million a
    /// second, and a 64 KiB WRITE stream a few percent at most
    /// (`docs/BENCHMARKS.md`, session 14). Use it when each driver has a
    /// core of its own; never when one thread polls several drivers in
    /// turn (one driver's spin then holds up the others).
    pub busy_poll: Duration,
    /// Which backend [`Driver::bind`](crate::Driver::bind) picks.
    pub backend: Backend,
    /// io_uring settings.
    pub uring: UringConfig,
    /// AF_XDP settings (interface, queue, UMEM and ring sizes).
    pub xdp: XdpConfig,
    /// Faults to inject into received datagrams (default: none).
    pub faults: FaultConfig,
}

impl DriverConfig {
    /// Defaults around a listen address.
    pub fn new(listen: SocketAddr) -> Self {
        let endpoint = EndpointConfig::default();
        DriverConfig {
            listen,
            planes: Vec::new(),
            // Twice the paths: a failed path moves to a port no path uses.
            send_sockets: 2 * usize::from(endpoint.paths),
            endpoint,
            seed: 0,
            socket_buffer: 8 << 20,
            max_gso_segments: 16,
            turn_send_bytes: DEFAULT_TURN_SEND_BYTES,
            turn_recv_bytes: DEFAULT_TURN_RECV_BYTES,
            busy_poll: Duration::ZERO,
            backend: Backend::Auto,
            uring: UringConfig::default(),
            xdp: XdpConfig::default(),
            faults: FaultConfig::default(),
        }
    }
}

/// Counters of the driver itself (the core keeps its own).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DriverStats {
    /// Datagrams handed to the kernel.
    pub datagrams_sent: u64,
    /// Datagrams read from the kernel (GRO segments counted one by one).
    pub datagrams_received: u64,
    /// Receives that came with the kernel's arrival timestamp
    /// (`SO_TIMESTAMPNS`; a GRO batch counts once).
    pub stamped: u64,
    /// Sends that carried several datagrams (UDP GSO).
    pub gso_sends: u64,
    /// Receive calls that returned several datagrams at once (GRO).
    pub gro_batches: u64,
    /// Reads of a receive socket (portable only: `recvmmsg` calls, those
    /// that found nothing included).
    pub reads: u64,
    /// Sends the kernel refused (logged; the protocol recovers the loss).
    pub send_errors: u64,
    /// Turns of the loop that waited for the network or a timer.
    pub waits: u64,
    /// Transmits sent with zero copy (io_uring only).
    pub zero_copy_sends: u64,
    /// Zero-copy sends the kernel copied after all (loopback always does).
    pub zero_copy_copied: u64,
    /// Sends whose payloads the kernel read straight from their memory
    /// regions (io_uring, [`UringConfig::gather_threshold`]).
    pub gathered_sends: u64,
    /// Times the multishot receive was armed (io_uring only; 1 if it never ended).
    pub recv_arms: u64,
    /// Turns whose busy poll found work before they slept
    /// ([`DriverConfig::busy_poll`]).
    pub busy_polls: u64,
    /// Extra rounds of receive buffers read before timers that ran late
    /// (io_uring only): what came while the thread was held up is read
    /// before any retransmission timeout is judged.
    pub late_drains: u64,
    /// Received datagrams dropped by the driver (truncated, or bad metadata).
    pub recv_dropped: u64,
    /// Datagrams received on each plane's address (plane 0 first; planes
    /// past the configured ones stay 0).
    pub received_per_plane: [u64; metaroce_proto::consts::MAX_PLANES],
    /// `io_uring_enter` calls (io_uring only).
    pub submits: u64,
    /// Turns that ended without a system call: nothing to submit, nothing
    /// to wait for, and no completion held by the kernel (io_uring only).
    pub idle_turns: u64,
    /// Received datagrams the fault injector dropped.
    pub faults_dropped: u64,
    /// Received datagrams the fault injector delivered twice.
    pub faults_duplicated: u64,
    /// Received datagrams the fault injector held back (reordered).
    pub faults_delayed: u64,
    /// AF_XDP: the socket runs in zero-copy mode (else copy mode).
    pub xdp_zero_copy: bool,
    /// AF_XDP: frames the XDP program redirected to the socket (all CPUs).
    pub xdp_redirected: u64,
    /// AF_XDP: frames the XDP program passed on to the kernel.
    pub xdp_passed: u64,
    /// AF_XDP: frames the kernel dropped on the way to the socket, for
    /// other reasons than the two below (a frame too long for a chunk).
    pub xdp_rx_dropped: u64,
    /// AF_XDP: frames dropped because the receive ring was full.
    pub xdp_rx_ring_full: u64,
    /// AF_XDP: frames dropped because the fill ring was empty (no frame
    /// to receive into).
    pub xdp_fill_ring_empty: u64,
    /// AF_XDP: descriptors the kernel refused as invalid.
    pub xdp_invalid_descs: u64,
    /// AF_XDP: frames in the fill ring at the last look.
    pub xdp_fill_level: u64,
    /// AF_XDP: transmit frames free at the last look.
    pub xdp_tx_free: u64,
    /// AF_XDP: kicks of the transmit ring after which the device had
    /// dropped a frame.
    pub xdp_tx_dropped: u64,
    /// AF_XDP: turns that found no free transmit frame.
    pub xdp_tx_full: u64,
    /// AF_XDP: route and neighbour lookups (cache misses).
    pub route_lookups: u64,
    /// AF_XDP: datagrams sent through the kernel's UDP socket (next hop not
    /// resolved yet, or a route through another interface).
    pub kernel_sent: u64,
    /// AF_XDP: datagrams read from the kernel's UDP socket (frames the XDP
    /// program did not redirect).
    pub kernel_received: u64,
}

impl DriverConfig {
    /// The seed the endpoint gets: [`seed`](Self::seed), with the operating
    /// system's randomness mixed in when the endpoint has a pre-shared key.
    pub(crate) fn endpoint_seed(&self) -> u64 {
        if self.endpoint.psk.is_none() {
            return self.seed;
        }
        let mut b = [0u8; 8];
        let random = std::fs::File::open("/dev/urandom")
            .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut b))
            .map(|()| u64::from_ne_bytes(b));
        let extra = random.unwrap_or_else(|_| {
            // No /dev/urandom: the clock and the process id, which at
            // least differ between runs.
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64);
            t ^ u64::from(std::process::id()).rotate_left(32)
        });
        self.seed ^ extra
    }
}

/// The AF_XDP backend's settings (in [`DriverConfig::xdp`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XdpConfig {
    /// The interface; `None`: the one that holds the bind address.
    pub iface: Option<String>,
    /// The receive queue to bind (0).
    pub queue: u32,
    /// UMEM frames of 4 KiB, half for receiving and half for sending
    /// (a power of two; 8192 = 32 MiB).
    pub frames: u32,
    /// Entries of each of the four rings (a power of two, at most half the
    /// frames; 4096).
    pub ring: u32,
    /// `Some(true)`: zero copy or fail; `Some(false)`: copy mode; `None`
    /// (the default): zero copy where the driver has it, else copy.
    pub zero_copy: Option<bool>,
}

impl Default for XdpConfig {
    fn default() -> Self {
        XdpConfig {
            iface: None,
            queue: 0,
            frames: 8192,
            ring: 4096,
            zero_copy: None,
        }
    }
}

/// How an AF_XDP driver runs (`XdpDriver::info`, [`Driver::xdp_info`](crate::Driver::xdp_info)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XdpInfo {
    /// Zero copy or copy.
    pub mode: XdpMode,
    /// How the XDP program is attached: `driver` (the interface's own
    /// hook) or `generic`.
    pub attach: &'static str,
    /// The interface.
    pub iface: String,
}

impl std::fmt::Display for XdpInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} mode, {} XDP hook, {}",
            self.mode, self.attach, self.iface
        )
    }
}

/// Which mode the socket runs in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum XdpMode {
    /// The driver places frames in the UMEM itself.
    ZeroCopy,
    /// The kernel copies each frame between its buffers and the UMEM (what
    /// veth and drivers without AF_XDP support offer).
    Copy,
}

impl std::fmt::Display for XdpMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            XdpMode::ZeroCopy => "zero-copy",
            XdpMode::Copy => "copy",
        })
    }
}
