"""Continuing a finished job through the HTTP API, run by the real job runner (no Celery: the API's enqueue is
recorded and each id is handed to worker.jobs.job_runner.run_job, on PostgreSQL and a local object store).

A fine-tuned model (`ft:...`), a checkpoint's name (`...:ckpt-step-N`) or a checkpoint id (`ftckpt_...`) named
as `model` starts the new job from that checkpoint's weights, with the reference pinned to them; another
project's are 404s; a downloaded checkpoint is a complete directory that `init_from` loads.
"""

from __future__ import annotations

import io
import tarfile

import pytest
from safetensors.torch import load_file

from service.job_spec.spec import JobSpec
from tests.service.api.conftest import assert_error, running_api, upload
from worker.checkpoints.checkpoint import load_checkpoint
from worker.jobs.job_runner import run_job

JOBS = "/v1/fine_tuning/jobs"


def _hyperparameters(**training) -> dict:
    return {
        "sampling": {"temperature": 1.0, "max_output_tokens": 4, "max_model_len": 32},
        "optimizer": {"lr": 3e-3},
        "loss": {"kl_beta": 0.1},
        "training": {"steps": 2, "batch_size": 4, "group_size": 4, "micro_batch_size": 16, "mini_batches": 1,
                     "eval_interval": 0, "eval_max_rows": 8, "checkpoint_interval": 0, **training},
    }


def _body(model: str, train: str, hyperparameters: dict) -> dict:
    return {"model": model, "training_file": train, "seed": 3, "method": {"type": "cispo", "cispo": {
        "reward": {"type": "exact_match", "field": "answer"}, "hyperparameters": hyperparameters}}}


def _run(api, settings, body: dict) -> dict:
    r = api.client.post(JOBS, json=body)
    assert r.status_code == 200, r.text
    job_id = r.json()["id"]
    assert api.enqueued.ids[-1] == job_id
    assert run_job(job_id, settings) == "succeeded", api.client.get(f"{JOBS}/{job_id}").json()["error"]
    return api.client.get(f"{JOBS}/{job_id}").json()


def _metric(api, job_id: str, name: str) -> dict[int, float]:
    data = api.client.get(f"{JOBS}/{job_id}/metrics", params={"name": name}).json()["data"]
    return {m["step"]: m["value"] for m in data}


def _download(api, job_id: str, tmp_path, name: str):
    """The job's newest checkpoint, downloaded and unpacked: (checkpoint object, directory)."""
    ckpt = api.client.get(f"{JOBS}/{job_id}/checkpoints").json()["data"][0]
    r = api.client.get(f"{JOBS}/{job_id}/checkpoints/{ckpt['id']}/content")
    assert r.status_code == 200
    dest = tmp_path / name
    with tarfile.open(fileobj=io.BytesIO(r.content)) as tar:
        tar.extractall(dest, filter="data")
    return ckpt, dest


def test_a_fine_tuned_model_trains_on_through_the_api(postgres_url, toy_dir, tmp_path):
    with running_api(postgres_url, tmp_path, heartbeat_s=0.2, lease_ttl_s=30, retry_backoff_s=0) as api:
        settings = api.app.state.settings
        train = upload(api.client, content=(toy_dir / "train.jsonl").read_bytes()).json()["id"]
        lora = {"r": 8, "alpha": 16, "target_modules": "all-linear"}
        source = _run(api, settings, _body(str(toy_dir / "model"), train, {**_hyperparameters(), "lora": lora}))
        model = source["fine_tuned_model"]
        source_ckpt, source_dir = _download(api, source["id"], tmp_path, "source")

        # The download is a whole checkpoint: the manifest, the trainer state, the adapter; it loads as init_from.
        assert {"manifest.json", "trainer_state.json", "trainer_state.safetensors",
                "adapter/adapter_model.safetensors", "adapter/adapter_config.json"} <= {
            p.relative_to(source_dir).as_posix() for p in source_dir.rglob("*") if p.is_file()}
        assert load_checkpoint(source_dir).adapter_dir == source_dir / "adapter"

        # A dry run resolves it too: the base model is checked, the spec starts from the final checkpoint.
        dry = api.client.post(JOBS, params={"dry_run": "true"}, json=_body(model, train, _hyperparameters(steps=1)))
        assert dry.status_code == 200, dry.text
        assert dry.json()["spec"]["init_from"] == source_ckpt["id"]

        # Continued from the fine-tuned model (lora left out: the source's adapter shape is kept).
        continued = _run(api, settings, _body(model, train, _hyperparameters(steps=1)))
        assert continued["model"] == model
        assert continued["fine_tuned_model"] == f"ft:{toy_dir / 'model'}:alpha::{continued['id']}"
        with api.session() as s:
            from service.repositories import jobs as jobs_repo

            spec = JobSpec.model_validate(jobs_repo.get_for_worker(s, continued["id"]).spec)
        assert spec.init_from == source_ckpt["id"] and spec.model == str(toy_dir / "model")
        assert spec.lora.r == 8 and spec.lora.target_modules == "all-linear"

        # The reference is the starting policy: at step 1 (one optimizer step, measured before it) KL is exactly 0,
        # and the continued job's checkpoint pins the source's final adapter, bit for bit, as its reference.
        assert _metric(api, continued["id"], "kl_ref") == {1: 0.0}
        _, continued_dir = _download(api, continued["id"], tmp_path, "continued")
        pinned = load_file(continued_dir / "reference" / "adapter_model.safetensors")
        trained = load_file(source_dir / "adapter" / "adapter_model.safetensors")
        assert pinned.keys() == trained.keys() and any(v.abs().max() > 0 for k, v in trained.items() if "lora_B" in k)
        assert all((pinned[k] == trained[k]).all() for k in trained)
        # Greedy evaluation at step 0 is the source's final policy's.
        assert _metric(api, continued["id"], "eval_reward_mean")[0] == _metric(api, source["id"],
                                                                                "eval_reward_mean")[2]

        # A checkpoint's name or id starts from that checkpoint (created, not run here).
        for named in (source_ckpt["fine_tuned_model_checkpoint"], source_ckpt["id"]):
            r = api.client.post(JOBS, json=_body(named, train, _hyperparameters(steps=1)))
            assert r.status_code == 200, r.text
            with api.session() as s:
                assert jobs_repo.get_for_worker(s, r.json()["id"]).spec["init_from"] == source_ckpt["id"]

        # Another adapter shape cannot continue this one; another project cannot see it at all.
        other_lora = {**_hyperparameters(steps=1), "lora": {"r": 4}}
        error = assert_error(api.client.post(JOBS, json=_body(model, train, other_lora)), 400, "lora")
        assert error["param"] == "method.cispo.hyperparameters.lora"
        theirs = upload(api.other, content=(toy_dir / "train.jsonl").read_bytes()).json()["id"]
        for named in (model, source_ckpt["id"], source_ckpt["fine_tuned_model_checkpoint"],
                      model.replace(":alpha:", ":beta:")):
            error = assert_error(api.other.post(JOBS, json=_body(named, theirs, _hyperparameters())), 404, "model")
            assert error["param"] == "model" and error["code"] == "model_not_found"


@pytest.mark.parametrize("named", ["ft:nope", "ftckpt_nope"])
def test_an_unknown_fine_tuned_model_is_a_404_naming_model(postgres_url, tmp_path, named):
    with running_api(postgres_url, tmp_path) as api:
        train = upload(api.client).json()["id"]
        error = assert_error(api.client.post(JOBS, json=_body(named, train, _hyperparameters())), 404, named)
        assert error["param"] == "model"
