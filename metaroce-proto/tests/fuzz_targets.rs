//! The fuzz targets of `fuzz/` run as plain tests on seeded random and
//! mutated inputs, so CI exercises them without a fuzzer. Deterministic:
//! fixed seeds; `METAROCE_FUZZ_ITERS=<n>` scales the number of inputs.

mod fuzz_logic;

use fuzz_logic::*;

fn iters(default: usize) -> usize {
    std::env::var("METAROCE_FUZZ_ITERS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .map_or(default, |n| n.max(1))
}

fn mutate(rng: &mut Rng, b: &mut Vec<u8>) {
    for _ in 0..=rng.below(4) {
        let n = b.len();
        match rng.below(6) {
            0 | 1 if n > 0 => {
                let i = rng.below(n as u64) as usize;
                b[i] ^= 1 << rng.below(8);
            }
            2 if n > 0 => {
                let i = rng.below(n as u64) as usize;
                b[i] = rng.next_u64() as u8;
            }
            3 => b.truncate(rng.below(n as u64 + 1) as usize),
            4 => {
                let k = rng.below(32) as usize + 1;
                let extra = rng.bytes(k);
                b.extend(extra);
            }
            _ => {}
        }
    }
}

#[test]
fn decode_packet_on_random_and_mutated_inputs() {
    let fx = Fixture::new();
    let mut rng = Rng::new(0xdec0de);
    let n = iters(4000);
    for i in 0..n * 5 {
        let mut b = if i % 3 == 0 {
            let len = rng.below(256) as usize;
            rng.bytes(len)
        } else {
            fx.corpus[rng.below(fx.corpus.len() as u64) as usize]
                .bytes
                .clone()
        };
        if i % 3 != 0 {
            decode_packet(&b);
            mutate(&mut rng, &mut b);
        }
        decode_packet(&b);
    }
}

/// A random program in the target's input format, biased towards edits of
/// captured packets.
fn random_program(rng: &mut Rng) -> Vec<u8> {
    let mut p = Vec::new();
    for _ in 0..=rng.below(12) {
        let kind = match rng.below(10) {
            0 => 0u8,
            1 => 1,
            _ => 2,
        };
        let mut c = kind | (rng.next_u64() as u8 & 0xf8);
        // Mostly from the peer's address, so packets get past the source check.
        if rng.below(4) != 0 {
            c &= !0x10;
        }
        if rng.below(8) != 0 {
            c &= !0x80;
        }
        p.push(c);
        if c & 0x80 != 0 {
            p.extend(rng.bytes(2));
        }
        match kind {
            0 => p.push(rng.next_u64() as u8),
            1 => {
                let n = rng.below(200) as u16;
                p.extend(n.to_be_bytes());
                p.extend(rng.bytes(n as usize));
            }
            _ => {
                p.push(rng.next_u64() as u8);
                let edits = rng.below(4) as u8;
                p.push(edits);
                for _ in 0..edits {
                    // Positions mostly inside the headers.
                    let pos = rng.below(80) as u16;
                    p.extend(pos.to_be_bytes());
                    p.push(rng.next_u64() as u8);
                    p.push(rng.next_u64() as u8);
                }
            }
        }
    }
    p
}

#[test]
fn endpoint_datagram_on_seed_inputs() {
    let fx = Fixture::new();
    for input in seed_inputs(&fx) {
        endpoint_datagram(&input);
    }
}

#[test]
fn endpoint_datagram_on_random_programs() {
    let mut rng = Rng::new(0xe9d9);
    for _ in 0..iters(4000) / 20 {
        let prog = random_program(&mut rng);
        endpoint_datagram(&prog);
    }
}

#[test]
fn endpoint_datagram_on_arbitrary_bytes() {
    let mut rng = Rng::new(0xa7b1);
    for _ in 0..iters(4000) / 20 {
        let len = rng.below(300) as usize;
        let prog = rng.bytes(len);
        endpoint_datagram(&prog);
    }
}

/// The packets the fuzzers edit include ACKs riding on DATA (PROTOCOL
/// §6.7), so that the coalesced path is fuzzed from valid datagrams.
#[test]
fn the_captured_exchange_holds_coalesced_datagrams() {
    use metaroce_proto::consts::ACK_FLAG_COALESCED;
    use metaroce_proto::wire::{AckPacket, DataHeader};
    let fx = Fixture::new();
    let coalesced: Vec<_> = fx
        .corpus
        .iter()
        .filter_map(|c| AckPacket::parse(&c.bytes, |_| false).ok())
        .filter(|a| a.header().flags & ACK_FLAG_COALESCED != 0)
        .collect();
    assert!(
        coalesced.len() >= 2,
        "{} coalesced datagrams",
        coalesced.len()
    );
    for a in coalesced {
        let data = a.coalesced().expect("a packet after the ACK");
        assert!(DataHeader::parse(data).is_ok(), "a DATA packet rides on it");
    }
}
