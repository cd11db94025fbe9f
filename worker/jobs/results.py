"""A job's result files: its per-step metrics as one CSV and as a TensorBoard event file, stored as files of
purpose `fine-tune-results`.

Like OpenAI's result files, they are listed in the job's `result_files` (the CSV first) and downloaded with
GET /v1/files/{id}/content. The CSV has one row per step, one column per metric (empty where a step has
no value, e.g. evaluation metrics between evaluations); the event file one event per step with its metrics as
scalars (worker/tracking/tensorboard_events.py), for `tensorboard --logdir` on the downloaded file's folder.
"""

from __future__ import annotations

import csv
import hashlib
import io
import time

from sqlalchemy.orm import Session

from service.db.models import File, JobMetric, new_id
from service.files import RESULTS_PURPOSE
from service.repositories import job_outputs
from service.repositories import jobs
from service.storage import ObjectStore
from worker.tracking.tensorboard_events import event_file, event_file_name

MAX_METRIC_ROWS = 2_000_000  # steps x metrics; far above any real job, so the file is complete


def metrics_csv(rows: list[JobMetric]) -> bytes:
    """`step,<name>,...` with the names sorted, one line per step in step order."""
    names = sorted({r.name for r in rows})
    by_step = metrics_by_step(rows)
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["step", *names])
    for step in sorted(by_step):
        values = by_step[step]
        writer.writerow([step, *(repr(values[n]) if n in values else "" for n in names)])
    return out.getvalue().encode()


def metrics_by_step(rows: list[JobMetric]) -> dict[int, dict[str, float]]:
    by_step: dict[int, dict[str, float]] = {}
    for r in rows:
        by_step.setdefault(r.step, {})[r.name] = r.value
    return by_step


def publish(session: Session, store: ObjectStore, job_id: str, epoch: int, project_id: str) -> str | None:
    """Upload the metrics CSV and the TensorBoard event file and attach them to the job (fenced); the CSV's
    file id, or None if there is nothing to publish or the lease is lost."""
    rows = jobs.metrics(session, job_id, names=None, step_min=None, step_max=None, limit=MAX_METRIC_ROWS)
    if not rows:
        return None
    content = metrics_csv(rows)
    csv_id = _attach(session, store, job_id, epoch, project_id, f"{job_id}-results.csv", content,
                     rows=content.count(b"\n") - 1, column="result_file_id")
    if csv_id is None:
        return None
    steps, now = metrics_by_step(rows), time.time()
    _attach(session, store, job_id, epoch, project_id, event_file_name(job_id, now), event_file(steps, now),
            rows=len(steps), column="tensorboard_file_id")
    return csv_id


def _attach(session: Session, store: ObjectStore, job_id: str, epoch: int, project_id: str, filename: str,
            content: bytes, *, rows: int, column: str) -> str | None:
    file_id = new_id("file-")
    key = f"files/{file_id}"
    store.put_bytes(key, content)
    file = File(id=file_id, project_id=project_id, filename=filename, purpose=RESULTS_PURPOSE,
                bytes=len(content), sha256=hashlib.sha256(content).hexdigest(), rows=rows, storage_key=key)
    if not job_outputs.attach_result_file(session, job_id, epoch, file, column=column):
        store.delete(key)
        return None
    return file_id
