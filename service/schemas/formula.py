"""A tiny, safe arithmetic language for combining sub-rewards (OpenAI's multi grader ``calculate_output``).

Never ``eval``: the formula is parsed with Python's ``ast`` and every node is
checked against a whitelist, then evaluated by walking the tree. Allowed:

- numbers, and names of the sub-rewards (nothing else: no builtins, no attributes);
- ``+ - * /`` and ``^`` (power, as OpenAI writes it; ``**`` also works), unary ``-``/``+``,
  parentheses; usual precedence, power binds tightest and is right-associative;
- calls of ``min max abs floor ceil exp sqrt log`` by name, positional arguments only
  (``log`` is the natural log).

Everything evaluates in floating point, so ``9^9^9`` overflows at once
instead of computing a huge integer. A result that is not finite, a division
by zero or ``log(0)`` is an error for that sample, not for the job.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from collections.abc import Callable, Mapping

MAX_FORMULA_CHARS = 1000
MAX_DEPTH = 50

_BINARY: dict[type, Callable[[float, float], float]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[float], float]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}
# name -> (function, min args, max args or None)
FUNCTIONS: dict[str, tuple[Callable[..., float], int, int | None]] = {
    "min": (lambda *a: min(a), 1, None),
    "max": (lambda *a: max(a), 1, None),
    "abs": (abs, 1, 1),
    "floor": (lambda x: float(math.floor(x)), 1, 1),
    "ceil": (lambda x: float(math.ceil(x)), 1, 1),
    "exp": (math.exp, 1, 1),
    "sqrt": (math.sqrt, 1, 1),
    "log": (math.log, 1, 1),
}
_NAME = re.compile(r"^[A-Za-z_]\w*$")


class FormulaError(ValueError):
    """The formula is not in the language; the message names the offending part."""


class Formula:
    """A checked formula over a fixed set of variable names."""

    def __init__(self, text: str, names: frozenset[str]):
        self.text, self.names = text, names
        if len(text) > MAX_FORMULA_CHARS:
            raise FormulaError(f"formula is {len(text)} characters, more than {MAX_FORMULA_CHARS}")
        try:
            tree = ast.parse(text.replace("^", "**"), mode="eval")
        except SyntaxError as e:
            raise FormulaError(f"formula does not parse at column {e.offset}: {e.msg}") from None
        except (ValueError, RecursionError, MemoryError) as e:
            raise FormulaError(f"formula does not parse: {e}") from None
        self.variables: set[str] = set()
        self._tree = tree.body
        self._check(self._tree, 0)

    def _check(self, node: ast.AST, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise FormulaError(f"formula nests deeper than {MAX_DEPTH}")
        if isinstance(node, ast.Constant):
            if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
                raise FormulaError(f"constant {node.value!r} is not a number")
        elif isinstance(node, ast.Name):
            if node.id not in self.names:
                known = ", ".join(sorted(self.names)) or "none"
                hint = " (a function must be called)" if node.id in FUNCTIONS else ""
                raise FormulaError(f"name {node.id!r} is not a sub-reward{hint} (known: {known})")
            self.variables.add(node.id)
        elif isinstance(node, ast.BinOp):
            if type(node.op) not in _BINARY:
                raise FormulaError(f"operator {type(node.op).__name__} is not allowed (allowed: + - * / ^)")
            self._check(node.left, depth + 1)
            self._check(node.right, depth + 1)
        elif isinstance(node, ast.UnaryOp):
            if type(node.op) not in _UNARY:
                raise FormulaError(f"operator {type(node.op).__name__} is not allowed (allowed: + - * / ^)")
            self._check(node.operand, depth + 1)
        elif isinstance(node, ast.Call):
            self._check_call(node, depth)
        elif isinstance(node, ast.Attribute):
            raise FormulaError(f"attribute access ('.{node.attr}') is not allowed")
        else:
            raise FormulaError(f"{type(node).__name__} is not allowed in a formula "
                               "(numbers, sub-reward names, + - * / ^ and function calls only)")

    def _check_call(self, node: ast.Call, depth: int) -> None:
        if not isinstance(node.func, ast.Name):
            raise FormulaError("calls must name a function directly (allowed: " + " ".join(FUNCTIONS) + ")")
        name = node.func.id
        if name not in FUNCTIONS:
            raise FormulaError(f"function {name!r} is not allowed (allowed: {' '.join(FUNCTIONS)})")
        if node.keywords or any(isinstance(a, ast.Starred) for a in node.args):
            raise FormulaError(f"{name}() takes positional arguments only")
        _, low, high = FUNCTIONS[name]
        if len(node.args) < low or (high is not None and len(node.args) > high):
            wanted = f"{low}" if high == low else f"at least {low}"
            raise FormulaError(f"{name}() takes {wanted} argument(s), got {len(node.args)}")
        for arg in node.args:
            self._check(arg, depth + 1)

    def evaluate(self, values: Mapping[str, float]) -> float:
        """The formula's value; raises ArithmeticError/ValueError (the sample's error) when undefined."""
        result = self._eval(self._tree, values)
        if isinstance(result, complex) or not math.isfinite(result):
            raise ValueError(f"formula gave {result}")
        return result

    def _eval(self, node: ast.AST, values: Mapping[str, float]) -> float:
        if isinstance(node, ast.Constant):
            return float(node.value)
        if isinstance(node, ast.Name):
            return float(values[node.id])
        if isinstance(node, ast.BinOp):
            return _BINARY[type(node.op)](self._eval(node.left, values), self._eval(node.right, values))
        if isinstance(node, ast.UnaryOp):
            return _UNARY[type(node.op)](self._eval(node.operand, values))
        fn = FUNCTIONS[node.func.id][0]  # ast.Call, checked
        return fn(*(self._eval(a, values) for a in node.args))


def compile_formula(text: str, names) -> Formula:
    bad = [n for n in names if not _NAME.match(n)]
    if bad:
        raise FormulaError(f"sub-reward name {bad[0]!r} cannot be used in a formula (letters, digits, _)")
    return Formula(text, frozenset(names))
