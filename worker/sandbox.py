"""Run untrusted code contained: the generic sandbox (no reward or environment knowledge).

    proc = spawn(python_argv(script), workdir=new_workdir("cispo-env-"), limits=Limits())
    ...talk to it over proc.stdin / proc.stdout...
    kill(proc)  # ends everything it started, verifies that, removes nothing (the caller owns workdir)

What a spawned process gets (level "namespaces"; see service/_sandbox_launch.py):

- its own pid namespace, under a root-owned init that reaps orphans: killing
  that init kills every descendant, setsid() daemons included;
- its own network namespace with no interface up: nothing is reachable,
  not the internet, not the host's loopback (Redis, PostgreSQL,
  torch.distributed stores) and, with no /run or /tmp, no Unix sockets;
- a new root: the system paths and the interpreter's prefix read-only, a
  minimal /dev (no GPU nodes), its own /proc, and `workdir`, a 0700 directory
  it owns and the only place it can write; the rest of the host (the
  service's database and settings, job directories, /tmp) is not there;
- an unprivileged uid/gid (settings.sandbox_uid, default nobody) with no
  capabilities, no supplementary groups and no_new_privs;
- rlimits: address space, file size, open files, processes (RLIMIT_NPROC, per
  uid; plus a per-sandbox pids cgroup where cgroup v1 `pids` is writable),
  optionally CPU seconds, no core dumps;
- an allow-listed environment (PATH, LANG, PYTHONHASHSEED, HOME=TMPDIR=workdir)
  and no file descriptors but stdin, stdout (pipes) and stderr.

Wall-clock limits are the caller's: wait on the pipes with a deadline, then kill().
When the host cannot do this (sandbox_level() == "none") or settings.sandbox is
"off", spawn() refuses: there is no weaker fallback.

No preexec_fn anywhere (unsafe in the threaded trainer): everything runs in
the launcher, after exec.

Not guaranteed: there is no seccomp filter, so the kernel's whole syscall
surface is reachable (user code may create nested user namespaces where the
host allows unprivileged ones; they have no host network or files either).
RLIMIT_NPROC counts per uid, and all sandboxes share the sandbox uid, so a
fork bomb in one can make another's forks (or start) fail until it is
killed; the pids cgroup is the per-sandbox bound. There is no memory or CPU
cgroup: RLIMIT_AS bounds each process, not a sandbox's sum. World-readable
files under the read-only paths (/usr, /etc, ...) are readable. If the
parent process is SIGKILLed its sandboxes die (the launcher watches its
status socket), but their workdirs stay, and their empty cgroups until a
later spawn sweeps them. It needs root: elsewhere the level is "none".
"""

from __future__ import annotations

import logging
import os
import select
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from service.sandbox_probe import effective_level, launch_argv, probe, read_only_paths, sandbox_gid, sandbox_python
from service.settings import get_settings

log = logging.getLogger(__name__)

DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"
START_TIMEOUT_S = 10.0
KILL_TIMEOUT_S = 5.0
STALE_CGROUP_S = 300.0

__all__ = ["Limits", "SandboxError", "SandboxProcess", "SandboxUnavailable", "kill", "members", "new_workdir",
           "python_argv", "require_sandbox", "sandbox_level", "sandbox_python", "spawn"]


class SandboxUnavailable(ValueError):
    """User code is refused: the host cannot isolate it, or the sandbox is turned off. Fails the job."""


class SandboxError(RuntimeError):
    """A sandbox failed to start, or (never expected) a process of it outlived kill()."""


@dataclass(frozen=True)
class Limits:
    cpu_s: int | None = None  # hard RLIMIT_CPU; None lets a long-lived child budget its own (soft) CPU
    address_space_bytes: int = 1 << 30
    file_size_bytes: int = 16 << 20
    open_files: int = 64
    max_processes: int = 64  # per uid (RLIMIT_NPROC) and, where possible, per sandbox (pids cgroup)

    def rlimits(self) -> dict[str, int]:
        limits = {"AS": self.address_space_bytes, "FSIZE": self.file_size_bytes, "NOFILE": self.open_files,
                  "NPROC": self.max_processes, "CORE": 0}
        if self.cpu_s is not None:
            limits["CPU"] = int(self.cpu_s)
        return limits


class SandboxProcess(subprocess.Popen):
    """The `unshare` process that holds a sandbox; .stdin/.stdout reach the target, kill() ends it all."""

    workdir: Path
    pid_ns: str | None = None  # "pid:[inode]" of the sandbox's pid namespace, once it exists
    cgroup: Path | None = None
    status: socket.socket | None = None  # the launcher exits when this closes (e.g. our process dies)

    def members(self) -> dict[int, int]:
        """The sandbox's live processes: {host pid: pid inside the sandbox}."""
        return members(self.pid_ns) if self.pid_ns else {}


def sandbox_level() -> str:
    """"namespaces" or "none" (probed once per process; "none" too when settings.sandbox is "off")."""
    settings = get_settings()
    return effective_level(settings.sandbox, settings.sandbox_uid)


def require_sandbox() -> None:
    """Raise SandboxUnavailable unless user code can be contained here (fail closed)."""
    settings = get_settings()
    if settings.sandbox == "off":
        raise SandboxUnavailable("user Python code is refused: the sandbox is turned off (CISPO_SANDBOX=off)")
    found = probe(settings.sandbox_uid)
    if found.level != "namespaces":
        raise SandboxUnavailable(f"user Python code is refused: this host cannot isolate it (no namespaces): "
                                 f"{found.reason}")


def python_argv(script: Path) -> list[str]:
    """argv running a stdlib-only script in the sandbox's interpreter, isolated (-I -S -B).

    The source goes on the command line, so the sandbox uid needs no access to
    the project's files (they are not in its file system anyway).
    """
    return [sandbox_python(), "-I", "-S", "-B", "-c", Path(script).read_text()]


def new_workdir(prefix: str = "cispo-sandbox-") -> Path:
    """A fresh 0700 directory for one sandbox; spawn() hands it to the sandbox uid. The caller removes it."""
    return Path(tempfile.mkdtemp(prefix=prefix))


def spawn(argv: list[str], *, workdir: Path, limits: Limits, extra_read_only: tuple[str, ...] = (),
          stderr=subprocess.DEVNULL) -> SandboxProcess:
    """Start argv contained (see the module doc), with stdin/stdout pipes; returns once argv has exec'd.

    Raises SandboxUnavailable (fail closed) or SandboxError (it did not start).
    """
    require_sandbox()
    settings = get_settings()
    uid, gid = settings.sandbox_uid, sandbox_gid(settings.sandbox_uid)
    workdir = Path(workdir)
    workdir.mkdir(mode=0o700, exist_ok=True)
    os.chown(workdir, uid, gid)
    os.chmod(workdir, 0o700)
    cgroup = _new_pids_cgroup(limits.max_processes)
    ours, theirs = socket.socketpair()
    config = {"uid": uid, "gid": gid, "workdir": str(workdir), "ro": read_only_paths(extra_read_only),
              "rlimits": limits.rlimits(), "cgroup": str(cgroup) if cgroup else None, "status_fd": theirs.fileno()}
    env = {"PATH": DEFAULT_PATH, "LANG": "C.UTF-8", "PYTHONHASHSEED": "0", "HOME": str(workdir),
           "TMPDIR": str(workdir)}
    try:
        proc = SandboxProcess(launch_argv(config, argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=stderr, cwd="/", env=env, close_fds=True, pass_fds=(theirs.fileno(),),
                              start_new_session=True)
    except BaseException:
        ours.close()
        _remove_cgroup(cgroup)
        raise
    finally:
        theirs.close()
    proc.workdir, proc.cgroup, proc.status = workdir, cgroup, ours
    try:
        answer = _read_status(ours, time.monotonic() + START_TIMEOUT_S)
    except OSError as e:
        answer = f"error: {e}"
    word, _, pid_ns = answer.partition(" ")
    if word != "ok" or not pid_ns.startswith("pid:["):
        kill(proc)
        raise SandboxError(f"the sandbox did not start: {answer or 'no answer from its launcher'}")
    proc.pid_ns = pid_ns  # nsfs names a namespace the same from inside and out
    return proc


def kill(proc: SandboxProcess) -> None:
    """SIGKILL everything the sandbox started, reap it, verify no survivor, drop its cgroup. Idempotent.

    Killing the pid namespace's init makes the kernel kill every other process
    in it; the group kill covers a launcher that had not created it yet.
    """
    if proc.returncode is None:
        if proc.pid_ns:
            _kill_init(proc.pid_ns)
            try:
                proc.wait(timeout=KILL_TIMEOUT_S)  # unshare reaps its init, then exits the same way
            except subprocess.TimeoutExpired:
                pass
        if proc.returncode is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # still ours to signal: we have not reaped it
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
    for f in (proc.stdin, proc.stdout, proc.stderr, proc.status):
        try:
            if f is not None:
                f.close()
        except OSError:
            pass
    survivors = _wait_empty(proc.pid_ns, time.monotonic() + KILL_TIMEOUT_S) if proc.pid_ns else {}
    if not _remove_cgroup(proc.cgroup) and proc.cgroup is not None:
        log.warning("sandbox cgroup %s could not be removed", proc.cgroup)
    proc.cgroup = None
    if survivors:
        raise SandboxError(f"sandbox processes survived the kill: {sorted(survivors)}")


def exit_status(returncode: int | None) -> int | None:
    """The target's status as Popen reports one: -N for signal N (the launcher exits 128+N)."""
    if returncode is not None and 128 < returncode <= 128 + 64:
        return 128 - returncode
    return returncode


def members(pid_ns: str) -> dict[int, int]:
    """Live (non-zombie) processes of a pid namespace: {host pid: pid inside it}."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.readlink(f"/proc/{entry}/ns/pid") != pid_ns:
                continue
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:  # gone meanwhile, or a zombie without namespaces
            continue
        fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
        if fields.get("State", "").startswith(("Z", "X")):
            continue
        found[int(entry)] = int(fields.get("NSpid", entry).split()[-1])
    return found


# -- internals ----------------------------------------------------------------


def _read_status(sock: socket.socket, deadline: float) -> str:
    data = b""
    while not data.endswith(b"\n"):
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([sock], [], [], remaining)[0]:
            return "error: the launcher did not answer in time"
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return data.decode(errors="replace").strip()


def _kill_init(pid_ns: str) -> None:
    for host_pid, ns_pid in members(pid_ns).items():
        if ns_pid != 1:
            continue
        try:  # a pidfd, so a pid reused since members() read it is never signalled
            fd = os.pidfd_open(host_pid)
        except ProcessLookupError:
            return
        try:
            if os.readlink(f"/proc/{host_pid}/ns/pid") == pid_ns:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass
        finally:
            os.close(fd)


def _wait_empty(pid_ns: str, deadline: float) -> dict[int, int]:
    while True:
        left = members(pid_ns)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.01)


def _pids_cgroup_root() -> Path | None:
    """This process's cgroup v1 `pids` directory, if it is there and writable (cgroup v2 is not used)."""
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if "pids" in controllers.split(","):
                root = Path("/sys/fs/cgroup/pids") / path.lstrip("/")
                return root if os.access(root, os.W_OK) else None
    except (OSError, ValueError):
        pass
    return None


def _new_pids_cgroup(max_processes: int) -> Path | None:
    """A per-sandbox pids cgroup (max_processes + its init), or None where the host offers none."""
    root = _pids_cgroup_root()
    if root is None:
        return None
    _sweep_stale_cgroups(root)
    path = root / f"cispo-sandbox-{uuid.uuid4().hex}"
    try:
        path.mkdir()
        (path / "pids.max").write_text(str(max_processes + 1))
        return path
    except OSError:
        _remove_cgroup(path)
        return None


def _sweep_stale_cgroups(root: Path) -> None:
    """Remove sandbox cgroups a crashed worker left behind: rmdir fails on any that still has a task.

    Only old ones: a young empty one may be a sandbox another thread is starting.
    """
    for stale in root.glob("cispo-sandbox-*"):
        try:
            if time.time() - stale.stat().st_mtime > STALE_CGROUP_S:
                stale.rmdir()
        except OSError:
            pass


def _remove_cgroup(path: Path | None) -> bool:
    if path is None:
        return True
    for _ in range(100):  # rmdir fails while a just-killed task has not left it
        try:
            path.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:
            time.sleep(0.01)
    return False

