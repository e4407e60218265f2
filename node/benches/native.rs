//! Native socket + shared memory throughput and LOOKUP latency, measured
//! against a cold memcpy of the same sizes in the same run.
//!
//! `cargo bench -p kvtier-node --bench native` (full run, about a minute);
//! `KVTIER_BENCH_QUICK=1 cargo bench -p kvtier-node --bench native` (CI smoke).
//! `KVTIER_BENCH_PROFILE_LOOKUP=SECS` runs only empty-store LOOKUPs for that
//! long after the PING phase (for `perf record`).
//! `KVTIER_BENCH_CELLS=256K/1,4M/16` restricts the throughput table to those
//! (size/batch) cells; `KVTIER_BENCH_CELLS=none` skips it. For A/B runs of
//! the two round-trip and allocation fixes: `KVTIER_BENCH_SPIN_US=0` (no
//! polling before blocking, server and client) and `KVTIER_BENCH_NO_TUNE=1`
//! (glibc's default allocator settings). `KVTIER_BENCH_INFLIGHT=N` keeps N
//! PUT or GET requests in flight on the connection (pipelined, default 1):
//! one chunk per request no longer waits a round trip per chunk.
//!
//! Besides throughput it reports, per cell, the minor page faults and the CPU
//! time (all threads: client and server) per request, which do not depend
//! on how loaded the machine is; the request round trip (PING through the
//! server versus a bare echo over a Unix socket, same run); and LOOKUP
//! latency. Every figure with a ratio or a target is also printed as a
//! `RESULT` line.
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
use node::native::codec::{Reply, Request, Response};
use node::native::{self, Client, NativeOptions, RegionEntry};
use node::tier::{ChunkId, ChunkKey, ChunkStore, Namespace, NamespaceRecord, TierConfig};

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

/// How long server and client poll before blocking: `KVTIER_BENCH_SPIN_US`,
/// else the default.
fn spin() -> Duration {
    std::env::var("KVTIER_BENCH_SPIN_US").map_or(native::DEFAULT_SPIN, |v| {
        Duration::from_micros(v.parse().expect("KVTIER_BENCH_SPIN_US: microseconds"))
    })
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
        // As the daemon does at start (see `node::memory`);
        // KVTIER_BENCH_NO_TUNE=1 measures glibc's defaults instead.
        if std::env::var_os("KVTIER_BENCH_NO_TUNE").is_none() {
            node::memory::tune_allocator();
        }
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
                    let opts = NativeOptions {
                        spin: spin(),
                        ..NativeOptions::default()
                    };
                    native::serve(l, ctx, opts, async {
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

/// Process-wide CPU time (user + system, all threads) and minor page faults.
#[derive(Clone, Copy)]
struct Usage {
    cpu: Duration,
    minflt: u64,
}

fn usage() -> Usage {
    // SAFETY: getrusage writes one `rusage` into the zeroed struct we own.
    let ru = unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut ru);
        ru
    };
    let tv = |t: libc::timeval| {
        Duration::from_secs(t.tv_sec as u64) + Duration::from_micros(t.tv_usec as u64)
    };
    Usage {
        cpu: tv(ru.ru_utime) + tv(ru.ru_stime),
        minflt: ru.ru_minflt as u64,
    }
}

/// One measured pass of one cell.
struct Pass {
    put_gbps: f64,
    get_gbps: f64,
    /// Minor page faults per PUT request (whole process).
    put_faults: f64,
    /// CPU microseconds per request (whole process).
    put_cpu_us: f64,
    get_cpu_us: f64,
    /// Minor page faults per GET request (whole process).
    get_faults: f64,
}

/// Requests in flight per connection (`KVTIER_BENCH_INFLIGHT`, default 1).
fn inflight() -> usize {
    std::env::var("KVTIER_BENCH_INFLIGHT")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n: &usize| n > 0)
        .unwrap_or(1)
}

/// Sends `reqs` requests made by `make`, keeping `depth` in flight, and
/// checks each reply with `ok`.
fn pipelined(
    c: &mut Client,
    reqs: usize,
    depth: usize,
    make: impl Fn(usize) -> Request,
    ok: impl Fn(&Response) -> bool,
) {
    let (mut sent, mut done) = (0, 0);
    while done < reqs {
        while sent < reqs && sent - done < depth {
            c.send(&make(sent)).expect("send");
            sent += 1;
        }
        match c.recv().expect("recv") {
            (_, Reply::Ok(r)) => assert!(ok(&r), "bad reply {r:?}"),
            (_, e) => panic!("{e:?}"),
        }
        done += 1;
    }
}

fn throughput(
    c: &mut Client,
    ns: node::tier::Namespace,
    size: usize,
    batch: usize,
    total: usize,
) -> Pass {
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
    let depth = inflight();
    let u0 = usage();
    let t = Instant::now();
    if depth == 1 {
        for r in 0..reqs {
            let st = c.put(ns, 0, &entries(r, 1), false).expect("put");
            debug_assert!(st.iter().all(|s| *s == 0));
        }
    } else {
        let make = |r| Request::Put {
            ns,
            group: 0,
            atomic: false,
            entries: entries(r, 1),
        };
        pipelined(
            c,
            reqs,
            depth,
            make,
            |r| matches!(r, Response::Put { statuses } if statuses.iter().all(|s| *s == 0)),
        );
    }
    let put = gbps(reqs * per_req * size, t.elapsed());
    let u1 = usage();
    let t = Instant::now();
    if depth == 1 {
        for r in 0..reqs {
            let res = c.get(ns, 0, &entries(r, 7)).expect("get");
            assert!(res.iter().all(|g| g.status.is_hit()), "miss in bench");
        }
    } else {
        // Requests in flight may write overlapping region ranges when
        // depth x batch exceeds the slots: the bytes are not checked here
        // (the statuses are), only the time.
        let make = |r| Request::Get {
            ns,
            group: 0,
            entries: entries(r, 7),
        };
        pipelined(
            c,
            reqs,
            depth,
            make,
            |r| matches!(r, Response::Get { results } if results.iter().all(|g| g.status.is_hit())),
        );
    }
    let get = gbps(reqs * per_req * size, t.elapsed());
    let u2 = usage();
    let keys: Vec<ChunkKey> = (0..nkeys).map(key).collect();
    for k in keys.chunks(4096) {
        c.delete(ns, 0, k).expect("delete");
    }
    let per = |d: Duration| d.as_secs_f64() * 1e6 / reqs as f64;
    Pass {
        put_gbps: put,
        get_gbps: get,
        put_faults: (u1.minflt - u0.minflt) as f64 / reqs as f64,
        put_cpu_us: per(u1.cpu - u0.cpu),
        get_cpu_us: per(u2.cpu - u1.cpu),
        get_faults: (u2.minflt - u1.minflt) as f64 / reqs as f64,
    }
}

/// Which (size, batch) cells to measure: `KVTIER_BENCH_CELLS` (e.g.
/// `256K/1,4M/16`, or `none`), else all.
fn cells() -> Vec<(usize, usize)> {
    // 32 MiB: 256 tokens of an 8B model's KV cache in bf16, a chunk size
    // at which glibc maps every allocation freshly (see tier::buffers).
    let all: Vec<(usize, usize)> = [256usize << 10, 1 << 20, 4 << 20]
        .into_iter()
        .flat_map(|s| [(s, 1), (s, 16)])
        .chain([(32 << 20, 1)])
        .collect();
    let Ok(spec) = std::env::var("KVTIER_BENCH_CELLS") else {
        return all;
    };
    let parse_size = |t: &str| -> usize {
        let t = t.trim();
        let (n, mul) = match t.strip_suffix(['K', 'k']) {
            Some(n) => (n, 1 << 10),
            None => match t.strip_suffix(['M', 'm']) {
                Some(n) => (n, 1 << 20),
                None => (t, 1),
            },
        };
        n.parse::<usize>()
            .expect("KVTIER_BENCH_CELLS: size like 256K or 4M")
            * mul
    };
    spec.split(',')
        .filter(|c| !c.trim().is_empty() && c.trim() != "none")
        .map(|c| {
            let (s, b) = c.split_once('/').expect("KVTIER_BENCH_CELLS: SIZE/BATCH");
            (
                parse_size(s),
                b.trim().parse().expect("KVTIER_BENCH_CELLS: batch"),
            )
        })
        .collect()
}

/// Waits until `s` has a byte to read, polling for up to `spin` first
/// (as the native client and server do) and then blocking.
fn wait_readable(s: &std::os::unix::net::UnixStream, spin: Duration) {
    let deadline = Instant::now() + spin;
    let mut b = [0u8; 1];
    while Instant::now() < deadline {
        match rustix::net::recv(
            s,
            &mut b,
            rustix::net::RecvFlags::PEEK | rustix::net::RecvFlags::DONTWAIT,
        ) {
            Err(rustix::io::Errno::AGAIN) => std::thread::yield_now(),
            _ => return,
        }
    }
}

/// Round trips of a bare 32-byte echo over a Unix socket (a thread that
/// reads 32 bytes and writes them back): the floor under any request.
/// With `spin`, both sides poll for that long before blocking in `read`.
fn raw_echo_round_trips(path: &std::path::Path, iters: usize, spin: Duration) -> Vec<Duration> {
    use std::io::{Read, Write};
    let _ = std::fs::remove_file(path);
    let l = std::os::unix::net::UnixListener::bind(path).expect("bind echo");
    let echo = std::thread::spawn(move || {
        let (mut s, _) = l.accept().expect("accept echo");
        let mut b = [0u8; 32];
        loop {
            wait_readable(&s, spin);
            if s.read_exact(&mut b).is_err() || s.write_all(&b).is_err() {
                break;
            }
        }
    });
    let mut s = std::os::unix::net::UnixStream::connect(path).expect("connect echo");
    let mut b = [7u8; 32];
    let mut out = Vec::with_capacity(iters);
    for _ in 0..iters {
        let t = Instant::now();
        s.write_all(&b).expect("echo write");
        wait_readable(&s, spin);
        s.read_exact(&mut b).expect("echo read");
        out.push(t.elapsed());
    }
    drop(s);
    echo.join().expect("echo thread");
    out
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// LOOKUP latency (1,024 keys, a 500 us gap before each, so that the
/// server's runtime goes idle in between, as between a scheduler's steps)
/// alone, then while two other connections PUT 32 MiB chunks back to back.
/// Copies that large run on the blocking pool: on a runtime worker they
/// held every other socket for the copy's length.
fn lookup_beside_bulk_copies(server: &Server, c: &mut Client, ns: Namespace, quick: bool) {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    const BIG: u64 = 32 << 20;
    let iters = if quick { 200 } else { 2_000 };
    let keys: Vec<ChunkKey> = (0..1024u64).map(|i| key(i * 7919 + 3)).collect();
    let measure = |c: &mut Client| {
        let mut lat: Vec<Duration> = (0..iters)
            .map(|_| {
                std::thread::sleep(Duration::from_micros(500));
                let t = Instant::now();
                c.lookup(ns, 1, black_box(&keys)).expect("lookup");
                t.elapsed()
            })
            .collect();
        lat.sort();
        (percentile(&lat, 0.5), percentile(&lat, 0.99))
    };
    let idle = measure(c);
    let stop = AtomicBool::new(false);
    let copied = AtomicU64::new(0);
    let (busy, bytes, secs) = std::thread::scope(|s| {
        let bulk: Vec<_> = (0..2u64)
            .map(|t| {
                let (stop, copied) = (&stop, &copied);
                s.spawn(move || {
                    let mut b = Client::connect(&server.path).expect("connect");
                    let ns = b.hello(&record()).expect("hello");
                    b.create_region(BIG).expect("region");
                    b.region_mut().expect("region").as_mut_slice().fill(0x3C);
                    let mut n = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        let e = RegionEntry {
                            key: key((1 << 40) | (t << 8) | (n % 2)),
                            offset: 0,
                            len: BIG,
                        };
                        assert_eq!(b.put(ns, 1, &[e], false).expect("put"), vec![0]);
                        copied.fetch_add(BIG, Ordering::Relaxed);
                        n += 1;
                    }
                })
            })
            .collect();
        // Past the first fills (fresh buffers) before measuring.
        while copied.load(Ordering::Relaxed) < 8 * BIG {
            assert!(
                !bulk.iter().any(|h| h.is_finished()),
                "a bulk PUT connection stopped"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        let (before, t0) = (copied.load(Ordering::Relaxed), Instant::now());
        let busy = measure(c);
        let bytes = copied.load(Ordering::Relaxed) - before;
        let secs = t0.elapsed().as_secs_f64();
        stop.store(true, Ordering::Relaxed);
        bulk.into_iter().for_each(|h| h.join().expect("bulk"));
        (busy, bytes, secs)
    });
    println!(
        "RESULT LOOKUP 1,024 keys (500 us gaps) beside 2 connections PUTting 32 MiB chunks ({:.1} GB/s): p50 {:.1} us p99 {:.1} us; alone p50 {:.1} us p99 {:.1} us: {:.2}x / {:.2}x",
        bytes as f64 / secs / 1e9,
        us(busy.0),
        us(busy.1),
        us(idle.0),
        us(idle.1),
        busy.0.as_secs_f64() / idle.0.as_secs_f64(),
        busy.1.as_secs_f64() / idle.1.as_secs_f64(),
    );
}

fn main() {
    let quick = std::env::var_os("KVTIER_BENCH_QUICK").is_some();
    let total = if quick { 64 << 20 } else { 1 << 30 };
    let server = Server::start();
    let mut c = Client::connect(&server.path).expect("connect");
    c.set_spin(spin());
    println!(
        "allocator: {}; server and client poll {} us before blocking while a CPU is spare (spare now: {})",
        if std::env::var_os("KVTIER_BENCH_NO_TUNE").is_none() {
            format!("{:?}", node::memory::tune_allocator())
        } else {
            "glibc defaults (KVTIER_BENCH_NO_TUNE)".to_string()
        },
        spin().as_micros(),
        native::spin::may_poll()
    );
    let ns = c.hello(&record()).expect("hello");
    c.create_region(ROTATE as u64).expect("region");
    c.region_mut().expect("region").as_mut_slice().fill(0x5A);
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!("load average at start: {}", load.trim());

    // Request round trip: PING through the server versus a bare echo, with
    // and without polling before blocking (the difference is the cost of
    // a thread wake-up on this machine).
    let iters = if quick { 2_000 } else { 20_000 };
    for _ in 0..200 {
        c.ping().expect("ping");
    }
    // The polling baseline always polls (50 us), whatever the server does.
    let spin = Duration::from_micros(50);
    let (mut raw, mut raw_spin, mut ping) = (Vec::new(), Vec::new(), Vec::with_capacity(iters));
    for half in 0..2 {
        // Interleaved halves, so that all three see the same background load.
        let echo = server.path.with_file_name(format!("echo{half}.sock"));
        raw.extend(raw_echo_round_trips(&echo, iters / 2, Duration::ZERO));
        raw_spin.extend(raw_echo_round_trips(&echo, iters / 2, spin));
        for _ in 0..iters / 2 {
            let t = Instant::now();
            c.ping().expect("ping");
            ping.push(t.elapsed());
        }
    }
    raw.sort();
    raw_spin.sort();
    ping.sort();
    let (raw50, ping50) = (percentile(&raw, 0.5), percentile(&ping, 0.5));
    let spin50 = percentile(&raw_spin, 0.5);
    println!(
        "RESULT native round trip (PING) p50 {:.1} us p99 {:.1} us vs bare Unix-socket echo p50 {:.1} us p99 {:.1} us: {:.2}x \
         (bare echo polling {} us before blocking: p50 {:.1} us p99 {:.1} us)",
        us(ping50),
        us(percentile(&ping, 0.99)),
        us(raw50),
        us(percentile(&raw, 0.99)),
        ping50.as_secs_f64() / raw50.as_secs_f64(),
        spin.as_micros(),
        us(spin50),
        us(percentile(&raw_spin, 0.99)),
    );

    // `KVTIER_BENCH_PROFILE_LOOKUP=SECS`: only LOOKUPs of 1,024 keys (in
    // the frame) in the empty store, for that long, then exit (a profile
    // of the transport and codec without the other phases).
    if let Some(secs) = std::env::var("KVTIER_BENCH_PROFILE_LOOKUP").ok().map(|v| {
        v.parse::<f64>()
            .expect("KVTIER_BENCH_PROFILE_LOOKUP: seconds")
    }) {
        let keys: Vec<ChunkKey> = (0..1024u64).map(|i| key(i * 7919 + 1)).collect();
        let until = Instant::now() + Duration::from_secs_f64(secs);
        let mut lat = Vec::new();
        while Instant::now() < until {
            let t = Instant::now();
            black_box(c.lookup(ns, 1, black_box(&keys)).expect("lookup"));
            lat.push(t.elapsed());
        }
        lat.sort();
        println!(
            "RESULT profile loop: {} LOOKUPs of 1,024 keys in an empty store: p50 {:.1} us p99 {:.1} us",
            lat.len(),
            us(percentile(&lat, 0.5)),
            us(percentile(&lat, 0.99)),
        );
        return;
    }

    // LOOKUP of 1,024 keys in the still empty store: the index probes cost
    // next to nothing, so this is the request's transport and codec cost
    // (a 32 KiB request frame, a 1 KiB reply) next to PING's.
    {
        let keys: Vec<ChunkKey> = (0..1024u64).map(|i| key(i * 7919 + 1)).collect();
        let (mut empty, mut empty_region) = (Vec::with_capacity(iters), Vec::with_capacity(iters));
        for _ in 0..iters {
            let t = Instant::now();
            let r = c.lookup(ns, 1, black_box(&keys)).expect("lookup");
            empty.push(t.elapsed());
            assert_eq!(r.prefix, 0);
            let t = Instant::now();
            let r = c
                .lookup_via_region(ns, 1, black_box(&keys), 0)
                .expect("lookup");
            empty_region.push(t.elapsed());
            assert_eq!(r.prefix, 0);
        }
        empty.sort();
        empty_region.sort();
        println!(
            "RESULT LOOKUP 1,024 keys in an empty store (transport and codec), end to end: p50 {:.1} us p99 {:.1} us; keys in the region p50 {:.1} us p99 {:.1} us (PING p50 {:.1} us)",
            us(percentile(&empty, 0.5)),
            us(percentile(&empty, 0.99)),
            us(percentile(&empty_region, 0.5)),
            us(percentile(&empty_region, 0.99)),
            us(ping50),
        );
    }

    lookup_beside_bulk_copies(&server, &mut c, ns, quick);

    let cells = cells();
    if !cells.is_empty() {
        let src = vec![0xA5u8; ROTATE];
        let mut dst = vec![0u8; ROTATE];
        memcpy_cold(&src, &mut dst, 1 << 20, ROTATE); // warm-up: fault every page in
        let reps = if quick { 1 } else { 5 };
        println!(
            "native socket + shared memory vs cold memcpy ({} MiB per measurement, median of {reps} interleaved runs, {} request(s) in flight)",
            total >> 20,
            inflight()
        );
        println!(
            "{:>8} {:>6} {:>12} {:>10} {:>10} {:>10} {:>10} {:>12} {:>12} {:>12} {:>12}",
            "size",
            "batch",
            "memcpy GB/s",
            "PUT GB/s",
            "GET GB/s",
            "PUT/memcpy",
            "GET/memcpy",
            "PUT flt/req",
            "PUT cpu us",
            "GET flt/req",
            "GET cpu us"
        );
        for (size, batch) in cells {
            let mut base = Vec::new();
            let mut passes = Vec::new();
            for _ in 0..reps {
                base.push(gbps(total, memcpy_cold(&src, &mut dst, size, total)));
                passes.push(throughput(&mut c, ns, size, batch, total));
            }
            let m = |f: fn(&Pass) -> f64| median(passes.iter().map(f).collect());
            let base = median(base);
            let (put, get) = (m(|p| p.put_gbps), m(|p| p.get_gbps));
            let (faults, put_cpu, get_cpu) = (
                m(|p| p.put_faults),
                m(|p| p.put_cpu_us),
                m(|p| p.get_cpu_us),
            );
            let get_faults = m(|p| p.get_faults);
            println!(
                "{:>7}K {:>6} {:>12.2} {:>10.2} {:>10.2} {:>9.2}x {:>9.2}x {:>12.1} {:>12.1} {:>12.1} {:>12.1}",
                size >> 10,
                batch,
                base,
                put,
                get,
                put / base,
                get / base,
                faults,
                put_cpu,
                get_faults,
                get_cpu
            );
            println!(
                "RESULT native PUT {}K x{batch} ({} in flight): {put:.2} GB/s vs cold memcpy {base:.2} GB/s = {:.2}x ({faults:.1} page faults, {put_cpu:.1} us CPU per request)",
                size >> 10,
                inflight(),
                put / base
            );
            println!(
                "RESULT native GET {}K x{batch} ({} in flight): {get:.2} GB/s vs cold memcpy {base:.2} GB/s = {:.2}x ({get_faults:.1} page faults, {get_cpu:.1} us CPU per request)",
                size >> 10,
                inflight(),
                get / base
            );
        }
    }

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
    let mut batch = || -> Vec<ChunkKey> {
        (0..1024)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                key(x % entries)
            })
            .collect()
    };
    let mut via_region = Vec::with_capacity(iters);
    for i in 0..iters {
        // Each call gets its own random keys (none is warmed by the other),
        // and the order alternates.
        let (a, b, r) = (batch(), batch(), batch());
        let socket = |c: &mut Client, keys: &[ChunkKey]| {
            let t = Instant::now();
            let r = c.lookup(ns, 1, keys).expect("lookup");
            let d = t.elapsed();
            assert_eq!(r.prefix, 1024);
            d
        };
        // The keys travel in the region (the client's copy into it timed).
        let t = Instant::now();
        let res = c.lookup_via_region(ns, 1, &r, 0).expect("lookup");
        via_region.push(t.elapsed());
        assert_eq!(res.prefix, 1024);
        let local = |keys: &[ChunkKey]| {
            let t = Instant::now();
            let (p, _) = server.ctx.lookup(ns, 1, black_box(keys));
            let d = t.elapsed();
            assert_eq!(p, 1024);
            d
        };
        if i % 2 == 0 {
            end_to_end.push(socket(&mut c, &a));
            server_side.push(local(&b));
        } else {
            server_side.push(local(&b));
            end_to_end.push(socket(&mut c, &a));
        }
    }
    end_to_end.sort();
    server_side.sort();
    via_region.sort();
    let (e50, s50) = (percentile(&end_to_end, 0.5), percentile(&server_side, 0.5));
    let r50 = percentile(&via_region, 0.5);
    println!(
        "RESULT LOOKUP 1,024 random present keys in {entries} entries, keys in the region, end to end: p50 {:.1} us p99 {:.1} us (target 50 us: {:.2}x of target)",
        us(r50),
        us(percentile(&via_region, 0.99)),
        us(r50) / 50.0
    );
    println!(
        "RESULT LOOKUP 1,024 random present keys in {entries} entries, end to end: p50 {:.1} us p99 {:.1} us (target 50 us: {:.2}x of target)",
        us(e50),
        us(percentile(&end_to_end, 0.99)),
        us(e50) / 50.0
    );
    println!(
        "RESULT LOOKUP 1,024 random present keys in {entries} entries, in-process NodeContext::lookup: p50 {:.1} us p99 {:.1} us (target 20 us: {:.2}x of target)",
        us(s50),
        us(percentile(&server_side, 0.99)),
        us(s50) / 20.0
    );
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!("load average at end: {}", load.trim());
}
