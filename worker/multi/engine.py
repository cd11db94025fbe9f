"""A rollout engine for one resident job (its evaluations and pre-flight): the shared decode, its rows alone.

The trainer's own evaluation and pre-flight code (worker/trainer/loop.py) call engine.generate(policy, rows, ...);
this engine answers through worker/multi/rollout.py with the job's adapter (and, for a vLLM job, the shared vLLM
engine), so those run unchanged.
"""

from __future__ import annotations

import torch

from service.job_spec.sampling import SamplingSpec
from worker.multi.lora import SharedBase
from worker.multi.rollout import RolloutRequest, generate_jobs
from worker.rollout.rollout import Rollout


class JobEngine:
    def __init__(self, shared: SharedBase, name: str, tokenizer, device: torch.device, *, kind: str = "hf"):
        self.shared, self.name, self.tokenizer, self.device = shared, name, tokenizer, device
        self.kind = kind  # the job's rollout.engine

    def generate(self, policy, rows: list[dict], sampling: SamplingSpec, *, group_size: int, greedy: bool = False,
                 environment=None, max_turns: int = 1, seeds=None, sampling_seeds=None) -> Rollout:
        if not greedy and sampling_seeds is None:  # as rollout.generate would draw them
            sampling_seeds = torch.randint(0, 2**62, (len(rows),)).tolist()
        out = generate_jobs(self.shared, self.tokenizer, self.device, [
            RolloutRequest(self.name, rows, sampling, group_size, sampling_seeds=sampling_seeds, greedy=greedy,
                           environment=environment, max_turns=max_turns, seeds=seeds, engine=self.kind)])[0]
        if isinstance(out, Exception):
            raise out
        return out

    def close(self) -> None:
        pass
