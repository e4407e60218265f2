//! The writer thread (`kvtier-writer`): the only code that writes the store
//! file. It takes jobs from a bounded channel, gathers them into large
//! aligned batches (one `pwrite` each), appends them to the open region,
//! seals full regions (summary + seal slot + fdatasync), opens the next
//! region (a free one, else it reclaims the oldest sealed region, FIFO by
//! generation, removing its index entries first), and answers flush markers
//! after an fdatasync.
//!
//! A failed write or sync poisons the disk tier until reopen (STYLE.md rule
//! 8), except ENOSPC from a write, which pauses the writer: the batch fails
//! (or the region switch: a full region whose seal failed takes no more
//! batches), the writer keeps serving and tries again with the next batch.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use bytes::Bytes;
use crossbeam_channel::{Receiver, Sender, bounded};

use crate::device::{AlignedBuf, BLOCK, Device, block_up};
use crate::format::ChunkHeader;
use crate::index::Location;
use crate::layout::{
    BATCH_FIXED, BatchHead, DATA_START, Entry, KIND_CHUNK, KIND_TOMBSTONE, OPEN_SLOT, RECORD_ALIGN,
    SEAL_SLOT, SealSlot, decode_entries, encode_entries, encode_open_slot, entries_len_bound,
};
use crate::pack::{Packer, Part};
use crate::segment::{Disk, DiskCounters, Recovered, Unsealed};
use crate::types::ChunkId;
use crate::{Error, Result};

/// Counts what a flush's jobs became.
#[derive(Default)]
pub(crate) struct Ticket {
    pub written: AtomicU64,
    pub bytes: AtomicU64,
    pub failed: AtomicU64,
    /// Atomic groups whose version of an id was written before this
    /// flush's job of an older version, which was dropped for it
    /// ([`Hooks::wanted`]): the flush then writes the rest of each group,
    /// so that the version it stands for is whole on disk when it returns.
    pub groups: parking_lot::Mutex<Vec<u64>>,
}

/// One chunk to write.
pub(crate) struct Job {
    pub id: ChunkId,
    pub name: Option<Bytes>,
    pub data: Bytes,
    /// RAM sequence number when the job came from a RAM entry (flush, idle):
    /// the entry is marked clean after the write if its seq is unchanged.
    pub ram_seq: Option<u64>,
    /// Set by the writer: the job's version was put after a cancellation of
    /// its id that was pending when the job was packed.
    pub after_cancel: bool,
    /// Set by [`Hooks::wanted`]: a flush's job of a version overwritten
    /// since; written (the flush covers it) but never indexed.
    pub superseded: bool,
    /// RAM sequence number of the spilled entry this job writes (an
    /// eviction's): the store unspills it once the job is written, failed
    /// or no longer wanted.
    pub spill_seq: Option<u64>,
    /// When this version was put (a delete after it cancels the job).
    pub inserted: Instant,
    /// Counts the job among its id's writes not done yet
    /// ([`PendingWrite`]) until it is dropped.
    pub _pending: PendingWrite,
    pub txn: u64,
    pub txn_size: u32,
    pub created_ms: u64,
    pub ticket: Option<Arc<Ticket>>,
    /// A replaced or deleted member's version, written only so that its
    /// atomic group is found whole at recovery; never indexed (see
    /// `Inner::write_for_group`).
    pub for_group: bool,
}

/// An id's entry in the store's map of writes not done yet
/// ([`PendingWrite`]).
#[derive(Default)]
pub(crate) struct Pending {
    /// Write jobs of the id queued, packed or in flight.
    pub jobs: u32,
    /// The newest RAM version (sequence number) of the id that a job wrote
    /// while this entry lived: a flush's job of an older version
    /// (overwritten since) is dropped then ([`Hooks::wanted`]), since it
    /// would follow that record in the log and win at recovery. 0: none.
    pub written: u64,
    /// The atomic group of that version (0: none): the flush that dropped
    /// its older job then writes the rest of the group
    /// ([`Ticket::groups`]).
    pub written_txn: u64,
}

/// The store's map of writes not done yet, per id.
pub(crate) type PendingMap = Arc<parking_lot::Mutex<std::collections::HashMap<ChunkId, Pending>>>;

/// Counts one write job of `id` in the store's map of writes not done yet
/// (queued, packed or in flight) until the job is dropped: after it was
/// indexed, failed, skipped or not queued at all. A put of an id with a
/// count asks for its older versions' writes to be cancelled
/// (`Inner::supersede`). A flush takes its count before it reads the
/// version to write, so that a put after that read sees it.
pub(crate) struct PendingWrite {
    map: PendingMap,
    id: ChunkId,
}

impl PendingWrite {
    /// Counts a job of `id` in `map`.
    pub(crate) fn new(map: &PendingMap, id: ChunkId) -> Self {
        map.lock().entry(id).or_default().jobs += 1;
        Self {
            map: Arc::clone(map),
            id,
        }
    }
}

impl Drop for PendingWrite {
    fn drop(&mut self) {
        let mut m = self.map.lock();
        if let Some(n) = m.get_mut(&self.id) {
            n.jobs -= 1;
            if n.jobs == 0 {
                m.remove(&self.id);
            }
        }
    }
}

/// Messages to the writer thread.
pub(crate) enum Msg {
    Write(Job),
    /// One call's dirty evictions, handed off together.
    Writes(Vec<Job>),
    /// Persist the deletion of an id (deleted at `.1`).
    Tombstone(ChunkId, Instant),
    /// `.2` cancellations of `id`'s jobs, the latest made at `.1` (its
    /// atomic group broke, or an overwrite superseded it), may be forgotten
    /// once every job queued before this message is done.
    Forget(ChunkId, Instant, u32),
    /// Write everything queued before, fdatasync, then answer.
    Flush(Sender<Result<()>>),
    /// Like `Flush`, then exit.
    Stop(Sender<Result<()>>),
    /// Seal regions recovered from batch records, then answer.
    SealRecovered(Sender<Result<()>>),
    /// Write everything queued before, seal the open region (the next
    /// batch opens another) and clear the open slots of the regions
    /// recovery found empty ([`Recovered::emptied`]), then answer whether
    /// anything was written.
    SealOpen(Sender<Result<bool>>),
}

/// What the writer tells the store about.
pub(crate) trait Hooks: Send + Sync {
    /// Whether the job is still wanted before it is written (not deleted,
    /// superseded or already written meanwhile); sets `job.superseded` for
    /// a flush's job whose version was overwritten since.
    fn wanted(&self, job: &mut Job) -> bool;
    /// The time of `id`'s pending cancellation, if any.
    fn cancel_time(&self, id: &ChunkId) -> Option<Instant>;
    /// Whether the job was cancelled (its chunk deleted, or its atomic group
    /// broke) after it was queued. Asked under the index's write lock when
    /// the written job is indexed: a delete records its cancellation and
    /// removes the id from the index under that lock (a broken group
    /// records it before taking the lock), so a cancelled job is never
    /// indexed after the id was taken out of the index.
    fn cancelled(&self, job: &Job) -> bool;
    /// The job's chunk is written (not yet durable).
    fn written(&self, job: &Job);
    /// The job's chunk could not be written.
    fn failed(&self, job: &Job);
    /// A bound on the RAM versions that exist now (every one has a lower
    /// sequence number), taken under the index lock as a reclaim removes
    /// its entries, for [`Hooks::reclaimed`].
    fn ram_seq(&self) -> u64;
    /// These entries left the index because their region was reclaimed;
    /// `ram_seq`: [`Hooks::ram_seq`] while they did (a RAM version from
    /// then on never had their disk copy).
    fn reclaimed(&self, r: u32, removed: Vec<(ChunkId, Location)>, ram_seq: u64);
    /// Region `r` now holds entries of these atomic groups (indexed or
    /// not): reclaiming it takes a member from each.
    fn group_entries(&self, r: u32, txns: Vec<u64>);
    /// A tombstone for `id` deleted at `at` was written, or (for
    /// [`Msg::Forget`]) every job queued before it is done: cancellations of
    /// `id` made at or before `at` are no longer needed.
    fn tombstone_done(&self, id: &ChunkId, at: Instant);
    /// The `no-tax` eviction hand-offs that found the queue full and wait
    /// beside it (taken in order; see `Inner::handle_evicted`). `closing`:
    /// the writer stops, and later hand-offs are refused.
    fn take_overflow(&self, closing: bool) -> Vec<Job>;
}

struct OpenRegion {
    r: u32,
    generation: u64,
    data_end: u64,
    entries: Vec<Entry>,
    /// Re-opened after recovery with its old generation: blocks past the
    /// data end may hold leftover batch records of this generation (written
    /// before the crash, never made durable in order), so each batch first
    /// makes sure the block right after it holds none.
    reused: bool,
    /// Its last batch holds chunks or tombstones: a clean stop ends it with
    /// a marker ([`Writer::mark_stop`]).
    marker_owed: bool,
}

pub(crate) struct Writer {
    disk: Arc<Disk>,
    hooks: Arc<dyn Hooks>,
    /// Per region: generation (0 = free) and whether sealed.
    regions: Vec<(u64, bool)>,
    open: Option<OpenRegion>,
    /// Bumped at each failed batch: the I/O thread skips the batches packed
    /// before the writer saw the failure.
    epoch: u64,
    next_generation: u64,
    batch_bytes: usize,
    /// Spare batch buffers (reused: fresh ones pay page faults).
    spare: Vec<AlignedBuf>,
    recovered: Vec<Unsealed>,
    /// [`Recovered::emptied`], until `SealOpen` clears their open slots.
    emptied: Vec<u32>,
    /// [`Recovered::damaged_slots`], until `SealOpen` rewrites them.
    damaged_slots: Vec<(u32, Option<u64>)>,
    /// Regions whose damaged open slot left their generation unknown:
    /// records of it may lie anywhere in them, so a region opened there
    /// checks the block after each batch ([`OpenRegion::reused`]).
    suspect: Vec<u32>,
    /// A full region whose seal failed with ENOSPC (the writer paused): it
    /// takes no more batches, and is sealed before any other region opens.
    unsealed_full: Option<OpenRegion>,
    /// Batches handed to the I/O thread, oldest first (it writes them in
    /// order); at most `depth`.
    inflight: VecDeque<InFlight>,
    depth: usize,
    io: Option<IoLink>,
    packer: Packer,
    /// Spilled versions whose writes a close past its deadline dropped
    /// (counted once in `Disk::abandoned_bytes`).
    abandoned: std::collections::HashSet<(ChunkId, u64)>,
    /// For ids with a pending cancellation: the newest `inserted` of the
    /// jobs written (and indexed) since that are newer than it (versions put
    /// after the delete). A tombstone older than such a version is not
    /// written: its record would come after the newer version's in the log
    /// and delete it at recovery. An entry goes once its id has no pending
    /// cancellation left (after a tombstone or forget is handled).
    newer: std::collections::HashMap<ChunkId, Instant>,
    /// Jobs marked `after_cancel` packed and not yet written or failed, per
    /// id: a tombstone of that id waits for them before it is decided.
    unfinished: std::collections::HashMap<ChunkId, u32>,
    /// Jobs with a RAM version packed and not yet written or failed, per id:
    /// how many, and the newest version (sequence number). A flush's job of
    /// an older version waits for them before it is decided
    /// ([`Hooks::wanted`] drops it once a newer version is written, and
    /// must write it when that write failed; review: decided while the
    /// newer one was still packed, it was written after it).
    packed: hashbrown::HashMap<ChunkId, (u32, u64)>,
    /// Tombstones whose batch failed while the disk was not poisoned (the
    /// ENOSPC pause): written again ahead of the next items or flush.
    retry_tombs: Vec<(ChunkId, Instant)>,
    /// Deletes whose tombstone failed, kept durable until one is written
    /// (`crate::deletes`).
    journal: crate::deletes::Journal,
    /// When the oldest batch written since the last fdatasync was written:
    /// the writer syncs once it has had nothing to do for [`QUIET_SYNC`], or
    /// when its queue is empty and that batch is [`MAX_UNSYNCED`] old
    /// ([`Writer::next_msg`]).
    unsynced: Option<Instant>,
    /// When the writer last took a message.
    last_msg: Instant,
}

/// How long the writer waits with nothing to do before it makes the batches
/// it wrote since its last fdatasync durable. Idle-pass and eviction writes
/// otherwise stayed in the device's volatile cache until the next flush or
/// region seal (a power loss could lose chunks the stats called written).
/// Only a writer with an empty queue syncs, so no put or write waits for it.
pub(crate) const QUIET_SYNC: std::time::Duration = std::time::Duration::from_millis(200);

/// The longest a written batch waits for that sync while writes keep
/// trickling in (each restarting the quiet time): a steady trickle had
/// kept every write unsynced until the region filled (review).
pub(crate) const MAX_UNSYNCED: std::time::Duration = std::time::Duration::from_secs(1);

/// Batches in flight to the I/O thread: while it writes one, the next ones
/// wait in its queue, so the device never idles while the writer packs
/// (copy + CRC) or wakes up.
const IO_DEPTH: usize = 3;

/// Channels to the I/O thread (`kvtier-io`): it writes batches in order
/// while the writer packs the next, so copying and CRCs overlap the I/O.
struct IoLink {
    /// A batch, its offset, and the writer's epoch when it was packed.
    req: Sender<(AlignedBuf, u64, u64)>,
    done: Receiver<(AlignedBuf, std::io::Result<()>)>,
}

/// A packed batch submitted to the I/O thread, applied when it completes.
struct InFlight {
    r: u32,
    /// Data end of the region before this batch (rolled back on failure).
    start: u64,
    /// Length of the open region's entry list before this batch.
    entries_before: usize,
    total: u64,
    items: Vec<Item>,
    entries: Vec<Entry>,
}

enum Item {
    Job(Job),
    Tomb(ChunkId, Instant),
}

impl Item {
    fn record_len(&self) -> u64 {
        match self {
            Item::Job(j) => {
                (ChunkHeader::encoded_len_for_name(j.name.as_ref().map_or(0, |n| n.len())) as u64
                    + j.data.len() as u64)
                    .next_multiple_of(RECORD_ALIGN)
            }
            Item::Tomb(..) => 0,
        }
    }
}

/// The largest payload a chunk with a name of `name_len` bytes may have to
/// fit, with its header, one batch head and a summary entry, in an empty
/// region of `region_size` bytes ([`Writer::pack`]'s test for one chunk).
/// Larger chunks could never be written: the store refuses them at the put.
pub(crate) fn max_payload_len(region_size: u64, name_len: usize) -> u64 {
    let head = block_up(BATCH_FIXED as u64 + entries_len_bound(1));
    let summary = block_up(entries_len_bound(1));
    let room = region_size.saturating_sub(DATA_START + summary + head);
    let record = room / RECORD_ALIGN * RECORD_ALIGN;
    record.saturating_sub(ChunkHeader::encoded_len_for_name(name_len) as u64)
}

/// Writes one batch. Failpoint `tier::writer::batch_write` (feature
/// `failpoints`): fails it with ENOSPC when its argument is `enospc`, else EIO.
/// Its time goes into `counters.write_micros`.
fn write_batch(
    dev: &dyn Device,
    counters: &DiskCounters,
    buf: &[u8],
    off: u64,
) -> std::io::Result<()> {
    #[cfg(feature = "failpoints")]
    fail::fail_point!("tier::writer::batch_write", |arg| Err(
        crate::segment::failpoint_error(arg)
    ));
    let t = Instant::now();
    let res = dev.write_at(buf, off);
    DiskCounters::add_time(&counters.write_micros, t);
    counters.batch_writes.fetch_add(1, Ordering::Relaxed);
    res
}

/// The fdatasync of a flush. Failpoint `tier::writer::flush_sync` (feature
/// `failpoints`): fails it with EIO.
fn flush_sync(disk: &Disk) -> std::io::Result<()> {
    #[cfg(feature = "failpoints")]
    fail::fail_point!("tier::writer::flush_sync", |arg| Err(
        crate::segment::failpoint_error(arg)
    ));
    disk.sync()
}

/// The I/O thread (`kvtier-io`): writes the batches in order and answers
/// each. After a failed write, the batches queued behind it (packed in the
/// same epoch, before the writer saw the failure) are answered with an
/// error unwritten: nothing lands behind the hole, not even in the next
/// region.
fn io_loop(
    dev: &dyn Device,
    counters: &DiskCounters,
    req: Receiver<(AlignedBuf, u64, u64)>,
    done: Sender<(AlignedBuf, std::io::Result<()>)>,
) {
    let mut failed_epoch = None;
    for (buf, off, epoch) in req {
        let res = if failed_epoch == Some(epoch) {
            Err(std::io::Error::other(
                "not written: an earlier batch failed",
            ))
        } else {
            write_batch(dev, counters, &buf, off)
        };
        if res.is_err() {
            failed_epoch = Some(epoch);
        }
        if done.send((buf, res)).is_err() {
            return;
        }
    }
}

impl Writer {
    pub fn new(
        disk: Arc<Disk>,
        hooks: Arc<dyn Hooks>,
        rec: Recovered,
        batch_bytes: usize,
        pack_helpers: usize,
        journal: crate::deletes::Journal,
    ) -> Self {
        let open = rec.reopen.map(|u| {
            tracing::info!(
                region = u.r,
                generation = u.generation,
                data_end = u.data_end,
                entries = u.entries.len(),
                "re-opened the region that was open at shutdown for appends"
            );
            OpenRegion {
                r: u.r,
                generation: u.generation,
                data_end: u.data_end,
                marker_owed: !u.ends_marked,
                entries: u.entries,
                reused: true,
            }
        });
        Self {
            disk,
            hooks,
            regions: rec.regions,
            open,
            epoch: 0,
            next_generation: rec.max_generation + 1,
            batch_bytes,
            spare: Vec::new(),
            recovered: rec.unsealed,
            emptied: rec.emptied,
            suspect: rec
                .damaged_slots
                .iter()
                .filter(|(_, g)| g.is_none())
                .map(|(r, _)| *r)
                .collect(),
            damaged_slots: rec.damaged_slots,
            unsealed_full: None,
            inflight: VecDeque::new(),
            depth: IO_DEPTH,
            io: None,
            packer: Packer::new(pack_helpers),
            abandoned: std::collections::HashSet::new(),
            newer: std::collections::HashMap::new(),
            unfinished: std::collections::HashMap::new(),
            packed: hashbrown::HashMap::new(),
            retry_tombs: Vec::new(),
            journal,
            unsynced: None,
            last_msg: Instant::now(),
        }
    }

    /// The thread body: starts the I/O thread, then serves messages.
    pub fn run(mut self, rx: Receiver<Msg>) {
        let disk = self.disk.clone();
        // Never more than `depth` batches are outstanding, so neither
        // channel ever blocks its sender.
        let (req_tx, req_rx) = bounded::<(AlignedBuf, u64, u64)>(self.depth);
        let (done_tx, done_rx) = bounded(self.depth);
        let io = std::thread::Builder::new()
            .name("kvtier-io".into())
            .spawn(move || io_loop(&*disk.dev, &disk.counters, req_rx, done_tx));
        match io {
            Ok(_) => {
                self.io = Some(IoLink {
                    req: req_tx,
                    done: done_rx,
                })
            }
            Err(e) => tracing::warn!(error = %e, "no kvtier-io thread; writing inline"),
        }
        /// Marks the writer stopped however `serve` ends (a panic too), so
        /// no flush waits for an answer that cannot come.
        struct Stopped(Arc<Disk>);
        impl Drop for Stopped {
            fn drop(&mut self) {
                self.0.writer_stopped.store(true, Ordering::SeqCst);
            }
        }
        let _stopped = Stopped(self.disk.clone());
        self.serve(&rx);
        // Dropping the link ends the I/O thread.
        self.io = None;
    }

    fn serve(&mut self, rx: &Receiver<Msg>) {
        let mut items: Vec<Item> = Vec::new();
        let mut forgets: Vec<(ChunkId, Instant, u32)> = Vec::new();
        while let Some(msg) = self.next_msg(rx) {
            let mut control = None;
            let mut bytes = 0usize;
            let push = |m: Msg,
                        items: &mut Vec<Item>,
                        forgets: &mut Vec<(ChunkId, Instant, u32)>,
                        bytes: &mut usize| match m {
                Msg::Write(j) => {
                    *bytes += j.data.len();
                    items.push(Item::Job(j));
                    None
                }
                Msg::Writes(js) => {
                    for j in js {
                        *bytes += j.data.len();
                        items.push(Item::Job(j));
                    }
                    None
                }
                Msg::Tombstone(id, seq) => {
                    items.push(Item::Tomb(id, seq));
                    None
                }
                Msg::Forget(id, at, n) => {
                    forgets.push((id, at, n));
                    None
                }
                other => Some(other),
            };
            control = control.or(push(msg, &mut items, &mut forgets, &mut bytes));
            while control.is_none() && bytes < self.batch_bytes {
                match rx.try_recv() {
                    Ok(m) => control = push(m, &mut items, &mut forgets, &mut bytes),
                    Err(_) => break,
                }
            }
            // Hand-offs that found the queue full wait beside it, behind
            // every message sent before them: taken once the queue is empty
            // (everything sent before them is in `items` or done), so they
            // never overtake an earlier message (review: one overtook a
            // flush's job of an older version, which a restart then served).
            if rx.is_empty() {
                for j in self.hooks.take_overflow(false) {
                    items.push(Item::Job(j));
                }
            }
            let retried = !self.retry_tombs.is_empty() && (!items.is_empty() || control.is_some());
            if retried {
                // Failed tombstones go first: they were queued before.
                let retry = std::mem::take(&mut self.retry_tombs);
                items.splice(0..0, retry.into_iter().map(|(id, at)| Item::Tomb(id, at)));
            }
            if !items.is_empty() {
                // Tombstones superseded by a newer version are not written;
                // their cancellations are forgotten like a `Forget`'s.
                let superseded = self.write_items(std::mem::take(&mut items));
                forgets.extend(superseded.into_iter().map(|(id, at)| (id, at, 1)));
            }
            if retried && control.is_none() && !self.journal.ids().is_empty() {
                // The journal holds deletes the disk refused (all retried
                // with this batch; the ones replayed at open are cleared by
                // the open's flush, or failed again into the retries): once
                // this batch is on disk and synced, the journal goes without
                // waiting for a flush or the stop (until then a crash's
                // replay also deletes versions put after those deletes).
                self.drain();
                if self.retry_tombs.is_empty() {
                    let r = self.sync();
                    self.clear_journal(&r);
                }
            }
            if !forgets.is_empty() {
                // Every job queued before these messages is written (or
                // skipped) once the batches in flight are done.
                self.drain();
                for (id, at, n) in forgets.drain(..) {
                    for _ in 0..n {
                        self.hooks.tombstone_done(&id, at);
                    }
                    self.forget_newer(&id);
                }
            }
            if control.is_some() {
                self.drain();
            }
            match control {
                None => {}
                Some(Msg::Flush(ack)) => {
                    self.count_unwritten_tombstones();
                    let r = self.sync();
                    self.clear_journal(&r);
                    let _ = ack.send(r);
                }
                Some(Msg::SealRecovered(ack)) => {
                    let _ = ack.send(self.seal_recovered());
                }
                Some(Msg::SealOpen(ack)) => {
                    let r = match self.open.take() {
                        // An empty region stays open: nothing to list.
                        Some(o) if o.entries.is_empty() => {
                            self.open = Some(o);
                            Ok(false)
                        }
                        Some(mut o) => {
                            let r = self.seal(&mut o);
                            if r.is_err() {
                                self.open = Some(o);
                            }
                            r.map(|()| true)
                        }
                        None => Ok(false),
                    };
                    let r = r.and_then(|sealed| Ok(self.repair_slots()? || sealed));
                    let _ = ack.send(r);
                }
                Some(Msg::Stop(ack)) => {
                    let unwritten = self.count_unwritten_tombstones();
                    if unwritten > 0 {
                        tracing::error!(
                            deletes = unwritten,
                            "the writer stops with deletes neither the disk (ENOSPC) nor the \
                             deletes journal took: chunks they deleted may be back after the restart"
                        );
                    }
                    let r = self.sync();
                    // The journal first: a marker whose write fails poisons
                    // the disk, which would keep it (its replay at the next
                    // open deletes versions written after its deletes).
                    self.clear_journal(&r);
                    if r.is_ok() {
                        self.mark_stop();
                    }
                    let _ = ack.send(r);
                    // Whatever raced the stop into the queue is not written:
                    // say so (a spilled chunk's RAM copy goes); deletes go
                    // to the journal, for the next open to replay.
                    let mut tombs = Vec::new();
                    for j in self.hooks.take_overflow(true) {
                        self.hooks.failed(&j);
                    }
                    for m in rx.try_iter() {
                        match m {
                            Msg::Write(j) => self.hooks.failed(&j),
                            Msg::Writes(js) => js.iter().for_each(|j| self.hooks.failed(j)),
                            Msg::Flush(ack) | Msg::Stop(ack) | Msg::SealRecovered(ack) => {
                                let _ = ack.send(Err(Error::Closed));
                            }
                            Msg::SealOpen(ack) => {
                                let _ = ack.send(Err(Error::Closed));
                            }
                            Msg::Tombstone(id, _) => tombs.push(id),
                            Msg::Forget(..) => {}
                        }
                    }
                    self.journal_deletes(&tombs);
                    return;
                }
                Some(Msg::Write(_) | Msg::Writes(_) | Msg::Tombstone(..) | Msg::Forget(..)) => {
                    unreachable!("handled by push")
                }
            }
        }
        self.drain();
    }

    /// The next message; while batches are in flight, their completions
    /// are applied as they come (their chunks become readable from disk).
    /// A writer with nothing to do for [`QUIET_SYNC`] (or with an empty
    /// queue and a batch written [`MAX_UNSYNCED`] ago) syncs what it wrote
    /// since its last fdatasync.
    fn next_msg(&mut self, rx: &Receiver<Msg>) -> Option<Msg> {
        let m = self.wait_msg(rx);
        self.last_msg = Instant::now();
        m
    }

    /// [`Writer::next_msg`]'s wait.
    fn wait_msg(&mut self, rx: &Receiver<Msg>) -> Option<Msg> {
        loop {
            let done = match (&self.io, self.inflight.is_empty()) {
                (Some(io), false) => io.done.clone(),
                _ => match self.unsynced {
                    Some(since) => {
                        let due = (self.last_msg + QUIET_SYNC).min(since + MAX_UNSYNCED);
                        match rx.recv_timeout(due.saturating_duration_since(Instant::now())) {
                            Ok(m) => return Some(m),
                            Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                                self.quiet_sync();
                                continue;
                            }
                            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => {
                                return None;
                            }
                        }
                    }
                    None => return rx.recv().ok(),
                },
            };
            crossbeam_channel::select! {
                recv(rx) -> m => return m.ok(),
                recv(done) -> d => self.on_done(d.ok()),
            }
        }
    }

    fn poison(&self, what: String) {
        tracing::error!(error = %what, "disk tier poisoned until reopen");
        let mut p = self.disk.poison.lock();
        if p.is_none() {
            *p = Some(what);
        }
    }

    fn check_poison(&self) -> Result<()> {
        match self.disk.poisoned() {
            Some(p) => Err(Error::Poisoned(p)),
            None => Ok(()),
        }
    }

    fn sync(&mut self) -> Result<()> {
        self.check_poison()?;
        if let Err(e) = flush_sync(&self.disk) {
            self.poison(format!("fdatasync failed: {e}"));
            return Err(Error::Io {
                op: "sync",
                path: self.disk.dev.path().to_path_buf(),
                source: e,
            });
        }
        self.unsynced = None;
        Ok(())
    }

    /// Ends the open region's chain of batches with an empty one, synced,
    /// once a stop's sync made everything before it durable. Recovery
    /// tells a torn last batch (a crash's, never flushed: dropped quietly)
    /// from damage only by an intact batch after it; this marker is that
    /// batch, so bit rot in the entry list of the last batch before a clean
    /// stop is reported, not taken for a torn write (QA: one flipped byte
    /// lost every chunk of that batch with `verify` exiting 0). Costs one
    /// block per stop that follows writes; skipped where the region has no
    /// room left for it, and a failure only warns (everything it marks is
    /// already durable; a torn marker is a torn tail of no chunks).
    fn mark_stop(&mut self) {
        let Some(o) = &self.open else { return };
        let head = block_up(BATCH_FIXED as u64 + entries_len_bound(0));
        let summary = block_up(entries_len_bound(o.entries.len()));
        if !o.marker_owed || o.data_end + head + summary > self.disk.region_size {
            return;
        }
        let (r, at) = (o.r, o.data_end);
        self.submit(Vec::new());
        self.drain();
        // A failed write rolls the data end back (ENOSPC pauses, anything
        // else poisons).
        let landed = self
            .open
            .as_ref()
            .is_some_and(|o| o.r == r && o.data_end == at + head);
        if !landed {
            tracing::warn!(
                region = r,
                "the clean-stop marker's write failed (logged above)"
            );
        } else if let Err(e) = self.check_poison().and_then(|()| self.sync()) {
            tracing::warn!(region = r, "syncing the clean-stop marker failed: {e}");
        }
    }

    /// The sync of a quiet writer ([`QUIET_SYNC`]): a failure poisons the
    /// disk tier as a flush's does (the next flush reports it).
    fn quiet_sync(&mut self) {
        self.unsynced = None;
        if self.disk.poisoned().is_some() {
            return;
        }
        let r = self.sync();
        self.clear_journal(&r);
    }

    /// Removes the deletes journal once a sync succeeded with no tombstone
    /// left to write: every delete in it is on disk.
    fn clear_journal(&mut self, synced: &Result<()>) {
        if synced.is_ok() && self.retry_tombs.is_empty() && self.disk.poisoned().is_none() {
            if let Err(e) = self.journal.clear() {
                tracing::warn!(error = %e, "cannot remove the deletes journal (replayed again at the next open)");
            }
        }
    }

    /// Publishes how many tombstones wait to be written again (the disk
    /// refused them with ENOSPC) and are not in the deletes journal either,
    /// for the flush that is answered next.
    fn count_unwritten_tombstones(&self) -> usize {
        let n = self
            .retry_tombs
            .iter()
            .filter(|(id, _)| !self.journal.contains(id))
            .count();
        self.disk
            .counters
            .tombstones_unwritten
            .store(n as u64, Ordering::Relaxed);
        n
    }

    /// Rewrites the open slots recovery found wrong, where the region is
    /// still as recovery left it: zeroed (a free region) for a region open
    /// but empty or whose damaged slot named no known generation; the
    /// recovered generation for the other damaged ones. Then fdatasync:
    /// later opens no longer walk the empty regions, nor count their torn
    /// chunks or the damaged slots. Returns whether it wrote any.
    fn repair_slots(&mut self) -> Result<bool> {
        let open = self.open.as_ref().map(|o| o.r);
        let free = |w: &Self, r: u32| w.regions[r as usize].0 == 0 && open != Some(r);
        let mut writes: Vec<(u32, Option<u64>)> = Vec::new();
        for r in std::mem::take(&mut self.emptied) {
            if free(self, r) {
                writes.push((r, None));
            }
        }
        for (r, g) in std::mem::take(&mut self.damaged_slots) {
            let still = match g {
                Some(g) => self.regions[r as usize].0 == g,
                None => free(self, r),
            };
            if still && !writes.iter().any(|w| w.0 == r) {
                writes.push((r, g));
            }
        }
        if writes.is_empty() {
            return Ok(false);
        }
        self.check_poison()?;
        let mut slot = AlignedBuf::zeroed(BLOCK as usize);
        for &(r, g) in &writes {
            slot.fill(0);
            if let Some(g) = g {
                encode_open_slot(&mut slot, r, g);
            }
            if let Err(e) = self
                .disk
                .dev
                .write_at(&slot, self.disk.region_base(r) + OPEN_SLOT)
            {
                self.poison(format!("rewriting the open slot of region {r} failed: {e}"));
                return Err(Error::Io {
                    op: "rewrite a region's open slot in",
                    path: self.disk.dev.path().to_path_buf(),
                    source: e,
                });
            }
            tracing::info!(region = r, generation = ?g, "rewrote an open slot recovery found empty or damaged");
        }
        self.sync()?;
        Ok(true)
    }

    fn seal_recovered(&mut self) -> Result<()> {
        for u in std::mem::take(&mut self.recovered) {
            self.check_poison()?;
            let mut o = OpenRegion {
                r: u.r,
                generation: u.generation,
                data_end: u.data_end,
                entries: u.entries,
                reused: true,
                marker_owed: false,
            };
            self.seal(&mut o)?;
        }
        Ok(())
    }

    /// Drops the chunk writes among `items` (a close's deadline passed:
    /// what is still queued is lost at the exit anyway, and writing it
    /// would only hold the stop up). Deletes stay, to be written.
    fn abandon_jobs(&mut self, items: &mut std::collections::VecDeque<Item>) {
        for it in std::mem::take(items) {
            match it {
                Item::Job(j) => {
                    // An eviction's (no copy is left in RAM to count),
                    // once per version: a flush's second round may have
                    // queued the same spilled version again.
                    if j.ram_seq.is_none()
                        && j.spill_seq
                            .is_none_or(|seq| self.abandoned.insert((j.id, seq)))
                    {
                        self.disk
                            .abandoned_bytes
                            .fetch_add(j.data.len() as u64, Ordering::Relaxed);
                    }
                    self.settle(&j);
                    self.hooks.failed(&j);
                }
                tomb @ Item::Tomb(..) => items.push_back(tomb),
            }
        }
    }

    fn fail_all(&mut self, items: &[Item]) {
        let mut tombs = Vec::new();
        for it in items {
            match it {
                Item::Job(j) => {
                    self.settle(j);
                    self.disk
                        .counters
                        .write_failures
                        .fetch_add(1, Ordering::Relaxed);
                    self.hooks.failed(j);
                }
                // A delete must reach the disk, or the chunk comes back at
                // recovery: kept in the deletes journal, and retried unless
                // disk writes have stopped.
                Item::Tomb(id, at) => {
                    tombs.push(*id);
                    if self.disk.poisoned().is_none() {
                        self.retry_tombs.push((*id, *at));
                    }
                }
            }
        }
        self.journal_deletes(&tombs);
    }

    /// Makes the deletes of `ids` durable in the deletes journal (one write
    /// and one fdatasync for all of them).
    fn journal_deletes(&mut self, ids: &[ChunkId]) {
        if ids.is_empty() {
            return;
        }
        if let Err(e) = self.journal.add_all(ids) {
            tracing::error!(
                error = %e,
                deletes = ids.len(),
                "cannot record deletes in the deletes journal: the chunks may be back after a restart"
            );
        }
    }

    /// Packs and submits `items` in order; returns the tombstones it did
    /// not write because a newer version of their id is on disk before them
    /// (see `Writer::newer`).
    fn write_items(&mut self, items: Vec<Item>) -> Vec<(ChunkId, Instant)> {
        let mut superseded = Vec::new();
        let mut kept = std::collections::VecDeque::with_capacity(items.len());
        for it in items {
            match it {
                Item::Job(mut j) => {
                    if j.ticket.is_some()
                        && let Some(seq) = j.ram_seq
                        && self
                            .packed
                            .get(&j.id)
                            .is_some_and(|(_, newest)| *newest > seq)
                    {
                        // A newer version of `id` is packed or in flight:
                        // write what comes before this job and wait, so the
                        // decision rests on what reached the disk.
                        self.pack(std::mem::take(&mut kept));
                        self.drain();
                    }
                    if !self.hooks.wanted(&mut j) {
                        continue;
                    }
                    if let Some(seq) = j.ram_seq.or(j.spill_seq) {
                        let e = self.packed.entry(j.id).or_insert((0, seq));
                        e.0 += 1;
                        e.1 = e.1.max(seq);
                    }
                    // A version put after a pending cancellation of its id:
                    // counted until written (`finish`) or failed.
                    if self
                        .hooks
                        .cancel_time(&j.id)
                        .is_some_and(|t| j.inserted > t)
                    {
                        j.after_cancel = true;
                        *self.unfinished.entry(j.id).or_default() += 1;
                    }
                    kept.push_back(Item::Job(j));
                }
                Item::Tomb(id, at) => {
                    if self.unfinished.contains_key(&id) {
                        // A newer version of `id` is packed or in flight:
                        // write what comes before this tombstone and wait,
                        // so the decision rests on what reached the disk.
                        self.pack(std::mem::take(&mut kept));
                        self.drain();
                    }
                    if self.newer.get(&id).is_some_and(|n| *n > at) {
                        superseded.push((id, at));
                    } else {
                        kept.push_back(Item::Tomb(id, at));
                    }
                }
            }
        }
        self.pack(kept);
        superseded
    }

    /// A packed job is written or failed.
    fn settle(&mut self, j: &Job) {
        if j.ram_seq.or(j.spill_seq).is_some()
            && let Some(e) = self.packed.get_mut(&j.id)
        {
            e.0 -= 1;
            if e.0 == 0 {
                self.packed.remove(&j.id);
            }
        }
        if !j.after_cancel {
            return;
        }
        if let Some(n) = self.unfinished.get_mut(&j.id) {
            *n -= 1;
            if *n == 0 {
                self.unfinished.remove(&j.id);
            }
        }
    }

    /// Drops what `newer` keeps for `id` once no cancellation of it is
    /// pending.
    fn forget_newer(&mut self, id: &ChunkId) {
        if self.hooks.cancel_time(id).is_none() {
            self.newer.remove(id);
        }
    }

    /// Packs `items` into batches in order and submits them (failing them
    /// all when the disk is poisoned or no region opens).
    fn pack(&mut self, mut items: std::collections::VecDeque<Item>) {
        let rs = self.disk.region_size;
        while !items.is_empty() {
            if self.disk.abandon_writes.load(Ordering::SeqCst) {
                self.abandon_jobs(&mut items);
                if items.is_empty() {
                    return;
                }
            }
            if self.check_poison().is_err() {
                self.drain();
                self.fail_all(items.make_contiguous());
                return;
            }
            if self.open.is_none() {
                self.drain();
                let opened = match self.unsealed_full.take() {
                    Some(full) => self.seal_and_open_next(full),
                    None => self.open_next_region(),
                };
                if !opened {
                    // Poisoned, or paused by ENOSPC (tried again with the
                    // next items).
                    self.fail_all(items.make_contiguous());
                    return;
                }
            }
            let o = self.open.as_ref().expect("a region is open");
            let mut k = 0;
            let mut data = 0u64;
            while k < items.len() {
                let rec = items[k].record_len();
                let head = block_up(BATCH_FIXED as u64 + entries_len_bound(k + 1));
                let summary = block_up(entries_len_bound(o.entries.len() + k + 1));
                if o.data_end + block_up(head + data + rec) + summary > rs {
                    break;
                }
                data += rec;
                k += 1;
            }
            if k == 0 {
                if o.data_end == DATA_START {
                    // Does not fit even in an empty region: puts refuse such
                    // chunks (`max_payload_len`), so this is only a guard.
                    let it = items.pop_front().expect("not empty");
                    tracing::warn!(
                        len = it.record_len(),
                        region_size = rs,
                        "chunk larger than a region; not written"
                    );
                    self.fail_all(&[it]);
                } else if !self.switch_region() {
                    self.fail_all(items.make_contiguous());
                    return;
                }
                continue;
            }
            let batch: Vec<Item> = items.drain(..k).collect();
            self.submit(batch);
        }
    }

    /// Packs `items` into a batch and hands it to the I/O thread (after
    /// making room: at most `depth` batches in flight).
    fn submit(&mut self, items: Vec<Item>) {
        while self.inflight.len() >= self.depth {
            self.complete_oldest();
        }
        self.reap();
        // A completion may have failed (rolled back the data end, or
        // poisoned the disk): pack against the state as it is now.
        if self.check_poison().is_err() || self.open.is_none() {
            self.fail_all(&items);
            return;
        }
        let head_len = block_up(BATCH_FIXED as u64 + entries_len_bound(items.len()));
        let total: u64 = block_up(head_len + items.iter().map(Item::record_len).sum::<u64>());
        // A batch gathers at least `batch_bytes` of payload, so it is a bit
        // larger than that (headers, the last chunk): buffers get headroom
        // and are reused (a fresh one costs page faults and zeroing).
        let mut buf = match self
            .spare
            .iter()
            .position(|b| b.capacity() >= total as usize)
        {
            Some(i) => self.spare.swap_remove(i),
            None => {
                AlignedBuf::zeroed((total as usize).max(self.batch_bytes + self.batch_bytes / 4))
            }
        };
        let o = self.open.as_mut().expect("a region is open");
        let r = o.r;
        buf.set_len(total as usize);
        // Layout first, then the payloads (copy + CRC, spread over the
        // pack helpers), then the headers, which carry the CRCs.
        let mut at = head_len as usize;
        let mut parts = Vec::with_capacity(items.len());
        let mut places = Vec::with_capacity(items.len());
        for it in items.iter() {
            if let Item::Job(j) = it {
                let hl = ChunkHeader::encoded_len_for_name(j.name.as_ref().map_or(0, |n| n.len()));
                parts.push(Part {
                    src: &j.data[..],
                    dst: at + hl,
                });
                places.push((at, hl));
                at += it.record_len() as usize;
            }
        }
        let crcs = self.packer.copy_crc(&mut buf, &parts);
        drop(parts);
        let mut entries = Vec::with_capacity(items.len());
        let mut jobs = places.iter().zip(crcs);
        for it in items.iter() {
            match it {
                Item::Job(j) => {
                    let (&(at, hl), crc) = jobs.next().expect("one place per job");
                    let pl = j.data.len();
                    let h = ChunkHeader {
                        id: j.id,
                        payload_len: pl as u64,
                        payload_crc: crc,
                        created_ms: j.created_ms,
                        flags: 0,
                        name: j.name.clone(),
                    };
                    debug_assert_eq!(h.encoded_len(), hl);
                    h.encode_into(&mut buf[at..at + hl]);
                    let rec = it.record_len() as usize;
                    buf[at + hl + pl..at + rec].fill(0);
                    entries.push(Entry {
                        ns: j.id.ns.0,
                        key: j.id.key.0,
                        group: j.id.group,
                        kind: KIND_CHUNK,
                        offset: (o.data_end + at as u64) as u32,
                        header_len: hl as u32,
                        payload_len: pl as u32,
                        payload_crc: crc,
                        txn: j.txn,
                        txn_size: j.txn_size,
                    });
                }
                Item::Tomb(id, _) => entries.push(Entry {
                    ns: id.ns.0,
                    key: id.key.0,
                    group: id.group,
                    kind: KIND_TOMBSTONE,
                    offset: 0,
                    header_len: 0,
                    payload_len: 0,
                    payload_crc: 0,
                    txn: 0,
                    txn_size: 0,
                }),
            }
        }
        buf[at..].fill(0);
        let ents = encode_entries(&entries);
        let bh = BatchHead {
            region: r,
            entry_count: entries.len() as u32,
            generation: o.generation,
            batch_len: total as u32,
            entries_len: ents.len() as u32,
            entries_crc: crate::format::crc32c(&ents),
        };
        bh.encode_into(&mut buf[..BATCH_FIXED]);
        buf[BATCH_FIXED..BATCH_FIXED + ents.len()].copy_from_slice(&ents);
        buf[BATCH_FIXED + ents.len()..head_len as usize].fill(0);
        let off = self.disk.region_base(r) + o.data_end;
        let check_after = o.reused.then_some((o.generation, o.data_end + total));
        let f = InFlight {
            r,
            start: o.data_end,
            entries_before: o.entries.len(),
            total,
            items,
            entries,
        };
        if let Some((generation, after)) = check_after {
            if let Err(e) = self.clear_leftover(r, generation, after) {
                self.poison(format!(
                    "clearing a leftover batch record in region {r} failed: {e}"
                ));
                self.fail_all(&f.items);
                self.recycle(buf);
                return;
            }
        }
        let o = self.open.as_mut().expect("a region is open");
        o.data_end += total;
        o.marker_owed = !f.entries.is_empty();
        o.entries.extend_from_slice(&f.entries);
        match &self.io {
            Some(io) => {
                if let Err(e) = io.req.send((buf, off, self.epoch)) {
                    // The I/O thread is gone: nothing can be written.
                    self.poison("the kvtier-io thread is gone".into());
                    self.recycle(e.into_inner().0);
                    self.finish(
                        f,
                        Err(std::io::Error::other("the kvtier-io thread is gone")),
                    );
                    return;
                }
                self.inflight.push_back(f);
            }
            None => {
                let res = write_batch(&*self.disk.dev, &self.disk.counters, &buf, off);
                self.recycle(buf);
                self.finish(f, res);
            }
        }
    }

    /// Keeps a written batch's buffer for the next batch: up to `depth + 1`
    /// buffers (one being packed while `depth` are in flight), the largest
    /// ones (a buffer of an unusually large batch replaces a smaller one).
    fn recycle(&mut self, buf: AlignedBuf) {
        if self.spare.len() <= self.depth {
            self.spare.push(buf);
        } else if let Some(small) = self
            .spare
            .iter_mut()
            .min_by_key(|b| b.capacity())
            .filter(|b| b.capacity() < buf.capacity())
        {
            *small = buf;
        }
    }

    /// In a re-opened region, the block at `at` (right after the batch about
    /// to be written) may hold a batch record of this generation left from
    /// before the crash (or from a batch whose write failed): were this
    /// batch's successor lost in a crash, recovery would chain into it and
    /// revive stale entries. Such a block is zeroed and synced before the
    /// batch is written.
    fn clear_leftover(&self, r: u32, generation: u64, at: u64) -> std::io::Result<()> {
        if at + BLOCK > self.disk.region_size {
            return Ok(());
        }
        let off = self.disk.region_base(r) + at;
        let mut block = AlignedBuf::zeroed(BLOCK as usize);
        self.disk.dev.read_at(&mut block, off)?;
        let leftover = BatchHead::decode(&block[..BATCH_FIXED])
            .is_some_and(|h| h.region == r && h.generation == generation);
        if leftover {
            tracing::info!(
                region = r,
                offset = at,
                "zeroing a leftover batch record past the recovered data end"
            );
            block.fill(0);
            self.disk.dev.write_at(&block, off)?;
            self.disk.sync()?;
        }
        Ok(())
    }

    /// Applies the completions that have arrived, without waiting.
    fn reap(&mut self) {
        while !self.inflight.is_empty() {
            let Some(Ok(d)) = self.io.as_ref().map(|io| io.done.try_recv()) else {
                return;
            };
            self.on_done(Some(d));
        }
    }

    /// Waits for every batch in flight and applies it.
    fn drain(&mut self) {
        while !self.inflight.is_empty() {
            self.complete_oldest();
        }
    }

    /// Waits for the oldest batch in flight and applies it.
    fn complete_oldest(&mut self) {
        let d = self.io.as_ref().and_then(|io| io.done.recv().ok());
        self.on_done(d);
    }

    /// Applies the completion `d` of the oldest batch in flight (`None`: the
    /// I/O thread is gone).
    fn on_done(&mut self, d: Option<(AlignedBuf, std::io::Result<()>)>) {
        let Some(f) = self.inflight.pop_front() else {
            return;
        };
        let res = match d {
            Some((buf, res)) => {
                self.recycle(buf);
                res
            }
            None => Err(std::io::Error::other("the kvtier-io thread is gone")),
        };
        if res.is_err() && !self.inflight.is_empty() {
            // The later batches were written behind a hole: recovery would
            // never reach them, so they fail too (after their I/O is done,
            // so their buffers come back).
            let later: Vec<InFlight> = self.inflight.drain(..).collect();
            for l in later {
                if let Some((buf, _)) = self.io.as_ref().and_then(|io| io.done.recv().ok()) {
                    self.recycle(buf);
                }
                self.roll_back(l.r, l.start, l.entries_before);
                self.fail_all(&l.items);
            }
        }
        if res.is_err() {
            // Batches packed from now on are written again.
            self.epoch += 1;
        }
        self.finish(f, res);
    }

    /// Forgets a failed batch of region `r` (and everything after it in that
    /// region): its data end goes back to `start`.
    fn roll_back(&mut self, r: u32, start: u64, entries_before: usize) {
        if let Some(o) = self.open.as_mut().filter(|o| o.r == r) {
            if start < o.data_end {
                o.data_end = start;
                o.entries.truncate(entries_before);
            }
            // What failed writes left past the data end may include batch
            // records of this generation.
            o.reused = true;
        }
    }

    /// Applies a written batch (index, hooks) or rolls back a failed one
    /// (and every batch after it: none is in flight any more).
    fn finish(&mut self, f: InFlight, res: std::io::Result<()>) -> bool {
        let InFlight {
            r,
            start,
            entries_before,
            total,
            items,
            entries,
        } = f;
        if let Err(e) = res {
            self.roll_back(r, start, entries_before);
            if e.raw_os_error() == Some(libc::ENOSPC) {
                self.pause_nospace();
            } else {
                self.poison(format!(
                    "writing a batch of {total} bytes to region {r} failed: {e}"
                ));
            }
            self.fail_all(&items);
            return false;
        }
        if self.disk.paused_nospace.swap(false, Ordering::Relaxed) {
            tracing::info!("the disk writer resumes: a batch was written after the pause (ENOSPC)");
        }
        self.unsynced.get_or_insert_with(Instant::now);
        let c = &self.disk.counters;
        c.disk_write_bytes.fetch_add(total, Ordering::Relaxed);
        {
            let mut ix = self.disk.index.write();
            for (it, e) in items.iter().zip(&entries) {
                match it {
                    // Not indexed: its delete has taken the id out of the
                    // index (a group break will, once it gets the lock).
                    // Nor a flush's write of a version overwritten since
                    // (`Job::superseded`): only a restart reads it.
                    Item::Job(j) if j.superseded || self.hooks.cancelled(j) => {}
                    Item::Job(_) => {
                        let prev = ix.insert(
                            e.id(),
                            Location {
                                region: r,
                                offset: e.offset,
                                header_len: e.header_len,
                                payload_len: e.payload_len,
                                crc: e.payload_crc,
                                txn: e.txn,
                            },
                        );
                        let old = prev.map_or(0, |p| u64::from(p.payload_len));
                        self.disk
                            .live_bytes
                            .fetch_add(u64::from(e.payload_len), Ordering::Relaxed);
                        self.disk.live_bytes.fetch_sub(old, Ordering::Relaxed);
                    }
                    // The delete took the id out of the index itself; what is
                    // indexed now is a version put after it (never a
                    // cancelled one: see `Hooks::cancelled`).
                    Item::Tomb(..) => {}
                }
            }
        }
        let txns: Vec<u64> = items
            .iter()
            .filter_map(|it| match it {
                Item::Job(j) if j.txn != 0 => Some(j.txn),
                _ => None,
            })
            .collect();
        if !txns.is_empty() {
            self.hooks.group_entries(r, txns);
        }
        for it in items.iter() {
            match it {
                Item::Job(j) => {
                    self.disk
                        .counters
                        .disk_writes
                        .fetch_add(1, Ordering::Relaxed);
                    // Only while a cancellation it is newer than is pending
                    // (a cancelled job is older; after the last tombstone
                    // nothing needs it).
                    if j.after_cancel
                        && self
                            .hooks
                            .cancel_time(&j.id)
                            .is_some_and(|t| j.inserted > t)
                    {
                        let n = self.newer.entry(j.id).or_insert(j.inserted);
                        *n = (*n).max(j.inserted);
                    }
                    self.settle(j);
                    self.hooks.written(j);
                }
                Item::Tomb(id, seq) => {
                    self.hooks.tombstone_done(id, *seq);
                    self.forget_newer(id);
                }
            }
        }
        true
    }

    /// The open region is full: seals it and opens the next one. Once its
    /// batches are done, the next region is chosen (and reclaimed: its index
    /// entries dropped only now, so an older copy of a chunk whose newer one
    /// was still in flight is not reported gone); one fdatasync makes the
    /// full region's batches durable; its summary and seal slot and the next
    /// region's open slot are written; a second fdatasync makes those
    /// durable before any batch lands in the next region (two syncs for the
    /// switch, not one per seal and one per open). The syncs run on an idle
    /// device: a flush that overlapped the next batches' writes slowed them
    /// by as much as it saved.
    ///
    /// Returns whether a region is open now (`false`: poisoned, or paused
    /// by ENOSPC with the full region kept for a later try).
    fn switch_region(&mut self) -> bool {
        self.drain();
        if self.check_poison().is_err() {
            // A batch failed for good: nothing more is written.
            return false;
        }
        let full = self.open.take().expect("a full region is open");
        self.seal_and_open_next(full)
    }

    /// Seals `full` and opens the next region ([`switch_region`]'s writes).
    /// On ENOSPC while writing them the writer pauses and `full` waits in
    /// `unsealed_full` for the next try: the device is consistent either
    /// way (a seal slot or open slot is only trusted whole and under its
    /// generation, and `full` stays the last region opened, so a restart
    /// walks its batches). The region picked as next is free by then (if
    /// it was reclaimed, its chunks are out of the index already).
    ///
    /// [`switch_region`]: Self::switch_region
    fn seal_and_open_next(&mut self, mut full: OpenRegion) -> bool {
        let (next, generation, open_slot, open_at) = self.next_open_slot();
        match self.seal_with(&mut full, Some((&open_slot, open_at)), true) {
            Ok(()) => {
                self.opened(next, generation);
                true
            }
            Err(e) => {
                if self.check_poison().is_ok() {
                    self.unsealed_full = Some(full);
                } else {
                    tracing::error!(error = %e, "sealing a region failed");
                }
                false
            }
        }
    }

    /// The device is full (ENOSPC): the writer pauses (what it was writing
    /// fails, later work tries again), reads go on.
    fn pause_nospace(&self) {
        if !self.disk.paused_nospace.swap(true, Ordering::Relaxed) {
            tracing::warn!("device full (ENOSPC): the disk writer pauses; reads keep working");
        }
    }

    /// Writes the summary and the seal slot, then fdatasync.
    fn seal(&mut self, o: &mut OpenRegion) -> Result<()> {
        self.seal_with(o, None, false)
    }

    /// fdatasync (the region's batches first, so a durable summary never
    /// lists a chunk whose bytes could still be lost), the summary and the
    /// seal slot, then `also` (another region's open slot), then fdatasync.
    /// With `pause_on_nospace`, ENOSPC from a write pauses the writer
    /// instead of poisoning the disk (a failed sync always poisons).
    fn seal_with(
        &mut self,
        o: &mut OpenRegion,
        also: Option<(&AlignedBuf, u64)>,
        pause_on_nospace: bool,
    ) -> Result<()> {
        let base = self.disk.region_base(o.r);
        let ents = encode_entries(&o.entries);
        let slen = block_up(ents.len() as u64);
        let mut buf = AlignedBuf::zeroed(slen as usize);
        buf[..ents.len()].copy_from_slice(&ents);
        let seal = SealSlot {
            region: o.r,
            generation: o.generation,
            entry_count: o.entries.len() as u32,
            summary_offset: o.data_end as u32,
            summary_len: ents.len() as u32,
            summary_crc: crate::format::crc32c(&ents),
            data_end: o.data_end as u32,
        };
        let mut slot = AlignedBuf::zeroed(BLOCK as usize);
        seal.encode_into(&mut slot);
        let writes = || {
            self.disk.dev.write_at(&buf, base + o.data_end)?;
            self.disk.dev.write_at(&slot, base + SEAL_SLOT)?;
            match also {
                Some((b, at)) => self.disk.dev.write_at(b, at),
                None => Ok(()),
            }
        };
        let res = match self.disk.sync() {
            Err(e) => Err((e, false)),
            Ok(()) => match writes() {
                Err(e) => Err((e, true)),
                Ok(()) => self.disk.sync().map_err(|e| (e, false)),
            },
        };
        if let Err((e, in_write)) = res {
            if in_write && pause_on_nospace && e.raw_os_error() == Some(libc::ENOSPC) {
                self.pause_nospace();
            } else {
                self.poison(format!("sealing region {} failed: {e}", o.r));
            }
            return Err(Error::Io {
                op: "seal a region of",
                path: self.disk.dev.path().to_path_buf(),
                source: e,
            });
        }
        // Every batch written so far is durable: no quiet sync is due.
        self.unsynced = None;
        self.regions[o.r as usize] = (o.generation, true);
        Ok(())
    }

    /// A free region, or the oldest sealed one, reclaimed.
    fn pick_next_region(&mut self) -> u32 {
        match self.regions.iter().position(|&(g, _)| g == 0) {
            Some(r) => r as u32,
            None => {
                let (r, _) = self
                    .regions
                    .iter()
                    .enumerate()
                    .filter(|(_, (_, sealed))| *sealed)
                    .min_by_key(|(_, (g, _))| *g)
                    .expect("at least two regions, one of them sealed");
                let r = r as u32;
                self.reclaim(r);
                r
            }
        }
    }

    /// Picks the next region (reclaiming it if it was sealed) and a new
    /// generation for it: its open slot and where that goes. The region is
    /// open once the slot is durable ([`opened`](Self::opened)).
    fn next_open_slot(&mut self) -> (u32, u64, AlignedBuf, u64) {
        let r = self.pick_next_region();
        let generation = self.next_generation;
        self.next_generation += 1;
        let mut slot = AlignedBuf::zeroed(BLOCK as usize);
        encode_open_slot(&mut slot, r, generation);
        (r, generation, slot, self.disk.region_base(r) + OPEN_SLOT)
    }

    /// Region `r`'s open slot with `generation` is durable: batches go there.
    fn opened(&mut self, r: u32, generation: u64) {
        self.regions[r as usize] = (generation, false);
        self.open = Some(OpenRegion {
            r,
            generation,
            data_end: DATA_START,
            entries: Vec::new(),
            reused: self.suspect.contains(&r),
            marker_owed: false,
        });
    }

    /// Opens a free region, or reclaims the oldest sealed one first.
    /// Returns whether it did: ENOSPC writing its open slot pauses the
    /// writer (the next try picks a free region again: this one, if it was
    /// reclaimed), any other failure poisons the disk.
    fn open_next_region(&mut self) -> bool {
        let (r, generation, slot, at) = self.next_open_slot();
        // The open slot is durable before any batch lands in the region, so
        // a crash can never pair the old summary with new data.
        if let Err(e) = self.disk.dev.write_at(&slot, at) {
            if e.raw_os_error() == Some(libc::ENOSPC) {
                self.pause_nospace();
            } else {
                self.poison(format!("opening region {r} failed: {e}"));
            }
            return false;
        }
        if let Err(e) = self.disk.sync() {
            self.poison(format!("opening region {r} failed: fdatasync: {e}"));
            return false;
        }
        self.opened(r, generation);
        true
    }

    /// Removes every index entry of region `r` (its space is about to be
    /// reused) and tells the store which.
    fn reclaim(&mut self, r: u32) {
        let (generation, _) = self.regions[r as usize];
        let mut removed = Vec::new();
        let seal = {
            let mut slots = AlignedBuf::zeroed(BLOCK as usize);
            self.disk
                .dev
                .read_at(&mut slots, self.disk.region_base(r) + SEAL_SLOT)
                .ok()
                .and_then(|()| SealSlot::decode(&slots))
                .filter(|s| s.generation == generation && s.region == r)
        };
        let from_summary = seal.and_then(|s| self.disk.read_summary(r, &s).ok());
        let ram_seq;
        match from_summary.as_ref().and_then(|b| decode_entries(b).ok()) {
            Some(arch) => {
                let mut ix = self.disk.index.write();
                ram_seq = self.hooks.ram_seq();
                for a in arch.iter() {
                    let id = crate::layout::ArchivedEntry::to_native(a).id();
                    if ix.get(&id).is_some_and(|l| l.region == r) {
                        if let Some(l) = ix.remove(&id) {
                            removed.push((id, l));
                        }
                    }
                }
            }
            None => {
                let mut ix = self.disk.index.write();
                ram_seq = self.hooks.ram_seq();
                removed = ix.retain(|_, l| l.region != r);
            }
        }
        let bytes: u64 = removed.iter().map(|(_, l)| u64::from(l.payload_len)).sum();
        self.disk.live_bytes.fetch_sub(bytes, Ordering::Relaxed);
        self.disk
            .counters
            .region_evictions
            .fetch_add(1, Ordering::Relaxed);
        self.regions[r as usize] = (0, false);
        self.hooks.reclaimed(r, removed, ram_seq);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use parking_lot::Mutex;

    /// Fails its first write; records the offsets of the others.
    #[derive(Default)]
    struct FailFirst {
        calls: Mutex<Vec<u64>>,
    }

    impl Device for FailFirst {
        fn read_at(&self, _: &mut [u8], _: u64) -> std::io::Result<()> {
            Ok(())
        }
        fn write_at(&self, _: &[u8], off: u64) -> std::io::Result<()> {
            let mut c = self.calls.lock();
            c.push(off);
            if c.len() == 1 {
                return Err(std::io::Error::from_raw_os_error(libc::ENOSPC));
            }
            Ok(())
        }
        fn sync(&self) -> std::io::Result<()> {
            Ok(())
        }
        fn len(&self) -> u64 {
            1 << 30
        }
        fn direct_io(&self) -> bool {
            false
        }
        fn path(&self) -> &std::path::Path {
            std::path::Path::new("<fail-first>")
        }
    }

    #[test]
    fn batches_queued_behind_a_failed_write_are_not_written() {
        let dev = FailFirst::default();
        let (req_tx, req_rx) = bounded(8);
        let (done_tx, done_rx) = bounded(8);
        // Three batches packed before the writer saw the failure (epoch 0),
        // then one packed after (epoch 1).
        for (off, epoch) in [(0, 0), (4096, 0), (8192, 0), (0, 1)] {
            req_tx.send((AlignedBuf::zeroed(4096), off, epoch)).unwrap();
        }
        drop(req_tx);
        io_loop(&dev, &DiskCounters::default(), req_rx, done_tx);
        let res: Vec<bool> = done_rx.iter().map(|(_, r)| r.is_ok()).collect();
        assert_eq!(res, [false, false, false, true]);
        assert_eq!(
            *dev.calls.lock(),
            [0, 0],
            "only the failed write and the retry"
        );
    }
}
