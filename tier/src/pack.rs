//! Copy + CRC32C of chunk payloads into a disk write batch, spread over a
//! few helper threads (`kvtier-pack-N`) besides the writer thread.
//!
//! Payloads arrive in unaligned memory, so `O_DIRECT` needs them copied into
//! the aligned batch buffer; the format needs their CRC32C. Both touch every
//! byte and run in one pass over small pieces (the CRC reads what the copy
//! just wrote, still in cache). One thread does this at roughly the speed of
//! a fast disk, so large batches are cut into pieces that the writer and the
//! helpers take from a shared counter; the per-piece CRCs are combined with
//! `crc32c_combine`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};

use crossbeam_channel::{Receiver, Sender, bounded, unbounded};

/// Unit of work handed to one thread.
const PIECE: usize = 256 << 10;
/// Inner step of the fused copy + CRC (stays in L1/L2 between the two).
const STEP: usize = 64 << 10;

/// A part to copy: `src` goes to `buf[dst..dst + src.len()]`.
pub(crate) struct Part<'a> {
    pub src: &'a [u8],
    pub dst: usize,
}

struct Piece {
    part: usize,
    src: *const u8,
    dst: *mut u8,
    len: usize,
}

struct Task {
    pieces: Vec<Piece>,
    next: AtomicUsize,
    crcs: Vec<AtomicU32>,
}

// SAFETY: the raw pointers of a task's pieces address disjoint ranges of one
// destination buffer and live source buffers; `Packer::copy_crc` keeps both
// borrowed, and touches neither, until every thread that got the task has
// acknowledged it, so no access outlives the borrows or races another.
unsafe impl Send for Task {}
// SAFETY: as above; each piece is claimed by exactly one thread through the
// atomic counter, and the CRC slots are atomics.
unsafe impl Sync for Task {}

impl Task {
    fn run(&self) {
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            let Some(p) = self.pieces.get(i) else {
                return;
            };
            // SAFETY: see `unsafe impl Send for Task`: the ranges are valid
            // for `len` bytes, disjoint, and claimed by this thread alone.
            let (src, dst) = unsafe {
                (
                    std::slice::from_raw_parts(p.src, p.len),
                    std::slice::from_raw_parts_mut(p.dst, p.len),
                )
            };
            self.crcs[i].store(copy_crc_into(src, dst), Ordering::Relaxed);
        }
    }
}

/// Copies `src` into `dst` (same length) and returns the CRC32C of the bytes.
pub(crate) fn copy_crc_into(src: &[u8], dst: &mut [u8]) -> u32 {
    let mut crc = crate::format::Crc32c::default();
    for (s, d) in src.chunks(STEP).zip(dst.chunks_mut(STEP)) {
        d.copy_from_slice(s);
        crc.update(d);
    }
    crc.value()
}

/// The helper threads. With none, everything runs on the calling thread.
pub(crate) struct Packer {
    workers: Vec<Sender<Arc<Task>>>,
    acks: Receiver<()>,
}

impl Packer {
    /// Starts `helpers` threads (fewer if spawning fails; logged).
    pub fn new(helpers: usize) -> Self {
        let (ack_tx, acks) = unbounded();
        let mut workers = Vec::new();
        for n in 0..helpers {
            let (tx, rx) = bounded::<Arc<Task>>(1);
            let ack = ack_tx.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("kvtier-pack-{n}"))
                .spawn(move || {
                    for task in rx {
                        task.run();
                        drop(task);
                        if ack.send(()).is_err() {
                            return;
                        }
                    }
                });
            match spawned {
                Ok(_) => workers.push(tx),
                Err(e) => {
                    tracing::warn!(error = %e, "could not start a kvtier-pack thread");
                    break;
                }
            }
        }
        Self { workers, acks }
    }

    /// Copies every part into `buf` and returns each part's CRC32C, in
    /// order. Parts must not overlap in `buf` (checked).
    ///
    /// `&mut self`: the helpers acknowledge on one shared channel, so two
    /// calls at once could each count the other's acknowledgements and
    /// return while a helper still copies into their buffer.
    pub fn copy_crc(&mut self, buf: &mut [u8], parts: &[Part<'_>]) -> Vec<u32> {
        let total: usize = parts.iter().map(|p| p.src.len()).sum();
        let mut end = 0;
        for p in parts {
            assert!(
                p.dst >= end
                    && p.dst
                        .checked_add(p.src.len())
                        .is_some_and(|e| e <= buf.len()),
                "pack parts overlap or overflow the buffer"
            );
            end = p.dst + p.src.len();
        }
        if self.workers.is_empty() || total < 2 * PIECE {
            return parts
                .iter()
                .map(|p| copy_crc_into(p.src, &mut buf[p.dst..p.dst + p.src.len()]))
                .collect();
        }
        let base = buf.as_mut_ptr();
        let mut pieces = Vec::with_capacity(total / PIECE + parts.len());
        for (k, p) in parts.iter().enumerate() {
            let mut off = 0;
            while off < p.src.len() {
                let len = PIECE.min(p.src.len() - off);
                pieces.push(Piece {
                    part: k,
                    src: p.src[off..].as_ptr(),
                    // SAFETY: `p.dst + off + len <= buf.len()` (checked above).
                    dst: unsafe { base.add(p.dst + off) },
                    len,
                });
                off += len;
            }
        }
        let n = pieces.len();
        let task = Arc::new(Task {
            pieces,
            next: AtomicUsize::new(0),
            crcs: (0..n).map(|_| AtomicU32::new(0)).collect(),
        });
        let mut sent = 0;
        for w in self.workers.iter().take(n - 1) {
            if w.send(task.clone()).is_ok() {
                sent += 1;
            }
        }
        task.run();
        // Every helper that got the task must be done with it before the
        // borrows of `buf` and the sources end.
        for _ in 0..sent {
            if self.acks.recv().is_err() {
                // All helpers are gone, so none can still touch the task.
                break;
            }
        }
        let mut out = vec![0u32; parts.len()];
        let mut seen = vec![false; parts.len()];
        for (p, c) in task.pieces.iter().zip(&task.crcs) {
            let c = c.load(Ordering::Relaxed);
            out[p.part] = if seen[p.part] {
                crate::format::crc32c_combine(out[p.part], c, p.len as u64)
            } else {
                seen[p.part] = true;
                c
            };
        }
        out
    }
}

/// Helper threads for a machine with `cores` cores: a quarter of them, at
/// most 3 (one thread packs about as fast as a fast NVMe drive writes).
pub(crate) fn default_helpers(cores: usize) -> usize {
    (cores / 4).min(3)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parallel_copy_crc_matches_a_plain_copy_and_crc() {
        for helpers in [0, 1, 3] {
            let mut p = Packer::new(helpers);
            let srcs: Vec<Vec<u8>> = [0usize, 1, 4095, PIECE, 3 * PIECE + 17, 1 << 20]
                .iter()
                .enumerate()
                .map(|(i, &n)| (0..n).map(|j| (j * 31 + i * 7) as u8).collect())
                .collect();
            let mut at = 0;
            let parts: Vec<Part<'_>> = srcs
                .iter()
                .map(|s| {
                    let d = at + 64;
                    at = d + s.len();
                    Part { src: s, dst: d }
                })
                .collect();
            let mut buf = vec![0xeeu8; at + 100];
            let crcs = p.copy_crc(&mut buf, &parts);
            for (part, crc) in parts.iter().zip(crcs) {
                assert_eq!(&buf[part.dst..part.dst + part.src.len()], part.src);
                assert_eq!(crc, crc32c::crc32c(part.src), "helpers {helpers}");
                assert_eq!(buf[part.dst - 64], 0xee, "gap untouched");
            }
        }
    }
}
