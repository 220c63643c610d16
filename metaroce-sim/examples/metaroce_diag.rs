//! Diagnostics of a metaroce run: per-path and per-link imbalance, the
//! core's counters and the simulator's cost per event.
//!
//! ```text
//! cargo run --release -p metaroce-sim --example metaroce_diag -- [hosts] [duration_ms] [loss] [paths]
//! ```

use metaroce_sim::time::ms_to_ns;
use metaroce_sim::topology::LinkKind;
use metaroce_sim::{run_transport, MetaroceFactory, SimConfig, TransportKind};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize, d: &str| args.get(i).cloned().unwrap_or_else(|| d.to_owned());
    let mut cfg = SimConfig {
        transport: TransportKind::Metaroce,
        hosts: arg(0, "64").parse().unwrap(),
        duration_ns: ms_to_ns(arg(1, "3").parse().unwrap()),
        loss: arg(2, "0").parse().unwrap(),
        ..SimConfig::default()
    };
    cfg.metaroce.paths = arg(3, "8").parse().unwrap();
    let factory = MetaroceFactory::new(cfg.metaroce.clone());
    let r = run_transport(&cfg, "metaroce", |env| factory.host(env), None);
    println!("{}", metaroce_sim::render_table(std::slice::from_ref(&r)));
    println!("{:#?}", factory.summary());
    // Link utilisation by kind.
    let secs = r.sim_ms / 1e3;
    let mut by_kind: std::collections::BTreeMap<&str, Vec<f64>> = Default::default();
    for l in &r.links {
        let k = match l.kind {
            LinkKind::HostUp { .. } => "host-up",
            LinkKind::LeafUp { .. } => "leaf-up",
            LinkKind::SpineDown { .. } => "spine-down",
            LinkKind::LeafDown { .. } => "leaf-down",
        };
        // Packets/s × ~4.2 kB ≈ load; report packets per µs.
        by_kind
            .entry(k)
            .or_default()
            .push(l.carried as f64 / secs / 1e6);
    }
    for (k, mut v) in by_kind {
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        let mean = v.iter().sum::<f64>() / v.len() as f64;
        println!(
            "{k:>10}: packets/us min {:.2} mean {:.2} max {:.2} (line rate ~{:.2} data pkts/us)",
            v[0],
            mean,
            v[v.len() - 1],
            cfg.link_gbps * 1e9 / 8.0 / 4194.0 / 1e6
        );
    }
    for (i, s) in factory.path_report().iter().take(usize::MAX).enumerate() {
        println!("conn {i}: {s}");
    }
}
