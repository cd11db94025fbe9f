"""A model no worker can load (a hub id that does not exist or cannot be downloaded, a relative path read as a hub
id) fails the job as invalid_job on its first attempt: no retries spent waiting out the hub client."""

from __future__ import annotations

import huggingface_hub.constants
import pytest

from service.db.session import session_factory
from service.repositories import jobs
from tests.worker.jobs.test_job_runner import job_row, make_settings, submit
from worker.jobs.job_runner import run_job


@pytest.mark.parametrize("model", ["Qwen/NoSuchModel-7B", "models/tiny"])
def test_a_model_that_cannot_be_fetched_is_a_permanent_invalid_job(database_url, toy_dir, tmp_path, monkeypatch,
                                                                     model):
    # No hub here: what an unreachable one ends in, without its ~45 s of retries. huggingface_hub reads the
    # variable once, at import, so the flag itself is set too.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    settings = make_settings(tmp_path, database_url).model_copy(update={"max_attempts": 3})
    job_id = submit(settings, toy_dir, steps=1)
    with session_factory(database_url).begin() as s:
        job = jobs.get_for_worker(s, job_id)
        job.spec = {**job.spec, "model": model}
        job.model = model
    assert run_job(job_id, settings) == "failed"
    job = job_row(settings, job_id)
    assert (job.status, job.attempts, job.error_code) == ("failed", 1, "invalid_job")
    assert "the model cannot be loaded on this worker" in job.error_message
