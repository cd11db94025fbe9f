"""What every JSON-lines sandbox child runs before and around its own part. Standard library only.

Not imported: service/sandbox/channel.py puts this source in front of the
child's (worker/rewards/_child.py, worker/envs/_env_child.py) and runs the two
as one ``python -I -S -B -c`` program, since an isolated interpreter in the
sandbox's root has no path to project modules. The child defines
``load(init, timeout)`` (the user's entry point, from ``user_namespace``) and
``serve(proto_in, proto_out, loaded, timeout)``, then calls
``run_child(load, serve)``.

Protocol framing, one JSON object per line on the original stdin/stdout,
moved to private descriptors before any user code runs (fds 0-2 and
sys.stdin/stdout/stderr then point at /dev/null, so user prints cannot
corrupt it):

  parent: {..., "timeout_s": float}          (the child's init message)
  child:  {"ok": true} | {"ok": false, "error": str}
  then the child's own requests and answers.

Each user call runs under a SIGALRM timer (``guarded``; cooperative, the
parent's wall-clock deadline is the hard limit) and each batch under an
RLIMIT_CPU budget (``cpu_budget``).
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


def cpu_budget(seconds):
    """Let the coming batch use `seconds` more CPU time; the soft limit's SIGXCPU kills the child beyond it."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    soft = int(usage.ru_utime + usage.ru_stime + seconds) + 1
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def describe(exc):
    try:
        text = f"{type(exc).__name__}: {exc}"
    except BaseException:  # a user exception whose __str__ fails
        text = type(exc).__name__
    return text[:MAX_ERROR_CHARS]


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


def send(out, message):
    out.write(json.dumps(message, allow_nan=False).encode() + b"\n")
    out.flush()


def timed(timeout, fn, *args):
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        return fn(*args)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def guarded(timeout, fn, *args):
    """(value, None) or (None, error message): a user failure is the call's, never the child's."""
    try:
        return timed(timeout, fn, *args), None
    except CallTimeout:
        return None, f"timeout after {timeout:g} s"
    except BaseException as e:  # user code: SystemExit, KeyboardInterrupt, anything
        return None, describe(e)


def user_namespace(source, name, timeout):
    """Exec the user's source once, under the timer, as module `name`; returns its namespace."""
    namespace = {"__name__": name, "__builtins__": builtins}
    code = compile(source, f"<{name.strip('_')}>", "exec", dont_inherit=True)
    timed(timeout, exec, code, namespace)
    return namespace


def run_child(load, serve):
    """Read the init message, load the user's code (answering ok or the error), then serve until EOF."""
    proto_in, proto_out = _private_protocol()
    signal.signal(signal.SIGALRM, _on_alarm)
    init = json.loads(proto_in.readline())
    timeout = float(init["timeout_s"])
    cpu_budget(timeout + 1)
    try:
        loaded = load(init, timeout)
    except CallTimeout:
        send(proto_out, {"ok": False, "error": f"loading the source took more than {timeout:g} s"})
    except BaseException as e:
        send(proto_out, {"ok": False, "error": describe(e)})
    else:
        send(proto_out, {"ok": True})
        serve(proto_in, proto_out, loaded, timeout)
    os._exit(0)  # skip interpreter teardown: user atexit hooks and finalizers do not run
