//! Chunk format v1: the header that precedes every chunk payload on disk (and
//! on the wire between peers).
//!
//! The format is an API (STYLE.md rule 17): the byte table below is mirrored
//! in `tier/FORMAT.md`, golden fixtures under `tier/tests/fixtures/format-v1/`
//! pin the encoding, and any layout change bumps [`FORMAT_VERSION`] and adds a
//! new fixture directory. Every integer is little-endian; nothing is `usize`.
//!
//! ```text
//! offset  size  field
//! ------  ----  -----------------------------------------------------------
//!      0     4  magic "KVTC"
//!      4     2  format version (u16) = 1
//!      6     2  reserved, must be zero
//!      8     4  header length (u32): the whole padded header, multiple of 64
//!     12     4  flags (u32), opaque to the format (carried for the store)
//!     16    16  namespace id
//!     32    32  key
//!     64     2  group (u16)
//!     66     2  reserved, must be zero
//!     68     4  payload CRC32C (u32, Castagnoli)
//!     72     8  payload length (u64)
//!     80     8  created time (u64, unix milliseconds)
//!     88     4  name length N (u32), at most MAX_NAME_LEN
//!     92     N  name bytes (e.g. a RESP key string), absent when N = 0
//!   92+N     4  header CRC32C over bytes [0, 92+N)
//!   96+N     P  zero padding up to the header length (checked on decode)
//! ```
//!
//! A header without a name is 128 bytes. The payload follows the header; its
//! alignment on disk is the store's business, not the format's.
//!
//! A chunk whose `name` is `None` and one whose name is empty are the same on
//! disk (N = 0); decoding yields `None`.
//!
//! Decoding checks, in this order and before allocating anything: that the
//! fixed part is present, the magic, the version, the reserved fields, the
//! name length limit, that the header length matches the name length, that
//! the whole header is present, the header CRC, and that the padding is zero.
//! As a result every single flipped byte of an encoded header is rejected.

use bytes::Bytes;

use crate::types::{ChunkId, ChunkKey, GroupId, Namespace};

/// Magic bytes at offset 0 of every chunk header.
pub const MAGIC: [u8; 4] = *b"KVTC";
/// The chunk format version this build writes and reads.
pub const FORMAT_VERSION: u16 = 1;
/// Headers are zero-padded to a multiple of this many bytes.
pub const HEADER_ALIGN: usize = 64;
/// Length of the fixed part of the header (everything before the name).
pub const FIXED_HEADER_LEN: usize = 92;
/// Longest name a header may carry (64 KiB).
pub const MAX_NAME_LEN: usize = 64 * 1024;
/// Length of the header CRC that follows the name.
pub const HEADER_CRC_LEN: usize = 4;
/// Longest possible encoded header (with a name of [`MAX_NAME_LEN`] bytes).
pub const MAX_HEADER_LEN: usize = padded_usize(FIXED_HEADER_LEN + MAX_NAME_LEN + HEADER_CRC_LEN);

// Byte offsets of the fixed part; see the table in the module docs.
const OFF_MAGIC: usize = 0;
const OFF_VERSION: usize = 4;
const OFF_RESERVED0: usize = 6;
const OFF_HEADER_LEN: usize = 8;
const OFF_FLAGS: usize = 12;
const OFF_NAMESPACE: usize = 16;
const OFF_KEY: usize = 32;
const OFF_GROUP: usize = 64;
const OFF_RESERVED1: usize = 66;
const OFF_PAYLOAD_CRC: usize = 68;
const OFF_PAYLOAD_LEN: usize = 72;
const OFF_CREATED: usize = 80;
const OFF_NAME_LEN: usize = 88;
const OFF_NAME: usize = FIXED_HEADER_LEN;

const _: () = assert!(OFF_NAME_LEN + 4 == FIXED_HEADER_LEN);
const _: () = assert!(MAX_HEADER_LEN <= u32::MAX as usize);

const fn padded_usize(len: usize) -> usize {
    len.div_ceil(HEADER_ALIGN) * HEADER_ALIGN
}

/// CRC32C (Castagnoli) of `data`, hardware-accelerated where available.
pub fn crc32c(data: &[u8]) -> u32 {
    crc_fast::crc32_iscsi(data)
}

/// A CRC32C computed over pieces, as if over their concatenation.
pub struct Crc32c(crc_fast::Digest);

impl Default for Crc32c {
    fn default() -> Self {
        Self(crc_fast::Digest::new(crc_fast::CrcAlgorithm::Crc32Iscsi))
    }
}

impl Crc32c {
    /// Adds the next piece.
    pub fn update(&mut self, data: &[u8]) {
        self.0.update(data);
    }

    /// The CRC32C of everything added so far.
    pub fn value(&self) -> u32 {
        // A 32-bit CRC's value always fits its 32 bits.
        self.0.finalize() as u32
    }
}

/// The CRC32C of `a`'s bytes followed by `b`'s `len_b` bytes, from the two
/// CRCs alone.
pub fn crc32c_combine(a: u32, b: u32, len_b: u64) -> u32 {
    crc_fast::checksum_combine(
        crc_fast::CrcAlgorithm::Crc32Iscsi,
        u64::from(a),
        u64::from(b),
        len_b,
    ) as u32
}

/// `len` rounded up to a multiple of `align`.
///
/// Saturates to `u64::MAX` when the result does not fit in a `u64` or `align`
/// is zero, so a length read from disk can never wrap around; callers compare
/// the result against their region or file size and reject it.
pub fn padded(len: u64, align: u64) -> u64 {
    len.checked_next_multiple_of(align).unwrap_or(u64::MAX)
}

/// A malformed or mismatching chunk header or payload.
///
/// Every variant carries the numbers a human needs to tell what went wrong.
/// Converted to [`crate::Error::Corrupt`] (or
/// [`crate::Error::IncompatibleVersion`] for versions) by `From`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FormatError {
    /// Fewer bytes than the header needs.
    #[error("truncated chunk header: need {need} bytes, have {have}")]
    Truncated {
        /// Bytes needed to go on.
        need: usize,
        /// Bytes available.
        have: usize,
    },
    /// The first four bytes are not `KVTC`.
    #[error("bad chunk magic {found:02x?} (expected \"KVTC\")")]
    BadMagic {
        /// The bytes found.
        found: [u8; 4],
    },
    /// A chunk written by another format version.
    #[error("chunk format version {found} is not supported (this build reads version {supported})")]
    UnsupportedVersion {
        /// The version in the header.
        found: u16,
        /// The version this build reads.
        supported: u16,
    },
    /// A reserved field or the padding holds a non-zero byte.
    #[error(
        "non-zero byte {value:#04x} at offset {offset} of a chunk header (reserved or padding)"
    )]
    NonZeroReserved {
        /// Offset of the first non-zero byte within the header.
        offset: usize,
        /// Its value.
        value: u8,
    },
    /// The stored header length does not match the name length.
    #[error(
        "chunk header length {stored} does not match its name length {name_len} (expected {expected})"
    )]
    HeaderLength {
        /// The header length field.
        stored: u32,
        /// The name length field.
        name_len: u32,
        /// The header length that name length implies.
        expected: u32,
    },
    /// The header CRC does not match its bytes.
    #[error("chunk header CRC mismatch: stored {stored:#010x}, computed {computed:#010x}")]
    HeaderCrc {
        /// CRC stored in the header.
        stored: u32,
        /// CRC of the bytes read.
        computed: u32,
    },
    /// The payload CRC does not match the payload.
    #[error("chunk payload CRC mismatch: stored {stored:#010x}, computed {computed:#010x}")]
    PayloadCrc {
        /// CRC stored in the header.
        stored: u32,
        /// CRC of the payload read.
        computed: u32,
    },
    /// The payload is not as long as the header says.
    #[error("chunk payload length mismatch: header says {expected} bytes, got {actual}")]
    PayloadLength {
        /// Length in the header.
        expected: u64,
        /// Length of the payload read.
        actual: u64,
    },
    /// The header belongs to another chunk (namespace, key or group differ).
    #[error("chunk identity mismatch: expected {expected:?}, found {found:?}")]
    Identity {
        /// The id that was asked for.
        expected: Box<ChunkId>,
        /// The id in the header.
        found: Box<ChunkId>,
    },
    /// The stored name differs from the expected one (a key hash collision
    /// or a chunk stored without a name).
    #[error("chunk name mismatch: expected {expected_len} bytes, found {found_len:?} bytes")]
    NameMismatch {
        /// Length of the expected name.
        expected_len: usize,
        /// Length of the stored name (`None`: no name stored).
        found_len: Option<usize>,
    },
    /// A field exceeds its limit.
    #[error("{what} of {len} bytes is too long (limit {max})")]
    TooLong {
        /// Which field.
        what: &'static str,
        /// Its length.
        len: u64,
        /// The limit.
        max: u64,
    },
}

impl From<FormatError> for crate::Error {
    fn from(e: FormatError) -> Self {
        match e {
            FormatError::UnsupportedVersion { found, supported } => {
                crate::Error::IncompatibleVersion {
                    what: "chunk format",
                    found: u32::from(found),
                    supported: supported.to_string(),
                    hint: "read it with a kvtier build that supports that chunk format version",
                }
            }
            FormatError::PayloadCrc { .. } | FormatError::PayloadLength { .. } => {
                crate::Error::Corrupt {
                    what: "chunk payload".into(),
                    detail: e.to_string(),
                }
            }
            _ => crate::Error::Corrupt {
                what: "chunk header".into(),
                detail: e.to_string(),
            },
        }
    }
}

/// The decoded header of one chunk.
///
/// Build it with [`ChunkHeader::for_payload`], write it with
/// [`ChunkHeader::encode_into`], read it back with [`ChunkHeader::decode`],
/// then check it with [`ChunkHeader::check_identity`] and the payload with
/// [`ChunkHeader::verify_payload`] before serving any byte.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkHeader {
    /// Namespace, key and group of the chunk.
    pub id: ChunkId,
    /// Payload length in bytes.
    pub payload_len: u64,
    /// CRC32C of the payload.
    pub payload_crc: u32,
    /// Creation time, unix milliseconds.
    pub created_ms: u64,
    /// Flags for the store's use; format v1 assigns no meaning to them.
    pub flags: u32,
    /// Optional name (e.g. a RESP key string), compared on read. An empty
    /// name is encoded like no name and decodes as `None`.
    pub name: Option<Bytes>,
}

#[inline]
fn le_u16(buf: &[u8], off: usize) -> u16 {
    u16::from_le_bytes([buf[off], buf[off + 1]])
}

#[inline]
fn le_u32(buf: &[u8], off: usize) -> u32 {
    let mut b = [0u8; 4];
    b.copy_from_slice(&buf[off..off + 4]);
    u32::from_le_bytes(b)
}

#[inline]
fn le_u64(buf: &[u8], off: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&buf[off..off + 8]);
    u64::from_le_bytes(b)
}

impl ChunkHeader {
    /// A header for `payload` (its length and CRC32C are computed here).
    pub fn for_payload(id: ChunkId, name: Option<Bytes>, payload: &[u8], created_ms: u64) -> Self {
        Self {
            id,
            payload_len: payload.len() as u64,
            payload_crc: crc32c(payload),
            created_ms,
            flags: 0,
            name,
        }
    }

    fn name_len(&self) -> usize {
        self.name.as_ref().map_or(0, |n| n.len())
    }

    /// Encoded (padded) length of this header.
    pub fn encoded_len(&self) -> usize {
        Self::encoded_len_for_name(self.name_len())
    }

    /// Encoded (padded) length of a header carrying a name of `name_len`
    /// bytes. Not meaningful for `name_len > MAX_NAME_LEN`.
    pub fn encoded_len_for_name(name_len: usize) -> usize {
        padded_usize(FIXED_HEADER_LEN + name_len + HEADER_CRC_LEN)
    }

    /// Checks that a name of `len` bytes fits in a header; callers check
    /// names when they are accepted (PUT) so encoding never fails later.
    pub fn check_name_len(len: usize) -> Result<(), FormatError> {
        if len > MAX_NAME_LEN {
            return Err(FormatError::TooLong {
                what: "chunk name",
                len: len as u64,
                max: MAX_NAME_LEN as u64,
            });
        }
        Ok(())
    }

    /// Writes the header, padding included, to the start of `out` and
    /// returns its length ([`ChunkHeader::encoded_len`]).
    ///
    /// # Panics
    /// If `out` is shorter than [`ChunkHeader::encoded_len`] or the name is
    /// longer than [`MAX_NAME_LEN`] (check it with
    /// [`ChunkHeader::check_name_len`] first): both are caller bugs.
    pub fn encode_into(&self, out: &mut [u8]) -> usize {
        let name: &[u8] = self.name.as_deref().unwrap_or(&[]);
        assert!(
            name.len() <= MAX_NAME_LEN,
            "chunk name longer than MAX_NAME_LEN"
        );
        let len = self.encoded_len();
        assert!(
            out.len() >= len,
            "encode buffer of {} bytes < header {len}",
            out.len()
        );
        let out = &mut out[..len];
        out[OFF_MAGIC..OFF_MAGIC + 4].copy_from_slice(&MAGIC);
        out[OFF_VERSION..OFF_VERSION + 2].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        out[OFF_RESERVED0..OFF_RESERVED0 + 2].fill(0);
        // Fits: len <= MAX_HEADER_LEN <= u32::MAX (const-asserted above).
        out[OFF_HEADER_LEN..OFF_HEADER_LEN + 4].copy_from_slice(&(len as u32).to_le_bytes());
        out[OFF_FLAGS..OFF_FLAGS + 4].copy_from_slice(&self.flags.to_le_bytes());
        out[OFF_NAMESPACE..OFF_NAMESPACE + 16].copy_from_slice(&self.id.ns.0);
        out[OFF_KEY..OFF_KEY + 32].copy_from_slice(&self.id.key.0);
        out[OFF_GROUP..OFF_GROUP + 2].copy_from_slice(&self.id.group.to_le_bytes());
        out[OFF_RESERVED1..OFF_RESERVED1 + 2].fill(0);
        out[OFF_PAYLOAD_CRC..OFF_PAYLOAD_CRC + 4].copy_from_slice(&self.payload_crc.to_le_bytes());
        out[OFF_PAYLOAD_LEN..OFF_PAYLOAD_LEN + 8].copy_from_slice(&self.payload_len.to_le_bytes());
        out[OFF_CREATED..OFF_CREATED + 8].copy_from_slice(&self.created_ms.to_le_bytes());
        out[OFF_NAME_LEN..OFF_NAME_LEN + 4].copy_from_slice(&(name.len() as u32).to_le_bytes());
        let crc_at = OFF_NAME + name.len();
        out[OFF_NAME..crc_at].copy_from_slice(name);
        let crc = crc32c(&out[..crc_at]);
        out[crc_at..crc_at + HEADER_CRC_LEN].copy_from_slice(&crc.to_le_bytes());
        out[crc_at + HEADER_CRC_LEN..].fill(0);
        len
    }

    /// The encoded header in a new vector.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.encoded_len()];
        self.encode_into(&mut out);
        out
    }

    /// Validates the fixed part at the start of `buf` and returns the whole
    /// header length, for readers that read [`FIXED_HEADER_LEN`] bytes first
    /// and then the rest. Needs at least [`FIXED_HEADER_LEN`] bytes.
    pub fn peek_len(buf: &[u8]) -> Result<usize, FormatError> {
        if buf.len() < FIXED_HEADER_LEN {
            return Err(FormatError::Truncated {
                need: FIXED_HEADER_LEN,
                have: buf.len(),
            });
        }
        let magic = [buf[0], buf[1], buf[2], buf[3]];
        if magic != MAGIC {
            return Err(FormatError::BadMagic { found: magic });
        }
        let version = le_u16(buf, OFF_VERSION);
        if version != FORMAT_VERSION {
            return Err(FormatError::UnsupportedVersion {
                found: version,
                supported: FORMAT_VERSION,
            });
        }
        for off in (OFF_RESERVED0..OFF_RESERVED0 + 2).chain(OFF_RESERVED1..OFF_RESERVED1 + 2) {
            if buf[off] != 0 {
                return Err(FormatError::NonZeroReserved {
                    offset: off,
                    value: buf[off],
                });
            }
        }
        let name_len = le_u32(buf, OFF_NAME_LEN);
        if name_len as usize > MAX_NAME_LEN {
            return Err(FormatError::TooLong {
                what: "chunk name",
                len: u64::from(name_len),
                max: MAX_NAME_LEN as u64,
            });
        }
        let stored = le_u32(buf, OFF_HEADER_LEN);
        let expected = Self::encoded_len_for_name(name_len as usize);
        if stored as usize != expected {
            return Err(FormatError::HeaderLength {
                stored,
                name_len,
                // Fits: expected <= MAX_HEADER_LEN <= u32::MAX.
                expected: expected as u32,
            });
        }
        Ok(expected)
    }

    /// Decodes and checks a header at the start of `buf` (bytes after the
    /// header are ignored). Checks magic, version, reserved fields, lengths,
    /// completeness (before allocating), the header CRC and zero padding.
    pub fn decode(buf: &[u8]) -> Result<ChunkHeader, FormatError> {
        let len = Self::peek_len(buf)?;
        if buf.len() < len {
            return Err(FormatError::Truncated {
                need: len,
                have: buf.len(),
            });
        }
        let buf = &buf[..len];
        let name_len = le_u32(buf, OFF_NAME_LEN) as usize;
        let crc_at = OFF_NAME + name_len;
        let stored = le_u32(buf, crc_at);
        let computed = crc32c(&buf[..crc_at]);
        if stored != computed {
            return Err(FormatError::HeaderCrc { stored, computed });
        }
        let pad_at = crc_at + HEADER_CRC_LEN;
        if let Some(i) = buf[pad_at..].iter().position(|&b| b != 0) {
            return Err(FormatError::NonZeroReserved {
                offset: pad_at + i,
                value: buf[pad_at + i],
            });
        }
        let mut ns = [0u8; 16];
        ns.copy_from_slice(&buf[OFF_NAMESPACE..OFF_NAMESPACE + 16]);
        let mut key = [0u8; 32];
        key.copy_from_slice(&buf[OFF_KEY..OFF_KEY + 32]);
        let group: GroupId = le_u16(buf, OFF_GROUP);
        let name = (name_len > 0).then(|| Bytes::copy_from_slice(&buf[OFF_NAME..crc_at]));
        Ok(ChunkHeader {
            id: ChunkId::new(Namespace(ns), ChunkKey(key), group),
            payload_len: le_u64(buf, OFF_PAYLOAD_LEN),
            payload_crc: le_u32(buf, OFF_PAYLOAD_CRC),
            created_ms: le_u64(buf, OFF_CREATED),
            flags: le_u32(buf, OFF_FLAGS),
            name,
        })
    }

    /// Checks that `payload` has the length and CRC32C this header records.
    pub fn verify_payload(&self, payload: &[u8]) -> Result<(), FormatError> {
        if payload.len() as u64 != self.payload_len {
            return Err(FormatError::PayloadLength {
                expected: self.payload_len,
                actual: payload.len() as u64,
            });
        }
        self.check_payload_crc(crc32c(payload))
    }

    /// Checks a payload CRC32C computed elsewhere (e.g. piece by piece as a
    /// read lands) against the header's; the length is the caller's check.
    pub fn check_payload_crc(&self, computed: u32) -> Result<(), FormatError> {
        if computed != self.payload_crc {
            return Err(FormatError::PayloadCrc {
                stored: self.payload_crc,
                computed,
            });
        }
        Ok(())
    }

    /// Checks that this header belongs to `expected` (namespace, key and
    /// group). With `name: Some(n)` the header must also carry exactly the
    /// name `n` (an empty `n` matches a header without name); with `None` the
    /// stored name is not compared (plain key reads).
    pub fn check_identity(
        &self,
        expected: &ChunkId,
        name: Option<&[u8]>,
    ) -> Result<(), FormatError> {
        if self.id != *expected {
            return Err(FormatError::Identity {
                expected: Box::new(*expected),
                found: Box::new(self.id),
            });
        }
        if let Some(want) = name {
            let have: &[u8] = self.name.as_deref().unwrap_or(&[]);
            if have != want {
                return Err(FormatError::NameMismatch {
                    expected_len: want.len(),
                    found_len: self.name.as_ref().map(|n| n.len()),
                });
            }
        }
        Ok(())
    }
}

#[cfg(feature = "arbitrary")]
impl<'a> arbitrary::Arbitrary<'a> for ChunkHeader {
    fn arbitrary(u: &mut arbitrary::Unstructured<'a>) -> arbitrary::Result<Self> {
        let id = ChunkId::arbitrary(u)?;
        let name_len = u.int_in_range(0..=512usize)?;
        let name: Option<Bytes> = if bool::arbitrary(u)? && name_len > 0 {
            Some(Bytes::copy_from_slice(u.bytes(name_len)?))
        } else {
            None
        };
        Ok(Self {
            id,
            payload_len: u64::arbitrary(u)?,
            payload_crc: u32::arbitrary(u)?,
            created_ms: u64::arbitrary(u)?,
            flags: u32::arbitrary(u)?,
            name,
        })
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn sample(name: Option<&[u8]>) -> ChunkHeader {
        let id = ChunkId::new(Namespace([7; 16]), ChunkKey([0xa5; 32]), 3);
        let mut h = ChunkHeader::for_payload(
            id,
            name.map(Bytes::copy_from_slice),
            b"payload bytes",
            1_700_000_000_123,
        );
        h.flags = 0x0102_0304;
        h
    }

    #[test]
    fn round_trips_with_and_without_name() {
        for name in [None, Some(&b"resp:key:1"[..]), Some(&[0u8; 200][..])] {
            let h = sample(name);
            let enc = h.encode();
            assert_eq!(enc.len(), h.encoded_len());
            assert_eq!(enc.len() % HEADER_ALIGN, 0);
            assert_eq!(ChunkHeader::peek_len(&enc).unwrap(), enc.len());
            assert_eq!(ChunkHeader::decode(&enc).unwrap(), h);
            // Trailing bytes (the payload) are ignored.
            let mut with_tail = enc.clone();
            with_tail.extend_from_slice(b"payload bytes");
            assert_eq!(ChunkHeader::decode(&with_tail).unwrap(), h);
        }
        assert_eq!(sample(None).encoded_len(), 128);
        assert_eq!(ChunkHeader::encoded_len_for_name(32), 128);
        assert_eq!(ChunkHeader::encoded_len_for_name(33), 192);
    }

    #[test]
    fn empty_name_decodes_as_none() {
        let mut h = sample(None);
        h.name = Some(Bytes::new());
        let dec = ChunkHeader::decode(&h.encode()).unwrap();
        assert_eq!(dec.name, None);
        assert_eq!(dec.encode(), h.encode());
    }

    #[test]
    fn every_flipped_byte_is_rejected() {
        for name in [
            None,
            Some(&b"a RESP key string that spans"[..]),
            Some(&b"x"[..]),
        ] {
            let enc = sample(name).encode();
            for i in 0..enc.len() {
                for mask in [0x01u8, 0x80, 0xff] {
                    let mut bad = enc.clone();
                    bad[i] ^= mask;
                    assert!(
                        ChunkHeader::decode(&bad).is_err(),
                        "flip {mask:#x} at byte {i} of {} accepted",
                        enc.len()
                    );
                }
            }
        }
    }

    #[test]
    fn every_truncation_is_rejected() {
        for name in [None, Some(&b"some name"[..])] {
            let enc = sample(name).encode();
            for n in 0..enc.len() {
                match ChunkHeader::decode(&enc[..n]) {
                    Err(FormatError::Truncated { need, have }) => {
                        assert_eq!(have, n);
                        assert!(need > n);
                    }
                    other => panic!("truncation to {n} gave {other:?}"),
                }
            }
        }
    }

    #[test]
    fn specific_errors_are_reported() {
        let enc = sample(Some(b"nm")).encode();
        let mut bad = enc.clone();
        bad[0] = b'X';
        assert!(matches!(
            ChunkHeader::decode(&bad),
            Err(FormatError::BadMagic { .. })
        ));
        let mut bad = enc.clone();
        bad[OFF_VERSION..OFF_VERSION + 2].copy_from_slice(&2u16.to_le_bytes());
        assert_eq!(
            ChunkHeader::decode(&bad),
            Err(FormatError::UnsupportedVersion {
                found: 2,
                supported: 1
            })
        );
        let e: crate::Error = ChunkHeader::decode(&bad).unwrap_err().into();
        assert!(
            matches!(e, crate::Error::IncompatibleVersion { found: 2, .. }),
            "{e}"
        );
        let mut bad = enc.clone();
        bad[OFF_NAME_LEN..OFF_NAME_LEN + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            ChunkHeader::decode(&bad),
            Err(FormatError::TooLong { .. })
        ));
        let mut bad = enc.clone();
        bad[OFF_NAME_LEN] = 40;
        assert!(matches!(
            ChunkHeader::decode(&bad),
            Err(FormatError::HeaderLength { .. })
        ));
        let mut bad = enc.clone();
        bad[OFF_NAME] ^= 1;
        assert!(matches!(
            ChunkHeader::decode(&bad),
            Err(FormatError::HeaderCrc { .. })
        ));
        let e: crate::Error = ChunkHeader::decode(&bad).unwrap_err().into();
        assert!(matches!(e, crate::Error::Corrupt { .. }), "{e}");
        let mut bad = enc.clone();
        *bad.last_mut().unwrap() = 1;
        assert!(matches!(
            ChunkHeader::decode(&bad),
            Err(FormatError::NonZeroReserved {
                offset: 127,
                value: 1
            })
        ));
    }

    #[test]
    fn a_huge_name_length_does_not_allocate_before_the_truncation_check() {
        let mut h = sample(None);
        h.name = Some(Bytes::from(vec![b'n'; MAX_NAME_LEN]));
        let enc = h.encode();
        assert_eq!(enc.len(), MAX_HEADER_LEN);
        assert_eq!(ChunkHeader::decode(&enc).unwrap(), h);
        assert!(matches!(
            ChunkHeader::decode(&enc[..FIXED_HEADER_LEN]),
            Err(FormatError::Truncated {
                need: MAX_HEADER_LEN,
                ..
            })
        ));
        assert!(ChunkHeader::check_name_len(MAX_NAME_LEN).is_ok());
        assert!(ChunkHeader::check_name_len(MAX_NAME_LEN + 1).is_err());
    }

    #[test]
    fn payload_and_identity_checks() {
        let id = ChunkId::new(Namespace([1; 16]), ChunkKey([2; 32]), 0);
        let h = ChunkHeader::for_payload(id, Some(Bytes::from_static(b"k")), b"abc", 5);
        assert!(h.verify_payload(b"abc").is_ok());
        assert!(matches!(
            h.verify_payload(b"abd"),
            Err(FormatError::PayloadCrc { .. })
        ));
        assert_eq!(
            h.verify_payload(b"ab"),
            Err(FormatError::PayloadLength {
                expected: 3,
                actual: 2
            })
        );
        assert!(h.check_identity(&id, None).is_ok());
        assert!(h.check_identity(&id, Some(b"k")).is_ok());
        assert!(matches!(
            h.check_identity(&id, Some(b"K")),
            Err(FormatError::NameMismatch { .. })
        ));
        for other in [
            ChunkId::new(Namespace([9; 16]), id.key, id.group),
            ChunkId::new(id.ns, ChunkKey([9; 32]), id.group),
            ChunkId::new(id.ns, id.key, 1),
        ] {
            assert!(matches!(
                h.check_identity(&other, None),
                Err(FormatError::Identity { .. })
            ));
        }
        let unnamed = ChunkHeader::for_payload(id, None, b"abc", 5);
        assert_eq!(
            unnamed.check_identity(&id, Some(b"k")),
            Err(FormatError::NameMismatch {
                expected_len: 1,
                found_len: None
            })
        );
    }

    #[test]
    fn padded_rounds_up_and_saturates() {
        assert_eq!(padded(0, 4096), 0);
        assert_eq!(padded(1, 4096), 4096);
        assert_eq!(padded(4096, 4096), 4096);
        assert_eq!(padded(u64::MAX - 1, 4096), u64::MAX);
        assert_eq!(padded(5, 0), u64::MAX);
    }

    fn arb_header() -> impl Strategy<Value = ChunkHeader> {
        (
            any::<[u8; 16]>(),
            any::<[u8; 32]>(),
            any::<u16>(),
            any::<u64>(),
            any::<u32>(),
            any::<u64>(),
            any::<u32>(),
            proptest::option::of(proptest::collection::vec(any::<u8>(), 1..300)),
        )
            .prop_map(
                |(ns, key, group, payload_len, payload_crc, created_ms, flags, name)| ChunkHeader {
                    id: ChunkId::new(Namespace(ns), ChunkKey(key), group),
                    payload_len,
                    payload_crc,
                    created_ms,
                    flags,
                    name: name.map(Bytes::from),
                },
            )
    }

    proptest! {
        /// The CRC32C helpers agree with the `crc32c` crate (an independent
        /// implementation) on every length, split and alignment: the
        /// folding kernels switch paths at 16, 64, 256 bytes and more.
        #[test]
        fn proptest_crc32c_matches_the_reference(
            data in prop::collection::vec(any::<u8>(), 0..5000),
            skip in 0usize..64,
            cut in any::<prop::sample::Index>(),
        ) {
            let data = &data[skip.min(data.len())..];
            let at = cut.index(data.len() + 1);
            let (a, b) = data.split_at(at);
            let want = crc32c::crc32c(data);
            prop_assert_eq!(crc32c(data), want);
            let mut pieces = Crc32c::default();
            pieces.update(a);
            pieces.update(b);
            prop_assert_eq!(pieces.value(), want);
            prop_assert_eq!(crc32c_combine(crc32c(a), crc32c(b), b.len() as u64), want);
        }

        #[test]
        fn proptest_round_trip(h in arb_header()) {
            let enc = h.encode();
            prop_assert_eq!(enc.len() % HEADER_ALIGN, 0);
            prop_assert_eq!(ChunkHeader::decode(&enc).unwrap(), h);
        }

        #[test]
        fn proptest_flip_rejected(h in arb_header(), pos in any::<prop::sample::Index>(), mask in 1u8..=255) {
            let mut enc = h.encode();
            let i = pos.index(enc.len());
            enc[i] ^= mask;
            prop_assert!(ChunkHeader::decode(&enc).is_err());
        }

        #[test]
        fn proptest_arbitrary_bytes_never_panic(buf in proptest::collection::vec(any::<u8>(), 0..400)) {
            if let Ok(h) = ChunkHeader::decode(&buf) {
                let enc = h.encode();
                prop_assert_eq!(&buf[..enc.len()], &enc[..]);
            }
        }
    }
}
