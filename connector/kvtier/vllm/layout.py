"""What both roles derive from vLLM's config: groups, chunk size, namespace record."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from typing import Any

from kvtier.vllm.config import KvtierConfig
from kvtier.vllm.namespace import (
    GroupLayout,
    build_record,
    default_info,
    hash_algo_is_reproducible,
    layout_fingerprint,
)

logger = logging.getLogger("kvtier.vllm")


class Unsupported(Exception):
    """The engine's configuration is one this connector cannot serve (yet)."""


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def group_layouts(kv_cache_config: Any) -> list[GroupLayout]:
    """The KV-cache groups the connector stores, or Unsupported.

    Every group that takes part in KV transfer must be a full-attention group
    (MLA included): sliding-window and Mamba groups keep only part of the
    prefix, so restoring the full-attention groups alone would leave them
    unwritten (not implemented yet).
    """
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    groups = []
    for gid in kv_cache_config.transfer_group_ids:
        group = kv_cache_config.kv_cache_groups[gid]
        spec = group.kv_cache_spec
        if not isinstance(spec, FullAttentionSpec) or not spec.prefix_cacheable:
            raise Unsupported(
                f"KV-cache group {gid} has spec {type(spec).__name__}; kvtier stores only "
                "full-attention groups (sliding-window / Mamba hybrids: not implemented yet)"
            )
        if spec.tokens_per_state != 1:
            raise Unsupported(f"KV-cache group {gid}: compressed states are not supported yet")
        spec_text = (
            f"{type(spec).__name__}/h{spec.num_heads}/k{spec.head_size}/v{spec.head_size_v}/"
            f"{_dtype_name(spec.dtype)}/{getattr(spec.kv_quant_mode, 'name', spec.kv_quant_mode)}"
        )
        groups.append(
            GroupLayout(
                group_id=gid,
                layer_names=tuple(group.layer_names),
                block_size=int(spec.block_size),
                page_bytes=int(spec.real_page_size_bytes),
                spec=spec_text,
            )
        )
    if not groups:
        raise Unsupported("the model has no KV-cache group that takes part in KV transfer")
    sizes = {g.block_size for g in groups}
    if len(sizes) != 1:
        raise Unsupported(f"KV-cache groups with different block sizes {sorted(sizes)}: not supported yet")
    return groups


@dataclass(frozen=True)
class EngineLayout:
    """Everything derived once from the vLLM config, identical on every rank."""

    groups: tuple[GroupLayout, ...]
    block_size: int
    hash_block_size: int
    chunk_blocks: int
    tp_size: int
    hash_algo: str
    #: The namespace record without a meaningful rank (set per rank).
    record: dict[str, Any]

    @property
    def chunk_tokens(self) -> int:
        """Tokens per chunk."""
        return self.block_size * self.chunk_blocks

    @property
    def hashes_per_chunk(self) -> int:
        """`request.block_hashes` entries per chunk."""
        return self.chunk_tokens // self.hash_block_size

    def record_for_rank(self, rank: int) -> dict[str, Any]:
        """The namespace record of one rank."""
        return {**self.record, "rank": int(rank)}

    def chunk_keys(self, block_hashes: Any, max_tokens: int) -> list[bytes]:
        """Keys of the full chunks among the first `max_tokens` tokens: the chained
        block hash of the last hash block of each chunk."""
        n = min(len(block_hashes) // self.hashes_per_chunk, max_tokens // self.chunk_tokens)
        hpc = self.hashes_per_chunk
        return [bytes(block_hashes[(c + 1) * hpc - 1]) for c in range(n)]


#: Model configuration fields that change the K/V bytes of a token beyond what
#: the layout fences already (heads, head size, layer count, dtype): the
#: positional encoding and its scaling, attention windows. Read from the
#: configuration as built from the engine's arguments: a model's
#: constructor may change other fields in the workers only (MiniMax-M2 sets
#: max_model_len, Telechat2 its bias flags), and the scheduler, which never
#: builds the model, must derive the same namespace.
KV_CONFIG_FIELDS = (
    "rope_scaling", "rope_theta", "rope_parameters", "rope_type", "partial_rotary_factor", "rotary_dim",
    "position_embedding_type", "sliding_window", "use_sliding_window", "max_window_layers", "layer_types",
    "attention_chunk_size", "attn_logit_softcapping", "num_attention_heads", "num_key_value_heads",
    "head_dim", "hidden_size", "num_hidden_layers",
)


def _plain(v: Any) -> Any:
    """JSON for what `json` cannot write, the same in every process: a set
    sorted, a function or class by its qualified name, anything else by its
    type (never a str() that may hold a memory address)."""
    if isinstance(v, (set, frozenset)):
        return sorted(map(str, v))
    if callable(v) and hasattr(v, "__qualname__"):
        return f"{getattr(v, '__module__', '')}.{v.__qualname__}"
    return f"<{type(v).__module__}.{type(v).__qualname__}>"


def model_fingerprint(model: Any) -> str:
    """A hash of what besides the model path changes the K/V bytes: the
    engine's `hf_overrides`, the fields of KV_CONFIG_FIELDS of the loaded
    configuration (overrides applied: RoPE scaling ...) and the weight
    quantization. Two engines on one model path with other settings then
    never share chunks."""
    parts: dict[str, Any] = {
        "quantization": str(getattr(model, "quantization", None)),
        "hf_overrides": getattr(model, "hf_overrides", None) or None,
    }
    hf = getattr(model, "hf_text_config", None) or getattr(model, "hf_config", None)
    if hf is not None:
        for name in KV_CONFIG_FIELDS:
            if hasattr(hf, name):
                parts[name] = getattr(hf, name)
    blob = json.dumps(parts, sort_keys=True, default=_plain)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def engine_layout(vllm_config: Any, kv_cache_config: Any, cfg: KvtierConfig) -> EngineLayout:
    """Derives the layout; raises Unsupported when the engine cannot be served."""
    import vllm

    groups = group_layouts(kv_cache_config)
    block_size = groups[0].block_size
    hash_block_size = int(getattr(kv_cache_config, "hash_block_size", None) or vllm_config.cache_config.block_size)
    if block_size % hash_block_size:
        raise Unsupported(f"block size {block_size} is not a multiple of the hash block size {hash_block_size}")
    cache = vllm_config.cache_config
    model = vllm_config.model_config
    hash_algo = str(cache.prefix_caching_hash_algo)
    kv_dtype = str(cache.cache_dtype)
    if kv_dtype == "auto":
        kv_dtype = _dtype_name(model.dtype) if model is not None else "auto"
    tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
    pcp = int(getattr(vllm_config.parallel_config, "prefill_context_parallel_size", 1) or 1)
    dcp = int(getattr(vllm_config.parallel_config, "decode_context_parallel_size", 1) or 1)
    pp = int(getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1) or 1)
    if pcp != 1 or dcp != 1 or pp != 1:
        raise Unsupported(
            f"pipeline/context parallelism (pp={pp}, pcp={pcp}, dcp={dcp}) is not supported yet"
        )
    layout = layout_fingerprint(groups, cfg.chunk_blocks)
    layout += f";kv-layout:{getattr(kv_cache_config, 'kv_cache_layout', None)}"
    if model is not None:
        layout += f";model-config:{model_fingerprint(model)}"
    model_name = str(model.model) if model is not None else ""
    revision = cfg.model_revision or str((model.revision if model is not None else None) or "")
    record = build_record(
        model=model_name,
        model_revision=revision,
        engine_version=str(vllm.__version__),
        tp_size=tp_size,
        rank=0,
        kv_dtype=kv_dtype,
        block_size=block_size,
        chunk_tokens=block_size * cfg.chunk_blocks,
        hash_algo=hash_algo,
        layout=layout,
        salt=cfg.salt,
        info=default_info(),
    )
    return EngineLayout(
        groups=tuple(groups),
        block_size=block_size,
        hash_block_size=hash_block_size,
        chunk_blocks=cfg.chunk_blocks,
        tp_size=tp_size,
        hash_algo=hash_algo,
        record=record,
    )


def reproducible(layout: EngineLayout) -> bool:
    """Whether keys are stable across processes; logs why not."""
    if hash_algo_is_reproducible(layout.hash_algo):
        return True
    logger.warning(
        "kvtier: prefix_caching_hash_algo=%s without PYTHONHASHSEED gives block hashes that "
        "differ in every process; kvtier will neither store nor load (set "
        "--prefix-caching-hash-algo sha256_cbor, or a fixed PYTHONHASHSEED on every node)",
        layout.hash_algo,
    )
    return False
