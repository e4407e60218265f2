//! Execution of parsed RESP commands against a [`NodeContext`], with replies
//! byte for byte as Redis 7 sends them (RESP2).
//!
//! Check order is Redis's: unknown command, then arity, then authentication.
//! Every read goes through [`NodeContext::get`] / [`NodeContext::locate`], so
//! the node's read cascade serves RESP like every other interface.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tier::ChunkId;

use super::RespOptions;
use super::keys::{KeyMapper, MAX_KEY_LEN};
use super::reply::Output;
use crate::NodeContext;
use crate::context::NodeCounters;

/// The Redis version kvtier reports (`redis_version`, `HELLO`): the RESP
/// behaviour it mimics.
pub const REDIS_COMPAT_VERSION: &str = "7.2.0";
/// Exact Redis error texts.
pub const NOAUTH: &str = "-NOAUTH Authentication required.";
/// See [`NOAUTH`].
pub const WRONGPASS: &str = "-WRONGPASS invalid username-password pair or user is disabled.";
const NOPROTO: &str = "-NOPROTO unsupported protocol version";
const NOT_INTEGER: &str = "value is not an integer or out of range";
const SYNTAX: &str = "syntax error";
/// Pins taken by positive EXISTS replies, per connection.
const PINS_MAX: usize = 32;
/// Slots of the per-key write epochs that invalidate pins.
const EPOCH_SLOTS: usize = 1024;

/// State shared by every connection of one RESP listener.
pub struct Shared {
    /// The node.
    pub ctx: Arc<NodeContext>,
    /// Listener options.
    pub opts: RespOptions,
    /// Key → chunk id mapping.
    pub keys: Arc<KeyMapper>,
    /// Connections open now.
    pub clients: AtomicU64,
    /// The listening port (for INFO).
    pub port: u16,
    next_client_id: AtomicU64,
    /// Bytes of large values being received now over all connections (each
    /// buffer is taken at the bulk's announced length), bounded by
    /// `receiving_max`: a client announcing values it never sends cannot
    /// make the daemon hold more.
    pub receiving: std::sync::atomic::AtomicUsize,
    /// The larger of 1 GiB and a quarter of the RAM budget.
    pub receiving_max: usize,
    // Bumped by every SET / DEL of a key hashing to the slot; a pin is only
    // served while its slot is unchanged, so a pin never outlives a write.
    epochs: Box<[AtomicU64]>,
    /// Bytes held by pins over all connections (INFO's
    /// `kvtier_pinned_bytes`; shared with RAM while the key is there): a
    /// pinned key evicted since holds its bytes outside the RAM budget
    /// until the pin goes.
    pub pinned_bytes: Arc<AtomicU64>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("port", &self.port)
            .field("clients", &self.clients)
            .finish_non_exhaustive()
    }
}

impl Shared {
    /// State for a listener on `port`.
    pub fn new(ctx: Arc<NodeContext>, opts: RespOptions, port: u16) -> Self {
        let ram = usize::try_from(ctx.store.config().ram_budget).unwrap_or(usize::MAX);
        Self {
            receiving: std::sync::atomic::AtomicUsize::new(0),
            receiving_max: match opts.max_receiving {
                0 => (ram / 4).max(1 << 30),
                n => n,
            },
            ctx,
            opts,
            keys: Arc::new(KeyMapper::new()),
            clients: AtomicU64::new(0),
            port,
            next_client_id: AtomicU64::new(1),
            epochs: (0..EPOCH_SLOTS).map(|_| AtomicU64::new(0)).collect(),
            pinned_bytes: Arc::new(AtomicU64::new(0)),
        }
    }

    fn epoch_slot(&self, id: &ChunkId) -> &AtomicU64 {
        let i = u16::from_le_bytes([id.key.0[0], id.key.0[1]]) as usize % EPOCH_SLOTS;
        &self.epochs[i]
    }

    fn bump(&self, id: &ChunkId) {
        self.epoch_slot(id).fetch_add(1, Ordering::AcqRel);
    }
}

struct Pin {
    key: Bytes,
    epoch: u64,
    /// The store's [`tier::ChunkStore::deletions_of`] the key at the pin.
    deletions: u64,
    at: Instant,
    data: Bytes,
    /// [`Shared::pinned_bytes`], less `data` when the pin goes.
    held: Arc<AtomicU64>,
}

impl Drop for Pin {
    fn drop(&mut self) {
        self.held
            .fetch_sub(self.data.len() as u64, Ordering::Relaxed);
    }
}

/// Per-connection state.
pub struct Session {
    /// Client id (CLIENT ID, HELLO).
    pub id: u64,
    /// Whether commands other than AUTH / HELLO / QUIT are allowed.
    pub authenticated: bool,
    /// Name set by CLIENT SETNAME / HELLO SETNAME.
    pub name: Option<Bytes>,
    /// Set by QUIT: close after the reply.
    pub close: bool,
    /// Replies in RESP3 (after `HELLO 3`).
    pub resp3: bool,
    pins: VecDeque<Pin>,
    pin_ttl: Duration,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("id", &self.id)
            .field("authenticated", &self.authenticated)
            .finish_non_exhaustive()
    }
}

impl Session {
    /// How long until the oldest pin runs out (None: no pins).
    pub fn pins_expire_in(&self) -> Option<Duration> {
        self.pins
            .iter()
            .map(|p| self.pin_ttl.saturating_sub(p.at.elapsed()))
            .min()
    }

    /// Drops the pins whose time is up, and with them bytes the store may
    /// have evicted since (QA: an idle connection held them until it
    /// closed, past the RAM budget).
    pub fn drop_old_pins(&mut self) {
        if self.pins.is_empty() {
            return;
        }
        let ttl = self.pin_ttl;
        self.pins.retain(|p| p.at.elapsed() < ttl);
    }

    /// A new session; authenticated from the start when no password is set.
    pub fn new(shared: &Shared) -> Self {
        Self {
            id: shared.next_client_id.fetch_add(1, Ordering::Relaxed),
            authenticated: shared.opts.password.is_none(),
            name: None,
            close: false,
            resp3: false,
            pins: VecDeque::new(),
            pin_ttl: shared.opts.pin_ttl,
        }
    }
}

type Res = Result<(), Vec<u8>>;

fn err(msg: impl Into<Vec<u8>>) -> Res {
    Err(msg.into())
}

fn wrong_args(name: &str) -> Vec<u8> {
    format!("wrong number of arguments for '{name}' command").into_bytes()
}

/// `%.Ns` of a C string: up to the first NUL, at most `n` bytes.
fn c_str(b: &[u8], n: usize) -> &[u8] {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len()).min(n);
    &b[..end]
}

fn unknown_command(args: &[Bytes]) -> Vec<u8> {
    let mut rest: Vec<u8> = Vec::new();
    for a in &args[1..] {
        if rest.len() >= 128 {
            break;
        }
        let room = 128 - rest.len();
        rest.push(b'\'');
        rest.extend_from_slice(c_str(a, room));
        rest.extend_from_slice(b"' ");
    }
    let mut m = b"unknown command '".to_vec();
    m.extend_from_slice(c_str(&args[0], 128));
    m.extend_from_slice(b"', with args beginning with: ");
    m.extend_from_slice(&rest);
    m
}

fn unknown_subcommand(sub: &[u8], cmd: &str) -> Vec<u8> {
    let mut m = b"unknown subcommand '".to_vec();
    m.extend_from_slice(c_str(sub, 128));
    m.extend_from_slice(format!("'. Try {cmd} HELP.").as_bytes());
    m
}

/// A served command, as `COMMAND INFO` describes it (Redis 7's reply
/// shape, without its key specs and subcommands).
struct Spec {
    name: &'static str,
    arity: i32,
    no_auth: bool,
    /// Redis's command flags (`readonly`, `write`, `fast`, ...).
    flags: &'static [&'static str],
    /// First key argument, last key argument (-1: the last argument) and
    /// step between keys; (0, 0, 0) for a command that takes no keys.
    keys: (i64, i64, i64),
    /// ACL categories.
    acl: &'static [&'static str],
}

const COMMANDS: &[Spec] = &[
    Spec {
        name: "auth",
        arity: -2,
        no_auth: true,
        flags: &[
            "noscript",
            "loading",
            "stale",
            "fast",
            "no_auth",
            "allow_busy",
        ],
        keys: (0, 0, 0),
        acl: &["@fast", "@connection"],
    },
    Spec {
        name: "client",
        arity: -2,
        no_auth: false,
        flags: &["noscript", "loading", "stale"],
        keys: (0, 0, 0),
        acl: &["@slow", "@connection"],
    },
    Spec {
        name: "command",
        arity: -1,
        no_auth: false,
        flags: &["loading", "stale"],
        keys: (0, 0, 0),
        acl: &["@slow", "@connection"],
    },
    Spec {
        name: "config",
        arity: -2,
        no_auth: false,
        flags: &["admin", "noscript", "loading", "stale"],
        keys: (0, 0, 0),
        acl: &["@admin", "@slow", "@dangerous"],
    },
    Spec {
        name: "dbsize",
        arity: 1,
        no_auth: false,
        flags: &["readonly", "fast"],
        keys: (0, 0, 0),
        acl: &["@keyspace", "@read", "@fast"],
    },
    Spec {
        name: "del",
        arity: -2,
        no_auth: false,
        flags: &["write"],
        keys: (1, -1, 1),
        acl: &["@keyspace", "@write", "@slow"],
    },
    Spec {
        name: "echo",
        arity: 2,
        no_auth: false,
        flags: &["fast"],
        keys: (0, 0, 0),
        acl: &["@fast", "@connection"],
    },
    Spec {
        name: "exists",
        arity: -2,
        no_auth: false,
        flags: &["readonly", "fast"],
        keys: (1, -1, 1),
        acl: &["@keyspace", "@read", "@fast"],
    },
    Spec {
        name: "get",
        arity: 2,
        no_auth: false,
        flags: &["readonly", "fast"],
        keys: (1, 1, 1),
        acl: &["@read", "@string", "@fast"],
    },
    Spec {
        name: "hello",
        arity: -1,
        no_auth: true,
        flags: &[
            "noscript",
            "loading",
            "stale",
            "fast",
            "no_auth",
            "allow_busy",
        ],
        keys: (0, 0, 0),
        acl: &["@fast", "@connection"],
    },
    Spec {
        name: "info",
        arity: -1,
        no_auth: false,
        flags: &["loading", "stale"],
        keys: (0, 0, 0),
        acl: &["@slow", "@dangerous"],
    },
    Spec {
        name: "ping",
        arity: -1,
        no_auth: false,
        flags: &["fast"],
        keys: (0, 0, 0),
        acl: &["@fast", "@connection"],
    },
    Spec {
        name: "quit",
        arity: -1,
        no_auth: true,
        flags: &[
            "noscript",
            "loading",
            "stale",
            "fast",
            "no_auth",
            "allow_busy",
        ],
        keys: (0, 0, 0),
        acl: &["@fast", "@connection"],
    },
    Spec {
        name: "select",
        arity: 2,
        no_auth: false,
        flags: &["loading", "stale", "fast"],
        keys: (0, 0, 0),
        acl: &["@fast", "@connection"],
    },
    Spec {
        name: "set",
        arity: -3,
        no_auth: false,
        flags: &["write", "denyoom"],
        keys: (1, 1, 1),
        acl: &["@write", "@string", "@slow"],
    },
];

fn arity_ok(arity: i32, argc: usize) -> bool {
    let argc = i64::try_from(argc).unwrap_or(i64::MAX);
    let arity = i64::from(arity);
    if arity >= 0 {
        argc == arity
    } else {
        argc >= -arity
    }
}

/// Executes one command, appending its reply to `out`. Returns whether the
/// reply was an error.
pub async fn execute(
    shared: &Shared,
    session: &mut Session,
    args: Vec<Bytes>,
    out: &mut Output,
) -> bool {
    let counters = &shared.ctx.counters;
    NodeCounters::inc(&counters.resp_commands);
    let res = dispatch(shared, session, &args, out).await;
    match res {
        Ok(()) => false,
        Err(msg) => {
            NodeCounters::inc(&counters.resp_errors);
            out.error(msg);
            true
        }
    }
}

async fn dispatch(shared: &Shared, s: &mut Session, args: &[Bytes], out: &mut Output) -> Res {
    let Some(name) = args.first() else {
        return Ok(());
    };
    let lower = name.to_ascii_lowercase();
    let Some(spec) = COMMANDS
        .iter()
        .find(|c| c.name.as_bytes() == lower.as_slice())
    else {
        return Err(unknown_command(args));
    };
    if !arity_ok(spec.arity, args.len()) {
        return Err(wrong_args(spec.name));
    }
    if !s.authenticated && !spec.no_auth {
        return err(NOAUTH);
    }
    match spec.name {
        "auth" => auth(shared, s, args, out),
        "client" => client(s, args, out),
        "command" => command(args, out),
        "config" => config(shared, args, out),
        "dbsize" => {
            out.integer(resp_keys(shared).await? as i64);
            Ok(())
        }
        "del" => del(shared, args, out).await,
        "exists" => exists(shared, s, args, out),
        "get" => get(shared, s, &args[1], out).await,
        "hello" => hello(shared, s, args, out),
        "info" => {
            let sections = &args[1..];
            let keys = if super::info::wants_keyspace(sections) {
                Some(resp_keys(shared).await?)
            } else {
                None
            };
            out.verbatim_text(super::info::info_text(shared, sections, keys).as_bytes());
            Ok(())
        }
        // redis-cli --pipe ends with an ECHO to know it has every reply
        // (QA: without it, it waited 30 s and exited 1).
        "echo" => {
            out.bulk(&args[1]);
            Ok(())
        }
        "ping" => match args.len() {
            1 => {
                out.simple("PONG");
                Ok(())
            }
            2 => {
                out.bulk(&args[1]);
                Ok(())
            }
            _ => Err(wrong_args("ping")),
        },
        "quit" => {
            s.close = true;
            out.ok();
            Ok(())
        }
        "select" => match super::parser::string_to_i64(&args[1]) {
            None => err(NOT_INTEGER),
            // Redis reads the index as a C int first.
            Some(n) if i32::try_from(n).is_err() => err(format!(
                "value is out of range, value must between {} and {}",
                i32::MIN,
                i32::MAX
            )),
            Some(0) => {
                out.ok();
                Ok(())
            }
            Some(_) => err("DB index is out of range"),
        },
        "set" => set(shared, args, out).await,
        _ => Err(unknown_command(args)),
    }
}

fn password_matches(configured: &str, given: &[u8]) -> bool {
    let c = configured.as_bytes();
    // Length leaks; content compared in constant time.
    c.len() == given.len() && c.iter().zip(given).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
}

/// Redis's credential check for the `default` user.
fn check_credentials(shared: &Shared, user: Option<&[u8]>, pass: &[u8]) -> Res {
    if let Some(u) = user {
        if u != b"default" {
            return err(WRONGPASS);
        }
    }
    match &shared.opts.password {
        None => Ok(()),
        Some(pw) if password_matches(pw, pass) => Ok(()),
        Some(_) => err(WRONGPASS),
    }
}

fn auth(shared: &Shared, s: &mut Session, args: &[Bytes], out: &mut Output) -> Res {
    if args.len() > 3 {
        return err(SYNTAX);
    }
    if args.len() == 2 && shared.opts.password.is_none() {
        return err(
            "AUTH <password> called without any password configured for the default user. Are you sure your configuration is correct?",
        );
    }
    let (user, pass) = if args.len() == 3 {
        (Some(&args[1][..]), &args[2][..])
    } else {
        (None, &args[1][..])
    };
    check_credentials(shared, user, pass)?;
    s.authenticated = true;
    out.ok();
    Ok(())
}

fn hello(shared: &Shared, s: &mut Session, args: &[Bytes], out: &mut Output) -> Res {
    // Without a version the protocol stays as it is.
    let mut proto = None;
    if args.len() >= 2 {
        match super::parser::string_to_i64(&args[1]) {
            None => return err("Protocol version is not an integer or out of range"),
            Some(v @ (2 | 3)) => proto = Some(v),
            Some(_) => return err(NOPROTO),
        }
    }
    let mut auth: Option<(&[u8], &[u8])> = None;
    let mut setname: Option<&Bytes> = None;
    let mut j = 2;
    while j < args.len() {
        let more = args.len() - 1 - j;
        let opt = args[j].to_ascii_lowercase();
        if opt == b"auth" && more >= 2 {
            auth = Some((&args[j + 1], &args[j + 2]));
            j += 3;
        } else if opt == b"setname" && more >= 1 {
            // Checked while parsing, before AUTH, as Redis 7.2 does.
            check_client_name(&args[j + 1])?;
            setname = Some(&args[j + 1]);
            j += 2;
        } else {
            let mut m = b"Syntax error in HELLO option '".to_vec();
            m.extend_from_slice(c_str(&args[j], usize::MAX));
            m.push(b'\'');
            return Err(m);
        }
    }
    if let Some((user, pass)) = auth {
        check_credentials(shared, Some(user), pass)?;
        s.authenticated = true;
    }
    if !s.authenticated {
        return err(
            "-NOAUTH HELLO must be called with the client already authenticated, otherwise the HELLO <proto> AUTH <user> <pass> option can be used to authenticate the client and select the RESP protocol version at the same time",
        );
    }
    if let Some(n) = setname {
        s.name = (!n.is_empty()).then(|| n.clone());
    }
    if let Some(v) = proto {
        s.resp3 = v == 3;
        out.set_resp3(s.resp3);
    }
    out.map_header(7);
    out.bulk(b"server");
    out.bulk(b"redis");
    out.bulk(b"version");
    out.bulk(REDIS_COMPAT_VERSION.as_bytes());
    out.bulk(b"proto");
    out.integer(if s.resp3 { 3 } else { 2 });
    out.bulk(b"id");
    out.integer(s.id as i64);
    out.bulk(b"mode");
    out.bulk(b"standalone");
    out.bulk(b"role");
    out.bulk(b"master");
    out.bulk(b"modules");
    out.array_header(0);
    Ok(())
}

/// Redis's rule for CLIENT SETNAME and HELLO SETNAME.
fn check_client_name(name: &[u8]) -> Res {
    if name.iter().any(|&b| b <= b' ' || b > b'~') {
        return err("Client names cannot contain spaces, newlines or special characters.");
    }
    Ok(())
}

fn client(s: &mut Session, args: &[Bytes], out: &mut Output) -> Res {
    let sub = args[1].to_ascii_lowercase();
    match sub.as_slice() {
        b"id" if args.len() == 2 => out.integer(s.id as i64),
        b"id" => return Err(wrong_args("client|id")),
        b"getname" if args.len() == 2 => match &s.name {
            Some(n) => out.bulk(n),
            None => out.null(),
        },
        b"getname" => return Err(wrong_args("client|getname")),
        b"setname" if args.len() == 3 => {
            check_client_name(&args[2])?;
            s.name = (!args[2].is_empty()).then(|| args[2].clone());
            out.ok();
        }
        b"setname" => return Err(wrong_args("client|setname")),
        // Client-side caching needs invalidation pushes kvtier never sends:
        // a client told "+OK" would serve stale values.
        b"tracking" if args.len() >= 3 && !args[2].eq_ignore_ascii_case(b"off") => {
            return err(
                "CLIENT TRACKING is not supported by kvtier (no invalidation messages); keep client-side caching off",
            );
        }
        // Hints that change nothing here (a client library's name and
        // version; eviction and LRU hints for a server that evicts by size;
        // tracking off) are accepted and ignored.
        b"help" if args.len() == 2 => {
            let lines = [
                "CLIENT <subcommand> [<arg> ...]. kvtier serves:",
                "ID",
                "GETNAME",
                "SETNAME <name>",
                "SETINFO, NO-EVICT, NO-TOUCH, TRACKING OFF: accepted and ignored",
            ];
            help_reply(out, &lines);
        }
        b"no-evict" | b"no-touch" if args.len() == 3 => {
            if !(args[2].eq_ignore_ascii_case(b"on") || args[2].eq_ignore_ascii_case(b"off")) {
                return err(SYNTAX);
            }
            out.ok();
        }
        b"setinfo" if args.len() == 4 => {
            if !(args[2].eq_ignore_ascii_case(b"lib-name")
                || args[2].eq_ignore_ascii_case(b"lib-ver"))
            {
                return err(format!(
                    "Unrecognized option '{}'",
                    String::from_utf8_lossy(&args[2])
                ));
            }
            out.ok();
        }
        b"tracking" if args.len() >= 3 => out.ok(),
        b"setinfo" | b"no-evict" | b"no-touch" | b"tracking" => {
            return Err(wrong_args(&format!(
                "client|{}",
                String::from_utf8_lossy(&sub)
            )));
        }
        // Everything else (KILL, PAUSE, REPLY, LIST, ...) is not served:
        // a client told "+OK" would believe it had happened.
        _ => return Err(unknown_subcommand(&args[1], "CLIENT")),
    }
    Ok(())
}

/// `COMMAND INFO`'s entry of one command: name, arity, flags, first key,
/// last key, step, ACL categories, then (Redis 7) tips, key specs and
/// subcommands, empty here.
fn command_info(spec: &Spec, out: &mut Output) {
    out.array_header(10);
    out.bulk(spec.name.as_bytes());
    out.integer(i64::from(spec.arity));
    out.set_header(spec.flags.len());
    for f in spec.flags {
        out.simple(f);
    }
    let (first, last, step) = spec.keys;
    out.integer(first);
    out.integer(last);
    out.integer(step);
    out.set_header(spec.acl.len());
    for a in spec.acl {
        out.simple(a);
    }
    out.array_header(0);
    out.array_header(0);
    out.array_header(0);
}

fn command(args: &[Bytes], out: &mut Output) -> Res {
    let Some(sub) = args.get(1).map(|a| a.to_ascii_lowercase()) else {
        out.array_header(COMMANDS.len());
        for spec in COMMANDS {
            command_info(spec, out);
        }
        return Ok(());
    };
    match sub.as_slice() {
        b"help" if args.len() == 2 => {
            let lines = [
                "COMMAND <subcommand> [<arg> ...]. kvtier serves:",
                "(no subcommand): every command's details",
                "COUNT",
                "INFO [<command-name> ...]",
                "LIST [FILTERBY (MODULE <name>|ACLCAT <category>|PATTERN <pattern>)]",
                "DOCS: an empty reply (no documentation is served)",
            ];
            help_reply(out, &lines);
        }
        b"count" if args.len() == 2 => out.integer(COMMANDS.len() as i64),
        b"count" => return Err(wrong_args("command|count")),
        b"docs" => out.map_header(0),
        b"list" => {
            let names: Vec<&str> = match &args[2..] {
                [] => COMMANDS.iter().map(|c| c.name).collect(),
                [by, kind, arg] if by.eq_ignore_ascii_case(b"filterby") => {
                    let kind = kind.to_ascii_lowercase();
                    let keep = |c: &&Spec| match kind.as_slice() {
                        // No modules are loaded.
                        b"module" => false,
                        // As Redis: the category without its `@`, any
                        // case; an unknown one selects nothing.
                        b"aclcat" => c
                            .acl
                            .iter()
                            .any(|a| a.as_bytes()[1..].eq_ignore_ascii_case(arg)),
                        _ => glob_match(arg, c.name.as_bytes()),
                    };
                    if !matches!(kind.as_slice(), b"module" | b"aclcat" | b"pattern") {
                        return err(SYNTAX);
                    }
                    COMMANDS.iter().filter(keep).map(|c| c.name).collect()
                }
                _ => return err(SYNTAX),
            };
            out.array_header(names.len());
            for n in names {
                out.bulk(n.as_bytes());
            }
        }
        // Every command without names, as Redis 7 does; an unknown name
        // gets a null entry.
        b"info" if args.len() == 2 => {
            out.array_header(COMMANDS.len());
            for spec in COMMANDS {
                command_info(spec, out);
            }
        }
        b"info" => {
            out.array_header(args.len() - 2);
            for name in &args[2..] {
                let name = name.to_ascii_lowercase();
                match COMMANDS.iter().find(|c| c.name.as_bytes() == name) {
                    Some(spec) => command_info(spec, out),
                    None => out.null_array(),
                }
            }
        }
        _ => return Err(unknown_subcommand(&args[1], "COMMAND")),
    }
    Ok(())
}

fn config(shared: &Shared, args: &[Bytes], out: &mut Output) -> Res {
    let sub = args[1].to_ascii_lowercase();
    match sub.as_slice() {
        b"get" => {
            if args.len() < 3 {
                return Err(wrong_args("config|get"));
            }
            let st = shared.ctx.store.stats();
            let params: [(&str, String); 6] = [
                ("save", String::new()),
                ("appendonly", "no".into()),
                ("maxmemory", st.ram_budget.to_string()),
                // RAM evicts the least recently used chunk of any key (to
                // the disk tier, where there is one).
                ("maxmemory-policy", "allkeys-lru".into()),
                ("databases", "1".into()),
                ("maxclients", shared.opts.max_connections.to_string()),
            ];
            let mut found = Vec::new();
            for (k, v) in &params {
                // As Redis 7: a pattern without `[`, `*` or `?` is a name.
                let matches = |p: &Bytes| {
                    if p.iter().any(|b| matches!(b, b'[' | b'*' | b'?')) {
                        glob_match(p, k.as_bytes())
                    } else {
                        p.eq_ignore_ascii_case(k.as_bytes())
                    }
                };
                if args[2..].iter().any(matches) {
                    found.push((*k, v.clone()));
                }
            }
            out.map_header(found.len());
            for (k, v) in found {
                out.bulk(k.as_bytes());
                out.bulk(v.as_bytes());
            }
            Ok(())
        }
        b"help" if args.len() == 2 => {
            let lines = [
                "CONFIG <subcommand> [<arg> ...]. kvtier serves:",
                "GET <pattern> [<pattern> ...]",
                "SET, RESETSTAT, REWRITE: refused (kvtier is configured by its file)",
            ];
            help_reply(out, &lines);
            Ok(())
        }
        b"set" | b"resetstat" | b"rewrite" => err(
            "CONFIG SET, RESETSTAT and REWRITE are not supported by kvtier; use its config file",
        ),
        _ => Err(unknown_subcommand(&args[1], "CONFIG")),
    }
}

/// A `HELP` subcommand's reply: one simple string per line.
fn help_reply(out: &mut Output, lines: &[&str]) {
    out.array_header(lines.len());
    for l in lines {
        out.simple(l);
    }
}

/// Redis's pattern match (`*`, `?`, `[abc]`, `[a-z]`, `[^a]`, `\\x`),
/// without case, as CONFIG GET uses it. Iterative, backtracking only to the
/// last `*`: O(pattern × name) whatever the pattern.
fn glob_match(pattern: &[u8], name: &[u8]) -> bool {
    let lower = |b: u8| b.to_ascii_lowercase();
    // Whether the element at the start of `p` (not a `*`) matches `c`, and
    // its length. Brackets follow Redis's `stringmatchlen` byte for byte:
    // `\x` inside compares with case, `a-z` takes any end (`]` too), an
    // unclosed bracket runs to the end of the pattern.
    let one = |p: &[u8], c: u8| -> (bool, usize) {
        match p {
            [b'?', ..] => (true, 1),
            [b'\\', x, ..] => (lower(*x) == lower(c), 2),
            [b'[', ..] => {
                let not = p.get(1) == Some(&b'^');
                let mut i = if not { 2 } else { 1 };
                let mut hit = false;
                loop {
                    if i >= p.len() {
                        // Unclosed: the last byte ends the element.
                        i = p.len() - 1;
                        break;
                    }
                    if p[i] == b'\\' && p.len() - i >= 2 {
                        i += 1;
                        hit |= p[i] == c;
                    } else if p[i] == b']' {
                        break;
                    } else if p.len() - i >= 3 && p[i + 1] == b'-' {
                        let (a, z) = (p[i].min(p[i + 2]), p[i].max(p[i + 2]));
                        hit |= (lower(a)..=lower(z)).contains(&lower(c));
                        i += 2;
                    } else {
                        hit |= lower(p[i]) == lower(c);
                    }
                    i += 1;
                }
                (hit != not, i + 1)
            }
            [x, ..] => (lower(*x) == lower(c), 1),
            [] => (false, 0),
        }
    };
    let (mut pi, mut ni) = (0, 0);
    // Where to resume after the last `*`: (pattern after it, name index).
    let mut star: Option<(usize, usize)> = None;
    while ni < name.len() {
        if pi < pattern.len() {
            if pattern[pi] == b'*' {
                star = Some((pi + 1, ni));
                pi += 1;
                continue;
            }
            let (hit, len) = one(&pattern[pi..], name[ni]);
            if hit {
                pi += len;
                ni += 1;
                continue;
            }
        }
        match star {
            Some((sp, sn)) => {
                star = Some((sp, sn + 1));
                pi = sp;
                ni = sn + 1;
            }
            None => return false,
        }
    }
    while pi < pattern.len() && pattern[pi] == b'*' {
        pi += 1;
    }
    pi == pattern.len()
}

/// Keys stored through RESP (DBSIZE, INFO's keyspace). Counting them walks
/// the indexes (O(chunks)), so it runs on the blocking pool.
pub(super) async fn resp_keys(shared: &Shared) -> Result<u64, Vec<u8>> {
    let store = Arc::clone(&shared.ctx.store);
    tokio::task::spawn_blocking(move || {
        store
            .namespaces()
            .iter()
            .filter(|n| super::keys::is_resp_engine(&n.record.engine))
            .map(|n| n.chunks)
            .sum()
    })
    .await
    .map_err(|e| format!("kvtier could not count the keys: {e}").into_bytes())
}

fn exists(shared: &Shared, s: &mut Session, args: &[Bytes], out: &mut Output) -> Res {
    let mut n = 0i64;
    for key in &args[1..] {
        if key.len() > MAX_KEY_LEN {
            continue;
        }
        let id = shared.keys.id(key);
        let Some(loc) = shared.ctx.locate(&id) else {
            continue;
        };
        n += 1;
        if loc == crate::Location::Ram {
            pin(shared, s, key, &id);
        }
    }
    out.integer(n);
    Ok(())
}

/// Keeps a RAM-resident key's bytes for a short while after a positive
/// EXISTS: LMCache's native client stalls on a miss after a hit, so a chunk
/// evicted between its EXISTS and GET is still served (unless it was
/// written or deleted through RESP since).
fn pin(shared: &Shared, s: &mut Session, key: &Bytes, id: &ChunkId) {
    let epoch = shared.epoch_slot(id).load(Ordering::Acquire);
    let deletions = shared.ctx.store.deletions_of(id);
    // RAM only: a chunk evicted since the EXISTS is not pinned (its GET
    // reads the disk on the blocking pool), and no disk read runs here.
    // Not counted as a read: EXISTS only asks (Redis counts no keyspace
    // hit for it either); the GET that takes the pin counts it.
    let Some(data) = shared.ctx.store.peek_ram(id, Some(key)) else {
        return;
    };
    s.drop_old_pins();
    s.pins.retain(|p| p.key != *key);
    if s.pins.len() >= PINS_MAX {
        s.pins.pop_front();
    }
    s.pins.push_back(Pin {
        key: key.clone(),
        epoch,
        deletions,
        at: Instant::now(),
        held: {
            shared
                .pinned_bytes
                .fetch_add(data.len() as u64, Ordering::Relaxed);
            Arc::clone(&shared.pinned_bytes)
        },
        data,
    });
}

fn take_pin(shared: &Shared, s: &mut Session, key: &[u8], id: &ChunkId) -> Option<Bytes> {
    let i = s.pins.iter().position(|p| p.key == key)?;
    let p = s.pins.remove(i)?;
    // Deleted by other means than RESP (`kvtier delete`, gc) since, which
    // bump no RESP epoch (QA: a GET served a key deleted so).
    let fresh = p.at.elapsed() < s.pin_ttl
        && shared.epoch_slot(id).load(Ordering::Acquire) == p.epoch
        && shared.ctx.store.deletions_of(id) == p.deletions;
    fresh.then(|| p.data.clone())
}

async fn get(shared: &Shared, s: &mut Session, key: &Bytes, out: &mut Output) -> Res {
    if key.len() > MAX_KEY_LEN {
        // Absent, as such a key always is: a miss (hits + misses = GETs).
        shared.ctx.store.count_miss();
        out.null();
        return Ok(());
    }
    let id = shared.keys.id(key);
    // A fresh pin first: nothing set or deleted the key since its EXISTS,
    // so the pinned bytes are its value (the store may have evicted them
    // since). Asked after a store miss, the one GET counted as a miss and
    // a hit.
    if !s.pins.is_empty() {
        if let Some(data) = take_pin(shared, s, key, &id) {
            shared.ctx.store.count_ram_hit(&id.ns, data.len() as u64);
            out.bulk_bytes(data);
            return Ok(());
        }
    }
    match shared.ctx.get(id, Some(key.clone())).await {
        Some(hit) => out.bulk_bytes(hit.data),
        None => out.null(),
    }
    Ok(())
}

async fn del(shared: &Shared, args: &[Bytes], out: &mut Output) -> Res {
    let ids: Vec<ChunkId> = args[1..]
        .iter()
        .filter(|key| key.len() <= MAX_KEY_LEN)
        .map(|key| shared.keys.id(key))
        .collect();
    for id in &ids {
        shared.bump(id);
    }
    // A delete hands its tombstone to the disk writer and waits for room
    // in its queue (on a hung disk, for good): never on a runtime worker.
    let store = Arc::clone(&shared.ctx.store);
    let (n, ids) = tokio::task::spawn_blocking(move || {
        let n = ids.iter().filter(|id| store.delete(id)).count();
        (n, ids)
    })
    .await
    .map_err(|e| format!("kvtier could not delete: {e}").into_bytes())?;
    for id in &ids {
        shared.bump(id);
    }
    out.integer(n as i64);
    Ok(())
}

async fn set(shared: &Shared, args: &[Bytes], out: &mut Output) -> Res {
    let (key, value) = (&args[1], &args[2]);
    let (mut nx, mut xx, mut get_old, mut keepttl) = (false, false, false, false);
    // An expiry option and its value: checked as Redis does (every option
    // first, then the value), then refused.
    let mut expire: Option<(Vec<u8>, &Bytes)> = None;
    let mut i = 3;
    while i < args.len() {
        let opt = args[i].to_ascii_uppercase();
        match opt.as_slice() {
            b"NX" if !xx => nx = true,
            b"XX" if !nx => xx = true,
            b"GET" => get_old = true,
            b"KEEPTTL" if expire.is_none() => keepttl = true,
            // The same one again replaces it, as in Redis 7.0.
            b"EX" | b"PX" | b"EXAT" | b"PXAT"
                if !keepttl
                    && expire.as_ref().is_none_or(|(o, _)| *o == opt)
                    && i + 1 < args.len() =>
            {
                i += 1;
                expire = Some((opt, &args[i]));
            }
            _ => return err(SYNTAX),
        }
        i += 1;
    }
    if let Some((opt, value)) = expire {
        return match super::parser::string_to_i64(value) {
            None => err(NOT_INTEGER),
            Some(n) if n <= 0 => err("invalid expire time in 'set' command"),
            Some(_) => {
                let o = String::from_utf8_lossy(&opt).into_owned();
                err(format!(
                    "SET option '{o}' is not supported by kvtier: keys do not expire (the cache evicts by size)"
                ))
            }
        };
    }
    if key.len() > MAX_KEY_LEN {
        return err(format!(
            "key of {} bytes is too long: kvtier accepts keys of at most {MAX_KEY_LEN} bytes",
            key.len()
        ));
    }
    let ctx = &shared.ctx;
    let id = match shared.keys.registered_id(key) {
        Some(id) => id,
        None => {
            // The first write to a namespace may write the store's manifest.
            let (c, k, keys) = (Arc::clone(ctx), key.clone(), Arc::clone(&shared.keys));
            tokio::task::spawn_blocking(move || keys.register(&c, &k))
                .await
                .map_err(|e| format!("kvtier could not store the value: {e}").into_bytes())?
                .map_err(|e| format!("kvtier could not store the value: {e}").into_bytes())?
        }
    };
    let old = if get_old || nx || xx {
        if get_old {
            ctx.get(id, Some(key.clone())).await.map(|h| h.data)
        } else {
            ctx.locate(&id).map(|_| Bytes::new())
        }
    } else {
        None
    };
    let blocked = (nx && old.is_some()) || (xx && old.is_none());
    if !blocked {
        shared.bump(&id);
        let store = Arc::clone(&ctx.store);
        let (k, v) = (key.clone(), value.clone());
        let res = crate::context::insert_off_runtime(&ctx.store, "put task", move || {
            store.put_named(id, k, v)
        })
        .await;
        res.map_err(|e| format!("kvtier could not store the value: {e}").into_bytes())?;
        shared.bump(&id);
    }
    if get_old {
        match old {
            Some(d) => out.bulk_bytes(d),
            None => out.null(),
        }
    } else if blocked {
        out.null();
    } else {
        out.ok();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn glob_match_is_redis_s_pattern_match() {
        for (p, name, want) in [
            ("*", "maxmemory", true),
            ("max*", "maxmemory", true),
            ("max*", "maxmemory-policy", true),
            ("MAXMEMORY", "maxmemory", true),
            ("*policy", "maxmemory-policy", true),
            ("*memory", "maxmemory-policy", false),
            ("max?emory", "maxmemory", true),
            ("max?emory", "maxemory", false),
            ("[ms]ave", "save", true),
            ("[^s]ave", "save", false),
            ("[a-t]ave", "save", true),
            ("[t-z]ave", "save", false),
            ("sav\\e", "save", true),
            ("*a*a*a*a*a*a*a*a*a*a*b", "aaaaaaaaaaaaaaaaaaaa", false),
            ("", "save", false),
            ("save*", "save", true),
            ("save?", "save", false),
            // Redis's bracket edges: a range may end at `]`, an escape
            // inside compares with case, an unclosed bracket ends the pattern.
            // (`s-]` is the range: the bracket then runs to the end.)
            ("[s-]ave", "save", false),
            ("[s-]]ave", "save", true),
            ("[\\S]ave", "save", false),
            ("[\\s]ave", "save", true),
            ("sav[e", "save", true),
            ("sav[^", "save", true),
            ("[^a-r]ave", "save", true),
        ] {
            assert_eq!(
                glob_match(p.as_bytes(), name.as_bytes()),
                want,
                "{p} ~ {name}"
            );
        }
    }

    fn b(v: &[&str]) -> Vec<Bytes> {
        v.iter()
            .map(|s| Bytes::copy_from_slice(s.as_bytes()))
            .collect()
    }

    #[test]
    fn unknown_command_text_matches_redis() {
        assert_eq!(
            String::from_utf8(unknown_command(&b(&["FOO", "a", "b"]))).unwrap(),
            "unknown command 'FOO', with args beginning with: 'a' 'b' "
        );
        assert_eq!(
            String::from_utf8(unknown_command(&b(&["foo"]))).unwrap(),
            "unknown command 'foo', with args beginning with: "
        );
        let long = "x".repeat(200);
        let m = String::from_utf8(unknown_command(&b(&["f", &long, "next"]))).unwrap();
        assert_eq!(
            m,
            format!(
                "unknown command 'f', with args beginning with: '{}' ",
                "x".repeat(128)
            )
        );
    }

    #[test]
    fn arity_rules() {
        assert!(arity_ok(2, 2));
        assert!(!arity_ok(2, 3));
        assert!(arity_ok(-2, 5));
        assert!(!arity_ok(-2, 1));
    }
}
