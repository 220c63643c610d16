//! `metaroce fabric`: a small multipath testbed in network namespaces.
//!
//! Two hosts, `mr-h1` (10.77.1.1) and `mr-h2` (10.77.2.1), each behind a
//! router, `mr-r1` and `mr-r2`; the routers are joined by N parallel veth
//! "spine" links `sp0..spN-1` (10.77.{10+k}.1 ↔ .2) with an ECMP route over
//! all of them, hashed on the L4 5-tuple (`fib_multipath_hash_policy=1`),
//! so each metaroce path (UDP source port) picks a spine as in a real
//! leaf-spine fabric. The hosts send wire-sized packets (`gso_max_segs
//! 1`: their stacks segment GSO and TSO batches, as a NIC would, so that
//! every loss and mark is of one datagram or segment). Optional per-spine
//! rate limits (tc `tbf` at both ends), link cuts (`ip link set down`),
//! random loss (nftables
//! `numgen random`, else `netem`, whichever the system has) and random ECN
//! CE marking of ECN-capable packets (nftables `ip ecn set ce`).
//!
//! Everything lives in four namespaces, `PREFIX-h1`, `PREFIX-h2`,
//! `PREFIX-r1` and `PREFIX-r2`; the prefix is `mr` unless `--prefix` or
//! `METAROCE_FABRIC_PREFIX` says otherwise, so that several fabrics (a test's
//! and a script's) can exist at once. `down` removes exactly those four and
//! is safe to run at any time. Needs root.
//!
//! ```sh
//! sudo metaroce fabric up --spines 4 --rate-mbit 1000
//! sudo ip netns exec mr-h2 metaroce perf server --bind 10.77.2.1:18515 &
//! sudo ip netns exec mr-h1 metaroce perf client 10.77.2.1 -D 5
//! sudo metaroce fabric cut 1; sudo metaroce fabric heal 1
//! sudo metaroce fabric down
//! ```

/// MTU of every fabric link unless `--mtu` says otherwise: jumbo frames,
/// as RDMA fabrics run.
const JUMBO_MTU: u16 = 9000;

use anyhow::{bail, Context};
use clap::{Args, Subcommand};
use std::process::Command;

/// The host addresses (client side, server side).
pub const HOST_IPS: [&str; 2] = ["10.77.1.1", "10.77.2.1"];
/// Longest namespace prefix.
const MAX_PREFIX: usize = 32;

/// The namespaces of one fabric: `{prefix}-h1`, `-h2` (hosts, client side
/// first) and `-r1`, `-r2` (their routers). Interface names inside them do
/// not depend on the prefix (`eth0`, `h1`, `h2`, `sp0`..), so they stay
/// within the kernel's 15 characters.
#[derive(Debug, Clone)]
struct Names {
    hosts: [String; 2],
    routers: [String; 2],
}

impl Names {
    fn new(prefix: &str) -> anyhow::Result<Names> {
        let ok = !prefix.is_empty()
            && prefix.len() <= MAX_PREFIX
            && prefix
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
        if !ok {
            bail!(
                "--prefix must be 1 to {MAX_PREFIX} characters of A-Z, a-z, 0-9, `_` and `-`, not `{prefix}`"
            );
        }
        let n = |s: &str| format!("{prefix}-{s}");
        Ok(Names {
            hosts: [n("h1"), n("h2")],
            routers: [n("r1"), n("r2")],
        })
    }

    fn all(&self) -> impl Iterator<Item = &String> {
        self.hosts.iter().chain(&self.routers)
    }
}
/// Most spine links.
const MAX_SPINES: u8 = 64;

/// Arguments of `metaroce fabric`.
#[derive(Debug, Args)]
pub struct FabricArgs {
    /// Namespace prefix: the fabric is PREFIX-h1, PREFIX-h2, PREFIX-r1, PREFIX-r2.
    #[arg(
        long,
        global = true,
        env = "METAROCE_FABRIC_PREFIX",
        default_value = "mr"
    )]
    prefix: String,
    #[command(subcommand)]
    cmd: FabricCmd,
}

#[derive(Debug, Subcommand)]
enum FabricCmd {
    /// Build the testbed (tearing down any earlier one first).
    Up {
        /// Parallel spine links between the routers.
        #[arg(long, default_value_t = 2)]
        spines: u8,
        /// Rate limit of each spine link and direction, Mbit/s (none if absent).
        #[arg(long)]
        rate_mbit: Option<u32>,
        /// MTU of every link, bytes: 9000 (jumbo frames, as RDMA fabrics
        /// run) or smaller, e.g. 1500 for standard Ethernet frames (a
        /// `perf` client keeps its datagrams within its route's MTU).
        #[arg(long, default_value_t = JUMBO_MTU, value_parser = clap::value_parser!(u16).range(1280..=9000))]
        mtu: u16,
    },
    /// Remove the fabric's namespaces (safe to repeat).
    Down,
    /// Show the namespaces, spine links, routes and qdiscs.
    Status,
    /// Take spine link K down (both ends).
    Cut {
        /// Spine index.
        k: u8,
    },
    /// Bring spine link K back up.
    Heal {
        /// Spine index.
        k: u8,
    },
    /// Drop PCT percent of packets at random on spine links (0 removes the
    /// loss; 100 on one spine is a silent blackhole: its routes stay up).
    Loss {
        /// Percent, 0 to 100.
        pct: f64,
        /// Which spine: an index or `all`.
        #[arg(long, default_value = "all")]
        link: String,
    },
    /// CE-mark PCT percent of ECN-capable packets at random on spine links (0 stops it).
    Ecn {
        /// Percent, 0 to 100.
        pct: f64,
        /// Which spine: an index or `all`.
        #[arg(long, default_value = "all")]
        link: String,
    },
}

/// Runs `metaroce fabric`.
pub fn run(a: FabricArgs) -> anyhow::Result<()> {
    let names = Names::new(&a.prefix)?;
    require_root()?;
    let f = &names;
    match a.cmd {
        FabricCmd::Up {
            spines,
            rate_mbit,
            mtu,
        } => up(f, spines, rate_mbit, mtu),
        FabricCmd::Down => {
            down(f);
            println!("fabric {} down", a.prefix);
            Ok(())
        }
        FabricCmd::Status => status(f),
        FabricCmd::Cut { k } => set_spine(f, k, false),
        FabricCmd::Heal { k } => set_spine(f, k, true),
        FabricCmd::Loss { pct, link } => loss(f, pct, &link),
        FabricCmd::Ecn { pct, link } => ecn(f, pct, &link),
    }
}

/// Fails with a clear message unless we are root.
pub fn require_root() -> anyhow::Result<()> {
    let out = Command::new("id")
        .arg("-u")
        .output()
        .context("running `id -u`")?;
    let uid = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if uid != "0" {
        bail!("metaroce fabric needs root (network namespaces, veth, tc); `id -u` says {uid}");
    }
    Ok(())
}

/// Runs a command, failing with its stderr.
fn sh(prog: &str, args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new(prog)
        .args(args)
        .output()
        .with_context(|| format!("running {prog}"))?;
    if !out.status.success() {
        bail!(
            "`{prog} {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// `ip -n NS ARGS...`
fn ip(ns: &str, args: &[&str]) -> anyhow::Result<()> {
    let mut v = vec!["-n", ns];
    v.extend_from_slice(args);
    sh("ip", &v)
}

fn sysctl(ns: &str, kv: &str) -> anyhow::Result<()> {
    sh("ip", &["netns", "exec", ns, "sysctl", "-qw", kv])
}

/// The fabric's namespaces that exist.
fn namespaces(f: &Names) -> Vec<String> {
    let out = Command::new("ip").args(["netns", "list"]).output();
    let Ok(out) = out else { return Vec::new() };
    let have: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect();
    f.all().filter(|n| have.contains(n)).cloned().collect()
}

/// Removes the fabric's namespaces (their veths go with them). Never fails.
fn down(f: &Names) {
    for ns in namespaces(f) {
        let _ = sh("ip", &["netns", "del", &ns]);
    }
}

/// Spine links that exist (by index).
fn spines(f: &Names) -> Vec<u8> {
    let out = Command::new("ip")
        .args(["-n", &f.routers[0], "-br", "link"])
        .output();
    let Ok(out) = out else { return Vec::new() };
    let mut v: Vec<u8> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split(['@', ' ']).next())
        .filter_map(|n| n.strip_prefix("sp")?.parse().ok())
        .collect();
    v.sort_unstable();
    v
}

/// Builds the testbed.
fn up(f: &Names, n: u8, rate_mbit: Option<u32>, mtu: u16) -> anyhow::Result<()> {
    if n == 0 || n > MAX_SPINES {
        bail!("--spines must be between 1 and {MAX_SPINES}");
    }
    if rate_mbit == Some(0) {
        bail!("--rate-mbit must be positive");
    }
    down(f);
    let r = build(f, n, rate_mbit, mtu);
    if r.is_err() {
        down(f);
    }
    r?;
    println!(
        "fabric up: {} ({}) ↔ {} ({}) over {n} spine link(s){}, MTU {mtu}",
        f.hosts[0],
        HOST_IPS[0],
        f.hosts[1],
        HOST_IPS[1],
        rate_mbit.map_or(String::new(), |r| format!(" of {r} Mbit/s"))
    );
    Ok(())
}

fn build(f: &Names, n: u8, rate_mbit: Option<u32>, mtu: u16) -> anyhow::Result<()> {
    let (hosts, routers) = (&f.hosts, &f.routers);
    let mtu = mtu.to_string();
    for ns in f.all() {
        sh("ip", &["netns", "add", ns])?;
        ip(ns, &["link", "set", "lo", "up"])?;
    }
    // Host legs: eth0 in the host, h1/h2 in its router.
    for (i, (h, r)) in hosts.iter().zip(routers).enumerate() {
        let leg = format!("h{}", i + 1);
        ip(
            h,
            &[
                "link", "add", "eth0", "type", "veth", "peer", "name", &leg, "netns", r,
            ],
        )?;
        let net = format!("10.77.{}", i + 1);
        ip(h, &["addr", "add", &format!("{net}.1/24"), "dev", "eth0"])?;
        // Jumbo frames unless asked otherwise, as RDMA fabrics run: a 4 KiB
        // payload plus headers must not be fragmented (a fragment has no
        // UDP port to hash on); with smaller frames, perf sizes its
        // datagrams to the route.
        ip(h, &["link", "set", "eth0", "mtu", &mtu])?;
        ip(r, &["link", "set", &leg, "mtu", &mtu])?;
        // Wire-sized packets from the hosts, as a NIC puts them on a real
        // wire: veth would otherwise carry a GSO/TSO batch (up to 64 KiB,
        // 16 of metaroce's datagrams or 44 TCP segments) through the
        // routers as one packet, and a random drop would take the whole
        // batch, a burst of losses on one path instead of the independent
        // losses `fabric loss` stands for. One segment per packet makes the
        // host's stack segment before it sends.
        ip(h, &["link", "set", "eth0", "gso_max_segs", "1"])?;
        ip(h, &["link", "set", "eth0", "up"])?;
        ip(
            h,
            &["route", "add", "default", "via", &format!("{net}.254")],
        )?;
        ip(r, &["addr", "add", &format!("{net}.254/24"), "dev", &leg])?;
        ip(r, &["link", "set", &leg, "up"])?;
    }
    for r in routers {
        for kv in [
            "net.ipv4.ip_forward=1",
            "net.ipv4.fib_multipath_hash_policy=1",
            "net.ipv4.conf.all.rp_filter=0",
            "net.ipv4.conf.default.rp_filter=0",
            "net.ipv4.conf.all.ignore_routes_with_linkdown=1",
        ] {
            sysctl(r, kv)?;
        }
    }
    for k in 0..n {
        let dev = format!("sp{k}");
        ip(
            &routers[0],
            &[
                "link",
                "add",
                &dev,
                "type",
                "veth",
                "peer",
                "name",
                &dev,
                "netns",
                &routers[1],
            ],
        )?;
        for (side, r) in routers.iter().enumerate() {
            ip(
                r,
                &[
                    "addr",
                    "add",
                    &format!("10.77.{}.{}/24", 10 + u32::from(k), side + 1),
                    "dev",
                    &dev,
                ],
            )?;
            sysctl(r, &format!("net.ipv4.conf.{dev}.rp_filter=0"))?;
            ip(r, &["link", "set", &dev, "mtu", &mtu])?;
            ip(r, &["link", "set", &dev, "up"])?;
            if let Some(rate) = rate_mbit {
                // A burst of 4 ms at the rate (at least a few jumbo frames).
                let burst = (u64::from(rate) * 1_000_000 / 8 / 250).max(64 * 1024);
                sh(
                    "tc",
                    &[
                        "-n",
                        r,
                        "qdisc",
                        "replace",
                        "dev",
                        &dev,
                        "root",
                        "tbf",
                        "rate",
                        &format!("{rate}mbit"),
                        "burst",
                        &burst.to_string(),
                        "latency",
                        "20ms",
                    ],
                )?;
            }
        }
    }
    // ECMP over every spine, each way.
    for (side, r) in routers.iter().enumerate() {
        let dst = format!("10.77.{}.0/24", 2 - side);
        let mut args = vec!["route".to_string(), "add".into(), dst];
        for k in 0..n {
            args.extend([
                "nexthop".into(),
                "via".into(),
                format!("10.77.{}.{}", 10 + u32::from(k), 2 - side),
                "dev".into(),
                format!("sp{k}"),
                "weight".into(),
                "1".into(),
            ]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        ip(r, &args)?;
    }
    Ok(())
}

fn set_spine(f: &Names, k: u8, up: bool) -> anyhow::Result<()> {
    if !spines(f).contains(&k) {
        bail!("no spine link {k} (is the fabric up? `metaroce fabric status`)");
    }
    let dev = format!("sp{k}");
    let state = if up { "up" } else { "down" };
    for r in &f.routers {
        ip(r, &["link", "set", &dev, state])?;
    }
    println!("spine {k} {state}");
    Ok(())
}

fn have(prog: &str) -> bool {
    Command::new(prog)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// The spines `link` names (`all` or an index), checking the fabric is up.
fn spine_targets(f: &Names, link: &str) -> anyhow::Result<(Vec<u8>, Vec<u8>)> {
    let all = spines(f);
    if all.is_empty() {
        bail!("the fabric is not up (`metaroce fabric up`)");
    }
    let targets: Vec<u8> = if link == "all" {
        all.clone()
    } else {
        let k: u8 = link
            .parse()
            .map_err(|_| anyhow::anyhow!("--link takes a spine index or `all`, not `{link}`"))?;
        if !all.contains(&k) {
            bail!("no spine link {k}");
        }
        vec![k]
    };
    Ok((all, targets))
}

/// Puts `rule` (an nft statement list, or none) into the per-spine chain
/// `sp{k}` of table `inet {table}` in both routers, for each target spine:
/// a forward-hook chain at `priority` jumps by output interface to one chain
/// per spine, so each spine's rule can be replaced on its own.
fn nft_per_spine(
    f: &Names,
    table: &str,
    priority: i32,
    all: &[u8],
    targets: &[u8],
    rule: Option<&str>,
) -> anyhow::Result<()> {
    for r in &f.routers {
        let nft = |args: &[&str]| {
            let mut v = vec!["netns", "exec", r, "nft"];
            v.extend_from_slice(args);
            sh("ip", &v)
        };
        let fresh = nft(&["list", "table", "inet", table]).is_err();
        if fresh {
            nft(&["add", "table", "inet", table])?;
            // (`fwd` is an nft keyword: the chain is `spines`.)
            nft(&[&format!(
                "add chain inet {table} spines {{ type filter hook forward priority {priority} ; policy accept ; }}"
            )])?;
            for k in all {
                nft(&["add", "chain", "inet", table, &format!("sp{k}")])?;
                nft(&[&format!(
                    "add rule inet {table} spines oifname \"sp{k}\" jump sp{k}"
                )])?;
            }
        }
        for k in targets {
            nft(&["flush", "chain", "inet", table, &format!("sp{k}")])?;
            if let Some(rule) = rule {
                nft(&[&format!("add rule inet {table} sp{k} {rule}")])?;
            }
        }
    }
    Ok(())
}

fn loss(f: &Names, pct: f64, link: &str) -> anyhow::Result<()> {
    if !(0.0..=100.0).contains(&pct) {
        bail!("loss must be between 0 and 100 percent");
    }
    let (all, targets) = spine_targets(f, link)?;
    if have("nft") {
        // numgen random mod 10000 < pct*100: drop that fraction, per spine,
        // as packets leave each router.
        let per10k = (pct * 100.0).round() as u32;
        // 100%: a silent blackhole (routes stay, everything is dropped).
        let rule = if per10k >= 10_000 {
            "drop".to_string()
        } else {
            format!("numgen random mod 10000 < {per10k} drop")
        };
        nft_per_spine(
            f,
            "mr_loss",
            0,
            &all,
            &targets,
            (per10k > 0).then_some(&*rule),
        )?;
    } else {
        // No nftables: netem on the spine's egress at both ends (replaces a
        // rate limit there).
        for r in &f.routers {
            for k in &targets {
                let dev = format!("sp{k}");
                if pct == 0.0 {
                    let _ = sh("tc", &["-n", r, "qdisc", "del", "dev", &dev, "root"]);
                    continue;
                }
                sh(
                    "tc",
                    &[
                        "-n", r, "qdisc", "replace", "dev", &dev, "root", "netem", "loss",
                        &format!("{pct}%"),
                    ],
                )
                .context(
                    "no way to drop packets here: `nft` is not installed and the kernel has no sch_netem",
                )?;
            }
        }
    }
    println!("loss {pct}% on spine(s) {targets:?}");
    Ok(())
}

/// CE-marks `pct` percent of the ECN-capable packets crossing the spines
/// (nftables `ip ecn set ce`; the kernel here has no RED to mark by queue).
fn ecn(f: &Names, pct: f64, link: &str) -> anyhow::Result<()> {
    if !(0.0..=100.0).contains(&pct) {
        bail!("the marked fraction must be between 0 and 100 percent");
    }
    let (all, targets) = spine_targets(f, link)?;
    if !have("nft") {
        bail!("ECN marking needs nftables (`nft`): install the nftables package");
    }
    let per10k = (pct * 100.0).round() as u32;
    let rule = format!("ip ecn != not-ect numgen random mod 10000 < {per10k} ip ecn set ce");
    // Before the loss table: a packet is marked, then maybe dropped.
    nft_per_spine(
        f,
        "mr_ecn",
        -10,
        &all,
        &targets,
        (per10k > 0).then_some(&*rule),
    )?;
    println!("ECN CE marks on {pct}% of ECT packets on spine(s) {targets:?}");
    Ok(())
}

fn status(f: &Names) -> anyhow::Result<()> {
    let ns = namespaces(f);
    if ns.is_empty() {
        println!(
            "fabric down (none of {} exists)",
            f.all().cloned().collect::<Vec<_>>().join(" ")
        );
        return Ok(());
    }
    println!("namespaces: {}", ns.join(" "));
    for r in &f.routers {
        if !ns.iter().any(|n| n == r) {
            continue;
        }
        for args in [
            vec!["-n", r, "-br", "link"],
            vec![
                "-n",
                r,
                "route",
                "show",
                "10.77.0.0/16",
                "root",
                "10.77.0.0/16",
            ],
        ] {
            let out = Command::new("ip").args(&args).output()?;
            println!("{r}: ip {}", args[2..].join(" "));
            print!("{}", String::from_utf8_lossy(&out.stdout));
        }
        let out = Command::new("tc")
            .args(["-n", r, "qdisc", "show"])
            .output()?;
        println!("{r}: tc qdisc");
        for l in String::from_utf8_lossy(&out.stdout).lines() {
            if l.contains("dev sp") {
                println!("{l}");
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_prefix() {
        let f = Names::new("mrt42").unwrap();
        assert_eq!(f.hosts, ["mrt42-h1", "mrt42-h2"]);
        assert_eq!(f.routers, ["mrt42-r1", "mrt42-r2"]);
        assert_eq!(Names::new("mr").unwrap().routers[1], "mr-r2");
    }

    #[test]
    fn bad_prefixes_are_refused() {
        for p in ["", "a b", "x/y", "é", &"p".repeat(MAX_PREFIX + 1)] {
            let e = Names::new(p).unwrap_err().to_string();
            assert!(e.contains("--prefix"), "{p:?}: {e}");
        }
        assert!(Names::new(&"p".repeat(MAX_PREFIX)).is_ok());
    }
}
