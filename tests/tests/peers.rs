//! The peer cascade between real `kvtier` daemons on loopback (QUIC +
//! mutual TLS): a chunk PUT on A is found and fetched byte-exact on B,
//! ranks never mix, a SIGKILLed peer turns into fast misses and is marked
//! down, a restarted peer is re-synced, a node with a certificate from
//! another CA is refused, and corrupt bytes on a holder's disk are never
//! served to a peer.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kvtier_tests::{
    Daemon, chunk_bytes, http_get, peer_state, poll, run_kvtier, test_record, wait_present,
};
use node::native::LookupLocation;
use node::tier::{ChunkKey, Namespace};

/// Fast membership thresholds for tests (environment, like any key).
const ENV: [(&str, &str); 3] = [
    ("KVTIER_PEER_SUSPECT_AFTER", "500ms"),
    ("KVTIER_PEER_DOWN_AFTER", "1500ms"),
    ("KVTIER_PEER_FETCH_TIMEOUT", "1s"),
];

fn kvtier_ok(args: &[&str]) {
    let out = run_kvtier(args, &[]);
    assert!(
        out.status.success(),
        "kvtier {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `kvtier cert init-ca` into `dir/NAME-ca`, returning the CA dir.
fn make_ca(dir: &Path, name: &str, cluster: &str) -> PathBuf {
    let ca = dir.join(format!("{name}-ca"));
    kvtier_ok(&[
        "cert",
        "init-ca",
        "--cluster",
        cluster,
        "--out",
        ca.to_str().expect("utf-8 path"),
    ]);
    ca
}

/// `kvtier cert issue` for `node` into `dir/node/tls`.
fn issue(dir: &Path, ca: &Path, node: &str) -> PathBuf {
    let tls = dir.join(node).join("tls");
    kvtier_ok(&[
        "cert",
        "issue",
        "--ca",
        ca.to_str().expect("utf-8 path"),
        "--node",
        node,
        "--ip",
        "127.0.0.1",
        "--out",
        tls.to_str().expect("utf-8 path"),
    ]);
    tls
}

/// Free UDP ports on 127.0.0.1 (bound, then released).
fn free_ports(n: usize) -> Vec<u16> {
    let socks: Vec<std::net::UdpSocket> = (0..n)
        .map(|_| std::net::UdpSocket::bind("127.0.0.1:0").expect("bind"))
        .collect();
    socks
        .iter()
        .map(|s| s.local_addr().expect("addr").port())
        .collect()
}

fn start_node(
    dir: &Path,
    name: &str,
    tls: &Path,
    port: u16,
    peers: &[u16],
) -> Result<Daemon, String> {
    let nd = dir.join(name);
    std::fs::create_dir_all(&nd).expect("node dir");
    let listen = format!("127.0.0.1:{port}");
    let peers: Vec<String> = peers.iter().map(|p| format!("127.0.0.1:{p}")).collect();
    let peers = peers.join(",");
    let mut extra = vec![
        "--node-name",
        name,
        "--peer-listen",
        &listen,
        "--tls-dir",
        tls.to_str().expect("utf-8 path"),
    ];
    if !peers.is_empty() {
        extra.extend(["--peers", &peers]);
    }
    let d = Daemon::start(&nd, &extra, &ENV)?;
    // The ready event names the bound peer endpoint. The lock file says
    // ready just before the event is logged: wait for it (bounded).
    let want = format!("\"peer\":\"{listen}\"");
    let t0 = Instant::now();
    while !d.log().contains(&want) {
        if t0.elapsed() > Duration::from_secs(10) {
            return Err(format!("{want} not in the ready event; log:\n{}", d.log()));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(d)
}

/// Two peered nodes, `a` and `b`, with certificates of one CA, in `dir`.
struct Two {
    a: Daemon,
    b: Daemon,
    /// b's TLS dir (to restart it).
    b_tls: PathBuf,
    /// a's and b's peer ports.
    ports: Vec<u16>,
}

fn two_nodes(dir: &Path) -> Two {
    let ca = make_ca(dir, "cluster", "test");
    let ports = free_ports(2);
    let a_tls = issue(dir, &ca, "a");
    let b_tls = issue(dir, &ca, "b");
    let a =
        start_node(dir, "a", &a_tls, ports[0], &[ports[1]]).unwrap_or_else(|e| panic!("a: {e}"));
    let b =
        start_node(dir, "b", &b_tls, ports[1], &[ports[0]]).unwrap_or_else(|e| panic!("b: {e}"));
    Two { a, b, b_tls, ports }
}

fn put(d: &Daemon, ns: Namespace, key: ChunkKey, data: &[u8]) {
    let mut c = d.client();
    let st = c.put_bytes(ns, 0, &[(key, data)]).expect("PUT");
    assert_eq!(st, vec![0], "PUT status");
}

#[test]
fn chunks_cross_nodes_and_dead_peers_become_fast_misses() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ca = make_ca(dir.path(), "cluster", "test");
    let names = ["a", "b", "c"];
    let ports = free_ports(3);
    let tls: Vec<PathBuf> = names.iter().map(|n| issue(dir.path(), &ca, n)).collect();
    let others = |i: usize| -> Vec<u16> {
        ports
            .iter()
            .enumerate()
            .filter(|(j, _)| *j != i)
            .map(|(_, p)| *p)
            .collect()
    };
    let mut nodes: Vec<Daemon> = (0..3)
        .map(|i| {
            start_node(dir.path(), names[i], &tls[i], ports[i], &others(i))
                .unwrap_or_else(|e| panic!("start {}: {e}", names[i]))
        })
        .collect();

    // Two ranks write the SAME keys with different bytes: rank 0 on a,
    // rank 1 on c. b must serve each rank its own bytes.
    let r0 = test_record(0);
    let r1 = test_record(1);
    let ns0 = nodes[0].client().hello(&r0).expect("HELLO");
    let ns1 = nodes[2].client().hello(&r1).expect("HELLO");
    let (key, d0) = chunk_bytes(1, 1);
    let (_, d1) = chunk_bytes(2, 1);
    assert_ne!(d0, d1);
    put(&nodes[0], ns0, key, &d0);
    put(&nodes[2], ns1, key, &d1);
    // A second key on a that b only looks up, never fetches (so b holds no
    // copy of it), and a flush so that a's disk has both.
    let (key2, d2) = chunk_bytes(3, 1);
    put(&nodes[0], ns0, key2, &d2);
    assert_eq!(nodes[0].client().flush().expect("FLUSH").failed, 0);

    let mut cb = nodes[1].client();
    assert_eq!(cb.hello(&r0).expect("HELLO"), ns0);
    assert_eq!(cb.hello(&r1).expect("HELLO"), ns1);
    wait_present(&nodes[1], ns0, key, Duration::from_secs(15));
    wait_present(&nodes[1], ns1, key, Duration::from_secs(15));
    wait_present(&nodes[1], ns0, key2, Duration::from_secs(15));
    let r = cb.lookup(ns0, 0, &[key]).expect("LOOKUP");
    assert_eq!(
        r.locations,
        vec![LookupLocation::Peer],
        "b holds no copy yet"
    );
    assert_eq!(cb.get_bytes(ns0, 0, key).expect("GET"), Some(d0.clone()));
    assert_eq!(cb.get_bytes(ns1, 0, key).expect("GET"), Some(d1.clone()));
    // The fetched copies are admitted to b's RAM as clean: a read is now a
    // local RAM hit, and a flush writes nothing to b's disk (a and c keep
    // the durable copies).
    let r = cb.lookup(ns0, 0, &[key]).expect("LOOKUP");
    assert_eq!(r.locations, vec![LookupLocation::Ram], "admitted to RAM");
    let fl = cb.flush().expect("FLUSH");
    assert_eq!((fl.chunks, fl.failed), (0, 0), "{fl:?}");
    let st = cb.stats().expect("STATS");
    assert_eq!(st["store"]["disk_writes"], 0, "{}", st["store"]);
    assert_eq!(st["store"]["disk_chunks"], 0, "{}", st["store"]);
    assert_eq!(st["store"]["dirty_bytes"], 0, "{}", st["store"]);
    // CLUSTER_LOOKUP on b sees both ranks' chunks.
    let cl = cb
        .cluster_lookup(&r0, &[0, 1], 0, &[key])
        .expect("CLUSTER_LOOKUP");
    assert_eq!(cl.min_prefix, 1, "{cl:?}");

    // `kvtier peers --json` on b lists a and c up.
    let out = run_kvtier(
        &[
            "peers",
            "--json",
            "--socket",
            nodes[1].socket.to_str().expect("utf-8 path"),
        ],
        &[],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let peers: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let peers = peers.as_array().expect("a list");
    assert_eq!(peers.len(), 2, "{peers:?}");
    for p in peers {
        assert_eq!(p["state"], "up", "{p}");
        for k in ["name", "addr", "chunks", "bytes"] {
            assert!(p.get(k).is_some(), "{k} missing in {p}");
        }
    }

    // Per-peer Prometheus metrics and the `peers` field of /status.
    let http = nodes[1].http.expect("http enabled");
    let metrics = http_get(http, "/metrics");
    assert!(
        metrics.contains("kvtier_peer_up{peer=\"a\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("kvtier_peer_fetched_bytes_total{peer=\"a\"}"),
        "{metrics}"
    );
    let status: serde_json::Value = serde_json::from_str(
        http_get(http, "/status")
            .split("\r\n\r\n")
            .nth(1)
            .expect("body"),
    )
    .expect("status json");
    assert_eq!(status["peers"].as_array().map(Vec::len), Some(2));

    // SIGKILL a: b marks it down, and a GET of a chunk only a had is a
    // fast miss.
    nodes[0].kill9();
    poll("a down at b", Duration::from_secs(10), || {
        (peer_state(&nodes[1], "a").as_deref() == Some("down")).then_some(())
    });
    let t = Instant::now();
    assert_eq!(cb.get_bytes(ns0, 0, key2).expect("GET"), None);
    assert!(
        t.elapsed() < Duration::from_millis(900),
        "miss took {:?}",
        t.elapsed()
    );
    let r = cb.lookup(ns0, 0, &[key2]).expect("LOOKUP");
    assert_eq!(r.prefix, 0, "a down peer's chunks are not offered");

    // a restarts with its disk content: b re-syncs and fetches key2.
    nodes[0] = start_node(dir.path(), "a", &tls[0], ports[0], &others(0))
        .unwrap_or_else(|e| panic!("restart a: {e}"));
    poll("a up again at b", Duration::from_secs(15), || {
        (peer_state(&nodes[1], "a").as_deref() == Some("up")).then_some(())
    });
    wait_present(&nodes[1], ns0, key2, Duration::from_secs(15));
    assert_eq!(cb.get_bytes(ns0, 0, key2).expect("GET"), Some(d2));
}

#[test]
fn cluster_lookup_reports_ram_on_each_ranks_own_node() {
    let dir = tempfile::tempdir().expect("temp dir");
    let Two {
        a,
        mut b,
        b_tls,
        ports,
    } = two_nodes(dir.path());
    // The daemons start first and the engines later: the links are up
    // before either rank says HELLO, so the records of namespaces
    // registered then must reach the peers as well (they were sent only
    // when a link came up: a saw rank 1's chunks but not its rank).
    for (d, peer) in [(&a, "b"), (&b, "a")] {
        poll("the link up", Duration::from_secs(15), || {
            (peer_state(d, peer).as_deref() == Some("up")).then_some(())
        });
    }
    // Tensor parallelism, one rank per node: rank 0's engine on a, rank 1's
    // on b, the same three keys each; a fourth key nobody has.
    let (r0, r1) = (test_record(0), test_record(1));
    let ns0 = a.client().hello(&r0).expect("HELLO");
    let ns1 = b.client().hello(&r1).expect("HELLO");
    let keys: Vec<ChunkKey> = (0..4).map(|i| chunk_bytes(40, i).0).collect();
    for (i, k) in (0u32..).zip(&keys[..3]) {
        put(&a, ns0, *k, &chunk_bytes(40, i).1);
        put(&b, ns1, *k, &chunk_bytes(41, i).1);
    }
    // The scheduler on a asks for both ranks.
    let ranks = |d: &Daemon| -> Vec<(u32, u32, u32)> {
        let cl = d
            .client()
            .cluster_lookup(&r0, &[0, 1], 0, &keys)
            .expect("CLUSTER_LOOKUP");
        cl.ranks
            .iter()
            .map(|r| (r.rank, r.prefix, r.ram_prefix))
            .collect()
    };
    let want = |w: Vec<(u32, u32, u32)>, what: &str| {
        let mut last = Vec::new();
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(15) {
            last = ranks(&a);
            if last == w {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("{what}: CLUSTER_LOOKUP on a says {last:?}, want {w:?}");
    };
    // Rank 1's three chunks are in b's RAM, which a knows from the sync.
    want(vec![(0, 3, 3), (1, 3, 3)], "rank 1 in b's RAM");
    // b restarts: its chunks are on its disk only, and its snapshot says so.
    assert_eq!(b.client().flush().expect("FLUSH").failed, 0);
    assert_eq!(b.stop_with(libc::SIGTERM).code(), Some(0), "{}", b.log());
    b = start_node(dir.path(), "b", &b_tls, ports[1], &[ports[0]])
        .unwrap_or_else(|e| panic!("restart b: {e}"));
    want(vec![(0, 3, 3), (1, 3, 0)], "rank 1 on b's disk only");
    // A read on b promotes the first chunk into its RAM; a hears of it.
    let mut cb = b.client();
    assert_eq!(cb.hello(&r1).expect("HELLO"), ns1);
    assert_eq!(
        cb.get_bytes(ns1, 0, keys[0]).expect("GET"),
        Some(chunk_bytes(41, 0).1)
    );
    want(
        vec![(0, 3, 3), (1, 3, 1)],
        "rank 1's first chunk promoted on b",
    );
}

#[test]
fn a_node_from_another_ca_is_refused() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ca = make_ca(dir.path(), "good", "test");
    // Same cluster name, different CA key.
    let evil_ca = make_ca(dir.path(), "evil", "test");
    let ports = free_ports(2);
    let a_tls = issue(dir.path(), &ca, "a");
    let x_tls = issue(dir.path(), &evil_ca, "x");
    let a = start_node(dir.path(), "a", &a_tls, ports[0], &[ports[1]])
        .unwrap_or_else(|e| panic!("{e}"));
    let x = start_node(dir.path(), "x", &x_tls, ports[1], &[ports[0]])
        .unwrap_or_else(|e| panic!("{e}"));
    // Both sides refuse the other's certificate and say why.
    for (d, who) in [(&a, "a"), (&x, "x")] {
        poll(
            "a logged certificate refusal",
            Duration::from_secs(15),
            || d.log().contains("refused peer certificate").then_some(()),
        );
        let doc = d.client().stats().expect("STATS");
        let peers = doc["peers"].as_array().expect("peers").clone();
        assert_eq!(peers.len(), 1, "{who}: {peers:?}");
        assert_eq!(peers[0]["state"], "down", "{who}: {peers:?}");
        assert!(
            peers[0]["name"].is_null(),
            "{who} never learned a name: {peers:?}"
        );
    }
    // Each says why the link is down, in STATS and `kvtier peers`, and
    // logs it at warn, also on the refused side (it said only "connection
    // lost", at debug after the first attempt: QA).
    for (d, who) in [(&a, "a"), (&x, "x")] {
        let err = poll("a last_error", Duration::from_secs(15), || {
            let doc = d.client().stats().ok()?;
            doc["peers"][0]["last_error"].as_str().map(str::to_owned)
        });
        assert!(!err.is_empty(), "{who}");
        assert!(
            d.log().contains("cannot connect to peer"),
            "{who} logged no warning: {}",
            d.log()
        );
        let sock = d.socket.to_string_lossy().into_owned();
        let out = run_kvtier(&["peers", "--socket", &sock], &[]);
        let table = String::from_utf8_lossy(&out.stdout);
        assert!(table.contains("last connect failed: "), "{who}: {table}");
    }
    // Retries of the same refusal go to debug: at most one warn line per
    // side of the handshake and reason (QA: 13 lines per node in 28 s, for
    // good). Wait for a few more retries first.
    std::thread::sleep(Duration::from_secs(3));
    for (d, who) in [(&a, "a"), (&x, "x")] {
        let log = d.log();
        let n = log
            .matches("\"message\":\"refused peer certificate")
            .count();
        assert!(n <= 2, "{who} warned {n} times: {log}");
        let n = log
            .matches("\"message\":\"inbound peer handshake failed")
            .count();
        assert!(n <= 1, "{who} warned {n} times: {log}");
    }
}

/// A seed listed twice, and a second address of a peer already linked
/// (`localhost` or the IPv4-mapped `[::ffff:127.0.0.1]` beside
/// `127.0.0.1`), are one peer: one row, one metric
/// series (three rows and three series made Prometheus reject the scrape:
/// QA).
#[test]
fn a_peer_listed_twice_or_by_two_addresses_is_one_peer() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ca = make_ca(dir.path(), "cluster", "test");
    let ports = free_ports(2);
    let a_tls = issue(dir.path(), &ca, "a");
    let b_tls = issue(dir.path(), &ca, "b");
    let b = start_node(dir.path(), "b", &b_tls, ports[1], &[ports[0]])
        .unwrap_or_else(|e| panic!("b: {e}"));
    let nd = dir.path().join("a");
    std::fs::create_dir_all(&nd).expect("node dir");
    let listen = format!("127.0.0.1:{}", ports[0]);
    let seeds = format!(
        "127.0.0.1:{p},localhost:{p},127.0.0.1:{p},[::ffff:127.0.0.1]:{p}",
        p = ports[1]
    );
    let a = Daemon::start(
        &nd,
        &[
            "--node-name",
            "a",
            "--peer-listen",
            &listen,
            "--tls-dir",
            a_tls.to_str().expect("utf-8"),
            "--peers",
            &seeds,
        ],
        &ENV,
    )
    .unwrap_or_else(|e| panic!("a: {e}"));
    poll("b up at a", Duration::from_secs(15), || {
        (peer_state(&a, "b").as_deref() == Some("up")).then_some(())
    });
    // The alias is dialled and skipped (or never resolves): either way it
    // ends as no row.
    poll("one row for b", Duration::from_secs(15), || {
        let doc = a.client().stats().ok()?;
        (doc["peers"].as_array()?.len() == 1).then_some(())
    });
    assert!(a.log().contains("peer listed twice"), "{}", a.log());
    drop(b);
}

#[test]
fn corrupt_bytes_on_the_holders_disk_are_never_served_to_a_peer() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ca = make_ca(dir.path(), "cluster", "test");
    let ports = free_ports(2);
    let a_tls = issue(dir.path(), &ca, "a");
    let b_tls = issue(dir.path(), &ca, "b");
    let mut a = start_node(dir.path(), "a", &a_tls, ports[0], &[ports[1]])
        .unwrap_or_else(|e| panic!("{e}"));
    let rec = test_record(0);
    let ns = a.client().hello(&rec).expect("HELLO");
    let chunks: Vec<(ChunkKey, Vec<u8>)> = (0..16).map(|i| chunk_bytes(7, i)).collect();
    for (k, v) in &chunks {
        put(&a, ns, *k, v);
    }
    assert_eq!(a.client().flush().expect("FLUSH").failed, 0);
    a.kill9();
    // Flip one byte every 16 KiB of the written part of a's store files.
    let mut flipped = 0;
    for entry in std::fs::read_dir(&a.data_dir).expect("data dir").flatten() {
        use std::os::unix::fs::FileExt;
        let path = entry.path();
        if !path.is_file() || path.file_name() == Some(std::ffi::OsStr::new("LOCK")) {
            continue;
        }
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .expect("open");
        let len = f.metadata().expect("stat").len().min(32 << 20);
        let mut bytes = vec![0u8; usize::try_from(len).expect("fits")];
        f.read_exact_at(&mut bytes, 0).expect("read");
        let written = bytes.iter().rposition(|b| *b != 0).map_or(0, |p| p + 1);
        let mut off = 8192;
        while off < written {
            bytes[off] ^= 0x5a;
            flipped += 1;
            off += 16 << 10;
        }
        f.write_all_at(&bytes, 0).expect("write");
        f.sync_all().expect("sync");
    }
    assert!(flipped > 0);
    let a = start_node(dir.path(), "a", &a_tls, ports[0], &[ports[1]])
        .unwrap_or_else(|e| panic!("{e}"));
    let b = start_node(dir.path(), "b", &b_tls, ports[1], &[ports[0]])
        .unwrap_or_else(|e| panic!("{e}"));
    let mut cb = b.client();
    cb.hello(&rec).expect("HELLO");
    // Whatever a's index still offers after recovery reaches b's view.
    let offered = a
        .client()
        .lookup(ns, 0, &chunks.iter().map(|c| c.0).collect::<Vec<_>>());
    let offered = offered.expect("LOOKUP on a");
    let held = |l: &&LookupLocation| **l != LookupLocation::Miss;
    if offered.locations.iter().any(|l| held(&l)) {
        let first = chunks
            .iter()
            .zip(&offered.locations)
            .find(|(_, l)| held(l))
            .map(|(c, _)| c.0)
            .expect("one offered");
        wait_present(&b, ns, first, Duration::from_secs(15));
    }
    let mut served = 0;
    for (k, want) in &chunks {
        if let Some(got) = cb.get_bytes(ns, 0, *k).expect("GET") {
            assert!(got == *want, "chunk {k} reached b with corrupt bytes");
            served += 1;
        }
    }
    assert!(
        served < chunks.len(),
        "{served} of {} chunks served despite {flipped} flipped bytes",
        chunks.len()
    );
}

#[test]
fn peer_configuration_contradictions_are_refused() {
    let dir = tempfile::tempdir().expect("temp dir");
    let data = dir.path().join("data");
    let base = [
        "config",
        "check",
        "--data-dir",
        data.to_str().expect("utf-8 path"),
        "--disk-budget",
        "0",
    ];
    let cases: [(&[&str], &str); 7] = [
        (
            &["--peer-listen", "0.0.0.0:7401", "--insecure-dev"],
            "peer-listen",
        ),
        // A port no peer can be dialled on is refused at start (it failed
        // only at each connect: QA).
        (
            &[
                "--peer-listen",
                "127.0.0.1:0",
                "--insecure-dev",
                "--peers",
                "127.0.0.1:99999",
            ],
            "port of 1 to 65535",
        ),
        (
            &[
                "--peer-listen",
                "127.0.0.1:0",
                "--insecure-dev",
                "--peers",
                "127.0.0.1:0",
            ],
            "port of 1 to 65535",
        ),
        (
            &[
                "--peer-listen",
                "127.0.0.1:0",
                "--insecure-dev",
                "--peers",
                ":7401",
            ],
            "is not host:port",
        ),
        (&["--peer-listen", "127.0.0.1:0"], "tls-dir"),
        (&["--peers", "127.0.0.1:7401"], "peers"),
        (
            &[
                "--peer-listen",
                "127.0.0.1:0",
                "--insecure-dev",
                "--peers",
                "10.1.2.3:7401",
            ],
            "peers",
        ),
    ];
    for (extra, key) in cases {
        let mut args: Vec<&str> = base.to_vec();
        args.extend_from_slice(extra);
        let out = run_kvtier(&args, &[]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{extra:?} accepted");
        assert!(
            err.contains(key),
            "{extra:?}: error does not name {key}: {err}"
        );
    }
    // Loopback-only insecure development mode is fine.
    let mut args: Vec<&str> = base.to_vec();
    args.extend_from_slice(&[
        "--peer-listen",
        "127.0.0.1:0",
        "--insecure-dev",
        "--peers",
        "localhost:7401",
    ]);
    let out = run_kvtier(&args, &[]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// One RESP command over a fresh connection; returns the raw reply.
fn resp(addr: std::net::SocketAddr, args: &[&[u8]]) -> Vec<u8> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("connect resp");
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let mut req = format!("*{}\r\n", args.len()).into_bytes();
    for a in args {
        req.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        req.extend_from_slice(a);
        req.extend_from_slice(b"\r\n");
    }
    s.write_all(&req).expect("write");
    let mut out = Vec::new();
    let mut buf = [0u8; 65536];
    // Read until the reply is complete: a simple string/integer line, or a
    // bulk string with its announced length.
    loop {
        let n = s.read(&mut buf).expect("read");
        assert!(n > 0, "connection closed: {out:?}");
        out.extend_from_slice(&buf[..n]);
        if out.first() == Some(&b'$') {
            if let Some(eol) = out.windows(2).position(|w| w == b"\r\n") {
                let len: i64 = std::str::from_utf8(&out[1..eol])
                    .expect("utf-8")
                    .parse()
                    .expect("length");
                if len < 0 || out.len() >= eol + 2 + len as usize + 2 {
                    return out;
                }
            }
        } else if out.ends_with(b"\r\n") {
            return out;
        }
    }
}

#[test]
fn resp_set_on_one_node_is_found_by_get_and_exists_on_another() {
    let dir = tempfile::tempdir().expect("temp dir");
    let Two { a, b, .. } = two_nodes(dir.path());
    let (ra, rb) = (a.resp.expect("resp on a"), b.resp.expect("resp on b"));
    let value: Vec<u8> = (0..300_000u32).map(|i| (i * 13 % 251) as u8).collect();
    assert_eq!(resp(ra, &[b"SET", b"lmcache:key:1", &value]), b"+OK\r\n");
    poll("EXISTS on b", Duration::from_secs(15), || {
        (resp(rb, &[b"EXISTS", b"lmcache:key:1"]) == b":1\r\n").then_some(())
    });
    let got = resp(rb, &[b"GET", b"lmcache:key:1"]);
    let mut want = format!("${}\r\n", value.len()).into_bytes();
    want.extend_from_slice(&value);
    want.extend_from_slice(b"\r\n");
    assert!(
        got == want,
        "GET on b returned {} bytes, not the value",
        got.len()
    );
    assert_eq!(resp(rb, &[b"EXISTS", b"lmcache:other"]), b":0\r\n");
}

/// An LMCache value read on a node that never SET one in its namespace is
/// kept there once fetched: the namespace is registered from the record
/// its holder publishes (QA: fetched from the peer again on every GET).
/// A plain RESP value is still read from its holder each time.
#[test]
fn an_lmcache_value_fetched_by_a_node_that_never_set_one_is_kept() {
    let dir = tempfile::tempdir().expect("temp dir");
    let Two { a, b, .. } = two_nodes(dir.path());
    let (ra, rb) = (a.resp.expect("resp on a"), b.resp.expect("resp on b"));
    let key: &[u8] = b"qa-model@2@0@5eed1234abcd@bfloat16";
    let value: Vec<u8> = (0..200_000u32).map(|i| (i * 7 % 251) as u8).collect();
    assert_eq!(resp(ra, &[b"SET", key, &value]), b"+OK\r\n");
    assert_eq!(resp(ra, &[b"SET", b"plain:1", b"v"]), b"+OK\r\n");
    poll("EXISTS on b", Duration::from_secs(15), || {
        (resp(rb, &[b"EXISTS", key]) == b":1\r\n"
            && resp(rb, &[b"EXISTS", b"plain:1"]) == b":1\r\n")
            .then_some(())
    });
    let mut want = format!("${}\r\n", value.len()).into_bytes();
    want.extend_from_slice(&value);
    want.extend_from_slice(b"\r\n");
    for _ in 0..3 {
        assert!(resp(rb, &[b"GET", key]) == want, "GET on b: other bytes");
        assert_eq!(resp(rb, &[b"GET", b"plain:1"]), b"$1\r\nv\r\n");
    }
    // One fetch of the LMCache value (then RAM hits), three of the plain one.
    assert_eq!(peer_field(&b, "a", "fetches_ok"), Some(4));
    let st = b.client().stats().expect("STATS");
    assert_eq!(st["store"]["hits_ram"], 2, "{}", st["store"]);
}

#[test]
fn a_stopped_peer_never_hangs_a_get_past_its_timeout() {
    let dir = tempfile::tempdir().expect("temp dir");
    let Two { a, b, .. } = two_nodes(dir.path());
    let rec = test_record(0);
    let ns = a.client().hello(&rec).expect("HELLO");
    let mut cb = b.client();
    cb.hello(&rec).expect("HELLO");
    let keys: Vec<(ChunkKey, Vec<u8>)> = (0..3).map(|i| chunk_bytes(9, i)).collect();
    for (k, v) in &keys {
        put(&a, ns, *k, v);
    }
    for (k, _) in &keys {
        wait_present(&b, ns, *k, Duration::from_secs(15));
    }
    // Freeze a (a partition, as seen from b): every GET on b ends within the
    // fetch timeout (1s) plus scheduling margin, as a miss.
    kvtier_tests::freeze(a.pid());
    for (k, _) in &keys {
        let t = Instant::now();
        let got = cb.get_bytes(ns, 0, *k).expect("GET");
        // Seen once under heavy load: the bytes came back although a was
        // stopped. Say where they came from if it happens again.
        if got.is_some() {
            let stats = cb.stats().map(|s| s.to_string()).unwrap_or_default();
            panic!(
                "GET on b returned {} bytes after a was stopped ({:?} after the signal); b's STATS: {stats}; a's state at b: {:?}; b's log:\n{}",
                got.map_or(0, |g| g.len()),
                t.elapsed(),
                peer_state(&b, "a"),
                b.log()
            );
        }
        assert!(
            t.elapsed() < Duration::from_millis(2500),
            "GET took {:?}",
            t.elapsed()
        );
    }
    poll("a down at b", Duration::from_secs(10), || {
        (peer_state(&b, "a").as_deref() == Some("down")).then_some(())
    });
    kvtier_tests::signal(a.pid(), libc::SIGCONT);
    poll("a up again at b", Duration::from_secs(15), || {
        (peer_state(&b, "a").as_deref() == Some("up")).then_some(())
    });
    wait_present(&b, ns, keys[0].0, Duration::from_secs(15));
    assert_eq!(
        cb.get_bytes(ns, 0, keys[0].0).expect("GET"),
        Some(keys[0].1.clone())
    );
}

/// Registers the rank-0 test namespace on both nodes and PUTs `n` chunks
/// of `round` on a, waiting until b sees each of them at a.
fn a_holds(t: &Two, round: u32, n: u32) -> (Namespace, Vec<(ChunkKey, Vec<u8>)>) {
    let rec = test_record(0);
    let ns = t.a.client().hello(&rec).expect("HELLO");
    t.b.client().hello(&rec).expect("HELLO");
    let keys: Vec<(ChunkKey, Vec<u8>)> = (0..n).map(|i| chunk_bytes(round, i)).collect();
    for (k, v) in &keys {
        put(&t.a, ns, *k, v);
    }
    for (k, _) in &keys {
        wait_present(&t.b, ns, *k, Duration::from_secs(15));
    }
    (ns, keys)
}

/// A peer row's number field on `d` (its STATS), by peer name.
fn peer_field(d: &Daemon, name: &str, field: &str) -> Option<u64> {
    let doc = d.client().stats().ok()?;
    doc["peers"]
        .as_array()?
        .iter()
        .find(|p| p["name"] == name)?[field]
        .as_u64()
}

/// A client that hangs up while its GET waits for peer fetches ends that
/// GET: the fetches are dropped (not run to their timeout for nobody, and
/// not counted as failures or as still in flight), and the rest of the
/// GET's keys are never asked for.
#[test]
fn a_get_whose_client_hung_up_stops_fetching_from_peers() {
    use node::native::codec::{RegionEntry, Request};
    let dir = tempfile::tempdir().expect("temp dir");
    let two = two_nodes(dir.path());
    let (ns, keys) = a_holds(&two, 11, 40);
    let Two { a, b, .. } = two;
    let mut c = b.client();
    let slot = 300 * 1024;
    c.create_region((slot * keys.len()) as u64).expect("region");
    let entries: Vec<RegionEntry> = keys
        .iter()
        .enumerate()
        .map(|(i, (k, _))| RegionEntry {
            key: *k,
            offset: (i * slot) as u64,
            len: slot as u64,
        })
        .collect();
    // a frozen: b's fetches wait for their timeout (1 s).
    kvtier_tests::freeze(a.pid());
    c.send(&Request::Get {
        ns,
        group: 0,
        entries,
    })
    .expect("send GET");
    poll("b fetching from a", Duration::from_millis(800), || {
        (peer_field(&b, "a", "fetches_in_flight")? > 0).then_some(())
    });
    drop(c);
    poll("b's fetches dropped", Duration::from_millis(800), || {
        (peer_field(&b, "a", "fetches_in_flight")? == 0).then_some(())
    });
    // Past the fetch timeout, nothing of that GET ran on to fail.
    std::thread::sleep(Duration::from_millis(1500));
    let doc = b.client().stats().expect("STATS");
    assert_eq!(
        peer_field(&b, "a", "fetches_failed"),
        Some(0),
        "fetches of the abandoned GET ran to their timeout; b's STATS: {doc}"
    );
    assert_eq!(peer_field(&b, "a", "fetches_in_flight"), Some(0));
    assert_eq!(doc["counters"]["native-abandoned"], 1, "STATS: {doc}");
    // Abandoned, not answered: no request error (an engine that died
    // raised the error-rate alert).
    assert_eq!(doc["counters"]["native-errors"], 0, "STATS: {doc}");
    // The reads it dropped while they waited for a are misses (they
    // counted nowhere: review); none was a hit.
    assert!(doc["store"]["misses"].as_u64() > Some(0), "STATS: {doc}");
    assert_eq!(doc["store"]["hits_peer"], 0, "STATS: {doc}");
    kvtier_tests::signal(a.pid(), libc::SIGCONT);
    // The connection's end leaves b serving: a's chunks come back.
    poll("a up again at b", Duration::from_secs(15), || {
        (peer_state(&b, "a").as_deref() == Some("up")).then_some(())
    });
    assert_eq!(
        b.client().get_bytes(ns, 0, keys[0].0).expect("GET"),
        Some(keys[0].1.clone())
    );
}

/// A client that only shut its sending side (done asking, still reading)
/// gets the reply of a GET that waited for a peer: only a client gone both
/// ways abandons its GET.
#[test]
fn a_half_closed_client_still_gets_its_get_reply() {
    use node::native::codec::{GetStatus, RegionEntry, Reply, Request, Response};
    let dir = tempfile::tempdir().expect("temp dir");
    let two = two_nodes(dir.path());
    let (ns, keys) = a_holds(&two, 12, 1);
    let Two { a, b, .. } = two;
    let (k, v) = &keys[0];
    let mut c = b.client();
    c.create_region(v.len() as u64).expect("region");
    kvtier_tests::freeze(a.pid());
    c.send(&Request::Get {
        ns,
        group: 0,
        entries: vec![RegionEntry {
            key: *k,
            offset: 0,
            len: v.len() as u64,
        }],
    })
    .expect("send GET");
    poll("b fetching from a", Duration::from_millis(800), || {
        (peer_field(&b, "a", "fetches_in_flight")? > 0).then_some(())
    });
    c.stream()
        .shutdown(std::net::Shutdown::Write)
        .expect("shutdown");
    // The fetch times out (1 s, a is frozen): a miss, answered.
    let (_, reply) = c.recv().expect("a half-closed client gets its reply");
    kvtier_tests::signal(a.pid(), libc::SIGCONT);
    match reply {
        Reply::Ok(Response::Get { results }) => {
            assert_eq!(results.len(), 1);
            assert_eq!(results[0].status, GetStatus::Miss, "{results:?}");
        }
        other => panic!("GET reply: {other:?}"),
    }
    let doc = b.client().stats().expect("STATS");
    assert_eq!(doc["counters"]["native-abandoned"], 0, "STATS: {doc}");
}

/// A different node taking over a peer's address starts with its own
/// counters (the old node's fetched bytes were shown as the new one's:
/// QA); a node answering with this node's own name is a warning, not a
/// silent self-skip.
#[test]
fn another_node_at_a_peers_address_starts_its_own_counters() {
    let dir = tempfile::tempdir().expect("temp dir");
    let Two { a, b, ports, .. } = two_nodes(dir.path());
    let r0 = test_record(0);
    let ns = b.client().hello(&r0).expect("HELLO");
    let (key, data) = chunk_bytes(7, 1);
    put(&b, ns, key, &data);
    let mut ca = a.client();
    assert_eq!(ca.hello(&r0).expect("HELLO"), ns);
    wait_present(&a, ns, key, Duration::from_secs(15));
    assert_eq!(ca.get_bytes(ns, 0, key).expect("GET"), Some(data));
    let fetched = |d: &Daemon, name: &str| -> Option<u64> {
        let doc = d.client().stats().ok()?;
        doc["peers"]
            .as_array()?
            .iter()
            .find(|p| p["name"] == name)
            .and_then(|p| p["bytes_fetched"].as_u64())
    };
    assert!(fetched(&a, "b").is_some_and(|n| n > 0));
    drop(b);
    // Node c (its own certificate) now listens where b did.
    let ca_dir = dir.path().join("cluster-ca");
    let c_tls = issue(dir.path(), &ca_dir, "c");
    let _c = start_node(dir.path(), "c", &c_tls, ports[1], &[ports[0]])
        .unwrap_or_else(|e| panic!("c: {e}"));
    poll("c up at a", Duration::from_secs(20), || {
        (peer_state(&a, "c").as_deref() == Some("up")).then_some(())
    });
    assert_eq!(fetched(&a, "c"), Some(0), "b's counters were carried over");
    // A second "a" (the same certificate, copied) dialled by a.
    let a2_port = free_ports(1)[0];
    let a_tls = dir.path().join("a").join("tls");
    let nd = dir.path().join("a2");
    std::fs::create_dir_all(&nd).expect("node dir");
    let listen = format!("127.0.0.1:{a2_port}");
    let seeds = format!("127.0.0.1:{}", ports[0]);
    let a2 = Daemon::start(
        &nd,
        &[
            "--node-name",
            "a",
            "--peer-listen",
            &listen,
            "--tls-dir",
            a_tls.to_str().expect("utf-8"),
            "--peers",
            &seeds,
        ],
        &ENV,
    )
    .unwrap_or_else(|e| panic!("a2: {e}"));
    poll(
        "a2 warns of the shared name",
        Duration::from_secs(15),
        || {
            a2.log()
                .contains("presents this node's own name")
                .then_some(())
        },
    );
}

/// A node that dials us without being in our seed list is served, and
/// what it was served is counted under its name (it was counted nowhere:
/// QA).
#[test]
fn bytes_served_to_a_node_not_in_our_peers_are_counted() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ca = make_ca(dir.path(), "cluster", "test");
    let ports = free_ports(2);
    let a_tls = issue(dir.path(), &ca, "a");
    let d_tls = issue(dir.path(), &ca, "d");
    let a = start_node(dir.path(), "a", &a_tls, ports[0], &[]).unwrap_or_else(|e| panic!("a: {e}"));
    let d = start_node(dir.path(), "d", &d_tls, ports[1], &[ports[0]])
        .unwrap_or_else(|e| panic!("d: {e}"));
    let r0 = test_record(0);
    let ns = a.client().hello(&r0).expect("HELLO");
    let (key, data) = chunk_bytes(9, 1);
    put(&a, ns, key, &data);
    let mut cd = d.client();
    assert_eq!(cd.hello(&r0).expect("HELLO"), ns);
    wait_present(&d, ns, key, Duration::from_secs(15));
    assert_eq!(cd.get_bytes(ns, 0, key).expect("GET"), Some(data.clone()));
    let doc = a.client().stats().expect("STATS");
    assert_eq!(
        doc["served_unlisted"]["d"].as_u64(),
        Some(data.len() as u64),
        "{}",
        doc["served_unlisted"]
    );
    // The served count of d in a's /metrics.
    let served_metric = || {
        let metrics = http_get(a.http.expect("http"), "/metrics");
        kvtier_tests::metric(&metrics, "kvtier_peer_served_bytes_total{peer=\"d\"}")
    };
    assert_eq!(served_metric(), Some(data.len() as f64));
    let sock = a.socket.to_string_lossy().into_owned();
    let out = run_kvtier(&["peers", "--socket", &sock], &[]);
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        table.contains("d (not in peers, dials this node): served"),
        "{table}"
    );
    // Once d is gone it no longer dials this node: no row (a name seen
    // once stayed listed for good: QA); the metric keeps its count.
    drop(cd);
    drop(d);
    poll("d's row gone", Duration::from_secs(15), || {
        let doc = a.client().stats().ok()?;
        doc["served_unlisted"].get("d").is_none().then_some(())
    });
    assert_eq!(served_metric(), Some(data.len() as f64));
}

/// Two `--insecure-dev` nodes started as docs/scale-out.md shows, without
/// node names, link: each is named after its peer port (both were
/// `kvtier-dev`, so each skipped the other as itself), and what one serves
/// the other is counted under the other's name (the throw-away
/// certificate's common name was rcgen's default, a phantom peer).
#[test]
fn insecure_dev_nodes_without_names_link_and_count_under_their_names() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ports = free_ports(2);
    let start = |i: usize| {
        let nd = dir.path().join(format!("n{i}"));
        std::fs::create_dir_all(&nd).expect("node dir");
        let listen = format!("127.0.0.1:{}", ports[i]);
        let seed = format!("127.0.0.1:{}", ports[1 - i]);
        Daemon::start(
            &nd,
            &["--peer-listen", &listen, "--peers", &seed, "--insecure-dev"],
            &ENV,
        )
        .unwrap_or_else(|e| panic!("node {i}: {e}"))
    };
    let a = start(0);
    let b = start(1);
    for (d, other) in [(&a, ports[1]), (&b, ports[0])] {
        let name = format!("dev-{other}");
        poll("the other node up", Duration::from_secs(15), || {
            (peer_state(d, &name).as_deref() == Some("up")).then_some(())
        });
    }
    for d in [&a, &b] {
        let doc = d.client().stats().expect("STATS");
        assert_eq!(
            doc["served_unlisted"],
            serde_json::json!({}),
            "a phantom peer: {doc}"
        );
    }
}

/// `config check` refuses what `node start` refuses beyond the keys
/// themselves (QA: it said OK to each of these, then the start failed): a
/// tls-dir without certificates, a node name the certificate does not
/// carry, and sizes an existing store was not created with.
#[test]
fn config_check_refuses_what_the_start_refuses() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ca = make_ca(dir.path(), "good", "test");
    let tls = issue(dir.path(), &ca, "spark1");
    let data = dir.path().join("data");
    let d = data.to_str().expect("utf-8 path");
    let tls = tls.to_str().expect("utf-8 path");
    let missing = dir.path().join("nope");
    let missing = missing.to_str().expect("utf-8 path");
    let peer = ["--peer-listen", "127.0.0.1:0", "--disk-budget", "0"];
    let cases: [(&[&str], &str); 2] = [
        (&["--tls-dir", missing], "nope"),
        (&["--tls-dir", tls, "--node-name", "spark9"], "node-name"),
    ];
    for (extra, said) in cases {
        let args = [&["config", "check", "--data-dir", d][..], &peer, extra].concat();
        let out = run_kvtier(&args, &[]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{extra:?} accepted");
        assert!(err.contains(said), "{extra:?}: {err}");
    }
    let args = [
        &["config", "check", "--data-dir", d, "--tls-dir", tls][..],
        &peer,
    ]
    .concat();
    let out = run_kvtier(&args, &[]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!String::from_utf8_lossy(&out.stdout).contains("chmod 600"));
    // A node key others can read is warned about (QA: accepted silently).
    let key = Path::new(tls).join("node.key");
    std::fs::set_permissions(&key, std::os::unix::fs::PermissionsExt::from_mode(0o644))
        .expect("chmod");
    let out = run_kvtier(&args, &[]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        said.contains("# WARNING:") && said.contains("chmod 600"),
        "{said}"
    );
    // A store of 1 MiB regions, then a config with 2 MiB ones.
    let nd = dir.path().join("node");
    std::fs::create_dir_all(&nd).expect("node dir");
    let mut args = kvtier_tests::test_args(&nd);
    kvtier_tests::set_flag(&mut args, "--region-size", "1MiB");
    kvtier_tests::set_flag(&mut args, "--disk-budget", "16MiB");
    let node = Daemon::start_args(&nd, &args, &ENV).unwrap_or_else(|e| panic!("{e}"));
    let d = node.data_dir.to_str().expect("utf-8 path").to_owned();
    let d = d.as_str();
    drop(node);
    let out = run_kvtier(
        &[
            "config",
            "check",
            "--data-dir",
            d,
            "--disk-budget",
            "16MiB",
            "--region-size",
            "2MiB",
        ],
        &[],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "a region size the store refuses was accepted"
    );
    assert!(err.contains("region-size"), "{err}");
}

/// A RESP value read on another node is served from its holder each time,
/// never cached there: a DEL or an overwrite on the holder is not undone by
/// a copy elsewhere (a fetched copy was admitted and announced, so the
/// holder fetched a deleted value back from it, and the reader kept
/// serving the old value after the holder's overwrite: review).
#[test]
fn a_resp_value_deleted_or_overwritten_on_its_holder_never_comes_back_through_a_peer() {
    let dir = tempfile::tempdir().expect("temp dir");
    let Two { a, b, .. } = two_nodes(dir.path());
    let (ra, rb) = (a.resp.expect("resp on a"), b.resp.expect("resp on b"));
    let bulk = |v: &[u8]| {
        let mut w = format!("${}\r\n", v.len()).into_bytes();
        w.extend_from_slice(v);
        w.extend_from_slice(b"\r\n");
        w
    };
    // a registers the default RESP namespace with a key of its own (a
    // node that never wrote a namespace admits nothing into it).
    assert_eq!(resp(ra, &[b"SET", b"a:own", b"x"]), b"+OK\r\n");
    assert_eq!(resp(rb, &[b"SET", b"user:43", b"v1"]), b"+OK\r\n");
    poll("user:43 on a", Duration::from_secs(15), || {
        (resp(ra, &[b"EXISTS", b"user:43"]) == b":1\r\n").then_some(())
    });
    assert_eq!(resp(ra, &[b"GET", b"user:43"]), bulk(b"v1"));
    // A marker written on a after that GET: once b sees it, b has seen
    // every availability change a made before it (one ordered stream),
    // such as an announced copy of user:43.
    assert_eq!(resp(ra, &[b"SET", b"a:marker", b"m"]), b"+OK\r\n");
    poll("a's marker on b", Duration::from_secs(15), || {
        (resp(rb, &[b"EXISTS", b"a:marker"]) == b":1\r\n").then_some(())
    });
    assert_eq!(resp(rb, &[b"DEL", b"user:43"]), b":1\r\n");
    assert_eq!(
        resp(rb, &[b"GET", b"user:43"]),
        b"$-1\r\n",
        "the deleted value came back from a"
    );
    assert_eq!(resp(rb, &[b"EXISTS", b"user:43"]), b":0\r\n");
    assert_eq!(resp(rb, &[b"SET", b"user:43", b"v2"]), b"+OK\r\n");
    let got = poll("user:43 on a again", Duration::from_secs(15), || {
        let r = resp(ra, &[b"GET", b"user:43"]);
        (r != b"$-1\r\n").then_some(r)
    });
    assert_eq!(got, bulk(b"v2"), "a served the overwritten value");
}

/// Chunks a node serves to a peer are not its clients' hits: `hits_ram`,
/// `hits_disk`, `misses` and `bytes_out` count its own clients' reads only
/// (each chunk served was a local hit on the holder: review), and those
/// a peer served count in `hits_peer` on the node that fetched them.
#[test]
fn chunks_served_to_a_peer_are_not_counted_as_local_hits() {
    let dir = tempfile::tempdir().expect("temp dir");
    let Two { a, b, .. } = two_nodes(dir.path());
    let r0 = test_record(0);
    let ns = a.client().hello(&r0).expect("HELLO");
    let (key, data) = chunk_bytes(11, 1);
    put(&a, ns, key, &data);
    let mut cb = b.client();
    assert_eq!(cb.hello(&r0).expect("HELLO"), ns);
    wait_present(&b, ns, key, Duration::from_secs(15));
    assert_eq!(cb.get_bytes(ns, 0, key).expect("GET"), Some(data.clone()));
    let st = a.client().stats().expect("STATS");
    let store = &st["store"];
    for k in ["hits_ram", "hits_disk", "hits_peer", "misses", "bytes_out"] {
        assert_eq!(store[k], 0, "{k} on the holder: {store}");
    }
    // On the node that fetched it, a GET a peer served is a hit, not a
    // miss (QA: a node restoring from its peers showed a hit ratio of 0);
    // a key nobody holds is a miss.
    let (absent, _) = chunk_bytes(11, 2);
    assert_eq!(cb.get_bytes(ns, 0, absent).expect("GET"), None);
    let st = cb.stats().expect("STATS");
    let store = &st["store"];
    assert_eq!(store["hits_peer"], 1, "{store}");
    assert_eq!(store["misses"], 1, "{store}");
    assert_eq!(store["bytes_out"], data.len(), "{store}");
    let metrics = http_get(b.http.expect("http"), "/metrics");
    assert_eq!(
        kvtier_tests::metric(&metrics, "kvtier_hits_total{tier=\"peer\"}"),
        Some(1.0),
        "{metrics}"
    );
}

/// Concurrent GETs of one chunk that only a peer holds share one fetch
/// (QA: 8 GETs of one key made 8 fetches, each moving the chunk over the
/// network), and each gets the bytes.
#[test]
fn concurrent_gets_of_one_chunk_share_one_peer_fetch() {
    let dir = tempfile::tempdir().expect("temp dir");
    let Two { a, b, .. } = two_nodes(dir.path());
    let r0 = test_record(0);
    let ns = a.client().hello(&r0).expect("HELLO");
    let key = node::tier::ChunkKey([0x5e; 32]);
    let data: Vec<u8> = (0..3u32 << 20).map(|i| (i % 251) as u8).collect();
    put(&a, ns, key, &data);
    wait_present(&b, ns, key, Duration::from_secs(15));
    let go = std::sync::Barrier::new(8);
    std::thread::scope(|s| {
        for _ in 0..8 {
            s.spawn(|| {
                let mut c = b.client();
                assert_eq!(c.hello(&r0).expect("HELLO"), ns);
                go.wait();
                let got = c.get_bytes(ns, 0, key).expect("GET").expect("a hit");
                assert!(got == data, "other bytes");
            });
        }
    });
    assert_eq!(peer_field(&b, "a", "fetches_ok"), Some(1));
    assert_eq!(peer_field(&b, "a", "fetches_in_flight"), Some(0));
}

/// A shared fetch goes on for the GETs still waiting when the GET that
/// started it is abandoned (review: it ran inside that GET, so the next
/// waiter started the fetch again, with a fresh timeout).
#[test]
fn a_shared_fetch_outlives_the_get_that_started_it() {
    use node::native::codec::{RegionEntry, Request};
    let dir = tempfile::tempdir().expect("temp dir");
    let two = two_nodes(dir.path());
    let (ns, keys) = a_holds(&two, 13, 1);
    let Two { a, b, .. } = two;
    let key = keys[0].0;
    let mut first = b.client();
    first.create_region(1 << 20).expect("region");
    // a frozen: the fetch waits for its timeout (1 s).
    kvtier_tests::freeze(a.pid());
    let t0 = Instant::now();
    first
        .send(&Request::Get {
            ns,
            group: 0,
            entries: vec![RegionEntry {
                key,
                offset: 0,
                len: 1 << 20,
            }],
        })
        .expect("send GET");
    poll("b fetching from a", Duration::from_millis(800), || {
        (peer_field(&b, "a", "fetches_in_flight")? > 0).then_some(())
    });
    let waited = std::thread::scope(|s| {
        let second = s.spawn(|| {
            let mut c = b.client();
            c.hello(&test_record(0)).expect("HELLO");
            let t = Instant::now();
            assert_eq!(c.get_bytes(ns, 0, key).expect("GET"), None, "a is frozen");
            t.elapsed()
        });
        // The second GET joins; then the first one's client hangs up.
        std::thread::sleep(Duration::from_millis(600));
        drop(first);
        second.join().expect("second GET")
    });
    let total = t0.elapsed();
    kvtier_tests::signal(a.pid(), libc::SIGCONT);
    // One fetch, timed out once at about 1 s after the first GET; started
    // again, it would have ended about 1 s after the hang-up (1.6 s or
    // more).
    assert!(
        total < Duration::from_millis(1400),
        "the second GET waited {waited:?}, {total:?} after the first began"
    );
    assert_eq!(peer_field(&b, "a", "fetches_failed"), Some(1));
}

/// The count of peer replies that failed verification is exported in
/// `/metrics`, STATS and `/status` (the peer layer counted them, but the
/// daemon exported nothing: review). A corrupt reply itself is the peer
/// crate's test (`corrupt_payload_is_rejected`).
#[test]
fn the_corrupt_peer_reply_count_is_exported() {
    let dir = tempfile::tempdir().expect("temp dir");
    let Two { a, .. } = two_nodes(dir.path());
    let http = a.http.expect("http");
    let metrics = http_get(http, "/metrics");
    assert_eq!(
        kvtier_tests::metric(&metrics, "kvtier_peer_corrupt_replies_total"),
        Some(0.0),
        "{metrics}"
    );
    let st = a.client().stats().expect("STATS");
    assert_eq!(st["peer_corrupt_replies"], 0, "{st}");
    let status = http_get(http, "/status");
    assert!(status.contains("\"peer_corrupt_replies\": 0"), "{status}");
}

/// LMCache's keys name their chunk's content hash: a value fetched from a
/// peer is kept (admitted) as for the native engines, unlike plain RESP
/// keys, and is served after its holder is gone.
#[test]
fn lmcache_values_fetched_from_a_peer_are_kept() {
    let dir = tempfile::tempdir().expect("temp dir");
    let Two { a, mut b, .. } = two_nodes(dir.path());
    let (ra, rb) = (a.resp.expect("resp on a"), b.resp.expect("resp on b"));
    // a registers the LMCache namespace with a key of its own.
    let own = b"m@2@0@00aa@bfloat16";
    let key = b"m@2@0@11bb@bfloat16";
    assert_eq!(resp(ra, &[b"SET", own, b"x"]), b"+OK\r\n");
    assert_eq!(resp(rb, &[b"SET", key, b"kv-bytes"]), b"+OK\r\n");
    poll("the key on a", Duration::from_secs(15), || {
        (resp(ra, &[b"EXISTS", key]) == b":1\r\n").then_some(())
    });
    assert_eq!(resp(ra, &[b"GET", key]), b"$8\r\nkv-bytes\r\n");
    b.kill9();
    assert_eq!(
        resp(ra, &[b"GET", key]),
        b"$8\r\nkv-bytes\r\n",
        "not kept on a"
    );
}
