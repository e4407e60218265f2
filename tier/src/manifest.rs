//! `namespaces.json`: the record of every namespace registered with the
//! store, with a coarse last-used time (for `gc` by age).
//!
//! Written atomically: a temporary file, fsync, rename over the old one,
//! fsync of the directory. A crash leaves either the old or the new file.
//! A file that does not parse is refused at open with
//! [`Error::ManifestCorrupt`] (never silently replaced: it is the only copy
//! of the records); [`salvage`] (`kvtier verify --repair`) sets it aside and
//! keeps the records that still check.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::types::{Namespace, NamespaceRecord};
use crate::{Error, Result};

/// File name of the manifest inside the data dir.
pub const FILE_NAME: &str = "namespaces.json";
const VERSION: u32 = 1;
/// What to do about a manifest of another version.
const MANIFEST_VERSION_HINT: &str = "another kvtier version wrote it; the chunks do not depend on it: \
     move namespaces.json aside and start (a client's HELLO registers its namespace again)";

/// One namespace in the manifest.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "kebab-case")]
pub struct NsEntry {
    /// The full record (its id is recomputed and checked at load).
    pub record: NamespaceRecord,
    /// Last time a chunk of it was written or read (unix ms, coarse).
    pub last_used_ms: u64,
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
struct FileFormat {
    version: u32,
    namespaces: BTreeMap<Namespace, NsEntry>,
}

fn io(op: &'static str, path: &Path, source: std::io::Error) -> Error {
    Error::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}

/// Path of the manifest in `dir`.
pub fn path_in(dir: &Path) -> PathBuf {
    dir.join(FILE_NAME)
}

/// Loads the manifest (empty when absent).
pub fn load(dir: &Path) -> Result<BTreeMap<Namespace, NsEntry>> {
    let path = path_in(dir);
    let text = match crate::store::read_data_file(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(BTreeMap::new()),
        Err(e) => return Err(io("read", &path, e)),
    };
    let f: FileFormat = serde_json::from_slice(&text).map_err(|e| Error::ManifestCorrupt {
        path: path.clone(),
        detail: e.to_string(),
    })?;
    if f.version != VERSION {
        return Err(Error::IncompatibleVersion {
            what: "namespace manifest (namespaces.json)",
            found: f.version,
            supported: VERSION.to_string(),
            hint: MANIFEST_VERSION_HINT,
        });
    }
    for (id, e) in &f.namespaces {
        if e.record.id() != *id {
            return Err(Error::ManifestCorrupt {
                path: path.clone(),
                detail: format!("record listed under {id} hashes to {}", e.record.id()),
            });
        }
    }
    Ok(f.namespaces)
}

/// What [`salvage`] did with a corrupt manifest.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Salvaged {
    /// Where a copy of the corrupt file went (`namespaces.json.corrupt-N`).
    pub set_aside: PathBuf,
    /// Records that parsed and hash to the id they are listed under: kept.
    pub kept: usize,
    /// Entries that did not: left out of the new manifest. At least 1 when
    /// the file does not parse as a whole (how many it held is unknown).
    pub lost: usize,
}

/// Repairs a manifest that [`load`] refuses as corrupt: keeps every record
/// that still parses and hashes to the id it is listed under, copies the
/// corrupt file aside (`namespaces.json.corrupt-N`, never overwriting one,
/// synced), then replaces it atomically with a manifest of the kept
/// records: a failure or crash at any step leaves the corrupt file in
/// place (and a repair to run again), never no manifest at all. `None` when the file is
/// absent or loads cleanly (nothing to do). A file of another manifest
/// version is refused as by [`load`], not salvaged. The caller holds the
/// data dir's lock.
pub fn salvage(dir: &Path) -> Result<Option<Salvaged>> {
    match load(dir) {
        Err(Error::ManifestCorrupt { .. }) => {}
        Err(e) => return Err(e),
        Ok(_) => return Ok(None),
    }
    let path = path_in(dir);
    let text = crate::store::read_data_file(&path).map_err(|e| io("read", &path, e))?;
    let (kept, lost) = salvage_records(&text)?;
    let set_aside = keep_copy(dir, &text)?;
    store(dir, &kept)?;
    Ok(Some(Salvaged {
        set_aside,
        kept: kept.len(),
        lost,
    }))
}

/// The records of a corrupt manifest's `text` that still parse and hash to
/// the id they are listed under, and how many entries did not (at least 1
/// when the text does not parse as a whole). A manifest of another version
/// is refused.
fn salvage_records(text: &[u8]) -> Result<(BTreeMap<Namespace, NsEntry>, usize)> {
    let mut kept = BTreeMap::new();
    let mut lost = 0;
    // Entry by entry: bit rot in one record leaves the others readable.
    if let Ok(serde_json::Value::Object(top)) = serde_json::from_slice(text) {
        if let Some(v) = top.get("version").and_then(serde_json::Value::as_u64) {
            if v != u64::from(VERSION) {
                return Err(Error::IncompatibleVersion {
                    what: "namespace manifest (namespaces.json)",
                    found: u32::try_from(v).unwrap_or(u32::MAX),
                    supported: VERSION.to_string(),
                    hint: MANIFEST_VERSION_HINT,
                });
            }
        }
        if let Some(serde_json::Value::Object(list)) = top.get("namespaces") {
            for (key, entry) in list {
                let id = key.parse::<Namespace>().ok();
                match (id, serde_json::from_value::<NsEntry>(entry.clone())) {
                    (Some(id), Ok(e)) if e.record.id() == id => {
                        kept.insert(id, e);
                    }
                    _ => lost += 1,
                }
            }
        } else {
            lost += 1;
        }
    } else {
        // The file does not parse as a whole (cut short, a broken brace):
        // each `"<id>": {record}` that still parses on its own is kept. How
        // many were lost is unknown past what was found: at least one.
        lost += scan_entries(text, &mut kept).max(1);
    }
    Ok((kept, lost))
}

/// [`load`], except that a corrupt manifest gives the records
/// [`salvage`] would keep, changing nothing on disk (read-only opens:
/// `kvtier verify` checks the chunks all the same and reports the manifest).
pub(crate) fn load_or_salvage_in_memory(dir: &Path) -> Result<BTreeMap<Namespace, NsEntry>> {
    match load(dir) {
        Err(Error::ManifestCorrupt { path, detail }) => {
            let text = crate::store::read_data_file(&path).map_err(|e| io("read", &path, e))?;
            let (kept, lost) = salvage_records(&text)?;
            tracing::warn!(
                path = %path.display(),
                kept = kept.len(),
                lost,
                "the namespace manifest is corrupt ({detail}); read-only open with the records \
                 that still parse"
            );
            Ok(kept)
        }
        r => r,
    }
}

/// Finds every `"<32 hex digits>": {` in `text` and parses the object that
/// follows as an entry; keeps the ones that hash to their key. Returns how
/// many of them were not kept.
fn scan_entries(text: &[u8], kept: &mut BTreeMap<Namespace, NsEntry>) -> usize {
    let mut bad = 0;
    for at in 0..text.len() {
        let Some(key) = text.get(at..at + 34) else {
            break;
        };
        if key[0] != b'"' || key[33] != b'"' || !key[1..33].iter().all(u8::is_ascii_hexdigit) {
            continue;
        }
        let rest = &text[at + 34..];
        let colon = rest.iter().position(|b| !b.is_ascii_whitespace());
        let Some(brace) = colon
            .filter(|&c| rest[c] == b':')
            .and_then(|c| {
                rest[c + 1..]
                    .iter()
                    .position(|b| !b.is_ascii_whitespace())
                    .map(|b| c + 1 + b)
            })
            .filter(|&b| rest[b] == b'{')
        else {
            continue;
        };
        let id = std::str::from_utf8(&key[1..33])
            .ok()
            .and_then(|k| k.parse::<Namespace>().ok());
        let entry = serde_json::Deserializer::from_slice(&rest[brace..])
            .into_iter::<NsEntry>()
            .next();
        match (id, entry) {
            (Some(id), Some(Ok(e))) if e.record.id() == id => {
                kept.insert(id, e);
            }
            _ => bad += 1,
        }
    }
    bad
}

/// Writes `text` to the first free `namespaces.json.corrupt-N` (created
/// `O_EXCL`: nothing there is overwritten or followed) and syncs it.
fn keep_copy(dir: &Path, text: &[u8]) -> Result<PathBuf> {
    use std::os::unix::fs::OpenOptionsExt;
    for n in 0u32..1000 {
        let p = dir.join(format!("{FILE_NAME}.corrupt-{n}"));
        let mut f = match crate::store::open_data_file(
            &p,
            fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(crate::store::DATA_FILE_MODE),
            0,
        ) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(io("create", &p, e)),
        };
        crate::store::own_like_dir(&f, dir).map_err(|e| io("chown", &p, e))?;
        f.write_all(text).map_err(|e| io("write", &p, e))?;
        f.sync_all().map_err(|e| io("fsync", &p, e))?;
        return Ok(p);
    }
    Err(Error::Corrupt {
        what: dir.display().to_string(),
        detail: format!("1000 {FILE_NAME}.corrupt-N files already set aside: remove some"),
    })
}

/// Writes the manifest atomically.
pub fn store(dir: &Path, namespaces: &BTreeMap<Namespace, NsEntry>) -> Result<()> {
    let body = serde_json::to_vec_pretty(&FileFormat {
        version: VERSION,
        namespaces: namespaces.clone(),
    })
    .map_err(|e| Error::Corrupt {
        what: "namespace manifest".into(),
        detail: e.to_string(),
    })?;
    write_atomic(dir, FILE_NAME, &body)
}

/// Replaces `dir/name` with `body` durably: a fresh temporary file,
/// fsynced, renamed into place, the directory fsynced.
pub(crate) fn write_atomic(dir: &Path, name: &str, body: &[u8]) -> Result<()> {
    let path = dir.join(name);
    let tmp = dir.join(format!("{name}.tmp"));
    // Failpoint `tier::manifest::write` (feature `failpoints`): the
    // temporary file cannot be written (`return(enospc)`: a full
    // filesystem).
    #[cfg(feature = "failpoints")]
    fail::fail_point!("tier::manifest::write", |arg| Err(io(
        "write",
        &tmp,
        crate::segment::failpoint_error(arg)
    )));
    // Created afresh (`O_EXCL`, after removing a leftover): nothing planted
    // under the temporary name is written, or chowned.
    match fs::remove_file(&tmp) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io("remove the leftover", &tmp, e)),
    }
    let mut f = {
        use std::os::unix::fs::OpenOptionsExt;
        crate::store::open_data_file(
            &tmp,
            fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(crate::store::DATA_FILE_MODE),
            0,
        )
    }
    .map_err(|e| io("create", &tmp, e))?;
    let filled = crate::store::own_like_dir(&f, dir)
        .map_err(|e| io("chown", &tmp, e))
        .and_then(|()| f.write_all(body).map_err(|e| io("write", &tmp, e)))
        .and_then(|()| f.sync_all().map_err(|e| io("fsync", &tmp, e)));
    drop(f);
    if let Err(e) = filled {
        // Not left behind (QA: a full filesystem left empty `.tmp` files).
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    if let Err(e) = fs::rename(&tmp, &path) {
        let _ = fs::remove_file(&tmp);
        return Err(io("rename into place", &path, e));
    }
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| io("fsync the directory of", &path, e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_refuses_garbage() {
        let dir = tempfile::tempdir().unwrap();
        assert!(load(dir.path()).unwrap().is_empty());
        let rec = NamespaceRecord {
            model: "m".into(),
            ..Default::default()
        };
        let mut m = BTreeMap::new();
        m.insert(
            rec.id(),
            NsEntry {
                record: rec.clone(),
                last_used_ms: 5,
            },
        );
        store(dir.path(), &m).unwrap();
        assert_eq!(load(dir.path()).unwrap(), m);
        fs::write(path_in(dir.path()), b"{not json").unwrap();
        assert!(matches!(
            load(dir.path()),
            Err(Error::ManifestCorrupt { .. })
        ));
    }

    fn entry(model: &str) -> (Namespace, NsEntry) {
        let record = NamespaceRecord {
            model: model.into(),
            ..Default::default()
        };
        (
            record.id(),
            NsEntry {
                record,
                last_used_ms: 7,
            },
        )
    }

    #[test]
    fn salvage_keeps_the_records_that_check_and_sets_the_file_aside() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(salvage(dir.path()).unwrap(), None, "absent: nothing to do");
        let m: BTreeMap<_, _> = [entry("alpha"), entry("beta")].into_iter().collect();
        store(dir.path(), &m).unwrap();
        assert_eq!(salvage(dir.path()).unwrap(), None, "clean: nothing to do");
        // Bit rot in one record: it no longer hashes to its id.
        let path = path_in(dir.path());
        let text = fs::read_to_string(&path)
            .unwrap()
            .replace("\"beta\"", "\"bet\\u0061x\"");
        fs::write(&path, &text).unwrap();
        assert!(matches!(
            load(dir.path()),
            Err(Error::ManifestCorrupt { .. })
        ));
        let s = salvage(dir.path()).unwrap().expect("salvaged");
        assert_eq!((s.kept, s.lost), (1, 1));
        assert_eq!(
            fs::read_to_string(&s.set_aside).unwrap(),
            text,
            "kept as it was"
        );
        let (alpha, _) = entry("alpha");
        let loaded = load(dir.path()).unwrap();
        assert_eq!(loaded.keys().copied().collect::<Vec<_>>(), vec![alpha]);
        // Cut short where the second record starts: the first is kept.
        let two: BTreeMap<_, _> = [entry("alpha"), entry("beta")].into_iter().collect();
        store(dir.path(), &two).unwrap();
        let ids: Vec<Namespace> = two.keys().copied().collect();
        let full = fs::read_to_string(&path).unwrap();
        let second = full.find(&format!("\"{}\"", ids[1])).expect("second key");
        fs::write(&path, &full[..second]).unwrap();
        let s3 = salvage(dir.path()).unwrap().expect("salvaged");
        assert_eq!((s3.kept, s3.lost), (1, 1), "{}", &full[..second]);
        assert_eq!(
            load(dir.path())
                .unwrap()
                .keys()
                .copied()
                .collect::<Vec<_>>(),
            vec![ids[0]]
        );
        // Nothing parses: no record kept; an earlier set-aside file is not
        // overwritten.
        fs::write(&path, b"{\"version\": 1, \"namesp").unwrap();
        let s2 = salvage(dir.path()).unwrap().expect("salvaged");
        assert_eq!((s2.kept, s2.lost), (0, 1));
        assert_ne!(s2.set_aside, s.set_aside);
        assert!(s.set_aside.exists() && s2.set_aside.exists());
        assert!(load(dir.path()).unwrap().is_empty());
        // Another version is refused, not salvaged.
        fs::write(&path, b"{\"version\": 9, \"namespaces\": 3}").unwrap();
        assert!(matches!(
            salvage(dir.path()),
            Err(Error::IncompatibleVersion { found: 9, .. })
        ));
        assert!(path.exists(), "left in place");
    }
}
