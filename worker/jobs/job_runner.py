"""Runs one service job: claim the lease, fetch inputs, train, report, end the lease.

The SQL row is the truth. A duplicate broker message finds the lease taken
and returns; a worker that loses its lease stops writing at once (every write
is fenced by the lease epoch, and its checkpoints go under its epoch's own
prefix). Cancellation, pause and the worker's graceful shutdown (DRAIN) are
honoured at the next step boundary, after a checkpoint; the job resumes from
it on this worker or any other. A cancel also cuts short a batch of sandboxed
user code (a reward or environment) at once: nothing of the step is kept.

Failures: a bad job (its data, checkpoint or reward) fails at once. Anything
else (an unreachable object store, a crashed step) may be transient: the job
is queued again after a growing backoff and resumes from its newest
checkpoint, until it has used `max_attempts` runs. The steps of a run (claim,
inputs, failure classification, end) are worker/jobs/lifecycle/'s, shared with
resident jobs (worker/multi/runner.py) and eval runs (worker/jobs/eval_runner.py).
"""

from __future__ import annotations

from pathlib import Path

from service.sandbox.channel import INTERRUPT
from service.settings import Settings
from service.storage import ObjectStore
from worker import scratch
from worker.jobs.job_reporter import JobReporter
from worker.jobs.lifecycle.end import abandon, conclude, run_outcome
from worker.jobs.lifecycle.failures import ending_of
from worker.jobs.lifecycle.start import Claimed, claim_run, connect, make_reporter, prepare_run, start_trackers, worker_owner
from worker.rewards.engine import ScoringContext


def train(claimed: Claimed, store: ObjectStore, work: Path, settings: Settings, reporter: JobReporter):
    """Run the trainer for the job from its newest committed checkpoint, in this process or across
    spec.resources.gpus processes under torchrun (the lease and heartbeat stay here); returns its TrainResult."""
    from worker.torchrun.launch import run_training  # torch loads here, not at worker import

    local_spec, run_dir = prepare_run(claimed, store, work, reporter)
    scoring = ScoringContext.from_settings(settings, claimed.secrets)
    if local_spec.resources.on_ray:  # larger than one machine: this worker drives it on the Ray cluster
        from worker.ray_driver.entry import run_on_ray_cluster

        return run_on_ray_cluster(local_spec, run_dir, reporter, settings=settings, scoring=scoring)
    return run_training(local_spec, run_dir, reporter, scoring=scoring)


def run_job(job_id: str, settings: Settings, *, owner: str | None = None) -> str | None:
    """Run the job if its lease can be taken; returns the status it ended in (None if not ours)."""
    sessions, store = connect(settings)
    claimed = claim_run(sessions, job_id, worker_owner(owner), settings)
    if not isinstance(claimed, Claimed):
        return claimed

    reporter = make_reporter(sessions, store, job_id, claimed, settings)
    work = scratch.run_dir(settings, job_id, claimed.epoch)  # this run's own, removed however it ends
    reporter.start()
    try:
        start_trackers(reporter, job_id, claimed, settings)
        result = train(claimed, store, work, settings, reporter)
        status, error = run_outcome(reporter, result.steps_done, claimed.spec.training.steps)
    except Exception as e:  # the job fails, retries or is cancelled; the worker lives on
        status, error = ending_of(e, lost=reporter.lost, what=f"job {job_id}")
    finally:
        reporter.stop()
        INTERRUPT.clear()  # the cancel was this job's: later user code in this process must run
    if status is None:  # the lease is another worker's now
        abandon(sessions, store, job_id, claimed, reporter, work)
        return None
    return conclude(sessions, store, job_id, claimed, settings, reporter, work, status, error)
