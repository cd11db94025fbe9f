"""A job's evidence through the repository (service/repositories/job_evidence.py): the curve is the job's own
forecast metrics by step; the forecast and best checkpoint writes are fenced by the lease; the best checkpoint is
the best eval score, the earliest of equals."""

from __future__ import annotations

import pytest

from service.db.models import Checkpoint, JobMetric
from service.db.session import session_factory
from service.repositories import job_evidence, job_lease, jobs, projects
from tests.service.repositories.job_rows import queued_job


@pytest.fixture
def claimed(database_url):
    """(sessions, job id, its lease epoch, another running job's id)."""
    sessions = session_factory(database_url)
    with sessions.begin() as s:
        project = projects.get_or_create_project(s, "own").id
        job_id, other = queued_job(s, project), queued_job(s, project, seed=2)
    with sessions.begin() as s:
        epoch = job_lease.claim(s, job_id, "w", ttl_s=60)
        assert job_lease.claim(s, other, "w", ttl_s=60) == epoch  # the same epoch: only the job id tells them apart
    return sessions, job_id, epoch, other


def test_the_curve_holds_the_jobs_own_forecast_metrics_by_step(claimed):
    sessions, job_id, _, other = claimed
    with sessions.begin() as s:
        s.add_all([JobMetric(job_id=job_id, step=3, name="reward_mean", value=0.3),
                   JobMetric(job_id=job_id, step=1, name="reward_mean", value=0.1),
                   JobMetric(job_id=job_id, step=1, name="trained_tokens", value=40.0),
                   JobMetric(job_id=job_id, step=2, name="eval_reward_mean", value=0.2),
                   JobMetric(job_id=job_id, step=2, name="eval_reward_ci_low", value=0.15),
                   JobMetric(job_id=job_id, step=2, name="eval_reward_ci_high", value=0.25),
                   JobMetric(job_id=job_id, step=2, name="loss", value=9.0),
                   JobMetric(job_id=other, step=2, name="reward_mean", value=0.9)])
    with sessions() as s:
        curve = job_evidence.curve(s, job_id)
        assert job_evidence.curve(s, "ftjob-none") == {}
    assert list(curve) == [1, 2, 3]
    assert curve == {1: {"reward_mean": 0.1, "trained_tokens": 40.0},
                     2: {"eval_reward_mean": 0.2, "eval_reward_ci_low": 0.15, "eval_reward_ci_high": 0.25},
                     3: {"reward_mean": 0.3}}


@pytest.mark.parametrize("metrics, score", [({"eval_reward_mean": 0.5, "eval_loss": 2.0}, 0.5),
                                            ({"eval_loss": 2}, -2.0), ({"eval_reward_mean": 1}, 1.0),
                                            ({"loss": 1.0}, None), ({}, None), (None, None)])
def test_an_eval_score_is_the_reward_else_minus_the_loss(metrics, score):
    got = job_evidence.eval_score(metrics)
    assert got == score and (score is None or type(got) is float)


def _checkpoint(s, job_id: str, step: int, **metrics) -> str:
    s.add(ckpt := Checkpoint(job_id=job_id, step=step, storage_prefix=f"p/{step}", files={}, metrics=metrics))
    s.flush()
    return ckpt.id


def test_the_best_checkpoint_has_the_best_eval_and_is_the_earliest_of_equals(claimed):
    sessions, job_id, _, other = claimed
    with sessions.begin() as s:
        assert job_evidence.best_checkpoint(s, job_id) is None
        _checkpoint(s, job_id, 1)  # no eval
        assert job_evidence.best_checkpoint(s, job_id) is None
        later_tie = _checkpoint(s, job_id, 6, eval_reward_mean=0.7)
        _checkpoint(s, job_id, 2, eval_reward_mean=0.4)
        best = _checkpoint(s, job_id, 4, eval_reward_mean=0.7)
        _checkpoint(s, job_id, 5, eval_reward_mean=-0.1)
        _checkpoint(s, other, 3, eval_reward_mean=0.9)
        assert job_evidence.best_checkpoint(s, job_id).id == best != later_tie
        supervised = _checkpoint(s, other, 7, eval_loss=0.5)
        _checkpoint(s, other, 8, eval_loss=0.8)
    with sessions() as s:
        assert job_evidence.best_checkpoint(s, other).step == 3
    with sessions.begin() as s:
        s.execute(Checkpoint.__table__.delete().where(Checkpoint.__table__.c.step == 3))
    with sessions() as s:
        assert job_evidence.best_checkpoint(s, other).id == supervised  # the lower loss


def test_the_forecast_and_best_checkpoint_writes_are_fenced_by_the_lease(claimed):
    sessions, job_id, epoch, other = claimed
    with sessions.begin() as s:
        assert job_evidence.set_forecast(s, job_id, epoch, {"source": "eval"}) is True
        assert job_evidence.set_forecast(s, job_id, epoch + 1, {"source": "stale"}) is False
        assert job_evidence.set_best_checkpoint(s, job_id, epoch, "ftckpt_1") is True
        assert job_evidence.set_best_checkpoint(s, job_id, epoch - 1, "ftckpt_stale") is False
    with sessions() as s:
        job, untouched = jobs.get_for_worker(s, job_id), jobs.get_for_worker(s, other)
        assert (job.forecast, job.best_checkpoint_id) == ({"source": "eval"}, "ftckpt_1")
        assert (untouched.forecast, untouched.best_checkpoint_id) == (None, None)
    with sessions.begin() as s:
        assert job_evidence.set_best_checkpoint(s, job_id, epoch, None) is True
    with sessions() as s:
        assert jobs.get_for_worker(s, job_id).best_checkpoint_id is None
