"""The connector driven by vLLM's real scheduler against a real kvtier daemon."""

from __future__ import annotations

import os
from pathlib import Path


from harness import Daemon, Engine, make_request

PROMPT = [((i * 37) % 997) + 1 for i in range(600)]  # 2 full chunks of 256 tokens + a tail


def run_one(e: Engine, req_id: str, tokens=PROMPT, max_tokens: int = 3) -> None:
    e.add(make_request(req_id, tokens, max_tokens=max_tokens))
    e.run(lambda: req_id in e.finished)
    # The held blocks are released once every worker reported its saves.
    e.run(lambda: req_id not in e.scheduler.requests)


def store(sock: str, extra: dict | None = None, **kw) -> dict:
    e = Engine({"socket": sock, "min_tokens_for_disk": 0, **(extra or {})}, **kw)
    try:
        run_one(e, "store")
        return e.totals()
    finally:
        e.shutdown()


def test_store_restart_lookup_load_byte_exact(daemon: Daemon):
    t = store(daemon.socket)
    assert t["save_chunks"] == 2 and t["save_failed_chunks"] == 0
    # A planned restart: SIGTERM flushes RAM to disk.
    daemon.stop(graceful=True)
    daemon.start()
    e = Engine({"socket": daemon.socket, "min_tokens_for_disk": 0})
    try:
        run_one(e, "again")
        t = e.totals()
        # Both chunks came from the daemon's disk, and were checked byte for byte
        # (Engine verifies every token it did not compute itself).
        assert e.verified["again"] == 512
        assert t["hit_tokens"] == 512 and t["load_chunks"] == 2 and t["load_hit_disk"] == 2
        assert t["load_failed_chunks"] == 0
        # One CLUSTER_LOOKUP for the request, however often vLLM asked.
        assert t["lookups"] == 1 and t["lookup_tokens"] == 512
        # Nothing new to store: the chunks are already there.
        assert t["save_chunks"] == 0
    finally:
        e.shutdown()


def test_size_gate_counts_only_ram_chunks(daemon: Daemon):
    store(daemon.socket)
    daemon.stop(graceful=True)
    daemon.start()  # RAM is empty now: the chunks are on disk only
    e = Engine({"socket": daemon.socket})  # default gate: 32768 tokens
    try:
        run_one(e, "small")
        t = e.totals()
        assert t["hit_tokens"] == 0 and e.verified["small"] == 0
        assert t["gate_skipped_tokens"] == 512
    finally:
        e.shutdown()
    # In RAM (just stored again by the run above? no: the chunks were present, so
    # nothing was re-stored); a fresh store lands in RAM and passes the gate.
    e = Engine({"socket": daemon.socket, "salt": "x"})
    try:
        run_one(e, "ram1")
    finally:
        e.shutdown()
    e = Engine({"socket": daemon.socket, "salt": "x"})
    try:
        run_one(e, "ram2")
        t = e.totals()
        assert t["hit_tokens"] == 512 and t["hit_tokens_ram"] == 512 and t["load_hit_ram"] == 2
        assert e.verified["ram2"] == 512
    finally:
        e.shutdown()


def test_salt_and_layout_fence_namespaces(daemon: Daemon):
    store(daemon.socket)
    for extra in ({"salt": "other"}, {"chunk_blocks": 8}):
        e = Engine({"socket": daemon.socket, "min_tokens_for_disk": 0, **extra})
        try:
            e.add(make_request("x", PROMPT, max_tokens=1))
            e.run(lambda: "x" in e.finished)
            t = e.totals()
            assert t["hit_tokens"] == 0, extra
        finally:
            e.shutdown()


def _flip_payload_byte(data_dir: Path, needle: bytes) -> int:
    """Flips one byte of every stored copy of `needle` under data_dir; returns the count."""
    n = 0
    for root, _, files in os.walk(data_dir):
        for f in files:
            p = Path(root) / f
            b = bytearray(p.read_bytes())
            i = b.find(needle)
            while i >= 0:
                b[i + len(needle) // 2] ^= 0xFF
                n += 1
                i = b.find(needle, i + 1)
            if n:
                p.write_bytes(bytes(b))
    return n


def test_corrupt_chunk_on_disk_is_a_load_error_then_recompute(daemon: Daemon):
    from harness import expected_page
    import hashlib

    store(daemon.socket)
    daemon.stop(graceful=True)
    # The first page of chunk 1 (token 256, layer 0, rank 0) as the daemon stores it.
    h = hashlib.sha256()
    for t in PROMPT[:257]:
        h.update(t.to_bytes(4, "little"))
    # Head 0 of token 256 is 64 contiguous bytes of the page ([H, N, C] per block).
    needle = expected_page(0, 0, h.digest(), 256)[0].contiguous().view(__import__("torch").uint8).numpy().tobytes()
    daemon.start()
    # Corrupt it under the running daemon (its index says "on disk"; RAM is empty),
    # so the failure shows at GET, when the daemon verifies the payload CRC.
    assert _flip_payload_byte(daemon.data, needle) >= 1, "chunk bytes not found on disk"
    e = Engine({"socket": daemon.socket, "min_tokens_for_disk": 0})
    try:
        run_one(e, "c")
        t = e.totals()
        # Chunk 0 restored, chunk 1 refused by the daemon's CRC check: vLLM recomputed it,
        # and the engine's byte check of everything it did not compute passed.
        assert t["load_chunks"] == 1 and t["load_failed_chunks"] == 1
        assert e.verified["c"] in (256, 512)
    finally:
        e.shutdown()


def test_missing_chunk_at_load_time_is_a_load_error(daemon: Daemon):
    from kvtier.client import KvtierClient

    store(daemon.socket)
    e = Engine({"socket": daemon.socket, "min_tokens_for_disk": 0})
    deleted = []

    def evict_second_chunk(so):
        meta = so.kv_connector_metadata
        for loads in meta.loads.values():
            second = [ld for ld in loads if ld.chunk == 1]
            if second and not deleted:
                rec = e.workers[0].worker.record
                with KvtierClient(daemon.socket, region_size=0) as c:
                    ns = c.hello(rec)
                    deleted.extend(c.delete(ns, [second[0].key], group=0))

    e.before_workers = evict_second_chunk
    try:
        run_one(e, "m")
        t = e.totals()
        assert deleted == [True]
        assert t["load_chunks"] == 1 and t["load_failed_chunks"] == 1 and t["load_failed_requests"] == 1
    finally:
        e.shutdown()


def test_daemon_killed_before_load_is_a_load_error(daemon: Daemon):
    store(daemon.socket)
    e = Engine({"socket": daemon.socket, "min_tokens_for_disk": 0})

    def kill(so):
        if so.kv_connector_metadata.loads:
            daemon.stop(graceful=False)

    e.before_workers = kill
    try:
        run_one(e, "k")
        t = e.totals()
        assert t["load_chunks"] == 0 and t["load_failed_requests"] == 1
    finally:
        e.shutdown()


def test_two_ranks_min_over_ranks(daemon: Daemon):
    """Two TP ranks on one daemon: the scheduler loads only what every rank has."""
    from kvtier.client import KvtierClient

    t = store(daemon.socket, tp_size=2)
    assert t["save_chunks"] == 4  # 2 chunks x 2 ranks
    e = Engine({"socket": daemon.socket, "min_tokens_for_disk": 0}, tp_size=2)
    rec1 = e.workers[1].worker.record
    keys = e.connector.layout.chunk_keys(make_request("k", PROMPT).block_hashes, 599)
    with KvtierClient(daemon.socket, region_size=0) as c:
        assert c.delete(c.hello(rec1), [keys[1]], group=0) == [True]
    try:
        run_one(e, "tp")
        t = e.totals()
        # Rank 1 lacks chunk 1, so only chunk 0 is restored, on both ranks.
        assert t["hit_tokens"] == 256 and t["load_chunks"] == 2
        assert e.verified["tp"] == 256
    finally:
        e.shutdown()


def test_two_ranks_on_two_daemons_with_peers(short_tmp):
    """TP=2 across two nodes: each rank stores into its own node's daemon; the
    scheduler's one CLUSTER_LOOKUP on node 1 sees rank 1's chunks on node 2
    (through the peers' availability sync), and min over ranks is right when
    one rank lacks a chunk."""
    import time

    from kvtier.client import KvtierClient

    from harness import start_peered_pair

    d1 = Daemon(short_tmp, "n1")
    d2 = Daemon(short_tmp, "n2")
    try:
        start_peered_pair(d1, d2)
        socks = [d1.socket, d2.socket]
        e = Engine({"socket": d1.socket, "min_tokens_for_disk": 0}, tp_size=2, sockets=socks)
        try:
            run_one(e, "s")
            assert e.totals()["save_chunks"] == 4
            rec0, rec1 = e.workers[0].worker.record, e.workers[1].worker.record
        finally:
            e.shutdown()
        req = make_request("k", PROMPT)  # block hashes 15 and 31 end chunks 0 and 1

        with KvtierClient(d1.socket, region_size=0) as c:
            # Each node holds only its own rank's chunks (rank 1's live on node 2)...
            assert c.lookup(c.hello(rec1), [bytes(req.block_hashes[15])]).locations[0] not in ("ram", "disk")
            # ...and learns the other node's through the availability sync.
            deadline = time.monotonic() + 30
            while True:
                r = c.cluster_lookup(rec0, [0, 1], [bytes(req.block_hashes[15]), bytes(req.block_hashes[31])])
                if r.min_prefix == 2 or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            assert r.min_prefix == 2, r
        e = Engine({"socket": d1.socket, "min_tokens_for_disk": 0}, tp_size=2, sockets=socks)
        try:
            run_one(e, "l")
            t = e.totals()
            assert t["hit_tokens"] == 512 and t["load_chunks"] == 4 and e.verified["l"] == 512
        finally:
            e.shutdown()
        # Rank 1 (node 2) loses chunk 1: node 1's scheduler must offer chunk 0 only.
        with KvtierClient(d2.socket, region_size=0) as c:
            assert c.delete(c.hello(rec1), [bytes(req.block_hashes[31])], group=0) == [True]
        with KvtierClient(d1.socket, region_size=0) as c:
            deadline = time.monotonic() + 30
            while True:
                r = c.cluster_lookup(rec0, [0, 1], [bytes(req.block_hashes[15]), bytes(req.block_hashes[31])])
                if r.min_prefix == 1 or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            assert r.min_prefix == 1, r
        e = Engine({"socket": d1.socket, "min_tokens_for_disk": 0}, tp_size=2, sockets=socks)
        try:
            run_one(e, "m")
            t = e.totals()
            assert t["hit_tokens"] == 256 and e.verified["m"] == 256
        finally:
            e.shutdown()
    finally:
        d1.stop(graceful=False)
        d2.stop(graceful=False)


def test_two_kv_cache_groups_store_restore_and_request_level_failure(daemon: Daemon):
    """HMA layout with two groups: one chunk per group and key; a failure is
    reported per request (`failed_recving`), as vLLM requires with several groups."""
    from kvtier.client import KvtierClient

    t = store(daemon.socket, groups=2)
    assert t["save_chunks"] == 4  # 2 chunks x 2 groups
    e = Engine({"socket": daemon.socket, "min_tokens_for_disk": 0}, groups=2)
    try:
        run_one(e, "g")
        t = e.totals()
        assert t["hit_tokens"] == 512 and t["load_chunks"] == 4 and e.verified["g"] == 512
    finally:
        e.shutdown()
    e = Engine({"socket": daemon.socket, "min_tokens_for_disk": 0}, groups=2)
    keys = e.connector.layout.chunk_keys(make_request("k", PROMPT).block_hashes, 599)

    def evict(so):
        if so.kv_connector_metadata.loads:
            with KvtierClient(daemon.socket, region_size=0) as c:
                assert c.delete(c.hello(e.workers[0].worker.record), [keys[1]], group=1) == [True]

    e.before_workers = evict
    try:
        run_one(e, "h")
        t = e.totals()
        assert t["load_failed_requests"] == 1 and e.verified["h"] == 0
    finally:
        e.shutdown()


def test_local_prefix_hit_is_not_stored_again(daemon: Daemon):
    # The second request finds every full chunk in vLLM's own prefix cache: one
    # lookup says kvtier has them, so nothing is copied again.
    e = Engine({"socket": daemon.socket, "min_tokens_for_disk": 0})
    try:
        run_one(e, "a", PROMPT)
        assert e.totals()["save_chunks"] == 2
        run_one(e, "b", PROMPT[:512] + [5] * 100)
        t = e.totals()
        assert t["save_chunks"] == 2 and t["lookups"] == 2 and t["hit_tokens"] == 0
    finally:
        e.shutdown()
