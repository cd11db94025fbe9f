"""A job's result file: its per-step metrics as one CSV, stored as a file of purpose `fine-tune-results`.

Like OpenAI's result files, it is listed in the job's `result_files` and downloaded with
GET /v1/files/{id}/content. One row per step, one column per metric (empty where a step has
no value, e.g. evaluation metrics between evaluations).
"""

from __future__ import annotations

import csv
import hashlib
import io

from sqlalchemy.orm import Session

from service.db.models import File, JobMetric, new_id
from service.files import RESULTS_PURPOSE
from service.repositories import job_outputs
from service.repositories import jobs
from service.storage import ObjectStore

MAX_METRIC_ROWS = 2_000_000  # steps x metrics; far above any real job, so the file is complete


def metrics_csv(rows: list[JobMetric]) -> bytes:
    """`step,<name>,...` with the names sorted, one line per step in step order."""
    names = sorted({r.name for r in rows})
    by_step: dict[int, dict[str, float]] = {}
    for r in rows:
        by_step.setdefault(r.step, {})[r.name] = r.value
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["step", *names])
    for step in sorted(by_step):
        values = by_step[step]
        writer.writerow([step, *(repr(values[n]) if n in values else "" for n in names)])
    return out.getvalue().encode()


def publish(session: Session, store: ObjectStore, job_id: str, epoch: int, project_id: str) -> str | None:
    """Upload the metrics CSV and attach it to the job (fenced); its file id, or None if there is nothing
    to publish or the lease is lost."""
    rows = jobs.metrics(session, job_id, names=None, step_min=None, step_max=None, limit=MAX_METRIC_ROWS)
    if not rows:
        return None
    content = metrics_csv(rows)
    file_id = new_id("file-")
    key = f"files/{file_id}"
    store.put_bytes(key, content)
    file = File(id=file_id, project_id=project_id, filename=f"{job_id}-results.csv", purpose=RESULTS_PURPOSE,
                bytes=len(content), sha256=hashlib.sha256(content).hexdigest(), rows=content.count(b"\n") - 1,
                storage_key=key)
    if not job_outputs.attach_result_file(session, job_id, epoch, file):
        store.delete(key)
        return None
    return file_id
