"""bfloat16 CPU rollouts on prepacked oneDNN weights: the same tokens, log-probs and logits as unpacked, bit for bit;
one packed copy per weight, reused while the weight is unchanged and refreshed when it changes. float32 rollouts:
only weights large enough to pay are packed, within rounding of sgemm, and their copies last one rollout."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from service.job_spec.sampling import SamplingSpec
from worker.rollout import decode, packed_linears
from worker.rollout.effective_weights import rollout_weights
from worker.rollout.rollout_state import release_rollout_state

EOS, PAD = 2, 0
CPU = torch.device("cpu")
BF16 = torch.bfloat16

pytestmark = pytest.mark.skipif(not (torch.backends.mkldnn.is_available()
                                     and torch.ops.mkldnn._is_mkldnn_bf16_supported()),
                                reason="no oneDNN bfloat16 on this CPU")


def prompts(n: int = 6) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(3, 10, (n,), generator=g).tolist()
    return [[1] + torch.randint(4, 40, (k,), generator=g).tolist() for k in lengths]


def _sample(model, rows):
    spec = SamplingSpec(max_output_tokens=10, max_model_len=64, temperature=0.9)
    with rollout_weights(model, BF16) as low:
        tokens, logprobs = decode.sample_tokens(low, rows, max_new=10, sampling=spec, greedy=False, eos_id=EOS,
                                                pad_id=PAD, device=CPU, logprobs=True, seeds=list(range(len(rows))))
        logits = low(input_ids=torch.tensor(rows[0])[None]).logits
    return tokens, logprobs, logits


@pytest.mark.parametrize("rows", [1, 2, 5, 16, 17, 64, 100])
def test_the_packed_kernel_equals_f_linear_in_bfloat16(rows):
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 80).to(BF16), torch.randn(96).to(BF16)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, packed_linears.PACK_ROWS)
    layer = torch.nn.Linear(80, 96).to(BF16)
    forward = packed_linears.packed_forward(layer, packed)
    inputs = [torch.randn(rows, 80).to(BF16), torch.randn(rows, 1, 80).to(BF16),
              torch.randn(rows, 3, 80).to(BF16)[:, -1:],  # a non-contiguous slice, as the LM head gets at prefill
              torch.randn(2, rows, 1, 80).to(BF16), torch.randn(2, rows, 3, 80).to(BF16)[:, :, 1:2],
              torch.randn(80, rows).to(BF16).t()]
    for x in inputs:
        layer.bias = None
        assert torch.equal(forward(x), F.linear(x, weight))
        layer.bias = torch.nn.Parameter(bias, requires_grad=False)
        assert torch.equal(forward(x), F.linear(x, weight, bias))


def test_a_packed_rollout_gives_the_unpacked_tokens_logprobs_and_logits(lora_model, monkeypatch):
    rows = [p for p in prompts(3) for _ in range(3)]
    release_rollout_state(lora_model, above_bytes=0)
    packed = _sample(lora_model, rows)
    import worker.rollout.effective_weights as effective_weights

    monkeypatch.setattr(effective_weights, "packable", lambda *a: False)
    release_rollout_state(lora_model, above_bytes=0)
    plain = _sample(lora_model, rows)
    assert packed[0] == plain[0] and packed[1] == plain[1]
    assert torch.equal(packed[2], plain[2])
    release_rollout_state(lora_model, above_bytes=0)


def test_linears_run_packed_inside_and_as_they_were_after(lora_model):
    before = {n: p for n, p in lora_model.named_parameters()}
    base = lora_model.get_base_model().model.layers[0].self_attn.q_proj.base_layer
    with rollout_weights(lora_model, BF16):
        assert base.weight.is_mkldnn and base.weight.dtype == BF16 and "forward" in base.__dict__
    assert "forward" not in base.__dict__ and not base.weight.is_mkldnn
    for name, p in lora_model.named_parameters():
        assert p is before[name] and p.dtype == torch.float32, name
    with rollout_weights(lora_model):  # float32 rollouts stay on the model's own weights (PEFT's logits exactly)
        assert not base.weight.is_mkldnn and "forward" not in base.__dict__


def test_a_frozen_weight_is_packed_once_and_repacked_when_it_changes(lora_model):
    base = lora_model.get_base_model().model.layers[0].mlp.down_proj.base_layer
    ids = torch.tensor(prompts(2)[0])[None]
    with torch.no_grad(), rollout_weights(lora_model, BF16):
        first, logits = base.weight, lora_model(input_ids=ids).logits
    with torch.no_grad(), rollout_weights(lora_model, BF16):
        assert base.weight is first  # not cast and reordered again
    saved = base.weight.detach().clone()
    try:
        with torch.no_grad():
            base.weight.mul_(1.5)  # an in-place write (an optimizer step, a checkpoint load) bumps its version
            with rollout_weights(lora_model, BF16):
                assert base.weight is not first
                assert not torch.equal(lora_model(input_ids=ids).logits, logits)
    finally:
        with torch.no_grad():
            base.weight.copy_(saved)


def test_a_tied_head_keeps_one_shared_weight_and_runs_packed(toy_dir, monkeypatch):
    import worker.rollout.effective_weights as effective_weights

    model = AutoModelForCausalLM.from_pretrained(toy_dir / "model", dtype=torch.float32)
    model.get_output_embeddings().weight = model.get_input_embeddings().weight  # as a tied checkpoint loads
    ids = torch.tensor(prompts(2)[0])[None]
    with torch.no_grad():
        with rollout_weights(model, BF16) as low:
            head = low.get_output_embeddings()
            assert low.get_input_embeddings().weight is head.weight and not head.weight.is_mkldnn
            assert "forward" in head.__dict__
            packed = low(input_ids=ids).logits
        monkeypatch.setattr(effective_weights, "packable", lambda *a: False)
        with rollout_weights(model, BF16) as low:
            plain = low(input_ids=ids).logits
    assert torch.equal(packed, plain)
    assert "forward" not in model.get_output_embeddings().__dict__


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_the_prefill_head_gets_a_contiguous_input_in_bfloat16_only(toy_dir, monkeypatch, dtype):
    """A model loaded in bfloat16 (no rollout copies, so nothing packed): the prefill's head input is made
    contiguous (no bmm over copies of the head's weight), with the same tokens and log-probs bit for bit; a float32
    head keeps torch.matmul's route (MKL rounds the two differently)."""
    from contextlib import nullcontext

    model = AutoModelForCausalLM.from_pretrained(toy_dir / "model", dtype=dtype).eval()
    rows = [p for p in prompts(3) for _ in range(2)]
    spec = SamplingSpec(max_output_tokens=6, max_model_len=64)
    seen = []
    hook = model.get_output_embeddings().register_forward_hook(
        lambda _m, args, _o: seen.append(args[0].is_contiguous()))

    def run():
        return decode.sample_tokens(model, rows, max_new=6, sampling=spec, greedy=False, eos_id=EOS, pad_id=PAD,
                                    device=CPU, logprobs=True, seeds=list(range(len(rows))))

    try:
        got = run()
        prefill_contiguous = seen[0]
        monkeypatch.setattr(decode, "contiguous_head_input", lambda *a, **k: nullcontext())
        plain = run()
    finally:
        hook.remove()
    assert prefill_contiguous == (dtype is BF16)
    assert got == plain
    assert not model.get_output_embeddings()._forward_pre_hooks


@pytest.mark.parametrize("rows", [1, 2, 5, 16, 17, 64, 100])
def test_the_packed_kernel_is_within_float32_rounding_of_f_linear(rows):
    """Float32: oneDNN sums the products in another order than MKL's sgemm, so only rounding may differ. Any order
    of a k-term float32 sum stays within k * 2**-24 * sum|x_i w_i| (+ the bias's |b| * 2**-24) of the exact one:
    a wrong weight, layout or bias would miss that by orders of magnitude."""
    torch.manual_seed(0)
    k = 896
    weight, bias = torch.randn(320, k), torch.randn(320)
    packed = packed_linears.packed_copy(weight)
    layer = torch.nn.Linear(k, 320)
    forward = packed_linears.packed_forward(layer, packed)
    inputs = [torch.randn(rows, k), torch.randn(rows, 1, k), torch.randn(rows, 3, k)[:, -1:],
              torch.randn(2, rows, 1, k), torch.randn(2, rows, 3, k)[:, :, 1:2], torch.randn(k, rows).t()]
    unit = 2.0 ** -24
    for x in inputs:
        for b in (None, bias):
            layer.bias = None if b is None else torch.nn.Parameter(b, requires_grad=False)
            got, want = forward(x), F.linear(x, weight, b)
            bound = unit * (k * F.linear(x.abs(), weight.abs()) + (0 if b is None else b.abs()))
            assert got.shape == want.shape
            assert ((got - want).abs() <= bound).all()


def _wide_mlp_lora_model():
    """A LoRA model whose MLP weights (64 x 4096) reach the float32 packing threshold and whose attention (64 x 64),
    adapters and head (64-word vocabulary) do not."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=4096, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
                         bos_token_id=1, eos_token_id=EOS, pad_token_id=PAD)
    assert 64 * 4096 >= packed_linears.FLOAT32_PACK_MIN_ELEMENTS > 64 * 64
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    return model.eval()


def _record_packing(monkeypatch, base) -> tuple[list[str], list]:
    """The names of the base model's linears that rollouts pack own-dtype copies of, and weak references to the
    copies (to see them freed)."""
    import weakref

    import worker.rollout.effective_weights as effective_weights

    names = {id(m.weight): n for n, m in base.named_modules() if isinstance(m, torch.nn.Linear)}
    packed_names, copies = [], []

    def recording(weight):
        copy = packed_linears.packed_copy(weight)
        packed_names.append(names[id(weight)])
        copies.append(weakref.ref(copy))
        return copy

    monkeypatch.setattr(effective_weights, "packed_copy", recording)
    return packed_names, copies


def test_a_float32_rollout_packs_only_large_weights_and_drops_the_copies_after(monkeypatch):
    """The rollout sampler packs the float32 weights large enough to pay, through the LoRA base layers, for the
    rollout only: the copies are freed when it ends, so they never add to the update's peak memory."""
    import gc
    from types import SimpleNamespace

    from worker.rollout.rollout import TransformersSampler

    model = _wide_mlp_lora_model()
    base = model.get_base_model()
    packed_names, copies = _record_packing(monkeypatch, base)
    policy = SimpleNamespace(model=model, tokenizer=SimpleNamespace(eos_token_id=EOS, pad_token_id=PAD),
                             lm_head_float32=False, device=CPU)
    sample = TransformersSampler(policy, SamplingSpec(max_output_tokens=8, max_model_len=64), logprobs=True)
    rows = [p for p in prompts(3) for _ in range(2)]
    tokens, _ = sample(rows, [8] * len(rows), greedy=False, seeds=list(range(len(rows))))
    assert all(len(t) > 0 for t in tokens)
    mlp = {f"model.layers.{i}.mlp.{p}_proj.base_layer" for i in range(2) for p in ("gate", "up", "down")}
    assert sorted(packed_names) == sorted(mlp)
    gc.collect()
    assert copies and all(ref() is None for ref in copies)
    assert not any("forward" in m.__dict__ for m in base.modules() if type(m) is torch.nn.Linear)


def test_float32_packed_logits_are_within_rounding_of_the_unpacked(monkeypatch):
    """What packing changes in a float32 forward is rounding: logits within 1e-5 of sgemm's (the 0.5B shape's moved
    by at most 9.3e-6, bench/README.md), and the model's forward is its own again after."""
    model = _wide_mlp_lora_model()
    ids = torch.tensor(prompts(2)[0])[None]
    with torch.no_grad():
        with rollout_weights(model, pack=True) as rolled:
            down = model.get_base_model().model.layers[0].mlp.down_proj.base_layer
            assert "forward" in down.__dict__
            packed = rolled(input_ids=ids).logits
        with rollout_weights(model) as rolled:
            assert "forward" not in down.__dict__
            plain = rolled(input_ids=ids).logits
    assert not torch.equal(packed, plain)  # the packed kernel did run
    torch.testing.assert_close(packed, plain, rtol=0, atol=1e-5)


def test_a_bfloat16_model_decodes_on_packed_copies_for_one_rollout_with_the_same_tokens(toy_dir, monkeypatch):
    """A model loaded in bfloat16 casts nothing, so no cast copy is there to pack: with `pack` each of its linears
    runs on a packed copy made for the rollout (the same kernel, so the same tokens, log-probs and logits bit for
    bit), and the copies are freed when it ends (kept, they would add the weights' size to the update's peak)."""
    import gc

    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(toy_dir / "model", dtype=BF16),
                           LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # the adapter changes the tokens, so it takes part in what is compared
    base = model.get_base_model()
    packed_names, copies = _record_packing(monkeypatch, base)
    rows = [p for p in prompts(3) for _ in range(2)]
    spec = SamplingSpec(max_output_tokens=10, max_model_len=64, temperature=0.9)

    def sample(pack: bool):
        with torch.no_grad(), rollout_weights(model, pack=pack) as rolled:
            tokens, logprobs = decode.sample_tokens(rolled, rows, max_new=10, sampling=spec, greedy=False,
                                                    eos_id=EOS, pad_id=PAD, device=CPU, logprobs=True,
                                                    seeds=list(range(len(rows))))
            return tokens, logprobs, rolled(input_ids=torch.tensor(rows[0])[None]).logits

    packed = sample(True)
    linears = {n for n, m in base.named_modules() if type(m) is torch.nn.Linear and ".lora_" not in f".{n}"}
    assert sorted(packed_names) == sorted(linears) and len(linears) > 10  # every base linear and the head
    gc.collect()
    assert all(ref() is None for ref in copies)
    assert not any("forward" in m.__dict__ for m in base.modules())
    made = len(packed_names)
    plain = sample(False)
    assert len(packed_names) == made  # nothing packed without `pack`
    assert packed[0] == plain[0] and packed[1] == plain[1] and torch.equal(packed[2], plain[2])
    assert all(p.dtype == BF16 and not p.is_mkldnn for n, p in base.named_parameters() if ".lora_" not in n)
