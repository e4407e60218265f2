//! The quinn driver: one QUIC endpoint per node, a link to every seed peer,
//! serving of inbound links, and chunk fetches.
//!
//! Topology: each node dials every seed (one outbound connection per peer)
//! and accepts connections from the others, so every pair has two
//! connections. Over its *outbound* connection a node subscribes to the
//! peer's availability (control stream: hello, then snapshot and deltas
//! from the peer, pings from us), measures liveness and RTT, and fetches
//! chunks (one bidirectional stream per chunk). Over *inbound* connections
//! it publishes its own availability and serves fetches. No dedup or
//! leader election is needed, and a restarted peer is re-synced by the
//! reconnect of the outbound link.
//!
//! Call order: [`PeerHandle::start`] inside a tokio runtime, then
//! `local_added`/`local_removed` as the store changes, `holders`/`fetch` on
//! the read path, and [`PeerHandle::shutdown`] at the end (returns once
//! every task has finished).

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use parking_lot::{Mutex, RwLock};
use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use quinn::{Connection, RecvStream, SendStream, VarInt};
use rand::Rng;
use tokio::sync::{Notify, Semaphore, broadcast, mpsc, watch};
use tokio::task::JoinHandle;

use crate::Error;
use crate::directory::{Directory, MAX_SLOTS};
use crate::id::{ChunkBytes, PeerChunkId, PeerNamespace};
use crate::proto::frame::{self, FrameHeader, HEADER_LEN};
use crate::proto::health::{Backoff, HealthConfig, PeerHealth, PeerState};
use crate::proto::msg::{FetchStatus, Message};
use crate::proto::sync::{Publisher, RemoteSync, SyncAction, snapshot_messages};
use crate::tls::{TlsSetup, peer_node_name};

/// Future returned by [`ChunkSource::read`].
pub type SourceFuture = Pin<Box<dyn Future<Output = Option<ChunkBytes>> + Send + 'static>>;

/// What the node supplies so this node can serve fetches and snapshots.
pub trait ChunkSource: Send + Sync + 'static {
    /// Reads a chunk for a peer: the payload as stored and its recorded
    /// CRC32C (`None` if not held or unreadable). Must not block the
    /// calling task (disk reads belong on the tier's I/O threads).
    fn read(&self, id: &PeerChunkId) -> SourceFuture;
    /// Every chunk held locally (RAM or disk) with its payload length and
    /// whether it is in RAM. Called on a blocking thread when a peer
    /// subscribes.
    fn snapshot(&self) -> Vec<(PeerChunkId, u64, bool)>;
    /// Namespace records (opaque JSON bytes) of the namespaces held here.
    fn namespace_records(&self) -> Vec<(PeerNamespace, Vec<u8>)>;
    /// A buffer of `len` bytes for the payload of a chunk fetched from a
    /// peer, which the fetch fills in order (the node hands out the memory
    /// of dropped chunks); `None`, the default, for a new buffer.
    fn fetch_buffer(&self, len: usize) -> Option<Box<dyn FetchBuffer>> {
        let _ = len;
        None
    }
}

/// A buffer a fetched payload is copied into, piece by piece, in order:
/// one lent by [`ChunkSource::fetch_buffer`], else a new `BytesMut`.
pub trait FetchBuffer: Send {
    /// Appends the next piece (never more than the length it was made for).
    fn extend_from_slice(&mut self, piece: &[u8]);
    /// The bytes appended.
    fn freeze(self: Box<Self>) -> Bytes;
}

impl FetchBuffer for BytesMut {
    fn extend_from_slice(&mut self, piece: &[u8]) {
        BytesMut::extend_from_slice(self, piece);
    }
    fn freeze(self: Box<Self>) -> Bytes {
        BytesMut::freeze(*self)
    }
}

/// Largest UDP payload one `sendmsg` may carry (IPv4: 65,535 − 20 − 8).
/// With segmentation offload (GSO), quinn hands the kernel up to
/// [`GSO_SEGMENTS`] datagrams in one call, and the kernel refuses the whole
/// batch with EMSGSIZE when they add up to more; quinn-udp drops such a
/// batch silently (as if the datagrams were lost).
pub const MAX_SENDMSG_PAYLOAD: usize = 65_507;

/// Datagrams quinn 0.11 puts in one GSO batch (`MAX_TRANSMIT_SEGMENTS`).
pub const GSO_SEGMENTS: usize = 10;

/// Largest datagram that still fits [`GSO_SEGMENTS`] to a `sendmsg`.
pub const MAX_GSO_DATAGRAM: u16 = (MAX_SENDMSG_PAYLOAD / GSO_SEGMENTS) as u16;

/// Largest initial datagram size quinn-proto 0.11 can use: handshake
/// (long-header) packets encode their length in two bytes, and it panics
/// on 16 KiB or more.
pub const MAX_INITIAL_MTU: u16 = 16_383;

/// QUIC transport tuning (same settings for the raw-quinn baseline bench).
///
/// What decides throughput on a fast path (measured with
/// `peer/examples/quic_tune.rs`, see docs/benchmarks.md): CPU per packet
/// (so the datagram size), loss from receive-buffer overruns (each loss
/// cuts the congestion window), and GSO batches that must stay under the
/// 64 KiB `sendmsg` limit.
#[derive(Debug, Clone, Copy)]
pub struct TransportTuning {
    /// Initial datagram size (must fit the path MTU from the first packet;
    /// at most [`MAX_INITIAL_MTU`]). Default: 1200.
    pub initial_mtu: u16,
    /// Datagram size the path is known to carry: MTU discovery and black
    /// hole detection never go below it. Default: 1200 (QUIC's minimum).
    pub min_mtu: u16,
    /// Upper bound for MTU discovery and the largest UDP payload accepted.
    /// Above [`MAX_GSO_DATAGRAM`], segmentation offload is turned off (one
    /// datagram per `sendmsg`). Default: 6500 (reached on jumbo-frame
    /// networks and loopback; 1500-byte networks stop at ~1450 by
    /// discovery), so GSO stays on.
    pub max_udp_payload: u16,
    /// Per-stream receive window. Default: 16 MiB.
    pub stream_window: u32,
    /// Per-connection receive window. Default: 64 MiB.
    pub conn_window: u32,
    /// Per-connection send window. Default: 64 MiB.
    pub send_window: u64,
    /// UDP socket send/receive buffer size requested from the kernel.
    /// Default: 32 MiB (the kernel caps it at `net.core.[rw]mem_max` unless
    /// the process has CAP_NET_ADMIN; the receive side is forced when it
    /// may be).
    pub socket_buffer: u32,
}

impl Default for TransportTuning {
    fn default() -> Self {
        Self {
            initial_mtu: 1200,
            min_mtu: 1200,
            max_udp_payload: MAX_GSO_DATAGRAM.min(6500),
            stream_window: 16 << 20,
            conn_window: 64 << 20,
            send_window: 64 << 20,
            socket_buffer: 32 << 20,
        }
    }
}

impl TransportTuning {
    /// Settings for loopback (MTU 64 KiB): 6500-byte datagrams from the
    /// first packet and never below (the path is known), GSO on.
    pub fn loopback() -> Self {
        Self::path(6500)
    }

    /// Settings for a path known to carry `mtu`-byte UDP payloads
    /// (e.g. 8952 on 9000-byte jumbo frames): that size from the first
    /// packet and never below (no black-hole fallback). `mtu` is clamped
    /// to 1200..=[`MAX_INITIAL_MTU`]; above [`MAX_GSO_DATAGRAM`] GSO is off.
    pub fn path(mtu: u16) -> Self {
        let mtu = mtu.clamp(1200, MAX_INITIAL_MTU);
        Self {
            initial_mtu: mtu,
            min_mtu: mtu,
            max_udp_payload: mtu,
            ..Self::default()
        }
    }

    /// Same as [`TransportTuning::path`] (kept for the bench's
    /// `KVTIER_BENCH_TUNING=N`).
    pub fn jumbo(mtu: u16) -> Self {
        Self::path(mtu)
    }

    fn upper_bound(&self) -> u16 {
        self.max_udp_payload.max(self.initial_mtu).max(1200)
    }

    /// Whether GSO batches of this datagram size fit one `sendmsg`.
    pub fn gso(&self) -> bool {
        self.upper_bound() <= MAX_GSO_DATAGRAM
    }

    /// quinn's transport config for these settings plus liveness timers.
    pub fn transport_config(
        &self,
        keep_alive: Duration,
        idle_timeout: Duration,
    ) -> quinn::TransportConfig {
        let mut t = quinn::TransportConfig::default();
        let initial = self.initial_mtu.clamp(1200, MAX_INITIAL_MTU);
        t.initial_mtu(initial);
        t.min_mtu(self.min_mtu.clamp(1200, initial));
        let mut mtu = quinn::MtuDiscoveryConfig::default();
        mtu.upper_bound(self.upper_bound());
        t.mtu_discovery_config(Some(mtu));
        t.enable_segmentation_offload(self.gso());
        // RFC 9002's initial window (10 datagrams, at least 14,720 bytes):
        // quinn's fixed 14,720 leaves less than two datagrams above ~7 KB
        // and stalls the handshake.
        let mut cc = quinn::congestion::CubicConfig::default();
        cc.initial_window((10 * u64::from(initial)).max(14_720));
        t.congestion_controller_factory(Arc::new(cc));
        t.stream_receive_window(VarInt::from_u32(self.stream_window));
        t.receive_window(VarInt::from_u32(self.conn_window));
        t.send_window(self.send_window);
        t.max_concurrent_bidi_streams(VarInt::from_u32(256));
        t.max_concurrent_uni_streams(VarInt::from_u32(0));
        t.keep_alive_interval(Some(keep_alive));
        t.max_idle_timeout(quinn::IdleTimeout::try_from(idle_timeout).ok());
        t
    }

    /// quinn's endpoint config for these settings.
    pub fn endpoint_config(&self) -> quinn::EndpointConfig {
        let mut e = quinn::EndpointConfig::default();
        // Values from 1200 to 65527 are accepted; ours are clamped above.
        let _ = e.max_udp_payload_size(self.upper_bound());
        e
    }

    /// Binds a UDP socket with the configured buffer sizes.
    pub fn bind_socket(&self, addr: SocketAddr) -> std::io::Result<std::net::UdpSocket> {
        let s = std::net::UdpSocket::bind(addr)?;
        let size = self.socket_buffer as usize;
        // Best effort: the kernel caps these at rmem_max / wmem_max unless
        // the process may force them (CAP_NET_ADMIN). A large receive
        // buffer is what keeps a briefly descheduled receiver from dropping
        // datagrams (each drop costs a congestion-window cut).
        if rustix::net::sockopt::set_socket_recv_buffer_size_force(&s, size).is_err() {
            let _ = rustix::net::sockopt::set_socket_recv_buffer_size(&s, size);
        }
        let _ = rustix::net::sockopt::set_socket_send_buffer_size(&s, size);
        Ok(s)
    }
}

/// Most [`PeerConfig::fetch_connections`] per peer.
pub const MAX_FETCH_CONNECTIONS: u32 = 16;
/// Longest timeout or membership threshold accepted (one day): instants
/// are computed as `now + duration`, which a longer value could overflow.
pub const MAX_PEER_DURATION: Duration = Duration::from_secs(86_400);

/// Peer configuration (the node maps its own config onto this).
#[derive(Debug, Clone)]
pub struct PeerConfig {
    /// Address to listen on for peers. Default: 127.0.0.1:0.
    pub listen: SocketAddr,
    /// Seed peers, `host:port`. Our own address may be listed (it is
    /// recognised by name and skipped). Default: none.
    pub peers: Vec<String>,
    /// Handshake + hello timeout. Default: 2 s.
    pub connect_timeout: Duration,
    /// Ping interval on each outbound link. Default: 250 ms.
    pub ping_interval: Duration,
    /// Silence before a peer is suspect. Default: 1 s.
    pub suspect_after: Duration,
    /// Silence before a peer is down and its link dropped. Default: 3 s.
    pub down_after: Duration,
    /// QUIC keep-alive interval. Default: 500 ms.
    pub keep_alive: Duration,
    /// QUIC idle timeout (connection closed when silent this long).
    /// Default: 3 s.
    pub idle_timeout: Duration,
    /// First reconnect delay. Default: 100 ms.
    pub backoff_base: Duration,
    /// Largest reconnect delay. Default: 5 s.
    pub backoff_max: Duration,
    /// Concurrent fetches per peer (requester side). Default: 16.
    pub max_fetches_per_peer: u32,
    /// QUIC connections per peer that carry fetches: the control connection
    /// plus `fetch_connections - 1` fetch-only ones dialed after it, used in
    /// turn. Each connection is driven by its own task, so on hosts with
    /// cores to spare several spread the packet and crypto work (one
    /// connection moves ~1.2 GB/s on loopback, four ~2.4–3.2 GB/s on a
    /// 16-core host: docs/benchmarks.md). Default: 4.
    pub fetch_connections: u32,
    /// Bytes per second served to one peer; 0 = unlimited. Default: 0.
    pub serve_rate_limit: u64,
    /// Flush a delta when this many changes are pending. Default: 1024.
    pub delta_max_batch: usize,
    /// Flush a delta when the oldest change is this old. Default: 5 ms.
    pub delta_max_delay: Duration,
    /// Largest chunk payload accepted in a fetch reply. Default: 256 MiB.
    pub max_chunk_len: u64,
    /// Most chunks one peer may announce; past it its link is dropped with
    /// a warning (and retried with backoff), so its announcements cannot
    /// grow this node's memory without bound. At least 1. Default:
    /// [`crate::directory::DEFAULT_MAX_CHUNKS_PER_PEER`] (8 Mi).
    pub max_chunks_per_peer: u64,
    /// QUIC tuning.
    pub tuning: TransportTuning,
}

impl Default for PeerConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            peers: Vec::new(),
            connect_timeout: Duration::from_secs(2),
            ping_interval: Duration::from_millis(250),
            suspect_after: Duration::from_secs(1),
            down_after: Duration::from_secs(3),
            keep_alive: Duration::from_millis(500),
            idle_timeout: Duration::from_secs(3),
            backoff_base: Duration::from_millis(100),
            backoff_max: Duration::from_secs(5),
            max_fetches_per_peer: 16,
            fetch_connections: 4,
            serve_rate_limit: 0,
            delta_max_batch: 1024,
            delta_max_delay: Duration::from_millis(5),
            max_chunk_len: 256 << 20,
            max_chunks_per_peer: crate::directory::DEFAULT_MAX_CHUNKS_PER_PEER,
            tuning: TransportTuning::default(),
        }
    }
}

impl PeerConfig {
    /// Rejects contradictions (never clamps). `insecure` is the
    /// `--insecure-dev` mode: then the listen address must be loopback.
    pub fn validate(&self, insecure: bool) -> Result<(), Error> {
        let bad = |m: String| Err(Error::Config(m));
        if self.peers.len() > MAX_SLOTS {
            return bad(format!(
                "{} peers configured, at most {MAX_SLOTS}",
                self.peers.len()
            ));
        }
        for (key, d) in [
            ("connect-timeout", self.connect_timeout),
            ("ping-interval", self.ping_interval),
            ("suspect-after", self.suspect_after),
            ("down-after", self.down_after),
            ("keep-alive", self.keep_alive),
            ("idle-timeout", self.idle_timeout),
            ("backoff-max", self.backoff_max),
        ] {
            if d > MAX_PEER_DURATION {
                return bad(format!(
                    "{key} of {d:?} is longer than the {MAX_PEER_DURATION:?} limit"
                ));
            }
        }
        if self.suspect_after >= self.down_after {
            return bad("suspect-after must be shorter than down-after".into());
        }
        if self.ping_interval >= self.suspect_after {
            return bad("ping-interval must be shorter than suspect-after".into());
        }
        if self.max_chunks_per_peer == 0 {
            return bad("max-chunks-per-peer must be at least 1".into());
        }
        if self.max_fetches_per_peer == 0 {
            return bad("max-fetches-per-peer must be at least 1".into());
        }
        if !(1..=MAX_FETCH_CONNECTIONS).contains(&self.fetch_connections) {
            return bad(format!(
                "fetch-connections must be 1 to {MAX_FETCH_CONNECTIONS}, not {}",
                self.fetch_connections
            ));
        }
        if self.backoff_base.is_zero() || self.backoff_base > self.backoff_max {
            return bad("backoff-base must be > 0 and <= backoff-max".into());
        }
        if insecure && !self.listen.ip().is_loopback() {
            return bad(format!(
                "--insecure-dev binds loopback only; peer-listen {} is not a loopback address",
                self.listen
            ));
        }
        Ok(())
    }
}

/// Why a fetch from peers produced no bytes (the caller treats it as a
/// miss).
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum FetchError {
    /// No up or suspect peer is known to hold the chunk.
    #[error("no peer holds the chunk")]
    NoHolder,
    /// The deadline passed.
    #[error("peer fetch timed out after {after:?} (peer {peer})")]
    Timeout {
        /// Peer being asked when time ran out.
        peer: String,
        /// The timeout.
        after: Duration,
    },
    /// The holder no longer has it.
    #[error("peer {peer} does not have the chunk")]
    NotFound {
        /// Peer.
        peer: String,
    },
    /// The holder refused (busy) or failed to read it.
    #[error("peer {peer} could not serve the chunk: {why}")]
    Refused {
        /// Peer.
        peer: String,
        /// Reason it gave.
        why: String,
    },
    /// The bytes received failed verification.
    #[error("peer {peer} sent a corrupt reply: {why}")]
    Corrupt {
        /// Peer.
        peer: String,
        /// What did not match.
        why: String,
    },
    /// The connection or stream failed.
    #[error("peer {peer}: {why}")]
    Transport {
        /// Peer.
        peer: String,
        /// Error.
        why: String,
    },
    /// This node is shutting down.
    #[error("peer transport is shutting down")]
    ShuttingDown,
}

/// A peer offered as a holder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerRef {
    /// Slot index (position in the seed list).
    pub slot: u16,
    /// Node name (from its certificate).
    pub name: Arc<str>,
    /// State when asked.
    pub state: PeerState,
}

/// One row of `kvtier peers`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PeerStatus {
    /// Node name (`None` until first connected).
    pub name: Option<String>,
    /// Seed address as configured.
    pub addr: String,
    /// State now.
    pub state: PeerState,
    /// Smoothed RTT in microseconds (QUIC's estimate while connected).
    pub rtt_us: Option<u64>,
    /// Chunks the peer holds (as synced here).
    pub chunks: u64,
    /// Their payload bytes.
    pub bytes: u64,
    /// Whether the availability view is in sync.
    pub synced: bool,
    /// Milliseconds since the last snapshot or delta was applied.
    pub last_sync_age_ms: Option<u64>,
    /// Payload bytes fetched from this peer.
    pub bytes_fetched: u64,
    /// Payload bytes served to this peer.
    pub bytes_served: u64,
    /// Fetches from this peer that succeeded.
    pub fetches_ok: u64,
    /// Fetches from this peer that failed (any reason).
    pub fetches_failed: u64,
    /// Fetches from this peer running now (a fetch whose requester gave
    /// up, e.g. a client that hung up, is no longer counted).
    pub fetches_in_flight: u32,
    /// Successful connects so far.
    pub connects: u64,
    /// Open QUIC connections that carry fetches (the control connection
    /// plus fetch-only ones; 0 while disconnected).
    pub connections: u32,
    /// Snapshots forced by gaps or resets.
    pub resyncs: u64,
    /// Why the last attempt to connect failed (`None` once one succeeds),
    /// e.g. a certificate the peer refused.
    pub last_error: Option<String>,
}

/// What one requesting peer has been served, over all its connections.
struct ServeStats {
    bytes: AtomicU64,
    limiter: RateLimiter,
    /// Under a serve rate, one reply at a time, in arrival order (see
    /// `serve_fetch`).
    turn: tokio::sync::Mutex<()>,
    /// Fetches being served to this peer: at most twice what a peer asks of
    /// one holder at once (`max_fetches_per_peer`); more are answered `Busy`
    /// (each serve may hold a thread of the blocking pool, which local disk
    /// reads need too).
    serving: Semaphore,
    /// Subscriptions (control streams) this peer may still open, over all
    /// its connections (see [`MAX_CONTROL_STREAMS`]).
    control: Arc<Semaphore>,
    /// This peer's open inbound connections, oldest first (at most
    /// [`MAX_CONNECTIONS_PER_PEER`]).
    conns: Mutex<VecDeque<Connection>>,
}

/// Removes `conn` from its peer's list when its serving ends.
struct ConnEntry<'a> {
    stats: &'a ServeStats,
    id: usize,
}

impl Drop for ConnEntry<'_> {
    fn drop(&mut self) {
        self.stats.conns.lock().retain(|c| c.stable_id() != self.id);
    }
}

impl ServeStats {
    /// Lists `conn` as one of this peer's connections. Past
    /// [`MAX_CONNECTIONS_PER_PEER`] the oldest is closed (code
    /// [`CLOSE_TOO_MANY_CONNECTIONS`]) and returned: stale connections of a
    /// peer that reconnected go before its new ones.
    fn admit_conn(&self, conn: &Connection) -> (ConnEntry<'_>, Option<Connection>) {
        let mut conns = self.conns.lock();
        conns.retain(|c| c.close_reason().is_none());
        let evicted = if conns.len() >= MAX_CONNECTIONS_PER_PEER {
            conns.pop_front()
        } else {
            None
        };
        if let Some(old) = &evicted {
            old.close(
                CLOSE_TOO_MANY_CONNECTIONS,
                b"too many connections from this peer; the oldest is closed",
            );
        }
        conns.push_back(conn.clone());
        let entry = ConnEntry {
            stats: self,
            id: conn.stable_id(),
        };
        (entry, evicted)
    }
}

/// One configured peer.
struct Slot {
    index: usize,
    seed: String,
    name: RwLock<Option<Arc<str>>>,
    conn: RwLock<Option<Connection>>,
    /// Fetch-only connections to the same peer (see
    /// [`PeerConfig::fetch_connections`]); emptied when the link drops.
    extra: RwLock<Vec<Connection>>,
    /// Round-robin position over `conn` and `extra`.
    next_conn: AtomicUsize,
    health: Mutex<PeerHealth>,
    sync: Mutex<RemoteSync>,
    namespaces: Mutex<Vec<(PeerNamespace, Vec<u8>)>>,
    is_self: AtomicBool,
    /// The node another seed links to that this seed reached last (an
    /// alias of its address): no row of its own while that link lasts.
    /// Dialled again now and then, since what answers at an address can
    /// change.
    alias_of: Mutex<Option<Arc<str>>>,
    /// Why the last connect failed (cleared when one succeeds).
    last_error: Mutex<Option<String>>,
    fetch_sem: Semaphore,
    in_flight: AtomicU32,
    bytes_fetched: AtomicU64,
    fetches_ok: AtomicU64,
    fetches_failed: AtomicU64,
    connects: AtomicU64,
    /// Until when fetches skip this peer: a fetch from it timed out (see
    /// [`SLOW_PEER_COOLDOWN`]).
    slow_until: Mutex<Option<Instant>>,
    /// When any fetch from this peer last received something (a reply
    /// header or payload bytes): a timed-out fetch blames the peer only if
    /// it sent nothing at all meanwhile.
    progress: Mutex<Option<Instant>>,
}

/// One fetch counted in a peer's `in_flight` (or one reply in
/// `Shared::serves_in_flight`) for as long as it lives.
struct InFlight<'a>(&'a AtomicU32);

impl<'a> InFlight<'a> {
    fn new(count: &'a AtomicU32) -> Self {
        // SeqCst: a shutdown's drain reads it after setting its flag, and a
        // serve reads the flag after counting itself (each sees the other).
        count.fetch_add(1, Ordering::SeqCst);
        Self(count)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// How long a peer is skipped (by fetches and by lookups' availability)
/// after a fetch from it timed out while it sent nothing on any fetch. A
/// holder whose link is up but whose fetches hang (a stopped disk, a hung
/// process behind a live QUIC stack) is not marked down by the membership
/// protocol; without this every chunk of a restore waited out its own
/// timeout there, so a GET of N chunks took about N / 16 timeouts. Now the
/// first wave times out and the rest are misses at once (or go to another
/// holder) until the cooldown ends or the link is made again. A holder that
/// is merely slow (a serve rate, a queue of large chunks) keeps sending
/// bytes on some fetch and is never put in cooldown.
pub const SLOW_PEER_COOLDOWN: Duration = Duration::from_secs(10);

impl Slot {
    /// The counters that belong to the peer node this slot links to (they
    /// start over when another node takes its address, and move with the
    /// node to another seed's row).
    fn node_counters(&self) -> [&AtomicU64; 4] {
        [
            &self.bytes_fetched,
            &self.fetches_ok,
            &self.fetches_failed,
            &self.connects,
        ]
    }

    fn cooling(&self, now: Instant) -> bool {
        self.slow_until.lock().is_some_and(|t| now < t)
    }

    fn progressed(&self) {
        *self.progress.lock() = Some(Instant::now());
    }

    /// Whether any fetch from this peer received something since `t`.
    fn progressed_since(&self, t: Instant) -> bool {
        self.progress.lock().is_some_and(|p| p >= t)
    }

    fn label(&self) -> String {
        self.name
            .read()
            .as_deref()
            .map_or_else(|| self.seed.clone(), str::to_owned)
    }
}

struct Shared {
    cfg: PeerConfig,
    node_name: String,
    cluster: String,
    insecure: bool,
    endpoint: quinn::Endpoint,
    client_cfg: quinn::ClientConfig,
    // parking_lot: pushes are O(1) and the flusher holds it only to cut a
    // batch and hand it to the broadcast channel (never across await).
    publisher: Mutex<Publisher>,
    deltas: broadcast::Sender<Bytes>,
    flush_now: Notify,
    ns_version: watch::Sender<u64>,
    directory: Directory,
    slots: Vec<Arc<Slot>>,
    source: Arc<dyn ChunkSource>,
    // parking_lot: looked up once per inbound connection.
    served: Mutex<HashMap<String, Arc<ServeStats>>>,
    shutdown: watch::Sender<bool>,
    // parking_lot: pushed at start and per connection, drained at shutdown.
    tasks: Mutex<Vec<JoinHandle<()>>>,
    corrupt_replies: AtomicU64,
    /// Fetch replies being served, from admission until the requester
    /// acknowledged the last byte (or left): a shutdown waits for them.
    serves_in_flight: AtomicU32,
    /// Set at a shutdown: new fetches are answered `Busy` (the requester
    /// tries another holder) while those in flight finish.
    draining: AtomicBool,
    /// Which slot links to each peer node, by name: claimed when a hello
    /// names the node and held until that link ends (see [`NameClaim`]).
    /// One check-and-claim under this lock, so two seeds that reach one
    /// node (aliases of one address) never both link to it.
    // parking_lot: taken once per link made and once per link ended.
    linked: Mutex<HashMap<Arc<str>, usize>>,
}

/// A slot's claim on a peer node's name in [`Shared::linked`], released
/// when the link it was taken for ends.
struct NameClaim {
    shared: Arc<Shared>,
    name: Arc<str>,
    index: usize,
}

impl NameClaim {
    /// Claims `name` for slot `index`, or names the slot that holds it.
    fn take(shared: &Arc<Shared>, name: &str, index: usize) -> Result<Self, usize> {
        let mut linked = shared.linked.lock();
        match linked.get(name) {
            Some(&other) if other != index => Err(other),
            _ => {
                let name: Arc<str> = Arc::from(name);
                linked.insert(name.clone(), index);
                Ok(Self {
                    shared: shared.clone(),
                    name,
                    index,
                })
            }
        }
    }
}

impl Drop for NameClaim {
    fn drop(&mut self) {
        let mut linked = self.shared.linked.lock();
        if linked.get(&self.name) == Some(&self.index) {
            linked.remove(&self.name);
        }
    }
}

/// Handle to the running peer layer; cheap to clone.
#[derive(Clone)]
pub struct PeerHandle {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for PeerHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerHandle")
            .field("node", &self.shared.node_name)
            .field("cluster", &self.shared.cluster)
            .finish_non_exhaustive()
    }
}

fn spawn(shared: &Shared, fut: impl Future<Output = ()> + Send + 'static) {
    let h = tokio::spawn(fut);
    let mut tasks = shared.tasks.lock();
    tasks.retain(|t| !t.is_finished());
    tasks.push(h);
}

impl PeerHandle {
    /// Binds the endpoint and starts the link, accept and flush tasks.
    /// Must be called inside a tokio runtime.
    pub fn start(
        cfg: PeerConfig,
        tls: TlsSetup,
        source: Arc<dyn ChunkSource>,
    ) -> Result<Self, Error> {
        cfg.validate(tls.insecure)?;
        let socket = cfg
            .tuning
            .bind_socket(cfg.listen)
            .map_err(|e| Error::Transport(format!("bind {}: {e}", cfg.listen)))?;
        Self::start_on(cfg, tls, source, socket)
    }

    /// [`PeerHandle::start`] on a UDP socket bound beforehand (with
    /// [`TransportTuning::bind_socket`]), so that a caller can claim the
    /// port before doing costly work that a busy port would waste. The
    /// socket's own address replaces `cfg.listen` (validation included).
    /// Must be called inside a tokio runtime.
    pub fn start_on(
        mut cfg: PeerConfig,
        tls: TlsSetup,
        source: Arc<dyn ChunkSource>,
        socket: std::net::UdpSocket,
    ) -> Result<Self, Error> {
        cfg.listen = socket
            .local_addr()
            .map_err(|e| Error::Transport(format!("peer socket address: {e}")))?;
        cfg.validate(tls.insecure)?;
        // A seed listed twice would be two links to one peer, and two rows
        // (and duplicate metric series) for it.
        // Numeric addresses compare as addresses (`[::ffff:127.0.0.1]:P`
        // is `127.0.0.1:P`); names as written, whatever their case.
        let mut seen = std::collections::HashSet::new();
        cfg.peers.retain(|p| {
            let p = p.trim();
            let key = match p.parse::<SocketAddr>() {
                Ok(a) => SocketAddr::new(a.ip().to_canonical(), a.port()).to_string(),
                Err(_) => p.to_ascii_lowercase(),
            };
            let first = seen.insert(key);
            if !first {
                tracing::warn!(seed = %p, "peer listed twice in peers; the repeat is ignored");
            }
            first
        });
        let transport = Arc::new(
            cfg.tuning
                .transport_config(cfg.keep_alive, cfg.idle_timeout),
        );
        let server_crypto = QuicServerConfig::try_from(tls.server.clone())
            .map_err(|e| Error::Tls(format!("quic server config: {e}")))?;
        let mut server_cfg = quinn::ServerConfig::with_crypto(Arc::new(server_crypto));
        server_cfg.transport_config(transport.clone());
        let client_crypto = QuicClientConfig::try_from(tls.client.clone())
            .map_err(|e| Error::Tls(format!("quic client config: {e}")))?;
        let mut client_cfg = quinn::ClientConfig::new(Arc::new(client_crypto));
        client_cfg.transport_config(transport);
        let runtime =
            quinn::default_runtime().ok_or_else(|| Error::Transport("no tokio runtime".into()))?;
        let endpoint = quinn::Endpoint::new(
            cfg.tuning.endpoint_config(),
            Some(server_cfg),
            socket,
            runtime,
        )
        .map_err(|e| Error::Transport(format!("create endpoint: {e}")))?;
        let health = HealthConfig {
            ping_interval: cfg.ping_interval,
            suspect_after: cfg.suspect_after,
            down_after: cfg.down_after,
        };
        let slots = cfg
            .peers
            .iter()
            .enumerate()
            .map(|(index, seed)| {
                Arc::new(Slot {
                    index,
                    seed: seed.clone(),
                    name: RwLock::new(None),
                    conn: RwLock::new(None),
                    extra: RwLock::new(Vec::new()),
                    next_conn: AtomicUsize::new(0),
                    health: Mutex::new(PeerHealth::new(health)),
                    sync: Mutex::new(RemoteSync::new()),
                    namespaces: Mutex::new(Vec::new()),
                    is_self: AtomicBool::new(false),
                    alias_of: Mutex::new(None),
                    last_error: Mutex::new(None),
                    fetch_sem: Semaphore::new(cfg.max_fetches_per_peer as usize),
                    in_flight: AtomicU32::new(0),
                    bytes_fetched: AtomicU64::new(0),
                    fetches_ok: AtomicU64::new(0),
                    fetches_failed: AtomicU64::new(0),
                    connects: AtomicU64::new(0),
                    slow_until: Mutex::new(None),
                    progress: Mutex::new(None),
                })
            })
            .collect();
        let epoch: u64 = rand::thread_rng().r#gen();
        let (deltas, _) = broadcast::channel(1024);
        let directory = Directory::with_limit(cfg.max_chunks_per_peer);
        let shared = Arc::new(Shared {
            publisher: Mutex::new(Publisher::new(
                epoch,
                cfg.delta_max_batch,
                cfg.delta_max_delay,
            )),
            cfg,
            node_name: tls.node_name.clone(),
            cluster: tls.cluster.clone(),
            insecure: tls.insecure,
            endpoint,
            client_cfg,
            deltas,
            flush_now: Notify::new(),
            ns_version: watch::channel(0).0,
            directory,
            slots,
            source,
            served: Mutex::new(HashMap::new()),
            shutdown: watch::channel(false).0,
            tasks: Mutex::new(Vec::new()),
            corrupt_replies: AtomicU64::new(0),
            serves_in_flight: AtomicU32::new(0),
            draining: AtomicBool::new(false),
            linked: Mutex::new(HashMap::new()),
        });
        spawn(&shared, accept_loop(shared.clone()));
        spawn(&shared, flush_loop(shared.clone()));
        for slot in &shared.slots {
            spawn(&shared, link_loop(shared.clone(), slot.clone()));
        }
        tracing::info!(node = %shared.node_name, cluster = %shared.cluster, addr = ?shared.endpoint.local_addr().ok(), peers = shared.slots.len(), "peer layer started");
        Ok(Self { shared })
    }

    /// Address the endpoint is bound to.
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.shared.endpoint.local_addr()
    }

    /// Our node name.
    pub fn node_name(&self) -> &str {
        &self.shared.node_name
    }

    /// Our cluster id.
    pub fn cluster(&self) -> &str {
        &self.shared.cluster
    }

    /// Records that this node now holds `id`, in RAM (cheap; batched into
    /// deltas).
    pub fn local_added(&self, id: PeerChunkId, len: u64) {
        self.publish(|p, now| p.added(id, len, now));
    }

    /// Records that this node no longer holds `id`.
    pub fn local_removed(&self, id: PeerChunkId) {
        self.publish(|p, now| p.removed(id, now));
    }

    /// Records that this node's copy of `id` entered (`true`) or left its
    /// RAM (for the per-rank RAM prefix of peers' cluster lookups).
    pub fn local_ram(&self, id: PeerChunkId, in_ram: bool) {
        self.publish(|p, now| p.ram(id, in_ram, now));
    }

    fn publish(&self, f: impl FnOnce(&mut Publisher, Instant)) {
        let wake = {
            let mut p = self.shared.publisher.lock();
            f(&mut p, Instant::now());
            // Wake the flusher for the first change (it then sleeps until the
            // batch deadline) and for a full batch.
            p.batch_full() || p.pending() == 1
        };
        if wake {
            self.shared.flush_now.notify_one();
        }
    }

    /// Tells subscribers that the namespace records changed (they are
    /// re-read from the source and re-sent).
    pub fn namespaces_changed(&self) {
        self.shared.ns_version.send_modify(|v| *v += 1);
    }

    /// Up or suspect peers said to hold `id`, best first (RAM only).
    pub fn holders(&self, id: &PeerChunkId) -> Vec<PeerRef> {
        let mask = self.shared.directory.holders(id);
        self.refs(mask)
    }

    /// For each id, whether any up or suspect peer holds it (one lock).
    pub fn available(&self, ids: &[PeerChunkId]) -> Vec<bool> {
        let live = self.live_mask();
        self.shared
            .directory
            .holders_many(ids)
            .into_iter()
            .map(|m| m & live != 0)
            .collect()
    }

    /// How many of `ids` (in order, all of namespace `ns`) are in RAM on the
    /// live peers that publish `ns`'s namespace record (the nodes whose
    /// engine registered it): the longest such prefix over those peers.
    /// 0 when no live peer publishes it. From the directory; no RPC.
    pub fn ram_prefix(&self, ns: PeerNamespace, ids: &[PeerChunkId]) -> usize {
        let now = Instant::now();
        self.shared
            .slots
            .iter()
            .filter(|s| {
                s.health.lock().state(now) != PeerState::Down
                    && !s.cooling(now)
                    && s.namespaces.lock().iter().any(|(n, _)| *n == ns)
            })
            .map(|s| self.shared.directory.ram_prefix(s.index, ids))
            .max()
            .unwrap_or(0)
    }

    fn live_mask(&self) -> u32 {
        let now = Instant::now();
        let mut m = 0u32;
        for s in &self.shared.slots {
            if s.health.lock().state(now) != PeerState::Down && !s.cooling(now) {
                m |= 1 << s.index;
            }
        }
        m
    }

    fn refs(&self, mask: u32) -> Vec<PeerRef> {
        if mask == 0 {
            return Vec::new();
        }
        let now = Instant::now();
        let mut v: Vec<(PeerRef, (bool, Duration, u32))> = Vec::new();
        for s in &self.shared.slots {
            if mask & (1 << s.index) == 0 {
                continue;
            }
            let state = s.health.lock().state(now);
            if state == PeerState::Down || s.cooling(now) {
                continue;
            }
            let Some(name) = s.name.read().clone() else {
                continue;
            };
            let rtt = s
                .conn
                .read()
                .as_ref()
                .map_or(Duration::MAX, Connection::rtt);
            let key = (
                state != PeerState::Up,
                rtt,
                s.in_flight.load(Ordering::Relaxed),
            );
            v.push((
                PeerRef {
                    slot: s.index as u16,
                    name,
                    state,
                },
                key,
            ));
        }
        v.sort_by_key(|a| a.1);
        v.into_iter().map(|(r, _)| r).collect()
    }

    /// Fetches `id` from the best holder, with one retry on another holder;
    /// the whole call ends within `timeout`. The bytes are verified (id,
    /// length, payload CRC32C) before they are returned.
    pub async fn fetch(&self, id: &PeerChunkId, timeout: Duration) -> Result<Bytes, FetchError> {
        if *self.shared.shutdown.borrow() {
            return Err(FetchError::ShuttingDown);
        }
        // A timeout too long to add is as good as none (a far deadline).
        let now = tokio::time::Instant::now();
        let deadline = now
            .checked_add(timeout)
            .unwrap_or_else(|| now + MAX_PEER_DURATION);
        // Peers in cooldown are left out (see SLOW_PEER_COOLDOWN): with no
        // other holder, a miss at once.
        let holders = self.holders(id);
        if holders.is_empty() {
            return Err(FetchError::NoHolder);
        }
        let mut last = FetchError::NoHolder;
        for h in holders.iter().take(2) {
            let slot = self.shared.slots[h.slot as usize].clone();
            let asked = Instant::now();
            // A guard, not an add and a sub around the await: a fetch
            // whose future is dropped (its client hung up, a shutdown)
            // must not stay counted, or the holder order would shun this
            // peer for good.
            let counted = InFlight::new(&slot.in_flight);
            let r = tokio::time::timeout_at(deadline, fetch_from(&self.shared, &slot, id)).await;
            drop(counted);
            match r {
                Ok(Ok(b)) => {
                    *slot.slow_until.lock() = None;
                    slot.fetches_ok.fetch_add(1, Ordering::Relaxed);
                    slot.bytes_fetched
                        .fetch_add(b.len() as u64, Ordering::Relaxed);
                    return Ok(b);
                }
                Ok(Err(e)) => {
                    slot.fetches_failed.fetch_add(1, Ordering::Relaxed);
                    if matches!(e, FetchError::Corrupt { .. }) {
                        self.shared.corrupt_replies.fetch_add(1, Ordering::Relaxed);
                        // A peer with a broken path or software fails every
                        // fetch: once per peer at warn, then at debug.
                        if crate::logonce::warn_now(format!("corrupt|{}", h.name)) {
                            tracing::warn!(peer = %h.name, error = %e,
                                "corrupt reply from a peer (served as a miss; repeats from it are logged at debug)");
                        } else {
                            tracing::debug!(peer = %h.name, error = %e, "corrupt reply from a peer");
                        }
                    } else {
                        tracing::debug!(peer = %h.name, error = %e, "peer fetch failed");
                    }
                    last = e;
                }
                Err(_) => {
                    slot.fetches_failed.fetch_add(1, Ordering::Relaxed);
                    // Blamed only when it sent nothing on any fetch for at
                    // least half the timeout (not a first holder's leftover
                    // time): a hung peer, not a busy one.
                    let now = Instant::now();
                    let fair = now.saturating_duration_since(asked) >= timeout / 2;
                    if fair && !slot.progressed_since(asked) {
                        let until = now + SLOW_PEER_COOLDOWN;
                        if slot
                            .slow_until
                            .lock()
                            .replace(until)
                            .is_none_or(|t| t <= now)
                        {
                            tracing::warn!(peer = %h.name, after = ?timeout, cooldown = ?SLOW_PEER_COOLDOWN,
                                "a fetch from a peer timed out with nothing received from it; \
                                 it is skipped for the cooldown");
                        }
                    }
                    return Err(FetchError::Timeout {
                        peer: h.name.to_string(),
                        after: timeout,
                    });
                }
            }
        }
        Err(last)
    }

    /// Replies that failed verification so far (each a miss; the first
    /// from each peer is logged at warn, see [`crate::logonce`]).
    pub fn corrupt_replies(&self) -> u64 {
        self.shared.corrupt_replies.load(Ordering::Relaxed)
    }

    /// Status of every configured peer (our own seed entry excluded).
    pub fn peers(&self) -> Vec<PeerStatus> {
        let now = Instant::now();
        let served = self.shared.served.lock();
        self.shared
            .slots
            .iter()
            .filter(|s| !s.is_self.load(Ordering::Relaxed) && s.alias_of.lock().is_none())
            .map(|s| {
                let name = s.name.read().as_deref().map(str::to_owned);
                let state = s.health.lock().state(now);
                let rtt = s.conn.read().as_ref().map(|c| c.rtt().as_micros() as u64);
                let t = self.shared.directory.totals(s.index);
                let sync = s.sync.lock();
                let bytes_served = name
                    .as_ref()
                    .and_then(|n| served.get(n))
                    .map_or(0, |st| st.bytes.load(Ordering::Relaxed));
                PeerStatus {
                    name,
                    addr: s.seed.clone(),
                    state,
                    rtt_us: rtt,
                    chunks: t.chunks,
                    bytes: t.bytes,
                    synced: sync.is_synced(),
                    last_sync_age_ms: sync
                        .last_activity()
                        .map(|a| now.saturating_duration_since(a).as_millis() as u64),
                    bytes_fetched: s.bytes_fetched.load(Ordering::Relaxed),
                    bytes_served,
                    fetches_ok: s.fetches_ok.load(Ordering::Relaxed),
                    fetches_failed: s.fetches_failed.load(Ordering::Relaxed),
                    fetches_in_flight: s.in_flight.load(Ordering::Relaxed),
                    connects: s.connects.load(Ordering::Relaxed),
                    connections: s.conn.read().as_ref().map_or(0, |_| {
                        let live = s
                            .extra
                            .read()
                            .iter()
                            .filter(|c| c.close_reason().is_none())
                            .count();
                        1 + live as u32
                    }),
                    resyncs: sync.gaps(),
                    last_error: s.last_error.lock().clone(),
                }
            })
            .collect()
    }

    /// Payload bytes served to nodes that are not among our peers (a node
    /// whose seed list names us while ours does not name it), by name.
    /// `connected_only`: only those connected now, for a list of who dials
    /// this node (a name seen once, such as the one a node at a peer's
    /// address showed before it changed, stayed listed for good: QA);
    /// counters over time want them all.
    pub fn served_unlisted(&self, connected_only: bool) -> Vec<(String, u64)> {
        let listed: std::collections::HashSet<String> = self
            .shared
            .slots
            .iter()
            .filter_map(|s| s.name.read().as_deref().map(str::to_owned))
            .collect();
        // A seed not linked yet has no name: a node that dials from a seed's
        // address is listed all the same (QA: listed peers showed as "not
        // in peers" while this node's own dials waited to retry).
        let canonical =
            |a: std::net::SocketAddr| std::net::SocketAddr::new(a.ip().to_canonical(), a.port());
        let seeds: std::collections::HashSet<std::net::SocketAddr> = self
            .shared
            .slots
            .iter()
            .filter_map(|s| s.seed.parse().ok())
            .map(canonical)
            .collect();
        let mut out: Vec<(String, u64)> = self
            .shared
            .served
            .lock()
            .iter()
            .filter(|(n, st)| {
                let conns = st.conns.lock();
                !listed.contains(*n)
                    && **n != self.shared.node_name
                    && (!connected_only || !conns.is_empty())
                    && !conns
                        .iter()
                        .any(|c| seeds.contains(&canonical(c.remote_address())))
            })
            .map(|(n, st)| (n.clone(), st.bytes.load(Ordering::Relaxed)))
            .collect();
        out.sort();
        out
    }

    /// Namespace records peers published: (peer name, namespace, record).
    pub fn namespace_records(&self) -> Vec<(String, PeerNamespace, Vec<u8>)> {
        let mut out = Vec::new();
        for s in &self.shared.slots {
            let label = s.label();
            for (ns, rec) in s.namespaces.lock().iter() {
                out.push((label.clone(), *ns, rec.clone()));
            }
        }
        out
    }

    /// Chunk counts per namespace per peer: (peer name, namespace, chunks).
    pub fn namespace_counts(&self) -> Vec<(String, PeerNamespace, u64)> {
        let mut out = Vec::new();
        for s in &self.shared.slots {
            let label = s.label();
            for (ns, n) in self.shared.directory.namespaces(s.index) {
                out.push((label.clone(), ns, n));
            }
        }
        out
    }

    /// QUIC connections open on this endpoint (inbound and outbound).
    pub fn open_connections(&self) -> usize {
        self.shared.endpoint.open_connections()
    }

    /// Distinct remote chunk ids tracked, and the index's table bytes.
    pub fn directory_size(&self) -> (usize, usize) {
        (
            self.shared.directory.len(),
            self.shared.directory.table_bytes(),
        )
    }

    /// Closes every connection and waits (up to `grace`) for all tasks.
    pub async fn shutdown(&self, grace: Duration) {
        // Fetch replies in flight finish first, for up to half the grace
        // (QA: a clean stop of a holder cut the replies it was sending, and
        // its peers' GETs of them missed); new fetches are turned away.
        self.shared.draining.store(true, Ordering::SeqCst);
        let deadline = tokio::time::Instant::now() + grace;
        let drain_until = tokio::time::Instant::now() + grace / 2;
        while self.shared.serves_in_flight.load(Ordering::SeqCst) > 0
            && tokio::time::Instant::now() < drain_until
        {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        self.shared.shutdown.send_replace(true);
        self.shared.endpoint.close(VarInt::from_u32(0), b"shutdown");
        let tasks: Vec<_> = std::mem::take(&mut *self.shared.tasks.lock());
        for t in tasks {
            let abort = t.abort_handle();
            if tokio::time::timeout_at(deadline, t).await.is_err() {
                abort.abort();
            }
        }
        let _ = tokio::time::timeout_at(deadline, self.shared.endpoint.wait_idle()).await;
    }
}

// ---------------------------------------------------------------------------
// framing over quinn streams

#[derive(Debug)]
enum StreamErr {
    Closed,
    Io(String),
    Decode(crate::proto::DecodeError),
}

impl std::fmt::Display for StreamErr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Closed => f.write_str("stream closed"),
            Self::Io(e) => f.write_str(e),
            Self::Decode(e) => write!(f, "bad frame: {e}"),
        }
    }
}

/// How long a frame's body may take to arrive once its header has.
const FRAME_BODY_TIMEOUT: Duration = Duration::from_secs(10);

async fn read_frame(recv: &mut RecvStream) -> Result<Message, StreamErr> {
    read_frame_within(recv, crate::proto::frame::MAX_BODY).await
}

/// The largest body of a stream's first frame (a fetch request or a hello,
/// at most 520 bytes) and of a fetch reply: a peer could otherwise make
/// every new stream buffer up to 16 MiB for the body deadline (QA: 120
/// streams took a holder from 42 to 740 MB resident).
const SMALL_FRAME_MAX: u32 = 1 << 10;

/// [`read_frame`] of a frame whose body is at most `max_body` bytes.
async fn read_frame_within(recv: &mut RecvStream, max_body: u32) -> Result<Message, StreamErr> {
    let mut header = [0u8; HEADER_LEN];
    match recv.read_exact(&mut header).await {
        Ok(()) => {}
        Err(quinn::ReadExactError::FinishedEarly(0)) => return Err(StreamErr::Closed),
        Err(e) => return Err(StreamErr::Io(e.to_string())),
    }
    let h = FrameHeader::decode(&header).map_err(StreamErr::Decode)?;
    if h.body_len > max_body {
        return Err(StreamErr::Decode(crate::proto::DecodeError::TooLong {
            len: u64::from(h.body_len),
            max: u64::from(max_body),
        }));
    }
    // The body is taken as it arrives, within a deadline: a peer that
    // announced 16 MiB bodies on many streams and sent none (or all but a
    // byte) held that memory for as long as its connection lived.
    let want = h.body_len as usize;
    let mut body = Vec::with_capacity(want.min(64 << 10));
    let fill = async {
        while body.len() < want {
            match recv.read_chunk(want - body.len(), true).await {
                Ok(Some(c)) => body.extend_from_slice(&c.bytes),
                Ok(None) => return Err(StreamErr::Io("stream ended inside a frame".into())),
                Err(e) => return Err(StreamErr::Io(e.to_string())),
            }
        }
        Ok(())
    };
    tokio::time::timeout(FRAME_BODY_TIMEOUT, fill)
        .await
        .map_err(|_| {
            StreamErr::Io(format!(
                "a frame body of {want} bytes did not arrive within {FRAME_BODY_TIMEOUT:?}"
            ))
        })??;
    h.check_body(&header, &body).map_err(StreamErr::Decode)?;
    Message::decode_body(h.kind, &body).map_err(StreamErr::Decode)
}

async fn write_msg(send: &mut SendStream, m: &Message) -> Result<(), StreamErr> {
    send.write_all(&frame::encode(m))
        .await
        .map_err(|e| StreamErr::Io(e.to_string()))
}

/// Reads frames into a channel so the owner can `select!` on them (reading
/// a frame is not cancel-safe).
fn frame_reader(
    mut recv: RecvStream,
) -> (mpsc::Receiver<Result<Message, StreamErr>>, JoinHandle<()>) {
    let (tx, rx) = mpsc::channel(64);
    let h = tokio::spawn(async move {
        loop {
            let r = read_frame(&mut recv).await;
            let stop = r.is_err();
            if tx.send(r).await.is_err() || stop {
                break;
            }
        }
    });
    (rx, h)
}

// ---------------------------------------------------------------------------
// publisher side

async fn flush_loop(shared: Arc<Shared>) {
    let mut shutdown = shared.shutdown.subscribe();
    let far = Duration::from_secs(3600);
    loop {
        let deadline = shared.publisher.lock().deadline();
        let sleep_until = deadline.map_or_else(
            || tokio::time::Instant::now() + far,
            tokio::time::Instant::from_std,
        );
        tokio::select! {
            _ = shared.flush_now.notified() => {}
            _ = tokio::time::sleep_until(sleep_until) => {}
            _ = shutdown.changed() => return,
        }
        let now = Instant::now();
        let mut p = shared.publisher.lock();
        while let Some(d) = p.poll_delta(now) {
            // Sent under the lock so the channel order is the seq order.
            let _ = shared.deltas.send(Bytes::from(frame::encode(&d)));
        }
    }
}

/// Subscribes to deltas at a consistent point: returns the receiver and the
/// `(epoch, seq)` a snapshot taken now must carry.
fn subscribe(shared: &Shared) -> (broadcast::Receiver<Bytes>, u64, u64) {
    let mut p = shared.publisher.lock();
    if let Some(d) = p.flush() {
        let _ = shared.deltas.send(Bytes::from(frame::encode(&d)));
    }
    (shared.deltas.subscribe(), p.epoch(), p.seq())
}

async fn send_snapshot(
    shared: &Arc<Shared>,
    send: &mut SendStream,
) -> Result<broadcast::Receiver<Bytes>, StreamErr> {
    let (rx, epoch, seq) = subscribe(shared);
    let src = shared.source.clone();
    let entries = tokio::task::spawn_blocking(move || src.snapshot())
        .await
        .map_err(|e| StreamErr::Io(format!("snapshot task: {e}")))?;
    for m in snapshot_messages(epoch, seq, entries) {
        write_msg(send, &m).await?;
    }
    Ok(rx)
}

async fn send_namespaces(shared: &Arc<Shared>, send: &mut SendStream) -> Result<(), StreamErr> {
    let src = shared.source.clone();
    let records = tokio::task::spawn_blocking(move || src.namespace_records())
        .await
        .map_err(|e| StreamErr::Io(format!("namespace task: {e}")))?;
    write_msg(send, &Message::Namespaces { records }).await
}

async fn accept_loop(shared: Arc<Shared>) {
    let mut shutdown = shared.shutdown.subscribe();
    loop {
        let incoming = tokio::select! {
            i = shared.endpoint.accept() => i,
            _ = shutdown.changed() => return,
        };
        let Some(incoming) = incoming else { return };
        let s2 = shared.clone();
        spawn(&shared, async move {
            let remote = incoming.remote_address();
            let conn = match tokio::time::timeout(s2.cfg.connect_timeout, incoming).await {
                Ok(Ok(c)) => c,
                Ok(Err(e)) => {
                    if crate::logonce::warn_now(format!(
                        "inbound|{}|{}",
                        remote.ip(),
                        crate::logonce::shape(&e.to_string())
                    )) {
                        tracing::warn!(%remote, error = %e,
                            "inbound peer handshake failed (repeats are logged at debug)");
                    } else {
                        tracing::debug!(%remote, error = %e, "inbound peer handshake failed");
                    }
                    return;
                }
                Err(_) => {
                    tracing::warn!(%remote, "inbound peer handshake timed out");
                    return;
                }
            };
            serve_conn(s2, conn).await;
        });
    }
}

fn conn_name(conn: &Connection) -> Option<String> {
    let any = conn.peer_identity()?;
    let chain = any
        .downcast::<Vec<rustls::pki_types::CertificateDer<'static>>>()
        .ok()?;
    peer_node_name(&chain)
}

async fn serve_conn(shared: Arc<Shared>, conn: Connection) {
    let cert_name = conn_name(&conn);
    let remote = conn.remote_address();
    let label = cert_name.clone().unwrap_or_else(|| remote.to_string());
    let stats = shared
        .served
        .lock()
        .entry(label.clone())
        .or_insert_with(|| {
            Arc::new(ServeStats {
                bytes: AtomicU64::new(0),
                limiter: RateLimiter::new(shared.cfg.serve_rate_limit),
                turn: tokio::sync::Mutex::new(()),
                serving: Semaphore::new(2 * shared.cfg.max_fetches_per_peer as usize),
                control: Arc::new(Semaphore::new(MAX_CONTROL_STREAMS)),
                conns: Mutex::new(VecDeque::new()),
            })
        })
        .clone();
    // Each connection may buffer up to `conn_window` bytes its streams sent
    // and nobody read (64 MiB by default), so one peer's connections are
    // bounded, like its subscriptions and serves. The oldest goes: a peer
    // that reconnected while its old connections linger keeps its new ones.
    let (_entry, evicted) = stats.admit_conn(&conn);
    if evicted.is_some() {
        if crate::logonce::warn_now(format!("conns|{label}")) {
            tracing::warn!(peer = %label, most = MAX_CONNECTIONS_PER_PEER,
                "closed a peer's oldest connection to admit a new one (repeats are logged at debug)");
        } else {
            tracing::debug!(peer = %label, "closed a peer's oldest connection");
        }
    }
    let mut shutdown = shared.shutdown.subscribe();
    // The connection's streams end with it: when it closes, or at a
    // shutdown, those still serving are aborted and waited for (a blocking
    // read a source already started finishes on its own thread; its result
    // goes nowhere).
    let mut streams = tokio::task::JoinSet::new();
    loop {
        let (send, recv) = tokio::select! {
            r = conn.accept_bi() => match r {
                Ok(s) => s,
                Err(e) => {
                    tracing::debug!(peer = %label, error = %e, "inbound peer connection ended");
                    break;
                }
            },
            Some(_) = streams.join_next(), if !streams.is_empty() => continue,
            _ = shutdown.changed() => break,
        };
        let s2 = shared.clone();
        let st = stats.clone();
        let cn = cert_name.clone();
        let lb = label.clone();
        streams.spawn(async move {
            if let Err(e) = serve_stream(s2, send, recv, cn, st).await {
                tracing::debug!(peer = %lb, error = %e, "peer stream ended");
            }
        });
    }
    streams.shutdown().await;
}

async fn serve_stream(
    shared: Arc<Shared>,
    mut send: SendStream,
    mut recv: RecvStream,
    cert_name: Option<String>,
    stats: Arc<ServeStats>,
) -> Result<(), StreamErr> {
    let first = tokio::time::timeout(
        shared.cfg.connect_timeout,
        read_frame_within(&mut recv, SMALL_FRAME_MAX),
    )
    .await
    .map_err(|_| StreamErr::Io("no request within the timeout".into()))??;
    match first {
        Message::FetchRequest { id } => serve_fetch(&shared, send, id, &stats).await,
        Message::Hello {
            node_name,
            cluster,
            epoch: their_epoch,
        } => {
            if cluster != shared.cluster {
                tracing::warn!(peer = %node_name, %cluster, "refused hello from another cluster");
                return Err(StreamErr::Io("cluster mismatch".into()));
            }
            if !shared.insecure && cert_name.as_deref() != Some(node_name.as_str()) {
                tracing::warn!(peer = %node_name, cert = ?cert_name, "refused hello: name differs from certificate");
                return Err(StreamErr::Io("name mismatch".into()));
            }
            // A peer subscribes once per link (its old connection's
            // subscription may linger a moment after it reconnects): each
            // costs a snapshot of every id and a delta feed, so more than a
            // few at once, over all its connections, are refused.
            let _subscription = Arc::clone(&stats.control)
                .try_acquire_owned()
                .map_err(|_| {
                    if crate::logonce::warn_now(format!("control|{node_name}")) {
                        tracing::warn!(peer = %node_name, most = MAX_CONTROL_STREAMS,
                        "refused a peer's extra subscription");
                    }
                    StreamErr::Io("too many subscriptions from one peer".into())
                })?;
            let epoch = shared.publisher.lock().epoch();
            write_msg(
                &mut send,
                &Message::Hello {
                    node_name: shared.node_name.clone(),
                    cluster: shared.cluster.clone(),
                    epoch,
                },
            )
            .await?;
            if node_name == shared.node_name && their_epoch == epoch {
                // This node dialled itself: no subscription (a snapshot).
                let _ = send.finish();
                return Ok(());
            }
            serve_control(shared, send, recv).await
        }
        other => Err(StreamErr::Io(format!(
            "unexpected first message kind {}",
            other.kind()
        ))),
    }
}

/// How long a link dropped for announcing more than `max-chunks-per-peer`
/// chunks waits before it is dialed again.
const OVER_LIMIT_RETRY: Duration = Duration::from_secs(60);

/// Subscriptions (control streams) one peer may hold at once, over all its
/// connections.
const MAX_CONTROL_STREAMS: usize = 4;

/// Inbound connections one peer may hold at once: twice the most a link
/// dials ([`MAX_FETCH_CONNECTIONS`]), so a link being re-made while its old
/// connections close fits.
pub const MAX_CONNECTIONS_PER_PEER: usize = 2 * MAX_FETCH_CONNECTIONS as usize;

/// QUIC application close code of a peer's oldest connection, closed to
/// admit a new one past [`MAX_CONNECTIONS_PER_PEER`].
pub const CLOSE_TOO_MANY_CONNECTIONS: VarInt = VarInt::from_u32(0x4b01);

/// Least time between two snapshots a subscriber's `Resync` asks for (each
/// is a walk of every id and a copy of them all to the peer).
const RESYNC_INTERVAL: Duration = Duration::from_secs(1);

async fn serve_control(
    shared: Arc<Shared>,
    mut send: SendStream,
    recv: RecvStream,
) -> Result<(), StreamErr> {
    let (mut frames, reader) = frame_reader(recv);
    let _reader = AbortOnDrop(reader);
    let mut shutdown = shared.shutdown.subscribe();
    let mut ns_rx = shared.ns_version.subscribe();
    ns_rx.borrow_and_update();
    send_namespaces(&shared, &mut send).await?;
    let mut deltas = send_snapshot(&shared, &mut send).await?;
    let mut last_snapshot = tokio::time::Instant::now();
    // An asked-for snapshot is sent once RESYNC_INTERVAL has passed since
    // the last one; pings and deltas go on meanwhile.
    let mut resync_at: Option<tokio::time::Instant> = None;
    loop {
        tokio::select! {
            d = deltas.recv() => match d {
                Ok(f) => send.write_chunk(f).await.map_err(|e| StreamErr::Io(e.to_string()))?,
                Err(broadcast::error::RecvError::Lagged(n)) => {
                    tracing::info!(lagged = n, "peer subscriber lagged; sending a new snapshot");
                    deltas = send_snapshot(&shared, &mut send).await?;
                    (last_snapshot, resync_at) = (tokio::time::Instant::now(), None);
                }
                Err(broadcast::error::RecvError::Closed) => return Ok(()),
            },
            m = frames.recv() => match m {
                Some(Ok(Message::Ping { nonce })) => write_msg(&mut send, &Message::Pong { nonce }).await?,
                Some(Ok(Message::Resync)) => {
                    // At most one asked-for snapshot per RESYNC_INTERVAL: a
                    // peer looping Resync got a whole snapshot per 16-byte
                    // frame (50 frames: 59 MB back, and as many index walks).
                    // Sent by the timer arm below (at once when it is due).
                    resync_at = Some(last_snapshot + RESYNC_INTERVAL);
                }
                Some(Ok(_)) => {}
                Some(Err(e)) => return Err(e),
                None => return Ok(()),
            },
            () = tokio::time::sleep_until(resync_at.unwrap_or(last_snapshot)), if resync_at.is_some() => {
                deltas = send_snapshot(&shared, &mut send).await?;
                (last_snapshot, resync_at) = (tokio::time::Instant::now(), None);
            }
            r = ns_rx.changed() => {
                if r.is_ok() {
                    send_namespaces(&shared, &mut send).await?;
                }
            }
            _ = shutdown.changed() => return Ok(()),
        }
    }
}

async fn serve_fetch(
    shared: &Arc<Shared>,
    mut send: SendStream,
    id: PeerChunkId,
    stats: &ServeStats,
) -> Result<(), StreamErr> {
    let limiter = &stats.limiter;
    let reply = |status, len, crc| Message::FetchReply {
        status,
        id,
        len,
        crc,
    };
    // Counted before the drain flag is read: a shutdown that set it either
    // sees this reply in flight or this reply sees the flag (review).
    let in_flight = InFlight::new(&shared.serves_in_flight);
    let serving = match stats.serving.try_acquire() {
        Ok(permit) if !shared.draining.load(Ordering::SeqCst) => permit,
        _ => {
            drop(in_flight);
            write_msg(&mut send, &reply(FetchStatus::Busy, 0, 0)).await?;
            let _ = send.finish();
            return Ok(());
        }
    };
    // Under a serve rate, replies to one peer go one at a time in arrival
    // order: interleaved piece by piece, up to 16 of them shared the rate
    // and all finished late together, past the requester's timeout (the
    // goodput fell to a few % of the rate). A requester that gave up (its
    // stream stopped) is skipped, in the queue or mid-reply, so its share
    // goes to the next one.
    let stopped = send.stopped();
    tokio::pin!(stopped);
    // A requester that left is seen first: it neither takes the turn from
    // one still waiting nor has a chunk read for it.
    let turn = if limiter.limited() {
        tokio::select! {
            biased;
            _ = &mut stopped => return Ok(()),
            t = stats.turn.lock() => Some(t),
        }
    } else {
        None
    };
    let got = tokio::select! {
        biased;
        _ = &mut stopped => return Ok(()),
        got = shared.source.read(&id) => got,
    };
    let Some(chunk) = got else {
        write_msg(&mut send, &reply(FetchStatus::NotFound, 0, 0)).await?;
        let _ = send.finish();
        return Ok(());
    };
    let len = chunk.payload.len() as u64;
    if limiter.limited() {
        // The turn is held for at most twice the reply's time at the rate,
        // plus 10 s: a requester that neither reads nor stops its stream
        // would hold it (and every later fetch of that peer) for good.
        let most = Duration::from_secs_f64(2.0 * len as f64 / limiter.rate as f64)
            + Duration::from_secs(10);
        let send_all = async {
            write_msg(&mut send, &reply(FetchStatus::Ok, len, chunk.crc)).await?;
            let mut rest = chunk.payload;
            while !rest.is_empty() {
                let piece = rest.split_to(rest.len().min(256 << 10));
                let debit = limiter.acquire(piece.len() as u64).await;
                send.write_chunk(piece)
                    .await
                    .map_err(|e| StreamErr::Io(e.to_string()))?;
                debit.spent();
            }
            Ok::<(), StreamErr>(())
        };
        tokio::select! {
            r = tokio::time::timeout(most, send_all) => match r {
                Ok(r) => r?,
                Err(_) => {
                    let _ = send.reset(VarInt::from_u32(0));
                    return Err(StreamErr::Io(format!("reply not taken within {most:?}")));
                }
            },
            _ = &mut stopped => return Ok(()),
        }
    } else {
        write_msg(&mut send, &reply(FetchStatus::Ok, len, chunk.crc)).await?;
        send.write_chunk(chunk.payload)
            .await
            .map_err(|e| StreamErr::Io(e.to_string()))?;
    }
    let _ = send.finish();
    stats.bytes.fetch_add(len, Ordering::Relaxed);
    // In flight until the requester has every byte (its acknowledgement
    // ends `stopped`): a shutdown closing the endpoint before then would
    // drop what is still unsent or unacknowledged. The serve slot goes now.
    drop(serving);
    drop(turn);
    let _ = tokio::time::timeout(DELIVERY_WAIT, stopped).await;
    Ok(())
}

/// How long a served reply may wait for its requester's acknowledgement
/// of the last byte (counted in flight meanwhile).
const DELIVERY_WAIT: Duration = Duration::from_secs(5);

/// Token bucket for bytes served to one peer (burst: one second).
struct RateLimiter {
    rate: u64,
    // parking_lot: a few arithmetic ops; the wait happens outside the lock.
    state: Mutex<(f64, Instant)>,
}

impl RateLimiter {
    fn new(rate: u64) -> Self {
        Self {
            rate,
            state: Mutex::new((rate as f64, Instant::now())),
        }
    }

    fn limited(&self) -> bool {
        self.rate > 0
    }

    /// Takes `n` bytes from the bucket, waiting while it is in debt. The
    /// bytes go back if the returned [`Debit`] is dropped before
    /// [`Debit::spent`] (or this future before it returns): a reply cut
    /// short by its requester must not delay the next one.
    async fn acquire(&self, n: u64) -> Debit<'_> {
        let wait = {
            let mut s = self.state.lock();
            let now = Instant::now();
            let rate = self.rate as f64;
            s.0 = (s.0 + now.saturating_duration_since(s.1).as_secs_f64() * rate).min(rate);
            s.1 = now;
            s.0 -= n as f64;
            if s.0 >= 0.0 {
                Duration::ZERO
            } else {
                Duration::from_secs_f64(-s.0 / rate)
            }
        };
        let debit = Debit {
            limiter: self,
            n,
            spent: false,
        };
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
        debit
    }

    /// Tokens in the bucket now (tests).
    #[cfg(test)]
    fn tokens(&self) -> f64 {
        self.state.lock().0
    }
}

/// Bytes taken from a [`RateLimiter`]; refunded when dropped unspent.
struct Debit<'a> {
    limiter: &'a RateLimiter,
    n: u64,
    spent: bool,
}

impl Debit<'_> {
    /// The bytes went out: the debit stands.
    fn spent(mut self) {
        self.spent = true;
    }
}

impl Drop for Debit<'_> {
    fn drop(&mut self) {
        if !self.spent {
            let mut s = self.limiter.state.lock();
            s.0 = (s.0 + self.n as f64).min(self.limiter.rate as f64);
        }
    }
}

struct AbortOnDrop(JoinHandle<()>);

impl AbortOnDrop {
    /// Aborts the task and waits until it is gone: an abort alone lets a
    /// task that is running on another worker finish its current step.
    async fn stop(mut self) {
        self.0.abort();
        let _ = (&mut self.0).await;
    }
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

// ---------------------------------------------------------------------------
// subscriber side: one outbound link per seed

async fn link_loop(shared: Arc<Shared>, slot: Arc<Slot>) {
    let mut shutdown = shared.shutdown.subscribe();
    let mut backoff = Backoff::new(shared.cfg.backoff_base, shared.cfg.backoff_max);
    // The failure last logged at warn: a new one (the first after a link,
    // or another reason) is logged at warn, repeats at debug.
    let mut warned: Option<String> = None;
    loop {
        if *shutdown.borrow() {
            return;
        }
        match connect(&shared, &slot).await {
            Ok(Dialed::Link((conn, send, recv, claim))) => {
                backoff.reset();
                warned = None;
                *slot.last_error.lock() = None;
                *slot.alias_of.lock() = None;
                slot.is_self.store(false, Ordering::Relaxed);
                let extras = (shared.cfg.fetch_connections > 1).then(|| {
                    AbortOnDrop(tokio::spawn(dial_extra(
                        shared.clone(),
                        slot.clone(),
                        conn.remote_address(),
                    )))
                });
                let over_limit = run_link(&shared, &slot, &conn, send, recv).await;
                // Gone before the fetch connections are closed: a dial that
                // was finishing could add one after, which then outlived
                // this link (and was counted in `connections`).
                if let Some(extras) = extras {
                    extras.stop().await;
                }
                for c in std::mem::take(&mut *slot.extra.write()) {
                    c.close(VarInt::from_u32(0), b"link closed");
                }
                conn.close(VarInt::from_u32(0), b"link closed");
                *slot.conn.write() = None;
                slot.health.lock().on_disconnected();
                slot.sync.lock().reset();
                shared.directory.clear_slot(slot.index);
                drop(claim);
                if let Some((old, new)) = slot.health.lock().poll_transition(Instant::now()) {
                    tracing::warn!(peer = %slot.label(), from = old.as_str(), to = new.as_str(), "peer state");
                }
                if over_limit {
                    // Dialed again at once, it would send the same snapshot
                    // (its every id, walked and copied) to be refused again.
                    tokio::select! {
                        _ = tokio::time::sleep(OVER_LIMIT_RETRY) => {}
                        _ = shutdown.changed() => return,
                    }
                }
            }
            Ok(Dialed::Itself) => {
                slot.is_self.store(true, Ordering::Relaxed);
                return;
            }
            Ok(Dialed::Reflected) => {
                if warned.as_deref() != Some("reflected") {
                    tracing::warn!(seed = %slot.seed,
                        "this seed reaches this node itself, but it is not this node's listen \
                         address (a port forward or NAT to it, or something reflecting its \
                         packets); hidden, and dialled again now and then in case another node \
                         answers there");
                    warned = Some("reflected".into());
                }
                *slot.last_error.lock() = None;
                slot.is_self.store(true, Ordering::Relaxed);
            }
            Ok(Dialed::Alias { other, name })
                if slot.name.read().as_deref().is_some_and(|mine| mine != name) =>
            {
                // This seed's node was another one: the node answering here
                // now shows the certificate of a node another seed links to
                // (a copied certificate). A failure of this seed's own row,
                // not an alias (QA: the node vanished from the list).
                let mine = slot.label();
                let e = format!(
                    "the node at this seed, last {mine:?}, now presents the certificate of {name:?}, \
                     which seed {other} links to: two nodes share a certificate?"
                );
                *slot.alias_of.lock() = None;
                connect_failed(&slot, &mut warned, backoff.attempts(), e);
            }
            Ok(Dialed::Alias { other, name }) => {
                // Said at warn once per other seed and name, then at debug
                // on every later dial while it stays so.
                let why = format!("alias of {other} ({name})");
                if warned.as_deref() != Some(why.as_str()) {
                    tracing::warn!(seed = %slot.seed, %other, %name,
                        "this seed reaches a peer another seed already links to; it is skipped \
                         while that link lasts");
                    warned = Some(why);
                } else {
                    tracing::debug!(seed = %slot.seed, %other, %name, "seed still reaches a linked peer");
                }
                *slot.last_error.lock() = None;
                *slot.alias_of.lock() = Some(Arc::from(name.as_str()));
            }
            Err(e) => {
                // An alias stays hidden while another seed's row stands for
                // its node, linked or not (a node that is down is one down
                // row, not one per spelling of its address); with no such
                // row its failure shows as its own.
                let aliased = slot.alias_of.lock().clone();
                if let Some(n) = aliased {
                    let shown = shared.slots.iter().any(|o| {
                        o.index != slot.index
                            && o.alias_of.lock().is_none()
                            && o.name.read().as_deref() == Some(&*n)
                    });
                    if !shown {
                        *slot.alias_of.lock() = None;
                    }
                }
                slot.is_self.store(false, Ordering::Relaxed);
                connect_failed(&slot, &mut warned, backoff.attempts(), e);
            }
        }
        let mut delay = backoff.next_delay(rand::thread_rng().r#gen());
        if slot.alias_of.lock().is_some() || slot.is_self.load(Ordering::Relaxed) {
            // Its node is linked through another seed, or it reached this
            // node itself: checked now and then only (each check costs the
            // holder a TLS handshake).
            delay = delay.max(ALIAS_RECHECK_FACTOR * shared.cfg.backoff_max);
        }
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = shutdown.changed() => return,
        }
    }
}

/// Logs a failed connect of `slot` and keeps it as the row's `last_error`:
/// at warn when its reason differs from `warned` (the one last said at
/// warn), else at debug. Reasons are compared without their digits: one
/// that carries a time or a count ("expired 19 seconds ago") is the same.
fn connect_failed(slot: &Slot, warned: &mut Option<String>, attempt: u32, e: String) {
    let shape = crate::logonce::shape(&e);
    if warned.as_deref() != Some(shape.as_str()) {
        tracing::warn!(seed = %slot.seed, error = %e, "cannot connect to peer");
        *warned = Some(shape);
    } else {
        tracing::debug!(seed = %slot.seed, error = %e, attempt, "cannot connect to peer");
    }
    *slot.last_error.lock() = Some(e);
}

/// A link made: its control connection and stream, and the claim on the
/// peer's name it holds until the link ends.
type Link = (Connection, SendStream, RecvStream, NameClaim);

/// Whether `addr` is this node's own listen address: its port at an
/// address of this host (one a socket can bind; `local`, the endpoint's
/// address, may be a wildcard).
fn own_address(addr: SocketAddr, local: Option<SocketAddr>) -> bool {
    let Some(local) = local else {
        return false;
    };
    if addr.port() != local.port() {
        return false;
    }
    let ip = local.ip().to_canonical();
    ip == addr.ip() || (ip.is_unspecified() && std::net::UdpSocket::bind((addr.ip(), 0)).is_ok())
}

/// An alias seed (one reaching a node another seed links to) is dialled
/// again every this many `backoff_max`: what answers at its address may
/// change (a node that showed a copied certificate gets its own).
const ALIAS_RECHECK_FACTOR: u32 = 6;

/// What the handshake and hellos with a seed found.
enum Hello {
    /// A peer, its hello checked.
    Peer(Connection, SendStream, RecvStream, String),
    /// This node itself.
    Itself,
    /// This node itself, reached through an address that is not its own.
    Reflected,
    /// A node slot `other` links to (named by its certificate).
    Alias { other: usize, name: String },
}

/// What dialling a seed found.
enum Dialed {
    /// A link to a peer.
    Link(Link),
    /// This node itself (its own address, or its own hello at its own
    /// listen port on an address of this host): never dialled again.
    Itself,
    /// Its own hello at another address (its packets reflected back):
    /// hidden, and dialled again now and then.
    Reflected,
    /// A peer another seed already links to (`other`: that seed).
    Alias { other: String, name: String },
}

/// Dials the seed and exchanges hellos.
async fn connect(shared: &Arc<Shared>, slot: &Slot) -> Result<Dialed, String> {
    let fut = async {
        let addr = tokio::net::lookup_host(slot.seed.as_str())
            .await
            .map_err(|e| format!("resolve {}: {e}", slot.seed))?
            .next()
            .ok_or_else(|| format!("resolve {}: no address", slot.seed))?;
        // An IPv4-mapped IPv6 address (`[::ffff:10.0.0.2]:7300`) is its
        // IPv4 address: an IPv4 endpoint cannot send to the mapped form,
        // and the loopback and self checks below would not recognise it.
        let addr = SocketAddr::new(addr.ip().to_canonical(), addr.port());
        if shared.insecure && !addr.ip().is_loopback() {
            return Err(format!("--insecure-dev refuses non-loopback peer {addr}"));
        }
        if shared
            .endpoint
            .local_addr()
            .is_ok_and(|a| SocketAddr::new(a.ip().to_canonical(), a.port()) == addr)
        {
            return Ok(Hello::Itself);
        }
        let conn = shared
            .endpoint
            .connect_with(shared.client_cfg.clone(), addr, "kvtier-peer")
            .map_err(|e| format!("connect {addr}: {e}"))?
            .await
            .map_err(|e| format!("handshake with {addr}: {e}"))?;
        let cert_name = conn_name(&conn);
        // A certificate naming a node another seed links to: an alias,
        // known before any stream is opened (a subscription would make
        // that node walk and send its whole index at every re-dial). The
        // claim itself is taken below, once the hello confirms the name.
        if let Some(name) = &cert_name
            && let Some(&other) = shared.linked.lock().get(name.as_str())
            && other != slot.index
        {
            conn.close(VarInt::from_u32(0), b"duplicate");
            return Ok(Hello::Alias {
                other,
                name: name.clone(),
            });
        }
        let (mut send, mut recv) = conn
            .open_bi()
            .await
            .map_err(|e| format!("open control stream: {e}"))?;
        let epoch = shared.publisher.lock().epoch();
        write_msg(
            &mut send,
            &Message::Hello {
                node_name: shared.node_name.clone(),
                cluster: shared.cluster.clone(),
                epoch,
            },
        )
        .await
        .map_err(|e| e.to_string())?;
        let hello = read_frame_within(&mut recv, SMALL_FRAME_MAX)
            .await
            .map_err(|e| match conn.close_reason() {
                // E.g. the peer's TLS alert when it refused our certificate.
                Some(why) => format!("read hello: {e} ({why})"),
                None => format!("read hello: {e}"),
            })?;
        let Message::Hello {
            node_name,
            cluster,
            epoch: their_epoch,
        } = hello
        else {
            return Err(format!("expected hello, got message kind {}", hello.kind()));
        };
        if cluster != shared.cluster {
            return Err(format!(
                "peer is in cluster {cluster:?}, we are {:?}",
                shared.cluster
            ));
        }
        if !shared.insecure && cert_name.as_deref() != Some(node_name.as_str()) {
            return Err(format!(
                "hello name {node_name:?} differs from certificate {cert_name:?}"
            ));
        }
        if node_name == shared.node_name {
            conn.close(VarInt::from_u32(0), b"self");
            if their_epoch == epoch {
                // Its own listen port at an address of this host: this node
                // (a shared peer list names every node), for good. Else its
                // packets came back through something else (an echo, a
                // forwarding loop, a hairpin NAT): what answers there may
                // change, so it is dialled again now and then (QA: a seed
                // that echoed UDP for a while was skipped for good, and the
                // node that then listened there was never dialled).
                if own_address(addr, shared.endpoint.local_addr().ok()) {
                    tracing::debug!(seed = %slot.seed, "seed is this node; skipped");
                    return Ok(Hello::Itself);
                }
                return Ok(Hello::Reflected);
            }
            // Another process answered with our name: two nodes share one
            // (a certificate issued twice, or copied). A failure, dialled
            // again with backoff: once that node has its own certificate,
            // it is linked (QA: the seed was skipped for good).
            return Err(format!(
                "the node at this seed presents this node's own name {node_name:?}: two nodes \
                 share it (issue each node its own certificate)"
            ));
        }
        Ok(Hello::Peer(conn, send, recv, node_name))
    };
    let r = tokio::time::timeout(shared.cfg.connect_timeout, fut)
        .await
        .map_err(|_| format!("connect to {} timed out", slot.seed))??;
    let alias = |other: usize, name: String| Dialed::Alias {
        other: shared.slots[other].seed.clone(),
        name,
    };
    let (conn, send, recv, name) = match r {
        Hello::Peer(conn, send, recv, name) => (conn, send, recv, name),
        Hello::Itself => return Ok(Dialed::Itself),
        Hello::Reflected => return Ok(Dialed::Reflected),
        Hello::Alias { other, name } => return Ok(alias(other, name)),
    };
    let claim = match NameClaim::take(shared, &name, slot.index) {
        Ok(claim) => claim,
        Err(other) => {
            // Another seed already links to this node (an alias of one
            // address, e.g. localhost and 127.0.0.1).
            conn.close(VarInt::from_u32(0), b"duplicate");
            return Ok(alias(other, name));
        }
    };
    let prev = slot.name.write().replace(Arc::from(name.as_str()));
    if prev.as_deref().is_some_and(|p| p != name) {
        tracing::warn!(seed = %slot.seed, old = ?prev, new = %name, "peer at this address changed name");
        // The counters were the old node's.
        for c in slot.node_counters() {
            c.store(0, Ordering::Relaxed);
        }
    }
    // Another seed's row for this node (its link ended, and this seed
    // linked first): hidden now, not at its next dial (QA: two rows and
    // duplicate metric series for a few seconds), and its counters move
    // here, so the node's counters do not start over.
    for o in shared.slots.iter().filter(|o| o.index != slot.index) {
        if o.name.read().as_deref() != Some(name.as_str()) || o.conn.read().is_some() {
            continue;
        }
        *o.alias_of.lock() = Some(Arc::from(name.as_str()));
        for (mine, theirs) in slot.node_counters().into_iter().zip(o.node_counters()) {
            mine.fetch_add(theirs.swap(0, Ordering::Relaxed), Ordering::Relaxed);
        }
    }
    *slot.conn.write() = Some(conn.clone());
    slot.connects.fetch_add(1, Ordering::Relaxed);
    // A new link is a fresh start: fetches try this peer again at once.
    *slot.slow_until.lock() = None;
    let now = Instant::now();
    let mut h = slot.health.lock();
    h.on_connected(now);
    if let Some((old, new)) = h.poll_transition(now) {
        tracing::info!(peer = %name, addr = %conn.remote_address(), from = old.as_str(), to = new.as_str(), "peer state");
    }
    Ok(Dialed::Link((conn, send, recv, claim)))
}

/// Dials the fetch-only connections of `slot` (all but its control
/// connection) to `addr`, checking that each certificate names the peer the
/// control connection said hello to. A failure is logged and leaves fetches
/// on the connections made so far.
async fn dial_extra(shared: Arc<Shared>, slot: Arc<Slot>, addr: SocketAddr) {
    let want = slot.name.read().clone();
    for _ in 1..shared.cfg.fetch_connections {
        let dial = async {
            shared
                .endpoint
                .connect_with(shared.client_cfg.clone(), addr, "kvtier-peer")
                .map_err(|e| e.to_string())?
                .await
                .map_err(|e| e.to_string())
        };
        let conn = match tokio::time::timeout(shared.cfg.connect_timeout, dial).await {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => {
                tracing::debug!(peer = %slot.label(), error = %e, "extra fetch connection failed");
                return;
            }
            Err(_) => {
                tracing::debug!(peer = %slot.label(), "extra fetch connection timed out");
                return;
            }
        };
        if !shared.insecure && conn_name(&conn).as_deref() != want.as_deref() {
            tracing::warn!(peer = %slot.label(), cert = ?conn_name(&conn), "extra fetch connection: certificate names another node; not used");
            conn.close(VarInt::from_u32(0), b"name mismatch");
            return;
        }
        slot.extra.write().push(conn);
    }
}

/// The connection for the next fetch from `slot`: the control connection
/// and the fetch-only ones in turn (a closed one is passed over).
fn pick_conn(slot: &Slot) -> Option<Connection> {
    let main = slot.conn.read().clone()?;
    let extra = slot.extra.read();
    if extra.is_empty() {
        return Some(main);
    }
    let i = slot.next_conn.fetch_add(1, Ordering::Relaxed) % (extra.len() + 1);
    match extra.get(i.wrapping_sub(1)) {
        Some(c) if c.close_reason().is_none() => Some(c.clone()),
        _ => Some(main),
    }
}

/// Runs a link until it ends. Returns true when it was dropped because the
/// peer announced more than `max-chunks-per-peer` chunks.
async fn run_link(
    shared: &Arc<Shared>,
    slot: &Slot,
    conn: &Connection,
    mut send: SendStream,
    recv: RecvStream,
) -> bool {
    let (mut frames, reader) = frame_reader(recv);
    let _reader = AbortOnDrop(reader);
    let mut shutdown = shared.shutdown.subscribe();
    let label = slot.label();
    loop {
        let next = slot
            .health
            .lock()
            .next_timeout()
            .unwrap_or_else(|| Instant::now() + Duration::from_secs(1));
        tokio::select! {
            m = frames.recv() => {
                let now = Instant::now();
                let msg = match m {
                    Some(Ok(m)) => m,
                    Some(Err(e)) => {
                        tracing::warn!(peer = %label, error = %e, "peer control stream failed");
                        return false;
                    }
                    None => return false,
                };
                match msg {
                    Message::Pong { nonce } => {
                        slot.health.lock().on_pong(nonce, now);
                    }
                    Message::Namespaces { records } => {
                        slot.health.lock().on_heard(now);
                        *slot.namespaces.lock() = records;
                    }
                    other => {
                        slot.health.lock().on_heard(now);
                        let action = slot.sync.lock().handle(other, now);
                        let applied = match action {
                            SyncAction::Clear => {
                                shared.directory.clear_slot(slot.index);
                                Ok(())
                            }
                            SyncAction::Add(entries) => shared.directory.apply(
                                slot.index,
                                entries.into_iter().flat_map(|(id, len, ram)| {
                                    // An add means "in RAM"; a snapshot says so per entry.
                                    [Some(crate::proto::Op::Add(id, len)), (!ram).then_some(crate::proto::Op::Ram(id, false))]
                                        .into_iter()
                                        .flatten()
                                }),
                            ),
                            SyncAction::Apply(ops) => shared.directory.apply(slot.index, ops),
                            SyncAction::RequestResync => {
                                tracing::info!(peer = %label, "availability gap; asking for a new snapshot");
                                if write_msg(&mut send, &Message::Resync).await.is_err() {
                                    return false;
                                }
                                Ok(())
                            }
                            SyncAction::Synced => {
                                tracing::debug!(peer = %label, chunks = shared.directory.totals(slot.index).chunks, "availability in sync");
                                Ok(())
                            }
                            SyncAction::None => Ok(()),
                        };
                        if let Err(e) = applied {
                            // The caller closes the link and clears the slot.
                            if crate::logonce::warn_now(format!("over-limit|{label}")) {
                                tracing::warn!(peer = %label, error = %e, retry = ?OVER_LIMIT_RETRY,
                                    "peer announced too many chunks; dropping its link (max-chunks-per-peer)");
                            }
                            *slot.last_error.lock() = Some(e.to_string());
                            return true;
                        }
                    }
                }
            }
            _ = tokio::time::sleep_until(tokio::time::Instant::from_std(next)) => {}
            e = conn.closed() => {
                tracing::warn!(peer = %label, reason = %e, "peer connection lost");
                return false;
            }
            _ = shutdown.changed() => return false,
        }
        let now = Instant::now();
        let (ping, transition, state) = {
            let mut h = slot.health.lock();
            (h.poll_ping(now), h.poll_transition(now), h.state(now))
        };
        if let Some((old, new)) = transition {
            tracing::warn!(peer = %label, from = old.as_str(), to = new.as_str(), "peer state");
        }
        if state == PeerState::Down {
            return false;
        }
        if let Some(nonce) = ping {
            if write_msg(&mut send, &Message::Ping { nonce })
                .await
                .is_err()
            {
                return false;
            }
        }
    }
}

async fn fetch_from(
    shared: &Arc<Shared>,
    slot: &Slot,
    id: &PeerChunkId,
) -> Result<Bytes, FetchError> {
    let peer = slot.label();
    let tr = |why: String| FetchError::Transport {
        peer: peer.clone(),
        why,
    };
    let _permit = slot
        .fetch_sem
        .acquire()
        .await
        .map_err(|_| FetchError::ShuttingDown)?;
    let conn = pick_conn(slot).ok_or_else(|| tr("not connected".into()))?;
    let (mut send, mut recv) = conn.open_bi().await.map_err(|e| tr(e.to_string()))?;
    send.write_all(&frame::encode(&Message::FetchRequest { id: *id }))
        .await
        .map_err(|e| tr(e.to_string()))?;
    let _ = send.finish();
    let reply = read_frame_within(&mut recv, SMALL_FRAME_MAX)
        .await
        .map_err(|e| match e {
            StreamErr::Decode(d) => FetchError::Corrupt {
                peer: peer.clone(),
                why: d.to_string(),
            },
            other => tr(other.to_string()),
        })?;
    slot.progressed();
    let corrupt = |why: String| FetchError::Corrupt {
        peer: peer.clone(),
        why,
    };
    let Message::FetchReply {
        status,
        id: rid,
        len,
        crc,
    } = reply
    else {
        return Err(corrupt(format!(
            "expected a fetch reply, got kind {}",
            reply.kind()
        )));
    };
    if rid != *id {
        return Err(corrupt(
            "reply names another chunk (namespace, key or group differ)".into(),
        ));
    }
    match status {
        FetchStatus::Ok => {}
        FetchStatus::NotFound => return Err(FetchError::NotFound { peer }),
        FetchStatus::Busy => {
            return Err(FetchError::Refused {
                peer,
                why: "busy".into(),
            });
        }
        FetchStatus::Failed => {
            return Err(FetchError::Refused {
                peer,
                why: "read failed on the holder".into(),
            });
        }
    }
    if len > shared.cfg.max_chunk_len {
        return Err(corrupt(format!(
            "length {len} exceeds the limit {}",
            shared.cfg.max_chunk_len
        )));
    }
    let len = len as usize;
    // A claim past what was announced for the chunk (a holder's lie, or a
    // rarer overwrite by a larger version) gets its buffer as bytes come.
    let announced = shared.directory.announced_len(id).map_or(0, |l| l as usize);
    let eager = len <= EAGER_PAYLOAD.max(announced);
    let mut payload = Payload::new(len, eager, |len| {
        shared
            .source
            .fetch_buffer(len)
            .unwrap_or_else(|| Box::new(BytesMut::with_capacity(len)))
    });
    while payload.missing() > 0 {
        match recv.read_chunk(payload.missing(), true).await {
            Ok(Some(c)) => {
                payload.push(&c.bytes);
                slot.progressed();
            }
            Ok(None) => {
                return Err(corrupt(format!(
                    "stream ended after {} of {len} payload bytes",
                    len - payload.missing()
                )));
            }
            Err(e) => return Err(tr(e.to_string())),
        }
    }
    payload.finish(crc).map_err(corrupt)
}

/// Payloads up to this length take their whole buffer at once (see
/// [`Payload`]).
const EAGER_PAYLOAD: usize = 1 << 20;

/// A fetched payload being received, piece by piece, in order.
///
/// A payload whose length is no more than what was announced for the chunk
/// (or [`EAGER_PAYLOAD`]) takes its buffer of the whole length at once: the
/// usual case. One claiming more goes into a buffer that grows as bytes
/// come (doubling; a large one is remapped, not copied), so memory follows
/// the bytes that came, not the claim. A holder that claimed 256 MiB per
/// reply for a 1,000-byte chunk and sent nothing made its requester
/// allocate and zero 16 × 256 MiB per fetch timeout (3 GB resident with a
/// 256 MiB RAM budget: QA). Only such claims grow: the regrowth copies,
/// and an honest payload needs one buffer of its announced length.
struct Payload {
    len: usize,
    filled: usize,
    buf: Box<dyn FetchBuffer>,
    /// CRC32C of the pieces so far, each taken as it arrives (still in
    /// cache), not in a second pass over the whole chunk.
    crc: crc_fast::Digest,
}

impl Payload {
    /// A payload of `len` bytes: into `take(len)` when `eager`, else into a
    /// buffer that grows as bytes come.
    fn new(len: usize, eager: bool, take: impl FnOnce(usize) -> Box<dyn FetchBuffer>) -> Self {
        let buf = if eager {
            take(len)
        } else {
            Box::new(BytesMut::with_capacity(len.min(EAGER_PAYLOAD)))
        };
        Self {
            len,
            filled: 0,
            buf,
            crc: crate::proto::frame::crc32c_digest(),
        }
    }

    /// Bytes still to come.
    fn missing(&self) -> usize {
        self.len - self.filled
    }

    /// Adds the next piece (at most [`Payload::missing`] bytes).
    fn push(&mut self, piece: &[u8]) {
        debug_assert!(piece.len() <= self.missing());
        self.crc.update(piece);
        self.filled += piece.len();
        self.buf.extend_from_slice(piece);
    }

    /// The payload, when every byte came and its CRC32C is `crc`.
    fn finish(self, crc: u32) -> Result<Bytes, String> {
        if self.filled != self.len {
            return Err(format!(
                "{} of {} payload bytes came",
                self.filled, self.len
            ));
        }
        let got = crate::proto::frame::crc32c_value(&self.crc);
        if got != crc {
            return Err(format!("payload crc32c {got:#010x} != {crc:#010x}"));
        }
        Ok(self.buf.freeze())
    }
}

#[cfg(test)]
mod limiter_tests {
    use super::*;

    /// A reply cut short (its requester stopped the stream) gives back the
    /// bytes it took and did not send: the next reply is not delayed for it.
    #[tokio::test(start_paused = true)]
    async fn bytes_of_a_reply_cut_short_go_back_to_the_bucket() {
        let l = RateLimiter::new(1_000_000);
        l.acquire(600_000).await.spent();
        let after_spent = l.tokens();
        assert!(after_spent < 410_000.0, "{after_spent}");
        // Taken, then dropped before the bytes went out: refunded.
        drop(l.acquire(300_000).await);
        assert!(l.tokens() >= after_spent, "{} < {after_spent}", l.tokens());
        // Dropped while it waits for the bucket's debt to clear.
        let mut wait = Box::pin(l.acquire(900_000));
        assert!(
            tokio::time::timeout(Duration::from_millis(1), &mut wait)
                .await
                .is_err()
        );
        drop(wait);
        assert!(l.tokens() >= after_spent, "{} < {after_spent}", l.tokens());
    }
}

#[cfg(test)]
mod payload_tests {
    use super::*;
    use std::cell::Cell;

    fn crc(b: &[u8]) -> u32 {
        let mut d = crate::proto::frame::crc32c_digest();
        d.update(b);
        crate::proto::frame::crc32c_value(&d)
    }

    /// A new buffer of `n` bytes, as when the node lends none.
    fn fresh(n: usize) -> Box<dyn FetchBuffer> {
        Box::new(BytesMut::with_capacity(n))
    }

    /// A payload claimed past its announced length never takes a buffer of
    /// the claimed length (QA: 20 such fetches held 3 GB), and is
    /// byte-exact whatever the piece boundaries.
    #[test]
    fn a_payload_claimed_past_its_announced_length_grows_as_bytes_come() {
        let len = 64 << 20;
        let data: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
        let taken = Cell::new(0usize);
        let take = |n: usize| {
            taken.set(taken.get() + 1);
            fresh(n)
        };
        let mut p = Payload::new(len, false, take);
        for piece in data.chunks(1_000_003) {
            p.push(piece);
        }
        assert_eq!(taken.get(), 0, "a buffer of the claimed length was taken");
        assert_eq!(p.missing(), 0);
        assert_eq!(&p.finish(crc(&data)).expect("whole")[..], &data[..]);
    }

    /// Announced payloads take their buffer at once; a payload cut short or
    /// with another CRC is refused.
    #[test]
    fn announced_payloads_take_their_buffer_at_once_and_bad_ones_are_refused() {
        let taken = Cell::new(0usize);
        let take = |n: usize| {
            taken.set(taken.get() + 1);
            fresh(n)
        };
        let p = Payload::new(64 << 20, true, take);
        assert_eq!(taken.get(), 1);
        assert!(p.finish(0).expect_err("nothing came").contains("0 of"));
        let data = vec![5u8; 3 << 20];
        let mut p = Payload::new(data.len(), false, fresh);
        p.push(&data);
        let e = p.finish(crc(&data) ^ 1).expect_err("wrong crc");
        assert!(e.contains("crc32c"), "{e}");
        let p = Payload::new(0, true, fresh);
        assert_eq!(p.missing(), 0);
        assert!(p.finish(crc(&[])).expect("empty").is_empty());
    }
}

#[cfg(test)]
mod own_address_tests {
    use super::own_address;

    #[test]
    fn its_own_port_at_an_address_of_this_host_is_this_node() {
        let at = |s: &str| s.parse().expect("addr");
        // Bound to one address: that address only.
        assert!(own_address(
            at("127.0.0.1:7401"),
            Some(at("127.0.0.1:7401"))
        ));
        assert!(!own_address(
            at("127.0.0.1:7402"),
            Some(at("127.0.0.1:7401"))
        ));
        // Bound to every address: any address of this host at its port,
        // not another host's (TEST-NET-1 is nobody's).
        assert!(own_address(at("127.0.0.1:7401"), Some(at("0.0.0.0:7401"))));
        assert!(!own_address(at("192.0.2.1:7401"), Some(at("0.0.0.0:7401"))));
        assert!(!own_address(at("127.0.0.1:7401"), None));
    }
}
