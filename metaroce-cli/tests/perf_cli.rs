//! `metaroce perf` end to end: the README's main job, run short, on each
//! backend, with every byte verified.

mod common;

use common::{assert_success, BIN};
use std::process::Command;

fn perf(args: &[&str]) -> serde_json::Value {
    let out = Command::new(BIN)
        .arg("perf")
        .args(args)
        .arg("--json")
        .output()
        .expect("run metaroce perf");
    assert_success(&out, format!("metaroce perf {args:?} failed: "));
    serde_json::from_slice(&out.stdout).expect("one JSON object")
}

fn check(v: &serde_json::Value, op: &str) {
    assert_eq!(v["op"], op);
    assert_eq!(v["corrupt_bytes"], 0, "{v}");
    let iters = v["iterations"].as_u64().unwrap();
    assert!(iters > 0, "{v}");
    assert!(v["gbps"].as_f64().unwrap() > 0.0);
    // Every byte of every message was checked against its pattern.
    assert_eq!(
        v["verified_bytes"].as_u64().unwrap(),
        iters * v["msg_size"].as_u64().unwrap(),
        "{v}"
    );
    assert!(v["lat_p50_us"].as_f64().unwrap() > 0.0);
    assert!(v["lat_p99_us"].as_f64().unwrap() >= v["lat_p50_us"].as_f64().unwrap());
    let paths = v["paths"].as_array().unwrap();
    assert!(!paths.is_empty());
    for p in paths {
        // Each path reports its window and its moves off slow routes.
        assert!(p["cwnd"].as_u64().unwrap() > 0, "{p}");
        assert!(p["slow_moves"].as_u64().is_some(), "{p}");
    }
    // The interval rates (the client's own stream) cover the run and add
    // up to the bytes it moved.
    let iv = v["intervals"].as_array().unwrap();
    assert!(!iv.is_empty(), "{v}");
    let bits: f64 = iv
        .iter()
        .map(|i| {
            let secs = i["end_s"].as_f64().unwrap() - i["start_s"].as_f64().unwrap();
            i["gbps"].as_f64().unwrap() * 1e9 * secs
        })
        .sum();
    let own = if v["bidir"] == true { &v["tx"] } else { v };
    let bytes = own["bytes"].as_u64().unwrap() as f64;
    assert!(
        (bits / 8.0 - bytes).abs() <= bytes * 1e-6 + 1.0,
        "{bits} bits, {bytes} bytes: {v}"
    );
}

#[test]
fn write_read_send_on_the_portable_backend() {
    for op in ["write", "read", "send"] {
        let v = perf(&[
            "--backend",
            "portable",
            "--op",
            op,
            "-D",
            "0.3",
            "-s",
            "16K",
        ]);
        assert_eq!(v["backend"], "portable");
        check(&v, op);
    }
}

#[test]
fn default_run_picks_a_backend() {
    let v = perf(&["-D", "0.3"]);
    let backend = v["backend"].as_str().unwrap();
    assert!(backend == "io_uring" || backend == "portable", "{backend}");
    assert_eq!(v["busy_poll_us"], 50, "each side polls 50 µs by default");
    assert_eq!(v["mtu"], 4160, "4 KiB payloads by default");
    check(&v, "write");
}

/// The sum of a field of a run's paths.
fn paths_sum(v: &serde_json::Value, field: &str) -> u64 {
    let paths = v["paths"].as_array().unwrap();
    paths.iter().map(|p| p[field].as_u64().unwrap()).sum()
}

/// The average DATA datagram of a run's paths, bytes.
fn mean_datagram(v: &serde_json::Value) -> f64 {
    paths_sum(v, "bytes") as f64 / paths_sum(v, "packets").max(1) as f64
}

#[test]
fn jumbo_datagrams_carry_every_byte() {
    for op in ["write", "read"] {
        let v = perf(&["--op", op, "-D", "0.3", "--mtu", "8256"]);
        assert_eq!(v["mtu"], 8256, "{v}");
        assert_eq!(v["mtu_asked"], 8256, "{v}");
        check(&v, op);
    }
    // The WRITEs really went in 8 KiB payloads: more message bytes than
    // 4 KiB per datagram sent, which 4 KiB payloads cannot give whatever
    // else the run sent (retransmissions and probes only add datagrams; a
    // debug build on a loaded host times out and probes a lot, so the mean
    // datagram itself is no measure).
    let v = perf(&["-D", "0.3", "--mtu", "8256"]);
    let mean = mean_datagram(&v);
    assert!(mean <= 8256.0, "mean datagram {mean} bytes");
    let datagrams = paths_sum(&v, "packets");
    let per = v["bytes"].as_u64().unwrap() as f64 / datagrams.max(1) as f64;
    assert!(per > 4096.0, "{per} message bytes per datagram");
    let v = perf(&["-D", "0.3"]);
    let mean = mean_datagram(&v);
    assert!(
        mean <= 4160.0,
        "mean datagram {mean} bytes at the default MTU"
    );
}

#[test]
fn an_mtu_out_of_range_is_refused() {
    for bad in ["100", "9001"] {
        let out = Command::new(BIN)
            .args(["perf", "--mtu", bad])
            .output()
            .unwrap();
        assert!(!out.status.success(), "--mtu {bad} was taken");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("--mtu") && err.contains("256..=9000"), "{err}");
    }
}

#[test]
fn drivers_that_sleep_at_once_still_move_every_byte() {
    let v = perf(&["-D", "0.3", "--busy-poll", "0"]);
    assert_eq!(v["busy_poll_us"], 0);
    check(&v, "write");
}

#[test]
fn bad_flags_are_refused() {
    let out = Command::new(BIN)
        .args(["perf", "-s", "5G"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("exceeds the largest message"));
}

/// One direction of a `--bidir` report: it ran and every byte was checked.
fn check_direction(v: &serde_json::Value, which: &str) -> (u64, f64) {
    let d = &v[which];
    let iters = d["iterations"]
        .as_u64()
        .unwrap_or_else(|| panic!("{which}: {v}"));
    assert!(iters > 0, "{which} carried nothing: {v}");
    assert_eq!(d["corrupt_bytes"], 0, "{which}: {v}");
    assert_eq!(
        d["verified_bytes"].as_u64().unwrap(),
        iters * v["msg_size"].as_u64().unwrap(),
        "{which}: {v}"
    );
    assert_eq!(
        d["bytes"].as_u64().unwrap(),
        iters * v["msg_size"].as_u64().unwrap()
    );
    (iters, d["gbps"].as_f64().unwrap())
}

#[test]
fn bidir_loopback_checks_every_byte_both_ways() {
    for op in ["write", "read", "send"] {
        let v = perf(&[
            "--bidir",
            "--backend",
            "portable",
            "--op",
            op,
            "-D",
            "0.3",
            "-s",
            "16K",
            "-q",
            "2",
        ]);
        assert_eq!(v["bidir"], true, "{v}");
        check(&v, op);
        let (tx_iters, tx_gbps) = check_direction(&v, "tx");
        let (rx_iters, rx_gbps) = check_direction(&v, "rx");
        // The totals are the sums of the two directions.
        assert_eq!(
            v["iterations"].as_u64().unwrap(),
            tx_iters + rx_iters,
            "{v}"
        );
        let sum = v["gbps"].as_f64().unwrap();
        assert!((sum - (tx_gbps + rx_gbps)).abs() < 1e-9, "{v}");
    }
}

#[test]
fn one_way_runs_have_no_direction_objects() {
    let v = perf(&["--backend", "portable", "-D", "0.2", "-s", "16K"]);
    assert_eq!(v["bidir"], false);
    assert!(v.get("tx").is_none() && v.get("rx").is_none(), "{v}");
}

#[test]
fn bidir_text_report_shows_each_direction_and_the_sum() {
    let out = Command::new(BIN)
        .args([
            "perf",
            "-b",
            "--backend",
            "portable",
            "-D",
            "0.2",
            "-s",
            "16K",
        ])
        .output()
        .unwrap();
    assert_success(&out, "");
    let text = String::from_utf8_lossy(&out.stdout);
    let row = |tag: &str| {
        text.lines()
            .find(|l| l.trim_end().ends_with(tag))
            .unwrap_or_else(|| panic!("no `{tag}` row in\n{text}"))
            .split_whitespace()
            .nth(2)
            .unwrap()
            .parse::<f64>()
            .unwrap()
    };
    let (tx, rx) = (row(" tx"), row(" rx"));
    let sum = text
        .lines()
        .find(|l| l.contains("(sum of both ways)"))
        .unwrap_or_else(|| panic!("no sum row in\n{text}"))
        .split_whitespace()
        .nth(2)
        .unwrap()
        .parse::<f64>()
        .unwrap();
    assert!(tx > 0.0 && rx > 0.0, "{text}");
    assert!((sum - (tx + rx)).abs() < 0.002, "{text}");
}

/// `metaroce perf` with `args`, text report: its stdout.
fn perf_text(args: &[&str]) -> String {
    let out = Command::new(BIN)
        .arg("perf")
        .args(args)
        .output()
        .expect("run metaroce perf");
    assert_success(&out, format!("metaroce perf {args:?} failed: "));
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn a_run_without_verification_says_so() {
    let v = perf(&["-D", "0.2", "--no-verify"]);
    assert_eq!(v["verify"], false);
    assert_eq!(v["verified_bytes"], 0);
    assert!(v["iterations"].as_u64().unwrap() > 0);
    let text = perf_text(&["-D", "0.2", "--no-verify"]);
    assert!(text.contains("Verification         : off"), "{text}");
    let text = perf_text(&["-D", "0.2"]);
    assert!(text.contains("Verification         : every byte"), "{text}");
}

#[test]
fn messages_larger_than_a_step_are_filled_and_checked_in_pieces() {
    // 4 MiB messages take 16 steps of filling at the client and of
    // checking at the server (READs: at the client): every byte still
    // counted once.
    for op in ["write", "read"] {
        let v = perf(&["--op", op, "-s", "4M", "-t", "4", "-D", "0.3"]);
        check(&v, op);
    }
}

#[test]
fn all_sizes_run_one_after_another() {
    let out = Command::new(BIN)
        .args(["perf", "-a", "-D", "0.05", "--json"])
        .output()
        .unwrap();
    assert_success(&out, "metaroce perf -a failed: ");
    let runs: Vec<serde_json::Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON object a line"))
        .collect();
    let sizes: Vec<u64> = runs
        .iter()
        .map(|v| v["msg_size"].as_u64().unwrap())
        .collect();
    let want: Vec<u64> = (1..=23).map(|k| 1u64 << k).collect();
    assert_eq!(sizes, want, "2 bytes to 8 MiB, in order");
    for v in &runs {
        assert_eq!(v["corrupt_bytes"], 0, "{v}");
        assert_eq!(
            v["verified_bytes"].as_u64().unwrap(),
            v["iterations"].as_u64().unwrap() * v["msg_size"].as_u64().unwrap(),
            "{v}"
        );
    }
    // Up to 64 KiB there is time for many messages even unoptimised.
    assert!(runs[..15]
        .iter()
        .all(|v| v["iterations"].as_u64().unwrap() > 0));

    // The text report: one header, a row per size, the totals.
    let text = perf_text(&["--all", "-D", "0.02"]);
    assert_eq!(text.matches("BW Test").count(), 1, "{text}");
    for size in &want {
        assert!(
            text.lines()
                .any(|l| l.split_whitespace().next() == Some(&size.to_string())),
            "no row for {size}: {text}"
        );
    }
    assert!(text.contains("23 sizes, verified bytes"), "{text}");
    assert!(text.contains("corrupt bytes 0"), "{text}");
}

#[test]
fn all_sizes_leave_out_what_a_deep_queue_cannot_hold() {
    // 130 slots of 8 MiB would be over 1 GiB: -a with -t 65 stops at 4 MiB.
    let out = Command::new(BIN)
        .args(["perf", "-a", "-t", "65", "-D", "0.01", "--json"])
        .output()
        .unwrap();
    assert_success(&out, "metaroce perf -a -t 65 failed: ");
    let last = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["msg_size"]
                .as_u64()
                .unwrap()
        })
        .max();
    assert_eq!(last, Some(4 << 20));
}

#[test]
fn all_sizes_and_one_size_do_not_go_together() {
    let out = Command::new(BIN)
        .args(["perf", "-a", "-s", "4K"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot be used with"));
}

/// `--loss`, `--duplicate` and `--reorder` (what `scripts/soak.sh` runs
/// with): the faults happen (retransmissions) and every byte still arrives
/// intact; a fraction outside 0..=1 is refused.
#[test]
fn injected_loss_duplication_and_reordering_leave_every_byte_intact() {
    let v = perf(&[
        "--backend",
        "portable",
        "-D",
        "0.5",
        "-s",
        "16K",
        "--loss",
        "0.03",
        "--duplicate",
        "0.03",
        "--reorder",
        "0.03",
    ]);
    check(&v, "write");
    assert!(v["retransmits"].as_u64().unwrap() > 0, "{v}");
    let out = Command::new(BIN)
        .args(["perf", "--loss", "1.5"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("fraction"));
}
