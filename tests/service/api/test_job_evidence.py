"""A job's evidence end to end (API -> real worker run on the tiny model -> API): the forecast on the job object,
the best checkpoint kept and named (training.keep_best), and an early stop on a target (training.stop_when)."""

from __future__ import annotations

import json

import pytest

from tests.service.api.conftest import running_api, uploaded
from tests.worker.jobs.test_job_runner import make_settings as worker_settings
from worker.evals.forecast import MIN_POINTS
from worker.evals.stopping import EvalPoint, stop_reason
from worker.jobs.job_runner import run_job

JOBS = "/v1/fine_tuning/jobs"


def _rows(toy_dir, n=12) -> list[dict]:
    return [json.loads(line) for line in (toy_dir / "train.jsonl").read_text().splitlines()[:n]]


def _body(toy_dir, training_file: str, **training) -> dict:
    return {
        "model": str(toy_dir / "model"), "training_file": training_file, "seed": 3,
        "method": {"type": "cispo", "cispo": {
            "reward": {"type": "exact_match", "field": "answer"},
            "hyperparameters": {
                "lora": {"r": 4, "alpha": 8, "target_modules": "all-linear"},
                "sampling": {"max_output_tokens": 4, "max_model_len": 64},
                "training": {"batch_size": 2, "group_size": 4, "mini_batches": 1, "micro_batch_size": 8,
                             "eval_max_rows": 4, **training}}}},
    }


def _run(api, database_url, tmp_path, toy_dir, **training) -> str:
    r = api.client.post(JOBS, json=_body(toy_dir, uploaded(api.client, _rows(toy_dir)), **training))
    assert r.status_code == 200, r.text
    job_id = r.json()["id"]
    assert run_job(job_id, worker_settings(tmp_path, database_url)) == "succeeded"
    return job_id


@pytest.mark.slow
def test_a_finished_job_shows_its_forecast_and_its_best_checkpoint(database_url, toy_dir, tmp_path):
    steps = MIN_POINTS + 1  # an eval at every step and the step-0 baseline: enough evals to fit on
    with running_api(database_url, tmp_path) as api:
        job_id = _run(api, database_url, tmp_path, toy_dir, steps=steps, eval_interval=1, checkpoint_interval=1,
                      checkpoint_keep=1, keep_best=True)
        job = api.client.get(f"{JOBS}/{job_id}").json()
        checkpoints = api.client.get(f"{JOBS}/{job_id}/checkpoints").json()["data"]

    forecast = job["forecast"]
    assert forecast["source"] == "eval" and forecast["points"] == steps + 1
    assert forecast["fitted_at_step"] == steps and forecast["final_step"] == steps
    assert isinstance(forecast["trustworthy"], bool) and (forecast["trustworthy"] or forecast["reason"])
    if "asymptote" in forecast:  # fitted (a flat toy curve may leave the interval open: then it says so)
        low, high = forecast["asymptote"]["interval"]
        assert low <= forecast["asymptote"]["mean"] <= high
        assert forecast["trustworthy"] or forecast["reason"]
    # keep_best: the newest checkpoint (checkpoint_keep 1) and the best one, which the job names
    by_id = {c["id"]: c for c in checkpoints}
    assert job["best_checkpoint"] in by_id and len(checkpoints) <= 2
    assert max(c["step_number"] for c in checkpoints) == steps
    best = by_id[job["best_checkpoint"]]["metrics"]["eval_reward_mean"]
    assert best == max(c["metrics"]["eval_reward_mean"] for c in checkpoints)


@pytest.mark.slow
def test_a_job_stops_early_when_its_eval_reaches_the_target(database_url, toy_dir, tmp_path):
    # exact_match rewards are 0 or 1, so a target of 0 is reached by the first eval after the baseline (step 2):
    # the run must end there, as succeeded, with the reason in its events and a checkpoint of that step.
    with running_api(database_url, tmp_path) as api:
        job_id = _run(api, database_url, tmp_path, toy_dir, steps=20, eval_interval=2, checkpoint_interval=0,
                      stop_when={"target": 0.0})
        job = api.client.get(f"{JOBS}/{job_id}").json()
        events = [e["message"] for e in api.client.get(f"{JOBS}/{job_id}/events", params={"limit": 100}).json()["data"]]
        checkpoints = api.client.get(f"{JOBS}/{job_id}/checkpoints").json()["data"]
    assert (job["status"], job["steps_done"], job["total_steps"]) == ("succeeded", 2, 20)
    stop = [m for m in events if m.startswith("Stopping early at step 2 of 20 (training.stop_when): target reached")]
    assert len(stop) == 1
    assert any(m.startswith("Job succeeded") for m in events)
    assert [c["step_number"] for c in checkpoints] == [2]
    assert job["fine_tuned_model"] is not None


@pytest.mark.slow
def test_a_job_stops_at_the_first_plateau_its_evals_show(database_url, toy_dir, tmp_path):
    """The run ends at the first eval where the pure rule fires on the evals it recorded, and not before."""
    with running_api(database_url, tmp_path) as api:
        job_id = _run(api, database_url, tmp_path, toy_dir, steps=20, eval_interval=1, checkpoint_interval=0,
                      stop_when={"plateau": {"evals": 2}})
        job = api.client.get(f"{JOBS}/{job_id}").json()
        events = [e["message"] for e in api.client.get(f"{JOBS}/{job_id}/events", params={"limit": 100}).json()["data"]]
        metrics = api.client.get(f"{JOBS}/{job_id}/metrics", params={"limit": 1000})
    assert metrics.status_code == 200, metrics.text
    by_step: dict[int, dict] = {}
    for m in metrics.json()["data"]:
        by_step.setdefault(m["step"], {})[m["name"]] = m["value"]
    evals = [EvalPoint(s, v["eval_reward_mean"], v["eval_reward_ci_low"], v["eval_reward_ci_high"])
             for s, v in sorted(by_step.items()) if "eval_reward_mean" in v]
    done = job["steps_done"]
    assert job["status"] == "succeeded" and 2 <= done < 20 and evals[-1].step == done
    assert stop_reason(evals, plateau_evals=2) is not None
    assert all(stop_reason(evals[:k], plateau_evals=2) is None for k in range(1, len(evals)))
    assert sum(m.startswith(f"Stopping early at step {done} of 20 (training.stop_when): plateau") for m in events) == 1
