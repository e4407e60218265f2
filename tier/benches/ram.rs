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
//! Two more groups measure the LRU bookkeeping alone: `lru-ops-1M` (`get` of
//! random ids in a 1M-entry cache against `std::collections::HashMap::get`)
//! and `lookup-1024-in-1M` (1,024 ids, half cached: `contains_batch`, then
//! `contains` per id, against `HashMap::contains_key`).
//! `KVTIER_BENCH_SIZES_KIB=256,1024` picks chunk sizes (empty: none).
//!
//! Source and destination pools are 1 GiB each and every op moves to the
//! next chunk, so no chunk is in the CPU caches when touched. Peak memory is
//! about 2.5 GiB.
//!
//! `cargo bench -p kvtier-tier --bench ram` (add `-- --quick` for a short
//! run). Besides criterion's own output, prints one summary line per size and
//! op: `ratio = kvtier_throughput / memcpy_throughput`. The ratio comes from
//! a paired run after criterion's: memcpy, put and get batches (64 MiB each)
//! interleaved for 24 rounds, so that load from other processes on a shared
//! machine hits baseline and candidate alike.

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

/// Interleaved rounds of the paired measurement.
const PAIRED_ROUNDS: usize = 24;
/// Bytes per op per round of the paired measurement.
const PAIRED_BATCH_BYTES: usize = 64 << 20;

/// (bytes, nanoseconds) per paired label ("put-1024KiB").
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
            src,
            dst,
            ids: (0..count).map(chunk_id).collect(),
        }
    }

    fn count(&self) -> usize {
        self.src.len()
    }
}

/// The three measured operations over shared pools and caches, each with
/// its own rotating cursor.
struct Bench {
    p: Pools,
    put_cache: RamCache,
    get_cache: RamCache,
    cursors: [usize; 3],
}

const MEMCPY: usize = 0;
const PUT: usize = 1;
const GET: usize = 2;
const OP_NAMES: [&str; 3] = ["memcpy", "put", "get"];

impl Bench {
    fn new(size: usize) -> Self {
        let p = Pools::new(size);
        let count = p.count();
        let put_cache = RamCache::new(PUT_BUDGET);
        // Fill it so every measured put inserts a new id and evicts one
        // (steady state); measured puts start after the filled ids.
        let mut filled = 0;
        while filled < count && put_cache.used_bytes() + size as u64 <= PUT_BUDGET {
            put_cache
                .insert(p.ids[filled], p.src[filled].clone(), None, false)
                .expect("fits");
            filled += 1;
        }
        // Holds every source chunk (shares their memory: no extra GiB).
        let get_cache = RamCache::new(POOL_BYTES as u64);
        for i in 0..count {
            let (_, ev) = get_cache
                .insert(p.ids[i], p.src[i].clone(), None, false)
                .expect("fits");
            assert!(ev.is_empty(), "get cache must hold the whole pool");
        }
        let mut b = Self {
            p,
            put_cache,
            get_cache,
            cursors: [0, filled % count, 0],
        };
        // One full rotation of puts first, so the allocator reaches its
        // steady state (freed copies reused by new ones).
        b.run(PUT, count as u64);
        b
    }

    /// Runs `iters` ops of one kind and returns the time they took.
    fn run(&mut self, op: usize, iters: u64) -> Duration {
        let count = self.p.count();
        let mut i = self.cursors[op];
        let start = Instant::now();
        for _ in 0..iters {
            match op {
                MEMCPY => {
                    self.p.dst[i].copy_from_slice(&self.p.src[i]);
                    black_box(&self.p.dst[i]);
                }
                PUT => {
                    // The node copies out of shared memory into a new buffer.
                    let data = Bytes::copy_from_slice(&self.p.src[i]);
                    let (_, evicted) = self
                        .put_cache
                        .insert(self.p.ids[i], data, None, false)
                        .expect("fits");
                    black_box(evicted);
                }
                _ => {
                    let entry = self
                        .get_cache
                        .get(&self.p.ids[i])
                        .expect("every chunk is cached");
                    self.p.dst[i].copy_from_slice(&entry.data);
                    black_box(&self.p.dst[i]);
                }
            }
            i = (i + 1) % count;
        }
        let elapsed = start.elapsed();
        self.cursors[op] = i;
        elapsed
    }
}

fn bench_size(c: &mut Criterion, size: usize) {
    let kib = size >> 10;
    let mut b = Bench::new(size);
    {
        let mut g = c.benchmark_group(format!("ram-{kib}KiB"));
        g.throughput(Throughput::Bytes(size as u64));
        g.sample_size(10);
        for (op, name) in [
            (MEMCPY, "memcpy-cold"),
            (PUT, "put-copy-in"),
            (GET, "get-copy-out"),
        ] {
            g.bench_function(BenchmarkId::new(name, kib), |bench| {
                bench.iter_custom(|iters| b.run(op, iters))
            });
        }
        g.finish();
    }
    // Paired: the same ops interleaved, rotating which goes first.
    let batch = (PAIRED_BATCH_BYTES / size).max(1) as u64;
    for round in 0..PAIRED_ROUNDS {
        for k in 0..3 {
            let op = (round + k) % 3;
            let e = b.run(op, batch);
            record(
                &format!("{}-{kib}KiB", OP_NAMES[op]),
                batch * size as u64,
                e,
            );
        }
    }
}

/// Entries in the LRU-ops bench.
const LRU_ENTRIES: usize = 1 << 20;
/// Lookups per paired round of the LRU-ops bench.
const LRU_BATCH: usize = 1 << 16;

/// LRU bookkeeping cost alone: `get` (lookup + promote) of random ids in a
/// 1M-entry cache of empty chunks, against `std::collections::HashMap::get`
/// (SipHash, no LRU) over the same ids, in the same run.
fn bench_lru_ops(c: &mut Criterion) {
    let ids: Vec<ChunkId> = (0..LRU_ENTRIES).map(chunk_id).collect();
    let cache = RamCache::new(u64::MAX);
    let mut map = std::collections::HashMap::with_capacity(LRU_ENTRIES);
    for (i, id) in ids.iter().enumerate() {
        cache.insert(*id, Bytes::new(), None, false).expect("fits");
        map.insert(*id, (Bytes::new(), i as u64));
    }
    // A fixed pseudo-random probe order (every probe hits).
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    let order: Vec<usize> = (0..LRU_ENTRIES)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % LRU_ENTRIES as u64) as usize
        })
        .collect();
    let mut cursors = [0usize; 2];
    let mut run = |which: usize, iters: u64| {
        let mut k = cursors[which];
        let start = Instant::now();
        for _ in 0..iters {
            let id = &ids[order[k]];
            if which == 0 {
                black_box(cache.get(id).expect("present"));
            } else {
                black_box(map.get(id).expect("present").clone());
            }
            k = (k + 1) % LRU_ENTRIES;
        }
        cursors[which] = k;
        start.elapsed()
    };
    {
        let mut g = c.benchmark_group("lru-ops-1M");
        g.throughput(Throughput::Elements(1));
        g.bench_function("ramcache-get", |b| b.iter_custom(|n| run(0, n)));
        g.bench_function("std-hashmap-get", |b| b.iter_custom(|n| run(1, n)));
        g.finish();
    }
    for round in 0..PAIRED_ROUNDS {
        for k in 0..2 {
            let which = (round + k) % 2;
            let e = run(which, LRU_BATCH as u64);
            let label = if which == 0 { "lru-get" } else { "std-get" };
            record(label, LRU_BATCH as u64, e);
        }
    }

    // LOOKUP-style batches: 1,024 random ids, half cached, half not.
    const LOOKUP: usize = 1024;
    let batches: Vec<Vec<ChunkId>> = (0..64)
        .map(|b| {
            (0..LOOKUP)
                .map(|j| {
                    let k = order[(b * LOOKUP + j) % LRU_ENTRIES];
                    if j % 2 == 0 {
                        ids[k]
                    } else {
                        chunk_id(LRU_ENTRIES + k)
                    }
                })
                .collect()
        })
        .collect();
    let mut out = Vec::with_capacity(LOOKUP);
    let mut next = 0usize;
    let mut lookup = |which: usize, iters: u64| {
        let start = Instant::now();
        for _ in 0..iters {
            let batch = &batches[next];
            next = (next + 1) % batches.len();
            match which {
                0 => cache.contains_batch(batch, &mut out),
                1 => {
                    out.clear();
                    out.extend(batch.iter().map(|id| cache.contains(id)));
                }
                _ => {
                    out.clear();
                    out.extend(batch.iter().map(|id| map.contains_key(id)));
                }
            }
            black_box(&out);
        }
        start.elapsed()
    };
    {
        let mut g = c.benchmark_group("lookup-1024-in-1M");
        g.throughput(Throughput::Elements(LOOKUP as u64));
        g.bench_function("ramcache-contains-batch", |b| {
            b.iter_custom(|n| lookup(0, n))
        });
        g.bench_function("ramcache-contains-each", |b| {
            b.iter_custom(|n| lookup(1, n))
        });
        g.bench_function("std-hashmap-contains-key", |b| {
            b.iter_custom(|n| lookup(2, n))
        });
        g.finish();
    }
    for round in 0..PAIRED_ROUNDS {
        for k in 0..3 {
            let which = (round + k) % 3;
            let e = lookup(which, 16);
            let label = ["batch-contains", "each-contains", "std-contains"][which];
            record(label, 16, e);
        }
    }
}

/// Chunk sizes in KiB: 256, 1024 and 4096, or the comma-separated list in
/// `KVTIER_BENCH_SIZES_KIB` (empty: none, to run only the LRU groups).
fn sizes() -> Vec<usize> {
    match std::env::var("KVTIER_BENCH_SIZES_KIB") {
        Ok(v) => v
            .split(',')
            .filter(|s| !s.trim().is_empty())
            .map(|s| {
                s.trim()
                    .parse()
                    .expect("KVTIER_BENCH_SIZES_KIB: sizes in KiB")
            })
            .collect(),
        Err(_) => vec![256, 1024, 4096],
    }
}

fn summary() {
    let t = TOTALS.lock().expect("totals lock");
    let gbps = |label: &str| {
        t.get(label)
            .filter(|v| v.1 > 0)
            .map(|v| v.0 as f64 / v.1 as f64)
    };
    eprintln!(
        "\n=== tier RAM summary (cold: rotating through 1 GiB; paired, {PAIRED_ROUNDS} interleaved rounds of 64 MiB per op; GB/s = bytes per ns) ==="
    );
    if let (Some(k), Some(m)) = (gbps("lru-get"), gbps("std-get")) {
        eprintln!(
            "LRU get, 1M entries: kvtier {:.0} ns/op, std HashMap (SipHash, no LRU) {:.0} ns/op, ratio = kvtier_throughput / hashmap_throughput = {:.3}",
            1.0 / k,
            1.0 / m,
            k / m
        );
    }
    if let (Some(b), Some(e), Some(m)) = (
        gbps("batch-contains"),
        gbps("each-contains"),
        gbps("std-contains"),
    ) {
        eprintln!(
            "LOOKUP 1,024 ids (half hits) in 1M entries: contains_batch {:.1} us, contains each {:.1} us, std HashMap {:.1} us per batch; ratio = kvtier_throughput / hashmap_throughput = {:.3} (batch), {:.3} (each)",
            1e-3 / b,
            1e-3 / e,
            1e-3 / m,
            b / m,
            e / m
        );
    }
    for kib in sizes() {
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
    bench_lru_ops(&mut c);
    for kib in sizes() {
        bench_size(&mut c, kib << 10);
    }
    c.final_summary();
    summary();
}
