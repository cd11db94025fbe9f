"""What the recipes on a local model share: their rows written as the job's two files, and job.yaml's
hyperparameters as a spec for `cispo train` (docs/TRAINING.md: run a job locally), so one job runs through the
service or without it."""

from __future__ import annotations

import json
from pathlib import Path

import yaml


def local_spec(out: Path, model: str, job: dict) -> dict:
    cispo = job["method"]["cispo"]
    return {"model": model, "seed": job["seed"],
            "data": {"train_file": str(out / "train.jsonl"), "validation_file": str(out / "test.jsonl")},
            "reward": cispo["reward"], **cispo["hyperparameters"]}


def write_recipe(here: Path, out: Path, model: str, train: list[dict], test: list[dict]) -> None:
    """train.jsonl and test.jsonl in `out`, and spec.yaml: `here`'s job.yaml on `model` over those files."""
    out.mkdir(parents=True, exist_ok=True)
    for name, part in (("train.jsonl", train), ("test.jsonl", test)):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in part))
    job = yaml.safe_load((here / "job.yaml").read_text())
    spec = local_spec(out.resolve(), str(Path(model).resolve()), job)
    (out / "spec.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    print(f"{len(train)} train rows, {len(test)} test rows, spec.yaml in {out}")
