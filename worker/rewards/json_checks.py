"""JSON output rewards: does the completion parse, and does it conform to a schema.

A completion that is not JSON, or does not conform, scores 0.0: that is the
policy's output being wrong, not the reward failing, so it is not an error.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping
from typing import Any

import jsonschema

from service.schemas.reward_checks import JsonSchemaReward, JsonValidReward

_FENCE = re.compile(r"```[ \t]*(?:json|JSON)?[ \t]*\r?\n(.*?)```", re.DOTALL)
_NOT_JSON = object()


def extract_fenced(text: str) -> str:
    """The content of the first ```json (or bare ```) fenced block, or the text itself when there is none."""
    match = _FENCE.search(text)
    return match.group(1) if match else text


def parse_json(completion: str, *, fenced: bool) -> Any:
    """The parsed value, or _NOT_JSON."""
    text = extract_fenced(completion) if fenced else completion
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return _NOT_JSON


def json_valid(completion: str, row: Mapping[str, Any], spec: JsonValidReward) -> float:
    return 0.0 if parse_json(completion, fenced=spec.fenced) is _NOT_JSON else 1.0


@functools.lru_cache(maxsize=32)
def _validator(schema_json: str) -> jsonschema.protocols.Validator:
    schema = json.loads(schema_json)
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema)


def json_schema(completion: str, row: Mapping[str, Any], spec: JsonSchemaReward) -> float:
    value = parse_json(completion, fenced=spec.fenced)
    if value is _NOT_JSON:
        return 0.0
    validator = _validator(json.dumps(spec.json_schema, sort_keys=True))
    return 1.0 if validator.is_valid(value) else 0.0
