"""Requests in, reply messages out, over one resident base's running decode batch (decode_batch.py).

A request is admitted between decode steps: its prompts are checked
against the model's length (prompt_limits.py: a 400, then "end"), its
adapter loaded, "start" sent, and its choices (n per prompt) become rows
that wait until the batch has room (`max_rows`), then join it. Each step
(`step`) picks every row's token, looks once at the cancel marks of every
running request (one call for all of them: `looks`), sends each row's text
delta (stream.py's TextDeltas: never a piece of a stop sequence or half a
character), and drops at once the rows that ended (EOS, max tokens, a stop
sequence) and every row of a request whose caller is gone, before the next
forward. A request's "finish" is sent per choice, "end" once all are.
Seeds: choice i of a request seeded s draws from seed s + i, as before.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from worker.serving.prompt_limits import Refused, encode
from worker.serving.decode_batch import DecodeBatch, Row
from worker.serving.engine import ResidentModel
from worker.serving.stream import TextDeltas

log = logging.getLogger(__name__)

MAX_ROWS = 64  # rows decoded together at most; more wait (a request's choices join together, or not at all)


@dataclass(eq=False)
class InFlight:
    """One request being answered."""

    name: str  # for the log: its reply list
    send: Callable[..., None]
    cancel_key: str | None
    rows: list[Row]
    deltas: dict[int, TextDeltas]
    eos_id: int
    unfinished: int = 0
    decoded: int = 0  # tokens decoded for it so far (all choices)
    cancelled: bool = False
    failed: bool = False
    done: bool = False


class Scheduler:
    def __init__(self, resident: ResidentModel, *, looks: Callable[[list[str]], list[bool]] | None = None,
                 said: Callable[[], None] = lambda: None, max_rows: int = MAX_ROWS):
        """`looks`: whether each cancel key is set, all in one call; `said`: called once a step's messages are all
        sent (to `send`), before its forward (a sender that buffers sends them then)."""
        self.resident, self.max_rows, self.said = resident, max_rows, said
        self.looks = looks or (lambda keys: [False] * len(keys))
        self.batch = DecodeBatch(resident.model, resident.router, pad_id=resident.pad_id, device=resident.device)
        self.waiting: deque[InFlight] = deque()  # started, rows not yet in the batch
        self.running: list[InFlight] = []

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def waiting_rows(self) -> int:
        return sum(len(f.rows) for f in self.waiting)

    def add(self, request: dict, send: Callable[..., None], *, cancel_key: str | None = None,
            name: str = "") -> InFlight | None:
        """Admit a request (None: refused, its error and "end" sent). Raises what loading its adapter raised."""
        sampling, resident = request["sampling"], self.resident
        try:
            encoded, max_new = encode(resident, request["prompts"], sampling["max_tokens"],
                                      asked=sampling["max_tokens_asked"])
        except Refused as e:
            send(type="error", status=400, message=str(e), param=e.param, code="context_length_exceeded")
            send(type="end")
            return None
        in_use = {r.adapter for r in self.batch.rows} | {r.adapter for f in self.waiting for r in f.rows}
        adapter = resident.adapter(request["target"]["checkpoint"], in_use)
        n, tok = sampling["n"], resident.tokenizer
        send(type="start", prompt_tokens=sum(map(len, encoded)), choices=len(encoded) * n)
        seed = sampling["seed"]
        rows = [Row(adapter, ids, max_new, sampling["temperature"], sampling["top_p"],
                    None if seed is None else seed + p * n + j, index=p * n + j)
                for p, ids in enumerate(encoded) for j in range(n)]
        flight = InFlight(name, send, cancel_key, rows, {r.index: TextDeltas(tok, sampling["stop"]) for r in rows},
                          tok.eos_token_id, unfinished=len(rows))
        for row in rows:
            row.owner = flight
        self.waiting.append(flight)
        return flight

    def step(self) -> list[InFlight]:
        """Admit what fits, decode one token of every row; the requests that ended this step (done, cancelled or
        failed)."""
        self._join()
        if not self.batch.rows:
            return []
        tokens = self.batch.pick()
        keyed = [f for f in self.running if f.cancel_key is not None]
        if keyed:
            for flight, gone in zip(keyed, self.looks([f.cancel_key for f in keyed]), strict=True):
                flight.cancelled = gone
        leaving = set()
        for row, token in zip(self.batch.rows, tokens):
            flight = row.owner
            if flight.cancelled or flight.failed:
                leaving.add(row)
            elif token < 0:
                flight.failed = True
                leaving.add(row)
                flight.send(type="error", status=500, code="serving_error", message=(
                    "the serving worker failed: NonFiniteLogits: the model gave NaN or inf logits"))
            elif self._took(flight, row, token):
                leaving.add(row)
        self.said()
        ended = [f for f in self.running if f.cancelled or f.failed or f.done]
        for flight in ended:
            leaving.update(flight.rows)
        self.batch.drop(leaving)
        self.running = [f for f in self.running if f not in ended]
        self.batch.advance([row.tokens[-1] for row in self.batch.rows])
        return ended

    def fail_all(self, message: str) -> list[InFlight]:
        """Every admitted request fails with `message` (the batch's forward itself raised): nothing is left."""
        failed = [*self.running, *self.waiting]
        for flight in failed:
            flight.failed = True
            flight.send(type="error", status=500, message=message, code="serving_error")
        self.batch.drop(set(self.batch.rows))
        self.running, self.waiting = [], deque()
        return failed

    def _join(self) -> None:
        joining: list[InFlight] = []
        room = self.max_rows - len(self.batch)
        while self.waiting and (len(self.waiting[0].rows) <= room or not (self.batch.rows or joining)):
            flight = self.waiting.popleft()
            room -= len(flight.rows)
            joining.append(flight)
        if joining:
            self.batch.join([row for flight in joining for row in flight.rows])
            self.running.extend(joining)

    def _took(self, flight: InFlight, row: Row, token: int) -> bool:
        """Send what `token` adds to the row's choice; whether the choice ended with it."""
        flight.decoded += 1
        deltas, reason = flight.deltas[row.index], None
        if token == flight.eos_id:
            reason = "stop"
        else:
            if text := deltas.add(token):
                flight.send(type="delta", index=row.index, text=text)
            if deltas.stopped:
                reason = "stop"
            elif len(row.tokens) >= row.max_new:
                reason = "length"
        if reason is None:
            return False
        if not deltas.stopped and (rest := deltas.flush()):
            flight.send(type="delta", index=row.index, text=rest)
        flight.send(type="finish", index=row.index, reason=reason, tokens=len(row.tokens))
        flight.unfinished -= 1
        if flight.unfinished == 0:
            flight.done = True
            flight.send(type="end")
        return True
