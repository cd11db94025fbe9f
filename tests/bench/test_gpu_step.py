"""bench/gpu_step.py --smoke runs end to end on CPU, so the GPU script cannot rot between GPU runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_step_smoke_prints_every_figure():
    """Both modes run against TRL, the decode loop falls back to eager without CUDA, and every figure is printed."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_step.py"), "--smoke"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = out.stdout.split("== summary")[-1]
    for mode in ("lora", "full"):
        match = re.search(rf"{mode}\s+step speed-up vs TRL\s+([0-9.]+)x", summary)
        assert match and float(match.group(1)) > 0, summary
    assert re.search(r"decode ([0-9.]+) ms/step for 4 sequences, eager\s", summary), summary
    match = re.search(r"async\s+max_staleness 1 vs 0\s+([0-9.]+)x", summary)
    assert match and float(match.group(1)) > 0, summary
    assert "full fine-tuning" in out.stdout and "LoRA r=4" in out.stdout
