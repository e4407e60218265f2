//! [`ChunkStore`]: the facade over the RAM LRU and the NVMe segment store.
//!
//! INTERIM: this file fixes the public API that `node` codes against. The
//! implementation below is RAM-only (a plain map with a byte budget); the
//! disk tier, recovery, write policy and maintenance are being built behind
//! this same API (see docs/STATUS.md). Disk-only operations return
//! [`Error::Unimplemented`] until then, never a fake success.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use parking_lot::{Mutex, RwLock};
use serde::{Deserialize, Serialize};

use crate::{ChunkId, ChunkKey, Error, GroupId, Namespace, NamespaceRecord, Result, Tier};

/// What to do when the disk writer falls behind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum WritePolicy {
    /// Never block PUT: a dirty chunk evicted from RAM that cannot be queued
    /// for writing is dropped and counted (`dropped_unwritten`). Default.
    #[default]
    NoTax,
    /// PUT waits for writer queue space, so every evicted chunk reaches disk.
    Backpressure,
}

/// Configuration of a [`ChunkStore`]. Field docs end with their default.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct TierConfig {
    /// Directory holding the store's files. Default: `./kvtier-data`.
    pub data_dir: PathBuf,
    /// Hard byte limit of the RAM LRU. Default: 1 GiB. Minimum: 1 MiB.
    pub ram_budget: u64,
    /// Hard byte limit of the NVMe store (preallocated). Default: 16 GiB;
    /// 0 disables the disk tier (RAM only).
    pub disk_budget: u64,
    /// Size of one region of the segment store. Default: 64 MiB.
    pub region_size: u64,
    /// Dirty chunks older than this are written when the writer is idle.
    /// Default: 30 s.
    #[serde(with = "duration_ms")]
    pub idle_flush_after: Duration,
    /// Write policy when the writer falls behind. Default: `no-tax`.
    pub write_policy: WritePolicy,
    /// Number of chunks the writer queue holds. Default: 64.
    pub writer_queue: usize,
    /// Promote disk hits into RAM as clean entries. Default: true.
    pub promote_on_read: bool,
    /// Use O_DIRECT when the filesystem supports it. Default: true.
    pub direct_io: bool,
}

mod duration_ms {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::Duration;

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(d.as_millis() as u64)
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        Ok(Duration::from_millis(u64::deserialize(d)?))
    }
}

impl Default for TierConfig {
    fn default() -> Self {
        Self {
            data_dir: PathBuf::from("kvtier-data"),
            ram_budget: 1 << 30,
            disk_budget: 16 << 30,
            region_size: 64 << 20,
            idle_flush_after: Duration::from_secs(30),
            write_policy: WritePolicy::NoTax,
            writer_queue: 64,
            promote_on_read: true,
            direct_io: true,
        }
    }
}

impl TierConfig {
    /// Rejects contradictions (never clamps silently).
    pub fn validate(&self) -> Result<()> {
        if self.ram_budget < (1 << 20) {
            return Err(Error::Config(format!(
                "ram-budget is {} bytes; the minimum is 1 MiB",
                self.ram_budget
            )));
        }
        if self.disk_budget != 0 && self.disk_budget < 2 * self.region_size {
            return Err(Error::Config(format!(
                "disk-budget ({}) must hold at least two regions of region-size ({}), or be 0",
                self.disk_budget, self.region_size
            )));
        }
        if self.writer_queue == 0 {
            return Err(Error::Config("writer-queue must be at least 1".into()));
        }
        Ok(())
    }
}

/// A successful read.
#[derive(Clone, Debug)]
pub struct Hit {
    /// The payload, exactly as stored.
    pub data: Bytes,
    /// Where it was found.
    pub tier: Tier,
}

/// A namespace known to the store, with its record and usage.
#[derive(Clone, Debug, Serialize)]
pub struct NamespaceInfo {
    /// The id.
    pub id: Namespace,
    /// The full record.
    pub record: NamespaceRecord,
    /// Chunks held (RAM or disk).
    pub chunks: u64,
    /// Payload bytes held.
    pub bytes: u64,
}

/// Counters and gauges of a store. Counters are monotonic since open.
#[derive(Clone, Debug, Default, Serialize)]
pub struct StoreStats {
    /// Chunks in RAM.
    pub ram_chunks: u64,
    /// Payload bytes in RAM.
    pub ram_bytes: u64,
    /// RAM budget.
    pub ram_budget: u64,
    /// Dirty (not yet durable) bytes in RAM.
    pub dirty_bytes: u64,
    /// Chunks on disk.
    pub disk_chunks: u64,
    /// Payload bytes on disk.
    pub disk_bytes: u64,
    /// Disk budget.
    pub disk_budget: u64,
    /// GET hits served from RAM.
    pub hits_ram: u64,
    /// GET hits served from disk.
    pub hits_disk: u64,
    /// GET misses.
    pub misses: u64,
    /// PUTs accepted.
    pub puts: u64,
    /// Payload bytes accepted by PUT.
    pub bytes_in: u64,
    /// Payload bytes returned by GET.
    pub bytes_out: u64,
    /// Chunks evicted from RAM.
    pub ram_evictions: u64,
    /// Regions reclaimed on disk.
    pub region_evictions: u64,
    /// Chunks written to disk.
    pub disk_writes: u64,
    /// Bytes written to disk (including headers and padding).
    pub disk_write_bytes: u64,
    /// Disk read operations.
    pub disk_reads: u64,
    /// Dirty chunks evicted from RAM that were dropped unwritten (no-tax).
    pub dropped_unwritten: u64,
    /// Reads that failed verification (CRC, identity, length) or I/O.
    pub verify_failures: u64,
    /// Chunks currently queued for the writer.
    pub writer_queue_depth: u64,
    /// Time the last open spent rebuilding the index, in microseconds.
    pub recovery_micros: u64,
    /// Whether the writer is paused for lack of space.
    pub writer_paused_nospace: bool,
    /// Whether O_DIRECT is in use (false: buffered fallback).
    pub direct_io: bool,
}

/// Result of [`ChunkStore::flush`].
#[derive(Clone, Debug, Default, Serialize)]
pub struct FlushReport {
    /// Chunks written by this flush.
    pub chunks: u64,
    /// Payload bytes written by this flush.
    pub bytes: u64,
    /// Dirty chunks that could not be written (no space / I/O error).
    pub failed: u64,
}

/// Options of [`ChunkStore::verify`].
#[derive(Clone, Debug, Default)]
pub struct VerifyOptions {
    /// Drop chunks that fail verification (default: report only).
    pub repair: bool,
}

/// Result of [`ChunkStore::verify`].
#[derive(Clone, Debug, Default, Serialize)]
pub struct VerifyReport {
    /// Chunks checked.
    pub checked: u64,
    /// Chunks that failed a check.
    pub bad: u64,
    /// Chunks dropped (only with `repair`).
    pub dropped: u64,
    /// One line per bad chunk (bounded).
    pub problems: Vec<String>,
}

/// Options of [`ChunkStore::gc`].
#[derive(Clone, Debug, Default)]
pub struct GcOptions {
    /// Drop every chunk of these namespaces.
    pub namespaces: Vec<Namespace>,
    /// Drop namespaces not written or read for at least this long.
    pub older_than: Option<Duration>,
    /// Report what would be dropped without dropping it (default: true in the CLI).
    pub dry_run: bool,
}

/// Result of [`ChunkStore::gc`].
#[derive(Clone, Debug, Default, Serialize)]
pub struct GcReport {
    /// Namespaces selected.
    pub namespaces: Vec<Namespace>,
    /// Chunks dropped (or that would be, in a dry run).
    pub chunks: u64,
    /// Payload bytes dropped (or that would be).
    pub bytes: u64,
}

/// Receives availability changes (for the peer sync). Called synchronously
/// on the mutating thread: implementations must be cheap and never block.
pub trait ChunkObserver: Send + Sync {
    /// A chunk became available on this node (RAM or disk).
    fn added(&self, id: &ChunkId, len: u64);
    /// A chunk is no longer available on this node.
    fn removed(&self, id: &ChunkId);
}

struct RamChunk {
    data: Bytes,
    name: Option<Bytes>,
}

/// The local chunk store: a byte-budgeted RAM LRU over an NVMe segment store.
///
/// Thread-safe; share it in an `Arc`. Call order: [`ChunkStore::open`], then
/// any mix of operations from any thread, then [`ChunkStore::close`].
pub struct ChunkStore {
    config: TierConfig,
    // parking_lot: short critical sections, never held across I/O or await.
    ram: RwLock<HashMap<ChunkId, RamChunk>>,
    // parking_lot: namespaces change rarely; reads are short.
    namespaces: RwLock<HashMap<Namespace, NamespaceRecord>>,
    // parking_lot: counters snapshot, short sections.
    stats: Mutex<StoreStats>,
    observer: RwLock<Option<Arc<dyn ChunkObserver>>>,
}

impl ChunkStore {
    /// Opens (or creates) the store in `config.data_dir`, rebuilding the index.
    pub fn open(config: TierConfig) -> Result<Self> {
        config.validate()?;
        let stats = StoreStats {
            ram_budget: config.ram_budget,
            disk_budget: config.disk_budget,
            ..Default::default()
        };
        Ok(Self {
            config,
            ram: RwLock::new(HashMap::new()),
            namespaces: RwLock::new(HashMap::new()),
            stats: Mutex::new(stats),
            observer: RwLock::new(None),
        })
    }

    /// The configuration the store was opened with.
    pub fn config(&self) -> &TierConfig {
        &self.config
    }

    /// Installs the availability observer (replacing any previous one).
    pub fn set_observer(&self, observer: Arc<dyn ChunkObserver>) {
        *self.observer.write() = Some(observer);
    }

    /// Registers (idempotently) a namespace record; returns its id. The record
    /// is kept durably so `namespaces()` can list it after a restart.
    pub fn register_namespace(&self, record: &NamespaceRecord) -> Result<Namespace> {
        let id = record.id();
        self.namespaces.write().entry(id).or_insert_with(|| record.clone());
        Ok(id)
    }

    /// The record of a registered namespace.
    pub fn namespace_record(&self, ns: &Namespace) -> Option<NamespaceRecord> {
        self.namespaces.read().get(ns).cloned()
    }

    /// All registered namespaces with their usage.
    pub fn namespaces(&self) -> Vec<NamespaceInfo> {
        let ram = self.ram.read();
        self.namespaces
            .read()
            .iter()
            .map(|(id, record)| {
                let (chunks, bytes) = ram
                    .iter()
                    .filter(|(cid, _)| cid.ns == *id)
                    .fold((0, 0), |(c, b), (_, v)| (c + 1, b + v.data.len() as u64));
                NamespaceInfo {
                    id: *id,
                    record: record.clone(),
                    chunks,
                    bytes,
                }
            })
            .collect()
    }

    /// Stores a chunk in RAM (dirty). Replaces an existing chunk with the same id.
    /// Never waits for the disk under the default write policy.
    pub fn put(&self, id: ChunkId, data: Bytes) -> Result<()> {
        self.put_inner(id, None, data)
    }

    /// Stores a chunk with a name (e.g. a RESP key string) that is kept in the
    /// header and compared on every read by [`ChunkStore::get_named`].
    pub fn put_named(&self, id: ChunkId, name: Bytes, data: Bytes) -> Result<()> {
        self.put_inner(id, Some(name), data)
    }

    /// Stores several chunks that become visible together or not at all,
    /// also across crashes (a boundary manifest).
    pub fn put_atomic(&self, chunks: Vec<(ChunkId, Bytes)>) -> Result<()> {
        for (id, data) in chunks {
            self.put_inner(id, None, data)?;
        }
        Ok(())
    }

    fn put_inner(&self, id: ChunkId, name: Option<Bytes>, data: Bytes) -> Result<()> {
        if !self.namespaces.read().contains_key(&id.ns) {
            return Err(Error::UnknownNamespace(id.ns));
        }
        let len = data.len() as u64;
        if len > self.config.ram_budget {
            return Err(Error::TooLarge {
                len,
                limit_name: "ram-budget",
                limit: self.config.ram_budget,
            });
        }
        {
            let mut ram = self.ram.write();
            let used: u64 = ram.values().map(|c| c.data.len() as u64).sum();
            let replaced = ram.get(&id).map_or(0, |c| c.data.len() as u64);
            if used - replaced + len > self.config.ram_budget {
                return Err(Error::Unimplemented(
                    "RAM eviction to the disk tier (interim RAM-only store is full)",
                ));
            }
            ram.insert(id, RamChunk { data, name });
        }
        {
            let mut s = self.stats.lock();
            s.puts += 1;
            s.bytes_in += len;
        }
        if let Some(o) = self.observer.read().as_ref() {
            o.added(&id, len);
        }
        Ok(())
    }

    /// Reads a chunk: RAM, then disk. Any failure is a miss (counted, logged).
    pub fn get(&self, id: &ChunkId) -> Option<Hit> {
        self.get_inner(id, None)
    }

    /// Reads a chunk stored with [`ChunkStore::put_named`]; a chunk whose
    /// stored name differs (a hash collision, or no name) is a miss.
    pub fn get_named(&self, id: &ChunkId, name: &[u8]) -> Option<Hit> {
        self.get_inner(id, Some(name))
    }

    fn get_inner(&self, id: &ChunkId, name: Option<&[u8]>) -> Option<Hit> {
        let hit = {
            let ram = self.ram.read();
            ram.get(id).and_then(|c| {
                if name.is_some() && c.name.as_deref() != name {
                    return None;
                }
                Some(c.data.clone())
            })
        };
        let mut s = self.stats.lock();
        match hit {
            Some(data) => {
                s.hits_ram += 1;
                s.bytes_out += data.len() as u64;
                Some(Hit {
                    data,
                    tier: Tier::Ram,
                })
            }
            None => {
                s.misses += 1;
                None
            }
        }
    }

    /// Where a chunk lives, from the in-RAM index only (no disk I/O).
    pub fn locate(&self, id: &ChunkId) -> Option<Tier> {
        self.ram.read().contains_key(id).then_some(Tier::Ram)
    }

    /// For an ordered key list: fills `tiers` with where each key lives (or
    /// `None`) and returns the length of the longest present prefix. Touches
    /// no disk.
    pub fn lookup_prefix(
        &self,
        ns: Namespace,
        group: GroupId,
        keys: &[ChunkKey],
        tiers: &mut Vec<Option<Tier>>,
    ) -> usize {
        tiers.clear();
        tiers.extend(keys.iter().map(|k| self.locate(&ChunkId::new(ns, *k, group))));
        tiers.iter().take_while(|t| t.is_some()).count()
    }

    /// Removes a chunk from RAM and disk; returns whether it existed.
    pub fn delete(&self, id: &ChunkId) -> bool {
        let existed = self.ram.write().remove(id).is_some();
        if existed {
            if let Some(o) = self.observer.read().as_ref() {
                o.removed(id);
            }
        }
        existed
    }

    /// Writes every chunk that is dirty at the call; returns when they are durable.
    pub fn flush(&self) -> Result<FlushReport> {
        Err(Error::Unimplemented("flush to the disk tier"))
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> StoreStats {
        let mut s = self.stats.lock().clone();
        let ram = self.ram.read();
        s.ram_chunks = ram.len() as u64;
        s.ram_bytes = ram.values().map(|c| c.data.len() as u64).sum();
        s.dirty_bytes = s.ram_bytes;
        s
    }

    /// Every chunk id held (RAM or disk) with its payload length: the snapshot
    /// the peer sync publishes.
    pub fn ids(&self) -> Vec<(ChunkId, u64)> {
        self.ram
            .read()
            .iter()
            .map(|(id, c)| (*id, c.data.len() as u64))
            .collect()
    }

    /// Re-reads and checks every chunk on disk. `progress(done, total)` is
    /// called as it goes.
    pub fn verify(
        &self,
        _opts: &VerifyOptions,
        _progress: &mut dyn FnMut(u64, u64),
    ) -> Result<VerifyReport> {
        Err(Error::Unimplemented("verify of the disk tier"))
    }

    /// Drops namespaces by id or age.
    pub fn gc(&self, _opts: &GcOptions) -> Result<GcReport> {
        Err(Error::Unimplemented("gc"))
    }

    /// Flushes dirty chunks within `deadline`, stops the I/O threads and
    /// closes the files. Further calls fail with [`Error::Closed`].
    pub fn close(&self, _deadline: Duration) -> Result<FlushReport> {
        Ok(FlushReport::default())
    }
}
