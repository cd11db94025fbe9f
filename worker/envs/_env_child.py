"""The environment child: hosts one job's user environment class, one instance per episode.

Started by worker/envs/python_env.py through service/sandbox/channel.py in a
sandbox (service/sandbox/spawn.py: its own namespaces, uid, cgroup and seccomp
filter, rlimits, a private capped tmpfs) as
``python -I -S -B -c <service/sandbox/child_bootstrap.py + this source>``.
The bootstrap frames the protocol and loads the source; this file says what
runs inside. Standard library only: it must not import torch or project code.

Protocol, one JSON object per line on private descriptors (see the bootstrap):

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

import json

# From service/sandbox/child_bootstrap.py, which runs first in the same program: cpu_budget, describe,
# guarded, run_child, send, user_namespace.


def _jsonable(answer, what):
    try:
        json.dumps(answer, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as e:
        raise TypeError(f"{what} returned a value JSON cannot carry ({describe(e)})") from None
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


def load(init, timeout):
    cls = user_namespace(init["source"], "__environment__", timeout).get(init["class_name"])
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
            send(proto_out, {"ok": True})
            continue
        cpu_budget(float(request["cpu_s"]))
        results = []
        for item in request["episodes"]:
            episode_id = item[0]
            if op == "reset":
                value, error = guarded(timeout, _reset, cls, item[1], item[2])
                if error is None:
                    episodes[episode_id], answer = value
            elif episode_id not in episodes:
                value, error = None, f"unknown or finished episode {episode_id!r}"
            else:
                answer, error = guarded(timeout, _step, episodes[episode_id], item[1])
            if error is not None:
                episodes.pop(episode_id, None)
                results.append({"error": error})
                continue
            if op == "step" and (answer["terminated"] is True or answer["truncated"] is True):
                episodes.pop(episode_id, None)
            results.append(answer)
        send(proto_out, {"results": results})


if __name__ == "__main__":
    run_child(load, serve)
