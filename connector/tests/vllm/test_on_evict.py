"""`save_policy: on-evict` driven by vLLM's real scheduler and block pool against a real daemon.

Pool of 80 blocks (79 usable), chunks of 16 blocks (256 tokens), prompts of
600 tokens (2 full chunks + a tail: 38 blocks with the output), at most 256
tokens and 2 requests a step: the look-ahead window is max(5 % of 80, 256/16 + 2)
= 18 blocks.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from harness import Daemon, Engine, make_kv_cache_config, make_kv_caches, make_request, make_vllm_config

POOL = 80
LIMITS = {"num_blocks": POOL, "max_num_batched_tokens": 256, "max_num_seqs": 2}


def prompt(seed: int, n: int = 600) -> list[int]:
    return [((i * 37 + seed * 101) % 997) + 1 for i in range(n)]


def on_evict(sock: str, **extra) -> dict:
    return {"socket": sock, "min_tokens_for_disk": 0, "save_policy": "on-evict", **extra}


def run_one(e: Engine, req_id: str, tokens: list[int], max_tokens: int = 3) -> None:
    e.add(make_request(req_id, tokens, max_tokens=max_tokens))
    e.run(lambda: req_id in e.finished)
    e.run(lambda: req_id not in e.scheduler.requests)


def chunk_keys(tokens: list[int]) -> list[bytes]:
    r = make_request("k", tokens)
    return [bytes(r.block_hashes[15]), bytes(r.block_hashes[31])]


def present(daemon: Daemon, e: Engine, keys: list[bytes]) -> list[bool]:
    from kvtier.client import KvtierClient

    with KvtierClient(daemon.socket, region_size=0) as c:
        ns = c.hello(e.workers[0].worker.record)
        return [c.lookup(ns, [k]).prefix == 1 for k in keys]


def test_idle_engine_copies_nothing(daemon: Daemon):
    # Two requests on a pool they do not fill: the blocks vLLM hands out next are
    # never-used ones, so nothing is copied, although both chunks are tracked.
    e = Engine(on_evict(daemon.socket), **LIMITS)
    try:
        run_one(e, "a", prompt(1))
        for _ in range(20):
            e.step()  # idle steps
        t = e.totals()
        assert t["save_chunks"] == 0 and t["save_bytes"] == 0 and t["evict_chunks"] == 0
        assert e.connector.scheduler.evict.tracked_chunks() == 2
        assert present(daemon, e, chunk_keys(prompt(1))) == [False, False]
    finally:
        e.shutdown()
    # The same request under prefill-and-finish copies both chunks (the baseline).
    e = Engine({"socket": daemon.socket, "min_tokens_for_disk": 0, "salt": "pf"}, **LIMITS)
    try:
        run_one(e, "a", prompt(1))
        assert e.totals()["save_chunks"] == 2
    finally:
        e.shutdown()


def test_pressure_saves_before_reuse_and_restores_byte_exact(daemon: Daemon):
    e = Engine(on_evict(daemon.socket), **LIMITS)
    try:
        run_one(e, "a", prompt(1))
        assert e.totals()["save_chunks"] == 0
        # Unique requests turn the pool over: a's blocks are handed out again.
        for i in range(2, 6):
            run_one(e, f"f{i}", prompt(i))
        t = e.totals()
        assert t["evict_chunks"] >= 2 and t["evict_lost_chunks"] == 0, str(t)
        assert t["save_chunks"] == t["evict_chunks"] and t["save_failed_chunks"] == 0
        assert present(daemon, e, chunk_keys(prompt(1))) == [True, True]
        # Revisit in the same engine: nothing left in the GPU pool, both chunks from kvtier.
        before = e.totals()
        run_one(e, "a2", prompt(1))
        t = e.totals()
        assert t["hit_tokens"] - before["hit_tokens"] == 512
        assert e.verified["a2"] == 512  # compared byte for byte by the harness
    finally:
        e.shutdown()
    # A fresh engine (empty GPU pool) restores them too.
    e = Engine(on_evict(daemon.socket), **LIMITS)
    try:
        run_one(e, "a3", prompt(1))
        assert e.verified["a3"] == 512 and e.totals()["load_failed_chunks"] == 0
    finally:
        e.shutdown()


@pytest.mark.parametrize("kw", [{"tp_size": 2}, {"groups": 2, "num_blocks": 160}], ids=["tp2", "hma2"])
def test_pressure_every_rank_and_group(daemon: Daemon, kw):
    # Two TP ranks save their own shard each; two KV-cache groups (sharing the
    # pool, so a step allocates twice the blocks) save one chunk per group and key.
    limits = {**LIMITS, **kw}
    e = Engine(on_evict(daemon.socket), **limits)
    n = (e.tp_size) * len(e.connector.layout.groups)
    try:
        run_one(e, "a", prompt(1))
        for i in range(2, 6 if "groups" not in kw else 8):
            run_one(e, f"f{i}", prompt(i))
        t = e.totals()
        assert t["evict_lost_chunks"] == 0, str(t)
        assert t["save_chunks"] == t["evict_chunks"] * n and t["save_failed_chunks"] == 0, str(t)
        assert present(daemon, e, chunk_keys(prompt(1))) == [True, True]
    finally:
        e.shutdown()
    e = Engine(on_evict(daemon.socket), **limits)
    try:
        run_one(e, "a2", prompt(1))
        t = e.totals()
        assert e.verified["a2"] == 512 and t["load_chunks"] == 2 * n and t["load_failed_chunks"] == 0
    finally:
        e.shutdown()


def test_request_finishing_under_pressure_is_held_and_saved(daemon: Daemon):
    # a and b together hold 76 of the 79 blocks: when a finishes, fewer free
    # blocks than the look-ahead (18) remain, so its blocks would be among the
    # next ones handed out. Its chunks are saved at once and its blocks held
    # until the save is done (request_finished returns True).
    from kvtier.vllm.scheduler import KvtierScheduler

    e = Engine(on_evict(daemon.socket), **LIMITS)
    held = []
    real = KvtierScheduler.request_finished

    def spy(self, request, block_ids):
        r = real(self, request, block_ids)
        held.append((request.request_id, r[0]))
        return r

    KvtierScheduler.request_finished = spy
    try:
        e.add(make_request("a", prompt(1), max_tokens=3))
        e.add(make_request("b", prompt(2), max_tokens=40))
        e.run(lambda: "a" in e.finished)
        e.run(lambda: "a" not in e.scheduler.requests)
        assert ("a", True) in held, held
        assert present(daemon, e, chunk_keys(prompt(1))) == [True, True]
        e.run(lambda: "b" in e.finished)
        e.run(lambda: "b" not in e.scheduler.requests)
        assert e.totals()["evict_lost_chunks"] == 0
    finally:
        KvtierScheduler.request_finished = real
        e.shutdown()
    e = Engine(on_evict(daemon.socket), **LIMITS)
    try:
        run_one(e, "a2", prompt(1))
        assert e.verified["a2"] == 512
    finally:
        e.shutdown()


def test_local_prefix_hit_is_not_looked_up(daemon: Daemon):
    # a's chunk 1 leaves the GPU (and is saved on the way) while its chunk 0
    # stays cached: b shares chunk 0 and finished later, so chunk 0 is more
    # recently used than b's own 43 cached blocks, which sit between it and a's
    # chunk 1 in vLLM's free queue. kvtier never gets chunk 0. A revisit of a hits
    # chunk 0 locally and restores chunk 1 from kvtier: the lookup starts after
    # the local hit (asked from chunk 0 it would find nothing).
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    e = Engine(on_evict(daemon.socket), **LIMITS)
    pool = e.scheduler.kv_cache_manager.block_pool
    a = prompt(1)
    ha = make_request("h", a).block_hashes

    def cached(block: int) -> bool:
        return pool.cached_block_hash_to_block.get_one_block(make_block_hash_with_group_id(ha[block], 0)) is not None

    try:
        run_one(e, "a", a)
        run_one(e, "b", a[:256] + prompt(50, 700))
        i = 2
        while cached(16):
            assert i < 40, "a's chunk 1 never left the GPU"
            # Short fillers (7 blocks each): the look-ahead (18 blocks) never reaches chunk 0.
            run_one(e, f"f{i}", prompt(i, 100))
            i += 1
        assert cached(15), "a's chunk 0 left the GPU too"
        assert present(daemon, e, chunk_keys(a)) == [False, True]
        before = e.totals()
        run_one(e, "a2", a)
        t = e.totals()
        # 256 tokens from vLLM's prefix cache, 256 from kvtier, all checked byte for byte.
        assert e.verified["a2"] == 512
        assert t["hit_tokens"] - before["hit_tokens"] == 256, str(t)
        assert t["load_chunks"] - before["load_chunks"] == 1
    finally:
        e.shutdown()


def test_restore_waits_a_step_for_chunks_it_would_take(daemon: Daemon):
    # A restore allocates its blocks in one go, beyond what a step's token
    # budget allocates: here 32 blocks (2 chunks) against a look-ahead of 18.
    # b's chunk 1 sits within reach of that allocation but beyond the
    # look-ahead: the restore waits one step (vLLM asks again), the chunk is
    # saved in that step, then the restore proceeds; nothing is lost (without
    # the wait, the allocation takes b's chunk 1 unsaved).
    e = Engine(on_evict(daemon.socket), **LIMITS)
    try:
        x = prompt(1)
        run_one(e, "x", x)
        for i in range(2, 6):
            run_one(e, f"f{i}", prompt(i))
        assert present(daemon, e, chunk_keys(x)) == [True, True]
        run_one(e, "b", prompt(9))
        before = e.totals()
        assert present(daemon, e, chunk_keys(prompt(9))) == [False, False]
        run_one(e, "x2", x)
        t = e.totals()
        assert e.verified["x2"] == 512 and t["hit_tokens"] - before["hit_tokens"] == 512
        assert t["evict_lost_chunks"] == 0, str(t)
        # b's chunk 1 (freed first, so nearer the head) was within reach: saved;
        # its chunk 0 is saved too, or still in vLLM's prefix cache.
        got = present(daemon, e, chunk_keys(prompt(9)))
        assert got[1], got
        if not got[0]:
            from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

            h = make_request("h", prompt(9)).block_hashes[15]
            pool = e.scheduler.kv_cache_manager.block_pool
            assert pool.cached_block_hash_to_block.get_one_block(make_block_hash_with_group_id(h, 0)) is not None
    finally:
        e.shutdown()


def expected_chunk(tokens: list[int], chunk: int, rank: int = 0) -> bytes:
    """The payload the connector stores for one chunk of `tokens` (layers, blocks, pages)."""
    import hashlib

    import torch

    from harness import BLOCK_SIZE, NUM_LAYERS, expected_page

    h = hashlib.sha256()
    digests = []
    for t in tokens[: (chunk + 1) * 256]:
        h.update(t.to_bytes(4, "little"))
        digests.append(h.digest())
    out = []
    for layer in range(NUM_LAYERS):
        for b in range(chunk * 16, (chunk + 1) * 16):
            page = torch.stack(
                [expected_page(rank, layer, digests[p], p) for p in range(b * BLOCK_SIZE, (b + 1) * BLOCK_SIZE)], dim=1
            )  # [H, N, C]
            out.append(bytes(page.contiguous().view(torch.uint8).view(-1).numpy()))
    return b"".join(out)


def test_tiny_look_ahead_loses_chunks_but_stores_only_exact_bytes(daemon: Daemon):
    # A look-ahead of one block (smaller than what a step allocates, which the
    # config never allows) lets vLLM hand out tracked blocks before they were
    # chosen: those chunks are lost (counted), and every chunk that was stored
    # holds exactly the bytes of its key.
    from kvtier.client import KvtierClient

    e = Engine(on_evict(daemon.socket), **LIMITS)
    e.connector.scheduler.evict.window = 1
    prompts = {f"r{i}": prompt(i) for i in range(1, 7)}
    try:
        for rid, toks in prompts.items():
            run_one(e, rid, toks)
        t = e.totals()
        record = e.workers[0].worker.record
    finally:
        e.shutdown()
    assert t["evict_lost_chunks"] > 0, str(t)
    assert t["save_chunks"] == t["evict_chunks"] and t["save_failed_chunks"] == 0
    checked = 0
    with KvtierClient(daemon.socket, region_size=1 << 20) as c:
        ns = c.hello(record)
        for toks in prompts.values():
            for chunk, key in enumerate(chunk_keys(toks)):
                got = c.get_bytes(ns, key)
                if got is not None:
                    assert got == expected_chunk(toks, chunk), f"chunk {chunk} stored with wrong bytes"
                    checked += 1
    assert checked == t["save_chunks"]


def test_chunk_whose_blocks_vllm_handed_out_is_never_chosen(daemon: Daemon):
    # vLLM's own pool hands every free block out (evicting a's cached chunks, as
    # an allocation does) and takes them back empty: they sit at the head of the
    # free queue, under the ids the tracker knows a's chunks by. Choosing them
    # now would store whatever the new owner wrote: they must be dropped.
    e = Engine(on_evict(daemon.socket), **LIMITS)
    pool = e.scheduler.kv_cache_manager.block_pool
    ev = e.connector.scheduler.evict
    try:
        run_one(e, "a", prompt(1))
        assert ev.tracked_chunks() == 2 and e.totals()["evict_chunks"] == 0
        blocks = pool.get_new_blocks(pool.get_num_free_blocks())
        pool.free_blocks(blocks)
        ev.window = POOL  # every free block is "next"
        assert ev.select() == []
        t = e.totals()
        assert t["evict_lost_chunks"] == 2 and ev.tracked_chunks() == 0
        for _ in range(5):
            e.step()
        assert e.totals()["save_chunks"] == 0
        assert present(daemon, e, chunk_keys(prompt(1))) == [False, False]
    finally:
        e.shutdown()


def test_gather_not_done_in_the_step_is_dropped(daemon: Daemon):
    # The worker waits in wait_for_save until the step's on-evict gathers are
    # done; past timeout_ms it gives up and the late gather is never PUT (vLLM
    # may be writing those blocks by then).
    import kvtier.vllm.worker as wmod
    from kvtier.client import KvtierClient
    from kvtier.vllm.config import KvtierConfig
    from kvtier.vllm.layout import engine_layout
    from kvtier.vllm.meta import ChunkSave, KvtierMetadata
    from kvtier.vllm.metrics import StatsRecorder
    from kvtier.vllm.worker import KvtierWorker

    cfg = KvtierConfig(socket=daemon.socket, save_policy="on-evict", timeout_ms=200)
    kcc = make_kv_cache_config(64)
    layout = engine_layout(make_vllm_config({}), kcc, cfg)
    stats = StatsRecorder()
    w = KvtierWorker(cfg, layout, SimpleNamespace(parallel_config=SimpleNamespace(rank=0)), True, stats)
    caches = make_kv_caches(kcc)
    for t in caches.values():
        t.view(-1).view(__import__("torch").int16).random_(-30000, 30000)
    slow = threading.Event()
    real_gather = wmod.gather

    def gather(*a, **kw):
        if slow.is_set():
            time.sleep(1.0)  # past timeout_ms
        return real_gather(*a, **kw)

    wmod.gather = gather
    w.register_kv_caches(caches)
    try:
        # A gather done in time: stored, and wait_for_save returned only after it.
        ok = [ChunkSave(b"\x11" * 32, 0, list(range(0, 16)))]
        meta = KvtierMetadata(evict_saves=ok)
        w.handle_preemptions(meta)
        w.start_load_kv(meta)
        w.wait_for_save(meta)
        snapshot = {n: t[0:16].clone() for n, t in caches.items()}
        for t in caches.values():
            t[0:16].zero_()  # vLLM reuses the blocks right after the step
        # A late one: dropped.
        slow.set()
        late = [ChunkSave(b"\x22" * 32, 0, list(range(16, 32)))]
        meta = KvtierMetadata(evict_saves=late)
        w.handle_preemptions(meta)
        w.start_load_kv(meta)
        t0 = time.monotonic()
        w.wait_for_save(meta)
        assert time.monotonic() - t0 < 0.9
        assert w.wait_idle(30)
        t = stats.totals()
        assert t["save_chunks"] == 1 and t["save_dropped_chunks"] == 1, str(t)
        with KvtierClient(daemon.socket, region_size=1 << 20) as c:
            ns = c.hello(w.record)
            assert c.lookup(ns, [b"\x22" * 32]).prefix == 0
            got = c.get_bytes(ns, b"\x11" * 32)
        want = b"".join(bytes(snapshot[n].view(-1).view(__import__("torch").uint8).numpy()) for n in layout.groups[0].layer_names)
        assert got == want
    finally:
        wmod.gather = real_gather
        w.shutdown()
