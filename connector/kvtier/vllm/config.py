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


class ConfigError(ValueError):
    """A bad `kv_connector_extra_config`."""


@dataclass(frozen=True)
class KvtierConfig:
    """Parsed and validated connector settings."""

    #: Path of the local daemon's native socket. Default: /run/kvtier/kvtier.sock.
    socket: str = DEFAULT_SOCKET
    #: Size gate: requests whose prompt is shorter than this many tokens only
    #: count chunks resident in RAM (seed 000: a small miss recomputes cheaper
    #: than a disk read). 0 disables the gate. Default: 32768.
    min_tokens_for_disk: int = 32768
    #: When to store: "prefill-and-finish" (new full chunks as prefill
    #: completes them, and the rest at request end) or "on-evict" (not
    #: implemented yet). Default: "prefill-and-finish".
    save_policy: str = "prefill-and-finish"
    #: Engine blocks per kvtier chunk (chunk tokens = chunk_blocks *
    #: block_size). Default: 16 (256 tokens at block size 16).
    chunk_blocks: int = 16
    #: User salt, a fence field of the namespace: change it to invalidate
    #: everything stored. Default: "".
    salt: str = ""
    #: Deadline of one daemon call on the scheduler's path (lookups), in ms.
    #: A lookup past it counts as a miss. Default: 2000.
    lookup_timeout_ms: int = 2000
    #: Deadline of one daemon call on the worker's path (PUT/GET batches), in
    #: ms. A load past it becomes a load error (vLLM recomputes). Default: 30000.
    timeout_ms: int = 30000
    #: Bytes of shared-memory staging per direction (save, load) and rank;
    #: must hold at least one chunk. Default: 256 MiB.
    staging_bytes: int = 256 << 20
    #: Store chunks at all (False: restore only). Default: True.
    store: bool = True
    #: Load chunks at all (False: store only). Default: True.
    load: bool = True
    #: Model revision for the namespace when vLLM's config has none (e.g. a
    #: local path). Default: "" (vLLM's `revision`, if any, is used).
    model_revision: str = ""

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
        if self.save_policy == "on-evict":
            raise ConfigError(
                "kvtier connector: save_policy 'on-evict' is not implemented yet "
                "(use 'prefill-and-finish'; see docs/vllm.md)"
            )
        if self.min_tokens_for_disk < 0:
            raise ConfigError("kvtier connector: min_tokens_for_disk must be >= 0")
        if not 1 <= self.chunk_blocks <= 4096:
            raise ConfigError("kvtier connector: chunk_blocks must be in 1..=4096")
        if self.lookup_timeout_ms <= 0 or self.timeout_ms <= 0:
            raise ConfigError("kvtier connector: timeouts must be > 0 ms")
        if self.staging_bytes < 1 << 20:
            raise ConfigError("kvtier connector: staging_bytes must be at least 1 MiB")
        if not self.socket:
            raise ConfigError("kvtier connector: socket must not be empty")
