"""No module reaches into another for a private (underscored) name: what several modules share is public API of the
module that defines it, named as such, so a change to it is seen as a change to an interface. Read with ast over
service/, worker/ and bench/: `from our.module import _name` and `our_module._name` where `our_module` is one of
ours imported as a module."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OURS = ("service", "worker")


def _is_module(dotted: str) -> bool:
    path = REPO.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def private_reaches(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found, modules = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in OURS:
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{node.lineno}: from {node.module} import {alias.name}")
                elif _is_module(f"{node.module}.{alias.name}"):
                    modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            modules |= {a.asname for a in node.names if a.asname and a.name.split(".")[0] in OURS}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            found.append(f"{node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_no_module_imports_another_modules_private_names():
    found = {str(p.relative_to(REPO)): r for root in ("service", "worker", "bench") for p in sorted((REPO / root).rglob("*.py"))
             if (r := private_reaches(p))}
    assert not found, found


def test_the_check_sees_both_forms(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("from worker.jobs import job_runner\nfrom worker.jobs.job_runner import _claim, run_failure\n"
                   "from service.jobs import dataset_file\nimport worker.checkpoints.checkpoint as ckpt\n"
                   "job_runner._failure(1)\nckpt._sha256(2)\njob_runner.claim_run(3)\nself._x\n")
    assert [r.split(":")[0] for r in private_reaches(src)] == ["2", "5", "6"]
