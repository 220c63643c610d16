//! `metaroce perf` (being written).

use clap::Args;

/// Arguments of `metaroce perf`.
#[derive(Debug, Args)]
pub struct PerfArgs {}

pub fn run(_a: PerfArgs) -> anyhow::Result<()> {
    anyhow::bail!("metaroce perf is not written yet")
}
