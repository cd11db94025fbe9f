"""Memory admission on a shared base: a job's estimated peak, and whether it fits beside the resident jobs.

A job joins a shared worker only if the base plus every resident job's
estimate plus its own fits the worker's budget (CISPO_WORKER_MEMORY_GIB,
default 90% of the GPU's memory, or of the host's); one that does not waits,
queued, rather than running the worker out of memory and crashing every job
on it.

Per job (bytes):
- adapter: its LoRA weights and their gradients, float32 (PEFT keeps adapters
  in float32): 2 * 4 * P, P = sum over adapted linears of r * (in + out); with
  rollout.max_staleness s > 0 also its frozen sampling copy and the s + 1
  versions it keeps while loading it (worker/multi/job.py): (s + 2) * 4 * P more;
- optimizer: AdamW's two moments, float32: 2 * 4 * P;
- activations: what one micro-batch's forward keeps for the backward. Per
  token and layer of a Llama-style decoder, the tensors autograd saves: both
  norms' inputs and outputs (4h), q and the attention output (2q), k and v
  (2kv), the MLP's gate, up, activation and product (4I); plus the attention
  weights of eager/math attention (heads * T per token; flash attention keeps
  none, so this over-estimates there); plus one LM-head chunk's float32 logits
  and their gradient (2 * chunk * vocab * 4). LoRA's own rank-wide
  intermediates are left out: a rank is far below those widths. With
  training.pack_tokens a micro-batch is one packed row of up to pack_tokens
  tokens, each attending over the row (eager attention's weights are as
  wide); with training.gradient_checkpointing the forward keeps only each
  layer's input (h per token and layer) and one layer's tensors at a time
  (its recompute in the backward);
- kv_cache: the keys and values of the job's larger decode at full length
  (max_model_len tokens a row): its rollout's batch_size * group_size rows,
  or an evaluation's eval_max_rows (due evaluations of several jobs decode
  together, as their rollouts do), plus one decode step's float32 logits.
  None for a job with rollout.engine 'vllm': its rows' keys and values live
  in the vLLM engine's own cache.

Per worker, once, when any resident job samples with vLLM: the shared vLLM
engine (worker/multi/vllm_engine.py), which holds its own copy of the
weights, its KV cache and its activations (`engine_memory`). On a GPU that is
its configured share of the GPU's memory (rollout.gpu_memory_utilization of
the engine's first job, as it starts with); with sleep mode it gives that
back while the trainer updates. On a CPU: its weights in its dtype plus
VLLM_CPU_KVCACHE_SPACE, held throughout.

Per worker, once, when its jobs sample in a rollout.dtype other than the
base's (they share it: worker/multi/support.py's base_key): the copies of the
base's weights cast to it that the decode runs on, kept between rollouts
(worker/rollout/effective_weights.py), the base's parameters in that dtype
(`cast_copies`), counted with the base.

Phases line up across jobs (a cycle samples every job's rows together, then
updates every job together), so jobs together need the sum of their adapter
and optimizer state plus the larger of their rollout (summed KV caches, and
the engine) and their update (summed activations, and an engine that does
not sleep) (`together`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from service.job_spec.spec import JobSpec

FLOAT32 = 4
GIB = 2**30
VLLM_CPU_KV_GIB = "1"  # worker/rollout/vllm_engine.py's default for VLLM_CPU_KVCACHE_SPACE
DEFAULT_SHARE = 0.9  # of the device's memory, when the operator sets no budget: the allocator's own slack


@dataclass(frozen=True)
class BaseShape:
    """What the estimate needs of the base model."""

    linears: dict[str, tuple[int, int, int]]  # module name (last part) -> (how many, in_features, out_features)
    layers: int
    hidden: int
    q_width: int  # attention heads * head size
    kv_width: int  # key/value heads * head size
    intermediate: int
    heads: int
    vocab: int
    dtype_bytes: int  # of the base's weights and activations

    @classmethod
    def of(cls, model: torch.nn.Module) -> BaseShape:
        """The loaded base's shape: its linears (not the LM head, not LoRA's own) and its config's widths."""
        head = model.get_output_embeddings()
        linears: dict[str, tuple[int, int, int]] = {}
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and module is not head and ".lora_" not in name:
                short = name.removesuffix(".base_layer").rsplit(".", 1)[-1]
                count, _, _ = linears.get(short, (0, 0, 0))
                linears[short] = (count + 1, module.in_features, module.out_features)
        c = model.config
        heads = c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        return cls(linears=linears, layers=c.num_hidden_layers, hidden=c.hidden_size, q_width=heads * head_dim,
                   kv_width=(getattr(c, "num_key_value_heads", None) or heads) * head_dim,
                   intermediate=c.intermediate_size, heads=heads, vocab=c.vocab_size,
                   dtype_bytes=next(model.parameters()).element_size())


@dataclass(frozen=True)
class MemoryEstimate:
    adapter: int
    optimizer: int
    activations: int
    kv_cache: int

    @property
    def peak(self) -> int:
        return self.adapter + self.optimizer + max(self.activations, self.kv_cache)


def adapter_parameters(spec: JobSpec, shape: BaseShape) -> int:
    lora = spec.lora
    names = shape.linears if lora.target_modules == "all-linear" else \
        [n for n in lora.target_modules if n in shape.linears]
    return sum(count * lora.r * (fan_in + fan_out) for count, fan_in, fan_out in (shape.linears[n] for n in names))


def estimate(spec: JobSpec, shape: BaseShape) -> MemoryEstimate:
    """`spec`'s peak memory on a shared base of `shape` (see the module's docstring for each term)."""
    tc, length = spec.training, spec.sampling.max_model_len
    params = adapter_parameters(spec, shape)
    rows = tc.batch_size * tc.group_size
    width = length if tc.pack_tokens is None else min(tc.pack_tokens, rows * length)  # what a token attends over
    micro_tokens = min(tc.micro_batch_size, rows) * length if tc.pack_tokens is None else width
    per_token_layer = 4 * shape.hidden + 2 * shape.q_width + 2 * shape.kv_width + 4 * shape.intermediate \
        + shape.heads * width
    kept = shape.layers * shape.hidden + per_token_layer if tc.gradient_checkpointing else \
        shape.layers * per_token_layer
    activations = micro_tokens * kept * shape.dtype_bytes \
        + 2 * min(micro_tokens, tc.logprob_chunk_size) * shape.vocab * FLOAT32
    decoded = max(rows, tc.eval_max_rows)
    kv_cache = 0 if spec.rollout.engine == "vllm" else \
        decoded * length * shape.layers * 2 * shape.kv_width * shape.dtype_bytes + decoded * shape.vocab * FLOAT32
    stale = spec.rollout.max_staleness + 2 if spec.rollout.max_staleness else 0  # sampling copy and versions
    return MemoryEstimate(adapter=(2 + stale) * FLOAT32 * params, optimizer=2 * FLOAT32 * params,
                          activations=activations, kv_cache=kv_cache)


@dataclass(frozen=True)
class EngineMemory:
    """The shared vLLM engine's own memory, and whether it gives it back while the trainer updates."""

    held: int
    sleeps_in_update: bool


def engine_memory(specs: list[JobSpec], device: torch.device, base_parameters: int) -> EngineMemory | None:
    """The vLLM engine of these jobs (configured by the first that samples with vLLM), or None if none does."""
    spec = next((s for s in specs if s.rollout.engine == "vllm"), None)
    if spec is None:
        return None
    if device.type == "cuda":
        return EngineMemory(held=int(spec.rollout.gpu_memory_utilization * device_memory(device)),
                            sleeps_in_update=spec.rollout.sleep_mode)
    from worker.rollout.vllm_engine import engine_dtype

    weights = base_parameters * getattr(torch, engine_dtype(spec, cuda=False)).itemsize
    kv = float(os.environ.get("VLLM_CPU_KVCACHE_SPACE") or VLLM_CPU_KV_GIB)
    return EngineMemory(held=weights + int(kv * GIB), sleeps_in_update=False)


def together(estimates: list[MemoryEstimate], engine: EngineMemory | None = None) -> int:
    """What jobs need at once on one base: their states, and the larger of their summed phases, the vLLM engine
    (if any) counted once."""
    held = engine.held if engine is not None else 0
    in_update = 0 if engine is None or engine.sleeps_in_update else held
    return sum(e.adapter + e.optimizer for e in estimates) + max(
        sum(e.activations for e in estimates) + in_update, sum(e.kv_cache for e in estimates) + held)


def cast_copies(model: torch.nn.Module, spec: JobSpec) -> int:
    """The bytes of the copies of `model`'s weights that `spec`'s rollout.dtype decodes on (0 where it samples in
    the base's own dtype): every floating-point parameter once (tied ones share a copy), in that dtype."""
    from worker.model.precision import rollout_dtype

    dtype = rollout_dtype(spec)
    if dtype is None or dtype == next(model.parameters()).dtype:
        return 0
    return sum(p.numel() for p in model.parameters() if p.is_floating_point()) * dtype.itemsize


def model_bytes(model: torch.nn.Module) -> int:
    """The resident base's weights and buffers."""
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def default_budget(device: torch.device) -> int:
    """DEFAULT_SHARE of the GPU's memory, or of the host's on a CPU."""
    return int(DEFAULT_SHARE * device_memory(device))


def device_memory(device: torch.device) -> int:
    """The GPU's memory, or the host's on a CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
