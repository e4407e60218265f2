#!/usr/bin/env python3
"""Time the Python client's put() of many small bytes values (staged into
the shared region by the client), against a daemon started here.

    python3 scripts/python-staging-bench.py target/release/kvtier [OLD_CLIENT_PY]

With OLD_CLIENT_PY (e.g. `git show REV:connector/kvtier/client.py > old.py`)
each size is timed with that client too, side by side.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "connector"))


def load(path: str, name: str):  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(f"kvtier.{name}", path)
    assert spec and spec.loader
    m = importlib.util.module_from_spec(spec)
    m.__package__ = "kvtier"
    sys.modules[spec.name] = m
    spec.loader.exec_module(m)
    return m


def main() -> None:
    binary = sys.argv[1]
    clients = [("this", load(os.path.join(ROOT, "connector/kvtier/client.py"), "client_this"))]
    if len(sys.argv) > 2:
        clients.insert(0, ("old", load(sys.argv[2], "client_old")))
    d = tempfile.mkdtemp(prefix="kvtier-staging-")
    sock = os.path.join(d, "s.sock")
    args = [binary, "node", "start", "--data-dir", d + "/data", "--socket", sock, "--ram-budget", "1GiB",
            "--disk-budget", "0", "--resp-listen", "off", "--http-listen", "off"]
    p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(300):
            if os.path.exists(sock):
                break
            time.sleep(0.05)
        rec = {"model": "staging-bench", "engine": "bench", "tp-size": 1, "rank": 0}
        for n in (1000, 4000, 16000):
            items = [(i.to_bytes(32, "little"), b"x" * 64) for i in range(n)]
            for name, mod in clients:
                c = mod.KvtierClient(sock, region_size=64 << 20, timeout=120)
                ns = c.hello(rec)
                t0 = time.perf_counter()
                r = c.put(ns, items)
                dt = time.perf_counter() - t0
                assert r == ["ok"] * n, r[:3]
                print(f"{n:6d} values of 64 B  {name:5s} client  {dt:8.3f} s")
                c.close()
    finally:
        p.terminate()
        p.wait()


if __name__ == "__main__":
    main()
