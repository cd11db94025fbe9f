"""Stopping `cispo up` (the embedded default: one worker, solo pool) as operators do: SIGTERM from a
service manager with a job running, Ctrl-C (SIGINT to the whole foreground group) with a job running
and when idle. A stop checkpoints the running job and hands it back without using an attempt, an idle
stop takes about a second, and nothing `cispo up` started outlives it."""

from __future__ import annotations

import signal
import time

from sqlalchemy import func, select

from service.db.models import Checkpoint, Job, JobMetric
from service.queue import enqueue_job
from service.settings import Settings
from tests.e2e.up import Up
from tests.processes import survivors


def _assert_handed_back(up: Up, job_id: str, elapsed: float, starts: int) -> int:
    """The job is queued again from a checkpoint of the step it stopped at, with no attempt used; returns that step."""
    with up.sessions()() as s:
        job = s.scalar(select(Job).where(Job.id == job_id))
        ckpt = s.scalar(select(func.max(Checkpoint.step)).where(Checkpoint.job_id == job_id))
        step_s = s.scalar(select(func.max(JobMetric.value)).where(JobMetric.job_id == job_id,
                                                                  JobMetric.name == "step_seconds"))
    events = up.events(job_id)
    assert (job.status, job.lease_owner, job.attempts) == ("queued", None, 0), (job.status, job.lease_owner, job.attempts)
    assert 0 < job.steps_done < job.total_steps and ckpt == job.steps_done  # nothing done was lost
    assert sum(m.startswith("Job started") for m in events) == starts, events  # claimed once per start, no loop
    assert events[-1].startswith("The worker is shutting down"), events[-3:]
    # One step and one checkpoint upload, plus the stop of the API and the worker's start-up slack.
    assert elapsed < 15 + 3 * step_s, f"the stop took {elapsed:.1f} s (steps take {step_s:.1f} s)"
    assert not survivors(up.tag), survivors(up.tag)
    return job.steps_done


def test_a_stop_with_a_running_job_checkpoints_it_and_hands_it_back_without_an_attempt(tmp_path, toy_dir):
    with Up(tmp_path, toy_dir, log_tail=4000) as up:
        up.cli("db", "upgrade")
        client_key = up.cli("keys", "create", "--project", "stop")
        up.start()
        job_id = up.submit(up.client(client_key), toy_dir, steps=500)
        up.wait_for(lambda: up.job_column(job_id, Job.steps_done) >= 2, "the job made no progress")

        elapsed = up.stop(signal.SIGTERM, group=False)  # a service manager stopping `cispo up`
        stopped_at = _assert_handed_back(up, job_id, elapsed, starts=1)

        up.start()  # the next start resumes it from there, still on its first attempt
        up.wait_for(lambda: up.job_column(job_id, Job.steps_done) > stopped_at, "the job did not resume")
        events = up.events(job_id)
        assert f"Resumed from the checkpoint at step {stopped_at}" in events, events
        assert [m.split(")")[0] for m in events if m.startswith("Job started")] == ["Job started (attempt 1 of 3"] * 2

        elapsed = up.stop(signal.SIGINT, group=True)  # Ctrl-C in the terminal: every process gets SIGINT
        _assert_handed_back(up, job_id, elapsed, starts=2)


def test_ctrl_c_stops_an_idle_up_in_about_a_second(tmp_path, toy_dir):
    with Up(tmp_path, toy_dir) as up:
        up.cli("db", "upgrade")
        up.start()
        # A task first (one for a job that does not exist is enough): the worker used to take SIGTERM
        # over for each task and keep it afterwards, and it loads the job runner (and torch) then.
        enqueue_job("ftjob-none", settings=Settings(home=up.home))
        deadline = time.time() + 300
        while "ftjob-none does not exist" not in up.log.read_text():
            assert time.time() < deadline, up.log.read_text()[-3000:]
            time.sleep(0.3)
        time.sleep(3)  # idle: the worker is back to polling its broker
        up.stop_idle()
