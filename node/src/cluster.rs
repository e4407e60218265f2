//! The peer cascade inside the node: builds the peer endpoint from the
//! configuration and glues it to the chunk store.
//!
//! - [`StoreSource`] serves peers' fetches and snapshots from the store
//!   (reads on the blocking pool: a disk read is blocking, and the store
//!   verifies header and payload CRCs on every disk read);
//! - [`AvailabilityFeed`] is the store's [`tier::ChunkObserver`]: every add and
//!   remove becomes a batched availability delta;
//! - [`Cluster`] is what [`crate::context::NodeContext`] calls on a local
//!   miss: which peers hold a chunk (RAM only) and fetch-and-admit.
//!
//! `tier` and `peer` never see each other: ids are converted here.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use parking_lot::Mutex;
use peer::cert::NodeMaterial;
use peer::tls::TlsSetup;
use peer::{
    ChunkBytes, ChunkSource, FetchBuffer, FetchError, PeerChunkId, PeerConfig, PeerHandle,
    PeerNamespace, PeerStatus, SourceFuture, TransportTuning,
};
use tier::buffers::{Filler, POOL_MIN};
use tier::{ChunkId, ChunkKey, ChunkObserver, ChunkStore, GroupId, Namespace};

use crate::error::NodeError;

/// Converts a tier id to the peer protocol's id.
pub fn to_peer(id: &ChunkId) -> PeerChunkId {
    PeerChunkId {
        ns: PeerNamespace(id.ns.0),
        key: id.key.0,
        group: id.group,
    }
}

/// Converts a peer protocol id to a tier id.
pub fn to_tier(id: &PeerChunkId) -> ChunkId {
    ChunkId::new(Namespace(id.ns.0), ChunkKey(id.key), id.group)
}

/// A fetched chunk's payload lands in a buffer of the store's pool.
struct PooledFetch(Filler);

impl FetchBuffer for PooledFetch {
    fn extend_from_slice(&mut self, piece: &[u8]) {
        self.0.extend_from_slice(piece);
    }
    fn freeze(self: Box<Self>) -> Bytes {
        self.0.freeze()
    }
}

/// Serves peers from the local store.
pub struct StoreSource {
    store: Arc<ChunkStore>,
}

impl ChunkSource for StoreSource {
    fn read(&self, id: &PeerChunkId) -> SourceFuture {
        let store = Arc::clone(&self.store);
        let id = to_tier(id);
        Box::pin(async move {
            // The store verifies CRCs on disk reads; RAM bytes are what was
            // put. The CRC is computed here, on the blocking thread, for the
            // requester to verify end to end. Not a local hit or miss: the
            // store's hit counters are this node's clients' reads.
            tokio::task::spawn_blocking(move || store.get_for_peer(&id).map(ChunkBytes::new))
                .await
                .ok()
                .flatten()
        })
    }

    fn snapshot(&self) -> Vec<(PeerChunkId, u64, bool)> {
        self.store
            .ids_with_tier()
            .into_iter()
            .map(|(id, len, ram)| (to_peer(&id), len, ram))
            .collect()
    }

    fn namespace_records(&self) -> Vec<(PeerNamespace, Vec<u8>)> {
        self.store
            .namespaces()
            .into_iter()
            .filter_map(|n| Some((PeerNamespace(n.id.0), serde_json::to_vec(&n.record).ok()?)))
            .collect()
    }

    fn fetch_buffer(&self, len: usize) -> Option<Box<dyn FetchBuffer>> {
        (len >= POOL_MIN).then(|| {
            Box::new(PooledFetch(self.store.buffers().filler(len))) as Box<dyn FetchBuffer>
        })
    }
}

/// Forwards the store's availability changes to the peer layer (cheap,
/// never blocks: the peer layer batches them into deltas).
pub struct AvailabilityFeed {
    handle: PeerHandle,
}

impl ChunkObserver for AvailabilityFeed {
    fn added(&self, id: &ChunkId, len: u64) {
        self.handle.local_added(to_peer(id), len);
    }
    fn removed(&self, id: &ChunkId) {
        self.handle.local_removed(to_peer(id));
    }
    fn in_ram(&self, id: &ChunkId, in_ram: bool) {
        self.handle.local_ram(to_peer(id), in_ram);
    }
}

/// The peer options of the node configuration, resolved.
#[derive(Clone, Debug)]
pub struct ClusterOptions {
    /// Address to listen on for peers.
    pub listen: SocketAddr,
    /// Seed peers (`host:port`).
    pub peers: Vec<String>,
    /// Directory with `ca.pem`, `node.pem`, `node.key`.
    pub tls_dir: Option<PathBuf>,
    /// Self-signed, loopback-only development mode.
    pub insecure_dev: bool,
    /// The configured node name (must match the certificate's).
    pub node_name: Option<String>,
    /// Whole-fetch timeout on a local miss (a slow peer becomes a miss).
    pub fetch_timeout: Duration,
    /// Handshake timeout.
    pub connect_timeout: Duration,
    /// Silence before a peer is suspect.
    pub suspect_after: Duration,
    /// Silence before a peer is down.
    pub down_after: Duration,
    /// Bytes per second served to one peer (0 = unlimited).
    pub serve_rate: u64,
    /// QUIC connections per peer that carry fetches.
    pub fetch_connections: u32,
    /// Admit fetched chunks into local RAM (clean: never written to the
    /// local disk), except RESP values (mutable keys).
    pub admit: bool,
}

/// The running peer cascade of a node.
pub struct Cluster {
    /// What a fetch needs, shared with the tasks that run them.
    fetcher: Arc<Fetcher>,
    /// Fetches in flight by id: concurrent local misses of one chunk share
    /// one fetch ([`Cluster::fetch_named`]).
    flights: Arc<Mutex<Flights>>,
}

/// A cluster whose certificates are loaded and whose peer port is bound,
/// not started yet ([`Cluster::prepare`]): what can fail on a bad config or
/// a busy port has failed before the store opens.
pub struct PreparedCluster {
    cfg: PeerConfig,
    tls: TlsSetup,
    socket: std::net::UdpSocket,
    fetch_timeout: Duration,
    admit: bool,
}

/// The parts of a [`Cluster`] one fetch uses.
struct Fetcher {
    handle: PeerHandle,
    store: Arc<ChunkStore>,
    fetch_timeout: Duration,
    admit: bool,
}

/// Fetches in flight, and a counter that tells one flight of an id from
/// the next.
#[derive(Default)]
struct Flights {
    by_id: HashMap<ChunkId, Flight>,
    next: u64,
}

/// One fetch in flight: a task of its own, so that it goes on for the GETs
/// waiting for it when the one that started it goes away.
struct Flight {
    serial: u64,
    /// The GETs waiting for it (changed only under the map's lock).
    waiters: usize,
    done: tokio::sync::watch::Receiver<Option<Option<Bytes>>>,
    task: tokio::task::AbortHandle,
}

/// A GET's wait for a flight: the last waiter to go away before the fetch
/// is done ends it (no fetch runs to its timeout for nobody).
struct Waiting {
    flights: Arc<Mutex<Flights>>,
    id: ChunkId,
    serial: u64,
}

impl Drop for Waiting {
    fn drop(&mut self) {
        let mut f = self.flights.lock();
        if let Some(flight) = f.by_id.get_mut(&self.id)
            && flight.serial == self.serial
        {
            flight.waiters -= 1;
            if flight.waiters == 0 {
                flight.task.abort();
                f.by_id.remove(&self.id);
            }
        }
    }
}

/// The default name of an `insecure-dev` node listening on `listen`:
/// `dev-<port>` on 127.0.0.1 (or an unspecified address), else with the
/// address too, `dev-127-0-0-4-7401`.
fn dev_name(listen: std::net::SocketAddr) -> String {
    let ip = listen.ip();
    if ip.is_unspecified() || ip == std::net::IpAddr::from([127, 0, 0, 1]) {
        format!("dev-{}", listen.port())
    } else {
        let ip: String = ip
            .to_string()
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
            .collect();
        format!("dev-{}-{}", ip.trim_matches('-'), listen.port())
    }
}

impl Cluster {
    /// The TLS setup `opts` asks for: the certificates of `tls-dir`
    /// (checked: read, signed by their CA, naming `node-name` when set), or
    /// a throw-away one with `insecure-dev`, and warnings that do not stop
    /// a start (a node key others can read). `config check` runs it too.
    pub fn load_tls(opts: &ClusterOptions) -> Result<(TlsSetup, Vec<String>), NodeError> {
        let mut warnings = Vec::new();
        let peer_err = |what: &str, e: peer::Error| NodeError::Config(format!("{what}: {e}"));
        let tls = if opts.insecure_dev {
            let name = opts
                .node_name
                .clone()
                // Insecure nodes all run on this host (loopback only): the
                // port tells them apart (one shared default name made each
                // skip the other as itself), and the address when it is
                // not 127.0.0.1 (QA: nodes on 127.0.0.4 and 127.0.0.5 with
                // one port refused each other as this node).
                .unwrap_or_else(|| dev_name(opts.listen));
            TlsSetup::insecure_dev(&name).map_err(|e| peer_err("insecure-dev certificate", e))?
        } else {
            let dir = opts.tls_dir.as_ref().ok_or_else(|| {
                NodeError::Config(
                    "`peer-listen` is set but `tls-dir` is not: point it at the directory \
                     `kvtier cert issue --out DIR` wrote, or use --insecure-dev on loopback"
                        .into(),
                )
            })?;
            warnings.extend(peer::cert::key_exposure(dir));
            let m = NodeMaterial::read_from(dir)
                .map_err(|e| peer_err(&format!("read tls-dir {}", dir.display()), e))?;
            TlsSetup::from_material(&m)
                .map_err(|e| peer_err(&format!("load certificates from {}", dir.display()), e))?
        };
        if let Some(n) = &opts.node_name {
            if !opts.insecure_dev && *n != tls.node_name {
                return Err(NodeError::Config(format!(
                    "`node-name` is {n:?} but the certificate in tls-dir names {:?}",
                    tls.node_name
                )));
            }
        }
        Ok((tls, warnings))
    }

    /// Loads the TLS files and binds the peer port. Nothing runs yet.
    pub fn prepare(opts: &ClusterOptions) -> Result<PreparedCluster, NodeError> {
        let peer_err = |what: &str, e: peer::Error| NodeError::Config(format!("{what}: {e}"));
        let (tls, warnings) = Self::load_tls(opts)?;
        for w in warnings {
            tracing::warn!("{w}");
        }
        let cfg = PeerConfig {
            listen: opts.listen,
            peers: opts.peers.clone(),
            connect_timeout: opts.connect_timeout,
            suspect_after: opts.suspect_after,
            down_after: opts.down_after,
            serve_rate_limit: opts.serve_rate,
            fetch_connections: opts.fetch_connections,
            // A loopback listener means every peer is on this host (the
            // insecure mode and the tests): the path carries 64 KiB, so
            // start at the largest datagram GSO can batch. Elsewhere MTU
            // discovery finds the path's size (up to the same bound).
            tuning: if opts.listen.ip().is_loopback() {
                TransportTuning::loopback()
            } else {
                TransportTuning::default()
            },
            ..PeerConfig::default()
        };
        cfg.validate(tls.insecure)
            .map_err(|e| peer_err("peer configuration", e))?;
        let socket = cfg
            .tuning
            .bind_socket(cfg.listen)
            .map_err(|source| NodeError::Bind {
                what: "peer (QUIC)",
                addr: cfg.listen.to_string(),
                source,
            })?;
        Ok(PreparedCluster {
            cfg,
            tls,
            socket,
            fetch_timeout: opts.fetch_timeout,
            admit: opts.admit,
        })
    }

    /// The peer layer's handle.
    pub fn handle(&self) -> &PeerHandle {
        &self.fetcher.handle
    }

    /// Whether any up or suspect peer holds `id` (RAM only, no RPC).
    pub fn holds(&self, id: &ChunkId) -> bool {
        !self.fetcher.handle.holders(&to_peer(id)).is_empty()
    }

    /// For each id, whether any up or suspect peer holds it (one lock).
    pub fn available(&self, ids: &[ChunkId]) -> Vec<bool> {
        let p: Vec<PeerChunkId> = ids.iter().map(to_peer).collect();
        self.fetcher.handle.available(&p)
    }

    /// How many of `keys` (in order, namespace `ns`, `group`) are in RAM on
    /// the live peers whose engine registered `ns` (those that publish its
    /// record): the longest such prefix. From the directory; no RPC.
    pub fn ram_prefix(&self, ns: Namespace, group: GroupId, keys: &[ChunkKey]) -> usize {
        let p: Vec<PeerChunkId> = keys
            .iter()
            .map(|k| to_peer(&ChunkId::new(ns, *k, group)))
            .collect();
        self.fetcher.handle.ram_prefix(PeerNamespace(ns.0), &p)
    }

    /// Fetches `id` from a holder within the fetch timeout (verified by the
    /// peer layer), admitting it to local RAM when configured. Any failure
    /// is a miss (logged at debug, counted by the peer layer).
    pub async fn fetch(&self, id: &ChunkId) -> Option<Bytes> {
        self.fetch_named(id, None).await
    }

    /// [`Cluster::fetch`] for a chunk stored under a name (RESP keys). (The
    /// peer protocol carries no names: the id is the hash of the name.)
    ///
    /// Chunks of plain RESP keys are never admitted: their keys are
    /// mutable, and nothing tells a copy here that its holder deleted or
    /// overwrote the key, so an admitted copy (announced to peers like any
    /// local chunk) would serve the old value here and back to the holder.
    /// Each node serves only its own versions of such keys. Other
    /// namespaces' keys are content hashes: a copy never goes stale.
    ///
    /// Concurrent calls for one id share one fetch (two requests with a
    /// common prefix restore the same chunks at once: each fetched them,
    /// and moved them over the network, again). A call whose caller goes
    /// away (a client that hung up) leaves the fetch to the others; the
    /// last one to go ends it.
    pub async fn fetch_named(&self, id: &ChunkId, name: Option<Bytes>) -> Option<Bytes> {
        let (mut done, _waiting) = {
            let mut f = self.flights.lock();
            let Flights { by_id, next } = &mut *f;
            let flight = match by_id.entry(*id) {
                std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::hash_map::Entry::Vacant(e) => {
                    *next += 1;
                    let serial = *next;
                    let (tx, done) = tokio::sync::watch::channel(None);
                    let fetcher = Arc::clone(&self.fetcher);
                    let flights = Arc::clone(&self.flights);
                    let id = *id;
                    let task = tokio::spawn(async move {
                        let got = fetcher.fetch_once(&id, name).await;
                        // Off the map first: a miss that comes after this
                        // starts a fetch of its own, never reuses this one.
                        {
                            let mut f = flights.lock();
                            if f.by_id.get(&id).is_some_and(|x| x.serial == serial) {
                                f.by_id.remove(&id);
                            }
                        }
                        let _ = tx.send(Some(got));
                    });
                    e.insert(Flight {
                        serial,
                        waiters: 0,
                        done,
                        task: task.abort_handle(),
                    })
                }
            };
            flight.waiters += 1;
            let waiting = Waiting {
                flights: Arc::clone(&self.flights),
                id: *id,
                serial: flight.serial,
            };
            (flight.done.clone(), waiting)
        };
        // A closed channel: the task ended without an answer (aborted
        // because every waiter left, which this one has not, or panicked).
        let got = done.wait_for(Option::is_some).await.ok()?;
        got.clone().flatten()
    }

    /// Status of every peer.
    pub fn peers(&self) -> Vec<PeerStatus> {
        self.fetcher.handle.peers()
    }

    /// Closes every peer connection (bounded by `grace`).
    pub async fn shutdown(&self, grace: Duration) {
        self.fetcher.handle.shutdown(grace).await;
    }
}

/// What becomes of a chunk fetched from a peer ([`Fetcher::admission`]).
enum Admission {
    /// Not kept.
    No,
    /// Kept in RAM.
    Yes,
    /// Kept, once its namespace is registered from the record a peer
    /// publishes.
    Register(Box<tier::NamespaceRecord>),
}

impl Fetcher {
    /// One fetch of `id` (see [`Cluster::fetch_named`]).
    async fn fetch_once(&self, id: &ChunkId, name: Option<Bytes>) -> Option<Bytes> {
        let admission = if self.admit {
            self.admission(id)
        } else {
            Admission::No
        };
        let admit = !matches!(admission, Admission::No);
        // A GET that missed locally just before another one's fetch of the
        // chunk was admitted: served from RAM (counted as the peer hit it
        // nearly was), not fetched again.
        if admit && let Some(b) = self.store.peek_ram(id, name.as_deref()) {
            return Some(b);
        }
        match self.handle.fetch(&to_peer(id), self.fetch_timeout).await {
            Ok(b) => {
                if admit {
                    // A clean RAM insert: the holder keeps the durable copy,
                    // so this one is never written to the local disk and is
                    // dropped on eviction. An unregistered namespace (no
                    // local client used it yet) is simply not admitted.
                    let store = Arc::clone(&self.store);
                    let (id, data) = (*id, b.clone());
                    // Its evictions may wait for the disk writer (as RESP SET).
                    let res = crate::context::insert_off_runtime(
                        &self.store,
                        "admission task",
                        move || {
                            if let Admission::Register(rec) = admission {
                                store.register_namespace(&rec)?;
                            }
                            store.put_clean(id, name, data)
                        },
                    )
                    .await;
                    if let Err(e) = res {
                        tracing::debug!(error = %e, "fetched chunk not admitted");
                    }
                }
                Some(b)
            }
            Err(FetchError::NoHolder) => None,
            Err(e) => {
                tracing::debug!(error = %e, "peer fetch became a miss");
                None
            }
        }
    }

    /// Whether a chunk fetched for `id` may be admitted: its keys are
    /// immutable (not a plain RESP namespace: LMCache's keys name their
    /// chunk's content hash, like the native engines' keys), and its
    /// namespace is registered here, or a peer publishes its record, which
    /// is registered with the admission (QA: a node that only read LMCache
    /// values from its peers, never SET one, fetched them again each time).
    /// Only a namespace a peer holds chunks of can be registered so, never
    /// one a client's GET names.
    fn admission(&self, id: &ChunkId) -> Admission {
        let immutable = |r: &tier::NamespaceRecord| r.engine != crate::resp::keys::RESP_ENGINE;
        if let Some(r) = self.store.namespace_record(&id.ns) {
            return if immutable(&r) {
                Admission::Yes
            } else {
                Admission::No
            };
        }
        self.handle
            .namespace_records()
            .into_iter()
            .filter(|(_, ns, _)| ns.0 == id.ns.0)
            .filter_map(|(_, _, json)| serde_json::from_slice::<tier::NamespaceRecord>(&json).ok())
            .find(|r| r.id() == id.ns && immutable(r))
            .map_or(Admission::No, |r| Admission::Register(Box::new(r)))
    }
}

impl PreparedCluster {
    /// Starts syncing on the bound port and registers the availability
    /// observer on `store`. Inside a tokio runtime.
    pub fn start(self, store: Arc<ChunkStore>) -> Result<Cluster, NodeError> {
        let source = Arc::new(StoreSource {
            store: Arc::clone(&store),
        });
        let handle = PeerHandle::start_on(self.cfg, self.tls, source, self.socket)
            .map_err(|e| NodeError::Config(format!("start the peer layer: {e}")))?;
        store.set_observer(Arc::new(AvailabilityFeed {
            handle: handle.clone(),
        }));
        Ok(Cluster {
            fetcher: Arc::new(Fetcher {
                handle,
                store,
                fetch_timeout: self.fetch_timeout,
                admit: self.admit,
            }),
            flights: Arc::default(),
        })
    }
}

/// A per-peer metric: name, help, and how to read it from a status row.
type Metric<T> = (&'static str, &'static str, fn(&PeerStatus) -> T);

impl Cluster {
    /// Per-peer Prometheus metrics (label `peer`: the node name, or the
    /// seed address until connected).
    pub fn encode_metrics(
        &self,
        enc: &mut prometheus_client::encoding::DescriptorEncoder<'_>,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeMetric;
        use prometheus_client::metrics::MetricType;
        use prometheus_client::metrics::counter::ConstCounter;
        use prometheus_client::metrics::gauge::ConstGauge;

        let peers = self.peers();
        let names: Vec<String> = peers
            .iter()
            .map(|p| p.name.clone().unwrap_or_else(|| p.addr.clone()))
            .collect();
        let counters: [Metric<u64>; 4] = [
            (
                "peer_fetched_bytes",
                "Payload bytes fetched from the peer",
                |p| p.bytes_fetched,
            ),
            (
                "peer_served_bytes",
                "Payload bytes served to the peer",
                |p| p.bytes_served,
            ),
            (
                "peer_fetches",
                "Fetches from the peer that succeeded",
                |p| p.fetches_ok,
            ),
            (
                "peer_fetch_failures",
                "Fetches from the peer that failed (became misses)",
                |p| p.fetches_failed,
            ),
        ];
        let unlisted = self.fetcher.handle.served_unlisted(false);
        for (name, help, f) in counters {
            let mut me = enc.encode_descriptor(name, help, None, MetricType::Counter)?;
            for (n, p) in names.iter().zip(&peers) {
                ConstCounter::new(f(p)).encode(me.encode_family(&[("peer", n.as_str())])?)?;
            }
            if name == "peer_served_bytes" {
                // Nodes that dial us without being in our seed list.
                for (n, bytes) in &unlisted {
                    ConstCounter::new(*bytes).encode(me.encode_family(&[("peer", n.as_str())])?)?;
                }
            }
        }
        let gauges: [Metric<i64>; 5] = [
            (
                "peer_up",
                "1 while the peer is up, 0 when suspect or down",
                |p| i64::from(p.state == peer::PeerState::Up),
            ),
            (
                "peer_chunks",
                "Chunks the peer holds (as synced here)",
                |p| p.chunks as i64,
            ),
            (
                "peer_bytes",
                "Payload bytes the peer holds (as synced here)",
                |p| p.bytes as i64,
            ),
            (
                "peer_rtt_microseconds",
                "Smoothed RTT to the peer (0 when not connected)",
                |p| p.rtt_us.unwrap_or(0) as i64,
            ),
            (
                "peer_fetches_in_flight",
                "Fetches from the peer running now",
                |p| i64::from(p.fetches_in_flight),
            ),
        ];
        ConstCounter::new(self.fetcher.handle.corrupt_replies()).encode(enc.encode_descriptor(
            "peer_corrupt_replies",
            "Replies from peers that failed verification (id, length or CRC32C; each a miss)",
            None,
            MetricType::Counter,
        )?)?;
        for (name, help, f) in gauges {
            let mut me = enc.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for (n, p) in names.iter().zip(&peers) {
                ConstGauge::new(f(p)).encode(me.encode_family(&[("peer", n.as_str())])?)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::dev_name;

    /// Insecure-dev nodes on other loopback addresses with one port get
    /// names of their own (QA: 127.0.0.4:7401 and 127.0.0.5:7401 were both
    /// `dev-7401` and refused each other as this node).
    #[test]
    fn insecure_dev_names_tell_addresses_apart() {
        let name = |a: &str| dev_name(a.parse().unwrap());
        assert_eq!(name("127.0.0.1:7401"), "dev-7401");
        assert_eq!(name("0.0.0.0:7401"), "dev-7401");
        assert_eq!(name("127.0.0.4:7401"), "dev-127-0-0-4-7401");
        assert_ne!(name("127.0.0.4:7401"), name("127.0.0.5:7401"));
        assert_eq!(name("[::1]:7401"), "dev-1-7401");
    }
}
