"""The update's fused LoRA linears: PEFT's log-probs and gradients, with the adapter added by one addmm."""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.worker.trainer.conftest import parameter_storages, saved_for_backward, toy_lora_model
from tests.worker.trainer.test_scoring import CPU, PAD, groups, score
from worker.model.lora_forward import fused_lora_linears
from worker.trainer.scoring import collate_sequences


class CountOps(TorchDispatchMode):
    """How many times each aten op runs inside the block."""

    def __init__(self):
        super().__init__()
        self.calls: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[func] = self.calls.get(func, 0) + 1
        return func(*args, **(kwargs or {}))


def _adapted_linears(model) -> int:
    from peft.tuners.lora.layer import Linear

    return sum(type(m) is Linear for m in model.modules())


def test_fused_linears_give_peft_s_logprobs_and_gradients(lora_model):
    seqs, masks = groups()
    batch = collate_sequences(seqs, masks, pad_id=PAD, device=CPU, share_prefixes=True)
    lora_model.train()
    logp_a, ent_a, grads_a = score(lora_model, batch)
    with fused_lora_linears(lora_model), CountOps() as ops:
        logp_b, ent_b, grads_b = score(lora_model, batch)
    # the fused path ran: one addmm per adapted linear in each of the two forwards (prefix, then rows)
    assert ops.calls.get(torch.ops.aten.addmm.default, 0) == 2 * _adapted_linears(lora_model)
    for a, b in zip(logp_a + ent_a, logp_b + ent_b, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert grads_a.keys() == grads_b.keys() and any("lora_B" in n for n in grads_a)
    for name in grads_a:
        gap = (grads_a[name] - grads_b[name]).norm() / grads_a[name].norm()
        assert gap < 1e-5, (name, float(gap))


def test_disabled_adapters_inside_the_block_score_the_base(lora_model):
    """The reference policy (adapters disabled) inside the block is the base model, as PEFT's forward gives."""
    seqs, masks = groups()
    batch = collate_sequences(seqs, masks, pad_id=PAD, device=CPU)
    lora_model.eval()
    with torch.no_grad(), lora_model.disable_adapter():
        want, _, _ = _logprobs(lora_model, batch)
    with torch.no_grad(), fused_lora_linears(lora_model), lora_model.disable_adapter():
        got, _, _ = _logprobs(lora_model, batch)
    with torch.no_grad():
        adapted, _, _ = _logprobs(lora_model, batch)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not torch.allclose(adapted, want, atol=1e-3)  # the adapter does change the log-probs


def test_the_block_restores_peft_s_forward(lora_model):
    with fused_lora_linears(lora_model):
        assert sum("forward" in m.__dict__ for m in lora_model.modules()) == _adapted_linears(lora_model)
    assert not any("forward" in m.__dict__ for m in lora_model.modules())


def _logprobs(model, batch):
    from worker.trainer.scoring import sequence_logprobs

    logp, entropy = sequence_logprobs(model, batch, temperature=1.0, chunk_size=16)
    return logp, entropy, None


def test_under_autocast_the_adapters_keep_their_layer_s_input_not_copies(toy_dir):
    """A bf16 base with float32 adapters under bf16 autocast (the policy's mixed precision): q, k and v (and gate
    and up) keep one input for backward between them, as PEFT's cast to float32 and back made one copy each."""
    model = toy_lora_model(toy_dir, torch.bfloat16).train()
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if "lora_" in n)
    batch = collate_sequences(*groups(), pad_id=PAD, device=CPU)
    hidden, layers = model.config.hidden_size, model.config.num_hidden_layers

    def inputs_kept(fused: bool):
        with torch.autocast("cpu", dtype=torch.bfloat16), (fused_lora_linears(model) if fused else nullcontext()):
            logp, _, _ = _logprobs(model, batch)
        kept = saved_for_backward(logp.sum(), skip=parameter_storages(model))
        # the inputs of the rank-r matmuls (mm's first operand, at the model's width)
        return logp, sum(name == "MmBackward0" and t.dim() == 2 and t.shape[-1] == hidden and t.shape[0] > 4
                         for name, t in kept)

    want, peft_copies = inputs_kept(fused=False)
    got, fused_copies = inputs_kept(fused=True)
    assert peft_copies == 6 * layers  # q, k, v, o, gate, up: a copy each
    assert fused_copies == 3 * layers  # the attention's input, o's, the MLP's
    torch.testing.assert_close(got, want, rtol=0, atol=0.05)  # bf16 rounding of the addmm against PEFT's three ops
