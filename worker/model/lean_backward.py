"""Layers that keep less for backward in the update's forwards, with the same outputs and gradients bit for bit.

- SwiGLU MLPs. Llama-style MLPs compute down(silu(gate(x)) * up(x)); autograd
  keeps gate(x) for the SiLU, and silu(gate(x)) and up(x) for the product:
  three tensors of the MLP's full width per token and layer, the largest
  activations a step holds (at Qwen2.5-0.5B's shape, 576 tokens in bf16,
  127 MB each over the 24 layers). Here the product runs as one autograd
  function that keeps gate(x) and up(x) and recomputes the SiLU in backward:
  one MLP-width tensor less per layer for one elementwise SiLU more.
- RMSNorms. Llama's RMSNorm computes in float32 whatever its input's dtype,
  so with bf16 activations autograd keeps a float32 copy of its input (twice
  the input's bytes) per norm. Here a norm with a lower-precision input keeps
  that input alone and runs its forward again in backward (under the autocast
  state it first ran in) to take the same operations' gradients. A float32
  input keeps nothing more than the norm does itself, so it runs as is.

Both run the same operations on the same values as the modules' own forwards,
so the outputs and the gradients are the same bit for bit. Only modules whose
forward is the Llama class's own code (Qwen2, Qwen3, Mistral and the other
copies of it) are patched, MLPs only with a SiLU; any other runs as is, and so
does a module whose forward transformers' hub kernels own (a class carrying a
kernel_layer_name while the model's use_kernels is on).
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor

from worker.model.optional_swaps import guarded, optional, restore_forwards

NAME = "lean backward"


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


class _RecomputedNorm(torch.autograd.Function):
    """A norm's forward that keeps only its input for backward, and runs again in backward, under the autocast
    state it first ran in, to take the gradients of those same operations."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, forward, autocast: tuple) -> Tensor:
        ctx.forward, ctx.weight, ctx.autocast = forward, weight, autocast
        ctx.save_for_backward(x)
        return forward(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (x,) = ctx.saved_tensors
        need_x, need_weight = ctx.needs_input_grad[:2]
        x = x.detach().requires_grad_(need_x)
        wanted = [t for t, need in ((x, need_x), (ctx.weight, need_weight)) if need]
        device, enabled, dtype = ctx.autocast
        with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
            out = ctx.forward(x)
        grads = iter(torch.autograd.grad(out, wanted, grad))
        return next(grads) if need_x else None, next(grads) if need_weight else None, None, None


@contextmanager
def lean_backward(model: torch.nn.Module, *, norms: bool = True):
    """Within the block, `model`'s Llama-style SiLU MLPs and (with `norms`) RMSNorms keep less for backward (see
    the module). `norms=False` under FSDP: a recomputed norm reads its weight again in backward, where FSDP's
    own unsharding, not this function, decides which tensor that is. Where it cannot apply the model runs its own
    forwards (worker/model/optional_swaps.py)."""
    with optional(model, NAME, lambda: _patched(model, norms)):
        yield model


@contextmanager
def _patched(model: torch.nn.Module, norms: bool):
    patched: dict[torch.nn.Module, object] = {}  # module -> the forward set here
    kernels = _hub_kernels_active(model)
    try:
        for module in model.modules():
            if "forward" in module.__dict__ or (kernels and hasattr(type(module), "kernel_layer_name")):
                continue  # a forward of someone else's: another swap's, or one transformers' hub kernels own
            kind = _kind(type(module))
            if kind == "mlp" and _silu(module):
                fast = _mlp_forward(module)
            elif kind == "norm" and norms:
                fast = _norm_forward(module)
            else:
                continue
            module.forward = patched[module] = guarded(model, NAME, fast, type(module).forward.__get__(module))
        yield model
    finally:
        restore_forwards(patched)


def _hub_kernels_active(model: torch.nn.Module) -> bool:
    """Whether transformers' hub kernels are on for `model` (from_pretrained's use_kernels, the default from
    transformers 5.25): they then own the forwards of the classes that carry a kernel_layer_name."""
    return any(getattr(m, "use_kernels", False) is True for m in model.modules())


def _mlp_forward(module):
    def forward(x: Tensor) -> Tensor:
        return module.down_proj(silu_mul(module.gate_proj(x), module.up_proj(x)))

    return forward


def _norm_forward(module):
    own = type(module).forward.__get__(module)

    def forward(x: Tensor) -> Tensor:
        if x.dtype == torch.float32 or not torch.is_grad_enabled():
            return own(x)
        device = x.device.type
        autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        return _RecomputedNorm.apply(x, module.weight, own, autocast)

    return forward


_kinds: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module class -> "mlp", "norm" or None


def _kind(cls: type) -> str | None:
    """Whether instances of `cls` run LlamaMLP's or LlamaRMSNorm's forward, decided once per class (every update
    walks all of a model's modules)."""
    if cls not in _kinds:
        mlp, norm = _runs_code_of(cls, "LlamaMLP"), _runs_code_of(cls, "LlamaRMSNorm")
        _kinds[cls] = "mlp" if mlp else "norm" if norm else None
    return _kinds[cls]


def _runs_code_of(cls: type, llama_class: str) -> bool:
    """Whether `cls`'s forward is the Llama class's own code (the same bytecode and names)."""
    from transformers.models.llama import modeling_llama

    code = getattr(getattr(cls, "forward", None), "__code__", None)
    llama = getattr(modeling_llama, llama_class).forward.__code__
    return code is not None and code.co_code == llama.co_code and code.co_names == llama.co_names


def _silu(module) -> bool:
    from transformers.activations import SiLUActivation

    return isinstance(getattr(module, "act_fn", None), (SiLUActivation, torch.nn.SiLU))
