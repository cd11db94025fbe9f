"""`cispo keys` and `cispo train --help` as a user runs them: separate processes, a real SQLite state directory."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time


def cispo(*args, cwd, **env) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("CISPO_HOME", "DATABASE_URL", "CISPO_DATABASE_URL")}
    return subprocess.run([sys.executable, "-m", "worker.cli", *args], env={**clean, **env}, cwd=cwd,
                          capture_output=True, text=True, timeout=60)


def test_keys_outside_the_state_directory_say_where_they_looked(tmp_path):
    for command in (["keys", "create", "--project", "p"], ["keys", "list"], ["keys", "revoke", "key-x"]):
        done = cispo(*command, cwd=tmp_path)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert f"no cispo database at {tmp_path / '.cispo' / 'cispo.db'}" in done.stderr
        assert "CISPO_HOME" in done.stderr and "DATABASE_URL" in done.stderr
    assert not (tmp_path / ".cispo").exists()  # nothing was created in the wrong place


def test_a_database_without_the_schema_is_a_message(tmp_path):
    home = tmp_path / "state"
    home.mkdir()
    sqlite3.connect(home / "cispo.db").close()  # a file, but no tables
    done = cispo("keys", "create", "--project", "p", cwd=tmp_path, CISPO_HOME=str(home))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "cannot use the database at sqlite:///" in done.stderr and "no such table" in done.stderr
    assert "cispo db upgrade" in done.stderr


def test_keys_list_shows_times_people_read(tmp_path):
    env = {"CISPO_HOME": str(tmp_path / "home")}
    assert cispo("db", "upgrade", cwd=tmp_path, **env).returncode == 0
    created = cispo("keys", "create", "--project", "p", cwd=tmp_path, **env)
    assert created.returncode == 0, created.stderr
    assert "last used: never" in cispo("keys", "list", cwd=tmp_path, **env).stdout
    used = 1_764_000_000  # 2025-11-24 16:00:00 UTC
    with sqlite3.connect(tmp_path / "home" / "cispo.db") as db:
        db.execute("UPDATE api_key SET last_used_at = ?", (used,))
    line = cispo("keys", "list", cwd=tmp_path, **env).stdout
    assert "last used: 2025-11-24 16:00:00 UTC" in line and str(used) not in line


def test_train_help_says_where_the_run_goes():
    out = subprocess.run([sys.executable, "-m", "worker.cli", "train", "--help"], capture_output=True, text=True,
                         timeout=60).stdout
    assert "runs/<spec" not in out and "next to the spec" in out
