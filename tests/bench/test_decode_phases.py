"""bench/decode_phases.py runs end to end on the small shape and charges the decode steps' time to phases whose
shares add up to the whole (no timing is asserted)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_decode_phases_smoke_splits_a_step_into_phases_that_add_up():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "decode_phases.py"), "--repeats", "1", "--max-tokens",
                          "4", "--threads", "1"],
                         cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert re.search(r"= [0-9.]+x the [0-9.]+ s decode floor; [0-9.]+ ms per new token", text), text
    rows = dict(re.findall(r"^\| ([^|]+?) \| [0-9.]+ \| ([0-9.]+)% \|", text, re.M))
    # the adapter's matmuls are told from the base weight's by shape, under the same LoRA layer label
    assert {"base_linear", "lm_head", "lora adapter", "attention:sdpa", "sampling", "python:lora_linear"} <= set(rows)
    assert abs(sum(map(float, rows.values())) - 100) < 1, rows
    assert re.search(r"by kind \(ms/step\): .*base_linear [0-9.]+", text), text


def test_packed_base_linears_and_the_packing_itself_are_charged_as_such():
    """A packed base weight's call (oneDNN's kernel, no aten::linear to read a shape from) is the base linear's,
    not the adapter's; reordering the weights for the rollout is its own phase, not the loop's."""
    sys.path.insert(0, str(ROOT))
    from bench.decode_phases import _group, _phase

    assert _phase("lora_linear", "mkldnn::_linear_pointwise", [[16, 896], []], 16) == "base_linear"
    assert _phase("lora_linear", "aten::linear", [[16, 896], [16, 896]], 16) == "lora adapter"
    assert _phase("lora_linear", "aten::linear", [[16, 896], [4864, 896]], 16) == "base_linear"
    assert _phase(None, "mkldnn::_reorder_linear_weight", [[4864, 896], []], 16) == "packing weights"
    assert _group("packing weights") == "packing weights"
