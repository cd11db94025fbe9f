"""The ``score_model`` reward: a judge model on an OpenAI-compatible chat completions endpoint.

Per sample: render the messages, ask the judge, read a number from the
reply, clip it to the range. OpenAI forces its graders' replies into
``{"result": float, "steps": [...]}`` with structured outputs, which not
every compatible server offers, so we ask for that JSON in a first system
message and read the reply leniently: a JSON object with "result" (or
"score"), else the last number in the text. ``developer`` messages are sent
as ``system``, which more servers accept. Samples are judged concurrently
(``max_concurrency``), and the judge's token usage is added up per model.
"""

from __future__ import annotations

import dataclasses
import json
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from service.egress import EgressPolicy, bearer
from service.schemas.reward_remote import SCORE_DIGITS, ScoreModelReward
from service.schemas.templates import SampleParseError, TemplateError, render
from worker.rewards.builtins import last_number
from worker.rewards.errors import ScoringError
from worker.rewards.json_checks import extract_fenced
from worker.rewards.outcome import Outcome, add_usage
from worker.rewards.remote import post_with_retries

INSTRUCTION = ('You are grading a response. Reply with only a JSON object {{"result": <a number from {low:g} to '
               '{high:g}>, "steps": [{{"description": "...", "conclusion": "..."}}]}}.')


@dataclass(frozen=True)
class JudgeEndpoint:
    """Where score_model rewards are sent: an OpenAI-compatible base URL (…/v1) and its API key."""

    base_url: str
    api_key: str | None = None
    max_tokens: int | None = None  # the operator's cap on one reply (its own judge); None: the spec's own


def read_score(reply: str) -> float | None:
    """The judge's number: {"result": x} / {"score": x} as JSON (fenced or not), else the last number in the text."""
    try:
        parsed = json.loads(extract_fenced(reply).strip())
    except (ValueError, RecursionError):
        parsed = None
    if isinstance(parsed, dict):
        for key in ("result", "score"):
            value = parsed.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
    if isinstance(parsed, (int, float)) and not isinstance(parsed, bool):
        return float(parsed)
    return last_number(reply)


def _sampling(spec: ScoreModelReward, cap: int | None) -> dict[str, Any]:
    params = spec.sampling_params.model_dump(exclude_none=True)
    if "max_completions_tokens" in params:
        params["max_tokens"] = params.pop("max_completions_tokens")
    if cap is not None:
        params["max_tokens"] = min(params.get("max_tokens", cap), cap)
    return params


def on_scale(value: float, low: float, high: float) -> float:
    """The judge's number clipped to [low, high] and rounded to SCORE_DIGITS significant digits of the range's
    width (0.1235 on [0, 1], 7.123 on [0, 10]): a score, not a channel for whatever digits the judge wrote."""
    digits = SCORE_DIGITS - math.ceil(math.log10(high - low))
    return min(max(round(value, digits), low), high)


class JudgeBatchScorer:
    def __init__(self, spec: ScoreModelReward, endpoint: JudgeEndpoint, policy: EgressPolicy):
        self.spec, self.endpoint = spec, endpoint
        self.policy = dataclasses.replace(policy, read_timeout_s=spec.timeout_s)
        self.url = endpoint.base_url.rstrip("/") + "/chat/completions"
        self.headers = {"Authorization": bearer(endpoint.api_key)} if endpoint.api_key else {}  # keeps a binding
        low, high = spec.range
        self.instruction = {"role": "system", "content": INSTRUCTION.format(low=low, high=high)}

    def score(self, completions: list[str], rows: list[dict]) -> Outcome:
        out = Outcome.empty(len(completions))
        if not completions:
            return out
        with ThreadPoolExecutor(max_workers=min(self.spec.max_concurrency, len(completions))) as pool:
            results = list(pool.map(self._judge_one, completions, rows))
        for i, (score, error, usage) in enumerate(results):
            out.scores[i], out.errors[i] = score, error
            if usage is not None:
                add_usage(out.usage, self.spec.model, usage)
        return out

    def _judge_one(self, completion: str, row: dict) -> tuple[float | None, str | None, dict | None]:
        try:
            messages = [{"role": "system" if m.role == "developer" else m.role,
                         "content": render(m.content, completion, row)} for m in self.spec.input]
        except (TemplateError, SampleParseError) as e:
            return None, str(e), None
        body = {"model": self.spec.model, "messages": [self.instruction, *messages],
                **_sampling(self.spec, self.endpoint.max_tokens)}
        try:
            answer = post_with_retries(self.url, body, self.policy, headers=self.headers, retries=self.spec.retries,
                                       prefix="judge:", secret=self.endpoint.api_key)
        except ScoringError as e:
            return None, str(e), None
        usage = answer.get("usage") if isinstance(answer, dict) else None
        try:
            message = answer["choices"][0]["message"]
            content = message.get("content")
        except (KeyError, IndexError, TypeError, AttributeError):
            return None, "judge reply: the answer has no choices[0].message", usage
        # The judge's own words are never passed on: they would make the judge a free chat endpoint for
        # whoever can run a reward test (on the operator's key, when it is the service's judge).
        if message.get("refusal"):
            return None, "judge refused: the judge declined to score this sample (its text is not shown)", usage
        value = read_score(content) if isinstance(content, str) else None
        if value is None:
            length = len(content) if isinstance(content, str) else 0
            return None, f"judge reply: no number in the judge's reply ({length} characters, not shown)", usage
        return on_scale(value, *self.spec.range), None, usage

    def close(self) -> None:
        pass
