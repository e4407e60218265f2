//! [`NodeConfig`]: the daemon's one typed configuration, loaded with figment
//! from, in increasing precedence: embedded defaults, a TOML file
//! (`--config`), `KVTIER_*` environment variables, command-line flags.
//!
//! Every key is kebab-case and the same in all sources: `ram-budget` in
//! TOML is `KVTIER_RAM_BUDGET` in the environment and `--ram-budget` on the
//! command line. Unknown keys and invalid values are rejected with an error
//! naming the key and the source it came from ([`load`]). Checks that need
//! the machine (free disk space) run in [`NodeConfig::resolve`].

use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use figment::value::{Dict, Map, Value};
use figment::{Figment, Metadata, Profile, Provider};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use tier::{TierConfig, WritePolicy};

use crate::error::{NodeError, Result};
use crate::logging::LogFormat;
use crate::size::{ByteSize, HumanDuration};

/// Prefix of the environment variables read as configuration.
pub const ENV_PREFIX: &str = "KVTIER_";
/// Environment variable naming the config file (like `--config`); it is not
/// itself a configuration key.
pub const ENV_CONFIG_FILE: &str = "KVTIER_CONFIG";

/// Upper bound of the default RAM budget.
pub const DEFAULT_RAM_BUDGET_CAP: ByteSize = ByteSize::gib(4);
/// Upper bound of the automatic disk budget.
pub const DEFAULT_DISK_BUDGET_CAP: ByteSize = ByteSize::gib(16);
/// Longest `native-spin` accepted.
pub const MAX_NATIVE_SPIN: Duration = Duration::from_millis(1);

/// A TCP listen address, or `off`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Listen {
    /// The listener is disabled.
    Off,
    /// Listen on this address (port 0 picks a free port).
    Addr(SocketAddr),
}

impl Listen {
    /// The address, unless disabled.
    pub fn addr(self) -> Option<SocketAddr> {
        match self {
            Listen::Off => None,
            Listen::Addr(a) => Some(a),
        }
    }
}

impl FromStr for Listen {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        if s.eq_ignore_ascii_case("off") {
            return Ok(Listen::Off);
        }
        s.parse::<SocketAddr>().map(Listen::Addr).map_err(|_| {
            format!("{s:?} is not a listen address: use IP:PORT (e.g. \"127.0.0.1:6380\", \"[::1]:0\") or \"off\"")
        })
    }
}

impl fmt::Display for Listen {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Listen::Off => f.write_str("off"),
            Listen::Addr(a) => write!(f, "{a}"),
        }
    }
}

impl Serialize for Listen {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Listen {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// Unix permission bits of the native socket, written in octal ("0660").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileMode(pub u32);

impl FromStr for FileMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let t = s.trim().trim_start_matches("0o");
        match u32::from_str_radix(t, 8) {
            Ok(m) if m <= 0o777 && !t.is_empty() => Ok(FileMode(m)),
            Ok(m) if m <= 0o7777 => Err(format!(
                "{s:?} sets setuid, setgid or sticky bits, which a socket does not take: use \
                 permission bits only (0 to 0777, such as \"0660\")"
            )),
            _ => Err(format!(
                "{s:?} is not a file mode: use octal digits such as \"0660\""
            )),
        }
    }
}

impl fmt::Display for FileMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:04o}", self.0)
    }
}

impl Serialize for FileMode {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for FileMode {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        // Strings are read as octal; a TOML integer (e.g. `0o660`) as its value.
        let v = StrOrNum::deserialize(d).map_err(|_| {
            serde::de::Error::custom(
                "expected a file mode: a string of octal digits such as \"0660\"",
            )
        })?;
        match v {
            StrOrNum::Str(s) => s.parse().map_err(serde::de::Error::custom),
            StrOrNum::Num(n) if n <= 0o777 => Ok(FileMode(n as u32)),
            StrOrNum::Num(n) => Err(serde::de::Error::custom(format!(
                "{n} is not a file mode: use a string of octal digits such as \"0660\""
            ))),
        }
    }
}

#[derive(Deserialize)]
#[serde(untagged)]
enum StrOrNum {
    Str(String),
    Num(u64),
}

/// Reads a string; numbers and booleans (which the environment parser
/// produces for values such as `1234`) are taken as their text.
fn lenient_string<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Any {
        S(String),
        U(u64),
        I(i64),
        F(f64),
        B(bool),
    }
    let v = Any::deserialize(d)
        .map_err(|_| serde::de::Error::custom("expected a string, not a table or a list"))?;
    Ok(match v {
        Any::S(s) => s,
        Any::U(n) => n.to_string(),
        Any::I(n) => n.to_string(),
        Any::F(n) => n.to_string(),
        Any::B(b) => b.to_string(),
    })
}

fn lenient_opt_string<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    lenient_string(d).map(Some)
}

/// The daemon's configuration. Keys are kebab-case; each field's doc ends
/// with its default. See `deploy/config/single-node.toml` for a commented
/// example of every key.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct NodeConfig {
    /// Directory of the chunk store and its lock file. Default:
    /// `$STATE_DIRECTORY` (systemd), `/var/lib/kvtier` as root,
    /// `$XDG_DATA_HOME/kvtier`, else `~/.local/share/kvtier`.
    pub data_dir: PathBuf,
    /// Hard byte limit of the RAM tier. Default: 25 % of physical RAM, at
    /// most 4 GiB. Minimum: 1 MiB.
    pub ram_budget: ByteSize,
    /// Hard byte limit of the disk tier (preallocated in the data dir);
    /// 0 keeps chunks in RAM only. Must fit the free space of the data dir's
    /// filesystem minus `disk-reserve`. Default: unset, meaning 16 GiB or
    /// half of the available space if that is less.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_budget: Option<ByteSize>,
    /// Space the disk budget leaves free on the data dir's filesystem for
    /// everything else on it. Default: unset, meaning 5 % of the
    /// filesystem, at most 1 GiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_reserve: Option<ByteSize>,
    /// Size of one region of the disk store. Default: 256 MiB for a new
    /// store; an existing store keeps the size it was created with unless
    /// one is set explicitly (then a different size is refused at start).
    pub region_size: ByteSize,
    /// Use O_DIRECT on the disk store when the filesystem supports it.
    /// Default: true.
    pub direct_io: bool,
    /// Ask the kernel for transparent huge pages on new chunk buffers of
    /// 2 MiB and more (`MADV_HUGEPAGE`; effective where THP is `always` or
    /// `madvise`): a new chunk's copy faults 2 MiB pages instead of 4 KiB
    /// ones. Default: true.
    pub huge_pages: bool,
    /// Dirty chunks older than this are written to disk when the writer is
    /// idle. Default: 30s.
    pub idle_flush_after: HumanDuration,
    /// What PUT does when the disk writer falls behind: `no-tax` never
    /// blocks (an evicted dirty chunk that cannot be queued is dropped and
    /// counted), `backpressure` waits. Default: `no-tax`.
    pub write_policy: WritePolicy,
    /// The inference engine's GPU KV pool size. When set, the daemon warns
    /// at start if RAM + disk budget is not larger (such a tier never
    /// serves). Default: unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_kv_pool: Option<ByteSize>,
    /// Path of the native protocol's Unix socket. Default:
    /// `$RUNTIME_DIRECTORY/kvtier.sock` (systemd), `/run/kvtier/kvtier.sock`
    /// as root, `$XDG_RUNTIME_DIR/kvtier/kvtier.sock`, else `kvtier.sock` in
    /// the default data dir.
    pub socket: PathBuf,
    /// Permission bits of the socket. Default: `0660`.
    pub socket_mode: FileMode,
    /// How long a native connection keeps polling for its client's next
    /// request before its worker parks, at most 1ms. Polling saves a thread
    /// wake-up per request (tens of µs on many virtual machines), and burns
    /// a core per busy connection while it polls, so it polls only while the
    /// system has a CPU to spare (no more runnable threads than cores).
    /// Default: `50us`; `0s`: the daemon never polls (clients poll for
    /// replies per `KVTIER_CLIENT_SPIN_US`).
    pub native_spin: HumanDuration,
    /// RESP (Redis protocol: RESP2, RESP3 after `HELLO 3`) listen address, or `off`. A non-loopback
    /// address requires `resp-password`. Default: `127.0.0.1:6380`.
    pub resp_listen: Listen,
    /// Password RESP clients must send with `AUTH`. Default: unset (no AUTH).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "lenient_opt_string"
    )]
    pub resp_password: Option<String>,
    /// Largest value a RESP `SET` may carry. Default: 512 MiB.
    pub resp_max_value: ByteSize,
    /// HTTP listen address for `/metrics`, `/status` and `/healthz`, or
    /// `off`. Default: `127.0.0.1:7480`.
    pub http_listen: Listen,
    /// How long a graceful shutdown (SIGTERM, SIGINT) may spend flushing
    /// dirty chunks to disk. Default: 30s.
    pub shutdown_deadline: HumanDuration,
    /// Log format on stderr: `human` or `json`. Default: `human`.
    pub log_format: LogFormat,
    /// Log filter: a level (`info`, `debug`) or tracing directives
    /// (`info,node=debug`). Default: `info`.
    #[serde(deserialize_with = "lenient_string")]
    pub log_level: String,
    /// This node's name in logs and status. Default: unset, meaning the
    /// certificate's name with peers, `dev-<peer port>` with `insecure-dev`
    /// (`dev-<address>-<port>` off 127.0.0.1), else the host name.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "lenient_opt_string"
    )]
    pub node_name: Option<String>,
    /// Address the peer endpoint (QUIC, mutual TLS) listens on, or `off`
    /// (a single node). Default: `off`.
    pub peer_listen: Listen,
    /// Seed peers, `host:port` each: a TOML list, or one comma-separated
    /// string in the environment. This node's own address may be listed (it
    /// is skipped). At most 32. Default: none.
    pub peers: PeerList,
    /// Directory holding `ca.pem`, `node.pem` and `node.key` exactly as
    /// `kvtier cert issue --out DIR` writes them. Required with
    /// `peer-listen` unless `insecure-dev`. Default: unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_dir: Option<PathBuf>,
    /// Development only: a throw-away self-signed certificate, any peer
    /// accepted; `peer-listen` and every peer must be loopback addresses.
    /// Default: false.
    pub insecure_dev: bool,
    /// How long a GET that misses locally may wait for a peer before it is
    /// a miss; at most 1 day. Default: 2s.
    pub peer_fetch_timeout: HumanDuration,
    /// Peer handshake timeout; at most 1 day. Default: 2s.
    pub peer_connect_timeout: HumanDuration,
    /// Silence after which a peer is suspect; at most 1 day. Default: 1s.
    pub peer_suspect_after: HumanDuration,
    /// Silence after which a peer is down (its chunks are no longer
    /// offered). Must exceed `peer-suspect-after`; at most 1 day.
    /// Default: 3s.
    pub peer_down_after: HumanDuration,
    /// Bytes per second this node serves to one peer; 0 = unlimited.
    /// Default: 0.
    pub peer_serve_rate: ByteSize,
    /// Keep chunks fetched from peers in local RAM. Values of plain RESP
    /// keys are never kept (their keys are mutable: a copy would outlive a
    /// DEL or an overwrite on the node holding them); LMCache's keys name
    /// their content and are kept. Default: true.
    pub peer_admit: bool,
    /// QUIC connections to each peer that carry fetches (the control
    /// connection and `peer-fetch-connections - 1` fetch-only ones), 1 to
    /// 16. More spread a restore's packet and crypto work over more cores.
    /// Default: 4.
    pub peer_fetch_connections: u32,
}

/// The `peers` list: deserializes from a list of strings or from one
/// comma-separated string (the environment's form).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PeerList(pub Vec<String>);

impl Serialize for PeerList {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        self.0.serialize(s)
    }
}

impl<'de> Deserialize<'de> for PeerList {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Form {
            List(Vec<String>),
            One(String),
        }
        let v = match Form::deserialize(d).map_err(|_| {
            serde::de::Error::custom(
                "expected a list of \"host:port\" strings, or one string of them separated \
                 by commas (e.g. peers = [\"10.0.0.2:7470\", \"10.0.0.3:7470\"])",
            )
        })? {
            Form::List(v) => v,
            Form::One(s) => s.split(',').map(str::to_owned).collect(),
        };
        Ok(PeerList(
            v.into_iter()
                .map(|p| p.trim().to_owned())
                .filter(|p| !p.is_empty())
                .collect(),
        ))
    }
}

/// Whether `host:port` names a loopback address (`localhost` or a loopback
/// IP).
fn is_loopback_peer(p: &str) -> bool {
    if let Ok(a) = p.parse::<SocketAddr>() {
        return a.ip().is_loopback();
    }
    p.rsplit_once(':')
        .is_some_and(|(h, port)| h == "localhost" && port.parse::<u16>().is_ok())
}

/// Facts about the machine and the process environment that defaults
/// depend on. [`Environment::detect`] reads them; tests build their own.
#[derive(Clone, Debug, Default)]
pub struct Environment {
    /// Running as root (effective uid 0).
    pub root: bool,
    /// `$HOME`.
    pub home: Option<PathBuf>,
    /// `$XDG_DATA_HOME`.
    pub xdg_data_home: Option<PathBuf>,
    /// `$XDG_RUNTIME_DIR`.
    pub xdg_runtime_dir: Option<PathBuf>,
    /// `$STATE_DIRECTORY` (set by systemd's `StateDirectory=`).
    pub state_directory: Option<PathBuf>,
    /// `$RUNTIME_DIRECTORY` (set by systemd's `RuntimeDirectory=`).
    pub runtime_directory: Option<PathBuf>,
    /// Physical RAM in bytes, if known.
    pub mem_total: Option<u64>,
}

/// `KVTIER_*` variables that belong to the clients, benches and scripts,
/// not to the daemon's configuration (no config key has these names).
pub fn is_tool_variable(name: &str) -> bool {
    name == crate::native::spin::CLIENT_SPIN_ENV
        || name == "KVTIER_BIN"
        || name == "KVTIER_REDIS_SERVER"
        || name.starts_with("KVTIER_BENCH_")
}

fn env_path(name: &str) -> Option<PathBuf> {
    std::env::var_os(name)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .filter(|p| p.is_absolute())
}

/// Physical RAM from `/proc/meminfo`, if readable.
fn mem_total() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

impl Environment {
    /// Reads the current process's environment and machine.
    pub fn detect() -> Self {
        Self {
            root: rustix::process::geteuid().is_root(),
            home: env_path("HOME"),
            xdg_data_home: env_path("XDG_DATA_HOME"),
            xdg_runtime_dir: env_path("XDG_RUNTIME_DIR"),
            // systemd may list several directories separated by ':'.
            state_directory: env_path("STATE_DIRECTORY").and_then(|p| {
                p.to_str()
                    .map(|s| PathBuf::from(s.split(':').next().unwrap_or(s)))
            }),
            runtime_directory: env_path("RUNTIME_DIRECTORY").and_then(|p| {
                p.to_str()
                    .map(|s| PathBuf::from(s.split(':').next().unwrap_or(s)))
            }),
            mem_total: mem_total(),
        }
    }

    /// The default data directory.
    pub fn default_data_dir(&self) -> PathBuf {
        if let Some(d) = &self.state_directory {
            return d.clone();
        }
        if self.root {
            return PathBuf::from("/var/lib/kvtier");
        }
        if let Some(d) = &self.xdg_data_home {
            return d.join("kvtier");
        }
        if let Some(h) = &self.home {
            return h.join(".local/share/kvtier");
        }
        PathBuf::from("kvtier-data")
    }

    /// The default socket path.
    pub fn default_socket(&self) -> PathBuf {
        if let Some(d) = &self.runtime_directory {
            return d.join("kvtier.sock");
        }
        if self.root {
            return PathBuf::from(crate::native::SYSTEM_SOCKET);
        }
        if let Some(d) = &self.xdg_runtime_dir {
            return d.join("kvtier/kvtier.sock");
        }
        self.default_data_dir().join("kvtier.sock")
    }

    /// The default RAM budget: 25 % of physical RAM, at most 4 GiB (1 GiB
    /// when the RAM size is unknown).
    pub fn default_ram_budget(&self) -> ByteSize {
        match self.mem_total {
            Some(total) => ByteSize((total / 4).clamp(1 << 20, DEFAULT_RAM_BUDGET_CAP.0)),
            None => ByteSize::gib(1),
        }
    }
}

impl NodeConfig {
    /// The embedded defaults for a given environment.
    pub fn defaults_for(env: &Environment) -> Self {
        Self {
            data_dir: env.default_data_dir(),
            ram_budget: env.default_ram_budget(),
            disk_budget: None,
            disk_reserve: None,
            region_size: ByteSize(DEFAULT_REGION_SIZE),
            direct_io: true,
            huge_pages: true,
            idle_flush_after: HumanDuration::secs(30),
            write_policy: WritePolicy::NoTax,
            gpu_kv_pool: None,
            socket: env.default_socket(),
            socket_mode: FileMode(0o660),
            native_spin: HumanDuration(crate::native::DEFAULT_SPIN),
            resp_listen: Listen::Addr(SocketAddr::from(([127, 0, 0, 1], 6380))),
            resp_password: None,
            resp_max_value: ByteSize::mib(512),
            http_listen: Listen::Addr(SocketAddr::from(([127, 0, 0, 1], 7480))),
            shutdown_deadline: HumanDuration::secs(30),
            log_format: LogFormat::Human,
            log_level: "info".into(),
            node_name: None,
            peer_listen: Listen::Off,
            peers: PeerList::default(),
            tls_dir: None,
            insecure_dev: false,
            peer_fetch_timeout: HumanDuration::secs(2),
            peer_connect_timeout: HumanDuration::secs(2),
            peer_suspect_after: HumanDuration::secs(1),
            peer_down_after: HumanDuration::secs(3),
            peer_serve_rate: ByteSize(0),
            peer_fetch_connections: 4,
            peer_admit: true,
        }
    }

    /// The peer cascade's options, or `None` when `peer-listen` is `off`.
    pub fn cluster_options(&self) -> Option<crate::cluster::ClusterOptions> {
        let listen = self.peer_listen.addr()?;
        Some(crate::cluster::ClusterOptions {
            listen,
            peers: self.peers.0.clone(),
            tls_dir: self.tls_dir.clone(),
            insecure_dev: self.insecure_dev,
            node_name: self.node_name.clone(),
            fetch_timeout: self.peer_fetch_timeout.0,
            connect_timeout: self.peer_connect_timeout.0,
            suspect_after: self.peer_suspect_after.0,
            down_after: self.peer_down_after.0,
            serve_rate: self.peer_serve_rate.0,
            fetch_connections: self.peer_fetch_connections,
            admit: self.peer_admit,
        })
    }

    /// The chunk store's configuration. Call after [`NodeConfig::resolve`]
    /// (an unresolved automatic disk budget is taken as 0 here).
    pub fn tier_config(&self) -> TierConfig {
        TierConfig {
            data_dir: self.data_dir.clone(),
            ram_budget: self.ram_budget.0,
            disk_budget: self.disk_budget.map_or(0, |b| b.0),
            region_size: self.region_size.0,
            idle_flush_after: self.idle_flush_after.0,
            write_policy: self.write_policy,
            direct_io: self.direct_io,
            huge_pages: self.huge_pages,
            disk_reserve: self.disk_reserve.map_or(0, |r| r.0),
            ..TierConfig::default()
        }
    }

    /// Checks an existing chunk store in `data-dir` against the resolved
    /// sizes, as the start's open would (reads only; call after
    /// [`NodeConfig::resolve`]): a store of another region size or region
    /// count is refused naming the key and where its value came from (QA:
    /// `config check` said "the chunk store in D" and then the store's own
    /// message, which named neither the flag nor a value to set).
    pub fn check_existing_store(&self, src: &Sources) -> Result<()> {
        self.check_existing_layout(src)?;
        let tc = self.tier_config();
        if tc.disk_budget == 0 {
            return Ok(());
        }
        tier::store::check_existing_store(&tc).map_err(|e| {
            NodeError::Config(format!(
                "the chunk store in {} cannot be opened with this configuration: {e}",
                self.data_dir.display()
            ))
        })
    }

    /// The part of [`NodeConfig::check_existing_store`] that names a key: a
    /// store of another region size or count (what `node start` checks
    /// before its open, whose own errors say the rest).
    pub fn check_existing_layout(&self, src: &Sources) -> Result<()> {
        let tc = self.tier_config();
        if tc.disk_budget == 0 {
            return Ok(());
        }
        let bad = |key: &str, msg: String| {
            NodeError::Config(format!("invalid `{key}` ({}): {msg}", src.of(key)))
        };
        if let Some(l) = tier::store::existing_layout(&self.data_dir) {
            if l.region_size != tc.region_size {
                return Err(bad(
                    "region-size",
                    format!(
                        "the chunk store in {} was created with region-size {}, not {}; set \
                         region-size to {} or leave it unset (an existing store keeps its own), \
                         or move the store away",
                        self.data_dir.display(),
                        ByteSize(l.region_size),
                        ByteSize(tc.region_size),
                        ByteSize(l.region_size),
                    ),
                ));
            }
            let regions = tc.disk_budget / tc.region_size;
            if u64::from(l.region_count) != regions {
                return Err(bad(
                    "disk-budget",
                    format!(
                        "{} makes {regions} regions of {}, but the chunk store in {} holds {} \
                         ({}); set disk-budget to {} or leave it unset (an existing store keeps \
                         its size), or move the store away",
                        ByteSize(tc.disk_budget),
                        ByteSize(tc.region_size),
                        self.data_dir.display(),
                        l.region_count,
                        ByteSize(l.bytes()),
                        ByteSize(l.bytes()),
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The node name: `node-name`, else the host name.
    pub fn node_name(&self) -> String {
        if let Some(n) = &self.node_name {
            return n.clone();
        }
        std::fs::read_to_string("/proc/sys/kernel/hostname")
            .ok()
            .map(|h| h.trim().to_owned())
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| "kvtier".into())
    }

    /// The store's keys, checked as [`NodeConfig::check_static`] does
    /// (all the offline tools check).
    fn check_store(&self, src: &Sources) -> Result<()> {
        let bad = |key: &str, msg: String| {
            NodeError::Config(format!("invalid `{key}` ({}): {msg}", src.of(key)))
        };
        if self.ram_budget.0 < (1 << 20) {
            return Err(bad(
                "ram-budget",
                format!("{} is below the minimum of 1MiB", self.ram_budget),
            ));
        }
        if self.region_size.0 < (1 << 20)
            || self.region_size.0 > tier::config::MAX_REGION_SIZE
            || self.region_size.0 % 4096 != 0
        {
            return Err(bad(
                "region-size",
                format!(
                    "{} must be at least 1MiB, at most 1GiB and a multiple of 4KiB",
                    self.region_size
                ),
            ));
        }
        if self.shutdown_deadline.0 > MAX_SHUTDOWN_DEADLINE {
            return Err(bad(
                "shutdown-deadline",
                format!("{} is longer than the 1 day limit", self.shutdown_deadline),
            ));
        }
        if let Some(d) = self.disk_budget
            && d.0 != 0
            && d.0 < 2 * self.region_size.0
        {
            return Err(bad(
                "disk-budget",
                format!(
                    "{d} must hold at least two regions of region-size ({}), or be 0 for RAM only",
                    self.region_size
                ),
            ));
        }
        if self.data_dir.as_os_str().is_empty() {
            return Err(bad("data-dir", "must not be empty".into()));
        }
        if self.data_dir.exists() && !self.data_dir.is_dir() {
            return Err(bad(
                "data-dir",
                format!("{} exists and is not a directory", self.data_dir.display()),
            ));
        }
        Ok(())
    }

    /// Checks that do not need the machine: contradictions between keys.
    /// Returns warnings that do not prevent a start.
    fn check_static(&self, src: &Sources) -> Result<Vec<String>> {
        self.check_store(src)?;
        let bad = |key: &str, msg: String| {
            NodeError::Config(format!("invalid `{key}` ({}): {msg}", src.of(key)))
        };
        if self.socket.as_os_str().is_empty() {
            return Err(bad("socket", "must not be empty".into()));
        }
        // sun_path holds 108 bytes including the terminating NUL.
        if self.socket.as_os_str().len() > 107 {
            return Err(bad(
                "socket",
                format!(
                    "{} is {} bytes long; Unix socket paths are limited to 107 bytes",
                    self.socket.display(),
                    self.socket.as_os_str().len()
                ),
            ));
        }
        if self.socket_mode.0 & 0o600 != 0o600 {
            return Err(bad(
                "socket-mode",
                format!(
                    "{} must give the owner read and write (0600 at least)",
                    self.socket_mode
                ),
            ));
        }
        if self.native_spin.0 > MAX_NATIVE_SPIN {
            return Err(bad(
                "native-spin",
                format!("{} is longer than the 1ms limit", self.native_spin),
            ));
        }
        if let Some(p) = &self.resp_password
            && p.is_empty()
        {
            return Err(bad(
                "resp-password",
                "must not be empty (leave it unset for no AUTH)".into(),
            ));
        }
        if let Listen::Addr(a) = self.resp_listen
            && !a.ip().is_loopback()
            && self.resp_password.is_none()
        {
            return Err(bad(
                "resp-listen",
                format!(
                    "{a} is not a loopback address; set `resp-password` to expose RESP beyond this host"
                ),
            ));
        }
        if self.resp_max_value.0 == 0 {
            return Err(bad("resp-max-value", "must be larger than 0".into()));
        }
        if let (Listen::Addr(r), Listen::Addr(h)) = (self.resp_listen, self.http_listen)
            && r == h
            && r.port() != 0
        {
            return Err(bad("http-listen", format!("{h} is also `resp-listen`")));
        }
        crate::logging::parse_filter(&self.log_level).map_err(|e| bad("log-level", e))?;
        if let Some(n) = &self.node_name
            && (n.is_empty() || n.len() > 253)
        {
            return Err(bad("node-name", "must be 1 to 253 characters".into()));
        }
        self.check_peer_values(src, &bad)?;
        self.check_peers(&bad)?;
        Ok(self.short_shutdown_deadline(src).into_iter().collect())
    }

    /// Contradictions between the peer keys.
    fn check_peers(&self, bad: &dyn Fn(&str, String) -> NodeError) -> Result<()> {
        let Some(listen) = self.peer_listen.addr() else {
            if !self.peers.0.is_empty() {
                return Err(bad(
                    "peers",
                    "peers are listed but `peer-listen` is off; set `peer-listen`".into(),
                ));
            }
            return Ok(());
        };
        if self.peers.0.len() > 32 {
            return Err(bad(
                "peers",
                format!("{} peers listed, at most 32", self.peers.0.len()),
            ));
        }
        for p in &self.peers.0 {
            check_peer_addr(p).map_err(|why| bad("peers", why))?;
        }
        if self.insecure_dev {
            if !listen.ip().is_loopback() {
                return Err(bad(
                    "peer-listen",
                    format!(
                        "{listen} is not a loopback address; `insecure-dev` binds loopback only"
                    ),
                ));
            }
            if let Some(p) = self.peers.0.iter().find(|p| !is_loopback_peer(p)) {
                return Err(bad(
                    "peers",
                    format!("{p} is not a loopback address; `insecure-dev` talks to loopback only"),
                ));
            }
        } else if self.tls_dir.is_none() {
            // Blamed on `peer-listen`, the key that is set (`tls-dir` is
            // not, so its source would read "built-in default": QA).
            return Err(bad(
                "peer-listen",
                "peers need `tls-dir`, which is unset: point it at the directory `kvtier cert \
                 issue --out DIR` wrote (or use `insecure-dev` on loopback)"
                    .into(),
            ));
        }
        if let Some(n) = &self.node_name {
            peer::cert::validate_name("node", n).map_err(|e| bad("node-name", e.to_string()))?;
        }
        Ok(())
    }

    /// The peer keys' own values, checked also while peers are off (a file
    /// that passes `config check` must not fail once `peer-listen` is set).
    fn check_peer_values(
        &self,
        src: &Sources,
        bad: &dyn Fn(&str, String) -> NodeError,
    ) -> Result<()> {
        for (key, d) in [
            ("peer-fetch-timeout", self.peer_fetch_timeout),
            ("peer-connect-timeout", self.peer_connect_timeout),
            ("peer-suspect-after", self.peer_suspect_after),
            ("peer-down-after", self.peer_down_after),
        ] {
            if d.0 > peer::MAX_PEER_DURATION {
                return Err(bad(key, format!("{d} is longer than the 1 day limit")));
            }
        }
        if self.peer_suspect_after.0 >= self.peer_down_after.0 {
            // Blame the one of the two a user set (the other is a default).
            let (key, other, this, that) = if src.is_default("peer-down-after") {
                (
                    "peer-suspect-after",
                    "peer-down-after",
                    self.peer_suspect_after,
                    self.peer_down_after,
                )
            } else {
                (
                    "peer-down-after",
                    "peer-suspect-after",
                    self.peer_down_after,
                    self.peer_suspect_after,
                )
            };
            let rel = if key == "peer-down-after" {
                "longer"
            } else {
                "shorter"
            };
            return Err(bad(
                key,
                format!("{this} must be {rel} than `{other}` ({that})"),
            ));
        }
        if self.peer_suspect_after.0 <= std::time::Duration::from_millis(250) {
            return Err(bad(
                "peer-suspect-after",
                "must be longer than the 250ms ping interval".into(),
            ));
        }
        for key in ["peer-fetch-timeout", "peer-connect-timeout"] {
            let d = if key == "peer-fetch-timeout" {
                self.peer_fetch_timeout
            } else {
                self.peer_connect_timeout
            };
            if d.0.is_zero() {
                return Err(bad(key, "must be larger than 0".into()));
            }
        }
        if !(1..=peer::MAX_FETCH_CONNECTIONS).contains(&self.peer_fetch_connections) {
            return Err(bad(
                "peer-fetch-connections",
                format!(
                    "{} is not between 1 and {}",
                    self.peer_fetch_connections,
                    peer::MAX_FETCH_CONNECTIONS
                ),
            ));
        }
        Ok(())
    }

    /// Checks against the machine and fills automatic values: the disk
    /// budget must fit the data dir's filesystem. Returns warnings (such as
    /// a tier not larger than the GPU KV pool) that do not prevent a start.
    pub fn resolve(&mut self, loaded: &Loaded) -> Result<Vec<String>> {
        let space = disk_space(&self.data_dir)?;
        let mut warnings = self.resolve_with(loaded, space)?;
        warnings.extend(self.sparse_store_warning());
        Ok(warnings)
    }

    /// A warning when `shutdown-deadline` leaves a stop's flush no time: a
    /// stop first gives requests in flight half the deadline (at least
    /// 1 s) and peers 1 s, and drops what is still unwritten at the
    /// deadline. Not for a RAM-only node (nothing to flush).
    fn short_shutdown_deadline(&self, src: &Sources) -> Option<String> {
        let d = self.shutdown_deadline.0;
        let has_disk = self.disk_budget.is_none_or(|b| b.0 > 0);
        (has_disk && d < std::time::Duration::from_secs(2)).then(|| {
            format!(
                "shutdown-deadline {} ({}) leaves a stop's flush no time: requests in flight get \
                 half the deadline (at least 1 s) and peers 1 s first, and what is not written \
                 at the deadline is lost; use a few seconds or more (default 30s)",
                humantime::format_duration(d),
                src.of("shutdown-deadline"),
            )
        })
    }

    /// A warning when the data dir's store file is sparse (copied without
    /// its holes) and backing it again would leave less than `disk-reserve`
    /// free: the start then leaves it sparse, and its writes pause when the
    /// filesystem fills.
    fn sparse_store_warning(&self) -> Option<String> {
        use tier::device::Sparse;
        if self.disk_budget.is_some_and(|b| b.0 == 0) {
            // RAM only: the store is not opened (its own warning says so).
            return None;
        }
        let path = self.data_dir.join(STORE_FILE);
        let md = std::fs::symlink_metadata(&path)
            .ok()
            .filter(|m| m.is_file())?;
        let file = std::fs::File::open(&path).ok()?;
        let sparse = Sparse::check(&file, md.len()).ok()??;
        let reserve = self.disk_reserve.map_or(0, |r| r.0);
        let Sparse { missing, free } = sparse;
        (!sparse.leaves(reserve)).then(|| {
            format!(
                "the store file {} is sparse: backing it again needs {} more, and the \
                 filesystem has {} free with disk-reserve {}; it is left sparse, so disk writes \
                 pause (no space) when the filesystem fills: free space, or move the data dir",
                path.display(),
                ByteSize(missing).approx(),
                ByteSize(free).approx(),
                ByteSize(reserve).approx()
            )
        })
    }

    /// [`NodeConfig::resolve`] against a given filesystem size.
    fn resolve_with(&mut self, loaded: &Loaded, space: DiskSpace) -> Result<Vec<String>> {
        let mut warnings = Vec::new();
        let margin = self
            .disk_reserve
            .map_or((space.total / 20).min(1 << 30), |r| r.0);
        // The reserve is kept of the free space only: blocks the store's
        // files hold already need no new room (QA: a store that filled its
        // budget could not restart with that budget set on a full shared
        // filesystem).
        let usable = space
            .allocated
            .saturating_add(space.free.saturating_sub(margin));
        // The effective value, so `config check` prints it.
        self.disk_reserve = Some(ByteSize(margin));
        match self.disk_budget {
            // An existing store keeps the size it was created with: the
            // automatic choice depends on free space, which changes, and the
            // store refuses to reopen with another budget.
            None if existing_store_len(&self.data_dir) >= 2 * self.region_size.0 => {
                self.disk_budget = Some(ByteSize(existing_store_len(&self.data_dir)));
            }
            None => {
                let auto = DEFAULT_DISK_BUDGET_CAP.0.min(usable / 2);
                // A new store on a small automatic budget gets smaller
                // regions, as an explicit small budget does (see `load`).
                if loaded.sources.is_default("region-size")
                    && tier::store::existing_region_size(&self.data_dir).is_none()
                {
                    self.region_size = default_region_size(ByteSize(auto));
                }
                // Whole regions only.
                let auto = auto - auto % self.region_size.0;
                if auto < 2 * self.region_size.0 {
                    return Err(NodeError::Config(format!(
                        "`disk-budget` is unset and the filesystem of data dir {} has only {} \
                         available; set `disk-budget` explicitly (0 keeps chunks in RAM only) \
                         or choose another `data-dir`",
                        self.data_dir.display(),
                        ByteSize(space.available_to_store()).approx()
                    )));
                }
                self.disk_budget = Some(ByteSize(auto));
            }
            Some(b) if b.0 > usable => {
                return Err(NodeError::Config(format!(
                    "invalid `disk-budget` ({}): {} does not fit the filesystem of data dir {}: \
                     {} available (the store's existing files hold {} and {} is free, of which \
                     `disk-reserve` {} stays free)",
                    loaded.sources.of("disk-budget"),
                    b.approx(),
                    self.data_dir.display(),
                    ByteSize(usable).approx(),
                    ByteSize(space.allocated).approx(),
                    ByteSize(space.free).approx(),
                    ByteSize(margin).approx(),
                )));
            }
            Some(b) if b.0 == 0 && existing_store_len(&self.data_dir) > 0 => {
                warnings.push(format!(
                    "disk-budget is 0 (RAM only) but data dir {} holds a store of {}: it is left \
                     as it is and unused; drop `disk-budget 0` to serve it, or remove {} to \
                     free the space",
                    self.data_dir.display(),
                    ByteSize(existing_store_len(&self.data_dir)).approx(),
                    self.data_dir.join(STORE_FILE).display(),
                ));
            }
            Some(_) => {}
        }
        if let Some(w) = self.disk_not_larger_than_ram() {
            warnings.push(w);
        }
        warnings.extend(self.peer_warnings());
        if let Some(pool) = self.gpu_kv_pool {
            let tier = self
                .ram_budget
                .0
                .saturating_add(self.disk_budget.map_or(0, |b| b.0));
            if tier <= pool.0 {
                warnings.push(format!(
                    "the tier (ram-budget {} + disk-budget {} = {}) is NOT larger than the GPU KV \
                     pool (gpu-kv-pool {}): both are LRU over the same blocks, so this tier holds a \
                     subset of what the GPU already has and will almost never serve a hit. \
                     Raise disk-budget above {}.",
                    self.ram_budget.approx(),
                    self.disk_budget.map_or(ByteSize(0), |b| b).approx(),
                    ByteSize(tier).approx(),
                    pool.approx(),
                    pool.approx(),
                ));
            }
        }
        Ok(warnings)
    }

    /// Peer settings that work but not as an operator may expect (QA).
    fn peer_warnings(&self) -> Vec<String> {
        let mut w = Vec::new();
        if self.peer_listen.addr().is_none() {
            return w;
        }
        if self.insecure_dev
            && let Some(dir) = &self.tls_dir
        {
            w.push(format!(
                "tls-dir {} is ignored with insecure-dev: this node uses a throw-away \
                 certificate in cluster \"insecure-dev\", and peers that use the cluster's \
                 certificates refuse it; drop insecure-dev to use them",
                dir.display()
            ));
        }
        if self.peer_fetch_timeout.0 < MIN_USEFUL_FETCH_TIMEOUT {
            w.push(format!(
                "peer-fetch-timeout {} is shorter than a fetch from a peer takes (a round trip \
                 and the chunk's transfer: a few ms for a few MiB): GETs of chunks that only \
                 peers hold will miss although LOOKUP reports them; use 100ms or more \
                 (default 2s)",
                self.peer_fetch_timeout,
            ));
        }
        let rate = self.peer_serve_rate.0;
        let timeout = self.peer_fetch_timeout.0.as_secs_f64();
        let in_time = (rate as f64 * timeout) as u64;
        if rate > 0 && in_time < self.region_size.0 {
            w.push(format!(
                "peer-serve-rate {}/s x peer-fetch-timeout {} serves at most {} to a peer within \
                 its timeout (if the peers use the same peer-fetch-timeout): a larger chunk is \
                 never fetched from this node, every try times out; chunks may be up to about \
                 region-size ({}), so raise peer-serve-rate to at least your largest chunk \
                 divided by peer-fetch-timeout",
                self.peer_serve_rate.approx(),
                self.peer_fetch_timeout,
                ByteSize(in_time).approx(),
                self.region_size.approx(),
            ));
        }
        w
    }

    /// A warning when the disk tier is no larger than the RAM budget plus
    /// two regions: the store then does not write again the chunks RAM
    /// holds whose disk copy was reclaimed (the rewrites would reclaim more
    /// of what RAM holds), so a restart, a clean one too, loses them.
    fn disk_not_larger_than_ram(&self) -> Option<String> {
        let disk = self.disk_budget.filter(|b| b.0 > 0)?;
        let region = self.region_size.0.max(1);
        let floor = self.ram_budget.0.saturating_add(2 * region);
        (!tier::store::rewrites_reclaimed(self.ram_budget.0, region, disk.0 / region)).then(|| {
            format!(
                "disk-budget {} is not larger than ram-budget {} plus two regions of {}: chunks \
                 RAM holds whose disk copy is reclaimed to make room are not written again (that \
                 would reclaim more of what RAM holds), so a restart, even after a clean stop, \
                 loses them; make the disk tier several times the RAM budget (disk-budget above \
                 {}) or lower ram-budget",
                disk.approx(),
                self.ram_budget.approx(),
                self.region_size.approx(),
                ByteSize(floor).approx(),
            )
        })
    }

    /// A warning when this process could not create or write the data dir
    /// (checked on the nearest existing directory): `node start` would fail
    /// to open its store. A warning, not an error: `config check` may run as
    /// another user than the service.
    pub fn data_dir_access_warning(&self) -> Option<String> {
        dir_access_warning(
            "data-dir",
            &self.data_dir,
            "the daemon must create and write its store there",
        )
    }

    /// Every directory the daemon must create or write that this user
    /// could not: the data dir, and the native socket's directory.
    pub fn access_warnings(&self) -> Vec<String> {
        let socket_dir = match self.socket.parent() {
            Some(p) if p.as_os_str().is_empty() => Path::new("."),
            Some(p) => p,
            None => Path::new("/"),
        };
        self.data_dir_access_warning()
            .into_iter()
            .chain(dir_access_warning(
                "socket",
                socket_dir,
                "the daemon must create its socket there",
            ))
            .collect()
    }

    /// The configuration as TOML (unset optional keys are omitted).
    pub fn to_toml(&self) -> String {
        toml::to_string(self).expect("NodeConfig serializes to TOML")
    }
}

/// A warning when this user could not create or write `target` (checked on
/// its nearest existing ancestor); `key` names the setting, `why` says what
/// the daemon does there.
fn dir_access_warning(key: &str, target: &Path, why: &str) -> Option<String> {
    use std::os::unix::ffi::OsStrExt;
    let mut dir = target;
    while !dir.exists() {
        dir = match dir.parent() {
            // A relative path's last parent is "": the working directory.
            Some(p) if p.as_os_str().is_empty() => Path::new("."),
            Some(p) => p,
            None => return None,
        };
    }
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: a valid NUL-terminated path; access(2) only reads it.
    let rc = unsafe { libc::access(c.as_ptr(), libc::W_OK | libc::X_OK) };
    if rc == 0 {
        return None;
    }
    let e = std::io::Error::last_os_error();
    // SAFETY: plain syscalls without arguments.
    let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
    Some(format!(
        "{key} {}: {} is not writable by this user (uid {uid}, gid {gid}: {e}); {why}: run \
         it (and this check) as the service's user, or fix the ownership",
        target.display(),
        if dir == target {
            "it".to_string()
        } else {
            format!("its parent {}", dir.display())
        },
    ))
}

/// The store file's name in the data dir (see the README, "The store on
/// disk"); it is preallocated to exactly the disk budget.
pub const STORE_FILE: &str = "store.kvt";

/// Length of an existing store in `data_dir`, 0 if there is none: what its
/// superblock describes (the file may have been grown or truncated since),
/// else the length of a file not yet formatted.
fn existing_store_len(data_dir: &Path) -> u64 {
    tier::store::existing_layout(data_dir).map_or_else(
        || std::fs::metadata(data_dir.join(STORE_FILE)).map_or(0, |m| m.len()),
        |l| l.bytes(),
    )
}

struct DiskSpace {
    total: u64,
    /// Free space (for this user).
    free: u64,
    /// What the store's files already occupy.
    allocated: u64,
}

impl DiskSpace {
    /// Free space plus what the store's files already occupy.
    fn available_to_store(&self) -> u64 {
        self.free.saturating_add(self.allocated)
    }
}

/// Space of the filesystem holding `dir` (or its nearest existing ancestor).
fn disk_space(dir: &Path) -> Result<DiskSpace> {
    let mut probe = dir.to_path_buf();
    while !probe.exists() {
        if !probe.pop() || probe.as_os_str().is_empty() {
            probe = PathBuf::from(".");
            break;
        }
    }
    let st = rustix::fs::statvfs(&probe).map_err(|e| NodeError::Io {
        op: "read the filesystem size of",
        path: probe.clone(),
        source: e.into(),
    })?;
    let frsize = st.f_frsize.max(1);
    let total = st.f_blocks.saturating_mul(frsize);
    let free = st.f_bavail.saturating_mul(frsize);
    Ok(DiskSpace {
        total,
        free,
        allocated: allocated_bytes(dir),
    })
}

/// Bytes allocated by the regular files directly in `dir` and one level
/// below (the store's files); 0 when it does not exist.
fn allocated_bytes(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let mut sum = 0u64;
    let Ok(rd) = std::fs::read_dir(dir) else {
        return 0;
    };
    for entry in rd.flatten().take(100_000) {
        let Ok(md) = entry.metadata() else { continue };
        if md.is_file() {
            sum = sum.saturating_add(md.blocks().saturating_mul(512));
        } else if md.is_dir()
            && let Ok(sub) = std::fs::read_dir(entry.path())
        {
            for e in sub.flatten().take(100_000) {
                if let Ok(m) = e.metadata()
                    && m.is_file()
                {
                    sum = sum.saturating_add(m.blocks().saturating_mul(512));
                }
            }
        }
    }
    sum
}

/// Values given on the command line; each `Some` overrides every other
/// source. The CLI fills this from its flags.
#[derive(Clone, Debug, Default, Serialize)]
#[serde(rename_all = "kebab-case")]
#[expect(
    missing_docs,
    reason = "each field is the flag of the NodeConfig key of the same name"
)]
pub struct Overrides {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub data_dir: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ram_budget: Option<ByteSize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub disk_budget: Option<ByteSize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub disk_reserve: Option<ByteSize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub region_size: Option<ByteSize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub socket: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resp_listen: Option<Listen>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resp_password: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub http_listen: Option<Listen>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu_kv_pool: Option<ByteSize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub idle_flush_after: Option<HumanDuration>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub write_policy: Option<WritePolicy>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shutdown_deadline: Option<HumanDuration>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub log_format: Option<LogFormat>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub log_level: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node_name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peer_listen: Option<Listen>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peers: Option<PeerList>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_dir: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub insecure_dev: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peer_fetch_timeout: Option<HumanDuration>,
}

/// Where the configuration comes from.
#[derive(Clone, Debug, Default)]
pub struct ConfigSources {
    /// The TOML file (`--config`); when `None`, `KVTIER_CONFIG` from `env`
    /// names it, and without that no file is read.
    pub file: Option<PathBuf>,
    /// The environment variables to consider (only `KVTIER_*` are read).
    pub env: Vec<(String, String)>,
    /// Command-line values.
    pub flags: Overrides,
}

impl ConfigSources {
    /// Sources with the current process's environment.
    pub fn from_process(file: Option<PathBuf>, flags: Overrides) -> Self {
        Self {
            file,
            env: std::env::vars_os()
                .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
                .filter(|(k, _)| k.starts_with(ENV_PREFIX))
                .collect(),
            flags,
        }
    }

    /// The value of environment variable `name` among the sources.
    fn var(&self, name: &str) -> Option<&str> {
        self.env
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// The configuration file: `--config`, else a non-empty `KVTIER_CONFIG`.
    fn config_file(&self) -> Option<PathBuf> {
        self.file.clone().or_else(|| {
            self.var(ENV_CONFIG_FILE)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        })
    }

    /// The log format the sources ask for, read as far as each source
    /// parses (flag, then environment, then the file's `log-format`), for
    /// a start whose configuration failed to load: its error is then
    /// written in that format. `None` when none says.
    pub fn requested_log_format(&self) -> Option<LogFormat> {
        if let Some(f) = self.flags.log_format {
            return Some(f);
        }
        if let Some(v) = self.var("KVTIER_LOG_FORMAT") {
            return v.trim().to_ascii_lowercase().parse().ok();
        }
        // Read as `load` reads it: bounded, never blocking on a FIFO; a file
        // that cannot be read or parsed says nothing.
        let text = read_config_file(&self.config_file()?).ok()?;
        let table: toml::Table = text.parse().ok()?;
        table.get("log-format")?.as_str()?.parse().ok()
    }
}

/// Which source a layer is; names keys for error messages.
#[derive(Clone, Debug)]
enum SourceKind {
    Defaults,
    File(PathBuf),
    Env,
    Flags,
}

impl SourceKind {
    fn describe(&self, key: &str) -> String {
        match self {
            SourceKind::Defaults => DEFAULT_SOURCE.into(),
            SourceKind::File(p) => format!("from config file {}", p.display()),
            SourceKind::Env => format!(
                "from environment variable {ENV_PREFIX}{}",
                key.to_ascii_uppercase().replace('-', "_")
            ),
            SourceKind::Flags => format!("from command-line flag --{key}"),
        }
    }
    fn name(&self) -> &'static str {
        match self {
            SourceKind::Defaults => "defaults",
            SourceKind::File(_) => "file",
            SourceKind::Env => "env",
            SourceKind::Flags => "flags",
        }
    }
}

/// One configuration source as a figment provider.
struct Layer {
    kind: SourceKind,
    dict: Dict,
}

impl Provider for Layer {
    fn metadata(&self) -> Metadata {
        let kind = self.kind.clone();
        Metadata::named(kind.name())
            .interpolater(move |_: &Profile, k: &[&str]| kind.describe(&k.join(".")))
    }
    fn data(&self) -> std::result::Result<Map<Profile, Dict>, figment::Error> {
        Ok(Profile::Default.collect(self.dict.clone()))
    }
}

/// How [`Sources::of`] names the built-in defaults.
const DEFAULT_SOURCE: &str = "built-in default";

/// Which source set each key of a loaded configuration.
#[derive(Debug)]
pub struct Sources {
    figment: Figment,
}

impl Sources {
    /// "from config file /etc/kvtier.toml", "from environment variable
    /// KVTIER_RAM_BUDGET", "from command-line flag --ram-budget" or
    /// "built-in default".
    pub fn of(&self, key: &str) -> String {
        self.figment
            .find_metadata(key)
            .map(|m| m.interpolate(&Profile::Default, &[key]))
            .unwrap_or_else(|| DEFAULT_SOURCE.into())
    }

    /// Whether `key` has its built-in default (no file, variable or flag
    /// set it).
    pub fn is_default(&self, key: &str) -> bool {
        self.of(key) == DEFAULT_SOURCE
    }
}

/// A loaded configuration and where each value came from.
#[derive(Debug)]
pub struct Loaded {
    /// The configuration.
    pub config: NodeConfig,
    /// The file read, if any.
    pub file: Option<PathBuf>,
    /// Where each key came from.
    pub sources: Sources,
    /// Warnings found so far (see also [`NodeConfig::resolve`]).
    pub warnings: Vec<String>,
}

fn dict_of<T: Serialize>(value: &T) -> Result<Dict> {
    let map = figment::providers::Serialized::defaults(value)
        .data()
        .map_err(|e| NodeError::Config(format!("internal: cannot serialize configuration: {e}")))?;
    Ok(map.into_iter().next().map(|(_, d)| d).unwrap_or_default())
}

/// Turns a figment error from one layer into a message naming key and source.
fn describe_error(err: figment::Error, kind: &SourceKind) -> NodeError {
    let msgs: Vec<String> = err
        .into_iter()
        .map(|e| {
            let key = e.path.join(".");
            match &e.kind {
                figment::error::Kind::UnknownField(field, expected) => {
                    let full =
                        if key.is_empty() || key == *field || key.ends_with(&format!(".{field}")) {
                            if key.is_empty() {
                                field.clone()
                            } else {
                                key.clone()
                            }
                        } else {
                            format!("{key}.{field}")
                        };
                    format!(
                        "unknown key `{full}` ({}); known keys: {}",
                        kind.describe(&full),
                        expected.join(", ")
                    )
                }
                other if key.is_empty() => {
                    format!("invalid configuration ({}): {other}", kind.describe(""))
                }
                other => format!("invalid `{key}` ({}): {other}", kind.describe(&key)),
            }
        })
        .collect();
    NodeError::Config(msgs.join("\n"))
}

/// Most bytes a config file may have (a full one is a few KiB).
const MAX_CONFIG_FILE: u64 = 1 << 20;

/// The text of a config file: a regular file (links followed) of at most
/// [`MAX_CONFIG_FILE`] bytes. A FIFO would block the start for good and a
/// device (`/dev/zero`) read until memory ran out.
fn read_config_file(path: &std::path::Path) -> std::io::Result<String> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)?;
    let meta = f.metadata()?;
    let invalid = |m: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, m);
    if !meta.is_file() {
        return Err(invalid(
            "not a regular file (a directory, FIFO, socket or device)".into(),
        ));
    }
    if meta.len() > MAX_CONFIG_FILE {
        return Err(invalid(format!(
            "{} bytes, more than a config file's {MAX_CONFIG_FILE}",
            meta.len()
        )));
    }
    let mut text = String::new();
    f.take(MAX_CONFIG_FILE).read_to_string(&mut text)?;
    Ok(text)
}

/// Loads and checks the configuration from its sources, with the defaults
/// of `env`. Errors name the key and the source that set it.
pub fn load(sources: &ConfigSources, env: &Environment) -> Result<Loaded> {
    load_with(sources, env, false)
}

/// [`load`] for the offline tools (`verify`, `gc`, `namespaces`), which
/// use only the store's keys: the daemon's own keys are parsed (a value of
/// the wrong type is still an error) but not checked against each other,
/// so a node whose RESP password or peer certificates come from its
/// service's environment can be verified with its config file alone (QA).
pub fn load_store_keys(sources: &ConfigSources, env: &Environment) -> Result<Loaded> {
    load_with(sources, env, true)
}

fn load_with(sources: &ConfigSources, env: &Environment, store_only: bool) -> Result<Loaded> {
    let defaults = NodeConfig::defaults_for(env);
    let mut layers = vec![Layer {
        kind: SourceKind::Defaults,
        dict: dict_of(&defaults)?,
    }];

    let file = sources.config_file();
    if let Some(path) = &file {
        let text = read_config_file(path).map_err(|e| NodeError::Io {
            op: "read config file",
            path: path.clone(),
            source: e,
        })?;
        let dict: Dict = toml::from_str(&text).map_err(|e| {
            NodeError::Config(format!(
                "config file {} is not valid TOML: {e}",
                path.display()
            ))
        })?;
        layers.push(Layer {
            kind: SourceKind::File(path.clone()),
            dict,
        });
    }

    let mut env_dict = Dict::new();
    for (k, v) in &sources.env {
        let Some(name) = k.strip_prefix(ENV_PREFIX) else {
            continue;
        };
        // The clients' and the project's scripts' own variables are not
        // daemon keys: one shell may set them and start the daemon too
        // (`KVTIER_BIN` of the test scripts made every start fail).
        if k == ENV_CONFIG_FILE || name.is_empty() || is_tool_variable(k) {
            continue;
        }
        let key = name.to_ascii_lowercase().replace('_', "-");
        // Text with a leading zero ("0660", "007") stays text: it is a mode
        // or an identifier, not a decimal number. A socket mode is always
        // octal text ("660" too), never a decimal number.
        let value: Value = if key == "socket-mode"
            || (v.len() > 1 && v.starts_with('0') && v.bytes().all(|b| b.is_ascii_digit()))
        {
            Value::from(v.clone())
        } else {
            v.parse().expect("figment's value parser is infallible")
        };
        env_dict.insert(key, value);
    }
    layers.push(Layer {
        kind: SourceKind::Env,
        dict: env_dict,
    });
    layers.push(Layer {
        kind: SourceKind::Flags,
        dict: dict_of(&sources.flags)?,
    });

    // Each layer over the defaults alone first, so that an error is blamed
    // on the source that caused it.
    let base = Figment::from(&layers[0]);
    for layer in &layers[1..] {
        if let Err(e) = base.clone().merge(layer).extract::<NodeConfig>() {
            return Err(describe_error(e, &layer.kind));
        }
    }
    let mut figment = Figment::new();
    for layer in &layers {
        figment = figment.merge(layer);
    }
    let mut config: NodeConfig = figment
        .extract()
        .map_err(|e| describe_error(e, &SourceKind::Defaults))?;
    let sources = Sources { figment };
    if sources.is_default("region-size") {
        // A store created with another default (64 MiB before 2026-12)
        // keeps its region size; an explicit one is checked at open.
        if let Some(size) = tier::store::existing_region_size(&config.data_dir) {
            config.region_size = ByteSize(size);
        } else if let Some(budget) = config.disk_budget.filter(|b| b.0 != 0) {
            config.region_size = default_region_size(budget);
        }
    }
    let mut warnings = if store_only {
        config.check_store(&sources)?;
        Vec::new()
    } else {
        config.check_static(&sources)?
    };
    if let Some(total) = env.mem_total
        && config.ram_budget.0 > total
    {
        warnings.push(format!(
            "ram-budget ({}) is more than this machine's memory ({}): the kernel will swap or kill the daemon before the cache fills",
            config.ram_budget,
            ByteSize(total).approx()
        ));
    }
    Ok(Loaded {
        config,
        file,
        sources,
        warnings,
    })
}

/// Under this, a `peer-fetch-timeout` is warned about: no fetch of a
/// chunk from a peer completes in time.
const MIN_USEFUL_FETCH_TIMEOUT: std::time::Duration = std::time::Duration::from_millis(10);

/// The longest `shutdown-deadline` (humantime takes centuries: such a
/// deadline once overflowed an instant and panicked the stop, losing the
/// dirty set: QA).
const MAX_SHUTDOWN_DEADLINE: std::time::Duration = std::time::Duration::from_secs(86_400);

/// `region-size` of a new store with a disk budget of 2 GiB or more.
const DEFAULT_REGION_SIZE: u64 = 256 << 20;

/// The region size of a new store when `region-size` is unset: 256 MiB, or
/// for a disk budget under 2 GiB the power of two nearest below an eighth
/// of it (at least 1 MiB), so that a small store still has several regions
/// to evict one at a time instead of refusing to start.
fn default_region_size(disk_budget: ByteSize) -> ByteSize {
    const MIN: u64 = 1 << 20;
    let eighth = disk_budget.0 / 8;
    let pow2 = if eighth == 0 {
        0
    } else {
        1 << (63 - eighth.leading_zeros())
    };
    ByteSize(pow2.clamp(MIN, DEFAULT_REGION_SIZE))
}

/// Whether `p` is a `peers` entry: host:port with a port of 1 to 65535
/// (the `--peers` flag's parser uses it too); why not, otherwise.
pub fn check_peer_addr(p: &str) -> std::result::Result<(), String> {
    let Some((host, port)) = p.rsplit_once(':') else {
        return Err(format!("{p:?} is not host:port"));
    };
    if host.is_empty() || !port.parse::<u16>().is_ok_and(|n| n > 0) {
        return Err(format!("{p:?} is not host:port with a port of 1 to 65535"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 100 GiB filesystem with 40 GiB free for the store.
    fn roomy() -> DiskSpace {
        DiskSpace {
            total: 100 << 30,
            free: 40 << 30,
            allocated: 0,
        }
    }

    fn env() -> Environment {
        Environment {
            home: Some("/home/u".into()),
            mem_total: Some(64 << 30),
            ..Default::default()
        }
    }

    fn load_with(file: Option<&str>, vars: &[(&str, &str)], flags: Overrides) -> Result<Loaded> {
        let dir = tempfile::tempdir().unwrap();
        let path = file.map(|text| {
            let p = dir.path().join("node.toml");
            std::fs::write(&p, text).unwrap();
            p
        });
        let sources = ConfigSources {
            file: path,
            env: vars
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            flags,
        };
        load(&sources, &env())
    }

    fn err_of(r: Result<Loaded>) -> String {
        match r {
            Ok(l) => panic!("expected an error, got {:?}", l.config),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn defaults_depend_on_the_environment() {
        let c = NodeConfig::defaults_for(&env());
        assert_eq!(c.data_dir, PathBuf::from("/home/u/.local/share/kvtier"));
        assert_eq!(
            c.socket,
            PathBuf::from("/home/u/.local/share/kvtier/kvtier.sock")
        );
        assert_eq!(c.ram_budget, ByteSize::gib(4));
        let small = Environment {
            mem_total: Some(8 << 30),
            xdg_runtime_dir: Some("/run/user/7".into()),
            xdg_data_home: Some("/d".into()),
            ..env()
        };
        let c = NodeConfig::defaults_for(&small);
        assert_eq!(c.ram_budget, ByteSize::gib(2));
        assert_eq!(c.socket, PathBuf::from("/run/user/7/kvtier/kvtier.sock"));
        assert_eq!(c.data_dir, PathBuf::from("/d/kvtier"));
        let root = Environment {
            root: true,
            ..small
        };
        let c = NodeConfig::defaults_for(&root);
        assert_eq!(c.data_dir, PathBuf::from("/var/lib/kvtier"));
        assert_eq!(c.socket, PathBuf::from("/run/kvtier/kvtier.sock"));
        let systemd = Environment {
            state_directory: Some("/var/lib/kvtier".into()),
            runtime_directory: Some("/run/kvtier".into()),
            ..env()
        };
        let c = NodeConfig::defaults_for(&systemd);
        assert_eq!(c.socket, PathBuf::from("/run/kvtier/kvtier.sock"));
    }

    #[test]
    fn no_sources_gives_the_defaults() {
        let l = load_with(None, &[], Overrides::default()).unwrap();
        assert_eq!(l.config, NodeConfig::defaults_for(&env()));
        assert!(l.file.is_none());
        assert_eq!(l.sources.of("ram-budget"), "built-in default");
    }

    #[test]
    fn precedence_is_defaults_file_env_flags() {
        let file = "ram-budget = \"1GiB\"\nresp-listen = \"127.0.0.1:1111\"\nhttp-listen = \"off\"\nlog-level = \"debug\"\n";
        let vars = [
            ("KVTIER_RESP_LISTEN", "127.0.0.1:2222"),
            ("KVTIER_LOG_LEVEL", "warn"),
            ("OTHER", "x"),
        ];
        let flags = Overrides {
            log_level: Some("error".into()),
            ..Default::default()
        };
        let l = load_with(Some(file), &vars, flags).unwrap();
        assert_eq!(l.config.ram_budget, ByteSize::gib(1));
        assert_eq!(l.config.http_listen, Listen::Off);
        assert_eq!(l.config.resp_listen, "127.0.0.1:2222".parse().unwrap());
        assert_eq!(l.config.log_level, "error");
        assert!(
            l.sources.of("ram-budget").contains("node.toml"),
            "{}",
            l.sources.of("ram-budget")
        );
        assert_eq!(
            l.sources.of("resp-listen"),
            "from environment variable KVTIER_RESP_LISTEN"
        );
        assert_eq!(
            l.sources.of("log-level"),
            "from command-line flag --log-level"
        );
        assert_eq!(l.sources.of("socket"), "built-in default");
    }

    /// A new store with a small disk budget and no `region-size` gets
    /// smaller regions instead of a refusal; an explicit size stays (and
    /// is checked against the budget).
    #[test]
    fn a_small_disk_budget_gets_smaller_default_regions() {
        let dir = tempfile::tempdir().unwrap();
        let with = |budget: ByteSize, region: Option<ByteSize>| {
            load_with(
                None,
                &[],
                Overrides {
                    data_dir: Some(dir.path().join("data")),
                    disk_budget: Some(budget),
                    region_size: region,
                    ..Default::default()
                },
            )
        };
        for (budget, region) in [
            (ByteSize::mib(256), ByteSize::mib(32)),
            (ByteSize::mib(300), ByteSize::mib(32)),
            (ByteSize::mib(3), ByteSize::mib(1)),
            (ByteSize::gib(1), ByteSize::mib(128)),
            (ByteSize::gib(2), ByteSize::mib(256)),
            (ByteSize::gib(500), ByteSize::mib(256)),
        ] {
            let l = with(budget, None).unwrap();
            assert_eq!(l.config.region_size, region, "disk-budget {budget}");
        }
        // RAM only: the default stays.
        assert_eq!(
            with(ByteSize(0), None).unwrap().config.region_size,
            ByteSize::mib(256)
        );
        // Too small for two regions of even 1 MiB.
        let e = err_of(with(ByteSize::kib(1536), None));
        assert!(
            e.contains("disk-budget") && e.contains("two regions"),
            "{e}"
        );
        // Explicit: kept, and refused when the budget cannot hold two.
        let e = err_of(with(ByteSize::mib(256), Some(ByteSize::mib(256))));
        assert!(e.contains("two regions of region-size (256MiB)"), "{e}");
        let l = with(ByteSize::mib(256), Some(ByteSize::mib(64))).unwrap();
        assert_eq!(l.config.region_size, ByteSize::mib(64));
    }

    /// A data dir that is a file is refused by `config check` as by
    /// `node start`; a RAM budget beyond the machine's memory is a warning.
    #[test]
    fn a_file_as_data_dir_and_an_oversized_ram_budget_are_reported() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("afile");
        std::fs::write(&file, b"x").unwrap();
        let e = err_of(load_with(
            None,
            &[],
            Overrides {
                data_dir: Some(file),
                ..Default::default()
            },
        ));
        assert!(
            e.contains("`data-dir`") && e.contains("is not a directory"),
            "{e}"
        );
        // The test environment has 64 GiB.
        let l = load_with(
            None,
            &[],
            Overrides {
                ram_budget: Some(ByteSize::gib(100)),
                ..Default::default()
            },
        )
        .unwrap();
        assert!(
            l.warnings
                .iter()
                .any(|w| w.contains("more than this machine's memory")),
            "{:?}",
            l.warnings
        );
        let l = load_with(None, &[], Overrides::default()).unwrap();
        assert!(!l.warnings.iter().any(|w| w.contains("machine's memory")));
    }

    #[test]
    fn every_key_is_settable_from_the_environment() {
        let vars = [
            ("KVTIER_DATA_DIR", "/tmp/x"),
            ("KVTIER_RAM_BUDGET", "512MiB"),
            ("KVTIER_DISK_BUDGET", "1073741824"),
            ("KVTIER_REGION_SIZE", "8MiB"),
            ("KVTIER_DIRECT_IO", "false"),
            ("KVTIER_HUGE_PAGES", "false"),
            ("KVTIER_IDLE_FLUSH_AFTER", "1h"),
            ("KVTIER_WRITE_POLICY", "backpressure"),
            ("KVTIER_GPU_KV_POOL", "80GB"),
            ("KVTIER_SOCKET", "/tmp/x/s.sock"),
            ("KVTIER_SOCKET_MODE", "0600"),
            ("KVTIER_RESP_LISTEN", "[::1]:0"),
            ("KVTIER_RESP_PASSWORD", "1234"),
            ("KVTIER_RESP_MAX_VALUE", "1MiB"),
            ("KVTIER_HTTP_LISTEN", "off"),
            ("KVTIER_SHUTDOWN_DEADLINE", "5s"),
            ("KVTIER_LOG_FORMAT", "json"),
            ("KVTIER_LOG_LEVEL", "debug"),
            ("KVTIER_NODE_NAME", "spark1"),
        ];
        let c = load_with(None, &vars, Overrides::default()).unwrap().config;
        assert_eq!(c.data_dir, PathBuf::from("/tmp/x"));
        assert_eq!(c.ram_budget, ByteSize::mib(512));
        assert_eq!(c.disk_budget, Some(ByteSize::gib(1)));
        assert_eq!(c.region_size, ByteSize::mib(8));
        assert!(!c.direct_io);
        assert!(!c.huge_pages && !c.tier_config().huge_pages);
        assert_eq!(c.idle_flush_after, HumanDuration::secs(3600));
        assert_eq!(c.write_policy, WritePolicy::Backpressure);
        assert_eq!(c.gpu_kv_pool, Some(ByteSize(80_000_000_000)));
        assert_eq!(c.socket_mode, FileMode(0o600));
        assert_eq!(c.resp_listen, "[::1]:0".parse().unwrap());
        assert_eq!(c.resp_password.as_deref(), Some("1234"));
        assert_eq!(c.http_listen, Listen::Off);
        assert_eq!(c.shutdown_deadline, HumanDuration::secs(5));
        assert_eq!(c.log_format, LogFormat::Json);
        assert_eq!(c.node_name.as_deref(), Some("spark1"));
        // A mode without its leading zero is octal too, as `chmod` reads it.
        for (text, mode) in [("660", 0o660), ("777", 0o777), ("0o640", 0o640)] {
            let vars = [("KVTIER_SOCKET_MODE", text)];
            let c = load_with(None, &vars, Overrides::default())
                .unwrap_or_else(|e| panic!("{text}: {e}"))
                .config;
            assert_eq!(c.socket_mode, FileMode(mode), "{text}");
        }
        let vars = [("KVTIER_SOCKET_MODE", "999")];
        let e = load_with(None, &vars, Overrides::default()).unwrap_err();
        assert!(e.to_string().contains("octal digits"), "{e}");
        let vars = [("KVTIER_SOCKET_MODE", "1777")];
        let e = load_with(None, &vars, Overrides::default()).unwrap_err();
        assert!(e.to_string().contains("sticky bits"), "{e}");
        // The TOML rendering parses back to the same configuration.
        let back = load_with(Some(&c.to_toml()), &[], Overrides::default())
            .unwrap()
            .config;
        assert_eq!(back, c);
    }

    #[test]
    fn unknown_keys_name_the_key_and_the_source() {
        let e = err_of(load_with(
            Some("ram-budjet = \"1GiB\"\n"),
            &[],
            Overrides::default(),
        ));
        assert!(
            e.contains("unknown key `ram-budjet`") && e.contains("node.toml"),
            "{e}"
        );
        assert!(e.contains("ram-budget"), "lists the known keys: {e}");
        let e = err_of(load_with(
            None,
            &[("KVTIER_RAM_BUDJET", "1GiB")],
            Overrides::default(),
        ));
        assert!(
            e.contains("`ram-budjet`") && e.contains("KVTIER_RAM_BUDJET"),
            "{e}"
        );
        let e = err_of(load_with(
            Some("[tier]\nram = 1\n"),
            &[],
            Overrides::default(),
        ));
        assert!(e.contains("unknown key `tier`"), "{e}");
    }

    #[test]
    fn invalid_values_name_the_key_and_the_source() {
        let e = err_of(load_with(
            Some("ram-budget = \"12XB\"\n"),
            &[],
            Overrides::default(),
        ));
        assert!(
            e.contains("`ram-budget`") && e.contains("node.toml") && e.contains("12XB"),
            "{e}"
        );
        let e = err_of(load_with(
            None,
            &[("KVTIER_IDLE_FLUSH_AFTER", "30")],
            Overrides::default(),
        ));
        assert!(
            e.contains("`idle-flush-after`") && e.contains("KVTIER_IDLE_FLUSH_AFTER"),
            "{e}"
        );
        let e = err_of(load_with(
            None,
            &[("KVTIER_WRITE_POLICY", "fast")],
            Overrides::default(),
        ));
        assert!(e.contains("`write-policy`") && e.contains("no-tax"), "{e}");
        let e = err_of(load_with(
            None,
            &[("KVTIER_RESP_LISTEN", "localhost")],
            Overrides::default(),
        ));
        assert!(e.contains("`resp-listen`") && e.contains("\"off\""), "{e}");
        let e = err_of(load_with(
            Some("direct-io = \"yes\"\n"),
            &[],
            Overrides::default(),
        ));
        assert!(e.contains("`direct-io`"), "{e}");
        // Messages name what was expected, never a Rust type.
        for (toml, what) in [
            ("[peers]\nfoo = 1\n", "list of \"host:port\""),
            ("socket-mode = [1]\n", "octal digits"),
            ("node-name = { a = 1 }\n", "expected a string"),
        ] {
            let e = err_of(load_with(Some(toml), &[], Overrides::default()));
            assert!(e.contains(what) && !e.contains("enum"), "{toml}: {e}");
        }
        let e = err_of(load_with(
            Some("ram-budget = \n"),
            &[],
            Overrides::default(),
        ));
        assert!(
            e.contains("not valid TOML") && e.contains("node.toml"),
            "{e}"
        );
        let e = err_of(load_with(
            None,
            &[("KVTIER_LOG_LEVEL", "loud=!!")],
            Overrides::default(),
        ));
        assert!(
            e.contains("`log-level`") && e.contains("KVTIER_LOG_LEVEL"),
            "{e}"
        );
        let e = err_of(load_with(
            None,
            &[("KVTIER_NATIVE_SPIN", "2ms")],
            Overrides::default(),
        ));
        assert!(e.contains("native-spin") && e.contains("1ms"), "{e}");
        let c = load_with(Some("native-spin = \"50us\"\n"), &[], Overrides::default())
            .expect("50us is a valid spin");
        assert_eq!(c.config.native_spin.0, Duration::from_micros(50));
        // The clients' and scripts' variables in the daemon's environment
        // are not keys; a misspelt key still is an error.
        let c = load_with(
            None,
            &[
                ("KVTIER_CLIENT_SPIN_US", "0"),
                ("KVTIER_BIN", "/x"),
                ("KVTIER_BENCH_CELLS", "8"),
            ],
            Overrides::default(),
        )
        .expect("client and script variables are ignored");
        assert_eq!(c.config.native_spin.0, Duration::from_micros(50));
        let e = err_of(load_with(
            None,
            &[("KVTIER_RAM_BUDGT", "1GiB")],
            Overrides::default(),
        ));
        assert!(e.contains("KVTIER_RAM_BUDGT"), "{e}");
    }

    /// QA: a `shutdown-deadline` of centuries was accepted and panicked the
    /// stop (`now + d` overflowed), losing the dirty set; a `region-size`
    /// over 1 GiB passed `config check` and was refused by the store at
    /// `node start`, with another minimum. Both are refused at load.
    #[test]
    fn shutdown_deadlines_past_a_day_and_regions_past_a_gib_are_refused() {
        let e = err_of(load_with(
            Some("shutdown-deadline = \"500years\"\n"),
            &[],
            Overrides::default(),
        ));
        assert!(
            e.contains("shutdown-deadline") && e.contains("1 day"),
            "{e}"
        );
        load_with(
            Some("shutdown-deadline = \"1day\"\n"),
            &[],
            Overrides::default(),
        )
        .expect("a day is accepted");
        for size in [ByteSize::gib(2), ByteSize((1 << 30) + 4096)] {
            let flags = Overrides {
                region_size: Some(size),
                ..Overrides::default()
            };
            let e = err_of(load_with(None, &[], flags));
            assert!(
                e.contains("region-size") && e.contains("at most 1GiB"),
                "{size}: {e}"
            );
        }
    }

    /// QA: with `ram-budget` at u64::MAX the budget sums wrapped: a false
    /// "tier NOT larger than the GPU KV pool" and no disk-vs-RAM warning.
    #[test]
    fn budget_sums_saturate() {
        let flags = Overrides {
            ram_budget: Some(ByteSize(u64::MAX)),
            disk_budget: Some(ByteSize::mib(4)),
            region_size: Some(ByteSize::mib(1)),
            gpu_kv_pool: Some(ByteSize::gib(16)),
            ..Overrides::default()
        };
        let l = load_with(None, &[], flags).unwrap();
        let w = l.config.clone().resolve_with(&l, roomy()).unwrap();
        assert!(!w.iter().any(|w| w.contains("GPU KV pool")), "{w:?}");
        assert!(
            w.iter()
                .any(|w| w.contains("is not larger than ram-budget")),
            "{w:?}"
        );
    }

    /// Peer durations that `now + d` would overflow (humantime takes
    /// centuries) are refused, naming the key: they panicked a GET or the
    /// membership timer.
    #[test]
    fn peer_durations_past_a_day_are_refused_naming_the_key() {
        for key in [
            "peer-fetch-timeout",
            "peer-connect-timeout",
            "peer-suspect-after",
            "peer-down-after",
        ] {
            let file = format!("{key} = \"500years\"\n");
            let e = err_of(load_with(Some(&file), &[], Overrides::default()));
            assert!(e.contains(key) && e.contains("1 day"), "{key}: {e}");
        }
        let c = load_with(
            Some("peer-down-after = \"1day\"\npeer-fetch-timeout = \"1h\"\n"),
            &[],
            Overrides::default(),
        )
        .expect("a day is accepted");
        assert_eq!(c.config.peer_down_after.0, Duration::from_secs(86_400));
    }

    #[test]
    fn a_failed_load_still_tells_the_log_format_asked_for() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("node.toml");
        std::fs::write(&file, "log-format = \"json\"\nram_budget = \"1GiB\"\n").unwrap();
        let sources = |file: Option<&Path>, env: &[(&str, &str)], flag: Option<LogFormat>| {
            ConfigSources {
                file: file.map(Path::to_path_buf),
                env: env
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
                flags: Overrides {
                    log_format: flag,
                    ..Default::default()
                },
            }
            .requested_log_format()
        };
        let json = Some(LogFormat::Json);
        assert_eq!(sources(Some(&file), &[], None), json, "the file's key");
        let path = file.to_string_lossy().into_owned();
        assert_eq!(sources(None, &[("KVTIER_CONFIG", &path)], None), json);
        assert_eq!(sources(None, &[("KVTIER_LOG_FORMAT", "json")], None), json);
        assert_eq!(
            sources(Some(&file), &[("KVTIER_LOG_FORMAT", "human")], None),
            Some(LogFormat::Human),
            "the environment over the file"
        );
        assert_eq!(
            sources(Some(&file), &[], Some(LogFormat::Human)),
            Some(LogFormat::Human),
            "the flag over all"
        );
        std::fs::write(&file, "log-format = [unparsable\n").unwrap();
        assert_eq!(sources(Some(&file), &[], None), None);
        assert_eq!(sources(None, &[], None), None);
        // A FIFO says nothing, and never blocks the failed start.
        let fifo = dir.path().join("fifo.toml");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: `c` is a NUL-terminated path that outlives the call.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(
                ConfigSources {
                    file: Some(fifo),
                    ..Default::default()
                }
                .requested_log_format(),
            );
        });
        assert_eq!(rx.recv_timeout(Duration::from_secs(10)), Ok(None));
    }

    #[test]
    fn contradictions_name_the_key_and_the_source() {
        let flags = Overrides {
            ram_budget: Some(ByteSize::kib(4)),
            ..Default::default()
        };
        let e = err_of(load_with(None, &[], flags));
        assert!(
            e.contains("`ram-budget`") && e.contains("--ram-budget"),
            "{e}"
        );
        let e = err_of(load_with(
            Some("resp-listen = \"0.0.0.0:6380\"\n"),
            &[],
            Overrides::default(),
        ));
        assert!(
            e.contains("`resp-listen`") && e.contains("resp-password") && e.contains("node.toml"),
            "{e}"
        );
        let ok = load_with(
            Some("resp-listen = \"0.0.0.0:6380\"\n"),
            &[("KVTIER_RESP_PASSWORD", "s3cret")],
            Overrides::default(),
        );
        assert!(ok.is_ok());
        let e = err_of(load_with(
            Some("disk-budget = \"64MiB\"\nregion-size = \"64MiB\"\n"),
            &[],
            Overrides::default(),
        ));
        assert!(
            e.contains("`disk-budget`") && e.contains("two regions"),
            "{e}"
        );
        let e = err_of(load_with(
            Some("socket-mode = \"0066\"\n"),
            &[],
            Overrides::default(),
        ));
        assert!(e.contains("`socket-mode`"), "{e}");
        let long = format!("socket = \"/tmp/{}\"\n", "s".repeat(120));
        let e = err_of(load_with(Some(&long), &[], Overrides::default()));
        assert!(e.contains("`socket`") && e.contains("107"), "{e}");
    }

    #[test]
    fn missing_config_file_is_an_error() {
        let sources = ConfigSources {
            file: Some("/nonexistent/kvtier.toml".into()),
            ..Default::default()
        };
        let e = load(&sources, &env()).unwrap_err().to_string();
        assert!(e.contains("/nonexistent/kvtier.toml"), "{e}");
        let sources = ConfigSources {
            env: vec![("KVTIER_CONFIG".into(), "/nonexistent/b.toml".into())],
            ..Default::default()
        };
        let e = load(&sources, &env()).unwrap_err().to_string();
        assert!(e.contains("/nonexistent/b.toml"), "{e}");
    }

    /// Peer values are checked while peers are off too (a file that passed
    /// `config check` failed once `peer-listen` was set), and a
    /// contradiction names the key the user set, not the default (QA).
    #[test]
    fn peer_values_are_checked_without_peers_and_blame_the_key_set() {
        for (toml, key, what) in [
            (
                "peer-fetch-connections = 17\n",
                "`peer-fetch-connections` (from config file",
                "between 1 and",
            ),
            (
                "peer-suspect-after = \"5s\"\n",
                "`peer-suspect-after` (from config file",
                "shorter than `peer-down-after`",
            ),
            (
                "peer-suspect-after = \"1s\"\npeer-down-after = \"1s\"\n",
                "`peer-down-after` (from config file",
                "longer than `peer-suspect-after`",
            ),
            (
                "peer-connect-timeout = \"0s\"\n",
                "`peer-connect-timeout`",
                "larger than 0",
            ),
        ] {
            let e = err_of(load_with(Some(toml), &[], Overrides::default()));
            assert!(e.contains(key) && e.contains(what), "{toml}: {e}");
        }
    }

    /// A FIFO as the config file blocked the start for good, and a device
    /// (`/dev/zero`) read until memory ran out (QA).
    #[test]
    fn a_config_file_must_be_a_small_regular_file() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("f.toml");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: plain syscall on a valid C string.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let big = dir.path().join("big.toml");
        std::fs::write(&big, vec![b'#'; 2 << 20]).unwrap();
        for (path, why) in [
            (fifo.as_path(), "not a regular file"),
            (std::path::Path::new("/dev/zero"), "not a regular file"),
            (dir.path(), "not a regular file"),
            (big.as_path(), "more than a config file's"),
        ] {
            let sources = ConfigSources {
                file: Some(path.to_path_buf()),
                ..Default::default()
            };
            let e = load(&sources, &env()).unwrap_err().to_string();
            assert!(e.contains(why), "{path:?}: {e}");
        }
    }

    #[test]
    fn a_sparse_store_that_backing_would_push_into_the_reserve_is_warned_about() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = NodeConfig::defaults_for(&Environment::default());
        c.data_dir = dir.path().to_path_buf();
        assert_eq!(c.sparse_store_warning(), None, "no store");
        // A store file with no blocks: all of it is a hole.
        let f = std::fs::File::create(dir.path().join(STORE_FILE)).unwrap();
        f.set_len(64 << 20).unwrap();
        c.disk_reserve = Some(ByteSize(0));
        assert_eq!(c.sparse_store_warning(), None, "64 MiB fits");
        c.disk_reserve = Some(ByteSize(1 << 60));
        let w = c.sparse_store_warning().expect("a warning");
        assert!(
            w.contains("is sparse") && w.contains("64.0 MiB more"),
            "{w}"
        );
        c.disk_budget = Some(ByteSize(0));
        assert_eq!(c.sparse_store_warning(), None, "RAM only: not opened");
    }

    #[test]
    fn a_data_dir_that_cannot_be_created_is_warned_about() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = NodeConfig::defaults_for(&Environment::default());
        c.data_dir = dir.path().join("new").join("data");
        assert_eq!(c.data_dir_access_warning(), None, "creatable");
        // Below a regular file: nobody can create it, root included.
        std::fs::write(dir.path().join("file"), b"x").unwrap();
        c.data_dir = dir.path().join("file").join("data");
        let w = c.data_dir_access_warning().expect("a warning");
        assert!(
            w.contains("not writable") && w.contains("its parent"),
            "{w}"
        );
        // The socket's directory likewise.
        c.data_dir = dir.path().join("data");
        c.socket = dir.path().join("run").join("kvtier.sock");
        assert_eq!(c.access_warnings(), Vec::<String>::new());
        c.socket = dir.path().join("file").join("kvtier.sock");
        let w = c.access_warnings();
        assert!(
            w.len() == 1 && w[0].starts_with("socket ") && w[0].contains("create its socket"),
            "{w:?}"
        );
    }

    #[test]
    fn a_ram_only_start_over_an_existing_store_warns() {
        let dir = tempfile::tempdir().unwrap();
        let flags = Overrides {
            data_dir: Some(dir.path().to_path_buf()),
            disk_budget: Some(ByteSize(0)),
            ..Default::default()
        };
        let l = load_with(None, &[], flags).unwrap();
        assert!(
            l.config
                .clone()
                .resolve_with(&l, roomy())
                .unwrap()
                .is_empty()
        );
        std::fs::write(dir.path().join(STORE_FILE), vec![0u8; 1 << 20]).unwrap();
        let w = l.config.clone().resolve_with(&l, roomy()).unwrap();
        assert!(
            w.len() == 1 && w[0].contains("holds a store of 1.0 MiB") && w[0].contains("unused"),
            "{w:?}"
        );
    }

    /// Peer settings that cannot work as meant are warned about (QA): a
    /// `tls-dir` that `insecure-dev` ignores, and a serve rate too slow to
    /// send a large chunk within the fetch timeout.
    #[test]
    fn peer_settings_that_cannot_work_as_meant_are_warned_about() {
        let dir = tempfile::tempdir().unwrap();
        let warnings = |vars: &[(&str, &str)]| {
            let flags = Overrides {
                data_dir: Some(dir.path().join("data")),
                region_size: Some(ByteSize::mib(64)),
                ..Default::default()
            };
            let l = load_with(None, vars, flags).unwrap();
            l.config.clone().resolve_with(&l, roomy()).unwrap()
        };
        let dev = [
            ("KVTIER_PEER_LISTEN", "127.0.0.1:0"),
            ("KVTIER_INSECURE_DEV", "true"),
        ];
        assert!(warnings(&dev).is_empty(), "{:?}", warnings(&dev));
        let w = warnings(&[dev[0], dev[1], ("KVTIER_TLS_DIR", "/etc/kvtier/tls")]);
        assert!(
            w.len() == 1 && w[0].contains("tls-dir /etc/kvtier/tls is ignored with insecure-dev"),
            "{w:?}"
        );
        // 16 MiB/s for 2 s: 32 MiB, under the 64 MiB regions.
        let w = warnings(&[dev[0], dev[1], ("KVTIER_PEER_SERVE_RATE", "16MiB")]);
        assert!(
            w.len() == 1 && w[0].contains("serves at most 32.0 MiB"),
            "{w:?}"
        );
        assert!(warnings(&[dev[0], dev[1], ("KVTIER_PEER_SERVE_RATE", "32MiB")]).is_empty());
        // QA: a 1ns fetch timeout made every GET of a peer's chunk miss
        // while LOOKUP reported it, without a word.
        let w = warnings(&[dev[0], dev[1], ("KVTIER_PEER_FETCH_TIMEOUT", "1ns")]);
        assert!(
            w.iter()
                .any(|w| w.contains("peer-fetch-timeout 1ns is shorter")),
            "{w:?}"
        );
        assert!(warnings(&[dev[0], dev[1], ("KVTIER_PEER_FETCH_TIMEOUT", "100ms")]).is_empty());
        // Without a peer listener neither applies.
        assert!(warnings(&[("KVTIER_PEER_SERVE_RATE", "16MiB")]).is_empty());
    }

    /// A disk tier no larger than RAM plus two regions is warned about (a
    /// restart loses what RAM held beyond the disk's copies: QA saw 63 % of
    /// the keys gone after a clean stop, with nothing said).
    #[test]
    fn a_disk_no_larger_than_ram_is_warned_about() {
        let dir = tempfile::tempdir().unwrap();
        for (disk, warned) in [(32, true), (72, true), (80, false), (1024, false)] {
            let flags = Overrides {
                data_dir: Some(dir.path().join("data")),
                ram_budget: Some(ByteSize::mib(64)),
                disk_budget: Some(ByteSize::mib(disk)),
                region_size: Some(ByteSize::mib(4)),
                ..Default::default()
            };
            let l = load_with(None, &[], flags).unwrap();
            let w = l.config.clone().resolve_with(&l, roomy()).unwrap();
            let said = w
                .iter()
                .any(|w| w.contains("is not larger than ram-budget"));
            assert_eq!(said, warned, "disk {disk} MiB: {w:?}");
            // One line of prose (a lost line continuation left runs of
            // spaces in it: QA).
            assert!(w.iter().all(|w| !w.contains("  ")), "{w:?}");
        }
    }

    #[test]
    fn a_shutdown_deadline_that_leaves_the_flush_no_time_is_warned_about() {
        let dir = tempfile::tempdir().unwrap();
        for (deadline, disk, warned) in [
            ("0s", None, true),
            ("1500ms", Some(64), true),
            ("0s", Some(0), false),
            ("2s", None, false),
            ("30s", None, false),
        ] {
            let flags = Overrides {
                data_dir: Some(dir.path().join("data")),
                disk_budget: disk.map(ByteSize::mib),
                shutdown_deadline: Some(deadline.parse().unwrap()),
                ..Default::default()
            };
            let l = load_with(None, &[], flags).unwrap();
            let said = l
                .warnings
                .iter()
                .any(|w| w.contains("leaves a stop's flush no time") && w.contains("flag"));
            assert_eq!(said, warned, "{deadline}, disk {disk:?}: {:?}", l.warnings);
        }
    }

    #[test]
    fn resolve_fills_the_disk_budget_and_rejects_what_does_not_fit() {
        let dir = tempfile::tempdir().unwrap();
        let flags = Overrides {
            data_dir: Some(dir.path().join("data")),
            ..Default::default()
        };
        // A 100 GiB filesystem with 40 GiB free: the reserve is 1 GiB.
        let mut l = load_with(None, &[], flags.clone()).unwrap();
        let mut c = l.config.clone();
        let w = c.resolve_with(&l, roomy()).unwrap();
        assert_eq!(c.disk_budget, Some(DEFAULT_DISK_BUDGET_CAP));
        assert!(w.is_empty(), "{w:?}");
        // 10 GiB free: half of what is left after the reserve, whole regions.
        let mut c = l.config.clone();
        let some = DiskSpace {
            total: 100 << 30,
            free: 10 << 30,
            allocated: 0,
        };
        c.resolve_with(&l, some).unwrap();
        assert_eq!(c.disk_budget, Some(ByteSize(9 << 29)));

        // Too little room for two regions: the error says what to set.
        let tight = || DiskSpace {
            total: 100 << 30,
            free: 1 << 30,
            allocated: 0,
        };
        let e = l.config.clone().resolve_with(&l, tight()).unwrap_err();
        assert!(
            e.to_string().contains("set `disk-budget` explicitly"),
            "{e}"
        );
        // 2 GiB free: an automatic 512 MiB budget gets 64 MiB regions (eight
        // of them), as an explicit one would.
        let small = DiskSpace {
            total: 100 << 30,
            free: 2 << 30,
            allocated: 0,
        };
        let mut c_small = l.config.clone();
        c_small.resolve_with(&l, small).unwrap();
        assert_eq!(c_small.disk_budget, Some(ByteSize::mib(512)));
        assert_eq!(c_small.region_size, ByteSize::mib(64));

        // A store that fills its budget on a full filesystem restarts with
        // that budget set: its blocks are allocated, the reserve is kept of
        // the free space only (QA: refused until 20 MiB were freed). One
        // more region would need new room, which is not there.
        let full = || DiskSpace {
            total: 300 << 20,
            free: 0,
            allocated: 240 << 20,
        };
        for (budget, fits) in [(240u64 << 20, true), (256 << 20, false)] {
            let same = Overrides {
                disk_budget: Some(ByteSize(budget)),
                ..flags.clone()
            };
            let l = load_with(None, &[], same).unwrap();
            let r = l.config.clone().resolve_with(&l, full());
            assert_eq!(r.is_ok(), fits, "{budget}: {r:?}");
        }

        let huge = Overrides {
            disk_budget: Some(ByteSize(1 << 60)),
            ..flags.clone()
        };
        l = load_with(None, &[], huge).unwrap();
        let e = l.config.clone().resolve_with(&l, roomy()).unwrap_err();
        let e = e.to_string();
        assert!(
            e.contains("`disk-budget`") && e.contains("--disk-budget") && e.contains("available"),
            "{e}"
        );
        // The real filesystem cannot hold an exbibyte either.
        assert!(l.config.clone().resolve(&l).is_err());

        // The reserve: 768 MiB fit 1 GiB free only with a reserve of at most 256 MiB.
        let fits = |reserve: Option<ByteSize>| {
            let l = load_with(
                None,
                &[],
                Overrides {
                    disk_budget: Some(ByteSize::mib(768)),
                    disk_reserve: reserve,
                    ..flags.clone()
                },
            )
            .unwrap();
            l.config.clone().resolve_with(&l, tight())
        };
        let e = fits(None).unwrap_err().to_string();
        assert!(e.contains("`disk-reserve` 1.0 GiB"), "{e}");
        assert!(fits(Some(ByteSize::mib(257))).is_err());
        fits(Some(ByteSize::mib(256))).unwrap();
        fits(Some(ByteSize(0))).unwrap();

        // An existing store keeps its size when the budget is automatic,
        // however little room is left.
        std::fs::create_dir_all(dir.path().join("data")).unwrap();
        let f = std::fs::File::create(dir.path().join("data").join(STORE_FILE)).unwrap();
        f.set_len(3 * c.region_size.0).unwrap();
        l = load_with(None, &[], flags.clone()).unwrap();
        let mut c2 = l.config.clone();
        c2.resolve_with(&l, tight()).unwrap();
        assert_eq!(c2.disk_budget, Some(ByteSize(3 * c.region_size.0)));

        // A store created with 64 MiB regions keeps them when region-size is
        // not set; an explicit region-size stays as set (the store then
        // refuses to open, naming both).
        let mut sb = [0u8; 4096];
        tier::layout::Superblock {
            version: tier::layout::STORE_VERSION,
            region_size: 64 << 20,
            region_count: 48,
            created_ms: 1,
        }
        .encode_into(&mut sb);
        std::fs::write(dir.path().join("data").join(STORE_FILE), sb).unwrap();
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(dir.path().join("data").join(STORE_FILE))
            .unwrap();
        f.set_len(48 << 26).unwrap();
        l = load_with(None, &[], flags.clone()).unwrap();
        let mut c3 = l.config.clone();
        c3.resolve_with(&l, tight()).unwrap();
        assert_eq!(c3.region_size, ByteSize::mib(64));
        assert_eq!(c3.disk_budget, Some(ByteSize(48 << 26)));
        // The superblock, not the file's length, gives the size: a file
        // grown past its store (by an older version's refused open) or cut
        // short still opens as the store it is.
        for len in [50 << 26, 40 << 26] {
            f.set_len(len).unwrap();
            l = load_with(None, &[], flags.clone()).unwrap();
            let mut c = l.config.clone();
            c.resolve_with(&l, tight()).unwrap();
            assert_eq!(c.disk_budget, Some(ByteSize(48 << 26)), "file of {len}");
        }
        f.set_len(48 << 26).unwrap();
        // The budget check counts the store's regions, not the default's.
        let small = Overrides {
            disk_budget: Some(ByteSize::mib(192)),
            ..flags.clone()
        };
        l = load_with(None, &[], small).unwrap();
        assert_eq!(l.config.region_size, ByteSize::mib(64));
        let explicit = Overrides {
            region_size: Some(ByteSize::mib(128)),
            ..flags.clone()
        };
        l = load_with(None, &[], explicit).unwrap();
        let mut c4 = l.config.clone();
        c4.resolve_with(&l, tight()).unwrap();
        assert_eq!(c4.region_size, ByteSize::mib(128));

        let ram_only = Overrides {
            disk_budget: Some(ByteSize(0)),
            gpu_kv_pool: Some(ByteSize::gib(80)),
            ..flags
        };
        l = load_with(None, &[], ram_only).unwrap();
        let w = l.config.clone().resolve(&l).unwrap();
        // (The store made above stays in the data dir, unused: said too.)
        assert_eq!(w.len(), 2, "{w:?}");
        assert!(w[0].contains("holds a store"), "{}", w[0]);
        assert!(w[1].contains("NOT larger than the GPU KV pool"), "{}", w[1]);
    }

    /// QA: `config check --disk-budget 512MiB` on a store of 256 MiB said
    /// "the chunk store in D", then the store's message naming no flag.
    #[test]
    fn an_existing_store_of_another_size_names_the_key_and_its_source() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        std::fs::create_dir_all(&data).unwrap();
        let mut sb = [0u8; 4096];
        tier::layout::Superblock {
            version: tier::layout::STORE_VERSION,
            region_size: 32 << 20,
            region_count: 8,
            created_ms: 1,
        }
        .encode_into(&mut sb);
        std::fs::write(data.join(STORE_FILE), sb).unwrap();
        std::fs::OpenOptions::new()
            .write(true)
            .open(data.join(STORE_FILE))
            .unwrap()
            .set_len(256 << 20)
            .unwrap();
        let check = |flags: Overrides| {
            let l = load_with(
                None,
                &[],
                Overrides {
                    data_dir: Some(data.clone()),
                    disk_reserve: Some(ByteSize(0)),
                    ..flags
                },
            )
            .unwrap();
            let mut c = l.config.clone();
            c.resolve_with(&l, roomy()).unwrap();
            c.check_existing_store(&l.sources)
                .map_err(|e| e.to_string())
        };
        let e = check(Overrides {
            disk_budget: Some(ByteSize::mib(512)),
            ..Default::default()
        })
        .unwrap_err();
        assert!(
            e.starts_with("invalid `disk-budget` (from command-line flag --disk-budget): 512MiB makes 16 regions of 32MiB, but the chunk store in "),
            "{e}"
        );
        assert!(
            e.contains("holds 8 (256MiB); set disk-budget to 256MiB"),
            "{e}"
        );
        let e = check(Overrides {
            region_size: Some(ByteSize::mib(64)),
            ..Default::default()
        })
        .unwrap_err();
        assert!(
            e.starts_with("invalid `region-size` (from command-line flag --region-size): "),
            "{e}"
        );
        assert!(
            e.contains("created with region-size 32MiB, not 64MiB"),
            "{e}"
        );
        check(Overrides::default()).unwrap();
        check(Overrides {
            disk_budget: Some(ByteSize::mib(256)),
            ..Default::default()
        })
        .unwrap();
    }

    #[test]
    fn tier_config_carries_the_values() {
        let mut c = NodeConfig::defaults_for(&env());
        c.disk_budget = Some(ByteSize::gib(2));
        let t = c.tier_config();
        assert_eq!(t.ram_budget, 4 << 30);
        assert_eq!(t.disk_budget, 2 << 30);
        assert_eq!(t.data_dir, c.data_dir);
        t.validate().unwrap();
    }
}
