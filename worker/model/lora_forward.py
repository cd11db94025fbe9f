"""LoRA linears whose adapter output joins the base output in one addmm, for the update's forwards.

PEFT's LoRA Linear computes base(x) + lora_B(lora_A(dropout(x))) * scaling:
the rank-r product is written out at the layer's full output width, scaled in
a second pass and added in a third, and backward runs the scaling pass again.
torch.addmm(base(x), lora_A(dropout(x)), B^T, alpha=scaling) does the three in
one, with the same value and gradients up to float rounding. Measured on a
CPU at Qwen2.5-0.5B's MLP (896 -> 4864 -> 896, r=16, 576 tokens, CPU time):
base linears alone 176 ms forward and backward, with PEFT's LoRA 215 ms,
fused 198 ms.

Anything else (adapters disabled or merged, DoRA and other variants, adapter
biases, a base in another dtype than the adapter outside autocast, mixed-adapter
batches) runs PEFT's own forward, decided at each call, so switching adapters
inside the block (the reference policy) behaves as without it.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import Tensor

from worker.model.optional_swaps import guarded, optional, restore_forwards

NAME = "fused LoRA forward"


@contextmanager
def fused_lora_linears(model: torch.nn.Module):
    """Within the block, every plain PEFT LoRA Linear of `model` adds its adapters' output with one addmm; where
    that cannot apply, PEFT's forward runs (worker/model/optional_swaps.py)."""
    with optional(model, NAME, lambda: _patched(model)):
        yield model


@contextmanager
def _patched(model: torch.nn.Module):
    from peft.tuners.lora.layer import Linear

    patched: dict[torch.nn.Module, object] = {}
    try:
        for module in model.modules():
            if type(module) is Linear and "forward" not in module.__dict__:
                plain = type(module).forward.__get__(module)
                module.forward = patched[module] = guarded(model, NAME, _fused_forward(module), plain)
        yield model
    finally:
        restore_forwards(patched)  # the class's (PEFT's) forward again


def _fused_forward(module):
    peft_forward = type(module).forward.__get__(module)

    def forward(x: Tensor, *args, **kwargs) -> Tensor:
        adapters = [a for a in module.active_adapters if a in module.lora_A]
        if not _fusable(module, adapters, x, kwargs):
            return peft_forward(x, *args, **kwargs)
        result = module.base_layer(x, *args, **kwargs)
        result_dtype, shape = result.dtype, result.shape
        autocast = torch.is_autocast_enabled(x.device.type)
        for adapter in adapters:
            lora_a, dropout = module.lora_A[adapter], module.lora_dropout[adapter]
            # Under autocast the adapter's matmul casts x to the compute dtype anyway: PEFT's cast to the adapter's
            # dtype first (bf16 -> float32 -> bf16, exact) would make each adapted linear save its own copy of x
            # for backward, where q, k and v (gate and up) read one input. (Dropout keeps PEFT's cast: its random
            # mask is drawn in the input's dtype.)
            keep = autocast and isinstance(dropout, torch.nn.Identity)
            h = lora_a(dropout(x if keep else module._cast_input_dtype(x, lora_a.weight.dtype)))
            result = torch.addmm(result.reshape(-1, shape[-1]), h.reshape(-1, h.shape[-1]),
                                 module.lora_B[adapter].weight.t(), alpha=module.scaling[adapter]).view(shape)
        return result.to(result_dtype)

    return forward


def vanilla_adapters(module, adapters: list[str]) -> bool:
    """Whether every one of `adapters` is a plain LoRA linear adapter of `module` (no DoRA or other variant)."""
    variants = getattr(module, "lora_variant", {})
    dora = getattr(module, "use_dora", {})
    return all(a in module.lora_A and a not in variants and not dora.get(a, False) for a in adapters)


def _fusable(module, adapters: list[str], x: Tensor, kwargs: dict) -> bool:
    if module.disable_adapters or module.merged or kwargs.get("adapter_names") is not None:
        return False
    if not vanilla_adapters(module, adapters):
        return False
    for adapter in adapters:
        a, b = module.lora_A[adapter], module.lora_B[adapter]
        if a.bias is not None or b.bias is not None:
            return False
        # addmm needs one dtype: autocast gives it, else the base's weight must be the adapter's
        if not torch.is_autocast_enabled(x.device.type) and module.get_base_layer().weight.dtype != b.weight.dtype:
            return False
    return True
