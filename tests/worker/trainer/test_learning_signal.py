"""No silent failures: the pre-flight before step 1, the zero-variance watch, fail_on_no_signal, the reward trend.

A real trainer on the toy model; the reward that never tells completions apart is a constant 0.
"""

from __future__ import annotations

import pytest
import torch

from tests.specs import small_spec
from tests.worker.trainer.test_trainer import StopAt, adapter_tensors
from worker.jobs.progress import reward_trend
from worker.toy.task import reward as toy_reward
from worker.trainer.learning_signal import NoLearningSignal, ZeroVarianceWatch
from worker.trainer.loop import train


def always_zero(completion, **row):
    return 0.0


class SignalRecorder(StopAt):
    def __init__(self):
        super().__init__(10**9)
        self.preflight, self.no_signal, self.metrics = [], [], []

    def on_step(self, step, metrics):
        super().on_step(step, metrics)
        self.metrics.append(metrics)

    def on_preflight(self, metrics):
        self.preflight.append(metrics)

    def on_no_signal(self, step, steps):
        self.no_signal.append((step, steps))


def test_a_constant_reward_is_reported_before_step_1_and_warned_after_n_steps(toy_dir, tmp_path):
    rec = SignalRecorder()
    result = train(small_spec(toy_dir, steps=3, no_signal_steps=2, checkpoint_interval=0, preflight_groups=3),
                   tmp_path, reward_fn=always_zero, callbacks=rec)
    assert result.steps_done == 3  # only a warning: the user did not ask to fail
    [pre] = rec.preflight
    assert pre["preflight_groups"] == 3 and pre["preflight_reward_mean"] == 0.0
    assert pre["preflight_zero_variance_fraction"] == 1.0
    assert [m["zero_advantage_group_fraction"] for m in rec.metrics] == [1.0, 1.0, 1.0]
    assert rec.no_signal == [(2, 2)]  # once per streak, when it reaches no_signal_steps


def test_fail_on_no_signal_stops_before_step_1(toy_dir, tmp_path):
    rec = SignalRecorder()
    with pytest.raises(NoLearningSignal, match="all 2 pre-flight groups got one reward"):
        train(small_spec(toy_dir, steps=3, fail_on_no_signal=True), tmp_path, reward_fn=always_zero, callbacks=rec)
    assert rec.preflight and rec.steps == []  # not one training step was spent


def test_fail_on_no_signal_during_training_when_the_preflight_is_off(toy_dir, tmp_path):
    rec = SignalRecorder()
    with pytest.raises(NoLearningSignal, match="each of the last 2 steps"):
        train(small_spec(toy_dir, steps=4, preflight_groups=0, no_signal_steps=2, fail_on_no_signal=True),
              tmp_path, reward_fn=always_zero, callbacks=rec)
    assert rec.preflight == [] and rec.steps == [1, 2]


def test_the_preflight_leaves_the_training_run_unchanged(toy_dir, tmp_path):
    """Its prompts come from their own generator and its samples from a forked RNG: same metrics, same adapter."""
    runs = {}
    for groups in (0, 2):
        rec = SignalRecorder()
        result = train(small_spec(toy_dir, steps=2, preflight_groups=groups, checkpoint_interval=0),
                       tmp_path / str(groups), reward_fn=toy_reward, callbacks=rec)
        runs[groups] = (rec, adapter_tensors(result.last_checkpoint))
    (off, off_adapter), (on, on_adapter) = runs[0], runs[2]
    assert off.preflight == [] and len(on.preflight) == 1
    assert on.preflight[0]["preflight_zero_variance_fraction"] < 1.0  # the toy reward does tell completions apart
    keys = ("reward_mean", "loss", "completion_length_mean")
    assert [[m[k] for k in keys] for m in on.metrics] == [[m[k] for k in keys] for m in off.metrics]
    for name, tensor in off_adapter.items():
        assert torch.equal(tensor, on_adapter[name]), name


def test_the_zero_variance_watch_counts_consecutive_steps_only():
    watch = ZeroVarianceWatch(2)
    assert [watch.update(f) for f in (1.0, 0.5, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0)] == [
        False, False, False, True, False, False, False, True]


def test_reward_trend_against_hand_computed_values():
    # 4 steps, first and last one step each; 16 samples per step.
    # first: mean 0.1, std 0.3 -> var 0.09; last: mean 0.5, std 0.5 -> var 0.25.
    # se = sqrt(0.09/16 + 0.25/16) = sqrt(0.34)/4 = 0.14577; 2 se = 0.29155 < 0.4: moved.
    moved, text = reward_trend([(0.1, 0.3), (0.2, 0.4), (0.3, 0.4), (0.5, 0.5)], 16)
    assert moved is True
    assert text == ("reward moved beyond noise: 0.1000 over the first 1 step(s), 0.5000 over the last 1 "
                    "(+0.4000; 2 standard errors = 0.2915)")
    # the same means with 4 samples per step: 2 se = 0.5831 > 0.4: noise.
    assert reward_trend([(0.1, 0.3), (0.2, 0.4), (0.3, 0.4), (0.5, 0.5)], 4)[0] is False
    # pooled windows: 8 steps -> 2 per window; first (0, 0), (0.2, 0) pool to mean 0.1, var 0.01.
    moved, text = reward_trend([(0.0, 0.0), (0.2, 0.0)] + [(0.3, 0.1)] * 4 + [(0.3, 0.0), (0.3, 0.0)], 8)
    assert moved is True and "0.1000 over the first 2 step(s), 0.3000 over the last 2" in text
    assert reward_trend([(0.0, 0.0)] * 5, 16)[0] is False  # a constant reward never moved
    assert reward_trend([(0.4, 0.2)], 16)[0] is None


def test_cispo_train_prints_the_preflight_and_fails_on_no_signal(toy_dir, tmp_path):
    """`cispo train` as a user runs it: what it is doing before step 1, then a clear failure, not a traceback."""
    import os
    import subprocess
    import sys

    import yaml

    raw = small_spec(toy_dir, steps=2, fail_on_no_signal=True).model_dump(mode="json")
    raw["reward"] = {"type": "import", "path": "tests.worker.trainer.test_learning_signal:always_zero"}
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(raw))
    done = subprocess.run([sys.executable, "-m", "worker.cli", "train", str(spec)], capture_output=True, text=True,
                          timeout=600, cwd=os.getcwd())
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert f"Loading the model {toy_dir / 'model'} ..." in done.stderr
    assert "Starting the rollout engine (hf) ..." in done.stderr
    assert "Pre-flight: 2 groups sampled from the starting policy; baseline reward 0.0000" in done.stdout
    assert "error: no learning signal: all 2 pre-flight groups got one reward" in done.stderr
    assert not (tmp_path / "job" / "checkpoints").exists() or not any((tmp_path / "job" / "checkpoints").iterdir())
