//! The native protocol: length-prefixed, CRC-checked binary frames on a Unix
//! stream socket, with a shared-memory data plane (the client hands the
//! daemon a sealed memfd and names (offset, length) ranges in it).
//!
//! The wire format is specified in `node/PROTOCOL.md`. Parts:
//! - [`codec`]: sans-IO frame and body encoding/decoding (fuzzed, golden-tested);
//! - [`region`]: memfd mapping and descriptor passing;
//! - [`server`]: [`serve`] drives connections over a [`tokio::net::UnixListener`];
//! - [`client`]: a blocking [`Client`] for the CLI, tests and benches.
//!
//! Call order for the daemon: [`bind`] (inside a tokio runtime), then
//! [`serve`] with the shared [`crate::NodeContext`] and a shutdown future;
//! `serve` returns once every connection task has finished.

pub mod client;
pub mod codec;
pub mod region;
pub mod server;
pub mod spin;

use std::io;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::net::UnixListener;

pub use client::{Client, ClusterLookupResult, LookupResult};
pub use codec::{
    CodecError, ErrorCode, FlushReply, GetResult, GetStatus, LookupLocation, RegionEntry,
};
pub use region::{OwnedRegion, RegionError};
pub use server::serve;

/// Default socket permissions: owner and group may connect.
pub const DEFAULT_SOCKET_MODE: u32 = 0o660;

/// Default [`NativeOptions::spin`] and [`Client::set_spin`]: 50 µs, and
/// only while the system has a CPU to spare ([`spin`]). Polling saves a
/// thread wake-up per request where CPUs are idle (a LOOKUP round trip of
/// 1,024 keys: 84 → 30 µs on the idle 2-core build machine); on a loaded
/// machine it took cores from the work and doubled the round trip, which
/// the gate prevents. See `docs/benchmarks.md`, session 21.
pub const DEFAULT_SPIN: Duration = Duration::from_micros(50);

/// Limits and timeouts of the native server.
#[derive(Clone, Debug)]
pub struct NativeOptions {
    /// Largest request body accepted, in bytes. Default: 16 MiB (a LOOKUP of
    /// 65,536 keys is 2 MiB).
    pub max_frame: u32,
    /// Largest shared-memory region a client may register. Default: 64 GiB
    /// (address space only; the client owns the memory).
    pub max_region: u64,
    /// Most keys / entries / ranks in one request. Default: 65,536.
    pub max_batch: u32,
    /// Most concurrent connections; more get a `busy` error and are closed.
    /// Default: 1,024.
    pub max_connections: u32,
    /// Time allowed to receive the rest of a frame once its first byte has
    /// arrived, and to write a reply; a slower client is dropped. Default: 30 s.
    pub frame_timeout: Duration,
    /// Most bytes the read buffers of all connections together hold past
    /// their first 64 KiB each (large or incomplete requests, requests read
    /// ahead): a connection whose next request would go past it gets `busy`
    /// and is closed. Default: 512 MiB.
    pub max_buffered: usize,
    /// How long a connection keeps polling its socket for the next request
    /// after answering, before its task parks (0 parks at once). Can save a
    /// worker wake-up per request for clients that send requests back to
    /// back, at the price of up to this much CPU per request. Only while the
    /// system has a CPU to spare ([`spin::may_poll`]). Default: 50 µs
    /// ([`DEFAULT_SPIN`]); zero: the server never polls (clients follow
    /// [`spin::CLIENT_SPIN_ENV`]).
    pub spin: Duration,
}

impl Default for NativeOptions {
    fn default() -> Self {
        Self {
            max_frame: 16 << 20,
            max_region: 64 << 30,
            max_batch: 65_536,
            max_connections: 1_024,
            frame_timeout: Duration::from_secs(30),
            max_buffered: 512 << 20,
            spin: DEFAULT_SPIN,
        }
    }
}

/// Errors of the native server and client.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NativeError {
    /// An operating-system I/O error.
    #[error("native socket: cannot {op}: {source}")]
    Io {
        /// What failed ("bind /run/kvtier/kvtier.sock", "read reply").
        op: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// Another process is listening on the socket path.
    #[error("another process is already listening on {0}")]
    AddrInUse(PathBuf),
    /// The socket path exists and is not a socket.
    #[error("{0} exists and is not a Unix socket; refusing to remove it")]
    NotASocket(PathBuf),
    /// The daemon is not reachable.
    #[error(
        "cannot connect to the kvtier daemon at {path}: {source} ({})",
        unavailable_hint(path, source, std::path::Path::new(SYSTEM_SOCKET))
    )]
    Unavailable {
        /// Socket path.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// A frame could not be decoded.
    #[error(transparent)]
    Codec(#[from] CodecError),
    /// A region could not be created or used.
    #[error(transparent)]
    Region(#[from] RegionError),
    /// The daemon answered with an error.
    #[error("daemon error ({}): {message}", code.name())]
    Remote {
        /// The code.
        code: ErrorCode,
        /// The daemon's message.
        message: String,
    },
    /// The reply does not answer the request.
    #[error("protocol violation: {0}")]
    Protocol(String),
    /// The daemon closed the connection.
    #[error("the daemon closed the connection")]
    Closed,
    /// The operation timed out.
    #[error(
        "the daemon did not answer in time ({op}); is it stopped or overloaded? (a request it \
         already received may still take effect)"
    )]
    Timeout {
        /// What was being done.
        op: &'static str,
    },
    /// A local request that cannot be sent (no region, too big for it).
    #[error("invalid request: {0}")]
    Invalid(String),
    /// An earlier call on this connection failed part-way (a timeout, an
    /// I/O error, a reply out of step), so its reply may still be on the
    /// way and the daemon may still be copying into the region: the
    /// connection takes no more calls.
    #[error(
        "this connection is out of step with the daemon after an earlier failure ({0}); \
         connect again"
    )]
    Broken(String),
}

/// The socket of the daemon the systemd unit starts (`RuntimeDirectory=kvtier`),
/// and root's default (`Environment::default_socket`).
pub const SYSTEM_SOCKET: &str = "/run/kvtier/kvtier.sock";

/// What to check when connecting to `path` failed with `e`; `system` is
/// the systemd unit's socket, named when it exists and is not `path` (QA:
/// a user other than root looked for a daemon of its own, and nothing said
/// where the system's listens). Not used in its place: a command meant for
/// a user's own stopped daemon must not reach another one.
fn unavailable_hint(path: &std::path::Path, e: &io::Error, system: &std::path::Path) -> String {
    use std::os::unix::fs::FileTypeExt as _;
    if std::fs::metadata(path).is_ok_and(|m| !m.file_type().is_socket()) {
        return "that path is not a socket: check --socket or `socket` in the config".into();
    }
    match e.kind() {
        io::ErrorKind::PermissionDenied => "this user may not use the socket: run as the daemon's \
                                            user or a member of its group (see socket-mode)"
            .into(),
        // A path the kernel cannot take (over 107 bytes): no daemon could
        // listen there either.
        io::ErrorKind::InvalidInput => "use a shorter socket path".into(),
        _ if path != system && system.symlink_metadata().is_ok() => format!(
            "is `kvtier node start` running? A daemon listens on {} (the systemd unit's): pass \
             --socket {} or --config /etc/kvtier/kvtier.toml",
            system.display(),
            system.display()
        ),
        _ => "is `kvtier node start` running? A daemon started with another configuration is \
              reached with --socket or --config"
            .into(),
    }
}

impl NativeError {
    fn io(op: impl Into<String>, source: io::Error) -> Self {
        NativeError::Io {
            op: op.into(),
            source,
        }
    }
}

/// Fails as [`bind`] would when `path` is not a socket or a live server
/// answers on it, without changing anything: the daemon asks before it
/// opens the store and starts its peer layer (a start that failed only at
/// the bind was seen up by peers for a moment).
pub fn check_available(path: &Path) -> Result<(), NativeError> {
    match std::fs::symlink_metadata(path) {
        Ok(md) if !md.file_type().is_socket() => Err(NativeError::NotASocket(path.to_owned())),
        Ok(_) if std::os::unix::net::UnixStream::connect(path).is_ok() => {
            Err(NativeError::AddrInUse(path.to_owned()))
        }
        _ => Ok(()),
    }
}

/// Binds the native socket at `path` with permissions `mode` (e.g.
/// [`DEFAULT_SOCKET_MODE`]). Creates the parent directory if missing. A
/// stale socket file is removed only if nothing listens on it; a live one
/// or a non-socket file is an error. Must be called inside a tokio runtime.
pub fn bind(path: &Path, mode: u32) -> Result<UnixListener, NativeError> {
    match std::fs::symlink_metadata(path) {
        Ok(md) => {
            if !md.file_type().is_socket() {
                return Err(NativeError::NotASocket(path.to_owned()));
            }
            match std::os::unix::net::UnixStream::connect(path) {
                Ok(_) => return Err(NativeError::AddrInUse(path.to_owned())),
                Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                    std::fs::remove_file(path).map_err(|e| {
                        NativeError::io(format!("remove stale socket {}", path.display()), e)
                    })?;
                }
                Err(e) => {
                    return Err(NativeError::io(
                        format!("probe existing socket {}", path.display()),
                        e,
                    ));
                }
            }
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(NativeError::io(format!("stat {}", path.display()), e)),
    }
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)
            .map_err(|e| NativeError::io(format!("create directory {}", parent.display()), e))?;
    }
    let listener = std::os::unix::net::UnixListener::bind(path)
        .map_err(|e| NativeError::io(format!("bind {}", path.display()), e))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(|e| NativeError::io(format!("set permissions on {}", path.display()), e))?;
    listener
        .set_nonblocking(true)
        .map_err(|e| NativeError::io("set the listener non-blocking", e))?;
    UnixListener::from_std(listener)
        .map_err(|e| NativeError::io("register the listener with tokio", e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unreachable_socket_says_what_to_check() {
        let e = |kind| NativeError::Unavailable {
            path: "/run/kvtier/kvtier.sock".into(),
            source: io::Error::from(kind),
        };
        let denied = e(io::ErrorKind::PermissionDenied).to_string();
        assert!(
            denied.contains("socket-mode") && !denied.contains("running?"),
            "{denied}"
        );
        let long = e(io::ErrorKind::InvalidInput).to_string();
        assert!(
            long.contains("shorter") && !long.contains("running?"),
            "{long}"
        );
        let missing = e(io::ErrorKind::NotFound).to_string();
        assert!(
            missing.contains("is `kvtier node start` running?"),
            "{missing}"
        );
        // A regular file or a directory at the path (QA: it said "is
        // kvtier node start running?").
        let dir = tempfile::tempdir().expect("temp dir");
        let file = dir.path().join("file");
        std::fs::write(&file, b"x").expect("write");
        for path in [file, dir.path().to_path_buf()] {
            let said = NativeError::Unavailable {
                path: path.clone(),
                source: io::Error::from(io::ErrorKind::ConnectionRefused),
            }
            .to_string();
            assert!(said.contains("not a socket"), "{said}");
        }
        // A user's own default socket missing while the system daemon's
        // exists: the hint names it (the command does not go there).
        let own = dir.path().join("own.sock");
        let system = dir.path().join("system.sock");
        let refused = io::Error::from(io::ErrorKind::NotFound);
        assert!(!unavailable_hint(&own, &refused, &system).contains("pass --socket"));
        std::fs::write(&system, b"").expect("stand-in");
        let said = unavailable_hint(&own, &refused, &system);
        assert!(
            said.contains(&format!("pass --socket {}", system.display())),
            "{said}"
        );
        // Not when it is the path that failed.
        assert!(!unavailable_hint(&system, &refused, &system).contains("pass --socket"));
    }
}
