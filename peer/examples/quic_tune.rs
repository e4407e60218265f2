//! Raw quinn transfer experiments on loopback: one knob at a time against
//! quinn's defaults, with the same mutual TLS as the peer transport.
//!
//! ```sh
//! cargo run --release --locked -p kvtier-peer --example quic_tune -- \
//!     bytes=1G chunk=4M streams=4 conns=1 mtu=65000 gso=off sockbuf=32M force=1 cc=cubic
//! ```
//!
//! Every key is optional; an absent key keeps quinn's default
//! (`TransportConfig::default()`, `EndpointConfig::default()`, a plain
//! `UdpSocket::bind`). Keys:
//!
//! - `bytes` total payload per repetition (default 1G), `reps` (3);
//! - `chunk` bytes requested per stream (default = `bytes`: one stream),
//!   `streams` in flight per connection (1), `conns` connections (1);
//! - `mtu` initial MTU = min MTU = MTU discovery bound = endpoint
//!   `max_udp_payload_size`; or each alone: `imtu`, `minmtu`, `maxudp`;
//!   `disc=off` disables MTU discovery;
//! - `gso=off` disables segmentation offload (`enable_segmentation_offload`);
//! - `swin`, `cwin`, `sendwin` flow-control windows;
//! - `sockbuf` SO_SNDBUF/SO_RCVBUF request, `force=1` uses the
//!   SO_RCVBUFFORCE (CAP_NET_ADMIN) and falls back to the capped one;
//! - `cc=cubic|newreno|bbr`, `iw` its initial window (bytes);
//! - `suite=aes128|aes256|chacha` (rustls ring provider with that TLS 1.3
//!   suite only; default: the provider's order, AES-256-GCM first);
//! - `rt=shared|split` one 2-worker runtime for both ends, or one per end
//!   (as two daemons would have), `workers` per runtime (2);
//! - `copy=0` discards received chunks instead of copying them into one
//!   buffer per request (the peer path copies).
//!
//! Per repetition it prints GB/s, CPU seconds per GB (user+sys of this
//! process, both ends), the 1-minute load average, UDP receive-buffer
//! errors from `/proc/net/snmp`, and the sender's path statistics.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use peer::cert::{self, Validity};
use peer::tls::TlsSetup;
use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use quinn::{TransportConfig, VarInt};

fn size(v: &str) -> u64 {
    let v = v.trim();
    let (num, mul) = match v.chars().last() {
        Some('K' | 'k') => (&v[..v.len() - 1], 1u64 << 10),
        Some('M' | 'm') => (&v[..v.len() - 1], 1 << 20),
        Some('G' | 'g') => (&v[..v.len() - 1], 1 << 30),
        _ => (v, 1),
    };
    num.parse::<u64>().expect("a size such as 4M") * mul
}

struct Opts(HashMap<String, String>);

impl Opts {
    fn get(&self, k: &str) -> Option<&str> {
        self.0.get(k).map(String::as_str)
    }
    fn size(&self, k: &str) -> Option<u64> {
        self.get(k).map(size)
    }
    fn on(&self, k: &str) -> Option<bool> {
        self.get(k)
            .map(|v| matches!(v, "1" | "on" | "true" | "yes"))
    }
}

fn transport(o: &Opts) -> TransportConfig {
    let mut t = TransportConfig::default();
    let mtu = o.size("mtu").map(|m| m as u16);
    if let Some(m) = o.size("imtu").map(|m| m as u16).or(mtu) {
        t.initial_mtu(m);
    }
    if let Some(m) = o.size("minmtu").map(|m| m as u16).or(mtu) {
        t.min_mtu(m);
    }
    if o.on("disc") == Some(false) {
        t.mtu_discovery_config(None);
    } else if let Some(m) = o.size("maxudp").map(|m| m as u16).or(mtu) {
        let mut d = quinn::MtuDiscoveryConfig::default();
        d.upper_bound(m);
        t.mtu_discovery_config(Some(d));
    }
    if let Some(w) = o.size("swin") {
        t.stream_receive_window(VarInt::from_u64(w).expect("window"));
    }
    if let Some(w) = o.size("cwin") {
        t.receive_window(VarInt::from_u64(w).expect("window"));
    }
    if let Some(w) = o.size("sendwin") {
        t.send_window(w);
    }
    if o.on("gso") == Some(false) {
        t.enable_segmentation_offload(false);
    }
    let iw = o.size("iw");
    match o.get("cc") {
        None | Some("cubic") => {
            if let Some(w) = iw {
                let mut c = quinn::congestion::CubicConfig::default();
                c.initial_window(w);
                t.congestion_controller_factory(Arc::new(c));
            }
        }
        Some("newreno") => {
            let mut c = quinn::congestion::NewRenoConfig::default();
            if let Some(w) = iw {
                c.initial_window(w);
            }
            t.congestion_controller_factory(Arc::new(c));
        }
        Some("bbr") => {
            let mut c = quinn::congestion::BbrConfig::default();
            if let Some(w) = iw {
                c.initial_window(w);
            }
            t.congestion_controller_factory(Arc::new(c));
        }
        Some(other) => panic!("cc={other}: cubic, newreno or bbr"),
    }
    t.max_concurrent_bidi_streams(VarInt::from_u32(1024));
    t
}

fn endpoint_config(o: &Opts) -> quinn::EndpointConfig {
    let mut e = quinn::EndpointConfig::default();
    if let Some(m) = o.size("maxudp").or(o.size("mtu")) {
        e.max_udp_payload_size(m as u16).expect("1200..=65527");
    }
    e
}

fn bind(o: &Opts) -> std::net::UdpSocket {
    let s = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
    if let Some(b) = o.size("sockbuf") {
        let b = b as usize;
        use rustix::net::sockopt as so;
        let force = o.on("force") == Some(true);
        if !force || so::set_socket_recv_buffer_size_force(&s, b).is_err() {
            let _ = so::set_socket_recv_buffer_size(&s, b);
        }
        // rustix 0.38 has no SO_SNDBUFFORCE; the send side is capped at
        // wmem_max (a full send buffer makes quinn wait, it drops nothing).
        let _ = so::set_socket_send_buffer_size(&s, b);
    }
    s
}

fn socket_buffers(s: &std::net::UdpSocket) -> (usize, usize) {
    use rustix::net::sockopt as so;
    (
        so::get_socket_send_buffer_size(s).unwrap_or(0),
        so::get_socket_recv_buffer_size(s).unwrap_or(0),
    )
}

fn tls(o: &Opts) -> (TlsSetup, TlsSetup) {
    let ca = cert::init_ca("tune", Validity::days(1)).expect("ca");
    let mut provider = rustls::crypto::ring::default_provider();
    use rustls::crypto::ring::cipher_suite as cs;
    match o.get("suite") {
        None => {}
        Some("aes128") => provider.cipher_suites = vec![cs::TLS13_AES_128_GCM_SHA256],
        Some("aes256") => {
            provider.cipher_suites =
                vec![cs::TLS13_AES_256_GCM_SHA384, cs::TLS13_AES_128_GCM_SHA256];
        }
        Some("chacha") => {
            // QUIC Initial packets always use AES-128-GCM, so it stays listed.
            provider.cipher_suites = vec![
                cs::TLS13_CHACHA20_POLY1305_SHA256,
                cs::TLS13_AES_128_GCM_SHA256,
            ];
        }
        Some(other) => panic!("suite={other}: aes128, aes256 or chacha"),
    }
    let provider = Arc::new(provider);
    let mk = |n: &str| {
        let m = cert::issue(&ca, n, &[], &[], Validity::days(1)).expect("issue");
        TlsSetup::from_material_with_provider(&m, provider.clone()).expect("tls")
    };
    (mk("tune-a"), mk("tune-b"))
}

/// user+sys CPU seconds of this process.
fn cpu_seconds() -> f64 {
    let s = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let rest = s.rsplit_once(')').map_or("", |r| r.1);
    let f: Vec<&str> = rest.split_whitespace().collect();
    // Fields 14 and 15 of stat(5); `rest` starts at field 3.
    let tick = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (tick(11) + tick(12)) / 100.0
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .next()
        .unwrap_or("?")
        .to_owned()
}

/// UDP RcvbufErrors and SndbufErrors (system-wide).
fn udp_buf_errors() -> (u64, u64) {
    let s = std::fs::read_to_string("/proc/net/snmp").unwrap_or_default();
    let mut lines = s.lines().filter(|l| l.starts_with("Udp:"));
    let (Some(h), Some(v)) = (lines.next(), lines.next()) else {
        return (0, 0);
    };
    let h: Vec<&str> = h.split_whitespace().collect();
    let v: Vec<&str> = v.split_whitespace().collect();
    let get = |name: &str| {
        h.iter()
            .position(|x| *x == name)
            .and_then(|i| v.get(i))
            .and_then(|x| x.parse().ok())
            .unwrap_or(0)
    };
    (get("RcvbufErrors"), get("SndbufErrors"))
}

fn runtime(workers: usize) -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()
        .expect("runtime")
}

fn main() {
    let opts = Opts(
        std::env::args()
            .skip(1)
            .filter_map(|a| a.split_once('=').map(|(k, v)| (k.to_owned(), v.to_owned())))
            .collect(),
    );
    let total = opts.size("bytes").unwrap_or(1 << 30);
    let chunk = opts.size("chunk").unwrap_or(total).min(total);
    let streams = opts.size("streams").unwrap_or(1) as usize;
    let conns = opts.size("conns").unwrap_or(1) as usize;
    let reps = opts.size("reps").unwrap_or(3) as usize;
    let workers = opts.size("workers").unwrap_or(2) as usize;
    let split = opts.get("rt") == Some("split");
    let copy = opts.on("copy") != Some(false);
    let (ta, tb) = tls(&opts);
    let transport = Arc::new(transport(&opts));

    let server_rt = runtime(workers);
    let client_rt_own = split.then(|| runtime(workers));
    let client_rt = client_rt_own.as_ref().unwrap_or(&server_rt);

    // Server: answers each stream's 8-byte length with that many bytes.
    let data = Bytes::from(
        (0..chunk as usize)
            .map(|i| (i * 7 + 3) as u8)
            .collect::<Vec<u8>>(),
    );
    let server_conns: Arc<parking_lot::Mutex<Vec<quinn::Connection>>> = Arc::default();
    let ssock = bind(&opts);
    let (snd, rcv) = socket_buffers(&ssock);
    let server_addr: SocketAddr = {
        let _g = server_rt.enter();
        let mut sc = quinn::ServerConfig::with_crypto(Arc::new(
            QuicServerConfig::try_from(ta.server.clone()).expect("server crypto"),
        ));
        sc.transport_config(transport.clone());
        let ep = quinn::Endpoint::new(
            endpoint_config(&opts),
            Some(sc),
            ssock,
            quinn::default_runtime().expect("runtime"),
        )
        .expect("server endpoint");
        let addr = ep.local_addr().expect("addr");
        let sc2 = server_conns.clone();
        server_rt.spawn(async move {
            while let Some(inc) = ep.accept().await {
                let Ok(conn) = inc.await else { continue };
                sc2.lock().push(conn.clone());
                let data = data.clone();
                tokio::spawn(async move {
                    while let Ok((mut s, mut r)) = conn.accept_bi().await {
                        let data = data.clone();
                        tokio::spawn(async move {
                            let mut req = [0u8; 8];
                            if r.read_exact(&mut req).await.is_err() {
                                return;
                            }
                            let n = u64::from_le_bytes(req) as usize;
                            let _ = s.write_chunk(data.slice(..n)).await;
                            let _ = s.finish();
                            let _ = s.stopped().await;
                        });
                    }
                });
            }
        });
        addr
    };

    let clients: Vec<(quinn::Endpoint, quinn::Connection)> = client_rt.block_on(async {
        let mut v = Vec::new();
        for _ in 0..conns {
            let mut cc = quinn::ClientConfig::new(Arc::new(
                QuicClientConfig::try_from(tb.client.clone()).expect("client crypto"),
            ));
            cc.transport_config(transport.clone());
            let ep = quinn::Endpoint::new(
                endpoint_config(&opts),
                None,
                bind(&opts),
                quinn::default_runtime().expect("runtime"),
            )
            .expect("client endpoint");
            let conn = ep
                .connect_with(cc, server_addr, "tune-a")
                .expect("connect")
                .await
                .expect("handshake");
            v.push((ep, conn));
        }
        v
    });
    let args: Vec<String> = std::env::args().skip(1).collect();
    println!(
        "quic_tune {} | socket buffers snd {} rcv {} (kernel-reported) | alpn {:?}",
        args.join(" "),
        snd,
        rcv,
        clients[0]
            .1
            .handshake_data()
            .and_then(|h| h.downcast::<quinn::crypto::rustls::HandshakeData>().ok())
            .map(|h| h.protocol.clone())
            .map(|p| p.map(|p| String::from_utf8_lossy(&p).into_owned())),
    );
    for rep in 0..reps {
        let remaining = Arc::new(AtomicU64::new(total.div_ceil(chunk)));
        let (rb0, _) = udp_buf_errors();
        let cpu0 = cpu_seconds();
        let t0 = Instant::now();
        let got: u64 = client_rt.block_on(async {
            let mut set = tokio::task::JoinSet::new();
            for (_, conn) in &clients {
                for _ in 0..streams {
                    let conn = conn.clone();
                    let remaining = remaining.clone();
                    set.spawn(async move {
                        let mut got = 0u64;
                        while remaining
                            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                                n.checked_sub(1)
                            })
                            .is_ok()
                        {
                            let (mut s, mut r) = conn.open_bi().await.expect("open");
                            s.write_all(&chunk.to_le_bytes()).await.expect("request");
                            let _ = s.finish();
                            let mut buf =
                                BytesMut::with_capacity(if copy { chunk as usize } else { 0 });
                            let mut n = 0u64;
                            while let Some(c) = r.read_chunk(usize::MAX, true).await.expect("read")
                            {
                                n += c.bytes.len() as u64;
                                if copy {
                                    buf.extend_from_slice(&c.bytes);
                                }
                            }
                            assert_eq!(n, chunk, "short stream");
                            got += n;
                        }
                        got
                    });
                }
            }
            let mut sum = 0;
            while let Some(r) = set.join_next().await {
                sum += r.expect("join");
            }
            sum
        });
        let secs = t0.elapsed().as_secs_f64();
        let cpu = cpu_seconds() - cpu0;
        let (rb1, _) = udp_buf_errors();
        let gbps = got as f64 / secs / 1e9;
        let sc = server_conns.lock();
        let (mut lost, mut sent, mut cong, mut bh, mut ios, mut dgrams, mut mtu) =
            (0, 0, 0, 0, 0, 0, 0);
        for c in sc.iter() {
            let s = c.stats();
            lost += s.path.lost_packets;
            sent += s.path.sent_packets;
            cong += s.path.congestion_events;
            bh += s.path.black_holes_detected;
            ios += s.udp_tx.ios;
            dgrams += s.udp_tx.datagrams;
            mtu = s.path.current_mtu;
        }
        println!(
            "rep {rep}: {gbps:.3} GB/s  {:.2} CPU-s/GB  load {}  rcvbuf-errors {}  | sender: mtu {mtu}, {sent} pkts total, {lost} lost, {cong} congestion events, {bh} black holes, {:.1} datagrams per send call",
            cpu / (got as f64 / 1e9),
            loadavg(),
            rb1 - rb0,
            dgrams as f64 / ios.max(1) as f64,
        );
    }
    client_rt.block_on(async {
        for (ep, c) in &clients {
            c.close(VarInt::from_u32(0), b"done");
            ep.wait_idle().await;
        }
    });
    drop(clients);
    drop(client_rt_own);
    server_rt.shutdown_timeout(Duration::from_secs(1));
}
