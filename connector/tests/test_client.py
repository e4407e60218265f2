"""Tests of the Python client: golden frames shared with the Rust codec, and
round trips against a real daemon (see conftest.py)."""

from __future__ import annotations

import ctypes
import os
import socket
import threading
from pathlib import Path
from typing import Iterator

import pytest

from kvtier import KvtierClient, KvtierError, KvtierUnavailable, Region
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
    "lookup_reply": (4, (2, ["ram", "disk", "miss"])),
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


# --- against a real daemon ---------------------------------------------------


def record(rank: int) -> dict:
    return {
        "model": "py-test",
        "engine": "pytest",
        "tp-size": 2,
        "rank": rank,
        "kv-dtype": "bfloat16",
        "block-size": 16,
        "chunk-tokens": 256,
        "hash-algo": "sha256_cbor",
    }


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
