"""Many pollers against the real stack while a job trains: API latency, errors, and the trainer's pace.

For each database (PostgreSQL + Redis, and the embedded default: SQLite + the
server-less broker), this starts the real processes (`cispo api` under
uvicorn, `cispo worker` training the tiny model), submits a long job, and
once it trains measures the trainer's step rate alone, then again while N
pollers GET the job and its events (each every --interval seconds, as a
client loop would, over its own keep-alive connection). It prints p50/p95/p99/max latency, request count and
errors, and the step rate with pollers as a ratio of the rate without.

    .venv/bin/python bench/pollers.py                        # 200 pollers, 60 s, both databases
    .venv/bin/python bench/pollers.py --pollers 50 --seconds 10 --databases sqlite

PostgreSQL is reached at --pg (trust auth; a scratch database is created and
dropped), Redis at --redis. The rate limit is raised for the run (every
poller shares one key); everything else is the default configuration.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from worker.toy.__main__ import prepare, toy_spec  # noqa: E402
from worker.toy.demo import free_port, wait_healthy  # noqa: E402


class Stack:
    """One database's stack: migrated database, a key, the API and a worker process."""

    def __init__(self, kind: str, root: Path, toy: Path, args):
        self.kind, self.root, self.args = kind, root, args
        self.procs: list[subprocess.Popen] = []
        self.pg_name = None
        env = {**os.environ, "CISPO_HOME": str(root / "home"), "CISPO_MODEL_DIRS": str(toy.resolve()),
               "CISPO_RATE_LIMIT_PER_S": "1000000", "CISPO_RATE_LIMIT_BURST": "1000000",
               "CISPO_HEARTBEAT_S": "5", "PYTHONUNBUFFERED": "1"}
        for var in ("DATABASE_URL", "BROKER_URL", "STORAGE_URL", "CISPO_DATABASE_URL", "CISPO_BROKER_URL",
                    "CISPO_STORAGE_URL"):
            env.pop(var, None)
        if kind == "postgresql":
            from sqlalchemy import create_engine, text

            self.pg_name = f"cispo_bench_{uuid.uuid4().hex[:8]}"
            admin = create_engine(args.pg, isolation_level="AUTOCOMMIT")
            with admin.connect() as conn:
                conn.execute(text(f'CREATE DATABASE "{self.pg_name}"'))
            admin.dispose()
            env["DATABASE_URL"] = args.pg.rsplit("/", 1)[0] + "/" + self.pg_name
            env["BROKER_URL"] = args.redis
            import redis

            redis.Redis.from_url(args.redis).flushdb()
        self.env = env

    def cli(self, *argv: str) -> str:
        return subprocess.run([sys.executable, "-m", "worker.cli", *argv], env=self.env, check=True,
                              capture_output=True, text=True, cwd=self.root).stdout.strip()

    def start(self) -> str:
        self.cli("db", "upgrade")
        self.key = self.cli("keys", "create", "--project", "bench")
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        # On a GPU host the trainer leaves the CPUs to the API; on a small CPU-only host torch would take
        # them all, and the figures would measure CPU starvation, not the API. So the worker gets its share.
        threads = {"OMP_NUM_THREADS": str(self.args.worker_threads), "MKL_NUM_THREADS": str(self.args.worker_threads)}
        for name, argv, extra in (("api", ["api", "--port", str(port)], {}),
                                  ("worker", ["worker", "--pool", "solo"], threads)):
            log = (self.root / f"{name}.log").open("w")
            self.procs.append(subprocess.Popen([sys.executable, "-m", "worker.cli", *argv],
                                               env={**self.env, **extra}, stdout=log, stderr=subprocess.STDOUT,
                                               cwd=self.root))
        wait_healthy(base, self.procs[0], self.root / "api.log", timeout=90)
        return base

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        if self.pg_name:
            from sqlalchemy import create_engine, text

            admin = create_engine(self.args.pg, isolation_level="AUTOCOMMIT")
            with admin.connect() as conn:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{self.pg_name}" WITH (FORCE)'))
            admin.dispose()


def submit_job(client: httpx.Client, toy: Path) -> str:
    with (toy / "train.jsonl").open("rb") as f:
        r = client.post("/files", files={"file": ("train.jsonl", f)}, data={"purpose": "fine-tune"})
    r.raise_for_status()
    spec = toy_spec(toy, steps=100000)  # far more than the run lasts; cancelled at the end
    hyper = {k: spec[k] for k in ("lora", "sampling", "optimizer", "training")}
    # Small steps, so the step rate is measured over many of them in a short window.
    hyper["training"].update(batch_size=4, group_size=4, micro_batch_size=16, mini_batches=1, eval_interval=0,
                             checkpoint_interval=0)
    r = client.post("/fine_tuning/jobs", json={
        "model": str((toy / "model").resolve()), "training_file": r.json()["id"], "seed": 0,
        "method": {"type": "cispo", "cispo": {"reward": {"type": "exact_match", "field": "answer"},
                                              "hyperparameters": hyper}}})
    if r.status_code != 200:
        raise SystemExit(f"the job was refused: {r.text}")
    return r.json()["id"]


def steps_done(client: httpx.Client, job_id: str) -> int:
    events = client.get(f"/fine_tuning/jobs/{job_id}/metrics", params={"name": "loss", "limit": 10000}).json()
    return len(events["data"])


def wait_training(client: httpx.Client, job_id: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = client.get(f"/fine_tuning/jobs/{job_id}").json()
        if job["status"] in ("failed", "cancelled"):
            raise SystemExit(f"the job ended: {job}")
        if job["status"] == "running" and steps_done(client, job_id) >= 1:
            return
        time.sleep(1)
    raise SystemExit("the job did not start training")


def step_rate(client: httpx.Client, job_id: str, seconds: float) -> float:
    before, t = steps_done(client, job_id), time.monotonic()
    time.sleep(seconds)
    return (steps_done(client, job_id) - before) / (time.monotonic() - t)


class Connection:
    """One poller's keep-alive HTTP/1.1 connection, as an independent client would hold.

    A bare asyncio client rather than httpx: the pollers share the API's cores here, and 200 of them
    through httpx's pool cost more CPU than the API itself (so the figures measured the client).
    """

    def __init__(self, host: str, port: int, key: str):
        self.host, self.port, self.key = host, port, key
        self.reader = self.writer = None

    async def get(self, path: str) -> int:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        self.writer.write(f"GET {path} HTTP/1.1\r\nHost: {self.host}\r\nAuthorization: Bearer {self.key}\r\n\r\n"
                          .encode())
        try:
            head = await self.reader.readuntil(b"\r\n\r\n")
            status = int(head.split(b" ", 2)[1])
            length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            await self.reader.readexactly(length)
        except Exception:
            self.close()  # a broken or half-read connection is not reused
            raise
        return status

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


async def poll(base: str, key: str, job_id: str, *, pollers: int, seconds: float, interval: float
               ) -> tuple[list[float], int, dict[str, int]]:
    """(latencies in s, requests, errors by kind) of `pollers` loops each polling every `interval` s."""
    paths = [f"/v1/fine_tuning/jobs/{job_id}", f"/v1/fine_tuning/jobs/{job_id}/events"]
    host, port = base.removeprefix("http://").rsplit(":", 1)
    latencies: list[float] = []
    errors: dict[str, int] = {}
    end = time.monotonic() + seconds

    async def one(n: int) -> None:
        conn = Connection(host, int(port), key)
        await asyncio.sleep(random.random() * interval)  # spread the pollers over the interval
        i = n
        while time.monotonic() < end:
            started = time.monotonic()
            try:
                status = await asyncio.wait_for(conn.get(paths[i % 2]), timeout=30)
                if status != 200:
                    errors[f"HTTP {status}"] = errors.get(f"HTTP {status}", 0) + 1
            except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, ValueError, StopIteration) as e:
                conn.close()
                errors[type(e).__name__] = errors.get(type(e).__name__, 0) + 1
            latencies.append(time.monotonic() - started)
            i += 1
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))
        conn.close()

    await asyncio.gather(*(one(n) for n in range(pollers)))
    return latencies, len(latencies), errors


def run_loop(coroutine):
    try:
        import uvloop  # the API's loop too (pyproject.toml); the client should not be the slower side
    except ImportError:
        return asyncio.run(coroutine)
    return uvloop.run(coroutine)


def run(kind: str, toy: Path, args) -> dict:
    root = Path(tempfile.mkdtemp(prefix=f"cispo-bench-{kind}-"))
    stack = Stack(kind, root, toy, args)
    try:
        base = stack.start()
        client = httpx.Client(base_url=f"{base}/v1", headers={"Authorization": f"Bearer {stack.key}"}, timeout=60)
        job_id = submit_job(client, toy)
        print(f"{kind}: job {job_id} submitted; waiting for it to train", flush=True)
        wait_training(client, job_id)
        alone = step_rate(client, job_id, args.baseline_seconds)
        before, t = steps_done(client, job_id), time.monotonic()
        latencies, count, errors = run_loop(poll(base, stack.key, job_id, pollers=args.pollers,
                                                    seconds=args.seconds, interval=args.interval))
        polled = (steps_done(client, job_id) - before) / (time.monotonic() - t)
        client.post(f"/fine_tuning/jobs/{job_id}/cancel")
        q = statistics.quantiles(latencies, n=100, method="inclusive")  # never beyond the max
        return {"db": kind, "requests": count, "errors": sum(errors.values()), "error_kinds": errors,
                "p50": q[49], "p95": q[94], "p99": q[98], "max": max(latencies),
                "steps_alone": alone, "steps_polled": polled}
    finally:
        stack.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pollers", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--interval", type=float, default=1.0, help="Seconds between one poller's requests.")
    parser.add_argument("--baseline-seconds", type=float, default=20, help="Trainer step rate without pollers.")
    parser.add_argument("--databases", default="postgresql,sqlite")
    parser.add_argument("--worker-threads", type=int, default=1, help="torch threads of the training worker.")
    parser.add_argument("--pg", default="postgresql+psycopg://postgres@127.0.0.1:5432/test")
    parser.add_argument("--redis", default=f"redis://127.0.0.1:6379/{os.environ.get('CISPO_TEST_REDIS_DB', '15')}")
    args = parser.parse_args()

    toy = Path(tempfile.mkdtemp(prefix="cispo-bench-toy-"))
    prepare(toy, steps=10)
    print(f"{args.pollers} pollers x {args.seconds:g} s, one GET every {args.interval:g} s each "
          f"(offered ~{args.pollers / args.interval:.0f} req/s), while the tiny model trains", flush=True)
    rows = [run(kind, toy, args) for kind in args.databases.split(",")]
    print(f"\n| database | requests | errors | p50 ms | p95 ms | p99 ms | max ms | trainer steps/s alone | "
          "with pollers | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        ratio = r["steps_polled"] / r["steps_alone"] if r["steps_alone"] else float("nan")
        print(f"| {r['db']} | {r['requests']} | {r['errors']} | {r['p50'] * 1e3:.1f} | {r['p95'] * 1e3:.1f} | "
              f"{r['p99'] * 1e3:.1f} | {r['max'] * 1e3:.1f} | {r['steps_alone']:.2f} | {r['steps_polled']:.2f} | "
              f"{ratio:.2f}x |")
        if r["error_kinds"]:
            print(f"  errors on {r['db']}: {r['error_kinds']}")


if __name__ == "__main__":
    main()
