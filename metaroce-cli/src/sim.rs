//! `metaroce sim` (being wired to metaroce-sim).

use clap::Args;

/// Arguments of `metaroce sim`.
#[derive(Debug, Args)]
pub struct SimArgs {}

pub fn run(_a: SimArgs) -> anyhow::Result<()> {
    anyhow::bail!("metaroce sim is not wired up yet")
}
