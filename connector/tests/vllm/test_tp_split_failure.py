"""TP ranks that report a failed restore in different steps (review): vLLM
acts on a rank's invalid blocks in the step they arrive and lists the
request finished only once every rank reported."""

from __future__ import annotations

import pytest
from harness import Daemon, Engine, make_request
from test_daemon import PROMPT, run_one, store


def _delay_rank1_recv(e: Engine, req_id: str) -> list[int]:
    """Rank 1's load of `req_id` is reported one step later than it ends (its
    I/O thread was a step slower than rank 0's): a real multi-rank timing."""
    w1 = e.workers[1].worker
    orig = w1.get_finished
    delayed: list[int] = []

    def get_finished(finished, meta=None):
        s, r, f = orig(finished, meta)
        if req_id in r and not delayed:
            delayed.append(1)
            r = set(r) - {req_id}
            with w1._lock:
                w1._done_loads.append((req_id, True, set()))
        return s, r, f

    w1.get_finished = get_finished
    return delayed


def _delete_on_rank0(e: Engine, daemon: Daemon, chunk: int, keys: list[bytes]):
    from kvtier.client import KvtierClient

    def hook(so):
        for loads in so.kv_connector_metadata.loads.values():
            lds = [ld for ld in loads if ld.chunk == chunk]
            if lds and not keys:
                keys.append(lds[0].key)
                with KvtierClient(daemon.socket, region_size=0) as c:
                    assert c.delete(c.hello(e.workers[0].worker.record), keys, group=0) == [True]
    return hook


def _tp2_losing_chunk(daemon: Daemon, chunk: int, delay: bool) -> tuple[Engine, list[bytes], list[int]]:
    """Two ranks over stored chunks; rank 0's copy of `chunk` is deleted as
    its load starts, and with `delay` rank 1 reports its load a step late."""
    store(daemon.socket, tp_size=2)
    e = Engine({"socket": daemon.socket, "min_tokens_for_disk": 0}, tp_size=2)
    keys: list[bytes] = []
    e.before_workers = _delete_on_rank0(e, daemon, chunk, keys)
    delayed = _delay_rank1_recv(e, "m") if delay else [1]
    return e, keys, delayed


def _count_loads(worker) -> list[int]:  # type: ignore[no-untyped-def]
    """One entry per request load `worker` starts."""
    attempts: list[int] = []
    orig = worker.start_load_kv

    def start_load_kv(meta):  # type: ignore[no-untyped-def]
        attempts.extend(1 for _ in meta.loads)
        return orig(meta)

    worker.start_load_kv = start_load_kv
    return attempts


@pytest.mark.parametrize("delay", [False, True])
def test_tp2_partial_restore_failure_reported_in_two_steps_stores_lost_chunk_again(daemon: Daemon, delay):
    from kvtier.client import KvtierClient

    e, keys, delayed = _tp2_losing_chunk(daemon, 1, delay)
    try:
        run_one(e, "m")
        assert delayed, "rank 1's report was not delayed"
        t = e.totals()
        assert t["load_failed_chunks"] == 1
        # vLLM recomputed chunk 1 (invalid blocks, step N); the connector should
        # store it again on both ranks, as it does with one rank.
        with KvtierClient(daemon.socket, region_size=0) as c:
            prefix = c.lookup(c.hello(e.workers[0].worker.record), keys).prefix
        assert prefix == 1, f"chunk 1 was never stored again on rank 0 (save_chunks={t.get('save_chunks')})"
    finally:
        e.shutdown()


@pytest.mark.parametrize("delay", [False, True])
def test_tp2_restore_failure_at_chunk0_reported_in_two_steps_is_not_offered_again(daemon: Daemon, delay):
    e, _, delayed = _tp2_losing_chunk(daemon, 0, delay)
    attempts = _count_loads(e.workers[0].worker)
    try:
        run_one(e, "m")
        assert delayed
        t = e.totals()
        # One failed restore: the request must not be offered the same load again.
        assert len(attempts) == 1, (attempts, t["load_failed_requests"])
    finally:
        e.shutdown()


def test_tp2_rank0_daemon_unreachable_rank1_a_step_slower_restores_once(daemon: Daemon):
    """Rank 0's node daemon is unreachable (its GETs fail at once, DaemonDown),
    rank 1's GET ends a step later; the head's cluster lookup still lists the
    chunks. The failed restore was never noted (the connector saw the invalid
    blocks and the finished_recving in different steps), so vLLM asked again
    and was offered the same restore: 586 times in 10 s, never finished."""
    import time

    store(daemon.socket, tp_size=2)
    e = Engine({"socket": daemon.socket, "min_tokens_for_disk": 0}, tp_size=2)
    w0 = e.workers[0].worker
    for link in w0._load_links:
        link.close()
        link._next_try = time.monotonic() + 1e9  # DaemonDown, fast
    w1 = e.workers[1].worker
    orig = w1.get_finished
    pending: list[str] = []

    def get_finished(finished, meta=None):
        s, r, f = orig(finished, meta)
        back, pending[:] = set(pending), []
        for x in r:
            pending.append(x)
        return s, back, f

    w1.get_finished = get_finished
    attempts = _count_loads(w0)
    try:
        e.add(make_request("m", PROMPT, max_tokens=3))
        try:
            e.run(lambda: "m" in e.finished, timeout_s=10)
        except AssertionError:
            pass
        assert "m" in e.finished and len(attempts) == 1, f"{len(attempts)} restores of one request; finished={'m' in e.finished}"
    finally:
        e.shutdown()
