"""Running a reward test or grader run for a route: a concurrency slot, a short DB part, the scoring.

The routes that use this are `async`: the database part (checks, secret
reads) runs in the threadpool and returns at once; the scoring subprocess is
awaited on the event loop, so a reward that takes its full wall time holds
no thread that polling routes need. Slots are taken before anything else:
over the per-project or global cap the caller gets 429 + Retry-After.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from service.api.judge_budget import reported_tokens
from service.rewards.trials import Scoring


async def score(request: Request, project_id: str, prepare: Callable[[], Scoring]) -> dict:
    """The scoring subprocess's answer for what `prepare` (blocking, reads the database) returns."""
    settings, budget = request.app.state.settings, request.app.state.judge_budget
    async with request.app.state.scoring_slots.hold(project_id):
        scoring = await run_in_threadpool(prepare)  # its transaction has ended: no connection is held now
        if scoring.judge_calls:
            budget.check(project_id)
        leave = getattr(request.state, "leave_admission", None)
        if leave is not None:
            leave()  # scoring waits on a subprocess; other requests may take this place meanwhile
        answer = None
        try:
            answer = await scoring.run(settings)
            return answer
        finally:
            if scoring.judge_calls:  # a run that failed may still have used the judge: count the worst case
                estimate = scoring.judge_calls * settings.judge_max_tokens
                budget.charge(project_id, (answer is not None and reported_tokens(answer)) or estimate)
