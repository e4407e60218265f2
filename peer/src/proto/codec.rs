//! A small little-endian codec: bounds-checked reads, appending writes.
//!
//! Every read checks the remaining length first and returns
//! [`DecodeError::Truncated`] instead of panicking; nothing here allocates
//! more than the bytes actually present.

use crate::id::{PeerChunkId, PeerNamespace};

/// Why a frame or message could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// Fewer bytes than the structure needs.
    #[error("truncated: needed {needed} more bytes, {available} available")]
    Truncated {
        /// Bytes needed.
        needed: u64,
        /// Bytes available.
        available: u64,
    },
    /// The frame does not start with the protocol magic.
    #[error("bad magic {0:02x?}, expected \"KVTP\"")]
    BadMagic([u8; 4]),
    /// The frame uses a protocol version this build does not speak.
    #[error("unsupported protocol version {found} (this build speaks {supported})")]
    Version {
        /// Version found in the frame.
        found: u8,
        /// Version this build speaks.
        supported: u8,
    },
    /// The frame's body is larger than the limit.
    #[error("frame body of {len} bytes exceeds the limit of {max}")]
    TooLong {
        /// Declared body length.
        len: u64,
        /// Limit.
        max: u64,
    },
    /// The frame's CRC32C does not match its bytes.
    #[error("frame crc mismatch: stored {stored:#010x}, computed {computed:#010x}")]
    Crc {
        /// CRC in the frame header.
        stored: u32,
        /// CRC computed over the received bytes.
        computed: u32,
    },
    /// The message kind byte is unknown.
    #[error("unknown message kind {0}")]
    UnknownKind(u8),
    /// A field holds a value outside its domain.
    #[error("invalid field {field}: {why}")]
    Invalid {
        /// Field name.
        field: &'static str,
        /// What is wrong.
        why: &'static str,
    },
    /// Bytes left over after the message.
    #[error("{0} trailing bytes after the message")]
    Trailing(u64),
}

/// Reads little-endian values from a byte slice.
pub struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    /// Wraps `buf`.
    pub fn new(buf: &'a [u8]) -> Self {
        Self { buf }
    }

    /// Bytes not read yet.
    pub fn remaining(&self) -> usize {
        self.buf.len()
    }

    /// Takes `n` bytes.
    pub fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if self.buf.len() < n {
            return Err(DecodeError::Truncated {
                needed: n as u64,
                available: self.buf.len() as u64,
            });
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }

    /// Takes a fixed-size array.
    pub fn array<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let s = self.take(N)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    /// Reads a `u8`.
    pub fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.array::<1>()?[0])
    }

    /// Reads a little-endian `u16`.
    pub fn u16(&mut self) -> Result<u16, DecodeError> {
        Ok(u16::from_le_bytes(self.array()?))
    }

    /// Reads a little-endian `u32`.
    pub fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    /// Reads a little-endian `u64`.
    pub fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// Reads a chunk id (50 bytes).
    pub fn chunk_id(&mut self) -> Result<PeerChunkId, DecodeError> {
        let ns = PeerNamespace(self.array()?);
        let key = self.array()?;
        let group = self.u16()?;
        Ok(PeerChunkId { ns, key, group })
    }

    /// Reads a string with a `u8` length prefix (UTF-8 checked).
    pub fn short_str(&mut self, field: &'static str) -> Result<String, DecodeError> {
        let n = self.u8()? as usize;
        let s = self.take(n)?;
        std::str::from_utf8(s)
            .map(str::to_owned)
            .map_err(|_| DecodeError::Invalid {
                field,
                why: "not UTF-8",
            })
    }

    /// Reads a byte string with a `u32` length prefix.
    pub fn long_bytes(&mut self) -> Result<&'a [u8], DecodeError> {
        let n = self.u32()? as usize;
        self.take(n)
    }

    /// Reads a `u32` element count and checks that `count * min_elem_len`
    /// bytes are present, so a lying count cannot make us allocate.
    pub fn count(&mut self, min_elem_len: usize) -> Result<usize, DecodeError> {
        let n = self.u32()? as usize;
        let needed = n.saturating_mul(min_elem_len);
        if needed > self.buf.len() {
            return Err(DecodeError::Truncated {
                needed: needed as u64,
                available: self.buf.len() as u64,
            });
        }
        Ok(n)
    }

    /// Fails if bytes are left.
    pub fn finish(&self) -> Result<(), DecodeError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(DecodeError::Trailing(self.buf.len() as u64))
        }
    }
}

/// Appends little-endian values to a `Vec<u8>`.
pub trait WriteExt {
    /// Appends a `u16`.
    fn put_u16_le(&mut self, v: u16);
    /// Appends a `u32`.
    fn put_u32_le(&mut self, v: u32);
    /// Appends a `u64`.
    fn put_u64_le(&mut self, v: u64);
    /// Appends a chunk id.
    fn put_chunk_id(&mut self, id: &PeerChunkId);
    /// Appends a string of at most 255 bytes with a `u8` length (longer
    /// strings are cut at a char boundary).
    fn put_short_str(&mut self, s: &str);
}

impl WriteExt for Vec<u8> {
    fn put_u16_le(&mut self, v: u16) {
        self.extend_from_slice(&v.to_le_bytes());
    }
    fn put_u32_le(&mut self, v: u32) {
        self.extend_from_slice(&v.to_le_bytes());
    }
    fn put_u64_le(&mut self, v: u64) {
        self.extend_from_slice(&v.to_le_bytes());
    }
    fn put_chunk_id(&mut self, id: &PeerChunkId) {
        self.extend_from_slice(&id.ns.0);
        self.extend_from_slice(&id.key);
        self.put_u16_le(id.group);
    }
    fn put_short_str(&mut self, s: &str) {
        let mut end = s.len().min(255);
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        self.push(end as u8);
        self.extend_from_slice(&s.as_bytes()[..end]);
    }
}
