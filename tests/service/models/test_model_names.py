"""What a request's `model` names, resolved within the caller's project (service/models/start.py for a job's
starting point and an eval's model, service/serving/targets.py for serving), through the repositories: every
form of a fine-tuned model's name reaches its checkpoint, another project's is a 404 like one that does not exist."""

from __future__ import annotations

import pytest

from service.db.models import Checkpoint, Job
from service.db.session import session_factory
from service.errors import InvalidRequest, NotFound
from service.models import start
from service.models.fine_tuned import model_id
from service.repositories import jobs, projects
from service.serving import targets
from service.settings import Settings


def _job(s, project_id: str, status: str, lora: dict | None = {"r": 4}) -> Job:
    return jobs.add(s, Job(project_id=project_id, status=status, model="org/base", training_file="file-t",
                           spec={"model": "org/base", "lora": lora}, method={"type": "cispo"}, seed=1,
                           total_steps=10, suffix="s"))


def _checkpoint(s, job: Job, step: int) -> Checkpoint:
    s.add(ckpt := Checkpoint(job_id=job.id, step=step, storage_prefix=f"{job.id}/step-{step}",
                             files={"adapter.tar": {"sha256": "0" * 64, "bytes": 1}}, metrics={}))
    s.flush()
    return ckpt


@pytest.fixture
def made(database_url):
    sessions = session_factory(database_url)
    with sessions.begin() as s:
        own, other = (projects.get_or_create_project(s, name) for name in ("own", "other"))
        done, running, full, theirs = (_job(s, own.id, "succeeded"), _job(s, own.id, "running"),
                                       _job(s, own.id, "succeeded", lora=None), _job(s, other.id, "succeeded"))
        ckpts = {(j.id, step): _checkpoint(s, j, step).id for j in (done, running, full, theirs) for step in (1, 2)}
        names = {label: model_id(j, p.name) for label, j, p in [("done", done, own), ("running", running, own),
                                                                 ("full", full, own), ("theirs", theirs, other)]}
        ids = {"done": done.id, "running": running.id, "theirs": theirs.id}
    return sessions, own.id, names, ids, ckpts


def test_each_form_of_a_name_reaches_its_checkpoint_in_the_project(made):
    sessions, own, names, ids, ckpts = made
    with sessions() as s:
        final = start.resolve(s, own, names["done"])
        assert (final.checkpoint_id, final.source_job_id, final.base_model, final.lora) == \
            (ckpts[ids["done"], 2], ids["done"], "org/base", {"r": 4})
        assert start.resolve(s, own, f"{names['done']}:ckpt-step-1").checkpoint_id == ckpts[ids["done"], 1]
        by_id = start.resolve(s, own, ckpts[ids["running"], 1])  # a running job's checkpoint, by its id
        assert (by_id.checkpoint_id, by_id.source_job_id) == (ckpts[ids["running"], 1], ids["running"])
        assert start.resolve(s, own, f"{names['running']}:ckpt-step-2").checkpoint_id == ckpts[ids["running"], 2]


@pytest.mark.parametrize("name", ["theirs", "theirs:ckpt-step-1", "theirs-ckpt-id", "done:ckpt-step-3",
                                  "running", "done-renamed"])
def test_another_projects_or_an_unknown_name_is_not_found(made, name):
    sessions, own, names, ids, ckpts = made
    model = {"theirs": names["theirs"], "theirs:ckpt-step-1": f"{names['theirs']}:ckpt-step-1",
             "theirs-ckpt-id": ckpts[ids["theirs"], 1], "done:ckpt-step-3": f"{names['done']}:ckpt-step-3",
             "running": names["running"], "done-renamed": names["done"].replace(":own:", ":other:")}[name]
    with sessions() as s, pytest.raises(NotFound) as e:
        start.resolve(s, own, model)
    assert e.value.param == "model"


def test_serving_resolves_a_checkpoint_with_its_files_and_a_base_the_project_trained_on(made, tmp_path):
    sessions, own, names, ids, ckpts = made
    settings = Settings(home=str(tmp_path))
    with sessions() as s:
        target = targets.resolve(s, own, f"{names['done']}:ckpt-step-1", settings)
        assert target.base == "org/base" and target.checkpoint == {
            "id": ckpts[ids["done"], 1], "prefix": f"{ids['done']}/step-1",
            "files": {"adapter.tar": {"sha256": "0" * 64, "bytes": 1}}}
        assert targets.resolve(s, own, "org/base", settings).checkpoint is None  # its jobs trained on it
        with pytest.raises(NotFound):
            targets.resolve(s, own, "org/never-trained", settings)
        with pytest.raises(InvalidRequest, match="full fine-tune"):
            targets.resolve(s, own, names["full"], settings)
