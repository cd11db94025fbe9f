"""A job from upload to a downloaded, loadable adapter, over real HTTP, with the
official `openai` SDK as a client too. Runs against the stack in conftest.py."""

from __future__ import annotations

import hashlib
import io
import tarfile
import time

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from worker.toy.__main__ import toy_spec

REWARD_SOURCE = '''
def reward(completion, answer, **row):
    return 1.0 if completion.strip() == answer else 0.0
'''


def hyperparameters(toy_dir, **training) -> dict:
    spec = toy_spec(toy_dir)
    spec["training"].update({"steps": 4, "batch_size": 4, "group_size": 4, "micro_batch_size": 16,
                             "mini_batches": 2, "eval_interval": 0, "eval_max_rows": 8, "checkpoint_interval": 2,
                             **training})
    return {k: spec[k] for k in ("lora", "sampling", "optimizer", "training")}


def wait_for(get_job, statuses, timeout=300):
    deadline = time.time() + timeout
    while True:
        job = get_job()
        if job["status"] in statuses:
            return job
        assert time.time() < deadline, f"job stuck in {job['status']}"
        time.sleep(0.5)


def upload(client, path, name):
    with path.open("rb") as f:
        r = client.post("/files", files={"file": (name, f)}, data={"purpose": "fine-tune"})
    assert r.status_code == 200, r.text
    return r.json()["id"]


def test_job_end_to_end_over_http(stack, toy_dir):
    client = stack.client(stack.new_key("e2e"))
    train = upload(client, toy_dir / "train.jsonl", "train.jsonl")
    val = upload(client, toy_dir / "val.jsonl", "val.jsonl")
    r = client.post("/reward_functions", json={"name": "last-letter", "spec": {"type": "python", "source": REWARD_SOURCE}})
    assert r.status_code == 200, r.text
    reward_id = r.json()["id"]

    r = client.post("/fine_tuning/jobs", json={
        "model": str(toy_dir / "model"), "training_file": train, "validation_file": val, "seed": 3,
        "method": {"type": "cispo", "cispo": {"reward_function": reward_id,
                                             "hyperparameters": hyperparameters(toy_dir)}}})
    assert r.status_code == 200, r.text
    job_id = r.json()["id"]
    assert r.json()["status"] == "queued"

    job = wait_for(lambda: client.get(f"/fine_tuning/jobs/{job_id}").json(), ("succeeded", "failed", "cancelled"))
    assert job["status"] == "succeeded", job["error"]
    assert job["steps_done"] == 4 and job["error"] is None and job["fine_tuned_model"]

    metrics = client.get(f"/fine_tuning/jobs/{job_id}/metrics", params={"name": "reward_mean"}).json()["data"]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert all(0.0 <= m["value"] <= 1.0 for m in metrics)
    events = client.get(f"/fine_tuning/jobs/{job_id}/events", params={"limit": 100}).json()["data"]
    messages = [e["message"] for e in events]
    assert messages[0].startswith("Job succeeded; reward ")  # newest first, with the verdict on the reward
    assert any(e["type"] == "metrics" and e["data"]["step"] == 4 for e in events)

    ckpts = client.get(f"/fine_tuning/jobs/{job_id}/checkpoints").json()
    assert [c["step_number"] for c in ckpts["data"]] == [4, 2]
    latest = ckpts["data"][0]
    archive = client.get(f"/fine_tuning/jobs/{job_id}/checkpoints/{latest['id']}/content")
    assert archive.status_code == 200
    assert hashlib.sha256(archive.content).hexdigest() == archive.headers["x-sha256"]

    out = stack.root / "adapter-download"
    with tarfile.open(fileobj=io.BytesIO(archive.content)) as tar:
        tar.extractall(out, filter="data")
    tok = AutoTokenizer.from_pretrained(toy_dir / "model")
    ids = torch.tensor([tok("abcd=")["input_ids"]])
    base = AutoModelForCausalLM.from_pretrained(toy_dir / "model")
    tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(toy_dir / "model"), out / "adapter")
    with torch.no_grad():
        assert not torch.allclose(base(ids).logits, tuned(ids).logits, atol=1e-5)

    single = client.get(f"/fine_tuning/jobs/{job_id}/checkpoints/{latest['id']}/files/adapter/adapter_config.json")
    assert single.status_code == 200
    assert hashlib.sha256(single.content).hexdigest() == single.headers["x-sha256"]


def test_the_openai_sdk_drives_a_job(stack, toy_dir):
    openai = pytest.importorskip("openai")
    key = stack.new_key("sdk")
    client = openai.OpenAI(base_url=f"{stack.base}/v1", api_key=key, max_retries=0)
    with (toy_dir / "train.jsonl").open("rb") as f:
        train = client.files.create(file=f, purpose="fine-tune")
    assert train.id.startswith("file-") and train.purpose == "fine-tune"

    # OpenAI's reinforcement method with a string_check grader, mapped onto CISPO
    job = client.fine_tuning.jobs.create(
        model=str(toy_dir / "model"), training_file=train.id, seed=1, suffix="sdk",
        method={"type": "reinforcement", "reinforcement": {
            "grader": {"type": "string_check", "name": "last letter", "input": "{{ sample.output_text }}",
                       "reference": "{{ item.answer }}", "operation": "eq"},
            "hyperparameters": {"batch_size": 4, "n_epochs": 1, "compute_multiplier": 0.5}}},
    )
    assert job.id.startswith("ftjob-") and job.status == "queued"
    assert client.fine_tuning.jobs.retrieve(job.id).id == job.id
    assert job.id in [j.id for j in client.fine_tuning.jobs.list(limit=10)]

    # the mapped job runs 2000 rows / batch 4 = 500 steps: cancel it once it is running
    wait_for(lambda: client.fine_tuning.jobs.retrieve(job.id).model_dump(), ("running",))
    deadline = time.time() + 120
    while client.fine_tuning.jobs.retrieve(job.id).model_dump().get("steps_done", 0) < 1:
        assert time.time() < deadline
        time.sleep(0.3)
    client.fine_tuning.jobs.cancel(job.id)
    final = wait_for(lambda: client.fine_tuning.jobs.retrieve(job.id).model_dump(), ("cancelled", "failed", "succeeded"))
    assert final["status"] == "cancelled"

    first_page = client.fine_tuning.jobs.list_events(job.id, limit=2)
    assert first_page.data[0].message == "Job cancelled" and first_page.has_more
    all_events = list(first_page)  # iterating a page follows the `after` cursors
    assert len(all_events) >= 4 and len({e.id for e in all_events}) == len(all_events)
    checkpoints = list(client.fine_tuning.jobs.checkpoints.list(job.id))
    assert checkpoints and checkpoints[0].step_number >= 1  # the stop wrote one

    with pytest.raises(openai.NotFoundError):
        client.fine_tuning.jobs.retrieve("ftjob-doesnotexist")
    with pytest.raises(openai.BadRequestError) as bad:
        client.fine_tuning.jobs.create(model=str(toy_dir / "model"), training_file="file-nope",
                                       method={"type": "reinforcement", "reinforcement": {
                                           "grader": {"type": "string_check", "name": "x", "input": "a",
                                                      "reference": "{{ item.answer }}", "operation": "eq"}}})
    assert "training_file" in str(bad.value)
