"""The reference docs (README, CONTRIBUTING, docs/, bench/README.md) read as reference: no line a reader must
scroll sideways through (over 1,000 characters), and no wording from the history of the work (which session or
round of work a figure came from, which issue asked for it): that history lives in git."""

from __future__ import annotations

import re
from pathlib import Path

from tests.project_docs import ROOT, reference_docs

MAX_LINE = 1000
HISTORY = re.compile(
    r"\bissues?\b"                                                   # "issue 24", "the target"
    r"|\bsessions? \d+"                                               # "session 14"
    r"|\b(?:this|that|last|next|previous|earlier|later) (?:session|round)s?\b"
    r"|\brounds? (?:\d+|of work)\b"
    r"|\bhelper \d+",
    re.I,
)


def style_problems(path: Path) -> list[str]:
    problems = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if len(line) > MAX_LINE:
            problems.append(f"line {n}: {len(line)} characters (at most {MAX_LINE})")
        for m in HISTORY.finditer(line):
            problems.append(f"line {n}: history wording {m.group(0)!r}")
    return problems


def test_the_reference_docs_have_short_lines_and_no_history_wording():
    missing = [p for p in reference_docs() if not p.exists()]
    assert not missing, missing
    found = {str(p.relative_to(ROOT)): b for p in reference_docs() if (b := style_problems(p))}
    assert not found, found


def test_a_long_line_or_history_wording_is_caught(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("\n".join([
        "x" * 1000, "y" * 1001, "as issue 24 asked", "the Issue's target", "measured in session 14",
        "at the start of this round", "round 2 of work", "rounds of work", "helper 7 wrote",
        # technical uses of the same words stay allowed
        "read-only sessions for GETs, a pytest session, float32 rounding, a round trip, a round-trip copy",
    ]))
    assert [p.split(":")[0] for p in style_problems(doc)] == [
        "line 2", "line 3", "line 4", "line 5", "line 6", "line 7", "line 8", "line 9"]
