//! [`NodeContext`]: the state every local interface (native socket, RESP,
//! HTTP) shares, and the read cascade they all go through.
//!
//! Interfaces never call the store directly for reads: they call
//! [`NodeContext::get`] / [`NodeContext::lookup`] so that the peer cascade
//! (RAM → local disk → peers) serves every interface alike.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use tier::{ChunkId, ChunkKey, ChunkStore, GroupId, Hit, Namespace, NamespaceRecord, Tier};

/// Where a chunk was found by a lookup, as seen from this node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Location {
    /// In this node's RAM.
    Ram,
    /// On this node's disk.
    Disk,
    /// On a peer (RAM or disk).
    Peer,
}

impl From<Tier> for Location {
    fn from(t: Tier) -> Self {
        match t {
            Tier::Ram => Location::Ram,
            Tier::Disk => Location::Disk,
        }
    }
}

/// Per-rank result of a cluster lookup.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct RankPrefix {
    /// The rank.
    pub rank: u32,
    /// Longest prefix present anywhere in the cluster.
    pub prefix: usize,
    /// Longest prefix present in RAM on the rank's own node (size gate).
    pub ram_prefix: usize,
}

/// Counters kept by the node itself (the store keeps its own).
#[derive(Debug, Default)]
pub struct NodeCounters {
    /// Native-protocol requests served.
    pub native_requests: AtomicU64,
    /// Native-protocol requests answered with an error.
    pub native_errors: AtomicU64,
    /// RESP commands served.
    pub resp_commands: AtomicU64,
    /// RESP commands answered with an error.
    pub resp_errors: AtomicU64,
    /// Client connections accepted (all interfaces).
    pub connections: AtomicU64,
}

impl NodeCounters {
    /// Adds one to a counter.
    pub fn inc(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }
}

/// State shared by all local interfaces of a running node.
pub struct NodeContext {
    /// The local chunk store.
    pub store: Arc<ChunkStore>,
    /// This node's name (from its certificate when peers are configured).
    pub node_name: String,
    /// When the node started.
    pub started: Instant,
    /// Node-level counters.
    pub counters: NodeCounters,
}

impl NodeContext {
    /// A context over a store, without peers.
    pub fn new(store: Arc<ChunkStore>, node_name: String) -> Self {
        Self {
            store,
            node_name,
            started: Instant::now(),
            counters: NodeCounters::default(),
        }
    }

    /// Registers a namespace record with the store.
    pub fn register_namespace(&self, record: &NamespaceRecord) -> tier::Result<Namespace> {
        self.store.register_namespace(record)
    }

    /// Reads a chunk through the cascade: RAM → local disk → peers.
    /// `name`, when given, must equal the stored name (RESP keys).
    /// Any failure is a miss.
    pub async fn get(&self, id: ChunkId, name: Option<bytes::Bytes>) -> Option<Hit> {
        // RAM hits are answered inline; anything else may touch the disk and
        // runs on the blocking pool, never on a runtime worker.
        if self.store.locate(&id) == Some(Tier::Ram) {
            if let Some(hit) = self.get_local(&id, name.as_deref()) {
                return Some(hit);
            }
        }
        let store = Arc::clone(&self.store);
        tokio::task::spawn_blocking(move || match name {
            Some(n) => store.get_named(&id, &n),
            None => store.get(&id),
        })
        .await
        .ok()
        .flatten()
    }

    fn get_local(&self, id: &ChunkId, name: Option<&[u8]>) -> Option<Hit> {
        match name {
            Some(n) => self.store.get_named(id, n),
            None => self.store.get(id),
        }
    }

    /// Where a chunk is, from in-RAM indexes only (no disk, no network).
    pub fn locate(&self, id: &ChunkId) -> Option<Location> {
        self.store.locate(id).map(Location::from)
    }

    /// For an ordered key list in one namespace: per-key location and the
    /// longest present prefix. No disk, no network.
    pub fn lookup(
        &self,
        ns: Namespace,
        group: GroupId,
        keys: &[ChunkKey],
    ) -> (usize, Vec<Option<Location>>) {
        let mut tiers = Vec::with_capacity(keys.len());
        let prefix = self.store.lookup_prefix(ns, group, keys, &mut tiers);
        (prefix, tiers.into_iter().map(|t| t.map(Location::from)).collect())
    }

    /// Cluster lookup for the scheduler: for each rank of the family of
    /// `record` (its own rank field is ignored), the longest prefix present
    /// anywhere in the cluster and the RAM-resident prefix on the rank's node.
    /// Without peers, only this node's store is consulted.
    pub fn cluster_lookup(
        &self,
        record: &NamespaceRecord,
        ranks: &[u32],
        group: GroupId,
        keys: &[ChunkKey],
    ) -> (usize, Vec<RankPrefix>) {
        let mut out = Vec::with_capacity(ranks.len());
        let mut tiers = Vec::with_capacity(keys.len());
        for &rank in ranks {
            let ns = record.with_rank(rank).id();
            let prefix = self.store.lookup_prefix(ns, group, keys, &mut tiers);
            let ram_prefix = tiers
                .iter()
                .take_while(|t| **t == Some(Tier::Ram))
                .count();
            out.push(RankPrefix {
                rank,
                prefix,
                ram_prefix,
            });
        }
        let min = out.iter().map(|r| r.prefix).min().unwrap_or(0);
        (min, out)
    }
}
