//! The HTTP endpoint over real TCP on 127.0.0.1: /healthz, /metrics
//! (Prometheus text reflecting real store activity), /status and the
//! refusals (404, 405, 400, 431).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use node::NodeContext;
use tier::{ChunkId, ChunkKey, ChunkStore, NamespaceRecord, TierConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const T: Duration = Duration::from_secs(10);

/// The whole response to `raw`, status line and headers included.
async fn request_text(addr: SocketAddr, raw: &[u8]) -> String {
    let mut c = TcpStream::connect(addr).await.expect("connect");
    let _ = c.write_all(raw).await;
    let mut out = Vec::new();
    tokio::time::timeout(T, c.read_to_end(&mut out))
        .await
        .expect("response in time")
        .expect("read");
    String::from_utf8(out).expect("utf8")
}

async fn request(addr: SocketAddr, raw: &[u8]) -> (u16, String) {
    let text = request_text(addr, raw).await;
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("status line in {text:?}"));
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}

async fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    request(
        addr,
        format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes(),
    )
    .await
}

fn metric(body: &str, name: &str) -> f64 {
    body.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|rest| rest.strip_prefix(' ')))
        .unwrap_or_else(|| panic!("{name} missing in\n{body}"))
        .trim()
        .parse()
        .expect("number")
}

/// A RAM-only store of `ram_budget` bytes behind `node::http::serve` on
/// 127.0.0.1, stopped by [`HttpServer::stop`].
struct HttpServer {
    _dir: tempfile::TempDir,
    store: Arc<ChunkStore>,
    ctx: Arc<NodeContext>,
    addr: SocketAddr,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<(), node::http::HttpError>>,
}

impl HttpServer {
    async fn start(name: &str, ram_budget: u64) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let cfg = TierConfig {
            data_dir: dir.path().to_path_buf(),
            ram_budget,
            disk_budget: 0,
            ..TierConfig::default()
        };
        let store = Arc::new(ChunkStore::open(cfg).expect("open"));
        let ctx = Arc::new(NodeContext::new(Arc::clone(&store), name.into()));
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (stop, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(node::http::serve(listener, Arc::clone(&ctx), async {
            let _ = rx.await;
        }));
        Self {
            _dir: dir,
            store,
            ctx,
            addr,
            stop,
            task,
        }
    }

    /// Stops the server; it must return cleanly, in time.
    async fn stop(self) {
        let _ = self.stop.send(());
        tokio::time::timeout(T, self.task)
            .await
            .expect("serve returns")
            .expect("join")
            .expect("serve ok");
    }
}

#[tokio::test]
async fn metrics_status_and_health() {
    let server = HttpServer::start("metrics-node", 64 << 20).await;
    let (store, ctx, addr) = (&server.store, &server.ctx, server.addr);

    let (st, body) = get(addr, "/healthz").await;
    assert_eq!((st, body.as_str()), (200, "ok\n"));

    // Real activity: one put, two hits, one miss.
    let rec = NamespaceRecord {
        model: "m".into(),
        engine: "test".into(),
        ..Default::default()
    };
    let ns = ctx.register_namespace(&rec).expect("register");
    let id = ChunkId::new(ns, ChunkKey::from_name(b"a"), 0);
    store.put(id, Bytes::from(vec![7u8; 1000])).expect("put");
    assert!(ctx.get(id, None).await.is_some());
    assert!(ctx.get(id, None).await.is_some());
    assert!(
        ctx.get(ChunkId::new(ns, ChunkKey::from_name(b"b"), 0), None)
            .await
            .is_none()
    );

    let (st, body) = get(addr, "/metrics").await;
    assert_eq!(st, 200);
    assert_eq!(metric(&body, "kvtier_hits_total{tier=\"ram\"}"), 2.0);
    assert_eq!(metric(&body, "kvtier_misses_total"), 1.0);
    assert_eq!(metric(&body, "kvtier_puts_total"), 1.0);
    assert_eq!(metric(&body, "kvtier_bytes_in_total"), 1000.0);
    assert_eq!(metric(&body, "kvtier_bytes_out_total"), 2000.0);
    // The payload and the bookkeeping RAM charges it.
    let charged = 1000 + node::tier::ram::ENTRY_COST;
    assert_eq!(metric(&body, "kvtier_ram_bytes"), charged as f64);
    for name in [
        "kvtier_hits_total{tier=\"disk\"}",
        "kvtier_evictions_total{kind=\"ram\"}",
        "kvtier_evictions_total{kind=\"region\"}",
        "kvtier_dirty_bytes",
        "kvtier_writer_queue_depth",
        "kvtier_dropped_unwritten_total",
        "kvtier_lost_writes_total",
        "kvtier_disk_write_failures_total",
        "kvtier_verify_failures_total",
        "kvtier_recovery_seconds",
        "kvtier_uptime_seconds",
        "kvtier_requests_total{interface=\"resp\"}",
        "kvtier_request_errors_total{interface=\"native\"}",
        "kvtier_connections_total",
    ] {
        metric(&body, name);
    }
    // No Accept header: the classic text format 0.0.4 (a counter's TYPE
    // names its `_total` samples, no `# EOF`); a 0.0.4 parser typed every
    // counter as unknown in the OpenMetrics text.
    assert!(body.contains("# TYPE kvtier_hits_total counter"), "{body}");
    assert!(body.contains("# HELP kvtier_hits_total "), "{body}");
    assert!(!body.contains("# EOF"), "{body}");
    let text = request_text(
        addr,
        b"GET /metrics HTTP/1.1\r\nAccept: text/plain;version=0.0.4;q=0.3,*/*;q=0.2\r\n\r\n",
    )
    .await;
    assert!(
        text.contains("Content-Type: text/plain; version=0.0.4"),
        "{text}"
    );
    // What Prometheus asks for: OpenMetrics.
    let text = request_text(
        addr,
        b"GET /metrics HTTP/1.1\r\nAccept: application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5\r\n\r\n",
    )
    .await;
    assert!(
        text.contains("Content-Type: application/openmetrics-text"),
        "{text}"
    );
    assert!(text.contains("# TYPE kvtier_hits counter"), "{text}");
    assert!(text.ends_with("# EOF\n"), "{text}");
    let classic = text.split_once("\r\n\r\n").expect("body").1;
    assert_eq!(
        node::http::classic_text(classic)
            .lines()
            .filter(|l| !l.starts_with('#'))
            .count(),
        classic.lines().filter(|l| !l.starts_with('#')).count(),
        "the same samples in both formats"
    );

    let (st, body) = get(addr, "/status").await;
    assert_eq!(st, 200);
    let v: serde_json::Value = serde_json::from_str(&body).expect("json");
    assert_eq!(v["node"], "metrics-node");
    assert_eq!(v["version"], env!("CARGO_PKG_VERSION"));
    assert_eq!(v["store"]["hits_ram"], 2);
    assert_eq!(v["namespaces"][0]["record"]["model"], "m");
    assert_eq!(v["namespaces"][0]["chunks"], 1);

    let (st, _) = get(addr, "/nope").await;
    assert_eq!(st, 404);
    let text = request_text(addr, b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n").await;
    assert!(text.starts_with("HTTP/1.1 405 "), "{text}");
    let head = text.split_once("\r\n\r\n").map_or("", |(h, _)| h);
    assert!(head.contains("\r\nAllow: GET, HEAD"), "{text}");
    let (st, body) = request(addr, b"HEAD /healthz HTTP/1.1\r\n\r\n").await;
    assert_eq!((st, body.as_str()), (200, ""));
    let (st, _) = request(addr, b"\x16\x03\x01garbage\r\n\r\n").await;
    assert_eq!(st, 400);
    let mut huge = b"GET /metrics HTTP/1.1\r\nX: ".to_vec();
    huge.extend(vec![b'a'; 10_000]);
    let (st, _) = request(addr, &huge).await;
    assert_eq!(st, 431);

    server.stop().await;
}

/// QA: past 64 connections a new one was dropped without a word, so a few
/// dozen idle clients made /healthz, /metrics and /status unreachable. Now
/// the cap is [`node::http::MAX_CONNECTIONS`] (1024), and a connection past
/// it gets a 503 with `Connection: close`; once some close, requests are
/// served again.
#[tokio::test]
async fn past_the_connection_cap_a_503_not_a_reset() {
    // Both ends live in this process: about 2,100 descriptors, past a
    // shell's usual soft limit of 1,024.
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid pointer to a local struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
    if lim.rlim_cur < 2_400 {
        eprintln!("SKIPPED: the open-file limit ({}) is too low", lim.rlim_cur);
        return;
    }
    let server = HttpServer::start("cap-node", 16 << 20).await;
    let addr = server.addr;

    // Idle connections (no request: each waits for its head, up to 5 s).
    // The server accepts in order, so a request sent after them is
    // accepted after all of them.
    let mut idle = Vec::new();
    for _ in 0..100 {
        idle.push(TcpStream::connect(addr).await.expect("connect"));
    }
    let (st, body) = get(addr, "/healthz").await;
    assert_eq!((st, body.as_str()), (200, "ok\n"), "100 idle connections");
    while idle.len() < node::http::MAX_CONNECTIONS {
        idle.push(TcpStream::connect(addr).await.expect("connect"));
    }
    let text = request_text(addr, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n").await;
    assert!(
        text.starts_with("HTTP/1.1 503 Service Unavailable\r\n"),
        "{text:?}"
    );
    assert!(text.contains("\r\nConnection: close\r\n"), "{text:?}");
    // Room again once some close.
    idle.truncate(10);
    let t0 = std::time::Instant::now();
    loop {
        let (st, _) = get(addr, "/healthz").await;
        if st == 200 {
            break;
        }
        assert!(
            t0.elapsed() < T,
            "still {st} after the idle connections closed"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    drop(idle);
    server.stop().await;
}
