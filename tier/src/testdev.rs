//! Test devices (feature `test_utils`): a [`CountingDevice`] that proves how
//! much I/O an operation did, a [`CrashDevice`] that keeps live and durable
//! bytes apart so a test can crash at any sync (after redb's crash-test
//! backend), a [`FaultyDevice`] that fails writes or syncs on demand and a
//! [`HoldingDevice`] that holds reads or writes until released.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};

use parking_lot::Mutex;

use crate::device::Device;

/// Wraps a device and counts its operations.
pub struct CountingDevice {
    inner: Arc<dyn Device>,
    reads: AtomicU64,
    writes: AtomicU64,
    write_bytes: AtomicU64,
    syncs: AtomicU64,
}

/// A snapshot of a [`CountingDevice`]'s counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IoCounts {
    /// Read calls.
    pub reads: u64,
    /// Write calls.
    pub writes: u64,
    /// Bytes written.
    pub write_bytes: u64,
    /// Sync calls.
    pub syncs: u64,
}

impl CountingDevice {
    /// Counts the I/O issued to `inner`.
    pub fn new(inner: Arc<dyn Device>) -> Self {
        Self {
            inner,
            reads: AtomicU64::new(0),
            writes: AtomicU64::new(0),
            write_bytes: AtomicU64::new(0),
            syncs: AtomicU64::new(0),
        }
    }

    /// The counters so far.
    pub fn counts(&self) -> IoCounts {
        IoCounts {
            reads: self.reads.load(Ordering::SeqCst),
            writes: self.writes.load(Ordering::SeqCst),
            write_bytes: self.write_bytes.load(Ordering::SeqCst),
            syncs: self.syncs.load(Ordering::SeqCst),
        }
    }
}

impl Device for CountingDevice {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.reads.fetch_add(1, Ordering::SeqCst);
        self.inner.read_at(buf, offset)
    }
    fn read_at_in_order(
        &self,
        buf: &mut [u8],
        offset: u64,
        arrived: &mut dyn FnMut(&[u8]),
    ) -> io::Result<()> {
        self.reads.fetch_add(1, Ordering::SeqCst);
        self.inner.read_at_in_order(buf, offset, arrived)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.writes.fetch_add(1, Ordering::SeqCst);
        self.write_bytes
            .fetch_add(buf.len() as u64, Ordering::SeqCst);
        self.inner.write_at(buf, offset)
    }
    fn sync(&self) -> io::Result<()> {
        self.syncs.fetch_add(1, Ordering::SeqCst);
        self.inner.sync()
    }
    fn len(&self) -> u64 {
        self.inner.len()
    }
    fn direct_io(&self) -> bool {
        self.inner.direct_io()
    }
    fn path(&self) -> &Path {
        self.inner.path()
    }
}

struct CrashState {
    live: Vec<u8>,
    durable: Vec<u8>,
    /// Writes since the last successful sync, in issue order.
    pending: Vec<(u64, Vec<u8>)>,
    syncs: u64,
    crash_at_sync: Option<u64>,
    crashed: bool,
}

/// An in-memory device whose unsynced writes are lost or torn by a crash.
///
/// `sync` number N (1-based) set by [`CrashDevice::crash_at_sync`] fails and
/// marks the device crashed: every later call fails. [`CrashDevice::image`]
/// then yields what a disk could hold after power loss: the durable bytes
/// plus, for each unsynced write, nothing, all of it, or a torn prefix of
/// 512-byte sectors, chosen by a seed.
pub struct CrashDevice {
    state: Mutex<CrashState>,
    len: u64,
    path: PathBuf,
}

fn crash_err() -> io::Error {
    io::Error::other("simulated crash: the device is gone")
}

/// splitmix64: a tiny deterministic generator (no `rand` in the library).
fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl CrashDevice {
    /// A zeroed device of `len` bytes.
    pub fn new(len: u64) -> Self {
        Self::from_image(vec![0; len as usize])
    }

    /// A device whose live and durable bytes are `image`.
    pub fn from_image(image: Vec<u8>) -> Self {
        Self {
            len: image.len() as u64,
            state: Mutex::new(CrashState {
                live: image.clone(),
                durable: image,
                pending: Vec::new(),
                syncs: 0,
                crash_at_sync: None,
                crashed: false,
            }),
            path: PathBuf::from("<crash device>"),
        }
    }

    /// Crash at the `n`-th sync from now on (1-based, counted from creation).
    pub fn crash_at_sync(&self, n: u64) {
        self.state.lock().crash_at_sync = Some(n);
    }

    /// Crashes now: every later call fails.
    pub fn crash_now(&self) {
        self.state.lock().crashed = true;
    }

    /// Syncs so far (including a crashing one).
    pub fn syncs(&self) -> u64 {
        self.state.lock().syncs
    }

    /// Whether the device has crashed.
    pub fn crashed(&self) -> bool {
        self.state.lock().crashed
    }

    /// The bytes a disk could hold after a crash now: durable bytes plus a
    /// seeded choice, per unsynced write, of dropped / applied / torn.
    pub fn image(&self, seed: u64) -> Vec<u8> {
        let st = self.state.lock();
        let mut img = st.durable.clone();
        let mut rng = seed ^ 0x5eed;
        for (off, data) in &st.pending {
            let off = *off as usize;
            match splitmix(&mut rng) % 3 {
                0 => {}
                1 => img[off..off + data.len()].copy_from_slice(data),
                _ => {
                    // Torn: a random subset of 512-byte sectors lands.
                    for (i, sector) in data.chunks(512).enumerate() {
                        if splitmix(&mut rng) % 2 == 0 {
                            let at = off + i * 512;
                            img[at..at + sector.len()].copy_from_slice(sector);
                        }
                    }
                }
            }
        }
        img
    }

    /// The durable bytes only (every unsynced write lost).
    pub fn durable_image(&self) -> Vec<u8> {
        self.state.lock().durable.clone()
    }
}

impl Device for CrashDevice {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let st = self.state.lock();
        if st.crashed {
            return Err(crash_err());
        }
        let off = offset as usize;
        let end = off
            .checked_add(buf.len())
            .filter(|&e| e <= st.live.len())
            .ok_or_else(|| io::Error::from(io::ErrorKind::UnexpectedEof))?;
        buf.copy_from_slice(&st.live[off..end]);
        Ok(())
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        let mut st = self.state.lock();
        if st.crashed {
            return Err(crash_err());
        }
        let off = offset as usize;
        let end = off
            .checked_add(buf.len())
            .filter(|&e| e <= st.live.len())
            .ok_or_else(|| io::Error::from_raw_os_error(libc::ENOSPC))?;
        st.live[off..end].copy_from_slice(buf);
        st.pending.push((offset, buf.to_vec()));
        Ok(())
    }
    fn sync(&self) -> io::Result<()> {
        let mut st = self.state.lock();
        if st.crashed {
            return Err(crash_err());
        }
        st.syncs += 1;
        if st.crash_at_sync == Some(st.syncs) {
            st.crashed = true;
            return Err(crash_err());
        }
        let pending = std::mem::take(&mut st.pending);
        for (off, data) in pending {
            let off = off as usize;
            st.durable[off..off + data.len()].copy_from_slice(&data);
        }
        Ok(())
    }
    fn len(&self) -> u64 {
        self.len
    }
    fn direct_io(&self) -> bool {
        false
    }
    fn path(&self) -> &Path {
        &self.path
    }
}

/// Wraps a device and fails writes or syncs on demand.
pub struct FaultyDevice {
    inner: Arc<dyn Device>,
    /// Writes still allowed before failing; negative: unlimited.
    writes_left: AtomicI64,
    errno: AtomicI64,
    fail_sync: AtomicBool,
}

impl FaultyDevice {
    /// Wraps `inner`; no faults until configured.
    pub fn new(inner: Arc<dyn Device>) -> Self {
        Self {
            inner,
            writes_left: AtomicI64::new(-1),
            errno: AtomicI64::new(libc::EIO as i64),
            fail_sync: AtomicBool::new(false),
        }
    }

    /// After `n` more successful writes, every write fails with `errno`
    /// (e.g. `libc::ENOSPC` or `libc::EIO`).
    pub fn fail_writes_after(&self, n: i64, errno: i32) {
        self.errno.store(errno as i64, Ordering::SeqCst);
        self.writes_left.store(n, Ordering::SeqCst);
    }

    /// Writes succeed again.
    pub fn heal(&self) {
        self.writes_left.store(-1, Ordering::SeqCst);
        self.fail_sync.store(false, Ordering::SeqCst);
    }

    /// Every sync fails with EIO.
    pub fn fail_syncs(&self) {
        self.fail_sync.store(true, Ordering::SeqCst);
    }
}

impl Device for FaultyDevice {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.inner.read_at(buf, offset)
    }
    fn read_at_in_order(
        &self,
        buf: &mut [u8],
        offset: u64,
        arrived: &mut dyn FnMut(&[u8]),
    ) -> io::Result<()> {
        self.inner.read_at_in_order(buf, offset, arrived)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        let left = self.writes_left.load(Ordering::SeqCst);
        if left == 0 {
            return Err(io::Error::from_raw_os_error(
                self.errno.load(Ordering::SeqCst) as i32,
            ));
        }
        if left > 0 {
            self.writes_left.fetch_sub(1, Ordering::SeqCst);
        }
        self.inner.write_at(buf, offset)
    }
    fn sync(&self) -> io::Result<()> {
        if self.fail_sync.load(Ordering::SeqCst) {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        self.inner.sync()
    }
    fn len(&self) -> u64 {
        self.inner.len()
    }
    fn direct_io(&self) -> bool {
        self.inner.direct_io()
    }
    fn path(&self) -> &Path {
        self.inner.path()
    }
}

/// Wraps a device; reads and writes can be held (they wait inside the
/// device call) until released, so a test can act while a store's disk
/// read or write is in flight.
pub struct HoldingDevice {
    inner: Arc<dyn Device>,
    state: Mutex<HoldState>,
    changed: parking_lot::Condvar,
}

#[derive(Default)]
struct HoldState {
    /// Reads still to hold (the next ones issued).
    reads: usize,
    /// Hold every write.
    writes: bool,
    /// Bumped by each release; a held call waits for a change.
    releases: u64,
    /// Calls waiting now.
    waiting: usize,
}

impl HoldingDevice {
    /// Wraps `inner`; nothing held.
    pub fn new(inner: Arc<dyn Device>) -> Self {
        Self {
            inner,
            state: Mutex::new(HoldState::default()),
            changed: parking_lot::Condvar::new(),
        }
    }

    /// The next read issued waits until [`HoldingDevice::release`]; later
    /// ones pass (so the store's own reads, e.g. the writer's, go on).
    pub fn hold_next_read(&self) {
        self.state.lock().reads += 1;
    }

    /// Writes issued from now on wait until [`HoldingDevice::release`].
    pub fn hold_writes(&self) {
        self.state.lock().writes = true;
    }

    /// Lets every held call go on and holds nothing more.
    pub fn release(&self) {
        let mut s = self.state.lock();
        s.reads = 0;
        s.writes = false;
        s.releases += 1;
        self.changed.notify_all();
    }

    /// Waits (at most `limit`) until `n` calls are held; whether they are.
    pub fn wait_held(&self, n: usize, limit: std::time::Duration) -> bool {
        let deadline = std::time::Instant::now() + limit;
        let mut s = self.state.lock();
        while s.waiting < n {
            if self.changed.wait_until(&mut s, deadline).timed_out() {
                return s.waiting >= n;
            }
        }
        true
    }

    fn pass(&self, write: bool) {
        let mut s = self.state.lock();
        if write {
            if !s.writes {
                return;
            }
        } else if s.reads == 0 {
            return;
        } else {
            s.reads -= 1;
        }
        let at = s.releases;
        s.waiting += 1;
        self.changed.notify_all();
        while s.releases == at {
            self.changed.wait(&mut s);
        }
        s.waiting -= 1;
    }
}

impl Device for HoldingDevice {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.pass(false);
        self.inner.read_at(buf, offset)
    }
    fn read_at_in_order(
        &self,
        buf: &mut [u8],
        offset: u64,
        arrived: &mut dyn FnMut(&[u8]),
    ) -> io::Result<()> {
        self.pass(false);
        self.inner.read_at_in_order(buf, offset, arrived)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.pass(true);
        self.inner.write_at(buf, offset)
    }
    fn sync(&self) -> io::Result<()> {
        self.inner.sync()
    }
    fn len(&self) -> u64 {
        self.inner.len()
    }
    fn direct_io(&self) -> bool {
        self.inner.direct_io()
    }
    fn path(&self) -> &Path {
        self.inner.path()
    }
}
