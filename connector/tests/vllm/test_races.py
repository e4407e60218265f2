"""Request lifecycle races between vLLM's scheduler and the connector's I/O
threads, found by a review (each fails without its fix): aborts during a
restore, speculative decoding's call order, a daemon lost mid-save, a
preempted request's cached lookup, a short GET reply, a hung daemon."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from harness import Daemon, Engine, make_request

PROMPT = [((i * 37) % 997) + 1 for i in range(600)]  # 2 full chunks + a tail
OTHER = [((i * 53) % 991) + 2 for i in range(600)]


def _slow_loads(e: Engine, delay_s: float) -> None:
    for w in e.workers:
        for link in w.worker._load_links:
            orig = link.get

            def slow(*a, _o=orig, **k):
                time.sleep(delay_s)
                return _o(*a, **k)

            link.get = slow


def _resume_with_restore(e: Engine, req_id: str) -> None:
    """Runs `req_id` past its prompt (its chunks saved), then preempts it so
    that its resume restores them asynchronously."""
    from vllm.v1.request import RequestStatus

    e.run(lambda: e.requests[req_id].num_computed_tokens >= 620)
    for w in e.workers:
        assert w.worker.wait_idle(10)
    assert e.scheduler.reset_prefix_cache(reset_running_requests=True)
    e.step()
    assert e.requests[req_id].status == RequestStatus.WAITING_FOR_REMOTE_KVS


def test_abort_during_a_restore_keeps_the_blocks_until_it_is_received(daemon: Daemon):
    """A request aborted while its restore is in flight: its blocks stay held
    (vLLM frees them at finished_recving), no save of them is planned, and no
    later request gets them while the restore still writes them. Before, the
    workers reported it finished sending at once: vLLM gave its blocks to the
    next request, the late restore overwrote that request's KV, and vLLM's
    assertion on the late finished_recving stopped the engine."""
    from vllm.v1.request import RequestStatus

    e = Engine({"socket": daemon.socket, "min_tokens_for_disk": 0}, num_blocks=128)
    try:
        e.add(make_request("A", PROMPT, max_tokens=400))
        _resume_with_restore_slowly(e, "A", 0.6)
        e.scheduler.finish_requests("A", RequestStatus.FINISHED_ABORTED)
        e.add(make_request("D", OTHER, max_tokens=300))
        worker = e.workers[0].worker
        deadline = time.monotonic() + 20
        while "D" not in e.finished:
            assert time.monotonic() < deadline
            if "A" in e.scheduler.requests:
                e.step()
                if "A" not in e.scheduler.requests:
                    assert not worker._loading.get("A"), "A's blocks freed while its restore runs"
            else:
                e.step()
            if "D" in e.scheduler.requests and "D" not in e.finished:
                d = e.requests["D"]
                e.models[0].check(d.all_token_ids, e.scheduler.kv_cache_manager.get_block_ids("D"), d.num_computed_tokens)
            time.sleep(0.005)
        assert "A" not in e.scheduler.requests
    finally:
        e.shutdown()


def _resume_with_restore_slowly(e: Engine, req_id: str, delay_s: float) -> None:
    # Saves first (fast), then slow loads, so that the abort lands mid-restore.
    from vllm.v1.request import RequestStatus

    e.run(lambda: e.requests[req_id].num_computed_tokens >= 620)
    for w in e.workers:
        assert w.worker.wait_idle(10)
    _slow_loads(e, delay_s)
    assert e.scheduler.reset_prefix_cache(reset_running_requests=True)
    e.step()
    assert e.requests[req_id].status == RequestStatus.WAITING_FOR_REMOTE_KVS


def test_speculative_decoding_order_still_releases_finished_requests(daemon: Daemon):
    """With a speculative_config vLLM asks for the transfer results before
    `wait_for_save`; a finished request that saved must still be reported
    finished sending (its blocks were held forever)."""
    e = Engine({"socket": daemon.socket, "min_tokens_for_disk": 0})
    e.deferred_finalize = True
    try:
        # Keeps every step non-empty for as long as the release may take
        # (CI: 300 steps went by before a loaded machine's save finished,
        # and once 2,500): the bound is the run's 60 s, not a step count.
        e.add(make_request("bg", OTHER[:300], max_tokens=6000))
        e.add(make_request("A", PROMPT, max_tokens=3))
        e.run(lambda: "A" in e.finished)
        e.run(lambda: "A" not in e.scheduler.requests, max_steps=5900)
        assert e.totals()["save_chunks"] >= 2
    finally:
        e.shutdown()


def test_preempted_request_asks_again_and_restores_its_own_chunks(daemon: Daemon):
    """A request first looked up before its chunks existed: after a
    preemption it must ask again (its cached miss hid its own saves)."""
    e = Engine({"socket": daemon.socket, "min_tokens_for_disk": 0})
    try:
        e.add(make_request("A", PROMPT, max_tokens=100))
        _resume_with_restore(e, "A")
        e.run(lambda: "A" in e.finished)
        t = e.totals()
        assert t["hit_tokens"] >= 512 and t["load_chunks"] >= 2, t
    finally:
        e.shutdown()


def test_a_short_get_reply_fails_the_restore(daemon: Daemon):
    """A GET answered with fewer entries than asked must not count the
    missing chunks as loaded (zip() truncated silently)."""
    from test_daemon import store

    store(daemon.socket)
    e = Engine({"socket": daemon.socket, "min_tokens_for_disk": 0})
    for w in e.workers:
        for link in w.worker._load_links:
            orig = link.get
            link.get = lambda *a, _o=orig, **k: _o(*a, **k)[:-1]
    try:
        e.add(make_request("s", PROMPT, max_tokens=3))
        e.run(lambda: "s" in e.finished)
        t = e.totals()
        assert t["load_failed_requests"] == 1 and t["load_chunks"] == 0, t
    finally:
        e.shutdown()


def test_a_hung_daemon_is_tried_less_and_less_often(daemon: Daemon):
    """A stopped (not dead) daemon costs a lookup timeout per try on the
    engine's thread: after each failure in a row the next try waits twice as
    long (up to 30 s for lookups), instead of every 0.2 s."""
    e = Engine({"socket": daemon.socket, "min_tokens_for_disk": 0, "lookup_timeout_ms": 200})
    assert daemon.proc is not None
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        stalls, t_end, i = 0, time.monotonic() + 3.0, 0
        while time.monotonic() < t_end:
            r = make_request(f"r{i}", [((j * 31 + i) % 997) + 1 for j in range(300)], max_tokens=2)
            i += 1
            t0 = time.monotonic()
            e.connector.get_num_new_matched_tokens(r, 0)
            stalls += time.monotonic() - t0 > 0.15
            time.sleep(0.01)
        # Tries at 0, +0.2, +0.4, +0.8, +1.6 s after each timeout: at most 5
        # in 3 s (a fixed 0.2 s back-off gave 8).
        assert 1 <= stalls <= 5, stalls
        link = e.connector.scheduler._link
        assert link.max_retry_s == 30.0 and link._fails >= 3
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
        e.shutdown()


@pytest.mark.skipif(sys.platform != "linux", reason="memfd regions")
def test_daemon_lost_mid_save_fails_the_save_without_touching_its_memory(short_tmp: Path):
    """A save job of more batches than save links, the daemon killed under
    it: the failed PUT closed that link's shared memory, and gathering the
    next batch into it crashed the process (SIGSEGV). Run in a child."""
    script = textwrap.dedent(
        f"""
        import sys, faulthandler
        faulthandler.enable()
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from pathlib import Path
        from harness import Daemon, Engine, make_request
        d = Daemon(Path({str(short_tmp)!r}), "n1").start()
        e = Engine({{"socket": d.socket, "min_tokens_for_disk": 0, "staging_bytes": 1 << 20,
                    "save_links": 8}}, num_blocks=1024)
        w = e.workers[0].worker
        assert len(w._save_links) == 8, len(w._save_links)
        for link in w._save_links:
            link.namespace(w.record)  # every region mapped
        d.stop(graceful=False)
        e.add(make_request("big", [((i * 37) % 997) + 1 for i in range(8192 + 10)], max_tokens=2))
        e.step()
        assert w.wait_idle(30), "the save job never ended"
        t = e.totals()
        assert t["save_chunks"] == 0 and t["save_failed_chunks"] > 0, t
        e.shutdown()
        print("OK")
        """
    )
    env = {k: v for k, v in os.environ.items()}
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and "OK" in r.stdout, f"exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"


def test_preemption_waits_for_reads_of_its_blocks_not_for_puts(daemon: Daemon):
    """A step that preempts a request whose save is running waits (on the
    engine's thread) only until that save has read the request's blocks, at
    most PREEMPT_WAIT_S, not until its PUTs return (up to timeout_ms)."""
    from kvtier.vllm.worker import PREEMPT_WAIT_S

    # 16 chunks of 64 KiB per 1 MiB batch, one link: 19 chunks are two batches,
    # the second gathered only once the first one's PUT returned.
    e = Engine({"socket": daemon.socket, "min_tokens_for_disk": 0, "staging_bytes": 1 << 20, "save_links": 1})
    worker = e.workers[0].worker
    for link in worker._save_links:
        orig = link.put

        def slow(*a, _o=orig, **k):
            time.sleep(1.5)
            return _o(*a, **k)

        link.put = slow
    try:
        e.add(make_request("A", [((i * 37) % 997) + 1 for i in range(19 * 256 + 10)], max_tokens=100))
        e.run(lambda: worker._save_jobs.get("A"))  # the prompt's saves are queued
        assert e.scheduler.reset_prefix_cache(reset_running_requests=True)
        t0 = time.monotonic()
        so = e.step()
        took = time.monotonic() - t0
        assert "A" in so.preempted_req_ids
        assert took < PREEMPT_WAIT_S + 0.4, f"the preempting step waited {took:.2f} s"
    finally:
        e.shutdown()


def test_speculative_decoding_order_reports_a_request_after_its_final_saves(daemon: Daemon):
    """In vLLM's speculative-decoding order the results of a step are asked
    for before `wait_for_save` queues its saves: a finished request whose
    last chunk is saved at finish must not be reported finished sending
    (its blocks handed back to vLLM) before that save is queued and done.
    Reported first, the save read blocks other requests already wrote."""
    e = Engine({"socket": daemon.socket, "min_tokens_for_disk": 0}, num_blocks=128)
    e.deferred_finalize = True
    worker = e.workers[0].worker
    log: list[tuple[str, str]] = []
    get_finished, wait_for_save = worker.get_finished, worker.wait_for_save

    def logged_get_finished(fin, meta=None):
        sending, recving, failed = get_finished(fin, meta)
        log.extend(("sending", r) for r in sorted(sending))
        return sending, recving, failed

    def logged_wait_for_save(meta):
        log.extend(("queued", r) for r in sorted(meta.saves))
        return wait_for_save(meta)

    worker.get_finished, worker.wait_for_save = logged_get_finished, logged_wait_for_save
    try:
        e.add(make_request("bg", OTHER[:100], max_tokens=1500))  # every step has a forward
        # One chunk saved at prefill, the second (its output) at finish.
        e.add(make_request("A", PROMPT[:300], max_tokens=300))
        e.run(lambda: "A" in e.finished)
        e.run(lambda: "A" not in e.scheduler.requests, max_steps=300)
        a = [kind for kind, r in log if r == "A"]
        assert a.count("queued") == 2 and a.count("sending") == 1, log
        assert a.index("sending") > len(a) - 1 - a[::-1].index("queued"), f"reported before its final save: {a}"
        assert worker.wait_idle(10)
        assert "A" not in worker._finishing and "A" not in worker._save_jobs and "A" not in worker._pending_saves
    finally:
        e.shutdown()


def test_a_waiting_request_asks_again_but_counts_its_tokens_once(daemon: Daemon, monkeypatch):
    """A request that waits asks the daemon again once its answer is older
    than LOOKUP_TTL_S, but its tokens count once in `lookup_tokens` (the
    hit ratio read too low under load, when requests wait)."""
    import kvtier.vllm.scheduler as sched
    from test_daemon import store

    store(daemon.socket)
    monkeypatch.setattr(sched, "LOOKUP_TTL_S", 0.05)
    e = Engine({"socket": daemon.socket, "min_tokens_for_disk": 0})
    try:
        r = make_request("w", PROMPT, max_tokens=2)
        for _ in range(3):
            assert e.connector.get_num_new_matched_tokens(r, 0) == (512, True)
            time.sleep(0.06)
        t = e.connector.get_kv_connector_stats().data
        assert t["lookups"] == 3 and t["lookup_tokens"] == 512, t
    finally:
        e.shutdown()


def test_a_preempted_requests_dropped_saves_are_stored_again(daemon: Daemon):
    """A request preempted while the save of its prompt's chunks is held: the
    save is dropped (its blocks go to others), so the chunks must be saved
    again from the recomputed blocks. The scheduler counted them stored at
    planning and never saved them again: a miss for every later request."""
    import threading

    e = Engine({"socket": daemon.socket, "min_tokens_for_disk": 0})
    gate = threading.Event()
    w = e.workers[0].worker
    real = w._check_daemon_limits

    def held(link, _real=real):
        gate.wait(30)  # the saver is busy until released
        return _real(link)

    w._check_daemon_limits = held
    try:
        e.add(make_request("A", PROMPT, max_tokens=100))
        e.step()  # the whole prompt: its two chunks' save is planned, then held
        assert e.requests["A"].num_computed_tokens >= 512
        assert e.scheduler.reset_prefix_cache(reset_running_requests=True)
        e.step()  # A preempted (and resumed): its held save is dropped after PREEMPT_WAIT_S
        assert e.requests["A"].num_preemptions == 1
        gate.set()
        e.run(lambda: "A" in e.finished)
        e.run(lambda: "A" not in e.scheduler.requests)
        t = e.totals()
        assert t["save_dropped_chunks"] >= 2 and t["save_chunks"] >= 2, t
        assert e.scheduler.reset_prefix_cache()  # B's prompt comes from kvtier
        e.add(make_request("B", PROMPT, max_tokens=3))
        e.run(lambda: "B" in e.finished)
        assert e.totals()["hit_tokens"] >= 512
    finally:
        gate.set()
        e.shutdown()


def test_a_request_preempted_and_restored_in_one_step_does_not_save_its_chunks_again(daemon: Daemon):
    """A request preempted outside `schedule()` (reset_prefix_cache) and
    restored by the same `schedule()`: the lookup of its resume says its
    chunks are stored; the preemption must not undo that (a review found
    every restored chunk saved again)."""
    e = Engine({"socket": daemon.socket, "min_tokens_for_disk": 0}, num_blocks=128)
    try:
        e.add(make_request("A", PROMPT, max_tokens=400))
        _resume_with_restore(e, "A")
        before = e.totals()["save_chunks"]
        e.run(lambda: e.requests["A"].num_computed_tokens >= 640)
        assert e.totals()["save_chunks"] == before
    finally:
        e.shutdown()
