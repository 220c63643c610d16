#![allow(dead_code)]
//! Helpers shared by the integration tests.

use metaroce_sim::time::NS_PER_MS;
use metaroce_sim::{SimConfig, TransportKind};

/// A small fabric: 8 hosts, 2 leaves of 4, 4 spines, 100 Gbit/s, 1 ms.
pub fn small(transport: TransportKind) -> SimConfig {
    SimConfig {
        transport,
        hosts: 8,
        spines: 4,
        duration_ns: NS_PER_MS,
        ..SimConfig::default()
    }
}
