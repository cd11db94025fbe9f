"""A serving worker's messages in OpenAI's shapes: chat.completion, text_completion, and their stream chunks."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterable, Iterator

CHAT, TEXT = "chat.completion", "text_completion"


class Reply:
    def __init__(self, kind: str, model: str):
        self.kind, self.model = kind, model
        self.id = ("chatcmpl-" if kind == CHAT else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.prompt_tokens = self.completion_tokens = 0

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices,
                "system_fingerprint": None}

    def whole(self, messages: Iterable[dict]) -> dict:
        texts: dict[int, list[str]] = {}
        reasons: dict[int, str] = {}
        for m in messages:
            self._count(m)
            if m["type"] == "delta":
                texts.setdefault(m["index"], []).append(m["text"])
            elif m["type"] == "finish":
                reasons[m["index"]] = m["reason"]
        choices = [self._choice(i, "".join(texts.get(i, [])), reasons[i]) for i in sorted(reasons)]
        return {**self._envelope(self.kind, choices), "usage": self.usage()}

    def _choice(self, index: int, text: str, reason: str) -> dict:
        if self.kind == CHAT:
            return {"index": index, "message": {"role": "assistant", "content": text, "refusal": None},
                    "finish_reason": reason, "logprobs": None}
        return {"index": index, "text": text, "finish_reason": reason, "logprobs": None}

    def _count(self, m: dict) -> None:
        if m["type"] == "start":
            self.prompt_tokens = m["prompt_tokens"]
        elif m["type"] == "finish":
            self.completion_tokens += m["tokens"]

    def chunks(self, messages: Iterable[dict], *, include_usage: bool) -> Iterator[dict]:
        """Stream chunks: per chat choice a first delta with the role, then text deltas, then its finish_reason."""
        obj = "chat.completion.chunk" if self.kind == CHAT else TEXT
        for m in messages:
            self._count(m)
            if m["type"] == "start" and self.kind == CHAT:
                for i in range(m["choices"]):
                    yield self._chunk(obj, i, {"role": "assistant", "content": ""}, None)
            elif m["type"] == "delta":
                yield self._chunk(obj, m["index"], {"content": m["text"]}, None)
            elif m["type"] == "finish":
                yield self._chunk(obj, m["index"], {}, m["reason"])
        if include_usage:
            yield {**self._envelope(obj, []), "usage": self.usage()}

    def _chunk(self, obj: str, index: int, delta: dict, reason: str | None) -> dict:
        if self.kind == CHAT:
            choice = {"index": index, "delta": delta, "finish_reason": reason, "logprobs": None}
        else:
            choice = {"index": index, "text": delta.get("content", ""), "finish_reason": reason, "logprobs": None}
        return self._envelope(obj, [choice])


def sse(payload: dict) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


DONE = b"data: [DONE]\n\n"
