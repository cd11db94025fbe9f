"""/v1/models: a project's succeeded jobs are its fine-tuned models, in OpenAI's shapes, and can be deleted."""

from __future__ import annotations

from tests.service.api.conftest import assert_error, created_job
from tests.service.api.trained import train


def test_a_succeeded_job_is_a_model_listed_fetched_and_deleted(api):
    job = created_job(api, suffix="poet")
    running = created_job(api)
    out = train(api.database_url, api.store, job["id"])
    train(api.database_url, api.store, running["id"], status=None)

    listed = api.client.get("/v1/models").json()
    done = api.client.get(f"/v1/fine_tuning/jobs/{job['id']}").json()
    model_id = f"ft:tiny-model:alpha:poet:{job['id']}"
    assert done["fine_tuned_model"] == model_id
    assert [m["id"] for m in listed["data"]] == [model_id]  # the running job is no model yet
    model = listed["data"][0]
    assert model["object"] == "model" and model["owned_by"] == done["organization_id"]
    assert model["created"] == done["finished_at"] and model["root"] == "tiny-model"
    assert api.client.get(f"/v1/models/{model_id}").json() == model

    assert_error(api.other.get(f"/v1/models/{model_id}"), 404, "no such model")  # another project
    assert_error(api.client.get(f"/v1/models/ft:other-base:alpha:poet:{job['id']}"), 404, "no such model")
    assert_error(api.client.get(f"/v1/models/ft:tiny-model:alpha::{running['id']}"), 404, "no such model")

    deleted = api.client.delete(f"/v1/models/{model_id}")
    assert deleted.status_code == 200, deleted.text
    assert deleted.json() == {"id": model_id, "object": "model", "deleted": True}
    assert api.client.get("/v1/models").json()["data"] == []
    assert_error(api.client.get(f"/v1/models/{model_id}"), 404)
    assert_error(api.client.delete(f"/v1/models/{model_id}"), 404)
    # The adapter bytes and the checkpoint rows are gone; the job and its history stay.
    assert not api.store.exists(f"{out['prefix']}/adapter.tar")
    assert api.client.get(f"/v1/fine_tuning/jobs/{job['id']}/checkpoints").json()["data"] == []
    events = api.client.get(f"/v1/fine_tuning/jobs/{job['id']}/events").json()["data"]
    assert events[0]["message"].startswith("Fine-tuned model deleted")


def test_models_page_with_a_model_id_cursor(api):
    jobs = [created_job(api) for _ in range(3)]
    for job in jobs:
        train(api.database_url, api.store, job["id"], checkpoint_step=None)
    first = api.client.get("/v1/models", params={"limit": 2}).json()
    assert first["has_more"] is True and len(first["data"]) == 2
    rest = api.client.get("/v1/models", params={"limit": 2, "after": first["last_id"]}).json()
    ids = [m["fine_tuning_job_id"] for m in first["data"] + rest["data"]]
    assert ids == [j["id"] for j in reversed(jobs)] and rest["has_more"] is False


def test_deleting_a_model_unnames_its_best_checkpoint(api):
    """The job object stops naming a best checkpoint whose row and files went with the model (it named a
    checkpoint that no longer existed)."""
    from service.db.session import session_factory
    from service.repositories import job_evidence
    from service.repositories import job_lease

    job = created_job(api)
    out = train(api.database_url, api.store, job["id"], status=None)
    with session_factory(api.database_url).begin() as s:
        assert job_evidence.set_best_checkpoint(s, job["id"], out["epoch"], out["checkpoint"])
        assert job_lease.finish(s, job["id"], out["epoch"], "succeeded")
    url = f"/v1/fine_tuning/jobs/{job['id']}"
    done = api.client.get(url).json()
    assert done["best_checkpoint"] == out["checkpoint"]

    assert api.client.delete(f"/v1/models/{done['fine_tuned_model']}").status_code == 200
    after = api.client.get(url)
    assert after.status_code == 200 and after.json()["best_checkpoint"] is None
    assert api.client.get(f"{url}/checkpoints").json()["data"] == []
