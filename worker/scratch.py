"""A worker's local scratch space: one directory per run, removed when the run ends, swept when it cannot.

A run works in CISPO_HOME/work/<job>/epoch-<lease epoch>/ (its dataset copy,
its local checkpoints). The epoch is the run's own: no later run of the job,
on this machine or another, and no stale worker of it (paused past its lease)
ever shares the directory. Everything a run needs again is in the object store
(the committed checkpoint) and SQL, so the run removes its directory whatever
way it ends. A worker killed mid-run cannot; the sweep (each reconciler pass)
removes every run directory but those of runs that hold their job's lease now.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from service.db.session import session_factory
from service.private_paths import private_dir
from service.repositories import job_lease
from service.settings import Settings

log = logging.getLogger(__name__)


def run_dir(settings: Settings, job_id: str, epoch: int) -> Path:
    """This run's own directory, named only: make_run_dir makes it inside the run, so a work root that cannot be
    made fails the run (an attempt, retried with backoff) instead of escaping the job runner."""
    return settings.resolved_work_dir() / job_id / f"epoch-{epoch:06d}"


def make_run_dir(work: Path) -> Path:
    """The run directory `run_dir` named, under its work root made 0700 (private_root)."""
    private_root(work.parent.parent)
    work.mkdir(parents=True, exist_ok=True)
    return work


def private_root(root: Path) -> Path:
    """`root`, made 0700: the runs below hold tenants' datasets and weights, and CISPO_WORK_DIR may lie outside
    the private home, where a 0755 root would hand them to every local user."""
    return private_dir(root)


def beside_jobs(settings: Settings, name: str) -> Path:
    """A private scratch root of its own (NAME-work) beside the jobs' work directory, whose sweep removes whatever
    no job lease holds: evals, the serving worker and the Tinker worker keep their files here."""
    return private_root(settings.resolved_work_dir().with_name(f"{name}-work"))


def remove(path: Path) -> None:
    """Remove a run's directory, and its job's once no other run of it is left here."""
    shutil.rmtree(path, ignore_errors=True)
    try:
        path.parent.rmdir()
    except OSError:  # another run of the job (a new lease on this machine) works beside it
        pass


def sweep(settings: Settings) -> list[Path]:
    """Remove the run directories of runs that no longer hold their job's lease; returns them."""
    root = settings.resolved_work_dir()
    if not root.is_dir():
        return []
    # Listed before the database is read: a directory seen here was made after its run's claim committed, so
    # the read below sees that claim (a run that is starting is never taken for a dead one).
    found = {job.name: sorted(job.iterdir()) for job in root.iterdir() if job.is_dir()}
    if not found:
        return []
    with session_factory(settings.resolved_database_url()).begin() as s:
        live = job_lease.running_epochs(s, list(found))
    removed = []
    for job_id, entries in found.items():
        for entry in entries:
            if job_id in live and entry.name == f"epoch-{live[job_id]:06d}":
                continue  # the run that holds the lease (here, or a stale copy of it: it stops on its own)
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
        try:
            (root / job_id).rmdir()
        except OSError:  # a live run's directory is in it
            pass
    if removed:
        log.info("swept %d run directories of ended or moved runs from %s", len(removed), root)
    return removed
