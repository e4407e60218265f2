//! Helpers for multi-process tests that start real `kvtier` daemons.
//!
//! [`Daemon::start`] runs the `kvtier` binary (built by `scripts/test`
//! before the tests, or named by `KVTIER_BIN`) with its own data dir and
//! socket in a temp dir, RESP and HTTP on `127.0.0.1:0`, and waits until the
//! daemon has recorded itself as ready in `data_dir/LOCK` (its pid, socket
//! and bound ports). Every wait is bounded; a daemon still running when its
//! [`Daemon`] is dropped is killed by pid.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

use node::daemon::LockInfo;
use node::native::Client;

/// How long a daemon may take to start or stop in tests.
pub const DEADLINE: Duration = Duration::from_secs(60);

/// The `kvtier` binary: `$KVTIER_BIN`, else `kvtier` next to the test
/// binary's `deps/` directory (`target/<profile>/kvtier`).
pub fn kvtier_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("KVTIER_BIN") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("path of the test binary");
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("test binary lives in target/<profile>/deps");
    let bin = profile_dir.join("kvtier");
    assert!(
        bin.exists(),
        "{} does not exist: build it first (`cargo build --bin kvtier`, done by scripts/test) \
         or set KVTIER_BIN",
        bin.display()
    );
    bin
}

/// A `kvtier` command with every `KVTIER_*` variable of the test
/// environment removed (so that only what the test sets applies).
pub fn kvtier_command() -> Command {
    let mut cmd = Command::new(kvtier_bin());
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("KVTIER_") {
            cmd.env_remove(k);
        }
    }
    cmd.env("RUST_BACKTRACE", "0");
    // Test stores are small and preallocated; they must also start on a
    // nearly full disk (CI machines have been seen with 258 MiB free), so
    // no space is held back beyond each store's own budget.
    cmd.env("KVTIER_DISK_RESERVE", "0");
    cmd
}

/// Free bytes (for unprivileged users) on the filesystem holding `dir`.
pub fn free_bytes(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: statvfs is a plain C struct; all zeroes is a valid value.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path and `st` a writable statvfs.
    let rc = unsafe { libc::statvfs(c.as_ptr(), &mut st) };
    (rc == 0).then(|| st.f_bavail.saturating_mul(st.f_frsize))
}

/// A temporary directory with room for `bytes`: under the system temp dir
/// when its filesystem has that much free (plus 256 MiB), else under
/// `/dev/shm` (tmpfs: the store then takes its buffered-I/O fallback).
/// Panics, saying how much each had, when neither has room.
pub fn tempdir_with_room(bytes: u64) -> tempfile::TempDir {
    let need = bytes + (256 << 20);
    let tmp = std::env::temp_dir();
    let shm = Path::new("/dev/shm");
    let tmp_free = free_bytes(&tmp);
    if tmp_free.is_some_and(|f| f >= need) {
        return tempfile::tempdir().expect("temp dir");
    }
    let shm_free = free_bytes(shm);
    if shm_free.is_some_and(|f| f >= need) {
        eprintln!(
            "{} has {:?} bytes free, under the {need} this test needs: using {}",
            tmp.display(),
            tmp_free,
            shm.display()
        );
        return tempfile::tempdir_in(shm).expect("temp dir in /dev/shm");
    }
    panic!(
        "this test needs {need} bytes of free space: {} has {tmp_free:?}, {} has {shm_free:?}",
        tmp.display(),
        shm.display()
    );
}

/// Runs `kvtier ARGS...` to completion (bounded by [`DEADLINE`]).
pub fn run_kvtier(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = kvtier_command();
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let child = cmd.spawn().expect("spawn kvtier");
    let pid = child.id();
    // Output is collected on a thread so that the wait can be bounded.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(DEADLINE) {
        Ok(out) => out.expect("wait for kvtier"),
        Err(_) => {
            signal(pid, libc::SIGKILL);
            panic!(
                "`kvtier {}` did not finish within {DEADLINE:?}",
                args.join(" ")
            );
        }
    }
}

/// Sends `sig` to `pid` (a process this test started).
pub fn signal(pid: u32, sig: libc::c_int) {
    let pid = libc::pid_t::try_from(pid).expect("pid fits pid_t");
    // SAFETY: kill(2) has no memory-safety preconditions; `pid` is a child
    // this test spawned and has not reaped yet.
    let rc = unsafe { libc::kill(pid, sig) };
    assert_eq!(
        rc,
        0,
        "kill({pid}, {sig}): {}",
        std::io::Error::last_os_error()
    );
}

/// Stops `pid` (a process this test started) with `SIGSTOP` and waits, up
/// to 5 s, until every one of its threads is stopped: the signal is
/// delivered to each thread as it next runs, so under load a thread could
/// still answer a request sent right after `kill` returned.
pub fn freeze(pid: u32) {
    signal(pid, libc::SIGSTOP);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        if all_threads_stopped(pid) {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "process {pid} not stopped 5 s after SIGSTOP"
        );
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
}

/// Whether every thread of `pid` is in state `T` (stopped) in `/proc`.
fn all_threads_stopped(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks.flatten().all(|t| {
        std::fs::read_to_string(t.path().join("stat")).is_ok_and(|stat| {
            // The state follows the command name, which is in parentheses
            // and may itself contain spaces or parentheses.
            stat.rsplit_once(") ")
                .is_some_and(|(_, rest)| rest.starts_with(['T', 't', 'Z', 'X']))
        })
    })
}

/// A running `kvtier node start` process.
pub struct Daemon {
    child: Option<Child>,
    /// The data dir.
    pub data_dir: PathBuf,
    /// The native socket.
    pub socket: PathBuf,
    /// The bound RESP address, if enabled.
    pub resp: Option<std::net::SocketAddr>,
    /// The bound HTTP address, if enabled.
    pub http: Option<std::net::SocketAddr>,
    log: PathBuf,
}

/// The size flags of a test daemon's store; offline commands (`verify`,
/// `namespaces`, `gc`) on its data dir pass the same.
pub const TEST_STORE: [&str; 4] = ["--disk-budget", "32MiB", "--region-size", "4MiB"];

/// Arguments for a small test daemon: its data dir and socket under `dir`,
/// 64 MiB RAM, 32 MiB disk in 4 MiB regions, ephemeral ports, JSON logs.
pub fn test_args(dir: &Path) -> Vec<String> {
    let s = |p: PathBuf| p.to_string_lossy().into_owned();
    vec![
        "node".into(),
        "start".into(),
        "--data-dir".into(),
        s(dir.join("data")),
        "--socket".into(),
        s(dir.join("kvtier.sock")),
        "--ram-budget".into(),
        "64MiB".into(),
        "--resp-listen".into(),
        "127.0.0.1:0".into(),
        "--http-listen".into(),
        "127.0.0.1:0".into(),
        "--log-format".into(),
        "json".into(),
        "--shutdown-deadline".into(),
        "30s".into(),
    ]
    .into_iter()
    .chain(TEST_STORE.map(String::from))
    .collect()
}

/// `GET path` from a daemon's HTTP listener: the whole response, headers
/// included.
pub fn http_get(addr: std::net::SocketAddr, path: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("connect http");
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .expect("write");
    let mut out = String::new();
    s.read_to_string(&mut out).expect("read");
    out
}

/// The value of the unlabelled Prometheus sample `name` in `metrics`.
pub fn metric(metrics: &str, name: &str) -> Option<f64> {
    metrics.lines().find_map(|l| {
        let (n, v) = l.split_once(' ')?;
        (n == name).then(|| v.trim().parse().ok())?
    })
}

/// Sets `flag`'s value in `args` (appending the flag if it is absent).
pub fn set_flag(args: &mut Vec<String>, flag: &str, value: &str) {
    match args.iter().position(|a| a == flag) {
        Some(i) if i + 1 < args.len() => args[i + 1] = value.to_string(),
        _ => args.extend([flag.to_string(), value.to_string()]),
    }
}

impl Daemon {
    /// Starts a daemon with [`test_args`] in `dir` plus `extra` arguments
    /// and `env`, and waits until it serves. On failure, returns the
    /// daemon's exit status and log.
    pub fn start(dir: &Path, extra: &[&str], env: &[(&str, &str)]) -> Result<Daemon, String> {
        let mut args = test_args(dir);
        args.extend(extra.iter().map(|s| s.to_string()));
        Self::start_args(dir, &args, env)
    }

    /// Starts `kvtier ARGS` (which must include `--data-dir DIR/data` and
    /// `--socket`) and waits until it serves.
    pub fn start_args(dir: &Path, args: &[String], env: &[(&str, &str)]) -> Result<Daemon, String> {
        Self::start_wrapped(dir, &[], args, env)
    }

    /// [`Daemon::start_args`] with `kvtier` run through `wrapper` (e.g.
    /// `ip netns exec NAME`, which execs it: the pid stays the daemon's).
    pub fn start_wrapped(
        dir: &Path,
        wrapper: &[&str],
        args: &[String],
        env: &[(&str, &str)],
    ) -> Result<Daemon, String> {
        let data_dir = PathBuf::from(flag_value(args, "--data-dir").expect("--data-dir"));
        let socket = PathBuf::from(flag_value(args, "--socket").expect("--socket"));
        let log = dir.join(format!("daemon-{}.log", unique()));
        let log_file = std::fs::File::create(&log).map_err(|e| e.to_string())?;
        let mut cmd = kvtier_command();
        if let Some((prog, rest)) = wrapper.split_first() {
            let mut w = Command::new(prog);
            w.args(rest).arg(cmd.get_program());
            for (k, v) in cmd.get_envs() {
                match v {
                    Some(v) => w.env(k, v),
                    None => w.env_remove(k),
                };
            }
            cmd = w;
        }
        cmd.args(args)
            .stdin(Stdio::null())
            .stdout(log_file.try_clone().map_err(|e| e.to_string())?)
            .stderr(log_file);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd.spawn().map_err(|e| format!("spawn kvtier: {e}"))?;
        let pid = child.id();
        let mut d = Daemon {
            child: Some(child),
            data_dir,
            socket,
            resp: None,
            http: None,
            log,
        };
        let t0 = Instant::now();
        loop {
            if let Some(status) = d.child_mut().try_wait().map_err(|e| e.to_string())? {
                d.child = None;
                return Err(format!(
                    "kvtier exited during start-up with {status}; log:\n{}",
                    d.log()
                ));
            }
            if let Some(info) = read_lock(&d.data_dir)
                && info.pid == pid
                && info.ready
            {
                d.resp = info.resp;
                d.http = info.http;
                return Ok(d);
            }
            if t0.elapsed() > DEADLINE {
                return Err(format!(
                    "kvtier not ready within {DEADLINE:?}; log:\n{}",
                    d.log()
                ));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn child_mut(&mut self) -> &mut Child {
        self.child.as_mut().expect("daemon is running")
    }

    /// The daemon's pid.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("daemon is running").id()
    }

    /// Everything the daemon has written to stdout and stderr so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// A native-protocol client connected to this daemon.
    pub fn client(&self) -> Client {
        Client::connect(&self.socket).expect("connect to the daemon's socket")
    }

    /// SIGKILL, then reap.
    pub fn kill9(&mut self) {
        let mut child = self.child.take().expect("daemon is running");
        child.kill().expect("SIGKILL the daemon");
        child.wait().expect("reap the daemon");
    }

    /// Sends `sig` and waits (bounded) for the exit status.
    pub fn stop_with(&mut self, sig: libc::c_int) -> ExitStatus {
        signal(self.pid(), sig);
        self.wait_exit()
    }

    /// Waits (bounded by [`DEADLINE`]) for the daemon to exit.
    pub fn wait_exit(&mut self) -> ExitStatus {
        let t0 = Instant::now();
        loop {
            if let Some(status) = self.child_mut().try_wait().expect("wait for the daemon") {
                self.child = None;
                return status;
            }
            if t0.elapsed() > DEADLINE {
                let log = self.log();
                self.kill9();
                panic!("daemon did not exit within {DEADLINE:?}; log:\n{log}");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn flag_value<'a>(args: &'a [String], flag: &str) -> Option<&'a str> {
    args.iter()
        .position(|a| a == flag)
        .and_then(|i| args.get(i + 1))
        .map(String::as_str)
}

fn unique() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

/// The holder recorded in `data_dir/LOCK`, if readable.
pub fn read_lock(data_dir: &Path) -> Option<LockInfo> {
    let text = std::fs::read_to_string(data_dir.join(node::daemon::LOCK_FILE)).ok()?;
    serde_json::from_str(&text).ok()
}

/// A namespace record for tests (rank `rank` of a made-up model).
pub fn test_record(rank: u32) -> node::tier::NamespaceRecord {
    node::tier::NamespaceRecord {
        model: "kvtier-test/model".into(),
        engine: "kvtier-tests".into(),
        engine_version: "1".into(),
        // Ranks past 1 are distinct namespaces in tests; a rank is below tp-size.
        tp_size: 2.max(rank + 1),
        rank,
        kv_dtype: "bfloat16".into(),
        block_size: 16,
        chunk_tokens: 256,
        hash_algo: "sha256".into(),
        ..Default::default()
    }
}

/// Deterministic chunk bytes for key index `i` in round `round`: a length
/// between 1 KiB and 300 KiB and content that differs per (round, i).
pub fn chunk_bytes(round: u32, i: u32) -> (node::tier::ChunkKey, Vec<u8>) {
    use rand::{Rng, SeedableRng};
    let seed = (u64::from(round) << 32) | u64::from(i);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut key = [0u8; 32];
    rng.fill(&mut key[..]);
    let len = rng.gen_range(1024..300 * 1024);
    let mut data = vec![0u8; len];
    rng.fill(&mut data[..]);
    (node::tier::ChunkKey(key), data)
}

/// Polls `f` every 20 ms until it returns `Some`, for at most `limit`
/// (panics naming `what` when the limit passes).
pub fn poll<T>(what: &str, limit: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let t0 = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            t0.elapsed() < limit,
            "timed out after {limit:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The state of peer `name` in `d`'s STATS document.
pub fn peer_state(d: &Daemon, name: &str) -> Option<String> {
    let doc = d.client().stats().ok()?;
    doc["peers"]
        .as_array()?
        .iter()
        .find(|p| p["name"] == name)
        .and_then(|p| p["state"].as_str().map(str::to_owned))
}

/// LOOKUP on `d` until `key` (group 0) is present, at a peer or locally.
pub fn wait_present(
    d: &Daemon,
    ns: node::tier::Namespace,
    key: node::tier::ChunkKey,
    limit: Duration,
) {
    let mut c = d.client();
    poll("the key to be present", limit, || {
        let r = c.lookup(ns, 0, &[key]).ok()?;
        (r.prefix == 1).then_some(())
    });
}
