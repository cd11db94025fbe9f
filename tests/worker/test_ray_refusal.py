"""A worker on a deployment without a Ray cluster fails a job asking for nodes > 1 at once, naming the field
(invalid_job, no retry, nothing started): the create check's twin, for jobs created before the setting changed."""

from __future__ import annotations

from tests.worker.jobs.test_job_runner import job_row, make_settings, submit
from worker.jobs.job_runner import run_job


def test_a_job_for_two_nodes_fails_at_once_on_a_worker_without_a_ray_cluster(database_url, toy_dir, tmp_path):
    settings = make_settings(tmp_path, database_url)  # no CISPO_RAY_ADDRESS
    job_id = submit(settings, toy_dir, steps=1, resources={"nodes": 2})
    assert run_job(job_id, settings) == "failed"
    job = job_row(settings, job_id)
    assert (job.status, job.attempts, job.error_code) == ("failed", 1, "invalid_job")
    assert "resources.nodes is 2" in job.error_message and "CISPO_RAY_ADDRESS" in job.error_message
