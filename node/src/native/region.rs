//! Shared-memory regions: the daemon's mapping of a client's memfd
//! ([`MappedRegion`]), the client's own memfd ([`OwnedRegion`]), and passing
//! descriptors over a Unix socket with `SCM_RIGHTS`.
//!
//! Safety contract (see `node/PROTOCOL.md`, "Shared memory"):
//! - The region must be a memfd sealed with `F_SEAL_SHRINK`, at least as
//!   long as the registered length. The daemon checks both before mapping, so
//!   the client can never truncate the file under the mapping (which would
//!   turn a daemon access into SIGBUS).
//! - Every (offset, length) named in a request is range-checked against the
//!   mapping before any byte is touched.
//! - The daemon reads a PUT range and writes a GET range only while it
//!   handles that request. The client must not modify a PUT range nor read
//!   a GET range until the reply has arrived; if it does, only its own bytes
//!   are garbled (the daemon copies raw memory and never interprets it).

use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;

use bytes::Bytes;
use memmap2::{MmapOptions, MmapRaw};
use rustix::fs::SealFlags;
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};
use tier::ChunkKey;
use tier::buffers::BufferPool;

/// Most descriptors accepted in one `recvmsg`; more truncate the control
/// message, which the daemon treats as a protocol violation.
pub const MAX_FDS_PER_READ: usize = 4;

/// `statfs` type of tmpfs, where a plain memfd lives (linux/magic.h).
const TMPFS_MAGIC: u64 = 0x0102_1994;

/// Why a region cannot be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RegionError {
    /// The region length is 0 or above the daemon's limit.
    #[error("region length {len} is not in 1..={max} (max-region)")]
    BadLength {
        /// Requested length.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// The descriptor is not a sealable memfd or lacks `F_SEAL_SHRINK`.
    #[error(
        "the region descriptor must be a memfd sealed with F_SEAL_SHRINK \
         (memfd_create(MFD_ALLOW_SEALING), ftruncate, fcntl(F_ADD_SEALS, F_SEAL_SHRINK)): {0}"
    )]
    NotSealed(String),
    /// The file is shorter than the registered length.
    #[error("region file is {size} bytes, shorter than the registered length {len}")]
    TooShort {
        /// File size.
        size: u64,
        /// Registered length.
        len: u64,
    },
    /// An operating-system error.
    #[error("cannot {op} the region: {source}")]
    Io {
        /// What failed.
        op: &'static str,
        /// The OS error.
        #[source]
        source: io::Error,
    },
}

/// The daemon's mapping of a client region.
///
/// Range-checked access only: [`MappedRegion::check`] before
/// [`MappedRegion::copy_out`] / [`MappedRegion::copy_in`].
pub struct MappedRegion {
    map: MmapRaw,
    len: u64,
}

impl std::fmt::Debug for MappedRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MappedRegion")
            .field("len", &self.len)
            .finish()
    }
}

impl MappedRegion {
    /// Maps `len` bytes of `fd` after checking that it is a memfd sealed
    /// against shrinking and long enough.
    pub fn map(fd: &OwnedFd, len: u64, max: u64) -> Result<Self, RegionError> {
        if len == 0 || len > max {
            return Err(RegionError::BadLength { len, max });
        }
        let seals = rustix::fs::fcntl_get_seals(fd)
            .map_err(|e| RegionError::NotSealed(format!("F_GET_SEALS failed: {e}")))?;
        if !seals.contains(SealFlags::SHRINK) {
            return Err(RegionError::NotSealed(format!("seals are {seals:?}")));
        }
        // Only a plain (shmem) memfd: a hole punched into a huge-page one
        // gives up its reservation, and a later daemon access to it is
        // SIGBUS once the pool runs dry (the shrink seal does not stop hole
        // punching); nor can such a mapping be unmapped at a length that is
        // not a whole number of huge pages.
        let fs = rustix::fs::fstatfs(fd).map_err(|e| RegionError::Io {
            op: "fstatfs",
            source: e.into(),
        })?;
        #[allow(clippy::unnecessary_cast)] // `f_type`'s type differs between targets
        let fs_type = fs.f_type as u64 & 0xffff_ffff;
        if fs_type != TMPFS_MAGIC {
            return Err(RegionError::NotSealed(format!(
                "the file is not on tmpfs (filesystem type {fs_type:#x}); \
                 huge-page memfds (MFD_HUGETLB) are not accepted"
            )));
        }
        let st = rustix::fs::fstat(fd).map_err(|e| RegionError::Io {
            op: "fstat",
            source: e.into(),
        })?;
        let size = u64::try_from(st.st_size).unwrap_or(0);
        if size < len {
            return Err(RegionError::TooShort { size, len });
        }
        let map_len = usize::try_from(len).map_err(|_| RegionError::BadLength { len, max })?;
        let map = MmapOptions::new()
            .len(map_len)
            .map_raw(std::os::fd::AsRawFd::as_raw_fd(fd))
            .map_err(|source| RegionError::Io { op: "mmap", source })?;
        Ok(Self { map, len })
    }

    /// Length of the mapping.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the mapping is empty (never: length 0 is refused).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether `[offset, offset + len)` lies inside the mapping.
    pub fn check(&self, offset: u64, len: u64) -> bool {
        offset.checked_add(len).is_some_and(|end| end <= self.len)
    }

    /// Copies `len` bytes at `offset` out of the region into a new buffer.
    /// Returns `None` when the range is outside the mapping.
    pub fn copy_out(&self, offset: u64, len: u64) -> Option<Vec<u8>> {
        if !self.check(offset, len) {
            return None;
        }
        let n = len as usize; // in range: len <= self.len, which fits usize
        let mut v = Vec::with_capacity(n);
        // SAFETY: [offset, offset+len) is inside the live mapping (checked
        // above; the file is sealed against shrinking, so the pages stay
        // valid); `v` has capacity `n` and does not overlap the mapping. The
        // client may write the range concurrently, which only garbles its
        // own bytes (documented contract); we never form a reference to the
        // shared memory.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.map.as_ptr().add(offset as usize),
                v.as_mut_ptr(),
                n,
            );
            v.set_len(n);
        }
        Some(v)
    }

    /// Copies `count` keys (32 bytes each) at `offset` out of the region,
    /// straight into the key vector (one copy, no byte buffer between).
    /// Returns `None` when the range is outside the mapping.
    pub fn copy_keys_out(&self, offset: u64, count: u32) -> Option<Vec<ChunkKey>> {
        let len = u64::from(count) * 32;
        if !self.check(offset, len) {
            return None;
        }
        let n = count as usize;
        let mut v: Vec<ChunkKey> = Vec::with_capacity(n);
        // SAFETY: as in `copy_out`: the source range is inside the live
        // mapping and never borrowed. `ChunkKey` is `repr(transparent)` over
        // `[u8; 32]` (alignment 1, every byte pattern valid), so `32 * n`
        // bytes written through a byte pointer into the capacity of `v`
        // make `n` initialised keys.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.map.as_ptr().add(offset as usize),
                v.as_mut_ptr().cast::<u8>(),
                n * 32,
            );
            v.set_len(n);
        }
        Some(v)
    }

    /// Copies `len` bytes at `offset` out of the region into a chunk
    /// buffer from `pool` (the memory of a dropped chunk where one of the
    /// size is pooled). Returns `None` when the range is outside the
    /// mapping.
    pub fn copy_out_pooled(&self, pool: &Arc<BufferPool>, offset: u64, len: u64) -> Option<Bytes> {
        if !self.check(offset, len) {
            return None;
        }
        // SAFETY: [offset, offset+len) is inside the live mapping (checked
        // above; the file is sealed against shrinking). Concurrent writes by
        // the client only garble its own bytes (see `copy_out`); the pool
        // copies through the raw pointer and never borrows shared memory.
        Some(unsafe { pool.copy_from_raw(self.map.as_ptr().add(offset as usize), len as usize) })
    }

    /// Copies `data` into the region at `offset`. Returns false (and writes
    /// nothing) when the range is outside the mapping.
    pub fn copy_in(&self, offset: u64, data: &[u8]) -> bool {
        if !self.check(offset, data.len() as u64) {
            return false;
        }
        // SAFETY: the destination range is inside the live, writable, sealed
        // mapping (checked above) and cannot overlap `data`, which is
        // daemon-owned memory.
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                self.map.as_mut_ptr().add(offset as usize),
                data.len(),
            );
        }
        true
    }
}

/// A client-side region: a sealed memfd mapped into this process.
pub struct OwnedRegion {
    fd: OwnedFd,
    map: MmapRaw,
    len: u64,
}

impl std::fmt::Debug for OwnedRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OwnedRegion")
            .field("len", &self.len)
            .finish()
    }
}

impl OwnedRegion {
    /// Creates a memfd of `len` bytes, seals it against shrinking and maps it.
    pub fn create(name: &str, len: u64) -> Result<Self, RegionError> {
        let io = |op| {
            move |e: rustix::io::Errno| RegionError::Io {
                op,
                source: e.into(),
            }
        };
        if len == 0 {
            return Err(RegionError::BadLength { len, max: u64::MAX });
        }
        let fd = rustix::fs::memfd_create(
            name,
            rustix::fs::MemfdFlags::CLOEXEC | rustix::fs::MemfdFlags::ALLOW_SEALING,
        )
        .map_err(io("memfd_create"))?;
        rustix::fs::ftruncate(&fd, len).map_err(io("ftruncate"))?;
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK).map_err(io("seal"))?;
        let map_len =
            usize::try_from(len).map_err(|_| RegionError::BadLength { len, max: u64::MAX })?;
        let map = MmapOptions::new()
            .len(map_len)
            .map_raw(std::os::fd::AsRawFd::as_raw_fd(&fd))
            .map_err(|source| RegionError::Io { op: "mmap", source })?;
        Ok(Self { fd, map, len })
    }

    /// The memfd (to pass to the daemon).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the region is empty (never).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Start address of the mapping (e.g. for `cudaHostRegister`).
    pub fn as_ptr(&self) -> *mut u8 {
        self.map.as_mut_ptr()
    }

    /// The region's bytes.
    ///
    /// The daemon writes them during a GET on the connection that registered
    /// this region, which needs `&mut` on the client. After a call that
    /// failed part-way (a timeout) the daemon may still be copying: the
    /// client then refuses further calls ([`super::NativeError::Broken`]),
    /// and bytes read here are not a reply's. A descriptor of this region
    /// registered on another connection ([`OwnedRegion::fd`]) is that
    /// caller's to order.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the mapping is live for the lifetime of `self` and `len`
        // bytes long, and any bytes are a valid `u8`. Another process (the
        // daemon) writing the shared pages concurrently can only change
        // their values, as with any shared mapping; within this crate the
        // daemon writes only while a GET holds `&mut Client`, or after a
        // call that failed, when the client takes no more calls.
        unsafe { std::slice::from_raw_parts(self.map.as_ptr(), self.len as usize) }
    }

    /// The region's bytes, writable (fill PUT ranges here).
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as for `as_slice`; `&mut self` makes this borrow unique in
        // this process.
        unsafe { std::slice::from_raw_parts_mut(self.map.as_mut_ptr(), self.len as usize) }
    }
}

/// Sends all of `data` on a blocking socket, attaching `fd` (if any) to the
/// first `sendmsg`, which carries the first byte of `data`.
pub fn send_with_fd(
    sock: BorrowedFd<'_>,
    data: &[u8],
    fd: Option<BorrowedFd<'_>>,
) -> io::Result<()> {
    let mut sent = 0;
    if let Some(fd) = fd {
        let fds = [fd];
        let mut space = [0u8; rustix::cmsg_space!(ScmRights(1))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        if !control.push(SendAncillaryMessage::ScmRights(&fds)) {
            return Err(io::Error::other(
                "control buffer too small for one descriptor",
            ));
        }
        loop {
            match rustix::net::sendmsg(
                sock,
                &[IoSlice::new(data)],
                &mut control,
                SendFlags::NOSIGNAL,
            ) {
                Ok(n) => {
                    sent = n;
                    break;
                }
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(e.into()),
            }
        }
    }
    while sent < data.len() {
        match rustix::net::send(sock, &data[sent..], SendFlags::NOSIGNAL) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => sent += n,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Outcome of [`recv_with_fds`].
#[derive(Debug)]
pub struct Received {
    /// Bytes read (0: end of stream).
    pub bytes: usize,
    /// Whether the kernel truncated the control data (descriptors lost).
    pub truncated: bool,
}

/// One non-blocking `recvmsg` into `buf`, pushing any received descriptors
/// (close-on-exec) onto `fds`. Returns `WouldBlock` when nothing is ready.
pub fn recv_with_fds(
    sock: BorrowedFd<'_>,
    buf: &mut [u8],
    fds: &mut Vec<OwnedFd>,
) -> io::Result<Received> {
    let mut space = [0u8; rustix::cmsg_space!(ScmRights(MAX_FDS_PER_READ))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let ret = loop {
        match rustix::net::recvmsg(
            sock,
            &mut [IoSliceMut::new(buf)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC | RecvFlags::DONTWAIT,
        ) {
            Ok(r) => break r,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    };
    for msg in control.drain() {
        if let RecvAncillaryMessage::ScmRights(rights) = msg {
            fds.extend(rights);
        }
    }
    let truncated = ret.flags.bits() & (libc::MSG_CTRUNC as u32) != 0;
    Ok(Received {
        bytes: ret.bytes,
        truncated,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owned_region_maps_in_the_daemon_and_ranges_are_checked() {
        let mut r = OwnedRegion::create("t", 8192).unwrap();
        r.as_mut_slice()[100..104].copy_from_slice(b"abcd");
        let fd = r.fd().try_clone_to_owned().unwrap();
        let m = MappedRegion::map(&fd, 8192, 1 << 20).unwrap();
        assert_eq!(m.copy_out(100, 4).unwrap(), b"abcd");
        // Keys come out as they lie in the region; the range is checked.
        for (i, b) in r.as_mut_slice()[4096..4096 + 96].iter_mut().enumerate() {
            *b = i as u8;
        }
        let keys = m.copy_keys_out(4096, 3).unwrap();
        let want: Vec<ChunkKey> = (0..3u8)
            .map(|k| ChunkKey(std::array::from_fn(|j| k * 32 + j as u8)))
            .collect();
        assert_eq!(keys, want);
        assert_eq!(m.copy_keys_out(8192 - 64, 2).unwrap().len(), 2);
        assert!(m.copy_keys_out(8192 - 64, 3).is_none());
        assert!(m.copy_keys_out(u64::MAX - 10, 1).is_none());
        assert!(m.copy_keys_out(0, 0).unwrap().is_empty());
        assert!(m.copy_out(8190, 3).is_none());
        assert!(m.copy_out(u64::MAX, 2).is_none());
        assert!(m.copy_in(8000, b"xyz"));
        assert!(!m.copy_in(8191, b"xy"));
        assert_eq!(&r.as_slice()[8000..8003], b"xyz");
        // Longer than the file, over the limit, zero.
        assert!(matches!(
            MappedRegion::map(&fd, 8193, 1 << 20),
            Err(RegionError::TooShort { .. })
        ));
        assert!(matches!(
            MappedRegion::map(&fd, 8192, 4096),
            Err(RegionError::BadLength { .. })
        ));
        assert!(matches!(
            MappedRegion::map(&fd, 0, 4096),
            Err(RegionError::BadLength { .. })
        ));
    }

    #[test]
    fn huge_page_memfds_are_refused() {
        use rustix::fs::MemfdFlags;
        let Ok(fd) = rustix::fs::memfd_create("h", MemfdFlags::ALLOW_SEALING | MemfdFlags::HUGETLB)
        else {
            eprintln!("SKIPPED: this kernel has no hugetlbfs memfds");
            return;
        };
        // One huge page of the usual size (2 MiB); elsewhere skipped.
        if rustix::fs::ftruncate(&fd, 2 << 20).is_err() {
            eprintln!("SKIPPED: huge pages here are not 2 MiB");
            return;
        }
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK).unwrap();
        match MappedRegion::map(&fd, 2 << 20, 1 << 30) {
            Err(RegionError::NotSealed(m)) => assert!(m.contains("huge-page"), "{m}"),
            other => panic!("a huge-page memfd was not refused as such: {other:?}"),
        }
    }

    #[test]
    fn unsealed_memfds_and_plain_files_are_refused() {
        let fd = rustix::fs::memfd_create("u", rustix::fs::MemfdFlags::ALLOW_SEALING).unwrap();
        rustix::fs::ftruncate(&fd, 4096).unwrap();
        assert!(matches!(
            MappedRegion::map(&fd, 4096, 1 << 20),
            Err(RegionError::NotSealed(_))
        ));
        let f = tempfile::tempfile().unwrap();
        f.set_len(4096).unwrap();
        let fd: OwnedFd = f.into();
        assert!(matches!(
            MappedRegion::map(&fd, 4096, 1 << 20),
            Err(RegionError::NotSealed(_))
        ));
    }
}
