"""User Python environments in the sandbox child: the protocol, per-episode failures, timeouts, cleanup."""

from __future__ import annotations

import threading
import time

import pytest

from service.schemas.environments import PythonEnvironment
from worker.envs.python_env import EnvironmentLoadError, PythonEnvironmentProcess
from service.sandbox.spawn import sandbox_level
from service.sandbox.channel import INTERRUPT, Interrupted

pytestmark = pytest.mark.skipif(sandbox_level() != "namespaces",
                                reason="this host cannot sandbox user code (sandbox_level() is 'none')")

COUNTER = '''
class Counter:
    """Counts to row['n']; reward 1 per step; misbehaves on request."""

    def reset(self, seed, row):
        print("user output must not reach the protocol")
        self.n, self.i, self.mode = row["n"], 0, row.get("mode")
        if self.mode == "reset_raises":
            raise RuntimeError("no reset today")
        if self.mode == "gymnasium":  # Gymnasium's (observation, info)
            return f"count to {self.n} (seed {seed})", {"seed": seed}
        return f"count to {self.n} (seed {seed})"

    def step(self, action):
        self.i += 1
        mode = self.mode
        if mode == "raises":
            raise ValueError("bad action " + action)
        if mode == "short_tuple":
            return ("obs", 1.0)
        if mode == "nan":
            return "obs", float("nan"), False, False, {}
        if mode == "text_reward":
            return "obs", "1", False, False, {}
        if mode == "bad_flag":
            return "obs", 1.0, "yes", False, {}
        if mode == "bad_observation":
            return 42, 1.0, False, False, {}
        if mode == "object_info":
            return "obs", 1.0, False, False, object()
        if mode == "hog":
            self.hoard = bytearray(2 << 30)
        if mode == "crash":
            import os
            os._exit(3)
        if mode == "hang":
            while True:
                pass
        done = self.i >= self.n
        return (None if done else [{"role": "user", "content": f"{self.i}"}]), 1.0, done, False, {"i": self.i}
'''


def env(**kw) -> PythonEnvironmentProcess:
    return PythonEnvironmentProcess(PythonEnvironment(source=COUNTER, class_name="Counter", **kw))


def test_episodes_are_separate_instances_and_follow_the_protocol():
    with env() as e:
        resets = e.reset([("a", 7, {"n": 2}), ("b", 8, {"n": 1})])
        assert [r.observation for r in resets] == ["count to 2 (seed 7)", "count to 1 (seed 8)"]
        assert all(r.error is None for r in resets)
        first = e.step([("a", "x"), ("b", "y")])
        assert first[0].observation == [{"role": "user", "content": "1"}] and not first[0].done
        assert first[1].terminated and first[1].observation is None and first[1].reward == 1.0
        pid = e.pid
        second = e.step([("a", "x")])
        assert second[0].terminated
        assert e.step([("a", "x")])[0].error.startswith("unknown or finished episode")
        e.release(["a", "b"])
        assert e.pid == pid  # one long-lived child per job
    assert e.pid is None


@pytest.mark.parametrize("mode, message", [
    ("raises", "ValueError: bad action x"),
    ("short_tuple", "step must return (observation, reward, terminated, truncated, info)"),
    ("nan", "JSON cannot carry"),
    ("text_reward", "reward must be a number"),
    ("bad_flag", "terminated must be a bool"),
    ("bad_observation", "observation must be a string or a non-empty list of chat messages"),
])
def test_a_failing_step_fails_only_its_episode(mode, message):
    with env() as e:
        e.reset([("bad", 0, {"n": 3, "mode": mode}), ("good", 0, {"n": 3})])
        bad, good = e.step([("bad", "x"), ("good", "x")])
        assert good.error is None and good.reward == 1.0
        assert bad.error is not None and message in bad.error, bad.error


def test_info_is_not_used_so_any_value_will_do():
    with env() as e:
        e.reset([("a", 0, {"n": 3, "mode": "object_info"})])
        assert e.step([("a", "x")])[0].error is None


def test_reset_errors_are_per_episode():
    with env() as e:
        bad, good = e.reset([("bad", 0, {"n": 1, "mode": "reset_raises"}), ("good", 0, {"n": 1})])
        assert "RuntimeError: no reset today" in bad.error and good.observation == "count to 1 (seed 0)"


def test_reset_may_return_gymnasium_s_observation_and_info():
    with env() as e:
        [outcome] = e.reset([("a", 4, {"n": 1, "mode": "gymnasium"})])
        assert outcome.error is None and outcome.observation == "count to 1 (seed 4)"


def test_a_hanging_step_times_out_and_the_next_batch_gets_a_new_child():
    with env(timeout_s=0.5) as e:
        e.reset([("hang", 0, {"n": 3, "mode": "hang"}), ("ok", 0, {"n": 3})])
        pid = e.pid
        hung, ok = e.step([("hang", "x"), ("ok", "x")])
        assert "timeout" in hung.error
        assert ok.error is None  # the cooperative timer stopped only the hanging call
        assert e.pid == pid
        e.reset([("next", 0, {"n": 1})])
        assert e.step([("next", "x")])[0].terminated


def test_an_interrupt_kills_a_running_batch_at_once():
    with env(timeout_s=60) as e:  # a batch deadline of a minute
        e.reset([("hang", 0, {"n": 3, "mode": "hang"})])
        sandbox = e.sandbox
        threading.Timer(0.5, INTERRUPT.set).start()  # what the job runner does on a cancel
        started = time.monotonic()
        try:
            with pytest.raises(Interrupted, match="^the job was cancelled while user code ran$"):
                e.step([("hang", "x")])
        finally:
            INTERRUPT.clear()
        assert time.monotonic() - started < 3
        assert sandbox.returncode is not None and sandbox.members() == {}  # nothing of it is left


def test_source_that_fails_to_load_is_a_job_error():
    spec = PythonEnvironment(source="raise SystemExit('nope')\nclass E:\n    def reset(self, s, r): pass\n"
                                    "    def step(self, a): pass\n", class_name="E")
    with PythonEnvironmentProcess(spec) as e, pytest.raises(EnvironmentLoadError, match="nope"):
        e.reset([("a", 0, {})])


def test_a_crashing_child_fails_its_batch_and_is_replaced():
    with env() as e:
        e.reset([("crash", 0, {"n": 3, "mode": "crash"}), ("ok", 0, {"n": 3})])
        pid = e.pid
        crashed, ok = e.step([("crash", "x"), ("ok", "x")])
        assert "died" in crashed.error and "died" in ok.error
        assert e.pid is None
        assert "restarted" in e.step([("ok", "x")])[0].error
        assert e.reset([("new", 0, {"n": 1})])[0].error is None and e.pid not in (None, pid)


def test_memory_is_capped_per_spec():
    with env(memory_mb=256) as e:
        e.reset([("hog", 0, {"n": 3, "mode": "hog"}), ("ok", 0, {"n": 3})])
        hog, ok = e.step([("hog", "x"), ("ok", "x")])
        assert "MemoryError" in hog.error and ok.error is None
