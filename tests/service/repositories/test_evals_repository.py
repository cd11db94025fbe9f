"""Eval runs through the repository (service/repositories/evals.py): the API reads them within a project; the
worker's claim and finish are compare-and-set on the status (and the owner), so a duplicate message or another
worker changes nothing; the claim is a lease, cancel ends or stops a run, and a queued eval knows its fair turn."""

from __future__ import annotations

import pytest

from sqlalchemy import update

from service.db.models import EvalRun, Job
from service.db.session import session_factory
from service.repositories import evals, projects
from tests.service.repositories.job_rows import queued_job


@pytest.fixture
def runs(database_url, monkeypatch):
    """(sessions, own project id, other project id, {label: eval run id}); the repository's now() is 777."""
    monkeypatch.setattr(evals, "now", lambda: 777)
    sessions = session_factory(database_url)
    with sessions.begin() as s:
        own, other = (projects.get_or_create_project(s, name).id for name in ("own", "other"))
        ids = {}
        for label, project_id, created_at in [("old", own, 100), ("edge", own, 200), ("new", own, 300),
                                              ("theirs", other, 50)]:
            added = evals.add(s, EvalRun(project_id=project_id, status="queued", model="m", file_id="file-e",
                                         spec={}, created_at=created_at))
            assert added.id.startswith("evalrun_")  # flushed: the id exists before the commit
            ids[label] = added.id
    return sessions, own, other, ids


def test_reads_stay_in_the_project_and_the_worker_reads_by_id(runs):
    sessions, own, other, ids = runs
    with sessions() as s:
        assert evals.get(s, own, ids["old"]).created_at == 100
        assert evals.get(s, own, ids["theirs"]) is None and evals.get(s, other, ids["new"]) is None
        assert evals.get(s, other, ids["theirs"]).id == ids["theirs"]
        assert evals.get_for_worker(s, ids["theirs"]).project_id == other
        assert evals.get_for_worker(s, "evalrun_none") is None
        page = evals.page(s, own, after=None, limit=2)
        assert [r.id for r in page.items] == [ids["new"], ids["edge"]] and page.has_more
        assert [r.id for r in evals.page(s, own, after=ids["edge"], limit=2).items] == [ids["old"]]
        assert [r.id for r in evals.page(s, other, after=None, limit=5).items] == [ids["theirs"]]


def test_a_run_is_claimed_once_and_finished_by_its_owner_only(runs):
    sessions, own, _, ids = runs
    with sessions.begin() as s:
        assert evals.claim(s, ids["old"], "worker-1") is True
        assert evals.claim(s, ids["old"], "worker-2") is False  # a duplicate message: taken
        assert evals.finish(s, ids["edge"], "worker-1", status="succeeded") is False  # never claimed
        assert evals.finish(s, ids["old"], "worker-2", status="failed", error_code="x") is False  # not its owner
    with sessions() as s:
        run = evals.get(s, own, ids["old"])
        assert (run.status, run.owner, run.started_at, run.finished_at) == ("running", "worker-1", 777, None)
        assert evals.get(s, own, ids["edge"]).status == "queued"
    with sessions.begin() as s:
        assert evals.finish(s, ids["old"], "worker-1", status="succeeded", result={"mean": 0.5},
                            result_file_id="file-r", error_code="partial", error_message="2 rows failed") is True
        assert evals.finish(s, ids["old"], "worker-1", status="failed") is False  # finished already
        assert evals.claim(s, ids["old"], "worker-1") is False
    with sessions() as s:
        run = evals.get(s, own, ids["old"])
        assert (run.status, run.result, run.result_file_id, run.error_code, run.error_message, run.finished_at) == (
            "succeeded", {"mean": 0.5}, "file-r", "partial", "2 rows failed", 777)


def test_queued_before_lists_runs_still_queued_since_before_the_moment(runs):
    sessions, _, _, ids = runs
    with sessions.begin() as s:
        evals.claim(s, ids["theirs"], "worker-1")
    with sessions() as s:
        assert sorted(evals.queued_before(s, 200)) == [ids["old"]]  # not the one created at 200, nor a claimed one
        assert sorted(evals.queued_before(s, 301)) == sorted([ids["old"], ids["edge"], ids["new"]])


def test_a_claim_is_a_lease_its_worker_renews_and_a_lapsed_one_fails_the_run(runs):
    sessions, own, _, ids = runs
    with sessions.begin() as s:
        assert evals.claim(s, ids["old"], "worker-1", ttl_s=60) and evals.claim(s, ids["edge"], "worker-2", ttl_s=60)
    with sessions.begin() as s:
        assert evals.heartbeat(s, ids["old"], "worker-1", ttl_s=-1) is False  # renewed (here: into the past)
        assert evals.heartbeat(s, ids["old"], "worker-2", ttl_s=60) is None  # not its run
        assert evals.heartbeat(s, ids["new"], "worker-1", ttl_s=60) is None  # never claimed
    with sessions.begin() as s:
        assert evals.fail_expired(s) == [ids["old"]]  # worker-2's lease still runs
        assert evals.fail_expired(s) == []
    with sessions.begin() as s:
        # The worker that lost it has every write refused, so a late result cannot overwrite the failure.
        assert evals.heartbeat(s, ids["old"], "worker-1", ttl_s=60) is None
        assert evals.finish(s, ids["old"], "worker-1", status="succeeded", result={"mean": 1.0}) is False
    with sessions() as s:
        run = evals.get(s, own, ids["old"])
        assert (run.status, run.error_code, run.result, run.finished_at) == ("failed", "worker_lost", None, 777)
        assert "create the eval run again" in run.error_message
        assert evals.get(s, own, ids["edge"]).status == "running"


def test_cancel_ends_a_queued_run_at_once_and_asks_a_running_one_to_stop(runs):
    sessions, own, _, ids = runs
    with sessions.begin() as s:
        evals.claim(s, ids["edge"], "worker-1", ttl_s=60)
    with sessions.begin() as s:
        assert evals.active_count(s, own) == 3
        queued = evals.request_cancel(s, evals.get(s, own, ids["old"]))
        assert (queued.status, queued.finished_at) == ("cancelled", 777)
        running = evals.request_cancel(s, evals.get(s, own, ids["edge"]))
        assert (running.status, running.cancel_requested) == ("running", True)
        assert evals.active_count(s, own) == 2
        assert evals.heartbeat(s, ids["edge"], "worker-1", ttl_s=60) is True  # what the worker reads
        with pytest.raises(evals.IllegalTransition, match="is cancelled"):
            evals.request_cancel(s, queued)
    with sessions.begin() as s:
        assert evals.finish(s, ids["edge"], "worker-1", status="cancelled")
        with pytest.raises(evals.IllegalTransition):
            evals.request_cancel(s, evals.get(s, own, ids["edge"]))


def test_an_eval_waits_its_turn_behind_another_projects_queued_work(runs):
    sessions, own, other, ids = runs
    with sessions.begin() as s:
        s.execute(update(EvalRun).where(EvalRun.id == ids["theirs"]).values(status="succeeded"))
        assert not evals.another_project_goes_first(s, ids["edge"], {})  # only this project waits
        evals.claim(s, ids["old"], "worker-1", ttl_s=60)
        # own runs one eval: its next one comes at (1 + 1), another project's first queued job at (0 + 1).
        job = queued_job(s, other, created_at=900)
        assert evals.another_project_goes_first(s, ids["edge"], {})
        assert not evals.another_project_goes_first(s, ids["edge"], {"own": 3})  # a weight of 3: (1+1)/3 < 1
        s.execute(update(Job).where(Job.id == job).values(status="running"))
        assert not evals.another_project_goes_first(s, ids["edge"], {})  # the other project waits for nothing now
        assert not evals.another_project_goes_first(s, ids["old"], {})  # not queued: the claim decides
