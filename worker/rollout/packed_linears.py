"""Linears on a CPU with their weights prepacked into oneDNN's blocked layout for a rollout.

bfloat16: a bfloat16 F.linear on a CPU runs oneDNN, which reorders the weight
into its blocked (AMX/VNNI) layout at every call: at decode's 16 rows a step
that reorder is a second pass over the weight's bytes. Reordering once per
rollout and calling the packed kernel (torch.ops.mkldnn._linear_pointwise,
what inductor's CPU freezing pass emits) gives the same outputs bit for bit
(the same oneDNN kernel; tests/worker/rollout/test_packed_linears.py checks rows
1-100, bias, 3-d inputs) for ~30% less CPU time over the 0.5B shape's linears
at 16 rows. It also keeps the prefill's LM head (a non-contiguous
[B, 1, hidden] slice) off torch.matmul's bmm route, which expands the
[vocab, hidden] weight B times (a copy of 4 x 58 MB per rollout at the 0.5B
shape). Packed bfloat16 copies are kept between rollouts with the version of
the weight they came from (the optimizer's in-place steps and load_state_dict
bump it), so frozen base weights (LoRA) are cast and reordered once, not at
every rollout. In-place writes through `.data` do not bump a tensor's
version; nothing in the worker writes the trained model's weights that way.
Those cast copies replace plain ones the rollout needs anyway; a model
already in bfloat16 (dtype bfloat16 on a CPU) casts nothing, so its linears
get packed copies for one rollout only, as float32 ones do below (kept, they
would add the weights' size to the update's peak).

float32: F.linear runs MKL's sgemm, which repacks the weight at every call
(the 0.5B decode's base linears ran at 2.3x their FLOP floor, bench/README.md);
oneDNN's packed float32 kernel made that decode 1.6-1.8x faster. It rounds
differently from sgemm (logits within ~1e-5, log-probs ~5e-6 at the 0.5B
shape), so a packed float32 rollout no longer gives the trainer's logits bit
for bit. That is harmless: a synchronous float32 rollout reports no sampler
log-probs (HFEngine's report_logprobs is off when no weight is rounded), so
the trainer's logp_old is its own forward and no TIS factor is applied: the
difference only perturbs which tokens are drawn, by ~5e-6 in log-prob, far
below sampling noise. With asynchronous rollouts logp_old is the sampler's
log-prob, so the ratio is off 1 by ~5e-6 more, beside the staleness it is
there to carry (and ratio_max, 5 by default, caps). Only weights of at
least FLOAT32_PACK_MIN_ELEMENTS are packed (below it the packed kernel is no
faster), so the tiny test models keep sgemm and PEFT's logits bit for bit.
A packed float32 copy is as large as the weight itself, so it lives for one
rollout only (worker/rollout/effective_weights.py drops it on exit): the
peak stays the update's, at the cost of repacking per rollout (1.1 s for the
0.5B shape's 169 weights against ~6 s saved over a 32-token decode): once for
all the turns of a multi-turn rollout, and not at all for a rollout of fewer
than PACK_MIN_NEW_TOKENS new tokens (worker/rollout/rollout.py).
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

__all__ = ["packable", "packed_weight", "packed_copy", "packed_forward", "PACK_ROWS", "FLOAT32_PACK_MIN_ELEMENTS",
           "PACK_MIN_NEW_TOKENS"]

PACK_ROWS = 16  # oneDNN's batch-size hint for the blocked layout (any row count gives the same outputs)
# The smallest float32 weight (elements) worth packing. One thread, 16 rows, min of 5 (load 2.2): sgemm / packed
# time 0.25x at 64x64, 0.33x at 128x64 (the toy models' largest), 0.85x at 256x256, 0.98x at 128x896 (the 0.5B
# shape's k/v projections), 1.21x at 512x512, 1.37x at 896x896, 2.2-2.3x at 4864x896 and 32768x896; packing
# costs ~1-3 calls' time, so it pays from 2**18 elements (1 MiB) on.
FLOAT32_PACK_MIN_ELEMENTS = 2**18
# The fewest new tokens a rollout must decode for packing its weights' own-dtype copies to pay: the 0.5B shape's
# float32 weights took 1.1 s to pack against ~6 s saved over 32 decode steps (~0.19 s a step), so it breaks even
# near 6 steps (bfloat16 sooner: its unpacked kernel reorders the weight at every call).
PACK_MIN_NEW_TOKENS = 8

_sources: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> (weight's id, version, address)


def packable(module: torch.nn.Module, weight: Tensor, dtype: torch.dtype | None) -> bool:
    """Whether `module` is a plain Linear whose rollout weight (`weight` cast to `dtype`) can run prepacked here:
    any bfloat16 one, a float32 one of at least FLOAT32_PACK_MIN_ELEMENTS."""
    dtype = dtype or weight.dtype
    if not (type(module) is torch.nn.Linear and weight.device.type == "cpu" and weight.dim() == 2
            and torch.backends.mkldnn.is_available()):
        return False
    if dtype is torch.float32:
        return weight.numel() >= FLOAT32_PACK_MIN_ELEMENTS
    return dtype is torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def packed_copy(weight: Tensor) -> Tensor:
    """A weight reordered for the packed kernel, in its own dtype: a copy as large as the weight, for one
    rollout."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)


def packed_weight(module: torch.nn.Module, source: Tensor, kept: dict, dtype: torch.dtype,
                  key: str = "weight") -> torch.nn.Parameter:
    """`source` cast to `dtype` and prepacked, kept in `kept[key]` and reused while `source` is unchanged."""
    stamp = (id(source), source._version, source.data_ptr())
    copy = kept.get(key)
    if copy is None or not copy.is_mkldnn or _sources.get(module) != stamp:
        kept.pop(key, None)  # the old copy goes before the new one is made: one copy's memory at a time
        packed = torch.ops.mkldnn._reorder_linear_weight(source.detach().to(dtype), PACK_ROWS)
        copy = kept[key] = torch.nn.Parameter(packed, requires_grad=False)
        _sources[module] = stamp
    return copy


def packed_forward(module: torch.nn.Linear, weight: Tensor):
    """The Linear's forward on `weight` (its weight prepacked): x @ W^T + b through oneDNN's packed kernel."""

    def forward(x: Tensor) -> Tensor:
        bias = module.bias
        if bias is None or x.dim() == 2 or x.is_contiguous():  # F.linear's fused addmm
            return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        # F.linear's other route (a non-contiguous n-d input): the product rounded, then the bias added
        return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "").add_(bias)

    return forward
