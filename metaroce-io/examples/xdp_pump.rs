//! The ceiling of a path: UDP datagrams pumped with no protocol, over an
//! AF_XDP socket ([`RawXdp`], the af_xdp driver's own socket, program and
//! headers) or over a kernel UDP socket, one datagram per call, each side
//! busy polling. `scripts/xdp-compare.sh` runs it across `metaroce fabric`
//! beside `metaroce perf` on both backends.
//!
//! ```text
//! xdp_pump sink   --backend af_xdp|udp --bind IP:PORT [--seconds S]
//! xdp_pump source --backend af_xdp|udp --bind IP:0 --to IP:PORT --size BYTES [--seconds S]
//! xdp_pump echo   --backend af_xdp|udp --bind IP:PORT [--seconds S]
//! xdp_pump ping   --backend af_xdp|udp --bind IP:0 --to IP:PORT [--count N]
//! ```
//!
//! `sink` prints `{"packets", "bytes", "seconds", "pps", "gbps"}` counted
//! from its first datagram for `--seconds` (default 3); `ping` prints the
//! p50 and p99 of `--count` 8-byte round trips (default 20,000) against an
//! `echo`. Linux, root (AF_XDP).

#[cfg(target_os = "linux")]
fn main() {
    if let Err(e) = linux::run() {
        eprintln!("xdp_pump: {e}");
        std::process::exit(1);
    }
}

#[cfg(not(target_os = "linux"))]
fn main() {
    eprintln!("xdp_pump: AF_XDP exists on Linux only");
}

#[cfg(target_os = "linux")]
mod linux {
    use metaroce_io::xdp::RawXdp;
    use metaroce_io::DriverConfig;
    use std::net::{SocketAddr, SocketAddrV4, UdpSocket};
    use std::time::{Duration, Instant};

    type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

    /// One side: an AF_XDP socket or a kernel UDP socket.
    enum Side {
        Xdp(Box<RawXdp>),
        Udp(UdpSocket),
    }

    impl Side {
        fn open(backend: &str, bind: SocketAddrV4) -> Result<Side> {
            match backend {
                "af_xdp" => {
                    let cfg = DriverConfig::new(SocketAddr::V4(bind));
                    let raw = RawXdp::open(&cfg)?;
                    eprintln!("af_xdp: {} on {}", raw.info(), raw.local_addr());
                    Ok(Side::Xdp(Box::new(raw)))
                }
                "udp" => {
                    let s = UdpSocket::bind(bind)?;
                    s.set_nonblocking(true)?;
                    Ok(Side::Udp(s))
                }
                other => Err(format!("unknown backend {other} (af_xdp or udp)").into()),
            }
        }

        /// Sends up to `n` datagrams; how many went.
        fn send(&mut self, to: SocketAddrV4, payload: &[u8], n: usize) -> Result<usize> {
            match self {
                Side::Xdp(r) => Ok(r.send(to, payload, n)?),
                Side::Udp(s) => {
                    let mut k = 0;
                    while k < n {
                        match s.send_to(payload, to) {
                            Ok(_) => k += 1,
                            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                            Err(e) => return Err(e.into()),
                        }
                    }
                    Ok(k)
                }
            }
        }

        /// Calls `f` with each datagram waiting (up to 64); how many.
        fn recv(&mut self, buf: &mut [u8], mut f: impl FnMut(SocketAddrV4, &[u8])) -> Result<u32> {
            match self {
                Side::Xdp(r) => Ok(r.recv(64, f)),
                Side::Udp(s) => {
                    let mut k = 0;
                    while k < 64 {
                        match s.recv_from(buf) {
                            Ok((n, SocketAddr::V4(from))) => {
                                f(from, &buf[..n]);
                                k += 1;
                            }
                            Ok(_) => {}
                            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                            Err(e) => return Err(e.into()),
                        }
                    }
                    Ok(k)
                }
            }
        }
    }

    fn arg(args: &[String], name: &str) -> Option<String> {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1).cloned())
    }

    pub fn run() -> Result<()> {
        let args: Vec<String> = std::env::args().skip(1).collect();
        let role = args.first().cloned().unwrap_or_default();
        let backend = arg(&args, "--backend").unwrap_or_else(|| "af_xdp".into());
        let bind: SocketAddrV4 = arg(&args, "--bind").ok_or("--bind IP:PORT")?.parse()?;
        let secs: f64 = arg(&args, "--seconds").map_or(Ok(3.0), |s| s.parse())?;
        let to =
            || -> Result<SocketAddrV4> { Ok(arg(&args, "--to").ok_or("--to IP:PORT")?.parse()?) };
        let mut side = Side::open(&backend, bind)?;
        let mut buf = vec![0u8; 65536];
        match role.as_str() {
            "sink" => {
                let (mut packets, mut bytes) = (0u64, 0u64);
                let mut first: Option<Instant> = None;
                let mut last = Instant::now();
                let idle_limit = Instant::now() + Duration::from_secs(30);
                loop {
                    let n = side.recv(&mut buf, |_, p| {
                        packets += 1;
                        bytes += p.len() as u64;
                    })?;
                    if n > 0 {
                        last = Instant::now();
                        first.get_or_insert(last);
                    }
                    match first {
                        Some(t0) if t0.elapsed().as_secs_f64() >= secs => break,
                        None if Instant::now() > idle_limit => return Err("nothing arrived".into()),
                        _ => {}
                    }
                }
                let s = last.duration_since(first.unwrap()).as_secs_f64().max(1e-9);
                println!(
                    "{{\"backend\": \"{backend}\", \"packets\": {packets}, \"bytes\": {bytes}, \"seconds\": {s:.6}, \"pps\": {:.1}, \"gbps\": {:.4}}}",
                    packets as f64 / s,
                    bytes as f64 * 8.0 / s / 1e9
                );
            }
            "source" => {
                let to = to()?;
                let size: usize = arg(&args, "--size").map_or(Ok(64), |s| s.parse())?;
                let payload = vec![0x5au8; size];
                let end = Instant::now() + Duration::from_secs_f64(secs + 1.0);
                let mut sent = 0u64;
                while Instant::now() < end {
                    sent += side.send(to, &payload, 64)? as u64;
                    // Give the transmit ring's frames back as they complete.
                    side.recv(&mut buf, |_, _| {})?;
                }
                eprintln!("source: {sent} datagrams of {size} bytes");
            }
            "echo" => {
                let end = Instant::now() + Duration::from_secs_f64(secs.max(60.0));
                let mut back: Vec<(SocketAddrV4, Vec<u8>)> = Vec::new();
                while Instant::now() < end {
                    side.recv(&mut buf, |from, p| back.push((from, p.to_vec())))?;
                    for (from, p) in back.drain(..) {
                        while side.send(from, &p, 1)? == 0 {}
                    }
                }
            }
            "ping" => {
                let to = to()?;
                let count: usize = arg(&args, "--count").map_or(Ok(20_000), |s| s.parse())?;
                let mut rtts = Vec::with_capacity(count);
                let payload = [7u8; 8];
                // Warm up: the next hop resolved, both sides awake.
                for k in 0..count + 1000 {
                    let t0 = Instant::now();
                    while side.send(to, &payload, 1)? == 0 {}
                    let mut got = false;
                    while !got {
                        side.recv(&mut buf, |_, _| got = true)?;
                        if t0.elapsed() > Duration::from_secs(1) {
                            break;
                        }
                    }
                    if got && k >= 1000 {
                        rtts.push(t0.elapsed().as_secs_f64() * 1e6);
                    }
                }
                rtts.sort_by(f64::total_cmp);
                let q = |f: f64| {
                    rtts.get((rtts.len() as f64 * f) as usize)
                        .copied()
                        .unwrap_or(f64::NAN)
                };
                println!(
                    "{{\"backend\": \"{backend}\", \"round_trips\": {}, \"p50_us\": {:.2}, \"p99_us\": {:.2}}}",
                    rtts.len(),
                    q(0.5),
                    q(0.99)
                );
            }
            _ => return Err("role: sink, source, echo or ping".into()),
        }
        Ok(())
    }
}
