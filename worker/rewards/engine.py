"""The scoring engine: a reward spec plus a ScoringContext gives a BatchScorer. Torch-free.

One engine for every caller: the trainer (via worker/trainer/rewards.py),
and the API's reward test and graders/run endpoints, which run it in a
subprocess (worker/rewards/runner.py) so user code and outbound calls never
run in the API process. Where each kind of reward runs:

- builtins and template graders: our pure functions, in this process;
- ``regex`` and ``json_schema``: the user's pattern or schema (whose patterns are user regexes too), in a
  killable child with deadlines (worker/rewards/regex.py);
- ``python``: user code, in a sandboxed child (worker/rewards/sandbox.py);
- ``http`` / ``score_model``: remote calls through the egress policy;
- ``multi``: its parts (scored side by side in threads), then the weights or formula.

Everything the spec does not hold comes from the ScoringContext: secret
values (the spec names them), the egress policy, the service's judge endpoint.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from service.egress import EgressPolicy
from service.schemas.formula import compile_formula
from service.schemas.reward_checks import JsonSchemaReward
from service.schemas.rewards import HttpReward, MultiReward, PythonReward, RegexReward, ScoreModelReward
from worker.rewards import graders, json_checks
from worker.rewards.builtins import BUILTINS
from worker.rewards.errors import describe
from worker.rewards.judge import JudgeBatchScorer, JudgeEndpoint
from worker.rewards.outcome import BatchScorer, Outcome, add_usage
from worker.rewards.regex import RegexBatchScorer
from worker.rewards.remote import HttpBatchScorer
from worker.rewards.sandbox import PythonRewardProcess

# type -> fn(completion, row, spec): our own code, safe to call in-process.
PURE_REWARDS: dict[str, Callable[[str, Mapping[str, Any], Any], float]] = {
    **BUILTINS,
    "json_valid": json_checks.json_valid,
    "string_check": graders.string_check,
    "similarity": graders.similarity,
}


@dataclass(frozen=True)
class ScoringContext:
    secrets: Mapping[str, str] = field(default_factory=dict)  # name -> value, for the specs' auth_secret
    egress: EgressPolicy = EgressPolicy()
    judge: JudgeEndpoint | None = None  # the service's score_model endpoint, if the operator set one

    @classmethod
    def from_settings(cls, settings, secrets: Mapping[str, str] | None = None) -> ScoringContext:
        judge = JudgeEndpoint(settings.judge_base_url, settings.judge_api_key or None, settings.judge_max_tokens) \
            if settings.judge_base_url else None
        return cls(secrets=dict(secrets or {}), egress=EgressPolicy.from_setting(settings.egress_allow), judge=judge)

    def secret(self, name: str | None) -> str | None:
        if name is None:
            return None
        if name not in self.secrets:
            raise ValueError(f"the reward needs the secret {name!r}, which the project does not have "
                             "(create it with POST /v1/secrets)")
        return self.secrets[name]


def as_score(value: Any) -> float:
    """A finite float from a reward's return value, or TypeError/ValueError saying what it was."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"returned {type(value).__name__}, not a number")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"returned {value}")
    return value


class FunctionBatchScorer:
    """Calls ``fn(completion, row)`` here for each sample: trusted code only."""

    def __init__(self, fn: Callable[[str, dict], Any]):
        self.fn = fn

    def score(self, completions: list[str], rows: list[dict]) -> Outcome:
        out = Outcome.empty(len(completions))
        for i, (completion, row) in enumerate(zip(completions, rows, strict=True)):
            try:
                out.scores[i] = as_score(self.fn(completion, row))
            except Exception as e:  # any failure is the sample's, not the job's
                out.errors[i] = describe(e)
        return out

    def close(self) -> None:
        pass


class SandboxBatchScorer:
    """User Python source, scored batch by batch in a PythonRewardProcess child."""

    def __init__(self, process: PythonRewardProcess):
        self.process = process

    def score(self, completions: list[str], rows: list[dict]) -> Outcome:
        result = self.process.score(completions, rows)
        return Outcome(scores=list(result.scores), errors=list(result.errors))

    def close(self) -> None:
        self.process.close()


class MultiBatchScorer:
    """Named parts combined by weights or a formula; the parts' outcomes are kept as components."""

    def __init__(self, spec: MultiReward, parts: dict[str, BatchScorer]):
        self.spec, self.parts = spec, parts
        self.needed = spec.used_names()
        self.formula = compile_formula(spec.formula, spec.rewards) if spec.formula is not None else None
        self.weights = {n: (spec.weights or {}).get(n, 1.0) for n in spec.rewards}

    def score(self, completions: list[str], rows: list[dict]) -> Outcome:
        with ThreadPoolExecutor(max_workers=len(self.parts)) as pool:
            futures = {n: pool.submit(p.score, completions, rows) for n, p in self.parts.items()}
            parts = {n: f.result() for n, f in futures.items()}
        out = Outcome.empty(len(completions))
        out.components = parts
        for part in parts.values():
            for model, usage in part.usage.items():
                add_usage(out.usage, model, usage)
        for i in range(len(completions)):
            failed = [n for n in self.needed if parts[n].scores[i] is None]
            if failed:
                out.errors[i] = f"{failed[0]}: {parts[failed[0]].errors[i]}"
                continue
            values = {n: parts[n].scores[i] for n in self.needed}
            try:
                out.scores[i] = self.formula.evaluate(values) if self.formula else \
                    sum(self.weights[n] * v for n, v in values.items())
            except (ArithmeticError, ValueError, TypeError) as e:
                out.errors[i] = f"formula: {type(e).__name__}: {e}"
        return out

    def close(self) -> None:
        for part in self.parts.values():
            part.close()


def build_scorer(spec, context: ScoringContext | None = None) -> BatchScorer:
    """The BatchScorer for a service reward spec (not 'import', which only the trainer knows)."""
    context = context or ScoringContext()
    if isinstance(spec, MultiReward):
        parts: dict[str, BatchScorer] = {}
        try:
            for name, sub in spec.rewards.items():
                parts[name] = build_scorer(sub, context)
        except BaseException:
            for part in parts.values():
                part.close()
            raise
        return MultiBatchScorer(spec, parts)
    if isinstance(spec, RegexReward):
        return RegexBatchScorer(spec)
    if isinstance(spec, JsonSchemaReward):
        return json_checks.JsonSchemaBatchScorer(spec)
    if isinstance(spec, PythonReward):
        return SandboxBatchScorer(PythonRewardProcess(spec.source, spec.entry_point))
    if isinstance(spec, HttpReward):
        return HttpBatchScorer(spec, context.egress, context.secret(spec.auth_secret))
    if isinstance(spec, ScoreModelReward):
        if spec.base_url is not None:
            endpoint = JudgeEndpoint(spec.base_url, context.secret(spec.auth_secret))
        elif context.judge is not None:
            endpoint = context.judge
        else:
            raise ValueError("a score_model reward needs a judge endpoint: give base_url, or the operator sets "
                             "CISPO_JUDGE_BASE_URL")
        return JudgeBatchScorer(spec, endpoint, context.egress)
    fn = PURE_REWARDS[spec.type]
    return FunctionBatchScorer(lambda completion, row: fn(completion, row, spec))
