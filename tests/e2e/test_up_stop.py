"""Stopping `cispo up` (the embedded default: one worker, solo pool) as operators do: SIGTERM from a
service manager with a job running, Ctrl-C (SIGINT to the whole foreground group) with a job running
and when idle. A stop checkpoints the running job and hands it back without using an attempt, an idle
stop takes about a second, and nothing `cispo up` started outlives it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from sqlalchemy import func, select

from service.db.models import Checkpoint, Job, JobEvent, JobMetric
from service.db.session import read_session_factory
from service.queue import enqueue_job
from service.settings import Settings
from tests.conftest import free_port
from tests.e2e.test_service_flow import hyperparameters, upload
from tests.processes import survivors, tagged
from worker.toy.demo import wait_healthy


class Up:
    """`cispo up` on its own embedded state, in its own process group (as a terminal would run it)."""

    def __init__(self, root: Path, toy_dir: Path):
        self.home, self.log = root / "home", root / "up.log"
        env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "BROKER_URL", "STORAGE_URL")}
        env.update(CISPO_HOME=str(self.home), CISPO_MODEL_DIRS=str(toy_dir), CISPO_HEARTBEAT_S="1",
                   PYTHONUNBUFFERED="1")
        self.env, self.tag = tagged(env)
        self.proc: subprocess.Popen | None = None

    def cli(self, *args: str) -> str:
        return subprocess.run([sys.executable, "-m", "worker.cli", *args], env=self.env, check=True,
                              capture_output=True, text=True).stdout.strip()

    def start(self) -> None:
        self.port = free_port()
        with self.log.open("a") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "worker.cli", "up", "--port", str(self.port)],
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

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for line in survivors(self.tag):  # a failed test must not leave them running either
            os.kill(int(line.split(":")[0]), signal.SIGKILL)

    def client(self, key: str) -> httpx.Client:
        return httpx.Client(base_url=f"http://127.0.0.1:{self.port}/v1", headers={"Authorization": f"Bearer {key}"},
                            timeout=60)

    def sessions(self):
        return read_session_factory(f"sqlite:///{(self.home / 'cispo.db').resolve()}")


def _submit(up: Up, client: httpx.Client, toy_dir: Path, steps: int) -> str:
    train = upload(client, toy_dir / "train.jsonl", "train.jsonl")
    r = client.post("/fine_tuning/jobs", json={
        "model": str(toy_dir / "model"), "training_file": train, "seed": 3,
        "method": {"type": "cispo", "cispo": {
            "reward": {"type": "exact_match", "field": "answer", "case_sensitive": True},
            "hyperparameters": hyperparameters(toy_dir, steps=steps, checkpoint_interval=1000)}}})
    assert r.status_code == 200, r.text
    return r.json()["id"]


def _job(up: Up, job_id: str, column):
    """One column of the job's row, read in a short transaction (SQLite: the workers' writes wait on it)."""
    with up.sessions()() as s:
        return s.scalar(select(column).where(Job.id == job_id))


def _wait(up: Up, job_id: str, done, what: str, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while not done():
        assert time.time() < deadline, f"{what}:\n{up.log.read_text()[-3000:]}"
        time.sleep(0.3)


def _events(sessions, job_id: str) -> list[str]:
    with sessions() as s:
        return list(s.scalars(select(JobEvent.message).where(JobEvent.job_id == job_id).order_by(JobEvent.seq)))


def _assert_handed_back(up: Up, job_id: str, elapsed: float, starts: int) -> int:
    """The job is queued again from a checkpoint of the step it stopped at, with no attempt used; returns that step."""
    sessions = up.sessions()
    with sessions() as s:
        job = s.scalar(select(Job).where(Job.id == job_id))
        ckpt = s.scalar(select(func.max(Checkpoint.step)).where(Checkpoint.job_id == job_id))
        step_s = s.scalar(select(func.max(JobMetric.value)).where(JobMetric.job_id == job_id,
                                                                  JobMetric.name == "step_seconds"))
    events = _events(sessions, job_id)
    assert (job.status, job.lease_owner, job.attempts) == ("queued", None, 0), (job.status, job.lease_owner, job.attempts)
    assert 0 < job.steps_done < job.total_steps and ckpt == job.steps_done  # nothing done was lost
    assert sum(m.startswith("Job started") for m in events) == starts, events  # claimed once per start, no loop
    assert events[-1].startswith("The worker is shutting down"), events[-3:]
    # One step and one checkpoint upload, plus the stop of the API and the worker's start-up slack.
    assert elapsed < 15 + 3 * step_s, f"the stop took {elapsed:.1f} s (steps take {step_s:.1f} s)"
    assert not survivors(up.tag), survivors(up.tag)
    return job.steps_done


def test_a_stop_with_a_running_job_checkpoints_it_and_hands_it_back_without_an_attempt(tmp_path, toy_dir):
    up = Up(tmp_path, toy_dir)
    try:
        up.cli("db", "upgrade")
        client_key = up.cli("keys", "create", "--project", "stop")
        up.start()
        job_id = _submit(up, up.client(client_key), toy_dir, steps=500)
        _wait(up, job_id, lambda: _job(up, job_id, Job.steps_done) >= 2,
              "the job made no progress")

        elapsed = up.stop(signal.SIGTERM, group=False)  # a service manager stopping `cispo up`
        stopped_at = _assert_handed_back(up, job_id, elapsed, starts=1)

        up.start()  # the next start resumes it from there, still on its first attempt
        _wait(up, job_id, lambda: _job(up, job_id, Job.steps_done) > stopped_at,
              "the job did not resume")
        events = _events(up.sessions(), job_id)
        assert f"Resumed from the checkpoint at step {stopped_at}" in events, events
        assert [m.split(")")[0] for m in events if m.startswith("Job started")] == ["Job started (attempt 1 of 3"] * 2

        elapsed = up.stop(signal.SIGINT, group=True)  # Ctrl-C in the terminal: every process gets SIGINT
        _assert_handed_back(up, job_id, elapsed, starts=2)
    finally:
        up.kill()
        print(up.log.read_text()[-4000:])


def test_ctrl_c_stops_an_idle_up_in_about_a_second(tmp_path, toy_dir):
    up = Up(tmp_path, toy_dir)
    try:
        up.cli("db", "upgrade")
        up.start()
        # A task first (one for a job that does not exist is enough): the worker used to take SIGTERM
        # over for each task and keep it afterwards, and it loads the job runner (and torch) then.
        enqueue_job("ftjob-none", settings=Settings(home=up.home))
        deadline = time.time() + 300
        while "ftjob-none does not exist" not in up.log.read_text():
            assert time.time() < deadline, up.log.read_text()[-3000:]
            time.sleep(0.3)
        time.sleep(3)  # idle: the worker is back to polling its broker

        elapsed = up.stop(signal.SIGINT, group=True)
        # About a second here; the old loop needed two more broker polls (2 s each) at best.
        assert elapsed < 2.5, f"an idle Ctrl-C took {elapsed:.1f} s"
        assert not survivors(up.tag), survivors(up.tag)
    finally:
        up.kill()
        print(up.log.read_text()[-3000:])
