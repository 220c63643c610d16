//! Sweep the baselines over loss rates on a simulated fabric and print a
//! table (and, with `--json`, one JSON report per line).
//!
//! ```text
//! cargo run --release -p metaroce-sim --example sweep -- \
//!     [--hosts 64] [--spines 8] [--duration-ms 10] [--pattern permutation] \
//!     [--transports rocev2-gbn,irn] [--losses 0,0.001,0.01,0.05,0.1] [--json]
//! ```

use metaroce_sim::{render_table, run_with_progress, Pattern, SimConfig, TransportKind};

fn main() {
    let mut cfg = SimConfig::default();
    let mut transports = vec![TransportKind::RoceV2Gbn, TransportKind::Irn];
    let mut losses = vec![0.0, 0.001, 0.01, 0.05, 0.1];
    let mut json = false;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().unwrap_or_else(|| panic!("{a} needs a value"));
        match a.as_str() {
            "--hosts" => cfg.hosts = val().parse().expect("hosts"),
            "--spines" => cfg.spines = val().parse().expect("spines"),
            "--planes" => cfg.planes = val().parse().expect("planes"),
            "--link-gbps" => cfg.link_gbps = val().parse().expect("link-gbps"),
            "--duration-ms" => {
                cfg.duration_ns = metaroce_sim::time::ms_to_ns(val().parse().expect("ms"))
            }
            "--pattern" => cfg.pattern = val().parse::<Pattern>().expect("pattern"),
            "--flow-bytes" => cfg.flow_bytes = Some(val().parse().expect("flow-bytes")),
            "--seed" => cfg.seed = val().parse().expect("seed"),
            "--fail" => cfg.faults.push(val().parse().expect("fail spec")),
            "--transports" => {
                transports = val()
                    .split(',')
                    .map(|t| t.parse().expect("transport"))
                    .collect()
            }
            "--losses" => losses = val().split(',').map(|l| l.parse().expect("loss")).collect(),
            "--json" => json = true,
            other => panic!("unknown argument {other}"),
        }
    }
    let mut reports = Vec::new();
    for &transport in &transports {
        for &loss in &losses {
            let run_cfg = SimConfig {
                transport,
                loss,
                ..cfg.clone()
            };
            let mut last = 0;
            let mut progress = |p: &metaroce_sim::Progress| {
                let pct = p.sim_ns * 100 / p.duration_ns;
                if pct >= last + 25 {
                    last = pct;
                    eprintln!("  {transport} loss {loss}: {pct}% ({} events)", p.events);
                }
            };
            let r = run_with_progress(&run_cfg, Some(&mut progress)).expect("valid config");
            eprintln!(
                "{transport} loss {loss}: {:.2} Gb/s/host, {} events in {:.2} s ({:.1} M events/s)",
                r.goodput_gbps,
                r.events,
                r.wall_s,
                r.events_per_s / 1e6
            );
            if json {
                println!("{}", serde_json::to_string(&r).expect("serialise"));
            }
            reports.push(r);
        }
    }
    print!("{}", render_table(&reports));
}
