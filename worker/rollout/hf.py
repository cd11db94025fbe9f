"""The transformers engine: worker/trainer/rollout.py's generate() on the trainer's own model."""

from __future__ import annotations

from service.schemas.job_spec import SamplingSpec
from worker.envs.protocol import Environment
from worker.trainer.policy import Policy
from worker.trainer.rollout import Rollout, generate


class HFEngine:
    """Samples with the very weights being trained, so there is nothing to sync and no sampler log-probs."""

    def generate(self, policy: Policy, rows: list[dict], sampling: SamplingSpec, *, group_size: int,
                 greedy: bool = False, environment: Environment | None = None, max_turns: int = 1,
                 seeds: list[int] | None = None) -> Rollout:
        return generate(policy, rows, sampling, group_size=group_size, greedy=greedy, environment=environment,
                        max_turns=max_turns, seeds=seeds)

    def close(self) -> None:
        pass
