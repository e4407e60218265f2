//! The fingerprint slot table shared by the disk index ([`crate::index`])
//! and the RAM shards ([`crate::ram`]): it maps a 64-bit hash to `u32`
//! indices of the caller's own entry array.
//!
//! Layout: a power-of-two array of 8-byte slots, each a 32-bit fingerprint
//! (the hash's high half with the lowest bit set, so never 0; 0 marks an
//! empty slot) and the 32-bit index of an entry. The home slot of a hash is
//! its low bits; collisions probe linearly (wrapping at the end), deletion
//! shifts the rest of the chain back (no tombstones), and the table is kept
//! at most half full (2.5 slots per miss on average), growing by doubling.
//! The slots are grouped in 64-byte-aligned lines of 8, so a probe's home
//! slot lies in one cache line; arrays of 2 MiB and more are advised to use
//! huge pages.
//!
//! The table never sees the entries: a lookup asks the caller's `eq(idx)`
//! only for slots whose fingerprint matches (about 2^-31 of the others), and
//! deletion and growth ask for the hash of an index. Batched probes of many
//! keys call [`FpTable::prefetch`] for a key some distance ahead, then
//! [`FpTable::first_match`] (no entry access, so the probes are independent
//! and their cache misses overlap; it compares a line's slots at once with
//! SSE2), and confirm the candidates afterwards.

/// One slot: `fp == 0` marks it empty.
#[derive(Clone, Copy, Default, PartialEq, Eq, Debug)]
#[repr(C)]
pub(crate) struct Slot {
    /// [`fingerprint`] of the entry's hash.
    pub(crate) fp: u32,
    /// Index of the entry in the caller's array.
    pub(crate) idx: u32,
}

/// The fingerprint of a hash: its high 32 bits with the lowest bit set
/// (never 0, which marks an empty slot).
#[inline(always)]
pub(crate) fn fingerprint(h: u64) -> u32 {
    ((h >> 32) as u32) | 1
}

/// A cache prefetch hint for `p` (x86_64 and aarch64, the CPU of DGX Spark;
/// a no-op elsewhere). The batched probes depend on it: without it each of
/// a batch's misses waits for memory in turn.
#[inline(always)]
pub(crate) fn prefetch<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: prefetch is a hint; it never faults, even on invalid addresses.
    unsafe {
        core::arch::x86_64::_mm_prefetch(p as *const i8, core::arch::x86_64::_MM_HINT_T0);
    }
    #[cfg(target_arch = "aarch64")]
    // SAFETY: `prfm` is a hint with no architectural effect: it never
    // faults, even on invalid addresses, and touches no stack, flags or
    // other registers. (`core::arch::aarch64::_prefetch` is not stable.)
    unsafe {
        core::arch::asm!(
            "prfm pldl1keep, [{p}]",
            p = in(reg) p,
            options(nostack, readonly, preserves_flags)
        );
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    let _ = p;
}

/// Advises the kernel that `[addr, addr + len)` may be backed by huge pages
/// (fewer TLB misses on random probes); advice only, skipped under 2 MiB.
pub(crate) fn advise_huge(addr: usize, len: usize) {
    const HUGE: usize = 2 << 20;
    if len < HUGE {
        return;
    }
    // Whole huge pages only: the advice is about them, and a range aligned
    // to 4 KiB alone is refused (EINVAL) on a kernel with 64 KiB pages, as
    // some aarch64 kernels are.
    let start = addr.next_multiple_of(HUGE);
    let end = (addr + len) / HUGE * HUGE;
    if end > start {
        // SAFETY: advice on memory this process owns (a vector's buffer);
        // MADV_HUGEPAGE never changes contents.
        unsafe {
            libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
        }
    }
}

/// Slots per cache line.
const LINE: usize = 8;

/// One cache line of slots: the unit a probe reads.
#[derive(Clone, Copy, Default)]
#[repr(C, align(64))]
struct Line([Slot; LINE]);

/// Lines for `n` slots (`n` a multiple of [`LINE`]), huge-page advised.
fn empty_lines(n: usize) -> Vec<Line> {
    let n = n / LINE;
    let mut v: Vec<Line> = Vec::with_capacity(n);
    advise_huge(v.as_ptr() as usize, n * size_of::<Line>());
    v.resize(n, Line::default());
    v
}

/// Two masks over the slots of `line`, bit `k` for slot `k`: the slots
/// whose fingerprint is `fp`, and those whose fingerprint is `fp` or 0
/// (empty), where a probe stops.
#[inline(always)]
fn line_masks(line: &Line, fp: u32) -> (u32, u32) {
    #[cfg(target_arch = "x86_64")]
    {
        use core::arch::x86_64::{
            __m128i, _mm_castps_si128, _mm_castsi128_ps, _mm_cmpeq_epi32, _mm_load_ps,
            _mm_movemask_ps, _mm_or_si128, _mm_set1_epi32, _mm_setzero_si128, _mm_shuffle_ps,
        };
        // SAFETY: SSE2 is part of the x86_64 baseline; the four aligned
        // 16-byte loads read `line` (64 bytes, 64-byte aligned) through a
        // reference.
        unsafe {
            let p = line.0.as_ptr().cast::<f32>();
            // The fingerprints (even 32-bit lanes) of slots 0..4 and 4..8.
            let lo = _mm_castps_si128(_mm_shuffle_ps::<0x88>(
                _mm_load_ps(p),
                _mm_load_ps(p.add(4)),
            ));
            let hi = _mm_castps_si128(_mm_shuffle_ps::<0x88>(
                _mm_load_ps(p.add(8)),
                _mm_load_ps(p.add(12)),
            ));
            let f = _mm_set1_epi32(fp as i32);
            let z = _mm_setzero_si128();
            let mask = |a: __m128i, b: __m128i| {
                (_mm_movemask_ps(_mm_castsi128_ps(a)) | (_mm_movemask_ps(_mm_castsi128_ps(b)) << 4))
                    as u32
            };
            let (hit_lo, hit_hi) = (_mm_cmpeq_epi32(lo, f), _mm_cmpeq_epi32(hi, f));
            let stop_lo = _mm_or_si128(hit_lo, _mm_cmpeq_epi32(lo, z));
            let stop_hi = _mm_or_si128(hit_hi, _mm_cmpeq_epi32(hi, z));
            (mask(hit_lo, hit_hi), mask(stop_lo, stop_hi))
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let (mut hit, mut stop) = (0u32, 0u32);
        for (k, s) in line.0.iter().enumerate() {
            hit |= u32::from(s.fp == fp) << k;
            stop |= u32::from(s.fp == fp || s.fp == 0) << k;
        }
        (hit, stop)
    }
}

/// The slot table (see the module docs). Not synchronised: its owner is.
pub(crate) struct FpTable {
    /// The slots, `mask + 1` of them, in cache-line-aligned groups.
    lines: Vec<Line>,
    /// Number of slots minus one (a power of two minus one, at least 15).
    mask: usize,
    /// Occupied slots.
    len: usize,
}

impl FpTable {
    /// An empty table that holds `n` entries without growing.
    pub(crate) fn with_capacity(n: usize) -> Self {
        let cap = (n.max(8) * 2).next_power_of_two();
        Self {
            lines: empty_lines(cap),
            mask: cap - 1,
            len: 0,
        }
    }

    /// Number of entries (for tests).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Number of slots.
    fn capacity(&self) -> usize {
        self.mask + 1
    }

    /// Bytes of the slot array.
    pub(crate) fn memory_bytes(&self) -> usize {
        self.lines.len() * size_of::<Line>()
    }

    #[inline(always)]
    fn at(&self, pos: usize) -> Slot {
        self.lines[pos / LINE].0[pos % LINE]
    }

    #[inline(always)]
    fn at_mut(&mut self, pos: usize) -> &mut Slot {
        &mut self.lines[pos / LINE].0[pos % LINE]
    }

    /// Starts loading the home slot of `h` (its cache line) into the cache.
    #[inline(always)]
    pub(crate) fn prefetch(&self, h: u64) {
        prefetch(
            self.lines
                .as_ptr()
                .wrapping_add((h as usize & self.mask) / LINE),
        );
    }

    /// The position of the entry of hash `h` for which `eq(idx)` holds;
    /// `eq` runs only on fingerprint matches.
    #[inline]
    pub(crate) fn find(&self, h: u64, mut eq: impl FnMut(u32) -> bool) -> Option<usize> {
        let fp = fingerprint(h);
        let mut pos = h as usize;
        loop {
            pos &= self.mask;
            let s = self.at(pos);
            if s.fp == 0 {
                return None;
            }
            if s.fp == fp && eq(s.idx) {
                return Some(pos);
            }
            pos += 1;
        }
    }

    /// The index of the first entry on `h`'s probe path whose fingerprint
    /// matches `h`'s, without any entry access: `None` is exact, `Some` a
    /// candidate to confirm.
    ///
    /// Scans a cache line at a time, with no branch on a single slot: the
    /// slots of the line from the probe position on are compared at once,
    /// and the first empty or matching one decides. Most probes end in the
    /// home line, so the one branch per line is well predicted (a
    /// slot-by-slot loop mispredicts its exit about every other probe, which
    /// dominates when the table is in cache). The slots read are those a
    /// slot-by-slot probe would read, rounded to whole lines.
    #[inline(always)]
    pub(crate) fn first_match(&self, h: u64) -> Option<u32> {
        let fp = fingerprint(h);
        let pos = h as usize & self.mask;
        let mut line = pos / LINE;
        // Slots before the probe position do not count in the home line.
        let mut from = !0u32 << (pos % LINE);
        loop {
            let l = &self.lines[line];
            let (hit, stop) = line_masks(l, fp);
            let stop = stop & from;
            if stop != 0 {
                let k = stop.trailing_zeros();
                return (hit >> k & 1 != 0).then_some(l.0[k as usize % LINE].idx);
            }
            line = (line + 1) & (self.mask / LINE);
            from = !0;
        }
    }

    /// [`FpTable::first_match`] of `n` hashes, `hash(i)` the `i`th, handed
    /// to `f(i, match)` in order. The home line of hash `i + D` is
    /// prefetched while hash `i` is probed (a ring carries the hashes in
    /// between, so each is computed once), so about `D` random line reads
    /// are in flight at any time and their latencies overlap.
    #[inline(always)]
    pub(crate) fn probe_batch(
        &self,
        n: usize,
        hash: impl Fn(usize) -> u64,
        mut f: impl FnMut(usize, Option<u32>),
    ) {
        const D: usize = 16;
        const RING: usize = 32;
        let mut ring = [0u64; RING];
        for (i, r) in ring.iter_mut().enumerate().take(D.min(n)) {
            *r = hash(i);
            self.prefetch(*r);
        }
        for i in 0..n {
            if i + D < n {
                let h = hash(i + D);
                ring[(i + D) % RING] = h;
                self.prefetch(h);
            }
            f(i, self.first_match(ring[i % RING]));
        }
    }

    /// The index stored at `pos` (from [`FpTable::find`]).
    #[inline]
    pub(crate) fn idx_at(&self, pos: usize) -> u32 {
        self.at(pos).idx
    }

    /// Points the entry of hash `h` stored as `from` to `to` instead (the
    /// caller moved it in its array). Returns `false` if `from` is absent.
    pub(crate) fn reindex(&mut self, h: u64, from: u32, to: u32) -> bool {
        match self.find(h, |i| i == from) {
            Some(pos) => {
                self.at_mut(pos).idx = to;
                true
            }
            None => false,
        }
    }

    /// Adds entry `idx` of hash `h`, which the caller knows is absent;
    /// `hash_of(i)` gives the hash of each present entry `i` if the table
    /// has to grow.
    pub(crate) fn insert(&mut self, h: u64, idx: u32, hash_of: impl Fn(u32) -> u64) {
        if (self.len + 1) * 2 > self.capacity() {
            self.grow(hash_of);
        }
        let s = Slot {
            fp: fingerprint(h),
            idx,
        };
        self.place(s, h);
        self.len += 1;
    }

    /// Puts `s` into the first empty slot from the home of `h`.
    #[inline]
    fn place(&mut self, s: Slot, h: u64) {
        let mut pos = h as usize;
        loop {
            pos &= self.mask;
            let slot = self.at_mut(pos);
            if slot.fp == 0 {
                *slot = s;
                return;
            }
            pos += 1;
        }
    }

    /// Doubles the slot array and re-places every entry (the fingerprint is
    /// kept; the home comes from `hash_of(idx)`).
    fn grow(&mut self, hash_of: impl Fn(u32) -> u64) {
        let cap = self.capacity() * 2;
        let old = std::mem::replace(&mut self.lines, empty_lines(cap));
        self.mask = cap - 1;
        for s in old.iter().flat_map(|l| l.0).filter(|s| s.fp != 0) {
            self.place(s, hash_of(s.idx));
        }
    }

    /// Empties slot `pos` (from [`FpTable::find`]) and shifts the rest of
    /// its probe chain back, asking `hash_of(idx)` for the hash of each
    /// entry met, so every chain stays unbroken without tombstones.
    pub(crate) fn remove_at(&mut self, pos: usize, hash_of: impl Fn(u32) -> u64) {
        debug_assert!(self.at(pos).fp != 0, "removing an empty slot");
        let mut hole = pos;
        let mut pos = pos;
        loop {
            pos = (pos + 1) & self.mask;
            let s = self.at(pos);
            if s.fp == 0 {
                break;
            }
            let home = hash_of(s.idx) as usize & self.mask;
            // Move s into the hole if its home is not in (hole, pos], i.e.
            // the hole lies on its probe path.
            let dist_pos = pos.wrapping_sub(home) & self.mask;
            let dist_hole = hole.wrapping_sub(home) & self.mask;
            if dist_hole < dist_pos {
                *self.at_mut(hole) = s;
                hole = pos;
            }
        }
        *self.at_mut(hole) = Slot::default();
        self.len -= 1;
    }

    /// Every occupied slot with its position (for invariant checks).
    #[cfg(test)]
    pub(crate) fn occupied(&self) -> impl Iterator<Item = (usize, Slot)> + '_ {
        self.lines
            .iter()
            .flat_map(|l| l.0)
            .enumerate()
            .filter(|(_, s)| s.fp != 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    /// Hashes of the test keys: few fingerprints (so unequal keys share
    /// them) and homes at both ends of any table size (so chains collide
    /// and wrap from the last slot to the first).
    fn hash(key: u32) -> u64 {
        let hi = [0x10u64, 0x20, 0x30][key as usize % 3];
        let lo = [u32::MAX, u32::MAX - 1, 0, 1, key.wrapping_mul(0x9e37_79b9)][key as usize % 5];
        (hi << 32) | u64::from(lo)
    }

    /// The caller's side of the table in the style of the index: a dense
    /// entry array with swap-remove.
    #[derive(Default)]
    struct Dense {
        table: Option<FpTable>,
        keys: Vec<u32>,
        vals: Vec<u64>,
    }

    impl Dense {
        fn table(&self) -> &FpTable {
            self.table.as_ref().expect("table")
        }
        fn pos(&self, k: u32) -> Option<usize> {
            self.table().find(hash(k), |i| self.keys[i as usize] == k)
        }
        fn get(&self, k: u32) -> Option<u64> {
            self.pos(k)
                .map(|p| self.vals[self.table().idx_at(p) as usize])
        }
        fn insert(&mut self, k: u32, v: u64) -> Option<u64> {
            if let Some(p) = self.pos(k) {
                let i = self.table().idx_at(p) as usize;
                return Some(std::mem::replace(&mut self.vals[i], v));
            }
            let idx = self.keys.len() as u32;
            self.keys.push(k);
            self.vals.push(v);
            let keys = &self.keys;
            let t = self.table.as_mut().expect("table");
            t.insert(hash(k), idx, |i| hash(keys[i as usize]));
            None
        }
        fn remove(&mut self, k: u32) -> Option<u64> {
            let p = self.pos(k)?;
            let idx = self.table().idx_at(p);
            let keys = &self.keys;
            let t = self.table.as_mut().expect("table");
            t.remove_at(p, |i| hash(keys[i as usize]));
            self.keys.swap_remove(idx as usize);
            let v = self.vals.swap_remove(idx as usize);
            if let Some(&moved) = self.keys.get(idx as usize) {
                let last = self.keys.len() as u32;
                assert!(t.reindex(hash(moved), last, idx), "moved entry is indexed");
            }
            Some(v)
        }
        /// Structural invariants: load, and every entry reachable from its
        /// home through occupied slots only.
        fn check(&self) {
            let t = self.table();
            assert_eq!(t.len(), self.keys.len());
            assert!(t.len() * 2 <= t.capacity());
            let mut seen = vec![false; self.keys.len()];
            for (pos, s) in t.occupied() {
                let k = self.keys[s.idx as usize];
                assert_eq!(s.fp, fingerprint(hash(k)));
                assert!(!std::mem::replace(&mut seen[s.idx as usize], true));
                let mut p = hash(k) as usize & t.mask;
                while p != pos {
                    assert!(t.at(p).fp != 0, "chain of {k} broken at {p}");
                    p = (p + 1) & t.mask;
                }
            }
            assert!(seen.iter().all(|&s| s));
        }
    }

    proptest! {
        #[test]
        fn agrees_with_a_hashmap(
            cap in 0usize..20,
            ops in proptest::collection::vec((0u8..4, 0u32..60), 0..500),
        ) {
            let mut d = Dense { table: Some(FpTable::with_capacity(cap)), ..Default::default() };
            let mut model = HashMap::new();
            for (step, (op, k)) in ops.into_iter().enumerate() {
                match op {
                    0 | 1 => prop_assert_eq!(d.insert(k, step as u64), model.insert(k, step as u64)),
                    2 => prop_assert_eq!(d.remove(k), model.remove(&k)),
                    _ => {
                        prop_assert_eq!(d.get(k), model.get(&k).copied());
                        // A present key always has a candidate, and a
                        // candidate always shares the key's fingerprint; a
                        // key whose fingerprint no entry has gets none.
                        let first = d.table().first_match(hash(k));
                        let fp = fingerprint(hash(k));
                        if let Some(i) = first {
                            prop_assert_eq!(fingerprint(hash(d.keys[i as usize])), fp);
                        }
                        if model.contains_key(&k) {
                            prop_assert!(first.is_some());
                        }
                        if !model.keys().any(|&j| fingerprint(hash(j)) == fp) {
                            prop_assert!(first.is_none());
                        }
                    }
                }
                d.check();
            }
            for k in 0..60 {
                prop_assert_eq!(d.get(k), model.get(&k).copied());
            }
        }
    }

    #[test]
    fn chains_wrap_around_and_survive_growth_and_removal() {
        let mut d = Dense {
            table: Some(FpTable::with_capacity(0)),
            ..Default::default()
        };
        // Keys 0, 5, 10, ... all have home u32::MAX: the last slot, then
        // slots 0, 1, ... of any table size.
        let ks: Vec<u32> = (0..40).map(|i| i * 15).collect();
        for &k in &ks {
            assert_eq!(hash(k) as u32, u32::MAX);
            assert_eq!(d.insert(k, u64::from(k)), None);
            d.check();
        }
        assert!(d.table().capacity() >= 80, "grew");
        // Same home and fingerprint for all: only `eq` tells them apart.
        assert!(
            ks.iter()
                .all(|&k| fingerprint(hash(k)) == fingerprint(hash(0)))
        );
        for &k in ks.iter().step_by(3) {
            assert_eq!(d.remove(k), Some(u64::from(k)));
            d.check();
        }
        for (i, &k) in ks.iter().enumerate() {
            assert_eq!(d.get(k), (i % 3 != 0).then_some(u64::from(k)));
        }
    }
}
