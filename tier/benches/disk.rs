//! Disk write and read throughput of the store against raw `O_DIRECT`
//! sequential I/O of the same bytes on the same filesystem, measured in the
//! same run, interleaved (baseline, store, baseline, store, ...), medians.
//! Chunks of 64 KiB, 1 MiB and 4 MiB: the 64 KiB rows show what the store
//! pays per chunk (a write job, a record header, an index entry) where the
//! bytes are few.
//!
//! - write: `put` N chunks + `flush()` (durable) vs `pwrite` of the same
//!   bytes with the store's write size (4 MiB batches), queue depth 1, then
//!   `fdatasync`; twice, in the two states a store's file is in: its first
//!   fill (a new store vs a new file preallocated with `fallocate`, whose
//!   extents the filesystem converts from "unwritten" on each first write)
//!   and its steady state (a store that has filled its budget once, writing
//!   into reclaimed regions, vs overwriting the same file);
//! - read: `get` of every chunk from disk (RAM holds none of them,
//!   `promote-on-read` off) vs `pread` of chunk-record-sized blocks (payload
//!   and header, block aligned), queue depth 1. Under it, diagnostics: the
//!   share of the store's read time spent in disk reads (and their speed),
//!   raw `pread`s at the store's own record offsets (is the layout slower
//!   to read?), and the read strategies interleaved on one file: plain
//!   `pread`, `pread` then CRC32C (the store before split reads), and the
//!   split read with the CRC of each piece as it lands (the store now).
//!
//! Each raw baseline is also run from (into) 64 buffers in turn instead of
//! one, colder than the CPU caches (see `raw_bufs`): how much of a gap is
//! the baseline's buffer staying in cache.
//!
//! Data lives under the target dir (not /tmp, which may be tmpfs); at most
//! ~1.5 GiB on disk. Run: `cargo bench -p kvtier-tier --bench disk`
//! (`KVTIER_BENCH_REGION_MIB=N` for regions of N MiB instead of the default,
//! `KVTIER_BENCH_PACK_THREADS=N` for N CRC/copy helper threads).

use std::fs::OpenOptions;
use std::hint::black_box;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::Criterion;
use tier::device::{AlignedBuf, BLOCK, Device, DirectMode, FileDevice, block_up};
use tier::{ChunkId, ChunkKey, ChunkStore, NamespaceRecord, TierConfig, WritePolicy};

const MIB: u64 = 1 << 20;
const TOTAL: u64 = 512 * MIB;
const REPS: usize = 3;

/// "64 KiB", "1 MiB": a chunk size as the results name it.
fn size_name(chunk: usize) -> String {
    if chunk >= MIB as usize {
        format!("{} MiB", chunk >> 20)
    } else {
        format!("{} KiB", chunk >> 10)
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).expect("no NaN"));
    v[v.len() / 2]
}

/// Raw `O_DIRECT` writes of `total` bytes in `block`-sized writes, then
/// `fdatasync`: GB/s. `fresh`: into a new file preallocated with
/// `fallocate`, as a new store's file is (on ext4 and XFS its extents are
/// "unwritten" until first written, and each first write converts them);
/// else over the bytes of the existing file, as a store that has filled its
/// budget once writes (reclaimed regions).
fn raw_write(path: &Path, bufs: &[AlignedBuf], block: usize, total: u64, fresh: bool) -> f64 {
    if fresh {
        let _ = std::fs::remove_file(path);
    }
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(fresh)
        .truncate(false)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .expect("O_DIRECT open (the bench needs a filesystem that supports it)");
    if fresh {
        // SAFETY: plain syscall on a valid fd.
        let rc = unsafe { libc::fallocate(f.as_raw_fd(), 0, 0, (total + 64 * MIB) as i64) };
        assert_eq!(rc, 0, "fallocate: {}", std::io::Error::last_os_error());
    }
    let t = Instant::now();
    let mut off = 0;
    for buf in bufs.iter().cycle() {
        if off >= total {
            break;
        }
        f.write_all_at(&buf[..block], off).expect("write");
        off += block as u64;
    }
    f.sync_data().expect("sync");
    total as f64 / t.elapsed().as_secs_f64() / 1e9
}

/// One timed write phase of the store: `put` + `flush`, and where the time
/// went (from the store's own counters).
struct StoreWrite {
    gbps: f64,
    /// Share of the time the I/O thread spent in batch writes ...
    in_writes: f64,
    /// ... at this speed.
    write_gbps: f64,
    /// Share of the time in fdatasyncs, and how many.
    in_syncs: f64,
    syncs: f64,
    /// Mean batch write, bytes.
    batch: f64,
}

fn store_write(s: &ChunkStore, ids: &[ChunkId], payloads: &[Bytes]) -> StoreWrite {
    let before = s.stats();
    let t = Instant::now();
    let mut bytes = 0;
    for (i, id) in ids.iter().enumerate() {
        let p = &payloads[i % payloads.len()];
        bytes += p.len();
        s.put(*id, p.clone()).expect("put");
    }
    s.flush().expect("flush");
    let secs = t.elapsed().as_secs_f64();
    let after = s.stats();
    let write_us = (after.disk_write_micros - before.disk_write_micros) as f64;
    StoreWrite {
        gbps: bytes as f64 / secs / 1e9,
        in_writes: write_us / 1e6 / secs,
        write_gbps: (after.disk_write_bytes - before.disk_write_bytes) as f64 / write_us / 1e3,
        in_syncs: (after.disk_sync_micros - before.disk_sync_micros) as f64 / 1e6 / secs,
        syncs: (after.disk_syncs - before.disk_syncs) as f64,
        batch: (after.disk_write_bytes - before.disk_write_bytes) as f64
            / (after.disk_batch_writes - before.disk_batch_writes).max(1) as f64,
    }
}

/// Prints one write comparison (medians over the reps).
fn report_write(
    what: &str,
    chunk: usize,
    raw: Vec<f64>,
    cold: Vec<f64>,
    store: &[StoreWrite],
    direct: bool,
) {
    let pick = |f: fn(&StoreWrite) -> f64| median(store.iter().map(f).collect());
    let (wr, ws) = (median(raw), pick(|w| w.gbps));
    println!(
        "RESULT disk write {} chunks, {what}: store {ws:.2} GB/s vs raw O_DIRECT 4 MiB qd1 {wr:.2} GB/s = {:.2}x (direct_io={direct}, {} MiB regions, pack threads {})",
        size_name(chunk),
        ws / wr,
        region_mib(),
        pack_threads().map_or("default".to_string(), |n| n.to_string()),
    );
    let (tw, ts) = (pick(|w| w.in_writes), pick(|w| w.in_syncs));
    println!(
        "  store time: {:.0}% in batch writes (at {:.2} GB/s, {:.0} KiB each), {:.0}% in {} fdatasyncs, {:.0}% with the device idle",
        tw * 100.0,
        pick(|w| w.write_gbps),
        pick(|w| w.batch) / 1024.0,
        ts * 100.0,
        pick(|w| w.syncs),
        (1.0 - tw - ts) * 100.0,
    );
    let wc = median(cold);
    println!(
        "  raw from {COLD_BUFS} buffers in turn (colder than the CPU caches): {wc:.2} GB/s; store = {:.2}x of it",
        ws / wc
    );
}

/// `O_DIRECT` `pread` of the blocks covering each `(offset, length)`
/// record, in the order given (at the store's record offsets: the store's
/// reads without the store), queue depth 1: GB/s of those blocks.
fn raw_read_at(path: &Path, bufs: &mut [AlignedBuf], records: &[(u64, u64)]) -> f64 {
    let f = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .expect("open");
    let span = |&(off, len): &(u64, u64)| {
        let first = off / BLOCK * BLOCK;
        (first, block_up(off + len) - first)
    };
    let n = bufs.len();
    let (t, mut bytes) = (Instant::now(), 0);
    for (i, r) in records.iter().enumerate() {
        let (first, len) = span(r);
        let buf = &mut bufs[i % n];
        f.read_exact_at(&mut buf[..len as usize], first)
            .expect("read");
        black_box(&buf[..8]);
        bytes += len;
    }
    bytes as f64 / t.elapsed().as_secs_f64() / 1e9
}

/// The read strategies side by side on the same file, interleaved in
/// groups of 8 consecutive records (so drift of the device's speed hits
/// all alike): plain `pread`; `pread` then CRC32C of the whole record (the
/// store before split reads); the device's split read with the CRC of each
/// piece as it lands (the store now). GB/s of each.
fn read_strategies(path: &Path, block: usize, count: u64, stride: u64) -> [f64; 3] {
    let len = std::fs::metadata(path).expect("raw file").len();
    let dev = FileDevice::open(path, len, DirectMode::Auto, 0).expect("open raw");
    let mut buf = AlignedBuf::zeroed(block);
    let mut secs = [0f64; 3];
    let mut bytes = [0u64; 3];
    for g in 0..count / 8 {
        let mode = (g % 3) as usize;
        let t = Instant::now();
        for i in g * 8..g * 8 + 8 {
            let off = i * stride;
            match mode {
                0 => dev.read_at(&mut buf, off).expect("read"),
                1 => {
                    dev.read_at(&mut buf, off).expect("read");
                    black_box(tier::format::crc32c(&buf));
                }
                _ => {
                    let mut crc = tier::format::Crc32c::default();
                    dev.read_at_in_order(&mut buf, off, &mut |p: &[u8]| crc.update(p))
                        .expect("read");
                    black_box(crc.value());
                }
            }
        }
        secs[mode] += t.elapsed().as_secs_f64();
        bytes[mode] += 8 * block as u64;
    }
    [0, 1, 2].map(|m| bytes[m] as f64 / secs[m] / 1e9)
}

/// `pread` of `count` blocks of `block` bytes, `stride` apart: GB/s.
fn raw_read(path: &Path, bufs: &mut [AlignedBuf], block: usize, count: u64, stride: u64) -> f64 {
    let records: Vec<(u64, u64)> = (0..count).map(|i| (i * stride, block as u64)).collect();
    raw_read_at(path, bufs, &records)
}

/// Buffers the raw baselines write from and read into, each of `len`
/// bytes with contents of its own: one (the baseline: the same buffer
/// every time, so it stays in the CPU caches), or [`COLD_BUFS`] in turn,
/// more than the CPU caches hold (a diagnostic row: on the virtio disks
/// measured here a raw write from, or read into, a cache-warm buffer is
/// 15–20 % faster; docs/benchmarks.md "Session 31"). The store's batch
/// buffers were just packed and its read buffer is recycled, so neither
/// row is its exact case; the first is the target's baseline.
fn raw_bufs(n: usize, len: usize) -> Vec<AlignedBuf> {
    (0..n)
        .map(|k| {
            let mut b = AlignedBuf::zeroed(len);
            b.iter_mut()
                .enumerate()
                .for_each(|(i, x)| *x = (i as u8).wrapping_add(k as u8));
            b
        })
        .collect()
}

/// How many buffers the cold raw rows rotate through (of up to 4 MiB + 4
/// KiB each: 256 MiB and more).
const COLD_BUFS: usize = 64;

/// Region size of the bench stores: `KVTIER_BENCH_REGION_MIB`, else the
/// store's default. Each full region costs a seal (summary + fdatasyncs)
/// and the tail that no whole record fits.
fn region_mib() -> u64 {
    std::env::var("KVTIER_BENCH_REGION_MIB").map_or(TierConfig::default().region_size >> 20, |v| {
        v.parse().expect("KVTIER_BENCH_REGION_MIB: a size in MiB")
    })
}

/// `KVTIER_BENCH_PACK_THREADS=N`: CRC/copy helper threads (default: the
/// store's, a quarter of the cores, at most 3).
fn pack_threads() -> Option<usize> {
    std::env::var("KVTIER_BENCH_PACK_THREADS").ok().map(|v| {
        v.parse()
            .expect("KVTIER_BENCH_PACK_THREADS: a thread count")
    })
}

fn bench(_c: &mut Criterion) {
    let root = Path::new(env!("CARGO_TARGET_TMPDIR")).join("kvtier-disk-bench");
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).expect("bench dir");
    for chunk in [64 << 10, MIB as usize, 4 * MIB as usize] {
        let n = TOTAL / chunk as u64;
        let cfg = TierConfig {
            data_dir: root.join(format!("store-{chunk}")),
            ram_budget: 64 * MIB,
            disk_budget: TOTAL + 256 * MIB,
            region_size: region_mib() * MIB,
            write_policy: WritePolicy::Backpressure,
            promote_on_read: false,
            idle_flush_after: Duration::from_secs(3600),
            pack_threads: pack_threads(),
            ..TierConfig::default()
        };
        let payloads: Vec<Bytes> = (0..8u8)
            .map(|i| Bytes::from(vec![i.wrapping_mul(31) | 1; chunk]))
            .collect();
        let raw = root.join(format!("raw-{chunk}"));
        let (mut raw_fresh, mut raw_over, mut rd_raw, mut rd_store) =
            (vec![], vec![], vec![], vec![]);
        let (mut fresh, mut steady, mut rd_split_time, mut rd_at_store) =
            (vec![], vec![], vec![], vec![]);
        let (mut cold_fresh, mut cold_over, mut rd_cold) = (vec![], vec![], vec![]);
        let record = (chunk as u64 + 128).next_multiple_of(4096);
        // A record's blocks: at most one block past its rounded length
        // (a record starts 64-byte aligned, not block aligned).
        let big = (4 * MIB).max(record + BLOCK) as usize;
        let mut hot = raw_bufs(1, big);
        let mut cold = raw_bufs(COLD_BUFS, big);
        let mut strategies = vec![];
        let mut direct = false;
        for rep in 0..REPS {
            let _ = std::fs::remove_dir_all(&cfg.data_dir);
            let s = ChunkStore::open(cfg.clone()).expect("open");
            direct = s.stats().direct_io;
            let ns = s
                .register_namespace(&NamespaceRecord {
                    model: "bench".into(),
                    ..Default::default()
                })
                .expect("ns");
            let ids = |phase: u64| -> Vec<ChunkId> {
                (0..n)
                    .map(|i| {
                        let mut k = [0u8; 32];
                        k[..8].copy_from_slice(&(i + (rep as u64 * 3 + phase) * n).to_le_bytes());
                        k[8] = 1;
                        ChunkId::new(ns, ChunkKey(k), 0)
                    })
                    .collect()
            };
            // First fill: a new store, a new preallocated raw file.
            raw_fresh.push(raw_write(&raw, &hot, 4 * MIB as usize, TOTAL, true));
            cold_fresh.push(raw_write(&raw, &cold, 4 * MIB as usize, TOTAL, true));
            fresh.push(store_write(&s, &ids(0), &payloads));
            // Fill the rest of the budget (untimed), so the timed writes
            // that follow all land in reclaimed regions.
            store_write(&s, &ids(1), &payloads);
            raw_over.push(raw_write(&raw, &hot, 4 * MIB as usize, TOTAL, false));
            cold_over.push(raw_write(&raw, &cold, 4 * MIB as usize, TOTAL, false));
            let last = ids(2);
            steady.push(store_write(&s, &last, &payloads));
            // Reads: drop RAM by reopening (promote off keeps RAM empty).
            drop(s);
            let s = ChunkStore::open(cfg.clone()).expect("reopen");
            // Only blocks the raw writes wrote (audit: n - 1 records of
            // 68 KiB at 64 KiB chunks ran 6 % past the written 512 MiB,
            // into preallocated blocks that read about 100x faster).
            let rd_n = (n - 1).min(TOTAL / record);
            rd_raw.push(raw_read(&raw, &mut hot, record as usize, rd_n, record));
            rd_cold.push(raw_read(&raw, &mut cold, record as usize, rd_n, record));
            strategies.push(read_strategies(&raw, record as usize, rd_n, record));
            let before = s.stats();
            let t = Instant::now();
            let mut bytes = 0;
            for id in &last {
                bytes += s.get(id).expect("disk hit").data.len();
            }
            let secs = t.elapsed().as_secs_f64();
            rd_store.push(bytes as f64 / secs / 1e9);
            let after = s.stats();
            let records: Vec<(u64, u64)> = last
                .iter()
                .map(|id| {
                    let (_, off, len) = s.disk_location(id).expect("on disk");
                    (off, len)
                })
                .collect();
            drop(s);
            rd_at_store.push(raw_read_at(
                &cfg.data_dir.join("store.kvt"),
                &mut hot,
                &records,
            ));
            let read_us = (after.disk_read_micros - before.disk_read_micros) as f64;
            rd_split_time.push((
                read_us / 1e6 / secs,
                (after.disk_read_bytes - before.disk_read_bytes) as f64 / read_us / 1e3,
            ));
            assert_eq!(after.verify_failures, 0);
        }
        report_write(
            "first fill (vs a new fallocated file)",
            chunk,
            raw_fresh,
            cold_fresh,
            &fresh,
            direct,
        );
        report_write(
            "steady state (reclaimed regions, vs overwriting a file)",
            chunk,
            raw_over,
            cold_over,
            &steady,
            direct,
        );
        let (rr, rs) = (median(rd_raw), median(rd_store));
        println!(
            "RESULT disk read  {} chunks: store {rs:.2} GB/s vs raw O_DIRECT {} KiB qd1 {rr:.2} GB/s = {:.2}x",
            size_name(chunk),
            (chunk as u64 + 128).next_multiple_of(4096) >> 10,
            rs / rr
        );
        let rc = median(rd_cold);
        println!(
            "  raw into {COLD_BUFS} buffers in turn (colder than the CPU caches): {rc:.2} GB/s; store = {:.2}x of it",
            rs / rc
        );
        let ra = median(rd_at_store);
        println!(
            "  raw pread of the store file at the store's record offsets: {ra:.2} GB/s = {:.2}x of raw qd1",
            ra / rr
        );
        let st = |m: usize| median(strategies.iter().map(|s| s[m]).collect());
        println!(
            "  read strategies interleaved on the raw file: pread {:.2} GB/s; pread then CRC {:.2} GB/s = {:.2}x; split read, CRC per piece {:.2} GB/s = {:.2}x",
            st(0),
            st(1),
            st(1) / st(0),
            st(2),
            st(2) / st(0)
        );
        rd_split_time.sort_by(|a, b| a.0.partial_cmp(&b.0).expect("no NaN"));
        let (share, gbps) = rd_split_time[rd_split_time.len() / 2];
        println!(
            "  store time (median run): {:.0}% in disk reads (at {gbps:.2} GB/s), {:.0}% elsewhere",
            share * 100.0,
            (1.0 - share) * 100.0
        );
    }
    let _ = std::fs::remove_dir_all(&root);
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    bench(&mut c);
    c.final_summary();
}
