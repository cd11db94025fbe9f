"""The worker's "stop after a checkpoint" flag, in a module light enough to import from a signal handler.

Set when the worker shuts down gracefully (worker/celery_app.py): the running job checkpoints at its next
step boundary and goes back to the queue without using up an attempt (worker/jobs/job_runner.py). It lives
apart from the job runner because importing that loads torch, which can take many seconds: a signal
handler that did so stalled every stop (and a second signal arriving meanwhile met a half-imported module).
"""

from __future__ import annotations

import threading

DRAIN = threading.Event()
