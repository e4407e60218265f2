//! The in-RAM index of chunks on disk: `ChunkId -> Location`.
//!
//! It is the truth for negatives: a chunk absent here is not on disk, so a
//! miss costs no I/O. Keys are already uniform hashes, so the table hashes
//! only 8 key bytes folded with the namespace and group (one multiply), and
//! lookups of many keys go in batches with software prefetch of the slots and
//! then of the entries, so the memory latency of a random probe overlaps with
//! that of its neighbours.
//!
//! Layout: an open-addressing table of 8-byte slots (32-bit tag, 32-bit
//! entry index; tag 0 = empty) with linear probing and backward-shift
//! deletion, at most half full; entries live densely in a `Vec`.

use crate::types::{ChunkId, ChunkKey, GroupId, Namespace};

/// Where a chunk's record lies on disk and what it must contain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Location {
    /// Region index.
    pub region: u32,
    /// Offset of the record (header) within the region.
    pub offset: u32,
    /// Encoded header length.
    pub header_len: u32,
    /// Payload length.
    pub payload_len: u32,
    /// Payload CRC32C.
    pub crc: u32,
    /// Atomic group id (0 = none).
    pub txn: u64,
}

#[derive(Clone, Copy, Default)]
#[repr(C)]
struct Slot {
    tag: u32,
    idx: u32,
}

/// The index table. Not synchronised: the store wraps it in a lock.
pub struct Index {
    slots: Vec<Slot>,
    mask: usize,
    entries: Vec<(ChunkId, Location)>,
}

#[inline]
fn hash_parts(ns: &Namespace, key: &ChunkKey, group: GroupId) -> u64 {
    let k = u64::from_le_bytes(key.0[0..8].try_into().expect("8 bytes"));
    let n0 = u64::from_le_bytes(ns.0[0..8].try_into().expect("8 bytes"));
    let n1 = u64::from_le_bytes(ns.0[8..16].try_into().expect("8 bytes"));
    let h = (k ^ n0 ^ n1.rotate_left(29) ^ u64::from(group)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    h ^ (h >> 29)
}

#[inline]
fn split(h: u64) -> (usize, u32) {
    (h as usize, ((h >> 32) as u32) | 1)
}

#[inline(always)]
fn prefetch<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: prefetch is a hint; it never faults, even on invalid addresses.
    unsafe {
        core::arch::x86_64::_mm_prefetch(p as *const i8, core::arch::x86_64::_MM_HINT_T0);
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

impl Default for Index {
    fn default() -> Self {
        Self::with_capacity(0)
    }
}

impl Index {
    /// An empty index sized for `n` entries without growing.
    pub fn with_capacity(n: usize) -> Self {
        let cap = (n.max(8) * 2).next_power_of_two();
        Self {
            slots: vec![Slot::default(); cap],
            mask: cap - 1,
            entries: Vec::with_capacity(n),
        }
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the index is empty.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Bytes of RAM used by the table and entries.
    pub fn memory_bytes(&self) -> usize {
        self.slots.len() * std::mem::size_of::<Slot>()
            + self.entries.capacity() * std::mem::size_of::<(ChunkId, Location)>()
    }

    /// Slot index holding `id`, if present.
    #[inline]
    fn find_slot(&self, id: &ChunkId, h: u64) -> Option<usize> {
        let (mut pos, tag) = split(h);
        loop {
            pos &= self.mask;
            let s = self.slots[pos];
            if s.tag == 0 {
                return None;
            }
            if s.tag == tag && self.entries[s.idx as usize].0 == *id {
                return Some(pos);
            }
            pos += 1;
        }
    }

    /// The location of `id`.
    #[inline]
    pub fn get(&self, id: &ChunkId) -> Option<Location> {
        let h = hash_parts(&id.ns, &id.key, id.group);
        self.find_slot(id, h)
            .map(|s| self.entries[self.slots[s].idx as usize].1)
    }

    /// Whether `id` is present.
    pub fn contains(&self, id: &ChunkId) -> bool {
        self.get(id).is_some()
    }

    /// Inserts or replaces; returns the previous location.
    pub fn insert(&mut self, id: ChunkId, loc: Location) -> Option<Location> {
        let h = hash_parts(&id.ns, &id.key, id.group);
        if let Some(s) = self.find_slot(&id, h) {
            let e = &mut self.entries[self.slots[s].idx as usize].1;
            return Some(std::mem::replace(e, loc));
        }
        if (self.entries.len() + 1) * 2 > self.slots.len() {
            self.grow();
        }
        let idx = u32::try_from(self.entries.len()).expect("index holds < 2^32 entries");
        self.entries.push((id, loc));
        let (mut pos, tag) = split(h);
        loop {
            pos &= self.mask;
            if self.slots[pos].tag == 0 {
                self.slots[pos] = Slot { tag, idx };
                return None;
            }
            pos += 1;
        }
    }

    fn grow(&mut self) {
        let cap = self.slots.len() * 2;
        self.slots = vec![Slot::default(); cap];
        self.mask = cap - 1;
        for (i, (id, _)) in self.entries.iter().enumerate() {
            let (mut pos, tag) = split(hash_parts(&id.ns, &id.key, id.group));
            loop {
                pos &= self.mask;
                if self.slots[pos].tag == 0 {
                    self.slots[pos] = Slot { tag, idx: i as u32 };
                    break;
                }
                pos += 1;
            }
        }
    }

    /// Removes `id`; returns its location.
    pub fn remove(&mut self, id: &ChunkId) -> Option<Location> {
        let h = hash_parts(&id.ns, &id.key, id.group);
        let slot = self.find_slot(id, h)?;
        let idx = self.slots[slot].idx as usize;
        // Backward-shift deletion keeps probe chains intact without tombstones.
        let mut hole = slot;
        let mut pos = slot;
        loop {
            pos = (pos + 1) & self.mask;
            let s = self.slots[pos];
            if s.tag == 0 {
                break;
            }
            let (id2, _) = &self.entries[s.idx as usize];
            let home = split(hash_parts(&id2.ns, &id2.key, id2.group)).0 & self.mask;
            // Move s into the hole if its home is not in (hole, pos].
            let dist_pos = pos.wrapping_sub(home) & self.mask;
            let dist_hole = hole.wrapping_sub(home) & self.mask;
            if dist_hole < dist_pos {
                self.slots[hole] = s;
                hole = pos;
            }
        }
        self.slots[hole] = Slot::default();
        // Remove the entry densely: move the last entry into `idx`.
        let (_, loc) = self.entries.swap_remove(idx);
        if idx < self.entries.len() {
            let moved = self.entries[idx].0;
            let mh = hash_parts(&moved.ns, &moved.key, moved.group);
            let ms = self
                .find_slot_by_idx(mh, self.entries.len() as u32)
                .expect("the moved entry has a slot");
            self.slots[ms].idx = idx as u32;
        }
        Some(loc)
    }

    fn find_slot_by_idx(&self, h: u64, idx: u32) -> Option<usize> {
        let (mut pos, _) = split(h);
        loop {
            pos &= self.mask;
            let s = self.slots[pos];
            if s.tag == 0 {
                return None;
            }
            if s.idx == idx {
                return Some(pos);
            }
            pos += 1;
        }
    }

    /// Removes every entry for which `f` returns false; returns the removed.
    pub fn retain(
        &mut self,
        mut f: impl FnMut(&ChunkId, &Location) -> bool,
    ) -> Vec<(ChunkId, Location)> {
        let (keep, drop): (Vec<_>, Vec<_>) = std::mem::take(&mut self.entries)
            .into_iter()
            .partition(|(id, l)| f(id, l));
        let mut fresh = Index::with_capacity(keep.len());
        for (id, l) in keep {
            fresh.insert(id, l);
        }
        *self = fresh;
        drop
    }

    /// Iterates every entry.
    pub fn iter(&self) -> impl Iterator<Item = &(ChunkId, Location)> {
        self.entries.iter()
    }

    /// Batched lookup of `keys` in one namespace and group: `out[i]` is the
    /// location of `keys[i]`. Prefetches slots, then entries, a window at a
    /// time, so the random memory accesses of a window overlap.
    pub fn get_batch(
        &self,
        ns: &Namespace,
        group: GroupId,
        keys: &[ChunkKey],
        out: &mut Vec<Option<Location>>,
    ) {
        const W: usize = 32;
        out.clear();
        out.resize(keys.len(), None);
        let mut hashes = [0u64; W];
        let mut cand = [u32::MAX; W];
        for (w, window) in keys.chunks(W).enumerate() {
            for (i, k) in window.iter().enumerate() {
                let h = hash_parts(ns, k, group);
                hashes[i] = h;
                prefetch(&self.slots[split(h).0 & self.mask]);
            }
            for (i, _) in window.iter().enumerate() {
                let (mut pos, tag) = split(hashes[i]);
                cand[i] = u32::MAX;
                loop {
                    pos &= self.mask;
                    let s = self.slots[pos];
                    if s.tag == 0 {
                        break;
                    }
                    if s.tag == tag {
                        cand[i] = s.idx;
                        prefetch(&self.entries[s.idx as usize]);
                        break;
                    }
                    pos += 1;
                }
            }
            for (i, k) in window.iter().enumerate() {
                if cand[i] == u32::MAX {
                    continue;
                }
                let (id, loc) = &self.entries[cand[i] as usize];
                out[w * W + i] = if id.key == *k && id.ns == *ns && id.group == group {
                    Some(*loc)
                } else {
                    // A 32-bit tag collision: fall back to the full probe.
                    self.get(&ChunkId::new(*ns, *k, group))
                };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    fn id(n: u64, ns: u8, g: u16) -> ChunkId {
        let mut key = [0u8; 32];
        key[..8].copy_from_slice(&n.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes());
        key[8..16].copy_from_slice(&n.to_le_bytes());
        ChunkId::new(Namespace([ns; 16]), ChunkKey(key), g)
    }

    fn loc(n: u32) -> Location {
        Location {
            region: n,
            offset: n,
            header_len: 128,
            payload_len: n,
            crc: n,
            txn: 0,
        }
    }

    proptest! {
        #[test]
        fn agrees_with_a_hashmap(ops in proptest::collection::vec((0u8..3, 0u64..64, 0u8..2), 0..400)) {
            let mut ix = Index::default();
            let mut model = HashMap::new();
            for (op, n, ns) in ops {
                let k = id(n, ns, (n % 2) as u16);
                match op {
                    0 | 1 => {
                        prop_assert_eq!(ix.insert(k, loc(n as u32)), model.insert(k, loc(n as u32)));
                    }
                    _ => {
                        prop_assert_eq!(ix.remove(&k), model.remove(&k));
                    }
                }
                prop_assert_eq!(ix.len(), model.len());
            }
            for n in 0..64 {
                for ns in 0..2 {
                    let k = id(n, ns, (n % 2) as u16);
                    prop_assert_eq!(ix.get(&k), model.get(&k).copied());
                }
            }
        }
    }

    #[test]
    fn batch_lookup_matches_single_lookups() {
        let mut ix = Index::with_capacity(10);
        for n in 0..5000 {
            ix.insert(id(n, 1, 0), loc(n as u32));
        }
        let keys: Vec<ChunkKey> = (0..10_000).map(|n| id(n, 1, 0).key).collect();
        let mut out = Vec::new();
        ix.get_batch(&Namespace([1; 16]), 0, &keys, &mut out);
        for (n, o) in out.iter().enumerate() {
            assert_eq!(*o, (n < 5000).then(|| loc(n as u32)));
        }
        ix.get_batch(&Namespace([2; 16]), 0, &keys, &mut out);
        assert!(out.iter().all(Option::is_none));
        let removed = ix.retain(|_, l| l.region % 2 == 0);
        assert_eq!(removed.len(), 2500);
        assert_eq!(ix.get(&id(3, 1, 0)), None);
        assert_eq!(ix.get(&id(4, 1, 0)), Some(loc(4)));
    }
}
