//! Recovery (open → serving) time of a store of 1,000,000 small chunks
//! (256-byte payloads), of the same in atomic groups of two (a tenth of
//! them put again as new groups, so recovery keeps their earlier
//! locations), and of 2,000 chunks of 1 MiB (2 GiB; the 10,000
//! would need 10 GiB of bench disk; recovery reads summaries, so its cost
//! follows the entry count, not the bytes).
//!
//! Baseline measured in the same run: inserting the same number of entries
//! from memory into a pre-sized std `HashMap` (the floor of any index
//! rebuild). Data under the target dir. Run:
//! `cargo bench -p kvtier-tier --bench recovery`

use std::collections::HashMap;
use std::hint::black_box;
use std::path::Path;
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::Criterion;
use tier::{ChunkId, ChunkKey, ChunkStore, NamespaceRecord, TierConfig, WritePolicy};

const MIB: u64 = 1 << 20;

fn id(ns: tier::Namespace, i: u64) -> ChunkId {
    let mut k = [0u8; 32];
    let x = i.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    k[..8].copy_from_slice(&x.to_le_bytes());
    k[8..16].copy_from_slice(&i.to_le_bytes());
    ChunkId::new(ns, ChunkKey(k), 0)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).expect("no NaN"));
    v[v.len() / 2]
}

fn case(root: &Path, name: &str, count: u64, len: usize, disk: u64, groups: bool) {
    let cfg = TierConfig {
        data_dir: root.join(name),
        ram_budget: 64 * MIB,
        disk_budget: disk,
        region_size: 64 * MIB,
        write_policy: WritePolicy::Backpressure,
        idle_flush_after: Duration::from_secs(3600),
        ..TierConfig::default()
    };
    let ns;
    {
        let s = ChunkStore::open(cfg.clone()).expect("open");
        ns = s
            .register_namespace(&NamespaceRecord {
                model: "bench".into(),
                ..Default::default()
            })
            .expect("ns");
        let payload = Bytes::from(vec![0x5a; len]);
        let t = Instant::now();
        if groups {
            let pair = |i: u64| {
                vec![
                    (id(ns, i), payload.clone()),
                    (id(ns, i + 1), payload.clone()),
                ]
            };
            for i in (0..count).step_by(2) {
                s.put_atomic(pair(i)).expect("put_atomic");
            }
            for i in (0..count / 10).step_by(2) {
                s.put_atomic(pair(i)).expect("put_atomic again");
            }
        } else {
            for i in 0..count {
                s.put(id(ns, i), payload.clone()).expect("put");
            }
        }
        s.close(Duration::from_secs(600)).expect("close");
        println!(
            "built {name}: {count} chunks in {:.1} s",
            t.elapsed().as_secs_f64()
        );
    }
    let mut ours = Vec::new();
    let mut base = Vec::new();
    let mut lookups: Vec<f64> = Vec::new();
    for _ in 0..3 {
        let t = Instant::now();
        let s = ChunkStore::open(cfg.clone()).expect("reopen");
        let el = t.elapsed().as_secs_f64();
        assert_eq!(s.stats().disk_chunks, count, "every chunk recovered");
        assert!(s.get(&id(ns, count / 2)).is_some());
        ours.push(el);
        if count >= 1_000_000 && lookups.is_empty() {
            // Store-level lookup_prefix of 1,024 keys (half hits) in this
            // 1M-entry store: the index probe plus a RAM check per key.
            let mut tiers = Vec::new();
            let mut x = 0x9e37_79b9_u64;
            for _ in 0..200 {
                let keys: Vec<ChunkKey> = (0..1024u64)
                    .map(|i| {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        let n = if i % 2 == 0 {
                            x % count
                        } else {
                            count + x % count
                        };
                        id(ns, n).key
                    })
                    .collect();
                let t = Instant::now();
                s.lookup_prefix(ns, 0, &keys, &mut tiers);
                lookups.push(t.elapsed().as_secs_f64() * 1e6);
                assert_eq!(tiers.iter().filter(|t| t.is_some()).count(), 512);
            }
        }
        drop(s);
        let t = Instant::now();
        let mut m: HashMap<ChunkId, (u32, u32, u32)> = HashMap::with_capacity(count as usize);
        for i in 0..count {
            m.insert(id(ns, i), (i as u32, 1, 2));
        }
        black_box(&m);
        base.push(t.elapsed().as_secs_f64());
    }
    let (o, b) = (median(ours), median(base));
    if !lookups.is_empty() {
        println!(
            "RESULT store lookup_prefix 1024 keys (512 hits) in {count} entries: median {:.1} us/batch",
            median(lookups)
        );
    }
    println!(
        "RESULT recovery {name}: {count} chunks in {:.0} ms ({:.2} us/entry); baseline std HashMap insert of {count} entries from RAM {:.0} ms; ratio {:.2}x",
        o * 1e3,
        o * 1e6 / count as f64,
        b * 1e3,
        o / b
    );
}

fn bench(_c: &mut Criterion) {
    let root = Path::new(env!("CARGO_TARGET_TMPDIR")).join("kvtier-recovery-bench");
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).expect("bench dir");
    case(&root, "1M-small", 1_000_000, 256, 1 << 30, false);
    let _ = std::fs::remove_dir_all(root.join("1M-small"));
    case(&root, "1M-small-groups", 1_000_000, 256, 1 << 30, true);
    let _ = std::fs::remove_dir_all(root.join("1M-small-groups"));
    case(
        &root,
        "2000x1MiB",
        2_000,
        MIB as usize,
        2 * 1024 * MIB + 256 * MIB,
        false,
    );
    let _ = std::fs::remove_dir_all(&root);
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    bench(&mut c);
    c.final_summary();
}
