"""kvtier's vLLM connector: `KvtierConnector` for vLLM 0.33.

Load it with `kv_connector_module_path: "kvtier.vllm"` and
`kv_connector: "KvtierConnector"` (see docs/vllm.md). Importing this package
fails with a clear message when the installed vLLM's connector interface is
not the supported one.
"""

from kvtier.vllm.compat import SUPPORTED_VLLM, UnsupportedVllm, check_vllm

VLLM_VERSION = check_vllm()

from kvtier.vllm.config import ConfigError, KvtierConfig  # noqa: E402
from kvtier.vllm.connector import KvtierConnector  # noqa: E402

__all__ = ["KvtierConnector", "KvtierConfig", "ConfigError", "SUPPORTED_VLLM", "UnsupportedVllm", "VLLM_VERSION"]
