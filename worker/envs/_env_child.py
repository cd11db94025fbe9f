"""The environment child: hosts one job's user environment class, one instance per episode.

Started by worker/envs/python_env.py in a sandbox (worker/sandbox.py: its own
namespaces, uid, cgroup and seccomp filter, rlimits, a private capped tmpfs) as
``python -I -S -B -c <this source>``. Standard library only: it must not
import torch or project code.

Protocol, one JSON object per line on the original stdin/stdout, which are
moved to private descriptors before user code runs (user prints go to
/dev/null and cannot corrupt it):

  parent: {"source", "class_name", "timeout_s"}
  child:  {"ok": true} | {"ok": false, "error": str}
  parent: {"op": "reset", "episodes": [[id, seed, row]...], "cpu_s": float}
  child:  {"results": [{"observation": ...} | {"error": str} ...]}
  parent: {"op": "step", "episodes": [[id, action]...], "cpu_s": float}
  child:  {"results": [{"observation", "reward", "terminated", "truncated"} | {"error": str} ...]}
  parent: {"op": "release", "ids": [id...]}
  child:  {"ok": true}

Each user call (constructor + reset, or step) runs under a SIGALRM timer
(cooperative; the parent's wall-clock deadline is the hard limit). An
episode whose call fails is forgotten, as is one that terminated. Values
must survive json.dumps; the parent checks their types.
"""

import builtins
import json
import os
import resource
import signal
import sys

MAX_ERROR_CHARS = 500


class CallTimeout(BaseException):
    """Raised by the SIGALRM handler; a BaseException so `except Exception` in user code lets it through."""


def _on_alarm(signum, frame):
    raise CallTimeout


def _cpu_budget(seconds):
    usage = resource.getrusage(resource.RUSAGE_SELF)
    soft = int(usage.ru_utime + usage.ru_stime + seconds) + 1
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def _describe(exc):
    try:
        text = f"{type(exc).__name__}: {exc}"
    except BaseException:
        text = type(exc).__name__
    return text[:MAX_ERROR_CHARS]


def _private_protocol():
    proto_in = os.fdopen(os.dup(0), "rb")
    proto_out = os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    sys.stdin = open(os.devnull, "r")
    sys.stdout = open(os.devnull, "w")
    sys.stderr = open(os.devnull, "w")
    return proto_in, proto_out


def _send(out, message):
    out.write(json.dumps(message, allow_nan=False).encode() + b"\n")
    out.flush()


def _timed(timeout, fn, *args):
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        return fn(*args)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def _jsonable(answer, what):
    try:
        json.dumps(answer, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as e:
        raise TypeError(f"{what} returned a value JSON cannot carry ({_describe(e)})") from None
    return answer


def _reset(cls, seed, row):
    instance = cls()
    observation = instance.reset(seed, row)
    # Gymnasium's reset returns (observation, info); info is not used, as step's is not.
    if (isinstance(observation, tuple) and len(observation) == 2 and isinstance(observation[1], dict)
            and (observation[0] is None or isinstance(observation[0], (str, list)))):
        observation = observation[0]
    return instance, _jsonable({"observation": observation}, "reset")


def _step(instance, action):
    result = instance.step(action)
    if not isinstance(result, (tuple, list)) or len(result) != 5:
        raise TypeError("step must return (observation, reward, terminated, truncated, info), "
                        f"got {type(result).__name__}"
                        + (f" of length {len(result)}" if isinstance(result, (tuple, list)) else ""))
    observation, reward, terminated, truncated, _info = result
    answer = {"observation": observation, "reward": reward, "terminated": terminated, "truncated": truncated}
    return _jsonable(answer, "step")


def _guarded(timeout, fn, *args):
    """(value, None) or (None, error message): a user failure is the episode's, never the child's."""
    try:
        return _timed(timeout, fn, *args), None
    except CallTimeout:
        return None, f"timeout after {timeout:g} s"
    except BaseException as e:  # user code: SystemExit, KeyboardInterrupt, anything
        return None, _describe(e)


def _load(init):
    namespace = {"__name__": "__environment__", "__builtins__": builtins}
    code = compile(init["source"], "<environment>", "exec", dont_inherit=True)
    _timed(float(init["timeout_s"]), exec, code, namespace)
    cls = namespace.get(init["class_name"])
    if not isinstance(cls, type):
        raise NameError(f"class {init['class_name']!r} is not defined")
    return cls


def serve(proto_in, proto_out, cls, timeout):
    episodes = {}
    while True:
        line = proto_in.readline()
        if not line:
            return  # the parent closed the pipe
        request = json.loads(line)
        op = request["op"]
        if op == "release":
            for episode_id in request["ids"]:
                episodes.pop(episode_id, None)
            _send(proto_out, {"ok": True})
            continue
        _cpu_budget(float(request["cpu_s"]))
        results = []
        for item in request["episodes"]:
            episode_id = item[0]
            if op == "reset":
                value, error = _guarded(timeout, _reset, cls, item[1], item[2])
                if error is None:
                    episodes[episode_id], answer = value
            elif episode_id not in episodes:
                value, error = None, f"unknown or finished episode {episode_id!r}"
            else:
                answer, error = _guarded(timeout, _step, episodes[episode_id], item[1])
            if error is not None:
                episodes.pop(episode_id, None)
                results.append({"error": error})
                continue
            if op == "step" and (answer["terminated"] is True or answer["truncated"] is True):
                episodes.pop(episode_id, None)
            results.append(answer)
        _send(proto_out, {"results": results})


def main():
    proto_in, proto_out = _private_protocol()
    signal.signal(signal.SIGALRM, _on_alarm)
    init = json.loads(proto_in.readline())
    timeout = float(init["timeout_s"])
    _cpu_budget(timeout + 1)
    try:
        cls = _load(init)
    except CallTimeout:
        _send(proto_out, {"ok": False, "error": f"loading the source took more than {timeout:g} s"})
        return
    except BaseException as e:
        _send(proto_out, {"ok": False, "error": _describe(e)})
        return
    _send(proto_out, {"ok": True})
    serve(proto_in, proto_out, cls, timeout)


if __name__ == "__main__":
    main()
    os._exit(0)  # skip interpreter teardown: user atexit hooks and finalizers do not run
