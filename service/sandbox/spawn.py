"""Run untrusted code contained: the generic sandbox (no reward or environment knowledge).

    proc = spawn(python_argv(script), workdir=new_workdir("cispo-env-"), limits=Limits())
    ...talk to it over proc.stdin / proc.stdout...
    kill(proc)  # ends everything it started, verifies that, removes nothing (the caller owns workdir)

What a spawned process gets (level "namespaces"; see service/sandbox/launch.py):

- its own pid namespace, under a root-owned init that reaps orphans: killing
  that init kills every descendant, setsid() daemons included;
- its own network namespace with no interface up: nothing is reachable,
  not the internet, not the host's loopback (Redis, PostgreSQL,
  torch.distributed stores) and, with no /run or /tmp, no Unix sockets;
- a new root: the system paths and the interpreter's prefix read-only, a
  minimal /dev (no GPU nodes, no /dev/shm), its own /proc, and at `workdir`'s
  path a tmpfs of limits.workdir_bytes (and workdir_inodes) that it owns, the
  only place it can write; the rest of the host (the service's database and
  settings, job directories, /tmp) is not there. The host's `workdir` stays
  an empty root-owned placeholder;
- a uid/gid of its own, leased from settings.sandbox_uid[_count] for its
  lifetime (service/sandbox/uids.py): no other live sandbox shares it, so
  RLIMIT_NPROC, keyrings and /proc checks separate tenants; no capabilities,
  no supplementary groups, no_new_privs, a fresh session keyring;
- a seccomp filter denying new namespaces, io_uring, keyctl, ptrace, mounts,
  bpf, perf, userfaultfd, kexec and modules (service/sandbox/launch.py);
- a cgroup of its own (v2, or v1 memory + pids; service/sandbox/cgroup.py)
  bounding the memory (its tmpfs included) and the processes of all of it
  together, plus per-process rlimits: address space, file size, open files,
  processes, optionally CPU seconds, no core dumps;
- an allow-listed environment (PATH, LANG, PYTHONHASHSEED, HOME=TMPDIR=workdir)
  and no file descriptors but stdin, stdout (pipes) and stderr.

Wall-clock limits are the caller's: wait on the pipes with a deadline, then kill().
When the host cannot provide every layer (sandbox_level() == "none"), or
settings.sandbox is "off", spawn() refuses: there is no weaker fallback.

No preexec_fn anywhere (unsafe in the threaded trainer): everything runs in
the launcher, after exec.

Not guaranteed: the filter is a deny list, so the rest of the kernel's
syscall surface is reachable. There is no CPU cgroup limit (a sandbox may use
whole cores until its deadline). World-readable files under the read-only
paths (/usr, /etc, ...) are readable. If the parent process is SIGKILLed its
sandboxes die (the launcher watches its status socket), but their host
placeholders stay, and their empty cgroups until a later spawn sweeps them.
It needs root: elsewhere the level is "none".
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
from dataclasses import dataclass
from pathlib import Path

from service.sandbox.cgroup import CgroupUnavailable, SandboxCgroup, new_cgroup, remove_cgroup
from service.sandbox.probe import effective_level, launch_argv, launch_config, probe, sandbox_python
from service.sandbox.uids import NoUidFree, UidLease, lease_uid
from service.settings import get_settings

log = logging.getLogger(__name__)

DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"
START_TIMEOUT_S = 10.0
KILL_TIMEOUT_S = 5.0

__all__ = ["Limits", "SandboxError", "SandboxProcess", "SandboxUnavailable", "kill", "members", "new_workdir",
           "python_argv", "require_sandbox", "sandbox_level", "sandbox_python", "spawn"]


class SandboxUnavailable(ValueError):
    """User code is refused: the host cannot isolate it, or the sandbox is turned off. Fails the job."""


class SandboxError(RuntimeError):
    """A sandbox failed to start, or (never expected) a process of it outlived kill()."""


@dataclass(frozen=True)
class Limits:
    cpu_s: int | None = None  # hard RLIMIT_CPU; None lets a long-lived child budget its own (soft) CPU
    address_space_bytes: int = 1 << 30  # per process
    memory_bytes: int = 1 << 30  # the whole sandbox: every process, and the files in its workdir
    file_size_bytes: int = 16 << 20
    workdir_bytes: int = 64 << 20  # everything it writes, together
    workdir_inodes: int = 4096
    open_files: int = 64
    max_processes: int = 64  # per sandbox (its uid's RLIMIT_NPROC, and its cgroup's pids.max)

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
    cgroup: SandboxCgroup | None = None
    uid_lease: UidLease | None = None
    status: socket.socket | None = None  # the launcher exits when this closes (e.g. our process dies)

    @property
    def uid(self) -> int | None:
        return self.uid_lease.uid if self.uid_lease else None

    def members(self) -> dict[int, int]:
        """The sandbox's live processes: {host pid: pid inside the sandbox}."""
        return members(self.pid_ns) if self.pid_ns else {}


def sandbox_level() -> str:
    """"namespaces" or "none" (probed, then re-probed now and then; "none" too when settings.sandbox is "off")."""
    settings = get_settings()
    return effective_level(settings.sandbox, settings.sandbox_uid, settings.sandbox_uid_count)


def require_sandbox() -> None:
    """Raise SandboxUnavailable unless user code can be contained here (fail closed)."""
    settings = get_settings()
    if settings.sandbox == "off":
        raise SandboxUnavailable("user Python code is refused: the sandbox is turned off (CISPO_SANDBOX=off)")
    found = probe(settings.sandbox_uid, settings.sandbox_uid_count)
    if found.level != "namespaces":
        raise SandboxUnavailable(f"user Python code is refused: this host cannot isolate it (no namespaces): "
                                 f"{found.reason}")


def python_argv(*scripts: Path) -> list[str]:
    """argv running stdlib-only scripts, joined in order as one program, in the sandbox's interpreter, isolated
    (-I -S -B).

    The source goes on the command line, so the sandbox uid needs no access to
    the project's files (they are not in its file system anyway, and -I leaves no path to import them from).
    """
    return [sandbox_python(), "-I", "-S", "-B", "-c", "\n".join(Path(script).read_text() for script in scripts)]


def new_workdir(prefix: str = "cispo-sandbox-") -> Path:
    """A fresh 0700 directory naming one sandbox's working directory (a tmpfs inside it). The caller removes it."""
    return Path(tempfile.mkdtemp(prefix=prefix))


def spawn(argv: list[str], *, workdir: Path, limits: Limits, extra_read_only: tuple[str, ...] = (),
          stderr=subprocess.DEVNULL) -> SandboxProcess:
    """Start argv contained (see the module doc), with stdin/stdout pipes; returns once argv has exec'd.

    Raises SandboxUnavailable (fail closed) or SandboxError (it did not start).
    """
    require_sandbox()
    settings = get_settings()
    workdir = Path(workdir)
    workdir.mkdir(mode=0o700, exist_ok=True)
    try:
        lease = lease_uid(settings.sandbox_uid, settings.sandbox_uid_count)
    except NoUidFree as e:
        raise SandboxError(f"the sandbox did not start: {e}") from None
    try:
        cgroup = new_cgroup(limits.memory_bytes, limits.max_processes + 1)  # + its init
    except CgroupUnavailable as e:
        lease.release()
        raise SandboxError(f"the sandbox did not start: {e}") from None
    ours, theirs = socket.socketpair()
    config = launch_config(uid=lease.uid, workdir=str(workdir), workdir_bytes=limits.workdir_bytes,
                           workdir_inodes=limits.workdir_inodes, rlimits=limits.rlimits(),
                           cgroups=[str(p) for p in cgroup.paths], status_fd=theirs.fileno(),
                           extra_read_only=extra_read_only)
    env = {"PATH": DEFAULT_PATH, "LANG": "C.UTF-8", "PYTHONHASHSEED": "0", "HOME": str(workdir),
           "TMPDIR": str(workdir)}
    try:
        proc = SandboxProcess(launch_argv(config, argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=stderr, cwd="/", env=env, close_fds=True, pass_fds=(theirs.fileno(),),
                              start_new_session=True)
    except BaseException:
        ours.close()
        remove_cgroup(cgroup)
        lease.release()
        raise
    finally:
        theirs.close()
    proc.workdir, proc.cgroup, proc.uid_lease, proc.status = workdir, cgroup, lease, ours
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
    """SIGKILL everything the sandbox started, reap it, verify no survivor, drop its cgroup and uid. Idempotent.

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
    if not remove_cgroup(proc.cgroup):
        log.warning("sandbox cgroup %s could not be removed", proc.cgroup)
    proc.cgroup = None
    if survivors:  # the uid stays leased (to this process) while anything may still run as it
        raise SandboxError(f"sandbox processes survived the kill: {sorted(survivors)}")
    if proc.uid_lease is not None:
        proc.uid_lease.release()


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
