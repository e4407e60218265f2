"""Page gathers and scatters between vLLM's KV cache views and the staging area.

The staging area is the client's shared-memory region (the daemon copies
chunk bytes straight out of / into it). On CUDA it is registered with
`cudaHostRegister`, so the GPU's DMA reads and writes it at pinned-memory
speed; pages are gathered on the GPU first (one `index_select` per layer and
batch, not one copy per page) so that each batch is a single DMA.

A chunk payload of one group is, per layer of the group (in order), the
chunk's blocks' logical `[H, N, C]` pages, as raw bytes: `[layers, blocks,
page_bytes]`, contiguous. The physical `KVCacheLayout` of the engine does not
matter: `index_select` / `index_copy_` follow the strides.
"""

from __future__ import annotations

import logging
import time

import torch

logger = logging.getLogger("kvtier.vllm")


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A `[B, H, N, C*itemsize]` uint8 view of a `[B, H, N, C]` layer view."""
    if t.dim() != 4:
        raise ValueError(f"expected a [B, H, N, C] KV cache view, got shape {tuple(t.shape)}")
    if t.dtype == torch.uint8:
        return t
    if t.stride(-1) != 1:
        raise ValueError("the last dimension of a KV cache view must be contiguous")
    return t.view(torch.uint8)


def page_bytes(t: torch.Tensor) -> int:
    """Bytes of one block's logical page."""
    return int(t[0].numel() * t.element_size())


class Staging:
    """A byte tensor over a shared-memory region, pinned for CUDA when possible."""

    def __init__(self, region: memoryview, address: int, device: torch.device):
        self.tensor = torch.frombuffer(region, dtype=torch.uint8)
        self.nbytes = self.tensor.numel()
        self.device = device
        self._registered = 0
        if device.type == "cuda" and self.nbytes:
            # SAFETY (of the raw pointer): the region stays mapped while the
            # client's connection lives; `close()` unregisters it first.
            err = torch.cuda.cudart().cudaHostRegister(address, self.nbytes, 0)
            if int(err) != 0:
                logger.warning("kvtier: cudaHostRegister of the staging area failed (%s); copies will be pageable", err)
            else:
                self._registered = address

    def close(self) -> None:
        """Unregisters the region (before its connection closes)."""
        if self._registered:
            torch.cuda.cudart().cudaHostUnregister(self._registered)
            self._registered = 0

    def rows(self, n: int, layers: int, blocks: int, page: int, offset: int = 0) -> torch.Tensor:
        """`n` chunk slots from byte `offset` as `[n, layers, blocks, page]`."""
        return self.tensor[offset : offset + n * layers * blocks * page].view(n, layers, blocks, page)


# On CPU the copies run through numpy: torch's OpenMP-parallel CPU kernels,
# called from the connector's I/O threads while the engine's thread runs its
# own, deadlock (seen with PyPI torch 2.15); numpy copies use no thread pool.


def gather(
    layers: list[torch.Tensor],
    block_ids: list[int],
    n: int,
    cb: int,
    staging: Staging,
    use_numpy: bool | None = None,
    offset: int = 0,
    timing: dict[str, float] | None = None,
) -> None:
    """Copies `n` chunks of `cb` blocks (block_ids, chunk-major) of every layer into staging
    from byte `offset`. `use_numpy` defaults to "on CPU". On CUDA the copies are queued on
    the current stream (the caller synchronizes). `timing`: adds seconds spent per phase
    ("gather" on the device, "d2h" into staging), synchronizing between them (profiling only)."""
    dev = staging.device
    page = layers[0][0].numel()
    t0 = time.perf_counter()
    if dev.type == "cpu" if use_numpy is None else use_numpy:
        out = staging.rows(n, len(layers), cb, page, offset).numpy()
        for li, t in enumerate(layers):
            out[:, li] = t.numpy()[block_ids].reshape(n, cb, page)
        _add(timing, "gather", t0)
        return
    ids = torch.tensor(block_ids, dtype=torch.long, device=dev)
    dst = staging.rows(n, len(layers), cb, page, offset)
    buf = dst if dev.type == "cpu" else torch.empty(dst.shape, dtype=torch.uint8, device=dev)
    for li, t in enumerate(layers):
        buf[:, li].copy_(t.index_select(0, ids).view(n, cb, page))
    if timing is not None:
        _sync(dev)
        t0 = _add(timing, "gather", t0)
    if buf is not dst:
        dst.copy_(buf, non_blocking=True)
    if timing is not None:
        _sync(dev)
        _add(timing, "d2h", t0)


def scatter(
    layers: list[torch.Tensor],
    n: int,
    cb: int,
    staging: Staging,
    rows: list[int],
    block_ids: list[int],
    use_numpy: bool | None = None,
    offset: int = 0,
    timing: dict[str, float] | None = None,
) -> None:
    """Copies staged pages (from byte `offset`) into GPU blocks: row `rows[i]` (chunk * cb +
    block) of every layer goes to block `block_ids[i]`. `use_numpy` defaults to "on CPU".
    On CUDA the copies are queued on the current stream (the caller synchronizes).
    `timing`: as for `gather`, phases "h2d" and "scatter"."""
    dev = staging.device
    page = layers[0][0].numel()
    src = staging.rows(n, len(layers), cb, page, offset)
    t0 = time.perf_counter()
    if dev.type == "cpu" if use_numpy is None else use_numpy:
        s = src.numpy()
        for li, t in enumerate(layers):
            a = t.numpy()
            a[block_ids] = s[:, li].reshape(n * cb, page)[rows].reshape(len(rows), *a.shape[1:])
        _add(timing, "scatter", t0)
        return
    if dev.type != "cpu":
        src = src.to(dev, non_blocking=True)
    if timing is not None:
        _sync(dev)
        t0 = _add(timing, "h2d", t0)
    ridx = torch.tensor(rows, dtype=torch.long, device=dev)
    bidx = torch.tensor(block_ids, dtype=torch.long, device=dev)
    for li, t in enumerate(layers):
        pages = src[:, li].reshape(n * cb, page).index_select(0, ridx)
        t.index_copy_(0, bidx, pages.view(len(rows), *t.shape[1:]))
    if timing is not None:
        _sync(dev)
        _add(timing, "scatter", t0)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.current_stream(dev).synchronize()


def _add(timing: dict[str, float] | None, phase: str, t0: float) -> float:
    """Adds the seconds since `t0` to `timing[phase]`; returns now."""
    now = time.perf_counter()
    if timing is not None:
        timing[phase] = timing.get(phase, 0.0) + now - t0
    return now
