"""bfloat16 linears on a CPU with their weights prepacked once per rollout into oneDNN's blocked layout.

A bfloat16 F.linear on a CPU runs oneDNN, which reorders the weight into its
blocked (AMX/VNNI) layout at every call: at decode's 16 rows a step that
reorder is a second pass over the weight's bytes. Reordering once per rollout
and calling the packed kernel (torch.ops.mkldnn._linear_pointwise, what
inductor's CPU freezing pass emits) gives the same outputs bit for bit (the
same oneDNN kernel; tests/rollout/test_packed_linears.py checks rows 1-100,
bias, 3-d inputs) for ~30% less CPU time over the 0.5B shape's linears at 16
rows. It also keeps the prefill's LM head (a non-contiguous [B, 1, hidden]
slice) off torch.matmul's bmm route, which expands the [vocab, hidden] weight
B times (a copy of 4 x 58 MB per rollout at the 0.5B shape).

float32 is left alone: MKL's sgemm and oneDNN's float32 kernel round
differently (~2e-6), so a packed float32 rollout would no longer give PEFT's
logits bit for bit.

Packed copies are kept between rollouts with the version of the weight they
came from (the optimizer's in-place steps and load_state_dict bump it), so
frozen base weights (LoRA) are cast and reordered once, not at every rollout.
In-place writes through `.data` do not bump a tensor's version; nothing in the
worker writes the trained model's weights that way.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

__all__ = ["packable", "packed_weight", "packed_forward", "PACK_ROWS"]

PACK_ROWS = 16  # oneDNN's batch-size hint for the blocked layout (any row count gives the same outputs)

_sources: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> (weight's id, version, address)


def packable(module: torch.nn.Module, weight: Tensor, dtype: torch.dtype | None) -> bool:
    """Whether `module` is a plain Linear whose rollout weight (`weight` cast to `dtype`) can run prepacked here."""
    return (dtype is torch.bfloat16 and type(module) is torch.nn.Linear and weight.device.type == "cpu"
            and weight.dim() == 2 and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


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
