"""The update plan both CISPO update paths run (worker/trainer/plan.py), checked without a model: which sequences
train, their per-token advantages, logp_old's source, and each optimizer step's sequences, normaliser and weights.
That the two paths then give the same numbers is tests/worker/multi/test_batched_update.py's."""

from __future__ import annotations

import pytest
import torch

from tests.specs import job_spec
from tests.worker.distributed.test_distributed import fixed_batch
from worker.toy.__main__ import toy_spec
from worker.trainer.plan import plan_update, rank_mini_batches


def _spec(toy_dir, *, loss=None, rollout=None, **training):
    return job_spec(toy_spec(toy_dir), lora=None, loss=loss or {}, rollout=rollout or {},
                    training={"steps": 1, "batch_size": 2, "group_size": 4, "mini_batches": 1, **training})


def test_the_plan_trains_the_kept_sequences_with_action_tokens_in_the_shuffled_steps(toy_dir):
    spec = _spec(toy_dir, mini_batches=2, update_epochs=2)
    rollout, advantages = fixed_batch()
    rollout.action_mask[3], rollout.action_turns[3] = [0] * len(rollout.action_mask[3]), []  # a failed reset
    kept = [0, 1, 2, 3, 5, 6]
    plan = plan_update(rollout, advantages, kept, step=4, spec=spec)
    assert plan.indices == [0, 1, 2, 5, 6]
    assert {i: v.tolist() for i, v in plan.token_adv.items()} == {
        i: [float(advantages[i])] * rollout.action_counts[i] for i in plan.indices}
    assert [s.sequences for s in plan.steps] == [cut for epoch in (0, 1)
                                                 for cut in rank_mini_batches(spec, plan.indices, 8, 4, epoch)]
    assert [s.normalizer for s in plan.steps] == [sum(rollout.action_counts[i] for i in s.sequences)
                                                  for s in plan.steps]
    assert plan.needs_old and not plan.needs_ref and plan.old is None and plan.sampler is None
    assert all(s.weight_of is None for s in plan.steps)


def test_prompt_normalisation_weights_each_sequence_by_its_prompt_s_tokens(toy_dir):
    spec = _spec(toy_dir, loss={"normalization": "prompt", "kl_beta": 0.1})
    rollout, advantages = fixed_batch()
    plan = plan_update(rollout, advantages, list(range(8)), step=0, spec=spec)
    (only,) = plan.steps
    per_prompt = [sum(rollout.action_counts[4 * p: 4 * p + 4]) for p in (0, 1)]
    assert only.normalizer == 2.0
    assert only.weight_of == pytest.approx({i: 1 / per_prompt[i // 4] for i in range(8)})
    assert plan.needs_ref and not plan.needs_old  # one step per rollout: logp_old is the pass's own


def test_asynchronous_rollouts_take_logp_old_from_the_sampler_and_drop_the_tis_factor(toy_dir):
    spec = _spec(toy_dir, update_epochs=2, rollout={"max_staleness": 1})
    rollout, advantages = fixed_batch()
    with pytest.raises(ValueError, match="needs the sampler's log-probs"):
        plan_update(rollout, advantages, list(range(8)), step=0, spec=spec)
    rollout.sampler_logprobs = [[-1.0 - i] * n for i, n in enumerate(rollout.action_counts)]
    plan = plan_update(rollout, advantages, list(range(8)), step=0, spec=spec)
    assert not plan.needs_old and plan.sampler is None
    assert {i: v.tolist() for i, v in plan.old.items()} == {i: rollout.sampler_logprobs[i] for i in range(8)}
    synchronous = plan_update(rollout, advantages, list(range(8)), step=0, spec=_spec(toy_dir, update_epochs=2))
    assert synchronous.needs_old and synchronous.old is None and synchronous.sampler is not None  # TIS


def test_nothing_to_train_is_no_plan(toy_dir):
    rollout, advantages = fixed_batch()
    rollout.action_mask[2], rollout.action_turns[2] = [0] * len(rollout.action_mask[2]), []
    assert plan_update(rollout, advantages, [2], step=0, spec=_spec(toy_dir)) is None
    assert plan_update(rollout, torch.zeros(8), [], step=0, spec=_spec(toy_dir)) is None
