"""The regex reward: user patterns matched in a killable child, so backtracking cannot hang the trainer."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from service.schemas.rewards import RegexReward
from worker.rewards.engine import build_scorer
from tests.worker.rewards.fresh_scorer import score_in_a_fresh_process
from worker.rewards.errors import error_kind
from worker.rewards.regex import RegexBatchScorer

CATASTROPHIC = RegexReward(pattern=r"(a+)+$")  # exponential on "aaaa...ab"
HANGS = "a" * 40 + "b"


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")


def test_search_versus_full_match_through_the_engine():
    texts = ["answer: 12", "12", "no digits", "YES"]
    specs = [RegexReward(pattern=r"\d+"), RegexReward(pattern=r"\d+", full_match=True),
             RegexReward(pattern="(?i)yes")]
    results = []
    for spec in specs:
        scorer = build_scorer(spec)
        try:
            results.append(scorer.score(texts, [{}] * len(texts)).scores)
        finally:
            scorer.close()
    assert results == [[1.0, 1.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]]


def test_a_backtracking_pattern_times_out_that_sample_only():
    scorer = RegexBatchScorer(CATASTROPHIC, timeout_s=0.5)
    try:
        scorer.score(["warm"], [{}])  # the child is running: only the matching is timed below
        hung_child = scorer.child.pid
        started = time.monotonic()
        out = scorer.score(["aaa", HANGS, "xa", "b"], [{}] * 4)
        elapsed = time.monotonic() - started
        assert out.scores == [1.0, None, 1.0, 0.0]  # the texts after the hang were matched by a new child
        assert out.errors[1] == "regex: timed out after 0.5 s" and error_kind(out.errors[1]) == "timeout"
        assert 0.5 <= elapsed < 3
        deadline = time.monotonic() + 5
        while not _gone(hung_child) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _gone(hung_child)  # killed, not left spinning on a core
        assert scorer.score(["aa"], [{}]).scores == [1.0]  # and the scorer goes on
    finally:
        child = scorer.child
        scorer.close()
        scorer.close()  # idempotent
    assert child is None or _gone(child.pid)


def test_a_batch_of_hanging_samples_is_bounded_by_the_batch_budget():
    """What keeps a job cancellable: one step's regex scoring ends within about batch_budget_s."""
    scorer = RegexBatchScorer(CATASTROPHIC, timeout_s=0.3, batch_budget_s=1.0)
    try:
        started = time.monotonic()
        out = scorer.score([HANGS] * 50, [{}] * 50)
        elapsed = time.monotonic() - started
    finally:
        scorer.close()
    assert elapsed < 3, elapsed  # 50 x 0.3 s would be 15 s
    assert out.scores == [None] * 50
    assert all(error_kind(e) == "timeout" for e in out.errors)
    # Either way the budget ended it: mid-batch, or (on a loaded machine) before the child was even ready.
    assert out.errors[-1].startswith("regex: timed out") and "the batch's 1 s budget was spent" in out.errors[-1]


def test_the_trainer_process_never_runs_the_pattern():
    """Through the engine as the trainer builds it, in a separate process so that a hang fails, not blocks."""
    scores, errors = score_in_a_fresh_process(CATASTROPHIC, [HANGS, "aa"])
    assert scores == [None, 1.0] and error_kind(errors[0]) == "timeout"


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="positive"):
        RegexBatchScorer(CATASTROPHIC, timeout_s=0)
    scorer = RegexBatchScorer(CATASTROPHIC)
    with pytest.raises(ValueError, match="2 completions but 1 rows"):
        scorer.score(["a", "b"], [{}])
    assert scorer.score([], []).scores == []
    scorer.close()


def test_a_fresh_child_gives_the_first_sample_its_timeout_not_the_start_up_slack():
    """The per-sample limit holds for the first text of a new child too: its clock starts when the child is
    ready, so a backtracking first sample ends after timeout_s (was timeout_s + 5 s of start-up slack)."""
    scorer = RegexBatchScorer(CATASTROPHIC, timeout_s=1.0)
    try:
        started = time.monotonic()
        out = scorer.score([HANGS, "aa"], [{}] * 2)
        elapsed = time.monotonic() - started
    finally:
        scorer.close()
    assert out.errors[0] == "regex: timed out after 1 s" and out.scores[1] == 1.0
    assert 1.0 <= elapsed < 3.0, elapsed  # two child starts (~0.05 s each) + 1 s; the old deadline was 6 s


def test_a_slow_child_start_is_not_charged_to_the_sample(monkeypatch):
    """Start-up (here 1.5 s, past the 0.5 s per-sample limit) has its own allowance: the sample still scores."""
    import worker.rewards.regex as regex

    slow = "import time; time.sleep(1.5)\n" + regex.CHILD_SCRIPT.read_text()
    monkeypatch.setattr(regex, "CHILD_SCRIPT", type("Script", (), {"read_text": staticmethod(lambda: slow)}))
    scorer = RegexBatchScorer(RegexReward(pattern=r"\d"), timeout_s=0.5)
    try:
        assert scorer.score(["7", "x"], [{}] * 2).scores == [1.0, 0.0]
    finally:
        scorer.close()


def test_a_child_that_never_gets_ready_fails_the_batch_once_not_sample_by_sample(monkeypatch):
    import worker.rewards.regex as regex

    monkeypatch.setattr(regex, "START_SLACK_S", 0.5)
    monkeypatch.setattr(regex, "CHILD_SCRIPT", type("Script", (), {"read_text": staticmethod(
        lambda: "import time; time.sleep(30)")}))
    scorer = RegexBatchScorer(RegexReward(pattern=r"\d"), timeout_s=0.2)
    try:
        started = time.monotonic()
        out = scorer.score(["1", "2", "3"], [{}] * 3)
        elapsed = time.monotonic() - started
    finally:
        scorer.close()
    assert out.scores == [None] * 3 and elapsed < 2.0, elapsed
    assert out.errors == ["regex: timed out: the matching process did not start within 0.5 s"] * 3
    assert all(error_kind(e) == "timeout" for e in out.errors)
