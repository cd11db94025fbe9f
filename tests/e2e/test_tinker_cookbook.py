"""The Tinker SDK and tinker-cookbook, unmodified, against `cispo up`: the cookbook's math_rl recipe (arithmetic)
trains a LoRA on the toy base through /api/v1, saves and resumes, with the sampler's and the trainer's
log-probs in agreement."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.up import Up

pytest.importorskip("tinker_cookbook.recipes.math_rl.train")


def recipe(up: Up, key: str, model: Path, log_path: Path, *, loss_fn: str, resume: bool = False,
           max_steps: int = 3) -> subprocess.CompletedProcess:
    env = {**up.env, "TINKER_API_KEY": f"tml-{key}", "TINKER_TELEMETRY": "0", "HF_HUB_OFFLINE": "1"}
    args = [f"base_url=http://127.0.0.1:{up.port}", f"model_name={model}", "renderer_name=role_colon",
            "env=arithmetic", f"loss_fn={loss_fn}", "lora_rank=8", "group_size=4", "groups_per_batch=4",
            "max_tokens=5", f"max_steps={max_steps}", "eval_every=0", "save_every=2", f"log_path={log_path}",
            f"behavior_if_log_dir_exists={'resume' if resume else 'delete'}"]
    return subprocess.run([sys.executable, "-m", "tinker_cookbook.recipes.math_rl.train", *args], env=env,
                          capture_output=True, text=True, timeout=900)


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


def test_math_rl_recipe_trains_saves_and_resumes(tmp_path, toy_dir):
    with Up(tmp_path, toy_dir) as up:
        up.cli("db", "upgrade")
        key = up.cli("keys", "create", "--project", "alpha")
        up.start()
        log_path = tmp_path / "run"
        first = recipe(up, key, toy_dir / "model", log_path, loss_fn="importance_sampling")
        check_run(first, log_path, 3)
        assert any(c.get("name") == "000002" for c in checkpoints(log_path))  # save_every=2
        trim_final(log_path)
        again = recipe(up, key, toy_dir / "model", log_path, loss_fn="cispo", resume=True, max_steps=3)
        check_run(again, log_path, 3)
        assert "resum" in (again.stdout + again.stderr).lower()
