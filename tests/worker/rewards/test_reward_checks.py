"""Builtin graded rewards on hand-made cases: normalisation, JSON, length, templates, string_check, similarity."""

from __future__ import annotations

import math

import pytest
from pydantic import TypeAdapter, ValidationError

from service.schemas.reward_checks import (
    JsonSchemaReward,
    JsonValidReward,
    LengthReward,
    SimilarityReward,
    StringCheckReward,
)
from service.schemas.rewards import ExactMatchReward, RewardSpec
from service.schemas.templates import SampleParseError, TemplateError, check_template, render
from worker.rewards.builtins import exact_match, length
from worker.rewards.graders import similarity, string_check
from worker.rewards.engine import build_scorer
from worker.rewards.json_checks import json_valid

SPEC = TypeAdapter(RewardSpec)


# -- exact_match normalisation --------------------------------------------------


def test_exact_match_normalisation_options():
    row = {"answer": "New York, NY"}
    assert exact_match("new  york  ny", row, ExactMatchReward()) == 0.0
    assert exact_match("new york ny", row, ExactMatchReward(strip_punctuation=True)) == 1.0
    assert exact_match("new \n york ny", row, ExactMatchReward(strip_punctuation=True)) == 0.0
    both = ExactMatchReward(strip_punctuation=True, collapse_whitespace=True)
    assert exact_match("  New \n York  NY! ", row, both) == 1.0
    assert exact_match("new york ny", row, both.model_copy(update={"case_sensitive": True})) == 0.0
    assert exact_match("«New York» NY", row, both) == 1.0  # Unicode punctuation too


# -- templates ---------------------------------------------------------------------


def test_templates_render_item_paths_and_the_sample():
    row = {"answer": "Paris", "meta": {"tags": ["geo", "fr"], "n": 3}, "ok": True}
    assert render("{{ item.answer }}/{{item.meta.tags.1}}/{{ item.meta.n }}/{{item.ok}}", "x", row) == "Paris/fr/3/true"
    assert render("<{{ sample.output_text }}>", "out", row) == "<out>"
    assert render("{{ sample.output_json.a.0 }}", '{"a": [5, 6]}', row) == "5"
    assert render('{{ item.meta }}', "", row) == '{"tags":["geo","fr"],"n":3}'
    assert render("no variables", "x", {}) == "no variables"


def test_template_variables_that_do_not_resolve_are_sample_errors():
    with pytest.raises(TemplateError, match="item has no field 'missing'"):
        render("{{ item.missing }}", "x", {"answer": 1})
    with pytest.raises(TemplateError, match="has 1 elements, no index 3"):
        render("{{ item.a.3 }}", "x", {"a": [0]})
    with pytest.raises(SampleParseError, match="not JSON"):
        render("{{ sample.output_json }}", "not json", {})


@pytest.mark.parametrize("template", ["{{ row.a }}", "{{ sample.output_tools }}", "{{ sample }}", "{{ item[0] }}",
                                      "{{ item.a + 1 }}"])
def test_unsupported_template_variables_are_refused_by_name(template):
    with pytest.raises(ValueError, match="template variable"):
        check_template(template)


@pytest.mark.parametrize("template", ["{{ item.answer", "x {{ item.a }} and {{ item.b", "{{", "a }} {{ b"])
def test_an_unclosed_variable_is_refused(template):
    """It would otherwise be compared as literal text, and never match."""
    with pytest.raises(ValueError, match="no closing"):
        check_template(template)
    assert check_template('{"a": {"b": 1}}') == '{"a": {"b": 1}}'  # a stray '}}' is plain text


# -- JSON -------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["NaN", "Infinity", "-Infinity", '{"a": Infinity}', "[1, NaN]",
                                  "```json\n{\"a\": -Infinity}\n```"])
def test_json_valid_refuses_nan_and_infinity(text):
    """Python's json.loads reads them; RFC 8259 JSON has no NaN or Infinity, so they are not valid JSON."""
    assert json_valid(text, {}, JsonValidReward(fenced=True)) == 0.0
    assert json_valid(text, {}, JsonValidReward()) == 0.0


def test_json_valid_with_and_without_fences():
    plain, fenced = JsonValidReward(), JsonValidReward(fenced=True)
    assert json_valid(' {"a": 1} ', {}, plain) == 1.0
    assert json_valid("[1, 2", {}, plain) == 0.0
    text = 'Here it is:\n```json\n{"a": [1, 2]}\n```\nDone.'
    assert json_valid(text, {}, plain) == 0.0 and json_valid(text, {}, fenced) == 1.0
    assert json_valid("```\n42\n```", {}, fenced) == 1.0  # a bare fence counts too
    assert json_valid('{"a": 1}', {}, fenced) == 1.0  # no fence: the whole completion


def test_json_schema_conformance():
    schema = {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0}}, "required": ["age"]}
    texts = ['{"age": 30}', '{"age": -1}', '{"name": "x"}', "not json", '```json\n{"age": 1}\n```']
    scores = {}
    for fenced in (False, True):
        scorer = build_scorer(JsonSchemaReward(json_schema=schema, fenced=fenced))
        try:
            scores[fenced] = scorer.score(texts, [{}] * len(texts)).scores
        finally:
            scorer.close()
    assert scores[False] == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert scores[True] == [1.0, 0.0, 0.0, 0.0, 1.0]  # the fenced block's content is what conforms


def test_json_schema_is_checked_when_the_spec_is_created():
    with pytest.raises(ValidationError, match="not a valid schema at properties/age/type"):
        JsonSchemaReward(json_schema={"properties": {"age": {"type": "integr"}}})
    with pytest.raises(ValidationError, match="not a valid schema"):
        SPEC.validate_python({"type": "json_schema", "json_schema": {"minimum": "zero"}})


# -- length ------------------------------------------------------------------------------


def test_length_linear_and_gaussian_by_hand():
    linear = LengthReward(target=10, tolerance=2, scale=4, unit="chars")
    assert length("x" * 12, {}, linear) == 1.0  # within tolerance
    assert length("x" * 14, {}, linear) == pytest.approx(0.5)  # d = 4 - 2 = 2 -> 1 - 2/4
    assert length("x" * 4, {}, linear) == 0.0  # d = 6 - 2 = 4 -> 0
    gauss = LengthReward(target=5, scale=2, penalty="gaussian")  # words
    assert length("one two three", {}, gauss) == pytest.approx(math.exp(-4 / 8))  # d = 2
    over = LengthReward(target=3, scale=3, penalize="over")
    assert length("a", {}, over) == 1.0 and length("a b c d e f", {}, over) == 0.0
    under = LengthReward(target=3, scale=3, penalize="under")
    assert length("a b c d e f g", {}, under) == 1.0 and length("a b", {}, under) == pytest.approx(2 / 3)


# -- string_check and similarity ------------------------------------------------------


@pytest.mark.parametrize("operation,completion,expected", [
    ("eq", "Paris", 1.0), ("eq", "paris", 0.0), ("ne", "Lyon", 1.0), ("ne", "Paris", 0.0),
    ("like", "It is Paris.", 1.0), ("like", "it is paris", 0.0), ("ilike", "it is PARIS", 1.0),
])
def test_string_check_operations(operation, completion, expected):
    spec = StringCheckReward(reference="{{ item.city.name }}", operation=operation)
    assert string_check(completion, {"city": {"name": "Paris"}}, spec) == expected


def test_similarity_reward_uses_the_field_or_a_reference_template():
    spec = SimilarityReward(metric="fuzzy_match")
    assert similarity("abcd", {"answer": "acbd"}, spec) == pytest.approx(0.75)
    templated = SimilarityReward(metric="token_f1", reference="{{ item.gold.text }}")
    assert similarity("the cat sat", {"gold": {"text": "the cat ran away"}}, templated) == pytest.approx(4 / 7)
    with pytest.raises(KeyError, match="no field 'answer'"):
        similarity("x", {}, spec)
    with pytest.raises(ValidationError, match="metric"):
        SPEC.validate_python({"type": "similarity", "metric": "meteor"})
