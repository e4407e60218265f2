//! Split reads with Linux native AIO (`io_setup` / `io_submit` /
//! `io_getevents`), for large records on an `O_DIRECT` file.
//!
//! A verified read is a `pread` and then a CRC32C over the bytes: at one
//! read per reader the device idles while the CPU checksums (~0.1 ms per
//! MiB with cold caches). [`SplitReader`] reads a record as pieces of at
//! least 256 KiB, two in flight at a time, and hands each piece to the
//! caller (which checksums it) as soon as it and every piece before it has
//! landed: the device reads the next piece meanwhile, and only the last
//! pieces' checksums are not overlapped. Measured in the disk bench
//! (docs/benchmarks.md, interleaved with `pread` then CRC on one file):
//! 4 MiB reads gain 2–13 points of raw `pread` speed (median 6), 1 MiB
//! reads −2 to +6 (median 2). Submitting all pieces at once gained
//! nothing (the device shares its bandwidth among them and they land
//! together); three in flight or a half-size first piece (to stagger the
//! landings) were no better than two equal pieces in flight.
//!
//! Native AIO is only asynchronous with `O_DIRECT`; some sandboxes block its
//! syscalls. Where the kernel refuses AIO for good (ENOSYS, EPERM, EACCES,
//! EINVAL) the reader logs it once and turns splitting off, and the device
//! reads the plain way; where it is only short of contexts (EAGAIN:
//! `fs.aio-max-nr`) that one read is not split. A piece the kernel will not
//! take, that fails or that comes back short is read again with
//! `read_exact_at` (EINTR and short reads retried, as the plain path does).
//! At most [`MAX_CTXS`] contexts exist per device; reads beyond that many
//! at once are not split. Whatever happens (an error, a panic in the
//! caller's callback), the reader waits for every submitted piece before
//! the buffer goes back to the caller.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use parking_lot::Mutex;

use crate::device::BLOCK;

/// Most pieces one read is split into (also the events of a context).
pub(crate) const MAX_PIECES: usize = 8;
/// Pieces in flight at once.
const WINDOW: usize = 2;
/// Reads shorter than this are not split.
pub(crate) const SPLIT_FROM: usize = 512 << 10;
/// Smallest piece (bytes, a multiple of the 4 KiB block).
const MIN_PIECE: usize = 256 << 10;

const IOCB_CMD_PREAD: u16 = 0;

/// `struct iocb` of `<linux/aio_abi.h>` (64 bytes; `aio_key` and
/// `aio_rw_flags` are both zero here, so their order does not matter).
#[repr(C)]
#[derive(Default)]
struct Iocb {
    data: u64,
    key: u32,
    rw_flags: i32,
    lio_opcode: u16,
    reqprio: i16,
    fildes: u32,
    buf: u64,
    nbytes: u64,
    offset: i64,
    reserved2: u64,
    flags: u32,
    resfd: u32,
}

/// `struct io_event` of `<linux/aio_abi.h>`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct IoEvent {
    data: u64,
    obj: u64,
    res: i64,
    res2: i64,
}

// The kernel's layouts (same on x86_64 and aarch64).
const _: () = assert!(size_of::<Iocb>() == 64 && std::mem::offset_of!(Iocb, buf) == 24);
const _: () = assert!(size_of::<IoEvent>() == 32 && std::mem::offset_of!(IoEvent, res) == 16);

/// One AIO context. Dropping it destroys the context (about 30 ms), which
/// waits for any I/O still in flight on it (Linux 3.19 and later); the
/// reader drains its own pieces first and relies on that only when
/// `io_getevents` itself fails.
struct Ctx(libc::c_ulong);

impl Ctx {
    fn new() -> io::Result<Self> {
        #[cfg(feature = "failpoints")]
        fail::fail_point!("tier::aio::setup", |arg| Err(failpoint_errno(arg)));
        let mut id: libc::c_ulong = 0;
        // SAFETY: io_setup writes one aio_context_t through a valid pointer.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_io_setup,
                MAX_PIECES as libc::c_long,
                &mut id as *mut libc::c_ulong,
            )
        };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Self(id))
    }
}

impl Drop for Ctx {
    fn drop(&mut self) {
        // SAFETY: the context is ours; io_destroy waits for in-flight I/O.
        unsafe { libc::syscall(libc::SYS_io_destroy, self.0) };
    }
}

/// Most AIO contexts a reader keeps (one per concurrent split read; reads
/// beyond that many at once are not split). Each costs `fs.aio-nr` slots.
pub(crate) const MAX_CTXS: usize = 16;

/// Split reads over a pool of AIO contexts (one per concurrent reader,
/// created on demand up to [`MAX_CTXS`], kept for reuse).
#[derive(Default)]
pub(crate) struct SplitReader {
    // parking_lot Mutex: a push or pop, never held across a syscall.
    ctxs: Mutex<Vec<Ctx>>,
    /// Contexts in existence (pooled or in use).
    live: AtomicUsize,
    unavailable: AtomicBool,
    warned_busy: AtomicBool,
}

impl Drop for SplitReader {
    fn drop(&mut self) {
        // Destroying a context takes ~30 ms: off the dropping thread.
        let ctxs = std::mem::take(self.ctxs.get_mut());
        if !ctxs.is_empty() {
            let _ = std::thread::Builder::new()
                .name("kvtier-aio-free".into())
                .spawn(move || drop(ctxs));
        }
    }
}

/// Piece boundaries for a read of `len` bytes: `len` split into at most
/// [`MAX_PIECES`] block-aligned pieces of at least [`MIN_PIECE`].
pub(crate) fn piece_len(len: usize) -> usize {
    let pieces = (len / MIN_PIECE).clamp(1, MAX_PIECES);
    len.div_ceil(pieces).next_multiple_of(BLOCK as usize)
}

impl SplitReader {
    /// Whether split reads work here (false once the kernel refused AIO
    /// for good: ENOSYS, EPERM, EACCES, EINVAL).
    pub(crate) fn available(&self) -> bool {
        !self.unavailable.load(Ordering::Relaxed)
    }

    /// Turns split reads off (tests of the plain path).
    #[cfg(test)]
    pub(crate) fn disable(&self) {
        self.unavailable.store(true, Ordering::Relaxed);
    }

    /// Contexts in existence (tests).
    #[cfg(test)]
    pub(crate) fn contexts(&self) -> usize {
        self.live.load(Ordering::Relaxed)
    }

    /// Notes that the kernel refused `what` with `e`: refusals for good
    /// turn splitting off (logged once); others (EAGAIN: `fs.aio-max-nr`
    /// used up, ENOMEM) only skip it for this read (logged once).
    fn refused(&self, what: &str, e: &io::Error) {
        let for_good = matches!(
            e.raw_os_error(),
            Some(libc::ENOSYS | libc::EPERM | libc::EACCES | libc::EINVAL)
        );
        if for_good {
            if !self.unavailable.swap(true, Ordering::Relaxed) {
                tracing::warn!(error = %e,
                    "Linux AIO unavailable ({what} failed); large disk reads are not split");
            }
        } else if !self.warned_busy.swap(true, Ordering::Relaxed) {
            tracing::warn!(error = %e,
                "Linux AIO busy ({what} failed); this read and others like it are not split");
        }
    }

    fn take_ctx(&self) -> Option<Ctx> {
        if let Some(c) = self.ctxs.lock().pop() {
            return Some(c);
        }
        if self.live.fetch_add(1, Ordering::Relaxed) >= MAX_CTXS {
            self.live.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        match Ctx::new() {
            Ok(c) => Some(c),
            Err(e) => {
                self.live.fetch_sub(1, Ordering::Relaxed);
                self.refused("io_setup", &e);
                None
            }
        }
    }

    /// Drops a context that is not going back to the pool.
    fn discard(&self, ctx: Ctx) {
        self.live.fetch_sub(1, Ordering::Relaxed);
        drop(ctx);
    }

    /// Reads `buf.len()` bytes at `offset` of `file` as pieces, [`WINDOW`]
    /// in flight at a time, calling `arrived` with each piece in order once
    /// it and all before it have landed. A piece that fails or comes back
    /// short is read again the plain way (as `read_exact_at` would) before
    /// the read counts as failed; after a failure nothing more is
    /// submitted. `None`: not split (AIO unavailable or busy, or a read
    /// under [`SPLIT_FROM`]), nothing was read: the caller reads plainly.
    ///
    /// Never returns, nor unwinds from a panic in `arrived`, while the
    /// kernel may still write into `buf`.
    pub(crate) fn read(
        &self,
        file: &File,
        buf: &mut [u8],
        offset: u64,
        arrived: &mut dyn FnMut(&[u8]),
    ) -> Option<io::Result<()>> {
        let len = buf.len();
        if len < SPLIT_FROM || !self.available() {
            return None;
        }
        let ctx = self.take_ctx()?;
        let piece = piece_len(len);
        let n = len.div_ceil(piece);
        let base = buf.as_mut_ptr();
        let range = |i: usize| (i * piece, ((i + 1) * piece).min(len));
        // Piece i as a slice; only for pieces not in flight.
        let part = |i: usize| {
            let (lo, hi) = range(i);
            // SAFETY: piece i lies inside `buf`, is disjoint from every
            // other piece, and no I/O writes it when this is called.
            unsafe { std::slice::from_raw_parts_mut(base.add(lo), hi - lo) }
        };
        let mut iocbs: Vec<Iocb> = (0..n)
            .map(|i| {
                let (lo, hi) = range(i);
                Iocb {
                    data: i as u64,
                    lio_opcode: IOCB_CMD_PREAD,
                    fildes: file.as_raw_fd() as u32,
                    // SAFETY: lo < len, inside the allocation.
                    buf: unsafe { base.add(lo) } as u64,
                    nbytes: (hi - lo) as u64,
                    offset: (offset + lo as u64) as i64,
                    ..Iocb::default()
                }
            })
            .collect();
        let mut done = [false; MAX_PIECES];
        let mut first_err: Option<io::Error> = None;
        let mut panicked = None;
        let (mut submitted, mut in_flight, mut next) = (0usize, 0usize, 0usize);
        let mut events = [IoEvent::default(); MAX_PIECES];
        // A piece that failed or came back short (`got` bytes, or a negated
        // errno) is read again the plain way.
        let redo = |i: usize, got: i64, first_err: &mut Option<io::Error>| {
            let from = usize::try_from(got).unwrap_or(0);
            let (lo, _) = range(i);
            if let Err(e) = file.read_exact_at(&mut part(i)[from..], offset + (lo + from) as u64) {
                first_err.get_or_insert(e);
            }
        };
        loop {
            // Keep WINDOW pieces queued: the device works on the next one
            // while this thread checks the last one to land.
            while submitted < n && in_flight < WINDOW && first_err.is_none() && panicked.is_none() {
                let mut one = &mut iocbs[submitted] as *mut Iocb;
                // SAFETY: `one` points at a live iocb whose buffer is a
                // piece of `buf` disjoint from every other piece; `buf`
                // outlives it (every submitted piece is waited for below,
                // also when `arrived` panics).
                let rc = unsafe {
                    libc::syscall(
                        libc::SYS_io_submit,
                        ctx.0,
                        1 as libc::c_long,
                        &mut one as *mut *mut Iocb,
                    )
                };
                if rc == 1 {
                    submitted += 1;
                    in_flight += 1;
                    continue;
                }
                let e = io::Error::last_os_error();
                if rc < 0 && e.raw_os_error() == Some(libc::EINTR) {
                    continue;
                }
                // The kernel did not take it: read this piece the plain way.
                if rc < 0 {
                    self.refused("io_submit", &e);
                }
                redo(submitted, 0, &mut first_err);
                done[submitted] = true;
                submitted += 1;
            }
            // Hand over every piece that has landed, in order.
            while next < n && done[next] && first_err.is_none() && panicked.is_none() {
                let (lo, hi) = range(next);
                // SAFETY: piece `next` has completed and no I/O writes it.
                let landed = unsafe { std::slice::from_raw_parts(base.add(lo), hi - lo) };
                let call = std::panic::AssertUnwindSafe(|| arrived(landed));
                if let Err(p) = std::panic::catch_unwind(call) {
                    panicked = Some(p);
                }
                next += 1;
            }
            if in_flight == 0 {
                if submitted == n || first_err.is_some() || panicked.is_some() {
                    break;
                }
                continue;
            }
            // SAFETY: events has room for `in_flight` <= MAX_PIECES events.
            let got = unsafe {
                libc::syscall(
                    libc::SYS_io_getevents,
                    ctx.0,
                    1 as libc::c_long,
                    in_flight as libc::c_long,
                    events.as_mut_ptr(),
                    std::ptr::null_mut::<libc::timespec>(),
                )
            };
            if got < 0 {
                let e = io::Error::last_os_error();
                if e.raw_os_error() == Some(libc::EINTR) {
                    continue;
                }
                // Cannot tell what is still in flight: destroying the
                // context waits for all of it before `buf` is released.
                self.discard(ctx);
                return Some(Err(e));
            }
            for ev in &events[..got as usize] {
                let i = ev.data as usize;
                let (lo, hi) = range(i);
                #[cfg(feature = "failpoints")]
                let ev = &IoEvent {
                    res: failpoint_piece(ev.res),
                    ..*ev
                };
                if ev.res != (hi - lo) as i64 && first_err.is_none() {
                    redo(i, ev.res, &mut first_err);
                }
                done[i] = true;
            }
            in_flight -= got as usize;
        }
        // Every piece has landed: the context is clean for the next read.
        self.ctxs.lock().push(ctx);
        if let Some(p) = panicked {
            std::panic::resume_unwind(p);
        }
        Some(first_err.map_or(Ok(()), Err))
    }
}

/// Failpoint `tier::aio::setup` (feature `failpoints`): `io_setup` fails
/// with the errno named by the argument (`eagain`, `eperm`, else EIO).
#[cfg(feature = "failpoints")]
fn failpoint_errno(arg: Option<String>) -> io::Error {
    io::Error::from_raw_os_error(match arg.as_deref() {
        Some("eagain") => libc::EAGAIN,
        Some("eperm") => libc::EPERM,
        _ => libc::EIO,
    })
}

/// Failpoint `tier::aio::piece` (feature `failpoints`): a completed piece
/// reports `short` (half its bytes), `eintr`, or else EIO, instead of `res`.
#[cfg(feature = "failpoints")]
fn failpoint_piece(res: i64) -> i64 {
    fail::eval("tier::aio::piece", |arg| match arg.as_deref() {
        Some("short") => res / 2 / 4096 * 4096,
        Some("eintr") => -i64::from(libc::EINTR),
        _ => -i64::from(libc::EIO),
    })
    .unwrap_or(res)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_are_aligned_few_and_cover_the_read() {
        for len in [
            SPLIT_FROM,
            1 << 20,
            (1 << 20) + 8192,
            4 << 20,
            (4 << 20) + 4096,
            64 << 20,
        ] {
            let piece = piece_len(len);
            let n = len.div_ceil(piece);
            assert_eq!(piece % 4096, 0);
            assert!(piece >= MIN_PIECE, "{len}: {piece}");
            assert!((2..=MAX_PIECES).contains(&n), "{len}: {n} pieces");
            assert!((n - 1) * piece < len, "{len}: no empty piece");
        }
    }
}
