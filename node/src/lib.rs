//! kvtier-node: the kvtier daemon.
//!
//! Owns: configuration, wiring of the tier store and the peer protocol,
//! the native Unix-socket protocol, the RESP2 endpoint and HTTP metrics.
//! Every interface reads through [`context::NodeContext`], so the peer
//! cascade serves them all.

pub mod context;
pub mod http;
pub mod resp;

pub use context::{Location, NodeContext, RankPrefix};
pub use peer;
pub use tier;
