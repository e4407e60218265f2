//! `kvtier bench <scenario>`: end-to-end benchmarks against real daemons.
//!
//! Every scenario prints a table and, with `--json FILE`, writes the same
//! figures as JSON. Speed figures are printed next to a baseline measured
//! in the same run (the machine's limits, or another server), never against
//! remembered numbers.
//!
//! Scenarios (see `docs/benchmarks.md`):
//! - [`limits`]: cold memcpy, O_DIRECT sequential write/read, TCP and raw
//!   QUIC loopback throughput;
//! - [`local`]: PUT / GET / LOOKUP through the native socket and shared
//!   memory, RAM hits and disk hits, as ratios to the limits;
//! - [`vs`]: the same chunk workload over RESP against kvtier, a real
//!   redis-server and LMCache's server;
//! - [`crash`]: kill -9 torture of a writer that PUTs and FLUSHes;
//! - [`churn`]: PUT p99 while the disk writer is saturated, bytes written
//!   while idle;
//! - [`restore`]: the seed scenario in miniature across two daemons with
//!   peers, and `two-rank`, the cluster-demo driver.
//!
//! Daemons the bench starts are `kvtier node start` child processes of this
//! binary with their own data dir and socket in a scratch directory; they
//! are killed by pid when the bench ends, whatever happens.

mod churn;
mod crash;
mod limits;
mod local;
mod report;
mod restore;
mod vs;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use node::daemon::LockInfo;
use node::native::Client;
use node::tier::{ChunkKey, NamespaceRecord};

/// How long a daemon started by the bench may take to start or stop.
const DAEMON_DEADLINE: Duration = Duration::from_secs(60);

/// `kvtier bench`
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// The scenario.
    #[command(subcommand)]
    pub scenario: Scenario,
}

/// The benchmark scenarios.
#[derive(Debug, Subcommand)]
pub enum Scenario {
    /// The machine's limits: cold memcpy, O_DIRECT sequential write/read,
    /// TCP and raw QUIC loopback.
    Limits(limits::LimitsArgs),
    /// PUT / GET / LOOKUP through the native socket + shared memory (RAM
    /// and disk hits), as ratios to the limits measured in the same run.
    Local(local::LocalArgs),
    /// The same chunk workload over RESP: kvtier vs redis-server vs the
    /// LMCache server, as ratios to kvtier.
    Vs(vs::VsArgs),
    /// kill -9 torture: wrong reads, phantom chunks, flushed survival.
    Crash(crash::CrashArgs),
    /// PUT p99 while the disk writer is busy vs idle (saturated when it
    /// writes ≥ 90 % of the phase); bytes written while idle.
    Churn(churn::ChurnArgs),
    /// The seed scenario in miniature: 2 ranks, 2 daemons with peers,
    /// restart, cluster lookup and full restore from disk and from a peer.
    Restore(restore::RestoreArgs),
    /// Two-rank write and restore through running daemons (the driver of
    /// `scripts/cluster-demo`).
    TwoRank(restore::TwoRankArgs),
}

/// Options every scenario has.
#[derive(Debug, Args, Clone, Default)]
pub struct CommonArgs {
    /// Also write the results as JSON to this file (its directory is
    /// checked before the run).
    #[arg(long, value_name = "FILE", value_parser = parse_json_path)]
    pub json: Option<PathBuf>,
    /// An existing directory (on the filesystem to measure) in which the
    /// bench creates its scratch dir for data dirs and sockets, removed at
    /// the end. Default: $TMPDIR.
    #[arg(long, value_name = "DIR", value_parser = parse_dir)]
    pub dir: Option<PathBuf>,
}

/// Runs a `kvtier bench` scenario; returns the exit code (1 when a
/// correctness check of the scenario failed).
pub fn run(args: &BenchArgs) -> Result<u8> {
    undo_on_signals();
    match &args.scenario {
        Scenario::Limits(a) => limits::run(a),
        Scenario::Local(a) => local::run(a),
        Scenario::Vs(a) => vs::run(a),
        Scenario::Crash(a) => crash::run(a),
        Scenario::Churn(a) => churn::run(a),
        Scenario::Restore(a) => restore::run(a),
        Scenario::TwoRank(a) => restore::run_two_rank(a),
    }
}

/// What a bench stopped by a signal leaves behind unless it is undone: its
/// scratch dirs and the processes it started (daemons, redis-server, the
/// LMCache server). Each is listed while it exists.
struct Undo {
    dirs: Vec<PathBuf>,
    pids: Vec<u32>,
}

static UNDO: std::sync::Mutex<Undo> = std::sync::Mutex::new(Undo {
    dirs: Vec::new(),
    pids: Vec::new(),
});

fn undo() -> std::sync::MutexGuard<'static, Undo> {
    UNDO.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Spawns `cmd` listed among the children a signal kills, under the list's
/// lock: a signal's clean-up runs wholly before the spawn (which then never
/// happens: the process exits) or after the pid is listed. A child spawned
/// but not yet listed lived on through the clean-up and recreated the
/// scratch dir just removed (QA: `bench crash` stopped by SIGTERM left its
/// `e0` data dir about one time in thirty).
pub(crate) fn spawn_tracked(cmd: &mut Command) -> std::io::Result<Child> {
    let mut undo = undo();
    let child = cmd.spawn()?;
    undo.pids.push(child.id());
    Ok(child)
}

/// SIGKILLs a listed child, then reaps it and takes it off the list under
/// the list's lock (it stays listed until it is gone: a signal's clean-up
/// that came meanwhile kills it too, and removes the scratch dir only once
/// it can no longer write there).
pub(crate) fn kill_and_reap(child: &mut Child) {
    let _ = child.kill();
    let mut undo = undo();
    let _ = child.wait();
    let pid = child.id();
    undo.pids.retain(|&p| p != pid);
}

/// [`std::process::Child::try_wait`] for a listed child: reaped and taken
/// off the list under the list's lock, so a signal's clean-up (which kills
/// the listed pids under that lock) never reaches a pid reaped and reused
/// meanwhile.
pub(crate) fn try_reap(
    child: &mut std::process::Child,
) -> std::io::Result<Option<std::process::ExitStatus>> {
    let mut undo = undo();
    let status = child.try_wait()?;
    if status.is_some() {
        let pid = child.id();
        undo.pids.retain(|&p| p != pid);
    }
    Ok(status)
}

/// The signals [`undo_on_signals`] takes.
const UNDO_SIGNALS: [libc::c_int; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];

/// A command for a child process of the bench, with the signals the bench
/// blocks unblocked again (a signal mask is inherited through exec: its
/// daemons ignored the SIGTERM of a graceful stop).
pub(crate) fn command(program: impl AsRef<std::ffi::OsStr>) -> Command {
    use std::os::unix::process::CommandExt;
    let mut cmd = Command::new(program);
    let set = undo_sigset();
    let bench = std::process::id();
    // SAFETY: between fork and exec only pthread_sigmask, prctl and getppid,
    // all async-signal-safe, are called, on values built before the fork.
    unsafe {
        cmd.pre_exec(move || {
            libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
            // A bench that dies without its clean-up (SIGKILL, an abort)
            // takes its children with it (QA: its daemons lived on with
            // parent 1). The signal follows the thread that forked: the
            // bench starts its children from its main thread only.
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            if u32::try_from(libc::getppid()).ok() != Some(bench) {
                return Err(std::io::Error::other("the bench exited during the start"));
            }
            Ok(())
        });
    }
    cmd
}

/// The set of [`UNDO_SIGNALS`].
fn undo_sigset() -> libc::sigset_t {
    // SAFETY: sigset_t is plain data; sigemptyset/sigaddset initialise it.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for sig in UNDO_SIGNALS {
            libc::sigaddset(&mut set, sig);
        }
        set
    }
}

/// Runs `cmd` to its end and collects its output ([`Command::output`]),
/// listed among the processes a signal kills meanwhile (an LMCache driver
/// outlived a stopped `bench vs`, with parent pid 1).
pub(crate) fn output(cmd: &mut Command) -> std::io::Result<std::process::Output> {
    use std::io::Read;
    let mut child = spawn_tracked(cmd.stdout(Stdio::piped()).stderr(Stdio::piped()))?;
    let (mut out, mut err) = (child.stdout.take(), child.stderr.take());
    let read_all = |pipe: &mut Option<std::process::ChildStdout>| {
        let mut buf = Vec::new();
        pipe.as_mut().map(|p| p.read_to_end(&mut buf));
        buf
    };
    let (stdout, stderr) = std::thread::scope(|s| {
        let e = s.spawn(|| {
            let mut buf = Vec::new();
            err.as_mut().map(|p| p.read_to_end(&mut buf));
            buf
        });
        let o = read_all(&mut out);
        (o, e.join().unwrap_or_default())
    });
    // Its output ended: it is exiting. Reaped under the list's lock.
    let status = loop {
        if let Some(status) = try_reap(&mut child)? {
            break status;
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    Ok(std::process::Output {
        status,
        stdout,
        stderr,
    })
}

/// SIGINT, SIGTERM and SIGHUP stop a bench cleanly: they are blocked in
/// every thread (this runs before the bench starts any) and taken by one
/// thread, which kills the processes the bench started, removes its scratch
/// dirs and exits with 128 + the signal. Before, a Ctrl-C or `kill` left a
/// daemon running (parent pid 1) and up to gigabytes of scratch data.
/// Children are spawned through [`command`], which unblocks them again.
fn undo_on_signals() {
    let set = undo_sigset();
    // SAFETY: pthread_sigmask only reads the initialised set.
    unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
    let spawned = std::thread::Builder::new()
        .name("kvtier-bench-signals".into())
        .spawn(move || {
            let mut sig: libc::c_int = 0;
            // SAFETY: `set` is initialised; `sig` is a valid out pointer.
            if unsafe { libc::sigwait(&set, &mut sig) } != 0 {
                return;
            }
            let u = undo();
            for &pid in &u.pids {
                if let Ok(pid) = libc::pid_t::try_from(pid) {
                    // SAFETY: kill(2) and waitpid(2) have no memory-safety
                    // preconditions; these are our unreaped children.
                    unsafe {
                        libc::kill(pid, libc::SIGKILL);
                        libc::waitpid(pid, std::ptr::null_mut(), 0);
                    }
                }
            }
            for d in &u.dirs {
                remove_dir_settled(d);
            }
            if u.pids.is_empty() && u.dirs.is_empty() {
                errln!("kvtier bench: stopped by signal {sig}");
            } else {
                errln!(
                    "kvtier bench: stopped by signal {sig}; its processes are killed and its scratch dir removed"
                );
            }
            std::process::exit(128 + sig);
        });
    if let Err(e) = spawned {
        errln!("kvtier bench: no signal thread ({e}); a Ctrl-C may leave its scratch dir behind");
        // SAFETY: as above; unblocks what this function blocked.
        unsafe { libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut()) };
    }
}

/// Removes `dir` for a signal's clean-up, again while something recreates
/// it (the main thread runs on meanwhile: a file it created during the
/// removal failed it with "directory not empty"). Bounded.
fn remove_dir_settled(dir: &Path) {
    for _ in 0..10 {
        let _ = std::fs::remove_dir_all(dir);
        // The main thread's next step either fails (its parent is gone) or
        // recreated something: looked at again after it had time to.
        std::thread::sleep(Duration::from_millis(20));
        if !dir.exists() {
            return;
        }
    }
}

/// A scratch directory `kvtier-bench-TAG-PID`, created in the `--dir`
/// given (which must exist, see [`parse_dir`], and is kept) or in $TMPDIR,
/// and removed with everything in it on drop, on an error's return and by
/// a signal's clean-up.
pub(crate) struct Scratch {
    path: PathBuf,
}

impl Scratch {
    pub(crate) fn new(given: Option<&Path>, tag: &str) -> Result<Self> {
        let parent = given.map_or_else(std::env::temp_dir, Path::to_path_buf);
        let path = parent.join(format!("kvtier-bench-{tag}-{}", std::process::id()));
        if path.exists() {
            std::fs::remove_dir_all(&path)
                .with_context(|| format!("remove stale scratch dir {}", path.display()))?;
        }
        // Created and listed under the list's lock (a signal's clean-up
        // sees it listed once it exists), and never its parents: those are
        // the user's (`--dir`) and would be left behind.
        let mut undo = undo();
        std::fs::create_dir(&path)
            .with_context(|| format!("create scratch dir {}", path.display()))?;
        undo.dirs.push(path.clone());
        Ok(Self { path })
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
        undo().dirs.retain(|d| d != &self.path);
    }
}

/// A `kvtier node start` child process started by the bench.
pub(crate) struct Daemon {
    child: Option<Child>,
    args: Vec<String>,
    env: Vec<(String, String)>,
    /// The data dir.
    pub data_dir: PathBuf,
    /// The native socket.
    pub socket: PathBuf,
    /// Bound RESP address, if enabled.
    pub resp: Option<SocketAddr>,
    /// Bound HTTP address, if enabled.
    pub http: Option<SocketAddr>,
    log: PathBuf,
}

/// Settings of a daemon the bench starts.
#[derive(Clone, Debug)]
pub(crate) struct DaemonSpec {
    pub ram_budget: String,
    pub disk_budget: String,
    pub resp: bool,
    pub extra: Vec<String>,
    /// Extra `KVTIER_*` environment (keys without a flag, e.g. region size).
    pub env: Vec<(String, String)>,
}

impl Default for DaemonSpec {
    fn default() -> Self {
        Self {
            ram_budget: "256MiB".into(),
            disk_budget: "1GiB".into(),
            resp: false,
            extra: Vec::new(),
            env: Vec::new(),
        }
    }
}

impl Daemon {
    /// Starts a daemon in `dir` (data dir `dir/data`, socket `dir/s.sock`)
    /// and waits until it serves.
    pub(crate) fn start(dir: &Path, spec: &DaemonSpec) -> Result<Self> {
        // Not `create_dir_all`: a scratch dir that a signal's clean-up has
        // just removed is not recreated.
        match std::fs::create_dir(dir) {
            Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => {
                return Err(e).with_context(|| format!("create {}", dir.display()));
            }
            _ => {}
        }
        let data_dir = dir.join("data");
        let socket = dir.join("s.sock");
        let s = |p: &Path| p.to_string_lossy().into_owned();
        let mut args: Vec<String> = vec![
            "node".into(),
            "start".into(),
            "--data-dir".into(),
            s(&data_dir),
            "--socket".into(),
            s(&socket),
            "--ram-budget".into(),
            spec.ram_budget.clone(),
            "--disk-budget".into(),
            spec.disk_budget.clone(),
            "--resp-listen".into(),
            if spec.resp {
                "127.0.0.1:0".into()
            } else {
                "off".into()
            },
            "--http-listen".into(),
            "127.0.0.1:0".into(),
            "--log-format".into(),
            "json".into(),
            "--log-level".into(),
            "warn".into(),
        ];
        args.extend(spec.extra.iter().cloned());
        let mut d = Daemon {
            child: None,
            args,
            env: spec.env.clone(),
            data_dir,
            socket,
            resp: None,
            http: None,
            log: dir.join("daemon.log"),
        };
        d.spawn()?;
        Ok(d)
    }

    /// (Re)starts the process with the same arguments and waits until it
    /// serves (its LOCK file says ready with its pid).
    pub(crate) fn spawn(&mut self) -> Result<()> {
        if self.child.is_some() {
            bail!("daemon already running");
        }
        let exe = std::env::current_exe().context("find the kvtier binary")?;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .with_context(|| format!("open {}", self.log.display()))?;
        let mut cmd = command(exe);
        for (k, _) in std::env::vars_os() {
            if k.to_string_lossy().starts_with("KVTIER_") {
                cmd.env_remove(k);
            }
        }
        cmd.envs(self.env.iter().map(|(k, v)| (k, v)));
        cmd.args(&self.args)
            .stdin(Stdio::null())
            .stdout(log.try_clone().context("dup log file")?)
            .stderr(log);
        let child = spawn_tracked(&mut cmd).context("spawn `kvtier node start`")?;
        let pid = child.id();
        self.child = Some(child);
        let t0 = Instant::now();
        loop {
            if let Some(status) = try_reap(self.child_mut()).context("wait for the daemon")? {
                self.child = None;
                bail!(
                    "the daemon exited during start-up with {status}; log {}:\n{}",
                    self.log.display(),
                    self.log_tail()
                );
            }
            if let Some(info) = read_lock(&self.data_dir)
                && info.pid == pid
                && info.ready
            {
                self.resp = info.resp;
                self.http = info.http;
                return Ok(());
            }
            if t0.elapsed() > DAEMON_DEADLINE {
                self.kill9();
                bail!("the daemon was not ready within {DAEMON_DEADLINE:?}");
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn child_mut(&mut self) -> &mut Child {
        self.child.as_mut().expect("daemon is running")
    }

    /// The last lines of the daemon's log.
    pub(crate) fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    /// SIGKILL and reap (no-op when not running).
    pub(crate) fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            kill_and_reap(&mut child);
        }
    }

    /// SIGTERM (a graceful, flushing shutdown) and wait, bounded.
    pub(crate) fn stop(&mut self) -> Result<()> {
        let Some(child) = self.child.as_mut() else {
            return Ok(());
        };
        let pid = libc::pid_t::try_from(child.id()).context("pid fits pid_t")?;
        // SAFETY: kill(2) has no memory-safety preconditions; `pid` is our
        // unreaped child.
        unsafe { libc::kill(pid, libc::SIGTERM) };
        let t0 = Instant::now();
        loop {
            if let Some(status) = try_reap(self.child_mut()).context("wait for the daemon")? {
                self.child = None;
                if !status.success() {
                    bail!(
                        "the daemon exited with {status} after SIGTERM:\n{}",
                        self.log_tail()
                    );
                }
                return Ok(());
            }
            if t0.elapsed() > DAEMON_DEADLINE {
                self.kill9();
                bail!("the daemon did not exit within {DAEMON_DEADLINE:?} of SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// A native client connected to this daemon.
    pub(crate) fn client(&self) -> Result<Client> {
        Client::connect(&self.socket).context("connect to the bench daemon")
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill9();
    }
}

fn read_lock(data_dir: &Path) -> Option<LockInfo> {
    let text = std::fs::read_to_string(data_dir.join(node::daemon::LOCK_FILE)).ok()?;
    serde_json::from_str(&text).ok()
}

/// The namespace record the benches write under.
pub(crate) fn bench_record(tp_size: u32, rank: u32, salt: &str) -> NamespaceRecord {
    NamespaceRecord {
        model: "kvtier-bench/synthetic-70b".into(),
        model_revision: "1".into(),
        engine: "kvtier-bench".into(),
        engine_version: env!("CARGO_PKG_VERSION").into(),
        tp_size,
        rank,
        kv_dtype: "bfloat16".into(),
        block_size: 16,
        chunk_tokens: 16,
        hash_algo: "splitmix64".into(),
        layout: "synthetic".into(),
        format_version: 1,
        salt: salt.into(),
        info: Default::default(),
    }
}

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A deterministic 32-byte key for (`tag`, `i`).
pub(crate) fn bench_key(tag: u64, i: u64) -> ChunkKey {
    let mut s = tag.wrapping_mul(0x1000_0000_01B3) ^ i.wrapping_mul(0x9E37_79B9);
    let mut k = [0u8; 32];
    for w in k.chunks_exact_mut(8) {
        w.copy_from_slice(&splitmix(&mut s).to_le_bytes());
    }
    ChunkKey(k)
}

/// Fills `buf` with the deterministic payload of `key` (so any read can be
/// checked byte for byte).
pub(crate) fn fill_payload(key: &ChunkKey, buf: &mut [u8]) {
    let mut s = u64::from_le_bytes(key.0[..8].try_into().expect("8 bytes"));
    let mut words = buf.chunks_exact_mut(8);
    for w in &mut words {
        w.copy_from_slice(&splitmix(&mut s).to_le_bytes());
    }
    let rest = words.into_remainder();
    let last = splitmix(&mut s).to_le_bytes();
    let n = rest.len();
    rest.copy_from_slice(&last[..n]);
}

/// The deterministic payload of `key`, `len` bytes.
#[cfg(test)]
pub(crate) fn payload(key: &ChunkKey, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    fill_payload(key, &mut v);
    v
}

/// Latency summary of an hdrhistogram in nanoseconds.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub(crate) struct Lat {
    pub count: u64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub max_us: f64,
}

/// Fewest samples for a p99 that is not just the slowest one or two.
pub(crate) const P99_MIN_SAMPLES: u64 = 200;

/// A p99 for a table: marked `*` when it rests on fewer than
/// [`P99_MIN_SAMPLES`] samples (then it is about the maximum: audit).
pub(crate) fn p99_cell(p99_us: f64, count: u64) -> String {
    if count < P99_MIN_SAMPLES {
        format!("{p99_us:.1}*")
    } else {
        format!("{p99_us:.1}")
    }
}

/// The note under a table with starred p99s.
pub(crate) const P99_NOTE: &str =
    "* p99 of fewer than 200 samples: about the slowest of them, not a tail percentile";

pub(crate) fn new_hist() -> hdrhistogram::Histogram<u64> {
    hdrhistogram::Histogram::new_with_bounds(1, 120_000_000_000, 3).expect("valid bounds")
}

pub(crate) fn record(h: &mut hdrhistogram::Histogram<u64>, d: Duration) {
    let ns = u64::try_from(d.as_nanos())
        .unwrap_or(u64::MAX)
        .clamp(1, 120_000_000_000);
    h.record(ns).expect("value within bounds");
}

impl Lat {
    pub(crate) fn of(h: &hdrhistogram::Histogram<u64>) -> Self {
        Self {
            count: h.len(),
            p50_us: h.value_at_quantile(0.5) as f64 / 1e3,
            p99_us: h.value_at_quantile(0.99) as f64 / 1e3,
            max_us: h.max() as f64 / 1e3,
        }
    }
}

/// GB/s (10^9 bytes per second).
pub(crate) fn gbps(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64().max(1e-9) / 1e9
}

/// A progress bar on stderr (hidden when stderr is not a terminal).
pub(crate) fn bar(len: u64, msg: &str) -> indicatif::ProgressBar {
    let pb = indicatif::ProgressBar::new(len);
    pb.set_style(
        indicatif::ProgressStyle::with_template("{msg:>28} [{bar:30}] {pos}/{len} {elapsed}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    pb.set_message(msg.to_owned());
    pb
}

/// Exact size of a chunk for labels: "256KiB", "2.5MiB", "1.125MiB",
/// "1000B", "1028KiB". MiB with up to three decimals where that is exact,
/// else the largest unit that divides it (a 1000-byte size was "0KiB", and
/// 1.25 MiB "1.2MiB").
pub(crate) fn size_name(b: u64) -> String {
    const MIB: u64 = 1 << 20;
    // b / 2^20 has at most three decimals exactly when 2^17 divides b.
    if b >= MIB && b % (MIB >> 3) == 0 {
        let mib = format!("{:.3}", b as f64 / MIB as f64);
        format!("{}MiB", mib.trim_end_matches('0').trim_end_matches('.'))
    } else {
        node::ByteSize(b).to_string()
    }
}

/// The chunk sizes of the issue: 256 KiB, 1 MiB, 2.5 MiB (a 16-token block
/// of a 70B-class model per rank), 4 MiB.
pub(crate) const CHUNK_SIZES: [u64; 4] = [256 << 10, 1 << 20, 5 << 19, 4 << 20];

/// Parses one size ("2.5MiB") into bytes.
pub(crate) fn parse_size(s: &str) -> Result<u64, String> {
    parse_bytes(s).map(|b| b.0)
}

/// A `--json` file whose directory exists and is writable: checked before
/// a run of minutes, not after it. `-` is refused (the table goes to stdout).
fn parse_json_path(s: &str) -> Result<PathBuf, String> {
    if s == "-" {
        return Err("give a file name: the table goes to stdout".into());
    }
    if s.is_empty() {
        return Err("give a file name".into());
    }
    let path = PathBuf::from(s);
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    if path.is_dir() {
        return Err(format!("{s} is a directory"));
    }
    if !dir.is_dir() {
        return Err(format!("{} is not a directory", dir.display()));
    }
    let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes())
        .map_err(|_| format!("{s}: a NUL byte in the path"))?;
    // SAFETY: access(2) reads the NUL-terminated path only.
    if unsafe { libc::access(c.as_ptr(), libc::W_OK) } != 0 {
        return Err(format!("cannot write in {}", dir.display()));
    }
    Ok(path)
}

/// A `--dir` that exists, is a directory and is writable: a missing one
/// was created with its missing parents, which stayed after the run (a
/// misspelt path put gigabytes of scratch data somewhere unexpected).
fn parse_dir(s: &str) -> Result<PathBuf, String> {
    if s.is_empty() {
        return Err("give a directory".into());
    }
    let path = PathBuf::from(s);
    match std::fs::metadata(&path) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => return Err(format!("{s} is not a directory")),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(format!(
                "{s}: no such directory (the bench creates none but its own scratch dir in it)"
            ));
        }
        Err(e) => return Err(format!("{s}: {e}")),
    }
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| format!("{s}: a NUL byte in the path"))?;
    // SAFETY: access(2) reads the NUL-terminated path only.
    if unsafe { libc::access(c.as_ptr(), libc::W_OK | libc::X_OK) } != 0 {
        return Err(format!("cannot write in {s}"));
    }
    Ok(path)
}

/// A size of at least one byte (a bench of 0-byte chunks or pools divides
/// by zero).
pub(crate) fn parse_bytes(s: &str) -> Result<node::ByteSize, String> {
    match s.trim().parse::<node::ByteSize>() {
        Ok(b) if b.0 == 0 => Err(format!("{s:?}: must be at least 1 byte")),
        Ok(b) => Ok(b),
        Err(e) => Err(format!("{s:?}: {e}")),
    }
}

/// A duration longer than zero (an empty phase prints figures of nothing).
pub(crate) fn parse_duration(s: &str) -> Result<node::HumanDuration, String> {
    match s.trim().parse::<node::HumanDuration>() {
        Ok(d) if d.0.is_zero() => Err(format!("{s:?}: must be longer than 0s")),
        Ok(d) => Ok(d),
        Err(e) => Err(format!("{s:?}: {e}")),
    }
}

/// A count of at least one.
pub(crate) fn parse_count<T>(s: &str) -> Result<T, String>
where
    T: std::str::FromStr + Default + PartialEq,
    T::Err: std::fmt::Display,
{
    match s.trim().parse::<T>() {
        Ok(n) if n == T::default() => Err(format!("{s:?}: must be at least 1")),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("{s:?}: {e}")),
    }
}

/// Parses "256KiB,1MiB" into bytes.
#[cfg(test)]
pub(crate) fn parse_sizes(s: &str) -> Result<Vec<u64>, String> {
    s.split(',')
        .map(|p| {
            p.trim()
                .parse::<node::ByteSize>()
                .map(|b| b.0)
                .map_err(|e| format!("{p:?}: {e}"))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_are_deterministic_and_key_specific() {
        let (a, b) = (bench_key(1, 1), bench_key(1, 2));
        assert_ne!(a, b);
        assert_eq!(payload(&a, 1000), payload(&a, 1000));
        assert_ne!(payload(&a, 1000), payload(&b, 1000));
        assert_eq!(payload(&a, 13).len(), 13);
    }

    #[test]
    fn sizes_parse_and_name() {
        assert_eq!(
            parse_sizes("256KiB, 2.5MiB").unwrap(),
            vec![256 << 10, 5 << 19]
        );
        assert!(parse_sizes("12XB").is_err());
        assert_eq!(size_name(5 << 19), "2.5MiB");
        assert_eq!(size_name(256 << 10), "256KiB");
        assert_eq!(size_name(4 << 20), "4MiB");
    }

    /// Labels name the exact size: sizes that are not whole KiB were
    /// printed rounded down ("0KiB" for 1000 bytes) and MiB rounded to
    /// one decimal ("1.2MiB" for 1.25 MiB, "1.0MiB" for 1 MiB + 4 KiB).
    #[test]
    fn size_names_are_exact() {
        for (b, name) in [
            (1000, "1000B"),
            (1, "1B"),
            (1536, "1536B"),
            (4 << 10, "4KiB"),
            (1000 << 10, "1000KiB"),
            ((1 << 20) + 4096, "1028KiB"),
            ((1 << 20) + 1, "1048577B"),
            (5 << 18, "1.25MiB"),
            (9 << 17, "1.125MiB"),
            (3 << 19, "1.5MiB"),
            (1 << 30, "1024MiB"),
        ] {
            assert_eq!(size_name(b), name, "{b} bytes");
            // A label reads back as the size it names.
            assert_eq!(parse_size(name), Ok(b), "{name}");
        }
    }

    /// Values that divided by zero, sliced past a pool, printed figures of
    /// nothing, or were found wrong only after a run, are usage errors.
    #[test]
    fn zero_sizes_counts_and_unwritable_json_paths_are_refused() {
        assert!(parse_size("0").unwrap_err().contains("at least 1 byte"));
        assert_eq!(parse_size("1MiB"), Ok(1 << 20));
        assert!(parse_bytes("0B").is_err());
        assert!(
            parse_count::<usize>("0")
                .unwrap_err()
                .contains("at least 1")
        );
        assert_eq!(parse_count::<u32>("3"), Ok(3));
        assert!(parse_count::<u32>("-1").is_err());
        assert!(parse_duration("0s").is_err());
        assert!(parse_duration("2s").is_ok());
        assert!(parse_json_path("-").is_err());
        assert!(parse_json_path("").is_err());
        assert!(parse_json_path("/nonexistent-dir/x.json").is_err());
        let dir = std::env::temp_dir();
        assert!(parse_json_path(&dir.to_string_lossy()).is_err());
        let ok = dir.join("kvtier-bench-test-r.json");
        assert_eq!(parse_json_path(&ok.to_string_lossy()), Ok(ok));
    }

    /// A `--dir` must exist: a missing one (and its missing parents) was
    /// created and left behind.
    #[test]
    fn a_dir_that_does_not_exist_or_is_a_file_is_refused() {
        let tmp = std::env::temp_dir();
        assert_eq!(parse_dir(&tmp.to_string_lossy()), Ok(tmp.clone()));
        let missing = tmp.join(format!("kvtier-bench-no-such-{}/x", std::process::id()));
        let e = parse_dir(&missing.to_string_lossy()).unwrap_err();
        assert!(e.contains("no such directory"), "{e}");
        assert!(e.contains(&*missing.to_string_lossy()), "{e}");
        let file = tmp.join(format!("kvtier-bench-dir-file-{}", std::process::id()));
        std::fs::write(&file, b"").unwrap();
        let e = parse_dir(&file.to_string_lossy()).unwrap_err();
        let _ = std::fs::remove_file(&file);
        assert!(e.contains("is not a directory"), "{e}");
        assert!(parse_dir("").is_err());
    }
}
