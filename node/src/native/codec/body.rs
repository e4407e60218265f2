//! Body encoders and decoders of every op (layouts in `node/PROTOCOL.md`).

use tier::{ChunkKey, GroupId, Namespace, NamespaceRecord};

use super::{
    CodecError, Cursor, ErrorCode, FLAG_ATOMIC, FLAG_KEYS_IN_REGION, GET_RESULT_LEN, Header,
    Limits, Op, REGION_ENTRY_LEN, REPLY_BIT, encode_frame, messages::*,
};

/// The keys of a JSON object, in order, duplicates kept (`serde_json`'s
/// own map keeps the last of two equal keys, silently).
struct ObjectKeys(Vec<String>);

impl<'de> serde::Deserialize<'de> for ObjectKeys {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = ObjectKeys;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut m: A,
            ) -> Result<ObjectKeys, A::Error> {
                let mut keys = Vec::new();
                while let Some(k) = m.next_key::<String>()? {
                    m.next_value::<serde::de::IgnoredAny>()?;
                    keys.push(k);
                }
                Ok(ObjectKeys(keys))
            }
        }
        d.deserialize_map(V)
    }
}

/// Most bytes of a namespace record's JSON in a request: the store keeps
/// records of at most 16 KiB (compact), this leaves room for whitespace.
/// Checked before parsing (review: a 16 MiB HELLO of `[0,0,...]` parsed
/// into 256 MiB of JSON values on a runtime worker).
pub const MAX_RECORD_JSON: usize = 64 << 10;

/// Most ranks one CLUSTER_LOOKUP may name (each costs a hash of the record
/// and the rank's probes on a blocking thread).
pub const MAX_CLUSTER_RANKS: usize = 4096;

fn decode_record(json: &[u8], op: &'static str) -> Result<NamespaceRecord, CodecError> {
    let bad = |detail: String| CodecError::BadBody { op, detail };
    if json.len() > MAX_RECORD_JSON {
        return Err(CodecError::TooLong {
            op,
            what: "namespace record (bytes of JSON)",
            len: json.len(),
            max: MAX_RECORD_JSON,
        });
    }
    // A fence field given twice is ambiguous: refused like a misspelt one.
    if let Ok(ObjectKeys(keys)) = serde_json::from_slice::<ObjectKeys>(json) {
        let mut seen = std::collections::HashSet::new();
        if let Some(k) = keys.iter().find(|k| !seen.insert(k.as_str())) {
            return Err(bad(format!("namespace record field {k:?} is given twice")));
        }
    }
    let value: serde_json::Value = serde_json::from_slice(json)
        .map_err(|e| bad(format!("namespace record is not JSON: {e}")))?;
    let obj = value
        .as_object()
        .ok_or_else(|| bad("namespace record must be a JSON object".into()))?;
    // The record type fills missing fields with defaults and would ignore
    // unknown ones: a misspelt fence field would silently become its default.
    // Reject unknown keys instead.
    let known = serde_json::to_value(NamespaceRecord::default()).expect("record serialises");
    let known = known.as_object().expect("record is an object");
    if let Some(k) = obj.keys().find(|k| !known.contains_key(*k)) {
        let mut names: Vec<&str> = known.keys().map(String::as_str).collect();
        names.sort_unstable();
        return Err(bad(format!(
            "unknown namespace record field {k:?} (known: {})",
            names.join(", ")
        )));
    }
    serde_json::from_value(value).map_err(|e| bad(format!("invalid namespace record: {e}")))
}

/// HELLO's record also names a rank that exists (CLUSTER_LOOKUP ignores its
/// record's rank).
fn check_rank(record: &NamespaceRecord, op: &'static str) -> Result<(), CodecError> {
    if record.tp_size > 0 && record.rank >= record.tp_size {
        return Err(CodecError::BadBody {
            op,
            detail: format!(
                "namespace record has rank {} but tp-size {}: ranks count from 0 to tp-size - 1",
                record.rank, record.tp_size
            ),
        });
    }
    Ok(())
}

/// Most rank × key probes one CLUSTER_LOOKUP may ask for: 32 ranks of
/// 65,536 keys (each probe costs RAM, disk index and peer directory
/// lookups on a blocking thread).
pub const MAX_CLUSTER_PROBES: u64 = 1 << 21;

/// CLUSTER_LOOKUP's ranks: each named once, each below the record's
/// tp-size (when it gives one), and not more probes than
/// [`MAX_CLUSTER_PROBES`] (QA: a request repeating rank 0 4,096 times over
/// 4,096 keys held a blocking thread for seconds).
fn check_ranks(
    record: &NamespaceRecord,
    ranks: &[u32],
    keys: usize,
    op: &'static str,
) -> Result<(), CodecError> {
    let bad = |detail: String| CodecError::BadBody { op, detail };
    let mut seen = std::collections::HashSet::with_capacity(ranks.len());
    for &r in ranks {
        if !seen.insert(r) {
            return Err(bad(format!("rank {r} is given twice")));
        }
        if record.tp_size > 0 && r >= record.tp_size {
            return Err(bad(format!(
                "rank {r} but the record's tp-size is {}: ranks count from 0 to tp-size - 1",
                record.tp_size
            )));
        }
    }
    if ranks.len() as u64 * keys as u64 > MAX_CLUSTER_PROBES {
        return Err(CodecError::TooManyProbes {
            op,
            ranks: ranks.len(),
            keys,
            max: MAX_CLUSTER_PROBES,
        });
    }
    Ok(())
}

fn check_flags(op: Op, flags: u16, allowed: u16) -> Result<(), CodecError> {
    if flags & !allowed != 0 {
        return Err(CodecError::UnknownFlags {
            op: op.name(),
            flags,
        });
    }
    Ok(())
}

/// Decodes a request body. `header` must come from [`decode_frame`](super::decode_frame).
pub fn decode_request(
    header: &Header,
    body: &[u8],
    limits: &Limits,
) -> Result<Request, CodecError> {
    if header.op & REPLY_BIT != 0 {
        return Err(CodecError::BadBody {
            op: "request",
            detail: format!("op {:#06x} has the reply bit set", header.op),
        });
    }
    let op = Op::from_code(header.op).ok_or(CodecError::UnknownOp(header.op))?;
    check_flags(
        op,
        header.flags,
        match op {
            Op::Put => FLAG_ATOMIC,
            Op::Lookup => FLAG_KEYS_IN_REGION,
            _ => 0,
        },
    )?;
    if header.status != 0 {
        return Err(CodecError::BadBody {
            op: op.name(),
            detail: format!("status field is {} in a request, must be 0", header.status),
        });
    }
    let mut c = Cursor::new(body, op.name());
    let req = match op {
        Op::Ping => Request::Ping,
        Op::Flush => Request::Flush,
        Op::Stats => Request::Stats,
        Op::Hello => {
            c.pos = body.len();
            let record = decode_record(body, op.name())?;
            check_rank(&record, op.name())?;
            Request::Hello { record }
        }
        Op::RegisterRegion => Request::RegisterRegion {
            len: c.u64("region length")?,
        },
        Op::Lookup if header.flags & FLAG_KEYS_IN_REGION != 0 => {
            let ns = c.ns()?;
            let group = c.u16("group")?;
            c.reserved16()?;
            let count = c.u32("count")?;
            if count > limits.max_batch {
                return Err(CodecError::BatchTooLarge {
                    op: op.name(),
                    count: u64::from(count),
                    max: limits.max_batch,
                });
            }
            let offset = c.u64("keys offset")?;
            Request::LookupInRegion {
                ns,
                group,
                offset,
                count,
            }
        }
        Op::Lookup | Op::Delete => {
            let ns = c.ns()?;
            let group = c.u16("group")?;
            c.reserved16()?;
            let n = c.u32("count")?;
            let n = c.count(n, 32, Some(limits), "keys")?;
            let keys = c.keys(n)?;
            if op == Op::Lookup {
                Request::Lookup { ns, group, keys }
            } else {
                Request::Delete { ns, group, keys }
            }
        }
        Op::ClusterLookup => {
            let group = c.u16("group")?;
            c.reserved16()?;
            let nranks = c.u32("rank count")?;
            let nkeys = c.u32("key count")?;
            let rec_len = c.u32("record length")?;
            let nranks = c.count(nranks, 4, Some(limits), "ranks")?;
            if nranks > MAX_CLUSTER_RANKS {
                return Err(CodecError::TooLong {
                    op: op.name(),
                    what: "rank list (ranks)",
                    len: nranks,
                    max: MAX_CLUSTER_RANKS,
                });
            }
            let ranks = (0..nranks)
                .map(|_| c.u32("rank"))
                .collect::<Result<Vec<_>, _>>()?;
            let nkeys = c.count(nkeys, 32, Some(limits), "keys")?;
            let keys = c.keys(nkeys)?;
            let record = decode_record(c.take(rec_len as usize, "record")?, op.name())?;
            // As stored (HELLO's limit): each rank hashes the record
            // (review: 4,096 ranks of a 64 KiB record hashed 256 MiB).
            let stored = record.stored_len();
            if stored > tier::store::MAX_RECORD_BYTES {
                return Err(CodecError::TooLong {
                    op: op.name(),
                    what: "namespace record (bytes as stored)",
                    len: stored,
                    max: tier::store::MAX_RECORD_BYTES,
                });
            }
            check_ranks(&record, &ranks, keys.len(), op.name())?;
            Request::ClusterLookup {
                record,
                ranks,
                group,
                keys,
            }
        }
        Op::Put | Op::Get => {
            let ns = c.ns()?;
            let group = c.u16("group")?;
            c.reserved16()?;
            let n = c.u32("count")?;
            let n = c.count(n, REGION_ENTRY_LEN, Some(limits), "entries")?;
            let entries = (0..n)
                .map(|_| {
                    Ok(RegionEntry {
                        key: c.key()?,
                        offset: c.u64("offset")?,
                        len: c.u64("length")?,
                    })
                })
                .collect::<Result<Vec<_>, CodecError>>()?;
            if op == Op::Put {
                Request::Put {
                    ns,
                    group,
                    atomic: header.flags & FLAG_ATOMIC != 0,
                    entries,
                }
            } else {
                Request::Get { ns, group, entries }
            }
        }
    };
    c.finish()?;
    Ok(req)
}

fn put_ns_group_count(out: &mut Vec<u8>, ns: &Namespace, group: GroupId, count: usize) {
    out.extend_from_slice(&ns.0);
    out.extend_from_slice(&group.to_le_bytes());
    out.extend_from_slice(&0u16.to_le_bytes());
    out.extend_from_slice(&wire_u32(count).to_le_bytes());
}

fn wire_u32(n: usize) -> u32 {
    u32::try_from(n).expect("batch sizes are bounded far below 2^32")
}

/// Encodes a LOOKUP (`op` [`Op::Lookup`]) or DELETE (`op` [`Op::Delete`])
/// of borrowed keys: the bytes [`encode_request`] writes for the
/// `Request`, without copying the keys into one first.
pub fn encode_keys_request(
    out: &mut Vec<u8>,
    id: u64,
    op: Op,
    ns: &Namespace,
    group: GroupId,
    keys: &[ChunkKey],
) {
    debug_assert!(matches!(op, Op::Lookup | Op::Delete));
    encode_frame(out, op as u16, 0, 0, id, |out| {
        put_keys(out, ns, group, keys)
    });
}

fn put_keys(out: &mut Vec<u8>, ns: &Namespace, group: GroupId, keys: &[ChunkKey]) {
    put_ns_group_count(out, ns, group, keys.len());
    put_key_bytes(out, keys);
}

/// Appends the keys' bytes back to back. Sized once and filled with
/// fixed-size copies: an `extend_from_slice` per key (a capacity check and a
/// 32-byte `memcpy` call each) took most of a 1,024-key LOOKUP's encoding.
fn put_key_bytes(out: &mut Vec<u8>, keys: &[ChunkKey]) {
    let start = out.len();
    out.resize(start + keys.len() * 32, 0);
    for (dst, k) in out[start..].chunks_exact_mut(32).zip(keys) {
        dst.copy_from_slice(&k.0);
    }
}

/// Appends a request frame to `out`.
pub fn encode_request(out: &mut Vec<u8>, id: u64, req: &Request) {
    let flags = match req {
        Request::Put { atomic: true, .. } => FLAG_ATOMIC,
        Request::LookupInRegion { .. } => FLAG_KEYS_IN_REGION,
        _ => 0,
    };
    encode_frame(out, req.op() as u16, flags, 0, id, |out| match req {
        Request::Ping | Request::Flush | Request::Stats => {}
        Request::Hello { record } => {
            serde_json::to_writer(out, record).expect("a record serialises");
        }
        Request::RegisterRegion { len } => out.extend_from_slice(&len.to_le_bytes()),
        Request::Lookup { ns, group, keys } | Request::Delete { ns, group, keys } => {
            put_keys(out, ns, *group, keys);
        }
        Request::LookupInRegion {
            ns,
            group,
            offset,
            count,
        } => {
            put_ns_group_count(out, ns, *group, *count as usize);
            out.extend_from_slice(&offset.to_le_bytes());
        }
        Request::ClusterLookup {
            record,
            ranks,
            group,
            keys,
        } => {
            let json = serde_json::to_vec(record).expect("a record serialises");
            out.extend_from_slice(&group.to_le_bytes());
            out.extend_from_slice(&0u16.to_le_bytes());
            out.extend_from_slice(&wire_u32(ranks.len()).to_le_bytes());
            out.extend_from_slice(&wire_u32(keys.len()).to_le_bytes());
            out.extend_from_slice(&wire_u32(json.len()).to_le_bytes());
            for r in ranks {
                out.extend_from_slice(&r.to_le_bytes());
            }
            put_key_bytes(out, keys);
            out.extend_from_slice(&json);
        }
        Request::Put {
            ns, group, entries, ..
        }
        | Request::Get { ns, group, entries } => {
            put_ns_group_count(out, ns, *group, entries.len());
            out.reserve(entries.len() * REGION_ENTRY_LEN);
            for e in entries {
                out.extend_from_slice(&e.key.0);
                out.extend_from_slice(&e.offset.to_le_bytes());
                out.extend_from_slice(&e.len.to_le_bytes());
            }
        }
    });
}

/// Appends a success reply frame to `out`.
pub fn encode_response(out: &mut Vec<u8>, id: u64, resp: &Response) {
    encode_frame(
        out,
        resp.op() as u16 | REPLY_BIT,
        0,
        0,
        id,
        |out| match resp {
            Response::Pong => {}
            Response::Hello(h) => {
                out.extend_from_slice(&h.ns.0);
                out.extend_from_slice(&h.version.to_le_bytes());
                out.extend_from_slice(&0u16.to_le_bytes());
                out.extend_from_slice(&h.max_batch.to_le_bytes());
                out.extend_from_slice(&h.max_frame.to_le_bytes());
                out.extend_from_slice(&0u32.to_le_bytes());
                out.extend_from_slice(&h.max_region.to_le_bytes());
            }
            Response::RegionRegistered { len } => out.extend_from_slice(&len.to_le_bytes()),
            Response::Lookup { prefix, locations } => {
                out.extend_from_slice(&prefix.to_le_bytes());
                out.extend_from_slice(&wire_u32(locations.len()).to_le_bytes());
                out.extend(locations.iter().map(|l| *l as u8));
            }
            Response::ClusterLookup { min_prefix, ranks } => {
                out.extend_from_slice(&min_prefix.to_le_bytes());
                out.extend_from_slice(&wire_u32(ranks.len()).to_le_bytes());
                for r in ranks {
                    out.extend_from_slice(&r.rank.to_le_bytes());
                    out.extend_from_slice(&r.prefix.to_le_bytes());
                    out.extend_from_slice(&r.ram_prefix.to_le_bytes());
                }
            }
            Response::Put { statuses } => {
                out.extend_from_slice(&wire_u32(statuses.len()).to_le_bytes());
                for s in statuses {
                    out.extend_from_slice(&s.to_le_bytes());
                }
            }
            Response::Get { results } => {
                out.extend_from_slice(&wire_u32(results.len()).to_le_bytes());
                out.extend_from_slice(&0u32.to_le_bytes());
                for r in results {
                    out.push(r.status as u8);
                    out.extend_from_slice(&[0u8; 7]);
                    out.extend_from_slice(&r.len.to_le_bytes());
                }
            }
            Response::Delete { existed } => {
                out.extend_from_slice(&wire_u32(existed.len()).to_le_bytes());
                out.extend(existed.iter().map(|e| u8::from(*e)));
            }
            Response::Flush(f) => {
                out.extend_from_slice(&f.chunks.to_le_bytes());
                out.extend_from_slice(&f.bytes.to_le_bytes());
                out.extend_from_slice(&f.failed.to_le_bytes());
            }
            Response::Stats { json } => out.extend_from_slice(json),
        },
    );
}

/// Appends an error reply frame to `out`. `op` is the request's op code
/// (0 when the request could not be parsed); the message is truncated to
/// 4 KiB on a character boundary.
pub fn encode_error(out: &mut Vec<u8>, id: u64, op: u16, code: ErrorCode, message: &str) {
    let mut end = message.len().min(4096);
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    encode_frame(
        out,
        (op & !REPLY_BIT) | REPLY_BIT,
        0,
        code as u16,
        id,
        |out| {
            out.extend_from_slice(&message.as_bytes()[..end]);
        },
    );
}

/// The location of wire code `b`, `None` for an unknown code.
fn location(b: u8) -> Option<LookupLocation> {
    Some(match b {
        0 => LookupLocation::Miss,
        1 => LookupLocation::Ram,
        2 => LookupLocation::Disk,
        3 => LookupLocation::Peer,
        _ => return None,
    })
}

fn get_status(b: u8, c: &Cursor<'_>) -> Result<GetStatus, CodecError> {
    Ok(match b {
        0 => GetStatus::Miss,
        1 => GetStatus::HitRam,
        2 => GetStatus::HitDisk,
        3 => GetStatus::HitPeer,
        4 => GetStatus::TooSmall,
        _ => return Err(c.bad(format!("unknown GET status {b}"))),
    })
}

/// Decodes a reply frame (client side). The body is checked as strictly as
/// requests are; counts are bounded by the body length.
pub fn decode_reply(header: &Header, body: &[u8]) -> Result<Reply, CodecError> {
    if header.op & REPLY_BIT == 0 {
        return Err(CodecError::BadBody {
            op: "reply",
            detail: format!("op {:#06x} lacks the reply bit", header.op),
        });
    }
    if header.status != 0 {
        return Ok(Reply::Error {
            code: ErrorCode::from_code(header.status),
            message: String::from_utf8_lossy(body).into_owned(),
        });
    }
    let code = header.op & !REPLY_BIT;
    let op = Op::from_code(code).ok_or(CodecError::UnknownOp(code))?;
    let mut c = Cursor::new(body, op.name());
    let resp = match op {
        Op::Ping => Response::Pong,
        Op::Hello => {
            let ns = c.ns()?;
            let version = c.u16("version")?;
            c.reserved16()?;
            let max_batch = c.u32("max batch")?;
            let max_frame = c.u32("max frame")?;
            c.reserved32()?;
            let max_region = c.u64("max region")?;
            Response::Hello(HelloReply {
                ns,
                version,
                max_batch,
                max_frame,
                max_region,
            })
        }
        Op::RegisterRegion => Response::RegionRegistered {
            len: c.u64("length")?,
        },
        Op::Lookup => {
            let prefix = c.u32("prefix")?;
            let n = c.u32("count")?;
            let n = c.count(n, 1, None, "locations")?;
            let raw = c.take(n, "locations")?;
            // Checked first, then mapped: a fallible `collect` does not
            // vectorise and cost more than the rest of the reply.
            if let Some(&b) = raw.iter().find(|&&b| location(b).is_none()) {
                return Err(c.bad(format!("unknown location code {b}")));
            }
            let locations = raw
                .iter()
                .map(|&b| location(b).unwrap_or(LookupLocation::Miss))
                .collect();
            Response::Lookup { prefix, locations }
        }
        Op::ClusterLookup => {
            let min_prefix = c.u32("min prefix")?;
            let n = c.u32("count")?;
            let n = c.count(n, 12, None, "ranks")?;
            let ranks = (0..n)
                .map(|_| {
                    Ok(RankPrefixReply {
                        rank: c.u32("rank")?,
                        prefix: c.u32("prefix")?,
                        ram_prefix: c.u32("ram prefix")?,
                    })
                })
                .collect::<Result<Vec<_>, CodecError>>()?;
            Response::ClusterLookup { min_prefix, ranks }
        }
        Op::Put => {
            let n = c.u32("count")?;
            let n = c.count(n, 2, None, "statuses")?;
            let statuses = (0..n)
                .map(|_| c.u16("status"))
                .collect::<Result<Vec<_>, _>>()?;
            Response::Put { statuses }
        }
        Op::Get => {
            let n = c.u32("count")?;
            c.reserved32()?;
            let n = c.count(n, GET_RESULT_LEN, None, "results")?;
            let results = (0..n)
                .map(|_| {
                    let status = get_status(c.u8("status")?, &c)?;
                    c.take(7, "padding")?;
                    Ok(GetResult {
                        status,
                        len: c.u64("length")?,
                    })
                })
                .collect::<Result<Vec<_>, CodecError>>()?;
            Response::Get { results }
        }
        Op::Delete => {
            let n = c.u32("count")?;
            let n = c.count(n, 1, None, "flags")?;
            let existed = c.take(n, "flags")?.iter().map(|b| *b != 0).collect();
            Response::Delete { existed }
        }
        Op::Flush => Response::Flush(FlushReply {
            chunks: c.u64("chunks")?,
            bytes: c.u64("bytes")?,
            failed: c.u64("failed")?,
        }),
        Op::Stats => {
            c.pos = body.len();
            Response::Stats {
                json: body.to_vec(),
            }
        }
    };
    c.finish()?;
    Ok(Reply::Ok(resp))
}
