"""redis-py against the daemon's RESP endpoint, in RESP2 and RESP3 (redis-py
sends ``HELLO 3`` on connect when asked for protocol 3, the default of
recent releases), and with the library's own default."""

from __future__ import annotations

import os

import pytest

redis = pytest.importorskip("redis", reason="redis-py is installed by scripts/test.d/30-python.sh")


@pytest.mark.parametrize("protocol", [2, 3, None])
def test_redis_py_round_trips_bytes(resp_daemon: tuple[object, int], protocol: int | None) -> None:
    _, port = resp_daemon
    kw = {} if protocol is None else {"protocol": protocol}
    r = redis.Redis(host="127.0.0.1", port=port, socket_timeout=10, **kw)
    try:
        assert r.ping() is True
        key = f"test@1@0@{protocol}@bfloat16"
        value = os.urandom(300_000) + b"\r\n\x00end"
        assert r.set(key, value) is True
        assert r.get(key) == value
        assert r.exists(key, "absent", key) == 2
        assert r.get("absent") is None
        assert r.set(key, b"other", nx=True) is None
        assert r.set("absent", b"x", xx=True) is None
        assert r.get(key) == value
        assert r.dbsize() >= 1
        info = r.info()
        assert "redis_version" in info
        assert r.config_get("databases") == {"databases": "1"}
        assert r.delete(key, key, "absent") == 1
        assert r.get(key) is None
        with pytest.raises(redis.ResponseError, match="do not expire"):
            r.set(key, b"v", ex=10)
    finally:
        r.close()


def test_redis_py_pipeline(resp_daemon: tuple[object, int]) -> None:
    _, port = resp_daemon
    r = redis.Redis(host="127.0.0.1", port=port, socket_timeout=10, protocol=3)
    try:
        p = r.pipeline(transaction=False)
        for i in range(50):
            p.set(f"p{i}", bytes([i]) * 1000)
        for i in range(50):
            p.get(f"p{i}")
        out = p.execute()
        assert out[:50] == [True] * 50
        assert out[50:] == [bytes([i]) * 1000 for i in range(50)]
    finally:
        r.close()
