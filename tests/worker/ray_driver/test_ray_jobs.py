"""Service jobs with resources.nodes 2, run by the job runner (real PostgreSQL, object store directory) as the
driver of a real two-node Ray cluster: the job succeeds with its checkpoints committed; a gang the cluster cannot
grant, and a node lost mid-job, send the job back to queued using no attempt, and it resumes and finishes; a
killed driver takes its ranks with it. PostgreSQL only: the SQL side is the job runner's, tested on both."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from sqlalchemy import func, select

from service.db.models import Checkpoint, JobEvent
from service.db.session import session_factory
from tests.worker.ray_driver.conftest import NODE, ROOT
from tests.worker.ray_driver.test_ray_driver import _gone, _rank_pids
from tests.worker.jobs.test_job_runner import job_row, make_settings, run_in_thread, submit
from worker.jobs.job_runner import run_job

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow

TRAINING = dict(batch_size=2, group_size=4, micro_batch_size=4, mini_batches=1, eval_max_rows=2)


def _settings(tmp_path, database_url, cluster, **extra):
    return make_settings(tmp_path, database_url).model_copy(update={"ray_address": cluster.address, **extra})


def _events(settings, job_id) -> list[str]:
    with session_factory(settings.resolved_database_url())() as s:
        return list(s.scalars(select(JobEvent.message).where(JobEvent.job_id == job_id).order_by(JobEvent.id)))


def _checkpoints(settings, job_id) -> int:
    with session_factory(settings.resolved_database_url())() as s:
        return s.scalar(select(func.count()).select_from(Checkpoint).where(Checkpoint.job_id == job_id))


def test_a_two_node_job_succeeds_with_its_checkpoints_committed(postgres_url, toy_dir, tmp_path, two_nodes):
    settings = _settings(tmp_path, postgres_url, two_nodes)
    job_id = submit(settings, toy_dir, steps=2, checkpoint_interval=1, resources={"nodes": 2}, **TRAINING)
    assert run_job(job_id, settings) == "succeeded"
    job = job_row(settings, job_id)
    assert (job.steps_done, job.attempts) == (2, 1)
    assert _checkpoints(settings, job_id) == 2  # uploaded by the driver, fenced by its epoch
    assert any("Started 2 rank(s) on 2 Ray node(s)" in e for e in _events(settings, job_id))


def test_a_gang_the_cluster_cannot_grant_queues_the_job_using_no_attempt(postgres_url, toy_dir, tmp_path, two_nodes):
    settings = _settings(tmp_path, postgres_url, two_nodes, ray_gang_timeout_s=3)
    job_id = submit(settings, toy_dir, steps=1, resources={"nodes": 3}, **{**TRAINING, "batch_size": 3})
    assert run_job(job_id, settings) == "queued"
    job = job_row(settings, job_id)
    assert (job.status, job.attempts) == ("queued", 0)  # the attempt is given back
    assert any(e.startswith("The Ray cluster lacks capacity") and "did not grant 3 node(s)" in e
               for e in _events(settings, job_id))
    assert ray.available_resources().get("CPU") == 2  # nothing held while it waits


def test_a_node_lost_mid_job_queues_it_using_no_attempt_and_it_resumes_to_the_end(postgres_url, toy_dir, tmp_path,
                                                                                 two_nodes):
    settings = _settings(tmp_path, postgres_url, two_nodes)
    job_id = submit(settings, toy_dir, steps=3, checkpoint_interval=1, resources={"nodes": 2}, **TRAINING)
    thread, out = run_in_thread(settings, job_id)
    deadline = time.monotonic() + 300
    while _checkpoints(settings, job_id) < 1:  # a committed checkpoint to resume from
        assert time.monotonic() < deadline and thread.is_alive(), "the job made no checkpoint"
        time.sleep(0.2)
    worker_node = next(n for n in two_nodes.list_all_nodes() if n is not two_nodes.head_node)
    two_nodes.remove_node(worker_node)
    thread.join(timeout=300)
    assert out["status"] == "queued"
    job = job_row(settings, job_id)
    assert (job.status, job.attempts) == ("queued", 0)
    assert any(e.startswith("The Ray cluster lacks capacity") and "left the cluster" in e
               for e in _events(settings, job_id))

    two_nodes.add_node(**NODE)  # capacity returns
    two_nodes.wait_for_nodes()
    assert run_job(job_id, settings) == "succeeded"
    job = job_row(settings, job_id)
    assert (job.steps_done, job.attempts) == (3, 1)
    assert any(e.startswith("Resumed from the checkpoint at step") for e in _events(settings, job_id))


def test_a_dead_driver_takes_its_ranks_with_it_and_the_next_worker_restarts_the_job(postgres_url, toy_dir, tmp_path,
                                                                                     two_nodes):
    """The driver (a worker process) is killed mid-job: Ray ends its ranks and placement group (they are its own),
    and once the lease expires another worker claims the job (a higher epoch) and runs it to the end."""
    settings = _settings(tmp_path, postgres_url, two_nodes, lease_ttl_s=5)
    job_id = submit(settings, toy_dir, steps=3, checkpoint_interval=1, resources={"nodes": 2}, **TRAINING)
    env = {**os.environ, "CISPO_DATABASE_URL": settings.database_url, "CISPO_STORAGE_URL": settings.storage_url,
           "CISPO_HOME": str(settings.home), "CISPO_RAY_ADDRESS": two_nodes.address, "CISPO_LEASE_TTL_S": "5",
           "CISPO_HEARTBEAT_S": "0.2", "PYTHONPATH": str(ROOT)}
    driver = subprocess.Popen([sys.executable, "-c", f"from service.settings import Settings; from worker.jobs.job_runner "
                               f"import run_job; run_job({job_id!r}, Settings())"], env=env)
    try:
        deadline = time.monotonic() + 300
        while _checkpoints(settings, job_id) < 1:
            assert time.monotonic() < deadline and driver.poll() is None, "the job made no checkpoint"
            time.sleep(0.2)
        ranks = _rank_pids()
        first_epoch = job_row(settings, job_id).lease_epoch
        driver.kill()  # no drain, no goodbye: as a lost machine
        driver.wait()
    finally:
        if driver.poll() is None:
            driver.kill()
    assert len(ranks) >= 2 and _gone(ranks, within_s=60)
    deadline = time.monotonic() + 60
    while ray.available_resources().get("CPU") != 2:  # the placement group went with its driver
        assert time.monotonic() < deadline, ray.available_resources()
        time.sleep(0.5)

    time.sleep(5)  # the lease expires
    assert run_job(job_id, settings) == "succeeded"
    job = job_row(settings, job_id)
    assert job.steps_done == 3 and job.lease_epoch > first_epoch and job.attempts == 2
    assert any(e.startswith("Resumed from the checkpoint at step") for e in _events(settings, job_id))
