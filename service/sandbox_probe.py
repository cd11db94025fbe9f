"""Can this host contain untrusted code? Probed once per process, shared by the worker and /readyz.

The sandbox itself is worker/sandbox.py; this module holds what both sides
need without importing worker/ or torch: the probe, the launcher's command
line and the interpreter the sandbox runs. The probe does not trust flags or
kernel versions: it starts a real sandbox through the real launcher
(service/_sandbox_launch.py) and checks from inside that the user code runs
as the sandbox uid, in its own pid namespace, with no network and nothing
writable but its directory.

Levels: "namespaces" (all of that works) or "none" (user code is refused).
"""

from __future__ import annotations

import errno
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

LAUNCHER = Path(__file__).with_name("_sandbox_launch.py")
UNSHARE_FLAGS = ("--net", "--pid", "--fork", "--mount-proc", "--ipc", "--kill-child")
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
SYSTEM_SEARCH = "/usr/sbin:/usr/bin:/sbin:/bin"
PROBE_TIMEOUT_S = 20.0

# Runs inside the trial sandbox as the sandbox uid; prints what it could and could not do.
_CHECK = r"""
import errno, json, os, socket
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
open("probe-inside", "w").close()
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


def sandbox_gid(uid: int) -> int:
    """The uid's primary group (nogroup for nobody), or the same number where the uid has no entry."""
    try:
        return pwd.getpwuid(uid).pw_gid
    except KeyError:
        return uid


@lru_cache(maxsize=None)
def probe(uid: int = 65534) -> Probe:
    """What this host allows for user code run as `uid`; cached for the life of the process."""
    if not sys.platform.startswith("linux"):
        return Probe("none", "not Linux")
    if uid == 0:
        return Probe("none", "the sandbox uid must not be 0")
    if os.geteuid() != 0:
        return Probe("none", "the worker is not root: it can neither create the namespaces nor switch the "
                             "user code to an unprivileged uid")
    if shutil.which("unshare", path=SYSTEM_SEARCH) is None:
        return Probe("none", "unshare (util-linux) is not installed")
    workdir = Path(tempfile.mkdtemp(prefix="cispo-probe-"))
    try:
        os.chown(workdir, uid, sandbox_gid(uid))
        config = {"uid": uid, "gid": sandbox_gid(uid), "workdir": str(workdir), "ro": read_only_paths(),
                  "rlimits": {"NPROC": 64, "CORE": 0}, "cgroup": None, "status_fd": None}
        argv = launch_argv(config, [sandbox_python(), "-I", "-S", "-B", "-c", _CHECK])
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(workdir), "TMPDIR": str(workdir)}
        run = subprocess.run(argv, capture_output=True, env=env, cwd="/", timeout=PROBE_TIMEOUT_S,
                             start_new_session=True)
        if run.returncode != 0:
            detail = run.stderr.decode(errors="replace").strip().splitlines()
            return Probe("none", f"the trial sandbox failed (exit {run.returncode}): {detail[-1] if detail else ''}")
        found = json.loads(run.stdout.decode().strip().splitlines()[-1])
        expected = {"uid": (uid,), "pid": (2,), "loopback": (errno.ENETUNREACH,),
                    "write_outside": (errno.EROFS, errno.EACCES)}
        wrong = {k: found.get(k) for k, ok in expected.items() if found.get(k) not in ok}
        if wrong or not (workdir / "probe-inside").is_file():
            return Probe("none", f"the trial sandbox is not contained: {wrong or 'workdir not writable'}")
        return Probe("namespaces", "")
    except (OSError, ValueError, subprocess.SubprocessError) as e:
        return Probe("none", f"the trial sandbox failed: {type(e).__name__}: {e}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def effective_level(sandbox: str = "auto", uid: int = 65534) -> str:
    """The level user code gets under the settings' `sandbox` mode: "none" when it is "off"."""
    return "none" if sandbox == "off" else probe(uid).level
