//! Lookup of 1,024 keys (half hits, half misses, random) in a 1M-entry
//! index, against a std `HashMap` (SipHash) holding the same entries, both
//! measured in this run. Batches rotate through 256 different key sets so
//! the table is not cache-resident between iterations.
//!
//! Run: `cargo bench -p kvtier-tier --bench lookup`

use std::collections::HashMap;
use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::Criterion;
use tier::index::{Index, Location};
use tier::{ChunkId, ChunkKey, Namespace};

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
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    bench(&mut c);
    c.final_summary();
}
