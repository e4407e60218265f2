//! kvtier-node: the kvtier daemon.
//!
//! Owns: configuration ([`config`], figment: defaults < TOML file <
//! `KVTIER_*` environment < flags), the daemon's wiring and lifecycle
//! ([`daemon`]: data-dir lock, store open and recovery, listeners, graceful
//! shutdown), wiring of the tier store and the peer protocol, the native
//! Unix-socket protocol, the RESP2 endpoint and HTTP metrics. Every
//! interface reads through [`context::NodeContext`], so the peer cascade
//! serves them all.
//!
//! Does not own: command-line parsing (the `kvtier` binary), the chunk
//! store's internals (`tier`), the peer protocol (`peer`).

pub mod cluster;
pub mod config;
pub mod context;
pub mod daemon;
pub mod error;
pub mod http;
pub mod logging;
pub mod memory;
pub mod native;
pub mod notify;
pub mod resp;
pub mod size;

pub use config::{Listen, NodeConfig};
pub use context::{Location, NodeContext, RankPrefix};
pub use daemon::{NodeHandle, RunSummary, run, start};
pub use error::NodeError;
pub use peer;
pub use size::{ByteSize, HumanDuration};
pub use tier;
