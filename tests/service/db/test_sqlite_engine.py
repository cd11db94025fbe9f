"""The embedded SQLite engine: WAL with commits that do not wait for the disk, yet survive the process dying."""

from __future__ import annotations

import subprocess
import sys

from sqlalchemy import text

from service.db.session import make_engine

WRITER = """
import os, sys
from sqlalchemy import text
from service.db.session import make_engine
engine = make_engine(sys.argv[1])
with engine.begin() as conn:
    conn.execute(text("CREATE TABLE t (a INTEGER)"))
with engine.begin() as conn:
    conn.execute(text("INSERT INTO t VALUES (42)"))
os._exit(0)  # no close, no checkpoint: what a killed API or worker leaves
"""


def test_sqlite_commits_in_wal_without_a_sync_each(tmp_path):
    engine = make_engine(f"sqlite:///{tmp_path / 'a.db'}")
    with engine.connect() as conn:
        assert conn.execute(text("PRAGMA journal_mode")).scalar() == "wal"
        assert conn.execute(text("PRAGMA synchronous")).scalar() == 1  # NORMAL (FULL is 2: an fsync per commit)
    engine.dispose()


def test_a_commit_survives_the_process_that_made_it_dying(tmp_path):
    url = f"sqlite:///{tmp_path / 'a.db'}"
    subprocess.run([sys.executable, "-c", WRITER, url], check=True, timeout=120)
    engine = make_engine(url)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT a FROM t")).scalars().all() == [42]
    engine.dispose()
