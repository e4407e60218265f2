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
//! during an append) fails its CRC and ends the read.

use std::collections::HashSet;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
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
/// the first torn or corrupt record.
pub fn read(dir: &Path) -> io::Result<Vec<ChunkId>> {
    let bytes = match fs::read(dir.join(FILE_NAME)) {
        Ok(b) => b,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut ids = Vec::with_capacity(bytes.len() / RECORD);
    for r in bytes.chunks(RECORD) {
        match (r.len() == RECORD).then(|| decode(r)).flatten() {
            Some(id) => ids.push(id),
            None => {
                tracing::warn!(
                    kept = ids.len(),
                    "deletes journal: a torn or corrupt record ends it"
                );
                break;
            }
        }
    }
    Ok(ids)
}

fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir).and_then(|d| d.sync_all())
}

/// The writer's handle on the journal.
pub(crate) struct Journal {
    dir: PathBuf,
    /// The ids in the file (each appended once).
    ids: HashSet<ChunkId>,
    exists: bool,
}

impl Journal {
    /// The journal of `dir`, with the ids its file already holds; a torn
    /// tail is cut off, so that appends land after the last good record.
    pub(crate) fn open(dir: &Path) -> io::Result<Self> {
        let good = read(dir)?;
        let path = dir.join(FILE_NAME);
        let exists = path.exists();
        if exists {
            let len = (good.len() * RECORD) as u64;
            let f = OpenOptions::new().write(true).open(&path)?;
            if f.metadata()?.len() != len {
                f.set_len(len)?;
                f.sync_all()?;
            }
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            exists,
            ids: good.into_iter().collect(),
        })
    }

    /// Whether `id`'s delete is durable in the journal.
    pub(crate) fn contains(&self, id: &ChunkId) -> bool {
        self.ids.contains(id)
    }

    /// Appends `id` (once) and makes it durable. Failpoint
    /// `tier::deletes::append` (feature `failpoints`) fails it.
    pub(crate) fn add(&mut self, id: &ChunkId) -> io::Result<()> {
        if self.ids.contains(id) {
            return Ok(());
        }
        #[cfg(feature = "failpoints")]
        fail::fail_point!("tier::deletes::append", |arg| Err(
            crate::segment::failpoint_error(arg)
        ));
        let path = self.dir.join(FILE_NAME);
        let mut f = {
            use std::os::unix::fs::OpenOptionsExt;
            OpenOptions::new()
                .create(true)
                .append(true)
                .mode(crate::store::DATA_FILE_MODE)
                .open(&path)?
        };
        if !self.exists {
            crate::store::own_like_dir(&f, &self.dir)?;
        }
        f.write_all(&encode(id))?;
        f.sync_data()?;
        if !self.exists {
            sync_dir(&self.dir)?;
            self.exists = true;
        }
        self.ids.insert(*id);
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
        sync_dir(&self.dir)?;
        self.exists = false;
        self.ids.clear();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(n: u8) -> ChunkId {
        ChunkId::new(Namespace([n; 16]), ChunkKey([n ^ 0x5a; 32]), u16::from(n))
    }

    #[test]
    fn appends_once_reads_back_and_stops_at_a_torn_record() {
        let dir = tempfile::tempdir().unwrap();
        assert!(read(dir.path()).unwrap().is_empty());
        let mut j = Journal::open(dir.path()).unwrap();
        j.add(&id(1)).unwrap();
        j.add(&id(2)).unwrap();
        j.add(&id(1)).unwrap();
        assert!(j.contains(&id(2)) && !j.contains(&id(3)));
        assert_eq!(read(dir.path()).unwrap(), vec![id(1), id(2)]);
        // A reopened journal knows its ids (no second append).
        let mut j = Journal::open(dir.path()).unwrap();
        j.add(&id(2)).unwrap();
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
        let mut j = Journal::open(dir.path()).unwrap();
        j.add(&id(4)).unwrap();
        assert_eq!(read(dir.path()).unwrap(), vec![id(1), id(4)]);
        j.clear().unwrap();
        assert!(!path.exists());
        assert!(read(dir.path()).unwrap().is_empty());
    }
}
