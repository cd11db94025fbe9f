"""The first-GPU check: one command, each stage in its own process under its own timeout, all output kept.

    python bench/gpu_check.py                   # a CUDA machine: under 9 minutes on one H200
    python bench/gpu_check.py --smoke           # anywhere, tiny shapes: checks that every stage runs
    python bench/gpu_check.py --wheels DIR      # install what is missing from a wheel bundle only (no network)
    python bench/gpu_check.py --build-wheels DIR --python-version 3.12   # make that bundle beforehand

Self-contained on a bare GPU machine whose Python is not ours: it runs on that
machine's interpreter and its torch, installs only the packages whose modules
are missing, at the locked CUDA set's versions (constraints/cuda.txt; never
torch: pip runs under a constraint that pins the installed torch, and with
--wheels from the bundle alone, which --build-wheels fills with the locked
versions), sets HF_HUB_OFFLINE=1 and
builds every model locally. Stages (bench/gpu_check_stages.py):

  env      versions, the device, a C compiler for Triton
  decode   compiled decode greedy tokens == eager (plain and LoRA), graph breaks, skipped CUDA graphs,
           recompiles across batch 64 -> 13 -> 64, ms/step compiled vs eager
  train    the trainer in bf16, LoRA and full fine-tuning: 2 steps + an eval of another batch size,
           finite loss, peak and retained GPU memory
  bench    bench/gpu_step.py: LoRA and full FT vs TRL, decode ms/step (targets 8x, 4x, 2.7 ms)

Every stage's output goes to OUT/<stage>.log and its figures to OUT/<stage>.json; OUT/summary.json and the
last lines printed sum up. OUT is --out, else $OUT (the device runner's folder), else ./gpu_check_out.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGES = {"env": 30, "decode": 170, "train": 110, "bench": 210}  # seconds each on a GPU: under 9 minutes
SMOKE_TIMEOUT = 600  # per stage on a busy CPU
# module -> requirement: what the stages import beyond the standard library and torch (pyproject.toml's bounds)
REQUIREMENTS = {
    "numpy": "numpy>=1.26",
    "yaml": "pyyaml>=6",
    "pydantic": "pydantic>=2.7,<3",
    "pydantic_settings": "pydantic-settings>=2.3,<3",
    "boto3": "boto3>=1.34",
    "httpx": "httpx>=0.27",
    "tokenizers": "tokenizers>=0.20",
    "safetensors": "safetensors>=0.4",
    "transformers": "transformers>=5.19,<5.21",
    "accelerate": "accelerate>=1.0",
    "peft": "peft>=0.21,<0.22",
    "datasets": "datasets",
    "trl": "trl>=1.16,<1.17",
}
LOCK = ROOT / "constraints" / "cuda.txt"  # the locked CUDA set (`make lock`)
TORCH_FAMILY = ("torch==", "triton==", "nvidia-")  # torch and the wheels it brings: the machine's own
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}


def missing_requirements(find=importlib.util.find_spec) -> list[str]:
    """The requirements whose module this interpreter cannot import."""
    return [req for module, req in REQUIREMENTS.items() if find(module) is None]


def locked_constraints(torch_version: str | None) -> str:
    """The locked CUDA set (constraints/cuda.txt, the versions the image and the tests ran), less torch and what
    torch itself depends on (triton, the nvidia-* wheels: the machine's torch brings its own), plus the installed
    torch where given."""
    lines = [line for line in LOCK.read_text().splitlines()
             if line and not line.startswith("#") and not line.startswith(TORCH_FAMILY)]
    return "\n".join(lines + ([f"torch=={torch_version}"] if torch_version else [])) + "\n"


def pip_install_command(missing: list[str], torch_version: str, constraints: Path,
                        wheels: Path | None) -> list[str]:
    """pip for the missing requirements at the locked CUDA set's versions, with the installed torch pinned (so
    nothing replaces it) and, given a wheel bundle, nothing but the bundle."""
    constraints.write_text(locked_constraints(torch_version))
    command = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-c", str(constraints)]
    if wheels is not None:
        command += ["--no-index", "--find-links", str(wheels)]
    return command + missing


def install_missing(wheels: Path | None, log) -> list[str]:
    """Install what is missing; the requirements installed (empty when all were there)."""
    if importlib.util.find_spec("torch") is None:
        raise SystemExit("torch is not installed for this Python: the check uses the machine's torch, never its own")
    missing = missing_requirements()
    if not missing:
        log("all requirements present; nothing installed")
        return []
    import torch

    if f"torch=={torch.__version__.split('+')[0]}" not in LOCK.read_text().splitlines():
        log(f"torch {torch.__version__} here, not the locked set's: the other packages stay at the lock's versions")
    with tempfile.TemporaryDirectory() as tmp:
        command = pip_install_command(missing, torch.__version__, Path(tmp) / "constraints.txt", wheels)
        log("installing: " + " ".join(command))
        subprocess.run(command, check=True)
    importlib.invalidate_caches()
    still = missing_requirements()
    if still:
        raise SystemExit(f"still missing after pip: {still}")
    return missing


def build_wheels(out: Path, python_version: str) -> None:
    """Download wheels of every requirement but torch (and of their dependencies) for `python_version` on
    manylinux x86_64, to carry to a machine without network. torch is left out: the GPU machine has its own."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        constraints = Path(tmp) / "constraints.txt"
        constraints.write_text(locked_constraints(None))  # the locked versions; torch's own come with the machine
        subprocess.run([sys.executable, "-m", "pip", "download", "--dest", str(out), "--only-binary=:all:",
                        "-c", str(constraints), "--python-version", python_version,
                        "--platform", "manylinux2014_x86_64", "--platform", "manylinux_2_28_x86_64",
                        *REQUIREMENTS.values()], check=True)
    for torch_wheel in [*out.glob("torch-*.whl"), *out.glob("nvidia_*.whl"), *out.glob("triton-*.whl")]:
        torch_wheel.unlink()  # dependencies of torch; the machine's torch brings its own
    print(f"{len(list(out.glob('*.whl')))} wheels in {out}")


def stage_command(name: str, *, smoke: bool, out: Path) -> list[str]:
    command = [sys.executable, "-u", str(ROOT / "bench" / "gpu_check_stages.py"), name, "--out", str(out)]
    return command + (["--smoke"] if smoke else [])


def run_stage(name: str, *, smoke: bool, out: Path, timeout: float) -> dict:
    """One stage in its own process group, its output teed to OUT/<name>.log; a timer kills the group at the
    timeout (also when the stage hangs without printing)."""
    command = stage_command(name, smoke=smoke, out=out)
    env = {**os.environ, **OFFLINE, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    started = time.perf_counter()
    killed = threading.Event()
    with open(out / f"{name}.log", "w") as log:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)

        def kill() -> None:
            killed.set()
            os.killpg(proc.pid, signal.SIGKILL)

        timer = threading.Timer(timeout, kill)
        timer.start()
        try:
            for line in proc.stdout:
                sys.stdout.write(f"[{name}] {line}")
                log.write(line)
                log.flush()
            proc.wait()
        finally:
            timer.cancel()
        if killed.is_set():
            log.write(f"\n[gpu_check] stage {name} killed after {timeout:.0f} s\n")
    figures = out / f"{name}.json"
    result = json.loads(figures.read_text()) if figures.exists() else {}
    status = "timeout" if killed.is_set() else ("ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})")
    return {"stage": name, "status": status, "seconds": round(time.perf_counter() - started, 1), **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on any device: checks every stage runs")
    parser.add_argument("--out", type=Path, default=None, help="where logs and figures go")
    parser.add_argument("--wheels", type=Path, default=None, help="install missing packages from this bundle only")
    parser.add_argument("--stages", default=",".join(STAGES), help="comma-separated subset of " + ",".join(STAGES))
    parser.add_argument("--build-wheels", type=Path, default=None, help="download the bundle here and exit")
    parser.add_argument("--python-version", default="3.12", help="with --build-wheels: the target's Python")
    args = parser.parse_args()
    if args.build_wheels is not None:
        build_wheels(args.build_wheels, args.python_version)
        return
    out = args.out or Path(os.environ.get("OUT") or "gpu_check_out")
    out.mkdir(parents=True, exist_ok=True)
    os.environ.update(OFFLINE)
    started = time.perf_counter()
    installed = install_missing(args.wheels, print)
    results = []
    for name in args.stages.split(","):
        timeout = SMOKE_TIMEOUT if args.smoke else STAGES[name]
        results.append(run_stage(name, smoke=args.smoke, out=out, timeout=timeout))
    summary = {"smoke": args.smoke, "installed": installed, "seconds": round(time.perf_counter() - started, 1),
               "stages": results}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print("\n== gpu_check summary ==")
    for r in results:
        figures = {k: v for k, v in r.items() if k not in ("stage", "status", "seconds")}
        print(f"{r['stage']:<7} {r['status']:<22} {r['seconds']:6.1f} s  {json.dumps(figures)}")
    print(f"total {summary['seconds']:.0f} s; logs and figures in {out}")
    sys.exit(0 if all(r["status"] == "ok" for r in results) else 1)


if __name__ == "__main__":
    main()
