"""LMCache 0.5.6's own ``resp://`` remote backend against a real kvtier daemon.

The backend is built exactly as the engine builds it
(``LMCacheEngineConfig`` with ``remote_url="resp://..."`` then
``CreateStorageBackends``), for two ranks of one model, with real
``CacheEngineKey`` objects. Chunks are stored, checked with
``batched_async_contains`` and loaded back byte-exact through LMCache's
native RESP client.

Every call into LMCache has a time limit: a misbehaving server makes that
client hang rather than fail.

Run by ``scripts/test.d/45-lmcache.sh`` inside the LMCache venv; skipped
elsewhere (LMCache not installed).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lmcache")

from lmcache.utils import CacheEngineKey  # noqa: E402
from lmcache.v1.memory_management import MemoryFormat  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402
from lmcache.v1.storage_backend import CreateStorageBackends  # noqa: E402

from kvtier.lmcache import lmcache_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
CALL_TIMEOUT = 20.0
MODEL = "kvtier-test/llama-tiny"
WORLD = 2
CHUNK_TOKENS = 256
# (layers, 2, chunk tokens, kv heads, head size): 4*2*256*2*64 bf16 = 512 KiB per chunk.
KV_SHAPE = (4, 2, CHUNK_TOKENS, 2, 64)
CHUNKS = 12


def _binary() -> Path:
    return Path(os.environ.get("KVTIER_BIN", ROOT / "target" / "debug" / "kvtier"))


class Daemon:
    def __init__(self, proc: subprocess.Popen[bytes], port: int, log: Path) -> None:
        self.proc, self.port, self.log = proc, port, log

    def resp(self, *args: bytes) -> bytes:
        """One raw RESP command; returns the raw reply (small replies only)."""
        req = b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)
        with socket.create_connection(("127.0.0.1", self.port), timeout=CALL_TIMEOUT) as s:
            s.sendall(req)
            out = b""
            while not out.endswith(b"\r\n"):
                chunk = s.recv(65536)
                if not chunk:
                    break
                out += chunk
            if out.startswith(b"$") and not out.startswith(b"$-1"):
                n = int(out[1 : out.index(b"\r\n")])
                while len(out) < out.index(b"\r\n") + 2 + n + 2:
                    out += s.recv(65536)
            return out


@pytest.fixture(scope="module")
def resp_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    binary = _binary()
    if not binary.exists():
        pytest.fail(f"{binary} does not exist (cargo build -p kvtier-cli)")
    tmp = tmp_path_factory.mktemp("kvtier-lmcache")
    log = tmp / "daemon.log"
    cmd = [
        str(binary), "node", "start",
        "--data-dir", str(tmp / "data"),
        "--socket", str(tmp / "s.sock"),
        "--ram-budget", "1GiB",
        "--disk-budget", "0",
        "--resp-listen", "127.0.0.1:0",
        "--http-listen", "off",
    ]  # fmt: skip
    with open(log, "wb") as out:
        # KVTIER_* variables are daemon settings: do not hand it ours.
        env = {k: v for k, v in os.environ.items() if k != "KVTIER_BIN"}
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    port = None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and proc.poll() is None:
        m = re.search(r"resp\s+127\.0\.0\.1:(\d+)", log.read_text(errors="replace"))
        if m:
            port = int(m.group(1))
            break
        time.sleep(0.05)
    if port is None:
        proc.kill()
        proc.wait(10)
        pytest.fail(f"daemon did not report its RESP address:\n{log.read_text(errors='replace')[-3000:]}")
    try:
        yield Daemon(proc, port, log)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


class Rank:
    """One engine rank: its own event loop thread and LMCache backends."""

    def __init__(self, port: int, rank: int) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.metadata = LMCacheMetadata(
            model_name=MODEL,
            world_size=WORLD,
            local_world_size=WORLD,
            worker_id=rank,
            local_worker_id=rank,
            kv_dtype=torch.bfloat16,
            kv_shape=KV_SHAPE,
            chunk_size=CHUNK_TOKENS,
        )
        self.config = lmcache_config(
            f"127.0.0.1:{port}", chunk_size=CHUNK_TOKENS, max_local_cpu_size=0.25, blocking_timeout_secs=10
        )
        backends = CreateStorageBackends(self.config, self.metadata, self.loop)
        self.cpu = backends["LocalCPUBackend"]
        remotes = [b for name, b in backends.items() if name.startswith("RemoteBackend")]
        assert len(remotes) == 1, list(backends)
        self.remote = remotes[0]

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(CALL_TIMEOUT)

    def chunk(self, seed: int) -> tuple[Any, bytes]:
        obj = self.cpu.allocate(self.metadata.get_shapes(), self.metadata.get_dtypes(), MemoryFormat.KV_2LTD)
        assert obj is not None, "LocalCPUBackend could not allocate"
        t = obj.tensor
        g = torch.Generator().manual_seed(seed)
        flat = t.view(torch.uint8).view(-1)
        flat.copy_(torch.randint(0, 256, (flat.numel(),), dtype=torch.uint8, generator=g))
        return obj, bytes(flat.numpy().tobytes())

    def stop(self) -> None:
        # RemoteBackend.close() can deadlock its own loop (LMCache 0.5.6): stop the loop only.
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def key(rank: int, chunk_hash: int) -> Any:
    return CacheEngineKey(MODEL, WORLD, rank, chunk_hash, torch.bfloat16)


class PutWaiter:
    """Counts LMCache's per-key completion callbacks of fire-and-forget puts."""

    def __init__(self, n: int) -> None:
        self.n, self.done, self.cv = n, 0, threading.Condition()

    def __call__(self, _key: Any) -> None:
        with self.cv:
            self.done += 1
            self.cv.notify_all()

    def wait(self) -> None:
        with self.cv:
            assert self.cv.wait_for(lambda: self.done >= self.n, CALL_TIMEOUT), (
                f"{self.done} of {self.n} puts completed in time"
            )


def test_two_ranks_store_check_and_load_byte_exact(resp_daemon: Daemon) -> None:
    ranks = [Rank(resp_daemon.port, r) for r in range(WORLD)]
    try:
        # The default chunk hash can be negative: keys then contain '-'.
        hashes = [(-1) ** i * (0x448569D442B6A772 + 7919 * i) for i in range(CHUNKS)]
        stored: dict[tuple[int, int], bytes] = {}
        for r, rank in enumerate(ranks):
            keys = [key(r, h) for h in hashes]
            assert rank.run(rank.remote.batched_async_contains(f"miss-{r}", keys, False)) == 0
            objs = []
            for i, h in enumerate(hashes):
                obj, data = rank.chunk(seed=1000 * r + i)
                objs.append(obj)
                stored[(r, h)] = data
            waiter = PutWaiter(len(keys))
            rank.remote.batched_submit_put_task(keys, objs, on_complete_callback=waiter)
            waiter.wait()
            assert rank.remote.put_failed_count == 0

        # Every chunk is present; a missing one in the middle ends the prefix.
        for r, rank in enumerate(ranks):
            keys = [key(r, h) for h in hashes]
            assert rank.run(rank.remote.batched_async_contains(f"all-{r}", keys, False)) == CHUNKS
            gap = keys[:5] + [key(r, 12345)] + keys[5:]
            assert rank.run(rank.remote.batched_async_contains(f"gap-{r}", gap, False)) == 5

        # Loads are byte-exact, and each rank gets its own bytes for the same chunk hash.
        for r, rank in enumerate(ranks):
            for h in hashes:
                obj = rank.remote.get_blocking(key(r, h))
                assert obj is not None, f"rank {r} chunk {h:x} missing"
                got = bytes(obj.tensor.view(torch.uint8).view(-1).numpy().tobytes())
                assert len(got) == len(stored[(r, h)])
                assert got == stored[(r, h)], f"rank {r} chunk {h:x} differs"
                assert got != stored[(1 - r, h)]
                obj.ref_count_down()

        # The daemon holds one namespace per rank: the raw keys as LMCache wrote them.
        k0 = key(0, hashes[1]).to_string().encode()
        assert b"-" in k0
        assert resp_daemon.resp(b"EXISTS", k0, key(1, hashes[1]).to_string().encode()) == b":2\r\n"
        assert resp_daemon.resp(b"DBSIZE") == b":%d\r\n" % (WORLD * CHUNKS)
    finally:
        for rank in ranks:
            rank.stop()
