"""kvtier: Python side of the kvtier KV-cache tier.

- :mod:`kvtier.client`: the native-protocol client (:class:`KvtierClient`).
- ``kvtier.vllm``: the vLLM connector (built on the client).
"""

from .client import (
    ClusterLookupResult,
    GetResult,
    KvtierClient,
    KvtierError,
    KvtierProtocolError,
    KvtierUnavailable,
    LookupResult,
    Pending,
    RankPrefix,
    Region,
)

__all__ = [
    "ClusterLookupResult",
    "GetResult",
    "KvtierClient",
    "KvtierError",
    "KvtierProtocolError",
    "KvtierUnavailable",
    "LookupResult",
    "Pending",
    "RankPrefix",
    "Region",
]
