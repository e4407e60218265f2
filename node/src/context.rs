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
    /// Native GETs dropped because their client hung up while their disk
    /// or peer reads waited.
    pub native_abandoned: AtomicU64,
    /// RESP commands served.
    pub resp_commands: AtomicU64,
    /// RESP commands answered with an error.
    pub resp_errors: AtomicU64,
    /// Client connections accepted (all interfaces).
    pub connections: AtomicU64,
    /// Of those, RESP connections (RESP INFO's `total_connections_received`).
    pub resp_connections: AtomicU64,
}

impl NodeCounters {
    /// Adds one to a counter.
    pub fn inc(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }
}

/// Runs a store insert `f` (a put, an admission) where it may wait: under
/// `write-policy = backpressure` an insert's evictions wait for room in the
/// disk writer's queue, so it runs on the blocking pool, never on a runtime
/// worker; otherwise inline (it never waits). `what` names it in the error
/// of a task that failed.
pub(crate) async fn insert_off_runtime<T: Send + 'static>(
    store: &ChunkStore,
    what: &'static str,
    f: impl FnOnce() -> tier::Result<T> + Send + 'static,
) -> tier::Result<T> {
    if store.config().write_policy != tier::WritePolicy::Backpressure {
        return f();
    }
    tokio::task::spawn_blocking(f).await.unwrap_or_else(|e| {
        Err(tier::Error::InvalidArgument {
            what,
            value: e.to_string(),
        })
    })
}

/// Counts a GET miss in the store when dropped, unless disarmed: a GET
/// that goes on to the peers counts its local miss only once they missed
/// too, or once it was dropped while waiting for them.
struct CountMissOnDrop<'a>(Option<&'a ChunkStore>);

impl CountMissOnDrop<'_> {
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for CountMissOnDrop<'_> {
    fn drop(&mut self) {
        if let Some(store) = self.0 {
            store.count_miss();
        }
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
    /// The peer cascade, when `peer-listen` is set.
    pub cluster: Option<Arc<crate::cluster::Cluster>>,
}

impl NodeContext {
    /// A context over a store, without peers.
    pub fn new(store: Arc<ChunkStore>, node_name: String) -> Self {
        Self {
            store,
            node_name,
            started: Instant::now(),
            counters: NodeCounters::default(),
            cluster: None,
        }
    }

    /// Adds the peer cascade: local misses then go to peers.
    pub fn with_cluster(mut self, cluster: Arc<crate::cluster::Cluster>) -> Self {
        self.cluster = Some(cluster);
        self
    }

    /// Every peer's status (for STATS, `/status` and `kvtier peers`); an
    /// empty list without peers.
    pub fn peers_json(&self) -> serde_json::Value {
        match &self.cluster {
            None => serde_json::Value::Array(Vec::new()),
            Some(c) => serde_json::to_value(c.peers()).unwrap_or(serde_json::Value::Null),
        }
    }

    /// Replies from peers that failed verification (0 without peers).
    pub fn peer_corrupt_replies(&self) -> u64 {
        self.cluster
            .as_ref()
            .map_or(0, |c| c.handle().corrupt_replies())
    }

    /// Bytes served to nodes not among our peers (`{name: bytes}`; empty
    /// without peers): their seed lists name us, ours does not name them.
    pub fn served_unlisted_json(&self) -> serde_json::Value {
        let mut m = serde_json::Map::new();
        if let Some(c) = &self.cluster {
            for (name, bytes) in c.handle().served_unlisted(true) {
                m.insert(name, bytes.into());
            }
        }
        serde_json::Value::Object(m)
    }

    /// Registers a namespace record with the store.
    ///
    /// A namespace new to this node is announced to the peers (their
    /// cluster lookups map its chunks to a rank by its record).
    pub fn register_namespace(&self, record: &NamespaceRecord) -> tier::Result<Namespace> {
        let known = self.store.namespace_record(&record.id()).is_some();
        let ns = self.store.register_namespace(record)?;
        if !known {
            if let Some(c) = &self.cluster {
                c.handle().namespaces_changed();
            }
        }
        Ok(ns)
    }

    /// Reads a chunk through the cascade: RAM → local disk → peers.
    /// `name`, when given, must equal the stored name (RESP keys).
    /// Any failure is a miss. A chunk fetched from a peer is reported as a
    /// RAM hit (admitted to RAM by default, RESP values excepted); use
    /// [`NodeContext::get_with_location`] to tell.
    pub async fn get(&self, id: ChunkId, name: Option<bytes::Bytes>) -> Option<Hit> {
        let (data, loc) = self.get_with_location(id, name).await?;
        let tier = match loc {
            Location::Disk => Tier::Disk,
            Location::Ram | Location::Peer => Tier::Ram,
        };
        Some(Hit { data, tier })
    }

    /// [`NodeContext::get`], returning where the bytes came from.
    pub async fn get_with_location(
        &self,
        id: ChunkId,
        name: Option<bytes::Bytes>,
    ) -> Option<(bytes::Bytes, Location)> {
        self.get_with_location_held(id, name, ()).await
    }

    /// [`NodeContext::get_with_location`], holding `held` (a bound's
    /// permits) for as long as the local disk read runs: it goes with the
    /// read onto the blocking pool, so a GET dropped meanwhile (its client
    /// hung up) does not give it back before the read ends (review). It is
    /// dropped before any peer fetch (the peer layer bounds those).
    pub async fn get_with_location_held<G: Send + 'static>(
        &self,
        id: ChunkId,
        name: Option<bytes::Bytes>,
        held: G,
    ) -> Option<(bytes::Bytes, Location)> {
        // RAM hits are answered inline; anything else may touch the disk and
        // runs on the blocking pool, never on a runtime worker.
        if let Some(hit) = self.get_ram(&id, name.as_deref()) {
            return Some(hit);
        }
        let store = Arc::clone(&self.store);
        let local_name = name.clone();
        // A local miss is counted below, once the peers missed too: a GET
        // a peer served is a hit (`hits_peer`), not a miss (QA: a node
        // restoring from its peers showed a hit ratio of 0).
        let local = tokio::task::spawn_blocking(move || {
            let hit = store.get_local(&id, local_name.as_deref());
            drop(held);
            hit
        })
        .await
        .ok()
        .flatten();
        if let Some(hit) = local {
            return Some((hit.data, hit.tier.into()));
        }
        // Peers: only those the in-RAM directory says hold it; the fetch is
        // verified (id, length, CRC32C) and bounded by peer-fetch-timeout.
        // A GET dropped while it waits (its client hung up) is a miss too.
        let miss = CountMissOnDrop(Some(&self.store));
        let data = match &self.cluster {
            Some(cluster) => cluster.fetch_named(&id, name).await?,
            None => return None,
        };
        miss.disarm();
        self.store.count_peer_hit(data.len() as u64);
        Some((data, Location::Peer))
    }

    /// The chunk if it is in this node's RAM (no disk, no network, never
    /// blocks; [`tier::ChunkStore::get_ram`]). `name` as for [`NodeContext::get`].
    pub fn get_ram(&self, id: &ChunkId, name: Option<&[u8]>) -> Option<(bytes::Bytes, Location)> {
        let hit = self.store.get_ram(id, name)?;
        Some((hit.data, Location::Ram))
    }

    /// Where a chunk is, from in-RAM indexes only (no disk, no network).
    pub fn locate(&self, id: &ChunkId) -> Option<Location> {
        match self.store.locate(id) {
            Some(t) => Some(t.into()),
            None => self
                .cluster
                .as_ref()
                .filter(|c| c.holds(id))
                .map(|_| Location::Peer),
        }
    }

    /// Fills the `None`s of `tiers` (keys missing locally) with
    /// [`Location::Peer`] where an up peer holds the key; returns the
    /// longest prefix present locally or at a peer.
    fn with_peers(
        &self,
        ns: Namespace,
        group: GroupId,
        keys: &[ChunkKey],
        locs: &mut [Option<Location>],
    ) -> usize {
        if let Some(c) = &self.cluster {
            let missing: Vec<usize> = (0..locs.len()).filter(|&i| locs[i].is_none()).collect();
            if !missing.is_empty() {
                let ids: Vec<ChunkId> = missing
                    .iter()
                    .map(|&i| ChunkId::new(ns, keys[i], group))
                    .collect();
                for (i, held) in missing.into_iter().zip(c.available(&ids)) {
                    if held {
                        locs[i] = Some(Location::Peer);
                    }
                }
            }
        }
        locs.iter().take_while(|l| l.is_some()).count()
    }

    /// For an ordered key list in one namespace: per-key location and the
    /// longest present prefix. No disk, no network.
    pub fn lookup(
        &self,
        ns: Namespace,
        group: GroupId,
        keys: &[ChunkKey],
    ) -> (usize, Vec<Option<Location>>) {
        let mut locs = Vec::with_capacity(keys.len());
        let prefix = self.lookup_with(ns, group, keys, |l| locs.push(l));
        (prefix, locs)
    }

    /// [`NodeContext::lookup`] handing each key's location to `each`, in
    /// key order, instead of collecting them (the native server writes them
    /// straight into its reply). Without peers this is one batched probe of
    /// the store's indexes and no other allocation than the store's.
    pub fn lookup_with(
        &self,
        ns: Namespace,
        group: GroupId,
        keys: &[ChunkKey],
        mut each: impl FnMut(Option<Location>),
    ) -> usize {
        let mut tiers = Vec::with_capacity(keys.len());
        let prefix = self.store.lookup_prefix(ns, group, keys, &mut tiers);
        if self.cluster.is_none() {
            for t in tiers {
                each(t.map(Location::from));
            }
            return prefix;
        }
        let mut locs: Vec<Option<Location>> =
            tiers.into_iter().map(|t| t.map(Location::from)).collect();
        let prefix = self.with_peers(ns, group, keys, &mut locs);
        locs.into_iter().for_each(each);
        prefix
    }

    /// Cluster lookup for the scheduler: for each rank of the family of
    /// `record` (its own rank field is ignored), the longest prefix present
    /// anywhere in the cluster and the RAM-resident prefix on the rank's node.
    /// Without peers, only this node's store is consulted. With peers, the
    /// prefix counts keys held by any up peer (from the in-RAM directory, no
    /// RPC), and the rank's node is any node whose engine registered the
    /// rank's namespace: this one (its RAM) and the live peers publishing
    /// the namespace's record (their RAM residency travels with the
    /// availability sync); `ram_prefix` is the longest of those.
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
            let ns = record.id_of_rank(rank);
            let mut prefix = self.store.lookup_prefix(ns, group, keys, &mut tiers);
            let mut ram_prefix = tiers.iter().take_while(|t| **t == Some(Tier::Ram)).count();
            if let Some(c) = &self.cluster {
                if self.store.namespace_record(&ns).is_none() {
                    // Not this node's rank: its RAM says nothing about it.
                    ram_prefix = 0;
                }
                ram_prefix = ram_prefix.max(c.ram_prefix(ns, group, keys));
                let mut locs: Vec<Option<Location>> =
                    tiers.iter().map(|t| t.map(Location::from)).collect();
                prefix = self.with_peers(ns, group, keys, &mut locs);
            }
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
