"""Supervised warm start, then CISPO, then eval runs: through the HTTP API, run by the real job runner and
the real eval runner (worker/jobs/eval_runner.py) on PostgreSQL and a local object store; `cispo jobs eval`
as a separate process against a real uvicorn server.

An SFT job (`method.type: supervised`, OpenAI's chat rows with an assistant turn) trains the toy model; a
CISPO job names its fine-tuned model and continues from its weights; eval runs score the CISPO model and
the base on a file, with the mean's 95% interval and a per-row results file.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

from service.repositories import jobs as jobs_repo
from service.job_spec.spec import JobSpec
from tests.service.api.conftest import assert_error, jsonl, running_api, upload
from tests.service.api.uvicorn_thread import serving
from worker.evals.intervals import wilson
from worker.jobs.eval_runner import run_eval
from worker.jobs.job_runner import run_job

JOBS = "/v1/fine_tuning/jobs"
REWARD = {"type": "exact_match", "field": "answer"}
SAMPLING = {"temperature": 1.0, "max_output_tokens": 4, "max_model_len": 32}
ROWS = 48


def _rows(toy_dir) -> list[dict]:
    return [json.loads(line) for line in (toy_dir / "train.jsonl").read_text().splitlines()[:ROWS]]


def _sft_body(model: str, file_id: str) -> dict:
    return {"model": model, "training_file": file_id, "seed": 3, "method": {"type": "supervised", "supervised": {
        "reward": REWARD, "hyperparameters": {
            "n_epochs": 1, "batch_size": 16, "learning_rate_multiplier": 300,
            "lora": {"r": 8, "alpha": 16, "target_modules": "all-linear"}, "sampling": SAMPLING,
            "training": {"eval_max_rows": 8, "checkpoint_interval": 0, "micro_batch_size": 16}}}}}


def _cispo_body(model: str, file_id: str) -> dict:
    return {"model": model, "training_file": file_id, "seed": 3, "method": {"type": "cispo", "cispo": {
        "reward": REWARD, "hyperparameters": {
            "sampling": SAMPLING, "optimizer": {"lr": 3e-3},
            "training": {"steps": 1, "batch_size": 4, "group_size": 4, "micro_batch_size": 16, "mini_batches": 1,
                         "eval_max_rows": 8, "checkpoint_interval": 0}}}}}


def _run(api, settings, body: dict) -> dict:
    r = api.client.post(JOBS, json=body)
    assert r.status_code == 200, r.text
    job_id = r.json()["id"]
    assert run_job(job_id, settings) == "succeeded", api.client.get(f"{JOBS}/{job_id}").json()["error"]
    return api.client.get(f"{JOBS}/{job_id}").json()


def _metric(api, job_id: str, name: str) -> dict[int, float]:
    data = api.client.get(f"{JOBS}/{job_id}/metrics", params={"name": name}).json()["data"]
    return {m["step"]: m["value"] for m in data}


def _evaluate(api, settings, body: dict) -> dict:
    r = api.client.post("/v1/evals", json=body)
    assert r.status_code == 200, r.text
    run = r.json()
    assert run["object"] == "eval.run" and run["status"] == "queued" and run["result"] is None
    assert run_eval(run["id"], settings) == "succeeded"
    assert run_eval(run["id"], settings) is None  # a duplicate message finds it taken
    done = api.client.get(f"/v1/evals/{run['id']}").json()
    assert done["status"] == "succeeded", done["error"]
    return done


def _per_row(api, run: dict) -> list[dict]:
    (file_id,) = run["result_files"]
    r = api.client.get(f"/v1/files/{file_id}/content")
    assert r.status_code == 200
    return [json.loads(line) for line in r.text.splitlines()]


def test_sft_then_cispo_from_its_model_then_eval_runs(postgres_url, toy_dir, tmp_path):
    rows = _rows(toy_dir)
    chats = [{"messages": [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["answer"]}],
              "answer": r["answer"]} for r in rows]
    prompts = [{"messages": c["messages"][:1], "answer": c["answer"]} for c in chats]
    base = str(toy_dir / "model")
    with running_api(postgres_url, tmp_path, heartbeat_s=0.2, lease_ttl_s=30, retry_backoff_s=0) as api:
        settings = api.app.state.settings
        sft_file = upload(api.client, content=jsonl(chats)).json()["id"]  # an upload may hold SFT rows
        prompt_file = upload(api.client, content=jsonl(prompts)).json()["id"]

        # Each method checks the rows it reads, naming the file, the line and the field.
        error = assert_error(api.client.post(JOBS, json=_sft_body(base, prompt_file)), 400, "training_file line 1",
                             "'messages' has no assistant message")
        assert error["param"] == "training_file"
        assert_error(api.client.post(JOBS, json=_cispo_body(base, sft_file)), 400, "training_file line 1",
                     "'messages' ends with an assistant message")

        sft = _run(api, settings, _sft_body(base, sft_file))
        with api.session() as s:
            spec = JobSpec.model_validate(jobs_repo.get_for_worker(s, sft["id"]).spec)
        assert spec.method == "supervised" and spec.training.steps == ROWS // 16
        losses = _metric(api, sft["id"], "loss")
        assert sorted(losses) == [1, 2, 3]
        eval_loss = _metric(api, sft["id"], "eval_loss")
        assert eval_loss[3] < eval_loss[0]  # it learned the assistant turns
        (ckpt,) = api.client.get(f"{JOBS}/{sft['id']}/checkpoints").json()["data"]
        assert ckpt["eval"]["loss"] == pytest.approx(eval_loss[3])
        assert ckpt["eval"]["n"] == 8 and len(ckpt["eval"]["interval"]) == 2
        assert ckpt["eval"]["difference_to_baseline"]["mean"] == pytest.approx(
            _metric(api, sft["id"], "eval_reward_mean")[3] - _metric(api, sft["id"], "eval_reward_mean")[0])

        # CISPO continues the SFT model: it starts from the SFT checkpoint, and its step-0 eval (the same eight
        # prompts, greedy) is the SFT model's final one.
        cispo = _run(api, settings, _cispo_body(sft["fine_tuned_model"], prompt_file))
        with api.session() as s:
            assert jobs_repo.get_for_worker(s, cispo["id"]).spec["init_from"] == ckpt["id"]
        cispo_eval = _metric(api, cispo["id"], "eval_reward_mean")
        assert cispo_eval[0] == _metric(api, sft["id"], "eval_reward_mean")[3]
        assert _metric(api, cispo["id"], "eval_reward_diff")[0] == 0.0  # the baseline against itself

        # Eval runs: the CISPO model with its job's reward, in the same harness as its evals.
        tuned = _evaluate(api, settings, {"model": cispo["fine_tuned_model"], "file": prompt_file, "max_rows": 8})
        result = tuned["result"]
        assert result["n"] == 8 and result["mean"] == pytest.approx(cispo_eval[1])
        assert result["method"] == "wilson"
        assert result["interval"] == pytest.approx(list(wilson(round(result["mean"] * 8), 8)))
        per_row = _per_row(api, tuned)
        assert [r["row"] for r in per_row] == list(range(8))
        assert all(set(r) == {"row", "prompt", "completion", "reward"} for r in per_row)
        assert per_row[0]["prompt"].startswith("user: " + rows[0]["prompt"])
        assert sum(r["reward"] for r in per_row) / 8 == pytest.approx(result["mean"])
        # The base model, with a reward given: the SFT job's baseline (its step-0 eval on the same prompts).
        plain = _evaluate(api, settings, {"model": base, "file": prompt_file, "max_rows": 8, "reward": REWARD})
        assert plain["checkpoint_id"] is None
        assert plain["result"]["mean"] == pytest.approx(_metric(api, sft["id"], "eval_reward_mean")[0])
        listed = api.client.get("/v1/evals").json()["data"]
        assert [r["id"] for r in listed] == [plain["id"], tuned["id"]]

        # Bad requests name the field; another project sees none of it.
        assert_error(api.client.post("/v1/evals", json={"model": base, "file": prompt_file}), 400, "reward")
        assert_error(api.client.post("/v1/evals", json={"model": base, "file": sft_file, "reward": REWARD}), 400,
                     "file line 1", "ends with an assistant message")
        assert_error(api.client.post("/v1/evals", json={"model": base, "file": "file-nope", "reward": REWARD}),
                     400, "file")
        assert_error(api.other.get(f"/v1/evals/{tuned['id']}"), 404, "eval")
        theirs = upload(api.other, content=jsonl(prompts)).json()["id"]
        assert_error(api.other.post("/v1/evals", json={"model": cispo["fine_tuned_model"], "file": theirs}), 404,
                     "model")

        # `cispo jobs eval` waits for a worker and prints the mean with its interval.
        key = api.client.headers["Authorization"].split()[1]
        with serving(api.app) as url:
            worker = threading.Thread(target=_run_queued_evals, args=(api, settings), daemon=True)
            worker.start()
            cli = subprocess.run(
                [sys.executable, "-m", "worker.cli", "jobs", "eval", cispo["id"], "--file", prompt_file,
                 "--max-rows", "8", "--interval", "0.2", "--api-url", url, "--api-key", key],
                capture_output=True, text=True, timeout=600)
        assert cli.returncode == 0, cli.stderr
        low, high = result["interval"]
        assert f"mean reward {result['mean']:.4f}" in cli.stdout and f"[{low:.4f}, {high:.4f}]" in cli.stdout
        assert "queued" in cli.stderr and "per-row results: file-" in cli.stdout


def _run_queued_evals(api, settings, timeout_s: float = 600) -> None:
    """The worker's part, for the CLI: run the first queued eval run that appears."""
    from sqlalchemy import select

    from service.db.models import EvalRun

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with api.session() as s:
            queued = s.scalar(select(EvalRun.id).where(EvalRun.status == "queued"))
        if queued:
            run_eval(queued, settings)
            return
        time.sleep(0.1)
