//! The `kvtier` client commands against a real daemon: put / get / lookup /
//! delete / flush / stats / namespaces, their exit codes, and `config check`.

use kvtier_tests::{Daemon, TEST_STORE, run_kvtier};

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// A command's stdout and stderr, for assertion messages.
fn text_of(out: &std::process::Output) -> String {
    format!("{}{}", text(&out.stdout), text(&out.stderr))
}

#[test]
fn client_commands_round_trip_and_use_documented_exit_codes() {
    let dir = tempfile::tempdir().expect("temp dir");
    let d = Daemon::start(dir.path(), &[], &[]).unwrap_or_else(|e| panic!("{e}"));
    let sock = d.socket.to_string_lossy().into_owned();
    let s = ["--socket", sock.as_str()];

    let record = dir.path().join("ns.toml");
    std::fs::write(
        &record,
        "model = \"m\"\nengine = \"vllm\"\ntp-size = 2\nrank = 1\nkv-dtype = \"bfloat16\"\n",
    )
    .expect("write record");
    let payload = dir.path().join("chunk.bin");
    let bytes: Vec<u8> = (0..200_000u32).map(|i| (i * 7 + 3) as u8).collect();
    std::fs::write(&payload, &bytes).expect("write payload");

    let (p, r) = (
        payload.to_string_lossy().into_owned(),
        record.to_string_lossy().into_owned(),
    );
    let out = run_kvtier(
        &[
            &["put", &p, "--namespace-record", &r, "--name", "hello"][..],
            &s,
        ]
        .concat(),
        &[],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let ns = text(&out.stderr)
        .lines()
        .find_map(|l| l.strip_prefix("namespace ").map(str::to_owned))
        .expect("put prints the registered namespace id");
    assert_eq!(ns.len(), 32);

    // A record file with a misspelt field, an empty one, and one in JSON
    // with a field that does not exist: refused, naming the problem.
    for (body, want) in [
        ("model = \"m\"\ntp_size = 2\n", "unknown field `tp_size`"),
        ("model = \"m\"\ntp_size = 2\n", "did you mean `tp-size`?"),
        ("", "has no `model`"),
        ("{\"model\": \"m\", \"ranks\": 2}", "unknown field `ranks`"),
    ] {
        let bad = dir.path().join("bad-record");
        std::fs::write(&bad, body).expect("write record");
        let b = bad.to_string_lossy().into_owned();
        let out = run_kvtier(
            &[
                &["put", &p, "--namespace-record", &b, "--name", "x"][..],
                &s,
            ]
            .concat(),
            &[],
        );
        assert_eq!(
            out.status.code(),
            Some(1),
            "{body:?}: {}",
            text(&out.stderr)
        );
        assert!(
            text(&out.stderr).contains(want),
            "{body:?}: {}",
            text(&out.stderr)
        );
    }

    let got = dir.path().join("got.bin");
    let g = got.to_string_lossy().into_owned();
    let out = run_kvtier(
        &[
            &["get", "--name", "hello", "--namespace", &ns, "-o", &g][..],
            &s,
        ]
        .concat(),
        &[],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(
        std::fs::read(&got).expect("read output") == bytes,
        "get returns the bytes put"
    );

    // `get -o - | head -c 10`: the reader goes away mid-value; the command
    // stops quietly with 141 (as if killed by SIGPIPE), no error, no panic.
    let mut child = kvtier_tests::kvtier_command()
        .args(
            [
                &["get", "--name", "hello", "--namespace", &ns, "-o", "-"][..],
                &s,
            ]
            .concat(),
        )
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn kvtier get");
    drop(child.stdout.take());
    let out = child.wait_with_output().expect("kvtier get");
    assert_eq!(out.status.code(), Some(141), "{}", text(&out.stderr));
    assert_eq!(text(&out.stderr), "", "no error for a closed stdout");

    let key = node::tier::ChunkKey::from_name(b"hello").to_string();
    let other = "ab".repeat(32);
    let out = run_kvtier(
        &[&["lookup", "--namespace", &ns, &key][..], &s].concat(),
        &[],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("ram"), "{}", text(&out.stdout));
    let out = run_kvtier(
        &[
            &["lookup", "--namespace", &ns, &key, &other, "--json"][..],
            &s,
        ]
        .concat(),
        &[],
    );
    assert_eq!(out.status.code(), Some(4), "a missing key exits 4");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("lookup --json");
    assert_eq!(v["prefix"], 1);

    let out = run_kvtier(
        &[&["get", &other, "--namespace", &ns, "-o", &g][..], &s].concat(),
        &[],
    );
    assert_eq!(
        out.status.code(),
        Some(4),
        "a miss exits 4: {}",
        text(&out.stderr)
    );

    // `put --json` with a record: one JSON line on stdout, nothing else.
    let out = run_kvtier(
        &[
            &["put", &p, "--namespace-record", &r, "--name", "again"][..],
            &["--group", "3", "--json"],
            &s,
        ]
        .concat(),
        &[],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(text(&out.stderr), "", "--json prints nothing else");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("put --json");
    assert_eq!(v["namespace"], ns.as_str(), "{v}");
    assert_eq!(
        v["key"],
        node::tier::ChunkKey::from_name(b"again").to_string(),
        "{v}"
    );
    assert_eq!(
        (v["group"].as_u64(), v["bytes"].as_u64()),
        (Some(3), Some(200_000))
    );

    let out = run_kvtier(&[&["flush", "--json"][..], &s].concat(), &[]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("flush --json");
    assert_eq!(v["failed"], 0);

    let out = run_kvtier(&[&["stats", "--json"][..], &s].concat(), &[]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("stats --json");
    assert!(v["store"]["puts"].as_u64().expect("store.puts") >= 1, "{v}");
    let out = run_kvtier(&[&["stats"][..], &s].concat(), &[]);
    assert!(
        text(&out.stdout).contains("store.puts"),
        "{}",
        text(&out.stdout)
    );

    let data = d.data_dir.to_string_lossy().into_owned();
    let args = [
        &["namespaces", "--json", "--data-dir", &data][..],
        &TEST_STORE,
    ]
    .concat();
    let out = run_kvtier(&args, &[]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("namespaces --json");
    assert!(
        v.as_array()
            .expect("a list")
            .iter()
            .any(|n| n["id"] == ns.as_str()),
        "{v}"
    );
    // Not through the socket: refused, saying how.
    for cmd in [
        &["namespaces"][..],
        &["verify"],
        &["gc", "--older-than", "1h"],
    ] {
        let out = run_kvtier(&[cmd, &s[..]].concat(), &[]);
        assert_eq!(out.status.code(), Some(2), "{cmd:?}: {}", text(&out.stderr));
        assert!(
            text(&out.stderr).contains("through its data dir"),
            "{cmd:?}: {}",
            text(&out.stderr)
        );
    }

    let out = run_kvtier(
        &[&["delete", "--namespace", &ns, &key, &other][..], &s].concat(),
        &[],
    );
    assert_eq!(
        out.status.code(),
        Some(4),
        "an absent key exits 4: {}",
        text(&out.stdout)
    );
    let out = run_kvtier(
        &[&["get", &key, "--namespace", &ns, "-o", &g][..], &s].concat(),
        &[],
    );
    assert_eq!(out.status.code(), Some(4), "deleted");

    // A chunk larger than a region (4 MiB here): refused, naming the limit.
    let big = dir.path().join("big.bin");
    std::fs::write(&big, vec![7u8; 5 << 20]).expect("write big");
    let b = big.to_string_lossy().into_owned();
    let out = run_kvtier(
        &[&["put", &b, "--namespace", &ns, "--name", "big"][..], &s].concat(),
        &[],
    );
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("too-large: ")
            && err.contains("big.bin is larger than the ")
            && err.contains(" this daemon takes per chunk"),
        "{err}"
    );
    // The limit is said once (QA: "the chunk is more than N bytes, this
    // daemon takes chunks up to N bytes").
    let limit = err
        .split("larger than the ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .expect("the limit");
    assert_eq!(err.matches(limit).count(), 1, "{err}");
    // A huge input is not read whole first (QA: `put /dev/zero` read until
    // memory ran out): here a sparse 1 GiB file, refused after the limit.
    let huge = dir.path().join("huge.bin");
    std::fs::File::create(&huge)
        .and_then(|f| f.set_len(1 << 30))
        .expect("sparse file");
    let h = huge.to_string_lossy().into_owned();
    let out = run_kvtier(
        &[&["put", &h, "--namespace", &ns, "--name", "huge"][..], &s].concat(),
        &[],
    );
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("huge.bin is larger than the "), "{err}");

    let out = run_kvtier(&["put", &p, "--namespace", &ns, "--key"], &[]);
    assert_eq!(
        out.status.code(),
        Some(2),
        "usage error: {}",
        text(&out.stderr)
    );
}

#[test]
fn a_failed_start_in_json_log_mode_says_why_in_json() {
    // A data dir under a regular file cannot be created: the start fails
    // after logging is set up, and stderr must hold JSON lines only.
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("a-file");
    std::fs::write(&file, b"").expect("write");
    let data = file.join("data");
    let sock = dir.path().join("s.sock");
    let (data, sock) = (data.to_string_lossy(), sock.to_string_lossy());
    let start = |format: &[&str]| {
        let args = [
            &["node", "start"][..],
            format,
            &[
                "--data-dir",
                &data,
                "--socket",
                &sock,
                "--resp-listen",
                "off",
                "--http-listen",
                "off",
            ],
        ]
        .concat();
        run_kvtier(&args, &[])
    };
    let out = start(&["--log-format", "json"]);
    assert_eq!(out.status.code(), Some(1), "{}", text_of(&out));
    let stderr = text(&out.stderr);
    let lines: Vec<serde_json::Value> = stderr
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l:?}")))
        .collect();
    let last = lines.last().expect("a line on stderr");
    assert_eq!(last["level"], "ERROR", "{last}");
    assert_eq!(last["target"], "kvtier", "{last}");
    let message = last["fields"]["message"].as_str().expect("message");
    assert!(message.contains("could not create data dir"), "{last}");
    assert!(last["timestamp"].as_str().is_some(), "{last}");
    // A configuration that fails to load says why in JSON too, when its
    // flag, environment or file asks for JSON (it was text: QA).
    let config = dir.path().join("json.toml");
    std::fs::write(&config, "log-format = \"json\"\nram_budget = \"1GiB\"\n").expect("write");
    let config = config.to_string_lossy();
    for (args, env) in [
        (
            &["--log-format", "json", "--ram-budget", "1KiB"][..],
            &[][..],
        ),
        (
            &["--ram-budget", "1KiB"][..],
            &[("KVTIER_LOG_FORMAT", "json")][..],
        ),
        (&["--config", &config][..], &[][..]),
    ] {
        let out = run_kvtier(&[&["node", "start"][..], args].concat(), env);
        assert_eq!(out.status.code(), Some(1), "{}", text_of(&out));
        let stderr = text(&out.stderr);
        let line: serde_json::Value = serde_json::from_str(stderr.trim())
            .unwrap_or_else(|e| panic!("{args:?} {env:?}: not one JSON line ({e}): {stderr}"));
        let message = line["fields"]["message"].as_str().expect("message");
        assert!(
            message.contains("ram-budget") || message.contains("ram_budget"),
            "{line}"
        );
    }
    // The human format keeps its text line.
    let out = start(&[]);
    assert_eq!(out.status.code(), Some(1), "{}", text_of(&out));
    assert!(
        text(&out.stderr).contains("kvtier: error: could not create data dir"),
        "{}",
        text_of(&out)
    );
}

#[test]
fn an_unreachable_daemon_exits_3() {
    let dir = tempfile::tempdir().expect("temp dir");
    let sock = dir.path().join("none.sock").to_string_lossy().into_owned();
    let out = run_kvtier(&["stats", "--socket", &sock], &[]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert!(
        err.contains("none.sock") && err.contains("kvtier node start"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn a_daemon_that_stopped_answering_exits_3_after_the_timeout() {
    let dir = tempfile::tempdir().expect("temp dir");
    let d = Daemon::start(dir.path(), &[], &[]).unwrap_or_else(|e| panic!("{e}"));
    let sock = d.socket.to_string_lossy().into_owned();
    kvtier_tests::freeze(d.pid());
    // `flush` waits forever by default; `--timeout` bounds it too.
    for cmd in ["stats", "flush", "peers"] {
        let t = std::time::Instant::now();
        let out = run_kvtier(&[cmd, "--socket", &sock, "--timeout", "1s"], &[]);
        let err = text(&out.stderr);
        kvtier_tests::signal(d.pid(), libc::SIGCONT);
        assert_eq!(out.status.code(), Some(3), "{cmd}: {err}");
        assert!(err.contains("did not answer in time"), "{cmd}: {err}");
        assert!(
            t.elapsed() < std::time::Duration::from_secs(20),
            "{cmd} took {:?}",
            t.elapsed()
        );
        kvtier_tests::freeze(d.pid());
    }
    // `namespaces` on a running daemon asks its HTTP /status: the same exit.
    let data = d.data_dir.to_string_lossy().into_owned();
    let out = run_kvtier(&["namespaces", "--data-dir", &data], &[]);
    let err = text(&out.stderr);
    kvtier_tests::signal(d.pid(), libc::SIGCONT);
    assert_eq!(out.status.code(), Some(3), "namespaces: {err}");
    assert!(err.contains("did not answer in time"), "namespaces: {err}");
    // Answering again: 0 waits forever, and gets the reply.
    let out = run_kvtier(&["stats", "--socket", &sock, "--timeout", "0"], &[]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
}

/// A listener that never accepts, its backlog full (a stopped or swamped
/// daemon): the connect itself is bounded by `--timeout`.
#[test]
fn a_full_listen_backlog_times_out_the_connect() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("full.sock");
    let listener = std::os::unix::net::UnixListener::bind(&path).expect("bind");
    let mut held = Vec::new();
    // The backlog (SOMAXCONN, 4096 at most) fills; then connects block.
    let t0 = std::time::Instant::now();
    loop {
        let (tx, rx) = std::sync::mpsc::channel();
        let p = path.clone();
        std::thread::spawn(move || {
            let _ = tx.send(std::os::unix::net::UnixStream::connect(p));
        });
        match rx.recv_timeout(std::time::Duration::from_millis(200)) {
            Ok(s) => held.push(s.expect("connect while the backlog has room")),
            Err(_) => break,
        }
        assert!(held.len() <= 5000, "the backlog never filled");
        assert!(t0.elapsed() < std::time::Duration::from_secs(60));
    }
    let sock = path.to_string_lossy().into_owned();
    for cmd in ["stats", "flush"] {
        let t = std::time::Instant::now();
        let out = run_kvtier(&[cmd, "--socket", &sock, "--timeout", "1s"], &[]);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(3), "{cmd}: {err}");
        assert!(
            err.contains("did not answer in time (connect)"),
            "{cmd}: {err}"
        );
        assert!(
            t.elapsed() < std::time::Duration::from_secs(20),
            "{cmd} took {:?}",
            t.elapsed()
        );
    }
    drop(listener);
}

#[test]
fn cert_refuses_bad_input_before_writing_anything() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ca = dir.path().join("ca");
    let ca_s = ca.to_string_lossy().into_owned();
    let init_ca = |days: &str| {
        run_kvtier(
            &[
                "cert",
                "init-ca",
                "--cluster",
                "c1",
                "--out",
                &ca_s,
                "--days",
                days,
            ],
            &[],
        )
    };
    for days in ["0", "99999999", "-1"] {
        let out = init_ca(days);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "--days {days}: {err}");
        assert!(!err.contains("panicked"), "{err}");
        assert!(!ca.exists(), "--days {days} wrote {}", ca.display());
    }
    let out = init_ca("2");
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let node = dir.path().join("n1");
    let node_s = node.to_string_lossy().into_owned();
    for (extra, want) in [
        (&["--dns", "a b"][..], "invalid DNS name"),
        (&["--dns", "10.0.0.1"][..], "give it with --ip"),
        (&["--days", "0"][..], "0 is not in 1..=36500"),
    ] {
        let out = run_kvtier(
            &[
                &[
                    "cert", "issue", "--ca", &ca_s, "--node", "n1", "--out", &node_s,
                ][..],
                extra,
            ]
            .concat(),
            &[],
        );
        let err = text(&out.stderr);
        // Malformed values are usage errors.
        assert_eq!(out.status.code(), Some(2), "{extra:?}: {err}");
        assert!(err.contains(want), "{extra:?}: {err}");
        assert!(!node.exists(), "{extra:?} wrote {}", node.display());
    }
    // Names a peer could never verify as the node's DNS name, too.
    for bad in ["n_1", "n1..x", "n1.", "10.0.0.1"] {
        let out = run_kvtier(
            &[
                "cert", "issue", "--ca", &ca_s, "--node", bad, "--out", &node_s,
            ],
            &[],
        );
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{bad}: {err}");
        assert!(err.contains("invalid node name"), "{bad}: {err}");
        assert!(!node.exists());
    }
    // Into the CA's own directory (ca.pem is there): refused whole.
    let out = run_kvtier(
        &[
            "cert", "issue", "--ca", &ca_s, "--node", "n1", "--out", &ca_s,
        ],
        &[],
    );
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    assert!(!ca.join("node.key").exists() && !ca.join("node.pem").exists());
    // Longer than the CA: issued, ending with the CA, and said so.
    let out = run_kvtier(
        &[
            "cert", "issue", "--ca", &ca_s, "--node", "n1", "--out", &node_s,
        ],
        &[],
    );
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(err.contains("the CA expires in 2 day(s)"), "{err}");
    assert!(!err.contains("warning"), "{err}");
    // A CA key the group can read: issued, with a warning (QA: none).
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(ca.join("ca.key"), std::fs::Permissions::from_mode(0o640))
        .expect("chmod");
    let node2 = dir.path().join("n2").to_string_lossy().into_owned();
    let out = run_kvtier(
        &[
            "cert", "issue", "--ca", &ca_s, "--node", "n2", "--out", &node2,
        ],
        &[],
    );
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(
        err.contains("ca.key has mode 0640") && err.contains("chmod 600"),
        "{err}"
    );
    // An --out that is a file: said as such (QA: "File exists").
    let file = dir.path().join("afile");
    std::fs::write(&file, b"x").expect("write");
    let out = run_kvtier(
        &[
            "cert",
            "init-ca",
            "--cluster",
            "c2",
            "--out",
            &file.to_string_lossy(),
        ],
        &[],
    );
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("is not a directory"), "{err}");
}

#[test]
fn config_check_prints_a_config_that_parses_back() {
    let dir = tempfile::tempdir().expect("temp dir");
    let data = dir.path().join("data").to_string_lossy().into_owned();
    let out = run_kvtier(
        &[
            "config",
            "check",
            "--data-dir",
            &data,
            "--ram-budget",
            "1GiB",
        ],
        &[
            ("KVTIER_RESP_LISTEN", "off"),
            ("KVTIER_GPU_KV_POOL", "1TiB"),
        ],
    );
    let toml = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(
        toml.contains("ram-budget = \"1GiB\"") && toml.contains("resp-listen = \"off\""),
        "{toml}"
    );
    assert!(
        toml.contains("NOT larger than the GPU KV pool"),
        "the seed-003 warning: {toml}"
    );
    let file = dir.path().join("effective.toml");
    std::fs::write(&file, &toml).expect("write");
    let f = file.to_string_lossy().into_owned();
    let out = run_kvtier(&["config", "check", "--config", &f, "--json"], &[]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("config check --json");
    assert_eq!(v["config"]["ram-budget"], "1GiB");
    assert_eq!(v["config"]["data-dir"], data.as_str());
    // A RESP password is never printed (QA: it showed in clear, though
    // `--help` warns that flags show in `ps`); where it came from is.
    for json in [false, true] {
        let mut args = vec!["config", "check", "--config", &f];
        if json {
            args.push("--json");
        }
        let out = run_kvtier(&args, &[("KVTIER_RESP_PASSWORD", "s3cret-pw")]);
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
        let said = text(&out.stdout);
        assert!(!said.contains("s3cret-pw"), "{said}");
        assert!(said.contains("resp-password"), "{said}");
    }
}

/// A config whose socket directory this user could not create is valid but not
/// "OK": the header says how many warnings follow, and `--strict` exits 1
/// (QA: a scripted preflight passed, then the start failed). The output is
/// one write, so `| head -1` leaves the exit status 0 (it was 141).
#[test]
fn config_check_warnings_are_not_ok_and_strict_fails_on_them() {
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::write(dir.path().join("file"), b"x").expect("write");
    // A socket below a regular file: nobody can create it, root included.
    let sock = dir.path().join("file").join("kvtier.sock");
    let sock = sock.to_string_lossy().into_owned();
    let data = dir.path().join("data").to_string_lossy().into_owned();
    let env = [("KVTIER_RESP_LISTEN", "off"), ("KVTIER_HTTP_LISTEN", "off")];
    let check = |strict: bool, sock: &str| {
        // A small RAM budget: the automatic disk budget (half the free
        // space) stays larger than it on any test machine.
        let mut args = vec![
            "config",
            "check",
            "--data-dir",
            &data,
            "--socket",
            sock,
            "--ram-budget",
            "16MiB",
        ];
        if strict {
            args.push("--strict");
        }
        run_kvtier(&args, &env)
    };
    let out = check(false, &sock);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let said = text(&out.stdout);
    let first = said.lines().next().unwrap_or_default();
    assert!(
        first.starts_with("# configuration valid, with 1 warning(s)"),
        "{said}"
    );
    assert!(!said.contains("configuration OK"), "{said}");
    let out = check(true, &sock);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stdout));
    assert!(
        text(&out.stderr).contains("kvtier: error: config check --strict: 1 warning(s)"),
        "{}",
        text(&out.stderr)
    );
    // With --json: the failed command's document (QA: no error, no
    // exit_code), and what the sizes come to.
    let sized = [
        "config",
        "check",
        "--data-dir",
        &data,
        "--ram-budget",
        "16MiB",
        "--disk-budget",
        "300MiB",
        "--region-size",
        "32MiB",
    ];
    let strict_json = [&sized[..], &["--socket", &sock, "--strict", "--json"]].concat();
    let out = run_kvtier(&strict_json, &env);
    assert_eq!(out.status.code(), Some(1), "{}", text_of(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(v["ok"], false, "{v}");
    assert_eq!(v["exit_code"], 1, "{v}");
    assert!(
        v["error"].as_str().expect("error").contains("--strict"),
        "{v}"
    );
    assert_eq!(v["store"]["regions"], 9, "{v}");
    assert_eq!(v["store"]["disk_bytes"], 9u64 * (32 << 20), "{v}");
    let out = run_kvtier(&sized, &env);
    assert!(
        text(&out.stdout).contains(
            "# store: 9 × 32.0 MiB regions = 288.0 MiB (disk-budget rounded down to whole \
             regions); chunks up to 15.9 MiB"
        ),
        "{}",
        text_of(&out)
    );
    let sock = dir
        .path()
        .join("kvtier.sock")
        .to_string_lossy()
        .into_owned();
    let out = check(true, &sock);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(text(&out.stdout).starts_with("# configuration OK"));
    let bin = kvtier_tests::kvtier_bin();
    for _ in 0..3 {
        let out = std::process::Command::new("bash")
            .arg("-c")
            .arg(format!(
                "KVTIER_RESP_LISTEN=off KVTIER_HTTP_LISTEN=off '{}' config check --data-dir '{data}' \
                 --socket '{sock}' | head -1 >/dev/null; echo ${{PIPESTATUS[0]}}",
                bin.display()
            ))
            .output()
            .expect("bash");
        assert_eq!(text(&out.stdout).trim(), "0", "{}", text(&out.stderr));
    }
}

/// `config check` on an existing store of another size: one sentence
/// naming the key and where its value came from (QA: "the chunk store in
/// D", then a cause naming neither); with `--json`, a JSON object on
/// stdout as well (QA: stdout was empty), the same message on stderr and
/// exit 1.
#[test]
fn config_check_names_the_key_an_existing_store_refuses_and_json_says_so() {
    use node::tier::layout::{STORE_VERSION, Superblock};
    let dir = tempfile::tempdir().expect("temp dir");
    let data = dir.path().join("data");
    std::fs::create_dir_all(&data).expect("mkdir");
    // A store of 8 regions of 1 MiB (a superblock and its length suffice).
    let mut sb = [0u8; 4096];
    Superblock {
        version: STORE_VERSION,
        region_size: 1 << 20,
        region_count: 8,
        created_ms: 1,
    }
    .encode_into(&mut sb);
    let file = data.join("store.kvt");
    std::fs::write(&file, sb).expect("write superblock");
    std::fs::OpenOptions::new()
        .write(true)
        .open(&file)
        .and_then(|f| f.set_len(8 << 20))
        .expect("store length");
    let data = data.to_string_lossy().into_owned();
    let env = [("KVTIER_RESP_LISTEN", "off"), ("KVTIER_HTTP_LISTEN", "off")];
    let check = |json: bool, budget: &str| {
        let mut args = vec![
            "config",
            "check",
            "--data-dir",
            &data,
            "--ram-budget",
            "4MiB",
            "--disk-reserve",
            "0",
            "--disk-budget",
            budget,
        ];
        if json {
            args.push("--json");
        }
        run_kvtier(&args, &env)
    };
    let want = "kvtier: error: invalid `disk-budget` (from command-line flag --disk-budget): \
                16MiB makes 16 regions of 1MiB, but the chunk store in ";
    let out = check(false, "16MiB");
    assert_eq!(out.status.code(), Some(1), "{}", text_of(&out));
    let err = text(&out.stderr);
    assert!(err.starts_with(want), "{err}");
    assert!(err.contains("set disk-budget to 8MiB"), "{err}");
    assert_eq!(err.lines().count(), 1, "one sentence, no cause: {err}");
    assert!(out.stdout.is_empty(), "{}", text(&out.stdout));

    let out = check(true, "16MiB");
    assert_eq!(out.status.code(), Some(1), "{}", text_of(&out));
    assert!(text(&out.stderr).starts_with(want), "{}", text_of(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {}", text_of(&out)));
    assert_eq!(v["ok"], false, "{v}");
    let msg = v["error"].as_str().expect("error");
    assert!(
        msg.starts_with("invalid `disk-budget` (from command-line flag --disk-budget)"),
        "{v}"
    );
    // A key refused before any store is looked at: the same.
    let out = run_kvtier(
        &[
            "config",
            "check",
            "--json",
            "--data-dir",
            &data,
            "--ram-budget",
            "12KiB",
        ],
        &env,
    );
    assert_eq!(out.status.code(), Some(1), "{}", text_of(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {}", text_of(&out)));
    assert_eq!(v["ok"], false, "{v}");
    assert!(
        v["error"]
            .as_str()
            .is_some_and(|e| e.contains("ram-budget")),
        "{v}"
    );

    // The store's own size passes, and says `ok`.
    let out = check(true, "8MiB");
    assert_eq!(out.status.code(), Some(0), "{}", text_of(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(v["ok"], true, "{v}");
}

#[test]
fn verify_and_gc_work_offline_and_report_bad_chunks() {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut d = Daemon::start(dir.path(), &[], &[]).unwrap_or_else(|e| panic!("{e}"));
    let mut c = d.client();
    let ns = c.hello(&kvtier_tests::test_record(0)).expect("HELLO");
    for i in 0..12 {
        let (key, data) = kvtier_tests::chunk_bytes(300, i);
        assert_eq!(c.put_bytes(ns, 0, &[(key, &data)]).expect("PUT"), vec![0]);
    }
    assert_eq!(d.stop_with(libc::SIGTERM).code(), Some(0), "{}", d.log());

    let data = d.data_dir.to_string_lossy().into_owned();
    let store = [
        &["--data-dir", data.as_str(), "--ram-budget", "64MiB"][..],
        &TEST_STORE,
    ]
    .concat();
    let out = run_kvtier(&[&["verify", "--json"][..], &store].concat(), &[]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("verify --json");
    assert_eq!(v["checked"], 12, "{v}");
    assert_eq!(v["bad"], 0, "{v}");

    let id = ns.to_string();
    let out = run_kvtier(
        &[&["gc", "--namespace", &id, "--json"][..], &store].concat(),
        &[],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("gc --json");
    assert_eq!(v["dry_run"], true);
    assert!(v.get("dry-run").is_none(), "{v}");
    assert_eq!(v["report"]["chunks"], 12, "{v}");
    // An id this store does not hold is said, not counted as dropped.
    let out = run_kvtier(
        &[
            &["gc", "--namespace", &"12".repeat(16), "--json", "--apply"][..],
            &store,
        ]
        .concat(),
        &[],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("not in the namespace manifest"),
        "{}",
        text(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("gc --json");
    assert_eq!(v["report"]["chunks"], 0, "{v}");
    // A dry run dropped nothing.
    let out = run_kvtier(&[&["verify", "--json"][..], &store].concat(), &[]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("verify --json");
    assert_eq!(v["checked"], 12, "{v}");
    let out = run_kvtier(
        &[&["gc", "--namespace", &id, "--apply"][..], &store].concat(),
        &[],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("dropped"),
        "{}",
        text(&out.stdout)
    );
    let out = run_kvtier(&[&["verify", "--json"][..], &store].concat(), &[]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("verify --json");
    assert_eq!(v["checked"], 0, "gc --apply dropped the namespace: {v}");

    let out = run_kvtier(&[&["gc"][..], &store].concat(), &[]);
    assert_eq!(
        out.status.code(),
        Some(2),
        "gc without a selection is refused as a usage error"
    );
}

/// A daemon's store with `chunks` chunks of `chunk_bytes(round, i)` in
/// regions of `region`, flushed, the daemon killed (-9), then one byte
/// flipped halfway through the data written in the first `scan` bytes of
/// the store file. Returns the stopped daemon (for its data dir).
fn store_with_a_flipped_byte(
    dir: &std::path::Path,
    region: &str,
    chunks: u32,
    round: u32,
    scan: usize,
) -> Daemon {
    let mut args = kvtier_tests::test_args(dir);
    kvtier_tests::set_flag(&mut args, "--region-size", region);
    let mut d = Daemon::start_args(dir, &args, &[]).unwrap_or_else(|e| panic!("{e}"));
    let mut c = d.client();
    let ns = c.hello(&kvtier_tests::test_record(0)).expect("HELLO");
    for i in 0..chunks {
        let (key, data) = kvtier_tests::chunk_bytes(round, i);
        assert_eq!(c.put_bytes(ns, 0, &[(key, &data)]).expect("PUT"), vec![0]);
    }
    assert_eq!(c.flush().expect("FLUSH").failed, 0);
    d.kill9();
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(d.data_dir.join("store.kvt"))
        .expect("open store");
    let mut buf = vec![0u8; scan];
    f.read_exact_at(&mut buf, 0).expect("read store");
    let written = buf.iter().rposition(|b| *b != 0).expect("data written");
    let off = written / 2;
    f.write_all_at(&[buf[off] ^ 0xff], off as u64)
        .expect("flip");
    f.sync_all().expect("sync");
    d
}

#[test]
fn verify_exits_5_on_corrupt_chunks_and_repair_drops_them() {
    let dir = tempfile::tempdir().expect("temp dir");
    // 1 MiB regions: the chunks below fill several, so most are in sealed
    // regions, which reopen from their summaries without re-reading payloads.
    let d = store_with_a_flipped_byte(dir.path(), "1MiB", 24, 400, 1 << 20);
    let data = d.data_dir.to_string_lossy().into_owned();
    let store = [
        "--data-dir",
        data.as_str(),
        "--disk-budget",
        "32MiB",
        "--region-size",
        "1MiB",
        "--ram-budget",
        "64MiB",
    ];
    // A plain verify opens the store read-only: it writes nothing, so a
    // second run finds and says the same.
    let files = || {
        let mut v: Vec<(String, Vec<u8>)> = std::fs::read_dir(&d.data_dir)
            .expect("data dir")
            .flatten()
            .filter(|e| e.file_name() != "LOCK")
            .map(|e| {
                let bytes = std::fs::read(e.path()).expect("read");
                (e.file_name().to_string_lossy().into_owned(), bytes)
            })
            .collect();
        v.sort();
        v
    };
    let before = files();
    let mut said = Vec::new();
    for _ in 0..2 {
        let out = run_kvtier(&[&["verify"][..], &store].concat(), &[]);
        assert_eq!(
            out.status.code(),
            Some(5),
            "{}{}",
            text(&out.stdout),
            text(&out.stderr)
        );
        said.push(text(&out.stdout));
        assert!(before == files(), "a plain verify changed the data dir");
    }
    assert_eq!(said[0], said[1]);
    let out = run_kvtier(
        &[&["verify", "--repair", "--json"][..], &store].concat(),
        &[],
    );
    assert_eq!(
        out.status.code(),
        Some(5),
        "the repair run still reports what it found: {}",
        text(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("verify --json");
    assert!(v["dropped"].as_u64().expect("dropped") >= 1, "{v}");
    let out = run_kvtier(&[&["verify"][..], &store].concat(), &[]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "clean after repair: {}",
        text(&out.stdout)
    );
}

/// A start refused for a larger budget leaves the store file as it was, so
/// plain starts and offline commands go on working; a truncated file is
/// reported, not silently grown, until `verify --repair`.
#[test]
fn refused_opens_leave_the_store_file_alone_and_truncation_is_reported() {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut args = kvtier_tests::test_args(dir.path());
    kvtier_tests::set_flag(&mut args, "--region-size", "1MiB");
    let mut d = Daemon::start_args(dir.path(), &args, &[]).unwrap_or_else(|e| panic!("{e}"));
    let mut c = d.client();
    let ns = c.hello(&kvtier_tests::test_record(0)).expect("HELLO");
    for i in 0..24 {
        let (key, data) = kvtier_tests::chunk_bytes(402, i);
        assert_eq!(c.put_bytes(ns, 0, &[(key, &data)]).expect("PUT"), vec![0]);
    }
    assert_eq!(c.flush().expect("FLUSH").failed, 0);
    drop(c);
    assert!(d.stop_with(libc::SIGTERM).success());
    let path = d.data_dir.join("store.kvt");
    let len = |p: &std::path::Path| std::fs::metadata(p).expect("store file").len();
    assert_eq!(len(&path), 32 << 20);

    let mut larger = args.clone();
    kvtier_tests::set_flag(&mut larger, "--disk-budget", "64MiB");
    let refs: Vec<&str> = larger.iter().map(String::as_str).collect();
    let out = run_kvtier(&refs, &[]);
    assert_ne!(out.status.code(), Some(0));
    assert!(
        text(&out.stderr).contains("invalid `disk-budget` (from command-line flag --disk-budget)"),
        "{}",
        text(&out.stderr)
    );
    assert_eq!(
        len(&path),
        32 << 20,
        "the refused start did not grow the file"
    );
    // No budget given: the store's own size, from its superblock.
    let data = d.data_dir.to_string_lossy().into_owned();
    let store = ["--data-dir", data.as_str(), "--ram-budget", "64MiB"];
    let out = run_kvtier(&[&["verify"][..], &store].concat(), &[]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}{}",
        text(&out.stdout),
        text(&out.stderr)
    );

    // Truncated into its fourth region: reported (exit 5), and neither
    // verify nor namespaces touches the file.
    let cut = 3 * (1 << 20) + 4096;
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .and_then(|f| f.set_len(cut))
        .expect("truncate");
    let out = run_kvtier(&[&["verify"][..], &store].concat(), &[]);
    assert_eq!(out.status.code(), Some(5), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("truncated") && text(&out.stdout).contains("verify --repair"),
        "{}",
        text(&out.stdout)
    );
    // Its JSON has the keys of a report of a store that opened (QA: the
    // gc_pending keys were missing).
    let out = run_kvtier(&[&["verify", "--json"][..], &store].concat(), &[]);
    assert_eq!(out.status.code(), Some(5), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("verify --json");
    assert_eq!(
        (v["gc_pending"].clone(), v["gc_pending_error"].clone()),
        (serde_json::json!([]), serde_json::Value::Null),
        "{v}"
    );
    assert!(
        v.get("gc_pending").is_some() && v.get("gc_pending_error").is_some(),
        "{v}"
    );
    let out = run_kvtier(&[&["namespaces"][..], &store].concat(), &[]);
    assert_ne!(out.status.code(), Some(0));
    assert!(
        text(&out.stderr).contains("truncated"),
        "{}",
        text(&out.stderr)
    );
    assert_eq!(
        len(&path),
        cut,
        "read-only commands leave the file as it is"
    );
    // The repair grows it back and keeps what was before the cut.
    let out = run_kvtier(
        &[&["verify", "--repair", "--json"][..], &store].concat(),
        &[],
    );
    assert_eq!(out.status.code(), Some(5), "a repair that found something");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("verify --json");
    assert_eq!(v["grown_from"], cut, "{v}");
    assert_eq!(len(&path), 32 << 20);
    let out = run_kvtier(&[&["verify", "--json"][..], &store].concat(), &[]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stdout));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("verify --json");
    let kept = v["checked"].as_u64().expect("checked");
    assert!((1..24).contains(&kept), "{v}");
}

/// A chunk torn or corrupt in the region that was open at the last
/// shutdown is left out by recovery when the store opens, before verify's
/// walk: verify still reports it (exit 5, `dropped_at_open`) instead of a
/// clean store.
#[test]
fn verify_reports_chunks_recovery_dropped_in_the_open_region() {
    let dir = tempfile::tempdir().expect("temp dir");
    // 16 MiB regions: every chunk below stays in the first, still open, one.
    let d = store_with_a_flipped_byte(dir.path(), "16MiB", 8, 401, 8 << 20);
    let data = d.data_dir.to_string_lossy().into_owned();
    let store = [
        "--data-dir",
        data.as_str(),
        "--disk-budget",
        "32MiB",
        "--region-size",
        "16MiB",
        "--ram-budget",
        "64MiB",
    ];
    let out = run_kvtier(&[&["verify", "--json"][..], &store].concat(), &[]);
    assert_eq!(
        out.status.code(),
        Some(5),
        "{}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("verify --json");
    assert_eq!(v["dropped_at_open"], 1, "{v}");
    assert_eq!(v["checked"], 7, "{v}");
    assert!(
        text(&out.stderr).contains("dropped at recovery"),
        "{}",
        text(&out.stderr)
    );
    let out = run_kvtier(&[&["verify"][..], &store].concat(), &[]);
    assert_eq!(out.status.code(), Some(5));
    assert!(
        text(&out.stdout).contains("dropped at open: 1 chunk(s)"),
        "{}",
        text(&out.stdout)
    );
    // `--repair` seals that region without the chunk: later opens are clean
    // (they dropped and counted it again every time).
    let out = run_kvtier(&[&["verify", "--repair"][..], &store].concat(), &[]);
    assert_eq!(out.status.code(), Some(5), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("sealed now without them"),
        "{}",
        text(&out.stdout)
    );
    let out = run_kvtier(&[&["verify", "--json"][..], &store].concat(), &[]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("verify --json");
    assert_eq!(out.status.code(), Some(0), "{v}{}", text(&out.stderr));
    assert_eq!(
        (v["dropped_at_open"].as_u64(), v["checked"].as_u64()),
        (Some(0), Some(7)),
        "{v}"
    );
}

#[test]
fn verify_reports_damaged_region_metadata() {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut args = kvtier_tests::test_args(dir.path());
    kvtier_tests::set_flag(&mut args, "--region-size", "16MiB");
    let mut d = Daemon::start_args(dir.path(), &args, &[]).unwrap_or_else(|e| panic!("{e}"));
    let mut c = d.client();
    let ns = c.hello(&kvtier_tests::test_record(0)).expect("HELLO");
    for i in 0..8 {
        let (key, data) = kvtier_tests::chunk_bytes(402, i);
        assert_eq!(c.put_bytes(ns, 0, &[(key, &data)]).expect("PUT"), vec![0]);
    }
    assert_eq!(c.flush().expect("FLUSH").failed, 0);
    d.kill9();
    // One bit of the open slot of region 0 (the open region).
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(d.data_dir.join("store.kvt"))
        .expect("open store");
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, 4096 + 20).expect("read");
    f.write_all_at(&[b[0] ^ 1], 4096 + 20).expect("flip");
    f.sync_all().expect("sync");
    let data = d.data_dir.to_string_lossy().into_owned();
    let store = [
        "--data-dir",
        data.as_str(),
        "--disk-budget",
        "32MiB",
        "--region-size",
        "16MiB",
    ];
    let out = run_kvtier(&[&["verify", "--json"][..], &store].concat(), &[]);
    let all = format!("{}{}", text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(5), "{all}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("verify --json");
    assert_eq!(v["damaged_metadata"], 1, "{v}");
    assert_eq!(v["checked"], 8, "nothing lost: {v}");
    assert!(all.contains("damaged open slot"), "{all}");
    let out = run_kvtier(&[&["verify"][..], &store].concat(), &[]);
    assert_eq!(out.status.code(), Some(5));
    assert!(
        text(&out.stdout).contains("damaged at open: 1"),
        "{}",
        text(&out.stdout)
    );
    // The repair rewrites the slot: the next verify is clean, nothing lost.
    let out = run_kvtier(&[&["verify", "--repair"][..], &store].concat(), &[]);
    assert_eq!(out.status.code(), Some(5), "{}", text_of(&out));
    assert!(
        text(&out.stdout).contains("rewritten now"),
        "{}",
        text_of(&out)
    );
    let out = run_kvtier(&[&["verify", "--json"][..], &store].concat(), &[]);
    assert_eq!(out.status.code(), Some(0), "{}", text_of(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("verify --json");
    assert_eq!(
        (v["damaged_metadata"].clone(), v["checked"].clone()),
        (0.into(), 8.into()),
        "{v}"
    );
}

/// A `gc --apply` killed part way leaves its selection (`gc.pending`):
/// `verify` says so, and the next writable open finishes the drop.
#[test]
fn an_interrupted_gc_is_reported_and_finished() {
    let dir = tempfile::tempdir().expect("temp dir");
    let args = kvtier_tests::test_args(dir.path());
    let mut d = Daemon::start_args(dir.path(), &args, &[]).unwrap_or_else(|e| panic!("{e}"));
    let mut c = d.client();
    let ns = c.hello(&kvtier_tests::test_record(0)).expect("HELLO");
    let keep = c.hello(&kvtier_tests::test_record(1)).expect("HELLO");
    for i in 0..3 {
        let (key, data) = kvtier_tests::chunk_bytes(77, i);
        assert_eq!(c.put_bytes(ns, 0, &[(key, &data)]).expect("PUT"), vec![0]);
        assert_eq!(c.put_bytes(keep, 0, &[(key, &data)]).expect("PUT"), vec![0]);
    }
    drop(c);
    assert!(d.stop_with(libc::SIGTERM).success(), "{}", d.log());
    // What a gc of `ns` killed before its deletes leaves behind.
    std::fs::write(
        d.data_dir.join("gc.pending"),
        format!("{{\"version\":1,\"namespaces\":[\"{ns}\"]}}"),
    )
    .expect("write gc.pending");
    let data = d.data_dir.to_string_lossy().into_owned();
    let store = [&["--data-dir", data.as_str()][..], &TEST_STORE].concat();
    let out = run_kvtier(&[&["verify", "--json"][..], &store].concat(), &[]);
    assert_eq!(out.status.code(), Some(0), "{}", text_of(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("verify --json");
    assert_eq!(v["gc_pending"], serde_json::json!([ns.to_string()]), "{v}");
    assert_eq!(v["checked"], 6, "{v}");
    let out = run_kvtier(&[&["verify"][..], &store].concat(), &[]);
    assert!(
        text(&out.stdout).contains("gc pending"),
        "{}",
        text_of(&out)
    );
    // The gc run again (as after one that failed with its selection
    // durable): the open finishes the drop first, and says so (QA: the
    // retry read "dropped: 0 namespace(s)" and "not in the manifest").
    let id = ns.to_string();
    let out = run_kvtier(
        &[&["gc", "--namespace", id.as_str(), "--apply"][..], &store].concat(),
        &[],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text_of(&out));
    let err = text(&out.stderr);
    assert!(
        err.contains(&format!(
            "finished an interrupted gc --apply first (gc.pending): dropped {id}"
        )),
        "{err}"
    );
    assert!(!err.contains("not in the namespace manifest"), "{err}");
    let out = run_kvtier(&[&["verify", "--json"][..], &store].concat(), &[]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("verify --json");
    assert_eq!(
        (v["gc_pending"].clone(), v["checked"].clone()),
        (serde_json::json!([]), 3.into()),
        "{v}"
    );
    assert_eq!(v["gc_pending_error"], serde_json::Value::Null, "{v}");
    // A gc.pending that does not parse is damage (its namespaces are
    // unknown): reported, exit 5; `verify --repair` removes it.
    std::fs::write(d.data_dir.join("gc.pending"), "{\"version\":1,\"namesp").expect("write");
    let out = run_kvtier(&[&["verify", "--json"][..], &store].concat(), &[]);
    assert_eq!(out.status.code(), Some(5), "{}", text_of(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("verify --json");
    assert!(v["gc_pending_error"].is_string(), "{v}");
    let out = run_kvtier(&[&["verify"][..], &store].concat(), &[]);
    assert_eq!(out.status.code(), Some(5), "{}", text_of(&out));
    assert!(
        text(&out.stdout).contains("gc pending: unreadable"),
        "{}",
        text_of(&out)
    );
    // A repair that removed it found something: exit 5, said (QA: exit 0).
    let out = run_kvtier(&[&["verify", "--repair"][..], &store].concat(), &[]);
    assert_eq!(out.status.code(), Some(5), "{}", text_of(&out));
    assert!(
        text(&out.stdout).contains("gc pending: unreadable")
            && text(&out.stdout).contains("removed now"),
        "{}",
        text_of(&out)
    );
    assert!(!d.data_dir.join("gc.pending").exists());
    let out = run_kvtier(&[&["verify", "--repair"][..], &store].concat(), &[]);
    assert_eq!(out.status.code(), Some(0), "{}", text_of(&out));
}

/// The offline tools use the store's keys only: a config file whose daemon
/// keys need what the service's environment gives (a RESP password for a
/// non-loopback `resp-listen`, `tls-dir` for `peer-listen`) still verifies,
/// gc's and lists (QA: each failed with exit 1); the daemon refuses it.
#[test]
fn offline_tools_ignore_the_daemons_own_keys_in_a_config_file() {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut d = Daemon::start(dir.path(), &[], &[]).unwrap_or_else(|e| panic!("{e}"));
    let mut c = d.client();
    let ns = c.hello(&kvtier_tests::test_record(0)).expect("HELLO");
    let (key, data) = kvtier_tests::chunk_bytes(310, 0);
    assert_eq!(c.put_bytes(ns, 0, &[(key, &data)]).expect("PUT"), vec![0]);
    drop(c);
    // `config check` of that data dir says a daemon holds it (not a
    // warning: --strict passes; QA: it said nothing).
    let data = d.data_dir.to_string_lossy().into_owned();
    let out = run_kvtier(
        &[
            &[
                "config",
                "check",
                "--strict",
                "--json",
                "--ram-budget",
                "8MiB",
                "--data-dir",
                data.as_str(),
            ][..],
            &TEST_STORE,
        ]
        .concat(),
        &[],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text_of(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("config check --json");
    assert!(
        v["in_use"]
            .as_str()
            .is_some_and(|n| n.contains("a running kvtier daemon (pid ")),
        "{v}"
    );
    assert_eq!(d.stop_with(libc::SIGTERM).code(), Some(0), "{}", d.log());
    let file = dir.path().join("kvtier.toml");
    std::fs::write(
        &file,
        format!(
            "data-dir = {:?}\nresp-listen = \"0.0.0.0:1\"\npeer-listen = \"127.0.0.1:1\"\n",
            d.data_dir
        ),
    )
    .expect("write config");
    let conf = file.to_string_lossy().into_owned();
    let store = [&["--config", conf.as_str()][..], &TEST_STORE].concat();
    let out = run_kvtier(&[&["verify", "--json"][..], &store].concat(), &[]);
    assert_eq!(out.status.code(), Some(0), "{}", text_of(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("verify --json");
    assert_eq!(v["checked"], 1, "{v}");
    let id = ns.to_string();
    let out = run_kvtier(&[&["gc", "--namespace", &id][..], &store].concat(), &[]);
    assert_eq!(out.status.code(), Some(0), "{}", text_of(&out));
    let out = run_kvtier(&[&["namespaces", "--json"][..], &store].concat(), &[]);
    assert_eq!(out.status.code(), Some(0), "{}", text_of(&out));
    // The daemon's own check still refuses it, naming the key that is set.
    let out = run_kvtier(&[&["config", "check"][..], &store].concat(), &[]);
    assert_eq!(out.status.code(), Some(1), "{}", text_of(&out));
    assert!(
        text(&out.stderr).contains("resp-listen"),
        "{}",
        text_of(&out)
    );
}

/// A corrupt `namespaces.json` stops the daemon from starting with a message
/// that names the repair; `verify` reports it, `verify --repair` sets the file
/// aside, and the chunks serve again once a client registers its namespace.
#[test]
fn verify_repair_sets_a_corrupt_namespace_manifest_aside() {
    let dir = tempfile::tempdir().expect("temp dir");
    let args = kvtier_tests::test_args(dir.path());
    let mut d = Daemon::start_args(dir.path(), &args, &[]).unwrap_or_else(|e| panic!("{e}"));
    let mut c = d.client();
    let record = kvtier_tests::test_record(0);
    let ns = c.hello(&record).expect("HELLO");
    let chunks: Vec<_> = (0..4).map(|i| kvtier_tests::chunk_bytes(403, i)).collect();
    for (key, data) in &chunks {
        assert_eq!(c.put_bytes(ns, 0, &[(*key, data)]).expect("PUT"), vec![0]);
    }
    drop(c);
    assert!(d.stop_with(libc::SIGTERM).success(), "{}", d.log());
    let manifest = d.data_dir.join("namespaces.json");
    let json = std::fs::read(&manifest).expect("read namespaces.json");
    std::fs::write(&manifest, &json[..json.len() / 2]).expect("cut namespaces.json");

    let refused = Daemon::start_args(dir.path(), &args, &[])
        .map(|_| ())
        .expect_err("refused");
    assert!(refused.contains("corrupt namespace manifest"), "{refused}");
    assert!(refused.contains("kvtier verify --repair"), "{refused}");
    let data = d.data_dir.to_string_lossy().into_owned();
    let store = [&["--data-dir", data.as_str()][..], &TEST_STORE].concat();
    let out = run_kvtier(&[&["verify"][..], &store].concat(), &[]);
    assert_eq!(out.status.code(), Some(5), "{}", text_of(&out));
    assert!(
        text(&out.stdout).contains("corrupt namespace manifest"),
        "{}",
        text_of(&out)
    );
    assert_eq!(
        std::fs::read(&manifest).expect("left as it was").len(),
        json.len() / 2
    );
    // The chunks are checked all the same (QA: none were, so damage to
    // them showed only after the repair).
    let out = run_kvtier(&[&["verify", "--json"][..], &store].concat(), &[]);
    assert_eq!(out.status.code(), Some(5), "{}", text_of(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("verify --json");
    assert_eq!(v["checked"], 4, "{v}");
    assert!(
        v["problems"][0]
            .as_str()
            .is_some_and(|p| p.contains("corrupt namespace manifest")),
        "{v}"
    );
    // `namespaces` and a `gc` dry run still refuse it (they would list or
    // plan from part of it, silently: review).
    for cmd in [&["namespaces"][..], &["gc", "--older-than", "1d"][..]] {
        let out = run_kvtier(&[cmd, &store].concat(), &[]);
        assert_eq!(out.status.code(), Some(1), "{cmd:?}: {}", text_of(&out));
        assert!(
            text(&out.stderr).contains("verify --repair"),
            "{cmd:?}: {}",
            text_of(&out)
        );
    }

    let out = run_kvtier(
        &[&["verify", "--repair", "--json"][..], &store].concat(),
        &[],
    );
    assert_eq!(
        out.status.code(),
        Some(5),
        "a repair that found something: {}",
        text_of(&out)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("verify --json");
    let repaired = &v["manifest_repaired"];
    assert_eq!(repaired["records_kept"], 0, "{v}");
    assert_eq!(v["checked"], 4, "no chunk lost: {v}");
    let aside = repaired["set_aside"].as_str().expect("set_aside");
    assert_eq!(
        std::fs::read(aside).expect("set aside").len(),
        json.len() / 2
    );
    let out = run_kvtier(&[&["verify"][..], &store].concat(), &[]);
    assert_eq!(out.status.code(), Some(0), "{}", text_of(&out));
    // The chunks whose record was lost are still listed, by id.
    let out = run_kvtier(&[&["namespaces", "--json"][..], &store].concat(), &[]);
    assert_eq!(out.status.code(), Some(0), "{}", text_of(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("namespaces --json");
    assert_eq!(
        v,
        serde_json::json!([{
            "id": ns.to_string(),
            "record": null,
            "chunks": 4,
            "bytes": chunks.iter().map(|(_, d)| d.len()).sum::<usize>(),
        }]),
        "{v}"
    );
    let out = run_kvtier(&[&["namespaces"][..], &store].concat(), &[]);
    let listed = text(&out.stdout);
    assert!(
        listed.contains(&ns.to_string()) && listed.contains("no record"),
        "{}",
        text_of(&out)
    );

    let d = Daemon::start_args(dir.path(), &args, &[]).unwrap_or_else(|e| panic!("{e}"));
    let mut c = d.client();
    assert_eq!(c.hello(&record).expect("HELLO again"), ns);
    for (key, data) in &chunks {
        assert_eq!(c.get_bytes(ns, 0, *key).expect("GET").as_ref(), Some(data));
    }
}

/// Every metric the Grafana dashboard (`docs/grafana/kvtier.json`) queries
/// is one a running daemon exports, so the dashboard cannot drift from
/// the daemon silently.
#[test]
fn the_dashboard_queries_only_metrics_the_daemon_exports() {
    let dashboard = include_str!("../../docs/grafana/kvtier.json");
    let doc: serde_json::Value = serde_json::from_str(dashboard).expect("dashboard JSON");
    let mut wanted = std::collections::BTreeSet::new();
    for panel in doc["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"].as_str().expect("expr");
            let mut rest = expr;
            while let Some(at) = rest.find("kvtier_") {
                let name: String = rest[at..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                rest = &rest[at + name.len()..];
                wanted.insert(name);
            }
        }
    }
    assert!(wanted.len() >= 20, "the dashboard's metrics: {wanted:?}");
    let dir = tempfile::tempdir().expect("temp dir");
    let d = Daemon::start(dir.path(), &[], &[]).unwrap_or_else(|e| panic!("{e}"));
    // Some labelled series appear once something happened: a put, a hit,
    // a miss, a flush.
    let mut c = d.client();
    let ns = c.hello(&kvtier_tests::test_record(0)).expect("HELLO");
    let (key, data) = kvtier_tests::chunk_bytes(7, 0);
    c.put_bytes(ns, 0, &[(key, &data)]).expect("PUT");
    assert!(c.get_bytes(ns, 0, key).expect("GET").is_some());
    let (absent, _) = kvtier_tests::chunk_bytes(7, 1);
    assert!(c.get_bytes(ns, 0, absent).expect("GET").is_none());
    c.flush().expect("FLUSH");
    let metrics = kvtier_tests::http_get(d.http.expect("http listener"), "/metrics");
    let exported: std::collections::BTreeSet<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("kvtier_"))
        .filter_map(|l| l.split(['{', ' ']).next())
        .collect();
    let missing: Vec<_> = wanted
        .iter()
        .filter(|w| !exported.contains(w.as_str()))
        .collect();
    assert!(
        missing.is_empty(),
        "dashboard metrics the daemon does not export: {missing:?}\nexported: {exported:?}"
    );
}

/// Completion scripts for every shell; `tier` (the alias) completes too; a
/// reader that closes early (`| head`) is not an error.
#[test]
fn completions_cover_the_tier_alias() {
    for (shell, want) in [
        (
            "bash",
            "complete -F _kvtier -o bashdefault -o default tier\n",
        ),
        ("zsh", "#compdef kvtier tier\n"),
        ("fish", "complete -c tier -w kvtier\n"),
        ("elvish", "kvtier"),
        ("powershell", "kvtier"),
    ] {
        let out = run_kvtier(&["completions", shell], &[]);
        assert_eq!(out.status.code(), Some(0), "{shell}: {}", text(&out.stderr));
        assert!(text(&out.stdout).contains(want), "{shell}: no {want:?}");
    }
    // The bash script parses.
    let out = run_kvtier(&["completions", "bash"], &[]);
    let script = tempfile::NamedTempFile::new().expect("temp file");
    std::fs::write(script.path(), &out.stdout).expect("write script");
    if let Ok(st) = std::process::Command::new("bash")
        .arg("-n")
        .arg(script.path())
        .status()
    {
        assert!(st.success(), "bash -n rejects the completion script");
    }
    let mut child = kvtier_tests::kvtier_command()
        .args(["completions", "zsh"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn");
    drop(child.stdout.take());
    let out = child.wait_with_output().expect("wait");
    // 141 when the script did not fit the pipe before it closed, else 0.
    assert!(
        matches!(out.status.code(), Some(0 | 141)),
        "{}",
        text(&out.stderr)
    );
    assert_eq!(text(&out.stderr), "", "no panic for a closed stdout");
}

/// A port already in use (TCP or the peers' UDP) or unreadable peer
/// certificates fail the start with a message naming them, before the store
/// file is created: nothing is left preallocated on disk.
#[test]
fn a_port_in_use_fails_the_start_before_the_store_is_created() {
    let dir = tempfile::tempdir().expect("temp dir");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = taken.local_addr().expect("addr").to_string();
    for flag in ["--http-listen", "--resp-listen"] {
        let mut args = kvtier_tests::test_args(dir.path());
        kvtier_tests::set_flag(&mut args, flag, &port);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = run_kvtier(&args, &[]);
        assert_eq!(out.status.code(), Some(1), "{flag}: {}", text(&out.stderr));
        let err = text(&out.stderr);
        assert!(
            err.contains(&port) && err.contains("in use"),
            "{flag}: {err}"
        );
        assert!(
            !dir.path().join("data").join("store.kvt").exists(),
            "{flag}: the store file was created"
        );
    }
    // The peer layer's QUIC port and its certificates are checked before
    // the store opens too.
    let udp = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind udp");
    let udp_port = udp.local_addr().expect("addr").to_string();
    let no_certs = dir.path().join("empty-tls");
    std::fs::create_dir(&no_certs).expect("tls dir");
    let no_certs = no_certs.to_str().expect("utf-8 path");
    let cases: [(&[&str], &str); 2] = [
        (
            &["--peer-listen", &udp_port, "--insecure-dev"],
            udp_port.as_str(),
        ),
        (
            &["--peer-listen", "127.0.0.1:0", "--tls-dir", no_certs],
            no_certs,
        ),
    ];
    for (extra, named) in cases {
        let mut args = kvtier_tests::test_args(dir.path());
        args.extend(extra.iter().map(|s| s.to_string()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = run_kvtier(&args, &[]);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{extra:?}: {err}");
        assert!(err.contains(named), "{extra:?}: {err}");
        assert!(
            !dir.path().join("data").join("store.kvt").exists(),
            "{extra:?}: the store file was created"
        );
    }
}

/// A daemon past its connection limit answers `busy` and closes: a client
/// command exits 3 (unreachable now, retry later), not 1.
#[test]
fn a_busy_daemon_exits_3() {
    use node::native::codec::{ErrorCode, encode_error};
    use std::io::Write;
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("busy.sock");
    let listener = std::os::unix::net::UnixListener::bind(&path).expect("bind");
    let server = std::thread::spawn(move || {
        let (mut conn, _) = listener.accept().expect("accept");
        let mut out = Vec::new();
        encode_error(
            &mut out,
            0,
            0,
            ErrorCode::Busy,
            "the daemon already serves 1024 connections (max-connections)",
        );
        conn.write_all(&out).expect("write busy");
    });
    let sock = path.to_string_lossy().into_owned();
    let out = run_kvtier(&["stats", "--socket", &sock, "--timeout", "10s"], &[]);
    server.join().expect("server thread");
    assert_eq!(out.status.code(), Some(3), "{}", text_of(&out));
    assert!(
        text(&out.stderr).contains("max-connections"),
        "{}",
        text_of(&out)
    );
}

/// The store file itself is locked: with the data dir's LOCK file removed
/// under a running daemon, `verify` (and a second daemon) are still
/// refused instead of writing beside it.
#[test]
fn a_removed_lock_file_does_not_let_a_second_writer_in() {
    let dir = tempfile::tempdir().expect("temp dir");
    let args = kvtier_tests::test_args(dir.path());
    let d = Daemon::start_args(dir.path(), &args, &[]).unwrap_or_else(|e| panic!("{e}"));
    std::fs::remove_file(d.data_dir.join("LOCK")).expect("remove LOCK");
    let data = d.data_dir.to_string_lossy().into_owned();
    let store = [&["--data-dir", data.as_str()][..], &TEST_STORE].concat();
    let out = run_kvtier(&[&["verify"][..], &store].concat(), &[]);
    assert_eq!(out.status.code(), Some(1), "{}", text_of(&out));
    assert!(
        text(&out.stderr).contains("in use by another process"),
        "{}",
        text_of(&out)
    );
    let mut second = kvtier_tests::test_args(dir.path());
    kvtier_tests::set_flag(
        &mut second,
        "--socket",
        &dir.path().join("second.sock").to_string_lossy(),
    );
    let refused = Daemon::start_args(dir.path(), &second, &[])
        .map(|_| ())
        .expect_err("second daemon");
    assert!(refused.contains("in use by another process"), "{refused}");
    let mut c = d.client();
    c.ping().expect("the first daemon still serves");
}

/// A store file that is not a kvtier store (its superblock unreadable) is
/// reported as bad, with what to do: no repair rebuilds a superblock.
#[test]
fn verify_of_an_unreadable_superblock_names_the_way_out() {
    let dir = tempfile::tempdir().expect("temp dir");
    let data = dir.path().join("data");
    std::fs::create_dir(&data).expect("data dir");
    std::fs::write(data.join("store.kvt"), vec![0x5a; 64 << 10]).expect("garbage store");
    let d = data.to_string_lossy().into_owned();
    for repair in [false, true] {
        let mut args = vec!["verify", "--data-dir", d.as_str()];
        if repair {
            args.push("--repair");
        }
        let out = run_kvtier(&args, &[]);
        assert_eq!(out.status.code(), Some(5), "{}", text_of(&out));
        let said = text(&out.stdout);
        assert!(said.contains("superblock"), "{said}");
        assert!(said.contains("move the data dir aside"), "{said}");
    }
    assert_eq!(
        std::fs::read(data.join("store.kvt")).expect("read").len(),
        64 << 10,
        "left as it was"
    );
}

/// Offline commands format nothing: a zeroed store file is reported, not
/// turned into a new empty store of the default size (QA: `verify
/// --repair` preallocated 16 GiB over a 64 MiB store whose superblock was
/// zeroed, and exited 0). `--disk-budget 0` (RAM only) is refused: it
/// checked nothing and exited 0. A report of a store that could not be
/// opened has the same JSON keys as any other.
#[test]
fn offline_commands_never_format_a_zeroed_store_or_ignore_it() {
    let dir = tempfile::tempdir().expect("temp dir");
    let data = dir.path().join("data");
    std::fs::create_dir(&data).expect("data dir");
    std::fs::write(data.join("store.kvt"), vec![0u8; 64 << 10]).expect("zeroed store");
    let d = data.to_string_lossy().into_owned();
    for args in [
        &["verify", "--data-dir", &d][..],
        &["verify", "--data-dir", &d, "--repair"],
    ] {
        let out = run_kvtier(args, &[]);
        assert_eq!(out.status.code(), Some(5), "{args:?}: {}", text_of(&out));
        assert!(
            text(&out.stdout).contains("no kvtier superblock"),
            "{}",
            text_of(&out)
        );
    }
    let out = run_kvtier(&["verify", "--data-dir", &d, "--json"], &[]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("verify --json");
    for key in [
        "checked",
        "bad",
        "dropped",
        "dropped_at_open",
        "damaged_metadata",
        "sealed_open_region",
        "grown_from",
        "manifest_repaired",
        "problems",
    ] {
        assert!(v.get(key).is_some(), "{key} missing: {v}");
    }
    let out = run_kvtier(
        &["gc", "--data-dir", &d, "--older-than", "1s", "--apply"],
        &[],
    );
    assert_eq!(out.status.code(), Some(1), "{}", text_of(&out));
    assert_eq!(
        std::fs::read(data.join("store.kvt")).expect("read"),
        vec![0u8; 64 << 10],
        "left as it was"
    );
    let out = run_kvtier(&["verify", "--data-dir", &d, "--disk-budget", "0"], &[]);
    assert_eq!(out.status.code(), Some(2), "{}", text_of(&out));
    assert!(
        text(&out.stderr).contains("--disk-budget 0"),
        "{}",
        text_of(&out)
    );
}

/// Starts `kvtier bench local` (a long RAM-only run) in `dir` and waits
/// (bounded) until its daemon is up: the bench, its scratch dir and the
/// daemon's pid (from the LOCK file).
fn start_bench_local(
    dir: &std::path::Path,
    stderr: std::process::Stdio,
) -> (std::process::Child, std::path::PathBuf, libc::pid_t) {
    let child = kvtier_tests::kvtier_command()
        .args(["bench", "local", "--dir"])
        .arg(dir)
        .args([
            "--sizes",
            "256KiB",
            "--concurrency",
            "1",
            "--set-bytes",
            "8MiB",
        ])
        .args(["--cell-bytes", "64GiB", "--pool", "4MiB", "--no-disk"])
        .stdout(std::process::Stdio::null())
        .stderr(stderr)
        .spawn()
        .expect("spawn kvtier bench");
    let scratch = dir.join(format!("kvtier-bench-local-{}", child.id()));
    let lock = scratch.join("node").join("data").join("LOCK");
    // Its daemon is up once the LOCK file names a pid (bounded wait).
    let until = std::time::Instant::now() + std::time::Duration::from_secs(120);
    let daemon = loop {
        let pid = std::fs::read_to_string(&lock)
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(t.lines().next()?).ok())
            .and_then(|v| v["pid"].as_i64());
        if let Some(pid) = pid {
            break pid as libc::pid_t;
        }
        assert!(
            std::time::Instant::now() < until,
            "the bench's daemon never started"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    (child, scratch, daemon)
}

/// A bench stopped by SIGTERM (or Ctrl-C) kills the daemon it started and
/// removes its scratch dir (both were left: a daemon with parent pid 1 and
/// up to gigabytes of scratch data), and exits 128 + the signal.
#[test]
fn a_bench_stopped_by_a_signal_kills_its_daemon_and_removes_its_scratch_dir() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (child, scratch, daemon) = start_bench_local(dir.path(), std::process::Stdio::piped());
    // SAFETY: kill(2) on the bench we spawned.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    let out = child.wait_with_output().expect("wait for the bench");
    assert_eq!(out.status.code(), Some(143), "{}", text(&out.stderr));
    assert!(!scratch.exists(), "the scratch dir is removed");
    // SAFETY: signal 0 only checks that the pid exists.
    let alive = unsafe { libc::kill(daemon, 0) } == 0;
    assert!(!alive, "the bench's daemon (pid {daemon}) is gone");
}

/// Whether `pid` is a live process (not gone, not a zombie waiting for a
/// reaper that a container's init may never be).
fn running(pid: libc::pid_t) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            let state = s.rsplit_once(')')?.1.trim_start().chars().next()?;
            Some(state != 'Z' && state != 'X')
        })
        .unwrap_or(false)
}

/// A bench killed with SIGKILL (no clean-up runs) still takes its daemon
/// with it (QA: the daemon lived on with parent pid 1).
#[test]
fn a_bench_killed_outright_takes_its_daemon_with_it() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (mut child, _, daemon) = start_bench_local(dir.path(), std::process::Stdio::null());
    child.kill().expect("SIGKILL the bench");
    child.wait().expect("reap the bench");
    let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while running(daemon) {
        if std::time::Instant::now() > until {
            // SAFETY: kill(2) on the daemon the test's bench started.
            unsafe { libc::kill(daemon, libc::SIGKILL) };
            panic!("the bench's daemon (pid {daemon}) outlived the bench's SIGKILL");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Values a bench cannot run with are refused before any work.
#[test]
fn bench_values_it_cannot_run_with_are_refused_up_front() {
    let t0 = std::time::Instant::now();
    let out = run_kvtier(
        &["bench", "local", "--concurrency", "2000", "--no-disk"],
        &[],
    );
    assert_ne!(out.status.code(), Some(0), "{}", text_of(&out));
    assert!(
        text(&out.stderr).contains("at most 1000 clients"),
        "{}",
        text_of(&out)
    );
    let out = run_kvtier(
        &["bench", "limits", "--sizes", "1MiB", "--pool", "100TiB"],
        &[],
    );
    assert_eq!(out.status.code(), Some(1), "{}", text_of(&out));
    assert!(
        text(&out.stderr).contains("memory available"),
        "{}",
        text_of(&out)
    );
    let out = run_kvtier(
        &[
            "bench",
            "limits",
            "--sizes",
            "1MiB",
            "--disk-bytes",
            "100TiB",
        ],
        &[],
    );
    assert_eq!(out.status.code(), Some(1), "{}", text_of(&out));
    assert!(
        text(&out.stderr).contains("free space"),
        "{}",
        text_of(&out)
    );
    let out = run_kvtier(&["bench", "churn", "--bg-rate", "0"], &[]);
    assert_eq!(out.status.code(), Some(2), "{}", text_of(&out));
    // A daemon named with --socket is reached first (not after the limits).
    let out = run_kvtier(
        &["bench", "local", "--socket", "/nonexistent/kvtier.sock"],
        &[],
    );
    assert_eq!(out.status.code(), Some(3), "{}", text_of(&out));
    assert!(
        t0.elapsed() < std::time::Duration::from_secs(30),
        "{:?}",
        t0.elapsed()
    );
}

/// A `--dir` that does not exist (or is a file) is refused before any work,
/// naming it, and nothing is created: it was created with its missing
/// parents, which stayed after the run.
#[test]
fn a_bench_dir_that_does_not_exist_is_refused_and_not_created() {
    let dir = tempfile::tempdir().expect("temp dir");
    let missing = dir.path().join("no-such").join("deeper");
    let file = dir.path().join("a-file");
    std::fs::write(&file, b"").expect("write");
    for (given, want) in [
        (&missing, "no such directory"),
        (&file, "is not a directory"),
    ] {
        // --socket to nothing: a bench that went on would fail there (3).
        let out = kvtier_tests::kvtier_command()
            .args([
                "bench",
                "local",
                "--socket",
                "/nonexistent/kvtier.sock",
                "--dir",
            ])
            .arg(given)
            .output()
            .expect("run kvtier bench");
        assert_eq!(out.status.code(), Some(2), "{}", text_of(&out));
        let err = text(&out.stderr);
        assert!(err.contains(want), "{err}");
        assert!(err.contains(&*given.to_string_lossy()), "{err}");
    }
    assert!(!dir.path().join("no-such").exists(), "nothing was created");
}

/// A working set of fewer chunks than a bench needs, and a `local` cell
/// smaller than its set, are refused up front naming the least value: they
/// were raised silently, so the figures were of other values than those
/// given (and labelled with the given ones).
#[test]
fn bench_sets_and_cells_below_their_minimum_are_refused_naming_it() {
    // --socket to nothing: a bench that went on would fail there (3).
    let local = ["bench", "local", "--socket", "/nonexistent/kvtier.sock"];
    for (args, want) in [
        (
            &["--sizes", "256KiB,1MiB", "--set-bytes", "8MiB"][..],
            "--set-bytes 32MiB or more",
        ),
        (
            &[
                "--sizes",
                "256KiB",
                "--set-bytes",
                "8MiB",
                "--cell-bytes",
                "4MiB",
            ][..],
            "--cell-bytes 8MiB or more",
        ),
    ] {
        let out = run_kvtier(&[&local[..], args].concat(), &[]);
        assert_eq!(out.status.code(), Some(2), "{}", text_of(&out));
        assert!(text(&out.stderr).contains(want), "{}", text_of(&out));
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let d = dir.path().to_string_lossy().into_owned();
    let out = run_kvtier(
        &[
            "bench",
            "vs",
            "--sizes",
            "256KiB",
            "--concurrency",
            "1",
            "--set-bytes",
            "1MiB",
            "--redis-server",
            "/nonexistent/redis-server",
            "--lmcache-python",
            "/nonexistent/python",
            "--dir",
            &d,
        ],
        &[],
    );
    assert_eq!(out.status.code(), Some(2), "{}", text_of(&out));
    assert!(
        text(&out.stderr).contains("--set-bytes 2MiB or more"),
        "{}",
        text_of(&out)
    );
}

/// `kvtier put FILE --namespace-record RECORD --name NAME --json` to the
/// daemon at `sock`: the namespace id it printed.
fn put_named(sock: &str, record: &std::path::Path, name: &str, file: &std::path::Path) -> String {
    let out = run_kvtier(
        &[
            "put",
            &file.to_string_lossy(),
            "--namespace-record",
            &record.to_string_lossy(),
            "--name",
            name,
            "--json",
            "--socket",
            sock,
        ],
        &[],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text_of(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("put --json");
    v["namespace"].as_str().expect("namespace").to_owned()
}

/// `kvtier get --name NAME --namespace NS -o PATH` from the daemon at `sock`.
fn get_named(sock: &str, ns: &str, name: &str, path: &std::path::Path) -> std::process::Output {
    run_kvtier(
        &[
            "get",
            "--name",
            name,
            "--namespace",
            ns,
            "-o",
            &path.to_string_lossy(),
            "--socket",
            sock,
        ],
        &[],
    )
}

/// `get -o FILE` that cannot write the whole chunk (a full filesystem: a
/// 128 KiB tmpfs, mounted where the test may, else skipped) leaves FILE as
/// it was and no temporary file (it left a truncated FILE in place of the
/// old one).
#[test]
fn a_get_that_cannot_write_the_whole_chunk_leaves_the_file_as_it_was() {
    let dir = tempfile::tempdir().expect("temp dir");
    let outdir = dir.path().join("small");
    std::fs::create_dir(&outdir).expect("mkdir");
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=128k", "kvtier-test"])
        .arg(&outdir)
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !mounted {
        eprintln!("SKIPPED: cannot mount a small tmpfs here");
        return;
    }
    struct Unmount(std::path::PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount").arg(&self.0).status();
        }
    }
    let _unmount = Unmount(outdir.clone());
    let d = Daemon::start(dir.path(), &[], &[]).unwrap_or_else(|e| panic!("{e}"));
    let sock = d.socket.to_string_lossy().into_owned();
    let record = dir.path().join("ns.toml");
    std::fs::write(&record, "model = \"m\"\n").expect("write record");
    let payload = dir.path().join("chunk.bin");
    let bytes: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    std::fs::write(&payload, &bytes).expect("write payload");
    let ns = put_named(&sock, &record, "big", &payload);
    let target = outdir.join("got.bin");
    std::fs::write(&target, b"old contents").expect("write old");
    let out = get_named(&sock, &ns, "big", &target);
    assert_eq!(out.status.code(), Some(1), "{}", text_of(&out));
    let kept = std::fs::read(&target).expect("read");
    assert!(
        kept == b"old contents",
        "the old file is kept, not cut to {} bytes",
        kept.len()
    );
    let left: Vec<_> = std::fs::read_dir(&outdir)
        .expect("list")
        .map(|e| e.expect("entry").file_name())
        .collect();
    assert_eq!(left.len(), 1, "no temporary file is left: {left:?}");
    // One that fits replaces it whole.
    let small = dir.path().join("small.bin");
    std::fs::write(&small, b"new contents").expect("write");
    put_named(&sock, &record, "small", &small);
    let out = get_named(&sock, &ns, "small", &target);
    assert_eq!(out.status.code(), Some(0), "{}", text_of(&out));
    assert_eq!(std::fs::read(&target).expect("read"), b"new contents");
}

/// A bench run to its end stops its daemons with SIGTERM (a graceful,
/// flushing stop) and exits 0. The bench blocks SIGTERM for its own signal
/// thread; its children inherited that mask through exec and ignored the
/// stop: every finished bench waited 60 s and exited 1. Its labels name a
/// size that is not whole KiB exactly (1000 B chunks were "0KiB", 8 of
/// them "0 MB per rank").
#[test]
fn a_bench_run_to_its_end_stops_its_daemons_gracefully() {
    let dir = tempfile::tempdir().expect("temp dir");
    let t0 = std::time::Instant::now();
    let out = kvtier_tests::kvtier_command()
        .args([
            "bench", "restore", "--chunks", "8", "--size", "1000B", "--dir",
        ])
        .arg(dir.path())
        .output()
        .expect("run kvtier bench restore");
    assert_eq!(out.status.code(), Some(0), "{}", text_of(&out));
    assert!(
        text(&out.stdout).contains("all checks passed"),
        "{}",
        text_of(&out)
    );
    assert!(
        text(&out.stdout).contains("8 chunks of 1000B (8000B per rank)"),
        "{}",
        text_of(&out)
    );
    assert_eq!(
        std::fs::read_dir(dir.path()).expect("list").count(),
        0,
        "the scratch dir is removed"
    );
    assert!(
        t0.elapsed() < std::time::Duration::from_secs(50),
        "no stop waited for its deadline: {:?}",
        t0.elapsed()
    );
}

/// `get -o` writes through a symlink (the link stays) and into a file with
/// other hard links (they all see the chunk): the whole-or-nothing rename
/// replaced the link with a file and split the hard links (review).
#[test]
fn get_writes_through_a_symlink_and_keeps_hard_links() {
    let dir = tempfile::tempdir().expect("temp dir");
    let d = Daemon::start(dir.path(), &[], &[]).unwrap_or_else(|e| panic!("{e}"));
    let sock = d.socket.to_string_lossy().into_owned();
    let record = dir.path().join("ns.toml");
    std::fs::write(&record, "model = \"m\"\n").expect("write record");
    let payload = dir.path().join("chunk.bin");
    std::fs::write(&payload, b"chunk bytes").expect("write payload");
    let ns = put_named(&sock, &record, "k", &payload);
    let target = dir.path().join("target.bin");
    std::fs::write(&target, b"old").expect("write");
    let link = dir.path().join("link.bin");
    std::os::unix::fs::symlink(&target, &link).expect("symlink");
    let hard = dir.path().join("hard.bin");
    let other = dir.path().join("other.bin");
    std::fs::write(&hard, b"old").expect("write");
    std::fs::hard_link(&hard, &other).expect("hard link");
    for path in [&link, &hard] {
        let out = get_named(&sock, &ns, "k", path);
        assert_eq!(out.status.code(), Some(0), "{}", text_of(&out));
    }
    assert!(
        std::fs::symlink_metadata(&link)
            .expect("stat")
            .file_type()
            .is_symlink()
    );
    assert_eq!(std::fs::read(&target).expect("read"), b"chunk bytes");
    assert_eq!(std::fs::read(&other).expect("read"), b"chunk bytes");
}

/// A stop that cannot persist the namespaces' last-used times (here a
/// directory planted under the manifest's temporary name, which even root
/// cannot replace) warns once, not once per flush and again at close, and
/// still exits 0 with the chunks flushed.
#[test]
fn a_stop_that_cannot_persist_last_used_times_warns_once() {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut d = Daemon::start(dir.path(), &[], &[]).unwrap_or_else(|e| panic!("{e}"));
    let mut c = d.client();
    let ns = c.hello(&kvtier_tests::test_record(0)).expect("HELLO");
    let (key, data) = kvtier_tests::chunk_bytes(330, 0);
    assert_eq!(c.put_bytes(ns, 0, &[(key, &data)]).expect("PUT"), vec![0]);
    drop(c);
    let planted = d.data_dir.join("namespaces.json.tmp");
    std::fs::create_dir_all(planted.join("x")).expect("plant a directory");
    assert_eq!(d.stop_with(libc::SIGTERM).code(), Some(0), "{}", d.log());
    let log = d.log();
    assert_eq!(
        log.matches("could not persist namespace last-used times")
            .count(),
        1,
        "{log}"
    );
    assert!(log.contains("\"flushed_chunks\":1"), "{log}");
}

/// Every command's `--json` prints `{"ok": false, ...}` on stdout when it
/// fails, with the exit code it returns (QA: stdout was empty but for
/// `config check`, so a script piping it to a JSON parser got nothing),
/// and the message on stderr as without `--json`; without `--json` stdout
/// stays empty. Usage errors too (exit code 2).
#[test]
fn json_commands_print_an_error_document_on_failure() {
    let dir = tempfile::tempdir().expect("temp dir");
    let sock = dir.path().join("none.sock");
    let sock = sock.to_string_lossy().into_owned();
    let data = dir.path().join("empty-data").to_string_lossy().into_owned();
    let ns = "00112233445566778899aabbccddeeff";
    let key = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";
    let cases: Vec<(Vec<&str>, i32)> = vec![
        (vec!["stats", "--socket", &sock], 3),
        (vec!["flush", "--socket", &sock], 3),
        (vec!["peers", "--socket", &sock], 3),
        (vec!["lookup", "--socket", &sock, "--namespace", ns, key], 3),
        (vec!["verify", "--data-dir", &data], 1),
        // A usage error clap refuses (QA: no JSON), and one in a value.
        (vec!["stats", "--socket", &sock, "--no-such-flag"], 2),
        (
            vec!["lookup", "--socket", &sock, "--namespace", "nothex", key],
            2,
        ),
    ];
    for (args, code) in cases {
        let plain = run_kvtier(&args, &[]);
        assert_eq!(
            plain.status.code(),
            Some(code),
            "{args:?}: {}",
            text_of(&plain)
        );
        assert!(plain.stdout.is_empty(), "{args:?}: {}", text_of(&plain));
        let mut with = args.clone();
        with.push("--json");
        let out = run_kvtier(&with, &[]);
        assert_eq!(out.status.code(), Some(code), "{with:?}: {}", text_of(&out));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("{with:?}: stdout is not JSON ({e}): {}", text_of(&out)));
        assert_eq!(v["ok"], false, "{v}");
        assert_eq!(v["exit_code"], code, "{v}");
        let msg = v["error"].as_str().expect("error");
        assert!(
            text(&out.stderr).contains(msg),
            "{with:?}: stderr lacks the message: {}",
            text_of(&out)
        );
    }
}

/// A put into a namespace the daemon has no record of says how a CLI user
/// registers one (QA: the daemon's own message says "send HELLO", which a
/// CLI user cannot).
#[test]
fn a_put_into_an_unknown_namespace_hints_at_namespace_record() {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut d = Daemon::start(dir.path(), &[], &[]).unwrap_or_else(|e| panic!("{e}"));
    let file = dir.path().join("chunk.bin");
    std::fs::write(&file, b"bytes").expect("write");
    let sock = d.socket.to_string_lossy().into_owned();
    let out = run_kvtier(
        &[
            "put",
            &file.to_string_lossy(),
            "--socket",
            &sock,
            "--namespace",
            "ffffffffffffffffffffffffffffffff",
            "--name",
            "x",
        ],
        &[],
    );
    assert_eq!(out.status.code(), Some(1), "{}", text_of(&out));
    let err = text(&out.stderr);
    assert!(err.contains("unknown-namespace"), "{err}");
    assert!(
        err.contains("hint:") && err.contains("put --namespace-record FILE"),
        "{err}"
    );
    assert_eq!(d.stop_with(libc::SIGTERM).code(), Some(0), "{}", d.log());
}

/// A `--peers` value that is not host:port is a usage error (exit 2), as
/// `--peer-listen garbage` is (QA: it exited 1 once parsed as a string).
#[test]
fn a_malformed_peers_flag_is_a_usage_error() {
    for bad in ["garbage", "127.0.0.4:99999", ":7401", "127.0.0.4:0"] {
        let out = run_kvtier(&["config", "check", "--peers", bad], &[]);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{bad}: {err}");
        assert!(err.contains("not host:port"), "{bad}: {err}");
    }
}

/// `config check` says the disk budget was rounded down to whole regions
/// only when it was (QA: always).
#[test]
fn config_check_says_rounded_only_when_it_was() {
    for (budget, rounded) in [("256MiB", false), ("250MiB", true)] {
        let out = run_kvtier(
            &[
                "config",
                "check",
                "--disk-budget",
                budget,
                "--region-size",
                "32MiB",
            ],
            &[],
        );
        let s = text(&out.stdout);
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
        assert_eq!(s.contains("rounded down"), rounded, "{budget}: {s}");
    }
}
