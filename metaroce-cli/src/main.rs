//! `metaroce`: the command-line tool.
//!
//! - `metaroce perf`: throughput and latency of the transport (our
//!   ib_write_bw/iperf3); with no arguments, a self-contained loopback run.
//! - `metaroce perf server` / `metaroce perf client ADDR`: the same between
//!   two hosts, with a TCP control connection as perftest's.
//! - `metaroce fabric`: a namespace testbed of parallel ECMP spine links
//!   (rate limits, cuts, loss) to run `perf` across (root only).
//! - `metaroce sim`: the packet-level fabric simulator, metaroce against the
//!   transports it replaces.

mod fabric;
mod oob;
mod perf;
mod sim;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

/// metaroce: a MetaRoCE-style multipath RDMA transport over UDP.
#[derive(Debug, Parser)]
#[command(name = "metaroce", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Measure throughput and latency (loopback by default).
    Perf(Box<perf::PerfArgs>),
    /// A multipath testbed in network namespaces (root only).
    Fabric(fabric::FabricArgs),
    /// Simulate a data-centre fabric running metaroce or a baseline transport.
    Sim(Box<sim::SimArgs>),
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("METAROCE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Perf(a) => perf::run(*a),
        Command::Sim(a) => sim::run(*a),
        Command::Fabric(a) => fabric::run(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("metaroce: {e:#}");
            ExitCode::FAILURE
        }
    }
}
