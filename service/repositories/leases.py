"""What every leased row shares (a job, an eval run): a worker holds it `running` while it renews
`lease_expires_at`, and a running row whose lease passed has no live worker.

The tables differ in what fences a write (a job's lease epoch, an eval run's owner) and in what happens to a
lost run (a job goes back to the queue while it has attempts; an eval run fails), so those stay with each
table's repository (service/repositories/job_lease.py, job_recovery.py, evals.py).
"""

from __future__ import annotations

import time

from sqlalchemy import and_, update
from sqlalchemy.orm import Session


def expired(table, t: float):
    """A running row whose worker stopped renewing its lease before `t`."""
    return and_(table.status == "running", table.lease_expires_at < t)


def renew(session: Session, table, fence, ttl_s: float) -> bool:
    """Extend the lease of the row that `fence` (the run's WHERE clause) selects; False when it is lost."""
    result = session.execute(update(table).where(fence).values(lease_expires_at=time.time() + ttl_s)
                             .execution_options(synchronize_session=False))
    return result.rowcount == 1
