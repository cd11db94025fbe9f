"""Reward specs a job may name: user Python, builtin checks, remote scorers, and combinations of them.

Torch-free, and never runs user code: the API validates these specs, the
worker scores with them (worker/rewards/). Each spec is a ``type``-tagged,
frozen model that refuses unknown fields.

The service accepts exactly the types in ``RewardSpec`` (``SERVICE_REWARD_TYPES``).
The job spec also knows ``import`` (``job_spec.ImportReward``): a trusted
callable imported into the trainer process, for local CLI runs only; the
service refuses it, since it would run arbitrary code in the worker.

- ``python``: user source defining ``reward(completion, **row) -> float``,
  run in a separate, restricted process (worker/rewards/sandbox.py), never in
  the API, Celery or trainer process. Validation here only compiles and
  parses the source; it never executes it.
- ``exact_match``, ``contains``, ``regex``, ``numeric_match``: builtin
  verifiers (worker/rewards/builtins.py) that give 1.0 or 0.0.
- ``json_valid``, ``json_schema``, ``length``, ``similarity``, ``string_check``:
  builtin graded checks (reward_checks.py).
- ``http``, ``score_model``: a remote scoring endpoint or a judge model (reward_remote.py).
- ``multi``: named sub-rewards of the types above combined by weights or a
  formula; each sub-reward is also reported as its own metric.

OpenAI's graders map onto these types (service/schemas/graders.py).
"""

from __future__ import annotations

import ast
import re
from typing import Annotated, Literal

from pydantic import Field, StringConstraints, ValidationInfo, field_validator, model_validator

from service.schemas.python_source import check_identifier, check_source

from service.schemas.formula import FormulaError, compile_formula
from service.schemas.reward_base import RewardBase as _RewardBase
from service.schemas.reward_checks import (
    JsonSchemaReward,
    JsonValidReward,
    LengthReward,
    SimilarityReward,
    StringCheckReward,
)
from service.schemas.reward_remote import HttpReward, ScoreModelReward

MAX_PATTERN_CHARS = 1000
MAX_SUB_REWARDS = 16


class PythonReward(_RewardBase):
    """User Python source, scored in a sandboxed child process.

    The source must define, at top level, ``def reward(completion, **row)``
    (or the name given as ``entry_point``) returning a real number. It is
    executed once per worker child with the standard library only (no site
    packages). A sample whose call raises, times out or returns a non-number,
    NaN or infinity gets the job's failure score and is counted as an error.
    """

    type: Literal["python"] = "python"
    source: str = Field(description="Python source, at most 256 KiB of UTF-8.")
    entry_point: str = Field("reward", description="Name of the top-level function to call.")

    @field_validator("source")
    @classmethod
    def _compiles(cls, source: str) -> str:
        return check_source(source, "<reward>")

    @field_validator("entry_point")
    @classmethod
    def _identifier(cls, name: str) -> str:
        return check_identifier(name, "entry_point")

    @model_validator(mode="after")
    def _defines_entry_point(self) -> PythonReward:
        tree = ast.parse(self.source, "<reward>")
        for node in tree.body:
            if getattr(node, "name", None) != self.entry_point:
                continue
            if isinstance(node, ast.FunctionDef):
                return self
            if isinstance(node, ast.AsyncFunctionDef):
                raise ValueError(
                    f"source line {node.lineno}: entry point {self.entry_point!r} must be a plain def, not async def"
                )
        raise ValueError(f"entry point {self.entry_point!r} is not defined (needs a top-level def)")


class ExactMatchReward(_RewardBase):
    """1.0 if the completion equals ``str(row[field])`` after normalisation, else 0.0.

    Normalisation applies to both sides, in this order: punctuation (Unicode
    category P*) is removed when ``strip_punctuation``; runs of whitespace
    become one space when ``collapse_whitespace``; surrounding whitespace is
    stripped when ``strip``; case is folded unless ``case_sensitive``.
    """

    type: Literal["exact_match"] = "exact_match"
    field: str = Field("answer", min_length=1, description="Row field holding the expected answer.")
    case_sensitive: bool = False
    strip: bool = True
    collapse_whitespace: bool = False
    strip_punctuation: bool = False


class ContainsReward(_RewardBase):
    """1.0 if ``str(row[field])`` occurs in the completion (case folded unless ``case_sensitive``)."""

    type: Literal["contains"] = "contains"
    field: str = Field("answer", min_length=1, description="Row field holding the text to look for.")
    case_sensitive: bool = False


class RegexReward(_RewardBase):
    """1.0 if ``pattern`` matches the completion: anywhere (re.search), or all of it when ``full_match``.

    Python ``re`` syntax; flags go inline, e.g. ``(?i)``. Patterns are capped
    at 1000 characters; the cap does not rule out catastrophic backtracking.
    """

    type: Literal["regex"] = "regex"
    pattern: str = Field(min_length=1, max_length=MAX_PATTERN_CHARS)
    full_match: bool = False

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, pattern: str) -> str:
        try:
            re.compile(pattern)
        except re.error as e:
            where = f" at position {e.pos}" if e.pos is not None else ""
            raise ValueError(f"invalid regular expression{where}: {e.msg}") from None
        except (RecursionError, OverflowError) as e:
            raise ValueError(f"invalid regular expression: {e}") from None
        return pattern


class NumericMatchReward(_RewardBase):
    """1.0 if the completion's answer number is within ``tolerance`` (absolute) of ``float(row[field])``.

    ``source`` picks the answer: ``last_number``, the last number in the
    completion (``-3``, ``2.5``, ``1,234.5``, ``1e-3``); ``boxed``, the
    content of the last ``\\boxed{...}``, which must be a single number; or
    ``after_hashes``, the number right after the last ``####`` (GSM8K's answer
    format, as verl's strict GSM8K score reads it). No number found gives 0.0;
    a row value that is not a number is a sample error.
    """

    type: Literal["numeric_match"] = "numeric_match"
    field: str = Field("answer", min_length=1, description="Row field holding the expected number.")
    tolerance: float = Field(1e-6, ge=0.0, allow_inf_nan=False, description="Absolute tolerance.")
    source: Literal["last_number", "boxed", "after_hashes"] = "last_number"


SingleReward = (
    PythonReward | ExactMatchReward | ContainsReward | RegexReward | NumericMatchReward | JsonValidReward
    | JsonSchemaReward | LengthReward | SimilarityReward | StringCheckReward | HttpReward | ScoreModelReward
)
"""Every service reward type except multi (a multi's parts)."""

SubRewardName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,39}$")]


class MultiReward(_RewardBase):
    """Named sub-rewards combined into one score; each is also reported per step as ``reward/<name>_mean``.

    The combined score is the ``formula`` (service/schemas/formula.py) over
    the sub-reward names, or else the weighted sum of the sub-rewards
    (``weights``, 1 for each name left out; not normalised, so give 1/n each
    for a mean). A sample fails when a sub-reward it needs fails, or when the
    formula is undefined for it (division by zero, log of 0).
    """

    type: Literal["multi"] = "multi"
    rewards: dict[SubRewardName, Annotated[SingleReward, Field(discriminator="type")]] = Field(
        min_length=1, max_length=MAX_SUB_REWARDS)
    weights: dict[str, float] | None = None
    formula: str | None = Field(None, min_length=1, max_length=1000)

    # Field validators, not one model validator: an error then names the field it is about ("spec.weights").
    @field_validator("weights")
    @classmethod
    def _weights_name_rewards(cls, weights: dict[str, float] | None, info: ValidationInfo) -> dict | None:
        rewards = info.data.get("rewards")  # absent when the rewards themselves were refused
        if weights is not None and rewards is not None and (unknown := sorted(set(weights) - set(rewards))):
            raise ValueError(f"names {', '.join(map(repr, unknown))}, which {'is' if len(unknown) == 1 else 'are'} "
                             f"not in rewards ({', '.join(map(repr, rewards))})")
        return weights

    @field_validator("formula")
    @classmethod
    def _formula_compiles(cls, formula: str | None, info: ValidationInfo) -> str | None:
        if formula is None:
            return None
        if info.data.get("weights") is not None:
            raise ValueError("give weights or formula, not both")
        if (rewards := info.data.get("rewards")) is not None:
            try:
                compile_formula(formula, rewards)
            except FormulaError as e:
                raise ValueError(str(e)) from None
        return formula

    def used_names(self) -> list[str]:
        """The sub-rewards the combined score depends on."""
        if self.formula is not None:
            return sorted(compile_formula(self.formula, self.rewards).variables)
        return [name for name in self.rewards if (self.weights or {}).get(name, 1.0) != 0.0]


AnyReward = SingleReward | MultiReward

RewardSpec = Annotated[AnyReward, Field(discriminator="type")]
"""The reward specs the service accepts."""

BuiltinRewardSpec = ExactMatchReward | ContainsReward | RegexReward | NumericMatchReward

SERVICE_REWARD_TYPES = frozenset({
    "python", "exact_match", "contains", "regex", "numeric_match", "json_valid", "json_schema", "length",
    "similarity", "string_check", "http", "score_model", "multi",
})


def secret_names(spec) -> set[str]:
    """The project secrets a reward spec needs (it may hold names, never values)."""
    if isinstance(spec, MultiReward):
        return set().union(*(secret_names(s) for s in spec.rewards.values()))
    name = getattr(spec, "auth_secret", None)
    return {name} if name else set()
