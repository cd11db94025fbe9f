"""`make demo`'s path: `cispo up` on the embedded default (SQLite, a server-less
broker, a local object store), driven over REST, with no database or Redis server."""

from __future__ import annotations

import stat
import subprocess
import sys


def test_demo_runs_on_the_embedded_default(tmp_path):
    env_free = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONUNBUFFERED": "1",
                # an unreachable server would make any accidental use of Postgres or Redis fail loudly
                "DATABASE_URL": "", "BROKER_URL": "", "STORAGE_URL": ""}
    out = subprocess.run([sys.executable, "-m", "worker.toy.demo", "--root", str(tmp_path / "demo"), "--steps", "6"],
                         env=env_free, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "eval reward:" in out.stdout and "adapter of checkpoint" in out.stdout
    home = tmp_path / "demo" / "home"
    assert (home / "cispo.db").is_file() and (home / "broker.db").is_file()
    # every project's state is the owner's only (service/private_paths.py)
    assert {p: stat.S_IMODE((home / p).stat().st_mode) for p in ("", "cispo.db", "broker.db", "objects")} == {
        "": 0o700, "cispo.db": 0o600, "broker.db": 0o600, "objects": 0o700}
    assert (tmp_path / "demo" / "adapter" / "adapter_model.safetensors").is_file()
