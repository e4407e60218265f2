"""KvtierWorker on its own against a real daemon: preemption cancels saves."""

import threading
from types import SimpleNamespace

from harness import Daemon, make_kv_cache_config, make_kv_caches, make_vllm_config
from kvtier.vllm.config import KvtierConfig
from kvtier.vllm.layout import engine_layout
from kvtier.vllm.meta import ChunkSave, KvtierMetadata
from kvtier.vllm.metrics import StatsRecorder
from kvtier.vllm.worker import KvtierWorker


def test_preemption_cancels_queued_saves(daemon: Daemon):
    from kvtier.client import KvtierClient

    cfg = KvtierConfig(socket=daemon.socket)
    kcc = make_kv_cache_config(64)
    layout = engine_layout(make_vllm_config({}), kcc, cfg)
    stats = StatsRecorder()
    w = KvtierWorker(cfg, layout, SimpleNamespace(parallel_config=SimpleNamespace(rank=0)), True, stats)
    gate = threading.Event()
    real = w._run_save

    def held(job, stream):
        gate.wait(30)  # the saver is busy until released
        real(job, stream)

    w._run_save = held  # before register_kv_caches starts the saver thread
    w.register_kv_caches(make_kv_caches(kcc))
    first = [ChunkSave(b"\x01" * 32, 0, list(range(0, 16)))]
    victim = [ChunkSave(b"\x02" * 32, 0, list(range(16, 32))), ChunkSave(b"\x03" * 32, 0, list(range(32, 48)))]
    try:
        w.wait_for_save(KvtierMetadata(saves={"a": first}))
        w.wait_for_save(KvtierMetadata(saves={"b": victim}))
        w.handle_preemptions(KvtierMetadata(preempted=["b"]))
        gate.set()
        assert w.wait_idle(30)
        t = stats.totals()
        assert t["save_chunks"] == 1 and t["save_dropped_chunks"] == 2
        with KvtierClient(daemon.socket, region_size=0) as c:
            ns = c.hello(w.record)
            assert c.lookup(ns, [b"\x01" * 32]).prefix == 1
            assert c.lookup(ns, [b"\x02" * 32]).prefix == 0
    finally:
        gate.set()
        w.shutdown()


def test_a_chunk_larger_than_the_daemons_regions_disables_the_worker(short_tmp, caplog):
    # 1 MiB regions hold a little less than 1 MiB chunks (256 blocks of the
    # test layout's 4 KiB).
    d = Daemon(short_tmp, "small", ["--region-size", "1MiB", "--disk-budget", "8MiB"]).start()
    try:
        cfg = KvtierConfig(socket=d.socket, chunk_blocks=256)
        kcc = make_kv_cache_config(512)
        layout = engine_layout(make_vllm_config({}), kcc, cfg)
        w = KvtierWorker(cfg, layout, SimpleNamespace(parallel_config=SimpleNamespace(rank=0)), True, StatsRecorder())
        with caplog.at_level("ERROR"):
            w.register_kv_caches(make_kv_caches(kcc))
        assert not w.enabled
        assert "more than the daemon's largest chunk" in caplog.text
        w.shutdown()
    finally:
        d.stop(graceful=False)
