//! Frame layout: every message on a peer stream travels in one frame.
//!
//! | offset | size | field                                            |
//! |-------:|-----:|--------------------------------------------------|
//! |      0 |    4 | magic `KVTP`                                     |
//! |      4 |    1 | protocol version ([`VERSION`])                   |
//! |      5 |    1 | message kind                                     |
//! |      6 |    2 | reserved, zero                                   |
//! |      8 |    4 | body length `n` (u32 LE, ≤ [`MAX_BODY`])          |
//! |     12 |    4 | CRC32C over bytes 0..12 followed by the body     |
//! |     16 |    n | body (see [`super::msg`])                        |
//!
//! A fetch reply's chunk payload follows its frame raw on the same stream;
//! it is covered by the payload CRC32C carried in the reply, not by the frame
//! CRC (so the payload is checksummed once, end to end).

use super::codec::{DecodeError, Reader};
use super::msg::Message;

/// Frame magic.
pub const MAGIC: [u8; 4] = *b"KVTP";
/// Protocol version this build speaks.
pub const VERSION: u8 = 2;
/// Frame header length.
pub const HEADER_LEN: usize = 16;
/// Largest frame body accepted (16 MiB); snapshots are split into parts
/// below this.
pub const MAX_BODY: u32 = 16 << 20;

/// A decoded frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    /// Message kind.
    pub kind: u8,
    /// Body length in bytes.
    pub body_len: u32,
    /// Stored CRC32C.
    pub crc: u32,
}

impl FrameHeader {
    /// Decodes and checks magic, version, reserved bits and the length
    /// limit. The CRC is checked by [`FrameHeader::check_body`] once the body
    /// has been read.
    pub fn decode(buf: &[u8; HEADER_LEN]) -> Result<Self, DecodeError> {
        let mut r = Reader::new(buf);
        let magic: [u8; 4] = r.array()?;
        if magic != MAGIC {
            return Err(DecodeError::BadMagic(magic));
        }
        let version = r.u8()?;
        if version != VERSION {
            return Err(DecodeError::Version {
                found: version,
                supported: VERSION,
            });
        }
        let kind = r.u8()?;
        let reserved = r.u16()?;
        if reserved != 0 {
            return Err(DecodeError::Invalid {
                field: "reserved",
                why: "must be zero",
            });
        }
        let body_len = r.u32()?;
        if body_len > MAX_BODY {
            return Err(DecodeError::TooLong {
                len: u64::from(body_len),
                max: u64::from(MAX_BODY),
            });
        }
        let crc = r.u32()?;
        Ok(Self {
            kind,
            body_len,
            crc,
        })
    }

    /// Checks the CRC over `header` (the 16 raw bytes) and `body`.
    pub fn check_body(&self, header: &[u8; HEADER_LEN], body: &[u8]) -> Result<(), DecodeError> {
        if body.len() as u64 != u64::from(self.body_len) {
            return Err(DecodeError::Truncated {
                needed: u64::from(self.body_len),
                available: body.len() as u64,
            });
        }
        let computed = frame_crc(&header[..12], body);
        if computed != self.crc {
            return Err(DecodeError::Crc {
                stored: self.crc,
                computed,
            });
        }
        Ok(())
    }
}

/// A running CRC32C (Castagnoli), for data that arrives in pieces.
pub(crate) fn crc32c_digest() -> crc_fast::Digest {
    crc_fast::Digest::new(crc_fast::CrcAlgorithm::Crc32Iscsi)
}

/// The CRC32C of everything `d` was given.
pub(crate) fn crc32c_value(d: &crc_fast::Digest) -> u32 {
    // A 32-bit CRC's value always fits its 32 bits.
    d.finalize() as u32
}

/// The CRC32C over a header's first 12 bytes followed by the body.
fn frame_crc(header: &[u8], body: &[u8]) -> u32 {
    let mut d = crc32c_digest();
    d.update(header);
    d.update(body);
    crc32c_value(&d)
}

/// Encodes `msg` as one complete frame.
pub fn encode(msg: &Message) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + msg.body_len_hint());
    out.extend_from_slice(&MAGIC);
    out.push(VERSION);
    out.push(msg.kind());
    out.extend_from_slice(&[0, 0]);
    out.extend_from_slice(&[0; 8]); // length and crc, filled below
    msg.encode_body(&mut out);
    let body_len = (out.len() - HEADER_LEN) as u32;
    out[8..12].copy_from_slice(&body_len.to_le_bytes());
    let crc = frame_crc(&out[..12], &out[HEADER_LEN..]);
    out[12..16].copy_from_slice(&crc.to_le_bytes());
    out
}

/// Decodes one complete frame from the front of `buf`, returning the
/// message and the number of bytes consumed. Checks everything before
/// decoding the body; never panics.
pub fn decode(buf: &[u8]) -> Result<(Message, usize), DecodeError> {
    let Some(head) = buf.get(..HEADER_LEN) else {
        return Err(DecodeError::Truncated {
            needed: HEADER_LEN as u64,
            available: buf.len() as u64,
        });
    };
    let mut header = [0u8; HEADER_LEN];
    header.copy_from_slice(head);
    let h = FrameHeader::decode(&header)?;
    let end = HEADER_LEN + h.body_len as usize;
    let Some(body) = buf.get(HEADER_LEN..end) else {
        return Err(DecodeError::Truncated {
            needed: end as u64,
            available: buf.len() as u64,
        });
    };
    h.check_body(&header, body)?;
    let msg = Message::decode_body(h.kind, body)?;
    Ok((msg, end))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::id::{PeerChunkId, PeerNamespace};
    use crate::proto::msg::{FetchStatus, Message, Op};

    fn sample_id(i: u8) -> PeerChunkId {
        PeerChunkId {
            ns: PeerNamespace([i; 16]),
            key: [i.wrapping_add(1); 32],
            group: u16::from(i),
        }
    }

    fn samples() -> Vec<Message> {
        vec![
            Message::Hello {
                node_name: "node-a".into(),
                cluster: "prod".into(),
                epoch: 7,
            },
            Message::SnapshotBegin {
                epoch: 1,
                seq: 2,
                total: 3,
            },
            Message::SnapshotPart {
                entries: vec![(sample_id(1), 10, true), (sample_id(2), 20, false)],
            },
            Message::SnapshotEnd { seq: 9 },
            Message::Delta {
                epoch: 3,
                seq: 4,
                ops: vec![
                    Op::Add(sample_id(3), 5),
                    Op::Remove(sample_id(4)),
                    Op::Ram(sample_id(5), false),
                    Op::Ram(sample_id(6), true),
                ],
            },
            Message::Resync,
            Message::Ping { nonce: 42 },
            Message::Pong { nonce: 43 },
            Message::Namespaces {
                records: vec![(PeerNamespace([9; 16]), b"{\"rank\":0}".to_vec())],
            },
            Message::FetchRequest { id: sample_id(5) },
            Message::FetchReply {
                status: FetchStatus::Ok,
                id: sample_id(6),
                len: 1 << 20,
                crc: 0xdead_beef,
            },
        ]
    }

    #[test]
    fn round_trip_every_kind() {
        for m in samples() {
            let f = encode(&m);
            let (d, used) = decode(&f).expect("decode");
            assert_eq!(used, f.len());
            assert_eq!(d, m);
        }
    }

    #[test]
    fn every_flipped_bit_is_rejected() {
        for m in samples() {
            let f = encode(&m);
            for i in 0..f.len() {
                for bit in [0u8, 3, 7] {
                    let mut g = f.clone();
                    g[i] ^= 1 << bit;
                    match decode(&g) {
                        Err(_) => {}
                        Ok((d, _)) => panic!("flip at {i} bit {bit} accepted: {d:?}"),
                    }
                }
            }
        }
    }

    #[test]
    fn truncation_is_an_error() {
        for m in samples() {
            let f = encode(&m);
            for cut in 0..f.len() {
                assert!(decode(&f[..cut]).is_err(), "cut at {cut} accepted");
            }
        }
    }

    #[test]
    fn oversized_length_rejected_before_reading_body() {
        let mut f = encode(&Message::Resync);
        f[8..12].copy_from_slice(&(MAX_BODY + 1).to_le_bytes());
        let mut h = [0u8; HEADER_LEN];
        h.copy_from_slice(&f[..HEADER_LEN]);
        assert!(matches!(
            FrameHeader::decode(&h),
            Err(DecodeError::TooLong { .. })
        ));
    }

    #[test]
    fn wrong_version_and_magic() {
        // Version 1 (no RAM residency) and a future version are refused.
        for v in [1, VERSION + 1] {
            let mut f = encode(&Message::Resync);
            f[4] = v;
            assert!(matches!(
                decode(&f),
                Err(DecodeError::Version { found, .. }) if found == v
            ));
        }
        let mut f = encode(&Message::Resync);
        f[0] = b'X';
        assert!(matches!(decode(&f), Err(DecodeError::BadMagic(_))));
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..512)) {
            let _ = decode(&bytes);
        }

        #[test]
        fn delta_round_trips(n in 0usize..50, seed in proptest::num::u8::ANY) {
            let ops = (0..n).map(|i| {
                let id = sample_id(seed.wrapping_add(i as u8));
                if i % 3 == 0 { Op::Remove(id) } else { Op::Add(id, i as u64 * 4096) }
            }).collect();
            let m = Message::Delta { epoch: u64::from(seed), seq: n as u64, ops };
            let f = encode(&m);
            let (d, _) = decode(&f).expect("decode");
            proptest::prop_assert_eq!(d, m);
        }
    }
}
