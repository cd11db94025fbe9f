"""The schema comes from Alembic, and the ORM models never drift from it."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect

from service.db.models import Base


def test_upgrade_from_empty_builds_every_table(database_url):
    engine = create_engine(database_url)
    try:
        tables = set(inspect(engine).get_table_names())
    finally:
        engine.dispose()
    assert set(Base.metadata.tables) <= tables
    assert "alembic_version" in tables


def test_models_match_the_migrations(database_url):
    """No pending autogenerate diff: a model change without a migration fails here."""
    engine = create_engine(database_url)
    try:
        with engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
    finally:
        engine.dispose()
    assert diff == []


def test_metric_rows_are_unique_per_job_step_and_name(database_url):
    engine = create_engine(database_url)
    try:
        pk = inspect(engine).get_pk_constraint("job_metric")["constrained_columns"]
    finally:
        engine.dispose()
    assert sorted(pk) == ["job_id", "name", "step"]
