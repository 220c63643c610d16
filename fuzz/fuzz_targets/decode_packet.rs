//! Every decoder of `metaroce_proto::wire` on arbitrary bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../../metaroce-proto/tests/fuzz_logic/mod.rs"]
mod fuzz_logic;

fuzz_target!(|data: &[u8]| fuzz_logic::decode_packet(data));
