"""bench/multi_job.py --smoke runs its GPU mode end to end on CPU, so the GPU script cannot rot between GPU runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_multi_job_smoke_prints_every_figure(toy_dir):
    """Sequential and shared runs at K = 1 and 2 (the GPU mode's path: bench/gpu_step.py's workload, the base held
    as a shared worker holds it), a row per K with every figure, and the summary's ratios."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "CISPO_TEST_TOY_DIR": str(toy_dir)}
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "multi_job.py"), "--smoke"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "workload smoke: hidden 32, 2 layers" in out.stdout
    for k in (1, 2):
        row = re.search(rf"^\| {k} \| ([0-9.]+) \| ([0-9.]+) \| ([0-9.]+)x \| ([0-9.]+)x \| ([0-9]+) \|", out.stdout,
                        re.MULTILINE)
        assert row and all(float(v) > 0 for v in row.groups()), out.stdout
    summary = out.stdout.split("== summary")[-1]
    for k in (1, 2):
        match = re.search(rf"K={k} shared vs sequential steady rate ([0-9.]+)x", summary)
        assert match and float(match.group(1)) > 0, summary
