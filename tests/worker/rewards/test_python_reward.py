"""User Python rewards in the sandbox child: scoring, failures, timeouts, isolation, cleanup.

The containment itself (network, files, fork bombs, ...) is tests/service/sandbox/test_containment.py.
"""

from __future__ import annotations

import os
import signal
import stat
import time
from pathlib import Path

import pytest

from worker.rewards.sandbox import PythonRewardPool, PythonRewardProcess, RewardLoadError
from service.sandbox.spawn import sandbox_level

pytestmark = pytest.mark.skipif(sandbox_level() != "namespaces",
                                reason="this host cannot sandbox user code (sandbox_level() is 'none')")

ROWS = [{"answer": "a"}, {"answer": "b"}, {"answer": "c"}]


def _gone(pid: int, wait_s: float = 5.0) -> bool:
    """True once pid no longer exists (or is a zombie: killed, waiting for a reaper that is not us)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def test_scores_a_batch_and_keeps_one_child():
    source = "def reward(completion, answer, **row):\n    return 1.0 if completion == answer else 0.25\n"
    with PythonRewardProcess(source) as proc:
        first = proc.score(["a", "x", "c"], ROWS)
        assert first.scores == [1.0, 0.25, 1.0]
        assert first.errors == [None, None, None]
        pid = proc.pid
        assert proc.score(["x"], ROWS[:1]).scores == [0.25]
        big = ["y" * 1_000_000] * 3  # several MB each way through the pipes
        assert proc.score(big, [{"answer": "y" * 1_000_000}] * 3).scores == [1.0, 1.0, 1.0]
        assert proc.pid == pid  # one long-lived child per job
    assert proc.pid is None and _gone(pid)


def test_bad_values_are_per_sample_errors_and_others_still_score():
    source = """
import math
class Loud:
    def __float__(self):
        raise RuntimeError("no float for you")
def reward(completion, **row):
    if completion == "raise":
        raise ZeroDivisionError("x" * 2000)
    if completion == "string":
        return "1.0"
    if completion == "nan":
        return math.nan
    if completion == "inf":
        return -math.inf
    if completion == "bool":
        return True
    if completion == "exit":
        raise SystemExit(3)
    return 0.5
"""
    kinds = ["ok", "raise", "string", "nan", "inf", "bool", "exit", "ok"]
    with PythonRewardProcess(source) as proc:
        result = proc.score(kinds, [{}] * len(kinds))
    assert result.scores == [0.5, None, None, None, None, None, None, 0.5]
    assert result.errors[0] is None and result.errors[-1] is None
    assert result.errors[1].startswith("ZeroDivisionError: xxx") and len(result.errors[1]) == 500
    assert result.errors[2] == "TypeError: returned str, not a number"
    assert result.errors[3] == "ValueError: returned nan"
    assert result.errors[4] == "ValueError: returned -inf"
    assert result.errors[5] == "TypeError: returned bool, not a number"
    assert result.errors[6] == "SystemExit: 3"


def test_slow_sample_times_out_alone():
    """A pure-Python loop is stopped by the child's per-sample timer; the batch's other samples score."""
    source = "def reward(completion, **row):\n    while completion == 'loop':\n        pass\n    return 1.0\n"
    with PythonRewardProcess(source, timeout_s=0.3) as proc:
        pid = proc.pid
        result = proc.score(["a", "loop", "b"], [{}] * 3)
        assert result.scores == [1.0, None, 1.0]
        assert result.errors[1] == "timeout after 0.3 s"
        assert proc.pid == pid or pid is None


def test_unstoppable_loop_is_killed_and_next_batch_gets_a_new_child():
    source = """
import signal
def reward(completion, **row):
    if completion == "loop":
        signal.signal(signal.SIGALRM, signal.SIG_IGN)  # defeats the child's own timer
        while True:
            pass
    return 1.0
"""
    with PythonRewardProcess(source, timeout_s=0.3) as proc:
        assert proc.score(["a"], [{}]).scores == [1.0]
        old_pid, old_dir = proc.pid, proc.workdir
        started = time.monotonic()
        result = proc.score(["a", "loop", "b"], [{}] * 3)
        elapsed = time.monotonic() - started
        budget = proc.batch_timeout(3)
        assert budget == pytest.approx(1.9)
        assert budget <= elapsed < budget + 1.5
        assert result.scores == [None, None, None]
        assert result.errors == [f"timeout after {budget:g} s"] * 3
        assert proc.pid is None and _gone(old_pid) and not old_dir.exists()

        again = proc.score(["a", "b"], [{}] * 2)
        assert again.scores == [1.0, 1.0]
        assert proc.pid not in (None, old_pid)


def test_batch_deadline_is_capped():
    proc = PythonRewardProcess("def reward(c, **r):\n    return 1\n", timeout_s=10, max_batch_timeout_s=60)
    assert proc.batch_timeout(2) == 21.0
    assert proc.batch_timeout(1000) == 60.0
    proc.close()


def test_crash_fails_the_batch_and_restarts():
    source = """
import os, signal
def reward(completion, **row):
    if completion == "crash":
        os.kill(os.getpid(), signal.SIGSEGV)
    return 2.0
"""
    with PythonRewardProcess(source) as proc:
        result = proc.score(["a", "crash"], [{}] * 2)
        assert result.scores == [None, None]
        assert result.errors == [f"reward process died (signal {int(signal.SIGSEGV)})"] * 2
        assert proc.score(["a"], [{}]).scores == [2.0]


def test_garbage_on_the_protocol_fails_the_batch_and_restarts():
    source = """
import os
def reward(completion, **row):
    if completion == "forge":
        for fd in range(3, 64):
            try:
                os.write(fd, b"not json\\n")
            except OSError:
                pass
    return 1.0
"""
    with PythonRewardProcess(source) as proc:
        result = proc.score(["forge"], [{}])
        assert result.scores == [None]
        assert result.errors[0].startswith("reward process sent an invalid answer")
        assert proc.score(["a"], [{}]).scores == [1.0]


def test_printing_does_not_break_the_protocol():
    source = """
import os, sys
def reward(completion, **row):
    print("x" * 1_000_000)
    print('{"scores": [9.0], "errors": [null]}')
    sys.stderr.write("e" * 100_000)
    os.write(1, b"raw fd 1\\n")
    os.write(2, b"raw fd 2\\n")
    sys.__stdout__.write("dunder\\n")
    sys.__stdout__.flush()
    return float(len(completion))
"""
    with PythonRewardProcess(source) as proc:
        assert proc.score(["ab", "abc"], [{}] * 2).scores == [2.0, 3.0]
        assert proc.score(["abcd"], [{}]).scores == [4.0]


def test_child_does_not_see_the_parent_environment(monkeypatch):
    monkeypatch.setenv("DATABASE_URL", "postgresql://secret")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "hunter2")
    source = """
import os
def reward(completion, **row):
    if completion == "db":
        return 1.0 if "DATABASE_URL" in os.environ else 0.0
    if completion == "aws":
        return 1.0 if any(k.startswith("AWS") for k in os.environ) else 0.0
    allowed = {"PATH", "LANG", "PYTHONHASHSEED", "HOME", "TMPDIR"}
    return 1.0 if set(os.environ) <= allowed and os.environ["PYTHONHASHSEED"] == "0" else 0.0
"""
    with PythonRewardProcess(source) as proc:
        assert proc.score(["db", "aws", "allow-list"], [{}] * 3).scores == [0.0, 0.0, 1.0]


def _host_pid(proc: PythonRewardProcess, ns_pid: int) -> int:
    """The host pid of the sandbox process that sees itself as ns_pid (pids user code reports are these)."""
    return {inner: host for host, inner in proc.sandbox.members().items()}[ns_pid]


def test_cwd_is_a_private_temp_dir_removed_after_close():
    source = """
import os
def reward(completion, **row):
    cwd = os.getcwd()
    assert os.environ["HOME"] == os.environ["TMPDIR"] == cwd, (cwd, dict(os.environ))
    os.makedirs("sub/deeper")
    with open("sub/deeper/out.txt", "w") as f:
        f.write("hi")
    os.chmod("sub/deeper", 0o500)  # read-only: removal must still work
    os.chmod("sub", 0o500)
    return 1.0
"""
    proc = PythonRewardProcess(source)
    try:
        assert proc.score(["a"], [{}]).errors == [None]
        workdir = proc.workdir
        child = _host_pid(proc, 2)  # the reward child; pid 1 is the sandbox's init
        inside = Path(f"/proc/{child}/root{workdir}")  # its tmpfs, seen through its own root
        assert inside.is_dir() and (inside / "sub" / "deeper" / "out.txt").is_file()
        assert stat.S_IMODE(inside.stat().st_mode) == 0o700
        assert inside.stat().st_uid == proc.sandbox.uid  # the sandbox's own uid owns it
        assert Path(os.readlink(f"/proc/{child}/cwd")) == workdir
        assert workdir != Path.cwd()
        assert workdir.is_dir() and not any(workdir.iterdir())  # nothing reached the host's disk
    finally:
        proc.close()
    assert not workdir.exists()
    with pytest.raises(RuntimeError, match="closed"):
        proc.score(["a"], [{}])


def test_memory_limit_is_a_sample_error():
    source = "def reward(completion, **row):\n    if completion == 'big':\n        bytearray(2 << 30)\n    return 1.0\n"
    with PythonRewardProcess(source) as proc:
        result = proc.score(["big", "small"], [{}] * 2)
    assert result.scores == [None, 1.0]
    assert result.errors[0].startswith("MemoryError")


_DAEMON = """
import os, time
def reward(completion, **row):
    r, w = os.pipe()
    first = os.fork()
    if first == 0:  # the intermediate child: fork the daemon, exit
        os.close(r)
        if os.fork() == 0:  # the daemon reports its own pid once it is what the test asks (after setsid)
            if completion == "setsid":
                os.setsid()
            os.write(w, str(os.getpid()).encode())
            os.close(w)
            while True:
                time.sleep(1)
        os._exit(0)
    os.close(w)
    pid = int(os.read(r, 64))
    os.waitpid(first, 0)
    return float(pid)
"""


def test_double_forked_daemon_does_not_survive_close():
    proc = PythonRewardProcess(_DAEMON)
    try:
        result = proc.score(["daemon"], [{}])
        daemon, holder = _host_pid(proc, int(result.scores[0])), proc.pid
        assert daemon not in (os.getpid(), holder)
        os.kill(daemon, 0)  # alive while the job runs
    finally:
        proc.close()
    assert _gone(holder)
    assert _gone(daemon)


def test_setsid_daemon_does_not_survive_close():
    """setsid() leaves the process group, not the pid namespace: killing its init kills the daemon."""
    proc = PythonRewardProcess(_DAEMON)
    daemon = None
    try:
        daemon = _host_pid(proc, int(proc.score(["setsid"], [{}]).scores[0]))
        assert os.getsid(daemon) != os.getsid(proc.pid)  # it did leave the session
        proc.close()
        assert _gone(daemon)  # the default 5 s: the namespace is torn down asynchronously, slower on a loaded machine
    finally:
        proc.close()
        if daemon and not _gone(daemon, wait_s=0):
            os.kill(daemon, signal.SIGKILL)


def test_source_that_fails_to_load_raises():
    with PythonRewardProcess("import numpy\ndef reward(c, **r):\n    return 1.0\n") as proc:
        with pytest.raises(RewardLoadError, match="ModuleNotFoundError: No module named 'numpy'"):
            proc.score(["a"], [{}])
        assert proc.pid is None
    with PythonRewardProcess("while True:\n    pass\ndef reward(c, **r):\n    return 1.0\n", timeout_s=0.3) as proc:
        with pytest.raises(RewardLoadError, match="took more than 0.3 s"):
            proc.score(["a"], [{}])
    with PythonRewardProcess("reward = 3\n") as proc:
        with pytest.raises(RewardLoadError, match="not defined or not callable"):
            proc.score(["a"], [{}])


def test_trainer_scorer_maps_failures_to_the_failure_score():
    torch = pytest.importorskip("torch")
    from service.schemas.rewards import NumericMatchReward, PythonReward
    from worker.trainer.rewards import SandboxScorer, make_scorer

    spec = PythonReward(source="def reward(completion, answer, **row):\n    return float(completion) / answer\n")
    scorer = make_scorer(spec)
    assert isinstance(scorer, SandboxScorer)
    try:
        scores = scorer.score(["1", "oops", "3"], [{"answer": 2}] * 3, failure_score=-1.0)
        assert scores.rewards.tolist() == [0.5, -1.0, 1.5]
        assert scores.rewards.dtype == torch.float32
        assert scores.errors == ["ValueError: could not convert string to float: 'oops'"]
        pid = scorer.process.pid
    finally:
        scorer.close()
    assert _gone(pid)

    builtin = make_scorer(NumericMatchReward())
    scores = builtin.score(["is 4", "is 5", "is 4"], [{"answer": 4}, {"answer": 4}, {}], failure_score=-1.0)
    assert scores.rewards.tolist() == [1.0, 0.0, -1.0]
    assert len(scores.errors) == 1 and scores.errors[0].startswith("KeyError")


def test_pool_splits_a_batch_in_order_and_fails_only_the_broken_chunk():
    source = """
import os
def reward(completion, **row):
    if completion == "crash":
        os._exit(3)
    return float(completion)
"""
    with PythonRewardPool(source, processes=3) as pool:
        first = pool.score([str(i) for i in range(10)], [{}] * 10)
        assert first.scores == [float(i) for i in range(10)] and first.errors == [None] * 10
        holders = {child.pid for child in pool.children}
        assert len(holders) == 3 and None not in holders  # three sandboxes

        mixed = pool.score(["1", "2", "3", "4", "crash", "6", "7", "8", "9"], [{}] * 9)  # chunks of 3
        assert mixed.scores == [1.0, 2.0, 3.0, None, None, None, 7.0, 8.0, 9.0]
        assert mixed.errors[3:6] == ["reward process died (exit code 3)"] * 3
        assert pool.score(["5"], [{}]).scores == [5.0]  # fewer rows than children
        assert pool.score([], []).scores == []
    assert all(child.pid is None for child in pool.children) and all(_gone(pid) for pid in holders)
