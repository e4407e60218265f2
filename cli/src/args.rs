//! Command-line arguments (clap derive).

use std::path::PathBuf;

use clap::builder::TypedValueParser as _;
use clap::{Args, Parser, Subcommand, ValueEnum};
use node::config::{Listen, Overrides};
use node::logging::LogFormat;
use node::tier::WritePolicy;
use node::{ByteSize, HumanDuration};

const AFTER_HELP: &str = "\
Configuration: every daemon option is a TOML key in --config FILE, an environment variable \
KVTIER_<KEY> (e.g. KVTIER_RAM_BUDGET=8GiB) and a flag (--ram-budget 8GiB); flags win over the \
environment, which wins over the file, which wins over the built-in defaults. \
`kvtier config check` prints the effective configuration.

Exit codes: 0 ok, 1 error, 2 usage, 3 daemon unreachable, 4 not found / miss, \
5 verification failures found, 130 `node start` stopped by a second signal before its flush \
ended, 141 stdout closed early. See docs/cli.md.";

/// kvtier: a per-node KV-cache tier (RAM over NVMe) for LLM inference engines.
#[derive(Debug, Parser)]
#[command(name = "kvtier", version, after_help = AFTER_HELP)]
pub struct Cli {
    /// The command.
    #[command(subcommand)]
    pub command: Command,
}

impl Cli {
    /// Whether the command was asked for JSON on stdout (`--json`): an
    /// error then prints `{"ok": false, ...}` there too.
    pub fn json_output(&self) -> bool {
        match &self.command {
            Command::Config(ConfigCommand::Check(a)) => a.json,
            Command::Stats(a) => a.json,
            Command::Lookup(a) => a.json,
            Command::Put(a) => a.json,
            Command::Delete(a) => a.json,
            Command::Flush(a) => a.json,
            Command::Namespaces(a) => a.json,
            Command::Verify(a) => a.json,
            Command::Gc(a) => a.json,
            Command::Peers(a) => a.json,
            // `get` writes the chunk's bytes; `bench --json FILE` writes a
            // file; the others print no JSON.
            Command::Node(_)
            | Command::Get(_)
            | Command::Completions(_)
            | Command::Bench(_)
            | Command::Cert(_) => false,
        }
    }
}

/// The commands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the node daemon (`kvtier node start`).
    #[command(subcommand)]
    Node(NodeCommand),
    /// Show the daemon's counters and gauges as a table (or JSON).
    Stats(StatsArgs),
    /// Show where keys live (RAM, disk, peer, or missing) and the longest
    /// present prefix. Exits 4 if any key is missing.
    Lookup(LookupArgs),
    /// Store a file's bytes as one chunk.
    Put(PutArgs),
    /// Fetch one chunk into a file (or stdout with `-o -`). Exits 4 on a miss.
    Get(GetArgs),
    /// Delete chunks. Exits 4 if any key did not exist.
    Delete(DeleteArgs),
    /// Write every dirty chunk to disk; returns once they are durable.
    Flush(FlushArgs),
    /// List the namespaces the store knows, with their ids and usage.
    Namespaces(NamespacesArgs),
    /// Re-read and check every chunk on disk (offline: the daemon must be
    /// stopped). Exits 5 if bad chunks are found.
    Verify(VerifyArgs),
    /// Drop namespaces by id or age (offline; dry run unless --apply).
    Gc(GcArgs),
    /// Configuration tools.
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell).
    Completions(CompletionsArgs),
    /// End-to-end benchmarks against real daemons (limits, local, vs, crash,
    /// churn, restore, two-rank); see docs/benchmarks.md.
    Bench(crate::bench::BenchArgs),
    /// Cluster certificates: `init-ca` and `issue` (mutual TLS between nodes).
    #[command(subcommand)]
    Cert(crate::cmd_cert::CertCommand),
    /// Show this node's peers: state, RTT, chunks and bytes they hold, last
    /// sync, bytes fetched and served.
    Peers(crate::cmd_peers::PeersArgs),
}

/// `kvtier node ...`
#[derive(Debug, Subcommand)]
pub enum NodeCommand {
    /// Start the daemon in the foreground. Works with no configuration at
    /// all; prints a start-up summary. SIGTERM / SIGINT / SIGHUP flush
    /// dirty chunks within --shutdown-deadline and exit 0 (1 if the flush
    /// did not finish in time); a second SIGTERM / SIGINT exits at once
    /// (130).
    Start(ConfigArgs),
}

/// `kvtier config ...`
#[derive(Debug, Subcommand)]
pub enum ConfigCommand {
    /// Validate the configuration (file, environment, flags) and print the
    /// effective result as TOML (or JSON). Exits 1 naming the bad key and
    /// its source.
    Check(ConfigCheckArgs),
}

/// Every daemon option as a flag (each also a TOML key and `KVTIER_<KEY>`).
#[derive(Debug, Args, Clone, Default)]
pub struct ConfigArgs {
    /// TOML configuration file (also `KVTIER_CONFIG`). Default: none, the
    /// built-in defaults.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Directory of the chunk store. Default: $STATE_DIRECTORY (set by
    /// systemd), else /var/lib/kvtier as root, else $XDG_DATA_HOME/kvtier
    /// or ~/.local/share/kvtier.
    #[arg(long, value_name = "DIR")]
    pub data_dir: Option<PathBuf>,
    /// RAM tier budget, e.g. 8GiB. Default: 25% of physical RAM, at most 4GiB.
    #[arg(long, value_name = "SIZE", allow_hyphen_values = true)]
    pub ram_budget: Option<ByteSize>,
    /// Disk tier budget (preallocated in the data dir), e.g. 500GiB; 0 keeps
    /// chunks in RAM only. Default: 16GiB, or half the available space of the
    /// data dir's filesystem if less. Must fit the free space.
    #[arg(long, value_name = "SIZE", allow_hyphen_values = true)]
    pub disk_budget: Option<ByteSize>,
    /// Space the disk budget leaves free on the data dir's filesystem.
    /// Default: 5% of the filesystem, at most 1GiB.
    #[arg(long, value_name = "SIZE", allow_hyphen_values = true)]
    pub disk_reserve: Option<ByteSize>,
    /// Size of one region of the disk store (the unit of eviction), e.g.
    /// 64MiB; 1MiB to 1GiB. Default for a new store: 256MiB, or with a disk budget under
    /// 2GiB the power of two below an eighth of it (at least 1MiB). Unset,
    /// an existing store keeps the size it was made with.
    #[arg(long, value_name = "SIZE", allow_hyphen_values = true)]
    pub region_size: Option<ByteSize>,
    /// Native protocol Unix socket. Default: $RUNTIME_DIRECTORY/kvtier.sock
    /// (set by systemd), else /run/kvtier/kvtier.sock as root, else
    /// $XDG_RUNTIME_DIR/kvtier/kvtier.sock, else kvtier.sock in the default
    /// data dir.
    #[arg(long, value_name = "PATH")]
    pub socket: Option<PathBuf>,
    /// RESP (Redis protocol: RESP2, RESP3 after `HELLO 3`) listen address, or `off`. Default: 127.0.0.1:6380.
    #[arg(long, value_name = "ADDR|off")]
    pub resp_listen: Option<Listen>,
    /// Password for RESP AUTH (required for a non-loopback --resp-listen).
    /// Prefer KVTIER_RESP_PASSWORD or the file: flags are visible in `ps`.
    #[arg(long, value_name = "PASSWORD")]
    pub resp_password: Option<String>,
    /// HTTP listen address for /metrics, /status, /healthz, or `off`.
    /// Default: 127.0.0.1:7480.
    #[arg(long, value_name = "ADDR|off")]
    pub http_listen: Option<Listen>,
    /// The engine's GPU KV pool size; the daemon warns when RAM + disk
    /// budget is not larger (such a tier never serves). Default: unset.
    #[arg(long, value_name = "SIZE", allow_hyphen_values = true)]
    pub gpu_kv_pool: Option<ByteSize>,
    /// Write dirty chunks older than this when the disk is idle, e.g. 30s.
    /// Default: 30s.
    #[arg(long, value_name = "DURATION", allow_hyphen_values = true)]
    pub idle_flush_after: Option<HumanDuration>,
    /// When the disk writer falls behind: never slow PUT (`no-tax`) or wait
    /// (`backpressure`). Default: no-tax.
    #[arg(
        long,
        value_name = "POLICY",
        value_parser = clap::builder::PossibleValuesParser::new(["no-tax", "backpressure"])
            .try_map(|s| parse_write_policy(&s))
    )]
    pub write_policy: Option<WritePolicy>,
    /// Time a graceful shutdown may spend flushing; at most 1 day. Default: 30s.
    #[arg(long, value_name = "DURATION", allow_hyphen_values = true)]
    pub shutdown_deadline: Option<HumanDuration>,
    /// Log format: human or json. Default: human.
    #[arg(
        long,
        value_name = "FORMAT",
        value_parser = clap::builder::PossibleValuesParser::new(["human", "json"])
            .try_map(|s| s.parse::<LogFormat>())
    )]
    pub log_format: Option<LogFormat>,
    /// Log level (trace, debug, info, warn, error, off) or filter, e.g.
    /// info,node=debug. Default: info.
    #[arg(long, value_name = "LEVEL")]
    pub log_level: Option<String>,
    /// This node's name; with peers it must equal the name in its
    /// certificate. Default: the certificate's name, dev-<peer port> with
    /// --insecure-dev (dev-<address>-<port> off 127.0.0.1), else the host
    /// name.
    #[arg(long, value_name = "NAME")]
    pub node_name: Option<String>,
    /// Peer (QUIC, mutual TLS) listen address, or `off`. Default: off.
    #[arg(long, value_name = "ADDR|off")]
    pub peer_listen: Option<Listen>,
    /// Seed peers, HOST:PORT (repeatable or comma-separated). Default: none.
    #[arg(long, value_name = "HOST:PORT", value_delimiter = ',', value_parser = parse_peer)]
    pub peers: Vec<String>,
    /// Directory with ca.pem, node.pem, node.key (`kvtier cert issue
    /// --out DIR`). Required with --peer-listen unless --insecure-dev.
    #[arg(long, value_name = "DIR")]
    pub tls_dir: Option<PathBuf>,
    /// Development only: self-signed certificate, any peer accepted,
    /// loopback addresses only.
    #[arg(long)]
    pub insecure_dev: bool,
    /// How long a local miss may wait for a peer, e.g. 500ms. Default: 2s.
    #[arg(long, value_name = "DURATION", allow_hyphen_values = true)]
    pub peer_fetch_timeout: Option<HumanDuration>,
}

fn parse_write_policy(s: &str) -> Result<WritePolicy, String> {
    match s {
        "no-tax" => Ok(WritePolicy::NoTax),
        "backpressure" => Ok(WritePolicy::Backpressure),
        _ => Err(format!(
            "{s:?} is not a write policy: use \"no-tax\" or \"backpressure\""
        )),
    }
}

impl ConfigArgs {
    /// The flags as configuration overrides.
    pub fn overrides(&self) -> Overrides {
        Overrides {
            data_dir: self.data_dir.clone(),
            ram_budget: self.ram_budget,
            disk_budget: self.disk_budget,
            disk_reserve: self.disk_reserve,
            region_size: self.region_size,
            socket: self.socket.clone(),
            resp_listen: self.resp_listen,
            resp_password: self.resp_password.clone(),
            http_listen: self.http_listen,
            gpu_kv_pool: self.gpu_kv_pool,
            idle_flush_after: self.idle_flush_after,
            write_policy: self.write_policy,
            shutdown_deadline: self.shutdown_deadline,
            log_format: self.log_format,
            log_level: self.log_level.clone(),
            node_name: self.node_name.clone(),
            peer_listen: self.peer_listen,
            peers: (!self.peers.is_empty()).then(|| node::config::PeerList(self.peers.clone())),
            tls_dir: self.tls_dir.clone(),
            insecure_dev: self.insecure_dev.then_some(true),
            peer_fetch_timeout: self.peer_fetch_timeout,
        }
    }
}

/// The options that pick a store and open it offline (`namespaces`,
/// `verify`, `gc`): the daemon's other options do not apply there.
#[derive(Debug, Args, Clone, Default)]
pub struct StoreArgs {
    /// TOML configuration file (also `KVTIER_CONFIG`); only the store's
    /// keys are used. Default: none, the built-in defaults.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Directory of the chunk store. Default: $STATE_DIRECTORY (set by
    /// systemd), else /var/lib/kvtier as root, else $XDG_DATA_HOME/kvtier
    /// or ~/.local/share/kvtier.
    #[arg(long, value_name = "DIR")]
    pub data_dir: Option<PathBuf>,
    /// RAM budget of the offline store, e.g. 1GiB. Default: as for the daemon.
    #[arg(long, value_name = "SIZE", allow_hyphen_values = true)]
    pub ram_budget: Option<ByteSize>,
    /// The store's disk budget. Default: the size of the existing store.
    #[arg(long, value_name = "SIZE", allow_hyphen_values = true)]
    pub disk_budget: Option<ByteSize>,
    /// The store's region size. Default: the existing store's.
    #[arg(long, value_name = "SIZE", allow_hyphen_values = true)]
    pub region_size: Option<ByteSize>,
    /// Space a disk budget given here must leave free on the filesystem.
    /// Default: 5% of the filesystem, at most 1GiB.
    #[arg(long, value_name = "SIZE", allow_hyphen_values = true)]
    pub disk_reserve: Option<ByteSize>,
    /// Not used here (kept to refuse it with the way to do it).
    #[arg(long, value_name = "PATH", hide = true)]
    pub socket: Option<PathBuf>,
}

impl StoreArgs {
    /// As the daemon's options, the others left unset.
    pub fn config_args(&self) -> ConfigArgs {
        ConfigArgs {
            config: self.config.clone(),
            data_dir: self.data_dir.clone(),
            ram_budget: self.ram_budget,
            disk_budget: self.disk_budget,
            region_size: self.region_size,
            disk_reserve: self.disk_reserve,
            socket: self.socket.clone(),
            ..ConfigArgs::default()
        }
    }
}

/// `kvtier config check`
#[derive(Debug, Args)]
pub struct ConfigCheckArgs {
    /// Print JSON instead of TOML.
    #[arg(long)]
    pub json: bool,
    /// Exit 1 when there are warnings too (e.g. this user could not create
    /// the data dir): a preflight run as the service's user.
    #[arg(long)]
    pub strict: bool,
    /// The configuration to check.
    #[command(flatten)]
    pub config: ConfigArgs,
}

/// How a client command finds the daemon.
#[derive(Debug, Args, Clone)]
pub struct ClientArgs {
    /// The daemon's socket. Default: `socket` from --config /
    /// KVTIER_SOCKET / the built-in default.
    #[arg(long, value_name = "PATH")]
    pub socket: Option<PathBuf>,
    /// TOML configuration file to read `socket` from (also `KVTIER_CONFIG`).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// How long to wait for each reply before giving up with exit code 3
    /// (a stopped or overloaded daemon); 0 waits forever. Default: 60s,
    /// and forever for `flush`, which takes as long as the disk needs.
    #[arg(long, value_name = "DURATION", allow_hyphen_values = true)]
    pub timeout: Option<HumanDuration>,
}

/// A namespace given by id.
#[derive(Debug, Args, Clone)]
pub struct NamespaceArg {
    /// Namespace id: 32 hex digits, as listed by `kvtier namespaces`.
    #[arg(long, value_name = "ID")]
    pub namespace: node::tier::Namespace,
    /// KV-cache group within the namespace.
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub group: u16,
}

/// `kvtier stats`
#[derive(Debug, Args)]
pub struct StatsArgs {
    /// Print the daemon's STATS document as JSON.
    #[arg(long)]
    pub json: bool,
    /// The daemon.
    #[command(flatten)]
    pub client: ClientArgs,
}

/// `kvtier lookup`
#[derive(Debug, Args)]
pub struct LookupArgs {
    /// The namespace.
    #[command(flatten)]
    pub ns: NamespaceArg,
    /// Keys in order (64 hex digits each).
    #[arg(required = true, value_name = "KEY")]
    pub keys: Vec<node::tier::ChunkKey>,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
    /// The daemon.
    #[command(flatten)]
    pub client: ClientArgs,
}

/// A chunk key: hex, or a string hashed to a key.
#[derive(Debug, Args, Clone)]
#[group(required = true, multiple = false)]
pub struct KeyArg {
    /// The chunk key: 64 hex digits.
    #[arg(long, value_name = "HEX")]
    pub key: Option<node::tier::ChunkKey>,
    /// A string key, hashed to a chunk key (as RESP keys are).
    #[arg(long, value_name = "STRING")]
    pub name: Option<String>,
}

impl KeyArg {
    /// The chunk key.
    pub fn key(&self) -> node::tier::ChunkKey {
        match (&self.key, &self.name) {
            (Some(k), _) => *k,
            (None, Some(n)) => node::tier::ChunkKey::from_name(n.as_bytes()),
            (None, None) => unreachable!("clap requires --key or --name"),
        }
    }
}

/// `kvtier put`
#[derive(Debug, Args)]
pub struct PutArgs {
    /// File whose bytes become the chunk (`-` for stdin).
    #[arg(value_name = "FILE")]
    pub file: PathBuf,
    /// Namespace id (32 hex digits, see `kvtier namespaces`). The namespace
    /// must already be registered; use --namespace-record for a new one.
    #[arg(
        long,
        value_name = "ID",
        required_unless_present = "namespace_record",
        conflicts_with = "namespace_record"
    )]
    pub namespace: Option<node::tier::Namespace>,
    /// A namespace record (TOML or JSON file with model, engine, tp-size,
    /// rank, kv-dtype, ...) to register with the daemon; its id is printed.
    #[arg(long, value_name = "FILE")]
    pub namespace_record: Option<PathBuf>,
    /// KV-cache group within the namespace.
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub group: u16,
    /// The key.
    #[command(flatten)]
    pub key: KeyArg,
    /// Print JSON: `{"namespace", "key", "group", "bytes"}`.
    #[arg(long)]
    pub json: bool,
    /// The daemon.
    #[command(flatten)]
    pub client: ClientArgs,
}

/// `kvtier get`
#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("which").required(true).args(["key", "name"])))]
pub struct GetArgs {
    /// The namespace.
    #[command(flatten)]
    pub ns: NamespaceArg,
    /// The key (64 hex digits); or use --name.
    #[arg(value_name = "KEY")]
    pub key: Option<node::tier::ChunkKey>,
    /// A string key, hashed to a chunk key (as RESP keys are).
    #[arg(long, value_name = "STRING")]
    pub name: Option<String>,
    /// Output file (`-` for stdout).
    #[arg(short, long, value_name = "FILE")]
    pub output: PathBuf,
    /// The daemon.
    #[command(flatten)]
    pub client: ClientArgs,
}

/// `kvtier delete`
#[derive(Debug, Args)]
pub struct DeleteArgs {
    /// The namespace.
    #[command(flatten)]
    pub ns: NamespaceArg,
    /// Keys to delete (64 hex digits each).
    #[arg(required = true, value_name = "KEY")]
    pub keys: Vec<node::tier::ChunkKey>,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
    /// The daemon.
    #[command(flatten)]
    pub client: ClientArgs,
}

/// `kvtier flush`
#[derive(Debug, Args)]
pub struct FlushArgs {
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
    /// The daemon.
    #[command(flatten)]
    pub client: ClientArgs,
}

/// `kvtier namespaces`
#[derive(Debug, Args)]
pub struct NamespacesArgs {
    /// Print JSON (full records).
    #[arg(long)]
    pub json: bool,
    /// Which store (read offline when no daemon runs).
    #[command(flatten)]
    pub config: StoreArgs,
}

/// `kvtier verify`
#[derive(Debug, Args)]
pub struct VerifyArgs {
    /// Drop the chunks that fail verification (default: report only).
    #[arg(long)]
    pub repair: bool,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
    /// Which store (data dir, budgets).
    #[command(flatten)]
    pub config: StoreArgs,
}

/// `kvtier gc`
#[derive(Debug, Args)]
pub struct GcArgs {
    /// Drop every chunk of this namespace (repeatable; 32 hex digits).
    #[arg(long = "namespace", value_name = "ID")]
    pub namespaces: Vec<node::tier::Namespace>,
    /// Drop namespaces not written or read for at least this long, e.g. 7days.
    #[arg(long, value_name = "DURATION", allow_hyphen_values = true)]
    pub older_than: Option<HumanDuration>,
    /// Really drop them (default: dry run, report only).
    #[arg(long)]
    pub apply: bool,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
    /// Which store (data dir, budgets).
    #[command(flatten)]
    pub config: StoreArgs,
}

/// Shells for `kvtier completions`.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum Shell {
    /// Bash.
    Bash,
    /// Zsh.
    Zsh,
    /// Fish.
    Fish,
    /// Elvish.
    Elvish,
    /// PowerShell.
    Powershell,
}

/// `kvtier completions`
#[derive(Debug, Args)]
pub struct CompletionsArgs {
    /// The shell.
    #[arg(value_enum)]
    pub shell: Shell,
}

/// A `--peers` entry, checked as the config's `peers` are, by the parser
/// (a usage error, exit 2, as `--peer-listen garbage` is; QA).
fn parse_peer(s: &str) -> Result<String, String> {
    node::config::check_peer_addr(s).map(|()| s.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn flags_map_to_overrides() {
        let cli = Cli::try_parse_from([
            "kvtier",
            "node",
            "start",
            "--ram-budget",
            "1GiB",
            "--resp-listen",
            "off",
            "--write-policy",
            "backpressure",
            "--shutdown-deadline",
            "5s",
            "--log-format",
            "json",
        ])
        .unwrap();
        let Command::Node(NodeCommand::Start(a)) = cli.command else {
            panic!()
        };
        let o = a.overrides();
        assert_eq!(o.ram_budget, Some(ByteSize::gib(1)));
        assert_eq!(o.resp_listen, Some(Listen::Off));
        assert_eq!(o.write_policy, Some(WritePolicy::Backpressure));
        assert_eq!(o.shutdown_deadline, Some(HumanDuration::secs(5)));
        assert_eq!(o.log_format, Some(LogFormat::Json));
        assert!(o.data_dir.is_none());
    }

    #[test]
    fn bad_values_are_usage_errors_naming_the_flag() {
        let e =
            Cli::try_parse_from(["kvtier", "node", "start", "--ram-budget", "12XB"]).unwrap_err();
        assert!(e.use_stderr());
        let msg = e.to_string();
        assert!(
            msg.contains("--ram-budget") && msg.contains("12XB"),
            "{msg}"
        );
        let e = Cli::try_parse_from(["kvtier", "lookup", "--namespace", "xyz", "00"]).unwrap_err();
        assert!(e.to_string().contains("--namespace"), "{e}");
    }

    /// QA: a negative size or duration given as its own word
    /// (`--ram-budget -1`) got clap's "unexpected argument '-1'" instead of
    /// the value's own error.
    #[test]
    fn negative_values_as_their_own_word_get_the_values_error() {
        for args in [
            &["kvtier", "node", "start", "--ram-budget", "-1"][..],
            &["kvtier", "node", "start", "--disk-budget", "-1GiB"],
            &["kvtier", "config", "check", "--region-size", "-64MiB"],
            &["kvtier", "node", "start", "--shutdown-deadline", "-5s"],
            &["kvtier", "peers", "--watch", "--interval", "-1s"],
        ] {
            let e = Cli::try_parse_from(args).unwrap_err();
            assert_eq!(
                e.kind(),
                clap::error::ErrorKind::ValueValidation,
                "{args:?}: {e}"
            );
            assert!(
                e.to_string().contains("cannot be negative"),
                "{args:?}: {e}"
            );
        }
        // A flag where the value should be says so (review: "cannot be
        // negative" for `gc --older-than --apply`).
        let e = Cli::try_parse_from(["kvtier", "gc", "--older-than", "--apply"]).unwrap_err();
        assert!(e.to_string().contains("this is a flag, not a value"), "{e}");
    }

    /// QA: `node start --help` left out that systemd's `$STATE_DIRECTORY`
    /// and `$RUNTIME_DIRECTORY` come first, and the `--insecure-dev` name.
    #[test]
    fn node_start_help_names_the_systemd_defaults_and_the_dev_name() {
        let mut cmd = Cli::command();
        let start = cmd
            .find_subcommand_mut("node")
            .and_then(|n| n.find_subcommand_mut("start"))
            .expect("node start");
        let help = start.render_long_help().to_string();
        for want in [
            "$STATE_DIRECTORY",
            "$RUNTIME_DIRECTORY/kvtier.sock",
            "dev-<peer port> with --insecure-dev",
        ] {
            let flat = help.split_whitespace().collect::<Vec<_>>().join(" ");
            let want = want.split_whitespace().collect::<Vec<_>>().join(" ");
            assert!(flat.contains(&want), "{want:?} not in\n{help}");
        }
    }

    /// QA: `peers --interval 5s` without `--watch` was accepted and did
    /// nothing with the interval.
    #[test]
    fn peers_interval_requires_watch() {
        let e = Cli::try_parse_from(["kvtier", "peers", "--interval", "5s"]).unwrap_err();
        assert_eq!(
            e.kind(),
            clap::error::ErrorKind::MissingRequiredArgument,
            "{e}"
        );
        assert!(e.to_string().contains("--watch"), "{e}");
        for ok in [
            &["kvtier", "peers"][..],
            &["kvtier", "peers", "--watch"],
            &["kvtier", "peers", "--watch", "--interval", "5s"],
        ] {
            Cli::try_parse_from(ok).unwrap_or_else(|e| panic!("{ok:?}: {e}"));
        }
    }
}
