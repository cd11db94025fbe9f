"""Fair share of a base model's free worker slots between projects (issue 16).

A shared worker (CISPO_WORKER_JOBS > 1) with a free slot takes the queued job
of its base that comes first in `fair_order`; the API shows each queued job's
place in that order (the job object's queue_position).

The rule: a project's n-th waiting job (oldest first), when the project already
runs r jobs of that base, comes at (r + n) / weight. So the project holding
the fewest slots per unit of weight goes next: with equal weights (the
default) projects take turns, one job each, and a project that already runs
jobs waits behind one that runs none; a project of weight 2 gets two slots to
another's one. Ties go to the older job.

Weights decide slots only: in a cycle every resident job advances one step,
so a project's share of a worker's time is its share of the slots. Giving a
heavier project more steps per cycle instead would make a job's pace depend
on its neighbours and break the one-step-per-cycle accounting of the cycle.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction


@dataclass(frozen=True)
class Waiting:
    """A queued job, as the order needs it."""

    job_id: str
    project: str  # the project's name: what the operator's weights name
    created_at: int
    seq: int  # insertion order: breaks ties of created_at (whole seconds)


def fair_order(waiting: list[Waiting], running: Mapping[str, int], weights: Mapping[str, float]) -> list[str]:
    """The waiting jobs' ids in the order free slots take them; `running`: jobs of the base each project runs
    now; `weights`: per project name (absent: 1)."""
    nth: dict[str, int] = {}
    keyed = []
    for job in sorted(waiting, key=lambda w: (w.created_at, w.seq)):
        n = nth[job.project] = nth.get(job.project, 0) + 1
        # Exact fractions: (r + n) / w of two projects can tie, and a float would break that tie by rounding.
        turn = Fraction(running.get(job.project, 0) + n) / Fraction(weights.get(job.project, 1.0))
        keyed.append((turn, job.created_at, job.seq, job.job_id))
    return [job_id for *_, job_id in sorted(keyed)]
