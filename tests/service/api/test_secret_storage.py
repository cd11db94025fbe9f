"""Secrets at rest are encrypted, bound to hosts (refused elsewhere, by field), and migrated from clear."""

from __future__ import annotations

import stat

from sqlalchemy import create_engine, text

from service.db.migrate import upgrade
from service.egress import BoundSecret
from service.repositories import secrets as secrets_repo
from service.secrets.box import secret_box
from service.settings import Settings
from tests.service.api.conftest import assert_error, cispo_body, running_api, uploaded

VALUE = "Bearer sk-live-4c1d-at-rest"


def _raw_rows(url: str) -> list[tuple]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.execute(text("SELECT * FROM secret"))]
    finally:
        engine.dispose()


def test_values_are_encrypted_at_rest_with_a_0600_key_file(database_url, tmp_path):
    with running_api(database_url, tmp_path) as api:
        r = api.client.post("/v1/secrets", json={"name": "k", "value": VALUE, "hosts": ["grader.example.com"]})
        assert r.status_code == 200, r.text
        rows = _raw_rows(database_url)
        assert len(rows) == 1 and VALUE not in str(rows) and "sk-live" not in str(rows)
        key_file = tmp_path / "home" / "secret.key"
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
        with api.session() as s:
            project_id = s.execute(text("SELECT project_id FROM secret")).scalar()
            got = secrets_repo.values(s, project_id, ["k"], secret_box(api.app.state.settings))
        assert got == {"k": VALUE} and isinstance(got["k"], BoundSecret) and got["k"].hosts == ("grader.example.com",)


def test_a_spec_that_would_send_a_secret_elsewhere_is_refused_by_field(database_url, tmp_path):
    with running_api(database_url, tmp_path, egress_allow="127.0.0.1") as api:
        c = api.client
        secret = {"name": "k", "value": VALUE, "hosts": ["grader.example.com"]}
        assert c.post("/v1/secrets", json=secret).status_code == 200
        elsewhere = {"type": "http", "url": "http://127.0.0.1:9/score", "auth_secret": "k"}
        for response, param in [
            (c.post("/v1/reward_functions", json={"name": "r", "spec": elsewhere}), "spec"),
            (c.post("/v1/reward_functions/test", json={"spec": elsewhere, "completions": ["a"]}), "spec"),
            (c.post("/v1/environments", json={"name": "e", "spec": {**elsewhere, "url": "http://127.0.0.1:9/env"}}),
             "spec.auth_secret"),
            (c.post("/v1/fine_tuning/jobs", json=cispo_body(uploaded(c), method={"type": "cispo", "cispo": {
                "reward": elsewhere}})), "method.cispo.reward"),
        ]:
            error = assert_error(response, 400, "'k' may only be sent to grader.example.com", "'127.0.0.1'")
            assert error["param"] == param and error["code"] == "secret_host_not_allowed"
        judge = {"type": "score_model", "model": "m", "input": [{"role": "user", "content": "x"}],
                 "base_url": "http://127.0.0.1:9/v1", "auth_secret": "k"}
        assert_error(c.post("/v1/reward_functions", json={"name": "j", "spec": judge}), 400, "may only be sent to")
        assert not api.enqueued.ids


def test_the_migration_encrypts_clear_values_and_binds_them_to_the_hosts_in_use(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'legacy.sqlite'}"
    upgrade(url, "0002")
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO project (id, name, created_at) VALUES ('proj_1', 'p', 0)"))
        for sid, name in (("secret-1", "used"), ("secret-2", "unused")):
            conn.execute(text("INSERT INTO secret (id, project_id, name, value, created_at) "
                              "VALUES (:id, 'proj_1', :name, :value, 0)"), {"id": sid, "name": name, "value": VALUE})
        conn.execute(text("INSERT INTO reward_function (id, project_id, name, spec, created_at) VALUES "
                          "('rwfn-1', 'proj_1', 'r', :spec, 0)"),
                     {"spec": '{"type": "multi", "rewards": {"a": {"type": "http", "url": '
                              '"https://Grader.Example.com/score", "auth_secret": "used"}}}'})
    engine.dispose()
    monkeypatch.setenv("CISPO_HOME", str(tmp_path / "home"))
    from service.settings import get_settings
    get_settings.cache_clear()
    try:
        upgrade(url)
        box = secret_box(Settings(home=tmp_path / "home"))
    finally:
        get_settings.cache_clear()
    rows = _raw_rows(url)
    assert VALUE not in str(rows)
    engine = create_engine(url)
    with engine.connect() as conn:
        got = {name: (box.open(ct), hosts) for name, ct, hosts in
               conn.execute(text("SELECT name, ciphertext, hosts FROM secret"))}
    engine.dispose()
    assert got == {"used": (VALUE, '["grader.example.com"]'), "unused": (VALUE, "[]")}
