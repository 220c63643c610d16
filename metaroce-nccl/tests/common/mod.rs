//! Helpers of the crate's tests: where cargo put the plugin, a scratch
//! directory, the plugin installed under the name NCCL opens.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The directory of the build's artifacts (`target/debug`): the test
/// binary lives in its `deps/`.
pub fn artifacts() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    exe.parent()
        .and_then(Path::parent)
        .expect("target/<profile>")
        .to_path_buf()
}

/// The cdylib cargo built for this crate. Cargo always leaves it in
/// `deps/` (its name carries no hash, so it is this build's); it copies it
/// up to `target/<profile>` only when the library itself was a requested
/// target, which a test-only build (`cargo test -p metaroce-nccl --test
/// c_abi`) is not.
pub fn cdylib() -> PathBuf {
    let name = "libmetaroce_nccl.so";
    let candidates = [artifacts().join("deps").join(name), artifacts().join(name)];
    candidates
        .iter()
        .find(|p| p.exists())
        .cloned()
        .unwrap_or_else(|| {
            panic!(
                "{name} missing in {} and its deps/: cargo builds it with the crate",
                artifacts().display()
            )
        })
}

/// A fresh scratch directory.
pub fn scratch(name: &str) -> PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let d = std::env::temp_dir().join(format!(
        "metaroce-nccl-{name}-{}-{nanos}",
        std::process::id()
    ));
    std::fs::create_dir_all(&d).expect("scratch dir");
    d
}

/// Installs the plugin as NCCL finds it: `DIR/libnccl-net-metaroce.so`
/// (a copy of the cdylib, as the README's install step makes).
pub fn install_plugin(dir: &Path) -> PathBuf {
    let lib = dir.join("lib");
    std::fs::create_dir_all(&lib).expect("lib dir");
    std::fs::copy(cdylib(), lib.join("libnccl-net-metaroce.so")).expect("copy plugin");
    lib
}

/// Runs both ranks of the harness; `wrap(rank)` may put each in a network
/// namespace (a command prefix). Returns both outputs.
pub fn run_ranks(
    name: &str,
    args: &[&str],
    env: &[(&str, String)],
    prefix: impl Fn(usize) -> Vec<String>,
    timeout: Duration,
) -> [Output; 2] {
    let dir = scratch(name);
    let lib = install_plugin(&dir);
    let rv = dir.join("rendezvous");
    std::fs::create_dir_all(&rv).expect("rendezvous dir");
    let harness = env!("CARGO_BIN_EXE_metaroce-nccl-harness");
    let mut children = Vec::new();
    for rank in 0..2 {
        let pre = prefix(rank);
        let mut cmd = if pre.is_empty() {
            Command::new(harness)
        } else {
            let mut c = Command::new(&pre[0]);
            c.args(&pre[1..]).arg("env");
            // `ip netns exec` keeps the environment; say it explicitly anyway.
            c.arg(format!("LD_LIBRARY_PATH={}", lib.display()));
            for (k, v) in env {
                c.arg(format!("{k}={v}"));
            }
            c.arg(harness);
            c
        };
        cmd.env("LD_LIBRARY_PATH", &lib)
            .args(["--rank", &rank.to_string(), "--rendezvous"])
            .arg(&rv)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        children.push(cmd.spawn().expect("spawn harness"));
    }
    let deadline = Instant::now() + timeout;
    loop {
        let done = children
            .iter_mut()
            .all(|c| c.try_wait().ok().flatten().is_some());
        if done {
            break;
        }
        if Instant::now() > deadline {
            for c in &mut children {
                let _ = c.kill();
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut outs = children
        .into_iter()
        .map(|c| c.wait_with_output().expect("wait"));
    let outs = [outs.next().expect("rank 0"), outs.next().expect("rank 1")];
    let _ = std::fs::remove_dir_all(&dir);
    outs
}

/// Asserts both ranks succeeded, printing their logs otherwise.
pub fn assert_ok(outs: &[Output; 2]) {
    for (rank, o) in outs.iter().enumerate() {
        let err = String::from_utf8_lossy(&o.stderr);
        eprintln!("--- rank {rank} ---\n{err}");
        assert!(
            o.status.success(),
            "rank {rank} failed: {:?}\n{err}",
            o.status
        );
    }
}
