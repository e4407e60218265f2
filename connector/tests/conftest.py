"""Fixtures: a real kvtier daemon started for the tests.

The daemon binary is ``$KVTIER_BIN`` or ``target/debug/kvtier`` at the
repository root (``cargo build -p kvtier-cli`` builds it). Tests that need a
daemon are skipped, with the reason, only when that binary is missing or
cannot start; ``scripts/test.d/30-python.sh`` sets ``REQUIRE_KVTIER_DAEMON=1``
so that CI fails instead.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "node" / "tests" / "fixtures" / "frames"


def _binary() -> Path:
    return Path(os.environ.get("KVTIER_BIN", ROOT / "target" / "debug" / "kvtier"))


def _unavailable(reason: str) -> None:
    if os.environ.get("REQUIRE_KVTIER_DAEMON"):
        pytest.fail(f"kvtier daemon required but unavailable: {reason}")
    pytest.skip(f"kvtier daemon unavailable: {reason}")


class Daemon:
    """A running `kvtier node start` process."""

    def __init__(self, proc: subprocess.Popen[bytes], socket_path: Path, log: Path) -> None:
        self.proc = proc
        self.socket_path = socket_path
        self.log = log

    def log_tail(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-3000:]
        except OSError:
            return ""


def _connectable(path: Path) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(1.0)
        s.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        s.close()


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    return FIXTURES


def _start(tmp: Path, resp_listen: str = "off") -> Iterator[Daemon]:
    """Starts `kvtier node start` with a store under `tmp` and RESP on
    `resp_listen`; stops it with SIGTERM."""
    binary = _binary()
    if not binary.exists():
        _unavailable(f"{binary} does not exist (build it with `cargo build -p kvtier-cli`)")
    sock = tmp / "s.sock"
    log = tmp / "daemon.log"
    cmd = [
        str(binary),
        "node",
        "start",
        "--data-dir",
        str(tmp / "data"),
        "--socket",
        str(sock),
        "--resp-listen",
        resp_listen,
        "--http-listen",
        "127.0.0.1:0",
        "--ram-budget",
        "512MiB",
        "--disk-budget",
        "64MiB",
        "--region-size",
        "8MiB",
        # Tests must start on a nearly full disk too (CI has had 258 MiB free).
        "--disk-reserve",
        "0",
    ]
    with open(log, "wb") as out:
        # The daemon reads every KVTIER_* variable as configuration.
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    d = Daemon(proc, sock, log)
    deadline = time.monotonic() + 30
    try:
        while not _connectable(sock):
            if proc.poll() is not None:
                _unavailable(f"`{' '.join(cmd)}` exited with {proc.returncode}:\n{d.log_tail()}")
            if time.monotonic() > deadline:
                _unavailable(f"socket {sock} not ready within 30 s:\n{d.log_tail()}")
            time.sleep(0.02)
        yield d
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    yield from _start(tmp_path_factory.mktemp("kvtier"))


def free_port() -> int:
    """A loopback TCP port that was free a moment ago."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
    finally:
        s.close()


@pytest.fixture(scope="module")
def resp_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, int]]:
    """A daemon with its RESP endpoint on a free loopback port: (daemon, port)."""
    port = free_port()
    for d in _start(tmp_path_factory.mktemp("kvtier-resp"), f"127.0.0.1:{port}"):
        yield d, port
