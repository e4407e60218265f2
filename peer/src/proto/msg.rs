//! Message bodies (all integers little-endian; see `peer/PROTOCOL.md`).

use super::codec::{DecodeError, Reader, WriteExt};
use crate::id::{PeerChunkId, PeerNamespace};

/// One change in a delta, applied in order.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub enum Op {
    /// The sender now holds this chunk (payload length), in its RAM: a
    /// chunk always arrives through RAM.
    Add(PeerChunkId, u64),
    /// The sender no longer holds this chunk.
    Remove(PeerChunkId),
    /// The sender's copy of a chunk it holds entered (`true`) or left
    /// (`false`) its RAM.
    Ram(PeerChunkId, bool),
}

/// Outcome of a fetch as the holder reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub enum FetchStatus {
    /// The payload follows the frame.
    Ok = 0,
    /// The holder does not have the chunk (any more).
    NotFound = 1,
    /// The holder refuses for now (overloaded or shutting down).
    Busy = 2,
    /// The holder failed to read it (I/O error or corruption on its side).
    Failed = 3,
}

impl FetchStatus {
    fn from_u8(v: u8) -> Result<Self, DecodeError> {
        Ok(match v {
            0 => Self::Ok,
            1 => Self::NotFound,
            2 => Self::Busy,
            3 => Self::Failed,
            _ => {
                return Err(DecodeError::Invalid {
                    field: "fetch status",
                    why: "unknown value",
                });
            }
        })
    }
}

/// A peer protocol message.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub enum Message {
    /// First message on a control stream, both ways.
    Hello {
        /// Sender's node name (must match its certificate).
        node_name: String,
        /// Sender's cluster id (must match ours).
        cluster: String,
        /// Sender's availability epoch (random per process start).
        epoch: u64,
    },
    /// Start of an availability snapshot taken at `(epoch, seq)`.
    SnapshotBegin {
        /// Publisher epoch.
        epoch: u64,
        /// Sequence number the snapshot reflects; the next delta is `seq + 1`.
        seq: u64,
        /// Number of entries that follow in parts.
        total: u64,
    },
    /// Some snapshot entries: (chunk id, payload length, in RAM).
    SnapshotPart {
        /// Entries.
        entries: Vec<(PeerChunkId, u64, bool)>,
    },
    /// End of a snapshot.
    SnapshotEnd {
        /// Same `seq` as in the begin message.
        seq: u64,
    },
    /// A batch of availability changes.
    Delta {
        /// Publisher epoch.
        epoch: u64,
        /// Sequence number of this batch (previous + 1).
        seq: u64,
        /// Changes, in order.
        ops: Vec<Op>,
    },
    /// The subscriber lost track (gap, reset): please send a new snapshot.
    Resync,
    /// Liveness probe.
    Ping {
        /// Echoed in the pong.
        nonce: u64,
    },
    /// Liveness answer.
    Pong {
        /// The ping's nonce.
        nonce: u64,
    },
    /// Namespace records known to the sender (JSON, opaque to this crate).
    Namespaces {
        /// (namespace id, record bytes).
        records: Vec<(PeerNamespace, Vec<u8>)>,
    },
    /// Request for one chunk (first and only frame on a fetch stream).
    FetchRequest {
        /// Chunk wanted.
        id: PeerChunkId,
    },
    /// Answer to a fetch; with `Ok`, `len` payload bytes follow the frame.
    FetchReply {
        /// Outcome.
        status: FetchStatus,
        /// The chunk this reply is about (checked against the request).
        id: PeerChunkId,
        /// Payload length.
        len: u64,
        /// Payload CRC32C.
        crc: u32,
    },
}

mod kind {
    pub const HELLO: u8 = 1;
    pub const SNAPSHOT_BEGIN: u8 = 2;
    pub const SNAPSHOT_PART: u8 = 3;
    pub const SNAPSHOT_END: u8 = 4;
    pub const DELTA: u8 = 5;
    pub const RESYNC: u8 = 6;
    pub const PING: u8 = 7;
    pub const PONG: u8 = 8;
    pub const NAMESPACES: u8 = 9;
    pub const FETCH_REQUEST: u8 = 10;
    pub const FETCH_REPLY: u8 = 11;
}

const OP_ADD: u8 = 1;
const OP_REMOVE: u8 = 2;
const OP_RAM: u8 = 3;
/// Encoded size of one snapshot entry (id, length, RAM flag).
pub const ENTRY_LEN: usize = PeerChunkId::WIRE_LEN + 8 + 1;

/// A boolean byte: 0 or 1, anything else is invalid.
fn flag(v: u8, field: &'static str) -> Result<bool, DecodeError> {
    match v {
        0 => Ok(false),
        1 => Ok(true),
        _ => Err(DecodeError::Invalid {
            field,
            why: "not 0 or 1",
        }),
    }
}

impl Message {
    /// The kind byte of this message.
    pub fn kind(&self) -> u8 {
        match self {
            Self::Hello { .. } => kind::HELLO,
            Self::SnapshotBegin { .. } => kind::SNAPSHOT_BEGIN,
            Self::SnapshotPart { .. } => kind::SNAPSHOT_PART,
            Self::SnapshotEnd { .. } => kind::SNAPSHOT_END,
            Self::Delta { .. } => kind::DELTA,
            Self::Resync => kind::RESYNC,
            Self::Ping { .. } => kind::PING,
            Self::Pong { .. } => kind::PONG,
            Self::Namespaces { .. } => kind::NAMESPACES,
            Self::FetchRequest { .. } => kind::FETCH_REQUEST,
            Self::FetchReply { .. } => kind::FETCH_REPLY,
        }
    }

    pub(crate) fn body_len_hint(&self) -> usize {
        match self {
            Self::SnapshotPart { entries } => 4 + entries.len() * ENTRY_LEN,
            Self::Delta { ops, .. } => 20 + ops.len() * (1 + ENTRY_LEN),
            _ => 64,
        }
    }

    /// Appends the body to `out`.
    pub fn encode_body(&self, out: &mut Vec<u8>) {
        match self {
            Self::Hello {
                node_name,
                cluster,
                epoch,
            } => {
                out.put_short_str(node_name);
                out.put_short_str(cluster);
                out.put_u64_le(*epoch);
            }
            Self::SnapshotBegin { epoch, seq, total } => {
                out.put_u64_le(*epoch);
                out.put_u64_le(*seq);
                out.put_u64_le(*total);
            }
            Self::SnapshotPart { entries } => {
                out.put_u32_le(entries.len() as u32);
                for (id, len, ram) in entries {
                    out.put_chunk_id(id);
                    out.put_u64_le(*len);
                    out.push(u8::from(*ram));
                }
            }
            Self::SnapshotEnd { seq } => out.put_u64_le(*seq),
            Self::Delta { epoch, seq, ops } => {
                out.put_u64_le(*epoch);
                out.put_u64_le(*seq);
                out.put_u32_le(ops.len() as u32);
                for op in ops {
                    match op {
                        Op::Add(id, len) => {
                            out.push(OP_ADD);
                            out.put_chunk_id(id);
                            out.put_u64_le(*len);
                        }
                        Op::Remove(id) => {
                            out.push(OP_REMOVE);
                            out.put_chunk_id(id);
                        }
                        Op::Ram(id, ram) => {
                            out.push(OP_RAM);
                            out.put_chunk_id(id);
                            out.push(u8::from(*ram));
                        }
                    }
                }
            }
            Self::Resync => {}
            Self::Ping { nonce } | Self::Pong { nonce } => out.put_u64_le(*nonce),
            Self::Namespaces { records } => {
                out.put_u32_le(records.len() as u32);
                for (ns, rec) in records {
                    out.extend_from_slice(&ns.0);
                    out.put_u32_le(rec.len() as u32);
                    out.extend_from_slice(rec);
                }
            }
            Self::FetchRequest { id } => out.put_chunk_id(id),
            Self::FetchReply {
                status,
                id,
                len,
                crc,
            } => {
                out.push(*status as u8);
                out.put_chunk_id(id);
                out.put_u64_le(*len);
                out.put_u32_le(*crc);
            }
        }
    }

    /// Decodes a body of the given kind; the whole body must be consumed.
    pub fn decode_body(kind: u8, body: &[u8]) -> Result<Self, DecodeError> {
        let mut r = Reader::new(body);
        let msg = match kind {
            kind::HELLO => Self::Hello {
                node_name: r.short_str("node name")?,
                cluster: r.short_str("cluster")?,
                epoch: r.u64()?,
            },
            kind::SNAPSHOT_BEGIN => Self::SnapshotBegin {
                epoch: r.u64()?,
                seq: r.u64()?,
                total: r.u64()?,
            },
            kind::SNAPSHOT_PART => {
                let n = r.count(ENTRY_LEN)?;
                let mut entries = Vec::with_capacity(n);
                for _ in 0..n {
                    let id = r.chunk_id()?;
                    let len = r.u64()?;
                    entries.push((id, len, flag(r.u8()?, "snapshot entry RAM flag")?));
                }
                Self::SnapshotPart { entries }
            }
            kind::SNAPSHOT_END => Self::SnapshotEnd { seq: r.u64()? },
            kind::DELTA => {
                let epoch = r.u64()?;
                let seq = r.u64()?;
                let n = r.count(1 + PeerChunkId::WIRE_LEN)?;
                let mut ops = Vec::with_capacity(n);
                for _ in 0..n {
                    match r.u8()? {
                        OP_ADD => {
                            let id = r.chunk_id()?;
                            ops.push(Op::Add(id, r.u64()?));
                        }
                        OP_REMOVE => ops.push(Op::Remove(r.chunk_id()?)),
                        OP_RAM => {
                            let id = r.chunk_id()?;
                            ops.push(Op::Ram(id, flag(r.u8()?, "delta RAM flag")?));
                        }
                        _ => {
                            return Err(DecodeError::Invalid {
                                field: "delta op",
                                why: "unknown tag",
                            });
                        }
                    }
                }
                Self::Delta { epoch, seq, ops }
            }
            kind::RESYNC => Self::Resync,
            kind::PING => Self::Ping { nonce: r.u64()? },
            kind::PONG => Self::Pong { nonce: r.u64()? },
            kind::NAMESPACES => {
                let n = r.count(20)?;
                let mut records = Vec::with_capacity(n);
                for _ in 0..n {
                    let ns = PeerNamespace(r.array()?);
                    records.push((ns, r.long_bytes()?.to_vec()));
                }
                Self::Namespaces { records }
            }
            kind::FETCH_REQUEST => Self::FetchRequest { id: r.chunk_id()? },
            kind::FETCH_REPLY => Self::FetchReply {
                status: FetchStatus::from_u8(r.u8()?)?,
                id: r.chunk_id()?,
                len: r.u64()?,
                crc: r.u32()?,
            },
            other => return Err(DecodeError::UnknownKind(other)),
        };
        r.finish()?;
        Ok(msg)
    }
}
