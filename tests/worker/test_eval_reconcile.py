"""The reconciler resends an eval run whose broker message was lost (it stays queued), and only such runs."""

from __future__ import annotations

import time

from service.db.models import EvalRun
from service.db.session import session_factory
from service.repositories import evals, projects
from tests.worker.test_job_runner import make_settings


def _eval_run(database_url, status: str) -> str:
    with session_factory(database_url).begin() as s:
        project = projects.get_or_create_project(s, "alpha")
        run = evals.add(s, EvalRun(project_id=project.id, status=status, model="m", file_id="file-x", spec={},
                                   created_at=int(time.time()) - 10))
        return run.id


def test_a_queued_eval_run_is_resent_once_per_interval(database_url, tmp_path, monkeypatch):
    from worker import reconciler

    settings = make_settings(tmp_path, database_url)
    queued, running = _eval_run(database_url, "queued"), _eval_run(database_url, "running")
    sent = []
    monkeypatch.setattr(reconciler, "enqueue_eval", lambda eval_id, settings=None: sent.append(eval_id))
    memory: dict[str, float] = {}
    assert reconciler.reconcile_once(settings, resend_after_s=3600, sent=memory) == []  # too young to worry
    assert reconciler.reconcile_once(settings, resend_after_s=5, sent=memory) == [queued]
    assert reconciler.reconcile_once(settings, resend_after_s=5, sent=memory) == []  # not again this interval
    assert sent == [queued] and running not in sent
    with session_factory(database_url).begin() as s:
        assert evals.claim(s, queued, "w") and not evals.claim(s, queued, "w2")  # one runner, however many sends
