"""The transformers engine: worker/trainer/rollout.py's generate() on the trainer's own model."""

from __future__ import annotations

import torch

from service.schemas.job_spec import SamplingSpec
from worker.envs.protocol import Environment
from worker.trainer.policy import Policy
from worker.trainer.rollout import Rollout, generate, transformers_sampler


class HFEngine:
    """Samples with the very weights being trained, so there is nothing to sync.

    In the trainer's own precision the sampler is the trainer and reports no log-probs. With a lower
    `dtype` (rollout.dtype) the weights are cast once per rollout and each token's sampling log-prob is
    reported, for the truncated IS correction.
    """

    def __init__(self, dtype: torch.dtype | None = None):
        self.dtype = dtype

    def generate(self, policy: Policy, rows: list[dict], sampling: SamplingSpec, *, group_size: int,
                 greedy: bool = False, environment: Environment | None = None, max_turns: int = 1,
                 seeds: list[int] | None = None) -> Rollout:
        sampler = transformers_sampler(policy, sampling, dtype=self.dtype, logprobs=self.dtype is not None)
        return generate(policy, rows, sampling, group_size=group_size, greedy=greedy, environment=environment,
                        max_turns=max_turns, seeds=seeds, sampler=sampler)

    def close(self) -> None:
        pass
