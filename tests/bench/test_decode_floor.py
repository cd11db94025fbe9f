"""bench/decode_floor.py runs end to end on the small shape and prints the decode against its floor (no timing is
asserted)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_decode_floor_smoke_prints_the_ratio_to_the_floor_with_the_load():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "decode_floor.py"), "--repeats", "1", "--max-tokens",
                          "4", "--threads", "1", "--profile", "5"],
                         cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert re.search(r"load average at start [0-9.]+", text), text
    assert re.search(r"read bandwidth [0-9.]+ GB/s, float32 matmul [0-9]+ GFLOP/s", text), text
    assert re.search(r"decode: median [0-9.]+ s of .* = [0-9.]+x its [0-9.]+ s floor \([0-9]+ ms/step\); "
                     r"load average [0-9.]+", text), text
    assert "Self CPU" in text  # the operator profile
