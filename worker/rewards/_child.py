"""The reward child: runs one job's user reward function, one batch at a time.

Started by worker/rewards/sandbox.py through service/sandbox/channel.py, as
``python -I -S -B -c <service/sandbox/child_bootstrap.py + this source>``,
inside a sandbox (service/sandbox/spawn.py), which has already set the
rlimits, the unprivileged uid, the namespaces and the private working
directory. The bootstrap frames the protocol and loads the source; this file
says what runs inside.
Standard library only: it must not import torch or project code (they are
not in its file system), and user code sees no site packages.

Protocol, one JSON object per line on private descriptors (see the bootstrap):

  parent: {"source": str, "entry_point": str, "timeout_s": float}
  child:  {"ok": true} | {"ok": false, "error": str}
  parent: {"completions": [str...], "rows": [{...}...], "cpu_s": float}
  child:  {"scores": [float|null...], "errors": [null|str...]}

Each call runs under a per-sample SIGALRM timer (cooperative; the parent's
wall-clock deadline is the hard limit). Values are converted with float()
here, so user objects never reach the parent.
"""

import json
import math
import numbers

# From service/sandbox/child_bootstrap.py, which runs first in the same program: CallTimeout, cpu_budget,
# guarded, run_child, send, user_namespace.


def _to_score(value):
    # worker/rewards/engine.py's as_score, copied: nothing outside the standard library reaches the sandbox.
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"returned {type(value).__name__}, not a number")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"returned {value}")
    return value


def load(init, timeout):
    """Exec the user source once; returns the entry point or raises."""
    fn = user_namespace(init["source"], "__reward__", timeout).get(init["entry_point"])
    if not callable(fn):
        raise NameError(f"entry point {init['entry_point']!r} is not defined or not callable")
    return fn


def _score(fn, completion, row):
    return _to_score(fn(completion, **row))


def serve(proto_in, proto_out, fn, timeout):
    while True:
        line = proto_in.readline()
        if not line:
            return  # the parent closed the pipe
        batch = json.loads(line)
        cpu_budget(float(batch.get("cpu_s", timeout * len(batch["rows"]))))
        scores, errors = [], []
        for completion, row in zip(batch["completions"], batch["rows"]):
            value, error = guarded(timeout, _score, fn, completion, row)
            scores.append(value)
            errors.append(error)
        send(proto_out, {"scores": scores, "errors": errors})


if __name__ == "__main__":
    run_child(load, serve)
