"""JSON output rewards: does the completion parse, and does it conform to a schema.

A completion that is not JSON, or does not conform, scores 0.0: that is the
policy's output being wrong, not the reward failing, so it is not an error.

A schema is user input whose ``pattern`` and ``patternProperties`` are
regexes that can backtrack for ever, so json_schema validates in the regex
reward's killable child, under its deadlines (worker/rewards/regex.py); a
sample that misses its deadline gets ``json_schema: timed out ...``.
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from service.schemas.reward_checks import JsonSchemaReward, JsonValidReward
from worker.rewards.regex import BATCH_BUDGET_S, TIMEOUT_S, ChildBatchScorer

_FENCE = re.compile(r"```[ \t]*(?:json|JSON)?[ \t]*\r?\n(.*?)```", re.DOTALL)
_NOT_JSON = object()


def extract_fenced(text: str) -> str:
    """The content of the first ```json (or bare ```) fenced block, or the text itself when there is none."""
    match = _FENCE.search(text)
    return match.group(1) if match else text


def reject_constant(name: str):
    """Python's json reads NaN, Infinity and -Infinity; RFC 8259 JSON has no such values."""
    raise ValueError(f"{name} is not JSON")


def parse_json(completion: str, *, fenced: bool) -> Any:
    """The parsed value, or _NOT_JSON (strict RFC 8259: NaN and Infinity are not JSON)."""
    text = extract_fenced(completion) if fenced else completion
    try:
        return json.loads(text, parse_constant=reject_constant)
    except (ValueError, RecursionError):
        return _NOT_JSON


def json_valid(completion: str, row: Mapping[str, Any], spec: JsonValidReward) -> float:
    return 0.0 if parse_json(completion, fenced=spec.fenced) is _NOT_JSON else 1.0


def _jsonschema_path() -> str:
    """The directory jsonschema (and, beside it, its dependencies) is installed in, for the child's sys.path."""
    spec = importlib.util.find_spec("jsonschema")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("jsonschema is not installed")
    return str(Path(spec.origin).parents[1])


class JsonSchemaBatchScorer(ChildBatchScorer):
    """Scores batches with one JsonSchemaReward: 1.0 where the completion is JSON that conforms, else 0.0."""

    label = "json_schema"

    def __init__(self, spec: JsonSchemaReward, *, timeout_s: float = TIMEOUT_S,
                 batch_budget_s: float = BATCH_BUDGET_S):
        super().__init__(timeout_s=timeout_s, batch_budget_s=batch_budget_s)
        self.spec = spec
        self.sys_path = [_jsonschema_path()]

    def texts(self, completions: list[str]) -> list[str]:
        return [extract_fenced(c) if self.spec.fenced else c for c in completions]

    def request(self, texts: list[str]) -> dict:
        return {"schema": self.spec.json_schema, "sys_path": self.sys_path, "texts": texts}
