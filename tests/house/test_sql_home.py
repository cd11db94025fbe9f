"""All SQL lives in service/repositories/ (and the engine's own glue in service/db/): every other module asks a
repository function. A module that builds a query (imports sqlalchemy's select, insert, update, delete, text or
func) anywhere else fails this test: move its query into a repository function."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BUILDERS = {"select", "insert", "update", "delete", "text", "func"}
HOMES = ("service/repositories/", "service/db/")


def builds_sql(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "sqlalchemy":
            if {a.name for a in node.names} & BUILDERS:
                return True
    return False


def test_only_the_repositories_build_sql():
    found = {str(p.relative_to(REPO)) for root in ("service", "worker") for p in (REPO / root).rglob("*.py")
             if not str(p.relative_to(REPO)).startswith(HOMES) and builds_sql(p)}
    assert found == set(), "SQL outside service/repositories/: move it into a repository function"


def test_the_check_sees_a_query_builder(tmp_path):
    (tmp_path / "a.py").write_text("from sqlalchemy import select\n")
    (tmp_path / "b.py").write_text("def f():\n    from sqlalchemy import func, or_\n")
    (tmp_path / "c.py").write_text("from sqlalchemy.orm import Session\nfrom sqlalchemy import or_\n")
    assert [builds_sql(tmp_path / n) for n in ("a.py", "b.py", "c.py")] == [True, True, False]
