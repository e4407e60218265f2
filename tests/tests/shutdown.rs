//! Signals during shutdown: a second SIGTERM / SIGINT while the daemon is
//! still flushing its dirty chunks after the first one exits at once with
//! code 130, and the store it leaves behind reopens and never serves wrong
//! bytes. And what the service manager is told (`READY=1`, `STOPPING=1`).

use std::path::Path;
use std::time::{Duration, Instant};

use kvtier_tests::{DEADLINE, Daemon, test_record};
use node::native::RegionEntry;
use node::tier::ChunkKey;

/// Chunk size and count: a dirty set large enough (768 MiB) that the
/// shutdown flush takes a good fraction of a second even on a fast disk.
const CHUNK: usize = 4 << 20;
const CHUNKS: usize = 192;
/// Chunks per PUT (the region holds one batch).
const BATCH: usize = 16;

fn key(i: usize) -> ChunkKey {
    let mut k = [0u8; 32];
    k[..8].copy_from_slice(&(i as u64).to_le_bytes());
    k[8] = 0x5D;
    ChunkKey(k)
}

/// Chunk `i`'s bytes: every 8-byte word holds (i, word index).
fn fill(i: usize, out: &mut [u8]) {
    for (w, c) in out.chunks_exact_mut(8).enumerate() {
        c.copy_from_slice(&(((i as u64) << 40) | w as u64).to_le_bytes());
    }
}

fn args(dir: &Path) -> Vec<String> {
    let s = |p: std::path::PathBuf| p.to_string_lossy().into_owned();
    [
        "node",
        "start",
        "--data-dir",
        &s(dir.join("data")),
        "--socket",
        &s(dir.join("kvtier.sock")),
        // Everything stays dirty in RAM until the shutdown flush.
        "--ram-budget",
        "1GiB",
        "--disk-budget",
        "1GiB",
        "--idle-flush-after",
        "1h",
        "--resp-listen",
        "off",
        "--http-listen",
        "off",
        "--log-format",
        "json",
        "--shutdown-deadline",
        "60s",
    ]
    .iter()
    .map(|a| a.to_string())
    .collect()
}

/// Waits (bounded) until the daemon's log contains `needle`.
fn wait_for_log(d: &Daemon, needle: &str) {
    let t0 = Instant::now();
    while !d.log().contains(needle) {
        assert!(
            t0.elapsed() < DEADLINE,
            "the daemon never logged {needle:?}; log:\n{}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn second_signal_during_the_flush_exits_at_once_with_130(first: libc::c_int, second: libc::c_int) {
    // The store preallocates its budget and the flush writes 768 MiB.
    let dir = kvtier_tests::tempdir_with_room(5 << 28);
    let mut d =
        Daemon::start_args(dir.path(), &args(dir.path()), &[]).unwrap_or_else(|e| panic!("{e}"));
    let mut c = d.client();
    let ns = c.hello(&test_record(0)).expect("HELLO");
    c.create_region((CHUNK * BATCH) as u64).expect("region");
    for b in 0..CHUNKS / BATCH {
        let region = c.region_mut().expect("region").as_mut_slice();
        let mut entries = Vec::with_capacity(BATCH);
        for j in 0..BATCH {
            let i = b * BATCH + j;
            fill(i, &mut region[j * CHUNK..(j + 1) * CHUNK]);
            entries.push(RegionEntry {
                key: key(i),
                offset: (j * CHUNK) as u64,
                len: CHUNK as u64,
            });
        }
        let st = c.put(ns, 0, &entries, false).expect("PUT");
        assert!(st.iter().all(|s| *s == 0), "PUT statuses {st:?}");
    }
    let stats = c.stats().expect("STATS");
    let dirty = stats["store"]["dirty_bytes"].as_u64().expect("dirty_bytes");
    // Each chunk's payload and the bookkeeping RAM charges it.
    let charged = (CHUNK as u64 + node::tier::ram::ENTRY_COST) * CHUNKS as u64;
    assert_eq!(dirty, charged, "every chunk is still dirty");
    drop(c);

    kvtier_tests::signal(d.pid(), first);
    // The daemon logs this right before it starts writing the dirty set.
    wait_for_log(&d, "flushing the dirty set");
    let t0 = Instant::now();
    kvtier_tests::signal(d.pid(), second);
    let status = d.wait_exit();
    let took = t0.elapsed();
    let log = d.log();
    assert_eq!(
        status.code(),
        Some(130),
        "exit status after a second signal during the flush ({status}); log:\n{log}"
    );
    assert!(
        log.contains("second signal"),
        "the daemon says why it exits; log:\n{log}"
    );
    // In the JSON log format (`args`), as a JSON line like the others (QA:
    // it was plain text there).
    let line = log
        .lines()
        .find(|l| l.contains("second signal"))
        .expect("the line");
    let v: serde_json::Value =
        serde_json::from_str(line).unwrap_or_else(|e| panic!("not a JSON line ({e}): {line}"));
    assert!(
        v["fields"]["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("second signal")),
        "{line}"
    );
    assert_eq!(v["level"], "WARN", "{line}");
    // It says what the exit loses (the flush had only begun).
    assert!(
        line.contains("of chunks not on disk yet are lost"),
        "{line}"
    );
    assert!(
        v["timestamp"].is_string() && v["target"].is_string(),
        "{line}"
    );
    assert!(
        !log.contains("store closed"),
        "the flush had finished before the second signal, so this run proves nothing \
         (make the dirty set larger); log:\n{log}"
    );
    assert!(
        took < Duration::from_secs(5),
        "exiting took {took:?} after the second signal"
    );

    // The store it left mid-flush reopens; what it serves is byte-exact.
    let d =
        Daemon::start_args(dir.path(), &args(dir.path()), &[]).unwrap_or_else(|e| panic!("{e}"));
    let mut c = d.client();
    assert_eq!(c.hello(&test_record(0)).expect("HELLO"), ns);
    let mut want = vec![0u8; CHUNK];
    for i in 0..CHUNKS {
        if let Some(got) = c.get_bytes(ns, 0, key(i)).expect("GET") {
            fill(i, &mut want);
            assert!(got == want, "chunk {i} came back with different bytes");
        }
    }
}

#[test]
fn a_second_sigterm_during_the_shutdown_flush_exits_at_once_with_130() {
    second_signal_during_the_flush_exits_at_once_with_130(libc::SIGTERM, libc::SIGTERM);
}

#[test]
fn a_sigint_after_a_sigterm_during_the_shutdown_flush_exits_at_once_with_130() {
    second_signal_during_the_flush_exits_at_once_with_130(libc::SIGTERM, libc::SIGINT);
}

/// A daemon whose stderr is a pipe nobody reads any more (a `| head` or a
/// log shipper that died) still starts, serves, and on SIGTERM flushes its
/// dirty chunks and exits 0: a log line it cannot write is dropped, never a
/// panic that loses the flush.
#[test]
fn a_closed_log_pipe_never_stops_the_shutdown_flush() {
    use std::process::Stdio;
    let dir = tempfile::tempdir().expect("temp dir");
    let mut args = kvtier_tests::test_args(dir.path());
    kvtier_tests::set_flag(&mut args, "--log-format", "human");
    kvtier_tests::set_flag(&mut args, "--resp-listen", "off");
    kvtier_tests::set_flag(&mut args, "--http-listen", "off");
    let mut child = kvtier_tests::kvtier_command()
        .args(&args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn kvtier");
    // Close the read ends: every write to stdout or stderr now fails (EPIPE).
    drop(child.stdout.take());
    drop(child.stderr.take());
    let socket = dir.path().join("kvtier.sock");
    let mut c = kvtier_tests::poll("the daemon's socket", DEADLINE, || {
        if let Ok(Some(status)) = child.try_wait() {
            panic!("the daemon exited at start: {status}");
        }
        node::native::Client::connect(&socket).ok()
    });
    let ns = c.hello(&test_record(0)).expect("HELLO");
    let (k, v) = kvtier_tests::chunk_bytes(7, 1);
    assert_eq!(c.put_bytes(ns, 0, &[(k, &v)]).expect("PUT"), vec![0]);
    drop(c);
    kvtier_tests::signal(child.id(), libc::SIGTERM);
    let t = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        assert!(t.elapsed() < DEADLINE, "no exit after SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(0), "exit after SIGTERM: {status}");
    // The chunk was dirty at the signal: the shutdown flush kept it.
    let d = Daemon::start_args(dir.path(), &kvtier_tests::test_args(dir.path()), &[])
        .unwrap_or_else(|e| panic!("{e}"));
    let mut c = d.client();
    let ns2 = c.hello(&test_record(0)).expect("HELLO");
    assert_eq!(ns2, ns);
    assert_eq!(c.get_bytes(ns, 0, k).expect("GET"), Some(v));
}

/// Under systemd's `Type=notify` (the unit in deploy/systemd): `READY=1`
/// once the socket serves, with the daemon's pid, and `STOPPING=1` when a
/// SIGTERM starts the shutdown. Without it `systemctl start` returned
/// before the socket existed and units ordered after kvtier raced it. The
/// daemon is spawned bare (not through `Daemon::start`, which waits for its
/// LOCK record) so that READY=1 is the only signal the ping relies on.
#[test]
fn the_service_manager_is_told_ready_then_stopping() {
    use std::os::unix::net::UnixDatagram;
    use std::process::{Child, Stdio};
    struct Reap(Child);
    impl Drop for Reap {
        fn drop(&mut self) {
            if self.0.try_wait().ok().flatten().is_none() {
                let _ = self.0.kill();
                let _ = self.0.wait();
            }
        }
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("notify.sock");
    let manager = UnixDatagram::bind(&path).expect("bind the notify socket");
    manager.set_read_timeout(Some(DEADLINE)).expect("timeout");
    let log = std::fs::File::create(dir.path().join("daemon.log")).expect("log");
    let mut d = Reap(
        kvtier_tests::kvtier_command()
            .args(kvtier_tests::test_args(dir.path()))
            .env("NOTIFY_SOCKET", &path)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("spawn kvtier"),
    );
    let mut buf = [0u8; 512];
    let recv = |buf: &mut [u8]| -> String {
        let n = manager.recv(buf).expect("a notification");
        String::from_utf8_lossy(&buf[..n]).into_owned()
    };
    let ready = recv(&mut buf);
    assert!(ready.lines().any(|l| l == "READY=1"), "{ready:?}");
    assert!(
        ready.lines().any(|l| l == format!("MAINPID={}", d.0.id())),
        "{ready:?}"
    );
    node::native::Client::connect(dir.path().join("kvtier.sock"))
        .and_then(|mut c| c.ping())
        .expect("the socket serves once READY=1 is sent");
    kvtier_tests::signal(d.0.id(), libc::SIGTERM);
    let stopping = recv(&mut buf);
    assert!(stopping.lines().any(|l| l == "STOPPING=1"), "{stopping:?}");
    let t0 = Instant::now();
    let status = loop {
        if let Some(st) = d.0.try_wait().expect("wait") {
            break st;
        }
        assert!(t0.elapsed() < DEADLINE, "no exit after SIGTERM");
        std::thread::sleep(Duration::from_millis(10));
    };
    assert!(status.success(), "{status:?}");
}

/// A `NOTIFY_SOCKET` nobody listens on is a warning, not a failed start.
#[test]
fn an_unreachable_notify_socket_only_warns() {
    let dir = tempfile::tempdir().expect("temp dir");
    let nowhere = dir.path().join("no-such-socket");
    let mut d = Daemon::start(
        dir.path(),
        &[],
        &[("NOTIFY_SOCKET", nowhere.to_str().expect("utf-8 path"))],
    )
    .expect("start");
    d.client().ping().expect("serves");
    let status = d.stop_with(libc::SIGTERM);
    assert!(status.success(), "{status:?}");
    assert!(
        d.log().contains("could not notify the service manager"),
        "{}",
        d.log()
    );
}
