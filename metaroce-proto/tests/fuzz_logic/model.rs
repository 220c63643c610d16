//! Model-based test of RC semantics: random rounds of verbs operations over
//! the lossy, duplicating, reordering pair (`common::Pair`), every round
//! compared with a small reference model of what RC promises:
//!
//! - the requester's completions come in post order, one per request, with
//!   the status the model gives: `Success` for a request within a region
//!   that allows it under a valid key; `RemoteAccessError` for a wrong key,
//!   a stale key (of a deregistered region), an out-of-bounds range or a
//!   missing access right; `RemoteInvalidRequest` for a SEND longer than its
//!   receive; `WrFlushError` for every request after the first error (the
//!   QP is then in ERROR);
//! - the responder's receive completions come in post order: `Success` with
//!   the SEND's length, `LocalLengthError` for one too long, `WrFlushError`
//!   for one never used when its QP is destroyed;
//! - every byte of every region is what the model says: a WRITE lands only
//!   where it was allowed, whole; a refused one changes nothing anywhere; a
//!   READ brings the bytes the region held when it executed (requests
//!   execute in post order); a receive holds its SEND's bytes.
//!
//! Rounds mix WRITE, READ and SEND, keys right, wrong and stale,
//! out-of-bounds ranges, regions without the access a request needs,
//! receives posted late (the SEND meets RNR and is retried), receives too
//! small, a target region deregistered and registered again (with a new
//! key, perhaps other rights) while WRITEs to it are in flight, and the QPs
//! destroyed and created anew. Where timing decides (a request to a region
//! deregistered while it was in flight either executed before, and then
//! its bytes are in the region handed back by the deregistration, or fails
//! `RemoteAccessError`), the model takes the implementation's choice if it
//! is one of those and checks its consequences.
//!
//! Overlapping WRITEs (or READ buffers) in flight together may leave either's
//! bytes: placement is out of order (PROTOCOL §11.5); the model says so.
//! (It found finding 5 of `tests/core_findings.rs`.)
//!
//! The plain test is `tests/model.rs` (seeded cases); the fuzz target
//! `model` (`fuzz/`) runs [`run_input`] on the fuzzer's inputs.

#[path = "../common/mod.rs"]
mod common;

use common::*;
use metaroce_proto::verbs::*;
use metaroce_proto::EndpointConfig;
use std::time::Duration;

/// Bytes of each target region at B, and of A's source and READ regions.
const REGION: usize = 8192;
/// Target regions at B.
const TARGETS: usize = 3;
/// Receive slots at B, each `SLOT` bytes.
const SLOTS: usize = 4;
const SLOT: usize = 2048;
/// Rounds per case.
const ROUNDS: usize = 24;
/// Simulated time a round may take, at most.
const ROUND_LIMIT: Duration = Duration::from_secs(20);

/// Which key a request names.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Key {
    /// The region's current rkey.
    Valid,
    /// A key no region has.
    Wrong,
    /// The rkey of a region deregistered in an earlier round.
    Stale,
}

#[derive(Debug, Clone, Copy)]
enum Op {
    Write {
        src: usize,
        region: usize,
        off: usize,
        len: usize,
        key: Key,
    },
    Read {
        region: usize,
        off: usize,
        len: usize,
        dst: usize,
        key: Key,
    },
    /// A SEND of `len` bytes into a receive of `recv_len` bytes (slot
    /// `slot`), the receive posted before the SEND or `late`.
    Send {
        src: usize,
        len: usize,
        recv_len: usize,
        slot: usize,
        late: bool,
    },
}

/// A region as the model knows it: its keys and rights, and every byte
/// (`None`: undefined, the range of a WRITE that failed part way).
struct Region {
    info: MrInfo,
    bytes: Vec<Option<u8>>,
}

impl Region {
    fn allows(&self, need: AccessFlags, off: usize, len: usize) -> bool {
        self.info.access.contains(need) && off + len <= REGION
    }
}

struct World {
    p: Pair,
    v: Verbs,
    rng: TestRng,
    targets: Vec<Region>,
    /// rkeys of regions deregistered so far.
    stale: Vec<u32>,
    /// A's source region (its bytes never change) and READ region.
    src: MrInfo,
    src_bytes: Vec<u8>,
    rd: MrInfo,
    rd_bytes: Vec<Option<u8>>,
    /// B's receive region.
    rcv: MrInfo,
    rcv_bytes: Vec<Option<u8>>,
    next_wr: u64,
    /// What was checked (printed at the end).
    tally: Tally,
}

#[derive(Debug, Default)]
pub struct Tally {
    pub rounds: u64,
    pub ops: u64,
    pub success: u64,
    pub access_errors: u64,
    pub invalid_requests: u64,
    pub flushed: u64,
    pub late_receives: u64,
    pub reregistrations: u64,
    pub in_flight_executed_before: u64,
    pub dereg_in_use: u64,
    pub qp_recreated: u64,
}

fn access(rng: &mut TestRng) -> AccessFlags {
    match rng.below(4) {
        0 => AccessFlags::REMOTE_READ,
        1 => AccessFlags::REMOTE_WRITE,
        _ => AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
    }
}

impl World {
    fn new(seed: u64) -> World {
        let cfg = EndpointConfig {
            paths: 4,
            ..EndpointConfig::default()
        };
        let link = LinkConfig::lossy(0.03);
        let mut p = Pair::new(cfg.clone(), cfg, seed, link);
        p.connect();
        let v = Verbs::setup(&mut p);
        let mut rng = TestRng::new(seed ^ 0x30de1);
        let src_bytes = pattern(seed, REGION);
        let src =
            p.a.reg_mr(
                v.pda,
                src_bytes.clone().into_boxed_slice(),
                0,
                AccessFlags::NONE,
            )
            .unwrap();
        let rd =
            p.a.reg_mr(
                v.pda,
                vec![0u8; REGION].into_boxed_slice(),
                0,
                AccessFlags::LOCAL_WRITE,
            )
            .unwrap();
        let rcv =
            p.b.reg_mr(
                v.pdb,
                vec![0u8; SLOTS * SLOT].into_boxed_slice(),
                0,
                AccessFlags::LOCAL_WRITE,
            )
            .unwrap();
        let mut w = World {
            p,
            v,
            rng: TestRng::new(0),
            targets: Vec::new(),
            stale: Vec::new(),
            src,
            src_bytes,
            rd,
            rd_bytes: vec![Some(0); REGION],
            rcv,
            rcv_bytes: vec![Some(0); SLOTS * SLOT],
            next_wr: 1,
            tally: Tally::default(),
        };
        for i in 0..TARGETS {
            let acc = access(&mut rng);
            let r = w.register(i as u64 + 1000, acc);
            w.targets.push(r);
        }
        w.rng = rng;
        w
    }

    /// Registers a fresh target region at B, filled with `tag`'s pattern.
    fn register(&mut self, tag: u64, acc: AccessFlags) -> Region {
        let bytes = pattern(tag, REGION);
        let info = self
            .p
            .b
            .reg_mr(self.v.pdb, bytes.clone().into_boxed_slice(), 0, acc)
            .unwrap();
        Region {
            info,
            bytes: bytes.into_iter().map(Some).collect(),
        }
    }

    fn key(&mut self, k: Key, region: usize) -> u32 {
        match k {
            Key::Valid => self.targets[region].info.rkey,
            Key::Stale if !self.stale.is_empty() => {
                self.stale[self.rng.below(self.stale.len() as u64) as usize]
            }
            _ => loop {
                let k = self.rng.next_u64() as u32;
                let used = self.targets.iter().any(|t| t.info.rkey == k) || self.stale.contains(&k);
                if !used {
                    break k;
                }
            },
        }
    }

    fn gen_op(&mut self, slot: usize) -> Op {
        let r = &mut self.rng;
        let region = r.below(TARGETS as u64) as usize;
        let key = match r.below(10) {
            0 => Key::Wrong,
            1 => Key::Stale,
            _ => Key::Valid,
        };
        let len = match r.below(4) {
            0 => 1 + r.below(64) as usize,
            1 => 1 + r.below(REGION as u64 / 2) as usize,
            _ => 1 + r.below(6000) as usize,
        };
        // Now and then a range that runs past the region's end.
        let off = if r.below(10) == 0 {
            REGION - (len.min(REGION) / 2).max(1)
        } else {
            r.below((REGION - len.min(REGION)) as u64 + 1) as usize
        };
        let src = r.below((REGION - len.min(REGION)) as u64 + 1) as usize;
        match r.below(3) {
            0 => Op::Write {
                src,
                region,
                off,
                len,
                key,
            },
            1 => Op::Read {
                region,
                off,
                len,
                dst: src,
                key,
            },
            _ => {
                let len = 1 + r.below(SLOT as u64) as usize;
                let recv_len = if r.below(8) == 0 {
                    len - 1 - r.below(len as u64) as usize / 2
                } else {
                    SLOT
                };
                Op::Send {
                    src: r.below((REGION - len) as u64 + 1) as usize,
                    len,
                    recv_len: recv_len.max(if len > 1 { 0 } else { 1 }),
                    slot,
                    late: r.below(5) == 0,
                }
            }
        }
    }

    /// Posts a receive; whether the QP took it (one in ERROR need not).
    fn post_recv(&mut self, slot: usize, len: usize, wr_id: u64) -> bool {
        let wr = RecvWr {
            wr_id,
            sge: Sge {
                lkey: self.rcv.lkey,
                addr: (slot * SLOT) as u64,
                len: len as u32,
            }
            .into(),
        };
        match self.p.b.post_recv(self.v.qb, wr) {
            Ok(()) => true,
            Err(VerbsError::InvalidState(QpState::Error)) => false,
            Err(e) => panic!("post_recv: {e}"),
        }
    }

    fn round(&mut self, seed: u64) {
        self.tally.rounds += 1;
        let n = 1 + self.rng.below(5) as usize;
        let mut slot = 0;
        let mut ops = Vec::new();
        for _ in 0..n {
            let op = self.gen_op(slot);
            if let Op::Send { .. } = op {
                slot += 1;
                if slot == SLOTS {
                    ops.push(op);
                    break;
                }
            }
            ops.push(op);
        }
        // Receives are posted in SEND order: from the first late one on,
        // all late.
        let mut late_from = usize::MAX;
        let mut wr_ids = Vec::new();
        let mut recv_ids = Vec::new();
        for (i, op) in ops.iter().enumerate() {
            let id = self.next_wr;
            self.next_wr += 1;
            wr_ids.push(id);
            if let Op::Send {
                late,
                recv_len,
                slot,
                ..
            } = *op
            {
                let rid = id | 1 << 40;
                if late || late_from != usize::MAX {
                    late_from = late_from.min(i);
                    recv_ids.push((i, rid, slot, recv_len, true));
                } else {
                    let posted = self.post_recv(slot, recv_len, rid);
                    recv_ids.push((i, rid, slot, recv_len, posted));
                }
            }
        }
        let now = self.p.now;
        let mut keys = Vec::new();
        // A request after a READ is fenced half the time (it then waits for
        // the READ's completion, PROTOCOL §11.5).
        let mut fences = Vec::new();
        let mut read_before = false;
        for (i, op) in ops.clone().into_iter().enumerate() {
            let fence = read_before && self.rng.below(2) == 0;
            fences.push(fence);
            read_before |= matches!(op, Op::Read { .. });
            let mut wr = match op {
                Op::Write {
                    src,
                    region,
                    off,
                    len,
                    key,
                } => {
                    let rkey = self.key(key, region);
                    keys.push(rkey);
                    SendWr::new(
                        wr_ids[i],
                        SendOp::Write(RemoteAddr {
                            rkey,
                            addr: off as u64,
                        }),
                        Sge {
                            lkey: self.src.lkey,
                            addr: src as u64,
                            len: len as u32,
                        },
                    )
                }
                Op::Read {
                    region,
                    off,
                    len,
                    dst,
                    key,
                } => {
                    let rkey = self.key(key, region);
                    keys.push(rkey);
                    SendWr::new(
                        wr_ids[i],
                        SendOp::Read(RemoteAddr {
                            rkey,
                            addr: off as u64,
                        }),
                        Sge {
                            lkey: self.rd.lkey,
                            addr: dst as u64,
                            len: len.min(REGION - dst) as u32,
                        },
                    )
                }
                Op::Send { src, len, .. } => {
                    keys.push(0);
                    SendWr::new(
                        wr_ids[i],
                        SendOp::Send,
                        Sge {
                            lkey: self.src.lkey,
                            addr: src as u64,
                            len: len as u32,
                        },
                    )
                }
            };
            wr.fence = fence;
            self.p.a.post_send(now, self.v.qa, wr).unwrap();
        }
        self.tally.ops += ops.len() as u64;

        // Mid-flight: a target region that a WRITE or READ of this round
        // names is deregistered and registered anew.
        // (target index, the old region as the model knew it, its bytes as
        // the deregistration handed them back).
        let mut moved: Option<(usize, Region, Vec<u8>)> = None;
        if self.rng.below(3) == 0 {
            let named: Vec<usize> = ops
                .iter()
                .enumerate()
                .filter_map(|(i, op)| match *op {
                    Op::Write { region, .. } | Op::Read { region, .. }
                        if keys[i] == self.targets[region].info.rkey =>
                    {
                        Some(region)
                    }
                    _ => None,
                })
                .collect();
            if let Some(&region) = named.first() {
                let wait = Duration::from_micros(self.rng.below(40));
                self.p.run_for(wait);
                let old = self.targets[region].info;
                match self.p.b.dereg_mr(old.lkey) {
                    Ok(buf) => {
                        self.tally.reregistrations += 1;
                        self.stale.push(old.rkey);
                        let tag = self.rng.next_u64();
                        let acc = access(&mut self.rng);
                        let fresh = self.register(tag, acc);
                        assert_ne!(fresh.info.rkey, old.rkey, "seed {seed}: a key reused");
                        let old = std::mem::replace(&mut self.targets[region], fresh);
                        moved = Some((region, old, buf.to_vec()));
                    }
                    Err(VerbsError::MrInUse(_)) => self.tally.dereg_in_use += 1,
                    Err(e) => panic!("seed {seed}: dereg_mr: {e}"),
                }
            }
        }
        if late_from != usize::MAX {
            // The SENDs meet RNR until their receives come.
            self.tally.late_receives += 1;
            self.p.run_for(Duration::from_micros(300));
            for r in recv_ids.iter_mut() {
                if r.0 >= late_from {
                    r.4 = self.post_recv(r.2, r.3, r.1);
                }
            }
        }
        let deadline = self.p.now + ROUND_LIMIT;
        let want = ops.len();
        let mut got = Vec::new();
        let (cqa, cqb) = (self.v.cqa, self.v.cqb);
        let done = self.p.run_until(deadline, |p| {
            got.extend(drain_cq(&mut p.a, cqa));
            got.len() >= want
        });
        assert!(
            done,
            "seed {seed}: {} of {want} requests completed in {ROUND_LIMIT:?}: {ops:?} -> {got:?}",
            got.len()
        );
        // Late duplicates settle; nothing more may complete.
        self.p.run_for(Duration::from_millis(2));
        got.extend(drain_cq(&mut self.p.a, cqa));
        assert_eq!(
            got.len(),
            want,
            "seed {seed}: completions {got:?} for {ops:?}"
        );

        // The model, request by request in post order.
        let mut failed = false;
        let mut recv_status = Vec::new();
        for (i, op) in ops.iter().enumerate() {
            let wc = got[i];
            let ctx = || {
                format!(
                    "seed {seed}: request {i} {op:?} (key {:#x}) of {ops:?}: {wc:?}; all: {:?}",
                    keys[i],
                    got.iter().map(|w| w.status).collect::<Vec<_>>()
                )
            };
            assert_eq!(wc.wr_id, wr_ids[i], "{}: out of order", ctx());
            if failed {
                assert_eq!(wc.status, WcStatus::WrFlushError, "{}", ctx());
                self.tally.flushed += 1;
                // A flushed request may have been placed before the
                // responder met the failure (placement is out of order):
                // what it targets is undefined, where it was allowed to
                // write. Nowhere else.
                match *op {
                    Op::Write {
                        region, off, len, ..
                    } => {
                        let t = match moved.as_mut() {
                            Some(m) if m.0 == region && m.1.info.rkey == keys[i] => &mut m.1,
                            _ => &mut self.targets[region],
                        };
                        if keys[i] == t.info.rkey && t.allows(AccessFlags::REMOTE_WRITE, off, len) {
                            for b in &mut t.bytes[off..off + len] {
                                *b = None;
                            }
                        }
                    }
                    Op::Send {
                        len,
                        recv_len,
                        slot,
                        ..
                    } => {
                        let n = len.min(recv_len);
                        for b in &mut self.rcv_bytes[slot * SLOT..slot * SLOT + n] {
                            *b = None;
                        }
                        recv_status.push(None);
                    }
                    Op::Read { .. } => {}
                }
                continue;
            }
            match *op {
                Op::Write {
                    src,
                    region,
                    off,
                    len,
                    ..
                }
                | Op::Read {
                    region,
                    off,
                    len,
                    dst: src,
                    ..
                } => {
                    let write = matches!(op, Op::Write { .. });
                    let need = if write {
                        AccessFlags::REMOTE_WRITE
                    } else {
                        AccessFlags::REMOTE_READ
                    };
                    // The region this request names, as it was when posted:
                    // the one deregistered meanwhile, or the current one.
                    let in_moved = moved
                        .as_ref()
                        .is_some_and(|m| m.0 == region && m.1.info.rkey == keys[i]);
                    let t = match moved.as_mut() {
                        Some(m) if in_moved => &mut m.1,
                        _ => &mut self.targets[region],
                    };
                    let allowed = keys[i] == t.info.rkey && t.allows(need, off, len);
                    let bytes = &mut t.bytes;
                    // A request to the region deregistered while it was in
                    // flight executed before (success) or fails: timing
                    // decides, and either is right if the region allowed it.
                    let expect_ok = allowed && (!in_moved || wc.status == WcStatus::Success);
                    if expect_ok {
                        assert_eq!(wc.status, WcStatus::Success, "{}", ctx());
                        self.tally.success += 1;
                        if in_moved {
                            self.tally.in_flight_executed_before += 1;
                        }
                        if write {
                            for k in 0..len {
                                bytes[off + k] = Some(self.src_bytes[src + k]);
                            }
                            // An earlier WRITE of this round to the same
                            // region, in flight at the same time: placement
                            // is out of order (PROTOCOL §11.2), so where the
                            // two overlap either's bytes may stay (§11.5).
                            for (h, earlier) in ops.iter().enumerate().take(i) {
                                if let Op::Write {
                                    region: r0,
                                    off: o0,
                                    len: l0,
                                    ..
                                } = *earlier
                                {
                                    if r0 == region && keys[h] == keys[i] {
                                        let lo = o0.max(off);
                                        let hi = (o0 + l0).min(off + len);
                                        for b in &mut bytes[lo..hi.max(lo)] {
                                            *b = None;
                                        }
                                    }
                                }
                            }
                        } else {
                            let n = len.min(REGION - src);
                            self.rd_bytes[src..src + n].copy_from_slice(&bytes[off..off + n]);
                            // An earlier READ of this round into an
                            // overlapping buffer: its response packets are
                            // placed out of order too (§11.5).
                            for earlier in ops.iter().take(i) {
                                if let Op::Read {
                                    len: l0, dst: d0, ..
                                } = *earlier
                                {
                                    let lo = d0.max(src);
                                    let hi = (d0 + l0.min(REGION - d0)).min(src + n);
                                    for b in &mut self.rd_bytes[lo..hi.max(lo)] {
                                        *b = None;
                                    }
                                }
                            }
                            // A later WRITE to the same region without a
                            // fence may be placed before this READ executes
                            // (§11.5): where it overlaps, either bytes.
                            for (j, later) in ops.iter().enumerate().skip(i + 1) {
                                if let Op::Write {
                                    region: r2,
                                    off: o2,
                                    len: l2,
                                    ..
                                } = *later
                                {
                                    if r2 == region && keys[j] == keys[i] && !fences[j] {
                                        let lo = o2.max(off);
                                        let hi = (o2 + l2).min(off + n);
                                        for k in lo..hi.max(lo) {
                                            self.rd_bytes[src + k - off] = None;
                                        }
                                    }
                                }
                            }
                        }
                    } else {
                        assert_eq!(wc.status, WcStatus::RemoteAccessError, "{}", ctx());
                        self.tally.access_errors += 1;
                        failed = true;
                        if in_moved && write && off + len <= REGION {
                            // Placed in part, perhaps, before the region went.
                            for b in &mut bytes[off..off + len] {
                                *b = None;
                            }
                        }
                        if !write && off < REGION {
                            // A failed READ leaves its buffer undefined.
                            let n = len.min(REGION - src);
                            for b in &mut self.rd_bytes[src..src + n] {
                                *b = None;
                            }
                        }
                    }
                }
                Op::Send {
                    src,
                    len,
                    recv_len,
                    slot,
                    ..
                } => {
                    if len <= recv_len {
                        assert_eq!(wc.status, WcStatus::Success, "{}", ctx());
                        self.tally.success += 1;
                        for k in 0..len {
                            self.rcv_bytes[slot * SLOT + k] = Some(self.src_bytes[src + k]);
                        }
                        recv_status.push(Some((WcStatus::Success, len)));
                    } else {
                        assert_eq!(wc.status, WcStatus::RemoteInvalidRequest, "{}", ctx());
                        self.tally.invalid_requests += 1;
                        failed = true;
                        for b in &mut self.rcv_bytes[slot * SLOT..slot * SLOT + recv_len] {
                            *b = None;
                        }
                        recv_status.push(Some((WcStatus::LocalLengthError, len)));
                    }
                }
            }
        }
        // The old region, handed back by the deregistration: every byte the
        // model knows is there. (Its bytes before this round were the
        // model's; requests that executed before the move changed them.)
        if let Some((region, old, buf)) = &moved {
            for (k, (want, have)) in old.bytes.iter().zip(buf).enumerate() {
                if let Some(want) = want {
                    assert_eq!(
                        want, have,
                        "seed {seed}: old region {region}, byte {k}, after {ops:?} -> {got:?}"
                    );
                }
            }
        }

        // The QPs are destroyed after a failure (and now and then anyway),
        // which flushes the receives never used.
        let recreate = failed || self.rng.below(6) == 0;
        if recreate {
            self.p.a.destroy_qp(self.v.qa).unwrap();
            self.p.b.destroy_qp(self.v.qb).unwrap();
        }
        let recvs = drain_cq(&mut self.p.b, cqb);
        let mut expect = Vec::new();
        for (j, &(_, rid, _, _, posted)) in recv_ids.iter().enumerate() {
            match recv_status.get(j).copied().flatten() {
                Some((st, len)) => expect.push((rid, st, (st == WcStatus::Success).then_some(len))),
                None if recreate && posted => expect.push((rid, WcStatus::WrFlushError, None)),
                None => {}
            }
        }
        let have: Vec<_> = recvs
            .iter()
            .map(|w| {
                // An error completion's length is undefined (as in verbs).
                let len = (w.status == WcStatus::Success).then_some(w.byte_len as usize);
                (w.wr_id, w.status, len)
            })
            .collect();
        assert_eq!(have, expect, "seed {seed}: receives of {ops:?} -> {got:?}");
        if recreate {
            self.tally.qp_recreated += 1;
            let p = &mut self.p;
            let qa = p.a.create_qp(QpInit::new(self.v.pda, cqa, cqa)).unwrap();
            let qb = p.b.create_qp(QpInit::new(self.v.pdb, cqb, cqb)).unwrap();
            p.a.connect_qp(qa, p.conn_a.unwrap(), qb).unwrap();
            p.b.connect_qp(qb, p.conn_b.unwrap(), qa).unwrap();
            self.v.qa = qa;
            self.v.qb = qb;
        }
        let statuses: Vec<_> = got.iter().map(|w| w.status).collect();
        self.check_memory(seed, &format!("{ops:?} -> {statuses:?}"));
    }

    /// Every byte of every region is what the model says.
    fn check_memory(&self, seed: u64, ops: &str) {
        let check = |what: &str, have: &[u8], want: &[Option<u8>]| {
            for (k, (h, w)) in have.iter().zip(want).enumerate() {
                if let Some(w) = w {
                    assert_eq!(h, w, "seed {seed}: {what}, byte {k}, after {ops}");
                }
            }
        };
        for (i, t) in self.targets.iter().enumerate() {
            check(
                &format!("target region {i}"),
                self.p.b.mr(t.info.lkey).unwrap(),
                &t.bytes,
            );
        }
        check(
            "READ region",
            self.p.a.mr(self.rd.lkey).unwrap(),
            &self.rd_bytes,
        );
        check(
            "receive region",
            self.p.b.mr(self.rcv.lkey).unwrap(),
            &self.rcv_bytes,
        );
        assert_eq!(self.p.a.mr(self.src.lkey).unwrap(), &self.src_bytes[..]);
    }
}

/// One case: `ROUNDS` rounds from `seed` (the link's randomness and every
/// choice of the rounds); panics where the implementation departs from
/// the model.
pub fn run_case(seed: u64) -> Tally {
    let mut w = World::new(seed);
    for _ in 0..ROUNDS {
        w.round(seed);
    }
    w.tally
}

/// One case driven by a fuzzer's input: its first 8 bytes are the seed
/// (of the link: which datagrams are lost, duplicated or reordered), the
/// rest the choices of the rounds (8 bytes each, [`TestRng::with_tape`];
/// past its end the seed's numbers go on).
pub fn run_input(data: &[u8]) -> Tally {
    let (head, tape) = data.split_at(data.len().min(8));
    let mut s = [0u8; 8];
    s[..head.len()].copy_from_slice(head);
    let seed = u64::from_le_bytes(s);
    let mut w = World::new(seed);
    w.rng = TestRng::with_tape(seed ^ 0x30de1, tape);
    for _ in 0..ROUNDS {
        w.round(seed);
    }
    w.tally
}
