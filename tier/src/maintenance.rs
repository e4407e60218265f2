//! Maintenance: `verify` (re-read and check every chunk on disk; repair
//! drops bad ones only when asked) and `gc` (drop namespaces by id or by
//! age of last use).

use std::collections::HashSet;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::store::{GcOptions, GcReport, Inner, VerifyOptions, VerifyReport};
use crate::types::{ChunkId, Namespace};
use crate::{Error, Result};

/// The file naming the namespaces a `gc --apply` is dropping: written
/// durably before its first delete, removed once its deletes are durable.
/// A writable open that finds it (the gc was killed part way) finishes
/// the drop, so a gc is all or nothing across crashes.
pub const GC_PENDING_FILE: &str = "gc.pending";

#[derive(Serialize, Deserialize)]
struct GcPending {
    version: u32,
    namespaces: Vec<Namespace>,
}

/// The namespaces of an interrupted `gc --apply` in `data_dir`, if any.
/// A file that does not parse is [`Error::Corrupt`].
pub fn pending_gc(data_dir: &Path) -> Result<Option<Vec<Namespace>>> {
    let path = data_dir.join(GC_PENDING_FILE);
    let text = match std::fs::read(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => {
            return Err(Error::Io {
                op: "read",
                path,
                source: e,
            });
        }
    };
    match serde_json::from_slice::<GcPending>(&text) {
        Ok(p) if p.version == 1 => Ok(Some(p.namespaces)),
        Ok(p) => Err(Error::Corrupt {
            what: path.display().to_string(),
            detail: format!("version {} (this kvtier writes 1)", p.version),
        }),
        Err(e) => Err(Error::Corrupt {
            what: path.display().to_string(),
            detail: e.to_string(),
        }),
    }
}

fn clear_pending_gc(data_dir: &Path) -> Result<()> {
    let path = data_dir.join(GC_PENDING_FILE);
    match std::fs::remove_file(&path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::Io {
            op: "remove",
            path,
            source: e,
        }),
    }
}

/// Finishes a `gc --apply` that was interrupted (see [`GC_PENDING_FILE`]);
/// called by a writable open. It never fails the open: a gc that fails
/// again (a full or failing disk) is logged and left pending for the next
/// open, and the store serves meanwhile. A file that does not parse is
/// logged and removed: nothing was dropped on its account yet, since it is
/// written whole before the first delete.
pub(crate) fn finish_pending_gc(inner: &Inner) {
    let dir = &inner.config.data_dir;
    let finished = match pending_gc(dir) {
        Ok(None) => return,
        Ok(Some(namespaces)) => gc(
            inner,
            &GcOptions {
                namespaces,
                older_than: None,
                dry_run: false,
            },
        )
        .map(|report| {
            tracing::warn!(
                namespaces = report.namespaces.len(),
                chunks = report.chunks,
                bytes = report.bytes,
                "finished a gc --apply that was interrupted"
            );
        }),
        Err(e) => {
            tracing::warn!(error = %e, "ignoring an unreadable {GC_PENDING_FILE}");
            Ok(())
        }
    };
    // gc cleared it unless nothing was left to drop.
    match finished.and_then(|()| clear_pending_gc(dir)) {
        Ok(()) => {}
        Err(e) => tracing::error!(
            error = %e,
            "could not finish an interrupted gc --apply; it stays pending ({GC_PENDING_FILE}) \
             and the next open tries again"
        ),
    }
}

/// At most this many problem lines are kept in a report.
const MAX_PROBLEMS: usize = 100;

pub(crate) fn verify(
    inner: &Inner,
    opts: &VerifyOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<VerifyReport> {
    let mut report = VerifyReport::default();
    let Some(d) = &inner.disk else {
        return Ok(report);
    };
    if let Some(p) = d.poisoned() {
        return Err(crate::Error::Poisoned(p));
    }
    let snapshot: Vec<_> = d.index.read().iter().copied().collect();
    let total = snapshot.len() as u64;
    for (i, (id, loc)) in snapshot.into_iter().enumerate() {
        if let Err(why) = d.read_at_location(&id, None, &loc) {
            // Skip entries that moved or left meanwhile (rewritten, reclaimed).
            if d.index.read().get(&id) == Some(loc) {
                report.bad += 1;
                if report.problems.len() < MAX_PROBLEMS {
                    report.problems.push(format!(
                        "{}/{}/{} region {} offset {}: {why}",
                        id.ns, id.key, id.group, loc.region, loc.offset
                    ));
                }
                if opts.repair {
                    d.counters
                        .verify_failures
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    // Drop the disk copy only; a RAM copy (verified bytes
                    // from the engine) stays.
                    let ram = inner.ram.remove(&id);
                    inner.delete_inner(&id, ram.is_none());
                    if let Some(e) = ram {
                        // What it evicts goes to the writer like any
                        // eviction (a dirty one is spilled until written).
                        if let Ok((_, evicted)) = inner.ram.insert(id, e.data, e.name, true) {
                            inner.handle_evicted(evicted);
                        }
                    }
                    report.dropped += 1;
                }
            }
        }
        report.checked += 1;
        progress(i as u64 + 1, total);
    }
    Ok(report)
}

pub(crate) fn gc(inner: &Inner, opts: &GcOptions) -> Result<GcReport> {
    let now = crate::layout::now_ms();
    let mut chosen: HashSet<Namespace> = opts.namespaces.iter().copied().collect();
    if !opts.dry_run && inner.disk.is_some() {
        // An earlier drop the open could not finish (no space) is part of
        // this one: this gc's selection replaces `gc.pending`, and must not
        // forget it.
        if let Ok(Some(earlier)) = pending_gc(&inner.config.data_dir) {
            chosen.extend(earlier);
        }
    }
    if let Some(age) = opts.older_than {
        let age_ms = u64::try_from(age.as_millis()).unwrap_or(u64::MAX);
        for (ns, last) in inner.namespace_last_used() {
            if now.saturating_sub(last) >= age_ms {
                chosen.insert(ns);
            }
        }
    }
    let mut report = GcReport::default();
    if chosen.is_empty() {
        return Ok(report);
    }
    let mut victims: Vec<(ChunkId, u64)> = Vec::new();
    let mut seen = HashSet::new();
    if let Some(d) = &inner.disk {
        for (id, l) in d.index.read().iter() {
            if chosen.contains(&id.ns) && seen.insert(*id) {
                victims.push((*id, u64::from(l.payload_len)));
            }
        }
    }
    for (id, _) in inner.ram.ids() {
        if chosen.contains(&id.ns) && seen.insert(id) {
            if let Some(e) = inner.ram.peek_any(&id) {
                victims.push((id, e.data.len() as u64));
            }
        }
    }
    // Only what the store holds is reported: a namespace in its manifest,
    // or with chunks (a manifest entry can be missing); an id it does not
    // hold (a typo, another node's) is not "dropped".
    let mut held: HashSet<Namespace> = victims.iter().map(|(id, _)| id.ns).collect();
    held.extend(inner.namespace_last_used().into_iter().map(|(ns, _)| ns));
    report.namespaces = chosen.intersection(&held).copied().collect();
    report.namespaces.sort();
    report.chunks = victims.len() as u64;
    report.bytes = victims.iter().map(|(_, l)| l).sum();
    if opts.dry_run {
        return Ok(report);
    }
    // All or nothing across a crash: the selection is durable first, and
    // stays until the deletes are (a writable open finishes it).
    let durable = inner.disk.is_some() && !report.namespaces.is_empty();
    if durable {
        let body = serde_json::to_vec(&GcPending {
            version: 1,
            namespaces: report.namespaces.clone(),
        })
        .expect("namespace ids serialize");
        crate::manifest::write_atomic(&inner.config.data_dir, GC_PENDING_FILE, &body)?;
    }
    // Failpoint `tier::maintenance::gc_deleting` (feature `failpoints`):
    // `return` stops the gc here, as a kill would, its selection durable.
    #[cfg(feature = "failpoints")]
    fail::fail_point!("tier::maintenance::gc_deleting", |_| Err(Error::Closed));
    for (id, _) in &victims {
        inner.delete_inner(id, true);
    }
    let gone: Vec<Namespace> = report.namespaces.clone();
    inner.forget_namespaces(&gone)?;
    if durable {
        inner.flush_inner(None)?;
        clear_pending_gc(&inner.config.data_dir)?;
    }
    Ok(report)
}
