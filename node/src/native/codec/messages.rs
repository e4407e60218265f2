//! Typed requests and replies of the native protocol (layouts in `node/PROTOCOL.md`).

use tier::{ChunkKey, GroupId, Namespace, NamespaceRecord};

use super::{ErrorCode, Op};

/// One PUT or GET entry: a chunk key and a range of the shared region
/// (for GET, `len` is the capacity of the destination).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RegionEntry {
    /// The chunk key.
    pub key: ChunkKey,
    /// Offset in the region.
    pub offset: u64,
    /// Length (PUT) or capacity (GET).
    pub len: u64,
}

/// Where a looked-up key lives (LOOKUP reply, one byte per key).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum LookupLocation {
    /// Not present.
    Miss = 0,
    /// In this node's RAM.
    Ram = 1,
    /// On this node's disk.
    Disk = 2,
    /// On a peer.
    Peer = 3,
}

/// Per-key outcome of a GET (reply entry byte 0).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum GetStatus {
    /// Not present (or failed verification): recompute.
    Miss = 0,
    /// Served from RAM; `len` bytes were written at the entry's offset.
    HitRam = 1,
    /// Served from the local disk.
    HitDisk = 2,
    /// Served from a peer.
    HitPeer = 3,
    /// Present but larger than the capacity; `len` is the size needed and
    /// nothing was written.
    TooSmall = 4,
}

impl GetStatus {
    /// Whether bytes were written into the region.
    pub fn is_hit(self) -> bool {
        matches!(
            self,
            GetStatus::HitRam | GetStatus::HitDisk | GetStatus::HitPeer
        )
    }
}

/// Per-key GET result.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GetResult {
    /// Outcome.
    pub status: GetStatus,
    /// Bytes written (hits) or needed (too small); 0 for a miss.
    pub len: u64,
}

impl GetResult {
    /// A miss.
    pub const MISS: GetResult = GetResult {
        status: GetStatus::Miss,
        len: 0,
    };
}

/// HELLO reply.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HelloReply {
    /// The namespace id of the record.
    pub ns: Namespace,
    /// The daemon's protocol version.
    pub version: u16,
    /// Most entries the daemon accepts in one request.
    pub max_batch: u32,
    /// Largest frame body the daemon accepts.
    pub max_frame: u32,
    /// Largest region the daemon maps.
    pub max_region: u64,
}

/// Per-rank part of a CLUSTER_LOOKUP reply.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankPrefixReply {
    /// The rank.
    pub rank: u32,
    /// Longest prefix present anywhere in the cluster.
    pub prefix: u32,
    /// Longest prefix in RAM on the rank's node.
    pub ram_prefix: u32,
}

/// FLUSH reply.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Serialize)]
pub struct FlushReply {
    /// Chunks written.
    pub chunks: u64,
    /// Payload bytes written.
    pub bytes: u64,
    /// Dirty chunks that could not be written.
    pub failed: u64,
}

/// A decoded request.
#[derive(Clone, Debug, PartialEq)]
pub enum Request {
    /// PING.
    Ping,
    /// HELLO with the namespace record (JSON on the wire).
    Hello {
        /// The record.
        record: NamespaceRecord,
    },
    /// REGISTER_REGION: map `len` bytes of the descriptor sent with the frame.
    RegisterRegion {
        /// Bytes to map from offset 0.
        len: u64,
    },
    /// LOOKUP.
    Lookup {
        /// Namespace.
        ns: Namespace,
        /// Group.
        group: GroupId,
        /// Ordered keys.
        keys: Vec<ChunkKey>,
    },
    /// LOOKUP of `count` keys of 32 bytes stored at `offset` in the
    /// connection's region (op LOOKUP with [`super::FLAG_KEYS_IN_REGION`]):
    /// the same answer as [`Request::Lookup`] without the keys in the frame.
    LookupInRegion {
        /// Namespace.
        ns: Namespace,
        /// Group.
        group: GroupId,
        /// Offset of the first key in the region.
        offset: u64,
        /// Number of keys.
        count: u32,
    },
    /// CLUSTER_LOOKUP.
    ClusterLookup {
        /// Record of the family (its rank is ignored).
        record: NamespaceRecord,
        /// Ranks to answer for.
        ranks: Vec<u32>,
        /// Group.
        group: GroupId,
        /// Ordered keys.
        keys: Vec<ChunkKey>,
    },
    /// PUT.
    Put {
        /// Namespace.
        ns: Namespace,
        /// Group.
        group: GroupId,
        /// All or nothing.
        atomic: bool,
        /// Chunks to store.
        entries: Vec<RegionEntry>,
    },
    /// GET.
    Get {
        /// Namespace.
        ns: Namespace,
        /// Group.
        group: GroupId,
        /// Chunks to read and where to write them.
        entries: Vec<RegionEntry>,
    },
    /// DELETE.
    Delete {
        /// Namespace.
        ns: Namespace,
        /// Group.
        group: GroupId,
        /// Keys to remove.
        keys: Vec<ChunkKey>,
    },
    /// FLUSH.
    Flush,
    /// STATS.
    Stats,
}

impl Request {
    /// The op of this request.
    pub fn op(&self) -> Op {
        match self {
            Request::Ping => Op::Ping,
            Request::Hello { .. } => Op::Hello,
            Request::RegisterRegion { .. } => Op::RegisterRegion,
            Request::Lookup { .. } | Request::LookupInRegion { .. } => Op::Lookup,
            Request::ClusterLookup { .. } => Op::ClusterLookup,
            Request::Put { .. } => Op::Put,
            Request::Get { .. } => Op::Get,
            Request::Delete { .. } => Op::Delete,
            Request::Flush => Op::Flush,
            Request::Stats => Op::Stats,
        }
    }
}

/// A decoded successful reply (errors are [`Reply::Error`]).
#[derive(Clone, Debug, PartialEq)]
pub enum Response {
    /// PING reply.
    Pong,
    /// HELLO reply.
    Hello(HelloReply),
    /// REGISTER_REGION reply: bytes mapped.
    RegionRegistered {
        /// Length of the mapping.
        len: u64,
    },
    /// LOOKUP reply.
    Lookup {
        /// Longest present prefix.
        prefix: u32,
        /// Per key.
        locations: Vec<LookupLocation>,
    },
    /// CLUSTER_LOOKUP reply.
    ClusterLookup {
        /// Minimum prefix over the ranks.
        min_prefix: u32,
        /// Per rank.
        ranks: Vec<RankPrefixReply>,
    },
    /// PUT reply: per entry 0 (stored) or an [`ErrorCode`].
    Put {
        /// Per-entry status codes.
        statuses: Vec<u16>,
    },
    /// GET reply.
    Get {
        /// Per entry.
        results: Vec<GetResult>,
    },
    /// DELETE reply: per key whether it existed.
    Delete {
        /// Per key.
        existed: Vec<bool>,
    },
    /// FLUSH reply.
    Flush(FlushReply),
    /// STATS reply: a JSON document.
    Stats {
        /// UTF-8 JSON.
        json: Vec<u8>,
    },
}

impl Response {
    /// The op this response answers.
    pub fn op(&self) -> Op {
        match self {
            Response::Pong => Op::Ping,
            Response::Hello(_) => Op::Hello,
            Response::RegionRegistered { .. } => Op::RegisterRegion,
            Response::Lookup { .. } => Op::Lookup,
            Response::ClusterLookup { .. } => Op::ClusterLookup,
            Response::Put { .. } => Op::Put,
            Response::Get { .. } => Op::Get,
            Response::Delete { .. } => Op::Delete,
            Response::Flush(_) => Op::Flush,
            Response::Stats { .. } => Op::Stats,
        }
    }
}

/// A decoded reply frame: a response or an error.
#[derive(Clone, Debug, PartialEq)]
pub enum Reply {
    /// Success.
    Ok(Response),
    /// The daemon refused or failed the request.
    Error {
        /// The code.
        code: ErrorCode,
        /// Human-readable message.
        message: String,
    },
}
