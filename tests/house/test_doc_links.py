"""Every relative link in README.md, CONTRIBUTING.md, docs/ and bench/README.md reaches something: the file exists and an `#anchor` names a
heading of it (GitHub's anchors), so moving a section between those files cannot leave a reader at a dead end."""

from __future__ import annotations

import re
from pathlib import Path

from tests.project_docs import ROOT, reference_docs

LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?")
FENCE = re.compile(r"^ {0,3}(```|~~~)")


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            out.append(line)
    return out


def anchors(path: Path) -> set[str]:
    """GitHub's anchor for each heading: lower-cased, punctuation but - and _ dropped, spaces to hyphens, a
    repeated one suffixed -1, -2."""
    seen: dict[str, int] = {}
    for line in prose_lines(path.read_text()):
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = re.sub(r"[^\w\- ]", "", re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1)).lower()).replace(" ", "-")
            seen[base] = seen.get(base, -1) + 1
    return {base if n == 0 else f"{base}-{k}" for base, n in seen.items() for k in range(n + 1)}


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def broken_links(path: Path) -> list[str]:
    broken = []
    for line in prose_lines(path.read_text()):
        for target in LINK.findall(line):
            if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("/"):
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                broken.append(f"{target}: no {shown(dest)}")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{target}: no heading #{anchor} in {shown(dest)}")
    return broken


def test_every_relative_link_in_the_docs_reaches_a_file_and_heading():
    broken = {shown(p): b for p in reference_docs() if (b := broken_links(p))}
    assert not broken, broken


def test_a_link_to_a_missing_heading_or_file_is_caught(tmp_path):
    (tmp_path / "other.md").write_text("# Other\n\n## Several jobs on one base (`CISPO_WORKER_JOBS`)\n")
    doc = tmp_path / "doc.md"
    doc.write_text("## Your data, dry runs\n\n[a](#your-data-dry-runs) [b](other.md#several-jobs-on-one-base-cispo_worker_jobs)"
                   " [c](#environments) [d](gone.md) [e](https://example.com/x)\n```\n[f](#in-code)\n```\n")
    assert [b.split(":")[0] for b in broken_links(doc)] == ["#environments", "gone.md"]
