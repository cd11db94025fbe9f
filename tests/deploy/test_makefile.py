"""`make install` as a fresh machine runs it, read with `make -n` (nothing is executed) into a scratch venv path."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_install_shows_its_steps_and_what_pip_does(tmp_path):
    venv = tmp_path / "venv"  # never the shared .venv: `make -n` prints, and this path does not exist
    out = subprocess.run(["make", "-n", "--no-print-directory", "-C", str(REPO), f"VENV={venv}",
                          f"{venv}/.installed"], capture_output=True, text=True, timeout=60, check=True).stdout
    installs = [line for line in out.splitlines() if "pip install" in line]
    assert len(installs) >= 3 and not any(" -q" in line for line in installs)  # pip's own lines are shown
    steps = [line for line in out.splitlines() if line.startswith('echo "==> [')]
    assert [s.split("]")[0] for s in steps] == ['echo "==> [1/4', 'echo "==> [2/4', 'echo "==> [3/4', 'echo "==> [4/4']
