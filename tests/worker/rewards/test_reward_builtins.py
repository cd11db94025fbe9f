"""Builtin reward verifiers on hand-made cases, and reward spec validation."""

from __future__ import annotations

import pytest
from pydantic import TypeAdapter, ValidationError

from service.job_spec.spec import JobSpec
from service.schemas.rewards import (
    ContainsReward,
    ExactMatchReward,
    NumericMatchReward,
    PythonReward,
    RegexReward,
    RewardSpec,
)
from worker.rewards.builtins import contains, exact_match, last_boxed, last_number, numeric_match

SPEC = TypeAdapter(RewardSpec)


def _error(raw: dict) -> str:
    with pytest.raises(ValidationError) as info:
        SPEC.validate_python(raw)
    return str(info.value)


# -- exact_match -----------------------------------------------------------------


def test_exact_match_defaults_fold_case_and_strip():
    spec = ExactMatchReward()
    assert exact_match("  Paris\n", {"answer": "paris"}, spec) == 1.0
    assert exact_match("Paris!", {"answer": "paris"}, spec) == 0.0
    assert exact_match("Paris is it", {"answer": "paris"}, spec) == 0.0


def test_exact_match_options():
    assert exact_match("Paris", {"answer": "paris"}, ExactMatchReward(case_sensitive=True)) == 0.0
    assert exact_match("paris", {"answer": "paris"}, ExactMatchReward(case_sensitive=True)) == 1.0
    assert exact_match(" paris", {"answer": "paris"}, ExactMatchReward(strip=False)) == 0.0
    assert exact_match("42", {"label": 42}, ExactMatchReward(field="label")) == 1.0  # non-strings compare as str


# -- contains -------------------------------------------------------------------


@pytest.mark.parametrize("options, completion, expected", [
    ({}, "paris", "  Paris\n"),  # strip and case folding: the expected answer too
    ({}, "\tParis ", " PARIS\n"),
    ({"strip_punctuation": True}, "paris", "Paris!"),
    ({"strip_punctuation": True}, "Paris!", "¿paris?"),
    ({"collapse_whitespace": True}, "new york", "New \t York"),
    ({"collapse_whitespace": True}, "New   york", "new\nyork"),
    ({"collapse_whitespace": True, "strip_punctuation": True}, "new york", " New, York. "),
])
def test_exact_match_normalises_both_sides(options, completion, expected):
    spec = ExactMatchReward(**options)
    assert exact_match(completion, {"answer": expected}, spec) == 1.0
    assert exact_match(expected, {"answer": completion}, spec) == 1.0


def test_exact_match_keeps_what_its_options_keep_on_both_sides():
    assert exact_match("paris", {"answer": " paris"}, ExactMatchReward(strip=False)) == 0.0
    assert exact_match("paris", {"answer": "Paris"}, ExactMatchReward(case_sensitive=True)) == 0.0
    assert exact_match("paris", {"answer": "paris!"}, ExactMatchReward()) == 0.0
    assert exact_match("new york", {"answer": "new  york"}, ExactMatchReward()) == 0.0


def test_contains_folds_case_on_both_sides():
    assert contains("It is PARIS.", {"answer": "paris"}, ContainsReward()) == 1.0
    assert contains("it is paris.", {"answer": "Paris"}, ContainsReward()) == 1.0
    assert contains("it is paris.", {"answer": "Paris"}, ContainsReward(case_sensitive=True)) == 0.0


def test_string_check_ilike_folds_case_on_both_sides_and_eq_like_do_not():
    from service.schemas.reward_checks import StringCheckReward
    from worker.rewards.graders import string_check

    def check(operation: str, completion: str, reference: str) -> float:
        spec = StringCheckReward(reference="{{ item.answer }}", operation=operation)
        return string_check(completion, {"answer": reference}, spec)

    assert check("ilike", "It is PARIS", "paris") == check("ilike", "it is paris", "PARIS") == 1.0
    assert check("like", "It is PARIS", "paris") == check("like", "it is paris", "PARIS") == 0.0
    assert check("eq", "paris", "paris") == check("ne", "paris", " paris") == 1.0
    assert check("eq", "paris", " paris") == check("eq", " paris", "paris") == 0.0  # eq does not strip


def test_contains():
    spec = ContainsReward()
    assert contains("The capital is PARIS.", {"answer": "paris"}, spec) == 1.0
    assert contains("The capital is Lyon.", {"answer": "paris"}, spec) == 0.0
    assert contains("The capital is PARIS.", {"answer": "paris"}, ContainsReward(case_sensitive=True)) == 0.0
    assert contains("x=7", {"y": 7}, ContainsReward(field="y")) == 1.0


# -- numbers --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("the answer is 1,234.5", 1234.5),
        ("-3", -3.0),
        ("x = -3.", -3.0),
        ("2 apples and 17 pears", 17.0),
        ("12,345,678 grains", 12345678.0),
        ("pages 10-20", 20.0),  # a hyphen between numbers is not a sign
        ("1,2345", 2345.0),  # not a thousands group
        ("about .5", 0.5),
        ("1e3", 1000.0),
        ("no number here", None),
    ],
)
def test_last_number(text, expected):
    assert last_number(text) == expected


def test_numeric_match_last_number_and_tolerance_edges():
    spec = NumericMatchReward(tolerance=0.5)
    assert numeric_match("so it is 1,234.5", {"answer": "1234"}, spec) == 1.0  # |diff| == tolerance counts
    assert numeric_match("so it is 1,234.6", {"answer": "1234"}, spec) == 0.0
    assert numeric_match("-3", {"answer": -3}, NumericMatchReward()) == 1.0
    assert numeric_match("-3", {"answer": 3}, NumericMatchReward()) == 0.0
    default = NumericMatchReward()  # 1e-6 absolute
    assert numeric_match("0.1000005", {"answer": 0.1}, default) == 1.0
    assert numeric_match("0.100002", {"answer": 0.1}, default) == 0.0
    assert numeric_match("nothing", {"answer": 0}, default) == 0.0
    assert numeric_match("7", {"answer": "1,000"}, default) == 0.0
    assert numeric_match("1000", {"answer": "1,000"}, default) == 1.0


def test_numeric_match_boxed():
    spec = NumericMatchReward(source="boxed")
    assert numeric_match(r"first \boxed{7}, finally \boxed{42} and 99", {"answer": 42}, spec) == 1.0
    assert numeric_match(r"\boxed{ $1,234$ }", {"answer": 1234}, spec) == 1.0
    assert numeric_match("42 with no box", {"answer": 42}, spec) == 0.0
    assert numeric_match(r"\boxed{x = 42}", {"answer": 42}, spec) == 0.0  # the box must hold just a number
    assert numeric_match(r"\boxed{42} at the end 99", {"answer": 99}, NumericMatchReward()) == 1.0
    assert last_boxed(r"\boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed{1} then \boxed{2") == "1"  # an unclosed box is skipped


def test_numeric_match_after_hashes_reads_gsm8k_answers():
    """GSM8K's format: the number right after the last ####; later numbers and numbers without #### do not count."""
    spec = NumericMatchReward(source="after_hashes")
    assert numeric_match("3 + 4 = 7 apples\n#### 7", {"answer": "7"}, spec) == 1.0
    assert numeric_match("#### 5 wrong\n#### $1,234.", {"answer": "1234"}, spec) == 1.0
    assert numeric_match("#### -3 because 10 - 13", {"answer": -3}, spec) == 1.0
    assert numeric_match("the answer is 7", {"answer": 7}, spec) == 0.0  # no ####: no answer
    assert numeric_match("#### seven", {"answer": 7}, spec) == 0.0
    assert numeric_match("#### 8\nso 7", {"answer": 7}, spec) == 0.0  # last_number would say 1.0 here


def test_missing_field_and_bad_row_value_raise_clearly():
    with pytest.raises(KeyError, match="row has no field 'answer'.*'solution'"):
        exact_match("x", {"solution": "x"}, ExactMatchReward())
    with pytest.raises(KeyError, match="'gold'"):
        contains("x", {"answer": "x"}, ContainsReward(field="gold"))
    with pytest.raises(KeyError, match="'answer'"):
        numeric_match("1", {}, NumericMatchReward())
    with pytest.raises(ValueError, match="row field 'answer' is not a number: 'seven'"):
        numeric_match("7", {"answer": "seven"}, NumericMatchReward())


# -- spec validation ------------------------------------------------------------


def test_specs_validate_through_the_union_and_the_job_spec():
    assert isinstance(SPEC.validate_python({"type": "regex", "pattern": "a+"}), RegexReward)
    assert SPEC.validate_python({"type": "numeric_match"}).source == "last_number"
    job = JobSpec.model_validate({"model": "m", "data": {"train_file": "t.jsonl"},
                                  "reward": {"type": "python", "source": "def reward(c, **r):\n    return 1.0\n"}})
    assert isinstance(job.reward, PythonReward) and job.reward.entry_point == "reward"
    assert "extra" in _error({"type": "contains", "needle": "x"})  # unknown fields refused
    assert "import" not in str(SPEC.json_schema())  # the service's union has no 'import'


def test_bad_regex_names_the_problem():
    message = _error({"type": "regex", "pattern": "(abc"})
    assert "invalid regular expression at position 0: missing ), unterminated subpattern" in message
    assert "at most 1000 characters" in _error({"type": "regex", "pattern": "a" * 1001})


def test_python_syntax_error_names_the_line():
    source = "def reward(completion, **row):\n    x = 1\n    return (x +\n"
    message = _error({"type": "python", "source": source})
    assert "source line 3:" in message
    message = _error({"type": "python", "source": "import os\n\ndef reward(c, **r)\n    return 1.0\n"})
    assert "source line 3: expected ':'" in message


def test_python_entry_point_must_be_a_top_level_def():
    assert "entry point 'reward' is not defined" in _error({"type": "python", "source": "def score(c, **r):\n    return 1\n"})
    nested = "class A:\n    def reward(self, c):\n        return 1\n"
    assert "entry point 'reward' is not defined" in _error({"type": "python", "source": nested})
    assert "entry point 'judge' is not defined" in _error(
        {"type": "python", "source": "def reward(c, **r):\n    return 1\n", "entry_point": "judge"})
    assert "not async def" in _error({"type": "python", "source": "async def reward(c, **r):\n    return 1\n"})
    assert "not a Python identifier" in _error({"type": "python", "source": "def f(): pass", "entry_point": "a-b"})
    ok = SPEC.validate_python({"type": "python", "source": "def judge(c, **r):\n    return 1\n", "entry_point": "judge"})
    assert ok.entry_point == "judge"


def test_python_source_size_cap():
    body = "def reward(c, **r):\n    return 1.0\n"
    at_cap = body + "#" * (256 * 1024 - len(body) - 1) + "\n"
    assert len(at_cap.encode()) == 256 * 1024
    SPEC.validate_python({"type": "python", "source": at_cap})
    message = _error({"type": "python", "source": at_cap + "#"})
    assert "262145 bytes, more than 262144 (256 KiB)" in message
    # the cap counts UTF-8 bytes, not characters
    assert "more than 262144" in _error({"type": "python", "source": body + "#" + "é" * (128 * 1024)})


def test_python_source_is_not_executed_by_validation(tmp_path):
    marker = tmp_path / "ran"
    source = f"open({str(marker)!r}, 'w').close()\ndef reward(c, **r):\n    return 1.0\n"
    SPEC.validate_python({"type": "python", "source": source})
    assert not marker.exists()
