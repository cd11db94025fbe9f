"""The decode loop's GPU paths, checked on CPU: refusing NaN logits, the compile fallback per shape (reported,
retried), one static cache per shape, freeing the kept rollout state, and compiled == eager (aot_eager)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.worker.rollout.test_decode import CPU, EOS, PAD, prompts, spec, static_greedy
from worker.rollout import decode, static_decode
from worker.rollout.effective_weights import rollout_weights
from worker.rollout.rollout_state import release_rollout_state, rollout_state_bytes
from worker.rollout.token_picking import NonFiniteLogits


@pytest.fixture
def plain_model(toy_dir):
    return AutoModelForCausalLM.from_pretrained(toy_dir / "model", dtype=torch.float32).eval()


def _sample(model, rows, *, greedy=True, compiled=False, max_new=8):
    return decode.sample_tokens(model, rows, max_new=max_new, sampling=spec(), greedy=greedy, eos_id=EOS,
                                pad_id=PAD, device=CPU, compiled=compiled)[0]


@pytest.mark.parametrize("compiled", [False, True])
def test_nan_logits_fail_the_rollout_instead_of_sampling_the_last_token(plain_model, monkeypatch, compiled):
    """An overflowed (here: poisoned) LM head row makes every softmax NaN; the old loop then sampled the last
    vocabulary id for every row, silently."""
    # the static loop, uncompiled
    monkeypatch.setattr(static_decode, "compiled_step", lambda model: static_decode.decode_step)
    with torch.no_grad():
        plain_model.lm_head.weight[5] = float("nan")
    with pytest.raises(NonFiniteLogits, match="NaN or inf logits"):
        _sample(plain_model, prompts(3), greedy=False, compiled=compiled)


def test_a_failed_compile_falls_back_for_that_shape_only_is_reported_and_retried(plain_model, monkeypatch):
    rows, few = prompts(6), prompts(2)
    expected, expected_few = _sample(plain_model, rows), _sample(plain_model, few)
    static_decode.take_compile_fallbacks()
    calls = []

    def flaky(model):  # compiling the 6-row shape (bucket 8) fails; any other shape works
        def step(model, token_B1, *args):
            calls.append(token_B1.shape[0])
            if token_B1.shape[0] == 8:
                raise RuntimeError("inductor: no C compiler")
            return static_decode.decode_step(model, token_B1, *args)
        return step

    monkeypatch.setattr(static_decode, "compiled_step", flaky)
    assert _sample(plain_model, rows, compiled=True) == expected  # decoded eagerly instead
    reported = static_decode.take_compile_fallbacks()
    assert len(reported) == 1 and "batch bucket 8" in reported[0] and "compiled again next time" in reported[0]
    assert _sample(plain_model, few, compiled=True) == expected_few and 2 in calls  # other shapes still compile
    assert static_decode.take_compile_fallbacks() == []
    for _ in range(static_decode.MAX_COMPILE_TRIES - 1):  # retried: the same shape tries compiling again
        calls.clear()
        assert _sample(plain_model, rows, compiled=True) == expected and calls == [8]
    assert "eagerly from now on" in static_decode.take_compile_fallbacks()[-1]
    calls.clear()
    assert _sample(plain_model, rows, compiled=True) == expected and calls == []  # given up for this shape only


def test_static_caches_are_kept_per_shape(plain_model):
    """A training batch, an eval batch, the training batch again: its cache (and its addresses) comes back."""
    rows, few = prompts(6), prompts(2)
    static_greedy(plain_model, rows, 6)
    first = static_decode.static_caches[plain_model][(8, static_decode.CACHE_BUCKET)]
    static_greedy(plain_model, few, 6)
    assert static_greedy(plain_model, rows, 6) == static_greedy(plain_model, rows, 6)
    assert static_decode.static_caches[plain_model][(8, static_decode.CACHE_BUCKET)] is first
    bucket = static_decode.CACHE_BUCKET
    assert list(static_decode.static_caches[plain_model]) == [(2, bucket), (8, bucket)]
    for b in (1, 3, 9, 17):  # buckets 1, 4, 16, 24: the least recently used beyond the limit are dropped
        static_greedy(plain_model, prompts(b), 2)
    assert len(static_decode.static_caches[plain_model]) == static_decode.STATIC_CACHES_KEPT


def test_batches_are_padded_to_a_bucket_sharing_its_cache_and_graph(plain_model, monkeypatch):
    """Batches of 5, 6 and 7 rows (an eval batch, a later turn's survivors) run the 8-row cache and step, and each
    row still gets the eager loop's tokens (the padding rows' are never returned)."""
    steps = []

    def recording(model):
        def step(model, token_B1, *args):
            steps.append(token_B1.shape[0])
            return static_decode.decode_step(model, token_B1, *args)
        return step

    monkeypatch.setattr(static_decode, "compiled_step", recording)
    static_decode.static_caches.pop(plain_model, None)
    for b in (5, 6, 7):
        rows = prompts(b)
        assert _sample(plain_model, rows, compiled=True) == _sample(plain_model, rows)
    assert set(steps) == {8}
    assert list(static_decode.static_caches[plain_model]) == [(8, static_decode.CACHE_BUCKET)]
    assert [static_decode.batch_bucket(b) for b in (1, 2, 3, 5, 8, 9, 13, 64)] == [1, 2, 4, 8, 8, 16, 16, 64]


def test_kept_rollout_state_is_freed_above_the_threshold(plain_model):
    rows = prompts(4)
    with rollout_weights(plain_model, torch.bfloat16) as generator:  # kept bf16 weight copies
        expected = static_greedy(generator, rows, 6)
    held = rollout_state_bytes(plain_model)
    weights = sum(p.numel() * 2 for p in plain_model.parameters())
    assert held > weights  # every weight's bf16 copy and the static cache
    assert not release_rollout_state(plain_model, above_bytes=held)  # small enough: kept
    assert not release_rollout_state(plain_model)  # on a CPU nothing is freed by default
    assert release_rollout_state(plain_model, above_bytes=held - 1)
    assert rollout_state_bytes(plain_model) == 0
    with rollout_weights(plain_model, torch.bfloat16) as generator:  # rebuilt as needed, same tokens
        assert static_greedy(generator, rows, 6) == expected


@pytest.mark.slow
def test_compiled_decode_step_gives_the_eager_tokens(lora_model, monkeypatch):
    """The compiled (static cache, fullgraph) step, here with the aot_eager backend (no CUDA graphs, no C
    compiler), gives the eager loop's greedy tokens, plain and with a LoRA folded in."""
    torch._dynamo.reset()
    compiled = torch.compile(static_decode.decode_step, backend="aot_eager", fullgraph=True)
    monkeypatch.setattr(static_decode, "compiled_step", lambda model: compiled)
    static_decode.take_compile_fallbacks()
    rows = prompts(4)
    with rollout_weights(lora_model) as merged:
        eager = _sample(merged, rows, max_new=6)
        assert _sample(merged, rows, max_new=6, compiled=True) == eager
    with lora_model.disable_adapter():
        base = lora_model.get_base_model()
        assert _sample(base, rows, max_new=6, compiled=True) == _sample(base, rows, max_new=6)
    assert static_decode.take_compile_fallbacks() == []  # it really ran compiled


def test_the_trainer_reports_a_compile_fallback_as_a_metric_and_a_warning(toy_dir, tmp_path, monkeypatch):
    """A step whose compiled decode failed says so: decode_compile_fallbacks counts it and on_warning gets the
    message (the job runner makes it a warn event); the next step, compiled fine, reports 0."""
    from tests.specs import small_spec
    from tests.worker.trainer.test_trainer import StopAt
    from worker.rollout import rollout
    from worker.trainer.loop import train

    failures = iter([True])

    def sometimes_failing(model):
        def step(*args):
            if next(failures, False):
                raise RuntimeError("cudagraph pool exhausted")
            return static_decode.decode_step(*args)
        return step

    real = rollout.sample_tokens
    monkeypatch.setattr(rollout, "sample_tokens", lambda *a, **k: real(*a, **{**k, "compiled": True}))
    monkeypatch.setattr(static_decode, "compiled_step", sometimes_failing)
    static_decode.take_compile_fallbacks()
    metrics, warnings = [], []

    class Collect(StopAt):
        def on_step(self, step, m):
            super().on_step(step, m)
            metrics.append(m["decode_compile_fallbacks"])

        def on_warning(self, step, message):
            warnings.append((step, message))

    train(small_spec(toy_dir, steps=2, checkpoint_interval=0), tmp_path, callbacks=Collect(99))
    assert metrics == [1.0, 0.0]
    assert len(warnings) == 1 and warnings[0][0] == 1 and "cudagraph pool exhausted" in warnings[0][1]


def test_the_eager_loop_can_drop_finished_rows_every_few_steps(lora_model):
    """On CUDA the eager loop asks whether rows finished (a sync) every few steps, not every step: same tokens,
    and the batch shrinks only at those steps."""
    from tests.worker.trainer.conftest import forward_shapes

    rows = prompts()

    def run(check_every):
        with forward_shapes(lora_model) as shapes:
            (tokens, _), = decode.sample_jobs(merged, None, [decode.JobRows(None, rows, 40, spec(), greedy=True)],
                                              eos_id=EOS, pad_id=PAD, device=CPU, check_every=check_every)
        return tokens, [b for b, _ in shapes[1:]]

    with rollout_weights(lora_model) as merged:
        every_step, sizes_1 = run(1)
        every_4, sizes_4 = run(4)
    assert every_4 == every_step
    assert any(r[-1] == EOS for r in every_step) and len(set(sizes_1)) > 1  # rows did finish at various steps
    changes = [t for t in range(1, len(sizes_4)) if sizes_4[t] != sizes_4[t - 1]]
    assert changes and all((t + 1) % 4 == 0 for t in changes), sizes_4  # forward t follows step t's check
    assert len(sizes_4) >= len(sizes_1)  # finished rows rode along a little longer
