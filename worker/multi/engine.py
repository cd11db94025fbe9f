"""A rollout engine for one resident job (its evaluations and pre-flight): the shared decode, its rows alone.

The trainer's own evaluation and pre-flight code (worker/trainer/loop.py) call engine.generate(policy, rows, ...);
this engine answers through worker/multi/rollout.py with the job's adapter (and, for a vLLM job, the shared vLLM
engine), so those run unchanged.

Evaluations due at the same cycle boundary are decoded together (`decode_evaluations`): one shared decode for
every due job's rows, as a cycle's rollouts are, instead of one decode per job. Each job's result waits in its
engine and answers the evaluation's own generate() call when that call asks for exactly the same thing; any
other call is decoded alone as before, so the trainer's evaluation code stays the only one.
"""

from __future__ import annotations

import logging

import torch

from service.job_spec.sampling import SamplingSpec
from worker.multi.lora import SharedBase
from worker.multi.rollout import RolloutRequest, generate_jobs
from worker.rollout.rollout import Rollout

log = logging.getLogger(__name__)


class JobEngine:
    """A prepared result answers only the call it was decoded for, and is dropped when the job's next step begins
    (its weights change then: `forget`)."""

    def __init__(self, shared: SharedBase, name: str, tokenizer, device: torch.device, *, kind: str = "hf"):
        self.shared, self.name, self.tokenizer, self.device = shared, name, tokenizer, device
        self.kind = kind  # the job's rollout.engine
        self.prepared: tuple[RolloutRequest, Rollout] | None = None  # decoded beside other jobs' (decode_evaluations)

    def generate(self, policy, rows: list[dict], sampling: SamplingSpec, *, group_size: int, greedy: bool = False,
                 environment=None, max_turns: int = 1, seeds=None, sampling_seeds=None) -> Rollout:
        if not greedy and sampling_seeds is None:  # as rollout.generate would draw them
            sampling_seeds = torch.randint(0, 2**62, (len(rows),)).tolist()
        request = RolloutRequest(self.name, rows, sampling, group_size, sampling_seeds=sampling_seeds, greedy=greedy,
                                 environment=environment, max_turns=max_turns, seeds=seeds, engine=self.kind)
        if self.prepared is not None and self.prepared[0] == request:  # used once, by the call it was decoded for
            prepared, self.prepared = self.prepared[1], None
            return prepared
        out = generate_jobs(self.shared, self.tokenizer, self.device, [request])[0]
        if isinstance(out, Exception):
            raise out
        return out

    def forget(self) -> None:
        self.prepared = None

    close = forget


def decode_evaluations(shared: SharedBase, tokenizer, device: torch.device, jobs: list) -> None:
    """Decode the next evaluation of every job in `jobs` (ResidentJobs) in one shared decode; each result waits in
    its job's engine for that evaluation. A single job is left to decode its own. Never raises: a job whose
    decode failed (or all of them, if the batch itself did) decodes alone in its own evaluation and meets its
    own error there, as it would alone."""
    jobs = [job for job in jobs if job.engine is not None]  # a supervised job without a reward samples nothing
    if len(jobs) < 2:
        return
    try:
        requests = [job.evaluation_request() for job in jobs]
        outs = generate_jobs(shared, tokenizer, device, requests)
    except Exception:  # noqa: BLE001 - each evaluation then decodes alone
        log.exception("decoding %d jobs' evaluations together failed", len(jobs))
        return
    for job, request, out in zip(jobs, requests, outs, strict=True):
        if not isinstance(out, Exception):
            job.engine.prepared = (request, out)
