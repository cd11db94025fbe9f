"""One cgroup per sandbox: a memory and a pids limit that cover every process in it, together.

Per-process rlimits cannot bound a sandbox's sum (N processes of 1 GiB each,
or a fork bomb under a shared uid); a cgroup does, and its tmpfs pages (the
sandbox's working directory) are charged to it too. The launcher
(service/sandbox/launch.py) moves itself into `paths` before anything forks.

Where it goes, checked in this order:
- cgroup v2, where this process's cgroup offers the memory and pids
  controllers: the sandboxes are children of that cgroup. The "no internal
  processes" rule means a non-root cgroup with processes cannot hand
  controllers to children, so its processes move to a leaf child first
  (WORKER_LEAF), as container init systems do (under systemd that needs
  Delegate=yes on the worker's unit); the root cgroup needs no such move;
- cgroup v1, where this process's `memory` and `pids` directories are writable:
  a directory in each.
Elsewhere new_cgroup() raises CgroupUnavailable and the sandbox fails closed.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

PREFIX = "cispo-sandbox-"
WORKER_LEAF = "cispo-worker"
STALE_S = 300.0
CONTROLLERS = ("memory", "pids")


class CgroupUnavailable(RuntimeError):
    """This host gives this process no writable cgroup with the memory and pids controllers."""


@dataclass
class SandboxCgroup:
    version: str  # "v1" | "v2"
    paths: list[Path]  # v2: one directory; v1: the memory one and the pids one

    def memory_peak(self) -> int | None:
        """The most memory the sandbox held at once, in bytes (for tests and benchmarks)."""
        name = "memory.peak" if self.version == "v2" else "memory.max_usage_in_bytes"
        for path in self.paths:
            try:
                return int((path / name).read_text())
            except (OSError, ValueError):
                continue
        return None


def _mounts() -> list[tuple[str, str, list[str]]]:
    """(mount point, fs type, options) of every cgroup file system."""
    found = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 4 and fields[2] in ("cgroup", "cgroup2"):
            found.append((fields[1].replace("\\040", " "), fields[2], fields[3].split(",")))
    return found


def _own_paths() -> dict[str, str]:
    """This process's cgroup per hierarchy: {"": v2 path, controller or name=...: v1 path}."""
    found = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            found[c] = path
    return found


_v2_lock = threading.Lock()


def _v2_parent() -> Path | None:
    own = _own_paths().get("")
    mount = next((m for m, fs, _ in _mounts() if fs == "cgroup2"), None)
    if own is None or mount is None:
        return None
    base = Path(mount) / own.lstrip("/")
    if base.name == WORKER_LEAF:  # this process (or a sibling worker) already moved into the leaf
        base = base.parent
    try:
        if set(CONTROLLERS) <= set((base / "cgroup.subtree_control").read_text().split()):
            return base
        if not set(CONTROLLERS) <= set((base / "cgroup.controllers").read_text().split()):
            return None
        if not os.access(base / "cgroup.subtree_control", os.W_OK):
            return None
        with _v2_lock:
            if base != Path(mount):  # the root cgroup is exempt from the rule: nothing has to move
                leaf = base / WORKER_LEAF
                leaf.mkdir(exist_ok=True)
                for pid in (base / "cgroup.procs").read_text().split():
                    try:
                        (leaf / "cgroup.procs").write_text(pid)
                    except OSError:  # gone meanwhile
                        pass
            (base / "cgroup.subtree_control").write_text(" ".join("+" + c for c in CONTROLLERS))
        return base
    except OSError:
        return None


def _v1_parents() -> list[Path] | None:
    own = _own_paths()
    parents = []
    for controller in CONTROLLERS:
        mount = next((m for m, fs, opts in _mounts() if fs == "cgroup" and controller in opts), None)
        if mount is None or controller not in own:
            return None
        path = Path(mount) / own[controller].lstrip("/")
        if not os.access(path, os.W_OK):
            return None
        parents.append(path)
    return parents


def parents() -> tuple[str, list[Path]]:
    """("v2", [its parent]) or ("v1", [memory parent, pids parent]) of new sandbox cgroups, or ("", [])."""
    v2 = _v2_parent()
    if v2 is not None:
        return "v2", [v2]
    v1 = _v1_parents()
    return ("v1", v1) if v1 is not None else ("", [])


def new_cgroup(memory_bytes: int, max_processes: int) -> SandboxCgroup:
    """A fresh cgroup holding at most `memory_bytes` (no swap) and `max_processes` processes."""
    name = PREFIX + uuid.uuid4().hex
    version, where = parents()
    if version == "v2":
        plan = [(where[0] / name, {"memory.max": memory_bytes, "memory.swap.max": 0, "pids.max": max_processes})]
    else:
        if not where:
            raise CgroupUnavailable("no writable cgroup with the memory and pids controllers (v2, or v1 "
                                    "memory and pids hierarchies)")
        memory, pids = where
        # memsw (memory + swap) exists only with swap accounting; swappiness 0 keeps it from swapping without it.
        plan = [(memory / name, {"memory.limit_in_bytes": memory_bytes, "memory.memsw.limit_in_bytes": memory_bytes,
                                 "memory.swappiness": 0}),
                (pids / name, {"pids.max": max_processes})]
    cgroup = SandboxCgroup(version, [path for path, _ in plan])
    for path in cgroup.paths:
        _sweep_stale(path.parent)
    try:
        for path, limits in plan:
            path.mkdir()
            for file, value in limits.items():
                if _is_swap(file) and not (path / file).exists():
                    continue  # there only where swap accounting is on; without it there is no swap to bound
                (path / file).write_text(str(value))  # a missing limit file fails: it would bound nothing
    except OSError as e:
        remove_cgroup(cgroup)
        raise CgroupUnavailable(f"cannot set up the sandbox cgroup: {e}") from None
    return cgroup


def _is_swap(file: str) -> bool:
    return "swap" in file or "memsw" in file


def remove_cgroup(cgroup: SandboxCgroup | None) -> bool:
    """rmdir every directory of the cgroup (retrying while just-killed tasks leave); True when all are gone."""
    if cgroup is None:
        return True
    gone = True
    for path in cgroup.paths:
        for _ in range(100):
            try:
                path.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.01)
        else:
            gone = False
    return gone


def _sweep_stale(parent: Path) -> None:
    """Remove sandbox cgroups a crashed worker left behind: rmdir fails on any that still has a task.

    Only old ones: a young empty one may be a sandbox another thread is starting.
    """
    for stale in parent.glob(PREFIX + "*"):
        try:
            if time.time() - stale.stat().st_mtime > STALE_S:
                stale.rmdir()
        except OSError:
            pass
