//! RESP SET/GET throughput: kvtier's RESP endpoint versus a real
//! `redis-server` started by this bench, measured in the same run with the
//! same client, for 256 KiB, 1 MiB, 2.5 MiB and 4 MiB values.
//!
//! Run: `cargo bench -p kvtier-node --bench resp` (add `-- --quick` for a
//! short smoke, `-- --kvtier HOST:PORT` to measure a running daemon instead
//! of the in-process server). Prints GB/s for both servers and the ratio kvtier/redis
//! (target: >= 1). Without `redis-server` on PATH it measures kvtier only
//! and says so.
//!
//! The client: `CONNS` blocking connections on their own threads, one
//! request in flight per connection (as LMCache's `resp://` client does),
//! values written with one vectored write and read into a preallocated
//! buffer. kvtier runs in this process on a 2-thread tokio runtime over a
//! RAM-only chunk store; redis-server runs with `--save '' --appendonly no`.

use std::io::{IoSlice, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use node::NodeContext;
use node::resp::{self, RespOptions};
use tier::{ChunkStore, TierConfig};

const CONNS: usize = 4;
/// Measured passes per cell and server (median printed).
const REPS: usize = 3;
const SIZES: [(usize, &str); 4] = [
    (256 << 10, "256 KiB"),
    (1 << 20, "1 MiB"),
    (5 << 19, "2.5 MiB"),
    (4 << 20, "4 MiB"),
];

struct Client {
    s: TcpStream,
    // Read buffer: `rbuf[rpos..rlen]` is unread.
    rbuf: Vec<u8>,
    rpos: usize,
    rlen: usize,
    val: Vec<u8>,
}

impl Client {
    fn connect(addr: SocketAddr) -> Self {
        let s = TcpStream::connect(addr).expect("connect");
        s.set_nodelay(true).expect("nodelay");
        s.set_read_timeout(Some(Duration::from_secs(30)))
            .expect("timeout");
        Self {
            s,
            rbuf: vec![0; 64 << 10],
            rpos: 0,
            rlen: 0,
            val: Vec::new(),
        }
    }

    fn line(&mut self) -> Vec<u8> {
        loop {
            if let Some(i) = self.rbuf[self.rpos..self.rlen]
                .windows(2)
                .position(|w| w == b"\r\n")
            {
                let l = self.rbuf[self.rpos..self.rpos + i].to_vec();
                self.rpos += i + 2;
                return l;
            }
            if self.rpos > 0 {
                self.rbuf.copy_within(self.rpos..self.rlen, 0);
                self.rlen -= self.rpos;
                self.rpos = 0;
            }
            let n = self
                .s
                .read(&mut self.rbuf[self.rlen..])
                .expect("read reply");
            assert!(n > 0, "server closed the connection");
            self.rlen += n;
        }
    }

    fn set(&mut self, key: &[u8], val: &[u8]) {
        let head = format!(
            "*3\r\n$3\r\nSET\r\n${}\r\n{}\r\n${}\r\n",
            key.len(),
            String::from_utf8_lossy(key),
            val.len()
        );
        let mut parts = [
            IoSlice::new(head.as_bytes()),
            IoSlice::new(val),
            IoSlice::new(b"\r\n"),
        ];
        let mut slices: &mut [IoSlice<'_>] = &mut parts;
        while !slices.is_empty() {
            let n = self.s.write_vectored(slices).expect("write");
            IoSlice::advance_slices(&mut slices, n);
        }
        let l = self.line();
        assert_eq!(l, b"+OK", "SET reply");
    }

    fn get(&mut self, key: &[u8], expect_len: usize) {
        let req = format!(
            "*2\r\n$3\r\nGET\r\n${}\r\n{}\r\n",
            key.len(),
            String::from_utf8_lossy(key)
        );
        self.s.write_all(req.as_bytes()).expect("write");
        let l = self.line();
        assert_eq!(l, format!("${expect_len}").as_bytes(), "GET reply header");
        // Value + CRLF: what is buffered, then straight from the socket.
        let total = expect_len + 2;
        self.val.resize(total, 0);
        let have = (self.rlen - self.rpos).min(total);
        self.val[..have].copy_from_slice(&self.rbuf[self.rpos..self.rpos + have]);
        self.rpos += have;
        self.s
            .read_exact(&mut self.val[have..])
            .expect("read value");
        assert_eq!(&self.val[expect_len..], b"\r\n");
    }
}

/// Runs `op` on `CONNS` threads, `per_conn` times each; returns GB/s.
fn run(addr: SocketAddr, size: usize, per_conn: usize, keys: usize, set: bool) -> f64 {
    let val: Arc<Vec<u8>> = Arc::new((0..size).map(|i| (i * 31 % 251) as u8).collect());
    let start = Instant::now();
    let handles: Vec<_> = (0..CONNS)
        .map(|t| {
            let val = Arc::clone(&val);
            std::thread::spawn(move || {
                let mut c = Client::connect(addr);
                for i in 0..per_conn {
                    let key = format!("bench:{}:{}", size, (t * per_conn + i) % keys);
                    if set {
                        c.set(key.as_bytes(), &val);
                    } else {
                        c.get(key.as_bytes(), size);
                    }
                }
            })
        })
        .collect();
    for h in handles {
        h.join().expect("client thread");
    }
    let secs = start.elapsed().as_secs_f64();
    (size * per_conn * CONNS) as f64 / secs / 1e9
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

struct Redis(Child);

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

fn start_redis() -> Option<(Redis, SocketAddr)> {
    let port = free_port();
    let child = Command::new("redis-server")
        .args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .args([
            "--maxmemory",
            "0",
            "--protected-mode",
            "no",
            "--loglevel",
            "warning",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    let redis = Redis(child);
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if let Ok(mut s) = TcpStream::connect(addr) {
            let mut b = [0u8; 7];
            if s.write_all(b"PING\r\n").is_ok()
                && s.read_exact(&mut b).is_ok()
                && &b == b"+PONG\r\n"
            {
                return Some((redis, addr));
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let target_bytes: usize = if quick { 64 << 20 } else { 512 << 20 };
    // `--kvtier HOST:PORT`: measure a running daemon instead of an in-process server.
    let external: Option<SocketAddr> = std::env::args()
        .skip_while(|a| a != "--kvtier")
        .nth(1)
        .map(|a| a.parse().expect("--kvtier takes HOST:PORT"));
    // As the daemon does at start (see `node::memory`).
    node::memory::tune_allocator();
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Arc::new(
        ChunkStore::open(TierConfig {
            data_dir: dir.path().to_path_buf(),
            ram_budget: 2 << 30,
            disk_budget: 0,
            ..TierConfig::default()
        })
        .expect("open store"),
    );
    let ctx = Arc::new(NodeContext::new(store, "bench".into()));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .expect("bind");
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let kv_addr = match external {
        Some(a) => {
            println!("kvtier: the daemon at {a}");
            a
        }
        None => {
            println!("kvtier: in-process RESP server (2 tokio workers, RAM-only store)");
            listener.local_addr().expect("addr")
        }
    };
    let server = rt.spawn(resp::serve(listener, ctx, RespOptions::default(), async {
        let _ = stop_rx.await;
    }));
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!("load average at start: {}", load.trim());
    let redis = start_redis();
    if redis.is_none() {
        println!("redis-server not found or did not start: measuring kvtier only (no ratio)");
    }
    println!(
        "RESP throughput, {CONNS} connections, one request in flight each ({} MiB per cell)",
        target_bytes >> 20
    );
    println!(
        "{:<8} {:<4} {:>12} {:>12} {:>8}",
        "value", "op", "kvtier GB/s", "redis GB/s", "ratio"
    );
    for (size, label) in SIZES {
        let per_conn = (target_bytes / size / CONNS).max(4);
        // Distinct keys: 256 MiB worth, so GETs hit and memory stays bounded.
        let keys = ((256 << 20) / size).clamp(CONNS, per_conn * CONNS);
        for set in [true, false] {
            let op = if set { "SET" } else { "GET" };
            // Warm-up pass so GETs find every key; then REPS measured passes
            // alternating between the servers; the median of each is printed
            // (the machine is shared: alternating keeps both under the same load).
            run(kv_addr, size, keys.div_ceil(CONNS), keys, true);
            if let Some((_, a)) = &redis {
                run(*a, size, keys.div_ceil(CONNS), keys, true);
            }
            let (mut kv, mut rd) = (Vec::new(), Vec::new());
            for _ in 0..REPS {
                kv.push(run(kv_addr, size, per_conn, keys, set));
                if let Some((_, a)) = &redis {
                    rd.push(run(*a, size, per_conn, keys, set));
                }
            }
            let kv = median(&mut kv);
            if rd.is_empty() {
                println!("{label:<8} {op:<4} {kv:>12.2} {:>12} {:>8}", "-", "-");
                println!(
                    "RESULT resp {op} {label}: kvtier {kv:.2} GB/s (no redis-server: no ratio)"
                );
            } else {
                let rd = median(&mut rd);
                println!("{label:<8} {op:<4} {kv:>12.2} {rd:>12.2} {:>8.2}", kv / rd);
                println!(
                    "RESULT resp {op} {label}: kvtier {kv:.2} GB/s vs redis-server {rd:.2} GB/s = {:.2}x (target >= 1)",
                    kv / rd
                );
            }
        }
    }
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!("load average at end: {}", load.trim());
    drop(redis);
    let _ = stop_tx.send(());
    let _ = rt.block_on(server);
}
