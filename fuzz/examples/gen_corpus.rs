//! Writes seed corpora: `corpus/decode_packet/` gets every packet of a real
//! exchange (handshake, every DATA opcode, ACKs, CLOSE); `corpus/endpoint_datagram/`
//! gets one program per captured packet (see `fuzz_logic::seed_inputs`).

#[path = "../../metaroce-proto/tests/fuzz_logic/mod.rs"]
mod fuzz_logic;

use std::fs;
use std::path::Path;

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus");
    let fx = fuzz_logic::Fixture::new();
    let dec = root.join("decode_packet");
    fs::create_dir_all(&dec).unwrap();
    for (i, p) in fx.corpus.iter().enumerate() {
        fs::write(dec.join(format!("pkt-{i:04}")), &p.bytes).unwrap();
    }
    let ep = root.join("endpoint_datagram");
    fs::create_dir_all(&ep).unwrap();
    let seeds = fuzz_logic::seed_inputs(&fx);
    for (i, s) in seeds.iter().enumerate() {
        fs::write(ep.join(format!("prog-{i:04}")), s).unwrap();
    }
    println!(
        "wrote {} packets and {} programs under {}",
        fx.corpus.len(),
        seeds.len(),
        root.display()
    );
}
