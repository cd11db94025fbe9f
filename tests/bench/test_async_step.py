"""bench/async_step.py runs end to end on the toy task and prints every figure (no timing is asserted)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_async_step_smoke_prints_each_phase_the_bound_and_the_speedup(toy_dir):
    env = {**os.environ, "ASYNC_STEP_TOY_DIR": str(toy_dir), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "async_step.py"), "--workloads", "toy",
                          "--staleness", "0", "1", "--steps", "1", "--warmup", "1"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert re.search(r"load average at start [0-9.]+", text), text
    header = next(line for line in text.splitlines() if line.lstrip().startswith("s "))
    for field in ("steps/s", "rollout", "reward", "update", "roll_wait", "upd_wait", "speed-up", "load"):
        assert field in header, header
    rows = {int(m.group(1)): m.group(0) for m in re.finditer(r"^\s*([012]) +[0-9.]+ .*x +[0-9.]+$", text, re.M)}
    assert sorted(rows) == [0, 1], text
    assert re.search(r"overlap bound \(sync step [0-9.]+ s / longest phase, \w+ [0-9.]+ s\): [0-9.]+x", text), text
    assert re.search(r"achieved at max_staleness 1: [0-9.]+x = [0-9]+% of the bound \(load average [0-9.]+\)",
                     text), text
