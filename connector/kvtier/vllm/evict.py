"""`save_policy: on-evict`: store cached chunks only as vLLM is about to reuse their blocks.

Scheduler side only (engine core, head node). vLLM 0.33 hands the connector its
GPU `BlockPool` (`bind_gpu_block_pool`). Its `free_block_queue` is the order in
which `get_new_blocks` hands blocks out: free blocks without a prefix-cache hash
first (`free_blocks` prepends them), then cached blocks least recently used
first (appended); handing out a cached block evicts it
(`_maybe_evict_cached_block`). So the blocks "about to be reused" are the head
of that queue, and a cached block's bytes stay what its hash names until then.

The tracker keeps the full chunks that requests computed and that kvtier does
not hold yet (with their block ids and the block hashes vLLM gave those blocks).
Each step, after vLLM's scheduler allocated the step's blocks, it walks the
first `window` blocks of the free queue. A tracked chunk with a block there is
saved in this very step: every rank gathers it in this step, before vLLM can
hand the block to anyone (see `KvtierWorker._queue_evict_saves`), and only if
every block of the chunk still carries the hash it was computed under (else
the chunk is dropped, never stored). While the free blocks ahead of the first
unstored cached chunk number at least `window`, nothing is copied.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from kvtier.vllm.layout import EngineLayout
from kvtier.vllm.meta import ChunkSave
from kvtier.vllm.metrics import StatsRecorder

logger = logging.getLogger("kvtier.vllm")


@dataclass
class _Tracked:
    key: bytes
    #: One ChunkSave per KV-cache group, as the save path builds them.
    saves: list[ChunkSave]
    #: Per save, per block: the `BlockHashWithGroupId` vLLM caches the block under.
    expect: list[list[bytes]]


def window_blocks(fraction: float, num_gpu_blocks: int, step_blocks: int) -> int:
    """Free blocks looked ahead: the configured fraction of the pool, never fewer
    than one step can allocate (a chunk chosen at step N must not be handed out
    by step N+1's allocation before it was chosen)."""
    return max(1, math.ceil(fraction * num_gpu_blocks), step_blocks)


class EvictTracker:
    """Cached, not yet stored chunks, and which of them vLLM is about to reuse."""

    def __init__(self, layout: EngineLayout, fraction: float, step_blocks: int, max_chunks_per_step: int,
                 stats: StatsRecorder):
        from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

        self._hash_with_group = make_block_hash_with_group_id
        self.layout = layout
        self.fraction = fraction
        self.step_blocks = step_blocks
        self.max_chunks_per_step = max(1, max_chunks_per_step)
        self.stats = stats
        self.pool: Any = None
        self.window = 0
        self._chunks: dict[bytes, _Tracked] = {}
        #: block id -> key of the tracked chunk that owns it (one chunk per block).
        self._by_block: dict[int, bytes] = {}
        #: Keys known stored on every rank (saved here, found by a lookup, restored).
        self._stored: OrderedDict[bytes, None] = OrderedDict()
        self._stored_cap = 4096
        self._warned = False
        #: Blocks that restores accepted in the current schedule() will allocate.
        self._planned = 0
        #: Look-ahead of the next select(), when restores need more than `window`.
        self._extra = 0

    # ---- set-up ------------------------------------------------------------

    def bind(self, pool: Any) -> None:
        """Takes vLLM's GPU block pool (`bind_gpu_block_pool`)."""
        self.pool = pool
        n = int(pool.num_gpu_blocks)
        self.window = window_blocks(self.fraction, n, self.step_blocks)
        self._stored_cap = max(4096, 4 * n // max(1, self.layout.chunk_blocks))
        if not getattr(pool, "enable_caching", True):
            logger.warning("kvtier: save_policy on-evict needs vLLM's prefix caching; nothing will be stored")
        logger.info(
            "kvtier: on-evict saves look %d blocks ahead of vLLM's allocator (pool of %d, at most %d chunks a step)",
            self.window, n, self.max_chunks_per_step,
        )

    def ready(self) -> bool:
        """Whether vLLM handed over its block pool; warns once when it did not."""
        if self.pool is None and not self._warned:
            self._warned = True
            logger.error(
                "kvtier: save_policy on-evict needs vLLM's GPU block pool (bind_gpu_block_pool), "
                "which this engine did not hand over; nothing will be stored"
            )
        return self.pool is not None

    # ---- bookkeeping ---------------------------------------------------------

    def _expected(self, block_hashes: Any, save: ChunkSave, chunk: int) -> list[bytes]:
        r = self.layout.block_size // self.layout.hash_block_size
        cb = self.layout.chunk_blocks
        return [
            self._hash_with_group(block_hashes[(chunk * cb + i + 1) * r - 1], save.group)
            for i in range(len(save.block_ids))
        ]

    def is_stored(self, key: bytes) -> bool:
        """Whether the key is known stored (no need to track it)."""
        return key in self._stored

    def mark_stored(self, keys: list[bytes]) -> None:
        """Notes keys every rank holds (a lookup found them, or they were saved)."""
        for k in keys:
            self._stored[k] = None
            self._stored.move_to_end(k)
            self._drop(k)
        while len(self._stored) > self._stored_cap:
            self._stored.popitem(last=False)

    def forget_stored(self, keys: list[bytes]) -> None:
        """Keys no longer known stored (their restore failed)."""
        for k in keys:
            self._stored.pop(k, None)

    def track(self, saves: list[ChunkSave], block_hashes: Any, first_chunk: int) -> list[bytes]:
        """Starts tracking the chunks of `saves` (per chunk, one ChunkSave per group,
        in chunk order from `first_chunk`), computed by the request whose
        `block_hashes` name them; returns the keys now tracked with these blocks."""
        ngroups = len(self.layout.groups)
        keys: list[bytes] = []
        for i in range(0, len(saves), ngroups):
            group_saves = saves[i : i + ngroups]
            key = group_saves[0].key
            if key in self._stored:
                continue
            chunk = first_chunk + i // ngroups
            t = _Tracked(key, group_saves, [self._expected(block_hashes, s, chunk) for s in group_saves])
            old = self._chunks.get(key)
            if old is not None:
                if self._intact(old):
                    continue  # the same chunk in other blocks: keep the copy already tracked
                self._lost(key)
            for s in group_saves:
                for bid in s.block_ids:
                    prev = self._by_block.get(bid)
                    if prev is not None and prev != key:
                        # The block holds other bytes now: that chunk can no longer be saved.
                        self._lost(prev)
            self._chunks[key] = t
            for s in group_saves:
                for bid in s.block_ids:
                    self._by_block[bid] = key
            keys.append(key)
        return keys

    def _drop(self, key: bytes) -> _Tracked | None:
        t = self._chunks.pop(key, None)
        if t is not None:
            for s in t.saves:
                for bid in s.block_ids:
                    if self._by_block.get(bid) == key:
                        del self._by_block[bid]
        return t

    def _lost(self, key: bytes) -> None:
        if self._drop(key) is not None:
            self.stats.add(evict_lost_chunks=1)

    def _intact(self, t: _Tracked) -> bool:
        blocks = self.pool.blocks
        for s, want in zip(t.saves, t.expect):
            for bid, h in zip(s.block_ids, want):
                if blocks[bid].block_hash != h:
                    return False
        return True

    # ---- per step ----------------------------------------------------------

    def _first_tracked(self, limit: int) -> int:
        """Position of the first tracked block among the first `limit` free blocks, or `limit`."""
        q = self.pool.free_block_queue
        node = q.fake_free_list_head.next_free_block
        tail = q.fake_free_list_tail
        n = 0
        while node is not None and node is not tail and n < limit:
            if node.block_id in self._by_block:
                return n
            node = node.next_free_block
            n += 1
        return limit

    def reserve(self, blocks: int) -> bool:
        """Whether a restore may allocate `blocks` blocks in this schedule() at once.

        A restore's blocks are allocated in one go, beyond what one step's
        token budget can allocate (the window's floor). If that would hand out
        tracked chunks the window has not reached, the answer is no: the next
        step saves them (its look-ahead covers the restore), and vLLM asks
        again one step later (`get_num_new_matched_tokens` returns None).
        """
        if self.pool is None or not self._chunks:
            return True
        need = self._planned + blocks + self.window
        if self._first_tracked(need) < need:
            self._extra = max(self._extra, need)
            return False
        self._planned += blocks
        return True

    def select(self) -> list[ChunkSave]:
        """The tracked chunks with a block among the next `window` free blocks vLLM
        will hand out (more when a restore waits for room), least recently used
        first, still intact; at most `max_chunks_per_step`. They count as stored
        from now on."""
        look, self._extra, self._planned = max(self.window, self._extra), 0, 0
        if not self._chunks or not self.ready():
            return []
        q = self.pool.free_block_queue
        node = q.fake_free_list_head.next_free_block
        tail = q.fake_free_list_tail
        order: list[bytes] = []
        seen: set[bytes] = set()
        n = 0
        while node is not None and node is not tail and n < look:
            key = self._by_block.get(node.block_id)
            if key is not None and key not in seen:
                seen.add(key)
                order.append(key)
            node = node.next_free_block
            n += 1
        out: list[ChunkSave] = []
        picked = 0
        for key in order:
            t = self._chunks.get(key)
            if t is None:
                continue
            if not self._intact(t):
                self._lost(key)
                continue
            if picked >= self.max_chunks_per_step:
                continue  # next step (if its blocks are still there)
            picked += 1
            out.extend(t.saves)
            self.mark_stored([key])
        if picked:
            self.stats.add(evict_chunks=picked)
        return out

    def pressure(self) -> bool:
        """Whether blocks freed now would land among the next `window` blocks vLLM
        hands out (cached blocks are appended behind every free block)."""
        return self.pool is not None and self.pool.get_num_free_blocks() < self.window

    def take_held(self, keys: list[bytes], held: set[int]) -> list[ChunkSave]:
        """Stops tracking the chunks of `keys` that are intact and lie entirely in
        `held` (blocks a finishing request keeps until its saves are done), and
        returns their saves; they count as stored from now on."""
        out: list[ChunkSave] = []
        taken = 0
        for key in keys:
            t = self._chunks.get(key)
            if t is None or any(b not in held for s in t.saves for b in s.block_ids) or not self._intact(t):
                continue
            out.extend(t.saves)
            self.mark_stored([key])
            taken += 1
        if taken:
            self.stats.add(evict_chunks=taken)
        return out

    def tracked_chunks(self) -> int:
        """Chunks tracked now (tests)."""
        return len(self._chunks)
