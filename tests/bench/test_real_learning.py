"""bench/real_learning.py without a model: every configuration is a valid job, the built rows are fixed and right."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.real_learning import CONFIGS, TASKS, arithmetic_rows, job, normalized, summary  # noqa: E402
from service.job_spec.spec import JobSpec  # noqa: E402


@pytest.mark.parametrize("task", sorted(TASKS))
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_every_config_is_a_valid_job(task, config, tmp_path):
    spec = JobSpec.model_validate(job(tmp_path / "model", task, config, 1, 3, 1, tmp_path, max_output_tokens=16))
    assert (spec.training.steps, spec.training.batch_size, spec.training.group_size) == (3, 8, 4)
    own = CONFIGS[config].get("sampling", {}).get("max_output_tokens")
    assert spec.sampling.max_output_tokens == (own or 16)  # a config's own length wins over the run's
    assert len((tmp_path / "test.jsonl").read_text().splitlines()) == 20


def test_arithmetic_rows_are_fixed_distinct_and_right():
    train, test = arithmetic_rows()
    assert (train, test) == arithmetic_rows()
    questions = [r["messages"][0]["content"] for r in train + test]
    assert len(set(questions)) == len(questions) == 220
    for row in train + test:
        a, b = (int(x) for x in row["messages"][0]["content"].split("?")[0].split()[-3::2])
        assert row["answer"] == str(a + b)


def test_normalized_ignores_case_and_punctuation():
    assert normalized(" Paris.") == normalized("paris") and normalized("Buenos Aires!") == "buenos aires"


def test_summary_means_over_seeds(tmp_path):
    run = {"task": "capitals", "config": "defaults", "steps": 2, "max_output_tokens": 16, "exact_before": 0.0,
           "exact_after": 0.1, "curve": [[0, 0.2, 0.0], [2, 0.3, 0.1]], "zero_group_fraction": 0.5,
           "truncated_fraction": 0.25, "cpu_s": 10.0, "load": [1.0, 1.0, 1.0]}
    lines = [{**run, "seed": 0, "eval_before": 0.2, "eval_after": 0.3},
             {**run, "seed": 1, "eval_before": 0.2, "eval_after": 0.5}]
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert "seeds [0, 1]: eval gain +0.200, exact gain +0.10" in summary(tmp_path / "r.jsonl")
