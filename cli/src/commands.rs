//! Command implementations. Each returns the process exit code on success
//! (0, or 4 / 5 for "data" outcomes: miss, verification failures).

use std::io::{IsTerminal, Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use node::config::{self, ConfigSources, Environment, Loaded, NodeConfig};
use node::daemon::DataDirLock;
use node::native::{Client, ErrorCode, LookupLocation};
use node::tier::{self, ChunkStore, GcOptions, Namespace, NamespaceRecord, VerifyOptions};
use node::{ByteSize, HumanDuration};

use crate::args::*;
use crate::{EXIT_ERROR, EXIT_MISS, EXIT_OK, EXIT_VERIFY_FAILED};

/// Runs one parsed command.
pub fn run(cli: Cli) -> Result<u8> {
    match cli.command {
        Command::Node(NodeCommand::Start(a)) => node_start(&a),
        Command::Config(ConfigCommand::Check(a)) => config_check(&a),
        Command::Stats(a) => stats(&a),
        Command::Lookup(a) => lookup(&a),
        Command::Put(a) => put(&a),
        Command::Get(a) => get(&a),
        Command::Delete(a) => delete(&a),
        Command::Flush(a) => flush(&a),
        Command::Namespaces(a) => namespaces(&a),
        Command::Verify(a) => verify(&a),
        Command::Gc(a) => gc(&a),
        Command::Completions(a) => completions(&a),
        Command::Bench(a) => crate::bench::run(&a),
        Command::Cert(c) => crate::cmd_cert::run(&c),
        Command::Peers(a) => crate::cmd_peers::run(&a),
    }
}

fn load(args: &ConfigArgs) -> Result<Loaded> {
    load_by(args, config::load)
}

/// The configuration from `args`' sources, loaded by `loader`
/// ([`config::load`], or [`config::load_store_keys`] for offline tools).
fn load_by(
    args: &ConfigArgs,
    loader: fn(&ConfigSources, &Environment) -> node::error::Result<Loaded>,
) -> Result<Loaded> {
    let sources = ConfigSources::from_process(args.config.clone(), args.overrides());
    Ok(loader(&sources, &Environment::detect())?)
}

/// `loaded`, resolved, with every warning.
fn resolved(loaded: &Loaded) -> Result<(NodeConfig, Vec<String>)> {
    let mut cfg = loaded.config.clone();
    let mut warnings = loaded.warnings.clone();
    warnings.extend(cfg.resolve(loaded)?);
    Ok((cfg, warnings))
}

// ---------------------------------------------------------------- node start

fn node_start(args: &ConfigArgs) -> Result<u8> {
    let start_config = || -> Result<(NodeConfig, Vec<String>)> {
        let loaded = load(args)?;
        let (cfg, warnings) = resolved(&loaded)?;
        // An existing store of other sizes: refused naming the key and
        // its source, as `config check` does (the store's own refusal
        // named neither).
        cfg.check_existing_layout(&loaded.sources)?;
        Ok((cfg, warnings))
    };
    let (cfg, warnings) = start_config().inspect_err(|_| {
        // Logging is not set up yet: the error follows the format asked for.
        let sources = ConfigSources::from_process(args.config.clone(), args.overrides());
        if sources.requested_log_format() == Some(node::logging::LogFormat::Json) {
            node::logging::fatal_errors_as_json();
        }
    })?;
    node::logging::init(cfg.log_format, &cfg.log_level)?;
    let human = cfg.log_format == node::logging::LogFormat::Human;
    for w in &warnings {
        tracing::warn!("{w}");
        if human && w.contains("GPU KV pool") {
            node::logging::eprint_lossy(&format!(
                "\n{}\n!! WARNING: {w}\n{}\n\n",
                "!".repeat(78),
                "!".repeat(78)
            ));
        }
    }
    // Before any thread starts: see node::memory (one arena, no page
    // faults on reused chunk memory).
    node::memory::tune_allocator();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("kvtier-worker")
        .build()
        .context("start the async runtime")?;
    let summary = rt.block_on(async {
        // Handlers are installed before the node starts, so a SIGTERM during
        // start-up is a graceful shutdown too.
        let signals = Signals::install().context("install signal handlers")?;
        node::run(cfg, signals.first())
            .await
            .map_err(anyhow::Error::from)
    })?;
    tracing::info!(
        uptime = %HumanDuration(Duration::from_secs(summary.uptime.as_secs())),
        flushed_chunks = summary.flush.as_ref().map_or(0, |f| f.chunks),
        flush_failed = summary.flush.as_ref().map_or(0, |f| f.failed),
        "kvtier stopped"
    );
    Ok(stop_status(&summary))
}

/// The exit status of a graceful stop: 1 when the final flush could not
/// write every dirty chunk (they are lost: a full disk, an I/O error), so
/// that systemd and the operator are not told the stop made everything
/// durable (QA: it exited 0, with the loss logged at info only).
fn stop_status(summary: &node::RunSummary) -> u8 {
    match &summary.flush {
        Some(f) if f.failed > 0 => {
            tracing::error!(
                lost = f.failed,
                "the final flush could not write {} dirty chunk(s) (see the warnings above: \
                 no space or an I/O error); they are lost",
                f.failed
            );
            EXIT_ERROR
        }
        _ => EXIT_OK,
    }
}

struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
    /// `None` when SIGHUP was ignored at start (`nohup`): it stays ignored.
    hup: Option<tokio::signal::unix::Signal>,
}

/// Whether this process inherited SIGHUP as ignored (`nohup`).
fn sighup_ignored() -> bool {
    // SAFETY: a zeroed sigaction is a valid out-parameter; a null new
    // action only reads the current one.
    unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        libc::sigaction(libc::SIGHUP, std::ptr::null(), &mut old) == 0
            && old.sa_sigaction == libc::SIG_IGN
    }
}

impl Signals {
    fn install() -> std::io::Result<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Self {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
            // The terminal that started a foreground daemon went away (an
            // ssh session dropped): a graceful stop, not the default death
            // that would lose every dirty chunk. Under `nohup` the operator
            // asked to outlive the terminal: registering would undo that.
            hup: if sighup_ignored() {
                None
            } else {
                Some(signal(SignalKind::hangup())?)
            },
        })
    }

    /// The name of the first stop signal to arrive.
    async fn first_stop(&mut self) -> &'static str {
        let hup = async {
            match &mut self.hup {
                Some(h) => h.recv().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = self.term.recv() => "SIGTERM",
            _ = self.int.recv() => "SIGINT",
            _ = hup => "SIGHUP",
        }
    }

    /// Completes on the first SIGTERM, SIGINT or SIGHUP; a second SIGTERM
    /// or SIGINT exits the process at once with code 130, without flushing.
    /// A SIGHUP during the shutdown does not (Ctrl-C, then the terminal
    /// closes: the flush goes on).
    async fn first(mut self) {
        let name = self.first_stop().await;
        tracing::info!(
            "received {name}: shutting down gracefully (send SIGTERM or SIGINT again to exit at once)"
        );
        tokio::spawn(async move {
            let name = tokio::select! {
                _ = self.term.recv() => "SIGTERM",
                _ = self.int.recv() => "SIGINT",
            };
            // What the exit loses, as the stop's own report would say it.
            let lost = match node::daemon::unwritten_now() {
                Some(0) => "; nothing was left unwritten".to_string(),
                Some(b) => format!(
                    "; {} of chunks not on disk yet are lost",
                    node::size::ByteSize(b).approx()
                ),
                None => String::new(),
            };
            let msg =
                format!("second signal ({name}): exiting now without finishing the flush{lost}");
            // Written directly (the exit comes right after it): in the JSON
            // log format, as one JSON line too (QA: it was plain text
            // among the JSON lines).
            node::logging::eprint_lossy(&if node::logging::json_active() {
                format!(
                    "{}\n",
                    node::logging::json_line("WARN", module_path!(), &msg)
                )
            } else {
                format!("kvtier: {msg}\n")
            });
            std::process::exit(130);
        });
    }
}

// -------------------------------------------------------------- config check

/// `config check`; with `--json`, an invalid configuration prints
/// `{"ok": false, "error": ..., "causes": [...]}` on stdout too, as every
/// command's `--json` does on an error (`crate::main_with`).
fn config_check(args: &ConfigCheckArgs) -> Result<u8> {
    let loaded = load(&args.config)?;
    let (mut cfg, mut warnings) = resolved(&loaded)?;
    warnings.extend(cfg.access_warnings());
    // What the start checks beyond the keys themselves: an existing store
    // against the sizes, and the certificates against the node name.
    cfg.check_existing_store(&loaded.sources)?;
    if let Some(opts) = cfg.cluster_options() {
        let (_, tls_warnings) = node::cluster::Cluster::load_tls(&opts)?;
        warnings.extend(tls_warnings);
    }
    // A running daemon (or offline tool) on the data dir: said, not a
    // warning (a check before restarting that daemon is normal, also with
    // --strict), since this start would be refused while it runs (QA).
    let in_use = DataDirLock::holder(&cfg.data_dir).map(|h| {
        format!(
            "data dir {} is in use by {}: a start with this configuration is refused until it \
             stops",
            cfg.data_dir.display(),
            h.describe()
        )
    });
    // A secret is not printed (terminals, CI logs, pasted output): the
    // printed configuration leaves it out and says so.
    let hidden: Vec<&str> = cfg
        .resp_password
        .take()
        .map(|_| "resp-password")
        .into_iter()
        .collect();
    // What the sizes come to (QA: `disk-budget = "300MiB"` printed, 288 MiB
    // used): whole regions, and the largest chunk they and the RAM take.
    let (layout, max_chunk) = tier::store::planned_layout(&cfg.tier_config());
    let strict_failed = args.strict && !warnings.is_empty();
    if args.json {
        let mut doc = serde_json::json!({
            "ok": !strict_failed,
            "file": loaded.file,
            "config": cfg,
            "store": {
                "regions": layout.region_count,
                "region_size": layout.region_size,
                "disk_bytes": layout.bytes(),
                "max_chunk": max_chunk,
            },
            "hidden": hidden,
            "warnings": warnings,
            "in_use": in_use,
        });
        if strict_failed {
            // The shape of every failed `--json` command (cli.md, "Output").
            doc["error"] = format!(
                "config check --strict: {} warning(s), listed under \"warnings\"",
                warnings.len()
            )
            .into();
            doc["exit_code"] = EXIT_ERROR.into();
            doc["causes"] = serde_json::json!([]);
        }
        outln!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        use std::fmt::Write as _;
        // One write: a reader that takes only the first line (`| head -1`)
        // gets it whole and the command still exits 0 (cli.md, "Output").
        let mut text = String::new();
        let source = match &loaded.file {
            Some(f) => format!("{} + environment + flags", f.display()),
            None => "built-in defaults + environment + flags (no file)".to_string(),
        };
        if warnings.is_empty() {
            let _ = writeln!(text, "# configuration OK: {source}");
        } else {
            let _ = writeln!(
                text,
                "# configuration valid, with {} warning(s) below (the start may still fail): {source}",
                warnings.len()
            );
        }
        for w in &warnings {
            let _ = writeln!(text, "# WARNING: {w}");
        }
        if let Some(note) = &in_use {
            let _ = writeln!(text, "# NOTE: {note}");
        }
        if layout.region_count == 0 {
            let _ = writeln!(
                text,
                "# store: RAM only (no disk tier); chunks up to {}",
                ByteSize(max_chunk).approx_floor()
            );
        } else {
            // Said only when it was (QA: printed for 256MiB = 8 x 32MiB).
            let rounded = if layout.bytes() < cfg.tier_config().disk_budget {
                " (disk-budget rounded down to whole regions)"
            } else {
                ""
            };
            let _ = writeln!(
                text,
                "# store: {} × {} regions = {}{rounded}; chunks up to {}",
                layout.region_count,
                ByteSize(layout.region_size).approx(),
                ByteSize(layout.bytes()).approx(),
                ByteSize(max_chunk).approx_floor()
            );
        }
        if cfg.gpu_kv_pool.is_none() {
            let _ = writeln!(
                text,
                "# gpu-kv-pool is unset: set it to get a warning when the tier is too small"
            );
        }
        for key in &hidden {
            let _ = writeln!(
                text,
                "# {key} is set ({}); not shown",
                loaded.sources.of(key)
            );
        }
        text.push_str(&cfg.to_toml());
        out!("{text}");
    }
    if strict_failed {
        errln!(
            "kvtier: error: config check --strict: {} warning(s), {}",
            warnings.len(),
            if args.json {
                "listed under \"warnings\" in the JSON"
            } else {
                "see above"
            }
        );
        return Ok(EXIT_ERROR);
    }
    Ok(EXIT_OK)
}

// ---------------------------------------------------------- client commands

fn socket_of(args: &ClientArgs) -> Result<PathBuf> {
    if let Some(s) = &args.socket {
        return Ok(s.clone());
    }
    let loaded = load(&ConfigArgs {
        config: args.config.clone(),
        ..Default::default()
    })?;
    Ok(loaded.config.socket)
}

/// Per-reply timeout when `--timeout` is not given.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

pub(crate) fn connect(args: &ClientArgs) -> Result<Client> {
    connect_with_default(args, Some(DEFAULT_TIMEOUT))
}

/// Connects with `--timeout`, or `default` (`None`: forever) without it.
fn connect_with_default(args: &ClientArgs, default: Option<Duration>) -> Result<Client> {
    let socket = socket_of(args)?;
    // `--timeout` as given (0: none), or `default` when not given.
    let timeout_or = |default| match args.timeout {
        Some(t) if t.0.is_zero() => None,
        Some(t) => Some(t.0),
        None => default,
    };
    // `flush` waits forever for its reply, but not for the connect (unless
    // told `--timeout 0`).
    let client = Client::connect_timeout(&socket, timeout_or(Some(DEFAULT_TIMEOUT)))?;
    client.set_timeout(timeout_or(default))?;
    Ok(client)
}

fn stats(args: &StatsArgs) -> Result<u8> {
    let mut client = connect(&args.client)?;
    let doc = client.stats().context("read the daemon's stats")?;
    if args.json {
        outln!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        out!("{}", render_table(&doc));
    }
    Ok(EXIT_OK)
}

/// A two-column table of a JSON document; nested objects become sections.
fn render_table(doc: &serde_json::Value) -> String {
    fn walk(out: &mut Vec<(String, String)>, prefix: &str, v: &serde_json::Value) {
        match v {
            serde_json::Value::Object(map) => {
                for (k, v) in map {
                    let key = if prefix.is_empty() {
                        k.clone()
                    } else {
                        format!("{prefix}.{k}")
                    };
                    walk(out, &key, v);
                }
            }
            serde_json::Value::String(s) => out.push((prefix.into(), s.clone())),
            // A list of records (the peers) is a table of its own:
            // `kvtier peers` prints it.
            serde_json::Value::Array(items) if items.iter().any(|i| i.is_object()) => {
                let hint = if prefix == "peers" {
                    " (see `kvtier peers`)"
                } else {
                    " (see --json)"
                };
                out.push((prefix.into(), format!("{}{hint}", items.len())));
            }
            other => {
                let mut text = other.to_string();
                // Byte counts are easier to read with a unit.
                if (prefix.ends_with("bytes")
                    || prefix.ends_with("budget")
                    || prefix.ends_with("_size"))
                    && let Some(n) = other.as_u64()
                {
                    // A limit rounds down, as the start-up summary's: a
                    // 32 MiB chunk does not fit in "31.9 MiB".
                    let approx = if prefix.starts_with("max-") {
                        ByteSize(n).approx_floor()
                    } else {
                        ByteSize(n).approx()
                    };
                    text = format!("{n} ({approx})");
                }
                out.push((prefix.into(), text));
            }
        }
    }
    let mut rows = Vec::new();
    walk(&mut rows, "", doc);
    let width = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    let mut s = String::new();
    for (k, v) in rows {
        s.push_str(&format!("{k:<width$}  {v}\n"));
    }
    s
}

fn location_name(l: LookupLocation) -> &'static str {
    match l {
        LookupLocation::Miss => "miss",
        LookupLocation::Ram => "ram",
        LookupLocation::Disk => "disk",
        LookupLocation::Peer => "peer",
    }
}

fn lookup(args: &LookupArgs) -> Result<u8> {
    let mut client = connect(&args.client)?;
    let r = client
        .lookup(args.ns.namespace, args.ns.group, &args.keys)
        .context("look up keys")?;
    if args.json {
        let keys: Vec<_> = args
            .keys
            .iter()
            .zip(&r.locations)
            .map(|(k, l)| serde_json::json!({"key": k.to_string(), "location": location_name(*l)}))
            .collect();
        outln!("{}", serde_json::json!({"prefix": r.prefix, "keys": keys}));
    } else {
        for (k, l) in args.keys.iter().zip(&r.locations) {
            outln!("{k}  {}", location_name(*l));
        }
        outln!("prefix {} of {}", r.prefix, args.keys.len());
    }
    let all = r.locations.iter().all(|l| *l != LookupLocation::Miss);
    Ok(if all { EXIT_OK } else { EXIT_MISS })
}

/// Reads a namespace record file (TOML, or JSON when it starts with `{`).
/// Strict, unlike the wire format: a misspelt field (`tp_size` for
/// `tp-size`) would otherwise be ignored and give a different namespace id
/// without a word, so unknown fields and a missing `model` are errors.
fn read_record(path: &Path) -> Result<NamespaceRecord> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("read namespace record {}", path.display()))?;
    let value: serde_json::Value = if text.trim_start().starts_with('{') {
        serde_json::from_str(&text).map_err(anyhow::Error::from)
    } else {
        toml::from_str::<toml::Value>(&text)
            .map_err(anyhow::Error::from)
            .and_then(|v| serde_json::to_value(v).map_err(anyhow::Error::from))
    }
    .with_context(|| format!("parse namespace record {}", path.display()))?;
    let known = serde_json::to_value(NamespaceRecord::default())?;
    let known: Vec<&String> = known
        .as_object()
        .map(|o| o.keys().collect())
        .unwrap_or_default();
    let Some(fields) = value.as_object() else {
        bail!(
            "namespace record {} is not a table of fields",
            path.display()
        );
    };
    for k in fields.keys() {
        if !known.contains(&k) {
            let kebab = k.replace('_', "-");
            let hint = if known.contains(&&kebab) {
                format!(" (did you mean `{kebab}`?)")
            } else {
                String::new()
            };
            bail!(
                "unknown field `{k}` in namespace record {}{hint}; the fields are: {}",
                path.display(),
                known
                    .iter()
                    .map(|k| k.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
    }
    let record: NamespaceRecord = serde_json::from_value(value)
        .with_context(|| format!("parse namespace record {}", path.display()))?;
    if record.model.trim().is_empty() {
        bail!(
            "namespace record {} has no `model`: name the model whose KV cache this is",
            path.display()
        );
    }
    Ok(record)
}

fn status_error(code: u16) -> anyhow::Error {
    anyhow!(
        "the daemon refused the chunk: {}",
        ErrorCode::from_code(code).name()
    )
}

/// Reads at most `limit` bytes of `r`, so an endless input (`/dev/zero`)
/// or a huge file never fills this process's memory. Returns the bytes and
/// whether more followed.
fn read_limited(r: &mut dyn Read, limit: u64) -> std::io::Result<(Vec<u8>, bool)> {
    let mut data = Vec::new();
    r.take(limit).read_to_end(&mut data)?;
    let mut one = [0u8; 1];
    loop {
        match r.read(&mut one) {
            Ok(n) => return Ok((data, n > 0)),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

fn put(args: &PutArgs) -> Result<u8> {
    // The input is opened first: a missing file is named before a missing
    // daemon.
    let what = if args.file.as_os_str() == "-" {
        "stdin".to_string()
    } else {
        args.file.display().to_string()
    };
    let mut input: Box<dyn Read> = if args.file.as_os_str() == "-" {
        Box::new(std::io::stdin().lock())
    } else {
        let f = std::fs::File::open(&args.file).with_context(|| format!("read {what}"))?;
        if f.metadata().is_ok_and(|m| m.is_dir()) {
            bail!("read {what}: is a directory");
        }
        Box::new(f)
    };
    let mut client = connect(&args.client)?;
    // The daemon's largest chunk bounds what is read (none from a daemon
    // that does not say: it refuses a chunk too large itself).
    let max = client
        .stats()
        .ok()
        .and_then(|s| s.get("max-chunk-bytes").and_then(|v| v.as_u64()));
    let too_large = |len: usize, max: u64| {
        anyhow!(
            "{}: the chunk is {len} bytes, this daemon takes chunks up to {max} bytes ({}; region-size and ram-budget set it)",
            status_error(ErrorCode::TooLarge as u16),
            ByteSize(max).approx_floor()
        )
    };
    let (data, more) = read_limited(&mut input, max.map_or(u64::MAX, |m| m.saturating_add(1)))
        .with_context(|| format!("read {what}"))?;
    if let Some(max) = max
        && (more || data.len() as u64 > max)
    {
        // Reading stopped past the limit: the input's length is not known
        // (QA: "the chunk is more than N bytes, ... up to N bytes" said the
        // same number twice).
        return Err(anyhow!(
            "{}: {what} is larger than the {max} bytes ({}) this daemon takes per chunk (region-size and ram-budget set it)",
            status_error(ErrorCode::TooLarge as u16),
            ByteSize(max).approx_floor()
        ));
    }
    let ns = match (&args.namespace, &args.namespace_record) {
        (Some(ns), _) => *ns,
        (None, Some(path)) => {
            let ns = client
                .hello(&read_record(path)?)
                .context("register the namespace")?;
            if !args.json {
                errln!("namespace {ns}");
            }
            ns
        }
        (None, None) => bail!("give --namespace ID or --namespace-record FILE"),
    };
    let key = args.key.key();
    let statuses = client
        .put_bytes(ns, args.group, &[(key, &data)])
        .context("put the chunk")?;
    match statuses.first() {
        Some(0) if args.json => {
            outln!(
                "{}",
                serde_json::json!({
                    "namespace": ns.to_string(),
                    "key": key.to_string(),
                    "group": args.group,
                    "bytes": data.len(),
                })
            );
            Ok(EXIT_OK)
        }
        Some(0) => {
            outln!("stored {key} ({} bytes) in namespace {ns}", data.len());
            Ok(EXIT_OK)
        }
        Some(&code) if ErrorCode::from_code(code) == ErrorCode::TooLarge => {
            // The status is a bare code: say what the limit is.
            Err(match max {
                Some(max) => too_large(data.len(), max),
                None => status_error(code),
            })
        }
        Some(code) => Err(status_error(*code)),
        None => bail!("the daemon sent an empty PUT reply"),
    }
}

fn get(args: &GetArgs) -> Result<u8> {
    let key = match (&args.key, &args.name) {
        (Some(k), _) => *k,
        (None, Some(n)) => node::tier::ChunkKey::from_name(n.as_bytes()),
        (None, None) => bail!("give a KEY or --name"),
    };
    let mut client = connect(&args.client)?;
    match client
        .get_bytes(args.ns.namespace, args.ns.group, key)
        .context("get the chunk")?
    {
        None => {
            errln!("miss: {key} is not in namespace {}", args.ns.namespace);
            Ok(EXIT_MISS)
        }
        Some(bytes) => {
            if args.output.as_os_str() == "-" {
                let mut out = std::io::stdout().lock();
                out.write_all(&bytes).map_err(crate::StdoutClosed::wrap)?;
                out.flush().map_err(crate::StdoutClosed::wrap)?;
            } else {
                write_whole(&args.output, &bytes)
                    .with_context(|| format!("write {}", args.output.display()))?;
                errln!("wrote {} bytes to {}", bytes.len(), args.output.display());
            }
            Ok(EXIT_OK)
        }
    }
}

/// Writes `bytes` to `path` whole or not at all when it is a regular file
/// of ours (or new): through a temporary file beside it, synced, then renamed
/// over it (a full disk left a truncated file in place of the old one).
/// Anything else is written in place, as before: a symlink (written
/// through), a device or FIFO, a file with other links or another owner
/// (a rename would break the links or change the owner), or a directory
/// where the temporary file cannot be made.
fn write_whole(path: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::os::unix::fs::MetadataExt;
    match std::fs::symlink_metadata(path) {
        // SAFETY: geteuid(2) has no preconditions.
        Ok(m) if !m.is_file() || m.nlink() > 1 || m.uid() != unsafe { libc::geteuid() } => {
            return std::fs::write(path, bytes);
        }
        _ => {}
    }
    let (Some(name), Some(dir)) = (path.file_name(), path.parent()) else {
        return std::fs::write(path, bytes);
    };
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(name);
    tmp_name.push(format!(".kvtier-get-{}", std::process::id()));
    let tmp = path.with_file_name(tmp_name);
    let mut f = match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&tmp)
    {
        Ok(f) => f,
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::StorageFull | std::io::ErrorKind::QuotaExceeded
            ) =>
        {
            return Err(e);
        }
        // No temporary file here (a directory we may not write, a stale
        // one, a name too long): in place.
        Err(_) => return std::fs::write(path, bytes),
    };
    let written = (|| {
        f.write_all(bytes)?;
        f.sync_data()?;
        if let Ok(m) = std::fs::metadata(path) {
            // The new file keeps the old one's permissions.
            f.set_permissions(m.permissions())?;
        }
        std::fs::rename(&tmp, path)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
        return written;
    }
    // The rename itself durable (best effort).
    let dir = if dir.as_os_str().is_empty() {
        std::path::Path::new(".")
    } else {
        dir
    };
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

fn delete(args: &DeleteArgs) -> Result<u8> {
    let mut client = connect(&args.client)?;
    let existed = client
        .delete(args.ns.namespace, args.ns.group, &args.keys)
        .context("delete keys")?;
    if args.json {
        let keys: Vec<_> = args
            .keys
            .iter()
            .zip(&existed)
            .map(|(k, e)| serde_json::json!({"key": k.to_string(), "existed": e}))
            .collect();
        outln!("{}", serde_json::json!({ "keys": keys }));
    } else {
        for (k, e) in args.keys.iter().zip(&existed) {
            outln!("{k}  {}", if *e { "deleted" } else { "not found" });
        }
    }
    Ok(if existed.iter().all(|e| *e) {
        EXIT_OK
    } else {
        EXIT_MISS
    })
}

fn flush(args: &FlushArgs) -> Result<u8> {
    // A flush of a large dirty RAM tier takes as long as the disk needs.
    let mut client = connect_with_default(&args.client, None)?;
    let r = client.flush().context("flush")?;
    if args.json {
        outln!("{}", serde_json::to_string(&r)?);
    } else {
        outln!(
            "flushed {} chunk(s), {}; {} failed",
            r.chunks,
            ByteSize(r.bytes).approx(),
            r.failed
        );
    }
    if r.failed > 0 {
        // Why, when the daemon's state says it (the log has the details).
        let store = client.stats().ok().map(|d| d["store"].clone());
        let why = match store {
            Some(s) if s["disk_poisoned"] == true => {
                "disk writes failed and stay stopped until a restart (an I/O error; see the \
                 daemon's log)"
            }
            Some(s) if s["writer_paused_nospace"] == true => {
                "the data dir's filesystem is full (the disk writer is paused): free space there \
                 and flush again"
            }
            // The writer may have resumed since (space was freed).
            _ => "no space or an I/O error (see the daemon's log)",
        };
        bail!("{} dirty chunk(s) could not be written: {why}", r.failed);
    }
    Ok(EXIT_OK)
}

// ------------------------------------------------------- store maintenance

/// The namespaces of a running daemon, from its HTTP `/status` (the native
/// STATS document does not list them).
fn namespaces_from_daemon(info: &node::daemon::LockInfo) -> Result<serde_json::Value> {
    if !info.ready {
        bail!(
            "the kvtier daemon (pid {}) holding the data dir is still starting; try again",
            info.pid
        );
    }
    let addr = info.http.ok_or_else(|| {
        anyhow!(
            "a kvtier daemon (pid {}) holds the data dir and its HTTP endpoint is off; \
             listing namespaces needs its /status (enable --http-listen) or a stopped daemon",
            info.pid
        )
    })?;
    let body = http_get(addr, "/status").with_context(|| format!("read http://{addr}/status"))?;
    let doc: serde_json::Value = serde_json::from_slice(&body).context("parse /status")?;
    doc.get("namespaces")
        .cloned()
        .ok_or_else(|| anyhow!("the daemon's /status has no namespaces"))
}

/// A minimal HTTP/1.0 GET on loopback (bounded time and size).
fn http_get(addr: std::net::SocketAddr, path: &str) -> Result<Vec<u8>> {
    // A daemon that cannot be reached or does not answer exits 3, as on
    // the native socket.
    let unreachable = |e: std::io::Error| {
        let why = match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                "did not answer in time; is it stopped or overloaded?".to_string()
            }
            _ => format!("cannot be reached: {e}"),
        };
        anyhow::Error::new(crate::Unreachable(format!(
            "the kvtier daemon's HTTP endpoint http://{addr}{path} {why}"
        )))
    };
    let mut s =
        std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5)).map_err(unreachable)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    s.set_write_timeout(Some(Duration::from_secs(10)))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").map_err(unreachable)?;
    let mut buf = Vec::new();
    s.take(64 << 20)
        .read_to_end(&mut buf)
        .map_err(unreachable)?;
    let split = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| anyhow!("malformed HTTP response"))?;
    let head = String::from_utf8_lossy(&buf[..split]);
    if !head.starts_with("HTTP/1.1 200") && !head.starts_with("HTTP/1.0 200") {
        bail!("HTTP error: {}", head.lines().next().unwrap_or(""));
    }
    Ok(buf[split + 4..].to_vec())
}

/// How an offline command opens the store.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Access {
    /// Nothing written: no recovery writes (a region recovered from its
    /// batches stays unsealed, the deletes journal stays), so a report run
    /// twice finds the same thing.
    ReadOnly,
    /// Opened as the daemon opens it (recovery writes what it recovered).
    Write,
    /// [`Access::Write`], plus the manifest salvaged and a truncated file
    /// grown back (`verify --repair`).
    Repair,
}

/// Opens the store offline (no daemon) under the data dir lock. A repair
/// first salvages a corrupt namespace manifest (returned: what it did) and
/// grows a truncated store file (see [`tier::TierConfig`]).
fn open_offline(
    cfg: &NodeConfig,
    role: &str,
    access: Access,
) -> Result<(ChunkStore, DataDirLock, Option<tier::manifest::Salvaged>)> {
    let repair = access == Access::Repair;
    // Opening creates (and preallocates) a store: never do that by accident.
    let file = cfg.data_dir.join(config::STORE_FILE);
    if !file.exists() {
        bail!(
            "there is no chunk store in {} (no {}); give the daemon's --data-dir or --config",
            cfg.data_dir.display(),
            config::STORE_FILE
        );
    }
    if cfg.disk_budget.is_some_and(|b| b.0 == 0) {
        return Err(crate::UsageError(format!(
            "--disk-budget 0 (RAM only) would leave the store in {} unchecked and untouched; \
             leave the budget unset, and `kvtier {role}` reads it from the store",
            cfg.data_dir.display()
        ))
        .into());
    }
    // An offline command formats nothing: a zeroed store file would become
    // a new, empty store of the configured size (a repair "fixed" it so).
    if tier::store::store_file_unformatted(&cfg.data_dir) {
        return Err(tier::Error::Corrupt {
            what: format!("store file {}", file.display()),
            detail: "it has no kvtier superblock (zeroed, or never formatted): nothing in it \
                     can be checked or repaired; restore the file from a copy, or move the data \
                     dir aside and start the daemon (it formats a new store)"
                .into(),
        }
        .into());
    }
    let lock = DataDirLock::acquire(&cfg.data_dir, role).map_err(|e| match e {
        node::NodeError::Locked { data_dir, holder } => {
            // Another offline command is waited for; a daemon is stopped.
            let way = if holder.starts_with("another process") {
                "stop the daemon if one runs there, or wait for the command to finish"
            } else if holder.contains("daemon") {
                "stop the daemon first (systemctl stop kvtier, or SIGTERM)"
            } else {
                "try again when it is done"
            };
            anyhow!(
                "data dir {} is in use by {holder}; `kvtier {role}` needs exclusive access to \
                 the store: {way}",
                data_dir.display()
            )
        }
        other => other.into(),
    })?;
    let salvaged = if repair {
        tier::manifest::salvage(&cfg.data_dir).context("repair the namespace manifest")?
    } else {
        None
    };
    if let Some(s) = &salvaged {
        // Said at once: the store's own open may still fail below.
        errln!(
            "kvtier: the namespace manifest was corrupt: copied aside to {}; {} record(s) kept, {} unreadable",
            s.set_aside.display(),
            s.kept,
            s.lost
        );
    }
    let tier_config = tier::TierConfig {
        grow_truncated: repair,
        read_only: access == Access::ReadOnly,
        // Only `verify` reports a corrupt manifest itself: the other
        // read-only commands (`namespaces`, a `gc` dry run) refuse it.
        salvage_manifest: access == Access::ReadOnly && role == "verify",
        ..cfg.tier_config()
    };
    let store = ChunkStore::open(tier_config)
        .with_context(|| format!("open the chunk store in {}", cfg.data_dir.display()))?;
    Ok((store, lock, salvaged))
}

fn close_offline(store: ChunkStore, lock: DataDirLock) -> Result<()> {
    store
        .close(Duration::from_secs(60))
        .context("close the chunk store")?;
    drop(lock);
    Ok(())
}

fn namespaces(args: &NamespacesArgs) -> Result<u8> {
    // Counting every namespace's chunks walks the whole index: the daemon
    // does it for HTTP /status (found through the data dir's LOCK file),
    // not for native STATS, so a socket alone cannot tell.
    let cfg = offline_config(&args.config, "namespaces")?;
    let list: serde_json::Value = match DataDirLock::holder(&cfg.data_dir) {
        Some(info) if info.role == "daemon" => namespaces_from_daemon(&info)?,
        Some(info) if info.pid == 0 => bail!(
            "data dir {} is locked by a process whose LOCK record is empty or unreadable (a \
             daemon that could not write it, e.g. on a full filesystem?); ask the daemon over \
             HTTP /status, or stop it and run this again",
            cfg.data_dir.display()
        ),
        Some(info) => bail!(
            "data dir {} is in use by `kvtier {}` (pid {}); try again when it is done",
            cfg.data_dir.display(),
            info.role,
            info.pid
        ),
        None if !cfg.data_dir.join(config::STORE_FILE).exists() => {
            errln!(
                "no chunk store in {} yet (not the daemon's data dir? give its --data-dir or \
                 --config)",
                cfg.data_dir.display()
            );
            serde_json::Value::Array(vec![])
        }
        None => {
            let (store, lock, _) = open_offline(&cfg, "namespaces", Access::ReadOnly)?;
            let list = serde_json::to_value(store.namespace_listing())?;
            close_offline(store, lock)?;
            list
        }
    };
    if args.json {
        outln!("{}", serde_json::to_string_pretty(&list)?);
        return Ok(EXIT_OK);
    }
    let items = list.as_array().cloned().unwrap_or_default();
    if items.is_empty() {
        outln!("no namespaces (a client registers one with HELLO, e.g. the vLLM connector)");
        return Ok(EXIT_OK);
    }
    outln!(
        "{:<32}  {:>10}  {:>10}  MODEL / ENGINE / TP / RANK / DTYPE",
        "ID",
        "CHUNKS",
        "BYTES"
    );
    let mut unrecorded = 0;
    for ns in items {
        let r = &ns["record"];
        if r.is_null() {
            // Chunks held under an id the manifest has no record of.
            unrecorded += 1;
            outln!(
                "{:<32}  {:>10}  {:>10}  (no record: the namespace manifest lost it)",
                ns["id"].as_str().unwrap_or("?"),
                ns["chunks"].as_u64().unwrap_or(0),
                ByteSize(ns["bytes"].as_u64().unwrap_or(0)).approx(),
            );
            continue;
        }
        // Record fields are a client's text: control characters are shown
        // escaped, never sent to the terminal (QA: a model name carrying
        // escape sequences retitled the terminal and printed a fake row).
        let s = |k: &str| printable(r[k].as_str().unwrap_or(""));
        outln!(
            "{:<32}  {:>10}  {:>10}  {} / {} {} / tp{} / rank {} / {}",
            ns["id"].as_str().unwrap_or("?"),
            ns["chunks"].as_u64().unwrap_or(0),
            ByteSize(ns["bytes"].as_u64().unwrap_or(0)).approx(),
            s("model"),
            s("engine"),
            s("engine-version"),
            r["tp-size"].as_u64().unwrap_or(0),
            r["rank"].as_u64().unwrap_or(0),
            s("kv-dtype"),
        );
    }
    if unrecorded > 0 {
        outln!(
            "{unrecorded} namespace(s) without a record: a client's HELLO with the same record \
             registers it again; `kvtier gc --namespace ID --apply` (daemon stopped) drops its chunks"
        );
    }
    Ok(EXIT_OK)
}

/// `s` with its control characters and invisible format characters
/// escaped (`\u{1b}`, `\n`, `\u{202e}`, ...): a record field could
/// otherwise move the cursor, or reorder or hide the text around it.
fn printable(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if c.is_control() {
            out.extend(c.escape_default());
        } else if invisible(c) {
            out.extend(c.escape_unicode());
        } else {
            out.push(c);
        }
    }
    out
}

/// Unicode format characters a terminal draws as nothing: bidirectional
/// overrides and isolates, zero-width characters, the soft hyphen, the
/// byte order mark and interlinear annotation marks.
fn invisible(c: char) -> bool {
    matches!(
        c,
        '\u{00ad}'
            | '\u{061c}'
            | '\u{180e}'
            | '\u{200b}'..='\u{200f}'
            | '\u{2028}'..='\u{202e}'
            | '\u{2060}'..='\u{206f}'
            | '\u{feff}'
            | '\u{fff9}'..='\u{fffb}'
    )
}

/// A progress bar on a terminal, nothing otherwise.
fn progress(what: &str) -> Option<indicatif::ProgressBar> {
    if !std::io::stderr().is_terminal() {
        return None;
    }
    let pb = indicatif::ProgressBar::new(0);
    if let Ok(style) =
        indicatif::ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} chunks ({eta} left)")
    {
        pb.set_style(style.progress_chars("=> "));
    }
    pb.set_message(what.to_string());
    Some(pb)
}

/// The store an offline command works on; `--socket` is refused: these
/// commands open the store itself, found through its data dir.
fn offline_config(args: &StoreArgs, cmd: &str) -> Result<NodeConfig> {
    if args.socket.is_some() {
        return Err(crate::UsageError(format!(
            "`kvtier {cmd}` finds the store (and a daemon on it) through its data dir (--data-dir or --config), not --socket"
        ))
        .into());
    }
    Ok(resolved(&load_by(&args.config_args(), config::load_store_keys)?)?.0)
}

fn verify(args: &VerifyArgs) -> Result<u8> {
    let cfg = offline_config(&args.config, "verify")?;
    // A truncated store file (which a repair grows back): its length now,
    // when it is shorter than its superblock says.
    let file = cfg.data_dir.join(config::STORE_FILE);
    let truncated = tier::store::existing_layout(&cfg.data_dir).and_then(|l| {
        let len = std::fs::metadata(&file).ok()?.len();
        (len < l.bytes()).then_some(len)
    });
    // Recovery's own findings (a torn or corrupt chunk in the region that was
    // open at the last shutdown) are logged as the store opens.
    let _ = node::logging::init(node::logging::LogFormat::Human, "warn");
    let access = if args.repair {
        Access::Repair
    } else {
        Access::ReadOnly
    };
    // A corrupt namespace manifest: the read-only open goes on with the
    // records that still parse (the chunks are checked all the same), and
    // it is reported here; `--repair` sets it aside and rewrites it.
    let manifest_problem = match tier::manifest::load(&cfg.data_dir) {
        // The error's own text says what `--repair` does (QA: said twice).
        Err(e @ tier::Error::ManifestCorrupt { .. }) if !args.repair => Some(e.to_string()),
        _ => None,
    };
    // An unreadable `gc.pending`, which a writable open (`--repair`) removes.
    let gc_pending_before = gc_pending_state(&cfg.data_dir).1;
    let (store, lock, salvaged) = match open_offline(&cfg, "verify", access) {
        Ok(opened) => opened,
        // A store that cannot be opened because of what is on disk (a
        // truncated file, a corrupt superblock or namespace manifest) is a
        // finding, not a usage error: reported as one (exit 5), with the fix
        // in the message.
        Err(e)
            if matches!(
                e.downcast_ref::<tier::Error>(),
                Some(tier::Error::Corrupt { .. } | tier::Error::ManifestCorrupt { .. })
            ) =>
        {
            let mut problem = format!("{:#}", e);
            if matches!(
                e.downcast_ref::<tier::Error>(),
                Some(tier::Error::Corrupt { what, .. }) if what.contains("superblock")
            ) {
                // Nothing to rebuild it from: say what to do instead.
                problem.push_str(
                    "; `verify --repair` cannot rebuild a superblock: restore the store file from \
                     a copy, or move the data dir aside and start empty (it is a cache: see \
                     docs/operations.md, Recovery)",
                );
            }
            if args.json {
                // The same keys as a report of a store that opened.
                let (gc_pending, gc_pending_error) = gc_pending_state(&cfg.data_dir);
                let doc = serde_json::json!({
                    "checked": 0, "bad": 1, "dropped": 0, "dropped_at_open": 0,
                    "damaged_metadata": 0, "sealed_open_region": false,
                    "grown_from": null, "manifest_repaired": null,
                    "problems": [problem],
                    "gc_pending": gc_pending, "gc_pending_error": gc_pending_error,
                });
                outln!("{}", serde_json::to_string_pretty(&doc)?);
            } else {
                outln!("bad: {problem}");
            }
            return Ok(EXIT_VERIFY_FAILED);
        }
        Err(e) => return Err(e),
    };
    // Chunks that failed their checks while the store opened: recovery has
    // already left them out, so the walk below never sees them.
    let opened = store.stats();
    let (at_open, damaged) = (opened.verify_failures, opened.damaged_metadata);
    let pb = progress("verifying");
    let mut cb = |done: u64, total: u64| {
        if let Some(pb) = &pb {
            pb.set_length(total);
            pb.set_position(done);
        }
    };
    let report = store.verify(
        &VerifyOptions {
            repair: args.repair,
        },
        &mut cb,
    );
    if let Some(pb) = &pb {
        pb.finish_and_clear();
    }
    let mut report = report.context("verify the store")?;
    // The chunks recovery dropped from the open region would be dropped
    // again at every open (and counted here) until the region is sealed.
    let sealed = args.repair
        && (at_open > 0 || damaged > 0)
        && store
            .seal_open_region()
            .context("seal the open region (its summary leaves out the dropped chunks)")?;
    close_offline(store, lock)?;
    // A gc --apply killed part way (a writable open, `--repair`, already
    // finished it): said, not counted as damage.
    // One that does not parse is damage: a writable open removes it without
    // finishing its drop (`verify --repair`, then `gc --apply` again).
    let (gc_pending, mut gc_pending_error) = gc_pending_state(&cfg.data_dir);
    // Removed by this repair's open: still a finding (its gc's namespaces
    // are unknown), said as such.
    let gc_pending_removed = gc_pending_error.is_none() && gc_pending_before.is_some();
    if gc_pending_removed {
        gc_pending_error = gc_pending_before;
    }
    report.problems.extend(manifest_problem.iter().cloned());
    if args.json {
        let mut doc = serde_json::to_value(&report)?;
        doc["gc_pending_removed"] = gc_pending_removed.into();
        doc["gc_pending"] = serde_json::to_value(&gc_pending)?;
        doc["gc_pending_error"] = serde_json::to_value(&gc_pending_error)?;
        doc["dropped_at_open"] = at_open.into();
        doc["damaged_metadata"] = damaged.into();
        doc["sealed_open_region"] = sealed.into();
        doc["grown_from"] = truncated.map_or(serde_json::Value::Null, Into::into);
        doc["manifest_repaired"] = match &salvaged {
            Some(s) => serde_json::json!({
                "set_aside": s.set_aside, "records_kept": s.kept, "records_lost": s.lost,
            }),
            None => serde_json::Value::Null,
        };
        outln!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        if let Some(len) = truncated {
            outln!(
                "store file: truncated to {len} bytes; grown back to its size (the chunks that \
                 were past the cut are dropped)"
            );
        }
        if let Some(s) = &salvaged {
            outln!(
                "namespace manifest: corrupt; copied aside to {}, {} record(s) kept, {} unreadable \
                 (chunks are not affected; a client registers its namespace again at HELLO)",
                s.set_aside.display(),
                s.kept,
                s.lost
            );
        }
        for p in &report.problems {
            outln!("bad: {p}");
        }
        if !gc_pending.is_empty() {
            outln!(
                "gc pending: a `gc --apply` of {} namespace(s) was interrupted; its chunks are \
                 still counted here, and the next start (or `verify --repair`, or any `gc \
                 --apply`) finishes the drop",
                gc_pending.len()
            );
        }
        if let Some(e) = gc_pending_error.as_ref().filter(|_| gc_pending_removed) {
            outln!(
                "gc pending: unreadable ({e}); removed now: a `gc --apply` may have been \
                 interrupted and its namespaces are unknown: run that gc again"
            );
        } else if let Some(e) = &gc_pending_error {
            outln!(
                "gc pending: unreadable ({e}); a `gc --apply` may have been interrupted and its \
                 namespaces are unknown: `verify --repair` (or the next start) removes the file, \
                 then run that gc again"
            );
        }
        if sealed && at_open > 0 {
            outln!(
                "dropped at open: {at_open} chunk(s) found torn or corrupt while the store opened \
                 (never served; see the warnings above); the open region is sealed now without \
                 them (or freed, when it held nothing else)"
            );
        } else if at_open > 0 {
            outln!(
                "dropped at open: {at_open} chunk(s) found torn or corrupt while the store opened \
                 (never served; see the warnings above; counted at every open until the open \
                 region is sealed: `verify --repair` seals it)"
            );
        }
        if damaged > 0 && sealed {
            outln!(
                "damaged at open: {damaged} region slot(s), summary(ies), batch record(s) or \
                 deletes-journal record(s) (see the warnings above for what was recovered); \
                 rewritten now"
            );
        } else if damaged > 0 {
            outln!(
                "damaged at open: {damaged} region slot(s), summary(ies), batch record(s) or \
                 deletes-journal record(s) (see the warnings above for what was recovered; \
                 counted at every open until the region is reused, or `verify --repair` \
                 rewrites them; a damaged delete's chunk may be back)"
            );
        }
        outln!(
            "checked {} chunk(s): {} bad, {} dropped{}",
            report.checked,
            report.bad,
            report.dropped,
            if report.bad > 0 && !args.repair {
                " (run with --repair to drop them)"
            } else {
                ""
            }
        );
    }
    Ok(
        if report.bad > 0
            || !report.problems.is_empty()
            || at_open > 0
            || damaged > 0
            || salvaged.is_some()
            || truncated.is_some()
            || gc_pending_error.is_some()
        {
            EXIT_VERIFY_FAILED
        } else {
            EXIT_OK
        },
    )
}

/// The namespaces of an interrupted `gc --apply` in `data_dir`, or why its
/// `gc.pending` could not be read.
fn gc_pending_state(data_dir: &Path) -> (Vec<Namespace>, Option<String>) {
    match tier::maintenance::pending_gc(data_dir) {
        Ok(p) => (p.unwrap_or_default(), None),
        Err(e) => (Vec::new(), Some(e.to_string())),
    }
}

fn gc(args: &GcArgs) -> Result<u8> {
    if args.namespaces.is_empty() && args.older_than.is_none() {
        return Err(crate::UsageError(
            "give --namespace ID (repeatable) and/or --older-than DURATION to select what to drop"
                .into(),
        )
        .into());
    }
    let cfg = offline_config(&args.config, "gc")?;
    let pending = || gc_pending_state(&cfg.data_dir).0;
    let pending_before = if args.apply { pending() } else { Vec::new() };
    // The open logs why it could not finish an earlier gc (`warn`).
    let _ = node::logging::init(node::logging::LogFormat::Human, "warn");
    let (store, lock, _) = open_offline(
        &cfg,
        "gc",
        if args.apply {
            Access::Write
        } else {
            Access::ReadOnly
        },
    )?;
    // A writable open first finishes an interrupted `gc --apply` (one that
    // failed, e.g. on a full filesystem, after its selection was durable):
    // said, or a retry read "dropped: 0 namespace(s)" (QA).
    let after_open = pending();
    let finished: Vec<Namespace> = if pending_before.is_empty() || !after_open.is_empty() {
        Vec::new()
    } else {
        pending_before
    };
    let joined = |ids: &[Namespace]| {
        ids.iter()
            .map(Namespace::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    };
    if args.apply && !after_open.is_empty() {
        errln!(
            "kvtier: warning: an interrupted gc --apply of {} could not be finished at open; \
             this gc drops it too",
            joined(&after_open)
        );
    }
    if !finished.is_empty() {
        errln!(
            "kvtier: finished an interrupted gc --apply first (gc.pending): dropped {}",
            joined(&finished)
        );
    }
    // An id that is not in this store (a typo, another node's store) is said,
    // not reported as "dropped: 1 namespace(s), 0 chunk(s)".
    let known: Vec<Namespace> = store.namespaces().iter().map(|n| n.id).collect();
    let unknown: Vec<String> = args
        .namespaces
        .iter()
        .filter(|ns| !known.contains(ns) && !finished.contains(ns))
        .map(Namespace::to_string)
        .collect();
    if !unknown.is_empty() {
        errln!(
            "kvtier: warning: not in the namespace manifest of the store at {}: {} (`kvtier namespaces --data-dir ...` lists its namespaces; chunks of such an id that a lost manifest left on disk are counted below)",
            cfg.data_dir.display(),
            unknown.join(", ")
        );
    }
    let opts = GcOptions {
        // Unknown ids too: chunks of a namespace missing from the manifest
        // can only be dropped by id.
        namespaces: args.namespaces.clone(),
        older_than: args.older_than.map(|d| d.0),
        dry_run: !args.apply,
    };
    let report = store.gc(&opts).context("gc the store");
    let closed = close_offline(store, lock);
    let report = match (report, closed) {
        (Ok(report), closed) => {
            closed?;
            report
        }
        (Err(e), closed) => {
            if let Err(c) = closed {
                errln!("kvtier: warning: {c:#}");
            }
            // Recorded when this run wrote its selection (gc.pending
            // changed), or the ids it was given are all in it already.
            let now = pending();
            let recorded = args.apply
                && !now.is_empty()
                && (now != after_open
                    || (!args.namespaces.is_empty()
                        && args.namespaces.iter().all(|n| now.contains(n))));
            return Err(if recorded {
                e.context(
                    "the drop is recorded in gc.pending: the next writable open of this data \
                     dir (a daemon start, verify --repair, gc --apply) finishes it once it can \
                     write",
                )
            } else {
                e
            });
        }
    };
    if args.json {
        let doc = serde_json::json!({ "dry_run": !args.apply, "report": report });
        outln!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        let verb = if args.apply {
            "dropped"
        } else {
            "would drop (dry run; add --apply)"
        };
        let ids: Vec<String> = report.namespaces.iter().map(Namespace::to_string).collect();
        outln!(
            "{verb}: {} namespace(s), {} chunk(s), {}",
            ids.len(),
            report.chunks,
            ByteSize(report.bytes).approx()
        );
        for id in ids {
            outln!("  {id}");
        }
    }
    Ok(EXIT_OK)
}

fn completions(args: &CompletionsArgs) -> Result<u8> {
    use clap::CommandFactory;
    use clap_complete::Shell as S;
    let shell = match args.shell {
        Shell::Bash => S::Bash,
        Shell::Zsh => S::Zsh,
        Shell::Fish => S::Fish,
        Shell::Elvish => S::Elvish,
        Shell::Powershell => S::PowerShell,
    };
    let mut cmd = Cli::command();
    // Into a buffer first: clap_complete panics on a failed write.
    let mut script = Vec::new();
    clap_complete::generate(shell, &mut cmd, "kvtier", &mut script);
    let mut script = String::from_utf8(script).context("completion script")?;
    // The `tier` alias completes like `kvtier`.
    match args.shell {
        Shell::Bash => script.push_str(
            "if [[ \"${BASH_VERSINFO[0]}\" -eq 4 && \"${BASH_VERSINFO[1]}\" -ge 4 || \"${BASH_VERSINFO[0]}\" -gt 4 ]]; then\n    \
             complete -F _kvtier -o nosort -o bashdefault -o default tier\n\
             else\n    complete -F _kvtier -o bashdefault -o default tier\nfi\n",
        ),
        Shell::Zsh => {
            script = script.replacen("#compdef kvtier\n", "#compdef kvtier tier\n", 1);
        }
        Shell::Fish => script.push_str("complete -c tier -w kvtier\n"),
        Shell::Elvish | Shell::Powershell => {}
    }
    out!("{script}");
    Ok(EXIT_OK)
}

#[cfg(test)]
mod printable_tests {
    #[test]
    fn control_characters_are_escaped() {
        assert_eq!(
            super::printable("evil\u{1b}]0;x\u{7}\nFAKE\té"),
            "evil\\u{1b}]0;x\\u{7}\\nFAKE\\té"
        );
    }

    #[test]
    fn invisible_format_characters_are_escaped() {
        // A right-to-left override shows "gpj.exe" as "exe.jpg"; zero-width
        // spaces and a BOM make two names that look the same.
        assert_eq!(
            super::printable("a\u{202e}gpj.exe b\u{200b}c\u{feff}\u{2066}é中"),
            "a\\u{202e}gpj.exe b\\u{200b}c\\u{feff}\\u{2066}é中"
        );
    }
}

#[cfg(test)]
mod stop_status_tests {
    use node::tier::store::FlushReport;

    fn summary(flush: Option<FlushReport>) -> node::RunSummary {
        node::RunSummary {
            uptime: std::time::Duration::from_secs(1),
            flush,
            aborted: Vec::new(),
        }
    }

    #[test]
    fn a_stop_that_lost_dirty_chunks_is_a_failure() {
        let report = |failed| FlushReport {
            chunks: 3,
            bytes: 3 << 20,
            failed,
        };
        assert_eq!(
            super::stop_status(&summary(Some(report(0)))),
            crate::EXIT_OK
        );
        assert_eq!(
            super::stop_status(&summary(Some(report(16)))),
            crate::EXIT_ERROR
        );
        // A store that failed to close is an error before this point.
        assert_eq!(super::stop_status(&summary(None)), crate::EXIT_OK);
    }
}

#[cfg(test)]
mod render_table_tests {
    #[test]
    fn lists_of_records_are_counted_not_dumped() {
        let doc = serde_json::json!({
            "ram_bytes": 2048,
            "peers": [{"name": "n2", "state": "up"}, {"name": "n3", "state": "down"}],
            "tags": ["a", "b"],
        });
        let t = super::render_table(&doc);
        assert!(t.contains("peers      2 (see `kvtier peers`)"), "{t}");
        assert!(!t.contains("\"n2\""), "{t}");
        assert!(t.contains("ram_bytes  2048 (2.0 KiB)"), "{t}");
        assert!(t.contains("tags       [\"a\",\"b\"]"), "{t}");
    }
}
