"""Fine-tuned models through the repository (service/repositories/fine_tuned_models.py): a project's succeeded jobs
whose model was not deleted; retiring one marks it once, drops its own checkpoint rows only, and says so."""

from __future__ import annotations

import pytest

from service.db.models import Checkpoint, Job
from service.db.session import session_factory
from service.repositories import fine_tuned_models as models
from service.repositories import jobs, projects


def _job(s, project_id: str, status: str) -> str:
    return jobs.add(s, Job(project_id=project_id, status=status, model="m", training_file="file-t", spec={},
                           method={"type": "cispo"}, seed=1, total_steps=10)).id


def _checkpoint(s, job_id: str, step: int) -> str:
    s.add(ckpt := Checkpoint(job_id=job_id, step=step, storage_prefix=f"{job_id}/step-{step}", files={},
                             metrics={}))
    s.flush()
    return ckpt.id


@pytest.fixture
def made(database_url):
    """(sessions, own project id, other project id, {label: job id})."""
    sessions = session_factory(database_url)
    with sessions.begin() as s:
        own, other = (projects.get_or_create_project(s, name).id for name in ("own", "other"))
        ids = {label: _job(s, own, status) for label, status in [
            ("done", "succeeded"), ("second", "succeeded"), ("running", "running"), ("failed", "failed"),
            ("cancelled", "cancelled")]}
        ids["theirs"] = _job(s, other, "succeeded")
    return sessions, own, other, ids


def test_a_projects_models_are_its_succeeded_jobs_newest_first(made):
    sessions, own, other, ids = made
    with sessions() as s:
        assert [j.id for j in models.page(s, own, after=None, limit=5).items] == [ids["second"], ids["done"]]
        first = models.page(s, own, after=None, limit=1)
        assert [j.id for j in first.items] == [ids["second"]] and first.has_more
        assert [j.id for j in models.page(s, other, after=None, limit=5).items] == [ids["theirs"]]
        assert models.get(s, own, ids["done"]).id == ids["done"]
        assert models.get(s, other, ids["theirs"]).id == ids["theirs"]
        for label in ("running", "failed", "cancelled", "theirs"):
            assert models.get(s, own, ids[label]) is None, label


def test_retire_marks_the_model_once_and_drops_its_own_checkpoints(made, monkeypatch):
    sessions, own, _, ids = made
    with sessions.begin() as s:
        kept = [_checkpoint(s, ids["done"], step) for step in (1, 2)]
        _checkpoint(s, ids["second"], 1)
        jobs.get(s, own, ids["done"]).best_checkpoint_id = kept[1]
    monkeypatch.setattr(models, "now", lambda: 4242)
    with sessions.begin() as s:
        stale = models.get(s, own, ids["done"])  # a second delete that read the model before the first committed
        assert sorted(models.retire(s, models.get(s, own, ids["done"]))) == [f"{ids['done']}/step-1",
                                                                              f"{ids['done']}/step-2"]
    monkeypatch.setattr(models, "now", lambda: 9999)
    with sessions.begin() as s:
        assert models.retire(s, stale) == []
    with sessions() as s:
        job = jobs.get(s, own, ids["done"])
        assert (job.model_deleted_at, job.best_checkpoint_id) == (4242, None)
        assert jobs.checkpoints(s, ids["done"], after=None, limit=10).items == []
        assert [c.step for c in jobs.checkpoints(s, ids["second"], after=None, limit=10).items] == [1]
        assert jobs.get(s, own, ids["second"]).model_deleted_at is None
        assert [e.message for e in jobs.events(s, ids["done"], after=None, limit=10).items] == [
            "Fine-tuned model deleted; its checkpoints were removed"]
        assert jobs.events(s, ids["second"], after=None, limit=10).items == []
        assert models.get(s, own, ids["done"]) is None
        assert [j.id for j in models.page(s, own, after=None, limit=5).items] == [ids["second"]]
