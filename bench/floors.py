"""What one CISPO step must cost on this machine at best: the floors bench/trl_compare.py prints each phase against.

Pure arithmetic on a Llama shape and the workload (tested by hand in
tests/bench/test_floors.py), plus two measurements of the machine: memory
read bandwidth and matmul rate, taken in the bench's own process and thread
setting, never hard-coded.

- decode: every forward reads all the weights once (they do not fit a cache)
  and the KV cache written so far; it also does 2 FLOPs per weight per token.
  Its floor is the larger of bytes / bandwidth and FLOPs / matmul rate (at a
  few rows per step the two are close on a CPU).
- update: the weight matmuls of a forward and a backward over the distinct
  tokens (a group's shared prompt once): 2 FLOPs per weight per token forward,
  2 more backward for the input gradients, 2 more for weight gradients of the
  weights that train (the adapter's only, with LoRA). The LM head runs on the
  completion tokens only: forward, recomputed in backward, input gradient.
  Attention-score FLOPs are left out (under 2% at these lengths).
- memory: base weights + adapter + its gradient and AdamW's two moments +
  saved activations + KV cache; activations are an estimate: the inputs the
  backward needs of each layer per token (6 hidden + 2 KV + 4 intermediate
  wide) and one chunk of float32 logits with its softmax and gradient.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

FLOAT32_BYTES = 4


@dataclass(frozen=True)
class Shape:
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    tied: bool

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * (self.hidden // self.heads)

    @property
    def layer_linear_params(self) -> int:
        """q, k, v, o, gate, up, down of one layer (Llama: no biases)."""
        h, i, kv = self.hidden, self.intermediate, self.kv_dim
        return 2 * h * h + 2 * h * kv + 3 * h * i

    @property
    def body_linear_params(self) -> int:
        return self.layers * self.layer_linear_params

    @property
    def head_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def params(self) -> int:
        """Every weight, a tied embedding counted once (norms: 2 per layer + the final one)."""
        norms = (2 * self.layers + 1) * self.hidden
        return self.body_linear_params + self.head_params * (1 if self.tied else 2) + norms

    def lora_params(self, r: int) -> int:
        """LoRA on every linear of the body (PEFT's all-linear leaves the LM head out): r * (in + out) each."""
        h, i, kv = self.hidden, self.intermediate, self.kv_dim
        return self.layers * r * (2 * h + 2 * (h + kv) + 2 * h + 2 * (h + i) + (i + h))

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return self.layers * 2 * self.kv_dim * dtype_bytes


@dataclass(frozen=True)
class Step:
    prompts: int
    group: int
    prompt_tokens: int
    new_tokens: int
    lora_r: int  # 0: full fine-tuning
    dtype_bytes: int  # the compute dtype's

    @property
    def rows(self) -> int:
        return self.prompts * self.group

    @property
    def distinct_tokens(self) -> int:
        """Tokens the update must run: each prompt once, every completion token."""
        return self.prompts * self.prompt_tokens + self.rows * self.new_tokens


def decode_bytes(shape: Shape, step: Step) -> int:
    """Bytes read by the new_tokens forwards: all weights each time (the adapter too) and the KV cache so far."""
    weights = shape.params * step.dtype_bytes + shape.lora_params(step.lora_r) * FLOAT32_BYTES
    # forward t (t >= 1) reads the cache of prompt_tokens + t - 1 earlier positions for every row
    cached = sum(step.prompt_tokens + t - 1 for t in range(1, step.new_tokens))
    return step.new_tokens * weights + step.rows * cached * shape.kv_bytes_per_token(step.dtype_bytes)


def decode_flops(shape: Shape, step: Step) -> int:
    """Prefill of each prompt once, then rows x (new_tokens - 1) one-token forwards; the head on sampled positions."""
    tokens = step.prompts * step.prompt_tokens + step.rows * (step.new_tokens - 1)
    return 2 * shape.body_linear_params * tokens + 2 * shape.head_params * step.rows * step.new_tokens


def update_flops(shape: Shape, step: Step) -> int:
    tokens = step.distinct_tokens
    body = shape.body_linear_params
    if step.lora_r:
        adapter = shape.lora_params(step.lora_r)
        body_flops = 4 * body * tokens + 6 * adapter * tokens
        head_passes = 3  # forward, recomputed in backward, input gradient (a frozen head)
    else:
        body_flops = 6 * body * tokens
        head_passes = 4  # and its weight gradient
    return body_flops + head_passes * 2 * shape.head_params * step.rows * step.new_tokens


def floor_seconds(bytes_moved: int, flops: int, bandwidth: float, matmul_rate: float) -> float:
    """The larger of the memory time and the compute time (they overlap at best)."""
    return max(bytes_moved / bandwidth, flops / matmul_rate)


def memory_floor_bytes(shape: Shape, step: Step, *, logprob_chunk: int = 1024) -> dict[str, int]:
    """What the step must hold at its peak, part by part (see the module docstring), and the sum."""
    trainable = shape.lora_params(step.lora_r) if step.lora_r else shape.params
    base = shape.params * step.dtype_bytes
    parts = {
        "base weights": base,
        "adapter": trainable * FLOAT32_BYTES if step.lora_r else 0,
        "optimizer state": 3 * trainable * FLOAT32_BYTES,  # gradient + AdamW's two moments
        "activations": step.distinct_tokens * shape.layers
        * (6 * shape.hidden + 2 * shape.kv_dim + 4 * shape.intermediate) * step.dtype_bytes
        + 3 * min(logprob_chunk, step.rows * step.new_tokens) * shape.vocab * FLOAT32_BYTES,
        "KV cache": step.rows * (step.prompt_tokens + step.new_tokens) * shape.kv_bytes_per_token(step.dtype_bytes),
    }
    if not step.lora_r and step.dtype_bytes != FLOAT32_BYTES:
        parts["base weights"] = shape.params * FLOAT32_BYTES  # float32 master weights
    parts["sum"] = sum(parts.values())
    return parts


def measure_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes per second of reading a buffer far larger than any cache (best of `repeats`)."""
    x = torch.ones(megabytes * 2**20 // FLOAT32_BYTES, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - started)
    return x.numel() * FLOAT32_BYTES / best


def measure_matmul_rate(dtype: torch.dtype, *, rows: int = 512, inner: int = 896, cols: int = 4864,
                        repeats: int = 5) -> float:
    """FLOP/s of a matmul the size of the model's MLP on a micro-batch of tokens (best of `repeats`)."""
    a, b = torch.randn(rows, inner).to(dtype), torch.randn(inner, cols).to(dtype)
    a @ b  # warm up (oneDNN picks its kernel)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - started)
    return 2 * rows * inner * cols / best
