//! Side-by-side benchmark: kvtier's `tier::ChunkStore` against foyer's
//! `HybridCache`, same RAM budget, same disk budget, same filesystem, same
//! chunk sizes and the same single-client workload:
//!
//! 1. PUT N chunks (N × size > RAM budget, so both spill to disk),
//! 2. GET all of them, newest first (RAM hits, then disk hits), every byte
//!    compared,
//! 3. close (both flush RAM to disk on close) and reopen on the same files,
//! 4. GET all again after the restart: hits counted, every byte compared,
//! 5. throughput per phase and the recovery time, with kvtier/foyer ratios.
//!
//! Usage: `cargo run --release --locked --manifest-path
//! benches/foyer-compare/Cargo.toml -- [--quick] [--defaults] [--dir DIR]`.
//! `--defaults` keeps each store's default overload policy (both drop
//! chunks the disk writer cannot take) instead of "no drops".
//! `DIR` (default: this package's `target/bench-data`) must be on a real
//! filesystem, not tmpfs: both stores use O_DIRECT there.
//!
//! Timings cover the store calls only; generating and comparing the bytes
//! is done outside the timed sections.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use bytes::Bytes;
use foyer::{
    BlockEngineConfig, DeviceBuilder, FsDeviceBuilder, HybridCache, HybridCacheBuilder,
    HybridCachePolicy, PsyncIoEngineConfig, RecoverMode, Source,
};
use tier::{ChunkId, ChunkKey, ChunkStore, NamespaceRecord, Tier, TierConfig, WritePolicy};

/// Budgets and sizes of one run.
#[derive(Clone, Copy, Debug)]
struct Sizes {
    ram_budget: u64,
    disk_budget: u64,
    /// Payload bytes written per chunk size.
    data: u64,
    /// kvtier region size = foyer block size.
    region: u64,
    /// Each store's default overload policy (both drop what the disk
    /// writer cannot take) instead of "every evicted chunk reaches disk".
    defaults: bool,
}

const CHUNK_SIZES: [u64; 3] = [256 << 10, 1 << 20, 4 << 20];

/// Figures of one store for one chunk size.
#[derive(Clone, Debug, Default)]
struct Figures {
    put: Duration,
    get: Duration,
    get_ram_hits: u64,
    get_disk_hits: u64,
    get_misses: u64,
    close: Duration,
    reopen: Duration,
    get_after: Duration,
    after_hits: u64,
    after_misses: u64,
    bad_bytes: u64,
    note: String,
}

fn main() {
    let mut quick = false;
    let mut defaults = false;
    let mut dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/bench-data");
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--quick" => quick = true,
            "--defaults" => defaults = true,
            "--dir" => match args.next() {
                Some(d) => dir = PathBuf::from(d),
                None => fail("--dir needs a path"),
            },
            other => fail(&format!(
                "unknown argument {other:?}; usage: [--quick] [--defaults] [--dir DIR]"
            )),
        }
    }
    let sizes = if quick {
        Sizes {
            ram_budget: 32 << 20,
            disk_budget: 256 << 20,
            data: 128 << 20,
            region: 16 << 20,
            defaults,
        }
    } else {
        Sizes {
            ram_budget: 128 << 20,
            disk_budget: 1 << 30,
            data: 512 << 20,
            region: 16 << 20,
            defaults,
        }
    };
    if let Err(e) = std::fs::create_dir_all(&dir) {
        fail(&format!("creating {}: {e}", dir.display()));
    }
    println!(
        "kvtier tier::ChunkStore vs foyer 0.22.6 HybridCache: ram budget {} MiB, disk budget {} MiB, \
         {} MiB written per chunk size, region/block {} MiB, data under {}; overload policy: {}",
        sizes.ram_budget >> 20,
        sizes.disk_budget >> 20,
        sizes.data >> 20,
        sizes.region >> 20,
        dir.display(),
        if sizes.defaults {
            "each store's default (drops what the disk writer cannot take)"
        } else {
            "no drops (kvtier Backpressure; foyer queue and buffer pool sized to the data)"
        }
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap_or_else(|e| fail(&format!("tokio runtime: {e}")));

    let mut rows = Vec::new();
    for &chunk in &CHUNK_SIZES {
        let n = sizes.data / chunk;
        let chunks: Vec<Bytes> = (0..n).map(|i| make_chunk(i, chunk)).collect();
        let kv = run_kvtier(&dir, sizes, &chunks);
        let fo = rt.block_on(run_foyer(&dir, sizes, &chunks));
        rows.push((chunk, n, kv, fo));
    }
    print_table(&rows);
}

fn fail(msg: &str) -> ! {
    eprintln!("foyer-compare: {msg}");
    std::process::exit(2)
}

/// Chunk `i`: splitmix64 stream seeded by `i` (distinct per chunk).
fn make_chunk(i: u64, len: u64) -> Bytes {
    let mut v = Vec::with_capacity(len as usize);
    let mut s = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
    while (v.len() as u64) < len {
        s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        v.extend_from_slice(&z.to_le_bytes());
    }
    v.truncate(len as usize);
    Bytes::from(v)
}

fn fresh_dir(base: &Path, name: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(name)
        .tempdir_in(base)
        .unwrap_or_else(|e| fail(&format!("tempdir in {}: {e}", base.display())))
}

fn kv_id(ns: tier::Namespace, i: u64) -> ChunkId {
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&i.to_le_bytes());
    ChunkId::new(ns, ChunkKey(key), 0)
}

fn run_kvtier(base: &Path, sizes: Sizes, chunks: &[Bytes]) -> Figures {
    let dir = fresh_dir(base, "kvtier-");
    let config = TierConfig {
        data_dir: dir.path().to_path_buf(),
        ram_budget: sizes.ram_budget,
        disk_budget: sizes.disk_budget,
        region_size: sizes.region,
        // Every evicted chunk reaches disk (the default, no-tax, drops
        // what the writer cannot take; foyer is configured to match).
        write_policy: if sizes.defaults {
            WritePolicy::NoTax
        } else {
            WritePolicy::Backpressure
        },
        ..TierConfig::default()
    };
    let record = NamespaceRecord {
        model: "foyer-compare".into(),
        ..NamespaceRecord::default()
    };
    let mut f = Figures::default();
    let store =
        ChunkStore::open(config.clone()).unwrap_or_else(|e| fail(&format!("kvtier open: {e}")));
    let ns = store
        .register_namespace(&record)
        .unwrap_or_else(|e| fail(&format!("kvtier register_namespace: {e}")));

    let t = Instant::now();
    for (i, c) in chunks.iter().enumerate() {
        store
            .put(kv_id(ns, i as u64), c.clone())
            .unwrap_or_else(|e| fail(&format!("kvtier put: {e}")));
    }
    // The PUT phase ends when every spilled chunk is on disk (foyer: its
    // `wait()` for the flushers). Polled: the store has no wait call.
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let s = store.stats();
        let settled = s.writer_queue_depth == 0
            && s.disk_chunks + s.ram_chunks + s.dropped_unwritten + s.disk_write_failures
                >= chunks.len() as u64;
        if settled {
            if s.dropped_unwritten + s.disk_write_failures != 0 {
                f.note = format!(
                    "{} dropped unwritten, {} write failures during PUT",
                    s.dropped_unwritten, s.disk_write_failures
                );
            }
            break;
        }
        if Instant::now() > deadline {
            f.note = "spill writes not settled after 120 s".into();
            break;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    f.put = t.elapsed();

    // Newest first: the RAM-resident tail hits RAM, the rest comes from
    // disk (in PUT order, an LRU scan would evict each chunk just before
    // its read and every read would go to disk).
    for (i, c) in chunks.iter().enumerate().rev() {
        let t = Instant::now();
        let hit = store.get(&kv_id(ns, i as u64));
        f.get += t.elapsed();
        match hit {
            Some(h) => {
                match h.tier {
                    Tier::Ram => f.get_ram_hits += 1,
                    Tier::Disk => f.get_disk_hits += 1,
                }
                if h.data != *c {
                    f.bad_bytes += 1;
                }
            }
            None => f.get_misses += 1,
        }
    }

    let t = Instant::now();
    let report = store
        .close(Duration::from_secs(60))
        .unwrap_or_else(|e| fail(&format!("kvtier close: {e}")));
    f.close = t.elapsed();
    if report.failed != 0 {
        f.note.push_str(&format!(
            " {} chunks failed to flush on close",
            report.failed
        ));
    }
    drop(store);

    let t = Instant::now();
    let store = ChunkStore::open(config).unwrap_or_else(|e| fail(&format!("kvtier reopen: {e}")));
    f.reopen = t.elapsed();
    let ns2 = store
        .register_namespace(&record)
        .unwrap_or_else(|e| fail(&format!("kvtier register_namespace: {e}")));
    assert_eq!(ns, ns2, "namespace id is a hash of the record");

    for (i, c) in chunks.iter().enumerate() {
        let t = Instant::now();
        let hit = store.get(&kv_id(ns, i as u64));
        f.get_after += t.elapsed();
        match hit {
            Some(h) => {
                f.after_hits += 1;
                if h.data != *c {
                    f.bad_bytes += 1;
                }
            }
            None => f.after_misses += 1,
        }
    }
    let _ = store.close(Duration::from_secs(60));
    f
}

type Foyer = HybridCache<u64, Bytes>;

async fn build_foyer(dir: &Path, sizes: Sizes) -> (Foyer, String) {
    // O_DIRECT like kvtier on the same filesystem; fall back to buffered
    // I/O (and say so) where the filesystem refuses it.
    for direct in [true, false] {
        let device = match FsDeviceBuilder::new(dir)
            .with_capacity(sizes.disk_budget as usize)
            .with_direct(direct)
            .build()
        {
            Ok(d) => d,
            Err(e) if direct => {
                eprintln!("foyer: O_DIRECT device refused ({e}); using buffered I/O");
                continue;
            }
            Err(e) => fail(&format!("foyer device: {e}")),
        };
        let mut engine = BlockEngineConfig::new(device).with_block_size(sizes.region as usize);
        if !sizes.defaults {
            engine = engine
                // Default 32 MiB: entries evicted past it are dropped,
                // never written. Raised so every evicted entry reaches
                // disk, like kvtier under `Backpressure`.
                .with_submit_queue_size_threshold((sizes.data + sizes.ram_budget) as usize)
                // Default 16 MiB: an entry that does not fit the
                // flusher's buffer is dropped too. Sized to the whole
                // data set (extra RAM kvtier does not use).
                .with_buffer_pool_size(sizes.data as usize);
        }
        let built = HybridCacheBuilder::new()
            .with_name("foyer-compare")
            .with_policy(HybridCachePolicy::WriteOnEviction)
            .with_flush_on_close(true)
            .memory(sizes.ram_budget as usize)
            .with_weighter(|_k: &u64, v: &Bytes| v.len())
            .storage()
            .with_io_engine_config(PsyncIoEngineConfig::new())
            .with_recover_mode(RecoverMode::Quiet)
            .with_engine_config(engine)
            .build()
            .await;
        match built {
            Ok(c) => {
                let mode = if direct { "O_DIRECT" } else { "buffered" };
                return (c, mode.to_string());
            }
            Err(e) if direct => {
                eprintln!("foyer: build with O_DIRECT failed ({e}); using buffered I/O");
            }
            Err(e) => fail(&format!("foyer build: {e}")),
        }
    }
    unreachable!("the buffered attempt either returns or fails")
}

async fn run_foyer(base: &Path, sizes: Sizes, chunks: &[Bytes]) -> Figures {
    let dir = fresh_dir(base, "foyer-");
    let mut f = Figures::default();
    let (cache, mode) = build_foyer(dir.path(), sizes).await;

    let t = Instant::now();
    for (i, c) in chunks.iter().enumerate() {
        cache.insert(i as u64, c.clone());
    }
    cache.storage().wait().await;
    f.put = t.elapsed();

    // Newest first, as for kvtier.
    for (i, c) in chunks.iter().enumerate().rev() {
        let t = Instant::now();
        let hit = cache.get(&(i as u64)).await;
        f.get += t.elapsed();
        match hit {
            Ok(Some(e)) => {
                match e.source() {
                    Source::Disk => f.get_disk_hits += 1,
                    _ => f.get_ram_hits += 1,
                }
                if *e.value() != *c {
                    f.bad_bytes += 1;
                }
            }
            Ok(None) => f.get_misses += 1,
            Err(e) => fail(&format!("foyer get: {e}")),
        }
    }

    let t = Instant::now();
    cache
        .close()
        .await
        .unwrap_or_else(|e| fail(&format!("foyer close: {e}")));
    f.close = t.elapsed();
    drop(cache);

    let t = Instant::now();
    let (cache, _) = build_foyer(dir.path(), sizes).await;
    f.reopen = t.elapsed();

    for (i, c) in chunks.iter().enumerate() {
        let t = Instant::now();
        let hit = cache.get(&(i as u64)).await;
        f.get_after += t.elapsed();
        match hit {
            Ok(Some(e)) => {
                f.after_hits += 1;
                if *e.value() != *c {
                    f.bad_bytes += 1;
                }
            }
            Ok(None) => f.after_misses += 1,
            Err(e) => fail(&format!("foyer get after reopen: {e}")),
        }
    }
    let _ = cache.close().await;
    f.note = mode;
    f
}

fn gbps(bytes: u64, d: Duration) -> f64 {
    if d.is_zero() {
        return f64::INFINITY;
    }
    bytes as f64 / d.as_secs_f64() / 1e9
}

fn ratio(a: f64, b: f64) -> String {
    if b == 0.0 || !a.is_finite() || !b.is_finite() {
        "-".into()
    } else {
        format!("{:.2}×", a / b)
    }
}

fn print_table(rows: &[(u64, u64, Figures, Figures)]) {
    println!();
    println!("| chunk | n | phase | kvtier | foyer | kvtier/foyer |\n|---|---|---|---|---|---|");
    for (chunk, n, kv, fo) in rows {
        let bytes = chunk * n;
        let size = if *chunk >= 1 << 20 {
            format!("{} MiB", chunk >> 20)
        } else {
            format!("{} KiB", chunk >> 10)
        };
        let tp = |name: &str, a: Duration, b: Duration| {
            let (x, y) = (gbps(bytes, a), gbps(bytes, b));
            println!(
                "| {size} | {n} | {name} GB/s | {x:.2} | {y:.2} | {} |",
                ratio(x, y)
            );
        };
        tp("put (until spilled)", kv.put, fo.put);
        tp("get", kv.get, fo.get);
        println!(
            "| {size} | {n} | get hits ram/disk/miss | {}/{}/{} | {}/{}/{} | |",
            kv.get_ram_hits,
            kv.get_disk_hits,
            kv.get_misses,
            fo.get_ram_hits,
            fo.get_disk_hits,
            fo.get_misses
        );
        let ms = |name: &str, a: Duration, b: Duration| {
            let (x, y) = (a.as_secs_f64() * 1e3, b.as_secs_f64() * 1e3);
            // Times: lower is better, so a ratio < 1 favours kvtier.
            println!(
                "| {size} | {n} | {name} ms | {x:.1} | {y:.1} | {} |",
                ratio(x, y)
            );
        };
        ms("close (flush)", kv.close, fo.close);
        ms("reopen (recovery)", kv.reopen, fo.reopen);
        tp("get after restart", kv.get_after, fo.get_after);
        println!(
            "| {size} | {n} | hits after restart | {}/{n} | {}/{n} | |",
            kv.after_hits, fo.after_hits
        );
        println!(
            "| {size} | {n} | wrong bytes | {} | {} | |",
            kv.bad_bytes, fo.bad_bytes
        );
        if !kv.note.is_empty() {
            println!("kvtier {size}: {}", kv.note);
        }
        println!("foyer {size}: device I/O {}", fo.note);
    }
    println!(
        "\nGB/s = payload bytes / time in the store calls (1e9 bytes); ratios > 1 favour kvtier for GB/s, \
         < 1 favour kvtier for ms."
    );
}
