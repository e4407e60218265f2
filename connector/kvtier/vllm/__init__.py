"""kvtier's vLLM connector: `KvtierConnector` for vLLM 0.33.

Load it with `kv_connector_module_path: "kvtier.vllm"` and
`kv_connector: "KvtierConnector"` (see docs/vllm.md). Importing this package
fails with a clear message naming the supported versions when the installed
vLLM's connector interface is not the supported one. Without vLLM installed
at all, the package imports (its worker I/O modules serve
scripts/gpu-e2e.py on machines without vLLM), and asking for
`KvtierConnector` raises that same error.
"""

from typing import Any

from kvtier.vllm.compat import SUPPORTED_VLLM, UnsupportedVllm, check_vllm, vllm_installed
from kvtier.vllm.config import ConfigError, KvtierConfig

VLLM_VERSION = check_vllm() if vllm_installed() else None

if VLLM_VERSION is not None:
    from kvtier.vllm.connector import KvtierConnector


def __getattr__(name: str) -> Any:
    if name == "KvtierConnector":
        check_vllm()  # raises UnsupportedVllm naming the supported versions
    raise AttributeError(name)


__all__ = ["KvtierConnector", "KvtierConfig", "ConfigError", "SUPPORTED_VLLM", "UnsupportedVllm", "VLLM_VERSION"]
