//! `kvtier bench restore` (the seed scenario in miniature) and
//! `kvtier bench two-rank` (the driver of `scripts/cluster-demo`).
//!
//! `two-rank` talks to running daemons: it writes rank 0's chunks on one
//! node and rank 1's on another (same keys, as vLLM's block hashes are the
//! same on every rank; the namespaces differ by rank), flushes both, then
//! on a third node waits for CLUSTER_LOOKUP to report the full prefix for
//! both ranks and restores every chunk of both ranks through that node's
//! peer cascade, comparing every byte.
//!
//! `restore` starts two daemons with peers itself: writes 2 ranks, flushes,
//! restarts both, times cluster lookup and a full restore from local disk,
//! then deletes one node's copy and restores from the peer's disk, and
//! times a negative LOOKUP of 1,024 keys while proving from the daemon's
//! counters that it read nothing from disk.

use std::net::UdpSocket;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use clap::Args;
use node::native::{Client, GetStatus, RegionEntry};
use node::tier::{ChunkKey, Namespace, NamespaceRecord};
use serde_json::json;

use super::report::{Report, Table, f1, f2, print_header};
use super::{
    CommonArgs, Daemon, DaemonSpec, Scratch, bar, bench_key, bench_record, fill_payload, gbps,
    size_name,
};
use crate::{EXIT_ERROR, EXIT_OK};

/// `kvtier bench two-rank`
#[derive(Debug, Args)]
pub struct TwoRankArgs {
    /// Socket of the node that stores rank 0's chunks.
    #[arg(long, value_name = "PATH")]
    pub rank0: PathBuf,
    /// Socket of the node that stores rank 1's chunks.
    #[arg(long, value_name = "PATH")]
    pub rank1: PathBuf,
    /// Socket of the node that looks up and restores both ranks (through
    /// its peers). Repeatable: every node given restores.
    #[arg(long = "restore-from", value_name = "PATH", required = true)]
    pub restore_from: Vec<PathBuf>,
    /// Chunks per rank.
    #[arg(long, value_parser = crate::bench::parse_count::<u64>, default_value_t = 32)]
    pub chunks: u64,
    /// Chunk size.
    #[arg(long, value_parser = crate::bench::parse_bytes, default_value = "256KiB")]
    pub size: node::ByteSize,
    /// How long to wait for the peers' availability to converge.
    #[arg(long, default_value = "20s")]
    pub timeout: node::HumanDuration,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// The record, keys and payload seeds of a two-rank session.
struct Session {
    records: [NamespaceRecord; 2],
    keys: Vec<ChunkKey>,
    size: u64,
}

impl Session {
    fn new(salt: &str, chunks: u64, size: u64) -> Self {
        Self {
            records: [bench_record(2, 0, salt), bench_record(2, 1, salt)],
            keys: (0..chunks).map(|i| bench_key(0x5E55, i)).collect(),
            size,
        }
    }

    /// The payload of chunk `i` of `rank`.
    fn fill(&self, rank: usize, i: usize, buf: &mut [u8]) {
        fill_payload(&bench_key(1000 + rank as u64, i as u64), buf);
    }

    /// PUTs every chunk of `rank` through `c` in batches; returns the
    /// namespace.
    fn write(&self, c: &mut Client, rank: usize) -> Result<Namespace> {
        let ns = c.hello(&self.records[rank]).context("HELLO")?;
        let batch = batch_of(self.size);
        c.create_region(batch as u64 * self.size)
            .context("create region")?;
        for (b, keys) in self.keys.chunks(batch).enumerate() {
            let region = c.region_mut().expect("created").as_mut_slice();
            let mut entries = Vec::new();
            for (j, key) in keys.iter().enumerate() {
                let off = j * self.size as usize;
                self.fill(
                    rank,
                    b * batch + j,
                    &mut region[off..off + self.size as usize],
                );
                entries.push(RegionEntry {
                    key: *key,
                    offset: off as u64,
                    len: self.size,
                });
            }
            let st = c.put(ns, 0, &entries, false).context("PUT")?;
            if let Some(bad) = st.iter().find(|s| **s != 0) {
                bail!("PUT of rank {rank} failed with code {bad}");
            }
        }
        Ok(ns)
    }

    /// GETs every chunk of `rank` through `c`; returns (bytes, wrong, misses,
    /// statuses seen).
    fn restore(&self, c: &mut Client, rank: usize) -> Result<RestoreCount> {
        let start = Instant::now();
        let mut checking = Duration::ZERO;
        let ns = c.hello(&self.records[rank]).context("HELLO")?;
        let batch = batch_of(self.size);
        c.create_region(batch as u64 * self.size)
            .context("create region")?;
        let mut want = vec![0u8; self.size as usize];
        let mut n = RestoreCount::default();
        for (b, keys) in self.keys.chunks(batch).enumerate() {
            let entries: Vec<RegionEntry> = keys
                .iter()
                .enumerate()
                .map(|(j, key)| RegionEntry {
                    key: *key,
                    offset: j as u64 * self.size,
                    len: self.size,
                })
                .collect();
            let res = c.get(ns, 0, &entries).context("GET")?;
            let check = Instant::now();
            let region = c.region().expect("created").as_slice();
            for (j, r) in res.iter().enumerate() {
                match r.status {
                    GetStatus::HitRam => n.ram += 1,
                    GetStatus::HitDisk => n.disk += 1,
                    GetStatus::HitPeer => n.peer += 1,
                    _ => {
                        n.misses += 1;
                        continue;
                    }
                }
                self.fill(rank, b * batch + j, &mut want);
                let off = j * self.size as usize;
                if r.len != self.size || region[off..off + self.size as usize] != want[..] {
                    n.wrong += 1;
                } else {
                    n.bytes += self.size;
                }
            }
            checking += check.elapsed();
        }
        // The restore's own time: the bench's byte checks are left out
        // (audit: they were timed with it).
        n.secs = start.elapsed().saturating_sub(checking).as_secs_f64();
        Ok(n)
    }
}

#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
struct RestoreCount {
    bytes: u64,
    ram: u64,
    disk: u64,
    peer: u64,
    misses: u64,
    wrong: u64,
    /// Seconds the restore took, its byte checks left out.
    secs: f64,
}

/// Chunks per PUT / GET request: about 16 MiB, at least 1, at most 64.
fn batch_of(size: u64) -> usize {
    ((16u64 << 20) / size.max(1)).clamp(1, 64) as usize
}

/// Polls CLUSTER_LOOKUP on `c` until both ranks report `want` chunks or
/// the deadline passes; returns the last result's min prefix and the time.
fn wait_cluster(
    c: &mut Client,
    s: &Session,
    want: u32,
    timeout: Duration,
) -> Result<(u32, Duration)> {
    let t0 = Instant::now();
    loop {
        let r = c
            .cluster_lookup(&s.records[0], &[0, 1], 0, &s.keys)
            .context("CLUSTER_LOOKUP")?;
        if r.min_prefix >= want || t0.elapsed() > timeout {
            return Ok((r.min_prefix, t0.elapsed()));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Runs `kvtier bench two-rank`.
pub(crate) fn run_two_rank(a: &TwoRankArgs) -> Result<u8> {
    let s = Session::new(
        &format!("two-rank-{}", std::process::id()),
        a.chunks,
        a.size.0,
    );
    let connect =
        |p: &Path| Client::connect(p).with_context(|| format!("connect to {}", p.display()));
    let t0 = Instant::now();
    let (mut c0, mut c1) = (connect(&a.rank0)?, connect(&a.rank1)?);
    s.write(&mut c0, 0).context("write rank 0")?;
    s.write(&mut c1, 1).context("write rank 1")?;
    let f0 = c0.flush().context("FLUSH rank 0's node")?;
    let f1 = c1.flush().context("FLUSH rank 1's node")?;
    let write_time = t0.elapsed();
    if !a.json {
        outln!(
            "wrote {} chunks of {} per rank: rank 0 on {}, rank 1 on {} (flushed {} + {} chunks) in {:.0} ms",
            a.chunks,
            size_name(a.size.0),
            a.rank0.display(),
            a.rank1.display(),
            f0.chunks,
            f1.chunks,
            write_time.as_secs_f64() * 1e3
        );
    }
    let mut ok = f0.failed == 0 && f1.failed == 0;
    let mut nodes = Vec::new();
    let absent: Vec<ChunkKey> = (0..16).map(|i| bench_key(0xDEAD, i)).collect();
    for sock in &a.restore_from {
        let mut c = connect(sock)?;
        let (prefix, waited) = wait_cluster(&mut c, &s, a.chunks as u32, a.timeout.0)?;
        let r0 = s.restore(&mut c, 0).context("restore rank 0")?;
        let r1 = s.restore(&mut c, 1).context("restore rank 1")?;
        let rt = Duration::from_secs_f64(r0.secs + r1.secs);
        let ns0 = c.hello(&s.records[0])?;
        let neg = c.lookup(ns0, 0, &absent).context("LOOKUP of absent keys")?;
        let good = prefix == a.chunks as u32
            && [r0, r1].iter().all(|r| r.misses == 0 && r.wrong == 0)
            && neg.prefix == 0;
        ok &= good;
        if !a.json {
            outln!(
                "{}: cluster lookup prefix {prefix}/{} ({} {:.0} ms); restored rank 0: \
                 {} ram / {} disk / {} peer, {} missing, {} wrong; rank 1: {} ram / {} disk / {} peer, \
                 {} missing, {} wrong; {:.1} MB in {:.0} ms; absent keys prefix {} -> {}",
                sock.display(),
                a.chunks,
                if prefix == a.chunks as u32 {
                    "converged in"
                } else {
                    "NOT converged after"
                },
                waited.as_secs_f64() * 1e3,
                r0.ram,
                r0.disk,
                r0.peer,
                r0.misses,
                r0.wrong,
                r1.ram,
                r1.disk,
                r1.peer,
                r1.misses,
                r1.wrong,
                (r0.bytes + r1.bytes) as f64 / 1e6,
                rt.as_secs_f64() * 1e3,
                neg.prefix,
                if good { "OK" } else { "FAILED" }
            );
        }
        nodes.push(json!({
            "socket": sock, "cluster_prefix": prefix, "converged_ms": waited.as_secs_f64() * 1e3,
            "rank0": r0, "rank1": r1, "restore_ms": rt.as_secs_f64() * 1e3,
            "absent_prefix": neg.prefix, "ok": good,
        }));
    }
    if a.json {
        let doc = json!({"chunks": a.chunks, "size": a.size.0, "ok": ok, "nodes": nodes});
        outln!("{}", serde_json::to_string_pretty(&doc)?);
    }
    Ok(if ok { EXIT_OK } else { EXIT_ERROR })
}

/// `kvtier bench restore`
#[derive(Debug, Args)]
pub struct RestoreArgs {
    /// Chunks per rank (12,500 chunks of 16 tokens is a 200K-token
    /// session; scale down to the machine's disk).
    #[arg(long, value_parser = crate::bench::parse_count::<u64>, default_value_t = 2000)]
    pub chunks: u64,
    /// Chunk size.
    #[arg(long, value_parser = crate::bench::parse_bytes, default_value = "256KiB")]
    pub size: node::ByteSize,
    /// Common options.
    #[command(flatten)]
    pub common: CommonArgs,
}

/// The flags `kvtier node start` needs for peers.
const PEER_FLAGS: [&str; 4] = ["--peer-listen", "--peers", "--tls-dir", "--node-name"];

/// Fails naming the missing piece when this binary's `node start` has no
/// peer flags yet.
pub(crate) fn require_peer_flags() -> Result<()> {
    let exe = std::env::current_exe().context("find the kvtier binary")?;
    let out = super::output(super::command(exe).args(["node", "start", "--help"]))
        .context("run `kvtier node start --help`")?;
    let help = String::from_utf8_lossy(&out.stdout);
    let missing: Vec<&str> = PEER_FLAGS
        .iter()
        .copied()
        .filter(|f| !help.contains(f))
        .collect();
    if !missing.is_empty() {
        bail!(
            "not implemented yet: `kvtier node start` has no {} flag(s), so the bench cannot \
             start daemons with peers (the peer wiring of node/src/cluster.rs into the daemon \
             and its flags is not done)",
            missing.join(", ")
        );
    }
    Ok(())
}

/// A free UDP port on 127.0.0.1 (bound, then released: a small race the
/// daemon's start-up error would report).
fn free_udp_port() -> Result<u16> {
    let s = UdpSocket::bind("127.0.0.1:0").context("bind a UDP port")?;
    Ok(s.local_addr()?.port())
}

/// Runs `kvtier bench restore`.
pub(crate) fn run(a: &RestoreArgs) -> Result<u8> {
    print_header("restore")?;
    require_peer_flags()?;
    let scratch = Scratch::new(a.common.dir.as_deref(), "restore")?;
    let dir = scratch.path();
    let ca = node::peer::cert::init_ca("bench-restore", node::peer::cert::Validity::days(1))
        .context("create a CA")?;
    let bytes_per_rank = a.chunks * a.size.0;
    let ports = [free_udp_port()?, free_udp_port()?];
    let mut daemons = Vec::new();
    for i in 0..2 {
        let name = format!("n{}", i + 1);
        let tls = dir.join(&name).join("tls");
        node::peer::cert::issue(
            &ca,
            &name,
            &["127.0.0.1".parse().expect("ip")],
            &[],
            node::peer::cert::Validity::days(1),
        )
        .context("issue a node certificate")?
        .write_to(&tls)
        .context("write the node certificate")?;
        let spec = DaemonSpec {
            // Both ranks fit on each node's disk (the peer-disk phase keeps
            // a second copy of rank 0 on node 2).
            ram_budget: format!("{}MiB", (bytes_per_rank >> 20) * 2 + 256),
            disk_budget: format!("{}MiB", (bytes_per_rank >> 20) * 4 + 512),
            resp: false,
            env: Vec::new(),
            extra: vec![
                "--node-name".into(),
                name.clone(),
                "--peer-listen".into(),
                format!("127.0.0.1:{}", ports[i]),
                "--peers".into(),
                format!("127.0.0.1:{}", ports[1 - i]),
                "--tls-dir".into(),
                tls.to_string_lossy().into_owned(),
            ],
        };
        daemons.push(Daemon::start(&dir.join(&name), &spec)?);
    }
    let s = Session::new(
        &format!("restore-{}", std::process::id()),
        a.chunks,
        a.size.0,
    );
    let pb = bar(6, "restore");
    pb.set_message("write 2 ranks");
    let t = Instant::now();
    s.write(&mut daemons[0].client()?, 0)?;
    s.write(&mut daemons[1].client()?, 1)?;
    // A second copy of rank 0 on node 2, for the restore from a peer's disk.
    s.write(&mut daemons[1].client()?, 0)?;
    for d in &daemons {
        let f = d.client()?.flush().context("FLUSH")?;
        ensure!(f.failed == 0, "FLUSH failed for {} chunks", f.failed);
    }
    let write_time = t.elapsed();
    pb.inc(1);
    pb.set_message("restart both");
    let t = Instant::now();
    for d in daemons.iter_mut() {
        d.stop()?;
    }
    for d in daemons.iter_mut() {
        d.spawn()?;
    }
    let restart_time = t.elapsed();
    pb.inc(1);
    pb.set_message("cluster lookup");
    let mut c1 = daemons[0].client()?;
    let (prefix, converge) = wait_cluster(&mut c1, &s, a.chunks as u32, Duration::from_secs(30))?;
    let t = Instant::now();
    let lookups = 20;
    for _ in 0..lookups {
        c1.cluster_lookup(&s.records[0], &[0, 1], 0, &s.keys)?;
    }
    let cl_time = t.elapsed() / lookups;
    pb.inc(1);
    pb.set_message("restore from disk");
    let r0 = s.restore(&mut daemons[0].client()?, 0)?;
    let r1 = s.restore(&mut daemons[1].client()?, 1)?;
    let disk_time = Duration::from_secs_f64(r0.secs + r1.secs);
    pb.inc(1);
    pb.set_message("restore from a peer's disk");
    let ns0 = c1.hello(&s.records[0])?;
    let existed = c1.delete(ns0, 0, &s.keys).context("DELETE node 1's copy")?;
    ensure!(
        existed.iter().all(|e| *e),
        "node 1 did not hold every rank-0 chunk"
    );
    // Node 2 restarts so its copy is on disk only.
    daemons[1].stop()?;
    daemons[1].spawn()?;
    let (_, _) = wait_cluster(&mut c1, &s, a.chunks as u32, Duration::from_secs(30))?;
    let rp = s.restore(&mut daemons[0].client()?, 0)?;
    let peer_time = Duration::from_secs_f64(rp.secs);
    pb.inc(1);
    pb.set_message("negative lookup");
    let absent: Vec<ChunkKey> = (0..1024).map(|i| bench_key(0xAB5E, i)).collect();
    // A missing counter fails the bench (a renamed field read as equal
    // before and after: audit).
    let reads = |c: &mut Client| -> Result<u64> {
        c.stats()?["store"]["disk_reads"]
            .as_u64()
            .context("the daemon's STATS has no store.disk_reads")
    };
    let before = reads(&mut c1)?;
    let mut neg_hist = super::new_hist();
    let mut neg_prefix = 0;
    for _ in 0..200 {
        let t = Instant::now();
        neg_prefix = neg_prefix.max(c1.lookup(ns0, 0, &absent)?.prefix);
        super::record(&mut neg_hist, t.elapsed());
    }
    let after = reads(&mut c1)?;
    pb.finish_and_clear();
    for d in daemons.iter_mut() {
        d.stop()?;
    }

    let total = 2 * bytes_per_rank;
    let neg = super::Lat::of(&neg_hist);
    let mut t = Table::new(
        &format!(
            "restore: 2 ranks x {} chunks of {} ({} per rank), 2 daemons with peers",
            a.chunks,
            size_name(a.size.0),
            // Exact: "0 MB" for 8 chunks of 1000 B.
            node::ByteSize(bytes_per_rank)
        ),
        &["step", "time ms", "GB/s", "detail"],
    );
    t.row(vec![
        "write + flush (3 copies)".into(),
        f1(write_time.as_secs_f64() * 1e3),
        f2(gbps(total + bytes_per_rank, write_time)),
        String::new(),
    ]);
    t.row(vec![
        "restart both daemons".into(),
        f1(restart_time.as_secs_f64() * 1e3),
        "-".into(),
        String::new(),
    ]);
    t.row(vec![
        "peer availability converged".into(),
        f1(converge.as_secs_f64() * 1e3),
        "-".into(),
        format!("prefix {prefix}/{}", a.chunks),
    ]);
    t.row(vec![
        "cluster lookup (2 ranks)".into(),
        f2(cl_time.as_secs_f64() * 1e3),
        "-".into(),
        format!("{} keys", a.chunks),
    ]);
    t.row(vec![
        "full restore, local disk".into(),
        f1(disk_time.as_secs_f64() * 1e3),
        f2(gbps(r0.bytes + r1.bytes, disk_time)),
        format!(
            "disk hits {}, ram {}, miss {}, wrong {}",
            r0.disk + r1.disk,
            r0.ram + r1.ram,
            r0.misses + r1.misses,
            r0.wrong + r1.wrong
        ),
    ]);
    t.row(vec![
        "rank 0 restore, peer's disk".into(),
        f1(peer_time.as_secs_f64() * 1e3),
        f2(gbps(rp.bytes, peer_time)),
        format!(
            "peer hits {}, miss {}, wrong {}",
            rp.peer, rp.misses, rp.wrong
        ),
    ]);
    t.row(vec![
        "negative LOOKUP 1,024 keys p50/p99 µs".into(),
        format!("{}/{}", f1(neg.p50_us), f1(neg.p99_us)),
        "-".into(),
        format!(
            "disk reads during 200 lookups: {}",
            after.wrapping_sub(before)
        ),
    ]);
    t.print()?;
    let ok = prefix == a.chunks as u32
        && [r0, r1, rp].iter().all(|r| r.misses == 0 && r.wrong == 0)
        && rp.peer == a.chunks
        && neg_prefix == 0
        && after == before;
    let mut report = Report::new("restore");
    report.set(
        "result",
        json!({
            "chunks_per_rank": a.chunks, "size": a.size.0,
            "write_flush_ms": write_time.as_secs_f64() * 1e3,
            "restart_ms": restart_time.as_secs_f64() * 1e3,
            "converge_ms": converge.as_secs_f64() * 1e3,
            "cluster_lookup_ms": cl_time.as_secs_f64() * 1e3,
            "restore_disk_ms": disk_time.as_secs_f64() * 1e3,
            "restore_disk_gbps": gbps(r0.bytes + r1.bytes, disk_time),
            "restore_peer_ms": peer_time.as_secs_f64() * 1e3,
            "restore_peer_gbps": gbps(rp.bytes, peer_time),
            "rank0": r0, "rank1": r1, "peer": rp,
            "negative_lookup": neg, "negative_lookup_disk_reads": after.wrapping_sub(before),
            "ok": ok,
        }),
    );
    report.write(a.common.json.as_deref())?;
    outln!(
        "{}",
        if ok {
            "restore: all checks passed"
        } else {
            "restore: CHECKS FAILED"
        }
    );
    Ok(if ok { EXIT_OK } else { EXIT_ERROR })
}
