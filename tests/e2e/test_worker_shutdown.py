"""A deploy: SIGTERM to a prefork worker mid-job. The job checkpoints at its next step boundary,
goes back to the queue without using up an attempt, and another worker finishes it from there.
A SIGTERM that reaches the pool child itself (a supervisor signalling the whole group) drains the same way."""

from __future__ import annotations

import os
import signal
import time

import pytest
from sqlalchemy import select

from service.db.models import Job
from service.db.session import session_factory
from tests.e2e.test_service_flow import REWARD_SOURCE, hyperparameters, upload, wait_for


def _start_job(client, toy_dir, steps: int) -> tuple[str, callable]:
    """(job id, a function that polls the job) for a job that runs until `steps`."""
    train = upload(client, toy_dir / "train.jsonl", "train.jsonl")
    reward = client.post("/reward_functions", json={"name": "r", "spec": {"type": "python", "source": REWARD_SOURCE}})
    r = client.post("/fine_tuning/jobs", json={
        "model": str(toy_dir / "model"), "training_file": train, "seed": 3,
        "method": {"type": "cispo", "cispo": {"reward_function": reward.json()["id"],
                                             "hyperparameters": hyperparameters(toy_dir, steps=steps,
                                                                                checkpoint_interval=100)}}})
    assert r.status_code == 200, r.text
    job_id = r.json()["id"]
    get = lambda: client.get(f"/fine_tuning/jobs/{job_id}").json()  # noqa: E731
    deadline = time.time() + 300
    while get().get("steps_done", 0) < 2:
        assert time.time() < deadline, "the job made no progress"
        time.sleep(0.3)
    return job_id, get


def _events(client, job_id: str) -> list[str]:
    events, after = [], None
    while True:
        params = {"limit": 100, **({"after": after} if after else {})}
        page = client.get(f"/fine_tuning/jobs/{job_id}/events", params=params).json()
        events += [e["message"] for e in page["data"]]
        if not page["has_more"]:
            return events
        after = page["data"][-1]["id"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone too, only not yet reaped
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.slow
def test_sigterm_drains_the_job_to_another_worker(stack, toy_dir):
    client = stack.client(stack.new_key("drain"))
    # 18 steps left after the first 2 (each samples 16 completions: most of a second even on an idle machine):
    # the job cannot end on its own before the drain (a poll may be 1 s stale); a second worker runs the rest.
    job_id, get = _start_job(client, toy_dir, steps=20)

    worker = stack.procs["worker"]
    worker.send_signal(signal.SIGTERM)  # warm shutdown: waits for the job, which drains
    assert worker.wait(timeout=120) == 0
    job = get()
    assert job["status"] == "queued", job
    stopped_at = job["steps_done"]
    ckpts = client.get(f"/fine_tuning/jobs/{job_id}/checkpoints").json()["data"]
    assert ckpts and ckpts[0]["step_number"] == stopped_at  # at most the step in flight is lost: none

    stack.start("worker-2", "worker", "--pool", "prefork")
    job = wait_for(get, ("succeeded", "failed", "cancelled"), timeout=600)
    assert job["status"] == "succeeded", job["error"]
    events = _events(client, job_id)
    assert any("shutting down" in m for m in events)
    assert f"Resumed from the checkpoint at step {stopped_at}" in events
    assert any("attempt 1 of" in m for m in events) and not any("attempt 2 of" in m for m in events)


@pytest.mark.slow
def test_sigterm_to_a_pool_child_drains_its_job_and_the_worker_runs_on(stack, toy_dir):
    client = stack.client(stack.new_key("child-drain"))
    job_id, get = _start_job(client, toy_dir, steps=15)  # 13 steps left when the child is signalled
    with session_factory(stack.env["DATABASE_URL"])() as s:
        owner = s.scalar(select(Job.lease_owner).where(Job.id == job_id))
    child = int(owner.rsplit(":", 1)[1])  # the runner's "host:pid"
    workers = [p for p in stack.procs.values() if p.poll() is None]

    os.kill(child, signal.SIGTERM)  # the child only: its parent is not shutting down
    deadline = time.time() + 120
    while not any("shutting down" in m for m in _events(client, job_id)):  # one killed mid-step never says so
        assert time.time() < deadline, f"the job did not drain: {_events(client, job_id)}"
        time.sleep(0.5)
    while _alive(child):  # it returns from its task and exits (one task per child)
        assert time.time() < deadline, "the drained child is still running"
        time.sleep(0.2)

    job = wait_for(get, ("succeeded", "failed", "cancelled"), timeout=600)  # the worker's next child resumes it
    assert job["status"] == "succeeded", job["error"]
    assert all(p.poll() is None for p in workers), "a worker (or the API) went down with the child"
    events = _events(client, job_id)
    assert any(m.startswith("Resumed from the checkpoint at step") for m in events), events
    assert not any("attempt 2 of" in m for m in events)
