"""Alembic glue: `cispo db upgrade`, embedded start and the tests all build the schema this way."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

from service.private_paths import private_file, sqlite_file

MIGRATIONS = Path(__file__).resolve().parents[2] / "migrations"


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    cfg.set_main_option("file_template", "%%(year)d_%%(month).2d_%%(day).2d_%%(rev)s_%%(slug)s")
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    if (path := sqlite_file(url)) is not None:
        private_file(path)  # Alembic's own engine would create it 0644
    command.upgrade(alembic_config(url), revision)
