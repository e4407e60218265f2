//! `ChunkStore::put_clean`: a copy admitted from elsewhere (a peer) lives in
//! RAM only, is never written to this node's disk (not by flush, eviction
//! or close), never replaces a chunk held here, and is announced to the
//! observer like any chunk held.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use parking_lot::Mutex;
use tier::{ChunkId, ChunkKey, ChunkObserver, ChunkStore, NamespaceRecord, Tier, TierConfig};

const MIB: u64 = 1 << 20;

fn config(dir: &std::path::Path) -> TierConfig {
    TierConfig {
        data_dir: dir.to_path_buf(),
        ram_budget: 2 * MIB,
        disk_budget: 8 * MIB,
        region_size: MIB,
        idle_flush_after: Duration::from_secs(3600),
        writer_queue: 64,
        ..TierConfig::default()
    }
}

fn id(ns: tier::Namespace, n: u8) -> ChunkId {
    ChunkId::new(ns, ChunkKey([n; 32]), 0)
}

fn payload(n: u8, len: usize) -> Bytes {
    Bytes::from(
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31) ^ n)
            .collect::<Vec<u8>>(),
    )
}

#[derive(Default)]
struct Log(Mutex<Vec<(ChunkId, bool)>>);

impl ChunkObserver for Log {
    fn added(&self, id: &ChunkId, _len: u64) {
        self.0.lock().push((*id, true));
    }
    fn removed(&self, id: &ChunkId) {
        self.0.lock().push((*id, false));
    }
}

#[test]
fn clean_copies_never_reach_the_local_disk() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ns;
    {
        let s = ChunkStore::open(config(dir.path())).expect("open");
        ns = s
            .register_namespace(&NamespaceRecord {
                model: "m".into(),
                ..Default::default()
            })
            .expect("namespace");
        let log = Arc::new(Log::default());
        s.set_observer(log.clone());
        assert!(
            s.put_clean(id(ns, 1), None, payload(1, 100_000))
                .expect("admit")
        );
        assert!(
            s.put_clean(
                id(ns, 2),
                Some(Bytes::from_static(b"resp:k")),
                payload(2, 50_000)
            )
            .expect("admit named")
        );
        assert_eq!(s.locate(&id(ns, 1)), Some(Tier::Ram));
        assert_eq!(s.get(&id(ns, 1)).expect("hit").data, payload(1, 100_000));
        assert!(s.get_named(&id(ns, 2), b"other").is_none());
        assert_eq!(
            s.get_named(&id(ns, 2), b"resp:k").expect("hit").data,
            payload(2, 50_000)
        );
        assert_eq!(s.stats().dirty_bytes, 0);

        // A chunk PUT here is not replaced by a clean copy, and stays dirty.
        s.put(id(ns, 3), payload(3, 10_000)).expect("put");
        assert!(
            !s.put_clean(id(ns, 3), None, payload(9, 10_000))
                .expect("admit")
        );
        assert_eq!(s.get(&id(ns, 3)).expect("hit").data, payload(3, 10_000));

        let r = s.flush().expect("flush");
        assert_eq!(r.chunks, 1, "only the PUT chunk is written");
        let st = s.stats();
        assert_eq!((st.disk_chunks, st.disk_writes), (1, 1));

        // Overflow RAM with clean copies: evicted ones are gone, not written.
        for n in 10..60u8 {
            s.put_clean(id(ns, n), None, payload(n, 100_000))
                .expect("admit");
        }
        let st = s.stats();
        assert!(st.ram_evictions > 0, "{st:?}");
        assert_eq!((st.disk_chunks, st.disk_writes), (1, 1), "{st:?}");
        assert_eq!(s.locate(&id(ns, 1)), None, "evicted clean copy is gone");
        let events = log.0.lock().clone();
        assert!(events.contains(&(id(ns, 1), true)));
        assert!(events.contains(&(id(ns, 1), false)));
        s.close(Duration::from_secs(10)).expect("close");
    }
    let s = ChunkStore::open(config(dir.path())).expect("reopen");
    assert_eq!(s.stats().disk_chunks, 1);
    assert!(
        s.get(&id(ns, 59)).is_none(),
        "clean copies do not survive a restart"
    );
    assert_eq!(s.get(&id(ns, 3)).expect("hit").data, payload(3, 10_000));
}
