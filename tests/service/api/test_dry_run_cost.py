"""The dry run's cost before start (service/cost_estimate.py): expected trained tokens and, from this project's
earlier succeeded jobs, expected worker-seconds, saying where the figures came from or that none exist."""

from __future__ import annotations

from sqlalchemy import update

from service.db.models import Job, JobMetric
from tests.service.api.conftest import uploaded
from tests.service.api.test_dry_run import JOBS, ROWS, checks, dry, local_body


def _earlier(api, body, *, length: float, tokens: int, seconds: int, model: str | None = None) -> None:
    """A job of the project that succeeded: `tokens` trained in `seconds`, completions of `length` tokens."""
    r = api.client.post(JOBS, json=body)
    assert r.status_code == 200, r.text
    job_id = r.json()["id"]
    with api.session() as s:
        s.add_all([JobMetric(job_id=job_id, step=i + 1, name="completion_length_mean", value=length) for i in range(3)])
        values = {"status": "succeeded", "started_at": 1000, "finished_at": 1000 + seconds, "trained_tokens": tokens}
        if model is not None:
            values["model"] = model
        s.execute(update(Job).where(Job.id == job_id).values(**values))
        s.commit()


def test_without_earlier_jobs_the_tokens_are_an_upper_bound_and_no_seconds_are_guessed(api, toy_dir):
    out = dry(api, local_body(api, toy_dir))  # 3 steps, batch 2, group 4, 256 output tokens, 1 update epoch
    assert (out.json()["expected_trained_tokens"], out.json()["expected_worker_seconds"]) == (3 * 2 * 4 * 256, None)
    [cost] = checks(out)["cost"]
    assert cost["status"] == "skipped" and "at most 256 completion tokens per sample" in cost["message"]
    assert "this project has no earlier succeeded job that trained" in cost["message"]


def test_earlier_jobs_on_the_model_give_tokens_and_worker_seconds(api, toy_dir):
    body = local_body(api, toy_dir)
    _earlier(api, body, length=8.0, tokens=200, seconds=20)  # 0.1 s per trained token
    body["method"]["cispo"]["hyperparameters"]["training"]["batch_size"] = 4
    out = dry(api, body)
    tokens = 3 * 4 * 4 * 8  # completions end at 8 tokens, far below the 256 cap: they stay 8
    assert out.json()["expected_trained_tokens"] == tokens
    assert out.json()["expected_worker_seconds"] == round(0.1 * tokens)
    [cost] = checks(out)["cost"]
    assert cost["status"] == "passed"
    assert "8.0 completion tokens per sample, from 1 earlier job(s) of this project on this model" in cost["message"]
    assert "the median of 1 earlier succeeded job(s) of this project on this model" in cost["message"]
    # another project has no history of its own: nothing of this project's is used
    other = api.other.post(JOBS, params={"dry_run": "true"}, json={**body, "training_file": uploaded(api.other, ROWS)})
    assert other.status_code == 200 and other.json()["expected_worker_seconds"] is None


def test_earlier_jobs_on_other_models_are_used_and_said_so(api, toy_dir):
    body = local_body(api, toy_dir)
    _earlier(api, body, length=8.0, tokens=100, seconds=50, model="another/model")  # 0.5 s per token
    out = dry(api, body)
    tokens = 3 * 2 * 4 * 256  # no earlier job on this model: the completion cap
    assert (out.json()["expected_trained_tokens"], out.json()["expected_worker_seconds"]) == (tokens, tokens // 2)
    [cost] = checks(out)["cost"]
    assert "1 earlier succeeded job(s) of this project on other models (none on this one)" in cost["message"]
