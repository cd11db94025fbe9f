"""Fixtures of the trainer tests: the toy model with a LoRA that matters, and a recorder of forward shapes."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from peft import LoraConfig, get_peft_model

from worker.model.loading import load_causal_lm


@pytest.fixture(scope="module")
def lora_model(toy_dir):
    return toy_lora_model(toy_dir).eval()


def toy_lora_model(toy_dir, dtype: torch.dtype = torch.float32):
    """The toy model in `dtype` with a LoRA (float32, as PEFT keeps adapters) whose B matrices are far from zero, so
    the adapter changes what it computes."""
    torch.manual_seed(0)
    base = load_causal_lm(toy_dir / "model", dtype=dtype)  # as the worker loads it
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    return model


@contextmanager
def forward_shapes(model):
    """The (batch, tokens) shape of every forward `model` (a PeftModel) runs inside the block, in order."""
    shapes: list[tuple[int, int]] = []
    hook = model.get_base_model().model.embed_tokens.register_forward_hook(
        lambda _m, args, _out: shapes.append(tuple(args[0].shape)))
    try:
        yield shapes
    finally:
        hook.remove()


def saved_for_backward(output: torch.Tensor, *, skip: set[int] = frozenset()) -> list[tuple[str, torch.Tensor]]:
    """Every tensor the autograd graph behind `output` keeps for backward, once per storage (storages in `skip`,
    e.g. the parameters', left out), with the node that keeps it."""
    found: dict[int, tuple[str, torch.Tensor]] = {}
    seen, stack = set(), [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for attr in dir(node):  # built-in nodes name each saved tensor _saved_*; autograd Functions': saved_tensors
            if not (attr.startswith("_saved_") or attr == "saved_tensors"):
                continue
            value = getattr(node, attr)
            for t in value if isinstance(value, (tuple, list)) else [value]:
                if isinstance(t, torch.Tensor) and t.numel() and t.untyped_storage().data_ptr() not in skip:
                    found.setdefault(t.untyped_storage().data_ptr(), (node.name(), t))
        stack.extend(n for n, _ in node.next_functions)
    return list(found.values())


def parameter_storages(model: torch.nn.Module) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in model.parameters()}
