"""bench/packed_float32.py runs end to end on the small shape: packed float32 linears decode the same prompts, and
the bench reports how far their logits move (no timing is asserted)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_packed_float32_smoke_reports_time_and_the_logits_difference():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "packed_float32.py"), "--repeats", "1",
                          "--max-tokens", "4", "--threads", "1"],
                         cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    diff = re.search(r"max abs difference ([0-9.e+-]+) \(max \|logit\| ([0-9.]+)\)", text)
    assert diff, text
    assert float(diff.group(1)) < 1e-4 * float(diff.group(2))  # a rounding difference, not another computation
    assert re.search(r"completions identical [0-9]+/16", text), text
    assert re.search(r"decode: sgemm .* packed .*: [0-9.]+x faster", text), text
