"""CISPO_WORKER_JOBS: the setting, `cispo up --worker-jobs`, the chart's config.workerJobs, and the worker's choice."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from service.settings import Settings
from worker.cli import build_parser
from worker.multi.support import refusal
from worker.toy.__main__ import toy_spec
from service.job_spec.spec import JobSpec

CHART = Path(__file__).resolve().parents[3] / "helm" / "cispo"


def test_the_setting_defaults_to_one_job_and_refuses_zero(monkeypatch):
    assert Settings().worker_jobs == 1
    monkeypatch.setenv("CISPO_WORKER_JOBS", "4")
    assert Settings().worker_jobs == 4
    with pytest.raises(ValidationError, match="worker_jobs"):
        Settings(worker_jobs=0)


def test_cispo_up_takes_the_number_of_jobs():
    assert build_parser().parse_args(["up", "--worker-jobs", "3"]).worker_jobs == 3
    assert build_parser().parse_args(["up"]).worker_jobs is None  # CISPO_WORKER_JOBS, else 1
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--worker-jobs", "0"])


def test_the_chart_renders_the_setting_into_the_config():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["config"]["workerJobs"] == 1
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    assert re.search(r"^CISPO_WORKER_JOBS: \{\{ \.Values\.config\.workerJobs", helpers, re.M)


def test_jobs_that_cannot_share_a_base_say_why(toy_dir):
    raw = toy_spec(toy_dir)
    assert refusal(JobSpec.model_validate(raw)) is None
    raw["lora"] = None
    raw["rollout"] = {"max_staleness": 1}  # asynchronous sampling shares (a stale sampling copy of the adapter)
    assert refusal(JobSpec.model_validate(raw)) == "it fine-tunes every weight (lora: null)"
    rounded = toy_spec(toy_dir)
    rounded["rollout"] = {"dtype": "bfloat16"}  # its own sampling dtype shares too (beside jobs of that dtype)
    assert refusal(JobSpec.model_validate(rounded)) is None
    rounded["lora"] = {**rounded.get("lora", {}), "base_quantization": "nf4"}
    assert refusal(JobSpec.model_validate(rounded)) == "its base is quantised"
