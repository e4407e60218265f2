//! The remote availability index: which peers hold which chunk.
//!
//! Answered from RAM only; never waits on the network. One entry per
//! distinct chunk id held by any peer:
//!
//! | field   | bytes | why |
//! |---------|------:|-----|
//! | fingerprint | 12 | 96-bit mix of (namespace, key, group) |
//! | holders | 4 | bitmask of peer slots (≤ [`MAX_SLOTS`]) |
//! | ram     | 4 | bitmask of the holders whose copy is in their RAM |
//! | len     | 4 | payload length, saturated at `u32::MAX` (stats only) |
//!
//! 24 bytes in a hashbrown table (+1 control byte, load factor ≤ 7/8, power
//! of two buckets) is 27–55 bytes per entry depending on where the count
//! falls between two table sizes; `directory_memory_per_entry` in the tests
//! measures it for 1M entries. A fingerprint collision (≈ 2⁻⁹⁶ per pair)
//! can only make a peer look like a holder of a chunk it lacks: the fetch
//! then verifies the id and the payload CRC and turns it into a miss.
//!
//! The fingerprint is keyed with a random seed per directory. Unkeyed, it
//! could be inverted: a peer could announce many distinct ids with one
//! 64-bit table hash, which made each insert probe every earlier one
//! (65,536 such ids held the directory's lock for over a minute and kept
//! the peer's link flapping: QA). The table still takes the fingerprint's
//! first 64 bits as its hash, so a probe costs no extra hashing.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use parking_lot::RwLock;

use crate::id::{PeerChunkId, PeerNamespace};
use crate::proto::msg::Op;

/// Most peer slots one directory tracks.
pub const MAX_SLOTS: usize = 32;
/// Most chunks one peer may be said to hold, by default: 8 Mi entries
/// (about 0.2–0.45 GB of table), e.g. 8 TiB of 1 MiB chunks. A peer that
/// announces more is refused ([`OverLimit`]), so a faulty or hostile one
/// cannot grow this node's memory without bound.
pub const DEFAULT_MAX_CHUNKS_PER_PEER: u64 = 8 << 20;

/// Ops [`Directory::apply`] applies before it lets waiting readers in.
const APPLY_BATCH: usize = 4096;

/// A peer announced more chunks than the directory keeps for one peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the peer announced more than {limit} chunks")]
pub struct OverLimit {
    /// The per-peer limit.
    pub limit: u64,
}

/// A 96-bit fingerprint of a chunk id (12 bytes, 4-byte aligned, so a
/// table entry stays 24 bytes with the RAM mask).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fingerprint([u32; 3]);

impl std::hash::Hash for Fingerprint {
    fn hash<H: Hasher>(&self, h: &mut H) {
        // Uniform already: the first 64 bits are the hash.
        h.write_u64(u64::from(self.0[0]) | u64::from(self.0[1]) << 32);
    }
}

#[inline]
fn fmix(mut k: u64) -> u64 {
    k ^= k >> 33;
    k = k.wrapping_mul(0xff51_afd7_ed55_8ccd);
    k ^= k >> 33;
    k = k.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    k ^ (k >> 33)
}

/// The fingerprint's two lanes before the seed and the id's words.
const FP_INIT: [u64; 2] = [0x9e37_79b9_7f4a_7c15, 0x6a09_e667_f3bc_c909];

/// `id` as the words [`fingerprint`] mixes in: namespace, key, group.
fn fp_words(id: &PeerChunkId) -> [u64; 7] {
    let w = |b: &[u8]| u64::from_le_bytes(b.try_into().expect("8 bytes"));
    [
        w(&id.ns.0[..8]),
        w(&id.ns.0[8..]),
        w(&id.key[..8]),
        w(&id.key[8..16]),
        w(&id.key[16..24]),
        w(&id.key[24..]),
        u64::from(id.group),
    ]
}

/// Fingerprints `id` under `seed` (one directory's random key; see the
/// module docs for why it is keyed).
fn fingerprint(seed: [u64; 2], id: &PeerChunkId) -> Fingerprint {
    let words = fp_words(id);
    let mut a = FP_INIT[0] ^ seed[0];
    let mut b = FP_INIT[1] ^ seed[1];
    for (i, x) in words.iter().enumerate() {
        a = fmix(a ^ x);
        b = fmix(b ^ x.rotate_left(17 + i as u32));
    }
    Fingerprint([a as u32, (a >> 32) as u32, b as u32])
}

/// Hasher for fingerprints: they are uniform already, take the first word.
#[derive(Default)]
pub struct FpHasher(u64);

impl Hasher for FpHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

#[derive(Clone, Copy)]
struct Entry {
    holders: u32,
    /// Subset of `holders` whose copy is in their RAM.
    ram: u32,
    len: u32,
}

#[derive(Default, Clone)]
struct SlotStats {
    chunks: u64,
    bytes: u64,
    namespaces: HashMap<PeerNamespace, u64>,
}

#[derive(Default)]
struct Inner {
    map: hashbrown::HashMap<Fingerprint, Entry, BuildHasherDefault<FpHasher>>,
    slots: Vec<SlotStats>,
}

/// Per-slot totals.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SlotTotals {
    /// Chunks the peer is said to hold.
    pub chunks: u64,
    /// Their payload bytes.
    pub bytes: u64,
}

/// Which peers hold which chunk. Shared by the transport (writers, one per
/// peer) and lookups (readers).
pub struct Directory {
    // parking_lot RwLock: critical sections are short and never span an
    // await; lookups far outnumber updates.
    inner: RwLock<Inner>,
    /// Most chunks one slot may hold.
    max_per_slot: u64,
    /// The fingerprint's key.
    seed: [u64; 2],
}

impl Default for Directory {
    fn default() -> Self {
        Self::new()
    }
}

impl Directory {
    /// An empty directory keeping at most [`DEFAULT_MAX_CHUNKS_PER_PEER`]
    /// chunks per peer.
    pub fn new() -> Self {
        Self::with_limit(DEFAULT_MAX_CHUNKS_PER_PEER)
    }

    /// An empty directory keeping at most `max_per_slot` chunks per peer.
    pub fn with_limit(max_per_slot: u64) -> Self {
        Self {
            inner: RwLock::new(Inner {
                map: Default::default(),
                slots: vec![SlotStats::default(); MAX_SLOTS],
            }),
            max_per_slot,
            seed: rand::random(),
        }
    }

    fn fp(&self, id: &PeerChunkId) -> Fingerprint {
        fingerprint(self.seed, id)
    }

    /// Bitmask of slots said to hold `id`.
    pub fn holders(&self, id: &PeerChunkId) -> u32 {
        let fp = self.fp(id);
        self.inner.read().map.get(&fp).map_or(0, |e| e.holders)
    }

    /// The payload length announced for `id` (by the first peer that said
    /// it holds it; saturated at `u32::MAX`), if any peer does.
    pub fn announced_len(&self, id: &PeerChunkId) -> Option<u32> {
        let fp = self.fp(id);
        self.inner.read().map.get(&fp).map(|e| e.len)
    }

    /// Bitmasks for many ids under one lock.
    pub fn holders_many<'a>(&self, ids: impl IntoIterator<Item = &'a PeerChunkId>) -> Vec<u32> {
        let g = self.inner.read();
        ids.into_iter()
            .map(|id| g.map.get(&self.fp(id)).map_or(0, |e| e.holders))
            .collect()
    }

    /// Records that `slot` holds `id`.
    pub fn add(&self, slot: usize, id: &PeerChunkId, len: u64) -> Result<(), OverLimit> {
        self.apply(slot, std::iter::once(Op::Add(*id, len)))
    }

    /// Applies ops from `slot` in order. An add that would make `slot`
    /// hold more than its limit is refused with the ops after it; the ops
    /// before it stay applied (the caller drops the peer's link, which
    /// clears the slot).
    pub fn apply(&self, slot: usize, ops: impl IntoIterator<Item = Op>) -> Result<(), OverLimit> {
        if slot >= MAX_SLOTS {
            return Ok(());
        }
        let limit = self.max_per_slot;
        let bit = 1u32 << slot;
        let mut g = self.inner.write();
        for (n, op) in ops.into_iter().enumerate() {
            // A snapshot part holds up to hundreds of thousands of ops:
            // lookups waiting for the lock get it between batches.
            if n % APPLY_BATCH == APPLY_BATCH - 1 {
                parking_lot::RwLockWriteGuard::bump(&mut g);
            }
            let Inner { map, slots } = &mut *g;
            let st = &mut slots[slot];
            match op {
                Op::Add(id, len) => {
                    let fp = self.fp(&id);
                    if st.chunks >= limit && map.get(&fp).is_none_or(|e| e.holders & bit == 0) {
                        return Err(OverLimit { limit });
                    }
                    let e = map.entry(fp).or_insert(Entry {
                        holders: 0,
                        ram: 0,
                        len: u32::try_from(len).unwrap_or(u32::MAX),
                    });
                    // A chunk arrives through RAM (see `Op::Add`).
                    e.ram |= bit;
                    if e.holders & bit == 0 {
                        e.holders |= bit;
                        st.chunks += 1;
                        st.bytes += u64::from(e.len);
                        *st.namespaces.entry(id.ns).or_default() += 1;
                    }
                }
                Op::Remove(id) => {
                    let fp = self.fp(&id);
                    if let Some(e) = map.get_mut(&fp) {
                        e.ram &= !bit;
                        if e.holders & bit != 0 {
                            e.holders &= !bit;
                            st.chunks -= 1;
                            st.bytes -= u64::from(e.len);
                            if let Some(c) = st.namespaces.get_mut(&id.ns) {
                                *c -= 1;
                                if *c == 0 {
                                    st.namespaces.remove(&id.ns);
                                }
                            }
                        }
                        if e.holders == 0 {
                            map.remove(&fp);
                        }
                    }
                }
                Op::Ram(id, in_ram) => {
                    if let Some(e) = map.get_mut(&self.fp(&id))
                        && e.holders & bit != 0
                    {
                        if in_ram {
                            e.ram |= bit;
                        } else {
                            e.ram &= !bit;
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Forgets everything `slot` was said to hold (O(entries)).
    pub fn clear_slot(&self, slot: usize) {
        if slot >= MAX_SLOTS {
            return;
        }
        let bit = 1u32 << slot;
        let mut g = self.inner.write();
        if g.slots[slot].chunks == 0 {
            return;
        }
        g.map.retain(|_, e| {
            e.holders &= !bit;
            e.ram &= !bit;
            e.holders != 0
        });
        g.slots[slot] = SlotStats::default();
    }

    /// How many of `ids`, in order, `slot` holds in its RAM (the length of
    /// the leading run).
    pub fn ram_prefix(&self, slot: usize, ids: &[PeerChunkId]) -> usize {
        if slot >= MAX_SLOTS {
            return 0;
        }
        let bit = 1u32 << slot;
        let g = self.inner.read();
        ids.iter()
            .take_while(|id| g.map.get(&self.fp(id)).is_some_and(|e| e.ram & bit != 0))
            .count()
    }

    /// Totals for `slot`.
    pub fn totals(&self, slot: usize) -> SlotTotals {
        let g = self.inner.read();
        g.slots
            .get(slot)
            .map_or_else(SlotTotals::default, |s| SlotTotals {
                chunks: s.chunks,
                bytes: s.bytes,
            })
    }

    /// Chunk counts per namespace held by `slot`.
    pub fn namespaces(&self, slot: usize) -> Vec<(PeerNamespace, u64)> {
        let g = self.inner.read();
        g.slots
            .get(slot)
            .map(|s| s.namespaces.iter().map(|(k, v)| (*k, *v)).collect())
            .unwrap_or_default()
    }

    /// Distinct chunk ids tracked.
    pub fn len(&self) -> usize {
        self.inner.read().map.len()
    }

    /// Whether nothing is tracked.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes allocated by the index table (buckets and control bytes).
    pub fn table_bytes(&self) -> usize {
        self.inner.read().map.allocation_size()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(i: u64, ns: u8) -> PeerChunkId {
        let mut key = [0u8; 32];
        key[..8].copy_from_slice(&i.to_le_bytes());
        PeerChunkId {
            ns: PeerNamespace([ns; 16]),
            key,
            group: 0,
        }
    }

    #[test]
    fn add_remove_and_slot_bits() {
        let d = Directory::new();
        d.add(0, &id(1, 1), 100).expect("under the limit");
        d.add(3, &id(1, 1), 100).expect("under the limit");
        d.add(3, &id(2, 1), 50).expect("under the limit");
        assert_eq!(d.holders(&id(1, 1)), 0b1001);
        assert_eq!(d.holders(&id(2, 1)), 0b1000);
        assert_eq!(d.holders(&id(1, 2)), 0, "same key, other namespace");
        assert_eq!(d.announced_len(&id(2, 1)), Some(50));
        assert_eq!(d.announced_len(&id(1, 2)), None);
        assert_eq!(
            d.totals(3),
            SlotTotals {
                chunks: 2,
                bytes: 150
            }
        );
        d.apply(3, [Op::Remove(id(1, 1)), Op::Remove(id(9, 1))])
            .expect("under the limit");
        assert_eq!(d.holders(&id(1, 1)), 0b1);
        assert_eq!(
            d.totals(3),
            SlotTotals {
                chunks: 1,
                bytes: 50
            }
        );
        d.clear_slot(0);
        assert_eq!(d.holders(&id(1, 1)), 0);
        assert_eq!(d.len(), 1);
        assert_eq!(d.namespaces(3), vec![(PeerNamespace([1; 16]), 1)]);
        // Duplicate add is idempotent.
        d.add(3, &id(2, 1), 50).expect("under the limit");
        assert_eq!(d.totals(3).chunks, 1);
        // Out-of-range slot is ignored, never panics.
        d.add(MAX_SLOTS, &id(5, 1), 1).expect("ignored");
        assert_eq!(d.holders(&id(5, 1)), 0);
    }

    #[test]
    fn ram_bits_follow_adds_ram_ops_removes_and_clears() {
        let d = Directory::new();
        let ids: Vec<_> = (0..6).map(|i| id(i, 1)).collect();
        for x in &ids {
            d.add(2, x, 10).expect("under the limit");
        }
        assert_eq!(d.ram_prefix(2, &ids), 6, "an add is in RAM");
        assert_eq!(d.ram_prefix(1, &ids), 0, "another slot holds nothing");
        d.apply(2, [Op::Ram(ids[3], false)])
            .expect("under the limit");
        assert_eq!(d.ram_prefix(2, &ids), 3);
        // A RAM op for a chunk the slot does not hold changes nothing.
        d.apply(1, [Op::Ram(ids[3], true)])
            .expect("under the limit");
        assert_eq!(d.ram_prefix(2, &ids), 3);
        assert_eq!(d.ram_prefix(1, &ids), 0);
        d.apply(2, [Op::Ram(ids[3], true), Op::Ram(ids[0], false)])
            .expect("under the limit");
        assert_eq!(d.ram_prefix(2, &ids), 0);
        assert_eq!(d.ram_prefix(2, &ids[1..]), 5);
        // Another holder of the same chunk keeps its own bit.
        d.add(5, &ids[1], 10).expect("under the limit");
        d.apply(2, [Op::Remove(ids[1])]).expect("under the limit");
        assert_eq!(d.ram_prefix(2, &ids[1..]), 0);
        assert_eq!(d.ram_prefix(5, &ids[1..]), 1);
        // Re-adding is in RAM again; clearing the slot forgets the bits.
        d.add(2, &ids[1], 10).expect("under the limit");
        assert_eq!(d.ram_prefix(2, &ids[1..]), 5);
        d.clear_slot(2);
        assert_eq!(d.ram_prefix(2, &ids[1..]), 0);
        assert_eq!(d.ram_prefix(5, &ids[1..]), 1);
        assert_eq!(d.ram_prefix(MAX_SLOTS, &ids), 0);
    }

    /// A peer cannot grow the directory past its limit (a hostile peer
    /// streamed 3M entries, RSS 18 -> 289 MB: review): the add past it is
    /// refused, re-adds and removes of what it holds are not, and other
    /// peers keep their own room.
    #[test]
    fn a_peer_past_its_chunk_limit_is_refused() {
        let d = Directory::with_limit(3);
        let ids: Vec<_> = (0..5).map(|i| id(i, 1)).collect();
        let adds =
            |r: std::ops::Range<usize>| ids[r].iter().map(|x| Op::Add(*x, 10)).collect::<Vec<_>>();
        assert_eq!(d.apply(1, adds(0..5)), Err(OverLimit { limit: 3 }));
        assert_eq!(d.totals(1).chunks, 3, "the ops before the refused one stay");
        assert_eq!(d.len(), 3);
        assert_eq!(d.holders(&ids[3]), 0);
        d.apply(1, adds(0..3)).expect("re-adding what it holds");
        d.apply(1, [Op::Remove(ids[0])]).expect("a remove");
        d.add(1, &ids[3], 10).expect("room again");
        assert_eq!(d.add(1, &ids[4], 10), Err(OverLimit { limit: 3 }));
        // Another peer has its own limit, also for chunks slot 1 holds.
        d.apply(2, adds(2..5)).expect("another slot");
        assert_eq!(d.holders(&ids[3]), 0b110);
        // The default is generous.
        assert_eq!(Directory::new().max_per_slot, DEFAULT_MAX_CHUNKS_PER_PEER);
    }

    #[test]
    fn group_is_part_of_identity() {
        let mut a = id(1, 1);
        let d = Directory::new();
        d.add(0, &a, 1).expect("under the limit");
        a.group = 1;
        assert_eq!(d.holders(&a), 0);
    }

    /// `fmix`'s inverse (both xor-shifts by 33 undo themselves).
    fn unfmix(mut k: u64) -> u64 {
        // The inverse of an odd multiplier mod 2^64 (Newton's iteration).
        let inv = |m: u64| {
            let mut x = m;
            for _ in 0..6 {
                x = x.wrapping_mul(2u64.wrapping_sub(m.wrapping_mul(x)));
            }
            x
        };
        k ^= k >> 33;
        k = k.wrapping_mul(inv(0xc4ce_b9fe_1a85_ec53));
        k ^= k >> 33;
        k = k.wrapping_mul(inv(0xff51_afd7_ed55_8ccd));
        k ^ (k >> 33)
    }

    /// `n` distinct ids whose unkeyed fingerprints share their first 64
    /// bits (the table's hash): what a peer that knows the code can mint.
    fn colliding_ids(n: u64) -> Vec<PeerChunkId> {
        let target = 0x0123_4567_89ab_cdefu64;
        (0..n)
            .map(|i| {
                let mut x = id(i, 7);
                // The first lane (the table's hash) over the first five words.
                let mut a = FP_INIT[0];
                for v in &fp_words(&x)[..5] {
                    a = fmix(a ^ v);
                }
                // a7 = fmix(a6 ^ group), group 0; a6 = fmix(a5 ^ key[24..]).
                let a6 = unfmix(target);
                let last = unfmix(a6) ^ a;
                x.key[24..].copy_from_slice(&last.to_le_bytes());
                assert_eq!(
                    fingerprint([0, 0], &x).0[..2],
                    [target as u32, (target >> 32) as u32]
                );
                x
            })
            .collect()
    }

    /// Ids minted to share one unkeyed table hash spread over the keyed
    /// table (QA: 65,536 of them held the lock for over a minute), and are
    /// still told apart.
    #[test]
    fn ids_crafted_to_collide_unkeyed_get_distinct_hashes() {
        let ids = colliding_ids(4096);
        let d = Directory::new();
        let hashes: std::collections::HashSet<u64> = ids
            .iter()
            .map(|x| {
                let f = d.fp(x);
                u64::from(f.0[0]) | u64::from(f.0[1]) << 32
            })
            .collect();
        assert!(hashes.len() > 4000, "{} distinct hashes", hashes.len());
        d.apply(0, ids.iter().map(|x| Op::Add(*x, 1)))
            .expect("under the limit");
        assert_eq!(d.len(), ids.len());
        assert!(ids.iter().all(|x| d.holders(x) == 1));
        // Two directories key their fingerprints differently.
        assert_ne!(Directory::new().fp(&ids[0]), d.fp(&ids[0]));
    }

    /// Measures the bytes per remote entry for 1M entries (the number
    /// quoted in docs/benchmarks.md). `#[ignore]`d for time; run with
    /// `cargo nextest run -p kvtier-peer --run-ignored all directory_memory`.
    #[test]
    #[ignore = "allocates ~60 MB; run explicitly"]
    fn directory_memory_per_entry() {
        let d = Directory::new();
        let n = 1_000_000u64;
        for i in 0..n {
            d.add(0, &id(i, 1), 1 << 20).expect("under the limit");
        }
        assert_eq!(d.len() as u64, n);
        let per = d.table_bytes() as f64 / n as f64;
        println!(
            "directory: {n} entries, {} table bytes, {per:.1} bytes/entry",
            d.table_bytes()
        );
        assert!(per <= 64.0, "{per} bytes per entry");
    }
}
