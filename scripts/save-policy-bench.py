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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "connector"))
sys.path.insert(0, str(ROOT / "connector" / "tests" / "vllm"))
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")

from harness import Daemon, Engine, make_request  # noqa: E402

POLICIES = ("prefill-and-finish", "on-evict")


def tokens(seed: int, n: int) -> list[int]:
    return [((i * 37 + seed * 7919) % 997) + 1 for i in range(n)]


def drain(e: Engine, ids: list[str], timeout_s: float) -> None:
    e.run(lambda: all(r in e.finished for r in ids), max_steps=1_000_000, timeout_s=timeout_s)
    e.run(lambda: all(r not in e.scheduler.requests for r in ids), max_steps=1_000_000, timeout_s=timeout_s)


def batch(e: Engine, reqs: list[tuple[str, list[int]]], max_tokens: int, timeout_s: float) -> None:
    for rid, toks in reqs:
        e.add(make_request(rid, toks, max_tokens=max_tokens))
    drain(e, [rid for rid, _ in reqs], timeout_s)


def revisit(e: Engine, rid: str, toks: list[int], prefix_len: int, max_tokens: int, timeout_s: float) -> tuple[int, int]:
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
    args = ap.parse_args()
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
