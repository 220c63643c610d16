//! The plugin driven as NCCL drives it, by `metaroce-nccl-harness`: two
//! ranks in two processes, the plugin loaded with `dlopen` under the file
//! name NCCL opens (`libnccl-net-metaroce.so`, found through
//! `LD_LIBRARY_PATH`), every byte of every message checked.

mod common;

use common::{assert_ok, run_ranks};
use std::process::Command;
use std::sync::Mutex;
use std::time::Duration;

/// One pair of ranks at a time: they share two cores with everything else.
static SERIAL: Mutex<()> = Mutex::new(());

fn loopback() -> Vec<(&'static str, String)> {
    vec![("METAROCE_ADDRS", "127.0.0.1".into())]
}

/// The newest table (v12), messages of 0 B to 64 MiB both ways with up to
/// NCCL_NET_MAX_REQUESTS outstanding, then grouped receives of 8 tags whose
/// messages come in reverse order, shorter than their buffers.
#[test]
fn newest_version_over_loopback_every_byte() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let outs = run_ranks(
        "v12",
        &["--budget", "8M", "verify"],
        &loopback(),
        |_| Vec::new(),
        Duration::from_secs(600),
    );
    assert_ok(&outs);
    for (rank, o) in outs.iter().enumerate() {
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            err.contains("ncclNetPlugin_v12"),
            "rank {rank} did not pick v12"
        );
        assert!(
            err.contains("verified 2 x 67108864 B"),
            "rank {rank}: no 64 MiB run"
        );
        assert!(
            err.contains("grouped receives of 8 tags"),
            "rank {rank}: no grouped run"
        );
        assert!(
            err.contains("sent before their receives were posted"),
            "rank {rank}: no late-receiver run"
        );
        // The harness's deliberate bad regMr came back as an error code
        // with a warning through the logger it gave init.
        assert!(
            err.contains("NCCL WARN NET/metaroce: regMr"),
            "rank {rank}: no warning logged"
        );
        assert!(String::from_utf8_lossy(&o.stdout).contains("verify ok"));
    }
}

/// The v8 table (int sizes) does the same work, with the endpoint thread
/// alone driving each endpoint and every message waiting for its receive
/// (no eager messages): the other way the plugin can be configured.
#[test]
fn v8_over_loopback_every_byte() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut env = loopback();
    env.push(("METAROCE_PROGRESS", "thread".into()));
    env.push(("METAROCE_EAGER_BYTES", "0".into()));
    let outs = run_ranks(
        "v8",
        &[
            "--version",
            "8",
            "--max-size",
            "8M",
            "--budget",
            "4M",
            "verify",
        ],
        &env,
        |_| Vec::new(),
        Duration::from_secs(600),
    );
    assert_ok(&outs);
    for o in &outs {
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains("ncclNetPlugin_v8"));
        assert!(err.contains("sent before their receives were posted"));
    }
}

/// With 1% of the datagrams each endpoint receives dropped (the io layer's
/// fault injection), every byte still arrives, in order, with its size.
#[test]
fn injected_loss_over_loopback_every_byte() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut env = loopback();
    env.push(("METAROCE_FAULT_DROP", "0.01".into()));
    let outs = run_ranks(
        "loss",
        &[
            "--version",
            "11",
            "--max-size",
            "8M",
            "--budget",
            "4M",
            "verify",
        ],
        &env,
        |_| Vec::new(),
        Duration::from_secs(600),
    );
    assert_ok(&outs);
    // The loss was real: the senders retransmitted.
    for (rank, o) in outs.iter().enumerate() {
        let err = String::from_utf8_lossy(&o.stderr);
        let retransmits: u64 = err
            .lines()
            .find_map(|l| l.split(" data packets sent, ").nth(1))
            .and_then(|r| r.split(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("rank {rank}: no close line with counters:\n{err}"));
        assert!(retransmits > 0, "rank {rank}: 1% loss but no retransmit");
    }
}

/// Key files for the authenticated mode (`METAROCE_PSK_FILE`): two
/// different 32-byte keys in a scratch directory, removed on drop.
struct Keys(std::path::PathBuf);

impl Keys {
    fn new() -> Keys {
        let d = common::scratch("keys");
        std::fs::write(d.join("a"), [0x5a; 32]).expect("key a");
        std::fs::write(d.join("b"), [0xa5; 32]).expect("key b");
        Keys(d)
    }
    fn path(&self, name: &str) -> String {
        self.0.join(name).display().to_string()
    }
}

impl Drop for Keys {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// With the same key on both ranks every datagram is sealed
/// (AES-128-GCM), and the whole verification still passes: messages up to
/// 8 MiB both ways, grouped receives, receives posted late.
#[test]
fn sealed_over_loopback_every_byte() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let keys = Keys::new();
    let mut env = loopback();
    env.push(("METAROCE_PSK_FILE", keys.path("a")));
    let outs = run_ranks(
        "sealed",
        &["--max-size", "8M", "--budget", "4M", "verify"],
        &env,
        |_| Vec::new(),
        Duration::from_secs(600),
    );
    assert_ok(&outs);
    for o in &outs {
        assert!(String::from_utf8_lossy(&o.stdout).contains("verify ok"));
    }
}

/// Ranks with different keys get no connection: the rank whose endpoint
/// opens the connection between them is refused by the other's (PROTOCOL
/// §3.2, `KeyRefused`) at once; the other learns it from the set-up
/// stream closing, or, if it waits for that connection, gives up when
/// `METAROCE_CONNECT_TIMEOUT_MS` (4 s here) runs out, pointing at the key.
/// Both fail with an error rather than exchange a byte.
#[test]
fn ranks_with_different_keys_get_no_connection() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let keys = Keys::new();
    let mut env = loopback();
    env.push(("METAROCE_CONNECT_TIMEOUT_MS", "4000".into()));
    let started = std::time::Instant::now();
    let outs = run_ranks(
        "wrong-key",
        &["--max-size", "64K", "verify"],
        &env,
        |rank| {
            vec![
                "env".into(),
                format!("METAROCE_PSK_FILE={}", keys.path(["a", "b"][rank])),
            ]
        },
        Duration::from_secs(60),
    );
    let took = started.elapsed();
    for (rank, o) in outs.iter().enumerate() {
        let err = String::from_utf8_lossy(&o.stderr);
        eprintln!("--- rank {rank} ---\n{err}");
        assert!(
            !o.status.success(),
            "rank {rank} connected with another key"
        );
        assert!(!String::from_utf8_lossy(&o.stdout).contains("verify ok"));
    }
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&outs[0].stderr),
        String::from_utf8_lossy(&outs[1].stderr)
    );
    assert!(all.contains("refused the key"), "no rank says why:\n{all}");
    assert!(
        all.matches("METAROCE_PSK_FILE").count() + all.matches("refused the key").count() >= 2,
        "a rank fails without pointing at the key:\n{all}"
    );
    assert!(took < Duration::from_secs(20), "took {took:?}");
}

/// Messages longer than their buffers fail with an error on the side that
/// finds out (the sender for one that waits for its buffer's announcement,
/// the receiver for an eager one), within seconds, and no byte lands past a
/// buffer.
#[test]
fn messages_longer_than_their_buffers_are_refused() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let outs = run_ranks(
        "misuse",
        &["misuse"],
        &loopback(),
        |_| Vec::new(),
        Duration::from_secs(120),
    );
    assert_ok(&outs);
    let err0 = String::from_utf8_lossy(&outs[0].stderr);
    let err1 = String::from_utf8_lossy(&outs[1].stderr);
    assert!(
        err0.contains("a 100 B eager message for a 16 B buffer"),
        "{err0}"
    );
    assert!(
        err1.contains("a 64 KiB message for a 16 B buffer"),
        "{err1}"
    );
    // Each error went through NCCL's logger as a warning, with its reason.
    assert!(
        err0.contains("NCCL WARN NET/metaroce: test") && err0.contains("for a buffer of 16"),
        "{err0}"
    );
    assert!(
        err1.contains("NCCL WARN NET/metaroce: isend") && err1.contains("holds 16"),
        "{err1}"
    );
}

/// The bench mode prints sendrecv_perf's columns as JSON.
#[test]
fn bench_reports_sendrecv_columns() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let outs = run_ranks(
        "bench",
        &[
            "--max-size",
            "64K",
            "--iters",
            "5",
            "--pingpongs",
            "200",
            "--json",
            "bench",
        ],
        &loopback(),
        |_| Vec::new(),
        Duration::from_secs(300),
    );
    assert_ok(&outs);
    let out = String::from_utf8_lossy(&outs[0].stdout);
    let v: serde_json::Value = serde_json::from_str(out.trim()).expect("rank 0 prints JSON");
    let rows = v["sendrecv"].as_array().expect("rows");
    assert_eq!(rows.len(), 14, "8 B to 64 KiB: {out}");
    for r in rows {
        assert!(r["time_us"].as_f64().unwrap() > 0.0);
        assert!(r["algbw_gbps"].as_f64().unwrap() > 0.0);
        assert_eq!(r["busbw_gbps"], r["algbw_gbps"]);
    }
    assert!(v["rtt_8b_us"]["p50"].as_f64().unwrap() > 0.0);
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

/// The `metaroce` binary (`METAROCE_BIN`, else next to this test's build).
fn metaroce_bin() -> Option<std::path::PathBuf> {
    if let Ok(p) = std::env::var("METAROCE_BIN") {
        return Some(p.into());
    }
    let p = common::artifacts().join("metaroce");
    p.exists().then_some(p)
}

/// Across `metaroce fabric` (4 spines, network namespaces; root only):
/// lossless, then with 1% loss on every spine.
#[test]
fn across_metaroce_fabric_lossless_and_lossy() {
    if !is_root() {
        println!("skipped: the fabric run needs root (network namespaces)");
        return;
    }
    let Some(bin) = metaroce_bin() else {
        println!(
            "skipped: no `metaroce` binary next to this build (build metaroce-cli, \
             or set METAROCE_BIN)"
        );
        return;
    };
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let prefix = format!("mrn{}", std::process::id());
    let fabric = |args: &[&str]| {
        Command::new(&bin)
            .arg("fabric")
            .args(args)
            .env("METAROCE_FABRIC_PREFIX", &prefix)
            .output()
            .expect("run metaroce fabric")
    };
    struct Down<F: Fn(&[&str]) -> std::process::Output>(F);
    impl<F: Fn(&[&str]) -> std::process::Output> Drop for Down<F> {
        fn drop(&mut self) {
            let _ = (self.0)(&["down"]);
        }
    }
    let _down = Down(fabric);
    let fabric = &_down.0;
    let up = fabric(&["up", "--spines", "4"]);
    if !up.status.success() {
        let err = String::from_utf8_lossy(&up.stderr);
        if err.contains("netns") || err.contains("Operation not permitted") {
            println!("skipped: cannot create network namespaces here: {err}");
            return;
        }
        panic!("fabric up failed: {err}");
    }
    let hosts = [("h1", "10.77.1.1"), ("h2", "10.77.2.1")];
    let run = |name: &str| {
        let outs = run_ranks(
            name,
            &["--max-size", "8M", "--budget", "4M", "verify"],
            &[],
            |rank| {
                let (ns, ip) = hosts[rank];
                vec![
                    "ip".into(),
                    "netns".into(),
                    "exec".into(),
                    format!("{prefix}-{ns}"),
                    "env".into(),
                    format!("METAROCE_ADDRS={ip}"),
                ]
            },
            Duration::from_secs(600),
        );
        assert_ok(&outs);
    };
    run("fabric");
    let loss = fabric(&["loss", "1"]);
    if !loss.status.success() {
        let err = String::from_utf8_lossy(&loss.stderr);
        if err.contains("no way to drop packets") {
            println!("loss part skipped: no nftables here: {err}");
            return;
        }
        panic!("fabric loss failed: {err}");
    }
    run("fabric-loss");
}
