//! The model-based test of RC semantics with a fuzzer choosing: its input's
//! first 8 bytes seed the lossy, duplicating, reordering link, the rest pick
//! every operation (WRITE, READ, SEND; keys right, wrong and stale;
//! out-of-bounds ranges; missing rights; late and short receives;
//! deregistration and re-registration with WRITEs in flight; QPs destroyed
//! and created anew). Every completion, status and byte of every region is
//! compared with the reference model; a departure panics. The logic and
//! what it checks: `fuzz_logic/model.rs`; its plain test: `tests/model.rs`.
#![no_main]

use libfuzzer_sys::fuzz_target;

// The plain test's entry (`run_case`, a seed's rounds) is not the fuzzer's.
#[allow(dead_code)]
#[path = "../../metaroce-proto/tests/fuzz_logic/model.rs"]
mod model;

fuzz_target!(|data: &[u8]| {
    model::run_input(data);
});
