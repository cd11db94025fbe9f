"""The sandbox launcher: pid 1 of a sandbox's fresh namespaces. A script, never imported.

worker/sandbox.py (and the probe in service/sandbox_probe.py) run it, as root, as

    unshare --net --pid --fork --mount-proc --ipc --kill-child -- \\
        python -I -S -B _sandbox_launch.py CONFIG_JSON -- ARGV...

so it starts as pid 1 of a new pid namespace, in a network namespace with no
interface up, and in private mount and IPC namespaces. It then

1. joins the sandbox's pids cgroup, if it was given one;
2. builds a new root file system and chroots into it: read-only binds of the
   system paths and the interpreter's prefix, a /dev with only null, zero,
   full, random and urandom, the new pid namespace's /proc, and the workdir,
   the only writable place (nothing else of the host is reachable: no /tmp,
   /run, /var, /home, /sys, no sockets, no GPU device nodes);
3. forks the target, which sets the rlimits, drops to the sandbox uid/gid with
   no supplementary groups and no_new_privs (so RLIMIT_NPROC binds and
   root-only files stay unreadable), chdirs into the workdir and execs ARGV
   with the environment this launcher was given;
4. stays pid 1: it reaps orphans, and exits with the target's status (128+N
   for signal N: pid 1 cannot re-raise it) when the target ends, or at once
   when the parent's end of the status socket closes (the parent died). Its
   exit ends the namespace: the kernel SIGKILLs every process left in it,
   setsid() daemons included.

CONFIG_JSON: {"uid", "gid", "workdir", "ro": [paths], "rlimits": {NAME: int},
"cgroup": path|null, "status_fd": int|null}. On the status fd it writes
"ok pid:[INODE]\\n" (its pid namespace, as the host names it too) once the
target has exec'd, or "error: ...\\n" (and exits 125).
Standard library only; everything is imported before the chroot.
"""

import ctypes
import json
import os
import resource
import select
import signal
import socket
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_MOVE, MS_REC, MS_PRIVATE = 32, 4096, 8192, 16384, 1 << 18
PR_SET_NO_NEW_PRIVS = 38
DEVICES = ("null", "zero", "full", "random", "urandom")
STAGING = "/tmp"  # the new root is built on a tmpfs mounted here (the host's /tmp is hidden by it)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]


class SetupError(Exception):
    pass


def _mount(source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    if _libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
        err = ctypes.get_errno()
        raise SetupError(f"mount {target}: {os.strerror(err)}")


def _bind(fd, target, flags):
    """Bind what fd (O_PATH) names onto target, then make that mount `flags` (read-only or not)."""
    _mount(f"/proc/self/fd/{fd}", target, None, MS_BIND | MS_REC)
    _mount(None, target, None, MS_REMOUNT | MS_BIND | flags)


def _new_root(config):
    """Build the sandbox's file system on a tmpfs at STAGING, move it to / and chroot into it."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # unshare does this too; nothing must propagate out
    # Open every source before STAGING hides the host's /tmp (the workdir usually lives there).
    ro = []
    for path in config["ro"]:
        if os.path.islink(path):
            ro.append((path, os.readlink(path), None))
        elif os.path.exists(path):
            ro.append((path, None, os.open(path, os.O_PATH | os.O_CLOEXEC)))
    devices = [(name, os.open(f"/dev/{name}", os.O_PATH | os.O_CLOEXEC)) for name in DEVICES]
    workdir = config["workdir"]
    work_fd = os.open(workdir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)

    os.umask(0o022)  # directories made here are traversable by the sandbox uid
    _mount("tmpfs", STAGING, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
    root = STAGING
    read_only = MS_RDONLY | MS_NOSUID | MS_NODEV
    for path, link, fd in ro:
        target = root + path
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if link is not None:
            os.symlink(link, target)
            continue
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            os.makedirs(target, exist_ok=True)
        else:
            open(target, "w").close()
        _bind(fd, target, read_only)
        os.close(fd)

    os.makedirs(root + "/dev")
    _mount("tmpfs", root + "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=64k")
    for name, fd in devices:
        open(f"{root}/dev/{name}", "w").close()
        _bind(fd, f"{root}/dev/{name}", MS_NOSUID | MS_NOEXEC)
        os.close(fd)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{root}/dev/{name}")
    _mount(None, root + "/dev", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NOEXEC)

    os.makedirs(root + "/proc")
    _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.makedirs(root + "/tmp", exist_ok=True)  # exists, read-only: TMPDIR points at the workdir
    os.makedirs(root + workdir, exist_ok=True)
    _bind(work_fd, root + workdir, MS_NOSUID | MS_NODEV)
    os.close(work_fd)

    # switch_root: move the new tree onto / and chroot into it; the old root is left unreachable.
    os.chdir(root)
    _mount(root, "/", None, MS_MOVE)
    os.chroot(".")
    os.chdir("/")
    _mount(None, "/", None, MS_REMOUNT | MS_BIND | read_only)


def _exec_target(config, argv, error_w):
    """In the forked child: limits, unprivileged identity, then exec. Never returns."""
    try:
        for name, value in config["rlimits"].items():
            resource.setrlimit(getattr(resource, "RLIMIT_" + name), (value, value))
        os.setgroups([])
        os.setgid(config["gid"])
        os.setuid(config["uid"])  # drops every capability: the uid is not 0
        if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
        os.chdir(config["workdir"])
        os.execve(argv[0], argv, os.environ)
    except BaseException as e:
        os.write(error_w, f"{argv[0]}: {type(e).__name__}: {e}".encode()[:2000])
    os._exit(127)


def _report(status, message):
    if status is not None:
        try:
            status.sendall(message.encode() + b"\n")
        except OSError:
            pass
    if not message.startswith("ok"):
        sys.stderr.write(f"sandbox launcher: {message}\n")


def main():
    config = json.loads(sys.argv[1])
    argv = sys.argv[sys.argv.index("--", 2) + 1:]
    status = None
    if config.get("status_fd") is not None:
        status = socket.socket(fileno=config["status_fd"])
        status.set_inheritable(False)
    try:
        if os.getpid() != 1:
            raise SetupError("not pid 1 of a new pid namespace")
        pid_ns = os.readlink("/proc/self/ns/pid")
        if config.get("cgroup"):  # before anything forks: every descendant is counted
            with open(os.path.join(config["cgroup"], "cgroup.procs"), "w") as f:
                f.write("0")
        _new_root(config)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so SIGCHLD reaches pid 1 and wakes select
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        error_r, error_w = os.pipe()  # close-on-exec: EOF without data means the exec succeeded
        target = os.fork()
        if target == 0:
            _exec_target(config, argv, error_w)
        os.close(error_w)
        error = os.read(error_r, 4096)
        os.close(error_r)
        if error:
            raise SetupError(error.decode(errors="replace"))
    except BaseException as e:
        _report(status, f"error: {e}")
        os._exit(125)
    _report(status, f"ok {pid_ns}")
    null = os.open("/dev/null", os.O_RDWR)  # the target holds the pipes; the parent sees EOF when it ends
    os.dup2(null, 0)
    os.dup2(null, 1)

    watch = [wake_r] + ([status] if status is not None else [])
    while True:
        ready, _, _ = select.select(watch, [], [])
        if status in ready:
            try:
                gone = not status.recv(64)
            except OSError:
                gone = True
            if gone:
                os._exit(137)  # the parent is gone: end the whole sandbox
        if wake_r in ready:
            while True:
                try:
                    if not os.read(wake_r, 512):
                        break
                except BlockingIOError:
                    break
        while True:  # reap everything that ended: orphans are re-parented to us
            try:
                pid, code = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                os._exit(125)
            if pid == 0:
                break
            if pid == target:
                code = os.waitstatus_to_exitcode(code)
                os._exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    main()
