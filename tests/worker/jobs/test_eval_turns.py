"""A worker that takes an eval run's message while another project's queued work has the earlier fair-share turn
sends the message again, after a delay, and runs it anyway once it has yielded MAX_YIELDS times."""

from __future__ import annotations

import time

from service.db.models import EvalRun
from service.db.session import session_factory
from service.repositories import evals, projects
from tests.service.repositories.job_rows import queued_job
from tests.worker.jobs.test_job_runner import make_settings
from worker.jobs import eval_turns


def test_an_eval_hands_its_turn_to_another_projects_waiting_job(database_url, tmp_path, monkeypatch):
    settings = make_settings(tmp_path, database_url)
    sent = []
    monkeypatch.setattr(eval_turns, "enqueue_eval", lambda eval_id, **kw: sent.append((eval_id, kw)))
    with session_factory(database_url).begin() as s:
        busy, waiting = (projects.get_or_create_project(s, name).id for name in ("busy", "waiting"))
        first, second = (evals.add(s, EvalRun(project_id=busy, status="queued", model="m", file_id="file-e", spec={},
                                              created_at=int(time.time()) - 60)).id for _ in range(2))
        evals.claim(s, first, "worker-1", ttl_s=60)  # one of busy's evals holds a worker
    assert not eval_turns.hand_over_turn(second, settings, 0)  # nobody else waits: it runs
    with session_factory(database_url).begin() as s:
        queued_job(s, waiting)  # created after both evals, yet its project runs nothing
    assert eval_turns.hand_over_turn(second, settings, 0)
    assert sent == [(second, {"settings": settings, "delay_s": eval_turns.YIELD_DELAY_S, "yielded": 1})]
    assert not eval_turns.hand_over_turn(second, settings, eval_turns.MAX_YIELDS)  # yielded enough: it runs
    assert len(sent) == 1
