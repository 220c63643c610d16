//! `metaroce sim`: the packet-level fabric simulator (metaroce-sim), with
//! metaroce (the real core) and the baselines it replaces.
//!
//! ```text
//! metaroce sim --transport metaroce --hosts 64 --spines 8 --loss 0.01
//! metaroce sim --transport all --sweep loss=0,0.001,0.01,0.05,0.1 --json
//! ```
//!
//! The kernel fabric of `metaroce fabric up --spines 4 --rate-mbit 200`
//! (two hosts, four spines shaped by `tc tbf rate 200mbit burst 100000
//! latency 20ms`, the core's own timers), with receiver-thread stalls, a
//! gray spine or a silent blackhole:
//!
//! ```text
//! metaroce sim --hosts 2 --hosts-per-leaf 1 --spines 4 --link-gbps 10 \
//!   --spine-shaper 0.2:100000:20ms --ecn off --pattern incast:1 --paths 16 \
//!   --min-rto-us 2000 --ack-delay-us 20 --initial-window 262144 --duration-ms 6000 \
//!   [--loss 0.01] [--host-stall 0.3:1000] [--fail spine:0@0=0.02] [--fail spine:0@2000=blackhole]
//! ```

use std::io::IsTerminal;
use std::time::Instant;

use anyhow::{bail, Context};
use clap::Args;
use metaroce_sim::time::{ms_to_ns, NS_PER_US};
use metaroce_sim::{
    render_table, run_with_progress, FaultSpec, LossLinks, Pattern, Progress, SimConfig, SimReport,
    TransportKind,
};

/// Arguments of `metaroce sim`.
#[derive(Debug, Args)]
pub struct SimArgs {
    /// Transport: metaroce, rocev2-gbn, irn, blast; a comma list, or `all`
    /// (metaroce, rocev2-gbn, irn).
    #[arg(long, default_value = "metaroce")]
    pub transport: String,
    /// Number of hosts.
    #[arg(long, default_value_t = 64)]
    pub hosts: u32,
    /// Spines per plane.
    #[arg(long, default_value_t = 8)]
    pub spines: u32,
    /// Independent planes (NIC ports per host, one address each). metaroce spreads each connection's paths over them (--paths 16×P keeps the default per plane).
    #[arg(long, default_value_t = 1)]
    pub planes: u32,
    /// Hosts per leaf (default: as many as spines, 1:1 subscription).
    #[arg(long)]
    pub hosts_per_leaf: Option<u32>,
    /// Host link rate in Gbit/s.
    #[arg(long, default_value_t = 100.0)]
    pub link_gbps: f64,
    /// Random loss probability on the loss links.
    #[arg(long, default_value_t = 0.0)]
    pub loss: f64,
    /// Links that drop at random: spine-to-leaf, leaf-to-host or all.
    #[arg(long, default_value = "spine-to-leaf")]
    pub loss_links: String,
    /// Traffic: permutation, all-to-all, incast:K or allreduce.
    #[arg(long, default_value = "permutation")]
    pub pattern: String,
    /// Bytes per flow (default: long-running flows; all-reduce steps of 1 MiB).
    #[arg(long)]
    pub flow_bytes: Option<u64>,
    /// Simulated time in milliseconds.
    #[arg(long, default_value_t = 10.0)]
    pub duration_ms: f64,
    /// A fault, `TARGET@START_MS[-END_MS][=GBPS|=blackhole]`, e.g. `spine:3@2`
    /// (spine 3 fails at 2 ms; routing then avoids it), `spine:3@2-5`,
    /// `link:0-1@1`, `plane:1@0`, `host:5@1=25` (degrade to 25 Gbit/s),
    /// `spine:3@2=10` (a gray spine: up, at 10 Gbit/s), `spine:3@2=blackhole`
    /// (a silent blackhole: drops everything, routing keeps hashing onto it).
    /// Repeatable.
    #[arg(long)]
    pub fail: Vec<String>,
    /// Shape every leaf↔spine port (both directions) with a token bucket, as
    /// `tc tbf`: `RATE_GBPS:BURST_BYTES[:QUEUE]`, QUEUE in bytes or as a
    /// latency (`20ms`, `500us`: the rate × latency + burst, as tc computes
    /// it; default: --buffer-bytes). The port sends at line rate while
    /// tokens last; tokens refill at RATE up to BURST. `0.2:100000:20ms` is
    /// `tc tbf rate 200mbit burst 100000 latency 20ms`.
    #[arg(long, value_name = "RATE_GBPS:BURST_BYTES[:QUEUE]")]
    pub spine_shaper: Option<String>,
    /// Stall every host's processing now and then: `RATE_PER_MS:MEAN_US[:exp|fixed]`.
    /// Running periods are exponential of mean 1/RATE ms (stalls start as a
    /// Poisson process of RATE per ms of running time), stalls last MEAN µs
    /// on average (exponential) or exactly (fixed). A stalled host sends
    /// nothing new, its timers wait, and packets reaching it are handed over
    /// together when the stall ends. E.g. `0.5:500` (a 500 µs stall every 2 ms).
    #[arg(long, value_name = "RATE_PER_MS:MEAN_US[:exp|fixed]")]
    pub host_stall: Option<String>,
    /// Largest transport payload per packet, bytes (metaroce rounds full
    /// segments down to a multiple of 64).
    #[arg(long, default_value_t = 4096)]
    pub mtu: u32,
    /// Seed of every random choice.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// metaroce: paths per connection.
    #[arg(long, default_value_t = metaroce_proto::consts::DEFAULT_PATHS)]
    pub paths: u8,
    /// metaroce: bytes per RDMA WRITE (default 256 KiB; 64 KiB for all-to-all).
    #[arg(long)]
    pub chunk_bytes: Option<u32>,
    /// metaroce: WRITEs kept posted per flow (default 8; 2 for all-to-all).
    #[arg(long)]
    pub outstanding: Option<u32>,
    /// metaroce: minimum RTO in µs (default: 5 × base RTT, at least 20 µs).
    #[arg(long)]
    pub min_rto_us: Option<u64>,
    /// metaroce: delayed-ACK timer in µs (default 2; the core's own default,
    /// which real hosts run, is 20).
    #[arg(long)]
    pub ack_delay_us: Option<u64>,
    /// metaroce: initial congestion window in bytes (default: one BDP).
    #[arg(long)]
    pub initial_window: Option<u64>,
    /// metaroce: largest congestion window in bytes (default: the core's).
    #[arg(long)]
    pub max_window: Option<u64>,
    /// metaroce: verify the placed bytes of every n-th WRITE (0: never).
    #[arg(long, default_value_t = 1)]
    pub verify_every: u32,
    /// Switch buffer per output port, bytes.
    #[arg(long)]
    pub buffer_bytes: Option<u64>,
    /// ECN marking threshold per switch port, bytes.
    #[arg(long)]
    pub ecn_threshold_bytes: Option<u64>,
    /// Switches mark ECN above the threshold: on or off (ablation).
    #[arg(long, default_value = "on", value_parser = on_off, action = clap::ArgAction::Set)]
    pub ecn: bool,
    /// metaroce: receiver hints (each receiver grants its senders a share of
    /// its link rate in every ACK): on or off (ablation).
    #[arg(long, default_value = "on", value_parser = on_off, action = clap::ArgAction::Set)]
    pub receiver_hints: bool,
    /// Width of a time-series bin in µs (goodput series, recovery, convergence).
    #[arg(long, default_value_t = 10.0)]
    pub bin_us: f64,
    /// A grid over one parameter, e.g. `loss=0,0.001,0.01,0.05,0.1`.
    #[arg(long)]
    pub sweep: Option<String>,
    /// Print JSON (one object, or an array for several runs) instead of a table.
    #[arg(long)]
    pub json: bool,
}

fn on_off(s: &str) -> Result<bool, String> {
    match s {
        "on" | "true" | "1" => Ok(true),
        "off" | "false" | "0" => Ok(false),
        _ => Err(format!("expected on or off, got {s:?}")),
    }
}

/// The configurations to run, in output order.
fn configs(a: &SimArgs) -> anyhow::Result<Vec<SimConfig>> {
    let transports: Vec<TransportKind> = if a.transport == "all" {
        vec![
            TransportKind::Metaroce,
            TransportKind::RoceV2Gbn,
            TransportKind::Irn,
        ]
    } else {
        a.transport
            .split(',')
            .map(|t| t.trim().parse::<TransportKind>())
            .collect::<Result<_, _>>()?
    };
    let pattern: Pattern = a.pattern.parse()?;
    let mut base = SimConfig {
        hosts: a.hosts,
        spines: a.spines,
        planes: a.planes,
        hosts_per_leaf: a.hosts_per_leaf,
        link_gbps: a.link_gbps,
        loss: a.loss,
        loss_links: a.loss_links.parse::<LossLinks>()?,
        flow_bytes: a.flow_bytes,
        duration_ns: ms_to_ns(a.duration_ms),
        faults: a
            .fail
            .iter()
            .map(|f| f.parse::<FaultSpec>())
            .collect::<Result<_, _>>()?,
        seed: a.seed,
        mtu: a.mtu,
        spine_shaper: a.spine_shaper.as_deref().map(str::parse).transpose()?,
        host_stalls: a.host_stall.as_deref().map(str::parse).transpose()?,
        ..SimConfig::default()
    };
    if let Some(b) = a.buffer_bytes {
        base.buffer_bytes = b;
    }
    if let Some(k) = a.ecn_threshold_bytes {
        base.ecn_threshold_bytes = k;
    }
    base.ecn_marking = a.ecn;
    if !(a.bin_us > 0.0 && a.bin_us.is_finite()) {
        bail!("--bin-us must be positive");
    }
    base.bin_ns = ((a.bin_us * NS_PER_US as f64).round() as u64).max(1);
    let many_flows = matches!(pattern, Pattern::AllToAll);
    base.pattern = pattern;
    let m = &mut base.metaroce;
    m.paths = a.paths;
    m.chunk_bytes = a
        .chunk_bytes
        .unwrap_or(if many_flows { 64 * 1024 } else { 256 * 1024 });
    m.outstanding = a
        .outstanding
        .unwrap_or(if many_flows { 2 } else { m.outstanding });
    m.min_rto_ns = a.min_rto_us.map(|us| us * NS_PER_US);
    m.initial_window = a.initial_window;
    if let Some(us) = a.ack_delay_us {
        m.ack_delay_ns = us * NS_PER_US;
    }
    m.max_window = a.max_window;
    m.verify_every = a.verify_every;
    m.receiver_hints = a.receiver_hints;
    if a.duration_ms <= 0.0 || !a.duration_ms.is_finite() {
        bail!("--duration-ms must be positive");
    }
    let losses: Vec<f64> = match &a.sweep {
        None => vec![a.loss],
        Some(spec) => {
            let (key, values) = spec
                .split_once('=')
                .context("--sweep expects KEY=V1,V2,... (e.g. loss=0,0.01)")?;
            if key.trim() != "loss" {
                bail!("--sweep supports only `loss` (got {key:?})");
            }
            values
                .split(',')
                .map(|v| {
                    v.trim()
                        .parse::<f64>()
                        .with_context(|| format!("bad loss value {v:?}"))
                })
                .collect::<anyhow::Result<_>>()?
        }
    };
    let mut out = Vec::new();
    for &transport in &transports {
        for &loss in &losses {
            let c = SimConfig {
                transport,
                loss,
                ..base.clone()
            };
            c.validate()?;
            out.push(c);
        }
    }
    Ok(out)
}

/// The derived metrics of a run (recovery, incast), one line each, if any.
fn render_metrics(r: &SimReport) -> String {
    let us = |v: Option<f64>| v.map_or_else(|| "never".to_owned(), |x| format!("{x:.0} us"));
    let mut out = String::new();
    if r.goodput_after_fault_gbps.is_some() {
        out += &format!(
            "{} loss {}: recovery to 85% of line {} (bins of {} us); goodput after the fault {:.2} Gb/s\n",
            r.transport,
            r.loss,
            us(r.recovery_us),
            r.bin_us,
            r.goodput_after_fault_gbps.unwrap_or(0.0)
        );
    }
    if let Some(m) = &r.metaroce {
        let per = |n: u64| {
            if m.data_packets_sent == 0 {
                0.0
            } else {
                n as f64 / m.data_packets_sent as f64
            }
        };
        out += &format!(
            "{} loss {}: {} data packets, {} retransmitted ({:.2}%), {} RTO fires ({:.2} per 10,000), {} declared lost, {} of them spurious\n",
            r.transport,
            r.loss,
            m.data_packets_sent,
            m.retransmits,
            100.0 * per(m.retransmits),
            m.rto_fires,
            1e4 * per(m.rto_fires),
            m.packets_lost,
            m.spurious_losses
        );
    }
    if let Some(u) = r.receiver_utilization {
        out += &format!(
            "{} loss {}: receiver link {:.1}% utilised, Jain {:.4}, receiver queue max {:.1} KB, convergence {} (windows of {:.0} us)\n",
            r.transport,
            r.loss,
            100.0 * u,
            r.jain_fairness.unwrap_or(0.0),
            r.receiver_max_queue_bytes.unwrap_or(0) as f64 / 1e3,
            us(r.convergence_us),
            r.convergence_window_us.unwrap_or(0.0)
        );
    }
    out
}

pub fn run(a: SimArgs) -> anyhow::Result<()> {
    let configs = configs(&a)?;
    let tty = std::io::stderr().is_terminal();
    let total = configs.len();
    let mut reports: Vec<SimReport> = Vec::with_capacity(total);
    for (i, cfg) in configs.iter().enumerate() {
        let label = format!(
            "[{}/{}] {} loss {}",
            i + 1,
            total,
            cfg.transport.name(),
            cfg.loss
        );
        let started = Instant::now();
        let mut last_print = Instant::now();
        let mut progress = |p: &Progress| {
            if last_print.elapsed().as_millis() >= 250 {
                last_print = Instant::now();
                eprint!(
                    "\r{label}: {:5.1}% of {:.1} ms simulated, {} events, {:.1} s   ",
                    100.0 * p.sim_ns as f64 / p.duration_ns.max(1) as f64,
                    p.duration_ns as f64 / 1e6,
                    p.events,
                    started.elapsed().as_secs_f64()
                );
            }
        };
        let r = if tty {
            run_with_progress(cfg, Some(&mut progress))?
        } else {
            run_with_progress(cfg, None)?
        };
        if tty {
            eprintln!(
                "\r{label}: {:.2} Gb/s per host, {} events in {:.2} s{:20}",
                r.goodput_gbps, r.events, r.wall_s, ""
            );
        }
        reports.push(r);
    }
    if a.json {
        let s = if reports.len() == 1 && a.sweep.is_none() {
            serde_json::to_string_pretty(&reports[0])?
        } else {
            serde_json::to_string_pretty(&reports)?
        };
        println!("{s}");
    } else {
        print!("{}", render_table(&reports));
        let metrics: String = reports.iter().map(render_metrics).collect();
        if !metrics.is_empty() {
            print!("\n{metrics}");
        }
        if reports.iter().any(|r| r.bytes_lost > 0) {
            println!("\nWARNING: some runs lost application bytes (column `lost B`).");
        }
    }
    Ok(())
}
