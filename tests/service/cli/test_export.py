"""A merged full-weight export, as a user gets it: a job asks for `training.export: merged` through a real uvicorn
API (PostgreSQL), the real job runner trains the tiny model and merges each checkpoint in the worker, and
`cispo jobs export --merge` (a separate process, HTTP only) saves a directory that from_pretrained loads alone,
with the same logits as the base model plus the adapter (`cispo jobs export` without --merge)."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from safetensors.torch import load_file

from service.settings import Settings
from tests.service.api.live_server import live_api
from tests.service.cli.test_cli_jobs import cispo
from worker.jobs.job_runner import run_job

STEPS = 2


def _body(toy_dir, train: str, **training) -> dict:
    return {"model": str(toy_dir / "model"), "training_file": train, "seed": 3, "method": {"type": "cispo", "cispo": {
        "reward": {"type": "exact_match", "field": "answer"}, "hyperparameters": {
            "lora": {"r": 4, "alpha": 8, "target_modules": "all-linear"},
            "optimizer": {"lr": 3e-2},
            "sampling": {"temperature": 1.0, "max_output_tokens": 4, "max_model_len": 32},
            "training": {"steps": STEPS, "batch_size": 4, "group_size": 4, "micro_batch_size": 16,
                         "mini_batches": 1, "eval_interval": 0, "eval_max_rows": 4, "checkpoint_interval": 0,
                         "preflight_groups": 0, **training}}}}}


@pytest.fixture
def live(tmp_path, toy_dir):
    with live_api(tmp_path, CISPO_MODEL_DIRS=str(toy_dir.parent)) as api:
        yield api


def _run(live, tmp_path, toy_dir, client: httpx.Client, train: str, **training) -> str:
    r = client.post("/v1/fine_tuning/jobs", json=_body(toy_dir, train, **training))
    assert r.status_code == 200, r.text
    job_id = r.json()["id"]
    settings = Settings(home=tmp_path / "worker", database_url=live.database_url,
                        storage_url=live.env["STORAGE_URL"], heartbeat_s=0.2, lease_ttl_s=30, retry_backoff_s=0)
    assert run_job(job_id, settings) == "succeeded", client.get(f"/v1/fine_tuning/jobs/{job_id}").json()["error"]
    return job_id


@pytest.mark.slow
def test_a_merged_export_loads_alone_and_gives_the_adapters_logits(live, tmp_path, toy_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    client = httpx.Client(base_url=live.base, headers={"Authorization": f"Bearer {live.key}"}, timeout=60)
    r = client.post("/v1/files", files={"file": ("train.jsonl", (toy_dir / "train.jsonl").read_bytes())},
                    data={"purpose": "fine-tune"})
    train = r.json()["id"]
    job_id = _run(live, tmp_path, toy_dir, client, train, export="merged")
    [ckpt] = client.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints").json()["data"]
    assert ckpt["merged_model"] is True and ckpt["step_number"] == STEPS

    merged_dir, adapter_dir = tmp_path / "merged", tmp_path / "adapter"
    done = cispo(live, "export", job_id, "--merge", "-o", str(merged_dir))
    assert done.returncode == 0, done.stderr
    assert "from_pretrained" in done.stdout
    done = cispo(live, "export", job_id, "--checkpoint", ckpt["id"], "-o", str(adapter_dir))
    assert done.returncode == 0, done.stderr
    # An export never overwrites: the directory now holds a model.
    again = cispo(live, "export", job_id, "--merge", "-o", str(merged_dir))
    assert again.returncode == 2 and "not empty" in again.stderr

    # The merged directory: plain weights (no LoRA tensors), config, tokenizer, a manifest of sha256s.
    names = {p.name for p in merged_dir.iterdir()}
    assert {"config.json", "model.safetensors", "manifest.json", "tokenizer_config.json"} <= names
    assert not any("lora" in k for k in load_file(merged_dir / "model.safetensors"))
    manifest = json.loads((merged_dir / "manifest.json").read_text())
    assert "model.safetensors" in manifest["files"] and manifest["dtype"] == "float32"

    tokenizer = AutoTokenizer.from_pretrained(merged_dir)
    prompts = [json.loads(line)["prompt"] for line in (toy_dir / "val.jsonl").read_text().splitlines()[:3]]
    ids = tokenizer(prompts, return_tensors="pt", padding=True)
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    base = AutoModelForCausalLM.from_pretrained(toy_dir / "model").eval()
    with torch.no_grad():
        plain = base(**ids).logits
        adapted = PeftModel.from_pretrained(base, adapter_dir).eval()(**ids).logits
        alone = merged(**ids).logits
    assert (adapted - plain).abs().max() > 1e-3  # the adapter trained: a base-only export would fail below
    torch.testing.assert_close(alone, adapted, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_without_export_merged_the_download_is_a_404_naming_the_option(live, tmp_path, toy_dir):
    client = httpx.Client(base_url=live.base, headers={"Authorization": f"Bearer {live.key}"}, timeout=60)
    r = client.post("/v1/files", files={"file": ("train.jsonl", (toy_dir / "train.jsonl").read_bytes())},
                    data={"purpose": "fine-tune"})
    job_id = _run(live, tmp_path, toy_dir, client, r.json()["id"], steps=1)
    [ckpt] = client.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints").json()["data"]
    assert ckpt["merged_model"] is False
    r = client.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints/{ckpt['id']}/merged")
    assert r.status_code == 404 and "training.export" in r.json()["error"]["message"]
    done = cispo(live, "export", job_id, "--merge", "-o", str(tmp_path / "out"))
    assert done.returncode == 3 and "training.export" in done.stderr
    assert not (tmp_path / "out").exists()
