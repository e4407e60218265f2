"""Without vLLM the worker I/O modules import (scripts/gpu-e2e.py), the connector does not."""

import subprocess
import sys
from pathlib import Path

CODE = r"""
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None
sys.meta_path.insert(0, Block())
import kvtier.vllm as k
assert k.VLLM_VERSION is None
from kvtier.vllm.worker import KvtierWorker  # noqa: F401
try:
    k.KvtierConnector
except ImportError as e:
    assert "0.33" in str(e), e
    print("ok")
"""


def test_worker_imports_without_vllm_connector_does_not():
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120,
                       env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]
