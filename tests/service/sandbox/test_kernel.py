"""The sandbox's kernel-facing layers, attacked from inside: its own uid, one cgroup for memory and
processes, a capped tmpfs, the seccomp filter and a private keyring; and how the host's level is probed.

Same style as test_sandbox_containment.py: each attack returns in bounded time,
fails visibly, and leaves nothing behind (the `trainer` fixture checks).
"""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import struct
import time
from pathlib import Path

import pytest

import service.sandbox.launch as launcher
from service.sandbox import cgroup as sandbox_cgroup, probe as sandbox_probe
from service.sandbox.probe import Probe
from service.sandbox.uids import lease_uid
from worker.rewards.sandbox import PythonRewardProcess
from service.sandbox.spawn import SandboxUnavailable, sandbox_level
from tests.service.sandbox.attacks import SANDBOX_UIDS, Run, fresh_settings, needs_sandbox, trainer  # noqa: F401

SYSCALLS = launcher.SYSCALLS.get(os.uname().machine, (0, {}, None))[1]

# Every syscall the filter must deny, with arguments for which the kernel itself answers something other
# than EPERM when the caller holds the capability (bad pointers, fds, flags): so EPERM means the filter.
# Written out here, not read from launcher.DENIED, so dropping a rule there fails these tests.
ATTACKS = {
    "unshare": [0x10000000], "setns": [-1, 0], "mount": [0, 0, 0, 0, 0], "umount2": [0, 0], "pivot_root": [0, 0],
    "open_tree": [-1, 0, 0xFFFFFFFF], "move_mount": [-1, 0, -1, 0, 0], "fsopen": [0, 0], "fsconfig": [-1, 0, 0, 0, 0],
    "fsmount": [-1, 0, 0], "fspick": [-1, 0, 0], "mount_setattr": [-1, 0, 0xFFFFFFFF, 0, 0],
    "io_uring_setup": [1, 0], "io_uring_enter": [-1, 0, 0, 0, 0], "io_uring_register": [-1, 0, 0, 0],
    "keyctl": [-1, 0, 0], "add_key": [0, 0, 0, 0, -3], "request_key": [0, 0, 0, 0], "ptrace": [-1, 0, 0, 0],
    "process_vm_readv": [1, 0, 0, 0, 0, 1], "process_vm_writev": [1, 0, 0, 0, 0, 1], "bpf": [-1, 0, 0],
    "perf_event_open": [0, 0, -1, -1, 0], "userfaultfd": [-1], "kexec_load": [0, 0, 0, 0],
    "kexec_file_load": [-1, -1, 0, 0, 0], "init_module": [0, 0, 0], "finit_module": [-1, 0, 0],
    "delete_module": [0, 0],
}


@needs_sandbox
class TestKernelLayers:
    def test_live_sandboxes_never_share_a_uid(self, trainer):
        source = "import os\ndef reward(completion, **row):\n    return float(os.getuid())\n"
        procs = [PythonRewardProcess(source) for _ in range(3)]
        try:
            uids = [p.score(["x"], [{}]).scores[0] for p in procs]
        finally:
            for p in procs:
                p.close()
        assert len(set(uids)) == 3 and all(int(u) in SANDBOX_UIDS for u in uids), uids
        for uid in uids:  # each was handed back at close(): it can be leased again
            lease_uid(int(uid), 1).release()

    def test_memory_limit_covers_all_its_processes_together(self, trainer):
        """Four processes of 150 MB each: each is under the per-process limit, their sum is not."""
        source = """
import os, time
def reward(completion, **row):
    children = []
    for _ in range(4):
        pid = os.fork()
        if pid == 0:
            hoard = b"x" * (150 << 20)  # touched, so resident
            time.sleep(1.5)  # all four hold theirs at once
            os._exit(0)
        children.append(pid)
    return float(sum(os.waitpid(pid, 0)[1] == 0 for pid in children))
"""
        run = Run(source, ["x"], timeout_s=20, memory_bytes=256 << 20)
        held = run.result.scores[0]
        assert held is not None and held <= 1, run.result  # the rest were OOM-killed: 256 MiB for all of it
        run.assert_nothing_survives()

    def test_writes_are_capped_in_total_and_never_reach_the_host_disk(self, trainer):
        source = """
import os
def reward(completion, **row):
    written = 0
    try:
        for i in range(40):  # 40 files of 15 MiB, each under RLIMIT_FSIZE: 600 MiB
            with open(f"f{i}", "wb") as f:
                for _ in range(15):
                    f.write(b"x" * (1 << 20))
                    written += 1 << 20
    except OSError as e:
        return float(e.errno * 10**10 + written)
    return float(written)
"""
        run = Run(source, ["x"], timeout_s=20)
        failed_errno, written = divmod(int(run.result.scores[0]), 10**10)
        assert failed_errno == errno.ENOSPC and written <= 64 << 20, (failed_errno, written)
        run.assert_nothing_survives()

    def test_seccomp_denies_namespaces_io_uring_keys_ptrace_and_kernel_interfaces(self, trainer):
        numbers = SYSCALLS
        source = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def call(nr, *args):
    ctypes.set_errno(0)
    result = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])
    if result == 0 and nr == CLONE:
        os._exit(0)  # a raw clone() child: leave at once
    if result > 0 and nr == CLONE:
        os.waitpid(result, 0)
    return -ctypes.get_errno() if result < 0 else result
def reward(completion, nr, args, **row):
    raise RuntimeError(str(call(nr, *args)))
"""
        clone_newuser = 0x10000000 | signal.SIGCHLD
        calls = {**ATTACKS, "clone": [clone_newuser, 0, 0, 0, 0]}
        rows = [{"nr": numbers[name], "args": args} for name, args in calls.items()]
        rows.append({"nr": numbers["clone3"], "args": [0, 0]})
        source = source.replace("CLONE", str(numbers["clone"]))
        run = Run(source, ["x"] * len(rows), rows)
        answers = dict(zip([*calls, "clone3"], (e.removeprefix("RuntimeError: ") for e in run.result.errors)))
        assert answers == {**{name: str(-errno.EPERM) for name in calls}, "clone3": str(-errno.ENOSYS)}
        run.assert_nothing_survives()

    def test_threads_forks_and_subprocesses_still_work_under_the_filter(self, trainer):
        source = """
import os, subprocess, threading
def reward(completion, **row):
    box = []
    thread = threading.Thread(target=lambda: box.append(1))
    thread.start()
    thread.join()
    out = subprocess.run(["/bin/echo", "ok"], capture_output=True).stdout
    return float(len(box) + (out == b"ok\\n"))
"""
        run = Run(source, ["x"])
        assert run.result.scores == [2.0], run.result.errors
        run.assert_nothing_survives()

    def test_the_workers_keyring_is_out_of_reach(self, trainer):
        """A key in the worker's session keyring: before, a sandbox inherited (possessed) it."""
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        numbers = SYSCALLS
        join = libc.syscall(ctypes.c_long(numbers["keyctl"]), ctypes.c_long(1), ctypes.c_char_p(b"cispo-test"))
        assert join > 0, os.strerror(ctypes.get_errno())  # this process now has a session keyring of its own
        canary = f"cispo-canary-{os.getpid()}".encode()
        key = libc.syscall(ctypes.c_long(numbers["add_key"]), ctypes.c_char_p(b"user"), ctypes.c_char_p(canary),
                           ctypes.c_char_p(b"secret"), ctypes.c_long(6), ctypes.c_long(-3))
        assert key > 0, os.strerror(ctypes.get_errno())
        try:
            source = "def reward(completion, **row):\n    raise RuntimeError(open('/proc/keys').read())\n"
            run = Run(source, ["x"])
        finally:
            libc.syscall(ctypes.c_long(numbers["keyctl"]), ctypes.c_long(3), ctypes.c_long(key))  # revoke
        assert run.result.errors[0].startswith("RuntimeError:")
        assert canary.decode() not in run.result.errors[0]
        run.assert_nothing_survives()


def test_a_failed_probe_is_retried_after_its_short_ttl(monkeypatch):
    answers = iter([Probe("none", "a transient failure"), Probe("namespaces", "")])
    monkeypatch.setattr(sandbox_probe, "_probe", lambda first, count: next(answers))
    monkeypatch.setattr(sandbox_probe, "NEGATIVE_TTL_S", 0.2)
    sandbox_probe.forget_probes()
    try:
        assert sandbox_probe.probe(1000, 1).level == "none"
        assert sandbox_probe.probe(1000, 1).level == "none"  # cached for a moment
        time.sleep(0.3)
        assert sandbox_probe.probe(1000, 1).level == "namespaces"  # probed again: user code is back
        time.sleep(0.3)
        assert sandbox_probe.effective_level("auto", 1000, 1) == "namespaces"  # a success is kept longer
    finally:
        sandbox_probe.forget_probes()


def test_no_writable_cgroup_fails_closed(monkeypatch, fresh_settings):
    monkeypatch.setattr(sandbox_cgroup, "_v2_parent", lambda: None)
    monkeypatch.setattr(sandbox_cgroup, "_v1_parents", lambda: None)
    sandbox_probe.forget_probes()
    try:
        found = sandbox_probe.probe()
        if os.geteuid() == 0:
            assert found == Probe("none", "no writable cgroup with the memory and pids controllers (v2, or v1 "
                                          "memory and pids hierarchies)")
        assert sandbox_level() == "none"
        with pytest.raises(SandboxUnavailable, match="memory and pids"if os.geteuid() == 0 else "refused"):
            PythonRewardProcess("def reward(c, **r):\n    return 1.0\n")
    finally:
        sandbox_probe.forget_probes()


_FILTERED_CALLS = """
import ctypes, json, os, sys
import service.sandbox.launch as launcher
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
numbers = launcher.SYSCALLS[os.uname().machine][1]
if sys.argv[2] == "filtered":
    assert libc.prctl(launcher.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0
    launcher._install_seccomp(os.uname().machine)
answers = {}
for name, args in json.loads(sys.argv[1]).items():
    pid = os.fork()
    if pid == 0:  # each call in a child of its own: a successful unshare or ptrace changes nothing here
        ctypes.set_errno(0)
        result = libc.syscall(ctypes.c_long(numbers[name]), *[ctypes.c_long(a) for a in args])
        os._exit(min(ctypes.get_errno(), 255) if result < 0 else 0)
    answers[name] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
print(json.dumps(answers))
"""


@pytest.mark.skipif(os.geteuid() != 0 or not SYSCALLS, reason="needs root (the capabilities the filter must "
                                                               "stand in for) and a syscall table")
def test_the_filter_itself_denies_each_syscall_a_privileged_caller_could_make():
    """Inside the sandbox the uid has no capabilities, so the kernel alone already answers EPERM to pivot_root,
    move_mount, fsopen, fsmount and fspick: there a dropped rule would go unseen. Here the same filter is
    installed in a root process, where each call gets past the kernel's own checks to an argument error."""
    import json
    import subprocess
    import sys

    def answers(mode: str) -> dict[str, int]:
        done = subprocess.run([sys.executable, "-c", _FILTERED_CALLS, json.dumps(ATTACKS), mode],
                              capture_output=True, text=True, timeout=60, cwd=os.getcwd(),
                              env={**os.environ, "PYTHONPATH": str(Path(launcher.__file__).parents[2])})
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    unfiltered = answers("plain")
    assert {name for name, err in unfiltered.items() if err == errno.EPERM} == set(), unfiltered
    assert answers("filtered") == {name: errno.EPERM for name in ATTACKS}


def test_seccomp_program_jumps_stay_inside_the_program():
    for machine in launcher.SYSCALLS:
        program = launcher.seccomp_program(machine)
        code = list(struct.iter_unpack("=HBBI", program))
        for i, (op, jt, jf, _k) in enumerate(code):
            if op & 0x07 == 0x05:  # BPF_JMP
                assert i + 1 + max(jt, jf) < len(code)
        assert code[-1][0] == launcher.RET and code[-1][3] == launcher.RET_ERRNO | errno.ENOSYS
    with pytest.raises(launcher.SetupError, match="no syscall table"):
        launcher.seccomp_program("sparc")


# -- the probe itself, run for real (probe() caches; these call _probe, the trial sandbox, directly) -----------

# A uid range of one, outside the settings' (other tests' sandboxes and leases never touch it).
PROBE_UID = 3_000_000 + os.getpid() % 100_000


def _check_then(edit: str) -> str:
    """The probe's in-sandbox check with `edit` run on its findings just before it prints them."""
    last = "print(json.dumps(found))"
    assert sandbox_probe._CHECK.rstrip().endswith(last)
    return sandbox_probe._CHECK.rstrip().removesuffix(last) + edit + "\n" + last + "\n"


@needs_sandbox
def test_the_probe_runs_a_contained_trial_sandbox_and_leaves_nothing_behind(monkeypatch, trainer):
    made = {}
    mkdtemp, new_cgroup = sandbox_probe.tempfile.mkdtemp, sandbox_probe.new_cgroup
    monkeypatch.setattr(sandbox_probe.tempfile, "mkdtemp", lambda **kw: made.setdefault("workdir", mkdtemp(**kw)))
    monkeypatch.setattr(sandbox_probe, "new_cgroup", lambda *a: made.setdefault("cgroup", new_cgroup(*a)))

    assert sandbox_probe._probe(PROBE_UID, 1) == Probe("namespaces", "")

    assert Path(made["workdir"]).name.startswith("cispo-probe-") and not Path(made["workdir"]).exists()
    assert made["cgroup"].paths and not any(p.exists() for p in made["cgroup"].paths)
    lease_uid(PROBE_UID, 1).release()  # its uid is free again


@needs_sandbox
@pytest.mark.parametrize("edit, wrong", [
    ("found['uid'] = os.getuid() + 1", "uid"), ("found['gid'] = os.getgid() + 1", "gid"), ("found['pid'] = 3", "pid"),
    ("found['loopback'] = 'open'", "loopback"), ("found['write_outside'] = 'ok'", "write_outside"),
    ("found['unshare'] = 'ok'", "unshare"), ("found['cgroup'] = False", "cgroup"), ("del found['cgroup']", "cgroup"),
    ("found['workdir_bytes'] = 0", "workdir_bytes"), ("del found['workdir_bytes']", "workdir_bytes"),
    (f"found['workdir_bytes'] = {sandbox_probe.PROBE_WORKDIR_BYTES + 4096}", "workdir_bytes"),
])
def test_the_probe_refuses_a_trial_sandbox_that_is_not_contained(monkeypatch, edit, wrong):
    monkeypatch.setattr(sandbox_probe, "_CHECK", _check_then(edit))
    found = sandbox_probe._probe(PROBE_UID, 1)
    assert found.level == "none"
    assert found.reason.startswith(f"the trial sandbox is not contained: {{{wrong!r}: "), found.reason
    assert found.reason.count(": ") == 2  # that one finding alone


@needs_sandbox
@pytest.mark.parametrize("edit", ["found['write_outside'] = errno.EACCES",  # a read-only bind or no permission
                                  f"found['workdir_bytes'] = {sandbox_probe.PROBE_WORKDIR_BYTES}"])
def test_the_probe_accepts_each_contained_answer(monkeypatch, edit):
    monkeypatch.setattr(sandbox_probe, "_CHECK", _check_then(edit))
    assert sandbox_probe._probe(PROBE_UID, 1) == Probe("namespaces", "")


@needs_sandbox
@pytest.mark.parametrize("check, reason", [
    ("import sys\nsys.stderr.write('first\\nlast words\\n')\nsys.exit(3)", "the trial sandbox failed (exit 3): last words"),
    ("raise SystemExit(4)", "the trial sandbox failed (exit 4): "),
    ("print('not json')", "the trial sandbox failed: JSONDecodeError: Expecting value: line 1 column 1 (char 0)"),
])
def test_a_trial_sandbox_that_fails_says_how(monkeypatch, check, reason):
    monkeypatch.setattr(sandbox_probe, "_CHECK", check)
    assert sandbox_probe._probe(PROBE_UID, 1) == Probe("none", reason)


@needs_sandbox
def test_a_trial_sandbox_past_its_deadline_is_a_failure(monkeypatch, trainer):
    monkeypatch.setattr(sandbox_probe, "_CHECK", "import time\ntime.sleep(60)")
    monkeypatch.setattr(sandbox_probe, "PROBE_TIMEOUT_S", 1.0)
    started = time.monotonic()
    found = sandbox_probe._probe(PROBE_UID, 1)
    assert found.level == "none" and found.reason.startswith("the trial sandbox failed: TimeoutExpired: ")
    assert time.monotonic() - started < 10


def test_the_probe_says_why_a_host_cannot_sandbox(monkeypatch):
    held = lease_uid(PROBE_UID, 1)
    try:
        if os.geteuid() == 0 and sandbox_probe.shutil.which("unshare", path=sandbox_probe.SYSTEM_SEARCH):
            assert sandbox_probe._probe(PROBE_UID, 1) == Probe(
                "none", f"all 1 sandbox uids ({PROBE_UID}-{PROBE_UID}) are in use by live sandboxes")
    finally:
        held.release()
    assert sandbox_probe._probe(0, 5) == Probe("none", "the sandbox uids must not include 0")
    monkeypatch.setattr(sandbox_probe.os, "geteuid", lambda: 1000)
    assert sandbox_probe._probe(1, 5) == Probe("none", "the worker is not root: it can neither create the namespaces "
                                                       "nor switch the user code to an unprivileged uid")  # 1 may start
    monkeypatch.setattr(sandbox_probe.os, "geteuid", lambda: 0)
    asked = []
    monkeypatch.setattr(sandbox_probe.shutil, "which", lambda *a, **kw: asked.append((a, kw)))
    assert sandbox_probe._probe(PROBE_UID, 1) == Probe("none", "unshare (util-linux) is not installed")
    assert asked == [(("unshare",), {"path": sandbox_probe.SYSTEM_SEARCH})]
    with pytest.raises(FileNotFoundError, match=r"^unshare \(util-linux\) is not installed$"):
        sandbox_probe.launch_argv({}, ["true"])
    monkeypatch.setattr(sandbox_probe.sys, "platform", "darwin")
    assert sandbox_probe._probe(PROBE_UID, 1) == Probe("none", "not Linux")


def test_the_sandbox_sees_the_system_its_interpreter_and_the_extra_paths_once_each(monkeypatch):
    present = {"/usr", "/bin", "/lib", "/lib64", "/etc"}  # as on a merged-/usr host: no /sbin, /lib32, /libx32
    monkeypatch.setattr(sandbox_probe.os.path, "lexists", lambda p: p in present)
    monkeypatch.setattr(sandbox_probe.sys, "base_prefix", "/opt/python3.11")
    assert sandbox_probe.read_only_paths() == ["/usr", "/bin", "/lib", "/lib64", "/etc", "/opt/python3.11"]
    extra = ("/usr/share/data", "/usr", "/srv/models", "/srv/models/small", "/usrlocal", "/opt/python3.11/lib")
    assert sandbox_probe.read_only_paths(extra) == ["/usr", "/bin", "/lib", "/lib64", "/etc", "/opt/python3.11",
                                                    "/srv/models", "/usrlocal"]
    monkeypatch.setattr(sandbox_probe.sys, "base_prefix", "/usr")  # a system Python: nothing to add
    assert sandbox_probe.read_only_paths() == ["/usr", "/bin", "/lib", "/lib64", "/etc"]


def test_the_launch_command_and_its_configuration(monkeypatch):
    monkeypatch.setattr(sandbox_probe.shutil, "which", lambda name, path: f"/sbin/{name}" if path else None)
    monkeypatch.setattr(sandbox_probe, "sandbox_python", lambda: "/opt/py/bin/python3")
    assert sandbox_probe.launch_argv({"uid": 5}, ["prog", "--flag"]) == [
        "/sbin/unshare", "--net", "--pid", "--fork", "--mount-proc", "--ipc", "--kill-child", "--",
        "/opt/py/bin/python3", "-I", "-S", "-B", str(Path(sandbox_probe.__file__).with_name("launch.py")),
        '{"uid": 5}', "--", "prog", "--flag"]
    monkeypatch.setattr(sandbox_probe, "read_only_paths", lambda extra=(): ["/usr", *extra])
    assert sandbox_probe.launch_config(uid=100007, workdir="/tmp/w", workdir_bytes=1 << 20, workdir_inodes=64,
                                       rlimits={"NPROC": 16}, cgroups=["/sys/fs/cgroup/x"], status_fd=5,
                                       extra_read_only=("/data",)) == {
        "uid": 100007, "gid": 100007, "workdir": "/tmp/w", "workdir_bytes": 1 << 20, "workdir_inodes": 64,
        "ro": ["/usr", "/data"], "rlimits": {"NPROC": 16}, "cgroups": ["/sys/fs/cgroup/x"], "status_fd": 5}
    assert sandbox_probe.launch_config(uid=1, workdir="/w", workdir_bytes=1, workdir_inodes=1, rlimits={},
                                       cgroups=[], status_fd=None)["ro"] == ["/usr"]


@needs_sandbox
def test_the_trial_sandbox_gets_an_allow_listed_environment(monkeypatch):
    monkeypatch.setenv("CISPO_PROBE_CANARY", "a secret of the worker's")
    monkeypatch.setattr(sandbox_probe, "_CHECK", _check_then("found['uid'] = sorted(os.environ)"))
    assert sandbox_probe._probe(PROBE_UID, 1).reason == (
        "the trial sandbox is not contained: {'uid': ['HOME', 'LANG', 'PATH', 'TMPDIR']}")


def test_each_uid_range_is_probed_and_cached_on_its_own(monkeypatch):
    monkeypatch.setattr(sandbox_probe, "_probe", lambda first, count: Probe("none", f"{first}+{count}"))
    sandbox_probe.forget_probes()
    try:
        assert [sandbox_probe.probe(*r).reason for r in [(1000, 1), (2000, 3), (1000, 1)]] == ["1000+1", "2000+3", "1000+1"]
    finally:
        sandbox_probe.forget_probes()
