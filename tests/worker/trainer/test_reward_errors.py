"""Reward failures in the trainer: the on_reward_errors callback, the error-rate stop, sub-reward metrics."""

from __future__ import annotations

import pytest

from service.job_spec.spec import JobSpec
from tests.specs import small_spec
from tests.worker.trainer.test_trainer import StopAt
from worker.rewards.errors import RewardErrorRateExceeded
from worker.trainer.loop import Trainer, train


class Recorder(StopAt):
    def __init__(self):
        super().__init__(10**9)
        self.metrics, self.reward_errors = [], []

    def on_step(self, step, metrics):
        super().on_step(step, metrics)
        self.metrics.append(metrics)

    def on_reward_errors(self, step, errors):
        self.reward_errors.append((step, list(errors)))


def always_fails(completion, **row):
    return 1 / 0


def fails_on_answer_a(completion, answer, **row):
    if answer == "a":
        raise ValueError("no reward for a")
    return float(completion.strip() == answer)


def test_a_step_whose_error_rate_passes_the_threshold_fails_the_run(toy_dir, tmp_path):
    spec = small_spec(toy_dir, steps=3)
    rec = Recorder()
    with pytest.raises(RewardErrorRateExceeded) as info:
        train(spec, tmp_path, reward_fn=always_fails, callbacks=rec)
    assert str(info.value) == ("reward function failed on 100% of samples at step 1 (threshold 50%; 16 of 16): "
                               "ZeroDivisionError: division by zero")
    assert rec.metrics == []  # no update was made with garbage rewards
    assert [(step, len(errors)) for step, errors in rec.reward_errors] == [(1, 16)]


def test_errors_below_the_threshold_are_reported_and_training_goes_on(toy_dir, tmp_path):
    rec = Recorder()
    result = train(small_spec(toy_dir, steps=3, reward_failure_score=-1.0), tmp_path, reward_fn=fails_on_answer_a,
                   callbacks=rec)
    assert result.steps_done == 3
    counts = [m["reward_errors"] for m in rec.metrics]
    assert sum(counts) > 0, "the toy data has answers 'a' in most batches"
    assert [len(e) for _, e in rec.reward_errors] == [c for c in counts if c]
    assert all(msg == "ValueError: no reward for a" for _, errors in rec.reward_errors for msg in errors)
    for m in rec.metrics:
        assert m["reward_error_fraction"] == m["reward_errors"] / 16
        assert m["reward_mean"] >= -1.0


def test_threshold_one_never_stops_and_zero_stops_at_the_first_error(toy_dir, tmp_path):
    rec = Recorder()
    result = train(small_spec(toy_dir, steps=1, reward_error_threshold=1.0), tmp_path / "one",
                   reward_fn=always_fails, callbacks=rec)
    assert result.steps_done == 1 and rec.metrics[0]["reward_errors"] == 16
    assert rec.metrics[0]["reward_mean"] == 0.0  # the default failure score
    with pytest.raises(RewardErrorRateExceeded, match=r"threshold 0%"):
        train(small_spec(toy_dir, steps=3, reward_error_threshold=0.0), tmp_path / "zero", reward_fn=fails_on_answer_a)


def test_multi_reward_parts_are_reported_as_metrics(toy_dir, tmp_path):
    raw = small_spec(toy_dir, steps=1).model_dump(mode="json")
    raw["reward"] = {"type": "multi", "formula": "0.8 * exact + 0.2 * short", "rewards": {
        "exact": {"type": "exact_match", "field": "answer"},
        "short": {"type": "length", "unit": "chars", "target": 1, "scale": 3},
    }}
    rec = Recorder()
    Trainer(JobSpec.model_validate(raw), tmp_path).run(rec)
    m = rec.metrics[0]
    assert 0.0 <= m["reward/exact_mean"] <= 1.0 and 0.0 <= m["reward/short_mean"] <= 1.0
    assert m["reward/exact_errors"] == 0.0 and m["reward/short_errors"] == 0.0
    assert m["reward_mean"] == pytest.approx(0.8 * m["reward/exact_mean"] + 0.2 * m["reward/short_mean"], abs=1e-6)
