"""`make demo`'s path: `cispo up` on the embedded default (SQLite, a server-less
broker, a local object store), driven over REST, with no database or Redis server."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time

from tests.processes import survivors, tagged


def test_demo_runs_on_the_embedded_default_and_leaves_no_process(tmp_path):
    env_free, tag = tagged({"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONUNBUFFERED": "1",
                            # an unreachable server would make any accidental use of Postgres or Redis fail loudly
                            "DATABASE_URL": "", "BROKER_URL": "", "STORAGE_URL": "",
                            # the worker's torch thread count (tests/conftest.py): at two threads on a loaded 2-core
                            # machine, the demo's tiny model took 130 s to build instead of 5
                            **{k: os.environ[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS") if k in os.environ}})
    demo = subprocess.Popen([sys.executable, "-m", "worker.toy.demo", "--root", str(tmp_path / "demo"), "--steps", "6"],
                            env=env_free, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, reported = "", None
        for line in demo.stdout:  # the stop begins once the report is printed
            stdout += line
            if line.startswith("eval reward:"):
                reported = time.monotonic()
        stderr = demo.stderr.read()
        assert demo.wait(timeout=600) == 0, stdout[-2000:] + stderr[-3000:]
        stopped_in = time.monotonic() - reported
    finally:
        demo.kill()
        left = survivors(tag)
    assert not left, f"processes outlived the demo: {left}"
    # An idle `cispo up` stops in about a second (it used to wait out 30 s, then leave its worker running).
    assert stopped_in < 10, f"the demo took {stopped_in:.1f} s to stop the service"
    assert "adapter of checkpoint" in stdout
    home = tmp_path / "demo" / "home"
    assert (home / "cispo.db").is_file() and (home / "broker.db").is_file()
    # every project's state is the owner's only (service/private_paths.py)
    assert {p: stat.S_IMODE((home / p).stat().st_mode) for p in ("", "cispo.db", "broker.db", "objects")} == {
        "": 0o700, "cispo.db": 0o600, "broker.db": 0o600, "objects": 0o700}
    assert (tmp_path / "demo" / "adapter" / "adapter_model.safetensors").is_file()
