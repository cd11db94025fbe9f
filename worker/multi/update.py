"""The update phase of one cycle: every resident job's CISPO optimizer steps, their micro-batches batched.

Each job's optimizer steps are worker/trainer/plan.py's plan, the one its
job alone runs (the same kept sequences, mini-batch shuffle from its seed,
step and epoch, normalisers and logp_old), cut into the same micro-batches
of similar lengths. Round r holds every job's r-th optimizer
step; the k-th micro-batches of the round's jobs run as ONE forward and ONE
backward over the shared base, rows sorted by job (worker/multi/lora.py).

Why the sum is exact: the loss of the combined micro-batch is
sum_j loss_j, each job's CISPO loss over its own rows, normalised by its
own optimizer step's token count (or sequence/prompt count). Job j's adapter
touches only job j's rows, so d(sum_i loss_i)/d(adapter_j) = d(loss_j)/d(adapter_j):
the gradient job j's steps alone would accumulate. Per-token log-probs use
each job's own temperature, LM-head chunking and loss knobs. Then, per job:
gradient clipping over its own parameters, its own optimizer's step (lr set
by the caller from its own schedule).

What differs from alone is float rounding only: the combined batch is padded
to its longest row and its matmuls have other shapes, so sums may be taken in
another order (see the tests for the bound).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import Tensor

from service.job_spec.spec import JobSpec
from worker.multi.lora import BASE_ONLY, SharedBase
from worker.rollout.rollout import Rollout
from worker.trainer.metrics import UpdateStats
from worker.multi.routed import collate_rows, routed_hidden, row_slices, rows_logprobs
from worker.trainer.plan import UpdatePlan, plan_update
from worker.trainer.update import micro_batches


@dataclass
class JobUpdate:
    """One job's share of a cycle's update."""

    name: str  # its adapter on the shared base
    spec: JobSpec
    optimizer: torch.optim.Optimizer
    params: list[torch.nn.Parameter]
    rollout: Rollout
    advantages: Tensor | list[Tensor]  # per sequence, one value per action token (or one value per sequence)
    indices: list[int]  # the sequences to train on
    step: int  # the job's trainer step (keys its mini-batch shuffle)
    stats: UpdateStats = field(default_factory=UpdateStats)
    plan: UpdatePlan | None = None  # worker/trainer/plan.py's, made by batched_update (None: nothing to train)

    @property
    def lengths(self) -> list[int]:
        return [len(ids) for ids in self.rollout.token_ids]


def _collate(parts: list[tuple[JobUpdate, list[int]]], pad_id: int, device):
    """The combined micro-batch of the jobs' sequences `parts`, each job's shared prompts held once (routed.py)."""
    return collate_rows([job.rollout.token_ids[i] for job, micro in parts for i in micro],
                        [job.rollout.action_mask[i] for job, micro in parts for i in micro],
                        [job.name for job, micro in parts for _ in micro], pad_id=pad_id, device=device)


def _job_logprobs(shared: SharedBase, job: JobUpdate, hidden_BTH: Tensor, batch, rows: slice):
    return rows_logprobs(shared, hidden_BTH, batch, rows, temperature=job.spec.sampling.temperature,
                         chunk_size=job.spec.training.logprob_chunk_size, owner=job.name)


def _frozen_logprobs(shared: SharedBase, jobs: list[JobUpdate], *, reference: bool, pad_id: int, device,
                     autocast) -> list[dict[int, Tensor]]:
    """Per job, its sequences' action-token log-probs under its current adapter (or the base alone), no grad;
    every job's k-th micro-batch scored in one forward."""
    if not jobs:  # the usual case (one update per rollout, no KL): no eval/train round trip over every module
        return []
    results: list[dict[int, Tensor]] = [{} for _ in jobs]
    micros = [micro_batches(job.plan.indices, job.lengths, job.spec.training.micro_batch_size) for job in jobs]
    model = shared.model
    was_training = model.training
    shared.set_training(False)
    with torch.no_grad():
        for k in range(max(map(len, micros), default=0)):
            parts = [(j, micros[j][k]) for j in range(len(jobs)) if k < len(micros[j])]
            batch = _collate([(jobs[j], m) for j, m in parts], pad_id, device)
            names = [BASE_ONLY if reference else jobs[j].name for j, m in parts for _ in m]
            hidden = routed_hidden(shared, batch, names, autocast)
            for (j, micro), rows in zip(parts, row_slices([len(m) for _, m in parts])):
                logp, _ = _job_logprobs(shared, jobs[j], hidden, batch, rows)
                mask = batch.action_mask_BT[rows].bool()
                lengths = mask.sum(-1).long().tolist()
                results[j].update(zip(micro, logp[mask].split(lengths)))
    shared.set_training(was_training)
    return results


def batched_update(shared: SharedBase, jobs: list[JobUpdate], *, pad_id: int, device,
                   autocast=nullcontext) -> list[UpdateStats]:
    """Every job's optimizer steps of this cycle; returns each job's UpdateStats, in order. `autocast()`: the
    context forwards run in (the shared base's compute dtype)."""
    for job in jobs:
        job.plan = plan_update(job.rollout, job.advantages, job.indices, step=job.step, spec=job.spec)
    trained = [job for job in jobs if job.plan is not None]
    needs_old = [job for job in trained if job.plan.needs_old]
    for job, old in zip(needs_old, _frozen_logprobs(shared, needs_old, reference=False, pad_id=pad_id,
                                                     device=device, autocast=autocast)):
        job.plan.old = old
    needs_ref = [job for job in trained if job.plan.needs_ref]
    for job, ref in zip(needs_ref, _frozen_logprobs(shared, needs_ref, reference=True, pad_id=pad_id,
                                                     device=device, autocast=autocast)):
        job.plan.ref = ref
    shared.set_training(True)
    for r in range(max((len(job.plan.steps) for job in trained), default=0)):
        _round(shared, [job for job in trained if r < len(job.plan.steps)], r, pad_id, device, autocast)
    for job in jobs:
        job.optimizer.zero_grad(set_to_none=True)
    return [job.stats for job in jobs]


def _round(shared: SharedBase, jobs: list[JobUpdate], r: int, pad_id: int, device, autocast) -> None:
    """Optimizer step r of each of `jobs`: their micro-batches in shared forwards and backwards, then each job's
    own clipping and step."""
    micros = {job.name: micro_batches(job.plan.steps[r].sequences, job.lengths, job.spec.training.micro_batch_size)
              for job in jobs}
    for job in jobs:
        job.optimizer.zero_grad(set_to_none=True)
    losses = {job.name: 0.0 for job in jobs}
    for k in range(max((len(micros[job.name]) for job in jobs), default=0)):
        parts = [(job, micros[job.name][k]) for job in jobs if k < len(micros[job.name])]
        batch = _collate(parts, pad_id, device)
        names = [job.name for job, micro in parts for _ in micro]
        hidden = routed_hidden(shared, batch, names, autocast)
        total = None
        for (job, micro), rows in zip(parts, row_slices([len(micro) for _, micro in parts])):
            with autocast():
                logp, entropy = _job_logprobs(shared, job, hidden, batch, rows)
            out = job.plan.loss(job.plan.steps[r], micro, logp, batch.action_mask_BT[rows])
            total = out.loss if total is None else total + out.loss
            losses[job.name] += float(out.loss.detach())
            job.stats.add(out, float((entropy * batch.action_mask_BT[rows]).sum()))
        total.backward()  # one backward for every job's micro-batch: the adapters are disjoint
    for job in jobs:
        job.plan.close_step(job.stats, job.params, job.optimizer, losses[job.name])
