//! The AF_XDP backend across a namespace fabric (root): every operation
//! with every byte verified, lossless and at 1% loss, against itself and
//! against io_uring; and its clear refusals: a second XDP program on the
//! interface, no privilege, a loopback address; and a crashed process
//! leaves no XDP program behind.

mod common;

use common::*;
use std::process::Command;
use std::time::Duration;

/// Brings a fabric of two spines up under namespace prefix `tag` (one per
/// test: the tests of this file run at once, in one process), or says why
/// the test skips.
fn fabric(tag: &str) -> Option<TestFabric> {
    if !is_root() {
        println!("skipped: needs root (network namespaces, XDP)");
        return None;
    }
    let fab = TestFabric::new(tag);
    fab.up(&["--spines", "2"])?;
    Some(fab)
}

/// `perf server --once` in h2 on `server`, a client in h1 on `client`,
/// `--op op`; checks every byte and returns the client's report.
fn run(fab: &TestFabric, server: &str, client: &str, op: &str) -> serde_json::Value {
    let mut srv = Command::new("ip");
    srv.args(["netns", "exec", &fab.ns("h2"), BIN, "perf", "server"])
        .args(["--bind", "10.77.2.1:0", "--once", "--backend", server]);
    let (srv, addr) = start_server(srv);
    let mut cli = Command::new("ip");
    cli.args(["netns", "exec", &fab.ns("h1"), BIN, "perf", "client", &addr])
        .args(["-D", "1", "--op", op, "--backend", client, "--json"]);
    let out = bounded(cli, Duration::from_secs(60));
    assert_success(
        &out,
        format!("{op} client ({server} server, {client} client) failed: "),
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert_eq!(v["backend"], client, "{v}");
    if client == "af_xdp" {
        assert!(
            matches!(v["xdp_mode"].as_str(), Some("copy" | "zero-copy")),
            "{v}"
        );
    }
    assert_all_verified(&v);
    assert!(
        server_exit(srv, Duration::from_secs(20)),
        "the {server} server failed ({op})"
    );
    println!(
        "{op:5} {server:>8} <- {client:<8}: {:.3} Gbit/s, {} retransmits, mtu {}",
        v["gbps"].as_f64().unwrap(),
        v["retransmits"],
        v["mtu"]
    );
    v
}

/// Whether `ns`'s `eth0` has an XDP program attached.
fn xdp_attached(fab: &TestFabric, ns: &str) -> bool {
    let out = Command::new("ip")
        .args(["-n", &fab.ns(ns), "link", "show", "dev", "eth0"])
        .output()
        .unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    s.contains("xdp") || s.contains("prog/xdp")
}

#[test]
fn af_xdp_carries_every_operation_across_the_fabric_and_interoperates_with_io_uring() {
    let Some(fab) = fabric("mrxa") else { return };
    for loss in ["0", "1"] {
        let l = fab.metaroce(&["fabric", "loss", loss]);
        if !l.status.success() {
            let err = String::from_utf8_lossy(&l.stderr);
            if err.contains("no way to drop packets") {
                println!("loss {loss}% skipped: no nftables here: {err}");
                continue;
            }
            panic!("fabric loss failed: {err}");
        }
        println!("loss {loss}%:");
        for op in ["write", "read", "send"] {
            let v = run(&fab, "af_xdp", "af_xdp", op);
            // Frames fit one 4 KiB UMEM chunk: the connection's MTU says so.
            assert!(v["mtu"].as_u64().unwrap() <= 3798, "{v}");
        }
        run(&fab, "af_xdp", "io_uring", "write");
        run(&fab, "io_uring", "af_xdp", "write");
    }
    // ECN: the driver writes ECT into the frames it builds and reads the
    // routers' CE marks from the frames it receives.
    assert!(fab.metaroce(&["fabric", "loss", "0"]).status.success());
    assert_success(
        &fab.metaroce(&["fabric", "ecn", "20"]),
        "fabric ecn failed: ",
    );
    let v = run(&fab, "af_xdp", "af_xdp", "write");
    let sum = |k: &str| -> u64 {
        v["paths"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p[k].as_u64().unwrap())
            .sum()
    };
    let (marks, packets) = (sum("ecn_marks"), sum("packets"));
    println!("ECN 20%: {marks} of {packets} packets marked");
    assert!(marks * 20 > packets, "{marks} of {packets} marked");
    assert!(!xdp_attached(&fab, "h1") && !xdp_attached(&fab, "h2"));
}

#[test]
fn af_xdp_refuses_clearly_and_leaves_no_program_behind() {
    let Some(fab) = fabric("mrxb") else { return };
    let server = |port: &str| {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &fab.ns("h2"), BIN, "perf", "server"])
            .args([
                "--bind",
                &format!("10.77.2.1:{port}"),
                "--backend",
                "af_xdp",
            ]);
        c
    };
    // A running af_xdp server holds the interface's XDP hook...
    let (first, _) = start_server(server("0"));
    assert!(xdp_attached(&fab, "h2"), "the server attached no program");
    // ...so a second endpoint there is refused, saying why.
    let second = bounded(server("0"), Duration::from_secs(20));
    assert!(!second.status.success());
    let err = String::from_utf8_lossy(&second.stderr);
    assert!(
        err.contains("another XDP program is attached to eth0"),
        "{err}"
    );
    // Killed outright, the server leaves no program: the link died with it.
    let mut first = first;
    let _ = first.0.kill();
    let _ = first.0.wait();
    let t0 = std::time::Instant::now();
    while xdp_attached(&fab, "h2") && t0.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        !xdp_attached(&fab, "h2"),
        "a killed server left its program"
    );
    let (again, _) = start_server(server("0"));
    drop(again);

    // Without privilege: a clear error, not a hang.
    let bin = std::env::temp_dir().join(format!("metaroce-xdp-test-{}", std::process::id()));
    std::fs::copy(BIN, &bin).unwrap();
    let mut c = Command::new("ip");
    c.args(["netns", "exec", &fab.ns("h2"), "setpriv"])
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .args(["--inh-caps=-all", "--bounding-set=-all"])
        .arg(&bin)
        .args([
            "perf",
            "server",
            "--bind",
            "10.77.2.1:0",
            "--backend",
            "af_xdp",
        ]);
    let out = bounded(c, Duration::from_secs(20));
    let _ = std::fs::remove_file(&bin);
    let err = String::from_utf8_lossy(&out.stderr);
    if err.contains("setpriv: not found") || err.contains("No such file") {
        println!("unprivileged part skipped: no setpriv here: {err}");
    } else {
        assert!(!out.status.success());
        assert!(err.contains("CAP_NET_ADMIN"), "{err}");
    }

    // Loopback: not an Ethernet interface, refused before anything is set up.
    let mut c = Command::new(BIN);
    c.args(["perf", "--backend", "af_xdp", "-D", "1"]);
    let out = bounded(c, Duration::from_secs(20));
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("AF_XDP backend needs the address of an Ethernet interface"),
        "{err}"
    );
}
