"""The transformers engine: worker/rollout/rollout.py's generate() on the trainer's own model."""

from __future__ import annotations

import torch

from service.job_spec.sampling import SamplingSpec
from worker.envs.protocol import Environment
from worker.model.policy import Policy
from worker.rollout.rollout import Rollout, generate, TransformersSampler


class HFEngine:
    """Samples with the very weights being trained, so there is nothing to sync.

    The weights run in `dtype` (cast once per rollout when theirs differs). When the sampler runs on such
    rounded copies (`report_logprobs`) each token's sampling log-prob is reported, for the truncated IS
    correction; on the trained weights as they are, the sampler is the trainer and reports none (float32's
    large linears run oneDNN's packed kernel, which rounds differently from the trainer's sgemm by ~5e-6 in
    log-prob: harmless, see worker/rollout/packed_linears.py).
    """

    def __init__(self, dtype: torch.dtype | None = None, *, report_logprobs: bool = False):
        self.dtype, self.report_logprobs = dtype, report_logprobs

    def generate(self, policy: Policy, rows: list[dict], sampling: SamplingSpec, *, group_size: int,
                 greedy: bool = False, environment: Environment | None = None, max_turns: int = 1,
                 seeds: list[int] | None = None, sampling_seeds: list[int] | None = None) -> Rollout:
        sampler = TransformersSampler(policy, sampling, dtype=self.dtype, logprobs=self.report_logprobs)
        return generate(policy, rows, sampling, group_size=group_size, greedy=greedy, environment=environment,
                        max_turns=max_turns, seeds=seeds, sampling_seeds=sampling_seeds, sampler=sampler)

    def close(self) -> None:
        pass
