"""The kvtier namespace of one rank, built from vLLM's configuration.

A namespace record is the fence of everything stored: bytes stored under one
(model, revision, engine version, TP size, rank, KV dtype, block size, chunk
size, hash algorithm, layout, salt) are never served for another. The JSON
keys match `tier::NamespaceRecord` (kebab-case, see tier/src/types.rs); the
daemon refuses unknown keys.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket as _socket
from dataclasses import dataclass
from typing import Any

#: Version of the chunk payload layout written by this connector (a fence).
#: Payload of one (chunk, group): for each layer of the group in
#: `KVCacheGroupSpec.layer_names` order, the logical `[blocks, H, N, C]`
#: pages of the chunk's blocks, contiguous, as raw bytes.
PAYLOAD_FORMAT_VERSION = 1

#: Hash algorithms whose block hashes are the same in every process.
REPRODUCIBLE_HASH_ALGOS = ("sha256", "sha256_cbor")


def hash_algo_is_reproducible(algo: str, env: dict[str, str] | None = None) -> bool:
    """True when block hashes computed with `algo` are equal across processes.

    vLLM seeds `NONE_HASH` of the non-cryptographic algorithms (xxhash*) from a
    random per-process value unless PYTHONHASHSEED is set.
    """
    env = os.environ if env is None else env
    return algo in REPRODUCIBLE_HASH_ALGOS or env.get("PYTHONHASHSEED") is not None


@dataclass(frozen=True)
class GroupLayout:
    """What the connector moves for one KV-cache group."""

    #: Index of the group in `KVCacheConfig.kv_cache_groups`.
    group_id: int
    #: Layer names in payload order.
    layer_names: tuple[str, ...]
    #: Tokens per block of this group.
    block_size: int
    #: Bytes of one layer's logical page (H * N * C * dtype size).
    page_bytes: int
    #: Spec fingerprint (type, heads, head sizes, dtype).
    spec: str

    def chunk_bytes(self, chunk_blocks: int) -> int:
        """Payload bytes of one chunk of this group."""
        return len(self.layer_names) * chunk_blocks * self.page_bytes


def layout_fingerprint(groups: list[GroupLayout], chunk_blocks: int) -> str:
    """A short, stable text describing the per-group payload layout."""
    parts = []
    for g in groups:
        names = hashlib.sha256("\n".join(g.layer_names).encode()).hexdigest()[:12]
        parts.append(
            f"g{g.group_id}:{g.spec}:bs{g.block_size}:page{g.page_bytes}:"
            f"layers{len(g.layer_names)}@{names}:chunk{g.chunk_bytes(chunk_blocks)}"
        )
    return ";".join(parts)


def build_record(
    *,
    model: str,
    model_revision: str,
    engine_version: str,
    tp_size: int,
    rank: int,
    kv_dtype: str,
    block_size: int,
    chunk_tokens: int,
    hash_algo: str,
    layout: str,
    salt: str,
    info: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The namespace record as the daemon's HELLO expects it (kebab-case JSON)."""
    return {
        "model": model,
        "model-revision": model_revision,
        "engine": "vllm",
        "engine-version": engine_version,
        "tp-size": int(tp_size),
        "rank": int(rank),
        "kv-dtype": kv_dtype,
        "block-size": int(block_size),
        "chunk-tokens": int(chunk_tokens),
        "hash-algo": hash_algo,
        "layout": layout,
        "format-version": PAYLOAD_FORMAT_VERSION,
        "salt": salt,
        "info": dict(info or {}),
    }


def default_info() -> dict[str, str]:
    """Informational (non-fence) fields."""
    return {"host": _socket.gethostname(), "created-by": "kvtier.vllm"}


def record_json(record: dict[str, Any]) -> str:
    """Canonical JSON of a record (for logs and tests)."""
    return json.dumps(record, sort_keys=True, separators=(",", ":"))
