//! The HTTP endpoint: Prometheus metrics on `/metrics`, a JSON snapshot on
//! `/status` and a liveness probe on `/healthz`.
//!
//! A deliberately small HTTP/1.1 server (GET and HEAD only, one request per
//! connection, bounded request head, bounded time): it serves scrapers and
//! operators on 127.0.0.1, not the data path. Metrics are encoded with the
//! `prometheus-client` crate from a snapshot taken at scrape time.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::NodeContext;

/// Largest request head accepted (request line + headers).
pub const MAX_REQUEST_HEAD: usize = 8 * 1024;
/// Time a client has to send its request head.
const READ_TIMEOUT: Duration = Duration::from_secs(5);
/// Time allowed to write a response.
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// Most HTTP connections served at once (as RESP's default
/// `max-connections`); one past it is answered 503 and closed.
pub const MAX_CONNECTIONS: usize = 1024;
/// Connections being refused (503) at once; past it one is closed unanswered.
const MAX_REFUSING: usize = 64;
/// Time a refused connection has to take its 503.
const REFUSE_TIMEOUT: Duration = Duration::from_secs(1);
/// The body of the answer past [`MAX_CONNECTIONS`].
const BUSY_BODY: &str = "too many HTTP connections: try again later\n";

/// Errors of the HTTP endpoint.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HttpError {
    /// The listener failed.
    #[error("HTTP listener I/O error while trying to {op}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

/// Serves `/metrics`, `/status` and `/healthz` on `listener` until
/// `shutdown` completes; returns after every connection task has finished.
pub async fn serve(
    listener: TcpListener,
    ctx: Arc<NodeContext>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), HttpError> {
    let mut registry = Registry::with_prefix("kvtier");
    registry.register_collector(Box::new(NodeCollector {
        ctx: Arc::clone(&ctx),
    }));
    let registry = Arc::new(registry);
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut tasks = JoinSet::new();
    let mut refusing = JoinSet::new();
    // Whether this episode at the cap was logged (QA: idle connections
    // that filled the cap made /healthz, /metrics and /status unreachable,
    // each new connection reset without a word).
    let mut at_cap_logged = false;
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
            Some(_) = refusing.join_next(), if !refusing.is_empty() => {}
            acc = listener.accept() => match acc {
                Ok((sock, _)) => {
                    if tasks.len() >= MAX_CONNECTIONS {
                        if !at_cap_logged {
                            at_cap_logged = true;
                            tracing::warn!(
                                max = MAX_CONNECTIONS,
                                "HTTP endpoint at its connection limit: new connections get 503 \
                                 until some close (logged once until it is below the limit again)"
                            );
                        }
                        if refusing.len() < MAX_REFUSING {
                            refusing.spawn(refuse(sock));
                        }
                        continue;
                    }
                    at_cap_logged = false;
                    let (ctx, registry, mut stop) = (Arc::clone(&ctx), Arc::clone(&registry), stop_rx.clone());
                    tasks.spawn(async move {
                        tokio::select! {
                            r = handle(sock, ctx, registry) => {
                                if let Err(e) = r {
                                    tracing::debug!(error = %e, "HTTP connection ended");
                                }
                            }
                            _ = stop.wait_for(|s| *s) => {}
                        }
                    });
                }
                Err(e) => {
                    tracing::warn!(error = %e, "HTTP accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
        }
    }
    let _ = stop_tx.send(true);
    refusing.abort_all();
    while tasks.join_next().await.is_some() {}
    while refusing.join_next().await.is_some() {}
    Ok(())
}

/// Answers a connection past [`MAX_CONNECTIONS`] with a 503, then waits
/// (bounded) for the client to close, reading what it sent: closing with
/// its request unread would reset the connection, and the client could
/// lose the answer.
async fn refuse(mut sock: TcpStream) {
    let resp = format!(
        "HTTP/1.1 503 {}\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {}\r\n\
         Retry-After: 5\r\nConnection: close\r\n\r\n{BUSY_BODY}",
        reason(503),
        BUSY_BODY.len()
    );
    let _ = tokio::time::timeout(REFUSE_TIMEOUT, async {
        sock.write_all(resp.as_bytes()).await?;
        sock.shutdown().await?;
        let mut sink = [0u8; 1024];
        while sock.read(&mut sink).await? > 0 {}
        std::io::Result::Ok(())
    })
    .await;
}

/// A parsed request line.
#[derive(Debug, PartialEq, Eq)]
pub struct Request {
    /// `GET`, `HEAD`, ...
    pub method: String,
    /// The path without the query string.
    pub path: String,
    /// The `Accept` header names OpenMetrics (as Prometheus's does): else
    /// `/metrics` answers in the classic text format 0.0.4.
    pub openmetrics: bool,
}

/// Why a request head is refused.
#[derive(Debug, PartialEq, Eq)]
pub enum HeadError {
    /// More bytes are needed.
    Incomplete,
    /// The head is longer than [`MAX_REQUEST_HEAD`].
    TooLarge,
    /// Not an HTTP/1.x request line.
    Malformed,
}

/// Where the head in `buf` ends: the length of its lines (the last line
/// break included) and of the head with the empty line after it. Lines end
/// with CRLF or a bare LF (RFC 9112 lets a server accept the latter: a
/// request typed into `nc` has them, and waited for the read timeout).
fn head_end(buf: &[u8]) -> Option<(usize, usize)> {
    let mut from = 0;
    while let Some(i) = buf[from..].iter().position(|&b| b == b'\n') {
        let i = from + i;
        match &buf[i + 1..] {
            [b'\n', ..] => return Some((i + 1, i + 2)),
            [b'\r', b'\n', ..] => return Some((i + 1, i + 3)),
            _ => from = i + 1,
        }
    }
    None
}

/// Parses an HTTP/1.x request head (the request line and the `Accept`
/// header; other headers are skipped but must be complete).
pub fn parse_head(buf: &[u8]) -> Result<Request, HeadError> {
    let Some((end, len)) = head_end(buf) else {
        return Err(if buf.len() >= MAX_REQUEST_HEAD {
            HeadError::TooLarge
        } else {
            HeadError::Incomplete
        });
    };
    if len > MAX_REQUEST_HEAD {
        return Err(HeadError::TooLarge);
    }
    let head = std::str::from_utf8(&buf[..end]).map_err(|_| HeadError::Malformed)?;
    let line = head.lines().next().ok_or(HeadError::Malformed)?;
    let mut parts = line.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(HeadError::Malformed);
    };
    if !version.starts_with("HTTP/1.") || method.is_empty() || !target.starts_with('/') {
        return Err(HeadError::Malformed);
    }
    let path = target.split('?').next().unwrap_or(target);
    let accept: Vec<&str> = head
        .lines()
        .skip(1)
        .filter_map(|l| {
            let (name, value) = l.split_once(':')?;
            name.trim().eq_ignore_ascii_case("accept").then_some(value)
        })
        .collect();
    let openmetrics = prefers_openmetrics(&accept.join(","));
    Ok(Request {
        method: method.to_owned(),
        path: path.to_owned(),
        openmetrics,
    })
}

/// Whether an `Accept` header value (several headers joined with commas)
/// prefers OpenMetrics to the classic text format: the highest q-value
/// wins (RFC 9110: a missing q is 1, `q=0` refuses), and a tie goes to
/// OpenMetrics, which must be named (`text/plain`, `text/*` and `*/*` stand
/// for the classic format). QA: `text/plain;q=1,application/openmetrics-text;q=0.1`
/// got OpenMetrics, because any mention of it did.
pub fn prefers_openmetrics(accept: &str) -> bool {
    let (mut om, mut classic) = (0.0f32, 0.0f32);
    for range in accept.split(',') {
        let mut parts = range.split(';');
        let media = parts.next().unwrap_or("").trim().to_ascii_lowercase();
        let q = parts
            .filter_map(|p| p.split_once('='))
            .find(|(k, _)| k.trim().eq_ignore_ascii_case("q"))
            .map_or(1.0, |(_, v)| {
                v.trim().parse::<f32>().unwrap_or(0.0).clamp(0.0, 1.0)
            });
        match media.as_str() {
            "application/openmetrics-text" => om = om.max(q),
            "text/plain" | "text/*" | "*/*" => classic = classic.max(q),
            _ => {}
        }
    }
    om > 0.0 && om >= classic
}

/// A response: status, content type, body.
#[derive(Debug)]
pub struct Response {
    /// Status code.
    pub status: u16,
    /// Content-Type header value.
    pub content_type: &'static str,
    /// The body.
    pub body: Vec<u8>,
}

fn text(status: u16, body: &str) -> Response {
    Response {
        status,
        content_type: "text/plain; charset=utf-8",
        body: body.as_bytes().to_vec(),
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        431 => "Request Header Fields Too Large",
        503 => "Service Unavailable",
        _ => "Internal Server Error",
    }
}

/// The OpenMetrics text of this registry in the classic Prometheus text
/// format 0.0.4, for scrapers that ask for no OpenMetrics: a counter
/// family's HELP and TYPE lines name its `_total` samples, and the `# EOF`
/// and `# UNIT` lines go (a 0.0.4 parser typed every counter as unknown).
/// Samples are the same in both.
pub fn classic_text(openmetrics: &str) -> String {
    let counters: std::collections::HashSet<&str> = openmetrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE ")?.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(openmetrics.len() + 16 * counters.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let meta = ["# HELP ", "# TYPE "]
            .into_iter()
            .find_map(|p| Some((p, line.strip_prefix(p)?)));
        match meta {
            Some((prefix, rest)) => {
                let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
                out.push_str(prefix);
                out.push_str(name);
                if counters.contains(name) {
                    out.push_str("_total");
                }
                if !tail.is_empty() {
                    out.push(' ');
                    out.push_str(tail);
                }
            }
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

/// Answers one request (no I/O).
pub fn respond(req: &Request, ctx: &NodeContext, registry: &Registry) -> Response {
    if req.method != "GET" && req.method != "HEAD" {
        return text(405, "only GET and HEAD are supported\n");
    }
    match req.path.as_str() {
        "/healthz" => text(200, "ok\n"),
        "/metrics" => {
            let mut body = String::new();
            match prometheus_client::encoding::text::encode(&mut body, registry) {
                Ok(()) if req.openmetrics => Response {
                    status: 200,
                    content_type: "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    body: body.into_bytes(),
                },
                Ok(()) => Response {
                    status: 200,
                    content_type: "text/plain; version=0.0.4; charset=utf-8",
                    body: classic_text(&body).into_bytes(),
                },
                Err(_) => text(500, "encoding metrics failed\n"),
            }
        }
        "/status" => match serde_json::to_vec_pretty(&status_json(ctx)) {
            Ok(mut body) => {
                body.push(b'\n');
                Response {
                    status: 200,
                    content_type: "application/json",
                    body,
                }
            }
            Err(_) => text(500, "encoding status failed\n"),
        },
        _ => text(404, "not found: try /metrics, /status or /healthz\n"),
    }
}

/// The `/status` document.
pub fn status_json(ctx: &NodeContext) -> serde_json::Value {
    let c = &ctx.counters;
    serde_json::json!({
        "node": ctx.node_name,
        "version": env!("CARGO_PKG_VERSION"),
        "uptime_seconds": ctx.started.elapsed().as_secs_f64(),
        "store": ctx.store.stats(),
        "namespaces": ctx.store.namespace_listing(),
        "peers": ctx.peers_json(),
        "served_unlisted": ctx.served_unlisted_json(),
        "peer_corrupt_replies": ctx.peer_corrupt_replies(),
        "requests": {
            "native": c.native_requests.load(Ordering::Relaxed),
            "native_errors": c.native_errors.load(Ordering::Relaxed),
            "native_abandoned": c.native_abandoned.load(Ordering::Relaxed),
            "resp": c.resp_commands.load(Ordering::Relaxed),
            "resp_errors": c.resp_errors.load(Ordering::Relaxed),
            "connections": c.connections.load(Ordering::Relaxed),
        },
    })
}

async fn write_response(
    sock: &mut TcpStream,
    resp: &Response,
    head_only: bool,
) -> std::io::Result<()> {
    // RFC 9110: a 405 lists the methods the resource supports.
    let allow = if resp.status == 405 {
        "Allow: GET, HEAD\r\n"
    } else {
        ""
    };
    let head = format!(
        "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\n{allow}Connection: close\r\n\r\n",
        resp.status,
        reason(resp.status),
        resp.content_type,
        resp.body.len()
    );
    let write = async {
        sock.write_all(head.as_bytes()).await?;
        if !head_only {
            sock.write_all(&resp.body).await?;
        }
        sock.shutdown().await
    };
    tokio::time::timeout(WRITE_TIMEOUT, write)
        .await
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))?
}

async fn handle(
    mut sock: TcpStream,
    ctx: Arc<NodeContext>,
    registry: Arc<Registry>,
) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(1024);
    let read = async {
        let mut chunk = [0u8; 1024];
        loop {
            match parse_head(&buf) {
                Err(HeadError::Incomplete) => {}
                other => return Ok(other),
            }
            let n = sock.read(&mut chunk).await?;
            if n == 0 {
                return Ok(Err(HeadError::Malformed));
            }
            buf.extend_from_slice(&chunk[..n]);
        }
    };
    let parsed: std::io::Result<Result<Request, HeadError>> =
        match tokio::time::timeout(READ_TIMEOUT, read).await {
            Ok(r) => r,
            Err(_) => {
                return write_response(
                    &mut sock,
                    &text(408, "request head not received in time\n"),
                    false,
                )
                .await;
            }
        };
    let (resp, head_only) = match parsed? {
        Ok(req) => {
            let head_only = req.method == "HEAD";
            // `/status` lists every namespace with its chunk counts (a walk
            // over the indexes, O(chunks)): never on a runtime worker.
            let resp = tokio::task::spawn_blocking(move || respond(&req, &ctx, &registry))
                .await
                .unwrap_or_else(|_| text(500, "the request's task failed\n"));
            (resp, head_only)
        }
        Err(HeadError::TooLarge) => (text(431, "request head too large\n"), false),
        Err(_) => (text(400, "malformed HTTP request\n"), false),
    };
    write_response(&mut sock, &resp, head_only).await
}

/// Encodes the node's counters and gauges at scrape time.
struct NodeCollector {
    ctx: Arc<NodeContext>,
}

impl std::fmt::Debug for NodeCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeCollector")
            .field("node", &self.ctx.node_name)
            .finish()
    }
}

fn counter<N: prometheus_client::encoding::EncodeCounterValue>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    v: N,
) -> Result<(), std::fmt::Error> {
    let m = ConstCounter::new(v);
    let me = enc.encode_descriptor(name, help, None, m.metric_type())?;
    m.encode(me)
}

/// A gauge's value: a count or size past `i64::MAX` (a `ram-budget` of
/// u64::MAX) reads as `i64::MAX`, not as a negative number.
fn gauge_value(v: impl TryInto<i64>) -> i64 {
    v.try_into().unwrap_or(i64::MAX)
}

fn gauge<T: prometheus_client::encoding::EncodeGaugeValue>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    v: T,
) -> Result<(), std::fmt::Error> {
    let m = ConstGauge::new(v);
    let me = enc.encode_descriptor(name, help, None, m.metric_type())?;
    m.encode(me)
}

fn labeled_counter(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    label: &str,
    values: &[(&str, u64)],
) -> Result<(), std::fmt::Error> {
    let mut me = enc.encode_descriptor(name, help, None, MetricType::Counter)?;
    for (l, v) in values {
        let labels = [(label, *l)];
        let fam = me.encode_family(&labels)?;
        ConstCounter::new(*v).encode(fam)?;
    }
    Ok(())
}

impl Collector for NodeCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let s = self.ctx.store.stats();
        let c = &self.ctx.counters;
        let ld = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        labeled_counter(
            &mut enc,
            "hits",
            "Chunk reads served, by where the chunk was found",
            "tier",
            &[
                ("ram", s.hits_ram),
                ("disk", s.hits_disk),
                ("peer", s.hits_peer),
            ],
        )?;
        counter(
            &mut enc,
            "misses",
            "Chunk reads that found nothing (or failed verification)",
            s.misses,
        )?;
        counter(&mut enc, "puts", "Chunks stored", s.puts)?;
        counter(&mut enc, "bytes_in", "Payload bytes stored", s.bytes_in)?;
        counter(&mut enc, "bytes_out", "Payload bytes read", s.bytes_out)?;
        labeled_counter(
            &mut enc,
            "evictions",
            "Evictions: chunks dropped from RAM, regions reclaimed on disk",
            "kind",
            &[("ram", s.ram_evictions), ("region", s.region_evictions)],
        )?;
        counter(
            &mut enc,
            "dropped_unwritten",
            "Dirty chunks evicted from RAM without reaching disk (no-tax policy)",
            s.dropped_unwritten,
        )?;
        counter(
            &mut enc,
            "evicted_chunks",
            "Chunks that left this node to make room with no copy kept (RAM eviction without a disk copy, region reclaim of a chunk RAM did not hold)",
            s.evicted_chunks,
        )?;
        counter(
            &mut enc,
            "lost_writes",
            "Dirty chunks lost because their disk write failed after RAM evicted them",
            s.lost_writes,
        )?;
        counter(
            &mut enc,
            "disk_write_failures",
            "Chunk writes the disk writer failed (I/O error, no space, too big), each attempt counted: read it as a rate",
            s.disk_write_failures,
        )?;
        counter(
            &mut enc,
            "reclaimed_rewrites",
            "Chunks whose disk copy was reclaimed while RAM held them: marked dirty, written again",
            s.reclaimed_rewrites,
        )?;
        counter(
            &mut enc,
            "verify_failures",
            "Reads that failed verification (CRC, identity, length) or I/O",
            s.verify_failures,
        )?;
        counter(
            &mut enc,
            "damaged_metadata",
            "Region slots, summaries or batch records found damaged when the store opened",
            s.damaged_metadata,
        )?;
        counter(
            &mut enc,
            "disk_writes",
            "Chunks written to disk",
            s.disk_writes,
        )?;
        counter(
            &mut enc,
            "disk_write_bytes",
            "Bytes written to disk, headers and padding included",
            s.disk_write_bytes,
        )?;
        counter(
            &mut enc,
            "disk_reads",
            "Chunks read from disk (one each, however many pieces a large one is read in)",
            s.disk_reads,
        )?;
        counter(
            &mut enc,
            "disk_read_bytes",
            "Bytes chunk reads took from disk, headers and block padding included",
            s.disk_read_bytes,
        )?;
        counter(
            &mut enc,
            "disk_read_seconds",
            "Time chunk reads spent in disk reads",
            s.disk_read_micros as f64 / 1e6,
        )?;
        counter(
            &mut enc,
            "disk_write_seconds",
            "Time the disk writer spent writing batches",
            s.disk_write_micros as f64 / 1e6,
        )?;
        counter(
            &mut enc,
            "disk_batch_writes",
            "Batch writes of the disk writer (disk_write_bytes over this is the mean batch size)",
            s.disk_batch_writes,
        )?;
        counter(
            &mut enc,
            "disk_syncs",
            "fdatasyncs of the store file (flushes, region switches, and the writer's sync of what it wrote once its queue is empty: after 200 ms without work, or a second after the write)",
            s.disk_syncs,
        )?;
        counter(
            &mut enc,
            "disk_sync_seconds",
            "Time spent in those fdatasyncs",
            s.disk_sync_micros as f64 / 1e6,
        )?;
        counter(
            &mut enc,
            "buffer_pool_reused",
            "New chunks and disk reads that reused a dropped chunk's buffer",
            s.buffer_pool_reused,
        )?;
        counter(
            &mut enc,
            "buffer_pool_fresh",
            "New chunks of 1 MiB or more and disk reads that found no pooled buffer",
            s.buffer_pool_fresh,
        )?;
        gauge(
            &mut enc,
            "buffer_pool_bytes",
            "Bytes of dropped chunks' buffers kept for new chunks",
            gauge_value(s.buffer_pool_bytes),
        )?;
        gauge(
            &mut enc,
            "ram_chunks",
            "Chunks in RAM",
            gauge_value(s.ram_chunks),
        )?;
        gauge(
            &mut enc,
            "ram_bytes",
            "Bytes of chunks in RAM as the RAM budget charges them: payloads, stored names (RESP keys) and about 270 bytes of bookkeeping per chunk",
            gauge_value(s.ram_bytes),
        )?;
        gauge(
            &mut enc,
            "ram_budget_bytes",
            "RAM budget",
            gauge_value(s.ram_budget),
        )?;
        gauge(
            &mut enc,
            "dirty_bytes",
            "Bytes in RAM not yet written to disk (written chunks are durable within about a second, at once with a flush)",
            gauge_value(s.dirty_bytes),
        )?;
        gauge(
            &mut enc,
            "spilled_chunks",
            "Chunks evicted from RAM and not on disk yet (readable, outside the RAM budget)",
            gauge_value(s.spilled_chunks),
        )?;
        gauge(
            &mut enc,
            "spilled_bytes",
            "Bytes of chunks evicted from RAM and not on disk yet",
            gauge_value(s.spilled_bytes),
        )?;
        gauge(
            &mut enc,
            "disk_chunks",
            "Chunks on disk",
            gauge_value(s.disk_chunks),
        )?;
        gauge(
            &mut enc,
            "disk_bytes",
            "Payload bytes on disk",
            gauge_value(s.disk_bytes),
        )?;
        gauge(
            &mut enc,
            "disk_budget_bytes",
            "Disk budget",
            gauge_value(s.disk_budget),
        )?;
        gauge(
            &mut enc,
            "writer_queue_depth",
            "Messages queued for the disk writer, plus evictions waiting beside its full queue",
            gauge_value(s.writer_queue_depth),
        )?;
        gauge(
            &mut enc,
            "writer_paused_nospace",
            "1 while the disk writer is paused for lack of space",
            i64::from(s.writer_paused_nospace),
        )?;
        gauge(
            &mut enc,
            "recovery_seconds",
            "Time the last start spent rebuilding the index",
            s.recovery_micros as f64 / 1e6,
        )?;
        gauge(
            &mut enc,
            "uptime_seconds",
            "Time since the node started",
            self.ctx.started.elapsed().as_secs_f64(),
        )?;
        labeled_counter(
            &mut enc,
            "requests",
            "Requests served by each local interface",
            "interface",
            &[
                ("native", ld(&c.native_requests)),
                ("resp", ld(&c.resp_commands)),
            ],
        )?;
        labeled_counter(
            &mut enc,
            "request_errors",
            "Requests answered with an error, by interface",
            "interface",
            &[
                ("native", ld(&c.native_errors)),
                ("resp", ld(&c.resp_errors)),
            ],
        )?;
        counter(
            &mut enc,
            "native_abandoned_requests",
            "Native GETs dropped because their client hung up while their reads waited",
            ld(&c.native_abandoned),
        )?;
        counter(
            &mut enc,
            "connections",
            "Client connections accepted (all interfaces)",
            ld(&c.connections),
        )?;
        if let Some(cluster) = &self.ctx.cluster {
            cluster.encode_metrics(&mut enc)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// QA: `ram-budget` u64::MAX read as -1 in `/metrics`.
    #[test]
    fn gauges_past_i64_read_as_its_max() {
        assert_eq!(gauge_value(u64::MAX), i64::MAX);
        assert_eq!(gauge_value(7u64), 7);
    }

    #[test]
    fn parse_head_cases() {
        assert_eq!(
            parse_head(b"GET /metrics?x=1 HTTP/1.1\r\nHost: a\r\n\r\n"),
            Ok(Request {
                method: "GET".into(),
                path: "/metrics".into(),
                openmetrics: false,
            })
        );
        // Prometheus asks for OpenMetrics first.
        assert!(
            parse_head(
                b"GET /metrics HTTP/1.1\r\nACCEPT: application/openmetrics-text;version=1.0.0,text/plain;q=0.5\r\n\r\n"
            )
            .is_ok_and(|r| r.openmetrics)
        );
        assert!(
            parse_head(b"GET /metrics HTTP/1.1\r\nAccept: text/plain;version=0.0.4\r\n\r\n")
                .is_ok_and(|r| !r.openmetrics)
        );
        // Two Accept headers count as one list.
        assert!(
            parse_head(
                b"GET /metrics HTTP/1.1\r\nAccept: text/plain;q=0.2\r\nAccept: application/openmetrics-text;q=0.5\r\n\r\n"
            )
            .is_ok_and(|r| r.openmetrics)
        );
        assert_eq!(
            parse_head(b"GET /metrics HTTP/1.1\r\nHost"),
            Err(HeadError::Incomplete)
        );
        assert_eq!(parse_head(b"GARBAGE\r\n\r\n"), Err(HeadError::Malformed));
        // Bare LF line ends (typed into nc), alone or mixed with CRLF.
        for head in [
            &b"GET /healthz HTTP/1.1\nHost: a\n\n"[..],
            b"GET /healthz HTTP/1.0\n\n",
            b"GET /healthz HTTP/1.1\r\nHost: a\n\n",
            b"GET /healthz HTTP/1.1\nHost: a\r\n\r\n",
        ] {
            assert_eq!(
                parse_head(head).map(|r| r.path),
                Ok("/healthz".to_string()),
                "{head:?}"
            );
        }
        assert_eq!(
            parse_head(b"GET /healthz HTTP/1.1\nHost: a\n"),
            Err(HeadError::Incomplete)
        );
        assert_eq!(
            parse_head(b"GET /healthz HTTP/1.1\r\nHost: a\r\n\r"),
            Err(HeadError::Incomplete)
        );
        assert_eq!(
            parse_head(b"GET metrics HTTP/1.1\r\n\r\n"),
            Err(HeadError::Malformed)
        );
        assert_eq!(
            parse_head(b"GET / SPDY/3\r\n\r\n"),
            Err(HeadError::Malformed)
        );
        assert_eq!(
            parse_head(&vec![b'a'; MAX_REQUEST_HEAD]),
            Err(HeadError::TooLarge)
        );
    }

    /// QA: any mention of OpenMetrics got it, whatever its q-value.
    #[test]
    fn accept_q_values_decide_the_format() {
        for (accept, om) in [
            (
                "text/plain;version=0.0.4;q=1,application/openmetrics-text;q=0.1",
                false,
            ),
            (
                "application/openmetrics-text;version=1.0.0;q=0.1, text/plain;version=0.0.4",
                false,
            ),
            ("text/plain;q=0.5, application/openmetrics-text;q=0.6", true),
            // Prometheus 2.x and 3.x.
            (
                "application/openmetrics-text;version=1.0.0;q=0.5,application/openmetrics-text;version=0.0.1;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2",
                true,
            ),
            (
                "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.5,application/openmetrics-text;version=0.0.1;q=0.4,text/plain;version=1.0.0;escaping=allow-utf-8;q=0.3,text/plain;version=0.0.4;q=0.2,*/*;q=0.1",
                true,
            ),
            // A tie: OpenMetrics, as before q-values counted.
            ("application/openmetrics-text, text/plain", true),
            ("text/plain;q=0.5, application/openmetrics-text;q=0.5", true),
            ("application/openmetrics-text;q=0.3, */*;q=0.3", true),
            (
                "APPLICATION/OpenMetrics-Text ; Q=0.9, text/plain ; q=0.8",
                true,
            ),
            // Refused, or not named.
            ("application/openmetrics-text;q=0", false),
            ("application/openmetrics-text;q=0, */*", false),
            ("*/*", false),
            ("", false),
            ("text/html", false),
            ("application/openmetrics-text;q=bogus", false),
        ] {
            assert_eq!(prefers_openmetrics(accept), om, "{accept:?}");
        }
    }
}
