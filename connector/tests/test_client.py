"""Tests of the Python client: golden frames shared with the Rust codec, and
round trips against a real daemon (see conftest.py)."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

from kvtier import KvtierClient, KvtierError, KvtierUnavailable, Region
from kvtier.client import KvtierProtocolError
from kvtier.client import LookupResult
from kvtier import _frames as fr

# --- golden frames (no daemon) ---------------------------------------------

NS = bytes(range(16))


def key(i: int) -> bytes:
    return bytes([i]) * 32


GOLDEN_RECORD = {
    "model": "llama",
    "model-revision": "r1",
    "engine": "vllm",
    "engine-version": "0.33",
    "tp-size": 2,
    "rank": 1,
    "kv-dtype": "bfloat16",
    "block-size": 16,
    "chunk-tokens": 256,
    "hash-algo": "sha256_cbor",
    "layout": "g0:32768",
    "format-version": 1,
    "salt": "",
    "info": {},
}

GOLDEN_REQUESTS = {
    "ping_request": lambda: fr.ping(1),
    "hello_request": lambda: fr.hello(2, GOLDEN_RECORD),
    "register_region_request": lambda: fr.register_region(3, 1 << 26),
    "lookup_request": lambda: fr.lookup(4, NS, 1, [key(1), key(2), key(3)]),
    "lookup_in_region_request": lambda: fr.lookup_in_region(11, NS, 1, 4096, 3),
    "cluster_lookup_request": lambda: fr.cluster_lookup(5, GOLDEN_RECORD, [0, 1], 0, [key(1), key(2)]),
    "put_request": lambda: fr.put(6, NS, 0, [(key(1), 0, 262_144), (key(2), 262_144, 1_048_576)], atomic=True),
    "get_request": lambda: fr.get(7, NS, 0, [(key(1), 4096, 262_144), (key(9), 1 << 20, 1 << 22)]),
    "delete_request": lambda: fr.delete(8, NS, 2, [key(7)]),
    "flush_request": lambda: fr.flush(9),
    "stats_request": lambda: fr.stats(10),
}

GOLDEN_REPLIES = {
    "hello_reply": (
        2,
        {"ns": NS, "version": 1, "max_batch": 65_536, "max_frame": 16 << 20, "max_region": 64 << 30},
    ),
    "register_region_reply": (3, 1 << 26),
    "lookup_reply": (4, (2, bytes([1, 2, 0]))),  # LookupResult names them
    "cluster_lookup_reply": (5, (1, [(0, 2, 2), (1, 1, 0)])),
    "put_reply": (6, [0, 10]),
    "get_reply": (7, [("hit-ram", 262_144), ("miss", 0)]),
    "delete_reply": (8, [True]),
    "flush_reply": (9, {"chunks": 3, "bytes": 786_432, "failed": 0}),
    "stats_reply": (10, {"node": "n1"}),
    "error_reply": (7, fr.ErrorReply(6, "out-of-range", "GET entry 1: out of range")),
}


def test_crc32c_matches_the_standard_check_value() -> None:
    assert fr.crc32c(b"123456789") == 0xE3069283
    assert fr._crc32c_py(b"123456789") == 0xE3069283
    assert fr.crc32c(b"") == 0
    for n in (1, 7, 8, 9, 31, 64, 1000, 4099):
        data = os.urandom(n)
        assert fr._crc32c_py(data) == fr._crc32c_bytewise(data) == fr.crc32c(data)


@pytest.mark.parametrize("name", sorted(GOLDEN_REQUESTS))
def test_requests_match_the_rust_golden_frames(fixtures_dir: Path, name: str) -> None:
    golden = (fixtures_dir / f"{name}.bin").read_bytes()
    assert GOLDEN_REQUESTS[name]() == golden


@pytest.mark.parametrize("name", sorted(GOLDEN_REPLIES))
def test_replies_decode_like_the_rust_golden_frames(fixtures_dir: Path, name: str) -> None:
    golden = (fixtures_dir / f"{name}.bin").read_bytes()
    h = fr.decode_header(golden)
    body = golden[fr.HEADER_LEN :]
    assert len(body) == h.body_len
    fr.check_body(h, body)
    req_id, expected = GOLDEN_REPLIES[name]
    assert h.req_id == req_id
    assert fr.decode_reply(h, body) == expected


def test_every_golden_fixture_is_covered(fixtures_dir: Path) -> None:
    names = {p.stem for p in fixtures_dir.glob("*.bin")}
    assert names and names == set(GOLDEN_REQUESTS) | set(GOLDEN_REPLIES)


def test_corrupt_frames_are_refused(fixtures_dir: Path) -> None:
    golden = (fixtures_dir / "lookup_reply.bin").read_bytes()
    for i in range(fr.HEADER_LEN):
        bad = bytearray(golden)
        bad[i] ^= 0x01
        with pytest.raises(fr.FrameError):
            fr.decode_header(bytes(bad))
    h = fr.decode_header(golden)
    bad = bytearray(golden)
    bad[-1] ^= 0x80
    with pytest.raises(fr.FrameError):
        fr.check_body(h, bytes(bad[fr.HEADER_LEN :]))
    v2 = bytearray(golden)
    v2[4] = 2
    with pytest.raises(fr.FrameError, match="version 2.*version 1"):
        fr.decode_header(bytes(v2))


def test_lookup_replies_with_impossible_codes_or_prefix_are_refused(fixtures_dir: Path) -> None:
    golden = (fixtures_dir / "lookup_reply.bin").read_bytes()
    h = fr.decode_header(golden)
    body = golden[fr.HEADER_LEN :]
    assert fr.decode_reply(h, body) == (2, bytes([1, 2, 0]))
    # The codes are checked when the reply is read, not when named.
    for bad in (body[:-1] + bytes([4]), body[:-1] + bytes([0xFF]), struct.pack("<I", 4) + body[4:]):
        with pytest.raises(fr.FrameError):
            fr.decode_reply(h, bad)
    r = LookupResult(2, bytes([1, 2, 0, 3]))
    assert r.locations == ["ram", "disk", "miss", "peer"]
    assert r.locations is r.locations  # named once
    assert r == LookupResult(2, bytes([1, 2, 0, 3])) != LookupResult(1, bytes([1, 2, 0, 3]))
    assert "locations=['ram', 'disk', 'miss', 'peer']" in repr(r)
    # Built from names too, as when it was a dataclass of (prefix, locations).
    assert LookupResult(2, ["ram", "disk", "miss", "peer"]) == r == LookupResult(2, locations=r.locations)
    with pytest.raises(ValueError):
        LookupResult(1, ["nowhere"])
    with pytest.raises(AttributeError):
        r.prefix = 3  # type: ignore[misc]


def test_region_is_sealed_shared_memory_with_an_address() -> None:
    import fcntl

    r = Region(1 << 16)
    try:
        assert fcntl.fcntl(r.fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK
        ctypes.memmove(r.address + 100, b"hello", 5)
        assert bytes(r.buffer[100:105]) == b"hello"
        assert bytes(r.view(100, 5)) == b"hello"
        with pytest.raises(ValueError):
            r.view(1 << 16, 1)
    finally:
        r.close()


def test_connect_failure_is_unavailable(tmp_path: Path) -> None:
    with pytest.raises(KvtierUnavailable, match="kvtier node start"):
        KvtierClient(tmp_path / "missing.sock")


def test_a_silent_daemon_times_out(tmp_path: Path) -> None:
    path = tmp_path / "silent.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(1)
    accepted: list[socket.socket] = []
    t = threading.Thread(target=lambda: accepted.append(srv.accept()[0]), daemon=True)
    t.start()
    try:
        c = KvtierClient(path, region_size=0, timeout=0.2)
        with pytest.raises(KvtierUnavailable, match="timed out"):
            c.ping()
        assert c.closed
    finally:
        t.join(timeout=5)
        for s in accepted:
            s.close()
        srv.close()


def test_the_spin_gate_reads_the_run_queue() -> None:
    from kvtier import client as kc

    assert kc.parse_runnable("0.05 0.10 0.20 3/412 9876\n") == 3
    for bad in ("", "0.05 0.10 0.20", "0.05 0.10 0.20 3 9876", "0.05 0.10 0.20 x/412 1", "0.1 0.1 0.1 3/y 1"):
        assert kc.parse_runnable(bad) is None, bad
    assert kc.spare_cpu(1, 2)  # idle: the sampler alone
    assert kc.spare_cpu(2, 2)  # the daemon runs too
    assert not kc.spare_cpu(3, 2)  # one more runnable thread, ours or not
    assert kc.spare_cpu(16, 16) and not kc.spare_cpu(17, 16)
    assert not kc.spare_cpu(0, 2)  # no reading: the sampler itself runs
    with open("/proc/loadavg") as f:
        assert kc.parse_runnable(f.read()) is not None
    assert 1 <= kc.usable_cpus() <= (os.cpu_count() or 1)
    assert isinstance(kc.may_poll(), bool)


def test_the_client_spin_default_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtier import client as kc

    monkeypatch.delenv("KVTIER_CLIENT_SPIN_US", raising=False)
    assert kc._default_spin() == 50e-6
    for value, want in (("0", 0.0), ("20", 20e-6), ("5000", 1e-3), ("x", 50e-6), ("-1", 50e-6)):
        monkeypatch.setenv("KVTIER_CLIENT_SPIN_US", value)
        assert kc._default_spin() == pytest.approx(want), value


def test_spin_is_bounded(tmp_path: Path) -> None:
    for bad in (-1e-6, 2e-3):
        with pytest.raises(ValueError, match="spin"):
            KvtierClient(tmp_path / "missing.sock", spin=bad)


def test_a_polling_client_times_out_and_reads_replies(
    tmp_path: Path, daemon, monkeypatch: pytest.MonkeyPatch  # type: ignore[no-untyped-def]
) -> None:
    from kvtier import client as kc

    monkeypatch.setattr(kc, "may_poll", lambda: True)
    polls = []
    real = kc.KvtierClient._poll_for_reply

    def counted(self: KvtierClient) -> None:
        polls.append(1)
        real(self)

    monkeypatch.setattr(kc.KvtierClient, "_poll_for_reply", counted)
    c = KvtierClient(daemon.socket_path, region_size=0, timeout=30, spin=1e-3)
    try:
        c.ping()
        ns = c.hello(record(0))
        assert c.lookup(ns, [key(5)]).locations == ["miss"]
        assert len(polls) >= 3
    finally:
        c.close()
    # A daemon that never answers: the poll ends, the timeout still fires.
    path = tmp_path / "silent.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(1)
    try:
        c = KvtierClient(path, region_size=0, timeout=0.2, spin=1e-3)
        with pytest.raises(KvtierUnavailable, match="timed out"):
            c.ping()
    finally:
        srv.close()


# --- against a real daemon ---------------------------------------------------


def record(rank: int) -> dict:
    return {
        "model": "py-test",
        "engine": "pytest",
        "tp-size": max(2, rank + 1),  # ranks past 1 are distinct namespaces here
        "rank": rank,
        "kv-dtype": "bfloat16",
        "block-size": 16,
        "chunk-tokens": 256,
        "hash-algo": "sha256_cbor",
    }


def _listening(path: Path) -> socket.socket:
    """A Unix socket listening at ``path`` that is not a daemon."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(1)
    return srv


def _one_connection_server(path: Path, then: str) -> tuple[socket.socket, threading.Thread]:
    """A server that accepts one connection, reads one request and then
    closes it (`then="close"`), resets it (`"reset"`), or sends half a reply
    header first (`"half"`)."""
    srv = _listening(path)

    def serve() -> None:
        conn = srv.accept()[0]
        conn.recv(4096)
        if then == "half":
            conn.sendall(fr.encode_frame(fr.REPLY_BIT, 1, 1, 0, b"")[: fr.HEADER_LEN // 2])
        if then == "reset":
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return srv, t


@pytest.mark.parametrize("then, by_peer", [("close", True), ("reset", True), ("half", False)])
def test_a_connection_the_daemon_closed_says_so(tmp_path: Path, then: str, by_peer: bool) -> None:
    """`closed_by_peer` (the vLLM connector sends an idempotent request once
    more on a new connection then) only when no byte of the reply came."""
    path = tmp_path / f"{then}.sock"
    srv, t = _one_connection_server(path, then)
    try:
        c = KvtierClient(path, region_size=0, timeout=5)
        with pytest.raises(KvtierUnavailable) as e:
            c.ping()
        assert e.value.closed_by_peer is by_peer, e.value
        assert c.closed
    finally:
        t.join(timeout=5)
        srv.close()


def test_a_send_into_a_closed_connection_is_closed_by_peer(tmp_path: Path) -> None:
    # The daemon restarted while the client was idle: the next send meets a
    # broken pipe.
    path = tmp_path / "gone.sock"
    srv = _listening(path)
    try:
        c = KvtierClient(path, region_size=0, timeout=5)
        srv.accept()[0].close()
        with pytest.raises(KvtierUnavailable) as e:
            for _ in range(3):  # the first send may still be taken by the kernel
                c.ping()
        assert e.value.closed_by_peer, e.value
    finally:
        srv.close()


def test_a_timeout_is_not_closed_by_peer(tmp_path: Path) -> None:
    path = tmp_path / "slow.sock"
    srv = _listening(path)
    try:
        c = KvtierClient(path, region_size=0, timeout=0.2)
        with pytest.raises(KvtierUnavailable) as e:
            c.ping()
        assert not e.value.closed_by_peer
    finally:
        srv.close()


def test_a_callers_region_outlives_its_connection(daemon) -> None:  # type: ignore[no-untyped-def]
    """A region passed in stays open when the client closes, and registers
    again on a new connection with its bytes intact."""
    r = Region(1 << 20)
    try:
        c = KvtierClient(daemon.socket_path, region_size=0, timeout=30, region=r)
        ns = c.hello(record(0))
        r.buffer[0:4096] = payload(77, 4096)
        assert c.put(ns, [(key(77), (0, 4096))]) == ["ok"]
        c.close()
        assert r.fd >= 0 and bytes(r.buffer[0:4096]) == payload(77, 4096)
        with KvtierClient(daemon.socket_path, region_size=0, timeout=30, region=r) as c2:
            assert c2.region is r
            ns = c2.hello(record(0))
            r.buffer[0:4096] = bytes(4096)
            res = c2.get(ns, [key(77)], into=[(0, 4096)])
            assert res[0].hit and bytes(r.buffer[0:4096]) == payload(77, 4096)
        assert r.fd >= 0
    finally:
        r.close()


def payload(i: int, n: int) -> bytes:
    return (i.to_bytes(4, "little") * (n // 4 + 1))[:n]


@pytest.fixture
def client(daemon) -> Iterator[KvtierClient]:  # type: ignore[no-untyped-def]
    c = KvtierClient(daemon.socket_path, region_size=8 << 20, timeout=30)
    yield c
    c.close()


def test_put_lookup_get_round_trip(client: KvtierClient) -> None:
    ns = client.hello(record(0))
    assert len(ns) == 16
    assert client.limits["version"] == 1
    data = [payload(i, n) for i, n in enumerate([1, 4096, 256 << 10, (1 << 20) + 3])]
    assert client.put(ns, [(key(i), d) for i, d in enumerate(data)]) == ["ok"] * 4
    r = client.lookup(ns, [key(0), key(1), key(2), key(3), key(99), key(0)])
    assert r.prefix == 4
    assert r.locations == ["ram", "ram", "ram", "ram", "miss", "ram"]
    into = [(4 << 20, 1 << 20), (5 << 20, 4096), (6 << 20, 1), (0, 1 << 21)]
    res = client.get(ns, [key(2), key(1), key(3), key(99)], into=into)
    assert [x.status for x in res] == ["hit-ram", "hit-ram", "too-small", "miss"]
    assert res[0].data is not None and bytes(res[0].data) == data[2]
    assert res[0].offset == 4 << 20 and res[0].length == len(data[2])
    assert bytes(client.region.buffer[5 << 20 : (5 << 20) + 4096]) == data[1]
    assert res[2].length == len(data[3]) and res[2].data is None
    assert client.get_bytes(ns, key(3)) == data[3]
    assert client.get_bytes(ns, key(99)) is None
    assert client.delete(ns, [key(1), key(99)]) == [True, False]
    assert client.lookup(ns, [key(0), key(1)]).prefix == 1
    # The same LOOKUP with the keys written into the region instead of the frame.
    keys = [key(0), key(1), key(2), key(99)]
    client.region.buffer[7 << 20 : (7 << 20) + 32 * len(keys)] = b"".join(keys)
    r = client.lookup_in_region(ns, 7 << 20, len(keys))
    assert r == client.lookup(ns, keys)
    assert r.prefix == 1 and r.locations == ["ram", "miss", "ram", "miss"]
    with pytest.raises(KvtierError) as e:
        client.lookup_in_region(ns, (8 << 20) - 16, 1)
    assert e.value.code == "out-of-range"


def test_zero_copy_put_and_get_with_numpy(client: KvtierClient) -> None:
    np = pytest.importorskip("numpy")
    ns = client.hello(record(0))
    arr = client.region.numpy()
    src = np.arange(1 << 18, dtype=np.uint32).view(np.uint8)
    arr[: src.size] = src
    assert client.put(ns, [(key(50), (0, src.size))], group=3) == ["ok"]
    arr[: src.size] = 0
    res = client.get(ns, [key(50)], group=3, into=[(1 << 21, src.size)])
    assert res[0].hit
    assert np.array_equal(arr[1 << 21 : (1 << 21) + src.size], src)
    # Another group is another chunk.
    assert client.lookup(ns, [key(50)]).prefix == 0


def test_put_of_ranges_and_bytes_does_not_overlap(client: KvtierClient) -> None:
    ns = client.hello(record(0))
    client.region.buffer[0:5] = b"range"
    assert client.put(ns, [(key(60), (0, 5)), (key(61), b"staged")], atomic=True) == ["ok", "ok"]
    assert client.get_bytes(ns, key(60)) == b"range"
    assert client.get_bytes(ns, key(61)) == b"staged"


def test_put_of_views_of_the_region_stores_their_own_bytes(client: KvtierClient) -> None:
    """Copying chunks between namespaces with the GET results' views: each
    value is a range of the region already (staging bytes over it stored
    another chunk's bytes under its key, reporting "ok")."""
    src, dst = client.hello(record(0)), client.hello(record(1))
    a, b = os.urandom(5000), os.urandom(6000)
    assert client.put(src, [(key(80), a), (key(81), b)]) == ["ok", "ok"]
    ra, rb = client.get(src, [key(80), key(81)], into=[(0, 5000), (5000, 6000)])
    assert ra.data is not None and rb.data is not None
    # A read-only view of the region, and bytes staged beside them.
    ro = client.region.buffer.toreadonly()[5000:11000]
    assert client.put(dst, [(key(81), rb.data), (key(80), ra.data), (key(82), ro), (key(83), b"x" * 7000)]) == [
        "ok"
    ] * 4
    assert bytes(ra.data) == a and bytes(rb.data) == b, "the views were not written over"
    assert client.get_bytes(dst, key(80)) == a
    assert client.get_bytes(dst, key(81)) == b
    assert client.get_bytes(dst, key(82)) == b
    assert client.get_bytes(dst, key(83)) == b"x" * 7000
    with pytest.raises(TypeError, match="C-contiguous"):
        client.put(dst, [(key(84), memoryview(bytearray(10))[::2])])


def test_put_stages_around_views_of_the_region_and_read_only_views(client: KvtierClient) -> None:
    """A GET result at the region's end leaves room at its start for bytes
    staged beside it (they were staged past it: a false too-large); a
    read-only numpy view of the region is copied out, not staged over."""
    np = pytest.importorskip("numpy")
    ns = client.hello(record(0))
    size = client.region.size
    last = os.urandom(size // 4)
    assert client.put(ns, [(key(85), last)]) == ["ok"]
    (r,) = client.get(ns, [key(85)], into=[(size - len(last), len(last))])
    assert r.data is not None
    assert client.put(ns, [(key(86), r.data), (key(87), b"small")]) == ["ok", "ok"]
    assert client.get_bytes(ns, key(86)) == last
    assert client.get_bytes(ns, key(87)) == b"small"
    # A range given as numpy integers is a range too: nothing is staged over it.
    client.region.buffer[0:4096] = b"a" * 4096
    assert client.put(ns, [(key(91), (np.int64(0), np.int64(4096))), (key(92), b"b" * 4096)]) == ["ok", "ok"]
    assert client.get_bytes(ns, key(91)) == b"a" * 4096
    with pytest.raises(TypeError, match="two integers"):
        client.put(ns, [(key(93), (0.5, 10))])
    arr = client.region.numpy()
    arr[:100] = ord("G")
    ro = arr[:100]
    ro.flags.writeable = False
    assert client.put(ns, [(key(88), b"X" * 100), (key(89), ro)]) == ["ok", "ok"]
    assert client.get_bytes(ns, key(88)) == b"X" * 100
    assert client.get_bytes(ns, key(89)) == b"G" * 100


def test_a_result_taken_before_an_interrupt_survives_a_close(client: KvtierClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reply resolved when an interrupt cut the rest of its taking short
    keeps its result through a close of the client (the close failed it)."""
    import kvtier.client as kc

    ns = client.hello(record(0))
    calls = [0]
    real = kc.KvtierClient._consume

    def consume(self: KvtierClient, n: int) -> None:
        calls[0] += 1
        if calls[0] == 1:
            raise KeyboardInterrupt
        real(self, n)

    monkeypatch.setattr(kc.KvtierClient, "_consume", consume)
    p = client.submit_put(ns, [(key(90), (0, 1))])
    with pytest.raises(KeyboardInterrupt):
        p.wait()
    assert p.done
    client.close()
    assert p.wait() == ["ok"]


def test_a_client_is_closed_in_a_forked_child(client: KvtierClient) -> None:
    """A forked child shares the parent's connection: its requests could
    take the parent's replies (wrong bytes under a hit status). In the child
    the client refuses every call; the parent's goes on."""
    ns = client.hello(record(0))
    assert client.put(ns, [(key(90), b"parent")]) == ["ok"]
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through its exit code
        code = 1
        try:
            client.ping()
        except KvtierUnavailable as e:
            code = 0 if "fork" in str(e) and client.closed else 2
        except BaseException:
            code = 3
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    for _ in range(50):
        assert client.get_bytes(ns, key(90)) == b"parent"


def test_an_interrupt_anywhere_in_taking_a_reply_keeps_the_connection_in_step(
    client: KvtierClient,
) -> None:
    """An exception from a signal handler (Ctrl-C) can land in any Python
    step of reading a reply: a retried wait() gives every request its own
    result (before, some left the reply consumed and its request unresolved:
    a mismatched reply id, a hang until the timeout, or a lost result)."""
    import sys

    ns = client.hello(record(0))
    assert client.put(ns, [(key(91), b"one"), (key(92), b"two")]) == ["ok", "ok"]
    steps = ["_settle_head", "decode_header", "check_body", "decode_reply", "_resolve", "results", "_consume", "_pop_head"]
    for step in steps:
        for nth in (1, 2):
            p = client.submit_get(ns, [key(91)], into=[(0, 100)])
            q = client.submit_get(ns, [key(92)], into=[(100, 100)])
            seen = [0]

            def trace(frame, event, arg):  # type: ignore[no-untyped-def]
                if event == "call" and frame.f_code.co_name == step:
                    seen[0] += 1
                    if seen[0] == nth:
                        sys.settrace(None)
                        raise KeyboardInterrupt
                return None

            sys.settrace(trace)
            try:
                p.wait()
            except KeyboardInterrupt:
                pass
            finally:
                sys.settrace(None)
            assert not client.closed, (step, nth)
            rp, rq = p.wait()[0], q.wait()[0]
            assert (rp.status, bytes(rp.data or b"")) == ("hit-ram", b"one"), (step, nth)
            assert (rq.status, bytes(rq.data or b"")) == ("hit-ram", b"two"), (step, nth)
            client.ping()


def test_a_closed_region_or_a_zero_timeout_is_refused_at_once(client: KvtierClient, daemon) -> None:  # type: ignore[no-untyped-def]
    r = Region(4096)
    r.close()
    start = time.monotonic()
    with pytest.raises(ValueError, match="closed"):
        client.set_region(r)
    assert time.monotonic() - start < 1
    client.ping()
    with pytest.raises(ValueError, match="timeout"):
        KvtierClient(daemon.socket_path, region_size=0, timeout=0)


def test_cluster_lookup(client: KvtierClient) -> None:
    ns0 = client.hello(record(0))
    ns1 = client.hello(record(1))
    keys = [key(100 + i) for i in range(6)]
    client.put(ns0, [(k, b"x") for k in keys[:5]])
    client.put(ns1, [(k, b"y") for k in keys[:2]])
    r = client.cluster_lookup(record(0), [0, 1], keys)
    assert r.min_prefix == 2
    assert [(x.rank, x.prefix, x.ram_prefix) for x in r.ranks] == [(0, 5, 5), (1, 2, 2)]


def test_errors_are_clear_and_the_connection_survives(client: KvtierClient) -> None:
    ns = client.hello(record(0))
    with pytest.raises(KvtierError) as e:
        client.put(ns, [(key(1), (client.region.size - 1, 2))])
    assert e.value.code == "out-of-range"
    with pytest.raises(KvtierError) as e:
        client.get(ns, [key(1)], into=[(client.region.size, 1)])
    assert e.value.code == "out-of-range"
    with pytest.raises(KvtierError) as e:
        client.hello({"model": "m", "rnak": 1})
    assert e.value.code == "bad-request" and "rnak" in str(e.value)
    with pytest.raises(KvtierError) as e:
        client.put(b"\x01" * 16, [(key(1), b"x")])
    assert e.value.code == "unknown-namespace"
    with pytest.raises(KvtierError, match="does not fit"):
        client.put(ns, [(key(1), bytes(client.region.size + 1))])
    client.ping()
    assert client.lookup(ns, [key(1)]).prefix == 0


def test_bad_arguments_are_refused_in_the_callers_terms(client: KvtierClient) -> None:
    """Out-of-range integers are ValueErrors naming the fields' ranges (not
    struct.error), and one key where a list goes is a TypeError saying so."""
    ns = client.hello(record(0))
    with pytest.raises(ValueError, match="groups are 0..65535"):
        client.get(ns, [key(1)], group=65536)
    with pytest.raises(ValueError, match="non-negative"):
        client.put(ns, [(key(1), (-1, 10))])
    with pytest.raises(TypeError, match="wrap a single key in a list"):
        client.get(ns, key(1))
    with pytest.raises(TypeError, match="wrap a single key in a list"):
        client.lookup(ns, key(1))
    with pytest.raises(TypeError, match="got int"):
        client.delete(ns, [1])
    # Lengths that add up to 32 per key are still refused, key by key.
    with pytest.raises(ValueError, match="keys are 32 bytes, got 31"):
        client.lookup(ns, [b"a" * 31, b"b" * 33])
    with pytest.raises(TypeError, match="got str"):
        client.lookup(ns, [key(1), "k" * 32])
    # Only bytes, bytearray and memoryview keys, counted in bytes (a 32 x 2
    # view is 64 bytes, not one key).
    import array

    with pytest.raises(TypeError, match="got array"):
        client.lookup(ns, [array.array("B", key(1))])
    with pytest.raises(ValueError, match="got 64"):
        client.lookup(ns, [memoryview(key(1) * 2).cast("B", shape=[32, 2])])
    with pytest.raises(TypeError, match="item 0 is a bytes"):
        client.put(ns, [key(1)])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="pairs; item 1 is a tuple"):
        client.put(ns, [(key(1), b"x"), (key(2), b"y", 3)])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="max_in_flight"):
        KvtierClient(client.socket_path, region_size=0, max_in_flight=1.5)  # type: ignore[arg-type]
    # Any bytes-like key of 32 bytes is one key.
    assert client.put(ns, [(key(4), b"four")]) == ["ok"]
    r = client.lookup(ns, [bytearray(key(4)), memoryview(key(4)), key(5)])
    assert r.locations == ["ram", "ram", "miss"]
    client.ping()


def test_a_busy_daemon_says_so_to_a_client_without_a_region(tmp_path: Path) -> None:
    """The daemon answers a connection past max-connections with `busy` and
    closes it: the client's first send fails, and the error raised is the
    daemon's, not a broken pipe."""
    path = tmp_path / "busy.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(1)

    def serve() -> None:
        conn = srv.accept()[0]
        conn.sendall(fr.encode_frame(fr.REPLY_BIT, 0, 13, 0, b"the daemon already serves 2 connections"))
        conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        c = KvtierClient(path, region_size=0, timeout=5)
        t.join(timeout=5)
        with pytest.raises(KvtierUnavailable) as e:
            c.stats()
        assert e.value.code == "busy", e.value
        assert "already serves" in str(e.value)
        assert c.closed
    finally:
        t.join(timeout=5)
        srv.close()


def test_stats_and_flush(client: KvtierClient) -> None:
    ns = client.hello(record(0))
    client.put(ns, [(key(200), payload(200, 8192))])
    s = client.stats()
    assert s["store"]["puts"] >= 1
    assert s["counters"]["native-requests"] >= 3
    f = client.flush()
    assert f["failed"] == 0 and f["chunks"] >= 1 and f["bytes"] >= 8192
    # Nothing is dirty any more.
    assert client.flush()["chunks"] == 0
    assert client.get_bytes(ns, key(200)) == payload(200, 8192)


def test_flush_waits_past_the_client_timeout_unless_bounded(daemon) -> None:  # type: ignore[no-untyped-def]
    with KvtierClient(daemon.socket_path, region_size=1 << 20, timeout=0.3) as c:
        ns = c.hello(record(0))
        c.put(ns, [(key(201), payload(201, 4096))])
        # A daemon that takes longer than the client's timeout (stopped for
        # 0.6 s here) still gets its flush answered...
        daemon.proc.send_signal(signal.SIGSTOP)
        threading.Timer(0.6, daemon.proc.send_signal, args=(signal.SIGCONT,)).start()
        t0 = time.monotonic()
        assert c.flush()["failed"] == 0
        assert time.monotonic() - t0 >= 0.5
        # ... and the client's own timeout is back for the other requests.
        assert c._sock is not None and c._sock.gettimeout() == 0.3
    with KvtierClient(daemon.socket_path, region_size=0) as c:
        daemon.proc.send_signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(KvtierUnavailable, match="timed out"):
                c.flush(timeout=0.3)
            assert time.monotonic() - t0 < 5
        finally:
            daemon.proc.send_signal(signal.SIGCONT)


def test_many_clients_at_once(daemon) -> None:  # type: ignore[no-untyped-def]
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            with KvtierClient(daemon.socket_path, region_size=1 << 20) as c:
                ns = c.hello(record(t))
                for i in range(10):
                    d = os.urandom(1000 + 37 * i)
                    assert c.put(ns, [(key(i), d)]) == ["ok"]
                    assert c.get_bytes(ns, key(i)) == d
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors


# --- pipelining ----------------------------------------------------------------


def test_pipelined_requests_resolve_in_order_byte_exact(daemon) -> None:  # type: ignore[no-untyped-def]
    size, n = 64 << 10, 48
    with KvtierClient(daemon.socket_path, region_size=2 * n * size, timeout=30, max_in_flight=8) as c:
        ns = c.hello(record(0))
        buf = c.region.buffer
        data = [os.urandom(size) for _ in range(n)]
        puts = []
        for i, d in enumerate(data):
            buf[i * size : (i + 1) * size] = d
            puts.append(c.submit_put(ns, [(key(i), (i * size, size))]))
            # Never more than max_in_flight sent and unanswered.
            assert len(c._in_flight) <= 8
        # The ninth submit waited for the first reply.
        assert puts[0].done
        assert [p.wait() for p in puts] == [["ok"]] * n
        gets = [c.submit_get(ns, [key(i)], into=[((n + i) * size, size)]) for i in range(n)]
        # A synchronous call after them reads their replies first.
        assert c.lookup(ns, [key(0), key(n - 1)]).prefix == 2
        assert all(g.done for g in gets)
        for i, g in enumerate(gets):
            (r,) = g.wait()
            assert r.status == "hit-ram" and r.offset == (n + i) * size
            assert bytes(r.data) == data[i], f"chunk {i}"


def test_a_refused_request_in_a_pipeline_fails_only_itself(client: KvtierClient) -> None:
    ns = client.hello(record(0))
    client.region.buffer[0:4] = b"abcd"
    first = client.submit_put(ns, [(key(1), (0, 4))])
    bad = client.submit_put(b"\x02" * 16, [(key(2), (0, 4))])
    out_of_range = client.submit_get(ns, [key(1)], into=[(client.region.size, 4)])
    last = client.submit_get(ns, [key(1)], into=[(4096, 4)])
    assert last.wait()[0].status == "hit-ram"
    assert first.wait() == ["ok"]
    with pytest.raises(KvtierError) as e:
        bad.wait()
    assert e.value.code == "unknown-namespace"
    with pytest.raises(KvtierError) as e:
        out_of_range.wait()
    assert e.value.code == "out-of-range"
    assert bytes(client.region.buffer[4096:4100]) == b"abcd"
    with pytest.raises(TypeError, match="put"):
        client.submit_put(ns, [(key(3), b"bytes")])  # type: ignore[list-item]
    client.ping()


def _accept_with_region(srv: socket.socket) -> socket.socket:
    """Accepts a client and answers its REGISTER_REGION of 64 KiB (the memfd
    that came along is dropped here)."""
    conn = srv.accept()[0]
    head = conn.recv(fr.HEADER_LEN + 8, socket.MSG_WAITALL)
    req_id = int.from_bytes(head[16:24], "little")
    body = (1 << 16).to_bytes(8, "little")
    conn.sendall(fr.encode_frame(fr.OP_REGISTER_REGION | fr.REPLY_BIT, 0, 0, req_id, body))
    return conn


def test_a_lost_connection_fails_every_request_in_flight(tmp_path: Path) -> None:
    """A daemon that reads three requests and hangs up: each pending request
    raises KvtierUnavailable naming the cause, none hangs."""
    path = tmp_path / "hangup.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(1)

    def serve() -> None:
        conn = _accept_with_region(srv)
        got = b""
        while got.count(fr.MAGIC) < 3:
            chunk = conn.recv(4096)
            if not chunk:
                break
            got += chunk
        conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        c = KvtierClient(path, region_size=1 << 16, timeout=5)
        pending = [c.submit_get(NS, [key(i)], into=[(i * 64, 64)]) for i in range(3)]
        for p in pending:
            with pytest.raises(KvtierUnavailable, match="closed the connection"):
                p.wait()
        assert c.closed
        with pytest.raises(KvtierUnavailable):
            c.submit_get(NS, [key(0)])
    finally:
        t.join(timeout=5)
        srv.close()


def test_replies_split_or_merged_by_the_socket_decode_alike(tmp_path: Path) -> None:
    """A reply that arrives a byte at a time, and two replies that arrive in
    one read (the second before its request was even sent)."""
    path = tmp_path / "odd.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(1)

    def reply(op: int, req_id: int, body: bytes = b"") -> bytes:
        return fr.encode_frame(op | fr.REPLY_BIT, 0, 0, req_id, body)

    def serve() -> None:
        conn = srv.accept()[0]
        conn.recv(fr.HEADER_LEN + 8, socket.MSG_WAITALL)
        for b in reply(fr.OP_REGISTER_REGION, 1, (1 << 16).to_bytes(8, "little")):
            conn.sendall(bytes([b]))
        conn.recv(fr.HEADER_LEN, socket.MSG_WAITALL)
        conn.sendall(reply(fr.OP_PING, 2) + reply(fr.OP_PING, 3))
        # The second and third PING (unanswered), then hang up.
        conn.recv(2 * fr.HEADER_LEN, socket.MSG_WAITALL)
        conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        c = KvtierClient(path, region_size=1 << 16, timeout=5)
        c.ping()
        c.ping()
        with pytest.raises(KvtierUnavailable, match="closed the connection"):
            c.ping()
    finally:
        t.join(timeout=5)
        srv.close()


def test_a_reply_larger_than_the_receive_buffer(client: KvtierClient) -> None:
    ns = client.hello(record(0))
    client.put(ns, [(key(7), b"x")])
    keys = [(i + (0x5EED << 200)).to_bytes(32, "little") for i in range(client.limits["max_batch"])]
    keys[3] = key(7)
    pending = client.submit_get(ns, [key(7)], into=[(0, 1)])
    r = client.lookup(ns, keys)  # a reply of 8 + 65,536 bytes
    assert r.prefix == 0 and r.locations.count("ram") == 1 and r.locations[3] == "ram"
    assert pending.wait()[0].status == "hit-ram"
    client.ping()


def test_large_pipelined_batches_never_deadlock_the_connection(daemon) -> None:  # type: ignore[no-untyped-def]
    """Replies that would overflow the socket while the client still sends
    requests: the daemon stops reading while a reply write blocks, the client
    while a send blocks. The client's reply budget keeps that from happening
    (without it this stalled until the daemon's 30 s frame timeout)."""
    with KvtierClient(daemon.socket_path, region_size=1 << 20, timeout=10) as c:
        ns = c.hello(record(0))
        for keys_per_get, depth in ((256, 64), (4096, 8)):
            keys = [(0xB16 << 128 | i).to_bytes(32, "little") for i in range(keys_per_get)]
            pending = [c.submit_get(ns, keys, into=[(0, 0)] * keys_per_get) for _ in range(depth)]
            for p in pending:
                assert [r.status for r in p.wait()] == ["miss"] * keys_per_get
        c.ping()


def _slow_reply_server(path: Path, lookups: int, split_first: float) -> threading.Thread:
    """Accepts one client, answers REGISTER_REGION, then `lookups` LOOKUPs of
    one key with prefix 1; the first reply's body comes `split_first`
    seconds after its header."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(1)

    def serve() -> None:
        conn = _accept_with_region(srv)
        for n in range(lookups):
            req = conn.recv(fr.HEADER_LEN, socket.MSG_WAITALL)
            body_len = int.from_bytes(req[12:16], "little")
            conn.recv(body_len, socket.MSG_WAITALL)
            req_id = int.from_bytes(req[16:24], "little")
            frame = fr.encode_frame(fr.OP_LOOKUP | fr.REPLY_BIT, 0, 0, req_id, struct.pack("<II", 1, 1) + b"\x01")
            if n == 0:
                conn.sendall(frame[: fr.HEADER_LEN])
                time.sleep(split_first)
                conn.sendall(frame[fr.HEADER_LEN :])
            else:
                conn.sendall(frame)
        conn.recv(1)
        conn.close()
        srv.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return t


def test_an_interrupted_wait_can_be_retried(tmp_path: Path) -> None:
    """Ctrl-C while a reply is half received: nothing of it is consumed, so
    the connection stays in step and the next call works."""
    path = tmp_path / "slow.sock"
    t = _slow_reply_server(path, lookups=2, split_first=0.6)

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        c = KvtierClient(path, region_size=1 << 16, timeout=5)
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(KeyboardInterrupt):
            c.lookup(NS, [key(1)])
        assert not c.closed
        r = c.lookup(NS, [key(2)])  # reads the first reply, then its own
        assert r.prefix == 1 and r.locations == ["ram"]
        c.close()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        t.join(timeout=5)


def test_an_interrupted_decode_is_done_again_on_the_next_wait(client: KvtierClient, monkeypatch: pytest.MonkeyPatch) -> None:
    import kvtier.client as kc

    ns = client.hello(record(0))
    client.region.buffer[0:2] = b"ab"
    real = kc._put_codes

    def interrupted(codes: object) -> list[str]:
        raise KeyboardInterrupt

    calls = [0]

    def interrupted_once(codes: object) -> list[str]:
        calls[0] += 1
        if calls[0] == 1:
            raise KeyboardInterrupt
        return real(codes)

    monkeypatch.setattr(kc, "_put_codes", interrupted_once)
    first = client.submit_put(ns, [(key(70), (0, 2))])
    monkeypatch.setattr(kc, "_put_codes", real)
    second = client.submit_put(ns, [(key(71), (0, 2))])
    with pytest.raises(KeyboardInterrupt):
        second.wait()  # decoding the first reply is interrupted
    # Nothing was lost: the first reply is decoded again.
    assert first.wait() == ["ok"]
    assert second.wait() == ["ok"]
    assert client.get_bytes(ns, key(71)) == b"ab"


def _scripted_server(path: Path, replies) -> tuple[socket.socket, threading.Thread]:  # type: ignore[no-untyped-def]
    """A fake daemon: answers REGISTER_REGION, then each next request with
    ``replies(op, req_id)`` (bytes of whole frames), until the client goes."""
    srv = _listening(path)

    def serve() -> None:
        conn = _accept_with_region(srv)
        conn.settimeout(10)
        try:
            while True:
                head = conn.recv(fr.HEADER_LEN, socket.MSG_WAITALL)
                if len(head) < fr.HEADER_LEN:
                    return
                h = fr.decode_header(head)
                if h.body_len:
                    conn.recv(h.body_len, socket.MSG_WAITALL)
                conn.sendall(replies(h.op, h.req_id))
        except OSError:
            return
        finally:
            conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return srv, t


def _get_reply(req_id: int, results: list[tuple[int, int]]) -> bytes:
    body = struct.pack("<II", len(results), 0) + b"".join(struct.pack("<B7xQ", s, n) for s, n in results)
    return fr.encode_frame(fr.OP_GET | fr.REPLY_BIT, 0, 0, req_id, body)


@pytest.mark.parametrize(
    "case, reply",
    [
        # A reply of another op (QA: a PING's reply to a LOOKUP raised
        # TypeError and left the client open).
        ("op", lambda op, rid: fr.encode_frame(fr.OP_PING | fr.REPLY_BIT, 0, 0, rid, b"")),
        # Fewer entries than keys (QA: zip() returned a shorter list).
        ("count", lambda op, rid: _get_reply(rid, [(1, 8)])),
        # A hit longer than its range (QA: a view over a neighbour's bytes).
        ("length", lambda op, rid: _get_reply(rid, [(1, 8), (1, 5000)])),
    ],
)
def test_a_reply_that_does_not_fit_its_request_closes_the_client(tmp_path: Path, case: str, reply) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / f"{case}.sock"
    srv, t = _scripted_server(path, reply)
    try:
        c = KvtierClient(path, region_size=1 << 16, timeout=5)
        with pytest.raises(KvtierProtocolError):
            c.get(NS, [key(0), key(1)], into=[(0, 8), (8, 8)])
        assert c.closed
        # Later calls say why (QA: they said that close() was called).
        with pytest.raises(KvtierUnavailable) as e:
            c.ping()
        assert "close() was called" not in str(e.value), e.value
    finally:
        t.join(timeout=5)
        srv.close()


def _memfds() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
        except OSError:
            pass
    return n


def test_regions_are_not_leaked_by_failed_or_dropped_clients(tmp_path: Path, daemon) -> None:  # type: ignore[no-untyped-def]
    """QA: a constructor whose REGISTER_REGION failed kept its memfd open,
    and a client dropped without close() held its region's memory until the
    process ended."""
    import gc

    path = tmp_path / "refuses.sock"
    refusal = fr.encode_frame(fr.OP_REGISTER_REGION | fr.REPLY_BIT, 0, 5, 1, b"region too large")
    srv = _listening(path)

    def serve() -> None:
        for _ in range(3):
            conn = srv.accept()[0]
            conn.recv(fr.HEADER_LEN + 8, socket.MSG_WAITALL)
            conn.sendall(refusal)
            conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        before = _memfds()
        for _ in range(3):
            with pytest.raises(KvtierError):
                KvtierClient(path, region_size=1 << 16, timeout=5)
        assert _memfds() <= before
    finally:
        t.join(timeout=5)
        srv.close()
    before = _memfds()
    for _ in range(3):
        c = KvtierClient(daemon.socket_path, region_size=1 << 20, timeout=5)
        c.ping()
        del c
    Region(1 << 20)  # a bare region, never closed
    gc.collect()
    assert _memfds() <= before


def test_flush_refuses_a_zero_timeout_and_stays_usable(client: KvtierClient) -> None:
    """QA: ``flush(timeout=0)`` made the socket non-blocking and broke a
    healthy connection."""
    for bad in (0, -1):
        with pytest.raises(ValueError, match="timeout"):
            client.flush(timeout=bad)
    assert client.flush(timeout=30)["failed"] == 0
    client.ping()


def bkey(i: int) -> bytes:
    return i.to_bytes(32, "little")


def test_many_small_values_are_staged_around_ranges_and_read_back(client: KvtierClient) -> None:
    """Bytes values are staged one after another around the zero-copy
    ranges of the call (QA: a first-fit scan per value was quadratic), and
    into gaps skipped once the region's end is reached."""
    ns = client.hello(record(0))
    size = client.region.size
    # Zero-copy ranges at the start and the end leave one gap in between.
    client.region.buffer[0:100] = b"a" * 100
    client.region.buffer[size - 100 : size] = b"z" * 100
    items: list = [(key(0), (0, 100)), (key(1), (size - 100, 100))]
    values = {i: bytes([i % 251]) * 64 for i in range(2, 5002)}
    items += [(bkey(i), v) for i, v in values.items()]
    assert client.put(ns, items) == ["ok"] * len(items)
    got = client.get(ns, [key(0), key(1)], into=[(0, 128), (128, 128)])
    assert [bytes(r.data) for r in got] == [b"a" * 100, b"z" * 100]
    for i in (2, 2500, 5001):
        assert client.get_bytes(ns, bkey(i)) == values[i]
    # Ranges at the start, a quarter and the end: a first copy of half the
    # region goes after the quarter's range (the gap before it is too
    # small), a second one does not fit after it and goes into that gap.
    q = size // 4
    for at in (0, q, size - 100):
        client.region.buffer[at : at + 100] = b"r" * 100
    half, fill = b"H" * (size // 2), b"F" * (q - 150)
    put = [(bkey(9000), (0, 100)), (bkey(9001), (q, 100)), (bkey(9002), (size - 100, 100))]
    assert client.put(ns, put + [(bkey(9003), half), (bkey(9004), fill)]) == ["ok"] * 5
    assert client.get_bytes(ns, bkey(9003)) == half
    assert client.get_bytes(ns, bkey(9004)) == fill
    assert client.get_bytes(ns, bkey(9001)) == b"r" * 100


def test_close_closes_the_region_the_client_owns(daemon) -> None:  # type: ignore[no-untyped-def]
    """Review: a change of this session left ``close()`` without its
    region's close (its memfd stayed mapped until the client was collected)."""
    c = KvtierClient(daemon.socket_path, region_size=1 << 20, timeout=5)
    r = c.region
    c.close()
    assert r.fd < 0
    with pytest.raises(KvtierError):
        c.region


def test_a_record_with_numpy_integers_registers_like_plain_ones(client: KvtierClient) -> None:
    """QA: numpy integers in a record (a rank read from a config array)
    raised TypeError from json."""
    np = pytest.importorskip("numpy")
    plain = record(1)
    assert client.hello({**plain, "rank": np.int64(1), "tp-size": np.int32(plain["tp-size"])}) == client.hello(plain)
    with pytest.raises(TypeError):
        client.hello({**plain, "salt": object()})
