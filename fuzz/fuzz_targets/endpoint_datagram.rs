//! A connected endpoint pair fed arbitrary datagrams (raw, or edits of valid
//! captured packets), then checked with a real byte-exact transfer. The input
//! format is documented on `fuzz_logic::endpoint_datagram`.
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../../metaroce-proto/tests/fuzz_logic/mod.rs"]
mod fuzz_logic;

fuzz_target!(|data: &[u8]| fuzz_logic::endpoint_datagram(data));
