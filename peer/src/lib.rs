//! kvtier-peer: the peer protocol between kvtier nodes (QUIC + mutual TLS).
//!
//! Owns: certificates ([`cert`]), TLS configuration ([`tls`]), the sans-IO
//! protocol ([`proto`]: framing, messages, availability sync, membership),
//! the remote availability index ([`directory`]) and the quinn driver
//! ([`transport`]: endpoint, connections, keepalives, reconnects, fetch).
//!
//! Does not own: disks or the chunk store. The node supplies a
//! [`ChunkSource`] to serve fetches and reports local availability changes
//! through [`PeerHandle::local_added`] / [`PeerHandle::local_removed`]; ids
//! here are this crate's own newtypes ([`PeerChunkId`]), converted in `node`.
//! Wire format: `peer/PROTOCOL.md`.

pub mod cert;
pub mod directory;
pub mod id;
mod logonce;
pub mod proto;
pub mod tls;
pub mod transport;

pub use id::{ChunkBytes, PeerChunkId, PeerNamespace};
pub use proto::PeerState;
pub use transport::{
    ChunkSource, FetchBuffer, FetchError, MAX_FETCH_CONNECTIONS, MAX_PEER_DURATION, PeerConfig,
    PeerHandle, PeerRef, PeerStatus, SourceFuture, TransportTuning,
};

/// Errors of this crate (setup, certificates, TLS, binding).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A file could not be read or written.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// Cause.
        source: std::io::Error,
    },
    /// A certificate or key is malformed, or does not fit this cluster.
    #[error("{what}: {detail}")]
    Cert {
        /// What was being processed.
        what: String,
        /// Why it failed.
        detail: String,
    },
    /// TLS configuration failed.
    #[error("tls: {0}")]
    Tls(String),
    /// Invalid configuration.
    #[error("invalid peer configuration: {0}")]
    Config(String),
    /// The QUIC endpoint could not be set up.
    #[error("peer transport: {0}")]
    Transport(String),
}
