"""Runs one eval run: claim it, fetch the file (and the checkpoint), score greedy completions, publish.

The same harness as a job's evals (Trainer.eval_rows, worker/trainer/evaluation.py): the spec's model
with the checkpoint loaded as the warm start, greedy completions of the file's first `eval_max_rows` rows,
each scored by the spec's reward in its sandbox. The result is the mean with its 95% interval
(worker/evals/intervals.py) and a per-row JSONL file (prompt, completion, reward) of purpose "evals".

A duplicate broker message finds the run claimed and returns. A run that fails is failed with the
error, not retried (an eval is cheap to ask for again), its error classified as a job's
(worker/jobs/lifecycle/failures.py). The claim is a lease the run renews
(worker/jobs/heartbeat.py) while it scores the rows in chunks of CHUNK_ROWS; between two chunks it ends as
`cancelled` when a cancel was asked, and stops writing when the lease is no longer its own. A worker that
dies stops renewing, and the reconciler fails the run once the lease has passed (worker/jobs/reconciler.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from dataclasses import fields
from pathlib import Path

from service.db.models import File, new_id
from service.files import EVAL_RESULTS_PURPOSE
from service.repositories import evals as evals_repo
from service.repositories import files as files_repo
from service.job_spec.spec import JobSpec
from service.settings import Settings
from service.storage import ObjectStore
from worker.evals.intervals import mean_interval
from worker.jobs.heartbeat import Heartbeat
from worker.jobs.lifecycle.failures import MESSAGE_CHARS, Cancelled, LeaseLost, ending_of
from worker.jobs.lifecycle.start import connect, fetch_start, run_secrets, starting_checkpoint, worker_owner
from worker.scratch import beside_jobs

log = logging.getLogger(__name__)

CHUNK_ROWS = 32  # rows scored between two looks at the lease: how soon a cancel takes effect


class EvalLease:
    """This worker's lease on an eval run: renewed in the background and before each chunk of rows."""

    def __init__(self, sessions, eval_id: str, owner: str, settings: Settings):
        self.sessions, self.eval_id, self.owner, self.ttl_s = sessions, eval_id, owner, settings.lease_ttl_s
        self.cancel = self.lost = False
        self.heartbeat = Heartbeat(self.renew, settings.heartbeat_s, name=f"heartbeat-{eval_id}")

    def renew(self) -> None:
        with self.sessions.begin() as s:
            cancel = evals_repo.heartbeat(s, self.eval_id, self.owner, self.ttl_s)
        self.lost, self.cancel = cancel is None, bool(cancel)

    def check(self) -> None:
        self.renew()
        if self.lost:
            raise LeaseLost()
        if self.cancel:
            raise Cancelled()


def work_dir(settings: Settings, eval_id: str) -> Path:
    """Outside the jobs' scratch root, whose sweep removes what no job lease holds."""
    return beside_jobs(settings, "eval") / eval_id


def _results_jsonl(results: list[dict]) -> bytes:
    return "".join(json.dumps({"row": i, **r}) + "\n" for i, r in enumerate(results)).encode()


def _publish(sessions, store: ObjectStore, run, results: list[dict]) -> str:
    content = _results_jsonl(results)
    file_id = new_id("file-")
    key = f"files/{file_id}"
    store.put_bytes(key, content)
    with sessions.begin() as s:
        files_repo.add(s, File(id=file_id, project_id=run.project_id, filename=f"{run.id}-results.jsonl",
                               purpose=EVAL_RESULTS_PURPOSE, bytes=len(content),
                               sha256=hashlib.sha256(content).hexdigest(), rows=len(results), storage_key=key))
    return file_id


def _evaluate(run, spec: JobSpec, store: ObjectStore, settings: Settings, secrets: dict, start, work: Path,
              lease: EvalLease):
    from worker.rewards.engine import ScoringContext
    from worker.trainer.evaluation import EvalRows
    from worker.trainer.loop import Trainer  # torch loads here, not at worker import

    data = work / "data" / "rows.jsonl"
    data.parent.mkdir(parents=True, exist_ok=True)
    store.get_file(f"files/{run.file_id}", data)
    update = {"data": spec.data.model_copy(update={"train_file": str(data), "validation_file": None})}
    if start is not None:
        update["init_from"] = str(fetch_start(store, start, work, run.checkpoint_id))
    local = spec.model_copy(update=update)
    trainer = Trainer(local, work / "run", resume=False, scoring=ScoringContext.from_settings(settings, secrets))
    try:
        rows, every = trainer.train_rows[: local.training.eval_max_rows], EvalRows()
        for first in range(0, len(rows), CHUNK_ROWS):
            lease.check()
            part = trainer.eval_rows(rows[first:first + CHUNK_ROWS], first=first)
            for name in fields(EvalRows):
                getattr(every, name.name).extend(getattr(part, name.name))
        return every
    finally:
        trainer.close()


def run_eval(eval_id: str, settings: Settings, *, owner: str | None = None) -> str | None:
    """Run the eval if it is still queued; returns the status it ended in (None if not ours)."""
    sessions, store = connect(settings)
    owner = worker_owner(owner)
    with sessions.begin() as s:
        if not evals_repo.claim(s, eval_id, owner, ttl_s=settings.lease_ttl_s):
            return None
        run = evals_repo.get_for_worker(s, eval_id)
        spec = JobSpec.model_validate(run.spec)
        secrets = run_secrets(s, run.project_id, spec, settings)
        start = starting_checkpoint(s, run.project_id, run.checkpoint_id)
        s.expunge(run)
    work = work_dir(settings, eval_id)
    lease = EvalLease(sessions, eval_id, owner, settings)
    lease.heartbeat.start()
    try:
        if run.checkpoint_id and start is None:
            raise ValueError(f"the checkpoint {run.checkpoint_id} no longer exists (its model was deleted)")
        rows = _evaluate(run, spec, store, settings, secrets, start, work, lease)
        interval = mean_interval(rows.rewards)
        result = {**interval.as_dict(), "errors": len(rows.errors)}
        file_id = _publish(sessions, store, run, rows.as_results())
        with sessions.begin() as s:
            if not evals_repo.finish(s, eval_id, owner, status="succeeded", result=result, result_file_id=file_id):
                log.warning("eval run %s: no longer this worker's when it finished; its result is dropped", eval_id)
                return None
        return "succeeded"
    except Exception as e:  # the run fails with a message (not retried), or is cancelled; the worker lives on
        status, failure = ending_of(e, lost=lease.lost, what=f"eval run {eval_id}")
        if status is None:
            log.warning("eval run %s: the lease is no longer this worker's; stopped without writing", eval_id)
            return None
        with sessions.begin() as s:
            evals_repo.finish(s, eval_id, owner, status=status, error_code=failure and failure.code,
                              error_message=failure and failure.message[:MESSAGE_CHARS])
        log.info("eval run %s ended %s", eval_id, status)
        return status
    finally:
        lease.heartbeat.stop()
        shutil.rmtree(work, ignore_errors=True)
