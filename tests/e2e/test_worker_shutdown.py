"""A deploy: SIGTERM to a prefork worker mid-job. The job checkpoints at its next step boundary,
goes back to the queue without using up an attempt, and another worker finishes it from there."""

from __future__ import annotations

import signal
import time

import pytest

from tests.e2e.test_service_flow import REWARD_SOURCE, hyperparameters, upload, wait_for


@pytest.mark.slow
def test_sigterm_drains_the_job_to_another_worker(stack, toy_dir):
    client = stack.client(stack.new_key("drain"))
    train = upload(client, toy_dir / "train.jsonl", "train.jsonl")
    reward = client.post("/reward_functions", json={"name": "r", "spec": {"type": "python", "source": REWARD_SOURCE}})
    r = client.post("/fine_tuning/jobs", json={
        "model": str(toy_dir / "model"), "training_file": train, "seed": 3,
        "method": {"type": "cispo", "cispo": {"reward_function": reward.json()["id"],
                                             "hyperparameters": hyperparameters(toy_dir, steps=60,
                                                                                checkpoint_interval=100)}}})
    assert r.status_code == 200, r.text
    job_id = r.json()["id"]
    get = lambda: client.get(f"/fine_tuning/jobs/{job_id}").json()  # noqa: E731
    deadline = time.time() + 300
    while get().get("steps_done", 0) < 2:
        assert time.time() < deadline, "the job made no progress"
        time.sleep(0.3)

    worker = stack.procs["worker"]
    # Enough steps are left that the job cannot end on its own before the drain (a poll may be 1 s stale).
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
    events, after = [], None
    while True:
        params = {"limit": 100, **({"after": after} if after else {})}
        page = client.get(f"/fine_tuning/jobs/{job_id}/events", params=params).json()
        events += [e["message"] for e in page["data"]]
        if not page["has_more"]:
            break
        after = page["data"][-1]["id"]
    assert any("shutting down" in m for m in events)
    assert f"Resumed from the checkpoint at step {stopped_at}" in events
    assert any("attempt 1 of" in m for m in events) and not any("attempt 2 of" in m for m in events)
