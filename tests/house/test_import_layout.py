"""The package layout holds: every module imports, service never imports worker, no circle among service's
packages nor among worker's, and worker's pure math (cispo/, evals/) imports nothing else from worker.

A "package" here is a folder under service/ or worker/ (service.api, worker.trainer, ...) or a module
directly in one (service.jobs, worker.scratch); an arrow is any import in a module's source, at the top or
inside a function, read with ast, so a lazy import cannot hide a circle (imports under `if TYPE_CHECKING:`
are annotations only). docs/ARCHITECTURE.md draws the layers these tests hold.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("service", "worker")


def _modules(root: str) -> dict[str, Path]:
    found = {}
    for path in sorted((REPO / root).rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _runtime_nodes(tree: ast.AST):
    """Every node but those under `if TYPE_CHECKING:` (annotations only: never imported at run time)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _imports(module: str, path: Path) -> set[str]:
    """Every module name `module` imports, relative imports resolved."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import submodule`
    return names


def _package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle in the graph, as a path that starts and ends at the same node, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt]
            if nxt not in state and (found := visit(nxt, path + [nxt])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def _package_arrows(root: str) -> dict[str, dict[str, set[str]]]:
    """package -> package it imports -> the module imports that make that arrow (the root package itself,
    an empty `worker/__init__.py`, is no node: `from worker import scratch` is an arrow to worker.scratch)."""
    modules = _modules(root)
    arrows: dict[str, dict[str, set[str]]] = {}
    for module, path in modules.items():
        if module == root:
            continue
        source = arrows.setdefault(_package(module), {})
        for name in _imports(module, path):
            if name in modules and name != root and _package(name) != _package(module):
                source.setdefault(_package(name), set()).add(f"{module} -> {name}")
    return arrows


def _graph(root: str) -> dict[str, set[str]]:
    return {package: set(targets) for package, targets in _package_arrows(root).items()}


def _service_graph() -> dict[str, set[str]]:
    return _graph("service")


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every circle in the graph, each once: a path from its smallest node back to it."""
    found = []

    def walk(start: str, node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt == start:
                found.append(path + [start])
            elif nxt > start and nxt not in path:
                walk(start, nxt, path + [nxt])

    for start in sorted(graph):
        walk(start, start, [start])
    return found


def _explain(circles: list[list[str]], arrows: dict[str, dict[str, set[str]]]) -> str:
    lines = []
    for circle in circles:
        lines.append(" -> ".join(circle))
        lines.extend(f"    {imp}" for a, b in zip(circle, circle[1:]) for imp in sorted(arrows[a][b]))
    return "\n".join(lines)


def test_service_never_imports_worker():
    offenders = sorted(f"{module} imports {name}" for module, path in _modules("service").items()
                       for name in _imports(module, path) if name == "worker" or name.startswith("worker."))
    assert offenders == []


def test_no_circle_among_service_packages():
    assert _cycle(_service_graph()) is None


def test_no_circle_among_worker_packages():
    """The layers of docs/ARCHITECTURE.md: cispo, evals, distributed, checkpoints <- model <- rollout <- trainer
    <- torchrun <- jobs <- multi <- celery_app <- cli; a failure prints every circle and the imports
    making it."""
    arrows = _package_arrows("worker")
    circles = _circles(_graph("worker"))
    assert circles == [], "circles among worker's packages:\n" + _explain(circles, arrows)


def test_worker_pure_math_imports_nothing_else_from_worker():
    """cispo/ (the loss, advantages, log-probs) and evals/ (intervals) are pure functions at the bottom."""
    arrows = _package_arrows("worker")
    for package in ("worker.cispo", "worker.evals"):
        assert arrows[package] == {}, f"{package} imports " + "; ".join(
            sorted(imp for imps in arrows[package].values() for imp in imps))


def test_no_circle_among_service_modules():
    modules = _modules("service")
    graph = {module: {name for name in _imports(module, path) if name in modules and name != module}
             for module, path in modules.items()}
    assert _cycle(graph) is None


def test_the_check_finds_a_circle():
    assert _cycle({"service.a": {"service.b"}, "service.b": {"service.c"}, "service.c": {"service.a"}}) == [
        "service.a", "service.b", "service.c", "service.a"]
    assert _cycle({"service.a": {"service.b"}, "service.b": set()}) is None
    two_circles = {"a": {"b", "c"}, "b": {"a"}, "c": {"b"}}
    assert _circles(two_circles) == [["a", "b", "a"], ["a", "c", "b", "a"]]
    assert _circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_every_module_imports():
    failures = {}
    for root in ROOTS:
        for module in _modules(root):
            try:
                importlib.import_module(module)
            except Exception as e:  # noqa: BLE001 - the test reports every failure at once
                failures[module] = f"{type(e).__name__}: {e}"
    assert failures == {}
