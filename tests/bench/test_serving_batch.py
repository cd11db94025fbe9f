"""bench/serving_batch.py --smoke on the tiny model: every figure of a round and the summary is printed (no timing
is asserted: the figures are the bench's to report)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NUMBER = r"([0-9.]+)"


@pytest.mark.slow
def test_serving_batch_smoke_prints_every_figure(toy_dir, tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TMPDIR": str(tmp_path)}
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "serving_batch.py"), "--toy-dir", str(toy_dir),
                          "--smoke"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "16 streams (4 projects x 4 adapters) vs one alone" in out.stdout
    summary = out.stdout.split("== summary")[-1]
    row = re.search(rf"^median: 16 together {NUMBER} s, slowest alone {NUMBER} s, ratio {NUMBER}x; ttft p50 "
                    rf"{NUMBER} ms, p99 {NUMBER} ms; tokens/s together {NUMBER}, alone {NUMBER}; load {NUMBER}$",
                    summary, re.MULTILINE)
    assert row, out.stdout
    together, alone, ratio, p50, p99, tps_together, tps_alone, _ = (float(v) for v in row.groups())
    assert together > 0 and alone > 0 and tps_together > 0 and tps_alone > 0
    assert ratio == pytest.approx(together / alone, rel=0.05) and 0 < p50 <= p99
