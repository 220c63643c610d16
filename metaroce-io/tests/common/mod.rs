//! What the loopback suites share: two connected endpoints on one backend,
//! a payload pattern, and a WRITE checked byte for byte.
#![allow(dead_code)]

use metaroce_io::{DriverConfig, IoDriver};
use metaroce_proto::verbs::*;
use std::time::{Duration, Instant};

/// Deterministic payload bytes.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Whether backend `name` can run here; prints the skip line if not.
pub fn runnable(name: &str) -> bool {
    if name == "io_uring" {
        if let Err(why) = metaroce_io::uring_probe() {
            println!("skipped: io_uring unavailable: {why}");
            return false;
        }
    }
    true
}

/// Two connected endpoints with a QP each, and a PD and CQ on each side.
pub struct Pair<D> {
    pub a: D,
    pub b: D,
    pub conn_a: ConnectionHandle,
    pub conn_b: ConnectionHandle,
    pub qa: Qpn,
    pub qb: Qpn,
    pub cqa: CqHandle,
    pub cqb: CqHandle,
    pub pda: PdHandle,
    pub pdb: PdHandle,
    pub start: Instant,
    /// The test fails if it runs longer than this (a hang is a failure).
    pub limit: Duration,
}

/// WRITEs posted by [`Pair::post_write`], to be finished by
/// [`Pair::finish_write`].
pub struct PostedWrite {
    dst: u32,
    data: Vec<u8>,
    parts: u64,
}

impl<D: IoDriver> Pair<D> {
    /// Binds both ends with `cfg` and connects them (handshake within
    /// `limit`, at most 10 s).
    pub fn connect(cfg: DriverConfig, limit: Duration) -> Self {
        Self::connect_with(cfg.clone(), cfg, limit)
    }

    /// Like [`connect`](Self::connect), with each end's own configuration.
    pub fn connect_with(cfg_a: DriverConfig, cfg_b: DriverConfig, limit: Duration) -> Self {
        let start = Instant::now();
        let mut a = D::bind(cfg_a).expect("bind a");
        let mut b = D::bind(cfg_b).expect("bind b");
        let (conn_a, conn_b) =
            metaroce_io::connect_pair(&mut a, &mut b, limit.min(Duration::from_secs(10)))
                .expect("handshake");
        let (pda, pdb) = (a.endpoint().alloc_pd(), b.endpoint().alloc_pd());
        let (cqa, cqb) = (a.endpoint().create_cq(4096), b.endpoint().create_cq(4096));
        let qa = a.endpoint().create_qp(QpInit::new(pda, cqa, cqa)).unwrap();
        let qb = b.endpoint().create_qp(QpInit::new(pdb, cqb, cqb)).unwrap();
        a.endpoint().connect_qp(qa, conn_a, qb).unwrap();
        b.endpoint().connect_qp(qb, conn_b, qa).unwrap();
        Pair {
            a,
            b,
            conn_a,
            conn_b,
            qa,
            qb,
            cqa,
            cqb,
            pda,
            pdb,
            start,
            limit,
        }
    }

    /// Polls both sides until `n_a` completions on `a`'s CQ and `n_b` on
    /// `b`'s have arrived, all successful; returns them.
    pub fn complete(
        &mut self,
        n_a: usize,
        n_b: usize,
    ) -> (Vec<WorkCompletion>, Vec<WorkCompletion>) {
        let (mut wa, mut wb) = (Vec::new(), Vec::new());
        while wa.len() < n_a || wb.len() < n_b {
            assert!(
                self.start.elapsed() < self.limit,
                "timed out: {}/{n_a} and {}/{n_b} completions; a {:?}, b {:?}",
                wa.len(),
                wb.len(),
                self.a.stats(),
                self.b.stats()
            );
            self.a.poll(Duration::ZERO).unwrap();
            self.b.poll(Duration::ZERO).unwrap();
            self.a.endpoint().poll_cq(self.cqa, 256, &mut wa).unwrap();
            self.b.endpoint().poll_cq(self.cqb, 256, &mut wb).unwrap();
        }
        for wc in wa.iter().chain(&wb) {
            assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
        }
        (wa, wb)
    }

    /// Data packets `a` has sent and `b` has received on their connection.
    pub fn data_packets(&mut self) -> (u64, u64) {
        let sent = self.a.endpoint().connection_stats(self.conn_a);
        let received = self.b.endpoint().connection_stats(self.conn_b);
        (
            sent.map_or(0, |s| s.data_packets_sent),
            received.map_or(0, |s| s.data_packets_received),
        )
    }

    /// Polls both sides (without waiting) until `b` has received `packets`
    /// DATA packets: a stream under way.
    pub fn run_until_received(&mut self, name: &str, packets: u64) {
        while self.data_packets().1 < packets {
            assert!(
                self.start.elapsed() < self.limit,
                "{name}: the stream did not start"
            );
            self.a.poll(Duration::ZERO).unwrap();
            self.b.poll(Duration::ZERO).unwrap();
        }
    }

    /// WRITEs `len` pattern bytes from `a` to `b` in `parts` requests and
    /// checks every byte at `b`.
    pub fn write_checked(&mut self, name: &str, len: usize, parts: u64) {
        let w = self.post_write(len, parts);
        self.finish_write(name, w);
    }

    /// Registers `len` pattern bytes (`seed`) as the source, on `a` or
    /// (`src_on_a` false) on `b`, and `len` zero bytes as the destination on
    /// the other side, each at its address with its access: the pattern and
    /// the two regions.
    fn source_and_destination(
        &mut self,
        (seed, len, src_on_a): (u64, usize, bool),
        src: (u64, AccessFlags),
        dst: (u64, AccessFlags),
    ) -> (Vec<u8>, MrInfo, MrInfo) {
        let data = pattern(seed, len);
        let (from, from_pd, to, to_pd) = if src_on_a {
            (&mut self.a, self.pda, &mut self.b, self.pdb)
        } else {
            (&mut self.b, self.pdb, &mut self.a, self.pda)
        };
        let s = from
            .endpoint()
            .reg_mr(from_pd, data.clone().into_boxed_slice(), src.0, src.1)
            .unwrap();
        let d = to
            .endpoint()
            .reg_mr(to_pd, vec![0u8; len].into_boxed_slice(), dst.0, dst.1)
            .unwrap();
        (data, s, d)
    }

    /// SENDs `n` messages with immediates from `a` into `n` RECVs posted at
    /// `b`, message `i` of `msg - i` pattern bytes (so each completion's
    /// length is checked too), and checks every byte and immediate.
    pub fn send_recv_checked(&mut self, name: &str, n: usize, msg: usize) {
        let (data, src, dst) = self.source_and_destination(
            (2, n * msg, true),
            (0, AccessFlags::NONE),
            (0, AccessFlags::LOCAL_WRITE),
        );
        for i in 0..n {
            let sge = Sge {
                lkey: dst.lkey,
                addr: (i * msg) as u64,
                len: msg as u32,
            };
            let wr = RecvWr {
                wr_id: i as u64,
                sge: sge.into(),
            };
            self.b.endpoint().post_recv(self.qb, wr).unwrap();
        }
        let now = self.a.now();
        for i in 0..n {
            let wr = SendWr::new(
                i as u64,
                SendOp::SendImm(i as u32),
                Sge {
                    lkey: src.lkey,
                    addr: (i * msg) as u64,
                    len: (msg - i) as u32,
                },
            );
            self.a.endpoint().post_send(now, self.qa, wr).unwrap();
        }
        let (_, wb) = self.complete(n, n);
        let got = self.b.endpoint().mr(dst.lkey).unwrap().to_vec();
        for wc in &wb {
            let i = wc.wr_id as usize;
            assert_eq!(wc.imm, Some(i as u32));
            assert_eq!(
                wc.byte_len as usize,
                msg - i,
                "{name}: length of message {i}"
            );
            let r = i * msg..i * msg + msg - i;
            assert!(got[r.clone()] == data[r], "{name}: message {i} differs");
        }
    }

    /// READs `len` pattern bytes from a region of `b` into a fresh region
    /// of `a` in one request and checks every byte at `a`.
    pub fn read_checked(&mut self, name: &str, len: usize) {
        let (data, remote, local) = self.source_and_destination(
            (3, len, false),
            (0x4000_0000, AccessFlags::REMOTE_READ),
            (0, AccessFlags::LOCAL_WRITE),
        );
        let now = self.a.now();
        let wr = SendWr::new(
            9,
            SendOp::Read(RemoteAddr {
                rkey: remote.rkey,
                addr: remote.addr,
            }),
            Sge {
                lkey: local.lkey,
                addr: 0,
                len: len as u32,
            },
        );
        self.a.endpoint().post_send(now, self.qa, wr).unwrap();
        let (wa, _) = self.complete(1, 0);
        assert_eq!(wa[0].wr_id, 9);
        let got = self.a.endpoint().mr(local.lkey).unwrap();
        assert!(got == &data[..], "{name}: READ data differs");
    }

    /// Posts, on `a`, `parts` WRITEs of `len` pattern bytes in all into a
    /// fresh region of `b`; nothing is polled yet.
    pub fn post_write(&mut self, len: usize, parts: u64) -> PostedWrite {
        let (data, src, dst) = self.source_and_destination(
            (1, len, true),
            (0, AccessFlags::NONE),
            (0x10_0000, AccessFlags::REMOTE_WRITE),
        );
        let part = len as u64 / parts;
        let now = self.a.now();
        for k in 0..parts {
            let off = k * part;
            let remote = RemoteAddr {
                rkey: dst.rkey,
                addr: dst.addr + off,
            };
            let local = Sge {
                lkey: src.lkey,
                addr: src.addr + off,
                len: part as u32,
            };
            self.a
                .endpoint()
                .post_send(now, self.qa, SendWr::new(k, SendOp::Write(remote), local))
                .unwrap();
        }
        PostedWrite {
            dst: dst.lkey,
            data,
            parts,
        }
    }

    /// Polls both sides until the WRITEs of `w` complete, and checks every
    /// byte at `b`.
    pub fn finish_write(&mut self, name: &str, w: PostedWrite) {
        let (wa, _) = self.complete(w.parts as usize, 0);
        assert_eq!(wa.len(), w.parts as usize);
        let got = self.b.endpoint().mr(w.dst).unwrap();
        let bad = got.iter().zip(&w.data).filter(|(x, y)| x != y).count();
        assert_eq!(bad, 0, "{name}: {bad} bytes differ");
    }
}
