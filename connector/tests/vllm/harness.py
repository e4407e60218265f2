"""A CPU engine around the real vLLM 0.33 scheduler, for connector tests.

It uses vLLM's own `Scheduler`, `Request`, block hasher, `SchedulerOutput`,
`KVOutputAggregator` and `ModelRunnerOutput`; only the model is replaced: a
"forward" writes a deterministic function of (position, token prefix hash,
rank, layer) into the KV pages of the tokens it computes, so a restore can be
compared byte for byte with what a recompute would produce.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[3]


# ---- the daemon -------------------------------------------------------------


def kvtier_bin() -> str:
    """The daemon binary (built by scripts/test.d/60-vllm.sh)."""
    b = os.environ.get("KVTIER_BIN") or str(ROOT / "target" / "debug" / "kvtier")
    if not os.path.exists(b):
        raise RuntimeError(f"kvtier binary not found at {b}: run `cargo build -p kvtier-cli`")
    return b


class Daemon:
    """A real `kvtier node start` on a temp dir and a Unix socket."""

    def __init__(self, workdir: Path, name: str = "n1", extra: list[str] | None = None):
        self.dir = workdir / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.data = self.dir / "data"
        self.socket = str(self.dir / "kvtier.sock")
        self.extra = list(extra or [])
        self.proc: subprocess.Popen | None = None
        self.log = self.dir / "daemon.log"

    def start(self, timeout_s: float = 30.0) -> Daemon:
        defaults = {
            "--data-dir": str(self.data),
            "--socket": self.socket,
            "--resp-listen": "off",
            "--http-listen": "off",
            "--ram-budget": "256MiB",
            "--disk-budget": "256MiB",
            "--region-size": "16MiB",
            # Tests must start on a nearly full disk too (CI has had 258 MiB free).
            "--disk-reserve": "0",
        }
        # A flag in `extra` replaces its default (the CLI refuses a flag twice).
        args = [kvtier_bin(), "node", "start"]
        for flag, value in defaults.items():
            if flag not in self.extra:
                args += [flag, value]
        args += self.extra
        if os.path.exists(self.socket):
            os.unlink(self.socket)
        # The daemon reads every KVTIER_* variable as a config key: keep ours out.
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
        self.proc = subprocess.Popen(args, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}: {self.log.read_text()[-3000:]}")
            if os.path.exists(self.socket):
                try:
                    s = socket.socket(socket.AF_UNIX)
                    s.connect(self.socket)
                    s.close()
                    return self
                except OSError:
                    pass
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"daemon did not listen on {self.socket} in {timeout_s}s: {self.log.read_text()[-3000:]}")

    def stop(self, graceful: bool = True, timeout_s: float = 30.0) -> None:
        """SIGTERM (flushes RAM to disk) or SIGKILL; waits for the process (by pid)."""
        p, self.proc = self.proc, None
        if p is None or p.poll() is not None:
            return
        if graceful:
            p.terminate()
        else:
            p.kill()
        try:
            p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)


# ---- vLLM objects -----------------------------------------------------------

NUM_LAYERS = 2
NUM_KV_HEADS = 2
HEAD_SIZE = 16
BLOCK_SIZE = 16


def tiny_model_dir() -> str:
    """A local HF config for a tiny Llama (no weights: vLLM only reads the config)."""
    d = Path(tempfile.gettempdir()) / "kvtier-vllm-tiny-model"
    d.mkdir(exist_ok=True)
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": NUM_KV_HEADS * 2,
        "num_hidden_layers": NUM_LAYERS, "vocab_size": 1000, "max_position_embeddings": 65536,
        "torch_dtype": "bfloat16", "head_dim": HEAD_SIZE,
    }
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def make_vllm_config(extra: dict[str, Any], *, tp_size: int = 1, rank: int = 0, hash_algo: str = "sha256_cbor",
                     num_blocks: int = 512, failure_policy: str = "recompute", max_num_batched_tokens: int = 16384,
                     max_num_seqs: int = 16) -> Any:
    from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig,
                             SchedulerConfig, VllmConfig)

    model = ModelConfig(model=tiny_model_dir(), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=16384, seed=0)
    cache = CacheConfig(block_size=BLOCK_SIZE, prefix_caching_hash_algo=hash_algo, enable_prefix_caching=True)
    cache.num_gpu_blocks = num_blocks
    kt = KVTransferConfig(kv_connector="KvtierConnector", kv_connector_module_path="kvtier.vllm", kv_role="kv_both",
                          kv_connector_extra_config=extra, kv_load_failure_policy=failure_policy)
    sched = SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs, max_model_len=16384,
                            enable_chunked_prefill=True, is_encoder_decoder=False)
    par = ParallelConfig(tensor_parallel_size=1)
    vc = VllmConfig(model_config=model, cache_config=cache, kv_transfer_config=kt, scheduler_config=sched,
                    device_config=DeviceConfig("cpu"), parallel_config=par)
    # One process plays every rank: set the TP fence and this rank by hand (the
    # config's validation would want that many devices).
    vc.parallel_config.tensor_parallel_size = tp_size
    vc.parallel_config.rank = rank
    return vc


def make_kv_cache_config(num_blocks: int = 512, groups: int = 1) -> Any:
    """One full-attention group, or `groups` of them (a hybrid-allocator layout)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, dtype=torch.bfloat16)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS * groups)]
    per = len(names) // groups
    specs = [KVCacheGroupSpec(names[g * per : (g + 1) * per], spec) for g in range(groups)]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=specs)


def make_kv_caches(kv_cache_config: Any, layout: str = "LBHNC", device: str = "cpu") -> dict[str, torch.Tensor]:
    """Per-layer `[B, H, N, C]` views into one allocation per group, in a vLLM physical layout."""
    out = {}
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        L, B, H, N, C = len(group.layer_names), kv_cache_config.num_blocks, spec.num_kv_heads, spec.block_size, 2 * spec.head_size
        dims = {"L": L, "B": B, "H": H, "N": N, "C": C}
        order = list(layout)
        base = torch.zeros([dims[d] for d in order], dtype=spec.dtype, device=device)
        # permute to logical [L, B, H, N, C]
        full = base.permute(*[order.index(d) for d in "LBHNC"])
        out.update({name: full[i] for i, name in enumerate(group.layer_names)})
    return out


def make_request(req_id: str, tokens: list[int], max_tokens: int = 4, salt: str | None = None) -> Any:
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    fn = get_hash_fn_by_name("sha256_cbor")
    init_none_hash(fn)
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(request_id=req_id, prompt_token_ids=list(tokens), sampling_params=sp, pooling_params=None,
                   cache_salt=salt, block_hasher=get_request_block_hasher(BLOCK_SIZE, fn))


def expected_page(rank: int, layer: int, prefix_digest: bytes, pos: int) -> torch.Tensor:
    """The KV values the fake model writes for the token at `pos` of a sequence."""
    seed = int.from_bytes(hashlib.sha256(prefix_digest + bytes([rank, layer]) + pos.to_bytes(4, "little")).digest()[:8], "little")
    g = torch.Generator().manual_seed(seed)
    return torch.randn(NUM_KV_HEADS, 2 * HEAD_SIZE, generator=g).to(torch.bfloat16)


class FakeModel:
    """Writes KV for computed tokens: a function of the token prefix, rank and layer."""

    def __init__(self, rank: int, kv_caches: dict[str, torch.Tensor], kv_cache_config: Any = None):
        self.rank = rank
        self.kv = kv_caches
        self.names = list(kv_caches)
        #: layer index -> KV-cache group index
        self.group_of = [0] * len(self.names)
        if kv_cache_config is not None:
            for g, group in enumerate(kv_cache_config.kv_cache_groups):
                for n in group.layer_names:
                    self.group_of[self.names.index(n)] = g

    def forward(self, tokens: list[int], block_ids: Any, start: int, end: int) -> None:
        h = hashlib.sha256()
        digests = []
        for t in tokens[:end]:
            h.update(t.to_bytes(4, "little"))
            digests.append(h.digest())
        for pos in range(start, end):
            off = pos % BLOCK_SIZE
            for li, name in enumerate(self.names):
                b = block_ids[self.group_of[li]][pos // BLOCK_SIZE]
                self.kv[name][b, :, off, :] = expected_page(self.rank, li, digests[pos], pos)

    def check(self, tokens: list[int], block_ids: Any, upto: int) -> None:
        """Asserts the KV of tokens [0, upto) is exactly what forward() writes."""
        h = hashlib.sha256()
        for pos in range(upto):
            h.update(tokens[pos].to_bytes(4, "little"))
            off = pos % BLOCK_SIZE
            for li, name in enumerate(self.names):
                b = block_ids[self.group_of[li]][pos // BLOCK_SIZE]
                got = self.kv[name][b, :, off, :].cpu()
                want = expected_page(self.rank, li, h.digest(), pos)
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (
                    f"rank {self.rank} layer {li} token {pos} (block {b}) differs"
                )


class Engine:
    """vLLM's scheduler plus one worker connector and fake model per rank."""

    def __init__(self, extra: dict[str, Any], tp_size: int = 1, layout: str = "LBHNC", num_blocks: int = 512,
                 hash_algo: str = "sha256_cbor", sockets: list[str] | None = None, groups: int = 1,
                 max_num_batched_tokens: int = 16384, max_num_seqs: int = 16, device: str = "cpu"):
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        from kvtier.vllm import KvtierConnector

        self.tp_size = tp_size
        self.kv_cache_config = make_kv_cache_config(num_blocks, groups)
        limits = {"max_num_batched_tokens": max_num_batched_tokens, "max_num_seqs": max_num_seqs}
        vc = make_vllm_config(extra, tp_size=tp_size, rank=0, hash_algo=hash_algo, num_blocks=num_blocks, **limits)
        self.vllm_config = vc
        self.scheduler = Scheduler(vc, self.kv_cache_config, StructuredOutputManager(vc), block_size=BLOCK_SIZE, log_stats=True)
        self.connector = self.scheduler.connector
        self.workers = []
        self.models = []
        for r in range(tp_size):
            wextra = dict(extra)
            if sockets is not None:
                wextra["socket"] = sockets[r]
            wvc = make_vllm_config(wextra, tp_size=tp_size, rank=r, hash_algo=hash_algo, num_blocks=num_blocks, **limits)
            w = KvtierConnector(wvc, KVConnectorRole.WORKER, self.kv_cache_config)
            caches = make_kv_caches(self.kv_cache_config, layout, device)
            w.register_kv_caches(caches)
            self.workers.append(w)
            self.models.append(FakeModel(r, caches, self.kv_cache_config))
        self.aggregator = KVOutputAggregator(expected_finished_count=tp_size)
        self.stats: list[Any] = []
        self.finished: set[str] = set()
        self.requests: dict[str, Any] = {}
        #: Called between the scheduler and the workers each step (fault injection).
        self.before_workers: Any = None
        #: req id -> tokens found already computed when first scheduled, verified byte-exact.
        self.verified: dict[str, int] = {}
        #: vLLM 0.33's order with a speculative_config (gpu_model_runner's
        #: `defer_kv_connector_finalize`): in a step with a forward, the
        #: transfer results are asked for before `wait_for_save`.
        self.deferred_finalize = False

    def add(self, request: Any) -> None:
        self.requests[request.request_id] = request
        self.scheduler.add_request(request)

    def step(self) -> Any:
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        so = self.scheduler.schedule()
        if self.before_workers is not None:
            self.before_workers(so)
        outputs = []
        for r, (w, model) in enumerate(zip(self.workers, self.models)):
            w.handle_preemptions(so.kv_connector_metadata)
            w.bind_connector_metadata(so.kv_connector_metadata)
            w.start_load_kv(None)
            self._forward(so, model)
            deferred = self.deferred_finalize and bool(so.num_scheduled_tokens)
            if not deferred:
                w.wait_for_save()
            res = w.get_transfer_results(so.finished_req_ids)
            kvo = KVConnectorOutput(
                finished_sending=res.finished_sending or None, finished_recving=res.finished_recving or None,
                failed_recving=res.failed_recving, invalid_block_ids=w.get_block_ids_with_load_errors(),
                kv_connector_stats=w.get_kv_connector_stats(),
            )
            if deferred:
                w.wait_for_save()  # finalize_kv_connector()
            w.clear_connector_metadata()
            req_ids = list(so.num_scheduled_tokens)
            outputs.append(ModelRunnerOutput(
                req_ids=req_ids, req_id_to_index={x: i for i, x in enumerate(req_ids)},
                sampled_token_ids=[self._sampled(so, x) for x in req_ids], kv_connector_output=kvo,
            ))
        out = self.aggregator.aggregate(outputs, 0)
        if out.kv_connector_output and out.kv_connector_output.kv_connector_stats:
            self.stats.append(out.kv_connector_output.kv_connector_stats)
        eco = self.scheduler.update_from_output(so, out)
        for outs in eco.values():
            for o in outs.outputs:
                if o.finished:
                    self.finished.add(o.request_id)
        return so

    def _sampled(self, so: Any, req_id: str) -> list[int]:
        req = self.requests[req_id]
        done = req.num_computed_tokens  # already advanced by schedule()
        # A token is sampled only when the step reaches the end of the known tokens.
        if done >= req.num_tokens:
            return [(req.num_tokens * 7 + 3) % 1000]
        return []

    def _forward(self, so: Any, model: FakeModel) -> None:
        for new in so.scheduled_new_reqs:
            req = self.requests[new.req_id]
            n = so.num_scheduled_tokens[new.req_id]
            # Whatever the engine did not compute itself (restored KV) must be exact.
            model.check(req.all_token_ids, new.block_ids, new.num_computed_tokens)
            self.verified[new.req_id] = max(self.verified.get(new.req_id, 0), new.num_computed_tokens)
            model.forward(req.all_token_ids, new.block_ids, new.num_computed_tokens, new.num_computed_tokens + n)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            req = self.requests[req_id]
            n = so.num_scheduled_tokens[req_id]
            start = cached.num_computed_tokens[i]
            blocks = self.scheduler.kv_cache_manager.get_block_ids(req_id)
            model.forward(req.all_token_ids, blocks, start, start + n)

    def run(self, until: Any, max_steps: int = 5000, timeout_s: float = 60.0) -> int:
        """Steps until `until()` is true (bounded in steps and time)."""
        deadline = time.monotonic() + timeout_s
        for i in range(max_steps):
            if until():
                return i
            if time.monotonic() > deadline:
                break
            so = self.step()
            if not so.num_scheduled_tokens:
                time.sleep(0.005)  # idle step: the I/O threads are working
        raise AssertionError(f"condition not met after {max_steps} steps / {timeout_s}s")

    def totals(self) -> dict[str, int]:
        """Counters summed over the scheduler and every worker since start,
        once the workers' queued and in-flight saves and loads have settled
        (a save of evicted blocks runs on after the step that gathered it;
        its counters land when its PUTs return)."""
        for w in self.workers:
            if w.worker is not None:
                w.worker.wait_idle(30)
        out: dict[str, int] = {}
        for c in [self.connector, *self.workers]:
            for k, v in c.stats.totals().items():
                out[k] = out.get(k, 0) + v
        return out

    def shutdown(self) -> None:
        for w in self.workers:
            w.shutdown()
        self.connector.shutdown()


def _free_udp_port() -> int:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def start_peered_pair(d1: Daemon, d2: Daemon) -> None:
    """Starts two daemons peered over loopback with certificates of a fresh CA
    (deploy/certs/README.md)."""
    base = d1.dir.parent / "certs"
    subprocess.run([kvtier_bin(), "cert", "init-ca", "--cluster", "test", "--out", str(base / "ca")], check=True, timeout=60)
    ports = [_free_udp_port(), _free_udp_port()]
    peers = ",".join(f"127.0.0.1:{p}" for p in ports)
    for d, port in zip((d1, d2), ports):
        name = d.dir.name
        subprocess.run([kvtier_bin(), "cert", "issue", "--ca", str(base / "ca"), "--node", name, "--ip", "127.0.0.1",
                        "--out", str(base / name)], check=True, timeout=60)
        d.extra += ["--node-name", name, "--peer-listen", f"127.0.0.1:{port}", "--peers", peers,
                    "--tls-dir", str(base / name)]
        d.start()
