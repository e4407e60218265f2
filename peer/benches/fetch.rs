//! Peer fetch throughput against a raw quinn transfer with the same
//! transport settings and TLS, plus one TCP loopback stream for context,
//! all in the same run on 127.0.0.1.
//!
//! Each iteration moves `concurrency()` chunks of the given size, one stream
//! per chunk, all in flight at once. Both quinn paths copy the received
//! stream chunks into one buffer per chunk; the peer path also checks the
//! frame CRC, the id and the payload CRC32C.
//!
//! After the criterion groups, a summary pass alternates the paths
//! (`SUMMARY_ROUNDS` rounds, median) and prints GB/s and the ratios
//! peer / raw quinn (same settings), peer / TCP and peer / Redis GET per
//! chunk size, plus raw quinn with quinn's default transport settings,
//! the load average and the CPU seconds per GB of each path.
//!
//! Redis: `redis-server` from `KVTIER_REDIS_SERVER` or `PATH` is started on
//! a free loopback port (no persistence) and read with GET over one
//! connection, the same request/response pattern as the TCP path; without
//! it the Redis column says so.
//!
//! `KVTIER_BENCH_TUNING=default` uses `TransportTuning::default()` (initial
//! MTU 1200, discovery up to 6500) instead of the loopback tuning;
//! `KVTIER_BENCH_TUNING=N` uses `TransportTuning::path(N)` (N-byte
//! datagrams from the first packet). `KVTIER_BENCH_SUMMARY_ONLY=1` skips
//! the criterion groups.
//!
//! Scale: `KVTIER_BENCH_STREAMS` (chunks in flight per iteration, default
//! 4), `KVTIER_BENCH_PEER_CONNS` (the requester's
//! `PeerConfig::fetch_connections`, default 1: the raw quinn baseline is
//! one connection too) and `KVTIER_BENCH_WORKERS`
//! (tokio worker threads shared by both nodes and the baselines, default
//! 2). The TCP and Redis baselines stay one connection, one request at a
//! time.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use criterion::{BenchmarkId, Criterion, Throughput};
use peer::cert::{self, Validity};
use peer::tls::TlsSetup;
use peer::{
    ChunkBytes, ChunkSource, PeerChunkId, PeerConfig, PeerHandle, PeerNamespace, SourceFuture,
    TransportTuning,
};
use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::runtime::Runtime;

const SIZES: [usize; 3] = [256 << 10, 1 << 20, 4 << 20];
const SUMMARY_ROUNDS: usize = 5;
const SUMMARY_BYTES: usize = 256 << 20;

/// A positive integer from the environment variable `name`, else `default`.
fn env_count(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or(default)
}

/// Chunks in flight per iteration.
fn concurrency() -> usize {
    static N: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *N.get_or_init(|| env_count("KVTIER_BENCH_STREAMS", 4))
}

/// The requester's fetch connections (`KVTIER_BENCH_PEER_CONNS`, default 1).
fn peer_conns() -> u32 {
    env_count("KVTIER_BENCH_PEER_CONNS", 1) as u32
}

/// Tokio workers shared by both nodes and the baselines.
fn workers() -> usize {
    env_count("KVTIER_BENCH_WORKERS", 2)
}

fn tuning() -> TransportTuning {
    match std::env::var("KVTIER_BENCH_TUNING").as_deref() {
        Ok("default") => TransportTuning::default(),
        Ok(mtu) if mtu.parse::<u16>().is_ok() => {
            TransportTuning::path(mtu.parse().expect("checked"))
        }
        _ => TransportTuning::loopback(),
    }
}

fn tuning_name() -> String {
    std::env::var("KVTIER_BENCH_TUNING").unwrap_or_else(|_| "loopback (6500)".into())
}

fn payload(len: usize) -> Bytes {
    Bytes::from((0..len).map(|i| (i * 7 + 3) as u8).collect::<Vec<u8>>())
}

fn id(size: usize) -> PeerChunkId {
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&(size as u64).to_le_bytes());
    PeerChunkId {
        ns: PeerNamespace([1; 16]),
        key,
        group: 0,
    }
}

struct Source {
    chunks: Vec<(PeerChunkId, ChunkBytes)>,
}

impl ChunkSource for Source {
    fn read(&self, id: &PeerChunkId) -> SourceFuture {
        let c = self
            .chunks
            .iter()
            .find(|(k, _)| k == id)
            .map(|(_, c)| c.clone());
        Box::pin(async move { c })
    }
    fn snapshot(&self) -> Vec<(PeerChunkId, u64, bool)> {
        self.chunks
            .iter()
            .map(|(k, c)| (*k, c.payload.len() as u64, true))
            .collect()
    }
    fn namespace_records(&self) -> Vec<(PeerNamespace, Vec<u8>)> {
        Vec::new()
    }
}

struct Setup {
    rt: Runtime,
    // peer path
    b: PeerHandle,
    _a: PeerHandle,
    // raw quinn path
    raw: quinn::Connection,
    _raw_server: quinn::Endpoint,
    _raw_client: quinn::Endpoint,
    // the raw server's side of the connection (sender stats)
    raw_sender: Arc<parking_lot::Mutex<Option<quinn::Connection>>>,
    // raw quinn with quinn's default transport settings
    raw_default: quinn::Connection,
    _raw_default_eps: (quinn::Endpoint, quinn::Endpoint),
    // tcp path
    tcp_addr: SocketAddr,
}

fn setup() -> Setup {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers())
        .enable_all()
        .build()
        .expect("runtime");
    let ca = cert::init_ca("bench", Validity::days(1)).expect("ca");
    let tls = |n: &str| {
        TlsSetup::from_material(&cert::issue(&ca, n, &[], &[], Validity::days(1)).expect("issue"))
            .expect("tls")
    };
    let (ta, tb) = (tls("bench-a"), tls("bench-b"));
    let t = tuning();
    let chunks = SIZES
        .iter()
        .map(|&s| (id(s), ChunkBytes::new(payload(s))))
        .collect();
    let raw_sender = Arc::new(parking_lot::Mutex::new(None));
    let rsend = raw_sender.clone();
    let (a, b, raw, rs, rc, tcp_addr, raw_default) = rt.block_on(async {
        let cfg = PeerConfig {
            tuning: t,
            ..PeerConfig::default()
        };
        let a = PeerHandle::start(cfg.clone(), ta.clone(), Arc::new(Source { chunks }))
            .expect("start a");
        for s in SIZES {
            a.local_added(id(s), s as u64);
        }
        let b = PeerHandle::start(
            PeerConfig {
                peers: vec![a.local_addr().expect("addr").to_string()],
                fetch_connections: peer_conns(),
                max_fetches_per_peer: 16.max(concurrency() as u32),
                ..cfg.clone()
            },
            tb.clone(),
            Arc::new(Source { chunks: Vec::new() }),
        )
        .expect("start b");
        let deadline = Instant::now() + Duration::from_secs(20);
        let conns = peer_conns();
        while SIZES.iter().any(|&s| b.holders(&id(s)).is_empty())
            || b.peers().first().is_none_or(|p| p.connections < conns)
        {
            assert!(Instant::now() < deadline, "sync and {conns} connection(s)");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }

        // Raw quinn: same tuning, same TLS configs.
        let transport = Arc::new(t.transport_config(cfg.keep_alive, cfg.idle_timeout));
        let (rs, rc, raw) = raw_pair(
            &ta,
            &tb,
            transport,
            t.endpoint_config(),
            || {
                t.bind_socket("127.0.0.1:0".parse().expect("addr"))
                    .expect("bind")
            },
            Some(rsend),
        )
        .await;
        // Raw quinn with quinn's defaults (plain sockets, default configs).
        let mut dt = quinn::TransportConfig::default();
        dt.max_concurrent_bidi_streams(quinn::VarInt::from_u32(256));
        let raw_default = raw_pair(
            &ta,
            &tb,
            Arc::new(dt),
            quinn::EndpointConfig::default(),
            || std::net::UdpSocket::bind("127.0.0.1:0").expect("bind"),
            None,
        )
        .await;

        // One TCP stream: the server answers each 8-byte length request
        // with that many bytes.
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("tcp");
        let tcp_addr = l.local_addr().expect("addr");
        tokio::spawn(async move {
            let payloads: Vec<Bytes> = SIZES.iter().map(|&s| payload(s)).collect();
            while let Ok((mut s, _)) = l.accept().await {
                let payloads = payloads.clone();
                tokio::spawn(async move {
                    let mut req = [0u8; 8];
                    while s.read_exact(&mut req).await.is_ok() {
                        let len = u64::from_le_bytes(req) as usize;
                        let Some(p) = payloads.iter().find(|p| p.len() == len) else {
                            return;
                        };
                        if s.write_all(p).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        (a, b, raw, rs, rc, tcp_addr, raw_default)
    });
    Setup {
        rt,
        b,
        _a: a,
        raw,
        _raw_server: rs,
        _raw_client: rc,
        raw_sender,
        raw_default: raw_default.2,
        _raw_default_eps: (raw_default.0, raw_default.1),
        tcp_addr,
    }
}

/// A raw quinn server answering each stream's 8-byte length with that many
/// bytes (`write_chunk` of a shared buffer), and a client connected to it.
async fn raw_pair(
    ta: &TlsSetup,
    tb: &TlsSetup,
    transport: Arc<quinn::TransportConfig>,
    endpoint: quinn::EndpointConfig,
    bind: impl Fn() -> std::net::UdpSocket,
    sender: Option<Arc<parking_lot::Mutex<Option<quinn::Connection>>>>,
) -> (quinn::Endpoint, quinn::Endpoint, quinn::Connection) {
    let mut sc = quinn::ServerConfig::with_crypto(Arc::new(
        QuicServerConfig::try_from(ta.server.clone()).expect("sc"),
    ));
    sc.transport_config(transport.clone());
    let rs = quinn::Endpoint::new(
        endpoint.clone(),
        Some(sc),
        bind(),
        quinn::default_runtime().expect("rt"),
    )
    .expect("server");
    let mut cc = quinn::ClientConfig::new(Arc::new(
        QuicClientConfig::try_from(tb.client.clone()).expect("cc"),
    ));
    cc.transport_config(transport);
    let rc = quinn::Endpoint::new(
        endpoint,
        None,
        bind(),
        quinn::default_runtime().expect("rt"),
    )
    .expect("client");
    let rs2 = rs.clone();
    tokio::spawn(async move {
        let payloads: Vec<Bytes> = SIZES.iter().map(|&s| payload(s)).collect();
        while let Some(inc) = rs2.accept().await {
            let Ok(conn) = inc.await else { continue };
            if let Some(s) = &sender {
                *s.lock() = Some(conn.clone());
            }
            let payloads = payloads.clone();
            tokio::spawn(async move {
                while let Ok((mut s, mut r)) = conn.accept_bi().await {
                    let payloads = payloads.clone();
                    tokio::spawn(async move {
                        let mut req = [0u8; 8];
                        if r.read_exact(&mut req).await.is_err() {
                            return;
                        }
                        let len = u64::from_le_bytes(req) as usize;
                        let Some(p) = payloads.iter().find(|p| p.len() == len) else {
                            return;
                        };
                        let _ = s.write_chunk(p.clone()).await;
                        let _ = s.finish();
                    });
                }
            });
        }
    });
    let raw = rc
        .connect_with(cc, rs.local_addr().expect("addr"), "bench-a")
        .expect("connect")
        .await
        .expect("handshake");
    (rs, rc, raw)
}

async fn raw_one(conn: &quinn::Connection, size: usize) -> Bytes {
    let (mut s, mut r) = conn.open_bi().await.expect("open");
    s.write_all(&(size as u64).to_le_bytes())
        .await
        .expect("write");
    let _ = s.finish();
    let mut buf = BytesMut::with_capacity(size);
    while buf.len() < size {
        match r.read_chunk(size - buf.len(), true).await.expect("read") {
            Some(c) => buf.extend_from_slice(&c.bytes),
            None => panic!("short"),
        }
    }
    buf.freeze()
}

async fn raw_batch(conn: &quinn::Connection, size: usize) {
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..concurrency() {
        let c = conn.clone();
        set.spawn(async move { raw_one(&c, size).await.len() });
    }
    while let Some(r) = set.join_next().await {
        assert_eq!(r.expect("join"), size);
    }
}

async fn peer_batch(b: &PeerHandle, size: usize) {
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..concurrency() {
        let b = b.clone();
        set.spawn(async move {
            b.fetch(&id(size), Duration::from_secs(10))
                .await
                .expect("fetch")
                .len()
        });
    }
    while let Some(r) = set.join_next().await {
        assert_eq!(r.expect("join"), size);
    }
}

async fn tcp_batch(s: &mut tokio::net::TcpStream, buf: &mut [u8], size: usize) {
    for _ in 0..concurrency() {
        s.write_all(&(size as u64).to_le_bytes())
            .await
            .expect("write");
        s.read_exact(&mut buf[..size]).await.expect("read");
    }
}

/// A `redis-server` this bench started (killed by its handle on drop),
/// holding one value per chunk size under the key `chunk-SIZE`.
struct Redis {
    child: std::process::Child,
    conn: std::io::BufReader<std::net::TcpStream>,
}

impl Redis {
    /// Starts `KVTIER_REDIS_SERVER` or `redis-server` from `PATH`; `Err`
    /// says why there is no Redis column.
    fn start() -> Result<Self, String> {
        use std::io::Write;
        let bin = std::env::var_os("KVTIER_REDIS_SERVER")
            .map(std::path::PathBuf::from)
            .or_else(|| {
                std::env::split_paths(&std::env::var_os("PATH")?)
                    .map(|d| d.join("redis-server"))
                    .find(|p| p.is_file())
            })
            .ok_or("no redis-server in PATH (set KVTIER_REDIS_SERVER)")?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| e.to_string())?
            .port();
        let child = std::process::Command::new(&bin)
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--protected-mode", "no"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .map_err(|e| format!("start {}: {e}", bin.display()))?;
        let mut r = Redis {
            child,
            conn: std::io::BufReader::new(Self::connect(port)?),
        };
        for size in SIZES {
            let key = format!("chunk-{size}");
            let p = payload(size);
            let s = r.conn.get_mut();
            write!(
                s,
                "*3\r\n$3\r\nSET\r\n${}\r\n{key}\r\n${}\r\n",
                key.len(),
                p.len()
            )
            .map_err(|e| e.to_string())?;
            s.write_all(&p).map_err(|e| e.to_string())?;
            s.write_all(b"\r\n").map_err(|e| e.to_string())?;
            let mut line = String::new();
            std::io::BufRead::read_line(&mut r.conn, &mut line).map_err(|e| e.to_string())?;
            if line != "+OK\r\n" {
                return Err(format!("SET answered {line:?}"));
            }
        }
        Ok(r)
    }

    fn connect(port: u16) -> Result<std::net::TcpStream, String> {
        let t0 = Instant::now();
        loop {
            match std::net::TcpStream::connect(("127.0.0.1", port)) {
                Ok(s) => {
                    s.set_nodelay(true).map_err(|e| e.to_string())?;
                    return Ok(s);
                }
                Err(e) if t0.elapsed() > Duration::from_secs(10) => {
                    return Err(format!("connect to redis-server: {e}"));
                }
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }

    /// `concurrency()` GETs of the chunk of `size`, one after the other (the
    /// TCP path's pattern), each read into `buf`.
    fn get_batch(&mut self, size: usize, buf: &mut [u8]) {
        use std::io::{BufRead, Read, Write};
        let key = format!("chunk-{size}");
        for _ in 0..concurrency() {
            write!(
                self.conn.get_mut(),
                "*2\r\n$3\r\nGET\r\n${}\r\n{key}\r\n",
                key.len()
            )
            .expect("GET");
            let mut line = String::new();
            self.conn.read_line(&mut line).expect("GET reply");
            assert_eq!(line, format!("${size}\r\n"), "GET reply header");
            self.conn.read_exact(&mut buf[..size]).expect("GET value");
            let mut crlf = [0u8; 2];
            self.conn.read_exact(&mut crlf).expect("GET CRLF");
        }
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// user+sys CPU seconds of this process (both ends of the in-process
/// paths; not the Redis server).
fn cpu_seconds() -> f64 {
    let s = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let rest = s.rsplit_once(')').map_or("", |r| r.1);
    let f: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of stat(5); `rest` starts at 3.
    let tick = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (tick(11) + tick(12)) / 100.0
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

/// Runs `f` once over `bytes` payload bytes: (GB/s, CPU seconds per GB).
fn timed(bytes: f64, f: impl FnOnce()) -> (f64, f64) {
    let c0 = cpu_seconds();
    let t = Instant::now();
    f();
    let secs = t.elapsed().as_secs_f64();
    (bytes / secs / 1e9, (cpu_seconds() - c0) / (bytes / 1e9))
}

fn bench(c: &mut Criterion) {
    let st = setup();
    let mut tcp = st
        .rt
        .block_on(tokio::net::TcpStream::connect(st.tcp_addr))
        .expect("tcp connect");
    tcp.set_nodelay(true).expect("nodelay");
    let mut tcp_buf = vec![0u8; 4 << 20];
    let mut redis = Redis::start();
    if std::env::var_os("KVTIER_BENCH_SUMMARY_ONLY").is_none() {
        let mut g = c.benchmark_group("peer_fetch");
        g.sample_size(10);
        g.warm_up_time(Duration::from_millis(500));
        g.measurement_time(Duration::from_secs(2));
        for size in SIZES {
            g.throughput(Throughput::Bytes((size * concurrency()) as u64));
            g.bench_with_input(BenchmarkId::new("raw_quinn", size), &size, |bch, &s| {
                bch.iter(|| st.rt.block_on(raw_batch(&st.raw, s)));
            });
            g.bench_with_input(BenchmarkId::new("peer", size), &size, |bch, &s| {
                bch.iter(|| st.rt.block_on(peer_batch(&st.b, s)));
            });
            g.bench_with_input(
                BenchmarkId::new("tcp_one_stream", size),
                &size,
                |bch, &s| {
                    bch.iter(|| st.rt.block_on(tcp_batch(&mut tcp, &mut tcp_buf, s)));
                },
            );
        }
        g.finish();
    }

    // Summary: alternate the paths, median GB/s over rounds, and ratios.
    println!(
        "\npeer fetch summary ({} tuning, {} streams in flight, {} fetch connection(s), {} workers, {SUMMARY_ROUNDS} rounds of {} MiB per path, median; load average {} at start):",
        tuning_name(),
        concurrency(),
        peer_conns(),
        workers(),
        SUMMARY_BYTES >> 20,
        loadavg()
    );
    if let Err(why) = &redis {
        println!("(Redis GET not measured: {why})");
    }
    println!(
        "{:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>10} {:>17}",
        "chunk",
        "raw GB/s",
        "peer",
        "dflt",
        "tcp",
        "redis",
        "peer/raw",
        "peer/tcp",
        "peer/redis",
        "CPU-s/GB raw/peer/dflt"
    );
    for size in SIZES {
        let iters = (SUMMARY_BYTES / (size * concurrency())).max(1);
        let bytes = (iters * size * concurrency()) as f64;
        let (mut raw, mut peer, mut dflt, mut tcpv, mut redv) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for _ in 0..SUMMARY_ROUNDS {
            raw.push(timed(bytes, || {
                st.rt.block_on(async {
                    for _ in 0..iters {
                        raw_batch(&st.raw, size).await;
                    }
                });
            }));
            peer.push(timed(bytes, || {
                st.rt.block_on(async {
                    for _ in 0..iters {
                        peer_batch(&st.b, size).await;
                    }
                });
            }));
            dflt.push(timed(bytes, || {
                st.rt.block_on(async {
                    for _ in 0..iters {
                        raw_batch(&st.raw_default, size).await;
                    }
                });
            }));
            tcpv.push(timed(bytes, || {
                st.rt.block_on(async {
                    for _ in 0..iters {
                        tcp_batch(&mut tcp, &mut tcp_buf, size).await;
                    }
                });
            }));
            if let Ok(r) = &mut redis {
                redv.push(timed(bytes, || {
                    for _ in 0..iters {
                        r.get_batch(size, &mut tcp_buf);
                    }
                }));
            }
        }
        let med = |v: &mut Vec<(f64, f64)>| -> (f64, f64) {
            if v.is_empty() {
                return (f64::NAN, f64::NAN);
            }
            v.sort_by(|a, b| a.0.total_cmp(&b.0));
            v[v.len() / 2]
        };
        let (r, p, d, t, x) = (
            med(&mut raw),
            med(&mut peer),
            med(&mut dflt),
            med(&mut tcpv),
            med(&mut redv),
        );
        println!(
            "{:>6} KiB {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>8.2}x {:>8.2}x {:>9.2}x {:>6.2}/{:.2}/{:.2}",
            size >> 10,
            r.0,
            p.0,
            d.0,
            t.0,
            x.0,
            p.0 / r.0,
            p.0 / t.0,
            p.0 / x.0,
            r.1,
            p.1,
            d.1
        );
    }
    println!("(load average {} at end)", loadavg());
    if let Some(c) = st.raw_sender.lock().clone() {
        let s = c.stats();
        let p = s.path;
        println!(
            "(raw quinn, same settings, sender: mtu {}, sent {} packets in {} sendmsg calls, lost {} ({} bytes), {} congestion events, {} black holes, cwnd {} bytes, rtt {:?})",
            p.current_mtu,
            p.sent_packets,
            s.udp_tx.ios,
            p.lost_packets,
            p.lost_bytes,
            p.congestion_events,
            p.black_holes_detected,
            p.cwnd,
            p.rtt
        );
    }
    let p = st.raw_default.stats().path;
    println!(
        "(raw quinn, quinn defaults, receiver view: mtu {}, rtt {:?}; its sender's losses are not visible from here)",
        p.current_mtu, p.rtt
    );
    let (n, table) = st.b.directory_size();
    println!("(directory at the requester: {n} entries, {table} table bytes)");
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    bench(&mut c);
    c.final_summary();
}
