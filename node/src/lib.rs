//! kvtier-node: the kvtier daemon.
//!
//! Owns: configuration, wiring of the tier store and the peer protocol,
//! the native Unix-socket protocol, the RESP2 endpoint and HTTP metrics.

pub use peer;
pub use tier;
