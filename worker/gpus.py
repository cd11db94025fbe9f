"""Which GPU a worker's pool child uses: with several children (one per GPU), child i sees only GPU i.

CUDA reads CUDA_VISIBLE_DEVICES (CUDA's own variable, not one of our settings) when it initializes. Torch
loads inside a job, in the pool child, never in the worker's main process, so setting the variable in the
child's init hook, right after the fork, is enough. A child that replaces another (a fresh child per job)
takes over its slot, hence its GPU.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import MutableMapping
from functools import lru_cache


def gpu_slots(environ: MutableMapping[str, str] = os.environ) -> tuple[str, ...] | None:
    """The GPUs this worker may share out, as CUDA_VISIBLE_DEVICES entries: the variable's own list when set,
    else every GPU the driver lists; None when neither says (no GPU or no driver: jobs run on the CPU)."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return tuple(d.strip() for d in visible.split(",") if d.strip())
    return _driver_gpus()


@lru_cache(maxsize=1)  # asked once in the main process; pool children inherit the answer
def _driver_gpus() -> tuple[str, ...] | None:
    # UUIDs, not indices: nvidia-smi's order is the PCI bus order, CUDA's default one is not.
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    uuids = tuple(line.strip() for line in out.stdout.splitlines() if line.strip())
    return uuids if out.returncode == 0 and uuids else None


def concurrency_error(concurrency: int, pool: str, environ: MutableMapping[str, str] = os.environ) -> str | None:
    """Why the worker cannot run `concurrency` jobs at once (None if it can)."""
    if concurrency > 1 and pool == "solo":
        return f"--concurrency {concurrency} needs --pool prefork: the solo pool runs one job at a time"
    slots = gpu_slots(environ)
    if concurrency > 1 and slots is not None and concurrency > len(slots):
        return (f"--concurrency {concurrency} runs one job per GPU, but this worker sees {len(slots)} GPU(s) "
                f"({','.join(slots) or 'CUDA_VISIBLE_DEVICES is empty'})")
    return None


def pin_gpu(index: int, concurrency: int, environ: MutableMapping[str, str] = os.environ) -> str | None:
    """In pool child `index` of `concurrency`, make only its own GPU visible; returns it (None: unchanged)."""
    slots = gpu_slots(environ)
    if concurrency <= 1 or not slots:  # one job has every GPU (a multi-GPU job needs them); CPU workers share none
        return None
    environ["CUDA_VISIBLE_DEVICES"] = slots[index % len(slots)]
    return environ["CUDA_VISIBLE_DEVICES"]
