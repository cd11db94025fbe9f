"""Rollouts of several jobs sampled together: worker/rollout/rollout.py's generate() for each job, one decode.

generate() turns a job's rows into token sequences, calls its sampler once
(a single-turn job), and turns the new tokens into a Rollout. Each job's
generate() runs twice here: first with a sampler that only records what it is
asked (sequences, budgets, streams), then, after one shared decode of every
job's requests (worker/multi/decode.py), with a sampler that hands back that
job's part. So each Rollout is built by the very code a job alone uses.
Single-turn only (support.py refuses environments: their reset and step calls
must not run twice).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from service.job_spec.sampling import SamplingSpec
from worker.multi.decode import JobRows, sample_jobs
from worker.multi.lora import SharedBase
from worker.rollout.rollout import Rollout, generate


@dataclass
class RolloutRequest:
    """One job's rollout of one cycle."""

    name: str  # its adapter on the shared base
    rows: list[dict]
    sampling: SamplingSpec
    group_size: int
    sampling_seeds: list[int] | None = None
    greedy: bool = False


class _Asked(Exception):
    def __init__(self, seqs, budgets, greedy, seeds):
        self.seqs, self.budgets, self.greedy, self.seeds = seqs, budgets, greedy, seeds


def _recorder(seqs, budgets, *, greedy, seeds=None):
    raise _Asked(seqs, budgets, greedy, seeds)


def generate_jobs(shared: SharedBase, tokenizer, device: torch.device,
                  requests: list[RolloutRequest]) -> list[Rollout | Exception]:
    """Each request's Rollout, in order, or the exception that job's rollout raised (one job's bad prompt or
    NaN logits never fails the others)."""
    policy = SimpleNamespace(tokenizer=tokenizer)  # generate() needs only the tokenizer when given a sampler
    # The sampler reports log-probs when it rounds: a base held below float32 under float32 adapters.
    logprobs = next(shared.base.parameters()).dtype != torch.float32
    asked: list[_Asked | Exception] = []
    for req in requests:
        try:
            generate(policy, req.rows, req.sampling, group_size=req.group_size, greedy=req.greedy,
                     sampler=_recorder, sampling_seeds=req.sampling_seeds)
            asked.append(RuntimeError("the rollout asked for no tokens"))
        except _Asked as a:
            asked.append(a)
        except Exception as e:  # this job's own problem (a prompt longer than its max_model_len)
            asked.append(e)
    live = [i for i, a in enumerate(asked) if isinstance(a, _Asked)]
    jobs = [JobRows(requests[i].name, asked[i].seqs, max(asked[i].budgets), requests[i].sampling,
                    greedy=asked[i].greedy, seeds=asked[i].seeds, logprobs=logprobs) for i in live]
    model = shared.model
    was_training = model.training
    model.eval()
    try:
        sampled = sample_jobs(model, shared.router, jobs, eos_id=tokenizer.eos_token_id,
                              pad_id=tokenizer.pad_token_id, device=device)
    finally:
        model.train(was_training)
    results: list[Rollout | Exception] = list(asked)
    for i, out in zip(live, sampled):
        if isinstance(out, Exception):
            results[i] = out
            continue
        req = requests[i]
        results[i] = generate(policy, req.rows, req.sampling, group_size=req.group_size, greedy=req.greedy,
                              sampler=lambda *_a, _out=out, **_k: _out, sampling_seeds=req.sampling_seeds)
    return results
