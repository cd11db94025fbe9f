"""bench/gpu_check.py: the prepared first-GPU check runs every stage on CPU (--smoke), kills a stage at its
timeout keeping its output, and installs only what is missing, never torch, from a wheel bundle when given."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench import gpu_check  # noqa: E402


@pytest.mark.slow
def test_smoke_runs_every_stage_and_keeps_every_output(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OUT": str(tmp_path)}
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--smoke"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    stages = {s["stage"]: s for s in summary["stages"]}
    assert list(stages) == ["env", "decode", "train", "bench"]
    assert all(s["status"] == "ok" for s in stages.values()), stages
    assert summary["installed"] == []  # everything was there
    for name in stages:
        assert (tmp_path / f"{name}.log").stat().st_size > 0
    assert stages["env"]["torch"] == torch.__version__ and stages["env"]["device"] == "CPU"
    decode = stages["decode"]
    assert decode["greedy_equal_plain"] is True and decode["greedy_equal_lora"] is True
    assert decode["graph_breaks"] == 0 and decode["compile_fallbacks"] == [] and decode["recompiles_on_return_to_64"] == 0
    assert decode["ms_per_step_compiled"] > 0 and decode["ms_per_step_eager"] > 0
    for mode in ("lora", "full"):
        assert len(stages["train"][f"{mode}_losses"]) == 2 and stages["train"][f"{mode}_evals"] >= 1
    bench = stages["bench"]
    assert bench["lora_speedup_vs_trl"] > 0 and bench["full_speedup_vs_trl"] > 0 and bench["decode_ms_per_step"] > 0
    assert "gpu_check summary" in out.stdout


def test_a_stage_is_killed_at_its_timeout_and_its_output_kept(tmp_path, monkeypatch):
    hang = [sys.executable, "-u", "-c",
            "import json, sys, time; print('started'); "
            f"open({str(tmp_path / 'hang.json')!r}, 'w').write(json.dumps({{'partial': 1}})); time.sleep(120)"]
    monkeypatch.setattr(gpu_check, "stage_command", lambda name, smoke, out: hang)
    result = gpu_check.run_stage("hang", smoke=True, out=tmp_path, timeout=3)
    assert result["status"] == "timeout" and result["seconds"] < 30
    assert result["partial"] == 1  # the figures written before the kill
    log = (tmp_path / "hang.log").read_text()
    assert "started" in log and "killed after 3 s" in log


def test_install_plan_pins_the_installed_torch_and_uses_only_the_bundle(tmp_path):
    missing = gpu_check.missing_requirements(find=lambda module: None if module in ("trl", "datasets") else True)
    assert missing == ["datasets", "trl>=1.16,<1.17"]
    command = gpu_check.pip_install_command(missing, "2.14.0+cu130", tmp_path / "c.txt", tmp_path / "wheels")
    constraints = (tmp_path / "c.txt").read_text().splitlines()
    assert constraints[-1] == "torch==2.14.0+cu130" and sum(c.startswith("torch==") for c in constraints) == 1
    assert command[command.index("-c") + 1] == str(tmp_path / "c.txt")
    assert "--no-index" in command and command[command.index("--find-links") + 1] == str(tmp_path / "wheels")
    assert not any(arg.startswith("torch") for arg in command)


def test_installs_and_bundles_take_the_locked_cuda_set_but_torch_s_own_wheels():
    """What the first GPU run installs is what the image and the tests ran: constraints/cuda.txt, less torch and
    the wheels torch brings (the machine's torch keeps its own)."""
    locked = [line for line in gpu_check.LOCK.read_text().splitlines() if line and not line.startswith("#")]
    constraints = gpu_check.locked_constraints(None).splitlines()
    assert constraints == [line for line in locked if not line.startswith(("torch==", "triton==", "nvidia-"))]
    assert any(c.startswith("transformers==") for c in constraints) and any(c.startswith("trl==") for c in constraints)


def test_the_requirements_keep_pyproject_s_ranges():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {r.split(">")[0].split("=")[0].split("<")[0].split("[")[0]: r for r in
                [*project["dependencies"], *(r for extra in project["optional-dependencies"].values() for r in extra)]}
    for requirement in gpu_check.REQUIREMENTS.values():
        name = requirement.split(">")[0].split("=")[0].split("<")[0]
        if name in declared:
            assert requirement == declared[name].split(";")[0].split("#")[0].strip(), (requirement, declared[name])


@pytest.mark.slow
def test_missing_packages_come_from_the_bundle_and_torch_stays(tmp_path):
    """A Python that sees the machine's torch but lacks a package: the runner installs it from the bundle with
    no index, and torch is the same afterwards."""
    probe = tmp_path / "probe"
    (probe / "cispo_gpucheck_probe").mkdir(parents=True)
    (probe / "cispo_gpucheck_probe" / "__init__.py").write_text("VALUE = 42\n")
    (probe / "pyproject.toml").write_text('[build-system]\nrequires = ["setuptools"]\nbuild-backend = '
                                          '"setuptools.build_meta"\n[project]\nname = "cispo-gpucheck-probe"\n'
                                          'version = "1.0"\n')
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(wheels), str(probe)], check=True, capture_output=True, timeout=300)
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    # The "machine's" packages (torch, pip, ...): this environment's site-packages, seen through a .pth file;
    # what the runner installs goes into the new environment's own site-packages.
    site = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (Path(site) / "machine.pth").write_text(str(Path(torch.__file__).resolve().parents[1]) + "\n")
    script = ("import sys; sys.path.insert(0, sys.argv[1]); from bench import gpu_check as g; "
              "g.REQUIREMENTS = {'torch': 'torch', 'cispo_gpucheck_probe': 'cispo-gpucheck-probe'}; "
              "import torch; before = torch.__version__; "
              "print('installed', g.install_missing(__import__('pathlib').Path(sys.argv[2]), print)); "
              "import importlib, cispo_gpucheck_probe; assert cispo_gpucheck_probe.VALUE == 42; "
              "import subprocess; after = subprocess.run([sys.executable, '-c', 'import torch; "
              "print(torch.__version__)'], capture_output=True, text=True).stdout.strip(); "
              "assert after == before, (before, after); print('torch', after)")
    pip_env = {**os.environ, "PYTHONPATH": ""}
    out = subprocess.run([str(python), "-c", script, str(ROOT), str(wheels)], capture_output=True, text=True,
                         timeout=600, env=pip_env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "installed ['cispo-gpucheck-probe']" in out.stdout and f"torch {torch.__version__}" in out.stdout
