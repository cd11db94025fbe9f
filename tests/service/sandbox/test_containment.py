"""Hostile user code in the sandbox: every attack returns, is recorded as a failure, and leaves nothing behind.

Each containment test checks that the call returns (in bounded time), that the
sample gets an error (or the attack visibly failed inside), that no process of
the sandbox survives close() (its pid namespace is empty, and pids the user
code reported are gone), that no directory, cgroup or process of the sandbox
uid leaks, and that this process (standing for the trainer) kept running.
"""

from __future__ import annotations

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

from service.sandbox.probe import Probe
from service.sandbox import spawn as sandbox
from worker.rewards.sandbox import PythonRewardProcess
from service.sandbox.spawn import Limits, SandboxError, SandboxUnavailable, members, python_argv, sandbox_level
from tests.service.sandbox.attacks import SANDBOX_UIDS, Run, fresh_settings, needs_sandbox, trainer  # noqa: F401


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
            "from service.sandbox.spawn import Limits, new_workdir, sandbox_python, spawn\n"
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
        assert (tmp_path / "w").stat().st_mode & 0o777 == 0o700  # spawn made the placeholder, private
        (tmp_path / "w").rmdir()



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


def test_a_dead_child_is_described_by_its_signal_or_its_exit_code():
    from service.sandbox.channel import describe_death

    assert describe_death(-signal.SIGSEGV, "reward process") == "reward process died (signal 11)"
    assert describe_death(0, "environment process") == "environment process died (exit code 0)"  # ended early
    assert describe_death(1, "reward process") == "reward process died (exit code 1)"
    assert describe_death(None, "reward process") == "reward process died (exit code None)"



_ECHO = """import json, os
while True:
    asked = json.loads(os.read(0, 4096))
    os.write(1, asked['raw'].encode() if 'raw' in asked else json.dumps('x' * asked['n']).encode() + b'\\n')
"""  # answers {"n": N} with a JSON string of N x's (N + 3 bytes with its newline), {"raw": text} with text


@needs_sandbox
@pytest.mark.parametrize("answer, error", [({"n": 101}, "answer larger than 103 bytes"),
                                           ({"raw": '"a"\n"b"\n'}, "unexpected output after its answer"),
                                           ({"raw": "{nope\n"}, "malformed answer")])
def test_the_channel_takes_one_json_line_of_at_most_its_cap(tmp_path, trainer, answer, error):
    from service.sandbox.channel import ChildFailed, JsonLinesChild

    (tmp_path / "echo.py").write_text(_ECHO)
    child = JsonLinesChild(tmp_path / "echo.py", limits=Limits(), prefix="cispo-reward-")
    try:
        assert child.exchange({"n": 100}, time.monotonic() + 20, max_bytes=103) == "x" * 100  # exactly the cap
        with pytest.raises(ChildFailed, match=f"^{error}$"):
            child.exchange(answer, time.monotonic() + 20, max_bytes=103)
    finally:
        child.stop()


def test_limits_become_these_rlimits():
    assert Limits().rlimits() == {"AS": 1 << 30, "FSIZE": 16 << 20, "NOFILE": 64, "NPROC": 64, "CORE": 0}
    assert Limits(cpu_s=7, address_space_bytes=5, file_size_bytes=6, open_files=8, max_processes=9).rlimits() == {
        "AS": 5, "FSIZE": 6, "NOFILE": 8, "NPROC": 9, "CORE": 0, "CPU": 7}


def test_python_argv_runs_the_scripts_as_one_isolated_program(tmp_path):
    (tmp_path / "a.py").write_text("A = 1\n")
    (tmp_path / "b.py").write_text("print(A)")
    assert python_argv(tmp_path / "a.py", tmp_path / "b.py") == [sandbox.sandbox_python(), "-I", "-S", "-B", "-c",
                                                                 "A = 1\n\nprint(A)"]


def test_a_new_workdir_is_private_and_named_for_its_use():
    workdir = sandbox.new_workdir("cispo-test-")
    try:
        assert workdir.name.startswith("cispo-test-") and workdir.stat().st_mode & 0o777 == 0o700
    finally:
        workdir.rmdir()
    workdir = sandbox.new_workdir()
    workdir.rmdir()
    assert workdir.name.startswith("cispo-sandbox-")


def test_exit_status_reads_only_128_plus_a_signal_number_as_a_signal():
    assert [sandbox.exit_status(128 + n) for n in (0, 1, 64, 65)] == [128, -1, -64, 193]


def test_the_launchers_status_line_is_read_whole_and_within_its_deadline():
    def read(*sends: bytes, close: bool = True, wait_s: float = 5.0) -> str:
        ours, theirs = socket.socketpair()
        with ours, theirs:
            def send():
                for data in sends:
                    theirs.sendall(data)
                    time.sleep(0.05)  # each its own chunk
                if close:
                    theirs.shutdown(socket.SHUT_WR)

            sender = threading.Thread(target=send, daemon=True)
            sender.start()

            def overdue(signum, frame):
                raise TimeoutError("_read_status waited past its deadline")

            previous = signal.signal(signal.SIGALRM, overdue)  # a read that ignores the deadline fails, not hangs
            signal.setitimer(signal.ITIMER_REAL, wait_s + 2)
            try:
                return sandbox._read_status(ours, time.monotonic() + wait_s)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous)
                sender.join()

    assert read(b"ok pid:[4026532", b"]\n") == "ok pid:[4026532]"  # one line, from however many chunks
    assert read(b"error: no such file\n", close=False) == "error: no such file"  # the line, not the socket's end
    assert read(b"ok pid:[4") == "ok pid:[4"  # the launcher died mid-line: what it said
    assert read() == ""  # it died without a word
    assert read(b"\xffok\n") == "\ufffdok"
    started = time.monotonic()
    assert read(b"ok", close=False, wait_s=0.3) == "error: the launcher did not answer in time"
    assert read(close=False, wait_s=0) == "error: the launcher did not answer in time"
    assert time.monotonic() - started < 2


class _Ended:
    """What kill() reads of a sandbox whose process already ended: its files, cgroup, uid lease, namespace."""

    def __init__(self, pid_ns=None):
        self.returncode, self.pid_ns, self.cgroup = 0, pid_ns, "its cgroup"
        self.stdin, self.stdout, self.stderr, self.status = (_Closable() for _ in range(4))
        self.uid_lease = _Closable()


class _Closable:
    closed = released = 0

    def close(self):
        self.closed += 1

    def release(self):
        self.released += 1


def test_kill_of_an_ended_sandbox_closes_its_files_drops_its_cgroup_and_frees_its_uid(monkeypatch, caplog):
    removed = []
    monkeypatch.setattr(sandbox, "remove_cgroup", lambda cgroup: removed.append(cgroup) or len(removed) > 1)
    proc = _Ended()
    sandbox.kill(proc)
    assert [f.closed for f in (proc.stdin, proc.stdout, proc.stderr, proc.status)] == [1, 1, 1, 1]
    assert removed == ["its cgroup"] and proc.cgroup is None and proc.uid_lease.released == 1
    assert [r.getMessage() for r in caplog.records] == ["sandbox cgroup its cgroup could not be removed"]
    caplog.clear()
    sandbox.kill(proc)  # again: nothing more to drop, nothing to warn about
    assert removed == ["its cgroup", None] and caplog.records == []


def test_kill_keeps_the_uid_leased_while_a_process_of_the_sandbox_survives(monkeypatch):
    monkeypatch.setattr(sandbox, "remove_cgroup", lambda cgroup: True)
    monkeypatch.setattr(sandbox, "members", lambda pid_ns: {4242: 7} if pid_ns == "pid:[1]" else {})
    monkeypatch.setattr(sandbox, "KILL_TIMEOUT_S", 0.2)
    proc = _Ended(pid_ns="pid:[1]")
    started = time.monotonic()
    with pytest.raises(SandboxError, match=r"^sandbox processes survived the kill: \[4242\]$"):
        sandbox.kill(proc)
    assert 0.2 <= time.monotonic() - started < 2  # it waited for them to go, until the deadline
    assert proc.uid_lease.released == 0 and proc.cgroup is None


def test_members_are_the_live_processes_of_a_namespace_by_their_pid_in_it():
    here = os.readlink("/proc/self/ns/pid")
    ended = subprocess.Popen(["/bin/true"])  # a zombie until it is reaped
    alive = subprocess.Popen(["/bin/sleep", "60"])  # after it in /proc
    try:
        deadline = time.monotonic() + 10
        while "\nState:\tZ" not in Path(f"/proc/{ended.pid}/status").read_text() and time.monotonic() < deadline:
            time.sleep(0.01)
        found = members(here)
        assert found[os.getpid()] == os.getpid() and found[alive.pid] == alive.pid and ended.pid not in found
    finally:
        ended.wait()
        alive.kill()
        alive.wait()
    assert members("pid:[0]") == {}


@needs_sandbox
def test_a_sandbox_names_its_init_and_its_target_by_their_pids_inside(trainer):
    workdir = sandbox.new_workdir("cispo-reward-")
    proc = sandbox.spawn(["/bin/sleep", "60"], workdir=workdir, limits=Limits(max_processes=9))
    try:
        assert sorted(proc.members().values()) == [1, 2] and proc.pid not in proc.members()
        pids_max = [(path / "pids.max").read_text() for path in proc.cgroup.paths if (path / "pids.max").exists()]
        assert pids_max == ["10\n"]  # its processes and its init
    finally:
        sandbox.kill(proc)
        workdir.rmdir()
    assert proc.members() == {} and proc.returncode is not None


def test_kill_before_the_namespace_exists_kills_the_launchers_process_group():
    """A launcher that never answered has no namespace to end: kill() SIGKILLs its session's process group."""
    proc = subprocess.Popen(["/bin/sleep", "60"], start_new_session=True)
    proc.pid_ns = proc.cgroup = proc.uid_lease = proc.status = None
    try:
        sandbox.kill(proc)
        assert proc.returncode == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@needs_sandbox
def test_a_sandbox_without_a_uid_or_a_cgroup_did_not_start_and_holds_nothing(monkeypatch, tmp_path):
    def no_uid(first, count):
        raise sandbox.NoUidFree("all 3 sandbox uids are in use")

    monkeypatch.setattr(sandbox, "lease_uid", no_uid)
    with pytest.raises(SandboxError, match=r"^the sandbox did not start: all 3 sandbox uids are in use$"):
        sandbox.spawn(["/bin/true"], workdir=tmp_path / "a", limits=Limits())

    def no_cgroup(memory_bytes, max_processes):
        raise sandbox.CgroupUnavailable("no writable cgroup")

    lease = _Closable()
    monkeypatch.setattr(sandbox, "lease_uid", lambda first, count: lease)
    monkeypatch.setattr(sandbox, "new_cgroup", no_cgroup)
    with pytest.raises(SandboxError, match=r"^the sandbox did not start: no writable cgroup$"):
        sandbox.spawn(["/bin/true"], workdir=tmp_path / "b", limits=Limits())
    assert lease.released == 1


@needs_sandbox
def test_the_target_gets_the_allow_listed_environment_and_no_stderr_of_ours(trainer, capfd, monkeypatch, tmp_path):
    monkeypatch.setenv("CISPO_CANARY", "a secret of the worker's")
    workdir = sandbox.new_workdir("cispo-reward-")
    proc = sandbox.spawn(["/bin/sh", "-c", "env; echo a flood >&2"], workdir=workdir, limits=Limits())
    try:
        printed = proc.stdout.read().decode()
        proc.wait(timeout=10)
    finally:
        sandbox.kill(proc)
        workdir.rmdir()
    shell_own = {"PWD", "OLDPWD", "SHLVL", "_"}  # what sh sets itself
    assert dict(line.split("=", 1) for line in printed.splitlines() if line.split("=", 1)[0] not in shell_own) == {
        "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0", "HOME": str(workdir),
        "TMPDIR": str(workdir)}
    assert capfd.readouterr().err == ""  # the sandbox's stderr goes nowhere unless the caller asks for it


@needs_sandbox
def test_extra_read_only_paths_are_visible_and_read_only(trainer, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "data.txt").write_text("readable\n")
    shared.chmod(0o755)
    tmp_path.chmod(0o755)
    workdir = sandbox.new_workdir("cispo-reward-")
    script = f"cat {shared}/data.txt; touch {shared}/new 2>/dev/null || echo refused"
    proc = sandbox.spawn(["/bin/sh", "-c", script], workdir=workdir, limits=Limits(), extra_read_only=(str(shared),))
    try:
        printed = proc.stdout.read().decode()
        proc.wait(timeout=10)
    finally:
        sandbox.kill(proc)
        workdir.rmdir()
    assert printed == "readable\nrefused\n" and not (shared / "new").exists()


@needs_sandbox
@pytest.mark.parametrize("status, error", [(OSError("connection reset"), "error: connection reset"),
                                           ("", "no answer from its launcher")])
def test_a_launcher_that_does_not_answer_ok_did_not_start(monkeypatch, trainer, status, error):
    def read_status(sock, deadline):
        if isinstance(status, Exception):
            raise status
        return status

    monkeypatch.setattr(sandbox, "_read_status", read_status)
    workdir = sandbox.new_workdir("cispo-reward-")
    try:
        with pytest.raises(SandboxError, match=f"^the sandbox did not start: {error}$"):
            sandbox.spawn(["/bin/sleep", "60"], workdir=workdir, limits=Limits())
        time.sleep(0.05)  # long enough for the trainer fixture's thread to tick
    finally:
        workdir.rmdir()
