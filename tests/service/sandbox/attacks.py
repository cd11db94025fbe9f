"""What the sandbox containment tests share: the trainer stand-in, the leftovers check, one scored run.

Imported by tests/service/sandbox/test_containment.py and test_kernel.py
(the fixtures by name, so pytest finds them there).
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from pathlib import Path

import pytest

from service.sandbox import cgroup as sandbox_cgroup
from service.settings import get_settings
from worker.rewards.sandbox import PythonRewardProcess
from service.sandbox.spawn import members, sandbox_level

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


def _others(cgroup: Path) -> bool:
    """Whether the cgroup holds a process of another test process's sandboxes: a sandbox uid (the range's
    first is 100000 or more) outside this one's range (pytest-xdist workers have ranges of their own)."""
    try:
        pids = (cgroup / "cgroup.procs").read_text().split()
    except OSError:
        return False
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        uid_line = next((line for line in status.splitlines() if line.startswith("Uid:")), "Uid: 0")
        uid = int(uid_line.split()[1])
        if uid >= 100000 and uid not in SANDBOX_UIDS:
            return True
    return False


def _leftovers() -> dict[str, set]:
    return {
        "sandbox uid processes": _uid_processes(SANDBOX_UIDS),
        # Where this process's sandboxes make them (TMPDIR: /tmp, or a pytest-xdist worker's own directory).
        "workdirs": {p.name for p in Path(tempfile.gettempdir()).glob("cispo-reward-*")  # not the reward runner's
                     if not p.name.startswith("cispo-reward-test-")},  # homes: other checkouts' tests make those
        "cgroups": {str(c) for p in sandbox_cgroup.parents()[1] for c in p.glob("cispo-sandbox-*") if not _others(c)},
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
    # Left behind: what is new and stays, all of 5 s. Sandboxes that others (pytest-xdist workers, other checkouts)
    # start and end meanwhile come and go, one after another; each is dropped once it is seen gone.
    deadline = time.monotonic() + 5
    left = _new_since(before)
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        now = _new_since(before)
        left = {k: v & now[k] for k, v in left.items() if v & now.get(k, set())}
    assert left == {}, f"left behind: {left}"


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


@pytest.fixture
def fresh_settings():
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()
