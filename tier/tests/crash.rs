//! Crash consistency.
//!
//! (a) A scripted workload on a [`CrashDevice`], crashed at every sync point
//!     in turn, each crash image with dropped / applied / torn unsynced
//!     writes; after reopening: no wrong bytes, no phantom chunks, every chunk
//!     whose `flush()` returned is present, atomic groups all-or-nothing.
//! (b) A property test: random put / get / delete / flush / crash+reopen
//!     against a `BTreeMap` model.
//! (c) A real `kill -9` loop: this test binary re-runs itself as a child
//!     that puts and flushes, printing what `flush()` confirmed, and is
//!     killed with SIGKILL at random moments; the parent reopens and checks.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{BufRead, BufReader};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use proptest::prelude::*;
use tier::testdev::CrashDevice;
use tier::{ChunkId, ChunkKey, ChunkStore, Namespace, NamespaceRecord, TierConfig, WritePolicy};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

fn record() -> NamespaceRecord {
    NamespaceRecord {
        model: "crash".into(),
        ..Default::default()
    }
}

fn id(ns: Namespace, n: u64) -> ChunkId {
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&n.wrapping_mul(0x9e37_79b9_7f4a_7c15).to_le_bytes());
    key[8..16].copy_from_slice(&n.to_le_bytes());
    ChunkId::new(ns, ChunkKey(key), 0)
}

/// Deterministic content of version `v` of chunk `n` (length varies).
fn value(n: u64, v: u64, max: u64) -> Bytes {
    let len = (1000 + (n * 7919 + v * 104_729) % max) as usize;
    let mut x = (n << 20 ^ v).wrapping_mul(0x2545_f491_4f6c_dd1d) | 1;
    let mut out = vec![0u8; len.next_multiple_of(8)];
    for w in out.chunks_exact_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        w.copy_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out[..8].copy_from_slice(&n.to_le_bytes());
    out[8..16].copy_from_slice(&v.to_le_bytes());
    Bytes::from(out)
}

fn cfg(dir: &std::path::Path, region: u64) -> TierConfig {
    TierConfig {
        data_dir: dir.to_path_buf(),
        ram_budget: MIB,
        disk_budget: 0, // the device decides
        region_size: region,
        idle_flush_after: Duration::from_secs(3600),
        write_policy: WritePolicy::Backpressure,
        writer_queue: 8,
        pack_threads: Some(1),
        ..TierConfig::default()
    }
}

#[derive(Clone, Copy, Debug)]
enum Op {
    Put(u64),
    Delete(u64),
    Flush,
    Atomic(u64), // ids n, n+1, n+2 as one group
}

fn script() -> Vec<Op> {
    let mut ops = Vec::new();
    for i in 0..90u64 {
        ops.push(Op::Put(i % 40));
        if i % 7 == 3 {
            ops.push(Op::Delete((i * 3) % 40));
        }
        if i % 11 == 5 {
            ops.push(Op::Atomic(100 + i));
        }
        if i % 6 == 5 {
            ops.push(Op::Flush);
        }
    }
    ops.push(Op::Flush);
    ops
}

/// What a run learned: every value ever put per id, the state confirmed by
/// the last successful flush, ids touched since, and the atomic groups.
#[derive(Default)]
struct Model {
    ever: HashMap<u64, Vec<Bytes>>,
    confirmed: HashMap<u64, Option<Bytes>>,
    current: HashMap<u64, Option<Bytes>>,
    touched_since_flush: HashSet<u64>,
    groups: Vec<Vec<u64>>,
}

const MAXLEN: u64 = 40 * KIB;

/// Runs the script until an operation fails (the device crashed).
fn run_script(store: &ChunkStore, ns: Namespace, m: &mut Model) {
    let mut version = 0u64;
    for op in script() {
        version += 1;
        match op {
            Op::Put(n) => {
                let v = value(n, version, MAXLEN);
                if store.put(id(ns, n), v.clone()).is_err() {
                    return;
                }
                m.ever.entry(n).or_default().push(v.clone());
                m.current.insert(n, Some(v));
                m.touched_since_flush.insert(n);
            }
            Op::Delete(n) => {
                store.delete(&id(ns, n));
                m.current.insert(n, None);
                m.touched_since_flush.insert(n);
            }
            Op::Atomic(n) => {
                let members: Vec<u64> = (n..n + 3).collect();
                let chunks: Vec<_> = members
                    .iter()
                    .map(|&k| (id(ns, k), value(k, version, MAXLEN)))
                    .collect();
                if store.put_atomic(chunks.clone()).is_err() {
                    return;
                }
                for (k, (_, v)) in members.iter().zip(chunks) {
                    m.ever.entry(*k).or_default().push(v.clone());
                    m.current.insert(*k, Some(v));
                    m.touched_since_flush.insert(*k);
                }
                m.groups.push(members);
            }
            Op::Flush => {
                if store.flush().is_err() {
                    return;
                }
                m.confirmed
                    .extend(m.current.iter().map(|(k, v)| (*k, v.clone())));
                m.touched_since_flush.clear();
            }
        }
    }
}

/// Checks a reopened store against what the crashed run learned.
fn check(store: &ChunkStore, ns: Namespace, m: &Model, ctx: &str) {
    let mut present = HashSet::new();
    for (cid, len) in store.ids() {
        let n = u64::from_le_bytes(cid.key.0[8..16].try_into().unwrap());
        assert_eq!(cid, id(ns, n), "{ctx}: foreign id");
        assert!(m.ever.contains_key(&n), "{ctx}: phantom chunk {n}");
        let got = store
            .get(&cid)
            .unwrap_or_else(|| panic!("{ctx}: listed {n} unreadable"));
        assert_eq!(got.data.len() as u64, len);
        assert!(m.ever[&n].contains(&got.data), "{ctx}: wrong bytes for {n}");
        present.insert(n);
    }
    for (n, state) in &m.confirmed {
        if m.touched_since_flush.contains(n) {
            continue;
        }
        match state {
            Some(v) => {
                let got = store.get(&id(ns, *n));
                assert_eq!(
                    got.map(|h| h.data).as_ref(),
                    Some(v),
                    "{ctx}: flushed chunk {n} lost or stale"
                );
            }
            None => assert!(!present.contains(n), "{ctx}: flushed delete of {n} undone"),
        }
    }
    for g in &m.groups {
        let p: Vec<bool> = g.iter().map(|k| present.contains(k)).collect();
        // Group members are never written again after their group.
        assert!(
            p.iter().all(|&x| x) || p.iter().all(|&x| !x),
            "{ctx}: half-visible atomic group {g:?}: {p:?}"
        );
    }
}

/// Chunks the idle pass wrote are made durable once the writer is quiet,
/// without a flush: before, they stayed unsynced (lost at a power loss)
/// while `dirty_bytes` already said 0, until the next flush or region seal.
#[test]
fn a_quiet_writer_syncs_what_the_idle_pass_wrote() {
    let dir = tempfile::tempdir().unwrap();
    let dev = Arc::new(CrashDevice::new(8 * MIB));
    let config = TierConfig {
        idle_flush_after: Duration::from_millis(40),
        ..cfg(dir.path(), 256 * KIB)
    };
    let s = ChunkStore::open_with_device(config.clone(), dev.clone()).unwrap();
    let ns = s.register_namespace(&record()).unwrap();
    let v = value(7, 1, 64 * KIB);
    s.put(id(ns, 7), v.clone()).unwrap();
    // The idle thread writes it (older than 40 ms, queue empty; the region
    // it opens syncs first), then the quiet writer syncs: bounded waits.
    let wait = |done: &dyn Fn() -> bool| {
        let until = Instant::now() + Duration::from_secs(10);
        while !done() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(20));
        }
        done()
    };
    assert!(
        wait(&|| s.stats().disk_writes == 1),
        "the idle pass wrote the chunk"
    );
    let syncs = dev.syncs();
    assert!(wait(&|| dev.syncs() > syncs), "the quiet writer synced");
    assert_eq!(s.stats().dirty_bytes, 0);
    let image = dev.durable_image();
    drop(s);
    let s = ChunkStore::open_with_device(config, Arc::new(CrashDevice::from_image(image))).unwrap();
    assert!(
        s.get(&id(ns, 7)).is_some_and(|h| h.data == v),
        "the chunk is in the durable image"
    );
}

/// Writes that keep trickling in (each restarting the quiet time) are
/// synced within about a second all the same: a put every 100 ms had kept
/// every write unsynced until its region filled (review).
#[test]
fn a_trickle_of_writes_is_synced_within_a_second() {
    let dir = tempfile::tempdir().unwrap();
    let dev = Arc::new(CrashDevice::new(8 * MIB));
    let config = TierConfig {
        idle_flush_after: Duration::from_millis(20),
        ..cfg(dir.path(), MIB)
    };
    let s = ChunkStore::open_with_device(config.clone(), dev.clone()).unwrap();
    let ns = s.register_namespace(&record()).unwrap();
    let first = Bytes::from(vec![7u8; 1000]);
    s.put(id(ns, 0), first.clone()).unwrap();
    for n in 1..=25u64 {
        std::thread::sleep(Duration::from_millis(100));
        s.put(id(ns, n), Bytes::from(vec![n as u8; 1000])).unwrap();
    }
    // At once, while the trickle's last writes are still due: the first
    // chunk, written some 2.4 s ago, is durable.
    let image = dev.durable_image();
    let writes = s.stats().disk_writes;
    assert_eq!(s.stats().region_evictions, 0);
    drop(s);
    let s = ChunkStore::open_with_device(config, Arc::new(CrashDevice::from_image(image))).unwrap();
    assert!(
        s.get(&id(ns, 0)).is_some_and(|h| h.data == first),
        "the first of {writes} trickled writes is not durable after 2.4 s"
    );
}

#[test]
fn crash_at_every_sync_point_keeps_the_store_consistent() {
    let dir = tempfile::tempdir().unwrap();
    let region = 256 * KIB;
    let dev_len = 8 * MIB;
    // A clean run: how many syncs, and no reclaim (every flushed chunk must
    // then survive).
    let total_syncs = {
        let dev = Arc::new(CrashDevice::new(dev_len));
        let s = ChunkStore::open_with_device(cfg(dir.path(), region), dev.clone()).unwrap();
        let ns = s.register_namespace(&record()).unwrap();
        let mut m = Model::default();
        run_script(&s, ns, &mut m);
        let st = s.stats();
        assert_eq!(st.region_evictions, 0);
        assert!(st.ram_evictions > 10, "the script must evict: {st:?}");
        drop(s);
        let s = ChunkStore::open_with_device(
            cfg(dir.path(), region),
            Arc::new(CrashDevice::from_image(dev.durable_image())),
        )
        .unwrap();
        check(&s, ns, &m, "clean run");
        dev.syncs()
    };
    assert!(total_syncs > 20, "{total_syncs}");
    for n in 1..=total_syncs {
        let dev = Arc::new(CrashDevice::new(dev_len));
        let s = ChunkStore::open_with_device(cfg(dir.path(), region), dev.clone()).unwrap();
        let ns = s.register_namespace(&record()).unwrap();
        dev.crash_at_sync(n);
        let mut m = Model::default();
        run_script(&s, ns, &mut m);
        dev.crash_now();
        drop(s);
        for seed in 0..3 {
            let img = dev.image(seed * 1000 + n);
            let d2 = Arc::new(CrashDevice::from_image(img));
            let s = ChunkStore::open_with_device(cfg(dir.path(), region), d2.clone())
                .unwrap_or_else(|e| panic!("reopen after crash at sync {n}: {e}"));
            check(&s, ns, &m, &format!("crash at sync {n} seed {seed}"));
            // The recovered store takes writes and survives another reopen.
            s.put(id(ns, 999), value(999, 1, MAXLEN)).unwrap();
            s.flush().unwrap();
            drop(s);
            let s = ChunkStore::open_with_device(
                cfg(dir.path(), region),
                Arc::new(CrashDevice::from_image(d2.durable_image())),
            )
            .unwrap();
            assert_eq!(s.get(&id(ns, 999)).unwrap().data, value(999, 1, MAXLEN));
        }
    }
}

#[derive(Clone, Debug)]
enum MOp {
    Put(u8, u8),
    Get(u8),
    Delete(u8),
    Flush,
    Crash(u64),
}

fn mop() -> impl Strategy<Value = MOp> {
    prop_oneof![
        6 => (0u8..24, any::<u8>()).prop_map(|(k, v)| MOp::Put(k, v)),
        3 => (0u8..24).prop_map(MOp::Get),
        1 => (0u8..24).prop_map(MOp::Delete),
        2 => Just(MOp::Flush),
        1 => any::<u64>().prop_map(MOp::Crash),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn random_ops_with_crashes_agree_with_a_model(ops in proptest::collection::vec(mop(), 1..80), small in any::<bool>()) {
        let dir = tempfile::tempdir().unwrap();
        // small: 8 regions of 64 KiB, so regions are reclaimed (a chunk may
        // then vanish, but never come back wrong); else nothing is reclaimed.
        let (region, len) = if small { (64 * KIB, 512 * KIB) } else { (256 * KIB, 16 * MIB) };
        let mut dev = Arc::new(CrashDevice::new(len));
        let mut s = ChunkStore::open_with_device(cfg(dir.path(), region), dev.clone()).unwrap();
        let ns = s.register_namespace(&record()).unwrap();
        let mut model: BTreeMap<u64, Bytes> = BTreeMap::new();
        let mut ever: HashMap<u64, Vec<Bytes>> = HashMap::new();
        let mut flushed: BTreeMap<u64, Option<Bytes>> = BTreeMap::new();
        let mut dirty: HashSet<u64> = HashSet::new();
        for op in ops {
            match op {
                MOp::Put(k, v) => {
                    let k = u64::from(k);
                    let val = value(k, u64::from(v), 30 * KIB);
                    s.put(id(ns, k), val.clone()).unwrap();
                    ever.entry(k).or_default().push(val.clone());
                    model.insert(k, val);
                    dirty.insert(k);
                }
                MOp::Get(k) => {
                    let k = u64::from(k);
                    let got = s.get(&id(ns, k)).map(|h| h.data);
                    match (&got, model.get(&k)) {
                        (Some(g), Some(m)) => prop_assert_eq!(g, m),
                        (Some(_), None) => prop_assert!(false, "deleted chunk {} served", k),
                        (None, Some(_)) => prop_assert!(small, "chunk {} lost without reclaim", k),
                        (None, None) => {}
                    }
                }
                MOp::Delete(k) => {
                    let k = u64::from(k);
                    s.delete(&id(ns, k));
                    model.remove(&k);
                    dirty.insert(k);
                }
                MOp::Flush => {
                    s.flush().unwrap();
                    for k in dirty.drain() {
                        flushed.insert(k, model.get(&k).cloned());
                    }
                }
                MOp::Crash(seed) => {
                    dev.crash_now();
                    drop(s);
                    dev = Arc::new(CrashDevice::from_image(dev.image(seed)));
                    s = ChunkStore::open_with_device(cfg(dir.path(), region), dev.clone()).unwrap();
                    // Re-derive the model from what survived, checking it.
                    let mut survived = BTreeMap::new();
                    for k in 0..24u64 {
                        if let Some(h) = s.get(&id(ns, k)) {
                            prop_assert!(ever.get(&k).is_some_and(|e| e.contains(&h.data)), "wrong bytes for {}", k);
                            survived.insert(k, h.data);
                        }
                        if !small && !dirty.contains(&k) {
                            if let Some(state) = flushed.get(&k) {
                                prop_assert_eq!(survived.get(&k), state.as_ref(), "flushed state of {} lost", k);
                            }
                        }
                    }
                    model = survived;
                    flushed = model.iter().map(|(k, v)| (*k, Some(v.clone()))).collect();
                    dirty.clear();
                }
            }
        }
    }
}

const CHILD_ENV: &str = "KVTIER_CRASH_CHILD_DIR";
const CHILD_BASE: &str = "KVTIER_CRASH_CHILD_BASE";

fn kill_cfg(dir: &std::path::Path) -> TierConfig {
    TierConfig {
        data_dir: dir.to_path_buf(),
        ram_budget: MIB,
        disk_budget: 64 * MIB,
        region_size: MIB,
        idle_flush_after: Duration::from_secs(3600),
        write_policy: WritePolicy::Backpressure,
        ..TierConfig::default()
    }
}

/// The child of the kill -9 loop (runs only when spawned by the parent):
/// puts chunks `base..base+300` of 16 KiB, flushes every 10 and prints the
/// highest id confirmed, then waits to be killed.
#[test]
#[ignore = "child process of kill_9_loop_never_loses_flushed_chunks"]
fn crash_child() {
    let Ok(dir) = std::env::var(CHILD_ENV) else {
        return;
    };
    let base: u64 = std::env::var(CHILD_BASE).unwrap().parse().unwrap();
    let s = ChunkStore::open(kill_cfg(std::path::Path::new(&dir))).unwrap();
    let ns = s.register_namespace(&record()).unwrap();
    println!("READY");
    for i in 0..300u64 {
        let n = base + i;
        s.put(id(ns, n), value(n, 0, 16 * KIB)).unwrap();
        if i % 10 == 9 {
            s.flush().unwrap();
            println!("FLUSHED {n}");
        }
    }
    println!("DONE");
    std::thread::sleep(Duration::from_secs(30));
}

#[test]
fn kill_9_loop_never_loses_flushed_chunks() {
    let dir = tempfile::tempdir().unwrap();
    let exe = std::env::current_exe().unwrap();
    let mut confirmed: Vec<(u64, u64)> = Vec::new(); // (base, highest flushed)
    let started = Instant::now();
    let mut rng = 0x1234_5678_u64;
    let mut loops = 0;
    while loops < 20 && started.elapsed() < Duration::from_secs(20) {
        let base = loops * 1000;
        let mut child = std::process::Command::new(&exe)
            .args(["--exact", "crash_child", "--ignored", "--nocapture"])
            .env(CHILD_ENV, dir.path())
            .env(CHILD_BASE, base.to_string())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        // Wait for READY, then kill at a random moment 0..150 ms later.
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut highest = None;
        loop {
            let line = rx.recv_timeout(deadline.saturating_duration_since(Instant::now()));
            match line {
                Ok(l) if l == "READY" => break,
                Ok(_) => {}
                Err(_) => panic!("child did not get ready"),
            }
        }
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let kill_at = Instant::now() + Duration::from_millis(rng % 150);
        while Instant::now() < kill_at {
            if let Ok(l) = rx.recv_timeout(kill_at.saturating_duration_since(Instant::now())) {
                if let Some(n) = l.strip_prefix("FLUSHED ") {
                    highest = Some(n.parse::<u64>().unwrap());
                }
            }
        }
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        reader.join().unwrap();
        // Lines printed before the kill were confirmed before it.
        for l in rx.try_iter() {
            if let Some(n) = l.strip_prefix("FLUSHED ") {
                highest = Some(n.parse::<u64>().unwrap());
            }
        }
        if let Some(h) = highest {
            confirmed.push((base, h));
        }
        // Reopen and check everything so far.
        let s = ChunkStore::open(kill_cfg(dir.path())).unwrap();
        let ns = record().id();
        for (cid, _) in s.ids() {
            let n = u64::from_le_bytes(cid.key.0[8..16].try_into().unwrap());
            assert!(n % 1000 < 300 && n / 1000 <= loops, "phantom {n}");
            assert_eq!(
                s.get(&cid).unwrap().data,
                value(n, 0, 16 * KIB),
                "wrong bytes for {n}"
            );
        }
        for &(b, h) in &confirmed {
            for n in b..=h {
                assert_eq!(
                    s.get(&id(ns, n)).map(|x| x.data),
                    Some(value(n, 0, 16 * KIB)),
                    "loop {loops}: flushed chunk {n} missing"
                );
            }
        }
        drop(s);
        loops += 1;
    }
    assert!(loops >= 5, "only {loops} loops ran");
}

/// A re-opened region must not chain into a batch left from before the
/// crash. Image: batches A (chunk 2, v0), T (a tombstone), C (chunk 2, v1)
/// with T lost and C landed (unsynced writes land in any order). Recovery
/// stops at T's hole and serves v0; the next incarnation deletes chunk 2,
/// whose tombstone batch has T's length and so ends exactly where C starts.
/// Were C still there, a third open would chain into it and revive v1
/// after a flushed delete.
#[test]
fn a_leftover_batch_past_the_recovered_end_is_never_chained_into() {
    let dir = tempfile::tempdir().unwrap();
    let region = 256 * KIB;
    let dev = Arc::new(CrashDevice::new(2 * MIB));
    let s = ChunkStore::open_with_device(cfg(dir.path(), region), dev.clone()).unwrap();
    let ns = s.register_namespace(&record()).unwrap();
    let (v0, v1) = (value(2, 0, 2000), value(2, 1, 2000));
    s.put(id(ns, 2), v0.clone()).unwrap();
    s.flush().unwrap();
    let a = s.disk_location(&id(ns, 2)).unwrap();
    s.delete(&id(ns, 9));
    s.flush().unwrap();
    s.put(id(ns, 2), v1.clone()).unwrap();
    s.flush().unwrap();
    let c = s.disk_location(&id(ns, 2)).unwrap();
    drop(s);
    // Layout: A = head block + one record block at 12 KiB; T = one block at
    // 20 KiB; C's record right after its head block at 24 KiB.
    assert_eq!((a.0, a.1, c.0, c.1), (0, 16384, 0, 28672), "layout changed");
    let mut img = dev.durable_image();
    img[20480..24576].fill(0); // T lost, C landed
    let dev2 = Arc::new(CrashDevice::from_image(img));
    let s = ChunkStore::open_with_device(cfg(dir.path(), region), dev2.clone()).unwrap();
    assert_eq!(s.get(&id(ns, 2)).unwrap().data, v0, "recovery stops at T");
    assert!(s.delete(&id(ns, 2)));
    s.flush().unwrap();
    drop(s);
    let s = ChunkStore::open_with_device(
        cfg(dir.path(), region),
        Arc::new(CrashDevice::from_image(dev2.durable_image())),
    )
    .unwrap();
    assert!(
        s.get(&id(ns, 2)).is_none(),
        "a flushed delete was undone by a leftover batch"
    );
    s.put(id(ns, 3), value(3, 0, 2000)).unwrap();
    s.flush().unwrap();
    assert_eq!(s.get(&id(ns, 3)).unwrap().data, value(3, 0, 2000));
}
