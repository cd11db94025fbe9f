"""Whether a worker that took an eval run's message runs it now or hands the turn to another project.

Eval runs and jobs share one first-in, first-out broker queue, so a project that asks for its evals first
would have every free worker run them while another project's job waits. A worker that takes an eval's
message checks the fair-share order over all queued work (service/repositories/evals.py,
another_project_goes_first): when another project's turn comes first, it sends the message again, after
YIELD_DELAY_S, and takes the next one. A run yields at most MAX_YIELDS times: a job that no worker here
takes (another base's shared workers, say) cannot hold an eval back for good.
"""

from __future__ import annotations

import logging

from service.db.session import session_factory
from service.queue import enqueue_eval
from service.repositories import evals as evals_repo
from service.settings import Settings

log = logging.getLogger(__name__)

YIELD_DELAY_S = 5.0
MAX_YIELDS = 12  # about a minute behind other projects' turns, at most


def hand_over_turn(eval_id: str, settings: Settings, yielded: int) -> bool:
    """True when the turn went to another project (the message was sent again); False: run the eval now."""
    if yielded >= MAX_YIELDS:
        return False
    with session_factory(settings.resolved_database_url())() as s:
        if not evals_repo.another_project_goes_first(s, eval_id, settings.project_weights):
            return False
    enqueue_eval(eval_id, settings=settings, delay_s=YIELD_DELAY_S, yielded=yielded + 1)
    log.info("eval run %s: another project's turn comes first; sent again (%d of %d)", eval_id, yielded + 1,
             MAX_YIELDS)
    return True
