"""`cispo up` driven as a terminal would run it, for the end-to-end tests of the embedded default: its own state
directory and process group, the CLI beside it, a job submitted over HTTP, its row and events read from SQLite."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from sqlalchemy import select

from service.db.models import Job, JobEvent
from service.db.session import read_session_factory
from tests.conftest import free_port
from tests.e2e.test_service_flow import hyperparameters, upload
from tests.processes import survivors, tagged
from worker.toy.demo import wait_healthy


class Up:
    """`cispo up [args]` on its own embedded state, in its own process group. As a context manager it kills
    whatever is left on the way out (a failed test must not leave processes running) and prints the log's end."""

    def __init__(self, root: Path, toy_dir: Path, *args: str, log_tail: int = 3000):
        self.home, self.log, self.args, self.log_tail = root / "home", root / "up.log", args, log_tail
        env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "BROKER_URL", "STORAGE_URL")}
        env.update(CISPO_HOME=str(self.home), CISPO_MODEL_DIRS=str(toy_dir), CISPO_HEARTBEAT_S="1",
                   PYTHONUNBUFFERED="1")
        self.env, self.tag = tagged(env)
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Up:
        return self

    def __exit__(self, *exc) -> None:
        self.kill()
        print(self.log.read_text()[-self.log_tail:] if self.log.exists() else "(no log)")

    def cli(self, *args: str) -> str:
        return subprocess.run([sys.executable, "-m", "worker.cli", *args], env=self.env, check=True,
                              capture_output=True, text=True).stdout.strip()

    def start(self) -> None:
        """Start it and wait until the API answers and the worker is ready."""
        self.port = free_port()
        with self.log.open("a") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "worker.cli", "up", "--port", str(self.port),
                                          *self.args],
                                         env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self._log_from = self.log.stat().st_size
        wait_healthy(f"http://127.0.0.1:{self.port}", self.proc, self.log)
        deadline = time.time() + 300
        while " ready." not in self.log.read_text()[self._log_from:]:  # Celery's "celery@host ready."
            assert time.time() < deadline and self.proc.poll() is None, self.log.read_text()[-3000:]
            time.sleep(0.2)

    def stop(self, sig: int, *, group: bool, timeout: float = 120) -> float:
        """Send sig to `cispo up` (group: to its whole group, as Ctrl-C does); seconds until it exited."""
        started = time.monotonic()
        os.killpg(self.proc.pid, sig) if group else self.proc.send_signal(sig)
        assert self.proc.wait(timeout=timeout) == 0, self.log.read_text()[-3000:]
        return time.monotonic() - started

    def stop_idle(self) -> None:
        """Ctrl-C with nothing running: done in about a second (the old loop needed two more broker polls, 2 s
        each, at best), leaving no process behind."""
        elapsed = self.stop(signal.SIGINT, group=True)
        assert elapsed < 2.5, f"an idle Ctrl-C took {elapsed:.1f} s"
        assert not survivors(self.tag), survivors(self.tag)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for line in survivors(self.tag):
            os.kill(int(line.split(":")[0]), signal.SIGKILL)

    def client(self, key: str) -> httpx.Client:
        return httpx.Client(base_url=f"http://127.0.0.1:{self.port}/v1", headers={"Authorization": f"Bearer {key}"},
                            timeout=60)

    def sessions(self):
        return read_session_factory(f"sqlite:///{(self.home / 'cispo.db').resolve()}")

    def submit(self, client: httpx.Client, toy_dir: Path, steps: int) -> str:
        """A toy CISPO job of `steps` steps (no checkpoint before the end but the ones a stop takes); its id."""
        train = upload(client, toy_dir / "train.jsonl", "train.jsonl")
        r = client.post("/fine_tuning/jobs", json={
            "model": str(toy_dir / "model"), "training_file": train, "seed": 3,
            "method": {"type": "cispo", "cispo": {
                "reward": {"type": "exact_match", "field": "answer", "case_sensitive": True},
                "hyperparameters": hyperparameters(toy_dir, steps=steps, checkpoint_interval=1000)}}})
        assert r.status_code == 200, r.text
        return r.json()["id"]

    def job_column(self, job_id: str, column):
        """One column of the job's row, read in a short transaction (SQLite: the workers' writes wait on it)."""
        with self.sessions()() as s:
            return s.scalar(select(column).where(Job.id == job_id))

    def events(self, job_id: str) -> list[str]:
        """The job's event messages, oldest first."""
        with self.sessions()() as s:
            return list(s.scalars(select(JobEvent.message).where(JobEvent.job_id == job_id).order_by(JobEvent.seq)))

    def wait_for(self, done, what: str, timeout: float = 600) -> None:
        deadline = time.time() + timeout
        while not done():
            assert time.time() < deadline, f"{what}:\n{self.log.read_text()[-3000:]}"
            time.sleep(0.3)
