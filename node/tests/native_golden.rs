//! Golden frames: committed binary fixtures of requests and replies. The
//! Rust encoder must reproduce them byte for byte and the decoder must read
//! them back; `connector/tests/test_client.py` checks the Python encoder and
//! decoder against the same files.
//!
//! Regenerate (only with a protocol version bump): `KVTIER_BLESS=1 cargo test
//! -p kvtier-node --test native_golden`.

use std::path::PathBuf;

use node::native::codec::{
    self, Decoded, ErrorCode, GetResult, GetStatus, HelloReply, LookupLocation, RankPrefixReply,
    RegionEntry, Reply, Request, Response,
};
use node::tier::{ChunkKey, Namespace, NamespaceRecord};

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/frames")
}

/// Namespace used by every fixture: bytes 0..16.
fn ns() -> Namespace {
    Namespace(std::array::from_fn(|i| i as u8))
}

/// Key `i`: 32 bytes of value `i`.
fn key(i: u8) -> ChunkKey {
    ChunkKey([i; 32])
}

fn record() -> NamespaceRecord {
    NamespaceRecord {
        model: "llama".into(),
        model_revision: "r1".into(),
        engine: "vllm".into(),
        engine_version: "0.33".into(),
        tp_size: 2,
        rank: 1,
        kv_dtype: "bfloat16".into(),
        block_size: 16,
        chunk_tokens: 256,
        hash_algo: "sha256_cbor".into(),
        layout: "g0:32768".into(),
        format_version: 1,
        salt: "".into(),
        info: Default::default(),
    }
}

#[expect(clippy::large_enum_variant, reason = "a short list of test fixtures")]
enum Fixture {
    Req(u64, Request),
    Resp(u64, Response),
    Err(u64, u16, ErrorCode, &'static str),
}

fn fixtures() -> Vec<(&'static str, Fixture)> {
    vec![
        ("ping_request", Fixture::Req(1, Request::Ping)),
        (
            "hello_request",
            Fixture::Req(2, Request::Hello { record: record() }),
        ),
        (
            "register_region_request",
            Fixture::Req(3, Request::RegisterRegion { len: 1 << 26 }),
        ),
        (
            "lookup_request",
            Fixture::Req(
                4,
                Request::Lookup {
                    ns: ns(),
                    group: 1,
                    keys: vec![key(1), key(2), key(3)],
                },
            ),
        ),
        (
            "lookup_in_region_request",
            Fixture::Req(
                11,
                Request::LookupInRegion {
                    ns: ns(),
                    group: 1,
                    offset: 4096,
                    count: 3,
                },
            ),
        ),
        (
            "cluster_lookup_request",
            Fixture::Req(
                5,
                Request::ClusterLookup {
                    record: record(),
                    ranks: vec![0, 1],
                    group: 0,
                    keys: vec![key(1), key(2)],
                },
            ),
        ),
        (
            "put_request",
            Fixture::Req(
                6,
                Request::Put {
                    ns: ns(),
                    group: 0,
                    atomic: true,
                    entries: vec![
                        RegionEntry {
                            key: key(1),
                            offset: 0,
                            len: 262_144,
                        },
                        RegionEntry {
                            key: key(2),
                            offset: 262_144,
                            len: 1_048_576,
                        },
                    ],
                },
            ),
        ),
        (
            "get_request",
            Fixture::Req(
                7,
                Request::Get {
                    ns: ns(),
                    group: 0,
                    entries: vec![
                        RegionEntry {
                            key: key(1),
                            offset: 4096,
                            len: 262_144,
                        },
                        RegionEntry {
                            key: key(9),
                            offset: 1 << 20,
                            len: 1 << 22,
                        },
                    ],
                },
            ),
        ),
        (
            "delete_request",
            Fixture::Req(
                8,
                Request::Delete {
                    ns: ns(),
                    group: 2,
                    keys: vec![key(7)],
                },
            ),
        ),
        ("flush_request", Fixture::Req(9, Request::Flush)),
        ("stats_request", Fixture::Req(10, Request::Stats)),
        (
            "hello_reply",
            Fixture::Resp(
                2,
                Response::Hello(HelloReply {
                    ns: ns(),
                    version: 1,
                    max_batch: 65_536,
                    max_frame: 16 << 20,
                    max_region: 64 << 30,
                }),
            ),
        ),
        (
            "register_region_reply",
            Fixture::Resp(3, Response::RegionRegistered { len: 1 << 26 }),
        ),
        (
            "lookup_reply",
            Fixture::Resp(
                4,
                Response::Lookup {
                    prefix: 2,
                    locations: vec![
                        LookupLocation::Ram,
                        LookupLocation::Disk,
                        LookupLocation::Miss,
                    ],
                },
            ),
        ),
        (
            "cluster_lookup_reply",
            Fixture::Resp(
                5,
                Response::ClusterLookup {
                    min_prefix: 1,
                    ranks: vec![
                        RankPrefixReply {
                            rank: 0,
                            prefix: 2,
                            ram_prefix: 2,
                        },
                        RankPrefixReply {
                            rank: 1,
                            prefix: 1,
                            ram_prefix: 0,
                        },
                    ],
                },
            ),
        ),
        (
            "put_reply",
            Fixture::Resp(
                6,
                Response::Put {
                    statuses: vec![0, 10],
                },
            ),
        ),
        (
            "get_reply",
            Fixture::Resp(
                7,
                Response::Get {
                    results: vec![
                        GetResult {
                            status: GetStatus::HitRam,
                            len: 262_144,
                        },
                        GetResult {
                            status: GetStatus::Miss,
                            len: 0,
                        },
                    ],
                },
            ),
        ),
        (
            "delete_reply",
            Fixture::Resp(
                8,
                Response::Delete {
                    existed: vec![true],
                },
            ),
        ),
        (
            "flush_reply",
            Fixture::Resp(
                9,
                Response::Flush(codec::FlushReply {
                    chunks: 3,
                    bytes: 786_432,
                    failed: 0,
                }),
            ),
        ),
        (
            "stats_reply",
            Fixture::Resp(
                10,
                Response::Stats {
                    json: br#"{"node":"n1"}"#.to_vec(),
                },
            ),
        ),
        (
            "error_reply",
            Fixture::Err(
                7,
                codec::Op::Get as u16,
                ErrorCode::OutOfRange,
                "GET entry 1: out of range",
            ),
        ),
    ]
}

fn encode(f: &Fixture) -> Vec<u8> {
    let mut out = Vec::new();
    match f {
        Fixture::Req(id, r) => codec::encode_request(&mut out, *id, r),
        Fixture::Resp(id, r) => codec::encode_response(&mut out, *id, r),
        Fixture::Err(id, op, code, msg) => codec::encode_error(&mut out, *id, *op, *code, msg),
    }
    out
}

#[test]
fn golden_frames_match_the_encoder_and_decode_back() {
    let bless = std::env::var_os("KVTIER_BLESS").is_some();
    let limits = codec::Limits { max_batch: 65_536 };
    for (name, f) in fixtures() {
        let path = dir().join(format!("{name}.bin"));
        let bytes = encode(&f);
        if bless {
            std::fs::create_dir_all(dir()).unwrap();
            std::fs::write(&path, &bytes).unwrap();
        }
        let golden = std::fs::read(&path).unwrap_or_else(|e| {
            panic!(
                "{}: {e} (regenerate with KVTIER_BLESS=1 only for a new protocol version)",
                path.display()
            )
        });
        assert_eq!(
            bytes, golden,
            "{name}: encoding differs from the committed fixture"
        );
        let Decoded::Frame { header, body, len } = codec::decode_frame(&golden, u32::MAX).unwrap()
        else {
            panic!("{name}: incomplete")
        };
        assert_eq!(len, golden.len());
        match f {
            Fixture::Req(id, r) => {
                assert_eq!(header.id, id);
                assert_eq!(
                    codec::decode_request(&header, body, &limits).unwrap(),
                    r,
                    "{name}"
                );
            }
            Fixture::Resp(id, r) => {
                assert_eq!(header.id, id);
                assert_eq!(
                    codec::decode_reply(&header, body).unwrap(),
                    Reply::Ok(r),
                    "{name}"
                );
            }
            Fixture::Err(id, _, code, msg) => {
                assert_eq!(header.id, id);
                assert_eq!(
                    codec::decode_reply(&header, body).unwrap(),
                    Reply::Error {
                        code,
                        message: msg.into()
                    },
                    "{name}"
                );
            }
        }
    }
}

#[test]
fn the_hello_fixture_names_the_record_s_namespace() {
    // The Python tests compute the namespace id through a real daemon; this
    // pins the id of the fixture record so both sides agree on the hash.
    let id = record().id();
    let golden = std::fs::read(dir().join("hello_request.bin")).unwrap();
    let Decoded::Frame { header, body, .. } = codec::decode_frame(&golden, u32::MAX).unwrap()
    else {
        panic!()
    };
    let Request::Hello { record: r } =
        codec::decode_request(&header, body, &codec::Limits { max_batch: 1 }).unwrap()
    else {
        panic!()
    };
    assert_eq!(r.id(), id);
}
