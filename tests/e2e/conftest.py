"""The production-shaped stack, for real: PostgreSQL, Redis, S3 (moto over HTTP),
a uvicorn API process and a Celery worker process (prefork: a fresh child per job),
started with the production commands the docs list, and stopped leaving no process."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port, model_dirs_for_tests
from worker.toy.demo import wait_healthy

from tests.conftest import REDIS_TEST_URL as REDIS_E2E
from tests.processes import survivors, tagged
from tests.project_docs import docs_text

def readme_production_commands() -> dict[str, list[str]]:
    """The documented production commands (the ```sh block after "Production runs"), by subcommand."""
    block = re.search(r"Production runs.*?```sh\n(.*?)```", docs_text(), re.S)
    assert block, "README.md and docs/ list no production commands"
    commands = {}
    for line in block.group(1).splitlines():
        argv = shlex.split(line, comments=True)
        assert argv[0] == "cispo", line
        commands[argv[1]] = argv[1:]
    assert set(commands) == {"db", "api", "worker"}, commands
    return commands


def _with_option(argv: list[str], option: str, value: str) -> list[str]:
    i = argv.index(option)
    return [*argv[: i + 1], value, *argv[i + 2 :]]


class Stack:
    def __init__(self, base: str, env: dict, root: Path, procs: dict[str, subprocess.Popen]):
        self.base, self.env, self.root, self.procs = base, env, root, procs

    def start(self, name: str, *args: str) -> subprocess.Popen:
        """Another process of the stack (e.g. a second worker); stopped with the stack."""
        with (self.root / f"{name}.log").open("w") as log:
            self.procs[name] = subprocess.Popen([sys.executable, "-m", "worker.cli", *args], env=self.env,
                                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        return self.procs[name]

    def new_key(self, project: str) -> str:
        out = subprocess.run([sys.executable, "-m", "worker.cli", "keys", "create", "--project", project],
                             env=self.env, check=True, capture_output=True, text=True)
        return out.stdout.strip()

    def client(self, key: str) -> httpx.Client:
        return httpx.Client(base_url=f"{self.base}/v1", headers={"Authorization": f"Bearer {key}"}, timeout=60)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, moto_endpoint):
    import redis

    from tests.conftest import make_database

    from tests.conftest import BUCKET

    root = tmp_path_factory.mktemp("stack")
    s3_url = f"s3://{BUCKET}/e2e-{root.name}?endpoint_url={moto_endpoint}"
    db_url, drop = make_database("postgresql", root)
    redis.Redis.from_url(REDIS_E2E).flushdb()
    env, tag = tagged({
        **os.environ,
        "DATABASE_URL": db_url,
        "BROKER_URL": REDIS_E2E,
        "STORAGE_URL": s3_url,
        "CISPO_HOME": str(root / "home"),
        "CISPO_HEARTBEAT_S": "1",
        "CISPO_MODEL_DIRS": model_dirs_for_tests(tmp_path_factory.getbasetemp()),  # where toy_dir's model is
        "PYTHONUNBUFFERED": "1",
    })
    port = free_port()
    commands = readme_production_commands()
    stack = Stack(f"http://127.0.0.1:{port}", env, root, {})
    try:
        subprocess.run([sys.executable, "-m", "worker.cli", *commands["db"]], env=env, check=True)
        # The API on this machine only, on a free port; the worker exactly as written.
        api = stack.start("api", *_with_option(_with_option(commands["api"], "--host", "127.0.0.1"), "--port", str(port)))
        stack.start("worker", *commands["worker"])
        wait_healthy(stack.base, api, root / "api.log")
        yield stack
    finally:
        procs = list(stack.procs.values())
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            try:  # whatever it left in its group (pool children) goes with it
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for name in stack.procs:
            log = root / f"{name}.log"
            print(f"--- {name} log (tail) ---\n{log.read_text()[-2000:] if log.exists() else ''}")
        drop()
        left = survivors(tag)
        for line in left:
            os.kill(int(line.split(":")[0]), signal.SIGKILL)
        assert not left, f"processes outlived the stack: {left}"
