//! The device layer: every byte the segment store reads or writes goes
//! through a [`Device`] (STYLE.md rule 20), so tests can count I/O
//! (`CountingDevice`) or crash at any sync (`CrashDevice`) with the real store
//! code on top.
//!
//! [`FileDevice`] is the production device: one preallocated file
//! (`store.kvt`), opened with `O_DIRECT` when the filesystem supports it and
//! buffered otherwise. The store only issues I/O at offsets and lengths that
//! are multiples of [`BLOCK`] from [`AlignedBuf`]s, which is what `O_DIRECT`
//! requires.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::fs::{File, OpenOptions};
use std::io;
use std::ops::{Deref, DerefMut};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;

use crate::aio::SplitReader;

/// Alignment and granularity of every store I/O (bytes).
pub const BLOCK: u64 = 4096;

/// A block device-like target: positional reads and writes, a durability
/// barrier and a fixed length.
///
/// Offsets and lengths passed by the store are multiples of [`BLOCK`] and
/// buffers come from [`AlignedBuf`].
pub trait Device: Send + Sync {
    /// Reads exactly `buf.len()` bytes at `offset`.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    /// Reads exactly `buf.len()` bytes at `offset` like [`Device::read_at`],
    /// handing them to `arrived` in order: consecutive slices that together
    /// cover `buf`, each once it has landed. A device that keeps reading
    /// while `arrived` works on the bytes before ([`FileDevice`] with
    /// `O_DIRECT`, for large reads) overlaps the two; this default reads
    /// everything, then hands it over at once. After an error, `arrived`
    /// may have seen a prefix.
    fn read_at_in_order(
        &self,
        buf: &mut [u8],
        offset: u64,
        arrived: &mut dyn FnMut(&[u8]),
    ) -> io::Result<()> {
        read_then_hand_over(self, buf, offset, arrived)
    }
    /// Writes all of `buf` at `offset`. Not durable until [`Device::sync`].
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()>;
    /// Makes every completed write durable (fdatasync).
    fn sync(&self) -> io::Result<()>;
    /// Size of the device in bytes.
    fn len(&self) -> u64;
    /// Whether the device is empty (never, for a usable store).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Whether I/O bypasses the page cache (`O_DIRECT`).
    fn direct_io(&self) -> bool;
    /// The path (or a description) for error messages.
    fn path(&self) -> &Path;
}

/// [`Device::read_at_in_order`] without splitting: the whole read, then
/// one hand-over.
fn read_then_hand_over<D: Device + ?Sized>(
    dev: &D,
    buf: &mut [u8],
    offset: u64,
    arrived: &mut dyn FnMut(&[u8]),
) -> io::Result<()> {
    dev.read_at(buf, offset)?;
    arrived(buf);
    Ok(())
}

/// A heap buffer aligned to [`BLOCK`], zero-initialised, for `O_DIRECT` I/O.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    cap: usize,
}

// SAFETY: AlignedBuf owns its allocation exclusively (like a Vec<u8>).
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only hands out `&[u8]`.
unsafe impl Sync for AlignedBuf {}

/// The allocation layout of an [`AlignedBuf`] holding `len` bytes: its size
/// (the capacity) rounded up to a non-zero multiple of [`BLOCK`], aligned to
/// [`BLOCK`].
/// Panics when that size overflows `usize` (it cannot wrap to a zero-size
/// layout).
pub(crate) fn block_layout(len: usize) -> Layout {
    let cap = len
        .div_ceil(BLOCK as usize)
        .max(1)
        .checked_mul(BLOCK as usize)
        .expect("AlignedBuf capacity overflows usize");
    Layout::from_size_align(cap, BLOCK as usize).expect("block-aligned layout")
}

impl AlignedBuf {
    /// A zeroed buffer of `len` bytes (capacity rounded up to [`BLOCK`]).
    pub fn zeroed(len: usize) -> Self {
        let layout = block_layout(len);
        // SAFETY: layout has a non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        Self {
            ptr,
            len,
            cap: layout.size(),
        }
    }

    /// [`AlignedBuf::zeroed`], with `advise(ptr, capacity)` called on the
    /// allocation before its bytes are first written (the allocator's own
    /// zeroing of an over-aligned block writes every page, so advice given
    /// after it, such as `MADV_HUGEPAGE`, came too late for them).
    pub(crate) fn zeroed_advised(len: usize, advise: impl FnOnce(*mut u8, usize)) -> Self {
        let layout = block_layout(len);
        // SAFETY: layout has a non-zero size.
        let raw = unsafe { std::alloc::alloc(layout) };
        let ptr = NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        advise(raw, layout.size());
        // SAFETY: `raw` is a live allocation of `layout.size()` bytes,
        // zeroed here before any `&[u8]` over it exists.
        unsafe { std::ptr::write_bytes(raw, 0, layout.size()) };
        Self {
            ptr,
            len,
            cap: layout.size(),
        }
    }

    /// Takes ownership of an allocation of `cap` bytes aligned to [`BLOCK`].
    ///
    /// # Safety
    /// `ptr` must come from the global allocator with [`block_layout`]`(len)`,
    /// whose size is `cap`, and all `cap` bytes must be initialised.
    pub(crate) unsafe fn from_raw_parts(ptr: NonNull<u8>, len: usize, cap: usize) -> Self {
        Self { ptr, len, cap }
    }

    /// Capacity in bytes (a multiple of [`BLOCK`]).
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Sets the length, zeroing newly exposed bytes is the caller's business
    /// (the allocation started zeroed). Panics beyond the capacity.
    pub fn set_len(&mut self, len: usize) {
        assert!(len <= self.cap, "AlignedBuf::set_len beyond capacity");
        self.len = len;
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        let layout = block_layout(self.cap);
        // SAFETY: allocated in `zeroed` (or handed to `from_raw_parts`)
        // with this exact layout (`cap` is already a block multiple).
        unsafe { dealloc(self.ptr.as_ptr(), layout) }
    }
}

impl Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: ptr is valid for cap >= len initialised (zeroed) bytes.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in deref, and we hold &mut self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl AsRef<[u8]> for AlignedBuf {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

/// `x` rounded up to a multiple of [`BLOCK`].
pub fn block_up(x: u64) -> u64 {
    x.div_ceil(BLOCK) * BLOCK
}

/// How [`FileDevice::open`] should treat `O_DIRECT`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DirectMode {
    /// Use `O_DIRECT` when the filesystem accepts it, else fall back.
    Auto,
    /// Buffered I/O.
    Off,
    /// Behave as if the filesystem refused `O_DIRECT` (tests the fallback).
    SimulateUnsupported,
}

/// The production device: one preallocated file.
pub struct FileDevice {
    file: File,
    path: PathBuf,
    len: u64,
    direct: bool,
    split: SplitReader,
}

fn is_direct_refusal(e: &io::Error) -> bool {
    e.raw_os_error() == Some(libc::EINVAL) || e.raw_os_error() == Some(libc::EOPNOTSUPP)
}

impl FileDevice {
    /// Opens or creates `path` with exactly `len` bytes, preallocated with
    /// `fallocate` (falling back to a sparse `set_len` where unsupported).
    ///
    /// With [`DirectMode::Auto`] it opens with `O_DIRECT` and probes one
    /// aligned read; a filesystem that refuses either is logged and served
    /// buffered ([`Device::direct_io`] tells which).
    ///
    /// A sparse file is backed again only where the filesystem keeps
    /// `reserve` bytes free after it.
    pub fn open(path: &Path, len: u64, mode: DirectMode, reserve: u64) -> io::Result<Self> {
        // Whether this call makes the file, from the create itself (a probe
        // before it could be answered by another process's file a moment
        // later, which a failed preallocation then removed).
        let (file, existed) = match crate::store::open_data_file(
            path,
            OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .mode(crate::store::DATA_FILE_MODE),
            0,
        ) {
            Ok(f) => (f, false),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => (
                crate::store::open_data_file(path, OpenOptions::new().read(true).write(true), 0)?,
                true,
            ),
            Err(e) => return Err(e),
        };
        let cur = file.metadata()?.len();
        if !existed {
            if let Some(dir) = path.parent() {
                crate::store::own_like_dir(&file, dir)?;
            }
        }
        if cur < len {
            if let Err(e) = preallocate(&file, len) {
                // A fallocate that fails part way keeps what it allocated
                // (QA: a zero-filled file of nearly the whole size left the
                // filesystem with 0 bytes free): undo it, removing a file
                // this call made, or trimming one it grew to its old size.
                // Only while no other process holds the file (its store
                // lock, taken after this open): never under a store that
                // opened it meanwhile (two openers past a removed LOCK).
                let undone = if !try_flock(&file) {
                    Ok(())
                } else if existed {
                    file.set_len(cur)
                } else if same_file(&file, path) {
                    drop(file);
                    std::fs::remove_file(path)
                } else {
                    Ok(())
                };
                if let Err(u) = undone {
                    tracing::warn!(path = %path.display(), error = %u,
                        "could not undo a failed preallocation of the store file");
                }
                return Err(e);
            }
        } else if let Some(sparse) = Sparse::check(&file, len)? {
            // Sparse (copied without its holes, or they were punched): backed
            // again, so that a full filesystem shows now, not as a paused
            // writer later. Where it cannot be, the store still opens; its
            // writes pause on ENOSPC when they reach a hole. Only where the
            // reserve stays free: a fallocate that fails part way keeps what
            // it allocated (QA: it took the filesystem to 0 bytes free).
            if !sparse.leaves(reserve) {
                let Sparse { missing, free } = sparse;
                tracing::warn!(path = %path.display(), missing, free, reserve,
                    "the store file is sparse and backing it again would leave less than \
                     disk-reserve free; it stays sparse: disk writes pause (ENOSPC) if the \
                     filesystem fills");
            } else if let Err(e) = preallocate(&file, len) {
                tracing::warn!(path = %path.display(), error = %e,
                    "the store file is sparse and cannot be preallocated again; \
                     disk writes pause (ENOSPC) if the filesystem fills");
            }
        }
        if !existed {
            // Make the new file's directory entry durable.
            if let Some(dir) = path.parent() {
                File::open(dir)?.sync_all()?;
            }
        }
        Self::with_file(file, path, len, mode, true)
    }

    /// Opens the existing `path` for reading only: nothing is created,
    /// grown, preallocated or written, and [`Device::write_at`] fails
    /// (`EBADF`). For a read-only store ([`crate::TierConfig::read_only`]).
    pub fn open_read_only(path: &Path, len: u64, mode: DirectMode) -> io::Result<Self> {
        let file = crate::store::open_data_file(path, OpenOptions::new().read(true), 0)?;
        Self::with_file(file, path, len, mode, false)
    }

    /// The device on `file`, or on an `O_DIRECT` descriptor of `path` where
    /// `mode` asks for it and the filesystem allows it.
    fn with_file(
        file: File,
        path: &Path,
        len: u64,
        mode: DirectMode,
        writable: bool,
    ) -> io::Result<Self> {
        let (file, direct) = match mode {
            DirectMode::Off => (file, false),
            DirectMode::SimulateUnsupported => {
                tracing::warn!(path = %path.display(), "O_DIRECT unsupported (simulated); using buffered I/O");
                (file, false)
            }
            DirectMode::Auto => match Self::try_direct(path, writable) {
                Ok(f) => (f, true),
                Err(e) if is_direct_refusal(&e) => {
                    tracing::warn!(path = %path.display(), error = %e,
                        "the filesystem refuses O_DIRECT; falling back to buffered I/O");
                    (file, false)
                }
                Err(e) => return Err(e),
            },
        };
        Ok(Self {
            file,
            path: path.to_path_buf(),
            len,
            direct,
            split: SplitReader::default(),
        })
    }

    fn try_direct(path: &Path, writable: bool) -> io::Result<File> {
        let f = crate::store::open_data_file(
            path,
            OpenOptions::new().read(true).write(writable),
            libc::O_DIRECT,
        )?;
        let mut probe = AlignedBuf::zeroed(BLOCK as usize);
        f.read_exact_at(&mut probe, 0)?;
        Ok(f)
    }
}

/// A store file with holes in its first `len` bytes (copied without them,
/// or they were punched): what backing it again needs, and what its
/// filesystem has. [`FileDevice::open`] backs it only where `disk-reserve`
/// stays free; the node's `config check` warns by the same rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sparse {
    /// Bytes of the first `len` with no blocks behind them.
    pub missing: u64,
    /// Bytes an unprivileged writer may still allocate on its filesystem.
    pub free: u64,
}

impl Sparse {
    /// `None` when `len` bytes of `file` are backed by blocks.
    pub fn check(file: &File, len: u64) -> io::Result<Option<Self>> {
        let missing = len.saturating_sub(file.metadata()?.blocks().saturating_mul(512));
        if missing == 0 {
            return Ok(None);
        }
        Ok(Some(Self {
            missing,
            free: free_bytes(file)?,
        }))
    }

    /// Whether backing the missing bytes leaves `reserve` free.
    pub fn leaves(&self, reserve: u64) -> bool {
        self.free >= self.missing.saturating_add(reserve)
    }
}

/// Bytes an unprivileged writer may still allocate on `file`'s filesystem.
fn free_bytes(file: &File) -> io::Result<u64> {
    use std::os::fd::AsRawFd;
    // SAFETY: statvfs is plain data; all zeroes is a valid value.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: a valid fd and a valid out-parameter; fstatvfs(2) only writes it.
    if unsafe { libc::fstatvfs(file.as_raw_fd(), &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st.f_bavail.saturating_mul(st.f_frsize.max(1)))
}

/// Takes an exclusive `flock` on `file` without waiting (released with
/// it): whether no other open file description holds one.
fn try_flock(file: &File) -> bool {
    use std::os::fd::AsRawFd;
    // SAFETY: flock on a descriptor owned by `file`.
    unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) == 0 }
}

/// Whether `path` still names `file` (same device and inode).
fn same_file(file: &File, path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (file.metadata(), path.symlink_metadata()) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

fn preallocate(file: &File, len: u64) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let len_i = i64::try_from(len).map_err(|_| io::Error::from_raw_os_error(libc::EFBIG))?;
    // SAFETY: plain syscall on a valid fd.
    let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len_i) };
    if rc == 0 {
        return Ok(());
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EOPNOTSUPP) {
        tracing::warn!(error = %e, "fallocate unsupported; the store file is sparse");
        return file.set_len(len);
    }
    Err(e)
}

impl Device for FileDevice {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.file.read_exact_at(buf, offset)
    }
    fn read_at_in_order(
        &self,
        buf: &mut [u8],
        offset: u64,
        arrived: &mut dyn FnMut(&[u8]),
    ) -> io::Result<()> {
        if self.direct {
            if let Some(res) = self.split.read(&self.file, buf, offset, arrived) {
                return res;
            }
        }
        read_then_hand_over(self, buf, offset, arrived)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.file.write_all_at(buf, offset)
    }
    fn sync(&self) -> io::Result<()> {
        self.file.sync_data()
    }
    fn len(&self) -> u64 {
        self.len
    }
    fn direct_io(&self) -> bool {
        self.direct
    }
    fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_buf_is_aligned_and_zeroed() {
        let b = AlignedBuf::zeroed(5000);
        assert_eq!(b.as_ptr() as usize % BLOCK as usize, 0);
        assert_eq!(b.len(), 5000);
        assert_eq!(b.capacity(), 8192);
        assert!(b.iter().all(|&x| x == 0));
    }

    #[test]
    #[should_panic(expected = "overflows usize")]
    fn a_capacity_past_usize_panics_instead_of_wrapping_to_zero() {
        // Wrapped (release builds), this was a zero-size allocation
        // handed out as a slice of `usize::MAX` bytes.
        block_layout(usize::MAX);
    }

    /// Reads `len` bytes at `off` through `read_at_in_order`: the pieces
    /// handed over, and the result.
    fn read_in_order(dev: &FileDevice, off: u64, len: usize) -> (Vec<Vec<u8>>, io::Result<()>) {
        let mut buf = AlignedBuf::zeroed(len);
        let mut parts = vec![];
        let res = dev.read_at_in_order(&mut buf, off, &mut |p: &[u8]| parts.push(p.to_vec()));
        if res.is_ok() {
            assert_eq!(parts.concat(), &buf[..], "pieces are the buffer, in order");
        }
        (parts, res)
    }

    /// A 16 MiB device with a known pattern on it.
    fn patterned(dir: &Path) -> (FileDevice, AlignedBuf) {
        let len = 16 << 20;
        let dev = FileDevice::open(&dir.join("d"), len, DirectMode::Auto, 0).unwrap();
        let mut w = AlignedBuf::zeroed(len as usize);
        w.iter_mut()
            .enumerate()
            .for_each(|(i, b)| *b = (i * 13 + i / 4091) as u8);
        dev.write_at(&w, 0).unwrap();
        dev.sync().unwrap();
        (dev, w)
    }

    #[test]
    fn large_reads_arrive_in_order_split_or_not() {
        // Where /tmp refuses O_DIRECT (tmpfs) this checks the plain path only.
        let dir = tempfile::tempdir().unwrap();
        let (dev, w) = patterned(dir.path());
        for (off, n) in [(0, 4 << 20), (12288, (1 << 20) + 8192), (4096, 256 << 10)] {
            let (parts, res) = read_in_order(&dev, off, n);
            res.unwrap();
            assert_eq!(parts.concat(), &w[off as usize..off as usize + n]);
            if dev.direct_io() && dev.split.available() && n >= crate::aio::SPLIT_FROM {
                assert!(parts.len() > 1, "a {n}-byte read is split: {}", parts.len());
                assert!(parts.len() <= crate::aio::MAX_PIECES);
            } else {
                assert_eq!(parts.len(), 1);
            }
        }
        dev.split.disable();
        let (parts, res) = read_in_order(&dev, 4096, 4 << 20);
        res.unwrap();
        assert_eq!(parts.len(), 1, "the plain path hands over once");
        assert_eq!(parts[0], &w[4096..4096 + (4 << 20)]);
    }

    #[test]
    fn a_panic_while_pieces_are_in_flight_waits_for_them_and_leaves_the_reader_usable() {
        let dir = tempfile::tempdir().unwrap();
        let (dev, w) = patterned(dir.path());
        let mut buf = AlignedBuf::zeroed(8 << 20);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            dev.read_at_in_order(&mut buf, 0, &mut |_: &[u8]| panic!("checker failed"))
        }));
        assert!(r.is_err(), "the panic reaches the caller");
        // Nothing writes into `buf` any more: it is freed and reused here.
        drop(buf);
        let (parts, res) = read_in_order(&dev, 4096, 8 << 20);
        res.unwrap();
        assert_eq!(parts.concat(), &w[4096..4096 + (8 << 20)]);
        assert!(
            dev.split.contexts() <= 1,
            "the context went back to the pool"
        );
    }

    #[test]
    fn many_concurrent_split_reads_are_exact_and_bounded_in_contexts() {
        let dir = tempfile::tempdir().unwrap();
        let (dev, w) = patterned(dir.path());
        std::thread::scope(|s| {
            for t in 0..24usize {
                let (dev, w) = (&dev, &w);
                s.spawn(move || {
                    for k in 0..4usize {
                        let off = ((t * 5 + k * 3) % 14) << 20;
                        let (parts, res) = read_in_order(dev, off as u64, 1 << 20);
                        res.unwrap();
                        assert!(
                            parts.concat() == w[off..off + (1 << 20)],
                            "thread {t} read {k}"
                        );
                    }
                });
            }
        });
        assert!(dev.split.contexts() <= crate::aio::MAX_CTXS);
    }

    #[test]
    fn a_read_past_the_end_is_an_error_split_or_not() {
        let dir = tempfile::tempdir().unwrap();
        let dev = FileDevice::open(&dir.path().join("d"), 2 << 20, DirectMode::Auto, 0).unwrap();
        for _ in 0..2 {
            // 1 MiB from 1.5 MiB: the second half is past the end.
            let (parts, res) = read_in_order(&dev, 3 << 19, 1 << 20);
            assert!(res.is_err(), "short read reported");
            assert!(parts.concat().len() < 1 << 20, "no full read handed over");
            // The device still reads afterwards (the AIO context was reused).
            let (_, res) = read_in_order(&dev, 0, 1 << 20);
            res.unwrap();
            dev.split.disable();
        }
    }

    #[test]
    fn file_device_round_trips_in_every_mode() {
        let dir = tempfile::tempdir().unwrap();
        for (i, mode) in [
            DirectMode::Auto,
            DirectMode::Off,
            DirectMode::SimulateUnsupported,
        ]
        .into_iter()
        .enumerate()
        {
            let p = dir.path().join(format!("d{i}"));
            let dev = FileDevice::open(&p, 1 << 20, mode, 0).unwrap();
            assert_eq!(std::fs::metadata(&p).unwrap().len(), 1 << 20);
            if mode != DirectMode::Auto {
                assert!(!dev.direct_io());
            }
            let mut w = AlignedBuf::zeroed(8192);
            w.iter_mut().enumerate().for_each(|(i, b)| *b = i as u8);
            dev.write_at(&w, 4096).unwrap();
            dev.sync().unwrap();
            let mut r = AlignedBuf::zeroed(8192);
            dev.read_at(&mut r, 4096).unwrap();
            assert_eq!(&r[..], &w[..]);
        }
    }
}
