//! `metaroce perf server` / `metaroce perf client` as two processes over
//! loopback: every byte verified for each operation, and clear errors for an
//! unreachable server and a port in use. Every child is bounded in time and
//! killed if a test fails.

use std::io::{BufRead, BufReader};
use std::net::UdpSocket;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_metaroce");

/// A child process killed when dropped (a failing test leaves nothing behind).
struct Guard(Child);

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `metaroce perf server --bind 127.0.0.1:0 --once` and reads the
/// address it prints on its first line.
fn start_server(extra: &[&str]) -> (Guard, String) {
    let mut child = Command::new(BIN)
        .args(["perf", "server", "--bind", "127.0.0.1:0", "--once"])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the server");
    let stdout = child.stdout.take().unwrap();
    let guard = Guard(child);
    let mut rd = BufReader::new(stdout);
    let mut line = String::new();
    rd.read_line(&mut line)
        .expect("read the server's first line");
    // Keep draining what the server prints so that it never blocks on us.
    std::thread::spawn(move || std::io::copy(&mut rd, &mut std::io::sink()));
    let addr = line
        .split("listening on ")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .unwrap_or_else(|| panic!("no address in {line:?}"))
        .to_string();
    (guard, addr)
}

/// Runs `metaroce` with `args`, killed after `limit`.
fn run_bounded(args: &[&str], limit: Duration) -> Output {
    let mut child = Command::new(BIN)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run metaroce");
    let t0 = Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            return child.wait_with_output().unwrap();
        }
        if t0.elapsed() > limit {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "metaroce {args:?} did not finish within {limit:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits for the `--once` server to exit and says whether it succeeded.
fn server_exit(mut g: Guard, limit: Duration) -> bool {
    let t0 = Instant::now();
    while t0.elapsed() < limit {
        if let Some(st) = g.0.try_wait().unwrap() {
            return st.success();
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("the --once server did not exit within {limit:?}");
}

#[test]
fn write_read_send_between_processes() {
    for op in ["write", "read", "send"] {
        let (srv, addr) = start_server(&["--backend", "portable"]);
        let out = run_bounded(
            &[
                "perf",
                "client",
                &addr,
                "--op",
                op,
                "-D",
                "0.3",
                "-s",
                "16K",
                "-q",
                "2",
                "--backend",
                "portable",
                "--json",
            ],
            Duration::from_secs(60),
        );
        assert!(
            out.status.success(),
            "client ({op}) failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
        assert_eq!(v["op"], op);
        assert_eq!(v["qps"], 2);
        assert_eq!(v["corrupt_bytes"], 0, "{v}");
        let iters = v["iterations"].as_u64().unwrap();
        assert!(iters > 0, "{v}");
        assert_eq!(
            v["verified_bytes"].as_u64().unwrap(),
            iters * v["msg_size"].as_u64().unwrap(),
            "{v}"
        );
        assert!(
            server_exit(srv, Duration::from_secs(20)),
            "the server failed ({op})"
        );
    }
}

#[test]
fn default_backend_single_qp_write() {
    let (srv, addr) = start_server(&[]);
    let out = run_bounded(
        &["perf", "client", &addr, "-D", "0.3", "--json"],
        Duration::from_secs(60),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["corrupt_bytes"], 0, "{v}");
    assert_eq!(
        v["verified_bytes"].as_u64().unwrap(),
        v["iterations"].as_u64().unwrap() * v["msg_size"].as_u64().unwrap()
    );
    assert!(server_exit(srv, Duration::from_secs(20)));
}

#[test]
fn unreachable_server_is_a_clear_error() {
    // A port nobody listens on: bind one, note it, let it go.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let out = run_bounded(&["perf", "client", &addr], Duration::from_secs(20));
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("cannot reach metaroce perf server at {addr}")),
        "{err}"
    );
}

#[test]
fn port_in_use_is_a_clear_error() {
    let held = UdpSocket::bind("127.0.0.1:0").unwrap();
    let addr = held.local_addr().unwrap().to_string();
    let out = run_bounded(
        &["perf", "server", "--bind", &addr, "--once"],
        Duration::from_secs(20),
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("port in use"), "{err}");
    assert!(err.contains(&addr), "{err}");
}

#[test]
fn bad_client_flags_are_refused() {
    let out = run_bounded(
        &["perf", "client", "127.0.0.1:1", "-q", "0"],
        Duration::from_secs(20),
    );
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("bad flags"));
}
