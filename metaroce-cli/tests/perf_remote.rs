//! `metaroce perf server` / `metaroce perf client` as two processes over
//! loopback: every byte verified for each operation, and clear errors for an
//! unreachable server and a port in use. Every child is bounded in time and
//! killed if a test fails.

mod common;

use common::{
    assert_all_verified, assert_success, bounded, server_exit, start_server as spawn_server, Guard,
    BIN,
};
use std::net::UdpSocket;
use std::process::{Command, Output};
use std::time::Duration;

/// Starts `metaroce perf server --bind 127.0.0.1:0 --once` and reads the
/// address it prints on its first line.
fn start_server(extra: &[&str]) -> (Guard, String) {
    let mut cmd = Command::new(BIN);
    cmd.args(["perf", "server", "--bind", "127.0.0.1:0", "--once"])
        .args(extra);
    spawn_server(cmd)
}

/// Runs `metaroce` with `args`, killed after `limit`.
fn run_bounded(args: &[&str], limit: Duration) -> Output {
    let mut cmd = Command::new(BIN);
    cmd.args(args);
    bounded(cmd, limit)
}

/// Runs `metaroce perf client ADDR --json` with `extra` flags (bounded to
/// 60 s), checks it succeeded and returns its JSON report.
fn client_json(addr: &str, extra: &[&str]) -> serde_json::Value {
    let mut args = vec!["perf", "client", addr, "--json"];
    args.extend_from_slice(extra);
    let out = run_bounded(&args, Duration::from_secs(60));
    assert_success(&out, format!("client {extra:?} failed: "));
    serde_json::from_slice(&out.stdout).expect("one JSON object")
}

/// Short runs of 16 KiB messages on two QPs, on the portable backend.
const SHORT_PORTABLE: [&str; 8] = ["-D", "0.3", "-s", "16K", "-q", "2", "--backend", "portable"];

#[test]
fn write_read_send_between_processes() {
    for op in ["write", "read", "send"] {
        let (srv, addr) = start_server(&["--backend", "portable"]);
        let v = client_json(&addr, &[&["--op", op][..], &SHORT_PORTABLE].concat());
        assert_eq!(v["op"], op);
        assert_eq!(v["qps"], 2);
        assert_all_verified(&v);
        assert!(
            server_exit(srv, Duration::from_secs(20)),
            "the server failed ({op})"
        );
    }
}

#[test]
fn default_backend_single_qp_write() {
    let (srv, addr) = start_server(&[]);
    let v = client_json(&addr, &["-D", "0.3"]);
    assert_eq!(v["corrupt_bytes"], 0, "{v}");
    assert_eq!(
        v["verified_bytes"].as_u64().unwrap(),
        v["iterations"].as_u64().unwrap() * v["msg_size"].as_u64().unwrap()
    );
    assert!(server_exit(srv, Duration::from_secs(20)));
}

#[test]
fn the_smaller_mtu_of_client_and_server_is_used() {
    // A server at the default MTU holds a jumbo client to it; one with
    // jumbo datagrams too lets it have them.
    for (server_mtu, used) in [("4160", 4160), ("8256", 8256)] {
        let (srv, addr) = start_server(&["--mtu", server_mtu]);
        let v = client_json(&addr, &["-D", "0.3", "--mtu", "8256"]);
        assert_eq!(v["mtu"], used, "{v}");
        assert_eq!(v["mtu_asked"], 8256, "{v}");
        assert_eq!(v["corrupt_bytes"], 0, "{v}");
        assert!(v["verified_bytes"].as_u64().unwrap() > 0, "{v}");
        assert!(server_exit(srv, Duration::from_secs(20)));
    }
}

#[test]
fn all_sizes_against_a_server_are_a_run_each() {
    // A server that serves run after run (no --once; the guard ends it).
    let mut cmd = Command::new(BIN);
    cmd.args(["perf", "server", "--bind", "127.0.0.1:0"]);
    let (_srv, addr) = spawn_server(cmd);
    let out = run_bounded(
        &["perf", "client", &addr, "--json", "-a", "-D", "0.02"],
        Duration::from_secs(120),
    );
    assert_success(&out, "client -a failed: ");
    let runs: Vec<serde_json::Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON object a line"))
        .collect();
    assert_eq!(runs.len(), 23);
    for (k, v) in (1..=23).zip(&runs) {
        assert_eq!(v["msg_size"], 1u64 << k);
        assert_eq!(v["corrupt_bytes"], 0, "{v}");
        assert_eq!(
            v["verified_bytes"].as_u64().unwrap(),
            v["iterations"].as_u64().unwrap() * v["msg_size"].as_u64().unwrap(),
            "{v}"
        );
    }
}

#[test]
fn bidir_between_processes_checks_both_ways() {
    let (srv, addr) = start_server(&["--backend", "portable"]);
    let v = client_json(&addr, &[&["--bidir"][..], &SHORT_PORTABLE].concat());
    let size = v["msg_size"].as_u64().unwrap();
    let mut total = 0;
    for which in ["tx", "rx"] {
        let d = &v[which];
        let iters = d["iterations"].as_u64().unwrap();
        assert!(iters > 0, "{which}: {v}");
        assert_eq!(d["corrupt_bytes"], 0, "{which}: {v}");
        assert_eq!(
            d["verified_bytes"].as_u64().unwrap(),
            iters * size,
            "{which}: {v}"
        );
        total += iters;
    }
    assert_eq!(v["iterations"].as_u64().unwrap(), total, "{v}");
    assert_eq!(v["verified_bytes"].as_u64().unwrap(), total * size, "{v}");
    assert!(
        server_exit(srv, Duration::from_secs(20)),
        "the server failed"
    );
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
