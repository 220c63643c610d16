//! `scripts/compare-fabric.sh`: the script parses and explains itself
//! (always), and as root a `--quick` comparison runs end to end on a fabric
//! of its own (prefix `mrq<pid>`), with the binary under test, leaving no
//! namespace behind. The full comparison is not part of the test suite.

mod common;

use common::{assert_success, bounded, is_root, BIN};
use std::process::Command;
use std::time::Duration;

fn script() -> String {
    format!(
        "{}/../scripts/compare-fabric.sh",
        env!("CARGO_MANIFEST_DIR")
    )
}

#[test]
fn the_script_parses_and_explains_itself() {
    let syntax = Command::new("bash")
        .args(["-n", &script()])
        .output()
        .unwrap();
    assert_success(&syntax, "bash -n: ");
    let help = Command::new("bash")
        .args([&script(), "--help"])
        .output()
        .unwrap();
    assert!(help.status.success());
    let text = String::from_utf8_lossy(&help.stdout);
    for flag in ["--quick", "--rate-mbit", "--no-write", "METAROCE"] {
        assert!(
            text.contains(flag),
            "--help does not mention {flag}: {text}"
        );
    }
    // --check says what is missing (exit 1) or that all is there (exit 0).
    let check = Command::new("bash")
        .args([&script(), "--check"])
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&check.stdout);
    assert!(out.contains("compare-fabric plan"), "{out}");
    if check.status.success() {
        assert!(out.contains("prerequisites: ok"), "{out}");
    } else {
        assert!(out.contains("missing:"), "{out}");
        if !is_root() {
            assert!(out.contains("root"), "{out}");
        }
    }
    let bad = Command::new("bash")
        .args([&script(), "--bogus"])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
}

#[test]
fn a_quick_comparison_runs_as_root() {
    if !is_root() {
        println!("skipped: needs root");
        return;
    }
    let check = Command::new("bash")
        .args([&script(), "--check"])
        .output()
        .unwrap();
    if !check.status.success() {
        println!("skipped: {}", String::from_utf8_lossy(&check.stdout).trim());
        return;
    }
    let prefix = format!("mrq{}", std::process::id());
    let mut cmd = Command::new("bash");
    cmd.args([&script(), "--quick", "--prefix", &prefix])
        .env("METAROCE", BIN);
    let out = bounded(cmd, Duration::from_secs(90));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let left = Command::new("ip").args(["netns", "list"]).output().unwrap();
    let left = String::from_utf8_lossy(&left.stdout);
    assert!(!left.contains(&prefix), "namespaces left behind: {left}");
    if stderr.contains("Operation not permitted") {
        println!("skipped: cannot create network namespaces here: {stderr}");
        return;
    }
    assert!(out.status.success(), "{stderr}\n{stdout}");
    assert!(
        stdout.contains("| transport | 0% | 1% | 10% | cut |"),
        "{stdout}"
    );
    let row = stdout
        .lines()
        .find(|l| l.starts_with("| metaroce ("))
        .unwrap_or_else(|| panic!("no metaroce row: {stdout}"));
    assert!(!row.contains("failed"), "{row}");
    assert!(
        stdout.contains("0 corrupt | **met**"),
        "the cut lost or corrupted bytes: {stdout}"
    );
    println!("{stdout}");
}
