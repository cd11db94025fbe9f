"""The rollout's lean LoRA forward: PEFT's outputs bit for bit at decode's and prefill's row counts, with the adapter's
product, scale and add in one addmm when the scale is a power of two (exact) and PEFT's three steps otherwise."""

from __future__ import annotations

import pytest
import torch

from worker.rollout import effective_weights
from worker.rollout.effective_weights import _lean_lora_forward


def _layer(lora_model):
    return lora_model.get_base_model().model.layers[0].mlp.up_proj


@pytest.mark.parametrize("scaling", [2.0, 0.5, 1.0, 1.7])
@pytest.mark.parametrize("rows", [1, 5, 16, 64])
def test_the_lean_forward_gives_peft_outputs_bit_for_bit(lora_model, scaling, rows):
    layer = _layer(lora_model)
    saved = layer.scaling["default"]
    layer.scaling["default"] = scaling
    try:
        x = torch.randn(rows, 1, layer.in_features, generator=torch.Generator().manual_seed(rows))
        with torch.no_grad():
            expected = layer(x)  # PEFT's own forward
            assert torch.equal(_lean_lora_forward(layer, ["default"])(x), expected)
    finally:
        layer.scaling["default"] = saved


@pytest.mark.parametrize("scaling, fused", [(2.0, True), (1.7, False)])
def test_a_power_of_two_scale_runs_one_addmm(lora_model, monkeypatch, scaling, fused):
    layer = _layer(lora_model)
    saved = layer.scaling["default"]
    layer.scaling["default"] = scaling
    calls = []
    addmm = torch.addmm
    monkeypatch.setattr(torch, "addmm", lambda *a, **k: calls.append(k.get("alpha")) or addmm(*a, **k))
    try:
        with torch.no_grad():
            _lean_lora_forward(layer, ["default"])(torch.randn(16, 1, layer.in_features))
    finally:
        layer.scaling["default"] = saved
    assert calls == ([scaling] if fused else [])
    assert effective_weights._exact_scale(2.0) and effective_weights._exact_scale(0.25)
    assert not effective_weights._exact_scale(1.7) and not effective_weights._exact_scale(0.0)


def test_the_lean_forward_reads_the_base_weight_at_call_time(lora_model):
    """The rollout swaps base weights for cast copies after the lean forward is built: the call must see them."""
    layer = _layer(lora_model)
    base = layer.get_base_layer()
    forward = _lean_lora_forward(layer, ["default"])
    x = torch.randn(16, 1, layer.in_features, generator=torch.Generator().manual_seed(3))
    original = base._parameters["weight"]
    try:
        base._parameters["weight"] = torch.nn.Parameter(original.detach() * 2, requires_grad=False)
        with torch.no_grad():
            expected = layer(x)  # PEFT's forward on the swapped weight
            assert torch.equal(forward(x), expected)
    finally:
        base._parameters["weight"] = original


def test_a_base_with_its_own_forward_or_hooks_is_called_as_a_module(lora_model):
    """A packed base forward (bf16 rollouts) and forward hooks are honoured, not bypassed by the direct F.linear."""
    layer = _layer(lora_model)
    base = layer.get_base_layer()
    forward = _lean_lora_forward(layer, ["default"])
    x = torch.randn(4, 1, layer.in_features, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        plain = forward(x)
        base.forward = lambda inp: torch.nn.functional.linear(inp, base.weight) + 1.0
        try:
            assert torch.equal(forward(x), layer(x))  # PEFT's forward runs the base's own forward too
            assert not torch.equal(forward(x), plain)
        finally:
            del base.forward
        handle = base.register_forward_hook(lambda _m, _a, out: out * 0)
        try:
            assert torch.equal(forward(x), layer(x))
            assert not torch.equal(forward(x), plain)
        finally:
            handle.remove()
        assert torch.equal(forward(x), plain)


@pytest.mark.parametrize("lean", [True, False])
def test_the_effective_weights_equal_peft_when_the_last_adapted_layer_holds_another_adapter(toy_dir, lean):
    """Two adapters on other modules, the active one's earlier in the model: every adapted layer is applied once
    (on the merged path the adapter path is switched off for the forward), whichever layer is visited last."""
    from contextlib import nullcontext

    from worker.model.optional_swaps import switched_off
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(toy_dir / "model", dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], init_lora_weights=False))
    model.add_adapter("other", LoraConfig(r=4, lora_alpha=8, target_modules=["down_proj"], init_lora_weights=False))
    model.set_adapter("default")
    model.eval()
    ids = torch.tensor([[1, 5, 7, 9, 11]])
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        with nullcontext() if lean else switched_off(effective_weights.LEAN), \
                effective_weights.rollout_weights(model) as plain:
            got = plain(input_ids=ids).logits
    assert torch.allclose(got, expected, atol=1e-5), float((got - expected).abs().max())
