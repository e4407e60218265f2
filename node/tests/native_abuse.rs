//! Misbehaving clients against a real server: each gets an error reply or is
//! dropped, and neither other clients nor stored data are affected.

mod native_support;

use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use native_support::{TestServer, key, payload, record, wait_until};
use node::native;
use node::native::codec::{self, Decoded, ErrorCode, Op, Reply, Response};
use node::native::region::send_with_fd;
use node::native::{Client, NativeError, NativeOptions, OwnedRegion, RegionEntry};
use node::tier::Namespace;

/// A well-behaved client that stores a reference chunk and checks it later.
struct Witness {
    client: Client,
    ns: Namespace,
    data: Vec<u8>,
}

impl Witness {
    fn new(server: &TestServer) -> Self {
        let mut client = server.client();
        let ns = client.hello(&record(0)).unwrap();
        let data = payload(77, 300_000);
        assert_eq!(
            client.put_bytes(ns, 0, &[(key(77), &data)]).unwrap(),
            vec![0]
        );
        Self { client, ns, data }
    }

    fn check(&mut self) {
        self.client.ping().unwrap();
        assert_eq!(
            self.client.get_bytes(self.ns, 0, key(77)).unwrap().unwrap(),
            self.data
        );
        assert_eq!(
            self.client.lookup(self.ns, 0, &[key(77)]).unwrap().prefix,
            1
        );
    }
}

fn raw(server: &TestServer) -> UnixStream {
    let s = UnixStream::connect(&server.path).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s
}

/// Reads one reply frame from a raw stream.
fn read_reply(s: &mut UnixStream) -> (codec::Header, Reply) {
    let mut buf = vec![0u8; codec::HEADER_LEN];
    s.read_exact(&mut buf).unwrap();
    let h = codec::decode_header(&buf, u32::MAX).unwrap().unwrap();
    buf.resize(codec::HEADER_LEN + h.body_len as usize, 0);
    s.read_exact(&mut buf[codec::HEADER_LEN..]).unwrap();
    let Decoded::Frame { header, body, .. } = codec::decode_frame(&buf, u32::MAX).unwrap() else {
        panic!("incomplete")
    };
    (header, codec::decode_reply(&header, body).unwrap())
}

fn expect_error(s: &mut UnixStream, want: ErrorCode) -> String {
    match read_reply(s).1 {
        Reply::Error { code, message } => {
            assert_eq!(code, want, "{message}");
            message
        }
        other => panic!("expected {want:?}, got {other:?}"),
    }
}

/// The server closed the stream (EOF or reset), within the read timeout.
fn expect_closed(s: &mut UnixStream) {
    let mut b = [0u8; 64];
    match s.read(&mut b) {
        Ok(0) => {}
        Ok(n) => panic!("expected EOF, got {n} more bytes"),
        Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{e}"),
    }
}

fn frame(op: u16, flags: u16, id: u64, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    codec::encode_frame(&mut out, op, flags, 0, id, |b| b.extend_from_slice(body));
    out
}

#[test]
fn garbage_gets_an_error_then_the_connection_is_closed() {
    let server = TestServer::start();
    let mut w = Witness::new(&server);
    let mut s = raw(&server);
    s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let msg = expect_error(&mut s, ErrorCode::Malformed);
    assert!(msg.contains("magic"), "{msg}");
    expect_closed(&mut s);
    w.check();
}

#[test]
fn another_protocol_version_is_refused_naming_both() {
    let server = TestServer::start();
    let mut s = raw(&server);
    let mut f = frame(Op::Hello as u16, 0, 5, b"{}");
    f[4] = 9;
    s.write_all(&f).unwrap();
    let msg = expect_error(&mut s, ErrorCode::UnsupportedVersion);
    assert!(
        msg.contains("version 9") && msg.contains("version 1"),
        "{msg}"
    );
    expect_closed(&mut s);
}

#[test]
fn corrupt_header_or_body_crc_is_refused() {
    let server = TestServer::start();
    let mut w = Witness::new(&server);
    for flip in [29usize, codec::HEADER_LEN + 3] {
        let mut s = raw(&server);
        let mut f = frame(Op::Lookup as u16, 0, 3, &[0u8; 24]);
        f[flip] ^= 0x10;
        s.write_all(&f).unwrap();
        let msg = expect_error(&mut s, ErrorCode::Malformed);
        assert!(msg.contains("CRC32C"), "{msg}");
        expect_closed(&mut s);
    }
    w.check();
}

#[test]
fn oversize_frame_is_refused_before_allocating() {
    let server = TestServer::start_with(NativeOptions {
        max_frame: 1 << 20,
        ..Default::default()
    });
    let mut w = Witness::new(&server);
    let mut s = raw(&server);
    // Claims a 4 GiB - 1 body; only the header is sent.
    let mut f = frame(Op::Put as u16, 0, 1, &[]);
    f[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
    let crc = tier::format::crc32c(&f[..28]);
    f[28..32].copy_from_slice(&crc.to_le_bytes());
    s.write_all(&f).unwrap();
    let msg = expect_error(&mut s, ErrorCode::TooLarge);
    assert!(msg.contains("max-frame"), "{msg}");
    expect_closed(&mut s);
    w.check();
}

#[test]
fn unknown_ops_flags_and_bad_bodies_get_errors_and_the_connection_lives_on() {
    let server = TestServer::start_with(NativeOptions {
        max_batch: 8,
        ..Default::default()
    });
    let mut s = raw(&server);
    s.write_all(&frame(200, 0, 1, b"")).unwrap();
    let (h, _) = read_reply(&mut s);
    assert_eq!((h.id, h.status), (1, ErrorCode::UnknownOp as u16));
    s.write_all(&frame(Op::Ping as u16, 0x40, 2, b"")).unwrap();
    expect_error(&mut s, ErrorCode::BadRequest);
    // A LOOKUP whose count disagrees with its body.
    let mut body = vec![0u8; 24];
    body[20..24].copy_from_slice(&3u32.to_le_bytes());
    body.extend_from_slice(&[1u8; 64]);
    s.write_all(&frame(Op::Lookup as u16, 0, 3, &body)).unwrap();
    expect_error(&mut s, ErrorCode::BadRequest);
    // Over max-batch.
    let mut body = vec![0u8; 24];
    body[20..24].copy_from_slice(&9u32.to_le_bytes());
    body.extend_from_slice(&[1u8; 9 * 32]);
    s.write_all(&frame(Op::Lookup as u16, 0, 4, &body)).unwrap();
    let msg = expect_error(&mut s, ErrorCode::TooLarge);
    assert!(msg.contains("max-batch"), "{msg}");
    // A HELLO with a misspelt fence field.
    s.write_all(&frame(Op::Hello as u16, 0, 5, br#"{"model":"m","rnak":1}"#))
        .unwrap();
    let msg = expect_error(&mut s, ErrorCode::BadRequest);
    assert!(msg.contains("rnak"), "{msg}");
    // Still usable.
    s.write_all(&frame(Op::Ping as u16, 0, 6, b"")).unwrap();
    let (h, r) = read_reply(&mut s);
    assert_eq!(h.id, 6);
    assert!(matches!(r, Reply::Ok(codec::Response::Pong)));
}

#[test]
fn out_of_range_and_regionless_requests_are_refused_and_store_nothing() {
    let server = TestServer::start();
    let mut w = Witness::new(&server);
    let mut c = server.client();
    let ns = c.hello(&record(0)).unwrap();
    let e = |off, len| RegionEntry {
        key: key(5),
        offset: off,
        len,
    };
    let err = c.put(ns, 0, &[e(0, 10)], false).unwrap_err();
    assert!(
        matches!(
            err,
            NativeError::Remote {
                code: ErrorCode::NoRegion,
                ..
            }
        ),
        "{err}"
    );
    let err = c.get(ns, 0, &[e(0, 10)]).unwrap_err();
    assert!(
        matches!(
            err,
            NativeError::Remote {
                code: ErrorCode::NoRegion,
                ..
            }
        ),
        "{err}"
    );
    c.create_region(4096).unwrap();
    for (off, len) in [
        (4000, 97),
        (4097, 0),
        (u64::MAX, 2),
        (0, u64::MAX),
        (1, 4096),
    ] {
        // One good entry first: the whole request is refused, nothing stored.
        let entries = [
            RegionEntry {
                key: key(6),
                offset: 0,
                len: 8,
            },
            e(off, len),
        ];
        let err = c.put(ns, 0, &entries, false).unwrap_err();
        assert!(
            matches!(
                err,
                NativeError::Remote {
                    code: ErrorCode::OutOfRange,
                    ..
                }
            ),
            "{err}"
        );
        let err = c.get(ns, 0, &entries).unwrap_err();
        assert!(
            matches!(
                err,
                NativeError::Remote {
                    code: ErrorCode::OutOfRange,
                    ..
                }
            ),
            "{err}"
        );
    }
    assert_eq!(c.lookup(ns, 0, &[key(6)]).unwrap().prefix, 0);
    // The witness's chunk does not fit this client's 4 KiB region: too small, not written.
    let r = c
        .get(
            ns,
            0,
            &[RegionEntry {
                key: key(77),
                offset: 0,
                len: 4096,
            }],
        )
        .unwrap();
    assert_eq!(r[0].status, node::native::GetStatus::TooSmall);
    assert!(c.region().unwrap().as_slice().iter().all(|b| *b == 0));
    c.ping().unwrap();
    w.check();
}

#[test]
fn bad_regions_are_refused() {
    let server = TestServer::start_with(NativeOptions {
        max_region: 64 << 20,
        ..Default::default()
    });
    let mut w = Witness::new(&server);
    let mut c = server.client();
    // No descriptor.
    let err = c
        .call(&codec::Request::RegisterRegion { len: 4096 })
        .unwrap_err();
    assert!(
        matches!(
            err,
            NativeError::Remote {
                code: ErrorCode::NoRegion,
                ..
            }
        ),
        "{err}"
    );
    // An unsealed memfd (could be truncated under the daemon's mapping).
    let fd = rustix::fs::memfd_create("x", rustix::fs::MemfdFlags::ALLOW_SEALING).unwrap();
    rustix::fs::ftruncate(&fd, 8192).unwrap();
    let err = c.register_region(fd.as_fd(), 8192).unwrap_err();
    assert!(err.to_string().contains("F_SEAL_SHRINK"), "{err}");
    // Longer than the file, and over max-region.
    let region = OwnedRegion::create("y", 8192).unwrap();
    let err = c.register_region(region.fd(), 8193).unwrap_err();
    assert!(
        matches!(
            err,
            NativeError::Remote {
                code: ErrorCode::NoRegion,
                ..
            }
        ),
        "{err}"
    );
    let big = OwnedRegion::create("z", (64 << 20) + 4096).unwrap();
    let err = c.register_region(big.fd(), (64 << 20) + 4096).unwrap_err();
    assert!(
        matches!(
            err,
            NativeError::Remote {
                code: ErrorCode::TooLarge,
                ..
            }
        ),
        "{err}"
    );
    // A good one still works on the same connection.
    assert_eq!(c.register_region(region.fd(), 8192).unwrap(), 8192);
    w.check();
}

/// Descriptors sent with frames other than REGISTER_REGION are closed with
/// their frame: they neither pile up in the daemon nor serve a later
/// REGISTER_REGION.
#[test]
fn descriptors_sent_with_other_frames_are_closed() {
    let server = TestServer::start();
    let mut w = Witness::new(&server);
    // Descriptors of this process (the server runs in it) open on the memfd.
    let held = || {
        std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
            .filter(|l| l.to_string_lossy().contains("kvtier-fd-probe"))
            .count()
    };
    let mut s = raw(&server);
    let region = OwnedRegion::create("kvtier-fd-probe", 4096).unwrap();
    assert_eq!(held(), 1);
    for id in 0..6 {
        let f = frame(Op::Ping as u16, 0, id, b"");
        send_with_fd(s.as_fd(), &f, Some(region.fd())).unwrap();
    }
    for id in 0..6 {
        let (h, r) = read_reply(&mut s);
        assert_eq!(h.id, id);
        assert!(matches!(r, Reply::Ok(Response::Pong)));
    }
    // The server holds none of them: only the client's own is open.
    assert!(wait_until(5, || held() == 1), "{} open", held());
    let mut out = Vec::new();
    codec::encode_request(&mut out, 7, &codec::Request::RegisterRegion { len: 4096 });
    s.write_all(&out).unwrap();
    expect_error(&mut s, ErrorCode::NoRegion);
    w.check();
}

/// REGISTER_REGION requests (one descriptor each) sent behind replies the
/// client has not read yet: the server, blocked writing those replies, reads
/// ahead only until a descriptor is pending, so five of them in a row are
/// not taken for a pile of unclaimed descriptors.
#[test]
fn descriptors_behind_unread_replies_are_claimed_in_turn() {
    let server = TestServer::start();
    let mut w = Witness::new(&server);
    let mut s = raw(&server);
    let mut batch = Vec::new();
    for id in 0..2000u64 {
        batch.extend_from_slice(&frame(Op::Stats as u16, 0, id, b""));
    }
    s.write_all(&batch).unwrap();
    let region = OwnedRegion::create("f", 4096).unwrap();
    for id in 2000..2006u64 {
        let f = frame(Op::RegisterRegion as u16, 0, id, &4096u64.to_le_bytes());
        send_with_fd(s.as_fd(), &f, Some(region.fd())).unwrap();
    }
    for id in 0..2006u64 {
        let (h, reply) = read_reply(&mut s);
        assert_eq!(h.id, id);
        match reply {
            Reply::Ok(Response::Stats { .. }) => assert!(id < 2000),
            Reply::Ok(Response::RegionRegistered { len }) => {
                assert!(id >= 2000);
                assert_eq!(len, 4096);
            }
            other => panic!("request {id}: {other:?}"),
        }
    }
    w.check();
}

#[test]
fn truncated_frames_and_mid_request_disconnects_do_not_disturb_others() {
    let server = TestServer::start();
    let mut w = Witness::new(&server);
    for cut in [1usize, 5, 20, 31, 32, 40, 100] {
        let mut s = raw(&server);
        let ns = record(0).id();
        let mut f = Vec::new();
        let entries = (0..4)
            .map(|i| RegionEntry {
                key: key(500 + i),
                offset: 0,
                len: 8,
            })
            .collect();
        codec::encode_request(
            &mut f,
            1,
            &codec::Request::Put {
                ns,
                group: 0,
                atomic: false,
                entries,
            },
        );
        s.write_all(&f[..cut.min(f.len() - 1)]).unwrap();
        drop(s);
    }
    w.check();
    let keys: Vec<_> = (500..504).map(key).collect();
    assert_eq!(w.client.lookup(w.ns, 0, &keys).unwrap().prefix, 0);
    // A client that dies with replies pending.
    let mut c = server.client();
    for _ in 0..50 {
        c.send(&codec::Request::Stats).unwrap();
    }
    drop(c);
    w.check();
}

#[test]
fn a_client_stalled_mid_frame_is_dropped() {
    let server = TestServer::start_with(NativeOptions {
        frame_timeout: Duration::from_millis(300),
        ..Default::default()
    });
    let mut w = Witness::new(&server);
    let mut s = raw(&server);
    let f = frame(Op::Ping as u16, 0, 1, b"");
    s.write_all(&f[..10]).unwrap();
    let start = Instant::now();
    expect_closed(&mut s);
    assert!(start.elapsed() < Duration::from_secs(5));
    w.check();
}

/// The frame timeout runs from a frame's first byte: a client that sends
/// one byte at a time, each well within the timeout, is dropped all the
/// same (it held its connection, and the shutdown, for as long as it
/// liked).
#[test]
fn a_client_trickling_a_frame_is_dropped_at_the_frame_deadline() {
    let server = TestServer::start_with(NativeOptions {
        frame_timeout: Duration::from_millis(300),
        ..Default::default()
    });
    let mut w = Witness::new(&server);
    let mut s = raw(&server);
    let f = frame(Op::Ping as u16, 0, 1, &[0u8; 1000]);
    let start = Instant::now();
    let mut dropped = None;
    for b in f.iter().take(40) {
        if s.write_all(std::slice::from_ref(b)).is_err() {
            dropped = Some(start.elapsed());
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let at = dropped.expect("a client trickling bytes for 4 s was never dropped");
    assert!(at < Duration::from_secs(2), "dropped after {at:?}");
    w.check();
}

/// The same while the server polls for the pieces (`spin`): a client
/// whose bytes each come within the poll window was never dropped (the
/// deadline was set only when a poll came back empty).
#[test]
fn a_client_trickling_within_the_poll_window_is_dropped_at_the_frame_deadline() {
    native::spin::force_for_tests(Some(true));
    let server = TestServer::start_with(NativeOptions {
        frame_timeout: Duration::from_millis(100),
        spin: Duration::from_millis(1),
        ..Default::default()
    });
    let mut w = Witness::new(&server);
    let mut s = raw(&server);
    let f = frame(Op::Ping as u16, 0, 1, &[0u8; 4000]);
    let start = Instant::now();
    let mut dropped = None;
    for b in &f {
        if s.write_all(std::slice::from_ref(b)).is_err() {
            dropped = Some(start.elapsed());
            break;
        }
        // Well inside the 1 ms poll; 4,000 bytes take over a second.
        std::thread::sleep(Duration::from_micros(200));
    }
    native::spin::force_for_tests(None);
    let at = dropped.expect("a client trickling bytes within the poll window was never dropped");
    assert!(at < Duration::from_secs(1), "dropped after {at:?}");
    w.check();
}

/// Large or incomplete requests are bounded over all connections
/// (`max_buffered`): past it a connection gets `busy` and is closed, the
/// others keep working, and the room comes back when the holder leaves.
#[test]
fn read_buffers_are_bounded_over_all_connections() {
    let server = TestServer::start_with(NativeOptions {
        max_buffered: 4 << 20,
        ..Default::default()
    });
    let mut w = Witness::new(&server);
    let big = frame(Op::Ping as u16, 0, 1, &vec![0u8; 3 << 20]);
    // Holds about 3 MiB: a frame that never completes.
    let mut a = raw(&server);
    a.write_all(&big[..big.len() - 100]).unwrap();
    w.check();
    // Refused as its bytes arrive (the write fails once it is closed).
    let mut b = raw(&server);
    let _ = b.write_all(&big);
    let msg = expect_error(&mut b, ErrorCode::Busy);
    assert!(msg.contains("at most 4 MiB"), "{msg}");
    expect_closed(&mut b);
    w.check();
    drop(a);
    // Once a's task has ended its share is free again: the same large
    // request is answered (a PING with a body is a bad request, not busy).
    assert!(wait_until(10, || {
        let mut c = raw(&server);
        // Refused (busy, then closed) while a's share is still held.
        c.write_all(&big).is_ok()
            && matches!(
                read_reply(&mut c).1,
                Reply::Error {
                    code: ErrorCode::BadRequest,
                    ..
                }
            )
    }));
    w.check();
}

/// A frame is charged against `max_buffered` as its bytes arrive, not as
/// its header announces them: connections that sent only headers of large
/// frames hold no room (review: 33 of them refused every other client's
/// request over 64 KiB).
#[test]
fn announced_bodies_hold_no_room_until_they_arrive() {
    let server = TestServer::start_with(NativeOptions {
        max_buffered: 4 << 20,
        ..Default::default()
    });
    let mut w = Witness::new(&server);
    let big = frame(Op::Ping as u16, 0, 1, &vec![0u8; 3 << 20]);
    let idle: Vec<UnixStream> = (0..4)
        .map(|_| {
            let mut s = raw(&server);
            s.write_all(&big[..codec::HEADER_LEN]).unwrap();
            s
        })
        .collect();
    w.check();
    // A whole large request is answered (a PING with a body is a bad
    // request, not busy).
    let mut c = raw(&server);
    c.write_all(&big).unwrap();
    assert!(matches!(
        read_reply(&mut c).1,
        Reply::Error {
            code: ErrorCode::BadRequest,
            ..
        }
    ));
    drop(idle);
    w.check();
}

#[test]
fn connections_over_the_limit_get_busy() {
    let server = TestServer::start_with(NativeOptions {
        max_connections: 2,
        ..Default::default()
    });
    let mut a = server.client();
    a.ping().unwrap();
    let mut b = server.client();
    b.ping().unwrap();
    let mut s = raw(&server);
    let msg = expect_error(&mut s, ErrorCode::Busy);
    assert!(msg.contains("max-connections"), "{msg}");
    expect_closed(&mut s);
    drop(a);
    // The freed slot is usable again (the server notices the close asynchronously).
    assert!(wait_until(10, || {
        let mut c = server.client();
        c.ping().is_ok()
    }));
    b.ping().unwrap();
}

#[test]
fn a_client_that_never_reads_replies_is_dropped_and_shutdown_completes() {
    let server = TestServer::start_with(NativeOptions {
        frame_timeout: Duration::from_millis(300),
        ..Default::default()
    });
    let mut w = Witness::new(&server);
    let mut s = raw(&server);
    s.set_write_timeout(Some(Duration::from_secs(10))).unwrap();
    // STATS replies are far larger than the requests: the socket buffers
    // fill up with unread replies while the requests still fit.
    let mut batch = Vec::new();
    for id in 0..2000u64 {
        batch.extend_from_slice(&frame(Op::Stats as u16, 0, id, b""));
    }
    let start = Instant::now();
    let mut closed = false;
    // The server reads up to 16 MiB of requests ahead while its replies
    // wait: 64 MiB are more than it takes in.
    for _ in 0..(64 << 20) / batch.len() {
        if let Err(e) = s.write_all(&batch) {
            // Dropped by the server, not our own write timeout.
            assert!(
                matches!(
                    e.kind(),
                    std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
                ),
                "{e}"
            );
            closed = true;
            break;
        }
    }
    assert!(
        closed,
        "the server kept accepting requests whose replies nobody reads"
    );
    assert!(start.elapsed() < Duration::from_secs(15));
    w.check();
    server.stop().unwrap();
}

/// Peak resident memory of this process (the server runs in it), bytes.
fn peak_rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kib = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .expect("VmHWM in /proc/self/status");
    kib << 10
}

/// A chunk larger than the store takes is refused before the server copies
/// it out of the region. The copy allocated its length first (QA: one
/// 48 GiB entry of a sparse region aborted the daemon on the allocation;
/// a 1 GiB one took 2 GiB of memory and a batch repeating it held a
/// blocking slot for seconds).
#[test]
fn an_oversized_put_is_refused_before_it_is_copied() {
    // 256 MiB of RAM, 64 MiB of disk: no chunk over 64 MiB fits.
    let server = TestServer::start();
    let mut w = Witness::new(&server);
    let mut c = server.client();
    let ns = c.hello(&record(0)).unwrap();
    const LEN: u64 = 1 << 30;
    c.create_region(LEN).unwrap();
    let before = peak_rss();
    let big = RegionEntry {
        key: key(9),
        offset: 0,
        len: LEN,
    };
    let small = RegionEntry {
        key: key(10),
        offset: 0,
        len: 4096,
    };
    let statuses = c.put(ns, 0, &[big, big, small, big], false).unwrap();
    let too_large = ErrorCode::TooLarge as u16;
    assert_eq!(statuses, vec![too_large, too_large, 0, too_large]);
    let err = c.put(ns, 0, &[small, big], true).unwrap_err();
    assert!(
        matches!(
            err,
            NativeError::Remote {
                code: ErrorCode::TooLarge,
                ..
            }
        ),
        "{err}"
    );
    let grown = peak_rss().saturating_sub(before);
    assert!(
        grown < 256 << 20,
        "refusing 1 GiB chunks raised the peak resident memory by {} MiB",
        grown >> 20
    );
    assert_eq!(c.lookup(ns, 0, &[key(9), key(10)]).unwrap().prefix, 0);
    assert_eq!(c.lookup(ns, 0, &[key(10)]).unwrap().prefix, 1);
    w.check();
}

#[test]
fn get_ranges_that_add_up_past_the_region_are_refused() {
    let server = TestServer::start();
    let mut w = Witness::new(&server);
    let mut c = server.client();
    let ns = c.hello(&record(0)).unwrap();
    c.put_bytes(ns, 0, &[(key(8), &payload(8, 100))]).unwrap();
    let len = c.region().unwrap().len();
    let whole = RegionEntry {
        key: key(8),
        offset: 0,
        len,
    };
    // One chunk named twice into the whole region: the same bytes could be
    // asked for without end from one small frame.
    match c.get(ns, 0, &[whole, whole]) {
        Err(NativeError::Remote {
            code: ErrorCode::BadRequest,
            message,
        }) => assert!(message.contains("overlap"), "{message}"),
        other => panic!("overlapping GET ranges past the region: {other:?}"),
    }
    // Within the region, destinations are the client's business.
    let half = RegionEntry {
        len: len / 2,
        ..whole
    };
    let r = c.get(ns, 0, &[half, half]).unwrap();
    assert!(r.iter().all(|r| r.status.is_hit()), "{r:?}");
    c.ping().unwrap();
    w.check();
}

#[test]
fn a_large_get_of_ram_hits_stops_when_its_client_hangs_up() {
    let server = TestServer::start();
    let mut c = server.client();
    let ns = c.hello(&record(0)).unwrap();
    const CHUNK: u64 = 4 << 20;
    const COUNT: u64 = 256; // 1 GiB of copies, 64 MiB per job
    c.create_region(CHUNK * COUNT).unwrap(); // sparse until written
    c.put_bytes(ns, 0, &[(key(9), &payload(9, CHUNK as usize))])
        .unwrap();
    let entries: Vec<RegionEntry> = (0..COUNT)
        .map(|i| RegionEntry {
            key: key(9),
            offset: i * CHUNK,
            len: CHUNK,
        })
        .collect();
    c.send(&native::codec::Request::Get {
        ns,
        group: 0,
        entries,
    })
    .unwrap();
    let memfd = c.region().unwrap().fd().try_clone_to_owned().unwrap();
    drop(c);
    // It used to copy the whole GiB in one job holding a copy slot, and
    // never noticed the hang-up.
    let abandoned = || {
        server
            .ctx
            .counters
            .native_abandoned
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    assert!(
        wait_until(10, || abandoned() == 1),
        "the GET was not abandoned: {}",
        abandoned()
    );
    // Copying stopped after the job under way: the pages the daemon wrote
    // into the (sparse) region stay far below the GiB asked for.
    std::thread::sleep(Duration::from_millis(1500));
    let written = rustix::fs::fstat(&memfd).unwrap().st_blocks as u64 * 512;
    assert!(
        written < CHUNK * COUNT / 4,
        "{written} bytes of the region were written after the hang-up"
    );
}

#[test]
fn a_client_stalled_mid_frame_does_not_hold_up_a_stop() {
    let server = TestServer::start();
    let mut s = raw(&server);
    // Half a header, then nothing (the frame deadline is 30 s).
    s.write_all(&frame(Op::Ping as u16, 0, 1, b"")[..8])
        .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let t0 = Instant::now();
    server.stop().unwrap();
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "the stop waited {:?} for a request that never came whole",
        t0.elapsed()
    );
    expect_closed(&mut s);
}

/// Liveness of the PUT copy bound (not its memory effect, which this
/// process's own region pages would hide): PUTs that together exceed it
/// wait for each other and all land.
#[test]
fn concurrent_atomic_puts_past_the_copy_bound_all_land() {
    // 64 MiB of RAM: PUT copies may hold 64 MiB at once; three clients
    // each PUT 48 MiB atomically at the same time.
    let server = TestServer::start_with_ram(NativeOptions::default(), 64 << 20);
    let threads: Vec<_> = (0..3u32)
        .map(|t| {
            let mut c = server.client();
            std::thread::spawn(move || {
                let ns = c.hello(&record(0)).unwrap();
                let items: Vec<(node::tier::ChunkKey, Vec<u8>)> = (0..6)
                    .map(|i| (key(100 * t + i), payload(100 * t + i, 8_000_000)))
                    .collect();
                let total: usize = items.iter().map(|(_, d)| d.len()).sum();
                c.create_region(total as u64).unwrap();
                let mut entries = Vec::new();
                let mut off = 0;
                for (k, d) in &items {
                    c.region_mut().unwrap().as_mut_slice()[off..off + d.len()].copy_from_slice(d);
                    entries.push(RegionEntry {
                        key: *k,
                        offset: off as u64,
                        len: d.len() as u64,
                    });
                    off += d.len();
                }
                assert_eq!(c.put(ns, 0, &entries, true).unwrap(), vec![0; 6]);
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let mut c = server.client();
    c.ping().unwrap();
}

/// A descriptor belongs to the frame it was sent with: one whose
/// REGISTER_REGION was refused, or that came with another op, is closed,
/// never mapped for a later REGISTER_REGION (review: the next one mapped
/// the refused frame's memfd, answered success, and its PUT stored that
/// memfd's bytes).
#[test]
fn a_descriptor_is_never_taken_for_a_later_frame() {
    let server = TestServer::start();
    let mut w = Witness::new(&server);
    let mut c = server.client();
    let ns = c.hello(&record(0)).unwrap();
    let mut s = raw(&server);
    let mut a = OwnedRegion::create("a", 4096).unwrap();
    a.as_mut_slice()[..16].copy_from_slice(&[b'A'; 16]);
    let mut b = OwnedRegion::create("b", 4096).unwrap();
    b.as_mut_slice()[..16].copy_from_slice(&[b'B'; 16]);
    // A REGISTER_REGION whose body is short, with memfd A.
    send_with_fd(
        s.as_fd(),
        &frame(Op::RegisterRegion as u16, 0, 1, &[0; 7]),
        Some(a.fd()),
    )
    .unwrap();
    expect_error(&mut s, ErrorCode::BadRequest);
    // A PING that carries memfd A again, then a REGISTER_REGION without one.
    send_with_fd(s.as_fd(), &frame(Op::Ping as u16, 0, 2, b""), Some(a.fd())).unwrap();
    assert!(matches!(read_reply(&mut s).1, Reply::Ok(Response::Pong)));
    let mut out = Vec::new();
    codec::encode_request(&mut out, 3, &codec::Request::RegisterRegion { len: 4096 });
    s.write_all(&out).unwrap();
    expect_error(&mut s, ErrorCode::NoRegion);
    // A good REGISTER_REGION with memfd B maps B: its PUT stores B's bytes.
    out.clear();
    codec::encode_request(&mut out, 4, &codec::Request::RegisterRegion { len: 4096 });
    send_with_fd(s.as_fd(), &out, Some(b.fd())).unwrap();
    assert!(matches!(
        read_reply(&mut s).1,
        Reply::Ok(Response::RegionRegistered { len: 4096 })
    ));
    out.clear();
    let put = codec::Request::Put {
        ns,
        group: 0,
        atomic: false,
        entries: vec![RegionEntry {
            key: key(9),
            offset: 0,
            len: 16,
        }],
    };
    codec::encode_request(&mut out, 5, &put);
    s.write_all(&out).unwrap();
    assert!(matches!(read_reply(&mut s).1, Reply::Ok(_)));
    assert_eq!(c.get_bytes(ns, 0, key(9)).unwrap().unwrap(), [b'B'; 16]);
    w.check();
}
