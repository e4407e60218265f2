"""`kv_connector_extra_config` keys of the kvtier vLLM connector.

Every key is optional; an unknown key is an error naming the key (a misspelt
key must never silently become a default). See docs/vllm.md.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

#: The daemon's default native socket (`kvtier node start --socket`).
DEFAULT_SOCKET = "/run/kvtier/kvtier.sock"

SAVE_POLICIES = ("prefill-and-finish", "on-evict")

#: Most daemon connections per direction and rank (each is a socket, a
#: shared-memory region and a daemon thread).
MAX_LINKS = 64

#: Longest `timeout_ms` (10 minutes): past it a hung daemon holds a request
#: (or a step waiting for a gather) for good in practice.
MAX_TIMEOUT_MS = 600_000
#: Longest `lookup_timeout_ms` (1 minute): a lookup runs on the engine's thread.
MAX_LOOKUP_TIMEOUT_MS = 60_000


def physical_memory() -> int | None:
    """Bytes of RAM of this machine, None when unknown."""
    import os

    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


class ConfigError(ValueError):
    """A bad `kv_connector_extra_config`."""


@dataclass(frozen=True)
class KvtierConfig:
    """Parsed and validated connector settings."""

    #: Absolute path of the local daemon's native socket (a relative one would
    #: depend on each vLLM process's working directory). Default:
    #: /run/kvtier/kvtier.sock.
    socket: str = DEFAULT_SOCKET
    #: Size gate: requests whose prompt is shorter than this many tokens only
    #: count chunks resident in RAM (seed 000: a small miss recomputes cheaper
    #: than a disk read). 0 disables the gate. Default: 32768.
    min_tokens_for_disk: int = 32768
    #: When to store: "prefill-and-finish" (new full chunks as prefill
    #: completes them, and the rest at request end) or "on-evict" (full chunks
    #: cached in vLLM's GPU block pool, only as the pool is about to reuse
    #: their blocks). Default: "prefill-and-finish".
    save_policy: str = "prefill-and-finish"
    #: on-evict only: how far ahead of vLLM's allocator the connector looks, as
    #: a fraction of the GPU block pool. A cached chunk that is not stored yet
    #: is saved once one of its blocks is among the next
    #: `evict_watermark * num_gpu_blocks` free blocks vLLM will hand out (never
    #: fewer than one full step can allocate). While the free blocks ahead of
    #: the first such chunk number at least that many, nothing is copied.
    #: Default: 0.05.
    evict_watermark: float = 0.05
    #: Engine blocks per kvtier chunk (chunk tokens = chunk_blocks *
    #: block_size). Default: 16 (256 tokens at block size 16).
    chunk_blocks: int = 16
    #: User salt, a fence field of the namespace: change it to invalidate
    #: everything stored. Default: "".
    salt: str = ""
    #: Deadline of one daemon call on the scheduler's path (lookups), in ms.
    #: A lookup past it counts as a miss. Default: 2000; 1..=60000.
    lookup_timeout_ms: int = 2000
    #: Deadline of one daemon call on the worker's path (PUT/GET batches), in
    #: ms. A load past it becomes a load error (vLLM recomputes). Default:
    #: 30000; 1..=600000.
    timeout_ms: int = 30000
    #: Bytes of shared-memory staging per direction (save, load) and rank;
    #: must hold at least one chunk, and at most this machine's RAM; each
    #: connection's share (`staging_bytes / save_links`, likewise for loads)
    #: must fit the daemon's max-region (64 GiB by default), or the worker
    #: disables itself at its first connection. Default: 256 MiB; minimum 1 MiB.
    staging_bytes: int = 256 << 20
    #: Store chunks at all (False: restore only). Default: True.
    store: bool = True
    #: Load chunks at all (False: store only). Default: True.
    load: bool = True
    #: Model revision for the namespace when vLLM's config has none (e.g. a
    #: local path). Default: "" (vLLM's `revision`, if any, is used).
    model_revision: str = ""
    #: Daemon connections the worker keeps for saves (PUTs in flight at once,
    #: each with `staging_bytes / save_links` of the staging area; fewer when a
    #: chunk would not fit). Default: 8.
    save_links: int = 8
    #: Daemon connections for loads (GETs in flight at once), likewise. Default: 8.
    load_links: int = 8

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> KvtierConfig:
        """Parses `kv_connector_extra_config`; raises ConfigError on any bad key or value."""
        extra = dict(extra or {})
        known = {f.name: f for f in fields(cls)}
        values: dict[str, Any] = {}
        for key, value in extra.items():
            if key not in known:
                raise ConfigError(
                    f"kvtier connector: unknown kv_connector_extra_config key {key!r} "
                    f"(known keys: {', '.join(sorted(known))})"
                )
            default = known[key].default
            if isinstance(default, bool):
                if not isinstance(value, bool):
                    raise ConfigError(f"kvtier connector: {key} must be true or false, got {value!r}")
            elif isinstance(default, float):
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise ConfigError(f"kvtier connector: {key} must be a number, got {value!r}")
                value = float(value)
            elif isinstance(default, int):
                if isinstance(value, bool) or not isinstance(value, int):
                    raise ConfigError(f"kvtier connector: {key} must be an integer, got {value!r}")
            elif isinstance(default, str) and not isinstance(value, str):
                raise ConfigError(f"kvtier connector: {key} must be a string, got {value!r}")
            values[key] = value
        cfg = cls(**values)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Rejects contradictions; never clamps."""
        if self.save_policy not in SAVE_POLICIES:
            raise ConfigError(
                f"kvtier connector: save_policy must be one of {', '.join(SAVE_POLICIES)}, "
                f"got {self.save_policy!r}"
            )
        if not 0.0 < self.evict_watermark <= 1.0:
            raise ConfigError(
                f"kvtier connector: evict_watermark must be a fraction of the block pool in (0, 1], "
                f"got {self.evict_watermark!r}"
            )
        for key in ("save_links", "load_links"):
            if not 1 <= getattr(self, key) <= MAX_LINKS:
                raise ConfigError(f"kvtier connector: {key} must be in 1..={MAX_LINKS}, got {getattr(self, key)!r}")
        if self.min_tokens_for_disk < 0:
            raise ConfigError("kvtier connector: min_tokens_for_disk must be >= 0")
        if not 1 <= self.chunk_blocks <= 4096:
            raise ConfigError("kvtier connector: chunk_blocks must be in 1..=4096")
        if not 1 <= self.lookup_timeout_ms <= MAX_LOOKUP_TIMEOUT_MS:
            raise ConfigError(
                f"kvtier connector: lookup_timeout_ms must be in 1..={MAX_LOOKUP_TIMEOUT_MS} "
                f"(a lookup runs on the engine's thread), got {self.lookup_timeout_ms!r}"
            )
        if not 1 <= self.timeout_ms <= MAX_TIMEOUT_MS:
            raise ConfigError(
                f"kvtier connector: timeout_ms must be in 1..={MAX_TIMEOUT_MS} (10 minutes), got {self.timeout_ms!r}"
            )
        if self.staging_bytes < 1 << 20:
            raise ConfigError("kvtier connector: staging_bytes must be at least 1 MiB")
        ram = physical_memory()
        if ram is not None and self.staging_bytes > ram:
            raise ConfigError(
                f"kvtier connector: staging_bytes={self.staging_bytes} is more than this machine's memory "
                f"({ram} bytes); it is shared memory per rank and direction (default 256 MiB)"
            )
        if not self.socket:
            raise ConfigError("kvtier connector: socket must not be empty")
        if not self.socket.startswith("/"):
            raise ConfigError(
                f"kvtier connector: socket must be an absolute path (the daemon's --socket), got {self.socket!r}"
            )
