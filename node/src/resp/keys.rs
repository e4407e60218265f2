//! Mapping of opaque RESP keys to chunk ids.
//!
//! A key that looks like an LMCache `CacheEngineKey.to_string()`
//! (`model@world_size@worker_id@chunkhash@dtype`: exactly five `@`-separated
//! fields, decimal world size and worker id) goes to a namespace of its own
//! per (model, world size, worker id, dtype), so each rank's chunks are fenced
//! from every other rank's. Any other key goes to one default RESP namespace.
//!
//! The chunk key is a hash of the full key bytes ([`ChunkKey::from_name`]);
//! the full key is stored with the chunk and compared on every read, so two
//! different keys can never return each other's bytes.

use std::collections::HashMap;

use parking_lot::Mutex;
use tier::{ChunkId, ChunkKey, Namespace, NamespaceRecord};

use crate::NodeContext;

/// Engine name of namespaces holding LMCache `resp://` chunks.
pub const LMCACHE_ENGINE: &str = "lmcache-resp";
/// Engine name of the default namespace of other RESP keys.
pub const RESP_ENGINE: &str = "resp";

/// Whether a namespace's `engine` is one the RESP server writes (chunks
/// named by their key's bytes; the native PUT, which stores no names,
/// refuses them).
pub fn is_resp_engine(engine: &str) -> bool {
    engine == RESP_ENGINE || engine == LMCACHE_ENGINE
}
/// Longest key accepted (the full key is kept in the chunk header).
pub const MAX_KEY_LEN: usize = 4096;
/// Namespace ids cached at most (registered ones always stay).
const CACHE_MAX: usize = 8192;
/// Namespaces created through RESP at most.
pub const MAX_NAMESPACES: usize = 4096;

/// The fields of an LMCache key that select its namespace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LmcacheKey<'a> {
    /// Model name.
    pub model: &'a str,
    /// Number of workers (tensor-parallel world size).
    pub world_size: u32,
    /// The worker's global rank.
    pub worker_id: u32,
    /// The chunk hash as written in the key (hex, possibly negative).
    pub chunk_hash: &'a str,
    /// The KV dtype (`bfloat16`, `half`, ...).
    pub dtype: &'a str,
}

fn decimal_u32(s: &str) -> Option<u32> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

/// Parses an LMCache key; `None` for any other key.
pub fn parse_lmcache_key(key: &[u8]) -> Option<LmcacheKey<'_>> {
    let s = std::str::from_utf8(key).ok()?;
    let mut it = s.split('@');
    let (model, ws, wid, hash, dtype) =
        (it.next()?, it.next()?, it.next()?, it.next()?, it.next()?);
    if it.next().is_some() || model.is_empty() || hash.is_empty() || dtype.is_empty() {
        return None;
    }
    let (world_size, worker_id) = (decimal_u32(ws)?, decimal_u32(wid)?);
    // A worker outside its world is no LMCache key (HELLO refuses such a
    // rank too): a plain key of the default namespace.
    if worker_id >= world_size {
        return None;
    }
    Some(LmcacheKey {
        model,
        world_size,
        worker_id,
        chunk_hash: hash,
        dtype,
    })
}

/// The namespace record a key belongs to.
pub fn namespace_record(key: &[u8]) -> NamespaceRecord {
    match parse_lmcache_key(key) {
        Some(k) => {
            let mut r = NamespaceRecord {
                model: k.model.to_owned(),
                engine: LMCACHE_ENGINE.to_owned(),
                tp_size: k.world_size,
                rank: k.worker_id,
                kv_dtype: k.dtype.to_owned(),
                ..Default::default()
            };
            r.info.insert("source".into(), "resp".into());
            r
        }
        None => {
            let mut r = NamespaceRecord {
                engine: RESP_ENGINE.to_owned(),
                ..Default::default()
            };
            r.info.insert("source".into(), "resp".into());
            r
        }
    }
}

/// The cache key: the key with its chunk-hash field removed (LMCache), or
/// empty (default namespace).
fn cache_key(key: &[u8]) -> Vec<u8> {
    match parse_lmcache_key(key) {
        Some(k) => format!("{}@{}@{}@{}", k.model, k.world_size, k.worker_id, k.dtype).into_bytes(),
        None => Vec::new(),
    }
}

#[derive(Clone, Copy, Debug)]
struct Cached {
    ns: Namespace,
    registered: bool,
}

/// Maps RESP keys to chunk ids, caching namespace ids.
#[derive(Default)]
pub struct KeyMapper {
    // parking_lot: a short map lookup per command, never held across await.
    cache: Mutex<HashMap<Vec<u8>, Cached>>,
}

impl std::fmt::Debug for KeyMapper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyMapper")
            .field("cached", &self.cache.lock().len())
            .finish()
    }
}

impl KeyMapper {
    /// A mapper with an empty cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// The chunk id of `key` for reads (registers nothing).
    pub fn id(&self, key: &[u8]) -> ChunkId {
        let ck = cache_key(key);
        let cached = self.cache.lock().get(&ck).map(|c| c.ns);
        let ns = cached.unwrap_or_else(|| {
            let ns = namespace_record(key).id();
            let mut cache = self.cache.lock();
            if cache.len() < CACHE_MAX {
                cache.entry(ck).or_insert(Cached {
                    ns,
                    registered: false,
                });
            }
            ns
        });
        ChunkId::new(ns, ChunkKey::from_name(key), 0)
    }

    /// The chunk id of `key` if its namespace is known to be registered
    /// with the store (no I/O).
    pub fn registered_id(&self, key: &[u8]) -> Option<ChunkId> {
        let ck = cache_key(key);
        let c = *self.cache.lock().get(&ck)?;
        c.registered
            .then(|| ChunkId::new(c.ns, ChunkKey::from_name(key), 0))
    }

    /// Registers `key`'s namespace with the store (may write the store's
    /// namespace manifest: call it off the async workers) and returns the
    /// key's chunk id. At most [`MAX_NAMESPACES`] namespaces are created
    /// through RESP, so a client cannot grow the manifest without bound.
    pub fn register(&self, ctx: &NodeContext, key: &[u8]) -> Result<ChunkId, RegisterError> {
        let ck = cache_key(key);
        {
            let cache = self.cache.lock();
            let registered = cache.values().filter(|c| c.registered).count();
            if !cache.get(&ck).is_some_and(|c| c.registered) && registered >= MAX_NAMESPACES {
                return Err(RegisterError::TooManyNamespaces);
            }
        }
        let ns = ctx
            .register_namespace(&namespace_record(key))
            .map_err(RegisterError::Store)?;
        let mut cache = self.cache.lock();
        if cache.len() >= CACHE_MAX && !cache.contains_key(&ck) {
            // Keep registered entries; drop read-only ones to make room.
            cache.retain(|_, c| c.registered);
        }
        cache.insert(
            ck,
            Cached {
                ns,
                registered: true,
            },
        );
        Ok(ChunkId::new(ns, ChunkKey::from_name(key), 0))
    }
}

/// Why a key's namespace could not be registered.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RegisterError {
    /// The RESP namespace limit is reached.
    #[error(
        "too many RESP namespaces (at most {MAX_NAMESPACES} distinct model/world-size/rank/dtype combinations)"
    )]
    TooManyNamespaces,
    /// The store refused the namespace.
    #[error(transparent)]
    Store(tier::Error),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lmcache_keys_parse_and_others_do_not() {
        let k =
            parse_lmcache_key(b"meta/llama@2@1@-448569d442b6a772@bfloat16").expect("lmcache key");
        assert_eq!(k.model, "meta/llama");
        assert_eq!((k.world_size, k.worker_id), (2, 1));
        assert_eq!(k.chunk_hash, "-448569d442b6a772");
        assert_eq!(k.dtype, "bfloat16");
        for other in [
            &b"plain"[..],
            b"m@2@1@abc",
            b"m@2@1@abc@bf16@tag%1",
            b"m@x@1@abc@bf16",
            b"m@2@-1@abc@bf16",
            b"@2@1@abc@bf16",
            b"m@2@1@@bf16",
            b"m@2@1@abc@",
            b"m@2@1@abc@\xff",
            b"m@2@2@abc@bf16",
            b"m@0@0@abc@bf16",
        ] {
            assert_eq!(parse_lmcache_key(other), None, "{other:?}");
        }
    }

    #[test]
    fn each_rank_gets_its_own_namespace() {
        let m = KeyMapper::new();
        let r0 = m.id(b"m@2@0@abc@bfloat16");
        let r1 = m.id(b"m@2@1@abc@bfloat16");
        let r0b = m.id(b"m@2@0@def@bfloat16");
        let other = m.id(b"foo");
        assert_ne!(r0.ns, r1.ns);
        assert_eq!(r0.ns, r0b.ns);
        assert_ne!(r0.key, r0b.key);
        assert_ne!(other.ns, r0.ns);
        assert_eq!(m.id(b"bar").ns, other.ns);
        let rec = namespace_record(b"m@2@1@abc@bfloat16");
        assert_eq!(rec.engine, LMCACHE_ENGINE);
        assert_eq!((rec.tp_size, rec.rank), (2, 1));
        assert_eq!(rec.kv_dtype, "bfloat16");
        assert_eq!(rec.id(), r1.ns);
    }

    #[test]
    fn register_records_the_namespace_with_the_store() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = tier::ChunkStore::open(tier::TierConfig {
            data_dir: dir.path().to_path_buf(),
            disk_budget: 0,
            ..tier::TierConfig::default()
        })
        .expect("open");
        let ctx = NodeContext::new(std::sync::Arc::new(store), "t".into());
        let m = KeyMapper::new();
        let key = b"m@4@3@abc@half";
        assert_eq!(m.registered_id(key), None);
        let id = m.register(&ctx, key).expect("register");
        assert_eq!(id, m.id(key));
        assert_eq!(m.registered_id(key), Some(id));
        let rec = ctx
            .store
            .namespace_record(&id.ns)
            .expect("registered in the store");
        assert_eq!(
            (rec.tp_size, rec.rank, rec.kv_dtype.as_str()),
            (4, 3, "half")
        );
    }
}
