//! What the `metaroce` process tests share: the binary, children that die
//! with the test, bounded runs, `perf server` start-up, and a namespace
//! fabric of a test's own.

#![allow(dead_code)] // each test file uses its own part

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The `metaroce` binary under test.
pub const BIN: &str = env!("CARGO_BIN_EXE_metaroce");

/// Fails the test, showing `what` and the child's stderr, unless `out`
/// is a successful exit.
pub fn assert_success(out: &Output, what: impl std::fmt::Display) {
    assert!(
        out.status.success(),
        "{what}{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Checks a perf `--json` report: messages ran, every byte of each was
/// verified, none was corrupt.
pub fn assert_all_verified(v: &serde_json::Value) {
    assert_eq!(v["corrupt_bytes"], 0, "{v}");
    let iters = v["iterations"].as_u64().unwrap();
    assert!(iters > 0, "{v}");
    assert_eq!(
        v["verified_bytes"].as_u64().unwrap(),
        iters * v["msg_size"].as_u64().unwrap(),
        "{v}"
    );
}

/// A child process killed when dropped (a failing test leaves nothing behind).
pub struct Guard(pub Child);

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Runs `cmd` to completion with its output captured, killed after `limit`.
/// Both pipes are read while it runs: a child that writes more than a pipe
/// holds (a `--json -a` report) would otherwise block on the write.
pub fn bounded(mut cmd: Command, limit: Duration) -> Output {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let drain = |mut r: Box<dyn std::io::Read + Send>| {
        std::thread::spawn(move || {
            let mut v = Vec::new();
            let _ = r.read_to_end(&mut v);
            v
        })
    };
    let out = drain(Box::new(child.stdout.take().unwrap()));
    let err = drain(Box::new(child.stderr.take().unwrap()));
    let t0 = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if t0.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{cmd:?} did not finish within {limit:?}: {}",
                String::from_utf8_lossy(&err.join().unwrap_or_default())
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Output {
        status,
        stdout: out.join().unwrap_or_default(),
        stderr: err.join().unwrap_or_default(),
    }
}

/// Starts a `perf server` command and reads the address it prints on its
/// first line ("listening on ADDR"); what it prints later is drained so it
/// never blocks on us.
pub fn start_server(mut cmd: Command) -> (Guard, String) {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the server");
    let stdout = child.stdout.take().unwrap();
    let guard = Guard(child);
    let mut rd = BufReader::new(stdout);
    let mut line = String::new();
    rd.read_line(&mut line)
        .expect("read the server's first line");
    std::thread::spawn(move || std::io::copy(&mut rd, &mut std::io::sink()));
    let addr = line
        .split("listening on ")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .unwrap_or_else(|| panic!("no address in {line:?}"))
        .to_string();
    (guard, addr)
}

/// Waits for a `--once` server to exit and says whether it succeeded.
pub fn server_exit(mut g: Guard, limit: Duration) -> bool {
    let t0 = Instant::now();
    while t0.elapsed() < limit {
        if let Some(st) = g.0.try_wait().unwrap() {
            return st.success();
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("the --once server did not exit within {limit:?}");
}

/// Whether the test runs as root (namespace fabrics need it).
pub fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

/// The network namespaces that exist now.
pub fn netns_list() -> String {
    let out = Command::new("ip").args(["netns", "list"]).output().unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A `metaroce fabric` of a test's own: namespace prefix `TAG<pid>`, so it
/// never touches a fabric someone else brought up. Dropped, it runs
/// `metaroce fabric down` and checks that no namespace of it is left (a
/// test that already panicked is not failed again). Make one only as root.
pub struct TestFabric {
    prefix: String,
}

impl TestFabric {
    /// The fabric of prefix `tag` followed by this process's id (not up yet).
    pub fn new(tag: &str) -> Self {
        TestFabric {
            prefix: format!("{tag}{}", std::process::id()),
        }
    }

    /// The namespace prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The namespace of `role` (`h1`, `h2`, `r1`, `r2`).
    pub fn ns(&self, role: &str) -> String {
        format!("{}-{role}", self.prefix)
    }

    /// A fabric of prefix `tag` brought up with `fabric up ARGS`, and the
    /// command's output; `None` (having said why) without root or where
    /// namespaces cannot be made, so that the test skips.
    pub fn start(tag: &str, args: &[&str]) -> Option<(Self, Output)> {
        if !is_root() {
            println!("skipped: needs root (network namespaces, tc, nftables)");
            return None;
        }
        let fab = TestFabric::new(tag);
        let up = fab.up(args)?;
        Some((fab, up))
    }

    /// `metaroce fabric up ARGS`: its output, or `None` (having said why)
    /// where this host cannot create network namespaces (root inside a
    /// container without CAP_SYS_ADMIN or veth support), so that the test
    /// skips. Any other failure fails the test.
    pub fn up(&self, args: &[&str]) -> Option<Output> {
        let up = self.metaroce(&[&["fabric", "up"], args].concat());
        if !up.status.success() {
            let err = String::from_utf8_lossy(&up.stderr);
            if err.contains("netns") || err.contains("Operation not permitted") {
                println!("skipped: cannot create network namespaces here: {err}");
                return None;
            }
            panic!("fabric up failed: {err}");
        }
        Some(up)
    }

    /// `metaroce ARGS`, with this fabric's prefix in the environment.
    pub fn metaroce(&self, args: &[&str]) -> Output {
        Command::new(BIN)
            .args(args)
            .env("METAROCE_FABRIC_PREFIX", &self.prefix)
            .output()
            .expect("run metaroce")
    }
}

impl Drop for TestFabric {
    fn drop(&mut self) {
        let out = self.metaroce(&["fabric", "down"]);
        assert!(out.status.success() || std::thread::panicking());
        let left = netns_list();
        assert!(
            !left.contains(&self.prefix) || std::thread::panicking(),
            "fabric down left {left}"
        );
    }
}
