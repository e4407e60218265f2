//! Identifiers the peer protocol speaks about.
//!
//! These are the peer crate's own newtypes; `node` converts between them and
//! the tier's ids (the two leaf crates never depend on each other).

use bytes::Bytes;

/// A 16-byte namespace id (a hash of the namespace's fence fields).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug, Default)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct PeerNamespace(pub [u8; 16]);

/// The identity of one chunk as the peer protocol names it:
/// (namespace, 32-byte key, group).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug, Default)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct PeerChunkId {
    /// Namespace id (per rank).
    pub ns: PeerNamespace,
    /// 32-byte key (already a uniform hash).
    pub key: [u8; 32],
    /// KV-cache group index; part of identity.
    pub group: u16,
}

impl PeerChunkId {
    /// Encoded size on the wire: 16 + 32 + 2 bytes.
    pub const WIRE_LEN: usize = 50;
}

/// The bytes of one chunk as a holder serves them: the payload exactly as
/// stored and its CRC32C as recorded in the chunk header.
#[derive(Clone, Debug)]
pub struct ChunkBytes {
    /// Payload bytes (no chunk header).
    pub payload: Bytes,
    /// CRC32C of `payload` as recorded when the chunk was stored.
    pub crc: u32,
}

impl ChunkBytes {
    /// Builds a `ChunkBytes` computing the CRC32C of `payload`.
    pub fn new(payload: Bytes) -> Self {
        let crc = crc_fast::crc32_iscsi(&payload);
        Self { payload, crc }
    }
}
