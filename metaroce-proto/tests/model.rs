//! Model-based test of RC semantics (the logic, and what it checks, in
//! `fuzz_logic/model.rs`; its fuzz twin is the `model` target of `fuzz/`).
//!
//! A failing case prints its seed; `METAROCE_MODEL_SEED=<seed>` replays it
//! alone, `METAROCE_MODEL_CASES=<n>` runs more cases (default 40, about 4 s
//! in a debug build).

#[path = "fuzz_logic/model.rs"]
mod model;

use model::*;

fn cases() -> u64 {
    std::env::var("METAROCE_MODEL_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(40)
}

#[test]
fn rc_semantics_match_the_model() {
    if let Some(seed) = std::env::var("METAROCE_MODEL_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        eprintln!("replaying seed {seed}: {:?}", run_case(seed));
        return;
    }
    let mut total = Tally::default();
    for case in 0..cases() {
        let seed = 0x5eed_0000 + case;
        let t = std::panic::catch_unwind(|| run_case(seed)).unwrap_or_else(|_| {
            panic!("model test failed at seed {seed}: replay with METAROCE_MODEL_SEED={seed}")
        });
        total.rounds += t.rounds;
        total.ops += t.ops;
        total.success += t.success;
        total.access_errors += t.access_errors;
        total.invalid_requests += t.invalid_requests;
        total.flushed += t.flushed;
        total.late_receives += t.late_receives;
        total.reregistrations += t.reregistrations;
        total.in_flight_executed_before += t.in_flight_executed_before;
        total.dereg_in_use += t.dereg_in_use;
        total.qp_recreated += t.qp_recreated;
    }
    eprintln!("model: {total:?}");
    // The cases reach what they are for.
    assert!(total.success > 0 && total.access_errors > 0 && total.invalid_requests > 0);
    assert!(total.flushed > 0 && total.late_receives > 0 && total.reregistrations > 0);
    assert!(total.qp_recreated > 0);
}

/// The fuzz target's entry on pseudo-random inputs (the choices come from
/// the bytes, not the seed): what the fuzzer runs, kept working here.
#[test]
fn fuzzer_inputs_run_the_model() {
    let mut gen = 0xf022_u64;
    let mut total = 0;
    for case in 0..8u64 {
        let len = 8 + 64 * case as usize;
        let input: Vec<u8> = (0..len)
            .map(|_| {
                gen ^= gen << 13;
                gen ^= gen >> 7;
                gen ^= gen << 17;
                gen as u8
            })
            .collect();
        let t = std::panic::catch_unwind(|| run_input(&input))
            .unwrap_or_else(|_| panic!("model departs on the fuzz input {input:02x?}"));
        total += t.ops;
    }
    assert!(total > 0);
}
