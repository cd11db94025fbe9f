"""The eval harness: greedy completions on fixed rows, scored; one code path for in-job evals and eval runs.

In a job the step-0 eval is the baseline, run in this same harness as every later eval; each eval reports
its mean with a 95% interval and the paired difference to the baseline on the same rows
(worker/evals/intervals.py). The baseline's per-row rewards travel in the checkpoints, so a resumed job
compares with the same baseline. A supervised job also reports the token-mean cross-entropy of the
held-out conversations (`eval_loss`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from worker.evals.intervals import eval_metrics
from worker.trainer.feedback import collect_feedback
from worker.trainer.samples import prompt_text


@dataclass
class EvalRows:
    """Per evaluated row, in row order (gathered from every rank)."""

    rewards: list[float] = field(default_factory=list)
    prompts: list[str] = field(default_factory=list)
    completions: list[str] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def as_results(self) -> list[dict]:
        return [{"prompt": p, "completion": c, "reward": r}
                for p, c, r in zip(self.prompts, self.completions, self.rewards, strict=True)]


def eval_seeds(job_seed: int, rows: int) -> list[int]:
    """Each evaluated row's episode seed: the same episodes at every evaluation of a job."""
    return [(job_seed + i) % 2**31 for i in range(rows)]


def generate_and_score(engine, policy, scorer, rows: list[dict], sampling, *, failure_score: float,
                       episodes: dict, multi_turn: bool) -> dict[str, list]:
    """One rank's greedy rollout of `rows` (group size 1) and its scores, as lists to gather."""
    rollout = engine.generate(policy, rows, sampling, group_size=1, greedy=True, **episodes)
    feedback = collect_feedback(rollout, scorer, failure_score=failure_score)
    tokenizer = policy.tokenizer
    prompts, completions = [], []
    for i, ids in enumerate(rollout.token_ids):
        start = rollout.prompt_lengths[i]
        prompts.append(prompt_text(tokenizer, ids[:start]))
        completions.append(tokenizer.decode(ids[start:]) if multi_turn else rollout.completions[i])
    return {"rewards": feedback.rewards.tolist(), "errors": feedback.errors, "lengths": rollout.action_counts,
            "turns": rollout.turns, "prompts": prompts, "completions": completions}


def eval_rows_metrics(every: EvalRows, baseline: list[float] | None) -> dict[str, float]:
    n = len(every.rewards)
    return {
        "eval_reward_mean": sum(every.rewards) / n,
        **eval_metrics(every.rewards, baseline),
        "eval_reward_errors": float(len(every.errors)),
        "eval_completion_length": sum(every.lengths) / n,
        "eval_turns_mean": sum(every.turns) / n,
        "eval_rows": float(n),
    }
