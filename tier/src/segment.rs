//! The segment store's shared state: the device, its geometry, the index and
//! the counters; the verified read path; and recovery (rebuilding the index
//! at open from region summaries, or from batch records for a region that
//! was not sealed).
//!
//! The writer thread (`writer.rs`) is the only one that writes; readers use
//! [`Disk::read_chunk`] from the caller's thread.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

use bytes::Bytes;
use parking_lot::{Mutex, RwLock};

use crate::buffers::BufferPool;
use crate::device::{AlignedBuf, BLOCK, Device, block_up};
use crate::format::{ChunkHeader, crc32c};
use crate::index::{Index, Location};
use crate::layout::{
    ArchivedEntry, BATCH_FIXED, BatchHead, DATA_START, Entry, KIND_CHUNK, KIND_TOMBSTONE,
    OPEN_SLOT, RECORD_ALIGN, STORE_VERSION, SealSlot, Superblock, SuperblockError, decode_entries,
    decode_open_slot,
};
use crate::types::ChunkId;
use crate::{Error, Result};

/// Most index entries reserved up front at recovery (16 Mi; more grow the
/// index as they arrive).
const MAX_INDEX_HINT: u64 = 1 << 24;

/// Counters of the disk tier (monotonic since open).
#[derive(Default)]
pub(crate) struct DiskCounters {
    pub disk_writes: AtomicU64,
    pub disk_write_bytes: AtomicU64,
    pub disk_reads: AtomicU64,
    pub region_evictions: AtomicU64,
    pub verify_failures: AtomicU64,
    pub write_failures: AtomicU64,
    /// fdatasyncs issued (flushes, region switches, quiet-writer syncs).
    pub syncs: AtomicU64,
    /// Time spent in those fdatasyncs, in microseconds.
    pub sync_micros: AtomicU64,
    /// Time the I/O thread spent writing batches, in microseconds.
    pub write_micros: AtomicU64,
    /// Batch writes the I/O thread issued (failed ones included).
    pub batch_writes: AtomicU64,
    /// Bytes read from disk by chunk reads (whole blocks).
    pub read_bytes: AtomicU64,
    /// Time chunk reads spent waiting for the device, in microseconds.
    pub read_micros: AtomicU64,
    /// Tombstones the disk refused (ENOSPC) waiting to be written again, as
    /// the writer last answered a flush.
    pub tombstones_unwritten: AtomicU64,
    /// Region slots or batch records found damaged at open (bit rot: a
    /// crash never produces one), see [`Disk::recover`].
    pub damaged_metadata: AtomicU64,
}

impl DiskCounters {
    /// Adds the time since `t` to `micros`.
    pub fn add_time(micros: &AtomicU64, t: Instant) {
        micros.fetch_add(t.elapsed().as_micros() as u64, Ordering::Relaxed);
    }
}

/// The disk tier shared by readers and the writer thread.
pub(crate) struct Disk {
    pub dev: Arc<dyn Device>,
    pub region_size: u64,
    pub region_count: u32,
    // parking_lot RwLock: many concurrent readers, short write sections by
    // the writer (batch inserts, reclaim); never held across I/O.
    pub index: RwLock<Index>,
    // parking_lot Mutex: set once on a failed write/fsync, read rarely.
    pub poison: Mutex<Option<String>>,
    pub paused_nospace: AtomicBool,
    /// Set when the writer thread has stopped taking messages: a flush
    /// marker still unanswered then never will be.
    pub writer_stopped: AtomicBool,
    /// Set when a close's deadline has passed: the writer drops the chunk
    /// writes still queued (each counted failed) instead of writing them,
    /// so the stop is not held up by them.
    pub abandon_writes: AtomicBool,
    /// Payload bytes of evictions' writes dropped so (no RAM copy left).
    pub abandoned_bytes: AtomicU64,
    pub counters: DiskCounters,
    /// Payload bytes of the chunks in the index.
    pub live_bytes: AtomicU64,
    /// Buffers of dropped chunks, reused by the next reads (shared with
    /// the store's copies of new chunks).
    pub bufs: Arc<BufferPool>,
}

/// Why a disk read did not produce bytes.
#[derive(Debug)]
pub(crate) enum ReadMiss {
    /// Not in the index (no I/O was done).
    Absent,
    /// The read or a check failed (logged, counted); the entry was dropped
    /// from the index.
    Bad,
}

/// A region recovered from its batch records (no valid seal).
pub(crate) struct Unsealed {
    pub r: u32,
    pub generation: u64,
    /// Entries of the intact batches, in order.
    pub entries: Vec<Entry>,
    /// End of the last intact batch (where the torn tail, if any, starts).
    pub data_end: u64,
    /// The last intact batch is a stop marker (no entries, see
    /// `Writer::mark_stop`).
    pub ends_marked: bool,
}

/// What recovery found, handed to the writer.
pub(crate) struct Recovered {
    /// Per region: generation (0 = free) and whether it is sealed.
    pub regions: Vec<(u64, bool)>,
    /// Regions recovered from batch records that must be sealed now.
    pub unsealed: Vec<Unsealed>,
    /// Regions whose open slot was damaged (bit rot), with the generation
    /// recovery took from their other records (`None`: none known, the
    /// region counts as free). `seal_open_region` rewrites those slots.
    pub damaged_slots: Vec<(u32, Option<u64>)>,
    /// Regions whose open slot names a generation but that hold nothing
    /// durable (no batch, or only torn or corrupt chunks): free in memory,
    /// walked again at every open until reused, or until
    /// [`crate::ChunkStore::seal_open_region`] clears their slot.
    pub emptied: Vec<u32>,
    /// The region that was open at the last shutdown or crash, recovered
    /// from its batch records, to be re-opened for appends at its data end
    /// (so restarts do not waste its remainder). Only the newest region
    /// holding entries qualifies, and only if its walk saw no read error.
    pub reopen: Option<Unsealed>,
    /// Highest generation seen.
    pub max_generation: u64,
    /// Highest transaction id seen.
    pub max_txn: u64,
}

/// A read of the recovery walk. Failpoint `tier::recovery::scan_read`
/// (feature `failpoints`): fails it with EIO.
fn scan_read(dev: &dyn Device, buf: &mut [u8], off: u64) -> std::io::Result<()> {
    #[cfg(feature = "failpoints")]
    fail::fail_point!("tier::recovery::scan_read", |arg| Err(failpoint_error(arg)));
    dev.read_at(buf, off)
}

/// The I/O error a failpoint injects: ENOSPC for the argument `enospc`,
/// else EIO.
#[cfg(feature = "failpoints")]
pub(crate) fn failpoint_error(arg: Option<String>) -> std::io::Error {
    match arg.as_deref() {
        Some("enospc") => std::io::Error::from_raw_os_error(libc::ENOSPC),
        _ => std::io::Error::from_raw_os_error(libc::EIO),
    }
}

/// What [`Disk::scan_batches`] found.
pub(crate) struct Scan {
    /// Entries of the intact batches, in order.
    pub entries: Vec<Entry>,
    /// Where the intact batches end.
    pub data_end: u64,
    /// The walk stopped at a read error (not at an invalid record), so
    /// what lies beyond is unknown: such a region is neither sealed nor
    /// re-opened (nothing is written to it).
    pub io_error: bool,
    /// The last intact batch holds no entries: a clean stop's marker.
    pub ends_marked: bool,
}

/// The superblock in `block` (the first block of the store at `path`):
/// `None` for a zeroed block (a fresh file), an error for another format
/// version, a corrupt superblock or a file that is not a kvtier store.
pub(crate) fn read_superblock(path: &std::path::Path, block: &[u8]) -> Result<Option<Superblock>> {
    match Superblock::decode(block) {
        Ok(sb) => Ok(Some(sb)),
        Err(SuperblockError::Version(v)) => Err(Error::IncompatibleVersion {
            what: "store format",
            found: v,
            supported: STORE_VERSION.to_string(),
            hint: "move the store away (or delete it) to start a fresh one",
        }),
        Err(SuperblockError::Corrupt(detail)) => Err(Error::Corrupt {
            what: format!("superblock of {}", path.display()),
            detail,
        }),
        Err(SuperblockError::NoMagic) if block.iter().any(|&b| b != 0) => Err(Error::Corrupt {
            what: format!("superblock of {}", path.display()),
            detail: "no kvtier magic and not zeroed: not a kvtier store".into(),
        }),
        Err(SuperblockError::NoMagic) => Ok(None),
    }
}

/// Refuses to open the store at `path`, laid out as `found`, with another
/// region size or region count than the configuration's.
pub(crate) fn check_layout(
    path: &std::path::Path,
    found: crate::store::StoreLayout,
    region_size: u64,
    region_count: u64,
) -> Result<()> {
    if found.region_size != region_size {
        return Err(Error::Config(format!(
            "the store in {} was created with region-size {} but the config says {}; \
             set region-size back to {} or move the store away",
            path.display(),
            size_text(found.region_size),
            size_text(region_size),
            size_text(found.region_size)
        )));
    }
    if u64::from(found.region_count) != region_count {
        return Err(Error::Config(format!(
            "the store in {} holds {} regions ({}) but disk-budget gives {}; \
             restore the disk-budget or move the store away",
            path.display(),
            found.region_count,
            size_text(found.bytes()),
            region_count
        )));
    }
    Ok(())
}

/// `n` bytes as a config value: `8MiB` where it is a whole number of MiB
/// (or GiB), else the bytes.
fn size_text(n: u64) -> String {
    match n {
        0 => "0".into(),
        n if n % (1 << 30) == 0 => format!("{}GiB", n >> 30),
        n if n % (1 << 20) == 0 => format!("{}MiB", n >> 20),
        n => n.to_string(),
    }
}

impl Disk {
    /// fdatasync of the device, counted and timed.
    pub fn sync(&self) -> std::io::Result<()> {
        let t = Instant::now();
        let res = self.dev.sync();
        self.counters.syncs.fetch_add(1, Ordering::Relaxed);
        DiskCounters::add_time(&self.counters.sync_micros, t);
        res
    }

    /// Byte offset of region `r`.
    pub fn region_base(&self, r: u32) -> u64 {
        u64::from(r) * self.region_size
    }

    pub fn poisoned(&self) -> Option<String> {
        self.poison.lock().clone()
    }

    /// Reads and fully verifies the chunk `id` (header CRC, identity, name,
    /// length, payload CRC). A failed check or I/O error drops the entry.
    pub fn read_chunk(
        &self,
        id: &ChunkId,
        name: Option<&[u8]>,
    ) -> Result<(Bytes, Option<Bytes>), ReadMiss> {
        let Some(loc) = self.index.read().get(id) else {
            return Err(ReadMiss::Absent);
        };
        match self.read_at_location(id, None, &loc) {
            Ok((data, stored)) => {
                // A different name is a plain miss (another key hashing to
                // the same id), not corruption: keep the entry.
                if let Some(want) = name {
                    if stored.as_deref().unwrap_or(&[]) != want {
                        return Err(ReadMiss::Absent);
                    }
                }
                Ok((data, stored))
            }
            Err(why) => {
                self.counters
                    .verify_failures
                    .fetch_add(1, Ordering::Relaxed);
                tracing::warn!(chunk = ?id, region = loc.region, offset = loc.offset, %why,
                    "disk read failed verification; served as a miss and dropped");
                let mut ix = self.index.write();
                if ix.get(id) == Some(loc) {
                    ix.remove(id);
                    self.live_bytes
                        .fetch_sub(u64::from(loc.payload_len), Ordering::Relaxed);
                }
                Err(ReadMiss::Bad)
            }
        }
    }

    /// Reads the record at `loc` and checks it against `id` and `loc`.
    pub fn read_at_location(
        &self,
        id: &ChunkId,
        name: Option<&[u8]>,
        loc: &Location,
    ) -> Result<(Bytes, Option<Bytes>), String> {
        let hl = loc.header_len as usize;
        let pl = loc.payload_len as usize;
        // Records are packed at 64-byte alignment: read the covering blocks.
        let start = u64::from(loc.offset);
        let first = start / BLOCK * BLOCK;
        let end = block_up(start + (hl + pl) as u64);
        if end > self.region_size || start < DATA_START {
            return Err(format!(
                "record of {} bytes at {start} is outside the region",
                hl + pl
            ));
        }
        let mut whole = self.bufs.take((end - first) as usize);
        self.counters.disk_reads.fetch_add(1, Ordering::Relaxed);
        let skip = (start - first) as usize;
        // The payload's CRC runs over each piece as it lands, while the
        // device reads the rest (where the device can split the read).
        let payload = skip + hl..skip + hl + pl;
        let (mut at, mut crc) = (0usize, crate::format::Crc32c::default());
        let t = Instant::now();
        let read = self.dev.read_at_in_order(
            &mut whole,
            self.region_base(loc.region) + first,
            &mut |part: &[u8]| {
                let (lo, hi) = (at, at + part.len());
                let (a, b) = (lo.max(payload.start), hi.min(payload.end));
                if a < b {
                    crc.update(&part[a - lo..b - lo]);
                }
                at = hi;
            },
        );
        DiskCounters::add_time(&self.counters.read_micros, t);
        read.map_err(|e| format!("I/O error: {e}"))?;
        self.counters
            .read_bytes
            .fetch_add(whole.len() as u64, Ordering::Relaxed);
        let buf = &whole[skip..skip + hl + pl];
        let head = ChunkHeader::decode(&buf[..hl]).map_err(|e| e.to_string())?;
        if head.encoded_len() != hl {
            return Err(format!(
                "header length {} differs from the index's {hl}",
                head.encoded_len()
            ));
        }
        head.check_identity(id, name).map_err(|e| e.to_string())?;
        if head.payload_len != pl as u64 || head.payload_crc != loc.crc {
            return Err(format!(
                "header says {} bytes crc {:#010x}, index says {pl} bytes crc {:#010x}",
                head.payload_len, head.payload_crc, loc.crc
            ));
        }
        head.check_payload_crc(crc.value())
            .map_err(|e| e.to_string())?;
        Ok((
            self.bufs.share(whole).slice(skip + hl..skip + hl + pl),
            head.name,
        ))
    }

    fn io_err(&self, op: &'static str, e: std::io::Error) -> Error {
        Error::Io {
            op,
            path: self.dev.path().to_path_buf(),
            source: e,
        }
    }

    /// Opens the device: formats a fresh one, else checks the superblock
    /// against the configured geometry and rebuilds the index.
    pub fn open(
        dev: Arc<dyn Device>,
        region_size: u64,
        bufs: Arc<BufferPool>,
    ) -> Result<(Self, Recovered)> {
        let region_count = u32::try_from(dev.len() / region_size).map_err(|_| {
            Error::Config(format!("{} regions is too many", dev.len() / region_size))
        })?;
        let disk = Self {
            dev,
            region_size,
            region_count,
            index: RwLock::new(Index::default()),
            poison: Mutex::new(None),
            paused_nospace: AtomicBool::new(false),
            writer_stopped: AtomicBool::new(false),
            abandon_writes: AtomicBool::new(false),
            abandoned_bytes: AtomicU64::new(0),
            counters: DiskCounters::default(),
            live_bytes: AtomicU64::new(0),
            bufs,
        };
        let mut block = AlignedBuf::zeroed(BLOCK as usize);
        disk.dev
            .read_at(&mut block, 0)
            .map_err(|e| disk.io_err("read the superblock of", e))?;
        match read_superblock(disk.dev.path(), &block)? {
            Some(sb) => {
                check_layout(
                    disk.dev.path(),
                    crate::store::StoreLayout {
                        region_size: sb.region_size,
                        region_count: sb.region_count,
                    },
                    region_size,
                    u64::from(region_count),
                )?;
            }
            None => {
                // A fresh device. Regions carry no valid open slot (zeroed),
                // except after a crash of a previous format attempt, which
                // wrote nothing but the superblock.
                let sb = Superblock {
                    version: STORE_VERSION,
                    region_size,
                    region_count,
                    created_ms: crate::layout::now_ms(),
                };
                sb.encode_into(&mut block);
                disk.dev
                    .write_at(&block, 0)
                    .and_then(|()| disk.dev.sync())
                    .map_err(|e| disk.io_err("write the superblock of", e))?;
            }
        }
        let rec = disk.recover()?;
        Ok((disk, rec))
    }

    fn recover(&self) -> Result<Recovered> {
        let mut slots = AlignedBuf::zeroed(2 * BLOCK as usize);
        let mut order = Vec::new();
        let mut regions = vec![(0u64, false); self.region_count as usize];
        let mut damaged_slots = Vec::new();
        for r in 0..self.region_count {
            self.dev
                .read_at(&mut slots, self.region_base(r) + OPEN_SLOT)
                .map_err(|e| self.io_err("read region slots of", e))?;
            let decoded = decode_open_slot(&slots[..BLOCK as usize], r);
            let generation = match decoded {
                Some(g) => Some(g),
                None if slots[..BLOCK as usize].iter().all(|&b| b == 0) => None,
                None => {
                    let g = self.generation_of_damaged(r, &slots);
                    damaged_slots.push((r, g));
                    g
                }
            };
            let Some(generation) = generation else {
                continue;
            };
            let seal_block = &slots[BLOCK as usize..];
            let decoded = SealSlot::decode(seal_block);
            if decoded.is_none() && seal_block.iter().any(|&b| b != 0) {
                // Written whole (its bytes are in its first sector) and only
                // after the summary is durable: not a torn write, damage.
                self.counters
                    .damaged_metadata
                    .fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    region = r,
                    "damaged seal slot; scanning the region's batches"
                );
            }
            let seal = decoded.filter(|s| s.generation == generation && s.region == r);
            order.push((generation, r, seal));
        }
        order.sort_unstable_by_key(|o| (o.0, o.1));
        // A capacity hint only: a seal slot's count is bounded by the
        // records its region can hold (a crafted slot with a valid CRC
        // asked for billions of entries and aborted the start), and the sum
        // by MAX_INDEX_HINT (the index grows past it as entries arrive).
        let per_region = self.region_size.saturating_sub(DATA_START) / RECORD_ALIGN;
        let total: u64 = order
            .iter()
            .filter_map(|(_, _, s)| s.map(|s| u64::from(s.entry_count).min(per_region)))
            .sum();
        let mut index = Index::with_capacity(total.min(MAX_INDEX_HINT) as usize);
        // Per group: the size its entries record and the distinct members
        // found (an id counted once, however often its version was written).
        let mut txns: HashMap<u64, (u32, u32)> = HashMap::new();
        // What each member's id mapped to before its group's entry was
        // applied (the first time), so that a group found incomplete rolls
        // its members back to what came before it instead of dropping them.
        let mut before: HashMap<(ChunkId, u64), Location> = HashMap::new();
        let mut rec = Recovered {
            regions: Vec::new(),
            unsealed: Vec::new(),
            emptied: Vec::new(),
            damaged_slots,
            reopen: None,
            max_generation: order.last().map_or(0, |o| o.0),
            max_txn: 0,
        };
        let mut apply = |r: u32, e: &Entry, index: &mut Index, max_txn: &mut u64| {
            let id = e.id();
            if e.kind == KIND_TOMBSTONE {
                index.remove(&id);
                return;
            }
            if e.txn != 0 {
                *max_txn = (*max_txn).max(e.txn);
                let prev = index.get(&id);
                // A rewrite of this group's version (the id's newest entry is
                // already the group's) is not another member.
                let again = prev.is_some_and(|l| l.txn == e.txn);
                let t = txns.entry(e.txn).or_insert((e.txn_size, 0));
                if !again {
                    t.1 += 1;
                }
                // Only an earlier location of another group; no entry means
                // nothing before, so first versions, the usual case, cost
                // nothing here.
                if let Some(prev) = prev.filter(|_| !again) {
                    before.entry((id, e.txn)).or_insert(prev);
                }
            }
            index.insert(
                id,
                Location {
                    region: r,
                    offset: e.offset,
                    header_len: e.header_len,
                    payload_len: e.payload_len,
                    crc: e.payload_crc,
                    txn: e.txn,
                },
            );
        };
        for (generation, r, seal) in order {
            // A seal slot is written only once its summary is durable: a
            // summary that fails its checks is damage, not a torn write.
            let summary = seal.and_then(|s| {
                self.read_summary(r, &s)
                    .inspect_err(|_| {
                        self.counters
                            .damaged_metadata
                            .fetch_add(1, Ordering::Relaxed);
                    })
                    .ok()
            });
            // A summary that passes its CRC but not validation (a writer bug,
            // a crafted file) is walked around like one that fails its CRC.
            let arch = summary.as_ref().and_then(|buf| {
                decode_entries(buf)
                    .inspect_err(|e| {
                        self.counters
                            .damaged_metadata
                            .fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(region = r, error = %e,
                            "region summary passes its crc but does not decode; scanning batches");
                    })
                    .ok()
            });
            match arch {
                Some(arch) => {
                    for a in arch.iter() {
                        apply(
                            r,
                            &ArchivedEntry::to_native(a),
                            &mut index,
                            &mut rec.max_txn,
                        );
                    }
                    regions[r as usize] = (generation, true);
                }
                None => {
                    let scan = self.scan_batches(r, generation)?;
                    if scan.entries.is_empty() && !scan.io_error {
                        // Nothing durable: the region is free again.
                        rec.emptied.push(r);
                        continue;
                    }
                    for e in &scan.entries {
                        apply(r, e, &mut index, &mut rec.max_txn);
                    }
                    // In memory, a region recovered from its batches counts
                    // as sealed (nothing is appended) unless re-opened below.
                    regions[r as usize] = (generation, true);
                    if scan.io_error {
                        // What lies past the read error is unknown: sealing
                        // (a summary at the end of what was read) or
                        // appending could overwrite durable batches. The
                        // region is left as it is until it is reclaimed; the
                        // next open walks it again.
                        tracing::warn!(
                            region = r,
                            entries = scan.entries.len(),
                            "read error while walking the batches of an unsealed region; \
                             serving what was read, writing nothing to it"
                        );
                    } else {
                        // `order` is sorted by generation: a later region
                        // holding entries makes an earlier candidate unfit
                        // (its new entries would be applied before that
                        // region's at the next recovery); see below.
                        rec.unsealed.extend(rec.reopen.take());
                        rec.reopen = Some(Unsealed {
                            r,
                            generation,
                            entries: scan.entries,
                            data_end: scan.data_end,
                            ends_marked: scan.ends_marked,
                        });
                    }
                }
            }
            if rec
                .reopen
                .as_ref()
                .is_some_and(|u| u.generation < generation)
            {
                rec.unsealed.extend(rec.reopen.take());
            }
        }
        if let Some(u) = &rec.reopen {
            // Open (not sealed): the writer appends to it.
            regions[u.r as usize] = (u.generation, false);
        }
        // Atomic groups: a group not found whole is undone. Each member whose
        // newest entry is that group's goes back to what it was before the
        // group (an earlier version, or nothing), and further back while that
        // too belongs to an incomplete group. Dropping the member instead
        // broke the group before it: with {A, B} flushed, then {A', B'} of
        // which only A' reached the disk, A was lost and B shown alone.
        let incomplete: std::collections::HashSet<u64> = txns
            .iter()
            .filter(|(_, (size, found))| found != size)
            .map(|(txn, _)| *txn)
            .collect();
        let undo: Vec<ChunkId> = if incomplete.is_empty() {
            Vec::new()
        } else {
            index
                .iter()
                .filter(|(_, l)| incomplete.contains(&l.txn))
                .map(|(id, _)| *id)
                .collect()
        };
        {
            for id in &undo {
                let mut now = index.get(id);
                // Each step goes to an older group's entry; bounded all the
                // same.
                let mut steps = 0;
                while let Some(l) = now.filter(|l| incomplete.contains(&l.txn)) {
                    steps += 1;
                    now = before
                        .get(&(*id, l.txn))
                        .copied()
                        .filter(|_| steps <= incomplete.len());
                }
                match now {
                    Some(l) => {
                        index.insert(*id, l);
                    }
                    None => {
                        index.remove(id);
                    }
                }
            }
        }
        let live: u64 = index.iter().map(|(_, l)| u64::from(l.payload_len)).sum();
        self.live_bytes.store(live, Ordering::Relaxed);
        *self.index.write() = index;
        rec.regions = regions;
        Ok(rec)
    }

    /// The generation of region `r` whose open slot (first block of
    /// `slots`) is not valid: `None` for a free region (a zeroed slot);
    /// else the slot is damaged, counted and logged, and the generation is
    /// taken from the region's own records: the newer of its seal slot and
    /// its first batch record, where they name this region (`None` when
    /// neither does: nothing durable is known there).
    fn generation_of_damaged(&self, r: u32, slots: &[u8]) -> Option<u64> {
        if slots[..BLOCK as usize].iter().all(|&b| b == 0) {
            return None;
        }
        self.counters
            .damaged_metadata
            .fetch_add(1, Ordering::Relaxed);
        let seal = SealSlot::decode(&slots[BLOCK as usize..])
            .filter(|s| s.region == r)
            .map(|s| s.generation);
        let mut head = AlignedBuf::zeroed(BLOCK as usize);
        let first = scan_read(&*self.dev, &mut head, self.region_base(r) + DATA_START)
            .ok()
            .and_then(|()| BatchHead::decode(&head[..BATCH_FIXED]))
            .filter(|h| h.region == r)
            .map(|h| h.generation);
        let generation = seal.max(first);
        tracing::warn!(
            region = r,
            ?generation,
            "damaged open slot: the region's generation is taken from its seal slot and first batch record"
        );
        generation
    }

    /// Reads and checks a sealed region's summary; Err means "scan instead".
    pub fn read_summary(&self, r: u32, s: &SealSlot) -> Result<AlignedBuf, String> {
        let off = u64::from(s.summary_offset);
        let len = u64::from(s.summary_len);
        if off < DATA_START || off % BLOCK != 0 || off + block_up(len) > self.region_size {
            return Err(format!("summary at {off}+{len} is out of bounds"));
        }
        let mut buf = AlignedBuf::zeroed(block_up(len) as usize);
        self.dev
            .read_at(&mut buf, self.region_base(r) + off)
            .map_err(|e| e.to_string())?;
        buf.set_len(len as usize);
        if crc32c(&buf) != s.summary_crc {
            tracing::warn!(region = r, "region summary fails its crc; scanning batches");
            return Err("summary crc mismatch".into());
        }
        Ok(buf)
    }

    /// Walks the batch records of region `r` from the start, verifying every
    /// chunk of every batch; stops at the first invalid or torn batch.
    /// Returns the entries of the intact batches and where they end.
    pub fn scan_batches(&self, r: u32, generation: u64) -> Result<Scan> {
        let mut entries = Vec::new();
        let mut off = DATA_START;
        let base = self.region_base(r);
        let mut head_buf = AlignedBuf::zeroed(BLOCK as usize);
        let mut io_error = false;
        // A batch whose record (head intact) failed its entries' checks:
        // skipped, since the head says where the next one starts. Damage
        // when an intact batch follows; a torn tail (a write that never
        // completed) when none does. A clean stop ends the chain with an
        // empty batch (`Writer::mark_stop`), so after one the last batch
        // with chunks is followed by an intact one: its damage is reported.
        let mut skipped: Option<(u64, u32)> = None;
        let mut ends_marked = false;
        while off + BLOCK <= self.region_size {
            if scan_read(&*self.dev, &mut head_buf, base + off).is_err() {
                io_error = true;
                break;
            }
            let Some(h) = BatchHead::decode(&head_buf[..BATCH_FIXED]) else {
                // A record the walk reached that fails its own CRC: not a
                // torn write (its first sector lands whole), damage. What
                // follows it is lost: where it ends is in it. Only a block
                // with the record's magic and version naming this region
                // counts: a payload an older generation left past the chain
                // may start with the magic alone (the region's normal end).
                // A flipped byte spoils one field: the magic and version
                // with the region or the generation, or those two alone.
                let magic = head_buf[..4] == crate::layout::BATCH_MAGIC
                    && head_buf[4..6] == crate::layout::SLOT_VERSION.to_le_bytes();
                let region_ok = head_buf[8..12] == r.to_le_bytes();
                let generation_ok = head_buf[16..24] == generation.to_le_bytes();
                let named = (magic && (region_ok || generation_ok)) || (region_ok && generation_ok);
                if named {
                    self.damaged_batch(
                        r,
                        off,
                        "the chunks from here to the region's end are not recovered",
                    );
                }
                break;
            };
            let blen = u64::from(h.batch_len);
            if h.generation != generation
                || h.region != r
                || blen % BLOCK != 0
                || blen < h.record_len()
                || off + blen > self.region_size
            {
                break;
            }
            let mut batch = AlignedBuf::zeroed(blen as usize);
            if self.dev.read_at(&mut batch, base + off).is_err() {
                io_error = true;
                break;
            }
            let ents = batch.get(BATCH_FIXED..BATCH_FIXED + h.entries_len as usize);
            let list: Option<Vec<Entry>> = ents
                .filter(|ents| crc32c(ents) == h.entries_crc)
                .and_then(|ents| decode_entries(ents).ok())
                .map(|arch| arch.iter().map(ArchivedEntry::to_native).collect())
                .filter(|list: &Vec<Entry>| list.len() == h.entry_count as usize);
            let Some(list) = list else {
                skipped.get_or_insert((off, h.entry_count));
                off += blen;
                continue;
            };
            ends_marked = list.is_empty();
            if let Some((at, _)) = skipped.take() {
                self.damaged_batch(
                    r,
                    at,
                    "bit rot, or a write a power loss tore while a later one landed: the chunks \
                     of its batch are not recovered; the batches after it are",
                );
            }
            // The record is intact, so the chain goes on; a chunk of the batch
            // that is torn or corrupt is left out on its own. (Within one
            // generation a position is written once, and a re-opened region
            // clears leftover records past its data end before a batch can
            // chain to them, see `Writer::clear_leftover`; so a valid record
            // at a chained position is genuine.)
            for e in list {
                if self.batch_entry_ok(&e, &batch, off, blen) {
                    entries.push(e);
                } else {
                    self.counters
                        .verify_failures
                        .fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(region = r, offset = e.offset, chunk = ?e.id(),
                        "torn or corrupt chunk in an unsealed region; dropped at recovery");
                }
            }
            off += blen;
        }
        if let Some((at, n)) = skipped.filter(|&(_, n)| n > 0) {
            // Not counted as damage: after a crash this is the normal end
            // of a region (a write it tore, never flushed). A region a clean
            // stop closed ends with its marker, so there it is damage and
            // counted above.
            tracing::warn!(
                region = r,
                offset = at,
                chunks = n,
                "the last batch of an unsealed region failed its checks: a write a crash or \
                 power loss tore (never flushed), or damage; its chunks are not recovered"
            );
        }
        Ok(Scan {
            entries,
            // A torn last batch: the next write goes where it started.
            data_end: skipped.map_or(off, |(at, _)| at),
            io_error,
            ends_marked: ends_marked && skipped.is_none(),
        })
    }

    /// Counts and logs a damaged batch record at `off` of region `r`.
    fn damaged_batch(&self, r: u32, off: u64, what: &str) {
        self.counters
            .damaged_metadata
            .fetch_add(1, Ordering::Relaxed);
        tracing::warn!(
            region = r,
            offset = off,
            "damaged batch record in an unsealed region: {what}"
        );
    }

    fn batch_entry_ok(&self, e: &Entry, batch: &[u8], batch_off: u64, blen: u64) -> bool {
        if e.kind != KIND_CHUNK {
            return e.kind == KIND_TOMBSTONE;
        }
        let start = u64::from(e.offset);
        let end = start + u64::from(e.header_len) + u64::from(e.payload_len);
        if start < batch_off || end > batch_off + blen {
            return false;
        }
        let rec = &batch[(start - batch_off) as usize..(end - batch_off) as usize];
        let hl = e.header_len as usize;
        let Ok(head) = ChunkHeader::decode(&rec[..hl.min(rec.len())]) else {
            return false;
        };
        head.encoded_len() == hl
            && head.id == e.id()
            && head.payload_crc == e.payload_crc
            && head.verify_payload(&rec[hl..]).is_ok()
    }
}
