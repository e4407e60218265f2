import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")

from harness import Daemon  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long tests, only with scripts/test --full")


@pytest.fixture
def short_tmp():
    # Unix socket paths must stay under 108 bytes: pytest's tmp_path can be longer.
    import tempfile

    with tempfile.TemporaryDirectory(prefix="kvt-") as d:
        yield Path(d)


@pytest.fixture
def daemon(short_tmp):
    d = Daemon(short_tmp, "n1").start()
    yield d
    d.stop(graceful=False)
