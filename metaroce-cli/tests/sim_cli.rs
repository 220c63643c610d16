//! `metaroce sim` end to end: a tiny fabric, JSON output.

mod common;

use common::{assert_success, BIN};
use std::process::Command;

fn metaroce() -> Command {
    Command::new(BIN)
}

const FIELDS: &[&str] = &[
    "transport",
    "hosts",
    "loss",
    "goodput_gbps",
    "goodput_fraction",
    "retransmit_fraction",
    "fct_p50_us",
    "fct_p99_us",
    "max_queue_bytes",
    "ecn_marked_fraction",
    "bytes_lost",
    "events",
    "wall_s",
];

#[test]
fn sim_json_single_run() {
    let out = metaroce()
        .args([
            "sim",
            "--transport",
            "metaroce",
            "--hosts",
            "8",
            "--spines",
            "4",
            "--duration-ms",
            "0.2",
            "--loss",
            "0.01",
            "--json",
        ])
        .output()
        .unwrap();
    assert_success(&out, "");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for f in FIELDS {
        assert!(v.get(f).is_some(), "missing {f}: {v}");
    }
    assert_eq!(v["transport"], "metaroce");
    assert_eq!(v["hosts"], 8);
    assert_eq!(v["loss"], 0.01);
    assert_eq!(v["bytes_lost"], 0);
    assert!(v["goodput_gbps"].as_f64().unwrap() > 0.0);
    assert!(v["events"].as_u64().unwrap() > 0);
    assert!(v["metaroce"]["adapter"]["writes_ok"].as_u64().unwrap() > 0);
}

#[test]
fn sim_sweep_gives_an_array_and_a_table() {
    let args = [
        "sim",
        "--transport",
        "metaroce,irn",
        "--hosts",
        "8",
        "--spines",
        "4",
        "--duration-ms",
        "0.1",
        "--sweep",
        "loss=0,0.05",
        "--fail",
        "spine:1@0.05",
    ];
    let out = metaroce().args(args).arg("--json").output().unwrap();
    assert_success(&out, "");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let runs = v.as_array().unwrap();
    assert_eq!(runs.len(), 4);
    let rows: Vec<(String, f64)> = runs
        .iter()
        .map(|r| {
            (
                r["transport"].as_str().unwrap().to_owned(),
                r["loss"].as_f64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        rows,
        [
            ("metaroce".into(), 0.0),
            ("metaroce".into(), 0.05),
            ("irn".into(), 0.0),
            ("irn".into(), 0.05)
        ]
    );
    for r in runs {
        assert_eq!(r["bytes_lost"], 0, "{r}");
    }
    let out = metaroce().args(args).output().unwrap();
    assert!(out.status.success());
    let table = String::from_utf8(out.stdout).unwrap();
    // The table, a blank line, then one metrics line per run with a fault,
    // and for each metaroce run one line of its loss recovery.
    let (rows, metrics) = table.split_once("\n\n").expect("metrics block");
    assert_eq!(rows.lines().count(), 2 + 4, "{table}");
    assert_eq!(metrics.lines().count(), 4 + 2, "{table}");
    assert_eq!(
        metrics.lines().filter(|l| l.contains("RTO fires")).count(),
        2,
        "{table}"
    );
    assert!(table.starts_with("transport"));
}

#[test]
fn sim_rejects_bad_arguments() {
    for bad in [
        &["sim", "--transport", "tcp"][..],
        &["sim", "--pattern", "ring"],
        &["sim", "--sweep", "hosts=1,2"],
        &["sim", "--fail", "spine:99@1"],
        &["sim", "--loss", "1.5"],
    ] {
        let out = metaroce().args(bad).output().unwrap();
        assert!(!out.status.success(), "{bad:?} succeeded");
        assert!(!out.stderr.is_empty());
    }
}

#[test]
fn sim_series_incast_metrics_and_ablation_knobs() {
    let out = metaroce()
        .args([
            "sim",
            "--hosts",
            "8",
            "--spines",
            "4",
            "--pattern",
            "incast:4",
            "--duration-ms",
            "0.2",
            "--bin-us",
            "20",
            "--receiver-hints",
            "off",
            "--ecn",
            "off",
            "--json",
        ])
        .output()
        .unwrap();
    assert_success(&out, "");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["bin_us"], 20.0);
    assert_eq!(v["goodput_series_gbps"].as_array().unwrap().len(), 10);
    assert_eq!(v["ecn_marked_fraction"], 0.0);
    for f in [
        "jain_fairness",
        "receiver_utilization",
        "receiver_max_queue_bytes",
        "convergence_window_us",
    ] {
        assert!(v[f].is_number(), "{f}: {v}");
    }
    assert!(v["recovery_us"].is_null());
    let bad = metaroce()
        .args(["sim", "--hosts", "8", "--ecn", "maybe"])
        .output()
        .unwrap();
    assert!(!bad.status.success());
}
