"""The project's documentation as the tests read it: README.md and docs/*.md, so a test of what the docs say
holds whichever of those files a section lives in (README links out to docs/ for the long sections)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def reference_docs() -> list[Path]:
    """Every file a user or contributor reads as reference: README, CONTRIBUTING, docs/ and the bench guide."""
    return [*doc_files(), ROOT / "CONTRIBUTING.md", ROOT / "bench" / "README.md"]


def docs_text() -> str:
    """Every documentation file's text, README first, each ending in a blank line."""
    return "".join(p.read_text().rstrip("\n") + "\n\n" for p in doc_files())


def section(title: str) -> str:
    """The body of the one `## title` section, up to the next `## ` heading or the end of its file."""
    found = []
    for path in doc_files():
        parts = re.split(rf"^## {re.escape(title)}\n", path.read_text(), flags=re.M)
        found += [part.split("\n## ", 1)[0] for part in parts[1:]]
    assert len(found) == 1, f"{len(found)} sections titled {title!r} in README.md and docs/"
    return found[0]
