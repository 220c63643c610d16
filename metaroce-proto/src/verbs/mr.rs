//! Memory regions and their keys.

use super::{AccessFlags, PdHandle, RegionBuf, VerbsError};
use crate::endpoint::RegionPin;
use core::ops::Range;
use core::sync::atomic::{AtomicU64, Ordering};

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

#[derive(Debug)]
pub(crate) struct MemoryRegion {
    pub(crate) pd: PdHandle,
    pub(crate) info: MrInfo,
    pub(crate) buf: RegionBuf,
    /// Outstanding work requests and READ responses that reference the region.
    pub(crate) refs: u32,
    /// Gathered transmits the driver still sends from the region
    /// ([`Chunk::Region`](crate::Chunk::Region)): its memory must stay.
    pub(crate) pins: u32,
}

impl MemoryRegion {
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

/// Regions indexed by the low 24 bits of their keys; the top 8 bits of each
/// key are a tag that changes on every registration of a slot, so a stale key
/// does not name a new region.
#[derive(Debug)]
pub(crate) struct MrTable {
    slots: Vec<Option<MemoryRegion>>,
    tags: Vec<u8>,
    free: Vec<u32>,
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

const INDEX_BITS: u32 = 24;
const INDEX_MASK: u32 = (1 << INDEX_BITS) - 1;

impl MrTable {
    pub(crate) fn new() -> Self {
        MrTable {
            slots: Vec::new(),
            tags: Vec::new(),
            free: Vec::new(),
            owner: NEXT_TABLE.fetch_add(1, Ordering::Relaxed),
        }
    }

    pub(crate) fn register(
        &mut self,
        pd: PdHandle,
        buf: RegionBuf,
        addr: u64,
        access: AccessFlags,
        key_salt: u32,
    ) -> Result<MrInfo, VerbsError> {
        if buf.is_empty() || addr.checked_add(buf.len() as u64).is_none() {
            return Err(VerbsError::InvalidLength(buf.len()));
        }
        let idx = match self.free.pop() {
            Some(i) => i,
            None => {
                if self.slots.len() as u32 >= INDEX_MASK {
                    return Err(VerbsError::InvalidLength(buf.len()));
                }
                self.slots.push(None);
                self.tags.push(0);
                (self.slots.len() - 1) as u32
            }
        };
        let i = idx as usize;
        self.tags[i] = self.tags[i].wrapping_add(1 + (key_salt as u8 & 0x3f));
        let tag = u32::from(self.tags[i]);
        let lkey = (tag << INDEX_BITS) | idx;
        // The rkey uses a different tag so that an lkey is never a valid rkey by accident.
        let rkey = ((tag ^ 0xa5 ^ (key_salt >> 24)) << INDEX_BITS) | idx;
        let info = MrInfo {
            lkey,
            rkey,
            addr,
            len: buf.len() as u64,
            access,
        };
        self.slots[i] = Some(MemoryRegion {
            pd,
            info,
            buf,
            refs: 0,
            pins: 0,
        });
        Ok(info)
    }

    pub(crate) fn deregister(&mut self, lkey: u32) -> Result<RegionBuf, VerbsError> {
        let idx = (lkey & INDEX_MASK) as usize;
        match self.slots.get(idx) {
            Some(Some(mr)) if mr.info.lkey == lkey => {
                if mr.refs > 0 {
                    return Err(VerbsError::MrInUse(mr.refs));
                }
                if mr.pins > 0 {
                    return Err(VerbsError::MrSending(mr.pins));
                }
            }
            _ => return Err(VerbsError::InvalidKey(lkey)),
        }
        let mr = self.slots[idx].take().ok_or(VerbsError::InvalidKey(lkey))?;
        self.free.push(idx as u32);
        Ok(mr.buf)
    }

    pub(crate) fn by_lkey(&self, lkey: u32) -> Option<&MemoryRegion> {
        self.slots
            .get((lkey & INDEX_MASK) as usize)?
            .as_ref()
            .filter(|m| m.info.lkey == lkey)
    }

    pub(crate) fn by_lkey_mut(&mut self, lkey: u32) -> Option<&mut MemoryRegion> {
        self.slots
            .get_mut((lkey & INDEX_MASK) as usize)?
            .as_mut()
            .filter(|m| m.info.lkey == lkey)
    }

    pub(crate) fn by_rkey(&self, rkey: u32) -> Option<&MemoryRegion> {
        self.slots
            .get((rkey & INDEX_MASK) as usize)?
            .as_ref()
            .filter(|m| m.info.rkey == rkey)
    }

    pub(crate) fn by_rkey_mut(&mut self, rkey: u32) -> Option<&mut MemoryRegion> {
        self.slots
            .get_mut((rkey & INDEX_MASK) as usize)?
            .as_mut()
            .filter(|m| m.info.rkey == rkey)
    }

    /// Number of regions in `pd`.
    pub(crate) fn count_in_pd(&self, pd: PdHandle) -> usize {
        self.slots.iter().flatten().filter(|m| m.pd == pd).count()
    }

    /// Checks a local buffer: region exists, same PD, rights, bounds.
    pub(crate) fn check_local(
        &self,
        pd: PdHandle,
        lkey: u32,
        addr: u64,
        len: u32,
        need: AccessFlags,
    ) -> bool {
        if len == 0 {
            return true;
        }
        match self.by_lkey(lkey) {
            Some(mr) => {
                mr.pd == pd
                    && mr.info.access.contains(need)
                    && mr.range(addr, u64::from(len)).is_some()
            }
            None => false,
        }
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
        let mut t = MrTable::new();
        let pd = PdHandle(0);
        let a = t
            .register(pd, RegionBuf::zeroed(100), 0x1000, AccessFlags::ALL, 7)
            .unwrap();
        assert_ne!(a.lkey, a.rkey);
        assert!(t.by_rkey(a.lkey).is_none());
        let mr = t.by_rkey(a.rkey).unwrap();
        assert_eq!(mr.range(0x1000, 100), Some(0..100));
        assert_eq!(mr.range(0x1010, 10), Some(16..26));
        assert_eq!(mr.range(0x0fff, 1), None);
        assert_eq!(mr.range(0x1000, 101), None);
        assert_eq!(mr.range(u64::MAX, 2), None);
        assert!(t.check_local(pd, a.lkey, 0x1000, 100, AccessFlags::LOCAL_WRITE));
        assert!(!t.check_local(PdHandle(1), a.lkey, 0x1000, 100, AccessFlags::NONE));
        t.add_ref(a.lkey, 1);
        assert_eq!(t.deregister(a.lkey), Err(VerbsError::MrInUse(1)));
        t.add_ref(a.lkey, -1);
        let p1 = t.pin(a.lkey).unwrap();
        let p2 = t.pin(a.lkey).unwrap();
        assert_eq!(t.deregister(a.lkey), Err(VerbsError::MrSending(2)));
        // Another table's pin does not unpin this one's region.
        let mut other = MrTable::new();
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
            .register(pd, RegionBuf::zeroed(8), 0, AccessFlags::NONE, 7)
            .unwrap();
        assert_ne!(a.lkey, b.lkey, "a reused slot gets a new key");
        assert!(t.by_rkey(a.rkey).is_none());
        assert!(t
            .register(pd, RegionBuf::default(), 0, AccessFlags::NONE, 1)
            .is_err());
    }
}
