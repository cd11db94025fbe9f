"""The engine's sampler on the toy base: seeded draws repeat, greedy is the plain model's argmax, the sampler's
log-probs are forward_backward's, a sampler version is frozen, draws of several sources in one call equal each
drawn alone, and stop tokens, stop strings and max_tokens end sequences with their reasons."""

from __future__ import annotations

import pytest
import torch
from peft import get_peft_model, set_peft_model_state_dict

from worker.checkpoints.checkpoint import CheckpointError
from worker.engine.engine import Engine, lora_spec
from worker.engine.types import AdamParams, AdapterConfig, Datum, Draw, Pass, SampleParams
from worker.model.policy import lora_config

from tests.worker.engine.engines import engine_with
from tests.worker.multi.conftest import toy_base

TOL = 1e-4
CONFIGS = {"one": AdapterConfig(rank=4, seed=1), "two": AdapterConfig(rank=2, seed=2, train_mlp=False, alpha=8.0)}
PROMPT = [1, 31, 32, 42, 37, 41]  # "<s>12+7=" in the toy tokenizer (one token a character)
OTHER = [1, 33, 43, 34, 41]  # "<s>3-4="


@pytest.fixture
def engine(toy_dir) -> Engine:
    """Both adapters, B far from zero: each samples long sequences, unlike the base and unlike each other."""
    return engine_with(toy_dir, CONFIGS, b_std=1.0)


def _draw(source, prompt=PROMPT, n=1, **params) -> Draw:
    prompt_logprobs = params.pop("prompt_logprobs", False)
    return Draw(source, prompt, n, SampleParams(**{"max_tokens": 12, **params}), prompt_logprobs=prompt_logprobs)


def _tokens(result) -> list[list[int]]:
    return [s.tokens for s in result.sequences]


def _plain_model(toy_dir, engine: Engine, name: str | None):
    """The source as a model of its own: PEFT's plain model with the adapter's weights, or the bare base."""
    if name is None:
        return toy_base(toy_dir).eval()
    model = get_peft_model(toy_base(toy_dir), lora_config(lora_spec(engine.configs[name])))
    set_peft_model_state_dict(model, {k: v.clone() for k, v in engine.shared.adapter_state(name).items()})
    return model.eval()


def _greedy(model, prompt: list[int], max_tokens: int, eos: int) -> list[int]:
    """Argmax continuation by full forwards (no cache), up to and including EOS."""
    out: list[int] = []
    with torch.no_grad():
        while len(out) < max_tokens and (not out or out[-1] != eos):
            logits = model(input_ids=torch.tensor([prompt + out])).logits[0, -1]
            out.append(int(logits.argmax()))
    return out


def test_a_seed_repeats_and_each_sample_has_its_own_stream(engine):
    first, again, other = engine.sample([_draw("one", n=4, seed=7), _draw("one", n=4, seed=7),
                                         _draw("one", n=4, seed=8)])
    assert _tokens(first) == _tokens(again)
    assert _tokens(first) != _tokens(other)
    assert len({tuple(t) for t in _tokens(first)}) > 1  # the samples of one draw differ
    (alone,) = engine.sample([_draw("one", n=4, seed=7)])  # whatever else shares the decode
    assert _tokens(alone) == _tokens(first)


@pytest.mark.parametrize("source", ["one", "two", None])
def test_greedy_is_the_plain_models_argmax(toy_dir, engine, source):
    for prompt in (PROMPT, OTHER):
        (result,) = engine.sample([_draw(source, prompt, n=2, temperature=0.0, max_tokens=10)])
        want = _greedy(_plain_model(toy_dir, engine, source), prompt, 10, engine.eos_ids[0])
        assert _tokens(result) == [want, want]


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_sampler_logprobs_are_forward_backwards(engine, temperature):
    """At temperature 1 (and greedy, recorded at 1) the sampler's log-prob of each new token is what
    forward_backward scores for it: the datum prompt + completion, the targets shifted by one."""
    (result,) = engine.sample([_draw("one", n=3, seed=3, temperature=temperature)])
    for seq in result.sequences:
        tokens = PROMPT + seq.tokens
        datum = Datum(tokens[:-1], {"target_tokens": torch.tensor(tokens[1:])})
        (scored,) = engine.forward_backward([Pass("one", [datum], "cross_entropy", forward_only=True)])
        trained = scored.logprobs[0][len(PROMPT) - 1 :]
        assert torch.allclose(torch.tensor(seq.logprobs), trained, atol=TOL)


def test_logprobs_at_another_temperature_are_the_tempered_policys(toy_dir, engine):
    (result,) = engine.sample([_draw("two", n=2, seed=4, temperature=0.6)])
    model = _plain_model(toy_dir, engine, "two")
    for seq in result.sequences:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([PROMPT + seq.tokens])).logits[0, len(PROMPT) - 1 : -1]
        want = torch.log_softmax(logits / 0.6, -1).gather(-1, torch.tensor(seq.tokens)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(seq.logprobs), want, atol=TOL)


@pytest.mark.parametrize("source", ["one", None])
def test_prompt_logprobs_are_the_models_log_softmax(toy_dir, engine, source):
    """Tinker's compute_logprobs: a draw of max_tokens 1 with prompt_logprobs, beside a longer prompt's draw."""
    results = engine.sample([_draw(source, OTHER, max_tokens=1, prompt_logprobs=True),
                             _draw(source, PROMPT, n=2, seed=1, prompt_logprobs=True), _draw("two", PROMPT)])
    model = _plain_model(toy_dir, engine, source)
    for prompt, result in zip((OTHER, PROMPT), results):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt])).logits[0, :-1]
        want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0]
        assert result.prompt_logprobs[0] is None and len(result.prompt_logprobs) == len(prompt)
        assert torch.allclose(torch.tensor(result.prompt_logprobs[1:]), want, atol=TOL)
    assert results[2].prompt_logprobs is None
    (unscored,) = engine.sample([_draw(source, PROMPT, n=2, seed=1)])  # scoring the prompt changes no token
    assert _tokens(unscored) == _tokens(results[1])
    (single,) = engine.sample([_draw(source, [1], max_tokens=1, prompt_logprobs=True)])
    assert single.prompt_logprobs == [None]


def _train(engine: Engine, name: str) -> None:
    datum = Datum(PROMPT[:-1], {"target_tokens": torch.tensor(PROMPT[1:])})
    engine.forward_backward([Pass(name, [datum], "cross_entropy")])
    engine.optim_step(name, AdamParams(learning_rate=0.5))


def test_a_sampler_version_is_frozen(engine):
    draws = lambda source: [_draw(source, n=2, temperature=0.0), _draw(source, OTHER, n=3, seed=2)]  # noqa: E731
    before = [_tokens(r) for r in engine.sample(draws("one"))]
    engine.save_for_sampler("one", "one@1")
    with pytest.raises(ValueError, match="exists"):
        engine.save_for_sampler("two", "one@1")
    with pytest.raises(ValueError, match="exists"):  # adapters and versions are one namespace: draws' sources
        engine.create("one@1", CONFIGS["one"])
    assert all(not p.requires_grad for p in engine.shared.parameters(engine.samplers["one@1"]))
    _train(engine, "one")
    _train(engine, "one")
    assert [_tokens(r) for r in engine.sample(draws("one@1"))] == before
    assert [_tokens(r) for r in engine.sample(draws("one"))] != before  # the live adapter did change
    engine.create("three", AdapterConfig(rank=4, seed=3))  # a later join leaves the version frozen
    assert all(not p.requires_grad for p in engine.shared.parameters(engine.samplers["one@1"]))
    engine.drop("one")  # the version outlives its source
    assert [_tokens(r) for r in engine.sample(draws("one@1"))] == before
    engine.drop_sampler("one@1")
    with pytest.raises(KeyError, match="one@1"):
        engine.sample(draws("one@1"))


def test_a_saved_state_loads_as_a_sampler_version(toy_dir, engine, tmp_path):
    engine.save_state("two", tmp_path / "state")
    engine.save_for_sampler("two", "v")
    draws = [_draw("v", n=3, seed=5), _draw("v", OTHER, temperature=0.0)]
    want = [_tokens(r) for r in engine.sample(draws)]
    fresh = Engine.load(toy_dir / "model")
    fresh.load_sampler("v", tmp_path / "state")
    assert [_tokens(r) for r in fresh.sample(draws)] == want
    assert all(not p.requires_grad for p in fresh.shared.parameters(fresh.samplers["v"]))
    path = tmp_path / "state" / "adapter" / "adapter_model.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="adapter_model.safetensors"):
        fresh.load_sampler("w", tmp_path / "state")
    assert "w" not in fresh.samplers


def test_draws_of_several_sources_in_one_call_equal_each_alone(engine):
    engine.save_for_sampler("two", "two@0")
    _train(engine, "two")
    draws = [_draw("one", n=2, temperature=0.0), _draw(None, OTHER, n=2, seed=1), _draw("two@0", n=2, seed=2),
             _draw("two", OTHER, n=3, seed=3, top_k=5), _draw("one", OTHER, n=2, seed=4, top_p=0.8),
             _draw(None, PROMPT, temperature=0.0, max_tokens=4)]
    together = engine.sample(draws)
    for draw, result in zip(draws, together):
        (alone,) = engine.sample([draw])
        assert _tokens(result) == _tokens(alone)
        for got, want in zip(result.sequences, alone.sequences):
            assert got.logprobs == pytest.approx(want.logprobs, abs=2e-5)
            assert got.stop_reason == want.stop_reason
    assert len({tuple(map(tuple, _tokens(r))) for r in together}) == len(draws)


def test_stop_tokens_strings_and_max_tokens_end_sequences(engine):
    (full,) = engine.sample([_draw("one", temperature=0.0, max_tokens=16)])
    tokens = full.sequences[0].tokens
    assert full.sequences[0].stop_reason == "length" and len(tokens) == 16 and engine.eos_ids[0] not in tokens
    tok = engine.tokenizer
    stop_id = tokens[5]
    at = tokens.index(stop_id) + 1
    text = tok.decode(tokens[6:8])  # a string of two tokens: the sequence keeps the one completing it
    upto = next(n for n in range(1, 17) if text in tok.decode(tokens[:n]))
    by_id, by_text, both, short = engine.sample([
        _draw("one", temperature=0.0, max_tokens=16, stop=(stop_id,)),
        _draw("one", temperature=0.0, max_tokens=16, stop=(text,)),
        _draw("one", temperature=0.0, max_tokens=16, stop=(text, stop_id)),
        _draw("one", temperature=0.0, max_tokens=3)])
    assert by_id.sequences[0].tokens == tokens[:at] and by_id.sequences[0].stop_reason == "stop"
    assert by_text.sequences[0].tokens == tokens[:upto] and by_text.sequences[0].stop_reason == "stop"
    assert both.sequences[0].tokens == tokens[: min(at, upto)]
    assert short.sequences[0].tokens == tokens[:3] and short.sequences[0].stop_reason == "length"
    assert by_id.sequences[0].logprobs == pytest.approx(full.sequences[0].logprobs[:at], abs=2e-5)
    # EOS ends a sequence with "stop", and is kept
    (base,) = engine.sample([_draw(None, temperature=0.0)])
    assert base.sequences[0].tokens[-1] == engine.eos_ids[0] and base.sequences[0].stop_reason == "stop"


def test_non_finite_logits_or_weights_fail_their_draw_only(engine):
    """Weights that overflow (finite, giving inf logits) fail their rows in the decode; NaN weights are kept out
    of it (in a grouped forward they would reach every row)."""
    engine.create("overflows", AdapterConfig(rank=2, seed=8))
    engine.create("diverged", AdapterConfig(rank=2, seed=9))
    with torch.no_grad():
        for p in engine.shared.parameters("overflows"):
            p.fill_(1e30)
        for p in engine.shared.parameters("diverged"):
            p.fill_(float("nan"))
    (want,) = engine.sample([_draw("one", n=2, seed=1)])
    ok, overflowed, nan, base = engine.sample([_draw("one", n=2, seed=1), _draw("overflows", n=2, seed=1),
                                               _draw("diverged", seed=1), _draw(None, temperature=0.0)])
    assert ok.error is None and _tokens(ok) == _tokens(want) and base.error is None and base.sequences
    assert overflowed.sequences == [] and overflowed.error.startswith("draw 1: ")
    assert "NaN or inf logits" in overflowed.error
    assert nan.sequences == [] and nan.error.startswith("draw 2: ") and "'diverged' hold NaN or inf" in nan.error


def test_draws_that_cannot_be_served_are_refused_before_decoding(toy_dir, engine):
    with pytest.raises(KeyError, match="draw 1: no adapter or sampler version 'nope'"):
        engine.sample([_draw("one"), _draw("nope")])
    with pytest.raises(ValueError, match="draw 0: temperature"):
        engine.sample([_draw("one", temperature=-1.0)])
    with pytest.raises(ValueError, match="draw 0: num_samples"):
        engine.sample([_draw("one", max_tokens=0)])
    no_tokenizer = Engine(toy_base(toy_dir))
    with pytest.raises(ValueError, match="stop strings need"):
        no_tokenizer.sample([_draw(None, stop=("ab",))])
    assert no_tokenizer.sample([_draw(None, stop=(5,), temperature=0.0)])[0].sequences  # ids need no tokenizer
