"""Hostile user code in the sandbox: every attack returns, is recorded as a failure, and leaves nothing behind.

Each containment test checks that the call returns (in bounded time), that the
sample gets an error (or the attack visibly failed inside), that no process of
the sandbox survives close() (its pid namespace is empty, and pids the user
code reported are gone), that no directory, cgroup or process of the sandbox
uid leaks, and that this process (standing for the trainer) kept running.
"""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from service import sandbox_cgroup, sandbox_probe
from service.sandbox_probe import Probe
from service.sandbox_uids import lease_uid
from service.settings import get_settings
from worker import sandbox
from worker.rewards.sandbox import PythonRewardProcess
from worker.sandbox import Limits, SandboxError, SandboxUnavailable, members, python_argv, sandbox_level

SANDBOX_UIDS = range(get_settings().sandbox_uid, get_settings().sandbox_uid + get_settings().sandbox_uid_count)
needs_sandbox = pytest.mark.skipif(sandbox_level() != "namespaces",
                                   reason="this host cannot sandbox user code (sandbox_level() is 'none')")


def _uid_processes(uids: range) -> set[int]:
    found = set()
    for entry in os.listdir("/proc"):
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        uid_line = next((line for line in status.splitlines() if line.startswith("Uid:")), "")
        state = next((line for line in status.splitlines() if line.startswith("State:")), "")
        if uid_line.split()[1:2] and int(uid_line.split()[1]) in uids and " Z " not in state + " ":
            found.add(int(entry))
    return found


def _leftovers() -> dict[str, set]:
    return {
        "sandbox uid processes": _uid_processes(SANDBOX_UIDS),
        "workdirs": {p.name for p in Path("/tmp").glob("cispo-reward-*")  # not the reward runner's homes:
                     if not p.name.startswith("cispo-reward-test-")},  # other checkouts' tests make those
        "cgroups": {str(c) for p in sandbox_cgroup.parents()[1] for c in p.glob("cispo-sandbox-*")},
    }


@pytest.fixture
def trainer():
    """Stands for the trainer: a thread of this process that must keep ticking; nothing new left after the test."""
    before = _leftovers()
    ticks, stop = [0], threading.Event()

    def beat():
        while not stop.wait(0.02):
            ticks[0] += 1

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    yield ticks
    stop.set()
    thread.join()
    assert ticks[0] > 0
    deadline = time.monotonic() + 5
    while _new_since(before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _new_since(before) == {}


def _new_since(before: dict[str, set]) -> dict[str, set]:
    """What appeared since `before` and is still there (what others' sandboxes removed meanwhile is fine)."""
    return {k: v - before[k] for k, v in _leftovers().items() if v - before[k]}


class Run:
    """Scores one batch, then closes; keeps what the checks need (namespace, host pids, timing)."""

    def __init__(self, source: str, completions: list[str], rows: list[dict] | None = None, **options):
        self.proc = PythonRewardProcess(source, **options)
        rows = rows if rows is not None else [{}] * len(completions)
        try:
            self.proc._ensure_started()
            self.pid_ns = self.proc.sandbox.pid_ns
            self.holder = self.proc.pid
            self.workdir = self.proc.workdir
            started = time.monotonic()
            self.result = self.proc.score(completions, rows)
            self.elapsed = time.monotonic() - started
            self.budget = self.proc.batch_timeout(len(completions))
            self.peak = len(members(self.pid_ns))  # processes in the sandbox once the call returned
        finally:
            self.proc.close()

    def assert_nothing_survives(self, reported_host_pids=()):
        assert members(self.pid_ns) == {}
        for pid in (self.holder, *reported_host_pids):
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
        assert not self.workdir.exists()


@needs_sandbox
class TestContainment:
    def test_infinite_loop_is_killed_at_the_batch_deadline(self, trainer):
        source = ("import signal\ndef reward(completion, **row):\n"
                  "    signal.signal(signal.SIGALRM, signal.SIG_IGN)\n    while True:\n        pass\n")
        run = Run(source, ["a", "b"], timeout_s=0.5)
        assert run.budget <= run.elapsed < run.budget + 2
        assert run.result.scores == [None, None]
        assert run.result.errors == [f"timeout after {run.budget:g} s"] * 2
        run.assert_nothing_survives()

    def test_memory_bomb_is_a_sample_error(self, trainer):
        source = """
def reward(completion, **row):
    if completion == "bytes":
        b"x" * 10**10
    hoard = []
    while True:
        hoard.append(bytearray(10**7))
"""
        run = Run(source, ["bytes", "grow"], memory_bytes=256 << 20)
        assert run.result.scores == [None, None]
        assert [e.split(":")[0] for e in run.result.errors] == ["MemoryError", "MemoryError"]
        run.assert_nothing_survives()

    def test_fork_bomb_stops_at_the_process_limit_and_dies_at_close(self, trainer):
        source = """
import os, time
def reward(completion, **row):
    made = 0
    while True:
        try:
            pid = os.fork()
        except OSError:
            if completion == "count":
                return float(made)
            time.sleep(0.01)
            continue
        if pid == 0:  # every child keeps forking too, forever
            while True:
                try:
                    os.fork()
                except OSError:
                    time.sleep(0.01)
        made += 1
"""
        run = Run(source, ["count"], timeout_s=2, max_processes=32)
        assert 0 < run.result.scores[0] <= 32
        assert run.peak <= 32 + 2  # the bound held: its init and the reward child, plus at most the limit
        run.assert_nothing_survives()

        bomb = Run(source, ["bomb"], timeout_s=1, max_processes=32)
        assert bomb.elapsed < bomb.budget + 2
        assert bomb.result.scores == [None] and bomb.result.errors[0].startswith("timeout")
        bomb.assert_nothing_survives()

    def test_network_is_unreachable(self, trainer):
        canary = socket.socket()
        canary.bind(("127.0.0.1", 0))
        canary.listen(8)
        canary.setblocking(False)
        targets = [("8.8.8.8", 53), ("127.0.0.1", 6379), ("127.0.0.1", 5432), ("127.0.0.1", canary.getsockname()[1])]
        reachable_here = []
        for host, port in targets[1:3]:  # control: Redis and PostgreSQL do listen on this machine's loopback
            try:
                socket.create_connection((host, port), timeout=2).close()
                reachable_here.append(port)
            except OSError:
                pass
        source = """
import socket
def reward(completion, host, port, **row):
    try:
        if host == "unix":
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(2)
            s.connect(port)
        elif host == "dns":
            socket.getaddrinfo("example.com", 443)
        else:
            socket.create_connection((host, port), timeout=2)
    except OSError as e:
        raise RuntimeError(f"errno {e.errno}") from None
    return 1.0
"""
        rows = [{"host": h, "port": p} for h, p in targets]
        rows += [{"host": "unix", "port": "/run/postgresql/.s.PGSQL.5432"}, {"host": "dns", "port": 0}]
        run = Run(source, ["x"] * len(rows), rows)
        assert run.result.scores == [None] * len(rows)
        for row, error in zip(rows[:4], run.result.errors):
            assert error == f"RuntimeError: errno {errno.ENETUNREACH}", row
        assert run.result.errors[4] == f"RuntimeError: errno {errno.ENOENT}"  # no /run in its file system
        assert run.result.errors[5].startswith("RuntimeError: errno")
        with pytest.raises(BlockingIOError):
            canary.accept()  # nothing ever connected to the host's loopback
        canary.close()
        assert reachable_here == [6379, 5432] or not reachable_here  # the control, where the servers run
        run.assert_nothing_survives()

    def test_planted_secrets_are_invisible(self, trainer, monkeypatch):
        canaries = {"DATABASE_URL": "postgresql://canary-db-secret", "AWS_SECRET_ACCESS_KEY": "canary-aws-secret"}
        for k, v in canaries.items():
            monkeypatch.setenv(k, v)
        source = """
import os
def reward(completion, **row):
    seen = [repr(dict(os.environ))]
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                seen.append(open(f"/proc/{pid}/environ", "rb").read().decode())
            except OSError as e:
                seen.append(f"{pid}: {e.strerror}")
    raise RuntimeError(" | ".join(seen))
"""
        run = Run(source, ["x"])
        error = run.result.errors[0]
        assert "PATH" in error and "Permission denied" in error  # it looked: its own env, and /proc/1 refused
        for value in canaries.values():
            assert value not in error
        for name in canaries:
            assert name not in error
        run.assert_nothing_survives()

    def test_service_files_are_unreadable(self, trainer, tmp_path):
        secret = tmp_path / "settings.env"  # stands for the service's settings / database, outside the sandbox
        secret.write_text("DATABASE_URL=postgresql://canary\n")
        secret.chmod(0o600)
        source = """
import os
def reward(completion, path, **row):
    try:
        with open(path) as f:
            return 1.0 if f.read() else 2.0
    except OSError as e:
        raise RuntimeError(e.strerror) from None
"""
        paths = [str(secret), "/etc/shadow", "/proc/1/environ", "/work/main/service/settings.py", "inside.secret"]
        proc = PythonRewardProcess(source)
        try:
            proc._ensure_started()
            pid_ns, workdir = proc.sandbox.pid_ns, proc.workdir
            child = {inner: host for host, inner in proc.sandbox.members().items()}[2]
            inside = Path(f"/proc/{child}/root{workdir}/inside.secret")  # root-owned 0600 in its own tmpfs
            inside.write_text("canary")
            inside.chmod(0o600)
            result = proc.score(["x"] * len(paths), [{"path": p} for p in paths])
        finally:
            proc.close()
        assert result.scores == [None] * len(paths)
        assert result.errors == ["RuntimeError: No such file or directory", "RuntimeError: Permission denied",
                                 "RuntimeError: Permission denied", "RuntimeError: No such file or directory",
                                 "RuntimeError: Permission denied"]
        assert members(pid_ns) == {}

    def test_writes_outside_its_directory_are_refused(self, trainer, tmp_path):
        name = f"cispo-escape-{os.getpid()}"
        targets = [str(tmp_path / name), f"/tmp/{name}", f"/{name}", f"/etc/{name}", f"/dev/shm/{name}",
                   f"/var/tmp/{name}", f"../{name}"]
        source = """
import os
def reward(completion, path, **row):
    if path == "big":
        with open("big", "wb") as f:
            for _ in range(64):
                f.write(b"x" * (1 << 20))
        return 1.0
    try:
        with open(path, "w") as f:
            f.write("escaped")
    except OSError as e:
        raise RuntimeError(e.strerror) from None
    return 1.0
"""
        run = Run(source, ["x"] * (len(targets) + 1), [{"path": p} for p in [*targets, "big"]])
        assert run.result.scores == [None] * (len(targets) + 1)
        assert all(e in ("RuntimeError: Read-only file system", "RuntimeError: No such file or directory",
                         "RuntimeError: Permission denied") for e in run.result.errors[:-1]), run.result.errors
        assert run.result.errors[-1] == "OSError: [Errno 27] File too large"  # RLIMIT_FSIZE, 16 MiB
        for t in targets:
            assert not os.path.exists(t if t.startswith("/") else run.workdir.parent / name)
        run.assert_nothing_survives()

    def test_printing_gigabytes_goes_nowhere_and_floods_are_capped(self, trainer):
        source = """
import os, sys
def reward(completion, **row):
    if completion == "print":
        chunk = "x" * (1 << 26)
        for _ in range(16):  # 1 GiB on stdout, more on fds 1 and 2
            sys.stdout.write(chunk)
        for fd in (1, 2):
            os.write(fd, b"y" * (1 << 26))
        return 1.0
    for fd in range(3, 64):  # the protocol is among these: flood every one of them
        try:
            os.set_blocking(fd, True)
            for _ in range(16):
                os.write(fd, b"z" * (1 << 20))
        except OSError:
            pass
    return 2.0
"""
        proc = PythonRewardProcess(source, timeout_s=30)
        try:
            assert proc.score(["print", "print"], [{}] * 2).scores == [1.0, 1.0]  # the protocol survived
            pid_ns = proc.sandbox.pid_ns
            flooded = proc.score(["flood"], [{}])
            assert flooded.scores == [None] and "larger than" in flooded.errors[0]
            assert members(pid_ns) == {}  # that sandbox is gone; the next batch gets a new one
            assert proc.score(["print"], [{}]).scores == [1.0]
        finally:
            proc.close()

    def test_bad_values_and_raising_are_per_sample_errors(self, trainer):
        source = """
def reward(completion, **row):
    if completion == "string":
        return "1.0"
    if completion == "nan":
        return float("nan")
    if completion == "raise":
        raise KeyError("boom")
    return 0.5
"""
        run = Run(source, ["string", "nan", "raise", "ok"])
        assert run.result.scores == [None, None, None, 0.5]
        assert run.result.errors[:3] == ["TypeError: returned str, not a number", "ValueError: returned nan",
                                         "KeyError: 'boom'"]
        run.assert_nothing_survives()

    def test_setsid_double_forked_daemon_dies_with_the_sandbox(self, trainer):
        source = """
import os, time
def reward(completion, **row):
    r, w = os.pipe()
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            signal = __import__("signal")
            for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
                signal.signal(s, signal.SIG_IGN)
            os.write(w, str(os.getpid()).encode())
            while True:
                time.sleep(1)
        os._exit(0)
    os.wait()
    return float(os.read(r, 64))
"""
        proc = PythonRewardProcess(source)
        try:
            ns_pid = int(proc.score(["x"], [{}]).scores[0])
            pid_ns = proc.sandbox.pid_ns
            daemon = {inner: host for host, inner in proc.sandbox.members().items()}[ns_pid]
            os.kill(daemon, 0)  # alive while the job runs
            holder, workdir = proc.pid, proc.workdir
        finally:
            proc.close()
        assert members(pid_ns) == {}
        for pid in (daemon, holder):
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
        assert not workdir.exists()

    def test_the_sandbox_dies_with_its_parent(self, trainer, tmp_path):
        """If the worker itself is SIGKILLed, its sandboxes end too (the launcher watches a socket)."""
        script = tmp_path / "parent.py"
        script.write_text(
            "import sys, time\n"
            "from worker.sandbox import Limits, new_workdir, sandbox_python, spawn\n"
            "proc = spawn([sandbox_python(), '-I', '-S', '-c', 'import time\\nwhile True: time.sleep(1)'],\n"
            "             workdir=new_workdir('cispo-reward-'), limits=Limits())\n"
            "print(proc.pid_ns, proc.workdir, ','.join(map(str, proc.cgroup.paths)), flush=True)\n"
            "time.sleep(60)\n")
        parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                                  cwd=Path(__file__).resolve().parents[2])
        try:
            pid_ns, workdir, cgroups = parent.stdout.readline().split()
            assert len(members(pid_ns)) == 2
        finally:
            parent.kill()
            parent.wait()
        deadline = time.monotonic() + 5
        while members(pid_ns) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert members(pid_ns) == {}
        Path(workdir).rmdir()  # the dead parent could not; the sandbox never wrote to it
        for cgroup in cgroups.split(","):
            Path(cgroup).rmdir()  # succeeds only when no task is left in it (a later spawn sweeps such dirs)

    def test_spawn_is_reusable_for_other_children(self, trainer, tmp_path):
        """The API an environment runner uses: its own stdlib script, its own protocol, then kill()."""
        script = tmp_path / "echo_child.py"
        script.write_text("import os, sys\nfor line in sys.stdin:\n"
                          "    sys.stdout.write(f'{os.getuid()} {os.getpid()} {line}')\n    sys.stdout.flush()\n")
        workdir = sandbox.new_workdir("cispo-reward-")
        proc = sandbox.spawn(python_argv(script), workdir=workdir, limits=Limits(cpu_s=5))
        try:
            proc.stdin.write(b"reset 7\n")
            proc.stdin.flush()
            assert proc.stdout.readline() == f"{proc.uid} 2 reset 7\n".encode()
            assert proc.uid in SANDBOX_UIDS
        finally:
            sandbox.kill(proc)
            sandbox.kill(proc)  # idempotent
        assert members(proc.pid_ns) == {}

        quick = sandbox.spawn(["/bin/true"], workdir=workdir, limits=Limits())  # ends before spawn() returns
        assert quick.wait(timeout=5) == 0
        sandbox.kill(quick)
        workdir.rmdir()

        with pytest.raises(SandboxError, match="did not start.*No such file"):
            sandbox.spawn(["/nonexistent/program"], workdir=tmp_path / "w", limits=Limits())
        (tmp_path / "w").rmdir()

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
        import service._sandbox_launch as launcher

        numbers = launcher.SYSCALLS[os.uname().machine][1]
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
        calls = {"unshare": [0x10000000], "setns": [0, 0], "io_uring_setup": [1, 0], "io_uring_enter": [0, 0, 0, 0, 0],
                 "io_uring_register": [0, 0, 0, 0], "keyctl": [0, -3, 0], "add_key": [0, 0, 0, 0, -3],
                 "request_key": [0, 0, 0, 0], "ptrace": [0, 0, 0, 0], "process_vm_readv": [1, 0, 0, 0, 0, 0],
                 "mount": [0, 0, 0, 0, 0], "umount2": [0, 0], "bpf": [0, 0, 0], "perf_event_open": [0, 0, -1, -1, 0],
                 "userfaultfd": [0], "kexec_load": [0, 0, 0, 0], "init_module": [0, 0, 0],
                 "finit_module": [-1, 0, 0], "delete_module": [0, 0], "clone": [clone_newuser, 0, 0, 0, 0]}
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
        numbers = __import__("service._sandbox_launch", fromlist=["SYSCALLS"]).SYSCALLS[os.uname().machine][1]
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


@pytest.fixture
def fresh_settings():
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


def test_sandbox_off_refuses_user_code(monkeypatch, fresh_settings):
    monkeypatch.setenv("CISPO_SANDBOX", "off")
    with pytest.raises(SandboxUnavailable, match=r"^user Python code is refused: the sandbox is turned off"):
        PythonRewardProcess("def reward(c, **r):\n    return 1.0\n")
    assert sandbox_level() == "none"
    with pytest.raises(SandboxUnavailable):
        sandbox.spawn(["/bin/true"], workdir=Path("/nonexistent"), limits=Limits())


def test_a_host_without_namespaces_refuses_user_code(monkeypatch, fresh_settings):
    monkeypatch.setenv("CISPO_SANDBOX", "auto")
    monkeypatch.setattr(sandbox, "probe", lambda first, count: Probe("none", "unshare failed"))
    with pytest.raises(SandboxUnavailable,
                       match=r"^user Python code is refused: this host cannot isolate it \(no namespaces\)"):
        PythonRewardProcess("def reward(c, **r):\n    return 1.0\n")


def test_a_refused_sandbox_fails_the_job_with_that_message(monkeypatch, fresh_settings):
    pytest.importorskip("torch")
    from service.schemas.rewards import PythonReward
    from worker.trainer.rewards import make_scorer

    monkeypatch.setenv("CISPO_SANDBOX", "off")
    with pytest.raises(ValueError, match="user Python code is refused"):  # job_runner: ValueError -> failed job
        make_scorer(PythonReward(source="def reward(c, **r):\n    return 1.0\n"))


def test_exit_status_maps_the_launchers_signal_codes():
    assert sandbox.exit_status(128 + signal.SIGSEGV) == -signal.SIGSEGV
    assert sandbox.exit_status(3) == 3 and sandbox.exit_status(-9) == -9 and sandbox.exit_status(None) is None


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
        assert sandbox_probe.effective_level("auto", 1000, 1) == "namespaces"
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


def test_seccomp_program_jumps_stay_inside_the_program():
    import struct

    import service._sandbox_launch as launcher

    for machine in launcher.SYSCALLS:
        program = launcher.seccomp_program(machine)
        code = list(struct.iter_unpack("=HBBI", program))
        for i, (op, jt, jf, _k) in enumerate(code):
            if op & 0x07 == 0x05:  # BPF_JMP
                assert i + 1 + max(jt, jf) < len(code)
        assert code[-1][0] == launcher.RET and code[-1][3] == launcher.RET_ERRNO | errno.ENOSYS
    with pytest.raises(launcher.SetupError, match="no syscall table"):
        launcher.seccomp_program("sparc")
