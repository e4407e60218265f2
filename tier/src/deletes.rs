//! The journal of deletes the disk did not take: `deletes.pending` in the
//! data dir.
//!
//! A delete reaches the disk as a tombstone record. While disk writes are
//! poisoned, or while the batch of a tombstone is refused (ENOSPC), the
//! deleted id is appended here instead (and fsynced), so that a restart
//! cannot bring the chunk back: the open replays the journal (deletes the
//! ids again, which writes their tombstones) and the writer removes the
//! file once a flush has made every tombstone durable. Replaying an id
//! whose newer version reached the disk after the delete deletes that
//! version too: a miss, never stale bytes.
//!
//! Format: records of [`RECORD`] bytes: namespace (16), key (32), group
//! (u16 LE), CRC32C of those 50 bytes (u32 LE). A torn last record (a crash
//! during an append) fails its CRC and ends the read; a bad record with
//! whole records after it is damage (bit rot): it is skipped and counted,
//! and the records after it are still replayed.

use std::collections::HashSet;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};

use crate::format::crc32c;
use crate::{ChunkId, ChunkKey, Namespace};

/// The journal's name in the data dir.
pub const FILE_NAME: &str = "deletes.pending";
/// Length of one record.
const RECORD: usize = 16 + 32 + 2 + 4;

fn encode(id: &ChunkId) -> [u8; RECORD] {
    let mut r = [0u8; RECORD];
    r[..16].copy_from_slice(&id.ns.0);
    r[16..48].copy_from_slice(&id.key.0);
    r[48..50].copy_from_slice(&id.group.to_le_bytes());
    let crc = crc32c(&r[..50]);
    r[50..].copy_from_slice(&crc.to_le_bytes());
    r
}

fn decode(r: &[u8]) -> Option<ChunkId> {
    let crc = u32::from_le_bytes(r[50..RECORD].try_into().ok()?);
    if crc32c(&r[..50]) != crc {
        return None;
    }
    Some(ChunkId::new(
        Namespace(r[..16].try_into().ok()?),
        ChunkKey(r[16..48].try_into().ok()?),
        u16::from_le_bytes(r[48..50].try_into().ok()?),
    ))
}

/// The ids in the journal of `dir` (none when there is no journal), up to
/// a torn or corrupt last record.
pub fn read(dir: &Path) -> io::Result<Vec<ChunkId>> {
    read_all(dir).map(|r| r.ids)
}

/// What [`read_all`] found.
#[derive(Debug, Default)]
pub struct Read {
    /// The good records' ids, in file order.
    pub ids: Vec<ChunkId>,
    /// Bad records with good ones after them: damage, not a torn append
    /// (each one a delete lost: its chunk may come back).
    pub damaged: u64,
    /// Where the last good record ends (appends go there).
    pub end: u64,
}

/// The journal of `dir`: its good records, the damaged ones skipped (QA:
/// one flipped byte in the first record undid every delete after it,
/// with a warning only, and the journal was then removed).
pub fn read_all(dir: &Path) -> io::Result<Read> {
    let bytes = match crate::store::read_data_file(&dir.join(FILE_NAME)) {
        Ok(b) => b,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Read::default()),
        Err(e) => return Err(e),
    };
    let mut out = Read {
        ids: Vec::with_capacity(bytes.len() / RECORD),
        ..Read::default()
    };
    let mut bad = 0u64;
    for (i, r) in bytes.chunks(RECORD).enumerate() {
        match (r.len() == RECORD).then(|| decode(r)).flatten() {
            Some(id) => {
                out.ids.push(id);
                out.end = ((i + 1) * RECORD) as u64;
                // Bad ones before a good one were damage, not a torn tail.
                out.damaged += bad;
                bad = 0;
            }
            None => bad += 1,
        }
    }
    if out.damaged > 0 {
        tracing::error!(
            damaged = out.damaged,
            kept = out.ids.len(),
            "deletes journal: damaged records skipped; the chunks they deleted may be back \
             (counted in damaged_metadata)"
        );
    }
    if bad > 0 {
        tracing::warn!(
            kept = out.ids.len(),
            "deletes journal: a torn or corrupt last record is cut off"
        );
    }
    Ok(out)
}

fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir).and_then(|d| d.sync_all())
}

/// The writer's handle on the journal.
pub(crate) struct Journal {
    dir: PathBuf,
    /// The ids in the file (each appended once), in file order.
    order: Vec<ChunkId>,
    ids: HashSet<ChunkId>,
    /// The file, once this process has written to it.
    file: Option<File>,
    /// Length of the good records: the next one is written there.
    len: u64,
    exists: bool,
}

impl Journal {
    /// The journal of `dir`, with the ids its file already holds, and
    /// how many damaged records it skipped. A torn or corrupt tail is cut
    /// off (the file is opened for writing only then), so that appends land
    /// right after the last good record.
    pub(crate) fn open(dir: &Path) -> io::Result<(Self, u64)> {
        let path = dir.join(FILE_NAME);
        let mut damaged = 0;
        let (order, exists, len) = match fs::symlink_metadata(&path) {
            Ok(m) => {
                let found = read_all(dir)?;
                damaged = found.damaged;
                let (good, len) = (found.ids, found.end);
                // Opened with the data dir's checks (no links) first.
                let open =
                    || crate::store::open_data_file(&path, OpenOptions::new().write(true), 0);
                if good.is_empty() {
                    // Nothing in it (a first append that failed, a torn
                    // first record): it goes, as a cleared journal does,
                    // rather than stay behind empty.
                    drop(open()?);
                    fs::remove_file(&path)?;
                    sync_dir(dir)?;
                    (good, false, 0)
                } else {
                    if m.len() != len {
                        let f = open()?;
                        f.set_len(len)?;
                        f.sync_all()?;
                    }
                    (good, true, len)
                }
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => (Vec::new(), false, 0),
            Err(e) => return Err(e),
        };
        let journal = Self {
            dir: dir.to_path_buf(),
            len,
            ids: order.iter().copied().collect(),
            order,
            file: None,
            exists,
        };
        Ok((journal, damaged))
    }

    /// The ids the journal holds, in the order they were added.
    pub(crate) fn ids(&self) -> &[ChunkId] {
        &self.order
    }

    /// Whether `id`'s delete is durable in the journal.
    pub(crate) fn contains(&self, id: &ChunkId) -> bool {
        self.ids.contains(id)
    }

    /// Appends the ids not in the journal yet, with one write and one
    /// fdatasync, right after the last good record (a failed write is cut
    /// back off, so it never hides later records). Failpoint
    /// `tier::deletes::append` (feature `failpoints`) fails it.
    pub(crate) fn add_all(&mut self, ids: &[ChunkId]) -> io::Result<()> {
        let mut new: Vec<ChunkId> = Vec::new();
        for id in ids {
            if !self.ids.contains(id) && !new.contains(id) {
                new.push(*id);
            }
        }
        if new.is_empty() {
            return Ok(());
        }
        #[cfg(feature = "failpoints")]
        fail::fail_point!("tier::deletes::append", |arg| Err(
            crate::segment::failpoint_error(arg)
        ));
        let created = !self.exists;
        let file = match &mut self.file {
            Some(f) => f,
            None => {
                use std::os::unix::fs::OpenOptionsExt;
                // A new journal is created here (`O_EXCL`: nothing planted
                // under its name is written, or chowned).
                let f = crate::store::open_data_file(
                    &self.dir.join(FILE_NAME),
                    OpenOptions::new()
                        .create(created)
                        .create_new(created)
                        .write(true)
                        .mode(crate::store::DATA_FILE_MODE),
                    0,
                )?;
                self.exists = true;
                if created {
                    crate::store::own_like_dir(&f, &self.dir)?;
                }
                self.file.insert(f)
            }
        };
        let mut buf = Vec::with_capacity(new.len() * RECORD);
        for id in &new {
            buf.extend_from_slice(&encode(id));
        }
        use std::os::unix::fs::FileExt;
        let written = file
            .write_all_at(&buf, self.len)
            .and_then(|()| file.sync_data())
            .and_then(|()| if created { sync_dir(&self.dir) } else { Ok(()) });
        if let Err(e) = written {
            // The file this call made holds nothing: it goes. If it
            // cannot, it stays known (empty), so the next append writes
            // into it instead of failing to create it again.
            let gone = created && fs::remove_file(self.dir.join(FILE_NAME)).is_ok();
            if gone {
                self.file = None;
                self.exists = false;
            } else {
                let _ = file.set_len(self.len);
            }
            return Err(e);
        }
        self.len += buf.len() as u64;
        self.ids.extend(new.iter().copied());
        self.order.extend(new);
        Ok(())
    }

    /// Removes the journal: every delete in it is on disk as a tombstone
    /// (or superseded by a newer version written after it).
    pub(crate) fn clear(&mut self) -> io::Result<()> {
        if !self.exists {
            return Ok(());
        }
        match fs::remove_file(self.dir.join(FILE_NAME)) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        // Gone: whatever the directory sync says, a later delete of one of
        // these ids must be written again.
        self.exists = false;
        self.file = None;
        self.len = 0;
        self.ids.clear();
        self.order.clear();
        sync_dir(&self.dir)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(n: u8) -> ChunkId {
        ChunkId::new(Namespace([n; 16]), ChunkKey([n ^ 0x5a; 32]), u16::from(n))
    }

    /// An empty journal file (its first append failed: QA saw one on a full
    /// filesystem outlive flushes and restarts) is removed at open.
    #[test]
    fn an_empty_journal_file_is_removed_at_open() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(FILE_NAME);
        fs::write(&path, b"").unwrap();
        let mut j = Journal::open(dir.path()).unwrap().0;
        assert!(!path.exists());
        assert!(j.ids().is_empty());
        // It is created anew by the next append.
        j.add_all(&[id(1)]).unwrap();
        assert_eq!(read(dir.path()).unwrap(), vec![id(1)]);
        // A torn first record is nothing too.
        fs::write(&path, &encode(&id(2))[..20]).unwrap();
        assert!(Journal::open(dir.path()).unwrap().0.ids().is_empty());
        assert!(!path.exists());
    }

    #[test]
    fn appends_once_reads_back_and_stops_at_a_torn_record() {
        let dir = tempfile::tempdir().unwrap();
        assert!(read(dir.path()).unwrap().is_empty());
        let mut j = Journal::open(dir.path()).unwrap().0;
        j.add_all(&[id(1), id(2), id(1)]).unwrap();
        j.add_all(&[id(2)]).unwrap();
        assert!(j.contains(&id(2)) && !j.contains(&id(3)));
        assert_eq!(read(dir.path()).unwrap(), vec![id(1), id(2)]);
        // A reopened journal knows its ids (no second append).
        let mut j = Journal::open(dir.path()).unwrap().0;
        assert_eq!(j.ids(), &[id(1), id(2)]);
        j.add_all(&[id(2)]).unwrap();
        assert_eq!(read(dir.path()).unwrap(), vec![id(1), id(2)]);
        // A torn tail, then a flipped bit: what comes before is kept.
        let path = dir.path().join(FILE_NAME);
        let mut bytes = fs::read(&path).unwrap();
        bytes.extend_from_slice(&encode(&id(3))[..20]);
        fs::write(&path, &bytes).unwrap();
        assert_eq!(read(dir.path()).unwrap(), vec![id(1), id(2)]);
        bytes[RECORD + 5] ^= 1;
        fs::write(&path, &bytes).unwrap();
        assert_eq!(read(dir.path()).unwrap(), vec![id(1)]);
        // Opening cuts the bad tail off: a new record follows the good one.
        let mut j = Journal::open(dir.path()).unwrap().0;
        j.add_all(&[id(4)]).unwrap();
        assert_eq!(read(dir.path()).unwrap(), vec![id(1), id(4)]);
        j.clear().unwrap();
        assert!(!path.exists());
        assert!(read(dir.path()).unwrap().is_empty());
        // Cleared means forgotten: the same ids are written again.
        j.add_all(&[id(1)]).unwrap();
        assert_eq!(read(dir.path()).unwrap(), vec![id(1)]);
    }

    /// QA: one flipped byte in the first record ended the read there, so
    /// every later delete was undone (a warning only), and the journal was
    /// then removed. A bad record with good ones after it is damage: the
    /// rest is replayed and the bad one counted.
    #[test]
    fn a_damaged_record_before_good_ones_is_skipped_and_counted() {
        let dir = tempfile::tempdir().unwrap();
        let mut j = Journal::open(dir.path()).unwrap().0;
        j.add_all(&[id(1), id(2), id(3)]).unwrap();
        drop(j);
        let path = dir.path().join(FILE_NAME);
        let mut bytes = fs::read(&path).unwrap();
        bytes[10] ^= 0x40;
        fs::write(&path, &bytes).unwrap();
        let r = read_all(dir.path()).unwrap();
        assert_eq!(
            (r.ids, r.damaged, r.end),
            (vec![id(2), id(3)], 1, 3 * RECORD as u64)
        );
        let (mut j, damaged) = Journal::open(dir.path()).unwrap();
        assert_eq!((j.ids(), damaged), (&[id(2), id(3)][..], 1));
        assert_eq!(fs::metadata(&path).unwrap().len(), 3 * RECORD as u64);
        j.add_all(&[id(4)]).unwrap();
        assert_eq!(read(dir.path()).unwrap(), vec![id(2), id(3), id(4)]);
    }

    /// The same through a store: the deletes after the damaged record are
    /// applied at open, and the damage is counted (`verify` exits 5).
    #[test]
    fn a_store_replays_the_deletes_after_a_damaged_record_and_counts_it() {
        use crate::{ChunkStore, NamespaceRecord, TierConfig};
        let dir = tempfile::tempdir().unwrap();
        let cfg = TierConfig {
            data_dir: dir.path().to_path_buf(),
            ram_budget: 4 << 20,
            disk_budget: 8 << 20,
            region_size: 1 << 20,
            direct_io: false,
            ..TierConfig::default()
        };
        let s = ChunkStore::open(cfg.clone()).unwrap();
        let ns = s
            .register_namespace(&NamespaceRecord {
                model: "m".into(),
                ..Default::default()
            })
            .unwrap();
        let ids: Vec<ChunkId> = (0..3u8)
            .map(|n| ChunkId::new(ns, ChunkKey([n; 32]), 0))
            .collect();
        for x in &ids {
            s.put(*x, bytes::Bytes::from(vec![7u8; 1000])).unwrap();
        }
        s.close(std::time::Duration::from_secs(30)).unwrap();
        drop(s);
        // As if the disk had refused their tombstones: deletes of all
        // three in the journal, the first record damaged.
        let mut bytes = Vec::new();
        for x in &ids {
            bytes.extend_from_slice(&encode(x));
        }
        bytes[3] ^= 1;
        fs::write(dir.path().join(FILE_NAME), &bytes).unwrap();
        let s = ChunkStore::open(cfg).unwrap();
        assert!(s.get(&ids[0]).is_some(), "its delete record was damaged");
        assert!(s.get(&ids[1]).is_none() && s.get(&ids[2]).is_none());
        assert_eq!(s.stats().damaged_metadata, 1);
    }

    #[test]
    fn a_partial_record_left_by_a_failed_append_never_hides_later_ones() {
        let dir = tempfile::tempdir().unwrap();
        let mut j = Journal::open(dir.path()).unwrap().0;
        j.add_all(&[id(1)]).unwrap();
        // As if a write had landed half a record and failed.
        let path = dir.path().join(FILE_NAME);
        let mut bytes = fs::read(&path).unwrap();
        bytes.extend_from_slice(&encode(&id(9))[..30]);
        fs::write(&path, &bytes).unwrap();
        // The next append goes right after the last good record.
        j.add_all(&[id(2)]).unwrap();
        assert_eq!(read(dir.path()).unwrap(), vec![id(1), id(2)]);
    }

    #[test]
    fn a_journal_that_cannot_be_read_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        fs::create_dir(dir.path().join(FILE_NAME)).unwrap();
        assert!(Journal::open(dir.path()).is_err());
    }
}
