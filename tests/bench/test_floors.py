"""bench/floors.py: the floor arithmetic on a shape small enough to count by hand."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.floors import (  # noqa: E402
    Shape,
    Step,
    decode_bytes,
    decode_flops,
    floor_seconds,
    measure_bandwidth,
    measure_matmul_rate,
    memory_floor_bytes,
    update_flops,
)

# hidden 4, 2 heads of 2 -> one KV head is 2 wide; 2 layers; vocab 10; tied head
TINY = Shape(vocab=10, hidden=4, intermediate=6, layers=2, heads=2, kv_heads=1, tied=True)
# 2 prompts x 2 completions, 3-token prompts, 2 new tokens, LoRA r=1, float32
STEP = Step(prompts=2, group=2, prompt_tokens=3, new_tokens=2, lora_r=1, dtype_bytes=4)


def test_parameter_counts():
    assert TINY.kv_dim == 2
    assert TINY.layer_linear_params == 2 * 16 + 2 * 4 * 2 + 3 * 4 * 6 == 120  # q,o; k,v; gate,up,down
    assert TINY.params == 240 + 40 + 5 * 4 == 300  # body, tied head once, 5 norms
    assert Shape(**{**TINY.__dict__, "tied": False}).params == 340
    assert TINY.lora_params(1) == 2 * (8 + 6 + 6 + 8 + 10 + 10 + 10) == 116  # r * (in + out) per linear
    assert TINY.kv_bytes_per_token(4) == 2 * 2 * 2 * 4


def test_decode_floor():
    # each of the 2 forwards reads 300 weights + 116 adapter weights, 4 bytes each; the second one also reads
    # the cache of 3 positions for 4 rows at 32 bytes a position
    assert decode_bytes(TINY, STEP) == 2 * 1664 + 4 * 3 * 32 == 3712
    # prefill 2 x 3 tokens, then 4 rows x 1 token through the body; the head on 4 rows x 2 sampled positions
    assert decode_flops(TINY, STEP) == 2 * 240 * 10 + 2 * 40 * 8 == 5440
    assert floor_seconds(3712, 5440, bandwidth=1000.0, matmul_rate=1000.0) == pytest.approx(5.44)  # compute-bound
    assert floor_seconds(3712, 5440, bandwidth=100.0, matmul_rate=1000.0) == pytest.approx(37.12)  # memory-bound


def test_update_floor():
    assert STEP.distinct_tokens == 2 * 3 + 4 * 2 == 14  # each prompt once
    # LoRA: body forward + input gradients (4 per weight per token), adapter 6 per weight per token,
    # head 3 passes over the 8 completion tokens
    assert update_flops(TINY, STEP) == 4 * 240 * 14 + 6 * 116 * 14 + 3 * 2 * 40 * 8 == 25104
    full = Step(**{**STEP.__dict__, "lora_r": 0})
    assert update_flops(TINY, full) == 6 * 240 * 14 + 4 * 2 * 40 * 8 == 22720


def test_memory_floor():
    parts = memory_floor_bytes(TINY, STEP)
    assert parts["base weights"] == 1200
    assert parts["adapter"] == 464
    assert parts["optimizer state"] == 3 * 464  # gradient and two moments
    # 14 tokens x 2 layers x (6*4 + 2*2 + 4*6) x 4 bytes, plus logits, softmax and gradient of 8 positions
    assert parts["activations"] == 14 * 2 * 52 * 4 + 3 * 8 * 10 * 4 == 6784
    assert parts["KV cache"] == 4 * 5 * 32
    assert parts["sum"] == 1200 + 464 + 1392 + 6784 + 640
    bf16_full = memory_floor_bytes(TINY, Step(**{**STEP.__dict__, "lora_r": 0, "dtype_bytes": 2}))
    assert bf16_full["base weights"] == 300 * 4 and bf16_full["adapter"] == 0  # float32 master weights


def test_measurements_are_positive_rates():
    assert measure_bandwidth(megabytes=8, repeats=2) > 1e6
    assert measure_matmul_rate(torch_float32(), rows=16, inner=16, cols=16, repeats=2) > 0


def torch_float32():
    import torch

    return torch.float32
