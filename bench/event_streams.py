"""What open event streams cost other requests: GET latency with 0 and N idle SSE streams, one run.

    .venv/bin/python bench/event_streams.py              # 100 streams, SQLite in a temp dir
    .venv/bin/python bench/event_streams.py --streams 300

Starts the real app under uvicorn on loopback, creates one queued job, and times GET
/v1/fine_tuning/jobs/{id} (median of --requests) before and while --streams clients hold
GET .../events?stream=true open; it also samples how many database connections are checked
out while the streams idle (each poll borrows one for a moment).
"""

from __future__ import annotations

import argparse
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx
import uvicorn

from service.api.app import create_app
from service.db.migrate import upgrade
from service.db.models import Job
from service.db.session import session_factory
from service.repositories import jobs as jobs_repo
from service.repositories import projects
from service.settings import Settings


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _latency(http: httpx.Client, path: str, n: int) -> float:
    times = []
    for _ in range(n):
        started = time.perf_counter()
        http.get(path).raise_for_status()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=100)
    parser.add_argument("--requests", type=int, default=30)
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="cispo-bench-"))
    url = f"sqlite:///{tmp / 'db.sqlite'}"
    upgrade(url)
    with session_factory(url)() as s:
        project = projects.get_or_create_project(s, "bench")
        key = projects.create_key(s, project)
        job = jobs_repo.add(s, Job(project_id=project.id, status="queued", model="m", training_file="f",
                                             spec={}, method={}, seed=0, total_steps=1))
        jobs_repo.add_event(s, job.id, "Job created")
        job_id = job.id
        s.commit()
    app = create_app(Settings(DATABASE_URL=url, STORAGE_URL=str(tmp / "objects"), home=tmp, model_hub_url=""),
                     enqueue=lambda _: None)
    port = _port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)

    headers = {"Authorization": f"Bearer {key}"}
    base = f"http://127.0.0.1:{port}"
    path = f"/v1/fine_tuning/jobs/{job_id}"
    with httpx.Client(base_url=base, headers=headers, timeout=60) as http:
        idle = _latency(http, path, args.requests)
        opened, release = threading.Semaphore(0), threading.Event()

        def hold():
            with httpx.Client(base_url=base, headers=headers, timeout=60) as own:
                with own.stream("GET", f"{path}/events", params={"stream": "true"}) as r:
                    next(r.iter_lines())
                    opened.release()
                    release.wait()

        threads = [threading.Thread(target=hold, daemon=True) for _ in range(args.streams)]
        for t in threads:
            t.start()
        for _ in threads:
            opened.acquire(timeout=60)
        pool = app.state.sessions.kw["bind"].pool
        samples = []
        for _ in range(20):
            samples.append(pool.checkedout())
            time.sleep(0.1)
        busy = _latency(http, path, args.requests)
        release.set()
    server.should_exit = True
    print(f"GET job, median of {args.requests}: {idle * 1000:.1f} ms idle, {busy * 1000:.1f} ms with "
          f"{args.streams} open streams ({busy / idle:.2f}x)")
    print(f"database connections checked out while the streams idle: max {max(samples)}, "
          f"mean {statistics.mean(samples):.2f} (sampled 20 times over 2 s)")


if __name__ == "__main__":
    main()
