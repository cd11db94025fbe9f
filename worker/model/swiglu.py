"""SwiGLU MLPs that keep two tensors for backward instead of three, for the update's forwards.

Llama-style MLPs compute down(silu(gate(x)) * up(x)); autograd then keeps
gate(x) for the SiLU, and silu(gate(x)) and up(x) for the product: three
tensors of the MLP's full width per token and layer, the largest activations
a step holds (at Qwen2.5-0.5B's shape, 576 tokens in bf16, 127 MB each over
the 24 layers). Within the block the product runs as one autograd function
that keeps gate(x) and up(x) and recomputes the SiLU in backward: the same
operations on the same values, so the same outputs and gradients bit for bit,
one MLP-width tensor less per layer for one elementwise SiLU more.

Only MLPs whose forward is LlamaMLP's own code (Qwen2, Qwen3, Mistral and the
other copies of it) with a SiLU activation are patched; any other runs as is.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor


class _SiluMul(torch.autograd.Function):
    """silu(gate) * up, keeping gate and up (not silu(gate)) for backward."""

    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor) -> Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: Tensor):
        gate, up = ctx.saved_tensors
        # autograd's own order for silu(gate) * up: the product's two gradients, then SiLU's backward
        grad_up = grad * F.silu(gate) if ctx.needs_input_grad[1] else None
        grad_gate = torch.ops.aten.silu_backward(grad * up, gate) if ctx.needs_input_grad[0] else None
        return grad_gate, grad_up


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    return _SiluMul.apply(gate, up)


@contextmanager
def recomputed_swiglu(model: torch.nn.Module):
    """Within the block, every Llama-style SiLU MLP of `model` recomputes its activation in backward."""
    patched = [m for m in model.modules() if _is_llama_swiglu(m) and "forward" not in m.__dict__]
    for module in patched:
        module.forward = _forward(module)
    try:
        yield model
    finally:
        for module in patched:
            del module.forward  # the class's forward again


def _forward(module):
    def forward(x: Tensor) -> Tensor:
        return module.down_proj(silu_mul(module.gate_proj(x), module.up_proj(x)))

    return forward


def _is_llama_swiglu(module: torch.nn.Module) -> bool:
    from transformers.activations import SiLUActivation
    from transformers.models.llama.modeling_llama import LlamaMLP

    forward = getattr(type(module), "forward", None)
    code, llama = getattr(forward, "__code__", None), LlamaMLP.forward.__code__
    return (code is not None and code.co_code == llama.co_code and code.co_names == llama.co_names
            and isinstance(getattr(module, "act_fn", None), (SiLUActivation, torch.nn.SiLU)))
