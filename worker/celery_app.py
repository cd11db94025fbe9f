"""The Celery worker: `celery -A worker.celery_app worker` (or `cispo worker`).

Concurrency 1 and a fresh child per job: a job owns the GPU, and its CUDA
context and memory go away with the process. Database pools are replaced in
every forked child (service.db.session), so children never share the
parent's connections.

Graceful shutdown (SIGTERM, a deploy): Celery's warm shutdown waits for the
running task, and this module tells the job to stop at its next step
boundary, checkpoint, and go back to the queue for another worker (DRAIN).
Give the worker a grace period of one step plus one checkpoint upload.

A SIGTERM sent to a pool child itself (a supervisor that signals the whole
process group, an operator's `kill`) drains the same way; a second one ends
the child at once, as before.
"""

from __future__ import annotations

import logging
import os
import signal

from billiard.process import active_children
from celery.signals import task_prerun, worker_process_init, worker_ready, worker_shutting_down

from service.queue import RUN_JOB, make_celery
from service.settings import get_settings

log = logging.getLogger(__name__)

# The signal the main process sends its pool children to drain; Celery resets SIGTERM and SIGUSR1 in
# children and uses SIGTERM to kill them on a cold shutdown, so it must be another one.
DRAIN_SIGNAL = signal.SIGUSR2

app = make_celery(get_settings())
app.conf.update(worker_concurrency=1, worker_max_tasks_per_child=1)


@app.task(name=RUN_JOB, acks_late=True)
def run_job(job_id: str) -> str | None:
    from worker.job_runner import run_job as run

    status = run(job_id, get_settings())
    log.info("job %s ended as %s", job_id, status)
    return status


@worker_ready.connect
def _start_reconciler(**_):
    from worker import reconciler, webhook_sender

    reconciler.start(get_settings(), interval_s=max(5.0, get_settings().lease_ttl_s / 3))
    webhook_sender.start(get_settings())


def _drain(*_):
    from worker.job_runner import DRAIN

    DRAIN.set()


_in_pool_child = False


@worker_process_init.connect
def _listen_for_drain(**_):
    global _in_pool_child
    _in_pool_child = True
    signal.signal(DRAIN_SIGNAL, _drain)


@task_prerun.connect
def _drain_on_sigterm(**_):
    """In a pool child, the first SIGTERM drains the job instead of killing it mid-step.

    Installed per task, not at process init: billiard replaces any SIGTERM handler the init hooks set
    with its own exit handler, which stays the answer to a second SIGTERM. Not in the solo pool, whose
    SIGTERM is Celery's own warm shutdown (which drains anyway)."""
    if not _in_pool_child:
        return
    exit_now = signal.getsignal(signal.SIGTERM)

    def drain_then_exit(signum, frame):
        log.warning("SIGTERM: the job checkpoints at its next step and goes back to the queue; "
                    "another SIGTERM ends this process now")
        signal.signal(signal.SIGTERM, exit_now)
        _drain()

    signal.signal(signal.SIGTERM, drain_then_exit)


@worker_shutting_down.connect
def _drain_jobs(how: str = "", **_):
    """Warm shutdown: the job in this process (solo pool) or in each pool child stops after a checkpoint.
    Cold shutdown ends the children now: the SIGTERM billiard would send them only drains a job."""
    log.warning("%s shutdown: %s", how, "running jobs end now" if how == "Cold" else
                "running jobs checkpoint and go back to the queue")
    _drain()
    for child in active_children():
        try:
            os.kill(child.pid, signal.SIGQUIT if how == "Cold" else DRAIN_SIGNAL)
        except ProcessLookupError:
            pass
