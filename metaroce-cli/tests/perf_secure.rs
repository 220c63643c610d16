//! `metaroce perf` with `--psk-file` (PROTOCOL §3.2) and `--crc`
//! (PROTOCOL §3.1): loopback runs sealed, every byte verified, and a client
//! whose key differs refused at once with a clear message.

mod common;

use common::{assert_all_verified, assert_success, bounded, server_exit, start_server, BIN};
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

/// A key file of 32 bytes of `fill`, in the test's temporary directory.
fn key_file(name: &str, fill: u8) -> PathBuf {
    let p = std::env::temp_dir().join(format!("metaroce-{name}-{}.key", std::process::id()));
    std::fs::write(&p, [fill; 32]).unwrap();
    p
}

fn run_json(args: &[&str]) -> serde_json::Value {
    let mut cmd = Command::new(BIN);
    cmd.args(args);
    let out = bounded(cmd, Duration::from_secs(60));
    assert_success(&out, format!("{args:?} failed: "));
    serde_json::from_slice(&out.stdout).expect("one JSON object")
}

#[test]
fn loopback_sealed_and_plain_say_what_protects_them() {
    let key = key_file("loopback", 0x42);
    let key = key.to_str().unwrap();
    for op in ["write", "read", "send"] {
        let v = run_json(&[
            "perf",
            "--json",
            "-D",
            "0.3",
            "-s",
            "16K",
            "--backend",
            "portable",
            "--op",
            op,
            "--psk-file",
            key,
        ]);
        assert_eq!(v["security"], "aes-128-gcm", "{v}");
        assert_eq!(v["integrity"], "aes-128-gcm", "{v}");
        assert_eq!(v["integrity_failures"], 0, "{v}");
        assert_all_verified(&v);
    }
    let v = run_json(&[
        "perf",
        "--json",
        "-D",
        "0.3",
        "--backend",
        "portable",
        "--crc",
        "on",
    ]);
    assert_eq!(
        (&v["security"], &v["integrity"]),
        (&"none".into(), &"crc32c".into()),
        "{v}"
    );
    assert_all_verified(&v);
    let v = run_json(&["perf", "--json", "-D", "0.3", "--backend", "portable"]);
    assert_eq!(
        (&v["security"], &v["integrity"]),
        (&"none".into(), &"none".into()),
        "{v}"
    );
    assert_all_verified(&v);
}

#[test]
fn client_and_server_with_one_key_verify_every_byte() {
    let key = key_file("remote", 0x17);
    let key = key.to_str().unwrap();
    let mut cmd = Command::new(BIN);
    cmd.args([
        "perf",
        "server",
        "--bind",
        "127.0.0.1:0",
        "--once",
        "--backend",
        "portable",
    ])
    .args(["--psk-file", key]);
    let (srv, addr) = start_server(cmd);
    let v = run_json(&[
        "perf",
        "client",
        &addr,
        "--json",
        "-D",
        "0.3",
        "--backend",
        "portable",
        "--psk-file",
        key,
    ]);
    assert_eq!(v["security"], "aes-128-gcm", "{v}");
    assert_all_verified(&v);
    assert!(server_exit(srv, Duration::from_secs(20)));
}

#[test]
fn a_client_with_another_key_exits_at_once_saying_the_key_was_refused() {
    let server_key = key_file("server", 0x01);
    let client_key = key_file("client", 0x02);
    for client_args in [vec!["--psk-file", client_key.to_str().unwrap()], vec![]] {
        let mut cmd = Command::new(BIN);
        cmd.args([
            "perf",
            "server",
            "--bind",
            "127.0.0.1:0",
            "--backend",
            "portable",
        ])
        .args(["--psk-file", server_key.to_str().unwrap()]);
        let (_srv, addr) = start_server(cmd);
        let mut cmd = Command::new(BIN);
        cmd.args([
            "perf",
            "client",
            &addr,
            "-D",
            "0.3",
            "--backend",
            "portable",
        ])
        .args(&client_args);
        let t0 = Instant::now();
        let out = bounded(cmd, Duration::from_secs(30));
        let took = t0.elapsed();
        assert!(!out.status.success(), "the client must fail");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("refused the key"), "{err}");
        assert!(took < Duration::from_secs(10), "refused in {took:?}");
    }
}
