//! An adversarial peer drives an established connection with *sequences*
//! of packets: forged DATA, ACK, CLOSE and coalesced ACK+DATA for the
//! victim's connection (sequence numbers exactly at, behind, ahead of, at
//! the edge of or half the space away from the real ones; SACK vectors of
//! every shape; grants and receive windows of 0 and the maximum; NAKs of
//! every code), replays, bursts, legitimate requests on both sides, lost
//! datagrams and time steps. Nothing may panic or livelock, the victim's
//! output per action, its connection state and (via libFuzzer's limits)
//! its memory stay bounded, regions the peer may not write never change,
//! every request completes, and an untouched second connection still works
//! byte-exact. The input format and the invariants are documented in
//! `fuzz_logic/adversary.rs` (`decode`, `World::check`).
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../../metaroce-proto/tests/fuzz_logic/adversary.rs"]
mod adversary;

fuzz_target!(|data: &[u8]| adversary::adversarial_peer(data));
