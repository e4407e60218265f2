//! kvtier-tier: the local chunk store of a kvtier node.
//!
//! Owns: identifiers ([`Namespace`], [`ChunkKey`], [`ChunkId`]), the on-disk
//! chunk format, the byte-budgeted RAM LRU, the NVMe segment store, recovery,
//! the write policy (RAM first, disk on eviction / idle / flush) and the
//! maintenance operations (verify, gc, stats).
//!
//! Does not own: networking of any kind, configuration files, processes.
//! The node crate wires this store to its protocols and peers.
//!
//! The entry point is [`ChunkStore`]: open it with a [`TierConfig`], then
//! `put` / `get` / `lookup_prefix` / `flush` from any thread. Calls are
//! synchronous and may block on disk reads; async callers use
//! `spawn_blocking` (a `get` that hits RAM never touches the disk).

mod aio;
pub mod buffers;
pub mod config;
pub mod deletes;
pub mod device;
mod error;
pub mod format;
mod fptable;
pub mod index;
pub mod layout;
pub mod maintenance;
pub mod manifest;
mod pack;
pub mod ram;
mod segment;
pub mod store;
#[cfg(feature = "test_utils")]
pub mod testdev;
pub mod types;
mod writer;

pub use error::{Error, Result};
pub use store::{
    ChunkObserver, ChunkStore, FlushReport, GcOptions, GcReport, Hit, NamespaceInfo,
    NamespaceListing, StoreStats, TierConfig, VerifyOptions, VerifyReport, WritePolicy,
};
pub use types::{ChunkId, ChunkKey, GroupId, Namespace, NamespaceFamily, NamespaceRecord, Tier};
