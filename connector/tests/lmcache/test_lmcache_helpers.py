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


def test_resp_url_refuses_what_is_not_host_and_port() -> None:
    """QA: these were taken as they were."""
    assert resp_url("resp://127.0.0.1:6380") == "resp://127.0.0.1:6380"
    for bad in ["resp://", "resp://nope", " 127.0.0.1:6380", "resp://h:99999", "resp://a/b:1", "resp://redis://h:1"]:
        with pytest.raises(ValueError):
            resp_url(bad)


@pytest.mark.parametrize("password", ['a\tb', "a\nb", 'q"\\x', "ünï", "p\x85w", "p\x7fw", "p\x9bw"])
def test_a_password_with_any_characters_reads_back_the_same(password: str) -> None:
    """QA: only backslash and double quote were escaped: a tab made the
    env JSON invalid, a newline read back from the YAML as a space."""
    import json

    env = lmcache_env("127.0.0.1:7000", password=password)
    assert json.loads(env["LMCACHE_EXTRA_CONFIG"])["password"] == password
    line = next(x for x in lmcache_yaml("127.0.0.1:7000", password=password).splitlines() if "password:" in x)
    # A double-quoted YAML scalar with JSON's escapes (PyYAML reads it so
    # where installed; the JSON reading is the same string).
    assert json.loads(line.split(":", 1)[1]) == password
    try:
        import yaml  # type: ignore[import-untyped]
    except ImportError:
        return
    assert yaml.safe_load(lmcache_yaml("127.0.0.1:7000", password=password))["extra_config"]["password"] == password
