//! A real network partition between two daemons: each runs in its own
//! network namespace, joined by a veth pair (10.231.7.1 ↔ 10.231.7.2).
//! A fetch crosses the link; then traffic is dropped in both directions
//! (blackhole routes: packets are discarded, nothing answers), a GET on b
//! of a chunk only a holds must become a miss within the fetch timeout,
//! and b must mark a suspect, then down; after the routes are removed, b
//! reconnects, re-syncs (a chunk PUT on a during the partition appears)
//! and fetches byte-exact again.
//!
//! Needs root and iproute2 (`ip netns`, veth). Without them the test prints
//! why and returns (CI runs as root with iproute2, so it runs there).
//! Addresses live only inside the two namespaces; the daemons' RESP and
//! HTTP listeners bind each namespace's own loopback.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use kvtier_tests::{
    Daemon, chunk_bytes, peer_state, poll, run_kvtier, test_args, test_record, wait_present,
};
use node::native::LookupLocation;
use node::tier::ChunkKey;

const ENV: [(&str, &str); 3] = [
    ("KVTIER_PEER_SUSPECT_AFTER", "500ms"),
    ("KVTIER_PEER_DOWN_AFTER", "1500ms"),
    ("KVTIER_PEER_FETCH_TIMEOUT", "1s"),
];
const ADDR: [&str; 2] = ["10.231.7.1", "10.231.7.2"];
const PORT: u16 = 7401;

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("run `ip`: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Two namespaces joined by a veth pair; deleted on drop (which also
/// removes the veth pair).
struct Netns {
    names: [String; 2],
    created: Vec<String>,
}

impl Netns {
    fn create() -> Result<Self, String> {
        // SAFETY: geteuid(2) has no preconditions and cannot fail.
        if unsafe { libc::geteuid() } != 0 {
            return Err("not running as root (network namespaces need CAP_SYS_ADMIN)".into());
        }
        ip(&["-V"]).map_err(|e| format!("no usable iproute2: {e}"))?;
        let tag = std::process::id() % 100_000;
        let mut ns = Netns {
            names: [format!("kvt{tag}a"), format!("kvt{tag}b")],
            created: Vec::new(),
        };
        let veth = [format!("kv{tag}x"), format!("kv{tag}y")];
        for n in ns.names.clone() {
            ip(&["netns", "add", &n])?;
            ns.created.push(n);
        }
        ip(&[
            "link", "add", &veth[0], "type", "veth", "peer", "name", &veth[1],
        ])?;
        for i in 0..2 {
            let n = ns.names[i].as_str();
            if let Err(e) = ip(&["link", "set", &veth[i], "netns", n]) {
                let _ = ip(&["link", "del", &veth[0]]);
                return Err(e);
            }
            ip(&[
                "-n",
                n,
                "addr",
                "add",
                &format!("{}/24", ADDR[i]),
                "dev",
                &veth[i],
            ])?;
            ip(&["-n", n, "link", "set", &veth[i], "up"])?;
            ip(&["-n", n, "link", "set", "lo", "up"])?;
        }
        Ok(ns)
    }

    /// Drops (`on`) or restores all traffic between the two namespaces.
    fn partition(&self, on: bool) {
        for i in 0..2 {
            let verb = if on { "add" } else { "del" };
            let to = format!("{}/32", ADDR[1 - i]);
            ip(&["-n", &self.names[i], "route", verb, "blackhole", &to])
                .unwrap_or_else(|e| panic!("{e}"));
        }
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        for n in &self.created {
            let _ = ip(&["netns", "del", n]);
        }
    }
}

fn kvtier_ok(args: &[&str]) {
    let out = run_kvtier(args, &[]);
    assert!(
        out.status.success(),
        "kvtier {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn start(dir: &Path, netns: &Netns, i: usize, tls: &Path) -> Daemon {
    let names = ["a", "b"];
    let nd = dir.join(names[i]);
    std::fs::create_dir_all(&nd).expect("node dir");
    let mut args = test_args(&nd);
    args.extend(
        [
            "--node-name",
            names[i],
            "--peer-listen",
            &format!("{}:{PORT}", ADDR[i]),
            "--peers",
            &format!("{}:{PORT}", ADDR[1 - i]),
            "--tls-dir",
            tls.to_str().expect("utf-8 path"),
        ]
        .map(str::to_owned),
    );
    Daemon::start_wrapped(&nd, &["ip", "netns", "exec", &netns.names[i]], &args, &ENV)
        .unwrap_or_else(|e| panic!("start {}: {e}", names[i]))
}

#[test]
fn a_dropped_link_turns_gets_into_timely_misses_and_heals() {
    let netns = match Netns::create() {
        Ok(n) => n,
        Err(why) => {
            println!("SKIPPED a_dropped_link_turns_gets_into_timely_misses_and_heals: {why}");
            return;
        }
    };
    let dir = tempfile::tempdir().expect("temp dir");
    let ca = dir.path().join("ca");
    let ca_s = ca.to_str().expect("utf-8 path");
    kvtier_ok(&["cert", "init-ca", "--cluster", "netns", "--out", ca_s]);
    let tls: Vec<PathBuf> = ["a", "b"]
        .iter()
        .zip(ADDR)
        .map(|(n, addr)| {
            let out = dir.path().join(format!("{n}-tls"));
            let out_s = out.to_str().expect("utf-8 path");
            kvtier_ok(&[
                "cert", "issue", "--ca", ca_s, "--node", n, "--ip", addr, "--out", out_s,
            ]);
            out
        })
        .collect();
    let a = start(dir.path(), &netns, 0, &tls[0]);
    let b = start(dir.path(), &netns, 1, &tls[1]);

    let rec = test_record(0);
    let ns = a.client().hello(&rec).expect("HELLO a");
    let mut cb = b.client();
    assert_eq!(cb.hello(&rec).expect("HELLO b"), ns);
    let chunks: Vec<(ChunkKey, Vec<u8>)> = (0..4).map(|i| chunk_bytes(21, i)).collect();
    for (k, v) in &chunks[..3] {
        let st = a.client().put_bytes(ns, 0, &[(*k, v)]).expect("PUT");
        assert_eq!(st, vec![0]);
    }

    // Across the veth link: sync, then a byte-exact fetch.
    for (k, _) in &chunks[..3] {
        wait_present(&b, ns, *k, Duration::from_secs(20));
    }
    assert_eq!(
        cb.lookup(ns, 0, &[chunks[0].0]).expect("LOOKUP").locations,
        vec![LookupLocation::Peer]
    );
    assert_eq!(
        cb.get_bytes(ns, 0, chunks[0].0).expect("GET"),
        Some(chunks[0].1.clone())
    );
    assert_eq!(peer_state(&b, "a").as_deref(), Some("up"));

    // Partition: every packet between the namespaces is dropped.
    netns.partition(true);
    let t0 = Instant::now();
    let t = Instant::now();
    assert_eq!(cb.get_bytes(ns, 0, chunks[1].0).expect("GET"), None);
    println!(
        "GET across the dropped link: a miss after {:?}",
        t.elapsed()
    );
    assert!(
        t.elapsed() < Duration::from_millis(2500),
        "GET across the dropped link took {:?} (fetch timeout 1s)",
        t.elapsed()
    );
    let t = Instant::now();
    let seen = poll("a suspect or down at b", Duration::from_secs(5), || {
        peer_state(&b, "a").filter(|s| s == "suspect" || s == "down")
    });
    println!("a was {seen} at b {:?} after that miss", t.elapsed());
    poll("a down at b", Duration::from_secs(10), || {
        (peer_state(&b, "a").as_deref() == Some("down")).then_some(())
    });
    println!("a down at b {:?} after the partition", t0.elapsed());
    let t = Instant::now();
    assert_eq!(cb.get_bytes(ns, 0, chunks[2].0).expect("GET"), None);
    assert!(t.elapsed() < Duration::from_millis(2500));
    assert_eq!(
        cb.lookup(ns, 0, &[chunks[2].0]).expect("LOOKUP").prefix,
        0,
        "a down peer's chunks are not offered"
    );
    // A chunk written on a while b cannot hear about it.
    let (k3, v3) = &chunks[3];
    assert_eq!(
        a.client().put_bytes(ns, 0, &[(*k3, v3)]).expect("PUT"),
        vec![0]
    );

    // Heal: b reconnects (backoff at most 5 s), re-syncs, fetches.
    netns.partition(false);
    let t = Instant::now();
    poll("a up again at b", Duration::from_secs(20), || {
        (peer_state(&b, "a").as_deref() == Some("up")).then_some(())
    });
    println!("a up again at b {:?} after healing", t.elapsed());
    wait_present(&b, ns, *k3, Duration::from_secs(15));
    assert_eq!(cb.get_bytes(ns, 0, *k3).expect("GET"), Some(v3.clone()));
    assert_eq!(
        cb.get_bytes(ns, 0, chunks[1].0).expect("GET"),
        Some(chunks[1].1.clone())
    );
    drop(cb);
    drop(b);
    drop(a);
}
