//! Codec benches: chunk header encode/decode and payload CRC32C, each against
//! a memcpy of the same bytes measured in the same run.
//!
//! `cargo bench -p kvtier-tier --bench codec` (add `-- --quick` for a short
//! run). Besides criterion's own output, prints one summary line per pair:
//! `ratio = kvtier_throughput / memcpy_throughput`.

use std::collections::BTreeMap;
use std::hint::black_box;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{BenchmarkId, Criterion, Throughput};
use tier::format::{ChunkHeader, crc32c};
use tier::{ChunkId, ChunkKey, Namespace};

/// (bytes, nanoseconds) accumulated per bench label over every timed call.
static TOTALS: Mutex<BTreeMap<String, (u128, u128)>> = Mutex::new(BTreeMap::new());

fn record(label: &str, bytes: u64, elapsed: Duration) {
    let mut t = TOTALS.lock().expect("totals lock");
    let e = t.entry(label.to_string()).or_default();
    e.0 += u128::from(bytes);
    e.1 += elapsed.as_nanos();
}

/// Times `iters` calls of `f`, records `bytes_per_iter` of throughput.
fn timed(label: &str, bytes_per_iter: u64, iters: u64, mut f: impl FnMut()) -> Duration {
    let start = Instant::now();
    for _ in 0..iters {
        f();
    }
    let elapsed = start.elapsed();
    record(label, bytes_per_iter * iters, elapsed);
    elapsed
}

fn sample_header(named: bool) -> ChunkHeader {
    let id = ChunkId::new(Namespace([3; 16]), ChunkKey([0x5a; 32]), 1);
    let name = named.then(|| Bytes::from_static(b"lmcache:model=llama:rank=0:chunk=0042"));
    ChunkHeader::for_payload(id, name, b"payload", 1_767_225_600_123)
}

fn bench_headers(c: &mut Criterion) {
    let mut g = c.benchmark_group("header");
    for named in [false, true] {
        let h = sample_header(named);
        let enc = h.encode();
        let len = enc.len() as u64;
        let tag = if named { "named" } else { "unnamed" };
        g.throughput(Throughput::Bytes(len));
        let mut out = vec![0u8; enc.len()];
        g.bench_function(BenchmarkId::new("encode", tag), |b| {
            b.iter_custom(|n| {
                timed(&format!("header-encode-{tag}"), len, n, || {
                    black_box(black_box(&h).encode_into(&mut out));
                })
            })
        });
        g.bench_function(BenchmarkId::new("decode", tag), |b| {
            b.iter_custom(|n| {
                timed(&format!("header-decode-{tag}"), len, n, || {
                    black_box(ChunkHeader::decode(black_box(&enc)).expect("decodes"));
                })
            })
        });
        g.bench_function(BenchmarkId::new("memcpy", tag), |b| {
            b.iter_custom(|n| {
                timed(&format!("header-memcpy-{tag}"), len, n, || {
                    out.copy_from_slice(black_box(&enc));
                    black_box(&out);
                })
            })
        });
    }
    g.finish();
}

fn bench_crc(c: &mut Criterion) {
    let mut g = c.benchmark_group("payload");
    g.sample_size(20);
    for size in [256 << 10, 1 << 20, 4 << 20] {
        let src: Vec<u8> = (0..size).map(|i| (i * 31 % 251) as u8).collect();
        let mut dst = vec![0u8; size];
        let kib = size >> 10;
        g.throughput(Throughput::Bytes(size as u64));
        g.bench_function(BenchmarkId::new("crc32c", format!("{kib}KiB")), |b| {
            b.iter_custom(|n| {
                timed(&format!("crc32c-{kib}KiB"), size as u64, n, || {
                    black_box(crc32c(black_box(&src)));
                })
            })
        });
        g.bench_function(BenchmarkId::new("memcpy", format!("{kib}KiB")), |b| {
            b.iter_custom(|n| {
                timed(&format!("memcpy-{kib}KiB"), size as u64, n, || {
                    dst.copy_from_slice(black_box(&src));
                    black_box(&dst);
                })
            })
        });
    }
    g.finish();
}

fn summary() {
    let t = TOTALS.lock().expect("totals lock");
    let gbps = |label: &str| {
        t.get(label)
            .filter(|v| v.1 > 0)
            .map(|v| v.0 as f64 / v.1 as f64)
    };
    let mut pairs = vec![];
    for tag in ["unnamed", "named"] {
        for op in ["encode", "decode"] {
            pairs.push((format!("header-{op}-{tag}"), format!("header-memcpy-{tag}")));
        }
    }
    for kib in [256, 1024, 4096] {
        pairs.push((format!("crc32c-{kib}KiB"), format!("memcpy-{kib}KiB")));
    }
    eprintln!("\n=== tier codec summary (hot buffers; GB/s = bytes per ns) ===");
    for (what, base) in pairs {
        if let (Some(k), Some(m)) = (gbps(&what), gbps(&base)) {
            if let Some(tag) = what.strip_prefix("header-") {
                let len = sample_header(tag.ends_with("-named")).encoded_len();
                eprintln!(
                    "{what:<24} {:>8.1} ns per {len}-byte header",
                    len as f64 / k
                );
            }
            eprintln!(
                "{what:<24} {k:>8.2} GB/s   {base:<22} {m:>8.2} GB/s   ratio = kvtier_throughput / memcpy_throughput = {:.3}",
                k / m
            );
        }
    }
}

fn main() {
    let mut c = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .configure_from_args();
    bench_headers(&mut c);
    bench_crc(&mut c);
    c.final_summary();
    summary();
}
