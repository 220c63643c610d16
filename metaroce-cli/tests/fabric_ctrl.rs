//! `metaroce perf`'s control channel across a fabric with a silently
//! blackholed spine (root only): a 4-spine namespace fabric whose spine 0
//! drops every packet without a word (nftables, `metaroce fabric loss`),
//! and clients that must still reach the server and run. A control
//! connection (and the metaroce handshake) hashed onto the dead spine
//! times out and is tried again from new source ports.
//!
//! Without root (or without network namespaces or nftables) it prints why
//! it skips and passes. The fabric has a namespace prefix of its own
//! (`mrc<pid>`), and is torn down even on failure.

mod common;

use common::{assert_all_verified, bounded, start_server, TestFabric, BIN};
use std::process::Command;
use std::time::Duration;

/// Retries the clients log as they happen (`METAROCE_LOG=info`).
const RETRY: &str = "trying again from a new source port";

#[test]
fn clients_reach_the_server_past_a_blackholed_spine() {
    let Some((fab, _)) = TestFabric::start("mrc", &["--spines", "4"]) else {
        return;
    };
    // The hosts put wire-sized packets on the fabric (their stacks segment
    // GSO and TSO batches), so a drop is of one datagram.
    for host in ["h1", "h2"] {
        let link = Command::new("ip")
            .args(["-n", &fab.ns(host), "-d", "link", "show", "eth0"])
            .output()
            .expect("ip link show");
        let text = String::from_utf8_lossy(&link.stdout);
        assert!(text.contains("gso_max_segs 1 "), "{host}: {text}");
    }
    // Spine 0 drops everything, both ways, silently (`loss 100`: an nft
    // drop rule; the routes stay up).
    let out = fab.metaroce(&["fabric", "loss", "100", "--link", "0"]);
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        if err.contains("no way to drop packets") {
            println!("skipped: no nftables or netem here: {err}");
            return;
        }
        panic!("could not blackhole spine 0: {err}");
    }

    let mut server = Command::new("ip");
    server
        .args(["netns", "exec", &fab.ns("h2"), BIN, "perf", "server"])
        .args(["--bind", "10.77.2.1:0"]);
    let (_srv, addr) = start_server(server);

    // Run after run until one needed a retry (each attempt lands on the
    // dead spine about one time in three, so that comes soon): every run
    // must reach the server and verify every byte.
    let mut retries = Vec::new();
    for _ in 0..8 {
        let mut cli = Command::new("ip");
        cli.args(["netns", "exec", &fab.ns("h1"), BIN, "perf", "client", &addr])
            .args(["-D", "0.3", "--json", "--connect-timeout", "60"])
            .env("METAROCE_LOG", "info");
        let out = bounded(cli, Duration::from_secs(120));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "a client failed with spine 0 blackholed (retries: {retries:?}): {err}"
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
        assert_all_verified(&v);
        let n = err.matches(RETRY).count();
        for line in err.lines().filter(|l| l.contains(RETRY)) {
            println!("{line}");
        }
        retries.push(n);
        if n > 0 {
            break;
        }
    }
    println!("runs and their retries: {retries:?}");
    assert!(
        retries.iter().any(|&n| n > 0),
        "no run needed a retry: is spine 0 really dropping? {retries:?}"
    );
}
