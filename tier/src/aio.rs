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
//! syscalls. Where `io_setup` fails, the reader logs it once and reports
//! itself unavailable, and the device reads the plain way; a piece the
//! kernel will not take is read with `pread`.

use std::io;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;

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

/// One AIO context. Dropping it destroys the context, which waits for any
/// I/O still in flight on it.
struct Ctx(libc::c_ulong);

impl Ctx {
    fn new() -> io::Result<Self> {
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

/// Split reads over a pool of AIO contexts (one per concurrent reader,
/// created on demand, kept for reuse).
#[derive(Default)]
pub(crate) struct SplitReader {
    ctxs: Mutex<Vec<Ctx>>,
    unavailable: AtomicBool,
}

/// Piece boundaries for a read of `len` bytes: `len` split into at most
/// [`MAX_PIECES`] block-aligned pieces of at least [`MIN_PIECE`].
pub(crate) fn piece_len(len: usize) -> usize {
    let pieces = (len / MIN_PIECE).clamp(1, MAX_PIECES);
    len.div_ceil(pieces).next_multiple_of(4096)
}

impl SplitReader {
    /// Whether split reads work here (false after `io_setup` failed once).
    pub(crate) fn available(&self) -> bool {
        !self.unavailable.load(Ordering::Relaxed)
    }

    /// Turns split reads off (tests of the plain path).
    #[cfg(test)]
    pub(crate) fn disable(&self) {
        self.unavailable.store(true, Ordering::Relaxed);
    }

    fn take_ctx(&self) -> Option<Ctx> {
        if let Some(c) = self.ctxs.lock().pop() {
            return Some(c);
        }
        match Ctx::new() {
            Ok(c) => Some(c),
            Err(e) => {
                if !self.unavailable.swap(true, Ordering::Relaxed) {
                    tracing::warn!(error = %e,
                        "Linux AIO unavailable (io_setup failed); large disk reads are not split");
                }
                None
            }
        }
    }

    /// Reads `buf.len()` bytes at `offset` of `fd` as pieces, [`WINDOW`]
    /// in flight at a time, calling `arrived` with each piece in order once
    /// it and all before it have landed. `None`: AIO is unavailable,
    /// nothing was read.
    ///
    /// Never returns while the kernel may still write into `buf`.
    pub(crate) fn read(
        &self,
        fd: RawFd,
        buf: &mut [u8],
        offset: u64,
        arrived: &mut dyn FnMut(&[u8]),
    ) -> Option<io::Result<()>> {
        let ctx = self.take_ctx()?;
        let piece = piece_len(buf.len());
        let n = buf.len().div_ceil(piece);
        let base = buf.as_mut_ptr();
        let range = |i: usize| (i * piece, ((i + 1) * piece).min(buf.len()));
        let mut iocbs: Vec<Iocb> = (0..n)
            .map(|i| {
                let (lo, hi) = range(i);
                Iocb {
                    data: i as u64,
                    lio_opcode: IOCB_CMD_PREAD,
                    fildes: fd as u32,
                    // SAFETY: lo < buf.len(), inside the allocation.
                    buf: unsafe { base.add(lo) } as u64,
                    nbytes: (hi - lo) as u64,
                    offset: (offset + lo as u64) as i64,
                    ..Iocb::default()
                }
            })
            .collect();
        let mut done = [false; MAX_PIECES];
        let mut first_err: Option<io::Error> = None;
        let (mut submitted, mut in_flight, mut next) = (0usize, 0usize, 0usize);
        let mut events = [IoEvent::default(); MAX_PIECES];
        loop {
            // Keep WINDOW pieces queued: the device works on the next one
            // while this thread checks the last one to land.
            while submitted < n && in_flight < WINDOW {
                let mut one = &mut iocbs[submitted] as *mut Iocb;
                // SAFETY: `one` points at a live iocb whose buffer is a
                // piece of `buf` disjoint from every other piece; `buf`
                // outlives it (this function waits for every submitted
                // piece before returning).
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
                let (lo, hi) = range(submitted);
                // SAFETY: a positional read into piece `submitted`, which
                // is not in flight and is disjoint from those that are.
                let got = unsafe {
                    libc::pread(
                        fd,
                        base.add(lo).cast(),
                        hi - lo,
                        (offset + lo as u64) as libc::off_t,
                    )
                };
                if got != (hi - lo) as isize && first_err.is_none() {
                    first_err = Some(if got < 0 {
                        io::Error::last_os_error()
                    } else {
                        short_or_os(got)
                    });
                }
                done[submitted] = true;
                submitted += 1;
            }
            // Hand over every piece that has landed, in order.
            while next < n && done[next] {
                if first_err.is_none() {
                    let (lo, hi) = range(next);
                    // SAFETY: piece `next` has completed and no I/O writes it.
                    arrived(unsafe { std::slice::from_raw_parts(base.add(lo), hi - lo) });
                }
                next += 1;
            }
            if in_flight == 0 {
                if submitted == n {
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
                // Cannot tell what is still in flight: dropping the context
                // waits for all of it before `buf` is released.
                drop(ctx);
                return Some(Err(e));
            }
            for ev in &events[..got as usize] {
                let i = ev.data as usize;
                let (lo, hi) = range(i);
                if ev.res != (hi - lo) as i64 && first_err.is_none() {
                    first_err = Some(short_or_os(ev.res as isize));
                }
                done[i] = true;
            }
            in_flight -= got as usize;
        }
        self.ctxs.lock().push(ctx);
        Some(first_err.map_or(Ok(()), Err))
    }
}

/// The error for a read that returned `got` (a byte count, or a negated
/// errno as AIO completions carry it) instead of the full length.
fn short_or_os(got: isize) -> io::Error {
    if got < 0 {
        io::Error::from_raw_os_error((-got) as i32)
    } else {
        io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!("short read: {got} bytes"),
        )
    }
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
