//! Sans-IO codec of the native protocol: frame header, requests, replies.
//!
//! Nothing here touches a socket or a clock: [`decode_frame`] looks at a byte
//! slice and says "need more", "here is a frame" or "this is not a frame";
//! [`encode_request`] / [`encode_response`] append to a `Vec`. The layout is
//! specified byte by byte in `node/PROTOCOL.md`; the tables below mirror it.
//!
//! Frame header (32 bytes, little-endian):
//!
//! | offset | size | field                                                 |
//! |-------:|-----:|-------------------------------------------------------|
//! |      0 |    4 | magic `KVTN`                                          |
//! |      4 |    2 | protocol version (1)                                  |
//! |      6 |    2 | op; replies set bit 15 ([`REPLY_BIT`])                |
//! |      8 |    2 | flags ([`FLAG_ATOMIC`] on PUT, [`FLAG_KEYS_IN_REGION`] on LOOKUP; otherwise 0) |
//! |     10 |    2 | status: 0 in requests; 0 or an [`ErrorCode`] in replies |
//! |     12 |    4 | body length                                           |
//! |     16 |    8 | request id (echoed by the reply)                      |
//! |     24 |    4 | CRC32C of the body                                    |
//! |     28 |    4 | CRC32C of bytes 0..28                                 |
//!
//! Decoding checks, in order: magic, version (both at fixed offsets in every
//! version), header CRC, body length against the caller's limit, that the
//! whole frame is present, body CRC. Nothing is allocated before all of them
//! pass; body decoders check every count against the body length first.

use tier::{ChunkKey, Namespace};

mod body;
mod messages;

pub use body::{
    MAX_CLUSTER_RANKS, MAX_RECORD_JSON, decode_reply, decode_request, encode_error,
    encode_keys_request, encode_request, encode_response,
};
pub use messages::{
    FlushReply, GetResult, GetStatus, HelloReply, LookupLocation, RankPrefixReply, RegionEntry,
    Reply, Request, Response,
};

/// Frame magic.
pub const MAGIC: [u8; 4] = *b"KVTN";
/// The protocol version this build speaks.
pub const VERSION: u16 = 1;
/// Size of the frame header.
pub const HEADER_LEN: usize = 32;
/// Bit set in the op of every reply.
pub const REPLY_BIT: u16 = 0x8000;
/// PUT flag: store all chunks of the request atomically (all or none).
pub const FLAG_ATOMIC: u16 = 0x0001;
/// LOOKUP flag: the keys are in the connection's shared-memory region (at
/// an offset the body gives) instead of the frame.
pub const FLAG_KEYS_IN_REGION: u16 = 0x0002;

const OFF_VERSION: usize = 4;
const OFF_OP: usize = 6;
const OFF_FLAGS: usize = 8;
const OFF_STATUS: usize = 10;
const OFF_BODY_LEN: usize = 12;
const OFF_ID: usize = 16;
const OFF_BODY_CRC: usize = 24;
const OFF_HEADER_CRC: usize = 28;

/// Size of a PUT / GET entry: key (32), offset (8), length (8).
pub const REGION_ENTRY_LEN: usize = 48;
/// Size of a GET reply entry: status (1), padding (7), length (8).
pub const GET_RESULT_LEN: usize = 16;
/// Size of the HELLO reply body.
pub const HELLO_REPLY_LEN: usize = 40;

/// Operation codes (header offset 6).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum Op {
    /// Liveness check; empty body both ways.
    Ping = 1,
    /// Protocol version check and namespace registration.
    Hello = 2,
    /// Hands a shared-memory region (memfd, SCM_RIGHTS) to the daemon.
    RegisterRegion = 3,
    /// Longest present prefix of an ordered key list, with locations.
    Lookup = 4,
    /// Per-rank prefixes for a namespace family.
    ClusterLookup = 5,
    /// Stores chunks copied from the region.
    Put = 6,
    /// Reads chunks into the region.
    Get = 7,
    /// Removes chunks.
    Delete = 8,
    /// Makes every dirty chunk durable.
    Flush = 9,
    /// Store and node counters as JSON.
    Stats = 10,
}

impl Op {
    /// The op for a wire code (without the reply bit).
    pub fn from_code(code: u16) -> Option<Op> {
        Some(match code {
            1 => Op::Ping,
            2 => Op::Hello,
            3 => Op::RegisterRegion,
            4 => Op::Lookup,
            5 => Op::ClusterLookup,
            6 => Op::Put,
            7 => Op::Get,
            8 => Op::Delete,
            9 => Op::Flush,
            10 => Op::Stats,
            _ => return None,
        })
    }

    /// Name used in errors and docs.
    pub fn name(self) -> &'static str {
        match self {
            Op::Ping => "PING",
            Op::Hello => "HELLO",
            Op::RegisterRegion => "REGISTER_REGION",
            Op::Lookup => "LOOKUP",
            Op::ClusterLookup => "CLUSTER_LOOKUP",
            Op::Put => "PUT",
            Op::Get => "GET",
            Op::Delete => "DELETE",
            Op::Flush => "FLUSH",
            Op::Stats => "STATS",
        }
    }
}

/// Error codes carried in the status field of a reply (0 means success).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u16)]
#[non_exhaustive]
pub enum ErrorCode {
    /// Not a frame (bad magic, CRC, length); the daemon closes the connection.
    Malformed = 1,
    /// The peer speaks another protocol version; the daemon closes.
    UnsupportedVersion = 2,
    /// Unknown op code.
    UnknownOp = 3,
    /// A well-framed request whose body is invalid.
    BadRequest = 4,
    /// A frame, batch or chunk over a configured limit.
    TooLarge = 5,
    /// An (offset, length) outside the registered region.
    OutOfRange = 6,
    /// PUT / GET before REGISTER_REGION, or a region that cannot be used.
    NoRegion = 7,
    /// The namespace was never registered (send HELLO first).
    UnknownNamespace = 8,
    /// The store failed (I/O, corruption, poisoned).
    Store = 9,
    /// The store is out of space.
    NoSpace = 10,
    /// The daemon does not implement this yet.
    Unimplemented = 11,
    /// The daemon is shutting down.
    ShuttingDown = 12,
    /// The daemon has too many connections.
    Busy = 13,
    /// Anything else.
    Internal = 14,
}

impl ErrorCode {
    /// The code for a wire value; unknown values map to [`ErrorCode::Internal`].
    pub fn from_code(code: u16) -> ErrorCode {
        match code {
            1 => ErrorCode::Malformed,
            2 => ErrorCode::UnsupportedVersion,
            3 => ErrorCode::UnknownOp,
            4 => ErrorCode::BadRequest,
            5 => ErrorCode::TooLarge,
            6 => ErrorCode::OutOfRange,
            7 => ErrorCode::NoRegion,
            8 => ErrorCode::UnknownNamespace,
            9 => ErrorCode::Store,
            10 => ErrorCode::NoSpace,
            11 => ErrorCode::Unimplemented,
            12 => ErrorCode::ShuttingDown,
            13 => ErrorCode::Busy,
            _ => ErrorCode::Internal,
        }
    }

    /// Stable name (also used by the Python client).
    pub fn name(self) -> &'static str {
        match self {
            ErrorCode::Malformed => "malformed",
            ErrorCode::UnsupportedVersion => "unsupported-version",
            ErrorCode::UnknownOp => "unknown-op",
            ErrorCode::BadRequest => "bad-request",
            ErrorCode::TooLarge => "too-large",
            ErrorCode::OutOfRange => "out-of-range",
            ErrorCode::NoRegion => "no-region",
            ErrorCode::UnknownNamespace => "unknown-namespace",
            ErrorCode::Store => "store",
            ErrorCode::NoSpace => "no-space",
            ErrorCode::Unimplemented => "unimplemented",
            ErrorCode::ShuttingDown => "shutting-down",
            ErrorCode::Busy => "busy",
            ErrorCode::Internal => "internal",
        }
    }
}

/// Errors of the codec. [`CodecError::is_fatal`] tells whether the byte
/// `bytes` as text where they are printable ASCII (`"HTTP"`), else `binary`.
fn printable(bytes: &[u8]) -> String {
    if bytes.iter().all(|b| b.is_ascii_graphic() || *b == b' ') {
        format!("{:?}", String::from_utf8_lossy(bytes))
    } else {
        "binary".into()
    }
}

/// stream can still be trusted (a fatal error closes the connection).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CodecError {
    /// The first bytes are not `KVTN`.
    #[error(
        "bad frame magic 0x{} ({}), expected \"KVTN\": the other side does not speak the kvtier native protocol",
        found.iter().map(|b| format!("{b:02x}")).collect::<String>(),
        printable(found)
    )]
    BadMagic {
        /// The bytes found.
        found: [u8; 4],
    },
    /// Another protocol version.
    #[error(
        "protocol version mismatch: the frame speaks version {found}, this side speaks version {supported}"
    )]
    UnsupportedVersion {
        /// Version in the frame.
        found: u16,
        /// Version of this build.
        supported: u16,
    },
    /// Header CRC mismatch.
    #[error("frame header CRC32C mismatch: stored {stored:#010x}, computed {computed:#010x}")]
    HeaderCrc {
        /// Stored CRC.
        stored: u32,
        /// Computed CRC.
        computed: u32,
    },
    /// Body CRC mismatch.
    #[error("frame body CRC32C mismatch: stored {stored:#010x}, computed {computed:#010x}")]
    BodyCrc {
        /// Stored CRC.
        stored: u32,
        /// Computed CRC.
        computed: u32,
    },
    /// Body longer than the receiver accepts.
    #[error("frame body of {len} bytes exceeds the limit of {max} bytes (max-frame)")]
    FrameTooLarge {
        /// Announced body length.
        len: u32,
        /// The limit.
        max: u32,
    },
    /// An op code this side does not know.
    #[error("unknown op code {0}")]
    UnknownOp(u16),
    /// Flag bits not defined for this op.
    #[error("{op}: unknown flag bits {flags:#06x}")]
    UnknownFlags {
        /// The op.
        op: &'static str,
        /// The flags.
        flags: u16,
    },
    /// More entries than the receiver accepts in one request.
    #[error("{op}: batch of {count} entries exceeds the limit of {max} (max-batch)")]
    BatchTooLarge {
        /// The op.
        op: &'static str,
        /// Entries in the request.
        count: u64,
        /// The limit.
        max: u32,
    },
    /// A CLUSTER_LOOKUP of more rank × key probes than one request may ask.
    #[error(
        "{op}: {ranks} ranks x {keys} keys is {} probes, more than the limit of {max} per request",
        *ranks as u64 * *keys as u64
    )]
    TooManyProbes {
        /// The op.
        op: &'static str,
        /// Ranks in the request.
        ranks: usize,
        /// Keys in the request.
        keys: usize,
        /// The limit.
        max: u64,
    },
    /// A namespace record, or a CLUSTER_LOOKUP's rank list, longer than
    /// the receiver accepts.
    #[error("{op}: {what} of {len} exceeds the limit of {max}")]
    TooLong {
        /// The op.
        op: &'static str,
        /// What is too long, with its unit.
        what: &'static str,
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// A body that does not match its op's layout.
    #[error("{op}: malformed body: {detail}")]
    BadBody {
        /// The op.
        op: &'static str,
        /// What is wrong, with the numbers.
        detail: String,
    },
}

impl CodecError {
    /// Whether the stream is desynchronised or untrustworthy (close it).
    pub fn is_fatal(&self) -> bool {
        matches!(
            self,
            CodecError::BadMagic { .. }
                | CodecError::UnsupportedVersion { .. }
                | CodecError::HeaderCrc { .. }
                | CodecError::BodyCrc { .. }
                | CodecError::FrameTooLarge { .. }
        )
    }

    /// The status code a reply to this error carries.
    pub fn code(&self) -> ErrorCode {
        match self {
            CodecError::BadMagic { .. }
            | CodecError::HeaderCrc { .. }
            | CodecError::BodyCrc { .. } => ErrorCode::Malformed,
            CodecError::UnsupportedVersion { .. } => ErrorCode::UnsupportedVersion,
            CodecError::FrameTooLarge { .. }
            | CodecError::BatchTooLarge { .. }
            | CodecError::TooManyProbes { .. }
            | CodecError::TooLong { .. } => ErrorCode::TooLarge,
            CodecError::UnknownOp(_) => ErrorCode::UnknownOp,
            CodecError::UnknownFlags { .. } | CodecError::BadBody { .. } => ErrorCode::BadRequest,
        }
    }
}

/// A parsed, CRC-checked frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// Op code, reply bit included.
    pub op: u16,
    /// Flags.
    pub flags: u16,
    /// Status (replies).
    pub status: u16,
    /// Body length.
    pub body_len: u32,
    /// Request id.
    pub id: u64,
}

/// Outcome of [`decode_frame`].
#[derive(Debug, PartialEq, Eq)]
pub enum Decoded<'a> {
    /// The buffer holds a prefix of a valid frame; `need` is the total frame
    /// length when known (header parsed), else [`HEADER_LEN`].
    Incomplete {
        /// Bytes the whole frame (or at least the header) needs.
        need: usize,
    },
    /// A complete frame.
    Frame {
        /// Its header.
        header: Header,
        /// Its body.
        body: &'a [u8],
        /// Bytes consumed from the buffer (header + body).
        len: usize,
    },
}

fn u16_at(b: &[u8], off: usize) -> u16 {
    u16::from_le_bytes([b[off], b[off + 1]])
}

fn u32_at(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

fn u64_at(b: &[u8], off: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[off..off + 8]);
    u64::from_le_bytes(a)
}

/// Parses the header at the start of `buf` (which may also hold a partial
/// frame). Checks magic and version as soon as their bytes are present.
///
/// Returns `Ok(None)` while fewer than [`HEADER_LEN`] bytes are present.
pub fn decode_header(buf: &[u8], max_body: u32) -> Result<Option<Header>, CodecError> {
    let have = buf.len().min(4);
    if buf[..have] != MAGIC[..have] {
        let mut found = [0u8; 4];
        found[..have].copy_from_slice(&buf[..have]);
        return Err(CodecError::BadMagic { found });
    }
    if buf.len() >= OFF_VERSION + 2 {
        let found = u16_at(buf, OFF_VERSION);
        if found != VERSION {
            return Err(CodecError::UnsupportedVersion {
                found,
                supported: VERSION,
            });
        }
    }
    if buf.len() < HEADER_LEN {
        return Ok(None);
    }
    let stored = u32_at(buf, OFF_HEADER_CRC);
    let computed = tier::format::crc32c(&buf[..OFF_HEADER_CRC]);
    if stored != computed {
        return Err(CodecError::HeaderCrc { stored, computed });
    }
    let body_len = u32_at(buf, OFF_BODY_LEN);
    if body_len > max_body {
        return Err(CodecError::FrameTooLarge {
            len: body_len,
            max: max_body,
        });
    }
    Ok(Some(Header {
        op: u16_at(buf, OFF_OP),
        flags: u16_at(buf, OFF_FLAGS),
        status: u16_at(buf, OFF_STATUS),
        body_len,
        id: u64_at(buf, OFF_ID),
    }))
}

/// Decodes one frame from the start of `buf`, accepting bodies of at most
/// `max_body` bytes. Never allocates.
pub fn decode_frame(buf: &[u8], max_body: u32) -> Result<Decoded<'_>, CodecError> {
    let Some(header) = decode_header(buf, max_body)? else {
        return Ok(Decoded::Incomplete { need: HEADER_LEN });
    };
    let total = HEADER_LEN + header.body_len as usize;
    if buf.len() < total {
        return Ok(Decoded::Incomplete { need: total });
    }
    let body = &buf[HEADER_LEN..total];
    let stored = u32_at(buf, OFF_BODY_CRC);
    let computed = tier::format::crc32c(body);
    if stored != computed {
        return Err(CodecError::BodyCrc { stored, computed });
    }
    Ok(Decoded::Frame {
        header,
        body,
        len: total,
    })
}

/// Appends a frame (header + body written by `body`) to `out`.
pub fn encode_frame(
    out: &mut Vec<u8>,
    op: u16,
    flags: u16,
    status: u16,
    id: u64,
    body: impl FnOnce(&mut Vec<u8>),
) {
    let start = out.len();
    out.extend_from_slice(&[0u8; HEADER_LEN]);
    body(out);
    let body_len = u32::try_from(out.len() - start - HEADER_LEN)
        .expect("frame bodies are bounded by batch limits far below 4 GiB");
    let body_crc = tier::format::crc32c(&out[start + HEADER_LEN..]);
    let h = &mut out[start..start + HEADER_LEN];
    h[0..4].copy_from_slice(&MAGIC);
    h[OFF_VERSION..OFF_VERSION + 2].copy_from_slice(&VERSION.to_le_bytes());
    h[OFF_OP..OFF_OP + 2].copy_from_slice(&op.to_le_bytes());
    h[OFF_FLAGS..OFF_FLAGS + 2].copy_from_slice(&flags.to_le_bytes());
    h[OFF_STATUS..OFF_STATUS + 2].copy_from_slice(&status.to_le_bytes());
    h[OFF_BODY_LEN..OFF_BODY_LEN + 4].copy_from_slice(&body_len.to_le_bytes());
    h[OFF_ID..OFF_ID + 8].copy_from_slice(&id.to_le_bytes());
    h[OFF_BODY_CRC..OFF_BODY_CRC + 4].copy_from_slice(&body_crc.to_le_bytes());
    let header_crc = tier::format::crc32c(&h[..OFF_HEADER_CRC]);
    h[OFF_HEADER_CRC..HEADER_LEN].copy_from_slice(&header_crc.to_le_bytes());
}

/// Limits a decoder enforces on bodies.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Most entries (keys, ranks) in one request.
    pub max_batch: u32,
}

/// A bounds-checked reader over a body.
pub(crate) struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    op: &'static str,
}

impl<'a> Cursor<'a> {
    fn new(buf: &'a [u8], op: &'static str) -> Self {
        Self { buf, pos: 0, op }
    }

    fn bad(&self, detail: String) -> CodecError {
        CodecError::BadBody {
            op: self.op,
            detail,
        }
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], CodecError> {
        let end = self.pos.checked_add(n).filter(|e| *e <= self.buf.len());
        match end {
            Some(end) => {
                let s = &self.buf[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            None => Err(self.bad(format!(
                "{what} needs {n} bytes at offset {} but the body has {}",
                self.pos,
                self.buf.len()
            ))),
        }
    }

    fn u8(&mut self, what: &str) -> Result<u8, CodecError> {
        Ok(self.take(1, what)?[0])
    }
    fn u16(&mut self, what: &str) -> Result<u16, CodecError> {
        Ok(u16_at(self.take(2, what)?, 0))
    }
    fn u32(&mut self, what: &str) -> Result<u32, CodecError> {
        Ok(u32_at(self.take(4, what)?, 0))
    }
    fn u64(&mut self, what: &str) -> Result<u64, CodecError> {
        Ok(u64_at(self.take(8, what)?, 0))
    }
    fn reserved16(&mut self) -> Result<(), CodecError> {
        let v = self.u16("reserved")?;
        if v != 0 {
            return Err(self.bad(format!(
                "reserved field at offset {} is {v}, must be 0",
                self.pos - 2
            )));
        }
        Ok(())
    }
    fn reserved32(&mut self) -> Result<(), CodecError> {
        let v = self.u32("reserved")?;
        if v != 0 {
            return Err(self.bad(format!(
                "reserved field at offset {} is {v}, must be 0",
                self.pos - 4
            )));
        }
        Ok(())
    }
    fn ns(&mut self) -> Result<Namespace, CodecError> {
        let mut a = [0u8; 16];
        a.copy_from_slice(self.take(16, "namespace")?);
        Ok(Namespace(a))
    }
    fn key(&mut self) -> Result<ChunkKey, CodecError> {
        let mut a = [0u8; 32];
        a.copy_from_slice(self.take(32, "key")?);
        Ok(ChunkKey(a))
    }
    /// `n` keys in a row, taken in one bounds check (a LOOKUP of 1,024 keys
    /// decodes as one copy, not 1,024 fallible steps).
    fn keys(&mut self, n: usize) -> Result<Vec<ChunkKey>, CodecError> {
        let len = n
            .checked_mul(32)
            .ok_or_else(|| self.bad(format!("{n} keys overflow the body")))?;
        Ok(keys_from(self.take(len, "keys")?))
    }
    /// Checks that `count` items of `size` bytes fit in what is left, and the
    /// batch limit, before anything is allocated for them.
    fn count(
        &self,
        count: u32,
        size: usize,
        limits: Option<&Limits>,
        what: &str,
    ) -> Result<usize, CodecError> {
        if let Some(l) = limits {
            if count > l.max_batch {
                return Err(CodecError::BatchTooLarge {
                    op: self.op,
                    count: u64::from(count),
                    max: l.max_batch,
                });
            }
        }
        let need = u64::from(count) * size as u64;
        let left = (self.buf.len() - self.pos) as u64;
        if need > left {
            return Err(self.bad(format!(
                "{count} {what} need {need} bytes but only {left} remain"
            )));
        }
        Ok(count as usize)
    }
    fn finish(&self) -> Result<(), CodecError> {
        if self.pos != self.buf.len() {
            return Err(self.bad(format!(
                "{} trailing bytes after the last field",
                self.buf.len() - self.pos
            )));
        }
        Ok(())
    }
}

/// The 32-byte keys laid back to back in `raw` (a trailing partial key is
/// ignored; callers pass whole multiples of 32 bytes).
pub(crate) fn keys_from(raw: &[u8]) -> Vec<ChunkKey> {
    raw.chunks_exact(32)
        .map(|k| ChunkKey(k.try_into().expect("chunks of 32 bytes")))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tier::NamespaceRecord;

    const LIMITS: Limits = Limits { max_batch: 1024 };

    fn frame(req: &Request) -> Vec<u8> {
        let mut out = Vec::new();
        encode_request(&mut out, 7, req);
        out
    }

    fn key(i: u8) -> ChunkKey {
        ChunkKey([i; 32])
    }

    #[test]
    fn a_lookup_reply_with_an_unknown_location_is_refused() {
        let reply = |codes: &[u8]| {
            let mut out = Vec::new();
            encode_frame(&mut out, Op::Lookup as u16 | REPLY_BIT, 0, 0, 9, |out| {
                out.extend_from_slice(&0u32.to_le_bytes());
                out.extend_from_slice(&(codes.len() as u32).to_le_bytes());
                out.extend_from_slice(codes);
            });
            let Ok(Decoded::Frame { header, body, .. }) = decode_frame(&out, 1 << 20) else {
                panic!("frame")
            };
            decode_reply(&header, body)
        };
        match reply(&[0, 1, 2, 3]) {
            Ok(Reply::Ok(Response::Lookup { locations, .. })) => assert_eq!(
                locations,
                [
                    LookupLocation::Miss,
                    LookupLocation::Ram,
                    LookupLocation::Disk,
                    LookupLocation::Peer
                ]
            ),
            other => panic!("{other:?}"),
        }
        let e = reply(&[1, 2, 7, 9])
            .expect_err("code 7 is unknown")
            .to_string();
        assert!(e.contains("unknown location code 7"), "{e}");
    }

    #[test]
    fn a_region_lookup_over_the_batch_limit_is_refused() {
        let req = Request::LookupInRegion {
            ns: Namespace([1; 16]),
            group: 0,
            offset: 0,
            count: LIMITS.max_batch + 1,
        };
        let buf = frame(&req);
        let Ok(Decoded::Frame { header, body, .. }) = decode_frame(&buf, 1 << 20) else {
            panic!("frame")
        };
        assert!(matches!(
            decode_request(&header, body, &LIMITS),
            Err(CodecError::BatchTooLarge { .. })
        ));
        // The flag is LOOKUP's only: on DELETE it is an unknown flag.
        let mut del = frame(&Request::Delete {
            ns: Namespace([1; 16]),
            group: 0,
            keys: vec![],
        });
        del[8] |= FLAG_KEYS_IN_REGION as u8;
        let hcrc = tier::format::crc32c(&del[..28]);
        del[28..32].copy_from_slice(&hcrc.to_le_bytes());
        let Ok(Decoded::Frame { header, body, .. }) = decode_frame(&del, 1 << 20) else {
            panic!("frame")
        };
        assert!(matches!(
            decode_request(&header, body, &LIMITS),
            Err(CodecError::UnknownFlags { .. })
        ));
    }

    #[test]
    fn keys_requests_encode_as_their_request() {
        let (ns, keys) = (Namespace([3; 16]), vec![key(1), key(2), key(3)]);
        for (op, req) in [
            (
                Op::Lookup,
                Request::Lookup {
                    ns,
                    group: 2,
                    keys: keys.clone(),
                },
            ),
            (
                Op::Delete,
                Request::Delete {
                    ns,
                    group: 2,
                    keys: keys.clone(),
                },
            ),
        ] {
            let mut out = Vec::new();
            encode_keys_request(&mut out, 7, op, &ns, 2, &keys);
            assert_eq!(out, frame(&req), "{op:?}");
        }
    }

    fn requests() -> Vec<Request> {
        let record = NamespaceRecord {
            model: "m".into(),
            tp_size: 2,
            ..Default::default()
        };
        vec![
            Request::Ping,
            Request::Hello {
                record: record.clone(),
            },
            Request::RegisterRegion { len: 1 << 20 },
            Request::Lookup {
                ns: Namespace([3; 16]),
                group: 2,
                keys: vec![key(1), key(2)],
            },
            Request::LookupInRegion {
                ns: Namespace([3; 16]),
                group: 2,
                offset: 1 << 40,
                count: 1024,
            },
            Request::ClusterLookup {
                record,
                ranks: vec![0, 1],
                group: 0,
                keys: vec![key(9)],
            },
            Request::Put {
                ns: Namespace([1; 16]),
                group: 0,
                atomic: true,
                entries: vec![RegionEntry {
                    key: key(5),
                    offset: 4096,
                    len: 100,
                }],
            },
            Request::Get {
                ns: Namespace([1; 16]),
                group: 1,
                entries: vec![RegionEntry {
                    key: key(5),
                    offset: 0,
                    len: 1 << 22,
                }],
            },
            Request::Delete {
                ns: Namespace([1; 16]),
                group: 0,
                keys: vec![key(4)],
            },
            Request::Flush,
            Request::Stats,
        ]
    }

    fn decode_req(buf: &[u8]) -> Result<Request, CodecError> {
        match decode_frame(buf, 1 << 20)? {
            Decoded::Frame { header, body, len } => {
                assert_eq!(len, buf.len());
                decode_request(&header, body, &LIMITS)
            }
            Decoded::Incomplete { need } => panic!("incomplete, need {need}"),
        }
    }

    #[test]
    fn every_request_round_trips() {
        for req in requests() {
            assert_eq!(decode_req(&frame(&req)).unwrap(), req);
        }
    }

    #[test]
    fn every_response_round_trips() {
        let responses = vec![
            Response::Pong,
            Response::Hello(HelloReply {
                ns: Namespace([4; 16]),
                version: 1,
                max_batch: 3,
                max_frame: 5,
                max_region: 1 << 40,
            }),
            Response::RegionRegistered { len: 42 },
            Response::Lookup {
                prefix: 1,
                locations: vec![
                    LookupLocation::Ram,
                    LookupLocation::Miss,
                    LookupLocation::Peer,
                ],
            },
            Response::ClusterLookup {
                min_prefix: 1,
                ranks: vec![RankPrefixReply {
                    rank: 1,
                    prefix: 2,
                    ram_prefix: 1,
                }],
            },
            Response::Put {
                statuses: vec![0, ErrorCode::NoSpace as u16],
            },
            Response::Get {
                results: vec![
                    GetResult {
                        status: GetStatus::HitDisk,
                        len: 77,
                    },
                    GetResult {
                        status: GetStatus::TooSmall,
                        len: 1 << 33,
                    },
                ],
            },
            Response::Delete {
                existed: vec![true, false],
            },
            Response::Flush(FlushReply {
                chunks: 1,
                bytes: 2,
                failed: 3,
            }),
            Response::Stats {
                json: b"{\"a\":1}".to_vec(),
            },
        ];
        for resp in responses {
            let mut out = Vec::new();
            encode_response(&mut out, 99, &resp);
            let Decoded::Frame { header, body, .. } = decode_frame(&out, 1 << 20).unwrap() else {
                panic!("incomplete")
            };
            assert_eq!(header.id, 99);
            assert_eq!(decode_reply(&header, body).unwrap(), Reply::Ok(resp));
        }
        let mut out = Vec::new();
        encode_error(&mut out, 5, Op::Get as u16, ErrorCode::OutOfRange, "nope");
        let Decoded::Frame { header, body, .. } = decode_frame(&out, 1 << 20).unwrap() else {
            panic!("incomplete")
        };
        assert_eq!(
            decode_reply(&header, body).unwrap(),
            Reply::Error {
                code: ErrorCode::OutOfRange,
                message: "nope".into()
            }
        );
    }

    #[test]
    fn every_prefix_is_incomplete_and_never_an_error() {
        for req in requests() {
            let buf = frame(&req);
            for cut in 0..buf.len() {
                match decode_frame(&buf[..cut], 1 << 20) {
                    Ok(Decoded::Incomplete { need }) => assert!(need > cut),
                    other => panic!("{req:?} cut at {cut}: {other:?}"),
                }
            }
        }
    }

    #[test]
    fn every_flipped_byte_is_rejected() {
        for req in requests() {
            let buf = frame(&req);
            for i in 0..buf.len() {
                for bit in [0x01u8, 0x80] {
                    let mut b = buf.clone();
                    b[i] ^= bit;
                    match decode_frame(&b, 1 << 20) {
                        Err(_) | Ok(Decoded::Incomplete { .. }) => {}
                        Ok(Decoded::Frame { .. }) => panic!("{req:?}: flip at {i} accepted"),
                    }
                }
            }
        }
    }

    #[test]
    fn header_errors_are_specific() {
        let buf = frame(&Request::Ping);
        assert!(matches!(
            decode_frame(b"GET / HTTP/1.1\r\n", 1024),
            Err(CodecError::BadMagic { .. })
        ));
        // Said in hex with its text (decimal-looking bytes were misread).
        let said = CodecError::BadMagic { found: *b"HTTP" }.to_string();
        assert!(said.contains("0x48545450 (\"HTTP\")"), "{said}");
        let said = CodecError::BadMagic {
            found: [0, 1, 2, 3],
        }
        .to_string();
        assert!(said.contains("0x00010203 (binary)"), "{said}");
        // Garbage is caught from its first byte, before a header is complete.
        assert!(matches!(
            decode_frame(b"X", 1024),
            Err(CodecError::BadMagic { .. })
        ));
        let mut v2 = buf.clone();
        v2[4] = 2;
        let e = decode_frame(&v2, 1024).unwrap_err();
        assert_eq!(
            e,
            CodecError::UnsupportedVersion {
                found: 2,
                supported: 1
            }
        );
        assert!(e.to_string().contains("version 2") && e.to_string().contains("version 1"));
        let big = frame(&Request::RegisterRegion { len: 1 });
        assert!(matches!(
            decode_frame(&big, 4),
            Err(CodecError::FrameTooLarge { len: 8, max: 4 })
        ));
    }

    #[test]
    fn body_errors_are_not_fatal_and_checked_before_allocating() {
        // Unknown op.
        let mut out = Vec::new();
        encode_frame(&mut out, 77, 0, 0, 1, |_| {});
        let Decoded::Frame { header, body, .. } = decode_frame(&out, 1024).unwrap() else {
            panic!()
        };
        let e = decode_request(&header, body, &LIMITS).unwrap_err();
        assert_eq!(e, CodecError::UnknownOp(77));
        assert!(!e.is_fatal());
        // A count that claims more keys than the body holds.
        let mut out = Vec::new();
        encode_frame(&mut out, Op::Lookup as u16, 0, 0, 1, |b| {
            b.extend_from_slice(&[0u8; 16]);
            b.extend_from_slice(&0u32.to_le_bytes());
            b.extend_from_slice(&u32::MAX.to_le_bytes());
        });
        let Decoded::Frame { header, body, .. } = decode_frame(&out, 1024).unwrap() else {
            panic!()
        };
        let e = decode_request(&header, body, &LIMITS).unwrap_err();
        assert!(matches!(e, CodecError::BatchTooLarge { .. }), "{e}");
        let e = decode_request(
            &header,
            body,
            &Limits {
                max_batch: u32::MAX,
            },
        )
        .unwrap_err();
        assert!(matches!(e, CodecError::BadBody { .. }), "{e}");
        // Unknown flags, trailing bytes, reserved fields.
        let mut out = Vec::new();
        encode_frame(&mut out, Op::Ping as u16, 4, 0, 1, |_| {});
        let Decoded::Frame { header, body, .. } = decode_frame(&out, 1024).unwrap() else {
            panic!()
        };
        assert!(matches!(
            decode_request(&header, body, &LIMITS),
            Err(CodecError::UnknownFlags { .. })
        ));
        let mut out = Vec::new();
        encode_frame(&mut out, Op::Ping as u16, 0, 0, 1, |b| b.push(1));
        let Decoded::Frame { header, body, .. } = decode_frame(&out, 1024).unwrap() else {
            panic!()
        };
        assert!(matches!(
            decode_request(&header, body, &LIMITS),
            Err(CodecError::BadBody { .. })
        ));
    }

    #[test]
    fn hello_rejects_unknown_record_fields() {
        let mut out = Vec::new();
        encode_frame(&mut out, Op::Hello as u16, 0, 0, 1, |b| {
            b.extend_from_slice(br#"{"model":"m","tp-sise":2}"#)
        });
        let Decoded::Frame { header, body, .. } = decode_frame(&out, 1024).unwrap() else {
            panic!()
        };
        let e = decode_request(&header, body, &LIMITS).unwrap_err();
        assert!(e.to_string().contains("tp-sise"), "{e}");
    }

    /// Decodes a HELLO carrying `json` as its record; each case must be
    /// accepted (`ok`) or refused with an error containing `why`.
    fn check_hello_records(cases: &[(&[u8], bool)], why: &str) {
        for &(json, ok) in cases {
            let mut out = Vec::new();
            encode_frame(&mut out, Op::Hello as u16, 0, 0, 1, |b| {
                b.extend_from_slice(json)
            });
            let Decoded::Frame { header, body, .. } = decode_frame(&out, 1024).unwrap() else {
                panic!()
            };
            let r = decode_request(&header, body, &LIMITS);
            assert_eq!(r.is_ok(), ok, "{}: {r:?}", String::from_utf8_lossy(json));
            if let Err(e) = r {
                assert!(e.to_string().contains(why), "{e}");
            }
        }
    }

    #[test]
    fn hello_rejects_a_field_given_twice() {
        check_hello_records(
            &[
                (br#"{"model":"x","model":"y"}"#, false),
                (br#"{"model":"y","info":{"a":"1"}}"#, true),
            ],
            "\"model\" is given twice",
        );
    }

    #[test]
    fn hello_rejects_a_rank_outside_tp_size() {
        check_hello_records(
            &[
                (br#"{"model":"m","tp-size":2,"rank":2}"#, false),
                (br#"{"model":"m","tp-size":2,"rank":7}"#, false),
                (br#"{"model":"m","tp-size":2,"rank":1}"#, true),
                (br#"{"model":"m","rank":0}"#, true),
            ],
            "ranks count from 0",
        );
        // CLUSTER_LOOKUP ignores its record's rank.
        let req = Request::ClusterLookup {
            record: NamespaceRecord {
                model: "m".into(),
                tp_size: 2,
                rank: 5,
                ..Default::default()
            },
            ranks: vec![0, 1],
            group: 0,
            keys: vec![key(1)],
        };
        let out = frame(&req);
        let Decoded::Frame { header, body, .. } = decode_frame(&out, 1 << 20).unwrap() else {
            panic!()
        };
        decode_request(&header, body, &LIMITS).expect("the rank is not checked");
    }

    /// CLUSTER_LOOKUP's ranks are distinct and below tp-size, and ranks ×
    /// keys is bounded (QA: rank 0 repeated 4,096 times over 4,096 keys
    /// held a blocking thread for seconds).
    #[test]
    fn cluster_lookup_ranks_are_distinct_in_range_and_bounded() {
        let decode = |tp_size: u32, ranks: Vec<u32>, keys: usize| {
            let req = Request::ClusterLookup {
                record: NamespaceRecord {
                    model: "m".into(),
                    tp_size,
                    ..Default::default()
                },
                ranks,
                group: 0,
                keys: (0..keys).map(|i| key(i as u8)).collect(),
            };
            let out = frame(&req);
            let Decoded::Frame { header, body, .. } = decode_frame(&out, 64 << 20).unwrap() else {
                panic!()
            };
            let limits = Limits { max_batch: 1 << 20 };
            decode_request(&header, body, &limits).map_err(|e| (e.code(), e.to_string()))
        };
        decode(4, vec![0, 1, 2, 3], 8).expect("every rank once");
        decode(0, vec![9, 1000], 8).expect("no tp-size: any rank");
        let (code, msg) = decode(4, vec![0, 1, 0], 8).unwrap_err();
        assert_eq!(code, ErrorCode::BadRequest);
        assert!(msg.contains("rank 0 is given twice"), "{msg}");
        let (code, msg) = decode(4, vec![0, 4], 8).unwrap_err();
        assert_eq!(code, ErrorCode::BadRequest);
        assert!(msg.contains("tp-size is 4"), "{msg}");
        let ranks: Vec<u32> = (0..33).collect();
        decode(0, ranks[..32].to_vec(), 65_536).expect("32 ranks of 65,536 keys");
        let (code, msg) = decode(0, ranks, 65_536).unwrap_err();
        assert_eq!(code, ErrorCode::TooLarge);
        assert!(msg.contains("probes"), "{msg}");
        // At most 4,096 ranks, whatever the keys (review: 1,500 ranks of one
        // key and a large record held a runtime worker for seconds).
        decode(0, (0..4096).collect(), 1).expect("4,096 ranks");
        let (code, msg) = decode(0, (0..4097).collect(), 1).unwrap_err();
        assert_eq!(code, ErrorCode::TooLarge);
        assert!(msg.contains("rank list") && msg.contains("4096"), "{msg}");
    }

    /// A namespace record of more than 64 KiB of JSON is refused before
    /// it is parsed, in HELLO and in CLUSTER_LOOKUP (review: 16 MiB of
    /// `[0,0,...]` parsed into 256 MiB of JSON values first).
    #[test]
    fn a_record_over_64_kib_is_refused_unparsed() {
        let decode = |op: Op, body: &[u8]| {
            let mut out = Vec::new();
            encode_frame(&mut out, op as u16, 0, 0, 1, |b| b.extend_from_slice(body));
            let Decoded::Frame { header, body, .. } = decode_frame(&out, 64 << 20).unwrap() else {
                panic!()
            };
            let limits = Limits { max_batch: 1 << 20 };
            decode_request(&header, body, &limits).map_err(|e| (e.code(), e.to_string()))
        };
        let json = |n: usize| format!(r#"{{"model":"m","salt":"{}"}}"#, "s".repeat(n));
        let fits = json(MAX_RECORD_JSON - 23);
        assert_eq!(fits.len(), MAX_RECORD_JSON);
        decode(Op::Hello, fits.as_bytes()).expect("64 KiB");
        let mut junk = vec![b'['];
        junk.extend(b"0,".repeat(MAX_RECORD_JSON / 2));
        junk.push(b']');
        let (code, msg) = decode(Op::Hello, &junk).unwrap_err();
        assert_eq!(code, ErrorCode::TooLarge);
        assert!(msg.contains("namespace record"), "{msg}");
        // A CLUSTER_LOOKUP of one rank, no keys, and `record`.
        let cl = |record: &[u8]| {
            let mut body = Vec::new();
            body.extend(0u16.to_le_bytes());
            body.extend(0u16.to_le_bytes());
            body.extend(1u32.to_le_bytes());
            body.extend(0u32.to_le_bytes());
            body.extend((record.len() as u32).to_le_bytes());
            body.extend(0u32.to_le_bytes());
            body.extend(record);
            decode(Op::ClusterLookup, &body)
        };
        let (code, msg) = cl(&junk).unwrap_err();
        assert_eq!(code, ErrorCode::TooLarge);
        assert!(msg.contains("namespace record"), "{msg}");
        // CLUSTER_LOOKUP's record is held to HELLO's 16 KiB as stored too
        // (each rank hashes it).
        cl(json(1000).as_bytes()).expect("a small record");
        let (code, msg) = cl(json(20_000).as_bytes()).unwrap_err();
        assert_eq!(code, ErrorCode::TooLarge);
        assert!(msg.contains("as stored"), "{msg}");
    }

    mod props {
        use super::*;
        use proptest::prelude::*;

        fn key() -> impl Strategy<Value = ChunkKey> {
            any::<[u8; 32]>().prop_map(ChunkKey)
        }

        fn entry() -> impl Strategy<Value = RegionEntry> {
            (key(), any::<u64>(), any::<u64>()).prop_map(|(key, offset, len)| RegionEntry {
                key,
                offset,
                len,
            })
        }

        fn request() -> impl Strategy<Value = Request> {
            let ns = any::<[u8; 16]>().prop_map(Namespace);
            prop_oneof![
                (
                    ns.clone(),
                    any::<u16>(),
                    proptest::collection::vec(key(), 0..40)
                )
                    .prop_map(|(ns, group, keys)| Request::Lookup {
                        ns,
                        group,
                        keys
                    }),
                (ns.clone(), any::<u16>(), any::<u64>(), 0u32..=1024).prop_map(
                    |(ns, group, offset, count)| Request::LookupInRegion {
                        ns,
                        group,
                        offset,
                        count
                    }
                ),
                (
                    ns.clone(),
                    any::<u16>(),
                    proptest::collection::vec(key(), 0..40)
                )
                    .prop_map(|(ns, group, keys)| Request::Delete {
                        ns,
                        group,
                        keys
                    }),
                (
                    ns.clone(),
                    any::<u16>(),
                    any::<bool>(),
                    proptest::collection::vec(entry(), 0..40)
                )
                    .prop_map(|(ns, group, atomic, entries)| Request::Put {
                        ns,
                        group,
                        atomic,
                        entries
                    }),
                (ns, any::<u16>(), proptest::collection::vec(entry(), 0..40))
                    .prop_map(|(ns, group, entries)| Request::Get { ns, group, entries }),
                (
                    "[a-z]{0,12}",
                    any::<u32>(),
                    // Distinct ranks (a rank given twice is refused).
                    proptest::collection::btree_set(any::<u32>(), 0..8),
                    proptest::collection::vec(key(), 0..8)
                )
                    .prop_map(|(model, rank, ranks, keys)| {
                        let ranks = ranks.into_iter().collect();
                        Request::ClusterLookup {
                            record: NamespaceRecord {
                                model,
                                rank,
                                ..Default::default()
                            },
                            ranks,
                            group: 0,
                            keys,
                        }
                    }),
                any::<u64>().prop_map(|len| Request::RegisterRegion { len }),
            ]
        }

        proptest! {
            #[test]
            fn requests_round_trip_and_reject_any_flipped_bit(
                req in request(),
                id in any::<u64>(),
                pos in any::<proptest::sample::Index>(),
                bit in 0u8..8,
            ) {
                let mut out = Vec::new();
                encode_request(&mut out, id, &req);
                let Ok(Decoded::Frame { header, body, len }) = decode_frame(&out, u32::MAX) else {
                    panic!("encoded request does not decode");
                };
                prop_assert_eq!(len, out.len());
                prop_assert_eq!(header.id, id);
                prop_assert_eq!(decode_request(&header, body, &LIMITS).unwrap(), req);
                let i = pos.index(out.len());
                out[i] ^= 1 << bit;
                let accepted = matches!(decode_frame(&out, u32::MAX), Ok(Decoded::Frame { .. }));
                prop_assert!(!accepted, "flip of bit {} at byte {} accepted", bit, i);
            }
        }
    }
}
