//! Recycled chunk buffers.
//!
//! Every chunk the store holds lives in a buffer of its own: a `PUT` copies
//! the caller's bytes into a new one, a disk read lands in a new one. A
//! fresh buffer of a few MiB or more costs a page fault and the kernel's
//! zeroing for every 4 KiB page: glibc serves allocations of 32 MiB and
//! more (its largest mmap threshold) from a mapping of their own and unmaps
//! it on free, so that every such chunk lands on new pages, whatever the
//! allocator settings. A 32 MiB chunk (256 tokens of an 8B model's KV cache
//! in bf16) is exactly that size: such `PUT`s copied at a quarter of memcpy
//! speed, 8,192 faults each.
//!
//! A [`BufferPool`] keeps the buffers of dropped chunks (the last `Bytes`
//! handle of a pooled chunk returns its buffer) and hands them to the next
//! chunk of about the same size. In a store whose RAM is full, each new
//! chunk evicts about as many bytes as it brings, so the pool stays small
//! and new chunks cost a copy, not a fault per page. The pool is bounded in
//! bytes and buffers; what does not fit is freed. Only buffers of at least
//! [`POOL_MIN`] bytes go through it: smaller ones are cheap for the
//! allocator to reuse on its own.

use std::alloc::alloc;
use std::collections::VecDeque;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use parking_lot::Mutex;

use crate::device::{AlignedBuf, BLOCK, block_layout};

/// Smallest copy that [`BufferPool::copy_of`] takes a pooled buffer for.
pub const POOL_MIN: usize = 1 << 20;

/// Recycled, block-aligned chunk buffers, bounded in bytes and count.
pub struct BufferPool {
    // parking_lot Mutex: a scan of at most `max_bufs` entries, no I/O held
    // (buffers are freed after it is released). Oldest first.
    bufs: Mutex<VecDeque<AlignedBuf>>,
    max_bytes: usize,
    max_bufs: usize,
    /// Ask for transparent huge pages on new buffers (see
    /// `advise_huge_pages`).
    huge_pages: bool,
    reused: AtomicU64,
    fresh: AtomicU64,
}

/// What a [`BufferPool`] holds and has done.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Buffers held for reuse now.
    pub buffers: u64,
    /// Their capacity in bytes.
    pub bytes: u64,
    /// Buffers handed out from the pool.
    pub reused: u64,
    /// Buffers that had to be allocated (nothing pooled of that size).
    pub fresh: u64,
}

impl BufferPool {
    /// A pool that holds at most `max_bytes` of buffers (and at most 64).
    pub fn new(max_bytes: usize) -> Self {
        Self {
            bufs: Mutex::new(VecDeque::new()),
            max_bytes,
            max_bufs: 64,
            huge_pages: false,
            reused: AtomicU64::new(0),
            fresh: AtomicU64::new(0),
        }
    }

    /// The pool a store with a RAM budget of `ram_budget` bytes gets: an
    /// eighth of the budget, at least 128 MiB (a few large chunks in
    /// flight) and at most 1 GiB; new buffers of 2 MiB and more ask for
    /// transparent huge pages if `huge_pages` (`TierConfig::huge_pages`).
    pub fn for_store(ram_budget: u64, huge_pages: bool) -> Self {
        let bytes = (ram_budget / 8).clamp(128 << 20, 1 << 30);
        Self {
            huge_pages,
            ..Self::new(usize::try_from(bytes).unwrap_or(usize::MAX))
        }
    }

    /// Counts of what the pool holds and has handed out.
    pub fn stats(&self) -> PoolStats {
        let bufs = self.bufs.lock();
        PoolStats {
            buffers: bufs.len() as u64,
            bytes: bufs.iter().map(|b| b.capacity() as u64).sum(),
            reused: self.reused.load(Ordering::Relaxed),
            fresh: self.fresh.load(Ordering::Relaxed),
        }
    }

    /// A pooled buffer whose capacity holds `len` bytes with at most about
    /// 12 % to spare (the chunk keeps its buffer while RAM charges only its
    /// length), the smallest such, set to length `len`. Its bytes are
    /// whatever its last chunk left there.
    fn reuse(&self, len: usize) -> Option<AlignedBuf> {
        let fits = len..=len + len / 8 + BLOCK as usize;
        let mut buf = {
            let mut bufs = self.bufs.lock();
            let best = bufs
                .iter()
                .enumerate()
                .filter(|(_, b)| fits.contains(&b.capacity()))
                .min_by_key(|(_, b)| b.capacity())
                .map(|(i, _)| i)?;
            bufs.remove(best)?
        };
        self.reused.fetch_add(1, Ordering::Relaxed);
        buf.set_len(len);
        Some(buf)
    }

    /// A buffer of `len` bytes to read into: a pooled one (see `reuse`),
    /// else a new zeroed one, advised to use huge pages (when enabled)
    /// before its pages are first written. The caller overwrites all `len`
    /// bytes.
    pub(crate) fn take(&self, len: usize) -> AlignedBuf {
        self.reuse(len).unwrap_or_else(|| {
            self.fresh.fetch_add(1, Ordering::Relaxed);
            let huge = self.huge_pages;
            AlignedBuf::zeroed_advised(len, |ptr, cap| {
                if huge {
                    advise_huge_pages(ptr, cap);
                }
            })
        })
    }

    /// Keeps `buf` for reuse (a buffer of [`POOL_MIN`] bytes or more),
    /// dropping the oldest ones beyond the bounds; frees what it does not
    /// keep after the lock is released.
    fn give(&self, buf: AlignedBuf) {
        if buf.capacity() < POOL_MIN {
            return;
        }
        let mut freed = Vec::new();
        {
            let mut bufs = self.bufs.lock();
            bufs.push_back(buf);
            let mut held: usize = bufs.iter().map(AlignedBuf::capacity).sum();
            while bufs.len() > self.max_bufs || held > self.max_bytes {
                let Some(old) = bufs.pop_front() else { break };
                held -= old.capacity();
                freed.push(old);
            }
        }
        drop(freed);
    }

    /// `Bytes` over `buf`; the buffer returns to this pool when the last
    /// handle (or slice) of it is dropped.
    pub(crate) fn share(self: &Arc<Self>, buf: AlignedBuf) -> Bytes {
        Bytes::from_owner(Pooled {
            buf: Some(buf),
            pool: Arc::clone(self),
        })
    }

    /// A copy of `src` in a buffer of its own, pooled from [`POOL_MIN`]
    /// bytes on.
    pub fn copy_of(self: &Arc<Self>, src: &[u8]) -> Bytes {
        // SAFETY: a slice is valid for reads of its length and cannot
        // overlap a buffer this pool owns exclusively.
        unsafe { self.copy_from_raw(src.as_ptr(), src.len()) }
    }

    /// Like [`BufferPool::copy_of`], from a raw pointer: for memory that
    /// another process may write meanwhile (a client's shared region),
    /// which must not be borrowed as a slice.
    ///
    /// # Safety
    /// `src` must be valid for reads of `len` bytes for the duration of
    /// the call. Concurrent writes to it only make the copied bytes
    /// unspecified.
    pub unsafe fn copy_from_raw(self: &Arc<Self>, src: *const u8, len: usize) -> Bytes {
        if len < POOL_MIN {
            let mut v = Vec::with_capacity(len);
            // SAFETY: the caller guarantees `src` for `len` bytes; `v` has
            // capacity `len` and is ours alone.
            unsafe {
                std::ptr::copy_nonoverlapping(src, v.as_mut_ptr(), len);
                v.set_len(len);
            }
            return Bytes::from(v);
        }
        let buf = match self.reuse(len) {
            Some(mut buf) => {
                // SAFETY: `buf` holds `len` bytes and is ours alone; the
                // caller guarantees `src`.
                unsafe { std::ptr::copy_nonoverlapping(src, buf.as_mut_ptr(), len) };
                buf
            }
            None => {
                self.fresh.fetch_add(1, Ordering::Relaxed);
                let layout = block_layout(len);
                let cap = layout.size();
                // SAFETY: the layout has a non-zero size.
                let raw = unsafe { alloc(layout) };
                let ptr =
                    NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
                if self.huge_pages {
                    advise_huge_pages(ptr.as_ptr(), cap);
                }
                // SAFETY: `ptr` is valid for `cap` bytes: the first `len`
                // are copied from `src` (the caller guarantees it; a fresh
                // allocation cannot overlap it), the rest zeroed, so all
                // `cap` are initialised, as `from_raw_parts` requires.
                unsafe {
                    std::ptr::copy_nonoverlapping(src, ptr.as_ptr(), len);
                    std::ptr::write_bytes(ptr.as_ptr().add(len), 0, cap - len);
                    AlignedBuf::from_raw_parts(ptr, len, cap)
                }
            }
        };
        self.share(buf)
    }

    /// A buffer of `len` bytes to fill piece by piece (a value read from a
    /// socket), pooled like the copies of [`BufferPool::copy_of`]: meant
    /// for lengths of [`POOL_MIN`] and more (a smaller one is a fresh
    /// zeroed buffer, which reading into a `Vec`'s spare capacity avoids).
    pub fn filler(self: &Arc<Self>, len: usize) -> Filler {
        Filler {
            buf: Some(self.take(len)),
            filled: 0,
            pool: Arc::clone(self),
        }
    }
}

/// A chunk buffer being filled (from a socket, piece by piece); see
/// [`BufferPool::filler`]. Its bytes past the filled part are initialised
/// but unspecified (an earlier chunk's or zeros).
/// Dropped unfrozen (an aborted read), its buffer returns to the pool.
pub struct Filler {
    /// `Some` until frozen.
    buf: Option<AlignedBuf>,
    filled: usize,
    pool: Arc<BufferPool>,
}

impl Filler {
    fn buf(&self) -> &AlignedBuf {
        self.buf
            .as_ref()
            .expect("a Filler holds its buffer until frozen")
    }

    /// The part not filled yet, to read into; then [`Filler::advance`].
    pub fn unfilled(&mut self) -> &mut [u8] {
        let filled = self.filled;
        &mut self
            .buf
            .as_mut()
            .expect("a Filler holds its buffer until frozen")[filled..]
    }

    /// Marks `n` more bytes filled. Panics beyond the length.
    pub fn advance(&mut self, n: usize) {
        assert!(
            n <= self.buf().len() - self.filled,
            "Filler::advance past its length"
        );
        self.filled += n;
    }

    /// Copies `src` after the filled part. Panics if it does not fit.
    pub fn extend_from_slice(&mut self, src: &[u8]) {
        self.unfilled()[..src.len()].copy_from_slice(src);
        self.filled += src.len();
    }

    /// Bytes filled so far.
    pub fn filled(&self) -> usize {
        self.filled
    }

    /// Whether all of its length is filled.
    pub fn is_full(&self) -> bool {
        self.filled == self.buf().len()
    }

    /// The filled bytes, as a chunk whose buffer returns to the pool when
    /// dropped.
    pub fn freeze(mut self) -> Bytes {
        let buf = self
            .buf
            .take()
            .expect("a Filler holds its buffer until frozen");
        self.pool.share(buf).slice(..self.filled)
    }
}

impl Drop for Filler {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            self.pool.give(b);
        }
    }
}

/// Transparent huge page size on x86-64 and aarch64 (4 KiB base pages).
const HUGE_PAGE: usize = 2 << 20;

/// Marks the 2 MiB pages that lie wholly inside the new allocation of
/// `cap` bytes at `ptr` `MADV_HUGEPAGE`, so that its first write faults huge
/// pages in where the kernel has them (call it before anything touches the
/// pages; the kernel falls back to small pages otherwise). Best effort: a
/// failure is ignored, and other systems than Linux do nothing.
fn advise_huge_pages(ptr: *mut u8, cap: usize) {
    #[cfg(target_os = "linux")]
    if cap >= HUGE_PAGE {
        let start = (ptr as usize).next_multiple_of(HUGE_PAGE);
        let end = (ptr as usize + cap) / HUGE_PAGE * HUGE_PAGE;
        if end > start {
            // SAFETY: advice only, on whole pages inside the caller's
            // allocation; it changes no contents.
            unsafe {
                libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (ptr, cap);
}

/// A buffer that returns to its pool when the last `Bytes` handle or slice
/// of it is dropped.
struct Pooled {
    buf: Option<AlignedBuf>,
    pool: Arc<BufferPool>,
}

impl AsRef<[u8]> for Pooled {
    fn as_ref(&self) -> &[u8] {
        self.buf.as_deref().unwrap_or(&[])
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            self.pool.give(b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_come_back_and_are_reused_only_when_their_size_fits() {
        let pool = Arc::new(BufferPool::new(128 << 20));
        let a = pool.take(1 << 20);
        let addr = a.as_ptr();
        // The last slice of a read's Bytes returns its buffer.
        let bytes = pool.share(a);
        let part = bytes.slice(10..20);
        drop(bytes);
        assert_eq!(pool.stats().buffers, 0, "a slice still holds it");
        drop(part);
        assert_eq!(pool.stats().buffers, 1);
        // Much smaller reads do not take it (RAM would charge too little).
        let small = pool.take(64 << 10);
        assert_ne!(small.as_ptr(), addr);
        assert_eq!(pool.stats().buffers, 1);
        // A read of the same size does, with the requested length.
        let again = pool.take((1 << 20) - 512);
        assert_eq!(again.as_ptr(), addr);
        assert_eq!(again.len(), (1 << 20) - 512);
        assert_eq!(pool.stats().buffers, 0);
        assert_eq!((pool.stats().reused, pool.stats().fresh), (1, 2));
        // Bounded: beyond the byte limit buffers are freed, not kept.
        for _ in 0..(128 >> 2) + 4 {
            pool.give(AlignedBuf::zeroed(4 << 20));
        }
        assert!(pool.stats().bytes <= 128 << 20, "{:?}", pool.stats());
        // Full, it drops its oldest buffers for the newest (a size nobody
        // asks for any more cannot hold it for good).
        let newest = AlignedBuf::zeroed(8 << 20);
        let addr = newest.as_ptr();
        pool.give(newest);
        assert!(pool.stats().bytes <= 128 << 20, "{:?}", pool.stats());
        assert_eq!(pool.take(8 << 20).as_ptr(), addr, "the newest is kept");
        let many = Arc::new(BufferPool::new(1 << 30));
        for _ in 0..100 {
            many.give(AlignedBuf::zeroed(POOL_MIN));
        }
        assert_eq!(many.stats().buffers, 64);
        // Below POOL_MIN nothing is kept.
        many.give(AlignedBuf::zeroed(POOL_MIN - BLOCK as usize));
        assert_eq!(many.stats().buffers, 64);
        assert!(many.bufs.lock().iter().all(|b| b.capacity() == POOL_MIN));
    }

    #[test]
    fn copies_land_in_the_buffer_of_a_dropped_chunk_with_its_exact_bytes() {
        let pool = Arc::new(BufferPool::new(128 << 20));
        let len = (3 << 20) + 5; // not a multiple of the block
        let a: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        let first = pool.copy_of(&a);
        assert_eq!(&first[..], &a[..]);
        let addr = first.as_ptr();
        drop(first);
        let b: Vec<u8> = (0..len).map(|i| (i % 241) as u8).collect();
        let second = pool.copy_of(&b);
        assert_eq!(second.as_ptr(), addr, "the dropped chunk's buffer");
        assert_eq!(&second[..], &b[..]);
        assert_eq!((pool.stats().reused, pool.stats().fresh), (1, 1));
        // Small copies bypass the pool: nothing is taken or kept.
        let small = pool.copy_of(&a[..POOL_MIN - 1]);
        assert_eq!(&small[..], &a[..POOL_MIN - 1]);
        drop(small);
        assert_eq!(pool.stats().buffers, 0);
        assert_eq!((pool.stats().reused, pool.stats().fresh), (1, 1));
        assert!(pool.copy_of(&[]).is_empty());
    }

    #[test]
    fn a_filled_buffer_freezes_to_its_filled_bytes_and_returns_when_dropped() {
        let pool = Arc::new(BufferPool::new(128 << 20));
        let mut f = pool.filler(2 << 20);
        f.extend_from_slice(b"head");
        let rest = f.unfilled();
        assert_eq!(rest.len(), (2 << 20) - 4);
        rest[..3].copy_from_slice(b"abc");
        f.advance(3);
        assert_eq!(f.filled(), 7);
        assert!(!f.is_full());
        let b = f.freeze();
        assert_eq!(&b[..], b"headabc");
        let addr = b.as_ptr();
        drop(b);
        let mut g = pool.filler(2 << 20);
        let n = g.unfilled().len();
        g.advance(n);
        assert!(g.is_full());
        let g = g.freeze();
        assert_eq!(g.as_ptr(), addr, "the dropped buffer, reused");
        // A fill abandoned before it was frozen (a client gone mid-value)
        // returns its buffer too.
        drop(g);
        let mut h = pool.filler(2 << 20);
        h.extend_from_slice(b"partial");
        drop(h);
        assert_eq!(pool.stats().buffers, 1);
        assert_eq!(pool.filler(2 << 20).freeze().as_ptr(), addr);
    }

    #[test]
    fn the_pool_size_follows_the_ram_budget_within_bounds() {
        assert_eq!(BufferPool::for_store(32 << 20, true).max_bytes, 128 << 20);
        assert_eq!(BufferPool::for_store(4 << 30, false).max_bytes, 512 << 20);
        assert_eq!(BufferPool::for_store(64 << 30, true).max_bytes, 1 << 30);
    }

    /// `VmFlags` of the mapping that holds `addr`, from /proc/self/smaps.
    #[cfg(target_os = "linux")]
    fn vm_flags(addr: usize) -> String {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut inside = false;
        for line in smaps.lines() {
            let range = line.split_whitespace().next().unwrap_or("");
            if let Some((lo, hi)) = range.split_once('-')
                && let (Ok(lo), Ok(hi)) =
                    (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
            {
                inside = (lo..hi).contains(&addr);
            } else if inside && let Some(flags) = line.strip_prefix("VmFlags:") {
                return flags.trim().to_string();
            }
        }
        panic!("no mapping holds {addr:#x}");
    }

    /// New buffers of 2 MiB and more carry the huge-page advice (`hg`)
    /// when asked, and only then; their bytes are what was copied.
    #[cfg(target_os = "linux")]
    #[test]
    fn new_large_buffers_ask_for_huge_pages_only_when_configured() {
        // 40 MiB: above glibc's largest mmap threshold, so each buffer is a
        // mapping of its own (a heap range advised by another test could
        // otherwise be reused here).
        const LEN: usize = 40 << 20;
        let src: Vec<u8> = (0..LEN).map(|i| (i % 253) as u8).collect();
        for huge in [false, true] {
            let pool = Arc::new(BufferPool::for_store(1 << 30, huge));
            let b = pool.copy_of(&src);
            assert_eq!(&b[..], &src[..]);
            let inner = (b.as_ptr() as usize).next_multiple_of(HUGE_PAGE);
            let flags = vm_flags(inner);
            assert_eq!(
                flags.split(' ').any(|f| f == "hg"),
                huge,
                "huge {huge}: {flags}"
            );
            let mut f = pool.filler(LEN);
            let n = f.unfilled().len();
            f.advance(n);
            let r = f.freeze();
            assert!(r.iter().all(|&x| x == 0), "a fresh read buffer is zeroed");
            let inner = (r.as_ptr() as usize).next_multiple_of(HUGE_PAGE);
            assert_eq!(vm_flags(inner).split(' ').any(|f| f == "hg"), huge);
        }
    }
}
