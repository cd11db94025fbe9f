"""SQL access to eval runs. The worker's writes are compare-and-set on the status and its owner, so a duplicate
broker message finds the run taken and leaves it alone, and a worker whose lease was given up (the reconciler
failed the run, a cancel ended it) has each write refused.

States: queued -> running -> succeeded | failed | cancelled; a queued run is cancelled at once, a running one
when its worker next checks (service/repositories/leases.py: the lease it renews meanwhile)."""

from __future__ import annotations

import time
from collections.abc import Mapping

from sqlalchemy import and_, func, or_, select, update
from sqlalchemy.orm import Session

from service.db.models import EvalRun, Job, Project, now
from service.fair_share import Waiting, fair_order
from service.repositories import leases
from service.repositories.pagination import Page, paginate

ACTIVE = ("queued", "running")
TERMINAL = ("succeeded", "failed", "cancelled")
LOST_CODE = "worker_lost"


class IllegalTransition(Exception):
    def __init__(self, run: EvalRun, action: str):
        super().__init__(f"eval run {run.id} is {run.status}; it cannot be {action}")


def add(session: Session, run: EvalRun) -> EvalRun:
    session.add(run)
    session.flush()
    return run


def get(session: Session, project_id: str, eval_id: str) -> EvalRun | None:
    return session.scalar(select(EvalRun).where(EvalRun.project_id == project_id, EvalRun.id == eval_id))


def get_for_worker(session: Session, eval_id: str) -> EvalRun | None:
    return session.scalar(select(EvalRun).where(EvalRun.id == eval_id))


def page(session: Session, project_id: str, *, after: str | None, limit: int) -> Page[EvalRun]:
    return paginate(session, select(EvalRun).where(EvalRun.project_id == project_id), EvalRun, after=after,
                    limit=limit)


def active_count(session: Session, project_id: str) -> int:
    """Queued and running eval runs of the project, under the project row's lock (as jobs.active_count), so
    two concurrent creates cannot both take the last place."""
    session.execute(select(Project.id).where(Project.id == project_id).with_for_update())
    return session.scalar(select(func.count()).select_from(EvalRun).where(EvalRun.project_id == project_id,
                                                                          EvalRun.status.in_(ACTIVE)))


def request_cancel(session: Session, run: EvalRun) -> EvalRun:
    """A queued run ends at once; a running one is asked to stop (its worker ends it between chunks of rows)."""
    for expected, values in ((("queued",), {"status": "cancelled", "finished_at": now()}),
                             (("running",), {"cancel_requested": True})):
        done = session.execute(update(EvalRun).where(EvalRun.id == run.id, EvalRun.status.in_(expected))
                               .values(**values).execution_options(synchronize_session=False))
        if done.rowcount == 1:
            session.refresh(run)
            return run
    session.refresh(run)
    raise IllegalTransition(run, "cancelled")


# -- the worker's side -------------------------------------------------------


def _owned(eval_id: str, owner: str):
    return and_(EvalRun.id == eval_id, EvalRun.status == "running", EvalRun.owner == owner)


def claim(session: Session, eval_id: str, owner: str, *, ttl_s: float = 90.0) -> bool:
    """queued -> running for this worker, under a lease of `ttl_s`; False when another took it or it is no
    longer queued."""
    done = session.execute(update(EvalRun).where(EvalRun.id == eval_id, EvalRun.status == "queued")
                           .values(status="running", owner=owner, started_at=now(),
                                   lease_expires_at=time.time() + ttl_s))
    return done.rowcount == 1


def heartbeat(session: Session, eval_id: str, owner: str, ttl_s: float) -> bool | None:
    """Renew the lease; returns whether a cancel was asked, or None when the run is no longer this worker's."""
    if not leases.renew(session, EvalRun, _owned(eval_id, owner), ttl_s):
        return None
    return bool(session.scalar(select(EvalRun.cancel_requested).where(EvalRun.id == eval_id)))


def finish(session: Session, eval_id: str, owner: str, *, status: str, result: dict | None = None,
           result_file_id: str | None = None, error_code: str | None = None,
           error_message: str | None = None) -> bool:
    """running -> succeeded | failed | cancelled, only by the worker that claimed it."""
    done = session.execute(update(EvalRun).where(_owned(eval_id, owner))
                           .values(status=status, result=result, result_file_id=result_file_id,
                                   error_code=error_code, error_message=error_message, finished_at=now(),
                                   lease_expires_at=None))
    return done.rowcount == 1


# -- the reconciler's sweeps -------------------------------------------------


def fail_expired(session: Session) -> list[str]:
    """Fail running eval runs whose worker stopped renewing the lease; returns their ids. Not retried: an eval is
    cheap to ask for again, and one that kills its worker would do it again."""
    t = time.time()
    lost = list(session.scalars(select(EvalRun.id).where(leases.expired(EvalRun, t))))
    if lost:
        session.execute(update(EvalRun).where(EvalRun.id.in_(lost), leases.expired(EvalRun, t))
                        .values(status="failed", error_code=LOST_CODE, finished_at=now(), lease_expires_at=None,
                                error_message="the worker running this eval stopped responding (its lease "
                                              "expired); create the eval run again")
                        .execution_options(synchronize_session=False))
    return lost


def queued_before(session: Session, created_before: int) -> list[str]:
    """Eval runs queued since before a moment: candidates for a lost broker message."""
    return list(session.scalars(select(EvalRun.id).where(EvalRun.status == "queued",
                                                         EvalRun.created_at < created_before)))


# -- fair turns --------------------------------------------------------------


def another_project_goes_first(session: Session, eval_id: str, weights: Mapping[str, float]) -> bool:
    """Whether queued work of another project (a job or an eval run) comes before this queued eval run in the
    fair-share order (service/fair_share.py) over all queued work, counting what each project runs now.

    Evals share the jobs' broker queue, which is first in, first out: a worker that takes an eval's message
    while another project's turn comes first hands the message back (worker/celery_app.py), so one project's
    evals cannot hold every worker while another project's job waits."""
    t = time.time()
    waiting = [Waiting(i, p, c, q) for i, p, c, q in session.execute(
        select(Job.id, Project.name, Job.created_at, Job.seq).join(Project, Project.id == Job.project_id)
        .where(Job.status == "queued", or_(Job.not_before.is_(None), Job.not_before <= t)))]
    waiting += [Waiting(i, p, c, q) for i, p, c, q in session.execute(
        select(EvalRun.id, Project.name, EvalRun.created_at, EvalRun.seq)
        .join(Project, Project.id == EvalRun.project_id).where(EvalRun.status == "queued"))]
    running: dict[str, int] = {}
    for table in (Job, EvalRun):
        for name, count in session.execute(select(Project.name, func.count()).select_from(table)
                                           .join(Project, Project.id == table.project_id)
                                           .where(table.status == "running").group_by(Project.name)):
            running[name] = running.get(name, 0) + count
    order = fair_order(waiting, running, weights)
    if eval_id not in order:
        return False  # no longer queued: the claim decides
    project = {w.job_id: w.project for w in waiting}
    return bool(order) and project[order[0]] != project[eval_id]
