//! Prometheus metrics from the core's stats structs, and a tiny HTTP server
//! for `/metrics`.
//!
//! The core has no metrics dependency: it keeps plain counters
//! ([`EndpointStats`], [`ConnectionStats`], [`PathStats`]); [`Metrics::update`]
//! copies them into Prometheus counters and gauges, per endpoint, connection
//! and path. Call it as often as the metrics should be fresh (say once per
//! scrape interval, from the thread that polls the driver).

use crate::DriverStats;
use metaroce_proto::{
    ConnectionStats, Endpoint, EndpointStats, PathState, PathStats, RejectReason,
};
use prometheus::{Encoder, GaugeVec, IntCounter, IntCounterVec, Opts, Registry, TextEncoder};
use std::collections::HashSet;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

const REASONS: [(RejectReason, &str); 21] = [
    (RejectReason::Truncated, "truncated"),
    (RejectReason::BadVersion, "bad_version"),
    (RejectReason::UnknownType, "unknown_type"),
    (RejectReason::UnknownOpcode, "unknown_opcode"),
    (RejectReason::InvalidField, "invalid_field"),
    (RejectReason::UnknownConnection, "unknown_connection"),
    (RejectReason::WrongSource, "wrong_source"),
    (RejectReason::WrongState, "wrong_state"),
    (RejectReason::CsnOutOfWindow, "csn_out_of_window"),
    (RejectReason::PsnOutOfWindow, "psn_out_of_window"),
    (RejectReason::Duplicate, "duplicate"),
    (RejectReason::BadQp, "bad_qp"),
    (RejectReason::MsgOutOfWindow, "msg_out_of_window"),
    (RejectReason::Inconsistent, "inconsistent"),
    (RejectReason::BogusAck, "bogus_ack"),
    (RejectReason::BadCookie, "bad_cookie"),
    (RejectReason::Refused, "refused"),
    (RejectReason::StaleGeneration, "stale_generation"),
    (RejectReason::BadIntegrity, "bad_integrity"),
    (RejectReason::BadKey, "bad_key"),
    (RejectReason::RateLimited, "rate_limited"),
];

type Counter<S> = (IntCounterVec, fn(&S) -> u64);
type Gauge<S> = (GaugeVec, fn(&S) -> f64);

const NS: f64 = 1e-9;

/// Metrics of one [`Endpoint`] (and optionally its driver), registered in a
/// [`Registry`]. Every series has an `endpoint` label with the name given at
/// creation, so several endpoints can share one registry; connection series
/// add `conn` (the connection's index), path series `conn` and `path`.
///
/// Counters (`_total`) and gauges:
///
/// | level | metrics |
/// |---|---|
/// | endpoint | `metaroce_datagrams_{sent,received}_total`, `metaroce_bytes_{sent,received}_total`, `metaroce_connections_opened_total`, `metaroce_cookies_sent_total`, `metaroce_rejects_total{reason}`, `metaroce_connections` |
/// | connection | `metaroce_connection_{data_packets_sent,data_packets_received,payload_bytes_sent,payload_bytes_received,retransmits,fast_retransmits,rto_fires,packets_lost,duplicates_received,acks_sent,acks_coalesced,acks_received,naks_sent,naks_received,probes_sent,route_checks,path_failures,path_moves}_total`; `metaroce_connection_{cwnd_bytes,in_flight_bytes,srtt_seconds,rto_seconds,rate_hint_bits_per_second,peer_window_bytes}` |
/// | path | `metaroce_path_{packets_sent,bytes_sent,packets_acked,packets_lost,retransmits,ecn_ce_marks,failures,moves,slow_moves}_total`; `metaroce_path_{srtt_seconds,cwnd_bytes,in_flight_bytes,source_port,plane,state}` (state: 0 active, 1 probing) |
/// | driver | `metaroce_driver_{datagrams_sent,datagrams_received,stamped,gso_sends,gro_batches,send_errors,recv_dropped,faults_dropped,faults_duplicated,faults_delayed,zero_copy_sends,gathered_sends,busy_polls,late_drains,idle_turns}_total`, `metaroce_driver_plane_datagrams_received_total{plane}`; AF_XDP (zero on the other backends): `metaroce_driver_{xdp_redirected,xdp_passed,xdp_rx_dropped,xdp_rx_ring_full,xdp_fill_ring_empty,xdp_invalid_descs,xdp_tx_dropped,xdp_tx_full,route_lookups,kernel_sent,kernel_received}_total`, `metaroce_driver_xdp_{fill_level,tx_free}` (from [`update_driver`](Self::update_driver)) |
///
/// `fast_retransmits` are the retransmissions a SACK gap caused; `rto_fires`
/// the retransmission timeouts. Series of connections that closed are
/// removed on the next update.
///
/// ```
/// use metaroce_io::Metrics;
/// use metaroce_proto::{Endpoint, EndpointConfig};
/// let ep = Endpoint::new(EndpointConfig::default(), 1).unwrap();
/// let mut m = Metrics::new("server").unwrap();
/// m.update(&ep);
/// let text = m.encode();
/// assert!(text.contains("metaroce_bytes_sent_total{endpoint=\"server\"} 0"));
/// ```
pub struct Metrics {
    registry: Registry,
    name: String,
    endpoint: Vec<Counter<EndpointStats>>,
    rejects: IntCounterVec,
    open: GaugeVec,
    conn_counters: Vec<Counter<ConnectionStats>>,
    conn_gauges: Vec<Gauge<ConnectionStats>>,
    path_counters: Vec<Counter<PathStats>>,
    path_gauges: Vec<Gauge<PathStats>>,
    driver: Vec<Counter<DriverStats>>,
    driver_gauges: Vec<Gauge<DriverStats>>,
    plane_received: IntCounterVec,
    /// Label values of the connections and paths seen on the last update.
    seen_conns: HashSet<String>,
    seen_paths: HashSet<(String, String)>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics")
            .field("endpoint", &self.name)
            .field("connections", &self.seen_conns.len())
            .finish_non_exhaustive()
    }
}

/// Sets a counter to an absolute value (a core counter only grows; a
/// smaller one, e.g. after a restart, starts the series over).
fn set_counter(c: &IntCounter, v: u64) {
    let cur = c.get();
    if v > cur {
        c.inc_by(v - cur);
    } else if v < cur {
        c.reset();
        c.inc_by(v);
    }
}

impl Metrics {
    /// Metrics for an endpoint called `name`, in a registry of their own.
    pub fn new(name: &str) -> prometheus::Result<Self> {
        Self::with_registry(Registry::new(), name)
    }

    /// Metrics for an endpoint called `name`, in `registry` (shared with
    /// other endpoints' metrics or the program's own).
    pub fn with_registry(registry: Registry, name: &str) -> prometheus::Result<Self> {
        let opts = |metric: &str, help: &str| Opts::new(metric, help).const_label("endpoint", name);
        let counter =
            |metric: &str, help: &str, labels: &[&str]| -> prometheus::Result<IntCounterVec> {
                let c = IntCounterVec::new(opts(metric, help), labels)?;
                registry.register(Box::new(c.clone()))?;
                Ok(c)
            };
        let gauge = |metric: &str, help: &str, labels: &[&str]| -> prometheus::Result<GaugeVec> {
            let g = GaugeVec::new(opts(metric, help), labels)?;
            registry.register(Box::new(g.clone()))?;
            Ok(g)
        };
        macro_rules! counters {
            ($ty:ty, $labels:expr, $prefix:literal; $($field:ident $(as $metric:literal)?: $help:literal),* $(,)?) => {
                vec![$({
                    #[allow(unused_variables)]
                    let metric = concat!($prefix, stringify!($field), "_total");
                    $(let metric = concat!($prefix, $metric, "_total");)?
                    let f: fn(&$ty) -> u64 = |s| s.$field;
                    (counter(metric, $help, $labels)?, f)
                }),*]
            };
        }
        let endpoint = counters!(EndpointStats, &[], "metaroce_";
            datagrams_sent: "Datagrams sent (GSO segments counted one by one).",
            datagrams_received: "Datagrams received.",
            bytes_sent: "Bytes sent.",
            bytes_received: "Bytes received.",
            connections_opened: "Connections created (both directions).",
            cookies_sent: "Handshake cookies handed out.",
        );
        let rejects = counter(
            "metaroce_rejects_total",
            "Datagrams (or parts) rejected, by reason.",
            &["reason"],
        )?;
        let open = gauge("metaroce_connections", "Connections open.", &[])?;
        let c = &["conn"];
        let conn_counters = counters!(ConnectionStats, c, "metaroce_connection_";
            data_packets_sent: "DATA packets sent, retransmissions included.",
            data_packets_received: "DATA packets received.",
            payload_bytes_sent: "Payload bytes sent for the first time.",
            payload_bytes_received: "Payload bytes placed at this end.",
            retransmits: "Retransmissions (SACK gap and timeout).",
            fast_retransmits: "Retransmissions a SACK gap caused.",
            rto_fires: "Retransmission timeouts fired.",
            packets_lost: "Packets declared lost.",
            duplicates_received: "Duplicate packets received.",
            acks_sent: "ACKs sent, coalesced ones included.",
            acks_coalesced: "ACKs sent riding on a DATA packet.",
            acks_received: "ACKs received.",
            naks_sent: "NAKs sent.",
            naks_received: "NAKs received.",
            probes_sent: "NOP probes sent (progress, tail-loss and failed-path probes).",
            route_checks: "Route checks sent: NOPs on paths that carry only ACKs.",
            path_failures: "Paths declared failed and moved to a new source port.",
            path_moves: "Paths moved to a new source port because their route stayed congested or was slow.",
        );
        let conn_gauges: Vec<Gauge<ConnectionStats>> = vec![
            (
                gauge("metaroce_connection_cwnd_bytes", "Congestion window.", c)?,
                |s| s.cwnd as f64,
            ),
            (
                gauge("metaroce_connection_in_flight_bytes", "Bytes in flight.", c)?,
                |s| s.in_flight as f64,
            ),
            (
                gauge("metaroce_connection_srtt_seconds", "Smoothed RTT.", c)?,
                |s| s.srtt_ns as f64 * NS,
            ),
            (
                gauge(
                    "metaroce_connection_rto_seconds",
                    "Current RTO, backoff included.",
                    c,
                )?,
                |s| s.rto_ns as f64 * NS,
            ),
            (
                gauge(
                    "metaroce_connection_rate_hint_bits_per_second",
                    "Latest rate hint from the receiver (0: none).",
                    c,
                )?,
                |s| f64::from(s.rate_hint_kbps) * 1e3,
            ),
            (
                gauge(
                    "metaroce_connection_peer_window_bytes",
                    "Bytes the receiver lets this side keep in flight (0: no window given).",
                    c,
                )?,
                |s| s.peer_window as f64,
            ),
        ];
        let p = &["conn", "path"];
        let path_counters = counters!(PathStats, p, "metaroce_path_";
            packets_sent: "DATA packets sent, retransmissions included.",
            bytes_sent: "Bytes of payload-carrying datagrams sent.",
            packets_acked: "Packets acknowledged.",
            packets_lost: "Packets declared lost (SACK gap or timeout).",
            retransmits: "Retransmissions sent on this path.",
            ce_marks as "ecn_ce_marks": "ECN CE marks the peer echoed.",
            failures: "Times declared failed and moved to a new source port.",
            moves: "Times moved to a new source port because the route stayed congested or was slow.",
            slow_moves: "Moves begun because the route was slow: its RTT far above the other paths'.",
        );
        let path_gauges: Vec<Gauge<PathStats>> = vec![
            (
                gauge(
                    "metaroce_path_srtt_seconds",
                    "Smoothed RTT (0 before a sample).",
                    p,
                )?,
                |s| s.srtt_ns as f64 * NS,
            ),
            (
                gauge(
                    "metaroce_path_cwnd_bytes",
                    "The path's congestion window.",
                    p,
                )?,
                |s| s.cwnd as f64,
            ),
            (
                gauge("metaroce_path_in_flight_bytes", "Bytes in flight.", p)?,
                |s| s.in_flight as f64,
            ),
            (
                gauge("metaroce_path_source_port", "UDP source port in use.", p)?,
                |s| f64::from(s.src_port),
            ),
            (
                gauge(
                    "metaroce_path_plane",
                    "Plane the path runs on (0 first).",
                    p,
                )?,
                |s| f64::from(s.plane),
            ),
            (
                gauge("metaroce_path_state", "Path state: 0 active, 1 probing.", p)?,
                |s| match s.state {
                    Some(PathState::Probing) => 1.0,
                    _ => 0.0,
                },
            ),
        ];
        let driver = counters!(DriverStats, &[], "metaroce_driver_";
            datagrams_sent: "Datagrams handed to the kernel.",
            datagrams_received: "Datagrams read from the kernel.",
            stamped: "Receives that came with the kernel's arrival timestamp.",
            gso_sends: "Sends that carried several datagrams (UDP GSO).",
            gro_batches: "Receives that returned several datagrams (GRO).",
            send_errors: "Sends the kernel refused.",
            recv_dropped: "Received datagrams dropped by the driver.",
            faults_dropped: "Received datagrams the fault injector dropped.",
            faults_duplicated: "Received datagrams the fault injector duplicated.",
            faults_delayed: "Received datagrams the fault injector held back.",
            zero_copy_sends: "Sends with zero copy (io_uring).",
            gathered_sends: "Sends whose payloads the kernel read straight from their memory regions (io_uring).",
            busy_polls: "Turns whose busy poll found work before they slept.",
            late_drains: "Extra rounds of receive buffers read before timers that ran late (io_uring).",
            idle_turns: "Turns that made no system call: nothing to submit, wait for or collect (io_uring).",
            xdp_redirected: "Frames the XDP program redirected to the AF_XDP socket (af_xdp).",
            xdp_passed: "Frames the XDP program passed on to the kernel (af_xdp).",
            xdp_rx_dropped: "Frames the kernel dropped on the way to the AF_XDP socket (af_xdp).",
            xdp_rx_ring_full: "Frames dropped because the AF_XDP receive ring was full (af_xdp).",
            xdp_fill_ring_empty: "Frames dropped because the fill ring had no frame to receive into (af_xdp).",
            xdp_invalid_descs: "Ring descriptors the kernel refused as invalid (af_xdp).",
            xdp_tx_dropped: "Kicks of the transmit ring after which the device had dropped a frame (af_xdp).",
            xdp_tx_full: "Turns that found no free transmit frame (af_xdp).",
            route_lookups: "Route and neighbour lookups over rtnetlink (af_xdp).",
            kernel_sent: "Datagrams sent through the kernel's UDP socket while a next hop was unresolved (af_xdp).",
            kernel_received: "Datagrams read from the kernel's UDP socket, not redirected by the program (af_xdp).",
        );
        let driver_gauges: Vec<Gauge<DriverStats>> = vec![
            (
                gauge(
                    "metaroce_driver_xdp_fill_level",
                    "Frames in the AF_XDP fill ring, ready to receive into (af_xdp).",
                    &[],
                )?,
                |s| s.xdp_fill_level as f64,
            ),
            (
                gauge(
                    "metaroce_driver_xdp_tx_free",
                    "AF_XDP transmit frames free (af_xdp).",
                    &[],
                )?,
                |s| s.xdp_tx_free as f64,
            ),
        ];
        let plane_received = counter(
            "metaroce_driver_plane_datagrams_received_total",
            "Datagrams read from the kernel on each plane's address.",
            &["plane"],
        )?;
        Ok(Metrics {
            plane_received,
            registry,
            name: name.to_string(),
            endpoint,
            rejects,
            open,
            conn_counters,
            conn_gauges,
            path_counters,
            path_gauges,
            driver,
            driver_gauges,
            seen_conns: HashSet::new(),
            seen_paths: HashSet::new(),
        })
    }

    /// The registry the metrics are in (a cheap clone shares it), e.g. for
    /// [`MetricsServer::start`].
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// Refreshes every metric from `ep`'s stats, its connections' and their
    /// paths'; removes the series of connections (and paths) that are gone.
    pub fn update(&mut self, ep: &Endpoint) {
        let s = ep.stats();
        for (c, f) in &self.endpoint {
            set_counter(&c.with_label_values::<&str>(&[]), f(&s));
        }
        for (r, label) in REASONS {
            set_counter(&self.rejects.with_label_values(&[label]), s.rejects.get(r));
        }
        let mut conns = HashSet::new();
        let mut paths = HashSet::new();
        for h in ep.connections() {
            let Some(cs) = ep.connection_stats(h) else {
                continue;
            };
            let conn = h.index().to_string();
            let cl = [conn.as_str()];
            for (c, f) in &self.conn_counters {
                set_counter(&c.with_label_values(&cl), f(&cs));
            }
            for (g, f) in &self.conn_gauges {
                g.with_label_values(&cl).set(f(&cs));
            }
            for ps in &cs.paths {
                let path = ps.id.to_string();
                let pl = [conn.as_str(), path.as_str()];
                for (c, f) in &self.path_counters {
                    set_counter(&c.with_label_values(&pl), f(ps));
                }
                for (g, f) in &self.path_gauges {
                    g.with_label_values(&pl).set(f(ps));
                }
                paths.insert((conn.clone(), path));
            }
            conns.insert(conn);
        }
        self.open
            .with_label_values::<&str>(&[])
            .set(conns.len() as f64);
        for gone in self.seen_conns.difference(&conns) {
            for (c, _) in &self.conn_counters {
                let _ = c.remove_label_values(&[gone.as_str()]);
            }
            for (g, _) in &self.conn_gauges {
                let _ = g.remove_label_values(&[gone.as_str()]);
            }
        }
        for (conn, path) in self.seen_paths.difference(&paths) {
            let pl = [conn.as_str(), path.as_str()];
            for (c, _) in &self.path_counters {
                let _ = c.remove_label_values(&pl);
            }
            for (g, _) in &self.path_gauges {
                let _ = g.remove_label_values(&pl);
            }
        }
        self.seen_conns = conns;
        self.seen_paths = paths;
    }

    /// Refreshes the `metaroce_driver_*` counters from a driver's
    /// [`stats`](crate::IoDriver::stats).
    pub fn update_driver(&mut self, s: &DriverStats) {
        for (c, f) in &self.driver {
            set_counter(&c.with_label_values::<&str>(&[]), f(s));
        }
        for (g, f) in &self.driver_gauges {
            g.with_label_values::<&str>(&[]).set(f(s));
        }
        for (k, &n) in s.received_per_plane.iter().enumerate() {
            if n > 0 {
                set_counter(&self.plane_received.with_label_values(&[&k.to_string()]), n);
            }
        }
    }

    /// Everything in the registry, in the text exposition format.
    pub fn encode(&self) -> String {
        encode(&self.registry)
    }
}

fn encode(registry: &Registry) -> String {
    let mut out = Vec::new();
    // Encoding gathered families into a Vec cannot fail.
    let _ = TextEncoder::new().encode(&registry.gather(), &mut out);
    String::from_utf8(out).unwrap_or_default()
}

/// What a [`MetricsServer`] calls before it answers each scrape, to bring
/// the registry's values up to date (see
/// [`Device::metrics_refresher`](crate::Device::metrics_refresher)).
pub type Refresh = Box<dyn Fn() + Send + 'static>;

/// A tiny HTTP server for Prometheus scrapes: `GET /metrics` answers the
/// registry in the text exposition format, anything else 404.
///
/// One background thread, one request per connection, handled one at a time
/// with 2 s read and write timeouts and requests of at most 8 KiB, so a slow
/// or hostile client delays scrapes but never grows the server. Dropping the
/// server stops the thread and closes the socket.
///
/// ```no_run
/// use metaroce_io::{Metrics, MetricsServer};
/// let m = Metrics::new("node1").unwrap();
/// let server = MetricsServer::start("127.0.0.1:9464", m.registry().clone()).unwrap();
/// println!("scrape http://{}/metrics", server.local_addr());
/// ```
#[derive(Debug)]
pub struct MetricsServer {
    local: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl MetricsServer {
    /// Binds `addr` (port 0: any free port) and serves `registry` from a
    /// background thread, as it is at the time of each scrape.
    pub fn start(addr: impl ToSocketAddrs, registry: Registry) -> std::io::Result<Self> {
        Self::start_with_refresh(addr, registry, Box::new(|| {}))
    }

    /// Like [`start`](Self::start), and calls `refresh` before it answers
    /// each scrape, so that the values are current when scraped (the
    /// server thread waits for it).
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use metaroce_io::{Device, DriverConfig, Metrics, MetricsServer};
    /// let metrics = Metrics::new("node1")?;
    /// let registry = metrics.registry().clone();
    /// let dev = Device::open_with_metrics(DriverConfig::new("0.0.0.0:4791".parse()?), metrics).await?;
    /// let server = MetricsServer::start_with_refresh("0.0.0.0:9464", registry, dev.metrics_refresher())?;
    /// # let _ = server; Ok(()) }
    /// ```
    pub fn start_with_refresh(
        addr: impl ToSocketAddrs,
        registry: Registry,
        refresh: Refresh,
    ) -> std::io::Result<Self> {
        let listener = TcpListener::bind(addr)?;
        let local = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let s2 = stop.clone();
        let thread = std::thread::Builder::new()
            .name("metaroce-metrics".into())
            .spawn(move || {
                for conn in listener.incoming() {
                    if s2.load(Ordering::Acquire) {
                        break;
                    }
                    match conn {
                        Ok(c) => {
                            if let Err(e) = serve(c, &registry, &refresh) {
                                tracing::debug!(error = %e, "metrics request failed");
                            }
                        }
                        Err(e) => tracing::debug!(error = %e, "metrics accept failed"),
                    }
                }
            })?;
        Ok(MetricsServer {
            local,
            stop,
            thread: Some(thread),
        })
    }

    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Wake the blocking accept; it sees the flag and returns.
        let mut wake = self.local;
        if wake.ip().is_unspecified() {
            wake.set_ip(match wake {
                SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
                SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
            });
        }
        let _ = TcpStream::connect_timeout(&wake, Duration::from_secs(1));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Reads one request (head only) and answers it.
fn serve(mut c: TcpStream, registry: &Registry, refresh: &Refresh) -> std::io::Result<()> {
    c.set_read_timeout(Some(Duration::from_secs(2)))?;
    c.set_write_timeout(Some(Duration::from_secs(2)))?;
    let mut buf = [0u8; 8192];
    let mut n = 0;
    while n < buf.len() {
        let k = c.read(&mut buf[n..])?;
        if k == 0 {
            break;
        }
        n += k;
        if buf[..n].windows(4).any(|w| w == b"\r\n\r\n") {
            break;
        }
    }
    let head = String::from_utf8_lossy(&buf[..n]);
    let mut words = head.split_whitespace();
    let (method, path) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
    let path = path.split('?').next().unwrap_or("");
    let (status, ctype, body) = if method == "GET" && path == "/metrics" {
        refresh();
        (
            "200 OK",
            TextEncoder::new().format_type().to_string(),
            encode(registry),
        )
    } else {
        (
            "404 Not Found",
            "text/plain".to_string(),
            "not found\n".to_string(),
        )
    };
    write!(
        c,
        "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    c.flush()
}
