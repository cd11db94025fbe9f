"""The regex reward: a user's pattern, matched in a killable child process against deadlines.

Python's ``re`` backtracks: ``(a+)+$`` on a long run of "a"s followed by "b"
takes exponential time, holds the GIL, and cannot be interrupted in the
trainer process, so a cancelled job would never notice. The pattern therefore
runs in a child (worker/rewards/_regex_child.py, standard library only), which
says when it is ready (started, request read, pattern compiled) and then
answers text by text. The parent gives each text ``timeout_s`` from the
child's "ready" on (start-up has its own START_SLACK_S, and a child that
misses it fails the rest of the batch, not one sample); on a miss it
kills the child, records ``regex: timed out after S s`` for that sample (kind
"timeout"), and goes on with the rest of the batch in a new child. The whole
batch also has ``batch_budget_s``: once it is spent, the samples not yet
matched are recorded as timed out without running, so one step's scoring,
and with it a cancel, is never held up longer than about that budget.

1.0 when the pattern matches anywhere (re.search), or the whole completion
when ``full_match``; 0.0 otherwise.

ChildBatchScorer is that mechanism without the regex: the json_schema reward
(worker/rewards/json_checks.py) validates in the same child under the same
deadlines, since a schema's ``pattern`` and ``patternProperties`` are user
regexes too.

Not the `regex` module's per-call timeout instead: measured (load 25 on 2 cores), it counts CPU seconds, so
``(x+x+)+y`` with timeout=1 ended after 4-6 s of wall clock, it bounds no memory (the child has RLIMIT_AS),
and jsonschema's patterns go through ``re`` anyway; the child's wall-clock kill holds all three.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import time
from pathlib import Path

from service.schemas.rewards import RegexReward
from worker.rewards.outcome import Outcome

CHILD_SCRIPT = Path(__file__).with_name("_regex_child.py")
TIMEOUT_S = 1.0  # per sample: a sane pattern takes microseconds on a completion
BATCH_BUDGET_S = 10.0
START_SLACK_S = 5.0  # a child's start-up and request set-up, before (not on top of) its first text's timeout


class ChildBatchScorer:
    """Scores batches in the matching child, text by text against deadlines; owns (and restarts) it until close().

    A subclass names its reward (`label`, the prefix of its errors) and says
    what the child is asked for a slice of texts (`request`, see _regex_child.py).
    """

    label = "regex"

    def __init__(self, *, timeout_s: float = TIMEOUT_S, batch_budget_s: float = BATCH_BUDGET_S):
        if not (timeout_s > 0 and batch_budget_s > 0):
            raise ValueError("timeouts must be positive")
        self.timeout_s, self.batch_budget_s = timeout_s, batch_budget_s
        self.child: subprocess.Popen | None = None
        self._pending = b""

    def texts(self, completions: list[str]) -> list[str]:
        """What the child matches, one per completion."""
        return completions

    def request(self, texts: list[str]) -> dict:
        raise NotImplementedError

    def score(self, completions: list[str], rows: list[dict]) -> Outcome:
        if len(completions) != len(rows):
            raise ValueError(f"{len(completions)} completions but {len(rows)} rows")
        texts = self.texts(completions)
        out = Outcome.empty(len(texts))
        budget_end = time.monotonic() + self.batch_budget_s
        start = 0
        while start < len(texts):
            start = self._match_from(texts, start, out, budget_end)
        return out

    def close(self) -> None:
        """Kill the child, if one runs. Idempotent; the next score() starts a new one."""
        child, self.child, self._pending = self.child, None, b""
        if child is not None:
            child.kill()
            child.wait()
            for f in (child.stdin, child.stdout):
                f.close()

    # -- internals --------------------------------------------------------------

    def _match_from(self, texts: list[str], start: int, out: Outcome, budget_end: float) -> int:
        """Match texts[start:] in the child; returns where the next attempt starts (len(texts) when done)."""
        if time.monotonic() >= budget_end:
            for i in range(start, len(texts)):
                out.errors[i] = f"{self.label}: timed out (the batch's {self.batch_budget_s:g} s budget was spent)"
            return len(texts)
        child = self._ensure_started()
        payload = memoryview(json.dumps(self.request(texts[start:])).encode() + b"\n")
        i = start
        with selectors.DefaultSelector() as sel:
            sel.register(child.stdout, selectors.EVENT_READ)
            sel.register(child.stdin, selectors.EVENT_WRITE)
            ready = False  # until the child's "+": no sample's clock runs
            deadline = min(time.monotonic() + START_SLACK_S, budget_end)
            while i < len(texts):
                remaining = deadline - time.monotonic()
                events = sel.select(remaining) if remaining > 0 else []
                if not events and not ready:
                    return self._not_ready(texts, i, out, budget_end)
                if not events:  # texts[i] missed its deadline (or the batch budget ran out)
                    self.close()
                    why = f"after {self.timeout_s:g} s" if deadline < budget_end else \
                        f"(the batch's {self.batch_budget_s:g} s budget was spent)"
                    out.errors[i] = f"{self.label}: timed out {why}"
                    return i + 1
                for key, _ in events:
                    if key.fileobj is child.stdin:
                        try:
                            payload = payload[os.write(child.stdin.fileno(), payload[:65536]):]
                        except BlockingIOError:
                            continue
                        except BrokenPipeError:
                            return self._crashed(texts, i, out)
                        if not payload:
                            sel.unregister(child.stdin)
                        continue
                    try:
                        chunk = os.read(child.stdout.fileno(), 65536)
                    except BlockingIOError:
                        continue
                    if not chunk:
                        return self._crashed(texts, i, out)
                    *answers, self._pending = (self._pending + chunk).split(b"\n")
                    for answer in answers:
                        if answer == b"+":
                            ready = True
                        elif answer.startswith(b"!"):  # this text raised in the child: the sample's error
                            out.errors[i] = f"{self.label}: {answer[1:].decode(errors='replace')}"
                        else:
                            out.scores[i] = 1.0 if answer == b"1" else 0.0
                        i += answer != b"+"
                    if ready:
                        deadline = min(time.monotonic() + self.timeout_s, budget_end)  # the next text's clock
        return i

    def _not_ready(self, texts: list[str], i: int, out: Outcome, budget_end: float) -> int:
        """The child did not get ready in time: no sample ran, so none is to blame; the rest of the batch fails
        (another start would only spend the batch's budget again)."""
        self.close()
        why = f"did not start within {START_SLACK_S:g} s" if time.monotonic() < budget_end else \
            f"did not start before the batch's {self.batch_budget_s:g} s budget was spent"
        for j in range(i, len(texts)):
            out.errors[j] = f"{self.label}: timed out: the matching process {why}"
        return len(texts)

    def _crashed(self, texts: list[str], i: int, out: Outcome) -> int:
        """The child died at texts[i] (out of memory, most likely): that sample fails, the rest go on."""
        self.close()
        out.errors[i] = f"{self.label}: the matching process died (out of memory?)"
        return i + 1

    def _ensure_started(self) -> subprocess.Popen:
        if self.child is None:
            self.child = subprocess.Popen(
                [sys.executable, "-I", "-S", "-B", "-c", CHILD_SCRIPT.read_text()], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd="/", env={"LANG": "C.UTF-8"},
                start_new_session=True)  # not in the worker's process group: its signals are not ours
            os.set_blocking(self.child.stdin.fileno(), False)
            os.set_blocking(self.child.stdout.fileno(), False)
        return self.child


class RegexBatchScorer(ChildBatchScorer):
    """Scores batches with one RegexReward."""

    def __init__(self, spec: RegexReward, *, timeout_s: float = TIMEOUT_S, batch_budget_s: float = BATCH_BUDGET_S):
        super().__init__(timeout_s=timeout_s, batch_budget_s=batch_budget_s)
        self.spec = spec

    def request(self, texts: list[str]) -> dict:
        return {"pattern": self.spec.pattern, "full_match": self.spec.full_match, "texts": texts}
