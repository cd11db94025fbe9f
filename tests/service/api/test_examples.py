"""examples/: each recipe's dataset builder runs offline, and its job.yaml passes a dry run (the toy model stands in
for Qwen2.5-0.5B-Instruct, with its 32768 positions, so nothing is downloaded)."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from service.schemas.rewards import NumericMatchReward
from tests.service.api.conftest import upload
from worker.rewards.builtins import numeric_match

EXAMPLES = Path(__file__).parents[3] / "examples"
JOBS = "/v1/fine_tuning/jobs"


def _module(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(example: str, out: Path, *args: str) -> None:
    subprocess.run([sys.executable, str(EXAMPLES / example / "build_dataset.py"), "--out", str(out), *args],
                   check=True, capture_output=True, timeout=120)


def _job_body(api, example: str, rows_dir: Path, model: Path) -> dict:
    """The example's job.yaml with its two files uploaded from rows_dir, as the CLI would, and the toy model."""
    body = yaml.safe_load((EXAMPLES / example / "job.yaml").read_text())
    for field in ("training_file", "validation_file"):
        r = upload(api.client, name=body[field], content=(rows_dir / body[field]).read_bytes())
        assert r.status_code == 200, r.text
        body[field] = r.json()["id"]
    return {**body, "model": str(model)}


def _stand_in(toy_dir: Path, where: Path) -> Path:
    """The toy model's files with Qwen2.5-0.5B-Instruct's context (the examples' lengths are checked against it)."""
    shutil.copytree(toy_dir / "model", where)
    config = json.loads((where / "config.json").read_text())
    (where / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 32768}))
    return where


def test_both_examples_pass_a_dry_run(api, toy_dir, tmp_path):
    model = _stand_in(toy_dir, tmp_path / "stand-in")
    _build("gsm8k", tmp_path / "gsm8k", "--sample")
    _build("guess_number", tmp_path / "guess_number", "--rows", "8")
    for example in ("gsm8k", "guess_number"):
        r = api.client.post(JOBS, params={"dry_run": "true"},
                            json=_job_body(api, example, tmp_path / example, model))
        assert r.status_code == 200, (example, r.text)
        checks = {c["name"]: c for c in r.json()["checks"]}
        assert not [c for c in r.json()["checks"] if c["status"] == "failed"], example
        assert checks["model"]["status"] == "passed" and checks["prompt_lengths"]["status"] == "passed", checks
        hyper = r.json()["spec"]
        assert hyper["lora"]["r"] in (16, 32) and hyper["rollout"]["engine"] == "vllm"
        if example == "gsm8k":
            assert checks["reward_fields"]["status"] == "passed"
            assert (hyper["reward"]["type"], hyper["reward"]["source"]) == ("numeric_match", "after_hashes")
        else:
            assert hyper["environment"]["class_name"] == "GuessNumber" and hyper["training"]["max_turns"] == 7


def test_gsm8k_rows_ask_for_hashes_and_their_worked_answers_score_one(tmp_path):
    """Each sample's worked solution, scored by the job's reward against the row built from it, gets 1.0; the
    prompt is a chat user turn ending with verl's instruction."""
    builder = _module(EXAMPLES / "gsm8k" / "build_dataset.py")
    reward = NumericMatchReward(**yaml.safe_load((EXAMPLES / "gsm8k" / "job.yaml").read_text())
                                ["method"]["cispo"]["reward"])
    for question, solution in builder.SAMPLE:
        row = builder.to_row(question, solution)
        assert row["prompt"][0]["role"] == "user" and row["prompt"][0]["content"].endswith('after "####".')
        assert numeric_match(solution, row, reward) == 1.0
        assert numeric_match(solution.replace("####", "answer:"), row, reward) == 0.0
    assert builder.to_row("q", "so 1,234 in all\n#### 1,234")["answer"] == "1234"


def test_the_guessing_environment_is_the_one_in_the_job_and_plays_by_its_rules():
    source = (EXAMPLES / "guess_number" / "environment.py").read_text()
    job = yaml.safe_load((EXAMPLES / "guess_number" / "job.yaml").read_text())
    assert job["method"]["cispo"]["environment"]["source"] == source
    env = _module(EXAMPLES / "guess_number" / "environment.py").GuessNumber()
    assert env.reset(0, {"low": 1, "high": 10, "secret": 7}) is None  # the row's prompt opens
    assert env.step("I guess 5") == ("5 is wrong: my number is higher. Your next guess?", 0.0, False, False, {})
    assert env.step("no idea")[:3] == ("Answer with a single whole number.", 0.0, False)
    observation, reward, terminated, *_ = env.step("7")
    assert observation is None and terminated and abs(reward - 0.8) < 1e-12  # two wrong answers before


@pytest.mark.parametrize("example", ["capitals", "arithmetic"])
def test_a_real_model_recipe_passes_a_dry_run_and_its_local_spec_is_the_same_job(api, toy_dir, tmp_path, example):
    from service.job_spec.spec import JobSpec

    out = tmp_path / example
    _build(example, out, "--model", str(toy_dir / "model"))
    r = api.client.post(JOBS, params={"dry_run": "true"}, json=_job_body(api, example, out, toy_dir / "model"))
    assert r.status_code == 200, r.text
    assert not [c for c in r.json()["checks"] if c["status"] == "failed"], r.json()["checks"]
    served = r.json()["spec"]
    local = JobSpec.model_validate(yaml.safe_load((out / "spec.yaml").read_text()))
    for section in ("reward", "lora", "sampling", "optimizer"):
        assert getattr(local, section).model_dump(mode="json") == served[section], section
    for knob in ("steps", "batch_size", "group_size", "mini_batches", "eval_max_rows"):
        assert getattr(local.training, knob) == served["training"][knob], knob
    rows = [json.loads(line) for line in (out / "test.jsonl").read_text().splitlines()]
    assert len(rows) == 20 and rows[0]["messages"][0]["role"] == "user"
    train = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    assert not {r["messages"][0]["content"] for r in rows} & {r["messages"][0]["content"] for r in train}


def test_the_arithmetic_rows_are_fixed_and_their_answers_right_and_scored_by_the_job():
    from service.job_spec.spec import JobSpec
    from worker.rewards.engine import build_scorer

    builder = _module(EXAMPLES / "arithmetic" / "build_dataset.py")
    train, test = builder.rows()
    assert (train, test) == builder.rows() and (len(train), len(test)) == (200, 20)
    for row in train + test:
        a, b = map(int, re.findall(r"\d+", row["messages"][0]["content"]))
        assert 10 <= a <= 99 and 10 <= b <= 99 and row["answer"] == str(a + b)
    job = yaml.safe_load((EXAMPLES / "arithmetic" / "job.yaml").read_text())["method"]["cispo"]
    spec = JobSpec.model_validate({"model": "m", "data": {"train_file": "t"}, "reward": job["reward"]})
    row = test[0]
    scores = build_scorer(spec.reward).score(
        [row["answer"], f"The answer is {row['answer']}.", str(int(row["answer"]) + 1),
         "Let me think about this sum step by step before I give " + row["answer"]], [row] * 4).scores
    assert scores[0] == 1.0 and 0 < scores[1] < 1.0 and scores[2] == 0.0 and scores[3] < scores[1]


def test_compare_counts_a_reply_right_by_its_last_number_or_by_containing_the_text():
    right = _module(EXAMPLES / "compare.py").right
    assert right("37 + 13 = 50", "50") and right("50", "50") and not right("50 or 51", "50")
    assert not right("I cannot say", "50")
    assert right("The capital of Australia is Canberra.", "Canberra") and not right("Sydney", "Canberra")
