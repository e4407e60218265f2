//! Golden fixtures for the chunk format (STYLE.md rule 17).
//!
//! `tier/tests/fixtures/format-vN/*.bin` hold encoded chunk headers of format
//! version N. The encoding of a fixed chunk under the current version must be
//! byte-identical to its committed fixture, and every fixture ever committed
//! (of any version) is read again: the current version decodes to the fixed
//! chunk, an older version is either still read or refused with
//! `UnsupportedVersion` naming it, never misparsed.
//!
//! Regenerate the current version's fixtures after an intentional change
//! (which must also bump `FORMAT_VERSION`) with
//! `KVTIER_BLESS=1 cargo nextest run -p kvtier-tier --test golden`.

use std::path::{Path, PathBuf};

use bytes::Bytes;
use tier::format::{ChunkHeader, FORMAT_VERSION, FormatError};
use tier::{ChunkId, ChunkKey, Namespace};

/// The payload of the fixed chunk.
const PAYLOAD: &[u8] = b"kvtier golden payload: 0123456789abcdef";
/// The name of the named fixture (a RESP-style key string).
const NAME: &[u8] = b"lmcache:model=llama:rank=0:chunk=0042";
/// Created time of the fixed chunk (2026-01-01T00:00:00.123Z).
const CREATED_MS: u64 = 1_767_225_600_123;

fn fixed_id() -> ChunkId {
    let mut ns = [0u8; 16];
    for (i, b) in ns.iter_mut().enumerate() {
        *b = 0x10 + i as u8;
    }
    let mut key = [0u8; 32];
    for (i, b) in key.iter_mut().enumerate() {
        *b = 0xa0 ^ (i as u8).wrapping_mul(7);
    }
    ChunkId::new(Namespace(ns), ChunkKey(key), 0x0203)
}

/// The fixed chunks of the current version: (fixture file name, header).
fn fixed_headers() -> Vec<(&'static str, ChunkHeader)> {
    let named = ChunkHeader::for_payload(
        fixed_id(),
        Some(Bytes::from_static(NAME)),
        PAYLOAD,
        CREATED_MS,
    );
    let mut unnamed = ChunkHeader::for_payload(fixed_id(), None, PAYLOAD, CREATED_MS);
    unnamed.flags = 0x8000_0001;
    vec![("header-named.bin", named), ("header-unnamed.bin", unnamed)]
}

fn fixtures_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn blessing() -> bool {
    std::env::var_os("KVTIER_BLESS").is_some_and(|v| v == "1")
}

fn current_dir() -> PathBuf {
    fixtures_root().join(format!("format-v{FORMAT_VERSION}"))
}

/// With `KVTIER_BLESS=1`, (re)writes the current version's fixtures. Both
/// tests call it first because nextest runs them in parallel processes.
fn bless_if_asked() {
    if !blessing() {
        return;
    }
    let dir = current_dir();
    std::fs::create_dir_all(&dir).expect("create fixture dir");
    for (file, header) in fixed_headers() {
        let path = dir.join(file);
        let tmp = dir.join(format!(".{file}.{}.tmp", std::process::id()));
        std::fs::write(&tmp, header.encode()).expect("write fixture");
        std::fs::rename(&tmp, &path).expect("rename fixture");
    }
}

#[test]
fn current_encoding_matches_committed_fixtures() {
    bless_if_asked();
    let dir = current_dir();
    for (file, header) in fixed_headers() {
        let encoded = header.encode();
        let path = dir.join(file);
        let committed = std::fs::read(&path).unwrap_or_else(|e| {
            panic!(
                "read fixture {}: {e} (regenerate with KVTIER_BLESS=1)",
                path.display()
            )
        });
        assert!(
            committed == encoded,
            "encoding of {file} changed: a format change must bump FORMAT_VERSION and add \
             fixtures under format-v{{N}}/\ncommitted: {committed:02x?}\nnow:       {encoded:02x?}"
        );
    }
}

#[test]
fn every_committed_fixture_is_read_or_refused_by_version() {
    bless_if_asked();
    let mut seen = 0;
    let mut dirs: Vec<_> = std::fs::read_dir(fixtures_root())
        .expect("list fixtures")
        .map(|e| e.expect("fixture dir entry").path())
        .collect();
    dirs.sort();
    for dir in dirs {
        let Some(version) = dir
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_prefix("format-v"))
            .and_then(|v| v.parse::<u16>().ok())
        else {
            continue;
        };
        let mut files: Vec<_> = std::fs::read_dir(&dir)
            .expect("list fixture dir")
            .map(|e| e.expect("fixture entry").path())
            .filter(|p| p.extension().is_some_and(|x| x == "bin"))
            .collect();
        files.sort();
        for path in files {
            seen += 1;
            let bytes = std::fs::read(&path).expect("read fixture");
            assert_eq!(
                u16::from_le_bytes([bytes[4], bytes[5]]),
                version,
                "{} is not a version {version} fixture",
                path.display()
            );
            match ChunkHeader::decode(&bytes) {
                Ok(h) => {
                    // Whatever version, a decoded fixture is the fixed chunk.
                    h.check_identity(&fixed_id(), None)
                        .expect("fixture identity");
                    h.verify_payload(PAYLOAD).expect("fixture payload CRC");
                    assert_eq!(h.created_ms, CREATED_MS);
                    if let Some(name) = &h.name {
                        assert_eq!(&name[..], NAME);
                    }
                    if version == FORMAT_VERSION {
                        assert_eq!(
                            h.encode(),
                            bytes,
                            "{} re-encodes differently",
                            path.display()
                        );
                    }
                }
                Err(FormatError::UnsupportedVersion { found, supported }) => {
                    assert_eq!(found, version);
                    assert_ne!(
                        version,
                        FORMAT_VERSION,
                        "current version refused: {}",
                        path.display()
                    );
                    assert_eq!(supported, FORMAT_VERSION);
                }
                Err(e) => panic!("fixture {} misread: {e}", path.display()),
            }
        }
    }
    assert!(seen >= 2, "expected committed fixtures, found {seen}");
}

/// Independent of the codec: the v1 fixture has the fields at the offsets of
/// the byte table in `format.rs` and `tier/FORMAT.md`.
#[test]
fn v1_fixture_matches_the_byte_table() {
    let b = std::fs::read(fixtures_root().join("format-v1/header-named.bin")).expect("read");
    let u16_at = |o: usize| u16::from_le_bytes([b[o], b[o + 1]]);
    let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"));
    let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"));
    let id = fixed_id();
    assert_eq!(&b[0..4], b"KVTC");
    assert_eq!(u16_at(4), 1);
    assert_eq!(u16_at(6), 0);
    assert_eq!(u32_at(8) as usize, b.len());
    assert_eq!(b.len() % 64, 0);
    assert_eq!(u32_at(12), 0, "flags");
    assert_eq!(&b[16..32], &id.ns.0);
    assert_eq!(&b[32..64], &id.key.0);
    assert_eq!(u16_at(64), id.group);
    assert_eq!(u16_at(66), 0);
    assert_eq!(u32_at(68), crc32c::crc32c(PAYLOAD));
    assert_eq!(u64_at(72), PAYLOAD.len() as u64);
    assert_eq!(u64_at(80), CREATED_MS);
    assert_eq!(u32_at(88) as usize, NAME.len());
    let crc_at = 92 + NAME.len();
    assert_eq!(&b[92..crc_at], NAME);
    assert_eq!(u32_at(crc_at), crc32c::crc32c(&b[..crc_at]));
    assert!(b[crc_at + 4..].iter().all(|&x| x == 0));
}
