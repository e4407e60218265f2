//! The in-RAM index of chunks on disk: `ChunkId -> Location`.
//!
//! It is the truth for negatives: a chunk absent here is not on disk, so a
//! miss costs no I/O. Keys are already uniform hashes, so the table hashes
//! only 16 key bytes folded with the namespace and group (one multiply), and
//! lookups of many keys go in batches with software prefetch of the slots and
//! then of the entries, so the memory latency of a random probe overlaps with
//! that of its neighbours.
//!
//! Layout: an `FpTable` (`fptable.rs`, the slot table shared with the
//! RAM tier: 8-byte slots of a 32-bit fingerprint from the hash's high half
//! and a 32-bit entry index, home slot from the low bits, linear probing,
//! backward-shift deletion, at most half full) over a dense `Vec` of
//! entries (a removal moves the last entry into the hole). Both are advised
//! to use huge pages (fewer TLB misses). A presence test needs only the slot
//! array ([`Index::contains_batch`]): 16 MiB for 1M entries, so more of it
//! stays in the CPU caches than with wider slots.

use crate::fptable::{FpTable, advise_huge, prefetch};
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

/// The index table. Not synchronised: the store wraps it in a lock.
pub struct Index {
    /// `hash -> position in entries`.
    table: FpTable,
    entries: Vec<(ChunkId, Location)>,
}

/// 64-bit hash of (namespace, key, group): [`key_hash`] of the key under the
/// [`seed`] of the namespace and group.
#[inline]
pub(crate) fn hash_parts(ns: &Namespace, key: &ChunkKey, group: GroupId) -> u64 {
    key_hash(seed(ns, group), key)
}

/// The part of [`hash_parts`] common to every key of a namespace and group
/// (a batch computes it once): both namespace words and the group, mixed by
/// multiplies, so that neither two groups nor two namespaces differ by a
/// plain XOR a family of structured keys could cancel.
///
/// Keyed with a random value per process ([`process_key`]): unkeyed, the
/// rounds of [`key_hash`] can be solved for a last word, so a client could
/// mint any number of distinct keys with one hash ([`colliding_key`] does
/// it for tests) and make the index and the RAM table probe one long run
/// for every other client. Hashes are never stored or sent: recovery and
/// peers work on ids.
#[inline]
pub(crate) fn seed(ns: &Namespace, group: GroupId) -> u64 {
    seed_under(process_key(), ns, group)
}

/// [`seed`] under `key` (0: the unkeyed seed a client could compute).
#[inline]
fn seed_under(key: u64, ns: &Namespace, group: GroupId) -> u64 {
    let w = |o: usize| u64::from_le_bytes(ns.0[o..o + 8].try_into().expect("8 bytes"));
    let s = fold_mul(w(0) ^ u64::from(group) ^ key, 0xa076_1d64_78bd_642f);
    fold_mul(s ^ w(8), 0xe703_7ed1_a0b4_28db)
}

/// A random 64-bit key, fixed for the life of the process.
#[inline]
fn process_key() -> u64 {
    static KEY: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *KEY.get_or_init(|| {
        use std::hash::BuildHasher;
        // std's RandomState draws its keys from the OS's random source.
        std::collections::hash_map::RandomState::new().hash_one(0x6b76_7469_6572_u64)
    })
}

/// A key's hash under `seed`: all four words of the key, each mixed in by a
/// multiply round. Every byte counts: keys are uniform hashes when vLLM makes
/// them, but a client may use structured ones (a fixed prefix and a counter
/// in the last bytes), and a hash of only the first 16 bytes gave all of
/// those one hash, so a fingerprint-only presence test called every such key
/// present and the index probed one long run. Rounds rather than one
/// multiply of folded words: a fold such as `a ^ rotl(b)` maps whole
/// families of structured keys (a repeated byte `x` and its complement) to
/// one hash.
///
/// The first three rounds fold the 128-bit product ([`fold_mul`]): a plain
/// 64-bit multiply carries a difference in its input's top bit to the top bit
/// alone, whatever the seed, so the next word could cancel it and families
/// of 8 keys shared one hash under every key. Folded, a difference spreads
/// through carries that depend on the keyed state. The last round is a plain
/// multiply, a bijection of the last word for a given state (tests mint
/// colliding keys with it; a client cannot, not knowing the state). So two
/// keys that differ only in the last word's top bit get hashes that differ
/// only in bits 63 and 31: one home slot, fingerprints one bit apart (a
/// pair that probes together, never a false "present"). The low
/// bits pick the home slot, the high 32 bits make the fingerprint (see
/// [`crate::fptable`]). Shared with the RAM tier.
#[inline]
pub(crate) fn key_hash(seed: u64, key: &ChunkKey) -> u64 {
    let h = (key_mix(key_state(seed, key)) ^ key_word(key, 3)).wrapping_mul(KEY_MUL[3]);
    h ^ (h >> 32)
}

/// [`key_hash`]'s state after the first three words of `key`.
#[inline(always)]
fn key_state(seed: u64, key: &ChunkKey) -> u64 {
    let h = fold_mul(key_word(key, 0) ^ seed, KEY_MUL[0]);
    let h = fold_mul(h ^ key_word(key, 1), KEY_MUL[1]);
    fold_mul(h ^ key_word(key, 2), KEY_MUL[2])
}

/// The 128-bit product of `x` and `m`, its halves XORed.
#[inline(always)]
fn fold_mul(x: u64, m: u64) -> u64 {
    let p = u128::from(x) * u128::from(m);
    (p as u64) ^ (p >> 64) as u64
}

/// The odd multipliers of [`key_hash`]'s rounds.
const KEY_MUL: [u64; 4] = [
    0x9e37_79b9_7f4a_7c15,
    0xd6e8_feb8_6659_fd93,
    0xa076_1d64_78bd_642f,
    0xe703_7ed1_a0b4_28db,
];

#[inline(always)]
fn key_word(key: &ChunkKey, i: usize) -> u64 {
    u64::from_le_bytes(key.0[i * 8..i * 8 + 8].try_into().expect("8 bytes"))
}

#[inline(always)]
fn key_mix(h: u64) -> u64 {
    h ^ (h >> 29)
}

/// A key other than `key` with the same [`key_hash`] under `seed` (same
/// home slot and fingerprint, for tests of hash collisions): the first two
/// words kept, the third inverted, and the fourth that brings the state
/// back to `key`'s.
#[cfg(test)]
pub(crate) fn colliding_key(seed: u64, key: &ChunkKey) -> ChunkKey {
    let mut k = key.0;
    k[16..24].copy_from_slice(&(!key_word(key, 2)).to_le_bytes());
    key_with_hash_of(seed, &ChunkKey(k), key)
}

/// `prefix`'s first three words, and the fourth that gives it `target`'s
/// [`key_hash`] under `seed` (the last round is a bijection of its word).
#[cfg(test)]
fn key_with_hash_of(seed: u64, prefix: &ChunkKey, target: &ChunkKey) -> ChunkKey {
    let mut k = prefix.0;
    let last =
        key_mix(key_state(seed, target)) ^ key_word(target, 3) ^ key_mix(key_state(seed, prefix));
    k[24..32].copy_from_slice(&last.to_le_bytes());
    let other = ChunkKey(k);
    debug_assert_eq!(key_hash(seed, &other), key_hash(seed, target));
    other
}

/// [`hash_parts`] of an id.
#[inline]
pub(crate) fn hash_id(id: &ChunkId) -> u64 {
    hash_parts(&id.ns, &id.key, id.group)
}

impl Default for Index {
    fn default() -> Self {
        Self::with_capacity(0)
    }
}

impl Index {
    /// An empty index sized for `n` entries without growing.
    pub fn with_capacity(n: usize) -> Self {
        let entries = Vec::with_capacity(n);
        advise_huge(
            entries.as_ptr() as usize,
            n * std::mem::size_of::<(ChunkId, Location)>(),
        );
        Self {
            table: FpTable::with_capacity(n),
            entries,
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
        self.table.memory_bytes()
            + self.entries.capacity() * std::mem::size_of::<(ChunkId, Location)>()
    }

    /// Table position of `id` (hash `h`), if present.
    #[inline]
    fn find_pos(&self, id: &ChunkId, h: u64) -> Option<usize> {
        self.table.find(h, |i| self.entries[i as usize].0 == *id)
    }

    /// The location of `id`.
    #[inline]
    pub fn get(&self, id: &ChunkId) -> Option<Location> {
        self.find_pos(id, hash_id(id))
            .map(|p| self.entries[self.table.idx_at(p) as usize].1)
    }

    /// Whether `id` is present.
    pub fn contains(&self, id: &ChunkId) -> bool {
        self.get(id).is_some()
    }

    /// Inserts or replaces; returns the previous location.
    pub fn insert(&mut self, id: ChunkId, loc: Location) -> Option<Location> {
        let h = hash_id(&id);
        if let Some(p) = self.find_pos(&id, h) {
            let e = &mut self.entries[self.table.idx_at(p) as usize].1;
            return Some(std::mem::replace(e, loc));
        }
        let idx = u32::try_from(self.entries.len()).expect("index holds < 2^32 entries");
        self.entries.push((id, loc));
        let entries = &self.entries;
        self.table
            .insert(h, idx, |i| hash_id(&entries[i as usize].0));
        None
    }

    /// Removes `id`; returns its location.
    pub fn remove(&mut self, id: &ChunkId) -> Option<Location> {
        let pos = self.find_pos(id, hash_id(id))?;
        let idx = self.table.idx_at(pos);
        let entries = &self.entries;
        self.table
            .remove_at(pos, |i| hash_id(&entries[i as usize].0));
        // Remove the entry densely: move the last entry into `idx`.
        let (_, loc) = self.entries.swap_remove(idx as usize);
        if let Some((moved, _)) = self.entries.get(idx as usize) {
            let last = self.entries.len() as u32;
            let found = self.table.reindex(hash_id(moved), last, idx);
            assert!(found, "the moved entry has a slot");
        }
        Some(loc)
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
    /// location of `keys[i]`. Software-pipelined over windows of 64 keys:
    /// the slot of key `i + 16` is prefetched while key `i` is probed, a
    /// matching slot's entry is prefetched at once, and the ids are compared
    /// at the end of the window, when those entries have arrived.
    pub fn get_batch(
        &self,
        ns: &Namespace,
        group: GroupId,
        keys: &[ChunkKey],
        out: &mut Vec<Option<Location>>,
    ) {
        const W: usize = 64;
        const D: usize = 16;
        out.clear();
        out.reserve(keys.len());
        let mut hashes = [0u64; W];
        let mut cand = [u32::MAX; W];
        let seed = seed(ns, group);
        for window in keys.chunks(W) {
            for (h, k) in hashes.iter_mut().zip(window) {
                *h = key_hash(seed, k);
            }
            let n = window.len();
            for &h in hashes.iter().take(D.min(n)) {
                self.table.prefetch(h);
            }
            for i in 0..n {
                if i + D < n {
                    self.table.prefetch(hashes[i + D]);
                }
                cand[i] = match self.table.first_match(hashes[i]) {
                    Some(idx) => {
                        // The entry is needed to confirm: start fetching it.
                        prefetch(&self.entries[idx as usize]);
                        idx
                    }
                    None => u32::MAX,
                };
            }
            out.extend(window.iter().zip(&cand[..n]).map(|(k, &c)| {
                if c == u32::MAX {
                    return None;
                }
                let (id, loc) = &self.entries[c as usize];
                if id.key == *k && id.ns == *ns && id.group == group {
                    Some(*loc)
                } else {
                    // Another id with the same fingerprint: the full probe.
                    self.get(&ChunkId::new(*ns, *k, group))
                }
            }));
        }
    }

    /// Batched presence test by fingerprint only (no entry access): `out[i]`
    /// tells whether `keys[i]` is present. A negative is exact. A positive
    /// is wrong only if an absent key's probe (home slot from the hash's low
    /// bits, 2.5 slots on average at half load) meets a 31-bit fingerprint
    /// match: about 1 in 10^9 absent keys. A read that follows checks the
    /// full id (a false positive becomes a miss, never wrong bytes).
    ///
    /// One pass, no allocation, about 16 random slot reads in flight at a time.
    pub fn contains_batch(
        &self,
        ns: &Namespace,
        group: GroupId,
        keys: &[ChunkKey],
        out: &mut Vec<bool>,
    ) {
        let seed = seed(ns, group);
        self.probe_fp(keys.len(), |i| key_hash(seed, &keys[i]), out);
    }

    /// Starts loading the home slot of hash `h` ([`hash_parts`]) into the
    /// cache.
    #[inline(always)]
    pub(crate) fn prefetch_hash(&self, h: u64) {
        self.table.prefetch(h);
    }

    /// Whether an id of hash `h` is present, by fingerprint (see
    /// [`Index::contains_batch`]).
    #[inline(always)]
    pub(crate) fn contains_hash(&self, h: u64) -> bool {
        self.table.first_match(h).is_some()
    }

    /// Fingerprint probes of `n` hashes, `hash(i)` the `i`th, batched
    /// ([`FpTable::probe_batch`]).
    #[inline(always)]
    fn probe_fp(&self, n: usize, hash: impl Fn(usize) -> u64, out: &mut Vec<bool>) {
        out.clear();
        out.reserve(n);
        self.table
            .probe_batch(n, hash, |_, m| out.push(m.is_some()));
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

    /// Keys minted to share one hash under the unkeyed seed (what a client
    /// that knows the code could compute) spread under the process's key.
    #[test]
    fn keys_crafted_to_collide_unkeyed_get_distinct_hashes() {
        let ns = Namespace([9; 16]);
        let unkeyed = seed_under(0, &ns, 0);
        let base = ChunkKey([0x33; 32]);
        let keys: Vec<ChunkKey> = (0..1024u64)
            .map(|i| {
                let mut k = base.0;
                k[..8].copy_from_slice(&i.to_le_bytes());
                let k = key_with_hash_of(unkeyed, &ChunkKey(k), &base);
                assert_eq!(key_hash(unkeyed, &k), key_hash(unkeyed, &base));
                k
            })
            .collect();
        let hashes: std::collections::HashSet<u64> =
            keys.iter().map(|k| hash_parts(&ns, k, 0)).collect();
        assert!(hashes.len() > 1000, "{} distinct hashes", hashes.len());
        assert_ne!(process_key(), 0);
    }

    /// Keys that differ in the top bit of one word and the bits the next
    /// round's xor-shift moves it to in the next word: a multiply carries a
    /// top-bit difference to the top bit alone whatever the seed, so with a
    /// plain multiply per round every such family of 8 keys shared one hash
    /// under every key (and a fingerprint-only LOOKUP called all 8 present
    /// when one was).
    #[test]
    fn top_bit_differences_do_not_cancel_in_the_next_word() {
        let ns = Namespace([4; 16]);
        let top = 1u64 << 63;
        let next = top | (top >> 29);
        for seed_key in [0, 1, process_key()] {
            let seed = seed_under(seed_key, &ns, 0);
            for base in [[0u8; 32], [0x5a; 32], [0xff; 32]] {
                let mut seen = std::collections::HashSet::new();
                for flips in 0..8u32 {
                    let mut words = [0u64; 4];
                    for (w, b) in words.iter_mut().zip(base.chunks(8)) {
                        *w = u64::from_le_bytes(b.try_into().unwrap());
                    }
                    for w in 0..3 {
                        if flips >> w & 1 == 1 {
                            words[w] ^= top;
                            words[w + 1] ^= next;
                        }
                    }
                    let mut k = [0u8; 32];
                    for (b, w) in k.chunks_mut(8).zip(words) {
                        b.copy_from_slice(&w.to_le_bytes());
                    }
                    let h = key_hash(seed, &ChunkKey(k));
                    assert!(seen.insert(h), "seed key {seed_key:#x} flips {flips:03b}");
                }
            }
        }
    }

    #[test]
    fn structured_keys_do_not_share_a_hash() {
        // Repeated-byte keys (and their complements, which a one-round fold
        // mapped to one hash) across groups and namespaces: all distinct.
        let mut seen = std::collections::HashSet::new();
        for x in 0..=255u8 {
            for g in 0..4 {
                for ns in [0u8, 1, 0xff] {
                    let h = hash_parts(&Namespace([ns; 16]), &ChunkKey([x; 32]), g);
                    assert!(seen.insert(h), "key [{x}; 32] group {g} ns {ns}");
                }
            }
        }
        // Little-endian counters across groups (a key XORed with the group
        // once met another key of another group).
        let mut seen = std::collections::HashSet::new();
        for i in 0..4096u32 {
            let mut k = [0u8; 32];
            k[..4].copy_from_slice(&i.to_le_bytes());
            for g in 0..8 {
                let h = hash_parts(&Namespace([7; 16]), &ChunkKey(k), g);
                assert!(seen.insert(h), "counter key {i} group {g}");
            }
        }
        // A fixed prefix and a counter in any one word of the key (the
        // last 16 bytes were once left out of the hash): all distinct, in
        // hash and in fingerprint.
        let mut seen = std::collections::HashSet::new();
        let mut fps = std::collections::HashSet::new();
        for word in 0..4 {
            for i in 1..=2048u64 {
                let mut k = [0x5au8; 32];
                k[word * 8..word * 8 + 8].copy_from_slice(&i.to_le_bytes());
                let h = hash_parts(&Namespace([3; 16]), &ChunkKey(k), 0);
                assert!(seen.insert(h), "counter {i} in word {word}");
                fps.insert(crate::fptable::fingerprint(h));
            }
        }
        assert!(fps.len() >= 8190, "{} distinct fingerprints", fps.len());
        // Fingerprint-only presence of half of them in an index: no false
        // positive for the other half.
        let mut ix = Index::default();
        for x in (0..=255u8).step_by(2) {
            ix.insert(
                ChunkId::new(Namespace([1; 16]), ChunkKey([x; 32]), 0),
                loc(u32::from(x)),
            );
        }
        let keys: Vec<ChunkKey> = (0..=255u8).map(|x| ChunkKey([x; 32])).collect();
        let mut present = Vec::new();
        ix.contains_batch(&Namespace([1; 16]), 0, &keys, &mut present);
        for (x, p) in present.iter().enumerate() {
            assert_eq!(*p, x % 2 == 0, "key [{x}; 32]");
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
        let mut present = Vec::new();
        for len in [0, 1, 15, 16, 17, 33, 10_000] {
            ix.contains_batch(&Namespace([1; 16]), 0, &keys[..len], &mut present);
            assert_eq!(present.len(), len);
            for (n, p) in present.iter().enumerate() {
                assert_eq!(*p, n < 5000, "key {n} of {len}");
            }
        }
        ix.get_batch(&Namespace([2; 16]), 0, &keys, &mut out);
        assert!(out.iter().all(Option::is_none));
        ix.contains_batch(&Namespace([1; 16]), 1, &keys, &mut present);
        assert!(!present.iter().any(|p| *p));
        let removed = ix.retain(|_, l| l.region % 2 == 0);
        assert_eq!(removed.len(), 2500);
        assert_eq!(ix.get(&id(3, 1, 0)), None);
        assert_eq!(ix.get(&id(4, 1, 0)), Some(loc(4)));
    }
}
