#!/usr/bin/env python3
"""The vLLM connector's save policies side by side: prefill-and-finish vs on-evict.

Runs the same workloads through vLLM 0.33's real scheduler and block pool (the
CPU engine of connector/tests/vllm/harness.py: a stand-in model writes a
deterministic function of the token prefix into the KV pages, so every
restored token is checked byte for byte) against a fresh real daemon per run,
once per policy, and reports what each policy copied and what it gave back:

  unique   many unique requests (no prefix is ever asked for again)
  shared   a few long shared prefixes, then unique requests that turn the GPU
           pool over, then the prefixes again (restore hit rate)
  hot      a few prefixes revisited often, in a pool that holds them all

Columns: chunks saved and bytes copied GPU -> daemon (summed over ranks),
chunks on-evict lost (reused by vLLM before they could be saved), tokens
restored from kvtier in the revisits and the restore hit rate (restored /
revisit prefix tokens vLLM did not find in its own prefix cache), wall seconds.

    PYTHONPATH=connector KVTIER_BIN=target/debug/kvtier \\
        ~/.cache/kvtier-test/venv-torch/bin/python scripts/save-policy-bench.py
    ... --device cuda     # KV caches on the GPU (still needs vLLM: see below)

Needs vLLM 0.33 importable (its scheduler and block pool decide what is
saved; the venv of scripts/lib/torch-venv.sh has it) and the kvtier binary.
Prints a table and one JSON line (prefix `RESULT `).

`--stall` measures instead what on-evict costs a step on the device, without
vLLM (torch and the kvtier binary only, e.g. on a GPU host): one step =
handle_preemptions, start_load_kv, a stand-in forward (matmuls on the device),
wait_for_save, with k chunks (gpu-e2e.py's shape by default: 32 layers, 8 KV
heads, head size 128, 16-block chunks = 32 MiB) to save under each policy.
on-evict gathers them within the step (wait_for_save returns once they left
the KV cache); prefill-and-finish queues them behind the forward and returns.
Reported: step time minus the forward alone, measured in the same run.

    python3 scripts/save-policy-bench.py --stall --kvtier target/release/kvtier --device cuda
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "connector"))
sys.path.insert(0, str(ROOT / "connector" / "tests" / "vllm"))
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")

from harness import Daemon  # noqa: E402

POLICIES = ("prefill-and-finish", "on-evict")


def stall(args: argparse.Namespace) -> int:
    """Per-step cost of saving k chunks under each policy (worker path only, no vLLM)."""
    import statistics
    from types import SimpleNamespace

    import torch

    from kvtier.vllm.config import KvtierConfig
    from kvtier.vllm.layout import EngineLayout
    from kvtier.vllm.meta import ChunkSave, KvtierMetadata
    from kvtier.vllm.metrics import StatsRecorder
    from kvtier.vllm.namespace import GroupLayout, build_record, layout_fingerprint
    from kvtier.vllm.worker import KvtierWorker

    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch sees no GPU")
    L, H, N, C, cb = args.layers, args.kv_heads, 16, 2 * args.head_size, 16
    ks = [int(k) for k in args.stall_chunks.split(",")]
    B = max(ks) * cb + 1
    page = H * N * C * 2
    names = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
    group = GroupLayout(0, tuple(names), N, page, f"FullAttentionSpec/h{H}/k{args.head_size}/v{args.head_size}/bfloat16/NONE")
    record = build_record(
        model="save-policy-bench", model_revision="", engine_version="bench", tp_size=1, rank=0, kv_dtype="bfloat16",
        block_size=N, chunk_tokens=N * cb, hash_algo="sha256_cbor", layout=layout_fingerprint([group], cb),
        salt=f"{time.time_ns()}", info={},
    )
    layout = EngineLayout((group,), N, N, cb, 1, "sha256_cbor", record)
    kv = torch.empty((L, B, H, N, C), dtype=torch.bfloat16, device=dev)
    kv.view(torch.int16).random_(-32768, 32767)
    caches = {name: kv[i] for i, name in enumerate(names)}
    work = Path(tempfile.mkdtemp(prefix="kvt-stall-"))
    proc = None
    try:
        import socket as _s
        import subprocess

        sock = str(work / "kvtier.sock")
        proc = subprocess.Popen(
            [args.kvtier, "node", "start", "--data-dir", str(work / "data"), "--socket", sock, "--resp-listen", "off",
             "--http-listen", "off", "--ram-budget", args.ram_budget, "--disk-budget", "0"],
            stdout=open(work / "daemon.log", "wb"), stderr=subprocess.STDOUT,
            env={k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")},
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                c = _s.socket(_s.AF_UNIX)
                c.connect(sock)
                c.close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"daemon did not start: {(work / 'daemon.log').read_text()[-2000:]}")
                time.sleep(0.05)
        cfg = KvtierConfig(socket=sock, staging_bytes=args.staging, timeout_ms=120_000)
        stats = StatsRecorder()
        w = KvtierWorker(cfg, layout, SimpleNamespace(parallel_config=SimpleNamespace(rank=0)), True, stats)
        w.register_kv_caches(caches)
        if not w.enabled:
            raise SystemExit("worker disabled itself (see the log above)")
        a = torch.randn(args.fwd_dim, args.fwd_dim, device=dev, dtype=torch.float32)

        def sync() -> None:
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)

        def forward() -> None:
            # On CUDA the host returns after the launch, as vLLM's forward does.
            x = a
            for _ in range(args.fwd_matmuls):
                x = x @ a
                x = x / x.norm()

        def step(meta: KvtierMetadata) -> float:
            sync()
            t0 = time.perf_counter()
            w.handle_preemptions(meta)
            w.start_load_kv(meta)
            forward()
            w.wait_for_save(meta)
            sync()
            return time.perf_counter() - t0

        rows = []
        seq = 0
        for _ in range(2):  # warm-up: allocator, connections, staging registration
            step(KvtierMetadata())
        fwd = []
        for _ in range(args.iters):
            fwd.append(step(KvtierMetadata()))
        base = statistics.median(fwd)
        for k in ks:
            for pol in POLICIES:
                ts = []
                for _ in range(args.iters):
                    seq += 1
                    saves = [ChunkSave(os.urandom(32), 0, list(range(1 + c * cb, 1 + (c + 1) * cb))) for c in range(k)]
                    if pol == "on-evict":
                        meta = KvtierMetadata(evict_saves=saves)
                    else:
                        meta = KvtierMetadata(saves={f"r{seq}": saves}, finishing=[f"r{seq}"])
                    ts.append(step(meta))
                    if not w.wait_idle(300):
                        raise SystemExit("saves did not finish")
                    w.get_finished({f"r{seq}"})
                med = statistics.median(ts)
                rows.append({"chunks": k, "policy": pol, "bytes": k * group.chunk_bytes(cb), "step_ms": round(med * 1e3, 3),
                             "forward_ms": round(base * 1e3, 3), "extra_ms": round((med - base) * 1e3, 3)})
                r = rows[-1]
                print(f"k={k:3} {pol:19} step={r['step_ms']:9.3f} ms  forward alone={r['forward_ms']:8.3f} ms  "
                      f"extra={r['extra_ms']:8.3f} ms", flush=True)
        t = stats.totals()
        w.shutdown()
    finally:
        if proc is not None:
            proc.kill()
            proc.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)
    print()
    print("| chunks to save | bytes | policy | step ms (median) | forward alone ms | extra ms |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['chunks']} | {r['bytes']} | {r['policy']} | {r['step_ms']} | {r['forward_ms']} | {r['extra_ms']} |")
    dev_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print("RESULT " + json.dumps({"mode": "stall", "device": dev_name, "args": vars(args), "rows": rows,
                                  "save_chunks": t.get("save_chunks"), "save_failed": t.get("save_failed_chunks"),
                                  "save_dropped": t.get("save_dropped_chunks")}))
    return 0


def tokens(seed: int, n: int) -> list[int]:
    return [((i * 37 + seed * 7919) % 997) + 1 for i in range(n)]


def drain(e: Any, ids: list[str], timeout_s: float) -> None:
    e.run(lambda: all(r in e.finished for r in ids), max_steps=1_000_000, timeout_s=timeout_s)
    e.run(lambda: all(r not in e.scheduler.requests for r in ids), max_steps=1_000_000, timeout_s=timeout_s)


def batch(e: Any, reqs: list[tuple[str, list[int]]], max_tokens: int, timeout_s: float) -> None:
    from harness import make_request  # needs vLLM

    for rid, toks in reqs:
        e.add(make_request(rid, toks, max_tokens=max_tokens))
    drain(e, [rid for rid, _ in reqs], timeout_s)


def revisit(e: Any, rid: str, toks: list[int], prefix_len: int, max_tokens: int, timeout_s: float) -> tuple[int, int]:
    """(tokens restored from kvtier, prefix tokens vLLM did not have locally) for one request."""
    before = e.totals()["hit_tokens"]
    batch(e, [(rid, toks)], max_tokens, timeout_s)
    restored = e.totals()["hit_tokens"] - before
    local = e.verified[rid] - restored  # tokens vLLM found in its own prefix cache
    return restored, max(0, prefix_len - local)


def run(args: argparse.Namespace, workload: str, policy: str, work: Path) -> dict:
    d = Daemon(work, f"{workload}-{policy}").start()
    extra = {"socket": d.socket, "min_tokens_for_disk": 0, "save_policy": policy}
    if policy == "on-evict":
        extra["evict_watermark"] = args.watermark
    from harness import Engine  # needs vLLM

    pool = args.pool if workload != "hot" else args.hot_pool
    e = Engine(extra, num_blocks=pool, max_num_batched_tokens=args.step_tokens, max_num_seqs=args.seqs,
               device=args.device)
    L, mt, to = args.prompt, args.max_tokens, args.timeout
    restored = missing = 0
    t0 = time.perf_counter()
    try:
        if workload == "unique":
            batch(e, [(f"u{i}", tokens(1000 + i, L)) for i in range(args.unique)], mt, to)
        elif workload == "shared":
            prefixes = [tokens(i, L) for i in range(args.prefixes)]
            batch(e, [(f"p{i}", p + tokens(500 + i, args.suffix)) for i, p in enumerate(prefixes)], mt, to)
            # Unique requests turn the pool over (args.turnover times its size).
            n_fill = max(1, args.turnover * pool * 16 // (L + args.suffix))
            batch(e, [(f"f{i}", tokens(2000 + i, L)) for i in range(n_fill)], mt, to)
            for i, p in enumerate(prefixes):
                r, m = revisit(e, f"v{i}", p + tokens(600 + i, args.suffix), L, mt, to)
                restored, missing = restored + r, missing + m
        elif workload == "hot":
            prefixes = [tokens(i, L) for i in range(args.prefixes)]
            for rnd in range(args.rounds):
                for i, p in enumerate(prefixes):
                    r, m = revisit(e, f"h{rnd}-{i}", p + tokens(700 + rnd * 50 + i, args.suffix), L, mt, to)
                    if rnd:
                        restored, missing = restored + r, missing + m
        for w in e.workers:
            w.worker.wait_idle(to)
        wall = time.perf_counter() - t0
        t = e.totals()
    finally:
        e.shutdown()
        d.stop(graceful=False)
    return {
        "workload": workload, "policy": policy, "pool_blocks": pool,
        "save_chunks": t["save_chunks"], "save_bytes": t["save_bytes"],
        "save_failed": t["save_failed_chunks"], "save_dropped": t["save_dropped_chunks"],
        "evict_chunks": t["evict_chunks"], "evict_lost": t["evict_lost_chunks"],
        "restored_tokens": restored, "revisit_missing_tokens": missing,
        "hit_rate": round(restored / missing, 3) if missing else None,
        "load_failed": t["load_failed_chunks"], "wall_s": round(wall, 2),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--workloads", default="unique,shared,hot")
    ap.add_argument("--pool", type=int, default=256, help="GPU blocks (16 tokens each) for unique/shared")
    ap.add_argument("--hot-pool", type=int, default=512, help="GPU blocks for hot (holds every prefix)")
    ap.add_argument("--prompt", type=int, default=1024, help="prompt / shared prefix tokens")
    ap.add_argument("--suffix", type=int, default=64, help="unique tokens after a shared prefix")
    ap.add_argument("--max-tokens", type=int, default=4, help="output tokens per request")
    ap.add_argument("--unique", type=int, default=48, help="requests of the unique workload")
    ap.add_argument("--prefixes", type=int, default=4)
    ap.add_argument("--turnover", type=int, default=2, help="shared: pool sizes of unique requests between visits")
    ap.add_argument("--rounds", type=int, default=6, help="hot: visits per prefix")
    ap.add_argument("--step-tokens", type=int, default=512, help="vLLM max_num_batched_tokens")
    ap.add_argument("--seqs", type=int, default=4, help="vLLM max_num_seqs")
    ap.add_argument("--watermark", type=float, default=0.05, help="on-evict evict_watermark")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--stall", action="store_true", help="measure the per-step cost of each policy (no vLLM needed)")
    ap.add_argument("--kvtier", default=os.environ.get("KVTIER_BIN", str(ROOT / "target" / "debug" / "kvtier")))
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--stall-chunks", default="1,2,4,8", help="chunks to save in one step")
    ap.add_argument("--staging", type=int, default=256 << 20)
    ap.add_argument("--ram-budget", default="16GiB")
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--fwd-dim", type=int, default=4096, help="stand-in forward: square matmul size")
    ap.add_argument("--fwd-matmuls", type=int, default=20, help="stand-in forward: matmuls per step")
    args = ap.parse_args()
    if args.stall:
        return stall(args)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--device cuda but torch sees no GPU")
    work = Path(tempfile.mkdtemp(prefix="kvt-spb-"))
    rows = []
    try:
        for wl in args.workloads.split(","):
            for pol in POLICIES:
                rows.append(run(args, wl, pol, work))
                r = rows[-1]
                print(f"{wl:7} {pol:19} saves={r['save_chunks']:5} bytes={r['save_bytes']:>11} "
                      f"lost={r['evict_lost']:4} restored={r['restored_tokens']:6} hit_rate={r['hit_rate']} "
                      f"wall={r['wall_s']}s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print()
    print("| workload | policy | chunks saved | bytes copied | lost (on-evict) | restored tokens | hit rate | wall s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        hr = "n/a" if r["hit_rate"] is None else f"{r['hit_rate']:.2f}"
        print(f"| {r['workload']} | {r['policy']} | {r['save_chunks']} | {r['save_bytes']} | {r['evict_lost']} | "
              f"{r['restored_tokens']} | {hr} | {r['wall_s']} |")
    print("RESULT " + json.dumps({"device": args.device, "args": vars(args), "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
