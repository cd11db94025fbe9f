"""The locks (constraints/*.txt, `make lock`): each admits what pyproject.toml asks for, and every install of the
project goes through one."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "constraints"))
import lock  # noqa: E402  (constraints/lock.py: the sets and how they are resolved)


def _locked(name: str) -> dict[str, str]:
    lines = (REPO / "constraints" / f"{name}.txt").read_text().splitlines()
    pins = [line.split("==") for line in lines if line and not line.startswith("#")]
    return {canonicalize_name(package): version for package, version in pins}


@pytest.mark.parametrize("name", list(lock.SETS))
def test_each_lock_satisfies_pyproject_s_requirements(name):
    """A range or an extra changed in pyproject.toml without `make lock` leaves a lock that no longer resolves."""
    spec = lock.SETS[name]
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    locked = _locked(name)
    for text in [*spec["pins"], *lock.requirements(pyproject, spec["extras"])]:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"sys_platform": "linux", "platform_system": "Linux",
                                                               "platform_machine": "x86_64"}):
            continue
        package = canonicalize_name(req.name)
        assert package in locked, f"{name}.txt has no {req.name} (rerun `make lock`)"
        assert req.specifier.contains(locked[package], prereleases=True), \
            f"{name}.txt pins {req.name}=={locked[package]}, outside {text} (rerun `make lock`)"


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_every_pip_install_of_make_install_uses_the_lock(tmp_path):
    venv = tmp_path / "venv"  # never the shared .venv: `make -n` prints, and this path does not exist
    out = subprocess.run(["make", "-n", "--no-print-directory", "-C", str(REPO), f"VENV={venv}", f"{venv}/.installed",
                          "vllm"], capture_output=True, text=True, timeout=60, check=True).stdout
    installs = [line for line in out.splitlines() if "pip install" in line]
    assert len(installs) >= 3
    for line in installs:
        assert "-c constraints/cpu.txt" in line or "-c constraints/cuda.txt" in line, line
    assert "torch==" + _locked("cpu" if shutil.which("nvidia-smi") is None else "cuda")["torch"] in installs[0]
