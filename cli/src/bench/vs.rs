//! `kvtier bench vs`: the same chunk workload against kvtier's RESP
//! endpoint, a real `redis-server` (started by the bench, no persistence)
//! and LMCache's own server (`python -m lmcache.v1.server`, driven through
//! LMCache's protocol classes), all on this machine in the same run.
//!
//! Per chunk size and concurrency: SET every chunk of a working set once,
//! then GET every chunk once (and check its length); throughput and
//! p50/p99 per operation; every figure also as a ratio to kvtier's.
//!
//! kvtier and Redis are driven by the same Rust RESP client. LMCache's
//! server speaks its own protocol, which the bench drives from Python with
//! LMCache's `ClientMetaMessage` / `ServerMetaMessage` (the client code its
//! remote connector uses); the Python client's own cost is part of that
//! column, as it is for LMCache users.
//!
//! The LMCache column needs a venv with `lmcache` and `torch` (the server
//! imports torch): `--lmcache-python`, else the test scripts' shared venv
//! (`~/.cache/kvtier-test/venv-torch`), else `.cache/venv-lmcache` or
//! `.cache/venv-torch` under the current directory. When none works the
//! column is skipped and the reason printed.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Barrier;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use serde_json::{Value, json};

use super::report::{Report, Table, f1, f2, print_header};
use super::{
    CommonArgs, Daemon, DaemonSpec, Lat, Scratch, bar, gbps, new_hist, parse_size, record,
    size_name,
};
use crate::EXIT_OK;

/// `kvtier bench vs`
#[derive(Debug, Args)]
pub struct VsArgs {
    /// Chunk sizes.
    #[arg(long, value_delimiter = ',', value_parser = parse_size, default_value = "256KiB,1MiB,2.5MiB,4MiB")]
    pub sizes: Vec<u64>,
    /// Client concurrencies (one connection each).
    #[arg(long, value_parser = crate::bench::parse_count::<usize>, value_delimiter = ',', default_value = "1,4")]
    pub concurrency: Vec<usize>,
    /// Working set per size and concurrency, in bytes; at least 8 chunks
    /// of the largest size.
    #[arg(long, value_parser = crate::bench::parse_bytes, default_value = "128MiB")]
    pub set_bytes: node::ByteSize,
    /// The redis-server binary.
    #[arg(long, default_value = "redis-server")]
    pub redis_server: PathBuf,
    /// Passes over every cell, the servers' order alternating between
    /// passes; each cell reports its median pass (by GB/s) and every
    /// pass's GB/s (`runs` in --json).
    #[arg(long, value_parser = crate::bench::parse_count::<usize>, default_value = "3")]
    pub repeats: usize,
    /// Python of a venv with lmcache and torch (default: the test scripts'
    /// `~/.cache/kvtier-test/venv-torch`, else .cache/venv-lmcache or
    /// .cache/venv-torch, whichever imports both).
    #[arg(long, value_name = "PATH")]
    pub lmcache_python: Option<PathBuf>,
    /// Common options.
    #[command(flatten)]
    pub common: CommonArgs,
}

/// A child process killed by pid when dropped (or when the bench is
/// stopped by a signal: [`super::spawn_tracked`]).
struct Proc(Child);

impl Proc {
    fn spawn(cmd: &mut Command) -> std::io::Result<Self> {
        super::spawn_tracked(cmd).map(Self)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        super::kill_and_reap(&mut self.0);
    }
}

fn free_tcp_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("bind a TCP port")?;
    Ok(l.local_addr()?.port())
}

/// Waits until `addr` accepts a connection (bounded) while `child` runs.
fn wait_listening(child: &mut Child, addr: SocketAddr, what: &str, log: &Path) -> Result<()> {
    let t0 = Instant::now();
    loop {
        if let Some(st) = super::try_reap(child)? {
            bail!(
                "{what} exited during start-up with {st}: {}",
                std::fs::read_to_string(log).unwrap_or_default().trim()
            );
        }
        if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
            return Ok(());
        }
        if t0.elapsed() > Duration::from_secs(60) {
            bail!("{what} did not listen on {addr} within 60 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A minimal blocking RESP2 client: SET and GET of binary values.
struct Resp {
    w: TcpStream,
    r: BufReader<TcpStream>,
    line: String,
}

impl Resp {
    fn connect(addr: SocketAddr) -> Result<Self> {
        let s = TcpStream::connect(addr).with_context(|| format!("connect to {addr}"))?;
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(Duration::from_secs(60)))?;
        Ok(Self {
            r: BufReader::with_capacity(1 << 20, s.try_clone()?),
            w: s,
            line: String::new(),
        })
    }

    fn read_line(&mut self) -> Result<&str> {
        self.line.clear();
        let n = self.r.read_line(&mut self.line)?;
        if n == 0 {
            bail!("server closed the connection");
        }
        Ok(self.line.trim_end())
    }

    fn set(&mut self, key: &[u8], value: &[u8]) -> Result<()> {
        let mut head = format!("*3\r\n$3\r\nSET\r\n${}\r\n", key.len()).into_bytes();
        head.extend_from_slice(key);
        head.extend_from_slice(format!("\r\n${}\r\n", value.len()).as_bytes());
        self.w.write_all(&head)?;
        self.w.write_all(value)?;
        self.w.write_all(b"\r\n")?;
        let l = self.read_line()?;
        if l != "+OK" {
            bail!("SET answered {l:?}");
        }
        Ok(())
    }

    /// GET into `buf`; returns the value's length, or None for a nil.
    fn get(&mut self, key: &[u8], buf: &mut Vec<u8>) -> Result<Option<usize>> {
        let mut req = format!("*2\r\n$3\r\nGET\r\n${}\r\n", key.len()).into_bytes();
        req.extend_from_slice(key);
        req.extend_from_slice(b"\r\n");
        self.w.write_all(&req)?;
        let l = self.read_line()?.to_owned();
        let Some(n) = l.strip_prefix('$') else {
            bail!("GET answered {l:?}");
        };
        let n: i64 = n.parse().context("bulk length")?;
        if n < 0 {
            return Ok(None);
        }
        let n = usize::try_from(n).context("bulk length")?;
        buf.resize(n + 2, 0);
        self.r.read_exact(buf)?;
        Ok(Some(n))
    }
}

/// Results of one (server, op, size, concurrency) cell.
#[expect(clippy::too_many_arguments, reason = "the fields of one JSON cell")]
fn cell_json(
    server: &str,
    op: &str,
    size: u64,
    c: usize,
    ops: u64,
    wall: Duration,
    lat: Lat,
    bad: u64,
) -> Value {
    json!({
        "server": server, "op": op, "size": size, "concurrency": c, "ops": ops,
        "gbps": gbps(ops * size, wall), "seconds": wall.as_secs_f64(),
        "latency": lat, "bad": bad,
    })
}

/// One cell per (server, op, size, concurrency): the pass of median GB/s
/// over the passes made, with every pass's GB/s in `runs`.
fn median_cells(passes: Vec<Value>) -> Vec<Value> {
    let mut groups: Vec<(String, Vec<Value>)> = Vec::new();
    for v in passes {
        let k = format!(
            "{}|{}|{}|{}",
            v["server"], v["op"], v["size"], v["concurrency"]
        );
        match groups.iter_mut().find(|(g, _)| *g == k) {
            Some((_, vs)) => vs.push(v),
            None => groups.push((k, vec![v])),
        }
    }
    groups
        .into_iter()
        .map(|(_, mut vs)| {
            let g = |v: &Value| v["gbps"].as_f64().unwrap_or(f64::NAN);
            vs.sort_by(|a, b| g(a).total_cmp(&g(b)));
            let runs: Vec<f64> = vs.iter().map(g).collect();
            let mut m = vs.swap_remove(vs.len() / 2);
            m["runs"] = json!(runs);
            m
        })
        .collect()
}

/// SET then GET a working set over RESP at `addr`.
fn resp_cells(server: &str, addr: SocketAddr, size: u64, c: usize, n: u64) -> Result<Vec<Value>> {
    let mut out = Vec::new();
    let tag = format!("vs:{}:{}:{c}", size, std::process::id());
    for op in ["SET", "GET"] {
        let barrier = Barrier::new(c + 1);
        let (results, wall) = std::thread::scope(|s| {
            let hs: Vec<_> = (0..c)
                .map(|t| {
                    let (barrier, tag) = (&barrier, &tag);
                    s.spawn(move || -> Result<(hdrhistogram::Histogram<u64>, u64)> {
                        let conn = Resp::connect(addr);
                        let value = vec![(t as u8) | 1; size as usize];
                        let mut buf = Vec::with_capacity(size as usize + 2);
                        barrier.wait();
                        let mut conn = conn?;
                        let mut h = new_hist();
                        let mut bad = 0;
                        let mut i = t as u64;
                        while i < n {
                            let key = format!("{tag}:{i}");
                            let t0 = Instant::now();
                            if op == "SET" {
                                conn.set(key.as_bytes(), &value)?;
                            } else if conn.get(key.as_bytes(), &mut buf)? != Some(size as usize) {
                                bad += 1;
                            }
                            record(&mut h, t0.elapsed());
                            i += c as u64;
                        }
                        Ok((h, bad))
                    })
                })
                .collect();
            barrier.wait();
            let t0 = Instant::now();
            let r: Vec<_> = hs
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(anyhow::anyhow!("client panicked")))
                })
                .collect();
            (r, t0.elapsed())
        });
        let mut h = new_hist();
        let mut bad = 0;
        for r in results {
            let (hh, b) = r?;
            h.add(&hh).expect("same bounds");
            bad += b;
        }
        // A GET that missed moved nothing (audit: counted as a chunk).
        let moved = n.saturating_sub(bad);
        out.push(cell_json(
            server,
            op,
            size,
            c,
            moved,
            wall,
            Lat::of(&h),
            bad,
        ));
    }
    Ok(out)
}

/// The Python driver of LMCache's server: LMCache's own protocol messages
/// over one socket per thread. Prints one JSON object per cell.
const LMCACHE_DRIVER: &str = r#"
import json, socket, sys, threading, time
import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.protocol import ClientCommand, ClientMetaMessage, ServerMetaMessage, ServerReturnCode

host, port = sys.argv[1], int(sys.argv[2])
size, conc, n = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
FMT = MemoryFormat.KV_2LTD
SHAPE = torch.Size([size // 2, 0, 0, 0])

def key(i):
    return CacheEngineKey("kvtier-bench", 1, 0, size * 1000003 + conc * 100000007 + i, torch.bfloat16)

def recv_all(s, n):
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = s.recv_into(view[got:], n - got)
        if k == 0:
            raise RuntimeError("server closed the connection")
        got += k
    return buf

def worker(t, op, lat, bad, start):
    s = socket.create_connection((host, port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    value = bytes([t | 1]) * size
    start.wait()
    i = t
    while i < n:
        t0 = time.perf_counter()
        if op == "SET":
            s.sendall(ClientMetaMessage(ClientCommand.PUT, key(i), size, FMT, torch.bfloat16, SHAPE).serialize())
            s.sendall(value)
        else:
            s.sendall(ClientMetaMessage(ClientCommand.GET, key(i), 0, FMT, None, torch.Size([0, 0, 0, 0])).serialize())
            meta = ServerMetaMessage.deserialize(recv_all(s, ServerMetaMessage.packlength()))
            if meta.code != ServerReturnCode.SUCCESS:
                bad[t] += 1
            else:
                data = recv_all(s, meta.length)
                if len(data) != size:
                    bad[t] += 1
        lat[t].append(time.perf_counter() - t0)
        i += conc
    if op == "SET":
        # PUT has no reply: a HEALTH round trip proves the server has read
        # every PUT sent on this connection.
        s.sendall(ClientMetaMessage(ClientCommand.HEALTH, key(0), 0, FMT, None, torch.Size([0, 0, 0, 0])).serialize())
        recv_all(s, ServerMetaMessage.packlength())
    s.close()

for op in ("SET", "GET"):
    lat = [[] for _ in range(conc)]
    bad = [0] * conc
    start = threading.Barrier(conc + 1)
    ths = [threading.Thread(target=worker, args=(t, op, lat, bad, start)) for t in range(conc)]
    for th in ths:
        th.start()
    start.wait()
    t0 = time.perf_counter()
    for th in ths:
        th.join()
    wall = time.perf_counter() - t0
    all_lat = sorted(x for l in lat for x in l)
    q = lambda p: all_lat[min(len(all_lat) - 1, int(p * len(all_lat)))] * 1e6
    print(json.dumps({"op": op, "seconds": wall, "ops": len(all_lat), "bad": sum(bad),
                      "p50_us": q(0.5), "p99_us": q(0.99), "max_us": all_lat[-1] * 1e6}), flush=True)
"#;

/// Finds a Python that imports lmcache's server and torch.
fn lmcache_python(given: Option<&Path>) -> Result<PathBuf, String> {
    let candidates: Vec<PathBuf> = match given {
        Some(p) => vec![p.to_owned()],
        None => {
            // The test scripts' shared venv (scripts/lib/torch-venv.sh), then
            // venvs under the current directory.
            let cache = std::env::var_os("KVTEST_CACHE")
                .map(PathBuf::from)
                .or_else(|| {
                    std::env::var_os("XDG_CACHE_HOME").map(|d| PathBuf::from(d).join("kvtier-test"))
                })
                .or_else(|| {
                    std::env::var_os("HOME").map(|d| PathBuf::from(d).join(".cache/kvtier-test"))
                });
            cache
                .map(|c| c.join("venv-torch"))
                .into_iter()
                .chain(
                    [".cache/venv-lmcache", ".cache/venv-torch"]
                        .iter()
                        .map(PathBuf::from),
                )
                .map(|v| v.join("bin/python"))
                .collect()
        }
    };
    let mut why = Vec::new();
    for py in candidates {
        if !py.exists() {
            why.push(format!("{} does not exist", py.display()));
            continue;
        }
        let out = super::output(
            super::command(&py)
                .args(["-c", "import torch, lmcache.v1.server, lmcache.v1.protocol"])
                .stdin(Stdio::null()),
        );
        match out {
            Ok(o) if o.status.success() => return Ok(py),
            Ok(o) => {
                let err = String::from_utf8_lossy(&o.stderr);
                let last = err.lines().rfind(|l| !l.trim().is_empty()).unwrap_or("");
                let last = if last.trim().is_empty() {
                    format!(
                        "it cannot import torch and lmcache ({}, no message)",
                        o.status
                    )
                } else {
                    last.trim().to_owned()
                };
                why.push(format!("{}: {last}", py.display()));
            }
            Err(e) => why.push(format!("{}: {e}", py.display())),
        }
    }
    Err(why.join("; "))
}

fn lmcache_cells(
    py: &Path,
    addr: SocketAddr,
    script: &Path,
    size: u64,
    c: usize,
    n: u64,
) -> Result<Vec<Value>> {
    let out = super::output(
        super::command(py)
            .arg(script)
            .args([
                addr.ip().to_string(),
                addr.port().to_string(),
                size.to_string(),
                c.to_string(),
                n.to_string(),
            ])
            .stdin(Stdio::null()),
    )
    .context("run the LMCache driver")?;
    if !out.status.success() {
        bail!(
            "the LMCache driver failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .last()
                .unwrap_or("")
        );
    }
    let mut cells = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.starts_with('{'))
    {
        let v: Value = serde_json::from_str(line).context("parse the driver's output")?;
        let ops = v["ops"].as_u64().unwrap_or(0);
        let wall = Duration::from_secs_f64(v["seconds"].as_f64().unwrap_or(f64::NAN).max(1e-9));
        let lat = Lat {
            count: ops,
            p50_us: v["p50_us"].as_f64().unwrap_or(f64::NAN),
            p99_us: v["p99_us"].as_f64().unwrap_or(f64::NAN),
            max_us: v["max_us"].as_f64().unwrap_or(f64::NAN),
        };
        cells.push(cell_json(
            "lmcache",
            v["op"].as_str().unwrap_or("?"),
            size,
            c,
            ops,
            wall,
            lat,
            v["bad"].as_u64().unwrap_or(0),
        ));
    }
    Ok(cells)
}

/// Fewest chunks in the set of each size.
const MIN_SET_CHUNKS: u64 = 8;

/// Runs `kvtier bench vs`.
pub(crate) fn run(a: &VsArgs) -> Result<u8> {
    // Refused before any work: it was raised silently, so the figures were
    // of another set than the one given.
    if let Some(&largest) = a.sizes.iter().max()
        && a.set_bytes.0 / largest < MIN_SET_CHUNKS
    {
        return Err(crate::UsageError(format!(
            "--set-bytes {}: {} chunks of {}; the set of each size needs at least \
             {MIN_SET_CHUNKS} (give --set-bytes {} or more, or smaller --sizes)",
            node::ByteSize(a.set_bytes.0),
            a.set_bytes.0 / largest,
            size_name(largest),
            node::ByteSize(largest * MIN_SET_CHUNKS),
        ))
        .into());
    }
    print_header("vs")?;
    let scratch = Scratch::new(a.common.dir.as_deref(), "vs")?;
    let per_server = a.set_bytes.0 * a.sizes.len() as u64 * a.concurrency.len() as u64;
    let mut notes = Vec::new();

    // kvtier: RESP on an ephemeral port, RAM large enough for the whole run.
    let spec = DaemonSpec {
        ram_budget: format!("{}MiB", (per_server >> 20) + 256),
        disk_budget: format!("{}MiB", (per_server >> 20) + 512),
        resp: true,
        extra: Vec::new(),
        env: Vec::new(),
    };
    let mut kv = Daemon::start(&scratch.path().join("kvtier"), &spec)?;
    let kv_addr = kv.resp.context("the bench daemon has no RESP address")?;

    // redis-server: no RDB, no AOF, loopback only.
    let redis_port = free_tcp_port()?;
    let redis_log = scratch.path().join("redis.log");
    let redis = Proc::spawn(
        super::command(&a.redis_server)
            .args([
                "--port",
                &redis_port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .arg("--dir")
            .arg(scratch.path())
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&redis_log)?)
            .stderr(Stdio::null()),
    );
    let mut redis = match redis {
        Ok(p) => Some(p),
        Err(e) => {
            notes.push(format!(
                "Redis column skipped: cannot run {}: {e}",
                a.redis_server.display()
            ));
            None
        }
    };
    let redis_addr: SocketAddr = ([127, 0, 0, 1], redis_port).into();
    if let Some(p) = redis.as_mut() {
        wait_listening(&mut p.0, redis_addr, "redis-server", &redis_log)?;
    }

    // LMCache's server, if a venv can run it.
    let mut lm = None;
    let lm_script = scratch.path().join("lmcache_driver.py");
    match lmcache_python(a.lmcache_python.as_deref()) {
        Ok(py) => {
            std::fs::write(&lm_script, LMCACHE_DRIVER)?;
            let port = free_tcp_port()?;
            let log = scratch.path().join("lmcache.log");
            let mut p = Proc::spawn(
                super::command(&py)
                    .args([
                        "-m",
                        "lmcache.v1.server",
                        "127.0.0.1",
                        &port.to_string(),
                        "cpu",
                    ])
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(std::fs::File::create(&log)?),
            )
            .context("start the LMCache server")?;
            let addr: SocketAddr = ([127, 0, 0, 1], port).into();
            match wait_listening(&mut p.0, addr, "the LMCache server", &log) {
                Ok(()) => lm = Some((py, p, addr)),
                Err(e) => notes.push(format!("LMCache column skipped: {e:#}")),
            }
        }
        Err(why) => notes.push(format!(
            "LMCache column skipped: no Python with lmcache and torch ({why})"
        )),
    }

    let mut servers_run = vec!["kvtier"];
    if redis.is_some() {
        servers_run.push("redis");
    }
    if lm.is_some() {
        servers_run.push("lmcache");
    }
    let servers = servers_run.len();
    let repeats = a.repeats.max(1);
    let pb = bar(
        (a.sizes.len() * a.concurrency.len() * servers * repeats) as u64,
        "vs",
    );
    let mut passes = Vec::new();
    for &size in &a.sizes {
        let n = a.set_bytes.0 / size;
        for &c in &a.concurrency {
            // The servers take turns going first (audit: one short pass per
            // cell, kvtier always first, swung by up to 2.5x between runs).
            for rep in 0..repeats {
                let mut order = servers_run.clone();
                order.rotate_left(rep % servers);
                for srv in order {
                    pb.set_message(format!(
                        "{srv} {} x{c} ({}/{repeats})",
                        size_name(size),
                        rep + 1
                    ));
                    match srv {
                        "kvtier" => passes.extend(resp_cells("kvtier", kv_addr, size, c, n)?),
                        "redis" => passes.extend(resp_cells("redis", redis_addr, size, c, n)?),
                        _ => {
                            let (py, _, addr) = lm.as_ref().expect("in the order only if started");
                            match lmcache_cells(py, *addr, &lm_script, size, c, n) {
                                Ok(v) => passes.extend(v),
                                Err(e) => {
                                    notes.push(format!("LMCache {} x{c}: {e:#}", size_name(size)))
                                }
                            }
                        }
                    }
                    pb.inc(1);
                }
            }
        }
    }
    pb.finish_and_clear();
    let cells = median_cells(passes);
    notes.push(format!(
        "each cell: the median of {repeats} pass(es), the servers taking turns to go first \
         (every pass's GB/s: `runs` in --json)"
    ));
    if lm.is_some() {
        notes.push(
            "LMCache's SET latency is the send alone (its PUT has no reply); the others' are \
             round trips"
                .into(),
        );
    }
    drop(lm);
    drop(redis);
    kv.stop()?;

    let mut t = Table::new(
        "RESP chunk workload (GB/s; latency µs; ratio = server / kvtier, higher is faster)",
        &[
            "op",
            "size",
            "conc",
            "kvtier GB/s",
            "p50",
            "p99",
            "redis GB/s",
            "ratio",
            "p99",
            "lmcache GB/s",
            "ratio",
            "p99",
        ],
    );
    let find = |srv: &str, op: &str, size: u64, c: usize| {
        cells.iter().find(|v| {
            v["server"] == srv && v["op"] == op && v["size"] == size && v["concurrency"] == c
        })
    };
    let mut starred = false;
    let mut p99 = |v: &serde_json::Value| {
        let n = v["latency"]["count"].as_u64().unwrap_or(0);
        starred |= n < super::P99_MIN_SAMPLES;
        super::p99_cell(v["latency"]["p99_us"].as_f64().unwrap_or(f64::NAN), n)
    };
    let mut ratios = Vec::new();
    for op in ["SET", "GET"] {
        for &size in &a.sizes {
            for &c in &a.concurrency {
                let Some(k) = find("kvtier", op, size, c) else {
                    continue;
                };
                let kg = k["gbps"].as_f64().unwrap_or(f64::NAN);
                let mut row = vec![
                    op.to_owned(),
                    size_name(size),
                    c.to_string(),
                    f2(kg),
                    f1(k["latency"]["p50_us"].as_f64().unwrap_or(f64::NAN)),
                    p99(k),
                ];
                for srv in ["redis", "lmcache"] {
                    match find(srv, op, size, c) {
                        Some(v) => {
                            let g = v["gbps"].as_f64().unwrap_or(f64::NAN);
                            row.push(f2(g));
                            row.push(f2(g / kg));
                            row.push(p99(v));
                            ratios.push(json!({"server": srv, "op": op, "size": size, "concurrency": c, "ratio_to_kvtier": g / kg}));
                        }
                        None => row.extend(["-".into(), "-".into(), "-".into()]),
                    }
                }
                t.row(row);
            }
        }
    }
    t.print()?;
    if starred {
        outln!("{}", super::P99_NOTE);
    }
    for n in &notes {
        outln!("{n}");
    }
    let bad: u64 = cells.iter().map(|v| v["bad"].as_u64().unwrap_or(0)).sum();
    if bad > 0 {
        outln!("WARNING: {bad} GETs returned a missing or wrong-length value");
    }
    let mut report = Report::new("vs");
    report.set("cells", json!(cells));
    report.set("ratios", json!(ratios));
    report.set("notes", json!(notes));
    report.write(a.common.json.as_deref())?;
    Ok(if bad == 0 { EXIT_OK } else { crate::EXIT_ERROR })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_python_is_a_reason_not_an_error() {
        let why = lmcache_python(Some(Path::new("/nonexistent/python"))).unwrap_err();
        assert!(why.contains("does not exist"), "{why}");
    }
}
