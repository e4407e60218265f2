"""Scheduler side: one CLUSTER_LOOKUP per request, load and save plans.

Runs in vLLM's engine-core process on the head node and talks only to that
node's daemon, which answers for every rank from its cluster-wide
availability map (min over ranks). It never moves KV bytes itself.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from kvtier.vllm.config import KvtierConfig
from kvtier.vllm.daemon import DaemonDown, DaemonLink
from kvtier.vllm.evict import EvictTracker
from kvtier.vllm.layout import EngineLayout
from kvtier.vllm.meta import ChunkLoad, ChunkSave, KvtierMetadata
from kvtier.vllm.metrics import StatsRecorder

logger = logging.getLogger("kvtier.vllm")


@dataclass
class _Req:
    request: Any
    #: Local prefix-cache hit passed to the last get_num_new_matched_tokens.
    local_tokens: int = 0
    #: Cached lookup: (ask, loadable chunks, present chunks), where the ask is
    #: (number of keys, first chunk asked, the request's preemptions so far).
    lookup: tuple[tuple[int, int, int], int, int] | None = None
    #: When it was asked (time.monotonic): reused for LOOKUP_TTL_S at most.
    lookup_at: float = 0.0
    #: The ask whose tokens the stats counted: a refreshed lookup of the same
    #: ask is not counted again.
    counted: tuple[int, int, int] | None = None
    #: Chunks known stored on every rank or already scheduled for a save.
    stored_chunks: int = 0
    #: Whether any save was ever scheduled (the blocks must then be held at finish).
    saved_any: bool = False
    #: Prefill still running (saves happen only then, and at finish).
    prefill_open: bool = True
    #: The request's block ids per group, as the scheduler hands them out.
    block_ids: list[list[int]] = field(default_factory=list)
    #: Blocks of the restore in flight (to spot its failure in the workers' output).
    loading_blocks: set[int] = field(default_factory=set)
    #: Chunk index (and key) of each block of the restore in flight: a failed
    #: restore stores again from its first failed chunk.
    loading_chunks: dict[int, tuple[int, bytes]] = field(default_factory=dict)
    #: Blocks of the restore in flight that a rank reported invalid (in any
    #: step before every rank reported the restore finished).
    failed_blocks: set[int] = field(default_factory=set)
    #: A restore failed: never offer one again for this request (vLLM recomputes).
    load_failed: bool = False
    #: on-evict: keys of the chunks this request's blocks were tracked under.
    tracked: list[bytes] = field(default_factory=list)
    #: The request's preemptions handled so far (`_note_preemption`).
    preemptions: int = 0


#: Seconds a request's lookup answer is reused while it waits (vLLM asks again
#: every step until it is scheduled): chunks saved or evicted meanwhile are
#: seen after this. A preempted request always asks again.
LOOKUP_TTL_S = 1.0


class KvtierScheduler:
    """Scheduler-role logic of `KvtierConnector`."""

    def __init__(self, cfg: KvtierConfig, layout: EngineLayout | None, enabled: bool, stats: StatsRecorder,
                 step_blocks: int = 0):
        self.cfg = cfg
        self.layout = layout
        self.enabled = enabled and layout is not None
        self.stats = stats
        self._reqs: dict[str, _Req] = {}
        self._pending_loads: dict[str, list[ChunkLoad]] = {}
        self._final_saves: dict[str, list[ChunkSave]] = {}
        self._finishing: list[str] = []
        # Lookups run on the engine's thread: a hung daemon is tried at most
        # every 30 s (after 0.2, 0.4, ... s), not every 0.2 s.
        self._link = DaemonLink(cfg.socket, 0, cfg.lookup_timeout_ms, "scheduler lookups", max_retry_s=30.0)
        #: save_policy on-evict: the cached chunks not stored yet (None: prefill-and-finish).
        self.evict: EvictTracker | None = None
        if self.enabled and cfg.save_policy == "on-evict" and layout is not None:
            per_chunk = sum(g.chunk_bytes(layout.chunk_blocks) for g in layout.groups)
            self.evict = EvictTracker(layout, cfg.evict_watermark, step_blocks, cfg.staging_bytes // per_chunk, stats)
        if self.enabled:
            try:
                self._link.client()
            except DaemonDown:
                pass  # warned once; lookups miss until it is up

    # ---- lookups -----------------------------------------------------------

    def _state(self, request: Any) -> _Req:
        st = self._reqs.get(request.request_id)
        if st is None or st.request is not request:
            st = _Req(request=request)
            self._reqs[request.request_id] = st
        return st

    def on_new_request(self, request: Any) -> None:
        """Starts tracking a request."""
        if self.enabled:
            self._state(request)

    def bind_gpu_block_pool(self, pool: Any) -> None:
        """vLLM's GPU block pool (on-evict watches its free queue)."""
        if self.evict is not None:
            self.evict.bind(pool)

    @staticmethod
    def _ask(st: _Req, keys: list[bytes], first: int) -> tuple[int, int, int]:
        """What a lookup answers: the keys (their count: a request's keys only
        grow), the first chunk asked, and the request's preemptions so far
        (after one, its own saves may be what restores it)."""
        return len(keys), first, getattr(st.request, "num_preemptions", 0)

    def _lookup(self, st: _Req, keys: list[bytes], first: int = 0) -> tuple[int, int]:
        """(loadable chunks after the size gate, chunks present on every rank), asking
        only from chunk `first` on: the chunks before it count as present. A cached
        answer to the same ask is reused for LOOKUP_TTL_S."""
        ask = self._ask(st, keys, first)
        if st.lookup is not None and st.lookup[0] == ask and time.monotonic() - st.lookup_at < LOOKUP_TTL_S:
            return st.lookup[1], st.lookup[2]
        assert self.layout is not None
        layout = self.layout
        ranks = list(range(layout.tp_size))
        gate = st.request.num_prompt_tokens < self.cfg.min_tokens_for_disk
        loadable = present = len(keys)
        asked = keys[first:]
        t0 = time.perf_counter()
        try:
            for g in layout.groups:
                mn, per = self._link.cluster_lookup(layout.record, ranks, asked, g.group_id)
                if {p.rank for p in per} != set(ranks):
                    raise RuntimeError(f"cluster lookup answered ranks {[p.rank for p in per]}, asked {ranks}")
                mn = min([mn] + [p.prefix for p in per])
                ram = min(p.ram_prefix for p in per)
                present = min(present, first + mn)
                loadable = min(loadable, first + (min(ram, mn) if gate else mn))
        except DaemonDown:
            self.stats.add(lookup_errors=1)
            return 0, 0
        except Exception as e:  # noqa: BLE001 - a failed lookup is a miss
            self.stats.add(lookup_errors=1)
            self._link.fail(e)
            return 0, 0
        self.stats.observe("lookup_s", time.perf_counter() - t0)
        self.stats.add(lookups=1)
        loadable = max(0, min(loadable, len(keys)))
        st.lookup = (ask, loadable, max(0, min(present, len(keys))))
        st.lookup_at = time.monotonic()
        if self.evict is not None:
            self.evict.mark_stored(keys[first : st.lookup[2]])
        return st.lookup[1], st.lookup[2]

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens loadable beyond the local hit (chunk-aligned, min over ranks); loads are async."""
        if not self.enabled:
            return 0, False
        layout = self.layout
        assert layout is not None
        st = self._state(request)
        self._note_preemption(st)
        if not self.cfg.load:
            # Nothing is restored, but prefill-and-finish asks which chunks
            # kvtier has so that it stores only the missing ones (it stored
            # every chunk of every request again: QA).
            keys = layout.chunk_keys(request.block_hashes, request.num_tokens - 1)
            if keys and self.evict is None and self.cfg.store:
                _, present = self._lookup(st, keys)
                st.stored_chunks = max(st.stored_chunks, present)
            return 0, False
        if st.load_failed:
            return 0, False
        st.local_tokens = num_computed_tokens
        # vLLM must compute at least the last token itself.
        keys = layout.chunk_keys(request.block_hashes, request.num_tokens - 1)
        if len(keys) * layout.chunk_tokens <= num_computed_tokens:
            if keys and self.evict is None and self.cfg.store:
                # Nothing to restore, but ask which chunks kvtier has, so that
                # prefill-and-finish stores again only the missing ones (not
                # every chunk vLLM found in its own prefix cache).
                _, present = self._lookup(st, keys)
                st.stored_chunks = max(st.stored_chunks, present)
            return 0, False
        # on-evict stores only what leaves the GPU, so the chunks of a local
        # prefix-cache hit may well be missing from kvtier: ask from the first
        # chunk the local hit does not cover. prefill-and-finish asks from chunk
        # 0, so that chunks kvtier lost are stored again from the local copy.
        first = num_computed_tokens // layout.chunk_tokens if self.evict is not None else 0
        ask = self._ask(st, keys, first)
        loadable, present = self._lookup(st, keys, first)
        if st.counted != ask:
            # Once per ask: a request that waits asks again every second.
            st.counted = ask
            self.stats.add(lookup_tokens=len(keys) * layout.chunk_tokens - num_computed_tokens)
            if present > loadable:  # the size gate held back what only the disk has
                self.stats.add(gate_skipped_tokens=(present - loadable) * layout.chunk_tokens)
        st.stored_chunks = max(st.stored_chunks, present)
        hit = loadable * layout.chunk_tokens
        if hit <= num_computed_tokens:
            return 0, False
        if self.evict is not None and not self.evict.reserve(-(-(hit - num_computed_tokens) // layout.block_size)):
            return None, False  # the blocks it would take hold unsaved chunks: next step
        return hit - num_computed_tokens, True

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Plans the restore of the tokens the scheduler accepted."""
        if not self.enabled:
            return
        st = self._state(request)
        st.block_ids = [list(b) for b in blocks.get_block_ids()]
        if num_external_tokens <= 0:
            return
        layout = self.layout
        assert layout is not None
        start = st.local_tokens
        end = start + num_external_tokens
        bs, cb, ct = layout.block_size, layout.chunk_blocks, layout.chunk_tokens
        keys = layout.chunk_keys(request.block_hashes, end)
        first_block, end_block = start // bs, end // bs
        loads: list[ChunkLoad] = []
        for c in range(start // ct, (end + ct - 1) // ct):
            if c >= len(keys):
                break
            for g in layout.groups:
                bids = st.block_ids[g.group_id]
                dst = [
                    (i, bids[c * cb + i])
                    for i in range(cb)
                    if first_block <= c * cb + i < end_block and c * cb + i < len(bids)
                ]
                if dst:
                    loads.append(ChunkLoad(key=keys[c], group=g.group_id, chunk=c, dst=dst))
        if loads:
            self._pending_loads.setdefault(request.request_id, []).extend(loads)
            st.loading_blocks = {bid for ld in loads for _, bid in ld.dst}
            st.loading_chunks = {bid: (ld.chunk, ld.key) for ld in loads for _, bid in ld.dst}
            self.stats.add(hit_tokens=num_external_tokens)
            if request.num_prompt_tokens < self.cfg.min_tokens_for_disk:
                self.stats.add(hit_tokens_ram=num_external_tokens)
        st.stored_chunks = max(st.stored_chunks, end // ct)

    def update_connector_output(self, output: Any) -> None:
        """Notes failed restores, so that a request is never offered the same failing load twice."""
        if not self.enabled:
            return
        failed = set(output.failed_recving or ())
        invalid = set(output.invalid_block_ids or ())
        if invalid:
            # vLLM acts on invalid blocks in the step they arrive (it
            # truncates the request and may ask again at once), while it
            # lists the request finished only once every rank reported: a
            # rank that failed fast and one a step slower split the two
            # (review: with TP 2 the failure went unnoticed, the lost chunks
            # were never stored again, and a request whose first chunk
            # failed was offered the same restore again and again).
            for st in self._reqs.values():
                hit = st.loading_blocks & invalid
                if hit:
                    st.load_failed = True
                    st.failed_blocks |= hit
        for req_id in output.finished_recving or ():
            st = self._reqs.get(req_id)
            if st is None:
                continue
            if req_id in failed or st.failed_blocks:
                st.load_failed = True
                # vLLM recomputes from the first failed block on: those chunks
                # are stored again from the recomputed bytes (the lookup had
                # counted them present; the daemon lost them since, or a rank
                # failed to read them). PUT of a chunk the daemon still has
                # stores the same bytes again: harmless.
                bad = st.loading_blocks if req_id in failed else st.failed_blocks
                if bad:
                    first = min(st.loading_chunks[b][0] for b in bad if b in st.loading_chunks)
                    st.stored_chunks = min(st.stored_chunks, first)
                    if self.evict is not None:
                        self.evict.forget_stored([k for c, k in st.loading_chunks.values() if c >= first])
            st.loading_blocks = set()
            st.loading_chunks = {}
            st.failed_blocks = set()

    # ---- saves -------------------------------------------------------------

    def _save_chunks(self, st: _Req, upto_tokens: int, block_ids: list[list[int]]) -> list[ChunkSave]:
        layout = self.layout
        assert layout is not None
        keys = layout.chunk_keys(st.request.block_hashes, upto_tokens)
        cb = layout.chunk_blocks
        out: list[ChunkSave] = []
        for c in range(st.stored_chunks, len(keys)):
            chunk: list[ChunkSave] = []
            for g in layout.groups:
                bids = block_ids[g.group_id] if g.group_id < len(block_ids) else []
                if len(bids) < (c + 1) * cb:
                    return out
                chunk.append(ChunkSave(key=keys[c], group=g.group_id, block_ids=list(bids[c * cb : (c + 1) * cb])))
            out.extend(chunk)
            st.stored_chunks = c + 1
        if out:
            st.saved_any = True
        return out

    def build_connector_meta(self, scheduler_output: Any) -> KvtierMetadata:
        """This step's loads, saves, finished holds and preemptions; resets step state."""
        meta = KvtierMetadata()
        if not self.enabled:
            return meta
        meta.loads, self._pending_loads = self._pending_loads, {}
        meta.saves, self._final_saves = self._final_saves, {}
        meta.finishing, self._finishing = self._finishing, []
        meta.preempted = sorted(scheduler_output.preempted_req_ids or ())
        if not self.cfg.store:
            return meta
        for req_id in meta.preempted:
            st = self._reqs.get(req_id)
            if st is not None:
                self._note_preemption(st)
        self._plan_step(meta, scheduler_output)
        if self.evict is not None:
            # vLLM allocated this step's blocks already: the head of its free
            # queue is what the next steps hand out.
            meta.evict_saves = self.evict.select()
        return meta

    def _note_preemption(self, st: _Req) -> None:
        """Once per preemption of the request, the first time it is seen (its
        resume's lookup, or the step's preempted list, whichever comes first):
        the workers drop its saves not done yet (its blocks go to others), so
        what it planned is not known stored any more. The lookup at its resume
        says what is, and its recompute saves the rest (review: the dropped
        chunks were never saved again, a miss for every later request). Done
        at the step's list alone, it undid the lookup of a request preempted
        and resumed in one `schedule()`, which then saved its restored chunks
        again (second review)."""
        n = getattr(st.request, "num_preemptions", 0)
        if n == st.preemptions:
            return
        st.preemptions = n
        if self.evict is None:
            st.stored_chunks = 0
            st.prefill_open = True

    def _plan_step(self, meta: KvtierMetadata, scheduler_output: Any) -> None:
        sched = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:
                continue
            st.block_ids = [list(b) for b in new.block_ids]
            self._plan_prefill_saves(meta, st, new.num_computed_tokens + sched.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if req_id in cached.resumed_req_ids:
                    st.block_ids = [list(b) for b in new_ids]
                else:
                    while len(st.block_ids) < len(new_ids):
                        st.block_ids.append([])
                    for g, b in enumerate(new_ids):
                        st.block_ids[g].extend(b)
            self._plan_prefill_saves(meta, st, cached.num_computed_tokens[i] + sched.get(req_id, 0))

    def _plan_prefill_saves(self, meta: KvtierMetadata, st: _Req, computed_after: int) -> None:
        if self.evict is not None:
            # on-evict: every full chunk computed so far (prompt and output) is
            # tracked until vLLM is about to reuse its blocks.
            self._track(st, computed_after, st.block_ids)
            return
        if not st.prefill_open:
            return
        prompt = st.request.num_prompt_tokens
        saves = self._save_chunks(st, min(computed_after, prompt), st.block_ids)
        if saves:
            meta.saves.setdefault(st.request.request_id, []).extend(saves)
        if computed_after >= prompt:
            st.prefill_open = False

    def request_finished(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """Schedules the final chunks' save; holds the blocks while saves are pending."""
        st = self._reqs.pop(request.request_id, None)
        if st is not None and (st.loading_blocks or request.request_id in self._pending_loads):
            # A restore is in flight (or planned and not sent yet: its loads go
            # out with the next step): vLLM holds the blocks until the workers
            # report it received. Saving them now would read blocks the restore
            # still writes, and a finished_sending would free them under it.
            return False, None
        if not self.enabled or st is None or not self.cfg.store:
            return False, None
        computed = max(0, request.num_computed_tokens - getattr(request, "num_in_flight_tokens", 0))
        if self.evict is not None:
            self._track(st, computed, [list(b) for b in block_ids])
            if not self.evict.pressure():
                # The blocks go back to vLLM's pool as they are (no hold), behind at
                # least `window` free blocks: saved if and when the pool is about to
                # reuse them.
                return False, None
            # Freed now, the blocks would be among the next ones vLLM hands out,
            # possibly in the very next allocation, before any step could copy
            # them: save their chunks now and hold the blocks until every rank
            # stored them (the prefill-and-finish path).
            held = {b for g in block_ids for b in g}
            saves = self.evict.take_held(st.tracked, held)
            if not saves:
                return False, None
            self._final_saves.setdefault(request.request_id, []).extend(saves)
            self._finishing.append(request.request_id)
            return True, None
        saves = self._save_chunks(st, computed, [list(b) for b in block_ids])
        if saves:
            self._final_saves.setdefault(request.request_id, []).extend(saves)
        if not st.saved_any:
            return False, None
        self._finishing.append(request.request_id)
        return True, None

    def _track(self, st: _Req, upto_tokens: int, block_ids: list[list[int]]) -> None:
        assert self.evict is not None
        first = st.stored_chunks
        saves = self._save_chunks(st, upto_tokens, block_ids)
        if saves:
            st.tracked.extend(self.evict.track(saves, st.request.block_hashes, first))

    def shutdown(self) -> None:
        """Closes the daemon connection."""
        self._link.close()
