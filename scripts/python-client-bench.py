#!/usr/bin/env python3
"""PUT / GET throughput through the Python client (``kvtier.KvtierClient``:
Unix socket + memfd shared memory) against a cold memcpy of the same sizes
measured in the same run (issue 3's benchmark "from the Python client").

A real daemon is started (RAM only, so the figure is the protocol's and the
copies', not the disk's) and its RAM budget filled once, so that measured
PUTs evict and reuse memory as in a full tier. The region is 256 MiB and
requests rotate through it, and the baseline copies rotate through two
256 MiB numpy arrays, so neither side runs from the CPU caches. PUT sends
chunks already in the region (the zero-copy path an engine uses: its
tensors are staged there); GET scatters them back into the region. Cells
alternate with the baseline (median of ``--reps`` passes), every GET is
checked against what was PUT (outside the timed loop, on a sample), and
each result is printed as a ``RESULT`` line with its ratio.

    python3 scripts/python-client-bench.py --kvtier target/release/kvtier
    python3 scripts/python-client-bench.py --quick     # CI smoke, small

Needs numpy and the connector package on the path (``PYTHONPATH=connector``
or the test venv, where ``pip install -e connector`` put it).
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, TypeVar

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "connector"))
from kvtier import GetResult, KvtierClient, Pending, Region  # noqa: E402
from kvtier import _frames as fr  # noqa: E402

ROTATE = 256 << 20
T = TypeVar("T")


def parse_size(s: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * units[s[-1].upper()] if s[-1].upper() in units else int(s)


def start_daemon(binary: str, tmp: Path, ram: str) -> tuple[subprocess.Popen[bytes], Path]:
    sock = tmp / "bench.sock"
    cmd = [
        binary, "node", "start",
        "--data-dir", str(tmp / "data"),
        "--socket", str(sock),
        "--resp-listen", "off",
        "--http-listen", "off",
        "--ram-budget", ram,
        "--disk-budget", "0",
        "--log-level", "warn",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    log = open(tmp / "daemon.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + 30
    while True:
        if proc.poll() is not None:
            sys.exit(f"the daemon exited with {proc.returncode}: {(tmp / 'daemon.log').read_text()[-2000:]}")
        s = socket.socket(socket.AF_UNIX)
        try:
            s.connect(str(sock))
            return proc, sock
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                sys.exit("the daemon's socket did not appear within 30 s")
            time.sleep(0.02)
        finally:
            s.close()


def memcpy_cold(src: np.ndarray, dst: np.ndarray, size: int, total: int) -> float:
    """GB/s of `total` bytes in `size` copies, rotating through both arrays."""
    slots = ROTATE // size
    n = total // size
    t = time.perf_counter()
    for i in range(n):
        s = (i % slots) * size
        d = ((i * 7 + 3) % slots) * size
        np.copyto(dst[d : d + size], src[s : s + size])
    return total / (time.perf_counter() - t) / 1e9


def cpu_seconds(pid: int | None = None) -> float:
    """CPU time (user + system, all threads) of this process, or of `pid`."""
    if pid is None:
        return time.process_time()
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def minor_faults(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def run_links(share, links: int) -> float:
    """Runs `share(link)` for every link on its own thread (the first on
    this one); returns the wall time. A failure in any share fails the run."""
    errors: list[BaseException] = []

    def guarded(link: int) -> None:
        try:
            share(link)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(1, links)]
    t = time.perf_counter()
    for th in threads:
        th.start()
    guarded(0)
    for th in threads:
        th.join()
    elapsed = time.perf_counter() - t
    if errors:
        sys.exit(f"a connection failed: {errors[0]}")
    return elapsed


def drive(requests: range, submit: Callable[[int], Pending[T]], check: Callable[[T], None], depth: int) -> None:
    """Submits each request, keeping at most `depth` in flight, and checks
    the replies in order."""
    window: collections.deque[Pending[T]] = collections.deque()
    for q in requests:
        if len(window) >= depth:
            check(window.popleft().wait())
        window.append(submit(q))
    while window:
        check(window.popleft().wait())


def key(i: int) -> bytes:
    return i.to_bytes(8, "little") * 4


def lookup_latency(c: KvtierClient, ns: bytes, entries: int, iters: int) -> None:
    """LOOKUP of 1,024 random present keys among `entries` (inserted first,
    64-byte chunks), keys in the frame and in the region, and PING, each
    with this client polling for the reply (its default, while a CPU is
    spare) and without (spin 0), interleaved. The daemon polls as its
    defaults say (`native-spin`)."""
    from kvtier.client import DEFAULT_SPIN, may_poll

    payload = bytes(64)
    for base in range(0, entries, 1024):
        items = [(key(2 << 40 | i), payload) for i in range(base, min(entries, base + 1024))]
        if c.put(ns, items) != ["ok"] * len(items):
            sys.exit("the LOOKUP set-up PUT failed")
    rng = np.random.default_rng(11)
    region_at = c.region.size - 32 * 1024
    rows: dict[str, list[float]] = collections.defaultdict(list)
    for it in range(iters):
        ids = rng.integers(0, entries, 1024)
        keys = [key(2 << 40 | int(i)) for i in ids]
        c.region.buffer[region_at : region_at + 32 * 1024] = b"".join(keys)
        for spin in (DEFAULT_SPIN, 0.0) if it % 2 == 0 else (0.0, DEFAULT_SPIN):
            c.spin = spin
            tag = "poll" if spin else "no poll"
            t = time.perf_counter()
            r = c.lookup(ns, keys)
            rows[f"frame, {tag}"].append(time.perf_counter() - t)
            t = time.perf_counter()
            r2 = c.lookup_in_region(ns, region_at, 1024)
            rows[f"region, {tag}"].append(time.perf_counter() - t)
            t = time.perf_counter()
            c.ping()
            rows[f"PING, {tag}"].append(time.perf_counter() - t)
            if r.prefix != 1024 or r2.prefix != 1024:
                sys.exit(f"LOOKUP found {r.prefix} / {r2.prefix} of 1,024 present keys")
    c.spin = DEFAULT_SPIN
    with open("/proc/loadavg") as f:
        load = f.read().strip()
    print(
        f"LOOKUP of 1,024 random present keys in {entries} entries, {iters} each "
        f"(client poll {DEFAULT_SPIN * 1e6:.0f} us while a CPU is spare; spare now: {may_poll()}; load {load})"
    )
    for name, lat in rows.items():
        lat.sort()
        p50, p99 = lat[len(lat) // 2] * 1e6, lat[len(lat) * 99 // 100] * 1e6
        target = "" if name.startswith("PING") else f" (target 50 us: {p50 / 50:.2f}x of target)"
        print(f"RESULT python LOOKUP {name}: p50 {p50:.1f} us p99 {p99:.1f} us{target}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kvtier", default=str(ROOT / "target" / "release" / "kvtier"), help="daemon binary")
    ap.add_argument("--cells", default="256K/1,256K/16,1M/1,1M/16,4M/1,4M/4", help="SIZE/BATCH list")
    ap.add_argument("--mib", type=int, default=512, help="MiB moved per measurement")
    ap.add_argument("--reps", type=int, default=5, help="interleaved passes per cell (median)")
    ap.add_argument(
        "--links",
        type=int,
        default=1,
        help="connections, each with its own region and thread, sharing the requests "
        "(as the vLLM connector's save_links / load_links); 1: one request in flight",
    )
    ap.add_argument(
        "--depth",
        type=int,
        default=1,
        help="requests in flight per connection (submit_put / submit_get, waited in order); "
        "1: each request waits for its reply",
    )
    ap.add_argument("--lookup-entries", type=int, default=65536, help="chunks stored for the LOOKUP figure (0: skip it)")
    ap.add_argument("--lookup-iters", type=int, default=2000, help="LOOKUPs of each kind measured")
    ap.add_argument("--quick", action="store_true", help="small and fast (CI smoke)")
    args = ap.parse_args()
    if args.quick:
        args.mib, args.reps, args.cells = 32, 1, "256K/1,1M/4"
        args.lookup_entries, args.lookup_iters = 4096, 50
    if args.depth < 1:
        sys.exit("--depth must be at least 1")
    if not Path(args.kvtier).exists():
        debug = ROOT / "target" / "debug" / "kvtier"
        if args.kvtier.endswith("release/kvtier") and debug.exists():
            args.kvtier = str(debug)
        else:
            sys.exit(f"{args.kvtier} does not exist: cargo build --release -p kvtier-cli")
    total = args.mib << 20
    cells = [(parse_size(c.split("/")[0]), int(c.split("/")[1])) for c in args.cells.split(",")]

    rng = np.random.default_rng(7)
    src = rng.integers(0, 256, ROTATE, dtype=np.uint8)
    dst = np.zeros(ROTATE, dtype=np.uint8)
    dst[:] = 1  # touch every page
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        # RAM for one measurement's chunks and then some: PUTs replace
        # nothing (fresh keys) and evict the oldest once the budget is full.
        ram = (2 * args.mib + 64) << 20
        proc, sock = start_daemon(args.kvtier, tmp, f"{ram >> 20}MiB")
        try:
            links = []
            for _ in range(args.links):
                c = KvtierClient(sock, region_size=0, timeout=60)
                region = Region(ROTATE)
                c.set_region(region)
                r = region.numpy()
                r[:] = src  # payload bytes, and every page touched
                ns = c.hello({"model": "python-client-bench", "engine": "bench", "tp-size": 1})
                links.append((c, r))
            print(
                f"python client vs cold memcpy ({args.mib} MiB per measurement, median of {args.reps}, "
                f"{args.links} connection(s), {args.depth} request(s) in flight on each; daemon {args.kvtier}; "
                f"Python {sys.version.split()[0]}, numpy {np.__version__}, CRC32C {fr.CRC32C_IMPL})"
            )
            # Fill the RAM budget once, so that measured PUTs run as in a
            # full tier (each evicts the oldest chunk and reuses its memory)
            # rather than growing the daemon's heap into fresh pages, which
            # costs a page fault per 4 KiB (a one-time cost of a new daemon).
            c0, _ = links[0]
            fill = 4 << 20
            for q in range(ram // fill + 1):
                if c0.put(ns, [(key(1 << 40 | q), ((q % (ROTATE // fill)) * fill, fill))]) != ["ok"]:
                    sys.exit("the warm-up PUT failed")
            print(
                f"{'cell':>10} {'PUT GB/s':>9} {'GET GB/s':>9} {'memcpy':>8} {'PUT':>6} {'GET':>6}"
                "   CPU us per request, client / daemon: PUT, GET"
            )
            next_key = 0
            for size, batch in cells:
                slots = ROTATE // size
                per_req = size * batch
                n_req = max(args.links, total // per_req)
                # Replace the RAM tier's chunks with chunks of this size
                # first (as the native bench does): a tier full of other
                # sizes made the first pass fault the allocator's memory in
                # (~30 page faults per request measured in the daemon).
                for q in range(ram // size + 1):
                    if c0.put(ns, [(key(3 << 40 | next_key), ((q % slots) * size, size))]) != ["ok"]:
                        sys.exit("the warm-up PUT failed")
                    next_key += 1
                puts, gets, bases = [], [], []
                # CPU per request (all passes): client process, daemon.
                cpu = {"put": [0.0, 0.0], "get": [0.0, 0.0]}
                faults = {"put": 0, "get": 0}

                def timed(kind: str, share: Callable[[int], None]) -> float:
                    c0, d0, f0 = cpu_seconds(), cpu_seconds(proc.pid), minor_faults(proc.pid)
                    wall = run_links(share, args.links)
                    faults[kind] += minor_faults(proc.pid) - f0
                    cpu[kind][0] += cpu_seconds() - c0
                    cpu[kind][1] += cpu_seconds(proc.pid) - d0
                    return wall

                for _ in range(args.reps):
                    bases.append(memcpy_cold(src, dst, size, n_req * per_req))
                    keys = [key(next_key + i) for i in range(n_req * batch)]
                    next_key += n_req * batch

                    def put_share(link: int) -> None:
                        # Requests link, link + links, ...; chunk j of the
                        # pass comes from region slot j % slots.
                        c, _ = links[link]

                        def submit(q: int) -> Pending[list[str]]:
                            items = []
                            for b in range(batch):
                                j = q * batch + b
                                items.append((keys[j], ((j % slots) * size, size)))
                            return c.submit_put(ns, items)

                        def check(codes: list[str]) -> None:
                            if codes != ["ok"] * batch:
                                raise RuntimeError(f"PUT failed: {codes}")

                        drive(range(link, n_req, args.links), submit, check, args.depth)

                    def get_share(link: int) -> None:
                        # Chunk j lands in slot (7j + 3) % slots.
                        c, _ = links[link]

                        def submit(q: int) -> Pending[list[GetResult]]:
                            ks, into = [], []
                            for b in range(batch):
                                j = q * batch + b
                                ks.append(keys[j])
                                into.append((((j * 7 + 3) % slots) * size, size))
                            return c.submit_get(ns, ks, into=into)

                        def check(res: list[GetResult]) -> None:
                            if not all(x.hit for x in res):
                                raise RuntimeError(f"GET missed: {[x.status for x in res]}")

                        drive(range(link, n_req, args.links), submit, check, args.depth)

                    puts.append(n_req * per_req / timed("put", put_share) / 1e9)
                    gets.append(n_req * per_req / timed("get", get_share) / 1e9)
                    # Check a sample: the last request of each link came back
                    # byte-exact (GET rewrote region slots; restore them).
                    for link, (_, r) in enumerate(links):
                        q = max(q for q in range(link, n_req, args.links))
                        for b in range(batch):
                            j = q * batch + b
                            got = r[((j * 7 + 3) % slots) * size :][:size]
                            want = src[(j % slots) * size :][:size]
                            if not np.array_equal(got, want):
                                sys.exit(f"GET of chunk {j} returned other bytes")
                        r[:] = src
                put, get, base = statistics.median(puts), statistics.median(gets), statistics.median(bases)
                cell = f"{size >> 10}K x{batch}"
                tag = f"{cell} ({args.links} conn, depth {args.depth})"
                us = {k: [v * 1e6 / (n_req * args.reps) for v in cv] for k, cv in cpu.items()}
                print(
                    f"{cell:>10} {put:9.2f} {get:9.2f} {base:8.2f} {put / base:5.2f}x {get / base:5.2f}x"
                    f"   {us['put'][0]:.0f} / {us['put'][1]:.0f}, {us['get'][0]:.0f} / {us['get'][1]:.0f}"
                    f"   daemon page faults per request: {faults['put'] / (n_req * args.reps):.1f}, "
                    f"{faults['get'] / (n_req * args.reps):.1f}"
                )
                print(f"RESULT python PUT {tag}: {put:.2f} GB/s vs cold memcpy {base:.2f} GB/s = {put / base:.2f}x")
                print(f"RESULT python GET {tag}: {get:.2f} GB/s vs cold memcpy {base:.2f} GB/s = {get / base:.2f}x")
            if args.lookup_entries:
                lookup_latency(links[0][0], ns, args.lookup_entries, args.lookup_iters)
            for c, _ in links:
                c.close()
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
