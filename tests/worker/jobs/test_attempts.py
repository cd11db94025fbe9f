"""Attempts are spent by failed runs only: pauses and duplicate messages are free, a job that
keeps failing stops after max_attempts with a growing backoff and a filled error. Old checkpoints
beyond the job's checkpoint_keep are deleted."""

from __future__ import annotations

import time

from sqlalchemy import select

from service.db.models import Checkpoint, JobEvent
from service.db.session import session_factory
from service.repositories import jobs
from service.storage import open_store
from tests.worker.jobs.test_job_runner import job_row, make_settings, run_in_thread, submit, wait_for_step
from worker.jobs.job_runner import run_job


def test_pause_and_resume_cycles_use_no_attempts(postgres_url, toy_dir, tmp_path):
    settings = make_settings(tmp_path, postgres_url).model_copy(update={"max_attempts": 1})
    job_id = submit(settings, toy_dir, steps=8, checkpoint_interval=1)
    for _ in range(3):
        # A step beyond the last run's, so this run has claimed the job (a pause may land a step late: waiting
        # for a fixed step could return before the claim, and pause the job while it is still queued).
        before = job_row(settings, job_id).steps_done
        thread, out = run_in_thread(settings, job_id)
        wait_for_step(settings, job_id, before + 1)
        with session_factory(postgres_url).begin() as s:
            jobs.request_pause(s, jobs.get_for_worker(s, job_id))
        thread.join(120)
        assert out["status"] == "paused" and job_row(settings, job_id).attempts == 0
        with session_factory(postgres_url).begin() as s:
            jobs.resume(s, jobs.get_for_worker(s, job_id))
    assert run_job(job_id, settings) == "succeeded"
    assert job_row(settings, job_id).attempts == 1


def test_a_duplicate_message_never_fails_a_healthy_running_job(postgres_url, toy_dir, tmp_path):
    settings = make_settings(tmp_path, postgres_url).model_copy(update={"max_attempts": 1})
    job_id = submit(settings, toy_dir, steps=3)
    thread, out = run_in_thread(settings, job_id)
    wait_for_step(settings, job_id, 1)
    assert run_job(job_id, settings) is None  # the broker redelivered while the job runs: a no-op
    assert job_row(settings, job_id).status == "running"
    thread.join(120)
    assert out["status"] == "succeeded"


def test_a_poison_job_fails_after_max_attempts_with_backoff(postgres_url, toy_dir, tmp_path):
    settings = make_settings(tmp_path, postgres_url).model_copy(update={"max_attempts": 3, "retry_backoff_s": 2.0})
    job_id = submit(settings, toy_dir, steps=2)
    settings.resolved_work_dir().parent.mkdir(parents=True, exist_ok=True)
    settings.resolved_work_dir().write_text("not a directory")  # every run fails the same way
    waits = []
    for attempt in (1, 2):
        assert run_job(job_id, settings) == "queued"
        job = job_row(settings, job_id)
        assert (job.status, job.attempts, job.error_code) == ("queued", attempt, None)
        waits.append(job.not_before - time.time())
        assert run_job(job_id, settings) is None  # too early: the backoff holds
        time.sleep(max(0.0, job.not_before - time.time()) + 0.05)
    assert 1.0 < waits[0] <= 2.0 and 3.0 < waits[1] <= 4.0  # 2 s, then doubled
    assert run_job(job_id, settings) == "failed"
    job = job_row(settings, job_id)
    assert (job.status, job.attempts, job.error_code) == ("failed", 3, "training_error")
    assert "Error" in job.error_message
    assert run_job(job_id, settings) is None  # a late duplicate changes nothing


def test_a_job_keeps_only_its_newest_checkpoints(postgres_url, toy_dir, tmp_path):
    settings = make_settings(tmp_path, postgres_url)
    job_id = submit(settings, toy_dir, steps=4, checkpoint_interval=1, checkpoint_keep=2)
    assert run_job(job_id, settings) == "succeeded"
    with session_factory(postgres_url).begin() as s:
        kept = list(s.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id).order_by(Checkpoint.step)))
        events = [e.message for e in s.scalars(select(JobEvent).where(JobEvent.job_id == job_id))]
    assert [c.step for c in kept] == [3, 4]
    assert sum(m.startswith("Checkpoint saved") for m in events) == 4
    stored = open_store(settings.resolved_storage_url()).list(f"jobs/{job_id}/checkpoints")
    assert stored and all(key.startswith(tuple(c.storage_prefix + "/" for c in kept)) for key in stored)
