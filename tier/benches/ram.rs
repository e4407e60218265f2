//! RAM tier benches: `RamCache` put and get of 256 KiB / 1 MiB / 4 MiB chunks
//! with cold CPU caches, against a plain memcpy of the same sizes rotating
//! through the same amount of memory, measured in the same run.
//!
//! - put: copy the chunk out of a source buffer into a new `Bytes` (as the
//!   node does when copying out of the client's shared memory), then
//!   `insert` it into a full 512 MiB cache (which evicts and frees the LRU
//!   chunk);
//! - get: `get` a chunk from a 1 GiB cache and copy it out into a destination
//!   buffer (as the node does into the client's shared memory);
//! - memcpy: copy the chunk from the source pool into the destination pool.
//!
//! Source and destination pools are 1 GiB each and every op moves to the
//! next chunk, so no chunk is in the CPU caches when touched. Peak memory is
//! about 2.5 GiB.
//!
//! `cargo bench -p kvtier-tier --bench ram` (add `-- --quick` for a short
//! run). Besides criterion's own output, prints one summary line per size and
//! op: `ratio = kvtier_throughput / memcpy_throughput`.

use std::collections::BTreeMap;
use std::hint::black_box;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{BenchmarkId, Criterion, Throughput};
use tier::ram::RamCache;
use tier::{ChunkId, ChunkKey, Namespace};

/// Bytes each pool rotates through.
const POOL_BYTES: usize = 1 << 30;
/// Budget of the cache the put bench inserts into.
const PUT_BUDGET: u64 = 512 << 20;

/// (bytes, nanoseconds) accumulated per bench label over every timed call.
static TOTALS: Mutex<BTreeMap<String, (u128, u128)>> = Mutex::new(BTreeMap::new());

fn record(label: &str, bytes: u64, elapsed: Duration) {
    let mut t = TOTALS.lock().expect("totals lock");
    let e = t.entry(label.to_string()).or_default();
    e.0 += u128::from(bytes);
    e.1 += elapsed.as_nanos();
}

fn chunk_id(i: usize) -> ChunkId {
    // splitmix64: key bytes that look like a real block hash.
    let mut z = (i as u64).wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut key = [0u8; 32];
    for part in key.chunks_exact_mut(8) {
        z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut x = z;
        x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        part.copy_from_slice(&(x ^ (x >> 31)).to_le_bytes());
    }
    ChunkId::new(Namespace([7; 16]), ChunkKey(key), 0)
}

struct Pools {
    size: usize,
    src: Vec<Bytes>,
    dst: Vec<Vec<u8>>,
    ids: Vec<ChunkId>,
}

impl Pools {
    fn new(size: usize) -> Self {
        let count = POOL_BYTES / size;
        let src = (0..count)
            .map(|i| Bytes::from(vec![(i % 251) as u8 + 1; size]))
            .collect();
        // Non-zero fill: faults every page in now (a zeroed `vec!` would be
        // lazily mapped and fault during the measurement).
        let dst = (0..count).map(|_| vec![0xeeu8; size]).collect();
        Self {
            size,
            src,
            dst,
            ids: (0..count).map(chunk_id).collect(),
        }
    }

    fn count(&self) -> usize {
        self.src.len()
    }
}

fn bench_size(c: &mut Criterion, size: usize) {
    let kib = size >> 10;
    let mut p = Pools::new(size);
    let count = p.count();
    let mut g = c.benchmark_group(format!("ram-{kib}KiB"));
    g.throughput(Throughput::Bytes(size as u64));
    g.sample_size(10);

    let mut next = 0usize;
    g.bench_function(BenchmarkId::new("memcpy-cold", kib), |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            for _ in 0..iters {
                let i = next;
                next = (next + 1) % count;
                p.dst[i].copy_from_slice(&p.src[i]);
                black_box(&p.dst[i]);
            }
            let e = start.elapsed();
            record(&format!("memcpy-{kib}KiB"), iters * size as u64, e);
            e
        })
    });

    {
        let cache = RamCache::new(PUT_BUDGET);
        // Fill it so every measured put inserts a new id and evicts one
        // (steady state); measured puts start after the filled ids.
        let mut filled = 0;
        while filled < count && cache.used_bytes() + size as u64 <= PUT_BUDGET {
            cache
                .insert(p.ids[filled], p.src[filled].clone(), None, false)
                .expect("fits");
            filled += 1;
        }
        let mut next = filled % count;
        // Then one full rotation of measured-style puts, so the allocator
        // reaches its steady state (freed copies reused by new ones) first.
        for _ in 0..count {
            let i = next;
            next = (next + 1) % count;
            let data = Bytes::copy_from_slice(&p.src[i]);
            black_box(cache.insert(p.ids[i], data, None, false).expect("fits"));
        }
        g.bench_function(BenchmarkId::new("put-copy-in", kib), |b| {
            b.iter_custom(|iters| {
                let start = Instant::now();
                for _ in 0..iters {
                    let i = next;
                    next = (next + 1) % count;
                    let data = Bytes::copy_from_slice(&p.src[i]);
                    let (_, evicted) = cache.insert(p.ids[i], data, None, false).expect("fits");
                    black_box(evicted);
                }
                let e = start.elapsed();
                record(&format!("put-{kib}KiB"), iters * size as u64, e);
                e
            })
        });
    }

    {
        // Holds every source chunk (shares their memory: no extra GiB).
        let cache = RamCache::new(POOL_BYTES as u64);
        for i in 0..count {
            let (_, ev) = cache
                .insert(p.ids[i], p.src[i].clone(), None, false)
                .expect("fits");
            assert!(ev.is_empty(), "get cache must hold the whole pool");
        }
        let mut next = 0usize;
        g.bench_function(BenchmarkId::new("get-copy-out", kib), |b| {
            b.iter_custom(|iters| {
                let start = Instant::now();
                for _ in 0..iters {
                    let i = next;
                    next = (next + 1) % count;
                    let entry = cache.get(&p.ids[i]).expect("every chunk is cached");
                    p.dst[i].copy_from_slice(&entry.data);
                    black_box(&p.dst[i]);
                }
                let e = start.elapsed();
                record(&format!("get-{kib}KiB"), iters * size as u64, e);
                e
            })
        });
    }
    g.finish();
    assert_eq!(p.size, size);
}

fn summary() {
    let t = TOTALS.lock().expect("totals lock");
    let gbps = |label: &str| {
        t.get(label)
            .filter(|v| v.1 > 0)
            .map(|v| v.0 as f64 / v.1 as f64)
    };
    eprintln!("\n=== tier RAM summary (cold: rotating through 1 GiB; GB/s = bytes per ns) ===");
    for kib in [256, 1024, 4096] {
        let Some(m) = gbps(&format!("memcpy-{kib}KiB")) else {
            continue;
        };
        for op in ["put", "get"] {
            if let Some(k) = gbps(&format!("{op}-{kib}KiB")) {
                eprintln!(
                    "{op} {kib:>4} KiB: kvtier {k:>6.2} GB/s, cold memcpy {m:>6.2} GB/s, ratio = kvtier_throughput / memcpy_throughput = {:.3}",
                    k / m
                );
            }
        }
    }
}

fn main() {
    let mut c = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3))
        .configure_from_args();
    for size in [256 << 10, 1 << 20, 4 << 20] {
        bench_size(&mut c, size);
    }
    c.final_summary();
    summary();
}
