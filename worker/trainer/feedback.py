"""From a rollout to learning signal: episode rewards, then one advantage per action token.

Without an environment the reward function scores each final completion
(one turn, one reward). With one, an episode's turn rewards come from
env.step and its reward is their sum; an episode that an environment failure
ended gets the job's failure score instead (``reward_failure_score``: zero
for each turn, the failure score on the turn that failed), and the failure
is counted in ``reward_errors``.

Advantages are group-relative (worker/cispo). By default every action token
of an episode gets the episode's advantage; with ``advantages.per_turn``
the tokens of turn k get the advantage of the reward-to-go from turn k
(worker/cispo/turn_advantages.py has the exact definition).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from service.job_spec.objective import AdvantageSpec
from worker.cispo import group_advantages, rewards_to_go, turn_advantages
from worker.distributed import group
from worker.envs import Environment, make_environment
from worker.rewards.engine import ScoringContext
from worker.trainer.rewards import InProcessScorer, RewardFn, Scorer, Scores, make_scorer
from worker.rollout.rollout import Rollout


def feedback_source(spec, *, reward_fn: RewardFn | None = None, environment: Environment | None = None,
                    scoring: ScoringContext | None = None) -> tuple[Environment | None, Scorer | None]:
    """(environment, scorer) of a job, one of them set: a trusted in-process stand-in first (`reward_fn`,
    `environment`), then the spec's environment, else its reward (a supervised job may have none: its evals then
    report only eval_loss)."""
    if reward_fn is not None:
        return None, InProcessScorer.from_callable(reward_fn)
    if environment is not None:
        return environment, None
    if spec.environment is not None:
        return make_environment(spec.environment, egress=scoring.egress if scoring else None,
                                secrets=scoring.secrets if scoring else None), None
    return None, None if spec.reward is None else make_scorer(spec.reward, scoring)


@dataclass
class Feedback:
    turn_rewards: list[list[float]]  # per episode, per turn (one entry without an environment)
    errors: list[str] = field(default_factory=list)  # one message per failed sample or episode
    scores: Scores | None = None  # the reward function's scores, when the job has one (components, ...)

    @property
    def rewards(self) -> Tensor:
        """Episode rewards: the sum of the turn rewards."""
        return torch.tensor([sum(r) for r in self.turn_rewards], dtype=torch.float32)


def collect_feedback(rollout: Rollout, scorer: Scorer | None, *, failure_score: float) -> Feedback:
    if scorer is not None:
        scores = scorer.score(rollout.completions, rollout.rows, failure_score=failure_score)
        return Feedback([[float(r)] for r in scores.rewards.tolist()], list(scores.errors), scores)
    turn_rewards, errors = [], []
    for rewards, turns, error in zip(rollout.turn_rewards, rollout.turns, rollout.errors, strict=True):
        if error is not None:
            errors.append(error)
            rewards = [0.0] * max(turns - 1, 0) + [failure_score]
        turn_rewards.append(list(rewards) or [0.0])
    return Feedback(turn_rewards, errors)


@dataclass
class Advantages:
    per_token: list[Tensor]  # per sequence: one advantage per action token, in order
    episode_PG: Tensor  # episode-level advantages (metrics)
    zero_P: Tensor  # groups that carry no signal (every advantage is exactly zero)


def batch_reward_std(rewards: Tensor) -> float:
    """The population std of the whole step's rewards, every process's share included (ScaleRL's batch scale).
    A collective: every process calls it."""
    values = rewards.double()
    n = group.sum_all(float(values.numel()))
    mean = group.sum_all(float(values.sum())) / n
    return max(group.sum_all(float(((values - mean) ** 2).sum())) / n, 0.0) ** 0.5


def assign_advantages(rollout: Rollout, feedback: Feedback, spec: AdvantageSpec, group_size: int, *,
                      batch_std: float | None = None) -> Advantages:
    """`batch_std`: for scale 'batch_std', the whole step's reward std (batch_reward_std; default: this share's)."""
    episode_PG, zero_P = group_advantages(feedback.rewards.view(-1, group_size), scale=spec.scale, eps=spec.eps,
                                          clip=spec.clip, batch_std=batch_std)
    if spec.per_turn:
        per_turn = turn_advantages([rewards_to_go(r) for r in feedback.turn_rewards], group_size,
                                   scale=spec.scale, eps=spec.eps, clip=spec.clip)
        zero_P = torch.stack([
            torch.cat(per_turn[p * group_size:(p + 1) * group_size]).eq(0).all()
            for p in range(len(per_turn) // group_size)
        ])
        per_token = [per_turn[i][torch.tensor(rollout.action_turns[i], dtype=torch.long)]
                     for i in range(len(rollout))]
    else:  # every action token of a sequence carries its episode's advantage: one op, not two per sequence
        counts = [len(turns) for turns in rollout.action_turns]
        per_token = list(episode_PG.flatten().repeat_interleave(torch.tensor(counts)).split(counts))
    return Advantages(per_token=per_token, episode_PG=episode_PG, zero_P=zero_P)
