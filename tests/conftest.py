"""Shared fixtures: the tiny model and the toy dataset, built once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def toy_dir(tmp_path_factory) -> Path:
    """A directory with the tiny model (model/), train.jsonl, val.jsonl and spec.yaml."""
    pytest.importorskip("torch")
    from worker.toy.__main__ import prepare

    root = tmp_path_factory.mktemp("toy")
    prepare(root)
    return root


# -- databases -----------------------------------------------------------------

PG_ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def _fresh_postgres(name: str) -> str:
    from sqlalchemy import create_engine, text

    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    return PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + name


def _drop_postgres(name: str) -> None:
    from sqlalchemy import create_engine, text

    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


def make_database(kind: str, tmp_path: Path) -> tuple[str, callable]:
    """A new, migrated database of the kind ('sqlite' or 'postgresql'); returns (url, drop)."""
    import uuid

    from service.db.migrate import upgrade

    if kind == "sqlite":
        url = f"sqlite:///{tmp_path / f'db-{uuid.uuid4().hex[:8]}.sqlite'}"
        drop = lambda: None  # noqa: E731
    else:
        name = f"cispo_test_{uuid.uuid4().hex[:10]}"
        url = _fresh_postgres(name)
        drop = lambda: _drop_postgres(name)  # noqa: E731
    upgrade(url)
    return url, drop


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request, tmp_path) -> str:
    """A fresh database built by `alembic upgrade head`, on SQLite and on the real PostgreSQL."""
    url, drop = make_database(request.param, tmp_path)
    yield url
    from service.db.session import session_factory

    session_factory(url).kw["bind"].dispose()
    drop()


@pytest.fixture
def postgres_url(tmp_path) -> str:
    url, drop = make_database("postgresql", tmp_path)
    yield url
    from service.db.session import session_factory

    session_factory(url).kw["bind"].dispose()
    drop()
