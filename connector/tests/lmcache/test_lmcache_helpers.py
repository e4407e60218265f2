"""kvtier.lmcache's settings helpers (no LMCache needed)."""

from __future__ import annotations

import pytest

from kvtier.lmcache import lmcache_env, lmcache_settings, lmcache_yaml, resp_url


def test_resp_url() -> None:
    assert resp_url("127.0.0.1:6380") == "resp://127.0.0.1:6380"
    assert resp_url("resp://h:1") == "resp://h:1"
    for bad in ["127.0.0.1", "redis://h:1", ":6380", "h:x"]:
        with pytest.raises(ValueError):
            resp_url(bad)


def test_settings_satisfy_lmcache_resp_asserts() -> None:
    s = lmcache_settings("127.0.0.1:7000", password="pw", num_threads=4)
    assert s["remote_url"] == "resp://127.0.0.1:7000"
    assert s["save_unfull_chunk"] is False
    assert s["extra_config"] == {"save_chunk_meta": False, "resp_num_threads": 4, "password": "pw"}
    y = lmcache_yaml("127.0.0.1:7000")
    assert 'remote_url: "resp://127.0.0.1:7000"' in y
    assert "  save_chunk_meta: false" in y
    env = lmcache_env("127.0.0.1:7000", password="pw")
    assert env["LMCACHE_REMOTE_URL"] == "resp://127.0.0.1:7000"
    assert env["LMCACHE_RESP_PASSWORD"] == "pw"
    assert env["LMCACHE_TRACK_USAGE"] == "false"
