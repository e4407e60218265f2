//! Maintenance: `verify` (re-read and check every chunk on disk; repair
//! drops bad ones only when asked) and `gc` (drop namespaces by id or by
//! age of last use).

use std::collections::HashSet;

use crate::Result;
use crate::store::{GcOptions, GcReport, Inner, VerifyOptions, VerifyReport};
use crate::types::{ChunkId, Namespace};

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
    for (id, _) in &victims {
        inner.delete_inner(id, true);
    }
    let gone: Vec<Namespace> = report.namespaces.clone();
    inner.forget_namespaces(&gone)?;
    Ok(report)
}
