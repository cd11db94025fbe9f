"""Job control (cancel / pause / resume) and what a run leaves: events, metrics, checkpoints, downloads.

The worker's writes are simulated through the same repository functions the
worker uses (claim, record_step, add_checkpoint, finish).
"""

from __future__ import annotations

import hashlib

import pytest

from service.repositories import job_lease, job_records, jobs as jobs_repo
from tests.service.api.conftest import assert_error, cispo_body, created_job, running_api, uploaded
from tests.project_docs import docs_text

JOBS = "/v1/fine_tuning/jobs"


def _claim(api, job_id: str) -> int:
    with api.session() as s:
        epoch = job_lease.claim(s, job_id, "worker-1", ttl_s=60)
        s.commit()
    assert epoch is not None
    return epoch


def _checkpoint(api, job_id: str, epoch: int, step: int, files: dict[str, bytes], metrics=None) -> str:
    prefix = f"jobs/{job_id}/checkpoints/step-{step}"
    meta = {}
    for rel, data in files.items():
        meta[rel] = {"sha256": api.store.put_bytes(f"{prefix}/{rel}", data), "bytes": len(data)}
    with api.session() as s:
        ckpt = job_records.add_checkpoint(s, job_id, epoch, step=step, storage_prefix=prefix, files=meta,
                                          metrics=metrics or {"reward_mean": 0.5})
        s.commit()
        return ckpt.id


def _control(api, job_id: str, action: str):
    return api.client.post(f"{JOBS}/{job_id}/{action}")


def test_cancel_a_queued_job_then_cancelling_again_is_409_without_retry(api):
    job = created_job(api)
    r = _control(api, job["id"], "cancel")
    assert r.status_code == 200 and r.json()["status"] == "cancelled" and r.json()["finished_at"] is not None
    again = _control(api, job["id"], "cancel")
    error = assert_error(again, 409, "cancelled")
    assert again.headers["x-should-retry"] == "false" and error["code"] == "invalid_job_state"
    assert_error(_control(api, job["id"], "resume"), 409)
    assert_error(_control(api, job["id"], "pause"), 409)


def test_pause_and_resume_a_queued_job_enqueues_again_after_commit(api):
    job = created_job(api)
    assert _control(api, job["id"], "pause").json()["status"] == "paused"
    assert_error(_control(api, job["id"], "pause"), 409, "paused")
    r = _control(api, job["id"], "resume")
    assert r.status_code == 200 and r.json()["status"] == "queued"
    assert api.enqueued.ids == [job["id"], job["id"]]
    assert api.enqueued.visible_at_send == [True, True]
    assert_error(_control(api, job["id"], "resume"), 409, "queued")
    assert api.enqueued.ids == [job["id"], job["id"]]  # an illegal resume sends nothing


def test_cancel_and_pause_of_a_running_job_are_requests_the_worker_honours(api):
    job = created_job(api)
    epoch = _claim(api, job["id"])
    assert _control(api, job["id"], "pause").json()["status"] == "running"
    assert _control(api, job["id"], "cancel").json()["status"] == "running"
    with api.session() as s:
        control = job_lease.heartbeat(s, job["id"], epoch, ttl_s=60)
        s.commit()
    assert (control.cancel, control.pause) == (True, True)


def test_events_are_newest_first_and_paginate(api):
    job = created_job(api)
    _control(api, job["id"], "pause")
    _control(api, job["id"], "resume")
    page = api.client.get(f"{JOBS}/{job['id']}/events", params={"limit": 2}).json()
    assert [e["message"] for e in page["data"]] == ["Job resumed", "Job paused"] and page["has_more"]
    event = page["data"][0]
    assert event["object"] == "fine_tuning.job.event" and event["level"] == "info" and event["type"] == "message"
    rest = api.client.get(f"{JOBS}/{job['id']}/events", params={"after": page["last_id"]}).json()
    assert [e["message"] for e in rest["data"]] == ["Job created"] and not rest["has_more"]
    assert_error(api.client.get(f"{JOBS}/{job['id']}/events", params={"after": "ftevent-nope"}), 400, "after")


def test_a_finished_job_reports_progress_metrics_and_its_model_name(api):
    job = created_job(api, suffix="exp")
    epoch = _claim(api, job["id"])
    with api.session() as s:
        for step in (1, 2, 3):
            assert job_records.record_step(s, job["id"], epoch, step, {"loss": 1.0 / step, "reward_mean": step / 10},
                                           trained_tokens=100, ttl_s=60)
        assert job_lease.finish(s, job["id"], epoch, "succeeded")
        s.commit()
    got = api.client.get(f"{JOBS}/{job['id']}").json()
    assert (got["status"], got["steps_done"], got["trained_tokens"]) == ("succeeded", 3, 300)
    assert got["fine_tuned_model"] == f"ft:tiny-model:alpha:exp:{job['id']}"
    metrics = api.client.get(f"{JOBS}/{job['id']}/metrics").json()
    # loss, reward_mean and each step's trained_tokens (what the job's trained_tokens sums)
    assert metrics["object"] == "list" and len(metrics["data"]) == 9 and not metrics["has_more"]
    assert sum(m["value"] for m in metrics["data"] if m["name"] == "trained_tokens") == got["trained_tokens"]
    assert metrics["data"][0] == {"step": 1, "name": "loss", "value": 1.0}
    some = api.client.get(f"{JOBS}/{job['id']}/metrics",
                          params=[("name", "reward_mean"), ("step_min", 2), ("step_max", 3)]).json()
    assert [(m["step"], m["value"]) for m in some["data"]] == [(2, 0.2), (3, 0.3)]
    limited = api.client.get(f"{JOBS}/{job['id']}/metrics", params={"limit": 4}).json()
    assert len(limited["data"]) == 4 and limited["has_more"]
    assert_error(api.client.get(f"{JOBS}/{job['id']}/metrics", params={"step_min": -1}), 400, "step_min")


def test_the_documented_orders_are_the_served_ones(api):
    """Metrics are a time series, oldest first; events, checkpoints and samples newest first. The docs (README.md,
    docs/) and the OpenAPI descriptions say so (the README used to say newest first for metrics too)."""
    paths = api.client.get("/openapi.json").json()["paths"]
    prefix = "/v1/fine_tuning/jobs/{fine_tuning_job_id}"
    assert "oldest step first" in paths[f"{prefix}/metrics"]["get"]["description"]
    assert "newest step first" in paths[f"{prefix}/samples"]["get"]["description"]
    [metrics_row] = [line for line in docs_text().splitlines() if line.startswith("| `GET .../{id}/metrics`")]
    assert "oldest step first" in metrics_row and "newest" not in metrics_row


def test_failed_job_shows_its_error(api):
    job = created_job(api)
    epoch = _claim(api, job["id"])
    with api.session() as s:
        job_lease.finish(s, job["id"], epoch, "failed", error_code="invalid_training_file",
                         error_message="line 3: bad row", error_param="training_file")
        s.commit()
    got = api.client.get(f"{JOBS}/{job['id']}").json()
    assert got["error"] == {"code": "invalid_training_file", "message": "line 3: bad row", "param": "training_file"}
    assert got["fine_tuned_model"] is None


def test_checkpoints_list_and_download_with_sha256(api):
    job = created_job(api)
    epoch = _claim(api, job["id"])
    archive, weights, manifest = b"tar bytes" * 1000, b"safetensors bytes", b'{"files": {}}'
    ids = [_checkpoint(api, job["id"], epoch, step, {"adapter/adapter_model.safetensors": weights,
                                                     "trainer_state/optimizer.pt": b"secret state",
                                                     "adapter.tar": archive, "manifest.json": manifest})
           for step in (1, 2)]
    page = api.client.get(f"{JOBS}/{job['id']}/checkpoints").json()
    assert [c["id"] for c in page["data"]] == ids[::-1]
    ckpt = page["data"][0]
    assert ckpt["object"] == "fine_tuning.job.checkpoint" and ckpt["step_number"] == 2
    assert ckpt["metrics"] == {"reward_mean": 0.5}
    assert ckpt["fine_tuned_model_checkpoint"] == f"ft:tiny-model:alpha::{job['id']}:ckpt-step-2"
    assert ckpt["fine_tuning_job_id"] == job["id"]
    after = api.client.get(f"{JOBS}/{job['id']}/checkpoints", params={"after": ids[1], "limit": 1}).json()
    assert [c["id"] for c in after["data"]] == [ids[0]]

    base = f"{JOBS}/{job['id']}/checkpoints/{ids[1]}"
    r = api.client.get(f"{base}/content")
    assert r.status_code == 200 and r.content == archive
    assert r.headers["x-sha256"] == hashlib.sha256(archive).hexdigest()
    r = api.client.get(f"{base}/files/adapter/adapter_model.safetensors")
    assert r.content == weights and r.headers["x-sha256"] == hashlib.sha256(weights).hexdigest()
    assert api.client.get(f"{base}/files/manifest.json").content == manifest
    for hidden in ("trainer_state/optimizer.pt", "adapter.tar", "adapter/missing.bin", "../../files/x"):
        assert_error(api.client.get(f"{base}/files/{hidden}"), 404)
    assert_error(api.client.get(f"{JOBS}/{job['id']}/checkpoints/ftckpt_nope/content"), 404, "ftckpt_nope")


def test_missing_checkpoint_object_is_a_404_not_a_500(api):
    job = created_job(api)
    epoch = _claim(api, job["id"])
    ckpt_id = _checkpoint(api, job["id"], epoch, 1, {"adapter.tar": b"x"})
    api.store.delete(f"jobs/{job['id']}/checkpoints/step-1/adapter.tar")
    assert_error(api.client.get(f"{JOBS}/{job['id']}/checkpoints/{ckpt_id}/content"), 404, "missing")


def test_list_jobs_paginates_and_filters_by_metadata(api):
    a = created_job(api, metadata={"team": "rl", "run": "1"})
    b = created_job(api, metadata={"team": "sft"})
    c = created_job(api, metadata={"team": "rl", "run": "2"})
    page = api.client.get(JOBS, params={"limit": 2}).json()
    assert [j["id"] for j in page["data"]] == [c["id"], b["id"]] and page["has_more"]
    rest = api.client.get(JOBS, params={"limit": 2, "after": page["last_id"]}).json()
    assert [j["id"] for j in rest["data"]] == [a["id"]] and not rest["has_more"]
    rl = api.client.get(JOBS, params={"metadata[team]": "rl"}).json()
    assert [j["id"] for j in rl["data"]] == [c["id"], a["id"]]
    one = api.client.get(JOBS, params={"metadata[team]": "rl", "metadata[run]": "1"}).json()
    assert [j["id"] for j in one["data"]] == [a["id"]]
    assert_error(api.client.get(JOBS, params={"after": "ftjob-nope"}), 400, "after")
    assert_error(api.client.get(JOBS, params={"limit": 101}), 400, "limit")
    assert_error(api.client.get(f"{JOBS}/ftjob-nope"), 404, "ftjob-nope")
    assert_error(_control(api, "ftjob-nope", "cancel"), 404)


def test_non_finite_checkpoint_metrics_are_reported_as_null(api):
    if not api.database_url.startswith("sqlite"):
        pytest.skip("PostgreSQL's JSON type refuses NaN outright, so such a row cannot exist there")
    job = created_job(api)
    epoch = _claim(api, job["id"])
    _checkpoint(api, job["id"], epoch, 1, {"adapter.tar": b"x"}, metrics={"loss": float("nan"), "r": 1.0})
    r = api.client.get(f"{JOBS}/{job['id']}/checkpoints")
    assert r.status_code == 200 and r.json()["data"][0]["metrics"] == {"loss": None, "r": 1.0}


def test_a_project_over_its_active_job_quota_gets_429_and_others_do_not(database_url, tmp_path):
    with running_api(database_url, tmp_path, max_active_jobs=2) as api:
        file_id = uploaded(api.client)
        first, second = (api.client.post(JOBS, json=cispo_body(file_id)).json() for _ in range(2))
        r = api.client.post(JOBS, json=cispo_body(file_id))
        error = assert_error(r, 429, "2 queued or running jobs")
        assert error["code"] == "active_job_quota_exceeded" and int(r.headers["retry-after"]) >= 1
        assert len(api.enqueued.ids) == 2  # nothing was created or enqueued for the refused one
        assert api.other.post(JOBS, json=cispo_body(uploaded(api.other))).status_code == 200  # per project

        assert api.client.post(f"{JOBS}/{first['id']}/pause").status_code == 200  # paused: not active
        assert api.client.post(JOBS, json=cispo_body(file_id)).status_code == 200
        assert_error(api.client.post(f"{JOBS}/{first['id']}/resume"), 429, "queued or running")
        assert api.client.post(f"{JOBS}/{second['id']}/cancel").status_code == 200
        assert api.client.post(f"{JOBS}/{first['id']}/resume").status_code == 200


LEGAL = {"cancel": {"validating_files", "queued", "running", "paused"}, "pause": {"queued", "running"},
         "resume": {"paused"}}


def _job_in(api, status: str) -> str:
    """A job brought to `status` the way it gets there: the worker's lease for running and the terminal
    ends, the API for paused and cancelled (validating_files is set directly: it lasts only a request)."""
    from sqlalchemy import update

    from service.db.models import Job

    job_id = created_job(api)["id"]
    if status in ("running", "succeeded", "failed"):
        epoch = _claim(api, job_id)
        if status != "running":
            with api.session() as s:
                assert job_lease.finish(s, job_id, epoch, status)
                s.commit()
    elif status in ("paused", "cancelled"):
        assert _control(api, job_id, {"paused": "pause", "cancelled": "cancel"}[status]).status_code == 200
    elif status == "validating_files":
        with api.session() as s:
            s.execute(update(Job).where(Job.id == job_id).values(status=status))
            s.commit()
    return job_id


@pytest.mark.parametrize("status", ["validating_files", "queued", "running", "paused", "succeeded", "failed",
                                    "cancelled"])
def test_every_illegal_transition_is_409_without_retry_and_changes_nothing(api, status):
    job_id = _job_in(api, status)
    before = api.client.get(f"{JOBS}/{job_id}").json()
    assert before["status"] == status
    sent = len(api.enqueued.ids)
    for action in sorted(set(LEGAL) - {a for a, legal in LEGAL.items() if status in legal}):
        r = _control(api, job_id, action)
        error = assert_error(r, 409, status)
        assert r.headers["x-should-retry"] == "false" and error["code"] == "invalid_job_state", action
        after = api.client.get(f"{JOBS}/{job_id}").json()
        assert (after["status"], after["finished_at"]) == (before["status"], before["finished_at"]), action
    assert len(api.enqueued.ids) == sent  # an illegal resume sends nothing
    with api.session() as s:
        job = jobs_repo.get_for_worker(s, job_id)
        assert not job.cancel_requested and not job.pause_requested
