"""Text deltas for a streamed reply that never cut a stop sequence or a character in two (the tokens come from
worker/serving/decode_batch.py, one step of every running request at a time)."""

from __future__ import annotations


class TextDeltas:
    """Turns token ids into the text to send next: held back while it may still grow into a stop sequence,
    or ends in half a multi-byte character; cut before the first stop sequence, which is never sent."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer, self.stops = tokenizer, stops
        self.ids: list[int] = []
        self.sent = 0  # characters of the decoded text already sent
        self.stopped = False

    def add(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = min((i for i in (text.find(s, max(0, self.sent - len(s))) for s in self.stops) if i >= 0),
                  default=-1)
        if cut >= 0:
            self.stopped = True
            return self._release(text, cut)
        ready = len(text.rstrip("\ufffd"))  # a character still arriving byte by byte
        for s in self.stops:  # a tail that could be the start of a stop sequence waits for the next token
            for k in range(min(len(s) - 1, ready), 0, -1):
                if text[:ready].endswith(s[:k]):
                    ready = min(ready, len(text[:ready]) - k)
                    break
        return self._release(text, ready)

    def flush(self) -> str:
        """What is left once decoding ended without a stop sequence."""
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        return self._release(text, len(text))

    def _release(self, text: str, upto: int) -> str:
        out = text[self.sent:upto] if upto > self.sent else ""
        self.sent = max(self.sent, upto)
        return out
