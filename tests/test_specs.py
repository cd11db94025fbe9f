"""tests/specs.py's merge: sections merge in depth, a choice of another type replaces the base's whole."""

from tests.specs import MINIMAL, job_spec, merged


def test_sections_merge_in_depth_and_none_replaces():
    base = {"training": {"steps": 4, "pass_rate_filter": {"threshold": 0.5}}, "lora": {"r": 8}}
    assert merged(base, {"training": {"pass_rate_filter": {"window": 3}}, "lora": None}) == {
        "training": {"steps": 4, "pass_rate_filter": {"threshold": 0.5, "window": 3}}, "lora": None}
    assert base == {"training": {"steps": 4, "pass_rate_filter": {"threshold": 0.5}}, "lora": {"r": 8}}


def test_a_choice_of_another_type_replaces_the_bases():
    assert job_spec(reward={"type": "exact_match", "field": "answer"}).reward.type == "exact_match"  # no stray path
    assert job_spec(reward={"path": "other.mod:fn"}).reward.path == "other.mod:fn"
    assert MINIMAL["reward"] == {"type": "import", "path": "pkg.mod:fn"}
