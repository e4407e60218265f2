//! Crash and restart of a real `kvtier` daemon: every flushed chunk survives
//! SIGKILL byte-exact, a SIGTERM (or SIGHUP) flushes dirty chunks and exits 0, nothing
//! corrupt is ever served, and bad configuration fails the start naming the
//! key and its source.

use std::collections::BTreeMap;

use kvtier_tests::{Daemon, TEST_STORE, chunk_bytes, http_get, metric, run_kvtier, test_record};
use node::tier::{ChunkKey, Namespace};

/// Chunks known to be durable (flushed) and chunks that may or may not
/// have survived (put after the last flush).
#[derive(Default)]
struct Model {
    durable: BTreeMap<ChunkKey, Vec<u8>>,
    maybe: BTreeMap<ChunkKey, Vec<u8>>,
}

fn put_round(d: &Daemon, ns: Namespace, round: u32, n: u32) -> BTreeMap<ChunkKey, Vec<u8>> {
    let mut c = d.client();
    let mut out = BTreeMap::new();
    for i in 0..n {
        let (key, data) = chunk_bytes(round, i);
        let st = c.put_bytes(ns, 0, &[(key, &data)]).expect("PUT");
        assert_eq!(st, vec![0], "PUT status of chunk {i} in round {round}");
        out.insert(key, data);
    }
    out
}

/// Every durable chunk is present and byte-exact; every other chunk is a
/// miss or byte-exact, never different bytes.
fn check(d: &Daemon, ns: Namespace, model: &Model) {
    let mut c = d.client();
    let ns2 = c.hello(&test_record(0)).expect("HELLO after restart");
    assert_eq!(ns2, ns);
    for (key, want) in &model.durable {
        let got = c.get_bytes(ns, 0, *key).expect("GET");
        match got {
            Some(got) => assert!(
                got == *want,
                "flushed chunk {key} came back with different bytes"
            ),
            None => panic!(
                "flushed chunk {key} is missing after restart; log:\n{}",
                d.log()
            ),
        }
    }
    for (key, want) in &model.maybe {
        if let Some(got) = c.get_bytes(ns, 0, *key).expect("GET") {
            assert!(
                got == *want,
                "unflushed chunk {key} came back with different bytes"
            );
        }
    }
    let keys: Vec<ChunkKey> = model.durable.keys().copied().collect();
    let r = c.lookup(ns, 0, &keys).expect("LOOKUP");
    assert_eq!(
        r.prefix as usize,
        keys.len(),
        "every flushed chunk is in the index"
    );
}

/// [`check`] of chunks that are all durable.
fn check_durable(d: &Daemon, ns: Namespace, chunks: BTreeMap<ChunkKey, Vec<u8>>) {
    let model = Model {
        durable: chunks,
        maybe: BTreeMap::new(),
    };
    check(d, ns, &model);
}

#[test]
fn sigkill_keeps_every_flushed_chunk_byte_exact() {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut model = Model::default();
    let mut ns = None;
    for round in 0..3u32 {
        let mut d = Daemon::start(dir.path(), &[], &[]).unwrap_or_else(|e| panic!("{e}"));
        let mut c = d.client();
        let id = c.hello(&test_record(0)).expect("HELLO");
        assert_eq!(*ns.get_or_insert(id), id, "the namespace id is stable");
        if round > 0 {
            check(&d, id, &model);
        }
        let flushed = put_round(&d, id, round * 2, 24);
        let reply = c.flush().expect("FLUSH");
        assert_eq!(reply.failed, 0, "flush failures");
        assert!(
            reply.chunks >= flushed.len() as u64,
            "flush wrote {} of {} chunks",
            reply.chunks,
            flushed.len()
        );
        model.durable.extend(flushed);
        // Chunks after the flush may be lost by SIGKILL, never corrupted.
        let unflushed = put_round(&d, id, round * 2 + 1, 8);
        for k in unflushed.keys() {
            model.durable.remove(k);
        }
        model.maybe.extend(unflushed);
        d.kill9();
    }
    let d = Daemon::start(dir.path(), &[], &[]).unwrap_or_else(|e| panic!("{e}"));
    check(&d, ns.expect("namespace"), &model);
}

fn a_stop_signal_flushes_dirty_chunks_and_exits_0(sig: libc::c_int, name: &str) {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut d = Daemon::start(dir.path(), &[], &[]).unwrap_or_else(|e| panic!("{e}"));
    let ns = d.client().hello(&test_record(0)).expect("HELLO");
    let chunks = put_round(&d, ns, 100, 32);
    let status = d.stop_with(sig);
    assert_eq!(
        status.code(),
        Some(0),
        "exit status after {name}; log:\n{}",
        d.log()
    );
    let log = d.log();
    assert!(log.contains(&format!("received {name}")), "{log}");
    // The JSON `kvtier ready` event carries the sizes the human summary shows.
    let ready = log
        .lines()
        .find(|l| l.contains("kvtier ready"))
        .unwrap_or_else(|| panic!("no ready event: {log}"));
    for field in [
        "\"ram_budget\":",
        "\"disk_budget\":",
        "\"max_chunk\":",
        "\"bytes\":",
    ] {
        assert!(ready.contains(field), "{field} missing: {ready}");
    }
    assert!(!d.socket.exists(), "the socket file is removed at shutdown");
    let d = Daemon::start(dir.path(), &[], &[]).unwrap_or_else(|e| panic!("{e}"));
    check_durable(&d, ns, chunks);
}

#[test]
fn sigterm_flushes_dirty_chunks_and_exits_0() {
    a_stop_signal_flushes_dirty_chunks_and_exits_0(libc::SIGTERM, "SIGTERM");
}

/// The terminal of a foreground daemon closed (a dropped ssh session).
#[test]
fn sighup_flushes_dirty_chunks_and_exits_0() {
    a_stop_signal_flushes_dirty_chunks_and_exits_0(libc::SIGHUP, "SIGHUP");
}

/// Under `nohup` (SIGHUP ignored when it starts) the daemon outlives its
/// terminal: a SIGHUP leaves it serving.
#[test]
fn under_nohup_a_sighup_leaves_the_daemon_serving() {
    let dir = tempfile::tempdir().expect("temp dir");
    let args = kvtier_tests::test_args(dir.path());
    let mut d =
        Daemon::start_wrapped(dir.path(), &["nohup"], &args, &[]).unwrap_or_else(|e| panic!("{e}"));
    kvtier_tests::signal(d.pid(), libc::SIGHUP);
    std::thread::sleep(std::time::Duration::from_millis(300));
    d.client().ping().expect("still serving after SIGHUP");
    assert!(!d.log().contains("received SIGHUP"), "{}", d.log());
    let status = d.stop_with(libc::SIGTERM);
    assert_eq!(status.code(), Some(0), "{}", d.log());
}

#[test]
fn a_restart_without_region_size_keeps_the_stores_regions_and_metrics_count_disk_time() {
    let dir = tempfile::tempdir().expect("temp dir");
    // The first daemon's store has 4 MiB regions (TEST_STORE).
    let mut d = Daemon::start(dir.path(), &[], &[]).unwrap_or_else(|e| panic!("{e}"));
    let ns = d.client().hello(&test_record(0)).expect("HELLO");
    let chunks = put_round(&d, ns, 300, 32);
    assert_eq!(d.client().flush().expect("FLUSH").failed, 0);
    let metrics = http_get(d.http.expect("http listener"), "/metrics");
    let m = |name: &str| metric(&metrics, name).unwrap_or_else(|| panic!("{name} in:\n{metrics}"));
    assert!(m("kvtier_disk_syncs_total") >= 1.0, "the flush synced");
    assert!(m("kvtier_disk_write_seconds_total") > 0.0);
    assert!(m("kvtier_disk_sync_seconds_total") > 0.0);
    assert!(m("kvtier_disk_write_bytes_total") >= 32.0 * 4096.0);
    // 32 chunks flushed at once: a batch or a few, not one per chunk.
    let batches = m("kvtier_disk_batch_writes_total");
    assert!((1.0..16.0).contains(&batches), "{batches} batch writes");
    assert_eq!(d.stop_with(libc::SIGTERM).code(), Some(0), "{}", d.log());
    // Without --region-size the default (256 MiB) would not fit the 32 MiB
    // budget twice: the daemon must adopt the store's 4 MiB to start.
    let mut args = kvtier_tests::test_args(dir.path());
    let at = args
        .iter()
        .position(|a| a == "--region-size")
        .expect("flag");
    args.drain(at..at + 2);
    let d = Daemon::start_args(dir.path(), &args, &[]).unwrap_or_else(|e| panic!("{e}"));
    let bytes: usize = chunks.values().map(Vec::len).sum();
    check_durable(&d, ns, chunks);
    // RAM starts empty: every chunk above came from disk.
    let metrics = http_get(d.http.expect("http listener"), "/metrics");
    let m = |name: &str| metric(&metrics, name).unwrap_or_else(|| panic!("{name} in:\n{metrics}"));
    assert!(m("kvtier_disk_reads_total") >= 32.0);
    assert!(m("kvtier_disk_read_bytes_total") >= bytes as f64);
    assert!(m("kvtier_disk_read_seconds_total") > 0.0);
    // Each read took a buffer, pooled or fresh (the PUTs' chunks are below
    // 1 MiB: not pooled).
    let pool = m("kvtier_buffer_pool_reused_total") + m("kvtier_buffer_pool_fresh_total");
    assert_eq!(pool, m("kvtier_disk_reads_total"));
    assert!(metric(&metrics, "kvtier_buffer_pool_bytes").is_some());
    let more = put_round(&d, ns, 301, 32);
    assert_eq!(d.client().flush().expect("FLUSH").failed, 0);
    check_durable(&d, ns, more);
}

#[test]
fn flipped_bytes_on_disk_are_never_served() {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut d = Daemon::start(dir.path(), &[], &[]).unwrap_or_else(|e| panic!("{e}"));
    let mut c = d.client();
    let ns = c.hello(&test_record(0)).expect("HELLO");
    let chunks = put_round(&d, ns, 200, 24);
    assert_eq!(c.flush().expect("FLUSH").failed, 0);
    d.kill9();

    // Flip one byte every 16 KiB in the written part (the first 32 MiB
    // hold every chunk of this test) of every store file.
    let mut flipped = 0;
    for entry in std::fs::read_dir(&d.data_dir)
        .expect("list data dir")
        .flatten()
    {
        use std::os::unix::fs::FileExt;
        let path = entry.path();
        if !path.is_file() || path.file_name() == Some(std::ffi::OsStr::new("LOCK")) {
            continue;
        }
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .expect("open store file");
        let len = file
            .metadata()
            .expect("stat store file")
            .len()
            .min(32 << 20);
        let mut bytes = vec![0u8; usize::try_from(len).expect("32 MiB fits usize")];
        file.read_exact_at(&mut bytes, 0).expect("read store file");
        let written = bytes.iter().rposition(|b| *b != 0).map_or(0, |p| p + 1);
        let mut off = 8192;
        while off < written {
            bytes[off] ^= 0x5a;
            flipped += 1;
            off += 16 << 10;
        }
        file.write_all_at(&bytes, 0).expect("write store file");
        file.sync_all().expect("sync store file");
    }
    assert!(
        flipped > 0,
        "the flushed chunks are in files under the data dir"
    );

    let d = Daemon::start(dir.path(), &[], &[])
        .unwrap_or_else(|e| panic!("a corrupt store must still start: {e}"));
    let mut c = d.client();
    c.hello(&test_record(0)).expect("HELLO");
    let mut served = 0;
    for (key, want) in &chunks {
        if let Some(got) = c.get_bytes(ns, 0, *key).expect("GET") {
            assert!(got == *want, "chunk {key} was served with corrupt bytes");
            served += 1;
        }
    }
    // Chunks smaller than the flip stride may survive; most must be misses.
    assert!(
        served < chunks.len(),
        "{served} of {} chunks served despite {flipped} flipped bytes",
        chunks.len()
    );
}

#[test]
fn a_second_daemon_on_the_same_data_dir_is_refused() {
    let dir = tempfile::tempdir().expect("temp dir");
    let d = Daemon::start(dir.path(), &[], &[]).unwrap_or_else(|e| panic!("{e}"));
    let other = tempfile::tempdir().expect("temp dir");
    let data = d.data_dir.to_string_lossy().into_owned();
    let sock = other.path().join("b.sock").to_string_lossy().into_owned();
    let out = run_kvtier(
        &[
            "node",
            "start",
            "--data-dir",
            &data,
            "--socket",
            &sock,
            TEST_STORE[0],
            TEST_STORE[1],
            TEST_STORE[2],
            TEST_STORE[3],
            "--resp-listen",
            "off",
            "--http-listen",
            "off",
        ],
        &[],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("in use") && err.contains(&format!("pid {}", d.pid())),
        "{err}"
    );

    // verify / gc need the store to themselves.
    let args = [&["verify", "--data-dir", &data][..], &TEST_STORE].concat();
    let out = run_kvtier(&args, &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("stop the daemon first"), "{err}");
    drop(d);
    // Held by another offline command: wait for it, there is no daemon to stop.
    let lock = node::daemon::DataDirLock::acquire(std::path::Path::new(&data), "verify")
        .expect("the lock, once the daemon is gone");
    let args = [
        &["gc", "--older-than", "1d", "--data-dir", &data][..],
        &TEST_STORE,
    ]
    .concat();
    let out = run_kvtier(&args, &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("`kvtier verify`") && err.contains("try again when it is done"),
        "{err}"
    );
    assert!(!err.contains("stop the daemon"), "{err}");
    drop(lock);
}

#[test]
fn config_errors_fail_the_start_naming_key_and_source() {
    let dir = tempfile::tempdir().expect("temp dir");
    let data = dir.path().join("data").to_string_lossy().into_owned();
    let start = [
        "node",
        "start",
        "--data-dir",
        data.as_str(),
        "--resp-listen",
        "off",
        "--http-listen",
        "off",
    ];

    let out = run_kvtier(&start, &[("KVTIER_RAM_BUDGET", "12XB")]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("ram-budget") && err.contains("KVTIER_RAM_BUDGET"),
        "{err}"
    );
    assert!(
        !err.contains("panicked") && !err.contains("backtrace"),
        "{err}"
    );

    let file = dir.path().join("bad.toml");
    std::fs::write(&file, "ram-budget = \"1GiB\"\nwrite-polcy = \"no-tax\"\n")
        .expect("write config");
    let f = file.to_string_lossy().into_owned();
    let mut args = start.to_vec();
    args.extend(["--config", f.as_str()]);
    let out = run_kvtier(&args, &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("write-polcy") && err.contains("bad.toml"),
        "{err}"
    );

    let mut args = start.to_vec();
    args.extend(["--shutdown-deadline", "soon"]);
    let out = run_kvtier(&args, &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(2),
        "a malformed flag is a usage error: {err}"
    );
    assert!(err.contains("--shutdown-deadline"), "{err}");

    let mut args = start.to_vec();
    args.extend(["--disk-budget", "1000TiB"]);
    let out = run_kvtier(&args, &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("disk-budget") && err.contains("--disk-budget") && err.contains("available"),
        "{err}"
    );
}

/// The daemon raises its soft open-file limit to the hard one: a shell's
/// usual 1,024 is below what its connection limits need, and past it
/// accepts failed with EMFILE and clients hung instead of getting `busy`
/// (QA). The daemon inherits this test's lowered soft limit.
#[test]
fn the_daemon_raises_its_open_file_limit() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit on a local struct; this test process
    // (one per test under nextest) keeps 256 open files, plenty for it.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim), 0);
        if lim.rlim_max <= 256 {
            eprintln!("SKIPPED: the hard open-file limit is {}", lim.rlim_max);
            return;
        }
        let low = libc::rlimit {
            rlim_cur: 256,
            rlim_max: lim.rlim_max,
        };
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &low), 0);
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let d = Daemon::start(dir.path(), &[], &[]).expect("start");
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", d.pid())).expect("limits");
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .expect("Max open files");
    let soft = line.split_whitespace().nth(3).expect("soft limit");
    let max = if lim.rlim_max == libc::RLIM_INFINITY {
        "unlimited".to_string()
    } else {
        lim.rlim_max.to_string()
    };
    assert_eq!(soft, max, "{line}");
}

/// A second daemon given a native socket another daemon serves fails
/// before it opens (and preallocates) a store or starts anything else
/// (it failed only at the bind, after peers had seen it up: QA).
#[test]
fn a_socket_in_use_fails_the_start_before_the_store_opens() {
    let dir = tempfile::tempdir().expect("temp dir");
    let first = Daemon::start(dir.path(), &[], &[]).expect("start");
    let other = tempfile::tempdir().expect("temp dir");
    let mut args = kvtier_tests::test_args(other.path());
    let at = args.iter().position(|a| a == "--socket").expect("--socket") + 1;
    args[at] = first.socket.to_string_lossy().into_owned();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = run_kvtier(&args, &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("native socket"), "{err}");
    assert!(
        !other.path().join("data").join("store.kvt").exists(),
        "the store was created: {err}"
    );
    drop(first);
}
