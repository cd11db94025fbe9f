"""What a finished job shows its owner, end to end: API -> real worker run -> API.

A job on OpenAI chat rows (and our prompt rows) with a multi reward runs on the tiny model; the API then
serves its sample completions, its result file (the metrics CSV) and, while it ran, its estimated finish.
"""

from __future__ import annotations

import time

import csv
import io
import json

import pytest
from sqlalchemy import select, update

from service.db.models import Job, JobMetric
from service.repositories.job_outputs import parse_sample_id, sample_id
from tests.service.api.conftest import assert_error, created_job, running_api, uploaded
from worker.jobs.job_runner import run_job
from worker.jobs.progress import StepClock
from tests.worker.jobs.test_job_runner import make_settings as worker_settings
from worker.trainer.samples import pick_indices

STEPS, GROUP = 3, 4


def _rows(toy_dir, n=12) -> list[dict]:
    rows = [json.loads(line) for line in (toy_dir / "train.jsonl").read_text().splitlines()[:n]]
    # Half in OpenAI's chat shape, half in ours: both train.
    return [{"messages": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} if i % 2 else r
            for i, r in enumerate(rows)]


def _body(toy_dir, training_file: str) -> dict:
    return {
        "model": str(toy_dir / "model"), "training_file": training_file, "seed": 3,
        "method": {"type": "cispo", "cispo": {
            "reward": {"type": "multi", "rewards": {"exact": {"type": "exact_match", "field": "answer"},
                                                    "has": {"type": "contains", "field": "answer"}}},
            "hyperparameters": {
                "lora": {"r": 4, "alpha": 8, "target_modules": "all-linear"},
                "sampling": {"max_output_tokens": 4, "max_model_len": 64},
                "training": {"steps": STEPS, "batch_size": 2, "group_size": GROUP, "mini_batches": 1,
                             "micro_batch_size": 8, "eval_interval": 0, "eval_max_rows": 2,
                             "checkpoint_interval": 0}}}},
    }


@pytest.fixture
def finished(database_url, toy_dir, tmp_path):
    """(api, job id) of a job the worker ran to success."""
    with running_api(database_url, tmp_path) as api:
        r = api.client.post("/v1/fine_tuning/jobs", json=_body(toy_dir, uploaded(api.client, _rows(toy_dir))))
        assert r.status_code == 200, r.text
        job_id = r.json()["id"]
        assert run_job(job_id, worker_settings(tmp_path, database_url)) == "succeeded"
        yield api, job_id


@pytest.mark.slow
def test_samples_results_and_estimated_finish_of_a_finished_job(finished):
    api, job_id = finished
    job = api.client.get(f"/v1/fine_tuning/jobs/{job_id}").json()
    assert job["status"] == "succeeded"
    assert job["estimated_finish"] is None  # shown only while running
    with api.session() as s:
        row = s.scalar(select(Job).where(Job.id == job_id))
        assert row.estimated_finish is not None and row.estimated_finish <= row.finished_at + 5
        metrics = list(s.scalars(select(JobMetric).where(JobMetric.job_id == job_id)))

    # the result files: a CSV of every metric, one line per step, downloadable like any file; then the same
    # metrics as a TensorBoard event file (read back in tests/service/api/test_tracking.py)
    [file_id, events_id] = job["result_files"]
    events = api.client.get(f"/v1/files/{events_id}/content")
    assert events.status_code == 200 and f'filename="events.out.tfevents.' in events.headers["content-disposition"]
    meta = api.client.get(f"/v1/files/{file_id}").json()
    assert meta["purpose"] == "fine-tune-results"
    content = api.client.get(f"/v1/files/{file_id}/content")
    assert content.status_code == 200 and int(content.headers["content-length"]) == meta["bytes"]
    assert content.headers["content-disposition"] == f'attachment; filename="{file_id}.csv"'
    table = list(csv.DictReader(io.StringIO(content.text)))
    assert [int(line["step"]) for line in table] == [0, 1, 2, 3]  # the step-0 evaluation, then each step
    assert set(table[0]) == {"step", *{m.name for m in metrics}}
    for m in metrics:
        assert float(table[m.step][m.name]) == m.value
    # a results file is not a dataset
    body = _body_for(api, file_id)
    assert_error(api.client.post("/v1/fine_tuning/jobs", json=body), 400, "training_file", "fine-tune-results")
    assert api.other.get(f"/v1/files/{file_id}").status_code == 404  # another project's

    # samples: newest step first, at most 16 per step, with the multi reward's parts
    r = api.client.get(f"/v1/fine_tuning/jobs/{job_id}/samples", params={"limit": 100})
    assert r.status_code == 200, r.text
    page = r.json()
    assert page["object"] == "list" and page["has_more"] is False
    data = page["data"]
    assert [d["step"] for d in data] == sorted((d["step"] for d in data), reverse=True)
    assert {d["step"] for d in data} == {1, 2, 3}
    for d in data:
        assert set(d) == {"object", "id", "step", "prompt", "completion", "reward", "advantage", "rewards",
                          "created_at"}
        assert d["object"] == "fine_tuning.job.sample" and set(d["rewards"]) == {"exact", "has"}
        assert d["reward"] == pytest.approx(d["rewards"]["exact"] + d["rewards"]["has"])
        assert "=" in d["prompt"]  # the toy prompt, as the model saw it
    per_step = {s: [d for d in data if d["step"] == s] for s in (1, 2, 3)}
    for samples in per_step.values():  # each group's best then worst (one when all score the same), up to 8 groups;
        assert 1 <= len(samples) <= 16  # which rows are picked is tested in tests/worker/trainer/test_samples.py

    # paging with after and filtering by step
    first = api.client.get(f"/v1/fine_tuning/jobs/{job_id}/samples", params={"limit": 2}).json()
    assert first["has_more"] is True and first["data"] == data[:2]
    rest = api.client.get(f"/v1/fine_tuning/jobs/{job_id}/samples",
                          params={"limit": 100, "after": first["data"][-1]["id"]}).json()
    assert first["data"] + rest["data"] == data
    only = api.client.get(f"/v1/fine_tuning/jobs/{job_id}/samples", params={"step": 2}).json()["data"]
    assert only == per_step[2]
    assert_error(api.client.get(f"/v1/fine_tuning/jobs/{job_id}/samples", params={"after": "nope"}), 400, "after")
    assert api.other.get(f"/v1/fine_tuning/jobs/{job_id}/samples").status_code == 404


def _body_for(api, file_id: str) -> dict:
    return {"model": "m", "training_file": file_id, "method": {"type": "cispo", "cispo": {
        "reward": {"type": "exact_match"}}}}


def test_pick_indices_takes_each_groups_best_then_worst():
    rewards = [0.0, 1.0, 0.5, 0.5,   # group 0: best 1, worst 0
               2.0, 2.0, 2.0, 2.0,   # group 1: all equal, one sample
               0.0, 3.0, 0.0, 0.0]   # group 2
    assert pick_indices(rewards, 4, groups=10) == [1, 0, 4, 9, 8]
    assert pick_indices(rewards, 4, groups=2) == [1, 0, 4]  # the first two groups


def test_step_clock_uses_wall_time_between_steps():
    clock = StepClock(total_steps=10)
    assert clock.estimate(1000.0, 1, step_seconds=2.0) == 1000 + 9 * 2  # one step seen: its own duration
    assert clock.estimate(1030.0, 4, step_seconds=2.0) == 1030 + 6 * 10  # 30 s for 3 steps (evals included)
    assert clock.estimate(1090.0, 10, step_seconds=2.0) == 1090


def test_sample_ids_round_trip():
    class Row:
        step, slot = 12, 3
    assert parse_sample_id(sample_id(Row())) == (12, 3)
    for bad in ("ftsample-1", "ftsample-a-1", "file-1-2", "ftsample--1-2"):
        with pytest.raises(ValueError):
            parse_sample_id(bad)


def test_estimated_finish_is_shown_only_while_the_job_runs(api):
    job_id = created_job(api)["id"]
    with api.session() as s:  # as the worker leaves it after a step
        s.execute(update(Job).where(Job.id == job_id).values(status="running", estimated_finish=2_000_000_000))
        s.commit()
    assert api.client.get(f"/v1/fine_tuning/jobs/{job_id}").json()["estimated_finish"] == 2_000_000_000
    with api.session() as s:
        s.execute(update(Job).where(Job.id == job_id).values(status="cancelled"))
        s.commit()
    time.sleep(api.app.state.settings.poll_cache_s + 0.1)  # a worker's write shows once the poll cache expires
    job = api.client.get(f"/v1/fine_tuning/jobs/{job_id}").json()
    assert job["estimated_finish"] is None and job["result_files"] == []
