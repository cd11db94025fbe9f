"""A queued job shows its place in the queue (queue_position): on shared workers (CISPO_WORKER_JOBS > 1) in the
fair-share order of its base model's queue, with the operator's project weights; otherwise oldest first."""

from __future__ import annotations

from sqlalchemy import update

from service.db.models import Job
from service.repositories import job_lease
from tests.service.api.conftest import cispo_body, running_api, uploaded


def _create(client, **overrides) -> dict:
    r = client.post("/v1/fine_tuning/jobs", json=cispo_body(uploaded(client), **overrides))
    assert r.status_code == 200, r.text
    return r.json()


def _position(client, job_id: str):
    r = client.get(f"/v1/fine_tuning/jobs/{job_id}")
    assert r.status_code == 200, r.text
    return r.json()["queue_position"]


def _three_jobs(api) -> tuple[str, str, str]:
    """alpha's two jobs, then beta's one, in that order of creation."""
    first, second = _create(api.client)["id"], _create(api.client)["id"]
    return first, second, _create(api.other)["id"]


def test_shared_workers_take_turns_between_projects(database_url, tmp_path):
    with running_api(database_url, tmp_path, worker_jobs=2, poll_cache_s=0) as api:
        created = _create(api.client)
        assert created["status"] == "queued" and created["queue_position"] == 1
        alpha_2 = _create(api.client)["id"]
        beta_1 = _create(api.other)["id"]
        # beta's job goes before alpha's second: projects take turns, one job each.
        assert [_position(api.client, created["id"]), _position(api.client, alpha_2),
                _position(api.other, beta_1)] == [1, 3, 2]
        listed = {j["id"]: j["queue_position"] for j in api.client.get("/v1/fine_tuning/jobs").json()["data"]}
        assert listed == {created["id"]: 1, alpha_2: 3}
        # Once alpha's first job runs, alpha holds a slot: beta's job is next, then alpha's second.
        with api.session() as s:
            assert job_lease.claim(s, created["id"], "worker-1", ttl_s=60) is not None
            s.commit()
        assert _position(api.client, created["id"]) is None  # running: no place in the queue
        assert [_position(api.other, beta_1), _position(api.client, alpha_2)] == [1, 2]
        # Cancelled: out of the queue, and the one behind moves up.
        assert api.other.post(f"/v1/fine_tuning/jobs/{beta_1}/cancel").json()["queue_position"] is None
        assert _position(api.client, alpha_2) == 1


def test_each_base_model_has_its_own_queue(database_url, tmp_path):
    with running_api(database_url, tmp_path, worker_jobs=2, poll_cache_s=0) as api:
        alpha_1, alpha_2, beta_1 = _three_jobs(api)
        with api.session() as s:  # as if alpha's first job were of another base
            s.execute(update(Job).where(Job.id == alpha_1).values(model="another-base"))
            s.commit()
        assert [_position(api.client, alpha_1), _position(api.client, alpha_2),
                _position(api.other, beta_1)] == [1, 1, 2]


def test_a_heavier_project_gets_two_turns_to_one(database_url, tmp_path):
    with running_api(database_url, tmp_path, worker_jobs=2, poll_cache_s=0, project_weights={"alpha": 2}) as api:
        alpha_1, alpha_2, beta_1 = _three_jobs(api)
        assert [_position(api.client, alpha_1), _position(api.client, alpha_2),
                _position(api.other, beta_1)] == [1, 2, 3]


def test_workers_of_one_job_each_take_the_oldest_first(database_url, tmp_path):
    with running_api(database_url, tmp_path, poll_cache_s=0) as api:  # worker_jobs 1: the broker's order
        alpha_1, alpha_2, beta_1 = _three_jobs(api)
        assert [_position(api.client, alpha_1), _position(api.client, alpha_2),
                _position(api.other, beta_1)] == [1, 2, 3]
