"""Real HTTP servers on loopback for remote-reward tests: a scoring endpoint and an OpenAI-compatible judge."""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

from tests.loopback_http import QuietHandler, base_url, serving


@dataclass
class Recorded:
    requests: list[dict] = field(default_factory=list)  # {"path", "headers", "body"}
    fail_first: int = 0  # /flaky answers 503 this many times, then scores


class _Handler(QuietHandler):

    def do_POST(self):
        rec: Recorded = self.server.recorded
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        rec.requests.append({"path": self.path, "headers": dict(self.headers), "body": body})
        if self.path.endswith("/chat/completions"):
            return self._judge(body)
        samples = body["samples"]
        # A good score: the completion's length / 10, or the row's "weight" when it has one.
        scores = [s["row"].get("weight", len(s["completion"]) / 10) for s in samples]
        if self.path == "/slow":
            time.sleep(1.5)
        elif self.path == "/garbage":
            return self.answer(200, b"<html>not json</html>")
        elif self.path == "/wrong-count":
            scores = scores[:-1]
        elif self.path == "/mixed":
            scores = [None if i % 2 else "x" if i % 3 == 2 else 1.0 for i in range(len(samples))]
        elif self.path == "/flaky" and rec.fail_first > 0:
            rec.fail_first -= 1
            return self.answer(503, b'{"error": "busy"}')
        elif self.path == "/echo-auth":
            return self.answer(500, json.dumps({"auth": self.headers.get("Authorization")}).encode())
        self.answer(200, json.dumps({"scores": scores}).encode())

    def _judge(self, body: dict) -> None:
        user = body["messages"][-1]["content"]
        if "refuse" in user:
            message = {"role": "assistant", "content": None, "refusal": "I cannot grade this."}
        elif "prose" in user:
            message = {"role": "assistant", "content": "Reasonable answer. Score: 0.8"}
        elif "silent" in user:
            message = {"role": "assistant", "content": "No opinion."}
        elif "digits" in user:  # a judge made to write many digits (what a tenant could ask it to encode)
            message = {"role": "assistant", "content": json.dumps({"result": 0.123456789012345})}
        else:
            message = {"role": "assistant", "content": json.dumps({"result": len(user), "steps": []})}
        answer = {"choices": [{"index": 0, "message": message}], "model": body["model"],
                  "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}}
        self.answer(200, json.dumps(answer).encode())


@contextmanager
def reward_server():
    """Yields (base_url, Recorded)."""
    with serving(_Handler) as server:
        server.recorded = Recorded()
        yield base_url(server), server.recorded
