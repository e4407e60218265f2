//! Disk write and read throughput of the store against raw `O_DIRECT`
//! sequential I/O of the same bytes on the same filesystem, measured in the
//! same run, interleaved (baseline, store, baseline, store, ...), medians.
//!
//! - write: `put` N chunks + `flush()` (durable) vs `pwrite` of the same
//!   bytes with the store's write size (4 MiB batches), queue depth 1, then
//!   `fdatasync`;
//! - read: `get` of every chunk from disk (RAM holds none of them,
//!   `promote-on-read` off) vs `pread` of chunk-record-sized blocks (payload
//!   + header, block aligned), queue depth 1.
//!
//! Data lives under the target dir (not /tmp, which may be tmpfs); at most
//! ~1.5 GiB on disk. Run: `cargo bench -p kvtier-tier --bench disk`
//! (`KVTIER_BENCH_REGION_MIB=N` for regions of N MiB instead of 64).

use std::fs::OpenOptions;
use std::hint::black_box;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::Criterion;
use tier::device::AlignedBuf;
use tier::{ChunkId, ChunkKey, ChunkStore, NamespaceRecord, TierConfig, WritePolicy};

const MIB: u64 = 1 << 20;
const TOTAL: u64 = 512 * MIB;
const REPS: usize = 3;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).expect("no NaN"));
    v[v.len() / 2]
}

fn raw_write(path: &Path, block: usize, total: u64) -> f64 {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .expect("O_DIRECT open (the bench needs a filesystem that supports it)");
    f.set_len(total + 64 * MIB).expect("size");
    let mut buf = AlignedBuf::zeroed(block);
    buf.iter_mut().enumerate().for_each(|(i, b)| *b = i as u8);
    let t = Instant::now();
    let mut off = 0;
    while off < total {
        f.write_all_at(&buf, off).expect("write");
        off += block as u64;
    }
    f.sync_data().expect("sync");
    total as f64 / t.elapsed().as_secs_f64() / 1e9
}

fn raw_read(path: &Path, block: usize, count: u64, stride: u64) -> f64 {
    let f = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .expect("open");
    let mut buf = AlignedBuf::zeroed(block);
    let t = Instant::now();
    for i in 0..count {
        f.read_exact_at(&mut buf, i * stride).expect("read");
        black_box(&buf[..8]);
    }
    (count * block as u64) as f64 / t.elapsed().as_secs_f64() / 1e9
}

/// Region size of the bench stores: `KVTIER_BENCH_REGION_MIB`, else 64
/// (the node's default). Each full region costs a seal (summary + fdatasync)
/// and the tail that no whole record fits.
fn region_mib() -> u64 {
    std::env::var("KVTIER_BENCH_REGION_MIB").map_or(64, |v| {
        v.parse().expect("KVTIER_BENCH_REGION_MIB: a size in MiB")
    })
}

fn bench(_c: &mut Criterion) {
    let root = Path::new(env!("CARGO_TARGET_TMPDIR")).join("kvtier-disk-bench");
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).expect("bench dir");
    for chunk in [MIB as usize, 4 * MIB as usize] {
        let n = TOTAL / chunk as u64;
        let cfg = TierConfig {
            data_dir: root.join(format!("store-{chunk}")),
            ram_budget: 64 * MIB,
            disk_budget: TOTAL + 256 * MIB,
            region_size: region_mib() * MIB,
            write_policy: WritePolicy::Backpressure,
            promote_on_read: false,
            idle_flush_after: Duration::from_secs(3600),
            ..TierConfig::default()
        };
        let payloads: Vec<Bytes> = (0..8u8)
            .map(|i| Bytes::from(vec![i.wrapping_mul(31) | 1; chunk]))
            .collect();
        let raw = root.join(format!("raw-{chunk}"));
        let (mut wr_raw, mut wr_store, mut rd_raw, mut rd_store) = (vec![], vec![], vec![], vec![]);
        let mut direct = false;
        for rep in 0..REPS {
            wr_raw.push(raw_write(&raw, 4 * MIB as usize, TOTAL));
            let s = ChunkStore::open(cfg.clone()).expect("open");
            direct = s.stats().direct_io;
            let ns = s
                .register_namespace(&NamespaceRecord {
                    model: "bench".into(),
                    ..Default::default()
                })
                .expect("ns");
            let ids: Vec<ChunkId> = (0..n)
                .map(|i| {
                    let mut k = [0u8; 32];
                    k[..8].copy_from_slice(&(i + rep as u64 * n).to_le_bytes());
                    k[8] = 1;
                    ChunkId::new(ns, ChunkKey(k), 0)
                })
                .collect();
            let t = Instant::now();
            for (i, id) in ids.iter().enumerate() {
                s.put(*id, payloads[i % 8].clone()).expect("put");
            }
            s.flush().expect("flush");
            wr_store.push(TOTAL as f64 / t.elapsed().as_secs_f64() / 1e9);
            // Reads: drop RAM by reopening (promote off keeps RAM empty).
            drop(s);
            let s = ChunkStore::open(cfg.clone()).expect("reopen");
            let record = (chunk as u64 + 128).next_multiple_of(4096);
            rd_raw.push(raw_read(&raw, record as usize, n - 1, record));
            let t = Instant::now();
            let mut bytes = 0;
            for id in &ids {
                bytes += s.get(id).expect("disk hit").data.len();
            }
            rd_store.push(bytes as f64 / t.elapsed().as_secs_f64() / 1e9);
            assert_eq!(s.stats().verify_failures, 0);
        }
        let (wr, ws, rr, rs) = (
            median(wr_raw),
            median(wr_store),
            median(rd_raw),
            median(rd_store),
        );
        println!(
            "RESULT disk write {} MiB chunks: store {ws:.2} GB/s vs raw O_DIRECT 4 MiB qd1 {wr:.2} GB/s = {:.2}x (direct_io={direct}, {} MiB regions)",
            chunk >> 20,
            ws / wr,
            region_mib()
        );
        println!(
            "RESULT disk read  {} MiB chunks: store {rs:.2} GB/s vs raw O_DIRECT {} KiB qd1 {rr:.2} GB/s = {:.2}x",
            chunk >> 20,
            (chunk as u64 + 128).next_multiple_of(4096) >> 10,
            rs / rr
        );
    }
    let _ = std::fs::remove_dir_all(&root);
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    bench(&mut c);
    c.final_summary();
}
