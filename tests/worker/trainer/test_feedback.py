"""The advantages a training step actually hands the update, under each advantages setting.

Checked end to end through Trainer.train_step on the toy model: a spec value
that was not passed on (scale, per_turn) would change what the update sees,
even though group_advantages itself is tested in tests/worker/cispo/test_advantages.py.
"""

from __future__ import annotations

import pytest
import torch

from worker.trainer import loop
from worker.trainer.loop import Trainer
from tests.specs import small_spec

GROUP = 4


def _varied_reward():
    """Rewards that differ within each group, with spreads far from 1, so scaling by the std shows (the tiny
    model's completions are too alike to score apart)."""
    calls = iter(range(10**6))
    return lambda completion, **row: float(next(calls) ** 2 % 11)


def _one_step(toy_dir, tmp_path, monkeypatch, **advantages) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(rewards_PG the step computed, the per-token advantages the update received)."""
    spec = small_spec(toy_dir, steps=1, batch_size=3, group_size=GROUP, mini_batches=1, micro_batch_size=12)
    spec = spec.model_copy(update={"advantages": spec.advantages.model_copy(update=advantages)})
    seen: dict = {}
    real_collect = loop.collect_feedback

    def collect(*args, **kwargs):
        seen["feedback"] = real_collect(*args, **kwargs)
        return seen["feedback"]

    monkeypatch.setattr(loop, "collect_feedback", collect)
    trainer = Trainer(spec, tmp_path, reward_fn=_varied_reward(), resume=False)
    real_run = trainer.updater.run

    def run(rollout, per_token, indices, **kwargs):
        seen["per_token"], seen["indices"] = per_token, indices
        return real_run(rollout, per_token, indices, **kwargs)

    trainer.updater.run = run
    try:
        trainer.train_step()
    finally:
        trainer.engine.close()
    assert sorted(seen["indices"]) == list(range(len(seen["per_token"])))  # every sequence is trained on
    return seen["feedback"].rewards.view(-1, GROUP).double(), seen["per_token"]


def _expected(rewards_PG: torch.Tensor, scale: str, eps: float = 1e-6) -> torch.Tensor:
    centred = rewards_PG - rewards_PG.mean(dim=1, keepdim=True)
    if scale == "group_std":
        centred = centred / (rewards_PG.std(dim=1, keepdim=True, unbiased=False) + eps)
    return centred.flatten()


@pytest.mark.parametrize("per_turn", [False, True])
@pytest.mark.parametrize("scale", ["none", "group_std"])
def test_the_update_gets_the_advantages_of_the_configured_scale(toy_dir, tmp_path, monkeypatch, scale, per_turn):
    rewards_PG, per_token = _one_step(toy_dir, tmp_path, monkeypatch, scale=scale, per_turn=per_turn)
    stds = rewards_PG.std(dim=1, unbiased=False)
    assert (stds > 0).all() and (stds - 1).abs().max() > 0.1, rewards_PG  # the scale makes a difference here
    expected = _expected(rewards_PG, scale)
    other = _expected(rewards_PG, {"none": "group_std", "group_std": "none"}[scale])
    for i, tokens in enumerate(per_token):
        assert len(tokens) > 0
        torch.testing.assert_close(tokens.double(), expected[i].expand(len(tokens)), atol=1e-5, rtol=1e-5)
    assert any((expected[i] - other[i]).abs() > 1e-3 for i in range(len(per_token)))


def test_the_update_gets_clipped_advantages(toy_dir, tmp_path, monkeypatch):
    rewards_PG, per_token = _one_step(toy_dir, tmp_path, monkeypatch, scale="group_std", clip=0.5)
    expected = _expected(rewards_PG, "group_std").clamp(-0.5, 0.5)
    assert (_expected(rewards_PG, "group_std").abs() > 0.5).any()  # the clip bites
    for i, tokens in enumerate(per_token):
        torch.testing.assert_close(tokens.double(), expected[i].expand(len(tokens)), atol=1e-5, rtol=1e-5)
