"""A model's effective weights for a rollout: the active LoRA adapters applied, cast to the rollout dtype.

- the active LoRA adapter runs unmerged on each adapted linear, through a
  lean forward that replaces PEFT's for the rollout: base(x) + B(A(x)) *
  scaling, PEFT's own arithmetic (the same logits, bit for bit), without its
  per-call bookkeeping. Nothing is copied: folding the adapter into a copy of
  every adapted weight cost their memory again (1.4 GB at Qwen2.5-0.5B in
  float32) and a pass over them per rollout, for two rank-r matmuls per
  linear that cost ~1% of its own. The base parameters are never written, so
  no merge/unmerge drift reaches training or checkpoints. Adapter kinds the
  lean forward does not cover (embeddings, DoRA and other variants) are
  folded into a kept copy of their weight;
- the rollout may run in a lower precision than training (rollout.dtype, e.g.
  bfloat16 sampling for a float32 job): the weights are cast once per
  rollout into kept copies, not at every step as autocast would;
- CPU linears run on oneDNN-prepacked weights (worker/rollout/packed_linears.py):
  the cast bfloat16 copies are kept packed; weights running in their own
  dtype (float32, or a bfloat16 model's) get packed copies (`pack`, rollouts
  only) made on entry and dropped on exit, since each is as large as its
  weight.
Copies are kept between rollouts (`kept_copies`) so that tensor addresses stay
put and CUDA graphs replay instead of re-recording; worker/rollout/rollout_state.py
frees them when they grow large.
"""

from __future__ import annotations

import math
import weakref
from contextlib import contextmanager

import torch
from torch import Tensor
from torch.nn.modules import module as nn_module

from worker.model.lora_forward import vanilla_adapters
from worker.model.optional_swaps import enabled, fall_back, guarded, optional, restore_forwards
from worker.rollout.packed_linears import packable, packed_copy, packed_forward, packed_weight

__all__ = ["rollout_weights", "kept_copies"]

EFFECTIVE, LEAN, PACKED = "effective weights", "lean LoRA rollout forward", "packed linears"
kept_copies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> {name: kept weight copy}


@contextmanager
def rollout_weights(model, dtype: torch.dtype | None = None, *, head_float32: bool = False,
                    pack: bool = False, adapters: bool = True):
    """`_effective_weights` where it can apply; else `model` as it is (PEFT's forwards, its own dtype: the same
    tokens up to float rounding), said once (worker/model/optional_swaps.py).

    Without `adapters` the LoRA layers' forwards are left as they are (a shared base's routed ones,
    worker/multi/lora.py) and only the cast and packed copies are made: the base's weights in `dtype` as a job
    alone samples, its adapters running on them in their own dtype."""
    with optional(model, EFFECTIVE, lambda: _effective_weights(model, dtype, head_float32=head_float32, pack=pack,
                                                               adapters=adapters)):
        yield model


@contextmanager
def _effective_weights(model, dtype: torch.dtype | None, *, head_float32: bool, pack: bool, adapters: bool = True):
    """Run `model` as a plain causal LM on its effective weights: active LoRA adapters applied, cast to `dtype`.

    Each adapted linear runs base(x) + B(A(x)) * scaling through a lean
    forward of its own (`_lean_lora_forward`); other adapted layers get a
    weight of their own holding W + delta (kept for the next rollout, so
    addresses stay stable for CUDA graphs) with the adapter path switched
    off. With a `dtype` other than the weights' own, every other
    floating-point parameter (base weights, embeddings, norms, LM head) is
    swapped for a kept copy in that dtype (tied weights stay tied), so the
    forward runs in it but for the small adapter matmuls, which stay in the
    adapter's dtype as in PEFT's own forward. The model's own parameters are
    never written: the optimizer's tensors, and what checkpoints save, are
    untouched. Buffers (rotary frequencies) stay as they are. With
    `head_float32` the LM head runs on a float32 copy of its weight and its
    input is cast up (training.lm_head_float32), so sampling sees the logits
    the trainer scores. With `pack`, plain CPU Linears that run in their
    weight's own dtype (no cast copy above) and can pay (packed_linears.packable:
    float32 ones large enough, any bfloat16 one) run on packed copies made here
    and dropped on exit (a rollout's decode repays the packing; a short forward
    may not). Without `adapters`, the LoRA layers are left alone (their forwards, the adapter path on) and
    only the rest is done.
    """
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    swapped: list[tuple[torch.nn.Module, str, torch.nn.Parameter]] = []
    hooks: list = []
    copies: dict[int, torch.nn.Parameter] = {}  # id(original) -> its copy, so a tied weight is copied once

    def swap(module: torch.nn.Module, name: str, value: Tensor) -> None:
        original = module._parameters[name]
        copy = copies.get(id(original))
        if copy is None:  # else a tied weight: it shares the copy made for its twin
            kept = kept_copies.setdefault(module, {})
            copy, target = kept.get(name), dtype or original.dtype
            if copy is None or copy.is_mkldnn or copy.shape != original.shape or copy.dtype != target:
                copy = kept[name] = torch.nn.Parameter(torch.empty_like(original, dtype=target), requires_grad=False)
            copies[id(original)] = copy.copy_(value)
        module._parameters[name] = copy
        swapped.append((module, name, original))

    peft = isinstance(model, PeftModel)
    if peft and _quantized_base(model, LoraLayer):  # QLoRA: a 4-bit weight cannot take the adapter folded in
        yield model  # the adapters run unmerged, the base in its own 4-bit kernels
        return
    lean: dict[torch.nn.Module, object] = {}  # LoRA linears running _lean_lora_forward -> that forward
    packed: dict[torch.nn.Module, object] = {}  # Linears running on a prepacked weight -> that forward
    try:
        with torch.no_grad():
            for module in model.modules() if peft and adapters else ():
                if not isinstance(module, LoraLayer) or module.merged:
                    continue
                active = [a for a in module.active_adapters if a in module.lora_A or a in module.lora_embedding_A]
                if not active:
                    continue
                if _lean_applies(module, active) and enabled(model, LEAN):
                    module.forward = guarded(model, LEAN, _lean_lora_forward(module, active),
                                             _merged_linear(module, active, dtype))
                    lean[module] = module.forward
                    continue
                base = module.get_base_layer()
                merged = base.weight.detach()
                for adapter in active:
                    merged = merged + module.get_delta_weight(adapter).to(merged.dtype)
                swap(base, "weight", merged)
            head = model.get_output_embeddings()
            if dtype is not None:
                shared = _shared_weights(model)
                for name, module in model.named_modules():
                    if peft and ".lora_" in f".{name}":  # adapters: in their own dtype (PEFT's), or unused
                        continue
                    for pname, p in list(module._parameters.items()):
                        if p is None or not p.is_floating_point() or p.dtype == dtype:
                            continue
                        if (pname != "weight" or dtype is not torch.bfloat16 or not packable(module, p, dtype)
                                or (head_float32 and module is head) or not enabled(model, PACKED)):
                            swap(module, pname, p)
                            continue
                        kept = kept_copies.setdefault(module, {})
                        try:
                            if id(p) in shared:  # a tied head: the plain copy stays its weight, shared with its twin
                                weight = packed_weight(module, p, kept, dtype, key="weight.packed")
                                swap(module, pname, p)
                            else:  # the packed copy is the only one
                                weight = module._parameters[pname] = packed_weight(module, p, kept, dtype)
                                swapped.append((module, pname, p))
                        except Exception as error:  # the plain cast copy instead
                            fall_back(model, PACKED, error)
                            swap(module, pname, p)
                            continue
                        module.forward = packed[module] = guarded(model, PACKED, packed_forward(module, weight),
                                                                  _cast_linear(module, p, dtype))
            if head_float32 and head.weight.dtype != torch.float32:
                current = head._parameters["weight"]  # maybe already a copy in `dtype`; a tied twin keeps it
                kept = kept_copies.setdefault(head, {})
                copy = kept.get("weight.float32")
                if copy is None or copy.shape != current.shape:
                    copy = kept["weight.float32"] = torch.nn.Parameter(
                        torch.empty_like(current, dtype=torch.float32), requires_grad=False)
                # From the model's own weight (float32 masters stay unrounded), not a `dtype` copy made above.
                own = next((o for m, n, o in swapped if m is head and n == "weight"), current)
                head._parameters["weight"] = copy.copy_(own)
                swapped.append((head, "weight", current))
                hooks.append(head.register_forward_pre_hook(lambda _m, args: (args[0].float(), *args[1:])))
            if pack:
                for name, module in model.named_modules():
                    weight = module._parameters.get("weight")
                    if (weight is None or weight.is_mkldnn or (dtype is not None and weight.dtype != dtype)
                            or "forward" in module.__dict__ or (peft and ".lora_" in f".{name}")
                            or not enabled(model, PACKED) or not packable(module, weight, weight.dtype)):
                        continue
                    try:
                        copy = packed_copy(weight)
                    except Exception as error:
                        fall_back(model, PACKED, error)
                        continue
                    # Held by this forward only: removing it on exit frees it (not kept between rollouts: a copy
                    # would add the weight's own size to the update's peak).
                    module.forward = packed[module] = guarded(model, PACKED, packed_forward(module, copy),
                                                              type(module).forward.__get__(module))
        if peft and adapters:
            with model.disable_adapter():
                yield model
        else:
            yield model
    finally:
        for hook in hooks:
            hook.remove()
        for module, name, original in reversed(swapped):
            module._parameters[name] = original
        restore_forwards({**lean, **packed})  # the class's (PEFT's, torch's) forward again


def _shared_weights(model) -> set[int]:
    """ids of parameters held by more than one module (tied embeddings): those keep one plain copy for all."""
    seen: set[int] = set()
    shared: set[int] = set()
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None:
                (shared if id(p) in seen else seen).add(id(p))
    return shared


def _lean_applies(module, adapters: list[str]) -> bool:
    """Whether `module` is a plain LoRA linear whose adapters are all vanilla LoRA (no DoRA or other variant)."""
    from peft.tuners.lora.layer import Linear

    return type(module) is Linear and "forward" not in module.__dict__ and vanilla_adapters(module, adapters)


def _lean_lora_forward(module, adapters: list[str]):
    """PEFT's LoRA Linear forward for inference, minus its per-call checks: base(x) + B(A(drop(x))) * scaling per
    adapter, in PEFT's order and dtypes (the adapter in its own, float32: the same logits bit for bit).

    What does not change during a rollout is decided once here, not at every call (168 calls a decode step at
    Qwen2.5-0.5B's shape): each adapter's route (one addmm, or PEFT's three steps) and B's transposed view;
    a plain base Linear is called as F.linear on its current weight, without a second module call."""
    base = module.get_base_layer()
    paths = []
    for adapter in adapters:
        drop = module.lora_dropout[adapter]
        a, b, scaling = module.lora_A[adapter], module.lora_B[adapter], module.scaling[adapter]
        # one addmm for PEFT's product, scale and add: a power-of-two scale is exact, so the one rounding of the
        # add is PEFT's (tests/worker/rollout/test_lean_lora.py checks the outputs bit for bit)
        fused = b.bias is None and _exact_scale(scaling)
        paths.append((None if isinstance(drop, torch.nn.Identity) else drop, a.weight, a.bias, b.weight,
                      b.weight.t(), b.bias, scaling, fused))
    linear, addmm = torch.nn.functional.linear, torch.addmm

    def forward(x: Tensor, *args, **kwargs) -> Tensor:
        if args or kwargs or not _plain_linear(base):
            result = base(x, *args, **kwargs)
        else:  # what base(x) runs, read at call time (the rollout may have swapped the weight for a cast copy)
            result = linear(x, base.weight, base.bias)
        result_dtype = result.dtype
        for drop, a_weight, a_bias, b_weight, b_weight_t, b_bias, scaling, fused in paths:
            h = x if x.dtype == a_weight.dtype else x.to(a_weight.dtype)
            h = linear(h if drop is None else drop(h), a_weight, a_bias)
            if fused and torch.promote_types(result.dtype, h.dtype) == h.dtype:
                width = b_weight.shape[0]
                result = addmm(result.to(h.dtype).reshape(-1, width), h.reshape(-1, h.shape[-1]), b_weight_t,
                               alpha=scaling).view(*result.shape[:-1], width)
            else:
                result = result + linear(h, b_weight, b_bias) * scaling
        return result if result.dtype == result_dtype else result.to(result_dtype)

    return forward


def _merged_linear(module, adapters: list[str], dtype: torch.dtype | None):
    """The lean forward's fallback, the plain path's own arithmetic: the base Linear on its weight with the adapters
    folded in, cast to the rollout's dtype (made at the first call, for the rest of the rollout: the next one
    folds them as the plain path does)."""
    base = module.get_base_layer()
    weight = base._parameters["weight"]  # the model's own, before any cast copy replaces it
    merged: list[Tensor] = []

    def forward(x: Tensor, *args, **kwargs) -> Tensor:
        if not merged:
            with torch.no_grad():
                folded = weight.detach()
                for adapter in adapters:
                    folded = folded + module.get_delta_weight(adapter).to(folded.dtype)
                merged.append(folded.to(dtype or folded.dtype))
        return torch.nn.functional.linear(x, merged[0], base.bias)

    return forward


def _cast_linear(module, source: Tensor, dtype: torch.dtype):
    """The Linear on `source` cast to `dtype` at each call (a packed forward's fallback, whose module holds only the
    packed copy; for the rest of that rollout: the next one casts once)."""

    def forward(x: Tensor) -> Tensor:
        return torch.nn.functional.linear(x, source.to(dtype), module.bias)

    return forward


def _plain_linear(module) -> bool:
    """Whether calling `module` runs exactly F.linear(x, module.weight, module.bias): a torch Linear with neither
    its own forward (a packed one, worker/rollout/packed_linears.py) nor hooks, of its own or global."""
    return (type(module) is torch.nn.Linear and "forward" not in module.__dict__ and not module._forward_hooks
            and not module._forward_pre_hooks and not _global_hooks())


def _global_hooks() -> bool:
    return bool(nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks)


def _exact_scale(scaling: float) -> bool:
    """Whether multiplying by `scaling` rounds nothing (a power of two: alpha = 2r, r, ... as LoRA configs mostly are)."""
    return scaling > 0 and math.frexp(scaling)[0] == 0.5


def _quantized_base(model, lora_layer) -> bool:
    """Whether any adapted layer's base weight is quantised (bitsandbytes' Params4bit carries a quant_state)."""
    return any(getattr(m.get_base_layer().weight, "quant_state", None) is not None
               for m in model.modules() if isinstance(m, lora_layer))
