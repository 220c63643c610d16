//! `metaroce perf` end to end: the README's main job, run short, on each
//! backend, with every byte verified.

use std::process::Command;

fn perf(args: &[&str]) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_metaroce"))
        .arg("perf")
        .args(args)
        .arg("--json")
        .output()
        .expect("run metaroce perf");
    assert!(
        out.status.success(),
        "metaroce perf failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
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
    assert!(!v["paths"].as_array().unwrap().is_empty());
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
    check(&v, "write");
}

#[test]
fn bad_flags_are_refused() {
    let out = Command::new(env!("CARGO_BIN_EXE_metaroce"))
        .args(["perf", "-s", "5G"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("exceeds the largest message"));
}
