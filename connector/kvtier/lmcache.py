"""Point LMCache at kvtier through LMCache's own ``resp://`` remote backend.

kvtier's daemon speaks RESP2 (``--resp-listen``, default ``127.0.0.1:6380``)
the way LMCache 0.5.6's native RESP client expects. Keys are LMCache's
``CacheEngineKey.to_string()`` (``model@world_size@worker_id@chunkhash@dtype``);
kvtier stores each worker id (rank) in its own namespace and compares the
full key on every read.

Three ways to configure LMCache, all equivalent:

- in Python (what the tests do): ``lmcache_config("127.0.0.1:6380")`` returns
  an ``LMCacheEngineConfig``;
- as a YAML file for ``LMCACHE_CONFIG_FILE``: ``lmcache_yaml(...)``;
- as environment variables: ``lmcache_env(...)``.

Requirements and quirks (LMCache 0.5.6):

- ``resp://`` is reached only through the legacy ``remote_url`` setting (it
  logs a deprecation warning); ``remote_storage_plugins`` hands adapters a
  ``plugin://`` URL the RESP adapter does not parse.
- ``save_unfull_chunk`` and ``extra_config.save_chunk_meta`` must be False
  (LMCache asserts it); every value is a full chunk.
- With a password (required by kvtier for a non-loopback ``--resp-listen``),
  LMCache sends ``AUTH``; pass ``password=`` here or set
  ``LMCACHE_RESP_PASSWORD``.
- A wrong port or password does not fail at setup: LMCache's calls hang
  until ``blocking_timeout_secs``. Check the address with
  ``redis-cli -p PORT ping`` first.
- Set ``LMCACHE_TRACK_USAGE=false`` (or ``DO_NOT_TRACK=1``) to keep LMCache
  from reporting usage to its authors.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["lmcache_config", "lmcache_env", "lmcache_settings", "lmcache_yaml", "resp_url"]


def resp_url(address: str) -> str:
    """``host:port`` (or an existing ``resp://host:port`` URL) → LMCache's
    ``remote_url``."""
    rest = address[len("resp://") :] if address.startswith("resp://") else address
    if "://" in rest:
        raise ValueError(f"expected host:port or resp://host:port, got {address!r}")
    host, sep, port = rest.rpartition(":")
    # QA: "resp://", "resp://nope" and " 127.0.0.1:6380" were taken as they were.
    if not sep or not host or any(c.isspace() or c in "/@" for c in host) or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"expected host:port or resp://host:port, got {address!r}")
    return f"resp://{rest}"


def lmcache_settings(
    address: str = "127.0.0.1:6380",
    *,
    chunk_size: int = 256,
    max_local_cpu_size: float = 5.0,
    num_threads: int = 8,
    password: str | None = None,
    blocking_timeout_secs: int = 10,
) -> dict[str, Any]:
    """The LMCache settings that make kvtier its remote tier, as a plain dict
    (keys as in LMCache's YAML config)."""
    extra: dict[str, Any] = {"save_chunk_meta": False, "resp_num_threads": int(num_threads)}
    if password:
        extra["password"] = password
    return {
        "chunk_size": int(chunk_size),
        "local_cpu": True,
        "max_local_cpu_size": float(max_local_cpu_size),
        "remote_url": resp_url(address),
        "remote_serde": "naive",
        "save_unfull_chunk": False,
        "blocking_timeout_secs": int(blocking_timeout_secs),
        "extra_config": extra,
    }


def lmcache_config(address: str = "127.0.0.1:6380", **kwargs: Any) -> Any:
    """An ``lmcache.v1.config.LMCacheEngineConfig`` using kvtier at
    ``address`` (``host:port``) as its ``resp://`` remote backend. Keyword
    arguments are those of :func:`lmcache_settings`. Imports LMCache lazily."""
    from lmcache.v1.config import LMCacheEngineConfig

    return LMCacheEngineConfig.from_defaults(**lmcache_settings(address, **kwargs))


def lmcache_yaml(address: str = "127.0.0.1:6380", **kwargs: Any) -> str:
    """The same settings as a YAML document for ``LMCACHE_CONFIG_FILE``."""
    s = lmcache_settings(address, **kwargs)
    lines = []
    for k, v in s.items():
        if k == "extra_config":
            lines.append("extra_config:")
            for ek, ev in v.items():
                lines.append(f"  {ek}: {_yaml_scalar(ev)}")
        else:
            lines.append(f"{k}: {_yaml_scalar(v)}")
    return "\n".join(lines) + "\n"


def lmcache_env(address: str = "127.0.0.1:6380", **kwargs: Any) -> dict[str, str]:
    """The same settings as ``LMCACHE_*`` environment variables (plus the
    telemetry opt-outs)."""
    s = lmcache_settings(address, **kwargs)
    env = {f"LMCACHE_{k.upper()}": _env_scalar(v) for k, v in s.items() if k != "extra_config"}
    extra = s["extra_config"]
    env["LMCACHE_EXTRA_CONFIG"] = "{" + ", ".join(f'"{k}": {_json_scalar(v)}' for k, v in extra.items()) + "}"
    if "password" in extra:
        env["LMCACHE_RESP_PASSWORD"] = str(extra["password"])
    env["LMCACHE_TRACK_USAGE"] = "false"
    env["DO_NOT_TRACK"] = "1"
    return env


def _yaml_scalar(v: Any) -> str:
    # A JSON scalar is a YAML one (a JSON string is a double-quoted YAML
    # scalar with the same escapes: QA, a password with a newline or a tab
    # read back as another password).
    return _json_scalar(v)


def _env_scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "True" if v else "False"
    return str(v)


def _json_scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return str(v)
    # ASCII only: YAML refuses (or folds) raw DEL, C1 controls and lone
    # surrogates, which JSON leaves unescaped otherwise (review).
    return json.dumps(str(v)).replace("\x7f", "\\u007f")
