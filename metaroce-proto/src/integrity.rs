//! Per-datagram protection of a connection's packets, negotiated in the
//! handshake: a CRC32C trailer (PROTOCOL §3.1), or AES-128-GCM under keys
//! derived from a pre-shared key (PROTOCOL §3.2).
//!
//! Every datagram of a connection that negotiated a trailer ends with it,
//! one per datagram (a coalesced ACK and its DATA packet share one; every
//! segment of a UDP GSO batch has its own). The sender reserves the
//! trailer's bytes as it builds each packet and fills them in one pass over
//! the finished transmit; the receiver checks and strips it before it
//! parses anything past the common header.

use crate::consts::{
    AEAD_PROOF_LEN, AEAD_TAG_LEN, AEAD_TRAILER_LEN, COMMON_HEADER_LEN, CRC32C_TRAILER_LEN,
    HANDSHAKE_NONCE_LEN, PSK_LEN,
};
use aws_lc_rs::{aead, hkdf, hmac};

/// A pre-shared key (PROTOCOL §3.2): 32 secret bytes both endpoints hold,
/// from which each connection derives its own keys. Its `Debug` shows no
/// byte of it.
///
/// ```
/// use metaroce_proto::Psk;
/// let k = Psk::new([7; 32]);
/// assert_eq!(format!("{k:?}"), "Psk(..)");
/// assert!(Psk::from_slice(&[0; 31]).is_none());
/// ```
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Psk([u8; PSK_LEN]);

impl Psk {
    /// A key of these 32 bytes.
    pub fn new(bytes: [u8; PSK_LEN]) -> Self {
        Psk(bytes)
    }

    /// A key from a slice, `None` unless it is exactly 32 bytes long.
    pub fn from_slice(bytes: &[u8]) -> Option<Self> {
        bytes.try_into().ok().map(Psk)
    }

    /// The client's proof that it holds the key, for its HELLO: the first
    /// [`AEAD_PROOF_LEN`] bytes of HMAC-SHA256 under the key of the label,
    /// the client's nonce and its connection id.
    pub(crate) fn hello_proof(
        &self,
        nonce_c: &[u8; HANDSHAKE_NONCE_LEN],
        cid_c: u32,
    ) -> [u8; AEAD_PROOF_LEN] {
        let key = hmac::Key::new(hmac::HMAC_SHA256, &self.0);
        let mut ctx = hmac::Context::with_key(&key);
        ctx.update(b"metaroce v1 hello");
        ctx.update(nonce_c);
        ctx.update(&cid_c.to_be_bytes());
        let mut out = [0u8; AEAD_PROOF_LEN];
        out.copy_from_slice(&ctx.sign().as_ref()[..AEAD_PROOF_LEN]);
        out
    }

    /// The connection's keys and the server's proof (PROTOCOL §3.2):
    /// HKDF-SHA256 with the two nonces as salt, the key as input keying
    /// material and the label and both connection ids as info, expanded to
    /// the client-to-server key, the server-to-client key and the proof.
    pub(crate) fn derive(
        &self,
        nonce_c: &[u8; HANDSHAKE_NONCE_LEN],
        nonce_s: &[u8; HANDSHAKE_NONCE_LEN],
        cid_c: u32,
        cid_s: u32,
    ) -> Derived {
        let mut salt = [0u8; 2 * HANDSHAKE_NONCE_LEN];
        salt[..HANDSHAKE_NONCE_LEN].copy_from_slice(nonce_c);
        salt[HANDSHAKE_NONCE_LEN..].copy_from_slice(nonce_s);
        let prk = hkdf::Salt::new(hkdf::HKDF_SHA256, &salt).extract(&self.0);
        let (c, s) = (cid_c.to_be_bytes(), cid_s.to_be_bytes());
        let info: [&[u8]; 3] = [b"metaroce v1 aes-128-gcm", &c, &s];
        let mut okm = [0u8; 48];
        // 48 bytes are far below HKDF-SHA256's limit of 255 * 32: the
        // expansion cannot fail.
        if let Ok(o) = prk.expand(&info, OkmLen(okm.len())) {
            let _ = o.fill(&mut okm);
        }
        let key = |b: &[u8]| {
            aead::LessSafeKey::new(
                aead::UnboundKey::new(&aead::AES_128_GCM, b).expect("a 16-byte AES-128 key"),
            )
        };
        let mut proof = [0u8; AEAD_PROOF_LEN];
        proof.copy_from_slice(&okm[32..48]);
        Derived {
            c2s: key(&okm[..16]),
            s2c: key(&okm[16..32]),
            proof,
        }
    }
}

impl core::fmt::Debug for Psk {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str("Psk(..)")
    }
}

/// What HKDF gives a connection.
pub(crate) struct Derived {
    pub(crate) c2s: aead::LessSafeKey,
    pub(crate) s2c: aead::LessSafeKey,
    /// The server's proof, in its ACCEPT.
    pub(crate) proof: [u8; AEAD_PROOF_LEN],
}

/// An output length for HKDF.
struct OkmLen(usize);

impl hkdf::KeyType for OkmLen {
    fn len(&self) -> usize {
        self.0
    }
}

/// Compares two proofs in time independent of where they differ.
pub(crate) fn proofs_equal(a: &[u8; AEAD_PROOF_LEN], b: &[u8; AEAD_PROOF_LEN]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// A connection's AES-128-GCM state: a key per direction and the sending
/// direction's datagram counter (the nonce: it never repeats under a key).
pub(crate) struct Aead {
    tx: aead::LessSafeKey,
    rx: aead::LessSafeKey,
    /// Sequence number of the next datagram sealed.
    tx_seq: u64,
}

impl core::fmt::Debug for Aead {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Aead")
            .field("tx_seq", &self.tx_seq)
            .finish_non_exhaustive()
    }
}

impl Aead {
    /// The state of one side: `client` says which derived key it sends with.
    pub(crate) fn new(d: Derived, client: bool) -> Self {
        let (tx, rx) = if client {
            (d.c2s, d.s2c)
        } else {
            (d.s2c, d.c2s)
        };
        Aead { tx, rx, tx_seq: 0 }
    }

    /// Seals datagram `dg`: common header (AAD), ciphertext, tag,
    /// sequence number. Its packets are in it up to `at`; `payload`, which
    /// may be empty, is encrypted from where it is into its place from
    /// `at` on, right before the trailer. The last sequence number, or a
    /// seal that fails (only past GCM's per-message limit of 64 GiB), sends
    /// the datagram zeroed past its common header, never in clear: the
    /// peer drops it (PROTOCOL §3.2).
    fn seal(&mut self, dg: &mut [u8], at: usize, payload: &[u8]) {
        let seq = self.tx_seq;
        if seq == u64::MAX {
            dg[COMMON_HEADER_LEN..].fill(0);
            return;
        }
        self.tx_seq += 1;
        let (head, rest) = dg.split_at_mut(COMMON_HEADER_LEN);
        let (packets, rest) = rest.split_at_mut(at - COMMON_HEADER_LEN);
        let (sealed, seq_out) = rest.split_at_mut(payload.len() + AEAD_TAG_LEN);
        let r = self.tx.seal_in_place_scatter(
            nonce(seq),
            aead::Aad::from(&*head),
            packets,
            payload,
            sealed,
        );
        if r.is_err() {
            dg[COMMON_HEADER_LEN..].fill(0);
            return;
        }
        seq_out.copy_from_slice(&seq.to_be_bytes());
    }
}

/// The nonce of datagram `seq`: four zero bytes and the sequence number.
fn nonce(seq: u64) -> aead::Nonce {
    let mut n = [0u8; aead::NONCE_LEN];
    n[4..].copy_from_slice(&seq.to_be_bytes());
    aead::Nonce::assume_unique_for_key(n)
}

/// What protects a connection's datagrams, as negotiated in its handshake
/// ([`Endpoint::connection_protection`](crate::Endpoint::connection_protection)).
///
/// ```
/// use metaroce_proto::Protection;
/// assert_eq!(Protection::Crc32c.name(), "crc32c");
/// assert_eq!(Protection::None.name(), "none");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Protection {
    /// Nothing beyond the UDP checksum.
    None,
    /// A CRC32C trailer on every datagram (PROTOCOL §3.1).
    Crc32c,
    /// Every datagram sealed with AES-128-GCM under the connection's keys,
    /// derived from a pre-shared key (PROTOCOL §3.2).
    Aes128Gcm,
}

impl Protection {
    /// The name reports use: `none`, `crc32c`.
    pub fn name(self) -> &'static str {
        match self {
            Protection::None => "none",
            Protection::Crc32c => "crc32c",
            Protection::Aes128Gcm => "aes-128-gcm",
        }
    }
}

/// How a connection's datagrams are protected after the handshake.
#[derive(Debug, Default)]
pub(crate) enum Protect {
    /// Nothing beyond the UDP checksum.
    #[default]
    Plain,
    /// A CRC32C of the datagram's bytes before it, big-endian.
    Crc32c,
    /// Sealed with AES-128-GCM (PROTOCOL §3.2).
    Aead(Box<Aead>),
}

impl Protect {
    /// What the protection is called.
    pub(crate) fn kind(&self) -> Protection {
        match self {
            Protect::Plain => Protection::None,
            Protect::Crc32c => Protection::Crc32c,
            Protect::Aead(_) => Protection::Aes128Gcm,
        }
    }

    /// Bytes each datagram's trailer takes.
    #[inline]
    pub(crate) fn trailer_len(&self) -> usize {
        match self {
            Protect::Plain => 0,
            Protect::Crc32c => CRC32C_TRAILER_LEN,
            Protect::Aead(_) => AEAD_TRAILER_LEN,
        }
    }

    /// Fills the trailer of one datagram, `dg`: its packets followed by
    /// [`trailer_len`](Self::trailer_len) bytes.
    pub(crate) fn seal(&mut self, dg: &mut [u8]) {
        match self {
            Protect::Plain => {}
            Protect::Crc32c => {
                let (body, trailer) = dg.split_at_mut(dg.len() - CRC32C_TRAILER_LEN);
                trailer.copy_from_slice(&crc32c(body).to_be_bytes());
            }
            Protect::Aead(a) => {
                let n = dg.len() - AEAD_TRAILER_LEN;
                a.seal(dg, n, &[]);
            }
        }
    }

    /// [`seal`](Self::seal) of one datagram, `dg`, whose packets end with
    /// a payload that is not in it yet: `payload`, whose place is at `at`,
    /// right before the trailer. Sealed with AES-128-GCM, the payload is
    /// encrypted from where it is straight into its place (one pass over
    /// its bytes, where a copy first would make two); the datagram is the
    /// one [`seal`](Self::seal) would make of it copied in. Otherwise it is
    /// copied in and `seal` does the rest.
    pub(crate) fn seal_from(&mut self, dg: &mut [u8], at: usize, payload: &[u8]) {
        let end = at + payload.len();
        match self {
            Protect::Aead(a) if at >= COMMON_HEADER_LEN && end + AEAD_TRAILER_LEN == dg.len() => {
                a.seal(dg, at, payload);
            }
            _ => {
                dg[at..end].copy_from_slice(payload);
                self.seal(dg);
            }
        }
    }

    /// Opens a received datagram sealed with AES-128-GCM into `scratch`
    /// (at least as long): the length of its packets there (common header
    /// and plaintext), or `None` if it is not authentic. Any other
    /// protection: `None`. The ciphertext is decrypted from `dg` straight
    /// into `scratch`, one pass over the bytes; what `scratch` holds after
    /// a datagram that fails is never read.
    pub(crate) fn open_into(&self, dg: &[u8], scratch: &mut [u8]) -> Option<usize> {
        let Protect::Aead(a) = self else {
            return None;
        };
        let n = dg.len().checked_sub(AEAD_TRAILER_LEN)?;
        if n < COMMON_HEADER_LEN || scratch.len() < n {
            return None;
        }
        let seq = u64::from_be_bytes(dg[n + AEAD_TAG_LEN..].try_into().ok()?);
        let (head, body) = dg[..n].split_at(COMMON_HEADER_LEN);
        let tag = &dg[n..n + AEAD_TAG_LEN];
        let (out_head, out_body) = scratch[..n].split_at_mut(COMMON_HEADER_LEN);
        a.rx.open_separate_gather(nonce(seq), aead::Aad::from(head), body, tag, out_body)
            .ok()?;
        out_head.copy_from_slice(head);
        Some(n)
    }

    /// Whether datagrams are sealed (and must be opened, not checked).
    pub(crate) fn is_aead(&self) -> bool {
        matches!(self, Protect::Aead(_))
    }

    /// Checks one received datagram; the length of its packets (the
    /// datagram without its trailer), or `None` if it fails the check.
    pub(crate) fn check(&self, dg: &[u8]) -> Option<usize> {
        match self {
            Protect::Plain => Some(dg.len()),
            Protect::Aead(_) => None,
            Protect::Crc32c => {
                let body = dg.len().checked_sub(CRC32C_TRAILER_LEN)?;
                let want = u32::from_be_bytes(dg[body..].try_into().ok()?);
                (crc32c(&dg[..body]) == want).then_some(body)
            }
        }
    }
}

/// CRC32C (iSCSI, Castagnoli) of `data`: `crc-fast` folds it with the
/// CPU's carry-less multiply, 512 bits at a time where the CPU has
/// AVX-512 VPCLMULQDQ (3.3 times the speed of the SSE 4.2 CRC32
/// instruction over 4 KiB on the Intel host, `docs/BENCHMARKS.md`), and
/// falls back to narrower vectors or tables on CPUs without.
#[inline]
fn crc32c(data: &[u8]) -> u32 {
    crc_fast::crc32_iscsi(data)
}

/// A running CRC32C, for a packet whose bytes come in several pieces.
fn crc32c_digest() -> crc_fast::Digest {
    crc_fast::Digest::new(crc_fast::CrcAlgorithm::Crc32Iscsi)
}

/// The CRC32C of each segment of a gathered transmit, written into its
/// trailer: the bytes are the chunks in wire order (`Buf` ranges of `buf`,
/// region bytes from `region`), the transmit `size` bytes long in segments
/// of `seg` bytes (the last one shorter), each ending with a trailer of
/// [`CRC32C_TRAILER_LEN`] bytes that lies in a `Buf` chunk.
pub(crate) fn crc_gathered<'a>(
    buf: &mut [u8],
    chunks: &[crate::Chunk],
    mut region: impl FnMut(u32, core::ops::Range<usize>) -> Option<&'a [u8]>,
    size: usize,
    seg: usize,
) {
    const T: usize = CRC32C_TRAILER_LEN;
    // Wire offset where the current segment starts, its body's end, and
    // its CRC so far.
    let mut seg_start = 0usize;
    let body_end = |start: usize| (start + seg).min(size) - T;
    let mut end = body_end(0);
    let mut wire = 0usize;
    let mut crc = crc32c_digest();
    for c in chunks {
        match c {
            crate::Chunk::Region { lkey, range } => {
                if let Some(bytes) = region(*lkey, range.clone()) {
                    crc.update(bytes);
                }
                wire += range.len();
            }
            crate::Chunk::Buf(r) => {
                let mut at = r.start;
                while at < r.end {
                    if wire < end {
                        let n = (end - wire).min(r.end - at);
                        crc.update(&buf[at..at + n]);
                        at += n;
                        wire += n;
                    } else {
                        // The trailer: within this chunk by construction.
                        let n = T.min(r.end - at);
                        if n == T {
                            let sum = crc.finalize() as u32;
                            buf[at..at + T].copy_from_slice(&sum.to_be_bytes());
                        }
                        at += n;
                        wire += n;
                        seg_start += seg;
                        crc.reset();
                        if seg_start < size {
                            end = body_end(seg_start);
                        } else {
                            end = usize::MAX;
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Chunk;

    #[test]
    fn crc32c_is_castagnoli() {
        // The check value of CRC-32C (iSCSI, RFC 3720).
        assert_eq!(crc32c(b"123456789"), 0xe306_9283);
    }

    #[test]
    fn crc_round_trip_and_any_flip_fails() {
        let mut dg = vec![0u8; 100 + CRC32C_TRAILER_LEN];
        for (i, b) in dg.iter_mut().enumerate().take(100) {
            *b = i as u8;
        }
        let mut p = Protect::Crc32c;
        p.seal(&mut dg);
        assert_eq!(p.check(&dg), Some(100));
        for bit in 0..dg.len() * 8 {
            let mut d = dg.clone();
            d[bit / 8] ^= 1 << (bit % 8);
            assert_eq!(p.check(&d), None, "bit {bit}");
        }
        assert_eq!(p.check(&dg[..3]), None);
        assert_eq!(Protect::Plain.check(&dg), Some(dg.len()));
    }

    #[test]
    fn gathered_crc_matches_contiguous() {
        // Two segments of 40 wire bytes and a last one of 25: header (8),
        // region payload, trailer; the trailers in the buffer after each
        // header.
        const T: usize = CRC32C_TRAILER_LEN;
        let region: Vec<u8> = (0..200u8).collect();
        let mut buf = vec![0u8; 64];
        let mut chunks = Vec::new();
        let mut wire = Vec::new();
        let mut at = 0;
        let mut off = 0;
        for (i, plen) in [28usize, 28, 13].into_iter().enumerate() {
            buf[at..at + 8].fill(i as u8 + 1);
            chunks.push(Chunk::Buf(at..at + 8));
            chunks.push(Chunk::Region {
                lkey: 7,
                range: off..off + plen,
            });
            chunks.push(Chunk::Buf(at + 8..at + 8 + T));
            let mut dg = buf[at..at + 8].to_vec();
            dg.extend_from_slice(&region[off..off + plen]);
            dg.extend_from_slice(&[0; T]);
            Protect::Crc32c.seal(&mut dg);
            wire.push(dg);
            at += 8 + T;
            off += plen;
        }
        // As `Gather` has them: adjacent buffer ranges merged.
        let mut merged: Vec<Chunk> = Vec::new();
        for c in chunks {
            match (merged.last_mut(), &c) {
                (Some(Chunk::Buf(a)), Chunk::Buf(b)) if a.end == b.start => a.end = b.end,
                _ => merged.push(c),
            }
        }
        assert_eq!(merged.len(), 7);
        crc_gathered(&mut buf, &merged, |_, r| Some(&region[r]), 105, 40);
        for (i, dg) in wire.iter().enumerate() {
            let t = i * (8 + T) + 8;
            assert_eq!(&buf[t..t + T], &dg[dg.len() - T..], "segment {i}");
        }
    }

    /// A sending and a receiving side of one connection's keys.
    fn aead_pair() -> (Protect, Protect) {
        let psk = Psk::new([9; PSK_LEN]);
        let derive = || psk.derive(&[1; HANDSHAKE_NONCE_LEN], &[2; HANDSHAKE_NONCE_LEN], 5, 6);
        (
            Protect::Aead(Box::new(Aead::new(derive(), true))),
            Protect::Aead(Box::new(Aead::new(derive(), false))),
        )
    }

    #[test]
    fn sealing_from_a_payload_elsewhere_is_sealing_it_copied_in() {
        let payload: Vec<u8> = (0..4096u32).map(|i| (i * 7) as u8).collect();
        // Common header, 40 more bytes of packets, payload, trailer.
        let at = COMMON_HEADER_LEN + 40;
        let len = at + payload.len() + AEAD_TRAILER_LEN;
        let head: Vec<u8> = (0..at as u8).collect();
        let (mut a, _) = aead_pair();
        let (mut b, rx) = aead_pair();
        for round in 0..3 {
            let mut copied = vec![0u8; len];
            copied[..at].copy_from_slice(&head);
            copied[at..at + payload.len()].copy_from_slice(&payload);
            a.seal(&mut copied);
            let mut scattered = vec![0xa5u8; len];
            scattered[..at].copy_from_slice(&head);
            b.seal_from(&mut scattered, at, &payload);
            assert_eq!(scattered, copied, "round {round}");
            let mut out = vec![0u8; len];
            assert_eq!(
                rx.open_into(&scattered, &mut out),
                Some(len - AEAD_TRAILER_LEN)
            );
            assert_eq!(&out[..at], &head[..]);
            assert_eq!(&out[at..at + payload.len()], &payload[..]);
        }
        // Not a payload right before the trailer: copied in, then sealed.
        let mut copied = vec![0u8; len];
        copied[..at].copy_from_slice(&head);
        copied[at..at + 100].copy_from_slice(&payload[..100]);
        a.seal(&mut copied);
        let mut other = vec![0u8; len];
        other[..at].copy_from_slice(&head);
        b.seal_from(&mut other, at, &payload[..100]);
        assert_eq!(other, copied);
    }

    #[test]
    fn opening_refuses_any_flipped_bit() {
        let (mut tx, rx) = aead_pair();
        let at = COMMON_HEADER_LEN + 8;
        let mut dg = vec![3u8; at + 64 + AEAD_TRAILER_LEN];
        tx.seal_from(&mut dg, at, &[0x5a; 64]);
        let mut out = vec![0u8; dg.len()];
        assert_eq!(rx.open_into(&dg, &mut out), Some(at + 64));
        for bit in 0..dg.len() * 8 {
            let mut d = dg.clone();
            d[bit / 8] ^= 1 << (bit % 8);
            assert_eq!(rx.open_into(&d, &mut out), None, "bit {bit}");
        }
        assert_eq!(rx.open_into(&dg[..AEAD_TRAILER_LEN + 3], &mut out), None);
        assert_eq!(rx.open_into(&dg, &mut out[..10]), None);
    }

    #[test]
    fn the_last_sequence_number_sends_nothing_in_clear() {
        let (mut tx, rx) = aead_pair();
        if let Protect::Aead(a) = &mut tx {
            a.tx_seq = u64::MAX;
        }
        let at = COMMON_HEADER_LEN + 8;
        for scatter in [false, true] {
            let mut dg = vec![0x77u8; at + 64 + AEAD_TRAILER_LEN];
            if scatter {
                tx.seal_from(&mut dg, at, &[0x5a; 64]);
            } else {
                tx.seal(&mut dg);
            }
            assert!(dg[COMMON_HEADER_LEN..].iter().all(|&b| b == 0), "{dg:?}");
            let mut out = vec![0u8; dg.len()];
            assert_eq!(rx.open_into(&dg, &mut out), None);
        }
    }
}
