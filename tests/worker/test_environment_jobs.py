"""A service job that runs an HTTP environment, through the worker's job runner (no Celery)."""

from __future__ import annotations

from sqlalchemy import select

from service.db.models import Job, JobEvent, JobMetric, Secret
from service.db.session import session_factory
from service.repositories import jobs, projects
from service.repositories import secrets as secrets_repo
from service.job_spec.spec import JobSpec
from service.secrets.box import secret_box
from service.storage import open_store
from tests.worker.envs.test_http_env import env_server
from tests.worker.jobs.test_job_runner import job_row, make_settings
from worker.jobs.job_runner import run_job
from worker.toy.__main__ import toy_spec


def test_http_environment_job_reads_its_secret_and_succeeds(database_url, toy_dir, tmp_path):
    settings = make_settings(tmp_path, database_url).model_copy(update={"egress_allow": "127.0.0.1"})
    store = open_store(settings.resolved_storage_url())
    store.put_file("files/file-train", toy_dir / "train.jsonl")
    with env_server() as (base, server):
        raw = toy_spec(toy_dir)
        raw.pop("reward")
        raw["environment"] = {"type": "http", "url": f"{base}/good", "auth_secret": "env-key"}
        raw["data"] = {"train_file": "file-train"}
        raw["sampling"]["max_model_len"] = 128
        raw["training"].update({"steps": 2, "batch_size": 2, "group_size": 2, "micro_batch_size": 8,
                                "mini_batches": 2, "eval_interval": 0, "eval_max_rows": 2, "max_turns": 3})
        spec = JobSpec.model_validate(raw)
        with session_factory(settings.resolved_database_url()).begin() as s:
            project = projects.get_or_create_project(s, "p")
            secrets_repo.add(s, Secret(project_id=project.id, name="env-key",
                                              ciphertext=secret_box(settings).seal("Bearer from-the-db"),
                                              hosts=["127.0.0.1"]))
            job_id = jobs.add(s, Job(project_id=project.id, status="queued", model=spec.model,
                                     training_file="file-train", spec=spec.model_dump(mode="json"),
                                     method={"type": "cispo"}, seed=spec.seed, total_steps=2)).id
        assert run_job(job_id, settings) == "succeeded", job_row(settings, job_id).error_message
    assert {r["auth"] for r in server.requests} == {"Bearer from-the-db"}
    with session_factory(settings.resolved_database_url()).begin() as s:
        turns = s.scalars(select(JobMetric.value).where(JobMetric.job_id == job_id, JobMetric.name == "turns_mean"))
        assert list(turns) == [2.0, 2.0]


def test_a_failing_environment_fails_the_job_as_an_environment_error(database_url, toy_dir, tmp_path):
    """Not as reward_error_rate: the code, message and warn event name the environment and the call that failed."""
    settings = make_settings(tmp_path, database_url).model_copy(update={"egress_allow": "127.0.0.1"})
    open_store(settings.resolved_storage_url()).put_file("files/file-train", toy_dir / "train.jsonl")
    with env_server() as (base, _):
        raw = toy_spec(toy_dir)
        raw.pop("reward")
        raw["environment"] = {"type": "http", "url": f"{base}/error"}  # reset works, every step is an HTTP 500
        raw["data"] = {"train_file": "file-train"}
        raw["sampling"]["max_model_len"] = 128
        raw["training"].update({"steps": 2, "batch_size": 2, "group_size": 2, "micro_batch_size": 8,
                                "mini_batches": 2, "eval_interval": 0, "eval_max_rows": 2, "max_turns": 3,
                                "reward_error_threshold": 0.5})
        spec = JobSpec.model_validate(raw)
        with session_factory(settings.resolved_database_url()).begin() as s:
            project = projects.get_or_create_project(s, "p")
            job_id = jobs.add(s, Job(project_id=project.id, status="queued", model=spec.model,
                                     training_file="file-train", spec=spec.model_dump(mode="json"),
                                     method={"type": "cispo"}, seed=spec.seed, total_steps=2)).id
        assert run_job(job_id, settings) == "failed"
    job = job_row(settings, job_id)
    assert job.error_code == "environment_error_rate", (job.error_code, job.error_message)
    message = job.error_message
    assert message.startswith(f"http environment {base}/error failed on 100% of episodes at step 1"), message
    assert "step 1: " in message and "HTTP 500" in message and "reward function" not in message
    with session_factory(settings.resolved_database_url()).begin() as s:
        warns = [e.message for e in s.scalars(select(JobEvent).where(JobEvent.job_id == job_id,
                                                                      JobEvent.level == "warn"))]
    assert any(w.startswith(f"Environment errors at step 1 (http environment {base}/error): 4 episodes failed")
               for w in warns), warns
