"""Can this host contain untrusted code? Probed through the real launcher; shared by the worker and /readyz.

The sandbox itself is service/sandbox/spawn.py; this module holds what both sides
need without importing worker/ or torch: the probe, the launcher's command
line and configuration, and the interpreter the sandbox runs. The probe does
not trust flags or kernel versions: it starts a real sandbox (a leased uid,
its own cgroup, the launcher's namespaces, new root, tmpfs and seccomp
filter) and checks from inside that the user code runs as that uid, in its
own pid namespace and cgroup, with no network, nothing writable but its
capped directory, and no way to create namespaces.

Levels: "namespaces" (every layer works) or "none" (user code is refused).
A result is kept POSITIVE_TTL_S, a failure only NEGATIVE_TTL_S: a transient
failure (a full uid range, a slow host) does not disable user code until a
restart, and a host that loses a layer is noticed.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from service.sandbox.cgroup import CgroupUnavailable, new_cgroup, remove_cgroup
from service.sandbox.uids import NoUidFree, lease_uid
from service.settings import get_settings

LAUNCHER = Path(__file__).with_name("launch.py")
UNSHARE_FLAGS = ("--net", "--pid", "--fork", "--mount-proc", "--ipc", "--kill-child")
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
SYSTEM_SEARCH = "/usr/sbin:/usr/bin:/sbin:/bin"
PROBE_TIMEOUT_S = 20.0
POSITIVE_TTL_S = 600.0
NEGATIVE_TTL_S = 30.0
PROBE_WORKDIR_BYTES = 1 << 20

# Runs inside the trial sandbox as the sandbox uid; prints what it could and could not do.
_CHECK = r"""
import ctypes, errno, json, os, socket
found = {"uid": os.getuid(), "gid": os.getgid(), "pid": os.getpid()}
try:
    socket.create_connection(("127.0.0.1", 9), timeout=2).close()
    found["loopback"] = "open"
except OSError as e:
    found["loopback"] = e.errno
try:
    open("/probe-outside", "w").close()
    found["write_outside"] = "ok"
except OSError as e:
    found["write_outside"] = e.errno
libc = ctypes.CDLL(None, use_errno=True)
found["unshare"] = ctypes.get_errno() if libc.unshare(0x10000000) != 0 else "ok"  # CLONE_NEWUSER
vfs = os.statvfs(".")
found["workdir_bytes"] = vfs.f_blocks * vfs.f_frsize
found["cgroup"] = "cispo-sandbox-" in open("/proc/self/cgroup").read()
print(json.dumps(found))
"""


@dataclass(frozen=True)
class Probe:
    level: str  # "namespaces" | "none"
    reason: str  # why "none"; empty otherwise


def sandbox_python() -> str:
    """The interpreter for sandboxed Python: the real base interpreter (no venv, no site packages).

    Its prefix is bound read-only into the sandbox (see read_only_paths), so it
    runs even where the prefix lives under a directory the sandbox uid cannot
    traverse (pyenv under /root, a private venv).
    """
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def read_only_paths(extra: tuple[str, ...] = ()) -> list[str]:
    """What the sandbox sees of the host, read-only: the system, this interpreter's prefix, and `extra`."""
    paths = [p for p in SYSTEM_PATHS if os.path.lexists(p)]
    for p in (os.path.realpath(sys.base_prefix), *extra):
        if not any(p == q or p.startswith(q.rstrip("/") + "/") for q in paths):
            paths.append(p)
    return paths


def launch_argv(config: dict, argv: list[str]) -> list[str]:
    """The command that starts `argv` in fresh namespaces through the launcher (run as root)."""
    unshare = shutil.which("unshare", path=SYSTEM_SEARCH)
    if unshare is None:
        raise FileNotFoundError("unshare (util-linux) is not installed")
    return [unshare, *UNSHARE_FLAGS, "--", sandbox_python(), "-I", "-S", "-B", str(LAUNCHER),
            json.dumps(config), "--", *argv]


def launch_config(*, uid: int, workdir: str, workdir_bytes: int, workdir_inodes: int, rlimits: dict[str, int],
                  cgroups: list[str], status_fd: int | None, extra_read_only: tuple[str, ...] = ()) -> dict:
    """The launcher's CONFIG_JSON (see service/sandbox/launch.py); gid = uid."""
    return {"uid": uid, "gid": uid, "workdir": workdir, "workdir_bytes": workdir_bytes,
            "workdir_inodes": workdir_inodes, "ro": read_only_paths(extra_read_only), "rlimits": rlimits,
            "cgroups": cgroups, "status_fd": status_fd}


def _default_range() -> tuple[int, int]:
    settings = get_settings()
    return settings.sandbox_uid, settings.sandbox_uid_count


_cache: dict[tuple[int, int], tuple[Probe, float]] = {}
_cache_lock = threading.Lock()


def probe(first_uid: int | None = None, count: int | None = None) -> Probe:
    """What this host allows for user code run as uids [first_uid, first_uid + count) (default: the settings').

    Cached: a success for POSITIVE_TTL_S, a failure for NEGATIVE_TTL_S, then probed again.
    """
    if first_uid is None or count is None:
        first_uid, count = _default_range()
    key = (first_uid, count)
    with _cache_lock:  # one probe at a time; callers meanwhile wait for its answer
        cached = _cache.get(key)
        if cached is not None and time.monotonic() < cached[1]:
            return cached[0]
        found = _probe(first_uid, count)
        _cache[key] = (found, time.monotonic() + (POSITIVE_TTL_S if found.level != "none" else NEGATIVE_TTL_S))
        return found


def forget_probes() -> None:
    """Drop every cached result: the next probe() runs the trial sandbox again."""
    with _cache_lock:
        _cache.clear()


def _probe(first_uid: int, count: int) -> Probe:
    if not sys.platform.startswith("linux"):
        return Probe("none", "not Linux")
    if first_uid < 1:
        return Probe("none", "the sandbox uids must not include 0")
    if os.geteuid() != 0:
        return Probe("none", "the worker is not root: it can neither create the namespaces nor switch the "
                             "user code to an unprivileged uid")
    if shutil.which("unshare", path=SYSTEM_SEARCH) is None:
        return Probe("none", "unshare (util-linux) is not installed")
    workdir = Path(tempfile.mkdtemp(prefix="cispo-probe-"))
    lease = cgroup = None
    try:
        lease = lease_uid(first_uid, count)
        cgroup = new_cgroup(256 << 20, 16)
        config = launch_config(uid=lease.uid, workdir=str(workdir), workdir_bytes=PROBE_WORKDIR_BYTES,
                               workdir_inodes=64, rlimits={"NPROC": 16, "CORE": 0},
                               cgroups=[str(p) for p in cgroup.paths], status_fd=None)
        argv = launch_argv(config, [sandbox_python(), "-I", "-S", "-B", "-c", _CHECK])
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(workdir), "TMPDIR": str(workdir)}
        run = subprocess.run(argv, capture_output=True, env=env, cwd="/", timeout=PROBE_TIMEOUT_S,
                             start_new_session=True)
        if run.returncode != 0:
            detail = run.stderr.decode(errors="replace").strip().splitlines()
            return Probe("none", f"the trial sandbox failed (exit {run.returncode}): {detail[-1] if detail else ''}")
        found = json.loads(run.stdout.decode().strip().splitlines()[-1])
        expected = {"uid": (lease.uid,), "gid": (lease.uid,), "pid": (2,), "loopback": (errno.ENETUNREACH,),
                    "write_outside": (errno.EROFS, errno.EACCES), "unshare": (errno.EPERM,), "cgroup": (True,)}
        wrong = {k: found.get(k) for k, ok in expected.items() if found.get(k) not in ok}
        if not 0 < found.get("workdir_bytes", 0) <= PROBE_WORKDIR_BYTES:
            wrong["workdir_bytes"] = found.get("workdir_bytes")
        if wrong:
            return Probe("none", f"the trial sandbox is not contained: {wrong}")
        return Probe("namespaces", "")
    except (CgroupUnavailable, NoUidFree) as e:
        return Probe("none", str(e))
    except (OSError, ValueError, subprocess.SubprocessError) as e:
        return Probe("none", f"the trial sandbox failed: {type(e).__name__}: {e}")
    finally:
        remove_cgroup(cgroup)
        if lease is not None:
            lease.release()
        shutil.rmtree(workdir, ignore_errors=True)


def effective_level(sandbox: str = "auto", first_uid: int | None = None, count: int | None = None) -> str:
    """The level user code gets under the settings' `sandbox` mode: "none" when it is "off"."""
    return "none" if sandbox == "off" else probe(first_uid, count).level
