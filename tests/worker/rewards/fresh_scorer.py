"""Score through the engine as the trainer builds it (worker.rewards.engine.build_scorer), in a separate Python
process, so that a reward that would hang the trainer fails a test by its timeout instead of blocking it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[3]


def score_in_a_fresh_process(spec: BaseModel, completions: list[str], *, timeout: float = 30) -> tuple[list, list]:
    """(scores, errors) of the completions, each scored against an empty row."""
    kind = type(spec)
    code = ("import json\n"
            f"from {kind.__module__} import {kind.__name__}\n"
            "from worker.rewards.engine import build_scorer\n"
            f"scorer = build_scorer({kind.__name__}.model_validate_json({spec.model_dump_json()!r}))\n"
            f"out = scorer.score({completions!r}, {[{} for _ in completions]!r})\n"
            "scorer.close()\n"
            "print(json.dumps([out.scores, out.errors]))\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stderr
    scores, errors = json.loads(run.stdout)
    return scores, errors
