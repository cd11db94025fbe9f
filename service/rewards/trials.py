"""Dry-running rewards and OpenAI graders on a few samples, with the exact scoring a job gets.

The scoring itself runs in a subprocess (service/rewards/runner.py); this
module checks the request, reads the secret values the spec names, and turns
the runner's answer into our reward-test shape or OpenAI's graders/run shape.
Each request is split in three: a short blocking part that reads the
database (run in the threadpool, transaction ended before scoring starts),
the scoring, awaited on the event loop under a wall-time limit, and the
shaping of the answer. The route holds a per-project and a global
concurrency slot throughout, so one tenant cannot occupy every scorer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter
from sqlalchemy.orm import Session

from service.errors import InvalidRequest
from service.repositories import secrets as secrets_repo
from service.rewards.references import check_reward_references, service_judges
from service.rewards.runner import run_reward
from service.schemas.graders import grader_reward, parse_grader
from service.schemas.rewards import RewardSpec, secret_names
from service.schemas.scoring_api import (
    GraderRunRequest,
    RewardTestErrors,
    RewardTestObject,
    RewardTestRequest,
    RewardTestResult,
    RewardTestTiming,
)
from service.secrets.box import secret_box
from service.settings import Settings

_SPEC = TypeAdapter(RewardSpec)


@dataclass(frozen=True)
class Scoring:
    """Everything the scoring subprocess needs, read from the database beforehand."""

    spec: dict
    completions: list[str]
    rows: list[dict]
    secrets: dict[str, str]
    judge_calls: int = 0  # requests to the operator's judge this scoring makes (its budget counts them)

    async def run(self, settings: Settings) -> dict:
        return await run_reward(self.spec, self.completions, self.rows, secrets=self.secrets, settings=settings)


def _prepare(session: Session, project_id: str, spec_json: dict, completions: list[str], rows: list[dict], *,
             param: str, settings: Settings) -> Scoring:
    spec = _SPEC.validate_python(spec_json)
    check_reward_references(session, project_id, spec, param=param, settings=settings)
    secrets = secrets_repo.values(session, project_id, secret_names(spec), secret_box(settings))
    session.rollback()  # no transaction stays open while user code runs
    return Scoring(spec_json, completions, rows, secrets, judge_calls=len(completions) * service_judges(spec))


def prepare_reward_test(session: Session, project_id: str, spec_json: dict, body: RewardTestRequest, *,
                        settings: Settings) -> Scoring:
    completions, rows = body.pairs()
    return _prepare(session, project_id, spec_json, completions, rows, param="spec", settings=settings)


def reward_test_result(answer: dict) -> RewardTestObject:
    count = len(answer["scores"])
    components = answer.get("components", {})
    results = [
        RewardTestResult(score=answer["scores"][i], error=answer["errors"][i], error_kind=answer["kinds"][i],
                         sub_scores={n: c["scores"][i] for n, c in components.items()})
        for i in range(count)
    ]
    by_kind: dict[str, int] = {}
    for kind in answer["kinds"]:
        if kind is not None:
            by_kind[kind] = by_kind.get(kind, 0) + 1
    seconds = float(answer["seconds"])
    return RewardTestObject(
        results=results, scores=answer["scores"], sub_scores={n: c["scores"] for n, c in components.items()},
        errors=RewardTestErrors(count=sum(by_kind.values()), by_kind=by_kind),
        timing=RewardTestTiming(total_seconds=seconds, per_sample_seconds=seconds / count),
    )


# -- OpenAI graders ------------------------------------------------------------------

_FLAGS = ("formula_parse_error", "invalid_variable_error", "model_grader_parse_error", "model_grader_refusal_error",
          "model_grader_server_error", "other_error", "python_grader_runtime_error", "python_grader_server_error",
          "sample_parse_error", "truncated_observation_error", "unresponsive_reward_error")
_KIND_FLAGS = {"timeout": "unresponsive_reward_error", "sandbox": "python_grader_server_error",
               "invalid_variable": "invalid_variable_error", "sample_parse": "sample_parse_error",
               "judge_refusal": "model_grader_refusal_error", "judge_parse": "model_grader_parse_error",
               "judge_server": "model_grader_server_error"}


def _error_flags(failures: list[tuple[str, str, str]]) -> dict[str, Any]:
    """OpenAI's metadata.errors from (kind, message, grader type) triples."""
    errors: dict[str, Any] = {flag: False for flag in _FLAGS}
    errors.update(model_grader_server_error_details=None, python_grader_runtime_error_details=None,
                  python_grader_server_error_type=None)
    for kind, message, grader_type in failures:
        flag = _KIND_FLAGS.get(kind)
        if flag is None:
            flag = "python_grader_runtime_error" if grader_type == "python" else "other_error"
        errors[flag] = True
        if flag == "python_grader_runtime_error":
            errors["python_grader_runtime_error_details"] = message
        elif flag == "model_grader_server_error":
            errors["model_grader_server_error_details"] = message
        elif flag == "python_grader_server_error":
            errors["python_grader_server_error_type"] = kind
    return errors


def prepare_grader_run(session: Session, project_id: str, body: GraderRunRequest, *,
                       settings: Settings) -> Scoring:
    """POST /v1/fine_tuning/alpha/graders/run, first part: check the grader and the item."""
    parse_grader(body.grader, param="grader")
    item = {} if body.item is None else body.item
    if not isinstance(item, dict):
        raise InvalidRequest("item: must be an object (a dataset row)", param="item")
    reward = grader_reward(body.grader, param="grader")
    return _prepare(session, project_id, reward, [body.model_sample], [item], param="grader", settings=settings)


def grader_run_result(body: GraderRunRequest, answer: dict) -> dict:
    """OpenAI's GraderRunResponse for one scored sample."""
    grader = parse_grader(body.grader, param="grader")
    score, error, kind = answer["scores"][0], answer["errors"][0], answer["kinds"][0]
    components = answer.get("components", {})
    failures = []
    if grader.type == "multi":
        for name, part in components.items():
            if part["errors"][0] is not None:
                failures.append((part["kinds"][0], part["errors"][0], body.grader["graders"][name]["type"]))
        if error is not None and not failures:
            failures.append((kind, error, "multi"))
    elif error is not None:
        failures.append((kind, error, grader.type))
    sub_rewards = {n: (p["scores"][0] if p["scores"][0] is not None else 0.0) for n, p in components.items()}
    usage = answer.get("usage", {})
    total_tokens = sum(u.get("total_tokens", 0) for u in usage.values())
    return {
        "reward": score if score is not None else 0.0,
        "metadata": {
            "name": grader.name, "type": grader.type, "errors": _error_flags(failures),
            "execution_time": float(answer["seconds"]), "scores": sub_rewards,
            "token_usage": total_tokens if usage else None,
            "sampled_model_name": getattr(grader, "model", None),
        },
        "sub_rewards": sub_rewards,
        "model_grader_token_usage_per_model": usage,
    }


def validate_grader(raw: dict) -> dict:
    """POST /v1/fine_tuning/alpha/graders/validate: the grader, once it is known to be usable."""
    parse_grader(raw, param="grader")
    return {"grader": raw}
