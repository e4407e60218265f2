#!/usr/bin/env python3
"""GPU -> kvtier daemon -> GPU through the vLLM connector's worker-side path.

Builds a KV cache on the device in vLLM 0.33's layout (one allocation, per-layer
`[B, H, N, C]` views of an `LBHNC` tensor), starts a real daemon (the binary is
passed by path), stores N chunks with `KvtierWorker` (gather on the device ->
shared-memory staging registered with cudaHostRegister -> PUT), restores them
into other blocks (GET -> staging -> scatter), checks the restore is
byte-exact, and reports GB/s next to a plain pinned-memory copy of the same
bytes measured in the same run. Needs torch, not vLLM.

    python3 scripts/gpu-e2e.py --kvtier target/release/kvtier            # CUDA
    python3 scripts/gpu-e2e.py --kvtier target/debug/kvtier --device cpu # anywhere

Prints a table and one JSON line (prefix `RESULT `).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "connector"))

import torch  # noqa: E402

try:
    import numpy as np
except ImportError:  # the fresh-memory baseline is then skipped
    np = None

from kvtier.vllm.config import KvtierConfig  # noqa: E402
from kvtier.vllm.layout import EngineLayout  # noqa: E402
from kvtier.vllm.meta import ChunkLoad, ChunkSave, KvtierMetadata  # noqa: E402
from kvtier.vllm.namespace import GroupLayout, build_record, layout_fingerprint  # noqa: E402
from kvtier.vllm.worker import KvtierWorker  # noqa: E402


def start_daemon(
    binary: str, workdir: Path, ram: str, settings: list[str] = ()
) -> tuple[subprocess.Popen, str]:
    sock = str(workdir / "kvtier.sock")
    log = open(workdir / "daemon.log", "wb")
    p = subprocess.Popen(
        [binary, "node", "start", "--data-dir", str(workdir / "data"), "--socket", sock,
         "--resp-listen", "off", "--http-listen", "off", "--ram-budget", ram, "--disk-budget", "0"],
        stdout=log, stderr=subprocess.STDOUT,
        # The daemon reads every KVTIER_* variable as a config key.
        env={k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
        | dict(kv.split("=", 1) for kv in settings),
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if p.poll() is not None:
            raise SystemExit(f"daemon exited: {(workdir / 'daemon.log').read_text()[-2000:]}")
        try:
            s = socket.socket(socket.AF_UNIX)
            s.connect(sock)
            s.close()
            return p, sock
        except OSError:
            time.sleep(0.05)
    p.kill()
    raise SystemExit("daemon did not start in 60 s")


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kvtier", required=True, help="path of the kvtier binary")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--chunk-blocks", type=int, default=16)
    ap.add_argument("--chunks", type=int, default=64, help="chunks stored and restored per iteration")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--staging", type=int, default=512 << 20, help="staging bytes per direction")
    ap.add_argument("--ram-budget", default="8GiB")
    ap.add_argument("--save-links", type=int, default=None, help="save connections (PUTs in flight); default: the connector's")
    ap.add_argument("--load-links", type=int, default=None, help="load connections (GETs in flight); default: the connector's")
    ap.add_argument(
        "--daemon-env", action="append", default=[], metavar="KVTIER_KEY=VALUE",
        help="a config setting for the daemon, e.g. KVTIER_HUGE_PAGES=false (repeatable)",
    )
    ap.add_argument(
        "--breakdown", action="store_true",
        help="time each phase (device gather/scatter, staging copies, PUT/GET); synchronizes "
        "between phases, so the totals are those of an unpipelined run",
    )
    args = ap.parse_args()

    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch sees no GPU (use --device cpu)")
    L, H, N, C = args.layers, args.kv_heads, args.block_size, 2 * args.head_size
    cb, n = args.chunk_blocks, args.chunks
    B = 2 * n * cb + 1  # source blocks, destination blocks, one spare
    dtype = torch.bfloat16
    page = H * N * C * 2
    names = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
    group = GroupLayout(0, tuple(names), N, page, f"FullAttentionSpec/h{H}/k{args.head_size}/v{args.head_size}/bfloat16/NONE")
    record = build_record(
        model="gpu-e2e", model_revision="", engine_version="gpu-e2e", tp_size=1, rank=0, kv_dtype="bfloat16",
        block_size=N, chunk_tokens=N * cb, hash_algo="sha256_cbor", layout=layout_fingerprint([group], cb),
        salt=f"{time.time_ns()}", info={},
    )
    layout = EngineLayout((group,), N, N, cb, 1, "sha256_cbor", record)
    cfg = KvtierConfig(staging_bytes=args.staging, timeout_ms=120_000)

    # vLLM 0.33: one allocation, physical LBHNC, per-layer logical [B, H, N, C] views.
    kv = torch.empty((L, B, H, N, C), dtype=dtype, device=dev)
    kv.view(torch.int16).random_(-32768, 32767)
    caches = {name: kv[i] for i, name in enumerate(names)}
    total = n * group.chunk_bytes(cb)

    work = Path(tempfile.mkdtemp(prefix="kvtier-gpu-e2e-"))
    proc, sock = start_daemon(os.path.abspath(args.kvtier), work, args.ram_budget, args.daemon_env)
    cfg = KvtierConfig(socket=sock, staging_bytes=args.staging, timeout_ms=120_000)
    worker = KvtierWorker(cfg, layout, SimpleNamespace(parallel_config=SimpleNamespace(rank=0)), True, _Stats())
    results: dict[str, list[float]] = {
        "save": [], "load": [], "pinned_d2h": [], "pinned_h2d": [], "fresh_copy": [], "parallel_copy": []
    }
    parallel_dst = None  # touched once, reused by every iteration's parallel-copy baseline
    phases: list[dict[str, float]] = []
    exact = True
    if args.save_links is not None:
        worker.save_links = args.save_links
    if args.load_links is not None:
        worker.load_links = args.load_links
    try:
        worker.register_kv_caches(caches)
        if not worker.enabled:
            raise SystemExit("worker disabled itself (see the log above)")
        src = list(range(0, n * cb))
        dst = list(range(n * cb, 2 * n * cb))
        for it in range(args.iters):
            keys = [os.urandom(32) for _ in range(n)]
            rid = f"r{it}"
            saves = [ChunkSave(keys[c], 0, src[c * cb : (c + 1) * cb]) for c in range(n)]
            if args.breakdown:
                worker.timing = {}
            sync(dev)
            t0 = time.perf_counter()
            worker.wait_for_save(KvtierMetadata(saves={rid: saves}, finishing=[rid]))
            _wait(lambda: rid in worker.get_finished({rid})[0], "save")
            results["save"].append(time.perf_counter() - t0)
            kv[:, dst].zero_()
            sync(dev)
            loads = [ChunkLoad(keys[c], 0, c, [(i, dst[c * cb + i]) for i in range(cb)]) for c in range(n)]
            t0 = time.perf_counter()
            worker.start_load_kv(KvtierMetadata(loads={rid: loads}))
            got: dict[str, set] = {}

            def loaded() -> bool:
                _, recv, failed = worker.get_finished(set())
                got.setdefault("recv", set()).update(recv)
                got.setdefault("failed", set()).update(failed)
                return rid in got["recv"]

            _wait(loaded, "load")
            sync(dev)
            results["load"].append(time.perf_counter() - t0)
            if worker.timing is not None:
                tm = dict(worker.timing)
                tm["save_total"] = results["save"][-1]
                tm["load_total"] = results["load"][-1]
                phases.append(tm)
            errors = worker.get_block_ids_with_load_errors()
            same = not errors and rid not in got["failed"] and torch.equal(
                kv[:, src].view(torch.int16), kv[:, dst].view(torch.int16)
            )
            exact = exact and same
            # Baseline: the same bytes through plain pinned host memory.
            flat = kv[:, src].contiguous()
            host = torch.empty(flat.shape, dtype=dtype, pin_memory=dev.type == "cuda")
            sync(dev)
            t0 = time.perf_counter()
            host.copy_(flat, non_blocking=True)
            sync(dev)
            results["pinned_d2h"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            flat.copy_(host, non_blocking=True)
            sync(dev)
            results["pinned_h2d"].append(time.perf_counter() - t0)
            # Baseline of the daemon's PUT copy: chunk-sized copies on one thread into
            # freshly allocated (never touched) memory, kept alive like stored chunks.
            if np is None:
                continue
            src_host = host.view(-1).view(torch.uint8).numpy()
            cbytes = group.chunk_bytes(cb)
            kept = []
            t0 = time.perf_counter()
            for c in range(n):
                fresh = np.empty(cbytes, dtype=np.uint8)
                np.copyto(fresh, src_host[c * cbytes : (c + 1) * cbytes])
                kept.append(fresh)
            results["fresh_copy"].append(time.perf_counter() - t0)
            del kept
            # Baseline of the host's memory bandwidth for the daemon's copies: the same
            # chunk-sized copies into touched memory on as many threads as the connector
            # has connections (numpy releases the GIL while it copies).
            if parallel_dst is None:
                parallel_dst = np.ones(n * cbytes, dtype=np.uint8)

            def one(c: int) -> None:
                part = slice(c * cbytes, (c + 1) * cbytes)
                np.copyto(parallel_dst[part], src_host[part])

            with ThreadPoolExecutor(max(len(worker._save_links), len(worker._load_links))) as ex:
                t0 = time.perf_counter()
                list(ex.map(one, range(n)))
                results["parallel_copy"].append(time.perf_counter() - t0)
    finally:
        worker.shutdown()
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(work, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in results.items() if v}
    gbps = {k: total / v / 1e9 for k, v in med.items()}
    gbps.setdefault("fresh_copy", float("nan"))
    gbps.setdefault("parallel_copy", float("nan"))
    out = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "bytes_per_iter": total, "chunk_bytes": group.chunk_bytes(cb), "chunks": n, "layers": L, "save_links": len(worker._save_links),
        "load_links": len(worker._load_links),
        "iters": args.iters, "byte_exact": exact,
        "save_GBps": round(gbps["save"], 3), "load_GBps": round(gbps["load"], 3),
        "pinned_d2h_GBps": round(gbps["pinned_d2h"], 3), "pinned_h2d_GBps": round(gbps["pinned_h2d"], 3),
        "save_vs_pinned_d2h": round(gbps["save"] / gbps["pinned_d2h"], 3),
        "load_vs_pinned_h2d": round(gbps["load"] / gbps["pinned_h2d"], 3),
        "fresh_copy_GBps": round(gbps["fresh_copy"], 3),
        "parallel_copy_GBps": round(gbps["parallel_copy"], 3),
        "save_vs_parallel_copy": round(gbps["save"] / gbps["parallel_copy"], 3),
        "load_vs_parallel_copy": round(gbps["load"] / gbps["parallel_copy"], 3),
    }
    print(f"{'path':<34}{'GB/s':>10}")
    print(f"{'save  device->staging->daemon (PUT)':<34}{out['save_GBps']:>10.2f}")
    print(f"{'load  daemon->staging->device (GET)':<34}{out['load_GBps']:>10.2f}")
    print(f"{'baseline pinned D2H':<34}{out['pinned_d2h_GBps']:>10.2f}")
    print(f"{'baseline pinned H2D':<34}{out['pinned_h2d_GBps']:>10.2f}")
    print(f"{'baseline copy into fresh memory':<34}{out['fresh_copy_GBps']:>10.2f}")
    threads = max(out["save_links"], out["load_links"])
    print(f"{f'baseline host memcpy, {threads} threads':<34}{out['parallel_copy_GBps']:>10.2f}")
    if phases:
        # One whole iteration (the median by save + load time), so that the phases add up.
        bd_it = sorted(phases, key=lambda p: p["save_total"] + p["load_total"])[len(phases) // 2]
        print("breakdown (seconds of the median iteration; phases synchronized, so not overlapped):")
        keys = ["gather", "d2h", "gather_wait", "put", "save_total", "get", "h2d", "scatter", "scatter_wait", "load_total"]
        bd = {k: bd_it.get(k, 0.0) for k in keys}
        for k in keys:
            print(f"  {k:<14}{bd[k]:>9.4f} s {total / bd[k] / 1e9 if bd[k] else float('inf'):>9.2f} GB/s")
        for tot, parts in (("save_total", keys[:4]), ("load_total", keys[5:9])):
            rest = bd[tot] - sum(bd[k] for k in parts)
            print(f"  {tot[:4]} other   {rest:>9.4f} s (Python, queueing, polling)")
        out["breakdown_s"] = {k: round(v, 5) for k, v in bd.items()}
    print(f"byte-exact restore: {exact}; {total / 2**20:.0f} MiB per iteration, median of {args.iters}")
    print("RESULT " + json.dumps(out))
    return 0 if exact else 1


class _Stats:
    """Counters are not needed here; timings are taken around the calls."""

    def add(self, **_: int) -> None:
        pass

    def observe(self, *_: object) -> None:
        pass


def _wait(cond, what: str, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise SystemExit(f"{what} did not finish in {timeout_s} s")
        time.sleep(0.0005)


if __name__ == "__main__":
    sys.exit(main())
