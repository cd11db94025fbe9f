"""Builtin verifiers: pure functions ``fn(completion, row, spec) -> float`` giving 1.0 or 0.0.

Our code, fast and side-effect free, so the trainer calls them in-process.
(Not the regex reward: a user's pattern can backtrack for ever, so it is
matched in a killable child, worker/rewards/regex.py.)
A row without the spec's field raises KeyError; a row value that cannot be
compared raises ValueError. The scorer turns either into a sample error.
"""

from __future__ import annotations

import functools
import math
import re
import unicodedata
from collections.abc import Callable, Mapping
from typing import Any

from service.schemas.reward_checks import LengthReward
from service.schemas.rewards import (
    ContainsReward,
    ExactMatchReward,
    NumericMatchReward,
)

BuiltinFn = Callable[[str, Mapping[str, Any], Any], float]

# A number as written in text: optional sign (not after a word character, so
# "10-20" reads 20), digits with optional thousands separators ("1,234"; a
# group must be exactly three digits), optional decimals and exponent.
_NUMBER = re.compile(
    r"""
    (?:(?<![\w.])-)?
    (?:
        (?<![\d.])\d{1,3}(?:,\d{3})+(?![\d])   # 1,234,567
      | (?<![\d.])\d+                          # 1234
      | (?<!\d)(?=\.\d)                        # .5
    )
    (?:\.\d+)?
    (?:[eE][-+]?\d+)?
    """,
    re.VERBOSE,
)
_BOXED = "\\boxed{"


def _field(row: Mapping[str, Any], name: str) -> Any:
    try:
        return row[name]
    except KeyError:
        raise KeyError(f"row has no field {name!r} (fields: {', '.join(map(repr, sorted(row))) or 'none'})") from None


def _normalise(text: str, *, case_sensitive: bool, strip: bool = False) -> str:
    if strip:
        text = text.strip()
    return text if case_sensitive else text.casefold()


_WHITESPACE = re.compile(r"\s+")


def _without_punctuation(text: str) -> str:
    return "".join(ch for ch in text if not unicodedata.category(ch).startswith("P"))


def exact_match(completion: str, row: Mapping[str, Any], spec: ExactMatchReward) -> float:
    expected = str(_field(row, spec.field))

    def norm(text: str) -> str:
        if spec.strip_punctuation:
            text = _without_punctuation(text)
        if spec.collapse_whitespace:
            text = _WHITESPACE.sub(" ", text)
        return _normalise(text, case_sensitive=spec.case_sensitive, strip=spec.strip)

    return 1.0 if norm(completion) == norm(expected) else 0.0


def contains(completion: str, row: Mapping[str, Any], spec: ContainsReward) -> float:
    needle = str(_field(row, spec.field))
    norm = functools.partial(_normalise, case_sensitive=spec.case_sensitive)
    return 1.0 if norm(needle) in norm(completion) else 0.0


def last_number(text: str) -> float | None:
    """The last number written in ``text`` ("1,234.5" -> 1234.5, "-3" -> -3.0), or None."""
    found = None
    for found in _NUMBER.finditer(text):
        pass
    if found is None:
        return None
    value = float(found.group().replace(",", ""))
    return value if math.isfinite(value) else None


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` in ``text`` (nested braces balanced), or None."""
    start = text.rfind(_BOXED)
    while start != -1:
        depth, i = 1, start + len(_BOXED)
        while i < len(text):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start + len(_BOXED): i]
            i += 1
        start = text.rfind(_BOXED, 0, start)  # unclosed: try an earlier one
    return None


def _boxed_number(text: str) -> float | None:
    content = last_boxed(text)
    if content is None:
        return None
    content = content.strip().strip("$").strip().rstrip(".")
    match = _NUMBER.fullmatch(content)
    if match is None:
        return None
    value = float(content.replace(",", ""))
    return value if math.isfinite(value) else None


def number_after_hashes(text: str) -> float | None:
    """The number right after the last ``####`` (spaces and a ``$`` may come between), or None."""
    start = text.rfind("####")
    if start == -1:
        return None
    rest = text[start + 4 :].lstrip().lstrip("$").lstrip()
    match = _NUMBER.match(rest)
    if match is None or not match.group():
        return None
    value = float(match.group().replace(",", ""))
    return value if math.isfinite(value) else None


def numeric_match(completion: str, row: Mapping[str, Any], spec: NumericMatchReward) -> float:
    raw = _field(row, spec.field)
    try:
        if isinstance(raw, bool):
            raise TypeError
        expected = float(raw.replace(",", "") if isinstance(raw, str) else raw)
    except (TypeError, ValueError):
        raise ValueError(f"row field {spec.field!r} is not a number: {raw!r:.100}") from None
    read = {"boxed": _boxed_number, "after_hashes": number_after_hashes}.get(spec.source, last_number)
    got = read(completion)
    if got is None:
        return 0.0
    return 1.0 if abs(got - expected) <= spec.tolerance else 0.0


def length(completion: str, row: Mapping[str, Any], spec: LengthReward) -> float:
    """See LengthReward for the formula."""
    n = len(completion.split()) if spec.unit == "words" else len(completion)
    over, under = n - spec.target, spec.target - n
    if spec.penalize == "over":
        distance = over
    elif spec.penalize == "under":
        distance = under
    else:
        distance = abs(over)
    d = max(0, distance - spec.tolerance)
    if spec.penalty == "linear":
        return max(0.0, 1.0 - d / spec.scale)
    return math.exp(-(d * d) / (2 * spec.scale * spec.scale))


BUILTINS: dict[str, BuiltinFn] = {
    "exact_match": exact_match,
    "contains": contains,
    "numeric_match": numeric_match,
    "length": length,
}

