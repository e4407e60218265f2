//! [`TierConfig`]: the store's configuration, with defaults and a
//! `validate()` that rejects contradictions (never clamps).

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::device::BLOCK;
use crate::{Error, Result};

/// Smallest accepted region size (64 KiB).
pub const MIN_REGION_SIZE: u64 = 64 << 10;
/// Largest accepted region size (1 GiB; offsets within a region are u32).
pub const MAX_REGION_SIZE: u64 = 1 << 30;

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

/// The largest [`TierConfig::ram_entry_cost`]: far above the real cost,
/// far below the smallest RAM budget.
const MAX_RAM_ENTRY_COST: u64 = 64 << 10;

/// Configuration of a [`crate::ChunkStore`]. Field docs end with their default.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct TierConfig {
    /// Directory holding the store's files. Default: `./kvtier-data`.
    pub data_dir: PathBuf,
    /// Hard byte limit of the RAM LRU. Default: 1 GiB. Minimum: 1 MiB.
    pub ram_budget: u64,
    /// Bytes `ram_budget` charges each chunk beyond its payload and name:
    /// its bookkeeping (node, id, table slot), so that a budget also bounds
    /// how many tiny or empty chunks RAM holds. 0 counts payload and name
    /// bytes alone (tests of the LRU's arithmetic). Default:
    /// [`crate::ram::ENTRY_COST`], the real cost.
    pub ram_entry_cost: u64,
    /// Hard byte limit of the NVMe store (preallocated). Default: 16 GiB;
    /// 0 disables the disk tier (RAM only).
    pub disk_budget: u64,
    /// Size of one region of the segment store: the unit of append, seal
    /// and reclaim. A multiple of 4 KiB between 64 KiB and 1 GiB; a chunk
    /// (header + payload) must fit in one region. An existing store keeps
    /// the region size it was created with (a different value is refused at
    /// open; [`existing_region_size`](crate::store::existing_region_size)
    /// reads it). Default: 256 MiB (each full region costs a seal: two
    /// fdatasyncs and three small writes on an idle device; at 64 MiB that
    /// was 5-9 % of the write time, at 256 MiB 2-4 %).
    pub region_size: u64,
    /// Dirty chunks older than this are written when the writer is idle.
    /// Default: 30 s.
    #[serde(with = "duration_ms")]
    pub idle_flush_after: Duration,
    /// Write policy when the writer falls behind. Default: `no-tax`.
    pub write_policy: WritePolicy,
    /// Messages the writer queue holds: under `backpressure` one per
    /// evicted chunk (puts wait when it is full); under `no-tax` one per put
    /// (all the dirty chunks it evicted), and hand-offs that find it full
    /// wait beside it, bounded by `spill_limit`; flushes and deletes take
    /// one per chunk, an idle pass one. Default: 64.
    pub writer_queue: usize,
    /// Promote disk hits into RAM as clean entries. Default: true.
    pub promote_on_read: bool,
    /// Use O_DIRECT when the filesystem supports it. Default: true.
    pub direct_io: bool,
    /// Threads that copy and checksum chunks into disk write batches,
    /// besides the writer thread (one thread packs about as fast as a fast
    /// NVMe drive writes). Default: unset = a quarter of the cores, at most 3.
    pub pack_threads: Option<usize>,
    /// Ask the kernel for transparent huge pages (`MADV_HUGEPAGE`) on new
    /// chunk buffers of 2 MiB and more: a chunk's first copy then faults
    /// one 2 MiB page instead of 512 small ones (a new 32 MiB chunk copied
    /// 2-10x faster on the build machine), and copies out of it miss the
    /// TLB less. Takes effect where THP is `always` or `madvise`; with
    /// `never`, or on other systems, nothing changes. Default: true.
    pub huge_pages: bool,
    /// Open a store file shorter than its superblock says (truncated by an
    /// incomplete copy or restore) by growing it back; the chunks that were
    /// past its end fail their checks and read as misses (`kvtier verify
    /// --repair` sets this, then drops them). Unset, such a file is refused
    /// and left as it is. Default: false.
    pub grow_truncated: bool,
    /// Most namespaces the store registers; a new one past it is refused
    /// with `NoSpace` (`kvtier gc` drops unused ones). Every registration
    /// rewrites the namespace manifest, so this bounds its size (records are
    /// at most 16 KiB each). Default: 4,096.
    pub max_namespaces: usize,
    /// Under `no-tax`, most bytes of chunks evicted dirty that may wait in
    /// memory for the disk writer (`spilled_bytes`), beyond `ram_budget`:
    /// a dirty eviction is dropped and counted (`dropped_unwritten`) when
    /// what waited before the put that evicted it is past the limit, so
    /// one chunk may always wait and at most the limit plus the put's
    /// evictions wait (the chunks one put evicts never count against each
    /// other). This is the only
    /// bound under `no-tax` (a full writer queue drops nothing: hand-offs
    /// wait beside it, and their bytes are held to this limit too: a chunk
    /// waiting there whose spilled copy an overwrite or a delete replaced
    /// still holds its bytes, so at most twice the limit waits when all
    /// did). `backpressure` is bounded by the queue (its PUTs
    /// wait). Default: unset = the larger of a quarter of `ram_budget` and
    /// 128 MiB.
    pub spill_limit: Option<u64>,
    /// Open an existing store without writing anything to its files: no
    /// writer thread, no recovery writes (regions recovered from their
    /// batches stay unsealed, the deletes journal is applied in memory
    /// only, a file longer than its store is not trimmed), and puts,
    /// deletes, flushes and namespace changes are refused with
    /// [`crate::Error::ReadOnly`]. `kvtier verify` without `--repair` uses
    /// it, so that it reports the same damage each time it runs. Not a
    /// config file key. Default: false.
    #[serde(skip)]
    pub read_only: bool,
    /// With `read_only`: a corrupt namespace manifest is read for the
    /// records that still parse (logged), instead of refusing the open, so
    /// `kvtier verify` checks the chunks all the same and reports the
    /// manifest itself. Not a config file key. Default: false.
    #[serde(skip)]
    pub salvage_manifest: bool,
    /// Bytes kept free on the data dir's filesystem when a sparse store
    /// file (copied without its holes, or holes punched in it) is backed
    /// again at open: where backing it would leave less, it stays sparse
    /// (its writes pause on ENOSPC when they reach a hole) rather than
    /// filling the filesystem. The node passes its `disk-reserve`.
    /// Default: 0.
    pub disk_reserve: u64,
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
            ram_entry_cost: crate::ram::ENTRY_COST,
            disk_budget: 16 << 30,
            region_size: 256 << 20,
            idle_flush_after: Duration::from_secs(30),
            write_policy: WritePolicy::NoTax,
            writer_queue: 64,
            promote_on_read: true,
            direct_io: true,
            pack_threads: None,
            huge_pages: true,
            grow_truncated: false,
            max_namespaces: 4096,
            spill_limit: None,
            read_only: false,
            salvage_manifest: false,
            disk_reserve: 0,
        }
    }
}

impl TierConfig {
    /// [`TierConfig::spill_limit`], or its default.
    pub fn spill_limit(&self) -> u64 {
        self.spill_limit
            .unwrap_or_else(|| (self.ram_budget / 4).max(128 << 20))
    }

    /// Rejects contradictions (never clamps silently).
    pub fn validate(&self) -> Result<()> {
        if self.max_namespaces == 0 {
            return Err(Error::Config(
                "max-namespaces is 0: no namespace could be registered".into(),
            ));
        }
        if self.ram_budget < (1 << 20) {
            return Err(Error::Config(format!(
                "ram-budget is {} bytes; the minimum is 1 MiB",
                self.ram_budget
            )));
        }
        if self.ram_entry_cost > MAX_RAM_ENTRY_COST {
            return Err(Error::Config(format!(
                "ram-entry-cost is {} bytes; the most is {MAX_RAM_ENTRY_COST} (the real \
                 bookkeeping is {} bytes)",
                self.ram_entry_cost,
                crate::ram::ENTRY_COST
            )));
        }
        if self.region_size % BLOCK != 0
            || self.region_size < MIN_REGION_SIZE
            || self.region_size > MAX_REGION_SIZE
        {
            return Err(Error::Config(format!(
                "region-size is {} bytes; it must be a multiple of {BLOCK} between {MIN_REGION_SIZE} and {MAX_REGION_SIZE}",
                self.region_size
            )));
        }
        if self.disk_budget != 0 && self.disk_budget / self.region_size > u64::from(u32::MAX) {
            return Err(Error::Config(format!(
                "disk-budget ({}) holds more than 2^32 regions of region-size ({})",
                self.disk_budget, self.region_size
            )));
        }
        if self.disk_budget != 0 && self.disk_budget < 2 * self.region_size {
            return Err(Error::Config(format!(
                "disk-budget ({}) must hold at least two regions of region-size ({}), or be 0",
                self.disk_budget, self.region_size
            )));
        }
        if self.pack_threads.is_some_and(|n| n > 64) {
            return Err(Error::Config(format!(
                "pack-threads is {}; at most 64",
                self.pack_threads.unwrap_or(0)
            )));
        }
        if self.writer_queue == 0 {
            return Err(Error::Config("writer-queue must be at least 1".into()));
        }
        Ok(())
    }
}
