//! Lookup of 1,024 keys (half hits, half misses, random) in a 1M-entry
//! index, against a std `HashMap` (SipHash) holding the same entries, both
//! measured in this run. Batches rotate through 256 different key sets so
//! the table is not cache-resident between iterations.
//!
//! Then the same batches through the store: `ChunkStore::lookup_prefix` on a
//! store holding the same 1M keys (64-byte chunks written to disk through a
//! 1 MiB RAM tier, so the last ~16K stay in RAM as well), the LOOKUP path of
//! the daemon (index probe + RAM check per key). Data under the target dir
//! (~300 MB), removed afterwards.
//!
//! Run: `cargo bench -p kvtier-tier --bench lookup`

use std::collections::HashMap;
use std::hint::black_box;
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::Criterion;
use tier::index::{Index, Location};
use tier::ram::RamCache;
use tier::{ChunkId, ChunkKey, ChunkStore, Namespace, NamespaceRecord, TierConfig, WritePolicy};

const ENTRIES: u64 = 1_000_000;
const BATCH: usize = 1024;
const BATCHES: usize = 256;

fn key(n: u64) -> ChunkKey {
    // Keys are uniform hashes in practice: use a mixed counter.
    let mut k = [0u8; 32];
    let mut x = n.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x5555;
    for w in k.chunks_exact_mut(8) {
        x ^= x >> 31;
        x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
        w.copy_from_slice(&x.to_le_bytes());
    }
    ChunkKey(k)
}

fn loc(n: u64) -> Location {
    Location {
        region: (n % 256) as u32,
        offset: n as u32,
        header_len: 128,
        payload_len: 1 << 20,
        crc: n as u32,
        txn: 0,
    }
}

fn bench(c: &mut Criterion) {
    let ns = Namespace([7; 16]);
    let mut index = Index::with_capacity(ENTRIES as usize);
    let mut std_map: HashMap<ChunkId, Location> = HashMap::with_capacity(ENTRIES as usize);
    for n in 0..ENTRIES {
        let id = ChunkId::new(ns, key(n), 0);
        index.insert(id, loc(n));
        std_map.insert(id, loc(n));
    }
    // Batches: even slots hit (random existing key), odd slots miss.
    let mut rng = 0x1234_5678_9abc_def1_u64;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let batches: Vec<Vec<ChunkKey>> = (0..BATCHES)
        .map(|_| {
            (0..BATCH)
                .map(|i| {
                    if i % 2 == 0 {
                        key(next() % ENTRIES)
                    } else {
                        key(ENTRIES + next() % (1 << 40))
                    }
                })
                .collect()
        })
        .collect();

    let mut g = c.benchmark_group("lookup_1024_keys_in_1M");
    g.measurement_time(Duration::from_secs(4));
    let mut out = Vec::with_capacity(BATCH);
    let mut which = 0usize;
    g.bench_function("std_hashmap_siphash", |b| {
        b.iter(|| {
            which = (which + 1) % BATCHES;
            let mut hits = 0;
            for k in &batches[which] {
                hits += usize::from(std_map.contains_key(&ChunkId::new(ns, *k, 0)));
            }
            black_box(hits)
        })
    });
    g.bench_function("index_one_by_one", |b| {
        b.iter(|| {
            which = (which + 1) % BATCHES;
            let mut hits = 0;
            for k in &batches[which] {
                hits += usize::from(index.get(&ChunkId::new(ns, *k, 0)).is_some());
            }
            black_box(hits)
        })
    });
    g.bench_function("index_batched_prefetch", |b| {
        b.iter(|| {
            which = (which + 1) % BATCHES;
            index.get_batch(&ns, 0, &batches[which], &mut out);
            black_box(out.iter().filter(|l| l.is_some()).count())
        })
    });
    let mut present = Vec::with_capacity(BATCH);
    g.bench_function("index_contains_batch_fingerprint", |b| {
        b.iter(|| {
            which = (which + 1) % BATCHES;
            index.contains_batch(&ns, 0, &batches[which], &mut present);
            black_box(present.iter().filter(|p| **p).count())
        })
    });
    g.finish();

    // The ratio, measured here in the same run (criterion's numbers above
    // are the detailed figures).
    let time = |f: &mut dyn FnMut(&[ChunkKey]) -> usize| {
        let reps = 2000;
        let t = Instant::now();
        let mut s = 0;
        for r in 0..reps {
            s += f(&batches[r % BATCHES]);
        }
        black_box(s);
        t.elapsed().as_secs_f64() * 1e6 / reps as f64
    };
    let base = time(&mut |ks| {
        ks.iter()
            .filter(|k| std_map.contains_key(&ChunkId::new(ns, **k, 0)))
            .count()
    });
    let ours = time(&mut |ks| {
        index.get_batch(&ns, 0, ks, &mut out);
        out.iter().filter(|l| l.is_some()).count()
    });
    let presence = time(&mut |ks| {
        index.contains_batch(&ns, 0, ks, &mut present);
        present.iter().filter(|p| **p).count()
    });
    let hits = {
        index.get_batch(&ns, 0, &batches[0], &mut out);
        out.iter().filter(|l| l.is_some()).count()
    };
    println!(
        "RESULT lookup 1024 keys ({hits} hits) in 1M: index get_batch {ours:.1} us/batch, contains_batch {presence:.1} us/batch, std HashMap {base:.1} us/batch; speedup {:.1}x / {:.1}x (target <= 20 us); index RAM {} MiB",
        base / ours,
        base / presence,
        index.memory_bytes() >> 20
    );
    drop(index);

    // The store: same keys, same batches.
    let root = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("kvtier-lookup-bench");
    let _ = std::fs::remove_dir_all(&root);
    let cfg = TierConfig {
        data_dir: root.clone(),
        ram_budget: 1 << 20,
        disk_budget: 768 << 20,
        region_size: 64 << 20,
        write_policy: WritePolicy::Backpressure,
        idle_flush_after: Duration::from_secs(3600),
        writer_queue: 4096,
        ..TierConfig::default()
    };
    let store = ChunkStore::open(cfg).expect("open the bench store");
    let sns = store
        .register_namespace(&NamespaceRecord {
            model: "lookup-bench".into(),
            ..Default::default()
        })
        .expect("namespace");
    let t = Instant::now();
    let payload = Bytes::from(vec![0x5a; 64]);
    for n in 0..ENTRIES {
        store
            .put(ChunkId::new(sns, key(n), 0), payload.clone())
            .expect("put");
    }
    store.flush().expect("flush");
    let st = store.stats();
    println!(
        "built the store: {} chunks on disk, {} in RAM, in {:.1} s",
        st.disk_chunks,
        st.ram_chunks,
        t.elapsed().as_secs_f64()
    );
    let mut tiers = Vec::with_capacity(BATCH);
    let mut g = c.benchmark_group("store_lookup_prefix_1024_keys_in_1M");
    g.measurement_time(Duration::from_secs(4));
    g.bench_function("lookup_prefix", |b| {
        b.iter(|| {
            which = (which + 1) % BATCHES;
            black_box(store.lookup_prefix(sns, 0, &batches[which], &mut tiers))
        })
    });
    g.finish();
    let (hits, in_ram) = {
        store.lookup_prefix(sns, 0, &batches[0], &mut tiers);
        (
            tiers.iter().filter(|t| t.is_some()).count(),
            tiers
                .iter()
                .filter(|t| **t == Some(tier::Tier::Ram))
                .count(),
        )
    };
    let base = time(&mut |ks| {
        ks.iter()
            .filter(|k| std_map.contains_key(&ChunkId::new(ns, **k, 0)))
            .count()
    });
    let ours = time(&mut |ks| {
        store.lookup_prefix(sns, 0, ks, &mut tiers);
        tiers.iter().filter(|t| t.is_some()).count()
    });
    println!(
        "RESULT store lookup_prefix 1024 keys ({hits} hits, {in_ram} in RAM) in a 1M-chunk store: {ours:.1} us/batch (target <= 20 us); std HashMap contains_key {base:.1} us/batch; speedup {:.1}x",
        base / ours
    );
    drop(store);
    let _ = std::fs::remove_dir_all(&root);

    // The RAM half alone: `RamCache::contains_keys` (what `lookup_prefix`
    // calls after the index probe) on a cache of the store's shape (the last
    // 16,384 keys) and on one holding all 1M keys (half of each batch hits).
    for cached in [16_384, ENTRIES] {
        let ram = RamCache::new(u64::MAX);
        for n in ENTRIES - cached..ENTRIES {
            ram.insert(ChunkId::new(ns, key(n), 0), payload.clone(), None, false)
                .expect("insert");
        }
        let mut present = Vec::with_capacity(BATCH);
        let hits = {
            ram.contains_keys(&ns, 0, &batches[0], &mut present);
            present.iter().filter(|p| **p).count()
        };
        let ours = time(&mut |ks| {
            ram.contains_keys(&ns, 0, ks, &mut present);
            present.iter().filter(|p| **p).count()
        });
        // On a shared machine the best of 40 rounds of 50 batches is the
        // steadier figure (preemption only ever adds time).
        let best = (0..40)
            .map(|r| {
                let t = Instant::now();
                let mut s = 0;
                for b in 0..50 {
                    ram.contains_keys(&ns, 0, &batches[(r * 50 + b) % BATCHES], &mut present);
                    s += present.iter().filter(|p| **p).count();
                }
                black_box(s);
                t.elapsed().as_secs_f64() * 1e6 / 50.0
            })
            .fold(f64::INFINITY, f64::min);
        println!(
            "RESULT ram contains_keys 1024 keys ({hits} hits) in a {cached}-entry RamCache: {ours:.1} us/batch (mean of 2,000), best round {best:.1} us/batch"
        );
    }
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    bench(&mut c);
    c.final_summary();
}
