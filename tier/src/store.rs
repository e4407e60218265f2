//! [`ChunkStore`]: the facade over the RAM LRU ([`crate::ram::RamCache`])
//! and the NVMe segment store (`segment.rs`, `writer.rs`).
//!
//! Write policy (no tax): a PUT lands in RAM (dirty; clean on a store
//! without a disk, which owes nothing) and returns. Disk
//! writes happen (a) when RAM evicts a dirty chunk (queued to the writer
//! thread with `try_send`: under [`WritePolicy::NoTax`] a full queue drops the
//! chunk and counts it in `dropped_unwritten`; under
//! [`WritePolicy::Backpressure`] the PUT waits for queue space), (b) in idle
//! time, for dirty chunks older than `idle-flush-after`, only while the writer
//! queue is empty (thread `kvtier-idle`), (c) on [`ChunkStore::flush`], which
//! returns when every chunk dirty at the call is durable, and (d) on
//! [`ChunkStore::close`]. Nothing else writes: an idle store does no I/O.
//!
//! Reads go RAM first, then disk (only if the in-RAM index has the id: a
//! miss does no I/O); every disk read is verified (header CRC, namespace,
//! key, group, name, length, payload CRC) and any failure is a miss, a
//! `verify_failures` count and a log line.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bytes::Bytes;
use crossbeam_channel::{RecvTimeoutError, Sender, TrySendError, bounded};
use parking_lot::{Mutex, RwLock};
use serde::Serialize;

use crate::buffers::BufferPool;
pub use crate::config::{TierConfig, WritePolicy};
use crate::device::{Device, DirectMode, FileDevice};
use crate::format::ChunkHeader;
use crate::index::{Location, key_hash, seed};
use crate::manifest::{self, NsEntry};
use crate::ram::{AbsentMark, Evicted, RamCache, RamEntry, pipelined};
use crate::segment::{Disk, ReadMiss};
use crate::writer::{Hooks, Job, Msg, PendingMap, PendingWrite, Ticket, Writer};
use crate::{ChunkId, ChunkKey, Error, GroupId, Namespace, NamespaceRecord, Result, Tier};

/// Name of the store file inside the data dir.
pub const STORE_FILE: &str = "store.kvt";

/// Mode of a data dir kvtier creates: the service's user and group only.
/// The store holds KV caches of prompts; nobody else should read them.
pub const DATA_DIR_MODE: u32 = 0o750;
/// Mode of the files kvtier creates in it.
pub const DATA_FILE_MODE: u32 = 0o640;

/// Creates `dir` and its missing parents with [`DATA_DIR_MODE`] (an
/// existing directory keeps its mode).
pub fn create_data_dir(dir: &std::path::Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(DATA_DIR_MODE)
        .create(dir)
}

/// Opens a file of the data dir, never through a symbolic link
/// (`O_NOFOLLOW`) and never one that is not a regular file (`O_NONBLOCK`,
/// which regular files ignore, keeps a FIFO from blocking the open). A
/// daemon or a `sudo kvtier verify` running as root on a data dir that
/// another user can write would otherwise write, and chown, whatever a
/// link planted there points to. Opened for writing, it must have no other
/// name either (a hard link: kvtier writes in place, so it would change
/// that file too). `flags`: more `open(2)` flags (`O_DIRECT`).
pub fn open_data_file(
    path: &std::path::Path,
    opts: &mut std::fs::OpenOptions,
    flags: i32,
) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = opts
        .custom_flags(flags | libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| {
            if e.raw_os_error() == Some(libc::ELOOP) {
                std::io::Error::new(
                    e.kind(),
                    format!(
                        "{} is a symbolic link: kvtier opens the files of its data dir only as \
                         regular files (replace the link with the file it points to; to keep the \
                         store on another disk, point data-dir at a directory there)",
                        path.display()
                    ),
                )
            } else {
                e
            }
        })?;
    let meta = f.metadata()?;
    if !meta.is_file() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{} is not a regular file", path.display()),
        ));
    }
    {
        use std::os::fd::AsRawFd;
        use std::os::unix::fs::MetadataExt;
        // SAFETY: F_GETFL on a descriptor this function owns.
        let mode = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_GETFL) };
        if mode >= 0 && mode & libc::O_ACCMODE != libc::O_RDONLY && meta.nlink() != 1 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!(
                    "{} has {} names (hard links): kvtier writes the files of its data dir in \
                     place, which would change the other names' file too; give it a file of its \
                     own (copy it, or remove the other names)",
                    path.display(),
                    meta.nlink()
                ),
            ));
        }
    }
    Ok(f)
}

/// Reads a whole file of the data dir, opened as [`open_data_file`] does.
pub fn read_data_file(path: &std::path::Path) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let mut f = open_data_file(path, std::fs::OpenOptions::new().read(true), 0)?;
    let mut buf = Vec::new();
    f.read_to_end(&mut buf)?;
    Ok(buf)
}

/// Takes an exclusive `flock` on the store file for as long as the returned
/// handle lives: a second store on the same file (a daemon whose data dir's
/// `LOCK` file was removed, or the file reached by another path) is refused
/// instead of writing beside the first.
fn lock_store_file(path: &std::path::Path) -> Result<std::fs::File> {
    use std::os::fd::AsRawFd;
    let io = |source| Error::Io {
        op: "lock the store file",
        path: path.to_path_buf(),
        source,
    };
    let f = open_data_file(path, std::fs::OpenOptions::new().read(true), 0).map_err(io)?;
    // SAFETY: flock on a descriptor owned here.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
        return Ok(f);
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
        return Err(io(e));
    }
    Err(io(std::io::Error::new(
        std::io::ErrorKind::WouldBlock,
        format!(
            "{} is in use by another process (a kvtier daemon, `kvtier verify` or `gc`): a store \
             file takes one at a time; stop the other one first",
            path.display()
        ),
    )))
}

/// Gives a file kvtier just created in `dir` the owner and group of `dir`
/// when this process runs as root and `dir` belongs to someone else: an
/// offline command run with `sudo` (`kvtier verify`) must not leave files
/// (0640) the service's user cannot read. Otherwise does nothing.
pub fn own_like_dir(file: &std::fs::File, dir: &std::path::Path) -> std::io::Result<()> {
    use std::os::unix::fs::MetadataExt;
    // SAFETY: a plain syscall without arguments.
    if unsafe { libc::geteuid() } != 0 {
        return Ok(());
    }
    let m = std::fs::metadata(dir)?;
    if m.uid() == 0 {
        return Ok(());
    }
    // Never a file with other names (a hard link planted in the data dir
    // to a file of root's; `open_data_file` refuses those for writing).
    let f = file.metadata()?;
    if !f.is_file() || f.nlink() != 1 {
        tracing::warn!(dir = %dir.display(), links = f.nlink(),
            "not giving a data file with other names to the data dir's owner");
        return Ok(());
    }
    std::os::unix::fs::fchown(file, Some(m.uid()), Some(m.gid()))
}

/// The shape of an existing store, from its superblock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoreLayout {
    /// Bytes per region.
    pub region_size: u64,
    /// Regions in the file.
    pub region_count: u32,
}

impl StoreLayout {
    /// The store's length in bytes: what its file should hold.
    pub fn bytes(&self) -> u64 {
        self.region_size * u64::from(self.region_count)
    }
}

/// The layout of the store in `data_dir`, from its superblock; `None` when
/// there is no store file or it holds no valid superblock (a fresh or
/// foreign file: opening it says which). Reads one block, writes nothing.
pub fn existing_layout(data_dir: &std::path::Path) -> Option<StoreLayout> {
    use std::io::Read;
    let mut block = [0u8; 64];
    open_data_file(
        &data_dir.join(STORE_FILE),
        std::fs::OpenOptions::new().read(true),
        0,
    )
    .and_then(|mut f| f.read_exact(&mut block))
    .ok()?;
    crate::layout::Superblock::decode(&block)
        .ok()
        .map(|sb| StoreLayout {
            region_size: sb.region_size,
            region_count: sb.region_count,
        })
}

/// The store `config` opens, before opening it: its regions (the disk
/// budget rounded down to whole regions), their size, the file's bytes and
/// the largest unnamed chunk a put accepts (see
/// [`ChunkStore::max_chunk_len`]).
pub fn planned_layout(config: &TierConfig) -> (StoreLayout, u64) {
    let region_size = config.region_size.max(1);
    let count = if config.disk_budget == 0 {
        0
    } else {
        u32::try_from(config.disk_budget / region_size).unwrap_or(u32::MAX)
    };
    let max = max_payload_for(config, (count > 0).then_some(region_size), 0);
    (
        StoreLayout {
            region_size: if count == 0 { 0 } else { region_size },
            region_count: count,
        },
        max,
    )
}

/// The largest chunk payload a put accepts with a name of `name_len` bytes
/// in a store of `config` with regions of `region_size` (`None`: no disk):
/// what the RAM budget leaves once it charges the name and the entry's
/// bookkeeping (as `RamCache::charge` does), and with a disk what an empty
/// region holds after the headers.
fn max_payload_for(config: &TierConfig, region_size: Option<u64>, name_len: usize) -> u64 {
    let ram = config
        .ram_budget
        .saturating_sub((name_len as u64).saturating_add(config.ram_entry_cost));
    match region_size {
        Some(r) => ram.min(crate::writer::max_payload_len(r, name_len)),
        None => ram,
    }
}

/// Checks an existing store file against `config` as [`ChunkStore::open`]
/// does first (its version, region size and budget; a truncated file),
/// writing nothing: `kvtier config check` reports what a start would
/// refuse. No store file, or `disk_budget` 0: nothing to check.
pub fn check_existing_store(config: &TierConfig) -> Result<()> {
    if config.disk_budget == 0 {
        return Ok(());
    }
    let len = config.disk_budget / config.region_size * config.region_size;
    let probe = TierConfig {
        read_only: true,
        ..config.clone()
    };
    check_existing_file(&config.data_dir.join(STORE_FILE), &probe, len).map(drop)
}

/// Whether the store file of `data_dir` exists with nothing in its first
/// block (zeroed, or empty): an open that may write would format it as a
/// new store. Reads one block, writes nothing.
pub fn store_file_unformatted(data_dir: &std::path::Path) -> bool {
    use std::io::Read;
    let Ok(f) = open_data_file(
        &data_dir.join(STORE_FILE),
        std::fs::OpenOptions::new().read(true),
        0,
    ) else {
        return false;
    };
    // What a failed read got before failing counts, as a short file does.
    let mut block = Vec::new();
    let _ = f.take(crate::device::BLOCK).read_to_end(&mut block);
    block.iter().all(|&b| b == 0)
}

/// Whether a store of `region_count` regions of `region_size` bytes
/// writes again the chunks RAM (`ram_budget`) holds whose disk copy went
/// with a reclaimed region: only where the disk is larger than the RAM
/// budget plus two regions; on a smaller disk the rewrites would reclaim
/// more of what RAM holds (and a restart loses such chunks: the node warns).
pub fn rewrites_reclaimed(ram_budget: u64, region_size: u64, region_count: u64) -> bool {
    ram_budget.saturating_add(2 * region_size) < region_size.saturating_mul(region_count)
}

/// The region size of the store in `data_dir`, from its superblock (see
/// [`existing_layout`]).
pub fn existing_region_size(data_dir: &std::path::Path) -> Option<u64> {
    existing_layout(data_dir).map(|l| l.region_size)
}

/// Checks an existing store file against the configured layout before it is
/// opened, so that a refused open leaves the file as it was: a different
/// region size or budget is refused (growing the file first would make the
/// next plain open fail too), and so is a file shorter than its superblock
/// says (truncated: the chunks past its end are gone) unless
/// `grow_truncated`. A file longer than its store (grown by an older
/// version's refused open) is trimmed back (left as it is when
/// `read_only`). Returns whether the file has a superblock.
fn check_existing_file(path: &std::path::Path, config: &TierConfig, len: u64) -> Result<bool> {
    use std::io::Read;
    let io = |op, e| Error::Io {
        op,
        path: path.to_path_buf(),
        source: e,
    };
    let mut block = vec![0u8; crate::device::BLOCK as usize];
    let file_len = match open_data_file(path, std::fs::OpenOptions::new().read(true), 0) {
        Ok(f) => {
            let file_len = f.metadata().map_or(0, |m| m.len());
            // Up to one block; what a short file lacks reads as zeros.
            f.take(block.len() as u64)
                .read_exact(&mut block)
                .or_else(|e| match e.kind() {
                    std::io::ErrorKind::UnexpectedEof => Ok(()),
                    _ => Err(e),
                })
                .map_err(|e| io("read the superblock of", e))?;
            file_len
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(io("open the store file", e)),
    };
    // Another version, a corrupt superblock, a foreign file: refused here,
    // before the device would grow the file to the configured budget.
    let sb = crate::segment::read_superblock(path, &block).map_err(|e| match e {
        // Cut inside its superblock: said so, not as a CRC mismatch (QA).
        Error::Corrupt { what, .. } if file_len < block.len() as u64 && file_len > 0 => {
            Error::Corrupt {
                what,
                detail: format!(
                    "the file is {file_len} bytes, shorter than its own superblock (truncated): \
                 restore it from a copy, or move the data dir aside to start empty"
                ),
            }
        }
        e => e,
    })?;
    let Some(sb) = sb else {
        // No superblock. A format writes it (and syncs) before anything
        // else, so a file that holds region slots or batches lost it
        // (zeroed or damaged): formatting it anew, at whatever geometry is
        // configured now, would lose its chunks without a word (QA: a
        // zeroed superblock came back as a bigger store, half its chunks
        // gone). Checked for read-only probes too (`kvtier config check`).
        if let Some(found) = store_data_in_unformatted(path, file_len, config.region_size)
            .map_err(|e| io("read the store file", e))?
        {
            return Err(Error::Corrupt {
                what: format!("store file {}", path.display()),
                detail: format!(
                    "it has no kvtier superblock (zeroed or damaged) but holds store data \
                     ({found}); formatting it would lose its chunks, so it is left as it is. \
                     Restore the file from a copy, or move it (or the data dir) aside to start \
                     an empty store"
                ),
            });
        }
        return Ok(false);
    };
    let l = StoreLayout {
        region_size: sb.region_size,
        region_count: sb.region_count,
    };
    crate::segment::check_layout(path, l, config.region_size, len / config.region_size)?;
    let cur = std::fs::metadata(path)
        .map_err(|e| io("read the size of", e))?
        .len();
    if cur < l.bytes() {
        if !config.grow_truncated {
            return Err(Error::Corrupt {
                what: format!("store file {}", path.display()),
                detail: format!(
                    "it is {cur} bytes but its superblock describes {} regions of {} bytes \
                     ({} bytes): it was truncated (an incomplete copy or restore?) and the chunks \
                     past its end are gone. Restore the whole file, or run `kvtier verify \
                     --repair` to grow it back and drop what was lost",
                    l.region_count,
                    l.region_size,
                    l.bytes()
                ),
            });
        }
        tracing::warn!(path = %path.display(), len = cur, store_len = l.bytes(),
            "the store file is truncated; growing it back (the chunks past its end are lost)");
    } else if cur > l.bytes() && config.read_only {
        tracing::info!(path = %path.display(), len = cur, store_len = l.bytes(),
            "the store file is longer than its store; the rest is ignored (read-only open)");
    } else if cur > l.bytes() {
        tracing::info!(path = %path.display(), len = cur, store_len = l.bytes(),
            "trimming the store file back to its store's length");
        open_data_file(path, std::fs::OpenOptions::new().write(true), 0)
            .and_then(|f| f.set_len(l.bytes()))
            .map_err(|e| io("trim", e))?;
    }
    Ok(true)
}

/// What a store file with no superblock holds that only a formatted store
/// writes, if anything. Looked at, whatever region size the store had:
/// - every byte of its first 64 MiB after the superblock (region 0's slots
///   and batches, and more regions where they are small);
/// - the open slots of regions 1 to 8 at every region size of a whole
///   number of MiB up to 1 GiB (regions are used from 0 upward, so a store
///   that used more than region 0 has region 1's);
/// - the open slot of every region at the configured region size (at most
///   65,536).
///
/// All zeros (a new file, or a format that crashed before its superblock:
/// the format writes and syncs it first): `None`. The reads stop at the
/// first non-zero byte, and skip holes and unwritten extents
/// (`SEEK_DATA`): a new preallocated file costs a few thousand `lseek`s.
fn store_data_in_unformatted(
    path: &std::path::Path,
    file_len: u64,
    region_size: u64,
) -> std::io::Result<Option<String>> {
    use std::os::unix::fs::FileExt;

    use crate::layout::OPEN_SLOT;
    const HEAD: u64 = 64 << 20;
    const MIB_USIZE: usize = 1 << 20;
    let block = crate::device::BLOCK;
    if file_len <= block {
        return Ok(None);
    }
    // O_DIRECT where it works: a buffered read of a block of zeros
    // filled (and zeroed) a large page-cache folio around it, megabytes per
    // block read (QA of this check: 13 s for a new 16 GiB store file).
    let f = open_data_file(path, std::fs::OpenOptions::new().read(true), libc::O_DIRECT)
        .or_else(|_| open_data_file(path, std::fs::OpenOptions::new().read(true), 0))?;
    let fd = std::os::fd::AsRawFd::as_raw_fd(&f);
    // Whether `[at, at + len)` may hold data: holes (and, on ext4 and XFS,
    // preallocated extents never written) read as zeros without reading
    // them (QA of this check: reading the zeros of a sparse 16 GiB file
    // block by block took 20 s, in the kernel's zeroing of readahead).
    let may_hold = |at: u64, len: u64| -> bool {
        // SAFETY: plain syscall on a valid fd.
        let next = unsafe { libc::lseek(fd, at as libc::off_t, libc::SEEK_DATA) };
        if next < 0 {
            // ENXIO: no data from `at` on; else (no SEEK_DATA here) read.
            return std::io::Error::last_os_error().raw_os_error() != Some(libc::ENXIO);
        }
        (next as u64) < at + len
    };
    let mut buf = crate::device::AlignedBuf::zeroed(MIB_USIZE);
    // The first 64 MiB, a MiB at a time (the first block is the superblock).
    let mut at = block;
    while at < file_len.min(HEAD) {
        // Whole blocks (O_DIRECT); a file's length is whole blocks as a
        // store makes it, and a shorter tail is what a short read leaves.
        let n = (file_len.min(HEAD) - at).min(buf.len() as u64) as usize;
        let n = n.next_multiple_of(block as usize).min(buf.len());
        if may_hold(at, n as u64) {
            // Up to the end of the file (a short last read).
            let mut got = 0;
            while got < n {
                match f.read_at(&mut buf[got..n], at + got as u64)? {
                    0 => break,
                    k => got += k,
                }
            }
            if let Some(i) = buf[..got].iter().position(|&b| b != 0) {
                return Ok(Some(format!("non-zero bytes at byte {}", at + i as u64)));
            }
        }
        at += n as u64;
    }
    let slot = &mut buf[..block as usize];
    let mut used = |at: u64| -> std::io::Result<bool> {
        if at < HEAD || at + block > file_len || !may_hold(at, block) {
            return Ok(false);
        }
        f.read_exact_at(slot, at)?;
        Ok(slot.iter().any(|&b| b != 0))
    };
    let mib = MIB_USIZE as u64;
    for size in (1..=1024u64).map(|k| k * mib) {
        for r in 1..=8 {
            let at = r * size + OPEN_SLOT;
            if used(at)? {
                return Ok(Some(format!(
                    "what may be region {r}'s open slot at byte {at}, for regions of {} MiB",
                    size / mib
                )));
            }
        }
    }
    let regions = (file_len / region_size.max(block)).min(1 << 16);
    for r in 1..regions {
        let at = r * region_size + OPEN_SLOT;
        if used(at)? {
            return Ok(Some(format!(
                "region {r}'s open slot at byte {at}, at the configured region size"
            )));
        }
    }
    Ok(None)
}

/// Warns when the store file is missing or empty while the manifest beside
/// it lists namespaces: their chunks are gone (a deleted or replaced file,
/// an incomplete restore) and the store starts empty.
fn warn_if_store_file_lost(path: &std::path::Path, data_dir: &std::path::Path) {
    let empty = match path.symlink_metadata() {
        Ok(m) => m.len() == 0,
        Err(e) => e.kind() == std::io::ErrorKind::NotFound,
    };
    let listed = crate::manifest::load(data_dir).map_or(0, |m| m.len());
    if empty && listed > 0 {
        tracing::warn!(path = %path.display(), namespaces = listed,
            "the store file is missing or empty but namespaces.json lists namespaces: \
             their chunks are gone and the store starts empty (restore the whole store file \
             from a backup, with the daemon stopped, to get them back)");
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

/// A namespace as an operator sees it: [`NamespaceInfo`], or the usage of
/// a namespace id whose chunks are held but whose record the manifest lacks
/// (a lost or salvaged `namespaces.json`; a client's HELLO with the same
/// record brings it back).
#[derive(Clone, Debug, Serialize)]
pub struct NamespaceListing {
    /// The id.
    pub id: Namespace,
    /// The full record; `None` when the manifest has none.
    pub record: Option<NamespaceRecord>,
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
    /// Bytes RAM's budget charges for its chunks: payloads, names and
    /// each chunk's bookkeeping (`TierConfig::ram_entry_cost`).
    pub ram_bytes: u64,
    /// RAM budget.
    pub ram_budget: u64,
    /// Of `ram_bytes`, those of dirty (not yet durable) chunks.
    pub dirty_bytes: u64,
    /// Chunks evicted from RAM and not on disk yet: still readable from
    /// memory, outside the RAM budget (not in `ram_chunks`).
    pub spilled_chunks: u64,
    /// Bytes of those chunks, counted as `ram_bytes` counts them (memory
    /// held beyond `ram_bytes`).
    pub spilled_bytes: u64,
    /// Chunks on disk.
    pub disk_chunks: u64,
    /// Payload bytes on disk.
    pub disk_bytes: u64,
    /// Disk budget: with a disk, the bytes of the store file (whole
    /// regions, so up to a region less than a configured budget that is
    /// not a multiple of the region size); without one, the configured 0.
    pub disk_budget: u64,
    /// GET hits served from RAM.
    pub hits_ram: u64,
    /// GET hits served from disk.
    pub hits_disk: u64,
    /// GET hits a node served with bytes fetched from a peer (counted by
    /// the node: [`ChunkStore::count_peer_hit`]).
    pub hits_peer: u64,
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
    /// Dirty chunks lost because their disk write failed (no space, an I/O
    /// error) after RAM had evicted them: with `dropped_unwritten`, the
    /// chunks put here that no read will ever return. Each counted once,
    /// unlike `disk_write_failures` (every failed attempt).
    pub lost_writes: u64,
    /// Chunks whose disk copy was reclaimed (its region reused) while RAM
    /// held them clean: marked dirty again, so they are written anew.
    pub reclaimed_rewrites: u64,
    /// Chunks that left this node to make room, no copy kept: evicted from
    /// RAM with none on disk (a RAM-only store, or dropped unwritten), or
    /// their region reclaimed while RAM did not hold them. What RESP's
    /// `INFO` reports as `evicted_keys`; RAM evictions whose chunk stays on
    /// disk are not counted.
    pub evicted_chunks: u64,
    /// Reads that failed verification (CRC, identity, length) or I/O.
    pub verify_failures: u64,
    /// Region slots, summaries, batch records or deletes-journal records
    /// found damaged (bit rot) when the store opened; logged with what was
    /// done about each.
    pub damaged_metadata: u64,
    /// Messages in the writer's queue (`writer_queue` places: a put's
    /// evictions, a flush's or idle pass's writes, a delete, each one
    /// message) plus the evictions waiting beside it while it is full: at
    /// `writer_queue` and over, the writer is behind.
    pub writer_queue_depth: u64,
    /// Time the last open spent rebuilding the index, in microseconds.
    pub recovery_micros: u64,
    /// Whether the writer is paused for lack of space.
    pub writer_paused_nospace: bool,
    /// Whether O_DIRECT is in use (false: buffered fallback).
    pub direct_io: bool,
    /// Chunk writes the disk writer failed (I/O error, no space, too big),
    /// each attempt counted: a dirty chunk still in RAM is tried again by
    /// the next flush or idle pass and counted again, so this is a rate of
    /// failures, not a count of lost chunks.
    pub disk_write_failures: u64,
    /// Whether the disk tier is poisoned by a failed write or sync.
    pub disk_poisoned: bool,
    /// Regions in the store file.
    pub disk_regions: u64,
    /// Bytes per region (0 without a disk).
    pub region_size: u64,
    /// Bytes of RAM used by the disk index.
    pub index_bytes: u64,
    /// fdatasyncs issued by the disk writer (flushes, region seals and
    /// opens).
    pub disk_syncs: u64,
    /// Time spent in those fdatasyncs, in microseconds.
    pub disk_sync_micros: u64,
    /// Time the disk writer's I/O thread spent writing batches, in
    /// microseconds (`disk_write_bytes` over this is the device's write
    /// speed as the store sees it).
    pub disk_write_micros: u64,
    /// Batch writes issued by the disk writer's I/O thread
    /// (`disk_write_bytes` over this is the mean batch: the writer gathers
    /// what is queued, up to 4 MiB, so batches are small while it keeps up
    /// with a trickle and large when it is behind).
    pub disk_batch_writes: u64,
    /// Bytes chunk reads took from disk (whole blocks, headers included).
    pub disk_read_bytes: u64,
    /// Time chunk reads spent in disk reads (failed ones included), in
    /// microseconds: the device, plus the checksum of the pieces of a
    /// split read that landed before the last one (`disk_read_bytes` over
    /// this is the read speed as the store sees it).
    pub disk_read_micros: u64,
    /// Bytes of dropped chunks' buffers kept for new chunks (memory held
    /// beyond `ram_bytes`; see [`crate::buffers`]).
    pub buffer_pool_bytes: u64,
    /// New chunks and disk reads that reused a pooled buffer.
    pub buffer_pool_reused: u64,
    /// New chunks of 1 MiB or more and disk reads that found no pooled
    /// buffer of their size (a fresh allocation).
    pub buffer_pool_fresh: u64,
}

impl StoreStats {
    /// Bytes of chunks not on disk yet: dirty in RAM, or evicted on their
    /// way to the disk writer (what an exit now would lose).
    pub fn unwritten_bytes(&self) -> u64 {
        self.dirty_bytes + self.spilled_bytes
    }
}

/// Result of [`ChunkStore::flush`].
#[derive(Clone, Debug, Default, Serialize)]
pub struct FlushReport {
    /// Chunks written by this flush.
    pub chunks: u64,
    /// Payload bytes written by this flush.
    pub bytes: u64,
    /// Dirty chunks that could not be written (no space / I/O error), or
    /// that a `no-tax` eviction dropped unwritten before the flush wrote
    /// them (past `spill_limit`).
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
    /// A chunk became available on this node; it is in RAM (a chunk always
    /// arrives through RAM).
    fn added(&self, id: &ChunkId, len: u64);
    /// A chunk is no longer available on this node.
    fn removed(&self, id: &ChunkId);
    /// A chunk this node holds entered (`true`: a disk hit promoted) or
    /// left (`false`: evicted, possibly on its way to disk) its RAM.
    fn in_ram(&self, _id: &ChunkId, _in_ram: bool) {}
}

/// Live atomic groups: which chunks belong to which transaction.
#[derive(Default)]
///
/// hashbrown's foldhash rather than SipHash: the maps are rebuilt from the
/// whole index at every open (a store of 1M chunks in groups of two spent
/// most of its recovery here).
struct Txns {
    next: u64,
    members: hashbrown::HashMap<u64, Vec<ChunkId>>,
    /// Each member's group and the group's size as its entry records it.
    of: hashbrown::HashMap<ChunkId, (u64, u32)>,
    /// Groups with an entry that may be on disk (a write job was made for
    /// a member, or recovery found one): their recorded size is fixed.
    queued: hashbrown::HashSet<u64>,
    /// When each group put since the open was registered: a version of a
    /// member inserted before that is not the group's (a flush's late job
    /// of an older version), and is written without the group's tag.
    since: hashbrown::HashMap<u64, Instant>,
}

impl Txns {
    /// The group tag (id, size) for a job writing the version of `id`
    /// inserted at `inserted`: its group's, if that version is the group's.
    fn tag(&self, id: &ChunkId, inserted: Instant) -> (u64, u32) {
        self.of
            .get(id)
            .copied()
            .filter(|(txn, _)| self.since.get(txn).is_none_or(|s| inserted >= *s))
            .unwrap_or((0, 0))
    }

    /// Forgets group `txn` (no member left).
    fn forget(&mut self, txn: u64) {
        self.members.remove(&txn);
        self.queued.remove(&txn);
        self.since.remove(&txn);
    }
}

#[derive(Default)]
struct Counters {
    hits_ram: AtomicU64,
    hits_disk: AtomicU64,
    hits_peer: AtomicU64,
    misses: AtomicU64,
    puts: AtomicU64,
    bytes_in: AtomicU64,
    bytes_out: AtomicU64,
    ram_evictions: AtomicU64,
    dropped_unwritten: AtomicU64,
    lost_writes: AtomicU64,
    reclaimed_rewrites: AtomicU64,
    evicted_chunks: AtomicU64,
}

pub(crate) struct Inner {
    pub(crate) config: TierConfig,
    pub(crate) ram: RamCache,
    /// Buffers of dropped chunks, for new chunks and disk reads.
    buffers: Arc<BufferPool>,
    pub(crate) disk: Option<Arc<Disk>>,
    tx: Option<Sender<Msg>>,
    // parking_lot: namespaces change rarely; reads are short.
    namespaces: RwLock<BTreeMap<Namespace, NsEntry>>,
    // parking_lot: only registration and manifest writes take it; it keeps
    // two manifest writers from racing.
    manifest_lock: Mutex<()>,
    /// The last try to persist namespace last-used times failed: its
    /// warning is not repeated (a stop tries in each flush and again at
    /// close) until a try succeeds.
    last_used_failing: AtomicBool,
    /// A namespace was registered in memory only (its manifest write found
    /// no space): a failing write of the manifest is a warning each time.
    manifest_unwritten: AtomicBool,
    counters: Counters,
    // parking_lot: swapped rarely, read on every add/remove.
    observer: RwLock<Option<Arc<dyn ChunkObserver>>>,
    /// Deletes (and broken atomic groups) whose jobs may still be queued: a
    /// job inserted before the cancellation is skipped. An entry is pruned
    /// when the writer has handled every tombstone or `Msg::Forget` sent for
    /// it (so every job queued before the last of them). parking_lot: short
    /// sections.
    cancel: Mutex<HashMap<ChunkId, Cancel>>,
    /// `Msg::Forget`s that found the writer queue full (they are never sent
    /// blocking: the writer thread itself breaks groups), coalesced per id
    /// (the latest time, how many): one entry per id however many
    /// overwrites or deletes pile up under overload. Sent by the next flush
    /// or idle pass. parking_lot: short sections.
    forget_later: Mutex<HashMap<ChunkId, (Instant, u32)>>,
    /// `no-tax` eviction hand-offs that found the writer's queue full, in
    /// order, for the writer to take at its next message; `None` once the
    /// writer stopped. Their chunks are spilled, so `spill_limit` bounds
    /// them in bytes (a queue slot per put dropped pipelined small SETs
    /// while the disk idled: QA). parking_lot: short sections.
    overflow: Mutex<Option<Vec<Job>>>,
    /// Payload bytes of the jobs in `overflow` (changed under its lock):
    /// they count against `spill_limit` in full, also once an overwrite or
    /// a delete replaced their spilled copy (which then no longer counts in
    /// `spilled_bytes`, while the job still holds the bytes: review).
    overflow_bytes: AtomicU64,
    /// Deletes by bucket of the id's hash ([`ChunkStore::deletions_of`]).
    deletions: Box<[AtomicU64]>,
    /// Write jobs not done yet (queued, packed or in flight), per id
    /// ([`PendingWrite`]). parking_lot: short sections.
    pending: PendingMap,
    // parking_lot: short sections on atomic puts and group breaks.
    txns: Mutex<Txns>,
    /// Regions holding entries of live atomic groups written since the
    /// open ([`Hooks::group_entries`]): a reclaim breaks those groups.
    group_regions: Mutex<HashMap<u32, Vec<u64>>>,
    /// Held for writing while an atomic group is inserted into RAM, for
    /// reading by every read: a reader sees all of a group or none of it.
    /// parking_lot: never held across I/O.
    gate: RwLock<()>,
    closed: AtomicBool,
    recovery_micros: AtomicU64,
}

/// Where the version a write job carries is held in RAM, which says what
/// becomes of that copy once written.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Held {
    /// Resident: marked clean if still that version.
    Resident,
    /// Spilled: dropped from RAM once indexed.
    Spilled,
    /// Not in RAM (evicted with spilling off).
    Gone,
}

/// What a flush covers, walked when it is called ([`Inner::flush_walk`]).
struct FlushWalk {
    dirty: Vec<(ChunkId, RamEntry)>,
    spilled: Vec<(ChunkId, u64)>,
}

/// A pending cancellation of an id's queued writes.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Cancel {
    /// The latest cancellation: versions put at or before it are cancelled.
    at: Instant,
    /// The latest delete or group break (an overwrite's cancellation is not
    /// one): a flush's job of a version put at or before it is not written
    /// at all (see [`Hooks::wanted`]).
    hard: Option<Instant>,
    /// Tombstones and forgets sent for the id and not handled yet.
    outstanding: u32,
}

/// Records a cancellation of `id` now (the caller then sends one tombstone
/// or forget for it) and returns its time, taken under the lock.
pub(crate) fn cancel_now(c: &mut HashMap<ChunkId, Cancel>, id: ChunkId) -> Instant {
    let now = Instant::now();
    cancel_at(c, id, now);
    if let Some(e) = c.get_mut(&id) {
        e.hard = Some(e.hard.map_or(now, |h| h.max(now)));
    }
    now
}

/// Records a cancellation of `id`'s versions put at or before `at` (the
/// caller then sends one tombstone or forget for it); an overwrite's, unless
/// [`cancel_now`] records it.
fn cancel_at(c: &mut HashMap<ChunkId, Cancel>, id: ChunkId, at: Instant) {
    let e = c.entry(id).or_insert(Cancel {
        at,
        hard: None,
        outstanding: 0,
    });
    e.at = e.at.max(at);
    e.outstanding += 1;
}

/// The local chunk store: a byte-budgeted RAM LRU over an NVMe segment store.
///
/// Thread-safe; share it in an `Arc`. Call order: [`ChunkStore::open`], then
/// any mix of operations from any thread, then [`ChunkStore::close`] (which
/// flushes). Dropping the store without `close` stops its threads without
/// flushing: dirty chunks that only live in RAM are lost, the file stays
/// consistent. Calls may block on disk reads: async callers use
/// `spawn_blocking`. Disk writes run on the `kvtier-writer` thread.
pub struct ChunkStore {
    inner: Arc<Inner>,
    // parking_lot: taken once at close.
    threads: Mutex<Vec<JoinHandle<()>>>,
    idle_stop: Mutex<Option<Sender<()>>>,
    /// The store file's `flock`, held until the store is closed or dropped.
    file_lock: Mutex<Option<std::fs::File>>,
}

impl ChunkStore {
    /// Opens (or creates) the store in `config.data_dir`, rebuilding the index.
    pub fn open(config: TierConfig) -> Result<Self> {
        config.validate()?;
        if !config.read_only {
            create_data_dir(&config.data_dir).map_err(|e| Error::Io {
                op: "create the data dir",
                path: config.data_dir.clone(),
                source: e,
            })?;
        }
        let dev: Option<(Arc<dyn Device>, std::fs::File)> = if config.disk_budget == 0 {
            None
        } else {
            let len = config.disk_budget / config.region_size * config.region_size;
            let path = config.data_dir.join(STORE_FILE);
            let mode = if config.direct_io {
                DirectMode::Auto
            } else {
                DirectMode::Off
            };
            let formatted = check_existing_file(&path, &config, len)?;
            if config.read_only {
                // Nothing to format or grow: the file must be a store.
                if !formatted {
                    return Err(Error::Corrupt {
                        what: format!("store file {}", path.display()),
                        detail: "it is missing, empty or has no kvtier superblock (never \
                                 formatted, or zeroed); a read-only open formats nothing"
                            .into(),
                    });
                }
                let lock = lock_store_file(&path)?;
                let dev = FileDevice::open_read_only(&path, len, mode).map_err(|e| Error::Io {
                    op: "open the store file (read-only)",
                    path: path.clone(),
                    source: e,
                })?;
                let store = Self::open_inner(config, Some(Arc::new(dev) as Arc<dyn Device>))?;
                *store.file_lock.lock() = Some(lock);
                return Ok(store);
            }
            warn_if_store_file_lost(&path, &config.data_dir);
            let dev = FileDevice::open(&path, len, mode, config.disk_reserve).map_err(|e| {
                if e.raw_os_error() == Some(libc::ENOSPC) {
                    Error::NoSpace {
                        detail: format!("preallocating {len} bytes for {}: {e}", path.display()),
                    }
                } else {
                    Error::Io {
                        op: "open the store file",
                        path: path.clone(),
                        source: e,
                    }
                }
            })?;
            let lock = lock_store_file(&path)?;
            Some((Arc::new(dev) as Arc<dyn Device>, lock))
        };
        let (dev, lock) = dev.unzip();
        let store = Self::open_inner(config, dev)?;
        *store.file_lock.lock() = lock;
        Ok(store)
    }

    /// Opens the store on a given device (tests: counting, crashing and
    /// failing devices). `config.disk_budget` is ignored: the device's
    /// length decides; namespaces still live in `config.data_dir`.
    #[cfg(feature = "test_utils")]
    pub fn open_with_device(config: TierConfig, dev: Arc<dyn Device>) -> Result<Self> {
        config.validate()?;
        create_data_dir(&config.data_dir).map_err(|e| Error::Io {
            op: "create the data dir",
            path: config.data_dir.clone(),
            source: e,
        })?;
        Self::open_inner(config, Some(dev))
    }

    fn open_inner(config: TierConfig, dev: Option<Arc<dyn Device>>) -> Result<Self> {
        let t0 = Instant::now();
        let namespaces = if config.read_only && config.salvage_manifest {
            manifest::load_or_salvage_in_memory(&config.data_dir)?
        } else {
            manifest::load(&config.data_dir)?
        };
        // A chunk evicted dirty stays readable until the disk has it.
        let ram = RamCache::new(config.ram_budget)
            .with_spill(dev.is_some())
            .with_entry_cost(config.ram_entry_cost);
        let buffers = Arc::new(BufferPool::for_store(config.ram_budget, config.huge_pages));
        let (disk, rec) = match dev {
            None => (None, None),
            Some(dev) if config.read_only => {
                let (d, _) = Disk::open(dev, config.region_size, Arc::clone(&buffers))?;
                // The deletes a poisoned or full disk did not take: applied
                // to the index only (a writable open writes their
                // tombstones).
                let crate::deletes::Read {
                    ids: pending,
                    damaged,
                    ..
                } = crate::deletes::read_all(&config.data_dir).map_err(|e| Error::Io {
                    op: "read the deletes journal (deletes.pending) in",
                    path: config.data_dir.clone(),
                    source: e,
                })?;
                d.counters
                    .damaged_metadata
                    .fetch_add(damaged, Ordering::Relaxed);
                let gone: Vec<_> = {
                    let mut ix = d.index.write();
                    pending.iter().filter_map(|id| ix.remove(id)).collect()
                };
                for loc in gone {
                    d.live_bytes
                        .fetch_sub(u64::from(loc.payload_len), Ordering::Relaxed);
                }
                (Some(Arc::new(d)), None)
            }
            Some(dev) => {
                let (d, rec) = Disk::open(dev, config.region_size, Arc::clone(&buffers))?;
                // Before the writer's channel exists: a failure here must not
                // leave a store whose drop waits for a writer that never
                // started.
                let (journal, damaged) =
                    crate::deletes::Journal::open(&config.data_dir).map_err(|e| Error::Io {
                        op: "open the deletes journal (deletes.pending) in",
                        path: config.data_dir.clone(),
                        source: e,
                    })?;
                d.counters
                    .damaged_metadata
                    .fetch_add(damaged, Ordering::Relaxed);
                (Some(Arc::new(d)), Some((rec, journal)))
            }
        };
        let mut txns = Txns::default();
        if let (Some(d), Some((rec, _))) = (&disk, &rec) {
            txns.next = rec.max_txn + 1;
            for (id, loc) in d.index.read().iter() {
                if loc.txn != 0 {
                    txns.members.entry(loc.txn).or_default().push(*id);
                }
            }
            let Txns {
                members,
                of,
                queued,
                ..
            } = &mut txns;
            of.reserve(members.values().map(Vec::len).sum());
            queued.reserve(members.len());
            for (t, m) in members.iter() {
                for id in m {
                    of.insert(*id, (*t, m.len() as u32));
                }
                queued.insert(*t);
            }
        }
        txns.next = txns.next.max(1);
        let (tx, rx) = bounded(config.writer_queue);
        // A read-only store has no writer: nothing is ever sent to it.
        let has_disk = disk.is_some() && !config.read_only;
        let inner = Arc::new(Inner {
            config,
            ram,
            buffers,
            disk: disk.clone(),
            tx: has_disk.then_some(tx),
            namespaces: RwLock::new(namespaces),
            manifest_lock: Mutex::new(()),
            last_used_failing: AtomicBool::new(false),
            manifest_unwritten: AtomicBool::new(false),
            counters: Counters::default(),
            observer: RwLock::new(None),
            cancel: Mutex::new(HashMap::new()),
            forget_later: Mutex::new(HashMap::new()),
            overflow: Mutex::new(Some(Vec::new())),
            overflow_bytes: AtomicU64::new(0),
            deletions: (0..DELETION_BUCKETS).map(|_| AtomicU64::new(0)).collect(),
            pending: PendingMap::default(),
            txns: Mutex::new(txns),
            group_regions: Mutex::new(HashMap::new()),
            gate: RwLock::new(()),
            closed: AtomicBool::new(false),
            recovery_micros: AtomicU64::new(0),
        });
        let store = Self {
            inner: inner.clone(),
            threads: Mutex::new(Vec::new()),
            idle_stop: Mutex::new(None),
            file_lock: Mutex::new(None),
        };
        if let (Some(d), Some((rec, journal))) = (disk, rec) {
            let needs_seal = !rec.unsealed.is_empty();
            let hooks: Arc<dyn Hooks> = inner.clone();
            let helpers = inner.config.pack_threads.unwrap_or_else(|| {
                crate::pack::default_helpers(
                    std::thread::available_parallelism().map_or(1, |n| n.get()),
                )
            });
            let replay = journal.ids().to_vec();
            let writer = Writer::new(d.clone(), hooks, rec, WRITE_BATCH, helpers, journal);
            let h = std::thread::Builder::new()
                .name("kvtier-writer".into())
                .spawn(move || writer.run(rx))
                .map_err(|e| Error::Io {
                    op: "spawn the writer thread for",
                    path: inner.config.data_dir.clone(),
                    source: e,
                })?;
            store.threads.lock().push(h);
            if needs_seal {
                // Seal the regions recovered from batch records that are not
                // re-opened (older ones, or one whose scan hit a read error),
                // so no later write can land behind their intact batches.
                let (ack, wait) = bounded(1);
                inner.send(Msg::SealRecovered(ack))?;
                wait.recv().map_err(|_| Error::Closed)??;
            }
            if !replay.is_empty() {
                // Deletes a poisoned or full disk did not take before the
                // last stop: deleted again, their tombstones written (the
                // writer removes the journal once they are durable).
                for id in &replay {
                    inner.delete_inner(id, false);
                }
                match inner.flush_inner(None) {
                    Ok(_) => tracing::info!(deletes = replay.len(), "replayed the deletes journal"),
                    Err(e) => tracing::warn!(
                        deletes = replay.len(),
                        error = %e,
                        "replayed the deletes journal; their tombstones are not on disk yet (the journal stays)"
                    ),
                }
            }
            let (stop_tx, stop_rx) = bounded::<()>(1);
            let weak = Arc::downgrade(&inner);
            let period = (inner.config.idle_flush_after / 4)
                .clamp(Duration::from_millis(10), Duration::from_secs(1));
            let h = std::thread::Builder::new()
                .name("kvtier-idle".into())
                .spawn(move || {
                    while let Err(crossbeam_channel::RecvTimeoutError::Timeout) =
                        stop_rx.recv_timeout(period)
                    {
                        match weak.upgrade() {
                            Some(inner) => inner.idle_pass(),
                            None => return,
                        }
                    }
                })
                .map_err(|e| Error::Io {
                    op: "spawn the idle flush thread for",
                    path: inner.config.data_dir.clone(),
                    source: e,
                })?;
            store.threads.lock().push(h);
            *store.idle_stop.lock() = Some(stop_tx);
            tracing::info!(
                chunks = d.index.read().len(),
                micros = t0.elapsed().as_micros() as u64,
                direct_io = d.dev.direct_io(),
                "chunk store opened"
            );
        }
        if !inner.config.read_only && inner.disk.is_some() {
            // A gc --apply killed part way is finished before anything else.
            crate::maintenance::finish_pending_gc(&inner);
        }
        inner
            .recovery_micros
            .store(t0.elapsed().as_micros() as u64, Ordering::Relaxed);
        Ok(store)
    }

    /// The pool that new chunk buffers should come from: a caller that
    /// copies bytes in to `put` them (a server reading a request) copies
    /// with [`BufferPool::copy_of`], so that large chunks reuse the memory
    /// of dropped ones instead of faulting in fresh pages.
    pub fn buffers(&self) -> &Arc<BufferPool> {
        &self.inner.buffers
    }

    /// The configuration the store was opened with.
    pub fn config(&self) -> &TierConfig {
        &self.inner.config
    }

    /// What the RAM budget charges a chunk of `len` payload bytes with a
    /// name of `name_len` bytes: both, and its bookkeeping
    /// (`TierConfig::ram_entry_cost`).
    pub fn ram_charge(&self, len: u64, name_len: usize) -> u64 {
        self.inner.ram.charge(len, name_len as u64)
    }

    /// The largest chunk payload a put accepts with a name of `name_len`
    /// bytes: the RAM budget, and with a disk what an empty region holds
    /// after the headers.
    pub fn max_chunk_len(&self, name_len: usize) -> u64 {
        let region_size = self.inner.disk.as_ref().map(|d| d.region_size);
        max_payload_for(&self.inner.config, region_size, name_len)
    }

    /// Installs the availability observer (replacing any previous one).
    pub fn set_observer(&self, observer: Arc<dyn ChunkObserver>) {
        *self.inner.observer.write() = Some(observer);
    }

    /// Registers (idempotently) a namespace record; returns its id. The record
    /// is kept durably (`namespaces.json`, written atomically) so
    /// `namespaces()` lists it after a restart.
    ///
    /// A record of more than [`MAX_RECORD_BYTES`] as JSON is refused: every
    /// registration rewrites the manifest, and `/status` lists the records.
    pub fn register_namespace(&self, record: &NamespaceRecord) -> Result<Namespace> {
        let id = record.id();
        if self.inner.namespaces.read().contains_key(&id) {
            return Ok(id);
        }
        self.inner.check_writable("registering a namespace")?;
        let len = record.stored_len();
        if len > MAX_RECORD_BYTES {
            return Err(Error::RecordTooLarge {
                len,
                max: MAX_RECORD_BYTES,
            });
        }
        let _g = self.inner.manifest_lock.lock();
        let mut snapshot = self.inner.namespaces.read().clone();
        if snapshot.contains_key(&id) {
            return Ok(id);
        }
        let max = self.inner.config.max_namespaces;
        if snapshot.len() >= max {
            return Err(Error::NoSpace {
                detail: format!(
                    "the store already holds {} namespaces, the most it registers \
                     (max-namespaces {max}); drop unused ones with `kvtier gc`",
                    snapshot.len()
                ),
            });
        }
        snapshot.insert(
            id,
            NsEntry {
                record: record.clone(),
                last_used_ms: crate::layout::now_ms(),
            },
        );
        match manifest::store(&self.inner.config.data_dir, &snapshot) {
            Ok(()) => {}
            // A full (or read-only) filesystem: the namespace is served
            // from memory, and the next flush or stop that can writes the
            // manifest (QA: a new engine could not use the RAM tier at all
            // while the preallocated store itself still had room). Until
            // then a crash forgets the record, not its chunks: they are
            // listed without one, and the client's next HELLO registers it.
            Err(Error::Io { source, .. })
                if matches!(
                    source.raw_os_error(),
                    Some(libc::ENOSPC | libc::EDQUOT | libc::EROFS)
                ) =>
            {
                tracing::warn!(
                    namespace = %id,
                    error = %source,
                    "namespace registered in memory only: the namespace manifest could not be \
                     written; the next flush or stop that can writes it"
                );
                self.inner.manifest_unwritten.store(true, Ordering::Relaxed);
            }
            Err(e) => return Err(e),
        }
        *self.inner.namespaces.write() = snapshot;
        Ok(id)
    }

    /// The record of a registered namespace.
    pub fn namespace_record(&self, ns: &Namespace) -> Option<NamespaceRecord> {
        self.inner
            .namespaces
            .read()
            .get(ns)
            .map(|e| e.record.clone())
    }

    /// All registered namespaces with their usage.
    pub fn namespaces(&self) -> Vec<NamespaceInfo> {
        self.namespace_listing()
            .into_iter()
            .filter_map(|n| {
                Some(NamespaceInfo {
                    id: n.id,
                    record: n.record?,
                    chunks: n.chunks,
                    bytes: n.bytes,
                })
            })
            .collect()
    }

    /// Every namespace an operator should see: the registered ones, then
    /// (sorted by id) those with chunks held but no record in the manifest.
    /// One walk of the index.
    pub fn namespace_listing(&self) -> Vec<NamespaceListing> {
        let mut usage: HashMap<Namespace, (u64, u64)> = HashMap::new();
        for (id, len) in self.ids() {
            let u = usage.entry(id.ns).or_default();
            u.0 += 1;
            u.1 += len;
        }
        let mut out: Vec<NamespaceListing> = self
            .inner
            .namespaces
            .read()
            .iter()
            .map(|(id, e)| {
                let (chunks, bytes) = usage.remove(id).unwrap_or_default();
                NamespaceListing {
                    id: *id,
                    record: Some(e.record.clone()),
                    chunks,
                    bytes,
                }
            })
            .collect();
        let mut unrecorded: Vec<NamespaceListing> = usage
            .into_iter()
            .map(|(id, (chunks, bytes))| NamespaceListing {
                id,
                record: None,
                chunks,
                bytes,
            })
            .collect();
        unrecorded.sort_by_key(|n| n.id.0);
        out.extend(unrecorded);
        out
    }

    /// Stores a chunk in RAM (dirty; clean without a disk). Replaces an
    /// existing chunk with the same id.
    /// Never waits for the disk under the default write policy.
    pub fn put(&self, id: ChunkId, data: Bytes) -> Result<()> {
        self.inner.put_inner(id, None, data, None)
    }

    /// Stores a chunk with a name (e.g. a RESP key string) that is kept in the
    /// header and compared on every read by [`ChunkStore::get_named`].
    pub fn put_named(&self, id: ChunkId, name: Bytes, data: Bytes) -> Result<()> {
        ChunkHeader::check_name_len(name.len()).map_err(|e| Error::InvalidArgument {
            what: "chunk name",
            value: e.to_string(),
        })?;
        self.inner.put_inner(id, Some(name), data, None)
    }

    /// Admits a copy of a chunk that is durable elsewhere (e.g. fetched from
    /// a peer) into RAM as *clean*: it is never written to this node's disk
    /// and is dropped when RAM evicts it. The observer is told it is held
    /// here (and that it is gone after the eviction). `name` is kept and
    /// compared like [`ChunkStore::put_named`]'s.
    ///
    /// Returns `Ok(false)` and changes nothing when the chunk is already in
    /// RAM or on disk here, so a local PUT is never replaced by an older
    /// clean copy.
    pub fn put_clean(&self, id: ChunkId, name: Option<Bytes>, data: Bytes) -> Result<bool> {
        if let Some(n) = &name {
            ChunkHeader::check_name_len(n.len()).map_err(|e| Error::InvalidArgument {
                what: "chunk name",
                value: e.to_string(),
            })?;
        }
        self.inner.put_clean_inner(id, name, data)
    }

    /// Stores several chunks that become visible together or not at all,
    /// also across crashes (a boundary manifest).
    ///
    /// Guarantee: the chunks are inserted into RAM while readers are held
    /// off, so a reader sees all of them or none. On disk each member
    /// carries the group's transaction id and size; recovery shows a group
    /// only if every member is found intact, so a crash at any point shows
    /// all or none. Later, when any member is lost (its write failed, it was
    /// dropped unwritten, its region was reclaimed), the other members are
    /// dropped too. A plain put of a member's id takes it out of the group.
    /// The whole group must fit in the RAM budget at once, each member
    /// charged as RAM charges it ([`ChunkStore::ram_charge`]).
    pub fn put_atomic(&self, chunks: Vec<(ChunkId, Bytes)>) -> Result<()> {
        let inner = &self.inner;
        inner.check_writable("a put")?;
        let mut ids: Vec<ChunkId> = Vec::with_capacity(chunks.len());
        // Distinct ids in put order (a `Vec` search was quadratic: review,
        // 32,768 members took 0.8 s).
        let mut seen = hashbrown::HashSet::with_capacity(chunks.len());
        let mut total = 0u64;
        for (id, data) in &chunks {
            if !inner.namespaces.read().contains_key(&id.ns) {
                return Err(Error::UnknownNamespace(id.ns));
            }
            inner.check_fits_region(0, data.len())?;
            total = total.saturating_add(self.ram_charge(data.len() as u64, 0));
            if seen.insert(*id) {
                ids.push(*id);
            }
        }
        if total > inner.config.ram_budget {
            return Err(Error::TooLarge {
                len: total,
                limit_name: "ram-budget (an atomic group must fit at once, with the bookkeeping RAM \
                             charges per chunk)",
                limit: inner.config.ram_budget,
            });
        }
        if chunks.is_empty() {
            return Ok(());
        }
        let size = ids.len() as u32;
        let _gate = inner.gate.write();
        let mut keep = Vec::new();
        let txn = {
            let mut t = inner.txns.lock();
            let txn = t.next;
            t.next += 1;
            // Before any member's insert (each stamps its version after).
            t.since.insert(txn, Instant::now());
            for id in &ids {
                if let Some(k) = inner.leave_group(&mut t, id) {
                    keep.push((*id, k));
                }
                t.of.insert(*id, (txn, size));
            }
            t.members.insert(txn, ids.clone());
            txn
        };
        for (id, (old, old_size)) in keep {
            inner.write_for_group(id, old, old_size);
        }
        let mut evicted = Vec::new();
        let mut res = Ok(());
        let t = Instant::now();
        for (id, data) in chunks {
            match inner.ram_insert(id, None, data, &mut evicted) {
                Ok(()) => {}
                Err(e) => {
                    res = Err(e);
                    break;
                }
            }
        }
        drop(_gate);
        for id in &ids {
            inner.supersede(*id, t);
        }
        if res.is_err() {
            inner.break_group(txn);
        }
        inner.handle_evicted(evicted);
        res
    }

    /// Reads a chunk: RAM, then disk. Any failure is a miss (counted, logged).
    pub fn get(&self, id: &ChunkId) -> Option<Hit> {
        self.inner.get_inner(id, None, true)
    }

    /// [`ChunkStore::get`] or [`ChunkStore::get_named`] (with `name`) for a
    /// caller that goes on to other nodes on a miss: a miss is not counted
    /// here; the caller counts what it finds with
    /// [`ChunkStore::count_peer_hit`] or [`ChunkStore::count_miss`]. A hit
    /// counts as usual.
    pub fn get_local(&self, id: &ChunkId, name: Option<&[u8]>) -> Option<Hit> {
        self.inner.get_inner(id, name, false)
    }

    /// Counts a GET miss (see [`ChunkStore::get_local`]).
    pub fn count_miss(&self) {
        self.inner.counters.misses.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a GET of `len` bytes that a local miss served with bytes
    /// fetched from a peer (see [`ChunkStore::get_local`]): in `hits_peer`
    /// and `bytes_out`.
    pub fn count_peer_hit(&self, len: u64) {
        let c = &self.inner.counters;
        c.hits_peer.fetch_add(1, Ordering::Relaxed);
        c.bytes_out.fetch_add(len, Ordering::Relaxed);
    }

    /// Reads a chunk stored with [`ChunkStore::put_named`]; a chunk whose
    /// stored name differs (a hash collision, or no name) is a miss.
    pub fn get_named(&self, id: &ChunkId, name: &[u8]) -> Option<Hit> {
        self.inner.get_inner(id, Some(name), true)
    }

    /// Reads a chunk from RAM only: `None` when it is not in RAM (or, with
    /// `name`, stored under another name), without touching the disk and
    /// without counting a miss (a caller that goes on to [`ChunkStore::get`]
    /// counts it there). A hit counts as [`ChunkStore::get`]'s RAM hits do.
    pub fn get_ram(&self, id: &ChunkId, name: Option<&[u8]>) -> Option<Hit> {
        self.inner.get_ram_inner(id, name).ok().flatten()
    }

    /// [`ChunkStore::get_ram`] that counts nothing (no hit, no `bytes_out`):
    /// for holding on to a chunk a client only asked about (RESP `EXISTS`
    /// keeps it for the `GET` that usually follows, which counts the read,
    /// see [`ChunkStore::count_ram_hit`]).
    pub fn peek_ram(&self, id: &ChunkId, name: Option<&[u8]>) -> Option<Bytes> {
        self.inner.peek_ram_inner(id, name).ok().flatten()
    }

    /// Counts a RAM hit of `len` bytes in namespace `ns` for bytes a client
    /// gets from a copy taken with [`ChunkStore::peek_ram`].
    pub fn count_ram_hit(&self, ns: &Namespace, len: u64) {
        self.inner.count_ram_hit(ns, len);
    }

    /// Reads a chunk, RAM then disk, to serve it to another node: not
    /// counted in `hits_ram`, `hits_disk`, `misses` or `bytes_out` (they
    /// count this node's clients' reads; the peer layer counts what it
    /// serves), and a disk copy is not cached in RAM for it. A disk read is
    /// verified as [`ChunkStore::get`]'s (a failure counts in
    /// `verify_failures` and is `None`). Blocking (disk).
    pub fn get_for_peer(&self, id: &ChunkId) -> Option<Bytes> {
        self.inner.get_for_peer_inner(id)
    }

    /// The payload length of the copy of `id` on disk, from the in-RAM
    /// index (no disk I/O): what a read from disk would return.
    /// `None` while the disk tier is poisoned (reads treat it as absent).
    pub fn disk_len(&self, id: &ChunkId) -> Option<u64> {
        let _g = self.inner.gate.read();
        let d = self
            .inner
            .disk
            .as_ref()
            .filter(|d| d.poisoned().is_none())?;
        d.index.read().get(id).map(|l| u64::from(l.payload_len))
    }

    /// Where a chunk lives, from the in-RAM index only (no disk I/O).
    pub fn locate(&self, id: &ChunkId) -> Option<Tier> {
        let _g = self.inner.gate.read();
        if self.inner.ram.contains(id) {
            return Some(Tier::Ram);
        }
        let d = self.inner.disk.as_ref()?;
        d.index.read().contains(id).then_some(Tier::Disk)
    }

    /// For an ordered key list: fills `tiers` with where each key lives (or
    /// `None`) and returns the length of the longest present prefix. Touches
    /// no disk and reads only the slot tables: each id is hashed once, and
    /// per block of keys the RAM tier and the disk index are probed in one
    /// pipeline in key order (the home slots of the key 16 ahead in both
    /// prefetched, so the RAM probes overlap the index's cache misses) under
    /// the index's read lock and every RAM shard's lock; when a shard is
    /// busy, the index is probed first and released before waiting for the
    /// shards (see [`crate::ram::RamCache::try_lock_all`]). Presence
    /// is by fingerprint, as LOOKUP is a hint: a negative is exact, a
    /// positive is wrong for about 1 in 10^9 absent keys, and a read checks
    /// the full id.
    pub fn lookup_prefix(
        &self,
        ns: Namespace,
        group: GroupId,
        keys: &[ChunkKey],
        tiers: &mut Vec<Option<Tier>>,
    ) -> usize {
        thread_local! {
            static HASHES: std::cell::RefCell<Vec<u64>> = const { std::cell::RefCell::new(Vec::new()) };
        }
        let _g = self.inner.gate.read();
        let ram = &self.inner.ram;
        tiers.clear();
        tiers.resize(keys.len(), None);
        HASHES.with_borrow_mut(|hashes| {
            hashes.clear();
            let seed = seed(&ns, group);
            hashes.extend(keys.iter().map(|k| key_hash(seed, k)));
            let ram_empty = ram.is_probe_empty();
            for (block, tiers) in hashes
                .chunks(crate::ram::PRESENCE_BLOCK)
                .zip(tiers.chunks_mut(crate::ram::PRESENCE_BLOCK))
            {
                let index = self.inner.disk.as_ref().map(|d| d.index.read());
                let Some(ix) = index.as_deref() else {
                    // No disk: the RAM tier alone.
                    if !ram_empty {
                        let shards = ram.lock_all();
                        pipelined(
                            block,
                            |h| shards.prefetch(h),
                            |i, h| tiers[i] = shards.contains(h).then_some(Tier::Ram),
                        );
                    }
                    continue;
                };
                if ram_empty {
                    pipelined(
                        block,
                        |h| ix.prefetch_hash(h),
                        |i, h| tiers[i] = ix.contains_hash(h).then_some(Tier::Disk),
                    );
                    continue;
                }
                // Both in one pipeline, the RAM probes overlapping the
                // index's cache misses, when every shard is free at once.
                // The index's read lock is never kept while waiting for a
                // shard: one held long by a walk (idle flush, gc) would
                // queue the disk writer, and the disk reads behind it.
                if let Some(shards) = ram.try_lock_all() {
                    pipelined(
                        block,
                        |h| {
                            shards.prefetch(h);
                            ix.prefetch_hash(h);
                        },
                        |i, h| {
                            tiers[i] = if shards.contains(h) {
                                Some(Tier::Ram)
                            } else {
                                ix.contains_hash(h).then_some(Tier::Disk)
                            };
                        },
                    );
                    continue;
                }
                pipelined(
                    block,
                    |h| ix.prefetch_hash(h),
                    |i, h| tiers[i] = ix.contains_hash(h).then_some(Tier::Disk),
                );
                drop(index);
                let shards = ram.lock_all();
                pipelined(
                    block,
                    |h| shards.prefetch(h),
                    |i, h| {
                        if shards.contains(h) {
                            tiers[i] = Some(Tier::Ram);
                        }
                    },
                );
            }
            // Keep the scratch space of a huge batch from staying around.
            hashes.shrink_to(1 << 16);
        });
        tiers.iter().take_while(|t| t.is_some()).count()
    }

    /// A count that changes whenever `id` (or an id sharing its bucket of
    /// 1,024) is deleted, by any path (a client's delete, `gc`), and never
    /// when RAM evicts it: a copy taken earlier (RESP's pin of a positive
    /// EXISTS) is still the id's value while the count is unchanged and no
    /// newer version was put.
    pub fn deletions_of(&self, id: &ChunkId) -> u64 {
        self.inner.deletions[deletion_bucket(id)].load(Ordering::Acquire)
    }

    /// Removes a chunk from RAM and disk; returns whether it existed. The
    /// removal reaches the disk as a tombstone, durable at the next flush.
    /// A read-only store removes nothing and returns false.
    pub fn delete(&self, id: &ChunkId) -> bool {
        if self.inner.config.read_only {
            return false;
        }
        self.inner.delete_inner(id, true)
    }

    /// Writes every chunk that is dirty at the call; returns when they are durable.
    pub fn flush(&self) -> Result<FlushReport> {
        self.inner.check_writable("a flush")?;
        self.inner.flush_inner(None)
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> StoreStats {
        let i = &self.inner;
        let c = &i.counters;
        let mut s = StoreStats {
            ram_chunks: i.ram.len() as u64,
            ram_bytes: i.ram.used_bytes(),
            ram_budget: i.config.ram_budget,
            dirty_bytes: i.ram.dirty_bytes(),
            spilled_chunks: i.ram.spilled_len() as u64,
            spilled_bytes: i.ram.spilled_bytes(),
            disk_budget: i.config.disk_budget,
            hits_ram: c.hits_ram.load(Ordering::Relaxed),
            hits_disk: c.hits_disk.load(Ordering::Relaxed),
            hits_peer: c.hits_peer.load(Ordering::Relaxed),
            misses: c.misses.load(Ordering::Relaxed),
            puts: c.puts.load(Ordering::Relaxed),
            bytes_in: c.bytes_in.load(Ordering::Relaxed),
            bytes_out: c.bytes_out.load(Ordering::Relaxed),
            ram_evictions: c.ram_evictions.load(Ordering::Relaxed),
            dropped_unwritten: c.dropped_unwritten.load(Ordering::Relaxed),
            lost_writes: c.lost_writes.load(Ordering::Relaxed),
            reclaimed_rewrites: c.reclaimed_rewrites.load(Ordering::Relaxed),
            evicted_chunks: c.evicted_chunks.load(Ordering::Relaxed),
            recovery_micros: i.recovery_micros.load(Ordering::Relaxed),
            ..Default::default()
        };
        let pool = i.buffers.stats();
        s.buffer_pool_bytes = pool.bytes;
        s.buffer_pool_reused = pool.reused;
        s.buffer_pool_fresh = pool.fresh;
        if let Some(d) = &i.disk {
            let dc = &d.counters;
            let ix = d.index.read();
            s.disk_chunks = ix.len() as u64;
            s.index_bytes = ix.memory_bytes() as u64;
            drop(ix);
            s.disk_bytes = d.live_bytes.load(Ordering::Relaxed);
            s.region_evictions = dc.region_evictions.load(Ordering::Relaxed);
            s.disk_writes = dc.disk_writes.load(Ordering::Relaxed);
            s.disk_write_bytes = dc.disk_write_bytes.load(Ordering::Relaxed);
            s.disk_reads = dc.disk_reads.load(Ordering::Relaxed);
            s.verify_failures = dc.verify_failures.load(Ordering::Relaxed);
            s.damaged_metadata = dc.damaged_metadata.load(Ordering::Relaxed);
            s.disk_write_failures = dc.write_failures.load(Ordering::Relaxed);
            s.disk_syncs = dc.syncs.load(Ordering::Relaxed);
            s.disk_sync_micros = dc.sync_micros.load(Ordering::Relaxed);
            s.disk_write_micros = dc.write_micros.load(Ordering::Relaxed);
            s.disk_batch_writes = dc.batch_writes.load(Ordering::Relaxed);
            s.disk_read_bytes = dc.read_bytes.load(Ordering::Relaxed);
            s.disk_read_micros = dc.read_micros.load(Ordering::Relaxed);
            s.writer_paused_nospace = d.paused_nospace.load(Ordering::Relaxed);
            s.direct_io = d.dev.direct_io();
            s.disk_poisoned = d.poisoned().is_some();
            s.disk_regions = u64::from(d.region_count);
            s.region_size = d.region_size;
            s.disk_budget = d.region_size.saturating_mul(s.disk_regions);
        }
        s.writer_queue_depth = i.tx.as_ref().map_or(0, |t| t.len() as u64)
            + i.overflow.lock().as_ref().map_or(0, |o| o.len() as u64);
        s
    }

    /// Every chunk id held (RAM or disk) with its payload length: the snapshot
    /// the peer sync publishes.
    pub fn ids(&self) -> Vec<(ChunkId, u64)> {
        self.ids_with_tier()
            .into_iter()
            .map(|(id, len, _)| (id, len))
            .collect()
    }

    /// [`ChunkStore::ids`] with whether each chunk is in RAM.
    ///
    /// The disk index is only copied under its read lock and merged after:
    /// a writer waiting for the lock, and every local lookup queued behind
    /// it (the lock is fair), waits for a copy, not for a map of a million
    /// entries being built (every peer link's snapshot asks for this).
    pub fn ids_with_tier(&self) -> Vec<(ChunkId, u64, bool)> {
        let mut ram: HashMap<ChunkId, u64> = HashMap::new();
        for (id, _) in self.inner.ram.ids() {
            if let Some(e) = self.inner.ram.peek_any(&id) {
                ram.insert(id, e.data.len() as u64);
            }
        }
        let disk: Vec<(ChunkId, u64)> = match &self.inner.disk {
            Some(d) => d
                .index
                .read()
                .iter()
                .map(|(id, l)| (*id, u64::from(l.payload_len)))
                .collect(),
            None => Vec::new(),
        };
        let mut out = Vec::with_capacity(disk.len() + ram.len());
        for (id, len) in disk {
            match ram.remove(&id) {
                Some(l) => out.push((id, l, true)),
                None => out.push((id, len, false)),
            }
        }
        out.extend(ram.into_iter().map(|(id, l)| (id, l, true)));
        out
    }

    /// Re-reads and checks every chunk on disk. `progress(done, total)` is
    /// called as it goes.
    pub fn verify(
        &self,
        opts: &VerifyOptions,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<VerifyReport> {
        if opts.repair {
            self.inner.check_writable("verify --repair")?;
        }
        self.inner.check_open()?;
        crate::maintenance::verify(&self.inner, opts, progress)
    }

    /// Writes what is queued and seals the region open for appends (the next
    /// write opens another). `verify --repair` uses it so that a chunk that
    /// recovery dropped from the open region (torn or corrupt) is gone for
    /// good: the summary lists only what recovery kept, and later opens read
    /// it instead of walking the batches again. A region recovery found
    /// open but without a durable chunk (all of its chunks torn) gets its
    /// open slot cleared instead. Returns whether anything was written.
    pub fn seal_open_region(&self) -> Result<bool> {
        self.inner.check_writable("sealing the open region")?;
        if self.inner.disk.is_none() {
            return Ok(false);
        }
        let (ack, wait) = bounded(1);
        self.inner.send(Msg::SealOpen(ack))?;
        wait.recv().map_err(|_| Error::Closed)?
    }

    /// Drops namespaces by id or age.
    pub fn gc(&self, opts: &GcOptions) -> Result<GcReport> {
        if !opts.dry_run {
            self.inner.check_writable("gc --apply")?;
        }
        self.inner.check_open()?;
        crate::maintenance::gc(&self.inner, opts)
    }

    /// Flushes dirty chunks within `deadline`, stops the I/O threads and
    /// closes the files. Further calls fail with [`Error::Closed`].
    pub fn close(&self, deadline: Duration) -> Result<FlushReport> {
        if self.inner.closed.swap(true, Ordering::SeqCst) {
            return Err(Error::Closed);
        }
        if self.inner.config.read_only {
            // Nothing was written, nothing is owed.
            let _ = self.stop_threads();
            self.file_lock.lock().take();
            return Ok(FlushReport::default());
        }
        // A deadline past what an instant holds (centuries) is no deadline.
        let now = Instant::now();
        let end = now
            .checked_add(deadline)
            .unwrap_or(now + Duration::from_secs(86_400 * 365));
        let rewrites = || {
            self.inner
                .counters
                .reclaimed_rewrites
                .load(Ordering::Relaxed)
        };
        let mut report = Ok(FlushReport::default());
        // Regions reclaimed by a round may have marked hot chunks dirty
        // again (see `Hooks::reclaimed`): a few more rounds write them. Each
        // marks only chunks read since they were last marked, and nothing
        // reads while the store closes, so this ends.
        for _ in 0..4 {
            let before = rewrites();
            report = match (report, self.inner.flush_inner(Some(end))) {
                (Ok(a), Ok(b)) => Ok(FlushReport {
                    chunks: a.chunks + b.chunks,
                    bytes: a.bytes + b.bytes,
                    // What is still unwritten: the last round tried it all.
                    failed: b.failed,
                }),
                (Err(e), _) | (_, Err(e)) => Err(e),
            };
            let again = report.as_ref().is_ok_and(|r| r.failed == 0)
                && rewrites() != before
                && Instant::now() < end;
            if !again {
                break;
            }
        }
        let late = Instant::now() >= end;
        if late && let Some(d) = &self.inner.disk {
            // Past the deadline: the writes still queued are dropped, not
            // written (they held the stop for as long as they took).
            d.abandon_writes.store(true, Ordering::SeqCst);
        }
        self.inner.persist_last_used();
        let stopped = self.stop_threads();
        self.file_lock.lock().take();
        if late && let Err(Error::Deadline(_)) = report {
            // Still dirty or spilled in RAM, plus evictions whose queued
            // writes were dropped.
            let st = self.stats();
            let dropped = self
                .inner
                .disk
                .as_ref()
                .map_or(0, |d| d.abandoned_bytes.load(Ordering::Relaxed));
            let unwritten = st.unwritten_bytes() + dropped;
            if unwritten == 0 && stopped.is_ok() {
                // The deadline passed (a zero one at once), but the stop's
                // final sync made everything durable: nothing is lost.
                return Ok(FlushReport::default());
            }
            report = Err(Error::Deadline(format!(
                "the flush did not finish within the close deadline ({deadline:?}): \
                 {:.1} MiB ({unwritten} bytes) of dirty chunks were not written and are \
                 lost at this exit",
                unwritten as f64 / (1u64 << 20) as f64
            )));
        }
        report
    }

    /// Stops the writer (its final sync) and the other threads; returns
    /// the final sync's result (`Ok` without a writer).
    fn stop_threads(&self) -> Result<()> {
        self.idle_stop.lock().take();
        let mut stopped = Ok(());
        if let Some(tx) = &self.inner.tx {
            let (ack, wait) = bounded(1);
            if tx.send(Msg::Stop(ack)).is_ok() {
                stopped = wait.recv().unwrap_or(Err(Error::Closed));
            }
        }
        for h in self.threads.lock().drain(..) {
            let _ = h.join();
        }
        stopped
    }

    /// Test hook: one pass of the idle flusher, as its timer would run it.
    #[cfg(feature = "test_utils")]
    pub fn idle_tick(&self) {
        self.inner.idle_pass();
    }

    /// Test hook: a clone of the disk index location of `id`, as
    /// `(region, offset within the file, record length)`.
    #[cfg(feature = "test_utils")]
    pub fn disk_location(&self, id: &ChunkId) -> Option<(u32, u64, u64)> {
        let d = self.inner.disk.as_ref()?;
        let l = d.index.read().get(id)?;
        Some((
            l.region,
            d.region_base(l.region) + u64::from(l.offset),
            u64::from(l.header_len) + u64::from(l.payload_len),
        ))
    }

    /// Test hook: entries of the map of cancelled writes (deletes and broken
    /// atomic groups whose pruning is still pending).
    #[cfg(feature = "test_utils")]
    pub fn cancelled_writes(&self) -> usize {
        self.inner.cancel.lock().len()
    }

    /// Test hook: write jobs of `id` queued, packed or in flight.
    #[cfg(feature = "test_utils")]
    pub fn pending_writes(&self, id: &ChunkId) -> usize {
        self.inner
            .pending
            .lock()
            .get(id)
            .map_or(0, |n| n.jobs as usize)
    }

    /// Test hook: header length of the chunk `id` on disk.
    #[cfg(feature = "test_utils")]
    pub fn disk_header_len(&self, id: &ChunkId) -> Option<u32> {
        let d = self.inner.disk.as_ref()?;
        d.index.read().get(id).map(|l| l.header_len)
    }
}

impl Drop for ChunkStore {
    fn drop(&mut self) {
        if !self.inner.closed.swap(true, Ordering::SeqCst) {
            let _ = self.stop_threads();
        }
    }
}

/// Most bytes of one namespace record as JSON.
pub const MAX_RECORD_BYTES: usize = 16 << 10;

/// Bytes gathered per disk write.
const WRITE_BATCH: usize = 4 << 20;

/// Most dirty chunks one idle pass hands to the writer (it runs again as
/// soon as the queue is empty).
const IDLE_PASS_JOBS: usize = 64;

impl Inner {
    fn check_open(&self) -> Result<()> {
        if self.closed.load(Ordering::SeqCst) {
            return Err(Error::Closed);
        }
        Ok(())
    }

    /// [`Self::check_open`], and `what` refused on a read-only store.
    fn check_writable(&self, what: &'static str) -> Result<()> {
        self.check_open()?;
        if self.config.read_only {
            return Err(Error::ReadOnly(what));
        }
        Ok(())
    }

    fn send(&self, m: Msg) -> Result<()> {
        match &self.tx {
            Some(tx) => tx.send(m).map_err(|_| Error::Closed),
            None => Err(Error::Closed),
        }
    }

    /// [`Inner::send`], giving up at `deadline` (if any) while the queue
    /// stays full.
    fn send_until(&self, m: Msg, deadline: Option<Instant>) -> Result<()> {
        let (Some(tx), Some(t)) = (&self.tx, deadline) else {
            return self.send(m);
        };
        tx.send_deadline(m, t).map_err(|e| match e {
            crossbeam_channel::SendTimeoutError::Timeout(_) => flush_deadline(),
            crossbeam_channel::SendTimeoutError::Disconnected(_) => Error::Closed,
        })
    }

    fn observer(&self) -> Option<Arc<dyn ChunkObserver>> {
        self.observer.read().clone()
    }

    fn touch(&self, ns: &Namespace) {
        // Coarse (a minute): kept in memory, persisted at flush/close/gc.
        let now = crate::layout::now_ms();
        let stale = self
            .namespaces
            .read()
            .get(ns)
            .is_some_and(|e| now > e.last_used_ms + 60_000);
        if stale {
            if let Some(e) = self.namespaces.write().get_mut(ns) {
                e.last_used_ms = now;
            }
        }
    }

    pub(crate) fn persist_last_used(&self) {
        let _g = self.manifest_lock.lock();
        let snap = self.namespaces.read().clone();
        if snap.is_empty() {
            return;
        }
        match manifest::store(&self.config.data_dir, &snap) {
            Ok(()) => {
                self.last_used_failing.store(false, Ordering::Relaxed);
                self.manifest_unwritten.store(false, Ordering::Relaxed);
            }
            Err(e) if self.manifest_unwritten.load(Ordering::Relaxed) => tracing::warn!(
                error = %e,
                "the namespace manifest is still not written: a namespace registered in memory \
                 only is forgotten by a restart (not its chunks; its client's next HELLO \
                 registers it again)"
            ),
            Err(e) if self.last_used_failing.swap(true, Ordering::Relaxed) => {
                tracing::debug!(error = %e, "could not persist namespace last-used times (again)");
            }
            Err(e) => tracing::warn!(error = %e, "could not persist namespace last-used times"),
        }
    }

    pub(crate) fn forget_namespaces(&self, gone: &[Namespace]) -> Result<()> {
        let _g = self.manifest_lock.lock();
        let mut snap = self.namespaces.read().clone();
        for ns in gone {
            snap.remove(ns);
        }
        manifest::store(&self.config.data_dir, &snap)?;
        *self.namespaces.write() = snap;
        Ok(())
    }

    pub(crate) fn namespace_last_used(&self) -> Vec<(Namespace, u64)> {
        self.namespaces
            .read()
            .iter()
            .map(|(id, e)| (*id, e.last_used_ms))
            .collect()
    }

    /// Inserts a put chunk into RAM: dirty (owed to the disk) when there is
    /// a disk, clean on a RAM-only store, where there is nothing to owe (an
    /// eviction then is a plain eviction, not a dropped write, and a flush
    /// has nothing to do).
    fn ram_insert(
        &self,
        id: ChunkId,
        name: Option<Bytes>,
        data: Bytes,
        evicted: &mut Vec<Evicted>,
    ) -> Result<()> {
        let len = data.len() as u64;
        let (_, ev) = self.ram.insert(id, data, name, self.disk.is_some())?;
        evicted.extend(ev);
        self.counters.puts.fetch_add(1, Ordering::Relaxed);
        self.counters.bytes_in.fetch_add(len, Ordering::Relaxed);
        if let Some(o) = self.observer() {
            o.added(&id, len);
        }
        Ok(())
    }

    fn put_inner(
        &self,
        id: ChunkId,
        name: Option<Bytes>,
        data: Bytes,
        _txn: Option<()>,
    ) -> Result<()> {
        self.check_writable("a put")?;
        if !self.namespaces.read().contains_key(&id.ns) {
            return Err(Error::UnknownNamespace(id.ns));
        }
        self.check_fits_region(name.as_ref().map_or(0, |n| n.len()), data.len())?;
        // Under the gate, so that a put_atomic of this id (which holds it
        // from registering its group to its last RAM insert) is wholly
        // before or after this leave and insert (review: a put between the
        // two shrank the rest of the group while put_atomic's version of
        // this id landed after the put, a group whole in RAM and short on
        // disk).
        let gate = self.gate.read();
        self.leave_group_now(&id);
        let mut evicted = Vec::new();
        let t = Instant::now();
        let inserted = self.ram_insert(id, name, data, &mut evicted);
        drop(gate);
        inserted?;
        self.supersede(id, t);
        self.touch(&id.ns);
        self.handle_evicted(evicted);
        Ok(())
    }

    /// Refuses a dirty chunk that could never be written: larger than what
    /// an empty region holds (it would stay dirty, and every flush would
    /// fail, until it is overwritten or deleted).
    fn check_fits_region(&self, name_len: usize, len: usize) -> Result<()> {
        let Some(d) = &self.disk else {
            return Ok(());
        };
        let limit = crate::writer::max_payload_len(d.region_size, name_len);
        if len as u64 > limit {
            return Err(Error::TooLarge {
                len: len as u64,
                limit_name: "the largest chunk a region holds (region-size less headers)",
                limit,
            });
        }
        Ok(())
    }

    fn put_clean_inner(&self, id: ChunkId, name: Option<Bytes>, data: Bytes) -> Result<bool> {
        self.check_writable("a put")?;
        if !self.namespaces.read().contains_key(&id.ns) {
            return Err(Error::UnknownNamespace(id.ns));
        }
        let Some(mark) = self.ram.mark_if_absent(&id) else {
            return Ok(false);
        };
        // Also while a write of a version that left RAM is on its way: it
        // could be indexed over this copy.
        if self.on_disk(&id) || self.pending.lock().contains_key(&id) {
            return Ok(false);
        }
        let len = data.len() as u64;
        // Never replaces a version put (or deleted) since the check.
        let (inserted, evicted) = self.ram.insert_if_unchanged(id, data, name, mark)?;
        if inserted.is_some() {
            if let Some(o) = self.observer() {
                o.added(&id, len);
            }
            self.touch(&id.ns);
        }
        self.handle_evicted(evicted);
        Ok(inserted.is_some())
    }

    /// Takes `id` out of its atomic group (it was replaced or deleted).
    ///
    /// While no member of the group has been handed to the writer, the rest
    /// becomes a group of its own size: recovery shows a group only when it
    /// finds as many members as their entries record, and the member that
    /// left will never be written as one (QA: a group put, one member
    /// overwritten or deleted, then a flush and a clean stop, lost the other
    /// members at the restart). Once a member is queued the recorded size
    /// is fixed, and the leaving member's version is written for the group.
    /// Returns `(txn, size)` when the group's size is fixed and others
    /// remain: the caller then hands `id`'s version in the group to
    /// [`Inner::write_for_group`] (outside the lock) before replacing it.
    #[must_use]
    fn leave_group(&self, t: &mut Txns, id: &ChunkId) -> Option<(u64, u32)> {
        let (txn, size) = t.of.remove(id)?;
        let m = t.members.get_mut(&txn)?;
        m.retain(|x| x != id);
        if m.is_empty() {
            t.forget(txn);
            None
        } else if !t.queued.contains(&txn) {
            let size = m.len() as u32;
            for x in m.iter() {
                t.of.insert(*x, (txn, size));
            }
            None
        } else {
            Some((txn, size))
        }
    }

    /// Takes `id` out of its atomic group, if any, and writes its version
    /// in the group for the group first where [`Inner::leave_group`] says
    /// so (a put or delete replacing it; the caller holds the gate).
    fn leave_group_now(&self, id: &ChunkId) {
        let keep = self.leave_group(&mut self.txns.lock(), id);
        if let Some((txn, size)) = keep {
            self.write_for_group(*id, txn, size);
        }
    }

    /// The members of atomic group `txn` now, once a put_atomic in progress
    /// has inserted them all (it holds the gate until then).
    fn group_members(&self, txn: u64) -> Vec<ChunkId> {
        let _gate = self.gate.read();
        self.txns
            .lock()
            .members
            .get(&txn)
            .cloned()
            .unwrap_or_default()
    }

    /// Drops every remaining member of `txn` (one member was lost).
    fn break_group(&self, txn: u64) {
        let members = {
            let mut t = self.txns.lock();
            let m = t.members.remove(&txn).unwrap_or_default();
            t.forget(txn);
            for id in &m {
                t.of.remove(id);
            }
            m
        };
        if members.is_empty() {
            return;
        }
        tracing::debug!(
            txn,
            members = members.len(),
            "atomic group lost a member; dropping the rest"
        );
        let obs = self.observer();
        for id in members {
            // Cancels a write of this member that is queued or in flight,
            // before the index lock (see `Hooks::cancelled`); then the
            // index, then RAM (see `delete_inner`).
            let mut now = Instant::now();
            if self.disk.is_some() {
                now = cancel_now(&mut self.cancel.lock(), id);
            }
            let on_disk = self.disk.as_ref().is_some_and(|d| {
                let mut ix = d.index.write();
                if ix.get(&id).is_some_and(|l| l.txn == txn) {
                    if let Some(l) = ix.remove(&id) {
                        d.live_bytes
                            .fetch_sub(u64::from(l.payload_len), Ordering::Relaxed);
                    }
                    true
                } else {
                    false
                }
            });
            let removed = self.ram.remove(&id);
            let in_ram = removed.is_some();
            if let (Some(e), Some(d)) = (removed, &self.disk)
                && e.dirty
                && d.abandon_writes.load(Ordering::SeqCst)
            {
                // A member whose write a close past its deadline dropped
                // broke the group: this one is lost at the exit too.
                d.abandoned_bytes
                    .fetch_add(e.data.len() as u64, Ordering::Relaxed);
            }
            if self.disk.is_some() {
                self.forget_cancel(id, now);
            }
            if in_ram || on_disk {
                if let Some(o) = &obs {
                    o.removed(&id);
                }
            }
        }
    }

    /// Asks the writer to prune the cancellation of `id` made at `at` once
    /// the jobs queued before it are done. Never blocks (the writer thread
    /// itself breaks groups when a write fails or a region is reclaimed).
    fn forget_cancel(&self, id: ChunkId, at: Instant) {
        match &self.tx {
            Some(tx) => match tx.try_send(Msg::Forget(id, at, 1)) {
                Ok(()) => {}
                Err(TrySendError::Full(_)) => {
                    let mut later = self.forget_later.lock();
                    let e = later.entry(id).or_insert((at, 0));
                    e.0 = e.0.max(at);
                    e.1 += 1;
                }
                Err(TrySendError::Disconnected(_)) => self.tombstone_done(&id, at),
            },
            None => self.tombstone_done(&id, at),
        }
    }

    /// Sends the `Msg::Forget`s that found the queue full (flush, idle).
    /// (`blocking`: waiting for room in the queue, until `deadline` if
    /// any; what is not sent stays for later.)
    fn send_forgets(&self, blocking: bool, deadline: Option<Instant>) {
        let later = std::mem::take(&mut *self.forget_later.lock());
        let Some(tx) = &self.tx else {
            return;
        };
        let mut rest = Vec::new();
        for (id, (at, n)) in later {
            let sent = match (blocking, deadline) {
                (true, None) => tx.send(Msg::Forget(id, at, n)).is_ok(),
                (true, Some(t)) => tx.send_deadline(Msg::Forget(id, at, n), t).is_ok(),
                (false, _) => tx.try_send(Msg::Forget(id, at, n)).is_ok(),
            };
            if !sent {
                rest.push((id, (at, n)));
            }
        }
        if !rest.is_empty() {
            let mut later = self.forget_later.lock();
            for (id, (at, n)) in rest {
                let e = later.entry(id).or_insert((at, 0));
                e.0 = e.0.max(at);
                e.1 += n;
            }
        }
    }

    fn txn_of(&self, id: &ChunkId) -> (u64, u32) {
        self.txns.lock().of.get(id).copied().unwrap_or((0, 0))
    }

    fn on_disk(&self, id: &ChunkId) -> bool {
        self.disk
            .as_ref()
            .is_some_and(|d| d.index.read().contains(id))
    }

    /// A version of `id` was put (stamped after `t`): no older version may
    /// become current again if this one is lost before it reaches the disk
    /// (dropped by the no-tax policy, or its write failed), as a RESP key
    /// overwritten would read its earlier value. So, like a delete of the
    /// versions put up to `t` (whose protocol it follows, `delete_inner`),
    /// this cancels their writes still queued or in flight (if the id has
    /// any, [`PendingWrite`]), takes the id out of the disk index, and bumps
    /// its RAM removal bucket (a disk read in flight does not cache the
    /// older copy). No tombstone: after a restart the older version, the
    /// last one the disk got, is served again if the new one never reached
    /// the disk, as after a crash.
    ///
    /// Checked after the insert: a write of an older version that starts
    /// later is skipped by the writer ([`Hooks::wanted`]: its version is no
    /// longer in RAM). Nothing to do (two short lookups) for an id neither
    /// indexed nor being written: a put of a new key, or a key overwritten
    /// in RAM. Should the new version reach the index between its insert
    /// and this call, it reads as a miss (a lost chunk, never an old one).
    fn supersede(&self, id: ChunkId, t: Instant) {
        let Some(d) = &self.disk else {
            return;
        };
        let pending = self.pending.lock().contains_key(&id);
        if !pending && !self.on_disk(&id) {
            return;
        }
        {
            // The order of `delete_inner`: nothing cancelled is indexed
            // after this removal (see `Hooks::cancelled`).
            let mut ix = d.index.write();
            if pending {
                cancel_at(&mut self.cancel.lock(), id, t);
            }
            if let Some(l) = ix.remove(&id) {
                d.live_bytes
                    .fetch_sub(u64::from(l.payload_len), Ordering::Relaxed);
            }
        }
        self.ram.bump(&id);
        if pending {
            self.forget_cancel(id, t);
        }
    }

    /// A chunk is gone from this node: tell the observer, break its group.
    /// Returns false when another copy of it is still here (RAM or disk).
    fn lost(&self, id: &ChunkId) -> bool {
        if self.ram.contains(id) || self.on_disk(id) {
            return false;
        }
        if let Some(o) = self.observer() {
            o.removed(id);
        }
        let (txn, _) = self.txn_of(id);
        if txn != 0 {
            self.break_group(txn);
        }
        true
    }

    pub(crate) fn handle_evicted(&self, evicted: Vec<Evicted>) {
        let obs = if evicted.is_empty() {
            None
        } else {
            self.observer()
        };
        // Under `no-tax`, one hand-off for all of this call's evictions: a
        // large put can evict thousands of small chunks at once, and one
        // queue slot each overflowed the writer's queue (dropping them)
        // while it was idle and far below `spill_limit`.
        let mut handoff = Vec::new();
        // What waited for the writer before this call's evictions (they
        // are counted in `spilled_bytes` already, all of them, before any is
        // handed off).
        let batch: u64 = evicted
            .iter()
            .filter(|e| e.spilled)
            .map(|e| self.ram.charge_of(&e.entry))
            .sum();
        let before = self.ram.spilled_bytes().saturating_sub(batch);
        for e in evicted {
            self.counters.ram_evictions.fetch_add(1, Ordering::Relaxed);
            // Before a possible `removed`: a peer applies both in order.
            if let Some(o) = &obs {
                o.in_ram(&e.id, false);
            }
            // A store without a disk has no writer and inserts clean: only a
            // dirty chunk of a store with a disk goes on.
            let (true, Some(tx)) = (e.entry.dirty, &self.tx) else {
                self.evicted(&e.id);
                continue;
            };
            // Failpoint `tier::store::hand_off` (feature `failpoints`): a
            // `pause` holds an evicted chunk between its eviction and its
            // hand-off to the writer (the window `flush_inner` covers).
            #[cfg(feature = "failpoints")]
            fail::fail_point!("tier::store::hand_off");
            let (id, seq, spilled) = (e.id, e.entry.seq, e.spilled);
            let held = if spilled { Held::Spilled } else { Held::Gone };
            let job = self.write_job(id, e.entry, held, None);
            match self.config.write_policy {
                // Memory past the budget is bounded too: the writer is
                // behind by this much already.
                // A chunk waits while what waited before this put's
                // evictions is within the limit (so one always may, and at
                // most the limit plus one put's evictions wait, bounded by
                // the put's size). Not counted: this call's own evictions,
                // whatever their order (QA: a 200 MiB SET evicted three
                // small keys and a large value at once; the large one's
                // bytes counted against the small ones, dropped while the
                // disk was idle, and a chunk larger than the limit could
                // only wait alone; review: counting those handed off before
                // a chunk dropped it when the large one was older).
                // A hand-off waiting beside the queue is still spilled
                // (in `spilled_bytes`) until an overwrite or a delete
                // replaces its copy: summing the two counted it twice
                // (review); what waits is at most twice the limit (plus a
                // put's evictions) when every job beside outlived its copy.
                WritePolicy::NoTax
                    if spilled && {
                        let beside = self.overflow_bytes.load(Ordering::Relaxed);
                        before.max(beside) > self.config.spill_limit()
                    } =>
                {
                    drop(job);
                    self.dropped_unwritten(&id, spilled.then_some(seq));
                }
                WritePolicy::NoTax => handoff.push(job),
                WritePolicy::Backpressure => {
                    if tx.send(Msg::Write(job)).is_err() {
                        self.dropped_unwritten(&id, spilled.then_some(seq));
                    }
                }
            }
        }
        if handoff.is_empty() {
            return;
        }
        let Some(tx) = &self.tx else { return };
        // Behind earlier hand-offs waiting beside a full queue (in order),
        // else into the queue, else beside it: the writer takes them at its
        // next message (the queue is full, so it has one). Bounded in bytes
        // by `spill_limit` above, not by the queue's length.
        let stopped = self
            .disk
            .as_ref()
            .is_some_and(|d| d.writer_stopped.load(Ordering::SeqCst));
        let writes = |m: Msg| match m {
            Msg::Writes(jobs) => jobs,
            _ => unreachable!("the message sent"),
        };
        // The hand-offs the writer will not take.
        let refused = 'hand: {
            let mut over = self.overflow.lock();
            // A writer that stopped (or died) takes nothing more.
            let Some(o) = over.as_mut().filter(|_| !stopped) else {
                break 'hand handoff;
            };
            let jobs = if o.is_empty() {
                match tx.try_send(Msg::Writes(handoff)) {
                    Ok(()) => return,
                    Err(TrySendError::Full(m)) => writes(m),
                    Err(TrySendError::Disconnected(m)) => break 'hand writes(m),
                }
            } else {
                handoff
            };
            let bytes: u64 = jobs.iter().map(|j| j.data.len() as u64).sum();
            self.overflow_bytes.fetch_add(bytes, Ordering::Relaxed);
            o.extend(jobs);
            return;
        };
        let lost: Vec<_> = refused.iter().map(|j| (j.id, j.spill_seq)).collect();
        drop(refused);
        for (id, seq) in lost {
            self.dropped_unwritten(&id, seq);
        }
    }

    /// A dirty eviction the writer will not take: counted, its spilled copy
    /// (sequence `spill_seq`) released, and the chunk gone if no other copy
    /// is here.
    fn dropped_unwritten(&self, id: &ChunkId, spill_seq: Option<u64>) {
        self.counters
            .dropped_unwritten
            .fetch_add(1, Ordering::Relaxed);
        if let Some(seq) = spill_seq {
            self.ram.unspill(id, seq);
        }
        self.evicted(id);
    }

    /// A chunk pushed out to make room: counted in `evicted_chunks` when no
    /// other copy of it is left here ([`Inner::lost`]).
    fn evicted(&self, id: &ChunkId) {
        if self.lost(id) {
            self.counters.evicted_chunks.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The RAM half of a read: `Err(mark)` when the id is not in RAM (the
    /// mark for promoting a disk copy, [`RamCache::insert_if_unchanged`]),
    /// `Ok(None)` when it is under another name (not counted),
    /// `Ok(Some(hit))` a hit (counted).
    fn get_ram_inner(&self, id: &ChunkId, name: Option<&[u8]>) -> Result<Option<Hit>, AbsentMark> {
        let Some(data) = self.peek_ram_inner(id, name)? else {
            return Ok(None);
        };
        self.count_ram_hit(&id.ns, data.len() as u64);
        Ok(Some(Hit {
            data,
            tier: Tier::Ram,
        }))
    }

    /// The RAM half of a read, counting nothing: `Err(mark)` when the id
    /// is not in RAM, `Ok(None)` when it is under another name.
    fn peek_ram_inner(
        &self,
        id: &ChunkId,
        name: Option<&[u8]>,
    ) -> Result<Option<Bytes>, AbsentMark> {
        let e = {
            let _g = self.gate.read();
            self.ram.get_or_mark(id)?
        };
        if name.is_some_and(|want| e.name.as_deref().unwrap_or(&[]) != want) {
            return Ok(None);
        }
        Ok(Some(e.data))
    }

    /// Counts a client's RAM hit of `len` bytes in namespace `ns`.
    fn count_ram_hit(&self, ns: &Namespace, len: u64) {
        self.counters.hits_ram.fetch_add(1, Ordering::Relaxed);
        self.counters.bytes_out.fetch_add(len, Ordering::Relaxed);
        self.touch(ns);
    }

    fn get_for_peer_inner(&self, id: &ChunkId) -> Option<Bytes> {
        let ram = {
            let _g = self.gate.read();
            self.ram.get_or_mark(id)
        };
        let data = match ram {
            Ok(e) => e.data,
            Err(_) => match &self.disk {
                Some(d) if d.poisoned().is_none() => d.read_chunk(id, None).ok()?.0,
                _ => return None,
            },
        };
        // Used by the cluster: the namespace is not idle for `gc --max-age`.
        self.touch(&id.ns);
        Some(data)
    }

    /// `count_miss`: whether a miss is counted here (see
    /// [`ChunkStore::get_local`]).
    fn get_inner(&self, id: &ChunkId, name: Option<&[u8]>, count_miss: bool) -> Option<Hit> {
        let mark = match self.get_ram_inner(id, name) {
            Ok(Some(hit)) => return Some(hit),
            Ok(None) => {
                if count_miss {
                    self.counters.misses.fetch_add(1, Ordering::Relaxed);
                }
                return None;
            }
            Err(mark) => mark,
        };
        // No lock across the disk read (the gate orders RAM inserts of
        // atomic groups; a single read is ordered by the mark below).
        let read = match &self.disk {
            Some(d) if d.poisoned().is_none() => d.read_chunk(id, name),
            _ => Err(ReadMiss::Absent),
        };
        match read {
            Ok((data, stored_name)) => {
                self.counters.hits_disk.fetch_add(1, Ordering::Relaxed);
                self.counters
                    .bytes_out
                    .fetch_add(data.len() as u64, Ordering::Relaxed);
                self.touch(&id.ns);
                // Failpoint `tier::store::promote` (feature `failpoints`): a
                // `pause` holds a disk hit between its read and its promotion.
                #[cfg(feature = "failpoints")]
                fail::fail_point!("tier::store::promote");
                if self.config.promote_on_read {
                    // Only while the disk copy is still indexed (held so: a
                    // reclaim cannot take it out during the insert): one
                    // whose region was reclaimed during the read would leave
                    // a clean RAM copy that no flush writes and no reclaim
                    // rewrites, lost at the next restart. And only if
                    // nothing put, deleted or wrote `id` meanwhile: the copy
                    // read may be older than what is current now.
                    let indexed = self.disk.as_ref().map(|d| d.index.read());
                    let promoted = indexed
                        .as_ref()
                        .is_some_and(|ix| ix.get(id).is_some())
                        .then(|| {
                            self.ram
                                .insert_if_unchanged(*id, data.clone(), stored_name, mark)
                        });
                    drop(indexed);
                    if let Some(Ok((inserted, ev))) = promoted {
                        if inserted.is_some() {
                            if let Some(o) = self.observer() {
                                o.in_ram(id, true);
                            }
                        }
                        self.handle_evicted(ev);
                    }
                }
                Some(Hit {
                    data,
                    tier: Tier::Disk,
                })
            }
            Err(_) => {
                if count_miss {
                    self.counters.misses.fetch_add(1, Ordering::Relaxed);
                }
                None
            }
        }
    }

    pub(crate) fn delete_inner(&self, id: &ChunkId, notify: bool) -> bool {
        // Order matters; each step has a reader or the writer racing it:
        // 1. the cancellation, stamped `t` under its lock: versions put
        //    (stamped under their shard lock) before `t` are deleted, later
        //    ones are puts after this delete and stay;
        // 2. the disk index (the writer never indexes a cancelled job after
        //    this: it asks `Hooks::cancelled` under the index lock);
        // 3. RAM, the versions stamped before `t` only; this bumps the id's
        //    removal bucket, so a read that missed RAM before it and found
        //    the disk copy does not promote that copy back;
        // 4. the tombstone, carrying `t`, sent after the RAM removal: once it
        //    is written the cancellation is pruned, and a job made from a RAM
        //    copy still there would be indexed. A version put after `t` and
        //    packed before the tombstone makes the writer drop the tombstone
        //    (its record would delete that version at recovery).
        // Steps 1 and 2 under the index's write lock (then the cancel lock,
        // the order `finish` takes them in): nothing put after `t` can be
        // indexed before this removal, which would take it out.
        // 0. out of its atomic group, its version in the group written for
        //    the group first where that must be (before the tombstone); all
        //    under the gate, as a put (see `put_inner`).
        let gate = self.gate.read();
        self.leave_group_now(id);
        let mut on_disk = false;
        let t = match &self.disk {
            Some(d) => {
                let mut ix = d.index.write();
                let t = cancel_now(&mut self.cancel.lock(), *id);
                if let Some(l) = ix.remove(id) {
                    d.live_bytes
                        .fetch_sub(u64::from(l.payload_len), Ordering::Relaxed);
                    on_disk = true;
                }
                t
            }
            None => Instant::now(),
        };
        let in_ram = self.ram.remove_if(id, |e| e.inserted <= t).is_some();
        self.deletions[deletion_bucket(id)].fetch_add(1, Ordering::AcqRel);
        // Not held across the tombstone's send, which waits while the
        // writer's queue is full (readers would wait behind a put_atomic
        // waiting for the gate).
        drop(gate);
        if let (Some(_), Some(tx)) = (&self.disk, &self.tx) {
            let _ = tx.send(Msg::Tombstone(*id, t));
        }
        if notify && (in_ram || on_disk) {
            if let Some(o) = self.observer() {
                o.removed(id);
            }
        }
        in_ram || on_disk
    }

    /// Writes everything dirty at the call (resident or spilled) and waits
    /// until it is durable.
    ///
    /// A chunk evicted just before the call is spilled, and its write is
    /// queued by the evicting thread a moment later: that may be after this
    /// flush's marker, and a chunk resident at the call may be evicted (so
    /// its flush job skipped) and meet the same race. So once the writer
    /// answers, whatever the flush covered and is still spilled with the
    /// same version (its eviction's write not done yet) is written by a
    /// second round (at worst twice), and if anything covered is not
    /// resident and clean at the same version any more (its eviction's
    /// write may have landed after the first marker's fdatasync), a second
    /// marker syncs again.
    pub(crate) fn flush_inner(&self, deadline: Option<Instant>) -> Result<FlushReport> {
        if self.disk.is_none() {
            // RAM-only: nothing is owed to a disk (puts are clean).
            return Ok(FlushReport::default());
        }
        let walked = self.flush_walk();
        self.flush_walked(walked, deadline)
    }

    /// What a flush covers: the dirty entries, then the spilled ones (an
    /// entry evicted between the two walks is in the second one; a spilled
    /// entry never becomes resident again).
    fn flush_walk(&self) -> FlushWalk {
        FlushWalk {
            dirty: self.ram.dirty_entries(None, usize::MAX),
            spilled: self.ram.spilled_ids(),
        }
    }

    /// The rest of [`Inner::flush_inner`], after its walk.
    fn flush_walked(&self, walk: FlushWalk, deadline: Option<Instant>) -> Result<FlushReport> {
        let Some(d) = &self.disk else {
            return Ok(FlushReport::default());
        };
        let FlushWalk { dirty, spilled } = walk;
        if let Some(p) = d.poisoned() {
            return Err(Error::Poisoned(p));
        }
        self.send_forgets(true, deadline);
        let ticket = Arc::new(Ticket::default());
        let send = |id, e, held, counted| {
            self.send_until(
                Msg::Write(self.write_job_counted(id, e, held, Some(ticket.clone()), counted)),
                deadline,
            )
        };
        // Written since its job was made and still the version RAM holds:
        // else it was spilled (or evicted) meanwhile, and its eviction's
        // write may have landed after the last marker's fdatasync.
        let clean_at =
            |id: &ChunkId, seq| self.ram.peek(id).is_some_and(|e| e.seq == seq && !e.dirty);
        let mut covered = spilled;
        covered.reserve(dirty.len());
        for (id, e) in dirty {
            // The version RAM holds now, not the walk's: each job is made
            // in turn (a send can wait), and a version put since may have
            // been written already, which this older one must not follow
            // in the log (review). Written since, or gone (deleted, or
            // written and evicted): nothing to do. The job is counted
            // first: a put after the read below sees it (`supersede`), and
            // a newer version written meanwhile is remembered with the
            // count (`Pending::written`, see `Hooks::wanted`).
            let counted = PendingWrite::new(&self.pending, id);
            let seq = e.seq;
            let cur = match self.ram.peek_any(&id) {
                // A group's version now: the walk's version is written
                // (unindexed), which recovery goes back to should the group
                // be incomplete; unless the group's version was written
                // first, when the writer drops it and names the group for
                // the rounds below.
                Some(c) if c.seq != seq && self.txn_of(&id).0 != 0 => e,
                Some(c) if c.dirty => c,
                _ => continue,
            };
            let held = if cur.seq != seq && self.ram.spilled(&id, cur.seq).is_some() {
                Held::Spilled
            } else {
                Held::Resident
            };
            covered.push((id, cur.seq));
            send(id, cur, held, counted)?;
        }
        self.flush_marker(deadline)?;
        let mut late = 0;
        let mut moved = false;
        for (id, seq) in covered {
            if let Some(e) = self.ram.spilled(&id, seq) {
                late += 1;
                send(id, e, Held::Spilled, PendingWrite::new(&self.pending, id))?;
            } else if !clean_at(&id, seq) {
                moved = true;
            }
        }
        // Groups whose version of an id made the writer drop this flush's
        // job of an older one: the rest of each group is written too, in
        // rounds (a member evicted meanwhile is written by its eviction,
        // which the next round's marker covers), at most three.
        let mut members: Vec<(ChunkId, u64)> = Vec::new();
        let mut again = late > 0 || moved;
        let mut done = hashbrown::HashSet::new();
        for round in 0..3 {
            let mut next = Vec::new();
            again |= members.iter().any(|(id, seq)| !clean_at(id, *seq));
            let groups = std::mem::take(&mut *ticket.groups.lock());
            let handled = !groups.is_empty();
            for txn in groups {
                if !done.insert(txn) {
                    continue;
                }
                for id in self.group_members(txn) {
                    let counted = PendingWrite::new(&self.pending, id);
                    let Some(cur) = self.ram.peek_any(&id).filter(|c| c.dirty) else {
                        continue;
                    };
                    let held = if self.ram.spilled(&id, cur.seq).is_some() {
                        Held::Spilled
                    } else {
                        Held::Resident
                    };
                    next.push((id, cur.seq));
                    send(id, cur, held, counted)?;
                }
            }
            // A round that handled a group ends with a marker, whatever it
            // sent (a member written by another job since the last marker
            // is synced by this one; review: this held only through
            // `moved` above).
            again |= !next.is_empty() || handled;
            if !again {
                break;
            }
            tracing::debug!(
                late,
                round,
                "flush: another round for chunks evicted during the call or atomic groups"
            );
            self.flush_marker(deadline)?;
            again = false;
            members = next;
        }
        // Groups named in the last round (three group versions overtaking
        // this flush's jobs in a row) are not written by it: not reported
        // as written either.
        let left = ticket.groups.lock().len() as u64;
        if left > 0 {
            tracing::warn!(
                groups = left,
                "flush: atomic groups newer than chunks it covered were not all written; counted as failed"
            );
            ticket.failed.fetch_add(left, Ordering::Relaxed);
        }
        self.persist_last_used();
        // Until a delete's tombstone is on disk (or in the deletes journal),
        // a restart can bring the chunk back: a flush with such deletes does
        // not report success.
        let n = d.counters.tombstones_unwritten.load(Ordering::Relaxed);
        if n > 0 {
            // This error replaces the report: it says the chunks it could
            // not write too (QA: a stop on a full disk named only the
            // deletes, not the dirty chunks it lost).
            let failed = ticket.failed.load(Ordering::Relaxed);
            let also = if failed > 0 {
                format!(
                    "; {failed} dirty chunk(s) could not be written either (no space or an I/O \
                     error)"
                )
            } else {
                String::new()
            };
            return Err(Error::NoSpace {
                detail: format!(
                    "{n} delete(s) are not on disk: the disk refused their tombstones and the \
                     deletes journal could not take them either; the tombstones are written \
                     again with the next write once there is room; until then a restart may \
                     bring back chunks they deleted{also}"
                ),
            });
        }
        Ok(FlushReport {
            chunks: ticket.written.load(Ordering::Relaxed),
            bytes: ticket.bytes.load(Ordering::Relaxed),
            failed: ticket.failed.load(Ordering::Relaxed),
        })
    }

    /// A write job for version `e` of `id` (flush, idle pass, eviction);
    /// `held` says what becomes of its RAM copy once written.
    fn write_job(&self, id: ChunkId, e: RamEntry, held: Held, ticket: Option<Arc<Ticket>>) -> Job {
        let counted = PendingWrite::new(&self.pending, id);
        self.write_job_counted(id, e, held, ticket, counted)
    }

    /// [`Inner::write_job`] with its count among `id`'s writes not done
    /// yet taken already.
    fn write_job_counted(
        &self,
        id: ChunkId,
        e: RamEntry,
        held: Held,
        ticket: Option<Arc<Ticket>>,
        counted: PendingWrite,
    ) -> Job {
        // The size is read and the group marked queued in one step, so a
        // member leaving meanwhile cannot change the size under this job.
        let (txn, txn_size) = {
            let mut t = self.txns.lock();
            let v = t.tag(&id, e.inserted);
            if v.0 != 0 {
                t.queued.insert(v.0);
            }
            v
        };
        Job {
            id,
            name: e.name,
            data: e.data,
            ram_seq: (held == Held::Resident).then_some(e.seq),
            after_cancel: false,
            superseded: false,
            spill_seq: (held == Held::Spilled).then_some(e.seq),
            inserted: e.inserted,
            _pending: counted,
            txn,
            txn_size,
            created_ms: crate::layout::now_ms(),
            ticket,
            for_group: false,
        }
    }

    /// Writes the version of `id` that its atomic group `txn` (of `size`
    /// members as their entries record) holds, as `id` leaves the group,
    /// when another member may already be on disk: without it recovery
    /// would find the group short of a member and undo the rest (QA: a
    /// group put, one member evicted and written, another overwritten or
    /// deleted, then a flush and a clean stop lost the written member at
    /// the restart). Written, never indexed; queued before the version or
    /// tombstone that replaces it, so recovery applies that one after it.
    /// Nothing to do when that version is on disk already, or is no longer
    /// held (its group broke). With no room in the writer's queue (or when
    /// the write fails) the rest of the group is dropped instead.
    fn write_for_group(&self, id: ChunkId, txn: u64, size: u32) {
        let (Some(d), Some(tx)) = (&self.disk, &self.tx) else {
            return;
        };
        if d.index.read().get(&id).is_some_and(|l| l.txn == txn) {
            return;
        }
        let Some(e) = self.ram.peek_any(&id).filter(|e| e.dirty) else {
            return;
        };
        if self
            .txns
            .lock()
            .since
            .get(&txn)
            .is_some_and(|s| e.inserted < *s)
        {
            return; // not the group's version
        }
        let job = Job {
            id,
            name: e.name,
            data: e.data,
            ram_seq: None,
            after_cancel: false,
            superseded: false,
            spill_seq: None,
            inserted: e.inserted,
            _pending: PendingWrite::new(&self.pending, id),
            txn,
            txn_size: size,
            created_ms: crate::layout::now_ms(),
            ticket: None,
            for_group: true,
        };
        if tx.try_send(Msg::Write(job)).is_err() {
            // Never waits (callers hold the gate): with the writer's queue
            // full the group is short of this member on disk, so the rest
            // goes now, as a restart would undo it.
            tracing::debug!(
                txn,
                "writer queue full: a member leaving its atomic group breaks the rest"
            );
            self.break_group(txn);
        }
    }

    /// Sends a flush marker and waits (until `deadline`, if any) for the
    /// writer to make everything queued before it durable.
    ///
    /// A marker that reached the queue after the writer's last look at it
    /// (a flush racing `close`) is never answered: once the writer has
    /// stopped, the wait ends with [`Error::Closed`].
    fn flush_marker(&self, deadline: Option<Instant>) -> Result<()> {
        let (ack, wait) = bounded(1);
        self.send_until(Msg::Flush(ack), deadline)?;
        let stopped = || {
            self.disk
                .as_ref()
                .is_none_or(|d| d.writer_stopped.load(Ordering::SeqCst))
        };
        loop {
            let step = Instant::now() + Duration::from_millis(50);
            let until = deadline.map_or(step, |t| t.min(step));
            match wait.recv_deadline(until) {
                Ok(res) => return res,
                Err(RecvTimeoutError::Disconnected) => return Err(Error::Closed),
                Err(RecvTimeoutError::Timeout) => {}
            }
            if stopped() {
                return wait.try_recv().unwrap_or(Err(Error::Closed));
            }
            if deadline.is_some_and(|t| Instant::now() >= t) {
                return Err(flush_deadline());
            }
        }
    }

    fn idle_pass(&self) {
        let (Some(tx), Some(d)) = (&self.tx, &self.disk) else {
            return;
        };
        if self.closed.load(Ordering::SeqCst) || d.poisoned().is_some() || !tx.is_empty() {
            return;
        }
        self.send_forgets(false, None);
        // One hand-off (one queue slot, as a put's evictions take): one
        // slot per job filled the queue that `no-tax` evictions need.
        // A chunk whose write is packed or on the device is still dirty
        // while the queue is empty already: it waits for that write, not
        // for a second copy of the same version (review: written once per
        // pass on a slow device).
        let mut found = self
            .ram
            .dirty_entries(Some(self.config.idle_flush_after), IDLE_PASS_JOBS);
        {
            let pending = self.pending.lock();
            found.retain(|(id, _)| !pending.contains_key(id));
        }
        let jobs: Vec<_> = found
            .into_iter()
            .map(|(id, e)| self.write_job(id, e, Held::Resident, None))
            .collect();
        if !jobs.is_empty() {
            // Full: the next pass tries again (the chunks stay dirty).
            let _ = tx.try_send(Msg::Writes(jobs));
        }
    }
}

impl Hooks for Inner {
    fn take_overflow(&self, closing: bool) -> Vec<Job> {
        let mut over = self.overflow.lock();
        self.overflow_bytes.store(0, Ordering::Relaxed);
        if closing {
            over.take().unwrap_or_default()
        } else {
            over.as_mut().map(std::mem::take).unwrap_or_default()
        }
    }

    fn wanted(&self, job: &mut Job) -> bool {
        if job.for_group {
            // Always written (its group's count needs it), never indexed.
            job.superseded = true;
            return true;
        }
        // A flush's job of a version overwritten since the flush was called
        // (the new version need not reach the disk before the flush
        // returns): written all the same, never indexed, so that after a
        // crash the id reads as this version or a newer one, not as an
        // older one still on disk. A delete or a group break still drops it.
        if job.ticket.is_some()
            && let Some(seq) = job.ram_seq
        {
            let (soft, hard) = self.cancel.lock().get(&job.id).map_or((false, false), |c| {
                (
                    job.inserted <= c.at,
                    c.hard.is_some_and(|h| job.inserted <= h),
                )
            });
            let cur = self.ram.peek(&job.id);
            let newer_in_ram = cur.as_ref().is_some_and(|e| e.seq != seq);
            if !hard && (soft || newer_in_ram) {
                // A newer version is on disk already: this one would follow
                // it in the log and come back at recovery (review: a flush
                // whose job was made late). Known from RAM (the newer
                // version clean there) or from the id's pending-write entry
                // (written, then overwritten or evicted).
                let newer_written = if newer_in_ram && cur.is_some_and(|e| !e.dirty) {
                    Some(self.txn_of(&job.id).0)
                } else {
                    self.pending
                        .lock()
                        .get(&job.id)
                        .filter(|p| p.written > seq)
                        .map(|p| p.written_txn)
                };
                if let Some(txn) = newer_written {
                    // A group's version: it stands for this one only once
                    // the whole group is on disk (recovery undoes a group
                    // found incomplete, back to before it, where this
                    // version was never written); the flush writes the rest
                    // of the group before it returns (`flush_walked`).
                    if txn != 0
                        && let Some(t) = &job.ticket
                    {
                        t.groups.lock().push(txn);
                    }
                    return false;
                }
                job.superseded = true;
                return true;
            }
        }
        if self.cancelled(job) {
            // Deleted or its group broke: a spilled copy goes too (the
            // delete removed it already; this covers every other path).
            if let Some(seq) = job.spill_seq {
                self.ram.unspill(&job.id, seq);
            }
            return false;
        }
        // An eviction's (or a flush's second round's) job: only while its
        // version is still spilled. Gone means written already, or
        // superseded by a newer put, whose own write must not be
        // overwritten on disk by this older version arriving late.
        let live = if let Some(seq) = job.spill_seq {
            self.ram.spilled(&job.id, seq).is_some()
        } else if let Some(seq) = job.ram_seq {
            self.ram
                .peek(&job.id)
                .is_some_and(|e| e.seq == seq && e.dirty)
        } else {
            return true;
        };
        // A flush's version gone from RAM with no copy left here (not on
        // disk, no newer version, not deleted: dealt with above) was
        // dropped unwritten (`no-tax` past `spill_limit`) or its eviction's
        // write failed: this flush did not make it durable (review: the
        // flush said every chunk was written). Still in RAM: another job
        // (its eviction's, the flush's late round) writes it.
        // Written by another job (its eviction's) and then reclaimed from
        // the disk is not a failure either (review): the id's pending entry,
        // which this job keeps, says what was written.
        if !live
            && let Some(t) = &job.ticket
            && !self.ram.contains(&job.id)
            && !self.on_disk(&job.id)
            && !job.ram_seq.or(job.spill_seq).is_some_and(|seq| {
                self.pending
                    .lock()
                    .get(&job.id)
                    .is_some_and(|p| p.written >= seq)
            })
        {
            t.failed.fetch_add(1, Ordering::Relaxed);
        }
        live
    }

    fn cancel_time(&self, id: &ChunkId) -> Option<Instant> {
        self.cancel.lock().get(id).map(|c| c.at)
    }

    fn cancelled(&self, job: &Job) -> bool {
        self.cancel
            .lock()
            .get(&job.id)
            .is_some_and(|c| job.inserted <= c.at)
    }

    fn written(&self, job: &Job) {
        if let Some(seq) = job.ram_seq {
            self.ram.mark_clean(&job.id, seq);
        }
        // A flush's job of an older version that comes later is left out
        // then (see `wanted`). A job for a group (`for_group`) writes an
        // older version on purpose and carries no sequence number.
        if let Some(seq) = job.ram_seq.or(job.spill_seq)
            && let Some(p) = self.pending.lock().get_mut(&job.id)
            && seq > p.written
        {
            p.written = seq;
            p.written_txn = job.txn;
        }
        // The disk index has it now (the writer updates it first).
        if let Some(seq) = job.spill_seq {
            self.ram.unspill(&job.id, seq);
        }
        if let Some(t) = &job.ticket {
            t.written.fetch_add(1, Ordering::Relaxed);
            t.bytes.fetch_add(job.data.len() as u64, Ordering::Relaxed);
        }
    }

    fn failed(&self, job: &Job) {
        if let Some(t) = &job.ticket {
            t.failed.fetch_add(1, Ordering::Relaxed);
        }
        if job.for_group {
            // The group is short of this member on disk: the rest goes now,
            // as a restart would undo it (review).
            self.break_group(job.txn);
        }
        // One spilled version can have two jobs (its eviction's and a
        // flush's): only the one that released the copy counts the loss
        // (review: counted twice).
        let released = job
            .spill_seq
            .is_none_or(|seq| self.ram.unspill(&job.id, seq));
        // An eviction's write: no copy is left in RAM to try again. Not a
        // loss when a newer version or a delete already replaced it.
        if job.ram_seq.is_none()
            && released
            && self.lost(&job.id)
            && !job.superseded
            && !self.cancelled(job)
        {
            self.counters.lost_writes.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn ram_seq(&self) -> u64 {
        self.ram.next_seq()
    }

    fn group_entries(&self, r: u32, mut txns: Vec<u64>) {
        txns.sort_unstable();
        txns.dedup();
        let live = self.txns.lock();
        txns.retain(|t| live.members.contains_key(t));
        drop(live);
        if !txns.is_empty() {
            let mut m = self.group_regions.lock();
            let v = m.entry(r).or_default();
            v.extend(txns);
            v.sort_unstable();
            v.dedup();
        }
    }

    fn reclaimed(&self, r: u32, removed: Vec<(ChunkId, Location)>, ram_seq: u64) {
        // Groups with an entry in the region lose a member, also where
        // that entry was not indexed (a member that left, written for its
        // group): the rest goes now, as a restart would undo it (the
        // region's indexed members break their groups below too).
        let groups = self.group_regions.lock().remove(&r).unwrap_or_default();
        for txn in groups {
            self.break_group(txn);
        }
        let obs = self.observer();
        // A chunk still in RAM and read since it got there lost only its
        // disk copy: it is marked dirty again ([`RamCache::mark_dirty`]), so
        // a flush or a stop writes it anew instead of a restart losing the
        // most used chunks. Not where RAM can hold as much as the disk: then
        // rewriting what RAM holds would reclaim more of it.
        let rewrite = self.disk.as_ref().is_some_and(|d| {
            rewrites_reclaimed(self.ram.budget(), d.region_size, u64::from(d.region_count))
        });
        let mut rewritten = 0u64;
        for (id, loc) in removed {
            if loc.txn != 0 {
                self.break_group(loc.txn);
            }
            if !self.ram.contains(&id) {
                self.counters.evicted_chunks.fetch_add(1, Ordering::Relaxed);
                if let Some(o) = &obs {
                    o.removed(&id);
                }
            } else if rewrite && self.ram.mark_dirty(&id, ram_seq) {
                rewritten += 1;
            }
        }
        if rewritten > 0 {
            self.counters
                .reclaimed_rewrites
                .fetch_add(rewritten, Ordering::Relaxed);
        }
    }

    fn tombstone_done(&self, id: &ChunkId, _at: Instant) {
        let mut c = self.cancel.lock();
        if let Some(e) = c.get_mut(id) {
            e.outstanding = e.outstanding.saturating_sub(1);
            if e.outstanding == 0 {
                c.remove(id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A store opened with `config` and one registered namespace.
    fn store_with_ns(config: TierConfig) -> (ChunkStore, Namespace) {
        let store = ChunkStore::open(config).unwrap();
        let ns = store
            .register_namespace(&NamespaceRecord {
                model: "m".into(),
                ..Default::default()
            })
            .unwrap();
        (store, ns)
    }

    /// With a RAM shard held by another thread, `lookup_prefix` probes the
    /// index first, lets its lock go, then waits for the shards: the answer
    /// is the same as when it overlaps both, and the disk index is never
    /// held while waiting (a writer of the index gets in meanwhile).
    #[test]
    fn lookup_prefix_with_a_busy_shard_releases_the_index_before_waiting() {
        let dir = tempfile::tempdir().unwrap();
        let (store, ns) = store_with_ns(TierConfig {
            data_dir: dir.path().to_path_buf(),
            ram_budget: 1 << 20,
            disk_budget: 16 << 20,
            region_size: 1 << 20,
            write_policy: WritePolicy::Backpressure,
            idle_flush_after: Duration::from_secs(3600),
            ..TierConfig::default()
        });
        let key = |n: u64| {
            let mut k = [0u8; 32];
            k[..8].copy_from_slice(&n.wrapping_mul(0x9e37_79b9_7f4a_7c15).to_le_bytes());
            k[8..16].copy_from_slice(&n.to_le_bytes());
            ChunkKey(k)
        };
        // 600 chunks of 4 KiB through 1 MiB of RAM: most on disk, the newest
        // in RAM; odd keys absent.
        for n in (0..1200).step_by(2) {
            store
                .put(
                    ChunkId::new(ns, key(n), 0),
                    Bytes::from(vec![n as u8; 4096]),
                )
                .unwrap();
        }
        store.flush().unwrap();
        let keys: Vec<ChunkKey> = (0..1200).map(key).collect();
        let mut free = Vec::new();
        store.lookup_prefix(ns, 0, &keys, &mut free);
        assert!(free.contains(&Some(Tier::Ram)) && free.contains(&Some(Tier::Disk)));
        let held = store.inner.ram.hold_shard(3);
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::scope(|s| {
            s.spawn(|| {
                let mut busy = Vec::new();
                store.lookup_prefix(ns, 0, &keys, &mut busy);
                tx.send(busy).unwrap();
            });
            // The lookup is waiting for shard 3: the index is free for a
            // writer (this would wait forever if the lookup held it).
            std::thread::sleep(Duration::from_millis(50));
            let d = store.inner.disk.as_ref().unwrap();
            let w = d.index.try_write_for(Duration::from_secs(5));
            assert!(
                w.is_some(),
                "the lookup kept the index's read lock while waiting"
            );
            drop(w);
            assert!(rx.try_recv().is_err(), "the lookup waited for the shard");
            drop(held);
        });
        assert_eq!(rx.recv().unwrap(), free);
    }

    /// A store whose RAM is full reuses the buffers of the chunks it drops
    /// (replaced or evicted) for new chunks copied in through its pool:
    /// after the first fill, large PUTs allocate nothing.
    #[test]
    fn new_chunks_reuse_the_buffers_of_dropped_ones() {
        let dir = tempfile::tempdir().unwrap();
        const LEN: usize = 4 << 20;
        let (store, ns) = store_with_ns(TierConfig {
            data_dir: dir.path().to_path_buf(),
            ram_budget: 8 * (LEN as u64 + crate::ram::ENTRY_COST),
            disk_budget: 0,
            ..TierConfig::default()
        });
        let id = |n: u8| ChunkId::new(ns, ChunkKey([n; 32]), 0);
        let src = vec![7u8; LEN];
        // Fill: 8 chunks, all fresh.
        for n in 0..8 {
            store.put(id(n), store.buffers().copy_of(&src)).unwrap();
        }
        let filled = store.buffers().stats();
        assert_eq!((filled.fresh, filled.reused), (8, 0));
        // Replacements, then evictions (new keys in a full RAM): every
        // chunk lands in a dropped one's buffer, except the first of all
        // (nothing dropped yet when it is copied).
        for round in 0..40u8 {
            let n = if round < 20 { round % 8 } else { 8 + round };
            let data = store.buffers().copy_of(&vec![round; LEN]);
            store.put(id(n), data).unwrap();
            assert_eq!(store.get(&id(n)).unwrap().data[..], vec![round; LEN][..]);
        }
        let after = store.buffers().stats();
        assert_eq!(after.fresh - filled.fresh, 1, "{after:?}");
        assert_eq!(after.reused, 39, "{after:?}");
        assert_eq!(after.buffers, 1, "{after:?}");
    }
}

/// Races between the writer, reads, deletes and flushes, staged on a
/// [`crate::testdev::HoldingDevice`], by holding a RAM shard's lock or a
/// device's fdatasync, or by calling the store's parts in a chosen order.
#[cfg(all(test, feature = "test_utils"))]
mod race_tests {
    use super::*;
    use crate::device::{DirectMode, FileDevice};
    use crate::testdev::HoldingDevice;
    use parking_lot::Condvar;

    const KIB: usize = 1024;
    const WAIT: Duration = Duration::from_secs(20);

    fn key(n: u64) -> ChunkKey {
        let mut k = [0u8; 32];
        k[..8].copy_from_slice(&n.wrapping_mul(0x9e37_79b9_7f4a_7c15).to_le_bytes());
        k[8..16].copy_from_slice(&n.to_le_bytes());
        ChunkKey(k)
    }

    fn data(n: u64, v: u8) -> Bytes {
        Bytes::from(vec![(n as u8).wrapping_mul(7) ^ v; 256 * KIB])
    }

    /// No idle flush during a test.
    const NO_IDLE: Duration = Duration::from_secs(3600);

    /// A store over `dev` (1 MiB of RAM for payloads, `region`-sized regions, the whole
    /// device as disk budget) with one namespace.
    fn open_on(
        dir: &std::path::Path,
        dev: Arc<dyn Device>,
        region: u64,
        idle: Duration,
    ) -> (ChunkStore, Namespace) {
        open_with(dir, dev, region, idle, |_| {})
    }

    /// [`open_on`] with the config changed by `tweak` first.
    fn open_with(
        dir: &std::path::Path,
        dev: Arc<dyn Device>,
        region: u64,
        idle: Duration,
        tweak: impl FnOnce(&mut TierConfig),
    ) -> (ChunkStore, Namespace) {
        let mut cfg = TierConfig {
            data_dir: dir.to_path_buf(),
            // Four 256 KiB chunks and the bookkeeping RAM charges per entry
            // (a few small ones too, never a fifth large one).
            ram_budget: (1 << 20) + 16 * crate::ram::ENTRY_COST,
            disk_budget: dev.len(),
            region_size: region,
            idle_flush_after: idle,
            direct_io: false,
            ..TierConfig::default()
        };
        tweak(&mut cfg);
        let s = ChunkStore::open_with_device(cfg, dev).unwrap();
        let ns = s
            .register_namespace(&NamespaceRecord {
                model: "m".into(),
                ..Default::default()
            })
            .unwrap();
        (s, ns)
    }

    /// A buffered file device of `len` bytes in `dir`.
    fn file(dir: &std::path::Path, len: u64) -> Arc<dyn Device> {
        Arc::new(FileDevice::open(&dir.join("dev"), len, DirectMode::Off, 0).unwrap())
    }

    /// [`open_on`] a 16 MiB file through a [`HoldingDevice`].
    fn setup(dir: &std::path::Path, idle: Duration) -> (ChunkStore, Namespace, Arc<HoldingDevice>) {
        let dev = Arc::new(HoldingDevice::new(file(dir, 16 << 20)));
        let (s, ns) = open_on(dir, dev.clone(), 1 << 20, idle);
        (s, ns, dev)
    }

    /// The RAM shard of `id` in a store's cache (16 shards: the low bits
    /// of the id's hash, as `RamCache::route` picks it).
    fn shard_of(id: &ChunkId) -> usize {
        (crate::index::hash_id(id) as u32 as usize) & (crate::ram::DEFAULT_SHARDS - 1)
    }

    /// Opens the first region (a chunk put, flushed and dropped from
    /// RAM), then puts four 256 KiB chunks, the first two `a` and `b` with
    /// `a` in a lower RAM shard, and evicts `a` then `b` (spilled) by two
    /// inserts whose evictions are returned, not handed off yet.
    fn two_spilled(
        s: &ChunkStore,
        ns: Namespace,
    ) -> (ChunkId, ChunkId, Vec<Evicted>, Vec<Evicted>) {
        let inner = &s.inner;
        let id = |n: u64| ChunkId::new(ns, key(n), 0);
        s.put(id(10_000), Bytes::from(vec![1u8; 4096])).unwrap();
        s.flush().unwrap();
        assert!(inner.ram.remove(&id(10_000)).is_some());
        let (an, bn) = (0..)
            .map(|n| (n, n + 1))
            .find(|&(a, b)| shard_of(&id(a)) < shard_of(&id(b)))
            .unwrap();
        let (a, b) = (id(an), id(bn));
        for n in [an, bn, 1000, 1001] {
            s.put(id(n), data(n, 1)).unwrap();
        }
        let (_, ev_a) = inner
            .ram
            .insert(id(1002), data(1002, 1), None, true)
            .unwrap();
        let (_, ev_b) = inner
            .ram
            .insert(id(1003), data(1003, 1), None, true)
            .unwrap();
        assert!(ev_a.len() == 1 && ev_a[0].id == a && ev_a[0].spilled);
        assert!(ev_b.len() == 1 && ev_b[0].id == b && ev_b[0].spilled);
        (a, b, ev_a, ev_b)
    }

    fn until(what: &str, mut f: impl FnMut() -> bool) {
        let deadline = Instant::now() + WAIT;
        while !f() {
            assert!(Instant::now() < deadline, "timed out: {what}");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// A chunk evicted dirty whose write fails (here ENOSPC on the first
    /// region's open, which pauses the writer) is lost as before the spill
    /// existed: its RAM copy goes too, counted as a write failure, and
    /// nothing spilled is left behind.
    #[test]
    fn a_failed_write_drops_the_spilled_copy() {
        let dir = tempfile::tempdir().unwrap();
        let inner: Arc<dyn crate::device::Device> =
            Arc::new(crate::testdev::CrashDevice::new(16 << 20));
        let dev = Arc::new(crate::testdev::FaultyDevice::new(inner));
        let (s, ns) = open_on(dir.path(), dev.clone(), 1 << 20, NO_IDLE);
        let id = |n: u64| ChunkId::new(ns, key(n), 0);
        dev.fail_writes_after(0, libc::ENOSPC);
        for n in 0..=4 {
            s.put(id(n), data(n, 1)).unwrap();
        }
        until("the write failed", || s.stats().disk_write_failures >= 1);
        until("nothing spilled", || s.inner.ram.spilled_len() == 0);
        assert!(s.get(&id(0)).is_none(), "the evicted chunk is lost");
        assert_eq!(s.locate(&id(0)), None);
        for n in 1..=4 {
            assert_eq!(s.get(&id(n)).unwrap().data, data(n, 1));
        }
        // Counted once as lost; the dirty chunks still in RAM whose flush
        // fails are failed attempts, not losses.
        assert_eq!(s.stats().lost_writes, 1);
        let failures = s.stats().disk_write_failures;
        let _ = s.flush();
        let _ = s.flush();
        assert!(s.stats().disk_write_failures > failures);
        assert_eq!(s.stats().lost_writes, 1);
        for n in 1..=4 {
            assert_eq!(s.get(&id(n)).unwrap().data, data(n, 1));
        }
    }

    /// A delete racing a write in flight: the writer, holding the index's
    /// lock, finds the job cancelled and never indexes it, so no read after
    /// the delete finds (and caches) the deleted chunk. Here the writer is
    /// held on the cancellation map while a get runs.
    #[test]
    fn a_delete_during_its_write_never_shows_the_chunk_again() {
        let dir = tempfile::tempdir().unwrap();
        let (s, ns, dev) = setup(dir.path(), Duration::from_secs(3600));
        let id = |n: u64| ChunkId::new(ns, key(n), 0);
        s.put(id(100), Bytes::from(vec![1u8; 4096])).unwrap();
        s.flush().unwrap();
        dev.hold_writes();
        for n in 0..=4 {
            s.put(id(n), data(n, 1)).unwrap();
        }
        assert!(dev.wait_held(1, WAIT));
        assert_eq!(s.inner.ram.spilled_len(), 1);
        assert!(s.delete(&id(0)));
        // The delete returned. Hold the writer where it asks whether the
        // job was cancelled (under the index's write lock).
        let guard = s.inner.cancel.lock();
        dev.release();
        let busy = || s.inner.disk.as_ref().unwrap().index.try_read().is_none();
        until("the writer holds the index", busy);
        let during = std::thread::scope(|scope| {
            let get = scope.spawn(|| s.get(&id(0)).map(|h| h.tier));
            std::thread::sleep(Duration::from_millis(50));
            drop(guard);
            get.join().unwrap()
        });
        s.flush().unwrap();
        let after = s.get(&id(0)).map(|h| h.tier);
        assert_eq!(
            (during, after, s.locate(&id(0))),
            (None, None, None),
            "a chunk deleted before the get started is read (and cached)"
        );
    }

    /// `verify --repair` re-inserts the RAM copy of a chunk whose disk
    /// copy is bad; what that insert evicts goes to the writer like any
    /// eviction (it was dropped: a spilled entry never written or
    /// unspilled).
    #[test]
    fn verify_repair_hands_what_it_evicts_to_the_writer() {
        let dir = tempfile::tempdir().unwrap();
        let (s, ns, dev) = setup(dir.path(), Duration::from_secs(3600));
        let id = |n: u64| ChunkId::new(ns, key(n), 0);
        s.put(id(0), data(0, 1)).unwrap();
        s.flush().unwrap();
        // Corrupt the disk copy's payload.
        let (_, off, _) = s.disk_location(&id(0)).unwrap();
        let hl = s.disk_header_len(&id(0)).unwrap() as u64;
        {
            use std::os::unix::fs::FileExt;
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(dir.path().join("dev"))
                .unwrap();
            let mut b = [0u8; 1];
            f.read_exact_at(&mut b, off + hl + 1000).unwrap();
            b[0] ^= 0xff;
            f.write_all_at(&b, off + hl + 1000).unwrap();
        }
        // A newer version in RAM over the bad one indexed (a put's window
        // before its `supersede`; inserted directly to keep it open).
        s.inner.ram.insert(id(0), data(0, 2), None, true).unwrap();
        dev.hold_writes();
        let held = Released(&dev);
        for n in 1..=4 {
            s.put(id(n), data(n, 1)).unwrap();
        }
        assert!(dev.wait_held(1, WAIT));
        assert_eq!(s.inner.ram.spilled_len(), 1, "chunk 0 (v2) spilled");
        let r = s
            .verify(&VerifyOptions { repair: true }, &mut |_, _| {})
            .unwrap();
        assert_eq!(r.dropped, 1);
        drop(held);
        s.flush().unwrap();
        let leaked: Vec<u64> = (0..=4)
            .filter(|&n| {
                s.inner.ram.peek(&id(n)).is_none() && s.inner.ram.peek_any(&id(n)).is_some()
            })
            .collect();
        assert_eq!(
            (
                s.inner.ram.spilled_len(),
                leaked,
                s.disk_location(&id(1)).is_some()
            ),
            (0, vec![], true),
            "after a flush, a spilled entry remains that was never handed to the writer"
        );
    }

    /// An eviction's hand-off delayed past a newer version's put and
    /// write: the older version's job is skipped (its spilled entry is
    /// gone), so it never overwrites the newer one on disk.
    #[test]
    fn a_late_hand_off_of_an_older_version_never_wins_on_disk() {
        let dir = tempfile::tempdir().unwrap();
        let (s, ns, _dev) = setup(dir.path(), Duration::from_secs(3600));
        let inner = &s.inner;
        let id = |n: u64| ChunkId::new(ns, key(n), 0);
        let x = id(0);
        s.put(x, data(0, 1)).unwrap();
        for n in 1..=3 {
            s.put(id(n), data(n, 1)).unwrap();
        }
        // A put of chunk 4 evicts x (v1), preempted before its hand-off.
        let (_, held) = inner.ram.insert(id(4), data(4, 1), None, true).unwrap();
        assert_eq!(held.len(), 1);
        assert!(held[0].id == x && held[0].spilled);
        s.put(x, data(0, 2)).unwrap();
        s.flush().unwrap();
        for n in 5..=9 {
            s.put(id(n), data(n, 1)).unwrap();
        }
        s.flush().unwrap();
        assert!(inner.ram.peek_any(&x).is_none(), "v2 is on disk only");
        assert!(s.disk_location(&x).is_some());
        // The preempted put resumes.
        inner.handle_evicted(held);
        s.flush().unwrap();
        assert_eq!(
            s.get(&x).unwrap().data[0],
            data(0, 2)[0],
            "v1 read after v2 was put and flushed"
        );
    }

    /// Two jobs of one version in different batches in flight (two idle
    /// passes): the first marks it clean; the second stays indexed (only a
    /// cancellation keeps a written job out of the index), so the chunk,
    /// clean in RAM, is on disk.
    #[test]
    fn a_second_write_of_a_version_keeps_it_indexed() {
        let dir = tempfile::tempdir().unwrap();
        let (s, ns, dev) = setup(dir.path(), Duration::from_millis(1));
        let id = |n: u64| ChunkId::new(ns, key(n), 0);
        s.put(id(100), Bytes::from(vec![1u8; 4096])).unwrap();
        s.flush().unwrap();
        let x = id(0);
        dev.hold_writes();
        s.put(x, data(0, 1)).unwrap();
        std::thread::sleep(Duration::from_millis(5));
        // An idle pass queues x; its write is held (in flight) ...
        s.idle_tick();
        assert!(dev.wait_held(1, WAIT));
        // ... and the next idle pass (the queue is empty) queues x again.
        s.idle_tick();
        until("the writer took the second job", || {
            s.stats().writer_queue_depth == 0
        });
        std::thread::sleep(Duration::from_millis(200));
        dev.release();
        s.flush().unwrap();
        assert_eq!(s.stats().dirty_bytes, 0, "x is clean in RAM");
        assert!(
            s.disk_location(&x).is_some(),
            "x is clean in RAM but not on disk"
        );
    }

    /// A delete held before its RAM removal (by the chunk's shard lock)
    /// keeps its cancellation: the tombstone that lets the writer prune it
    /// is sent only after the RAM copy is gone (else a job made from that
    /// copy meanwhile, by a flush, an idle pass or an eviction, would be
    /// indexed and the deleted chunk read back from disk).
    #[test]
    fn a_delete_keeps_its_cancellation_until_its_ram_copy_is_gone() {
        let dir = tempfile::tempdir().unwrap();
        let (s, ns) = open_on(dir.path(), file(dir.path(), 16 << 20), 1 << 20, NO_IDLE);
        let inner = &s.inner;
        let x = ChunkId::new(ns, key(0), 0);
        s.put(x, data(0, 1)).unwrap();
        s.flush().unwrap();
        // A dirty version in RAM with an older one indexed (a put's window
        // before its `supersede`; inserted directly to keep it open).
        inner.ram.insert(x, data(0, 2), None, true).unwrap();
        assert!(s.disk_location(&x).is_some());
        let held = inner.ram.hold_shard(shard_of(&x));
        std::thread::scope(|scope| {
            let del = scope.spawn(|| s.delete(&x));
            until("the delete removed x from the index", || {
                s.disk_location(&x).is_none()
            });
            let deadline = Instant::now() + Duration::from_millis(500);
            let mut pruned = false;
            while !pruned && Instant::now() < deadline {
                pruned = s.cancelled_writes() == 0;
                std::thread::sleep(Duration::from_millis(1));
            }
            // (x's shard is held: the delete waits in its RAM removal.)
            drop(held);
            assert!(del.join().unwrap());
            assert!(
                !pruned,
                "the delete's cancellation was pruned while x's RAM copy was still there"
            );
        });
    }

    /// A chunk resident and dirty at a flush's call, evicted while the
    /// flush walks the dirty entries (held here at a lower shard) and
    /// handed to the writer only after the flush's marker, is still made
    /// durable by that flush: the spilled entries are listed after the
    /// dirty ones, so it is in one list or the other.
    #[test]
    fn flush_covers_a_chunk_evicted_between_its_two_walks() {
        let dir = tempfile::tempdir().unwrap();
        let (s, ns) = open_on(dir.path(), file(dir.path(), 16 << 20), 1 << 20, NO_IDLE);
        let inner = &s.inner;
        let id = |n: u64| ChunkId::new(ns, key(n), 0);
        // x (the LRU, evicted by n) in a shard above 0; the walk is held at
        // shard 0 (n's shard is another one).
        let xn = (0..).find(|&n| shard_of(&id(n)) >= 2).unwrap();
        let x = id(xn);
        let nn = (100..).find(|&n| shard_of(&id(n)) != 0).unwrap();
        s.put(x, data(xn, 1)).unwrap();
        for n in 1000..1003 {
            s.put(id(n), data(n, 1)).unwrap();
        }
        assert_eq!(inner.ram.spilled_len(), 0);
        let held = inner.ram.hold_shard(0);
        std::thread::scope(|scope| {
            let flush = scope.spawn(|| s.flush().unwrap());
            // The flush waits for shard 0 in its dirty walk (its spilled
            // walk comes next).
            std::thread::sleep(Duration::from_millis(200));
            // A put evicts x (dirty at the flush's call): spilled, its
            // hand-off not done yet.
            let (_, ev) = inner.ram.insert(id(nn), data(nn, 1), None, true).unwrap();
            assert_eq!(ev.len(), 1);
            assert!(ev[0].id == x && ev[0].spilled);
            drop(held);
            let report = flush.join().unwrap();
            let on_disk = s.disk_location(&x).is_some();
            // The put resumes.
            inner.handle_evicted(ev);
            assert!(
                on_disk,
                "flush returned; x, dirty at its call, was never written: {report:?}"
            );
        });
    }

    /// A device whose syncs can be held; it keeps the writes not yet
    /// covered by a completed sync.
    struct SyncGate {
        inner: Arc<dyn Device>,
        st: Mutex<GateState>,
        cv: Condvar,
    }

    #[derive(Default)]
    struct GateState {
        hold: bool,
        waiting: usize,
        releases: u64,
        unsynced: Vec<(u64, u64)>,
    }

    impl SyncGate {
        fn hold(&self) {
            self.st.lock().hold = true;
        }
        fn waiting(&self) -> usize {
            self.st.lock().waiting
        }
        fn release(&self) {
            let mut s = self.st.lock();
            s.hold = false;
            s.releases += 1;
            self.cv.notify_all();
        }
        fn unsynced_at(&self, off: u64) -> bool {
            self.st
                .lock()
                .unsynced
                .iter()
                .any(|&(o, l)| o <= off && off < o + l)
        }
    }

    impl Device for SyncGate {
        fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
            self.inner.read_at(buf, offset)
        }
        fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
            self.inner.write_at(buf, offset)?;
            self.st.lock().unsynced.push((offset, buf.len() as u64));
            Ok(())
        }
        fn sync(&self) -> std::io::Result<()> {
            let n = {
                let mut s = self.st.lock();
                if s.hold {
                    let at = s.releases;
                    s.waiting += 1;
                    while s.releases == at {
                        self.cv.wait(&mut s);
                    }
                    s.waiting -= 1;
                }
                s.unsynced.len()
            };
            self.inner.sync()?;
            self.st.lock().unsynced.drain(..n);
            Ok(())
        }
        fn len(&self) -> u64 {
            self.inner.len()
        }
        fn direct_io(&self) -> bool {
            false
        }
        fn path(&self) -> &std::path::Path {
            self.inner.path()
        }
    }

    /// An eviction's write handed to the writer after a flush's first
    /// marker and written before the flush checks its entry (so no longer
    /// spilled) is synced by a second marker before the flush returns.
    /// Staged: the first marker's fdatasync is held while the eviction's
    /// job is handed off; the flush thread is held (by a shard lock) on an
    /// earlier entry of its list while the writer writes that job.
    #[test]
    fn flush_syncs_an_eviction_write_that_landed_after_its_first_marker() {
        let dir = tempfile::tempdir().unwrap();
        let gate = Arc::new(SyncGate {
            inner: file(dir.path(), 32 << 20),
            st: Mutex::new(GateState::default()),
            cv: Condvar::new(),
        });
        let (s, ns) = open_on(dir.path(), gate.clone(), 4 << 20, NO_IDLE);
        let inner = &s.inner;
        // y and x, the first two put (evicted first), y in a lower shard;
        // two puts evict y then x, both preempted before their hand-offs.
        let (y, x, ev_y, ev_x) = two_spilled(&s, ns);
        gate.hold();
        std::thread::scope(|scope| {
            let flush = scope.spawn(|| s.flush().unwrap());
            until("the first marker's fdatasync", || gate.waiting() == 1);
            // Past the first marker: y is put again (a new version over
            // its spilled one), x's hand-off goes through.
            s.put(y, Bytes::from(vec![2u8; 4096])).unwrap();
            let held = inner.ram.hold_shard(shard_of(&y));
            inner.handle_evicted(ev_x);
            gate.release();
            until("x written and unspilled", || {
                s.disk_location(&x).is_some() && inner.ram.peek_any(&x).is_none()
            });
            drop(held);
            let report = flush.join().unwrap();
            let (_, off, _) = s.disk_location(&x).unwrap();
            assert!(
                !gate.unsynced_at(off),
                "flush returned; x (dirty at its call) was written after its last fdatasync: {report:?}"
            );
        });
        drop(ev_y);
    }

    /// `delete_inner`'s steps, in its order, with a put of the id landing
    /// in the delete's window (after its cancellation, before its RAM
    /// removal) and written, by a flush or an eviction, before the
    /// tombstone reaches the writer: that put comes after the delete. It
    /// stays in RAM, its write is indexed, the tombstone is not written
    /// (its record would follow the put's and delete it at recovery), and
    /// it is there after a restart.
    fn a_put_after_a_delete_survives_its_tombstone(evict: bool) {
        let dir = tempfile::tempdir().unwrap();
        let dev = file(dir.path(), 16 << 20);
        let (s, ns) = open_on(dir.path(), dev.clone(), 1 << 20, NO_IDLE);
        let inner = &s.inner;
        let x = ChunkId::new(ns, key(0), 0);
        s.put(x, data(0, 1)).unwrap();
        s.flush().unwrap();
        // 1, 2: the cancellation and the index.
        let t = cancel_now(&mut inner.cancel.lock(), x);
        let d = inner.disk.as_ref().unwrap();
        assert!(d.index.write().remove(&x).is_some());
        // The put lands.
        s.put(x, data(0, 2)).unwrap();
        // 3: RAM, versions stamped before the cancellation only.
        assert!(inner.ram.remove_if(&x, |e| e.inserted <= t).is_none());
        // The put is written before the tombstone.
        if evict {
            for n in 100..104 {
                s.put(ChunkId::new(ns, key(n), 0), data(n, 1)).unwrap();
            }
            until("x written and unspilled", || {
                s.disk_location(&x).is_some() && inner.ram.peek_any(&x).is_none()
            });
        } else {
            s.flush().unwrap();
        }
        // 4: the tombstone.
        inner.send(Msg::Tombstone(x, t)).unwrap();
        s.flush().unwrap();
        assert!(
            s.disk_location(&x).is_some(),
            "the tombstone took the newer put out of the index"
        );
        assert_eq!(s.get(&x).unwrap().data, data(0, 2));
        assert_eq!(
            s.cancelled_writes(),
            0,
            "the skipped tombstone's cancellation is forgotten"
        );
        s.close(WAIT).unwrap();
        drop(s);
        let (s, _) = open_on(dir.path(), dev, 1 << 20, NO_IDLE);
        assert_eq!(
            s.get(&x).map(|h| h.data),
            Some(data(0, 2)),
            "the tombstone's record deleted the newer put at recovery"
        );
    }

    #[test]
    fn a_put_after_a_delete_survives_its_tombstone_through_a_flush() {
        a_put_after_a_delete_survives_its_tombstone(false);
    }

    #[test]
    fn a_put_after_a_delete_survives_its_tombstone_through_an_eviction() {
        a_put_after_a_delete_survives_its_tombstone(true);
    }

    /// Two deletes, both before sending their tombstones, then a put
    /// written before both: neither tombstone is written (each would delete
    /// the put at recovery), and the put survives a restart.
    #[test]
    fn a_put_after_two_deletes_survives_both_tombstones() {
        let dir = tempfile::tempdir().unwrap();
        let dev = file(dir.path(), 16 << 20);
        let (s, ns) = open_on(dir.path(), dev.clone(), 1 << 20, NO_IDLE);
        let inner = &s.inner;
        let x = ChunkId::new(ns, key(0), 0);
        s.put(x, data(0, 1)).unwrap();
        s.flush().unwrap();
        let d = inner.disk.as_ref().unwrap();
        let t1 = cancel_now(&mut inner.cancel.lock(), x);
        d.index.write().remove(&x);
        inner.ram.remove_if(&x, |e| e.inserted <= t1);
        let t2 = cancel_now(&mut inner.cancel.lock(), x);
        d.index.write().remove(&x);
        inner.ram.remove_if(&x, |e| e.inserted <= t2);
        s.put(x, data(0, 3)).unwrap();
        s.flush().unwrap();
        inner.send(Msg::Tombstone(x, t1)).unwrap();
        s.flush().unwrap();
        inner.send(Msg::Tombstone(x, t2)).unwrap();
        s.flush().unwrap();
        assert_eq!(s.get(&x).unwrap().data[0], data(0, 3)[0]);
        s.close(WAIT).unwrap();
        drop(s);
        let (s, _) = open_on(dir.path(), dev, 1 << 20, NO_IDLE);
        assert_eq!(
            s.get(&x).map(|h| h.data[0]),
            Some(data(0, 3)[0]),
            "v3 lost at recovery"
        );
    }

    /// A version put after a delete whose write fails (ENOSPC) does not
    /// stand in for the delete's tombstone: the tombstone is written, so a
    /// crash before the put is rewritten never brings the deleted version
    /// back.
    #[test]
    fn a_failed_newer_write_leaves_the_tombstone_written() {
        let dir = tempfile::tempdir().unwrap();
        let faulty = Arc::new(crate::testdev::FaultyDevice::new(file(
            dir.path(),
            16 << 20,
        )));
        let (s, ns) = open_on(dir.path(), faulty.clone(), 1 << 20, NO_IDLE);
        let inner = &s.inner;
        let x = ChunkId::new(ns, key(0), 0);
        s.put(x, data(0, 1)).unwrap();
        s.flush().unwrap();
        let d = inner.disk.as_ref().unwrap();
        let t = cancel_now(&mut inner.cancel.lock(), x);
        assert!(d.index.write().remove(&x).is_some());
        s.put(x, data(0, 2)).unwrap();
        assert!(inner.ram.remove_if(&x, |e| e.inserted <= t).is_none());
        faulty.fail_writes_after(0, libc::ENOSPC);
        let r = s.flush().unwrap();
        assert_eq!((r.chunks, r.failed), (0, 1), "the put's write failed");
        faulty.heal();
        inner.send(Msg::Tombstone(x, t)).unwrap();
        until("the cancellation pruned", || s.cancelled_writes() == 0);
        std::thread::sleep(Duration::from_millis(200));
        drop(s); // crash: no close
        let (s, _) = open_on(dir.path(), file(dir.path(), 16 << 20), 1 << 20, NO_IDLE);
        assert_eq!(
            s.get(&x).map(|h| h.data[0]),
            None,
            "the deleted v1 came back"
        );
    }

    /// Two deletes whose tombstones reach the writer out of order (the
    /// first delete is preempted before sending its own): the later one's
    /// tombstone does not end the cancellation the earlier one's still
    /// needs, so a put written between the two tombstones is known as newer
    /// and the earlier tombstone is not written after it.
    #[test]
    fn a_put_between_two_deletes_tombstones_out_of_order_survives() {
        let dir = tempfile::tempdir().unwrap();
        let dev = file(dir.path(), 16 << 20);
        let (s, ns) = open_on(dir.path(), dev.clone(), 1 << 20, NO_IDLE);
        let inner = &s.inner;
        let x = ChunkId::new(ns, key(0), 0);
        s.put(x, data(0, 1)).unwrap();
        s.flush().unwrap();
        let d = inner.disk.as_ref().unwrap();
        // Delete A: steps 1-3, then preempted.
        let ta = {
            let mut ix = d.index.write();
            let t = cancel_now(&mut inner.cancel.lock(), x);
            ix.remove(&x);
            t
        };
        inner.ram.remove_if(&x, |e| e.inserted <= ta);
        // Delete B, whole.
        assert!(!inner.delete_inner(&x, false));
        s.flush().unwrap();
        assert_eq!(s.cancelled_writes(), 1, "A's tombstone is still to come");
        // A put after both, written.
        s.put(x, data(0, 3)).unwrap();
        s.flush().unwrap();
        // A resumes.
        inner.send(Msg::Tombstone(x, ta)).unwrap();
        s.flush().unwrap();
        assert_eq!(s.cancelled_writes(), 0);
        s.close(WAIT).unwrap();
        drop(s);
        let (s, _) = open_on(dir.path(), dev, 1 << 20, NO_IDLE);
        assert_eq!(
            s.get(&x).map(|h| h.data),
            Some(data(0, 3)),
            "the earlier delete's tombstone deleted the later put at recovery"
        );
    }

    /// A tombstone that reaches the writer while a newer version of its id
    /// is still being written waits for that write, then is not written
    /// (the put survives a restart). The newer version's write is held on
    /// the device while the tombstone arrives.
    #[test]
    fn a_tombstone_waits_for_a_newer_write_in_flight() {
        let dir = tempfile::tempdir().unwrap();
        let (s, ns, dev) = setup(dir.path(), NO_IDLE);
        let inner = &s.inner;
        let x = ChunkId::new(ns, key(0), 0);
        s.put(x, data(0, 1)).unwrap();
        s.flush().unwrap();
        let d = inner.disk.as_ref().unwrap();
        let t = {
            let mut ix = d.index.write();
            let t = cancel_now(&mut inner.cancel.lock(), x);
            ix.remove(&x);
            t
        };
        s.put(x, data(0, 2)).unwrap();
        assert!(inner.ram.remove_if(&x, |e| e.inserted <= t).is_none());
        // Evicted (no flush: a flush marker would make the writer wait for
        // the write before it reads the tombstone).
        dev.hold_writes();
        for n in 100..104 {
            s.put(ChunkId::new(ns, key(n), 0), data(n, 1)).unwrap();
        }
        assert!(dev.wait_held(1, WAIT), "the put's write reached the device");
        inner.send(Msg::Tombstone(x, t)).unwrap();
        // Give the writer time to take the tombstone (it then waits).
        std::thread::sleep(Duration::from_millis(100));
        dev.release();
        s.flush().unwrap();
        assert_eq!(s.cancelled_writes(), 0);
        s.close(WAIT).unwrap();
        drop(s);
        let (s, _) = open_on(dir.path(), dev, 1 << 20, NO_IDLE);
        assert_eq!(
            s.get(&x).map(|h| h.data),
            Some(data(0, 2)),
            "the tombstone was written after the put's record"
        );
    }

    /// Releases a [`HoldingDevice`] when dropped (also when a test fails:
    /// the store's threads would wait on it forever).
    struct Released<'a>(&'a HoldingDevice);

    impl Drop for Released<'_> {
        fn drop(&mut self) {
            self.0.release();
        }
    }

    /// [`setup`] with a writer queue of one job (no idle flush), for
    /// [`jam_writer`].
    fn setup_queue_of_one(dir: &std::path::Path) -> (ChunkStore, Namespace, Arc<HoldingDevice>) {
        let dev = Arc::new(HoldingDevice::new(file(dir, 16 << 20)));
        let (s, ns) = open_with(dir, dev.clone(), 1 << 20, NO_IDLE, |c| {
            c.writer_queue = 1;
            // Hand-offs past the queue wait beside it up to this many bytes
            // of spilled chunks (one always may): none.
            c.spill_limit = Some(1);
        });
        (s, ns, dev)
    }

    /// Holds the writer of a store on `dev` in a write of `x` (whose first
    /// version was flushed, so a region is open) with a forget queued
    /// behind it: what is sent next is taken in one pass once the returned
    /// guard lets the write go.
    fn hold_writer_in<'a>(
        s: &ChunkStore,
        ns: Namespace,
        dev: &'a HoldingDevice,
        x: ChunkId,
    ) -> Released<'a> {
        s.put(x, Bytes::from(vec![2u8; 4096])).unwrap();
        dev.hold_writes();
        let held = Released(dev);
        let e = s.inner.ram.peek(&x).unwrap();
        s.inner
            .send(Msg::Write(s.inner.write_job(x, e, Held::Resident, None)))
            .unwrap();
        assert!(dev.wait_held(1, WAIT));
        s.inner
            .send(Msg::Forget(ChunkId::new(ns, key(60), 0), Instant::now(), 0))
            .unwrap();
        held
    }

    /// Fills the writer's queue of a store whose writes are held on its
    /// device (the writer waits in one write, the queue of one is full):
    /// puts 256 KiB fillers from key `from` until a dirty eviction is
    /// dropped unwritten. Returns the next free filler key.
    fn jam_writer(s: &ChunkStore, ns: Namespace, dev: &HoldingDevice, from: u64) -> u64 {
        let dropped = s.stats().dropped_unwritten;
        let mut n = from;
        while s.stats().dropped_unwritten == dropped {
            assert!(n < from + 64, "no eviction was dropped");
            s.put(ChunkId::new(ns, key(n), 0), data(n, 9)).unwrap();
            n += 1;
            if n == from + 5 {
                assert!(dev.wait_held(1, WAIT), "the writer is in a write");
            }
        }
        n
    }

    /// With a write held in flight, puts fillers from key 100 until a
    /// dirty eviction is dropped unwritten, reading `x` after each so that
    /// it stays most recently used. Returns the next free filler key.
    fn jam_keeping(s: &ChunkStore, ns: Namespace, x: &ChunkId) -> u64 {
        let dropped = s.stats().dropped_unwritten;
        let mut n = 100;
        while s.stats().dropped_unwritten == dropped {
            assert!(n < 164, "nothing dropped");
            s.put(ChunkId::new(ns, key(n), 0), data(n, 9)).unwrap();
            assert!(s.get(x).is_some());
            n += 1;
        }
        n
    }

    /// Puts fillers from key `from` until `id` is evicted and dropped
    /// unwritten (the writer jammed by [`jam_writer`]).
    fn drop_unwritten(s: &ChunkStore, ns: Namespace, id: &ChunkId, from: u64) {
        let dropped = s.stats().dropped_unwritten;
        let mut n = from;
        while s.inner.ram.peek_any(id).is_some() {
            assert!(n < from + 8, "{id:?} was never evicted");
            s.put(ChunkId::new(ns, key(n), 0), data(n, 9)).unwrap();
            n += 1;
        }
        assert!(s.stats().dropped_unwritten > dropped, "nothing dropped");
    }

    /// Cancellations whose forgets find the writer's queue full wait as one
    /// entry per id, however many pile up, and each is pruned once sent.
    #[test]
    fn forgets_that_find_the_queue_full_are_coalesced_per_id() {
        let dir = tempfile::tempdir().unwrap();
        let (s, ns, dev) = setup_queue_of_one(dir.path());
        dev.hold_writes();
        let held = Released(&dev);
        jam_writer(&s, ns, &dev, 100);
        let (x, y) = (ChunkId::new(ns, key(0), 0), ChunkId::new(ns, key(1), 0));
        // The queue of one takes a first forget (the jam's drops left it
        // empty: hand-offs past it wait beside it).
        let z = ChunkId::new(ns, key(2), 0);
        let at = cancel_now(&mut s.inner.cancel.lock(), z);
        s.inner.forget_cancel(z, at);
        assert_eq!(s.inner.tx.as_ref().unwrap().len(), 1, "the queue is full");
        for _ in 0..1000 {
            for id in [x, y] {
                let at = cancel_now(&mut s.inner.cancel.lock(), id);
                s.inner.forget_cancel(id, at);
            }
        }
        {
            let later = s.inner.forget_later.lock();
            assert_eq!(later.len(), 2, "one entry per id");
            assert!(later.values().all(|&(_, n)| n == 1000), "{later:?}");
        }
        drop(held);
        s.flush().unwrap();
        assert!(s.inner.forget_later.lock().is_empty());
        assert_eq!(s.cancelled_writes(), 0, "every cancellation is pruned");
    }

    /// An eviction's job waiting beside a full queue never overtakes a
    /// message sent before it: here a flush's job of the older version,
    /// queued behind a flush marker; the newer version must be the one on
    /// disk after a clean restart (review: the older one was).
    #[test]
    fn a_handoff_beside_the_queue_never_overtakes_an_older_flush_job() {
        let dir = tempfile::tempdir().unwrap();
        let dev = Arc::new(HoldingDevice::new(file(dir.path(), 16 << 20)));
        let (s, ns) = open_with(dir.path(), dev.clone(), 1 << 20, NO_IDLE, |c| {
            c.writer_queue = 2;
        });
        let s = Arc::new(s);
        let x = ChunkId::new(ns, key(0), 0);
        s.put(x, data(0, 1)).unwrap();
        dev.hold_writes();
        let held = Released(&dev);
        // The writer busy with a held write of x; a job alone, not a flush,
        // whose marker could stay queued beside t2's under load (CI once
        // saw both queued, the queue never at exactly one).
        let e = s.inner.ram.peek(&x).unwrap();
        s.inner
            .send(Msg::Write(s.inner.write_job(x, e, Held::Resident, None)))
            .unwrap();
        assert!(dev.wait_held(1, WAIT));
        let t2 = {
            let s = s.clone();
            std::thread::spawn(move || s.inner.flush_marker(None))
        };
        until("marker queued", || s.inner.tx.as_ref().unwrap().len() == 1);
        let t3 = {
            let s = s.clone();
            std::thread::spawn(move || s.flush().map(|_| ()))
        };
        until("queue full", || s.inner.tx.as_ref().unwrap().len() == 2);
        s.put(x, data(0, 2)).unwrap();
        let mut n = 100;
        while s.inner.ram.peek(&x).is_some() {
            assert!(n < 200, "x was never evicted");
            s.put(ChunkId::new(ns, key(n), 0), data(n, 9)).unwrap();
            n += 1;
        }
        assert!(!s.inner.overflow.lock().as_ref().unwrap().is_empty());
        drop(held);
        t3.join().unwrap().unwrap();
        t2.join().unwrap().unwrap();
        s.flush().unwrap();
        assert_eq!(s.get(&x).map(|h| h.data[0]), Some(data(0, 2)[0]));
        let s = Arc::try_unwrap(s).ok().unwrap();
        s.close(WAIT).unwrap();
        drop(s);
        let (s, _) = open_on(dir.path(), dev, 1 << 20, NO_IDLE);
        assert_eq!(
            s.get(&x).map(|h| h.data[0]),
            Some(data(0, 2)[0]),
            "after a clean restart the newer version is served"
        );
    }

    /// Jobs waiting beside the queue count against `spill_limit` in full,
    /// also once overwrites replaced their spilled copies (review: 94 MiB
    /// waited there with a 512 KiB limit).
    #[test]
    fn handoffs_beside_the_queue_are_bounded_by_spill_limit() {
        let dir = tempfile::tempdir().unwrap();
        let dev = Arc::new(HoldingDevice::new(file(dir.path(), 16 << 20)));
        let (s, ns) = open_with(dir.path(), dev.clone(), 1 << 20, NO_IDLE, |c| {
            c.writer_queue = 1;
            c.spill_limit = Some(512 << 10);
        });
        dev.hold_writes();
        let held = Released(&dev);
        let mut most = 0;
        for i in 0..400u64 {
            let k = i % 5;
            s.put(ChunkId::new(ns, key(k), 0), data(k, i as u8))
                .unwrap();
            let waiting: usize = s
                .inner
                .overflow
                .lock()
                .as_ref()
                .unwrap()
                .iter()
                .map(|j| j.data.len())
                .sum();
            most = most.max(waiting);
        }
        drop(held);
        s.flush().unwrap();
        assert!(most <= 1 << 20, "{most} bytes waited beside the queue");
        assert!(s.stats().dropped_unwritten > 0);
    }

    /// A chunk on disk, overwritten by a put whose version is then dropped
    /// unwritten (no-tax, the writer's queue full): the older version on
    /// disk is no longer served as current. A read misses; after a restart
    /// (nothing newer was ever written) the older version is back.
    #[test]
    fn an_overwrite_dropped_unwritten_never_serves_the_older_version() {
        let dir = tempfile::tempdir().unwrap();
        let (s, ns, dev) = setup_queue_of_one(dir.path());
        let x = ChunkId::new(ns, key(0), 0);
        s.put(x, data(0, 1)).unwrap();
        s.flush().unwrap();
        dev.hold_writes();
        let held = Released(&dev);
        let next = jam_writer(&s, ns, &dev, 100);
        s.put(x, data(0, 2)).unwrap();
        drop_unwritten(&s, ns, &x, next);
        assert_eq!(
            (s.get(&x).map(|h| h.data[0]), s.locate(&x)),
            (None, None),
            "the version before the lost overwrite is served as current"
        );
        drop(held);
        s.flush().unwrap();
        assert_eq!(s.get(&x).map(|h| h.data[0]), None);
        assert_eq!(s.cancelled_writes(), 0, "the cancellation is pruned");
        s.close(WAIT).unwrap();
        drop(s);
        let (s, _) = open_on(dir.path(), dev, 1 << 20, NO_IDLE);
        assert_eq!(s.get(&x).map(|h| h.data[0]), Some(data(0, 1)[0]));
    }

    /// An older version's write in flight when a newer version is put and
    /// then dropped unwritten: the older one, written after the drop, is
    /// not indexed (it would be served as current).
    #[test]
    fn an_older_write_landing_after_a_lost_overwrite_is_not_indexed() {
        let dir = tempfile::tempdir().unwrap();
        let (s, ns, dev) = setup_queue_of_one(dir.path());
        let x = ChunkId::new(ns, key(0), 0);
        s.put(x, data(0, 1)).unwrap();
        dev.hold_writes();
        let held = Released(&dev);
        // x's first version is evicted first: its write is the one held.
        let next = jam_writer(&s, ns, &dev, 100);
        assert!(
            s.inner.ram.peek(&x).is_none() && s.inner.ram.peek_any(&x).is_some(),
            "x's first version is spilled, its write held"
        );
        s.put(x, data(0, 2)).unwrap();
        drop_unwritten(&s, ns, &x, next);
        assert_eq!(s.get(&x).map(|h| h.data[0]), None);
        drop(held);
        s.flush().unwrap();
        assert_eq!(
            (s.get(&x).map(|h| h.data[0]), s.locate(&x)),
            (None, None),
            "the older version, written after the newer one was lost, is served"
        );
        assert_eq!(s.cancelled_writes(), 0, "the cancellation is pruned");
    }

    /// A newer version whose eviction write fails (ENOSPC while the region
    /// is open: the writer pauses, the store keeps serving): the version
    /// before it, on disk, is not served as current.
    #[test]
    fn an_overwrite_whose_write_fails_never_serves_the_older_version() {
        let dir = tempfile::tempdir().unwrap();
        let dev = Arc::new(crate::testdev::FaultyDevice::new(file(
            dir.path(),
            16 << 20,
        )));
        let (s, ns) = open_on(dir.path(), dev.clone(), 1 << 20, NO_IDLE);
        let x = ChunkId::new(ns, key(0), 0);
        s.put(x, data(0, 1)).unwrap();
        s.flush().unwrap();
        dev.fail_writes_after(0, libc::ENOSPC);
        s.put(x, data(0, 2)).unwrap();
        for n in 100..104 {
            s.put(ChunkId::new(ns, key(n), 0), data(n, 1)).unwrap();
        }
        until("the write failed", || s.stats().disk_write_failures >= 1);
        until("nothing spilled", || s.inner.ram.spilled_len() == 0);
        assert_eq!(
            (s.get(&x).map(|h| h.data[0]), s.locate(&x)),
            (None, None),
            "the version before the failed overwrite is served as current"
        );
    }

    /// A read that found an older version in the disk index and is reading
    /// it when a put makes that version obsolete returns what it read but
    /// does not cache it: the put bumps the id's RAM removal bucket after
    /// taking the index entry out. Staged: the put's insert, then the new
    /// version leaving RAM (dropped unwritten), then the read, then the
    /// put's `supersede`.
    #[test]
    fn a_read_in_flight_when_a_put_supersedes_its_version_does_not_cache_it() {
        let dir = tempfile::tempdir().unwrap();
        let (s, ns, dev) = setup(dir.path(), NO_IDLE);
        let x = ChunkId::new(ns, key(0), 0);
        s.put(x, data(0, 1)).unwrap();
        s.flush().unwrap();
        for n in 100..104 {
            s.put(ChunkId::new(ns, key(n), 0), data(n, 1)).unwrap();
        }
        assert!(s.inner.ram.peek_any(&x).is_none(), "x is on disk only");
        let t = Instant::now();
        s.inner.ram.insert(x, data(0, 2), None, true).unwrap();
        assert!(s.inner.ram.remove(&x).is_some());
        dev.hold_next_read();
        let held = Released(&dev);
        let read = std::thread::scope(|scope| {
            let get = scope.spawn(|| s.get(&x).map(|h| h.data[0]));
            assert!(dev.wait_held(1, WAIT), "the read reached the device");
            s.inner.supersede(x, t);
            drop(held);
            get.join().unwrap()
        });
        assert_eq!(read, Some(1));
        assert_eq!(
            (s.inner.ram.peek_any(&x).is_some(), s.get(&x).is_some()),
            (false, false),
            "the older version read meanwhile was cached"
        );
    }

    /// One version with two spilled jobs (an eviction's, and a flush's
    /// second round's) in two batches: the first is written and indexed,
    /// the second fails (ENOSPC). The version written stays indexed.
    #[test]
    fn a_failed_duplicate_write_keeps_the_written_version() {
        let dir = tempfile::tempdir().unwrap();
        let faulty = Arc::new(crate::testdev::FaultyDevice::new(file(
            dir.path(),
            16 << 20,
        )));
        let dev = Arc::new(HoldingDevice::new(faulty.clone()));
        let (s, ns) = open_on(dir.path(), dev.clone(), 1 << 20, NO_IDLE);
        let inner = &s.inner;
        let id = |n: u64| ChunkId::new(ns, key(n), 0);
        // The first region is open (its open slot written).
        s.put(id(100), Bytes::from(vec![1u8; 4096])).unwrap();
        s.flush().unwrap();
        let x = id(0);
        s.put(x, data(0, 1)).unwrap();
        for n in 1..=3 {
            s.put(id(n), data(n, 1)).unwrap();
        }
        // An insert of chunk 4 evicts x (spilled), before its hand-off.
        let (_, evicted) = inner.ram.insert(id(4), data(4, 1), None, true).unwrap();
        assert!(evicted.len() == 1 && evicted[0].id == x && evicted[0].spilled);
        let e = evicted[0].entry.clone();
        dev.hold_writes();
        let held = Released(&dev);
        // The eviction's hand-off: its batch is held in the device ...
        inner.handle_evicted(evicted);
        assert!(dev.wait_held(1, WAIT), "the first batch is in flight");
        // ... and a second job of the same version goes to the next batch.
        inner
            .send(Msg::Write(inner.write_job(x, e, Held::Spilled, None)))
            .unwrap();
        until("the writer took the second job", || {
            s.stats().writer_queue_depth == 0
        });
        std::thread::sleep(Duration::from_millis(200));
        faulty.fail_writes_after(1, libc::ENOSPC);
        drop(held);
        until("the second write failed", || {
            s.stats().disk_write_failures >= 1
        });
        faulty.heal();
        assert!(inner.ram.peek_any(&x).is_none(), "x is on disk only");
        assert_eq!(
            (s.locate(&x), s.get(&x).map(|h| h.data[0])),
            (Some(Tier::Disk), Some(data(0, 1)[0])),
            "x, written and indexed, was taken out by its duplicate's failure"
        );
    }

    /// An eviction dropped unwritten (no-tax) while a flush's write of the
    /// same version is in flight: that write is indexed (the version is the
    /// current one), and the flush reports it.
    #[test]
    fn a_dropped_eviction_keeps_the_flush_write_of_the_same_version() {
        let dir = tempfile::tempdir().unwrap();
        let (s, ns, dev) = setup_queue_of_one(dir.path());
        let x = ChunkId::new(ns, key(0), 0);
        s.put(x, data(0, 1)).unwrap();
        s.flush().unwrap();
        s.put(x, data(0, 2)).unwrap();
        dev.hold_writes();
        let held = Released(&dev);
        std::thread::scope(|scope| {
            let flush = scope.spawn(|| s.flush());
            assert!(
                dev.wait_held(1, WAIT),
                "the flush's write of v2 is in flight"
            );
            // Puts go on; x stays most recently used until the queue jams.
            let n = jam_keeping(&s, ns, &x);
            drop_unwritten(&s, ns, &x, n);
            drop(held);
            let report = flush.join().unwrap();
            assert!(report.is_ok(), "{:?}", report.err());
        });
        s.flush().unwrap();
        assert_eq!(
            (s.locate(&x), s.get(&x).map(|h| h.data[0])),
            (Some(Tier::Disk), Some(data(0, 2)[0])),
            "v2, written by the flush, is lost"
        );
    }

    /// A version's write can be in flight after the version left RAM
    /// without being replaced: a flush's job of v1 (never on disk before)
    /// is held when v1's eviction is dropped. v2 is put (nothing in RAM to
    /// replace) and dropped too. The flush's write of v1 then lands: it is
    /// not indexed (the put of v2 cancelled it), so v1 is not served after
    /// v2, newer, was lost.
    #[test]
    fn a_write_in_flight_of_a_version_that_left_ram_is_cancelled_by_a_put() {
        let dir = tempfile::tempdir().unwrap();
        let (s, ns, dev) = setup_queue_of_one(dir.path());
        // The first region is open (its open slot written).
        s.put(ChunkId::new(ns, key(99), 0), Bytes::from(vec![1u8; 4096]))
            .unwrap();
        s.flush().unwrap();
        let x = ChunkId::new(ns, key(0), 0);
        s.put(x, data(0, 1)).unwrap();
        dev.hold_writes();
        let held = Released(&dev);
        std::thread::scope(|scope| {
            let flush = scope.spawn(|| s.flush());
            assert!(
                dev.wait_held(1, WAIT),
                "the flush's write of v1 is in flight"
            );
            let n = jam_keeping(&s, ns, &x);
            drop_unwritten(&s, ns, &x, n);
            assert!(s.inner.ram.peek_any(&x).is_none(), "v1 left RAM");
            s.put(x, data(0, 2)).unwrap();
            drop_unwritten(&s, ns, &x, n + 8);
            drop(held);
            let _ = flush.join().unwrap();
        });
        s.flush().unwrap();
        assert_eq!(
            s.get(&x).map(|h| h.data[0]),
            None,
            "v1 is served as current after v2 was lost"
        );
        assert_eq!(s.cancelled_writes(), 0, "the cancellation is pruned");
    }

    /// An overwrite dropped unwritten while a read looks for the id in the
    /// window between its unspill and its loss: the read never finds the
    /// older version (the put took it out of the index).
    #[test]
    fn a_read_between_an_unspill_and_its_loss_never_finds_the_older_version() {
        let dir = tempfile::tempdir().unwrap();
        let (s, ns) = open_on(dir.path(), file(dir.path(), 16 << 20), 1 << 20, NO_IDLE);
        let inner = &s.inner;
        let id = |n: u64| ChunkId::new(ns, key(n), 0);
        let x = id(0);
        s.put(x, data(0, 1)).unwrap();
        s.flush().unwrap();
        s.put(x, data(0, 2)).unwrap();
        for n in 1..=3 {
            s.put(id(n), data(n, 1)).unwrap();
        }
        let (_, evicted) = inner.ram.insert(id(4), data(4, 1), None, true).unwrap();
        assert!(evicted.len() == 1 && evicted[0].id == x && evicted[0].spilled);
        // The drop branch of `handle_evicted` (the writer's queue full),
        // with a read in the middle.
        inner.ram.unspill(&x, evicted[0].entry.seq);
        assert_eq!(s.get(&x).map(|h| h.data[0]), None);
        inner.lost(&x);
        assert_eq!(s.get(&x).map(|h| h.data[0]), None);
    }

    /// A clean copy (a peer's) is not cached while a write of a version
    /// that left RAM is on its way to the disk: that write, indexed later,
    /// would sit under the copy and be served once the copy is evicted.
    #[test]
    fn a_clean_copy_waits_for_a_write_in_flight() {
        let dir = tempfile::tempdir().unwrap();
        let (s, ns, dev) = setup_queue_of_one(dir.path());
        let x = ChunkId::new(ns, key(0), 0);
        s.put(x, data(0, 1)).unwrap();
        dev.hold_writes();
        let held = Released(&dev);
        std::thread::scope(|scope| {
            let flush = scope.spawn(|| s.flush());
            assert!(
                dev.wait_held(1, WAIT),
                "the flush's write of x is in flight"
            );
            let n = jam_keeping(&s, ns, &x);
            drop_unwritten(&s, ns, &x, n);
            assert!(!s.put_clean(x, None, data(0, 3)).unwrap());
            drop(held);
            flush.join().unwrap().unwrap();
        });
        assert_eq!(s.get(&x).map(|h| h.data[0]), Some(data(0, 1)[0]));
    }

    // Atomic groups and late flush jobs (session 32 review).

    fn crash_open(
        dir: &std::path::Path,
    ) -> (ChunkStore, Namespace, Arc<crate::testdev::CrashDevice>) {
        let dev = Arc::new(crate::testdev::CrashDevice::new(16 << 20));
        let (s, ns) = open_on(dir, dev.clone(), 1 << 20, NO_IDLE);
        (s, ns, dev)
    }

    fn crash_reopen(
        dir: &std::path::Path,
        s: ChunkStore,
        dev: &crate::testdev::CrashDevice,
    ) -> ChunkStore {
        let img = dev.durable_image();
        dev.crash_now();
        drop(s);
        open_on(
            dir,
            Arc::new(crate::testdev::CrashDevice::from_image(img)),
            1 << 20,
            NO_IDLE,
        )
        .0
    }

    /// Writes the current RAM version of `id` (an eviction or idle pass would).
    fn write_now(s: &ChunkStore, id: ChunkId) {
        let e = s.inner.ram.peek(&id).unwrap();
        s.inner
            .send(Msg::Write(s.inner.write_job(id, e, Held::Resident, None)))
            .unwrap();
        s.inner.flush_marker(None).unwrap();
    }

    fn v(s: &ChunkStore, id: ChunkId) -> Option<u8> {
        s.get(&id).map(|h| h.data[0])
    }

    /// A flush's job of a version overwritten since (written unindexed) is
    /// dropped when the newer version is on disk already (review: flush
    /// made each job in turn, a newer version could be written meanwhile,
    /// and recovery, where the last entry wins, served the older one after
    /// a clean close).
    #[test]
    fn a_flush_job_made_after_a_newer_version_was_written_is_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let (s, ns) = open_on(dir.path(), file(dir.path(), 16 << 20), 1 << 20, NO_IDLE);
        let b = ChunkId::new(ns, key(1), 0);
        s.put(b, data(1, 1)).unwrap();
        let (_, old) = s
            .inner
            .ram
            .dirty_entries(None, usize::MAX)
            .into_iter()
            .find(|(i, _)| *i == b)
            .unwrap();
        s.put(b, data(1, 2)).unwrap();
        s.flush().unwrap(); // another flush writes the new version
        let ticket = Arc::new(Ticket::default());
        s.inner
            .send(Msg::Write(s.inner.write_job(
                b,
                old,
                Held::Resident,
                Some(ticket),
            )))
            .unwrap();
        s.inner.flush_marker(None).unwrap();
        assert_eq!(v(&s, b), Some(data(1, 2)[0]));
        s.close(Duration::from_secs(10)).unwrap();
        drop(s);
        let (s, _) = open_on(dir.path(), file(dir.path(), 16 << 20), 1 << 20, NO_IDLE);
        assert_eq!(
            v(&s, b),
            Some(data(1, 2)[0]),
            "the older version came back after a clean close"
        );
    }

    /// A flush's job of a version overwritten twice since it read it, the
    /// middle version written (and flushed) meanwhile and the newest still
    /// dirty in RAM, is dropped: written after the middle version it won at
    /// recovery, so a crash served it although a flush had returned after
    /// the middle one.
    #[test]
    fn a_flush_job_is_dropped_when_a_newer_version_was_written_and_overwritten() {
        let dir = tempfile::tempdir().unwrap();
        let crash = Arc::new(crate::testdev::CrashDevice::new(16 << 20));
        let (s, ns) = open_on(dir.path(), crash.clone(), 1 << 20, NO_IDLE);
        let a = ChunkId::new(ns, key(1), 0);
        s.put(a, data(1, 1)).unwrap();
        // A flush counts its job of A1, then reads A1 (`flush_inner`)...
        let counted = PendingWrite::new(&s.inner.pending, a);
        let first = s.inner.ram.peek(&a).unwrap();
        // ...then, before its job reaches the writer, A2 is put and flushed
        // by another call, and A3 is put (dirty in RAM).
        s.put(a, data(1, 2)).unwrap();
        s.flush().unwrap();
        s.put(a, data(1, 3)).unwrap();
        let ticket = Arc::new(Ticket::default());
        s.inner
            .send(Msg::Write(s.inner.write_job_counted(
                a,
                first,
                Held::Resident,
                Some(ticket.clone()),
                counted,
            )))
            .unwrap();
        s.inner.flush_marker(None).unwrap();
        assert_eq!(v(&s, a), Some(data(1, 3)[0]));
        let s = crash_reopen(dir.path(), s, &crash);
        assert_eq!(
            v(&s, a),
            Some(data(1, 2)[0]),
            "A2 was flushed, A3 never written: after a crash A must be A2 (A1 = {})",
            data(1, 1)[0]
        );
    }

    /// A group whose member left (that member's version in the group on
    /// disk, no longer indexed) loses it when the region holding it is
    /// reclaimed: the rest goes at once, as a restart undoes it (it stayed
    /// served until a restart dropped it).
    #[test]
    fn reclaiming_a_left_members_group_entry_breaks_the_group() {
        const REGION: u64 = 64 * KIB as u64;
        let dir = tempfile::tempdir().unwrap();
        let (s, ns) = open_on(dir.path(), file(dir.path(), 6 * REGION), REGION, NO_IDLE);
        let id = |n: u64| ChunkId::new(ns, key(n), 0);
        let small = |n: u64| Bytes::from(vec![n as u8; 20_000]);
        let (a, b) = (id(1), id(2));
        s.put_atomic(vec![(a, small(1)), (b, small(2))]).unwrap();
        write_now(&s, a); // A's version in the group, in the first region
        let first = s.disk_location(&a).unwrap().0;
        s.put(a, small(11)).unwrap(); // A leaves; its group entry stays on disk
        assert!(s.disk_location(&a).is_none());
        // Fillers until another region is open; B's version goes there.
        let mut n = 100;
        loop {
            s.put(id(n), small(n)).unwrap();
            write_now(&s, id(n));
            n += 1;
            if s.disk_location(&id(n - 1)).unwrap().0 != first {
                break;
            }
        }
        write_now(&s, b);
        assert_ne!(s.disk_location(&b).unwrap().0, first);
        assert!(s.get(&b).is_some());
        // More until the first region is reclaimed.
        while s.stats().region_evictions == 0 {
            assert!(n < 400, "the first region was never reclaimed");
            s.put(id(n), small(n)).unwrap();
            write_now(&s, id(n));
            n += 1;
        }
        assert!(s.get(&b).is_none(), "B outlived its group's entry of A");
        s.close(Duration::from_secs(10)).unwrap();
        drop(s);
        let (s, _) = open_on(dir.path(), file(dir.path(), 6 * REGION), REGION, NO_IDLE);
        assert!(s.get(&b).is_none(), "a restart agrees");
        assert_eq!(s.get(&a).map(|h| h.data[0]), Some(11));
    }

    /// A member's write for its group that fails (ENOSPC) breaks the rest
    /// at once: runtime and a clean restart agree (review: the rest stayed
    /// served and a restart undid it).
    #[test]
    fn a_failed_write_for_the_group_breaks_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let dev = Arc::new(crate::testdev::FaultyDevice::new(file(
            dir.path(),
            16 << 20,
        )));
        let (s, ns) = open_on(dir.path(), dev.clone(), 1 << 20, NO_IDLE);
        let (a, b) = (ChunkId::new(ns, key(1), 0), ChunkId::new(ns, key(2), 0));
        s.put_atomic(vec![(a, data(1, 1)), (b, data(2, 1))])
            .unwrap();
        write_now(&s, b); // B's group entry on disk: the group is queued
        assert!(s.disk_location(&b).is_some());
        let failures = s.stats().disk_write_failures;
        dev.fail_writes_after(0, libc::ENOSPC);
        s.put(a, data(1, 9)).unwrap(); // A leaves: its group version is written for the group
        until("the write for the group failed", || {
            s.stats().disk_write_failures > failures
        });
        dev.heal();
        s.flush().unwrap();
        let runtime = v(&s, b);
        s.close(Duration::from_secs(10)).unwrap();
        drop(s);
        let (s, _) = open_on(dir.path(), file(dir.path(), 16 << 20), 1 << 20, NO_IDLE);
        assert_eq!(v(&s, a), Some(data(1, 9)[0]));
        assert_eq!(
            v(&s, b),
            runtime,
            "B after a clean restart differs from what the store served before the close"
        );
    }

    /// A flush's job of a version overwritten since is written even when
    /// the newer version's job went first, if that write failed: the flush
    /// returned Ok, so a crash must show the flushed version or a newer one
    /// (review of a check, since removed, that dropped it).
    #[test]
    fn a_flushed_version_survives_a_newer_write_that_failed() {
        let dir = tempfile::tempdir().unwrap();
        let crash = Arc::new(crate::testdev::CrashDevice::new(16 << 20));
        let dev = Arc::new(crate::testdev::FaultyDevice::new(crash.clone()));
        let (s, ns) = open_on(dir.path(), dev.clone(), 1 << 20, NO_IDLE);
        let a = ChunkId::new(ns, key(1), 0);
        s.put(a, data(1, 0)).unwrap();
        s.flush().unwrap(); // A0 durable
        s.put(a, data(1, 1)).unwrap();
        // The flush of A1 makes its job (its send waits: queue full).
        let ticket = Arc::new(Ticket::default());
        let older = s.inner.write_job(
            a,
            s.inner.ram.peek(&a).unwrap(),
            Held::Resident,
            Some(ticket.clone()),
        );
        s.put(a, data(1, 2)).unwrap();
        // A2's job (another flush, an idle pass) reaches the writer first
        // and its write fails.
        let newer = s
            .inner
            .write_job(a, s.inner.ram.peek(&a).unwrap(), Held::Resident, None);
        let failures = s.stats().disk_write_failures;
        dev.fail_writes_after(0, libc::ENOSPC);
        s.inner.send(Msg::Write(newer)).unwrap();
        until("A2's write failed", || {
            s.stats().disk_write_failures > failures
        });
        dev.heal();
        s.inner.send(Msg::Write(older)).unwrap();
        let r = s.inner.flush_marker(None);
        assert!(r.is_ok(), "precondition: the flush of A1 returns Ok: {r:?}");
        assert_eq!(
            ticket.failed.load(Ordering::Relaxed),
            0,
            "nothing reported failed"
        );
        let s = crash_reopen(dir.path(), s, &crash);
        let got = v(&s, a);
        assert!(
            got == Some(data(1, 1)[0]) || got == Some(data(1, 2)[0]),
            "A1 was flushed (Ok) yet after a crash A is {got:?} (A0 = {})",
            data(1, 0)[0]
        );
    }

    /// put_atomic never waits for the writer's queue while it holds the
    /// gate (review: each leaving member's write for its group waited up to
    /// 100 ms there, and every reader with it: 801 ms for 9 members).
    #[test]
    fn a_put_atomic_leaving_a_queued_group_never_holds_readers_off_long() {
        let dir = tempfile::tempdir().unwrap();
        let dev = Arc::new(HoldingDevice::new(file(dir.path(), 16 << 20)));
        let (s, ns) = open_with(dir.path(), dev.clone(), 1 << 20, NO_IDLE, |c| {
            c.writer_queue = 1;
        });
        let s = Arc::new(s);
        let id = |n: u64| ChunkId::new(ns, key(n), 0);
        let small = |n: u64, v: u8| Bytes::from(vec![n as u8 ^ v; 1000]);
        let group = |v: u8| (1..=9).map(|n| (id(n), small(n, v))).collect::<Vec<_>>();
        s.put_atomic(group(1)).unwrap();
        // A job made for a member marks the group queued (its try_send found
        // the queue full, as an idle pass's may).
        drop(s.inner.write_job(
            id(1),
            s.inner.ram.peek(&id(1)).unwrap(),
            Held::Resident,
            None,
        ));
        let x = id(50);
        s.put(x, small(50, 0)).unwrap();
        dev.hold_writes();
        let held = Released(&dev);
        let tx = s.inner.tx.as_ref().unwrap().clone();
        tx.send(Msg::Write(s.inner.write_job(
            x,
            s.inner.ram.peek(&x).unwrap(),
            Held::Resident,
            None,
        )))
        .unwrap();
        assert!(dev.wait_held(1, WAIT));
        // The writer waits for the held write (a forget drains); the queue
        // of one fills.
        until("queue full", || {
            let _ = tx.try_send(Msg::Forget(id(60), Instant::now(), 0));
            tx.is_full()
        });
        std::thread::sleep(Duration::from_millis(50));
        assert!(tx.is_full());
        // put_atomic holds the gate (readers wait) for as long as it takes.
        let start = Instant::now();
        s.put_atomic(group(2)).unwrap();
        let took = start.elapsed();
        drop(held);
        assert!(
            took < Duration::from_millis(200),
            "put_atomic held the gate for {took:?}"
        );
        assert!(s.get(&x).is_some());
    }

    /// A flush's job of A1 that reaches the writer while a newer version's
    /// job (A2, another flush's) is packed or in flight waits for that
    /// write before it is decided (review: decided at packing, before A2's
    /// write finished, A1 was kept and written after A2, and a crash
    /// served A1 although the flush of A2 had returned).
    #[test]
    fn a_flush_job_behind_a_newer_version_in_flight_waits_for_it() {
        let dir = tempfile::tempdir().unwrap();
        let crash = Arc::new(crate::testdev::CrashDevice::new(16 << 20));
        let dev = Arc::new(HoldingDevice::new(crash.clone()));
        let (s, ns) = open_on(dir.path(), dev.clone(), 1 << 20, NO_IDLE);
        let a = ChunkId::new(ns, key(1), 0);
        let x = ChunkId::new(ns, key(9), 0);
        s.put(x, Bytes::from(vec![1u8; 4096])).unwrap();
        s.flush().unwrap(); // a region is open
        s.put(a, data(1, 1)).unwrap();
        let counted = PendingWrite::new(&s.inner.pending, a); // F1 counts...
        let first = s.inner.ram.peek(&a).unwrap(); // ...and reads A1
        s.put(a, data(1, 2)).unwrap(); // A2
        // The writer busy, so what follows is taken in one pass.
        let held = hold_writer_in(&s, ns, &dev, x);
        std::thread::sleep(Duration::from_millis(100));
        let e = s.inner.ram.peek(&a).unwrap();
        s.inner
            .send(Msg::Write(s.inner.write_job(
                a,
                e,
                Held::Resident,
                Some(Arc::new(Ticket::default())),
            )))
            .unwrap(); // F2's job of A2
        s.inner
            .send(Msg::Write(s.inner.write_job_counted(
                a,
                first,
                Held::Resident,
                Some(Arc::new(Ticket::default())),
                counted,
            )))
            .unwrap(); // F1's job of A1
        let (ack, f2) = bounded(1);
        s.inner.send(Msg::Flush(ack)).unwrap(); // F2's marker
        drop(held);
        f2.recv().unwrap().unwrap(); // F2, which covered A2, returns Ok
        s.inner.flush_marker(None).unwrap(); // F1 returns Ok
        assert_eq!(v(&s, a), Some(data(1, 2)[0]));
        let s = crash_reopen(dir.path(), s, &crash);
        assert_eq!(
            v(&s, a),
            Some(data(1, 2)[0]),
            "after a crash A must be A2 (A1 = {})",
            data(1, 1)[0]
        );
    }

    /// A flush's job of B1, made after B2 (a group's version) was written,
    /// is dropped (written after B2 it broke B2's group for good: recovery
    /// found the group short of B and undid it), and the flush writes the
    /// rest of B2's group instead, so that B2 stands for B1 whole on disk
    /// when the flush returns (before: B1 after a crash, A gone).
    #[test]
    fn a_flush_overtaken_by_a_groups_version_writes_the_whole_group() {
        let dir = tempfile::tempdir().unwrap();
        let (s, ns, dev) = crash_open(dir.path());
        let (a, b) = (ChunkId::new(ns, key(1), 0), ChunkId::new(ns, key(2), 0));
        s.put_atomic(vec![(a, data(1, 1)), (b, data(2, 1))])
            .unwrap();
        write_now(&s, a); // A1 on disk, G1 queued
        // A flush walks: B1 is dirty.
        let walked = s.inner.flush_walk();
        // G2: A leaves G1 first (written: nothing to do), then B empties it.
        s.put_atomic(vec![(a, data(1, 2)), (b, data(2, 2))])
            .unwrap();
        write_now(&s, b); // B2 on disk (an eviction, another flush)
        let r = s.inner.flush_walked(walked, None).unwrap();
        assert_eq!(r.failed, 0, "{r:?}");
        let s = crash_reopen(dir.path(), s, &dev);
        let (ga, gb) = (v(&s, a), v(&s, b));
        assert_eq!(
            (ga, gb),
            (Some(data(1, 2)[0]), Some(data(2, 2)[0])),
            "B1 was flushed, B2's group written whole: after a crash A = {ga:?}, B = {gb:?} \
             (A1 = {}, B1 = {})",
            data(1, 1)[0],
            data(2, 1)[0]
        );
    }

    /// A member of the group written by another job after the flush's
    /// first marker is synced by a marker of the round that handles the
    /// group before the flush returns (review).
    #[test]
    fn a_group_round_syncs_a_member_written_after_the_first_marker() {
        let dir = tempfile::tempdir().unwrap();
        let crash = Arc::new(crate::testdev::CrashDevice::new(16 << 20));
        let dev = Arc::new(HoldingDevice::new(crash.clone()));
        let (s, ns) = open_on(dir.path(), dev.clone(), 1 << 20, NO_IDLE);
        let (a, b) = (ChunkId::new(ns, key(1), 0), ChunkId::new(ns, key(2), 0));
        let x = ChunkId::new(ns, key(9), 0);
        s.put(x, Bytes::from(vec![1u8; 4096])).unwrap();
        s.flush().unwrap();
        s.put_atomic(vec![(a, data(1, 1)), (b, data(2, 1))])
            .unwrap();
        write_now(&s, a);
        let walked = s.inner.flush_walk(); // B1 dirty
        s.put_atomic(vec![(a, data(1, 2)), (b, data(2, 2))])
            .unwrap();
        write_now(&s, b); // B2 on disk, synced
        let held = hold_writer_in(&s, ns, &dev, x);
        std::thread::scope(|sc| {
            let t = sc.spawn(|| s.inner.flush_walked(walked, None));
            std::thread::sleep(Duration::from_millis(200)); // B1's job and the marker queued
            let gate = s.inner.gate.write(); // the round waits in group_members
            let e = s.inner.ram.peek(&a).unwrap(); // A2, queued behind the marker
            s.inner
                .send(Msg::Write(s.inner.write_job(a, e, Held::Resident, None)))
                .unwrap();
            drop(held);
            let t0 = Instant::now();
            while s.inner.ram.peek(&a).unwrap().dirty {
                assert!(t0.elapsed() < WAIT);
                std::thread::sleep(Duration::from_millis(5));
            }
            drop(gate);
            let r = t.join().unwrap().unwrap();
            assert_eq!(r.failed, 0, "{r:?}");
        });
        let s = crash_reopen(dir.path(), s, &crash);
        assert_eq!(
            (v(&s, a), v(&s, b)),
            (Some(data(1, 2)[0]), Some(data(2, 2)[0]))
        );
    }

    /// As above, where the job of B1 reaches the writer before B2 is
    /// written: B1 is written (unindexed, ahead of B2); the group, put
    /// after the walk, is not this flush's.
    #[test]
    fn a_flush_ahead_of_a_groups_version_writes_its_own_version_first() {
        let dir = tempfile::tempdir().unwrap();
        let (s, ns, dev) = crash_open(dir.path());
        let (a, b) = (ChunkId::new(ns, key(1), 0), ChunkId::new(ns, key(2), 0));
        s.put(b, data(2, 1)).unwrap();
        let walked = s.inner.flush_walk();
        s.put_atomic(vec![(a, data(1, 2)), (b, data(2, 2))])
            .unwrap();
        let r = s.inner.flush_walked(walked, None).unwrap();
        assert_eq!(r.failed, 0, "{r:?}");
        let s = crash_reopen(dir.path(), s, &dev);
        let (ga, gb) = (v(&s, a), v(&s, b));
        assert!(
            (ga, gb) == (None, Some(data(2, 1)[0]))
                || (ga, gb) == (Some(data(1, 2)[0]), Some(data(2, 2)[0])),
            "B1 flushed: after a crash A = {ga:?}, B = {gb:?}"
        );
    }

    /// A job writes its version's group tag, not the tag of the group the
    /// id is in now (review: a flush's job of a version older than a group
    /// took that group's tag and counted as its member at recovery).
    #[test]
    fn a_version_older_than_its_ids_group_is_written_untagged() {
        let dir = tempfile::tempdir().unwrap();
        let (s, ns, dev) = crash_open(dir.path());
        let (a, b) = (ChunkId::new(ns, key(1), 0), ChunkId::new(ns, key(2), 0));
        s.put(a, data(1, 1)).unwrap();
        let (_, old) = s
            .inner
            .ram
            .dirty_entries(None, usize::MAX)
            .into_iter()
            .find(|(i, _)| *i == a)
            .unwrap();
        s.put_atomic(vec![(a, data(1, 2)), (b, data(2, 2))])
            .unwrap();
        let job = s
            .inner
            .write_job(a, old, Held::Resident, Some(Arc::new(Ticket::default())));
        let tag = (job.txn, job.txn_size);
        s.inner.send(Msg::Write(job)).unwrap();
        write_now(&s, b); // b's group version reaches the disk, a's does not
        let s = crash_reopen(dir.path(), s, &dev);
        let (ga, gb) = (v(&s, a), v(&s, b));
        assert!(
            !(gb == Some(data(2, 2)[0]) && ga != Some(data(1, 2)[0])),
            "group {{a2, b2}} half visible: a = {ga:?} (a1 = {}), b = b2; a1 was tagged {tag:?}",
            data(1, 1)[0]
        );
    }

    /// A plain put of a member cannot land between put_atomic's txns step
    /// and its RAM inserts: it waits for the gate, so it comes after the
    /// whole group (review: it took no gate, left the group, shrinking b to
    /// a group of one, while put_atomic's insert of a2 landed after it:
    /// readers saw {a2, b2} and on disk b2 alone was a complete group).
    #[test]
    fn a_put_waits_for_a_put_atomic_of_its_id_to_finish() {
        let dir = tempfile::tempdir().unwrap();
        let (s, ns, _dev) = crash_open(dir.path());
        let (a, b) = (ChunkId::new(ns, key(1), 0), ChunkId::new(ns, key(2), 0));
        let s = Arc::new(s);
        let inner = &s.inner;
        let gate = inner.gate.write();
        {
            let mut t = inner.txns.lock();
            let txn = t.next;
            t.next += 1;
            for id in [a, b] {
                let _ = inner.leave_group(&mut t, &id);
                t.of.insert(id, (txn, 2));
            }
            t.members.insert(txn, vec![a, b]);
        }
        let done = Arc::new(AtomicBool::new(false));
        let put = {
            let (s, done) = (s.clone(), done.clone());
            std::thread::spawn(move || {
                s.put(a, data(1, 9)).unwrap(); // another connection's plain put
                done.store(true, Ordering::SeqCst);
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        assert!(!done.load(Ordering::SeqCst), "the put waits for the group");
        let mut ev = Vec::new();
        inner.ram_insert(a, None, data(1, 2), &mut ev).unwrap();
        inner.ram_insert(b, None, data(2, 2), &mut ev).unwrap();
        drop(gate);
        put.join().unwrap();
        assert!(ev.is_empty());
        // The put came after the group: a is its version, b the group's.
        assert_eq!(
            (v(&s, a), v(&s, b)),
            (Some(data(1, 9)[0]), Some(data(2, 2)[0]))
        );
    }

    /// `queued` is set when a job is made, not when it reaches the writer:
    /// an idle pass whose try_send finds the queue full marks the group, so
    /// a member leaving then does not shrink the rest; its version is
    /// written for the group instead, and b and c survive a clean close.
    #[test]
    fn a_member_leaving_after_a_job_that_never_reached_the_writer_keeps_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let (s, ns) = open_on(dir.path(), file(dir.path(), 16 << 20), 1 << 20, NO_IDLE);
        let id = |n: u64| ChunkId::new(ns, key(n), 0);
        s.put_atomic(vec![
            (id(1), data(1, 1)),
            (id(2), data(2, 1)),
            (id(3), data(3, 1)),
        ])
        .unwrap();
        let e = s.inner.ram.peek(&id(1)).unwrap();
        drop(s.inner.write_job(id(1), e, Held::Resident, None)); // try_send: Full
        s.put(id(1), data(1, 9)).unwrap();
        s.flush().unwrap();
        s.close(Duration::from_secs(10)).unwrap();
        drop(s);
        let (s, _) = open_on(dir.path(), file(dir.path(), 16 << 20), 1 << 20, NO_IDLE);
        assert_eq!(
            (v(&s, id(1)), v(&s, id(2)), v(&s, id(3))),
            (
                Some(data(1, 9)[0]),
                Some(data(2, 1)[0]),
                Some(data(3, 1)[0])
            )
        );
    }

    /// Recovery rolls a member back through two incomplete groups to a
    /// flushed one.
    #[test]
    fn recovery_rolls_back_through_two_incomplete_groups() {
        let dir = tempfile::tempdir().unwrap();
        let (s, ns, dev) = crash_open(dir.path());
        let id = |n: u64| ChunkId::new(ns, key(n), 0);
        let (a, b, c) = (id(1), id(2), id(3));
        s.put_atomic(vec![(a, data(1, 1)), (b, data(2, 1))])
            .unwrap();
        s.flush().unwrap();
        s.put_atomic(vec![(a, data(1, 2)), (b, data(2, 2))])
            .unwrap();
        write_now(&s, a);
        s.put_atomic(vec![(a, data(1, 3)), (c, data(3, 3))])
            .unwrap();
        write_now(&s, a);
        let s = crash_reopen(dir.path(), s, &dev);
        assert_eq!(
            (v(&s, a), v(&s, b), v(&s, c)),
            (Some(data(1, 1)[0]), Some(data(2, 1)[0]), None)
        );
        assert_eq!(s.stats().disk_chunks, 2);
    }

    /// A flushed delete between two groups stays a delete at rollback.
    #[test]
    fn recovery_rollback_stops_at_a_flushed_delete() {
        let dir = tempfile::tempdir().unwrap();
        let (s, ns, dev) = crash_open(dir.path());
        let id = |n: u64| ChunkId::new(ns, key(n), 0);
        let (a, b, c) = (id(1), id(2), id(3));
        s.put_atomic(vec![(a, data(1, 1)), (b, data(2, 1))])
            .unwrap();
        s.flush().unwrap();
        assert!(s.delete(&a));
        s.flush().unwrap();
        s.put_atomic(vec![(a, data(1, 2)), (c, data(3, 2))])
            .unwrap();
        write_now(&s, a);
        let s = crash_reopen(dir.path(), s, &dev);
        assert_eq!(
            (v(&s, a), v(&s, b), v(&s, c)),
            (None, Some(data(2, 1)[0]), None)
        );
    }

    /// Review: one spilled version, two jobs (the eviction's and
    /// a flush's late round) packed before either failed: `failed` runs
    /// twice and `lost_writes` ("each counted once") counts the chunk twice.
    #[test]
    fn lost_write_counted_once_with_two_jobs_of_one_version() {
        let dir = tempfile::tempdir().unwrap();
        let faulty = Arc::new(crate::testdev::FaultyDevice::new(file(
            dir.path(),
            32 << 20,
        )));
        let hold = Arc::new(HoldingDevice::new(faulty.clone()));
        let gate = Arc::new(SyncGate {
            inner: hold.clone(),
            st: Mutex::new(GateState::default()),
            cv: Condvar::new(),
        });
        let (s, ns) = open_on(dir.path(), gate.clone(), 4 << 20, NO_IDLE);
        let inner = &s.inner;
        let (x, y, ev_x, ev_y) = two_spilled(&s, ns);
        gate.hold();
        std::thread::scope(|scope| {
            let flush = scope.spawn(|| s.flush());
            until("the first marker's fdatasync", || gate.waiting() == 1);
            // The flush's late round stops at y (after sending x's job).
            let held = inner.ram.hold_shard(shard_of(&y));
            hold.hold_writes();
            faulty.fail_writes_after(0, libc::ENOSPC);
            gate.release();
            assert!(hold.wait_held(1, WAIT), "x's late flush job in flight");
            // x's eviction hands its job off now; the writer packs it
            // (x still spilled) behind the one in flight.
            inner.handle_evicted(ev_x);
            until("the hand-off taken", || s.stats().writer_queue_depth == 0);
            std::thread::sleep(Duration::from_millis(200));
            hold.release();
            until("x dropped", || inner.ram.peek_any(&x).is_none());
            std::thread::sleep(Duration::from_millis(200));
            faulty.heal();
            drop(held);
            let _ = flush.join().unwrap();
        });
        drop(ev_y);
        assert_eq!(
            s.stats().lost_writes,
            1,
            "one chunk lost, counted {}",
            s.stats().lost_writes
        );
    }

    /// QA (RESP): one put evicted three small dirty chunks and a large one
    /// at once with the writer idle; the large one's bytes counted against
    /// the small ones (all spilled before any was handed off), which were
    /// dropped unwritten, and a chunk over `spill_limit` could wait only
    /// alone. What waited before the put is what counts.
    #[test]
    fn one_puts_evictions_do_not_count_against_each_other() {
        let dir = tempfile::tempdir().unwrap();
        let dev = file(dir.path(), 16 << 20);
        let (s, ns) = open_with(dir.path(), dev, 1 << 20, NO_IDLE, |c| {
            c.spill_limit = Some(128 * KIB as u64);
        });
        let id = |n: u64| ChunkId::new(ns, key(n), 0);
        for n in 1..=3 {
            s.put(id(n), Bytes::from(vec![n as u8; 4 * KIB])).unwrap();
        }
        for n in 10..13 {
            s.put(id(n), data(n, 1)).unwrap();
        }
        s.put(id(20), Bytes::from(vec![20u8; 400 * KIB])).unwrap();
        s.flush().unwrap();
        assert_eq!(s.stats().dropped_unwritten, 0);
        for n in 1..=3 {
            assert_eq!(
                s.get(&id(n)).map(|h| h.data),
                Some(Bytes::from(vec![n as u8; 4 * KIB]))
            );
        }
        assert_eq!(s.get(&id(10)).map(|h| h.data), Some(data(10, 1)));
    }

    /// Review: the same QA case with the large value evicted first (it is
    /// the oldest): a first fix counted the evictions handed off before a
    /// chunk against it, and dropped the small ones after the large one
    /// unwritten with the disk idle.
    #[test]
    fn one_puts_evictions_do_not_count_against_each_other_in_either_order() {
        let dir = tempfile::tempdir().unwrap();
        let dev = file(dir.path(), 16 << 20);
        let (s, ns) = open_with(dir.path(), dev, 4 << 20, NO_IDLE, |c| {
            c.spill_limit = Some(128 * KIB as u64);
        });
        let id = |n: u64| ChunkId::new(ns, key(n), 0);
        s.put(id(20), Bytes::from(vec![20u8; 400 * KIB])).unwrap();
        for n in 1..=3 {
            s.put(id(n), Bytes::from(vec![n as u8; 4 * KIB])).unwrap();
        }
        // Evicts all four in one call: 20 first (oldest), then 1..=3.
        s.put(id(30), Bytes::from(vec![30u8; 1020 * KIB])).unwrap();
        s.flush().unwrap();
        assert_eq!(
            s.stats().dropped_unwritten,
            0,
            "small keys dropped with the disk idle"
        );
        for n in 1..=3 {
            assert!(s.get(&id(n)).is_some(), "key {n} lost");
        }
    }

    /// Review: a flush's chunk written by its eviction's job (durable), whose
    /// region the log then reclaims before the flush's own job reaches the
    /// writer: `wanted` finds no copy and counts it failed.
    #[test]
    fn a_flush_does_not_count_failed_a_chunk_its_eviction_wrote() {
        let dir = tempfile::tempdir().unwrap();
        let dev = Arc::new(HoldingDevice::new(file(dir.path(), 6 << 20)));
        let (s, ns) = open_with(dir.path(), dev.clone(), 1 << 20, NO_IDLE, |c| {
            c.spill_limit = Some(64 << 20);
            c.writer_queue = 1024;
        });
        let inner = &s.inner;
        let id = |n: u64| ChunkId::new(ns, key(n), 0);
        s.put(id(9999), Bytes::from(vec![1u8; 4096])).unwrap();
        s.flush().unwrap();
        let x = id(1);
        s.put(x, data(1, 1)).unwrap();
        let walk = inner.flush_walk();
        dev.hold_writes();
        let held = Released(&dev);
        for n in 100..140 {
            s.put(id(n), data(n, 1)).unwrap();
        }
        assert!(
            inner.ram.peek(&x).is_none() && inner.ram.contains(&x),
            "x spilled"
        );
        std::thread::scope(|scope| {
            let f = scope.spawn(|| inner.flush_walked(walk, None));
            until("the flush's job of x sent", || {
                inner.pending.lock().get(&x).map(|p| p.jobs) == Some(2)
            });
            drop(held);
            let r = f.join().unwrap().unwrap();
            assert_eq!(s.stats().dropped_unwritten + s.stats().lost_writes, 0);
            assert_eq!(r.failed, 0, "x was written by its eviction: {r:?}");
        });
    }

    /// Review: a flush's chunk that a `no-tax` eviction dropped unwritten
    /// (past `spill_limit`) after the flush's walk was not counted: the
    /// flush said every chunk dirty at its call was written.
    #[test]
    fn a_flush_counts_its_chunk_dropped_unwritten_as_failed() {
        let dir = tempfile::tempdir().unwrap();
        let dev = Arc::new(HoldingDevice::new(file(dir.path(), 16 << 20)));
        let (s, ns) = open_with(dir.path(), dev.clone(), 1 << 20, NO_IDLE, |c| {
            c.writer_queue = 1;
            c.spill_limit = Some(256 * KIB as u64);
        });
        let inner = &s.inner;
        let id = |n: u64| ChunkId::new(ns, key(n), 0);
        s.put(id(9999), Bytes::from(vec![1u8; 4096])).unwrap();
        s.flush().unwrap();
        dev.hold_writes();
        let held = Released(&dev);
        let (w, x) = (id(1), id(2));
        s.put(w, data(1, 1)).unwrap();
        std::thread::scope(|scope| {
            // The first flush's write of w holds the writer.
            let first = scope.spawn(|| s.flush());
            assert!(dev.wait_held(1, WAIT), "w's write in flight");
            s.put(x, data(2, 1)).unwrap();
            let second = scope.spawn(|| s.flush());
            until("the second flush's walk", || {
                inner.pending.lock().contains_key(&x)
            });
            // Evict w (its hand-off waits beside the full queue), then x:
            // past the spill limit, dropped unwritten.
            let mut n = 10;
            while inner.ram.peek_any(&x).is_some() {
                assert!(n < 20, "x never evicted");
                s.put(id(n), data(n, 1)).unwrap();
                n += 1;
            }
            assert_eq!(s.stats().dropped_unwritten, 1);
            drop(held);
            assert_eq!(first.join().unwrap().unwrap().failed, 0);
            let r = second.join().unwrap().unwrap();
            assert_eq!(r.failed, 1, "x was dropped, not written: {r:?}");
        });
        assert!(s.get(&x).is_none());
        assert_eq!(s.get(&w).map(|h| h.data), Some(data(1, 1)));
    }

    /// Review: the idle pass re-queues a dirty chunk whose write
    /// is still in flight (the queue is empty once the writer took it):
    /// the same version is written again, once per idle period.
    #[test]
    fn idle_pass_does_not_rewrite_a_chunk_in_flight() {
        let dir = tempfile::tempdir().unwrap();
        let (s, ns, dev) = setup(dir.path(), Duration::from_millis(40));
        let id = |n: u64| ChunkId::new(ns, key(n), 0);
        s.put(id(1), Bytes::from(vec![1u8; 4096])).unwrap();
        s.flush().unwrap();
        let d0 = s.stats().disk_writes;
        dev.hold_writes();
        s.put(id(2), data(2, 1)).unwrap();
        assert!(dev.wait_held(1, WAIT), "the idle pass's write");
        std::thread::sleep(Duration::from_millis(300));
        dev.release();
        // Not a flush: one called before the write landed writes the
        // chunk again itself (still dirty at its walk).
        until("the chunk clean", || s.stats().dirty_bytes == 0);
        std::thread::sleep(Duration::from_millis(100));
        let writes = s.stats().disk_writes - d0;
        assert_eq!(
            writes, 1,
            "one dirty chunk, written {writes} times by idle passes"
        );
    }

    /// Review: under no-tax, a hand-off waiting beside the queue
    /// whose chunk is still spilled is counted twice against `spill_limit`
    /// (in `spilled_bytes` and in `overflow_bytes`): dirty evictions are
    /// dropped while the memory waiting for the writer is well below it.
    #[test]
    fn spill_limit_counts_a_chunk_waiting_beside_the_queue_once() {
        let dir = tempfile::tempdir().unwrap();
        let dev = Arc::new(HoldingDevice::new(file(dir.path(), 16 << 20)));
        let limit = 2u64 << 20;
        let (s, ns) = open_with(dir.path(), dev.clone(), 1 << 20, NO_IDLE, |c| {
            c.writer_queue = 1;
            c.spill_limit = Some(limit);
        });
        s.put(ChunkId::new(ns, key(9999), 0), Bytes::from(vec![1u8; 4096]))
            .unwrap();
        s.flush().unwrap();
        dev.hold_writes();
        let held = Released(&dev);
        let mut n = 0;
        let mut waiting_at_drop = None;
        while waiting_at_drop.is_none() {
            assert!(n < 40, "nothing dropped");
            s.put(ChunkId::new(ns, key(n), 0), data(n, 3)).unwrap();
            n += 1;
            if n == 6 {
                assert!(dev.wait_held(1, WAIT), "the writer is in a write");
            }
            if s.stats().dropped_unwritten > 0 {
                // What waits for the writer now, plus the chunk dropped.
                waiting_at_drop = Some(s.stats().spilled_bytes + s.ram_charge(256 * KIB as u64, 0));
            }
        }
        drop(held);
        let w = waiting_at_drop.unwrap();
        assert!(
            w > limit,
            "dropped with {w} bytes waiting (spill_limit {limit})"
        );
    }
}

/// Buckets of [`ChunkStore::deletions_of`].
const DELETION_BUCKETS: usize = 1024;

fn deletion_bucket(id: &ChunkId) -> usize {
    (crate::index::hash_id(id) >> 40) as usize % DELETION_BUCKETS
}

/// The error of a flush whose deadline passed.
fn flush_deadline() -> Error {
    Error::Deadline("the flush did not finish within its deadline".into())
}
