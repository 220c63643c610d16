//! `metaroce perf client`'s control channel on paths that drop packets
//! silently, without root: a listener whose accept queue is full stands
//! for a blackholed path (the kernel drops every SYN it gets), one that
//! accepts and never answers for an exchange that stalls. The client gives
//! up within `--connect-timeout`, having tried from a new source port each
//! time, and names every attempt; a `perf server` whose client's old
//! control connection hangs serves the client's new one at once.

mod common;

use common::{assert_success, bounded, server_exit, start_server, BIN};
use socket2::{Domain, Protocol, Socket, Type};
use std::collections::HashSet;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Command, Output};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A loopback address where every TCP connect times out: a listener with
/// a backlog of 0 and one connection never accepted filling its queue.
/// Keep the returned sockets alive.
fn blackhole() -> (Socket, TcpStream, SocketAddr) {
    let s = Socket::new(Domain::IPV4, Type::STREAM, Some(Protocol::TCP)).unwrap();
    s.bind(&SocketAddr::from(([127, 0, 0, 1], 0)).into())
        .unwrap();
    s.listen(0).unwrap();
    let addr = s.local_addr().unwrap().as_socket().unwrap();
    let filler = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).unwrap();
    (s, filler, addr)
}

/// A listener that accepts and never says a word; its address and the
/// source ports of the connections it took.
fn silent() -> (SocketAddr, Arc<Mutex<Vec<u16>>>) {
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

/// Runs `metaroce perf client ADDR --connect-timeout SECS EXTRA...`;
/// returns its output and how long it took.
fn client(addr: &str, secs: &str, extra: &[&str]) -> (Output, Duration) {
    let mut cmd = Command::new(BIN);
    cmd.args(["perf", "client", addr, &format!("--connect-timeout={secs}")])
        .args(extra);
    let t0 = Instant::now();
    let out = bounded(cmd, Duration::from_secs(60));
    (out, t0.elapsed())
}

/// The attempt lines of a client's error (`attempt N: from source port
/// P, ...`): their numbers, ports and text.
fn attempts(stderr: &str) -> Vec<(usize, u16, String)> {
    stderr
        .lines()
        .filter_map(|l| {
            let rest = l.trim().strip_prefix("attempt ")?;
            let (n, rest) = rest.split_once(": from source port ")?;
            let (port, _) = rest.split_once(',')?;
            Some((n.parse().ok()?, port.parse().ok()?, l.to_string()))
        })
        .collect()
}

#[test]
fn with_nothing_reachable_the_client_gives_up_within_the_deadline_naming_each_attempt() {
    let (_bh, _filler, hole) = blackhole();
    let addr = hole.to_string();
    let (out, took) = client(&addr, "3", &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    // 3 s, and the process's start and end.
    assert!(took < Duration::from_millis(4500), "took {took:?}: {err}");
    assert!(
        err.contains(&format!(
            "cannot reach metaroce perf server at {addr}: no attempt succeeded within 3.0 s (--connect-timeout)"
        )),
        "{err}"
    );
    // 1 s, 1.25 s, then what is left: three attempts, each from a port of
    // its own, each a connect that timed out.
    let tried = attempts(&err);
    assert_eq!(tried.len(), 3, "{err}");
    let ports: HashSet<u16> = tried.iter().map(|t| t.1).collect();
    assert_eq!(ports.len(), tried.len(), "a source port used twice: {err}");
    for (i, (n, _, line)) in tried.iter().enumerate() {
        assert_eq!(*n, i + 1, "{err}");
        assert!(line.contains("connect: timed out"), "{line}");
    }
    assert!(err.contains("attempts, from 3 source ports"), "{err}");
    // Each retry is logged as it happens.
    assert!(err.contains("trying again from a new source port"), "{err}");
}

#[test]
fn a_stalled_exchange_is_retried_from_new_source_ports_until_the_deadline() {
    let (quiet, seen) = silent();
    let addr = quiet.to_string();
    let (out, took) = client(&addr, "2.5", &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(took < Duration::from_secs(4), "took {took:?}: {err}");
    let tried = attempts(&err);
    assert!(tried.len() >= 2, "{err}");
    for (_, _, line) in &tried {
        assert!(
            line.contains("control exchange: control connection stalled: no Welcome within"),
            "{line}"
        );
    }
    // The listener saw each attempt, each from its own port.
    let seen = seen.lock().unwrap().clone();
    let ports: Vec<u16> = tried.iter().map(|t| t.1).collect();
    assert_eq!(seen, ports, "{err}");
    assert_eq!(seen.iter().collect::<HashSet<_>>().len(), seen.len());
}

#[test]
fn a_server_serves_a_clients_new_connection_while_its_old_one_hangs() {
    let mut cmd = Command::new(BIN);
    cmd.args([
        "perf",
        "server",
        "--bind",
        "127.0.0.1:0",
        "--once",
        "--backend",
        "portable",
    ]);
    let (srv, addr) = start_server(cmd);
    // The client's first control connection: accepted, then silent, and
    // never closed (as when its path dies). The server would wait 10 s
    // for its Hello ...
    let _hung = TcpStream::connect(&addr).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    // ... but the same host's new connection takes over at once, and is
    // the run `--once` serves.
    let (out, took) = client(
        &addr,
        "10",
        &["-D", "0.3", "-s", "4K", "--backend", "portable", "--json"],
    );
    assert_success(&out, "client failed: ");
    assert!(took < Duration::from_secs(5), "took {took:?}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert_eq!(v["corrupt_bytes"], 0, "{v}");
    assert!(v["verified_bytes"].as_u64().unwrap() > 0, "{v}");
    assert!(
        server_exit(srv, Duration::from_secs(20)),
        "the server failed"
    );
}

#[test]
fn bad_connect_timeouts_are_refused() {
    for bad in ["0", "-1", "x", "inf"] {
        let (out, _) = client("127.0.0.1:1", bad, &[]);
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("--connect-timeout"), "{bad}: {err}");
    }
}
