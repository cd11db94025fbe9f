"""The reconciler resends an eval run whose broker message was lost (it stays queued), and only such runs; it fails
one whose worker stopped renewing its lease."""

from __future__ import annotations

import time

from service.db.models import EvalRun
from service.db.session import session_factory
from service.repositories import evals, projects
from tests.worker.jobs.test_job_runner import make_settings


def _eval_run(database_url, status: str) -> str:
    with session_factory(database_url).begin() as s:
        project = projects.get_or_create_project(s, "alpha")
        run = evals.add(s, EvalRun(project_id=project.id, status=status, model="m", file_id="file-x", spec={},
                                   created_at=int(time.time()) - 10))
        return run.id


def test_a_queued_eval_run_is_resent_once_per_interval(database_url, tmp_path, monkeypatch):
    from worker.jobs import reconciler

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


def test_a_running_eval_run_whose_lease_expired_is_failed_and_a_live_one_is_left(database_url, tmp_path,
                                                                                 monkeypatch):
    from worker.jobs import reconciler

    settings = make_settings(tmp_path, database_url)
    dead, live = _eval_run(database_url, "queued"), _eval_run(database_url, "queued")
    with session_factory(database_url).begin() as s:
        assert evals.claim(s, dead, "died", ttl_s=-1) and evals.claim(s, live, "alive", ttl_s=600)
    monkeypatch.setattr(reconciler, "enqueue_eval", lambda eval_id, settings=None: None)
    reconciler.reconcile_once(settings, resend_after_s=3600)
    with session_factory(database_url)() as s:
        lost, kept = evals.get_for_worker(s, dead), evals.get_for_worker(s, live)
        assert (lost.status, lost.error_code, lost.lease_expires_at) == ("failed", "worker_lost", None)
        assert kept.status == "running"
