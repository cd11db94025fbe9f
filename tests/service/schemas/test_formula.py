"""The multi grader's formula language: precedence, functions, and everything outside the whitelist refused."""

from __future__ import annotations

import math

import pytest

from service.schemas.formula import FormulaError, compile_formula

NAMES = ("a", "b", "c")
VALUES = {"a": 2.0, "b": 3.0, "c": 0.5}


def value(text: str, **values) -> float:
    return compile_formula(text, NAMES).evaluate({**VALUES, **values})


@pytest.mark.parametrize("text,expected", [
    ("a + b * c", 2 + 3 * 0.5),  # * before +
    ("(a + b) * c", 2.5),
    ("a - b - c", (2 - 3) - 0.5),  # left-associative
    ("a / b / c", (2 / 3) / 0.5),
    ("a ^ 2", 4.0),  # ^ is power, as OpenAI writes it
    ("a + b ^ 2", 2 + 9),  # ^ before + (Python's ^ would be xor, lower than +)
    ("2 ^ 3 ^ 2", 2 ** 9),  # right-associative
    ("-a ^ 2", -4.0),  # power before unary minus
    ("a ** 2", 4.0),
    ("-(a - b)", 1.0),
    ("0.25 * a + 0.75 * b", 0.5 + 2.25),
])
def test_precedence_and_associativity(text, expected):
    assert value(text) == pytest.approx(expected)


@pytest.mark.parametrize("text,expected", [
    ("min(a, b, c)", 0.5), ("max(a, b)", 3.0), ("min(a)", 2.0), ("abs(c - a)", 1.5),
    ("floor(a + c)", 2.0), ("ceil(a + c)", 3.0), ("exp(0)", 1.0), ("sqrt(a * 8)", 4.0),
    ("log(exp(b))", 3.0), ("max(0, min(1, a - b))", 0.0),
])
def test_functions(text, expected):
    assert value(text) == pytest.approx(expected)


def test_variables_are_the_names_used():
    assert compile_formula("a + max(b, 1)", NAMES).variables == {"a", "b"}


@pytest.mark.parametrize("text,needle", [
    ("d + 1", "name 'd' is not a sub-reward"),
    ("__import__('os')", "function '__import__' is not allowed"),
    ("__import__('os').system('x')", "calls must name a function directly"),
    ("eval('1')", "function 'eval' is not allowed"),
    ("a.real", "attribute access"),
    ("a.__class__", "attribute access"),
    ("(lambda: 1)()", "calls must name a function directly"),
    ("min(*[a, b])", "positional arguments only"),
    ("max(a, key=b)", "positional arguments only"),
    ("sqrt(a, b)", "takes 1 argument"),
    ("'abc'", "is not a number"),
    ("True + a", "is not a number"),
    ("[a, b]", "List is not allowed"),
    ("a if b else c", "IfExp is not allowed"),
    ("a < b", "Compare is not allowed"),
    ("a % b", "Mod is not allowed"),
    ("a // b", "FloorDiv is not allowed"),
    ("a & b", "BitAnd is not allowed"),
    ("not a", "Not is not allowed"),
    ("abs", "a function must be called"),
    ("a +", "does not parse"),
    ("x" * 1001, "more than 1000"),
    ("abs(" * 60 + "a" + ")" * 60, "nests deeper"),
])
def test_refused(text, needle):
    with pytest.raises(FormulaError) as info:
        compile_formula(text, NAMES)
    assert needle in str(info.value), str(info.value)


def test_undefined_values_are_errors_for_the_sample():
    with pytest.raises(ZeroDivisionError):
        value("a / (b - 3)")
    with pytest.raises(ValueError):
        value("log(b - 3)")
    with pytest.raises(OverflowError):
        value("9 ^ 9 ^ 9")  # floats: overflows at once instead of building a huge integer
    with pytest.raises(ValueError, match="formula gave"):
        value("(a - b) ^ 0.5")  # a complex number is not a score


def test_sub_reward_names_must_be_identifiers():
    with pytest.raises(FormulaError, match="cannot be used in a formula"):
        compile_formula("1", ["my grader"])
    assert math.isfinite(compile_formula("g_1 * 2", ["g_1"]).evaluate({"g_1": 0.5}))
