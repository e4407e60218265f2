//! End-to-end tests of the chunk store on real files and on test devices:
//! persistence across reopen, verified reads, the write policy (idle store
//! writes nothing, no-tax drops, backpressure, flush durability), misses
//! without I/O, corruption, version and geometry checks, and faults.

use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tier::device::{Device, DirectMode, FileDevice};
use tier::testdev::{CountingDevice, CrashDevice, FaultyDevice};
use tier::{
    ChunkId, ChunkKey, ChunkObserver, ChunkStore, Error, GcOptions, Namespace, NamespaceRecord,
    Tier, TierConfig, VerifyOptions, WritePolicy,
};

const MIB: u64 = 1 << 20;

fn record(rank: u32) -> NamespaceRecord {
    NamespaceRecord {
        model: "test-model".into(),
        engine: "vllm".into(),
        tp_size: 2,
        rank,
        kv_dtype: "bfloat16".into(),
        ..Default::default()
    }
}

fn config(dir: &std::path::Path) -> TierConfig {
    TierConfig {
        data_dir: dir.to_path_buf(),
        ram_budget: 4 * MIB,
        disk_budget: 8 * MIB,
        region_size: MIB,
        idle_flush_after: Duration::from_secs(3600),
        writer_queue: 64,
        // Exercise the parallel copy + CRC path on any machine.
        pack_threads: Some(2),
        ..TierConfig::default()
    }
}

fn id(ns: tier::Namespace, n: u64) -> ChunkId {
    ChunkId::new(ns, id_ns_key(n), (n % 3) as u16)
}

fn payload(n: u64, len: usize) -> Bytes {
    let mut v = vec![0u8; len];
    let mut x = n.wrapping_mul(0x2545_f491_4f6c_dd1d) | 1;
    for b in v.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    Bytes::from(v)
}

#[test]
fn put_flush_reopen_get_round_trips() {
    let dir = tempfile::tempdir().unwrap();
    let ns;
    {
        let s = ChunkStore::open(config(dir.path())).unwrap();
        ns = s.register_namespace(&record(0)).unwrap();
        for n in 0..20 {
            s.put(id(ns, n), payload(n, 10_000 + n as usize * 997))
                .unwrap();
        }
        s.put_named(
            id(ns, 100),
            Bytes::from_static(b"resp:key"),
            payload(100, 5000),
        )
        .unwrap();
        let r = s.flush().unwrap();
        assert_eq!(r.chunks, 21);
        assert_eq!(r.failed, 0);
        assert_eq!(s.stats().dirty_bytes, 0);
        s.close(Duration::from_secs(10)).unwrap();
        assert!(matches!(s.flush(), Err(Error::Closed)));
    }
    let s = ChunkStore::open(config(dir.path())).unwrap();
    assert_eq!(s.namespace_record(&ns), Some(record(0)));
    assert_eq!(s.stats().disk_chunks, 21);
    for n in 0..20 {
        assert_eq!(s.locate(&id(ns, n)), Some(Tier::Disk));
        let h = s.get(&id(ns, n)).unwrap();
        assert_eq!(h.tier, Tier::Disk);
        assert_eq!(h.data, payload(n, 10_000 + n as usize * 997));
        // Promoted into RAM as clean.
        assert_eq!(s.get(&id(ns, n)).unwrap().tier, Tier::Ram);
    }
    assert_eq!(s.stats().dirty_bytes, 0);
    assert!(s.get_named(&id(ns, 100), b"other").is_none());
    assert_eq!(
        s.get_named(&id(ns, 100), b"resp:key").unwrap().data,
        payload(100, 5000)
    );
    let info = s.namespaces();
    assert_eq!(info.len(), 1);
    assert_eq!(info[0].chunks, 21);
}

/// Chunks whose namespace record the manifest lost are still listed, by id
/// and usage, until a registration of the same record names them again.
#[test]
fn namespaces_without_a_record_are_listed_by_id() {
    let dir = tempfile::tempdir().unwrap();
    let s = ChunkStore::open(config(dir.path())).unwrap();
    let a = s.register_namespace(&record(0)).unwrap();
    let b = s.register_namespace(&record(1)).unwrap();
    for n in 0..3 {
        s.put(id(a, n), payload(n, 1000)).unwrap();
    }
    for n in 0..2 {
        s.put(id(b, n), payload(n, 500)).unwrap();
    }
    s.close(Duration::from_secs(10)).unwrap();
    std::fs::remove_file(dir.path().join(tier::manifest::FILE_NAME)).unwrap();

    let s = ChunkStore::open(config(dir.path())).unwrap();
    assert!(s.namespaces().is_empty());
    let mut want = [(a, 3, 3000), (b, 2, 1000)];
    want.sort_by_key(|w| w.0);
    let listed = |s: &ChunkStore| -> Vec<_> {
        s.namespace_listing()
            .into_iter()
            .map(|n| (n.id, n.record.is_some(), n.chunks, n.bytes))
            .collect()
    };
    assert_eq!(
        listed(&s),
        want.iter()
            .map(|&(ns, c, by)| (ns, false, c, by))
            .collect::<Vec<_>>()
    );
    assert_eq!(s.register_namespace(&record(1)).unwrap(), b);
    assert_eq!(listed(&s), vec![(b, true, 2, 1000), (a, false, 3, 3000)]);
    assert_eq!(s.namespaces().len(), 1);
}

/// A store of [`config`] in `dir` with `namespaces` namespaces (records
/// 0, 1, ...), each holding chunks 0..`chunks` of 3,000 bytes, flushed.
fn flushed_store(
    dir: &std::path::Path,
    namespaces: u32,
    chunks: u64,
) -> (ChunkStore, Vec<Namespace>) {
    let s = ChunkStore::open(config(dir)).unwrap();
    let ns: Vec<Namespace> = (0..namespaces)
        .map(|r| s.register_namespace(&record(r)).unwrap())
        .collect();
    for n in 0..chunks {
        for &x in &ns {
            s.put(id(x, n), payload(n, 3000)).unwrap();
        }
    }
    s.flush().unwrap();
    (s, ns)
}

/// Writes `path` as a `gc --apply` of `ns` that did not finish leaves it.
fn leave_pending_gc(path: &std::path::Path, ns: Namespace) {
    std::fs::write(path, format!("{{\"version\":1,\"namespaces\":[\"{ns}\"]}}")).unwrap();
}

/// A `gc --apply` leaves no trace once done; the selection file it keeps
/// while deleting is finished by a writable open if it is found there
/// (after a kill), and an unreadable one is removed without dropping
/// anything.
#[test]
fn gc_is_finished_by_the_next_open_when_its_selection_is_left_behind() {
    let dir = tempfile::tempdir().unwrap();
    let pending = dir.path().join(tier::maintenance::GC_PENDING_FILE);
    let (s, ns) = flushed_store(dir.path(), 2, 4);
    let (a, b) = (ns[0], ns[1]);
    let report = s
        .gc(&GcOptions {
            namespaces: vec![a],
            older_than: None,
            dry_run: false,
        })
        .unwrap();
    assert_eq!(report.chunks, 4);
    assert!(
        !pending.exists(),
        "a finished gc leaves no selection behind"
    );
    s.close(Duration::from_secs(10)).unwrap();

    // As a gc killed after choosing b and before its deletes leaves it.
    leave_pending_gc(&pending, b);
    let s = ChunkStore::open(config(dir.path())).unwrap();
    assert!(!pending.exists());
    assert!((0..4).all(|n| s.get(&id(b, n)).is_none()), "b dropped");
    assert!(s.namespaces().is_empty());
    s.close(Duration::from_secs(10)).unwrap();

    std::fs::write(&pending, b"{not json").unwrap();
    assert!(tier::maintenance::pending_gc(dir.path()).is_err());
    let s = ChunkStore::open(config(dir.path())).unwrap();
    assert!(!pending.exists(), "an unreadable selection is removed");
    drop(s);
}

/// A gc whose store holds an earlier selection it could not finish (the
/// open that should have found no space) drops that selection too: its own
/// replaces `gc.pending`, which forgot the earlier one (review).
#[test]
fn a_gc_over_an_unfinished_one_drops_both() {
    let dir = tempfile::tempdir().unwrap();
    let pending = dir.path().join(tier::maintenance::GC_PENDING_FILE);
    let (s, ns) = flushed_store(dir.path(), 3, 3);
    let (a, b, c) = (ns[0], ns[1], ns[2]);
    // What an open that could not finish a gc of `a` leaves behind.
    leave_pending_gc(&pending, a);
    let report = s
        .gc(&GcOptions {
            namespaces: vec![b],
            older_than: None,
            dry_run: false,
        })
        .unwrap();
    assert_eq!(report.namespaces, {
        let mut v = vec![a, b];
        v.sort();
        v
    });
    assert!(!pending.exists());
    assert!((0..3).all(|n| s.get(&id(a, n)).is_none() && s.get(&id(b, n)).is_none()));
    assert!((0..3).all(|n| s.get(&id(c, n)).is_some()), "c kept");
    let ids: Vec<_> = s.namespaces().iter().map(|n| n.id).collect();
    assert_eq!(ids, vec![c]);
    s.close(Duration::from_secs(10)).unwrap();
}

/// A store of [`config`] over an 8 MiB file in `dir`, through a device that
/// counts its reads and writes.
fn counting_store(dir: &std::path::Path) -> (ChunkStore, Arc<CountingDevice>) {
    let file = Arc::new(FileDevice::open(&dir.join("dev"), 8 * MIB, DirectMode::Auto, 0).unwrap());
    let dev = Arc::new(CountingDevice::new(file));
    let s = ChunkStore::open_with_device(config(dir), dev.clone()).unwrap();
    (s, dev)
}

#[test]
fn miss_performs_zero_disk_io_and_lookup_prefix_reports_tiers() {
    let dir = tempfile::tempdir().unwrap();
    let (s, dev) = counting_store(dir.path());
    let ns = s.register_namespace(&record(0)).unwrap();
    for n in 0..8 {
        s.put(id(ns, n), payload(n, 4096)).unwrap();
    }
    s.flush().unwrap();
    s.delete(&id(ns, 7)); // goes through RAM and index
    // Evict from RAM so they are disk-only: drop RAM copies by re-opening.
    drop(s);
    let s = ChunkStore::open_with_device(config(dir.path()), dev.clone()).unwrap();
    s.put(id(ns, 50), payload(50, 100)).unwrap();
    let before = dev.counts();
    for n in 1000..3000 {
        assert!(s.get(&id(ns, n)).is_none());
        assert!(s.locate(&id(ns, n)).is_none());
    }
    assert!(
        s.get(&id(ns, 7)).is_none(),
        "deleted before the flush-less reopen? tombstone"
    );
    let keys: Vec<ChunkKey> = [0u64, 1, 2, 9999].iter().map(|&n| id(ns, n).key).collect();
    let mut tiers = Vec::new();
    // All in group n % 3: ids 0,1,2 are in groups 0,1,2; look up group 0 only.
    let n = s.lookup_prefix(ns, 0, &keys[..1], &mut tiers);
    assert_eq!((n, tiers.clone()), (1, vec![Some(Tier::Disk)]));
    let n = s.lookup_prefix(ns, 0, &keys[3..], &mut tiers);
    assert_eq!((n, tiers.clone()), (0, vec![None]));
    assert_eq!(
        dev.counts(),
        before,
        "misses and lookups must not touch the device"
    );
    assert_eq!(s.stats().misses, 2001);
}

/// `get_ram` serves RAM hits only: a chunk on disk (or under another name)
/// is `None` without a device read or a miss counted; a RAM hit counts.
#[test]
fn get_ram_never_reads_the_disk() {
    let dir = tempfile::tempdir().unwrap();
    let (s, dev) = counting_store(dir.path());
    let ns = s.register_namespace(&record(0)).unwrap();
    s.put(id(ns, 1), payload(1, 4096)).unwrap();
    s.flush().unwrap();
    drop(s);
    // Reopened: chunk 1 is on disk only; chunk 2 is in RAM, named.
    let s = ChunkStore::open_with_device(config(dir.path()), dev.clone()).unwrap();
    s.put_named(id(ns, 2), Bytes::from_static(b"k2"), payload(2, 100))
        .unwrap();
    let (before, stats) = (dev.counts(), s.stats());
    assert_eq!(s.locate(&id(ns, 1)), Some(Tier::Disk));
    assert!(s.get_ram(&id(ns, 1), None).is_none(), "on disk only");
    assert!(
        s.get_ram(&id(ns, 2), Some(b"other")).is_none(),
        "another name"
    );
    let hit = s.get_ram(&id(ns, 2), Some(b"k2")).expect("a RAM hit");
    assert_eq!((hit.data, hit.tier), (payload(2, 100), Tier::Ram));
    assert_eq!(dev.counts(), before, "get_ram must not touch the device");
    let after = s.stats();
    assert_eq!(after.misses, stats.misses);
    assert_eq!(after.hits_ram, stats.hits_ram + 1);
    // The full read still finds the disk chunk.
    assert_eq!(s.get(&id(ns, 1)).unwrap().data, payload(1, 4096));
}

#[test]
fn lookup_prefix_reports_each_keys_tier_in_any_interleaving() {
    let dir = tempfile::tempdir().unwrap();
    let ns;
    // Group 0 only: n multiple of 3. Disk-only 0..30, RAM-only 300..330,
    // absent 3000..3030.
    let key = |n: u64| id_ns_key(n);
    {
        let s = ChunkStore::open(config(dir.path())).unwrap();
        ns = s.register_namespace(&record(0)).unwrap();
        for n in (0..30).step_by(3) {
            s.put(ChunkId::new(ns, key(n), 0), payload(n, 512)).unwrap();
        }
        s.flush().unwrap();
    }
    let s = ChunkStore::open(config(dir.path())).unwrap();
    for n in (300..330).step_by(3) {
        s.put(ChunkId::new(ns, key(n), 0), payload(n, 512)).unwrap();
    }
    // A disk hit is promoted: then it is found in RAM.
    assert!(s.get(&ChunkId::new(ns, key(6), 0)).is_some());
    let expect = |n: u64| match n {
        6 => Some(Tier::Ram),
        0..30 => Some(Tier::Disk),
        300..330 => Some(Tier::Ram),
        _ => None,
    };
    let mut order: Vec<u64> = (0..30)
        .step_by(3)
        .flat_map(|i| [i, 300 + i, 3000 + i])
        .collect();
    let mut tiers = Vec::new();
    for round in 0..4 {
        let keys: Vec<ChunkKey> = order.iter().map(|&n| key(n)).collect();
        let prefix = s.lookup_prefix(ns, 0, &keys, &mut tiers);
        let want: Vec<_> = order.iter().map(|&n| expect(n)).collect();
        assert_eq!(tiers, want, "round {round}, order {order:?}");
        assert_eq!(prefix, want.iter().take_while(|t| t.is_some()).count());
        // Another interleaving: rotate and reverse.
        order.rotate_left(7);
        if round % 2 == 1 {
            order.reverse();
        }
    }
    // Present-only prefixes: disk then RAM keys, then a miss.
    let keys: Vec<ChunkKey> = [0u64, 303, 9, 306, 3003].iter().map(|&n| key(n)).collect();
    assert_eq!(s.lookup_prefix(ns, 0, &keys, &mut tiers), 4);
    // Another group sees none of them.
    assert_eq!(s.lookup_prefix(ns, 1, &keys, &mut tiers), 0);
    assert!(tiers.iter().all(Option::is_none));
}

/// The key of `id(_, n)` (its group aside).
/// `lookup_prefix` over batches longer than one lock-all block (2,048
/// keys), in each combination of an empty or filled RAM tier with or
/// without a disk index, agrees key by key with `locate`.
#[test]
fn lookup_prefix_agrees_with_locate_across_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = TierConfig {
        ram_budget: MIB,
        disk_budget: 16 * MIB,
        write_policy: WritePolicy::Backpressure,
        ..config(dir.path())
    };
    let ns;
    let keys: Vec<ChunkKey> = (0..5_000).map(id_ns_key).collect();
    let check = |s: &ChunkStore, ns: tier::Namespace, what: &str| {
        let mut tiers = Vec::new();
        for batch in [&keys[2_047..2_050], &keys[1..4_500], &keys[..]] {
            let prefix = s.lookup_prefix(ns, 0, batch, &mut tiers);
            let want: Vec<Option<Tier>> = batch
                .iter()
                .map(|k| s.locate(&ChunkId::new(ns, *k, 0)))
                .collect();
            assert_eq!(tiers, want, "{what}");
            assert_eq!(prefix, want.iter().take_while(|t| t.is_some()).count());
        }
        tiers
    };
    {
        // RAM and disk: every third key stored, 1 MiB of RAM keeps the
        // newest ones there, the rest go to disk.
        let s = ChunkStore::open(cfg.clone()).unwrap();
        ns = s.register_namespace(&record(0)).unwrap();
        for (n, k) in keys.iter().enumerate().step_by(3) {
            s.put(ChunkId::new(ns, *k, 0), payload(n as u64, 4096))
                .unwrap();
        }
        s.flush().unwrap();
        let tiers = check(&s, ns, "RAM and disk");
        assert!(tiers.contains(&Some(Tier::Ram)) && tiers.contains(&Some(Tier::Disk)));
        assert_eq!(tiers.iter().filter(|t| t.is_some()).count(), 1_667);
    }
    // Empty RAM over a disk index: a reopened store.
    let s = ChunkStore::open(cfg.clone()).unwrap();
    let tiers = check(&s, ns, "disk only");
    assert!(tiers.iter().all(|t| *t != Some(Tier::Ram)));
    drop(s);
    // No disk at all: RAM empty, then filled.
    let dir = tempfile::tempdir().unwrap();
    let s = ChunkStore::open(TierConfig {
        disk_budget: 0,
        ram_budget: 16 * MIB,
        ..config(dir.path())
    })
    .unwrap();
    let ns = s.register_namespace(&record(0)).unwrap();
    assert!(check(&s, ns, "nothing").iter().all(Option::is_none));
    for (n, k) in keys.iter().enumerate().skip(1).step_by(2) {
        s.put(ChunkId::new(ns, *k, 0), payload(n as u64, 64))
            .unwrap();
    }
    let tiers = check(&s, ns, "RAM only");
    assert_eq!(
        tiers.iter().filter(|t| **t == Some(Tier::Ram)).count(),
        2_500
    );
}

fn id_ns_key(n: u64) -> ChunkKey {
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&n.wrapping_mul(0x9e37_79b9_7f4a_7c15).to_le_bytes());
    key[8..16].copy_from_slice(&n.to_le_bytes());
    ChunkKey(key)
}

#[test]
fn an_idle_store_performs_zero_writes() {
    let dir = tempfile::tempdir().unwrap();
    let file =
        Arc::new(FileDevice::open(&dir.path().join("dev"), 8 * MIB, DirectMode::Auto, 0).unwrap());
    let dev = Arc::new(CountingDevice::new(file));
    let mut cfg = config(dir.path());
    cfg.idle_flush_after = Duration::ZERO;
    let s = ChunkStore::open_with_device(cfg, dev.clone()).unwrap();
    let ns = s.register_namespace(&record(0)).unwrap();
    let opened = dev.counts();
    for _ in 0..5 {
        s.idle_tick();
    }
    assert_eq!(
        dev.counts().writes,
        opened.writes,
        "nothing dirty: no writes"
    );
    for n in 0..4 {
        s.put(id(ns, n), payload(n, 1000)).unwrap();
    }
    // Idle flush writes dirty chunks (age 0), without a sync.
    s.idle_tick();
    wait_for(|| s.stats().dirty_bytes == 0);
    let after_idle = dev.counts();
    assert!(after_idle.writes > opened.writes);
    for _ in 0..5 {
        s.idle_tick();
        for n in 0..4 {
            assert!(s.get(&id(ns, n)).is_some());
        }
    }
    s.flush().unwrap();
    let flushed = dev.counts();
    // Clean RAM, reads, idle ticks: zero further writes.
    for _ in 0..5 {
        s.idle_tick();
        assert!(s.get(&id(ns, 1)).is_some());
    }
    std::thread::yield_now();
    assert_eq!(dev.counts().writes, flushed.writes);
    assert_eq!(dev.counts().write_bytes, flushed.write_bytes);
}

#[test]
fn idle_flush_skips_young_chunks() {
    let dir = tempfile::tempdir().unwrap();
    let s = ChunkStore::open(config(dir.path())).unwrap(); // idle age 1 h
    let ns = s.register_namespace(&record(0)).unwrap();
    s.put(id(ns, 1), payload(1, 1000)).unwrap();
    s.idle_tick();
    s.flush().unwrap(); // a barrier: the writer saw everything queued before
    assert_eq!(s.stats().disk_writes, 1, "only flush wrote");
}

fn wait_for(mut f: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(
            std::time::Instant::now() < deadline,
            "condition not reached in 10 s"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// A device whose writes block until released: the writer falls behind.
struct GatedDevice {
    inner: Arc<dyn Device>,
    open: parking_lot::Mutex<bool>,
    cv: parking_lot::Condvar,
    writes: AtomicU64,
}

impl GatedDevice {
    fn release(&self) {
        *self.open.lock() = true;
        self.cv.notify_all();
    }
}

impl Device for GatedDevice {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        let mut g = self.open.lock();
        while !*g {
            self.cv.wait(&mut g);
        }
        self.writes.fetch_add(1, Ordering::SeqCst);
        self.inner.write_at(buf, offset)
    }
    fn sync(&self) -> std::io::Result<()> {
        self.inner.sync()
    }
    fn len(&self) -> u64 {
        self.inner.len()
    }
    fn direct_io(&self) -> bool {
        false
    }
    fn path(&self) -> &std::path::Path {
        self.inner.path()
    }
}

fn gated(len: u64) -> Arc<GatedDevice> {
    // Format the device first (superblock) so opening needs no gated write.
    let inner: Arc<dyn Device> = Arc::new(CrashDevice::new(len));
    Arc::new(GatedDevice {
        inner,
        open: parking_lot::Mutex::new(false),
        cv: parking_lot::Condvar::new(),
        writes: AtomicU64::new(0),
    })
}

/// A store with a 1 MiB RAM budget (and `tune` applied) whose writer blocks
/// on its first write until `release`; returns it, its device and a
/// namespace.
fn stalled_store(
    dir: &std::path::Path,
    tune: impl FnOnce(&mut TierConfig),
) -> (ChunkStore, Arc<GatedDevice>, tier::Namespace) {
    let dev = gated(8 * MIB);
    dev.release();
    let mut cfg = config(dir);
    cfg.ram_budget = MIB;
    tune(&mut cfg);
    let s = ChunkStore::open_with_device(cfg, dev.clone()).unwrap();
    *dev.open.lock() = false; // the writer now blocks on its first write
    let ns = s.register_namespace(&record(0)).unwrap();
    (s, dev, ns)
}

/// A close whose deadline passes stops there: the writes still queued are
/// dropped, not written (QA: a `0s` shutdown deadline still wrote every
/// queued chunk, and the error called the timeout an I/O error).
#[test]
fn a_close_past_its_deadline_drops_the_queued_writes_and_says_what_is_lost() {
    let dir = tempfile::tempdir().unwrap();
    let dev = gated(32 * MIB);
    dev.release();
    let mut cfg = config(dir.path());
    cfg.ram_budget = 16 * MIB;
    cfg.disk_budget = 32 * MIB;
    let s = ChunkStore::open_with_device(cfg.clone(), dev.clone()).unwrap();
    *dev.open.lock() = false; // the writer blocks on its first write
    let ns = s.register_namespace(&record(0)).unwrap();
    const N: u64 = 120; // 12 MB dirty; 1 MiB regions, a few batches in flight
    for k in 0..N {
        s.put(id(ns, k), payload(k, 100_000)).unwrap();
    }
    let opener = {
        let dev = dev.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(1000));
            dev.release();
        })
    };
    match s.close(Duration::from_millis(200)) {
        Err(tier::Error::Deadline(m)) => {
            assert!(m.contains("lost at this exit"), "{m}");
            assert!(!m.contains("I/O error"), "{m}");
        }
        other => panic!("a close past its deadline: {other:?}"),
    }
    opener.join().unwrap();
    let s = ChunkStore::open_with_device(cfg, dev.clone()).unwrap();
    let mut present = 0;
    for k in 0..N {
        if let Some(h) = s.get(&id(ns, k)) {
            assert_eq!(h.data, payload(k, 100_000), "chunk {k}");
            present += 1;
        }
    }
    assert!(
        present < N / 2,
        "{present} of {N} chunks were written past the deadline"
    );
}

/// A close with a deadline already past but nothing left to write is no
/// loss: it used to fail saying "0 bytes ... lost", and the daemon exited 1.
#[test]
fn a_zero_deadline_close_with_nothing_dirty_succeeds() {
    let dir = tempfile::tempdir().unwrap();
    let s = ChunkStore::open(config(dir.path())).unwrap();
    let ns = s.register_namespace(&record(0)).unwrap();
    s.put(id(ns, 1), payload(1, 10_000)).unwrap();
    s.flush().unwrap();
    s.close(Duration::ZERO).unwrap();
    let s = ChunkStore::open(config(dir.path())).unwrap();
    assert_eq!(s.get(&id(ns, 1)).unwrap().data, payload(1, 10_000));
}

/// Every chunk `0..n` of `len` bytes is either readable with its exact
/// bytes or counted in `dropped_unwritten`.
fn present_or_dropped(s: &ChunkStore, ns: tier::Namespace, n: u64, len: usize) {
    let st = s.stats();
    let mut present = 0;
    for k in 0..n {
        if let Some(h) = s.get(&id(ns, k)) {
            assert_eq!(h.data, payload(k, len));
            present += 1;
        }
    }
    assert_eq!(present + st.dropped_unwritten, n, "{st:?}");
}

/// Under no-tax a put never waits for a writer that is behind, and what
/// waits for it is bounded in bytes (`spill_limit`), not by the queue's
/// length: with a queue of 2 and the writer stuck in a write, ~30 dirty
/// evictions wait beside the queue and none is dropped (QA: pipelined
/// small SETs, one hand-off each, filled the 64-slot queue while the disk
/// idled, and were dropped); past the bytes bound they are dropped.
#[test]
fn no_tax_put_never_waits_and_drops_only_past_the_bytes_bound() {
    for (limit, dropped) in [(None, false), (Some(1), true)] {
        let dir = tempfile::tempdir().unwrap();
        let (s, dev, ns) = stalled_store(dir.path(), |c| {
            c.writer_queue = 2;
            c.spill_limit = limit;
        });
        // 40 x 100 KiB through a 1 MiB RAM: ~30 dirty evictions, one a put.
        for n in 0..40 {
            s.put(id(ns, n), payload(n, 100 << 10)).unwrap();
        }
        let st = s.stats();
        // Released before asserting: a failed test must not hang in the
        // store's drop, which waits for the blocked writer.
        dev.release();
        assert!(st.ram_evictions >= 30, "{st:?}");
        if dropped {
            assert!(st.dropped_unwritten >= 25, "{st:?}");
        } else {
            assert_eq!(st.dropped_unwritten, 0, "{st:?}");
            assert!(
                st.writer_queue_depth > 2,
                "waiting beside the queue: {st:?}"
            );
        }
        s.flush().unwrap();
        let st = s.stats();
        assert_eq!((st.writer_queue_depth, st.spilled_chunks), (0, 0), "{st:?}");
        present_or_dropped(&s, ns, 40, 100 << 10);
    }
}

/// Under no-tax, chunks evicted dirty that wait for a writer that is
/// behind are bounded in bytes (`spill_limit`), not only by the writer
/// queue's length: past the limit an eviction is dropped and counted (QA:
/// 120 chunks of 32 MiB into a 64 MiB budget held 1.8 GiB waiting).
#[test]
fn no_tax_bounds_the_bytes_waiting_for_the_writer() {
    let dir = tempfile::tempdir().unwrap();
    let (s, dev, ns) = stalled_store(dir.path(), |c| {
        c.writer_queue = 64;
        c.spill_limit = Some(512 << 10);
    });
    let mut most = 0;
    for n in 0..40 {
        s.put(id(ns, n), payload(n, 100 << 10)).unwrap();
        most = most.max(s.stats().spilled_bytes);
    }
    let st = s.stats();
    // Released before asserting: a failed test must not hang in the
    // store's drop, which waits for the blocked writer.
    dev.release();
    // The queue (64) would have taken all ~30 evictions, 3 MiB.
    assert!(most <= (512 + 110) << 10, "{most} bytes waited: {st:?}");
    assert!(st.dropped_unwritten >= 20, "{st:?}");
    s.flush().unwrap();
    present_or_dropped(&s, ns, 40, 100 << 10);
}

/// One put that evicts many small dirty chunks hands them to the writer
/// together: with a slot each, a 64-slot queue overflowed and dropped most
/// of them unwritten while the writer was idle and far below `spill_limit`
/// (QA: 2,000 RESP values of 100 B, then 1 MiB SETs: 1,944 dropped).
#[test]
fn a_put_evicting_many_small_chunks_drops_none_of_them() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path());
    cfg.ram_budget = MIB;
    let s = ChunkStore::open(cfg).unwrap();
    let ns = s.register_namespace(&record(0)).unwrap();
    let small = 2_000;
    for n in 0..small {
        s.put(id(ns, n), payload(n, 100)).unwrap();
    }
    // Most of the RAM budget at once: evicts ~730 of the small ones.
    s.put(id(ns, small), payload(small, 900 << 10)).unwrap();
    let st = s.stats();
    assert!(st.ram_evictions >= 500, "{st:?}");
    assert_eq!(st.dropped_unwritten, 0, "{st:?}");
    // One hand-off for them all (not one per chunk, waiting beside the queue).
    assert!(st.writer_queue_depth <= 1, "{st:?}");
    s.flush().unwrap();
    for n in 0..small {
        let h = s
            .get(&id(ns, n))
            .unwrap_or_else(|| panic!("chunk {n} lost"));
        assert!(h.data == payload(n, 100), "chunk {n} has other bytes");
    }
}

#[test]
fn backpressure_put_waits_and_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (s, dev, ns) = stalled_store(dir.path(), |c| {
        c.writer_queue = 2;
        c.write_policy = WritePolicy::Backpressure;
    });
    let s = Arc::new(s);
    let done = Arc::new(AtomicU64::new(0));
    let t = {
        let (s, done) = (s.clone(), done.clone());
        std::thread::spawn(move || {
            for n in 0..30 {
                s.put(id(ns, n), payload(n, 100 << 10)).unwrap();
                done.fetch_add(1, Ordering::SeqCst);
            }
        })
    };
    // The putter fills RAM, then blocks on the full queue.
    wait_for(|| s.stats().writer_queue_depth == 2);
    let stuck = done.load(Ordering::SeqCst);
    assert!(stuck < 30);
    dev.release();
    t.join().unwrap();
    s.flush().unwrap();
    assert_eq!(s.stats().dropped_unwritten, 0);
    for n in 0..30 {
        assert_eq!(
            s.get(&id(ns, n)).unwrap().data,
            payload(n, 100 << 10),
            "chunk {n}"
        );
    }
}

#[test]
fn regions_are_reclaimed_fifo_and_observers_told() {
    #[derive(Default)]
    struct Obs {
        added: AtomicU64,
        removed: AtomicU64,
    }
    impl ChunkObserver for Obs {
        fn added(&self, _: &ChunkId, _: u64) {
            self.added.fetch_add(1, Ordering::SeqCst);
        }
        fn removed(&self, _: &ChunkId) {
            self.removed.fetch_add(1, Ordering::SeqCst);
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path());
    cfg.disk_budget = 4 * MIB; // 4 regions of 1 MiB
    cfg.ram_budget = MIB;
    cfg.write_policy = WritePolicy::Backpressure;
    let s = ChunkStore::open(cfg.clone()).unwrap();
    let obs = Arc::new(Obs::default());
    s.set_observer(obs.clone());
    let ns = s.register_namespace(&record(0)).unwrap();
    // 12 MiB through a 4 MiB disk.
    for n in 0..120 {
        s.put(id(ns, n), payload(n, 100 << 10)).unwrap();
    }
    s.flush().unwrap();
    let st = s.stats();
    assert!(st.region_evictions >= 8, "{st:?}");
    assert!(st.disk_bytes <= 4 * MIB);
    // The newest chunks survive, the oldest are gone, nothing is wrong.
    for n in 0..120 {
        if let Some(h) = s.get(&id(ns, n)) {
            assert_eq!(h.data, payload(n, 100 << 10));
        }
    }
    assert!(s.get(&id(ns, 119)).is_some());
    assert!(s.get(&id(ns, 0)).is_none());
    assert!(obs.removed.load(Ordering::SeqCst) >= 80);
    drop(s);
    let s = ChunkStore::open(cfg).unwrap();
    let ids = s.ids();
    assert!(!ids.is_empty());
    for (cid, len) in ids {
        assert_eq!(len, 100 << 10);
        let n = u64::from_le_bytes(cid.key.0[8..16].try_into().unwrap());
        assert_eq!(s.get(&cid).unwrap().data, payload(n, 100 << 10));
    }
}

/// A store of `ram` and `disk` bytes (1 MiB regions; every eviction
/// written: no-tax may drop some when the writer is behind, and then fewer
/// regions are reclaimed) holding one flushed 100 KiB "hot" chunk.
fn hot_chunk_flushed(
    dir: &std::path::Path,
    ram: u64,
    disk: u64,
) -> (ChunkStore, TierConfig, ChunkId, Bytes) {
    let mut cfg = config(dir);
    cfg.disk_budget = disk;
    cfg.ram_budget = ram;
    cfg.write_policy = WritePolicy::Backpressure;
    let s = ChunkStore::open(cfg.clone()).unwrap();
    let ns = s.register_namespace(&record(0)).unwrap();
    let hot = id(ns, 1_000_000);
    let bytes = payload(1_000_000, 100 << 10);
    s.put(hot, bytes.clone()).unwrap();
    s.flush().unwrap();
    (s, cfg, hot, bytes)
}

/// PUTs 100 KiB chunks `range` in `hot`'s namespace, reading `hot` (a RAM
/// hit, byte-exact) after each.
fn put_cold_reading_hot(s: &ChunkStore, range: std::ops::Range<u64>, hot: &ChunkId) {
    let want = payload(1_000_000, 100 << 10);
    for n in range {
        s.put(id(hot.ns, n), payload(n, 100 << 10)).unwrap();
        assert_eq!(s.get(hot).unwrap().data, want);
    }
}

/// A chunk kept hot in RAM whose disk copy goes with a reclaimed region is
/// marked dirty again, so the next flush writes it anew and a restart
/// still has it (QA: the hot chunk was lost while every cold chunk written
/// after it survived). On a disk no larger than RAM it is not: rewriting
/// what RAM holds would reclaim more of it, for good.
#[test]
fn a_hot_chunk_whose_region_is_reclaimed_survives_a_restart() {
    for (disk, rewritten) in [(8 * MIB, true), (3 * MIB, false)] {
        let dir = tempfile::tempdir().unwrap();
        let (s, cfg, hot, bytes) = hot_chunk_flushed(dir.path(), 2 * MIB, disk);
        // 24 MiB of cold chunks through the disk, the hot one read after each.
        put_cold_reading_hot(&s, 0..240, &hot);
        s.flush().unwrap();
        let st = s.stats();
        assert!(st.region_evictions >= 16, "{st:?}");
        assert_eq!(st.reclaimed_rewrites > 0, rewritten, "{st:?}");
        drop(s);
        let s = ChunkStore::open(cfg).unwrap();
        assert_eq!(
            s.get(&hot).map(|h| h.data),
            rewritten.then(|| bytes.clone()),
            "disk {disk}"
        );
    }
}

/// A stop whose own flush reclaims the region of a hot chunk writes that
/// chunk too (a second round), so the restart has it (review: `close` ran
/// one flush and left it dirty).
#[test]
fn a_stop_writes_hot_chunks_its_own_flush_reclaimed() {
    let dir = tempfile::tempdir().unwrap();
    let (s, cfg, hot, bytes) = hot_chunk_flushed(dir.path(), 5 * MIB, 8 * MIB);
    // 6 MiB flushed after it, then 4 MiB dirty in RAM: their write at the
    // stop reclaims the hot chunk's region.
    put_cold_reading_hot(&s, 0..60, &hot);
    s.flush().unwrap();
    put_cold_reading_hot(&s, 100..140, &hot);
    let before = s.stats();
    s.close(Duration::from_secs(30)).unwrap();
    drop(s);
    let s = ChunkStore::open(cfg).unwrap();
    assert_eq!(
        s.get(&hot).map(|h| h.data),
        Some(bytes),
        "before the stop: {before:?}"
    );
}

/// Rewrites of reclaimed chunks end once an idle store wrote each hot one
/// again: only chunks read since they were last marked are marked, so the
/// rewrites cannot keep reclaiming each other's regions. (Review: with
/// small chunks, whose disk records are several times their RAM charge,
/// an idle store rewrote itself for good.)
#[test]
fn rewrites_of_reclaimed_chunks_end_on_an_idle_store() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path());
    cfg.disk_budget = 8 * MIB;
    cfg.ram_budget = 2 * MIB;
    // Payload bytes alone: the chunks' disk records are then several times
    // their RAM charge (with the real bookkeeping charge they are not).
    cfg.ram_entry_cost = 0;
    cfg.idle_flush_after = Duration::from_millis(40);
    let s = ChunkStore::open(cfg).unwrap();
    let ns = s.register_namespace(&record(0)).unwrap();
    let n = 30_000;
    for i in 0..n {
        s.put(id(ns, i), payload(i, 64)).unwrap();
    }
    for i in 0..n {
        let _ = s.get(&id(ns, i));
    }
    s.flush().unwrap();
    // Idle: the writes stop (two samples 300 ms apart agree), within 20 s.
    let t0 = Instant::now();
    let mut last = s.stats().disk_writes;
    loop {
        std::thread::sleep(Duration::from_millis(300));
        let now = s.stats().disk_writes;
        if now == last {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "an idle store still writes: {:?}",
            s.stats()
        );
        last = now;
    }
    let st = s.stats();
    eprintln!("idle writes stopped after {:?}: {st:?}", t0.elapsed());
    assert!(st.reclaimed_rewrites > 0, "{st:?}");
    assert!(st.reclaimed_rewrites <= 2 * n, "{st:?}");
}

/// A peer's copy admitted clean (`put_clean`) while a reclaim is taking its
/// region's entries out of the index is never marked dirty by that
/// reclaim: it must stay off the local disk (review: it was written).
#[test]
fn a_chunk_admitted_during_a_reclaim_is_not_written_locally() {
    use std::sync::{Mutex, OnceLock, Weak};
    #[derive(Default)]
    struct Admit {
        store: OnceLock<Weak<ChunkStore>>,
        pending: Mutex<Vec<(ChunkId, Bytes)>>,
        admitted: Mutex<Vec<ChunkId>>,
    }
    impl ChunkObserver for Admit {
        fn added(&self, _: &ChunkId, _: u64) {}
        // Called by the reclaim for each entry it took out: a peer fetch
        // of another chunk of that region lands now.
        fn removed(&self, gone: &ChunkId) {
            let Some(s) = self.store.get().and_then(Weak::upgrade) else {
                return;
            };
            for (c, data) in std::mem::take(&mut *self.pending.lock().unwrap()) {
                if c != *gone
                    && s.disk_location(&c).is_none()
                    && s.put_clean(c, None, data).unwrap()
                {
                    // Read at once: hot, as far as RAM can tell.
                    assert!(s.get(&c).is_some());
                    self.admitted.lock().unwrap().push(c);
                }
            }
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path());
    cfg.disk_budget = 8 * MIB;
    cfg.ram_budget = 2 * MIB;
    let s = Arc::new(ChunkStore::open(cfg).unwrap());
    let admit = Arc::new(Admit::default());
    admit.store.set(Arc::downgrade(&s)).unwrap();
    let ns = s.register_namespace(&record(0)).unwrap();
    for n in 0..60 {
        s.put(id(ns, n), payload(n, 100 << 10)).unwrap();
    }
    s.flush().unwrap();
    // The first region's chunks (out of RAM by now).
    *admit.pending.lock().unwrap() = (0..60)
        .filter(|&n| s.disk_location(&id(ns, n)).is_some_and(|l| l.0 == 0))
        .map(|n| (id(ns, n), payload(n, 100 << 10)))
        .collect();
    s.set_observer(admit.clone());
    for n in 1000..1040 {
        s.put(id(ns, n), payload(n, 100 << 10)).unwrap();
    }
    s.flush().unwrap();
    let admitted = admit.admitted.lock().unwrap().clone();
    assert!(!admitted.is_empty(), "the reclaim admitted nothing");
    for c in &admitted {
        assert_eq!(
            s.disk_location(c),
            None,
            "a peer's copy was written locally"
        );
    }
}

fn flip_byte(path: &std::path::Path, at: u64) {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, at).unwrap();
    b[0] ^= 0x40;
    f.write_all_at(&b, at).unwrap();
    f.sync_all().unwrap();
}

#[test]
fn bit_flips_in_payload_or_header_are_misses_never_wrong_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path());
    cfg.direct_io = false; // the buffered path, with the flips through the page cache
    cfg.region_size = 64 << 10; // three chunks per region: 0..3 get sealed
    let (ns, locs) = {
        let s = ChunkStore::open(cfg.clone()).unwrap();
        let ns = s.register_namespace(&record(0)).unwrap();
        for n in 0..4 {
            s.put(id(ns, n), payload(n, 12_000)).unwrap();
        }
        s.flush().unwrap();
        let locs: Vec<_> = (0..4)
            .map(|n| s.disk_location(&id(ns, n)).unwrap())
            .collect();
        s.close(Duration::from_secs(5)).unwrap();
        (ns, locs)
    };
    let file = dir.path().join("store.kvt");
    assert_eq!(locs[0].0, locs[2].0);
    assert_ne!(locs[0].0, locs[3].0, "chunk 3 is in the next region");
    flip_byte(&file, locs[0].1 + 200 + 5000); // payload
    flip_byte(&file, locs[1].1 + 40); // header (key)
    flip_byte(&file, locs[2].1 + 70); // header (payload crc)
    let s = ChunkStore::open(cfg.clone()).unwrap();
    assert!(!s.stats().direct_io);
    for n in 0..3 {
        assert!(s.get(&id(ns, n)).is_none(), "chunk {n}");
        assert_eq!(s.locate(&id(ns, n)), None, "bad entry dropped");
    }
    assert_eq!(s.get(&id(ns, 3)).unwrap().data, payload(3, 12_000));
    assert_eq!(s.stats().verify_failures, 3);
    drop(s);
    // verify finds them (again, after reopen) and repair drops them.
    let s = ChunkStore::open(cfg).unwrap();
    let mut calls = 0;
    let r = s
        .verify(&VerifyOptions { repair: false }, &mut |_, _| calls += 1)
        .unwrap();
    assert_eq!((r.checked, r.bad, r.dropped), (4, 3, 0));
    assert_eq!(calls, 4);
    assert_eq!(r.problems.len(), 3);
    let r = s
        .verify(&VerifyOptions { repair: true }, &mut |_, _| {})
        .unwrap();
    assert_eq!((r.bad, r.dropped), (3, 3));
    let r = s
        .verify(&VerifyOptions { repair: false }, &mut |_, _| {})
        .unwrap();
    assert_eq!((r.checked, r.bad), (1, 0));
}

#[test]
fn bit_flips_anywhere_in_a_large_split_read_are_misses() {
    // Records of 1.5 MiB: with O_DIRECT the device reads them as pieces and
    // the store checksums each piece as it lands.
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path());
    cfg.region_size = 4 * MIB;
    cfg.disk_budget = 16 * MIB;
    let len = 3 * MIB as usize / 2;
    let (ns, locs, heads) = {
        let s = ChunkStore::open(cfg.clone()).unwrap();
        let ns = s.register_namespace(&record(0)).unwrap();
        for n in 0..4 {
            s.put(id(ns, n), payload(n, len)).unwrap();
        }
        s.flush().unwrap();
        let locs: Vec<_> = (0..4)
            .map(|n| s.disk_location(&id(ns, n)).unwrap())
            .collect();
        let heads: Vec<_> = (0..4)
            .map(|n| u64::from(s.disk_header_len(&id(ns, n)).unwrap()))
            .collect();
        s.close(Duration::from_secs(5)).unwrap();
        (ns, locs, heads)
    };
    let file = dir.path().join("store.kvt");
    let payload_at = |n: usize, at: u64| locs[n].1 + heads[n] + at;
    flip_byte(&file, payload_at(0, 0)); // first byte: first piece
    flip_byte(&file, payload_at(1, len as u64 / 2 + 4097)); // a middle piece
    flip_byte(&file, payload_at(2, len as u64 - 1)); // last byte: last piece
    let s = ChunkStore::open(cfg).unwrap();
    for n in 0..3 {
        assert!(s.get(&id(ns, n)).is_none(), "chunk {n}");
    }
    assert_eq!(s.get(&id(ns, 3)).unwrap().data, payload(3, len));
    assert_eq!(s.stats().verify_failures, 3);
}

#[test]
fn another_store_version_or_region_size_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    ChunkStore::open(config(dir.path())).unwrap();
    let mut cfg = config(dir.path());
    cfg.region_size = 2 * MIB;
    let e = ChunkStore::open(cfg).err().unwrap();
    assert!(
        e.to_string()
            .contains("created with region-size 1MiB but the config says 2MiB"),
        "{e}"
    );
    let mut cfg = config(dir.path());
    cfg.disk_budget = 16 * MIB;
    let e = ChunkStore::open(cfg).err().unwrap();
    assert!(matches!(e, Error::Config(_)), "{e}");
    assert!(e.to_string().contains("holds 8 regions (8MiB)"), "{e}");
    // Rewrite the superblock with version 9 (valid crc): refused, naming both.
    let file = dir.path().join("store.kvt");
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&file)
        .unwrap();
    let mut sb = [0u8; 64];
    f.read_exact_at(&mut sb, 0).unwrap();
    let mut decoded = tier::layout::Superblock::decode(&sb).unwrap();
    decoded.version = 9;
    decoded.encode_into(&mut sb);
    f.write_all_at(&sb, 0).unwrap();
    match ChunkStore::open(config(dir.path())) {
        Err(Error::IncompatibleVersion {
            found, supported, ..
        }) => {
            assert_eq!(found, 9);
            assert_eq!(supported, "1");
        }
        other => panic!("expected IncompatibleVersion, got {:?}", other.err()),
    }
    // A flipped superblock byte is corruption, not a fresh store.
    sb[20] ^= 1;
    f.write_all_at(&sb, 0).unwrap();
    assert!(matches!(
        ChunkStore::open(config(dir.path())),
        Err(Error::Corrupt { .. })
    ));
}

#[test]
fn enospc_pauses_the_writer_and_reads_keep_working() {
    let dir = tempfile::tempdir().unwrap();
    let inner: Arc<dyn Device> = Arc::new(CrashDevice::new(8 * MIB));
    let dev = Arc::new(FaultyDevice::new(inner));
    let s = ChunkStore::open_with_device(config(dir.path()), dev.clone()).unwrap();
    let ns = s.register_namespace(&record(0)).unwrap();
    s.put(id(ns, 1), payload(1, 5000)).unwrap();
    s.flush().unwrap();
    dev.fail_writes_after(0, libc::ENOSPC);
    s.put(id(ns, 2), payload(2, 5000)).unwrap();
    let r = s.flush().unwrap();
    assert_eq!(r.failed, 1);
    let st = s.stats();
    assert!(st.writer_paused_nospace);
    assert!(!st.disk_poisoned);
    // Still served: from RAM (dirty, kept) and from disk.
    assert!(s.get(&id(ns, 2)).is_some());
    assert!(s.get(&id(ns, 1)).is_some());
    dev.heal();
    let r = s.flush().unwrap();
    assert_eq!((r.chunks, r.failed), (1, 0));
    assert!(!s.stats().writer_paused_nospace);
}

/// ENOSPC writing the first region's open slot pauses the writer like a
/// full batch write does (it poisoned the disk until reopen): the chunk
/// stays dirty in RAM and is written once the device has room again.
#[test]
fn enospc_opening_a_region_pauses_the_writer() {
    let dir = tempfile::tempdir().unwrap();
    let inner: Arc<dyn Device> = Arc::new(CrashDevice::new(8 * MIB));
    let dev = Arc::new(FaultyDevice::new(inner));
    let s = ChunkStore::open_with_device(config(dir.path()), dev.clone()).unwrap();
    let ns = s.register_namespace(&record(0)).unwrap();
    dev.fail_writes_after(0, libc::ENOSPC);
    s.put(id(ns, 1), payload(1, 5000)).unwrap();
    let r = s.flush().unwrap();
    assert_eq!(r.failed, 1);
    let st = s.stats();
    assert_eq!((st.writer_paused_nospace, st.disk_poisoned), (true, false));
    assert!(s.get(&id(ns, 1)).is_some());
    dev.heal();
    let r = s.flush().unwrap();
    assert_eq!((r.chunks, r.failed), (1, 0));
    assert!(!s.stats().writer_paused_nospace);
    s.close(Duration::from_secs(10)).unwrap();
    drop(s);
    let s = ChunkStore::open_with_device(config(dir.path()), dev).unwrap();
    assert_eq!(s.get(&id(ns, 1)).unwrap().data, payload(1, 5000));
}

/// ENOSPC on any of the three writes that seal a full region and open the
/// next (summary, seal slot, next open slot) pauses the writer; the full
/// region takes no more batches, and its seal is written again once the
/// device has room. Every chunk flushed before and after is there after a
/// restart.
#[test]
fn enospc_sealing_a_region_pauses_and_the_seal_is_written_later() {
    const LEN: usize = 300 * 1024;
    // How many chunks the first region holds (the same on every store of
    // this config).
    let fits = {
        let dir = tempfile::tempdir().unwrap();
        let s = ChunkStore::open(config(dir.path())).unwrap();
        let ns = s.register_namespace(&record(0)).unwrap();
        let mut n = 0;
        loop {
            s.put(id(ns, n), payload(n, LEN)).unwrap();
            s.flush().unwrap();
            if s.disk_location(&id(ns, n)).unwrap().0 != s.disk_location(&id(ns, 0)).unwrap().0 {
                break n;
            }
            n += 1;
        }
    };
    assert!(fits >= 2, "{fits}");
    for failing in 0..3 {
        let dir = tempfile::tempdir().unwrap();
        let inner: Arc<dyn Device> = Arc::new(CrashDevice::new(8 * MIB));
        let dev = Arc::new(FaultyDevice::new(inner));
        let s = ChunkStore::open_with_device(config(dir.path()), dev.clone()).unwrap();
        let ns = s.register_namespace(&record(0)).unwrap();
        for n in 0..fits {
            s.put(id(ns, n), payload(n, LEN)).unwrap();
            s.flush().unwrap();
        }
        let first = s.disk_location(&id(ns, 0)).unwrap().0;
        dev.fail_writes_after(failing, libc::ENOSPC);
        s.put(id(ns, fits), payload(fits, LEN)).unwrap();
        let r = s.flush().unwrap();
        let st = s.stats();
        assert_eq!(
            (r.failed, st.writer_paused_nospace, st.disk_poisoned),
            (1, true, false),
            "write {failing} of the switch failed"
        );
        // Room again, and only a small chunk to write, which would fit in
        // the full region: it must not go there (the failed seal's summary
        // and seal slot may be on the device already).
        assert!(s.delete(&id(ns, fits)));
        dev.heal();
        s.put(id(ns, 100), payload(100, 100)).unwrap();
        let r = s.flush().unwrap();
        assert_eq!((r.chunks, r.failed), (1, 0), "write {failing}");
        assert!(!s.stats().writer_paused_nospace);
        s.put(id(ns, fits), payload(fits, LEN)).unwrap();
        s.flush().unwrap();
        for n in [fits, 100] {
            assert_ne!(s.disk_location(&id(ns, n)).unwrap().0, first);
        }
        s.close(Duration::from_secs(10)).unwrap();
        drop(s);
        let s = ChunkStore::open_with_device(config(dir.path()), dev).unwrap();
        for n in 0..=fits {
            let hit = s
                .get(&id(ns, n))
                .unwrap_or_else(|| panic!("chunk {n} lost"));
            assert_eq!(hit.data, payload(n, LEN), "chunk {n}");
        }
        assert_eq!(s.get(&id(ns, 100)).unwrap().data, payload(100, 100));
    }
}

#[test]
fn a_failed_write_or_sync_poisons_disk_io_until_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let inner: Arc<dyn Device> = Arc::new(CrashDevice::new(8 * MIB));
    let dev = Arc::new(FaultyDevice::new(inner.clone()));
    let s = ChunkStore::open_with_device(config(dir.path()), dev.clone()).unwrap();
    let ns = s.register_namespace(&record(0)).unwrap();
    s.put(id(ns, 1), payload(1, 5000)).unwrap();
    s.flush().unwrap();
    dev.fail_syncs();
    s.put(id(ns, 2), payload(2, 5000)).unwrap();
    assert!(s.flush().is_err());
    assert!(s.stats().disk_poisoned);
    dev.heal();
    assert!(matches!(s.flush(), Err(Error::Poisoned(_))));
    // RAM keeps serving; disk reads are refused (a miss, not a wrong read).
    assert!(s.get(&id(ns, 2)).is_some());
    drop(s);
    let s = ChunkStore::open_with_device(config(dir.path()), dev).unwrap();
    assert_eq!(s.get(&id(ns, 1)).unwrap().data, payload(1, 5000));
    s.put(id(ns, 3), payload(3, 10)).unwrap();
    s.flush().unwrap();
}

#[test]
fn gc_drops_namespaces_by_id_and_by_age() {
    let dir = tempfile::tempdir().unwrap();
    let s = ChunkStore::open(config(dir.path())).unwrap();
    let a = s.register_namespace(&record(0)).unwrap();
    let b = s.register_namespace(&record(1)).unwrap();
    for n in 0..5 {
        s.put(id(a, n), payload(n, 1000)).unwrap();
        s.put(id(b, n), payload(n, 1000)).unwrap();
    }
    s.flush().unwrap();
    let dry = s
        .gc(&GcOptions {
            namespaces: vec![a],
            older_than: None,
            dry_run: true,
        })
        .unwrap();
    assert_eq!((dry.chunks, dry.bytes), (5, 5000));
    assert_eq!(dry.namespaces, vec![a]);
    assert!(s.get(&id(a, 0)).is_some());
    // An id the store does not hold is not reported as dropped.
    let stranger = record(9).id();
    let r = s
        .gc(&GcOptions {
            namespaces: vec![stranger, a],
            older_than: None,
            dry_run: true,
        })
        .unwrap();
    assert_eq!((r.namespaces, r.chunks), (vec![a], 5));
    let r = s
        .gc(&GcOptions {
            namespaces: vec![a],
            older_than: None,
            dry_run: false,
        })
        .unwrap();
    assert_eq!(r.chunks, 5);
    assert!(s.get(&id(a, 0)).is_none());
    assert!(s.namespace_record(&a).is_none());
    assert!(s.get(&id(b, 0)).is_some());
    // By age: everything is younger than an hour, older than zero.
    let r = s
        .gc(&GcOptions {
            namespaces: vec![],
            older_than: Some(Duration::from_secs(3600)),
            dry_run: false,
        })
        .unwrap();
    assert_eq!(r.chunks, 0);
    s.flush().unwrap();
    drop(s);
    // The drop survives a reopen (tombstones).
    let s = ChunkStore::open(config(dir.path())).unwrap();
    assert!(s.get(&id(a, 1)).is_none());
    assert!(s.namespace_record(&a).is_none());
    assert_eq!(s.get(&id(b, 1)).unwrap().data, payload(1, 1000));
    let r = s
        .gc(&GcOptions {
            namespaces: vec![],
            older_than: Some(Duration::ZERO),
            dry_run: false,
        })
        .unwrap();
    assert_eq!(r.namespaces, vec![b]);
    assert_eq!(r.chunks, 5);
}

#[test]
fn a_deletes_journal_that_cannot_be_opened_fails_the_open_at_once() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join(tier::deletes::FILE_NAME)).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let path = dir.path().to_path_buf();
    std::thread::spawn(move || {
        let _ = tx.send(ChunkStore::open(config(&path)).map(|_| ()));
    });
    let r = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("the open returned (it used to hang in the drop of the half-built store)");
    let e = r.expect_err("a journal that is a directory");
    assert!(e.to_string().contains("deletes journal"), "{e}");
}

#[test]
fn ram_only_store_works_without_a_disk() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path());
    cfg.disk_budget = 0;
    let s = ChunkStore::open(cfg).unwrap();
    let ns = s.register_namespace(&record(0)).unwrap();
    s.put(id(ns, 1), payload(1, 100)).unwrap();
    assert_eq!(s.get(&id(ns, 1)).unwrap().tier, Tier::Ram);
    // Nothing is owed to a disk there is not: puts are clean, a flush has
    // nothing to do and succeeds.
    assert_eq!(s.stats().dirty_bytes, 0);
    let r = s.flush().unwrap();
    assert_eq!(r.failed, 0, "{r:?}");
    assert!(s.delete(&id(ns, 1)));
    assert!(s.get(&id(ns, 1)).is_none());
    // Past the RAM budget the oldest go as plain evictions, not as dropped
    // writes (which would trip an operator's alert on every RAM-only node).
    for n in 0..12 {
        s.put(id(ns, n), payload(n, 512 * 1024)).unwrap();
    }
    let st = s.stats();
    assert_eq!(st.puts, 13, "{st:?}");
    assert!(st.ram_evictions >= 4, "{st:?}");
    assert_eq!(st.dropped_unwritten, 0, "{st:?}");
    // Every RAM eviction of a RAM-only store leaves the node.
    assert_eq!(st.evicted_chunks, st.ram_evictions, "{st:?}");
    assert_eq!(s.flush().unwrap().failed, 0);
    assert!(s.get(&id(ns, 11)).is_some());
    assert!(s.get(&id(ns, 0)).is_none());
    // A value as large as the budget does not fit beside its key: said so.
    let e = s
        .put_named(
            id(ns, 99),
            Bytes::from_static(b"key"),
            payload(99, 4 * MIB as usize),
        )
        .unwrap_err();
    let limit = 4 * MIB - 3 - tier::ram::ENTRY_COST;
    assert!(
        e.to_string().contains("less the key and the bookkeeping")
            && e.to_string()
                .contains(&format!("chunk of {} bytes", 4 * MIB))
            && e.to_string().contains(&format!("is {limit} bytes")),
        "{e}"
    );
    assert!(!dir.path().join("store.kvt").exists());
}

#[test]
fn unknown_namespace_and_oversized_chunks_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let s = ChunkStore::open(config(dir.path())).unwrap();
    let ns = record(5).id();
    assert!(matches!(
        s.put(id(ns, 1), payload(1, 10)),
        Err(Error::UnknownNamespace(_))
    ));
    let ns = s.register_namespace(&record(0)).unwrap();
    assert!(matches!(
        s.put(id(ns, 1), payload(1, 5 << 20)),
        Err(Error::TooLarge { .. })
    ));
    // A namespace record is small: one of megabytes (every registration
    // rewrites the manifest) is refused and not kept.
    let huge = NamespaceRecord {
        model: "m".repeat(tier::store::MAX_RECORD_BYTES),
        ..record(1)
    };
    let e = s.register_namespace(&huge).unwrap_err();
    assert!(e.to_string().contains("16 KiB"), "{e}");
    assert_eq!(s.namespaces().len(), 1);
    let fits = NamespaceRecord {
        model: "m".repeat(tier::store::MAX_RECORD_BYTES / 2),
        ..record(1)
    };
    s.register_namespace(&fits).unwrap();
    drop(s);
    // The count is bounded too: past it a new namespace is refused, the
    // registered ones still register.
    let dir = tempfile::tempdir().unwrap();
    let s = ChunkStore::open(TierConfig {
        max_namespaces: 3,
        ..config(dir.path())
    })
    .unwrap();
    for rank in 0..3 {
        s.register_namespace(&record(rank)).unwrap();
    }
    let e = s.register_namespace(&record(3)).unwrap_err();
    assert!(matches!(e, Error::NoSpace { .. }), "{e}");
    assert!(e.to_string().contains("max-namespaces 3"), "{e}");
    s.register_namespace(&record(1)).unwrap();
    assert_eq!(s.namespaces().len(), 3);
}

#[test]
fn a_chunk_no_region_can_hold_is_refused_at_the_put() {
    let dir = tempfile::tempdir().unwrap();
    let s = ChunkStore::open(config(dir.path())).unwrap();
    let ns = s.register_namespace(&record(0)).unwrap();
    let max = s.max_chunk_len(0) as usize;
    let named = s.max_chunk_len(100) as usize;
    // A region of 1 MiB less its slots, one batch head, the header and a
    // summary: a few blocks.
    assert!(
        max < MIB as usize && max > (MIB - (32 << 10)) as usize,
        "{max}"
    );
    assert!(named < max, "a name makes the header longer");
    let too_large =
        |r: tier::Result<()>| matches!(r, Err(Error::TooLarge { limit, .. }) if limit < MIB);
    assert!(too_large(s.put(id(ns, 1), payload(1, max + 1))));
    let name = Bytes::from(vec![b'n'; 100]);
    assert!(too_large(s.put_named(
        id(ns, 2),
        name.clone(),
        payload(2, named + 1)
    )));
    assert!(too_large(s.put_atomic(vec![
        (id(ns, 3), payload(3, 10)),
        (id(ns, 4), payload(4, max + 1)),
    ])));
    assert!(s.get(&id(ns, 3)).is_none(), "a refused group puts nothing");
    // What is accepted is written.
    s.put(id(ns, 1), payload(1, max)).unwrap();
    s.put_named(id(ns, 2), name.clone(), payload(2, named))
        .unwrap();
    let r = s.flush().unwrap();
    assert_eq!((r.chunks, r.failed), (2, 0));
    assert_eq!(s.stats().dirty_bytes, 0);
    s.close(Duration::from_secs(10)).unwrap();
    let s = ChunkStore::open(config(dir.path())).unwrap();
    let h = s.get(&id(ns, 1)).expect("written");
    assert_eq!((h.tier, h.data.len()), (Tier::Disk, max));
    assert!(h.data == payload(1, max));
    let h = s.get_named(&id(ns, 2), &name).expect("written");
    assert!(h.data == payload(2, named));
}

/// Fills `n` chunks of 300 KiB (three to a 1 MiB region) and closes.
fn fill_and_close(dir: &std::path::Path, n: u64) -> tier::Namespace {
    let s = ChunkStore::open(config(dir)).unwrap();
    let ns = s.register_namespace(&record(0)).unwrap();
    for k in 0..n {
        s.put(id(ns, k), payload(k, 300 << 10)).unwrap();
    }
    s.close(Duration::from_secs(10)).unwrap();
    ns
}

fn file_len(dir: &std::path::Path) -> u64 {
    std::fs::metadata(dir.join(tier::store::STORE_FILE))
        .unwrap()
        .len()
}

#[test]
fn a_refused_reopen_leaves_the_store_file_as_it_was() {
    let dir = tempfile::tempdir().unwrap();
    let ns = fill_and_close(dir.path(), 6);
    assert_eq!(file_len(dir.path()), 8 * MIB);
    let larger = TierConfig {
        disk_budget: 16 * MIB,
        ..config(dir.path())
    };
    let e = ChunkStore::open(larger).err().expect("refused").to_string();
    assert!(e.contains("disk-budget gives 16"), "{e}");
    assert_eq!(file_len(dir.path()), 8 * MIB, "not grown by the refusal");
    let other_regions = TierConfig {
        disk_budget: 16 * MIB,
        region_size: 2 * MIB,
        ..config(dir.path())
    };
    let e = ChunkStore::open(other_regions)
        .err()
        .expect("refused")
        .to_string();
    assert!(e.contains("region-size"), "{e}");
    assert_eq!(file_len(dir.path()), 8 * MIB);
    // A superblock that does not decode is refused before anything grows.
    let path = dir.path().join(tier::store::STORE_FILE);
    let flip = |at: u64| {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        let mut b = [0u8; 1];
        f.read_exact_at(&mut b, at).unwrap();
        f.write_all_at(&[b[0] ^ 0xff], at).unwrap();
    };
    flip(20);
    let larger = TierConfig {
        disk_budget: 16 * MIB,
        ..config(dir.path())
    };
    let e = ChunkStore::open(larger).err().expect("refused").to_string();
    assert!(e.contains("superblock"), "{e}");
    assert_eq!(file_len(dir.path()), 8 * MIB, "not grown by the refusal");
    flip(20);
    // The store opens as it was.
    let s = ChunkStore::open(config(dir.path())).unwrap();
    for k in 0..6 {
        assert!(s.get(&id(ns, k)).unwrap().data == payload(k, 300 << 10));
    }
    drop(s);
    // A file an older version grew past its store is trimmed back.
    std::fs::OpenOptions::new()
        .write(true)
        .open(dir.path().join(tier::store::STORE_FILE))
        .unwrap()
        .set_len(16 * MIB)
        .unwrap();
    let s = ChunkStore::open(config(dir.path())).unwrap();
    assert_eq!(file_len(dir.path()), 8 * MIB);
    assert_eq!(s.stats().disk_chunks, 6);
}

#[test]
fn a_store_file_cut_inside_its_superblock_is_called_truncated() {
    let dir = tempfile::tempdir().unwrap();
    fill_and_close(dir.path(), 1);
    let path = dir.path().join(tier::store::STORE_FILE);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(10)
        .unwrap();
    let e = ChunkStore::open(config(dir.path())).err().expect("refused");
    assert!(
        e.to_string()
            .contains("the file is 10 bytes, shorter than its own superblock (truncated)"),
        "{e}"
    );
    assert_eq!(file_len(dir.path()), 10, "a refused open writes nothing");
}

/// A store file whose superblock was zeroed but which holds chunks is
/// refused, not formatted anew at the configured geometry (QA: it came back
/// as a larger store with half its chunks gone, logged at INFO only); a
/// file of zeros (a format that crashed before its superblock) is
/// formatted.
#[test]
fn a_store_file_that_lost_its_superblock_is_refused_not_formatted() {
    use std::os::unix::fs::FileExt;
    let dir = tempfile::tempdir().unwrap();
    let ns = fill_and_close(dir.path(), 6);
    let path = dir.path().join(tier::store::STORE_FILE);
    let zero_at = |at: u64| {
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .write_all_at(&[0u8; 4096], at)
            .unwrap();
    };
    zero_at(0);
    let before = std::fs::read(&path).unwrap();
    for region_size in [MIB, 2 * MIB] {
        let other = TierConfig {
            region_size,
            disk_budget: 16 * MIB,
            ..config(dir.path())
        };
        let e = ChunkStore::open(other).err().expect("refused").to_string();
        assert!(
            e.contains("no kvtier superblock") && e.contains("holds store data"),
            "{e}"
        );
        assert!(
            std::fs::read(&path).unwrap() == before,
            "a refused open writes nothing"
        );
    }
    // The whole first region zeroed, and opened with regions larger than
    // the file (review: only region 0's blocks were looked at then): the
    // rest of the file still gives it away.
    zero_at(0);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .write_all_at(&vec![0u8; MIB as usize], 0)
        .unwrap();
    let larger = TierConfig {
        region_size: 8 * MIB,
        disk_budget: 16 * MIB,
        ram_budget: 16 * MIB,
        ..config(dir.path())
    };
    let e = ChunkStore::open(larger).err().expect("refused").to_string();
    assert!(e.contains("holds store data"), "{e}");
    // Past the first 64 MiB, what may be an open slot of regions of any
    // whole number of MiB: here region 2 of 40 MiB regions (or 8 of 10).
    let big = dir.path().join("big");
    std::fs::create_dir_all(&big).unwrap();
    let f = std::fs::File::create(big.join(tier::store::STORE_FILE)).unwrap();
    f.set_len(128 * MIB).unwrap();
    f.write_all_at(&[0x4b; 64], 2 * 40 * MIB + 4096).unwrap();
    let e = ChunkStore::open(config(&big))
        .err()
        .expect("refused")
        .to_string();
    assert!(
        e.contains("holds store data") && e.contains(&format!("at byte {}", 80 * MIB + 4096)),
        "{e}"
    );
    // All zeros: a new store.
    std::fs::write(&path, vec![0u8; 8 * MIB as usize]).unwrap();
    let s = ChunkStore::open(config(dir.path())).expect("formatted");
    let ns2 = s.register_namespace(&record(0)).unwrap();
    assert_eq!(ns2, ns);
    assert!(s.get(&id(ns, 0)).is_none());
}

#[test]
fn a_truncated_store_file_is_refused_until_grown_on_purpose() {
    let dir = tempfile::tempdir().unwrap();
    let ns = fill_and_close(dir.path(), 12);
    let path = dir.path().join(tier::store::STORE_FILE);
    // Cut into the third region: the chunks of regions 0 and 1 stay whole.
    let cut = 2 * MIB + (100 << 10);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(cut)
        .unwrap();
    let e = ChunkStore::open(config(dir.path()))
        .err()
        .expect("refused")
        .to_string();
    assert!(
        e.contains("truncated") && e.contains("verify --repair"),
        "{e}"
    );
    assert_eq!(file_len(dir.path()), cut, "a refused open writes nothing");
    let grow = TierConfig {
        grow_truncated: true,
        ..config(dir.path())
    };
    let s = ChunkStore::open(grow).unwrap();
    assert_eq!(file_len(dir.path()), 8 * MIB);
    let mut whole = 0;
    for k in 0..12 {
        if let Some(h) = s.get(&id(ns, k)) {
            assert!(
                h.data == payload(k, 300 << 10),
                "chunk {k} is intact or a miss"
            );
            whole += 1;
        }
    }
    // Regions 0 and 1 hold chunks 0..6 (three each); what was past the cut
    // is gone.
    assert!((6..12).contains(&whole), "{whole}");
    s.close(Duration::from_secs(10)).unwrap();
    ChunkStore::open(config(dir.path())).expect("whole again");
}

#[test]
fn the_store_is_private_to_its_user_and_group() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("a").join("data");
    let s = ChunkStore::open(config(&data)).unwrap();
    s.register_namespace(&record(0)).unwrap();
    s.close(Duration::from_secs(10)).unwrap();
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    // Under any umask: nothing for others, nothing executable in files.
    for d in [dir.path().join("a"), data.clone()] {
        assert_eq!(mode(&d) & 0o027, 0, "{}: {:o}", d.display(), mode(&d));
    }
    let mut files = 0;
    for e in std::fs::read_dir(&data).unwrap() {
        let p = e.unwrap().path();
        assert_eq!(mode(&p) & 0o137, 0, "{}: {:o}", p.display(), mode(&p));
        files += 1;
    }
    assert!(files >= 2, "the store file and the manifest");
}

/// Run as root on a data dir of another user (`sudo kvtier verify`), the
/// store leaves files that user owns, so the service can still read them.
#[test]
fn files_made_as_root_in_another_users_data_dir_belong_to_that_user() {
    use std::os::unix::fs::MetadataExt;
    // SAFETY: a plain syscall without arguments.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("SKIPPED: needs root to chown");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir(&data).unwrap();
    std::os::unix::fs::chown(&data, Some(4242), Some(4343)).unwrap();
    let s = ChunkStore::open(config(&data)).unwrap();
    s.register_namespace(&record(0)).unwrap();
    s.close(Duration::from_secs(10)).unwrap();
    let mut files = 0;
    for e in std::fs::read_dir(&data).unwrap() {
        let m = e.unwrap().metadata().unwrap();
        assert_eq!((m.uid(), m.gid()), (4242, 4343));
        files += 1;
    }
    assert!(files >= 2, "the store file and the manifest");
}

#[test]
fn an_atomic_group_is_seen_whole_or_not_at_all() {
    let dir = tempfile::tempdir().unwrap();
    let s = Arc::new(ChunkStore::open(config(dir.path())).unwrap());
    let ns = s.register_namespace(&record(0)).unwrap();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let keys: Vec<Vec<ChunkKey>> = (0..50u64)
        .map(|g| {
            (0..4)
                .map(|m| ChunkKey([(g * 4 + m) as u8 + 1; 32]))
                .collect()
        })
        .collect();
    let reader = {
        let (s, stop, keys) = (s.clone(), stop.clone(), keys.clone());
        std::thread::spawn(move || {
            let mut tiers = Vec::new();
            let mut seen_whole = 0;
            while !stop.load(Ordering::SeqCst) {
                for k in &keys {
                    let n = s.lookup_prefix(ns, 0, k, &mut tiers);
                    let present = tiers.iter().filter(|t| t.is_some()).count();
                    assert!(present == 0 || present == 4, "half a group: {present}");
                    assert_eq!(n, present);
                    seen_whole += usize::from(present == 4);
                }
            }
            seen_whole
        })
    };
    for k in &keys {
        let chunks = k
            .iter()
            .enumerate()
            .map(|(i, key)| (ChunkId::new(ns, *key, 0), payload(i as u64, 3000)))
            .collect();
        s.put_atomic(chunks).unwrap();
    }
    stop.store(true, Ordering::SeqCst);
    reader.join().unwrap();
    for k in &keys {
        for key in k {
            assert!(s.get(&ChunkId::new(ns, *key, 0)).is_some());
        }
    }
    // A group larger than RAM is refused whole.
    let big: Vec<_> = (0..5u64)
        .map(|n| (id(ns, 10_000 + n), payload(n, 1 << 20)))
        .collect();
    assert!(matches!(s.put_atomic(big), Err(Error::TooLarge { .. })));
    assert!(s.get(&id(ns, 10_000)).is_none());
}

/// A newer version of a flushed group that only partly reached the disk
/// before a crash is undone whole: the flushed group comes back, both
/// members (QA: the partial member was dropped instead, losing the flushed
/// version under it, and the other member of the flushed group was shown
/// alone).
#[test]
fn a_crash_mid_group_brings_back_the_group_before() {
    let dir = tempfile::tempdir().unwrap();
    let dev = Arc::new(CrashDevice::new(8 * MIB));
    let mut cfg = config(dir.path());
    cfg.ram_budget = MIB;
    let s = ChunkStore::open_with_device(cfg.clone(), dev.clone()).unwrap();
    let ns = s.register_namespace(&record(0)).unwrap();
    let (a, b) = (id(ns, 1), id(ns, 2));
    const LEN: usize = 300 << 10;
    s.put_atomic(vec![(a, payload(1, LEN)), (b, payload(2, LEN))])
        .unwrap();
    s.flush().unwrap();
    // And again with other bytes, then fillers: RAM evicts the new A (its
    // least recently used), so it alone is written.
    s.put_atomic(vec![(a, payload(11, LEN)), (b, payload(12, LEN))])
        .unwrap();
    s.put(id(ns, 3), payload(3, LEN)).unwrap();
    s.put(id(ns, 4), payload(4, LEN)).unwrap();
    // Wait until the new A is written and synced (the writer syncs once
    // idle), the new B still only in RAM.
    let t = Instant::now();
    let mut synced_at = None;
    loop {
        assert!(t.elapsed() < Duration::from_secs(10), "A was never written");
        if synced_at.is_none() && s.disk_location(&a).is_some() {
            synced_at = Some(dev.syncs());
        }
        if synced_at.is_some_and(|n| dev.syncs() > n) {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(s.disk_location(&b).is_none(), "the new B is not written");
    // A crash now: what was synced is all there is.
    let img = dev.durable_image();
    dev.crash_now();
    drop(s);
    let s = ChunkStore::open_with_device(cfg, Arc::new(CrashDevice::from_image(img))).unwrap();
    let got = |i: &ChunkId| s.get(i).map(|h| h.data);
    assert_eq!(got(&a), Some(payload(1, LEN)), "A of the flushed group");
    assert_eq!(got(&b), Some(payload(2, LEN)), "B of the flushed group");
}

/// A member of a group not yet written that is overwritten, deleted or
/// put in another group leaves it; the rest of the group is still
/// restored after a flush and a restart (QA: recovery found fewer members
/// than the group recorded and dropped the rest, also after a clean stop).
#[test]
fn the_rest_of_a_group_survives_a_member_leaving_before_any_write() {
    for how in ["overwrite", "delete", "regroup"] {
        let dir = tempfile::tempdir().unwrap();
        let s = ChunkStore::open(config(dir.path())).unwrap();
        let ns = s.register_namespace(&record(0)).unwrap();
        let (a, b, c) = (id(ns, 1), id(ns, 2), id(ns, 3));
        s.put_atomic(vec![
            (a, payload(1, 5_000)),
            (b, payload(2, 5_000)),
            (c, payload(3, 5_000)),
        ])
        .unwrap();
        let d = id(ns, 4);
        let mut want_a = None;
        match how {
            "overwrite" => {
                s.put(a, payload(11, 6_000)).unwrap();
                want_a = Some(payload(11, 6_000));
            }
            "delete" => assert!(s.delete(&a)),
            _ => {
                s.put_atomic(vec![(a, payload(21, 7_000)), (d, payload(4, 7_000))])
                    .unwrap();
                want_a = Some(payload(21, 7_000));
            }
        }
        s.flush().unwrap();
        s.close(Duration::from_secs(10)).unwrap();
        drop(s);
        let s = ChunkStore::open(config(dir.path())).unwrap();
        let got = |i: &ChunkId| s.get(i).map(|h| h.data);
        assert_eq!(got(&a), want_a, "{how}: A");
        assert_eq!(got(&b), Some(payload(2, 5_000)), "{how}: B");
        assert_eq!(got(&c), Some(payload(3, 5_000)), "{how}: C");
        if how == "regroup" {
            assert_eq!(got(&d), Some(payload(4, 7_000)), "{how}: D");
        }
    }
}

/// The same once a member of the group is already on disk: the member
/// that leaves is written for the group before what replaces it (QA: the
/// group was found short of that member at the restart and the written
/// member was undone).
#[test]
fn the_rest_of_a_group_survives_a_member_leaving_after_another_was_written() {
    for how in ["overwrite", "delete", "regroup"] {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = config(dir.path());
        cfg.ram_budget = MIB;
        let s = ChunkStore::open(cfg.clone()).unwrap();
        let ns = s.register_namespace(&record(0)).unwrap();
        let (a, b, d) = (id(ns, 1), id(ns, 2), id(ns, 4));
        const LEN: usize = 300 << 10;
        // B first: the least recently used, so the fillers evict B alone.
        s.put_atomic(vec![(b, payload(2, LEN)), (a, payload(1, LEN))])
            .unwrap();
        s.put(id(ns, 10), payload(10, LEN)).unwrap();
        s.put(id(ns, 11), payload(11, LEN)).unwrap();
        let t = Instant::now();
        while s.disk_location(&b).is_none() {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "{how}: B never written"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(s.disk_location(&a).is_none(), "{how}: A is not written yet");
        let mut want_a = None;
        match how {
            "overwrite" => {
                s.put(a, payload(21, 6_000)).unwrap();
                want_a = Some(payload(21, 6_000));
            }
            "delete" => assert!(s.delete(&a)),
            _ => {
                s.put_atomic(vec![(a, payload(31, 7_000)), (d, payload(4, 7_000))])
                    .unwrap();
                want_a = Some(payload(31, 7_000));
            }
        }
        s.flush().unwrap();
        s.close(Duration::from_secs(10)).unwrap();
        drop(s);
        let s = ChunkStore::open(cfg).unwrap();
        let got = |i: &ChunkId| s.get(i).map(|h| h.data);
        assert_eq!(got(&b), Some(payload(2, LEN)), "{how}: B");
        assert_eq!(got(&a), want_a, "{how}: A");
        if how == "regroup" {
            assert_eq!(got(&d), Some(payload(4, 7_000)), "{how}: D");
        }
    }
}

#[test]
fn a_group_that_loses_a_member_unwritten_disappears_whole() {
    let dir = tempfile::tempdir().unwrap();
    // The writer stalls: evictions get dropped.
    let (s, dev, ns) = stalled_store(dir.path(), |c| {
        c.writer_queue = 1;
        c.spill_limit = Some(1);
    });
    let group: Vec<_> = (0..3u64)
        .map(|n| (id(ns, n), payload(n, 200 << 10)))
        .collect();
    s.put_atomic(group).unwrap();
    for n in 0..3 {
        assert!(s.locate(&id(ns, n)).is_some());
    }
    // Push the group out of RAM: with the writer stalled, members are dropped.
    for n in 10..20 {
        s.put(id(ns, n), payload(n, 200 << 10)).unwrap();
    }
    assert!(s.stats().dropped_unwritten >= 2);
    dev.release();
    s.flush().unwrap();
    let present: Vec<bool> = (0..3).map(|n| s.get(&id(ns, n)).is_some()).collect();
    assert_eq!(
        present,
        vec![false; 3],
        "no member of a broken group stays visible"
    );
    // The cancellations of the broken group's writes are pruned once the
    // writer has handled what was queued before them (no leak).
    s.flush().unwrap();
    assert_eq!(s.cancelled_writes(), 0);
    // Many broken groups leave nothing behind either.
    *dev.open.lock() = false;
    for g in 0..20u64 {
        let group: Vec<_> = (0..3u64)
            .map(|n| (id(ns, 1000 + g * 10 + n), payload(n, 200 << 10)))
            .collect();
        s.put_atomic(group).unwrap();
    }
    assert!(
        s.cancelled_writes() > 0,
        "groups broke while the writer stalled"
    );
    dev.release();
    s.flush().unwrap();
    assert_eq!(s.cancelled_writes(), 0);
}

#[test]
fn buffered_fallback_when_o_direct_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("dev");
    let dev =
        Arc::new(FileDevice::open(&path, 8 * MIB, DirectMode::SimulateUnsupported, 0).unwrap());
    let s = ChunkStore::open_with_device(config(dir.path()), dev.clone()).unwrap();
    assert!(!s.stats().direct_io, "fallback is visible in the stats");
    let ns = s.register_namespace(&record(0)).unwrap();
    s.put(id(ns, 1), payload(1, 70_000)).unwrap();
    s.flush().unwrap();
    drop(s);
    // The same file works with O_DIRECT (where the filesystem allows it).
    let dev = Arc::new(FileDevice::open(&path, 8 * MIB, DirectMode::Auto, 0).unwrap());
    let s = ChunkStore::open_with_device(config(dir.path()), dev).unwrap();
    assert_eq!(s.get(&id(ns, 1)).unwrap().data, payload(1, 70_000));
}

#[test]
fn recovery_of_the_open_region_drops_only_the_corrupt_chunk() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path());
    cfg.direct_io = false;
    let (ns, bad) = {
        let s = ChunkStore::open(cfg.clone()).unwrap();
        let ns = s.register_namespace(&record(0)).unwrap();
        for n in 0..3 {
            s.put(id(ns, n), payload(n, 9000)).unwrap();
            s.flush().unwrap(); // one batch each
        }
        let bad = s.disk_location(&id(ns, 1)).unwrap();
        drop(s); // no seal: the region stays open on disk
        (ns, bad)
    };
    flip_byte(&dir.path().join("store.kvt"), bad.1 + 128 + 4000);
    let s = ChunkStore::open(cfg.clone()).unwrap();
    assert_eq!(s.stats().verify_failures, 1, "counted at recovery");
    assert!(s.get(&id(ns, 1)).is_none());
    assert_eq!(s.get(&id(ns, 0)).unwrap().data, payload(0, 9000));
    assert_eq!(
        s.get(&id(ns, 2)).unwrap().data,
        payload(2, 9000),
        "later batches kept"
    );
    // The recovered region is re-opened for appends (not sealed): new
    // batches go after the intact ones and everything survives a reopen.
    s.put(id(ns, 3), payload(3, 9000)).unwrap();
    s.flush().unwrap();
    assert_eq!(s.stats().region_evictions, 0);
    drop(s);
    let s = ChunkStore::open(cfg).unwrap();
    // The region is still open, so it is scanned again: the bad record is
    // still on disk and counted again, and still left out.
    assert_eq!(s.stats().verify_failures, 1);
    assert_eq!(s.stats().disk_chunks, 3);
    assert!(s.get(&id(ns, 1)).is_none());
    for n in [0, 2, 3] {
        assert_eq!(s.get(&id(ns, n)).unwrap().data, payload(n, 9000));
    }
    assert_eq!(s.disk_location(&id(ns, 3)).unwrap().0, bad.0, "same region");
}

#[test]
fn restarts_append_to_the_open_region_instead_of_wasting_it() {
    // 4 regions of 256 KiB; 24 restarts, each putting 3 chunks of 8 KiB
    // (about 600 KiB in all). Sealing the open region at every open would
    // need 24 regions and reclaim the oldest; re-opening needs 3.
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path());
    cfg.region_size = 256 << 10;
    cfg.disk_budget = 4 * cfg.region_size;
    let ns = record(0).id();
    let mut regions = std::collections::BTreeSet::new();
    for round in 0..24u64 {
        let s = ChunkStore::open(cfg.clone()).unwrap();
        s.register_namespace(&record(0)).unwrap();
        for i in 0..3 {
            let n = round * 10 + i;
            s.put(id(ns, n), payload(n, 8192)).unwrap();
        }
        if round % 3 == 0 {
            drop(s); // no close: only what the last round flushed is durable
            continue;
        }
        s.flush().unwrap();
        assert_eq!(s.stats().region_evictions, 0, "round {round}");
        for i in 0..3 {
            regions.insert(s.disk_location(&id(ns, round * 10 + i)).unwrap().0);
        }
        s.close(Duration::from_secs(30)).unwrap();
    }
    let s = ChunkStore::open(cfg).unwrap();
    for round in (0..24u64).filter(|r| r % 3 != 0) {
        for i in 0..3 {
            let n = round * 10 + i;
            assert_eq!(
                s.get(&id(ns, n)).map(|h| h.data),
                Some(payload(n, 8192)),
                "chunk {n} of round {round}"
            );
        }
    }
    assert!(regions.len() <= 3, "regions used: {regions:?}");
}

/// Files planted in the data dir under the store's names are never
/// followed or waited on: a symbolic link (to a file root owns, say) is
/// refused or replaced, never written through, and a FIFO is refused at
/// once (the open used to block on it for good).
#[test]
fn links_and_fifos_planted_in_the_data_dir_are_never_followed() {
    let outside = tempfile::tempdir().unwrap();
    let victim = outside.path().join("victim");
    std::fs::write(&victim, b"SECRET").unwrap();
    let open_in_thread = |dir: &std::path::Path| {
        let (tx, rx) = std::sync::mpsc::channel();
        let path = dir.to_path_buf();
        std::thread::spawn(move || {
            let _ = tx.send(ChunkStore::open(config(&path)).map(|_| ()));
        });
        rx.recv_timeout(Duration::from_secs(30))
            .expect("the open returned")
    };
    for name in [
        tier::store::STORE_FILE,
        tier::deletes::FILE_NAME,
        "namespaces.json",
    ] {
        let dir = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(&victim, dir.path().join(name)).unwrap();
        let e = open_in_thread(dir.path()).expect_err(name);
        assert!(e.to_string().contains("symbolic link"), "{name}: {e}");
        assert_eq!(std::fs::read(&victim).unwrap(), b"SECRET", "{name}");
        let dir = tempfile::tempdir().unwrap();
        let fifo =
            std::ffi::CString::new(dir.path().join(name).as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid C string.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
        let e = open_in_thread(dir.path()).expect_err(name);
        assert!(e.to_string().contains("not a regular file"), "{name}: {e}");
    }
    // Hard links: a store file with another name (a store elsewhere, or a
    // file of someone else's) is refused, not written through.
    let elsewhere = tempfile::tempdir_in(outside.path()).unwrap();
    ChunkStore::open(config(elsewhere.path()))
        .unwrap()
        .close(Duration::from_secs(5))
        .unwrap();
    let other = elsewhere.path().join(tier::store::STORE_FILE);
    let before = std::fs::read(&other).unwrap();
    let dir = tempfile::tempdir_in(outside.path()).unwrap();
    std::fs::hard_link(&other, dir.path().join(tier::store::STORE_FILE)).unwrap();
    let e = open_in_thread(dir.path()).expect_err("a hard-linked store file");
    assert!(e.to_string().contains("hard links"), "{e}");
    assert!(std::fs::read(&other).unwrap() == before, "left as it was");
    let dir = tempfile::tempdir_in(outside.path()).unwrap();
    std::fs::hard_link(&victim, dir.path().join(tier::deletes::FILE_NAME)).unwrap();
    let e = open_in_thread(dir.path()).expect_err("a hard-linked journal");
    assert!(e.to_string().contains("hard links"), "{e}");
    assert_eq!(std::fs::read(&victim).unwrap(), b"SECRET");
    // The manifest's temporary file: a link there is removed, not written
    // through, and the manifest is saved.
    let dir = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(&victim, dir.path().join("namespaces.json.tmp")).unwrap();
    let s = ChunkStore::open(config(dir.path())).unwrap();
    s.register_namespace(&record(0)).unwrap();
    assert_eq!(std::fs::read(&victim).unwrap(), b"SECRET");
    assert!(tier::manifest::load(dir.path()).unwrap().len() == 1);
}

/// Damaged region metadata (bit rot, not a crash): a flipped bit in an open
/// slot loses nothing (the generation comes from the region's own records),
/// a summary that passes its CRC but not validation is walked around, and a
/// damaged batch record is counted (`damaged_metadata`, which fails
/// `verify`); it used to read as a free region or a clean end of the chain,
/// losing flushed chunks without a word, or to make the store unopenable.
#[test]
fn damaged_region_metadata_is_recovered_around_or_counted() {
    use tier::format::crc32c;
    const REGION: u64 = 64 << 10;
    let make = || {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = config(dir.path());
        cfg.direct_io = false;
        cfg.region_size = REGION; // chunks 0..3 in a sealed region, 3 in the open one
        let s = ChunkStore::open(cfg.clone()).unwrap();
        let ns = s.register_namespace(&record(0)).unwrap();
        for n in 0..4 {
            s.put(id(ns, n), payload(n, 12_000)).unwrap();
        }
        s.flush().unwrap();
        let regions: Vec<u32> = (0..4)
            .map(|n| s.disk_location(&id(ns, n)).unwrap().0)
            .collect();
        s.close(Duration::from_secs(5)).unwrap();
        assert_eq!(regions[0], regions[2]);
        assert_ne!(regions[0], regions[3]);
        (dir, cfg, ns, u64::from(regions[0]), u64::from(regions[3]))
    };
    let reopen = |cfg: &TierConfig, ns, lost: &[u64]| {
        let s = ChunkStore::open(cfg.clone()).unwrap();
        for n in 0..4 {
            match s.get(&id(ns, n)) {
                Some(h) => {
                    assert!(!lost.contains(&n), "chunk {n} is back");
                    assert_eq!(h.data, payload(n, 12_000), "chunk {n}");
                }
                None => assert!(lost.contains(&n), "chunk {n} lost"),
            }
        }
        s.stats().damaged_metadata
    };
    let slot_of = |r: u64| r * REGION + 4096;
    // The open slot of the sealed region, then of the open one.
    for which in [0, 1] {
        let (dir, cfg, ns, sealed, open) = make();
        let r = if which == 0 { sealed } else { open };
        flip_byte(&dir.path().join("store.kvt"), slot_of(r) + 20);
        assert_eq!(reopen(&cfg, ns, &[]), 1, "open slot of region {r}");
        assert_eq!(reopen(&cfg, ns, &[]), 1, "the same at the next open");
    }
    // The first batch record of the open region: its chunk is lost, said.
    let (dir, cfg, ns, _, open) = make();
    flip_byte(&dir.path().join("store.kvt"), open * REGION + 3 * 4096 + 20);
    assert_eq!(reopen(&cfg, ns, &[3]), 1);
    // The sealed region's seal slot, then a byte of its summary: its
    // batches are walked instead, nothing is lost, and it is counted.
    for at in [2 * 4096 + 20, 0] {
        let (dir, cfg, ns, sealed, _) = make();
        let at = if at == 0 {
            let file = std::fs::File::open(dir.path().join("store.kvt")).unwrap();
            let mut seal = [0u8; 44];
            file.read_exact_at(&mut seal, sealed * REGION + 2 * 4096)
                .unwrap();
            let off = u32::from_le_bytes(seal[24..28].try_into().unwrap());
            u64::from(off) + 10
        } else {
            at
        };
        flip_byte(&dir.path().join("store.kvt"), sealed * REGION + at);
        assert_eq!(reopen(&cfg, ns, &[]), 1, "seal slot or summary at {at}");
    }
    // A crafted seal slot (valid CRC) claiming u32::MAX entries: only a
    // capacity hint, bounded by what the region can hold (it asked for
    // billions of index entries and aborted the open).
    {
        let (dir, cfg, ns, sealed, _) = make();
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(dir.path().join("store.kvt"))
            .unwrap();
        let mut block = vec![0u8; 4096];
        file.read_exact_at(&mut block, sealed * REGION + 2 * 4096)
            .unwrap();
        let mut seal = tier::layout::SealSlot::decode(&block).expect("a sealed region");
        seal.entry_count = u32::MAX;
        seal.encode_into(&mut block);
        file.write_all_at(&block, sealed * REGION + 2 * 4096)
            .unwrap();
        drop(file);
        assert!(reopen(&cfg, ns, &[]) <= 1, "the crafted count");
    }
    // Both the open slot and the first batch record of the open region: no
    // generation is known, the region counts as free (its chunk lost,
    // said). The repair zeroes the slot: later opens are clean, and the
    // region takes new chunks.
    let (dir, cfg, ns, _, open) = make();
    flip_byte(&dir.path().join("store.kvt"), slot_of(open) + 20);
    flip_byte(&dir.path().join("store.kvt"), open * REGION + 3 * 4096 + 20);
    assert_eq!(
        reopen(&cfg, ns, &[3]),
        1,
        "the slot (the free region is not walked)"
    );
    {
        let s = ChunkStore::open(cfg.clone()).unwrap();
        assert!(s.seal_open_region().unwrap(), "slots rewritten");
        s.close(Duration::from_secs(5)).unwrap();
    }
    assert_eq!(reopen(&cfg, ns, &[3]), 0, "clean after the repair");
    {
        let s = ChunkStore::open(cfg.clone()).unwrap();
        for n in 10..14 {
            s.put(id(ns, n), payload(n, 12_000)).unwrap();
        }
        s.close(Duration::from_secs(5)).unwrap();
        let s = ChunkStore::open(cfg.clone()).unwrap();
        for n in 10..14 {
            assert_eq!(s.get(&id(ns, n)).unwrap().data, payload(n, 12_000));
        }
        assert_eq!(s.stats().damaged_metadata, 0);
    }
    // Past the end of the chain, a block that starts with the record's
    // magic but names no region of this store (an older generation's
    // payload): the chain's normal end, not damage.
    let (dir, cfg, ns, _, open) = make();
    let (_, at, _) = {
        let s = ChunkStore::open(cfg.clone()).unwrap();
        s.disk_location(&id(ns, 3)).unwrap()
    };
    let end = (at + 128 + 12_000).div_ceil(4096) * 4096;
    assert!(end < (open + 1) * REGION);
    let mut block = vec![0x5au8; 4096];
    block[..4].copy_from_slice(b"KVTB");
    let file = OpenOptions::new()
        .write(true)
        .open(dir.path().join("store.kvt"))
        .unwrap();
    file.write_all_at(&block, end).unwrap();
    drop(file);
    assert_eq!(
        reopen(&cfg, ns, &[]),
        0,
        "a payload is not a damaged record"
    );
    // The sealed region's summary replaced by bytes that pass its CRC but
    // do not decode: its batches are walked instead.
    let (dir, cfg, ns, sealed, _) = make();
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(dir.path().join("store.kvt"))
        .unwrap();
    let seal_at = sealed * REGION + 2 * 4096;
    let mut seal = [0u8; 44];
    file.read_exact_at(&mut seal, seal_at).unwrap();
    let le32 = |b: &[u8], at: usize| u32::from_le_bytes(b[at..at + 4].try_into().unwrap());
    let (off, len) = (le32(&seal, 24), le32(&seal, 28));
    let garbage = vec![0xa5u8; len as usize];
    file.write_all_at(&garbage, sealed * REGION + u64::from(off))
        .unwrap();
    seal[32..36].copy_from_slice(&crc32c(&garbage).to_le_bytes());
    let crc = crc32c(&seal[..40]);
    seal[40..44].copy_from_slice(&crc.to_le_bytes());
    file.write_all_at(&seal, seal_at).unwrap();
    file.sync_all().unwrap();
    drop(file);
    assert_eq!(reopen(&cfg, ns, &[]), 1, "summary");
}

/// A store file that lost its preallocation (copied sparse, holes punched)
/// is backed again when it opens, unless that would leave less than
/// `disk_reserve` free on its filesystem (QA: on a nearly full filesystem a
/// failed fallocate kept what it had allocated, and no space was left).
#[test]
fn a_sparse_store_file_is_preallocated_again_at_open() {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::MetadataExt;
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path());
    let file = dir.path().join("store.kvt");
    drop(ChunkStore::open(cfg.clone()).unwrap());
    let full = std::fs::metadata(&file).unwrap().blocks();
    let f = OpenOptions::new().write(true).open(&file).unwrap();
    // SAFETY: a plain syscall on a valid descriptor.
    let rc = unsafe {
        libc::fallocate(
            f.as_raw_fd(),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            4 << 20,
            2 << 20,
        )
    };
    if rc != 0 {
        eprintln!("skipped: this filesystem cannot punch holes");
        return;
    }
    drop(f);
    let sparse = std::fs::metadata(&file).unwrap().blocks();
    assert!(sparse < full);
    // No filesystem here has an exabyte free: left sparse, still served.
    let mut tight = cfg.clone();
    tight.disk_reserve = 1 << 60;
    drop(ChunkStore::open(tight).unwrap());
    assert_eq!(std::fs::metadata(&file).unwrap().blocks(), sparse);
    drop(ChunkStore::open(cfg).unwrap());
    assert!(std::fs::metadata(&file).unwrap().blocks() >= full);
}

/// A region whose only chunks are torn (a crash during its first batch) is
/// free again at recovery, but its open slot still names it: every open
/// walked it and counted the torn chunk. `seal_open_region` (`verify
/// --repair`) clears that slot, says so, and later opens are clean.
#[test]
fn seal_open_region_clears_a_region_recovery_found_empty() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path());
    cfg.direct_io = false;
    let (ns, bad) = {
        let s = ChunkStore::open(cfg.clone()).unwrap();
        let ns = s.register_namespace(&record(0)).unwrap();
        s.put(id(ns, 0), payload(0, 9000)).unwrap();
        s.flush().unwrap();
        let bad = s.disk_location(&id(ns, 0)).unwrap();
        drop(s); // no seal: the region stays open on disk
        (ns, bad)
    };
    flip_byte(&dir.path().join("store.kvt"), bad.1 + 128 + 4000);
    let s = ChunkStore::open(cfg.clone()).unwrap();
    assert_eq!(s.stats().verify_failures, 1, "counted at recovery");
    assert_eq!(s.stats().disk_chunks, 0);
    assert!(
        s.seal_open_region().unwrap(),
        "the empty region's slot was cleared"
    );
    assert!(!s.seal_open_region().unwrap(), "nothing left to do");
    drop(s);
    let s = ChunkStore::open(cfg.clone()).unwrap();
    assert_eq!(s.stats().verify_failures, 0, "no longer walked");
    assert!(s.get(&id(ns, 0)).is_none());
    // The store keeps working: the region is reused.
    s.put(id(ns, 1), payload(1, 9000)).unwrap();
    s.flush().unwrap();
    drop(s);
    let s = ChunkStore::open(cfg).unwrap();
    assert_eq!(s.stats().verify_failures, 0);
    assert_eq!(s.get(&id(ns, 1)).unwrap().data, payload(1, 9000));
}

/// One store file, one store: a second open of the same file (a daemon's
/// `LOCK` file removed, or the file reached by another path) is refused
/// while the first lives, instead of two writers overwriting each other.
#[test]
fn a_store_file_in_use_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let s = ChunkStore::open(config(dir.path())).unwrap();
    let Err(e) = ChunkStore::open(config(dir.path())) else {
        panic!("opened twice")
    };
    assert!(e.to_string().contains("in use by another process"), "{e}");
    let ns = s.register_namespace(&record(0)).unwrap();
    s.put(id(ns, 1), payload(1, 1000)).unwrap();
    s.close(Duration::from_secs(5)).unwrap();
    drop(s);
    let s = ChunkStore::open(config(dir.path())).unwrap();
    assert_eq!(s.get(&id(ns, 1)).unwrap().data, payload(1, 1000));
}

/// Every file of `dir` with its bytes, sorted by name.
fn snapshot(dir: &std::path::Path) -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect();
    files.sort();
    files
}

/// A read-only open (`kvtier verify` without `--repair`) writes nothing:
/// damage that a writable open repairs as it recovers (a sealed region
/// whose seal slot rotted is re-sealed from its batches, a file longer than
/// its store is trimmed) is found again at every read-only open, with the
/// files unchanged byte for byte; puts, deletes, flushes, registrations
/// and repairs are refused. It used to be fixed by the first `verify`, so
/// the second one reported a clean store.
#[test]
fn a_read_only_open_writes_nothing_and_finds_the_same_damage_each_time() {
    const REGION: u64 = 64 << 10;
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path());
    cfg.direct_io = false;
    cfg.region_size = REGION;
    let (ns, sealed) = {
        let s = ChunkStore::open(cfg.clone()).unwrap();
        let ns = s.register_namespace(&record(0)).unwrap();
        for n in 0..4 {
            s.put(id(ns, n), payload(n, 12_000)).unwrap();
        }
        s.flush().unwrap();
        let sealed = s.disk_location(&id(ns, 0)).unwrap().0;
        assert_ne!(sealed, s.disk_location(&id(ns, 3)).unwrap().0);
        s.close(Duration::from_secs(5)).unwrap();
        (ns, u64::from(sealed))
    };
    let file = dir.path().join("store.kvt");
    flip_byte(&file, sealed * REGION + 2 * 4096 + 20);
    let store_len = file_len(dir.path());
    OpenOptions::new()
        .append(true)
        .open(&file)
        .unwrap()
        .write_all_at(&[7u8; 4096], store_len)
        .unwrap();
    let before = snapshot(dir.path());
    let ro = TierConfig {
        read_only: true,
        ..cfg.clone()
    };
    for round in 0..2 {
        let s = ChunkStore::open(ro.clone()).unwrap();
        assert_eq!(s.stats().damaged_metadata, 1, "round {round}");
        for n in 0..4 {
            assert_eq!(s.get(&id(ns, n)).unwrap().data, payload(n, 12_000));
        }
        let report = s
            .verify(&VerifyOptions { repair: false }, &mut |_, _| {})
            .unwrap();
        assert_eq!((report.checked, report.bad), (4, 0));
        let refused = |r: tier::Result<()>| matches!(r, Err(Error::ReadOnly(_)));
        assert!(refused(s.put(id(ns, 9), payload(9, 100))));
        assert!(refused(s.put_atomic(vec![(id(ns, 9), payload(9, 100))])));
        assert!(refused(
            s.put_clean(id(ns, 9), None, payload(9, 100)).map(drop)
        ));
        assert!(refused(s.flush().map(drop)));
        assert!(refused(s.register_namespace(&record(1)).map(drop)));
        assert!(refused(
            s.verify(&VerifyOptions { repair: true }, &mut |_, _| {})
                .map(drop)
        ));
        assert!(refused(s.seal_open_region().map(drop)));
        let gc = |dry_run| GcOptions {
            namespaces: vec![ns],
            older_than: None,
            dry_run,
        };
        assert_eq!(s.gc(&gc(true)).unwrap().chunks, 4);
        assert!(refused(s.gc(&gc(false)).map(drop)));
        assert!(!s.delete(&id(ns, 0)));
        assert!(s.get(&id(ns, 0)).is_some(), "nothing deleted");
        s.close(Duration::from_secs(5)).unwrap();
        assert!(
            before == snapshot(dir.path()),
            "round {round}: files changed"
        );
    }
    // A writable open recovers, re-seals the region and trims the file:
    // the open after it finds nothing.
    let s = ChunkStore::open(cfg.clone()).unwrap();
    assert_eq!(s.stats().damaged_metadata, 1);
    s.close(Duration::from_secs(5)).unwrap();
    assert_eq!(file_len(dir.path()), store_len);
    let s = ChunkStore::open(ro).unwrap();
    assert_eq!(s.stats().damaged_metadata, 0);
    for n in 0..4 {
        assert_eq!(s.get(&id(ns, n)).unwrap().data, payload(n, 12_000));
    }
}

/// A read-only open formats nothing: a store file without a superblock
/// (zeroed) is refused as corrupt and left as it is.
#[test]
fn a_read_only_open_of_an_unformatted_file_is_refused_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = TierConfig {
        read_only: true,
        ..config(dir.path())
    };
    let file = dir.path().join("store.kvt");
    std::fs::write(&file, vec![0u8; 8 * MIB as usize]).unwrap();
    let before = snapshot(dir.path());
    match ChunkStore::open(cfg.clone()) {
        Err(Error::Corrupt { detail, .. }) => assert!(detail.contains("superblock"), "{detail}"),
        Err(e) => panic!("wrong error: {e}"),
        Ok(_) => panic!("opened"),
    }
    assert!(before == snapshot(dir.path()));
    // No data dir at all: nothing is created.
    let gone = dir.path().join("nope");
    assert!(
        ChunkStore::open(TierConfig {
            data_dir: gone.clone(),
            ..cfg
        })
        .is_err()
    );
    assert!(!gone.exists());
}

/// A batch record of the open region whose head is intact but whose entry
/// list is damaged loses only its own batch: the head says where the next
/// one starts, the batches after it are recovered, and the loss is counted
/// in `damaged_metadata` (QA: a flipped byte in the first batch's entry
/// list dropped every chunk of the region without a word, and `verify`
/// exited 0). Damage to a head's region field is counted too. The same
/// damage in the last batch is counted after a clean stop (its empty
/// marker batch follows: QA, `verify` exited 0 having lost the batch);
/// without the marker, as after a crash, it reads as a torn write (not
/// counted) and the next write takes its place.
#[test]
fn a_damaged_batch_entry_list_loses_only_its_batch_and_is_counted() {
    use tier::layout::{BATCH_FIXED, BATCH_MAGIC, DATA_START};
    let make = || {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = config(dir.path());
        cfg.direct_io = false;
        let s = ChunkStore::open(cfg.clone()).unwrap();
        let ns = s.register_namespace(&record(0)).unwrap();
        for n in 0..3 {
            s.put(id(ns, n), payload(n, 9000)).unwrap();
            s.flush().unwrap(); // one batch each
        }
        let region = s.disk_location(&id(ns, 0)).unwrap().0;
        drop(s); // no seal: the region stays open on disk, marked
        // The batch heads of the region, in order: three batches of one
        // chunk, then the clean stop's marker.
        let base = u64::from(region) * MIB;
        let bytes = std::fs::read(dir.path().join("store.kvt")).unwrap();
        let heads: Vec<u64> = (DATA_START..MIB)
            .step_by(4096)
            .filter(|o| bytes[(base + o) as usize..][..4] == BATCH_MAGIC)
            .map(|o| base + o)
            .collect();
        assert_eq!(heads.len(), 4, "{heads:?}");
        (dir, cfg, ns, heads)
    };
    let reopen = |cfg: &TierConfig, ns, lost: &[u64]| {
        let s = ChunkStore::open(cfg.clone()).unwrap();
        for n in 0..3 {
            match s.get(&id(ns, n)) {
                Some(h) => {
                    assert!(!lost.contains(&n), "chunk {n} is back");
                    assert_eq!(h.data, payload(n, 9000), "chunk {n}");
                }
                None => assert!(lost.contains(&n), "chunk {n} lost"),
            }
        }
        s
    };
    // The first batch's entry list: only chunk 0 is lost, said.
    let (dir, cfg, ns, heads) = make();
    flip_byte(
        &dir.path().join("store.kvt"),
        heads[0] + BATCH_FIXED as u64 + 3,
    );
    let s = reopen(&cfg, ns, &[0]);
    assert_eq!(s.stats().damaged_metadata, 1);
    drop(s);
    // The first batch head's region field: the walk ends there, said.
    let (dir, cfg, ns, heads) = make();
    flip_byte(&dir.path().join("store.kvt"), heads[0] + 9);
    let s = reopen(&cfg, ns, &[0, 1, 2]);
    assert_eq!(s.stats().damaged_metadata, 1);
    drop(s);
    // The last batch's entry list after a clean stop: lost, said; the
    // write after it goes past the marker.
    let (dir, cfg, ns, heads) = make();
    flip_byte(
        &dir.path().join("store.kvt"),
        heads[2] + BATCH_FIXED as u64 + 3,
    );
    let s = reopen(&cfg, ns, &[2]);
    assert_eq!(s.stats().damaged_metadata, 1);
    s.put(id(ns, 7), payload(7, 9000)).unwrap();
    s.flush().unwrap();
    assert!(s.disk_location(&id(ns, 7)).unwrap().1 > heads[3]);
    drop(s);
    let s = reopen(&cfg, ns, &[2]);
    assert_eq!(s.get(&id(ns, 7)).unwrap().data, payload(7, 9000));
    drop(s);
    // The same without the marker (a crash before any stop): a torn
    // tail, not counted; the next write takes its place and survives a
    // reopen.
    let (dir, cfg, ns, heads) = make();
    let f = OpenOptions::new()
        .write(true)
        .open(dir.path().join("store.kvt"))
        .unwrap();
    f.write_all_at(&[0u8; 4096], heads[3]).unwrap();
    drop(f);
    flip_byte(
        &dir.path().join("store.kvt"),
        heads[2] + BATCH_FIXED as u64 + 3,
    );
    let s = reopen(&cfg, ns, &[2]);
    assert_eq!(s.stats().damaged_metadata, 0);
    s.put(id(ns, 7), payload(7, 9000)).unwrap();
    s.flush().unwrap();
    let at = s.disk_location(&id(ns, 7)).unwrap().1;
    assert!(at > heads[2] && at < heads[2] + 8192, "{at} vs {heads:?}");
    drop(s);
    let s = reopen(&cfg, ns, &[2]);
    assert_eq!(s.get(&id(ns, 7)).unwrap().data, payload(7, 9000));
    assert_eq!(s.stats().damaged_metadata, 0);
}

/// A clean stop ends the open region with one empty marker batch, and only
/// after writes: restarts without any add none (each would take a block).
#[test]
fn a_clean_stop_marks_the_open_region_once() {
    use tier::layout::{BATCH_MAGIC, DATA_START};
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path());
    cfg.direct_io = false;
    let heads = || {
        let bytes = std::fs::read(dir.path().join("store.kvt")).unwrap();
        (0..8u64)
            .flat_map(|r| (DATA_START..MIB).step_by(4096).map(move |o| r * MIB + o))
            .filter(|&o| bytes[o as usize..][..4] == BATCH_MAGIC)
            .count()
    };
    let s = ChunkStore::open(cfg.clone()).unwrap();
    let ns = s.register_namespace(&record(0)).unwrap();
    s.put(id(ns, 1), payload(1, 9000)).unwrap();
    s.flush().unwrap();
    drop(s);
    assert_eq!(heads(), 2, "the batch and its marker");
    for _ in 0..3 {
        drop(ChunkStore::open(cfg.clone()).unwrap());
    }
    assert_eq!(heads(), 2, "restarts without writes mark nothing");
    let s = ChunkStore::open(cfg.clone()).unwrap();
    s.put(id(ns, 2), payload(2, 9000)).unwrap();
    s.flush().unwrap();
    drop(s);
    assert_eq!(heads(), 4);
    let s = ChunkStore::open(cfg).unwrap();
    for n in 1..=2 {
        assert!(s.get(&id(ns, n)).unwrap().data == payload(n, 9000));
    }
    assert_eq!(s.stats().damaged_metadata, 0);
}

/// Serving a peer is no local read: `get_for_peer` counts no hit, miss or
/// byte out, and leaves a disk copy on disk (the holder counted each chunk
/// served to a peer as its own client's hit and cached disk copies: review).
#[test]
fn reads_for_peers_are_not_local_hits_and_not_cached() {
    let dir = tempfile::tempdir().unwrap();
    let ns;
    {
        let s = ChunkStore::open(config(dir.path())).unwrap();
        ns = s.register_namespace(&record(0)).unwrap();
        s.put(id(ns, 1), payload(1, 100_000)).unwrap();
        s.put(id(ns, 2), payload(2, 100_000)).unwrap();
        assert_eq!(s.get_for_peer(&id(ns, 1)), Some(payload(1, 100_000)));
        assert_eq!(s.get_for_peer(&id(ns, 9)), None);
        let st = s.stats();
        assert_eq!(
            (st.hits_ram, st.hits_disk, st.misses, st.bytes_out),
            (0, 0, 0, 0)
        );
        s.close(Duration::from_secs(10)).unwrap();
    }
    let s = ChunkStore::open(config(dir.path())).unwrap();
    assert_eq!(s.locate(&id(ns, 2)), Some(Tier::Disk));
    assert_eq!(s.get_for_peer(&id(ns, 2)), Some(payload(2, 100_000)));
    assert_eq!(s.locate(&id(ns, 2)), Some(Tier::Disk), "cached in RAM");
    let st = s.stats();
    assert_eq!(
        (st.hits_ram, st.hits_disk, st.misses, st.bytes_out),
        (0, 0, 0, 0)
    );
    // A client's read still counts and caches.
    assert!(s.get(&id(ns, 2)).is_some());
    assert_eq!(
        (s.stats().hits_disk, s.locate(&id(ns, 2))),
        (1, Some(Tier::Ram))
    );
}

/// The peer snapshot's list: every chunk once, in RAM or not, with its
/// length (the disk index is copied under its lock and merged after).
#[test]
fn ids_with_tier_lists_each_chunk_once_with_its_tier() {
    let dir = tempfile::tempdir().unwrap();
    let ns;
    {
        let s = ChunkStore::open(config(dir.path())).unwrap();
        ns = s.register_namespace(&record(0)).unwrap();
        for n in 1..=3 {
            s.put(id(ns, n), payload(n, 1000 * n as usize)).unwrap();
        }
        s.close(Duration::from_secs(10)).unwrap();
    }
    let s = ChunkStore::open(config(dir.path())).unwrap();
    assert!(s.get(&id(ns, 2)).is_some()); // now in RAM (clean) and on disk
    s.put(id(ns, 4), payload(4, 4000)).unwrap(); // RAM only
    let mut got = s.ids_with_tier();
    got.sort_by_key(|(i, _, _)| i.key);
    let mut want = vec![
        (id(ns, 1), 1000, false),
        (id(ns, 2), 2000, true),
        (id(ns, 3), 3000, false),
        (id(ns, 4), 4000, true),
    ];
    want.sort_by_key(|(i, _, _)| i.key);
    assert_eq!(got, want);
}

/// A store file whose preallocation fails is undone: a new one is removed,
/// and one the open grew is trimmed back to its old length (QA: a failed
/// fallocate on ext4 keeps what it allocated, and left a zero-filled file
/// of nearly the whole size with 0 bytes free on the filesystem). The
/// failure comes from `RLIMIT_FSIZE`, set in a child process (this test
/// binary run again for `failed_preallocation_child`), so no other test
/// shares the limit.
#[test]
fn a_failed_preallocation_leaves_no_store_file_behind() {
    let dir = tempfile::tempdir().unwrap();
    let run = |what: &str| {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "failed_preallocation_child", "--nocapture"])
            .env("KVTIER_TEST_PREALLOC_CHILD", what)
            .env("KVTIER_TEST_PREALLOC_DIR", dir.path())
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{what}: {text}");
        assert!(
            text.contains("child done"),
            "{what}: the child ran nothing: {text}"
        );
    };
    let file = dir.path().join("store.kvt");
    run("new");
    assert!(!file.exists(), "a new store file is removed");
    // A store file shorter than its size (a start that stopped part way):
    // the open that cannot grow it leaves its length as it was.
    std::fs::write(&file, vec![0u8; 4096]).unwrap();
    run("grow");
    assert_eq!(std::fs::metadata(&file).unwrap().len(), 4096);
    // Without the limit it opens and grows as usual.
    drop(ChunkStore::open(config(dir.path())).unwrap());
    assert_eq!(
        std::fs::metadata(&file).unwrap().len(),
        config(dir.path()).disk_budget
    );
}

/// The child of [`a_failed_preallocation_leaves_no_store_file_behind`]:
/// does nothing unless that test runs it.
#[test]
fn failed_preallocation_child() {
    let Ok(what) = std::env::var("KVTIER_TEST_PREALLOC_CHILD") else {
        return;
    };
    let dir = std::path::PathBuf::from(std::env::var("KVTIER_TEST_PREALLOC_DIR").unwrap());
    let limit = libc::rlimit {
        rlim_cur: 1 << 20,
        rlim_max: libc::RLIM_INFINITY,
    };
    // SAFETY: plain syscalls; ignoring SIGXFSZ makes an oversized write or
    // fallocate fail with EFBIG instead of ending the process.
    unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
        assert_eq!(libc::setrlimit(libc::RLIMIT_FSIZE, &limit), 0);
    }
    let err = ChunkStore::open(config(&dir))
        .err()
        .expect("the open fails");
    println!("{what}: {err}");
    assert!(
        matches!(&err, Error::Io { source, .. } if source.raw_os_error() == Some(libc::EFBIG)),
        "{what}: not the preallocation's failure: {err}"
    );
    println!("child done");
}

/// A small ext4 filesystem mounted from an image file (`mount -o loop`),
/// unmounted when dropped; `None` where this test cannot mount one (not
/// root, no `mkfs.ext4`, no loop devices).
struct LoopExt4 {
    dir: tempfile::TempDir,
}

impl LoopExt4 {
    fn new(size_mib: u64) -> Option<Self> {
        let dir = tempfile::tempdir().ok()?;
        let img = dir.path().join("fs.img");
        let mnt = dir.path().join("mnt");
        std::fs::create_dir(&mnt).ok()?;
        std::fs::File::create(&img)
            .and_then(|f| f.set_len(size_mib * MIB))
            .ok()?;
        let ok = |c: &mut std::process::Command| {
            c.stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        };
        // `-m 0`: no blocks reserved for root, so root fills it too.
        if !ok(std::process::Command::new("mkfs.ext4")
            .args(["-q", "-F", "-m", "0"])
            .arg(&img))
        {
            return None;
        }
        if !ok(std::process::Command::new("mount")
            .args(["-o", "loop"])
            .arg(&img)
            .arg(&mnt))
        {
            return None;
        }
        Some(Self { dir })
    }

    fn path(&self) -> std::path::PathBuf {
        self.dir.path().join("mnt")
    }
}

impl Drop for LoopExt4 {
    fn drop(&mut self) {
        let unmounted = std::process::Command::new("umount")
            .arg(self.path())
            .status()
            .is_ok_and(|s| s.success());
        if !unmounted {
            // Busy (a file still open): detached now, gone once released.
            let _ = std::process::Command::new("umount")
                .arg("-l")
                .arg(self.path())
                .status();
        }
    }
}

/// The same on a real full filesystem: ext4 keeps what a failed fallocate
/// allocated (and the length it reached), so without the undo a store too
/// large for its filesystem left it with no space at all.
#[test]
fn a_store_too_large_for_its_filesystem_leaves_the_space_free() {
    let Some(fs) = LoopExt4::new(24) else {
        eprintln!(
            "skipped: cannot mount a loop ext4 here (needs root, mkfs.ext4 and loop devices)"
        );
        return;
    };
    let free = || {
        let path = std::ffi::CString::new(fs.path().into_os_string().into_encoded_bytes()).unwrap();
        // SAFETY: a zeroed statvfs is a valid out-parameter.
        let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
        // SAFETY: `path` is NUL-terminated and `st` is writable.
        assert_eq!(unsafe { libc::statvfs(path.as_ptr(), &mut st) }, 0);
        st.f_bavail * st.f_frsize
    };
    let data = fs.path().join("data");
    let before = free();
    let mut cfg = config(&data);
    cfg.disk_budget = 32 * MIB;
    let err = ChunkStore::open(cfg.clone()).err().expect("too large");
    assert!(matches!(err, Error::NoSpace { .. }), "{err}");
    assert!(!data.join("store.kvt").exists());
    // The directory and its small files may take a few blocks.
    assert!(free() + MIB >= before, "free {} of {before}", free());
    // A store file shorter than its size, grown by an open that fails:
    // trimmed back.
    std::fs::write(data.join("store.kvt"), vec![0u8; 4096]).unwrap();
    let err = ChunkStore::open(cfg.clone()).err().expect("too large");
    assert!(matches!(err, Error::NoSpace { .. }), "{err}");
    assert_eq!(
        std::fs::metadata(data.join("store.kvt")).unwrap().len(),
        4096
    );
    assert!(free() + MIB >= before, "free {} of {before}", free());
    // A file another process holds (its store lock) is never undone: the
    // open grows it part way and leaves it so.
    {
        use std::os::fd::AsRawFd;
        let held = std::fs::File::open(data.join("store.kvt")).unwrap();
        // SAFETY: flock on a descriptor owned here.
        assert_eq!(unsafe { libc::flock(held.as_raw_fd(), libc::LOCK_EX) }, 0);
        let err = ChunkStore::open(cfg.clone()).err().expect("too large");
        assert!(matches!(err, Error::NoSpace { .. }), "{err}");
        assert!(std::fs::metadata(data.join("store.kvt")).unwrap().len() > 4096);
    }
    // One that fits opens.
    std::fs::remove_file(data.join("store.kvt")).unwrap();
    drop(ChunkStore::open(config(&data)).unwrap());
}

/// Empty chunks fill a RAM-only store's budget with their bookkeeping and
/// are evicted like any other (QA: a million empty chunks held 505 MB
/// under a 1 MiB budget, nothing evicted); the largest chunk RAM alone
/// takes leaves room for that bookkeeping.
#[test]
fn empty_chunks_are_bounded_by_the_ram_budget() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path());
    cfg.ram_budget = MIB;
    cfg.disk_budget = 0;
    let s = ChunkStore::open(cfg).unwrap();
    let ns = s.register_namespace(&record(0)).unwrap();
    for i in 0..20_000 {
        s.put(id(ns, i), Bytes::new()).unwrap();
    }
    let st = s.stats();
    assert_eq!(st.ram_chunks, MIB / tier::ram::ENTRY_COST, "{st:?}");
    assert!(st.ram_bytes <= MIB, "{st:?}");
    assert_eq!(st.ram_evictions, 20_000 - st.ram_chunks, "{st:?}");
    let max = s.max_chunk_len(0);
    assert_eq!(max, MIB - tier::ram::ENTRY_COST);
    s.put(id(ns, 0), payload(0, max as usize)).unwrap();
    assert!(s.put(id(ns, 1), payload(1, max as usize + 1)).is_err());
}

/// A close deadline past what an instant holds is no deadline: the dirty
/// set is written (QA: the daemon's `now + deadline` overflowed and
/// panicked its stop with centuries of `shutdown-deadline`).
#[test]
fn a_close_deadline_of_centuries_flushes_and_does_not_panic() {
    let dir = tempfile::tempdir().unwrap();
    let s = ChunkStore::open(config(dir.path())).unwrap();
    let ns = s.register_namespace(&record(0)).unwrap();
    s.put(id(ns, 1), payload(1, 4096)).unwrap();
    let report = s.close(Duration::MAX).unwrap();
    assert_eq!((report.chunks, report.failed), (1, 0), "{report:?}");
    let s = ChunkStore::open(config(dir.path())).unwrap();
    assert_eq!(s.get(&id(ns, 1)).unwrap().data, payload(1, 4096));
}

/// An atomic group is checked against the RAM budget as RAM charges its
/// members, bookkeeping included (review: 4 × 256 KiB passed a 1 MiB
/// budget's check, then the last members evicted the first and the group
/// was gone, while the put returned Ok).
#[test]
fn an_atomic_group_counts_the_bookkeeping_of_its_members() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path());
    cfg.ram_budget = MIB;
    cfg.disk_budget = 0;
    let s = ChunkStore::open(cfg).unwrap();
    let ns = s.register_namespace(&record(0)).unwrap();
    let group = |n: u64, len: usize| -> Vec<(ChunkId, Bytes)> {
        (0..n).map(|i| (id(ns, i), payload(i, len))).collect()
    };
    let e = s.put_atomic(group(4, 256 << 10)).unwrap_err();
    assert!(
        e.to_string().contains("an atomic group must fit at once"),
        "{e}"
    );
    assert_eq!(s.stats().ram_chunks, 0);
    // What fits with its bookkeeping is stored whole.
    let len = (MIB / 4 - tier::ram::ENTRY_COST) as usize;
    s.put_atomic(group(4, len)).unwrap();
    for i in 0..4 {
        assert_eq!(s.get(&id(ns, i)).unwrap().data, payload(i, len));
    }
}

/// `evicted_chunks` (RESP's `evicted_keys`) counts chunks that left the node
/// to make room: not a RAM eviction whose chunk stays on disk, but a chunk
/// whose region was reclaimed while RAM did not hold it.
#[test]
fn evicted_chunks_counts_chunks_that_left_the_node_only() {
    let dir = tempfile::tempdir().unwrap();
    let s = ChunkStore::open(config(dir.path())).unwrap();
    let ns = s.register_namespace(&record(0)).unwrap();
    // 4 MiB of RAM over 8 MiB of disk: the first chunks go to disk.
    for n in 0..10 {
        s.put(id(ns, n), payload(n, 512 * 1024)).unwrap();
    }
    s.flush().unwrap();
    let gone = |upto: u64| {
        (0..upto)
            .filter(|n| s.locate(&id(ns, *n)).is_none())
            .count() as u64
    };
    let st = s.stats();
    assert_eq!(st.evicted_chunks, gone(10), "{st:?}");
    assert!(
        st.ram_evictions > st.evicted_chunks,
        "chunks evicted from RAM and kept on disk are not counted: {st:?}"
    );
    // Far past the disk: regions are reclaimed and their oldest chunks go.
    for n in 10..60 {
        s.put(id(ns, n), payload(n, 512 * 1024)).unwrap();
        s.flush().unwrap();
    }
    let st = s.stats();
    assert!(st.region_evictions > 0, "{st:?}");
    assert!(gone(60) > 10, "{st:?}");
    assert_eq!(st.evicted_chunks, gone(60), "{st:?}");
}
