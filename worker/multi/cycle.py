"""One cycle: every resident job advances by one trainer step, sampled together and updated together.

    begin_step (each job: lr, prompts, streams) -> one shared rollout (worker/multi/rollout.py)
    -> take_rollout (each job: rewards, advantages) -> one batched update (worker/multi/update.py)
    -> end_step (each job: metrics reported) -> the due evaluations, decoded together (worker/multi/engine.py)
    -> finish_step (each job: its evaluation, checkpoint)

A supervised job samples nothing in its step: its step (ResidentJob.supervised_step, the trainer's own) runs on
its own forwards through its adapter, first; its due evaluation is decoded with the others'.

A job's own failure (its reward's error rate, a bad prompt, NaN logits in its
rows, its callbacks) removes that job only: it is returned among the
failures and the others go on. A failure of the shared update itself (the
combined backward) is every stepping job's, since none of their steps is whole.
"""

from __future__ import annotations

import logging
import time

import torch

from worker.multi.engine import decode_evaluations
from worker.multi.job import ResidentJob
from worker.multi.lora import SharedBase
from worker.multi.rollout import generate_jobs
from worker.multi.update import batched_update

log = logging.getLogger(__name__)


def start_jobs(shared: SharedBase, jobs: list[ResidentJob], *, device: torch.device) -> dict[str, BaseException]:
    """Start jobs joining together (each one's pre-flight and step-0 evaluation, ResidentJob.start), their
    evaluations decoded in one batch where they may go first; returns {job name: what stopped it}."""
    failures: dict[str, BaseException] = {}
    if jobs:
        decode_evaluations(shared, jobs[0].policy.tokenizer, device, [job for job in jobs if job.evaluation_may_lead()])
    for job in jobs:
        try:
            job.start()
        except Exception as e:  # noqa: BLE001 - this job's own start; the others go on
            log.warning("resident job %s failed to start: %s", job.name, e, exc_info=True)
            failures[job.name] = e
    return failures


def run_cycle(shared: SharedBase, jobs: list[ResidentJob], *, device: torch.device,
              autocast=None) -> dict[str, BaseException]:
    """Advance every job (none done) by one step; returns {job name: the exception that stopped it}."""
    failures: dict[str, BaseException] = {}

    def guarded(job: ResidentJob, call):
        try:
            return call()
        except Exception as e:  # noqa: BLE001 - this job's own problem; the others go on
            log.warning("resident job %s failed: %s", job.name, e, exc_info=True)
            failures[job.name] = e
            return None

    # A supervised step samples nothing: each runs on its own, through its own adapter.
    stepped = [job for job in jobs if job.supervised and guarded(job, job.supervised_step) is not None]
    stepped += _cispo_steps(shared, [job for job in jobs if not job.supervised], failures, guarded, device,
                            autocast)
    if stepped:  # the evaluations due now, in one decode (each job's own evaluate() in finish_step takes its part)
        decode_evaluations(shared, stepped[0].policy.tokenizer, device,
                           [job for job in stepped if job.eval_due(job.step)])
    for job in stepped:
        guarded(job, job.finish_step)
    return failures


def _cispo_steps(shared: SharedBase, jobs: list[ResidentJob], failures: dict[str, BaseException], guarded, device,
                 autocast) -> list[ResidentJob]:
    """The CISPO jobs' step up to its report, sampled together and updated together; returns the jobs stepped."""
    requests = {job.name: guarded(job, job.begin_step) for job in jobs}
    sampling = [job for job in jobs if job.name not in failures]
    if not sampling:
        return []
    tokenizer = sampling[0].policy.tokenizer
    started = time.perf_counter()
    rollouts = generate_jobs(shared, tokenizer, device, [requests[job.name] for job in sampling])
    rollout_s = time.perf_counter() - started
    updates = []
    for job, rollout in zip(sampling, rollouts):
        if isinstance(rollout, Exception):
            failures[job.name] = rollout
            continue
        update = guarded(job, lambda job=job, rollout=rollout: job.take_rollout(rollout, rollout_s))
        if update is not None:
            updates.append((job, update))
    if not updates:
        return []
    started = time.perf_counter()
    try:
        stats = batched_update(shared, [u for _, u in updates], pad_id=tokenizer.pad_token_id, device=device,
                               **({"autocast": autocast} if autocast is not None else {}))
    except Exception as e:  # noqa: BLE001 - the shared backward: no stepping job's step is whole
        log.exception("the batched update of %d jobs failed", len(updates))
        failures.update({job.name: e for job, _ in updates})
        return []
    update_s = time.perf_counter() - started
    return [job for (job, _), job_stats in zip(updates, stats)
            if guarded(job, lambda job=job, job_stats=job_stats: job.end_step(job_stats, update_s)) is not None]
