//! The daemon's lifecycle: [`run`] (and [`start`] + [`NodeHandle`]) take a
//! [`NodeConfig`], lock the data directory, open the chunk store (rebuilding
//! its index), bind the native socket, the RESP and HTTP listeners, serve
//! until shutdown, then stop the servers, flush dirty chunks within the
//! shutdown deadline and close the store. `run` returns only after every
//! task it started has finished (mini-redis style).
//!
//! Signals are not handled here: the caller passes a shutdown future (the
//! `kvtier` binary maps SIGTERM/SIGINT to it).

use std::fs::File;
use std::future::Future;
use std::io::{Read, Seek};
use std::net::SocketAddr;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use tier::{ChunkStore, FlushReport};
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::config::NodeConfig;
use crate::context::NodeContext;
use crate::error::{NodeError, Result};
use crate::logging::LogFormat;
use crate::size::ByteSize;

/// Name of the lock file in the data directory.
pub const LOCK_FILE: &str = "LOCK";

/// An exclusive `flock` on `data_dir/LOCK`, held by a daemon or by an
/// offline maintenance command (`kvtier verify` / `gc`). The file's content
/// says who holds it (JSON: pid, role, addresses); the lock itself is
/// released by the kernel when the process dies, so a stale file never
/// blocks a restart.
#[derive(Debug)]
pub struct DataDirLock {
    file: File,
    path: PathBuf,
}

/// What the lock file records about its holder.
#[derive(Clone, Debug, Default, Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct LockInfo {
    /// Process id of the holder.
    pub pid: u32,
    /// "daemon" or the maintenance command.
    pub role: String,
    /// The native socket (daemons only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub socket: Option<PathBuf>,
    /// The bound RESP address (daemons only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resp: Option<SocketAddr>,
    /// The bound HTTP address (daemons only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http: Option<SocketAddr>,
    /// Whether the holder is serving (false while still starting).
    #[serde(default)]
    pub ready: bool,
}

impl LockInfo {
    /// The holder, for messages: a default record (pid 0) stands for one
    /// that is empty or unreadable.
    pub fn describe(&self) -> String {
        match self.pid {
            0 => "another process (its LOCK record is empty or unreadable: a daemon or command \
                  still starting, or one that could not write it, e.g. on a full filesystem)"
                .into(),
            pid if self.role == "daemon" => format!(
                "a running kvtier daemon (pid {pid}{})",
                self.socket
                    .as_ref()
                    .map(|s| format!(", socket {}", s.display()))
                    .unwrap_or_default()
            ),
            pid => format!("`kvtier {}` (pid {pid})", self.role),
        }
    }
}

/// The holder record of a LOCK file: its first line. A rewrite writes over
/// the old record and then cuts it, so a reader in between may see the new
/// line followed by the old one's tail.
fn parse_record(text: &str) -> serde_json::Result<LockInfo> {
    serde_json::from_str(text.lines().next().unwrap_or(""))
}

impl DataDirLock {
    /// Creates `data_dir` if needed and takes its lock without waiting.
    /// Fails with [`NodeError::Locked`] naming the holder when another
    /// process has it.
    pub fn acquire(data_dir: &Path, role: &str) -> Result<Self> {
        tier::store::create_data_dir(data_dir).map_err(|e| NodeError::Io {
            op: "create data dir",
            path: data_dir.to_owned(),
            source: e,
        })?;
        let path = data_dir.join(LOCK_FILE);
        let mut file = tier::store::open_data_file(
            &path,
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .mode(tier::store::DATA_FILE_MODE),
            0,
        )
        .map_err(|e| NodeError::Io {
            op: "open lock file",
            path: path.clone(),
            source: if e.kind() == std::io::ErrorKind::PermissionDenied {
                std::io::Error::new(
                    e.kind(),
                    format!(
                        "{e}: the data dir's LOCK file must be writable by this user; run as \
                         the daemon's user (e.g. `sudo -u kvtier kvtier ...`), or check a copy \
                         of the data dir"
                    ),
                )
            } else if e.raw_os_error() == Some(libc::EROFS) {
                // The usual state after a disk error (ext4 errors=remount-ro),
                // when `verify` is what the operator runs (QA).
                std::io::Error::new(
                    e.kind(),
                    format!(
                        "{e}: the data dir's filesystem is read-only (after a disk error?); check \
                         a copy: `cp -a --sparse=always DATA_DIR COPY`, then `kvtier verify \
                         --data-dir COPY`"
                    ),
                )
            } else {
                e
            },
        })?;
        tier::store::own_like_dir(&file, data_dir).map_err(|e| NodeError::Io {
            op: "chown lock file",
            path: path.clone(),
            source: e,
        })?;
        match rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => {}
            Err(e) if e == rustix::io::Errno::WOULDBLOCK => {
                let mut text = String::new();
                let _ = file.read_to_string(&mut text);
                return Err(NodeError::Locked {
                    data_dir: data_dir.to_owned(),
                    holder: parse_record(&text).unwrap_or_default().describe(),
                });
            }
            Err(e) => {
                return Err(NodeError::Io {
                    op: "lock",
                    path,
                    source: e.into(),
                });
            }
        }
        let mut lock = Self { file, path };
        lock.write_or_warn(&LockInfo {
            pid: std::process::id(),
            role: role.into(),
            ..Default::default()
        });
        Ok(lock)
    }

    /// Replaces the recorded holder information: written over the old text,
    /// then cut to length. A rewrite thus needs no new block, so it works on
    /// a full filesystem (QA: truncating first freed the block, the write
    /// then failed with ENOSPC and every later start, `verify` and `gc`
    /// refused on the empty file).
    pub fn write(&mut self, info: &LockInfo) -> Result<()> {
        use std::os::unix::fs::FileExt as _;
        let mut text = serde_json::to_string(info).expect("LockInfo serializes");
        text.push('\n');
        let io = |e| NodeError::Io {
            op: "write lock file",
            path: self.path.clone(),
            source: e,
        };
        self.file.write_all_at(text.as_bytes(), 0).map_err(io)?;
        self.file.set_len(text.len() as u64).map_err(io)
    }

    /// [`DataDirLock::write`], with a failure only logged: the `flock` is
    /// what excludes other processes; the text only names the holder to
    /// them (and a full filesystem may refuse a first block for it).
    pub fn write_or_warn(&mut self, info: &LockInfo) {
        if let Err(e) = self.write(info) {
            tracing::warn!(error = %e, "could not record this process in the data dir's LOCK \
                file; others see \"another process\" holding it");
        }
    }

    /// Reads who holds the lock of `data_dir` without taking it: `None` when
    /// nobody does (or the directory has no lock file).
    pub fn holder(data_dir: &Path) -> Option<LockInfo> {
        let path = data_dir.join(LOCK_FILE);
        let mut file =
            tier::store::open_data_file(&path, std::fs::OpenOptions::new().read(true), 0).ok()?;
        match rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockShared) {
            // Nobody holds it exclusively; our shared lock ends with `file`.
            Ok(()) => None,
            Err(_) => {
                // A holder writes its record right after taking the lock:
                // one taken a moment ago is waited for, briefly (QA: two
                // daemons started at once; the loser's message blamed a
                // full filesystem).
                for _ in 0..20 {
                    let mut text = String::new();
                    file.rewind().ok()?;
                    file.read_to_string(&mut text).ok()?;
                    if let Ok(info) = parse_record(&text) {
                        return Some(info);
                    }
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                Some(LockInfo::default())
            }
        }
    }
}

/// The addresses a running node listens on (port 0 resolved).
#[derive(Clone, Debug, Serialize)]
pub struct BoundAddrs {
    /// The native protocol's Unix socket.
    pub socket: PathBuf,
    /// The RESP listener, if enabled.
    pub resp: Option<SocketAddr>,
    /// The HTTP listener, if enabled.
    pub http: Option<SocketAddr>,
    /// The peer layer's QUIC endpoint, if `peer-listen` is set.
    pub peer: Option<SocketAddr>,
}

/// The store of the node that [`run`] serves, for a last word at an
/// abrupt exit ([`unwritten_now`]).
static RUNNING: parking_lot::Mutex<Option<std::sync::Weak<ChunkStore>>> =
    parking_lot::Mutex::new(None);

/// What exiting now would lose, in bytes, of the node that [`run`] serves:
/// chunks not on disk yet (RAM's dirty ones, and those evicted on their
/// way to the disk writer). `None` when no node runs, or its store has no
/// disk (then everything is in RAM by design).
pub fn unwritten_now() -> Option<u64> {
    let store = RUNNING.lock().as_ref()?.upgrade()?;
    let s = store.stats();
    (s.disk_budget > 0).then_some(s.unwritten_bytes())
}

/// What the node found when it started.
#[derive(Clone, Debug, Serialize)]
pub struct StartupInfo {
    /// Crate version.
    pub version: &'static str,
    /// The data directory.
    pub data_dir: PathBuf,
    /// Namespaces known to the store.
    pub namespaces: usize,
    /// Chunks recovered from disk (plus any already in RAM).
    pub chunks: u64,
    /// Payload bytes recovered.
    pub bytes: u64,
    /// Time the store spent rebuilding its index (its `recovery_micros`,
    /// `kvtier_recovery_seconds`).
    pub recovery: Duration,
    /// The whole open of the store: the recovery, and before it the
    /// checks and preallocation of its file (seconds for a new large one).
    pub open: Duration,
    /// Whether the disk store uses O_DIRECT.
    pub direct_io: bool,
    /// RAM budget.
    pub ram_budget: ByteSize,
    /// Disk budget: the store file's bytes (whole regions; 0 without a
    /// disk).
    pub disk_budget: ByteSize,
    /// Regions in the store file and their size (0 without a disk).
    pub disk_regions: u64,
    /// Bytes per region.
    pub region_size: ByteSize,
    /// The largest chunk a put accepts (unnamed): the RAM budget, and with
    /// a disk what one region holds after its headers.
    pub max_chunk: ByteSize,
    /// Where it listens.
    pub addrs: BoundAddrs,
    /// Whether RESP asks for AUTH (`resp-password` set).
    pub resp_auth: bool,
}

impl StartupInfo {
    /// The human start-up summary block.
    pub fn render(&self) -> String {
        let ms = self.recovery.as_secs_f64() * 1e3;
        let open_ms = self.open.as_secs_f64() * 1e3;
        // A new file's preallocation (or a long check) said apart.
        let open = if open_ms >= 10.0 && open_ms >= 2.0 * ms {
            format!(" (store opened in {open_ms:.1} ms with its file's checks and preallocation)")
        } else {
            String::new()
        };
        let mut s = format!(
            "kvtier {} ready\n  data dir   {}\n  store      {} namespace(s), {} chunk(s) ({}) recovered in {ms:.1} ms{open}; \
             RAM budget {}, disk budget {}, direct I/O {}, chunks up to {}\n  native     {}\n",
            self.version,
            self.data_dir.display(),
            self.namespaces,
            self.chunks,
            ByteSize(self.bytes).approx(),
            self.ram_budget.approx(),
            self.disk_summary(),
            if self.direct_io { "on" } else { "off" },
            self.max_chunk.approx_floor(),
            self.addrs.socket.display(),
        );
        match self.addrs.resp {
            Some(a) => s.push_str(&format!(
                "  resp       {a} ({})\n",
                redis_cli_hint(a, self.resp_auth)
            )),
            None => s.push_str("  resp       off\n"),
        }
        match self.addrs.http {
            Some(a) => s.push_str(&format!(
                "  http       http://{a}/metrics  /status  /healthz\n"
            )),
            None => s.push_str("  http       off\n"),
        }
        match self.addrs.peer {
            Some(a) => s.push_str(&format!(
                "  peers      {a} (QUIC; `kvtier peers` lists the cluster)\n"
            )),
            None => s.push_str("  peers      off (single node)\n"),
        }
        s
    }

    /// The disk budget as the store holds it: its size and its regions
    /// (a configured budget that is not a whole number of regions is
    /// rounded down to one).
    fn disk_summary(&self) -> String {
        if self.disk_regions == 0 {
            return "0 B (RAM only)".into();
        }
        format!(
            "{} ({} × {} regions)",
            self.disk_budget.approx(),
            self.disk_regions,
            self.region_size.approx()
        )
    }
}

/// The `redis-cli` command line that reaches a RESP listener on `a`: its
/// default host is 127.0.0.1, so other addresses need `-h` (a wildcard is
/// reached on the loopback address of its family).
fn redis_cli_hint(a: SocketAddr, auth: bool) -> String {
    let ip = a.ip();
    let host = match ip {
        _ if ip == std::net::Ipv4Addr::LOCALHOST || ip == std::net::Ipv4Addr::UNSPECIFIED => None,
        std::net::IpAddr::V6(v6) if v6.is_unspecified() => Some("::1".to_string()),
        _ => Some(ip.to_string()),
    };
    // With a password, redis-cli asks for it (QA: the plain hint got
    // NOAUTH; `-a` would put it in `ps`).
    let ask = if auth { " --askpass" } else { "" };
    match host {
        None => format!("redis-cli -p {}{ask}", a.port()),
        Some(h) => format!("redis-cli -h {h} -p {}{ask}", a.port()),
    }
}

/// How a run ended.
#[derive(Clone, Debug, Serialize)]
pub struct RunSummary {
    /// How long the node served.
    pub uptime: Duration,
    /// What the final flush wrote (`None` when closing the store failed).
    pub flush: Option<FlushReport>,
    /// Servers that had to be aborted because they did not stop in time.
    pub aborted: Vec<&'static str>,
}

type TaskResult = (&'static str, Result<()>);

/// A started node. Drive it with [`NodeHandle::failed`] (resolves if a
/// server dies) and end it with [`NodeHandle::shutdown`]; dropping it
/// without shutdown aborts the servers and skips the final flush.
pub struct NodeHandle {
    config: NodeConfig,
    ctx: Arc<NodeContext>,
    startup: StartupInfo,
    stop: watch::Sender<bool>,
    tasks: JoinSet<TaskResult>,
    lock: DataDirLock,
    started: Instant,
}

/// A future that completes when `stop` turns true (or its sender is gone).
async fn stopped(mut rx: watch::Receiver<bool>) {
    let _ = rx.wait_for(|v| *v).await;
}

/// Open files the daemon may need at its connection limits: each native
/// connection holds its socket and up to 4 region descriptors, each RESP
/// and HTTP connection its socket (plus the HTTP refusals in progress),
/// plus the store, peers and logs.
const WANTED_OPEN_FILES: u64 = 1_024 * 5 + 1_024 + 1_024 + 64 + 512;

/// Raises the soft open-file limit to the hard one (a shell's usual 1,024
/// is below what the connection limits need: past it, accepts fail with
/// EMFILE and clients hang instead of getting `busy`; QA). Warns when even
/// the hard limit is below [`WANTED_OPEN_FILES`].
fn raise_open_file_limit() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid pointer to a local struct.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return;
    }
    if lim.rlim_cur < lim.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: lim.rlim_max,
            rlim_max: lim.rlim_max,
        };
        // SAFETY: as above.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            tracing::debug!(
                from = lim.rlim_cur,
                to = lim.rlim_max,
                "raised the open-file limit"
            );
            lim.rlim_cur = lim.rlim_max;
        }
    }
    if lim.rlim_cur < WANTED_OPEN_FILES {
        tracing::warn!(
            limit = lim.rlim_cur,
            wanted = WANTED_OPEN_FILES,
            "the open-file limit is below what the connection limits need: connections past it \
             fail (raise the hard limit: LimitNOFILE= in the unit, or ulimit -Hn)"
        );
    }
}

/// Starts a node: locks the data dir, opens the store, binds every enabled
/// listener and spawns the servers. Returns once it serves. Must run inside
/// a multi-threaded tokio runtime. `config` must be resolved
/// ([`NodeConfig::resolve`]).
pub async fn start(config: NodeConfig) -> Result<NodeHandle> {
    let started = Instant::now();
    // Chunk buffers reuse freed memory instead of faulting fresh pages.
    let tuning = crate::memory::tune_allocator();
    tracing::debug!(?tuning, "allocator settings");
    raise_open_file_limit();
    let data_dir = config.data_dir.clone();
    let lock = {
        let data_dir = data_dir.clone();
        tokio::task::spawn_blocking(move || DataDirLock::acquire(&data_dir, "daemon"))
            .await
            .map_err(|e| NodeError::Serve {
                what: "start-up",
                detail: e.to_string(),
            })??
    };

    // The TCP ports first: one already in use fails the start before the
    // store file is created (and preallocated to the disk budget).
    let bind = |what: &'static str, addr: std::net::SocketAddr| async move {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|source| NodeError::Bind {
                what,
                addr: addr.to_string(),
                source,
            })?;
        let local = listener.local_addr().map_err(|source| NodeError::Bind {
            what,
            addr: addr.to_string(),
            source,
        })?;
        Ok::<_, NodeError>((listener, local))
    };
    let resp_listener = match config.resp_listen.addr() {
        Some(addr) => {
            crate::resp::check_bind(&addr, config.resp_password.as_deref())
                .map_err(|e| NodeError::Config(format!("invalid `resp-listen`: {e}")))?;
            Some(bind("RESP", addr).await?)
        }
        None => None,
    };
    let http_listener = match config.http_listen.addr() {
        Some(addr) => Some(bind("HTTP", addr).await?),
        None => None,
    };

    // A native socket another daemon serves, likewise (bound below, once
    // the store is open).
    crate::native::check_available(&config.socket).map_err(|e| NodeError::Serve {
        what: "native socket",
        detail: e.to_string(),
    })?;

    // The peer layer's certificates and QUIC port, for the same reason.
    let prepared = match config.cluster_options() {
        Some(opts) => Some(crate::cluster::Cluster::prepare(&opts)?),
        None => None,
    };

    // Opening rebuilds the index from disk: blocking, off the runtime workers.
    let tier_config = config.tier_config();
    let t0 = Instant::now();
    let store = tokio::task::spawn_blocking(move || ChunkStore::open(tier_config))
        .await
        .map_err(|e| NodeError::Serve {
            what: "store open",
            detail: e.to_string(),
        })??;
    let open = t0.elapsed();
    let store = Arc::new(store);
    let stats = store.stats();
    // The figure `/metrics` and `stats` report (QA: the summary's included
    // a new file's preallocation, so the two disagreed).
    let recovery = Duration::from_micros(stats.recovery_micros);
    let namespaces = store.namespaces();
    let mut ctx = NodeContext::new(Arc::clone(&store), config.node_name());
    let mut peer_addr = None;
    if let Some(prepared) = prepared {
        // The peer cascade: starts the QUIC endpoint on the bound port and
        // registers the store's availability observer.
        match prepared.start(Arc::clone(&store)) {
            Ok(c) => {
                ctx.node_name = c.handle().node_name().to_owned();
                peer_addr = c.handle().local_addr().ok();
                ctx = ctx.with_cluster(Arc::new(c));
            }
            Err(e) => {
                let _ = store.close(Duration::ZERO);
                return Err(e);
            }
        }
    }
    let ctx = Arc::new(ctx);

    let (stop, stop_rx) = watch::channel(false);
    let mut tasks: JoinSet<TaskResult> = JoinSet::new();
    let fail = |e: NodeError| {
        // Close the store before returning: nothing was served yet, but the
        // store may own threads and files.
        let _ = store.close(Duration::ZERO);
        e
    };

    // Native socket.
    let listener = crate::native::bind(&config.socket, config.socket_mode.0).map_err(|e| {
        fail(NodeError::Serve {
            what: "native socket",
            detail: e.to_string(),
        })
    })?;
    // From here on a failed start must drop the stop sender and the tasks
    // (JoinSet aborts them on drop) before the store closes.
    {
        let ctx = Arc::clone(&ctx);
        let shutdown = stopped(stop_rx.clone());
        tasks.spawn(async move {
            let r = crate::native::serve(
                listener,
                ctx,
                crate::native::NativeOptions {
                    spin: config.native_spin.0,
                    ..Default::default()
                },
                shutdown,
            )
            .await
            .map_err(|e| NodeError::Serve {
                what: "native",
                detail: e.to_string(),
            });
            ("native", r)
        });
    }

    // RESP.
    let mut resp_addr = None;
    if let Some((listener, local)) = resp_listener {
        resp_addr = Some(local);
        let opts = crate::resp::RespOptions {
            password: config.resp_password.clone(),
            max_value: config.resp_max_value.0,
            ..Default::default()
        };
        let ctx = Arc::clone(&ctx);
        let shutdown = stopped(stop_rx.clone());
        tasks.spawn(async move {
            let r = crate::resp::serve(listener, ctx, opts, shutdown)
                .await
                .map_err(|e| NodeError::Serve {
                    what: "RESP",
                    detail: e.to_string(),
                });
            ("resp", r)
        });
    }

    // HTTP metrics / status.
    let mut http_addr = None;
    if let Some((listener, local)) = http_listener {
        http_addr = Some(local);
        let ctx = Arc::clone(&ctx);
        let shutdown = stopped(stop_rx.clone());
        tasks.spawn(async move {
            let r = crate::http::serve(listener, ctx, shutdown)
                .await
                .map_err(|e| NodeError::Serve {
                    what: "HTTP",
                    detail: e.to_string(),
                });
            ("http", r)
        });
    }
    drop(stop_rx);

    let addrs = BoundAddrs {
        socket: config.socket.clone(),
        resp: resp_addr,
        http: http_addr,
        peer: peer_addr,
    };
    let mut lock = lock;
    lock.write_or_warn(&LockInfo {
        pid: std::process::id(),
        role: "daemon".into(),
        socket: Some(addrs.socket.clone()),
        resp: addrs.resp,
        http: addrs.http,
        ready: true,
    });
    let startup = StartupInfo {
        version: env!("CARGO_PKG_VERSION"),
        data_dir,
        namespaces: namespaces.len(),
        chunks: stats.ram_chunks + stats.disk_chunks,
        bytes: stats.ram_bytes + stats.disk_bytes,
        recovery,
        open,
        direct_io: stats.direct_io,
        ram_budget: config.ram_budget,
        disk_budget: ByteSize(stats.disk_budget),
        disk_regions: stats.disk_regions,
        region_size: ByteSize(stats.region_size),
        max_chunk: ByteSize(ctx.store.max_chunk_len(0)),
        addrs,
        resp_auth: config.resp_password.is_some(),
    };
    Ok(NodeHandle {
        config,
        ctx,
        startup,
        stop,
        tasks,
        lock,
        started,
    })
}

impl NodeHandle {
    /// Where the node listens.
    pub fn addrs(&self) -> &BoundAddrs {
        &self.startup.addrs
    }

    /// What the node found at start.
    pub fn startup(&self) -> &StartupInfo {
        &self.startup
    }

    /// The shared context (store, counters).
    pub fn context(&self) -> &Arc<NodeContext> {
        &self.ctx
    }

    /// Resolves when a server task ends on its own (an error: servers only
    /// end at shutdown), with what it returned. Never resolves while all
    /// servers run.
    pub async fn failed(&mut self) -> NodeError {
        match self.tasks.join_next().await {
            Some(Ok((what, Err(e)))) => {
                tracing::error!(server = what, error = %e, "server failed");
                e
            }
            Some(Ok((what, Ok(())))) => NodeError::Serve {
                what,
                detail: "stopped unexpectedly".into(),
            },
            Some(Err(e)) => NodeError::Serve {
                what: "server task",
                detail: e.to_string(),
            },
            None => std::future::pending().await,
        }
    }

    /// Graceful shutdown: stops accepting, lets connections finish their
    /// current request, then flushes dirty chunks within the configured
    /// shutdown deadline and closes the store. Returns after every task has
    /// finished.
    pub async fn shutdown(mut self) -> Result<RunSummary> {
        let started = Instant::now();
        tracing::info!(
            deadline = %self.config.shutdown_deadline,
            "shutting down: stopping servers, then flushing dirty chunks"
        );
        self.stop.send_replace(true);
        // Servers stop within moments; give them at most half the deadline
        // (and at least a second) so that the flush keeps its share.
        let server_budget = (self.config.shutdown_deadline.0 / 2).max(Duration::from_secs(1));
        let mut aborted = Vec::new();
        let mut first_error = None;
        let wait = async {
            while let Some(res) = self.tasks.join_next().await {
                match res {
                    Ok((_, Ok(()))) => {}
                    Ok((what, Err(e))) => {
                        tracing::error!(server = what, error = %e, "server failed");
                        first_error.get_or_insert(e);
                    }
                    Err(e) if e.is_cancelled() => {}
                    Err(e) => {
                        first_error.get_or_insert(NodeError::Serve {
                            what: "server task",
                            detail: e.to_string(),
                        });
                    }
                }
            }
        };
        if tokio::time::timeout(server_budget, wait).await.is_err() {
            tracing::warn!("servers did not stop in {server_budget:?}; aborting their connections");
            aborted.push("servers");
            self.tasks.abort_all();
            while self.tasks.join_next().await.is_some() {}
        }

        if let Some(c) = &self.ctx.cluster {
            // Peers see a clean close (and stop offering our chunks) before
            // the store goes away.
            c.shutdown(Duration::from_secs(1)).await;
        }
        let remaining = self
            .config
            .shutdown_deadline
            .0
            .saturating_sub(started.elapsed());
        let store = Arc::clone(&self.ctx.store);
        tracing::info!(
            dirty_bytes = store.stats().dirty_bytes,
            remaining_ms = remaining.as_millis() as u64,
            "servers stopped: flushing the dirty set, then closing the store"
        );
        let t0 = Instant::now();
        let closed = tokio::task::spawn_blocking(move || {
            let r = store.close(remaining);
            // What a failed close leaves unwritten (QA: a stop after the
            // disk turned read-only did not say how much it lost).
            (r, store.stats().unwritten_bytes())
        })
        .await
        .map_err(|e| NodeError::Serve {
            what: "store close",
            detail: e.to_string(),
        })?;
        let (closed, unwritten) = closed;
        let flush = match closed {
            Ok(report) => {
                let ms = t0.elapsed().as_millis() as u64;
                if report.failed > 0 {
                    tracing::warn!(
                        chunks = report.chunks,
                        bytes = report.bytes,
                        failed = report.failed,
                        ms,
                        "store closed; some dirty chunks were not written"
                    );
                } else {
                    tracing::info!(
                        chunks = report.chunks,
                        bytes = report.bytes,
                        ms,
                        "store closed"
                    );
                }
                Some(report)
            }
            Err(e @ tier::Error::Deadline(_)) => {
                tracing::error!(error = %e, "shutdown-deadline passed before the flush finished");
                first_error.get_or_insert(NodeError::Store(e));
                None
            }
            Err(e) => {
                // The process exits next: nothing is tried again here.
                tracing::error!(error = %e, unwritten_bytes = unwritten,
                    "closing the store failed; {:.1} MiB ({unwritten} bytes) of chunks not on disk \
                     are lost at this exit", unwritten as f64 / (1u64 << 20) as f64);
                first_error.get_or_insert(NodeError::Store(e));
                None
            }
        };
        // The socket file is ours (bound at start); remove it so clients see
        // "not running" rather than "connection refused" on a stale file.
        if let Err(e) = std::fs::remove_file(&self.startup.addrs.socket)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(socket = %self.startup.addrs.socket.display(), error = %e, "could not remove the socket file");
        }
        self.lock.write_or_warn(&LockInfo {
            pid: std::process::id(),
            role: "daemon".into(),
            ready: false,
            ..Default::default()
        });
        drop(self.lock);
        match first_error {
            Some(e) => Err(e),
            None => Ok(RunSummary {
                uptime: self.started.elapsed(),
                flush,
                aborted,
            }),
        }
    }
}

/// Runs a node until `shutdown` completes (or a server fails), then shuts
/// it down gracefully. Prints the start-up summary (a block on stderr for
/// human logs, one `kvtier ready` event for JSON logs). Returns after every
/// task has finished.
pub async fn run(config: NodeConfig, shutdown: impl Future<Output = ()>) -> Result<RunSummary> {
    let human = config.log_format == LogFormat::Human;
    let mut node = start(config).await?;
    *RUNNING.lock() = Some(Arc::downgrade(&node.context().store));
    let st = node.startup();
    if human {
        crate::logging::eprint_lossy(&st.render());
    } else {
        tracing::info!(
            version = st.version,
            data_dir = %st.data_dir.display(),
            namespaces = st.namespaces,
            chunks = st.chunks,
            bytes = st.bytes,
            recovery_ms = st.recovery.as_secs_f64() * 1e3,
            open_ms = st.open.as_secs_f64() * 1e3,
            direct_io = st.direct_io,
            ram_budget = st.ram_budget.0,
            disk_budget = st.disk_budget.0,
            disk_regions = st.disk_regions,
            max_chunk = st.max_chunk.0,
            socket = %st.addrs.socket.display(),
            resp = %st.addrs.resp.map_or_else(|| "off".to_string(), |a| a.to_string()),
            http = %st.addrs.http.map_or_else(|| "off".to_string(), |a| a.to_string()),
            peer = %st.addrs.peer.map_or_else(|| "off".to_string(), |a| a.to_string()),
                    "kvtier ready"
        );
    }
    crate::notify::notify(&format!(
        "READY=1\nSTATUS=serving; {} chunk(s) recovered in {:.1} ms\nMAINPID={}",
        st.chunks,
        st.recovery.as_secs_f64() * 1e3,
        std::process::id()
    ));
    tokio::pin!(shutdown);
    let failure = tokio::select! {
        () = &mut shutdown => None,
        e = node.failed() => Some(e),
    };
    crate::notify::notify("STOPPING=1\nSTATUS=flushing dirty chunks, then exiting");
    let summary = node.shutdown().await;
    match failure {
        Some(e) => Err(e),
        None => summary,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Environment, Listen, NodeConfig};

    #[test]
    fn the_lock_is_exclusive_and_names_its_holder() {
        let dir = tempfile::tempdir().expect("temp dir");
        let data = dir.path().join("data");
        assert!(DataDirLock::holder(&data).is_none());
        let mut lock = DataDirLock::acquire(&data, "daemon").expect("first lock");
        lock.write(&LockInfo {
            pid: 4242,
            role: "daemon".into(),
            socket: Some("/tmp/x.sock".into()),
            ready: true,
            ..Default::default()
        })
        .expect("write");
        match DataDirLock::acquire(&data, "verify") {
            Err(NodeError::Locked { holder, .. }) => {
                assert!(
                    holder.contains("pid 4242") && holder.contains("/tmp/x.sock"),
                    "{holder}"
                );
            }
            other => panic!("expected Locked, got {other:?}"),
        }
        let h = DataDirLock::holder(&data).expect("held");
        assert_eq!(h.pid, 4242);
        drop(lock);
        assert!(DataDirLock::holder(&data).is_none(), "released on drop");
        let _again = DataDirLock::acquire(&data, "gc").expect("free again");
    }

    #[test]
    fn a_shorter_record_replaces_a_longer_one_whole() {
        let dir = tempfile::tempdir().expect("temp dir");
        let data = dir.path().join("data");
        let mut lock = DataDirLock::acquire(&data, "daemon").expect("lock");
        let long = LockInfo {
            pid: 4242,
            role: "daemon".into(),
            socket: Some(dir.path().join("a-rather-long-socket-name.sock")),
            ready: true,
            ..Default::default()
        };
        lock.write(&long).expect("write");
        let short = LockInfo {
            pid: 7,
            role: "daemon".into(),
            ..Default::default()
        };
        lock.write(&short).expect("rewrite");
        let text = std::fs::read_to_string(data.join(LOCK_FILE)).expect("read");
        let back: LockInfo = serde_json::from_str(&text).expect("one JSON record");
        assert_eq!((back.pid, back.socket, back.ready), (7, None, false));
        assert!(
            text.ends_with("}\n") && text.matches('{').count() == 1,
            "{text:?}"
        );
    }

    #[test]
    fn a_torn_or_empty_record_reads_as_what_it_is() {
        let dir = tempfile::tempdir().expect("temp dir");
        let data = dir.path().join("data");
        let _lock = DataDirLock::acquire(&data, "daemon").expect("lock");
        let path = data.join(LOCK_FILE);
        // A reader between a shorter rewrite and its cut: the new record,
        // then the old one's tail.
        std::fs::write(
            &path,
            "{\"pid\":7,\"role\":\"daemon\"}\n-rather-long-socket-name.sock\",\"ready\":true}\n",
        )
        .expect("write");
        assert_eq!(DataDirLock::holder(&data).expect("held").pid, 7);
        // A daemon that could not write its record (a full filesystem).
        std::fs::write(&path, "").expect("truncate");
        assert_eq!(DataDirLock::holder(&data).expect("held").pid, 0);
        match DataDirLock::acquire(&data, "verify") {
            Err(NodeError::Locked { holder, .. }) => {
                assert!(holder.contains("empty or unreadable"), "{holder}");
            }
            other => panic!("expected Locked, got {other:?}"),
        }
        // A holder that writes its record a moment after taking the lock
        // (two starts at once): waited for, not called empty (QA).
        let writer = {
            let path = path.clone();
            std::thread::spawn(move || {
                std::thread::sleep(std::time::Duration::from_millis(50));
                std::fs::write(&path, "{\"pid\":9,\"role\":\"daemon\"}\n").expect("write");
            })
        };
        assert_eq!(DataDirLock::holder(&data).expect("held").pid, 9);
        writer.join().expect("writer");
    }

    #[test]
    fn a_lock_file_planted_as_a_link_is_refused_not_followed() {
        let dir = tempfile::tempdir().expect("temp dir");
        let victim = dir.path().join("victim");
        std::fs::write(&victim, b"SECRET").expect("write");
        let data = dir.path().join("data");
        std::fs::create_dir(&data).expect("mkdir");
        std::os::unix::fs::symlink(&victim, data.join(LOCK_FILE)).expect("symlink");
        let e = DataDirLock::acquire(&data, "daemon").expect_err("a link");
        assert!(e.to_string().contains("symbolic link"), "{e}");
        assert_eq!(std::fs::read(&victim).expect("read"), b"SECRET");
    }

    fn test_config(dir: &Path) -> NodeConfig {
        let mut c = NodeConfig::defaults_for(&Environment::default());
        c.data_dir = dir.join("data");
        c.socket = dir.join("kvtier.sock");
        c.ram_budget = ByteSize::mib(16);
        c.disk_budget = Some(ByteSize::mib(16));
        c.region_size = ByteSize::mib(4);
        c.resp_listen = Listen::Addr("127.0.0.1:0".parse().expect("addr"));
        c.http_listen = Listen::Addr("127.0.0.1:0".parse().expect("addr"));
        c.shutdown_deadline = crate::HumanDuration::secs(10);
        c
    }

    #[test]
    fn the_redis_cli_hint_names_the_host_unless_it_is_the_default() {
        for (addr, want) in [
            ("127.0.0.1:6379", "redis-cli -p 6379"),
            ("0.0.0.0:6380", "redis-cli -p 6380"),
            ("10.0.0.5:6379", "redis-cli -h 10.0.0.5 -p 6379"),
            ("127.0.0.2:7000", "redis-cli -h 127.0.0.2 -p 7000"),
            ("[::1]:6379", "redis-cli -h ::1 -p 6379"),
            ("[::]:6379", "redis-cli -h ::1 -p 6379"),
        ] {
            assert_eq!(
                redis_cli_hint(addr.parse().expect("addr"), false),
                want,
                "{addr}"
            );
        }
        assert_eq!(
            redis_cli_hint("127.0.0.1:6380".parse().expect("addr"), true),
            "redis-cli -p 6380 --askpass"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_summary_states_the_disk_budget_the_store_holds() {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut cfg = test_config(dir.path());
        // 18 MiB is not a whole number of 4 MiB regions: the file holds 16.
        cfg.disk_budget = Some(ByteSize::mib(18));
        let node = start(cfg.clone()).await.expect("start");
        let render = node.startup().render();
        assert!(
            render.contains("disk budget 16.0 MiB (4 × 4.0 MiB regions)"),
            "{render}"
        );
        let file = std::fs::metadata(cfg.data_dir.join(crate::config::STORE_FILE)).expect("file");
        assert_eq!(file.len(), 16 << 20);
        assert_eq!(node.startup().disk_budget.0, file.len());
        // The recovery the summary states is the one `stats` reports (QA:
        // the summary's included the new file's preallocation).
        let st = node.startup();
        assert_eq!(
            st.recovery.as_micros() as u64,
            node.context().store.stats().recovery_micros
        );
        assert!(st.open >= st.recovery);
        node.shutdown().await.expect("shutdown");

        let mut ram_only = test_config(dir.path());
        ram_only.data_dir = dir.path().join("ram-only");
        ram_only.disk_budget = Some(ByteSize(0));
        let node = start(ram_only).await.expect("start");
        let render = node.startup().render();
        assert!(render.contains("disk budget 0 B (RAM only)"), "{render}");
        node.shutdown().await.expect("shutdown");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn start_binds_everything_and_shutdown_releases_everything() {
        let dir = tempfile::tempdir().expect("temp dir");
        let cfg = test_config(dir.path());
        let node = start(cfg.clone()).await.expect("start");
        let addrs = node.addrs().clone();
        assert!(addrs.resp.expect("resp").port() != 0);
        assert!(addrs.http.expect("http").port() != 0);
        assert!(addrs.socket.exists());
        let info = DataDirLock::holder(&cfg.data_dir).expect("daemon holds the lock");
        assert!(info.ready && info.pid == std::process::id() && info.resp == addrs.resp);
        assert!(node.startup().render().contains("ready"));
        assert!(
            node.startup()
                .render()
                .contains("  peers      off (single node)\n")
        );
        assert!(
            node.startup().render().contains(&format!(
                "(redis-cli -p {})",
                addrs.resp.expect("resp").port()
            )),
            "{}",
            node.startup().render()
        );

        // A second node on the same data dir is refused, naming the first.
        let mut other = cfg.clone();
        other.socket = dir.path().join("other.sock");
        match start(other).await {
            Err(NodeError::Locked { holder, .. }) => assert!(holder.contains("daemon"), "{holder}"),
            Err(e) => panic!("expected Locked, got {e}"),
            Ok(_) => panic!("a second node started on a locked data dir"),
        }

        let summary = node.shutdown().await.expect("shutdown");
        assert!(summary.aborted.is_empty());
        assert!(!addrs.socket.exists(), "socket removed");
        assert!(
            DataDirLock::holder(&cfg.data_dir).is_none(),
            "lock released"
        );
        // Ports are free again.
        std::net::TcpListener::bind(addrs.resp.expect("resp")).expect("RESP port released");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn run_returns_when_shutdown_completes() {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut cfg = test_config(dir.path());
        cfg.resp_listen = Listen::Off;
        cfg.http_listen = Listen::Off;
        let summary = run(cfg, async {}).await.expect("run");
        assert!(summary.flush.is_some());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_busy_port_fails_the_start_and_releases_the_lock() {
        let dir = tempfile::tempdir().expect("temp dir");
        let busy = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let mut cfg = test_config(dir.path());
        cfg.http_listen = Listen::Addr(busy.local_addr().expect("addr"));
        match start(cfg.clone()).await {
            Err(NodeError::Bind { what, .. }) => assert_eq!(what, "HTTP"),
            Err(e) => panic!("expected Bind, got {e}"),
            Ok(_) => panic!("started on a busy port"),
        }
        assert!(
            DataDirLock::holder(&cfg.data_dir).is_none(),
            "lock released"
        );
    }
}
