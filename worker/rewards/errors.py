"""Reward errors: what kind each one is, a short summary for events, and the error-rate stop.

Scorers report a failed sample as one message string (the sandbox child's
protocol is strings, and strings go into events as they are). The engine's
own failures start with a fixed prefix ("http:", "judge:", "template:", ...)
so that ``error_kind`` can sort every message into a small set of kinds for
the test endpoint and OpenAI's graders/run error flags.
"""

from __future__ import annotations

from collections import Counter

from service.schemas.templates import SampleParseError, TemplateError

MAX_MESSAGE_CHARS = 200

# Substrings (checked in order) -> kind.
_KINDS = (
    ("timeout after", "timeout"),
    ("timed out", "timeout"),
    ("reward process", "sandbox"),
    ("failed to load", "sandbox"),
    ("not a number", "non_numeric"),
    ("returned nan", "non_finite"),
    ("returned inf", "non_finite"),
    ("returned -inf", "non_finite"),
    ("template:", "invalid_variable"),
    ("sample_parse:", "sample_parse"),
    ("formula:", "formula"),
    ("judge refused:", "judge_refusal"),
    ("judge reply:", "judge_parse"),
    ("judge:", "judge_server"),
    ("http:", "http"),
)
KINDS = ("timeout", "sandbox", "non_numeric", "non_finite", "invalid_variable", "sample_parse", "formula",
         "judge_refusal", "judge_parse", "judge_server", "http", "exception")


class ScoringError(Exception):
    """A failure of the scoring machinery for some samples; its message starts with a kind prefix."""


class RewardErrorRateExceeded(RuntimeError):
    """Too many samples of one step failed to score: the reward is broken, so the job stops."""


class EnvironmentErrorRateExceeded(RewardErrorRateExceeded):
    """Too many episodes of one step failed in the environment (its reset or step calls): it is broken."""


def error_kind(message: str) -> str:
    lowered = message.lower()
    for needle, kind in _KINDS:
        if needle in lowered:
            return kind
    return "exception"


def describe(exc: BaseException) -> str:
    """A sample's error message: our own errors as they are, anything else as 'Type: message'."""
    if isinstance(exc, (ScoringError, TemplateError, SampleParseError)):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def truncate(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    return message if len(message) <= limit else message[: limit - 1] + "…"


def summarize(errors: list[str], limit: int = 5) -> list[tuple[str, int]]:
    """The ``limit`` most frequent distinct messages (truncated) with their counts, most frequent first."""
    return Counter(truncate(e) for e in errors).most_common(limit)


def error_rate_message(step: int, failed: int, total: int, threshold: float, errors: list[str], *,
                       environment: str | None = None) -> str:
    """`environment` (its description) when the failures are an environment's; its errors name the failing call."""
    top = summarize(errors, 1)
    example = f": {top[0][0]}" if top else ""
    what, unit = (f"{environment} failed", "episodes") if environment else ("reward function failed", "samples")
    return (f"{what} on {failed / total:.0%} of {unit} at step {step} "
            f"(threshold {threshold:.0%}; {failed} of {total}){example}")
