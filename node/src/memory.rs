//! Process-wide allocator settings for the daemon.
//!
//! Every PUT (native socket, RESP `SET`, peer fetch) copies a chunk into a
//! freshly allocated buffer of the chunk's size, and every eviction or
//! replacement frees one. With glibc's defaults a buffer of 128 KiB or more
//! may be served by its own `mmap` and handed back with `munmap` when freed
//! (the "dynamic mmap threshold" only rises after such a free), and free
//! memory at the top of a heap above 128 KiB is trimmed back to the kernel.
//! Either way the next chunk lands on pages the kernel has to fault in and
//! zero again: 64 page faults per 256 KiB chunk, which cost more than the
//! copy itself (measured with `node/benches/native.rs`, see
//! `docs/benchmarks.md`).
//!
//! [`tune_allocator`] fixes glibc's mmap threshold at its maximum (32 MiB on
//! 64-bit), raises the trim threshold and keeps one arena, so that chunk
//! buffers up to 32 MiB come from the heap and the memory of a freed chunk
//! is reused by the next one, on whichever thread, without a fault. The price: the process's resident memory
//! does not shrink after a burst of deletes; it stays near its high-water
//! mark, which the RAM budget bounds (see `docs/operations.md`, "Memory").
//! Chunks above 32 MiB still get their own mapping.
//!
//! Call it before the process starts its threads (the arena limit only
//! applies to threads that have not allocated yet): the `kvtier` binary
//! calls it before it builds its runtime, [`crate::daemon::start`] calls it
//! again for embedders (idempotent), and benches that run the servers
//! in-process call it first, so that they measure what the daemon does.

use std::sync::OnceLock;

/// glibc's largest accepted `M_MMAP_THRESHOLD` on 64-bit targets
/// (`4 * 1024 * 1024 * sizeof(long)`); a larger value is refused.
pub const MMAP_THRESHOLD: usize = 32 << 20;

/// `M_TRIM_THRESHOLD`: free memory at the top of a heap is returned to the
/// kernel only beyond this much (glibc's default is 128 KiB, dynamic).
pub const TRIM_THRESHOLD: usize = 1 << 30;

/// `M_ARENA_MAX`: one heap for every thread. With glibc's per-thread arenas
/// a chunk allocated on one runtime worker and freed on another (a
/// connection task moves between workers) returns to the first worker's
/// arena, where the second cannot reuse it: the second grows its own heap
/// onto fresh pages, and the first may unmap a heap that fell empty. Chunk
/// allocations are rare (one per PUT) and small allocations are served
/// from per-thread caches, so one arena costs little contention.
pub const ARENA_MAX: libc::c_int = 1;

/// What [`tune_allocator`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum AllocatorTuning {
    /// glibc accepted both settings.
    Applied,
    /// glibc refused a setting (the process keeps glibc's defaults for it).
    Refused,
    /// Not a glibc target: nothing to do (other allocators reuse memory
    /// on their own terms).
    Unsupported,
}

/// Applies the allocator settings described in the module docs. Idempotent:
/// the first call decides, later calls return its outcome.
pub fn tune_allocator() -> AllocatorTuning {
    static DONE: OnceLock<AllocatorTuning> = OnceLock::new();
    *DONE.get_or_init(apply)
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn apply() -> AllocatorTuning {
    let to_int = |v: usize| libc::c_int::try_from(v).expect("threshold fits a C int");
    // SAFETY: mallopt only changes allocator parameters; it is safe to call
    // at any time from any thread (glibc takes its own lock).
    let ok = unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, to_int(MMAP_THRESHOLD)) == 1
            && libc::mallopt(libc::M_TRIM_THRESHOLD, to_int(TRIM_THRESHOLD)) == 1
            && libc::mallopt(libc::M_ARENA_MAX, ARENA_MAX) == 1
    };
    if ok {
        AllocatorTuning::Applied
    } else {
        AllocatorTuning::Refused
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn apply() -> AllocatorTuning {
    AllocatorTuning::Unsupported
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Minor page faults of this process so far.
    fn minflt() -> u64 {
        // SAFETY: getrusage writes one `rusage` into the zeroed struct we own.
        let ru = unsafe {
            let mut ru: libc::rusage = std::mem::zeroed();
            libc::getrusage(libc::RUSAGE_SELF, &mut ru);
            ru
        };
        ru.ru_minflt as u64
    }

    /// Page faults of a second round of 64 fresh 256 KiB buffers, after a
    /// first round was allocated, touched and freed (a store that deletes
    /// or evicts its chunks and refills).
    fn refill_faults() -> u64 {
        const LEN: usize = 256 << 10;
        let round = || -> Vec<Vec<u8>> {
            (0..64)
                .map(|_| {
                    let mut v = Vec::with_capacity(LEN);
                    v.resize(LEN, 1);
                    std::hint::black_box(v)
                })
                .collect()
        };
        drop(round());
        let before = minflt();
        let second = round();
        let faults = minflt() - before;
        drop(second);
        faults
    }

    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn freed_chunk_buffers_are_reused_without_faults_once_tuned() {
        assert_eq!(tune_allocator(), AllocatorTuning::Applied);
        assert_eq!(tune_allocator(), AllocatorTuning::Applied, "idempotent");
        let faults = refill_faults();
        // glibc's defaults fault every page of the second round here
        // (64 buffers x 64 pages = 4,096); other threads of the test binary
        // may fault a few pages meanwhile.
        assert!(
            faults < 500,
            "{faults} page faults for 64 reused 256 KiB buffers"
        );
    }
}
