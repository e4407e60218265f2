"""Connector pieces that need vLLM but no daemon: config, version check,
namespace, gathers and scatters over every physical KV layout."""

import pytest
import torch

import kvtier.vllm as kv
from harness import BLOCK_SIZE, Engine, make_kv_cache_config, make_kv_caches, make_vllm_config
from kvtier.vllm.compat import UnsupportedVllm, check_vllm
from kvtier.vllm.config import ConfigError, KvtierConfig
from kvtier.vllm.namespace import hash_algo_is_reproducible
from kvtier.vllm.staging import Staging, byte_view, gather, scatter

# tier::NamespaceRecord's JSON keys (tier/src/types.rs): the daemon refuses others.
RECORD_KEYS = {
    "model", "model-revision", "engine", "engine-version", "tp-size", "rank", "kv-dtype", "block-size",
    "chunk-tokens", "hash-algo", "layout", "format-version", "salt", "info",
}


def test_config_defaults_and_unknown_key():
    c = KvtierConfig.from_extra_config({})
    assert c.min_tokens_for_disk == 32768 and c.save_policy == "prefill-and-finish"
    with pytest.raises(ConfigError, match="min_token_for_disk"):
        KvtierConfig.from_extra_config({"min_token_for_disk": 5})
    with pytest.raises(ConfigError, match="integer"):
        KvtierConfig.from_extra_config({"chunk_blocks": "16"})
    with pytest.raises(ConfigError, match="save_policy"):
        KvtierConfig.from_extra_config({"save_policy": "eager"})


def test_config_on_evict_and_link_keys():
    c = KvtierConfig.from_extra_config({})
    assert (c.save_links, c.load_links, c.evict_watermark) == (8, 8, 0.05)
    c = KvtierConfig.from_extra_config(
        {"save_policy": "on-evict", "evict_watermark": 0.2, "save_links": 2, "load_links": 16}
    )
    assert (c.save_policy, c.evict_watermark, c.save_links, c.load_links) == ("on-evict", 0.2, 2, 16)
    assert KvtierConfig.from_extra_config({"evict_watermark": 1}).evict_watermark == 1.0
    for bad in (0, 0.0, -0.1, 1.5, float("nan")):
        with pytest.raises(ConfigError, match="evict_watermark"):
            KvtierConfig.from_extra_config({"evict_watermark": bad})
    for bad in ("0.1", True, None):
        with pytest.raises(ConfigError, match="evict_watermark must be a number"):
            KvtierConfig.from_extra_config({"evict_watermark": bad})
    for key in ("save_links", "load_links"):
        for bad in (0, -1, 65):
            with pytest.raises(ConfigError, match=key):
                KvtierConfig.from_extra_config({key: bad})
        for bad in (2.0, "8", True):
            with pytest.raises(ConfigError, match="integer"):
                KvtierConfig.from_extra_config({key: bad})


def test_config_refuses_obviously_bad_values(monkeypatch):
    import kvtier.vllm.config as config

    with pytest.raises(ConfigError, match="absolute path"):
        KvtierConfig.from_extra_config({"socket": "kvtier.sock"})
    for key, top in (("timeout_ms", 600_000), ("lookup_timeout_ms", 60_000)):
        assert getattr(KvtierConfig.from_extra_config({key: top}), key) == top
        for bad in (0, top + 1, 10**12):
            with pytest.raises(ConfigError, match=key):
                KvtierConfig.from_extra_config({key: bad})
    monkeypatch.setattr(config, "physical_memory", lambda: 8 << 30)
    assert KvtierConfig.from_extra_config({"staging_bytes": 8 << 30}).staging_bytes == 8 << 30
    with pytest.raises(ConfigError, match="more than this machine's memory"):
        KvtierConfig.from_extra_config({"staging_bytes": 1 << 40})


def test_link_keys_reach_the_worker():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    w = kv.KvtierConnector(make_vllm_config({"socket": "/nonexistent", "save_links": 3, "load_links": 5}),
                           KVConnectorRole.WORKER, make_kv_cache_config())
    try:
        assert (w.worker.save_links, w.worker.load_links) == (3, 5)
    finally:
        w.shutdown()


def test_on_evict_window_and_bound_pool():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvtier.vllm.evict import window_blocks

    assert window_blocks(0.05, 80, 18) == 18 and window_blocks(0.05, 50000, 768) == 2500
    assert window_blocks(0.01, 10, 0) == 1
    # vLLM's scheduler binds its block pool right after building the connector.
    e = Engine({"socket": "/nonexistent", "save_policy": "on-evict"}, num_blocks=1000,
               max_num_batched_tokens=512, max_num_seqs=4)
    try:
        ev = e.connector.scheduler.evict
        assert ev is not None and ev.pool is e.scheduler.kv_cache_manager.block_pool
        assert ev.window == max(50, 512 // 16 + 4)
    finally:
        e.shutdown()
    c = kv.KvtierConnector(make_vllm_config({"socket": "/nonexistent"}), KVConnectorRole.SCHEDULER, make_kv_cache_config())
    assert c.scheduler.evict is None  # prefill-and-finish


def test_connector_refuses_unknown_key_through_vllm():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    vc = make_vllm_config({"sockt": "/x"})
    with pytest.raises(ConfigError, match="sockt"):
        kv.KvtierConnector(vc, KVConnectorRole.WORKER, make_kv_cache_config())


def test_version_check_names_supported_versions(monkeypatch):
    import vllm

    assert check_vllm() == vllm.__version__
    monkeypatch.setattr(vllm, "__version__", "0.32.1")
    monkeypatch.delenv("VLLM_KVTIER_SKIP_VERSION_CHECK", raising=False)
    with pytest.raises(UnsupportedVllm, match=r"supports vLLM 0\.33\.x; this is vLLM 0\.32\.1"):
        check_vllm()


def test_namespace_record_matches_tier_and_fences():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    w0 = kv.KvtierConnector(make_vllm_config({"socket": "/nonexistent"}, tp_size=2, rank=0), KVConnectorRole.WORKER, make_kv_cache_config())
    w1 = kv.KvtierConnector(make_vllm_config({"socket": "/nonexistent", "salt": "s"}, tp_size=2, rank=1), KVConnectorRole.WORKER, make_kv_cache_config())
    r0, r1 = w0.worker.record, w1.worker.record
    assert set(r0) == RECORD_KEYS
    assert r0["rank"] == 0 and r1["rank"] == 1 and r0["tp-size"] == 2
    assert r0["engine"] == "vllm" and r0["hash-algo"] == "sha256_cbor" and r0["kv-dtype"] == "bfloat16"
    assert r0["block-size"] == BLOCK_SIZE and r0["chunk-tokens"] == 16 * BLOCK_SIZE
    assert "page2048" in r0["layout"] and r1["salt"] == "s"
    w0.shutdown()
    w1.shutdown()


def test_unreproducible_hash_disables_the_connector(monkeypatch, caplog):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert not hash_algo_is_reproducible("xxhash")
    assert hash_algo_is_reproducible("xxhash", {"PYTHONHASHSEED": "0"})
    vc = make_vllm_config({"socket": "/nonexistent"}, hash_algo="xxhash")
    with caplog.at_level("WARNING", logger="kvtier.vllm"):
        c = kv.KvtierConnector(vc, KVConnectorRole.SCHEDULER, make_kv_cache_config())
    assert not c.scheduler.enabled
    assert "differ in every process" in caplog.text


def test_rank_disagreement_disables_the_worker(caplog):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    vc = make_vllm_config({"socket": "/nonexistent"}, tp_size=2, rank=5)
    with caplog.at_level("ERROR", logger="kvtier.vllm"):
        c = kv.KvtierConnector(vc, KVConnectorRole.WORKER, make_kv_cache_config())
    assert not c.worker.enabled and "rank check failed" in caplog.text


@pytest.mark.parametrize("use_numpy", [True, False], ids=["numpy", "torch"])
@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC", "LHBNC", "BHLNC", "LBNHC"])
def test_gather_scatter_round_trip_every_layout(layout, use_numpy):
    """Both copy paths (numpy: CPU I/O threads; torch: the CUDA path, run here on CPU)."""
    cfg = make_kv_cache_config(num_blocks=40)
    src = make_kv_caches(cfg, layout)
    for t in src.values():
        t.copy_(torch.randn(t.shape).to(t.dtype))
    dst = make_kv_caches(cfg, layout)
    layers_src = [byte_view(t) for t in src.values()]
    layers_dst = [byte_view(t) for t in dst.values()]
    cb, n = 4, 3
    region = memoryview(bytearray(n * len(layers_src) * cb * layers_src[0][0].numel()))
    st = Staging(region, 0, torch.device("cpu"))
    blocks = [7, 3, 9, 1, 20, 21, 22, 23, 39, 0, 5, 6]
    gather(layers_src, blocks, n, cb, st, use_numpy=use_numpy)
    # Payload order: [chunk][layer][block][page bytes].
    page = layers_src[0][0].numel()
    raw = bytes(region)
    for c in range(n):
        for li, t in enumerate(layers_src):
            for i in range(cb):
                off = ((c * len(layers_src) + li) * cb + i) * page
                assert raw[off : off + page] == t[blocks[c * cb + i]].contiguous().numpy().tobytes()
    targets = [30, 31, 32, 33, 10, 11, 12, 13, 2, 4, 8, 15]
    rows = list(range(n * cb))
    scatter(layers_dst, n, cb, st, rows, targets, use_numpy=use_numpy)
    for a, b in zip(src.values(), dst.values()):
        assert torch.equal(a[blocks].view(torch.uint8), b[targets].view(torch.uint8))
    untouched = [x for x in range(40) if x not in targets]
    for b in dst.values():
        assert not b[untouched].view(torch.uint8).any()


def test_daemon_down_at_start_is_a_no_op(short_tmp, caplog):
    sock = str(short_tmp / "none.sock")
    with caplog.at_level("WARNING", logger="kvtier.vllm"):
        e = Engine({"socket": sock, "min_tokens_for_disk": 0})
    from harness import make_request

    try:
        e.add(make_request("a", list(range(1, 600)), max_tokens=2))
        e.run(lambda: "a" in e.finished)
        t = e.totals()
        assert t["hit_tokens"] == 0 and t["save_chunks"] == 0 and t["lookup_errors"] >= 1
        assert "cannot reach the daemon" in caplog.text
    finally:
        e.shutdown()


def test_model_settings_that_change_kv_bytes_fence_the_namespace():
    """RoPE scaling (hf_overrides) or weight quantization on the same model
    path changes the K/V bytes: another namespace. The same settings give the
    same one in every process."""
    import types

    from vllm.config import ModelConfig

    from kvtier.vllm.layout import engine_layout, model_fingerprint

    def layout_of(vc):
        return engine_layout(vc, make_kv_cache_config(), KvtierConfig.from_extra_config({"socket": "/x"})).record["layout"]

    base = make_vllm_config({"socket": "/x"})
    again = make_vllm_config({"socket": "/x"})
    assert "model-config:" in layout_of(base) and layout_of(base) == layout_of(again)
    scaled = make_vllm_config({"socket": "/x"})
    scaled.model_config = ModelConfig(
        model=base.model_config.model, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=16384, seed=0,
        hf_overrides={"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    )
    assert layout_of(scaled) != layout_of(base)
    hf = base.model_config.hf_text_config
    quantized = types.SimpleNamespace(hf_text_config=hf, quantization="fp8", hf_overrides={})
    plain = types.SimpleNamespace(hf_text_config=hf, quantization=None, hf_overrides={})
    assert model_fingerprint(quantized) != model_fingerprint(plain) == model_fingerprint(base.model_config)
    # A model's constructor changing other fields in a worker (MiniMax-M2 sets
    # max_model_len) must not move the worker's namespace off the scheduler's.
    import copy

    worker_cfg = copy.deepcopy(base.model_config)
    worker_cfg.hf_config.max_model_len = 4096
    worker_cfg.hf_config.projector_hidden_act = "gelu"
    assert model_fingerprint(worker_cfg) == model_fingerprint(base.model_config)


def test_daemon_link_backs_off_on_failed_connects_and_calls(short_tmp):
    """A refused connect is tried again every RETRY_S; one that cost a
    timeout (a hung daemon) waits at least RETRY_S, doubling up to the link's
    bound; failed calls start at FIRST_RETRY_S; counted as failures in a row."""
    import socket
    import time

    from kvtier.vllm.daemon import FIRST_RETRY_S, RETRY_S, DaemonDown, DaemonLink

    link = DaemonLink("/nonexistent/kvtier.sock", 0, 100, "test", max_retry_s=30.0)
    for _ in range(10):
        link._next_try = 0.0
        with pytest.raises(DaemonDown):
            link.client()
        assert RETRY_S - 0.1 <= link._next_try - time.monotonic() <= RETRY_S
    # A listener that never answers: the region's registration times out.
    path = str(short_tmp / "hung.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(64)
    try:
        delays = []
        hung = DaemonLink(path, 1 << 20, 100, "test", max_retry_s=30.0)
        for _ in range(9):
            hung._next_try = 0.0
            with pytest.raises(DaemonDown):
                hung.client()
            delays.append(hung._next_try - time.monotonic())
        assert all(RETRY_S - 0.2 <= d <= 30.0 for d in delays), delays
        assert delays == sorted(delays, key=lambda d: round(d, 1)) and delays[-1] > 29, delays
        worker_link = DaemonLink(path, 1 << 20, 100, "test")
        for _ in range(7):
            worker_link._next_try = 0.0
            with pytest.raises(DaemonDown):
                worker_link.client()
        assert worker_link._next_try - time.monotonic() <= RETRY_S
    finally:
        srv.close()
    calls = DaemonLink("/nonexistent/kvtier.sock", 0, 100, "test", max_retry_s=30.0)
    calls.fail(RuntimeError("timed out"))
    assert calls._next_try - time.monotonic() <= FIRST_RETRY_S
