"""bench/real_learning.py without a model: every configuration is a valid job, the built rows are fixed and right."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.real_learning import (  # noqa: E402
    CONFIGS, TASKS, job, normalized, summary, trl_config, trl_metrics, trl_reward, trl_rows,
)
from service.job_spec.spec import JobSpec  # noqa: E402


@pytest.mark.parametrize("task", sorted(TASKS))
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_every_config_is_a_valid_job(task, config, tmp_path):
    spec = JobSpec.model_validate(job(tmp_path / "model", task, config, 1, 3, 1, tmp_path, max_output_tokens=16))
    assert (spec.training.steps, spec.training.batch_size, spec.training.group_size) == (3, 8, 4)
    own = CONFIGS[config].get("sampling", {}).get("max_output_tokens")
    assert spec.sampling.max_output_tokens == (own or 16)  # a config's own length wins over the run's
    assert len((tmp_path / "test.jsonl").read_text().splitlines()) == 20


def test_each_task_is_its_recipes_rows_and_reward(tmp_path):
    """The bench trains what examples/<task> trains: its rows (fixed: the same on every call) and job.yaml's reward."""
    import yaml

    for task in ("arithmetic", "capitals"):
        train, test = TASKS[task]()
        assert (train, test) == TASKS[task]() and len(test) == 20
        assert not {r["messages"][0]["content"] for r in test} & {r["messages"][0]["content"] for r in train}
        built = tmp_path / task
        subprocess.run([sys.executable, str(ROOT / "examples" / task / "build_dataset.py"), "--out", str(built)],
                       check=True, capture_output=True, timeout=60)
        assert [json.loads(line) for line in (built / "test.jsonl").read_text().splitlines()] == test
        recipe = yaml.safe_load((ROOT / "examples" / task / "job.yaml").read_text())["method"]["cispo"]["reward"]
        assert job(tmp_path / "model", task, "defaults", 0, 3, 1, tmp_path)["reward"] == recipe


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


def test_trl_rows_are_the_task_rows_as_a_conversational_dataset():
    train, _ = TASKS["arithmetic"]()
    rows = trl_rows(train)
    assert rows[0] == {"prompt": train[0]["messages"], "answer": train[0]["answer"]} and len(rows) == len(train)


def test_trl_reward_is_our_scorer_on_each_completion_and_its_row(tmp_path):
    from worker.trainer.rewards import make_scorer

    spec = JobSpec.model_validate(job(tmp_path / "model", "arithmetic", "defaults", 0, 3, 1, tmp_path))
    scorer = make_scorer(spec.reward)
    prompt = [{"role": "user", "content": "What is 23 + 48? Answer with the number only."}]
    texts = ["71", "70", "The sum is 71."]
    reward = trl_reward(scorer, ["answer"], failure_score=0.0)
    got = reward([prompt] * 3, [[{"role": "assistant", "content": t}] for t in texts], answer=["71"] * 3,
                 trainer_state=None, log_extra=None, log_metric=None)
    rows = [{"messages": prompt, "answer": "71"}] * 3
    assert got == scorer.score(texts, rows, failure_score=0.0).rewards.tolist()
    assert got[0] == 1.0 and got[1] == 0.0 and 0.0 < got[2] < 1.0
    assert reward([prompt], ["71"], answer=["71"]) == [1.0]  # a plain-text completion too


def test_trl_config_sets_only_the_shared_settings(tmp_path):
    spec = JobSpec.model_validate(job(tmp_path / "model", "arithmetic", "defaults", 1, 3, 1, tmp_path,
                                      max_output_tokens=16))
    config = trl_config(spec, tmp_path / "trl")
    assert (config["max_steps"], config["logging_steps"], config["max_completion_length"], config["seed"]) == (
        6, 2, 16, 1)  # 2 optimizer steps a rollout
    left_to_trl = {"scale_rewards", "epsilon", "epsilon_high", "adam_beta1", "adam_beta2", "adam_epsilon", "optim",
                   "lr_scheduler_type", "warmup_steps", "temperature", "top_p", "top_k", "beta", "max_grad_norm",
                   "weight_decay", "num_iterations"}
    assert not left_to_trl & config.keys()
    trl = pytest.importorskip("trl")
    args = trl.GRPOConfig(**config)
    assert (args.generation_batch_size, args.num_generations, args.learning_rate, args.bf16) == (32, 4, 2e-4, False)
    assert (args.scale_rewards, args.epsilon_high, args.adam_beta2) == ("group", None, 0.999)


def test_trl_metrics_take_our_names():
    logs = {"reward": 0.25, "frac_reward_zero_std": 0.5, "completions/clipped_ratio": 0.125,
            "completions/mean_length": 9.0, "entropy": 1.5, "cispo_clip_ratio": None, "loss": -0.1}
    assert trl_metrics(logs) == {"reward_mean": 0.25, "zero_advantage_group_fraction": 0.5,
                                 "truncated_fraction": 0.125, "completion_length_mean": 9.0, "entropy": 1.5}
