//! The store file's layout: superblock, region slots, batch records and the
//! rkyv entry lists used by batch records and region summaries.
//!
//! ```text
//! store.kvt = region 0 | region 1 | ... | region N-1     (N * region-size bytes)
//!
//! region r (at r * region-size):
//!   block 0   superblock (region 0 only; unused elsewhere)
//!   block 1   open slot  (written + synced when the region is (re)opened)
//!   block 2   seal slot  (written when the region is sealed)
//!   block 3.. batches: [batch record][chunk][chunk]...  (a batch is 4 KiB
//!             aligned; its chunk records are packed at 64-byte alignment)
//!             then, once sealed, the summary (rkyv entry list)
//!
//! superblock (little-endian)        open slot                 seal slot
//!  0  8 magic "KVTSTORE"             0 4 magic "KVTR"          0 4 magic "KVTR"
//!  8  4 store format version         4 2 slot version (1)      4 2 slot version
//! 12  4 block size (4096)            6 2 kind = 1 (open)       6 2 kind = 2 (seal)
//! 16  8 region size                  8 4 region index          8 4 region index
//! 24  4 region count                12 4 reserved (0)         12 4 entry count
//! 28  4 reserved (0)                16 8 generation           16 8 generation
//! 32  8 created (unix ms)           24 4 crc32c of [0,24)     24 4 summary offset
//! 40  4 crc32c of [0,40)                                      28 4 summary length
//!                                                             32 4 summary crc32c
//!                                                             36 4 data end
//!                                                             40 4 crc32c of [0,40)
//! batch record
//!  0 4 magic "KVTB"  4 2 version  6 2 reserved  8 4 region index  12 4 entry count
//! 16 8 generation   24 4 batch length (record + chunks, multiple of 4096)
//! 28 4 entries length  32 4 entries crc32c  36 4 crc32c of [0,36)
//! 64 . entries (rkyv `Vec<Entry>`), then zero padding to a block
//! ```

use rkyv::rancor;

use crate::device::{BLOCK, block_up};
use crate::format::crc32c;
use crate::types::{ChunkId, ChunkKey, Namespace};

/// Magic of the superblock.
pub const SB_MAGIC: [u8; 8] = *b"KVTSTORE";
/// The store format version this build writes and reads.
pub const STORE_VERSION: u32 = 1;
/// Magic of region slots.
pub const SLOT_MAGIC: [u8; 4] = *b"KVTR";
/// Magic of batch records.
pub const BATCH_MAGIC: [u8; 4] = *b"KVTB";
/// Version of slots and batch records.
pub const SLOT_VERSION: u16 = 1;
/// Offset of the open slot within a region.
pub const OPEN_SLOT: u64 = BLOCK;
/// Offset of the seal slot within a region.
pub const SEAL_SLOT: u64 = 2 * BLOCK;
/// Offset of the first batch within a region.
pub const DATA_START: u64 = 3 * BLOCK;
/// Chunk records (header + payload) start at multiples of this within a
/// batch; small chunks are packed, the batch as a whole is block aligned.
pub const RECORD_ALIGN: u64 = 64;
/// Length of a batch record's fixed part (entries start here).
pub const BATCH_FIXED: usize = 64;
/// Entry kind: a chunk.
pub const KIND_CHUNK: u8 = 0;
/// Entry kind: a tombstone (the id was deleted).
pub const KIND_TOMBSTONE: u8 = 1;

/// Wall-clock time in unix milliseconds (0 if the clock is before 1970).
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn le32(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]])
}
fn le16(b: &[u8], o: usize) -> u16 {
    u16::from_le_bytes([b[o], b[o + 1]])
}
fn le64(b: &[u8], o: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[o..o + 8]);
    u64::from_le_bytes(x)
}

/// The superblock at offset 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Superblock {
    /// Store format version.
    pub version: u32,
    /// Region size in bytes.
    pub region_size: u64,
    /// Number of regions.
    pub region_count: u32,
    /// Creation time, unix ms.
    pub created_ms: u64,
}

/// Why a superblock was refused.
#[derive(Debug, PartialEq, Eq)]
pub enum SuperblockError {
    /// No magic: a fresh (zeroed) or foreign file.
    NoMagic,
    /// Another store format version.
    Version(u32),
    /// A CRC or field check failed.
    Corrupt(String),
}

impl Superblock {
    /// Encodes into the first 44 bytes of `out`.
    pub fn encode_into(&self, out: &mut [u8]) {
        out[..44].fill(0);
        out[0..8].copy_from_slice(&SB_MAGIC);
        out[8..12].copy_from_slice(&self.version.to_le_bytes());
        out[12..16].copy_from_slice(&(BLOCK as u32).to_le_bytes());
        out[16..24].copy_from_slice(&self.region_size.to_le_bytes());
        out[24..28].copy_from_slice(&self.region_count.to_le_bytes());
        out[32..40].copy_from_slice(&self.created_ms.to_le_bytes());
        let crc = crc32c(&out[0..40]);
        out[40..44].copy_from_slice(&crc.to_le_bytes());
    }

    /// Decodes and checks a superblock.
    pub fn decode(b: &[u8]) -> Result<Self, SuperblockError> {
        if b.len() < 44 || b[0..8] != SB_MAGIC {
            return Err(SuperblockError::NoMagic);
        }
        let crc = le32(b, 40);
        if crc32c(&b[0..40]) != crc {
            return Err(SuperblockError::Corrupt(format!(
                "superblock crc {crc:#010x} does not match its bytes ({:#010x})",
                crc32c(&b[0..40])
            )));
        }
        let version = le32(b, 8);
        if version != STORE_VERSION {
            return Err(SuperblockError::Version(version));
        }
        let block = le32(b, 12);
        if u64::from(block) != BLOCK {
            return Err(SuperblockError::Corrupt(format!(
                "block size {block}, expected {BLOCK}"
            )));
        }
        // Bytes 28..32 are reserved: always written as zero.
        if le32(b, 28) != 0 {
            return Err(SuperblockError::Corrupt(format!(
                "reserved bytes 28..32 are {:#010x}, expected zero",
                le32(b, 28)
            )));
        }
        // The shape any store kvtier writes has (what the config accepts,
        // at least two regions): anything else is corrupt, not a setting.
        let (region_size, region_count) = (le64(b, 16), le32(b, 24));
        use crate::config::{MAX_REGION_SIZE, MIN_REGION_SIZE};
        if region_size % BLOCK != 0 || !(MIN_REGION_SIZE..=MAX_REGION_SIZE).contains(&region_size) {
            return Err(SuperblockError::Corrupt(format!(
                "region size {region_size} is not a multiple of {BLOCK} between \
                 {MIN_REGION_SIZE} and {MAX_REGION_SIZE}"
            )));
        }
        if region_count < 2 {
            return Err(SuperblockError::Corrupt(format!(
                "region count {region_count}, at least 2"
            )));
        }
        Ok(Self {
            version,
            region_size,
            region_count,
            created_ms: le64(b, 32),
        })
    }
}

/// The open slot of a region: its generation.
pub fn encode_open_slot(out: &mut [u8], region: u32, generation: u64) {
    out[..BLOCK as usize].fill(0);
    out[0..4].copy_from_slice(&SLOT_MAGIC);
    out[4..6].copy_from_slice(&SLOT_VERSION.to_le_bytes());
    out[6..8].copy_from_slice(&1u16.to_le_bytes());
    out[8..12].copy_from_slice(&region.to_le_bytes());
    out[16..24].copy_from_slice(&generation.to_le_bytes());
    let crc = crc32c(&out[0..24]);
    out[24..28].copy_from_slice(&crc.to_le_bytes());
}

/// Decodes an open slot; `None` when absent or invalid (a free region).
pub fn decode_open_slot(b: &[u8], region: u32) -> Option<u64> {
    if b.len() < 28 || b[0..4] != SLOT_MAGIC || le16(b, 4) != SLOT_VERSION || le16(b, 6) != 1 {
        return None;
    }
    // Bytes 12..16 are reserved: always written as zero.
    if crc32c(&b[0..24]) != le32(b, 24) || le32(b, 8) != region || le32(b, 12) != 0 {
        return None;
    }
    Some(le64(b, 16))
}

/// The seal slot of a region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SealSlot {
    /// Region index.
    pub region: u32,
    /// Generation (must match the open slot's).
    pub generation: u64,
    /// Entries in the summary.
    pub entry_count: u32,
    /// Offset of the summary within the region.
    pub summary_offset: u32,
    /// Length of the summary in bytes.
    pub summary_len: u32,
    /// CRC32C of the summary bytes.
    pub summary_crc: u32,
    /// End of the last batch.
    pub data_end: u32,
}

impl SealSlot {
    /// Encodes into a block.
    pub fn encode_into(&self, out: &mut [u8]) {
        out[..BLOCK as usize].fill(0);
        out[0..4].copy_from_slice(&SLOT_MAGIC);
        out[4..6].copy_from_slice(&SLOT_VERSION.to_le_bytes());
        out[6..8].copy_from_slice(&2u16.to_le_bytes());
        out[8..12].copy_from_slice(&self.region.to_le_bytes());
        out[12..16].copy_from_slice(&self.entry_count.to_le_bytes());
        out[16..24].copy_from_slice(&self.generation.to_le_bytes());
        out[24..28].copy_from_slice(&self.summary_offset.to_le_bytes());
        out[28..32].copy_from_slice(&self.summary_len.to_le_bytes());
        out[32..36].copy_from_slice(&self.summary_crc.to_le_bytes());
        out[36..40].copy_from_slice(&self.data_end.to_le_bytes());
        let crc = crc32c(&out[0..40]);
        out[40..44].copy_from_slice(&crc.to_le_bytes());
    }

    /// Decodes a seal slot; `None` when absent or invalid.
    pub fn decode(b: &[u8]) -> Option<Self> {
        if b.len() < 44 || b[0..4] != SLOT_MAGIC || le16(b, 4) != SLOT_VERSION || le16(b, 6) != 2 {
            return None;
        }
        if crc32c(&b[0..40]) != le32(b, 40) {
            return None;
        }
        Some(Self {
            region: le32(b, 8),
            entry_count: le32(b, 12),
            generation: le64(b, 16),
            summary_offset: le32(b, 24),
            summary_len: le32(b, 28),
            summary_crc: le32(b, 32),
            data_end: le32(b, 36),
        })
    }
}

/// One entry of a batch record or region summary: a chunk (or tombstone)
/// and where its record lies in the region.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    /// Namespace id.
    pub ns: [u8; 16],
    /// Key.
    pub key: [u8; 32],
    /// Group.
    pub group: u16,
    /// [`KIND_CHUNK`] or [`KIND_TOMBSTONE`].
    pub kind: u8,
    /// Offset of the chunk record (its header) within the region.
    pub offset: u32,
    /// Encoded header length.
    pub header_len: u32,
    /// Payload length.
    pub payload_len: u32,
    /// Payload CRC32C.
    pub payload_crc: u32,
    /// Atomic group (transaction) id; 0 = not part of one.
    pub txn: u64,
    /// Number of distinct chunks in the transaction.
    pub txn_size: u32,
}

impl Entry {
    /// The chunk id of this entry.
    pub fn id(&self) -> ChunkId {
        ChunkId::new(Namespace(self.ns), ChunkKey(self.key), self.group)
    }

    /// Length of the chunk record on disk (header + payload, padded to
    /// [`RECORD_ALIGN`]).
    pub fn record_len(&self) -> u64 {
        (u64::from(self.header_len) + u64::from(self.payload_len)).next_multiple_of(RECORD_ALIGN)
    }
}

impl ArchivedEntry {
    /// Converts to the native entry.
    pub fn to_native(&self) -> Entry {
        Entry {
            ns: self.ns,
            key: self.key,
            group: self.group.to_native(),
            kind: self.kind,
            offset: self.offset.to_native(),
            header_len: self.header_len.to_native(),
            payload_len: self.payload_len.to_native(),
            payload_crc: self.payload_crc.to_native(),
            txn: self.txn.to_native(),
            txn_size: self.txn_size.to_native(),
        }
    }
}

/// Serialized entries list (rkyv).
pub fn encode_entries(entries: &[Entry]) -> rkyv::util::AlignedVec {
    let v: Vec<Entry> = entries.to_vec();
    rkyv::to_bytes::<rancor::Error>(&v).expect("serializing plain entries cannot fail")
}

/// Upper bound of the serialized size of `n` entries.
pub fn entries_len_bound(n: usize) -> u64 {
    (n * std::mem::size_of::<ArchivedEntry>() + 64) as u64
}

/// Validates (bytecheck) and returns the archived entries in `bytes`, which
/// must be 16-byte aligned.
pub fn decode_entries(bytes: &[u8]) -> Result<&rkyv::Archived<Vec<Entry>>, String> {
    rkyv::access::<rkyv::Archived<Vec<Entry>>, rancor::Error>(bytes).map_err(|e| e.to_string())
}

/// A decoded batch record's fixed part.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchHead {
    /// Region index.
    pub region: u32,
    /// Entry count.
    pub entry_count: u32,
    /// Generation of the region when written.
    pub generation: u64,
    /// Total length of the batch (record + chunks).
    pub batch_len: u32,
    /// Length of the serialized entries.
    pub entries_len: u32,
    /// CRC32C of the serialized entries.
    pub entries_crc: u32,
}

impl BatchHead {
    /// Length of the record (fixed part + entries, block padded).
    pub fn record_len(&self) -> u64 {
        block_up(BATCH_FIXED as u64 + u64::from(self.entries_len))
    }

    /// Encodes the fixed part into `out[..BATCH_FIXED]`.
    pub fn encode_into(&self, out: &mut [u8]) {
        out[..BATCH_FIXED].fill(0);
        out[0..4].copy_from_slice(&BATCH_MAGIC);
        out[4..6].copy_from_slice(&SLOT_VERSION.to_le_bytes());
        out[8..12].copy_from_slice(&self.region.to_le_bytes());
        out[12..16].copy_from_slice(&self.entry_count.to_le_bytes());
        out[16..24].copy_from_slice(&self.generation.to_le_bytes());
        out[24..28].copy_from_slice(&self.batch_len.to_le_bytes());
        out[28..32].copy_from_slice(&self.entries_len.to_le_bytes());
        out[32..36].copy_from_slice(&self.entries_crc.to_le_bytes());
        let crc = crc32c(&out[0..36]);
        out[36..40].copy_from_slice(&crc.to_le_bytes());
    }

    /// Decodes the fixed part; `None` when it is not a valid record.
    pub fn decode(b: &[u8]) -> Option<Self> {
        if b.len() < BATCH_FIXED || b[0..4] != BATCH_MAGIC || le16(b, 4) != SLOT_VERSION {
            return None;
        }
        // Bytes 6..8 are reserved: always written as zero.
        if le16(b, 6) != 0 || crc32c(&b[0..36]) != le32(b, 36) {
            return None;
        }
        Some(Self {
            region: le32(b, 8),
            entry_count: le32(b, 12),
            generation: le64(b, 16),
            batch_len: le32(b, 24),
            entries_len: le32(b, 28),
            entries_crc: le32(b, 32),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::AlignedBuf;

    fn entry(i: u8) -> Entry {
        Entry {
            ns: [i; 16],
            key: [i.wrapping_add(1); 32],
            group: u16::from(i),
            kind: KIND_CHUNK,
            offset: 12288 + u32::from(i) * 4096,
            header_len: 128,
            payload_len: 1000 + u32::from(i),
            payload_crc: 7,
            txn: u64::from(i),
            txn_size: 2,
        }
    }

    #[test]
    fn superblock_round_trips_and_rejects_flips_and_versions() {
        let sb = Superblock {
            version: STORE_VERSION,
            region_size: 1 << 20,
            region_count: 9,
            created_ms: 5,
        };
        let mut b = [0u8; 64];
        sb.encode_into(&mut b);
        assert_eq!(Superblock::decode(&b), Ok(sb));
        for i in 0..44 {
            let mut c = b;
            c[i] ^= 0x10;
            assert!(Superblock::decode(&c).is_err(), "flip at {i}");
        }
        let mut other = sb;
        other.version = 7;
        other.encode_into(&mut b);
        assert_eq!(Superblock::decode(&b), Err(SuperblockError::Version(7)));
        assert_eq!(
            Superblock::decode(&[0u8; 64]),
            Err(SuperblockError::NoMagic)
        );
    }

    #[test]
    fn slots_round_trip_and_reject_flips() {
        let mut b = vec![0u8; BLOCK as usize];
        encode_open_slot(&mut b, 3, 42);
        assert_eq!(decode_open_slot(&b, 3), Some(42));
        assert_eq!(decode_open_slot(&b, 4), None);
        for i in 0..28 {
            let mut c = b.clone();
            c[i] ^= 1;
            assert_eq!(decode_open_slot(&c, 3), None, "flip at {i}");
        }
        let s = SealSlot {
            region: 3,
            generation: 42,
            entry_count: 10,
            summary_offset: 8192,
            summary_len: 900,
            summary_crc: 77,
            data_end: 8192,
        };
        s.encode_into(&mut b);
        assert_eq!(SealSlot::decode(&b), Some(s));
        for i in 0..44 {
            let mut c = b.clone();
            c[i] ^= 1;
            assert_eq!(SealSlot::decode(&c), None, "flip at {i}");
        }
    }

    #[test]
    fn entries_round_trip_and_bound_holds() {
        let entries: Vec<Entry> = (0..50).map(entry).collect();
        let bytes = encode_entries(&entries);
        assert!(bytes.len() as u64 <= entries_len_bound(50));
        let mut buf = AlignedBuf::zeroed(bytes.len());
        buf.copy_from_slice(&bytes);
        let arch = decode_entries(&buf).unwrap();
        let back: Vec<Entry> = arch.iter().map(ArchivedEntry::to_native).collect();
        assert_eq!(back, entries);
        // Truncated input is refused, never a panic.
        for cut in [0, 1, 8, bytes.len() / 2] {
            let _ = decode_entries(&buf[..cut]);
        }
    }

    #[test]
    fn batch_head_round_trips() {
        let h = BatchHead {
            region: 1,
            entry_count: 3,
            generation: 9,
            batch_len: 3 * 4096,
            entries_len: 300,
            entries_crc: 5,
        };
        let mut b = [0u8; 64];
        h.encode_into(&mut b);
        assert_eq!(BatchHead::decode(&b), Some(h));
        let mut c = b;
        c[17] ^= 1;
        assert_eq!(BatchHead::decode(&c), None);
        assert_eq!(h.record_len(), 4096);
    }

    /// Sets `b[range]` to `fill` and rewrites the CRC of `b[..crc_at]` at
    /// `crc_at`, so only the reserved bytes make the block invalid.
    fn dirty_reserved(b: &mut [u8], range: std::ops::Range<usize>, crc_at: usize) {
        b[range].fill(0xa5);
        let crc = crc32c(&b[..crc_at]);
        b[crc_at..crc_at + 4].copy_from_slice(&crc.to_le_bytes());
    }

    /// A superblock whose CRC matches but whose shape no store has (a
    /// region size the config refuses, fewer than two regions) is corrupt:
    /// it used to reach the config, whose error blamed the built-in default.
    #[test]
    fn a_superblock_with_an_impossible_shape_is_corrupt() {
        let mut b = vec![0u8; BLOCK as usize];
        for (region_size, region_count) in
            [(0, 9), (4096, 9), (12345, 9), (2 << 30, 9), (1 << 20, 1)]
        {
            Superblock {
                version: STORE_VERSION,
                region_size,
                region_count,
                created_ms: 5,
            }
            .encode_into(&mut b);
            assert!(
                matches!(Superblock::decode(&b), Err(SuperblockError::Corrupt(_))),
                "{region_size} x {region_count}"
            );
        }
    }

    /// Encoders write zeros into reserved bytes; a block with anything else
    /// there (and a CRC that matches it) was not written by this format and
    /// is refused, so every accepted block re-encodes to the same bytes (the
    /// segment_layout fuzz target's round-trip property).
    #[test]
    fn nonzero_reserved_bytes_are_refused() {
        let mut b = vec![0u8; BLOCK as usize];
        Superblock {
            version: STORE_VERSION,
            region_size: 1 << 20,
            region_count: 9,
            created_ms: 5,
        }
        .encode_into(&mut b);
        dirty_reserved(&mut b, 28..32, 40);
        assert!(matches!(
            Superblock::decode(&b),
            Err(SuperblockError::Corrupt(m)) if m.contains("reserved")
        ));

        encode_open_slot(&mut b, 0, 42);
        dirty_reserved(&mut b, 12..16, 24);
        assert_eq!(decode_open_slot(&b, 0), None);

        let mut h = [0u8; BATCH_FIXED];
        BatchHead {
            region: 1,
            entry_count: 3,
            generation: 9,
            batch_len: 3 * 4096,
            entries_len: 300,
            entries_crc: 5,
        }
        .encode_into(&mut h);
        dirty_reserved(&mut h, 6..8, 36);
        assert_eq!(BatchHead::decode(&h), None);
    }

    /// The input the segment_layout fuzz target found (an open slot with
    /// nonzero reserved bytes and a CRC over them that matches).
    #[test]
    fn fuzz_regression_open_slot_with_reserved_bytes() {
        let input: [u8; 64] = [
            0x4b, 0x56, 0x54, 0x52, 0x01, 0x00, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x5c,
            0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x2d, 0x4c, 0x56, 0x54, 0x4c, 0x7a, 0xc9, 0xaf,
            0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
            0x00, 0x00, 0x00, 0x00, 0x00, 0xb5, 0xab, 0x54, 0x52, 0x00, 0x00, 0x00, 0x00, 0x00,
            0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
        ];
        let mut block = vec![0u8; BLOCK as usize];
        block[..input.len()].copy_from_slice(&input);
        assert_eq!(crc32c(&block[0..24]), le32(&block, 24), "the CRC matches");
        assert_eq!(decode_open_slot(&block, 0), None);
    }
}
