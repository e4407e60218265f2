//! Peer fetch throughput against a raw quinn transfer with the same
//! transport settings and TLS, plus one TCP loopback stream for context,
//! all in the same run on 127.0.0.1.
//!
//! Each iteration moves `CONCURRENCY` chunks of the given size, one stream
//! per chunk, all in flight at once. Both quinn paths copy the received
//! stream chunks into one buffer per chunk; the peer path also checks the
//! frame CRC, the id and the payload CRC32C.
//!
//! After the criterion groups, a summary pass alternates the three paths
//! (`SUMMARY_ROUNDS` rounds, median) and prints GB/s and the ratio
//! peer / raw quinn per chunk size.
//!
//! `KVTIER_BENCH_TUNING=default` uses the untuned datagram size (initial
//! MTU 1200) instead of the loopback tuning; `KVTIER_BENCH_TUNING=N` uses
//! `TransportTuning::jumbo(N)` (N-byte datagrams from the first packet).

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
const CONCURRENCY: usize = 4;
const SUMMARY_ROUNDS: usize = 5;
const SUMMARY_BYTES: usize = 256 << 20;

fn tuning() -> TransportTuning {
    match std::env::var("KVTIER_BENCH_TUNING").as_deref() {
        Ok("default") => TransportTuning::default(),
        Ok(mtu) if mtu.parse::<u16>().is_ok() => {
            TransportTuning::jumbo(mtu.parse().expect("checked"))
        }
        _ => TransportTuning::loopback(),
    }
}

fn tuning_name() -> String {
    std::env::var("KVTIER_BENCH_TUNING").unwrap_or_else(|_| "loopback (8952)".into())
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
    fn snapshot(&self) -> Vec<(PeerChunkId, u64)> {
        self.chunks
            .iter()
            .map(|(k, c)| (*k, c.payload.len() as u64))
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
    // tcp path
    tcp_addr: SocketAddr,
}

fn setup() -> Setup {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
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
    let (a, b, raw, rs, rc, tcp_addr) = rt.block_on(async {
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
                ..cfg.clone()
            },
            tb.clone(),
            Arc::new(Source { chunks: Vec::new() }),
        )
        .expect("start b");
        let deadline = Instant::now() + Duration::from_secs(20);
        while SIZES.iter().any(|&s| b.holders(&id(s)).is_empty()) {
            assert!(Instant::now() < deadline, "sync");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }

        // Raw quinn: same tuning, same TLS configs.
        let transport = Arc::new(t.transport_config(cfg.keep_alive, cfg.idle_timeout));
        let mut sc = quinn::ServerConfig::with_crypto(Arc::new(
            QuicServerConfig::try_from(ta.server.clone()).expect("sc"),
        ));
        sc.transport_config(transport.clone());
        let rs = quinn::Endpoint::new(
            t.endpoint_config(),
            Some(sc),
            t.bind_socket("127.0.0.1:0".parse().expect("addr"))
                .expect("bind"),
            quinn::default_runtime().expect("rt"),
        )
        .expect("server");
        let mut cc = quinn::ClientConfig::new(Arc::new(
            QuicClientConfig::try_from(tb.client.clone()).expect("cc"),
        ));
        cc.transport_config(transport);
        let rc = quinn::Endpoint::new(
            t.endpoint_config(),
            None,
            t.bind_socket("127.0.0.1:0".parse().expect("addr"))
                .expect("bind"),
            quinn::default_runtime().expect("rt"),
        )
        .expect("client");
        let rs2 = rs.clone();
        tokio::spawn(async move {
            let payloads: Vec<Bytes> = SIZES.iter().map(|&s| payload(s)).collect();
            while let Some(inc) = rs2.accept().await {
                let Ok(conn) = inc.await else { continue };
                *rsend.lock() = Some(conn.clone());
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
        (a, b, raw, rs, rc, tcp_addr)
    });
    Setup {
        rt,
        b,
        _a: a,
        raw,
        _raw_server: rs,
        _raw_client: rc,
        raw_sender,
        tcp_addr,
    }
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
    for _ in 0..CONCURRENCY {
        let c = conn.clone();
        set.spawn(async move { raw_one(&c, size).await.len() });
    }
    while let Some(r) = set.join_next().await {
        assert_eq!(r.expect("join"), size);
    }
}

async fn peer_batch(b: &PeerHandle, size: usize) {
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..CONCURRENCY {
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
    for _ in 0..CONCURRENCY {
        s.write_all(&(size as u64).to_le_bytes())
            .await
            .expect("write");
        s.read_exact(&mut buf[..size]).await.expect("read");
    }
}

fn bench(c: &mut Criterion) {
    let st = setup();
    let mut tcp = st
        .rt
        .block_on(tokio::net::TcpStream::connect(st.tcp_addr))
        .expect("tcp connect");
    tcp.set_nodelay(true).expect("nodelay");
    let mut tcp_buf = vec![0u8; 4 << 20];
    let mut g = c.benchmark_group("peer_fetch");
    g.sample_size(10);
    g.warm_up_time(Duration::from_millis(500));
    g.measurement_time(Duration::from_secs(2));
    for size in SIZES {
        g.throughput(Throughput::Bytes((size * CONCURRENCY) as u64));
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

    // Summary: alternate the paths, median GB/s over rounds, and ratios.
    println!(
        "\npeer fetch summary ({} tuning, {CONCURRENCY} streams in flight, {SUMMARY_ROUNDS} rounds of {} MiB per path, median):",
        tuning_name(),
        SUMMARY_BYTES >> 20
    );
    println!(
        "{:>9} {:>10} {:>10} {:>10} {:>12} {:>10}",
        "chunk", "raw GB/s", "peer GB/s", "tcp GB/s", "peer/raw", "peer/tcp"
    );
    for size in SIZES {
        let iters = (SUMMARY_BYTES / (size * CONCURRENCY)).max(1);
        let bytes = (iters * size * CONCURRENCY) as f64;
        let mut raw = Vec::new();
        let mut peer = Vec::new();
        let mut tcpv = Vec::new();
        for _ in 0..SUMMARY_ROUNDS {
            let t = Instant::now();
            st.rt.block_on(async {
                for _ in 0..iters {
                    raw_batch(&st.raw, size).await;
                }
            });
            raw.push(bytes / t.elapsed().as_secs_f64() / 1e9);
            if std::env::var_os("KVTIER_BENCH_VERBOSE").is_some() {
                eprintln!("  {size}: raw round done in {:?}", t.elapsed());
            }
            let t = Instant::now();
            st.rt.block_on(async {
                for _ in 0..iters {
                    peer_batch(&st.b, size).await;
                }
            });
            peer.push(bytes / t.elapsed().as_secs_f64() / 1e9);
            let t = Instant::now();
            st.rt.block_on(async {
                for _ in 0..iters {
                    tcp_batch(&mut tcp, &mut tcp_buf, size).await;
                }
            });
            tcpv.push(bytes / t.elapsed().as_secs_f64() / 1e9);
        }
        let med = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let (r, p, t) = (med(&mut raw), med(&mut peer), med(&mut tcpv));
        println!(
            "{:>6} KiB {r:>10.2} {p:>10.2} {t:>10.2} {:>11.2}x {:>9.2}x",
            size >> 10,
            p / r,
            p / t
        );
    }
    if let Some(c) = st.raw_sender.lock().as_ref() {
        let p = c.stats().path;
        println!(
            "(raw quinn sender: mtu {}, sent {} packets, lost {} ({} bytes), {} congestion events, {} black holes, cwnd {} bytes, rtt {:?})",
            p.current_mtu,
            p.sent_packets,
            p.lost_packets,
            p.lost_bytes,
            p.congestion_events,
            p.black_holes_detected,
            p.cwnd,
            p.rtt
        );
    }
    let (n, table) = st.b.directory_size();
    println!("(directory at the requester: {n} entries, {table} table bytes)");
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    bench(&mut c);
    c.final_summary();
}
