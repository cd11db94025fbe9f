"""The update's SwiGLU MLPs: one MLP-width tensor less kept per layer, the same log-probs and gradients bit for bit."""

from __future__ import annotations

import torch
from transformers.models.llama.modeling_llama import LlamaMLP

from tests.trainer.conftest import parameter_storages, saved_for_backward
from tests.trainer.test_scoring import CPU, PAD, groups, score
from worker.model.swiglu import recomputed_swiglu, silu_mul
from worker.trainer.scoring import collate_sequences, sequence_logprobs


def _mlp_width_tensors(model, batch) -> int:
    """How many tensors of the MLP's width the graph of one forward keeps for backward."""
    width = model.config.intermediate_size
    logp, _ = sequence_logprobs(model, batch, temperature=1.0, chunk_size=16)
    kept = saved_for_backward(logp.sum(), skip=parameter_storages(model))
    return sum(t.dim() > 1 and t.shape[-1] == width for _, t in kept)


def test_the_block_gives_the_same_logprobs_and_gradients_bit_for_bit(lora_model):
    batch = collate_sequences(*groups(), pad_id=PAD, device=CPU, share_prefixes=True)
    lora_model.train()
    logp_a, ent_a, grads_a = score(lora_model, batch)
    with recomputed_swiglu(lora_model):
        logp_b, ent_b, grads_b = score(lora_model, batch)
    for a, b in zip(logp_a + ent_a, logp_b + ent_b, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert grads_a.keys() == grads_b.keys() and any("gate_proj.lora_A" in n for n in grads_a)
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=0, atol=0, msg=name)


def test_each_mlp_keeps_one_wide_tensor_less(lora_model):
    batch = collate_sequences(*groups(), pad_id=PAD, device=CPU, share_prefixes=True)
    layers = lora_model.config.num_hidden_layers
    # the rows' pass through every layer, the shared prompts' pass through all but the last (whose MLP output
    # nothing reads: the rows take only the prompts' keys and values)
    mlps = 2 * layers - 1
    lora_model.train()
    plain = _mlp_width_tensors(lora_model, batch)
    with recomputed_swiglu(lora_model):
        lean = _mlp_width_tensors(lora_model, batch)
    # kept without the block: gate(x) for the SiLU, silu(gate(x)) and up(x) for the product, the product for
    # down's adapter; with it silu(gate(x)) is recomputed
    assert plain == 4 * mlps
    assert lean == 3 * mlps


def test_silu_mul_gradients_match_autograd_s_in_bf16():
    gen = torch.Generator().manual_seed(0)
    gate, up = (torch.randn(7, 33, generator=gen).bfloat16().requires_grad_() for _ in range(2))
    grad = torch.randn(7, 33, generator=gen).bfloat16()
    want = torch.autograd.grad(torch.nn.functional.silu(gate) * up, (gate, up), grad)
    out = silu_mul(gate, up)
    got = torch.autograd.grad(out, (gate, up), grad)
    torch.testing.assert_close(out, torch.nn.functional.silu(gate) * up, rtol=0, atol=0)
    for a, b in zip(want, got, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # a frozen input gets no gradient computed
    frozen = silu_mul(gate, up.detach())
    assert torch.autograd.grad(frozen, gate, grad)[0].equal(want[0])


def test_only_llama_style_silu_mlps_are_patched_and_the_block_restores_them(lora_model):
    mlps = [m for m in lora_model.modules() if isinstance(m, LlamaMLP)]
    assert mlps
    other = LlamaMLP(lora_model.config)
    other.act_fn = torch.nn.GELU()  # a GeGLU: recomputing a SiLU would be wrong
    holder = torch.nn.ModuleList([lora_model, other])
    with recomputed_swiglu(holder):
        assert all("forward" in m.__dict__ for m in mlps)
        assert "forward" not in other.__dict__
    assert not any("forward" in m.__dict__ for m in holder.modules())
