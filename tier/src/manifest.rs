//! `namespaces.json`: the record of every namespace registered with the
//! store, with a coarse last-used time (for `gc` by age).
//!
//! Written atomically: a temporary file, fsync, rename over the old one,
//! fsync of the directory. A crash leaves either the old or the new file.
//! A file that does not parse is refused at open with [`Error::Corrupt`]
//! (never silently replaced: it is the only copy of the records).

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
    let f: FileFormat = serde_json::from_slice(&text).map_err(|e| Error::Corrupt {
        what: path.display().to_string(),
        detail: e.to_string(),
    })?;
    if f.version != VERSION {
        return Err(Error::IncompatibleVersion {
            found: f.version,
            supported: VERSION.to_string(),
            hint: "namespaces.json was written by another kvtier version",
        });
    }
    for (id, e) in &f.namespaces {
        if e.record.id() != *id {
            return Err(Error::Corrupt {
                what: path.display().to_string(),
                detail: format!("record listed under {id} hashes to {}", e.record.id()),
            });
        }
    }
    Ok(f.namespaces)
}

/// Writes the manifest atomically.
pub fn store(dir: &Path, namespaces: &BTreeMap<Namespace, NsEntry>) -> Result<()> {
    let path = path_in(dir);
    let tmp = dir.join(format!("{FILE_NAME}.tmp"));
    let body = serde_json::to_vec_pretty(&FileFormat {
        version: VERSION,
        namespaces: namespaces.clone(),
    })
    .map_err(|e| Error::Corrupt {
        what: "namespace manifest".into(),
        detail: e.to_string(),
    })?;
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
    crate::store::own_like_dir(&f, dir).map_err(|e| io("chown", &tmp, e))?;
    f.write_all(&body).map_err(|e| io("write", &tmp, e))?;
    f.sync_all().map_err(|e| io("fsync", &tmp, e))?;
    drop(f);
    fs::rename(&tmp, &path).map_err(|e| io("rename into place", &path, e))?;
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
        assert!(matches!(load(dir.path()), Err(Error::Corrupt { .. })));
    }
}
