//! A blocking native-protocol client (std `UnixStream`), used by the CLI,
//! the tests and the benches.
//!
//! Call order: [`Client::connect`], [`Client::hello`] for each namespace,
//! [`Client::create_region`] (or [`Client::register_region`]) before PUT /
//! GET, then any mix of requests. Requests can be pipelined with
//! [`Client::send`] / [`Client::recv`]; replies arrive in request order.

use std::io::{Read, Write};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use tier::{ChunkKey, GroupId, Namespace, NamespaceRecord};

use super::NativeError;
use super::codec::{
    self, Decoded, FlushReply, GetResult, HEADER_LEN, HelloReply, LookupLocation, Op,
    RankPrefixReply, RegionEntry, Reply, Request, Response,
};
use super::region::{OwnedRegion, send_with_fd};

/// Largest reply body a client accepts.
const MAX_REPLY: u32 = 1 << 30;
/// Default size of a region created on demand by the convenience methods.
const DEFAULT_REGION: u64 = 64 << 20;

/// Result of [`Client::lookup`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LookupResult {
    /// Length of the longest present prefix.
    pub prefix: u32,
    /// Per key.
    pub locations: Vec<LookupLocation>,
}

/// Result of [`Client::cluster_lookup`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterLookupResult {
    /// Minimum prefix over the ranks.
    pub min_prefix: u32,
    /// Per rank.
    pub ranks: Vec<RankPrefixReply>,
}

/// A blocking connection to the daemon's native socket.
pub struct Client {
    stream: UnixStream,
    next_id: u64,
    region: Option<OwnedRegion>,
    wbuf: Vec<u8>,
    rbuf: Vec<u8>,
    hello: Option<HelloReply>,
    spin: Duration,
    /// Set when a call failed part-way (timeout, I/O error, a reply out of
    /// step): the stream may still carry that call's reply and the daemon
    /// may still be copying into the region, so no further call is made on
    /// this connection ([`NativeError::Broken`]).
    broken: Option<String>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("next_id", &self.next_id)
            .field("region", &self.region)
            .finish()
    }
}

fn unexpected(want: &str, got: &Response) -> NativeError {
    NativeError::Protocol(format!("expected a {want} reply, got {:?}", got.op()))
}

/// The result of a LOOKUP reply (keys in the frame or in the region).
fn lookup_result(r: Response) -> Result<LookupResult, NativeError> {
    match r {
        Response::Lookup { prefix, locations } => Ok(LookupResult { prefix, locations }),
        other => Err(unexpected("LOOKUP", &other)),
    }
}

impl Client {
    /// Connects to the daemon at `path`. Default timeout: 60 s per reply.
    pub fn connect(path: impl AsRef<Path>) -> Result<Self, NativeError> {
        let path = path.as_ref();
        let stream = UnixStream::connect(path).map_err(|source| NativeError::Unavailable {
            path: path.to_owned(),
            source,
        })?;
        Self::with_stream(stream)
    }

    /// [`Client::connect`] with the connect itself bounded by `timeout`
    /// (`None`: unbounded), which then also bounds every reply: a daemon
    /// whose listen backlog is full (stopped, or swamped) blocks a plain
    /// connect for good.
    pub fn connect_timeout(
        path: impl AsRef<Path>,
        timeout: Option<Duration>,
    ) -> Result<Self, NativeError> {
        let path = path.as_ref();
        let stream = match timeout {
            None => UnixStream::connect(path),
            Some(t) => connect_bounded(path, t),
        }
        .map_err(|source| match source.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                NativeError::Timeout { op: "connect" }
            }
            _ => NativeError::Unavailable {
                path: path.to_owned(),
                source,
            },
        })?;
        let c = Self::with_stream(stream)?;
        c.set_timeout(timeout)?;
        Ok(c)
    }

    fn with_stream(stream: UnixStream) -> Result<Self, NativeError> {
        let c = Self {
            stream,
            next_id: 1,
            region: None,
            wbuf: Vec::with_capacity(4096),
            rbuf: Vec::with_capacity(4096),
            hello: None,
            spin: super::spin::client_spin(),
            broken: None,
        };
        c.set_timeout(Some(Duration::from_secs(60)))?;
        Ok(c)
    }

    /// Sets the read and write timeout (`None`: wait forever).
    pub fn set_timeout(&self, timeout: Option<Duration>) -> Result<(), NativeError> {
        self.stream
            .set_read_timeout(timeout)
            .and_then(|()| self.stream.set_write_timeout(timeout))
            .map_err(|e| NativeError::io("set socket timeouts", e))
    }

    /// The underlying socket (tests use it to send raw bytes).
    pub fn stream(&mut self) -> &mut UnixStream {
        &mut self.stream
    }

    /// Limits announced by the daemon in the last HELLO.
    pub fn server_limits(&self) -> Option<&HelloReply> {
        self.hello.as_ref()
    }

    /// Sends a request without waiting for its reply; returns its id.
    /// While its replies wait unread, the daemon reads up to 16 MiB of
    /// further requests ahead; a client that sends more before reading
    /// blocks until it reads (node/PROTOCOL.md, "Pipelining").
    pub fn send(&mut self, req: &Request) -> Result<u64, NativeError> {
        self.send_with_fd(req, None)
    }

    fn send_with_fd(
        &mut self,
        req: &Request,
        fd: Option<BorrowedFd<'_>>,
    ) -> Result<u64, NativeError> {
        self.send_encoded(|out, id| codec::encode_request(out, id, req), fd)
    }

    /// Sends the frame `encode(buf, id)` appends, with a fresh request id.
    fn send_encoded(
        &mut self,
        encode: impl FnOnce(&mut Vec<u8>, u64),
        fd: Option<BorrowedFd<'_>>,
    ) -> Result<u64, NativeError> {
        if let Some(why) = &self.broken {
            return Err(NativeError::Broken(why.clone()));
        }
        let id = self.next_id;
        self.next_id += 1;
        self.wbuf.clear();
        encode(&mut self.wbuf, id);
        let r = match fd {
            Some(fd) => send_with_fd(self.stream.as_fd(), &self.wbuf, Some(fd)),
            None => self.stream.write_all(&self.wbuf),
        };
        if let Err(e) = r {
            let err = map_io("send request", e);
            // Part of the frame may have gone out.
            self.mark_broken(&err);
            if matches!(err, NativeError::Closed) {
                // The daemon may have said why before it closed (`busy`
                // past max-connections): that is the error to report. A
                // closed peer never blocks this read.
                if let Ok((0, Reply::Error { code, message })) = self.recv() {
                    return Err(NativeError::Remote { code, message });
                }
            }
            return Err(err);
        }
        Ok(id)
    }

    /// Sets how long [`Client::recv`] polls for a reply before it blocks
    /// in `read` (default: [`super::spin::CLIENT_SPIN_ENV`] if set, else
    /// [`super::DEFAULT_SPIN`]; zero blocks at once).
    pub fn set_spin(&mut self, spin: Duration) {
        self.spin = spin;
    }

    /// Polls (non-blocking peeks) for up to
    /// `self.spin` until a reply byte is readable. A reply that comes back
    /// within that window then costs no sleep and wake-up of this thread,
    /// which on a virtual machine whose idle CPUs halt is tens of
    /// microseconds. Only while the system has a CPU to spare
    /// ([`super::spin::may_poll`]).
    fn spin_until_readable(&self) {
        if self.spin.is_zero() || !super::spin::may_poll() {
            return;
        }
        let deadline = Instant::now() + self.spin;
        let mut byte = [0u8; 1];
        loop {
            match rustix::net::recv(
                &self.stream,
                &mut byte,
                rustix::net::RecvFlags::PEEK | rustix::net::RecvFlags::DONTWAIT,
            ) {
                Err(rustix::io::Errno::AGAIN) | Err(rustix::io::Errno::INTR) => {}
                // Data, end of stream or an error: the blocking read reports it.
                _ => return,
            }
            if Instant::now() >= deadline {
                return;
            }
            std::hint::spin_loop();
        }
    }

    /// Whether an earlier call failed part-way, so that this connection
    /// refuses further calls ([`NativeError::Broken`]).
    pub fn is_broken(&self) -> bool {
        self.broken.is_some()
    }

    fn mark_broken(&mut self, err: &NativeError) {
        if self.broken.is_none() {
            self.broken = Some(err.to_string());
        }
    }

    /// Receives the next reply: its request id and contents. Any failure
    /// leaves the connection out of step with its requests: it is marked
    /// broken.
    pub fn recv(&mut self) -> Result<(u64, Reply), NativeError> {
        let r = self.recv_frame();
        if let Err(e) = &r {
            self.mark_broken(e);
        }
        r
    }

    fn recv_frame(&mut self) -> Result<(u64, Reply), NativeError> {
        self.spin_until_readable();
        self.rbuf.resize(HEADER_LEN, 0);
        self.stream
            .read_exact(&mut self.rbuf[..HEADER_LEN])
            .map_err(|e| map_io("read reply header", e))?;
        let header =
            codec::decode_header(&self.rbuf, MAX_REPLY)?.expect("a full header is present");
        let total = HEADER_LEN + header.body_len as usize;
        self.rbuf.resize(total, 0);
        self.stream
            .read_exact(&mut self.rbuf[HEADER_LEN..])
            .map_err(|e| map_io("read reply body", e))?;
        match codec::decode_frame(&self.rbuf, MAX_REPLY)? {
            Decoded::Frame { header, body, .. } => {
                Ok((header.id, codec::decode_reply(&header, body)?))
            }
            Decoded::Incomplete { .. } => Err(NativeError::Protocol("incomplete reply".into())),
        }
    }

    /// Sends a request and waits for its reply; a daemon error becomes
    /// [`NativeError::Remote`].
    pub fn call(&mut self, req: &Request) -> Result<Response, NativeError> {
        let id = self.send(req)?;
        self.wait(id)
    }

    fn wait(&mut self, id: u64) -> Result<Response, NativeError> {
        let (got, reply) = self.recv()?;
        match reply {
            // Error replies to unparseable frames carry id 0.
            Reply::Error { code, message } if got == id || got == 0 => {
                Err(NativeError::Remote { code, message })
            }
            Reply::Ok(resp) if got == id => Ok(resp),
            _ => {
                let err =
                    NativeError::Protocol(format!("reply id {got} does not match request id {id}"));
                self.mark_broken(&err);
                Err(err)
            }
        }
    }

    /// PING.
    pub fn ping(&mut self) -> Result<(), NativeError> {
        match self.call(&Request::Ping)? {
            Response::Pong => Ok(()),
            other => Err(unexpected("PING", &other)),
        }
    }

    /// HELLO: registers the namespace record; returns its id.
    pub fn hello(&mut self, record: &NamespaceRecord) -> Result<Namespace, NativeError> {
        match self.call(&Request::Hello {
            record: record.clone(),
        })? {
            Response::Hello(h) => {
                self.hello = Some(h);
                Ok(h.ns)
            }
            other => Err(unexpected("HELLO", &other)),
        }
    }

    /// Registers `len` bytes of a caller-owned sealed memfd as this
    /// connection's region (replacing any previous one).
    pub fn register_region(&mut self, fd: BorrowedFd<'_>, len: u64) -> Result<u64, NativeError> {
        let id = self.send_with_fd(&Request::RegisterRegion { len }, Some(fd))?;
        match self.wait(id)? {
            Response::RegionRegistered { len } => Ok(len),
            other => Err(unexpected("REGISTER_REGION", &other)),
        }
    }

    /// Creates a sealed memfd of `len` bytes, maps it here and registers it
    /// with the daemon as this connection's region.
    pub fn create_region(&mut self, len: u64) -> Result<(), NativeError> {
        let region = OwnedRegion::create("kvtier-client", len)?;
        let fd = region
            .fd()
            .try_clone_to_owned()
            .map_err(|e| NativeError::io("dup memfd", e))?;
        self.register_region(fd.as_fd(), len)?;
        self.region = Some(region);
        Ok(())
    }

    /// The region created by [`Client::create_region`].
    pub fn region(&self) -> Option<&OwnedRegion> {
        self.region.as_ref()
    }

    /// The region, writable (fill PUT ranges here).
    pub fn region_mut(&mut self) -> Option<&mut OwnedRegion> {
        self.region.as_mut()
    }

    fn ensure_region(&mut self, len: u64) -> Result<(), NativeError> {
        if self.region.as_ref().is_none_or(|r| r.len() < len) {
            self.create_region(len.max(DEFAULT_REGION))?;
        }
        Ok(())
    }

    /// LOOKUP: longest present prefix of `keys` and where each key lives.
    pub fn lookup(
        &mut self,
        ns: Namespace,
        group: GroupId,
        keys: &[ChunkKey],
    ) -> Result<LookupResult, NativeError> {
        // Encoded from the borrowed keys (no copy into a `Request`).
        let id = self.send_encoded(
            |out, id| codec::encode_keys_request(out, id, Op::Lookup, &ns, group, keys),
            None,
        )?;
        lookup_result(self.wait(id)?)
    }

    /// LOOKUP of `count` keys that the caller wrote, 32 bytes each, at
    /// `offset` in the region ([`Client::region_mut`]): the keys travel in
    /// shared memory instead of the request frame (fewer copies and no
    /// CRC over them), the answer is [`Client::lookup`]'s.
    pub fn lookup_in_region(
        &mut self,
        ns: Namespace,
        group: GroupId,
        offset: u64,
        count: u32,
    ) -> Result<LookupResult, NativeError> {
        lookup_result(self.call(&Request::LookupInRegion {
            ns,
            group,
            offset,
            count,
        })?)
    }

    /// [`Client::lookup`] with the keys carried in the region: copies them
    /// to `offset` in it (creating one if there is none) and calls
    /// [`Client::lookup_in_region`].
    pub fn lookup_via_region(
        &mut self,
        ns: Namespace,
        group: GroupId,
        keys: &[ChunkKey],
        offset: u64,
    ) -> Result<LookupResult, NativeError> {
        let len = keys.len() as u64 * 32;
        let end = offset
            .checked_add(len)
            .ok_or_else(|| NativeError::Protocol("key range overflows".into()))?;
        self.ensure_region(end)?;
        let region = self.region.as_mut().expect("ensured above").as_mut_slice();
        for (dst, k) in region[offset as usize..end as usize]
            .chunks_exact_mut(32)
            .zip(keys)
        {
            dst.copy_from_slice(&k.0);
        }
        let count = u32::try_from(keys.len())
            .map_err(|_| NativeError::Protocol(format!("{} keys in one LOOKUP", keys.len())))?;
        self.lookup_in_region(ns, group, offset, count)
    }

    /// CLUSTER_LOOKUP for the family of `record` over `ranks`.
    pub fn cluster_lookup(
        &mut self,
        record: &NamespaceRecord,
        ranks: &[u32],
        group: GroupId,
        keys: &[ChunkKey],
    ) -> Result<ClusterLookupResult, NativeError> {
        match self.call(&Request::ClusterLookup {
            record: record.clone(),
            ranks: ranks.to_vec(),
            group,
            keys: keys.to_vec(),
        })? {
            Response::ClusterLookup { min_prefix, ranks } => {
                Ok(ClusterLookupResult { min_prefix, ranks })
            }
            other => Err(unexpected("CLUSTER_LOOKUP", &other)),
        }
    }

    /// PUT of ranges already written into the region. Returns per entry 0
    /// (stored) or an [`super::ErrorCode`] value.
    pub fn put(
        &mut self,
        ns: Namespace,
        group: GroupId,
        entries: &[RegionEntry],
        atomic: bool,
    ) -> Result<Vec<u16>, NativeError> {
        match self.call(&Request::Put {
            ns,
            group,
            atomic,
            entries: entries.to_vec(),
        })? {
            Response::Put { statuses } => Ok(statuses),
            other => Err(unexpected("PUT", &other)),
        }
    }

    /// Copies each item into the region (creating or growing it as needed)
    /// and PUTs them. Returns per item 0 or an error code.
    pub fn put_bytes(
        &mut self,
        ns: Namespace,
        group: GroupId,
        items: &[(ChunkKey, &[u8])],
    ) -> Result<Vec<u16>, NativeError> {
        let total: u64 = items.iter().map(|(_, b)| b.len() as u64).sum();
        self.ensure_region(total.max(1))?;
        let region = self.region.as_mut().expect("ensured above").as_mut_slice();
        let mut entries = Vec::with_capacity(items.len());
        let mut off = 0usize;
        for (key, data) in items {
            region[off..off + data.len()].copy_from_slice(data);
            entries.push(RegionEntry {
                key: *key,
                offset: off as u64,
                len: data.len() as u64,
            });
            off += data.len();
        }
        self.put(ns, group, &entries, false)
    }

    /// GET into ranges of the region.
    pub fn get(
        &mut self,
        ns: Namespace,
        group: GroupId,
        entries: &[RegionEntry],
    ) -> Result<Vec<GetResult>, NativeError> {
        match self.call(&Request::Get {
            ns,
            group,
            entries: entries.to_vec(),
        })? {
            Response::Get { results } => Ok(results),
            other => Err(unexpected("GET", &other)),
        }
    }

    /// Reads one chunk into a new `Vec` (through the region, grown when the
    /// chunk does not fit). `None` on a miss.
    pub fn get_bytes(
        &mut self,
        ns: Namespace,
        group: GroupId,
        key: ChunkKey,
    ) -> Result<Option<Vec<u8>>, NativeError> {
        self.ensure_region(DEFAULT_REGION)?;
        for _ in 0..2 {
            let cap = self.region.as_ref().expect("ensured above").len();
            let r = self.get(
                ns,
                group,
                &[RegionEntry {
                    key,
                    offset: 0,
                    len: cap,
                }],
            )?;
            let r = r
                .first()
                .copied()
                .ok_or_else(|| NativeError::Protocol("empty GET reply".into()))?;
            if r.status.is_hit() {
                if r.len > cap {
                    let err = NativeError::Protocol(format!(
                        "GET reply says {} bytes were placed in a {cap}-byte range",
                        r.len
                    ));
                    self.mark_broken(&err);
                    return Err(err);
                }
                let region = self.region.as_ref().expect("ensured above").as_slice();
                return Ok(Some(region[..r.len as usize].to_vec()));
            }
            if r.status != codec::GetStatus::TooSmall {
                return Ok(None);
            }
            self.ensure_region(r.len)?;
        }
        Err(NativeError::Protocol(
            "chunk kept growing between GETs".into(),
        ))
    }

    /// DELETE: per key whether it existed.
    pub fn delete(
        &mut self,
        ns: Namespace,
        group: GroupId,
        keys: &[ChunkKey],
    ) -> Result<Vec<bool>, NativeError> {
        let id = self.send_encoded(
            |out, id| codec::encode_keys_request(out, id, Op::Delete, &ns, group, keys),
            None,
        )?;
        match self.wait(id)? {
            Response::Delete { existed } => Ok(existed),
            other => Err(unexpected("DELETE", &other)),
        }
    }

    /// FLUSH: returns once every chunk dirty at the call is durable.
    pub fn flush(&mut self) -> Result<FlushReply, NativeError> {
        match self.call(&Request::Flush)? {
            Response::Flush(f) => Ok(f),
            other => Err(unexpected("FLUSH", &other)),
        }
    }

    /// STATS as JSON (`node`, `uptime-secs`, `store`, `counters`).
    pub fn stats(&mut self) -> Result<serde_json::Value, NativeError> {
        match self.call(&Request::Stats)? {
            Response::Stats { json } => serde_json::from_slice(&json)
                .map_err(|e| NativeError::Protocol(format!("STATS reply is not JSON: {e}"))),
            other => Err(unexpected("STATS", &other)),
        }
    }
}

/// A Unix stream connect that gives up after `timeout`: the socket's send
/// timeout bounds a blocking `connect(2)` on Linux (EAGAIN when it passes).
fn connect_bounded(path: &Path, timeout: Duration) -> std::io::Result<UnixStream> {
    use std::os::fd::{FromRawFd, OwnedFd};
    use std::os::unix::ffi::OsStrExt;
    let bytes = path.as_os_str().as_bytes();
    // SAFETY: sockaddr_un is plain data; zeroed is a valid value.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    if bytes.is_empty() || bytes.len() >= addr.sun_path.len() || bytes.contains(&0) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!(
                "socket path is empty, longer than {} bytes or holds a NUL byte",
                addr.sun_path.len() - 1
            ),
        ));
    }
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (d, s) in addr.sun_path.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    // SAFETY: plain syscalls; the fd is owned at once, every pointer points
    // at a live local of the size passed.
    unsafe {
        let fd = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let fd = OwnedFd::from_raw_fd(fd);
        let tv = libc::timeval {
            tv_sec: timeout.as_secs().min(i64::MAX as u64) as libc::time_t,
            tv_usec: libc::suseconds_t::from(timeout.subsec_micros().max(
                // A zero timeval means "forever": at least 1 µs.
                u32::from(timeout.is_zero()),
            )),
        };
        let fd_raw = std::os::fd::AsRawFd::as_raw_fd(&fd);
        if libc::setsockopt(
            fd_raw,
            libc::SOL_SOCKET,
            libc::SO_SNDTIMEO,
            (&tv as *const libc::timeval).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        ) != 0
        {
            return Err(std::io::Error::last_os_error());
        }
        let len = std::mem::size_of::<libc::sa_family_t>() + bytes.len() + 1;
        if libc::connect(
            fd_raw,
            (&addr as *const libc::sockaddr_un).cast(),
            len as libc::socklen_t,
        ) != 0
        {
            return Err(std::io::Error::last_os_error());
        }
        Ok(UnixStream::from(fd))
    }
}

fn map_io(op: &'static str, e: std::io::Error) -> NativeError {
    match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            NativeError::Timeout { op }
        }
        std::io::ErrorKind::UnexpectedEof
        | std::io::ErrorKind::BrokenPipe
        | std::io::ErrorKind::ConnectionReset => NativeError::Closed,
        _ => NativeError::io(op, e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    /// A "daemon" that answers the first request (a PING) only after
    /// `delay`, then keeps the connection open without answering more.
    fn late_ponger(delay: Duration) -> (tempfile::TempDir, std::thread::JoinHandle<()>) {
        let dir = tempfile::tempdir().unwrap();
        let listener = UnixListener::bind(dir.path().join("s")).unwrap();
        let t = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut head = [0u8; HEADER_LEN];
            s.read_exact(&mut head).unwrap();
            let h = codec::decode_header(&head, 1 << 20).unwrap().unwrap();
            std::thread::sleep(delay);
            let mut out = Vec::new();
            codec::encode_response(&mut out, h.id, &Response::Pong);
            s.write_all(&out).unwrap();
            // Hold the connection until the client hangs up.
            let mut rest = Vec::new();
            let _ = s.read_to_end(&mut rest);
        });
        (dir, t)
    }

    #[test]
    fn a_call_that_timed_out_breaks_the_connection_instead_of_reading_its_late_reply() {
        let (dir, t) = late_ponger(Duration::from_millis(300));
        let mut c = Client::connect_timeout(dir.path().join("s"), Some(Duration::from_millis(100)))
            .unwrap();
        assert!(matches!(c.ping(), Err(NativeError::Timeout { .. })));
        assert!(c.is_broken());
        // The late reply arrives meanwhile; the next call must not take it
        // for its own (nor for a mismatch to go on from).
        std::thread::sleep(Duration::from_millis(400));
        match c.ping() {
            Err(NativeError::Broken(why)) => assert!(why.contains("in time"), "{why}"),
            other => panic!("a call on a timed-out connection: {other:?}"),
        }
        drop(c);
        t.join().unwrap();
    }
}
