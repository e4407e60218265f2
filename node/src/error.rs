//! The node crate's error type.

use std::io;
use std::path::PathBuf;

/// Errors returned by the node daemon and its configuration.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NodeError {
    /// A configuration value is invalid, unknown or contradicts another.
    /// The message names the key and where it came from.
    #[error("{0}")]
    Config(String),
    /// An operating-system I/O error.
    #[error("could not {op} {path}: {source}")]
    Io {
        /// What was being done ("create data dir", "lock").
        op: &'static str,
        /// The path involved.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// Binding a listener failed.
    #[error("could not listen on {what} {addr}: {source}")]
    Bind {
        /// Which listener ("RESP", "HTTP", "native socket").
        what: &'static str,
        /// The address or path.
        addr: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// Another process (a running daemon, or `kvtier verify`/`gc`) holds the
    /// data directory's lock.
    #[error("data dir {data_dir} is in use by {holder}")]
    Locked {
        /// The data directory.
        data_dir: PathBuf,
        /// Who holds it, as recorded in the lock file ("kvtier daemon pid 123").
        holder: String,
    },
    /// The chunk store failed.
    #[error("chunk store: {0}")]
    Store(#[from] tier::Error),
    /// A server task failed.
    #[error("{what} server failed: {detail}")]
    Serve {
        /// Which server.
        what: &'static str,
        /// What happened.
        detail: String,
    },
    /// Setting up logging failed.
    #[error("could not set up logging: {0}")]
    Logging(String),
    /// A part of the node that is not built yet (visible, never faked).
    #[error("not implemented yet: {0}")]
    Unimplemented(&'static str),
}

/// Shorthand result type.
pub type Result<T, E = NodeError> = std::result::Result<T, E>;
