//! A two-sided SEND/RECV request/response server on the async verbs API
//! ([`metaroce_io::Device`]), with its clients.
//!
//! ```sh
//! # server and 4 clients in one process, over loopback (the default)
//! cargo run --release --example send_recv_server
//! # or on two hosts
//! cargo run --release --example send_recv_server -- --listen 0.0.0.0:7471
//! cargo run --release --example send_recv_server -- --connect SERVER:7471 [--requests N] [--size BYTES]
//! ```
//!
//! The service is deliberately trivial (the reply is the request's bytes
//! reversed, tagged with the request's number as immediate data) so that
//! every byte can be checked both ways; what the example shows is the shape
//! of a verbs server:
//!
//! - the out-of-band exchange, here over TCP on the same port number as the
//!   UDP endpoint: the client sends its [`QpEndpoint`], the server lets it
//!   open the transport connection, then answers with its own once its QP
//!   is connected and its receives are posted (so no request can arrive
//!   before a receive is there for it);
//! - a pool of `DEPTH` posted receives per client, each re-posted as soon
//!   as its request is copied out;
//! - replies posted to a send completion queue, and a reply buffer reused
//!   only once the send from it has completed;
//! - a client that keeps `DEPTH` requests in flight (never more than the
//!   server has receives posted), and whose connection close ends the
//!   server's session (its receives complete flushed).

use metaroce_io::{
    AccessFlags, ApiError, Connection, Device, DriverConfig, MemoryRegion, QpEndpoint, QueuePair,
    RecvWr, RegionBuf, SendOp, SendWr, WcOpcode, WcStatus,
};
use std::error::Error;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Mutex;

/// Requests in flight per client, and receives posted per client.
const DEPTH: usize = 16;
/// Largest request (and reply).
const MAX: usize = 64 << 10;

type Result<T> = std::result::Result<T, Box<dyn Error + Send + Sync>>;

struct Args {
    listen: Option<SocketAddr>,
    connect: Option<SocketAddr>,
    clients: usize,
    requests: u32,
    size: usize,
}

fn args() -> Result<Args> {
    let mut a = Args {
        listen: None,
        connect: None,
        clients: 4,
        requests: 20_000,
        size: 4096,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--listen" => a.listen = Some(value()?.parse()?),
            "--connect" => a.connect = Some(tokio_lookup(&value()?)?),
            "--clients" => a.clients = value()?.parse()?,
            "--requests" => a.requests = value()?.parse()?,
            "--size" => a.size = value()?.parse()?,
            other => return Err(format!("unknown flag {other}").into()),
        }
    }
    if a.size == 0 || a.size > MAX {
        return Err(format!("--size must be 1..={MAX}").into());
    }
    Ok(a)
}

fn tokio_lookup(s: &str) -> Result<SocketAddr> {
    use std::net::ToSocketAddrs;
    Ok(s.to_socket_addrs()?
        .find(SocketAddr::is_ipv4)
        .ok_or(format!("{s}: no IPv4 address"))?)
}

/// The request with number `n`: `len` bytes anyone can recompute, and
/// different for every request and offset.
fn request(n: u32, len: usize) -> Vec<u8> {
    let n = n as usize;
    (0..len)
        .map(|i| (n.wrapping_mul(131) ^ i.wrapping_mul(7) ^ (i >> 8)) as u8)
        .collect()
}

/// The service.
fn reply(req: &[u8]) -> Vec<u8> {
    req.iter().rev().copied().collect()
}

// ---------------------------------------------------------------- server --

/// Runs the server on `dev` (its UDP address) and `tcp` (the out-of-band
/// channel) until the process ends.
async fn serve(dev: Device, tcp: TcpListener) -> Result<()> {
    // One transport handshake at a time, so that the connection accepted is
    // the one of the client that asked for it.
    let handshake = Arc::new(Mutex::new(()));
    loop {
        let (stream, from) = tcp.accept().await?;
        let (dev, handshake) = (dev.clone(), handshake.clone());
        tokio::spawn(async move {
            match session(dev, stream, handshake).await {
                Ok(n) => println!("server: {from} done after {n} requests"),
                Err(e) => eprintln!("server: {from}: {e}"),
            }
        });
    }
}

/// One client: returns how many requests it served.
async fn session(dev: Device, mut tcp: TcpStream, handshake: Arc<Mutex<()>>) -> Result<u64> {
    let mut buf = [0u8; QpEndpoint::LEN];
    tcp.read_exact(&mut buf).await?;
    let client = QpEndpoint::from_bytes(&buf)?;
    let conn = {
        let _one = handshake.lock().await;
        tcp.write_all(b"G").await?;
        let conn = tokio::time::timeout(Duration::from_secs(5), dev.accept())
            .await
            .map_err(|_| "the client did not open its connection")??;
        if !same_peer(conn.peer(), client.addr) {
            return Err(format!("expected {}, {} connected", client.addr, conn.peer()).into());
        }
        conn
    };
    let pd = dev.alloc_pd().await?;
    let (send_cq, recv_cq) = (
        dev.create_cq(4 * DEPTH).await?,
        dev.create_cq(4 * DEPTH).await?,
    );
    let qp = pd.create_qp(&send_cq, &recv_cq).await?;
    let inbox = pd
        .reg_mr(RegionBuf::zeroed(DEPTH * MAX), AccessFlags::LOCAL_WRITE)
        .await?;
    let outbox = pd
        .reg_mr(RegionBuf::zeroed(DEPTH * MAX), AccessFlags::NONE)
        .await?;
    qp.connect(&conn, client.qpn()).await?;
    for slot in 0..DEPTH {
        post_recv(&qp, &inbox, slot).await?;
    }
    tcp.write_all(&qp.endpoint().to_bytes()).await?;

    let mut busy = [false; DEPTH];
    let mut served = 0u64;
    loop {
        let wc = recv_cq.next().await?;
        if wc.status != WcStatus::Success {
            // The client closed (flushed receives) or the QP failed.
            return Ok(served);
        }
        let slot = wc.wr_id as usize;
        // Commands run in the order they are issued, so the receive is
        // re-posted after the copy-out, in one round trip to the endpoint.
        let (req, posted) = tokio::join!(
            inbox.read((slot * MAX) as u64, wc.byte_len as usize),
            post_recv(&qp, &inbox, slot)
        );
        let req = req?;
        posted?;
        // The reply buffer of this slot is free once its last send completed.
        for c in send_cq.poll(DEPTH) {
            busy[c.wr_id as usize] = false;
        }
        while busy[slot] {
            let c = send_cq.next().await?;
            if c.status != WcStatus::Success {
                return Ok(served);
            }
            busy[c.wr_id as usize] = false;
        }
        let out = reply(&req);
        let len = out.len() as u32;
        let sge = outbox.sge((slot * MAX) as u64, len)?;
        let imm = wc.imm.unwrap_or(0);
        let (written, posted) = tokio::join!(
            outbox.write((slot * MAX) as u64, out),
            qp.post_send(SendWr::new(slot as u64, SendOp::SendImm(imm), sge))
        );
        written?;
        posted?;
        busy[slot] = true;
        served += 1;
    }
}

fn same_peer(seen: SocketAddr, announced: SocketAddr) -> bool {
    seen.port() == announced.port()
        && (announced.ip().is_unspecified() || seen.ip() == announced.ip())
}

async fn post_recv(
    qp: &QueuePair,
    mr: &MemoryRegion,
    slot: usize,
) -> std::result::Result<(), ApiError> {
    let sge = mr.sge((slot * MAX) as u64, MAX as u32)?;
    qp.post_recv(RecvWr {
        wr_id: slot as u64,
        sge: sge.into(),
    })
    .await
}

// ---------------------------------------------------------------- client --

/// What one client measured.
#[derive(Debug)]
pub struct Report {
    /// Requests answered (and checked).
    pub requests: u32,
    /// Bytes moved, requests and replies.
    pub bytes: u64,
    /// From the first request to the last reply.
    pub elapsed: Duration,
    /// Each request's round trip.
    pub latencies_us: Vec<f64>,
}

/// Connects to the server at `server` (UDP endpoint and TCP port alike)
/// and runs `requests` requests of `size` bytes, each reply checked.
async fn client(server: SocketAddr, requests: u32, size: usize) -> Result<Report> {
    let local = if server.ip().is_loopback() {
        "127.0.0.1:0"
    } else {
        "0.0.0.0:0"
    };
    let dev = Device::open(DriverConfig::new(local.parse()?)).await?;
    let pd = dev.alloc_pd().await?;
    let (send_cq, recv_cq) = (
        dev.create_cq(4 * DEPTH).await?,
        dev.create_cq(4 * DEPTH).await?,
    );
    let qp = pd.create_qp(&send_cq, &recv_cq).await?;
    let reqs = pd
        .reg_mr(RegionBuf::zeroed(DEPTH * MAX), AccessFlags::NONE)
        .await?;
    let replies = pd
        .reg_mr(RegionBuf::zeroed(DEPTH * MAX), AccessFlags::LOCAL_WRITE)
        .await?;

    // Out of band: our QP, the go-ahead, the connection, the server's QP.
    let mut tcp = TcpStream::connect(server).await?;
    tcp.write_all(&qp.endpoint().to_bytes()).await?;
    let mut go = [0u8; 1];
    tcp.read_exact(&mut go).await?;
    let conn: Connection = dev.connect(server).await?;
    let mut buf = [0u8; QpEndpoint::LEN];
    tcp.read_exact(&mut buf).await?;
    qp.connect(&conn, QpEndpoint::from_bytes(&buf)?.qpn())
        .await?;
    for slot in 0..DEPTH {
        post_recv(&qp, &replies, slot).await?;
    }

    let start = Instant::now();
    let mut sent_at = vec![start; DEPTH];
    let mut latencies_us = Vec::with_capacity(requests as usize);
    let (mut sent, mut answered, mut send_done) = (0u32, 0u32, 0u32);
    while answered < requests {
        // A request slot is free once its reply came and its send completed.
        while sent < requests && sent - answered.min(send_done) < DEPTH as u32 {
            let slot = sent as usize % DEPTH;
            let sge = reqs.sge((slot * MAX) as u64, size as u32)?;
            let (written, posted) = tokio::join!(
                reqs.write((slot * MAX) as u64, request(sent, size)),
                qp.post_send(SendWr::new(u64::from(sent), SendOp::SendImm(sent), sge))
            );
            written?;
            posted?;
            sent_at[slot] = Instant::now();
            sent += 1;
        }
        // Whichever comes first: a reply or a send completion (`next` is
        // cancel safe: a completion is taken only by the call that returns it).
        let wc = tokio::select! {
            wc = recv_cq.next() => wc?,
            c = send_cq.next() => {
                check(&c?, WcOpcode::Send)?;
                send_done += 1;
                continue;
            }
        };
        check(&wc, WcOpcode::Recv)?;
        let n = answered;
        if wc.imm != Some(n) {
            return Err(format!("reply {:?} where {n} was due", wc.imm).into());
        }
        let slot = wc.wr_id as usize;
        latencies_us.push(sent_at[n as usize % DEPTH].elapsed().as_secs_f64() * 1e6);
        let (got, posted) = tokio::join!(
            replies.read((slot * MAX) as u64, wc.byte_len as usize),
            post_recv(&qp, &replies, slot)
        );
        if got? != reply(&request(n, size)) {
            return Err(format!("reply {n} differs from the expected bytes").into());
        }
        posted?;
        answered += 1;
    }
    let elapsed = start.elapsed();
    conn.close().await?;
    Ok(Report {
        requests,
        bytes: 2 * u64::from(requests) * size as u64,
        elapsed,
        latencies_us,
    })
}

fn check(wc: &metaroce_io::WorkCompletion, want: WcOpcode) -> Result<()> {
    if wc.status != WcStatus::Success || wc.opcode != want {
        return Err(format!("{:?} completed with {:?}", wc.opcode, wc.status).into());
    }
    Ok(())
}

fn print(reports: &[Report], size: usize) {
    let mut lat: Vec<f64> = reports
        .iter()
        .flat_map(|r| r.latencies_us.iter().copied())
        .collect();
    lat.sort_by(f64::total_cmp);
    let q = |x: f64| {
        lat.get(((lat.len().max(1) - 1) as f64 * x) as usize)
            .copied()
            .unwrap_or(0.0)
    };
    let requests: u32 = reports.iter().map(|r| r.requests).sum();
    let bytes: u64 = reports.iter().map(|r| r.bytes).sum();
    let secs = reports
        .iter()
        .map(|r| r.elapsed.as_secs_f64())
        .fold(0.0, f64::max);
    println!(
        "{} client(s), {requests} requests of {size} B, every reply verified: {:.0} requests/s, {:.2} Gbit/s both ways, latency p50 {:.1} us, p99 {:.1} us",
        reports.len(),
        f64::from(requests) / secs,
        bytes as f64 * 8.0 / secs / 1e9,
        q(0.5),
        q(0.99),
    );
}

#[tokio::main]
async fn main() -> Result<()> {
    let a = args()?;
    if let Some(addr) = a.listen {
        let dev = Device::open(DriverConfig::new(addr)).await?;
        let tcp = TcpListener::bind(dev.local_addr()).await?;
        println!(
            "serving on {} ({}); Ctrl-C to stop",
            dev.local_addr(),
            dev.backend()
        );
        return serve(dev, tcp).await;
    }
    if let Some(server) = a.connect {
        let r = client(server, a.requests, a.size).await?;
        print(&[r], a.size);
        return Ok(());
    }
    let reports = loopback(a.clients, a.requests, a.size).await?;
    print(&reports, a.size);
    Ok(())
}

/// Self-contained: a server and `clients` clients in this process, over
/// loopback, `requests` requests in all.
pub async fn loopback(clients: usize, requests: u32, size: usize) -> Result<Vec<Report>> {
    let dev = Device::open(DriverConfig::new("127.0.0.1:0".parse()?)).await?;
    let tcp = TcpListener::bind(dev.local_addr()).await?;
    let server = dev.local_addr();
    println!("server on {server} ({}), {clients} clients", dev.backend());
    let serving = tokio::spawn(serve(dev, tcp));
    let per = requests / clients.max(1) as u32;
    let runs: Vec<_> = (0..clients)
        .map(|_| tokio::spawn(client(server, per, size)))
        .collect();
    let mut reports = Vec::new();
    for r in runs {
        reports.push(r.await??);
    }
    serving.abort();
    Ok(reports)
}
