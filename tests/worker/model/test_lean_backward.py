"""The update's lean backward: SwiGLU MLPs keep one MLP-width tensor less per layer, RMSNorms on bf16 activations no
float32 copy of their input; the same log-probs and gradients bit for bit."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaMLP

from tests.worker.trainer.conftest import parameter_storages, saved_for_backward, toy_lora_model
from tests.worker.trainer.test_scoring import CPU, PAD, groups, score
from worker.model.lean_backward import lean_backward, silu_mul
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
    with lean_backward(lora_model):
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
    with lean_backward(lora_model):
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
    with lean_backward(holder):
        assert all("forward" in m.__dict__ for m in mlps)
        assert "forward" not in other.__dict__
    assert not any("forward" in m.__dict__ for m in holder.modules())


def _bf16_model(toy_dir, *, lora: bool):
    """The toy model in bf16: whole, or with float32 adapters (as the policy keeps them, under a bf16 autocast)."""
    from worker.model.loading import load_causal_lm

    if lora:
        return toy_lora_model(toy_dir, torch.bfloat16).train()
    return load_causal_lm(toy_dir / "model", dtype=torch.bfloat16).train()


@pytest.mark.parametrize("lora", [False, True], ids=["full bf16", "bf16 base, float32 LoRA, autocast"])
def test_bf16_norms_and_mlps_give_the_same_logprobs_and_gradients_bit_for_bit(toy_dir, lora):
    """Norm weights train in the full model (their gradients come from the recomputed forward) and are frozen
    under LoRA; either way every gradient is the plain forward's, bit for bit."""
    model = _bf16_model(toy_dir, lora=lora)
    batch = collate_sequences(*groups(), pad_id=PAD, device=CPU, share_prefixes=True)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=lora)
    with autocast:
        logp_a, ent_a, grads_a = score(model, batch)
    with autocast, lean_backward(model):
        logp_b, ent_b, grads_b = score(model, batch)
    for a, b in zip(logp_a + ent_a, logp_b + ent_b, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert grads_a.keys() == grads_b.keys()
    assert any("norm" in n for n in grads_a) != lora  # the norms train in the full model only
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=0, atol=0, msg=name)


def test_bf16_norms_keep_their_input_and_no_float32_copy(toy_dir):
    model = _bf16_model(toy_dir, lora=True)
    batch = collate_sequences(*groups(), pad_id=PAD, device=CPU, share_prefixes=True)
    hidden = model.config.hidden_size

    def float32_hidden_kept(lean: bool) -> int:
        with torch.autocast("cpu", dtype=torch.bfloat16), (lean_backward(model) if lean else nullcontext()):
            logp, _ = sequence_logprobs(model, batch, temperature=1.0, chunk_size=16)
        kept = saved_for_backward(logp.sum(), skip=parameter_storages(model))
        return sum(t.dtype == torch.float32 and t.dim() > 1 and t.shape[-1] == hidden for _, t in kept)

    # a norm's float32 copy of its bf16 input (kept by pow and by the product with rsqrt): one per norm whose
    # input gradient the loss needs (the decoder layers' of both passes)
    assert float32_hidden_kept(lean=False) >= 2 * model.config.num_hidden_layers
    assert float32_hidden_kept(lean=True) == 0


def test_a_float32_input_runs_the_norm_as_it_is(lora_model):
    """A float32 norm keeps nothing more than its own forward does: no recomputation is added."""
    batch = collate_sequences(*groups(), pad_id=PAD, device=CPU)
    lora_model.train()
    with lean_backward(lora_model):
        logp, _ = sequence_logprobs(lora_model, batch, temperature=1.0, chunk_size=16)
    nodes = saved_for_backward(logp.sum())
    assert not any("RecomputedNorm" in name for name, _ in nodes)
    assert any("SiluMul" in name for name, _ in nodes)


def test_under_fsdp_the_norms_are_left_alone(lora_model):
    with lean_backward(lora_model, norms=False):
        assert not any("forward" in m.__dict__ for m in lora_model.modules() if "RMSNorm" in type(m).__name__)
        assert any("forward" in m.__dict__ for m in lora_model.modules() if isinstance(m, LlamaMLP))


def _hub_kernel_mode_switch(model) -> None:
    """What transformers' train() and eval() do with hub kernels on (the default from transformers 5.25): the
    kernels library's kernelize puts each kernel layer's own (or the hub's) forward back, dropping the instance's."""
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.__dict__.pop("forward", None)


def test_a_forward_put_back_inside_the_block_leaves_the_block_cleanly(lora_model):
    """The hub kernels' mode switch drops the norms' lean forwards mid-update: the block still gives the plain
    gradients, ends without an error, and leaves no forward of its own behind."""
    batch = collate_sequences(*groups(), pad_id=PAD, device=CPU, share_prefixes=True)
    lora_model.train()
    _, _, want = score(lora_model, batch)
    with lean_backward(lora_model):
        _hub_kernel_mode_switch(lora_model)
        _, _, grads = score(lora_model, batch)
    for name in want:
        torch.testing.assert_close(grads[name], want[name], rtol=0, atol=0, msg=name)
    assert not [n for n, m in lora_model.named_modules() if "forward" in m.__dict__]


def test_with_the_installed_transformers_hub_kernels_on_the_block_leaves_their_layers_alone():
    """transformers' own kernel machinery (where the installed kernels library is one it can use): the layers it
    owns keep its forwards, the MLPs still run lean, and train()/eval() inside the block break nothing."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import is_kernels_available

    if not is_kernels_available():
        pytest.skip("no kernels library this transformers can use")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)
    model = LlamaForCausalLM(config)
    model.set_use_kernels(True)
    ids = torch.randint(0, 32, (2, 6))
    model.train()
    model(ids).logits.sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    with lean_backward(model):
        assert "forward" in model.model.layers[0].mlp.__dict__
        model.eval()
        model.train()
        model(ids).logits.sum().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name], rtol=0, atol=0, msg=name)
    assert "forward" not in model.model.layers[0].mlp.__dict__


def test_the_worker_loads_models_without_hub_kernels(toy_dir):
    """From transformers 5.25 from_pretrained turns hub kernels on by default (kernel code fetched from the hub,
    forwards swapped at every train() and eval()); the worker runs the model's own code."""
    from worker.model.loading import load_causal_lm

    model = load_causal_lm(toy_dir / "model", dtype=torch.float32)
    assert getattr(model, "use_kernels", False) is False
