"""The reward child: runs one job's user reward function, one batch at a time.

Started by worker/rewards/sandbox.py as ``python -I -S -B -c <this source>``
inside a sandbox (worker/sandbox.py), which has already set the rlimits,
the unprivileged uid, the namespaces and the private working directory.
Standard library only: it must not import torch or project code (they are
not in its file system), and user code sees no site packages.

Protocol, one JSON object per line on the original stdin/stdout, which are
moved to private descriptors before any user code runs (fds 0-2 and
sys.stdin/stdout/stderr then point at /dev/null, so user prints cannot
corrupt it):

  parent: {"source": str, "entry_point": str, "timeout_s": float}
  child:  {"ok": true} | {"ok": false, "error": str}
  parent: {"completions": [str...], "rows": [{...}...], "cpu_s": float}
  child:  {"scores": [float|null...], "errors": [null|str...]}

Each call runs under a per-sample SIGALRM timer (cooperative; the parent's
wall-clock deadline is the hard limit). Values are converted with float()
here, so user objects never reach the parent.
"""

import builtins
import json
import math
import numbers
import os
import resource
import signal
import sys

MAX_ERROR_CHARS = 500

class SampleTimeout(BaseException):
    """Raised by the SIGALRM handler; a BaseException so `except Exception` in user code lets it through."""


def _on_alarm(signum, frame):
    raise SampleTimeout


def _cpu_budget(seconds):
    """Let the coming batch use `seconds` more CPU time; the soft limit's SIGXCPU kills the child beyond it."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    soft = int(usage.ru_utime + usage.ru_stime + seconds) + 1
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def _describe(exc):
    try:
        text = f"{type(exc).__name__}: {exc}"
    except BaseException:  # a user exception whose __str__ fails
        text = type(exc).__name__
    return text[:MAX_ERROR_CHARS]


def _to_score(value):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"returned {type(value).__name__}, not a number")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"returned {value}")
    return value


def _private_protocol():
    """Move the protocol to private fds; point 0-2 and sys.std* at /dev/null."""
    proto_in = os.fdopen(os.dup(0), "rb")  # os.dup gives non-inheritable fds: exec'd programs do not get them
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


def _load(init):
    """Exec the user source once; returns the entry point or raises."""
    namespace = {"__name__": "__reward__", "__builtins__": builtins}
    code = compile(init["source"], "<reward>", "exec", dont_inherit=True)
    timeout = float(init["timeout_s"])
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        exec(code, namespace)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    fn = namespace.get(init["entry_point"])
    if not callable(fn):
        raise NameError(f"entry point {init['entry_point']!r} is not defined or not callable")
    return fn


def _score_one(fn, completion, row, timeout):
    try:
        signal.setitimer(signal.ITIMER_REAL, timeout)
        try:
            return _to_score(fn(completion, **row)), None
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except SampleTimeout:
        return None, f"timeout after {timeout:g} s"
    except BaseException as e:  # user code: SystemExit, KeyboardInterrupt, anything is the sample's
        return None, _describe(e)


def main():
    proto_in, proto_out = _private_protocol()
    signal.signal(signal.SIGALRM, _on_alarm)
    init = json.loads(proto_in.readline())
    timeout = float(init["timeout_s"])
    _cpu_budget(timeout + 1)

    try:
        fn = _load(init)
    except SampleTimeout:
        _send(proto_out, {"ok": False, "error": f"loading the source took more than {timeout:g} s"})
        return
    except BaseException as e:
        _send(proto_out, {"ok": False, "error": _describe(e)})
        return
    _send(proto_out, {"ok": True})

    while True:
        line = proto_in.readline()
        if not line:
            return  # the parent closed the pipe
        batch = json.loads(line)
        _cpu_budget(float(batch.get("cpu_s", timeout * len(batch["rows"]))))
        scores, errors = [], []
        for completion, row in zip(batch["completions"], batch["rows"]):
            value, error = _score_one(fn, completion, row, timeout)
            scores.append(value)
            errors.append(error)
        _send(proto_out, {"scores": scores, "errors": errors})


if __name__ == "__main__":
    main()
    # Skip interpreter teardown: user atexit hooks and finalizers do not run.
    os._exit(0)
