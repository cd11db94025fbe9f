"""OpenAI's chat.completions and completions request bodies, validated; and what a serving worker is sent.

Fields OpenAI defines that this service does not implement (tools, logprobs,
penalties, ...) are refused by name rather than silently ignored: a client
that sets them expects their effect.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from service.errors import InvalidRequest, describe_validation
from service.schemas.json_text import json_problem

MAX_N = 8
MAX_STOP = 4
SEED_RANGE = (-(2**63), 2**63 - 1)  # a 64-bit seed, as OpenAI documents it and torch's generator takes
DEFAULT_CHAT_MAX_TOKENS = 256
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stream: bool = False
    stream_options: dict | None = None
    user: str | None = None
    # Accepted only at their neutral value, which is what OpenAI's clients send when they send them at all.
    presence_penalty: Literal[0, 0.0] = 0
    frequency_penalty: Literal[0, 0.0] = 0

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops

    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, v):
        if v is not None and (set(v) - {"include_usage"} or not isinstance(v.get("include_usage", False), bool)):
            raise ValueError("only {'include_usage': true|false} is supported")
        return v

    @model_validator(mode="after")
    def _options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return self


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(_Body):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    def budget(self) -> int:
        return self.max_completion_tokens or self.max_tokens or DEFAULT_CHAT_MAX_TOKENS


class CompletionRequest(_Body):
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=MAX_N)]
    echo: Literal[False] = False

    def budget(self) -> int:
        return self.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS

    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)


def parse(kind: type[_Body], body: object) -> _Body:
    """The body validated; InvalidRequest (400) naming the first bad field otherwise."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object", code="invalid_value")
    if found := json_problem(body):  # text a tokenizer cannot encode fails in the worker otherwise
        where, problem = found
        raise InvalidRequest(f"{where}: {problem}", param=where, code="invalid_value")
    try:
        return kind.model_validate(body)
    except ValidationError as e:
        message, param = describe_validation(e.errors(), body)
        raise InvalidRequest(message, param=param, code="invalid_value") from None


def sampling(request: _Body) -> dict:
    """The sampling part of a worker message; temperature 0 is greedy decoding."""
    asked = request.max_tokens is not None or getattr(request, "max_completion_tokens", None) is not None
    return {"max_tokens": request.budget(), "max_tokens_asked": asked,
            "temperature": request.temperature, "top_p": request.top_p,
            "n": request.n, "stop": request.stop or [], "seed": request.seed}


def prompts(request: _Body) -> list[dict]:
    """Each prompt the worker completes: a chat conversation, or a text prompt as is."""
    if isinstance(request, ChatRequest):
        return [{"messages": [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                              for m in request.messages]}]
    return [{"text": p} for p in request.prompts()]
