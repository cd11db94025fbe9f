"""Per-turn advantages (worker/cispo/turn_advantages.py) against hand-computed numbers."""

from __future__ import annotations

import pytest
import torch

from worker.cispo import group_advantages, rewards_to_go, turn_advantages


def test_rewards_to_go():
    assert rewards_to_go([1.0, 0.0, 2.0]) == [3.0, 2.0, 2.0]
    assert rewards_to_go([]) == [0.0]


def test_hand_computed_per_turn_advantages():
    """Episode 0 rewards [1, 0] -> R [1, 0]; episode 1 rewards [0, 1, 1] -> R [2, 2, 1].

    Turn 0: mean(1, 2) = 1.5 -> [-0.5, 0.5]; turn 1: mean(0, 2) = 1 -> [-1, 1];
    turn 2: only episode 1 reached it -> 0.
    """
    adv = turn_advantages([rewards_to_go([1, 0]), rewards_to_go([0, 1, 1])], group_size=2)
    assert [a.tolist() for a in adv] == [[-0.5, -1.0], [0.5, 1.0, 0.0]]


def test_groups_are_separate_and_equal_returns_give_zero():
    adv = turn_advantages([[1.0, 1.0], [1.0, 1.0], [3.0], [1.0]], group_size=2)
    assert [a.tolist() for a in adv] == [[0.0, 0.0], [0.0, 0.0], [1.0], [-1.0]]


@pytest.mark.parametrize("scale", ["none", "group_std"])
def test_turn_zero_is_the_episode_advantage(scale):
    """At turn 0 the reward-to-go is the episode reward, so per-turn equals group_advantages there."""
    g = torch.Generator().manual_seed(0)
    rewards = torch.randint(0, 3, (3, 4), generator=g).float()
    episode, _ = group_advantages(rewards, scale=scale, eps=1e-6, clip=0.8)
    per_turn = turn_advantages([[r] for r in rewards.flatten().tolist()], 4, scale=scale, eps=1e-6, clip=0.8)
    torch.testing.assert_close(torch.stack([a[0] for a in per_turn]), episode.flatten())


def test_refuses_ragged_groups_and_nan():
    with pytest.raises(ValueError, match="groups of 2"):
        turn_advantages([[1.0]] * 3, group_size=2)
    with pytest.raises(ValueError, match="finite"):
        turn_advantages([[float("nan")], [1.0]], group_size=2)


def _rollout(action_turns, turn_rewards, errors, turns):
    from worker.rollout.rollout import Rollout

    n = len(action_turns)
    return Rollout(rows=[{}] * n, token_ids=[[0] * (len(a) + 1) for a in action_turns],
                   action_mask=[[0] + [1] * len(a) for a in action_turns], action_turns=action_turns,
                   prompt_lengths=[1] * n, completions=[""] * n, truncated=[False] * n, turns=turns,
                   turn_rewards=turn_rewards, errors=errors)


def test_each_turns_tokens_get_that_turns_advantage():
    """R: episode 0 [1, 0], episode 1 [1, 1]. Turn 0 ties (0, 0); turn 1: [0, 1] - 0.5 = [-0.5, 0.5]."""
    from service.job_spec.objective import AdvantageSpec
    from worker.trainer.feedback import assign_advantages, collect_feedback

    rollout = _rollout([[0, 0, 1], [0, 1, 1, 1]], [[1.0, 0.0], [0.0, 1.0]], [None, None], [2, 2])
    feedback = collect_feedback(rollout, None, failure_score=-1.0)
    per_turn = assign_advantages(rollout, feedback, AdvantageSpec(per_turn=True), group_size=2)
    assert [a.tolist() for a in per_turn.per_token] == [[0.0, 0.0, -0.5], [0.0, 0.5, 0.5, 0.5]]
    assert per_turn.zero_P.tolist() == [False]
    episode = assign_advantages(rollout, feedback, AdvantageSpec(), group_size=2)
    assert [a.tolist() for a in episode.per_token] == [[0.0] * 3, [0.0] * 4] and episode.zero_P.tolist() == [True]


def test_a_failed_episode_gets_the_failure_score():
    """Failed at its second step: rewards [0, -1] (sum = the failure score); a failed reset: [-1], no tokens."""
    from worker.trainer.feedback import collect_feedback

    rollout = _rollout([[0, 1], [], [0]], [[0.5], [], [1.0]], ["step 2: boom", "reset: no", None], [2, 0, 1])
    feedback = collect_feedback(rollout, None, failure_score=-1.0)
    assert feedback.turn_rewards == [[0.0, -1.0], [-1.0], [1.0]]
    assert feedback.rewards.tolist() == [-1.0, -1.0, 1.0] and feedback.errors == ["step 2: boom", "reset: no"]


# -- edges found by mutation testing (bench/mutate.py) ---------------------------------------------------


def test_ragged_episodes_compare_each_turn_among_the_episodes_that_reached_it():
    # turn 0: 1, 0, 2 (mean 1); turn 1: only episodes 0 and 1 got there: 1, 3 (mean 2)
    out = turn_advantages([[1.0, 1.0], [0.0, 3.0], [2.0]], 3)
    assert [t.tolist() for t in out] == [[0.0, -1.0], [-1.0, 1.0], [1.0]]
    scaled = turn_advantages([[1.0, 1.0], [0.0, 3.0], [2.0]], 3, scale="group_std")
    std0 = (2 / 3) ** 0.5
    expected = [[0.0, -1.0 / (1 + 1e-6)], [-1 / (std0 + 1e-6), 1.0 / (1 + 1e-6)], [1 / (std0 + 1e-6)]]
    for got, want in zip(scaled, expected):
        torch.testing.assert_close(got, torch.tensor(want), atol=1e-7, rtol=0.0)


def test_a_group_of_equal_returns_is_exactly_zero_even_when_its_mean_rounds():
    # three 0.1s average to 0.10000000000000002: only the all-equal rule makes their advantages exactly 0
    out = turn_advantages([[0.1], [0.1], [0.1], [0.0], [1.0], [2.0]], 3)
    assert [t.tolist() for t in out[:3]] == [[0.0], [0.0], [0.0]]
    assert [t.item() for t in out[3:]] == [-1.0, 0.0, 1.0]


def test_turn_advantage_errors_say_what_is_wrong():
    with pytest.raises(ValueError, match="^every episode needs the reward-to-go of at least turn 0$"):
        turn_advantages([[1.0], []], 2)
    with pytest.raises(ValueError, match="^rewards must be finite$"):
        turn_advantages([[1.0], [float("nan")]], 2)
    with pytest.raises(ValueError, match="^unknown advantage scale 'rank'$"):
        turn_advantages([[1.0], [0.0]], 2, scale="rank")
