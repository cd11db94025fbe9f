"""Builtin reward specs beyond exact answers: JSON output, length, text similarity, templated string checks.

Torch-free specs only; the scoring is in worker/rewards/ (json_checks.py,
builtins.py, graders.py, similarity.py). Each gives a score in [0, 1] for
the policy's output; a malformed completion scores 0, it is not an error.
Errors are reserved for what the reward itself cannot do (a row without the
named field, a template variable that does not resolve).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, field_validator

from service.schemas.reward_base import RewardBase, Template

MAX_SCHEMA_BYTES = 64 * 1024
SIMILARITY_METRICS = ("token_f1", "edit_ratio", "fuzzy_match", "bleu",
                      "rouge_1", "rouge_2", "rouge_3", "rouge_4", "rouge_5", "rouge_l")
SimilarityMetric = Literal["token_f1", "edit_ratio", "fuzzy_match", "bleu",
                           "rouge_1", "rouge_2", "rouge_3", "rouge_4", "rouge_5", "rouge_l"]


class JsonValidReward(RewardBase):
    """1.0 if the completion parses as JSON, else 0.0.

    With ``fenced``, the content of the first fenced block (```json ... ```
    or ``` ... ```) is parsed when there is one, else the whole completion.
    Surrounding whitespace is ignored.
    """

    type: Literal["json_valid"] = "json_valid"
    fenced: bool = False


class JsonSchemaReward(RewardBase):
    """1.0 if the completion is JSON (see json_valid's ``fenced``) that conforms to ``json_schema``, else 0.0.

    The schema is checked against its own metaschema (Draft 2020-12 unless it
    names another with ``$schema``) when the spec is created; ``$ref`` to
    remote documents is not followed.
    """

    type: Literal["json_schema"] = "json_schema"
    json_schema: dict[str, Any] = Field(description="A JSON Schema document.")
    fenced: bool = False

    @field_validator("json_schema")
    @classmethod
    def _valid_schema(cls, schema: dict[str, Any]) -> dict[str, Any]:
        import jsonschema  # API and worker both have it; imported here to keep plain spec imports light

        size = len(json.dumps(schema))
        if size > MAX_SCHEMA_BYTES:
            raise ValueError(f"json_schema is {size} bytes, more than {MAX_SCHEMA_BYTES}")
        validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        try:
            validator.check_schema(schema)
        except jsonschema.SchemaError as e:
            where = "/".join(map(str, e.absolute_path)) or "(root)"
            raise ValueError(f"json_schema is not a valid schema at {where}: {e.message}") from None
        return schema


class LengthReward(RewardBase):
    """Rewards a completion whose length is near ``target`` (characters or whitespace-separated words).

    With n the completion's length and
        d = max(0, |n - target| - tolerance)      (0 when only the penalised side is considered and n is on the other)
    the score is
        linear:   max(0, 1 - d / scale)           (0 from d >= scale on)
        gaussian: exp(-d^2 / (2 * scale^2))       (about 0.61 at d = scale, 0.14 at 2 * scale)
    ``penalize`` picks which side counts: "both", "over" (only longer than
    target + tolerance) or "under" (only shorter than target - tolerance).
    """

    type: Literal["length"] = "length"
    unit: Literal["chars", "words"] = "words"
    target: int = Field(ge=0, le=1_000_000)
    tolerance: int = Field(0, ge=0, le=1_000_000, description="Distance from target that still scores 1.")
    penalty: Literal["linear", "gaussian"] = "linear"
    scale: float = Field(gt=0, le=1e7, description="linear: distance (beyond tolerance) that scores 0; "
                         "gaussian: its standard deviation.")
    penalize: Literal["both", "over", "under"] = "both"


class SimilarityReward(RewardBase):
    """A similarity in [0, 1] between ``input`` (the completion by default) and the reference.

    The reference is ``reference`` rendered when given, else ``str(row[field])``.
    Metrics (worker/rewards/similarity.py):
      token_f1     SQuAD-style F1 of the bags of words;
      edit_ratio   1 - Levenshtein distance / length of the longer text (characters);
      fuzzy_match  rapidfuzz's fuzz.ratio / 100: 2 * LCS / (len(a) + len(b)) over characters;
      bleu         sentence BLEU-4 with BLEU+1 smoothing (Lin & Och 2004) and brevity penalty;
      rouge_1..5   ROUGE-N F1 of n-gram overlap;  rouge_l  ROUGE-L F1 (longest common subsequence).
    Word metrics lowercase and split on runs of letters/digits (punctuation is dropped).
    """

    type: Literal["similarity"] = "similarity"
    metric: SimilarityMetric
    field: str = Field("answer", min_length=1, description="Row field holding the reference text.")
    reference: Template | None = Field(None, description="A template for the reference; replaces `field`.")
    input: Template = Field("{{ sample.output_text }}", description="A template for the text being graded.")


class StringCheckReward(RewardBase):
    """OpenAI's string_check: 1.0 or 0.0 from comparing two rendered templates.

    eq: equal; ne: not equal; like: reference occurs in input; ilike: the same, ignoring case.
    No normalisation (use exact_match for that).
    """

    type: Literal["string_check"] = "string_check"
    input: Template = "{{ sample.output_text }}"
    reference: Template
    operation: Literal["eq", "ne", "like", "ilike"]
