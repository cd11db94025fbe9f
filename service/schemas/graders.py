"""OpenAI's RFT graders, validated and mapped onto our reward specs. Pure and torch-free.

    string_check     -> string_check (templates rendered per sample; eq, ne, like, ilike)
    text_similarity  -> similarity (fuzzy_match, bleu, rouge_1..rouge_5, rouge_l; pass_threshold is
                        accepted and does not change the reward, as in RFT where the score is the reward)
    python           -> python: the source plus a small entry point that calls
                        grade(sample={"output_text", "output_json", "output_tools", "choices"}, item=row),
                        run in the same sandbox as every python reward
    score_model      -> score_model (the service's judge endpoint, settings.judge_base_url)
    multi            -> multi (graders -> rewards by key, calculate_output -> formula); no nesting

Refused by name: label_model, cosine/gleu/meteor metrics, image_tag, image and audio
inputs, unknown fields. Used by the reinforcement job method (service/job_spec/build.py)
and by /v1/fine_tuning/alpha/graders/{run,validate}.
"""

from __future__ import annotations

import ast
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from service.errors import InvalidRequest, invalid_value
from service.schemas.formula import FormulaError, compile_formula
from service.schemas.reward_remote import JudgeSampling, check_score_range
from service.schemas.python_source import MAX_SOURCE_BYTES
from service.schemas.templates import check_template

SUPPORTED = ("string_check", "text_similarity", "python", "score_model", "multi")
METRICS = ("fuzzy_match", "bleu", "rouge_1", "rouge_2", "rouge_3", "rouge_4", "rouge_5", "rouge_l")
GRADE_ENTRY = "_openai_grade_entry"
GRADE_SHIM = f'''

# Added by the service: OpenAI's grade(sample, item), called the way python rewards are.
def {GRADE_ENTRY}(_completion, /, **item):
    import json as _json
    try:
        _output_json = _json.loads(_completion)
    except Exception:
        _output_json = None
    sample = {{"output_text": _completion, "output_json": _output_json, "output_tools": [], "choices": []}}
    return grade(sample, item)
'''
MAX_GRADER_SOURCE_BYTES = MAX_SOURCE_BYTES - len(GRADE_SHIM.encode())

TemplateText = Annotated[str, Field(max_length=20_000)]  # checked by check_template below


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class _Grader(_Model):
    name: str = Field(min_length=1, max_length=200)


class StringCheckGrader(_Grader):
    type: Literal["string_check"]
    input: TemplateText
    reference: TemplateText
    operation: Literal["eq", "ne", "like", "ilike"]

    @field_validator("input", "reference")
    @classmethod
    def _templates(cls, template: str) -> str:
        return check_template(template)


class TextSimilarityGrader(_Grader):
    type: Literal["text_similarity"]
    input: TemplateText
    reference: TemplateText
    evaluation_metric: str
    pass_threshold: float | None = None

    @field_validator("input", "reference")
    @classmethod
    def _templates(cls, template: str) -> str:
        return check_template(template)

    @field_validator("evaluation_metric")
    @classmethod
    def _supported_metric(cls, metric: str) -> str:
        if metric not in METRICS:
            why = {"cosine": "it needs an embedding model", "gleu": "it is not implemented",
                   "meteor": "it is not implemented"}.get(metric, "it is unknown")
            raise ValueError(f"evaluation_metric {metric!r} is not supported ({why}); supported: {', '.join(METRICS)}")
        return metric


class PythonGrader(_Grader):
    type: Literal["python"]
    source: str
    image_tag: str | None = None

    @field_validator("image_tag")
    @classmethod
    def _no_image(cls, tag: str | None) -> str | None:
        if tag is not None:
            raise ValueError(f"image_tag {tag!r} is not supported: python graders run with the standard library "
                             "only, in our sandbox; leave it out")
        return tag

    @field_validator("source")
    @classmethod
    def _defines_grade(cls, source: str) -> str:
        size = len(source.encode("utf-8", "surrogatepass"))
        if size > MAX_GRADER_SOURCE_BYTES:
            raise ValueError(f"source is {size} bytes, more than {MAX_GRADER_SOURCE_BYTES}")
        try:
            tree = ast.parse(source, "<grader>")
        except SyntaxError as e:
            raise ValueError(f"source line {e.lineno}: {e.msg}") from None
        except (ValueError, RecursionError, MemoryError) as e:
            raise ValueError(f"source does not compile: {e}") from None
        if not any(isinstance(n, ast.FunctionDef) and n.name == "grade" for n in tree.body):
            raise ValueError("source must define a top-level def grade(sample, item)")
        return source


class _TextPart(_Model):
    type: Literal["input_text", "output_text"]
    text: TemplateText


class JudgeInput(_Model):
    role: Literal["user", "assistant", "system", "developer"]
    content: TemplateText | _TextPart | list[_TextPart]
    type: Literal["message"] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content: Any) -> Any:
        parts = content if isinstance(content, list) else [content]
        for part in parts:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("input_image", "input_audio"):
                raise ValueError(f"content of type {kind!r} is not supported (text only)")
        return content

    def text(self) -> str:
        parts = self.content if isinstance(self.content, list) else [self.content]
        return "".join(p if isinstance(p, str) else p.text for p in parts)


class ScoreModelGrader(_Grader):
    type: Literal["score_model"]
    model: str = Field(min_length=1, max_length=200)
    input: list[JudgeInput] = Field(min_length=1, max_length=64)
    range: tuple[float, float] | None = None
    sampling_params: JudgeSampling | None = None
    pass_threshold: float | None = None

    @field_validator("input")
    @classmethod
    def _templates(cls, messages: list[JudgeInput]) -> list[JudgeInput]:
        for m in messages:
            check_template(m.text())
        return messages

    @field_validator("range")
    @classmethod
    def _range(cls, value: tuple[float, float] | None) -> tuple[float, float] | None:
        return None if value is None else check_score_range(value)


class MultiGrader(_Grader):
    type: Literal["multi"]
    graders: dict[str, dict[str, Any]] = Field(min_length=1, max_length=16)
    calculate_output: str = Field(min_length=1, max_length=1000)


_MODELS = {"string_check": StringCheckGrader, "text_similarity": TextSimilarityGrader, "python": PythonGrader,
           "score_model": ScoreModelGrader, "multi": MultiGrader}


def parse_grader(raw: Any, *, param: str, nested: bool = False) -> _Grader:
    """The validated grader; InvalidRequest / InvalidValue name the field (under ``param``) that is wrong."""
    if not isinstance(raw, dict):
        raise InvalidRequest(f"{param}: must be a grader object", param=param)
    kind = raw.get("type")
    allowed = SUPPORTED[:-1] if nested else SUPPORTED
    if kind not in allowed:
        why = "graders cannot be nested" if kind == "multi" else "it is not supported"
        raise InvalidRequest(f"{param}.type: grader type {kind!r} cannot be used here: {why} "
                             f"(supported: {', '.join(allowed)})", param=f"{param}.type", code="unsupported_grader")
    try:
        grader = _MODELS[kind].model_validate(raw)
    except ValidationError as e:
        raise invalid_value(e, raw, path=lambda p: f"{param}.{p}" if p else param) from None
    if isinstance(grader, MultiGrader):
        for key, sub in grader.graders.items():
            if not key.isidentifier() or len(key) > 40:
                raise InvalidRequest(f"{param}.graders: key {key!r} must be a name of letters, digits and _ "
                                     "(at most 40), so calculate_output can use it", param=f"{param}.graders")
            parse_grader(sub, param=f"{param}.graders.{key}", nested=True)
        try:
            compile_formula(grader.calculate_output, grader.graders)
        except FormulaError as e:
            raise InvalidRequest(f"{param}.calculate_output: {e}", param=f"{param}.calculate_output",
                                 code="invalid_formula") from None
    return grader


def _reward(grader: _Grader, param: str) -> dict:
    if isinstance(grader, StringCheckGrader):
        return {"type": "string_check", "input": grader.input, "reference": grader.reference,
                "operation": grader.operation}
    if isinstance(grader, TextSimilarityGrader):
        return {"type": "similarity", "metric": grader.evaluation_metric, "input": grader.input,
                "reference": grader.reference}
    if isinstance(grader, PythonGrader):
        return {"type": "python", "source": grader.source.rstrip("\n") + "\n" + GRADE_SHIM, "entry_point": GRADE_ENTRY}
    if isinstance(grader, ScoreModelGrader):
        reward = {"type": "score_model", "model": grader.model,
                  "input": [{"role": m.role, "content": m.text()} for m in grader.input]}
        if grader.range is not None:
            reward["range"] = list(grader.range)
        if grader.sampling_params is not None:
            reward["sampling_params"] = grader.sampling_params.model_dump(exclude_none=True)
        return reward
    assert isinstance(grader, MultiGrader)
    return {"type": "multi", "formula": grader.calculate_output,
            "rewards": {k: _reward(parse_grader(g, param=f"{param}.graders.{k}", nested=True), param)
                        for k, g in grader.graders.items()}}


def grader_reward(raw: Any, *, param: str) -> dict:
    """The reward spec (JSON) an OpenAI grader means; errors name the grader's fields under ``param``."""
    return _reward(parse_grader(raw, param=param), param)
