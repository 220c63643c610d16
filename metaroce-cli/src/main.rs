//! `metaroce`: the command-line tool.
//!
//! - `metaroce perf`: throughput and latency of the transport (our
//!   ib_write_bw/iperf3); with no arguments, a self-contained loopback run.
//! - `metaroce sim`: the packet-level fabric simulator, metaroce against the
//!   transports it replaces.

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
    Perf(perf::PerfArgs),
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
        Command::Perf(a) => perf::run(a),
        Command::Sim(a) => sim::run(*a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("metaroce: {e:#}");
            ExitCode::FAILURE
        }
    }
}
