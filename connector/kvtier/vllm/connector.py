"""`KvtierConnector`: vLLM's view of kvtier (one instance per role).

    vllm serve MODEL --prefix-caching-hash-algo sha256_cbor --kv-transfer-config \
      '{"kv_connector":"KvtierConnector","kv_connector_module_path":"kvtier.vllm",
        "kv_role":"kv_both","kv_load_failure_policy":"recompute",
        "kv_connector_extra_config":{"socket":"/run/kvtier/kvtier.sock"}}'

The scheduler instance (engine core, head node) plans restores from one
cluster lookup per request and plans saves; the worker instances (one per
rank, every node) move bytes to and from their own node's daemon. See
docs/vllm.md.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.vllm.config import KvtierConfig
from kvtier.vllm.layout import EngineLayout, Unsupported, engine_layout, reproducible
from kvtier.vllm.meta import KvtierMetadata
from kvtier.vllm.metrics import KvtierStats, StatsRecorder
from kvtier.vllm.namespace import record_json
from kvtier.vllm.scheduler import KvtierScheduler
from kvtier.vllm.worker import KvtierWorker

logger = logging.getLogger("kvtier.vllm")


class KvtierConnector(KVConnectorBase_V1, SupportsHMA):
    """A vLLM 0.33 KV connector storing to and restoring from the local kvtier daemon."""

    _cache_hit_source = CacheHitSource.EXTERNAL_UNSPECIFIED

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any):
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = self._kv_transfer_config
        self.cfg = KvtierConfig.from_extra_config(ktc.kv_connector_extra_config)
        self.stats = StatsRecorder()
        self.layout: EngineLayout | None = None
        enabled = True
        try:
            self.layout = engine_layout(vllm_config, kv_cache_config, self.cfg)
        except Unsupported as e:
            logger.warning("kvtier: %s; the connector is a no-op", e)
            enabled = False
        if self.layout is not None and not reproducible(self.layout):
            enabled = False
        if role == KVConnectorRole.SCHEDULER and getattr(ktc, "kv_load_failure_policy", "recompute") != "recompute":
            # A kvtier miss must never fail a request: the scheduler reads this
            # right after building the connector.
            logger.warning(
                "kvtier: kv_load_failure_policy=%r turned into 'recompute' (a failed restore "
                "recomputes instead of failing the request)", ktc.kv_load_failure_policy,
            )
            ktc.kv_load_failure_policy = "recompute"
        if self.layout is not None and enabled:
            logger.info("kvtier: %s namespace %s", role.name.lower(), record_json(self.layout.record))
        self.scheduler: KvtierScheduler | None = None
        self.worker: KvtierWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            sc = vllm_config.scheduler_config
            bs = self.layout.block_size if self.layout is not None else 16
            # Most blocks one step can allocate: its token budget plus one partial block
            # per request, in every KV-cache group (they share the pool).
            ngroups = max(1, len(getattr(kv_cache_config, "kv_cache_groups", None) or ()))
            step_blocks = (-(-int(sc.max_num_batched_tokens) // bs) + int(sc.max_num_seqs)) * ngroups
            self.scheduler = KvtierScheduler(self.cfg, self.layout, enabled, self.stats, step_blocks)
        else:
            self.worker = KvtierWorker(self.cfg, self.layout, vllm_config, enabled, self.stats)

    @property
    def requires_kv_delivery(self) -> bool:
        """A dropped save is a future miss, never lost work."""
        return False

    # ---- worker side -------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Records the per-layer KV views (worker)."""
        assert self.worker is not None
        self.worker.register_kv_caches(kv_caches)

    def _meta(self) -> KvtierMetadata:
        m = self._connector_metadata
        return m if isinstance(m, KvtierMetadata) else KvtierMetadata()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Stops saves of preempted requests before their blocks are reused."""
        if self.worker is not None and isinstance(kv_connector_metadata, KvtierMetadata):
            self.worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Queues the step's restores (asynchronous loads)."""
        assert self.worker is not None
        self.worker.start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are whole-request and asynchronous: nothing to wait for per layer."""
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Saves are whole-chunk, queued in `wait_for_save`."""
        return

    def wait_for_save(self) -> None:
        """Queues the step's saves behind the forward; does not wait for them."""
        assert self.worker is not None
        self.worker.wait_for_save(self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(finished sending, finished receiving)."""
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Saves done for held requests, loads done (failed ones included)."""
        if self.worker is None:
            return KVConnectorTransferResults()
        m = self._connector_metadata
        sending, recving, failed = self.worker.get_finished(
            finished_req_ids, m if isinstance(m, KvtierMetadata) else None
        )
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose restore failed (vLLM recomputes them)."""
        return self.worker.get_block_ids_with_load_errors() if self.worker is not None else set()

    def get_kv_connector_stats(self) -> KvtierStats | None:
        """This interval's counters (scheduler and workers alike)."""
        return self.stats.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvtierStats:
        """Rebuilds stats from their aggregated dict."""
        return KvtierStats(data=data) if data is not None else KvtierStats()

    def shutdown(self) -> None:
        """Stops the I/O threads and closes the daemon connections."""
        if self.worker is not None:
            self.worker.shutdown()
        if self.scheduler is not None:
            self.scheduler.shutdown()

    # ---- scheduler side ----------------------------------------------------

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        """vLLM's GPU block pool: `save_policy: on-evict` watches its free queue."""
        if self.scheduler is not None:
            self.scheduler.bind_gpu_block_pool(gpu_block_pool)

    def on_new_request(self, request: Any) -> None:
        """Starts tracking a request."""
        assert self.scheduler is not None
        self.scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Restorable tokens beyond the local hit (one CLUSTER_LOOKUP, min over ranks)."""
        assert self.scheduler is not None
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Plans the restore into the allocated blocks."""
        assert self.scheduler is not None
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """This step's loads and saves for every worker."""
        assert self.scheduler is not None
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        """Learns which restores failed (aggregated over every worker)."""
        assert self.scheduler is not None
        self.scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Single-group variant of `request_finished_all_groups`."""
        assert self.scheduler is not None
        return self.scheduler.request_finished(request, (block_ids,))

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """Saves the last chunks; True holds the blocks until every worker reports the save done."""
        assert self.scheduler is not None
        return self.scheduler.request_finished(request, block_ids)
