"""Embedded state (database, broker file, local object store) is readable by its owner only."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

from sqlalchemy import text

from service.db.session import make_engine
from service.queue import enqueue_job
from service.settings import Settings
from service.storage import LocalStore


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_cispo_db_upgrade_makes_a_private_home_and_database(tmp_path):
    home = tmp_path / "home"
    env = {**os.environ, "CISPO_HOME": str(home), "DATABASE_URL": "", "BROKER_URL": "", "STORAGE_URL": ""}
    out = subprocess.run([sys.executable, "-m", "worker.cli", "db", "upgrade"], env=env, capture_output=True,
                         text=True, timeout=120, preexec_fn=lambda: os.umask(0o022))  # the usual umask
    assert out.returncode == 0, out.stderr[-2000:]
    assert mode(home) == 0o700 and mode(home / "cispo.db") == 0o600


def test_the_database_broker_file_and_objects_are_created_private(tmp_path):
    old = os.umask(0o022)
    try:
        settings = Settings(home=tmp_path / "home", database_url="", broker_url="", storage_url="")
        engine = make_engine(settings.resolved_database_url())
        with engine.begin() as conn:  # WAL mode: writing creates cispo.db-wal and -shm beside it
            conn.execute(text("CREATE TABLE t (x INTEGER)"))
            conn.execute(text("INSERT INTO t VALUES (1)"))
        enqueue_job("ftjob-1", settings=settings)
        store = LocalStore(settings.resolved_storage_url())
        store.put_bytes("files/file-1", b"tenant data")
        store.put_bytes("jobs/j/checkpoints/step-1/adapter.bin", b"weights")
        db = settings.home / "cispo.db"
        files = [db, db.with_name("cispo.db-wal"), db.with_name("cispo.db-shm"), settings.home / "broker.db",
                 store.root / "files" / "file-1", store.root / "jobs/j/checkpoints/step-1/adapter.bin"]
        assert {str(f.relative_to(tmp_path)): mode(f) for f in files} == {
            str(f.relative_to(tmp_path)): 0o600 for f in files}
        assert mode(settings.home) == 0o700 and mode(store.root) == 0o700
        engine.dispose()
    finally:
        os.umask(old)


def test_state_an_older_version_left_world_readable_is_narrowed(tmp_path):
    home = tmp_path / "home"
    (home / "objects").mkdir(parents=True, mode=0o755)
    os.chmod(home / "objects", 0o755)
    for name in ("cispo.db", "cispo.db-wal"):
        (home / name).touch()
        os.chmod(home / name, 0o644)
    settings = Settings(home=home, database_url="", broker_url="", storage_url="")
    make_engine(settings.resolved_database_url()).dispose()
    LocalStore(settings.resolved_storage_url())
    assert mode(home / "cispo.db") == 0o600 and mode(home / "cispo.db-wal") == 0o600
    assert mode(home / "objects") == 0o700
