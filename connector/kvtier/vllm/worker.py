"""Worker side: moves KV pages between this rank's GPU and its own node's daemon.

One instance per rank, on every node. Saves and loads run on two background
threads (each with its own daemon connections, shared-memory staging areas and,
on CUDA, its own stream), so the forward pass is never held: a save waits on
a CUDA event recorded after the step's forward, then gathers, copies to
staging and PUTs; a load GETs into staging and scatters into the request's
blocks while the request waits in WAITING_FOR_REMOTE_KVS. Each direction keeps
up to `save_links` / `load_links` (config keys) requests in flight, one per connection: the
daemon copies a request's chunks on the thread serving its connection (PUT
into freshly allocated memory, page-fault bound), so one connection caps a
direction at one core's copy speed (docs/benchmarks.md, "vLLM connector").

Every rank reports every finished save and load (even when it had nothing to
do, or is disabled), so vLLM's aggregation across workers completes.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtier.vllm.config import KvtierConfig
from kvtier.vllm.daemon import GET_DISK, GET_PEER, GET_RAM, DaemonDown, DaemonLink, RegionRefused
from kvtier.vllm.layout import EngineLayout
from kvtier.vllm.meta import ChunkLoad, ChunkSave, KvtierMetadata
from kvtier.vllm.metrics import StatsRecorder
from kvtier.vllm.staging import Staging, byte_view, gather, scatter

logger = logging.getLogger("kvtier.vllm")

_STOP = object()

#: Longest wait (seconds) of a step that preempts a request for that
#: request's running saves to finish reading its blocks; past it, the rest of
#: those saves is dropped (a future miss) rather than hold the engine.
PREEMPT_WAIT_S = 0.5

#: Pseudo request id of on-evict saves (not a vLLM request: never reported
#: in finished_sending).
EVICT_REQ = "\x00kvtier-evict"


class _Disabled(Exception):
    """The worker disabled itself (a limit check failed) before the job began."""


@dataclass
class _SaveJob:
    req_id: str
    group: int
    chunks: list[ChunkSave]
    event: Any = None
    #: queued -> running -> done, or queued -> cancelled.
    state: str = "queued"
    #: Set when the source blocks may have been reused before the gather finished.
    tainted: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    #: Set once every batch was gathered into staging (or the job gave up): the
    #: source blocks are no longer read after this.
    gathered: threading.Event = field(default_factory=threading.Event)


@dataclass
class _LoadJob:
    req_id: str
    loads: list[ChunkLoad]


def detect_rank(vllm_config: Any, tp_size: int) -> tuple[int | None, str]:
    """This worker's TP rank from the initialized TP group, cross-checked with
    the config; (None, why) when they disagree."""
    cfg_rank = int(getattr(vllm_config.parallel_config, "rank", 0))
    try:
        from vllm.distributed import parallel_state as ps
    except ImportError:
        ps = None  # no vLLM (scripts/gpu-e2e.py): the config's rank is all there is
    try:
        if ps is not None and ps.model_parallel_is_initialized():
            g_rank = int(ps.get_tensor_model_parallel_rank())
            g_size = int(ps.get_tensor_model_parallel_world_size())
            if g_size != tp_size:
                return None, f"TP group has {g_size} ranks, config says tensor_parallel_size={tp_size}"
            if g_rank != cfg_rank % tp_size:
                return None, f"TP group rank {g_rank} != config rank {cfg_rank} (mod {tp_size})"
            return g_rank, "tp-group"
    except Exception as e:  # noqa: BLE001 - an unusable group is a disagreement
        return None, f"cannot read the TP group: {e}"
    if not 0 <= cfg_rank < tp_size:
        return None, f"config rank {cfg_rank} is outside 0..{tp_size}"
    return cfg_rank, "config (TP group not initialized)"


class KvtierWorker:
    """Worker-role logic of `KvtierConnector`."""

    def __init__(self, cfg: KvtierConfig, layout: EngineLayout | None, vllm_config: Any, enabled: bool, stats: StatsRecorder):
        self.cfg = cfg
        self.layout = layout
        self.stats = stats
        self.enabled = enabled and layout is not None
        self.rank: int | None = None
        self.record: dict[str, Any] | None = None
        if self.enabled:
            assert layout is not None
            rank, why = detect_rank(vllm_config, layout.tp_size)
            if rank is None:
                logger.error("kvtier: rank check failed (%s); the connector disables itself on this worker", why)
                self.enabled = False
            else:
                self.rank = rank
                self.record = layout.record_for_rank(rank)
                logger.info("kvtier: worker rank %d (from %s), socket %s", rank, why, cfg.socket)
        self.device: torch.device | None = None
        self._layers: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()  # std lock: short critical sections shared with the I/O threads
        self._pending_saves: dict[str, int] = {}
        self._save_jobs: dict[str, list[_SaveJob]] = {}
        self._finishing: set[str] = set()
        self._seen_finished: set[str] = set()
        self._done_loads: list[tuple[str, bool, set[int]]] = []
        #: Load jobs queued or running, per request: never reported finished
        #: sending meanwhile (vLLM would free blocks the load still writes).
        self._loading: dict[str, int] = {}
        #: The last metadata whose saves `wait_for_save` queued (see get_finished).
        self._saves_queued: KvtierMetadata | None = None
        #: Finished requests vLLM did not hold whose saves are still running:
        #: their bookkeeping goes when the last one ends.
        self._released: set[str] = set()
        self._load_errors: set[int] = set()
        #: on-evict saves of the current step (gathered before wait_for_save returns).
        self._evict_jobs: list[_SaveJob] = []
        self._evict_meta: KvtierMetadata | None = None
        self._threads: list[threading.Thread] = []
        self._save_q: queue.Queue = queue.Queue()
        self._load_q: queue.Queue = queue.Queue()
        #: Save connections (set in register_kv_caches): PUTs of several batches run at
        #: once, one per connection, each from its own share of the staging bytes.
        self._save_links: list[DaemonLink] = []
        self._put_pool: ThreadPoolExecutor | None = None
        self._load_links: list[DaemonLink] = []
        self._get_pool: ThreadPoolExecutor | None = None
        self._staging: dict[int, tuple[Any, Staging]] = {}
        #: Largest chunk of any group, in bytes (set in register_kv_caches).
        self._biggest_chunk = 0
        #: Whether the daemon's limits were checked (`_check_daemon_limits`).
        self._limits_checked = False
        # std lock: taken by the I/O threads around one STATS call, and to log a disable once.
        self._check_lock = threading.Lock()
        #: Profiling only (scripts/gpu-e2e.py --breakdown): when a dict, the I/O threads add
        #: seconds per phase to it and synchronize the device between phases.
        self.timing: dict[str, float] | None = None
        #: Most save connections (PUTs in flight at once); fewer when staging_bytes
        #: cannot give each one a whole chunk. From `save_links` (config); may be
        #: changed before register_kv_caches (scripts/gpu-e2e.py).
        self.save_links = cfg.save_links
        #: Most load connections (GETs in flight at once), likewise (`load_links`).
        self.load_links = cfg.load_links

    # ---- setup -------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Records per-group layer views, checks them against the layout, starts the I/O threads."""
        if not self.enabled:
            return
        layout = self.layout
        assert layout is not None
        try:
            for g in layout.groups:
                views = []
                for name in g.layer_names:
                    if name not in kv_caches:
                        raise ValueError(f"layer {name!r} of group {g.group_id} has no KV cache tensor")
                    t = byte_view(kv_caches[name])
                    if t[0].numel() != g.page_bytes:
                        raise ValueError(
                            f"layer {name!r}: page of {t[0].numel()} bytes, the KV cache spec says {g.page_bytes}"
                        )
                    views.append(t)
                self._layers[g.group_id] = views
            devs = {t.device for vs in self._layers.values() for t in vs}
            if len(devs) != 1:
                raise ValueError(f"KV caches on several devices: {devs}")
            self.device = devs.pop()
        except ValueError as e:
            logger.error("kvtier: %s; the connector disables itself on this worker", e)
            self.enabled = False
            return
        for g in layout.groups:
            if g.chunk_bytes(layout.chunk_blocks) > self.cfg.staging_bytes:
                logger.error(
                    "kvtier: a chunk of group %d is %d bytes, more than staging_bytes=%d; disabled",
                    g.group_id, g.chunk_bytes(layout.chunk_blocks), self.cfg.staging_bytes,
                )
                self.enabled = False
                return
        # The daemon copies each PUT chunk into fresh memory on the thread serving
        # the connection; several connections spread those copies over cores.
        biggest = max(g.chunk_bytes(layout.chunk_blocks) for g in layout.groups)
        links = max(1, min(self.save_links, self.cfg.staging_bytes // biggest))
        self._save_links = [
            DaemonLink(self.cfg.socket, self.cfg.staging_bytes // links, self.cfg.timeout_ms, f"worker saves ({i})")
            for i in range(links)
        ]
        self._put_pool = ThreadPoolExecutor(max_workers=links, thread_name_prefix="kvtier-put")
        links = max(1, min(self.load_links, self.cfg.staging_bytes // biggest))
        self._load_links = [
            DaemonLink(self.cfg.socket, self.cfg.staging_bytes // links, self.cfg.timeout_ms, f"worker loads ({i})")
            for i in range(links)
        ]
        self._get_pool = ThreadPoolExecutor(max_workers=links, thread_name_prefix="kvtier-get")
        self._biggest_chunk = biggest
        self._connect_links()
        if not self.enabled:
            for link in (*self._save_links, *self._load_links):
                link.close()
            return
        for name, q, fn in (("kvtier-save", self._save_q, self._run_save), ("kvtier-load", self._load_q, self._run_load)):
            t = threading.Thread(target=self._loop, args=(q, fn), name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def _connect_links(self) -> None:
        """Connects at start-up, so that a daemon that is down is reported
        then, and checks the daemon's limits; bounded by about one
        `timeout_ms` whatever the number of links (the engine waits for
        this). The first link goes alone: when the daemon does not answer
        (down, or hung), the others connect when first used. Otherwise the
        others connect in parallel."""
        first, *rest = (*self._save_links, *self._load_links)
        try:
            first.namespace(self.record or {})
        except RegionRefused as e:
            self._region_refused(e)
            return
        except DaemonDown:  # warned by the link; checked when it is up
            return
        except Exception as e:  # noqa: BLE001 - connected, then HELLO failed
            # Dropped with a back-off, not left holding a closed client
            # (its first job would fail at once: review).
            first.fail(e)
            return
        errors: list[BaseException] = []

        def connect(link: DaemonLink) -> None:
            try:
                link.namespace(self.record or {})
            except DaemonDown as e:  # warned by the link
                errors.append(e)
            except Exception as e:  # noqa: BLE001
                link.fail(e)
                errors.append(e)

        if rest:
            with ThreadPoolExecutor(max_workers=len(rest), thread_name_prefix="kvtier-connect") as pool:
                list(pool.map(connect, rest))
        refused = [e for e in errors if isinstance(e, RegionRefused)]
        if refused:
            self._region_refused(refused[0])
            return
        self._check_daemon_limits(first)

    def _check_daemon_limits(self, link: DaemonLink) -> bool:
        """Once per worker, on the first link that reaches the daemon (at
        start-up, or in the first job when the daemon was down then): a chunk
        the daemon cannot store (larger than one region of its disk store)
        would be refused on every save, so the worker says so and disables
        itself. False once disabled. Runs on the thread that owns `link`."""
        if self._limits_checked:
            return self.enabled
        with self._check_lock:
            if self._limits_checked:
                return self.enabled
            try:
                v = link.stats().get("max-chunk-bytes")
            except DaemonDown:
                return self.enabled  # asked again on the next job
            except Exception as e:  # noqa: BLE001 - asked again on the next job
                link.fail(e)
                return self.enabled
            self._limits_checked = True
            biggest = self._biggest_chunk
            if isinstance(v, int) and biggest > v:
                logger.error(
                    "kvtier: a chunk is %d bytes, more than the daemon's largest chunk (%d bytes: its "
                    "region-size less headers); raise the daemon's region-size (a disk-budget under 2GiB "
                    "picks small regions) or lower chunk_blocks; the connector disables itself on this worker",
                    biggest, v,
                )
                self.enabled = False
        return self.enabled

    def _region_refused(self, e: RegionRefused) -> None:
        """A link's region is longer than the daemon accepts: a configuration
        error, logged once; the worker disables itself."""
        with self._check_lock:
            if not self.enabled:
                return
            self.enabled = False
        logger.error(
            "kvtier: %s; staging_bytes=%d split over %d save and %d load connections gives each connection "
            "more than the daemon accepts: lower staging_bytes (or raise save_links / load_links); the "
            "connector disables itself on this worker",
            e, self.cfg.staging_bytes, len(self._save_links), len(self._load_links),
        )

    def _staging_for(self, link: DaemonLink) -> Staging:
        # The link keeps its region across a reconnection after a daemon
        # restart; a new one (after a failed call) needs a new staging view.
        region = link.region()
        cur = self._staging.get(id(link))
        if cur is not None and cur[0] is region:
            return cur[1]
        if cur is not None:
            cur[1].close()
        # The old region (if `fail` retired it) is unregistered now: unmapped
        # only after that, so no new region is mapped at an address CUDA
        # still has registered.
        link.release_retired()
        assert self.device is not None
        st = Staging(region, link.region_address(), self.device)
        self._staging[id(link)] = (region, st)
        return st

    def _loop(self, q: queue.Queue, fn: Any) -> None:
        stream = None
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            stream = torch.cuda.Stream(self.device)
        while True:
            job = q.get()
            if job is _STOP:
                return
            try:
                if stream is not None:
                    with torch.cuda.stream(stream):
                        fn(job, stream)
                else:
                    fn(job, None)
            except Exception:  # noqa: BLE001 - a job never kills the thread
                logger.exception("kvtier: I/O job failed unexpectedly")
                # Still report it, or vLLM would wait for this request forever.
                if isinstance(job, _LoadJob):
                    self._finish_load(job.req_id, job.loads, ok_before=-1)
                elif isinstance(job, _SaveJob) and not job.done.is_set():
                    self._save_done(job, dropped=len(job.chunks))

    # ---- per step ----------------------------------------------------------

    def start_load_kv(self, meta: KvtierMetadata) -> None:
        """Queues this step's restores (asynchronous)."""
        self._queue_evict_saves(meta)
        for req_id, loads in meta.loads.items():
            if not self.enabled:
                self._finish_load(req_id, loads, ok_before=-1)
                continue
            with self._lock:
                self._loading[req_id] = self._loading.get(req_id, 0) + 1
            self._load_q.put(_LoadJob(req_id, loads))

    def handle_preemptions(self, meta: KvtierMetadata) -> None:
        """Starts this step's on-evict gathers (vLLM calls this first in a step);
        cancels queued saves of preempted requests; gives running ones a short
        while to finish reading their blocks, then drops what they have not
        gathered yet (this runs on the engine's thread, before the forward)."""
        self._queue_evict_saves(meta)
        deadline = time.monotonic() + min(self.cfg.timeout_ms / 1000.0, PREEMPT_WAIT_S)
        for req_id in meta.preempted:
            with self._lock:
                jobs = list(self._save_jobs.get(req_id, ()))
                for j in jobs:
                    if j.state == "queued":
                        j.state = "cancelled"
            for j in jobs:
                # `gathered`, not `done`: its PUTs need not finish, only its reads
                # of the blocks. A gather checks `tainted` under the lock after it
                # completes, so one still running when this gives up is dropped.
                if j.state == "running" and not j.gathered.wait(max(0.0, deadline - time.monotonic())):
                    with self._lock:
                        j.tainted = True

    def _queue_evict_saves(self, meta: KvtierMetadata) -> None:
        """Queues the step's on-evict saves (once per step, from the first hook that runs).

        Their blocks are free in vLLM's pool: from the next step on vLLM may hand
        them out, zero them or write them. So they are gathered now, ordered after
        every earlier step's writes (an event on the current stream), and
        `wait_for_save` waits until the gather is done; a gather not done by then
        is dropped, never stored.
        """
        if meta is self._evict_meta:
            return
        self._evict_meta = meta
        self._evict_jobs = []
        if not meta.evict_saves:
            return
        if not self.enabled:
            self.stats.add(save_dropped_chunks=len(meta.evict_saves))
            return
        event = None
        if self.device is not None and self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        by_group: dict[int, list[ChunkSave]] = {}
        for c in meta.evict_saves:
            by_group.setdefault(c.group, []).append(c)
        for g, cs in by_group.items():
            job = _SaveJob(EVICT_REQ, g, cs, event)
            with self._lock:
                self._pending_saves[EVICT_REQ] = self._pending_saves.get(EVICT_REQ, 0) + 1
            self._evict_jobs.append(job)
            self._save_q.put(job)

    def _wait_evict_gathered(self) -> None:
        """Waits (bounded by timeout_ms) until the step's on-evict saves left vLLM's blocks."""
        jobs, self._evict_jobs, self._evict_meta = self._evict_jobs, [], None
        deadline = time.monotonic() + self.cfg.timeout_ms / 1000.0
        for j in jobs:
            if not j.gathered.wait(max(0.0, deadline - time.monotonic())):
                with self._lock:
                    # The I/O thread checks this under the lock after each gather, before
                    # its PUT: whatever it gathers from now on may be another request's.
                    j.tainted = True

    def wait_for_save(self, meta: KvtierMetadata) -> None:
        """Queues this step's saves behind an event on the current stream and
        returns; first waits until this step's on-evict saves are gathered."""
        if meta is not self._evict_meta:
            self._queue_evict_saves(meta)  # a runner that called neither earlier hook
        self._wait_evict_gathered()
        with self._lock:
            self._finishing.update(meta.finishing)
            self._saves_queued = meta
        if not meta.saves:
            return
        if not self.enabled:
            for chunks in meta.saves.values():
                self.stats.add(save_dropped_chunks=len(chunks))
            return
        event = None
        if self.device is not None and self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        for req_id, chunks in meta.saves.items():
            by_group: dict[int, list[ChunkSave]] = {}
            for c in chunks:
                by_group.setdefault(c.group, []).append(c)
            for g, cs in by_group.items():
                job = _SaveJob(req_id, g, cs, event)
                with self._lock:
                    self._pending_saves[req_id] = self._pending_saves.get(req_id, 0) + 1
                    self._save_jobs.setdefault(req_id, []).append(job)
                self._save_q.put(job)

    def get_finished(
        self, finished_req_ids: set[str], meta: KvtierMetadata | None = None
    ) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving) since the last call.

        `meta`: the step's bound metadata. With speculative decoding vLLM asks
        for the results before `wait_for_save`, in the only call whose
        `finished_req_ids` name the step's held requests: they are noted here,
        but reported no earlier than the next call, once `wait_for_save` queued
        their final saves (reported now, their blocks went back to vLLM before
        those saves read them)."""
        with self._lock:
            hold: set[str] = set()
            if meta is not None and meta.finishing:
                self._finishing.update(meta.finishing)
                if meta is not self._saves_queued:
                    hold = set(meta.finishing)
            self._seen_finished.update(r for r in finished_req_ids if r in self._finishing)
            sending = {
                r
                for r in self._seen_finished
                if r not in hold and not self._pending_saves.get(r) and not self._loading.get(r)
            }
            for r in sending:
                self._seen_finished.discard(r)
                self._finishing.discard(r)
                self._forget_saves(r)
            # Finished and not held (e.g. aborted during a restore): nothing
            # to report; drop its bookkeeping once its saves are done.
            for r in finished_req_ids:
                if r not in self._finishing and r in self._save_jobs:
                    if self._pending_saves.get(r):
                        self._released.add(r)
                    else:
                        self._forget_saves(r)
            done, self._done_loads = self._done_loads, []
        recving, failed = set(), set()
        multi = self.layout is not None and len(self.layout.groups) > 1
        for req_id, ok, bad_blocks in done:
            recving.add(req_id)
            if ok:
                continue
            self.stats.add(load_failed_requests=1)
            if multi or not bad_blocks:
                # Block ids are per group: vLLM takes request-level failures only.
                failed.add(req_id)
            else:
                self._load_errors |= bad_blocks
        return sending, recving, failed

    def _forget_saves(self, req_id: str) -> None:
        """Drops a request's save bookkeeping (under the lock)."""
        self._pending_saves.pop(req_id, None)
        self._save_jobs.pop(req_id, None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks of the requests just reported as received whose restore failed."""
        out, self._load_errors = self._load_errors, set()
        return out

    # ---- I/O threads -------------------------------------------------------

    def _run_save(self, job: _SaveJob, stream: Any) -> None:
        with self._lock:
            cancelled = job.state == "cancelled"
            if not cancelled:
                job.state = "running"
        if cancelled:
            self._save_done(job, dropped=len(job.chunks))
            return
        layout = self.layout
        assert layout is not None and self.record is not None
        group = next(g for g in layout.groups if g.group_id == job.group)
        cb = layout.chunk_blocks
        size = group.chunk_bytes(cb)
        stored = failed = dropped = 0
        t0 = time.perf_counter()
        try:
            if job.event is not None and stream is not None:
                stream.wait_event(job.event)
            tm = self.timing
            links = self._save_links
            nss = [link.namespace(self.record) for link in links]
            if not self._check_daemon_limits(links[0]):
                raise _Disabled()
            stagings = [self._staging_for(link) for link in links]
            per = max(1, stagings[0].nbytes // size)
            inflight: list[Future | None] = [None] * len(links)
            errors: list[BaseException] = []

            def settle(k: int) -> None:
                nonlocal stored
                f, inflight[k] = inflight[k], None
                if f is None:
                    return
                try:
                    stored += f.result()
                except DaemonDown as e:
                    errors.append(e)
                except Exception as e:  # noqa: BLE001 - reported once below
                    links[k].fail(e)
                    errors.append(e)

            try:
                for slot, i in enumerate(range(0, len(job.chunks), per)):
                    k = slot % len(links)
                    settle(k)  # link k's staging is free again once its PUT returned
                    if errors:
                        # A failed PUT dropped its connection and that link's
                        # region (a daemon that was only slow may still read
                        # it): the rest of the job fails (a future miss).
                        break
                    batch = job.chunks[i : i + per]
                    ids = [b for c in batch for b in c.block_ids]
                    gather(self._layers[job.group], ids, len(batch), cb, stagings[k], timing=tm)
                    t1 = time.perf_counter()
                    if stream is not None:
                        stream.synchronize()
                    if tm is not None:
                        tm["gather_wait"] = tm.get("gather_wait", 0.0) + time.perf_counter() - t1
                    with self._lock:
                        tainted = job.tainted
                    if tainted:
                        dropped += len(job.chunks) - i
                        break
                    entries = [(c.key, j * size, size) for j, c in enumerate(batch)]
                    if tm is not None or self._put_pool is None:
                        # Profiling: one PUT at a time, so that the phases add up.
                        t1 = time.perf_counter()
                        stored += self._put(links[k], nss[k], entries, job.group)
                        if tm is not None:
                            tm["put"] = tm.get("put", 0.0) + time.perf_counter() - t1
                    else:
                        inflight[k] = self._put_pool.submit(self._put, links[k], nss[k], entries, job.group)
            finally:
                job.gathered.set()  # the source blocks are not read any more
                for k in range(len(links)):
                    settle(k)
            failed = len(job.chunks) - stored - dropped
        except _Disabled:
            dropped = len(job.chunks)
        except RegionRefused as e:
            self._region_refused(e)
            dropped = len(job.chunks)
        except DaemonDown:
            failed = len(job.chunks) - stored - dropped
        except Exception as e:  # noqa: BLE001 - a failed save is a future miss
            failed = len(job.chunks) - stored - dropped
            for link in self._save_links:
                link.fail(e)
        self.stats.observe("save_s", time.perf_counter() - t0)
        self.stats.add(save_chunks=stored, save_bytes=stored * size, save_failed_chunks=failed)
        self._save_done(job, dropped=dropped)

    @staticmethod
    def _put(link: DaemonLink, ns: bytes, entries: list[tuple[bytes, int, int]], group: int) -> int:
        """PUTs staged ranges on one connection; returns how many were stored."""
        return sum(1 for ok in link.put(ns, entries, group) if ok)

    def _save_done(self, job: _SaveJob, dropped: int) -> None:
        if dropped:
            self.stats.add(save_dropped_chunks=dropped)
        with self._lock:
            job.state = "done" if job.state != "cancelled" else "cancelled"
            self._pending_saves[job.req_id] = self._pending_saves.get(job.req_id, 1) - 1
            if job.req_id in self._released and not self._pending_saves[job.req_id]:
                self._released.discard(job.req_id)
                self._forget_saves(job.req_id)
        job.gathered.set()
        job.done.set()

    def _run_load(self, job: _LoadJob, stream: Any) -> None:
        layout = self.layout
        assert layout is not None and self.record is not None
        cb = layout.chunk_blocks
        first_bad: int | None = None
        t0 = time.perf_counter()
        loaded_bytes = 0
        hits = {GET_RAM: 0, GET_DISK: 0, GET_PEER: 0}
        try:
            tm = self.timing
            links = self._load_links
            nss = [link.namespace(self.record) for link in links]
            if not self._check_daemon_limits(links[0]):
                raise _Disabled()
            stagings = [self._staging_for(link) for link in links]
            by_group: dict[int, list[ChunkLoad]] = {}
            for ld in job.loads:
                by_group.setdefault(ld.group, []).append(ld)
            for gid, loads in by_group.items():
                group = next(g for g in layout.groups if g.group_id == gid)
                size = group.chunk_bytes(cb)
                per = max(1, stagings[0].nbytes // size)
                batches = [loads[i : i + per] for i in range(0, len(loads), per)]
                # Up to one GET in flight per connection (each into its own staging);
                # results are scattered in order as they come back.
                inflight: list[tuple[int, list[ChunkLoad], Any]] = []

                def submit(slot: int) -> None:
                    k = slot % len(links)
                    batch = [ld for ld in batches[slot] if first_bad is None or ld.chunk < first_bad]
                    if not batch:
                        return
                    entries = [(ld.key, j * size, size) for j, ld in enumerate(batch)]
                    if tm is not None or self._get_pool is None:
                        # Profiling: one GET at a time, so that the phases add up.
                        t1 = time.perf_counter()
                        res = links[k].get(nss[k], entries, gid)
                        if tm is not None:
                            tm["get"] = tm.get("get", 0.0) + time.perf_counter() - t1
                        inflight.append((k, batch, res))
                    else:
                        inflight.append((k, batch, self._get_pool.submit(links[k].get, nss[k], entries, gid)))

                try:
                    nxt = 0
                    while nxt < min(len(links), len(batches)):
                        submit(nxt)
                        nxt += 1
                    while inflight:
                        k, batch, res = inflight.pop(0)
                        statuses = res.result() if isinstance(res, Future) else res
                        if len(statuses) != len(batch):
                            # Never zip short: a chunk without a status was not loaded.
                            raise RuntimeError(f"GET answered {len(statuses)} entries for {len(batch)}")
                        rows: list[int] = []
                        bids: list[int] = []
                        for j, (ld, (status, length)) in enumerate(zip(batch, statuses)):
                            if status not in hits or length != size:
                                first_bad = ld.chunk if first_bad is None else min(first_bad, ld.chunk)
                                continue
                            hits[status] += 1
                            loaded_bytes += size
                            for idx, bid in ld.dst:
                                rows.append(j * cb + idx)
                                bids.append(bid)
                        if rows:
                            scatter(self._layers[gid], len(batch), cb, stagings[k], rows, bids, timing=tm)
                            t1 = time.perf_counter()
                            if stream is not None:
                                stream.synchronize()  # staging k is free again
                            if tm is not None:
                                tm["scatter_wait"] = tm.get("scatter_wait", 0.0) + time.perf_counter() - t1
                        if nxt < len(batches):
                            submit(nxt)
                            nxt += 1
                finally:
                    # No GET may still write a staging area (or use a connection) after this.
                    for _, _, res in inflight:
                        if isinstance(res, Future):
                            try:
                                res.result()
                            except Exception:  # noqa: BLE001 - the first error is handled below
                                pass
        except RegionRefused as e:
            self._region_refused(e)
            first_bad = -1
        except (DaemonDown, _Disabled):
            first_bad = -1
        except Exception as e:  # noqa: BLE001 - a failed load is recomputed by vLLM
            for link in self._load_links:
                link.fail(e)
            first_bad = -1
        if stream is not None:
            stream.synchronize()  # no copy may still be in flight once the load is reported
        self.stats.observe("load_s", time.perf_counter() - t0)
        self.stats.add(
            load_chunks=hits[GET_RAM] + hits[GET_DISK] + hits[GET_PEER],
            load_bytes=loaded_bytes,
            load_hit_ram=hits[GET_RAM],
            load_hit_disk=hits[GET_DISK],
            load_hit_peer=hits[GET_PEER],
        )
        self._finish_load(job.req_id, job.loads, ok_before=first_bad)

    def _finish_load(self, req_id: str, loads: list[ChunkLoad], ok_before: int | None) -> None:
        """Reports a load; `ok_before` is the first failed chunk (-1: all failed, None: none)."""
        bad: set[int] = set()
        if ok_before is not None:
            bad = {bid for ld in loads if ok_before < 0 or ld.chunk >= ok_before for _, bid in ld.dst}
            self.stats.add(load_failed_chunks=len({(ld.chunk, ld.group) for ld in loads if ok_before < 0 or ld.chunk >= ok_before}))
        with self._lock:
            self._done_loads.append((req_id, ok_before is None, bad))
            n = self._loading.pop(req_id, 0) - 1
            if n > 0:
                self._loading[req_id] = n

    # ---- teardown ----------------------------------------------------------

    def wait_idle(self, timeout_s: float) -> bool:
        """Waits until both queues are drained (tests, shutdown)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                busy = any(self._pending_saves.values())
            if not busy and self._save_q.empty() and self._load_q.empty():
                return True
            time.sleep(0.005)
        return False

    def shutdown(self) -> None:
        """Stops the threads (after their current job) and closes the connections."""
        for q in (self._save_q, self._load_q):
            q.put(_STOP)
        for t in self._threads:
            # Until they exit: the links (and their regions) close below,
            # and a job still copying through a region must not see it
            # unmapped (review). Each call a job makes is bounded.
            t.join()
        for _, st in self._staging.values():
            st.close()
        if self._put_pool is not None:
            self._put_pool.shutdown(wait=True)
        for link in self._save_links:
            link.close()
        if self._get_pool is not None:
            self._get_pool.shutdown(wait=True)
        for link in self._load_links:
            link.close()
