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
from worker.trainer.packing import collate_packed
from worker.trainer.plan import UpdatePlan, plan_update
from worker.trainer.scoring import TokenBatch
from worker.trainer.update import head_dtype, job_micro_batches, shares_prefixes


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
    reference: str | None = BASE_ONLY  # the adapter of its reference policy (a KL term): a pinned one, or none

    @property
    def lengths(self) -> list[int]:
        return [len(ids) for ids in self.rollout.token_ids]


@dataclass
class _Combined:
    """A combined micro-batch: the batch, the adapter of each of its rows, and each part's rows and sequences (its
    slices of the batch's rows and of its one-row-per-sequence layout: the same unless the batch is packed)."""

    batch: TokenBatch
    names: list[str | None]
    rows: list[slice]
    sequences: list[slice]


def _collate(parts: list[tuple[JobUpdate, list[int]]], adapters: list[str | None], pad_id: int, device) -> _Combined:
    """The combined micro-batch of the jobs' sequences `parts`, part i's rows through adapter `adapters[i]`.

    Each job's shared prompts are held once (routed.py), unless a job in it shares none (worker/trainer/update.py's
    shares_prefixes: gradient checkpointing). Where a job in it packs (training.pack_tokens), every row is a packed
    row (worker/trainer/packing.py): a packing job's micro-batch (one of its packs) is one row, and the others'
    sequences, in their order, fill rows no wider, so no row pads to a pack's width (their log-probs are those of
    their padded micro-batch, as packing's are)."""
    ids = [job.rollout.token_ids[i] for job, micro in parts for i in micro]
    masks = [job.rollout.action_mask[i] for job, micro in parts for i in micro]
    if not any(job.spec.training.pack_tokens is not None for job, _ in parts):
        batch = collate_rows(ids, masks, [job.name for job, micro in parts for _ in micro], pad_id=pad_id,
                             device=device, share_prefixes=all(shares_prefixes(job.spec) for job, _ in parts))
        counts = [len(micro) for _, micro in parts]
    else:
        width = max(sum(job.lengths[i] for i in micro) if job.spec.training.pack_tokens is not None else
                    max(job.lengths[i] for i in micro) for job, micro in parts)
        rows = [[len(micro)] if job.spec.training.pack_tokens is not None else
                _consecutive_rows([job.lengths[i] for i in micro], width) for job, micro in parts]
        batch = collate_packed(ids, masks, rows=[n for part in rows for n in part], pad_id=pad_id, device=device)
        counts = [len(part) for part in rows]
    names = [name for name, count in zip(adapters, counts) for _ in range(count)]
    return _Combined(batch, names, row_slices(counts), row_slices([len(micro) for _, micro in parts]))


def _consecutive_rows(lengths: list[int], width: int) -> list[int]:
    """How many consecutive sequences of these lengths each row holds, a row taking sequences while they fit in
    `width` tokens (at least one)."""
    rows: list[int] = []
    room = 0
    for length in lengths:
        if rows and length <= room:
            rows[-1] += 1
            room -= length
        else:
            rows.append(1)
            room = width - length
    return rows


def _job_logprobs(shared: SharedBase, job: JobUpdate, hidden_BTH: Tensor, combined: _Combined, part: int,
                  adapter: str | None):
    """(logp, entropy) of part `part` of the combined micro-batch, one row per sequence, through `adapter`."""
    return rows_logprobs(shared, hidden_BTH, combined.batch, combined.rows[part],
                         sequences=combined.sequences[part], temperature=job.spec.sampling.temperature,
                         chunk_size=job.spec.training.logprob_chunk_size, owner=adapter,
                         head_dtype=head_dtype(job.spec))


def _frozen_logprobs(shared: SharedBase, jobs: list[JobUpdate], *, reference: bool, pad_id: int, device,
                     autocast) -> list[dict[int, Tensor]]:
    """Per job, its sequences' action-token log-probs under its current adapter (or its reference: the adapter it
    pinned, or the base alone), no grad; every job's k-th micro-batch scored in one forward."""
    if not jobs:  # the usual case (one update per rollout, no KL): no eval/train round trip over every module
        return []
    results: list[dict[int, Tensor]] = [{} for _ in jobs]
    micros = [job_micro_batches(job.spec, job.plan.indices, job.lengths) for job in jobs]
    model = shared.model
    was_training = model.training
    shared.set_training(False)
    with torch.no_grad():
        for k in range(max(map(len, micros), default=0)):
            parts = [(j, micros[j][k]) for j in range(len(jobs)) if k < len(micros[j])]
            adapters = [jobs[j].reference if reference else jobs[j].name for j, _ in parts]
            combined = _collate([(jobs[j], m) for j, m in parts], adapters, pad_id, device)
            hidden = routed_hidden(shared, combined.batch, combined.names, autocast)
            for part, ((j, micro), adapter) in enumerate(zip(parts, adapters)):
                logp, _ = _job_logprobs(shared, jobs[j], hidden, combined, part, adapter)
                mask = combined.batch.sequence_action_mask_BT[combined.sequences[part]].bool()
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
    micros = {job.name: job_micro_batches(job.spec, job.plan.steps[r].sequences, job.lengths) for job in jobs}
    for job in jobs:
        job.optimizer.zero_grad(set_to_none=True)
    losses = {job.name: 0.0 for job in jobs}
    for k in range(max((len(micros[job.name]) for job in jobs), default=0)):
        parts = [(job, micros[job.name][k]) for job in jobs if k < len(micros[job.name])]
        combined = _collate(parts, [job.name for job, _ in parts], pad_id, device)
        with shared.checkpointing(any(job.spec.training.gradient_checkpointing for job, _ in parts)):
            hidden = routed_hidden(shared, combined.batch, combined.names, autocast)
        total = None
        for part, (job, micro) in enumerate(parts):
            with autocast():
                logp, entropy = _job_logprobs(shared, job, hidden, combined, part, job.name)
            action_mask_BT = combined.batch.sequence_action_mask_BT[combined.sequences[part]]
            out = job.plan.loss(job.plan.steps[r], micro, logp, action_mask_BT)
            total = out.loss if total is None else total + out.loss
            losses[job.name] += float(out.loss.detach())
            job.stats.add(out, float((entropy * action_mask_BT).sum()))
        total.backward()  # one backward for every job's micro-batch: the adapters are disjoint
    for job in jobs:
        job.plan.close_step(job.stats, job.params, job.optimizer, losses[job.name])
