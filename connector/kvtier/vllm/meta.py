"""Scheduler → worker metadata (pickled by vLLM each step)."""

from __future__ import annotations

from dataclasses import dataclass, field

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
except ImportError:  # the worker I/O path runs without vLLM (scripts/gpu-e2e.py)

    class KVConnectorMetadata:  # type: ignore[no-redef]
        """Stand-in base when vLLM is not installed."""


@dataclass
class ChunkLoad:
    """Restore one chunk of one group into some of its blocks."""

    key: bytes
    group: int
    #: Chunk index within the request (loads are listed in chunk order).
    chunk: int
    #: (block index within the chunk, destination GPU block id): only the blocks
    #: beyond the local prefix-cache hit.
    dst: list[tuple[int, int]]


@dataclass
class ChunkSave:
    """Store one full chunk of one group."""

    key: bytes
    group: int
    #: The chunk's GPU block ids, in order (`chunk_blocks` of them).
    block_ids: list[int]


@dataclass
class KvtierMetadata(KVConnectorMetadata):
    """One step's work for every worker (every rank gets the same)."""

    #: req id -> chunks to restore (asynchronous loads).
    loads: dict[str, list[ChunkLoad]] = field(default_factory=dict)
    #: req id -> chunks to store.
    saves: dict[str, list[ChunkSave]] = field(default_factory=dict)
    #: Finished requests whose blocks the scheduler holds until every worker
    #: reports them in `finished_sending` (after their saves are done).
    finishing: list[str] = field(default_factory=list)
    #: Requests preempted this step: their blocks are about to be reused.
    preempted: list[str] = field(default_factory=list)
    #: save_policy on-evict: cached chunks whose blocks vLLM may hand out from the
    #: next step on. Every rank gathers them within this step (before
    #: `wait_for_save` returns) or drops them.
    evict_saves: list[ChunkSave] = field(default_factory=list)
