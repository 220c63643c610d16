//! Memory regions and their keys.

use super::{AccessFlags, PdHandle, RegionBuf, Registered, SgList, VerbsError};
use crate::endpoint::RegionPin;
use core::ops::Range;
use core::sync::atomic::{AtomicU64, Ordering};
use std::collections::HashMap;

/// Tells tables apart, so a pin goes back only to the one that made it.
static NEXT_TABLE: AtomicU64 = AtomicU64::new(1);

/// What the application learns when it registers a region: the keys and
/// where it lives in the virtual address space that peers use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MrInfo {
    /// Local key, for [`Sge::lkey`](super::Sge::lkey).
    pub lkey: u32,
    /// Remote key, to hand to peers for WRITE/READ.
    pub rkey: u32,
    /// Virtual address of byte 0 of the region.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Access rights.
    pub access: AccessFlags,
}

/// Why a peer's WRITE or READ was refused (it completes with
/// `RemoteAccessError` at the peer), for the responder's log.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum RemoteRefusal {
    /// The QP was not given the right (`QpAttrs::access`).
    #[error("the QP allows {has} only, not {need}")]
    QpAccess { need: AccessFlags, has: AccessFlags },
    /// No region has the key: never issued, deregistered, or forged.
    #[error("no memory region has this rkey (never issued or deregistered)")]
    NoRegion,
    /// The region is in another protection domain than the QP.
    #[error("the region is in another protection domain than the QP")]
    OtherPd,
    /// The region's bytes are lent to the application.
    #[error("the region is lent to the application (MemoryRegion::lend)")]
    Lent,
    /// The region was not registered with the right.
    #[error("the region was registered with {has}, without {need}")]
    RegionAccess { need: AccessFlags, has: AccessFlags },
    /// The range reaches outside the region.
    #[error("the range reaches outside the region of {size} bytes at {start:#x}")]
    Bounds { start: u64, size: u64 },
}

#[derive(Debug)]
pub(crate) struct MemoryRegion {
    pub(crate) pd: PdHandle,
    pub(crate) info: MrInfo,
    /// The bytes, indexed by the range a transfer copies (never as a
    /// whole inside the core).
    pub(crate) buf: Registered,
    /// Outstanding work requests and READ responses that reference the region.
    pub(crate) refs: u32,
    /// Gathered transmits the driver still sends from the region
    /// ([`Chunk::Region`](crate::Chunk::Region)): its memory must stay.
    pub(crate) pins: u32,
    /// The bytes are lent to the application ([`MrTable::lend`]): `buf` is
    /// empty until they come back, and nothing may use the region.
    pub(crate) lent: bool,
}

impl MemoryRegion {
    /// The byte range of `[addr, addr+len)` inside the buffer, if the region
    /// is in `pd`, grants every right in `need`, and holds the whole range:
    /// the check made before any byte is placed or sent for a peer.
    pub(crate) fn permits(
        &self,
        pd: PdHandle,
        need: AccessFlags,
        addr: u64,
        len: u64,
    ) -> Option<Range<usize>> {
        if self.pd != pd || !self.info.access.contains(need) {
            return None;
        }
        self.range(addr, len)
    }

    /// Nothing uses the region: its bytes are not lent, no request or READ
    /// response references it, and the driver sends nothing from it; else
    /// the error that says which (what deregistering and lending need).
    fn idle(&self) -> Result<(), VerbsError> {
        if self.lent {
            return Err(VerbsError::MrLent(self.info.lkey));
        }
        if self.refs > 0 {
            return Err(VerbsError::MrInUse(self.refs));
        }
        if self.pins > 0 {
            return Err(VerbsError::MrSending(self.pins));
        }
        Ok(())
    }

    /// The byte range of `[addr, addr+len)` inside the buffer, if it is inside.
    pub(crate) fn range(&self, addr: u64, len: u64) -> Option<Range<usize>> {
        let start = addr.checked_sub(self.info.addr)?;
        let end = start.checked_add(len)?;
        if end > self.buf.len() as u64 {
            return None;
        }
        Some(start as usize..end as usize)
    }
}

/// Memory-region keys: a secret pseudo-random permutation of a
/// registration counter (PROTOCOL §9.1).
///
/// Every key is drawn from the full 32-bit space, so a peer cannot guess
/// the key of a region it was not given, and, being a permutation of a
/// counter, no key is issued twice until 2³² keys have been drawn: a key
/// that was deregistered is never honoured again, whatever a late or forged
/// packet carries. The permutation is an eight-round Feistel network over
/// two 16-bit halves whose round function is SipHash-1-3 under a 128-bit
/// secret taken from the endpoint's seeded generator; after 2³² draws it
/// moves to a new secret derived from the old.
#[derive(Debug)]
struct KeyGen {
    secret: (u64, u64),
    counter: u32,
}

/// Feistel rounds of [`KeyGen`].
const KEY_ROUNDS: u32 = 8;

impl KeyGen {
    fn new(secret: (u64, u64)) -> Self {
        KeyGen { secret, counter: 0 }
    }

    /// The permutation of `x` under the current secret.
    fn permute(&self, x: u32) -> u32 {
        use core::hash::Hasher;
        let (mut l, mut r) = ((x >> 16) as u16, x as u16);
        for round in 0..KEY_ROUNDS {
            let mut h = siphasher::sip::SipHasher13::new_with_keys(self.secret.0, self.secret.1);
            h.write_u32(round << 16 | u32::from(r));
            let f = h.finish() as u16;
            (l, r) = (r, l ^ f);
        }
        u32::from(l) << 16 | u32::from(r)
    }

    /// The next key that is neither 0 (no key) nor `in_use`.
    fn next(&mut self, in_use: impl Fn(u32) -> bool) -> u32 {
        loop {
            let k = self.permute(self.counter);
            self.counter = self.counter.wrapping_add(1);
            if self.counter == 0 {
                // 2³² keys drawn: a new permutation.
                self.secret = (
                    self.secret.0.rotate_left(17) ^ self.secret.1,
                    self.secret.1.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x6b65_795f_6379_636c,
                );
            }
            if k != 0 && !in_use(k) {
                return k;
            }
        }
    }
}

/// The registered regions, in slots reused after deregistration, found by
/// their keys through one map (an lkey and an rkey are never equal).
#[derive(Debug)]
pub(crate) struct MrTable {
    slots: Vec<Option<MemoryRegion>>,
    free: Vec<u32>,
    /// Every live lkey and rkey, to its slot.
    keys: HashMap<u32, u32, rustc_hash::FxBuildHasher>,
    keygen: KeyGen,
    /// This table's identity, in every pin it makes.
    owner: u64,
}

impl Drop for MrTable {
    /// A region still pinned may be read by the kernel: its memory is
    /// leaked, not freed.
    fn drop(&mut self) {
        for mr in self.slots.iter_mut().flatten() {
            if mr.pins > 0 {
                std::mem::forget(std::mem::take(&mut mr.buf));
            }
        }
    }
}

/// The most regions one table holds.
pub(crate) const MAX_REGIONS: usize = 1 << 24;

impl MrTable {
    /// An empty table whose keys come from the permutation under `secret`.
    pub(crate) fn new(secret: (u64, u64)) -> Self {
        MrTable {
            slots: Vec::new(),
            free: Vec::new(),
            keys: HashMap::default(),
            keygen: KeyGen::new(secret),
            owner: NEXT_TABLE.fetch_add(1, Ordering::Relaxed),
        }
    }

    pub(crate) fn register(
        &mut self,
        pd: PdHandle,
        buf: RegionBuf,
        addr: u64,
        access: AccessFlags,
    ) -> Result<MrInfo, VerbsError> {
        if buf.is_empty() || addr.checked_add(buf.len() as u64).is_none() {
            return Err(VerbsError::InvalidLength(buf.len()));
        }
        if self.keys.len() / 2 >= MAX_REGIONS {
            return Err(VerbsError::TooManyRegions);
        }
        let idx = match self.free.pop() {
            Some(i) => i,
            None => {
                self.slots.push(None);
                (self.slots.len() - 1) as u32
            }
        };
        let keys = &self.keys;
        let lkey = self.keygen.next(|k| keys.contains_key(&k));
        let rkey = self.keygen.next(|k| k == lkey || keys.contains_key(&k));
        self.keys.insert(lkey, idx);
        self.keys.insert(rkey, idx);
        let info = MrInfo {
            lkey,
            rkey,
            addr,
            len: buf.len() as u64,
            access,
        };
        self.slots[idx as usize] = Some(MemoryRegion {
            pd,
            info,
            buf: Registered::new(buf),
            refs: 0,
            pins: 0,
            lent: false,
        });
        Ok(info)
    }

    pub(crate) fn deregister(&mut self, lkey: u32) -> Result<RegionBuf, VerbsError> {
        let mr = self.by_lkey(lkey).ok_or(VerbsError::InvalidKey(lkey))?;
        mr.idle()?;
        let rkey = mr.info.rkey;
        let idx = self.keys[&lkey];
        let mr = self.slots[idx as usize]
            .take()
            .ok_or(VerbsError::InvalidKey(lkey))?;
        self.keys.remove(&lkey);
        self.keys.remove(&rkey);
        self.free.push(idx);
        Ok(mr.buf.into_inner())
    }

    /// Takes a region's bytes out for the application, keeping its keys:
    /// refused while requests or READ responses reference it
    /// ([`VerbsError::MrInUse`]), while the driver still sends from it
    /// ([`VerbsError::MrSending`], microseconds), or if they are lent
    /// already. Until [`give_back`](Self::give_back), posts that name the
    /// region are refused and peers' accesses to it fail.
    pub(crate) fn lend(&mut self, lkey: u32) -> Result<RegionBuf, VerbsError> {
        let mr = self.by_lkey_mut(lkey).ok_or(VerbsError::InvalidKey(lkey))?;
        mr.idle()?;
        mr.lent = true;
        Ok(std::mem::take(&mut mr.buf).into_inner())
    }

    /// Puts lent bytes back ([`lend`](Self::lend)): `buf` must be as long as
    /// the region ([`VerbsError::InvalidLength`] if not, and it is dropped).
    pub(crate) fn give_back(&mut self, lkey: u32, buf: RegionBuf) -> Result<(), VerbsError> {
        let mr = self.by_lkey_mut(lkey).ok_or(VerbsError::InvalidKey(lkey))?;
        if !mr.lent {
            return Err(VerbsError::InvalidKey(lkey));
        }
        if buf.len() as u64 != mr.info.len {
            return Err(VerbsError::InvalidLength(buf.len()));
        }
        mr.buf = Registered::new(buf);
        mr.lent = false;
        Ok(())
    }

    fn slot(&self, key: u32) -> Option<&MemoryRegion> {
        let &i = self.keys.get(&key)?;
        self.slots.get(i as usize)?.as_ref()
    }

    fn slot_mut(&mut self, key: u32) -> Option<&mut MemoryRegion> {
        let &i = self.keys.get(&key)?;
        self.slots.get_mut(i as usize)?.as_mut()
    }

    pub(crate) fn by_lkey(&self, lkey: u32) -> Option<&MemoryRegion> {
        self.slot(lkey).filter(|m| m.info.lkey == lkey)
    }

    pub(crate) fn by_lkey_mut(&mut self, lkey: u32) -> Option<&mut MemoryRegion> {
        self.slot_mut(lkey).filter(|m| m.info.lkey == lkey)
    }

    pub(crate) fn by_rkey(&self, rkey: u32) -> Option<&MemoryRegion> {
        self.slot(rkey).filter(|m| m.info.rkey == rkey)
    }

    pub(crate) fn by_rkey_mut(&mut self, rkey: u32) -> Option<&mut MemoryRegion> {
        self.slot_mut(rkey).filter(|m| m.info.rkey == rkey)
    }

    /// Number of regions in `pd`.
    /// Regions registered.
    pub(crate) fn len(&self) -> usize {
        self.keys.len() / 2
    }

    pub(crate) fn count_in_pd(&self, pd: PdHandle) -> usize {
        self.slots.iter().flatten().filter(|m| m.pd == pd).count()
    }

    /// Checks a local buffer for a request, and says why it is refused:
    /// no such region, lent, another PD, missing rights, or out of bounds
    /// (in that order). An empty buffer names no memory and always passes.
    pub(crate) fn local_access(
        &self,
        pd: PdHandle,
        lkey: u32,
        addr: u64,
        len: u32,
        need: AccessFlags,
    ) -> Result<(), VerbsError> {
        if len == 0 {
            return Ok(());
        }
        let mr = self.by_lkey(lkey).ok_or(VerbsError::InvalidKey(lkey))?;
        if mr.lent {
            return Err(VerbsError::MrLent(lkey));
        }
        if mr.pd != pd {
            return Err(VerbsError::OtherPd(lkey));
        }
        if !mr.info.access.contains(need) {
            return Err(VerbsError::AccessDenied {
                lkey,
                need,
                has: mr.info.access,
            });
        }
        mr.range(addr, u64::from(len))
            .map(|_| ())
            .ok_or(VerbsError::OutsideRegion { lkey, addr, len })
    }

    /// Checks a peer's access to `len` bytes at `addr` of region `rkey`
    /// for a QP in `pd` whose access flags are `qp_access`, and says why
    /// when it is refused (a `RemoteAccessError` for the peer). An empty
    /// access names no memory and always passes (as in verbs).
    pub(crate) fn remote_access(
        &self,
        pd: PdHandle,
        qp_access: AccessFlags,
        rkey: u32,
        addr: u64,
        len: u64,
        need: AccessFlags,
    ) -> Result<(), RemoteRefusal> {
        if len == 0 {
            return Ok(());
        }
        if !qp_access.contains(need) {
            return Err(RemoteRefusal::QpAccess {
                need,
                has: qp_access,
            });
        }
        let mr = self.by_rkey(rkey).ok_or(RemoteRefusal::NoRegion)?;
        if mr.lent {
            return Err(RemoteRefusal::Lent);
        }
        if mr.pd != pd {
            return Err(RemoteRefusal::OtherPd);
        }
        if !mr.info.access.contains(need) {
            return Err(RemoteRefusal::RegionAccess {
                need,
                has: mr.info.access,
            });
        }
        mr.range(addr, len)
            .map(|_| ())
            .ok_or(RemoteRefusal::Bounds {
                start: mr.info.addr,
                size: mr.info.len,
            })
    }

    /// [`local_access`](Self::local_access) for every element of a
    /// request's list, in order: the first refusal.
    pub(crate) fn local_access_list(
        &self,
        pd: PdHandle,
        list: &SgList,
        need: AccessFlags,
    ) -> Result<(), VerbsError> {
        list.as_slice()
            .iter()
            .try_for_each(|s| self.local_access(pd, s.lkey, s.addr, s.len, need))
    }

    /// Adds (`+1`) or drops (`-1`) a reference on the region of each
    /// non-empty element of `list` (one per element: a region named twice
    /// holds two).
    pub(crate) fn add_list_refs(&mut self, list: &SgList, delta: i32) {
        for s in list.as_slice().iter().filter(|s| s.len > 0) {
            self.add_ref(s.lkey, delta);
        }
    }

    /// Copies `payload` to message bytes `offset..` of `list`, split over
    /// its elements in order. Every piece is checked first (in the list,
    /// each region still of `pd` and allowing `need`, within bounds):
    /// false, and nothing written, if one is not.
    pub(crate) fn scatter(
        &mut self,
        pd: PdHandle,
        need: AccessFlags,
        list: &SgList,
        offset: u32,
        payload: &[u8],
    ) -> bool {
        let Ok(len) = u32::try_from(payload.len()) else {
            return false;
        };
        let Some(pieces) = list.pieces(offset, len) else {
            return false;
        };
        let mut ranges: [(u32, Range<usize>); crate::consts::MAX_SGE] = Default::default();
        let mut n = 0;
        for (lkey, addr, plen) in pieces {
            let Some(r) = self
                .by_lkey(lkey)
                .and_then(|m| m.permits(pd, need, addr, u64::from(plen)))
            else {
                return false;
            };
            ranges[n] = (lkey, r);
            n += 1;
        }
        let mut at = 0;
        for (lkey, r) in ranges[..n].iter().cloned() {
            let Some(m) = self.by_lkey_mut(lkey) else {
                return false;
            };
            let l = r.len();
            m.buf[r].copy_from_slice(&payload[at..at + l]);
            at += l;
        }
        true
    }

    /// Adds (`+1`) or drops (`-1`) a reference.
    pub(crate) fn add_ref(&mut self, lkey: u32, delta: i32) {
        if let Some(mr) = self.by_lkey_mut(lkey) {
            mr.refs = mr.refs.saturating_add_signed(delta);
        }
    }

    /// Pins a region for a gathered transmit.
    pub(crate) fn pin(&mut self, lkey: u32) -> Option<RegionPin> {
        let owner = self.owner;
        let mr = self.by_lkey_mut(lkey)?;
        mr.pins = mr.pins.checked_add(1)?;
        Some(RegionPin { lkey, owner })
    }

    /// Lets go of a pin this table made (others are ignored).
    pub(crate) fn unpin(&mut self, pin: RegionPin) {
        if pin.owner != self.owner {
            return;
        }
        if let Some(mr) = self.by_lkey_mut(pin.lkey) {
            mr.pins = mr.pins.saturating_sub(1);
        }
    }

    pub(crate) fn add_ref_rkey(&mut self, rkey: u32, delta: i32) {
        if let Some(mr) = self.by_rkey_mut(rkey) {
            mr.refs = mr.refs.saturating_add_signed(delta);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_bounds_and_reuse() {
        let mut t = MrTable::new((1, 2));
        let pd = PdHandle(0);
        let a = t
            .register(pd, RegionBuf::zeroed(100), 0x1000, AccessFlags::ALL)
            .unwrap();
        assert_ne!(a.lkey, a.rkey);
        assert!(t.by_rkey(a.lkey).is_none());
        let mr = t.by_rkey(a.rkey).unwrap();
        assert_eq!(mr.range(0x1000, 100), Some(0..100));
        assert_eq!(mr.range(0x1010, 10), Some(16..26));
        assert_eq!(mr.range(0x0fff, 1), None);
        assert_eq!(mr.range(0x1000, 101), None);
        assert_eq!(mr.range(u64::MAX, 2), None);
        assert!(t
            .local_access(pd, a.lkey, 0x1000, 100, AccessFlags::LOCAL_WRITE)
            .is_ok());
        assert!(t
            .local_access(PdHandle(1), a.lkey, 0x1000, 100, AccessFlags::NONE)
            .is_err());
        t.add_ref(a.lkey, 1);
        assert_eq!(t.deregister(a.lkey), Err(VerbsError::MrInUse(1)));
        t.add_ref(a.lkey, -1);
        let p1 = t.pin(a.lkey).unwrap();
        let p2 = t.pin(a.lkey).unwrap();
        assert_eq!(t.deregister(a.lkey), Err(VerbsError::MrSending(2)));
        // Another table's pin does not unpin this one's region.
        let mut other = MrTable::new((1, 2));
        other.unpin(t.pin(a.lkey).unwrap());
        t.unpin(RegionPin {
            lkey: a.lkey,
            owner: other.owner,
        });
        assert_eq!(t.deregister(a.lkey), Err(VerbsError::MrSending(3)));
        t.unpin(p1);
        t.unpin(p2);
        assert_eq!(t.deregister(a.lkey), Err(VerbsError::MrSending(1)));
        let p3 = RegionPin {
            lkey: a.lkey,
            owner: t.owner,
        };
        t.unpin(p3);
        assert!(t.deregister(a.lkey).is_ok());
        assert!(t.by_lkey(a.lkey).is_none());
        let b = t
            .register(pd, RegionBuf::zeroed(8), 0, AccessFlags::NONE)
            .unwrap();
        assert_ne!(a.lkey, b.lkey, "a reused slot gets a new key");
        assert!(t.by_rkey(a.rkey).is_none());
        assert!(t
            .register(pd, RegionBuf::default(), 0, AccessFlags::NONE)
            .is_err());
    }

    /// Keys come from the whole 32-bit space, and no key is issued twice:
    /// a slot registered again and again never gets back a key it had, so
    /// a WRITE that names a deregistered region never lands in its successor.
    #[test]
    fn keys_are_never_reissued() {
        let mut t = MrTable::new((0x1234, 0x5678));
        let pd = PdHandle(0);
        let mut seen = std::collections::HashSet::new();
        let (mut high, mut low) = (0u32, 0u32);
        for _ in 0..20_000 {
            let m = t
                .register(pd, RegionBuf::zeroed(8), 0, AccessFlags::REMOTE_WRITE)
                .unwrap();
            assert!(seen.insert(m.lkey), "lkey {:#x} issued twice", m.lkey);
            assert!(seen.insert(m.rkey), "rkey {:#x} issued twice", m.rkey);
            high |= m.rkey >> 24;
            low |= m.rkey & 0xff;
            t.deregister(m.lkey).unwrap();
            assert!(t.by_rkey(m.rkey).is_none());
            assert!(t.by_lkey(m.lkey).is_none());
        }
        assert_eq!((high, low), (0xff, 0xff), "keys spread over all 32 bits");
        // The same secret gives the same keys; another gives others.
        let first = |secret| {
            MrTable::new(secret)
                .register(pd, RegionBuf::zeroed(8), 0, AccessFlags::NONE)
                .unwrap()
                .rkey
        };
        assert_eq!(first((1, 2)), first((1, 2)));
        assert_ne!(first((1, 2)), first((1, 3)));
    }

    #[test]
    fn key_permutation_is_a_bijection_on_a_sample() {
        let g = KeyGen::new((9, 10));
        let inputs: std::collections::BTreeSet<u32> =
            (0..u32::MAX).step_by(65_521).chain(0..70_000).collect();
        let outputs: std::collections::HashSet<u32> =
            inputs.iter().map(|&x| g.permute(x)).collect();
        assert_eq!(outputs.len(), inputs.len());
    }

    #[test]
    fn refusals_say_why() {
        let mut t = MrTable::new((3, 4));
        let pd = PdHandle(1);
        let a = t
            .register(pd, RegionBuf::zeroed(64), 0x100, AccessFlags::REMOTE_READ)
            .unwrap();
        let lw = AccessFlags::LOCAL_WRITE;
        assert_eq!(
            t.local_access(pd, a.lkey, 0x100, 64, AccessFlags::NONE),
            Ok(())
        );
        assert_eq!(
            t.local_access(pd, a.lkey, 0x100, 64, lw),
            Err(VerbsError::AccessDenied {
                lkey: a.lkey,
                need: lw,
                has: AccessFlags::REMOTE_READ
            })
        );
        assert_eq!(
            t.local_access(PdHandle(2), a.lkey, 0x100, 1, AccessFlags::NONE),
            Err(VerbsError::OtherPd(a.lkey))
        );
        assert_eq!(
            t.local_access(pd, a.lkey, 0x101, 64, AccessFlags::NONE),
            Err(VerbsError::OutsideRegion {
                lkey: a.lkey,
                addr: 0x101,
                len: 64
            })
        );
        assert_eq!(
            t.local_access(pd, a.lkey ^ 1, 0x100, 1, AccessFlags::NONE),
            Err(VerbsError::InvalidKey(a.lkey ^ 1))
        );
        assert_eq!(t.local_access(pd, 0, 0, 0, lw), Ok(()), "empty");

        let (rr, rw) = (AccessFlags::REMOTE_READ, AccessFlags::REMOTE_WRITE);
        let all = AccessFlags::ALL;
        assert_eq!(t.remote_access(pd, all, a.rkey, 0x100, 64, rr), Ok(()));
        assert_eq!(
            t.remote_access(pd, rr, a.rkey, 0x100, 64, rw),
            Err(RemoteRefusal::QpAccess { need: rw, has: rr })
        );
        assert_eq!(
            t.remote_access(pd, all, a.rkey, 0x100, 64, rw),
            Err(RemoteRefusal::RegionAccess { need: rw, has: rr })
        );
        assert_eq!(
            t.remote_access(pd, all, a.rkey ^ 1, 0x100, 64, rr),
            Err(RemoteRefusal::NoRegion)
        );
        assert_eq!(
            t.remote_access(PdHandle(2), all, a.rkey, 0x100, 64, rr),
            Err(RemoteRefusal::OtherPd)
        );
        let e = t.remote_access(pd, all, a.rkey, 0x100, 65, rr).unwrap_err();
        assert_eq!(
            e,
            RemoteRefusal::Bounds {
                start: 0x100,
                size: 64
            }
        );
        assert_eq!(
            e.to_string(),
            "the range reaches outside the region of 64 bytes at 0x100"
        );
    }

    #[test]
    fn a_lent_region_is_refused_until_it_is_back() {
        let mut t = MrTable::new((3, 4));
        let pd = PdHandle(1);
        let a = t
            .register(pd, RegionBuf::copy_of(&[9; 64]), 0x100, AccessFlags::ALL)
            .unwrap();
        t.add_ref(a.lkey, 1);
        assert_eq!(t.lend(a.lkey).unwrap_err(), VerbsError::MrInUse(1));
        t.add_ref(a.lkey, -1);
        let mut buf = t.lend(a.lkey).unwrap();
        assert_eq!(buf.len(), 64);
        assert_eq!(t.lend(a.lkey).unwrap_err(), VerbsError::MrLent(a.lkey));
        let lw = AccessFlags::LOCAL_WRITE;
        assert_eq!(
            t.local_access(pd, a.lkey, 0x100, 1, lw),
            Err(VerbsError::MrLent(a.lkey))
        );
        let rw = AccessFlags::REMOTE_WRITE;
        assert_eq!(
            t.remote_access(pd, AccessFlags::ALL, a.rkey, 0x100, 1, rw),
            Err(RemoteRefusal::Lent)
        );
        assert_eq!(
            t.deregister(a.lkey).unwrap_err(),
            VerbsError::MrLent(a.lkey)
        );
        assert_eq!(
            t.give_back(a.lkey, RegionBuf::zeroed(63)),
            Err(VerbsError::InvalidLength(63))
        );
        buf[0] = 1;
        t.give_back(a.lkey, buf).unwrap();
        assert_eq!(t.local_access(pd, a.lkey, 0x100, 64, lw), Ok(()));
        assert_eq!(t.by_lkey(a.lkey).unwrap().buf[0..2], [1, 9]);
        assert_eq!(t.deregister(a.lkey).unwrap().len(), 64);
    }

    #[test]
    fn permits_checks_pd_rights_and_bounds() {
        let mut t = MrTable::new((3, 4));
        let a = t
            .register(
                PdHandle(1),
                RegionBuf::zeroed(64),
                0x100,
                AccessFlags::REMOTE_READ,
            )
            .unwrap();
        let m = t.by_rkey(a.rkey).unwrap();
        assert_eq!(
            m.permits(PdHandle(1), AccessFlags::REMOTE_READ, 0x100, 64),
            Some(0..64)
        );
        assert_eq!(
            m.permits(PdHandle(2), AccessFlags::REMOTE_READ, 0x100, 64),
            None
        );
        assert_eq!(
            m.permits(PdHandle(1), AccessFlags::REMOTE_WRITE, 0x100, 1),
            None
        );
        assert_eq!(
            m.permits(PdHandle(1), AccessFlags::REMOTE_READ, 0x101, 64),
            None
        );
    }
}
