"""A per-project budget on the operator's judge for reward tests and grader runs.

A score_model grader without base_url runs on the operator's judge endpoint,
with the operator's key: every reward test is the operator's spend. Each
project may use `judge_tokens_per_project_hour` tokens of it in any hour
(sliding), as the judge reports them (or, when it does not, each call counted
at the reply cap judge_max_tokens). A project over its budget gets 429 with
the time until enough of it has aged out. Jobs are bounded by their own
limits (active jobs, steps) and are not counted here. Per API process, like
the other limits without Redis.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from service.errors import TooManyRequests

WINDOW_S = 3600.0


@dataclass
class JudgeBudget:
    tokens_per_hour: int
    clock: Callable[[], float] = time.monotonic
    _spent: dict[str, deque[tuple[float, int]]] = field(default_factory=dict)  # project -> (when, tokens)

    def used(self, project: str) -> int:
        spent = self._spent.get(project)
        if spent is None:
            return 0
        while spent and spent[0][0] <= self.clock() - WINDOW_S:
            spent.popleft()
        if not spent:
            del self._spent[project]
            return 0
        return sum(tokens for _, tokens in spent)

    def check(self, project: str) -> None:
        """Raise TooManyRequests when the project has spent its hour's tokens."""
        used = self.used(project)
        if used < self.tokens_per_hour:
            return
        # Wait until spending ages out below the budget again.
        left, retry_at = used, self.clock()
        for when, tokens in self._spent[project]:
            left -= tokens
            retry_at = when + WINDOW_S
            if left < self.tokens_per_hour:
                break
        raise TooManyRequests(f"judge budget: this project used {used} tokens of the service's judge in the last "
                              f"hour (the limit is {self.tokens_per_hour}); retry later or give the grader its own "
                              "base_url", retry_after_s=max(1.0, retry_at - self.clock()), code="judge_budget_exceeded")

    def charge(self, project: str, tokens: int) -> None:
        if tokens > 0:
            self._spent.setdefault(project, deque()).append((self.clock(), tokens))


def reported_tokens(answer: dict) -> int:
    """Tokens the judge reported for one scoring answer (its per-model usage)."""
    return sum(int(u.get("total_tokens", 0) or 0) for u in (answer.get("usage") or {}).values())
