//! A whole store of the current on-disk version, committed under
//! `tier/tests/fixtures/store-v1/`, read again by every build.
//!
//! `golden.rs` pins the chunk header; nothing else pinned the store file
//! itself: the superblock, the region slots, the batch records, the region
//! summaries (rkyv) and the namespace manifest, nor the hashes that name
//! what is stored (namespace ids, family ids, the keys of named chunks). An
//! accidental change to any of them (a field reordered in a summary entry,
//! an rkyv upgrade that lays archives out differently, another hash domain)
//! passed every test, and existing stores would then have been read as
//! damaged or as empty. Here the committed store must open, recover every
//! chunk it holds byte for byte (sealed regions through their summaries,
//! the region still open at the stop through its batches), keep what was
//! deleted deleted and an overwrite's newest version, and verify clean.
//!
//! A deliberate change bumps `STORE_VERSION` (or `FORMAT_VERSION`), keeps
//! this version's fixture (it must then be read or refused by name), and
//! blesses a fixture of the new version with
//! `KVTIER_BLESS=1 cargo nextest run -p kvtier-tier --test golden_store`.
//!
//! Not covered: `deletes.pending` and `gc.pending`, which exist only while
//! a delete or a gc waits for a full or failing disk.

use std::path::{Path, PathBuf};
use std::time::Duration;

use bytes::Bytes;
use tier::{ChunkId, ChunkKey, ChunkStore, NamespaceRecord, Tier, TierConfig, VerifyOptions};

/// The fixture's geometry: small regions, so the workload seals several.
const REGION: u64 = 64 << 10;
const REGIONS: u64 = 24;

fn record(rank: u32) -> NamespaceRecord {
    NamespaceRecord {
        model: "golden-model".into(),
        model_revision: "r1".into(),
        engine: "vllm".into(),
        engine_version: "0.33".into(),
        tp_size: 2,
        rank,
        kv_dtype: "bfloat16".into(),
        block_size: 16,
        chunk_tokens: 256,
        ..Default::default()
    }
}

/// Pinned ids of the records above and of a named chunk's key: these
/// name what a store holds, so changing how they are hashed strands every
/// stored chunk (and splits a cluster of mixed versions).
const NS_RANK0: &str = "4f66b012f1cf8d451cffc730a84d363a";
const NS_RANK1: &str = "8a9b7039f8ce54275864f6cfc379fb38";
const FAMILY: &str = "fe8469435dda797182d70bfd4953c184";
const NAME: &[u8] = b"golden-model@2@0@00ff42@bfloat16";
const NAME_KEY: &str = "41faac6d97d25ddb360856dbaf7de240f5961d499c76ea531827d27b714c16ed";

fn key(n: u64) -> ChunkKey {
    let mut k = [0u8; 32];
    for (i, b) in k.iter_mut().enumerate() {
        *b = (n as u8).wrapping_mul(31) ^ (i as u8).wrapping_mul(7) ^ 0x5a;
    }
    k[0] = n as u8;
    k[1] = (n >> 8) as u8;
    ChunkKey(k)
}

/// Deterministic bytes of chunk `n`, version `v`.
fn payload(n: u64, v: u64, len: usize) -> Bytes {
    let mut x = (n * 1_000 + v).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect::<Vec<u8>>()
        .into()
}

/// What the fixture must hold after the workload: each chunk with its
/// name and bytes, or `None` for one that must be absent.
struct Expect {
    id: ChunkId,
    name: Option<&'static [u8]>,
    data: Option<Bytes>,
}

fn expected() -> Vec<Expect> {
    let (ns0, ns1) = (record(0).id(), record(1).id());
    let mut out = Vec::new();
    // Plain chunks of both ranks, three groups, 0 bytes to 40 KiB: they fill
    // and seal several regions.
    for n in 0..40u64 {
        let ns = if n % 4 == 3 { ns1 } else { ns0 };
        let len = match n % 5 {
            0 => 0,
            1 => 1,
            2 => 4_096,
            3 => 13_001,
            _ => 40_960 - n as usize,
        };
        out.push(Expect {
            id: ChunkId::new(ns, key(n), (n % 3) as u16),
            name: None,
            data: Some(payload(n, 0, len)),
        });
    }
    // An atomic group (every member, one boundary).
    for g in 0..3u16 {
        out.push(Expect {
            id: ChunkId::new(ns0, key(100), g),
            name: None,
            data: Some(payload(100 + u64::from(g), 0, 9_000)),
        });
    }
    // A named chunk (as RESP stores one).
    out.push(Expect {
        id: ChunkId::new(ns0, ChunkKey::from_name(NAME), 0),
        name: Some(NAME),
        data: Some(payload(200, 0, 7_777)),
    });
    // Overwritten after a flush: the second version.
    out.push(Expect {
        id: ChunkId::new(ns0, key(300), 0),
        name: None,
        data: Some(payload(300, 2, 6_000)),
    });
    // Deleted after a flush: absent.
    out.push(Expect {
        id: ChunkId::new(ns1, key(400), 1),
        name: None,
        data: None,
    });
    out
}

fn config(dir: &Path) -> TierConfig {
    TierConfig {
        data_dir: dir.to_path_buf(),
        ram_budget: 1 << 20,
        disk_budget: REGION * REGIONS,
        region_size: REGION,
        idle_flush_after: Duration::from_secs(3600),
        ..TierConfig::default()
    }
}

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/store-v1")
}

/// Writes the fixture's store into `dir` with the current code.
fn write_fixture(dir: &Path) {
    let s = ChunkStore::open(config(dir)).expect("open");
    assert_eq!(
        s.register_namespace(&record(0)).expect("ns0"),
        record(0).id()
    );
    assert_eq!(
        s.register_namespace(&record(1)).expect("ns1"),
        record(1).id()
    );
    let ns0 = record(0).id();
    let ns1 = record(1).id();
    // Versions that are later replaced or deleted.
    s.put(ChunkId::new(ns0, key(300), 0), payload(300, 1, 20_000))
        .expect("put");
    s.put(ChunkId::new(ns1, key(400), 1), payload(400, 0, 5_000))
        .expect("put");
    s.flush().expect("flush");
    let all = expected();
    let group: Vec<(ChunkId, Bytes)> = all
        .iter()
        .filter(|e| e.id.key == key(100))
        .map(|e| (e.id, e.data.clone().expect("present")))
        .collect();
    for e in &all {
        let Some(data) = &e.data else {
            assert!(s.delete(&e.id), "the chunk to delete was stored");
            continue;
        };
        if e.id.key == key(100) {
            continue;
        }
        match e.name {
            Some(name) => s.put_named(e.id, Bytes::from_static(name), data.clone()),
            None => s.put(e.id, data.clone()),
        }
        .expect("put");
    }
    s.put_atomic(group).expect("atomic put");
    s.flush().expect("flush");
    let st = s.stats();
    assert!(
        st.disk_bytes > 3 * REGION && st.region_evictions == 0,
        "the workload should seal several regions and reclaim none: {st:?}"
    );
    s.close(Duration::from_secs(30)).expect("close");
}

/// With `KVTIER_BLESS=1`, (re)writes the fixture (every file of the data
/// dir except the lock).
fn bless_if_asked() {
    if std::env::var_os("KVTIER_BLESS").is_none_or(|v| v != "1") {
        return;
    }
    let tmp = tempfile::tempdir().expect("temp dir");
    write_fixture(tmp.path());
    let dir = fixture_dir();
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("fixture dir");
    for f in std::fs::read_dir(tmp.path()).expect("read dir") {
        let f = f.expect("entry");
        if f.file_name() != "LOCK" && f.file_type().expect("type").is_file() {
            std::fs::copy(f.path(), dir.join(f.file_name())).expect("copy");
        }
    }
}

/// A copy of the fixture in a temporary dir (opening a store writes to it).
fn fixture_copy() -> tempfile::TempDir {
    let tmp = tempfile::tempdir().expect("temp dir");
    let entries = std::fs::read_dir(fixture_dir()).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; bless it with KVTIER_BLESS=1",
            fixture_dir().display()
        )
    });
    for f in entries {
        let f = f.expect("entry");
        std::fs::copy(f.path(), tmp.path().join(f.file_name())).expect("copy");
    }
    tmp
}

#[test]
fn hashes_that_name_stored_chunks_are_pinned() {
    assert_eq!(record(0).id().to_string(), NS_RANK0, "namespace id");
    assert_eq!(record(1).id().to_string(), NS_RANK1, "namespace id");
    assert_eq!(record(0).family().to_string(), FAMILY, "family id");
    assert_eq!(record(1).family().to_string(), FAMILY, "family id");
    assert_eq!(ChunkKey::from_name(NAME).to_string(), NAME_KEY, "name key");
}

#[test]
fn the_committed_store_reads_byte_exact() {
    bless_if_asked();
    let tmp = fixture_copy();
    let s = ChunkStore::open(config(tmp.path())).expect("open the committed store");
    let known: Vec<_> = s.namespaces().iter().map(|n| n.id).collect();
    for r in [record(0), record(1)] {
        assert!(
            known.contains(&r.id()),
            "namespace {} not recovered",
            r.id()
        );
    }
    let mut present = 0;
    for e in expected() {
        let hit = match e.name {
            Some(name) => s.get_named(&e.id, name),
            None => s.get(&e.id),
        };
        match (&e.data, hit) {
            (Some(want), Some(hit)) => {
                assert_eq!(hit.tier, Tier::Disk, "{:?} read from disk", e.id);
                assert!(hit.data == *want, "{:?}: wrong bytes", e.id);
                present += 1;
            }
            (Some(_), None) => panic!("{:?} missing from the committed store", e.id),
            (None, Some(_)) => panic!("{:?} was deleted, and is back", e.id),
            (None, None) => {}
        }
    }
    let st = s.stats();
    assert_eq!(st.disk_chunks, present, "{st:?}");
    assert_eq!(st.verify_failures, 0);
    assert_eq!(st.damaged_metadata, 0);
    let report = s
        .verify(&VerifyOptions::default(), &mut |_, _| {})
        .expect("verify");
    assert_eq!((report.checked, report.bad), (present, 0), "{report:?}");
    s.close(Duration::from_secs(30)).expect("close");
}
