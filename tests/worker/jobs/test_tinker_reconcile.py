"""The reconciler ends Tinker sessions whose heartbeats stopped, releasing their models, and leaves live ones."""

from __future__ import annotations

import time

from service.db.session import session_factory
from service.repositories import projects
from service.repositories import tinker as repo
from tests.worker.jobs.test_job_runner import make_settings


def test_a_session_that_stopped_heartbeating_is_ended_and_a_live_one_is_left(database_url, tmp_path):
    from worker.jobs import reconciler

    settings = make_settings(tmp_path, database_url).model_copy(update={"tinker_session_timeout_s": 0.5})
    with session_factory(database_url).begin() as s:
        project_id = projects.get_or_create_project(s, "alpha").id
        silent = repo.create_session(s, project_id, tags=[], user_metadata=None, sdk_version="0.38.0")
        live = repo.create_session(s, project_id, tags=[], user_metadata=None, sdk_version="0.38.0")
        silent_model = repo.add_model(s, project_id, silent, 0, base_model="b", lora_config={"rank": 4})
        live_model = repo.add_model(s, project_id, live, 0, base_model="b", lora_config={"rank": 4})
    time.sleep(1.0)
    with session_factory(database_url).begin() as s:
        assert repo.heartbeat(s, project_id, live) is True
    reconciler.reconcile_once(settings, resend_after_s=3600)
    with session_factory(database_url)() as s:
        assert repo.get_model(s, project_id, silent_model).released_at is not None
        assert repo.get_model(s, project_id, live_model).released_at is None
        assert repo.heartbeat(s, project_id, silent) is False and repo.heartbeat(s, project_id, live) is True
