"""The Celery worker: `celery -A worker.celery_app worker` (or `cispo worker`).

A fresh child per job, whose CUDA context and memory go away with it; one
child by default (a job owns the worker's GPUs), or `worker_concurrency`
children, one per GPU, child i seeing only GPU i (worker/gpus.py). Database
pools are replaced in every forked child (service.db.session), so children
never share the parent's connections.

Graceful shutdown (SIGTERM, a deploy): Celery's warm shutdown waits for the
running task, and this module tells the job to stop at its next step
boundary, checkpoint, and go back to the queue for another worker (DRAIN).
Give the worker a grace period of one step plus one checkpoint upload.

The solo pool (`cispo up`) runs the job in the main process, so Celery's
own warm shutdown is what drains it there.

A SIGTERM sent to a pool child itself (a supervisor that signals the whole
process group, an operator's `kill`) drains the same way; a second one ends
the child at once, as before.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

from billiard.process import active_children, current_process
from celery.exceptions import Reject, WorkerShutdown
from celery.signals import task_prerun, worker_process_init, worker_ready, worker_shutting_down
from celery.worker import state as worker_state

from service.queue import RUN_EVAL, RUN_JOB, make_celery
from service.settings import get_settings
from worker.jobs.drain import DRAIN
from worker.gpus import pin_gpu

log = logging.getLogger(__name__)

# The signal the main process sends its pool children to drain; Celery resets SIGTERM and SIGUSR1 in
# children and uses SIGTERM to kill them on a cold shutdown, so it must be another one.
DRAIN_SIGNAL = signal.SIGUSR2

app = make_celery(get_settings())
app.conf.update(worker_concurrency=get_settings().worker_concurrency, worker_max_tasks_per_child=1)


def _refuse_while_draining() -> None:
    """This worker is stopping. Celery's solo pool (`cispo up`) still takes one more message after a warm
    shutdown began, often the very job that just drained: it goes back, unclaimed and unrun."""
    if DRAIN.is_set():
        raise Reject("the worker is shutting down", requeue=True)


@app.task(name=RUN_JOB, acks_late=True)
def run_job(job_id: str) -> str | None:
    _refuse_while_draining()
    if get_settings().worker_jobs > 1:  # one resident base, several LoRA jobs of it (worker/multi/runner.py)
        from worker.multi.runner import run_shared as run
    else:
        from worker.jobs.job_runner import run_job as run

    status = run(job_id, get_settings())
    log.info("job %s ended as %s", job_id, status)
    return status


@app.task(name=RUN_EVAL, acks_late=True)
def run_eval(eval_id: str, yielded: int = 0) -> str | None:
    """An eval run (worker/jobs/eval_runner.py): a model scored on a file, in this fresh child like a job, unless
    another project's turn comes first (worker/jobs/eval_turns.py)."""
    _refuse_while_draining()
    from worker.jobs.eval_runner import run_eval as run
    from worker.jobs.eval_turns import hand_over_turn

    if hand_over_turn(eval_id, get_settings(), yielded):
        return "yielded"

    status = run(eval_id, get_settings())
    log.info("eval run %s ended as %s", eval_id, status)
    return status


@worker_ready.connect
def _start_reconciler(**_):
    from worker.jobs import reconciler
    from worker.tracking import webhook_sender

    reconciler.start(get_settings(), interval_s=max(5.0, get_settings().lease_ttl_s / 3))
    webhook_sender.start(get_settings())


@worker_ready.connect
def _stop_at_once_when_idle(**_):
    """An idle worker on a polled broker (the embedded SQLite one) stops at once, not after its poll.

    Celery's stop handlers only set a flag that its loop reads between polls of the broker, and a
    poll of a polled transport lasts up to 3 s (a 2 s drain of 1 s sleeps). When the signal finds
    the worker asleep between polls, nothing is in flight: raise now what the loop would raise then."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        celery_handler = signal.getsignal(sig)
        if callable(celery_handler):
            signal.signal(sig, _then_stop_if_idle(celery_handler))


def _then_stop_if_idle(celery_handler):
    def handler(signum, frame):
        celery_handler(signum, frame)  # the warm shutdown (and its worker_shutting_down: drain)
        if _between_polls(frame) and worker_state.should_stop is not None:
            raise WorkerShutdown(worker_state.should_stop)

    return handler


def _between_polls(frame) -> bool:
    """The signal interrupted kombu's virtual transport in its sleep between two polls of the broker."""
    code = frame.f_code if frame is not None else None
    return code is not None and code.co_name == "drain_events" and code.co_filename.endswith(
        os.path.join("kombu", "transport", "virtual", "base.py"))


def _drain(*_):
    DRAIN.set()


def _in_pool_child() -> bool:
    """A prefork pool child, not the worker's main process. The solo pool sends worker_process_init too,
    but runs its jobs in the main process, whose SIGTERM must stay Celery's warm shutdown: taking it over
    there only drained the job, which queued itself again and was claimed again by the same worker,
    in a loop, until the worker was killed with the job still leased."""
    return current_process().name != "MainProcess"


@worker_process_init.connect
def _listen_for_drain(**_):
    if _in_pool_child():
        signal.signal(DRAIN_SIGNAL, _drain)
        pin_gpu(current_process().index, app.conf.worker_concurrency)


@task_prerun.connect
def _drain_on_sigterm(**_):
    """In a pool child, the first SIGTERM drains the job instead of killing it mid-step.

    Installed per task, not at process init: billiard replaces any SIGTERM handler the init hooks set
    with its own exit handler, which stays the answer to a second SIGTERM."""
    if not _in_pool_child() or threading.current_thread() is not threading.main_thread():
        return  # signal.signal works in the main thread only
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
