#!/usr/bin/env python3
"""Copy speed into fresh (never touched) memory with 4 KiB pages and with
transparent huge pages (MADV_HUGEPAGE), as a new chunk buffer sees it.

    python3 scripts/fresh-copy-bench.py [--mib 32] [--reps 64]

Each rep maps a new anonymous region, advises it (or not), and times one
numpy copy of MIB MiB into it; the median GB/s of each kind is printed,
alternated twice. Needs numpy and Linux.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import statistics
import time

import numpy as np

MADV_HUGEPAGE = 14
HUGE = 2 << 20


def run(libc: ctypes.CDLL, n: int, reps: int, huge: bool) -> float:
    src = np.ones(n, dtype=np.uint8)
    times, keep = [], []
    for _ in range(reps):
        m = mmap.mmap(-1, n + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        view = (ctypes.c_char * len(m)).from_buffer(m)
        base = ctypes.addressof(view)
        start = (base + HUGE - 1) // HUGE * HUGE
        if huge and libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(n), MADV_HUGEPAGE) != 0:
            raise SystemExit(f"madvise failed: errno {ctypes.get_errno()}")
        dst = np.frombuffer(m, dtype=np.uint8, count=n, offset=start - base)
        t = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t)
        del dst
        keep.append((m, view))  # kept mapped, like stored chunks
    return n / statistics.median(times) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=32)
    ap.add_argument("--reps", type=int, default=64)
    args = ap.parse_args()
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        print("THP:", f.read().strip())
    for _ in range(2):
        for huge in (False, True):
            gbps = run(libc, args.mib << 20, args.reps, huge)
            print(f"{'huge pages' if huge else '4 KiB pages':<12} {gbps:6.2f} GB/s")


if __name__ == "__main__":
    main()
