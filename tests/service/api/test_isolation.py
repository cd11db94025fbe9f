"""Tenant isolation: another project's ids are 404 on every resource, never 403, never data."""

from __future__ import annotations

from service.repositories import job_outputs as outputs_repo
from service.repositories import job_lease, job_records
from tests.service.api.conftest import assert_error, cispo_body, uploaded

JOBS = "/v1/fine_tuning/jobs"


def test_every_resource_of_another_project_is_404(api):
    owner, stranger = api.client, api.other
    file_id = uploaded(owner)
    fn = owner.post("/v1/reward_functions", json={"name": "c", "spec": {"type": "contains"}}).json()
    body = cispo_body(file_id)
    body["method"]["cispo"] = {"reward_function": fn["id"]}
    job = owner.post(JOBS, json=body).json()
    with api.session() as s:
        epoch = job_lease.claim(s, job["id"], "w", ttl_s=60)
        job_records.record_step(s, job["id"], epoch, 1, {"loss": 1.0}, trained_tokens=1, ttl_s=60)
        sha = api.store.put_bytes(f"jobs/{job['id']}/ck/adapter.tar", b"tar")
        ckpt = job_records.add_checkpoint(s, job["id"], epoch, step=1, storage_prefix=f"jobs/{job['id']}/ck",
                                          files={"adapter.tar": {"sha256": sha, "bytes": 3},
                                                 "manifest.json": {"sha256": sha, "bytes": 3}}, metrics={})
        s.commit()
    j, c = job["id"], ckpt.id

    foreign = [
        ("get", f"/v1/files/{file_id}"), ("get", f"/v1/files/{file_id}/content"), ("delete", f"/v1/files/{file_id}"),
        ("get", f"/v1/reward_functions/{fn['id']}"), ("delete", f"/v1/reward_functions/{fn['id']}"),
        ("get", f"{JOBS}/{j}"), ("post", f"{JOBS}/{j}/cancel"), ("post", f"{JOBS}/{j}/pause"),
        ("post", f"{JOBS}/{j}/resume"), ("get", f"{JOBS}/{j}/events"), ("get", f"{JOBS}/{j}/metrics"),
        ("get", f"{JOBS}/{j}/checkpoints"), ("get", f"{JOBS}/{j}/checkpoints/{c}/content"),
        ("get", f"{JOBS}/{j}/checkpoints/{c}/files/manifest.json"),
    ]
    for method, path in foreign:
        r = getattr(stranger, method)(path)
        assert_error(r, 404)
        assert file_id not in r.text or path.startswith("/v1/files"), (method, path, r.text)

    # Lists show only one's own; cursors and references from the other project are unknown.
    assert stranger.get("/v1/files").json()["data"] == []
    assert stranger.get(JOBS).json()["data"] == []
    assert stranger.get("/v1/reward_functions").json()["data"] == []
    assert_error(stranger.get("/v1/files", params={"after": file_id}), 400, "after")
    assert_error(stranger.get(JOBS, params={"after": j}), 400, "after")
    assert_error(stranger.post(JOBS, json=cispo_body(file_id)), 400, "training_file")
    own_body = cispo_body(uploaded(stranger))
    own_body["method"]["cispo"] = {"reward_function": fn["id"]}
    assert_error(stranger.post(JOBS, json=own_body), 400, "reward_function")

    # And nothing the stranger tried changed the owner's resources.
    assert owner.get(f"{JOBS}/{j}").json()["status"] == "running"
    assert owner.get(f"/v1/files/{file_id}").status_code == 200
    assert owner.get(f"/v1/reward_functions/{fn['id']}").status_code == 200
    assert owner.get(f"{JOBS}/{j}/checkpoints/{c}/content").content == b"tar"


def test_own_job_id_with_another_projects_nested_ids(api):
    """A nested lookup that forgot its job filter would serve the owner's rows through the stranger's own job."""
    owner, stranger = api.client, api.other
    owner_job = owner.post(JOBS, json=cispo_body(uploaded(owner))).json()["id"]
    own_job = stranger.post(JOBS, json=cispo_body(uploaded(stranger))).json()["id"]
    with api.session() as s:
        epoch = job_lease.claim(s, owner_job, "w", ttl_s=60)
        job_records.record_step(s, owner_job, epoch, 1, {"loss": 1.0}, trained_tokens=1, ttl_s=60)
        outputs_repo.add_samples(s, owner_job, epoch, 1, [{"prompt": "secret prompt", "completion": "secret",
                                                           "reward": 1.0, "advantage": 0.0, "rewards": {}}])
        sha = api.store.put_bytes(f"jobs/{owner_job}/ck/adapter.tar", b"tar")
        ckpt = job_records.add_checkpoint(s, owner_job, epoch, step=1, storage_prefix=f"jobs/{owner_job}/ck",
                                          files={"adapter.tar": {"sha256": sha, "bytes": 3},
                                                 "manifest.json": {"sha256": sha, "bytes": 3}}, metrics={})
        s.commit()
        c = ckpt.id
    owner_events = owner.get(f"{JOBS}/{owner_job}/events").json()["data"]
    assert owner_events and owner.get(f"{JOBS}/{owner_job}/samples").json()["data"]  # there is something to leak

    mine = f"{JOBS}/{own_job}"
    assert stranger.post(f"{mine}/cancel").status_code == 200  # ended, so a wrongly opened stream would end too
    assert_error(stranger.get(f"{mine}/checkpoints/{c}/content"), 404, c)
    assert_error(stranger.get(f"{mine}/checkpoints/{c}/files/manifest.json"), 404, c)
    assert_error(stranger.get(f"{mine}/checkpoints", params={"after": c}), 400, "after")
    assert_error(stranger.get(f"{mine}/events", params={"after": owner_events[0]["id"]}), 400, "after")
    assert_error(stranger.get(f"{mine}/events", params={"stream": "true"},
                              headers={"Last-Event-ID": owner_events[0]["id"]}), 400, "Last-Event-ID")
    assert stranger.get(f"{mine}/checkpoints").json()["data"] == []
    assert stranger.get(f"{mine}/metrics").json()["data"] == []
    assert stranger.get(f"{mine}/samples").json()["data"] == []
    assert stranger.get(f"{mine}/samples", params={"step": 1}).json()["data"] == []
    own_events = stranger.get(f"{mine}/events", params={"limit": 100}).json()["data"]
    assert not {e["id"] for e in own_events} & {e["id"] for e in owner_events}
