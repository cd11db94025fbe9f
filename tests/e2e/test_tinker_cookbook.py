"""The Tinker SDK and tinker-cookbook, unmodified, against `cispo up`: the cookbook's math_rl recipe (arithmetic)
trains a LoRA on the toy base through /api/v1, saves and resumes, with the sampler's and the trainer's
log-probs in agreement; two projects' recipes at once share one resident base and not their checkpoints."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_service_flow import upload
from tests.e2e.up import Up

pytest.importorskip("tinker_cookbook.recipes.math_rl.train")
tinker = pytest.importorskip("tinker")


def start_recipe(up: Up, key: str, model: Path, log_path: Path, *, loss_fn: str, resume: bool = False,
                 max_steps: int = 3) -> subprocess.Popen:
    env = {**up.env, "TINKER_API_KEY": f"tml-{key}", "TINKER_TELEMETRY": "0", "HF_HUB_OFFLINE": "1"}
    args = [f"base_url=http://127.0.0.1:{up.port}", f"model_name={model}", "renderer_name=role_colon",
            "env=arithmetic", f"loss_fn={loss_fn}", "lora_rank=8", "group_size=4", "groups_per_batch=4",
            "max_tokens=5", f"max_steps={max_steps}", "eval_every=0", "save_every=2", f"log_path={log_path}",
            f"behavior_if_log_dir_exists={'resume' if resume else 'delete'}"]
    return subprocess.Popen([sys.executable, "-m", "tinker_cookbook.recipes.math_rl.train", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finished(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    try:
        out, err = proc.communicate(timeout=900)
    finally:
        proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def recipe(*args, **kwargs) -> subprocess.CompletedProcess:
    return finished(start_recipe(*args, **kwargs))


def steps(log_path: Path) -> list[dict]:
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines() if line.strip()]


def checkpoints(log_path: Path) -> list[dict]:
    return [json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines() if line.strip()]


def check_run(run: subprocess.CompletedProcess, log_path: Path, n_steps: int) -> list[dict]:
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    rows = [r for r in steps(log_path) if "optim/kl_sample_train_v1" in r]
    assert len(rows) >= n_steps, rows
    for row in rows:
        assert all(math.isfinite(v) for v in row.values() if isinstance(v, float)), row
        # the sampler's log-probs are the trainer's: the engine samples and scores with one model
        assert abs(row["optim/kl_sample_train_v1"]) < 1e-3, row
    final = [c for c in checkpoints(log_path) if c.get("name") == "final"]
    assert final and final[-1]["state_path"].startswith("tinker://") and "/weights/final" in final[-1]["state_path"]
    assert "/sampler_weights/final" in final[-1]["sampler_path"]
    return rows


def trim_final(log_path: Path) -> None:
    """Forget the final checkpoint, as a run killed before its end would never have written it."""
    kept = [c for c in checkpoints(log_path) if c.get("name") != "final"]
    (log_path / "checkpoints.jsonl").write_text("".join(json.dumps(c) + "\n" for c in kept))


def tinker_models(http) -> dict[str, list[dict]]:
    """The project's Tinker-trained fine-tuned models: {model id: its checkpoints}."""
    out = {}
    for model in http.get("/models").json()["data"]:
        if ":tinker:" in model["id"]:
            job_id = model["id"].rsplit(":", 1)[-1]
            job = http.get(f"/fine_tuning/jobs/{job_id}").json()
            assert (job["status"], job["method"]["type"], job["fine_tuned_model"]) == ("succeeded", "tinker",
                                                                                      model["id"])
            out[model["id"]] = http.get(f"/fine_tuning/jobs/{job_id}/checkpoints").json()["data"]
    return out


def is_a_fine_tuned_model(up: Up, key: str, toy_dir: Path, recipe_sampler_path: str, download: Path) -> None:
    """A client's sampler weights are one of its project's fine-tuned models, as a job's adapter is: listed,
    chatted with through the serving worker, evaluated, and downloaded as a PEFT adapter that answers as the
    served model does."""
    from safetensors.torch import load_file

    from tests.worker.serving.served import local_greedy

    http = up.client(key)
    # The recipe's rewards were all equal on the toy base (nothing trained): train one that answers otherwise.
    service = tinker.ServiceClient(base_url=f"http://127.0.0.1:{up.port}", api_key=f"tml-{key}")
    training = service.create_lora_training_client(base_model=str(toy_dir / "model"), rank=4, seed=0).result()
    datum = tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints(list(range(5, 25))),
                               loss_fn_inputs={"target_tokens": list(range(6, 26)), "weights": [1.0] * 20})
    for _ in range(5):
        training.forward_backward([datum], "cross_entropy").result()
        training.optim_step(tinker.types.AdamParams(learning_rate=0.05)).result()
    sampler_path = training.save_weights_for_sampler("chat").result().path
    service.close("success").result(timeout=60)  # its session's heartbeats would outlive the server
    models = tinker_models(http)
    assert len(models) == 2, models
    by_path = {c["metrics"]["tinker_path"]: (model, c) for model, ckpts in models.items() for c in ckpts}
    assert recipe_sampler_path in by_path
    model, latest = by_path[sampler_path]
    assert latest["step_number"] == 5  # the optimizer steps behind the weights
    adapter = download / "adapter"
    adapter.mkdir(parents=True)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        r = http.get(f"/fine_tuning/jobs/{latest['fine_tuning_job_id']}/checkpoints/{latest['id']}/files/"
                     f"adapter/{name}")
        assert r.status_code == 200, r.text
        (adapter / name).write_bytes(r.content)
    assert any(t.abs().sum() > 0 for n, t in load_file(adapter / "adapter_model.safetensors").items()
               if "lora_B" in n), "the adapter never trained"
    chat = [{"role": "user", "content": "Say abc"}]
    expected = local_greedy(toy_dir / "model", adapter, chat, 6)
    assert expected["text"] != local_greedy(toy_dir / "model", None, chat, 6)["text"]  # the adapter matters
    r = http.post("/chat/completions", json={"model": model, "messages": chat, "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == expected["text"]
    file_id = upload(http, toy_dir / "val.jsonl", "val.jsonl")
    r = http.post("/evals", json={"model": model, "file": file_id, "max_rows": 4,
                                  "reward": {"type": "exact_match", "field": "answer"},
                                  "sampling": {"max_output_tokens": 4, "max_model_len": 64}})
    assert r.status_code == 200, r.text
    up.wait_for(lambda: http.get(f"/evals/{r.json()['id']}").json()["status"] in ("succeeded", "failed"),
                "the eval of the Tinker-trained model")
    run = http.get(f"/evals/{r.json()['id']}").json()
    assert run["status"] == "succeeded" and run["result"]["n"] == 4, run


def test_math_rl_recipe_trains_saves_and_resumes(tmp_path, toy_dir):
    with Up(tmp_path, toy_dir) as up:
        up.cli("db", "upgrade")
        key = up.cli("keys", "create", "--project", "alpha")
        up.start()
        log_path = tmp_path / "run"
        first = recipe(up, key, toy_dir / "model", log_path, loss_fn="importance_sampling")
        check_run(first, log_path, 3)
        assert any(c.get("name") == "000002" for c in checkpoints(log_path))  # save_every=2
        final = [c for c in checkpoints(log_path) if c.get("name") == "final"][-1]
        is_a_fine_tuned_model(up, key, toy_dir, final["sampler_path"], tmp_path / "download")
        trim_final(log_path)
        again = recipe(up, key, toy_dir / "model", log_path, loss_fn="cispo", resume=True, max_steps=3)
        check_run(again, log_path, 3)
        assert "resum" in (again.stdout + again.stderr).lower()


def test_two_projects_recipes_at_once_share_one_resident_base_and_not_their_checkpoints(tmp_path, toy_dir):
    with Up(tmp_path, toy_dir) as up:
        up.cli("db", "upgrade")
        keys = {p: up.cli("keys", "create", "--project", p) for p in ("alpha", "beta")}
        up.start()
        logs = {p: tmp_path / p for p in keys}
        procs = {p: start_recipe(up, keys[p], toy_dir / "model", logs[p], loss_fn=loss)
                 for p, loss in (("alpha", "importance_sampling"), ("beta", "cispo"))}
        runs = {p: finished(proc) for p, proc in procs.items()}
        for p, run in runs.items():
            check_run(run, logs[p], 3)
        # one worker, one copy of the base: both clients' adapters were trained on it
        assert up.log.read_text().count(f"base {toy_dir / 'model'} resident") == 1, up.log.read_text()[-3000:]
        finals = {p: [c for c in checkpoints(logs[p]) if c.get("name") == "final"][-1] for p in keys}
        assert finals["alpha"]["state_path"] != finals["beta"]["state_path"]
        for reader, owner in (("alpha", "beta"), ("beta", "alpha")):
            client = tinker.ServiceClient(base_url=f"http://127.0.0.1:{up.port}", api_key=f"tml-{keys[reader]}")
            with pytest.raises(Exception, match="no checkpoint|not found|404"):
                client.create_training_client_from_state(finals[owner]["state_path"]).result()
            with pytest.raises(Exception, match="no checkpoint|not found|404"):
                client.create_sampling_client(model_path=finals[owner]["sampler_path"]).sample(
                    tinker.types.ModelInput.from_ints([5, 6]), 1, tinker.types.SamplingParams(max_tokens=2)).result()
            own = client.create_training_client_from_state(finals[reader]["state_path"]).result()
            assert own.model_id  # its own project's state loads
            client.close("success").result(timeout=60)
