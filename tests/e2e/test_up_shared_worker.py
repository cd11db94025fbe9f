"""`cispo up --worker-jobs 2`: a real Celery worker process (the embedded stack's) trains two jobs of one base at once,
on one copy of it, both to success over HTTP."""

from __future__ import annotations

import time

from sqlalchemy import select

from service.db.models import Job
from tests.e2e.up import Up


def test_two_jobs_of_one_base_train_together_in_the_worker_process_to_success(tmp_path, toy_dir):
    with Up(tmp_path, toy_dir, "--worker-jobs", "2") as up:
        up.cli("db", "upgrade")
        key = up.cli("keys", "create", "--project", "shared")
        up.start()
        client = up.client(key)
        longer = up.submit(client, toy_dir, steps=8)
        shorter = up.submit(client, toy_dir, steps=2)
        deadline = time.time() + 900
        while {client.get(f"/fine_tuning/jobs/{j}").json()["status"] for j in (longer, shorter)} != {"succeeded"}:
            statuses = [client.get(f"/fine_tuning/jobs/{j}").json()["status"] for j in (longer, shorter)]
            assert time.time() < deadline and not {"failed", "cancelled"} & set(statuses), \
                (statuses, up.log.read_text()[-3000:])
            time.sleep(0.5)
        with up.sessions()() as s:
            rows = {j.id: j for j in s.scalars(select(Job).where(Job.id.in_([longer, shorter])))}
        assert (rows[longer].steps_done, rows[shorter].steps_done) == (8, 2)
        assert rows[longer].attempts == rows[shorter].attempts == 1
        owners = set()
        for job_id in (longer, shorter):
            events = up.events(job_id)
            started = [m for m in events if m.startswith("Job started")]
            assert len(started) == 1, events
            owners.add(started[0].rsplit(" on ", 1)[1])
        assert len(owners) == 1, owners  # one worker process ran both
        # One joined the other on its resident base, between two of its cycles.
        joined = [m for j in (longer, shorter) for m in up.events(j)
                  if m.startswith("Training beside the other jobs") and m.endswith("(2 of 2 slots)")]
        assert len(joined) == 1, joined
