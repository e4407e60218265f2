//! The native server: one task per connection, requests handled in order
//! (pipelining is allowed: replies come back in request order).
//!
//! Reads go through [`NodeContext`] (so the peer cascade serves this socket
//! too); writes go to the store. Chunk bytes are copied between the client's
//! region and the store exactly once. A runtime worker never copies
//! [`OFFLOAD_BYTES`] or more without yielding: a PUT whose entries add up to
//! less, the RAM hits of a GET that add up to less, and each disk or peer
//! hit of less are copied inline on the connection's task (the region is a
//! memfd, never backed by a disk, so touching it does not block on I/O, and
//! a hand-off to the blocking pool would cost more than such a copy); larger
//! ones, atomic PUTs, every PUT under the `backpressure` write policy (it
//! may wait for the disk writer) and LOOKUPs of [`OFFLOAD_KEYS`] probes or
//! more run on the blocking pool, at most
//! [`copy_slots`] at a time across all connections (which also bounds the
//! chunk buffers allocated outside the RAM budget while they are copied).
//! A runtime worker that copies a 32 MiB chunk is busy for milliseconds,
//! and while it is, tokio may poll no socket at all (the idle workers wait
//! for work, not for the I/O driver, which the busy worker last held):
//! every other client, a LOOKUP from the scheduler included, waited for
//! the copy (LOOKUP p50 0.04 ms -> 2-5 ms beside two connections' 32 MiB
//! PUTs, with 2 or 8 workers alike; docs/benchmarks.md, "Session 10").
//!
//! With [`NativeOptions::spin`] set, a connection polls its socket for the
//! client's next request for that long after answering (yielding to other
//! tasks between polls) before it parks: an engine saving or loading a run
//! of chunks sends its next request within microseconds of the reply, and
//! the poll can save a worker wake-up, which on a virtual machine whose
//! idle CPUs halt costs tens of microseconds. It polls only while the
//! system has a CPU to spare ([`super::spin`]); 50 µs by default (see
//! [`super::DEFAULT_SPIN`]).

use std::collections::VecDeque;
use std::future::Future;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use rustix::net::RecvFlags;
use tokio::io::{AsyncWriteExt, Interest};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio::task::JoinSet;
use tracing::{debug, warn};

use super::codec::{
    self, CodecError, Decoded, ErrorCode, FlushReply, GetResult, GetStatus, HelloReply, Limits,
    LookupLocation, RankPrefixReply, RegionEntry, Request, Response,
};
use super::region::{self, MappedRegion, RegionError};
use super::spin;
use super::{NativeError, NativeOptions};
use crate::context::{Location, NodeContext, NodeCounters};
use tier::ChunkId;

/// Initial (and idle) size of a connection's read buffer.
const READ_BUF: usize = 64 << 10;
/// Replies are written once this many bytes are pending, even mid-batch.
const WRITE_FLUSH: usize = 1 << 20;
/// Most disk or peer reads one GET keeps in flight.
const MAX_CONCURRENT_READS: usize = 16;

/// Disk reads of GETs in flight at once over all connections (each holds
/// a blocking thread).
const MAX_READS_IN_FLIGHT: usize = 256;
/// Most received descriptors waiting for their REGISTER_REGION frame.
const MAX_PENDING_FDS: usize = 4;
/// Most bytes one request copies between the region and chunks inline on
/// the connection's task; a request that copies more does its copies on
/// the blocking pool (see the module docs). 2 MiB take 0.1-0.4 ms to copy,
/// a hand-off 10-20 us.
pub const OFFLOAD_BYTES: u64 = 2 << 20;
/// Most bytes of a GET's RAM hits copied by one job on the blocking pool
/// (a chunk larger than this is a job of its own).
const GET_JOB_BYTES: u64 = 64 << 20;
/// Most keys (times ranks, for CLUSTER_LOOKUP) one LOOKUP probes inline;
/// larger ones run on the blocking pool like large copies (8,192 probes of a
/// 1M-entry store take about 150 us; a batch may hold 65,536 keys).
pub const OFFLOAD_KEYS: usize = 8192;
/// Most unprocessed request bytes a connection reads ahead while a reply
/// write blocks (a client that pipelines requests and reads no reply until
/// its sends complete would otherwise wait on the daemon while the daemon
/// waits on it).
const READ_AHEAD: usize = 16 << 20;

/// Serves native-protocol connections on `listener` until `shutdown`
/// completes, then stops accepting, lets every connection finish the request
/// it is handling, and returns once all connection tasks have ended.
pub async fn serve(
    listener: UnixListener,
    ctx: Arc<NodeContext>,
    opts: NativeOptions,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), NativeError> {
    let (stop_tx, stop_rx) = watch::channel(false);
    let permits = Arc::new(Semaphore::new(opts.max_connections as usize));
    let slots = Arc::new(Semaphore::new(copy_slots()));
    let copying = Arc::new(Semaphore::new(copy_kib_bound(
        ctx.store.config().ram_budget,
    )));
    let bounds = Arc::new(Bounds::new(ctx.store.config().ram_budget));
    let buffered = Arc::new(AtomicUsize::new(0));
    let opts = Arc::new(opts);
    let mut tasks = JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    NodeCounters::inc(&ctx.counters.connections);
                    match Arc::clone(&permits).try_acquire_owned() {
                        Ok(permit) => {
                            let conn = Connection::new(
                                stream,
                                Arc::clone(&ctx),
                                Arc::clone(&opts),
                                Arc::clone(&slots),
                                Arc::clone(&copying),
                                Arc::clone(&bounds),
                                Arc::clone(&buffered),
                            );
                            let stop = stop_rx.clone();
                            tasks.spawn(async move {
                                conn.run(stop).await;
                                drop(permit);
                            });
                        }
                        Err(_) => {
                            let max = opts.max_connections;
                            tasks.spawn(refuse_busy(stream, max));
                        }
                    }
                }
                Err(e) => {
                    // EMFILE / ENFILE and friends: back off instead of spinning.
                    warn!(error = %e, "native socket: accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
        }
    }
    drop(listener);
    // Receivers may all be gone already; that is fine.
    let _ = stop_tx.send(true);
    while tasks.join_next().await.is_some() {}
    Ok(())
}

async fn refuse_busy(mut stream: UnixStream, max: u32) {
    let mut out = Vec::new();
    codec::encode_error(
        &mut out,
        0,
        0,
        ErrorCode::Busy,
        &format!("the daemon already serves {max} connections (max-connections)"),
    );
    let _ = tokio::time::timeout(Duration::from_secs(1), stream.write_all(&out)).await;
}

type HandlerResult = Result<Response, (ErrorCode, String)>;

fn store_error(e: &tier::Error) -> (ErrorCode, String) {
    let code = match e {
        tier::Error::UnknownNamespace(_) => ErrorCode::UnknownNamespace,
        tier::Error::TooLarge { .. } => ErrorCode::TooLarge,
        tier::Error::NoSpace { .. } => ErrorCode::NoSpace,
        // A full filesystem under a file the store writes beside its chunks
        // (a HELLO's manifest rewrite).
        tier::Error::Io { source, .. } if source.raw_os_error() == Some(libc::ENOSPC) => {
            ErrorCode::NoSpace
        }
        tier::Error::Unimplemented(_) => ErrorCode::Unimplemented,
        tier::Error::Closed => ErrorCode::ShuttingDown,
        tier::Error::InvalidArgument { .. } | tier::Error::RecordTooLarge { .. } => {
            ErrorCode::BadRequest
        }
        _ => ErrorCode::Store,
    };
    (code, e.to_string())
}

fn joined<T>(r: Result<T, tokio::task::JoinError>) -> Result<T, (ErrorCode, String)> {
    r.map_err(|e| {
        if e.is_cancelled() {
            (
                ErrorCode::ShuttingDown,
                "the daemon is shutting down".into(),
            )
        } else {
            (ErrorCode::Internal, format!("blocking task failed: {e}"))
        }
    })
}

/// Large copies and lookups the server runs on the blocking pool at once,
/// across all connections: twice the cores (copies are bound by memory
/// bandwidth), at least 4.
pub fn copy_slots() -> usize {
    std::thread::available_parallelism().map_or(4, |n| (2 * n.get()).max(4))
}

/// Bounds over all connections on work the blocking pool runs for them:
/// GETs' disk reads in flight, their bytes (KiB, as [`copy_kib_bound`])
/// and their number; and DELETEs (one of 65,536 keys holds a thread for
/// about 0.2 s, and a delete may wait for room in the writer's queue:
/// review).
struct Bounds {
    read_kib: Arc<Semaphore>,
    /// `read_kib`'s size: the most one read takes.
    read_kib_cap: usize,
    reads: Arc<Semaphore>,
    deletes: Arc<Semaphore>,
}

const BOUND_CLOSED: &str = "the server's bounds are never closed";

impl Bounds {
    fn new(ram_budget: u64) -> Self {
        let cap = copy_kib_bound(ram_budget);
        Self {
            read_kib: Arc::new(Semaphore::new(cap)),
            read_kib_cap: cap,
            reads: Arc::new(Semaphore::new(MAX_READS_IN_FLIGHT)),
            deletes: Arc::new(Semaphore::new(copy_slots())),
        }
    }

    /// Waits for room for a disk read of `bytes` (one larger than the whole
    /// bound waits until it is alone); the room is held until the permits
    /// are dropped.
    async fn read(&self, bytes: u64) -> (OwnedSemaphorePermit, OwnedSemaphorePermit) {
        let count = Arc::clone(&self.reads)
            .acquire_owned()
            .await
            .expect(BOUND_CLOSED);
        let kib = Arc::clone(&self.read_kib)
            .acquire_many_owned(copy_permits(bytes, self.read_kib_cap))
            .await
            .expect(BOUND_CLOSED);
        (count, kib)
    }

    /// Waits for one of the DELETE slots.
    async fn delete(&self) -> OwnedSemaphorePermit {
        Arc::clone(&self.deletes)
            .acquire_owned()
            .await
            .expect(BOUND_CLOSED)
    }
}

/// KiB of region copies that PUTs may hold at once: the RAM budget (at
/// least 64 MiB).
fn copy_kib_bound(ram_budget: u64) -> usize {
    usize::try_from((ram_budget >> 10).max(64 << 10))
        .unwrap_or(usize::MAX)
        .min(Semaphore::MAX_PERMITS)
}

/// The permits (KiB, rounded up) for copies holding `bytes`, at most the
/// whole bound `cap` (a PUT larger than the bound waits until it is alone).
fn copy_permits(bytes: u64, cap: usize) -> u32 {
    let kib = bytes.div_ceil(1024).max(1);
    u32::try_from(kib.min(cap as u64)).unwrap_or(u32::MAX)
}

/// Runs `work` (a large copy or lookup) on the blocking pool, holding one
/// of the server's copy `slots`, when `offload`; else inline on the calling
/// task.
async fn run_heavy<T: Send + 'static>(
    slots: &Arc<Semaphore>,
    offload: bool,
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, (ErrorCode, String)> {
    if !offload {
        return Ok(work());
    }
    let slot = Arc::clone(slots)
        .acquire_owned()
        .await
        .expect("the copy slots are never closed");
    joined(
        tokio::task::spawn_blocking(move || {
            let _slot = slot;
            work()
        })
        .await,
    )
}

struct Connection {
    stream: UnixStream,
    ctx: Arc<NodeContext>,
    opts: Arc<NativeOptions>,
    /// The server's copy slots ([`run_heavy`]).
    slots: Arc<Semaphore>,
    /// KiB that PUTs may hold copied out of regions at once, over all
    /// connections ([`copy_kib_bound`]).
    copying: Arc<Semaphore>,
    /// Blocking-pool work over all connections.
    bounds: Arc<Bounds>,
    /// Shared with the copies running on the blocking pool.
    region: Option<Arc<MappedRegion>>,
    /// Descriptors received and not yet claimed by a REGISTER_REGION,
    /// oldest first, each with the stream bytes of the read that brought it
    /// (absolute offsets): it belongs to a frame that starts among them
    /// ([`Connection::claim_fd`]).
    fds: VecDeque<(std::ops::Range<u64>, OwnedFd)>,
    /// Stream offset of `rbuf[start]`: bytes of the connection handled so far.
    consumed: u64,
    /// Stream offset of the frame being handled.
    frame_at: u64,
    /// `rbuf[start..end]` holds received, unprocessed bytes.
    rbuf: Vec<u8>,
    /// Bytes of all connections' read buffers past [`READ_BUF`] each
    /// (bounded by `max-buffered`), and this one's share of them.
    buffered: Arc<AtomicUsize>,
    held: usize,
    /// The budget refused a read-ahead: none until a request is handled.
    ahead_refused: bool,
    /// When the incomplete frame in the buffer must be complete: set at
    /// its first read, cleared when a frame is handled (so a client that
    /// trickles a byte at a time is dropped all the same).
    frame_deadline: Option<tokio::time::Instant>,
    start: usize,
    end: usize,
    wbuf: Vec<u8>,
    /// The client closed its side (no more requests will come).
    read_closed: bool,
    /// Descriptors were lost or too many are pending: the connection is
    /// closed with an error once the requests before them are answered.
    fd_overflow: bool,
    /// A GET was abandoned: its client hung up while it waited for reads
    /// (no reply is sent, and it is not counted as an error).
    abandoned: std::sync::atomic::AtomicBool,
}

impl Drop for Connection {
    fn drop(&mut self) {
        self.buffered.fetch_sub(self.held, Ordering::Relaxed);
    }
}

enum Step {
    // Boxed: a request (with a namespace record) is much larger than the other variants.
    Frame(codec::Header, Box<Result<Request, CodecError>>, usize),
    Need(usize),
    Fatal(CodecError, u64, u16),
}

impl Connection {
    fn new(
        stream: UnixStream,
        ctx: Arc<NodeContext>,
        opts: Arc<NativeOptions>,
        slots: Arc<Semaphore>,
        copying: Arc<Semaphore>,
        bounds: Arc<Bounds>,
        buffered: Arc<AtomicUsize>,
    ) -> Self {
        Self {
            stream,
            ctx,
            opts,
            slots,
            copying,
            bounds,
            region: None,
            fds: VecDeque::new(),
            consumed: 0,
            frame_at: 0,
            rbuf: vec![0; READ_BUF],
            buffered,
            held: 0,
            ahead_refused: false,
            frame_deadline: None,
            start: 0,
            end: 0,
            wbuf: Vec::with_capacity(4096),
            read_closed: false,
            fd_overflow: false,
            abandoned: std::sync::atomic::AtomicBool::new(false),
        }
    }

    fn limits(&self) -> Limits {
        Limits {
            max_batch: self.opts.max_batch,
        }
    }

    fn next_step(&self) -> Step {
        let buf = &self.rbuf[self.start..self.end];
        match codec::decode_frame(buf, self.opts.max_frame) {
            Ok(Decoded::Frame { header, body, len }) => Step::Frame(
                header,
                Box::new(codec::decode_request(&header, body, &self.limits())),
                len,
            ),
            Ok(Decoded::Incomplete { need }) => Step::Need(need),
            Err(e) => {
                let (id, op) = match codec::decode_header(buf, u32::MAX) {
                    Ok(Some(h)) => (h.id, h.op),
                    _ => (0, 0),
                };
                Step::Fatal(e, id, op)
            }
        }
    }

    async fn run(mut self, mut stop: watch::Receiver<bool>) {
        if let Err(e) = self.serve(&mut stop).await {
            debug!(error = %e, "native connection ended");
        }
    }

    async fn serve(&mut self, stop: &mut watch::Receiver<bool>) -> io::Result<()> {
        loop {
            // Handle every complete frame already buffered.
            let need = loop {
                match self.next_step() {
                    Step::Frame(header, req, len) => {
                        self.frame_at = self.consumed;
                        self.start += len;
                        self.consumed += len as u64;
                        self.frame_deadline = None;
                        self.ahead_refused = false;
                        NodeCounters::inc(&self.ctx.counters.native_requests);
                        match *req {
                            Ok(req) => self.handle(header.id, req).await,
                            Err(e) => self.error(header.id, header.op, e.code(), &e.to_string()),
                        }
                        // A descriptor that came with this frame (or before
                        // it) and was not claimed by it is closed: it must
                        // never be taken for a later frame's (review: a
                        // REGISTER_REGION refused for its body left its memfd
                        // queued, and the next one mapped that memfd instead
                        // of its own and answered success).
                        self.close_fds_before(self.consumed);
                        if self.wbuf.len() >= WRITE_FLUSH {
                            self.flush_writes().await?;
                        }
                    }
                    Step::Need(need) => break need,
                    Step::Fatal(e, id, op) => {
                        debug!(error = %e, "native client sent a malformed frame; closing");
                        self.error(id, op, e.code(), &format!("{e}; closing the connection"));
                        self.flush_writes().await?;
                        return Ok(());
                    }
                }
            };
            let buffered = self.end - self.start;
            self.flush_writes().await?;
            if self.end - self.start > buffered {
                // Requests were read ahead while the replies waited; at
                // shutdown they are not started.
                if *stop.borrow() {
                    return Ok(());
                }
                continue;
            }
            if self.fd_overflow || self.read_closed {
                break;
            }
            if !self.make_room(need) {
                let (held, max) = (
                    self.buffered.load(Ordering::Relaxed) >> 20,
                    self.opts.max_buffered >> 20,
                );
                debug!(need, "native read buffers full; closing a connection");
                self.error(
                    0,
                    0,
                    ErrorCode::Busy,
                    &format!(
                        "the daemon holds {held} MiB of large or incomplete requests over all \
                         connections (at most {max} MiB); closing this connection, try again"
                    ),
                );
                self.flush_writes().await?;
                return Ok(());
            }
            let partial = self.end > self.start;
            let received = if partial {
                // The rest of a frame that arrived in pieces (a large
                // request is queued as several socket buffers) is polled for
                // too, or the worker would park between two pieces. The
                // deadline holds for polled pieces as well: a client that
                // trickles bytes faster than the poll gives up is dropped
                // all the same.
                let frame_timeout = self.opts.frame_timeout;
                let deadline = *self
                    .frame_deadline
                    .get_or_insert_with(|| tokio::time::Instant::now() + frame_timeout);
                if tokio::time::Instant::now() >= deadline {
                    debug!("native client stalled mid-frame; dropping it");
                    return Ok(());
                }
                // At a stop, a request not yet whole is not started (as one
                // read ahead is not), so waiting for its rest holds no
                // stop up (a client stalled mid-frame held it for half the
                // shutdown deadline).
                if *stop.borrow() {
                    return Ok(());
                }
                match self.poll_next_request().await? {
                    Some(r) => r,
                    None => tokio::select! {
                        r = tokio::time::timeout_at(deadline, self.read_some()) => match r {
                            Ok(r) => r?,
                            Err(_) => {
                                debug!("native client stalled mid-frame; dropping it");
                                return Ok(());
                            }
                        },
                        _ = stop.changed() => return Ok(()),
                    },
                }
            } else {
                if *stop.borrow() {
                    return Ok(());
                }
                match self.poll_next_request().await? {
                    Some(r) => r,
                    None => tokio::select! {
                        r = self.read_some() => r?,
                        _ = stop.changed() => return Ok(()),
                    },
                }
            };
            self.note(received);
        }
        if self.fd_overflow {
            self.error(
                0,
                0,
                ErrorCode::Malformed,
                &format!(
                    "too many file descriptors (at most one per REGISTER_REGION, {MAX_PENDING_FDS} pending); closing the connection"
                ),
            );
            self.flush_writes().await?;
        } else if self.end > self.start {
            debug!("native client disconnected mid-frame");
        }
        Ok(())
    }

    /// Takes in what a read brought: its bytes, and whether the client
    /// closed its side. A read that lost descriptors or brought too many is
    /// dropped whole (its requests are not handled; the connection is
    /// closed once the requests before it are answered).
    fn note(&mut self, received: region::Received) {
        if received.truncated || self.fds.len() > MAX_PENDING_FDS {
            self.fd_overflow = true;
            return;
        }
        if received.bytes == 0 {
            self.read_closed = true;
        }
        self.end += received.bytes;
    }

    /// Whether a blocked reply write may read more requests meanwhile: not
    /// while descriptors wait for their REGISTER_REGION frames (each
    /// arrives in a read of its own, and reading on would pile them up
    /// past the limit).
    fn may_read_ahead(&self) -> bool {
        !self.read_closed
            && !self.fd_overflow
            && !self.ahead_refused
            && self.fds.is_empty()
            && self.end - self.start < READ_AHEAD
    }

    /// One non-blocking read of more requests into the read buffer (made
    /// room for within [`READ_AHEAD`]), while a reply write blocks.
    fn read_ahead(&mut self) -> io::Result<()> {
        if self.end == self.rbuf.len() {
            if self.start > 0 {
                self.compact();
            } else {
                let len = (self.rbuf.len() * 2).clamp(READ_BUF, READ_AHEAD);
                if !self.resize_rbuf(len) {
                    // Waits for the replies to go out instead.
                    self.ahead_refused = true;
                    return Ok(());
                }
            }
        }
        match self.try_recv() {
            Ok(r) => {
                self.note(r);
                Ok(())
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Compacts the read buffer and makes room for more of a frame of
    /// `need` bytes: the buffer grows (doubling, up to `need`) only once
    /// the bytes already received fill it, so a frame is charged against
    /// `max-buffered` as it arrives, not as its header announces it
    /// (review: 33 connections that sent only headers announcing 16 MiB
    /// bodies refused every other client's request over 64 KiB). False
    /// when `max-buffered` does not leave the room.
    fn make_room(&mut self, need: usize) -> bool {
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
            if self.rbuf.len() > 4 * READ_BUF && need <= READ_BUF {
                self.resize_rbuf(READ_BUF);
            }
        } else {
            self.compact();
        }
        // `need` is bounded by max-frame + header: checked by the decoder.
        if self.rbuf.len() >= need || self.end < self.rbuf.len() {
            return true;
        }
        self.resize_rbuf(need.min(self.rbuf.len().saturating_mul(2).max(READ_BUF)))
    }

    /// Resizes the read buffer (its bytes up to `end` kept), counting what
    /// it holds past [`READ_BUF`] against the server's `max-buffered`;
    /// false, and nothing changed, when growing would go past it.
    fn resize_rbuf(&mut self, len: usize) -> bool {
        let len = len.max(self.end);
        let share = len.saturating_sub(READ_BUF);
        if share > self.held {
            let more = share - self.held;
            let before = self.buffered.fetch_add(more, Ordering::Relaxed);
            if before + more > self.opts.max_buffered {
                self.buffered.fetch_sub(more, Ordering::Relaxed);
                return false;
            }
            self.rbuf.resize(len, 0);
        } else {
            self.buffered
                .fetch_sub(self.held - share, Ordering::Relaxed);
            // A new, smaller buffer: `truncate` would keep the memory.
            let mut small = vec![0; len];
            small[..self.end].copy_from_slice(&self.rbuf[..self.end]);
            self.rbuf = small;
        }
        self.held = share;
        true
    }

    /// Moves the unprocessed bytes to the front of the read buffer.
    fn compact(&mut self) {
        if self.start > 0 {
            self.rbuf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
    }

    /// Polls the socket (non-blocking) for up to [`NativeOptions::spin`],
    /// yielding to other tasks between polls, while the system has a CPU
    /// to spare ([`spin::may_poll`]); `None` when nothing arrived.
    async fn poll_next_request(&mut self) -> io::Result<Option<region::Received>> {
        if self.opts.spin.is_zero() || !spin::may_poll() {
            return Ok(None);
        }
        let deadline = Instant::now() + self.opts.spin;
        let mut fds = Vec::new();
        loop {
            // A direct non-blocking recvmsg: tokio's readiness flag may be
            // stale either way, and the next `readable()` sorts it out.
            let sock = self.stream.as_fd();
            match region::recv_with_fds(sock, &mut self.rbuf[self.end..], &mut fds) {
                Ok(r) => {
                    self.keep_fds(std::mem::take(&mut fds), r.bytes);
                    return Ok(Some(r));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            // Lets this worker run other tasks (and poll the I/O driver)
            // without parking.
            tokio::task::yield_now().await;
        }
    }

    async fn read_some(&mut self) -> io::Result<region::Received> {
        loop {
            self.stream.readable().await?;
            match self.try_recv() {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                r => return r,
            }
        }
    }

    /// One non-blocking read into the read buffer after its unprocessed
    /// bytes, keeping any descriptors it brings; `WouldBlock` (clearing
    /// the readiness) when nothing is there.
    fn try_recv(&mut self) -> io::Result<region::Received> {
        let mut fds = Vec::new();
        let sock = self.stream.as_fd();
        let buf = &mut self.rbuf[self.end..];
        let r = self.stream.try_io(Interest::READABLE, || {
            region::recv_with_fds(sock, buf, &mut fds)
        })?;
        self.keep_fds(fds, r.bytes);
        Ok(r)
    }

    /// Queues the descriptors a read of `bytes` bytes after the buffered
    /// ones brought, tagged with the stream offsets of those bytes.
    fn keep_fds(&mut self, fds: Vec<OwnedFd>, bytes: usize) {
        let at = self.consumed + (self.end - self.start) as u64;
        self.fds
            .extend(fds.into_iter().map(|fd| (at..at + bytes as u64, fd)));
    }

    /// The descriptor sent with the frame being handled: the oldest one
    /// queued, if the read that brought it began at or before the frame's
    /// first byte and took that byte in (a descriptor is received with the
    /// first byte of the `sendmsg` that carried it, and a read ends with
    /// the message that carries descriptors). Older ones were not claimed
    /// by their frames and are closed.
    fn claim_fd(&mut self) -> Option<OwnedFd> {
        let at = self.frame_at;
        self.close_fds_before(at);
        if self.fds.front().is_some_and(|(r, _)| r.contains(&at)) {
            return self.fds.pop_front().map(|(_, fd)| fd);
        }
        None
    }

    /// Closes the queued descriptors whose reads ended at or before stream
    /// offset `at`.
    fn close_fds_before(&mut self, at: u64) {
        while self.fds.front().is_some_and(|(r, _)| r.end <= at) {
            self.fds.pop_front();
        }
    }

    /// Writes pending replies. While the socket is full it reads ahead the
    /// client's next requests (up to [`READ_AHEAD`] bytes; they are handled
    /// after), so that a client blocked sending them gets to read its
    /// replies. A client that has not taken the pending replies within
    /// `frame-timeout` is dropped, so it can never hold up shutdown.
    async fn flush_writes(&mut self) -> io::Result<()> {
        let mut at = 0;
        let deadline = tokio::time::Instant::now() + self.opts.frame_timeout;
        while at < self.wbuf.len() {
            match self.stream.try_write(&self.wbuf[at..]) {
                Ok(n) => {
                    at += n;
                    continue;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
            let ahead = self.may_read_ahead();
            let readable = tokio::select! {
                r = self.stream.writable() => { r?; false }
                r = self.stream.readable(), if ahead => { r?; true }
                () = tokio::time::sleep_until(deadline) => {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "client stopped reading its replies",
                    ));
                }
            };
            if readable {
                self.read_ahead()?;
            }
        }
        self.wbuf.clear();
        Ok(())
    }

    fn error(&mut self, id: u64, op: u16, code: ErrorCode, message: &str) {
        NodeCounters::inc(&self.ctx.counters.native_errors);
        codec::encode_error(&mut self.wbuf, id, op, code, message);
    }

    async fn handle(&mut self, id: u64, req: Request) {
        let op = req.op();
        match self.dispatch(req).await {
            Ok(resp) => codec::encode_response(&mut self.wbuf, id, &resp),
            // Nobody to answer: not an error the client got.
            Err(_) if std::mem::take(self.abandoned.get_mut()) => {}
            Err((code, message)) => self.error(id, op as u16, code, &message),
        }
    }

    async fn dispatch(&mut self, req: Request) -> HandlerResult {
        match req {
            Request::Ping => Ok(Response::Pong),
            Request::Hello { record } => {
                let ctx = Arc::clone(&self.ctx);
                let ns = joined(
                    tokio::task::spawn_blocking(move || ctx.register_namespace(&record)).await,
                )?
                .map_err(|e| {
                    let (code, msg) = store_error(&e);
                    (code, format!("HELLO: {msg}"))
                })?;
                Ok(Response::Hello(HelloReply {
                    ns,
                    version: codec::VERSION,
                    max_batch: self.opts.max_batch,
                    max_frame: self.opts.max_frame,
                    max_region: self.opts.max_region,
                }))
            }
            Request::RegisterRegion { len } => {
                let fd = self.claim_fd().ok_or((
                    ErrorCode::NoRegion,
                    "REGISTER_REGION carried no file descriptor (send the memfd with SCM_RIGHTS on the frame's first byte)".to_string(),
                ))?;
                let region = MappedRegion::map(&fd, len, self.opts.max_region).map_err(|e| {
                    let code = match e {
                        RegionError::BadLength { .. } => ErrorCode::TooLarge,
                        _ => ErrorCode::NoRegion,
                    };
                    (code, e.to_string())
                })?;
                self.region = Some(Arc::new(region));
                Ok(Response::RegionRegistered { len })
            }
            Request::Lookup { ns, group, keys } => self.lookup(ns, group, keys).await,
            Request::LookupInRegion {
                ns,
                group,
                offset,
                count,
            } => {
                let region = self.registered_region("LOOKUP")?;
                let keys = region.copy_keys_out(offset, count).ok_or_else(|| {
                    let len = u64::from(count) * 32;
                    out_of_range("LOOKUP keys".into(), offset, len, region.len())
                })?;
                self.lookup(ns, group, keys).await
            }
            Request::ClusterLookup {
                record,
                ranks,
                group,
                keys,
            } => {
                let ctx = Arc::clone(&self.ctx);
                let probes = keys.len().saturating_mul(ranks.len());
                // Each rank also hashes the record (up to 16 KiB): many
                // ranks go to the blocking pool whatever their keys.
                let heavy = probes >= OFFLOAD_KEYS || ranks.len() > 64;
                run_heavy(&self.slots, heavy, move || {
                    let (min, per_rank) = ctx.cluster_lookup(&record, &ranks, group, &keys);
                    Response::ClusterLookup {
                        min_prefix: min as u32,
                        ranks: per_rank
                            .into_iter()
                            .map(|r| RankPrefixReply {
                                rank: r.rank,
                                prefix: r.prefix as u32,
                                ram_prefix: r.ram_prefix as u32,
                            })
                            .collect(),
                    }
                })
                .await
            }
            Request::Put {
                ns,
                group,
                atomic,
                entries,
            } => self.put(ns, group, atomic, entries).await,
            Request::Get { ns, group, entries } => self.get(ns, group, &entries).await,
            Request::Delete { ns, group, keys } => {
                let store = Arc::clone(&self.ctx.store);
                let permit = self.bounds.delete().await;
                let existed = joined(
                    tokio::task::spawn_blocking(move || {
                        let _permit = permit;
                        keys.iter()
                            .map(|k| store.delete(&ChunkId::new(ns, *k, group)))
                            .collect::<Vec<bool>>()
                    })
                    .await,
                )?;
                Ok(Response::Delete { existed })
            }
            Request::Flush => {
                let store = Arc::clone(&self.ctx.store);
                let report = joined(tokio::task::spawn_blocking(move || store.flush()).await)?
                    .map_err(|e| store_error(&e))?;
                Ok(Response::Flush(FlushReply {
                    chunks: report.chunks,
                    bytes: report.bytes,
                    failed: report.failed,
                }))
            }
            Request::Stats => {
                let json = stats_json(&self.ctx);
                Ok(Response::Stats {
                    json: serde_json::to_vec(&json).expect("stats serialise"),
                })
            }
        }
    }

    /// LOOKUP's reply for `keys`.
    async fn lookup(
        &self,
        ns: tier::Namespace,
        group: tier::GroupId,
        keys: Vec<tier::ChunkKey>,
    ) -> HandlerResult {
        let ctx = Arc::clone(&self.ctx);
        run_heavy(&self.slots, keys.len() >= OFFLOAD_KEYS, move || {
            let mut locations = Vec::with_capacity(keys.len());
            let prefix = ctx.lookup_with(ns, group, &keys, |l| {
                locations.push(wire_location(l));
            });
            Response::Lookup {
                prefix: prefix as u32,
                locations,
            }
        })
        .await
    }

    /// The registered region, or the error of an `op` sent before one.
    fn registered_region(&self, op: &str) -> Result<&Arc<MappedRegion>, (ErrorCode, String)> {
        self.region.as_ref().ok_or((
            ErrorCode::NoRegion,
            format!("{op} before REGISTER_REGION: register a shared-memory region first"),
        ))
    }

    /// The registered region, after checking every entry's range against it.
    fn checked_region(
        &self,
        op: &str,
        entries: &[RegionEntry],
    ) -> Result<&Arc<MappedRegion>, (ErrorCode, String)> {
        let region = self.registered_region(op)?;
        for (i, e) in entries.iter().enumerate() {
            if !region.check(e.offset, e.len) {
                return Err(out_of_range(
                    format!("{op} entry {i}"),
                    e.offset,
                    e.len,
                    region.len(),
                ));
            }
        }
        Ok(region)
    }

    async fn put(
        &self,
        ns: tier::Namespace,
        group: tier::GroupId,
        atomic: bool,
        entries: Vec<RegionEntry>,
    ) -> HandlerResult {
        if entries.is_empty() {
            return Ok(Response::Put { statuses: vec![] });
        }
        let region = Arc::clone(self.checked_region("PUT", &entries)?);
        let store = Arc::clone(&self.ctx.store);
        let Some(record) = store.namespace_record(&ns) else {
            return Err((
                ErrorCode::UnknownNamespace,
                format!("namespace {ns} is not registered: send HELLO with its record first"),
            ));
        };
        if crate::resp::keys::is_resp_engine(&record.engine) {
            // RESP chunks carry their key's bytes, which a GET checks; an
            // unnamed chunk there would be an EXISTS hit and a GET miss.
            return Err((
                ErrorCode::BadRequest,
                format!(
                    "namespace {ns} holds RESP keys (engine {:?}), which carry their names: write them with SET over RESP",
                    record.engine
                ),
            ));
        }
        // Each member as RAM charges it: its bytes and its bookkeeping.
        let total = entries
            .iter()
            .fold(0u64, |t, e| t.saturating_add(store.ram_charge(e.len, 0)));
        let budget = store.config().ram_budget;
        if atomic && total > budget {
            return Err((
                ErrorCode::TooLarge,
                format!(
                    "atomic PUT of {} chunks, {total} bytes with the bookkeeping RAM charges \
                     per chunk, exceeds ram-budget ({budget} bytes)",
                    entries.len()
                ),
            ));
        }
        // A chunk the store would refuse is refused before it is copied out
        // of the region: the copy allocates its length (QA: one 48 GiB entry
        // of a sparse region aborted the daemon on the allocation).
        let max = store.max_chunk_len(0);
        if atomic && let Some(e) = entries.iter().find(|e| e.len > max) {
            return Err((
                ErrorCode::TooLarge,
                format!(
                    "atomic PUT: a chunk of {} bytes exceeds the largest chunk the store takes ({max} bytes)",
                    e.len
                ),
            ));
        }
        // An atomic PUT and any PUT under `backpressure` (it may wait for
        // the disk writer) never run on a runtime worker either.
        let offload = atomic
            || total >= OFFLOAD_BYTES
            || store.config().write_policy == tier::WritePolicy::Backpressure;
        // What the copies hold before the store takes them (an atomic PUT
        // all its chunks, else one chunk at a time) is bounded over all
        // connections by the RAM budget: one per copy slot was up to
        // 2 x cores x ram-budget, from sparse regions that cost the clients
        // nothing.
        let holding = if atomic {
            total
        } else {
            entries.iter().map(|e| e.len.min(max)).max().unwrap_or(0)
        };
        let permit = if offload {
            let n = copy_permits(holding, copy_kib_bound(self.ctx.store.config().ram_budget));
            Some(
                Arc::clone(&self.copying)
                    .acquire_many_owned(n)
                    .await
                    .expect("the copy bound is never closed"),
            )
        } else {
            None
        };
        let work = move || -> HandlerResult {
            let _permit = permit;
            let pool = store.buffers();
            let copy = |e: &RegionEntry| {
                region
                    .copy_out_pooled(pool, e.offset, e.len)
                    .expect("range checked above")
            };
            if atomic {
                let chunks: Vec<(ChunkId, Bytes)> = entries
                    .iter()
                    .map(|e| (ChunkId::new(ns, e.key, group), copy(e)))
                    .collect();
                store.put_atomic(chunks).map_err(|e| store_error(&e))?;
                return Ok(Response::Put {
                    statuses: vec![0; entries.len()],
                });
            }
            // One chunk copied at a time: memory held is bounded by one
            // chunk even when a batch names the same large range many times.
            let statuses = entries
                .iter()
                .map(|e| {
                    if e.len > max {
                        return ErrorCode::TooLarge as u16;
                    }
                    match store.put(ChunkId::new(ns, e.key, group), copy(e)) {
                        Ok(()) => 0,
                        Err(err) => store_error(&err).0 as u16,
                    }
                })
                .collect();
            Ok(Response::Put { statuses })
        };
        run_heavy(&self.slots, offload, work).await?
    }

    async fn get(
        &self,
        ns: tier::Namespace,
        group: tier::GroupId,
        entries: &[RegionEntry],
    ) -> HandlerResult {
        if entries.is_empty() {
            return Ok(Response::Get { results: vec![] });
        }
        let region = self.checked_region("GET", entries)?;
        // Destinations that do not overlap fit in the region; more than it
        // overlap (unspecified bytes, node/PROTOCOL.md). This bounds a GET's
        // copying by its region (a 64 MiB region could ask for one 31 MiB
        // chunk 2,048 times: 64 GB); a large sparse region still can ask
        // for that much, in jobs that share the copy slots fairly and stop
        // when the client hangs up.
        let wanted = entries
            .iter()
            .try_fold(0u64, |sum, e| sum.checked_add(e.len))
            .unwrap_or(u64::MAX);
        if wanted > region.len() {
            return Err((
                ErrorCode::BadRequest,
                format!(
                    "GET ranges add up to {wanted} bytes, more than the {}-byte region: \
                     destinations overlap",
                    region.len()
                ),
            ));
        }
        let mut results = vec![GetResult::MISS; entries.len()];
        // RAM hits are gathered (handles, no copy yet) and placed together
        // below. Anything else (disk, peers) is read concurrently, up to
        // MAX_CONCURRENT_READS at a time, each read placing its own chunk,
        // so a restore from disk or a peer keeps several reads in flight.
        // While reads wait, a client that hangs up ends the GET: its
        // pending reads are dropped (a peer fetch stops; a disk read already
        // running finishes), so a restore whose engine died does not go on
        // pulling chunks from peers for nobody.
        // RAM hits are counted once placed: a chunk larger than its range
        // (`too-small`) wrote nothing, so it is no hit and no `bytes_out`;
        // one on disk is not even read.
        let mut hits = Vec::new();
        let mut pending = JoinSet::new();
        let mut watch = HangupWatch::new();
        for (i, e) in entries.iter().enumerate() {
            let id = ChunkId::new(ns, e.key, group);
            if let Some(data) = self.ctx.store.peek_ram(&id, None) {
                hits.push((i, *e, Some((data, Location::Ram))));
                continue;
            }
            let disk_len = self.ctx.store.disk_len(&id);
            if let Some(len) = disk_len.filter(|&n| n > e.len) {
                results[i] = GetResult {
                    status: GetStatus::TooSmall,
                    len,
                };
                continue;
            }
            while pending.len() >= MAX_CONCURRENT_READS {
                self.settle(&mut pending, &mut results, &mut watch).await?;
            }
            // The bytes of disk reads are bounded over all connections by
            // the RAM budget, and the reads by a count (review: 32
            // connections of 16 reads of 4 MiB each took 2.9 GB and 481
            // threads with a 64 MiB RAM budget), held until the read ends
            // even when the GET is dropped; not for peer fetches, which
            // the peer layer bounds by its own means.
            let held = tokio::select! {
                biased;
                held = self.bounds.read(disk_len.unwrap_or(0)) => held,
                () = watch.hung_up(&self.stream) => return Err(self.abandon(&mut pending)),
            };
            let (ctx, region, e) = (Arc::clone(&self.ctx), Arc::clone(region), *e);
            let slots = Arc::clone(&self.slots);
            pending.spawn(async move {
                let hit = ctx.get_with_location_held(id, None, held).await;
                place_hits(&slots, region, vec![(i, e, hit)]).await
            });
        }
        // RAM hits are copied in jobs of at most GET_JOB_BYTES, each taking
        // a copy slot of its own: one large GET neither keeps a slot for
        // seconds (stalling every other client's copies) nor, after its
        // client hung up or a stop aborted it, goes on copying for long.
        let mut hits = hits.into_iter().peekable();
        while hits.peek().is_some() {
            let mut job = Vec::new();
            let mut bytes = 0u64;
            let len = |h: &(usize, RegionEntry, Option<(Bytes, Location)>)| {
                h.2.as_ref().map_or(0, |(d, _)| d.len() as u64)
            };
            while let Some(h) = hits.next_if(|h| job.is_empty() || bytes + len(h) <= GET_JOB_BYTES)
            {
                bytes += len(&h);
                job.push(h);
            }
            let placed = tokio::select! {
                biased;
                placed = place_hits(&self.slots, Arc::clone(region), job) => placed,
                () = watch.hung_up(&self.stream) => return Err(self.abandon(&mut pending)),
            };
            for (i, r) in placed {
                if r.status == GetStatus::HitRam {
                    self.ctx.store.count_ram_hit(&ns, r.len);
                }
                results[i] = r;
            }
        }
        while !pending.is_empty() {
            self.settle(&mut pending, &mut results, &mut watch).await?;
        }
        Ok(Response::Get { results })
    }

    /// Ends a GET whose client hung up: its pending reads are dropped.
    fn abandon(&self, pending: &mut JoinSet<Vec<(usize, GetResult)>>) -> (ErrorCode, String) {
        pending.abort_all();
        NodeCounters::inc(&self.ctx.counters.native_abandoned);
        self.abandoned
            .store(true, std::sync::atomic::Ordering::Relaxed);
        debug!(
            reads = pending.len(),
            "native client hung up during a GET; its reads are dropped"
        );
        (
            ErrorCode::Internal,
            "the client hung up; GET abandoned".into(),
        )
    }

    /// Waits for one concurrent read (which placed its chunk) and notes its
    /// result, or for the client to hang up ([`HangupWatch`]): then the
    /// GET's reads are dropped (the `JoinSet` aborts them) and it fails.
    async fn settle(
        &self,
        pending: &mut JoinSet<Vec<(usize, GetResult)>>,
        results: &mut [GetResult],
        watch: &mut HangupWatch,
    ) -> Result<(), (ErrorCode, String)> {
        let joined = tokio::select! {
            biased;
            j = pending.join_next() => j,
            () = watch.hung_up(&self.stream) => return Err(self.abandon(pending)),
        };
        match joined {
            Some(Ok(placed)) => {
                for (i, r) in placed {
                    results[i] = r;
                }
            }
            // A read task that panicked leaves its entry a miss.
            Some(Err(e)) => warn!(error = %e, "native GET: a read task failed"),
            None => {}
        }
        Ok(())
    }
}

/// Watches a connection for its client hanging up while a request waits
/// for reads. Only a client that closed both ways counts: one that only
/// shut its sending side (it still reads replies) does not. Readiness for
/// reading is the signal, so once the client's next request has arrived
/// (pipelined bytes keep the socket readable) nothing can be told without
/// reading it, and the watch stops; that GET runs to its end as before.
struct HangupWatch {
    on: bool,
}

impl HangupWatch {
    fn new() -> Self {
        Self { on: true }
    }

    /// Resolves when the client has hung up; pending for good otherwise.
    async fn hung_up(&mut self, stream: &UnixStream) {
        while self.on {
            if stream.readable().await.is_err() {
                break;
            }
            // A peek tells what the readiness meant; one that would block
            // clears it (the flag may be stale: requests are also read by
            // polling, around tokio).
            let mut byte = [0u8; 1];
            let peek = stream.try_io(Interest::READABLE, || {
                rustix::net::recv(stream, &mut byte, RecvFlags::PEEK | RecvFlags::DONTWAIT)
                    .map_err(io::Error::from)
            });
            match peek {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                // End of stream: hung up unless only half closed (replies
                // are still wanted).
                Ok(0) if closed_both_ways(stream) => return,
                // The next request is waiting, the client is half closed,
                // or the socket failed (the reply's write will tell).
                _ => self.on = false,
            }
        }
        std::future::pending::<()>().await;
    }
}

/// Whether the other end of `stream` is gone (`POLLHUP`: both directions
/// shut), as opposed to a client that only shut its sending side.
fn closed_both_ways(stream: &UnixStream) -> bool {
    use rustix::event::{PollFd, PollFlags, poll};
    let mut fds = [PollFd::new(stream, PollFlags::IN)];
    matches!(poll(&mut fds, 0), Ok(n) if n > 0)
        && fds[0].revents().intersects(PollFlags::HUP | PollFlags::ERR)
}

/// A GET's hits for entry `i` (range checked), to place in the region.
type Hits = Vec<(usize, RegionEntry, Option<(Bytes, Location)>)>;

/// Places `hits` into `region` ([`place`]) through [`run_heavy`]: inline
/// when the bytes they copy add up to less than [`OFFLOAD_BYTES`]. Returns
/// each entry's result; a failed copy task leaves its entries misses.
async fn place_hits(
    slots: &Arc<Semaphore>,
    region: Arc<MappedRegion>,
    hits: Hits,
) -> Vec<(usize, GetResult)> {
    let total: u64 = hits
        .iter()
        .filter_map(|(_, e, h)| {
            h.as_ref()
                .map(|(d, _)| d.len() as u64)
                .filter(|&n| n <= e.len)
        })
        .sum();
    let place_all = move |hits: Hits| {
        hits.into_iter()
            .map(|(i, e, hit)| (i, place(&region, &e, hit)))
            .collect::<Vec<_>>()
    };
    if total < OFFLOAD_BYTES {
        return place_all(hits);
    }
    // Only an offloaded copy can fail: its entries' numbers, for the misses.
    let idx: Vec<usize> = hits.iter().map(|(i, _, _)| *i).collect();
    run_heavy(slots, true, move || place_all(hits))
        .await
        .unwrap_or_else(|(_, e)| {
            warn!(error = %e, "native GET: a copy task failed");
            idx.into_iter().map(|i| (i, GetResult::MISS)).collect()
        })
}

/// Writes a hit into the region (range already checked) and says what happened.
fn place(region: &MappedRegion, e: &RegionEntry, hit: Option<(Bytes, Location)>) -> GetResult {
    let Some((data, loc)) = hit else {
        return GetResult::MISS;
    };
    let len = data.len() as u64;
    if len > e.len {
        return GetResult {
            status: GetStatus::TooSmall,
            len,
        };
    }
    let written = region.copy_in(e.offset, &data);
    debug_assert!(written, "range checked before any read");
    GetResult {
        status: match loc {
            Location::Ram => GetStatus::HitRam,
            Location::Disk => GetStatus::HitDisk,
            Location::Peer => GetStatus::HitPeer,
        },
        len,
    }
}

/// The `out-of-range` error of `what`'s range in a region of `region_len` bytes.
fn out_of_range(what: String, offset: u64, len: u64, region_len: u64) -> (ErrorCode, String) {
    (
        ErrorCode::OutOfRange,
        format!(
            "{what}: range offset {offset} length {len} is outside the region of {region_len} bytes"
        ),
    )
}

fn wire_location(l: Option<Location>) -> LookupLocation {
    match l {
        None => LookupLocation::Miss,
        Some(Location::Ram) => LookupLocation::Ram,
        Some(Location::Disk) => LookupLocation::Disk,
        Some(Location::Peer) => LookupLocation::Peer,
    }
}

/// The STATS document: store stats, node counters and uptime.
pub fn stats_json(ctx: &NodeContext) -> serde_json::Value {
    use std::sync::atomic::Ordering::Relaxed;
    let c = &ctx.counters;
    serde_json::json!({
        "node": ctx.node_name,
        "uptime-secs": ctx.started.elapsed().as_secs(),
        // The largest chunk a PUT accepts (unnamed; region-size less its
        // headers): clients check their chunk size against it at start.
        "max-chunk-bytes": ctx.store.max_chunk_len(0),
        "store": ctx.store.stats(),
        "peers": ctx.peers_json(),
        "served_unlisted": ctx.served_unlisted_json(),
        "peer_corrupt_replies": ctx.peer_corrupt_replies(),
        "counters": {
            "native-requests": c.native_requests.load(Relaxed),
            "native-errors": c.native_errors.load(Relaxed),
            "native-abandoned": c.native_abandoned.load(Relaxed),
            "resp-commands": c.resp_commands.load(Relaxed),
            "resp-errors": c.resp_errors.load(Relaxed),
            "connections": c.connections.load(Relaxed),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn put_copies_are_bounded_by_the_ram_budget_in_kib() {
        assert_eq!(copy_kib_bound(4 << 30), 4 << 20);
        assert_eq!(copy_kib_bound(1 << 20), 64 << 10, "at least 64 MiB");
        assert_eq!(copy_permits(1, 1 << 20), 1);
        assert_eq!(copy_permits(1025, 1 << 20), 2, "rounded up");
        assert_eq!(copy_permits(0, 1 << 20), 1);
        // Never more than the whole bound (a wait that could not end).
        assert_eq!(copy_permits(u64::MAX, 64 << 10), 64 << 10);
    }

    #[test]
    fn a_full_filesystem_is_no_space_and_other_io_errors_are_store_errors() {
        let io = |errno| tier::Error::Io {
            op: "write",
            path: "namespaces.json.tmp".into(),
            source: std::io::Error::from_raw_os_error(errno),
        };
        assert_eq!(store_error(&io(libc::ENOSPC)).0, ErrorCode::NoSpace);
        assert_eq!(store_error(&io(libc::EIO)).0, ErrorCode::Store);
    }
}
