"""The vLLM versions this connector is written against, checked at import."""

from __future__ import annotations

import inspect
import os

#: vLLM releases whose KV connector interface this connector implements.
SUPPORTED_VLLM = ("0.33",)


class UnsupportedVllm(ImportError):
    """The installed vLLM's connector interface is not the one this connector implements."""


def check_vllm() -> str:
    """Returns vLLM's version, or raises UnsupportedVllm naming the supported versions.

    `VLLM_KVTIER_SKIP_VERSION_CHECK=1` skips the version-number check (not the
    interface check), e.g. for a 0.33 development build with another number.
    """
    supported = ", ".join(f"{v}.x" for v in SUPPORTED_VLLM)
    try:
        import vllm
        from vllm.distributed.kv_transfer.kv_connector.v1 import base
    except ImportError as e:
        raise UnsupportedVllm(f"kvtier.vllm needs vLLM {supported}; importing vLLM failed: {e}") from e
    version = str(getattr(vllm, "__version__", "unknown"))
    ok = any(version == v or version.startswith(v + ".") for v in SUPPORTED_VLLM)
    if not ok and os.environ.get("VLLM_KVTIER_SKIP_VERSION_CHECK") != "1":
        raise UnsupportedVllm(
            f"kvtier.vllm supports vLLM {supported}; this is vLLM {version}. The KV connector "
            "interface changes between releases (set VLLM_KVTIER_SKIP_VERSION_CHECK=1 to try anyway)"
        )
    missing = [
        name
        for name in ("KVConnectorBase_V1", "SupportsHMA", "KVConnectorMetadata", "KVConnectorRole", "KVConnectorTransferResults")
        if not hasattr(base, name)
    ]
    cls = getattr(base, "KVConnectorBase_V1", None)
    if cls is not None:
        params = list(inspect.signature(cls.__init__).parameters)
        if params[:4] != ["self", "vllm_config", "role", "kv_cache_config"]:
            missing.append("KVConnectorBase_V1.__init__(vllm_config, role, kv_cache_config)")
        for m in ("get_transfer_results", "get_block_ids_with_load_errors", "request_finished", "build_connector_meta"):
            if not hasattr(cls, m):
                missing.append(f"KVConnectorBase_V1.{m}")
    if missing:
        raise UnsupportedVllm(
            f"kvtier.vllm supports vLLM {supported}; vLLM {version} lacks {', '.join(missing)}"
        )
    return version


def vllm_installed() -> bool:
    """Whether a `vllm` package is importable at all."""
    import importlib.util

    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        return False
