//! Identifiers: namespaces (per-rank fences), chunk keys, groups and chunk ids.
//!
//! A [`Namespace`] is a 16-byte hash of the *fence fields* of a
//! [`NamespaceRecord`]: any change to a fence field (model, rank, dtype,
//! layout, ...) yields another namespace, so bytes stored under one can never
//! be served for another. Informational fields are stored but not hashed.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Domain tag mixed into namespace ids; bump only with a format version change.
const NAMESPACE_DOMAIN: &[u8] = b"kvtier/namespace/v1";
/// Domain tag mixed into namespace family ids.
const FAMILY_DOMAIN: &[u8] = b"kvtier/family/v1";
/// Domain tag for hashing string keys (RESP) to [`ChunkKey`]s.
const NAME_KEY_DOMAIN: &[u8] = b"kvtier/name-key/v1";

/// A 16-byte namespace id: hash of the fence fields of a [`NamespaceRecord`].
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct Namespace(pub [u8; 16]);

/// A 16-byte namespace family id: the fence fields without the rank.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct NamespaceFamily(pub [u8; 16]);

/// A 32-byte chunk key (e.g. vLLM's chained block hash). Keys are already
/// uniform hashes; indexes use their bytes directly without rehashing.
/// Laid out as its 32 bytes (`repr(transparent)`), so a run of keys can be
/// copied in as bytes.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[repr(transparent)]
pub struct ChunkKey(pub [u8; 32]);

/// KV-cache group index (hybrid models have several); part of chunk identity.
pub type GroupId = u16;

/// Full identity of a chunk: (namespace, key, group).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug, Default)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct ChunkId {
    /// The per-rank namespace.
    pub ns: Namespace,
    /// The 32-byte key.
    pub key: ChunkKey,
    /// The KV-cache group.
    pub group: GroupId,
}

impl ChunkId {
    /// Builds a chunk id.
    pub fn new(ns: Namespace, key: ChunkKey, group: GroupId) -> Self {
        Self { ns, key, group }
    }
}

/// Where a chunk currently lives on this node.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Tier {
    /// In the RAM LRU (possibly also on disk).
    Ram,
    /// Only on the local NVMe store.
    Disk,
}

fn write_hex(f: &mut fmt::Formatter<'_>, bytes: &[u8]) -> fmt::Result {
    for b in bytes {
        write!(f, "{b:02x}")?;
    }
    Ok(())
}

fn parse_hex<const N: usize>(s: &str) -> Option<[u8; N]> {
    let s = s.as_bytes();
    if s.len() != 2 * N {
        return None;
    }
    let mut out = [0u8; N];
    for (i, pair) in s.chunks_exact(2).enumerate() {
        let hi = (pair[0] as char).to_digit(16)?;
        let lo = (pair[1] as char).to_digit(16)?;
        out[i] = (hi * 16 + lo) as u8;
    }
    Some(out)
}

macro_rules! hex_id {
    ($t:ident, $n:expr, $what:expr) => {
        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write_hex(f, &self.0)
            }
        }
        impl fmt::Debug for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}(", stringify!($t))?;
                write_hex(f, &self.0)?;
                write!(f, ")")
            }
        }
        impl Serialize for $t {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.collect_str(self)
            }
        }
        impl<'de> Deserialize<'de> for $t {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = String::deserialize(d)?;
                s.parse().map_err(serde::de::Error::custom)
            }
        }
        impl std::str::FromStr for $t {
            type Err = crate::Error;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                parse_hex::<$n>(s)
                    .map($t)
                    .ok_or_else(|| crate::Error::InvalidArgument {
                        what: $what,
                        value: s.chars().take(80).collect(),
                    })
            }
        }
    };
}
hex_id!(Namespace, 16, "namespace id (32 hex digits)");
hex_id!(NamespaceFamily, 16, "namespace family id (32 hex digits)");
hex_id!(ChunkKey, 32, "chunk key (64 hex digits)");

impl ChunkKey {
    /// Hashes a string key (e.g. a RESP key) to a chunk key. The full name
    /// must also be stored with the chunk and compared on read.
    pub fn from_name(name: &[u8]) -> Self {
        let mut h = Sha256::new();
        h.update(NAME_KEY_DOMAIN);
        h.update(name);
        ChunkKey(h.finalize().into())
    }
}

/// The full description of a namespace. Only the fence fields go into the id.
///
/// Stored once per namespace on disk and returned by `kvtier namespaces`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case", default)]
pub struct NamespaceRecord {
    /// Model id (fence), e.g. `meta-llama/Llama-3.1-70B`.
    pub model: String,
    /// Model revision (fence), e.g. a commit hash.
    pub model_revision: String,
    /// Engine name (fence), e.g. `vllm`.
    pub engine: String,
    /// Engine version (fence).
    pub engine_version: String,
    /// Tensor-parallel size (fence).
    pub tp_size: u32,
    /// Rank within the tensor-parallel group (fence; not in the family id).
    pub rank: u32,
    /// KV cache dtype (fence), e.g. `bfloat16`, `fp8_e4m3`.
    pub kv_dtype: String,
    /// Tokens per engine block (fence).
    pub block_size: u32,
    /// Tokens per chunk (fence).
    pub chunk_tokens: u32,
    /// Block hash algorithm (fence), e.g. `sha256_cbor`.
    pub hash_algo: String,
    /// Layout fingerprint (fence): e.g. per-group page sizes and tensor shape.
    pub layout: String,
    /// Format version of the chunk payload layout (fence).
    pub format_version: u32,
    /// User salt (fence): change it to invalidate everything.
    pub salt: String,
    /// Informational fields (not hashed): host, notes, created-by, ...
    pub info: BTreeMap<String, String>,
}

impl NamespaceRecord {
    fn hash_fences(&self, domain: &[u8], rank: Option<u32>) -> [u8; 16] {
        let mut h = Sha256::new();
        h.update(domain);
        let mut field = |b: &[u8]| {
            h.update((b.len() as u64).to_le_bytes());
            h.update(b);
        };
        field(self.model.as_bytes());
        field(self.model_revision.as_bytes());
        field(self.engine.as_bytes());
        field(self.engine_version.as_bytes());
        field(&self.tp_size.to_le_bytes());
        if let Some(rank) = rank {
            field(&rank.to_le_bytes());
        }
        field(self.kv_dtype.as_bytes());
        field(&self.block_size.to_le_bytes());
        field(&self.chunk_tokens.to_le_bytes());
        field(self.hash_algo.as_bytes());
        field(self.layout.as_bytes());
        field(&self.format_version.to_le_bytes());
        field(self.salt.as_bytes());
        let digest: [u8; 32] = h.finalize().into();
        let mut out = [0u8; 16];
        out.copy_from_slice(&digest[..16]);
        out
    }

    /// The namespace id: a hash of every fence field, rank included.
    pub fn id(&self) -> Namespace {
        self.id_of_rank(self.rank)
    }

    /// Bytes of this record as the store keeps it (compact JSON, every
    /// field written out), which [`crate::store::MAX_RECORD_BYTES`] limits.
    pub fn stored_len(&self) -> usize {
        serde_json::to_vec(self).map_or(usize::MAX, |v| v.len())
    }

    /// The id of this record with another rank: `self.with_rank(rank).id()`
    /// without copying the record.
    pub fn id_of_rank(&self, rank: u32) -> Namespace {
        Namespace(self.hash_fences(NAMESPACE_DOMAIN, Some(rank)))
    }

    /// The family id: a hash of every fence field except the rank.
    pub fn family(&self) -> NamespaceFamily {
        NamespaceFamily(self.hash_fences(FAMILY_DOMAIN, None))
    }

    /// This record with another rank (same family).
    pub fn with_rank(&self, rank: u32) -> Self {
        Self {
            rank,
            ..self.clone()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec() -> NamespaceRecord {
        NamespaceRecord {
            model: "m".into(),
            engine: "vllm".into(),
            tp_size: 2,
            rank: 0,
            kv_dtype: "bfloat16".into(),
            block_size: 16,
            chunk_tokens: 256,
            hash_algo: "sha256_cbor".into(),
            ..Default::default()
        }
    }

    #[test]
    fn every_fence_field_changes_the_id() {
        let base = rec();
        let mut variants = vec![];
        let mut r = base.clone();
        r.model.push('x');
        variants.push(r);
        let mut r = base.clone();
        r.rank = 1;
        variants.push(r);
        let mut r = base.clone();
        r.kv_dtype = "fp8".into();
        variants.push(r);
        let mut r = base.clone();
        r.layout = "x".into();
        variants.push(r);
        let mut r = base.clone();
        r.salt = "s".into();
        variants.push(r);
        for v in variants {
            assert_ne!(v.id(), base.id(), "{v:?}");
        }
    }

    #[test]
    fn info_fields_do_not_change_the_id_and_rank_keeps_the_family() {
        let base = rec();
        let mut r = base.clone();
        r.info.insert("host".into(), "spark1".into());
        assert_eq!(r.id(), base.id());
        let r1 = base.with_rank(1);
        assert_ne!(r1.id(), base.id());
        assert_eq!(r1.family(), base.family());
        assert_eq!(base.id_of_rank(1), r1.id());
        assert_eq!(r1.id_of_rank(0), base.id());
        assert_ne!(NamespaceFamily(base.id().0), base.family());
    }

    #[test]
    fn field_boundaries_are_unambiguous() {
        let mut a = rec();
        a.model = "ab".into();
        a.model_revision = "c".into();
        let mut b = rec();
        b.model = "a".into();
        b.model_revision = "bc".into();
        assert_ne!(a.id(), b.id());
    }

    #[test]
    fn hex_round_trips() {
        let ns = rec().id();
        let s = ns.to_string();
        assert_eq!(s.len(), 32);
        assert_eq!(s.parse::<Namespace>().unwrap(), ns);
        assert!("zz".parse::<Namespace>().is_err());
        let k = ChunkKey::from_name(b"abc");
        assert_eq!(k.to_string().parse::<ChunkKey>().unwrap(), k);
        assert_ne!(ChunkKey::from_name(b"abd"), k);
    }
}
