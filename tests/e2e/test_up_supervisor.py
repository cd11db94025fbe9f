"""`cispo up` as operators run it: a worker that dies is restarted, and SIGTERM leaves no orphan."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import free_port
from tests.processes import survivors, tagged
from worker.toy.demo import wait_healthy


def _children(pid: int) -> dict[int, str]:
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            try:
                out[int(child)] = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except FileNotFoundError:
                pass
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def _worker_of(up: subprocess.Popen, timeout: float = 60) -> int:
    deadline = time.time() + timeout
    while time.time() < deadline:
        # "worker --pool" is in the argv, and in the title Celery gives itself where setproctitle is installed.
        workers = [pid for pid, cmd in _children(up.pid).items() if "worker --pool" in cmd]
        if workers:
            return workers[0]
        time.sleep(0.2)
    raise AssertionError("cispo up runs no worker")


def test_up_restarts_a_dead_worker_and_stops_everything_on_sigterm(tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "BROKER_URL", "STORAGE_URL")}
    env.update(CISPO_HOME=str(tmp_path / "home"), PYTHONUNBUFFERED="1")
    env, tag = tagged(env)
    log = tmp_path / "up.log"
    with log.open("w") as out:
        up = subprocess.Popen([sys.executable, "-m", "worker.cli", "up", "--port", str(port)], env=env,
                              stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", up, log)
        first = _worker_of(up)
        os.kill(first, signal.SIGKILL)
        deadline = time.time() + 60
        while (second := _worker_of(up)) == first:
            assert time.time() < deadline, "the dead worker was not restarted"
            time.sleep(0.2)
        api = [pid for pid, cmd in _children(up.pid).items() if " api " in f"{cmd} "]
        assert api and _alive(second)

        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=90) == 0
        for pid in (second, *api):
            deadline = time.time() + 10
            while _alive(pid):
                assert time.time() < deadline, f"pid {pid} outlived cispo up"
                time.sleep(0.1)
        assert not survivors(tag), survivors(tag)  # the first worker's orphans included
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
        for line in survivors(tag):
            os.kill(int(line.split(":")[0]), signal.SIGKILL)
        print(log.read_text()[-3000:])
