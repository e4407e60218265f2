//! Native socket + shared memory throughput and LOOKUP latency, measured
//! against a cold memcpy of the same sizes in the same run.
//!
//! `cargo bench -p kvtier-node --bench native` (full run, about a minute);
//! `KVTIER_BENCH_QUICK=1 cargo bench -p kvtier-node --bench native` (CI smoke).
//!
//! A real server (`node::native::serve`) runs in-process on a Unix socket;
//! the blocking `Client` registers a memfd region and issues PUT / GET /
//! LOOKUP exactly as an engine would. "Cold" means the source and
//! destination rotate through 256 MiB, far beyond the caches, on both sides
//! of the comparison.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use node::NodeContext;
use node::native::{self, Client, NativeOptions, RegionEntry};
use node::tier::{ChunkId, ChunkKey, ChunkStore, NamespaceRecord, TierConfig};

const ROTATE: usize = 256 << 20;

fn key(i: u64) -> ChunkKey {
    let mut k = [0u8; 32];
    // Keys are uniform hashes in practice: spread the bits.
    let mut x = i.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    for c in k.chunks_mut(8) {
        x ^= x >> 29;
        x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
        c.copy_from_slice(&x.to_le_bytes());
    }
    ChunkKey(k)
}

fn gbps(bytes: usize, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

/// Cold memcpy: `total` bytes in `size` copies rotating through two 256 MiB buffers.
fn memcpy_cold(src: &[u8], dst: &mut [u8], size: usize, total: usize) -> Duration {
    let slots = ROTATE / size;
    let n = total / size;
    let t = Instant::now();
    for i in 0..n {
        let s = (i % slots) * size;
        let d = ((i * 7 + 3) % slots) * size;
        dst[d..d + size].copy_from_slice(&src[s..s + size]);
        black_box(&dst[d]);
    }
    t.elapsed()
}

struct Server {
    _dir: tempfile::TempDir,
    path: std::path::PathBuf,
    ctx: Arc<NodeContext>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Server {
    fn start() -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let config = TierConfig {
            data_dir: dir.path().join("data"),
            ram_budget: 1 << 30,
            disk_budget: 0,
            ..TierConfig::default()
        };
        let store = Arc::new(ChunkStore::open(config).expect("open store"));
        let ctx = Arc::new(NodeContext::new(store, "bench".into()));
        let path = dir.path().join("b.sock");
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let thread = {
            let (ctx, path) = (Arc::clone(&ctx), path.clone());
            std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()
                    .expect("runtime");
                rt.block_on(async move {
                    let l = native::bind(&path, 0o600).expect("bind");
                    ready_tx.send(()).expect("bench alive");
                    native::serve(l, ctx, NativeOptions::default(), async {
                        let _ = stop_rx.await;
                    })
                    .await
                    .expect("serve");
                });
            })
        };
        ready_rx.recv().expect("server ready");
        Self {
            _dir: dir,
            path,
            ctx,
            stop: Some(stop_tx),
            thread: Some(thread),
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn record() -> NamespaceRecord {
    NamespaceRecord {
        model: "bench".into(),
        tp_size: 1,
        ..Default::default()
    }
}

fn throughput(
    c: &mut Client,
    ns: node::tier::Namespace,
    size: usize,
    batch: usize,
    total: usize,
) -> (f64, f64) {
    let slots = ROTATE / size;
    let nkeys = slots as u64;
    let per_req = batch.min(slots);
    let reqs = (total / size / per_req).max(1);
    let entries = |r: usize, stride: usize| -> Vec<RegionEntry> {
        (0..per_req)
            .map(|j| {
                let i = r * per_req + j;
                RegionEntry {
                    key: key((i as u64) % nkeys),
                    offset: (((i * stride + 3) % slots) * size) as u64,
                    len: size as u64,
                }
            })
            .collect()
    };
    // Fill every key once (also warms the server's allocator).
    for r in 0..(slots / per_req) {
        let st = c.put(ns, 0, &entries(r, 1), false).expect("put");
        assert!(st.iter().all(|s| *s == 0), "put failed: {st:?}");
    }
    let t = Instant::now();
    for r in 0..reqs {
        let st = c.put(ns, 0, &entries(r, 1), false).expect("put");
        debug_assert!(st.iter().all(|s| *s == 0));
    }
    let put = gbps(reqs * per_req * size, t.elapsed());
    let t = Instant::now();
    for r in 0..reqs {
        let res = c.get(ns, 0, &entries(r, 7)).expect("get");
        assert!(res.iter().all(|g| g.status.is_hit()), "miss in bench");
    }
    let get = gbps(reqs * per_req * size, t.elapsed());
    let keys: Vec<ChunkKey> = (0..nkeys).map(key).collect();
    for k in keys.chunks(4096) {
        c.delete(ns, 0, k).expect("delete");
    }
    (put, get)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

fn main() {
    let quick = std::env::var_os("KVTIER_BENCH_QUICK").is_some();
    let total = if quick { 64 << 20 } else { 1 << 30 };
    let server = Server::start();
    let mut c = Client::connect(&server.path).expect("connect");
    let ns = c.hello(&record()).expect("hello");
    c.create_region(ROTATE as u64).expect("region");
    c.region_mut().expect("region").as_mut_slice().fill(0x5A);

    let src = vec![0xA5u8; ROTATE];
    let mut dst = vec![0u8; ROTATE];
    let reps = if quick { 1 } else { 5 };
    println!(
        "native socket + shared memory vs cold memcpy ({} MiB per measurement, median of {reps} interleaved runs)",
        total >> 20
    );
    println!(
        "{:>8} {:>6} {:>12} {:>10} {:>10} {:>10} {:>10}",
        "size", "batch", "memcpy GB/s", "PUT GB/s", "GET GB/s", "PUT/memcpy", "GET/memcpy"
    );
    for size in [256usize << 10, 1 << 20, 4 << 20] {
        memcpy_cold(&src, &mut dst, size, ROTATE); // warm-up: fault every page in
        for batch in [1usize, 16] {
            let (mut base, mut put, mut get) = (Vec::new(), Vec::new(), Vec::new());
            for _ in 0..reps {
                base.push(gbps(total, memcpy_cold(&src, &mut dst, size, total)));
                let (p, g) = throughput(&mut c, ns, size, batch, total);
                put.push(p);
                get.push(g);
            }
            let (base, put, get) = (median(base), median(put), median(get));
            println!(
                "{:>7}K {:>6} {:>12.2} {:>10.2} {:>10.2} {:>9.2}x {:>9.2}x",
                size >> 10,
                batch,
                base,
                put,
                get,
                put / base,
                get / base
            );
        }
    }
    drop(src);
    drop(dst);

    // LOOKUP of 1,024 keys in a store of N entries (inserted directly).
    let entries: u64 = if quick { 50_000 } else { 1_000_000 };
    let payload = bytes::Bytes::from_static(&[7u8; 64]);
    for i in 0..entries {
        server
            .ctx
            .store
            .put(ChunkId::new(ns, key(i), 1), payload.clone())
            .expect("populate");
    }
    let iters = if quick { 200 } else { 3000 };
    let mut end_to_end = Vec::with_capacity(iters);
    let mut server_side = Vec::with_capacity(iters);
    let mut x = 12345u64;
    for _ in 0..iters {
        let keys: Vec<ChunkKey> = (0..1024)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                key(x % entries)
            })
            .collect();
        let t = Instant::now();
        let r = c.lookup(ns, 1, &keys).expect("lookup");
        end_to_end.push(t.elapsed());
        assert_eq!(r.prefix, 1024);
        let t = Instant::now();
        let (p, _) = server.ctx.lookup(ns, 1, black_box(&keys));
        server_side.push(t.elapsed());
        assert_eq!(p, 1024);
    }
    end_to_end.sort();
    server_side.sort();
    println!(
        "LOOKUP 1,024 random present keys, {entries} entries: end to end p50 {:.1} us p99 {:.1} us; \
         in-process NodeContext::lookup p50 {:.1} us p99 {:.1} us (targets: 50 us end to end, 20 us server side)",
        percentile(&end_to_end, 0.5).as_secs_f64() * 1e6,
        percentile(&end_to_end, 0.99).as_secs_f64() * 1e6,
        percentile(&server_side, 0.5).as_secs_f64() * 1e6,
        percentile(&server_side, 0.99).as_secs_f64() * 1e6,
    );
}
