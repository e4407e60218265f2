//! The crate's error type.
//!
//! Corruption, I/O failure and lack of space are kept apart (STYLE.md rule 7):
//! the node must tell "refetch from a peer" from "the disk is failing".

use std::io;
use std::path::PathBuf;

/// Errors returned by the tier crate.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An operating-system I/O error.
    #[error("I/O error while trying to {op} {path}: {source}")]
    Io {
        /// What was being done ("read region 3 of", "open").
        op: &'static str,
        /// The file involved.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// Bytes on disk failed a check (magic, version, CRC, identity, length).
    #[error("corrupt data in {what}: {detail}")]
    Corrupt {
        /// Which structure ("chunk header", "region 7 summary").
        what: String,
        /// What check failed, with the numbers.
        detail: String,
    },
    /// `namespaces.json` does not parse, or a record in it does not hash to
    /// the id it is listed under. The chunks are not affected (they carry
    /// their namespace id); only the records are. Never replaced silently:
    /// [`crate::manifest::salvage`] sets the file aside.
    #[error(
        "corrupt namespace manifest {path}: {detail}; the chunks are not affected: \
         `kvtier verify --repair` sets the file aside and keeps the records it can still read \
         (a client registers its namespace again at HELLO)"
    )]
    ManifestCorrupt {
        /// The manifest file.
        path: PathBuf,
        /// What failed to parse or check.
        detail: String,
    },
    /// The store (or a chunk, or the namespace manifest) was written by an
    /// incompatible format version.
    #[error("{what} version {found} is not supported by this build (supports {supported}); {hint}")]
    IncompatibleVersion {
        /// Whose version: "store format", "chunk format", "namespace manifest".
        what: &'static str,
        /// The version found on disk.
        found: u32,
        /// The version(s) this build reads.
        supported: String,
        /// What to do about it.
        hint: &'static str,
    },
    /// The disk budget or the device is full; the writer pauses.
    #[error("no space: {detail}")]
    NoSpace {
        /// Budget / free bytes involved.
        detail: String,
    },
    /// A chunk is larger than the RAM budget or the region size.
    #[error("chunk of {len} bytes is too large: {limit_name} is {limit} bytes")]
    TooLarge {
        /// The chunk's size.
        len: u64,
        /// Which limit.
        limit_name: &'static str,
        /// The limit.
        limit: u64,
    },
    /// A previous write or fsync failed; the store refuses further disk I/O
    /// until it is reopened (never retry on an unknown disk state).
    #[error("the store is poisoned by a previous I/O error ({0}); reopen it")]
    Poisoned(String),
    /// The namespace was never registered with this store.
    #[error("unknown namespace {0}")]
    UnknownNamespace(crate::Namespace),
    /// A namespace record too large to keep.
    #[error(
        "namespace record of {len} bytes as stored (JSON with every field written out, defaults \
         included) is over the limit of {max} bytes (16 KiB)"
    )]
    RecordTooLarge {
        /// Its length as stored.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// A caller passed a bad value.
    #[error("invalid {what}: {value:?}")]
    InvalidArgument {
        /// What was invalid.
        what: &'static str,
        /// The value (truncated).
        value: String,
    },
    /// The configuration contradicts itself.
    #[error("invalid tier config: {0}")]
    Config(String),
    /// The store is shutting down.
    #[error("the store is closed")]
    Closed,
    /// A flush did not finish before its deadline (a close's flush: what
    /// it had not written is lost when the process exits).
    #[error("{0}")]
    Deadline(String),
    /// The store was opened read-only ([`crate::TierConfig::read_only`]).
    #[error("the store was opened read-only: {0} needs a writable open")]
    ReadOnly(&'static str),
    /// A capability that is not implemented yet (visible, never faked).
    #[error("not implemented yet: {0}")]
    Unimplemented(&'static str),
}

/// Shorthand result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
