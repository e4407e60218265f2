//! Deterministic fault injection with `fail` failpoints (feature
//! `failpoints`; run with `cargo nextest run -p kvtier-tier --features
//! failpoints --test failpoints`). The failpoint registry is global, so the
//! scenarios run one after another in one test.
//!
//! - `tier::writer::batch_write=return(enospc)`: the writer pauses, RAM keeps
//!   serving, writes go through again once the device has room;
//! - a tombstone whose batch fails that way is written again once the
//!   device has room (else the deleted chunk came back at recovery);
//!   meanwhile the deletes journal holds it (`tier::deletes::append=return`
//!   refuses that too: then a flush, and a close, fail with `NoSpace`); a
//!   delete made while writes are poisoned is journaled too, and the next
//!   open replays the journal, even after a crash;
//! - the same for a batch of a flush that spans several regions (each next
//!   region is opened while the batch before may be in flight): after a
//!   restart exactly the chunks the flush reported written are there (the
//!   I/O thread's unit test shows that batches queued behind a failed one
//!   are not written);
//! - `tier::writer::batch_write=return`: EIO poisons disk writes until reopen;
//!   what an earlier flush confirmed survives;
//! - `tier::writer::flush_sync=return`: a failed fdatasync fails the flush;
//! - `tier::store::hand_off=pause`: a chunk evicted just before a `flush()`
//!   and not yet handed to the writer is still covered by that flush;
//! - `tier::recovery::scan_read=return`: a read error while walking the open
//!   region's batches at open: the chunks read so far are served, nothing is
//!   written to that region (neither re-opened nor sealed: what lies past the
//!   error is unknown), and a later clean open finds all of it;
//! - `tier::maintenance::gc_deleting=return`: a `gc --apply` stopped (as by
//!   a kill) after it chose its namespaces and before its deletes is
//!   finished by the next writable open, not by a read-only one;
//! - `tier::aio::piece=return(short|eintr|eio)` and
//!   `tier::aio::setup=return(eagain|eperm)`: a split read whose pieces come
//!   back short or failed reads them again plainly, and a store whose AIO
//!   contexts are refused reads unsplit; every read stays byte-exact, none
//!   counts as a verification failure;
//! - `tier::store::promote=pause`: a disk hit whose region is reclaimed
//!   between its read and its promotion is served but not cached in RAM (a
//!   clean RAM copy with no disk copy behind it was lost at the next
//!   restart although it was served until then).

use std::time::Duration;

use bytes::Bytes;
use tier::{ChunkId, ChunkKey, ChunkStore, NamespaceRecord, Tier, TierConfig, WritePolicy};

const MIB: u64 = 1 << 20;

fn cfg(dir: &std::path::Path) -> TierConfig {
    TierConfig {
        data_dir: dir.to_path_buf(),
        // 4 MiB of payloads, and the bookkeeping RAM charges per chunk.
        ram_budget: 4 * MIB + 16 * tier::ram::ENTRY_COST,
        disk_budget: 8 * MIB,
        region_size: MIB,
        idle_flush_after: Duration::from_secs(3600),
        write_policy: WritePolicy::Backpressure,
        ..TierConfig::default()
    }
}

fn id(ns: tier::Namespace, n: u64) -> ChunkId {
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&n.wrapping_mul(0x9e37_79b9_7f4a_7c15).to_le_bytes());
    key[8..16].copy_from_slice(&n.to_le_bytes());
    ChunkId::new(ns, ChunkKey(key), 0)
}

fn payload(n: u64) -> Bytes {
    Bytes::from(vec![(n as u8) | 1; 20_000 + n as usize])
}

fn record() -> NamespaceRecord {
    NamespaceRecord {
        model: "failpoints".into(),
        ..Default::default()
    }
}

/// Turns a failpoint off when dropped: a paused thread goes on even when
/// an assertion fails.
struct Off(&'static str);

impl Drop for Off {
    fn drop(&mut self) {
        fail::cfg(self.0, "off").unwrap();
    }
}

#[test]
fn failpoints() {
    let scenario = fail::FailScenario::setup();
    enospc_pauses_and_resumes();
    a_tombstone_whose_batch_fails_is_written_later();
    a_close_with_a_delete_not_on_disk_says_so();
    deletes_the_disk_did_not_take_survive_a_restart_in_the_journal();
    a_failed_batch_across_a_region_switch_leaves_nothing_behind_it();
    eio_poisons_until_reopen();
    failed_fdatasync_fails_the_flush();
    a_flush_covers_a_chunk_evicted_but_not_yet_handed_off();
    a_read_error_in_the_recovery_walk_leaves_the_region_untouched();
    split_reads_recover_from_failed_pieces_and_refused_contexts();
    a_gc_stopped_before_its_deletes_is_finished_at_the_next_open();
    a_disk_hit_whose_region_is_reclaimed_during_its_read_is_not_promoted();
    a_namespace_registers_in_memory_when_its_manifest_cannot_be_written();
    scenario.teardown();
}

fn enospc_pauses_and_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let s = ChunkStore::open(cfg(dir.path())).unwrap();
    let ns = s.register_namespace(&record()).unwrap();
    fail::cfg("tier::writer::batch_write", "return(enospc)").unwrap();
    s.put(id(ns, 1), payload(1)).unwrap();
    let r = s.flush().unwrap();
    assert_eq!((r.chunks, r.failed), (0, 1));
    let st = s.stats();
    assert!(st.writer_paused_nospace && !st.disk_poisoned, "{st:?}");
    assert_eq!(s.get(&id(ns, 1)).unwrap().tier, Tier::Ram);
    fail::remove("tier::writer::batch_write");
    let r = s.flush().unwrap();
    assert_eq!((r.chunks, r.failed), (1, 0));
    assert!(!s.stats().writer_paused_nospace);
    drop(s);
    let s = ChunkStore::open(cfg(dir.path())).unwrap();
    assert_eq!(s.get(&id(ns, 1)).unwrap().data, payload(1));
}

fn a_tombstone_whose_batch_fails_is_written_later() {
    let dir = tempfile::tempdir().unwrap();
    let s = ChunkStore::open(cfg(dir.path())).unwrap();
    let ns = s.register_namespace(&record()).unwrap();
    s.put(id(ns, 1), payload(1)).unwrap();
    s.flush().unwrap();
    s.put(id(ns, 2), payload(2)).unwrap();
    s.flush().unwrap();
    s.put(id(ns, 3), payload(3)).unwrap();
    s.flush().unwrap();
    let journal = dir.path().join(tier::deletes::FILE_NAME);
    fail::cfg("tier::writer::batch_write", "return(enospc)").unwrap();
    // The journal refuses too: nothing holds the delete.
    fail::cfg("tier::deletes::append", "return(enospc)").unwrap();
    assert!(s.delete(&id(ns, 1)));
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !s.stats().writer_paused_nospace {
        assert!(
            std::time::Instant::now() < deadline,
            "the tombstone's batch never failed"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    // Until the tombstone is on disk, a flush does not report success:
    // a restart would bring the chunk back.
    let e = s.flush().expect_err("a delete is not on disk");
    assert!(
        matches!(&e, tier::Error::NoSpace { detail } if detail.contains("1 delete(s)")),
        "{e}"
    );
    assert!(!journal.exists());
    // With the journal taking deletes, a delete the disk refuses is
    // durable there: the flush succeeds.
    fail::remove("tier::deletes::append");
    assert!(s.delete(&id(ns, 2)));
    s.flush().expect("both deletes are in the journal");
    assert_eq!(
        tier::deletes::read(dir.path()).unwrap().len(),
        2,
        "the retried tombstone and the new one"
    );
    fail::remove("tier::writer::batch_write");
    // The next batch (here a third delete's) takes the refused tombstones
    // along, and the journal goes once they are synced, with no flush.
    assert!(s.delete(&id(ns, 3)));
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while journal.exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "the journal outlived the retried tombstones"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(!s.stats().writer_paused_nospace);
    s.flush().unwrap();
    assert_eq!(s.cancelled_writes(), 0, "the tombstones were written");
    assert!(!journal.exists(), "removed once the tombstones are on disk");
    drop(s);
    let s = ChunkStore::open(cfg(dir.path())).unwrap();
    for n in 1..=3 {
        assert!(s.get(&id(ns, n)).is_none(), "deleted chunk {n} came back");
    }
}

fn a_close_with_a_delete_not_on_disk_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let s = ChunkStore::open(cfg(dir.path())).unwrap();
    let ns = s.register_namespace(&record()).unwrap();
    s.put(id(ns, 1), payload(1)).unwrap();
    s.put(id(ns, 2), payload(2)).unwrap();
    s.flush().unwrap();
    fail::cfg("tier::writer::batch_write", "return(enospc)").unwrap();
    fail::cfg("tier::deletes::append", "return(enospc)").unwrap();
    assert!(s.delete(&id(ns, 1)));
    // A dirty chunk the disk refuses too: the error counts it as well (QA:
    // it named only the deletes).
    s.put(id(ns, 3), payload(3)).unwrap();
    let e = s
        .close(Duration::from_secs(10))
        .expect_err("a delete is not on disk");
    assert!(
        matches!(&e, tier::Error::NoSpace { detail }
            if detail.contains("1 delete(s)") && detail.contains("1 dirty chunk(s) could not be written")),
        "{e}"
    );
    fail::remove("tier::writer::batch_write");
    fail::remove("tier::deletes::append");
    // As the close said: the delete did not reach the disk.
    let s = ChunkStore::open(cfg(dir.path())).unwrap();
    assert_eq!(s.get(&id(ns, 1)).unwrap().data, payload(1));
    assert_eq!(s.get(&id(ns, 2)).unwrap().data, payload(2));
    drop(s);
}

/// A delete the disk refuses (ENOSPC) when the store closes, and one made
/// while disk writes are poisoned, are kept by the deletes journal: the
/// next open deletes them again and writes their tombstones.
fn deletes_the_disk_did_not_take_survive_a_restart_in_the_journal() {
    let dir = tempfile::tempdir().unwrap();
    let journal = dir.path().join(tier::deletes::FILE_NAME);
    let s = ChunkStore::open(cfg(dir.path())).unwrap();
    let ns = s.register_namespace(&record()).unwrap();
    for i in 1..=4 {
        s.put(id(ns, i), payload(i)).unwrap();
    }
    s.flush().unwrap();
    fail::cfg("tier::writer::batch_write", "return(enospc)").unwrap();
    assert!(s.delete(&id(ns, 1)));
    s.close(Duration::from_secs(10))
        .expect("the delete is durable in the journal");
    fail::remove("tier::writer::batch_write");
    assert!(journal.exists());
    let s = ChunkStore::open(cfg(dir.path())).unwrap();
    assert!(s.get(&id(ns, 1)).is_none(), "the deleted chunk came back");
    assert!(!journal.exists(), "its tombstone is on disk now");
    assert_eq!(s.get(&id(ns, 2)).unwrap().data, payload(2));
    // Poisoned (EIO): a delete cannot reach the disk until a reopen.
    fail::cfg("tier::writer::batch_write", "return").unwrap();
    s.put(id(ns, 5), payload(5)).unwrap();
    assert!(s.flush().is_err());
    assert!(s.stats().disk_poisoned);
    assert!(s.delete(&id(ns, 2)));
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while tier::deletes::read(dir.path()).unwrap().is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "the delete never reached the journal"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    // A stop while poisoned writes nothing more: the journal is all that
    // holds the delete (as after a crash).
    drop(s);
    fail::remove("tier::writer::batch_write");
    let s = ChunkStore::open(cfg(dir.path())).unwrap();
    assert!(!s.stats().disk_poisoned);
    assert!(s.get(&id(ns, 2)).is_none(), "the deleted chunk came back");
    assert_eq!(s.get(&id(ns, 3)).unwrap().data, payload(3));
    assert_eq!(s.get(&id(ns, 4)).unwrap().data, payload(4));
    assert!(!journal.exists());
    drop(s);
    // And it stays deleted across a plain restart.
    let s = ChunkStore::open(cfg(dir.path())).unwrap();
    assert!(s.get(&id(ns, 2)).is_none());
    assert!(s.get(&id(ns, 1)).is_none());
}

fn a_failed_batch_across_a_region_switch_leaves_nothing_behind_it() {
    let dir = tempfile::tempdir().unwrap();
    let s = ChunkStore::open(cfg(dir.path())).unwrap();
    let ns = s.register_namespace(&record()).unwrap();
    // One chunk per 1 MiB region: each batch goes to the next region, opened
    // while the batch before may still be in flight.
    let n = 4;
    let big = |i: u64| Bytes::from(vec![i as u8; 600_000]);
    for i in 1..=n {
        s.put(id(ns, i), big(i)).unwrap();
    }
    // The first batch is slow, so the next ones queue behind it; the second
    // fails.
    fail::cfg(
        "tier::writer::batch_write",
        "1*sleep(200)->1*return(enospc)->off",
    )
    .unwrap();
    let r = s.flush().unwrap();
    assert!(r.failed >= 1 && r.chunks + r.failed == n, "{r:?}");
    assert!(!s.stats().disk_poisoned);
    // Nothing more reaches the disk (the close's flush fails too).
    fail::cfg("tier::writer::batch_write", "return").unwrap();
    drop(s);
    fail::remove("tier::writer::batch_write");
    let s = ChunkStore::open(cfg(dir.path())).unwrap();
    let present: Vec<u64> = (1..=n).filter(|&i| s.get(&id(ns, i)).is_some()).collect();
    assert_eq!(
        present.len() as u64,
        r.chunks,
        "exactly what the flush reported"
    );
    for i in present {
        assert_eq!(s.get(&id(ns, i)).unwrap().data, big(i));
    }
    assert_eq!(s.stats().verify_failures, 0);
    // And the store writes again.
    s.put(id(ns, n + 1), big(n + 1)).unwrap();
    assert_eq!(s.flush().unwrap().failed, 0);
}

fn eio_poisons_until_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let s = ChunkStore::open(cfg(dir.path())).unwrap();
    let ns = s.register_namespace(&record()).unwrap();
    s.put(id(ns, 1), payload(1)).unwrap();
    s.flush().unwrap();
    fail::cfg("tier::writer::batch_write", "return").unwrap();
    s.put(id(ns, 2), payload(2)).unwrap();
    assert!(s.flush().is_err() || s.stats().disk_poisoned);
    assert!(s.stats().disk_poisoned);
    assert!(s.flush().is_err(), "poisoned until reopen");
    assert_eq!(s.get(&id(ns, 2)).unwrap().data, payload(2), "RAM serves");
    fail::remove("tier::writer::batch_write");
    drop(s);
    let s = ChunkStore::open(cfg(dir.path())).unwrap();
    assert!(!s.stats().disk_poisoned);
    assert_eq!(s.get(&id(ns, 1)).unwrap().data, payload(1));
    assert!(s.get(&id(ns, 2)).is_none(), "never written");
}

fn failed_fdatasync_fails_the_flush() {
    let dir = tempfile::tempdir().unwrap();
    let s = ChunkStore::open(cfg(dir.path())).unwrap();
    let ns = s.register_namespace(&record()).unwrap();
    s.put(id(ns, 1), payload(1)).unwrap();
    fail::cfg("tier::writer::flush_sync", "return").unwrap();
    assert!(s.flush().is_err());
    assert!(s.stats().disk_poisoned);
    fail::remove("tier::writer::flush_sync");
}

/// A PUT that evicts a dirty chunk is held between the eviction and the
/// hand-off of its write (`pause`); a `flush()` meanwhile must still make
/// that chunk durable before it returns: it was dirty at the call.
fn a_flush_covers_a_chunk_evicted_but_not_yet_handed_off() {
    let dir = tempfile::tempdir().unwrap();
    // Room for every write (one 512 KiB chunk per 1 MiB region).
    let cfg = |dir: &std::path::Path| TierConfig {
        disk_budget: 32 * MIB,
        ..cfg(dir)
    };
    let s = ChunkStore::open(cfg(dir.path())).unwrap();
    let ns = s.register_namespace(&record()).unwrap();
    let big = |n: u64| Bytes::from(vec![n as u8 | 1; 512 * 1024]);
    fail::cfg("tier::store::hand_off", "pause").unwrap();
    std::thread::scope(|scope| {
        // Lets the held put go on even when an assertion fails.
        let unpause = Off("tier::store::hand_off");
        // 9 x 512 KiB through 4 MiB: the 9th put evicts chunk 0 and is
        // held before handing it to the writer.
        let putter = scope.spawn(|| {
            for n in 0..9 {
                s.put(id(ns, n), big(n)).unwrap();
            }
        });
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while s.stats().ram_evictions == 0 {
            assert!(std::time::Instant::now() < deadline, "no eviction");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(s.disk_location(&id(ns, 0)), None);
        let report = s.flush().unwrap();
        assert!(
            s.disk_location(&id(ns, 0)).is_some(),
            "flush returned before the evicted chunk was written: {report:?}"
        );
        assert_eq!(report.failed, 0);
        assert!(report.chunks >= 9, "{report:?}");
        drop(unpause);
        putter.join().unwrap();
    });
    s.flush().unwrap();
    for n in 0..9 {
        assert_eq!(s.get(&id(ns, n)).unwrap().data, big(n));
    }
    drop(s);
    // Dropped without close: only what flushes wrote is there.
    let s = ChunkStore::open(cfg(dir.path())).unwrap();
    for n in 0..9 {
        assert_eq!(s.get(&id(ns, n)).unwrap().data, big(n), "chunk {n}");
    }
}

fn a_read_error_in_the_recovery_walk_leaves_the_region_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let ns = record().id();
    let first = {
        let s = ChunkStore::open(cfg(dir.path())).unwrap();
        s.register_namespace(&record()).unwrap();
        s.put(id(ns, 1), payload(1)).unwrap();
        s.flush().unwrap();
        s.disk_location(&id(ns, 1)).unwrap().0
    };
    // Without a fault the open region is re-opened: new chunks join it.
    {
        let s = ChunkStore::open(cfg(dir.path())).unwrap();
        s.put(id(ns, 2), payload(2)).unwrap();
        s.flush().unwrap();
        assert_eq!(s.disk_location(&id(ns, 2)).unwrap().0, first);
    }
    // The walk reads the first batch, then fails: what it read is served,
    // and new chunks go to another region.
    fail::cfg("tier::recovery::scan_read", "1*off->return").unwrap();
    let s = ChunkStore::open(cfg(dir.path())).unwrap();
    fail::remove("tier::recovery::scan_read");
    assert_eq!(s.get(&id(ns, 1)).unwrap().data, payload(1));
    assert!(s.get(&id(ns, 2)).is_none(), "past the read error");
    s.put(id(ns, 3), payload(3)).unwrap();
    s.flush().unwrap();
    assert_ne!(s.disk_location(&id(ns, 3)).unwrap().0, first);
    drop(s);
    // Nothing was written to that region, so a clean open finds all of it.
    let s = ChunkStore::open(cfg(dir.path())).unwrap();
    for n in 1..=3 {
        assert_eq!(s.get(&id(ns, n)).unwrap().data, payload(n), "chunk {n}");
    }
}

fn split_reads_recover_from_failed_pieces_and_refused_contexts() {
    let big = |i: u64| Bytes::from(vec![(i as u8) ^ 0x5a; 1_500_000 + i as usize * 4096]);
    let cases = [
        ("tier::aio::piece", "3*return(short)->off"),
        ("tier::aio::piece", "2*return(eintr)->off"),
        ("tier::aio::piece", "return(eio)"),
        ("tier::aio::setup", "return(eagain)"),
        ("tier::aio::setup", "return(eperm)"),
    ];
    for (point, actions) in cases {
        let dir = tempfile::tempdir().unwrap();
        let c = TierConfig {
            region_size: 4 * MIB,
            disk_budget: 16 * MIB,
            ..cfg(dir.path())
        };
        let s = ChunkStore::open(c.clone()).unwrap();
        let ns = s.register_namespace(&record()).unwrap();
        for i in 0..3 {
            s.put(id(ns, i), big(i)).unwrap();
        }
        assert_eq!(s.flush().unwrap().failed, 0);
        drop(s);
        // A fresh store: no AIO context pooled yet, RAM empty.
        let s = ChunkStore::open(c).unwrap();
        fail::cfg(point, actions).unwrap();
        for i in 0..3 {
            let hit = s
                .get(&id(ns, i))
                .unwrap_or_else(|| panic!("{point}={actions}: chunk {i}"));
            assert!(hit.data == big(i), "{point}={actions}: chunk {i} bytes");
            assert_eq!(hit.tier, Tier::Disk);
        }
        fail::remove(point);
        assert_eq!(s.stats().verify_failures, 0, "{point}={actions}");
    }
}

fn a_gc_stopped_before_its_deletes_is_finished_at_the_next_open() {
    let dir = tempfile::tempdir().unwrap();
    let s = ChunkStore::open(cfg(dir.path())).unwrap();
    let a = s.register_namespace(&record()).unwrap();
    let b = s
        .register_namespace(&NamespaceRecord {
            rank: 1,
            ..record()
        })
        .unwrap();
    for n in 0..6 {
        s.put(id(a, n), payload(n)).unwrap();
        s.put(id(b, n), payload(n)).unwrap();
    }
    s.flush().unwrap();
    fail::cfg("tier::maintenance::gc_deleting", "return").unwrap();
    let opts = tier::GcOptions {
        namespaces: vec![a],
        older_than: None,
        dry_run: false,
    };
    assert!(s.gc(&opts).is_err(), "stopped at the failpoint");
    fail::remove("tier::maintenance::gc_deleting");
    assert!(s.get(&id(a, 0)).is_some(), "nothing was dropped yet");
    drop(s);
    assert_eq!(
        tier::maintenance::pending_gc(dir.path()).unwrap(),
        Some(vec![a])
    );

    // A read-only open (a plain verify) reads it all and changes nothing.
    let ro = ChunkStore::open(TierConfig {
        read_only: true,
        ..cfg(dir.path())
    })
    .unwrap();
    assert!(ro.get(&id(a, 3)).is_some());
    drop(ro);
    assert!(dir.path().join(tier::maintenance::GC_PENDING_FILE).exists());

    // A writable open whose finish fails (the flush's fdatasync) still
    // opens; the gc stays pending.
    fail::cfg("tier::writer::flush_sync", "return").unwrap();
    let s = ChunkStore::open(cfg(dir.path())).expect("opens all the same");
    fail::remove("tier::writer::flush_sync");
    // (The failed fdatasync poisons disk I/O until a reopen, as any.)
    assert!(s.stats().disk_poisoned);
    assert_eq!(s.locate(&id(b, 1)), Some(Tier::Disk));
    drop(s);
    assert_eq!(
        tier::maintenance::pending_gc(dir.path()).unwrap(),
        Some(vec![a])
    );

    // A writable open finishes the drop, durably.
    let s = ChunkStore::open(cfg(dir.path())).unwrap();
    for n in 0..6 {
        assert!(s.get(&id(a, n)).is_none(), "a/{n} dropped");
        assert_eq!(s.get(&id(b, n)).unwrap().data, payload(n), "b/{n} kept");
    }
    assert_eq!(
        s.namespaces().iter().map(|n| n.id).collect::<Vec<_>>(),
        vec![b]
    );
    assert!(!dir.path().join(tier::maintenance::GC_PENDING_FILE).exists());
    s.close(Duration::from_secs(10)).unwrap();
    let s = ChunkStore::open(cfg(dir.path())).unwrap();
    assert!(s.get(&id(a, 2)).is_none(), "still dropped after a restart");
    assert!(s.get(&id(b, 2)).is_some());
}

/// A disk hit whose region is reclaimed between its read and its promotion
/// into RAM is served, and not promoted: a clean RAM copy with no disk copy
/// behind it is never written (not dirty) nor rewritten (no longer
/// indexed), so it was served until a restart lost it.
fn a_disk_hit_whose_region_is_reclaimed_during_its_read_is_not_promoted() {
    let dir = tempfile::tempdir().unwrap();
    // RAM larger than the disk: the writes that reclaim region 0 below are
    // all queued before the read (no insert meanwhile changes its mark).
    let cfg = |dir: &std::path::Path| TierConfig {
        ram_budget: 16 * MIB,
        ..cfg(dir)
    };
    let s = ChunkStore::open(cfg(dir.path())).unwrap();
    let ns = s.register_namespace(&record()).unwrap();
    for n in 0..50 {
        s.put(id(ns, n), payload(n)).unwrap();
    }
    s.close(Duration::from_secs(30)).unwrap();
    drop(s);
    // Reopened: chunk 0 is on disk only, in region 0.
    let s = ChunkStore::open(cfg(dir.path())).unwrap();
    let first = id(ns, 0);
    assert_eq!(s.disk_location(&first).map(|l| l.0), Some(0));
    // ~9 MiB dirty in RAM, for an 8 MiB disk.
    for n in 1000..1400 {
        s.put(id(ns, n), payload(n % 300)).unwrap();
    }
    fail::cfg("tier::store::promote", "pause").unwrap();
    std::thread::scope(|scope| {
        let unpause = Off("tier::store::promote");
        let hits = s.stats().hits_disk;
        let reader = scope.spawn(|| s.get(&first).map(|h| h.data));
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while s.stats().hits_disk == hits {
            assert!(std::time::Instant::now() < deadline, "no disk hit");
            std::thread::sleep(Duration::from_millis(5));
        }
        // Writing them reclaims region 0 while the read waits.
        s.flush().unwrap();
        assert_eq!(s.disk_location(&first), None, "region 0 not reclaimed");
        drop(unpause);
        assert_eq!(reader.join().unwrap(), Some(payload(0)));
    });
    assert_eq!(
        s.locate(&first),
        None,
        "promoted with no disk copy behind it"
    );
    assert!(s.get(&first).is_none());
}

/// Disk QA: on a full filesystem (the preallocated store itself still had
/// room) HELLO of a new namespace failed, so that engine could not use the
/// RAM tier at all. It registers in memory; the next flush that can writes
/// the manifest.
fn a_namespace_registers_in_memory_when_its_manifest_cannot_be_written() {
    let dir = tempfile::tempdir().unwrap();
    let s = ChunkStore::open(cfg(dir.path())).unwrap();
    fail::cfg("tier::manifest::write", "return(enospc)").unwrap();
    let ns = s
        .register_namespace(&record())
        .expect("registered in memory");
    s.put(id(ns, 1), payload(1)).unwrap();
    assert_eq!(s.get(&id(ns, 1)).unwrap().data, payload(1));
    s.flush().unwrap();
    // Any other error still fails the registration.
    fail::cfg("tier::manifest::write", "return").unwrap();
    let other = NamespaceRecord {
        model: "other".into(),
        ..Default::default()
    };
    assert!(s.register_namespace(&other).is_err());
    fail::remove("tier::manifest::write");
    // Room again: the next flush writes the manifest.
    s.flush().unwrap();
    s.close(Duration::from_secs(10)).unwrap();
    drop(s);
    let s = ChunkStore::open(cfg(dir.path())).unwrap();
    assert_eq!(s.namespace_record(&ns), Some(record()));
    assert_eq!(s.get(&id(ns, 1)).unwrap().data, payload(1));
}
