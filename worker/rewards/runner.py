"""``python -m worker.rewards.runner``: score a few samples with a reward spec, for the API. Torch-free.

The API must not run user code or import the worker, yet its reward test
and graders/run endpoints need the exact scoring a job gets. So the API
(service/rewards/runner.py) starts this module as a subprocess with a clean
environment, writes one JSON request on stdin and reads one JSON answer
from stdout; python rewards still go one level further, into the sandbox.

    in:  {"spec": {...}, "completions": [str], "rows": [{...}],
          "secrets": {name: value}, "egress_allow": str, "judge": {"base_url", "api_key"} | null}
    out: {"scores": [float|null], "errors": [str|null], "kinds": [str|null],
          "components": {name: {"scores", "errors", "kinds"}}, "usage": {model: {...}}, "seconds": float}
      or {"load_error": str} when the reward cannot even start (bad source, missing secret).
"""

from __future__ import annotations

import json
import sys
import time

from pydantic import TypeAdapter

from service.egress import EgressPolicy
from service.schemas.rewards import RewardSpec
from worker.rewards.engine import ScoringContext, build_scorer
from worker.rewards.errors import describe, error_kind
from worker.rewards.judge import JudgeEndpoint
from worker.rewards.outcome import Outcome
from worker.rewards.sandbox import RewardLoadError


def _plain(outcome: Outcome) -> dict:
    return {"scores": outcome.scores, "errors": outcome.errors,
            "kinds": [None if e is None else error_kind(e) for e in outcome.errors]}


def score_request(request: dict) -> dict:
    spec = TypeAdapter(RewardSpec).validate_python(request["spec"])
    judge = request.get("judge")
    context = ScoringContext(secrets=request.get("secrets") or {},
                             egress=EgressPolicy.from_setting(request.get("egress_allow", "")),
                             judge=JudgeEndpoint(judge["base_url"], judge.get("api_key"), judge.get("max_tokens"))
                             if judge else None)
    started = time.perf_counter()
    try:
        scorer = build_scorer(spec, context)
        try:
            outcome = scorer.score(list(request["completions"]), list(request["rows"]))
        finally:
            scorer.close()
    except (RewardLoadError, ValueError) as e:
        return {"load_error": describe(e)}
    return {**_plain(outcome), "components": {n: _plain(c) for n, c in outcome.components.items()},
            "usage": outcome.usage, "seconds": time.perf_counter() - started}


def main() -> None:
    protocol = sys.stdout
    sys.stdout = sys.stderr  # nothing but the answer reaches the protocol stream
    answer = score_request(json.load(sys.stdin))
    protocol.write(json.dumps(answer))
    protocol.flush()


if __name__ == "__main__":
    main()
