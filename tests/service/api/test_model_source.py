"""`model`: hub ids, or local directories under the operator's model_dirs, and one error for the rest."""

from __future__ import annotations

import pytest

from tests.service.api.conftest import assert_error, cispo_body, running_api, uploaded

JOBS = "/v1/fine_tuning/jobs"


def _dry_run(api, model: str):
    """Create a job naming `model` (a dry run would go on to load the model's config; creation checks only
    where the name points)."""
    return api.client.post(JOBS, json=cispo_body(uploaded(api.client), model=model))


@pytest.fixture
def sqlite_url(tmp_path):
    from tests.conftest import make_database

    url, drop = make_database("sqlite", tmp_path)
    yield url
    drop()


def test_server_paths_are_refused_with_one_error_that_reveals_nothing(sqlite_url, tmp_path):
    with running_api(sqlite_url, tmp_path) as api:
        assert _dry_run(api, "Qwen/Qwen2.5-0.5B").status_code == 200
        assert _dry_run(api, "gpt2").status_code == 200
        errors = []
        for model in ("/etc", "/etc/passwd", "/nonexistent/model", "/root", "../../etc", "./model", "~/model",
                      "org/../../etc", "a/b/c"):
            errors.append(assert_error(_dry_run(api, model), 400, "model: must be a hub id"))
        assert all(e["param"] == "model" and e["code"] == "invalid_model" for e in errors)
        assert len({e["message"] for e in errors}) == 1  # an existing and a missing path look alike
        assert "CISPO_MODEL_DIRS" in errors[0]["message"]  # where an operator allows local models


def test_local_paths_are_accepted_only_under_an_allowed_model_dir(sqlite_url, tmp_path):
    allowed = tmp_path / "models"
    (allowed / "tiny").mkdir(parents=True)
    (tmp_path / "private").mkdir()
    (allowed / "escape").symlink_to(tmp_path / "private")
    with running_api(sqlite_url, tmp_path, model_dirs=f"{allowed}, /opt/other-models") as api:
        accepted = _dry_run(api, str(allowed / "tiny"))
        assert accepted.status_code == 200, accepted.text
        assert accepted.json()["model"] == str(allowed / "tiny")
        assert _dry_run(api, str(allowed / "not-there-yet")).status_code == 200  # existence is not checked here
        refused = [_dry_run(api, m) for m in (str(allowed), str(allowed / ".." / "private"), str(allowed / "escape"),
                                              str(tmp_path / "private"), "/etc")]
        messages = {assert_error(r, 400, "operator's model directories")["message"] for r in refused}
        assert len(messages) == 1
        relative = assert_error(_dry_run(api, "./models/tiny"), 400, "model: must be a hub id")["message"]
        assert messages == {relative} and "(CISPO_MODEL_DIRS); relative paths are not accepted" in relative
