"""How a run starts: this worker's name on the lease, the claim, the secrets and starting checkpoint it reads
under it, its fenced reporter, and its inputs on local disk (in the run's own scratch directory,
worker/scratch.py)."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.orm import Session, sessionmaker

from service.db.session import session_factory
from service.job_spec.spec import JobSpec
from service.repositories import job_lease, job_recovery, jobs
from service.repositories import secrets as secrets_repo
from service.schemas.rewards import secret_names
from service.secrets.box import secret_box
from service.settings import Settings
from service.storage import ObjectStore, open_store
from service.storage_layout import MANIFEST
from worker import scratch
from worker.checkpoints.artifacts import download_checkpoint
from worker.checkpoints.checkpoint import CheckpointError, checkpoint_name
from worker.envs import describe_environment
from worker.jobs.job_reporter import JobReporter
from worker.tracking.trackers import Trackers

log = logging.getLogger(__name__)


def worker_owner(owner: str | None = None) -> str:
    """The name this worker holds leases under: `owner` if given, else host:pid."""
    return owner or f"{socket.gethostname()}:{os.getpid()}"


def connect(settings: Settings) -> tuple[sessionmaker[Session], ObjectStore]:
    """The database sessions and the object store a run reads and writes."""
    return session_factory(settings.resolved_database_url()), open_store(settings.resolved_storage_url())


def run_secrets(s: Session, project_id: str, spec: JobSpec, settings: Settings) -> dict[str, str]:
    """The values of the secrets the spec's reward and environment name. They live only in this process's memory,
    never in the spec, events or errors."""
    needed = secret_names(spec.reward) if spec.reward else set()
    if getattr(spec.environment, "auth_secret", None):  # an http environment's auth header
        needed.add(spec.environment.auth_secret)
    return secrets_repo.values(s, project_id, needed, secret_box(settings))


def starting_checkpoint(s: Session, project_id: str, checkpoint_id: str | None) -> tuple[str, dict] | None:
    """(storage prefix, files) of the project's checkpoint a run starts from; None if none is named or it was
    deleted."""
    start = jobs.project_checkpoint(s, project_id, checkpoint_id) if checkpoint_id else None
    return (start.storage_prefix, dict(start.files)) if start is not None else None


def fetch_start(store: ObjectStore, start: tuple[str, dict], work: Path, checkpoint_id: str) -> Path:
    """The starting checkpoint on local disk, in the run's scratch directory; verified when it loads."""
    prefix, files = start
    return download_checkpoint(store, prefix, files, work / "start" / checkpoint_id)


@dataclass(frozen=True)
class Claimed:
    """What a job's run needs from SQL, read under the lease."""

    epoch: int
    attempt: int
    project_id: str
    spec: JobSpec
    latest: tuple[int, str, dict] | None  # newest committed checkpoint: (step, storage prefix, files)
    secrets: dict[str, str]
    start: tuple[str, dict] | None = None  # a continued job's starting checkpoint: (storage prefix, files)


def claim_run(sessions: sessionmaker[Session], job_id: str, owner: str, settings: Settings) -> Claimed | str | None:
    """Take the job's lease; returns the claim, "failed" if the job has no attempt left, or None if not ours."""
    with sessions.begin() as s:
        job = jobs.get_for_worker(s, job_id)
        if job is None:
            log.warning("job %s does not exist; message dropped", job_id)
            return None
        epoch = job_lease.claim(s, job_id, owner, settings.lease_ttl_s, max_attempts=settings.max_attempts)
        if epoch is None:
            # Someone else holds it, it is waiting out a backoff, it is no longer runnable, or it
            # used up its attempts (then it fails now; a live lease is never touched).
            return "failed" if job_recovery.fail_exhausted(s, job_id, settings.max_attempts) else None
        s.refresh(job)  # the claim changed the row behind the session's back
        spec = JobSpec.model_validate(job.spec)
        latest = jobs.latest_checkpoint(s, job_id)
        latest = (latest.step, latest.storage_prefix, dict(latest.files)) if latest else None
        secrets = run_secrets(s, job.project_id, spec, settings)
        # A service job's init_from is a checkpoint id of its own project (service/models/start.py).
        start = starting_checkpoint(s, job.project_id, spec.init_from)
        jobs.add_event(s, job_id, f"Job started (attempt {job.attempts} of {settings.max_attempts}) on {owner}")
    return Claimed(epoch, job.attempts, job.project_id, spec, latest, secrets, start)


def make_reporter(sessions: sessionmaker[Session], store: ObjectStore, job_id: str, claimed: Claimed,
                  settings: Settings, kind: type[JobReporter] = JobReporter) -> JobReporter:
    """The run's fenced reporter (heartbeat, metrics, events, checkpoints), not yet started."""
    spec = claimed.spec
    return kind(sessions, store, job_id, claimed.epoch, settings, spec.training.steps,
                keep_checkpoints=spec.training.checkpoint_keep,
                environment=describe_environment(spec.environment) if spec.environment else None,
                export_merged=(spec.model, spec.dtype) if spec.training.export == "merged" else None,
                training=spec.training)


def start_trackers(reporter: JobReporter, job_id: str, claimed: Claimed, settings: Settings) -> None:
    if claimed.spec.integrations:
        reporter.trackers = Trackers(claimed.spec.integrations, job_id, settings, tracker_config(claimed.spec),
                                     reporter.event, project_id=claimed.project_id)


def tracker_config(spec: JobSpec) -> dict:
    """What a tracker run records about the job: the knobs people compare runs by."""
    return {"model": spec.model, "seed": spec.seed, "lora": spec.lora.model_dump() if spec.lora else None,
            "steps": spec.training.steps, "batch_size": spec.training.batch_size,
            "group_size": spec.training.group_size, "lr": spec.optimizer.lr, "kl_beta": spec.loss.kl_beta,
            "temperature": spec.sampling.temperature, "max_output_tokens": spec.sampling.max_output_tokens}


def prepare_run(claimed: Claimed, store: ObjectStore, work: Path, reporter: JobReporter) -> tuple[JobSpec, Path]:
    """The job's data and newest committed checkpoint on local disk: (the spec pointing at them, the run
    directory the trainer resumes in)."""
    reporter.event("Fetching the dataset")
    local_spec = _materialize(claimed.spec, store, scratch.make_run_dir(work) / "data")
    run_dir = work / "run"
    # Only the committed checkpoint may be resumed from: a local one left by a failed or killed run on
    # this machine was never recorded (a final one would then never be uploaded at all).
    for local in (run_dir / "checkpoints").glob("*"):
        if not _is_committed(local, claimed.latest):
            shutil.rmtree(local, ignore_errors=True)
    if claimed.latest is not None:  # resume from the committed checkpoint, wherever it was written
        step, prefix, files = claimed.latest
        download_checkpoint(store, prefix, files, run_dir / "checkpoints" / checkpoint_name(step))
    elif claimed.spec.init_from:  # a continued job's first run: the starting checkpoint, verified when it loads
        if claimed.start is None:
            raise CheckpointError(f"the starting checkpoint {claimed.spec.init_from} no longer exists (its "
                                  "fine-tuned model was deleted)")
        local = fetch_start(store, claimed.start, work, claimed.spec.init_from)
        local_spec = local_spec.model_copy(update={"init_from": str(local)})
    return local_spec, run_dir


def _materialize(spec: JobSpec, store: ObjectStore, data_dir: Path) -> JobSpec:
    """Download the job's dataset files and point the spec at the local copies."""
    data_dir.mkdir(parents=True, exist_ok=True)
    train = data_dir / "train.jsonl"
    store.get_file(f"files/{spec.data.train_file}", train)
    update = {"train_file": str(train)}
    if spec.data.validation_file:
        val = data_dir / "validation.jsonl"
        store.get_file(f"files/{spec.data.validation_file}", val)
        update["validation_file"] = str(val)
    return spec.model_copy(update={"data": spec.data.model_copy(update=update)})


def _is_committed(local: Path, latest: tuple[int, str, dict] | None) -> bool:
    """A local checkpoint directory holds exactly the committed one (same manifest, so same files)."""
    if latest is None or local.name != checkpoint_name(latest[0]) or not (local / MANIFEST).is_file():
        return False
    return hashlib.sha256((local / MANIFEST).read_bytes()).hexdigest() == latest[2].get(MANIFEST, {}).get("sha256")
