//! Reads racing disk I/O in flight, on a device that holds reads or writes
//! until released: a chunk evicted from RAM is readable (and present for
//! LOOKUP) until the disk has it, and a disk read never puts an outdated
//! copy into RAM over a newer put, a delete, or a newer version written
//! meanwhile.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tier::device::{DirectMode, FileDevice};
use tier::testdev::HoldingDevice;
use tier::{ChunkId, ChunkKey, ChunkStore, NamespaceRecord, Tier, TierConfig};

const MIB: u64 = 1 << 20;
const KIB: usize = 1 << 10;
const WAIT: Duration = Duration::from_secs(20);

fn config(dir: &std::path::Path) -> TierConfig {
    TierConfig {
        data_dir: dir.to_path_buf(),
        // Payload bytes, and the bookkeeping RAM charges per entry.
        ram_budget: 4 * MIB + 16 * tier::ram::ENTRY_COST,
        disk_budget: 16 * MIB,
        region_size: MIB,
        idle_flush_after: Duration::from_secs(3600),
        ..TierConfig::default()
    }
}

/// A store of [`config`] over a 16 MiB file in `dir` through a holding
/// device.
fn open(dir: &std::path::Path, dev: &Arc<HoldingDevice>) -> (ChunkStore, tier::Namespace) {
    let s = ChunkStore::open_with_device(config(dir), dev.clone()).unwrap();
    let ns = s
        .register_namespace(&NamespaceRecord {
            model: "m".into(),
            ..Default::default()
        })
        .unwrap();
    (s, ns)
}

fn device(dir: &std::path::Path) -> Arc<HoldingDevice> {
    let file = FileDevice::open(&dir.join("dev"), 16 * MIB, DirectMode::Auto, 0).unwrap();
    Arc::new(HoldingDevice::new(Arc::new(file)))
}

/// Releases the device when dropped, so a failing assertion fails the
/// test instead of leaving a store thread held forever.
struct ReleaseOnDrop<'a>(&'a HoldingDevice);

impl Drop for ReleaseOnDrop<'_> {
    fn drop(&mut self) {
        self.0.release();
    }
}

fn key(n: u64) -> ChunkKey {
    let mut k = [0u8; 32];
    k[..8].copy_from_slice(&n.wrapping_mul(0x9e37_79b9_7f4a_7c15).to_le_bytes());
    k[8..16].copy_from_slice(&n.to_le_bytes());
    ChunkKey(k)
}

fn payload(n: u64, version: u8, len: usize) -> Bytes {
    Bytes::from(
        (0..len)
            .map(|i| (i as u64).wrapping_mul(n | 1) as u8 ^ version)
            .collect::<Vec<u8>>(),
    )
}

/// While the writer is stuck in a write, chunks evicted from a full RAM
/// wait in its queue: each still reads back byte-exact from RAM, LOOKUP
/// counts it present (so a prefix that starts with the oldest chunks is
/// not cut at zero), and once written it reads from disk.
#[test]
fn a_chunk_on_its_way_to_disk_is_never_a_miss() {
    let dir = tempfile::tempdir().unwrap();
    let dev = device(dir.path());
    let (s, ns) = open(dir.path(), &dev);
    let id = |n: u64| ChunkId::new(ns, key(n), 0);
    const N: u64 = 24;
    const LEN: usize = 256 * KIB;
    let _release = ReleaseOnDrop(&dev);
    dev.hold_writes();
    // 6 MiB through 4 MiB of RAM: the oldest chunks are evicted dirty.
    for n in 0..N {
        s.put(id(n), payload(n, 1, LEN)).unwrap();
    }
    assert!(dev.wait_held(1, WAIT), "the writer reached the device");
    let stats = s.stats();
    assert!(stats.ram_evictions >= 6, "{stats:?}");
    assert_eq!(stats.disk_chunks, 0, "nothing written yet");
    assert_eq!(stats.dropped_unwritten, 0);
    // Every evicted chunk is spilled (its write queued or held), counted
    // beside the RAM tier, not in it.
    assert_eq!(stats.spilled_chunks, stats.ram_evictions, "{stats:?}");
    assert_eq!(
        stats.spilled_bytes,
        stats.spilled_chunks * (LEN as u64 + tier::ram::ENTRY_COST)
    );
    assert_eq!(stats.ram_chunks + stats.spilled_chunks, N);
    for n in 0..N {
        let hit = s.get(&id(n)).unwrap_or_else(|| panic!("chunk {n} missed"));
        assert_eq!((hit.data, hit.tier), (payload(n, 1, LEN), Tier::Ram));
        assert_eq!(s.locate(&id(n)), Some(Tier::Ram));
    }
    let keys: Vec<ChunkKey> = (0..N).map(key).collect();
    let mut tiers = Vec::new();
    assert_eq!(s.lookup_prefix(ns, 0, &keys, &mut tiers), N as usize);
    assert!(stats.ram_chunks < N, "{stats:?}");
    assert_eq!(s.stats().misses, 0);

    dev.release();
    s.flush().unwrap();
    let after = s.stats();
    assert_eq!((after.spilled_chunks, after.spilled_bytes), (0, 0));
    // The evicted ones now live on disk only (their RAM copies went once
    // the index had them); every chunk still reads back.
    let on_disk = (0..N)
        .filter(|&n| s.locate(&id(n)) == Some(Tier::Disk))
        .count();
    assert_eq!(on_disk as u64, stats.ram_evictions, "{:?}", s.stats());
    for n in 0..N {
        assert_eq!(s.get(&id(n)).unwrap().data, payload(n, 1, LEN));
    }
}

/// Reopens a store holding `n` chunks of version 1 on disk only, then
/// starts a `get` of chunk 0 in a thread, held inside its disk read.
fn with_a_read_in_flight(
    f: impl FnOnce(&ChunkStore, ChunkId) + Send,
) -> (tempfile::TempDir, ChunkStore, ChunkId, Option<Bytes>) {
    let dir = tempfile::tempdir().unwrap();
    let dev = device(dir.path());
    let ns = {
        let (s, ns) = open(dir.path(), &dev);
        s.put(ChunkId::new(ns, key(0), 0), payload(0, 1, 64 * KIB))
            .unwrap();
        s.close(WAIT).unwrap();
        ns
    };
    let (s, _) = open(dir.path(), &dev);
    let x = ChunkId::new(ns, key(0), 0);
    assert_eq!(s.locate(&x), Some(Tier::Disk));
    dev.hold_next_read();
    let read = std::thread::scope(|scope| {
        let _release = ReleaseOnDrop(&dev);
        let reader = scope.spawn(|| s.get(&x).map(|h| h.data));
        assert!(dev.wait_held(1, WAIT), "the read reached the device");
        f(&s, x);
        dev.release();
        reader.join().unwrap()
    });
    (dir, s, x, read)
}

#[test]
fn a_disk_read_never_replaces_a_newer_put() {
    let (_dir, s, x, read) = with_a_read_in_flight(|s, x| {
        s.put(x, payload(0, 2, 64 * KIB)).unwrap();
    });
    // The read may return the version it started with ...
    assert_eq!(read, Some(payload(0, 1, 64 * KIB)));
    // ... but the newer put stays the chunk's content, dirty.
    let hit = s.get(&x).unwrap();
    assert_eq!((hit.data, hit.tier), (payload(0, 2, 64 * KIB), Tier::Ram));
    assert!(s.stats().dirty_bytes > 0, "the newer put is still dirty");
    s.flush().unwrap();
    assert_eq!(s.get(&x).unwrap().data, payload(0, 2, 64 * KIB));
}

#[test]
fn a_disk_read_never_brings_back_a_deleted_chunk() {
    let (_dir, s, x, read) = with_a_read_in_flight(|s, x| {
        assert!(s.delete(&x));
    });
    assert_eq!(read, Some(payload(0, 1, 64 * KIB)));
    assert_eq!(s.locate(&x), None);
    assert!(s.get(&x).is_none());
}

/// A newer version put, evicted and written while the read is held: the
/// old copy the read returns is not cached over it.
#[test]
fn a_disk_read_never_caches_a_version_written_over_meanwhile() {
    let (_dir, s, x, read) = with_a_read_in_flight(|s, x| {
        s.put(x, payload(0, 2, 64 * KIB)).unwrap();
        // Push it out of RAM (5 MiB through 4) and onto disk.
        for n in 1..=20 {
            s.put(ChunkId::new(x.ns, key(n), 0), payload(n, 1, 256 * KIB))
                .unwrap();
        }
        s.flush().unwrap();
        assert_eq!(s.locate(&x), Some(Tier::Disk));
    });
    assert_eq!(read, Some(payload(0, 1, 64 * KIB)));
    assert_eq!(s.get(&x).unwrap().data, payload(0, 2, 64 * KIB));
}

/// A flush covers every chunk dirty when it was called, also one overwritten
/// while the flush waits: after a crash the id reads as the flushed version
/// or a newer one, never as the older one already on disk. (The overwrite
/// cancelled the flush's write, and the new version, which the flush does not
/// cover, was lost with the crash: the key read as version 1.)
#[test]
fn a_version_overwritten_during_its_flush_is_still_made_durable() {
    let dir = tempfile::tempdir().unwrap();
    let dev = device(dir.path());
    let (s, ns) = open(dir.path(), &dev);
    let x = ChunkId::new(ns, key(0), 0);
    let a = ChunkId::new(ns, key(1), 0);
    const LEN: usize = 64 * KIB;
    s.put(x, payload(0, 1, LEN)).unwrap();
    s.flush().unwrap();
    let release = ReleaseOnDrop(&dev);
    dev.hold_writes();
    std::thread::scope(|t| {
        // A first flush holds the writer inside the write of `a`.
        s.put(a, payload(1, 1, LEN)).unwrap();
        let first = t.spawn(|| s.flush().unwrap());
        assert!(dev.wait_held(1, WAIT), "the writer reached the device");
        // Version 2 is dirty when the second flush is called; its job waits
        // in the queue behind the held write.
        s.put(x, payload(0, 2, LEN)).unwrap();
        let second = t.spawn(|| s.flush().unwrap());
        let t0 = std::time::Instant::now();
        while s.pending_writes(&x) == 0 {
            assert!(t0.elapsed() < WAIT, "the flush queued no write of x");
            std::thread::sleep(Duration::from_millis(1));
        }
        // Version 3 lands while that flush waits; it is never written.
        s.put(x, payload(0, 3, LEN)).unwrap();
        dev.release();
        first.join().unwrap();
        let report = second.join().unwrap();
        assert_eq!(report.failed, 0, "{report:?}");
    });
    drop(release);
    // In this process version 3 is served; version 2 was never indexed.
    assert!(
        s.get(&x).unwrap().data == payload(0, 3, LEN),
        "version 3 in RAM"
    );
    assert_eq!(s.locate(&x), Some(Tier::Ram));
    // A crash: dropped without close, version 3 (dirty, never flushed) is lost.
    drop(s);
    let (s, _) = open(dir.path(), &device(dir.path()));
    let got = s.get(&x).expect("the flushed version survives the crash");
    assert!(
        got.data == payload(0, 2, LEN),
        "flushed version 2, not version {}",
        got.data[0] ^ payload(0, 0, LEN)[0]
    );
    assert!(s.get(&a).unwrap().data == payload(1, 1, LEN));
}
