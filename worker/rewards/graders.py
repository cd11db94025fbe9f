"""Template-rendering rewards: OpenAI's string_check and text similarity, per sample.

Both render their templates (service/schemas/templates.py) with the sample's
completion and dataset row, then compare. A variable the row does not have
raises TemplateError, which the scorer records as that sample's error.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from service.schemas.reward_checks import SimilarityReward, StringCheckReward
from service.schemas.templates import render
from worker.rewards.similarity import similarity as similarity_metric


def string_check(completion: str, row: Mapping[str, Any], spec: StringCheckReward) -> float:
    text, reference = render(spec.input, completion, row), render(spec.reference, completion, row)
    if spec.operation == "eq":
        passed = text == reference
    elif spec.operation == "ne":
        passed = text != reference
    elif spec.operation == "like":
        passed = reference in text
    else:  # ilike
        passed = reference.casefold() in text.casefold()
    return 1.0 if passed else 0.0


def similarity(completion: str, row: Mapping[str, Any], spec: SimilarityReward) -> float:
    text = render(spec.input, completion, row)
    if spec.reference is not None:
        reference = render(spec.reference, completion, row)
    elif spec.field in row:
        reference = str(row[spec.field])
    else:
        fields = ", ".join(map(repr, sorted(row))) or "none"
        raise KeyError(f"row has no field {spec.field!r} (fields: {fields})")
    return similarity_metric(spec.metric, text, reference)
