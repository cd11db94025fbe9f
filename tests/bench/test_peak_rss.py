"""bench/trl_compare.py's per-side peak RSS: a child's figure must be its own, not its parent's high-water mark."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_childs_peak_is_not_its_parents():
    held = bytearray(600 * 2**20)  # 600 MiB this process touches (zero-filled pages are resident once written)
    for i in range(0, len(held), 4096):
        held[i] = 1
    child = subprocess.run(
        [sys.executable, "-c", "from bench.trl_compare import _status_bytes; print(_status_bytes('VmHWM'))"],
        cwd=ROOT, capture_output=True, text=True, check=True)
    peak = int(child.stdout.split()[-1])
    # The child imports torch and transformers (~200-400 MiB); getrusage's ru_maxrss would report >= 600 MiB here.
    assert peak < 550 * 2**20, f"the child reported {peak / 2**20:.0f} MiB: its parent's peak, not its own"
    del held
