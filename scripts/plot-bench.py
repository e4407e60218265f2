#!/usr/bin/env python3
"""Plots of `kvtier bench` JSON results: throughput vs chunk size against the
machine's limits (from `bench local`) and against Redis / LMCache (from
`bench vs`).

    scripts/plot-bench.py --local local.json --vs vs.json --out docs/img

Needs matplotlib. Without it, re-runs itself in .cache/venv-plot (created
with `python3 -m venv` and `pip install matplotlib` on first use).
"""

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ensure_matplotlib():
    try:
        import matplotlib  # noqa: F401
        return
    except ImportError:
        pass
    venv = os.path.join(ROOT, ".cache", "venv-plot")
    py = os.path.join(venv, "bin", "python")
    if os.path.abspath(sys.executable) == os.path.abspath(py):
        sys.exit("matplotlib is missing from .cache/venv-plot")
    if not os.path.exists(py):
        subprocess.check_call([sys.executable, "-m", "venv", venv])
        subprocess.check_call([py, "-m", "pip", "install", "-q", "matplotlib"])
    os.execv(py, [py] + sys.argv)


def mib(b):
    return b / (1 << 20)


def plot_local(doc, out, plt):
    cells = doc["cells"]
    limits = {s["size"]: s for s in doc["limits"]["sizes"]}
    sizes = sorted(limits)
    files = []
    for op, limit_key, limit_label, name in [
        ("PUT", "memcpy_cold_gbps", "cold memcpy, one thread (limit)", "local-put.png"),
        ("GET ram", "memcpy_cold_gbps", "cold memcpy, one thread (limit)", "local-get-ram.png"),
        ("GET disk", "direct_read_gbps", "O_DIRECT sequential read, qd1 (limit)", "local-get-disk.png"),
    ]:
        rows = [c for c in cells if c["op"] == op]
        if not rows:
            continue
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        ax.plot([mib(s) for s in sizes], [limits[s][limit_key] for s in sizes],
                "k--", marker="s", label=limit_label)
        for conc in sorted({c["concurrency"] for c in rows}):
            pts = sorted((c["size"], c["gbps"]) for c in rows if c["concurrency"] == conc)
            ax.plot([mib(s) for s, _ in pts], [g for _, g in pts], marker="o",
                    label=f"kvtier {op}, {conc} client(s)")
        ax.set_xlabel("chunk size (MiB)")
        ax.set_ylabel("GB/s")
        ax.set_ylim(bottom=0)
        ax.set_title(f"kvtier {op} via native socket + shared memory")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = os.path.join(out, name)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(path)
    return files


def plot_vs(doc, out, plt):
    cells = doc["cells"]
    files = []
    concs = sorted({c["concurrency"] for c in cells})
    for op in ("SET", "GET"):
        for conc in concs:
            fig, ax = plt.subplots(figsize=(6.4, 4.0))
            any_line = False
            for server in ("kvtier", "redis", "lmcache"):
                pts = sorted((c["size"], c["gbps"]) for c in cells
                             if c["server"] == server and c["op"] == op and c["concurrency"] == conc)
                if pts:
                    any_line = True
                    ax.plot([mib(s) for s, _ in pts], [g for _, g in pts], marker="o", label=server)
            if not any_line:
                plt.close(fig)
                continue
            ax.set_xlabel("chunk size (MiB)")
            ax.set_ylabel("GB/s")
            ax.set_ylim(bottom=0)
            ax.set_title(f"{op} over each server's protocol, {conc} client(s)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
            fig.tight_layout()
            path = os.path.join(out, f"vs-{op.lower()}-c{conc}.png")
            fig.savefig(path, dpi=110)
            plt.close(fig)
            files.append(path)
    return files


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--local", help="JSON from `kvtier bench local --json`")
    ap.add_argument("--vs", help="JSON from `kvtier bench vs --json`")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "img"))
    args = ap.parse_args()
    if not args.local and not args.vs:
        ap.error("give --local and/or --vs")
    ensure_matplotlib()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(args.out, exist_ok=True)
    files = []
    if args.local:
        with open(args.local) as f:
            files += plot_local(json.load(f), args.out, plt)
    if args.vs:
        with open(args.vs) as f:
            files += plot_vs(json.load(f), args.out, plt)
    for p in files:
        print(p)


if __name__ == "__main__":
    main()
