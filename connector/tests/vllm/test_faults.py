"""The connector when the daemon restarts, hangs, comes up late, or refuses
its configuration: the engine never stalls and no save or restore is lost
for longer than it must."""

from __future__ import annotations

import os
import signal
import time
from types import SimpleNamespace

import pytest

from harness import Daemon, Engine, make_kv_cache_config, make_kv_caches, make_request, make_vllm_config
from kvtier.vllm import daemon as daemon_mod
from kvtier.vllm.config import KvtierConfig
from kvtier.vllm.layout import engine_layout
from kvtier.vllm.meta import ChunkSave, KvtierMetadata
from kvtier.vllm.metrics import StatsRecorder
from kvtier.vllm.staging import Staging
from kvtier.vllm.worker import KvtierWorker
from test_daemon import PROMPT, run_one

OTHER = [((i * 53) % 991) + 2 for i in range(600)]


def _worker(cfg: KvtierConfig, blocks: int = 64) -> tuple[KvtierWorker, object, StatsRecorder]:
    kcc = make_kv_cache_config(blocks)
    layout = engine_layout(make_vllm_config({}), kcc, cfg)
    stats = StatsRecorder()
    w = KvtierWorker(cfg, layout, SimpleNamespace(parallel_config=SimpleNamespace(rank=0)), True, stats)
    return w, kcc, stats


def test_a_restarted_daemon_loses_no_save_and_no_restore(daemon: Daemon):
    """After a clean restart every link still holds a connection the old
    daemon closed: the first call on each is sent again on a new connection
    (PUT and GET are idempotent) instead of failing."""
    e = Engine({"socket": daemon.socket, "min_tokens_for_disk": 0, "save_links": 2, "load_links": 2})
    try:
        run_one(e, "warm")
        assert e.totals()["save_chunks"] == 2
        daemon.stop(graceful=True)
        daemon.start()
        before = e.totals()
        run_one(e, "new", OTHER)
        t = e.totals()
        assert t["save_chunks"] - before["save_chunks"] == 2
        assert t["save_failed_chunks"] == before["save_failed_chunks"] == 0
        assert t["lookup_errors"] == 0
        # The same engine restores the first prompt from the restarted daemon.
        e.scheduler.reset_prefix_cache()
        run_one(e, "again")
        t = e.totals()
        assert t["load_chunks"] == 2 and t["load_failed_chunks"] == 0
        assert e.verified["again"] == 512
    finally:
        e.shutdown()


def test_start_up_with_a_hung_daemon_takes_about_one_timeout(daemon: Daemon):
    """A stopped (not dead) daemon accepts connections and never answers:
    the worker's start-up waits for one link, not for every one in turn."""
    cfg = KvtierConfig(socket=daemon.socket, timeout_ms=400)
    w, kcc, _ = _worker(cfg)
    assert daemon.proc is not None
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        w.register_kv_caches(make_kv_caches(kcc))
        took = time.monotonic() - t0
        # 8 save + 8 load links one after another would take 16 timeouts (6.4 s).
        assert took < 2.0, took
        assert w.enabled
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
        w.shutdown()


def test_a_chunk_too_large_is_found_when_the_daemon_comes_up_late(short_tmp, caplog, monkeypatch):
    """The size check that a worker runs at start-up runs at its first
    connection when the daemon was down then."""
    monkeypatch.setattr(daemon_mod, "RETRY_S", 0.1)
    d = Daemon(short_tmp, "late", ["--region-size", "1MiB", "--disk-budget", "8MiB"])
    cfg = KvtierConfig(socket=d.socket, chunk_blocks=256)
    w, kcc, stats = _worker(cfg, 512)
    try:
        w.register_kv_caches(make_kv_caches(kcc))  # the daemon is down: nothing checked yet
        assert w.enabled
        d.start()
        time.sleep(0.2)  # past the link's retry delay
        with caplog.at_level("ERROR", logger="kvtier.vllm"):
            w.wait_for_save(KvtierMetadata(saves={"a": [ChunkSave(b"\x01" * 32, 0, list(range(256)))]}))
            assert w.wait_idle(30)
        assert not w.enabled
        assert caplog.text.count("more than the daemon's largest chunk") == 1
        t = stats.totals()
        assert t["save_chunks"] == 0 and t["save_dropped_chunks"] == 1
    finally:
        w.shutdown()
        d.stop(graceful=False)


def test_a_region_the_daemon_refuses_is_a_configuration_error(daemon: Daemon, caplog):
    """A staging share above the daemon's max-region (64 GiB) is refused at
    every connection: logged once as a configuration error, the worker off,
    no retries. (The config's own check, staging_bytes at most this machine's
    RAM, is bypassed here: the dataclass is built directly.)"""
    cfg = KvtierConfig(socket=daemon.socket, staging_bytes=65 << 30, save_links=1, load_links=1)
    w, kcc, _ = _worker(cfg)
    try:
        with caplog.at_level("WARNING", logger="kvtier.vllm"):
            w.register_kv_caches(make_kv_caches(kcc))
        assert not w.enabled
        assert caplog.text.count("refuses a shared-memory region") == 1, caplog.text
        assert "(max-region)" in caplog.text
        assert "lower staging_bytes" in caplog.text and "cannot reach the daemon" not in caplog.text
        link = w._save_links[0]
        assert link.refused is not None
        with pytest.raises(daemon_mod.RegionRefused):
            link.client()  # at once, without asking the daemon again
    finally:
        w.shutdown()


def test_a_restore_that_failed_partway_stores_the_lost_chunk_again(daemon: Daemon):
    """The lookup counted chunk 1 present; it is gone by the GET: vLLM
    recomputes it, and the connector stores it again."""
    from kvtier.client import KvtierClient

    from test_daemon import store

    store(daemon.socket)
    e = Engine({"socket": daemon.socket, "min_tokens_for_disk": 0})
    keys: list[bytes] = []

    def evict_second_chunk(so):
        for loads in so.kv_connector_metadata.loads.values():
            second = [ld for ld in loads if ld.chunk == 1]
            if second and not keys:
                keys.append(second[0].key)
                with KvtierClient(daemon.socket, region_size=0) as c:
                    assert c.delete(c.hello(e.workers[0].worker.record), keys, group=0) == [True]

    e.before_workers = evict_second_chunk
    try:
        run_one(e, "m")
        t = e.totals()
        assert t["load_chunks"] == 1 and t["load_failed_chunks"] == 1
        assert t["save_chunks"] == 1  # chunk 1, from the recomputed bytes
        with KvtierClient(daemon.socket, region_size=0) as c:
            assert c.lookup(c.hello(e.workers[0].worker.record), keys).prefix == 1
    finally:
        e.shutdown()
    # A fresh engine restores both chunks, byte for byte.
    e = Engine({"socket": daemon.socket, "min_tokens_for_disk": 0})
    try:
        run_one(e, "n")
        assert e.totals()["load_chunks"] == 2 and e.verified["n"] == 512
    finally:
        e.shutdown()


def test_with_load_off_a_prompt_is_stored_once(daemon: Daemon):
    """`load: false` restores nothing, but a request still asks which chunks
    kvtier has: the same prompt again stores nothing new (it stored every
    chunk again: QA)."""
    e = Engine({"socket": daemon.socket, "min_tokens_for_disk": 0, "load": False})
    try:
        run_one(e, "first")
        assert e.totals()["save_chunks"] == 2
        e.scheduler.reset_prefix_cache()
        run_one(e, "second")
        t = e.totals()
        assert t["save_chunks"] == 2, t
        assert t["load_chunks"] == 0 and t["hit_tokens"] == 0, t
    finally:
        e.shutdown()


def test_a_failed_links_region_stays_mapped_until_its_staging_is_dropped(daemon: Daemon):
    """After a failed call the link drops its region but keeps it mapped
    (retired) until the worker has unregistered its staging view: a new
    region mapped at a still-registered address would be copied through the
    old pinned pages (review)."""
    link = daemon_mod.DaemonLink(daemon.socket, 1 << 20, 5000, "test")
    try:
        link.client()
        old = link._region
        address = link.region_address()
        link.fail(RuntimeError("a call timed out"))
        assert link.retired == [old] and old.fd >= 0, "unmapped while maybe registered"
        link._next_try = 0.0
        link.client()
        assert link._region is not old and link.region_address() != address
        link.release_retired()
        assert link.retired == [] and old.fd < 0
    finally:
        link.close()


def test_the_worker_unregisters_a_retired_region_before_it_is_unmapped(daemon: Daemon, monkeypatch):
    cfg = KvtierConfig(socket=daemon.socket, save_links=1, load_links=1)
    w, kcc, _ = _worker(cfg)
    order: list[str] = []
    monkeypatch.setattr(Staging, "close", lambda self: order.append("unregister"))
    try:
        w.register_kv_caches(make_kv_caches(kcc))
        link = w._save_links[0]
        w._staging_for(link)
        old = link._region
        link.fail(RuntimeError("a call timed out"))
        link._next_try = 0.0
        real_close = type(old).close
        monkeypatch.setattr(type(old), "close", lambda self: (order.append("unmap"), real_close(self)))
        w._staging_for(link)
        assert order[:2] == ["unregister", "unmap"], order
        assert old.fd < 0
    finally:
        w.shutdown()
