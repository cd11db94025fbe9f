"""Reward specs a job may name: user Python code and builtin verifiers.

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
"""

from __future__ import annotations

import ast
import keyword
import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_SOURCE_BYTES = 256 * 1024
MAX_PATTERN_CHARS = 1000


class _RewardBase(BaseModel):
    # Same rules as job_spec.Strict; kept separate so job_spec can import this module.
    model_config = ConfigDict(extra="forbid", frozen=True)


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
        size = len(source.encode("utf-8", "surrogatepass"))
        if size > MAX_SOURCE_BYTES:
            raise ValueError(f"source is {size} bytes, more than {MAX_SOURCE_BYTES} (256 KiB)")
        try:
            compile(source, "<reward>", "exec", dont_inherit=True)
        except SyntaxError as e:
            raise ValueError(f"source line {e.lineno}: {e.msg}") from None
        except (ValueError, RecursionError, MemoryError) as e:  # null bytes, absurd nesting
            raise ValueError(f"source does not compile: {e}") from None
        return source

    @field_validator("entry_point")
    @classmethod
    def _identifier(cls, name: str) -> str:
        if not name.isidentifier() or keyword.iskeyword(name):
            raise ValueError(f"entry_point {name!r} is not a Python identifier")
        return name

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

    Normalisation applies to both sides: surrounding whitespace is stripped
    when ``strip``; case is folded unless ``case_sensitive``.
    """

    type: Literal["exact_match"] = "exact_match"
    field: str = Field("answer", min_length=1, description="Row field holding the expected answer.")
    case_sensitive: bool = False
    strip: bool = True


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
    completion (``-3``, ``2.5``, ``1,234.5``, ``1e-3``); or ``boxed``, the
    content of the last ``\\boxed{...}``, which must be a single number. No
    number found gives 0.0; a row value that is not a number is a sample error.
    """

    type: Literal["numeric_match"] = "numeric_match"
    field: str = Field("answer", min_length=1, description="Row field holding the expected number.")
    tolerance: float = Field(1e-6, ge=0.0, allow_inf_nan=False, description="Absolute tolerance.")
    source: Literal["last_number", "boxed"] = "last_number"


RewardSpec = Annotated[
    PythonReward | ExactMatchReward | ContainsReward | RegexReward | NumericMatchReward,
    Field(discriminator="type"),
]
"""The reward specs the service accepts."""

BuiltinRewardSpec = ExactMatchReward | ContainsReward | RegexReward | NumericMatchReward

SERVICE_REWARD_TYPES = frozenset({"python", "exact_match", "contains", "regex", "numeric_match"})
