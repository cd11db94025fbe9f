"""The warning for a policy that moved too far in one step (worker/trainer/policy_jump.py)."""

from __future__ import annotations

from worker.trainer.policy_jump import KL_OLD_WARN, PolicyJumpWatch, policy_jump_message

LIMITS = {"lr": 1e-3, "ratio_max": 5.0, "mini_batches": 4, "update_epochs": 1}


def test_a_kl_old_spike_with_nothing_clipped_names_the_learning_rate_and_the_one_sided_cap():
    message = policy_jump_message({"kl_old": 22.1, "clip_fraction": 0.0}, **LIMITS)
    assert message.startswith("kl_old 22.1: the policy moved far")
    assert "clip fraction is 0" in message and "loss.ratio_max (5)" in message and "only from above" in message
    assert "optimizer.lr 0.001 is too high" in message and "4 mini_batches x 1 update_epochs" in message


def test_a_steady_or_clipped_step_says_only_what_applies():
    assert policy_jump_message({"kl_old": 1.8, "clip_fraction": 0.0}, **LIMITS) is None  # the toy's usual move
    assert policy_jump_message({"loss": 0.1}, **LIMITS) is None  # a supervised step has no kl_old
    clipped = policy_jump_message({"kl_old": KL_OLD_WARN * 2, "clip_fraction": 0.3},
                                  **{**LIMITS, "mini_batches": 1})
    assert "ratio_max" not in clipped and "mini_batches" not in clipped and "optimizer.lr" in clipped


def test_one_warning_per_spike():
    watch = PolicyJumpWatch(**LIMITS)
    said = [watch.update({"kl_old": kl, "clip_fraction": 0.0}) for kl in (0.0, 22.1, 111.5, 0.5, 30.0)]
    assert [m is not None for m in said] == [False, True, False, False, True]
    assert said[1].startswith("kl_old 22.1") and said[4].startswith("kl_old 30")
