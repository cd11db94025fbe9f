"""The worker image has what the GPU paths need: a C compiler for Triton (torch.compile, vLLM's compiled mode)
and vLLM, installed with torch in one pip run at the locked CUDA set's versions, so that pip cannot swap torch for
another version and two builds a month apart get the same versions."""

from __future__ import annotations

import re
from pathlib import Path

from tests.deploy.test_manifests import dockerfile_stages, stage_chain

REPO = Path(__file__).resolve().parents[2]


def _worker_runs() -> list[str]:
    return [rest for instr, rest in stage_chain(dockerfile_stages(), "worker") if instr == "RUN"]


def test_worker_image_installs_a_c_compiler():
    apt = [r for r in _worker_runs() if "apt-get install" in r]
    packages = {p for r in apt for p in r.split("apt-get install", 1)[1].split("&&")[0].split() if not p.startswith("-")}
    assert packages & {"gcc", "build-essential", "clang"}, packages
    assert "libc6-dev" in packages or "build-essential" in packages, "a compiler without libc headers links nothing"
    assert any("shutil.which('cc')" in r for r in _worker_runs()), "the build does not check the compiler is there"


def test_vllm_is_installed_with_torch_in_one_pip_run_at_the_locked_versions():
    """torch, vLLM and the worker extra in one pip run under the locked CUDA set, whose torch the build checks."""
    installs = [r for r in _worker_runs() if "pip install" in r]
    one_run = r"pip install -c constraints/cuda\.txt torch vllm \"\.\[worker,vllm[,\]]"
    pinned = [r for r in installs if re.search(one_run, r)]
    assert pinned, installs
    for run in installs:
        for command in re.split(r"&&|;", run):
            if "pip install" in command and "--no-deps" not in command:
                assert "-c constraints/cuda.txt" in command, f"an install outside the lock: {command}"
    assert any("import shutil, torch, triton, vllm" in r and "constraints/cuda.txt" in r for r in _worker_runs())
    locked = (REPO / "constraints" / "cuda.txt").read_text().splitlines()
    assert any(line.startswith("torch==") for line in locked) and any(line.startswith("vllm==") for line in locked)


def test_the_api_image_installs_the_locked_cpu_set():
    runs = [rest for instr, rest in stage_chain(dockerfile_stages(), "api") if instr == "RUN"]
    installs = [run for run in runs if "pip install" in run]
    commands = [c for run in installs for c in re.split(r"&&|;", run) if "pip install" in c and "--no-deps" not in c]
    assert commands and all("-c constraints/cpu.txt" in c for c in commands), commands


def test_the_api_image_has_neither():
    api = " ".join(rest for instr, rest in stage_chain(dockerfile_stages(), "api") if instr == "RUN")
    assert "vllm" not in api and "gcc" not in api
