"""The engine on the toy base: routed passes compute what each adapter alone does, log-probs are the PEFT
model's own, and a saved state resumes exactly (and is refused when tampered with)."""

from __future__ import annotations

import pytest
import torch
from peft import get_peft_model, set_peft_model_state_dict

from worker.checkpoints.checkpoint import CheckpointError
from worker.engine.engine import Engine, lora_spec
from worker.engine.types import AdamParams, AdapterConfig, Datum, Pass
from worker.model.policy import lora_config

from tests.worker.engine.engines import engine_with
from tests.worker.multi.conftest import toy_base

TOL = 1e-5


def _engine(toy_dir, **configs) -> Engine:
    return engine_with(toy_dir, configs)


CONFIGS = {"one": AdapterConfig(rank=4, seed=1), "two": AdapterConfig(rank=2, seed=2, train_mlp=False, alpha=8.0),
           # a LoRA beside the LM head only (Tinker's train_unembed)
           "head": AdapterConfig(rank=3, seed=3, train_attn=False, train_mlp=False, train_unembed=True)}


def _datums(seed: int, lengths=(5, 3)) -> list[Datum]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        tokens = torch.randint(3, 50, (n + 1,), generator=g)
        targets = tokens[1:].clone()
        targets[0] = int(torch.randint(3, 50, (1,), generator=g))  # an arbitrary target, not the next token
        out.append(Datum(tokens[:-1].tolist(), {
            "target_tokens": targets, "logprobs": -torch.rand(n, generator=g) * 4,
            "advantages": torch.randn(n, generator=g)}))
    return out


def _grads(engine, name):
    return [p.grad.clone() for p in engine.shared.parameters(name)]


def test_two_adapters_in_one_call_match_each_alone(toy_dir):
    passes = [Pass("two", _datums(1), "cispo", {"clip_high_threshold": 1.5}), Pass("one", _datums(2), "ppo"),
              Pass("head", _datums(4), "importance_sampling")]
    both = _engine(toy_dir, **CONFIGS)
    together = both.forward_backward(passes)
    for p, result in zip(passes, together):
        single = _engine(toy_dir, **{p.adapter: CONFIGS[p.adapter]})
        (alone,) = single.forward_backward([p])
        for x, y in zip(result.logprobs, alone.logprobs):
            assert torch.allclose(x, y, atol=TOL)
        assert result.metrics["loss:sum"] == pytest.approx(alone.metrics["loss:sum"], abs=TOL)
        for g, h in zip(_grads(both, p.adapter), _grads(single, p.adapter), strict=True):
            assert torch.allclose(g, h, atol=TOL)


@pytest.mark.parametrize("name", ["one", "head"])
def test_cross_entropy_logprobs_are_the_peft_models(toy_dir, name):
    engine = _engine(toy_dir, **{name: CONFIGS[name]})
    datums = _datums(3)
    (result,) = engine.forward_backward([Pass(name, datums, "cross_entropy", forward_only=True)])
    assert all(p.grad is None for p in engine.shared.parameters(name))  # forward_only: no gradient
    model = get_peft_model(toy_base(toy_dir), lora_config(lora_spec(CONFIGS[name])))
    state = engine.shared.adapter_state(name)
    assert any("lm_head" in k for k in state) == (name == "head")
    set_peft_model_state_dict(model, {k: v.clone() for k, v in state.items()})
    model.eval()
    for datum, logp in zip(datums, result.logprobs):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([datum.tokens])).logits[0].float()
        expected = torch.log_softmax(logits, -1).gather(-1, datum.inputs["target_tokens"][:, None])[:, 0]
        assert torch.allclose(logp, expected, atol=TOL)
    assert result.metrics["loss:sum"] == pytest.approx(-float(torch.cat(result.logprobs).sum()), abs=1e-4)


def _step(engine, seed):
    engine.forward_backward([Pass("one", _datums(seed), "importance_sampling")])
    return engine.optim_step("one", AdamParams(learning_rate=1e-2, grad_clip_norm=0.5))


def test_saved_state_resumes_exactly(toy_dir, tmp_path):
    first = _engine(toy_dir, one=CONFIGS["one"])
    metrics = _step(first, 4)
    assert metrics["grad_norm:mean"] > 0
    first.save_state("one", tmp_path / "state")
    _step(first, 5)
    assert first.steps_taken("one") == 2

    resumed = Engine.load(toy_dir / "model")
    resumed.load_state("one", tmp_path / "state")
    assert resumed.steps_taken("one") == 1  # the steps behind the saved weights count on
    _step(resumed, 5)
    assert resumed.steps_taken("one") == 2
    for x, y in zip(first.shared.parameters("one"), resumed.shared.parameters("one"), strict=True):
        assert torch.equal(x, y)
    # without the optimizer state the step differs (so the equality above is the moments' doing)
    fresh = Engine.load(toy_dir / "model")
    fresh.load_state("one", tmp_path / "state", optimizer=False)
    assert fresh.steps_taken("one") == 0
    _step(fresh, 5)
    assert any(not torch.equal(x, y) for x, y in zip(first.shared.parameters("one"), fresh.shared.parameters("one")))


def test_same_seed_same_adapter(toy_dir):
    one, two = Engine.load(toy_dir / "model"), Engine.load(toy_dir / "model")
    one.create("x", AdapterConfig(rank=4, seed=7))
    two.create("x", AdapterConfig(rank=4, seed=7))
    for x, y in zip(one.shared.parameters("x"), two.shared.parameters("x"), strict=True):
        assert torch.equal(x, y)
    with pytest.raises(ValueError, match="train_unembed"):
        one.create("y", AdapterConfig(rank=4, train_attn=False, train_mlp=False))


def test_tampered_state_is_refused(toy_dir, tmp_path):
    engine = _engine(toy_dir, one=CONFIGS["one"])
    _step(engine, 6)
    engine.save_state("one", tmp_path / "state")
    path = tmp_path / "state" / "adapter" / "adapter_model.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="adapter_model.safetensors"):
        Engine.load(toy_dir / "model").load_state("one", tmp_path / "state")
