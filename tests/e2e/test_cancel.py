"""A cancel while user code scores a batch: the sandbox is killed at once, not after the batch's deadline
(the per-sample timeout times the batch, up to 10 minutes)."""

from __future__ import annotations

import os
import time

from tests.e2e.test_service_flow import hyperparameters, upload, wait_for

SLEEPY_REWARD = '''
import time

def reward(completion, **row):
    time.sleep(3600)  # each sample runs into its 10 s timeout: a batch of 16 takes 160 s
    return 0.0
'''


def _descendants(pid: int) -> set[int]:
    """Live processes below pid (zombies are gone, only not yet reaped)."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError):
            continue
        if state != "Z":
            children.setdefault(int(ppid), []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def test_a_cancel_kills_a_running_python_reward_at_once(stack, toy_dir):
    client = stack.client(stack.new_key("cancel-reward"))
    train = upload(client, toy_dir / "train.jsonl", "train.jsonl")
    reward = client.post("/reward_functions", json={"name": "sleepy", "spec": {"type": "python",
                                                                              "source": SLEEPY_REWARD}})
    assert reward.status_code == 200, reward.text
    r = client.post("/fine_tuning/jobs", json={
        "model": str(toy_dir / "model"), "training_file": train, "seed": 3,
        "method": {"type": "cispo", "cispo": {"reward_function": reward.json()["id"],
                                             "hyperparameters": hyperparameters(toy_dir, steps=3)}}})
    assert r.status_code == 200, r.text
    job_id = r.json()["id"]
    get = lambda: client.get(f"/fine_tuning/jobs/{job_id}").json()  # noqa: E731

    # The worker's pool child runs the job; what it starts below itself is the reward's sandbox.
    worker, deadline = stack.procs["worker"].pid, time.time() + 180
    while not (sandbox := {p for c in _descendants(worker) for p in _descendants(c)}):
        assert time.time() < deadline and get()["status"] in ("queued", "running"), "no reward sandbox started"
        time.sleep(0.3)
    time.sleep(1)  # well inside the first batch

    asked = time.monotonic()
    assert client.post(f"/fine_tuning/jobs/{job_id}/cancel").status_code == 200
    job = wait_for(get, ("succeeded", "failed", "cancelled"), timeout=180)
    took = time.monotonic() - asked
    assert job["status"] == "cancelled", job
    assert took < 15, f"the cancel took {took:.0f} s: it waited for the reward batch"
    assert not sandbox & {p for p in _descendants(worker)}, "a sandbox process outlived the cancelled job"
