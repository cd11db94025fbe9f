"""bench/tinker_overhead.py on the tiny model at the fewest steps: both figures, their ratio and the load average
are printed (no timing is asserted: the figures are the bench's to report)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("tinker")


@pytest.mark.slow
def test_tinker_overhead_prints_both_figures_and_their_ratio(toy_dir, tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TMPDIR": str(tmp_path), "TINKER_TELEMETRY": "0"}
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "tinker_overhead.py"), "--models", "tiny",
                          "--toy-dir", str(toy_dir), "--steps", "2", "--quiet"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = out.stdout.split("== summary")[-1]
    row = re.search(r"^tiny \(4 x 32 tokens\): in process ([0-9.]+) ms/step, over HTTP ([0-9.]+) ms/step, "
                    r"ratio ([0-9.]+)x .*load ([0-9.]+)-([0-9.]+)$", summary, re.MULTILINE)
    assert row, out.stdout
    local, http, ratio = (float(v) for v in row.groups()[:3])
    assert local > 0 and http > 0
    assert ratio == pytest.approx(http / local, rel=0.02)
