"""The worker image has what the GPU paths need: a C compiler for Triton (torch.compile, vLLM's compiled mode)
and vLLM, pinned as a pair with torch so that pip cannot swap torch for another version."""

from __future__ import annotations

import re

from tests.deploy.test_manifests import dockerfile_stages, stage_chain


def _worker_runs() -> list[str]:
    return [rest for instr, rest in stage_chain(dockerfile_stages(), "worker") if instr == "RUN"]


def _args() -> dict[str, str]:
    chain = stage_chain(dockerfile_stages(), "worker")
    return dict(rest.split("=", 1) for instr, rest in chain if instr == "ARG" and "=" in rest)


def test_worker_image_installs_a_c_compiler():
    apt = [r for r in _worker_runs() if "apt-get install" in r]
    packages = {p for r in apt for p in r.split("apt-get install", 1)[1].split("&&")[0].split() if not p.startswith("-")}
    assert packages & {"gcc", "build-essential", "clang"}, packages
    assert "libc6-dev" in packages or "build-essential" in packages, "a compiler without libc headers links nothing"
    assert any("shutil.which('cc')" in r for r in _worker_runs()), "the build does not check the compiler is there"


def test_vllm_is_installed_pinned_with_torch_in_one_pip_run():
    args = _args()
    assert re.fullmatch(r"\d+\.\d+\.\d+", args.get("TORCH_VERSION", "")), args
    assert re.fullmatch(r"\d+\.\d+\.\d+(\.post\d+)?", args.get("VLLM_VERSION", "")), args
    pinned = [r for r in _worker_runs()
              if '"vllm==${VLLM_VERSION}"' in r and '"torch==${TORCH_VERSION}"' in r]
    assert pinned, "vllm and torch are not pinned together in one pip install"
    # The same run installs the project's worker extra, so nothing later re-resolves torch.
    assert re.search(r"pip install [^&]*\"vllm==\$\{VLLM_VERSION\}\"[^&]*\.\[worker[,\]]", pinned[0]), pinned[0]
    for run in _worker_runs():
        for spec in re.findall(r'"torch([^"]*)"', run):
            assert spec == "==${TORCH_VERSION}", f"an unpinned torch install: torch{spec}"
    assert any("import os, shutil, torch, triton, vllm" in r and "TORCH_VERSION" in r for r in _worker_runs())


def test_the_api_image_has_neither():
    api = " ".join(rest for instr, rest in stage_chain(dockerfile_stages(), "api") if instr == "RUN")
    assert "vllm" not in api and "gcc" not in api
