"""The sandbox launcher: pid 1 of a sandbox's fresh namespaces. A script, never imported.

service/sandbox/spawn.py (and the probe in service/sandbox/probe.py) run it, as root, as

    unshare --net --pid --fork --mount-proc --ipc --kill-child -- \\
        python -I -S -B launch.py CONFIG_JSON -- ARGV...

so it starts as pid 1 of a new pid namespace, in a network namespace with no
interface up, and in private mount and IPC namespaces. It then

1. joins the sandbox's cgroups (memory and pids), before anything forks;
2. builds a new root file system and chroots into it: read-only binds of the
   system paths and the interpreter's prefix, a /dev with only null, zero,
   full, random and urandom, the new pid namespace's /proc, and at the
   workdir's path a size- and inode-capped tmpfs owned by the sandbox uid,
   the only writable place (nothing else of the host is reachable: no /tmp,
   /dev/shm, /run, /var, /home, /sys, no sockets, no GPU device nodes; what
   it writes lives in memory charged to its cgroup, never on the host's disk);
3. forks the target, which sets the rlimits, drops to the sandbox uid/gid with
   no supplementary groups, joins a fresh anonymous session keyring (nothing
   of the worker's keyring stays reachable), sets no_new_privs, installs the
   seccomp filter (see DENIED), chdirs into the workdir and execs ARGV with
   the environment this launcher was given;
4. stays pid 1: it reaps orphans, and exits with the target's status (128+N
   for signal N: pid 1 cannot re-raise it) when the target ends, or at once
   when the parent's end of the status socket closes (the parent died). Its
   exit ends the namespace: the kernel SIGKILLs every process left in it,
   setsid() daemons included.

CONFIG_JSON: {"uid", "gid", "workdir", "workdir_bytes", "workdir_inodes", "ro": [paths],
"rlimits": {NAME: int}, "cgroups": [paths], "status_fd": int|null}. Any step
that fails fails the start (fail closed): there is no partial sandbox. On the status fd it writes
"ok pid:[INODE]\\n" (its pid namespace, as the host names it too) once the
target has exec'd, or "error: ...\\n" (and exits 125).
Standard library only; everything is imported before the chroot.
"""

import ctypes
import errno
import json
import os
import resource
import select
import signal
import socket
import struct
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_MOVE, MS_REC, MS_PRIVATE = 32, 4096, 8192, 16384, 1 << 18
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
KEYCTL_JOIN_SESSION_KEYRING = 1
DEVICES = ("null", "zero", "full", "random", "urandom")
STAGING = "/tmp"  # the new root is built on a tmpfs mounted here (the host's /tmp is hidden by it)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]


class SetupError(Exception):
    pass


# -- the seccomp filter ------------------------------------------------------------
# Denied with EPERM: new namespaces, io_uring (its own syscall surface, invisible to
# seccomp), the kernel keyring, tracing and other processes' memory, mounts, bpf,
# perf, userfaultfd (a race-widening primitive), kexec and kernel modules. clone()
# is allowed without namespace flags; clone3() answers ENOSYS, as seccomp cannot
# read its flags from memory, so libc falls back to clone(). Any other ABI (i386,
# x32) is killed or denied: its syscall numbers differ.
DENIED = ("unshare", "setns", "mount", "umount2", "pivot_root", "open_tree", "move_mount", "fsopen", "fsconfig",
          "fsmount", "fspick", "mount_setattr", "io_uring_setup", "io_uring_enter", "io_uring_register", "keyctl",
          "add_key", "request_key", "ptrace", "process_vm_readv", "process_vm_writev", "bpf", "perf_event_open",
          "userfaultfd", "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module")
CLONE_NAMESPACES = 0x7E020000  # NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET
# machine: (AUDIT_ARCH, syscall numbers, the lowest number of a foreign ABI sharing AUDIT_ARCH or None)
SYSCALLS = {
    "x86_64": (0xC000003E, dict(
        unshare=272, setns=308, mount=165, umount2=166, pivot_root=155, open_tree=428, move_mount=429, fsopen=430,
        fsconfig=431, fsmount=432, fspick=433, mount_setattr=442, io_uring_setup=425, io_uring_enter=426,
        io_uring_register=427, keyctl=250, add_key=248, request_key=249, ptrace=101, process_vm_readv=310,
        process_vm_writev=311, bpf=321, perf_event_open=298, userfaultfd=323, kexec_load=246, kexec_file_load=320,
        init_module=175, finit_module=313, delete_module=176, clone=56, clone3=435), 0x40000000),  # x32
    "aarch64": (0xC00000B7, dict(
        unshare=97, setns=268, mount=40, umount2=39, pivot_root=41, open_tree=428, move_mount=429, fsopen=430,
        fsconfig=431, fsmount=432, fspick=433, mount_setattr=442, io_uring_setup=425, io_uring_enter=426,
        io_uring_register=427, keyctl=219, add_key=217, request_key=218, ptrace=117, process_vm_readv=270,
        process_vm_writev=271, bpf=280, perf_event_open=241, userfaultfd=282, kexec_load=104, kexec_file_load=294,
        init_module=105, finit_module=273, delete_module=106, clone=220, clone3=435), None),
}
LD_W_ABS, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06  # classic BPF opcodes (with BPF_K)
RET_KILL_PROCESS, RET_ALLOW, RET_ERRNO = 0x80000000, 0x7FFF0000, 0x00050000
NR, ARCH, ARG0 = 0, 4, 16  # offsets in struct seccomp_data (ARG0: its low 32 bits, little-endian)


def seccomp_program(machine):
    """The filter as bytes of struct sock_filter {u16 code; u8 jt; u8 jf; u32 k}."""
    if machine not in SYSCALLS:
        raise SetupError(f"seccomp: no syscall table for {machine}")
    arch, nr, foreign = SYSCALLS[machine]
    code = [(LD_W_ABS, 0, 0, ARCH), (JEQ, 1, 0, arch), (RET, 0, 0, RET_KILL_PROCESS), (LD_W_ABS, 0, 0, NR)]
    if foreign is not None:
        code.append((JGE, "deny", 0, foreign))
    code += [(JEQ, "deny", 0, nr[name]) for name in DENIED]
    code += [(JEQ, "nosys", 0, nr["clone3"]), (JEQ, 0, "allow", nr["clone"]),
             (LD_W_ABS, 0, 0, ARG0), (JSET, "deny", 0, CLONE_NAMESPACES)]
    labels = {"allow": len(code), "deny": len(code) + 1, "nosys": len(code) + 2}
    code += [(RET, 0, 0, RET_ALLOW), (RET, 0, 0, RET_ERRNO | 1), (RET, 0, 0, RET_ERRNO | 38)]  # EPERM, ENOSYS
    jump = lambda at, to: labels[to] - at - 1 if isinstance(to, str) else to  # noqa: E731
    return b"".join(struct.pack("=HBBI", op, jump(i, jt), jump(i, jf), k) for i, (op, jt, jf, k) in enumerate(code))


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _install_seccomp(machine):
    program = seccomp_program(machine)
    buffer = ctypes.create_string_buffer(program, len(program))
    fprog = _SockFprog(len(program) // 8, ctypes.addressof(buffer))
    if _libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")


def _join_new_session_keyring(machine):
    """An anonymous session keyring of the sandbox uid: the worker's keys are no longer possessed.

    EPERM or ENOSYS means a filter above ours (Docker's default seccomp profile)
    already denies the keyring calls to the worker and so to every descendant:
    there is no keyring to leave, so that is not a failure.
    """
    if _libc.syscall(ctypes.c_long(SYSCALLS[machine][1]["keyctl"]), ctypes.c_long(KEYCTL_JOIN_SESSION_KEYRING),
                     ctypes.c_void_p(None)) < 0:
        err = ctypes.get_errno()
        if err not in (errno.EPERM, errno.ENOSYS):
            raise OSError(err, "keyctl(KEYCTL_JOIN_SESSION_KEYRING)")


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
    _mount("tmpfs", root + workdir, "tmpfs", MS_NOSUID | MS_NODEV,
           f"mode=0700,uid={config['uid']},gid={config['gid']},size={config['workdir_bytes']},"
           f"nr_inodes={config['workdir_inodes']}")

    # switch_root: move the new tree onto / and chroot into it; the old root is left unreachable.
    os.chdir(root)
    _mount(root, "/", None, MS_MOVE)
    os.chroot(".")
    os.chdir("/")
    _mount(None, "/", None, MS_REMOUNT | MS_BIND | read_only)


def _exec_target(config, argv, error_w):
    """In the forked child: limits, its own uid, a fresh keyring, the seccomp filter, then exec. Never returns."""
    try:
        for name, value in config["rlimits"].items():
            resource.setrlimit(getattr(resource, "RLIMIT_" + name), (value, value))
        os.setgroups([])
        os.setgid(config["gid"])
        os.setuid(config["uid"])  # drops every capability: the uid is not 0
        machine = os.uname().machine
        _join_new_session_keyring(machine)
        if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
        _install_seccomp(machine)  # last: execve below, and nothing after it, must pass the filter
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
        for cgroup in config["cgroups"]:  # before anything forks: every descendant is counted
            with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
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
