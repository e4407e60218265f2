//! The tokio side of the RESP endpoint: accepts connections, reads requests
//! into the sans-IO parser, executes them in order (pipelining) and writes
//! the queued replies with vectored writes.

use std::future::Future;
use std::io;
use std::io::IoSlice;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use tier::buffers::POOL_MIN;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinSet;

use super::commands::{Session, Shared, execute};
use super::parser::{MAX_ARGS, Parsed, RequestParser, UNAUTH_MAX_ARGS, UNAUTH_MAX_BULK};
use super::reply::Output;
use super::{RespError, RespOptions};
use crate::NodeContext;
use crate::context::NodeCounters;

/// Read buffer size (and the minimum free space before a read).
const READ_BUF: usize = 64 * 1024;
/// Most bytes read when no command is pending (Redis reads 16 KiB too).
const FIRST_READ: usize = 16 * 1024;
/// Queued reply bytes above which replies are written before the next
/// pipelined command runs (bounds memory per connection).
const FLUSH_AT: usize = 8 << 20;
/// Most request bytes read ahead while replies cannot be written.
const READ_AHEAD_MAX: usize = 4 << 20;
/// Most segments handed to one vectored write.
const MAX_IOV: usize = 64;
/// Time allowed to tell a rejected client why.
const REJECT_TIMEOUT: Duration = Duration::from_secs(1);

pub(super) async fn run(
    listener: TcpListener,
    ctx: Arc<NodeContext>,
    opts: RespOptions,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), RespError> {
    if opts.max_value == 0 || opts.max_connections == 0 {
        return Err(RespError::Config(
            "max-value and max-connections must be at least 1".into(),
        ));
    }
    let port = listener
        .local_addr()
        .map_err(|source| RespError::Io {
            op: "read the listen address",
            source,
        })?
        .port();
    let permits = Arc::new(Semaphore::new(opts.max_connections));
    let shared = Arc::new(Shared::new(ctx, opts, port));
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut tasks = JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
            acc = listener.accept() => match acc {
                Ok((sock, _peer)) => {
                    NodeCounters::inc(&shared.ctx.counters.connections);
                    NodeCounters::inc(&shared.ctx.counters.resp_connections);
                    let mut stop = stop_rx.clone();
                    match Arc::clone(&permits).try_acquire_owned() {
                        Ok(permit) => {
                            let shared = Arc::clone(&shared);
                            tasks.spawn(async move {
                                tokio::select! {
                                    r = connection(&shared, sock) => {
                                        if let Err(e) = r {
                                            tracing::debug!(error = %e, "RESP connection ended");
                                        }
                                    }
                                    _ = stop.wait_for(|s| *s) => {}
                                }
                                drop(permit);
                            });
                        }
                        Err(_) => {
                            tasks.spawn(async move {
                                let mut sock = sock;
                                let _ = tokio::time::timeout(
                                    REJECT_TIMEOUT,
                                    sock.write_all(b"-ERR max number of clients reached\r\n"),
                                )
                                .await;
                            });
                        }
                    }
                }
                Err(e) => {
                    // EMFILE and the like: transient; back off instead of spinning.
                    tracing::warn!(error = %e, "RESP accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
        }
    }
    let _ = stop_tx.send(true);
    while tasks.join_next().await.is_some() {}
    Ok(())
}

/// The slowest average rate a large value may arrive at, in bytes per
/// second, beyond its first `value_timeout` (see the value's receive).
const MIN_VALUE_RATE: f64 = (1u64 << 20) as f64;

/// How a large value's receive ended.
enum Received {
    Value(Bytes),
    /// The client closed the connection.
    Eof,
    /// No bytes for `value_timeout`, or too slow on average.
    Stalled,
}

/// A large value's share of [`Shared::receiving`], given back when dropped.
struct Receiving<'a>(&'a Shared, usize);

impl<'a> Receiving<'a> {
    fn take(shared: &'a Shared, len: usize) -> Option<Self> {
        let before = shared.receiving.fetch_add(len, Ordering::Relaxed);
        if before + len > shared.receiving_max {
            shared.receiving.fetch_sub(len, Ordering::Relaxed);
            return None;
        }
        Some(Self(shared, len))
    }
}

impl Drop for Receiving<'_> {
    fn drop(&mut self) {
        self.0.receiving.fetch_sub(self.1, Ordering::Relaxed);
    }
}

struct ClientGuard<'a>(&'a Shared);

impl Drop for ClientGuard<'_> {
    fn drop(&mut self) {
        self.0.clients.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Writes every queued reply. While the client is not reading them, keeps
/// reading its requests into `rbuf` (up to [`READ_AHEAD_MAX`] bytes), so a
/// client that writes a long pipeline before it reads the replies cannot
/// deadlock the connection.
async fn flush(sock: &TcpStream, out: &mut Output, rbuf: &mut BytesMut) -> io::Result<()> {
    let mut eof = false;
    while !out.is_empty() {
        let res = {
            let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(MAX_IOV);
            out.io_slices(&mut slices, MAX_IOV);
            sock.try_write_vectored(&slices)
        };
        match res {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => {
                out.advance(n);
                continue;
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
        let read_ahead = !eof && rbuf.len() < READ_AHEAD_MAX;
        tokio::select! {
            r = sock.writable() => r?,
            r = sock.readable(), if read_ahead => {
                r?;
                rbuf.reserve(READ_BUF);
                match sock.try_read_buf(rbuf) {
                    Ok(0) => eof = true,
                    Ok(_) => {}
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) => return Err(e),
                }
            }
        }
    }
    Ok(())
}

async fn connection(shared: &Shared, mut sock: TcpStream) -> io::Result<()> {
    shared.clients.fetch_add(1, Ordering::Relaxed);
    let _guard = ClientGuard(shared);
    sock.set_nodelay(true)?;
    let max_value = shared.opts.max_value;
    let mut session = Session::new(shared);
    let mut parser = RequestParser::new(max_value);
    if !session.authenticated {
        parser.set_limits(UNAUTH_MAX_ARGS, UNAUTH_MAX_BULK.min(max_value));
    }
    let mut rbuf = BytesMut::with_capacity(READ_BUF);
    let mut out = Output::default();
    loop {
        // Pins past their time go here too: a connection whose pipeline
        // keeps bytes arriving never waits in the read below (review).
        session.drop_old_pins();
        loop {
            match parser.parse(&mut rbuf) {
                Ok(Parsed::Command(args)) => {
                    let was_authenticated = session.authenticated;
                    execute(shared, &mut session, args, &mut out).await;
                    if !was_authenticated && session.authenticated {
                        parser.set_limits(MAX_ARGS, max_value);
                    }
                    if session.close {
                        flush(&sock, &mut out, &mut rbuf).await?;
                        return Ok(());
                    }
                    if out.pending() >= FLUSH_AT {
                        flush(&sock, &mut out, &mut rbuf).await?;
                    }
                }
                Ok(Parsed::Incomplete) => break,
                Ok(Parsed::DirectBulk(len)) => {
                    flush(&sock, &mut out, &mut rbuf).await?;
                    let Some(receiving) = Receiving::take(shared, len + 2) else {
                        NodeCounters::inc(&shared.ctx.counters.resp_errors);
                        out.error(format!(
                            "the server is receiving {} MiB of large values over all connections \
                             (at most {} MiB); closing this connection, try again",
                            shared.receiving.load(Ordering::Relaxed) >> 20,
                            shared.receiving_max >> 20
                        ));
                        flush(&sock, &mut out, &mut BytesMut::new()).await?;
                        let _ = sock.shutdown().await;
                        return Ok(());
                    };
                    // Read the payload straight into a buffer of its exact
                    // size; a large one from the store's pool (the memory
                    // of a dropped chunk, not fresh pages).
                    let total = len + 2;
                    let from_buf = rbuf.len().min(total);
                    // Each read must bring bytes within `value_timeout` (a
                    // client that stops sending gives its share back), and
                    // the whole value must average at least
                    // MIN_VALUE_RATE (one that trickles a byte now and then
                    // would hold it for ever).
                    let idle = shared.opts.value_timeout;
                    let whole = idle + Duration::from_secs_f64(total as f64 / MIN_VALUE_RATE);
                    let receive = async {
                        io::Result::Ok(if total >= POOL_MIN {
                            let mut data = shared.ctx.store.buffers().filler(total);
                            data.extend_from_slice(&rbuf.split_to(from_buf));
                            while !data.is_full() {
                                match tokio::time::timeout(idle, sock.read(data.unfilled())).await {
                                    Err(_) => return Ok(Received::Stalled),
                                    Ok(r) => match r? {
                                        0 => return Ok(Received::Eof),
                                        n => data.advance(n),
                                    },
                                }
                            }
                            Received::Value(data.freeze())
                        } else {
                            let mut data = BytesMut::with_capacity(total);
                            data.extend_from_slice(&rbuf.split_to(from_buf));
                            while data.len() < total {
                                match tokio::time::timeout(idle, sock.read_buf(&mut data)).await {
                                    Err(_) => return Ok(Received::Stalled),
                                    Ok(r) => {
                                        if r? == 0 {
                                            return Ok(Received::Eof);
                                        }
                                    }
                                }
                            }
                            Received::Value(data.freeze())
                        })
                    };
                    let received = match tokio::time::timeout(whole, receive).await {
                        Ok(r) => r?,
                        Err(_) => Received::Stalled,
                    };
                    let data = match received {
                        Received::Value(data) => data,
                        Received::Eof => return Ok(()),
                        Received::Stalled => {
                            // Given back before the client hears of it.
                            drop(receiving);
                            NodeCounters::inc(&shared.ctx.counters.resp_errors);
                            out.error(format!(
                                "a value of {len} bytes stalled (nothing for {} s, or slower than \
                                 1 MiB/s on average); closing this connection",
                                idle.as_secs_f64()
                            ));
                            flush(&sock, &mut out, &mut BytesMut::new()).await?;
                            let _ = sock.shutdown().await;
                            return Ok(());
                        }
                    };
                    drop(receiving);
                    if let Err(e) = parser.finish_direct(data) {
                        return protocol_error(shared, &mut sock, &mut out, &e).await;
                    }
                }
                Err(e) => return protocol_error(shared, &mut sock, &mut out, &e).await,
            }
        }
        // Commands read ahead while the replies waited are parsed before
        // waiting for more input (the client may send nothing more until
        // it has their replies).
        let buffered = rbuf.len();
        flush(&sock, &mut out, &mut rbuf).await?;
        if rbuf.len() > buffered {
            continue;
        }
        if rbuf.capacity() - rbuf.len() < READ_BUF / 4 {
            rbuf.reserve(READ_BUF);
        }
        // Between commands, read at most FIRST_READ: a large value's head
        // that lands in the read buffer is copied once more into the
        // value's own buffer (the rest is read straight into it), so the
        // first read should not take in more of it than needed.
        let read = async {
            if rbuf.is_empty() {
                sock.read_buf(&mut (&mut rbuf).limit(FIRST_READ)).await
            } else {
                sock.read_buf(&mut rbuf).await
            }
        };
        // Pins (a positive EXISTS's bytes) go when their time is up, also
        // on a connection that sends nothing more: the wait ends then, and
        // the loop's top drops them (reads are cancel-safe).
        let n = match session.pins_expire_in() {
            None => read.await?,
            Some(left) => match tokio::time::timeout(left, read).await {
                Ok(r) => r?,
                Err(_) => continue,
            },
        };
        if n == 0 {
            return Ok(());
        }
    }
}

async fn protocol_error(
    shared: &Shared,
    sock: &mut TcpStream,
    out: &mut Output,
    e: &super::parser::ProtocolError,
) -> io::Result<()> {
    NodeCounters::inc(&shared.ctx.counters.resp_errors);
    out.error(format!("Protocol error: {e}"));
    flush(sock, out, &mut BytesMut::new()).await?;
    let _ = sock.shutdown().await;
    Ok(())
}
