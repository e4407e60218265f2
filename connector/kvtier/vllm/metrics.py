"""Connector statistics, reported through vLLM's `get_kv_connector_stats`.

vLLM aggregates the stats of the scheduler and every worker and logs
`KV Transfer metrics: ...` each logging interval (see docs/vllm.md, "Is it
working?").
"""

from __future__ import annotations

import threading
from typing import Any

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
except ImportError:  # the worker I/O path runs without vLLM (scripts/gpu-e2e.py)
    from dataclasses import dataclass, field

    @dataclass
    class KVConnectorStats:  # type: ignore[no-redef]
        """Stand-in base when vLLM is not installed."""

        data: dict[str, Any] = field(default_factory=dict)

#: Counters, all summed across workers and intervals.
COUNTERS = (
    # scheduler
    "lookups",  # CLUSTER_LOOKUP calls
    "lookup_errors",  # lookups that failed (daemon down, timeout): counted as misses
    "lookup_tokens",  # tokens asked about beyond the local prefix-cache hit
    "hit_tokens",  # tokens the scheduler decided to load
    "hit_tokens_ram",  # ... of which every rank had in RAM
    "gate_skipped_tokens",  # tokens found on disk/peers but skipped by the size gate
    # worker
    "load_chunks",  # chunks restored
    "load_bytes",
    "load_hit_ram",
    "load_hit_disk",
    "load_hit_peer",
    "load_failed_chunks",  # misses, daemon errors, timeouts: vLLM recomputes
    "load_failed_requests",
    "save_chunks",  # chunks stored
    "save_bytes",
    "save_failed_chunks",  # daemon refused or unreachable
    "save_dropped_chunks",  # cancelled (preemption), not gathered in time (on-evict), connector disabled
    # scheduler, save_policy on-evict
    "evict_chunks",  # cached chunks scheduled for saving as vLLM was about to reuse their blocks
    "evict_lost_chunks",  # tracked chunks whose blocks vLLM reused before they could be saved
)

#: Per-batch latency series (seconds), reduced to avg / max.
SERIES = ("lookup_s", "load_s", "save_s")


class KvtierStats(KVConnectorStats):
    """Counters and latency series of one interval."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        """Zeroes everything."""
        self.data = {k: 0 for k in COUNTERS}
        for s in SERIES:
            self.data[s] = []

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Adds another worker's (or interval's) stats into this one."""
        if other is None or other.is_empty():
            return self
        for k, v in other.data.items():
            if isinstance(v, list):
                self.data.setdefault(k, []).extend(v)
            else:
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        """One line of figures for vLLM's log."""
        out: dict[str, int | float] = {k: self.data.get(k, 0) for k in COUNTERS if self.data.get(k, 0)}
        for s in SERIES:
            xs = self.data.get(s) or []
            if xs:
                out[f"{s}_avg"] = round(sum(xs) / len(xs), 6)
                out[f"{s}_max"] = round(max(xs), 6)
        if self.data.get("load_s") and self.data.get("load_bytes"):
            out["load_GBps"] = round(self.data["load_bytes"] / max(sum(self.data["load_s"]), 1e-9) / 1e9, 3)
        if self.data.get("save_s") and self.data.get("save_bytes"):
            out["save_GBps"] = round(self.data["save_bytes"] / max(sum(self.data["save_s"]), 1e-9) / 1e9, 3)
        return out

    def is_empty(self) -> bool:
        """True when nothing happened."""
        return not any(self.data.get(k) for k in (*COUNTERS, *SERIES))


class StatsRecorder:
    """Thread-safe accumulation; `take()` hands over and resets."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # std lock: held for a dict update only
        self._stats = KvtierStats()
        #: Totals since start (never reset), for tests and `totals()`.
        self._totals: dict[str, Any] = {k: 0 for k in COUNTERS}

    def add(self, **counts: int) -> None:
        """Adds to counters."""
        with self._lock:
            for k, v in counts.items():
                self._stats.data[k] = self._stats.data.get(k, 0) + v
                self._totals[k] = self._totals.get(k, 0) + v

    def observe(self, series: str, seconds: float) -> None:
        """Adds one latency sample."""
        with self._lock:
            self._stats.data.setdefault(series, []).append(seconds)

    def take(self) -> KvtierStats | None:
        """The interval's stats (None if empty), and a fresh interval."""
        with self._lock:
            s, self._stats = self._stats, KvtierStats()
        return None if s.is_empty() else s

    def totals(self) -> dict[str, Any]:
        """Counters since start."""
        with self._lock:
            return dict(self._totals)
