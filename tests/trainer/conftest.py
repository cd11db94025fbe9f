"""Fixtures of the trainer tests: the toy model with a LoRA that matters, and a recorder of forward shapes."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM


@pytest.fixture(scope="module")
def lora_model(toy_dir):
    """The toy model with a LoRA whose B matrices are far from zero, so the adapter changes what it computes."""
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(toy_dir / "model", dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    return model.eval()


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
