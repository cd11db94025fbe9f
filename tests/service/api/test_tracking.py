"""Experiment tracking end to end, without network: a job with `integrations` created through the API, run by the
real job runner on the tiny model, logs every step to W&B (offline: a run directory), to MLflow (a local file
store) and, as for every job, to a TensorBoard event file among its result files; a tracker that is missing or
breaks leaves an error event and the job succeeds."""

from __future__ import annotations

import json
import re
import struct
import sys

import pytest

from sqlalchemy import select

from service.db.models import Job
from service.settings import Settings
from tests.service.api.conftest import assert_error, running_api, uploaded
from worker.jobs.job_runner import run_job

STEPS = 3


def _body(toy_dir, training_file: str, integrations: list[dict]) -> dict:
    return {"model": str(toy_dir / "model"), "training_file": training_file, "seed": 3, "integrations": integrations,
            "method": {"type": "cispo", "cispo": {
                "reward": {"type": "exact_match", "field": "answer"},
                "hyperparameters": {
                    "lora": {"r": 4, "alpha": 8, "target_modules": "all-linear"},
                    "sampling": {"max_output_tokens": 4, "max_model_len": 64},
                    "training": {"steps": STEPS, "batch_size": 2, "group_size": 4, "mini_batches": 1,
                                 "micro_batch_size": 8, "eval_interval": 0, "eval_max_rows": 2,
                                 "checkpoint_interval": 0}}}}}


def _run(api, toy_dir, tmp_path, database_url, integrations: list[dict]) -> str:
    rows = [json.loads(line) for line in (toy_dir / "train.jsonl").read_text().splitlines()[:8]]
    r = api.client.post("/v1/fine_tuning/jobs", json=_body(toy_dir, uploaded(api.client, rows), integrations))
    assert r.status_code == 200, r.text
    job_id = r.json()["id"]
    settings = Settings(home=tmp_path / "worker", database_url=database_url, storage_url=str(tmp_path / "objects"),
                        heartbeat_s=0.2, lease_ttl_s=30, retry_backoff_s=0,
                        tracking_file_roots=str(tmp_path / "mlruns"))
    assert run_job(job_id, settings) == "succeeded"
    return job_id


def _api_metrics(api, job_id: str, name: str) -> dict[int, float]:
    data = api.client.get(f"/v1/fine_tuning/jobs/{job_id}/metrics", params={"name": name}).json()["data"]
    return {m["step"]: m["value"] for m in data}


def _events(api, job_id: str) -> list[dict]:
    return api.client.get(f"/v1/fine_tuning/jobs/{job_id}/events", params={"limit": 100}).json()["data"]


def _wandb_records(run_file) -> list[bytes]:
    """The records of a .wandb transaction log: a 7-byte header (":W&B", version), then LevelDB's log format
    (32 KiB blocks; per fragment crc32 (4), length (2 LE), type (1): full, first, middle, last)."""
    data, records, pending, pos = run_file.read_bytes(), [], b"", 7
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left_in_block = 32768 - pos % 32768
        if left_in_block < 7:  # the block's tail is padding
            pos += left_in_block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        fragment, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:  # zero padding
            continue
        pending += fragment
        if kind in (1, 4):
            records.append(pending)
            pending = b""
    return records


def _wandb_history(run_file) -> dict[int, dict[str, float]]:
    """The metrics rows an offline W&B run recorded, step -> {name: value}, parsed with wandb's own protobufs."""
    from wandb.proto import wandb_internal_pb2

    rows: dict[int, dict[str, float]] = {}
    for data in _wandb_records(run_file):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            step = record.history.step.num if record.history.HasField("step") else int(items["_step"])
            rows.setdefault(step, {}).update({k: v for k, v in items.items() if not k.startswith("_")})
    return rows


@pytest.mark.slow
def test_wandb_offline_mlflow_file_store_and_tensorboard_get_every_step(postgres_url, toy_dir, tmp_path,
                                                                        monkeypatch):
    pytest.importorskip("wandb", reason="the tracking extra")
    pytest.importorskip("mlflow", reason="the tracking extra")
    pytest.importorskip("tensorboard", reason="the tracking extra")
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "offline")  # no network: the run is a directory
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-root"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    store_uri = f"file:{tmp_path / 'mlruns' / 'store'}"
    integrations = [{"type": "wandb", "wandb": {"project": "cispo-test", "name": "toy", "tags": ["ci"]}},
                    {"type": "mlflow", "mlflow": {"tracking_uri": store_uri, "experiment": "toy"}}]
    with running_api(postgres_url, tmp_path, tracking_file_roots=str(tmp_path / "mlruns")) as api:
        job_id = _run(api, toy_dir, tmp_path, postgres_url, integrations)
        reward = _api_metrics(api, job_id, "reward_mean")
        eval_reward = _api_metrics(api, job_id, "eval_reward_mean")
        assert sorted(reward) == [1, 2, 3] and 0 in eval_reward
        events = _events(api, job_id)
        assert not [e for e in events if "integration" in e["message"] and e["level"] != "info"]
        # Where each run went, said once per tracker when it started.
        where = {e["data"]["integration"]: e["message"] for e in events if " integration logs to " in e["message"]}
        assert set(where) == {"wandb", "mlflow"} and f"W&B run {job_id}" in where["wandb"]
        assert "/toy' at " + store_uri in where["mlflow"] and "MLFLOW_ALLOW_FILE_STORE" in where["mlflow"]  # project/toy

        # W&B, offline: a run directory named after the job whose log holds each step's metrics.
        [run_dir] = (tmp_path / "wandb-root" / "wandb").glob(f"offline-run-*-{job_id}")
        history = _wandb_history(run_dir / f"run-{job_id}.wandb")
        assert {s: v["reward_mean"] for s, v in history.items() if "reward_mean" in v} == pytest.approx(reward)
        assert {s: v["eval_reward_mean"] for s, v in history.items() if "eval_reward_mean" in v} == \
            pytest.approx(eval_reward)

        # MLflow, a local file store: one finished run tagged with the job, the same series, in the experiment
        # of the job's project.
        with api.session() as s:
            project_id = s.scalar(select(Job.project_id).where(Job.id == job_id))
        client = MlflowClient(tracking_uri=store_uri)
        experiment = client.get_experiment_by_name(f"{project_id}/toy")
        [run] = client.search_runs([experiment.experiment_id], filter_string=f"tags.`cispo.job_id` = '{job_id}'")
        assert run.info.status == "FINISHED" and run.info.run_name == job_id and run.data.params["steps"] == "3"
        logged = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "reward_mean")}
        assert logged == pytest.approx(reward)

        # TensorBoard: the second result file, read by TensorBoard's own reader.
        job = api.client.get(f"/v1/fine_tuning/jobs/{job_id}").json()
        [csv_id, events_id] = job["result_files"]
        assert api.client.get(f"/v1/files/{events_id}").json()["purpose"] == "fine-tune-results"
        content = api.client.get(f"/v1/files/{events_id}/content")
        name = re.search(r'filename="([^"]+)"', content.headers["content-disposition"]).group(1)
        assert "tfevents" in name and job_id in name
        (tmp_path / "tb").mkdir()
        (tmp_path / "tb" / name).write_bytes(content.content)
        acc = EventAccumulator(str(tmp_path / "tb"))
        acc.Reload()
        assert {e.step: e.value for e in acc.Scalars("reward_mean")} == pytest.approx(reward, rel=1e-6)
        assert {e.step: e.value for e in acc.Scalars("eval_reward_mean")} == pytest.approx(eval_reward, rel=1e-6)


@pytest.mark.slow
def test_a_missing_or_broken_tracker_is_an_error_event_and_the_job_succeeds(postgres_url, toy_dir, tmp_path,
                                                                           monkeypatch):
    pytest.importorskip("mlflow", reason="the tracking extra")
    from worker.tracking import trackers

    monkeypatch.setitem(sys.modules, "wandb", None)  # as on a worker without the extra: the import fails

    def broken_log(self, step, metrics):
        raise ConnectionError("tracking server went away")

    monkeypatch.setattr(trackers.MlflowTracker, "log", broken_log)
    integrations = [{"type": "wandb", "wandb": {"project": "p"}},
                    {"type": "mlflow", "mlflow": {"tracking_uri": f"file:{tmp_path / 'mlruns'}"}}]
    with running_api(postgres_url, tmp_path, tracking_file_roots=str(tmp_path / "mlruns")) as api:
        job_id = _run(api, toy_dir, tmp_path, postgres_url, integrations)
        errors = [e for e in _events(api, job_id) if e["level"] == "error"]
        by_tracker = {e["data"]["integration"]: e["message"] for e in errors}
        assert set(by_tracker) == {"wandb", "mlflow"} and len(errors) == 2  # each switched off once
        assert "wandb package is not installed" in by_tracker["wandb"] and "cispo-service[tracking]" in \
            by_tracker["wandb"]
        assert "failed at step" in by_tracker["mlflow"] and "ConnectionError" in by_tracker["mlflow"]
        assert "went away" not in by_tracker["mlflow"]  # a library's text stays in the worker's log
        assert "goes on without it" in by_tracker["mlflow"]
        assert api.client.get(f"/v1/fine_tuning/jobs/{job_id}").json()["status"] == "succeeded"


def test_a_wandb_entity_the_operator_does_not_list_is_refused_at_creation(database_url, toy_dir, tmp_path):
    rows = [json.loads(line) for line in (toy_dir / "train.jsonl").read_text().splitlines()[:8]]
    with running_api(database_url, tmp_path, wandb_entities="team-a, team-b") as api:
        training_file = uploaded(api.client, rows)
        body = _body(toy_dir, training_file, [{"type": "wandb", "wandb": {"project": "p", "entity": "team-c"}}])
        r = api.client.post("/v1/fine_tuning/jobs", json=body)
        error = assert_error(r, 400, "'team-c' is not a W&B entity this service logs to (team-a, team-b)")
        assert error["param"] == "integrations[0].wandb.entity"
        body = _body(toy_dir, training_file, [{"type": "wandb", "wandb": {"project": "p", "entity": "team-b"}}])
        assert api.client.post("/v1/fine_tuning/jobs", json=body).status_code == 200
