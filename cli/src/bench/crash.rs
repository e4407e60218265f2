//! `kvtier bench crash`: kill -9 torture.
//!
//! Each iteration starts (or restarts) the bench's daemon, runs a writer
//! thread that PUTs batches of new chunks and FLUSHes every few batches,
//! and SIGKILLs the daemon at a random moment. The writer keeps three sets:
//! chunks whose PUT was acknowledged, chunks acknowledged before a FLUSH
//! that returned (flushed), and chunks whose PUT was in flight at the kill.
//! After the restart the bench checks, for this iteration's chunks and a
//! sample of every earlier iteration's flushed chunks:
//! - **wrong**: a GET returned bytes other than those written (must be 0);
//! - **phantom**: the store holds chunks that were never written: the
//!   daemon's chunk count is larger than the written chunks it holds, or a
//!   LOOKUP of 1,024 never-written keys finds any (must be 0);
//! - **flushed survival**: share of flushed chunks present (must be 100 %);
//! - **unflushed survival**: share of acknowledged, unflushed chunks
//!   present (reported: kill -9 may lose RAM-only chunks).
//!
//! Every `--fresh-every` iterations, and whenever the chunks written since
//! the last fresh start could fill half the disk budget, the data dir starts
//! over, so the budget is never reached (a region eviction would
//! legitimately drop flushed chunks and blur the count).

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Args;
use node::native::{Client, GetStatus, LookupLocation, RegionEntry};
use node::tier::{ChunkKey, Namespace, NamespaceRecord};
use rand::{Rng, SeedableRng};
use serde::Serialize;
use serde_json::json;

use super::report::{Report, Table, f2, print_header};
use super::{CommonArgs, Daemon, DaemonSpec, Scratch, bar, bench_key, bench_record, fill_payload};
use crate::{EXIT_ERROR, EXIT_OK};

/// Disk budget of the bench's daemon.
const DISK_BUDGET: u64 = 1 << 30;
/// Region size of the bench's daemon.
const REGION_SIZE: u64 = 8 << 20;

fn parse_kill_after(s: &str) -> Result<node::HumanDuration, String> {
    let d: node::HumanDuration = s.trim().parse().map_err(|e| format!("{s:?}: {e}"))?;
    if d.0 < Duration::from_millis(6) {
        return Err(format!(
            "{s:?}: at least 6ms (the kill comes 5 ms after the start at the earliest)"
        ));
    }
    Ok(d)
}

/// `kvtier bench crash`
#[derive(Debug, Args)]
pub struct CrashArgs {
    /// Kill -9 iterations (at least 100 for the published figure).
    #[arg(long, value_parser = crate::bench::parse_count::<u32>, default_value_t = 100)]
    pub iterations: u32,
    /// Chunk size.
    #[arg(long, value_parser = crate::bench::parse_bytes, default_value = "64KiB")]
    pub size: node::ByteSize,
    /// Chunks per PUT request.
    #[arg(long, value_parser = crate::bench::parse_count::<usize>, default_value_t = 8)]
    pub batch: usize,
    /// FLUSH after every this many PUT batches.
    #[arg(long, value_parser = crate::bench::parse_count::<u32>, default_value_t = 4)]
    pub flush_every: u32,
    /// Longest time the writer runs before the kill (uniform from 5 ms;
    /// at least 6ms).
    #[arg(long, default_value = "300ms", value_parser = parse_kill_after)]
    pub max_kill_after: node::HumanDuration,
    /// Start a fresh data dir every this many iterations.
    #[arg(long, value_parser = crate::bench::parse_count::<u32>, default_value_t = 25)]
    pub fresh_every: u32,
    /// Random seed (default: from the clock; printed).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Common options.
    #[command(flatten)]
    pub common: CommonArgs,
}

#[derive(Default)]
struct WriterLog {
    acked: Vec<u64>,
    flushed: Vec<u64>,
    in_flight: Vec<u64>,
    flushes: u64,
    error: Option<String>,
}

/// Chunk `i` of the run: key and payload.
fn key_of(i: u64) -> ChunkKey {
    bench_key(0xC4A5, i)
}

fn writer(
    socket: std::path::PathBuf,
    rec: NamespaceRecord,
    first: u64,
    size: u64,
    batch: usize,
    flush_every: u32,
    stop: Arc<AtomicBool>,
) -> WriterLog {
    let mut log = WriterLog::default();
    let run = (|| -> Result<()> {
        let mut c = Client::connect(&socket)?;
        let ns = c.hello(&rec)?;
        c.create_region(batch as u64 * size)?;
        let mut next = first;
        let mut since_flush = Vec::new();
        let mut batches = 0u32;
        // Bounded: the daemon is killed within --max-kill-after; the
        // count bound only guards against a daemon that never dies.
        for _ in 0..1_000_000 {
            if stop.load(Ordering::Relaxed) {
                break;
            }
            let ids: Vec<u64> = (next..next + batch as u64).collect();
            next += batch as u64;
            let region = c.region_mut().expect("created").as_mut_slice();
            let mut entries = Vec::new();
            for (j, id) in ids.iter().enumerate() {
                let off = j * size as usize;
                let key = key_of(*id);
                fill_payload(&key, &mut region[off..off + size as usize]);
                entries.push(RegionEntry {
                    key,
                    offset: off as u64,
                    len: size,
                });
            }
            log.in_flight = ids.clone();
            let st = c.put(ns, 0, &entries, false)?;
            log.in_flight.clear();
            for (id, s) in ids.iter().zip(&st) {
                if *s == 0 {
                    log.acked.push(*id);
                    since_flush.push(*id);
                }
            }
            batches += 1;
            if batches % flush_every == 0 {
                log.in_flight = since_flush.clone();
                let f = c.flush()?;
                log.in_flight.clear();
                if f.failed == 0 {
                    log.flushed.append(&mut since_flush);
                    log.flushes += 1;
                }
            }
        }
        Ok(())
    })();
    if let Err(e) = run {
        log.error = Some(format!("{e:#}"));
    }
    log
}

#[derive(Clone, Copy, Debug, Default, Serialize)]
struct IterResult {
    acked: u64,
    flushed: u64,
    flushed_present: u64,
    unflushed: u64,
    unflushed_present: u64,
    older_flushed_checked: u64,
    older_flushed_present: u64,
    wrong: u64,
    phantom: u64,
    store_chunks: u64,
    present_written: u64,
}

/// GETs `ids` and counts present and wrong ones.
fn check(c: &mut Client, ns: Namespace, ids: &[u64], size: u64) -> Result<(u64, u64)> {
    let (mut present, mut wrong) = (0, 0);
    let mut want = vec![0u8; size as usize];
    let cap = c.region().map_or(0, |r| r.len()) / size;
    for group in ids.chunks(cap.max(1) as usize) {
        let entries: Vec<RegionEntry> = group
            .iter()
            .enumerate()
            .map(|(j, id)| RegionEntry {
                key: key_of(*id),
                offset: j as u64 * size,
                len: size,
            })
            .collect();
        let res = c.get(ns, 0, &entries)?;
        let region = c.region().expect("created").as_slice();
        for ((j, id), r) in group.iter().enumerate().zip(&res) {
            match r.status {
                GetStatus::Miss => {}
                s if s.is_hit() => {
                    present += 1;
                    fill_payload(&key_of(*id), &mut want);
                    let off = j * size as usize;
                    if r.len != size || region[off..off + size as usize] != want[..] {
                        wrong += 1;
                    }
                }
                // A chunk larger than what was written under this key.
                _ => wrong += 1,
            }
        }
    }
    Ok((present, wrong))
}

/// Runs `kvtier bench crash`.
pub(crate) fn run(a: &CrashArgs) -> Result<u8> {
    print_header("crash")?;
    let seed = a.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
    });
    outln!("seed {seed} (repeat with --seed {seed})");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let scratch = Scratch::new(a.common.dir.as_deref(), "crash")?;
    let size = a.size.0;
    let spec = DaemonSpec {
        ram_budget: "64MiB".into(),
        disk_budget: format!("{}MiB", DISK_BUDGET >> 20),
        resp: false,
        extra: Vec::new(),
        // Small regions: every restart leaves the rest of the open region
        // unused until it is evicted, so each iteration may consume a region.
        env: vec![(
            "KVTIER_REGION_SIZE".into(),
            format!("{}MiB", REGION_SIZE >> 20),
        )],
    };
    let rec = bench_record(1, 0, "crash");
    let mut next_id = 0u64;
    // Flushed chunks of earlier iterations in the current data dir.
    let mut older: Vec<u64> = Vec::new();
    let mut epoch = 0u32;
    let mut epoch_first = 0u64;
    let mut epochs = 1u32;
    let mut epoch_start_iter = 0u32;
    let mut daemon = Daemon::start(&scratch.path().join("e0"), &spec)?;
    let mut results = Vec::new();
    let mut writer_errors = Vec::new();
    let pb = bar(u64::from(a.iterations), "kill -9 loop");
    let t_all = Instant::now();
    for it in 0..a.iterations {
        // A fresh data dir before the store could fill: a region eviction
        // would legitimately drop flushed chunks. Each chunk takes its
        // payload plus at most a 4 KiB-aligned header and padding on disk.
        let epoch_bytes = (next_id - epoch_first) * (size + 8192);
        // At most a quarter of the regions may be consumed by restarts.
        let max_iters = a
            .fresh_every
            .min((DISK_BUDGET / REGION_SIZE / 4) as u32)
            .max(1);
        if it > 0 && (it - epoch_start_iter >= max_iters || epoch_bytes > DISK_BUDGET / 2) {
            daemon.kill9();
            let old = scratch.path().join(format!("e{epoch}"));
            std::fs::remove_dir_all(&old).with_context(|| format!("remove {}", old.display()))?;
            epoch += 1;
            older.clear();
            epoch_first = next_id;
            epoch_start_iter = it;
            epochs += 1;
            daemon = Daemon::start(&scratch.path().join(format!("e{epoch}")), &spec)?;
        }
        let stop = Arc::new(AtomicBool::new(false));
        let first = next_id;
        let h = {
            let (socket, rec, stop) = (daemon.socket.clone(), rec.clone(), Arc::clone(&stop));
            let (batch, fe) = (a.batch, a.flush_every.max(1));
            std::thread::spawn(move || writer(socket, rec, first, size, batch, fe, stop))
        };
        let max_ms = a.max_kill_after.0.as_millis().max(6) as u64;
        std::thread::sleep(Duration::from_millis(rng.gen_range(5..max_ms)));
        daemon.kill9();
        stop.store(true, Ordering::Relaxed);
        let log = h
            .join()
            .map_err(|_| anyhow::anyhow!("writer thread panicked"))?;
        if let Some(e) = &log.error
            && !e.contains("closed")
            && !e.contains("Broken pipe")
            && !e.contains("reset")
        {
            writer_errors.push(e.clone());
        }
        let written_max = log
            .acked
            .iter()
            .chain(&log.in_flight)
            .copied()
            .max()
            .map_or(first, |m| m + 1);
        next_id = written_max.max(first) + a.batch as u64;
        daemon.spawn().context("restart after kill -9")?;
        let mut c = daemon.client()?;
        let ns = c.hello(&rec)?;
        // Phantoms first, before any GET could admit disk chunks to RAM:
        // the store's chunk count must equal the number of chunks written
        // to this data dir that it holds, and never-written keys are absent.
        let stats = c.stats()?;
        let store_chunks = stats["store"]["disk_chunks"].as_u64().unwrap_or(0)
            + stats["store"]["ram_chunks"].as_u64().unwrap_or(0);
        let mut present_written = 0u64;
        let written: Vec<u64> = (epoch_first..next_id).collect();
        for part in written.chunks(16_384) {
            let keys: Vec<ChunkKey> = part.iter().map(|i| key_of(*i)).collect();
            present_written += c
                .lookup(ns, 0, &keys)?
                .locations
                .iter()
                .filter(|l| **l != LookupLocation::Miss)
                .count() as u64;
        }
        let never: Vec<ChunkKey> = (0..1024)
            .map(|i| bench_key(0xF00D, u64::from(it) * 1024 + i))
            .collect();
        let found_never = c
            .lookup(ns, 0, &never)?
            .locations
            .iter()
            .filter(|l| **l != LookupLocation::Miss)
            .count() as u64;
        let phantom = found_never + store_chunks.saturating_sub(present_written);
        c.create_region(64 * size)?;
        let flushed: HashSet<u64> = log.flushed.iter().copied().collect();
        let unflushed: Vec<u64> = log
            .acked
            .iter()
            .copied()
            .filter(|i| !flushed.contains(i))
            .collect();
        let (fp, w1) = check(&mut c, ns, &log.flushed, size)?;
        let (up, w2) = check(&mut c, ns, &unflushed, size)?;
        let (_, w3) = check(&mut c, ns, &log.in_flight, size)?;
        // A sample of earlier flushed chunks in this data dir.
        let sample: Vec<u64> = (0..older.len().min(64))
            .map(|_| older[rng.gen_range(0..older.len())])
            .collect();
        let (op, w4) = check(&mut c, ns, &sample, size)?;
        older.extend(log.flushed.iter().copied());
        results.push(IterResult {
            acked: log.acked.len() as u64,
            flushed: log.flushed.len() as u64,
            flushed_present: fp,
            unflushed: unflushed.len() as u64,
            unflushed_present: up,
            older_flushed_checked: sample.len() as u64,
            older_flushed_present: op,
            wrong: w1 + w2 + w3 + w4,
            phantom,
            store_chunks,
            present_written,
        });
        pb.inc(1);
    }
    pb.finish_and_clear();
    daemon.kill9();
    let elapsed = t_all.elapsed();

    let sum = |f: fn(&IterResult) -> u64| results.iter().map(f).sum::<u64>();
    let (flushed, fp) = (sum(|r| r.flushed), sum(|r| r.flushed_present));
    let (older_c, older_p) = (
        sum(|r| r.older_flushed_checked),
        sum(|r| r.older_flushed_present),
    );
    let (unfl, up) = (sum(|r| r.unflushed), sum(|r| r.unflushed_present));
    let (wrong, phantom) = (sum(|r| r.wrong), sum(|r| r.phantom));
    let pct = |a: u64, b: u64| {
        if b == 0 {
            f64::NAN
        } else {
            100.0 * a as f64 / b as f64
        }
    };
    let mut t = Table::new(
        &format!(
            "kill -9 torture: {} iterations, chunks of {}, {:.1} s",
            a.iterations,
            super::size_name(size),
            elapsed.as_secs_f64()
        ),
        &["check", "value", "target"],
    );
    t.row(vec![
        "chunks acknowledged".into(),
        sum(|r| r.acked).to_string(),
        "-".into(),
    ]);
    t.row(vec!["wrong reads".into(), wrong.to_string(), "0".into()]);
    t.row(vec![
        "phantom chunks".into(),
        phantom.to_string(),
        "0".into(),
    ]);
    t.row(vec![
        "flushed chunks surviving (same iteration)".into(),
        format!("{fp}/{flushed} = {} %", f2(pct(fp, flushed))),
        "100 %".into(),
    ]);
    t.row(vec![
        "flushed chunks surviving (earlier iterations, sampled)".into(),
        format!("{older_p}/{older_c} = {} %", f2(pct(older_p, older_c))),
        "100 %".into(),
    ]);
    t.row(vec![
        "unflushed acknowledged chunks surviving".into(),
        format!("{up}/{unfl} = {} %", f2(pct(up, unfl))),
        "reported".into(),
    ]);
    t.print()?;
    for e in writer_errors.iter().take(5) {
        outln!("writer error (not a disconnect): {e}");
    }
    let ok = wrong == 0
        && phantom == 0
        && fp == flushed
        && older_p == older_c
        && writer_errors.is_empty();
    let mut report = Report::new("crash");
    report.set("seed", json!(seed));
    report.set(
        "summary",
        json!({
            "iterations": a.iterations, "data_dirs": epochs, "chunk_size": size, "wrong": wrong, "phantom": phantom,
            "flushed": flushed, "flushed_present": fp,
            "older_flushed_checked": older_c, "older_flushed_present": older_p,
            "unflushed": unfl, "unflushed_present": up,
            "unflushed_survival_pct": pct(up, unfl), "writer_errors": writer_errors,
            "seconds": elapsed.as_secs_f64(), "ok": ok,
        }),
    );
    report.set("iterations", serde_json::to_value(&results)?);
    report.write(a.common.json.as_deref())?;
    outln!(
        "{}",
        if ok {
            "crash: all checks passed"
        } else {
            "crash: CHECKS FAILED"
        }
    );
    Ok(if ok { EXIT_OK } else { EXIT_ERROR })
}
